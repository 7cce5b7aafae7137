//! `ferroccl-perf overlap`: a training-like step (compute, allreduce the gradients) run
//! sequentially and with the allreduce overlapped with the compute (see its `--help`).

use std::hint::black_box;
use std::time::Instant;

use ferroccl::{Communicator, ReduceOp, TransportKind};

use crate::args::{self, parse_size, Expected};
use crate::sub::{self, Common};
use crate::Failure;

/// `ferroccl-perf overlap`'s usage, printed with every command-line error.
pub const USAGE: &str = "usage: ferroccl-perf overlap [--size 8M] [--compute-ms MS] [-n ITERS] [--batches B]
                             [--ranks N | under ferroccl-run -n N --] [--transport T]";

/// What `--help` says before the options.
pub(crate) const ABOUT_MORE: &str = "\
One iteration computes (a fixed CPU workload on its own 64 KiB buffer, which stays in
cache: arithmetic, not memory traffic) and allreduces a gradient buffer (f32, sum):
  sequential   compute(); comm.allreduce(&mut grads, Sum)
  overlapped   comm.scope(|s| { let r = s.start(op::allreduce(&mut grads, Sum))?; compute(); r.wait() })
In the overlapped form the progress engine's background thread drives the allreduce while
the caller computes, and the caller takes over in r.wait().

Before timing, the compute is sized to last as long as the allreduce alone (fastest of 5,
slowest rank), or --compute-ms; rank 0's pass count is used on every rank. Then B batches
of ITERS iterations of each of four forms, the order rotating every batch: sequential,
overlapped, and the two halves alone (compute only, allreduce only), so that all four see
the same machine states. A batch is a barrier and ITERS iterations, its rate the slowest
rank's. Last, one checked iteration of each allreducing form (inputs rank + 1, sum n(n+1)/2).";

/// What `--help` says after the options.
pub(crate) const AFTER_HELP: &str = "\
output (rank 0): iterations/s of each form (median, min, max over the batches), the ratio
overlapped / sequential (of the medians, and the median of the ratios of the batches run
next to each other), and the ideal ratio with a free core for each thread:
(compute + allreduce) / max(compute, allreduce), from the medians of the halves. Every rank runs two busy threads while
they overlap (compute and progress), so on a machine with fewer cores than 2 x ranks the
gain is bounded, and may be negative.
exit status: 0 success; 1 a call failed or a checked result was wrong; 2 bad arguments.";

/// What `--help` says first.
pub(crate) const ABOUT: &str = "ferroccl-perf overlap: compute + gradient allreduce, sequential vs overlapped";

/// `ferroccl-perf overlap`'s options (after `ferroccl-perf overlap`; clap's [`crate::args::Sub`]).
#[derive(Clone, Debug, PartialEq, clap::Args)]
pub struct OverlapOptions {
    /// Gradient buffer in bytes (K, M suffixes)
    #[arg(long, value_name = "SIZE", default_value = "8M", allow_hyphen_values = true, value_parser = grad_size)]
    pub size: usize,
    /// Compute time per iteration (default: the allreduce's own time)
    #[arg(long, value_name = "MS", allow_hyphen_values = true, value_parser = args::seconds)]
    pub compute_ms: Option<f64>,
    /// Iterations per batch
    #[arg(short = 'n', value_name = "ITERS", default_value = "10", allow_hyphen_values = true, value_parser = args::whole::<1>)]
    pub iters: usize,
    /// Batches per form
    #[arg(long, value_name = "B", default_value = "6", allow_hyphen_values = true, value_parser = args::whole::<1>)]
    pub batches: usize,
    /// `--ranks`, `--transport`, `--no-bind`: the options every subcommand shares, parsed
    /// once ([`crate::sub::Common`]) and copied here.
    #[arg(skip)]
    pub common: Common,
}

/// `--size`: 4 bytes or more.
fn grad_size(v: &str) -> Result<usize, Expected> {
    parse_size(v).filter(|&b| b >= 4).ok_or_else(|| Expected("must be a size of 4 bytes or more, like 8M".into()))
}

