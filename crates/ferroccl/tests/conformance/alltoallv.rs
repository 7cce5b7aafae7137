//! `alltoallv`: random count matrices (zeros included) and random layouts (blocks in any
//! order, with gaps) against a reference computed from the same matrix, blocking and in a
//! scope, several dtypes, 2 to 4 ranks, every protocol; bad arguments found before
//! anything moves; counts that disagree between a sender and its receiver fail on the
//! wire, on every rank, without waiting for the deadline. The rooted calls built the same
//! way (gather, scatter, gatherv, scatterv) likewise.

use std::fmt::Debug;
use std::time::{Duration, Instant};

use ferroccl::{Algo, Collective, Communicator, DType, Element, Params, ProtoChoice, ReduceOp};
use ferroccl_kernels::{bf16, f16};
use proptest::prelude::*;
use proptest::test_runner::Config as ProptestConfig;

use crate::harness::{all_ok, check_cases, run_world, Suite};

/// splitmix64: every rank draws the same matrices from the case's seed.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// Values every dtype holds exactly (compared with `==`: no NaN).
trait V: Element + Copy + PartialEq + Debug {
    fn v(x: u64) -> Self;
}
impl V for f32 {
    fn v(x: u64) -> Self {
        (x % 2001) as f32 - 1000.0
    }
}
impl V for f64 {
    fn v(x: u64) -> Self {
        (x % 1_000_001) as f64 - 500_000.0
    }
}
impl V for f16 {
    fn v(x: u64) -> Self {
        f16::from_f64((x % 257) as f64 - 128.0)
    }
}
impl V for bf16 {
    fn v(x: u64) -> Self {
        bf16::from_f64((x % 257) as f64 - 128.0)
    }
}
impl V for u8 {
    fn v(x: u64) -> Self {
        x as u8
    }
}
impl V for u32 {
    fn v(x: u64) -> Self {
        x as u32
    }
}
impl V for i64 {
    fn v(x: u64) -> Self {
        x as i64
    }
}

/// One rank's buffer layout: `counts[p]` elements at `displs[p]`, `len` elements in all.
#[derive(Clone, Debug)]
struct Layout {
    counts: Vec<usize>,
    displs: Vec<usize>,
    len: usize,
}

/// Blocks of `counts` in a random order, each after a random gap (0 to 2), then a random
/// tail.
fn layout(rng: &mut Rng, counts: Vec<usize>) -> Layout {
    let n = counts.len();
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let mut displs = vec![0; n];
    let mut at = 0;
    for p in order {
        at += rng.below(3) as usize;
        displs[p] = at;
        at += counts[p];
    }
    Layout { counts, displs, len: at + rng.below(2) as usize }
}

/// One call's shape on every rank: `c[p][q]` elements from p to q, and every rank's send
/// and receive layouts.
#[derive(Clone, Debug)]
struct Case {
    c: Vec<Vec<usize>>,
    send: Vec<Layout>,
    recv: Vec<Layout>,
}

/// Counts up to `max`, about a third of them 0.
fn case(n: usize, seed: u64, max: usize) -> Case {
    let mut rng = Rng(seed);
    let c: Vec<Vec<usize>> =
        (0..n).map(|_| (0..n).map(|_| if rng.below(3) == 0 { 0 } else { rng.below(max as u64 + 1) as usize }).collect()).collect();
    let send = (0..n).map(|p| layout(&mut rng, c[p].clone())).collect();
    let recv = (0..n).map(|q| layout(&mut rng, (0..n).map(|p| c[p][q]).collect())).collect();
    Case { c, send, recv }
}

fn send_data<X: V>(rank: usize, len: usize, seed: u64) -> Vec<X> {
    let mut rng = Rng(seed ^ (rank as u64 + 1).wrapping_mul(0x1234_5678_9ABC_DEF1));
    (0..len).map(|_| X::v(rng.next())).collect()
}

/// What rank `r` must hold after the call: the sentinel in the gaps, block p from rank p.
fn reference<X: V>(k: &Case, r: usize, seed: u64, sentinel: X) -> Vec<X> {
    let rl = &k.recv[r];
    let mut out = vec![sentinel; rl.len];
    for (p, sl) in k.send.iter().enumerate() {
        let data = send_data::<X>(p, sl.len, seed);
        let cnt = k.c[p][r];
        out[rl.displs[p]..rl.displs[p] + cnt].copy_from_slice(&data[sl.displs[r]..sl.displs[r] + cnt]);
    }
    out
}

