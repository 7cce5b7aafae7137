//! MoE dispatch / combine (`ferroccl::moe`): random routings (tokens on their own rank's
//! experts, experts with no token, every token on one rank, n = 0) on 2 to 4 ranks, both
//! modes, several steps on one object, against a reference that runs every expert locally
//! (every rank draws every rank's input from the case's seed): f32 exactly (integer tokens,
//! dyadic weights), bf16 and f16 within the bound of docs/moe.md; the dispatched groups
//! exactly; two objects interleaved on one communicator (send one micro-batch, run and
//! combine the other, receive the first); bad input and mismatched configs fail on every
//! rank, naming the rank and the problem, well before the deadline.

use std::time::{Duration, Instant};

use ferroccl::moe::{Dispatched, Moe, MoeConfig, MoeFloat, MoeMode};
use ferroccl::{bf16, f16, Communicator, Params};
use proptest::prelude::*;
use proptest::test_runner::Config as ProptestConfig;

use crate::harness::{all_ok, check_cases, run_world, Suite};

fn params(s: &Suite, timeout: Duration, rank: usize) -> Params {
    Params { timeout, ..s.params(rank) }
}

/// splitmix64: every rank draws every rank's input from the case's seed.
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

/// Expert `e`: `y = x · (e + 1) + e`, elementwise, rounded to `T` (the reference computes
/// the same).
fn expert<T: MoeFloat>(e: usize, x: T) -> T {
    T::from_f32(x.to_f32() * (e + 1) as f32 + e as f32)
}

/// Routing patterns, drawn per case.
#[derive(Clone, Copy, Debug)]
enum Pattern {
    Random,
    /// Every token's experts on rank 0.
    AllToRankZero,
    /// Every token's experts on its own rank (no wire).
    LocalOnly,
    /// n = 0 everywhere.
    Empty,
    /// Random experts, about a third of the slots masked (`moe::MASKED`), some tokens'
    /// every slot.
    Masked,
}

/// One rank's input of one step.
struct Input {
    x: Vec<f32>,
    idx: Vec<u32>,
    w: Vec<f32>,
}

fn input(cfg: &MoeConfig, ranks: usize, pattern: Pattern, seed: u64, rank: usize, step: u64) -> Input {
    let mut rng = Rng(seed ^ (rank as u64) << 32 ^ step << 48);
    let n = match pattern {
        Pattern::Empty => 0,
        _ => rng.below(cfg.max_tokens_per_rank as u64 + 1) as usize,
    };
    let per = cfg.num_experts / ranks;
    let (lo, count) = match pattern {
        Pattern::AllToRankZero => (0, per),
        Pattern::LocalOnly => (rank * per, per),
        _ => (0, cfg.num_experts),
    };
    let k = cfg.top_k.min(count);
    let mut x = Vec::new();
    let mut idx = Vec::new();
    let mut w = Vec::new();
    for _ in 0..n {
        x.extend((0..cfg.hidden).map(|_| rng.below(17) as f32 - 8.0));
        let mut chosen: Vec<u32> = Vec::new();
        while chosen.len() < k {
            let e = (lo + rng.below(count as u64) as usize) as u32;
            if !chosen.contains(&e) {
                chosen.push(e);
            }
        }
        if matches!(pattern, Pattern::Masked) {
            for e in &mut chosen {
                if rng.below(3) == 0 {
                    *e = ferroccl::moe::MASKED;
                }
            }
        }
        idx.extend(&chosen);
        w.extend((0..k).map(|_| [0.25f32, 0.5, 1.0, 2.0][rng.below(4) as usize]));
    }
    Input { x, idx, w }
}

/// The config a case uses: top_k may shrink so that every pattern can pick distinct experts.
fn config(ranks: usize, seed: u64, pattern: Pattern) -> MoeConfig {
    let mut rng = Rng(seed ^ 0xC0F1);
    let per = 1 + rng.below(3) as usize;
    let num_experts = per * ranks;
    let top_k = 1 + rng.below(3) as usize;
    let top_k = match pattern {
        Pattern::AllToRankZero | Pattern::LocalOnly => top_k.min(per),
        _ => top_k.min(num_experts),
    };
    MoeConfig { num_experts, hidden: 1 + rng.below(9) as usize, top_k, max_tokens_per_rank: rng.below(12) as usize }
}

