#!/usr/bin/env bash
# TCP point to point against iperf3, over loopback and over a veth link between two network
# namespaces, alternating (iperf3, FerroCCL, iperf3, FerroCCL, ...) in one run; then
# FerroCCL's allreduce over the veth link (Open MPI cannot be placed in two namespaces by
# mpirun here; benches/latency.sh --transport tcp compares it over loopback).
#
#   sudo bash benches/tcp.sh [--rounds 3] [--size 256M] [--no-veth]
#
# FerroCCL: ferroccl-demo's ping-pong (rank 0 sends SIZE, rank 1 sends it back; one
# direction's rate = SIZE / half the round trip), 2 ranks, FERROCCL_TRANSPORT=tcp.
# iperf3: one stream, one direction, the receiver's rate, SIZE bytes (-n). The veth link:
# namespaces fccbench-a (10.78.0.1) and fccbench-b (10.78.0.2), made and removed by this
# script (needs root and `ip`; skipped, saying so, without them). Ranks there are launched
# as torchrun launches them (rank 0 serves the store), one FERROCCL_HOST_ID per namespace.
# Prints one row per round and transport, then the medians and FerroCCL / iperf3.
set -euo pipefail
rounds=3
size=256M
veth=1
while [ $# -gt 0 ]; do
    case "$1" in
        --rounds) rounds="$2"; shift 2 ;;
        --size) size="$2"; shift 2 ;;
        --no-veth) veth=0; shift ;;
        -h|--help) sed -n "2,16p" "$0"; exit 0 ;;
        *) echo "tcp.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
command -v iperf3 >/dev/null || { echo "tcp.sh: iperf3 is not installed (apt-get install iperf3)" >&2; exit 2; }
bytes=$(python3 -c "import sys; s=sys.argv[1]; m={'K':1<<10,'M':1<<20,'G':1<<30}; print(int(s[:-1])*m[s[-1]] if s[-1] in m else int(s))" "$size")
cargo build --release -q -p ferroccl-run
B=$root/target/release
out=$(mktemp -d /tmp/ferroccl-tcp.XXXX)
rows="$out/rows.txt"
: > "$rows"

ns_a=fccbench-a
ns_b=fccbench-b
cleanup() {
    ip netns del "$ns_a" 2>/dev/null || true
    ip netns del "$ns_b" 2>/dev/null || true
}
if [ "$veth" = 1 ]; then
    cleanup
    if ip netns add "$ns_a" 2>/dev/null && ip netns add "$ns_b"; then
        trap cleanup EXIT
        ip -n "$ns_a" link set lo up
        ip -n "$ns_b" link set lo up
        ip -n "$ns_a" link add va type veth peer name vb netns "$ns_b"
        ip -n "$ns_a" addr add 10.78.0.1/24 dev va
        ip -n "$ns_b" addr add 10.78.0.2/24 dev vb
        ip -n "$ns_a" link set va up
        ip -n "$ns_b" link set vb up
    else
        echo "tcp.sh: cannot make network namespaces (root and ip needed): veth link skipped" >&2
        veth=0
    fi
fi

# iperf3 LINK: the receiver's rate in GB/s.
iperf() {
    local srv=() cli=() addr=127.0.0.1
    if [ "$1" = veth ]; then
        srv=(ip netns exec "$ns_a") cli=(ip netns exec "$ns_b") addr=10.78.0.1
    fi
    "${srv[@]}" iperf3 -s -1 -p 5399 >/dev/null 2>&1 &
    local pid=$!
    sleep 0.3
    "${cli[@]}" iperf3 -c "$addr" -p 5399 -n "$bytes" -f m 2>&1 | awk '/receiver/ { for (i = 1; i <= NF; i++) if ($(i+1) == "Mbits/sec") { printf "%.3f\n", $i / 8000; exit } }'
    wait "$pid" 2>/dev/null || true
}

# ferroccl LINK: one direction's rate in GB/s (ping-pong of SIZE).
ferroccl() {
    local line
    if [ "$1" = loopback ]; then
        line=$("$B/ferroccl-run" -n 2 --transport tcp -- "$B/ferroccl-demo" --sizes "$size" --allreduce 8 | grep -E '^\[0\] rank 0 <-> 1')
    else
        local port=$((29500 + RANDOM % 1000)) pids=()
        for r in 0 1; do
            local ns=$ns_a
            [ "$r" = 1 ] && ns=$ns_b
            ip netns exec "$ns" env RANK=$r WORLD_SIZE=2 MASTER_ADDR=10.78.0.1 MASTER_PORT=$port \
                TORCHELASTIC_RUN_ID=tcpbench-$$-$RANDOM FERROCCL_TOKEN=tcpbench-$$ FERROCCL_HOST_ID=$ns FERROCCL_TRANSPORT=tcp \
                "$B/ferroccl-demo" --sizes "$size" --allreduce 8 >"$out/veth-$r.txt" 2>&1 &
            pids+=($!)
        done
        wait "${pids[@]}"
        line=$(grep -E '^rank 0 <-> 1' "$out/veth-0.txt")
    fi
    echo "$line" | grep -o '[0-9.]* GB/s' | tail -1 | cut -d' ' -f1
}

links=(loopback)
[ "$veth" = 1 ] && links+=(veth)
for i in $(seq 1 "$rounds"); do
    for link in "${links[@]}"; do
        a=$(iperf "$link")
        f=$(ferroccl "$link")
        b=$(iperf "$link")
        echo "round $i $link: iperf3 $a GB/s, FerroCCL $f GB/s, iperf3 $b GB/s"
        echo "$link $i $a $f $b" >>"$rows"
    done
done
echo "== medians ($size, $rounds rounds; ratio: FerroCCL / the mean of the iperf3 runs on either side, per round)"
for link in "${links[@]}"; do
    awk -v l="$link" 'BEGIN { n = 0 } $1 == l { ip[n] = ($3 + $5) / 2; f[n] = $4; r[n] = $4 / (($3 + $5) / 2); n++ }
        function med(a, n,   i, j, t) { for (i = 0; i < n; i++) for (j = i + 1; j < n; j++) if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t }
            return n % 2 ? a[int(n / 2)] : (a[n / 2 - 1] + a[n / 2]) / 2 }
        END { printf "%-8s iperf3 %.2f GB/s  FerroCCL %.2f GB/s  ratio %.2f\n", l, med(ip, n), med(f, n), med(r, n) }' "$rows"
done

if [ "$veth" = 1 ]; then
    echo "== FerroCCL allreduce f32 over the veth link (2 ranks, one per namespace; ferroccl-perf latency)"
    port=$((30500 + RANDOM % 1000)) pids=()
    for r in 0 1; do
        ns=$ns_a
        [ "$r" = 1 ] && ns=$ns_b
        ip netns exec "$ns" env RANK=$r WORLD_SIZE=2 MASTER_ADDR=10.78.0.1 MASTER_PORT=$port \
            TORCHELASTIC_RUN_ID=tcpbench-$$-ar FERROCCL_TOKEN=tcpbench-$$ FERROCCL_HOST_ID=$ns FERROCCL_TRANSPORT=tcp \
            taskset -c "$r" "$B/ferroccl-perf" latency --sizes 8,64K,1M,16M --dtype f32 --coll allreduce -n 200 --batches 4 >"$out/veth-ar-$r.txt" 2>&1 &
        pids+=($!)
    done
    wait "${pids[@]}"
    grep -E "size\(B\)|blocking|plan|wrong" "$out/veth-ar-0.txt" | grep -v "^#  blocking"
fi
echo "# rows and logs: $out"
