//! The progress engine's API, over one instantiation's transport: non-blocking
//! collectives in flight together (waited in random order) against the reference,
//! persistent plans run many times with their buffers rewritten between runs, group calls,
//! dropping requests without waiting, async `.await`, and `abort`.
//!
//! Values are small integers, so every algorithm's result is exactly the reference whatever
//! its reduction order.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferroccl::{Algo, Collective, Communicator, Error, LlChoice, Op, Params, ReduceOp, Request};
use ferroccl_kernels::bf16;
use proptest::prelude::*;
use proptest::test_runner::Config as ProptestConfig;

use crate::harness::{check_cases, run_world, RankResult, Suite, Wire};

fn params(s: &Suite, rank: usize) -> Params {
    Params { timeout: Duration::from_secs(60), ..s.params(rank) }
}

/// Runs `f` on `n` thread-ranks over `s`'s transport; returns each rank's result (an init
/// failure or a panic as `Err`).
fn world<R: Send>(s: &Suite, n: usize, f: impl Fn(Communicator) -> RankResult<R> + Sync) -> Vec<RankResult<R>> {
    run_world(n, |r| params(s, r), f)
}

/// Rank r's input value at index i of operation k.
fn val(k: usize, r: usize, i: usize) -> i64 {
    ((k * 31 + r * 7 + i * 3) % 23) as i64 - 11
}

/// One operation of a random sequence.
#[derive(Debug, Clone)]
enum OpSpec {
    AllreduceF32 { len: usize, op: u8 },
    AllreduceBf16 { len: usize },
    AllgatherI32 { len: usize },
    ReduceScatterF64 { len: usize },
    BroadcastU8 { len: usize, root: usize },
}

fn op_spec(n: usize) -> impl Strategy<Value = OpSpec> {
    let len = prop_oneof![0usize..4, 1usize..300, 1000usize..40_000];
    prop_oneof![
        (len.clone(), 0u8..3).prop_map(|(len, op)| OpSpec::AllreduceF32 { len, op }),
        len.clone().prop_map(|len| OpSpec::AllreduceBf16 { len }),
        len.clone().prop_map(|len| OpSpec::AllgatherI32 { len }),
        len.clone().prop_map(|len| OpSpec::ReduceScatterF64 { len }),
        (len, 0..n).prop_map(|(len, root)| OpSpec::BroadcastU8 { len, root }),
    ]
}

/// Buffers of one operation on one rank, and how to check them.
enum Bufs {
    F32(Vec<f32>, ReduceOp),
    Bf16(Vec<bf16>),
    I32(Vec<i32>, Vec<i32>),
    F64(Vec<f64>, Vec<f64>),
    U8(Vec<u8>, usize),
}

fn make(k: usize, spec: &OpSpec, r: usize, n: usize) -> Bufs {
    match *spec {
        OpSpec::AllreduceF32 { len, op } => {
            let op = [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min][op as usize];
            Bufs::F32((0..len).map(|i| val(k, r, i) as f32).collect(), op)
        }
        OpSpec::AllreduceBf16 { len } => Bufs::Bf16((0..len).map(|i| bf16::from_f32(val(k, r, i) as f32)).collect()),
        OpSpec::AllgatherI32 { len } => Bufs::I32((0..len).map(|i| val(k, r, i) as i32).collect(), vec![0; len * n]),
        OpSpec::ReduceScatterF64 { len } => Bufs::F64((0..len * n).map(|i| val(k, r, i) as f64).collect(), vec![0.0; len]),
        OpSpec::BroadcastU8 { len, root } => {
            Bufs::U8((0..len).map(|i| if r == root { (val(k, r, i) + 11) as u8 } else { 0 }).collect(), root)
        }
    }
}

fn check(k: usize, spec: &OpSpec, b: &Bufs, r: usize, n: usize) -> Result<(), String> {
    let bad = |what: &str| Err(format!("op {k} {spec:?} on rank {r}: {what}"));
    match (spec, b) {
        (OpSpec::AllreduceF32 { .. }, Bufs::F32(v, op)) => {
            for (i, x) in v.iter().enumerate() {
                let vals = (0..n).map(|q| val(k, q, i));
                let want = match op {
                    ReduceOp::Sum => vals.sum::<i64>(),
                    ReduceOp::Max => vals.max().unwrap_or(0),
                    _ => vals.min().unwrap_or(0),
                } as f32;
                if *x != want {
                    return bad(&format!("[{i}] = {x}, want {want}"));
                }
            }
        }
        (OpSpec::AllreduceBf16 { .. }, Bufs::Bf16(v)) => {
            for (i, x) in v.iter().enumerate() {
                let want = (0..n).map(|q| val(k, q, i)).sum::<i64>() as f32;
                if x.to_f32() != want {
                    return bad(&format!("[{i}] = {x}, want {want}"));
                }
            }
        }
        (OpSpec::AllgatherI32 { len }, Bufs::I32(_, out)) => {
            for q in 0..n {
                for i in 0..*len {
                    if out[q * len + i] != val(k, q, i) as i32 {
                        return bad(&format!("block {q} [{i}]"));
                    }
                }
            }
        }
        (OpSpec::ReduceScatterF64 { len }, Bufs::F64(_, out)) => {
            for (i, x) in out.iter().enumerate() {
                let want = (0..n).map(|q| val(k, q, r * len + i)).sum::<i64>() as f64;
                if *x != want {
                    return bad(&format!("[{i}] = {x}, want {want}"));
                }
            }
        }
        (OpSpec::BroadcastU8 { root, .. }, Bufs::U8(v, _)) => {
            for (i, x) in v.iter().enumerate() {
                if *x != (val(k, *root, i) + 11) as u8 {
                    return bad(&format!("[{i}]"));
                }
            }
        }
        _ => return bad("buffer kind"),
    }
    Ok(())
}

