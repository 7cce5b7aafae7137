//! `ferroccl-perf weights`: M->N weight sync of a model of mixed placements
//! (`Communicator::weight_sync`, issue 13) against the memcpy bound and the naive
//! broadcast-every-tensor approach (see its `--help`).

use std::time::Instant;

use ferroccl::reshard::{ModelLayout, Placement, RoutingTable, TensorLayout};
use ferroccl::{Communicator, DType, TransportKind, WeightRole};

use crate::args::{self, parse_size, Expected};
use crate::sub::{self, fail, Common};
use crate::Failure;

/// `ferroccl-perf weights`' usage, printed with every command-line error.
pub const USAGE: &str = "usage: ferroccl-perf weights [--model-bytes BYTES] [--tensors T] [--sources M] [--rounds R] [--iters I] \
[--ranks N | under ferroccl-run -n N --] [--transport T]";

pub(crate) const ABOUT_MORE: &str = "\
The first M ranks of the job (the sources, trainers) hold a model of BYTES in T bf16
tensors; the other N ranks (the destinations, inference) need it sharded another way.
Tensor k is replicated, row-sharded or column-sharded on the sources (k % 3) and
row-sharded, column-sharded or replicated on the destinations ((k / 3) % 3): every
combination. Each round runs three ways, I times each, in the order A B C:
  (a) sync     Communicator::weight_sync, set up once: sources publish(v), destinations
               pull(v) (the routing table replayed by one-sided transfer plans)
  (b) memcpy   the bound: each destination copies, in its own process, as many bytes as it
               receives per sync, from one plain buffer to another
  (c) naive    what one writes without it: for every tensor, rank 0 (which holds the whole
               model) broadcasts the whole tensor to every rank, and each destination
               copies its block out of it (row by row for column shards)
