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
MODULES=(virtio_pci 9pnet_virtio 9p overlay crc32_generic veth rdma_rxe ib_uverbs rdma_ucm)
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
cache_ready() { [ -f "$CACHE/kernel-version" ] && [ -f "$CACHE/vmlinuz" ] && [ -f "$CACHE/modules/load-order" ]; }

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

do_test() {
    if [ "${1:-}" = --timeout ]; then TIMEOUT="${2:?--timeout needs seconds}"; shift 2; fi
    [ $# -ge 1 ] || die "usage: run.sh test [--timeout SECS] BINARY [ARGS...]"
    local bin=$1; shift
    if [[ "$bin" == */* ]]; then
        [ -x "$bin" ] || die "$bin is not an executable file"
        bin="$(cd "$(dirname "$bin")" && pwd)/$(basename "$bin")"   # absolute, symlinks kept
    fi
    cache_ready || { log "no VM cache in $CACHE: running setup first"; do_setup; }
    command -v qemu-system-x86_64 >/dev/null || die "qemu-system-x86_64 not found: run 'bash tools/softroce/run.sh setup'"
    [ -x /bin/busybox ] || die "/bin/busybox not found: run 'bash tools/softroce/run.sh setup'"
    pick_accel

    local t0; t0=$(date +%s)
    mkdir -p "$CACHE/runs"
    local run; run=$(mktemp -d "$CACHE/runs/run.XXXXXX")
    CLEANUP+=("$run")
    # initramfs: static busybox, our /init, the cached modules
    mkdir -p "$run/initramfs"/{bin,dev,proc,sys,tmp}
    cp /bin/busybox "$run/initramfs/bin/busybox"
    cp -r "$CACHE/modules" "$run/initramfs/modules"
    install -m 755 "$HERE/guest-init.sh" "$run/initramfs/init"
    (cd "$run/initramfs" && find . -print0 | cpio --null -o -H newc --quiet | gzip -1 > "$run/initramfs.gz") \
        || die "packing the initramfs"
    # The command the guest runs: the host's environment knobs, the cwd, then guest.sh.
    {
        echo '#!/bin/bash'
        local v
        for v in $(compgen -e | grep -E '^(FERROCCL_|RUST_|PATH$|HOME$|LANG$)' || true); do
            printf 'export %s=%q\n' "$v" "${!v}"
        done
        printf 'cd %q 2>/dev/null || cd /\n' "$PWD"
        printf 'exec /bin/bash %q %q' "$HERE/guest.sh" "$bin"; [ $# -eq 0 ] || printf ' %q' "$@"; echo
    } > "$run/cmd.sh"
    chmod 755 "$run/cmd.sh"

    log "booting $(cat "$CACHE/kernel-version") ($ACCEL_NAME, timeout ${TIMEOUT} s): $bin $*"
    local rc=0
    set +e
    timeout --kill-after=10 "$TIMEOUT" qemu-system-x86_64 "${ACCEL[@]}" \
        -m "${FERROCCL_SOFTROCE_MEM:-2G}" -smp "${FERROCCL_SOFTROCE_SMP:-$(nproc)}" \
        -nodefaults -no-reboot -display none -monitor none -serial stdio \
        -kernel "$CACHE/vmlinuz" -initrd "$run/initramfs.gz" \
        -append "console=ttyS0 panic=-1 quiet loglevel=3 softroce.cmd=$run/cmd.sh" \
        -virtfs "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap" \
        </dev/null 2>&1 | tr -d '\r' | tee "$run/console.log"
    local qrc=${PIPESTATUS[0]}
    set -e
    local grc; grc=$(sed -n 's/^FERROCCL-SOFTROCE-EXIT=\([0-9][0-9]*\)$/\1/p' "$run/console.log" | tail -1)
    if [ "$qrc" = 124 ] || [ "$qrc" = 137 ]; then
        log "TIMEOUT: the VM was killed after ${TIMEOUT} s"; rc=124
    elif [ -z "$grc" ]; then
        log "FAILED: the VM stopped (qemu exit status $qrc) without reporting the command's exit status"; rc=125
    else
        rc=$grc
    fi
    log "exit status $rc after $(secs "$t0") s"
    return "$rc"
}

case "${1:-}" in
    setup) do_setup ;;
    test) shift; do_test "$@" ;;
    *) echo "usage: bash tools/softroce/run.sh setup | test [--timeout SECS] BINARY [ARGS...]" >&2; exit 2 ;;
esac
