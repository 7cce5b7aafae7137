#!/usr/bin/env bash
# A/B: two builds of FerroCCL side by side on small messages, alternating (A B B A A B ...)
# in one run, because this kind of machine changes speed every few tens of seconds.
#
#   bash benches/ab.sh OLD_BIN_DIR NEW_BIN_DIR [--rounds 8] [--ranks 2] [--transport shm]
#                      [-n 2000] [--sizes 8,4K]
#
# Each BIN_DIR holds a release `ferroccl-run` and `ferroccl-perf` (for instance a copy of
# target/release from the previous commit, and target/release now). Per round, each side
# runs, pinned (`ferroccl-run --bind`):
#   * `ferroccl-perf latency --sizes 8,4K` (or --sizes): allreduce f32 sum in place, blocking call and
#     persistent plan, 5 batches of N calls each (every batch is one sample);
#   * `ferroccl-perf sendrecv -b 8 -e 8`: 8 B exchanged both ways with sendrecv, N calls
#     (one sample per round).
# The order of the two sides flips every round. Prints, per measurement, the median over
# all samples of each side (us per call), NEW/OLD (< 1: the new build is faster) and the
# samples' spread (min-max), and keeps the raw samples in the output directory.
set -euo pipefail

[ $# -ge 2 ] || { sed -n "2,20p" "$0"; exit 2; }
A=$(cd "$1" && pwd)
B=$(cd "$2" && pwd)
shift 2
rounds=8
ranks=2
transport=shm
iters=2000
sizes=8,4K
while [ $# -gt 0 ]; do
    case "$1" in
        --rounds) rounds="$2"; shift 2 ;;
        --ranks) ranks="$2"; shift 2 ;;
        --transport) transport="$2"; shift 2 ;;
        -n) iters="$2"; shift 2 ;;
        --sizes) sizes="$2"; shift 2 ;;
        *) echo "ab.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
for d in "$A" "$B"; do
    for b in ferroccl-run ferroccl-perf; do
        [ -x "$d/$b" ] || { echo "ab.sh: $d/$b missing" >&2; exit 1; }
    done
done
out=$(mktemp -d /tmp/ferroccl-ab.XXXX)
samples="$out/samples"
: >"$samples"

run_side() { # side dir
    local side=$1 dir=$2
    "$dir/ferroccl-run" -n "$ranks" --bind --transport "$transport" -- \
        "$dir/ferroccl-perf" latency --sizes "$sizes" -n "$iters" -w 200 --batches 5 --raw >"$out/lat.$side.log" 2>&1
    sed -n 's/^\[0\] #batch \([0-9]*\) \([a-z]*\) \([0-9.]*\)$/allreduce-\1B-\2 '"$side"' \3/p' "$out/lat.$side.log" >>"$samples"
    "$dir/ferroccl-run" -n "$ranks" --bind --transport "$transport" -- \
        "$dir/ferroccl-perf" sendrecv -b 8 -e 8 -n "$iters" -w 200 -c 0 >"$out/sr.$side.log" 2>&1
    awk -v s="$side" '/^\[0\] +8 +2 +f32/ {print "sendrecv-8B " s " " $7}' "$out/sr.$side.log" >>"$samples"
}

for r in $(seq 1 "$rounds"); do
    if [ $((r % 2)) = 1 ]; then
        run_side old "$A"; run_side new "$B"
    else
        run_side new "$B"; run_side old "$A"
    fi
    echo "round $r/$rounds done" >&2
done

echo "# $ranks ranks, $transport, $rounds rounds, $iters calls per sample; us per call (median over samples) [min-max]"
printf "%-28s %18s %18s %8s\n" measurement old new new/old
for m in $(awk '{print $1}' "$samples" | sort -u); do
    med() { awk -v m="$m" -v s="$1" '$1==m && $2==s {print $3}' "$samples" | sort -g | awk '{a[NR]=$1} END {if (NR==0) print "nan"; else if (NR%2) print a[(NR+1)/2]; else print (a[NR/2]+a[NR/2+1])/2}'; }
    span() { awk -v m="$m" -v s="$1" '$1==m && $2==s {print $3}' "$samples" | sort -g | awk 'NR==1{lo=$1} {hi=$1} END {printf "%.2f-%.2f", lo, hi}'; }
    o=$(med old); n=$(med new)
    printf "%-28s %7.3f %10s %7.3f %10s %8.3f\n" "$m" "$o" "[$(span old)]" "$n" "[$(span new)]" "$(awk -v a="$o" -v b="$n" 'BEGIN {print b/a}')"
done
echo "# raw samples: $samples"
