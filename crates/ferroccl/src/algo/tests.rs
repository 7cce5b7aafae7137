//! Every builder against the reference, through the simulator.

use ferroccl_kernels::{bf16, f16, reduce_many_bytes, DType, ReduceOp};
use proptest::prelude::*;

use super::sim::{self, SimError};
use super::{build, is_float, Action, Algo, Buf, Collective, Schedule, Shape, Slice};

const DTYPES: [DType; 6] = [DType::F32, DType::F16, DType::Bf16, DType::I32, DType::U8, DType::F64];

/// What the inputs hold.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Values {
    /// Integer-valued floats in -2..=2 (integers: any value): every partial sum and product
    /// of up to 16 ranks is exact, so the ring is bit-equal to the reference too.
    Exact,
    /// Any finite floats (with NaN, infinities and zeros of both signs for min and max).
    Random,
}

#[derive(Clone, Copy, Debug)]
struct Case {
    algo: Algo,
    coll: Collective,
    n: usize,
    count: usize,
    dtype: DType,
    op: ReduceOp,
    chunk_bytes: usize,
    in_place: bool,
    values: Values,
    seed: u64,
}

/// splitmix64: a small deterministic generator.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn float_bytes(dtype: DType, v: f64) -> Vec<u8> {
    match dtype {
        DType::F32 => (v as f32).to_le_bytes().to_vec(),
        DType::F64 => v.to_le_bytes().to_vec(),
        DType::F16 => f16::from_f64(v).to_bits().to_le_bytes().to_vec(),
        DType::Bf16 => bf16::from_f64(v).to_bits().to_le_bytes().to_vec(),
        _ => unreachable!("not a float"),
    }
}

fn float_value(dtype: DType, b: &[u8]) -> f64 {
    match dtype {
        DType::F32 => f64::from(f32::from_le_bytes(b.try_into().unwrap())),
        DType::F64 => f64::from_le_bytes(b.try_into().unwrap()),
        DType::F16 => f16::from_bits(u16::from_le_bytes(b.try_into().unwrap())).to_f64(),
        DType::Bf16 => bf16::from_bits(u16::from_le_bytes(b.try_into().unwrap())).to_f64(),
        _ => unreachable!("not a float"),
    }
}

fn gen(rng: &mut Rng, dtype: DType, op: ReduceOp, values: Values, elems: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(elems * dtype.size());
    for _ in 0..elems {
        if !is_float(dtype) {
            out.extend_from_slice(&rng.next().to_le_bytes()[..dtype.size()]);
            continue;
        }
        let v = match (values, op) {
            (Values::Exact, _) => (rng.next() % 5) as f64 - 2.0,
            (Values::Random, ReduceOp::Min | ReduceOp::Max) if rng.next().is_multiple_of(16) => {
                [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 0.0, -0.0][(rng.next() % 5) as usize]
            }
            (Values::Random, ReduceOp::Prod) => rng.unit() * 8.0 - 4.0,
            (Values::Random, _) => rng.unit() * 2000.0 - 1000.0,
        };
        out.extend_from_slice(&float_bytes(dtype, v));
    }
    out
}

fn shape(c: &Case, rank: usize) -> Shape {
    Shape {
        coll: c.coll,
        n: c.n,
        rank,
        count: c.count,
        dtype: c.dtype,
        op: c.op,
        chunk_bytes: c.chunk_bytes,
        in_place: c.in_place,
        slots: 1 + (c.seed % 6) as usize,
    }
}

fn schedules(c: &Case) -> Result<Vec<Schedule>, String> {
    (0..c.n).map(|r| build(c.algo, &shape(c, r))).collect()
}

fn reduce_all(c: &Case, inputs: &[Vec<u8>]) -> Vec<u8> {
    let srcs: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
    let mut out = vec![0u8; inputs[0].len()];
    if !out.is_empty() {
        reduce_many_bytes(c.dtype, c.op, &srcs, &mut out).unwrap();
    }
    out
}