/// One blocking alltoallv and two at once in a scope (the second with another seed), each
/// checked against the reference.
fn check_dtype<X: V>(comm: &Communicator, k: &Case, k2: &Case, seed: u64) -> Result<(), String> {
    let r = comm.rank();
    let ctx = |what: &str| format!("rank {r}/{} {what} {}", comm.size(), X::DTYPE);
    let sentinel = X::v(0xFFFF_FFFF_FFFF_FFFF);
    let (sl, rl) = (&k.send[r], &k.recv[r]);
    let send = send_data::<X>(r, sl.len, seed);
    let mut recv = vec![sentinel; rl.len];
    comm.alltoallv(&send, &sl.counts, &sl.displs, &mut recv, &rl.counts, &rl.displs).map_err(|e| format!("{}: {e}", ctx("blocking")))?;
    let want = reference::<X>(k, r, seed, sentinel);
    if recv != want {
        return Err(format!("{}: got {recv:?}, want {want:?} ({k:?})", ctx("blocking")));
    }

    let seed2 = seed ^ 0xA5A5;
    let (sl2, rl2) = (&k2.send[r], &k2.recv[r]);
    let send2 = send_data::<X>(r, sl2.len, seed2);
    let mut recv2 = vec![sentinel; rl2.len];
    let mut recv1 = vec![sentinel; rl.len];
    comm.scope(|s| {
        let a = s.start(ferroccl::op::alltoallv(&send, &sl.counts, &sl.displs, &mut recv1, &rl.counts, &rl.displs))?;
        let b = s.start(ferroccl::op::alltoallv(&send2, &sl2.counts, &sl2.displs, &mut recv2, &rl2.counts, &rl2.displs))?;
        b.wait()?;
        a.wait()
    })
    .map_err(|e| format!("{}: {e}", ctx("scope")))?;
    if recv1 != want {
        return Err(format!("{}: first: got {recv1:?}, want {want:?} ({k:?})", ctx("scope")));
    }
    let want2 = reference::<X>(k2, r, seed2, sentinel);
    if recv2 != want2 {
        return Err(format!("{}: second: got {recv2:?}, want {want2:?} ({k2:?})", ctx("scope")));
    }

    // The two in one group, next to an allreduce: one job.
    let (mut g1, mut g2) = (vec![sentinel; rl.len], vec![sentinel; rl2.len]);
    let mut sum = [1u32; 3];
    comm.group(|g| {
        g.add(ferroccl::op::alltoallv(&send, &sl.counts, &sl.displs, &mut g1, &rl.counts, &rl.displs))?;
        g.add(ferroccl::op::allreduce(&mut sum, ferroccl::ReduceOp::Sum))?;
        g.add(ferroccl::op::alltoallv(&send2, &sl2.counts, &sl2.displs, &mut g2, &rl2.counts, &rl2.displs))
    })
    .map_err(|e| format!("{}: {e}", ctx("group")))?;
    if g1 != want || g2 != want2 || sum != [comm.size() as u32; 3] {
        return Err(format!("{}: got {g1:?} / {g2:?} / {sum:?}, want {want:?} / {want2:?} ({k:?}, {k2:?})", ctx("group")));
    }
    Ok(())
}

fn params(s: &Suite, proto: ProtoChoice, timeout: Duration, rank: usize) -> Params {
    // Eager up to 256 bytes: counts up to 100 elements take both protocols.
    Params { timeout, proto, eager_max: 256, shm_ring_bytes: 1 << 16, ..s.params(rank) }
}

/// Which algorithm each rank of a test forces (`FERROCCL_ALGO`).
#[derive(Clone, Copy, Debug)]
enum Forced {
    /// The cost model's choice.
    Auto,
    /// This one on every rank.
    All(Algo),
    /// Pairwise on odd ranks, the cost model on even ones, which picks the mesh for these
    /// small counts (what the cost model may do when the ranks' totals differ: the two
    /// schedules interoperate). Not mesh forced: the other collectives in the test must
    /// pick alike on every rank.
    Mixed,
}

impl Forced {
    fn algo(self, rank: usize) -> Option<Algo> {
        match self {
            Forced::Auto => None,
            Forced::All(a) => Some(a),
            Forced::Mixed => (rank % 2 == 1).then_some(Algo::Pairwise),
        }
    }
}

/// Random counts (zeros included) and layouts (gaps, blocks in any order) on 2 to 4 ranks,
/// six dtypes, blocking and non-blocking, against the reference.
pub fn alltoallv_equals_the_reference(s: &Suite) {
    alltoallv_cases(s, Just(Forced::Auto));
}