/// Starts every operation in `specs` in one scope, then waits for them in `order` (the
/// rest are dropped, so the scope waits for them), and checks every result.
fn run_sequence(comm: &Communicator, specs: &[OpSpec], order: &[usize], drop_some: bool) -> Result<(), String> {
    let (r, n) = (comm.rank(), comm.size());
    let mut bufs: Vec<Bufs> = specs.iter().enumerate().map(|(k, s)| make(k, s, r, n)).collect();
    comm.scope(|s| {
        let mut reqs: Vec<Option<Request<'_>>> = Vec::new();
        for b in bufs.iter_mut() {
            reqs.push(Some(match b {
                Bufs::F32(v, op) => s.start(ferroccl::op::allreduce(v, *op))?,
                Bufs::Bf16(v) => s.start(ferroccl::op::allreduce(v, ReduceOp::Sum))?,
                Bufs::I32(send, recv) => s.start(ferroccl::op::allgather_into(send, recv))?,
                Bufs::F64(send, recv) => s.start(ferroccl::op::reduce_scatter_into(send, recv, ReduceOp::Sum))?,
                Bufs::U8(v, root) => s.start(ferroccl::op::broadcast(v, *root))?,
            }));
        }
        for (j, &i) in order.iter().enumerate() {
            let m = reqs.len();
            if let Some(req) = reqs[i % m].take() {
                if drop_some && j % 3 == 2 {
                    drop(req); // the scope waits for it
                } else if j % 2 == 0 {
                    req.wait()?;
                } else {
                    while !req.test()? {
                        std::thread::yield_now();
                    }
                }
            }
        }
        Ok(())
    })
    .map_err(|e| format!("rank {r}: {e}"))?;
    for (k, (spec, b)) in specs.iter().zip(&bufs).enumerate() {
        check(k, spec, b, r, n)?;
    }
    Ok(())
}

pub fn interleaved_nonblocking_collectives_equal_the_reference(s: &Suite) {
    interleaved(s, |r| params(s, r));
}

/// Random sequences of non-blocking collectives (as above) with every call that fits the
/// slots on the low-latency protocol (forced, slots of [`LL_SLOT`] bytes), the others on the
/// schedules beside them in the engine.
pub fn forced_ll_interleaved_nonblocking_collectives_equal_the_reference(s: &Suite) {
    interleaved(s, |r| ll_params(s, r));
}

fn interleaved(s: &Suite, params: impl Fn(usize) -> Params + Sync) {
    let case = (2usize..5, proptest::collection::vec(op_spec(4), 1..7), any::<u64>(), any::<bool>());
    let config = ProptestConfig { cases: s.nonblocking_cases, ..ProptestConfig::default() };
    check_cases(config, case, |(n, specs, order_seed, drop_some)| {
        // Roots must be in range for this n.
        let specs: Vec<OpSpec> = specs
            .into_iter()
            .map(|spec| match spec {
                OpSpec::BroadcastU8 { len, root } => OpSpec::BroadcastU8 { len, root: root % n },
                spec => spec,
            })
            .collect();
        // Each rank waits in its own random order.
        let res = run_world(n, &params, |comm| {
            let r = comm.rank() as u64;
            let mut order: Vec<usize> = (0..specs.len()).collect();
            let mut x = order_seed ^ (r.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            for i in (1..order.len()).rev() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                order.swap(i, (x % (i as u64 + 1)) as usize);
            }
            let out = run_sequence(&comm, &specs, &order, drop_some);
            comm.finalize().map_err(|e| e.to_string())?;
            out
        });
        res.into_iter().collect::<Result<Vec<()>, String>>().map(|_| ())
    });
}

