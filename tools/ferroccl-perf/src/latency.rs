//! `ferroccl-perf latency`: small-message collective latency (allreduce by default), a
//! blocking call against a persistent plan, alternating in one run (see its `--help`).

use std::time::Instant;

use ferroccl::{Communicator, Plan, ReduceOp, TransportKind};
use ferroccl_kernels::bf16;

use crate::args::{self, parse_size, Expected};
use crate::data::Val;
use crate::sub::{self, Common};
use crate::Failure;

/// `ferroccl-perf latency`'s usage, printed with every command-line error.
pub const USAGE: &str = "usage: ferroccl-perf latency [--sizes 8,4K] [--dtype f32|bf16] [--coll C] [-n ITERS] [-w WARMUP]
                             [--batches B] [--raw] [--ranks N | under ferroccl-run -n N --] [--transport T]";

/// What `--help` says before the options.
pub(crate) const ABOUT_MORE: &str = "\
A collective (--coll, default allreduce: sum, in place) of f32 or bf16 (--dtype), two ways
in one run:
  blocking   comm.allreduce(&mut buf, ReduceOp::Sum) (comm.allgather, comm.broadcast,
             comm.reduce_scatter)
  plan       comm.plan(op::allreduce(&mut buf, ReduceOp::Sum)) (op::allgather,
             op::broadcast, op::reduce_scatter) built once per size, then plan.run() per call
Sizes are per-rank buffer sizes: for allgather and reduce_scatter the per-rank block (the
gathered output / the input are n times larger); broadcast's root is rank 0.
For each size: one checked call of each (every rank's input is rank + 1; allreduce and
reduce_scatter must give n(n+1)/2, exact in bf16 up to 22 ranks, allgather block r must be
r + 1, broadcast 1), WARMUP calls of each, then B batches per mode, alternating batch by
batch (blocking first in even batches, plan first in odd ones; the machine's speed drifts).
A batch is a barrier and ITERS timed calls; its time per call is the slowest rank's.";

/// What `--help` says after the options.
pub(crate) const AFTER_HELP: &str = "\
output (rank 0): per size and mode the median, min and max over the batches of the time
per call in microseconds, and plan/blocking (median over median). Its peer for MPI is
benches/peers/mpi_latency.c; benches/latency.sh runs both (Open MPI and MPICH), alternating.
exit status: 0 success; 1 a call failed or a checked result was wrong; 2 bad arguments.";

/// What `--help` says first.
pub(crate) const ABOUT: &str = "ferroccl-perf latency: small-message collective latency, blocking call vs persistent plan";

/// `ferroccl-perf latency`'s options (after `ferroccl-perf latency`; clap's [`crate::args::Sub`]).
#[derive(Clone, Debug, PartialEq, clap::Args)]
pub struct LatencyOptions {
    /// Comma-separated sizes in bytes (K, M suffixes), 4 or more each
    // The full path keeps clap from taking a `Vec` as a repeated option: the list is one
    // value, parsed by `sizes`.
    #[arg(long, value_name = "LIST", default_value = "8,4K", allow_hyphen_values = true, value_parser = sizes)]
    pub sizes: std::vec::Vec<usize>,
    /// Element type: f32 or bf16
    #[arg(long, value_name = "T", default_value = "f32", allow_hyphen_values = true, value_parser = dtype)]
    pub dtype: LatDtype,
    /// Collective: allreduce, allgather, broadcast or reduce_scatter
    #[arg(long, value_name = "C", default_value = "allreduce", allow_hyphen_values = true, value_parser = coll)]
    pub coll: LatColl,
    /// Timed calls per batch
    #[arg(short = 'n', value_name = "ITERS", default_value = "200", allow_hyphen_values = true, value_parser = args::whole::<1>)]
    pub iters: usize,
    /// Untimed calls of each mode before the batches
    #[arg(short = 'w', value_name = "WARMUP", default_value = "50", allow_hyphen_values = true, value_parser = args::whole::<0>)]
    pub warmup: usize,
    /// Batches per mode
    #[arg(long, value_name = "B", default_value = "10", allow_hyphen_values = true, value_parser = args::whole::<1>)]
    pub batches: usize,
    /// Also print every batch as "#batch SIZE MODE US" (benches/latency.sh collects these)
    #[arg(long)]
    pub raw: bool,
    /// `--ranks`, `--transport`, `--no-bind`: the options every subcommand shares, parsed
    /// once ([`crate::sub::Common`]) and copied here.
    #[arg(skip)]
    pub common: Common,
}

/// `--dtype`: the element types `latency` measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LatDtype {
    /// `f32`.
    F32,
    /// `half::bf16` (reduced with f32 accumulation).
    Bf16,
}

