//! The point-to-point properties (and split), over one instantiation's transport.
//!
//! Every proptest case starts a fresh bootstrap store and a fresh job of 2..=6 thread-ranks
//! (fewer over verbs), each with its own shm segment, TCP listener or queue pairs.
//! Payloads are derived from (case seed, message tag), so every receiver checks exactly
//! what it got, byte for byte.
//!
//! What is covered:
//! 1. `random_schedules_deliver_exactly`: random lists of send/recv pairs, walked in the same
//!    order by every rank, with random element types (u8, f32, bf16), sizes biased to the
//!    transport's protocol edges (shm and tcp: 0, 1, eager_max, eager_max+1, the ring's
//!    message limit, chunk size, inline_max, ring size; verbs: its eager slot and staging
//!    slot) and random knobs (ring size, inline max, cross-memory attach, eager max; over
//!    verbs the eager max only). Each rank checks that the transport to every peer is the
//!    one the instantiation asks for (under `mixed`: shm inside a host, tcp across).
//! 2. `sendrecv_permutations_deliver`: rounds of `sendrecv` where each rank sends to
//!    `perm[r]` and receives from `perm^-1[r]` (fixed points send to themselves), with
//!    per-pair sizes that straddle the eager/rendezvous threshold within one round.
//! 3. `tiny_ring_without_cma_moves_large_messages` (shm only): FERROCCL_SHM_CMA off, a 4 or
//!    8 KiB ring, messages of 100..400 KB between every ordered pair and in a sendrecv
//!    shift: hundreds of chunks per message, ring wrap-around and PAD records.
//! 4. `split_matches_model_and_subgroups_work`: random colors (some None) and keys with
//!    ties, checked against a model (order by (key, parent rank)), then concurrent traffic
//!    inside every sub-communicator interleaved with world traffic, and a nested split.
//! 5. Error paths: self / out-of-range peers, mismatched lengths in every
//!    eager/rendezvous combination, poisoning after an error.
//! 6. Dropping a communicator without finalize while a peer is blocked in recv from it.
//! 7. Regression tests for bugs these tests found (now fixed): a rendezvous-sized send
//!    against an eager-sized receive, `sendrecv` with a bad `to`, and sequential jobs of
//!    different sizes on one store.
//! 8. Two communicators sharing the mesh (the world and a split of it) from two threads of
//!    each rank.
//! 9. (verbs only) asking for verbs without a device is a clear error at init.

use std::time::{Duration, Instant};

use ferroccl::bootstrap::{new_token, StoreServer};
use ferroccl::{Communicator, Element, Error, Params, TransportKind};
use ferroccl_kernels::{as_bytes, as_bytes_mut, bf16};
use proptest::prelude::*;
use proptest::sample::select;
use proptest::test_runner::Config as ProptestConfig;

use crate::harness::{
    all_ok, check_cases, fresh_store_bind, run_world, run_world_at, verbs_device_named, RankResult, Suite, Wire, PROP_TIMEOUT,
};

// ---------------------------------------------------------------------------------------
// Payloads
// ---------------------------------------------------------------------------------------

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The payload of message `tag` in the case with `seed`: `n` elements of pseudo-random bits.
fn payload<T: Element>(seed: u64, tag: u64, n: usize) -> Vec<T> {
    let mut v = vec![T::zeroed(); n];
    let mut s = mix(seed ^ mix(tag));
    for chunk in as_bytes_mut(&mut v).chunks_mut(8) {
        s = mix(s);
        chunk.copy_from_slice(&s.to_le_bytes()[..chunk.len()]);
    }
    v
}

/// A receive buffer pre-filled with a pattern the payload is unlikely to have everywhere.
fn recv_buf<T: Element>(n: usize) -> Vec<T> {
    let mut v = vec![T::zeroed(); n];
    as_bytes_mut(&mut v).fill(0xa5);
    v
}

/// Describes the first differing byte, if any.
fn diff(got: &[u8], want: &[u8]) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!("length {} != {}", got.len(), want.len()));
    }
    got.iter().zip(want).position(|(a, b)| a != b).map(|i| {
        let wrong = got.iter().zip(want).filter(|(a, b)| a != b).count();
        format!("{wrong} of {} bytes differ, first at byte {i} (got {:#04x}, want {:#04x})", got.len(), got[i], want[i])
    })
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ty {
    U8,
    F32,
    Bf16,
}

impl Ty {
    fn size(self) -> usize {
        match self {
            Ty::U8 => 1,
            Ty::F32 => 4,
            Ty::Bf16 => 2,
        }
    }
}

fn ty() -> impl Strategy<Value = Ty> {
    prop_oneof![Just(Ty::U8), Just(Ty::F32), Just(Ty::Bf16)]
}

#[derive(Clone, Debug)]
struct Knobs {
    wire: Wire,
    /// Under [`Wire::Mixed`], rank r is on host `hosts[r]`: shm inside a host, tcp across.
    hosts: Vec<u8>,
    ring: usize,
    inline_max: usize,
    cma: bool,
    eager_max: usize,
}