/// Unit roundoff of `T` (0 for f32: the f32 cases are exact).
fn unit<T: MoeFloat>() -> f64 {
    match T::DTYPE {
        ferroccl::DType::Bf16 => 2f64.powi(-8),
        ferroccl::DType::F16 => 2f64.powi(-11),
        _ => 0.0,
    }
}

/// Checks the dispatched groups exactly, runs this rank's experts, combines, and checks
/// `out` against the reference (f32 exactly, half types within the bound).
fn check_step<T: MoeFloat>(
    comm: &Communicator,
    moe: &mut Moe<'_, T>,
    cfg: &MoeConfig,
    inputs: &[Input],
    d: Dispatched<T>,
) -> Result<(), String> {
    let y = experts(comm, cfg, inputs, &d)?;
    let me = comm.rank();
    let mut out = vec![T::from_f32(f32::NAN); inputs[me].x.len()];
    moe.combine(&y, &d.handle, &mut out).map_err(|e| format!("combine: {e}"))?;
    check_out(cfg, &inputs[me], &out, moe.mode())
}

/// Checks the groups of `d` against every rank's input and returns the local experts'
/// outputs.
fn experts<T: MoeFloat>(comm: &Communicator, cfg: &MoeConfig, inputs: &[Input], d: &Dispatched<T>) -> Result<Vec<T>, String> {
    let (me, ranks, h) = (comm.rank(), comm.size(), cfg.hidden);
    let per = cfg.num_experts / ranks;
    let mut want: Vec<T> = Vec::new();
    let mut offsets = vec![0];
    for le in 0..per {
        let e = (me * per + le) as u32;
        for inp in inputs {
            for (t, ks) in inp.idx.chunks(cfg.top_k.max(1)).enumerate() {
                if ks.contains(&e) {
                    want.extend(inp.x[t * h..(t + 1) * h].iter().map(|&v| T::from_f32(v)));
                }
            }
        }
        offsets.push(want.len() / h);
    }
    if d.expert_offsets != offsets || d.tokens != want {
        return Err(format!("rank {me}: dispatched {:?} / {:?}, want {offsets:?} / {want:?}", d.expert_offsets, d.tokens));
    }
    let mut y = d.tokens.clone();
    for le in 0..per {
        for v in &mut y[offsets[le] * h..offsets[le + 1] * h] {
            *v = expert(me * per + le, *v);
        }
    }
    Ok(y)
}

/// `out` against the reference: exact for f32; for the half types within `(2u + u²)` of
/// the magnitudes in throughput mode (each rank's partial sum rounded, then the total),
/// within `u` in low-latency mode (the origin sums every slot in f32, one rounding).
fn check_out<T: MoeFloat>(cfg: &MoeConfig, inp: &Input, out: &[T], mode: MoeMode) -> Result<(), String> {
    let (h, k) = (cfg.hidden, cfg.top_k);
    let u = unit::<T>();
    for (i, o) in out.iter().enumerate() {
        let t = i / h;
        let x = T::from_f32(inp.x[i]);
        let (mut sum, mut mag) = (0f64, 0f64);
        for j in 0..k {
            if inp.idx[t * k + j] == ferroccl::moe::MASKED {
                continue;
            }
            let wy = f64::from(inp.w[t * k + j]) * f64::from(expert(inp.idx[t * k + j] as usize, x).to_f32());
            sum += wy;
            mag += wy.abs();
        }
        let got = f64::from(o.to_f32());
        let bound = match mode {
            MoeMode::Throughput => (2.0 * u + u * u) * mag,
            MoeMode::LowLatency => u * mag,
        } + 1e-6 * mag;
        let ok = if u == 0.0 { got == sum } else { (got - sum).abs() <= bound };
        if !ok {
            return Err(format!("{}: token {t} element {i}: got {got}, want {sum} (bound {bound})", T::DTYPE));
        }
    }
    Ok(())
}

fn modes() -> [MoeMode; 2] {
    [MoeMode::Throughput, MoeMode::LowLatency]
}

