//! One job from start to end: the store and token, spawning the ranks, watching them
//! (failures, the grace period, `--timeout`, signals), and the clean-up.

use std::io::{self, Write};
use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::thread;
use std::time::{Duration, Instant};

use ferroccl::bootstrap::StoreServer;
use nix::sys::signal::Signal;
use signal_hook::iterator::Signals;

use crate::args::Options;
use crate::job::{rank_list, secs, Describe, Job, Stopping, TERM_TO_KILL};
use crate::new_token;
use crate::policy::{self, Failure};
use crate::signals;
use crate::spawn::{resolve_program, spawn_all};

/// Default of `FERROCCL_STORE_MAX_VALUE`: 64 MiB.
pub const DEFAULT_STORE_MAX_VALUE: usize = 64 << 20;

/// Reads `FERROCCL_STORE_MAX_VALUE` through `get` (unset or empty: the default).
fn store_max_value(get: impl Fn(&str) -> Option<String>) -> Result<usize, String> {
    ferroccl::Params::from_lookup(get).map(|p| p.store_max_value).map_err(|e| e.to_string())
}

/// Runs one job to the end and returns the runner's exit status.
pub(crate) fn run(opts: &Options) -> i32 {
    let started = Instant::now();
    let max_value = match store_max_value(|k| std::env::var(k).ok()) {
        Ok(v) => v,
        Err(msg) => {
            say!("ferroccl-run: error: {msg}");
            return 2;
        }
    };
    let path = match resolve_program(&opts.program) {
        Ok(p) => p,
        Err(e) => {
            let code = if e.kind() == io::ErrorKind::PermissionDenied { 126 } else { 127 };
            say!("ferroccl-run: cannot run {}: {e}", opts.program.to_string_lossy());
            return code;
        }
    };
    let token = match new_token() {
        Ok(t) => t,
        Err(e) => {
            say!("ferroccl-run: cannot make a job token: {e}");
            return 1;
        }
    };
    let mut signals = match signals::catch() {
        Ok(s) => s,
        Err(e) => {
            say!("ferroccl-run: cannot install signal handlers: {e}");
            return 1;
        }
    };
    let store = match StoreServer::start(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)), &token, max_value) {
        Ok(s) => s,
        Err(e) => {
            say!("ferroccl-run: cannot start the bootstrap store: {e}");
            signals.handle().close();
            return 1;
        }
    };
    let store_addr = store.addr();
    if opts.verbose {
        say!("ferroccl-run: store at {store_addr}, {} ranks", opts.nranks);
    }

    let mut job = Job {
        ranks: Vec::with_capacity(opts.nranks),
        pumps: Vec::new(),
        verbose: opts.verbose,
        flight: Default::default(),
        stopped: Vec::new(),
        died: Vec::new(),
    };
    let code = match spawn_all(opts, &path, &token, store_addr, &mut job) {
        Ok(()) => monitor(opts, &mut job, &mut signals, started),
        Err(code) => code,
    };
    job.kill_and_reap();
    job.drain_output();
    if code != 0 {
        flight_verdict(&job, started);
    }
    store.shutdown();
    signals.handle().close();
    if opts.verbose {
        say!("ferroccl-run: wall time {} s, exit status {code}", secs(started.elapsed()));
    }
    let _ = io::stdout().flush();
    code
}

