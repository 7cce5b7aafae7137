#!/usr/bin/env bash
# Verbs transport numbers inside the soft-RoCE VM (tools/softroce; TCG emulation, so only
# the ratios mean anything): perftest's ib_write_bw at 64 KiB and 1 MiB next to FerroCCL's
# point-to-point over verbs at the same sizes (ferroccl-perf sendrecv: both ranks send and
# receive at once; ferroccl-demo: ping-pong), then allreduce of 1 MiB over verbs, 2 ranks,
# then one-sided reads of 1 MiB (ferroccl-perf rma: the owner writes them from its window's
# memory region, zero copy), to set against ib_write_bw's 1 MiB uni.
# Alternates perftest and FerroCCL ROUNDS times because TCG's speed drifts.
# Usage: bash benches/verbs.sh [ROUNDS]         (host: builds, then boots the VM once)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" != "--guest" ]; then
    rounds=${1:-2}
    cargo build -q -p ferroccl-run -p ferroccl-perf --features ferroccl-run/verbs,ferroccl-perf/verbs --bins
    exec bash tools/softroce/run.sh test --timeout 900 "$PWD/benches/verbs.sh" --guest "$rounds"
fi
rounds=$2
B=./target/debug
G=$FERROCCL_IB_GID_INDEX
for i in $(seq 1 "$rounds"); do
    for s in 65536 1048576; do
        for dir in uni bi; do
            flag=(); [ "$dir" = bi ] && flag=(-b)
            ib_write_bw -d "$FERROCCL_IB_DEV" -x "$G" -s "$s" -n 500 -F "${flag[@]}" >/dev/null 2>&1 &
            sleep 1
            ib_write_bw -d "$FERROCCL_IB_DEV" -x "$G" -s "$s" -n 500 -F "${flag[@]}" "$FERROCCL_IB_IP" 2>&1 \
                | awk -v r="$i" -v d="$dir" '/^ *[0-9]+ +[0-9]+ /{printf "round %s ib_write_bw %s %8d B: BW average %s MB/s (peak %s)\n", r, d, $1, $4, $3}'
            wait
        done
    done
    # Both ranks send SIZE and receive SIZE at once: per direction SIZE/time, both 2x that.
    $B/ferroccl-perf sendrecv -b 64K -e 1M -f 16 -n 100 -w 5 --ranks 2 --transport verbs 2>/dev/null \
        | awk -v r="$i" '/^ +[0-9]+ +[0-9]+ +f32/{printf "round %s ferroccl sendrecv %8d B: %s us: %.1f MB/s per direction, %.1f MB/s both\n", r, $1, $6, $1/$6, 2*$1/$6}'
    $B/ferroccl-perf allreduce -b 1M -e 1M -n 30 -w 5 --ranks 2 --transport verbs 2>/dev/null \
        | awk -v r="$i" '/^ +1048576 /{printf "round %s ferroccl allreduce 1 MiB 2 ranks (%s): out of place %s us busbw %s GB/s, in place %s us busbw %s GB/s\n", r, $NF, $6, $8, $10, $12}'
    # Rank 0 reads 1 MiB of rank 1's window: read_into (one blocking read into plain memory)
    # and (b) (a transfer plan of one read into a window); median of 20 steps each.
    $B/ferroccl-perf rma --case 1mib --steps 20 --rounds 1 --ranks 2 --transport verbs 2>/dev/null \
        | awk -v r="$i" '$1=="read_into"{printf "round %s ferroccl rma read_into 1048576 B: %s us: %.1f MB/s\n", r, $2, 1048576/$2}
            $1=="(b)"{printf "round %s ferroccl rma plan read 1048576 B: %s us: %.1f MB/s\n", r, $3, 1048576/$3}'
done
