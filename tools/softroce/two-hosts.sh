#!/bin/bash
# Sourced inside the soft-RoCE VM (after guest.sh): a second rxe device, rxe1 on veth1
# (192.0.2.2), so that one VM holds two "hosts" whose RDMA traffic crosses the veth pair.
# Traffic between two local addresses would take the kernel's local route (and rxe finds
# no device for lo), so policy routing sends 192.0.2.1 <-> 192.0.2.2 out through the
# veth pair instead. (Network namespaces do not work: rxe's UDP socket is in the first.)
# Exports FERROCCL_TWO_HOSTS_GID_A / _B: the RoCE v2 GID indexes of rxe0 and rxe1.
# Returns non-zero if any step fails.
two_hosts_setup() {
    local i g want=0000:0000:0000:0000:0000:ffff:c000:0202
    ip addr add 192.0.2.2/24 dev veth1 || return 1
    for i in all default veth0 veth1; do
        sysctl -qw net.ipv4.conf.$i.accept_local=1 net.ipv4.conf.$i.rp_filter=0 || return 1
    done
    ip rule add pref 100 iif veth0 lookup local && ip rule add pref 101 iif veth1 lookup local \
        && ip route add 192.0.2.2/32 dev veth0 src 192.0.2.1 table 10 \
        && ip route add 192.0.2.1/32 dev veth1 src 192.0.2.2 table 11 \
        && ip rule add pref 200 to 192.0.2.2 lookup 10 && ip rule add pref 201 to 192.0.2.1 lookup 11 \
        && ip rule add pref 1000 lookup local && ip rule del pref 0 lookup local || return 1
    rdma link add rxe1 type rxe netdev veth1 || return 1
    for _ in $(seq 50); do
        for g in /sys/class/infiniband/rxe1/ports/1/gids/*; do
            if [ "$(cat "$g" 2>/dev/null)" = "$want" ]; then
                export FERROCCL_TWO_HOSTS_GID_A=$FERROCCL_IB_GID_INDEX FERROCCL_TWO_HOSTS_GID_B=${g##*/}
                return 0
            fi
        done
        sleep 0.1
    done
    return 1
}
