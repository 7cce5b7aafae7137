#!/usr/bin/env python3
"""A lossy, slow link for the multi-process tests (this kernel has no netem qdisc).

    lossy_link.py IF_A IF_B LOSS DELAY_MS SEED

Run in a namespace of its own that holds one end of two veth links (IF_A, IF_B): every
Ethernet frame that arrives on one is sent out of the other DELAY_MS later, except that
each is dropped with probability LOSS (0.01 = 1 %). Frames this process sent are not
taken again. Ends on SIGTERM. Also turns segmentation and checksum offloads off on its
two ends (`offloads_off`): frames must be whole and carry their checksums to be forwarded
one by one; the namespaces at the other ends must do the same on theirs (run this file
with `--offloads-off IF` there).
"""
import array
import fcntl
import heapq
import random
import select
import signal
import socket
import struct
import sys
import time

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4
SIOCETHTOOL = 0x8946
# ETHTOOL_S*: tx checksum, scatter-gather, TSO, GSO, GRO.
OFFLOADS = [0x17, 0x19, 0x1F, 0x24, 0x2C]


def offloads_off(ifname):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for cmd in OFFLOADS:
        val = array.array("B", struct.pack("II", cmd, 0))
        addr, _ = val.buffer_info()
        ifreq = struct.pack("16sP", ifname.encode(), addr).ljust(40, b"\0")
        try:
            fcntl.ioctl(s, SIOCETHTOOL, ifreq)
        except OSError as e:
            # Not every device has every offload; the ones that matter (TSO, GSO, tx
            # checksum) exist on veth.
            if cmd in (0x17, 0x1F, 0x24):
                sys.exit(f"lossy_link: turning offload {cmd:#x} off on {ifname}: {e}")
    s.close()


def main():
    if sys.argv[1] == "--offloads-off":
        for name in sys.argv[2:]:
            offloads_off(name)
        return
    if_a, if_b, loss, delay_ms, seed = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
    rng = random.Random(seed)
    offloads_off(if_a)
    offloads_off(if_b)
    socks = {}
    for name in (if_a, if_b):
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        s.bind((name, 0))
        s.setblocking(False)
        socks[name] = s
    other = {if_a: socks[if_b], if_b: socks[if_a]}
    by_fd = {s.fileno(): name for name, s in socks.items()}
    running = [True]
    signal.signal(signal.SIGTERM, lambda *_: running.__setitem__(0, False))
    queue = []  # (due, n, socket, frame)
    n = 0
    counts = {"in": 0, "dropped": 0, "out": 0}
    poller = select.poll()
    for s in socks.values():
        poller.register(s, select.POLLIN)
    while running[0]:
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            _, _, s, frame = heapq.heappop(queue)
            try:
                s.send(frame)
                counts["out"] += 1
            except OSError:
                pass
        wait = max(0.0, queue[0][0] - now) if queue else 0.05
        for fd, _ in poller.poll(wait * 1000):
            name = by_fd[fd]
            s = socks[name]
            while True:
                try:
                    frame, addr = s.recvfrom(65535)
                except BlockingIOError:
                    break
                if addr[2] == PACKET_OUTGOING:
                    continue
                counts["in"] += 1
                if rng.random() < loss:
                    counts["dropped"] += 1
                    continue
                n += 1
                heapq.heappush(queue, (time.monotonic() + delay_ms / 1000.0, n, other[name], frame))
    print(f"lossy_link: {counts['in']} frames in, {counts['dropped']} dropped, {counts['out']} forwarded", flush=True)


if __name__ == "__main__":
    main()
