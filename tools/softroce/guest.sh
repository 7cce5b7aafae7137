#!/bin/bash
# Runs inside the soft-RoCE VM (as root, in the host's userland): creates the rxe device
# rxe0 on one end of a veth pair, then execs "$@" with FERROCCL_IB_DEV, FERROCCL_IB_GID_INDEX
# (the RoCEv2 GID of FERROCCL_IB_IP) and FERROCCL_IB_IP set.
# Not lo: rxe on lo does not work. Traffic from rxe0 to its own address takes rxe's
# internal loopback path, so several QPs/processes on rxe0 can talk to each other.
set -u
fail() { echo "softroce guest: FAILED: $*" >&2; exit 125; }
IP=192.0.2.1   # documentation range; exists only inside the guest (the VM has no NIC)
# Loopback for multi-process jobs (ferroccl-run's bootstrap store listens on 127.0.0.1).
ip link set lo up || fail "ip link set lo up"
ip link add veth0 type veth peer name veth1 || fail "ip link add veth0 type veth peer name veth1"
ip addr add "$IP/24" dev veth0 || fail "ip addr add $IP/24 dev veth0"
ip link set veth0 up && ip link set veth1 up || fail "ip link set veth0/veth1 up"
rdma link add rxe0 type rxe netdev veth0 || fail "rdma link add rxe0 type rxe netdev veth0 (is crc32_generic loaded?)"

# The IPv4-mapped GID ::ffff:192.0.2.1 of type RoCE v2 (it appears shortly after the link).
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
[ -n "$gid_index" ] || fail "no RoCE v2 GID for $IP on rxe0 after 5 s: $(grep -H . "$port"/gids/* 2>/dev/null | grep -v ':0000:0000:0000:0000:0000:0000:0000:0000$')"
grep -q ACTIVE "$port/state" || fail "rxe0 port 1 is not ACTIVE: $(cat "$port/state")"

export FERROCCL_IB_DEV=rxe0 FERROCCL_IB_GID_INDEX=$gid_index FERROCCL_IB_IP=$IP
echo "softroce guest: kernel $(uname -r), $(nproc) cpus; rxe0 on veth0 ($IP), gid index $gid_index; running $*"
exec "$@"
