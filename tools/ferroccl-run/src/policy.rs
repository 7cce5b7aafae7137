//! Which status the runner exits with.
//!
//! The job's failure is the first rank that failed, except that a crash (a rank killed by
//! a signal, or one that panicked) noticed within [`ROOT_CAUSE_WINDOW`] after an ordinary
//! failure takes its place: the ranks that exited with an error were most likely reacting
//! to its death. [`root_cause`] makes that choice as failures come in, [`exit_code`] turns
//! the way the job ended into the runner's status.

use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::time::{Duration, Instant};

/// After an ordinary failure, how long a rank killed by a signal still counts as the root
/// cause (the first failure).
pub(crate) const ROOT_CAUSE_WINDOW: Duration = Duration::from_millis(250);

/// Rust's exit status for a process whose main thread panicked.
pub(crate) const PANIC_STATUS: i32 = 101;

/// A rank that failed (exited with a non-zero status or was killed), as the runner saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Failure {
    /// The rank.
    pub(crate) rank: usize,
    /// How it ended.
    pub(crate) status: ExitStatus,
    /// When the runner noticed it.
    pub(crate) at: Instant,
}

/// The failure that counts as the job's, given the one chosen so far and a new one.
///
/// A rank killed by a signal, or one that panicked, is the likelier root cause than one
/// that exited with an error after noticing it: if one shows up shortly after an ordinary
/// failure (a dying process's teardown can take longer than its peers need to notice it
/// and exit), it counts as the first failure.
pub(crate) fn root_cause(so_far: Option<Failure>, new: Failure) -> Failure {
    match so_far {
        None => new,
        Some(first) => {
            let soon_after = new.at.saturating_duration_since(first.at) < ROOT_CAUSE_WINDOW;
            if soon_after && is_crash(new.status) && !is_crash(first.status) {
                new
            } else {
                first
            }
        }
    }
}

/// The runner's exit status: 128 + the signal that stopped the runner, else the status of
/// the job's failure ([`root_cause`]), else 124 when `--timeout` passed, else 0.
pub(crate) fn exit_code(signal: Option<i32>, failure: Option<&Failure>, timed_out: bool) -> i32 {
    if let Some(sig) = signal {
        128 + sig
    } else if let Some(f) = failure {
        status_code(f.status)
    } else if timed_out {
        124
    } else {
        0
    }
}

/// Whether a rank crashed (killed by a signal, or panicked: status 101) rather than exited
/// with an error of its own: the likelier root cause of a failed job.
pub(crate) fn is_crash(st: ExitStatus) -> bool {
    st.signal().is_some() || st.code() == Some(PANIC_STATUS)
}

/// The runner's exit status for a failed rank: its code, or 128 + the signal.
pub(crate) fn status_code(st: ExitStatus) -> i32 {
    st.code().or_else(|| st.signal().map(|s| 128 + s)).unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failure(rank: usize, status: ExitStatus, at: Instant) -> Failure {
        Failure { rank, status, at }
    }

    #[test]
    fn statuses() {
        assert_eq!(status_code(ExitStatus::from_raw(9)), 137);
        assert!(is_crash(ExitStatus::from_raw(9)) && is_crash(ExitStatus::from_raw(101 << 8)));
        assert!(!is_crash(ExitStatus::from_raw(1 << 8)) && !is_crash(ExitStatus::from_raw(3 << 8)));
        assert_eq!(status_code(ExitStatus::from_raw(3 << 8)), 3);
    }

    #[test]
    fn the_first_failure_counts_unless_a_crash_follows_it_closely() {
        let t = Instant::now();
        let exit3 = failure(1, ExitStatus::from_raw(3 << 8), t);
        let killed_soon = failure(2, ExitStatus::from_raw(9), t + Duration::from_millis(100));
        let killed_late = failure(2, ExitStatus::from_raw(9), t + ROOT_CAUSE_WINDOW + Duration::from_millis(1));
        let exit4_soon = failure(0, ExitStatus::from_raw(4 << 8), t + Duration::from_millis(10));
        assert_eq!(root_cause(None, exit3), exit3);
        assert_eq!(root_cause(Some(exit3), killed_soon), killed_soon);
        assert_eq!(root_cause(Some(exit3), killed_late), exit3);
        assert_eq!(root_cause(Some(exit3), exit4_soon), exit3);
        // A crash is not replaced by a later crash.
        let panicked_soon = failure(0, ExitStatus::from_raw(101 << 8), t + Duration::from_millis(150));
        assert_eq!(root_cause(Some(killed_soon), panicked_soon), killed_soon);
    }

    #[test]
    fn exit_codes() {
        let f = failure(1, ExitStatus::from_raw(9), Instant::now());
        assert_eq!(exit_code(Some(15), Some(&f), true), 143);
        assert_eq!(exit_code(None, Some(&f), true), 137);
        assert_eq!(exit_code(None, None, true), 124);
        assert_eq!(exit_code(None, None, false), 0);
    }
}
