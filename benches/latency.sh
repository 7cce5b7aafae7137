#!/usr/bin/env bash
# Small-message allreduce latency: FerroCCL's blocking call and persistent plan vs Open MPI's
# MPI_Allreduce and persistent allreduce (MPI_Start/MPI_Wait), in one run, alternating.
#
#   benches/latency.sh [--ranks "2 4"] [--rounds 3] [--sizes 8,4K] [-n 200] [--batches 6]
#                      [--bind] [--out DIR]
#
# Builds ferroccl-perf (release) and benches/peers/mpi_latency.c (mpicc, into target/peers/),
# then, for --rounds rounds and each rank count, runs `ferroccl-perf latency` (F) and
# mpi_latency (M) back to back, the first of the pair swapped every round. Each of the two
# alternates its own two modes batch by batch (blocking, plan / MPI_Allreduce, persistent),
# so the ratios inside one implementation see the same machine state; across the two, the
# alternation of short runs does what it can (this kind of machine switches between a fast
# and a slow state every few tens of seconds: look at the "min" table too, which compares
# each side's fastest batch).
#
# Both: allreduce, f32, sum, in place, same sizes, same calls per batch, same warm-up, a
# barrier before each batch, the slowest rank's time per call, one checked call per mode.
# FerroCCL: --transport shm. MPI: mpirun --bind-to none --mca btl self,vader (sm from Open
# MPI 5), --oversubscribe when ranks > cores; persistent: MPI_Allreduce_init (MPI-4) or
# Open MPI 4.1's MPIX_Allreduce_init (<mpi-ext.h>, the pcollreq extension).
#
# --bind pins rank r to CPU r mod nproc on both sides (FerroCCL: taskset through
# ferroccl-run; MPI: --bind-to core, overload-allowed when ranks > cores). Unpinned, the
# kernel may put two ranks on one CPU for a whole run (FerroCCL's ranks then hand the CPU to
# each other with sched_yield on every call: ~10x slower at 8 B on a 2-core VM).
#
# Prints, per rank count, a table of medians over every batch of every round (us per call)
# and the ratios plan/blocking, plan/MPI persistent, blocking/MPI blocking (< 1: the first is
# faster), then the same from each mode's fastest batch. Raw rows and logs go to --out.
set -euo pipefail

ranks_list="2 4"
rounds=3
sizes="8,4K"
iters=200
batches=6
out=""
bind=0
while [ $# -gt 0 ]; do
    case "$1" in
        --ranks) ranks_list="$2"; shift 2 ;;
        --rounds) rounds="$2"; shift 2 ;;
        --sizes) sizes="$2"; shift 2 ;;
        -n) iters="$2"; shift 2 ;;
        --batches) batches="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        --bind) bind=1; shift ;;
        -h|--help) sed -n "2,30p" "$0"; exit 0 ;;
        *) echo "latency.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
[ -n "$out" ] || out=$(mktemp -d /tmp/ferroccl-latency.XXXX)
mkdir -p "$out"

for tool in mpicc mpirun ompi_info; do
    command -v "$tool" >/dev/null || { echo "latency.sh: $tool not found (apt-get install openmpi-bin libopenmpi-dev)" >&2; exit 1; }
done

echo "== building" >&2
cargo build --release -p ferroccl-perf -p ferroccl-run >&2
mkdir -p target/peers
mpicc -O2 -o target/peers/mpi_latency benches/peers/mpi_latency.c
perf=target/release/ferroccl-perf
runner=target/release/ferroccl-run
ncpu=$(nproc)
mpi=target/peers/mpi_latency

btl=vader
ompi_info | grep -q "MCA btl: vader" || btl=sm

args=(--sizes "$sizes" -n "$iters" --batches "$batches" --raw)
data="$out/rows.txt"
: > "$data"

# run IMPL N ROUND: appends "IMPL N SIZE MODE ROUND BATCH US" rows.
run() {
    local impl=$1 n=$2 round=$3 rc=0
    local log="$out/r$round-$impl-$n.log"
    if [ "$impl" = F ] && [ "$bind" = 1 ]; then
        "$runner" -n "$n" --transport shm --no-prefix -- sh -c \
            "exec taskset -c \$((FERROCCL_RANK % $ncpu)) $perf latency ${args[*]}" >"$log" 2>"$log.err" || rc=$?
    elif [ "$impl" = F ]; then
        "$perf" latency "${args[@]}" --ranks "$n" --transport shm >"$log" 2>"$log.err" || rc=$?
    else
        local over=() binding=none
        [ "$n" -gt "$ncpu" ] && over=(--oversubscribe)
        if [ "$bind" = 1 ]; then
            binding=core
            [ "$n" -gt "$ncpu" ] && binding=core:overload-allowed
        fi
        mpirun --allow-run-as-root "${over[@]}" --bind-to "$binding" -np "$n" --mca btl "self,$btl" \
            "$mpi" "${args[@]}" >"$log" 2>"$log.err" || rc=$?
    fi
    if [ "$rc" != 0 ]; then
        echo "latency.sh: $impl n=$n round $round exited with $rc; see $log and $log.err" >&2
        tail -3 "$log.err" >&2 || true
    fi
    grep -q "wrong elements: 0 OK" "$log" || echo "latency.sh: $impl n=$n round $round: no clean check in $log" >&2
    awk -v impl="$impl" -v n="$n" -v round="$round" '
        $1 == "#batch" { k = $2 " " $3; print impl, n, $2, $3, round, b[k]++, $4 }' "$log" >>"$data"
}

