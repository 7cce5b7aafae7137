//! M->N weight sync (issue 13): the first half of the job's ranks are trainers (M, at least
//! one), the rest inference ranks (N; M != N when the rank count is odd). They hold one toy
//! model of 18 tensors sharded two different ways; every step the trainers write a new
//! version into their shards and publish it, and the inference ranks pull it into theirs
//! through `Communicator::weight_sync` and check every byte.
//!
//! ```text
//! cargo build --release --bins --examples
//! ./target/release/ferroccl-run -n 4 -- ./target/release/examples/weight_sync
//! ./target/release/ferroccl-run -n 3 --transport tcp -- ./target/release/examples/weight_sync 10
//! ```
//!
//! The optional argument is the number of steps (versions), 5 by default. The model mixes
//! bf16 and f32 tensors, replicated, row- and column-sharded ones with uneven shards, and
//! 1-D biases. Element (row, col) of tensor `t` at step `s` is a hash of (t, row, col, s), so
//! a byte from another element, another tensor or another version is caught. Each rank
//! prints what it sent or received per sync and how long the syncs took; rank 0 then prints
//! the routing table's summary. Any wrong byte names the tensor and the element and makes
//! the program exit with status 1; so does a run on fewer than 2 ranks.

use std::ops::Range;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use ferroccl::reshard::{Block, ModelLayout, Placement, TensorLayout};
use ferroccl::{Communicator, DType, WeightRole};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("weight_sync example: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `extent` split into `parts` uneven shards (weights 1, 2, 3, ...; the last takes the
/// rest), e.g. 100 in 2: [33, 67]. One part gets everything.
fn uneven(extent: usize, parts: usize) -> Vec<usize> {
    let total: usize = (1..=parts).sum();
    let mut sizes: Vec<usize> = (1..=parts).map(|w| extent * w / total).collect();
    let given: usize = sizes[..parts - 1].iter().sum();
    sizes[parts - 1] = extent - given;
    sizes
}

/// `extent` split into `parts` near-equal shards (the first ones one larger).
fn even(extent: usize, parts: usize) -> Vec<usize> {
    (0..parts).map(|i| extent / parts + usize::from(i < extent % parts)).collect()
}

/// How a tensor is placed on one group.
#[derive(Clone, Copy)]
enum How {
    Replicated,
    Rows,
    Cols,
    UnevenRows,
    UnevenCols,
}

fn place(how: How, [rows, cols]: [usize; 2], ranks: usize) -> Placement {
    match how {
        How::Replicated => Placement::replicated(ranks),
        How::Rows => Placement::rows(&even(rows, ranks)),
        How::Cols => Placement::cols(&even(cols, ranks)),
        How::UnevenRows => Placement::rows(&uneven(rows, ranks)),
        How::UnevenCols => Placement::cols(&uneven(cols, ranks)),
    }
}

/// The toy model: (name, dtype, [rows, cols], placement on the trainers, on the inference
/// ranks). A `[n, 1]` shape is a 1-D vector (row-sharded as a column), a `[1, n]` one a 1-D
/// row (column-sharded).
fn model() -> Vec<(String, DType, [usize; 2], How, How)> {
    use How::*;
    let mut m = vec![("embed.weight".to_string(), DType::Bf16, [1000, 96], UnevenRows, Rows)];
    for l in 0..3 {
        let p = |s: &str| format!("layers.{l}.{s}");
        m.push((p("attn.qkv.weight"), DType::Bf16, [384, 128], Rows, Cols));
        m.push((p("attn.qkv.bias"), DType::F32, [384, 1], Rows, Replicated));
        m.push((p("attn.out.weight"), DType::Bf16, [128, 128], Cols, UnevenRows));
        m.push((p("mlp.up.weight"), DType::F32, [512, 128], Replicated, UnevenCols));
        m.push((p("mlp.up.bias"), DType::F32, [512, 1], Replicated, UnevenRows));
    }
    m.push(("final_norm.weight".to_string(), DType::F32, [1, 96], UnevenCols, Cols));
    m.push(("lm_head.weight".to_string(), DType::Bf16, [1000, 96], Cols, Replicated));
    m
}

fn layout(ranks: usize, trainers: bool) -> Res<ModelLayout> {
    let tensors = model()
        .into_iter()
        .map(|(name, dtype, shape, on_src, on_dst)| {
            let how = if trainers { on_src } else { on_dst };
            TensorLayout::new(name, dtype, shape, place(how, shape, ranks))
        })
        .collect();
    Ok(ModelLayout::new(ranks, tensors)?)
}

/// A 32-bit hash of (tensor, row, col, step).
fn hash(t: usize, row: usize, col: usize, step: u64) -> u32 {
    let mut x = ((t as u64) << 48) ^ ((row as u64) << 24) ^ (col as u64) ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^= x >> 33;
    x = x.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    x ^= x >> 33;
    (x >> 16) as u32
}

/// The bytes of element (row, col) of tensor `t` at `step`: a finite value in [1, 2) as f32,
/// or as bf16 (an f32 of that value, truncated to its top 16 bits), little endian.
fn element(dtype: DType, t: usize, row: usize, col: usize, step: u64) -> [u8; 4] {
    let bits = 0x3F80_0000 | (hash(t, row, col, step) & 0x007F_FFFF);
    match dtype {
        DType::Bf16 => {
            let b = ((bits >> 16) as u16).to_le_bytes();
            [b[0], b[1], 0, 0]
        }
        _ => bits.to_le_bytes(),
    }
}

/// Calls `f(tensor, row, col, bytes)` for every element `rank` holds in `layout`, `bytes`
/// being where the element lies in the rank's buffer (of `len` bytes).
fn for_each_element(
    layout: &ModelLayout,
    rank: usize,
    len: usize,
    mut f: impl FnMut(usize, usize, usize, Range<usize>) -> Res<()>,
) -> Res<()> {
    for (t, tl) in layout.tensors().iter().enumerate() {
        let (Some(b), Some(off)) = (layout.block(rank, t), layout.offset(rank, t)) else {
            return Err(format!("tensor `{}`: no block or offset for rank {rank}", tl.name()).into());
        };
        let Block { row0, rows, col0, cols } = b;
        let size = tl.dtype().size();
        for r in 0..rows {
            for c in 0..cols {
                let at = off + (r * cols + c) * size;
                if at + size > len {
                    return Err(format!(
                        "tensor `{}`: element ({}, {}) lies outside the buffer of {len} bytes",
                        tl.name(),
                        row0 + r,
                        col0 + c
                    )
                    .into());
                }
                f(t, row0 + r, col0 + c, at..at + size)?;
            }
        }
    }
    Ok(())
}

/// Median and largest of some durations, in milliseconds.
fn stats(v: &mut [Duration]) -> (f64, f64) {
    v.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    match v {
        [] => (0.0, 0.0),
        _ => (ms(v[v.len() / 2]), ms(v[v.len() - 1])),
    }
}

fn kib(bytes: usize) -> String {
    format!("{:.1} KiB", bytes as f64 / 1024.0)
}

fn run() -> Res<()> {
    let steps: u64 = match std::env::args().nth(1) {
        None => 5,
        Some(a) => a
            .parse()
            .ok()
            .filter(|&s| s >= 1)
            .ok_or_else(|| format!("the argument is the number of steps, a whole number >= 1, not {a:?}"))?,
    };
    let comm = Communicator::init()?;
    let (rank, n) = (comm.rank(), comm.size());
    if n < 2 {
        return Err(format!(
            "needs at least 2 ranks (M trainers and N inference ranks), this job has {n}; \
             start it with ferroccl-run -n 4 -- ./target/release/examples/weight_sync"
        )
        .into());
    }
    let m = n / 2;
    let trainers: Vec<usize> = (0..m).collect();
    let inference: Vec<usize> = (m..n).collect();
    let src = layout(m, true)?;
    let dst = layout(n - m, false)?;
    if rank == 0 {
        println!(
            "{} tensors, {m} trainer(s) (ranks 0..{m}) -> {} inference rank(s) (ranks {m}..{n}), {steps} steps",
            src.tensors().len(),
            n - m
        );
    }

    // Once: the routing table (computed by every rank itself), the buffers, the plans.
    let t0 = Instant::now();
    let mut ws = comm.weight_sync(&src, &trainers, &dst, &inference)?;
    let setup = t0.elapsed();
    let mut times = Vec::new();
    for step in 1..=steps {
        match ws.role() {
            WeightRole::Source(i) => {
                // Write this step's weights straight into the registered buffer (waits until
                // the last version was pulled), then publish it.
                let t = Instant::now();
                ws.with_buffer_mut(|buf| {
                    let len = buf.len();
                    for_each_element(&src, i, len, |t, r, c, at| {
                        let bytes = element(src.tensors()[t].dtype(), t, r, c, step);
                        buf[at.clone()].copy_from_slice(&bytes[..at.len()]);
                        Ok(())
                    })
                })??;
                ws.publish(step)?;
                times.push(t.elapsed());
            }
            WeightRole::Destination(j) => {
                let t = Instant::now();
                ws.pull(step)?;
                times.push(t.elapsed());
                // Every byte of every block of this rank, against the expected value.
                ws.with_current(|version, buf| {
                    if version != step {
                        return Err(format!("rank {rank}: pulled version {step}, the front buffer holds {version}").into());
                    }
                    for_each_element(&dst, j, buf.len(), |t, r, c, at| {
                        let tl = &dst.tensors()[t];
                        let want = element(tl.dtype(), t, r, c, step);
                        let got = &buf[at.clone()];
                        if got != &want[..at.len()] {
                            return Err(format!(
                                "rank {rank}: step {step}: tensor `{}` element (row {r}, col {c}) is {got:02x?}, expected {:02x?}",
                                tl.name(),
                                &want[..at.len()]
                            )
                            .into());
                        }
                        Ok(())
                    })
                })??;
            }
            WeightRole::None => {}
        }
    }
    // A trainer keeps its buffer until the last version was pulled.
    if let WeightRole::Source(_) = ws.role() {
        ws.wait_consumed(steps)?;
    }
    let table = ws.routing_table().clone();
    let (med, max) = stats(&mut times);
    match ws.role() {
        WeightRole::Source(i) => println!(
            "rank {rank} (trainer {i}): sends {} per sync in {} pieces; write + publish median {med:.2} ms, max {max:.2} ms; setup {:.1} ms",
            kib(table.bytes_from(i)),
            table.pieces_from(i).count(),
            setup.as_secs_f64() * 1e3
        ),
        WeightRole::Destination(j) => println!(
            "rank {rank} (inference {j}): receives {} per sync in {} pieces; pull median {med:.2} ms, max {max:.2} ms (waits for the trainers' writes included); {steps} versions, every byte checked",
            kib(table.bytes_to(j)),
            table.pieces_to(j).len()
        ),
        WeightRole::None => {}
    }
    drop(ws);
    comm.barrier()?;
    if rank == 0 {
        let strided = table.pieces().iter().filter(|p| !p.is_contiguous()).count();
        println!("routing table: {} pieces ({strided} strided) for {} tensors", table.pieces().len(), src.tensors().len());
        println!("(its ranks are group ranks: trainer i is rank i of the job, inference rank j is rank {m} + j)");
        let explain = table.explain(&src, &dst);
        if let Some(at) = explain.find("per sender") {
            for line in explain[at..].lines() {
                println!("  {line}");
            }
        }
    }
    comm.finalize()?;
    Ok(())
}