/// The same with the pairwise schedule forced on every rank, or on every other rank next to
/// the mesh.
pub fn alltoallv_pairwise_equals_the_reference(s: &Suite) {
    alltoallv_cases(s, prop_oneof![3 => Just(Forced::All(Algo::Pairwise)), 1 => Just(Forced::Mixed)]);
}

fn alltoallv_cases(s: &Suite, forced: impl Strategy<Value = Forced>) {
    let protos = prop_oneof![Just(ProtoChoice::Auto), Just(ProtoChoice::Eager), Just(ProtoChoice::Rendezvous)];
    let config = ProptestConfig { cases: s.nonblocking_cases, ..ProptestConfig::default() };
    check_cases(config, (2usize..=4, any::<u64>(), protos, forced), |(n, seed, proto, forced)| {
        let res = run_world(
            n,
            |r| Params { algo: forced.algo(r), ..params(s, proto, Duration::from_secs(60), r) },
            |comm| {
                let (k, k2) = (case(n, seed, 100), case(n, seed ^ 1, 7));
                // The choice the call makes is the one `algorithm_for` reports.
                let said = comm.algorithm_for(Collective::AllToAllV, DType::F32, ReduceOp::Sum, 1 << 20);
                if forced.algo(comm.rank()).is_some_and(|a| a != said) {
                    return Err(format!("rank {}: algorithm_for says {said}, forced {forced:?}", comm.rank()));
                }
                let small = comm.algorithm_for(Collective::AllToAllV, DType::F32, ReduceOp::Sum, 100);
                if matches!(forced, Forced::Mixed) && comm.rank() % 2 == 0 && small != Algo::Mesh {
                    return Err(format!("rank {}: the cost model picks {small} for small alltoallv's, not mesh", comm.rank()));
                }
                check_dtype::<f32>(&comm, &k, &k2, seed)?;
                check_dtype::<bf16>(&comm, &k2, &k, seed ^ 2)?;
                check_dtype::<f16>(&comm, &k, &k2, seed ^ 3)?;
                check_dtype::<u8>(&comm, &k, &k2, seed ^ 4)?;
                check_dtype::<i64>(&comm, &k2, &k, seed ^ 5)?;
                check_dtype::<f64>(&comm, &k, &k2, seed ^ 6)?;
                comm.finalize().map_err(|e| e.to_string())
            },
        );
        all_ok(res).map(|_| ()).map_err(|e| format!("{:?} {n} ranks {proto:?} {forced:?}: {e}", s.wire))
    });
}

/// A persistent alltoallv runs many times (and started in a scope) with rewritten send
/// buffers, each run against the reference.
pub fn alltoallv_plans_run_many_times(s: &Suite) {
    for (n, seed, forced) in [
        (2usize, 11u64, Forced::Auto),
        (3, 12, Forced::Auto),
        (4, 13, Forced::Auto),
        (3, 14, Forced::All(Algo::Pairwise)),
        (4, 15, Forced::All(Algo::Pairwise)),
        (4, 16, Forced::Mixed),
    ] {
        let res = run_world(
            n,
            |r| Params { algo: forced.algo(r), ..params(s, ProtoChoice::Auto, Duration::from_secs(60), r) },
            |comm| {
                let r = comm.rank();
                let k = case(n, seed, 100);
                let (sl, rl) = (&k.send[r], &k.recv[r]);
                let sentinel = 0xEEEE_EEEE_u32;
                let mut send = vec![0u32; sl.len];
                let mut recv = vec![sentinel; rl.len];
                let mut plan = comm
                    .plan(ferroccl::op::alltoallv(&mut send, &sl.counts, &sl.displs, &mut recv, &rl.counts, &rl.displs))
                    .map_err(|e| format!("rank {r}: plan: {e}"))?;
                let runs = s.plan_runs.min(50) as u64;
                for run in 0..runs {
                    let seed = seed.wrapping_mul(1000).wrapping_add(run);
                    let data = send_data::<u32>(r, sl.len, seed);
                    plan.input_mut().ok_or("no input")?.copy_from_slice(&data);
                    if run % 5 == 4 {
                        comm.scope(|sc| sc.start_plan(&mut plan)?.wait()).map_err(|e| format!("rank {r}: run {run} in a scope: {e}"))?;
                    } else {
                        plan.run().map_err(|e| format!("rank {r}: run {run}: {e}"))?;
                    }
                    let want = reference::<u32>(&k, r, seed, sentinel);
                    if plan.output() != &want[..] {
                        return Err(format!("rank {r}/{n}: run {run}: got {:?}, want {want:?}", plan.output()));
                    }
                }
                drop(plan);
                comm.finalize().map_err(|e| e.to_string())
            },
        );
        all_ok(res).unwrap();
    }
}

