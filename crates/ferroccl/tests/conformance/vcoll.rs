//! `allgatherv` and `reduce_scatterv` (per-rank counts) against the reference in every
//! runner (blocking, scope, group, plan), random counts with zeros, 1 to 4 ranks, several
//! dtypes and every protocol; and the per-call options of an operation: a timeout of its
//! own, an algorithm, a tag; bad input to the new forms returns its error on every rank
//! involved.

use std::time::Duration;

use ferroccl::{op, Algo, Communicator, Element, Error, Params, ProtoChoice, ReduceOp};
use ferroccl_kernels::bf16;
use proptest::prelude::*;
use proptest::test_runner::Config as ProptestConfig;

use crate::harness::{all_ok, check_cases, run_world, Suite};

/// splitmix64, so that every rank draws the same counts from the case's seed.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Per-rank counts up to `max`, about a third 0.
fn counts(n: usize, seed: u64, max: u64) -> Vec<usize> {
    (0..n).map(|p| mix(seed ^ ((p as u64 + 1) * 0x51))).map(|x| if x % 3 == 0 { 0 } else { ((x >> 8) % (max + 1)) as usize }).collect()
}

/// Small integers every dtype here holds exactly, and whose sums over 4 ranks too.
trait V: Element + Copy + PartialEq + std::fmt::Debug {
    fn v(x: u64) -> Self;
    fn add(a: Self, b: Self) -> Self;
}
impl V for f32 {
    fn v(x: u64) -> Self {
        (x % 9) as f32 - 4.0
    }
    fn add(a: Self, b: Self) -> Self {
        a + b
    }
}
impl V for bf16 {
    fn v(x: u64) -> Self {
        bf16::from_f32((x % 9) as f32 - 4.0)
    }
    fn add(a: Self, b: Self) -> Self {
        bf16::from_f32(a.to_f32() + b.to_f32())
    }
}
impl V for i64 {
    fn v(x: u64) -> Self {
        (x % 2001) as i64 - 1000
    }
    fn add(a: Self, b: Self) -> Self {
        a + b
    }
}
impl V for u8 {
    fn v(x: u64) -> Self {
        (x % 50) as u8
    }
    fn add(a: Self, b: Self) -> Self {
        a.wrapping_add(b)
    }
}

fn data<X: V>(rank: usize, len: usize, seed: u64) -> Vec<X> {
    (0..len).map(|i| X::v(mix(seed ^ ((rank as u64) << 40) ^ i as u64))).collect()
}

/// Displacements of `counts` laid out in order with a gap of `gap` before each block, and
/// the buffer's length.
fn layout(counts: &[usize], gap: usize) -> (Vec<usize>, usize) {
    let mut at = 0;
    let displs = counts
        .iter()
        .map(|c| {
            at += gap;
            let d = at;
            at += c;
            d
        })
        .collect();
    (displs, at + gap)
}