impl LatDtype {
    /// The name on the command line and in the output.
    pub const fn name(self) -> &'static str {
        match self {
            LatDtype::F32 => "f32",
            LatDtype::Bf16 => "bf16",
        }
    }
}

/// `--coll`: the collectives `latency` measures (those with a persistent plan).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LatColl {
    /// In-place allreduce, sum.
    AllReduce,
    /// Allgather of a per-rank block (out of place).
    AllGather,
    /// In-place broadcast from rank 0.
    Broadcast,
    /// Reduce-scatter, sum, into a per-rank block (out of place).
    ReduceScatter,
}

impl LatColl {
    /// Every one, in `--coll`'s order.
    pub const ALL: [LatColl; 4] = [LatColl::AllReduce, LatColl::AllGather, LatColl::Broadcast, LatColl::ReduceScatter];

    /// The name on the command line and in the output.
    pub const fn name(self) -> &'static str {
        match self {
            LatColl::AllReduce => "allreduce",
            LatColl::AllGather => "allgather",
            LatColl::Broadcast => "broadcast",
            LatColl::ReduceScatter => "reduce_scatter",
        }
    }

    /// Whether the call works in place on one buffer (no separate input).
    const fn in_place(self) -> bool {
        matches!(self, LatColl::AllReduce | LatColl::Broadcast)
    }

    /// The lengths (input, output) in elements of `count`-element calls on `n` ranks; an
    /// in-place call has no input.
    const fn lens(self, count: usize, n: usize) -> (usize, usize) {
        match self {
            LatColl::AllReduce | LatColl::Broadcast => (0, count),
            LatColl::AllGather => (count, n * count),
            LatColl::ReduceScatter => (n * count, count),
        }
    }

    /// What the header says about the call.
    fn describe(self, dtype: LatDtype) -> String {
        let t = dtype.name();
        match self {
            LatColl::AllReduce => format!("allreduce {t} sum in place"),
            LatColl::AllGather => format!("allgather {t}, size = the per-rank block"),
            LatColl::Broadcast => format!("broadcast {t} from rank 0 in place"),
            LatColl::ReduceScatter => format!("reduce_scatter {t} sum, size = the per-rank block"),
        }
    }
}

/// `--sizes`: a comma-separated list of sizes, each 4 bytes or more.
fn sizes(v: &str) -> Result<Vec<usize>, Expected> {
    let list = v.split(',').map(|s| parse_size(s).filter(|&b| b >= 4)).collect::<Option<Vec<_>>>();
    list.ok_or_else(|| Expected("must be a comma-separated list of sizes of 4 bytes or more, like 8,4K".into()))
}

/// `--dtype`.
fn dtype(v: &str) -> Result<LatDtype, Expected> {
    match v.trim() {
        "f32" => Ok(LatDtype::F32),
        "bf16" => Ok(LatDtype::Bf16),
        _ => Err(Expected("must be f32 or bf16".into())),
    }
}

/// `--coll`.
fn coll(v: &str) -> Result<LatColl, Expected> {
    let v = v.trim();
    LatColl::ALL
        .into_iter()
        .find(|c| c.name() == v)
        .ok_or_else(|| Expected("must be one of allreduce, allgather, broadcast, reduce_scatter".into()))
}

/// The two ways to call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Blocking,
    Plan,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Blocking => "blocking",
            Mode::Plan => "plan",
        }
    }
}

