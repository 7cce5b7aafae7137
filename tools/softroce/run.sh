#!/usr/bin/env bash
# FerroCCL's soft-RoCE harness: run a program against a real RDMA verbs stack (the Linux
# kernel's rdma_rxe driver) on a host whose own kernel has no RDMA support.
#
#   bash tools/softroce/run.sh setup                       # apt packages + VM kernel, cached
#   bash tools/softroce/run.sh test [--timeout S] BIN [ARGS...]
#
# `test` boots Debian's stock kernel in qemu (KVM when /dev/kvm is real hardware
# virtualization, else TCG), with the host's / shared read-only over virtio-9p as the
# guest's userland, creates the rxe device `rxe0` on a veth inside the guest and runs
# BIN ARGS there with FERROCCL_IB_DEV, FERROCCL_IB_GID_INDEX and FERROCCL_IB_IP set. It
# exits with BIN's exit status, 124 on timeout, 125 when the harness itself failed.
#
# Knobs: FERROCCL_SOFTROCE_CACHE (default <repo>/target/softroce),
#        FERROCCL_SOFTROCE_TIMEOUT (seconds, default 600), FERROCCL_SOFTROCE_MEM (2G),
#        FERROCCL_SOFTROCE_SMP (number of host cores), FERROCCL_SOFTROCE_ACCEL (auto|tcg|kvm),
#        FERROCCL_SOFTROCE_KPKG (kernel package; default: what linux-image-amd64 depends on).
# See README.md next to this file for costs and pitfalls.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
CACHE="${FERROCCL_SOFTROCE_CACHE:-$REPO/target/softroce}"
TIMEOUT="${FERROCCL_SOFTROCE_TIMEOUT:-600}"

# Kernel modules the guest loads (their dependencies are added by modprobe --show-depends).
# crc32_generic: rxe's ICRC needs the "crc32" crypto hash; without it `rdma link add`
# fails with "No such file or directory".
# virtio_net: the NIC of `pair` mode.
MODULES=(virtio_pci 9pnet_virtio 9p overlay crc32_generic veth virtio_net rdma_rxe ib_uverbs rdma_ucm)
HOST_PKGS=(qemu-system-x86 busybox-static kmod cpio xz-utils zstd iproute2 rdma-core
    ibverbs-providers ibverbs-utils perftest)
BUILD_PKGS=(libibverbs-dev librdmacm-dev libclang-dev pkg-config)

