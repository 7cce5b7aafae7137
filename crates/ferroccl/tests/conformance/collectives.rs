//! Collectives against the CPU reference, over one instantiation's transport (tests/mesh.rs
//! runs them as real processes). Each proptest case builds one world (a rank count, an
//! algorithm override, a protocol, a chunk size) and runs every collective x dtype x op x
//! in-place combination in it; every rank checks its result against the reference and
//! that all ranks hold the same bits.
//!
//! Values: "exact" inputs (small integers, powers of two) make every algorithm's result
//! exactly the reference, whatever its reduction order, so ring is checked bit for bit too;
//! random floats check that mesh and oneshot (rank-order reduction with f32 accumulation)
//! are bit-equal to the reference, and ring within its bound.

use std::time::Duration;

use ferroccl::{Algo, Communicator, Element, LlChoice, Params, ProtoChoice, ReduceOp};
use ferroccl_kernels::{bf16, f16, reduce_many};
use proptest::prelude::*;
use proptest::test_runner::Config as ProptestConfig;

use crate::harness::{all_ok, check_cases, run_world, Suite, Wire};

trait T: Element + Copy {
    /// An exactly representable value from a small integer (and powers of two for prod).
    fn exact(i: i64, prod: bool) -> Self;
    fn random(bits: u64) -> Self;
    fn same(a: &[Self], b: &[Self]) -> bool;
}

macro_rules! float_t {
    ($t:ty, $from:expr, $bits:expr) => {
        impl T for $t {
            fn exact(i: i64, prod: bool) -> Self {
                let v = if prod { [0.5, 1.0, 2.0, -1.0, -2.0][(i.rem_euclid(5)) as usize] } else { (i.rem_euclid(17) - 8) as f64 };
                $from(v)
            }
            fn random(bits: u64) -> Self {
                // Mostly ordinary values of mixed magnitude, sometimes specials.
                let x = (bits >> 11) as f64 / (1u64 << 53) as f64 * 200.0 - 100.0;
                let v = match bits % 97 {
                    0 => f64::NAN,
                    1 => f64::INFINITY,
                    2 => -0.0,
                    _ => x,
                };
                $from(v)
            }
            fn same(a: &[Self], b: &[Self]) -> bool {
                a.len() == b.len() && a.iter().zip(b).all(|(x, y)| $bits(*x) == $bits(*y) || (x != x && y != y))
            }
        }
    };
}
float_t!(f32, |v: f64| v as f32, |x: f32| x.to_bits() as u64);
float_t!(f64, |v: f64| v, |x: f64| x.to_bits());
float_t!(f16, f16::from_f64, |x: f16| x.to_bits() as u64);
float_t!(bf16, bf16::from_f64, |x: bf16| x.to_bits() as u64);

macro_rules! int_t {
    ($t:ty) => {
        impl T for $t {
            fn exact(i: i64, _prod: bool) -> Self {
                (i.wrapping_mul(2654435761) as u64 >> 7) as $t
            }
            fn random(bits: u64) -> Self {
                bits as $t
            }
            fn same(a: &[Self], b: &[Self]) -> bool {
                a == b
            }
        }
    };
}
int_t!(i32);
int_t!(u8);
int_t!(i64);
int_t!(u32);
int_t!(i8);
int_t!(u64);

const OPS: [ReduceOp; 5] = [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max, ReduceOp::Avg];

fn input<X: T>(rank: usize, len: usize, seed: u64, exact: bool, prod: bool) -> Vec<X> {
    (0..len)
        .map(|i| {
            let k = seed.wrapping_mul(6364136223846793005).wrapping_add((rank as u64) << 32 | i as u64);
            let mut z = k ^ (k >> 29);
            z = z.wrapping_mul(0xbf58476d1ce4e5b9);
            z ^= z >> 32;
            if exact {
                X::exact(z as i64 >> 3, prod)
            } else {
                X::random(z)
            }
        })
        .collect()
}

fn reference<X: T>(op: ReduceOp, ins: &[Vec<X>]) -> Vec<X> {
    let mut out = ins[0].clone();
    let srcs: Vec<&[X]> = ins.iter().map(|v| v.as_slice()).collect();
    reduce_many(op, &srcs, &mut out);
    out
}