pub fn plans_run_many_times_with_rewritten_buffers(s: &Suite) {
    {
        let res = world(s, 3, |comm| -> Result<(), String> {
            let (r, n) = (comm.rank(), comm.size());
            let e = |e: Error| e.to_string();
            let mut small = vec![0i64; 3];
            let mut big = vec![0.0f32; 70_000]; // rendezvous, several chunks
            let mut ag_send = vec![0u32; 5];
            let mut ag_recv = vec![0u32; 5 * n];
            let mut rs_send = vec![0i32; 4 * n];
            let mut rs_recv = vec![0i32; 4];
            let mut bc = vec![0u8; 33];
            {
                let mut p_small = comm.plan(ferroccl::op::allreduce(&mut small, ReduceOp::Sum)).map_err(e)?;
                let mut p_big = comm.plan(ferroccl::op::allreduce(&mut big, ReduceOp::Max)).map_err(e)?;
                let mut p_ag = comm.plan(ferroccl::op::allgather_into(&mut ag_send, &mut ag_recv)).map_err(e)?;
                let mut p_rs = comm.plan(ferroccl::op::reduce_scatter_into(&mut rs_send, &mut rs_recv, ReduceOp::Sum)).map_err(e)?;
                let mut p_bc = comm.plan(ferroccl::op::broadcast(&mut bc, 1)).map_err(e)?;
                let runs = s.plan_runs;
                for k in 0..runs {
                    p_small.output_mut().copy_from_slice(&[k as i64, r as i64, 1]);
                    p_small.run().map_err(e)?;
                    let want = [k as i64 * n as i64, (0..n as i64).sum(), n as i64];
                    if p_small.output() != want {
                        return Err(format!("run {k}: small allreduce {:?}, want {want:?}", p_small.output()));
                    }
                    p_ag.input_mut().ok_or("allgather input")?.fill((k * 10 + r) as u32);
                    p_ag.run().map_err(e)?;
                    for q in 0..n {
                        if p_ag.output()[q * 5..q * 5 + 5].iter().any(|&x| x != (k * 10 + q) as u32) {
                            return Err(format!("run {k}: allgather block {q}"));
                        }
                    }
                    let rs_in = p_rs.input_mut().ok_or("reduce_scatter input")?;
                    for (i, x) in rs_in.iter_mut().enumerate() {
                        *x = (i + k) as i32;
                    }
                    p_rs.run().map_err(e)?;
                    let rs_want: Vec<i32> = (0..4).map(|i| ((r * 4 + i + k) * n) as i32).collect();
                    if p_rs.output() != rs_want {
                        return Err(format!("run {k}: reduce_scatter {:?}, want {rs_want:?}", p_rs.output()));
                    }
                    p_bc.output_mut().fill(if r == 1 { k as u8 } else { 0xee });
                    p_bc.run().map_err(e)?;
                    if p_bc.output().iter().any(|&x| x != k as u8) {
                        return Err(format!("run {k}: broadcast"));
                    }
                    if k % 50 == 0 {
                        p_big.output_mut().iter_mut().enumerate().for_each(|(i, x)| *x = ((i + r + k) % 1000) as f32);
                        p_big.run().map_err(e)?;
                        let ok = p_big
                            .output()
                            .iter()
                            .enumerate()
                            .all(|(i, x)| *x == (0..n).map(|q| ((i + q + k) % 1000) as f32).fold(f32::MIN, f32::max));
                        if !ok {
                            return Err(format!("run {k}: big allreduce"));
                        }
                    }
                }
                if p_small.runs() != runs as u64 {
                    return Err("run count".into());
                }
            }
            comm.finalize().map_err(e)
        });
        for r in res {
            assert!(r.is_ok(), "{:?}: {}", s.wire, r.unwrap_err());
        }
    }
}