impl Knobs {
    fn params(&self, rank: usize) -> Params {
        let host = self.hosts.get(rank).copied().unwrap_or(0) as usize;
        Params {
            timeout: PROP_TIMEOUT,
            shm_ring_bytes: self.ring,
            shm_inline_max: self.inline_max,
            shm_cma: self.cma,
            eager_max: self.eager_max,
            ..self.wire.params(host)
        }
    }

    /// The transport two ranks must end up with.
    fn transport_between(&self, a: usize, b: usize) -> TransportKind {
        match self.wire {
            Wire::Shm => TransportKind::Shm,
            Wire::Tcp | Wire::TcpStriped | Wire::TcpZeroCopy => TransportKind::Tcp,
            Wire::Verbs => TransportKind::Verbs,
            Wire::Mixed if self.hosts[a] == self.hosts[b] => TransportKind::Shm,
            Wire::Mixed => TransportKind::Tcp,
        }
    }

    /// The shm message limit (ring / 2 - one record header), as documented in the shm
    /// transport: messages up to it (minus the 12-byte eager header) can go eagerly.
    fn shm_max_send(&self) -> usize {
        self.ring / 2 - 64
    }

    /// Byte sizes at the protocol edges for these knobs.
    fn edges(&self) -> Vec<usize> {
        if self.wire == Wire::Verbs {
            return verbs_edges(self.eager_max);
        }
        let ms = self.shm_max_send();
        let e = self.eager_max;
        let mut v = vec![
            0,
            1,
            2,
            3,
            e.saturating_sub(1),
            e,
            e + 1,
            e + 4,
            ms - 12,
            ms - 11,
            ms / 2,
            ms / 2 + 1,
            self.inline_max,
            self.inline_max + 1,
            self.ring - 64,
            self.ring,
            self.ring + 1,
            3 * self.ring + 7,
        ];
        v.retain(|&b| b < 200_000);
        v
    }
}

/// The verbs transport's edges: its eager slot (68 KiB, 12 bytes of eager header), its
/// staging slot (256 KiB pieces of a one-sided write) and the eager threshold.
fn verbs_edges(e: usize) -> Vec<usize> {
    const SLOT: usize = 68 << 10;
    const STAGE: usize = 256 << 10;
    let mut v = vec![0, 1, 3, e.saturating_sub(1), e, e + 1, SLOT - 12, SLOT - 11, STAGE - 1, STAGE, STAGE + 1, 2 * STAGE + 3];
    v.retain(|&b| b < 600_000);
    v
}

/// Which host each of `n` ranks is on: random under [`Wire::Mixed`], else none.
fn hosts(wire: Wire, n: usize) -> BoxedStrategy<Vec<u8>> {
    match wire {
        Wire::Mixed => proptest::collection::vec(0u8..2, n).boxed(),
        _ => Just(Vec::new()).boxed(),
    }
}

/// Random knobs for `n` ranks over `wire`: over verbs only the eager threshold varies (the
/// shm knobs mean nothing there).
fn knobs(wire: Wire, n: usize) -> BoxedStrategy<Knobs> {
    if wire == Wire::Verbs {
        return select(vec![0usize, 100, 4096, 65536])
            .prop_map(move |eager_max| Knobs { wire, hosts: Vec::new(), ring: 1 << 20, inline_max: 16384, cma: false, eager_max })
            .boxed();
    }
    (
        hosts(wire, n),
        select(vec![4096usize, 8192, 65536, 1 << 20]),
        select(vec![0usize, 64, 1000, 4096, 16384]),
        any::<bool>(),
        select(vec![0usize, 1, 100, 1024, 4096, 65536]),
    )
        .prop_map(move |(hosts, ring, inline_max, cma, eager_max)| Knobs { wire, hosts, ring, inline_max, cma, eager_max })
        .boxed()
}

/// A byte length biased to the protocol edges of `k`.
fn len_bytes(k: &Knobs) -> impl Strategy<Value = usize> {
    prop_oneof![
        4 => select(k.edges()),
        2 => 0usize..200_000,
        1 => 0usize..64,
    ]
}

/// Element count for about `bytes` bytes of `ty`: rounded up, so an edge `e + 1` stays above
/// `e` for wide types (all edges above 3 are multiples of 4 or one past).
fn elems(ty: Ty, bytes: usize) -> usize {
    bytes.div_ceil(ty.size())
}

fn send_typed<T: Element>(comm: &Communicator, to: usize, seed: u64, tag: u64, n: usize) -> RankResult<()> {
    let data = payload::<T>(seed, tag, n);
    comm.send(&data, to).map_err(|e| format!("rank {}: msg #{tag}: send {n} x {:?} to {to}: {e}", comm.rank(), T::DTYPE))
}