/// Runs every collective once on `comm` with `count` elements of `X` and op `op`, checking
/// each against the reference. Returns the concatenated results (for the cross-rank check).
fn check_all<X: T>(comm: &Communicator, count: usize, op: ReduceOp, seed: u64, exact: bool) -> Result<Vec<X>, String> {
    let (n, r) = (comm.size(), comm.rank());
    let prod = op == ReduceOp::Prod;
    let ins: Vec<Vec<X>> = (0..n).map(|k| input(k, count, seed, exact, prod)).collect();
    let wide: Vec<Vec<X>> = (0..n).map(|k| input(k, count * n, seed ^ 0x55, exact, prod)).collect();
    let red = reference(op, &ins);
    let red_wide = reference(op, &wide);
    let ctx = |what: &str| format!("rank {r}/{n} {what} count {count} {} {op}", X::DTYPE);
    let mut all = Vec::new();
    let mut expect = |what: &str, got: &[X], want: &[X]| -> Result<(), String> {
        if X::same(got, want) {
            all.extend_from_slice(got);
            Ok(())
        } else {
            let i = got.iter().zip(want).position(|(a, b)| !X::same(&[*a], &[*b])).unwrap_or(0);
            Err(format!("{}: element {i}: got {:?}, want {:?}", ctx(what), got.get(i), want.get(i)))
        }
    };
    let e = |what: &str| {
        let c = ctx(what);
        move |err: ferroccl::Error| format!("{c}: {err}")
    };

    // allreduce, out of place and in place
    let mut out = vec![X::exact(0, false); count];
    comm.allreduce_into(&ins[r], &mut out, op).map_err(e("allreduce_into"))?;
    expect("allreduce_into", &out, &red)?;
    let mut buf = ins[r].clone();
    comm.allreduce(&mut buf, op).map_err(e("allreduce"))?;
    expect("allreduce", &buf, &red)?;

    // allgather
    let cat: Vec<X> = ins.iter().flatten().copied().collect();
    let mut out = vec![X::exact(0, false); count * n];
    comm.allgather_into(&ins[r], &mut out).map_err(e("allgather"))?;
    expect("allgather", &out, &cat)?;
    let mut buf = vec![X::exact(1, false); count * n];
    buf[r * count..(r + 1) * count].copy_from_slice(&ins[r]);
    comm.allgather(&mut buf).map_err(e("allgather_in_place"))?;
    expect("allgather_in_place", &buf, &cat)?;

    // reduce_scatter
    let mut out = vec![X::exact(0, false); count];
    comm.reduce_scatter_into(&wide[r], &mut out, op).map_err(e("reduce_scatter"))?;
    expect("reduce_scatter", &out, &red_wide[r * count..(r + 1) * count])?;
    let mut buf = wide[r].clone();
    comm.reduce_scatter(&mut buf, op).map_err(e("reduce_scatter_in_place"))?;
    expect("reduce_scatter_in_place", &buf[r * count..(r + 1) * count], &red_wide[r * count..(r + 1) * count])?;

    // broadcast and reduce from every root
    for root in 0..n {
        let mut buf = if r == root { ins[root].clone() } else { vec![X::exact(3, false); count] };
        comm.broadcast(&mut buf, root).map_err(e(&format!("broadcast root {root}")))?;
        expect("broadcast", &buf, &ins[root])?;
        let mut out = vec![X::exact(0, false); if r == root { count } else { 0 }];
        comm.reduce_into(&ins[r], &mut out, op, root).map_err(e(&format!("reduce root {root}")))?;
        if r == root {
            expect("reduce", &out, &red)?;
        }
        let mut buf = ins[r].clone();
        comm.reduce(&mut buf, op, root).map_err(e(&format!("reduce_in_place root {root}")))?;
        expect("reduce_in_place", &buf, if r == root { &red } else { &ins[r] })?;
    }

    // alltoall
    let want: Vec<X> = (0..n).flat_map(|k| wide[k][r * count..(r + 1) * count].to_vec()).collect();
    let mut out = vec![X::exact(0, false); count * n];
    comm.alltoall(&wide[r], &mut out).map_err(e("alltoall"))?;
    expect("alltoall", &out, &want)?;
    Ok(all)
}

fn params(s: &Suite, algo: Option<Algo>, proto: ProtoChoice, chunk: usize, rank: usize) -> Params {
    let mut p = Params { timeout: Duration::from_secs(60), proto, chunk_bytes: chunk, ..s.params(rank) };
    p.algo = algo;
    p.shm_ring_bytes = 1 << 16;
    p
}

/// One world: every collective, every dtype, every op.
#[allow(clippy::too_many_arguments)]
fn run_case(
    s: &Suite,
    n: usize,
    algo: Option<Algo>,
    proto: ProtoChoice,
    chunk: usize,
    counts: &[usize],
    seed: u64,
    exact: bool,
) -> Result<(), String> {
    run_case_with(n, |r| params(s, algo, proto, chunk, r), |_| counts.to_vec(), seed, exact)
}