/// `steps` steps of one object of `T` in `mode`, each against the reference.
fn run_steps<T: MoeFloat>(comm: &Communicator, mode: MoeMode, pattern: Pattern, seed: u64, steps: u64) -> Result<(), String> {
    let ranks = comm.size();
    let cfg = config(ranks, seed, pattern);
    let ctx = |what: String| format!("rank {} {mode:?} {} {cfg:?} {pattern:?}: {what}", comm.rank(), T::DTYPE);
    let mut moe = comm.moe::<T>(cfg, mode).map_err(|e| ctx(format!("setup: {e}")))?;
    for step in 0..steps {
        let inputs: Vec<Input> = (0..ranks).map(|r| input(&cfg, ranks, pattern, seed, r, step)).collect();
        let mine = &inputs[comm.rank()];
        let x: Vec<T> = mine.x.iter().map(|&v| T::from_f32(v)).collect();
        let d = moe.dispatch(&x, &mine.idx, &mine.w).map_err(|e| ctx(format!("step {step}: dispatch: {e}")))?;
        check_step(comm, &mut moe, &cfg, &inputs, d).map_err(|e| ctx(format!("step {step}: {e}")))?;
    }
    Ok(())
}

/// Random routings (all five patterns, masked slots included), 2 to 4 ranks, both modes, f32 exactly and bf16,
/// f16 within the bound, three steps per object (the persistent buffers reused).
pub fn moe_dispatch_combine_equals_the_reference(s: &Suite) {
    let patterns = prop_oneof![
        Just(Pattern::Random),
        Just(Pattern::AllToRankZero),
        Just(Pattern::LocalOnly),
        Just(Pattern::Empty),
        Just(Pattern::Masked)
    ];
    let config = ProptestConfig { cases: 2 * s.nonblocking_cases, ..ProptestConfig::default() };
    check_cases(config, (2usize..=4, any::<u64>(), patterns), |(n, seed, pattern)| {
        let res = run_world(
            n,
            |r| params(s, Duration::from_secs(30), r),
            |comm| {
                for mode in modes() {
                    run_steps::<f32>(&comm, mode, pattern, seed, 3)?;
                    run_steps::<bf16>(&comm, mode, pattern, seed ^ 1, 2)?;
                    run_steps::<f16>(&comm, mode, pattern, seed ^ 2, 2)?;
                }
                comm.finalize().map_err(|e| e.to_string())
            },
        );
        all_ok(res).map(|_| ()).map_err(|e| format!("{:?} {n} ranks: {e}", s.wire))
    });
}

/// The low-latency mode's signals: between ranks of one host (shared windows over shm)
/// they are words raised in the destination's window, so no rank serves a `SIGNAL`;
/// between hosts (tcp, verbs) each dispatch and each combine is one `SIGNAL` from every
/// other rank. Counted by `signals_served` around three checked steps; 2 to 4 ranks.
pub fn moe_low_latency_signals_go_by_words_on_one_host(s: &Suite) {
    use ferroccl::TransportKind;
    for n in [2usize, 3, 4] {
        let res = run_world(
            n,
            |r| params(s, Duration::from_secs(30), r),
            |comm| {
                let me = comm.rank();
                let before = comm.registration_stats().signals_served;
                run_steps::<f32>(&comm, MoeMode::LowLatency, Pattern::Random, 31 + n as u64, 3)?;
                let served = comm.registration_stats().signals_served - before;
                // Each step: a dispatch and a combine from every other rank, one `SIGNAL`
                // each unless the pair shares a host (shm).
                let remote = (0..n).filter(|&p| p != me && comm.transport_to(p) != Some(TransportKind::Shm)).count() as u64;
                if served != 2 * 3 * remote {
                    return Err(format!(
                        "rank {me}: served {served} SIGNALs in 3 steps, want {} ({remote} peers off this host)",
                        6 * remote
                    ));
                }
                comm.finalize().map_err(|e| e.to_string())
            },
        );
        all_ok(res).unwrap_or_else(|e| panic!("{:?} {n} ranks: {e}", s.wire));
    }
}

/// Two objects (two micro-batches) on one communicator: send B's dispatch, run A's experts,
/// send and receive A's combine, receive B's dispatch, combine B; and with A's combine
/// received after B's dispatch. Several steps, both modes.
pub fn moe_two_micro_batches_interleave(s: &Suite) {
    for (n, seed) in [(2usize, 21u64), (3, 22), (4, 23)] {
        let res = run_world(
            n,
            |r| params(s, Duration::from_secs(30), r),
            |comm| {
                for mode in modes() {
                    interleave(&comm, mode, seed).map_err(|e| format!("rank {} {mode:?}: {e}", comm.rank()))?;
                }
                comm.finalize().map_err(|e| e.to_string())
            },
        );
        all_ok(res).unwrap_or_else(|e| panic!("{:?} {n} ranks: {e}", s.wire));
    }
}