fn recv_typed<T: Element>(comm: &Communicator, from: usize, seed: u64, tag: u64, n: usize) -> RankResult<()> {
    let mut buf = recv_buf::<T>(n);
    comm.recv(&mut buf, from).map_err(|e| format!("rank {}: msg #{tag}: recv {n} x {:?} from {from}: {e}", comm.rank(), T::DTYPE))?;
    let want = payload::<T>(seed, tag, n);
    match diff(as_bytes(&buf), as_bytes(&want)) {
        Some(d) => Err(format!("rank {}: msg #{tag} ({n} x {:?} from {from}): {d}", comm.rank(), T::DTYPE)),
        None => Ok(()),
    }
}

fn send_any(comm: &Communicator, ty: Ty, to: usize, seed: u64, tag: u64, n: usize) -> RankResult<()> {
    match ty {
        Ty::U8 => send_typed::<u8>(comm, to, seed, tag, n),
        Ty::F32 => send_typed::<f32>(comm, to, seed, tag, n),
        Ty::Bf16 => send_typed::<bf16>(comm, to, seed, tag, n),
    }
}

fn recv_any(comm: &Communicator, ty: Ty, from: usize, seed: u64, tag: u64, n: usize) -> RankResult<()> {
    match ty {
        Ty::U8 => recv_typed::<u8>(comm, from, seed, tag, n),
        Ty::F32 => recv_typed::<f32>(comm, from, seed, tag, n),
        Ty::Bf16 => recv_typed::<bf16>(comm, from, seed, tag, n),
    }
}

fn finalize(comm: Communicator) -> RankResult<()> {
    let r = comm.rank();
    comm.finalize().map_err(|e| format!("rank {r}: finalize: {e}"))
}

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig { cases, failure_persistence: None, max_shrink_iters: 32, ..ProptestConfig::default() }
}

// ---------------------------------------------------------------------------------------
// 1. Random message schedules
// ---------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
struct Msg {
    from: usize,
    to: usize,
    ty: Ty,
    bytes: usize,
}

fn schedule_case(s: &Suite) -> impl Strategy<Value = (usize, Knobs, Vec<Msg>, u64)> {
    let (wire, max_msgs) = (s.wire, s.schedule_msgs);
    (2usize..=s.p2p_ranks).prop_flat_map(move |n| {
        knobs(wire, n).prop_flat_map(move |k| {
            let msg = (0..n, 1..n, ty(), len_bytes(&k)).prop_map(move |(from, d, ty, bytes)| Msg { from, to: (from + d) % n, ty, bytes });
            (Just(n), Just(k), proptest::collection::vec(msg, 0..=max_msgs), any::<u64>())
        })
    })
}

pub fn random_schedules_deliver_exactly(s: &Suite) {
    check_cases(config(s.schedule_cases), schedule_case(s), |(n, k, msgs, seed)| check_schedule(n, &k, &msgs, seed));
}

fn check_schedule(n: usize, k: &Knobs, msgs: &[Msg], seed: u64) -> std::result::Result<(), String> {
    {
        let res = run_world(
            n,
            |r| k.params(r),
            |comm| {
                let me = comm.rank();
                for p in (0..n).filter(|&p| p != me) {
                    let want = k.transport_between(me, p);
                    if comm.transport_to(p) != Some(want) {
                        return Err(format!("rank {me}: transport to {p} is {:?}, expected {want}", comm.transport_to(p)));
                    }
                }
                for (i, m) in msgs.iter().enumerate() {
                    let cnt = elems(m.ty, m.bytes);
                    if m.from == me {
                        send_any(&comm, m.ty, m.to, seed, i as u64, cnt)?;
                    } else if m.to == me {
                        recv_any(&comm, m.ty, m.from, seed, i as u64, cnt)?;
                    }
                }
                finalize(comm)
            },
        );
        all_ok(res).map(|_| ())
    }
}

// ---------------------------------------------------------------------------------------
// 2. sendrecv in permutation patterns
// ---------------------------------------------------------------------------------------

fn perm_case(s: &Suite) -> impl Strategy<Value = (usize, Knobs, Vec<Vec<usize>>, Ty, u64)> {
    let (wire, max_rounds) = (s.wire, s.perm_rounds);
    (2usize..=s.p2p_ranks).prop_flat_map(move |n| {
        let perm = Just((0..n).collect::<Vec<usize>>()).prop_shuffle();
        (Just(n), knobs(wire, n), proptest::collection::vec(perm, 1..=max_rounds), ty(), any::<u64>())
    })
}

/// Bytes that rank `src` sends in round `round`: drawn per pair from the seed, so that one
/// round mixes eager and rendezvous messages around the knobs' edges.
fn pair_bytes(k: &Knobs, seed: u64, round: usize, src: usize) -> usize {
    let edges = k.edges();
    let h = mix(seed ^ mix(((round as u64) << 32) | src as u64));
    match h % 4 {
        0 | 1 => edges[(h >> 8) as usize % edges.len()],
        2 => (h >> 8) as usize % 150_000,
        _ => (h >> 8) as usize % 64,
    }
}

pub fn sendrecv_permutations_deliver(s: &Suite) {
    check_cases(config(s.perm_cases), perm_case(s), |(n, k, rounds, ty, seed)| check_perm(n, &k, &rounds, ty, seed));
}

