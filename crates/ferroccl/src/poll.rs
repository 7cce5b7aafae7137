//! What one round of a wait loop's step found: the common answer of every state machine
//! that is advanced by polling (transfers, schedule runs, jobs, setup waits).

/// What one round of a wait loop's step found.
#[derive(Debug)]
pub(crate) enum Poll<T> {
    /// Finished, with this value.
    Ready(T),
    /// Not finished, but something moved (keep polling eagerly).
    Moved,
    /// Nothing to do yet.
    Idle,
}

/// Ready when `done`; otherwise whether the last step moved anything.
pub(crate) fn poll_of(done: bool, moved: bool) -> Poll<()> {
    if done {
        Poll::Ready(())
    } else if moved {
        Poll::Moved
    } else {
        Poll::Idle
    }
}