pub fn groups_run_as_one_unit(s: &Suite) {
    let res = world(s, 4, |comm| -> Result<(), String> {
        let (r, n) = (comm.rank(), comm.size());
        let mut a = vec![r as u32 + 1; 10];
        let mut b = vec![1.0f64; 100_000];
        let send = vec![r as u8; 7];
        let mut got = vec![0u8; 7];
        let (to, from) = ((r + 1) % n, (r + n - 1) % n);
        comm.group(|g| {
            // A receive added after the send: a group cannot deadlock on it.
            g.add(ferroccl::op::send(&send, to))?;
            g.add(ferroccl::op::allreduce(&mut a, ReduceOp::Sum))?;
            g.add(ferroccl::op::recv(&mut got, from))?;
            g.add(ferroccl::op::allreduce(&mut b, ReduceOp::Sum))?;
            Ok(())
        })
        .map_err(|e| e.to_string())?;
        let sum: u32 = (1..=n as u32).sum();
        if a.iter().any(|&x| x != sum) || b.iter().any(|&x| x != n as f64) || got.iter().any(|&x| x != from as u8) {
            return Err(format!("rank {r}: group results wrong"));
        }
        // Small allreduces of one type and op are fused into one; others run beside them.
        let mut smalls: Vec<Vec<f32>> = (1..6).map(|k| vec![(r * k) as f32; k * 3]).collect();
        let mut maxes: Vec<Vec<i64>> = (0..2).map(|k| vec![(r + k) as i64; 4]).collect();
        let mut lone = vec![1u8; 5];
        comm.group(|g| {
            for v in smalls.iter_mut() {
                g.add(ferroccl::op::allreduce(v, ReduceOp::Sum))?;
            }
            for v in maxes.iter_mut() {
                g.add(ferroccl::op::allreduce(v, ReduceOp::Max))?;
            }
            g.add(ferroccl::op::allreduce(&mut lone, ReduceOp::Sum))
        })
        .map_err(|e| e.to_string())?;
        let rsum: usize = (0..n).sum();
        for (k, v) in smalls.iter().enumerate() {
            if v.len() != (k + 1) * 3 || v.iter().any(|&x| x != (rsum * (k + 1)) as f32) {
                return Err(format!("rank {r}: fused allreduce {k}: {v:?}"));
            }
        }
        for (k, v) in maxes.iter().enumerate() {
            if v.iter().any(|&x| x != (n - 1 + k) as i64) {
                return Err(format!("rank {r}: fused max {k}: {v:?}"));
            }
        }
        if lone != [n as u8; 5] {
            return Err(format!("rank {r}: lone allreduce {lone:?}"));
        }
        // A failed argument check starts nothing, and the communicator stays usable.
        let mut short = vec![0u8; 3];
        let err = comm.group(|g| {
            g.add(ferroccl::op::allreduce(&mut a, ReduceOp::Sum))?;
            g.add(ferroccl::op::allgather_into(&send, &mut short))
        });
        if !matches!(err, Err(Error::InvalidArgument(_))) {
            return Err(format!("rank {r}: bad group gave {err:?}"));
        }
        comm.barrier().map_err(|e| e.to_string())?;
        comm.finalize().map_err(|e| e.to_string())
    });
    for r in res {
        assert!(r.is_ok(), "{}", r.unwrap_err());
    }
}

/// A minimal executor: polls a future, parking the thread between wake-ups.
fn block_on<F: std::future::Future>(f: F) -> F::Output {
    use std::task::{Context, Poll, Wake, Waker};
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        match f.as_mut().poll(&mut cx) {
            Poll::Ready(v) => return v,
            Poll::Pending => std::thread::park_timeout(Duration::from_millis(100)),
        }
    }
}