/// Persistent gatherv and scatter plans run many times with rewritten send buffers,
/// every root, against the reference.
pub fn rooted_plans_run_many_times(s: &Suite) {
    for (n, seed) in [(2usize, 21u64), (3, 22), (4, 23)] {
        let res = run_world(
            n,
            |r| params(s, ProtoChoice::Auto, Duration::from_secs(60), r),
            |comm| {
                let r = comm.rank();
                let runs = s.plan_runs.min(20) as u64;
                let sentinel = 0xEEEE_EEEE_u32;
                for root in 0..n {
                    let k = case(n, seed ^ root as u64, 100);
                    let rl = &k.recv[root];
                    let mut send = vec![0u32; k.c[r][root]];
                    let mut recv = vec![sentinel; if r == root { rl.len } else { 0 }];
                    let (rc, rd) = if r == root { (&rl.counts[..], &rl.displs[..]) } else { (&[][..], &[][..]) };
                    let mut plan = comm
                        .plan(ferroccl::op::gatherv(&mut send, &mut recv, rc, rd, root))
                        .map_err(|e| format!("rank {r}: gatherv plan: {e}"))?;
                    for run in 0..runs {
                        let seed = seed.wrapping_mul(1000).wrapping_add(run);
                        plan.input_mut().ok_or("no input")?.copy_from_slice(&send_data::<u32>(r, k.c[r][root], seed));
                        plan.run().map_err(|e| format!("rank {r}: gatherv run {run}: {e}"))?;
                        if r == root {
                            let mut want = vec![sentinel; rl.len];
                            for p in 0..n {
                                want[rl.displs[p]..rl.displs[p] + k.c[p][root]].copy_from_slice(&send_data::<u32>(p, k.c[p][root], seed));
                            }
                            if plan.output() != &want[..] {
                                return Err(format!("rank {r}/{n}: gatherv run {run}: got {:?}, want {want:?}", plan.output()));
                            }
                        }
                    }
                    drop(plan);
                    let c = 1 + seed as usize % 7;
                    let mut send = vec![0u32; if r == root { n * c } else { 0 }];
                    let mut recv = vec![sentinel; c];
                    let mut plan =
                        comm.plan(ferroccl::op::scatter(&mut send, &mut recv, root)).map_err(|e| format!("rank {r}: scatter plan: {e}"))?;
                    for run in 0..runs {
                        let all = send_data::<u32>(root, n * c, run);
                        if r == root {
                            plan.input_mut().ok_or("no input")?.copy_from_slice(&all);
                        }
                        plan.run().map_err(|e| format!("rank {r}: scatter run {run}: {e}"))?;
                        if plan.output() != &all[r * c..(r + 1) * c] {
                            return Err(format!("rank {r}/{n}: scatter run {run}: got {:?}", plan.output()));
                        }
                    }
                }
                comm.finalize().map_err(|e| e.to_string())
            },
        );
        all_ok(res).unwrap();
    }
}