/// Elements of the compute's buffer: 64 KiB of f32.
const WORK: usize = 16 << 10;

/// The compute: `passes` passes of arithmetic over `work`.
fn compute(work: &mut [f32], passes: usize) {
    for _ in 0..black_box(passes) {
        for x in work.iter_mut() {
            *x = *x * 0.999_9 + 0.000_1;
        }
        black_box(&mut *work);
    }
}

/// The forms of an iteration: the two compared, and their two halves alone (timed in the
/// same batches, so that the ideal is computed from the same machine state).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Form {
    Sequential,
    Overlapped,
    ComputeOnly,
    AllreduceOnly,
}

impl Form {
    const ALL: [Form; 4] = [Form::Sequential, Form::Overlapped, Form::ComputeOnly, Form::AllreduceOnly];

    fn name(self) -> &'static str {
        match self {
            Form::Sequential => "sequential",
            Form::Overlapped => "overlapped",
            Form::ComputeOnly => "compute only",
            Form::AllreduceOnly => "allreduce only",
        }
    }
}

fn iteration(comm: &Communicator, form: Form, grads: &mut [f32], work: &mut [f32], passes: usize) -> ferroccl::Result<()> {
    match form {
        Form::Sequential => {
            compute(work, passes);
            comm.allreduce(grads, ReduceOp::Sum)
        }
        Form::Overlapped => comm.scope(|s| {
            let r = s.start(ferroccl::op::allreduce(grads, ReduceOp::Sum))?;
            compute(work, passes);
            r.wait()
        }),
        Form::ComputeOnly => {
            compute(work, passes);
            Ok(())
        }
        Form::AllreduceOnly => comm.allreduce(grads, ReduceOp::Sum),
    }
}

/// The fastest of `k` timings of `f` in milliseconds, the slowest rank's.
fn best_ms(comm: &Communicator, k: usize, mut f: impl FnMut() -> Result<(), Failure>) -> Result<f64, Failure> {
    let mut best = f64::INFINITY;
    for _ in 0..k {
        let t0 = Instant::now();
        f()?;
        best = best.min(t0.elapsed().as_secs_f64() * 1e3);
    }
    sub::max_over_ranks(comm, best)
}