fn e(what: &'static str) -> impl Fn(ferroccl::Error) -> String {
    move |err| format!("{what}: {err}")
}

fn interleave(comm: &Communicator, mode: MoeMode, seed: u64) -> Result<(), String> {
    let (me, ranks) = (comm.rank(), comm.size());
    let cfg = MoeConfig { num_experts: 2 * ranks, hidden: 4, top_k: 2, max_tokens_per_rank: 6 };
    let mut a = comm.moe::<f32>(cfg, mode).map_err(|e| e.to_string())?;
    let mut b = comm.moe::<f32>(cfg, mode).map_err(|e| e.to_string())?;
    for step in 0..3u64 {
        let ia: Vec<Input> = (0..ranks).map(|r| input(&cfg, ranks, Pattern::Random, seed, r, 2 * step)).collect();
        let ib: Vec<Input> = (0..ranks).map(|r| input(&cfg, ranks, Pattern::Random, seed, r, 2 * step + 1)).collect();
        let (ma, mb) = (&ia[me], &ib[me]);
        let da = a.dispatch(&ma.x, &ma.idx, &ma.w).map_err(e("A dispatch"))?;
        let pb = b.dispatch_send(&mb.x, &mb.idx, &mb.w).map_err(e("B dispatch_send"))?;
        let ya = experts(comm, &cfg, &ia, &da)?;
        let mut out_a = vec![f32::NAN; ma.x.len()];
        if step % 2 == 0 {
            a.combine(&ya, &da.handle, &mut out_a).map_err(e("A combine"))?;
            let db = pb.recv().map_err(e("B recv"))?;
            check_step(comm, &mut b, &cfg, &ib, db)?;
        } else {
            let pa = a.combine_send(&ya, &da.handle).map_err(e("A combine_send"))?;
            let db = pb.recv().map_err(e("B recv"))?;
            let yb = experts(comm, &cfg, &ib, &db)?;
            let pcb = b.combine_send(&yb, &db.handle).map_err(e("B combine_send"))?;
            pa.recv(&mut out_a).map_err(e("A combine recv"))?;
            let mut out_b = vec![f32::NAN; mb.x.len()];
            pcb.recv(&mut out_b).map_err(e("B combine recv"))?;
            check_out(&cfg, mb, &out_b, mode)?;
        }
        check_out(&cfg, ma, &out_a, mode)?;
    }
    Ok(())
}

/// What a bad rank does wrong.
#[derive(Clone, Copy, Debug)]
enum Fault {
    ExpertOutOfRange,
    TooManyTokens,
    ShortTopkIdx,
    NanWeight,
    Duplicate,
    ShortExpertOut,
}

impl Fault {
    /// Text every rank's error must hold.
    fn says(self) -> &'static str {
        match self {
            Fault::ExpertOutOfRange => "expert index 99 out of range",
            Fault::TooManyTokens => "more than max_tokens_per_rank",
            Fault::ShortTopkIdx => "topk_idx has",
            Fault::NanWeight => "weight is not finite",
            Fault::Duplicate => "twice",
            Fault::ShortExpertOut => "expert_out has",
        }
    }
}

