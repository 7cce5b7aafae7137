//! The running job: the ranks and output threads the runner started, stopping them, and
//! taking everything down at the end; how the runner words ranks, times and exits.

use std::fmt;
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, ExitStatus};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

/// Between `SIGTERM` and `SIGKILL` when the runner stops ranks after a failure or a timeout.
pub(crate) const TERM_TO_KILL: Duration = Duration::from_secs(1);

/// How long to wait for output streams after every rank has exited.
const DRAIN_WAIT: Duration = Duration::from_secs(3);

/// How a rank ended, as a phrase: "exited with status 3", "was killed by signal SIGKILL (9)".
pub(crate) struct Describe(pub(crate) ExitStatus);

impl fmt::Display for Describe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(code) = self.0.code() {
            write!(f, "exited with status {code}")
        } else if let Some(sig) = self.0.signal() {
            write!(f, "was killed by signal {}", signal_name(sig))?;
            if self.0.core_dumped() {
                write!(f, " (core dumped)")?;
            }
            Ok(())
        } else {
            write!(f, "ended with {:?}", self.0)
        }
    }
}

/// "SIGKILL (9)", or "42" for a signal nix does not name.
pub(crate) fn signal_name(sig: i32) -> String {
    match Signal::try_from(sig) {
        Ok(s) => format!("{} ({sig})", s.as_str()),
        Err(_) => format!("{sig}"),
    }
}

/// "0, 2, 3".
pub(crate) fn rank_list(ranks: &[usize]) -> String {
    ranks.iter().map(usize::to_string).collect::<Vec<_>>().join(", ")
}

/// Seconds as a short decimal: 5, 0.5, 1.25.
pub(crate) fn secs(d: Duration) -> String {
    let s = format!("{:.3}", d.as_secs_f64());
    let s = s.trim_end_matches('0').trim_end_matches('.');
    s.to_string()
}

/// One spawned rank.
#[derive(Debug)]
pub(crate) struct Rank {
    pub(crate) rank: usize,
    pub(crate) pid: i32,
    pub(crate) child: Child,
    pub(crate) status: Option<ExitStatus>,
}

impl Rank {
    /// Signals the rank's whole process group (the rank and what it started).
    fn signal_group(&self, sig: Signal) {
        let _ = killpg(Pid::from_raw(self.pid), sig);
    }
}

/// Everything the runner started that must be taken down at the end.
#[derive(Debug)]
pub(crate) struct Job {
    pub(crate) ranks: Vec<Rank>,
    pub(crate) pumps: Vec<(usize, JoinHandle<()>)>,
    pub(crate) verbose: bool,
    /// Flight-record lines the ranks wrote to stderr.
    pub(crate) flight: crate::output::FlightLines,
    /// Ranks the runner stopped (still running after the grace, or at the timeout).
    pub(crate) stopped: Vec<usize>,
    /// Ranks killed by a signal the runner did not send (SIGKILL from outside, a crash),
    /// in the order they died.
    pub(crate) died: Vec<usize>,
}

/// The runner's decision to stop the ranks still running.
#[derive(Debug)]
pub(crate) struct Stopping {
    pub(crate) kill_at: Instant,
    pub(crate) kill_sent: bool,
}

impl Job {
    pub(crate) fn running(&self) -> Vec<usize> {
        self.ranks.iter().filter(|r| r.status.is_none()).map(|r| r.rank).collect()
    }

    pub(crate) fn signal_running(&self, sig: Signal) {
        for r in self.ranks.iter().filter(|r| r.status.is_none()) {
            r.signal_group(sig);
        }
    }

    /// Sends SIGTERM to the running ranks and schedules SIGKILL `after` from now.
    pub(crate) fn begin_stop(&mut self, stopping: &mut Option<Stopping>, after: Duration) {
        let running = self.running();
        self.stopped.extend(running.iter().filter(|r| !self.stopped.contains(r)).collect::<Vec<_>>());
        self.signal_running(Signal::SIGTERM);
        let kill_at = Instant::now() + after;
        match stopping {
            Some(s) => s.kill_at = s.kill_at.min(kill_at),
            None => *stopping = Some(Stopping { kill_at, kill_sent: false }),
        }
    }

    /// Kills whatever is still running, reaps every rank, and cleans up what the ranks
    /// left in their process groups. Used on every way out once ranks were spawned.
    pub(crate) fn kill_and_reap(&mut self) {
        self.signal_running(Signal::SIGKILL);
        for r in &mut self.ranks {
            if r.status.is_none() {
                r.status = r.child.wait().ok();
            }
        }
        self.sweep_groups();
    }

    /// Kills processes that outlived their rank in its process group (a background child
    /// of a rank that exited): they would be orphans, and may hold the output pipes open.
    fn sweep_groups(&self) {
        for r in &self.ranks {
            let pg = Pid::from_raw(r.pid);
            if killpg(pg, None).is_ok() {
                if self.verbose {
                    say!("ferroccl-run: killing processes left behind in rank {}'s process group", r.rank);
                }
                let _ = killpg(pg, Signal::SIGKILL);
            }
        }
    }

    /// Waits (a bounded time) for every output stream to be drained and joins its thread.
    pub(crate) fn drain_output(&mut self) {
        let deadline = Instant::now() + DRAIN_WAIT;
        while Instant::now() < deadline && !self.pumps.iter().all(|(_, h)| h.is_finished()) {
            thread::sleep(Duration::from_millis(5));
        }
        let mut stuck: Vec<usize> = Vec::new();
        for (rank, h) in self.pumps.drain(..) {
            if h.is_finished() {
                let _ = h.join();
            } else if !stuck.contains(&rank) {
                stuck.push(rank);
            }
        }
        if !stuck.is_empty() {
            say!(
                "ferroccl-run: output of ranks {} still open {} s after they exited (a process outside their group holds it); not waiting",
                rank_list(&stuck),
                secs(DRAIN_WAIT)
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signal_names() {
        assert_eq!(signal_name(9), "SIGKILL (9)");
    }

    #[test]
    fn formatting() {
        assert_eq!(secs(Duration::from_secs(5)), "5");
        assert_eq!(secs(Duration::from_millis(500)), "0.5");
        assert_eq!(secs(Duration::from_millis(1250)), "1.25");
        assert_eq!(rank_list(&[1, 3]), "1, 3");
        assert_eq!(Describe(ExitStatus::from_raw(3 << 8)).to_string(), "exited with status 3");
        assert_eq!(Describe(ExitStatus::from_raw(9)).to_string(), "was killed by signal SIGKILL (9)");
    }
}
