//! Choosing an algorithm: a latency-bandwidth cost model.
//!
//! For each algorithm that implements the collective (and accepts the dtype and op, see
//! [`Algo::supports_op`]) [`estimate`] predicts the call's time as
//!
//! ```text
//! time = rounds * latency + messages * MSG_OVERHEAD * latency
//!      + max(wire_bytes / bandwidth * contention, reduced_bytes / REDUCE_GBPS)
//!      + sends * msg_us   (only for messages up to SMALL_BYTES)
//! ```
//!
//! (chunks are pipelined, so reductions overlap with the wire and the slower of the two
//! sets the pace);
//!
//! * `rounds`: dependent message latencies on the critical path (ring: `n - 1` per phase;
//!   mesh and oneshot: 1 per phase; chain: `n - 1` hops);
//! * `messages`: messages one rank posts beyond one per round (mesh posts `n - 1` at once:
//!   each costs software time even when the wire overlaps them);
//! * `wire_bytes`: the most bytes any rank sends (or receives), in units of the message;
//! * `contention`: `1 + MESH_CONTENTION * (n - 2)` for the mesh algorithms, whose `n - 1`
//!   simultaneous peers share the rank's link and memory, 1 otherwise;
//! * `reduced_bytes`: bytes one rank's reductions read;
//! * `sends`: messages the busiest rank sends (or, a rooted collective's root, receives) in
//!   all: ring and mesh allreduce `2 (n - 1)`, oneshot `n - 1`, Bruck and the binomial tree
//!   `ceil(log2 n)`, the chain 1; each costs the link's `msg_us` of software time while the
//!   call is small (beyond [`SMALL_BYTES`] copying the bytes dominates, and the terms above
//!   were fitted there without it).
//!
//! [`choose`] returns the cheapest. The constants are deliberately simple; they and the
//! [`LinkCost`] of each transport are where measurements should be fed back. Small messages
//! pick oneshot (allreduce) or mesh (one round), or over tcp from 4 ranks Bruck (allreduce,
//! allgather) or the binomial tree (broadcast), for fewer messages; large ones ring
//! (allreduce, allgather, reduce-scatter) or chain (broadcast). See docs/algorithms.md.

use ferroccl_kernels::{DType, ReduceOp};

use super::{Algo, Collective};

/// A transport's cost per message and per byte.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct LinkCost {
    /// One message's latency (microseconds).
    pub(crate) latency_us: f64,
    /// Per-rank bandwidth (GB/s, 1e9 bytes per second).
    pub(crate) gbps: f64,
    /// Software time of each small message a rank sends (microseconds): system calls,
    /// headers, the peer's wake-up.
    pub(crate) msg_us: f64,
}

/// Link costs the cost model assumes (rough measurements on one host; see
/// docs/algorithms.md). tcp's `msg_us` is fitted to 4 ranks over loopback (2 CPUs,
/// alternating, 8 B to 32 KiB): Bruck's 2 messages a rank took 0.76-0.94x the time of
/// oneshot's and the mesh allgather's 3. Over shm small calls take the low-latency slots,
/// so no message cost was fitted there.
pub(crate) const SHM_LINK: LinkCost = LinkCost { latency_us: 1.5, gbps: 8.0, msg_us: 0.0 };
pub(crate) const TCP_LINK: LinkCost = LinkCost { latency_us: 30.0, gbps: 3.0, msg_us: 22.0 };

/// Messages up to this size (bytes: `bytes` as [`estimate`] takes it) pay their link's
/// `msg_us`, and only they may take Bruck or the binomial tree: Bruck's allreduce moves
/// `n - 1` times the message through `ceil(log2 n)` dependent rounds (measured, 4 ranks over
/// tcp: 32 KiB 0.94x oneshot's time, 64 KiB 1.3x the mesh's); the tree was measured at
/// small sizes only.
pub(crate) const SMALL_BYTES: usize = 32 << 10;

