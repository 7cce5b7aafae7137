#!/bin/bash
# Runs inside both VMs of `run.sh pair` (via ci.sh): one FerroCCL job of 4 ranks across
# the two VMs, ranks 0 and 1 on VM a, 2 and 3 on VM b, started by hand with torchrun's
# variables (rank 0 serves the bootstrap store on VM a, 192.0.2.1, a port per job), the job token
# from FERROCCL_TOKEN (ci.sh sets one). FERROCCL_TRANSPORT=auto: shm inside a VM (same
# host), verbs between the VMs (two hosts, two rxe devices, packets on a real NIC link).
#   pair-suite.sh BIN_DIR
# Every rank runs `ferroccl-selftest exchange`, then `coll` (every collective, checked
# against the reference), then `weights --sources 2` (M->N weight sync: ranks 0 and 1 on
# VM a train, 2 and 3 on VM b pull and check every byte of every version). Exits 1 if any
# of this VM's ranks failed.
set -u
bin_dir=$1
[ -n "${FERROCCL_TOKEN:-}" ] || { echo "pair-suite: FERROCCL_TOKEN must be set"; exit 2; }
case "$FERROCCL_SOFTROCE_ROLE" in a) ranks=(0 1) ;; b) ranks=(2 3) ;; *) exit 2 ;; esac
export WORLD_SIZE=4 MASTER_ADDR=192.0.2.1 LOCAL_WORLD_SIZE=2 FERROCCL_TIMEOUT=120
port=29500
rc=0
for mode in "exchange --sizes 0,1,70000,1M" "coll --counts 0,1,7,1000,65537" "weights --sources 2 --versions 5"; do
    # A fresh store port per job: the previous job's store may still be winding down.
    port=$(( port + 10 ))
    export MASTER_PORT=$port
    pids=()
    for r in "${ranks[@]}"; do
        # shellcheck disable=SC2086
        RANK=$r LOCAL_RANK=$(( r % 2 )) timeout 300 "$bin_dir/ferroccl-selftest" $mode > "/tmp/rank$r.log" 2>&1 &
        pids+=($!)
    done
    for i in "${!pids[@]}"; do
        r=${ranks[$i]}
        if wait "${pids[$i]}"; then st=0; else st=$?; fi
        sed "s/^/[rank $r] /" "/tmp/rank$r.log" | grep -E "exchanged|collectives ok|weights ok|error|rank $r ok" | head -5
        [ "$st" -eq 0 ] || { echo "=== FAILED: rank $r, ${mode%% *}: exit $st"; tail -5 "/tmp/rank$r.log"; rc=1; }
        if [ "${mode%% *}" = weights ]; then
            grep -q "rank $r weights ok" "/tmp/rank$r.log" || { echo "=== FAILED: rank $r printed no weights ok line"; rc=1; }
        fi
    done
    if [ "${mode%% *}" = exchange ]; then
        # auto must have picked shm inside this VM and verbs to the other.
        case "$FERROCCL_SOFTROCE_ROLE" in a) want='(1:shm 2:verbs 3:verbs)' ;; b) want='(0:verbs 1:verbs 3:shm)' ;; esac
        grep -qF "$want" "/tmp/rank${ranks[0]}.log" || { echo "=== FAILED: rank ${ranks[0]} did not use $want"; rc=1; }
    fi
    echo "=== ${mode%% *} across two VMs: this VM's ranks ${ranks[*]} done (status so far $rc)"
done
exit $rc
