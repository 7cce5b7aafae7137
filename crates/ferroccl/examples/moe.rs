//! A mixture-of-experts layer over expert parallelism (issue 16): every rank holds two
//! experts (small MLPs, `relu(x·W1)·W2`) and a batch of tokens; a gate (`softmax(x·Wg)`,
//! top-2, renormalised) routes each token to two experts; `Communicator::moe` dispatches the
//! tokens to the ranks that own their experts, each rank runs its experts over what it
//! received (matrix products by `ndarray`), and combine brings back every token's
//! gate-weighted sum. Each rank checks its output against a reference that runs every
//! expert locally on its own tokens.
//!
//! ```text
//! cargo build --release --bins --examples
//! ./target/release/ferroccl-run -n 4 -- ./target/release/examples/moe
//! ./target/release/ferroccl-run -n 4 -- ./target/release/examples/moe --dtype bf16 --mode low-latency --overlap
//! ```
//!
//! Options: `--dtype f32|bf16` (tokens and expert outputs on the wire in that type; the
//! products in f32), `--mode throughput|low-latency|both` (default both), `--tokens N`
//! per rank (default 24), `--hidden H` (64), `--ffn F` (128), `--steps S` (3), `--overlap`
//! (each step as two micro-batches with two `Moe` objects: dispatch of the second is sent
//! before the first's experts run, and received after the first's combine was sent; the
//! non-blocking forms `dispatch_send` / `combine_send`). Experts: 2 per rank. Tolerance:
//! f32 1e-4 relative (the experts' products group rows differently from the reference);
//! bf16 2^-6 relative to the largest element of the token plus 2^-6 (the tokens and the
//! expert outputs are rounded to bf16, see docs/moe.md). Exit status 1 on a mismatch.

use std::process::ExitCode;
use std::time::Instant;

use ferroccl::moe::{Dispatched, Moe, MoeConfig, MoeFloat, MoeMode};
use ferroccl::{bf16, Communicator};
use ndarray::{s, Array2, ArrayView2};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("moe example: {e}");
            ExitCode::FAILURE
        }
    }
}

struct Opts {
    bf16: bool,
    modes: Vec<MoeMode>,
    tokens: usize,
    hidden: usize,
    ffn: usize,
    steps: usize,
    overlap: bool,
}

fn opts() -> Res<Opts> {
    let mut o = Opts {
        bf16: false,
        modes: vec![MoeMode::Throughput, MoeMode::LowLatency],
        tokens: 24,
        hidden: 64,
        ffn: 128,
        steps: 3,
        overlap: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = |name: &str| args.next().ok_or_else(|| format!("{name} needs a value"));
        let num =
            |v: String, name: &str| v.parse::<usize>().ok().filter(|&n| n > 0).ok_or_else(|| format!("{name} {v}: not a positive number"));
        match a.as_str() {
            "--dtype" => {
                o.bf16 = match val("--dtype")?.as_str() {
                    "f32" => false,
                    "bf16" => true,
                    d => return Err(format!("--dtype {d}: f32 or bf16").into()),
                }
            }
            "--mode" => {
                o.modes = match val("--mode")?.as_str() {
                    "throughput" => vec![MoeMode::Throughput],
                    "low-latency" => vec![MoeMode::LowLatency],
                    "both" => vec![MoeMode::Throughput, MoeMode::LowLatency],
                    m => return Err(format!("--mode {m}: throughput, low-latency or both").into()),
                }
            }
            "--tokens" => o.tokens = num(val("--tokens")?, "--tokens")?,
            "--hidden" => o.hidden = num(val("--hidden")?, "--hidden")?,
            "--ffn" => o.ffn = num(val("--ffn")?, "--ffn")?,
            "--steps" => o.steps = num(val("--steps")?, "--steps")?,
            "--overlap" => o.overlap = true,
            _ => return Err(format!("unknown argument {a:?}").into()),
        }
    }
    Ok(o)
}

/// A deterministic value in [-0.5, 0.5) from `(a, b, c)`: every rank builds the same weights.
fn hash01(a: u64, b: u64, c: u64) -> f32 {
    let mut z = a.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ b.wrapping_mul(0xC2B2_AE3D_27D4_EB4F) ^ c.wrapping_mul(0x1656_67B1_9E37_79F9);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32 - 0.5
}