/// Extra cost of each additional message posted in one round, as a fraction of the latency.
const MSG_OVERHEAD: f64 = 0.25;
/// Bandwidth lost per extra simultaneous peer of the mesh algorithms.
const MESH_CONTENTION: f64 = 0.05;
/// Ranks up to which the mesh alltoallv pays no contention against the pairwise one:
/// measured on 2 and 4 ranks (2 CPUs, shm and TCP, 1 KiB to 64 MiB per rank, alternating),
/// neither was consistently faster (docs/algorithms.md, "alltoallv: mesh or pairwise"), so
/// up to 4 ranks the mesh's single round wins; beyond, the mesh's usual contention
/// (`MESH_CONTENTION` per extra peer) is assumed, not measured.
const ALLTOALLV_FREE_RANKS: f64 = 4.0;
/// Steps of the pairwise alltoallv in flight.
const PAIRWISE_WINDOW: usize = super::pairwise::alltoallv::WINDOW;
/// Reduction throughput (GB/s of input read) of one core.
const REDUCE_GBPS: f64 = 20.0;
/// Pipeline chunk assumed for the chain's fill time (bytes).
const CHAIN_CHUNK: f64 = 512.0 * 1024.0;

/// Predicted time in microseconds of `coll` with `algo` on `n` ranks, for `bytes` =
/// `count * dtype size` (`count` as in [`super::Shape`]), or `None` if the algorithm does not
/// implement it.
pub(crate) fn estimate(algo: Algo, coll: Collective, n: usize, bytes: usize, link: LinkCost) -> Option<f64> {
    if !algo.supports(coll) {
        return None;
    }
    if n <= 1 {
        return Some(0.0);
    }
    let nf = n as f64;
    // S: the message in bytes; for the per-rank-count collectives, the whole n * count.
    let s = bytes as f64;
    let total = match coll {
        Collective::AllGather | Collective::ReduceScatter | Collective::AllToAll => s * nf,
        _ => s,
    };
    let frac = (nf - 1.0) / nf;
    let contention = 1.0 + MESH_CONTENTION * (nf - 2.0);
    let small = bytes <= SMALL_BYTES;
    if matches!(algo, Algo::Bruck | Algo::Binomial) && !small {
        return None;
    }
    // Bruck's rounds and the binomial tree's depth (and their messages: one a round).
    let log_rounds = n.next_power_of_two().trailing_zeros() as f64;
    // (rounds, extra messages, wire bytes, bandwidth factor, reduced bytes)
    let (rounds, msgs, wire, factor, reduced) = match (algo, coll) {
        // Each of the n - 1 pairwise reductions reads two blocks of S / n.
        (Algo::Ring, Collective::AllReduce) => (2.0 * (nf - 1.0), 0.0, 2.0 * frac * total, 1.0, 2.0 * frac * total),
        (Algo::Ring, Collective::AllGather) => (nf - 1.0, 0.0, frac * total, 1.0, 0.0),
        (Algo::Ring, Collective::ReduceScatter) => (nf - 1.0, 0.0, frac * total, 1.0, 2.0 * frac * total),
        // One ReduceMany reads n blocks of S / n.
        (Algo::Mesh, Collective::AllReduce) => (2.0, 2.0 * (nf - 2.0), 2.0 * frac * total, contention, total),
        (Algo::Mesh, Collective::AllGather | Collective::AllToAll) => (1.0, nf - 2.0, frac * total, contention, 0.0),
        // `bytes`: this rank's whole send buffer (its counts are its own).
        // Measured: no contention up to ALLTOALLV_FREE_RANKS ranks (see the constant).
        (Algo::Mesh, Collective::AllToAllV) => {
            let contention = 1.0 + MESH_CONTENTION * (nf - ALLTOALLV_FREE_RANKS).max(0.0);
            (1.0, nf - 2.0, frac * total, contention, 0.0)
        }
        // One round per window of steps, the same bytes, one peer sending to each rank.
        (Algo::Pairwise, Collective::AllToAllV) => {
            let rounds = ((nf - 1.0) / PAIRWISE_WINDOW as f64).ceil();
            (rounds, nf - 1.0 - rounds, frac * total, 1.0, 0.0)
        }
        // The root receives (sends) n - 1 blocks of this rank's count.
        (Algo::Mesh, Collective::Gather { .. } | Collective::Scatter { .. } | Collective::GatherV { .. } | Collective::ScatterV { .. }) => {
            (1.0, nf - 2.0, (nf - 1.0) * total, 1.0, 0.0)
        }
        (Algo::Mesh, Collective::ReduceScatter | Collective::ReduceScatterV) => (1.0, nf - 2.0, frac * total, contention, total),
        // `bytes`: this rank's block, to every peer.
        (Algo::Mesh, Collective::AllGatherV) => (1.0, nf - 2.0, (nf - 1.0) * total, contention, 0.0),
        // The root receives (sends) n - 1 messages.
        (Algo::Mesh, Collective::Reduce { .. }) => (1.0, nf - 2.0, (nf - 1.0) * total, 1.0, nf * total),
        (Algo::Mesh, Collective::Broadcast { .. }) => (1.0, nf - 2.0, (nf - 1.0) * total, 1.0, 0.0),
        (Algo::OneShot, Collective::AllReduce) => (1.0, nf - 2.0, (nf - 1.0) * total, contention, nf * total),
        // Every input gathered, then one ReduceMany (as oneshot, after the wire).
        (Algo::Bruck, Collective::AllReduce) => (log_rounds, 0.0, (nf - 1.0) * total, 1.0, nf * total),
        // The gathered blocks copied into place.
        (Algo::Bruck, Collective::AllGather) => (log_rounds, 0.0, frac * total, 1.0, total),
        // The root sends the message once per level.
        (Algo::Binomial, Collective::Broadcast { .. }) => (log_rounds, 0.0, log_rounds * total, 1.0, 0.0),
        // Pipelined: the last rank gets the last chunk n - 2 chunk-times after the first hop.
        (Algo::Chain, Collective::Broadcast { .. }) => (nf - 1.0, 0.0, total + (nf - 2.0) * total.min(CHAIN_CHUNK), 1.0, 0.0),
        _ => return None,
    };
    let per_byte_us = 1e-3 / link.gbps; // 1 byte at `gbps` GB/s, in microseconds
    let (wire_us, reduce_us) = (wire * factor * per_byte_us, reduced * 1e-3 / REDUCE_GBPS);
    // Oneshot reduces a chunk only once all n - 1 copies of it have landed (and, in place,
    // been sent): its reduction follows the wire instead of overlapping it (measured, 2
    // ranks, shm, f32: 1 MiB 185 us against the ring's 105, 256 KiB 49 against 38).
    let body = if matches!(algo, Algo::OneShot | Algo::Bruck) { wire_us + reduce_us } else { wire_us.max(reduce_us) };
    // `sends` (see the module docs): every round is one message, plus the extra ones
    // posted with it; the chain's root and links send once.
    let sends = if algo == Algo::Chain { 1.0 } else { rounds + msgs };
    let small_us = if small { sends * link.msg_us } else { 0.0 };
    Some(rounds * link.latency_us + msgs * MSG_OVERHEAD * link.latency_us + body + small_us)
}

