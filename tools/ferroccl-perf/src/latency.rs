//! `ferroccl-perf latency`: small-message allreduce latency, a blocking call against a
//! persistent plan, alternating in one run (see [`help`]).

use std::time::Instant;

use clap::CommandFactory;
use ferroccl::{Communicator, ReduceOp, TransportKind};

use crate::args::{self, parse_size, ArgError, Expected};
use crate::sub::{self, Common};
use crate::Failure;

/// `ferroccl-perf latency`'s usage, printed with every command-line error.
pub const USAGE: &str = "usage: ferroccl-perf latency [--sizes 8,4K] [-n ITERS] [-w WARMUP] [--batches B] [--raw]
                             [--ranks N | under ferroccl-run -n N --] [--transport T]";

/// What `--help` says before the options.
const ABOUT_MORE: &str = "\
Allreduce of f32, sum, in place, two ways in one run:
  blocking   comm.allreduce(&mut buf, ReduceOp::Sum)
  plan       comm.allreduce_plan(&mut buf, ReduceOp::Sum) built once per size, then
             plan.run() per call
For each size: one checked call of each (every rank's input is rank + 1; the sum must be
n(n+1)/2), WARMUP calls of each, then B batches per mode, alternating batch by batch
(blocking first in even batches, plan first in odd ones; the machine's speed drifts). A
batch is a barrier and ITERS timed calls; its time per call is the slowest rank's.";

/// What `--help` says after the options.
const AFTER_HELP: &str = "\
output (rank 0): per size and mode the median, min and max over the batches of the time
per call in microseconds, and plan/blocking (median over median). Its peer for MPI is
benches/peers/mpi_latency.c; benches/latency.sh runs both, alternating.
exit status: 0 success; 1 a call failed or a checked result was wrong; 2 bad arguments.";

/// `ferroccl-perf latency`'s options (its command line, parsed by clap).
#[derive(Clone, Debug, PartialEq, clap::Parser)]
#[command(
    name = "ferroccl-perf latency",
    about = "ferroccl-perf latency: small-message allreduce latency, blocking call vs persistent plan",
    override_usage = &USAGE["usage: ".len()..],
    before_help = ABOUT_MORE,
    after_help = AFTER_HELP,
    help_template = args::HELP_TEMPLATE,
    args_override_self = true,
    max_term_width = 100
)]
pub struct LatencyOptions {
    /// Comma-separated sizes in bytes (K, M suffixes), 4 or more each
    // The full path keeps clap from taking a `Vec` as a repeated option: the list is one
    // value, parsed by `sizes`.
    #[arg(long, value_name = "LIST", default_value = "8,4K", allow_hyphen_values = true, value_parser = sizes)]
    pub sizes: std::vec::Vec<usize>,
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
    /// `--ranks`, `--transport`.
    #[command(flatten)]
    pub common: Common,
}

/// `--help`.
pub fn help() -> String {
    LatencyOptions::command().render_help().to_string()
}

/// Parses the arguments after `latency`; `Ok(None)` for `--help`.
pub fn parse(args: &[String]) -> Result<Option<LatencyOptions>, ArgError> {
    args::parse_with("ferroccl-perf latency", args)
}

/// `--sizes`: a comma-separated list of sizes, each 4 bytes or more.
fn sizes(v: &str) -> Result<Vec<usize>, Expected> {
    let list = v.split(',').map(|s| parse_size(s).filter(|&b| b >= 4)).collect::<Option<Vec<_>>>();
    list.ok_or_else(|| Expected("must be a comma-separated list of sizes of 4 bytes or more, like 8,4K".into()))
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
        println!(
            "# ferroccl-perf latency: allreduce f32 sum in place, {n} ranks, transport {}",
            comm.transport_to((rank + 1) % n).map_or("self", TransportKind::name)
        );
        println!("#  blocking: comm.allreduce; plan: comm.allreduce_plan once per size, then plan.run()");
        println!(
            "#  {} batches of {} calls per mode (alternating), {} warm-up calls; time per call: the slowest rank's",
            o.batches, o.iters, o.warmup
        );
        println!("#{:>11} {:>12} {:>10} {:>10} {:>10}", "size(B)", "mode", "median_us", "min_us", "max_us");
    }
    let mut wrong = 0usize;
    let mut ratios = Vec::new();
    for &size in &o.sizes {
        let (w, medians) = one_size(&comm, o, size)?;
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

/// Checks, warms up and times one size; returns wrong elements (this rank) and the medians
/// (blocking, plan) in microseconds.
fn one_size(comm: &Communicator, o: &LatencyOptions, size: usize) -> Result<(usize, [f64; 2]), Failure> {
    let (rank, n) = (comm.rank(), comm.size());
    let count = (size / 4).max(1);
    let what = |m: Mode| format!("allreduce {size} B {}", m.name());
    let mut buf = vec![0f32; count];
    let mut pbuf = vec![0f32; count];
    let mut plan = comm.allreduce_plan(&mut pbuf, ReduceOp::Sum).map_err(sub::fail(comm, what(Mode::Plan)))?;
    let want = (n * (n + 1) / 2) as f32;
    let input = (rank + 1) as f32;

    buf.fill(input);
    comm.allreduce(&mut buf, ReduceOp::Sum).map_err(sub::fail(comm, what(Mode::Blocking)))?;
    let mut wrong = buf.iter().filter(|&&x| x != want).count();
    plan.output_mut().fill(input);
    plan.run().map_err(sub::fail(comm, what(Mode::Plan)))?;
    wrong += plan.output().iter().filter(|&&x| x != want).count();
    buf.fill(0.0);
    plan.output_mut().fill(0.0);

    let mut call = |m: Mode, buf: &mut [f32]| -> Result<(), Failure> {
        match m {
            Mode::Blocking => comm.allreduce(buf, ReduceOp::Sum),
            Mode::Plan => plan.run(),
        }
        .map_err(sub::fail(comm, what(m)))
    };
    for m in [Mode::Blocking, Mode::Plan] {
        for _ in 0..o.warmup {
            call(m, &mut buf)?;
        }
    }
    let mut times: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    for b in 0..o.batches {
        let order = if b % 2 == 0 { [Mode::Blocking, Mode::Plan] } else { [Mode::Plan, Mode::Blocking] };
        for m in order {
            comm.barrier().map_err(sub::fail(comm, "barrier"))?;
            let t0 = Instant::now();
            for _ in 0..o.iters {
                call(m, &mut buf)?;
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
    Ok((wrong, medians))
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(parse(&s(&["-n"])), Err(ArgError::MissingValue("-n".into())));
        assert_eq!(parse(&s(&["--raw=1"])), Err(ArgError::UnknownOption("--raw=1".into())));
        assert!(parse(&s(&["--transport", "pigeon"])).is_err());
        assert!(super::help().contains("allreduce_plan"));
    }
}