/// Whether results may differ from the reference within the ring's rounding bound.
fn approximate(c: &Case) -> bool {
    c.algo == Algo::Ring
        && c.coll.reduces()
        && c.values == Values::Random
        && is_float(c.dtype)
        && c.op != ReduceOp::Min
        && c.op != ReduceOp::Max
}

/// Runs one case; returns the outputs (after checking them against the reference).
fn check(c: &Case) -> Result<Vec<Vec<u8>>, String> {
    let scheds = schedules(c)?;
    let (n, e) = (c.n, c.dtype.size());
    for (r, s) in scheds.iter().enumerate() {
        if c.count == 0 && !s.steps.is_empty() {
            return Err(format!("rank {r}: count 0 but {} steps", s.steps.len()));
        }
        if s.steps.len() <= 800 {
            sim::check_deps(r, s, c.in_place).map_err(|err| err.to_string())?;
        }
    }
    let (in_elems, out_elems) = c.coll.elems(c.count, n).unwrap();
    let blk = c.count * e;
    let mut rng = Rng(c.seed);
    let inputs: Vec<Vec<u8>> = (0..n).map(|_| gen(&mut rng, c.dtype, c.op, c.values, in_elems)).collect();
    let sentinel = |len: usize| vec![0xEEu8; len];
    let outputs: Vec<Vec<u8>> = (0..n)
        .map(|r| {
            if !c.in_place {
                return sentinel(out_elems * e);
            }
            match c.coll {
                Collective::AllGather => {
                    let mut b = sentinel(n * blk);
                    b[r * blk..(r + 1) * blk].copy_from_slice(&inputs[r]);
                    b
                }
                Collective::Broadcast { root } if r != root => sentinel(blk),
                _ => inputs[r].clone(),
            }
        })
        .collect();
    let initial = outputs.clone();
    let got = sim::run(&scheds, c.dtype, c.op, c.in_place, inputs.clone(), outputs).map_err(|err| err.to_string())?;
    let expected: Vec<Vec<u8>> = match c.coll {
        Collective::AllReduce => vec![reduce_all(c, &inputs); n],
        Collective::AllGather => vec![inputs.concat(); n],
        Collective::ReduceScatter => {
            let all = reduce_all(c, &inputs);
            (0..n)
                .map(|r| {
                    let mine = &all[r * blk..(r + 1) * blk];
                    if c.in_place {
                        let mut b = inputs[r].clone();
                        b[r * blk..(r + 1) * blk].copy_from_slice(mine);
                        b
                    } else {
                        mine.to_vec()
                    }
                })
                .collect()
        }
        Collective::AllToAll => (0..n).map(|r| (0..n).flat_map(|i| inputs[i][r * blk..(r + 1) * blk].to_vec()).collect()).collect(),
        Collective::Broadcast { root } => vec![inputs[root].clone(); n],
        Collective::Reduce { root } => (0..n).map(|r| if r == root { reduce_all(c, &inputs) } else { initial[r].clone() }).collect(),
        c if c.per_call() => return Err(format!("{} is not built from a shape", c.name())),
        c => return Err(format!("{} has no reference here", c.name())),
    };
    for r in 0..n {
        if approximate(c) {
            within_ring_bound(c, r, &inputs, &got[r], &expected[r]).map_err(|why| format!("rank {r}: {why}"))?;
            if got[r] != got[0] && c.coll == Collective::AllReduce {
                return Err(format!("rank {r}'s result differs from rank 0's"));
            }
        } else if got[r] != expected[r] {
            let at = got[r].iter().zip(&expected[r]).position(|(a, b)| a != b).unwrap_or(0);
            return Err(format!(
                "rank {r}: output differs from the reference at byte {at} (element {}): got {:?}, want {:?}",
                at / e,
                &got[r][at / e * e..(at / e * e + e).min(got[r].len())],
                &expected[r][at / e * e..(at / e * e + e).min(expected[r].len())]
            ));
        }
    }
    Ok(got)
}