/// The cheapest algorithm for `coll` by [`estimate`], among those that [`build`](super::build)
/// accepts for `dtype` and `op` (so never the ring for integer `Avg`). Ties go to the
/// earlier of [`Algo::SCHEDULED`].
pub(crate) fn choose(coll: Collective, n: usize, bytes: usize, dtype: DType, op: ReduceOp, link: LinkCost) -> Algo {
    let mut best: Option<(f64, Algo)> = None;
    for algo in Algo::SCHEDULED {
        if !algo.supports_op(coll, dtype, op) {
            continue;
        }
        if let Some(t) = estimate(algo, coll, n, bytes, link) {
            if best.is_none_or(|(b, _)| t < b) {
                best = Some((t, algo));
            }
        }
    }
    // Mesh implements every collective with every dtype and op.
    best.map_or(Algo::Mesh, |(_, a)| a)
}

/// Every scheduled algorithm that implements `coll` with `dtype` and `op`, with its
/// [`estimate`] (microseconds), cheapest first: what [`choose`] weighed (for logs).
pub(crate) fn estimates(coll: Collective, n: usize, bytes: usize, dtype: DType, op: ReduceOp, link: LinkCost) -> Vec<(Algo, f64)> {
    let mut v: Vec<(Algo, f64)> = Algo::SCHEDULED
        .into_iter()
        .filter(|a| a.supports_op(coll, dtype, op))
        .filter_map(|a| estimate(a, coll, n, bytes, link).map(|t| (a, t)))
        .collect();
    v.sort_by(|a, b| a.1.total_cmp(&b.1));
    v
}