/// [`run_case`] with any parameters, and counts that depend on the element size (the
/// argument of `counts`, in bytes).
fn run_case_with(
    n: usize,
    params: impl Fn(usize) -> Params + Sync,
    counts: impl Fn(usize) -> Vec<usize> + Sync,
    seed: u64,
    exact: bool,
) -> Result<(), String> {
    let results = run_world(n, params, |comm| -> Result<Vec<Vec<u8>>, String> {
        let mut outs = Vec::new();
        for op in OPS {
            macro_rules! each {
                ($($t:ty),*) => {$(
                    for count in counts(std::mem::size_of::<$t>()) {
                        let v = check_all::<$t>(&comm, count, op, seed ^ count as u64, exact)?;
                        outs.push(ferroccl_kernels::as_bytes(&v).to_vec());
                    }
                )*};
            }
            each!(f32, f16, bf16, f64, i32, u8, i64, u32, i8, u64);
        }
        comm.finalize().map_err(|e| e.to_string())?;
        Ok(outs)
    });
    let mut first: Option<Vec<Vec<u8>>> = None;
    for (r, res) in results.into_iter().enumerate() {
        let outs = res?;
        // Everyone's allreduce/allgather/broadcast/alltoall differ by rank only where the
        // collective says so; the results of allreduce are first in each record and must be
        // identical: compare whole records of ranks for the symmetric collectives via the
        // per-rank checks above (each rank already equals the reference bit for bit).
        if let Some(f) = &first {
            assert_eq!(f.len(), outs.len(), "rank {r} ran a different number of calls");
        } else {
            first = Some(outs);
        }
    }
    Ok(())
}

/// Exact values: every algorithm (forced or chosen) equals the reference bit for bit.
pub fn collectives_equal_the_reference_exact_values(s: &Suite) {
    let case = (
        1usize..=s.collective_ranks,
        prop::sample::select(vec![
            None,
            Some(Algo::Ring),
            Some(Algo::Mesh),
            Some(Algo::OneShot),
            Some(Algo::Chain),
            Some(Algo::Ll),
            Some(Algo::Bruck),
            Some(Algo::Binomial),
        ]),
        prop::sample::select(vec![ProtoChoice::Auto, ProtoChoice::Eager, ProtoChoice::Rendezvous]),
        12u32..=17,
        prop::sample::select(vec![0usize, 1, 2, 3, 5, 17, 100, 1023, 4099]),
        any::<u64>(),
    );
    let config = ProptestConfig { cases: s.collective_cases, ..ProptestConfig::default() };
    check_cases(config, case, |(n, algo, proto, chunk_log, count, seed)| {
        let counts = [count, (count * 7 + 1) % 5000];
        run_case(s, n, algo, proto, 1 << chunk_log, &counts, seed, true)
    });
}

/// Bruck (allreduce, allgather) and the binomial tree (broadcast) forced on every rank
/// count up to the suite's, with chunks small enough that the larger counts take several:
/// every collective equals the reference (the others keep the cost model's choice).
pub fn bruck_and_the_binomial_tree_equal_the_reference(s: &Suite) {
    for algo in [Algo::Bruck, Algo::Binomial] {
        for n in 1..=s.collective_ranks {
            run_case(s, n, Some(algo), ProtoChoice::Auto, 1 << 12, &[0, 1, 5, 1023, 4099], 7 + n as u64, true)
                .unwrap_or_else(|e| panic!("{algo} on {n} ranks: {e}"));
        }
    }
}

/// The case that proptest once shrank a failure of the test above to (it was saved, over
/// shm, in `collectives.proptest-regressions`): three ranks, counts 0 and 1, the cost
/// model's choice, 4 KiB chunks.
pub fn collectives_equal_the_reference_three_ranks_counts_0_and_1(s: &Suite) {
    run_case(s, 3, None, ProtoChoice::Auto, 1 << 12, &[0, 1], 0, true).unwrap();
}

/// Random floats (specials included): mesh, oneshot, Bruck (allreduce and allgather), the
/// binomial tree (broadcast) and the low-latency protocol (where the wire has it: shm) are bit-equal to the rank-order
/// reference; auto (whatever it picks) is checked through the same path with exact values
/// above.
pub fn mesh_and_oneshot_are_bit_equal_to_the_reference_on_random_floats(s: &Suite) {
    for algo in [Algo::Mesh, Algo::OneShot, Algo::Bruck, Algo::Binomial, Algo::Ll] {
        for &n in s.float_ranks {
            run_case(s, n, Some(algo), ProtoChoice::Auto, 1 << 14, &[1, 33, 3000], 99 + n as u64, false)
                .unwrap_or_else(|e| panic!("{algo}: {e}"));
        }
    }
}