/// allgatherv and reduce_scatterv of one dtype, in each runner, against the reference.
fn check_dtype<X: V>(comm: &Communicator, seed: u64) -> Result<(), String> {
    let (n, r) = (comm.size(), comm.rank());
    let ctx = |what: &str| format!("rank {r}/{n} {what} {}", X::DTYPE);
    let sentinel = X::v(7777);
    // Mostly small blocks; every other case blocks of several chunks.
    let max = if seed.is_multiple_of(2) { 40 } else { 1500 };
    let c = counts(n, seed, max);
    let (displs, len) = layout(&c, (seed % 3) as usize);
    let send = data::<X>(r, c[r], seed);
    let mut want = vec![sentinel; len];
    for p in 0..n {
        want[displs[p]..displs[p] + c[p]].copy_from_slice(&data::<X>(p, c[p], seed));
    }
    // Blocking.
    let mut recv = vec![sentinel; len];
    comm.allgatherv(&send, &mut recv, &c, &displs).map_err(|e| format!("{}: {e}", ctx("allgatherv")))?;
    if recv != want {
        return Err(format!("{}: got {recv:?}, want {want:?}", ctx("allgatherv")));
    }
    // reduce_scatterv: block p of every rank's send, summed, lands on rank p.
    let rc = counts(n, seed ^ 0xBEEF, max);
    let total: usize = rc.iter().sum();
    let start: usize = rc[..r].iter().sum();
    let rs_send = data::<X>(r, total, seed ^ 1);
    let mut rs_want = data::<X>(0, total, seed ^ 1)[start..start + rc[r]].to_vec();
    for p in 1..n {
        let other = data::<X>(p, total, seed ^ 1);
        for (w, o) in rs_want.iter_mut().zip(&other[start..start + rc[r]]) {
            *w = X::add(*w, *o);
        }
    }
    let mut rs = vec![sentinel; rc[r]];
    comm.reduce_scatterv(&rs_send, &mut rs, &rc, ReduceOp::Sum).map_err(|e| format!("{}: {e}", ctx("reduce_scatterv")))?;
    if rs != rs_want {
        return Err(format!("{}: got {rs:?}, want {rs_want:?} (counts {rc:?})", ctx("reduce_scatterv")));
    }
    // Both in a scope, at once.
    let (mut a, mut b) = (vec![sentinel; len], vec![sentinel; rc[r]]);
    comm.scope(|s| {
        let x = s.start(op::allgatherv(&send, &mut a, &c, &displs))?;
        let y = s.start(op::reduce_scatterv(&rs_send, &mut b, &rc, ReduceOp::Sum))?;
        y.wait()?;
        x.wait()
    })
    .map_err(|e| format!("{}: {e}", ctx("scope")))?;
    if a != want || b != rs_want {
        return Err(format!("{}: got {a:?} / {b:?}, want {want:?} / {rs_want:?}", ctx("scope")));
    }
    // Both in one group, next to a fused allreduce.
    let (mut a, mut b, mut sum) = (vec![sentinel; len], vec![sentinel; rc[r]], [1u32; 3]);
    comm.group(|g| {
        g.add(op::allgatherv(&send, &mut a, &c, &displs))?;
        g.add(op::allreduce(&mut sum, ReduceOp::Sum))?;
        g.add(op::reduce_scatterv(&rs_send, &mut b, &rc, ReduceOp::Sum))
    })
    .map_err(|e| format!("{}: {e}", ctx("group")))?;
    if a != want || b != rs_want || sum != [n as u32; 3] {
        return Err(format!("{}: got {a:?} / {b:?} / {sum:?}", ctx("group")));
    }
    // Persistent plans, refilled between runs.
    let mut psend = vec![sentinel; c[r]];
    let mut precv = vec![sentinel; len];
    let mut plan = comm.plan(op::allgatherv(&mut psend, &mut precv, &c, &displs)).map_err(|e| format!("{}: {e}", ctx("plan")))?;
    for run in 0..3u64 {
        plan.input_mut().ok_or("no input")?.copy_from_slice(&data::<X>(r, c[r], seed ^ (run << 20)));
        plan.run().map_err(|e| format!("{}: run {run}: {e}", ctx("allgatherv plan")))?;
        for p in 0..n {
            if plan.output()[displs[p]..displs[p] + c[p]] != data::<X>(p, c[p], seed ^ (run << 20))[..] {
                return Err(format!("{}: run {run}: block {p} wrong", ctx("allgatherv plan")));
            }
        }
    }
    drop(plan);
    let mut psend = rs_send.clone();
    let mut precv = vec![sentinel; rc[r]];
    let mut plan =
        comm.plan(op::reduce_scatterv(&mut psend, &mut precv, &rc, ReduceOp::Sum)).map_err(|e| format!("{}: {e}", ctx("plan")))?;
    for run in 0..3 {
        plan.run().map_err(|e| format!("{}: run {run}: {e}", ctx("reduce_scatterv plan")))?;
        if plan.output() != &rs_want[..] {
            return Err(format!("{}: run {run}: got {:?}, want {rs_want:?}", ctx("reduce_scatterv plan"), plan.output()));
        }
    }
    Ok(())
}