/// The low-latency protocol's fixed cost (microseconds): a cache-line round trip and the
/// call's bookkeeping.
const LL_LATENCY_US: f64 = 0.3;
/// Copy throughput of one core through the low-latency slots (GB/s), fitted so that the
/// model hands over to the schedules where measurement does (2 ranks pinned, f32, shm,
/// alternating ll / oneshot / mesh / ring: allreduce between 128 and 256 KiB, allgather
/// about 64-128 KiB blocks, reduce_scatter about 64 KiB blocks, broadcast past 256 KiB).
const LL_COPY_GBPS: f64 = 35.0;

/// Most slot bytes one low-latency call reads (`n` x the message; broadcast: the message) when every rank has a
/// CPU of its own, so that they stay in a core's L2 (2 ranks pinned: allreduce 128 KiB
/// 22 us over the slots against the ring's 29, 256 KiB 51 against 38).
const LL_MAX_READ: usize = 384 << 10;

/// Predicted time in microseconds of `coll` on `n` ranks over the low-latency protocol
/// (`bytes` as in [`estimate`]): one round; every byte is copied in once and read (and
/// reduced) by one core from each slot it needs.
pub(crate) fn ll_estimate(coll: Collective, n: usize, bytes: usize) -> f64 {
    let (nf, s) = (n as f64, bytes as f64);
    let copied = match coll {
        // In: s; out: n slots of s read, reduced, written.
        Collective::AllReduce | Collective::Reduce { .. } => s + nf * s + s,
        Collective::AllGather => s + 2.0 * nf * s,
        Collective::ReduceScatter => nf * s + nf * s + s,
        Collective::AllToAll => nf * s + 2.0 * nf * s,
        // Broadcast, and the per-call collectives (never on the slots).
        _ => 3.0 * s,
    };
    LL_LATENCY_US + copied * 1e-3 / LL_COPY_GBPS
}

/// Whether the low-latency protocol is predicted faster than the best schedule
/// ([`choose`]) for this call.
pub(crate) fn ll_pays(coll: Collective, n: usize, bytes: usize, dtype: DType, op: ReduceOp, link: LinkCost) -> bool {
    let best = choose(coll, n, bytes, dtype, op, link);
    estimate(best, coll, n, bytes, link).is_none_or(|t| ll_estimate(coll, n, bytes) < t)
}