/// Local reductions and copies on several threads (`FERROCCL_REDUCE_THREADS=3`, every step
/// from 4 KiB up on the pool): every collective, dtype and op, bit-equal to the reference:
/// the mesh (which reduces in rank order) on random floats, specials included; the ring
/// (its own order) on exact values. The pool is the same whatever carries the bytes: not
/// run again in the emulated verbs VM.
pub fn reductions_on_several_threads_equal_the_reference(s: &Suite) {
    if s.wire == Wire::Verbs {
        return;
    }
    for (algo, exact) in [(Algo::Mesh, false), (Algo::Ring, true)] {
        let p = |r| Params { reduce_threads: Some(3), reduce_par_min: 4096, ..params(s, Some(algo), ProtoChoice::Auto, 1 << 16, r) };
        run_case_with(3, p, |_| vec![3000, 40_000], 17, exact).unwrap_or_else(|e| panic!("{algo}: {e}"));
    }
}

/// Large buffers through the pipeline: many chunks, rendezvous.
pub fn large_allreduce_through_the_pipeline(s: &Suite) {
    for algo in [Algo::Ring, Algo::Mesh] {
        let res = run_world(
            4,
            |r| params(s, Some(algo), ProtoChoice::Auto, 1 << 16, r),
            |comm| -> Result<(), String> {
                let count = s.large_count;
                let ins: Vec<Vec<f32>> = (0..4).map(|k| input(k, count, 5, true, false)).collect();
                let want = reference(ReduceOp::Sum, &ins);
                let mut buf = ins[comm.rank()].clone();
                comm.allreduce(&mut buf, ReduceOp::Sum).map_err(|e| e.to_string())?;
                if !f32::same(&buf, &want) {
                    return Err(format!("{:?} {algo}: rank {} differs", s.wire, comm.rank()));
                }
                comm.finalize().map_err(|e| e.to_string())
            },
        );
        for r in res {
            r.unwrap();
        }
    }
}

/// Bad input: an error that names the problem, and the communicator still works.
pub fn bad_arguments_are_errors_not_panics(s: &Suite) {
    let res = run_world(
        3,
        |r| params(s, None, ProtoChoice::Auto, 1 << 19, r),
        |comm| -> Result<(), String> {
            let mut a = vec![0f32; 10];
            let msgs = [
                comm.allreduce_into(&[1f32; 9], &mut a, ReduceOp::Sum).unwrap_err().to_string(),
                comm.allgather_into(&[1f32; 4], &mut a).unwrap_err().to_string(),
                comm.reduce_scatter_into(&[1f32; 10], &mut a[..4], ReduceOp::Sum).unwrap_err().to_string(),
                comm.broadcast(&mut a, 3).unwrap_err().to_string(),
                comm.reduce_into(&[1f32; 10], &mut a, ReduceOp::Max, 7).unwrap_err().to_string(),
                comm.alltoall(&[1f32; 10], &mut a).unwrap_err().to_string(),
                comm.allgather(&mut a).unwrap_err().to_string(),
            ];
            for (m, want) in
                msgs.iter().zip(["expected 9", "expected 12", "expected 12", "root 3", "root 7", "3 equal blocks", "3 equal blocks"])
            {
                if !m.contains(want) {
                    return Err(format!("error {m:?} does not say {want:?}"));
                }
            }
            // Still usable.
            let mut b = vec![comm.rank() as i32; 6];
            comm.allreduce(&mut b, ReduceOp::Sum).map_err(|e| e.to_string())?;
            if b != vec![3; 6] {
                return Err(format!("{b:?}"));
            }
            comm.finalize().map_err(|e| e.to_string())
        },
    );
    for r in res {
        r.unwrap();
    }
}

/// Ranks that call different collectives (or the same with other arguments) fail with an
/// error that shows both calls, instead of exchanging garbage or hanging.
pub fn mismatched_calls_fail_on_every_rank(s: &Suite) {
    let res = run_world(
        2,
        |r| params(s, Some(Algo::Mesh), ProtoChoice::Auto, 1 << 19, r),
        |comm| {
            let mut b = vec![1f32; 64];
            let r = if comm.rank() == 0 { comm.allreduce(&mut b, ReduceOp::Sum) } else { comm.allreduce(&mut b, ReduceOp::Max) };
            Ok(r.map(|()| "no error".to_string()).unwrap_or_else(|e| e.to_string()))
        },
    );
    for (r, msg) in all_ok(res).unwrap().iter().enumerate() {
        assert!(msg.contains("sum") && msg.contains("max"), "rank {r}: {msg}");
    }
}

/// Bytes of each low-latency slot in the forced-ll tests: small, so that the boundary
/// (the largest call that fits, and the one just past it) is cheap to reach.
const LL_SLOT: usize = 4096;

/// The parameters of the forced-ll tests: the low-latency protocol `ll` with slots of
/// `slot` bytes, the defaults otherwise (the cost model picks what runs past the slots).
fn ll_params(s: &Suite, ll: LlChoice, slot: usize, rank: usize) -> Params {
    Params { ll, ll_max_bytes: slot, ..params(s, None, ProtoChoice::Auto, 1 << 14, rank) }
}