/// One rank of `ferroccl-perf latency`.
pub fn run(o: &LatencyOptions) -> Result<(), Failure> {
    let comm = o.common.init()?;
    let (rank, n) = (comm.rank(), comm.size());
    if rank == 0 {
        let c = o.coll.name();
        println!(
            "# ferroccl-perf latency: {}, {n} ranks, transport {}",
            o.coll.describe(o.dtype),
            comm.transport_to((rank + 1) % n).map_or("self", TransportKind::name)
        );
        println!("#  blocking: comm.{c}; plan: comm.{c}_plan once per size, then plan.run()");
        println!(
            "#  {} batches of {} calls per mode (alternating), {} warm-up calls; time per call: the slowest rank's",
            o.batches, o.iters, o.warmup
        );
        println!("#{:>11} {:>12} {:>10} {:>10} {:>10}", "size(B)", "mode", "median_us", "min_us", "max_us");
    }
    let mut wrong = 0usize;
    let mut ratios = Vec::new();
    for &size in &o.sizes {
        let (w, medians) = match o.dtype {
            LatDtype::F32 => one_size::<f32>(&comm, o, size)?,
            LatDtype::Bf16 => one_size::<bf16>(&comm, o, size)?,
        };
        wrong += w;
        ratios.push((size, medians[1] / medians[0]));
    }
    let wrong = sub::max_over_ranks(&comm, wrong as f64)? as usize;
    if rank == 0 {
        for (size, r) in ratios {
            println!("# {size} B: plan / blocking = {r:.3}");
        }
        println!("# wrong elements: {wrong} {}", if wrong == 0 { "OK" } else { "FAILED" });
    }
    sub::finish(comm, wrong as u64)
}

/// The blocking call of `coll` (`input` is empty for the in-place ones).
fn blocking<T: Val>(comm: &Communicator, coll: LatColl, input: &[T], output: &mut [T]) -> ferroccl::Result<()> {
    match coll {
        LatColl::AllReduce => comm.allreduce(output, ReduceOp::Sum),
        LatColl::AllGather => comm.allgather_into(input, output),
        LatColl::Broadcast => comm.broadcast(output, 0),
        LatColl::ReduceScatter => comm.reduce_scatter_into(input, output, ReduceOp::Sum),
    }
}

/// The plan of `coll` over `input` (unused by the in-place ones) and `output`.
fn plan<'a, T: Val>(comm: &'a Communicator, coll: LatColl, input: &'a mut [T], output: &'a mut [T]) -> ferroccl::Result<Plan<'a, T>> {
    match coll {
        LatColl::AllReduce => comm.plan(ferroccl::op::allreduce(output, ReduceOp::Sum)),
        LatColl::AllGather => comm.plan(ferroccl::op::allgather_into(input, output)),
        LatColl::Broadcast => comm.plan(ferroccl::op::broadcast(output, 0)),
        LatColl::ReduceScatter => comm.plan(ferroccl::op::reduce_scatter_into(input, output, ReduceOp::Sum)),
    }
}

/// The exact result of a checked call on `n` ranks whose inputs are rank + 1.
fn expected<T: Val>(coll: LatColl, n: usize, out_len: usize) -> Vec<T> {
    let sum = T::from_small((n * (n + 1) / 2) as i32);
    match coll {
        LatColl::AllReduce | LatColl::ReduceScatter => vec![sum; out_len],
        LatColl::Broadcast => vec![T::from_small(1); out_len],
        LatColl::AllGather => {
            let block = out_len / n;
            (0..out_len).map(|i| T::from_small((i / block + 1) as i32)).collect()
        }
    }
}

/// How many elements of `got` differ from `want`.
fn wrong<T: Val>(got: &[T], want: &[T]) -> usize {
    got.iter().zip(want).filter(|(g, w)| g != w).count() + got.len().abs_diff(want.len())
}

