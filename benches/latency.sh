#!/usr/bin/env bash
# Small-message collective latency: FerroCCL's blocking call and persistent plan vs Open MPI's
# and MPICH's blocking call and persistent collective (MPI_Start/MPI_Wait), in one run,
# alternating.
#
#   benches/latency.sh [--ranks "2 4"] [--rounds 3] [--sizes 8,64,1K,8K,16K,32K,64K,256K]
#                      [--dtypes "f32 bf16"] [--colls allreduce] [--peers "ompi mpich"]
#                      [-n 200] [-w 50] [--batches 6] [--bind] [--transport shm|tcp] [--out DIR]
#
#   --dtypes   f32 and/or bf16
#   --colls    allreduce, allgather, broadcast, reduce_scatter (allgather, reduce_scatter:
#              the size is the per-rank block; broadcast: root 0)
#   --transport  shm (default) or tcp: FerroCCL's --transport, Open MPI's btl (self,vader /
#              self,sm, or self,tcp on the loopback interface); MPICH is not a tcp peer here
#              (ch4:ucx picks its own path) and is skipped with tcp.
#   --peers    ompi (Open MPI: mpicc.openmpi / mpirun.openmpi, or plain mpicc / mpirun if
#              they are Open MPI's) and/or mpich (mpicc.mpich / mpirun.mpich, or plain ones
#              if they are MPICH's); a peer that is not installed is skipped, saying so
#              (apt-get install openmpi-bin libopenmpi-dev mpich libmpich-dev).
#
# Builds ferroccl-perf (release) and benches/peers/mpi_latency.c once per MPI (into
# target/peers/mpi_latency.ompi, .mpich), then, for --rounds rounds and each rank count,
# dtype and collective, runs `ferroccl-perf latency` (F) and each peer back to back, their
# order rotated every round (with one peer: swapped). Each alternates its own two modes
# batch by batch (blocking, plan / blocking, persistent), so the ratios inside one
# implementation see the same machine state; across implementations, the alternation of
# short runs does what it can (this kind of machine switches between a fast and a slow state
# every few tens of seconds: look at the "min" table too, which compares each side's
# fastest batch).
#
# All: same op (sum), same sizes, same calls per batch, same warm-up, a barrier before each
# batch, the slowest rank's time per call, one checked call per mode before the batches (the MPI peers
# also one after them). FerroCCL: --transport
# shm. Open MPI: mpirun --bind-to none --mca btl self,vader (sm from Open MPI 5),
# --oversubscribe when ranks > cores; MPICH: mpirun -bind-to none. Persistent: MPI-4's
# MPI_*_init (MPICH >= 4) or Open MPI 4.1's MPIX_*_init (<mpi-ext.h>, the pcollreq
# extension). bf16 in MPI: MPI_UINT16_T and a user-defined sum MPI_Op (see mpi_latency.c).
#
# --bind pins rank r to CPU r mod nproc everywhere (FerroCCL: taskset through ferroccl-run;
# Open MPI: --bind-to core, overload-allowed when ranks > cores; MPICH: -bind-to core).
# Unpinned, the kernel may put two ranks on one CPU for a whole run (FerroCCL's ranks then
# hand the CPU to each other with sched_yield on every call: ~10x slower at 8 B on a 2-core
# VM). MPICH (4.0.2, ch4:ucx, Debian 12) busy-polls: with more ranks than cores it takes
# milliseconds per call (~8 ms at 8 B, 4 ranks on 2 cores), pinned or not, and
# MPIR_CVAR_POLLS_BEFORE_YIELD does not change that; its columns then only say so.
#
# Prints the machine (nproc, CPU model, load, date), then per dtype, collective and rank
# count a table of medians over every batch of every round (us per call) of every
# (implementation, mode) column, the best peer column at each size, and the ratios of
# FerroCCL's blocking call and plan to that best peer (< 1: FerroCCL is faster), plan /
# blocking, and paired ratios; then the same from each mode's fastest batch. Raw rows and
# logs go to --out.
set -euo pipefail

ranks_list="2 4"
rounds=3
sizes="8,64,1K,8K,16K,32K,64K,256K"
dtypes="f32 bf16"
colls="allreduce"
peers="ompi mpich"
iters=200
warmup=50
batches=6
out=""
bind=0
transport=shm
while [ $# -gt 0 ]; do
    case "$1" in
        --ranks) ranks_list="$2"; shift 2 ;;
        --rounds) rounds="$2"; shift 2 ;;
        --sizes) sizes="$2"; shift 2 ;;
        --dtypes) dtypes="$2"; shift 2 ;;
        --colls) colls="$2"; shift 2 ;;
        --peers) peers="$2"; shift 2 ;;
        -n) iters="$2"; shift 2 ;;
        -w) warmup="$2"; shift 2 ;;
        --batches) batches="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        --bind) bind=1; shift ;;
        --transport) transport="$2"; shift 2 ;;
        -h|--help) sed -n "2,52p" "$0"; exit 0 ;;
        *) echo "latency.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