/// Counts and displacements that do not fit the buffers are errors naming the peer, found
/// before anything moves: the communicator stays usable.
pub fn alltoallv_bad_arguments_are_errors(s: &Suite) {
    let res = run_world(
        3,
        |r| params(s, ProtoChoice::Auto, Duration::from_secs(20), r),
        |comm| -> Result<(), String> {
            let me = comm.rank();
            let send = [1f32; 6];
            let mut recv = [0f32; 6];
            let ok = ([2usize, 2, 2], [0usize, 2, 4]);
            let mut errs = Vec::new();
            let mut call = |sc: &[usize], sd: &[usize], rc: &[usize], rd: &[usize], want: &str| {
                let r = comm.alltoallv(&send, sc, sd, &mut recv, rc, rd);
                match r {
                    Ok(()) => errs.push(format!("rank {me}: no error for {want:?}")),
                    Err(e) if !e.to_string().contains(want) => errs.push(format!("rank {me}: {e} does not say {want:?}")),
                    Err(_) => {}
                }
            };
            call(&ok.0[..2], &ok.1, &ok.0, &ok.1, "send_counts has 2 entries");
            call(&ok.0, &ok.1, &ok.0, &[0, 2, 4, 6], "recv_displacements has 4 entries");
            call(&[2, 2, 3], &ok.1, &ok.0, &ok.1, "send block of peer 2 (3 elements at displacement 4)");
            call(&ok.0, &ok.1, &ok.0, &[0, 2, 5], "recv block of peer 2 (2 elements at displacement 5)");
            call(&ok.0, &ok.1, &ok.0, &[0, 3, usize::MAX], "recv block of peer 2");
            call(&ok.0, &ok.1, &ok.0, &[4, 3, 0], "recv blocks of peers 1 (2 elements at 3) and 0 (2 elements at 4) overlap");
            let mut sc = ok.0;
            sc[me] = 1;
            call(&sc, &ok.1, &ok.0, &ok.1, &format!("send_counts[{me}] != recv_counts[{me}]"));
            if !errs.is_empty() {
                return Err(errs.join("\n"));
            }
            // Still usable: a good call.
            let send: Vec<f32> = (0..6).map(|i| (me * 10 + i) as f32).collect();
            comm.alltoallv(&send, &ok.0, &ok.1, &mut recv, &ok.0, &ok.1).map_err(|e| format!("rank {me}: {e}"))?;
            let want: Vec<f32> = (0..3).flat_map(|p| [(p * 10 + 2 * me) as f32, (p * 10 + 2 * me + 1) as f32]).collect();
            if recv[..] != want[..] {
                return Err(format!("rank {me}: got {recv:?}, want {want:?}"));
            }
            comm.finalize().map_err(|e| e.to_string())
        },
    );
    all_ok(res).unwrap();
}

/// Rank 1 expects `expect` elements from rank 0, which sends it `sends`; everything else
/// agrees (rank 2 takes part). Every rank fails (the receiver in the call, the others in
/// the call or at their next one), promptly, and ranks 0 and 1 name both counts.
fn mismatch_case(s: &Suite, sends: usize, expect: usize, forced: Forced) {
    let res = run_world(
        3,
        |r| Params { algo: forced.algo(r), ..params(s, ProtoChoice::Auto, Duration::from_secs(5), r) },
        |comm| {
            let me = comm.rank();
            comm.barrier().map_err(|e| format!("rank {me}: barrier before: {e}"))?;
            let mut sc = vec![3usize; 3];
            let mut rc = vec![3usize; 3];
            if me == 0 {
                sc[1] = sends;
            }
            if me == 1 {
                rc[0] = expect;
            }
            let displs = |c: &[usize]| c.iter().scan(0, |at, &x| Some(std::mem::replace(at, *at + x))).collect::<Vec<_>>();
            let send = vec![me as u32; sc.iter().sum()];
            let mut recv = vec![0u32; rc.iter().sum()];
            let t0 = Instant::now();
            let first = comm.alltoallv(&send, &sc, &displs(&sc), &mut recv, &rc, &displs(&rc));
            let (in_call, err) = match first {
                Err(e) => (true, e),
                Ok(()) => match comm.barrier() {
                    Err(e) => (false, e),
                    Ok(()) => return Err(format!("rank {me} (sends {sends}, expects {expect}): mismatch unnoticed")),
                },
            };
            Ok((in_call, err.to_string(), t0.elapsed()))
        },
    );
    let sides = all_ok(res).unwrap();
    let ctx = format!("{:?} {forced:?}, rank 0 sends {sends}, rank 1 expects {expect}: {sides:#?}", s.wire);
    assert!(sides[1].0, "the receiver's call succeeded: {ctx}");
    for (r, (_, err, after)) in sides.iter().enumerate() {
        assert!(!err.contains("timed out"), "rank {r} waited for the deadline: {ctx}");
        if s.clocks {
            assert!(*after < Duration::from_secs(3), "rank {r} failed only after {after:?}: {ctx}");
        }
    }
    for (r, (_, err, _)) in sides.iter().enumerate().take(2) {
        let want = [format!("rank 1 receives {expect} u32"), format!("rank 0 sends {sends} u32")];
        assert!(want.iter().all(|w| err.contains(w.as_str())), "rank {r}'s error does not name both counts: {ctx}");
    }
}

/// A receiver's count that differs from what its sender sends: eager, rendezvous and
/// mixed, and a count of 0 on either side.
pub fn alltoallv_mismatched_counts_fail_on_every_rank(s: &Suite) {
    for forced in [Forced::Auto, Forced::All(Algo::Pairwise), Forced::Mixed] {
        mismatch_case(s, 5, 4, forced);
        mismatch_case(s, 0, 2, forced);
        mismatch_case(s, 3, 0, forced);
        mismatch_case(s, 300, 200, forced);
        mismatch_case(s, 2, 300, forced);
    }
}

