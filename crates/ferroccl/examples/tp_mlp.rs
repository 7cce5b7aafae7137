//! A tensor-parallel MLP forward, as in a decode step (issue 16): `--layers` layers of
//! `x <- x + W2 gelu(W1 x)` over `--tokens` tokens of width `--hidden` (H), the inner width
//! 4H. W1 is column-parallel (rank r holds its H x 4H/tp column block), W2 row-parallel
//! (its 4H/tp x H row block): each rank computes a partial output, and
//! `TensorParallel::row_parallel_reduce` sums them, one allreduce per layer and request.
//!
//! ```text
//! cargo build --release --bins --examples
//! ./target/release/ferroccl-run -n 2 -- ./target/release/examples/tp_mlp
//! ./target/release/ferroccl-run -n 4 -- ./target/release/examples/tp_mlp --dtype bf16 --hidden 1024 --tokens 8 --fused
//! ```
//!
//! Options (defaults in brackets): `--dtype f32|bf16` [f32], `--hidden H` [96], `--tokens T`
//! [2], `--layers L` [2], `--steps S` [5] timed steps after `--warmup W` [2] untimed ones,
//! `--fused` (see below), `--check` / `--no-check` [check], `--seed N` [16].
//!
//! Every token is a request of its own (continuous batching), so a layer has T partial
//! outputs `[1, H]` to sum: without `--fused` they are T blocking allreduces one after the
//! other; with `--fused` one group (`TensorParallel::row_parallel_reduce_many`), which packs
//! them into one message. With one token the two are the same call.
//!
//! Weights and inputs are functions of (seed, layer, matrix, row, column), so every rank
//! generates its own shards and, with `--check`, the full matrices too, and computes the
//! single-rank forward as the reference. The example exits with status 1 if any element
//! of its output differs from the reference by more than `tolerance * max(1, max |ref|)`:
//! 1e-4 for f32 (only the order of the sums differs), 2^-5 for bf16 (the partials are
//! rounded to bf16 before their sum, the reference's sum once after it).
//!
//! bf16: weights are rounded to bf16 (their storage precision) and widened to f32 once when
//! loaded, because the products (`ndarray`, f32) take f32; the activations are rounded to
//! bf16 after every operation, and the allreduce moves and sums bf16.
//!
//! Rank 0 prints, per run, the median time of a decode step per layer over the timed
//! steps, the median time inside the collectives per layer, and their share of the total
//! (the sum over the timed steps of the time inside the collectives over the sum of the
//! step times). Each step starts after a barrier (not timed). The time inside a
//! collective includes waiting for the slowest rank to get there.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use ferroccl::tp::TensorParallel;
use ferroccl::{bf16, Communicator, Element};
use ndarray::Array2;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tp_mlp example: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The command line.
#[derive(Debug, Clone)]
struct Args {
    dtype: String,
    hidden: usize,
    tokens: usize,
    layers: usize,
    steps: usize,
    warmup: usize,
    fused: bool,
    check: bool,
    seed: u64,
}

fn parse() -> Res<Args> {
    let mut a = Args { dtype: "f32".into(), hidden: 96, tokens: 2, layers: 2, steps: 5, warmup: 2, fused: false, check: true, seed: 16 };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = |name: &str| it.next().ok_or_else(|| format!("{name} needs a value"));
        match flag.as_str() {
            "--dtype" => a.dtype = value("--dtype")?,
            "--hidden" => a.hidden = value("--hidden")?.parse()?,
            "--tokens" => a.tokens = value("--tokens")?.parse()?,
            "--layers" => a.layers = value("--layers")?.parse()?,
            "--steps" => a.steps = value("--steps")?.parse()?,
            "--warmup" => a.warmup = value("--warmup")?.parse()?,
            "--seed" => a.seed = value("--seed")?.parse()?,
            "--fused" => a.fused = true,
            "--check" => a.check = true,
            "--no-check" => a.check = false,
            "-h" | "--help" => {
                println!(
                    "tp_mlp [--dtype f32|bf16] [--hidden H] [--tokens T] [--layers L] [--steps S] [--warmup W] [--fused] \
                     [--check|--no-check] [--seed N]"
                );
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other:?} (try --help)").into()),
        }
    }
    if a.hidden == 0 || a.tokens == 0 || a.layers == 0 || a.steps == 0 {
        return Err("--hidden, --tokens, --layers and --steps must be at least 1".into());
    }
    Ok(a)
}