for round in $(seq 1 "$rounds"); do
    for n in $ranks_list; do
        if [ $((round % 2)) = 1 ]; then order="F M"; else order="M F"; fi
        echo "== round $round/$rounds: $n ranks ($order)" >&2
        for impl in $order; do
            run "$impl" "$n" "$round"
        done
    done
done

rev="not a git checkout"
if git rev-parse --short HEAD >/dev/null 2>&1; then
    rev=$(git rev-parse --short HEAD)
    git diff --quiet HEAD -- crates tools 2>/dev/null || rev="$rev with local changes"
fi
echo "# allreduce f32 sum in place: FerroCCL ($rev) vs $(mpirun --version 2>/dev/null | head -1)"
pinned="unpinned"
[ "$bind" = 1 ] && pinned="rank r pinned to CPU r mod $ncpu"
echo "# host $(hostname), nproc $(nproc), $pinned; $rounds rounds x $batches batches x $iters calls per mode; time per call (us), the slowest rank's"
echo "# F blk: comm.allreduce; F plan: allreduce_plan + plan.run(); M blk: MPI_Allreduce; M pers: persistent allreduce + MPI_Start/MPI_Wait"
echo "# ratios < 1: the first is faster. pb = F plan / F blk; pm = F plan / M pers; bm = F blk / M blk"
echo "# paired: median over batches of the ratio of the two modes' batches in the same process (same machine state)"
sort -k2,2n -k3,3n "$data" | awk '
    function median(list,   a, k, m, j, x) {
        k = split(list, a, " ")
        for (m = 2; m <= k; m++) { x = a[m] + 0; j = m - 1; while (j >= 1 && a[j] + 0 > x) { a[j + 1] = a[j]; j-- } a[j + 1] = x }
        if (k == 0) return -1
        return (k % 2) ? a[(k + 1) / 2] : (a[k / 2] + a[k / 2 + 1]) / 2
    }
    {
        key = $2 SUBSEP $3; col = $1 " " $4
        if (!(key in seen)) { seen[key] = 1; order[++nk] = key }
        t[key, col] = t[key, col] " " $7
        if (!((key, col) in lo) || $7 + 0 < lo[key, col]) lo[key, col] = $7 + 0
        # The same batch of the other mode of the same process (paired ratios).
        pair[key, $1, $5, $6, $4] = $7
    }
    END {
        cols[1] = "F blocking"; cols[2] = "F plan"; cols[3] = "M blocking"; cols[4] = "M persistent"
        for (i = 1; i <= nk; i++) {
            key = order[i]
            for (c = 1; c <= 4; c++) med[key, c] = ((key, cols[c]) in t) ? median(t[key, cols[c]]) : -1
            fr = ""; mr = ""
            for (pk in pair) {
                split(pk, q, SUBSEP)
                if (q[1] SUBSEP q[2] != key || q[6] != "blocking") continue
                other = q[3] == "F" ? "plan" : "persistent"
                ok = q[1] SUBSEP q[2] SUBSEP q[3] SUBSEP q[4] SUBSEP q[5] SUBSEP other
                if (!(ok in pair)) continue
                r = pair[ok] / pair[pk]
                if (q[3] == "F") fr = fr " " r; else mr = mr " " r
            }
            fpair[key] = median(fr); mpair[key] = median(mr)
        }
        for (pass = 1; pass <= 2; pass++) {
            last = ""
            printf "\n## %s\n", pass == 1 ? "medians over all batches" : "fastest batch of each mode (min)"
            for (i = 1; i <= nk; i++) {
                key = order[i]; split(key, p, SUBSEP)
                if (p[1] != last) {
                    printf "\n# %s ranks\n", p[1]
                    printf "%8s %8s %8s %8s %8s %7s %7s %7s", "size(B)", "F blk", "F plan", "M blk", "M pers", "pb", "pm", "bm"
                    if (pass == 1) printf " %12s %12s", "pb paired", "M pers/blk"
                    printf "\n"
                    last = p[1]
                }
                for (c = 1; c <= 4; c++) v[c] = pass == 1 ? med[key, c] : (((key, cols[c]) in lo) ? lo[key, cols[c]] : -1)
                printf "%8s %8.2f %8.2f %8.2f %8.2f %7.2f %7.2f %7.2f", p[2], v[1], v[2], v[3], v[4], v[2] / v[1], v[2] / v[4], v[1] / v[3]
                if (pass == 1) printf " %12.2f %12.2f", fpair[key], mpair[key]
                printf "\n"
            }
        }
    }'
echo "# raw rows (IMPL N SIZE MODE ROUND BATCH US) and logs: $out"