/// gather, scatter (equal counts) and gatherv, scatterv (random counts with zeros, gapped
/// layouts at the root) from every root, on 2 to 4 ranks, four dtypes, every protocol.
pub fn gather_scatter_and_v_forms_equal_the_reference(s: &Suite) {
    let protos = prop_oneof![Just(ProtoChoice::Auto), Just(ProtoChoice::Eager), Just(ProtoChoice::Rendezvous)];
    let config = ProptestConfig { cases: s.nonblocking_cases, ..ProptestConfig::default() };
    check_cases(config, (2usize..=4, any::<u64>(), protos), |(n, seed, proto)| {
        let res = run_world(
            n,
            |r| params(s, proto, Duration::from_secs(60), r),
            |comm| {
                for root in 0..n {
                    let seed = seed ^ (root as u64) << 40;
                    rooted::<f32>(&comm, root, seed)?;
                    rooted::<bf16>(&comm, root, seed ^ 1)?;
                    rooted::<u8>(&comm, root, seed ^ 2)?;
                    rooted::<i64>(&comm, root, seed ^ 3)?;
                }
                comm.finalize().map_err(|e| e.to_string())
            },
        );
        all_ok(res).map(|_| ()).map_err(|e| format!("{:?} {n} ranks {proto:?}: {e}", s.wire))
    });
}

