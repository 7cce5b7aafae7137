//! `ferroccl-perf latency`: small-message allreduce latency, a blocking call against a
//! persistent plan, alternating in one run (see [`HELP`]).

use std::time::Instant;

use ferroccl::{Communicator, ReduceOp};

use crate::args::{parse_size, ArgError};
use crate::sub::{self, Common};
use crate::Failure;

/// `ferroccl-perf latency --help`.
pub const HELP: &str = "\
ferroccl-perf latency: small-message allreduce latency, blocking call vs persistent plan

usage: ferroccl-perf latency [--sizes 8,4K] [-n ITERS] [-w WARMUP] [--batches B] [--raw]
                             [--ranks N | under ferroccl-run -n N --] [--transport T]

Allreduce of f32, sum, in place, two ways in one run:
  blocking   comm.allreduce(&mut buf, ReduceOp::Sum)
  plan       comm.allreduce_plan(&mut buf, ReduceOp::Sum) built once per size, then
             plan.run() per call
For each size: one checked call of each (every rank's input is rank + 1; the sum must be
n(n+1)/2), WARMUP calls of each, then B batches per mode, alternating batch by batch
(blocking first in even batches, plan first in odd ones; the machine's speed drifts). A
batch is a barrier and ITERS timed calls; its time per call is the slowest rank's.

options:
  --sizes LIST      comma-separated sizes in bytes (K, M suffixes; default 8,4K)
  -n ITERS          timed calls per batch (default 200)
  -w WARMUP         untimed calls of each mode before the batches (default 50)
  --batches B       batches per mode (default 10)
  --raw             also print every batch as \"#batch SIZE MODE US\" (benches/latency.sh
                    collects these)
  --ranks N         start N local ranks (no launcher needed)
  --transport T     auto, shm, tcp (FERROCCL_TRANSPORT for this run)

output (rank 0): per size and mode the median, min and max over the batches of the time
per call in microseconds, and plan/blocking (median over median). Its peer for MPI is
benches/peers/mpi_latency.c; benches/latency.sh runs both, alternating.
exit status: 0 success; 1 a call failed or a checked result was wrong; 2 bad arguments.
";

/// `ferroccl-perf latency`'s options.
#[derive(Clone, Debug, PartialEq)]
pub struct LatencyOptions {
    /// `--sizes`, in bytes.
    pub sizes: Vec<usize>,
    /// `-n`.
    pub iters: usize,
    /// `-w`.
    pub warmup: usize,
    /// `--batches`.
    pub batches: usize,
    /// `--raw`.
    pub raw: bool,
    /// `--ranks`, `--transport`.
    pub common: Common,
}

/// Parses the arguments after `latency`; `Ok(None)` for `--help`.
pub fn parse(args: &[String]) -> Result<Option<LatencyOptions>, ArgError> {
    let Some(flags) = sub::flags(args, &["--sizes", "-n", "-w", "--batches", "--ranks", "--transport"], &["--raw"])? else {
        return Ok(None);
    };
    let mut o = LatencyOptions { sizes: vec![8, 4096], iters: 200, warmup: 50, batches: 10, raw: false, common: Common::default() };
    for f in &flags {
        if o.common.take(f)? {
            continue;
        }
        let v = f.1.as_deref().unwrap_or("");
        match f.0.as_str() {
            "--sizes" => {
                o.sizes = v
                    .split(',')
                    .map(|s| parse_size(s).filter(|&b| b >= 4))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| sub::bad("--sizes", v, "must be a comma-separated list of sizes of 4 bytes or more, like 8,4K"))?;
            }
            "-n" => o.iters = sub::count("-n", v, 1)?,
            "-w" => o.warmup = sub::count("-w", v, 0)?,
            "--batches" => o.batches = sub::count("--batches", v, 1)?,
            _ => o.raw = true,
        }
    }
    Ok(Some(o))
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
            comm.transport_to((rank + 1) % n).unwrap_or("?")
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
}