fn check_perm(n: usize, k: &Knobs, rounds: &[Vec<usize>], ty: Ty, seed: u64) -> std::result::Result<(), String> {
    {
        let res = run_world(
            n,
            |r| k.params(r),
            |comm| {
                let me = comm.rank();
                for (round, perm) in rounds.iter().enumerate() {
                    let to = perm[me];
                    let from = perm.iter().position(|&p| p == me).unwrap();
                    let out_n = elems(ty, pair_bytes(k, seed, round, me));
                    let in_n = elems(ty, pair_bytes(k, seed, round, from));
                    let tag_out = ((round as u64) << 8) | me as u64;
                    let tag_in = ((round as u64) << 8) | from as u64;
                    let ctx = |e: Error| format!("rank {me}: round {round}: sendrecv {out_n} to {to}, {in_n} from {from}: {e}");
                    let check = |got: &[u8], want: &[u8]| match diff(got, want) {
                        Some(d) => Err(format!("rank {me}: round {round}: from {from}: {d}")),
                        None => Ok(()),
                    };
                    match ty {
                        Ty::U8 => {
                            let (data, mut buf) = (payload::<u8>(seed, tag_out, out_n), recv_buf::<u8>(in_n));
                            comm.sendrecv(&data, to, &mut buf, from).map_err(ctx)?;
                            check(as_bytes(&buf), as_bytes(&payload::<u8>(seed, tag_in, in_n)))?;
                        }
                        Ty::F32 => {
                            let (data, mut buf) = (payload::<f32>(seed, tag_out, out_n), recv_buf::<f32>(in_n));
                            comm.sendrecv(&data, to, &mut buf, from).map_err(ctx)?;
                            check(as_bytes(&buf), as_bytes(&payload::<f32>(seed, tag_in, in_n)))?;
                        }
                        Ty::Bf16 => {
                            let (data, mut buf) = (payload::<bf16>(seed, tag_out, out_n), recv_buf::<bf16>(in_n));
                            comm.sendrecv(&data, to, &mut buf, from).map_err(ctx)?;
                            check(as_bytes(&buf), as_bytes(&payload::<bf16>(seed, tag_in, in_n)))?;
                        }
                    }
                }
                finalize(comm)
            },
        );
        all_ok(res).map(|_| ())
    }
}

// ---------------------------------------------------------------------------------------
// 3. Tiny ring, no cross-memory attach, large messages
// ---------------------------------------------------------------------------------------

/// Shm only: the knobs are the shm transport's.
pub fn tiny_ring_without_cma_moves_large_messages() {
    let case = (
        2usize..=3,
        select(vec![4096usize, 8192]),
        select(vec![0usize, 4096, 1 << 20]),
        select(vec![0usize, 1024, 65536]),
        proptest::collection::vec(100_000usize..400_000, 1..=3),
        any::<u64>(),
    );
    check_cases(config(48), case, |(n, ring, inline_max, eager_max, sizes, seed)| {
        let k = Knobs { wire: Wire::Shm, hosts: Vec::new(), ring, inline_max, cma: false, eager_max };
        let res = run_world(
            n,
            |r| k.params(r),
            |comm| {
                let me = comm.rank();
                let size = comm.size();
                // Every ordered pair, one message each way per size (the schedule is walked in
                // the same order everywhere).
                let mut tag = 0u64;
                for &bytes in &sizes {
                    for from in 0..size {
                        for to in (0..size).filter(|&t| t != from) {
                            let cnt = elems(Ty::F32, bytes);
                            if from == me {
                                send_any(&comm, Ty::F32, to, seed, tag, cnt)?;
                            } else if to == me {
                                recv_any(&comm, Ty::F32, from, seed, tag, cnt)?;
                            }
                            tag += 1;
                        }
                    }
                    // And a ring shift with sendrecv: all ranks write through rings at once.
                    let to = (me + 1) % size;
                    let from = (me + size - 1) % size;
                    let data = payload::<u8>(seed, 1000 + me as u64, bytes);
                    let mut buf = recv_buf::<u8>(bytes);
                    comm.sendrecv(&data, to, &mut buf, from).map_err(|e| format!("rank {me}: shift {bytes}: {e}"))?;
                    if let Some(d) = diff(&buf, &payload::<u8>(seed, 1000 + from as u64, bytes)) {
                        return Err(format!("rank {me}: shift of {bytes} bytes from {from}: {d}"));
                    }
                }
                finalize(comm)
            },
        );
        all_ok(res).map(|_| ())
    });
}

// ---------------------------------------------------------------------------------------
// 4. split
// ---------------------------------------------------------------------------------------

/// The model of `split`: for each rank, `None` if it passed no color, else the world ranks of
/// its group ordered by (key, world rank).
fn split_model(colors: &[Option<u32>], keys: &[i64]) -> Vec<Option<Vec<usize>>> {
    (0..colors.len())
        .map(|r| {
            let c = colors[r]?;
            let mut g: Vec<usize> = (0..colors.len()).filter(|&p| colors[p] == Some(c)).collect();
            g.sort_by_key(|&p| (keys[p], p));
            Some(g)
        })
        .collect()
}