fn params(s: &Suite, proto: ProtoChoice, rank: usize) -> Params {
    // Eager up to 256 bytes, chunks of 4 KiB (the smallest): counts up to 1,500 take both
    // protocols and several chunks.
    Params { timeout: Duration::from_secs(60), proto, eager_max: 256, chunk_bytes: 4096, shm_ring_bytes: 1 << 16, ..s.params(rank) }
}

/// Random counts (zeros included) and layouts on 1 to 4 ranks, four dtypes, every
/// protocol, every runner: equal to the reference.
pub fn allgatherv_and_reduce_scatterv_equal_the_reference(s: &Suite) {
    let protos = prop_oneof![Just(ProtoChoice::Auto), Just(ProtoChoice::Eager), Just(ProtoChoice::Rendezvous)];
    let config = ProptestConfig { cases: s.nonblocking_cases, ..ProptestConfig::default() };
    check_cases(config, (1usize..=4, any::<u64>(), protos), |(n, seed, proto)| {
        let res = run_world(
            n,
            |r| params(s, proto, r),
            |comm| {
                check_dtype::<f32>(&comm, seed)?;
                check_dtype::<bf16>(&comm, seed ^ 2)?;
                check_dtype::<i64>(&comm, seed ^ 3)?;
                check_dtype::<u8>(&comm, seed ^ 4)?;
                comm.finalize().map_err(|e| e.to_string())
            },
        );
        all_ok(res).map(|_| ()).map_err(|e| format!("{:?} {n} ranks {proto:?}: {e}", s.wire))
    });
}

/// What one rank's call ended with, as the test compares it.
fn outcome(r: ferroccl::Result<()>) -> String {
    match r {
        Ok(()) => "ok".into(),
        Err(e @ Error::InvalidArgument(_)) => format!("invalid: {e}"),
        Err(e @ Error::Mismatch { .. }) => format!("mismatch: {e}"),
        Err(e @ Error::Timeout { .. }) => format!("timeout: {e}"),
        Err(e) => format!("other: {e}"),
    }
}

