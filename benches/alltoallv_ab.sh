#!/usr/bin/env bash
# alltoallv: mesh against pairwise (FERROCCL_ALGO), alternating in one run, to place the cost
# model's crossover (docs/algorithms.md, "alltoallv").
#
#   bash benches/alltoallv_ab.sh [--ranks "2 4"] [--transports "shm tcp"] [--rounds 6]
#                                [--bin target/release]
#
# Per round, for each rank count and transport, runs `ferroccl-perf alltoallv` (uniform
# counts, f32, out of place, -c 1: every size checked once) with --algo mesh and --algo
# pairwise back to back, the order flipped every round (A B, B A, ...), over 1 KiB to 64 MiB
# per rank (the send buffer) in two ranges: 1K-256K x4 with 200 calls (20 warm-up), 1M-64M
# x4 with 10 calls (2 warm-up). Each run's time per size is ferroccl-perf's: the mean over
# the timed calls of the slowest rank. Prints, per (ranks, transport, size), the median over
# the rounds of each algorithm's time (us), pairwise / mesh (< 1: pairwise faster) and the
# number of rounds pairwise won; keeps the raw samples in the output directory.
set -euo pipefail

ranks_list="2 4"
transports="shm tcp"
rounds=6
bin=target/release
while [ $# -gt 0 ]; do
    case "$1" in
        --ranks) ranks_list="$2"; shift 2 ;;
        --transports) transports="$2"; shift 2 ;;
        --rounds) rounds="$2"; shift 2 ;;
        --bin) bin="$2"; shift 2 ;;
        -h|--help) sed -n "2,16p" "$0"; exit 0 ;;
        *) echo "alltoallv_ab.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
for b in ferroccl-run ferroccl-perf; do
    [ -x "$bin/$b" ] || { echo "alltoallv_ab.sh: $bin/$b missing (cargo build --release -p ferroccl-perf -p ferroccl-run)" >&2; exit 1; }
done
out=$(mktemp -d /tmp/ferroccl-a2av.XXXX)
samples="$out/samples"
: >"$samples"
ranges=("1K 256K 4 200 20" "1M 64M 4 10 2")

run() { # algo ranks transport round
    local algo=$1 n=$2 tr=$3 r=$4
    for rg in "${ranges[@]}"; do
        read -r min max f it wu <<<"$rg"
        local log="$out/$algo.$n.$tr.$r.$min.log"
        "$bin/ferroccl-run" -n "$n" --bind --transport "$tr" -- \
            "$bin/ferroccl-perf" alltoallv -b "$min" -e "$max" -f "$f" -n "$it" -w "$wu" -c 1 --no-inplace --algo "$algo" >"$log" 2>&1 ||
            { echo "alltoallv_ab.sh: $algo $n $tr failed, see $log" >&2; exit 1; }
        grep -q "wrong elements: 0 OK" "$log" || { echo "alltoallv_ab.sh: wrong elements, see $log" >&2; exit 1; }
        awk -v a="$algo" -v n="$n" -v t="$tr" '/^\[0\] +[0-9]+ +[0-9]+ +f32/ {print a, n, t, $2, $7}' "$log" >>"$samples"
    done
}

for r in $(seq 1 "$rounds"); do
    for n in $ranks_list; do
        for tr in $transports; do
            if [ $((r % 2)) = 1 ]; then order="mesh pairwise"; else order="pairwise mesh"; fi
            for a in $order; do run "$a" "$n" "$tr" "$r"; done
        done
    done
    echo "round $r/$rounds done" >&2
done

echo "# alltoallv, uniform counts, f32, out of place; $rounds rounds alternating mesh / pairwise; $(nproc) CPUs; us per call"
echo "# time: median over the rounds of each run's mean time per call (slowest rank); won: rounds in which pairwise was faster"
printf "%-5s %-4s %10s %12s %12s %8s %6s\n" ranks tr size mesh pairwise p/m won
for n in $ranks_list; do
    for tr in $transports; do
        for size in $(awk -v n="$n" -v t="$tr" '$2==n && $3==t {print $4}' "$samples" | sort -gu); do
            med() { awk -v a="$1" -v n="$n" -v t="$tr" -v s="$size" '$1==a && $2==n && $3==t && $4==s {print $5}' "$samples" | sort -g |
                awk '{a[NR]=$1} END {if (NR==0) print "nan"; else if (NR%2) print a[(NR+1)/2]; else print (a[NR/2]+a[NR/2+1])/2}'; }
            m=$(med mesh); p=$(med pairwise)
            won=$(awk -v n="$n" -v t="$tr" -v s="$size" '$2==n && $3==t && $4==s {v[$1" "NR]=$5; if ($1=="mesh") m[++i]=$5; else p[++j]=$5}
                END {w=0; for (k=1; k<=i && k<=j; k++) if (p[k] < m[k]) w++; print w "/" (i<j?i:j)}' "$samples")
            printf "%-5s %-4s %10s %12s %12s %8.3f %6s\n" "$n" "$tr" "$size" "$m" "$p" "$(awk -v a="$m" -v b="$p" 'BEGIN {print b/a}')" "$won"
        done
    done
done
echo "# raw samples: $samples"