log() { printf '[softroce %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "FAILED: $*"; exit 125; }
CLEANUP=()
trap 'rm -rf "${CLEANUP[@]}"' EXIT
secs() { echo $(( $(date +%s) - $1 )); }

# ensure_pkgs PKG...: install the packages that are not installed yet.
ensure_pkgs() {
    local missing=() p
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    [ "$(id -u)" = 0 ] || die "missing packages ${missing[*]}: install them as root (apt-get install ${missing[*]})"
    log "apt-get install ${missing[*]}"
    if [ -z "${SOFTROCE_APT_UPDATED:-}" ]; then
        apt-get update -qq || die "apt-get update"
        SOFTROCE_APT_UPDATED=1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
        || die "apt-get install ${missing[*]}"
}

# The cache holds only what a boot needs: vmlinuz, the guest's modules (decompressed,
# in load order) and a stamp naming the kernel. The initramfs is packed per run (<1 s),
# so edits to guest-init.sh take effect without a new setup.
cache_ready() {
    [ -f "$CACHE/kernel-version" ] && [ -f "$CACHE/vmlinuz" ] && [ -f "$CACHE/modules/load-order" ] \
        && [ "$(cat "$CACHE/modules/wanted" 2>/dev/null)" = "${MODULES[*]}" ]
}

do_setup() {
    local t0; t0=$(date +%s)
    ensure_pkgs "${HOST_PKGS[@]}" "${BUILD_PKGS[@]}"
    log "packages ready ($(secs "$t0") s)"
    local pkg="${FERROCCL_SOFTROCE_KPKG:-}"
    if [ -z "$pkg" ]; then
        pkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-/{print $2; exit}')
        if [ -z "$pkg" ]; then
            apt-get update -qq || die "apt-get update"
            pkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-/{print $2; exit}')
        fi
        [ -n "$pkg" ] || die "cannot find the kernel package linux-image-amd64 depends on (apt-cache depends linux-image-amd64)"
    fi
    local kv="${pkg#linux-image-}"
    if cache_ready && [ "$(cat "$CACHE/kernel-version")" = "$kv" ]; then
        log "kernel $kv already cached in $CACHE ($(secs "$t0") s)"
        return 0
    fi
    local tmp; tmp=$(mktemp -d "${TMPDIR:-/tmp}/ferroccl-softroce.XXXXXX")
    CLEANUP+=("$tmp")
    (cd "$tmp" && apt-get download "$pkg" >/dev/null 2>"$tmp/apt.err") \
        || { cat "$tmp/apt.err" >&2; die "apt-get download $pkg"; }
    local deb; deb=$(ls "$tmp"/*.deb)
    log "downloaded $(basename "$deb") ($(du -h "$deb" | cut -f1))"
    mkdir -p "$tmp/root"
    dpkg-deb -x "$deb" "$tmp/root" || die "dpkg-deb -x $deb"
    grep -q '^CONFIG_RDMA_RXE=[my]' "$tmp/root/boot/config-$kv" || die "kernel $kv has no CONFIG_RDMA_RXE"
    # Debian 12 keeps modules under /lib/modules (a real dir in the .deb); newer ones use /usr/lib.
    local mroot="$tmp/root"; [ -d "$tmp/root/lib/modules/$kv" ] || mroot="$tmp/root/usr"
    depmod -b "$mroot" "$kv" || die "depmod -b $mroot $kv"
    rm -rf "$CACHE/modules"; mkdir -p "$CACHE/modules"
    local m kw path args base seen=" "
    for m in "${MODULES[@]}"; do
        local deps; deps=$(modprobe -d "$mroot" -S "$kv" --show-depends "$m") || die "modprobe --show-depends $m (kernel $kv)"
        while read -r kw path args; do
            [ "$kw" = insmod ] || continue
            base=$(basename "$path"); base=${base%.xz}; base=${base%.zst}; base=${base%.gz}
            case "$seen" in *" $base "*) continue ;; esac
            seen="$seen$base "
            case "$path" in
                *.ko) cp "$path" "$CACHE/modules/$base" ;;
                *.ko.xz) xz -dc "$path" > "$CACHE/modules/$base" ;;
                *.ko.zst) zstd -qdc "$path" > "$CACHE/modules/$base" ;;
                *.ko.gz) gzip -dc "$path" > "$CACHE/modules/$base" ;;
            esac || die "extracting module $path"
            echo "$base $args" >> "$CACHE/modules/load-order"
        done <<< "$deps"
    done
    echo "${MODULES[*]}" > "$CACHE/modules/wanted"
    cp "$tmp/root/boot/vmlinuz-$kv" "$CACHE/vmlinuz" || die "no vmlinuz-$kv in $deb"
    echo "$kv" > "$CACHE/kernel-version"
    log "cached kernel $kv + $(wc -l < "$CACHE/modules/load-order") modules in $CACHE ($(du -sh "$CACHE" | cut -f1)); setup took $(secs "$t0") s"
}

pick_accel() {
    # A /dev/kvm backed by PVM (module kvm_pvm) cannot boot a stock kernel: use TCG there.
    local accel="${FERROCCL_SOFTROCE_ACCEL:-auto}"
    if [ "$accel" = auto ]; then
        if [ -d /sys/module/kvm_pvm ] || ! [ -w /dev/kvm ]; then accel=tcg; else accel=kvm; fi
    fi
    case "$accel" in
        kvm) ACCEL=(-enable-kvm -cpu host) ;;
        tcg) ACCEL=(-accel tcg,thread=multi -cpu max) ;;
        *) die "FERROCCL_SOFTROCE_ACCEL must be auto, tcg or kvm, not '$accel'" ;;
    esac
    ACCEL_NAME=$accel
}

# prepare_run: checks the tools, packs the initramfs (static busybox, our /init, the cached
# modules) into a fresh run directory, whose path it prints.
prepare_run() {
    cache_ready || { log "no VM cache in $CACHE (or an older module list): running setup first"; do_setup >&2; }
    command -v qemu-system-x86_64 >/dev/null || die "qemu-system-x86_64 not found: run 'bash tools/softroce/run.sh setup'"
    [ -x /bin/busybox ] || die "/bin/busybox not found: run 'bash tools/softroce/run.sh setup'"
    mkdir -p "$CACHE/runs"
    local run; run=$(mktemp -d "$CACHE/runs/run.XXXXXX")
    mkdir -p "$run/initramfs"/{bin,dev,proc,sys,tmp}
    cp /bin/busybox "$run/initramfs/bin/busybox"
    cp -r "$CACHE/modules" "$run/initramfs/modules"
    install -m 755 "$HERE/guest-init.sh" "$run/initramfs/init"
    (cd "$run/initramfs" && find . -print0 | cpio --null -o -H newc --quiet | gzip -1 > "$run/initramfs.gz") \
        || die "packing the initramfs"
    echo "$run"
}

# write_cmd FILE GUEST_SCRIPT BINARY [ARGS...]: the command a guest runs: the host's
# environment knobs, the cwd, then GUEST_SCRIPT (guest.sh or guest-pair.sh) with BINARY.
write_cmd() {
    local file=$1 guest=$2; shift 2
    {
        echo '#!/bin/bash'
        local v
        for v in $(compgen -e | grep -E '^(FERROCCL_|RUST_|PATH$|HOME$|LANG$)' || true); do
            printf 'export %s=%q\n' "$v" "${!v}"
        done
        printf 'cd %q 2>/dev/null || cd /\n' "$PWD"
        printf 'exec /bin/bash %q' "$HERE/$guest"; printf ' %q' "$@"; echo
    } > "$file"
    chmod 755 "$file"
}

# boot RUN CMD_FILE CONSOLE_LOG SMP [QEMU_ARGS...]: boots one VM running CMD_FILE; prints
# the console; returns the command's exit status (124 on timeout, 125 if none reported).
boot() {
    local run=$1 cmd=$2 console=$3 smp=$4; shift 4
    local rc=0 qrc grc
    set +e
    timeout --kill-after=10 "$TIMEOUT" qemu-system-x86_64 "${ACCEL[@]}" \
        -m "${FERROCCL_SOFTROCE_MEM:-2G}" -smp "$smp" \
        -nodefaults -no-reboot -display none -monitor none -serial stdio \
        -kernel "$CACHE/vmlinuz" -initrd "$run/initramfs.gz" \
        -append "console=ttyS0 panic=-1 quiet loglevel=3 softroce.cmd=$cmd" \
        -virtfs "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap" \
        "$@" </dev/null 2>&1 | tr -d '\r' > "$console"
    qrc=${PIPESTATUS[0]}
    set -e
    grc=$(sed -n 's/^FERROCCL-SOFTROCE-EXIT=\([0-9][0-9]*\)$/\1/p' "$console" | tail -1)
    if [ "$qrc" = 124 ] || [ "$qrc" = 137 ]; then
        log "TIMEOUT: the VM was killed after ${TIMEOUT} s"; rc=124
    elif [ -z "$grc" ]; then
        log "FAILED: the VM stopped (qemu exit status $qrc) without reporting the command's exit status"; rc=125
    else
        rc=$grc
    fi
    return "$rc"
}

# abs_bin BINARY: an absolute path for a BINARY given with a directory part.
abs_bin() {
    local bin=$1
    if [[ "$bin" == */* ]]; then
        [ -x "$bin" ] || die "$bin is not an executable file"
        bin="$(cd "$(dirname "$bin")" && pwd)/$(basename "$bin")"   # absolute, symlinks kept
    fi
    echo "$bin"
}