/// The world sizes of the forced-ll tests: 1 to 8 ranks (or the suite's largest) on shm;
/// elsewhere the protocol is never used (no communicator is on one host over shm), and
/// forcing it must change nothing, which a few sizes show.
fn ll_ranks(s: &Suite) -> std::ops::RangeInclusive<usize> {
    if s.wire == Wire::Shm {
        1..=s.collective_ranks.max(8)
    } else {
        1..=s.collective_ranks.min(3)
    }
}

/// Counts for `n` ranks and elements of `size` bytes with slots of `slot` bytes: 0, 1,
/// odd sizes, the largest call that fits the slots and the one just past it (which runs
/// a schedule), for allreduce, allgather, broadcast and reduce (the message) and for
/// reduce_scatter and alltoall (ranks x the block).
fn ll_counts(n: usize, size: usize, slot: usize) -> Vec<usize> {
    let (msg, block) = (slot / size, slot / (n * size));
    let mut c = vec![0, 1, 3, 17, msg, msg + 1, block, block + 1];
    c.sort_unstable();
    c.dedup();
    c
}

/// The low-latency protocol forced (`LlChoice::Force`): every collective x dtype x op, in
/// place and out of place, for 1 to 8 ranks, counts 0, 1, odd, the largest that fits the
/// slots and one past it (the schedules), all bit for bit equal to the reference.
pub fn forced_ll_collectives_equal_the_reference_up_to_and_past_the_slots(s: &Suite) {
    for n in ll_ranks(s) {
        run_case_with(n, |r| ll_params(s, LlChoice::Force, LL_SLOT, r), |size| ll_counts(n, size, LL_SLOT), 0x11 + n as u64, true)
            .unwrap_or_else(|e| panic!("{:?}, {n} ranks, ll forced, slots of {LL_SLOT} B: {e}", s.wire));
    }
}

/// Random floats (specials included) through forced ll, only counts that fit the slots:
/// bit-equal to the rank-order reference (f16/bf16 included).
pub fn forced_ll_is_bit_equal_to_the_reference_on_random_floats(s: &Suite) {
    for n in ll_ranks(s).step_by(3) {
        // Every collective fits: the block of reduce_scatter and alltoall too.
        let counts = |size: usize| {
            let most = LL_SLOT / (n * size);
            vec![1, 5, most]
        };
        run_case_with(n, |r| ll_params(s, LlChoice::Force, LL_SLOT, r), counts, 0x77 + n as u64, false)
            .unwrap_or_else(|e| panic!("{:?}, {n} ranks, ll forced, random floats: {e}", s.wire));
    }
}

/// `split` into two colors (ranks in reverse order inside each): each sub-communicator
/// gets its own slots and runs forced-ll collectives, interleaved with the world's,
/// each against the reference. Under [`Wire::Mixed`] the colors are the hosts, so the
/// sub-communicators (one host, shm) have the protocol while the world (two hosts) has not.
pub fn forced_ll_on_split_communicators_next_to_the_world(s: &Suite) {
    let n = if s.wire == Wire::Shm { 6 } else { 4 };
    let res = run_world(
        n,
        |r| ll_params(s, LlChoice::Force, LL_SLOT, r),
        |comm| -> Result<(), String> {
            let r = comm.rank();
            let sub = comm
                .split(Some((r % 2) as u32), -(r as i64))
                .map_err(|e| format!("rank {r}: split: {e}"))?
                .ok_or_else(|| format!("rank {r}: split left it out"))?;
            let want_rank = (n - 1 - r) / 2;
            if sub.rank() != want_rank || sub.size() != n / 2 {
                return Err(format!("rank {r}: sub-communicator rank {} of {}, want {want_rank}", sub.rank(), sub.size()));
            }
            for round in 0..4u64 {
                let op = OPS[round as usize % OPS.len()];
                let count = [1, 7, 300, 1023][round as usize];
                check_all::<f32>(&sub, count, op, round, true).map_err(|e| format!("sub: {e}"))?;
                check_all::<i32>(&comm, count, op, round ^ 0xff, true).map_err(|e| format!("world: {e}"))?;
                check_all::<bf16>(&sub, count / 3, op, round ^ 0xf0, true).map_err(|e| format!("sub: {e}"))?;
                sub.barrier().map_err(|e| format!("rank {r}: sub barrier: {e}"))?;
                comm.barrier().map_err(|e| format!("rank {r}: world barrier: {e}"))?;
            }
            // Both at once: a non-blocking call on the sub-communicator while the world
            // runs a blocking one.
            let mut a = vec![r as u64; 9];
            let mut b = vec![1i8; 5];
            sub.scope(|sc| {
                let req = sc.start(ferroccl::op::allreduce(&mut a, ReduceOp::Sum))?;
                comm.allreduce(&mut b, ReduceOp::Sum)?;
                req.wait()
            })
            .map_err(|e| format!("rank {r}: scope: {e}"))?;
            let want: u64 = (0..n as u64).filter(|q| q % 2 == r as u64 % 2).sum();
            if a != [want; 9] || b != [n as i8; 5] {
                return Err(format!("rank {r}: sub {a:?} (want {want}), world {b:?}"));
            }
            sub.finalize().map_err(|e| format!("rank {r}: sub finalize: {e}"))?;
            comm.finalize().map_err(|e| format!("rank {r}: finalize: {e}"))
        },
    );
    all_ok(res).unwrap_or_else(|e| panic!("{:?}: {e}", s.wire));
}

