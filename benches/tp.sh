#!/usr/bin/env bash
# Issue 16's measurement: a tensor-parallel MLP decode step (examples/tp_mlp.rs) at TP=2 and
# TP=4, f32 and bf16, hidden 4096 (ffn 16384), 1 and 8 tokens, over shm; fused (one group
# of a layer's per-token allreduces) and unfused (one blocking allreduce per token)
# alternate in every round (the order flips each round). Prints rank 0's line per run
# (median time per decode step per layer, time inside the collectives, their share) and,
# at the end, per configuration the median over the rounds of the per-run medians.
#
#   bash benches/tp.sh [--rounds 3] [--hidden 4096] [--layers 2] [--steps 10] [--transport shm]
#
# Memory: at TP=2 every rank holds 2 x 4096 x 8192 f32 per layer (256 MiB). No --check
# (the single-rank reference would hold the full matrices on every rank); the mesh test
# runs the checked small sizes.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=3; hidden=4096; layers=2; steps=10; transport=shm
while [ $# -gt 0 ]; do
    case "$1" in
        --rounds) rounds=$2; shift 2 ;;
        --hidden) hidden=$2; shift 2 ;;
        --layers) layers=$2; shift 2 ;;
        --steps) steps=$2; shift 2 ;;
        --transport) transport=$2; shift 2 ;;
        *) sed -n "2,13p" "$0"; exit 2 ;;
    esac
done
cargo build --release -q -p ferroccl-run -p ferroccl --examples
B=./target/release
out=$(mktemp -d)
for round in $(seq 1 "$rounds"); do
    if [ $((round % 2)) -eq 1 ]; then order="no yes"; else order="yes no"; fi
    for n in 2 4; do
        for dtype in f32 bf16; do
            for tokens in 1 8; do
                for fused in $order; do
                    flag=""; [ "$fused" = yes ] && flag="--fused"
                    line=$($B/ferroccl-run -n "$n" --transport "$transport" --timeout 600 -- \
                        $B/examples/tp_mlp --no-check --dtype "$dtype" --hidden "$hidden" --tokens "$tokens" \
                        --layers "$layers" --steps "$steps" --warmup 3 $flag | sed -n 's/^\[0\] //p' | grep 'per layer median')
                    echo "round $round: $line"
                    us=$(echo "$line" | sed -n 's/.*per layer median \([0-9.]*\) us, in collectives \([0-9.]*\) us, comm share \([0-9.]*\)%.*/\1 \2 \3/p')
                    echo "$us" >> "$out/tp$n-$dtype-t$tokens-fused$fused"
                done
            done
        done
    done
done
echo "== medians over $rounds rounds (us per decode step per layer; us in collectives; comm share %), $transport, hidden $hidden, $layers layers, $steps steps"
for f in "$out"/*; do
    name=$(basename "$f")
    med() { sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
    t=$(cut -d' ' -f1 "$f" | med); c=$(cut -d' ' -f2 "$f" | med); s=$(cut -d' ' -f3 "$f" | med)
    printf '%-28s step/layer %10s us   comm %10s us   share %5s%%\n' "$name" "$t" "$c" "$s"
done
rm -rf "$out"