fn split_case(s: &Suite) -> impl Strategy<Value = (usize, Vec<u8>, Vec<Option<u32>>, Vec<i64>, u64)> {
    let wire = s.wire;
    (2usize..=s.split_ranks).prop_flat_map(move |n| {
        let color = prop_oneof![1 => Just(None), 4 => (0u32..3).prop_map(Some), 1 => any::<u32>().prop_map(Some)];
        (
            Just(n),
            hosts(wire, n),
            proptest::collection::vec(color, n),
            proptest::collection::vec(prop_oneof![-2i64..3, any::<i64>()], n),
            any::<u64>(),
        )
    })
}

pub fn split_matches_model_and_subgroups_work(s: &Suite) {
    let wire = s.wire;
    check_cases(config(s.split_cases), split_case(s), |(n, hosts, colors, keys, seed)| check_split(n, wire, hosts, &colors, &keys, seed));
}

fn check_split(n: usize, wire: Wire, hosts: Vec<u8>, colors: &[Option<u32>], keys: &[i64], seed: u64) -> std::result::Result<(), String> {
    {
        let model = split_model(colors, keys);
        let k = Knobs { wire, hosts, ring: 8192, inline_max: 1000, cma: true, eager_max: 1024 };
        let res = run_world(
            n,
            |r| k.params(r),
            |comm| {
                let me = comm.rank();
                let sub = comm.split(colors[me], keys[me]).map_err(|e| format!("rank {me}: split: {e}"))?;
                let Some(group) = &model[me] else {
                    if sub.is_some() {
                        return Err(format!("rank {me}: color None but split returned a communicator"));
                    }
                    // Still take part in world traffic after the split.
                    return world_ring(&comm, seed).and_then(|()| finalize(comm));
                };
                let Some(sub) = sub else {
                    return Err(format!("rank {me}: color {:?} but split returned None", colors[me]));
                };
                let m = group.len();
                let pos = group.iter().position(|&p| p == me).unwrap();
                if sub.size() != m || sub.rank() != pos {
                    return Err(format!(
                        "rank {me}: sub-communicator is rank {} of {}, model says {pos} of {m} ({group:?})",
                        sub.rank(),
                        sub.size()
                    ));
                }
                let members: Vec<Option<usize>> = (0..m + 1).map(|i| sub.world_rank(i)).collect();
                let want: Vec<Option<usize>> = group.iter().map(|&p| Some(p)).chain([None]).collect();
                if members != want {
                    return Err(format!("rank {me}: sub-communicator members {members:?}, model {want:?}"));
                }
                // Traffic inside the group: a ring shift (eager and rendezvous sizes), then
                // point-to-point from the group's rank 0 to every other member, then a barrier;
                // world traffic in between, so sub and world streams interleave.
                let color = u64::from(colors[me].unwrap());
                for (i, bytes) in [7usize, 5000].into_iter().enumerate() {
                    let to = (pos + 1) % m;
                    let from = (pos + m - 1) % m;
                    let tag = |p: usize| (color << 40) | ((i as u64) << 32) | group[p] as u64;
                    let data = payload::<u8>(seed, tag(pos), bytes);
                    let mut buf = recv_buf::<u8>(bytes);
                    sub.sendrecv(&data, to, &mut buf, from).map_err(|e| format!("rank {me}: sub shift: {e}"))?;
                    if let Some(d) = diff(&buf, &payload::<u8>(seed, tag(from), bytes)) {
                        return Err(format!("rank {me}: sub shift of {bytes} from sub rank {from}: {d}"));
                    }
                    if i == 0 {
                        world_ring(&comm, seed)?;
                    }
                }
                for p in 1..m {
                    let tag = (color << 40) | (1 << 36) | p as u64;
                    if pos == 0 {
                        send_any(&sub, Ty::Bf16, p, seed, tag, 3000)?;
                    } else if pos == p {
                        recv_any(&sub, Ty::Bf16, 0, seed, tag, 3000)?;
                    }
                }
                sub.barrier().map_err(|e| format!("rank {me}: sub barrier: {e}"))?;
                // Split the sub-communicator again (parity of the sub rank, reversed order): the
                // grandchild maps its ranks through the child's members to world ranks.
                let parity = pos % 2;
                let grand = sub
                    .split(Some(parity as u32), -(pos as i64))
                    .map_err(|e| format!("rank {me}: nested split: {e}"))?
                    .ok_or_else(|| format!("rank {me}: nested split returned None"))?;
                let want: Vec<usize> = (0..m).rev().filter(|p| p % 2 == parity).map(|p| group[p]).collect();
                let got: Vec<usize> = (0..grand.size()).filter_map(|i| grand.world_rank(i)).collect();
                if got != want || grand.world_rank(grand.rank()) != Some(me) {
                    return Err(format!("rank {me}: nested split members {got:?} (rank {}), model {want:?}", grand.rank()));
                }
                world_ring(&grand, seed ^ 0x5151)?;
                grand.finalize().map_err(|e| format!("rank {me}: nested finalize: {e}"))?;
                sub.finalize().map_err(|e| format!("rank {me}: sub finalize: {e}"))?;
                finalize(comm)
            },
        );
        all_ok(res).map(|_| ())
    }
}

