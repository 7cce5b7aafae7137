#!/usr/bin/env bash
# Point-to-point latency (8 B) and bandwidth (1 MiB, 64 MiB) between two processes over
# shm and tcp, alternating the two (A B A B ...) because this machine's speed drifts, each
# next to single-thread memcpy measured in the same run; then communicator init time for
# 2, 4 and 8 ranks. Usage: bash benches/p2p.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
cargo build --release -q -p ferroccl-run
B=./target/release
echo "== point to point, 2 ranks (rank 0's table; ratios are to memcpy in the same run)"
for i in $(seq 1 "$rounds"); do
    for t in shm tcp; do
        $B/ferroccl-run -n 2 --transport "$t" -- $B/ferroccl-demo --sizes 8,1M,64M | sed -n 's/^\[0\] //p' | grep -E "memcpy \(|<->" | tr '\n' ' ' | sed "s/^/round $i $t: /"
        echo
    done
done
echo "== communicator init (rank 0: process start to init returned, store exchange and mesh included)"
for i in $(seq 1 "$rounds"); do
    for t in shm tcp; do
        for n in 2 4 8; do
            $B/ferroccl-run -n "$n" --transport "$t" -- $B/ferroccl-demo --sizes 8 --iters 10 | sed -n "s/^\[0\] ferroccl-demo: \([0-9]*\) ranks, init \([0-9.]*\) ms.*/round $i $t n=\1 init \2 ms/p"
        done
    done
done