for d in $dtypes; do
    case "$d" in f32|bf16) ;; *) echo "latency.sh: --dtypes: $d is not f32 or bf16" >&2; exit 2 ;; esac
done
case "$transport" in
    shm) ;;
    tcp) peers=$(echo "$peers" | tr ' ' '\n' | grep -v '^mpich$' | tr '\n' ' ' || true) ;;
    *) echo "latency.sh: --transport: $transport is not shm or tcp" >&2; exit 2 ;;
esac
for c in $colls; do
    case "$c" in allreduce|allgather|broadcast|reduce_scatter) ;;
        *) echo "latency.sh: --colls: $c is not allreduce, allgather, broadcast or reduce_scatter" >&2; exit 2 ;;
    esac
done

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
[ -n "$out" ] || out=$(mktemp -d /tmp/ferroccl-latency.XXXX)
mkdir -p "$out"
ncpu=$(nproc)
cpu_model=$(awk -F': *' '/^model name/ { print $2; exit }' /proc/cpuinfo 2>/dev/null || true)
[ -n "$cpu_model" ] || cpu_model=$(lscpu 2>/dev/null | awk -F': *' '/^Model name/ { print $2; exit }' || true)
machine="# machine: nproc $ncpu, ${cpu_model:-unknown CPU}, load $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo '?') at start; $(date)"

# find_mpi SUFFIX VERSION_PATTERN: sets cc and run to the MPI's compiler and launcher, the
# Debian alternatives (mpicc.SUFFIX, mpirun.SUFFIX), or plain mpicc/mpirun when mpirun's
# --version matches VERSION_PATTERN; leaves them empty when that MPI is not installed.
find_mpi() {
    if command -v "mpicc.$1" >/dev/null && command -v "mpirun.$1" >/dev/null; then
        cc="mpicc.$1" run="mpirun.$1"
    elif command -v mpicc >/dev/null && mpirun --version 2>/dev/null | grep -qi "$2"; then
        cc=mpicc run=mpirun
    fi
}

# The peers that are installed: their compiler and launcher.
declare -A peer_cc peer_run
avail=()
for p in $peers; do
    cc="" run=""
    case "$p" in
        ompi) find_mpi openmpi "open mpi\|openrte" ;;
        mpich) find_mpi mpich "hydra" ;;
        *) echo "latency.sh: --peers: $p is not ompi or mpich" >&2; exit 2 ;;
    esac
    if [ -z "$cc" ]; then
        echo "latency.sh: peer $p skipped: not installed (apt-get install openmpi-bin libopenmpi-dev mpich libmpich-dev)" >&2
        continue
    fi
    peer_cc[$p]=$cc
    peer_run[$p]=$run
    avail+=("$p")
done

echo "== building" >&2
cargo build --release -p ferroccl-perf -p ferroccl-run >&2
mkdir -p target/peers
for p in "${avail[@]}"; do
    "${peer_cc[$p]}" -O2 -o "target/peers/mpi_latency.$p" benches/peers/mpi_latency.c
done
perf=target/release/ferroccl-perf
runner=target/release/ferroccl-run

btl=vader
if [ -n "${peer_run[ompi]:-}" ]; then
    major=$("${peer_run[ompi]}" --version 2>/dev/null | head -1 | grep -o '[0-9][0-9]*\.[0-9.]*' | head -1 | cut -d. -f1)
    [ "${major:-4}" -ge 5 ] && btl=sm
fi
ompi_mca=(--mca btl "self,$btl")
[ "$transport" = tcp ] && ompi_mca=(--mca btl self,tcp --mca btl_tcp_if_include lo)

data="$out/rows.txt"
: > "$data"

