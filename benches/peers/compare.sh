#!/usr/bin/env bash
# FerroCCL vs Open MPI on this host, over shared memory, in one run.
#
# Builds ferroccl-perf (release) and benches/peers/mpi_coll.c (mpicc, into target/peers/),
# then for each rank count, case (collective + dtype) and size range runs FerroCCL and MPI
# back to back, alternating (F M, F M, ... for --rounds rounds, the first of each pair
# swapped every round), because this kind of machine's speed drifts over tens of seconds:
# both sides see the same drift. It prints one table per (ranks, case): size, the median
# time per call of each over the rounds, the busbw of that time, and the ratio FerroCCL / MPI.
#
#   benches/peers/compare.sh [--ranks "2 4"] [--rounds 3] [--out DIR] [--quick]
#
# Both sides: out-of-place (broadcast: in place, FerroCCL has no out-of-place broadcast),
# -c 1 (one extra checked call per size; any wrong element is reported), same sizes, same
# warm-up and iterations, the slowest rank's mean time. FerroCCL: ferroccl-perf --ranks N
# --transport shm. MPI: mpirun --oversubscribe --bind-to none --mca btl self,vader (or sm,
# whichever this Open MPI has; MPI_BIND=core to let it bind). bf16: MPI has no bf16, so
# the MPI side moves f32 buffers of the same size in bytes (see mpi_coll.c).
#
# Every run's JSON and log go to --out (default /tmp/ferroccl-peers.XXXX), with one SVG per
# rank count (ferroccl-perf plot) of the first round.
set -euo pipefail

ranks_list="2 4"
rounds=3
out=""
quick=0
while [ $# -gt 0 ]; do
    case "$1" in
        --ranks) ranks_list="$2"; shift 2 ;;
        --rounds) rounds="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        --quick) quick=1; shift ;;
        -h|--help) sed -n "2,23p" "$0"; exit 0 ;;
        *) echo "compare.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done

root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
[ -n "$out" ] || out=$(mktemp -d /tmp/ferroccl-peers.XXXX)
mkdir -p "$out"

for tool in mpicc mpirun ompi_info; do
    command -v "$tool" >/dev/null || { echo "compare.sh: $tool not found (apt-get install openmpi-bin libopenmpi-dev)" >&2; exit 1; }
done

echo "== building" >&2
cargo build --release -p ferroccl-perf >&2
mkdir -p target/peers
mpicc -O2 -o target/peers/mpi_coll benches/peers/mpi_coll.c
perf=target/release/ferroccl-perf
mpi=target/peers/mpi_coll

# The shared-memory BTL is "vader" up to Open MPI 4, "sm" from 5.
btl=vader
ompi_info | grep -q "MCA btl: vader" || btl=sm
bind=${MPI_BIND:-none}

cases=("allreduce f32" "allgather f32" "reduce_scatter f32" "broadcast f32" "allreduce bf16")
if [ "$quick" = 1 ]; then
    ranges=("8 64K 8 20 5" "1M 16M 16 5 1")
else
    # MIN MAX FACTOR ITERS WARMUP
    ranges=("8 512K 4 50 10" "2M 256M 4 5 1")
fi

data="$out/rows.txt"
: > "$data"

# run IMPL N COLL DTYPE MIN MAX FACTOR ITERS WARMUP ROUND RANGE
run() {
    local impl=$1 n=$2 coll=$3 dt=$4 min=$5 max=$6 f=$7 it=$8 wu=$9 round=${10} rg=${11}
    local variant=--no-inplace
    [ "$coll" = broadcast ] && variant=--inplace
    local tag="r$round-$impl-$coll-$dt-$n-$rg"
    local args=("$coll" -b "$min" -e "$max" -f "$f" -n "$it" -w "$wu" -d "$dt" -o sum -c 1 "$variant" --json "$out/$tag.json")
    local rc=0
    if [ "$impl" = F ]; then
        "$perf" "${args[@]}" --ranks "$n" --transport shm >"$out/$tag.log" 2>"$out/$tag.err" || rc=$?
    else
        local over=()
        [ "$n" -gt "$(nproc)" ] && over=(--oversubscribe)
        mpirun --allow-run-as-root "${over[@]}" --bind-to "$bind" -np "$n" --mca btl "self,$btl" \
            "$mpi" "${args[@]}" >"$out/$tag.log" 2>"$out/$tag.err" || rc=$?
    fi
    if [ "$rc" != 0 ]; then
        echo "compare.sh: $impl $coll $dt n=$n $min..$max exited with $rc; see $out/$tag.log and $out/$tag.err" >&2
        tail -3 "$out/$tag.err" >&2 || true
    fi
    # IMPL N COLL DTYPE RANGE ROW SIZE TIME BUSBW WRONG (out-of-place columns, else in-place)
    awk -v impl="$impl" -v n="$n" -v c="$coll" -v d="$dt" -v rg="$rg" '
        !/^#/ && NF >= 13 {
            t = $6; b = $8; w = $9
            if (b == "N/A") { t = $10; b = $12; w = $13 }
            print impl, n, c, d, rg, row++, $1, t, b, w
        }' "$out/$tag.log" >>"$data"
}