/// The largest message (`bytes` as in [`estimate`], at most `max`) up to which the
/// low-latency protocol pays on `n` ranks over shm ([`ll_pays`] for f32 sums: integer
/// averages, which never take the ring, only make it pay more). `shared`: the ranks share
/// CPUs.
pub(crate) fn ll_limit(coll: Collective, n: usize, max: usize, shared: bool) -> usize {
    // With a CPU each, beyond a core's L2 of slot reads per call the copies stream from
    // memory and the model's single copy rate no longer holds. Ranks that share CPUs pay
    // for every round of a schedule with a context switch, which one round of slots
    // saves: measured, 4 ranks on 2 CPUs, alternating, f32: allreduce 256 KiB 148 us over
    // the slots against the ring's 179 (1 MiB: 529 against 533), allgather of 256 KiB
    // blocks 168 against 326; so there the slots' size is the only limit.
    // Slots read per call: every member's, but for broadcast only the root's.
    let reads = if matches!(coll, Collective::Broadcast { .. }) { 1 } else { n.max(1) };
    let max = if shared { max } else { max.min(LL_MAX_READ / reads) };
    let pays = |b: usize| ll_pays(coll, n, b, DType::F32, ReduceOp::Sum, SHM_LINK);
    if !pays(1) {
        return 0;
    }
    let (mut lo, mut hi) = (1usize, max.max(1));
    if pays(hi) {
        return hi;
    }
    // pays(lo), !pays(hi)
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if pays(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algo::{build, Shape};

    const SHM: LinkCost = SHM_LINK;
    const TCP: LinkCost = TCP_LINK;

    fn colls(n: usize) -> Vec<Collective> {
        vec![
            Collective::AllReduce,
            Collective::AllGather,
            Collective::ReduceScatter,
            Collective::AllToAll,
            Collective::Broadcast { root: n - 1 },
            Collective::Reduce { root: 0 },
        ]
    }

    #[test]
    fn small_messages_take_one_round() {
        for (link, ns) in [(SHM, &[2, 4, 8][..]), (TCP, &[2, 3][..])] {
            for &n in ns {
                assert_eq!(choose(Collective::AllReduce, n, 256, DType::F32, ReduceOp::Sum, link), Algo::OneShot, "n {n}");
            }
        }
        // (With two ranks the ring is one round too.)
        for n in [3, 4, 8, 16] {
            for coll in [Collective::AllGather, Collective::ReduceScatter, Collective::Broadcast { root: 0 }] {
                if n < 16 || coll == Collective::ReduceScatter {
                    assert_eq!(choose(coll, n, 64, DType::F32, ReduceOp::Sum, SHM), Algo::Mesh, "{coll} n {n}");
                }
                if n == 3 || coll == Collective::ReduceScatter {
                    assert_eq!(choose(coll, n, 64, DType::F32, ReduceOp::Sum, TCP), Algo::Mesh, "{coll} n {n}");
                }
            }
        }
    }

    #[test]
    fn small_messages_over_tcp_take_bruck_from_four_ranks() {
        // Measured, 4 ranks over loopback tcp (2 CPUs, alternating with the choice before
        // Bruck): allreduce 8 B - 32 KiB 0.84-0.94x oneshot's time, 64 KiB 1.3x the mesh's;
        // allgather 8 B - 32 KiB blocks 0.74-0.87x the mesh's, 64 KiB 1.5-1.7x.
        for n in [4, 8, 16, 64] {
            for bytes in [4, 256, 8 << 10, SMALL_BYTES] {
                for coll in [Collective::AllReduce, Collective::AllGather] {
                    assert_eq!(choose(coll, n, bytes, DType::F32, ReduceOp::Sum, TCP), Algo::Bruck, "{coll} n {n} {bytes}");
                }
            }
            for coll in [Collective::AllReduce, Collective::AllGather] {
                assert_ne!(choose(coll, n, SMALL_BYTES + 4, DType::F32, ReduceOp::Sum, TCP), Algo::Bruck, "{coll} n {n}");
            }
        }
        // Two ranks: one message either way, and Bruck's copy on top.
        assert_eq!(choose(Collective::AllReduce, 2, 8, DType::F32, ReduceOp::Sum, TCP), Algo::OneShot);
        // Over shm (verbs too) the latency term alone decides: oneshot's extra messages
        // outweigh Bruck's extra rounds from 16 ranks (not measured: 2 CPUs here).
        assert_eq!(choose(Collective::AllReduce, 8, 8, DType::F32, ReduceOp::Sum, SHM), Algo::OneShot);
        assert_eq!(choose(Collective::AllReduce, 16, 8, DType::F32, ReduceOp::Sum, SHM), Algo::Bruck);
    }

    #[test]
    fn small_broadcasts_over_tcp_take_the_binomial_tree_from_four_ranks() {
        let bcast = |n, bytes, link| choose(Collective::Broadcast { root: 1 }, n, bytes, DType::F32, ReduceOp::Sum, link);
        for n in [4, 8, 16, 64] {
            for bytes in [4, 256, 8 << 10, SMALL_BYTES] {
                assert_eq!(bcast(n, bytes, TCP), Algo::Binomial, "n {n} {bytes}");
            }
            assert_ne!(bcast(n, SMALL_BYTES + 4, TCP), Algo::Binomial, "n {n}");
        }
        // 2 and 3 ranks: the root sends as many messages either way.
        assert_eq!(bcast(2, 8, TCP), Algo::Mesh);
        assert_eq!(bcast(3, 8, TCP), Algo::Mesh);
        assert_eq!(bcast(8, 8, SHM), Algo::Mesh);
    }

    /// The per-message cost of small messages changes no choice but to Bruck or the binomial
    /// tree: with it set to 0 and those two left out, every choice is what the model chose
    /// before them.
    #[test]
    fn the_message_cost_only_brings_bruck_in() {
        let before = |coll, n, bytes, link: LinkCost| {
            let mut best: Option<(f64, Algo)> = None;
            for algo in Algo::SCHEDULED.into_iter().filter(|&a| !matches!(a, Algo::Bruck | Algo::Binomial)) {
                if let Some(t) = estimate(algo, coll, n, bytes, LinkCost { msg_us: 0.0, ..link }) {
                    if best.is_none_or(|(b, _)| t < b) {
                        best = Some((t, algo));
                    }
                }
            }
            best.map(|(_, a)| a)
        };
        for link in [SHM, TCP] {
            for n in [2, 3, 4, 5, 8, 16, 64] {
                for coll in colls(n) {
                    for shift in 0..30 {
                        let bytes = 1usize << shift;
                        let now = choose(coll, n, bytes, DType::F32, ReduceOp::Sum, link);
                        if !matches!(now, Algo::Bruck | Algo::Binomial) {
                            assert_eq!(Some(now), before(coll, n, bytes, link), "{coll} n {n} 2^{shift}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn large_messages_take_the_ring() {
        for link in [SHM, TCP] {
            for n in [4, 8, 16] {
                let big = 256 << 20;
                assert_eq!(choose(Collective::AllReduce, n, big, DType::F32, ReduceOp::Sum, link), Algo::Ring, "n {n}");
                assert_eq!(choose(Collective::AllGather, n, big / n, DType::Bf16, ReduceOp::Sum, link), Algo::Ring, "n {n}");
                assert_eq!(choose(Collective::ReduceScatter, n, big / n, DType::F16, ReduceOp::Max, link), Algo::Ring, "n {n}");
                assert_eq!(choose(Collective::Broadcast { root: 1 }, n, big, DType::U8, ReduceOp::Sum, link), Algo::Chain, "n {n}");
            }
        }
    }

    #[test]
    fn integer_avg_never_picks_the_ring() {
        for n in [2, 3, 8, 16] {
            for bytes in [4, 1 << 20, 1 << 30] {
                for coll in [Collective::AllReduce, Collective::ReduceScatter] {
                    let a = choose(coll, n, bytes, DType::I32, ReduceOp::Avg, TCP);
                    assert_ne!(a, Algo::Ring, "{coll} n {n} bytes {bytes}");
                }
            }
        }
    }

    #[test]
    fn every_choice_builds() {
        for link in [SHM, TCP] {
            for n in [1, 2, 3, 5, 8, 16] {
                for coll in colls(n) {
                    for shift in [0, 4, 10, 16, 20, 26] {
                        for dtype in [DType::F32, DType::Bf16, DType::I64, DType::U8] {
                            for op in ReduceOp::ALL {
                                let count = (1usize << shift) / dtype.size() + 1;
                                let algo = choose(coll, n, count * dtype.size(), dtype, op, link);
                                let shape =
                                    Shape { coll, n, rank: n - 1, count: 3, dtype, op, chunk_bytes: 1 << 20, in_place: false, slots: 0 };
                                assert!(build(algo, &shape).is_ok(), "{coll} n {n} {dtype} {op}: {algo}");
                                assert!(estimate(algo, coll, n, count, link).is_some_and(f64::is_finite));
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn the_low_latency_protocol_takes_small_messages_only() {
        let cap = 256 << 10;
        for n in [2, 3, 4, 8] {
            for shared in [false, true] {
                for coll in colls(n) {
                    let per = if matches!(coll, Collective::ReduceScatter | Collective::AllToAll) { n } else { 1 };
                    let lim = ll_limit(coll, n, cap / per, shared);
                    // It pays for the smallest messages, never past the slots, nor past a
                    // core's L2 when the ranks have a CPU each.
                    assert!(lim >= 64, "{coll} n {n}: {lim}");
                    let reads = if matches!(coll, Collective::Broadcast { .. }) { 1 } else { n };
                    assert!(lim <= cap / per && (shared || lim <= LL_MAX_READ / reads), "{coll} n {n}: {lim}");
                    assert!(
                        ll_estimate(coll, n, 8) < estimate(choose(coll, n, 8, DType::F32, ReduceOp::Sum, SHM), coll, n, 8, SHM).unwrap()
                    );
                }
            }
        }
        // 2 ranks with a CPU each, as measured: allreduce handed back to the schedules
        // between 128 and 256 KiB, allgather between 32 and 128 KiB blocks.
        let lim = ll_limit(Collective::AllReduce, 2, cap, false);
        assert!((128 << 10..256 << 10).contains(&lim), "{lim}");
        let lim = ll_limit(Collective::AllGather, 2, cap, false);
        assert!((32 << 10..128 << 10).contains(&lim), "{lim}");
        // Broadcast reads one slot: 2 ranks pinned, 256 KiB 26 us over the slots against
        // 35-38 scheduled, 512 KiB 56 against 75.
        assert_eq!(ll_limit(Collective::Broadcast { root: 0 }, 2, cap, false), cap);
        // 4 ranks on 2 CPUs: the slots' size.
        assert_eq!(ll_limit(Collective::AllReduce, 4, cap, true), cap);
    }

    #[test]
    fn two_ranks_take_the_ring_past_small_messages() {
        // Measured (2 ranks, shm, f32): oneshot 16 KiB 6.6 us against the ring's 6.1, 1 MiB
        // 185 against 105.
        for bytes in [64 << 10, 1 << 20, 4 << 20, 256 << 20] {
            assert_eq!(choose(Collective::AllReduce, 2, bytes, DType::F32, ReduceOp::Sum, SHM), Algo::Ring, "{bytes}");
        }
        assert_eq!(choose(Collective::AllReduce, 2, 4 << 10, DType::F32, ReduceOp::Sum, SHM), Algo::OneShot);
    }

    #[test]
    fn alltoallv_takes_pairwise_only_for_many_ranks_and_large_blocks() {
        let a2av = |n, bytes, link| choose(Collective::AllToAllV, n, bytes, DType::F32, ReduceOp::Sum, link);
        // Measured on 2 and 4 ranks: no gain from pairwise, 1 KiB to 64 MiB.
        for link in [SHM, TCP] {
            for n in [2, 3, 4] {
                for shift in [0, 10, 16, 20, 26, 30] {
                    assert_eq!(a2av(n, 1 << shift, link), Algo::Mesh, "n {n} 2^{shift}");
                }
            }
            // Beyond: small calls stay on the mesh (fewer rounds), large ones take pairwise.
            for n in [8, 16, 64] {
                assert_eq!(a2av(n, 1 << 10, link), Algo::Mesh, "n {n}");
                assert_eq!(a2av(n, 64 << 20, link), Algo::Pairwise, "n {n}");
            }
        }
        // 8 ranks: the crossover near 150 KiB over shm, 1.1 MiB over TCP.
        assert_eq!(a2av(8, 128 << 10, SHM), Algo::Mesh);
        assert_eq!(a2av(8, 192 << 10, SHM), Algo::Pairwise);
        assert_eq!(a2av(8, 1 << 20, TCP), Algo::Mesh);
        assert_eq!(a2av(8, 3 << 19, TCP), Algo::Pairwise);
        // Pairwise implements nothing else.
        for coll in colls(8) {
            assert!(estimate(Algo::Pairwise, coll, 8, 1 << 20, SHM).is_none(), "{coll}");
        }
    }

    #[test]
    fn one_rank_costs_nothing() {
        assert_eq!(estimate(Algo::Ring, Collective::AllReduce, 1, 1 << 20, TCP), Some(0.0));
        assert_eq!(estimate(Algo::Chain, Collective::AllReduce, 4, 1 << 20, TCP), None);
    }
}