/// The element type of the activations and of the communication.
trait Act: Element + Copy {
    const NAME: &'static str;
    /// The relative tolerance of the check.
    const TOLERANCE: f32;
    fn from_f32(v: f32) -> Self;
    fn to_f32(self) -> f32;
    /// `v` rounded to this type's precision.
    fn round(v: f32) -> f32 {
        Self::from_f32(v).to_f32()
    }
}

impl Act for f32 {
    const NAME: &'static str = "f32";
    const TOLERANCE: f32 = 1e-4;
    fn from_f32(v: f32) -> Self {
        v
    }
    fn to_f32(self) -> f32 {
        self
    }
}

impl Act for bf16 {
    const NAME: &'static str = "bf16";
    const TOLERANCE: f32 = 1.0 / 32.0;
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

fn run() -> Res<()> {
    let args = parse()?;
    let comm = Communicator::init()?;
    match args.dtype.as_str() {
        "f32" => forward::<f32>(&comm, &args)?,
        "bf16" => forward::<bf16>(&comm, &args)?,
        other => return Err(format!("--dtype {other:?}: f32 or bf16").into()),
    }
    comm.finalize()?;
    Ok(())
}

/// A value in [-1, 1) that is a function of its arguments alone (splitmix64).
fn unit(seed: u64, tag: u64, i: usize, j: usize) -> f32 {
    let mut z = seed
        .wrapping_add(tag.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .wrapping_add((i as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F))
        .wrapping_add((j as u64).wrapping_mul(0x1656_67B1_9E37_79F9));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

/// Element (i, j) of matrix `m` (1: W1, H x 4H; 2: W2, 4H x H) of layer `l`, rounded to
/// the storage type; scaled by 1/sqrt(fan-in) so activations stay near 1.
fn weight<A: Act>(seed: u64, l: usize, m: u64, fan_in: usize, i: usize, j: usize) -> f32 {
    A::round(unit(seed, 2 + 2 * l as u64 + m, i, j) / (fan_in as f32).sqrt())
}

/// GELU (tanh approximation).
fn gelu(v: f32) -> f32 {
    0.5 * v * (1.0 + (0.797_884_6 * (v + 0.044_715 * v * v * v)).tanh())
}

/// One layer's weights on this rank, stored transposed so that one token's products are
/// matrix-vector products over contiguous rows (as CPU decode does: a general matrix
/// product with one row repacks the whole weight matrix every call); several tokens use the
/// general product over the transposed view. `w1t` is W1's
/// column block transposed (`ffn/tp x hidden`), `w2t` W2's row block transposed
/// (`hidden x ffn/tp`); f32.
struct Layer {
    w1t: Array2<f32>,
    w2t: Array2<f32>,
}

fn forward<A: Act>(comm: &Communicator, a: &Args) -> Res<()> {
    let tp = TensorParallel::new(comm);
    let (h, t) = (a.hidden, a.tokens);
    let f = 4 * h;
    let cols = tp.column_range(f)?; // this rank's columns of W1 = rows of W2
    let input = Array2::from_shape_fn((t, h), |(i, j)| A::round(unit(a.seed, 1, i, j)));

    // The reference first (full matrices, one rank's forward), so its memory is gone before
    // the shards are made.
    let reference = if a.check {
        let mut x = input.clone();
        for l in 0..a.layers {
            let w1 = Array2::from_shape_fn((h, f), |(i, j)| weight::<A>(a.seed, l, 0, h, i, j));
            let w2 = Array2::from_shape_fn((f, h), |(i, j)| weight::<A>(a.seed, l, 1, f, i, j));
            let mut hid = x.dot(&w1);
            hid.mapv_inplace(|v| A::round(gelu(v)));
            let y = hid.dot(&w2).mapv(A::round);
            x = (&x + &y).mapv(A::round);
        }
        Some(x)
    } else {
        None
    };

    let layers: Vec<Layer> = (0..a.layers)
        .map(|l| Layer {
            w1t: Array2::from_shape_fn((cols.len(), h), |(j, i)| weight::<A>(a.seed, l, 0, h, i, cols.start + j)),
            w2t: Array2::from_shape_fn((h, cols.len()), |(j, i)| weight::<A>(a.seed, l, 1, f, cols.start + i, j)),
        })
        .collect();

    let mut buf = vec![A::from_f32(0.0); t * h];
    let mut samples: Vec<(Duration, Duration)> = Vec::with_capacity(a.steps);
    let mut out = input.clone();
    for step in 0..a.warmup + a.steps {
        comm.barrier()?;
        let start = Instant::now();
        let mut in_comm = Duration::ZERO;
        let mut x = input.clone();
        for layer in &layers {
            if t == 1 {
                // One token: matrix-vector products over the transposed weights' rows.
                let mut hid = layer.w1t.dot(&x.row(0));
                hid.mapv_inplace(|v| A::round(gelu(v)));
                let y = layer.w2t.dot(&hid);
                for (d, v) in buf.iter_mut().zip(y.iter()) {
                    *d = A::from_f32(*v);
                }
            } else {
                // Several: general products (each weight matrix packed once per product).
                let mut hid = x.dot(&layer.w1t.t());
                hid.mapv_inplace(|v| A::round(gelu(v)));
                let y = hid.dot(&layer.w2t.t()); // this rank's partial output [t, h]
                for (d, v) in buf.iter_mut().zip(y.iter()) {
                    *d = A::from_f32(*v);
                }
            }
            let c = Instant::now();
            if a.fused {
                let mut rows: Vec<&mut [A]> = buf.chunks_mut(h).collect();
                tp.row_parallel_reduce_many(&mut rows)?;
            } else {
                for row in buf.chunks_mut(h) {
                    tp.row_parallel_reduce(row, [1, h])?;
                }
            }
            in_comm += c.elapsed();
            for (xv, yv) in x.iter_mut().zip(&buf) {
                *xv = A::round(*xv + yv.to_f32());
            }
        }
        if step >= a.warmup {
            samples.push((start.elapsed(), in_comm));
        }
        out = x;
    }

    let what = format!(
        "tp={} dtype={} hidden={h} ffn={f} tokens={t} layers={} fused={}",
        tp.degree(),
        A::NAME,
        a.layers,
        if a.fused { "yes" } else { "no" }
    );
    if let Some(want) = &reference {
        let scale = want.iter().fold(1.0f32, |m, v| m.max(v.abs()));
        let mut worst = (0.0f32, 0, 0);
        for ((i, j), w) in want.indexed_iter() {
            let e = (out[[i, j]] - w).abs();
            if e > worst.0 || e.is_nan() {
                worst = (e, i, j);
            }
        }
        let tol = A::TOLERANCE * scale;
        if worst.0.is_nan() || worst.0 > tol {
            let (e, i, j) = worst;
            return Err(format!(
                "rank {}: {what}: token {i}, element {j} is {}, the single-rank reference {} (error {e} > tolerance {tol})",
                tp.rank(),
                out[[i, j]],
                want[[i, j]]
            )
            .into());
        }
        if tp.rank() == 0 {
            println!("tp_mlp: {what}: check ok, max |error| {:.3e} <= {tol:.3e} (tolerance {} x {scale:.3})", worst.0, A::TOLERANCE);
        }
    }
    if tp.rank() == 0 {
        let per_layer = |d: Duration| d.as_secs_f64() * 1e6 / a.layers as f64;
        let median = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let total = median(samples.iter().map(|s| per_layer(s.0)).collect());
        let comm_us = median(samples.iter().map(|s| per_layer(s.1)).collect());
        let sum_total: f64 = samples.iter().map(|s| s.0.as_secs_f64()).sum();
        let sum_comm: f64 = samples.iter().map(|s| s.1.as_secs_f64()).sum();
        println!(
            "tp_mlp: {what} steps={}: per layer median {total:.1} us, in collectives {comm_us:.1} us, comm share {:.1}%",
            samples.len(),
            100.0 * sum_comm / sum_total.max(f64::MIN_POSITIVE)
        );
    }
    Ok(())
}
