#!/usr/bin/env bash
# CI step for the verbs layer: install what is missing (VM packages and the rdma-sys
# build dependencies, via `run.sh setup`), build ferroccl-verbs' tests with the `verbs`
# feature on the host, and run every test binary inside the soft-RoCE VM (one boot).
# Exits non-zero when anything fails.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$HERE/../.."
t0=$(date +%s)
log() { printf '[softroce-ci %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

bash "$HERE/run.sh" setup

# Default target CPU only: the VM's CPU has AVX2 but no AVX-512 (no target-cpu=native).
json=$(cargo test -p ferroccl-verbs --features verbs --release --no-run --message-format=json) \
    || { log "FAILED: building the ferroccl-verbs tests with --features verbs"; exit 1; }
mapfile -t bins < <(grep -o '"executable":"[^"]*"' <<< "$json" | sed 's/^"executable":"//; s/"$//')
[ ${#bins[@]} -gt 0 ] || { log "FAILED: cargo built no test binary"; exit 1; }
log "built ${#bins[@]} test binaries in $(( $(date +%s) - t0 )) s"

# Inside the VM the tests must not skip for want of a device.
export FERROCCL_VERBS_REQUIRED=1
rc=0
bash "$HERE/run.sh" test "$HERE/run-each.sh" "${bins[@]}" || rc=$?
log "verbs tests in the VM: exit status $rc; total $(( $(date +%s) - t0 )) s"
exit "$rc"