/// After a failed job: reads the ranks' flight records (from their stderr, or from the
/// files `FERROCCL_FLIGHT_RECORDER` names, written since the job started) and says, once,
/// where the ranks parted and who is to blame.
fn flight_verdict(job: &Job, started: Instant) {
    let mut text = job.flight.lock().unwrap_or_else(|e| e.into_inner()).join("\n");
    if let Ok(ferroccl::Params { flight_recorder: ferroccl::FlightDest::Files(prefix), .. }) = ferroccl::Params::from_env() {
        let since = std::time::SystemTime::now() - started.elapsed();
        for r in &job.ranks {
            // A rank writes `PREFIX<launch rank>.<pid>` (see `ferroccl::flight`).
            let mut path = prefix.clone().into_os_string();
            path.push(format!("{}.{}", r.rank, r.pid));
            let fresh = std::fs::metadata(&path).and_then(|m| m.modified()).is_ok_and(|t| t >= since);
            if let (true, Ok(s)) = (fresh, std::fs::read_to_string(&path)) {
                text.push('\n');
                text.push_str(&s);
            }
        }
    }
    let records = ferroccl::flight::parse(&text);
    if records.is_empty() {
        return;
    }
    let verdicts = ferroccl::flight::verdict(&records);
    for v in &verdicts {
        say!("ferroccl-run: flight recorder: {v}");
    }
    // The culprits: in each world (the one the job began with, and each one a shrink
    // built), where the ranks' calls diverged (its first communicator's), else the ranks
    // that left no record; ranks are launch ranks, so these are the processes to blame.
    let mut culprits: Vec<usize> = Vec::new();
    let mut worlds: Vec<&str> = Vec::new();
    for v in &verdicts {
        if !worlds.contains(&v.fabric.as_str()) {
            worlds.push(&v.fabric);
        }
    }
    for w in worlds {
        let of_world: Vec<&ferroccl::flight::Verdict> = verdicts.iter().filter(|v| v.fabric == w).collect();
        let blamed = of_world
            .iter()
            .find(|v| v.call.is_some() && !v.culprits.is_empty())
            .or_else(|| of_world.iter().find(|v| !v.culprits.is_empty()));
        for &c in blamed.map_or(&[][..], |v| &v.culprits[..]) {
            if !culprits.contains(&c) {
                culprits.push(c);
            }
        }
    }
    // A process that died where no record can show it (in a shrink, between calls) is
    // named too: a supervisor must replace it.
    if !culprits.is_empty() {
        for &d in &job.died {
            if !culprits.contains(&d) {
                culprits.push(d);
            }
        }
    }
    if !culprits.is_empty() {
        let how: Vec<String> = culprits
            .iter()
            .map(|&c| match job.ranks.iter().find(|r| r.rank == c).and_then(|r| r.status) {
                _ if job.stopped.contains(&c) => format!("rank {c} (still running after the others had failed: stopped by the runner)"),
                Some(st) if !st.success() => format!("rank {c} ({})", Describe(st)),
                _ => format!("rank {c}"),
            })
            .collect();
        say!("ferroccl-run: culprit: {}", how.join(", "));
    }
}

/// Watches the ranks until all have exited; handles failure, timeout and signals.
fn monitor(opts: &Options, job: &mut Job, signals: &mut Signals, started: Instant) -> i32 {
    let poll = if opts.nranks <= 64 { Duration::from_millis(10) } else { Duration::from_millis(20) };
    let deadline = opts.timeout.map(|t| started + t);
    let mut failure: Option<Failure> = None;
    let mut got_signal: Option<i32> = None;
    let mut timed_out = false;
    let mut stopping: Option<Stopping> = None;

    loop {
        for r in job.ranks.iter_mut().filter(|r| r.status.is_none()) {
            let st = match r.child.try_wait() {
                Ok(Some(st)) => st,
                Ok(None) => continue,
                Err(e) => {
                    say!("ferroccl-run: cannot wait for rank {}: {e}", r.rank);
                    ExitStatus::from_raw(1 << 8)
                }
            };
            r.status = Some(st);
            // Once the runner is stopping the job, exits are its own doing.
            if stopping.is_none() && !st.success() {
                say!("ferroccl-run: rank {} {}", r.rank, Describe(st));
                if st.signal().is_some() {
                    job.died.push(r.rank);
                }
                failure = Some(policy::root_cause(failure, Failure { rank: r.rank, status: st, at: Instant::now() }));
            } else if opts.verbose {
                say!("ferroccl-run: rank {} (pid {}) {}", r.rank, r.pid, Describe(st));
            }
        }
        let running = job.running();
        if running.is_empty() {
            break;
        }

        signals::forward(signals, job, &running, &mut got_signal, &mut stopping);

        let now = Instant::now();
        if stopping.is_none() {
            if let Some(Failure { rank: failed, at, .. }) = failure {
                if now >= at + opts.grace {
                    say!(
                        "ferroccl-run: killed ranks {} (still running {} s after rank {failed} failed)",
                        rank_list(&running),
                        secs(opts.grace)
                    );
                    job.begin_stop(&mut stopping, TERM_TO_KILL);
                }
            }
        }
        if stopping.is_none() && deadline.is_some_and(|d| now >= d) {
            timed_out = true;
            say!("ferroccl-run: timeout after {} s; ranks still running: {}", secs(opts.timeout.unwrap_or_default()), rank_list(&running));
            job.begin_stop(&mut stopping, TERM_TO_KILL);
        }
        if let Some(s) = &mut stopping {
            if !s.kill_sent && now >= s.kill_at {
                s.kill_sent = true;
                job.signal_running(Signal::SIGKILL);
            }
        }
        thread::sleep(poll);
    }

    policy::exit_code(got_signal, failure.as_ref(), timed_out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_max_value_from_env() {
        let only = |v: &'static str| move |k: &str| (k == "FERROCCL_STORE_MAX_VALUE").then(|| v.to_string());
        assert_eq!(store_max_value(|_| None), Ok(DEFAULT_STORE_MAX_VALUE));
        assert_eq!(store_max_value(only(" ")), Ok(DEFAULT_STORE_MAX_VALUE));
        assert_eq!(store_max_value(only("1024")), Ok(1024));
        assert!(store_max_value(only("lots")).unwrap_err().contains("FERROCCL_STORE_MAX_VALUE"));
        assert!(store_max_value(only("0")).is_err());
    }
}