fn matrix(tag: u64, rows: usize, cols: usize) -> Array2<f32> {
    let scale = 2.0 / (rows as f32).sqrt();
    Array2::from_shape_fn((rows, cols), |(r, c)| hash01(tag, r as u64, c as u64) * scale)
}

/// One expert: `relu(x·W1)·W2`.
struct Expert {
    w1: Array2<f32>,
    w2: Array2<f32>,
}

impl Expert {
    fn new(e: usize, hidden: usize, ffn: usize) -> Expert {
        Expert { w1: matrix(1000 + 2 * e as u64, hidden, ffn), w2: matrix(1001 + 2 * e as u64, ffn, hidden) }
    }

    fn forward(&self, x: ArrayView2<'_, f32>) -> Array2<f32> {
        x.dot(&self.w1).mapv(|v| v.max(0.0)).dot(&self.w2)
    }
}

/// The element type on the wire: f32 or bf16, converted to f32 for the products.
trait Wire: MoeFloat {
    fn from(v: f32) -> Self;
    fn to(self) -> f32;
}
impl Wire for f32 {
    fn from(v: f32) -> Self {
        v
    }
    fn to(self) -> f32 {
        self
    }
}
impl Wire for bf16 {
    fn from(v: f32) -> Self {
        bf16::from_f32(v)
    }
    fn to(self) -> f32 {
        self.to_f32()
    }
}

/// The gate's top-2 experts of each token and their renormalised softmax weights.
fn gate(x: &Array2<f32>, wg: &Array2<f32>) -> (Vec<u32>, Vec<f32>) {
    let logits = x.dot(wg);
    let (mut idx, mut w) = (Vec::new(), Vec::new());
    for row in logits.rows() {
        let mut order: Vec<usize> = (0..row.len()).collect();
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        let (a, b) = (order[0], order[1]);
        // softmax over all, renormalised over the two chosen: only their difference matters.
        let eb = (row[b] - row[a]).exp();
        idx.extend([a as u32, b as u32]);
        w.extend([1.0 / (1.0 + eb), eb / (1.0 + eb)]);
    }
    (idx, w)
}

/// This rank's local experts over what it received, group by group, rounded to `T`.
fn run_experts<T: Wire>(d: &Dispatched<T>, experts: &[Expert], first: usize, hidden: usize) -> Vec<T> {
    let x = Array2::from_shape_fn((d.tokens.len() / hidden, hidden), |(r, c)| d.tokens[r * hidden + c].to());
    let mut y = Vec::with_capacity(d.tokens.len());
    for (i, win) in d.expert_offsets.windows(2).enumerate() {
        let out = experts[first + i].forward(x.slice(s![win[0]..win[1], ..]));
        y.extend(out.iter().map(|&v| T::from(v)));
    }
    y
}

/// One step's tokens on this rank, already as the wire type sees them (rounded to `T`).
fn tokens<T: Wire>(me: usize, step: usize, micro: usize, n: usize, hidden: usize) -> Array2<f32> {
    Array2::from_shape_fn((n, hidden), |(t, h)| {
        T::from(4.0 * hash01(7 + step as u64 * 16 + micro as u64, (me * 100_000 + t) as u64, h as u64)).to()
    })
}

fn run() -> Res<()> {
    let o = opts()?;
    let comm = Communicator::init()?;
    let out = match o.bf16 {
        false => layer::<f32>(&comm, &o),
        true => layer::<bf16>(&comm, &o),
    };
    if let Err(e) = out {
        comm.abort();
        return Err(e);
    }
    comm.finalize()?;
    Ok(())
}