pub fn requests_are_futures_and_progress_without_a_waiter(s: &Suite) {
    let res = world(s, 3, |comm| -> Result<(), String> {
        let n = comm.size();
        let mut a = vec![2.0f32; 200_000];
        let mut b = vec![1i64; 5];
        comm.scope(|s| {
            let ra = s.start(ferroccl::op::allreduce(&mut a, ReduceOp::Sum))?;
            let rb = s.start(ferroccl::op::allreduce(&mut b, ReduceOp::Sum))?;
            // Nobody waits: the engine's thread completes them.
            let t0 = Instant::now();
            while !(rb.wait_timeout(Duration::ZERO)? && ra.wait_timeout(Duration::ZERO)?) {
                if t0.elapsed() > Duration::from_secs(30) {
                    return Err(Error::InvalidArgument("no progress without a waiter".into()));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            block_on(async {
                ra.await?;
                rb.await
            })
        })
        .map_err(|e| e.to_string())?;
        if a.iter().any(|&x| x != 2.0 * n as f32) || b.iter().any(|&x| x != n as i64) {
            return Err("wrong result".into());
        }
        let mut c = vec![1u8; 3];
        comm.scope(|s| block_on(s.start(ferroccl::op::allreduce(&mut c, ReduceOp::Sum))?)).map_err(|e| e.to_string())?;
        if c != [n as u8; 3] {
            return Err("async allreduce".into());
        }
        comm.finalize().map_err(|e| e.to_string())
    });
    for r in res {
        assert!(r.is_ok(), "{}", r.unwrap_err());
    }
}

pub fn abort_unblocks_a_rank_waiting_for_a_peer_that_never_comes(s: &Suite) {
    // Rank 1 never joins the allreduce; rank 0 aborts from another thread. Later calls (a
    // barrier) fail the same way.
    abort_while_a_peer_never_comes(s, &|r| params(s, r), 1000, false, &|comm| comm.barrier());
}

/// A rank that only sends still hears of a peer's abort: rank 0 broadcasts 8 B in a loop
/// (off the low-latency slots: every call a job that needs nothing from the peer), rank 1
/// aborts its communicator and then stays alive without calling anything. Rank 0 must fail
/// with the abort within 2,000 calls of it, not go on succeeding while the peer's socket or
/// ring still takes its data (measured: it fails in the call where it first sees rank 1's
/// flag, or, over shm, when the ring is full just before).
pub fn a_rank_that_only_sends_hears_of_a_peers_abort(s: &Suite) {
    let (aborted, done) = (AtomicBool::new(false), AtomicBool::new(false));
    let res = run_world(
        2,
        |r| Params { ll: LlChoice::Off, ..params(s, r) },
        |comm| -> Result<(), String> {
            let r = comm.rank();
            comm.barrier().map_err(|e| format!("rank {r}: barrier: {e}"))?;
            if r == 1 {
                std::thread::sleep(Duration::from_millis(20));
                comm.abort();
                aborted.store(true, Ordering::SeqCst);
                // Alive, calling nothing, until rank 0 is done.
                let t0 = Instant::now();
                while !done.load(Ordering::SeqCst) && t0.elapsed() < Duration::from_secs(60) {
                    std::thread::sleep(Duration::from_millis(5));
                }
                return Ok(());
            }
            let sent = || -> Result<(), String> {
                let mut b = [1.0f32; 2];
                let mut after = None::<u64>;
                for i in 0u64..1_000_000 {
                    if after.is_none() && aborted.load(Ordering::SeqCst) {
                        after = Some(i);
                    }
                    match comm.broadcast(&mut b, 0) {
                        Ok(()) if after.is_some_and(|a| i - a > 2_000) => {
                            return Err(format!("rank 0: still succeeding 2,000 calls after rank 1 aborted (call {i})"));
                        }
                        Ok(()) => {}
                        Err(Error::Aborted { by: Some(1), .. }) => return Ok(()),
                        Err(e) => return Err(format!("rank 0: call {i}: {e:?}")),
                    }
                }
                Err("rank 0: a million calls and no abort".into())
            };
            let r = sent();
            done.store(true, Ordering::SeqCst);
            r
        },
    );
    for r in res {
        assert!(r.is_ok(), "{}", r.unwrap_err());
    }
}

/// Rank 1 never joins rank 0's allreduce of `count` f32 (with `params`); rank 0 aborts from
/// another thread, and its call fails with `Aborted` promptly (over shm, with `want_ll`,
/// naming a low-latency call); so does `after` on rank 0, and rank 1's allreduce, which then
/// finds the abort.
fn abort_while_a_peer_never_comes(
    s: &Suite,
    params: &(dyn Fn(usize) -> Params + Sync),
    count: usize,
    want_ll: bool,
    after: &(dyn Fn(&Communicator) -> ferroccl::Result<()> + Sync),
) {
    let done = AtomicBool::new(false);
    let res = run_world(2, params, |comm| -> Result<(), String> {
        let r = comm.rank();
        if r != 0 {
            // Wait for rank 0's abort to reach us, without calling anything matching.
            let t0 = Instant::now();
            while !done.load(Ordering::SeqCst) && t0.elapsed() < Duration::from_secs(20) {
                std::thread::sleep(Duration::from_millis(5));
            }
            let mut x = [1u8];
            return match comm.allreduce(&mut x, ReduceOp::Sum) {
                Err(Error::Aborted { by: Some(0), .. }) => Ok(()),
                other => Err(format!("rank {r} after rank 0's abort: {other:?}")),
            };
        }
        let mut buf = vec![0.0f32; count];
        let t0 = Instant::now();
        let err = std::thread::scope(|sc| {
            sc.spawn(|| {
                std::thread::sleep(Duration::from_millis(300));
                comm.abort();
            });
            comm.allreduce(&mut buf, ReduceOp::Sum)
        });
        let took = t0.elapsed();
        done.store(true, Ordering::SeqCst);
        match err {
            Err(Error::Aborted { rank: 0, op: Op::Collective { coll: Collective::AllReduce, algo, .. }, by: None }) => {
                if want_ll && s.wire == Wire::Shm && algo != Algo::Ll {
                    return Err(format!("rank 0 aborted a {algo} allreduce, not a low-latency one"));
                }
            }
            other => return Err(format!("rank 0: {other:?}")),
        }
        // Promptly: the abort came at 0.3 s; allow a slow machine plenty. (Without clocks,
        // over verbs in an emulated VM, the check is that the error is the abort.)
        if s.clocks && took > Duration::from_millis(300) + Duration::from_secs(1) {
            return Err(format!("abort took {took:?}"));
        }
        match after(&comm) {
            Err(Error::Aborted { .. }) => Ok(()),
            other => Err(format!("after abort: {other:?}")),
        }
    });
    for r in res {
        assert!(r.is_ok(), "{:?}: {}", s.wire, r.unwrap_err());
    }
}

pub fn plans_start_in_scopes_next_to_other_operations(s: &Suite) {
    let res = world(s, 3, |comm| -> Result<(), String> {
        let (r, n) = (comm.rank(), comm.size());
        let e = |e: Error| e.to_string();
        let mut a = vec![0i32; 100];
        let mut b = vec![0.0f32; 50_000];
        let mut pa = comm.plan(ferroccl::op::allreduce(&mut a, ReduceOp::Sum)).map_err(e)?;
        let mut pb = comm.plan(ferroccl::op::broadcast(&mut b, 2)).map_err(e)?;
        for k in 0..20 {
            pa.output_mut().fill((r + k) as i32);
            pb.output_mut().fill(if r == 2 { k as f32 } else { -1.0 });
            let mut other = vec![1u64; 7];
            comm.scope(|s| {
                let ra = s.start_plan(&mut pa)?;
                let ro = s.start(ferroccl::op::allreduce(&mut other, ReduceOp::Sum))?;
                let rb = s.start_plan(&mut pb)?;
                rb.wait()?;
                ro.wait()?;
                ra.wait()
            })
            .map_err(e)?;
            let want = (0..n).map(|q| (q + k) as i32).sum::<i32>();
            if pa.output().iter().any(|&x| x != want) || pb.output().iter().any(|&x| x != k as f32) || other != [n as u64; 7] {
                return Err(format!("rank {r}, round {k}: wrong result"));
            }
        }
        if pa.runs() != 20 {
            return Err("runs".into());
        }
        let mut send = vec![0u32; 40];
        let mut recv = vec![0u32; 40];
        let mut po = comm.plan(ferroccl::op::allreduce_into(&mut send, &mut recv, ReduceOp::Sum)).map_err(e)?;
        for k in 0..10u32 {
            po.input_mut().ok_or("input")?.fill(k + r as u32);
            po.run().map_err(e)?;
            let want: u32 = (0..n as u32).map(|q| k + q).sum();
            if po.output().iter().any(|&x| x != want) {
                return Err(format!("allreduce_into plan run {k}"));
            }
        }
        if po.runs() != 10 {
            return Err("runs".into());
        }
        drop((pa, pb, po));
        comm.finalize().map_err(e)
    });
    for r in res {
        assert!(r.is_ok(), "{}", r.unwrap_err());
    }
}

pub fn eight_ranks_on_two_cores_make_progress_without_waiters(s: &Suite) {
    // More ranks than cores, every one with operations in flight that nobody waits for
    // until the end: the engines' threads must share the cores and finish them.
    let res = world(s, 8, |comm| -> Result<(), String> {
        let n = comm.size();
        let mut bufs: Vec<Vec<f32>> = (0..6).map(|k| vec![k as f32; 1 << (6 + 2 * k)]).collect();
        comm.scope(|s| {
            for b in bufs.iter_mut() {
                drop(s.start(ferroccl::op::allreduce(b, ReduceOp::Sum))?);
            }
            Ok(())
        })
        .map_err(|e| e.to_string())?;
        for (k, b) in bufs.iter().enumerate() {
            if b.iter().any(|&x| x != (k * n) as f32) {
                return Err(format!("buffer {k} wrong"));
            }
        }
        comm.finalize().map_err(|e| e.to_string())
    });
    for r in res {
        assert!(r.is_ok(), "{}", r.unwrap_err());
    }
}

/// Not a property of a transport: instantiated once.
pub fn handles_are_send_and_sync() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Communicator>();
    send_sync::<Request<'static>>();
    send_sync::<ferroccl::Scope<'static, 'static>>();
    send_sync::<ferroccl::Plan<'static, f32>>();
    send_sync::<ferroccl::Group<'static, 'static>>();
}

/// Bytes of each low-latency slot in the forced-ll tests (4 KiB: 1024 f32 fit, 1025 do
/// not).
const LL_SLOT: usize = 4096;

/// [`params`] with the low-latency protocol forced for every call that fits slots of
/// [`LL_SLOT`] bytes (only over shm; elsewhere no communicator has slots and nothing
/// changes).
fn ll_params(s: &Suite, rank: usize) -> Params {
    Params { ll: LlChoice::Force, ll_max_bytes: LL_SLOT, ..params(s, rank) }
}

/// Forced ll in groups: several small allreduces of one type and op (fused), others of
/// another op, an allgather and a broadcast that fit the slots and an allreduce that does
/// not, ten rounds with new values; then a group started in a scope next to a non-blocking
/// call. Every result against the reference.
pub fn forced_ll_groups_equal_the_reference(s: &Suite) {
    let res = run_world(
        4,
        |r| ll_params(s, r),
        |comm| -> Result<(), String> {
            let (r, n) = (comm.rank(), comm.size());
            let e = |e: Error| format!("rank {r}: {e}");
            for k in 0..10usize {
                let mut smalls: Vec<Vec<f32>> = (1..6).map(|j| (0..j * 3).map(|i| val(k + j, r, i) as f32).collect()).collect();
                let mut maxes: Vec<Vec<i64>> = (0..2).map(|j| (0..4).map(|i| val(k * 2 + j, r, i)).collect()).collect();
                let send: Vec<u32> = (0..6).map(|i| val(k, r, i) as u32).collect();
                let mut gathered = vec![0u32; 6 * n];
                let mut bc: Vec<u8> = (0..17).map(|i| if r == k % n { (val(k, r, i) + 11) as u8 } else { 0 }).collect();
                let mut big: Vec<f32> = (0..2000).map(|i| val(k, r, i) as f32).collect(); // past the slots
                comm.group(|g| {
                    for v in smalls.iter_mut() {
                        g.add(ferroccl::op::allreduce(v, ReduceOp::Sum))?;
                    }
                    g.add(ferroccl::op::allgather_into(&send, &mut gathered))?;
                    for v in maxes.iter_mut() {
                        g.add(ferroccl::op::allreduce(v, ReduceOp::Max))?;
                    }
                    g.add(ferroccl::op::allreduce(&mut big, ReduceOp::Sum))?;
                    g.add(ferroccl::op::broadcast(&mut bc, k % n))
                })
                .map_err(e)?;
                let sum = |kk: usize, i: usize| (0..n).map(|q| val(kk, q, i)).sum::<i64>();
                for (j, v) in smalls.iter().enumerate() {
                    if v.iter().enumerate().any(|(i, &x)| x != sum(k + j + 1, i) as f32) {
                        return Err(format!("rank {r}, round {k}: fused allreduce {j}: {v:?}"));
                    }
                }
                for (j, v) in maxes.iter().enumerate() {
                    if v.iter().enumerate().any(|(i, &x)| x != (0..n).map(|q| val(k * 2 + j, q, i)).max().unwrap()) {
                        return Err(format!("rank {r}, round {k}: fused max {j}: {v:?}"));
                    }
                }
                if gathered.iter().enumerate().any(|(i, &x)| x != val(k, i / 6, i % 6) as u32) {
                    return Err(format!("rank {r}, round {k}: allgather {gathered:?}"));
                }
                if bc.iter().enumerate().any(|(i, &x)| x != (val(k, k % n, i) + 11) as u8) {
                    return Err(format!("rank {r}, round {k}: broadcast {bc:?}"));
                }
                if big.iter().enumerate().any(|(i, &x)| x != sum(k, i) as f32) {
                    return Err(format!("rank {r}, round {k}: allreduce past the slots"));
                }
            }
            // A group in a scope, next to a non-blocking allreduce (both ll).
            let (mut a, mut b, mut c) = (vec![r as i32; 5], vec![1.0f64; 3], vec![2u32; 4]);
            comm.scope(|sc| {
                let ra = sc.start(ferroccl::op::allreduce(&mut a, ReduceOp::Sum))?;
                let rg = sc.group(|g| {
                    g.add(ferroccl::op::allreduce(&mut b, ReduceOp::Sum))?;
                    g.add(ferroccl::op::allreduce(&mut c, ReduceOp::Sum))
                })?;
                rg.wait()?;
                ra.wait()
            })
            .map_err(e)?;
            let rsum = (0..n as i32).sum::<i32>();
            if a != [rsum; 5] || b != [n as f64; 3] || c != [2 * n as u32; 4] {
                return Err(format!("rank {r}: group in a scope: {a:?} {b:?} {c:?}"));
            }
            comm.finalize().map_err(e)
        },
    );
    for r in res {
        assert!(r.is_ok(), "{:?}: {}", s.wire, r.unwrap_err());
    }
}

/// Forced ll plans (allreduce, allreduce_into, allgather, reduce_scatter, broadcast), run
/// the suite's many times with their buffers rewritten between runs, every fifth round
/// started together in a scope next to a non-blocking allreduce, and next to a plan past
/// the slots (a schedule). Every result against the reference.
pub fn forced_ll_plans_run_many_times_and_in_scopes(s: &Suite) {
    let res = run_world(
        3,
        |r| ll_params(s, r),
        |comm| -> Result<(), String> {
            let (r, n) = (comm.rank(), comm.size());
            let e = |e: Error| format!("rank {r}: {e}");
            let mut ar = vec![0i64; 3];
            let (mut ai, mut ao) = (vec![0.0f32; 64], vec![0.0f32; 64]);
            let (mut ag_send, mut ag_recv) = (vec![0u32; 5], vec![0u32; 5 * n]);
            let (mut rs_send, mut rs_recv) = (vec![0i32; 4 * n], vec![0i32; 4]);
            let mut bc = vec![0u8; 33];
            let mut big = vec![0.0f32; 1500]; // 6000 B: past the slots
            let mut p_ar = comm.plan(ferroccl::op::allreduce(&mut ar, ReduceOp::Sum)).map_err(e)?;
            let mut p_ai = comm.plan(ferroccl::op::allreduce_into(&mut ai, &mut ao, ReduceOp::Max)).map_err(e)?;
            let mut p_ag = comm.plan(ferroccl::op::allgather_into(&mut ag_send, &mut ag_recv)).map_err(e)?;
            let mut p_rs = comm.plan(ferroccl::op::reduce_scatter_into(&mut rs_send, &mut rs_recv, ReduceOp::Sum)).map_err(e)?;
            let mut p_bc = comm.plan(ferroccl::op::broadcast(&mut bc, 1)).map_err(e)?;
            let mut p_big = comm.plan(ferroccl::op::allreduce(&mut big, ReduceOp::Sum)).map_err(e)?;
            let runs = s.plan_runs.max(20);
            for k in 0..runs {
                p_ar.output_mut().copy_from_slice(&[k as i64, r as i64, 1]);
                p_ai.input_mut().ok_or("input")?.iter_mut().enumerate().for_each(|(i, x)| *x = val(k, r, i) as f32);
                p_ag.input_mut().ok_or("input")?.fill((k * 10 + r) as u32);
                p_rs.input_mut().ok_or("input")?.iter_mut().enumerate().for_each(|(i, x)| *x = (i + k) as i32);
                p_bc.output_mut().fill(if r == 1 { k as u8 } else { 0xee });
                p_big.output_mut().iter_mut().enumerate().for_each(|(i, x)| *x = val(k, r, i) as f32);
                let mut other = vec![(k + r) as u64; 7];
                if k % 5 == 0 {
                    comm.scope(|sc| {
                        let ra = sc.start_plan(&mut p_ar)?;
                        let ro = sc.start(ferroccl::op::allreduce(&mut other, ReduceOp::Sum))?;
                        let rb = sc.start_plan(&mut p_big)?;
                        let rai = sc.start_plan(&mut p_ai)?;
                        let rag = sc.start_plan(&mut p_ag)?;
                        let rrs = sc.start_plan(&mut p_rs)?;
                        let rbc = sc.start_plan(&mut p_bc)?;
                        // Waited in another order than started.
                        rbc.wait()?;
                        rb.wait()?;
                        rrs.wait()?;
                        ro.wait()?;
                        rag.wait()?;
                        rai.wait()?;
                        ra.wait()
                    })
                    .map_err(e)?;
                    let want = (0..n).map(|q| (k + q) as u64).sum::<u64>();
                    if other != [want; 7] {
                        return Err(format!("rank {r}, run {k}: non-blocking allreduce beside the plans {other:?}"));
                    }
                } else {
                    p_ar.run().map_err(e)?;
                    p_ai.run().map_err(e)?;
                    p_ag.run().map_err(e)?;
                    if k % 10 == 1 {
                        p_big.run().map_err(e)?;
                    }
                    p_rs.run().map_err(e)?;
                    p_bc.run().map_err(e)?;
                }
                let want = [k as i64 * n as i64, (0..n as i64).sum(), n as i64];
                if p_ar.output() != want {
                    return Err(format!("rank {r}, run {k}: allreduce {:?}, want {want:?}", p_ar.output()));
                }
                if p_ai.output().iter().enumerate().any(|(i, &x)| x != (0..n).map(|q| val(k, q, i)).max().unwrap() as f32) {
                    return Err(format!("rank {r}, run {k}: allreduce_into {:?}", p_ai.output()));
                }
                for q in 0..n {
                    if p_ag.output()[q * 5..q * 5 + 5].iter().any(|&x| x != (k * 10 + q) as u32) {
                        return Err(format!("rank {r}, run {k}: allgather block {q}"));
                    }
                }
                let rs_want: Vec<i32> = (0..4).map(|i| ((r * 4 + i + k) * n) as i32).collect();
                if p_rs.output() != rs_want {
                    return Err(format!("rank {r}, run {k}: reduce_scatter {:?}, want {rs_want:?}", p_rs.output()));
                }
                if p_bc.output().iter().any(|&x| x != k as u8) {
                    return Err(format!("rank {r}, run {k}: broadcast {:?}", p_bc.output()));
                }
                if (k % 5 == 0 || k % 10 == 1)
                    && p_big.output().iter().enumerate().any(|(i, &x)| x != (0..n).map(|q| val(k, q, i)).sum::<i64>() as f32)
                {
                    return Err(format!("rank {r}, run {k}: allreduce past the slots"));
                }
            }
            if p_ar.runs() != runs as u64 || p_bc.runs() != runs as u64 {
                return Err(format!("rank {r}: run counts {} {}", p_ar.runs(), p_bc.runs()));
            }
            drop((p_ar, p_ai, p_ag, p_rs, p_bc, p_big));
            comm.finalize().map_err(e)
        },
    );
    for r in res {
        assert!(r.is_ok(), "{:?}: {}", s.wire, r.unwrap_err());
    }
}

/// Forced ll (over shm the call is a low-latency one, and the error says so): rank 1 never
/// joins rank 0's allreduce; rank 0 aborts from another thread and its call fails with
/// `Aborted` promptly; rank 1 then finds the abort. Two ranks: with more thread-ranks the
/// slots are sometimes not set up at all (see `forced_ll_is_on_in_every_thread_rank_world`).
pub fn abort_unblocks_a_forced_ll_allreduce_whose_peer_never_comes(s: &Suite) {
    let again = |comm: &Communicator| comm.allreduce(&mut [0.0f32; 100], ReduceOp::Sum);
    abort_while_a_peer_never_comes(s, &|r| ll_params(s, r), 100, true, &again);
}