/// One ring shift on the world communicator.
fn world_ring(comm: &Communicator, seed: u64) -> RankResult<()> {
    let (me, n) = (comm.rank(), comm.size());
    let (to, from) = ((me + 1) % n, (me + n - 1) % n);
    let tag = |p: usize| (0xffu64 << 48) | p as u64;
    let data = payload::<f32>(seed, tag(me), 1500);
    let mut buf = recv_buf::<f32>(1500);
    comm.sendrecv(&data, to, &mut buf, from).map_err(|e| format!("rank {me}: world shift: {e}"))?;
    match diff(as_bytes(&buf), as_bytes(&payload::<f32>(seed, tag(from), 1500))) {
        Some(d) => Err(format!("rank {me}: world shift from {from}: {d}")),
        None => Ok(()),
    }
}

// ---------------------------------------------------------------------------------------
// 5. Error paths
// ---------------------------------------------------------------------------------------

fn small_params(s: &Suite, rank: usize) -> Params {
    Params { timeout: Duration::from_secs(5), eager_max: 1024, ..s.params(rank) }
}

pub fn bad_peers_are_invalid_arguments_and_do_not_poison(s: &Suite) {
    let t = s.wire;
    {
        let res = run_world(
            3,
            |r| small_params(s, r),
            |comm| {
                let me = comm.rank();
                let mut buf = [0u8; 4];
                let expect_invalid = |what: &str, r: ferroccl::Result<()>, needle: &str| -> RankResult<()> {
                    match r {
                        Err(Error::InvalidArgument(m)) if m.contains(needle) => Ok(()),
                        other => Err(format!("rank {me} ({t:?}): {what}: expected InvalidArgument mentioning {needle:?}, got {other:?}")),
                    }
                };
                expect_invalid("send to self", comm.send(&[1u8, 2], me), "itself")?;
                expect_invalid("recv from self", comm.recv(&mut buf, me), "itself")?;
                expect_invalid("send to 3", comm.send(&[1u8], 3), "peer 3")?;
                expect_invalid("recv from 99", comm.recv(&mut buf, 99), "peer 99")?;
                expect_invalid("send to usize::MAX", comm.send(&[1u8], usize::MAX), "out of range")?;
                expect_invalid("sendrecv half self", comm.sendrecv(&[1u8; 4], me, &mut buf, (me + 1) % 3), "itself")?;
                // (`sendrecv` to an invalid rank *from a valid one* is tested separately below: it
                // is the one bad-argument case that touches a live stream.)
                expect_invalid("sendrecv from 7", comm.sendrecv(&[1u8; 4], (me + 1) % 3, &mut buf, 7), "7")?;
                expect_invalid("sendrecv self, lengths differ", comm.sendrecv(&[1u8; 3], me, &mut buf, me), "")?;
                // Self sendrecv with equal lengths is a copy.
                comm.sendrecv(&[9u8, 8, 7, 6], me, &mut buf, me).map_err(|e| format!("rank {me}: self sendrecv: {e}"))?;
                if buf != [9, 8, 7, 6] {
                    return Err(format!("rank {me}: self sendrecv copied {buf:?}"));
                }
                // None of that poisoned the communicator.
                world_ring(&comm, 1)?;
                finalize(comm)
            },
        );
        all_ok(res).unwrap();
    }
}

/// `sendrecv(data, bad_to, buf, good_from)` must fail with InvalidArgument and leave the
/// stream from `good_from` as it was: a later ordinary send/recv between the two ranks works.
fn sendrecv_bad_to_keeps_stream(s: &Suite, len: usize) -> std::result::Result<(), String> {
    let t = s.wire;
    let res = run_world(
        2,
        |r| small_params(s, r),
        |comm| {
            let me = comm.rank();
            if me == 0 {
                let mut buf = vec![0u8; len];
                match comm.sendrecv(&vec![1u8; len], 7, &mut buf, 1) {
                    Err(Error::InvalidArgument(m)) if m.contains('7') => {}
                    other => return Err(format!("rank 0 ({t:?}): sendrecv to 7: expected InvalidArgument, got {other:?}")),
                }
                recv_any(&comm, Ty::U8, 1, 5, 0, len)?;
            } else {
                send_any(&comm, Ty::U8, 0, 5, 0, len)?;
            }
            finalize(comm)
        },
    );
    all_ok(res).map(|_| ()).map_err(|e| format!("{t:?}, {len} bytes: {e}"))
}

pub fn sendrecv_with_bad_to_leaves_the_recv_stream_intact(s: &Suite) {
    let errs: Vec<String> = [100, 100_000].into_iter().filter_map(|len| sendrecv_bad_to_keeps_stream(s, len).err()).collect();
    assert!(errs.is_empty(), "{}", errs.join("\n"));
}