# run IMPL N DTYPE COLL ROUND: appends "IMPL DTYPE COLL N SIZE MODE ROUND BATCH US" rows.
run() {
    local impl=$1 n=$2 dtype=$3 coll=$4 round=$5 rc=0
    local log="$out/r$round-$impl-$dtype-$coll-$n.log"
    local args=(--sizes "$sizes" --dtype "$dtype" --coll "$coll" -n "$iters" -w "$warmup" --batches "$batches" --raw)
    if [ "$impl" = F ] && [ "$bind" = 1 ]; then
        "$runner" -n "$n" --transport "$transport" --no-prefix -- sh -c \
            "exec taskset -c \$((FERROCCL_RANK % $ncpu)) $perf latency ${args[*]}" >"$log" 2>"$log.err" || rc=$?
    elif [ "$impl" = F ]; then
        "$perf" latency "${args[@]}" --ranks "$n" --transport "$transport" >"$log" 2>"$log.err" || rc=$?
    elif [ "$impl" = ompi ]; then
        local over=() binding=none
        [ "$n" -gt "$ncpu" ] && over=(--oversubscribe)
        if [ "$bind" = 1 ]; then
            binding=core
            [ "$n" -gt "$ncpu" ] && binding=core:overload-allowed
        fi
        "${peer_run[ompi]}" --allow-run-as-root "${over[@]}" --bind-to "$binding" -np "$n" "${ompi_mca[@]}" \
            "target/peers/mpi_latency.ompi" "${args[@]}" >"$log" 2>"$log.err" || rc=$?
    else
        local binding=none
        [ "$bind" = 1 ] && binding=core
        "${peer_run[mpich]}" -bind-to "$binding" -np "$n" \
            "target/peers/mpi_latency.mpich" "${args[@]}" >"$log" 2>"$log.err" || rc=$?
    fi
    if [ "$rc" != 0 ]; then
        echo "latency.sh: $impl $dtype $coll n=$n round $round exited with $rc; see $log and $log.err" >&2
        tail -3 "$log.err" >&2 || true
    fi
    grep -q "wrong elements: 0 OK" "$log" || echo "latency.sh: $impl $dtype $coll n=$n round $round: no clean check in $log" >&2
    # A (size, mode) whose checked calls gave wrong elements ("#wrong SIZE MODE COUNT", the
    # MPI peers) is left out of the tables: its times are not of a working collective.
    awk '$1 == "#wrong" { print "latency.sh: '"$impl $dtype $coll n=$n round $round"': " $3 " at " $2 " B gave " $4 " wrong elements: left out" }' "$log" >&2
    awk -v impl="$impl" -v n="$n" -v d="$dtype" -v c="$coll" -v round="$round" '
        FNR == NR { if ($1 == "#wrong") bad[$2 " " $3] = 1; next }
        $1 == "#batch" && !(($2 " " $3) in bad) { k = $2 " " $3; print impl, d, c, n, $2, $3, round, b[k]++, $4 }' "$log" "$log" >>"$data"
}

