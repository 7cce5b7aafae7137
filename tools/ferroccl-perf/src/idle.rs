//! `ferroccl-perf idle`: the CPU time a communicator uses while the program does nothing
//! with it (see its `--help`).

use std::time::{Duration, Instant};

use ferroccl::{Communicator, ReduceOp, TransportKind};

use crate::args::{self};
use crate::sub::{self, Common};
use crate::Failure;

/// `ferroccl-perf idle`'s usage, printed with every command-line error.
pub const USAGE: &str = "usage: ferroccl-perf idle [--seconds S] [--ranks N | under ferroccl-run -n N --] [--transport T]";

/// What `--help` says before the options.
pub(crate) const ABOUT_MORE: &str = "\
Each rank joins the job and uses the communicator the ways a program does, so that every
thread it has is running: blocking allreduces (8 B to 1 MiB), non-blocking ones in a scope
(one waited for after test() polls, one dropped, which the background progress thread
drives), and a persistent plan. Then a barrier, and the rank sleeps S seconds without
touching the communicator; afterwards one more allreduce (checked) shows that it still
works.

Measured over the idle period, per rank, from /proc (no root, no tracing):
  cpu_ms     user + system CPU time of the whole process, every thread
             (/proc/self/task/*/schedstat, nanoseconds)
  stat_ms    the same from /proc/self/stat utime + stime (10 ms ticks: a cross-check)
  cpu_%      cpu_ms over the idle wall time, in percent of one core
  wakeups    voluntary + involuntary context switches of every thread
  threads    threads of the process
Every thread is listed on stderr with its own numbers, by name. The main thread's count
includes reading /proc at the end of the period (a fraction of a millisecond). Expect cpu_%
near 0: the progress thread parks when nothing is in flight.";

/// What `--help` says first.
pub(crate) const ABOUT: &str = "ferroccl-perf idle: CPU time an idle communicator uses";

/// What `--help` says after the options.
pub(crate) const AFTER_HELP: &str = "exit status: 0 success; 1 a call failed or the final result was wrong; 2 bad arguments.";

/// `ferroccl-perf idle`'s options (after `ferroccl-perf idle`; clap's [`crate::args::Sub`]).
#[derive(Clone, Debug, PartialEq, clap::Args)]
pub struct IdleOptions {
    /// Idle time
    #[arg(long, value_name = "S", default_value = "5", allow_hyphen_values = true, value_parser = args::seconds)]
    pub seconds: f64,
    /// `--ranks`, `--transport`, `--no-bind`: the options every subcommand shares, parsed
    /// once ([`crate::sub::Common`]) and copied here.
    #[arg(skip)]
    pub common: Common,
}

/// One thread's counters.
#[derive(Clone, Debug, Default, PartialEq)]
struct ThreadCpu {
    tid: u64,
    name: String,
    cpu_ns: u64,
    switches: u64,
}

/// The process's counters at one moment.
#[derive(Clone, Debug, Default)]
struct Snapshot {
    threads: Vec<ThreadCpu>,
    /// utime + stime of /proc/self/stat, in clock ticks.
    ticks: u64,
}

impl Snapshot {
    fn take() -> Snapshot {
        let mut threads = Vec::new();
        if let Ok(dir) = std::fs::read_dir("/proc/self/task") {
            for e in dir.flatten() {
                let Some(tid) = e.file_name().to_str().and_then(|s| s.parse().ok()) else { continue };
                let p = e.path();
                let read = |f: &str| std::fs::read_to_string(p.join(f)).unwrap_or_default();
                let cpu_ns = read("schedstat").split_whitespace().next().and_then(|v| v.parse().ok()).unwrap_or(0);
                let switches = read("status")
                    .lines()
                    .filter(|l| l.starts_with("voluntary_ctxt_switches:") || l.starts_with("nonvoluntary_ctxt_switches:"))
                    .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                    .sum();
                threads.push(ThreadCpu { tid, name: read("comm").trim().to_string(), cpu_ns, switches });
            }
        }
        Snapshot { threads, ticks: stat_ticks(&std::fs::read_to_string("/proc/self/stat").unwrap_or_default()) }
    }
}

/// utime + stime (fields 14 and 15) of a /proc/PID/stat line; the command name in
/// parentheses may hold spaces, so fields are counted after its closing parenthesis.
fn stat_ticks(stat: &str) -> u64 {
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    // After ")": field 3 (state) is the first; utime is field 14, stime 15.
    let f: Vec<&str> = rest.split_whitespace().collect();
    let get = |k: usize| f.get(k - 3).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    get(14) + get(15)
}

/// What changed between two snapshots: per thread (threads that exist at the end; a
/// thread born in between counts from zero), and in total.
fn delta(a: &Snapshot, b: &Snapshot) -> (Vec<ThreadCpu>, u64, u64) {
    let mut out = Vec::new();
    for t in &b.threads {
        let before = a.threads.iter().find(|x| x.tid == t.tid);
        out.push(ThreadCpu {
            tid: t.tid,
            name: t.name.clone(),
            cpu_ns: t.cpu_ns.saturating_sub(before.map_or(0, |x| x.cpu_ns)),
            switches: t.switches.saturating_sub(before.map_or(0, |x| x.switches)),
        });
    }
    let ns = out.iter().map(|t| t.cpu_ns).sum();
    (out, ns, b.ticks.saturating_sub(a.ticks))
}

/// Linux reports /proc times in USER_HZ = 100 ticks per second on every architecture.
const TICK_MS: f64 = 10.0;

/// Uses the communicator every way a program does, so that its threads are running.
fn exercise(comm: &Communicator) -> ferroccl::Result<()> {
    for count in [2usize, 1024, 1 << 18] {
        let mut v = vec![1.0f32; count];
        for _ in 0..3 {
            comm.allreduce(&mut v, ReduceOp::Sum)?;
        }
    }
    let mut a = vec![1.0f32; 1 << 16];
    let mut b = vec![1.0f32; 1 << 10];
    comm.scope(|s| {
        let r = s.start(ferroccl::op::allreduce(&mut a, ReduceOp::Sum))?;
        // Dropped without a wait: the background progress thread drives it.
        drop(s.start(ferroccl::op::allreduce(&mut b, ReduceOp::Sum))?);
        while !r.test()? {
            std::thread::yield_now();
        }
        r.wait()
    })?;
    let mut p = vec![1.0f32; 1024];
    let mut plan = comm.plan(ferroccl::op::allreduce(&mut p, ReduceOp::Sum))?;
    for _ in 0..3 {
        plan.run()?;
    }
    Ok(())
}

/// One rank of `ferroccl-perf idle`.
pub fn run(o: &IdleOptions) -> Result<(), Failure> {
    let comm = o.common.init()?;
    let (rank, n) = (comm.rank(), comm.size());
    exercise(&comm).map_err(sub::fail(&comm, "collectives before the idle period"))?;
    comm.barrier().map_err(sub::fail(&comm, "barrier"))?;

    let before = Snapshot::take();
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(o.seconds));
    let after = Snapshot::take();
    let wall = t0.elapsed().as_secs_f64();

    let (threads, ns, ticks) = delta(&before, &after);
    let switches: u64 = threads.iter().map(|t| t.switches).sum();
    for t in &threads {
        eprintln!(
            "ferroccl-perf idle: rank {rank} thread {:?} (tid {}): {:.3} ms CPU, {} wakeups",
            t.name,
            t.tid,
            t.cpu_ns as f64 / 1e6,
            t.switches
        );
    }

    // Still works, and right.
    let mut v = vec![(rank + 1) as f32; 256];
    comm.allreduce(&mut v, ReduceOp::Sum).map_err(sub::fail(&comm, "allreduce after the idle period"))?;
    let want = (n * (n + 1) / 2) as f32;
    let wrong = v.iter().filter(|&&x| x != want).count();

    let mine = [ns as f64 / 1e6, ticks as f64 * TICK_MS, switches as f64, threads.len() as f64];
    let all = crate::bench::gather(&comm, &mine).map_err(sub::fail(&comm, "collecting the results"))?;
    let wrong = sub::max_over_ranks(&comm, wrong as f64)? as u64;
    if let Some(all) = all {
        println!(
            "# ferroccl-perf idle: {n} ranks, transport {}, idle {:.1} s after blocking, non-blocking and plan calls",
            comm.transport_to((rank + 1) % n).map_or("self", TransportKind::name),
            o.seconds
        );
        println!("#{:>5} {:>8} {:>10} {:>10} {:>8} {:>9} {:>8}", "rank", "idle_s", "cpu_ms", "stat_ms", "cpu_%", "wakeups", "threads");
        for (r, v) in all.iter().enumerate() {
            println!(" {r:>5} {wall:>8.2} {:>10.3} {:>10.0} {:>8.4} {:>9.0} {:>8.0}", v[0], v[1], v[0] / (wall * 1e3) * 100.0, v[2], v[3]);
        }
        let total: f64 = all.iter().map(|v| v[0]).sum();
        println!("# all ranks: {total:.3} ms CPU in {wall:.2} s idle ({:.4} % of one core)", total / (wall * 1e3) * 100.0);
        println!("# after the idle period: allreduce {}", if wrong == 0 { "OK" } else { "WRONG" });
        let _ = std::io::Write::flush(&mut std::io::stdout());
    }
    sub::finish(comm, wrong)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `ferroccl-perf idle ARGS`; `Ok(None)` for `--help`.
    fn parse(args: &[String]) -> Result<Option<IdleOptions>, args::ArgError> {
        match args::parse_sub("idle", args)? {
            Some(args::Sub::Idle(o)) => Ok(Some(o)),
            None => Ok(None),
            other => panic!("idle: {other:?}"),
        }
    }

    #[test]
    fn stat_fields_are_counted_after_the_name() {
        // pid (comm with spaces) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime ...
        let line = "42 (a b) c) S 1 42 42 0 -1 4194560 100 0 0 0 7 5 0 0 20 0 1 0";
        assert_eq!(stat_ticks(line), 12);
        assert_eq!(stat_ticks(""), 0);
    }

    #[test]
    fn the_process_sees_its_own_threads() {
        let s = Snapshot::take();
        assert!(!s.threads.is_empty());
        let t = std::thread::spawn(Snapshot::take);
        let inner = t.join().unwrap();
        assert!(inner.threads.len() >= 2);
        let (d, _, _) = delta(&s, &inner);
        assert_eq!(d.len(), inner.threads.len());
    }

    #[test]
    fn parses_seconds() {
        let o = parse(&["--seconds".to_string(), "0.5".to_string()]).unwrap().unwrap();
        assert_eq!(o.seconds, 0.5);
        assert!(parse(&["--seconds".to_string(), "-1".to_string()]).is_err());
        assert!(parse(&["--bogus".to_string()]).is_err());
    }
}
