#!/usr/bin/env bash
# MoE dispatch + combine: MPI (benches/peers/mpi_moe.c) against FerroCCL, on this host.
#
#   bash benches/moe.sh [--ranks "2 4"] [--tokens "1 8 64 128"] [--hidden 4096] [--experts 8]
#                       [--topk 2] [--steps 200] [--warmup 20] [--rounds 3] [--out DIR]
#
# Builds mpi_moe with mpicc (into target/peers/), checks it once per rank count
# (`--check`: the combine must give back the tokens), then for each round, rank count and
# token count runs every side once, the order of the sides flipped every round (this kind of
# machine's speed drifts over tens of seconds). Every side prints one line
#
#   <impl> ranks=N tokens=T hidden=H experts=E topk=K steps=S median_us=.. p10_us=.. p90_us=..
#
# (median, p10, p90 over the timed steps of the slowest rank's time per step, dispatch +
# combine; routing and step definition: the comment at the top of mpi_moe.c). The table
# gives, per (ranks, tokens), the median over the rounds of each side's median_us.
# MPI: Open MPI's mpirun --allow-run-as-root --oversubscribe --bind-to core (MPI_BIND to
# change the binding; with more ranks than cores, core:overload-allowed; MPI_ARGS for more
# mpirun arguments, e.g. MPI_ARGS="--mca mpi_yield_when_idle 1" on an oversubscribed host).
set -euo pipefail

ranks_list="2 4"
tokens_list="1 8 64 128"
hidden=4096
experts=8
topk=2
steps=200
warmup=20
rounds=3
out=""
while [ $# -gt 0 ]; do
    case "$1" in
        --ranks) ranks_list="$2"; shift 2 ;;
        --tokens) tokens_list="$2"; shift 2 ;;
        --hidden) hidden="$2"; shift 2 ;;
        --experts) experts="$2"; shift 2 ;;
        --topk) topk="$2"; shift 2 ;;
        --steps) steps="$2"; shift 2 ;;
        --warmup) warmup="$2"; shift 2 ;;
        --rounds) rounds="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        -h|--help) sed -n "2,18p" "$0"; exit 0 ;;
        *) echo "moe.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
[ -n "$out" ] || out=$(mktemp -d /tmp/ferroccl-moe.XXXX)
mkdir -p "$out" target/peers
for tool in mpicc mpirun; do
    command -v "$tool" >/dev/null || { echo "moe.sh: $tool not found (apt-get install openmpi-bin libopenmpi-dev)" >&2; exit 1; }
done
mpicc -O2 -o target/peers/mpi_moe benches/peers/mpi_moe.c
mpi=target/peers/mpi_moe

mpi_run() { # N ARGS...
    local n=$1
    shift
    local bind=${MPI_BIND:-core}
    [ "$bind" = core ] && [ "$n" -gt "$(nproc)" ] && bind=core:overload-allowed
    # shellcheck disable=SC2086 # MPI_ARGS: extra mpirun arguments, split on blanks
    mpirun --allow-run-as-root --oversubscribe --bind-to "$bind" ${MPI_ARGS:-} -np "$n" "$mpi" "$@"
}

# FerroCCL's side: `ferroccl-perf moe` (ranks pinned with ferroccl-run --bind, shm) runs
# both modes and one allreduce of the same bytes (T x H bf16), alternated step block by
# step block in one process; round 1 of its 2 rounds is the warm-up, the lines are round
# 2's. Three lines: ferroccl_moe mode=throughput, ferroccl_moe mode=lowlatency,
# ferroccl_allreduce. FERROCCL_MOE=0 runs MPI only.
cargo build --release -q -p ferroccl-perf -p ferroccl-run >&2
ferroccl_run() { # N T
    local n=$1 t=$2
    target/release/ferroccl-run -n "$n" --bind --transport shm -- \
        target/release/ferroccl-perf moe --tokens "$t" --hidden "$hidden" --experts "$experts" \
        --top-k "$topk" --steps "$steps" --rounds 2 | sed -n 's/^\[0\] //p' | grep '^ferroccl_'
}
sides="mpi"
[ "${FERROCCL_MOE:-1}" = 1 ] && sides="mpi ferroccl"
columns="$sides"
[ "${FERROCCL_MOE:-1}" = 1 ] && columns="mpi throughput lowlatency allreduce"

for n in $ranks_list; do
    mpi_run "$n" --check 8 "$hidden" "$experts" "$topk" 3 1 >"$out/check.$n.log" 2>&1 \
        || { cat "$out/check.$n.log" >&2; echo "moe.sh: mpi_moe --check failed on $n ranks" >&2; exit 1; }
done

rows="$out/rows.txt"
: >"$rows"
for r in $(seq 1 "$rounds"); do
    order=$sides
    [ $((r % 2)) = 0 ] && order=$(echo "$sides" | tr ' ' '\n' | tac | tr '\n' ' ')
    for n in $ranks_list; do
        for t in $tokens_list; do
            for side in $order; do
                case "$side" in
                    mpi) lines=$(mpi_run "$n" "$t" "$hidden" "$experts" "$topk" "$steps" "$warmup" | grep '^mpi_moe ') ;;
                    ferroccl) lines=$(ferroccl_run "$n" "$t") ;;
                esac
                while read -r line; do
                    echo "$line" | tee -a "$out/lines.txt" >&2
                    med=$(echo "$line" | sed -n 's/.*median_us=\([0-9.]*\).*/\1/p')
                    col=$(echo "$line" | sed -n 's/.*mode=\([a-z]*\).*/\1/p')
                    echo "${col:-mpi} $n $t $med" >>"$rows"
                done <<<"$lines"
            done
        done
    done
    echo "round $r/$rounds done" >&2
done

echo "# MoE dispatch + combine, hidden $hidden, experts $experts, top-$topk, bf16, $steps steps (+$warmup warm-up), $rounds rounds"
echo "# us per step: median over the rounds of each run's median (slowest rank); $(mpirun --version 2>/dev/null | head -1)"
printf "%-6s %-7s" ranks tokens
for side in $columns; do printf " %12s" "$side"; done
echo
for n in $ranks_list; do
    for t in $tokens_list; do
        printf "%-6s %-7s" "$n" "$t"
        for side in $columns; do
            m=$(awk -v s="$side" -v n="$n" -v t="$t" '$1==s && $2==n && $3==t {print $4}' "$rows" | sort -g |
                awk '{a[NR]=$1} END {if (NR==0) print "nan"; else if (NR%2) print a[(NR+1)/2]; else print (a[NR/2]+a[NR/2+1])/2}')
            printf " %12s" "$m"
        done
        echo
    done
done
echo "# lines: $out/lines.txt"