/// Rank 1 passes bad input (in dispatch, or in combine); every rank fails naming rank 1 and
/// the problem, well before the 10 s deadline. In throughput mode the object goes on
/// (every rank failed alike) and the next step is correct.
pub fn moe_bad_input_fails_on_every_rank(s: &Suite) {
    let faults =
        [Fault::ExpertOutOfRange, Fault::TooManyTokens, Fault::ShortTopkIdx, Fault::NanWeight, Fault::Duplicate, Fault::ShortExpertOut];
    let timeout = Duration::from_secs(10);
    let res = run_world(
        3,
        |r| params(s, timeout, r),
        |comm| {
            let me = comm.rank();
            let cfg = MoeConfig { num_experts: 6, hidden: 3, top_k: 2, max_tokens_per_rank: 4 };
            let mut seen = Vec::new();
            for mode in modes() {
                for fault in faults {
                    let mut moe = comm.moe::<f32>(cfg, mode).map_err(|e| format!("rank {me}: setup: {e}"))?;
                    let inputs: Vec<Input> = (0..3).map(|r| input(&cfg, 3, Pattern::Random, 5, r, 0)).collect();
                    let mut x = inputs[me].x.clone();
                    let mut idx = inputs[me].idx.clone();
                    let mut w = inputs[me].w.clone();
                    if me == 1 {
                        match fault {
                            Fault::ExpertOutOfRange => {
                                x = vec![1.0; 6];
                                idx = vec![0, 99, 1, 2];
                                w = vec![1.0; 4];
                            }
                            Fault::TooManyTokens => {
                                x = vec![1.0; 15];
                                idx = [0, 1].repeat(5);
                                w = vec![1.0; 10];
                            }
                            Fault::ShortTopkIdx => idx.push(0),
                            Fault::NanWeight => {
                                x = vec![1.0; 3];
                                idx = vec![0, 1];
                                w = vec![1.0, f32::NAN];
                            }
                            Fault::Duplicate => {
                                x = vec![1.0; 3];
                                idx = vec![4, 4];
                                w = vec![1.0, 1.0];
                            }
                            Fault::ShortExpertOut => {}
                        }
                    }
                    comm.barrier().map_err(|e| format!("rank {me}: barrier: {e}"))?;
                    let t0 = Instant::now();
                    let r = moe.dispatch(&x, &idx, &w).and_then(|d| {
                        let mut y = d.tokens.clone();
                        if me == 1 && matches!(fault, Fault::ShortExpertOut) {
                            y.push(0.0);
                        }
                        let mut out = vec![0f32; x.len()];
                        moe.combine(&y, &d.handle, &mut out)
                    });
                    let after = t0.elapsed();
                    let err = match r {
                        Ok(()) => return Err(format!("rank {me} {mode:?} {fault:?}: no error")),
                        Err(e) => e.to_string(),
                    };
                    let named = me == 1 || err.contains("rank 1");
                    if !named || !err.contains(fault.says()) || err.contains("timed out") {
                        return Err(format!("rank {me} {mode:?} {fault:?}: the error does not name rank 1 and the problem: {err}"));
                    }
                    if s.clocks && after > timeout / 4 {
                        return Err(format!("rank {me} {mode:?} {fault:?}: failed only after {after:?}: {err}"));
                    }
                    if mode == MoeMode::Throughput {
                        // Every rank failed alike: the object goes on.
                        let inp = &inputs[me];
                        let d = moe.dispatch(&inp.x, &inp.idx, &inp.w).map_err(|e| format!("rank {me} {fault:?}: dispatch after: {e}"))?;
                        check_step(&comm, &mut moe, &cfg, &inputs, d).map_err(|e| format!("rank {me} {fault:?}: step after: {e}"))?;
                    }
                    seen.push(err);
                }
            }
            comm.finalize().map_err(|e| e.to_string())?;
            Ok(seen)
        },
    );
    all_ok(res).unwrap_or_else(|e| panic!("{:?}: {e}", s.wire));
}

