#!/bin/busybox sh
# /init of the soft-RoCE VM's initramfs (PID 1 in the guest, busybox only). Loads the
# modules in /modules/load-order, mounts the host's / (virtio-9p, read-only) under a
# tmpfs overlay, chroots into it and runs the script named by softroce.cmd= on the
# kernel command line, then prints FERROCCL-SOFTROCE-EXIT=<status> and powers off.
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev

finish() {
    echo "FERROCCL-SOFTROCE-EXIT=$1"
    poweroff -f
}

while read -r mod args; do
    # shellcheck disable=SC2086
    insmod "/modules/$mod" $args 2>/tmp/insmod.err \
        || grep -q 'File exists' /tmp/insmod.err \
        || { echo "softroce-vm: insmod $mod FAILED: $(cat /tmp/insmod.err)"; finish 125; }
done < /modules/load-order

CMD=""
for a in $(cat /proc/cmdline); do
    case "$a" in softroce.cmd=*) CMD="${a#softroce.cmd=}" ;; esac
done
[ -n "$CMD" ] || { echo "softroce-vm: no softroce.cmd= on the kernel command line"; finish 125; }

mkdir -p /lower /rw /host
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=262144,cache=loose hostroot /lower \
    || { echo "softroce-vm: mounting the host's / over virtio-9p FAILED"; finish 125; }
# Writes in the guest go to a tmpfs (the overlay's upper layer) and are lost at power-off;
# the host's files, /tmp included, stay visible (test binaries may live anywhere).
mount -t tmpfs -o mode=755 tmpfs /rw
mkdir -p /rw/upper /rw/work
mount -t overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work overlay /host \
    || { echo "softroce-vm: overlay mount FAILED"; finish 125; }
mount -t proc proc /host/proc
mount -t sysfs sysfs /host/sys
mount -t devtmpfs devtmpfs /host/dev
mkdir -p /host/dev/pts /host/dev/shm
mount -t devpts devpts /host/dev/pts
mount -t tmpfs tmpfs /host/dev/shm
mount -t tmpfs tmpfs /host/run
hostname softroce-vm

chroot /host /usr/bin/env -i HOME=/root LANG=C.UTF-8 \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin /bin/bash "$CMD"
rc=$?
sync
finish "$rc"