fn rooted<X: V>(comm: &Communicator, root: usize, seed: u64) -> Result<(), String> {
    let (n, r) = (comm.size(), comm.rank());
    let ctx = |what: &str| format!("rank {r}/{n} {what} root {root} {}", X::DTYPE);
    let sentinel = X::v(0xFFFF_FFFF_FFFF_FFFF);
    let c = Rng(seed).below(101) as usize;

    // gather
    let send = send_data::<X>(r, c, seed);
    let mut recv = vec![sentinel; if r == root { n * c } else { 0 }];
    comm.gather(&send, &mut recv, root).map_err(|e| format!("{}: {e}", ctx("gather")))?;
    if r == root {
        let want: Vec<X> = (0..n).flat_map(|p| send_data::<X>(p, c, seed)).collect();
        if recv != want {
            return Err(format!("{}: got {recv:?}, want {want:?}", ctx("gather")));
        }
    }

    // scatter
    let all = send_data::<X>(root, n * c, seed ^ 7);
    let send = if r == root { all.clone() } else { Vec::new() };
    let mut recv = vec![sentinel; c];
    comm.scatter(&send, &mut recv, root).map_err(|e| format!("{}: {e}", ctx("scatter")))?;
    if recv[..] != all[r * c..(r + 1) * c] {
        return Err(format!("{}: got {recv:?}, want {:?}", ctx("scatter"), &all[r * c..(r + 1) * c]));
    }

    // gatherv: rank p sends c[p][root]; the root's layout is gapped.
    let k = case(n, seed, 100);
    let send = send_data::<X>(r, k.c[r][root], seed);
    let rl = &k.recv[root];
    let mut recv = vec![sentinel; if r == root { rl.len } else { 0 }];
    let (rc, rd) = if r == root { (&rl.counts[..], &rl.displs[..]) } else { (&[][..], &[][..]) };
    comm.gatherv(&send, &mut recv, rc, rd, root).map_err(|e| format!("{}: {e}", ctx("gatherv")))?;
    if r == root {
        let mut want = vec![sentinel; rl.len];
        for p in 0..n {
            want[rl.displs[p]..rl.displs[p] + k.c[p][root]].copy_from_slice(&send_data::<X>(p, k.c[p][root], seed));
        }
        if recv != want {
            return Err(format!("{}: got {recv:?}, want {want:?} ({k:?})", ctx("gatherv")));
        }
    }

    // scatterv: the root sends c[root][p] to p from its gapped layout.
    let sl = &k.send[root];
    let data = send_data::<X>(root, sl.len, seed ^ 9);
    let send = if r == root { data.clone() } else { Vec::new() };
    let (sc, sd) = if r == root { (&sl.counts[..], &sl.displs[..]) } else { (&[][..], &[][..]) };
    let mut recv = vec![sentinel; k.c[root][r]];
    comm.scatterv(&send, sc, sd, &mut recv, root).map_err(|e| format!("{}: {e}", ctx("scatterv")))?;
    let want = &data[sl.displs[r]..sl.displs[r] + k.c[root][r]];
    if recv[..] != want[..] {
        return Err(format!("{}: got {recv:?}, want {want:?} ({k:?})", ctx("scatterv")));
    }
    let blocking = recv;

    // The four at once in a scope (gatherv's and scatterv's results against the blocking
    // calls'; gather and scatter against the reference again).
    let g_send = send_data::<X>(r, c, seed);
    let mut g_recv = vec![sentinel; if r == root { n * c } else { 0 }];
    let s_send = if r == root { all.clone() } else { Vec::new() };
    let mut s_recv = vec![sentinel; c];
    let gv_send = send_data::<X>(r, k.c[r][root], seed);
    let mut gv_recv = vec![sentinel; if r == root { rl.len } else { 0 }];
    let mut sv_recv = vec![sentinel; k.c[root][r]];
    comm.scope(|scope| {
        let a = scope.start(ferroccl::op::gather(&g_send, &mut g_recv, root))?;
        let b = scope.start(ferroccl::op::scatter(&s_send, &mut s_recv, root))?;
        let c = scope.start(ferroccl::op::gatherv(&gv_send, &mut gv_recv, rc, rd, root))?;
        let d = scope.start(ferroccl::op::scatterv(&send, sc, sd, &mut sv_recv, root))?;
        d.wait()?;
        c.wait()?;
        b.wait()?;
        a.wait()
    })
    .map_err(|e| format!("{}: {e}", ctx("scope")))?;
    if r == root {
        let want: Vec<X> = (0..n).flat_map(|p| send_data::<X>(p, c, seed)).collect();
        if g_recv != want {
            return Err(format!("{}: gather: got {g_recv:?}, want {want:?}", ctx("scope")));
        }
        let mut want = vec![sentinel; rl.len];
        for p in 0..n {
            want[rl.displs[p]..rl.displs[p] + k.c[p][root]].copy_from_slice(&send_data::<X>(p, k.c[p][root], seed));
        }
        if gv_recv != want {
            return Err(format!("{}: gatherv: got {gv_recv:?}, want {want:?}", ctx("scope")));
        }
    }
    if s_recv[..] != all[r * c..(r + 1) * c] || sv_recv != blocking {
        return Err(format!("{}: scatter got {s_recv:?}, scatterv got {sv_recv:?} (blocking: {blocking:?})", ctx("scope")));
    }

    // The four in one group (one job): the same results.
    let mut g_recv2 = vec![sentinel; g_recv.len()];
    let mut s_recv2 = vec![sentinel; c];
    let mut gv_recv2 = vec![sentinel; gv_recv.len()];
    let mut sv_recv2 = vec![sentinel; sv_recv.len()];
    comm.group(|g| {
        g.add(ferroccl::op::gather(&g_send, &mut g_recv2, root))?;
        g.add(ferroccl::op::scatter(&s_send, &mut s_recv2, root))?;
        g.add(ferroccl::op::gatherv(&gv_send, &mut gv_recv2, rc, rd, root))?;
        g.add(ferroccl::op::scatterv(&send, sc, sd, &mut sv_recv2, root))
    })
    .map_err(|e| format!("{}: {e}", ctx("group")))?;
    if g_recv2 != g_recv || s_recv2 != s_recv || gv_recv2 != gv_recv || sv_recv2 != sv_recv {
        return Err(format!(
            "{}: gather {g_recv2:?} scatter {s_recv2:?} gatherv {gv_recv2:?} scatterv {sv_recv2:?} differ from the scope's",
            ctx("group")
        ));
    }
    Ok(())
}