/// Bad input to the new forms: refused before anything is sent (a timeout of zero, an
/// algorithm that does not implement the call, on every rank, the communicator usable
/// after), or found on the wire and relayed to every member (an algorithm that differs
/// between ranks, allgatherv counts that disagree with the sender's length,
/// reduce_scatterv counts that differ between ranks; a rank whose part was done learns of
/// it at its next call): never a hang, never a silent result.
pub fn bad_operations_fail_on_every_rank(s: &Suite) {
    let quick = |r| Params { timeout: Duration::from_secs(30), ..s.params(r) };
    // Refused at once, every rank alike, and the communicator stays usable.
    let res = run_world(2, quick, |comm| {
        let mut b = [1f32; 8];
        let zero = outcome(comm.run(op::allreduce(&mut b, ReduceOp::Sum).timeout(Duration::ZERO)));
        let chain = outcome(comm.run(op::allreduce(&mut b, ReduceOp::Sum).algo(Algo::Chain)));
        let mut g = [0u8; 4];
        let ring = outcome(comm.run(op::gather(&[1u8, 2], &mut g, 0).algo(Algo::Ring)));
        let mut out = [0f32; 8];
        let reduce_plan = outcome(comm.plan(op::reduce_into(&[1f32; 8], &mut out, ReduceOp::Sum, 0)).map(drop));
        comm.allreduce(&mut b, ReduceOp::Sum).map_err(|e| format!("rank {}: after the refusals: {e}", comm.rank()))?;
        Ok((zero, chain, ring, reduce_plan, b))
    });
    for (r, (zero, chain, ring, reduce_plan, b)) in all_ok(res).unwrap().into_iter().enumerate() {
        assert!(reduce_plan.starts_with("invalid") && reduce_plan.contains("reduce_into"), "rank {r}: {reduce_plan}");
        assert!(zero.starts_with("invalid") && zero.contains("timeout of zero"), "rank {r}: {zero}");
        assert!(chain.starts_with("invalid") && chain.contains("chain"), "rank {r}: {chain}");
        assert!(ring.starts_with("invalid") && ring.contains("ring"), "rank {r}: {ring}");
        assert_eq!(b, [2f32; 8], "rank {r}");
    }
    // Options that must agree, and counts, that differ between ranks: a mismatch on every
    // rank. Each case in a world of its own (a mismatch is fatal for the communicator).
    type Case = fn(&Communicator) -> ferroccl::Result<()>;
    let cases: [(&str, Case); 3] = [
        ("algorithms differ", |c| {
            let mut b = vec![1f32; 1 << 12];
            let a = if c.rank() == 0 { Algo::Ring } else { Algo::Mesh };
            c.run(op::allreduce(&mut b, ReduceOp::Sum).algo(a).tag("grads"))
        }),
        ("allgatherv counts disagree with the sender", |c| {
            // Every rank sends 3 elements, but rank 0 expects 2 from rank 1.
            let counts = if c.rank() == 0 { [3, 2] } else { [3, 3] };
            let displs = [0, 3];
            let mut recv = [0u32; 6];
            c.allgatherv(&[c.rank() as u32; 3], &mut recv, &counts, &displs)
        }),
        ("reduce_scatterv counts differ between ranks", |c| {
            let counts = if c.rank() == 0 { [2, 2] } else { [3, 1] };
            let mut recv = vec![0f32; counts[c.rank()]];
            c.reduce_scatterv(&[1f32; 4], &mut recv, &counts, ReduceOp::Sum)
        }),
    ];
    for (what, case) in cases {
        // A rank whose part of the call was done when the mismatch was found (its eager
        // message had left) learns of it at its next call.
        let res = run_world(2, quick, |comm| {
            Ok(match case(&comm) {
                Ok(()) => outcome(comm.barrier()),
                e => outcome(e),
            })
        });
        for (r, got) in all_ok(res).unwrap().into_iter().enumerate() {
            assert!(got.starts_with("mismatch"), "{:?}: {what}: rank {r}: {got}", s.wire);
            if what == "algorithms differ" {
                assert!(got.contains("[grads]"), "{what}: rank {r}: the tag is not in the error: {got}");
            }
        }
    }
}

/// A call's own timeout overrides the communicator's: a rank whose peer never joins gives
/// up after its limit (the error says how long it waited), while `FERROCCL_TIMEOUT` is a
/// minute; the tag names the call in the error.
pub fn a_per_call_timeout_overrides_the_communicators(s: &Suite) {
    let res = run_world(
        2,
        |r| Params { timeout: Duration::from_secs(60), ..s.params(r) },
        |comm| {
            if comm.rank() == 1 {
                // Never joins the call; learns of rank 0's failure at its next one.
                std::thread::sleep(Duration::from_millis(1500));
                return Ok(outcome(comm.barrier()));
            }
            let mut b = vec![1f32; 1 << 12];
            Ok(match comm.run(op::allreduce(&mut b, ReduceOp::Sum).timeout(Duration::from_millis(300)).tag("step 7")) {
                Err(Error::Timeout { after, op, .. }) if after < Duration::from_secs(30) => format!("timeout after {after:?}: {op}"),
                other => outcome(other),
            })
        },
    );
    let got = all_ok(res).unwrap();
    assert!(got[0].starts_with("timeout after") && got[0].contains("[step 7]"), "rank 0: {}", got[0]);
    assert_ne!(got[1], "ok", "rank 1 never learnt of rank 0's failure");
}