/// Forced ll, ranks in different calls: an allreduce against an allgather (both small
/// enough for the slots) fails on both ranks with a mismatch naming both calls; and a
/// 4-element allreduce against a 1,000,000-element one (the slots against a schedule)
/// fails both promptly (a probe after 50 ms), far before the 60 s deadline. Over shm the
/// error names the low-latency call.
pub fn forced_ll_mismatched_calls_fail_on_every_rank(s: &Suite) {
    for case in ["allreduce vs allgather", "4 vs 1000000"] {
        let t0 = std::time::Instant::now();
        let res = run_world(
            2,
            |r| ll_params(s, LlChoice::Force, 256 << 10, r),
            |comm| -> Result<(ferroccl::Error, Duration), String> {
                let r = comm.rank();
                let t = std::time::Instant::now();
                let mut b = vec![r as f32 + 1.0; if case.starts_with('4') && r == 1 { 1_000_000 } else { 4 }];
                let res = match (case, r) {
                    ("allreduce vs allgather", 1) => comm.allgather_into(&b.clone(), &mut [0f32; 8]),
                    _ => comm.allreduce(&mut b, ReduceOp::Sum),
                };
                match res {
                    Err(e) => Ok((e, t.elapsed())),
                    Ok(()) => Err(format!("rank {r}: {case}: no error")),
                }
            },
        );
        for (r, (e, took)) in all_ok(res).unwrap_or_else(|e| panic!("{case}: {e}")).into_iter().enumerate() {
            let msg = e.to_string();
            assert!(matches!(e, ferroccl::Error::Mismatch { .. }), "{case}: rank {r}: not a mismatch: {msg}");
            let names: &[&str] = if case.starts_with('4') { &["count 4,", "count 1000000"] } else { &["allreduce", "allgather"] };
            for name in names {
                assert!(msg.contains(name), "{case}: rank {r}'s error does not name {name:?}: {msg}");
            }
            if s.wire == Wire::Shm && (r == 0 || !case.starts_with('4')) {
                assert!(msg.contains(", ll)"), "{case}: rank {r} was not in a low-latency call: {msg}");
            }
            if s.clocks {
                assert!(took < Duration::from_secs(5), "{case}: rank {r} took {took:?}: {msg}");
            }
        }
        eprintln!("{:?} {case}: both ranks failed within {:?}", s.wire, t0.elapsed());
    }
}

/// Every member of every thread-rank world over shm has its low-latency slots: with the
/// protocol forced, a small allreduce is a low-latency call on every rank, for 2 to 8
/// ranks, eight worlds each. The only way a caller sees it: rank 0 calls that allreduce
/// while the others call an allgather, and each rank's mismatch names the algorithm of its
/// own call. (The other forced-ll tests pass whether or not the slots were set up: a
/// communicator without them runs the schedules, with the same results.)
///
/// Over tcp and mixed no world is on one host over shm: nothing to check.
pub fn forced_ll_is_on_in_every_thread_rank_world(s: &Suite) {
    if s.wire != Wire::Shm {
        return;
    }
    let mut off = Vec::new();
    for n in 2..=8 {
        for world in 0..8 {
            let res = run_world(
                n,
                |r| ll_params(s, LlChoice::Force, LL_SLOT, r),
                |comm| -> Result<Algo, String> {
                    let r = comm.rank();
                    // Every rank through its init first (a mismatch found early would fail
                    // a slow rank's init instead).
                    comm.barrier().map_err(|e| format!("rank {r}: barrier: {e}"))?;
                    let res = if r == 0 {
                        comm.allreduce(&mut [1f32; 4], ReduceOp::Sum)
                    } else {
                        comm.allgather_into(&[1f32], &mut vec![0f32; n])
                    };
                    match res {
                        Err(ferroccl::Error::Mismatch { op: ferroccl::Op::Collective { algo, .. }, .. }) => Ok(algo),
                        other => Err(format!("rank {r}: {other:?}")),
                    }
                },
            );
            // Where the slots are missing the barrier is a schedule, and a rank still in it
            // when rank 0 finds the mismatch fails there: only the calls' algorithms count.
            let algos: Vec<String> = res.iter().flatten().map(|a| a.to_string()).collect();
            let errs: Vec<&String> = res.iter().filter_map(|r| r.as_ref().err()).collect();
            if algos.iter().any(|a| a != "ll") || !errs.is_empty() {
                let first = errs.first().map_or(String::new(), |e| format!("; {} ranks failed otherwise, first: {e}", errs.len()));
                off.push(format!("{n} ranks, world {world}: calls ran as {algos:?}{first}"));
            }
        }
    }
    assert!(off.is_empty(), "worlds without the low-latency protocol (forced, over shm):\n{}", off.join("\n"));
}