do_test() {
    if [ "${1:-}" = --timeout ]; then TIMEOUT="${2:?--timeout needs seconds}"; shift 2; fi
    [ $# -ge 1 ] || die "usage: run.sh test [--timeout SECS] BINARY [ARGS...]"
    local bin; bin=$(abs_bin "$1"); shift
    pick_accel
    local t0; t0=$(date +%s)
    local run; run=$(prepare_run)
    CLEANUP+=("$run")
    write_cmd "$run/cmd.sh" guest.sh "$bin" "$@"
    log "booting $(cat "$CACHE/kernel-version") ($ACCEL_NAME, timeout ${TIMEOUT} s): $bin $*"
    local rc=0
    (boot "$run" "$run/cmd.sh" "$run/console.log" "${FERROCCL_SOFTROCE_SMP:-$(nproc)}") & local pid=$!
    tail -n +1 -s 0.1 -F --pid="$pid" "$run/console.log" 2>/dev/null & local tpid=$!
    wait "$pid" || rc=$?
    wait "$tpid" 2>/dev/null || true
    log "exit status $rc after $(secs "$t0") s"
    return "$rc"
}

# do_pair [--timeout SECS] BINARY [ARGS...]: two VMs, "a" (192.0.2.1) and "b" (192.0.2.2),
# each with one virtio NIC; the two NICs are joined by qemu's UDP socket netdev on the
# host's 127.0.0.1 and to nothing else. Each guest runs guest-pair.sh (rxe0 on its NIC),
# then BINARY with FERROCCL_SOFTROCE_ROLE=a|b and FERROCCL_SOFTROCE_PEER_IP. The exit
# status is a's if it failed, else b's.
do_pair() {
    if [ "${1:-}" = --timeout ]; then TIMEOUT="${2:?--timeout needs seconds}"; shift 2; fi
    [ $# -ge 1 ] || die "usage: run.sh pair [--timeout SECS] BINARY [ARGS...]"
    local bin; bin=$(abs_bin "$1"); shift
    pick_accel
    local t0; t0=$(date +%s)
    local run; run=$(prepare_run)
    CLEANUP+=("$run")
    FERROCCL_SOFTROCE_ROLE=a FERROCCL_SOFTROCE_IP=192.0.2.1 FERROCCL_SOFTROCE_PEER_IP=192.0.2.2 \
        write_cmd "$run/cmd-a.sh" guest-pair.sh "$bin" "$@"
    FERROCCL_SOFTROCE_ROLE=b FERROCCL_SOFTROCE_IP=192.0.2.2 FERROCCL_SOFTROCE_PEER_IP=192.0.2.1 \
        write_cmd "$run/cmd-b.sh" guest-pair.sh "$bin" "$@"
    local pa pb; pa=$(( 20000 + RANDOM % 20000 )); pb=$(( pa + 1 ))
    # Two emulated machines on the host's cores: one vCPU each.
    local smp="${FERROCCL_SOFTROCE_SMP:-1}"
    log "pair: booting VM a (192.0.2.1) and VM b (192.0.2.2), NICs joined over udp 127.0.0.1:$pa <-> :$pb ($ACCEL_NAME, timeout ${TIMEOUT} s): $bin $*"
    touch "$run/console-a.log" "$run/console-b.log"
    (boot "$run" "$run/cmd-a.sh" "$run/console-a.log" "$smp" \
        -netdev "socket,id=n0,udp=127.0.0.1:$pb,localaddr=127.0.0.1:$pa" \
        -device virtio-net-pci,netdev=n0,mac=52:54:00:12:34:01) & local pid_a=$!
    (boot "$run" "$run/cmd-b.sh" "$run/console-b.log" "$smp" \
        -netdev "socket,id=n0,udp=127.0.0.1:$pa,localaddr=127.0.0.1:$pb" \
        -device virtio-net-pci,netdev=n0,mac=52:54:00:12:34:02) & local pid_b=$!
    tail -n +1 -s 0.1 -F --pid="$pid_a" "$run/console-a.log" 2>/dev/null | sed -u 's/^/[a] /' & local ta=$!
    tail -n +1 -s 0.1 -F --pid="$pid_b" "$run/console-b.log" 2>/dev/null | sed -u 's/^/[b] /' & local tb=$!
    local ra=0 rb=0
    wait "$pid_a" || ra=$?
    wait "$pid_b" || rb=$?
    wait "$ta" "$tb" 2>/dev/null || true
    log "pair: VM a exit status $ra, VM b exit status $rb, after $(secs "$t0") s"
    [ "$ra" -ne 0 ] && return "$ra"
    return "$rb"
}

case "${1:-}" in
    setup) do_setup ;;
    test) shift; do_test "$@" ;;
    pair) shift; do_pair "$@" ;;
    *) echo "usage: bash tools/softroce/run.sh setup | test|pair [--timeout SECS] BINARY [ARGS...]" >&2; exit 2 ;;
esac
