#!/usr/bin/env bash
# Time from a cut link to the error on every rank (issue 17's "cut link" row): ranks in two
# network namespaces joined by a veth link (rank r in namespace r % 2, tcp between them, shm
# within one, one FERROCCL_HOST_ID per namespace, launched as torchrun launches them), all
# looping on `ferroccl-selftest kill --victim 999 --during D` (no victim: nobody dies);
# the link is taken down 2 + CUT s after the launch (no FIN, no RST: the frames just stop).
# Per rank: when it ended after the cut, and the error it printed (which peer it names).
# Needs root (ip netns).
#
#   sudo bash benches/cut_link.sh [BIN_DIR] [--ranks "2 4 8"] [--during allreduce]
#                                 [--timeout 4] [--cut 1.5] [--runs 2]
#
# BIN_DIR holds ferroccl-selftest (default target/release, built when missing). A rank
# that waits on a silent peer should fail at about FERROCCL_TIMEOUT (--timeout) after the
# cut; one whose own peers are alive may fail sooner (told by them) or at its own timeout.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=target/release
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then bin="$1"; shift; fi
ranks="2 4 8"; during=allreduce; timeout=4; cut=1.5; runs=2
while [ $# -gt 0 ]; do
    case "$1" in
        --ranks) ranks="$2"; shift 2 ;;
        --during) during="$2"; shift 2 ;;
        --timeout) timeout="$2"; shift 2 ;;
        --cut) cut="$2"; shift 2 ;;
        --runs) runs="$2"; shift 2 ;;
        *) echo "unknown option $1" >&2; exit 2 ;;
    esac
done
if [ ! -x "$bin/ferroccl-selftest" ]; then cargo build --release -p ferroccl-run >&2; fi
bin=$(cd "$bin" && pwd)

tag="fcut$$"; ns0="$tag-0"; ns1="$tag-1"; dir=$(mktemp -d)
cleanup() {
    for n in "$ns0" "$ns1"; do
        ip netns pids "$n" 2> /dev/null | xargs -r kill -KILL 2> /dev/null || true
        ip netns del "$n" 2> /dev/null || true
    done
    rm -rf "$dir"
}
trap cleanup EXIT
for n in "$ns0" "$ns1"; do ip netns add "$n"; ip -n "$n" link set lo up; done
ip -n "$ns0" link add br0 type bridge
ip -n "$ns0" link set br0 up
ip -n "$ns0" addr add 10.77.0.1/24 dev br0
ip -n "$ns0" link add h1 type veth peer name v1 netns "$ns1"
ip -n "$ns0" link set h1 master br0 up
ip -n "$ns1" addr add 10.77.0.2/24 dev v1
ip -n "$ns1" link set v1 up
now() { date +%s.%N; }

printf '%-5s %-4s %-5s %-9s %s\n' ranks run rank "after cut" "error"
for n in $ranks; do
    for run in $(seq 1 "$runs"); do
        port=$((32000 + RANDOM % 2000))
        rm -f "$dir"/end.* "$dir"/out.*
        for r in $(seq 0 $((n - 1))); do
            (
                env -i PATH="$PATH" RANK=$r WORLD_SIZE=$n MASTER_ADDR=10.77.0.1 MASTER_PORT=$port \
                    TORCHELASTIC_RUN_ID="$tag-$n-$run" FERROCCL_TOKEN="$tag-token" FERROCCL_HOST_ID="ns-$((r % 2))" \
                    FERROCCL_TIMEOUT="$timeout" FERROCCL_FLIGHT_RECORDER=off \
                    ip netns exec "$tag-$((r % 2))" "$bin/ferroccl-selftest" kill --victim 999 --during "$during" \
                    > "$dir/out.$r" 2>&1 || true
                now > "$dir/end.$r"
            ) &
        done
        # Until every rank is in its loop (setup takes well under a second here).
        sleep 2
        sleep "$cut"
        t_cut=$(now)
        ip -n "$ns1" link set v1 down
        wait
        ip -n "$ns1" link set v1 up
        for r in $(seq 0 $((n - 1))); do
            after=$(echo "$(cat "$dir/end.$r") - $t_cut" | bc)
            err=$(grep -m1 -o 'saw the failure after.*' "$dir/out.$r" | cut -c1-150 || true)
            printf '%-5s %-4s %-5s %-9.3f %s\n' "$n" "$run" "$r" "$after" "${err:-$(tail -1 "$dir/out.$r" | cut -c1-150)}"
        done
    done
done