/// Members with another config fail on every member, which names them; a config that is
/// wrong everywhere (experts not a multiple of the ranks) fails everywhere; calls out of
/// order (combine first, two dispatches) are local errors that send nothing; a combine
/// with another object's handle fails on every rank, naming the rank.
pub fn moe_bad_configs_and_misuse_are_errors(s: &Suite) {
    let timeout = Duration::from_secs(10);
    let res = run_world(
        3,
        |r| params(s, timeout, r),
        |comm| {
            let me = comm.rank();
            let cfg = MoeConfig { num_experts: 6, hidden: 3, top_k: 2, max_tokens_per_rank: 4 };
            for mode in modes() {
                let mine = if me == 2 { MoeConfig { hidden: 5, ..cfg } } else { cfg };
                let t0 = Instant::now();
                match comm.moe::<f32>(mine, mode) {
                    Ok(_) => return Err(format!("rank {me} {mode:?}: mismatched configs accepted")),
                    Err(e) if !e.to_string().contains("members 2 passed") => {
                        return Err(format!("rank {me} {mode:?}: does not name member 2: {e}"))
                    }
                    // Which field, and both values, on every member.
                    Err(e) if !e.to_string().contains("member 2's hidden is 5, member 0's 3") || e.to_string().contains("top_k") => {
                        return Err(format!("rank {me} {mode:?}: does not say that hidden differs (only): {e}"))
                    }
                    Err(_) => {}
                }
                if s.clocks && t0.elapsed() > timeout / 4 {
                    return Err(format!("rank {me}: mismatch found only after {:?}", t0.elapsed()));
                }
                // Another element type is another config too.
                let typed = if me == 0 { comm.moe::<bf16>(cfg, mode).map(|_| ()) } else { comm.moe::<f32>(cfg, mode).map(|_| ()) };
                match typed {
                    Err(e)
                        if e.to_string().contains("members 0 passed")
                            && e.to_string().contains("member 0's element type is bf16, member 1's f32") => {}
                    other => return Err(format!("rank {me} {mode:?}: element types differ, got {other:?}")),
                }
                // Another mode and another top_k on member 1: both fields named.
                let other_mode = if mode == MoeMode::Throughput { MoeMode::LowLatency } else { MoeMode::Throughput };
                let (c1, m1) = if me == 1 { (MoeConfig { top_k: 1, ..cfg }, other_mode) } else { (cfg, mode) };
                match comm.moe::<f32>(c1, m1) {
                    Err(e)
                        if e.to_string().contains("member 1's top_k is 1, member 0's 2")
                            && e.to_string().contains(&format!("member 1's mode is {other_mode:?}, member 0's {mode:?}")) => {}
                    other => return Err(format!("rank {me} {mode:?}: top_k and mode differ on member 1, got {:?}", other.map(|_| ()))),
                }
                match comm.moe::<f32>(MoeConfig { num_experts: 4, ..cfg }, mode) {
                    Err(e) if e.to_string().contains("not a multiple") => {}
                    other => return Err(format!("rank {me} {mode:?}: 4 experts on 3 ranks: {:?}", other.map(|_| ()))),
                }
                let mut moe = comm.moe::<f32>(cfg, mode).map_err(|e| e.to_string())?;
                let handle = {
                    let d = moe.dispatch(&[], &[], &[]).map_err(|e| format!("rank {me}: empty dispatch: {e}"))?;
                    match moe.dispatch(&[], &[], &[]) {
                        Err(e) if e.to_string().contains("alternate") => {}
                        other => return Err(format!("rank {me} {mode:?}: second dispatch: {:?}", other.map(|_| ()))),
                    }
                    let y = d.tokens.clone();
                    moe.combine(&y, &d.handle, &mut []).map_err(|e| format!("rank {me}: empty combine: {e}"))?;
                    d.handle
                };
                match moe.combine(&[], &handle, &mut []) {
                    Err(e) if e.to_string().contains("alternate") => {}
                    other => return Err(format!("rank {me} {mode:?}: combine without dispatch: {other:?}")),
                }
                // Rank 1 combines with another object's handle: every rank fails naming it;
                // the other object is unharmed.
                let mut other = comm.moe::<f32>(cfg, mode).map_err(|e| e.to_string())?;
                let inputs: Vec<Input> = (0..3).map(|r| input(&cfg, 3, Pattern::Random, 9, r, 0)).collect();
                let inp = &inputs[me];
                let d1 = moe.dispatch(&inp.x, &inp.idx, &inp.w).map_err(|e| format!("rank {me}: dispatch: {e}"))?;
                let d2 = other.dispatch(&inp.x, &inp.idx, &inp.w).map_err(|e| format!("rank {me}: dispatch: {e}"))?;
                let y1 = experts(&comm, &cfg, &inputs, &d1)?;
                let mut out = vec![0f32; inp.x.len()];
                let h = if me == 1 { &d2.handle } else { &d1.handle };
                match moe.combine(&y1, h, &mut out) {
                    Err(e) if e.to_string().contains("handle is not") && (me == 1 || e.to_string().contains("rank 1")) => {}
                    other => return Err(format!("rank {me} {mode:?}: combine with a foreign handle: {other:?}")),
                }
                check_step(&comm, &mut other, &cfg, &inputs, d2).map_err(|e| format!("rank {me} {mode:?}: other object: {e}"))?;
            }
            comm.finalize().map_err(|e| e.to_string())
        },
    );
    all_ok(res).unwrap_or_else(|e| panic!("{:?}: {e}", s.wire));
}
