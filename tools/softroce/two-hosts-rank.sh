#!/bin/bash
# Per-rank wrapper for a two-"host" job in one VM (see two-hosts.sh):
#   ferroccl-run -n N -- two-hosts-rank.sh PROGRAM [ARGS...]
# Ranks below FERROCCL_TWO_HOSTS_SPLIT (default N/2) are on host A with rxe0, the others on
# host B with rxe1; each host has its own FERROCCL_HOST_ID, so FERROCCL_TRANSPORT=auto
# picks shm inside a host and verbs across.
split=${FERROCCL_TWO_HOSTS_SPLIT:-$(( FERROCCL_WORLD_SIZE / 2 ))}
if [ "$FERROCCL_RANK" -lt "$split" ]; then
    export FERROCCL_HOST_ID=softroce-host-a FERROCCL_IB_DEV=rxe0 FERROCCL_IB_GID_INDEX=$FERROCCL_TWO_HOSTS_GID_A
else
    export FERROCCL_HOST_ID=softroce-host-b FERROCCL_IB_DEV=rxe1 FERROCCL_IB_GID_INDEX=$FERROCCL_TWO_HOSTS_GID_B
fi
exec "$@"