/// Bad arguments of the rooted calls are errors before anything moves; a gatherv or
/// scatterv whose root's count for a rank differs from that rank's fails on every rank,
/// promptly, naming both counts where it is found.
pub fn gather_scatter_bad_arguments_and_mismatches_are_errors(s: &Suite) {
    let res = run_world(
        3,
        |r| params(s, ProtoChoice::Auto, Duration::from_secs(20), r),
        |comm| -> Result<(), String> {
            let me = comm.rank();
            let mut buf = [0u32; 6];
            let mut errs = Vec::new();
            let mut expect = |r: ferroccl::Result<()>, want: &str| match r {
                Ok(()) => errs.push(format!("rank {me}: no error for {want:?}")),
                Err(e) if !e.to_string().contains(want) => errs.push(format!("rank {me}: {e} does not say {want:?}")),
                Err(_) => {}
            };
            expect(comm.gather(&[1u32; 2], &mut buf, 3), "root 3 is out of range");
            expect(comm.scatterv(&[1u32; 2], &[1, 1, 0], &[0, 1, 2], &mut buf, 5), "root 5 is out of range");
            if me == 0 {
                expect(comm.gather(&[1u32; 3], &mut buf, 0), "recv has 6 elements, expected 9");
                expect(comm.scatter(&[1u32; 5], &mut buf[..2], 0), "send has 5 elements, expected 6");
                expect(comm.gatherv(&[1u32; 2], &mut buf, &[2, 2], &[0, 2], 0), "recv_counts has 2 entries");
                expect(comm.gatherv(&[1u32; 2], &mut buf, &[2, 2, 2], &[0, 2, 5], 0), "recv block of peer 2");
                expect(comm.gatherv(&[1u32; 2], &mut buf, &[2, 2, 2], &[0, 1, 4], 0), "overlap");
                expect(comm.gatherv(&[1u32; 1], &mut buf, &[2, 2, 2], &[0, 2, 4], 0), "recv_counts[0] is 2");
                expect(comm.scatterv(&[1u32; 6], &[2, 2, 3], &[0, 2, 4], &mut buf[..2], 0), "send block of peer 2");
                expect(comm.scatterv(&[1u32; 6], &[2, 2, 2], &[0, 2, 4], &mut buf[..1], 0), "send_counts[0] is 2");
            }
            if !errs.is_empty() {
                return Err(errs.join("\n"));
            }
            // Still usable.
            let mine = [me as u32 * 10, me as u32 * 10 + 1];
            let mut all = [0u32; 6];
            comm.gather(&mine, &mut all, 0).map_err(|e| format!("rank {me}: {e}"))?;
            if me == 0 && all != [0, 1, 10, 11, 20, 21] {
                return Err(format!("rank 0: gathered {all:?}"));
            }
            comm.finalize().map_err(|e| e.to_string())
        },
    );
    all_ok(res).unwrap();
    // Mismatches: rank 1 sends 3 where the root (0) expects 2, eager and rendezvous; the
    // root sends rank 2 four elements where it expects five.
    for (gather, got, want) in [(true, 3usize, 2usize), (true, 0, 300), (true, 400, 2), (false, 4, 5), (false, 300, 0)] {
        let res = run_world(
            3,
            |r| params(s, ProtoChoice::Auto, Duration::from_secs(5), r),
            |comm| {
                let me = comm.rank();
                comm.barrier().map_err(|e| format!("rank {me}: barrier before: {e}"))?;
                let t0 = Instant::now();
                let first = if gather {
                    let send = vec![1u32; if me == 1 { got } else { 2 }];
                    let counts = [2, want, 2];
                    let displs = [0, 2, 2 + want];
                    let mut recv = vec![0u32; 4 + want];
                    comm.gatherv(&send, &mut recv, &counts, &displs, 0)
                } else {
                    let counts = [2, 2, got];
                    let send = vec![1u32; 4 + got];
                    let mut recv = vec![0u32; if me == 2 { want } else { 2 }];
                    comm.scatterv(&send, &counts, &[0, 2, 4], &mut recv, 0)
                };
                let (in_call, err) = match first {
                    Err(e) => (true, e),
                    Ok(()) => match comm.barrier() {
                        Err(e) => (false, e),
                        Ok(()) => return Err(format!("rank {me}: mismatch unnoticed")),
                    },
                };
                Ok((in_call, err.to_string(), t0.elapsed()))
            },
        );
        let sides = all_ok(res).unwrap();
        let ctx = format!("{:?} gather {gather} got {got} want {want}: {sides:#?}", s.wire);
        let (finder, text) = if gather {
            (0, [format!("rank 0 receives {want} u32"), format!("rank 1 sends {got} u32")])
        } else {
            (2, [format!("rank 2 receives {want} u32"), format!("rank 0 sends {got} u32")])
        };
        assert!(sides[finder].0, "the receiver's call succeeded: {ctx}");
        assert!(text.iter().all(|t| sides[finder].1.contains(t.as_str())), "rank {finder} does not name both counts: {ctx}");
        for (r, (_, err, after)) in sides.iter().enumerate() {
            assert!(!err.contains("timed out"), "rank {r} waited for the deadline: {ctx}");
            if s.clocks {
                assert!(*after < Duration::from_secs(3), "rank {r} failed only after {after:?}: {ctx}");
            }
        }
    }
}