fn layer<T: Wire>(comm: &Communicator, o: &Opts) -> Res<()> {
    let (me, n) = (comm.rank(), comm.size());
    let per_rank = 2;
    let num_experts = per_rank * n;
    if num_experts < 2 {
        return Err("top-2 routing needs at least 2 experts".into());
    }
    let experts: Vec<Expert> = (0..num_experts).map(|e| Expert::new(e, o.hidden, o.ffn)).collect();
    let wg = matrix(77, o.hidden, num_experts);
    let micro = if o.overlap { 2 } else { 1 };
    let cfg = MoeConfig { num_experts, hidden: o.hidden, top_k: 2, max_tokens_per_rank: o.tokens };
    let (tol_rel, tol_abs) = if std::mem::size_of::<T>() == 4 { (1e-4f32, 1e-5f32) } else { (1.0 / 64.0, 1.0 / 64.0) };
    for &mode in &o.modes {
        let mut moes: Vec<Moe<'_, T>> = (0..micro).map(|_| comm.moe::<T>(cfg, mode)).collect::<Result<_, _>>()?;
        let (mut worst, mut comm_time, mut total) = (0f32, 0f64, 0f64);
        for step in 0..o.steps {
            let t_step = Instant::now();
            let xs: Vec<Array2<f32>> = (0..micro).map(|m| tokens::<T>(me, step, m, o.tokens - me % 2, o.hidden)).collect();
            let gates: Vec<(Vec<u32>, Vec<f32>)> = xs.iter().map(|x| gate(x, &wg)).collect();
            let wire: Vec<Vec<T>> = xs.iter().map(|x| x.iter().map(|&v| T::from(v)).collect()).collect();
            let mut outs: Vec<Vec<T>> = wire.iter().map(|w| vec![T::from(0.0); w.len()]).collect();
            let mut in_comm = 0f64;
            if micro == 1 {
                let t = Instant::now();
                let d = moes[0].dispatch(&wire[0], &gates[0].0, &gates[0].1)?;
                in_comm += t.elapsed().as_secs_f64();
                let y = run_experts(&d, &experts, me * per_rank, o.hidden);
                let t = Instant::now();
                moes[0].combine(&y, &d.handle, &mut outs[0])?;
                in_comm += t.elapsed().as_secs_f64();
            } else {
                // Micro-batch B's dispatch is in flight while A's experts run.
                let (a, b) = moes.split_at_mut(1);
                let (outs_a, outs_b) = outs.split_at_mut(1);
                let t = Instant::now();
                let da = a[0].dispatch(&wire[0], &gates[0].0, &gates[0].1)?;
                let pb = b[0].dispatch_send(&wire[1], &gates[1].0, &gates[1].1)?;
                in_comm += t.elapsed().as_secs_f64();
                let ya = run_experts(&da, &experts, me * per_rank, o.hidden);
                let t = Instant::now();
                let ca = a[0].combine_send(&ya, &da.handle)?;
                let db = pb.recv()?;
                in_comm += t.elapsed().as_secs_f64();
                let yb = run_experts(&db, &experts, me * per_rank, o.hidden);
                let t = Instant::now();
                ca.recv(&mut outs_a[0])?;
                b[0].combine(&yb, &db.handle, &mut outs_b[0])?;
                in_comm += t.elapsed().as_secs_f64();
            }
            total += t_step.elapsed().as_secs_f64();
            comm_time += in_comm;
            // The reference: every expert locally, on this rank's own tokens.
            for (m, x) in xs.iter().enumerate() {
                let (idx, w) = &gates[m];
                for t in 0..x.nrows() {
                    let row = x.slice(s![t..t + 1, ..]);
                    let mut want = vec![0f32; o.hidden];
                    for k in 0..2 {
                        let y = experts[idx[2 * t + k] as usize].forward(row);
                        for (h, v) in want.iter_mut().enumerate() {
                            *v += w[2 * t + k] * T::from(y[[0, h]]).to();
                        }
                    }
                    let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
                    for (h, &v) in want.iter().enumerate() {
                        let got = outs[m][t * o.hidden + h].to();
                        let err = (got - v).abs();
                        worst = worst.max(err / (scale + 1.0));
                        if err > tol_rel * scale + tol_abs {
                            return Err(format!(
                                "rank {me}: {mode:?}, step {step}, micro-batch {m}, token {t}, element {h}: got {got}, reference {v} (experts {} and {})",
                                idx[2 * t],
                                idx[2 * t + 1]
                            )
                            .into());
                        }
                    }
                }
            }
        }
        comm.barrier()?;
        if me == 0 {
            println!(
                "moe example: {n} ranks, {num_experts} experts (top-2), {} tokens/rank x {micro} micro-batch(es), hidden {}, ffn {}, {} on the wire, {mode:?}: \
{} steps match the local reference (worst error {:.2e} of the token's scale); {:.0}% of rank 0's step time in dispatch/combine",
                o.tokens,
                o.hidden,
                o.ffn,
                if std::mem::size_of::<T>() == 4 { "f32" } else { "bf16" },
                o.steps,
                worst,
                100.0 * comm_time / total.max(1e-12)
            );
        }
    }
    Ok(())
}