impls=(F "${avail[@]}")
k=${#impls[@]}
for round in $(seq 1 "$rounds"); do
    # Rotated every round: each implementation goes first in turn.
    order=()
    for ((j = 0; j < k; j++)); do order+=("${impls[$(((j + round - 1) % k))]}"); done
    for n in $ranks_list; do
        for dtype in $dtypes; do
            for coll in $colls; do
                echo "== round $round/$rounds: $n ranks, $dtype $coll (${order[*]})" >&2
                for impl in "${order[@]}"; do
                    run "$impl" "$n" "$dtype" "$coll" "$round"
                done
            done
        done
    done
done

rev="not a git checkout"
if git rev-parse --short HEAD >/dev/null 2>&1; then
    rev=$(git rev-parse --short HEAD)
    git diff --quiet HEAD -- crates tools benches/peers 2>/dev/null || rev="$rev with local changes"
fi
versions=""
for p in "${avail[@]}"; do
    v=$(sed -n 's/^# mpi_latency: .* ranks, //p' "$out"/r1-"$p"-*.log 2>/dev/null | head -1)
    versions="$versions, $p = ${v:-?}"
done
echo "$machine"
echo "# $colls, $dtypes, sum, in place where the call is: FerroCCL ($rev) vs peers${versions:-: none}"
pinned="unpinned"
[ "$bind" = 1 ] && pinned="rank r pinned to CPU r mod $ncpu"
echo "# host $(hostname), $pinned; $rounds rounds x $batches batches x $iters calls per mode; time per call (us), the slowest rank's; finished $(date)"
echo "# F blk: comm.<coll>; F plan: <coll>_plan + plan.run(); <peer> blk: MPI_<Coll>; <peer> pers: its persistent form + MPI_Start/MPI_Wait:"
for p in "${avail[@]}"; do
    for c in $colls; do
        line=$(sed -n 's/^#  blocking: /blocking: /p' "$out"/r1-"$p"-*-"$c"-*.log 2>/dev/null | head -1)
        echo "#   $p $c: ${line:-no log}"
    done
done
echo "# best: the fastest peer column at that size (ompi/b = Open MPI blocking, mpich/p = MPICH persistent, ...)"
echo "# ratios < 1: FerroCCL is faster. F/best = F blk / best; P/best = F plan / best; pb = F plan / F blk"
echo "# paired: median over batches of the ratio of the two modes' batches in the same process (same machine state)"
awk -v peers="${avail[*]}" '
    function median(list,   a, k, m, j, x) {
        k = split(list, a, " ")
        for (m = 2; m <= k; m++) { x = a[m] + 0; j = m - 1; while (j >= 1 && a[j] + 0 > x) { a[j + 1] = a[j]; j-- } a[j + 1] = x }
        if (k == 0) return -1
        return (k % 2) ? a[(k + 1) / 2] : (a[k / 2] + a[k / 2 + 1]) / 2
    }
    function num(v, w) { return v > 0 ? sprintf("%" w ".2f", v) : sprintf("%" w "s", "-") }
    function ratio(a, b, w) { return (a > 0 && b > 0) ? sprintf("%" w ".2f", a / b) : sprintf("%" w "s", "-") }
    BEGIN {
        np = split(peers, P, " ")
        nc = 0
        impl[++nc] = "F"; md[nc] = "b"; head[nc] = "F blk"
        impl[++nc] = "F"; md[nc] = "p"; head[nc] = "F plan"
        for (i = 1; i <= np; i++) {
            impl[++nc] = P[i]; md[nc] = "b"; head[nc] = P[i] " blk"
            impl[++nc] = P[i]; md[nc] = "p"; head[nc] = P[i] " pers"
        }
    }
    {
        key = $2 SUBSEP $3 SUBSEP $4; size = $5; m = $6 == "blocking" ? "b" : "p"; col = $1 "/" m
        if (!(key in gseen)) { gseen[key] = 1; gorder[++ng] = key }
        if (!((key, size) in sseen)) { sseen[key, size] = 1; ns[key]++; sorder[key, ns[key]] = size }
        t[key, size, col] = t[key, size, col] " " $9
        if (!((key, size, col) in lo) || $9 + 0 < lo[key, size, col]) lo[key, size, col] = $9 + 0
        rb = $7 ":" $8
        pr[key, size, $1, rb, m] = $9
        if (m == "b") blist[key, size, $1] = blist[key, size, $1] " " rb
    }
    END {
        for (pass = 1; pass <= 2; pass++) {
            printf "\n## %s\n", pass == 1 ? "medians over all batches" : "fastest batch of each mode (min)"
            for (g = 1; g <= ng; g++) {
                key = gorder[g]; split(key, q, SUBSEP)
                printf "\n# %s %s, %s ranks\n", q[1], q[2], q[3]
                printf "%8s", "size(B)"
                for (c = 1; c <= nc; c++) printf " %10s", head[c]
                printf " %8s %8s %6s %6s %6s", "best", "by", "F/best", "P/best", "pb"
                if (pass == 1) {
                    printf " %9s", "pb paired"
                    for (i = 1; i <= np; i++) printf " %14s", P[i] " pers/blk"
                }
                printf "\n"
                for (s = 1; s <= ns[key]; s++) {
                    size = sorder[key, s]
                    best = -1; by = "-"
                    for (c = 1; c <= nc; c++) {
                        k3 = key SUBSEP size SUBSEP impl[c] "/" md[c]
                        v[c] = -1
                        if (k3 in t) v[c] = pass == 1 ? median(t[k3]) : lo[k3]
                        if (c > 2 && v[c] > 0 && (best < 0 || v[c] < best)) { best = v[c]; by = impl[c] "/" md[c] }
                    }
                    printf "%8s", size
                    for (c = 1; c <= nc; c++) printf " %s", num(v[c], 10)
                    printf " %s %8s %s %s %s", num(best, 8), by, ratio(v[1], best, 6), ratio(v[2], best, 6), ratio(v[2], v[1], 6)
                    if (pass == 1) {
                        for (i = 0; i <= np; i++) {
                            im = i == 0 ? "F" : P[i]
                            list = ""
                            nb = split(blist[key, size, im], B, " ")
                            for (j = 1; j <= nb; j++)
                                if ((key, size, im, B[j], "p") in pr)
                                    list = list " " pr[key, size, im, B[j], "p"] / pr[key, size, im, B[j], "b"]
                            printf " %s", num(median(list), i == 0 ? 9 : 14)
                        }
                    }
                    printf "\n"
                }
            }
        }
    }' "$data"
echo "# raw rows (IMPL DTYPE COLL N SIZE MODE ROUND BATCH US) and logs: $out"