/// Checks, warms up and times one size; returns wrong elements (this rank) and the medians
/// (blocking, plan) in microseconds.
fn one_size<T: Val>(comm: &Communicator, o: &LatencyOptions, size: usize) -> Result<(usize, [f64; 2]), Failure> {
    let (rank, n) = (comm.rank(), comm.size());
    let coll = o.coll;
    let count = (size / std::mem::size_of::<T>()).max(1);
    let (in_len, out_len) = coll.lens(count, n);
    let what = |m: Mode| format!("{} {size} B {}", coll.name(), m.name());
    let zero = T::from_small(0);
    let (mut input, mut output) = (vec![zero; in_len], vec![zero; out_len]);
    let (mut pinput, mut poutput) = (vec![zero; in_len], vec![zero; out_len]);
    let mut plan = plan(comm, coll, &mut pinput, &mut poutput).map_err(sub::fail(comm, what(Mode::Plan)))?;
    let want = expected::<T>(coll, n, out_len);
    let mine = T::from_small((rank + 1) as i32);

    // The checked calls: every rank's input is rank + 1.
    if coll.in_place() {
        output.fill(mine);
        plan.output_mut().fill(mine);
    } else {
        input.fill(mine);
        plan.input_mut().unwrap_or_default().fill(mine);
    }
    blocking(comm, coll, &input, &mut output).map_err(sub::fail(comm, what(Mode::Blocking)))?;
    let mut bad = wrong(&output, &want);
    plan.run().map_err(sub::fail(comm, what(Mode::Plan)))?;
    bad += wrong(plan.output(), &want);
    input.fill(zero);
    output.fill(zero);
    plan.output_mut().fill(zero);
    plan.input_mut().unwrap_or_default().fill(zero);

    let mut call = |m: Mode, output: &mut [T]| -> Result<(), Failure> {
        match m {
            Mode::Blocking => blocking(comm, coll, &input, output),
            Mode::Plan => plan.run(),
        }
        // The label is formatted only on failure: timed calls must not pay for it.
        .map_err(|e| sub::fail(comm, what(m))(e))
    };
    for m in [Mode::Blocking, Mode::Plan] {
        for _ in 0..o.warmup {
            call(m, &mut output)?;
        }
    }
    let mut times: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    for b in 0..o.batches {
        let order = if b % 2 == 0 { [Mode::Blocking, Mode::Plan] } else { [Mode::Plan, Mode::Blocking] };
        for m in order {
            comm.barrier().map_err(sub::fail(comm, "barrier"))?;
            let t0 = Instant::now();
            for _ in 0..o.iters {
                call(m, &mut output)?;
            }
            let us = t0.elapsed().as_secs_f64() * 1e6 / o.iters as f64;
            let slowest = sub::max_over_ranks(comm, us)?;
            if o.raw && rank == 0 {
                println!("#batch {size} {} {slowest:.3}", m.name());
            }
            times[m as usize].push(slowest);
        }
    }
    let mut medians = [0.0; 2];
    for m in [Mode::Blocking, Mode::Plan] {
        let t = &mut times[m as usize];
        medians[m as usize] = sub::median(t);
        if rank == 0 {
            let (lo, hi) = (t.first().copied().unwrap_or(0.0), t.last().copied().unwrap_or(0.0));
            println!(" {size:>11} {:>12} {:>10.2} {lo:>10.2} {hi:>10.2}", m.name(), medians[m as usize]);
        }
    }
    Ok((bad, medians))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `ferroccl-perf latency --help`.
    fn help() -> String {
        match args::parse(&["latency", "--help"]) {
            Ok(args::Cmd::Help(h)) => h,
            other => panic!("{other:?}"),
        }
    }

    /// `ferroccl-perf latency ARGS`; `Ok(None)` for `--help`.
    fn parse(args: &[String]) -> Result<Option<LatencyOptions>, args::ArgError> {
        match args::parse_sub("latency", args)? {
            Some(args::Sub::Latency(o)) => Ok(Some(o)),
            None => Ok(None),
            other => panic!("latency: {other:?}"),
        }
    }

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn parses_and_names_bad_values() {
        let o = parse(&s(&["--sizes", "8,4K,1M", "-n", "10", "--batches=3", "--raw", "--ranks", "4"])).unwrap().unwrap();
        assert_eq!((o.sizes, o.iters, o.warmup, o.batches, o.raw, o.common.ranks), (vec![8, 4096, 1 << 20], 10, 50, 3, true, Some(4)));
        assert_eq!(parse(&s(&["--help"])), Ok(None));
        let e = parse(&s(&["--sizes", "8,x"])).unwrap_err().to_string();
        assert!(e.contains("--sizes \"8,x\""), "{e}");
        assert!(parse(&s(&["--sizes", "2"])).is_err());
        assert!(parse(&s(&["--batches", "0"])).is_err());
    }

    #[test]
    fn options_switches_and_common_flags() {
        let o = parse(&s(&["-n", "5", "--raw", "--sizes=8,4K", "--ranks", "2", "--transport", "tcp"])).unwrap().unwrap();
        assert_eq!((o.iters, o.raw, o.sizes, o.common.ranks), (5, true, vec![8, 4096], Some(2)));
        assert_eq!(o.common.transport, Some(ferroccl::TransportChoice::Tcp));
        let d = parse(&s(&[])).unwrap().unwrap();
        assert_eq!((d.sizes, d.iters, d.warmup, d.batches, d.raw, d.common), (vec![8, 4096], 200, 50, 10, false, Common::default()));
        assert_eq!(parse(&s(&["-n", "1", "--help"])), Ok(None));
        assert_eq!(parse(&s(&["-n"])), Err(args::ArgError::MissingValue("-n".into())));
        assert_eq!(parse(&s(&["--raw=1"])), Err(args::ArgError::UnknownOption("--raw=1".into())));
        assert!(parse(&s(&["--transport", "pigeon"])).is_err());
        assert!(help().contains("comm.plan(op::allreduce"));
    }

    #[test]
    fn dtype_and_coll() {
        let d = parse(&s(&[])).unwrap().unwrap();
        assert_eq!((d.dtype, d.coll), (LatDtype::F32, LatColl::AllReduce));
        let o = parse(&s(&["--dtype", "bf16", "--coll=allgather", "--sizes", "8"])).unwrap().unwrap();
        assert_eq!((o.dtype, o.coll, o.sizes), (LatDtype::Bf16, LatColl::AllGather, vec![8]));
        for c in LatColl::ALL {
            assert_eq!(parse(&s(&["--coll", c.name()])).unwrap().unwrap().coll, c);
        }
        assert_eq!(parse(&s(&["--dtype", "bf16", "--dtype", "f32"])).unwrap().unwrap().dtype, LatDtype::F32);
        let e = parse(&s(&["--dtype", "f16"])).unwrap_err().to_string();
        assert!(e.contains("--dtype \"f16\"") && e.contains("f32 or bf16"), "{e}");
        let e = parse(&s(&["--coll", "alltoall"])).unwrap_err().to_string();
        assert!(e.contains("--coll \"alltoall\"") && e.contains("reduce_scatter"), "{e}");
        assert_eq!(parse(&s(&["--coll"])), Err(args::ArgError::MissingValue("--coll".into())));
        let h = help();
        for want in ["--dtype", "--coll", "op::reduce_scatter", "per-rank block"] {
            assert!(h.contains(want), "{want}: {h}");
        }
    }

    #[test]
    fn buffer_lengths_and_expected_results() {
        assert_eq!(LatColl::AllReduce.lens(4, 3), (0, 4));
        assert_eq!(LatColl::Broadcast.lens(4, 3), (0, 4));
        assert_eq!(LatColl::AllGather.lens(4, 3), (4, 12));
        assert_eq!(LatColl::ReduceScatter.lens(4, 3), (12, 4));
        assert_eq!(expected::<f32>(LatColl::AllReduce, 4, 2), vec![10.0; 2]);
        assert_eq!(expected::<f32>(LatColl::Broadcast, 4, 2), vec![1.0; 2]);
        assert_eq!(expected::<f32>(LatColl::AllGather, 3, 6), vec![1.0, 1.0, 2.0, 2.0, 3.0, 3.0]);
        // Sums of rank + 1 are exact in bf16 up to 22 ranks (253 <= 256).
        assert_eq!(expected::<bf16>(LatColl::ReduceScatter, 22, 1), vec![bf16::from_f32(253.0)]);
        assert_eq!(wrong(&[1.0f32, 2.0], &[1.0, 3.0]), 1);
        assert_eq!(wrong(&[1.0f32], &[1.0, 3.0]), 1);
    }
}