/// Two jobs in sequence, one process, the same store and token, first 2 ranks then 3. The
/// third rank's thread never joined the first job; the store keys must still agree (they
/// once did not: init counted per (store address, rank) only, and timed out).
pub fn sequential_jobs_on_one_store_address_with_different_sizes(s: &Suite) {
    let token = new_token();
    let server = StoreServer::start(fresh_store_bind(), &token, 64 << 20).expect("start store");
    let params = |r| small_params(s, r);
    for n in [2, 3] {
        let t0 = Instant::now();
        let res = run_world_at(&server, &token, n, params, |comm| {
            world_ring(&comm, 3)?;
            finalize(comm)
        });
        if let Err(e) = all_ok(res) {
            panic!("job of {n} ranks on the same store failed after {:?}:\n{e}", t0.elapsed());
        }
    }
}

/// Outcome of one side of a mismatch test: the error of the mismatched call, or of the
/// call after it (an eager send completes locally before the receiver sees it), how long
/// until that error, and the error of one more call afterwards (poisoning).
#[derive(Debug)]
struct Side {
    first: Option<String>,
    err: String,
    is_mismatch: bool,
    after: Duration,
    later: Option<String>,
}

fn mismatch_case(s: &Suite, send_len: usize, recv_len: usize) -> Vec<Side> {
    let t = s.wire;
    let res = run_world(
        2,
        |r| small_params(s, r),
        |comm| {
            let me = comm.rank();
            comm.barrier().map_err(|e| format!("rank {me}: barrier before: {e}"))?;
            let t0 = Instant::now();
            let first = if me == 0 { comm.send(&vec![1u8; send_len], 1) } else { comm.recv(&mut vec![0u8; recv_len], 0) };
            let (first_txt, err) = match first {
                Err(e) => (Some(e.to_string()), e),
                Ok(()) => match comm.barrier() {
                    Err(e) => (None, e),
                    Ok(()) => return Err(format!("rank {me} ({t:?}, send {send_len}, recv {recv_len}): mismatch unnoticed")),
                },
            };
            let after = t0.elapsed();
            let is_mismatch = matches!(err, Error::Mismatch { .. });
            let later = comm.send(&[1u8], 1 - me).err().map(|e| e.to_string());
            drop(comm);
            Ok(Side { first: first_txt, err: err.to_string(), is_mismatch, after, later })
        },
    );
    all_ok(res).unwrap()
}

fn check_mismatch(suite: &Suite, send_len: usize, recv_len: usize) {
    let sides = mismatch_case(suite, send_len, recv_len);
    let ctx = format!("{:?}, send {send_len}, recv {recv_len}: {sides:#?}", suite.wire);
    // Both sides report the mismatch as such: the one that finds it, and the other from
    // the fault it is told about (an eager sender at its next call).
    assert!(sides.iter().all(|s| s.is_mismatch), "not every side reported Error::Mismatch: {ctx}");
    for (r, s) in sides.iter().enumerate() {
        // Both sides fail promptly (timeout is 5 s), and the error explains the mismatch.
        // (Without clocks, over verbs in an emulated VM, the check is that the error is the
        // mismatch itself, not the deadline, which is 5 s.)
        if suite.clocks {
            assert!(s.after < Duration::from_secs(3), "rank {r} failed only after {:?}: {ctx}", s.after);
        }
        assert!(!s.err.contains("timed out"), "rank {r} waited for the deadline: {ctx}");
        assert!(s.err.contains("does not match"), "rank {r}'s error does not mention the mismatch: {ctx}");
        // The communicator stays poisoned.
        let later = s.later.as_deref().unwrap_or_else(|| panic!("rank {r}: a call after the error succeeded: {ctx}"));
        assert!(later.contains("does not match"), "rank {r}: later error forgets the cause: {ctx}");
    }
    // The receiver, which holds the buffer, must fail in the mismatched call.
    assert!(sides[1].first.is_some(), "the receiver's recv succeeded: {ctx}");
}

pub fn mismatch_eager_vs_eager(s: &Suite) {
    check_mismatch(s, 100, 200);
    check_mismatch(s, 200, 100);
}

pub fn mismatch_rendezvous_vs_rendezvous(s: &Suite) {
    check_mismatch(s, 100_000, 200_000);
    check_mismatch(s, 200_000, 100_000);
}

pub fn mismatch_eager_send_rendezvous_recv(s: &Suite) {
    check_mismatch(s, 100, 200_000);
}

pub fn mismatch_rendezvous_send_eager_recv(s: &Suite) {
    check_mismatch(s, 200_000, 100);
}

// ---------------------------------------------------------------------------------------
// 6. Drop without finalize
// ---------------------------------------------------------------------------------------