Time of one iteration: every rank enters a barrier, then is timed from the barrier's
return to the end of its part (a source: publish returned; a destination: pull returned,
its copy done, or its last block copied out); the slowest rank's time is the iteration's
(sources' publish does not wait: the last version was acknowledged before the barrier).
GB/s = the bytes every destination receives per sync, summed, / time. Reported per round
(medians of I iterations), then the medians of round 1 and of the other rounds, with
\"x of the memcpy bound\" = memcpy time / sync time and \"naive / sync\" = naive time /
sync time. Once per round (first iteration, outside the timed part) every byte of every
destination's blocks is checked, for (a) against the version just published and for (c)
against rank 0's model; (b) compares its two buffers. The sources write a version's bytes
only before a checked iteration (untimed): the other iterations publish and pull the same
bytes again, which costs the same.";

/// What `--help` says first.
pub(crate) const ABOUT: &str = "ferroccl-perf weights: M->N weight sync vs the memcpy bound vs broadcasting every tensor";

/// What `--help` says after the options.
pub(crate) const AFTER_HELP: &str = "exit status: 0 success; 1 a call failed or a check failed; 2 bad arguments.";

/// `ferroccl-perf weights`' options.
#[derive(Clone, Debug, PartialEq, clap::Args)]
pub struct WeightsOptions {
    /// Bytes of the model (K, M, G suffixes)
    #[arg(long = "model-bytes", value_name = "BYTES", default_value = "256M", allow_hyphen_values = true, value_parser = size)]
    pub model_bytes: usize,
    /// Number of tensors
    #[arg(long, value_name = "T", default_value = "64", allow_hyphen_values = true, value_parser = args::whole::<1>)]
    pub tensors: usize,
    /// Source ranks: the first M ranks of the job (default: half of them, rounded down)
    #[arg(long, value_name = "M", allow_hyphen_values = true, value_parser = args::whole::<1>)]
    pub sources: Option<usize>,
    /// Rounds (each runs A, B, C)
    #[arg(long, value_name = "R", default_value = "5", allow_hyphen_values = true, value_parser = args::whole::<1>)]
    pub rounds: usize,
    /// Iterations of each way per round
    #[arg(long, value_name = "I", default_value = "10", allow_hyphen_values = true, value_parser = args::whole::<1>)]
    pub iters: usize,
    /// `--ranks`, `--transport`, `--no-bind`: the options every subcommand shares, parsed
    /// once ([`crate::sub::Common`]) and copied here.
    #[arg(skip)]
    pub common: Common,
}

fn size(v: &str) -> Result<usize, Expected> {
    parse_size(v).filter(|&b| b >= 2).ok_or_else(|| Expected("must be a size in bytes of 2 or more, like 8M or 256M".into()))
}

/// `extent` in `parts` near-equal shards (the first ones one larger).
fn even(extent: usize, parts: usize) -> Vec<usize> {
    (0..parts).map(|i| extent / parts + usize::from(i < extent % parts)).collect()
}

/// The model's shape per tensor: about `bytes / tensors` bytes of bf16 each, `[rows, cols]`.
fn shape(bytes: usize, tensors: usize) -> [usize; 2] {
    let elems = (bytes / tensors / 2).max(1);
    let cols = match elems {
        e if e >= 2048 * 64 => 2048,
        e if e >= 256 * 16 => 256,
        _ => 1,
    };
    [elems / cols, cols]
}

/// The model on `ranks` ranks: tensor `k` placed by `kind(k)` (0 replicated, 1 rows, 2 cols).
fn layout(o: &WeightsOptions, ranks: usize, kind: impl Fn(usize) -> usize) -> Result<ModelLayout, ferroccl::reshard::ReshardError> {
    let [rows, cols] = shape(o.model_bytes, o.tensors);
    let tensors = (0..o.tensors)
        .map(|k| {
            let p = match kind(k) {
                0 => Placement::replicated(ranks),
                1 => Placement::rows(&even(rows, ranks)),
                _ => Placement::cols(&even(cols, ranks)),
            };
            TensorLayout::new(format!("t{k}"), DType::Bf16, [rows, cols], p)
        })
        .collect();
    ModelLayout::new(ranks, tensors)
}

/// The bf16 bits of element (row, col) of tensor `k` in version `v`.
fn pat(k: usize, row: usize, col: usize, v: u64) -> u16 {
    let x = (k as u64).wrapping_mul(0x9E37_79B9)
        ^ (row as u64).wrapping_mul(0x85EB_CA6B)
        ^ (col as u64).wrapping_mul(0xC2B2_AE35)
        ^ v.wrapping_mul(0x27D4_EB2F);
    (x >> 16) as u16
}

/// Writes version `v` into `rank`'s buffer of `layout`.
fn fill(layout: &ModelLayout, rank: usize, buf: &mut [u8], v: u64) {
    for k in 0..layout.tensors().len() {
        let (Some(b), Some(off)) = (layout.block(rank, k), layout.offset(rank, k)) else { continue };
        for r in 0..b.rows {
            let row = &mut buf[off + r * b.cols * 2..off + (r + 1) * b.cols * 2];
            for (c, e) in row.chunks_exact_mut(2).enumerate() {
                e.copy_from_slice(&pat(k, b.row0 + r, b.col0 + c, v).to_le_bytes());
            }
        }
    }
}

/// The elements of `rank`'s buffer of `layout` that are not version `v`; the first one
/// printed.
fn check(layout: &ModelLayout, rank: usize, buf: &[u8], v: u64, what: &str, me: usize) -> u64 {
    let mut wrong = 0;
    for k in 0..layout.tensors().len() {
        let (Some(b), Some(off)) = (layout.block(rank, k), layout.offset(rank, k)) else {
            wrong += 1;
            continue;
        };
        for r in 0..b.rows {
            let row = &buf[off + r * b.cols * 2..off + (r + 1) * b.cols * 2];
            for (c, e) in row.chunks_exact(2).enumerate() {
                let want = pat(k, b.row0 + r, b.col0 + c, v);
                if e != want.to_le_bytes() {
                    if wrong == 0 {
                        eprintln!(
                            "ferroccl-perf weights: rank {me}: {what}: tensor t{k} element (row {}, col {}) is {:02x?}, expected {:02x?}",
                            b.row0 + r,
                            b.col0 + c,
                            e,
                            want.to_le_bytes()
                        );
                    }
                    wrong += 1;
                }
            }
        }
    }
    wrong
}

/// What one rank keeps for the naive way: rank 0's whole model, a scratch tensor, and a
/// destination's buffer (laid out as the destination layout says).
struct Naive {
    full: Vec<Vec<u8>>,
    scratch: Vec<u8>,
    out: Vec<u8>,
}

/// One naive sync: every tensor broadcast whole from rank 0, each destination copying its
/// block out.
fn naive(comm: &Communicator, dst: &ModelLayout, dst_index: Option<usize>, nv: &mut Naive) -> ferroccl::Result<()> {
    for (k, t) in dst.tensors().iter().enumerate() {
        let [rows, cols] = t.shape();
        let len = rows * cols * 2;
        let buf: &mut [u8] = match nv.full.get_mut(k) {
            Some(full) => full,
            None => &mut nv.scratch[..len],
        };
        comm.broadcast(buf, 0)?;
        let Some(j) = dst_index else { continue };
        let (Some(b), Some(off)) = (dst.block(j, k), dst.offset(j, k)) else { continue };
        let w = b.cols * 2;
        if b.cols == cols {
            let from = b.row0 * cols * 2;
            nv.out[off..off + b.rows * w].copy_from_slice(&buf[from..from + b.rows * w]);
        } else {
            for r in 0..b.rows {
                let from = ((b.row0 + r) * cols + b.col0) * 2;
                nv.out[off + r * w..off + (r + 1) * w].copy_from_slice(&buf[from..from + w]);
            }
        }
    }
    Ok(())
}

/// One rank's run.
pub fn run(o: &WeightsOptions) -> Result<(), Failure> {
    let comm = o.common.init()?;
    let (me, n) = (comm.rank(), comm.size());
    let m = o.sources.unwrap_or(n / 2);
    if n < 2 || m == 0 || m >= n {
        let what = match o.sources {
            Some(s) => format!(
                "--sources {s} needs 1 to {} sources and at least one destination: run with more ranks or fewer sources",
                n.max(2) - 1
            ),
            None => format!("needs at least 2 ranks (sources and destinations), the job has {n}"),
        };
        return Err(Failure::Collective { rank: me, what: "start".into(), source: Box::new(ferroccl::Error::InvalidArgument(what)) });
    }
    let layouts = layout(o, m, |k| k % 3).and_then(|s| layout(o, n - m, |k| [1, 2, 0][(k / 3) % 3]).map(|d| (s, d)));
    let (src, dst) = layouts.map_err(|e| Failure::Collective {
        rank: me,
        what: "building the model's layouts".into(),
        source: Box::new(ferroccl::Error::InvalidArgument(e.to_string())),
    })?;
    let srcs: Vec<usize> = (0..m).collect();
    let dsts: Vec<usize> = (m..n).collect();
    let dst_index = me.checked_sub(m);
    let [rows, cols] = shape(o.model_bytes, o.tensors);
    let tensor_bytes = rows * cols * 2;
    let model = tensor_bytes * o.tensors;

    let mut ws = comm.weight_sync(&src, &srcs, &dst, &dsts).map_err(fail(&comm, "weight_sync setup"))?;
    let table: RoutingTable = ws.routing_table().clone();
    let received: usize = (0..n - m).map(|j| table.bytes_to(j)).sum();
    let mine = dst_index.map_or(0, |j| table.bytes_to(j));
    // (b): two plain buffers of this destination's bytes, touched before any timing.
    let copy_from = vec![0x5au8; mine];
    let mut copy_to = vec![0xa5u8; mine];
    // (c): rank 0 holds the model (version 0), everyone a scratch tensor.
    let mut nv = Naive {
        full: if me == 0 { (0..o.tensors).map(|k| whole_tensor(k, rows, cols)).collect() } else { Vec::new() },
        scratch: vec![0u8; if me == 0 { 0 } else { tensor_bytes }],
        out: vec![0u8; dst_index.and_then(|j| dst.buffer_len(j)).unwrap_or(0)],
    };

    let mut times: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); 3]; o.rounds];
    let mut wrong = 0u64;
    let mut version = 0u64;
    for round in times.iter_mut() {
        // (a) sync, (b) memcpy, (c) naive.
        for (way, way_times) in round.iter_mut().enumerate() {
            for iter in 0..o.iters {
                let checked = iter == 0;
                if way == 0 {
                    version += 1;
                    if let (WeightRole::Source(i), true) = (ws.role(), checked) {
                        ws.with_buffer_mut(|buf| fill(&src, i, buf, version)).map_err(fail(&comm, "writing the sources' buffers"))?;
                    }
                }
                if way == 2 && checked {
                    nv.out.fill(0);
                }
                comm.barrier().map_err(fail(&comm, "barrier"))?;
                let t0 = Instant::now();
                match (way, ws.role()) {
                    (0, WeightRole::Source(_)) => ws.publish(version).map_err(fail(&comm, "publish"))?,
                    (0, WeightRole::Destination(_)) => ws.pull(version).map_err(fail(&comm, "pull"))?,
                    (1, _) => copy_to.copy_from_slice(&copy_from),
                    (2, _) => naive(&comm, &dst, dst_index, &mut nv).map_err(fail(&comm, "naive: broadcast"))?,
                    _ => {}
                }
                let dt = t0.elapsed().as_secs_f64();
                let slowest = sub::max_over_ranks(&comm, dt)?;
                way_times.push(slowest);
                if !checked {
                    continue;
                }
                if let Some(j) = dst_index {
                    wrong += match way {
                        0 => ws
                            .with_current(|v, buf| match v == version {
                                true => check(&dst, j, buf, version, "(a) sync", me),
                                false => {
                                    eprintln!("ferroccl-perf weights: rank {me}: (a) sync: holds version {v}, not {version}");
                                    1
                                }
                            })
                            .map_err(fail(&comm, "reading the pulled version"))?,
                        1 => u64::from(copy_to != copy_from),
                        _ => check(&dst, j, &nv.out, 0, "(c) naive", me),
                    };
                }
            }
        }
    }
    if let WeightRole::Source(_) = ws.role() {
        ws.wait_consumed(version).map_err(fail(&comm, "waiting for the last pull"))?;
    }
    drop(ws);
    comm.barrier().map_err(fail(&comm, "barrier"))?;
    if me == 0 {
        let strided = table.pieces().iter().filter(|p| !p.is_contiguous()).count();
        let most = (0..n - m).map(|j| table.bytes_to(j)).max().unwrap_or(0);
        let transport = comm.transport_to(m).map_or("?", TransportKind::name);
        let info = Info { model, rows, cols, m, n: n - m, received, most, pieces: table.pieces().len(), strided, transport };
        report(o, &info, &mut times);
    }
    sub::finish(comm, wrong)
}