/// The documented ring bound: |ring - reference| <= 2 n u sum|x_i| (+ u |reference| for Avg),
/// with u the unit roundoff of the element type.
fn within_ring_bound(c: &Case, rank: usize, inputs: &[Vec<u8>], got: &[u8], want: &[u8]) -> Result<(), String> {
    let e = c.dtype.size();
    let u = match c.dtype {
        DType::F16 => 2f64.powi(-11),
        DType::Bf16 => 2f64.powi(-8),
        DType::F32 => 2f64.powi(-24),
        _ => 2f64.powi(-53),
    };
    let n = c.n as f64;
    // Output element i of an out-of-place reduce_scatter is element rank * count + i of the
    // inputs.
    let base = if c.coll == Collective::ReduceScatter && !c.in_place { rank * c.count } else { 0 };
    for i in 0..want.len() / e {
        let (g, w) = (float_value(c.dtype, &got[i * e..][..e]), float_value(c.dtype, &want[i * e..][..e]));
        let j = base + i;
        let mag: f64 = inputs.iter().map(|x| float_value(c.dtype, &x[j * e..][..e]).abs()).sum();
        let mut bound = 2.0 * n * u * mag;
        if c.op == ReduceOp::Avg {
            bound = bound / n + 2.0 * u * w.abs();
        }
        if (g - w).abs() > bound {
            return Err(format!("element {i}: ring {g} vs reference {w}, beyond the bound {bound}"));
        }
    }
    Ok(())
}

fn all_pairs() -> Vec<(Algo, Collective)> {
    let colls = [
        Collective::AllReduce,
        Collective::AllGather,
        Collective::ReduceScatter,
        Collective::AllToAll,
        Collective::Broadcast { root: 0 },
        Collective::Reduce { root: 0 },
    ];
    Algo::SCHEDULED.into_iter().flat_map(|a| colls.into_iter().filter(move |&c| a.supports(c)).map(move |c| (a, c))).collect()
}

fn with_root(coll: Collective, root: usize) -> Collective {
    match coll {
        Collective::Broadcast { .. } => Collective::Broadcast { root },
        Collective::Reduce { .. } => Collective::Reduce { root },
        c => c,
    }
}

fn values_for(algo: Algo) -> Values {
    if algo == Algo::Ring {
        Values::Exact
    } else {
        Values::Random
    }
}

/// Every (algorithm, collective) x n 1..=9 x counts x chunk sizes x in/out of place, with the
/// dtype and op rotating through all combinations (and a few counts for n 10..=16).
#[test]
fn sweep_shapes() {
    let mut k = 0usize;
    for (algo, coll) in all_pairs() {
        for n in 1..=16 {
            let counts = if n <= 9 { vec![0, 1, n - 1, n, n + 1, 17, 1000, 4099] } else { vec![n - 1, n + 1, 1000] };
            for count in counts {
                let combo = k % (DTYPES.len() * ReduceOp::ALL.len());
                k += 1;
                let dtype = DTYPES[combo % DTYPES.len()];
                let mut op = ReduceOp::ALL[combo / DTYPES.len()];
                if !algo.supports_op(coll, dtype, op) {
                    op = ReduceOp::Sum;
                }
                let e = dtype.size();
                // Tiny and odd chunks; fewer of them for the big shapes (keeps the sweep quick).
                let tiny = if count * n <= 1000 { 2 * e } else { 64 * e };
                let odd = if count * n <= 5000 { 7 * e + 3 } else { 67 * e + 3 };
                for chunk_bytes in [tiny, odd, 1 << 20] {
                    for in_place in [false, true] {
                        let case = Case {
                            algo,
                            coll: with_root(coll, (count + k) % n),
                            n,
                            count,
                            dtype,
                            op,
                            chunk_bytes,
                            in_place,
                            values: values_for(algo),
                            seed: k as u64,
                        };
                        if let Err(why) = check(&case) {
                            panic!("{case:?}: {why}");
                        }
                    }
                }
            }
        }
    }
}

