//! Signals to the runner: `SIGINT`, `SIGTERM` and `SIGHUP` are caught and forwarded to the
//! ranks, `SIGTERM` first and `SIGKILL` later (at once on a second signal).

use std::io;
use std::time::Duration;

use nix::sys::signal::Signal;
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

use crate::job::{rank_list, signal_name, Job, Stopping};

/// Between `SIGTERM` and `SIGKILL` when the runner itself was asked to stop.
pub(crate) const SIGNAL_TERM_TO_KILL: Duration = Duration::from_secs(2);

/// Starts catching the signals that stop the runner; they are read by [`forward`].
pub(crate) fn catch() -> io::Result<Signals> {
    Signals::new([SIGINT, SIGTERM, SIGHUP])
}

/// Acts on the signals that arrived since the last call: the first sends `SIGTERM` to the
/// `running` ranks (and schedules `SIGKILL`) and is kept in `got`; any later one sends
/// `SIGKILL` at once.
pub(crate) fn forward(signals: &mut Signals, job: &mut Job, running: &[usize], got: &mut Option<i32>, stopping: &mut Option<Stopping>) {
    for sig in signals.pending() {
        if got.is_none() {
            *got = Some(sig);
            say!("ferroccl-run: got {}; sending SIGTERM to ranks {}", signal_name(sig), rank_list(running));
            job.begin_stop(stopping, SIGNAL_TERM_TO_KILL);
        } else {
            say!("ferroccl-run: got {} again; sending SIGKILL to ranks {}", signal_name(sig), rank_list(running));
            job.signal_running(Signal::SIGKILL);
            if let Some(s) = stopping {
                s.kill_sent = true;
            }
        }
    }
}
