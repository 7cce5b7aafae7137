#!/usr/bin/env bash
# Issue 13's measurement: M->N weight sync of a 256 MiB model (64 bf16 tensors; replicated,
# row- and column-sharded) from M trainer ranks to N inference ranks, M=2 -> N=2 and
# M=1 -> N=3, over shm and tcp, each against the memcpy bound and the naive approach
# (rank 0 broadcasts every tensor), alternating A B C in every round (ferroccl-perf
# weights --help says what is timed). Run it on a quiet machine with at least 4 cores and
# ~4 GiB free. Usage: bash benches/weights.sh [ROUNDS] [MODEL_BYTES]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
bytes=${2:-256M}
cargo build --release -q -p ferroccl-run -p ferroccl-perf
B=./target/release
for t in shm tcp; do
    for m in 2 1; do
        echo "== M=$m -> N=$((4 - m)), $t, $bytes"
        $B/ferroccl-run -n 4 --transport "$t" -- $B/ferroccl-perf weights --model-bytes "$bytes" --tensors 64 --sources "$m" --rounds "$rounds" --iters 10 | sed -n 's/^\[0\] //p'
    done
done