/// Every dtype x op for the reducing collectives on a few small shapes.
#[test]
fn sweep_dtypes_and_ops() {
    for (algo, coll) in all_pairs().into_iter().filter(|(_, c)| c.reduces()) {
        for n in [1, 2, 3, 4, 7] {
            for count in [1, n + 1, 17] {
                for dtype in DTYPES {
                    for op in ReduceOp::ALL {
                        for (chunk_bytes, in_place) in [(2 * dtype.size(), true), (1 << 20, false)] {
                            let case = Case {
                                algo,
                                coll: with_root(coll, n / 2),
                                n,
                                count,
                                dtype,
                                op,
                                chunk_bytes,
                                in_place,
                                values: values_for(algo),
                                seed: (n * 1000 + count) as u64,
                            };
                            match check(&case) {
                                Err(why) if algo.supports_op(coll, dtype, op) => panic!("{case:?}: {why}"),
                                Ok(_) if !algo.supports_op(coll, dtype, op) => panic!("{case:?}: built a refused combination"),
                                _ => {}
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Ring reductions of arbitrary floats stay within the documented bound, and every rank
/// still ends with the same bytes.
#[test]
fn ring_rounding_bound() {
    for coll in [Collective::AllReduce, Collective::ReduceScatter] {
        for dtype in [DType::F16, DType::Bf16, DType::F32, DType::F64] {
            for op in [ReduceOp::Sum, ReduceOp::Avg] {
                for n in [2, 3, 5, 8, 9] {
                    for in_place in [false, true] {
                        let case = Case {
                            algo: Algo::Ring,
                            coll,
                            n,
                            count: 257,
                            dtype,
                            op,
                            chunk_bytes: 40,
                            in_place,
                            values: Values::Random,
                            seed: n as u64,
                        };
                        if let Err(why) = check(&case) {
                            panic!("{case:?}: {why}");
                        }
                    }
                }
            }
        }
    }
}

fn any_case() -> impl Strategy<Value = Case> {
    let pairs = all_pairs();
    (0..pairs.len(), 1usize..=16, 0usize..2000, 0..DTYPES.len(), 0..ReduceOp::ALL.len(), 1usize..600, any::<bool>(), any::<u64>()).prop_map(
        move |(p, n, count, d, o, chunk, in_place, seed)| {
            let (algo, coll) = pairs[p];
            let dtype = DTYPES[d];
            let op = if algo.supports_op(coll, dtype, ReduceOp::ALL[o]) { ReduceOp::ALL[o] } else { ReduceOp::Max };
            Case {
                algo,
                coll: with_root(coll, seed as usize % n),
                n,
                count,
                dtype,
                op,
                // At most a few hundred chunks per transfer (keeps the simulation quick).
                chunk_bytes: chunk.max(count * n * dtype.size() / 256),
                in_place,
                values: values_for(algo),
                seed,
            }
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]
    #[test]
    fn random_cases_match_the_reference(case in any_case()) {
        if let Err(why) = check(&case) {
            prop_assert!(false, "{:?}: {}", case, why);
        }
    }
}

#[test]
fn build_refuses_bad_shapes() {
    let ok = Shape {
        coll: Collective::AllReduce,
        n: 4,
        rank: 1,
        count: 10,
        dtype: DType::F32,
        op: ReduceOp::Sum,
        chunk_bytes: 64,
        in_place: false,
        slots: 0,
    };
    assert!(build(Algo::Ring, &ok).is_ok());
    let err = |algo, s: Shape| build(algo, &s).unwrap_err();
    assert!(err(Algo::Ring, Shape { rank: 4, ..ok }).contains("rank 4 out of range"));
    assert!(err(Algo::Ring, Shape { n: 0, rank: 0, ..ok }).contains("n == 0"));
    assert!(err(Algo::Mesh, Shape { coll: Collective::Broadcast { root: 9 }, ..ok }).contains("root 9"));
    assert!(err(Algo::Mesh, Shape { coll: Collective::Reduce { root: 4 }, ..ok }).contains("root 4"));
    assert!(err(Algo::Chain, ok).contains("chain does not implement allreduce"));
    assert!(err(Algo::OneShot, Shape { coll: Collective::AllGather, ..ok }).contains("oneshot"));
    assert!(err(Algo::Ring, Shape { dtype: DType::I32, op: ReduceOp::Avg, ..ok }).contains("avg"));
    assert!(build(Algo::Mesh, &Shape { dtype: DType::I32, op: ReduceOp::Avg, ..ok }).is_ok());
    assert!(err(Algo::Mesh, Shape { coll: Collective::AllGather, count: usize::MAX / 2, ..ok }).contains("overflows"));
    assert_eq!(build(Algo::Ring, &Shape { count: 0, ..ok }).unwrap(), Schedule::default());
}

#[test]
fn names_round_trip() {
    for a in Algo::ALL {
        assert_eq!(Algo::parse(a.name()), Some(a));
        assert_eq!(Algo::parse(&a.name().to_uppercase()), Some(a));
    }
    assert_eq!(Algo::parse("tree"), None);
    assert_eq!(Algo::parse("binomial"), Some(Algo::Binomial));
}

/// The schedule's size: the ring allreduce sends 2 (n - 1) / n of the message per rank in
/// 2 (n - 1) steps, the mesh the same bytes in two rounds.
#[test]
fn bytes_on_the_wire() {
    let sent = |algo, coll, n, count| -> usize {
        let s = build(
            algo,
            &Shape { coll, n, rank: 0, count, dtype: DType::F32, op: ReduceOp::Sum, chunk_bytes: 0, in_place: false, slots: 0 },
        )
        .unwrap();
        s.steps.iter().map(|st| if let Action::Send { src, .. } = &st.op { src.len() } else { 0 }).sum()
    };
    let sends = |algo, coll, n, count| -> usize {
        let s = build(
            algo,
            &Shape { coll, n, rank: 0, count, dtype: DType::F32, op: ReduceOp::Sum, chunk_bytes: 0, in_place: false, slots: 0 },
        )
        .unwrap();
        s.steps.iter().filter(|st| matches!(st.op, Action::Send { .. })).count()
    };
    let (n, count) = (8, 8000);
    let s = count * 4;
    assert_eq!(sent(Algo::Ring, Collective::AllReduce, n, count), 2 * (n - 1) * s / n);
    assert_eq!(sends(Algo::Ring, Collective::AllReduce, n, count), 2 * (n - 1));
    assert_eq!(sent(Algo::Mesh, Collective::AllReduce, n, count), 2 * (n - 1) * s / n);
    assert_eq!(sent(Algo::OneShot, Collective::AllReduce, n, count), (n - 1) * s);
    assert_eq!(sent(Algo::Ring, Collective::AllGather, n, count), (n - 1) * s);
    assert_eq!(sent(Algo::Mesh, Collective::ReduceScatter, n, count), (n - 1) * s);
    assert_eq!(sent(Algo::Chain, Collective::Broadcast { root: 0 }, n, count), s);
    assert_eq!(sent(Algo::Mesh, Collective::Broadcast { root: 0 }, n, count), (n - 1) * s);
}

fn slice(buf: Buf, start: usize, len: usize) -> Slice {
    Slice::new(buf, start, len)
}

#[test]
fn simulator_reports_deadlock_mismatch_and_races() {
    let recv_then_send = |peer| {
        let mut a = Schedule::default();
        let r = a.push(Action::Recv { peer, dst: slice(Buf::Output, 0, 4) }, vec![]);
        a.push(Action::Send { peer, src: slice(Buf::Input, 0, 4) }, vec![r]);
        a
    };
    let run = |s: Vec<Schedule>| sim::run(&s, DType::F32, ReduceOp::Sum, false, vec![vec![0; 4]; 2], vec![vec![0; 4]; 2]);
    let r = run(vec![recv_then_send(1), recv_then_send(0)]);
    assert!(matches!(r, Err(SimError::Deadlock(_))), "{r:?}");

    let mut b = Schedule::default();
    b.push(Action::Send { peer: 1, src: slice(Buf::Input, 0, 4) }, vec![]);
    let mut c = Schedule::default();
    c.push(Action::Recv { peer: 0, dst: slice(Buf::Output, 0, 8) }, vec![]);
    let r = sim::run(&[b.clone(), c], DType::F32, ReduceOp::Sum, false, vec![vec![0; 4], vec![0; 8]], vec![vec![0; 4], vec![0; 8]]);
    assert!(matches!(r, Err(SimError::LengthMismatch { .. })), "{r:?}");

    // A copy over a chunk still being sent.
    let mut d = Schedule::default();
    d.push(Action::Send { peer: 1, src: slice(Buf::Output, 0, 4) }, vec![]);
    d.push(Action::Copy { dst: slice(Buf::Output, 0, 4), src: slice(Buf::Input, 0, 4) }, vec![]);
    let mut e = Schedule::default();
    e.push(Action::Recv { peer: 0, dst: slice(Buf::Output, 0, 4) }, vec![]);
    assert!(matches!(run(vec![d.clone(), e]), Err(SimError::Race { rank: 0, step: 1, other: 0 })));
    assert!(matches!(sim::check_deps(0, &d, false), Err(SimError::Unordered { first: 0, second: 1, .. })));

    let mut z = Schedule::default();
    z.push(Action::Send { peer: 1, src: slice(Buf::Input, 0, 0) }, vec![]);
    assert!(matches!(run(vec![z, Schedule::default()]), Err(SimError::Invalid { .. })));
    let mut oob = Schedule::default();
    oob.push(Action::Copy { dst: slice(Buf::Output, 0, 4), src: slice(Buf::Scratch, 0, 4) }, vec![]);
    assert!(matches!(run(vec![oob, Schedule::default()]), Err(SimError::Invalid { .. })));
}

#[test]
fn alltoallv_sends_every_peer_one_whole_block_in_pairwise_order() {
    // 3 ranks, rank 1: sends 2 elements (bytes here) to rank 0, 0 to rank 2, 1 to itself.
    let send = [(0, 2), (5, 1), (2, 0)];
    let recv = [(4, 3), (1, 1), (9, 0)];
    let s = super::build_alltoallv(Algo::Mesh, 3, 1, &send, &recv);
    let ops: Vec<Action> = s.steps.iter().map(|st| st.op.clone()).collect();
    let sl = |buf, start, len| Slice::new(buf, start, len);
    assert_eq!(
        ops,
        vec![
            // Step 1: receive from rank 0, send to rank 2 (the empty block too).
            Action::Recv { peer: 0, dst: sl(Buf::Output, 4, 3) },
            Action::Send { peer: 2, src: sl(Buf::Input, 2, 0) },
            // Step 2: receive from rank 2 (empty), send to rank 0.
            Action::Recv { peer: 2, dst: sl(Buf::Output, 9, 0) },
            Action::Send { peer: 0, src: sl(Buf::Input, 0, 2) },
            Action::Copy { dst: sl(Buf::Output, 1, 1), src: sl(Buf::Input, 5, 1) },
        ]
    );
    assert!(s.steps.iter().all(|st| st.deps.is_empty()) && s.scratch_bytes == 0);
    // Alone: only the copy, and nothing at all for an empty block.
    assert_eq!(super::build_alltoallv(Algo::Mesh, 1, 0, &[(0, 4)], &[(8, 4)]).steps.len(), 1);
    assert!(super::build_alltoallv(Algo::Mesh, 1, 0, &[(0, 0)], &[(8, 0)]).steps.is_empty());
}

/// One rank's (byte offset, byte length) per peer.
type Blocks = Vec<(usize, usize)>;

/// Every rank's (send, recv) blocks of an alltoallv among `n` ranks whose counts (bytes,
/// at least 1: the simulator refuses empty transfers) come from `seed`; blocks packed in
/// rank order, the receive side in reverse order so that displacements are not trivial.
fn alltoallv_blocks(n: usize, seed: u64) -> Vec<(Blocks, Blocks)> {
    let mut rng = Rng(seed);
    // counts[a][b]: bytes rank a sends rank b.
    let counts: Vec<Vec<usize>> = (0..n).map(|_| (0..n).map(|_| 1 + (rng.next() % 9) as usize).collect()).collect();
    (0..n)
        .map(|r| {
            let mut off = 0;
            let send = (0..n)
                .map(|p| {
                    let b = (off, counts[r][p]);
                    off += counts[r][p];
                    b
                })
                .collect();
            let mut off = 0;
            let mut recv = vec![(0, 0); n];
            for p in (0..n).rev() {
                recv[p] = (off, counts[p][r]);
                off += counts[p][r];
            }
            (send, recv)
        })
        .collect()
}

/// Runs an alltoallv in the simulator with `algos[r]` on rank `r` and checks every block.
fn check_alltoallv(n: usize, seed: u64, algos: &[Algo], window: Option<usize>) {
    let blocks = alltoallv_blocks(n, seed);
    let scheds: Vec<Schedule> = (0..n)
        .map(|r| {
            let (send, recv) = &blocks[r];
            match (algos[r], window) {
                (Algo::Pairwise, Some(w)) => super::pairwise::alltoallv::build(n, r, send, recv, w),
                (a, _) => super::build_alltoallv(a, n, r, send, recv),
            }
        })
        .collect();
    for (r, s) in scheds.iter().enumerate() {
        sim::check_deps(r, s, false).unwrap();
    }
    // Byte i of rank r's block for p: r, p, i mixed.
    let val = |r: usize, p: usize, i: usize| (r * 31 + p * 7 + i * 3 + 1) as u8;
    let inputs: Vec<Vec<u8>> = (0..n)
        .map(|r| {
            let mut v = vec![0u8; blocks[r].0.iter().map(|b| b.1).sum()];
            for (p, &(off, len)) in blocks[r].0.iter().enumerate() {
                for i in 0..len {
                    v[off + i] = val(r, p, i);
                }
            }
            v
        })
        .collect();
    let outputs: Vec<Vec<u8>> = (0..n).map(|r| vec![0xEE; blocks[r].1.iter().map(|b| b.1).sum()]).collect();
    let got = sim::run(&scheds, DType::U8, ReduceOp::Sum, false, inputs, outputs).unwrap_or_else(|e| panic!("n {n} {algos:?}: {e}"));
    for r in 0..n {
        for (p, &(off, len)) in blocks[r].1.iter().enumerate() {
            let want: Vec<u8> = (0..len).map(|i| val(p, r, i)).collect();
            assert_eq!(&got[r][off..off + len], &want[..], "n {n} rank {r} block from {p} {algos:?}");
        }
    }
}

#[test]
fn pairwise_alltoallv_delivers_every_block() {
    for n in 1..=9 {
        for seed in 0..4 {
            check_alltoallv(n, seed, &vec![Algo::Pairwise; n], None);
            check_alltoallv(n, seed, &vec![Algo::Mesh; n], None);
            for w in [1, 2, 3, 16] {
                check_alltoallv(n, seed, &vec![Algo::Pairwise; n], Some(w));
            }
        }
    }
}

#[test]
fn ranks_may_mix_mesh_and_pairwise_in_one_alltoallv() {
    // Each rank picks from its own counts, so one call may run both schedules.
    for n in 2..=7 {
        for mask in 0..(1u32 << n) {
            let algos: Vec<Algo> = (0..n).map(|r| if mask >> r & 1 == 1 { Algo::Pairwise } else { Algo::Mesh }).collect();
            check_alltoallv(n, u64::from(mask), &algos, Some(1));
        }
    }
}

#[test]
fn pairwise_alltoallv_keeps_a_window_of_steps_in_flight() {
    // 5 ranks, rank 1, window 2: (recv from r - s, send to r + s) for s = 1..4, step s
    // waiting for step s - 2's two transfers; the copy before the first step that waits.
    let send = [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1)];
    let recv = [(4, 1), (3, 1), (2, 1), (1, 1), (0, 1)];
    let s = super::pairwise::alltoallv::build(5, 1, &send, &recv, 2);
    let peers: Vec<(String, usize, Vec<usize>)> = s
        .steps
        .iter()
        .map(|st| match &st.op {
            Action::Recv { peer, .. } => ("recv".into(), *peer, st.deps.clone()),
            Action::Send { peer, .. } => ("send".into(), *peer, st.deps.clone()),
            Action::Copy { .. } => ("copy".into(), 1, st.deps.clone()),
            op => panic!("{op:?}"),
        })
        .collect();
    let e = |k: &str, p: usize, d: Vec<usize>| (k.to_string(), p, d);
    assert_eq!(
        peers,
        vec![
            e("recv", 0, vec![]),
            e("send", 2, vec![]),
            e("recv", 4, vec![]),
            e("send", 3, vec![]),
            e("copy", 1, vec![]),
            e("recv", 3, vec![0, 1]),
            e("send", 4, vec![0, 1]),
            e("recv", 2, vec![2, 3]),
            e("send", 0, vec![2, 3]),
        ]
    );
    // Same messages as the mesh, zero-length ones included; with fewer steps than the
    // window, the copy last (as the mesh's).
    let z = super::build_alltoallv(Algo::Pairwise, 3, 0, &[(0, 0), (0, 0), (0, 0)], &[(0, 0), (0, 0), (0, 0)]);
    assert_eq!(z.steps.len(), 4);
    let two = super::build_alltoallv(Algo::Pairwise, 2, 0, &[(0, 1), (1, 1)], &[(0, 1), (1, 1)]);
    assert!(matches!(two.steps[2].op, Action::Copy { .. }) && two.steps.len() == 3);
}

#[test]
fn gather_and_scatter_exchange_one_message_per_rank_with_the_root() {
    let sl = |buf, start, len| Slice::new(buf, start, len);
    // Off the root: one message, empty or not.
    let g = super::build_gather(3, 2, 1, (0, 0), &[]);
    assert_eq!(g.steps.iter().map(|s| s.op.clone()).collect::<Vec<_>>(), vec![Action::Send { peer: 1, src: sl(Buf::Input, 0, 0) }]);
    let sc = super::build_scatter(3, 0, 1, &[], (4, 8));
    assert_eq!(sc.steps.iter().map(|s| s.op.clone()).collect::<Vec<_>>(), vec![Action::Recv { peer: 1, dst: sl(Buf::Output, 4, 8) }]);
    // The root: every other rank from root + 1 on, then its own block.
    let g = super::build_gather(3, 1, 1, (0, 4), &[(8, 0), (0, 4), (4, 4)]);
    assert_eq!(
        g.steps.iter().map(|s| s.op.clone()).collect::<Vec<_>>(),
        vec![
            Action::Recv { peer: 2, dst: sl(Buf::Output, 4, 4) },
            Action::Recv { peer: 0, dst: sl(Buf::Output, 8, 0) },
            Action::Copy { dst: sl(Buf::Output, 0, 4), src: sl(Buf::Input, 0, 4) },
        ]
    );
    let sc = super::build_scatter(2, 0, 0, &[(6, 2), (0, 6)], (0, 2));
    assert_eq!(
        sc.steps.iter().map(|s| s.op.clone()).collect::<Vec<_>>(),
        vec![Action::Send { peer: 1, src: sl(Buf::Input, 0, 6) }, Action::Copy { dst: sl(Buf::Output, 0, 2), src: sl(Buf::Input, 6, 2) }]
    );
}
