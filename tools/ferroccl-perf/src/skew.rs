//! `ferroccl-perf skew`: a small collective right after CPU-bound work, against the same
//! after a sleep (see its `--help`).

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ferroccl::{Communicator, TransportKind};

use crate::args::{self, parse_size};
use crate::sub::{self, Common};
use crate::Failure;

/// `ferroccl-perf skew`'s usage, printed with every command-line error.
pub const USAGE: &str =
    "usage: ferroccl-perf skew [--work-ms MS] [--size BYTES] [-n ITERS] [--ranks N | under ferroccl-run -n N --] [--transport T]";

/// What `--help` says before the options.
pub(crate) const ABOUT_MORE: &str = "\
Each iteration every rank works MS milliseconds, then calls allgather of BYTES per rank
(f32). Two modes, alternating iteration by iteration:
  compute   the work is CPU-bound (a loop calibrated to MS ms on an idle CPU): with more
            ranks than CPUs, ranks share CPUs and finish their work at different times, and
            the first to arrive wait for the others while those still compute;
  sleep     the work is a sleep of MS ms: every rank arrives at about the same time.
Per iteration it records when each rank entered and left the call (the host's clock, shared
by the ranks). Reported, as medians over the iterations:
  call_us   the call's duration, averaged over the ranks;
  tail_us   from the last rank's arrival to the last rank's return: what the collective
            itself costs once everyone is there. A waiting policy that takes CPU from the ranks
            still computing shows in compute's call_us; one slow to notice arrivals, in tail_us.
  then_sleep, then_compute
            tail_us of the iterations whose call is followed by a sleep, and by CPU-bound
            work: with more ranks than CPUs, the ranks that return first and start computing
            hold the CPUs that the others need to return (a scheduler's time slice, ~1-2
            ms); then_sleep is the collective's own tail.";

/// What `--help` says first.
pub(crate) const ABOUT: &str = "ferroccl-perf skew: a small collective after CPU-bound work vs after a sleep";

/// What `--help` says after the options.
pub(crate) const AFTER_HELP: &str = "exit status: 0 success; 1 a call failed or a result was wrong; 2 bad arguments.";

/// `ferroccl-perf skew`'s options (after `ferroccl-perf skew`; clap's [`crate::args::Sub`]).
#[derive(Clone, Debug, PartialEq, clap::Args)]
pub struct SkewOptions {
    /// Work before each call (milliseconds)
    #[arg(long = "work-ms", value_name = "MS", default_value = "2", allow_hyphen_values = true, value_parser = args::seconds)]
    pub work_ms: f64,
    /// Bytes each rank contributes (K, M suffixes; a multiple of 4)
    #[arg(long, value_name = "BYTES", default_value = "64", allow_hyphen_values = true, value_parser = size)]
    pub size: usize,
    /// Iterations per mode
    #[arg(short = 'n', value_name = "ITERS", default_value = "200", allow_hyphen_values = true, value_parser = args::whole::<1>)]
    pub iters: usize,
    /// Also print every iteration: "#iter I MODE" and each rank's arrival and return (us
    /// after the first arrival)
    #[arg(long)]
    pub raw: bool,
    /// `--ranks`, `--transport`, `--no-bind`: the options every subcommand shares, parsed
    /// once ([`crate::sub::Common`]) and copied here.
    #[arg(skip)]
    pub common: Common,
}

/// `--size`: a size in bytes, 4 or more.
fn size(v: &str) -> Result<usize, args::Expected> {
    parse_size(v).filter(|&b| b >= 4).ok_or_else(|| args::Expected("must be a size in bytes (K, M suffixes), 4 or more".into()))
}

fn now_us() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64() * 1e6)
}

/// CPU-bound work: `rounds` of a dependent multiply-add chain.
fn spin_work(rounds: u64) -> u64 {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for i in 0..rounds {
        x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(i);
    }
    std::hint::black_box(x)
}