/// Tensor `k`, whole, in version 0 (what rank 0 broadcasts in the naive way).
fn whole_tensor(k: usize, rows: usize, cols: usize) -> Vec<u8> {
    let mut t = vec![0u8; rows * cols * 2];
    for (i, e) in t.chunks_exact_mut(2).enumerate() {
        e.copy_from_slice(&pat(k, i / cols, i % cols, 0).to_le_bytes());
    }
    t
}

struct Info {
    model: usize,
    rows: usize,
    cols: usize,
    m: usize,
    n: usize,
    received: usize,
    most: usize,
    pieces: usize,
    strided: usize,
    transport: &'static str,
}

fn mib(b: usize) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

fn report(o: &WeightsOptions, i: &Info, times: &mut [Vec<Vec<f64>>]) {
    println!(
        "# weights: {} tensors of bf16 [{} x {}] ({:.1} MiB), {} source(s) -> {} destination(s) over {}",
        o.tensors,
        i.rows,
        i.cols,
        mib(i.model),
        i.m,
        i.n,
        i.transport
    );
    println!(
        "# per sync the destinations receive {:.1} MiB in all (at most {:.1} MiB each) in {} pieces ({} strided); {} rounds x {} iterations per way",
        mib(i.received),
        mib(i.most),
        i.pieces,
        i.strided,
        o.rounds,
        o.iters
    );
    println!("# time: barrier, then the slowest rank's time to the end of its part; GB/s = destination bytes / time; medians");
    println!(
        "# {:<6} {:>12} {:>9} {:>14} {:>9} {:>12} {:>9} {:>13} {:>13}",
        "round", "sync ms", "GB/s", "memcpy ms", "GB/s", "naive ms", "GB/s", "x of memcpy", "naive / sync"
    );
    let bytes = i.received as f64;
    let line = |label: &str, med: [f64; 3]| {
        let gbs = |t: f64| bytes / t / 1e9;
        println!(
            "  {:<6} {:>12.3} {:>9.2} {:>14.3} {:>9.2} {:>12.3} {:>9.2} {:>13.3} {:>13.2}",
            label,
            med[0] * 1e3,
            gbs(med[0]),
            med[1] * 1e3,
            gbs(med[1]),
            med[2] * 1e3,
            gbs(med[2]),
            med[1] / med[0],
            med[2] / med[0]
        );
    };
    for (r, t) in times.iter_mut().enumerate() {
        let med = [sub::median(&mut t[0]), sub::median(&mut t[1]), sub::median(&mut t[2])];
        line(&(r + 1).to_string(), med);
    }
    if times.len() > 1 {
        println!("# summary: round 1 alone, then rounds 2..{} together", times.len());
        let first = [sub::median(&mut times[0][0]), sub::median(&mut times[0][1]), sub::median(&mut times[0][2])];
        line("1", first);
        let mut rest: [Vec<f64>; 3] = Default::default();
        for t in &times[1..] {
            for (w, v) in rest.iter_mut().enumerate() {
                v.extend_from_slice(&t[w]);
            }
        }
        let [a, b, c] = &mut rest;
        line(&format!("2..{}", times.len()), [sub::median(a), sub::median(b), sub::median(c)]);
    }
    println!("# x of memcpy = memcpy time / sync time (1.00: the sync runs at the memcpy bound); naive / sync = naive time / sync time");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `ferroccl-perf weights ARGS`; `Ok(None)` for `--help`.
    fn parse(args: &[String]) -> Result<Option<WeightsOptions>, args::ArgError> {
        match args::parse_sub("weights", args)? {
            Some(args::Sub::Weights(o)) => Ok(Some(o)),
            None => Ok(None),
            other => panic!("weights: {other:?}"),
        }
    }

    fn opts(args: &[&str]) -> WeightsOptions {
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        parse(&args).expect("parses").expect("not --help")
    }

    #[test]
    fn defaults_and_shapes() {
        let o = opts(&[]);
        assert_eq!((o.model_bytes, o.tensors, o.sources, o.rounds, o.iters), (256 << 20, 64, None, 5, 10));
        assert_eq!(shape(256 << 20, 64), [1024, 2048]);
        assert_eq!(shape(8 << 20, 64), [256, 256]);
        assert_eq!(shape(100, 64), [1, 1]);
        assert!(parse(&["--model-bytes".to_string(), "1".to_string()]).is_err());
    }

    #[test]
    fn every_placement_pair_routes_and_the_check_catches_a_byte() {
        let o = opts(&["--model-bytes", "1M", "--tensors", "9"]);
        for (m, n) in [(2, 2), (1, 3), (3, 1)] {
            let src = layout(&o, m, |k| k % 3).expect("source layout");
            let dst = layout(&o, n, |k| [1, 2, 0][(k / 3) % 3]).expect("destination layout");
            let table = RoutingTable::compute(&src, &dst).expect("table");
            table.verify(&src, &dst).expect("verified");
            for j in 0..n {
                let mut buf = vec![0u8; dst.buffer_len(j).expect("rank")];
                fill(&dst, j, &mut buf, 7);
                assert_eq!(check(&dst, j, &buf, 7, "test", 0), 0);
                assert!(check(&dst, j, &buf, 8, "test", 0) > 0);
                let at = dst.offset(j, 4).expect("tensor 4");
                buf[at] ^= 1;
                assert_eq!(check(&dst, j, &buf, 7, "test", 0), 1);
            }
        }
    }
}