/// Broadcasts and reduces whose data fit a header line let a rank run ahead of the members
/// it does not wait for (a broadcast's root, a reduce off its root, a broadcast off the
/// root waits for the root only), by up to half the header lines. A long mixed sequence
/// (phases of 200 calls from one root, broadcasts only in every other phase; 1-8 f32, 96 B
/// now and then, a 128 B broadcast past the line, reduces and an allreduce now and then in the others; a
/// rank other than the root pausing at each phase's start so that the others run ahead of
/// it), 1 to 6 ranks: every result is
/// the reference's, the last barrier passes, and `finalize` (which checks the calls the
/// ranks ran ahead of) agrees.
pub fn forced_ll_runs_ahead_and_stays_correct(s: &Suite) {
    for n in ll_ranks(s).take(6) {
        let res = run_world(
            n,
            |r| ll_params(s, LlChoice::Force, LL_SLOT, r),
            |comm| -> Result<(), String> {
                let r = comm.rank();
                let val = |i: usize, p: usize, k: usize| (i * 31 + p * 7 + k) as f32;
                // Phases of PHASE calls with one root (longer than the ring, so that a rank
                // may get as far ahead as it is allowed); at each phase's start the rank
                // after the root pauses, and the others run ahead of it.
                const PHASE: usize = 200;
                for i in 0..6 * PHASE {
                    let root = (i / PHASE) % n;
                    let len = 1 + i % 8;
                    if i % PHASE == 0 && r == (root + 1) % n {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    let e = |what: &str, err: ferroccl::Error| format!("rank {r}: step {i}: {what}: {err}");
                    // Every other phase only broadcasts (nobody waits for everyone).
                    let kind = if (i / PHASE).is_multiple_of(2) { 0 } else { i % 7 };
                    match kind {
                        3 => {
                            let mut out = vec![0f32; len];
                            let b: Vec<f32> = (0..len).map(|k| val(i, r, k)).collect();
                            comm.reduce_into(&b, &mut out, ReduceOp::Sum, root).map_err(|err| e("reduce", err))?;
                            let want: Vec<f32> = (0..len).map(|k| (0..n).map(|p| val(i, p, k)).sum()).collect();
                            if r == root && out != want {
                                return Err(format!("rank {r}: step {i}: reduce to {root}: {out:?}, want {want:?}"));
                            }
                        }
                        5 if i % 35 == 5 => {
                            let mut b: Vec<f32> = (0..len).map(|k| val(i, r, k)).collect();
                            comm.allreduce(&mut b, ReduceOp::Sum).map_err(|err| e("allreduce", err))?;
                            let want: Vec<f32> = (0..len).map(|k| (0..n).map(|p| val(i, p, k)).sum()).collect();
                            if b != want {
                                return Err(format!("rank {r}: step {i}: allreduce: {b:?}, want {want:?}"));
                            }
                        }
                        _ => {
                            // In mixed phases every 11th is a 128 B broadcast: its data goes in
                            // the data slots; every 13th 96 B, the most a header line holds.
                            let len = if kind != 0 && i % 11 == 0 {
                                32
                            } else if i % 13 == 0 {
                                24
                            } else {
                                len
                            };
                            let mut b: Vec<f32> = (0..len).map(|k| if r == root { val(i, root, k) } else { -1.0 }).collect();
                            comm.broadcast(&mut b, root).map_err(|err| e("broadcast", err))?;
                            let want: Vec<f32> = (0..len).map(|k| val(i, root, k)).collect();
                            if b != want {
                                return Err(format!("rank {r}: step {i}: broadcast from {root}: {b:?}, want {want:?}"));
                            }
                        }
                    }
                }
                comm.barrier().map_err(|e| format!("rank {r}: last barrier: {e}"))?;
                comm.finalize().map_err(|e| format!("rank {r}: finalize: {e}"))
            },
        );
        all_ok(res).unwrap_or_else(|e| panic!("{n} ranks: {e}"));
    }
}

/// Two ranks that each broadcast from themselves (small, on the slots) both finish the
/// broadcast without waiting for anyone; the mismatch is found one operation later: a
/// low-latency allreduce, a schedule (an allgather past the slots) or `finalize`. Every
/// rank fails there or earlier, at least one with the mismatch naming both roots, none
/// after a silent success; 2 to 4 ranks (rank 0 from root 0, the others from root 1).
pub fn forced_ll_two_roots_fail_at_the_next_operation(s: &Suite) {
    if s.wire != Wire::Shm {
        return;
    }
    for next in ["allreduce", "allgather", "finalize"] {
        for n in 2..=4 {
            let ctx = format!("{n} ranks, then {next}");
            let res = failing_step(s, n, |comm| {
                let mut b = [comm.rank() as f32; 2];
                comm.broadcast(&mut b, usize::from(comm.rank() != 0)).and_then(|()| match next {
                    "allreduce" => comm.allreduce(&mut b, ReduceOp::Sum),
                    "allgather" => comm.allgather_into(&vec![1f32; LL_SLOT], &mut vec![0f32; LL_SLOT * n]),
                    _ => comm.finalize(),
                })
            });
            every_rank_failed_one_naming(s, &ctx, res, ["root 0", "root 1"]);
        }
    }
}

/// Two roots deep in a run of broadcasts from root 0: at call 20 of 150 rank 1 broadcasts
/// from itself. Nobody waits for the other root there, and the calls after it agree again,
/// so it is found only when the ranks settle the calls they ran ahead of, many at once (by
/// the digest of each member's calls); the mismatch must still name the call that differs
/// (both roots), and every rank fails; 2 to 4 ranks.
pub fn forced_ll_a_mismatch_deep_in_a_run_ahead_names_its_call(s: &Suite) {
    if s.wire != Wire::Shm {
        return;
    }
    for n in 2..=4 {
        let res = failing_step(s, n, |comm| {
            let mut b = [comm.rank() as f32; 2];
            for i in 0..150 {
                let root = usize::from(i == 20 && comm.rank() == 1);
                comm.broadcast(&mut b, root)?;
            }
            comm.finalize()
        });
        every_rank_failed_one_naming(s, &format!("{n} ranks"), res, ["root 0", "root 1"]);
    }
}

/// Runs `step` on every rank of an `n`-rank world with the low-latency protocol forced,
/// after a barrier: each rank's error and how long after the barrier it came (a rank
/// whose step succeeds fails the world).
fn failing_step(
    s: &Suite,
    n: usize,
    step: impl Fn(Communicator) -> ferroccl::Result<()> + Sync,
) -> Vec<Result<(ferroccl::Error, Duration), String>> {
    run_world(
        n,
        |r| ll_params(s, LlChoice::Force, LL_SLOT, r),
        |comm| {
            let r = comm.rank();
            comm.barrier().map_err(|e| format!("rank {r}: barrier: {e}"))?;
            let t = std::time::Instant::now();
            match step(comm) {
                Err(e) => Ok((e, t.elapsed())),
                Ok(()) => Err(format!("rank {r}: no error")),
            }
        },
    )
}

/// Every rank's result is an error (after `took`), at least one a mismatch that names both
/// `names`, none later than 5 s where the suite's clocks count.
fn every_rank_failed_one_naming(s: &Suite, ctx: &str, res: Vec<Result<(ferroccl::Error, Duration), String>>, names: [&str; 2]) {
    let errs = all_ok(res).unwrap_or_else(|e| panic!("{ctx}: {e}"));
    let named = errs.iter().any(|(e, _)| {
        let m = e.to_string();
        matches!(e, ferroccl::Error::Mismatch { .. }) && names.iter().all(|n| m.contains(n))
    });
    assert!(named, "{ctx}: no rank's mismatch names {names:?}: {errs:?}");
    if s.clocks {
        for (r, (e, took)) in errs.iter().enumerate() {
            assert!(*took < Duration::from_secs(5), "{ctx}: rank {r} took {took:?}: {e}");
        }
    }
}

/// A ring call (a small broadcast, in the ring of header lines) against a call outside it
/// (a small allreduce, in the sync lines): each side waits on its own kind of line, and the
/// mismatch is found by the probes a waiter sends after 50 ms. Rank 0 broadcasts from
/// itself (it waits for nobody, and finds it at `finalize`), the others allreduce; every
/// rank fails, at least one with a mismatch naming both calls, within seconds; 2 to 4 ranks.
pub fn forced_ll_ring_and_sync_calls_mismatch_on_every_rank(s: &Suite) {
    if s.wire != Wire::Shm {
        return;
    }
    for n in 2..=4 {
        let res = failing_step(s, n, |comm| {
            let mut b = [comm.rank() as f32; 2];
            let res = if comm.rank() == 0 { comm.broadcast(&mut b, 0) } else { comm.allreduce(&mut b, ReduceOp::Sum) };
            res.and_then(|()| comm.finalize())
        });
        every_rank_failed_one_naming(s, &format!("{n} ranks"), res, ["broadcast", "allreduce"]);
    }
}