/// Rounds of [`spin_work`] that take `ms` on this CPU now.
fn calibrate(ms: f64) -> u64 {
    let probe = 1_000_000u64;
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        spin_work(probe);
        best = best.min(t.elapsed().as_secs_f64());
    }
    ((ms / 1e3) / best.max(1e-9) * probe as f64) as u64
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// One rank of `ferroccl-perf skew`.
pub fn run(o: &SkewOptions) -> Result<(), Failure> {
    let comm: Communicator = o.common.init()?;
    let (rank, n) = (comm.rank(), comm.size());
    let count = (o.size / 4).max(1);
    let rounds = calibrate(o.work_ms);
    let send: Vec<f32> = vec![rank as f32; count];
    let mut recv = vec![0f32; count * n];
    // (arrive, leave) per mode and iteration.
    let mut times: [Vec<(f64, f64)>; 2] = [Vec::with_capacity(o.iters), Vec::with_capacity(o.iters)];
    let mut wrong = 0usize;
    for warm in 0..10 {
        comm.allgather_into(&send, &mut recv).map_err(sub::fail(&comm, format!("warm-up allgather {warm}")))?;
    }
    comm.barrier().map_err(sub::fail(&comm, "barrier"))?;
    for i in 0..o.iters {
        for m in if i % 2 == 0 { [0, 1] } else { [1, 0] } {
            if m == 0 {
                spin_work(rounds);
            } else {
                std::thread::sleep(Duration::from_secs_f64(o.work_ms / 1e3));
            }
            let a = now_us();
            comm.allgather_into(&send, &mut recv).map_err(|e| sub::fail(&comm, format!("allgather {i}"))(e))?;
            times[m].push((a, now_us()));
            wrong += (0..n).filter(|&q| recv[q * count..(q + 1) * count].iter().any(|&x| x != q as f32)).count();
        }
    }
    // Every rank's times to rank 0, one iteration at a time (4 values per message).
    let mut per_iter: Vec<Vec<[f64; 4]>> = Vec::new();
    for (c, s) in times[0].iter().zip(&times[1]) {
        let mine = [c.0, c.1, s.0, s.1];
        if let Some(all) = crate::bench::gather(&comm, &mine).map_err(sub::fail(&comm, "collecting the times"))? {
            per_iter.push(all);
        }
    }
    let wrong = sub::max_over_ranks(&comm, wrong as f64)? as u64;
    if rank == 0 {
        println!(
            "# ferroccl-perf skew: {n} ranks, transport {}, {} CPUs, allgather {} B per rank after {} ms of work, {} iterations per mode",
            comm.transport_to((rank + 1) % n).map_or("self", TransportKind::name),
            std::thread::available_parallelism().map_or(0, usize::from),
            count * 4,
            o.work_ms,
            o.iters
        );
        if o.raw {
            for (i, all) in per_iter.iter().enumerate() {
                for (m, name) in [(0, "compute"), (1, "sleep")] {
                    let first = all.iter().map(|r| r[2 * m]).fold(f64::MAX, f64::min);
                    let ranks: Vec<String> = all.iter().map(|r| format!("{:.0}-{:.0}", r[2 * m] - first, r[2 * m + 1] - first)).collect();
                    println!("#iter {i} {name} {}", ranks.join(" "));
                }
            }
        }
        println!("#   mode   call_us   tail_us  then_sleep  then_compute");
        for (m, name) in [(0, "compute"), (1, "sleep")] {
            let (mut call, mut tail) = (Vec::new(), Vec::new());
            // Even iterations run compute, sleep; odd ones sleep, compute: so both calls of
            // an even iteration are followed by a sleep, both of an odd one by compute.
            let mut then: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
            for (i, all) in per_iter.iter().enumerate() {
                let (a, l) = (2 * m, 2 * m + 1);
                call.push(all.iter().map(|r| r[l] - r[a]).sum::<f64>() / n as f64);
                let last_in = all.iter().map(|r| r[a]).fold(f64::MIN, f64::max);
                let last_out = all.iter().map(|r| r[l]).fold(f64::MIN, f64::max);
                tail.push(last_out - last_in);
                then[i % 2].push(last_out - last_in);
            }
            println!(
                "{name:>9} {:>9.1} {:>9.1} {:>11.1} {:>13.1}",
                median(&mut call),
                median(&mut tail),
                median(&mut then[0]),
                median(&mut then[1])
            );
        }
        println!("# wrong blocks: {wrong}{}", if wrong == 0 { " OK" } else { "" });
    }
    sub::finish(comm, wrong)
}
