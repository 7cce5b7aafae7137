#!/usr/bin/env bash
# Time to error of deliberate misuse (issue 10's cases), per case x transport x ranks x
# size: every rank's "failed after S s" from `ferroccl-selftest fault`, summarised as the
# slowest rank's time; "NO ERROR" where a rank returned Ok.
#
#   bash benches/faults.sh [BIN_DIR] [--ranks "2 4 8"] [--transports "shm tcp"]
#                          [--counts "1000 100000"] [--cases "..."] [--timeout 60]
#
# BIN_DIR holds ferroccl-run and ferroccl-selftest (default target/release, built when
# missing). FERROCCL_TIMEOUT is --timeout (default 60 s), so a case that is only caught
# by the deadline shows up as about that many seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=target/release
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then bin="$1"; shift; fi
ranks="2 4 8"; transports="shm tcp"; counts="1000 100000"; timeout=60
cases="bcast-root unmatched-send extra-call skip p2p-len reduce-root after-finalize"
while [ $# -gt 0 ]; do
    case "$1" in
        --ranks) ranks="$2"; shift 2 ;;
        --transports) transports="$2"; shift 2 ;;
        --counts) counts="$2"; shift 2 ;;
        --cases) cases="$2"; shift 2 ;;
        --timeout) timeout="$2"; shift 2 ;;
        *) echo "unknown option $1" >&2; exit 2 ;;
    esac
done
if [ ! -x "$bin/ferroccl-selftest" ]; then cargo build --release -p ferroccl-run >&2; fi
printf '%-15s %-4s %5s %7s  %s\n' case tr ranks count "slowest rank (s) / ranks failed / ranks Ok"
for c in $cases; do
    for t in $transports; do
        for n in $ranks; do
            for k in $counts; do
                out=$(FERROCCL_TIMEOUT=$timeout "$bin/ferroccl-run" -n "$n" --transport "$t" --timeout $((timeout * 3)) \
                    -- "$bin/ferroccl-selftest" fault --case "$c" --count "$k" 2>&1 || true)
                failed=$(grep -c "fault $c: failed after" <<< "$out" || true)
                ok=$(grep -c "fault $c: no error after" <<< "$out" || true)
                slow=$(grep -o "fault $c: failed after [0-9.]*" <<< "$out" | awk '{print $NF}' | sort -g | tail -1)
                printf '%-15s %-4s %5s %7s  %s / %s / %s\n' "$c" "$t" "$n" "$k" "${slow:--}" "$failed" "$ok"
            done
        done
    done
done