fn drop_while_peer_waits(s: &Suite, recv_len: usize) {
    let t = s.wire;
    let res = run_world(
        2,
        |r| Params { timeout: Duration::from_secs(20), ..small_params(s, r) },
        |comm| {
            let me = comm.rank();
            comm.barrier().map_err(|e| format!("rank {me}: barrier: {e}"))?;
            if me == 0 {
                std::thread::sleep(Duration::from_millis(300));
                drop(comm);
                return Ok(None);
            }
            let t0 = Instant::now();
            let r = comm.recv(&mut vec![0u8; recv_len], 0);
            let after = t0.elapsed();
            let later = comm.barrier();
            Ok(Some((r, after, later)))
        },
    );
    let mut res = all_ok(res).unwrap();
    let (r, after, later) = res.pop().flatten().unwrap();
    let ctx = format!("{t:?}, recv of {recv_len}: {r:?} after {after:?}; later: {later:?}");
    // The dropped communicator told rank 1 where rank 0 stopped: it never sent this message.
    match &r {
        Err(Error::PeerLeft { peer: 0, how: ferroccl::error::Departure::Dropped, p2p: Some((0, 0)), .. }) => {}
        _ => panic!("expected PeerLeft naming rank 0, dropped, no point-to-point message sent: {ctx}"),
    }
    // Without clocks (over verbs, in an emulated VM) the PeerLeft above, not a Timeout,
    // shows promptness.
    if s.clocks {
        assert!(after < Duration::from_secs(5), "not prompt: {ctx}");
    }
    assert!(later.is_err(), "{ctx}");
}

pub fn dropped_peer_fails_a_blocked_recv_promptly(s: &Suite) {
    drop_while_peer_waits(s, 100); // eager: waiting for data
    drop_while_peer_waits(s, 100_000); // rendezvous: clear-to-send posted, waiting for the write
}

// ---------------------------------------------------------------------------------------
// 8. Two communicators sharing the mesh; 9. verbs without a device
// ---------------------------------------------------------------------------------------

/// Two communicators sharing the mesh (the world and a split of it), driven from two
/// threads of each rank at once: eager and rendezvous transfers of both interleave on the
/// same connections (over verbs: queue pairs, slots, credits and staging slots).
pub fn communicators_on_two_threads_share_the_mesh(s: &Suite) {
    let res = run_world(
        3,
        |r| small_params(s, r),
        |comm| {
            let me = comm.rank();
            let sub = comm.split(Some(0), -(me as i64)).map_err(|e| format!("rank {me}: split: {e}"))?.ok_or("no sub-communicator")?;
            let traffic = |c: &Communicator, seed: u64| -> RankResult<()> {
                let (r, n) = (c.rank(), c.size());
                let (to, from) = ((r + 1) % n, (r + n - 1) % n);
                for (i, bytes) in [100usize, 70_000, 300_000, 5, 600_000].into_iter().enumerate() {
                    let tag = |p: usize| ((i as u64) << 32) | p as u64;
                    let data = payload::<u8>(seed, tag(r), bytes);
                    let mut buf = recv_buf::<u8>(bytes);
                    c.sendrecv(&data, to, &mut buf, from).map_err(|e| format!("rank {me} (seed {seed}): round {i}: {e}"))?;
                    if let Some(d) = diff(&buf, &payload::<u8>(seed, tag(from), bytes)) {
                        return Err(format!("rank {me} (seed {seed}): round {i} from {from}: {d}"));
                    }
                }
                Ok(())
            };
            std::thread::scope(|sc| {
                let other = sc.spawn(|| traffic(&sub, 2));
                let mine = traffic(&comm, 1);
                let theirs = other.join().unwrap_or_else(|_| Err(format!("rank {me}: the second thread panicked")));
                mine.and(theirs)
            })?;
            sub.finalize().map_err(|e| format!("rank {me}: sub finalize: {e}"))?;
            finalize(comm)
        },
    );
    all_ok(res).unwrap();
}

/// Without a usable device (or without the feature), asking for verbs is a clear error
/// at init, not a panic or a hang: on the rank without one, and (where the others have a
/// device) on every other rank too, naming that rank, not a timeout.
pub fn verbs_without_a_device_is_a_clear_error(s: &Suite) {
    assert_eq!(s.wire, Wire::Verbs);
    let here = verbs_device_named();
    let res = run_world(
        3,
        |r| {
            let p = small_params(s, r);
            if r == 1 {
                Params { ib_dev: Some("no-such-rdma-device".into()), ..p }
            } else {
                p
            }
        },
        |comm| {
            let r = comm.rank();
            Ok(format!("rank {r} initialised"))
        },
    );
    for (r, res) in res.into_iter().enumerate() {
        let e = res.expect_err("init with FERROCCL_TRANSPORT=verbs and a missing device must fail");
        assert!(e.contains("verbs"), "rank {r}: {e}");
        assert!(!e.contains("timed out"), "rank {r} waited for the rank without a device: {e}");
        if !cfg!(feature = "verbs") {
            assert!(e.contains("`verbs` cargo feature"), "rank {r}: {e}");
        } else if r == 1 || !here {
            assert!(e.contains("no-such-rdma-device") || e.contains("no RDMA device"), "rank {r}: {e}");
        } else {
            assert!(e.contains("rank 1") && e.contains("no usable RDMA device"), "rank {r}: {e}");
        }
    }
}