for round in $(seq 1 "$rounds"); do
    for n in $ranks_list; do
        for cs in "${cases[@]}"; do
            read -r coll dt <<<"$cs"
            for i in "${!ranges[@]}"; do
                read -r min max f it wu <<<"${ranges[$i]}"
                echo "== round $round/$rounds: $n ranks, $coll $dt, $min..$max" >&2
                if [ $((round % 2)) = 1 ]; then order="F M"; else order="M F"; fi
                for impl in $order; do
                    run "$impl" "$n" "$coll" "$dt" "$min" "$max" "$f" "$it" "$wu" "$round" "$i"
                done
            done
        done
    done
done

# The table: medians over the rounds, rows joined by position in the sweep (the sizes are
# the same, except where an f32 stand-in for bf16 rounds a tiny block differently).
echo "# FerroCCL vs $(mpirun --version 2>/dev/null | head -1) on $(hostname) (nproc $(nproc)), shm, $rounds rounds, medians"
echo "# time: median over the rounds of the mean time per call (us), slowest rank; busbw from that time with nccl-tests' factor"
echo "# ratio = FerroCCL busbw / MPI busbw (> 1: FerroCCL faster); wrong: wrong elements, summed over the rounds"
sort -k2,2n -k3,3 -k4,4 -k5,5n -k6,6n "$data" | awk '
    function factor(c, n) {
        if (c == "allreduce") return 2 * (n - 1) / n
        if (c == "allgather" || c == "reduce_scatter" || c == "alltoall") return (n - 1) / n
        return 1
    }
    function median(list,   a, k, m, j, x, t) {
        k = split(list, a, " ")
        for (m = 2; m <= k; m++) { x = a[m] + 0; j = m - 1; while (j >= 1 && a[j] + 0 > x) { a[j + 1] = a[j]; j-- } a[j + 1] = x }
        if (k == 0) return -1
        return (k % 2) ? a[(k + 1) / 2] : (a[k / 2] + a[k / 2 + 1]) / 2
    }
    {
        key = $2 SUBSEP $3 SUBSEP $4 SUBSEP $5 SUBSEP $6
        if (!(key in seen)) { seen[key] = 1; order[++nk] = key }
        if ($1 == "F") { fsize[key] = $7; ft[key] = ft[key] " " $8; fw[key] += $10 }
        else { msize[key] = $7; mt[key] = mt[key] " " $8; mw[key] += $10 }
    }
    END {
        last = ""
        for (i = 1; i <= nk; i++) {
            key = order[i]; split(key, p, SUBSEP)
            head = p[1] " ranks: " p[2] " " p[3]
            if (head != last) {
                printf "\n## %s\n", head
                printf "%12s %12s %12s %10s %10s %8s %6s %6s\n", "size(B)", "FerroCCL", "MPI", "F time", "MPI time", "ratio", "wrongF", "wrongM"
                printf "%12s %12s %12s %10s %10s %8s %6s %6s\n", "", "busbw GB/s", "busbw GB/s", "(us)", "(us)", "", "", ""
                last = head
            }
            fti = (key in ft) ? median(ft[key]) : -1; mti = (key in mt) ? median(mt[key]) : -1
            size = (key in fsize) ? fsize[key] : msize[key]
            # busbw from the median time (the printed busbw has two decimals only).
            fbw = fti > 0 ? fsize[key] / fti / 1e3 * factor(p[2], p[1]) : -1
            mbw = mti > 0 ? msize[key] / mti / 1e3 * factor(p[2], p[1]) : -1
            if (fbw > 0 && mbw > 0) ratio = sprintf("%.2f", fbw / mbw); else ratio = "-"
            printf "%12s %12.3f %12.3f %10.1f %10.1f %8s %6d %6d\n", size, fbw, mbw, fti, mti, ratio, fw[key], mw[key]
        }
    }'

for n in $ranks_list; do
    files=()
    for f in "$out"/r1-*-"$n"-*.json; do [ -s "$f" ] && files+=("$f"); done
    if [ "${#files[@]}" -gt 0 ]; then
        "$perf" plot "$out/peers-${n}ranks.svg" "${files[@]}" 2>/dev/null && echo "# plot: $out/peers-${n}ranks.svg"
    fi
done
echo "# raw rows, logs and JSON: $out"
