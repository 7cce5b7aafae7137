#!/bin/bash
# Runs inside each VM of `run.sh pair` (as root, in the host's userland): puts
# FERROCCL_SOFTROCE_IP on the VM's NIC (joined only to the other VM's NIC), creates rxe0
# on it, waits for its RoCE v2 GID and for the other VM to answer, then execs "$@" with
# FERROCCL_IB_DEV, FERROCCL_IB_GID_INDEX and FERROCCL_IB_IP set (FERROCCL_SOFTROCE_ROLE
# and FERROCCL_SOFTROCE_PEER_IP come from run.sh).
set -u
fail() { echo "softroce guest $FERROCCL_SOFTROCE_ROLE: FAILED: $*" >&2; exit 125; }
IP=$FERROCCL_SOFTROCE_IP
PEER=$FERROCCL_SOFTROCE_PEER_IP
ip link set lo up || fail "ip link set lo up"
nic=$(ls /sys/class/net | grep -v '^lo$' | head -1)
[ -n "$nic" ] || fail "no network device (is virtio_net loaded?)"
ip addr add "$IP/24" dev "$nic" && ip link set "$nic" up || fail "ip addr add $IP/24 dev $nic"
rdma link add rxe0 type rxe netdev "$nic" || fail "rdma link add rxe0 type rxe netdev $nic"

want=$(printf '0000:0000:0000:0000:0000:ffff:%02x%02x:%02x%02x' ${IP//./ })
port=/sys/class/infiniband/rxe0/ports/1
gid_index=""
for _ in $(seq 50); do
    for g in "$port"/gids/*; do
        i=${g##*/}
        if [ "$(cat "$g" 2>/dev/null)" = "$want" ] && [ "$(cat "$port/gid_attrs/types/$i" 2>/dev/null)" = "RoCE v2" ]; then
            gid_index=$i; break 2
        fi
    done
    sleep 0.1
done
[ -n "$gid_index" ] || fail "no RoCE v2 GID for $IP on rxe0 after 5 s"

# The other VM may still be booting: wait (up to 60 s) until its address resolves.
for _ in $(seq 120); do
    ip neigh show "$PEER" dev "$nic" | grep -qE 'REACHABLE|STALE|DELAY|PERMANENT' && break
    timeout 1 bash -c "exec 3<>/dev/tcp/$PEER/9" 2>/dev/null
    sleep 0.5
done
ip neigh show "$PEER" dev "$nic" | grep -qE 'REACHABLE|STALE|DELAY|PERMANENT' || fail "the other VM ($PEER) does not answer"

export FERROCCL_IB_DEV=rxe0 FERROCCL_IB_GID_INDEX=$gid_index FERROCCL_IB_IP=$IP
echo "softroce guest $FERROCCL_SOFTROCE_ROLE: kernel $(uname -r), $(nproc) cpu(s); rxe0 on $nic ($IP), gid index $gid_index; peer $PEER answers; running $*"
exec "$@"