/// One rank of `ferroccl-perf overlap`.
pub fn run(o: &OverlapOptions) -> Result<(), Failure> {
    let comm = o.common.init()?;
    let (rank, n) = (comm.rank(), comm.size());
    let count = o.size / 4;
    let mut grads = vec![0f32; count];
    let mut work = vec![1f32; WORK];
    let ar = |g: &mut [f32]| comm.allreduce(g, ReduceOp::Sum).map_err(sub::fail(&comm, format!("allreduce {} B", o.size)));

    // The allreduce alone, and the compute sized to match it (rank 0's count everywhere).
    // Fastest of a few: the machine may be in a slow phase, and both see the same phase.
    ar(&mut grads)?;
    let target_ms = match o.compute_ms {
        Some(ms) => ms,
        None => best_ms(&comm, 5, || ar(&mut grads))?,
    };
    // A few rounds of: time the compute with the current count, scale the count.
    let mut passes = 100.0f64;
    for _ in 0..4 {
        let t = best_ms(&comm, 3, || {
            compute(&mut work, passes as usize);
            Ok(())
        })?;
        passes = (passes * target_ms / t.max(1e-6)).ceil().clamp(1.0, 1e9);
    }
    let mut p = [if rank == 0 { passes } else { 0.0 }];
    comm.broadcast(&mut p, 0).map_err(sub::fail(&comm, "broadcast of the pass count"))?;
    let passes = p[0] as usize;

    if rank == 0 {
        println!(
            "# ferroccl-perf overlap: {n} ranks, transport {}, allreduce {} B f32 sum, nproc {}",
            comm.transport_to((rank + 1) % n).map_or("self", TransportKind::name),
            o.size,
            std::thread::available_parallelism().map_or(0, |p| p.get())
        );
        println!("#  compute: {passes} passes over 64 KiB (sized to {target_ms:.3} ms)");
        println!("#  {} batches of {} iterations per form, the forms rotating; rate: the slowest rank's", o.batches, o.iters);
        println!("#{:>15} {:>12} {:>10} {:>10} {:>10}", "form", "median_it/s", "min", "max", "ms/iter");
    }

    let mut rates: [Vec<f64>; 4] = Default::default();
    for b in 0..o.batches {
        for k in 0..Form::ALL.len() {
            let form = Form::ALL[(b + k) % Form::ALL.len()];
            comm.barrier().map_err(sub::fail(&comm, "barrier"))?;
            let t0 = Instant::now();
            for _ in 0..o.iters {
                iteration(&comm, form, &mut grads, &mut work, passes).map_err(sub::fail(&comm, format!("{} iteration", form.name())))?;
            }
            let secs = sub::max_over_ranks(&comm, t0.elapsed().as_secs_f64())?;
            rates[form as usize].push(o.iters as f64 / secs);
        }
    }
    // Overlapped / sequential batch by batch (neighbours in time), before sorting.
    let mut paired: Vec<f64> = rates[1].iter().zip(&rates[0]).map(|(ov, sq)| ov / sq).collect();

    // One checked iteration of each form that allreduces.
    let want = (n * (n + 1) / 2) as f32;
    let mut wrong = 0;
    for form in [Form::Sequential, Form::Overlapped] {
        grads.fill((rank + 1) as f32);
        iteration(&comm, form, &mut grads, &mut work, passes).map_err(sub::fail(&comm, format!("{} iteration", form.name())))?;
        wrong += grads.iter().filter(|&&x| x != want).count();
    }
    let wrong = sub::max_over_ranks(&comm, wrong as f64)? as u64;

    if rank == 0 {
        let mut med = [0.0; 4];
        for form in Form::ALL {
            let r = &mut rates[form as usize];
            let m = sub::median(r);
            med[form as usize] = m;
            let (lo, hi) = (r.first().copied().unwrap_or(0.0), r.last().copied().unwrap_or(0.0));
            println!(" {:>15} {m:>12.2} {lo:>10.2} {hi:>10.2} {:>10.3}", form.name(), 1e3 / m);
        }
        let (c, a) = (1.0 / med[2], 1.0 / med[3]);
        println!(
            "# overlapped / sequential = {:.3} (medians), {:.3} (median of batch pairs); ideal with a free core per thread: (c + a) / max(c, a) = {:.3}",
            med[1] / med[0],
            sub::median(&mut paired),
            (c + a) / c.max(a)
        );
        println!("# checked iterations: {}", if wrong == 0 { "OK" } else { "WRONG" });
    }
    sub::finish(comm, wrong)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `ferroccl-perf overlap ARGS`; `Ok(None)` for `--help`.
    fn parse(args: &[String]) -> Result<Option<OverlapOptions>, args::ArgError> {
        match args::parse_sub("overlap", args)? {
            Some(args::Sub::Overlap(o)) => Ok(Some(o)),
            None => Ok(None),
            other => panic!("overlap: {other:?}"),
        }
    }

    #[test]
    fn parses_and_names_bad_values() {
        let a: Vec<String> =
            ["--size", "4M", "--compute-ms", "2.5", "-n", "3", "--batches", "2", "--ranks", "2"].iter().map(|s| s.to_string()).collect();
        let o = parse(&a).unwrap().unwrap();
        assert_eq!((o.size, o.compute_ms, o.iters, o.batches, o.common.ranks), (4 << 20, Some(2.5), 3, 2, Some(2)));
        let e = parse(&["--size".to_string(), "2".to_string()]).unwrap_err().to_string();
        assert!(e.contains("--size \"2\""), "{e}");
        let d = parse(&[]).unwrap().unwrap();
        assert_eq!((d.size, d.compute_ms, d.iters, d.batches), (8 << 20, None, 10, 6));
    }

    #[test]
    fn compute_stays_at_its_fixed_point() {
        let mut w = vec![1f32; WORK];
        compute(&mut w, 3);
        assert!(w.iter().all(|x| (*x - 1.0).abs() < 1e-3));
    }
}
