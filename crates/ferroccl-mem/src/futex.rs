//! Cross-process doorbells: Linux futexes on a 32-bit word.
//!
//! These are *shared* futexes (no `FUTEX_PRIVATE_FLAG`): the kernel keys them
//! by the physical page, so a waiter in one process is woken by a waker in
//! another when both use the same word of a `MAP_SHARED` segment (see
//! [`ShmSegment::atomic_u32`](crate::segment::ShmSegment::atomic_u32)). They
//! work on private memory too, only slightly slower than private futexes.
//!
//! The usual doorbell pattern: the waiter loads the word, checks its
//! condition, and calls [`futex_wait`] with the value it saw; the waker changes
//! the word (a `Release` store or RMW) and then calls [`futex_wake`]. The
//! kernel compares the word to `expected` atomically with going to sleep, so a
//! wake between the check and the wait is never lost.
//!
//! ```
//! use std::sync::atomic::{AtomicU32, Ordering};
//! use std::time::Duration;
//! use ferroccl_mem::futex::{futex_wait, futex_wake, WaitOutcome};
//!
//! let bell = AtomicU32::new(0);
//! // Nobody rings: the wait times out.
//! let r = futex_wait(&bell, 0, Some(Duration::from_millis(1)))?;
//! assert_eq!(r, WaitOutcome::TimedOut);
//! // The word already changed: returns at once.
//! bell.store(1, Ordering::Release);
//! assert_eq!(futex_wait(&bell, 0, None)?, WaitOutcome::Woken);
//! assert_eq!(futex_wake(&bell, 1)?, 0); // no waiters
//! # Ok::<(), std::io::Error>(())
//! ```

use std::io;
use std::sync::atomic::AtomicU32;
use std::time::Duration;

use rustix::io::Errno;
use rustix::thread::futex;

/// How a [`futex_wait`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitOutcome {
    /// Woken by [`futex_wake`], or the word no longer held `expected` when
    /// the wait started, or the wait was interrupted by a signal (a spurious
    /// wake). Callers re-check their condition in every case.
    Woken,
    /// The timeout passed with no wake.
    TimedOut,
}

/// Converts a relative timeout, saturating at the largest `timespec`.
pub(crate) fn to_timespec(d: Duration) -> rustix::time::Timespec {
    rustix::time::Timespec::try_from(d).unwrap_or(rustix::time::Timespec { tv_sec: i64::MAX, tv_nsec: 999_999_999 })
}

/// Sleeps while `*word == expected`, until woken, or until `timeout` (a
/// relative duration; `None` waits without limit) passes.
///
/// Returns [`WaitOutcome::Woken`] on a wake, when the word did not hold
/// `expected` (`EAGAIN`) and on a signal (`EINTR`); returns
/// [`WaitOutcome::TimedOut`] when the timeout passed (`ETIMEDOUT`). Wakes can
/// be spurious, so callers loop on their own condition and deadline. Other
/// kernel errors (e.g. `EFAULT`, `EINVAL`, `ENOSYS`) are returned as `Err`.
pub fn futex_wait(word: &AtomicU32, expected: u32, timeout: Option<Duration>) -> io::Result<WaitOutcome> {
    let ts = timeout.map(to_timespec);
    match futex::wait(word, futex::Flags::empty(), expected, ts.as_ref()) {
        Ok(()) | Err(Errno::AGAIN) | Err(Errno::INTR) => Ok(WaitOutcome::Woken),
        Err(Errno::TIMEDOUT) => Ok(WaitOutcome::TimedOut),
        Err(e) => Err(io::Error::new(io::Error::from(e).kind(), format!("futex_wait(expected {expected}): {e}"))),
    }
}

/// Wakes up to `n` waiters sleeping on `word` (in this or other processes);
/// returns how many were woken.
///
/// Change the word before waking, so that a waiter that has not gone to sleep
/// yet sees the change and does not sleep at all.
pub fn futex_wake(word: &AtomicU32, n: u32) -> io::Result<u32> {
    // The kernel takes the count as a signed int.
    let n = n.min(i32::MAX as u32);
    let woken = futex::wake(word, futex::Flags::empty(), n)
        .map_err(|e| io::Error::new(io::Error::from(e).kind(), format!("futex_wake(n {n}): {e}")))?;
    Ok(u32::try_from(woken).unwrap_or(u32::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;
    use std::sync::Arc;
    use std::time::Instant;

    #[test]
    fn waiter_is_woken_by_another_thread() {
        let word = Arc::new(AtomicU32::new(0));
        let w = Arc::clone(&word);
        let waiter = std::thread::spawn(move || {
            let start = Instant::now();
            while w.load(Ordering::Acquire) == 0 {
                let r = futex_wait(&w, 0, Some(Duration::from_secs(5))).unwrap();
                assert_eq!(r, WaitOutcome::Woken, "woken, not timed out");
            }
            start.elapsed()
        });
        // Give the waiter a moment to go to sleep (not needed for correctness:
        // the value check makes a late waiter return at once).
        std::thread::sleep(Duration::from_millis(20));
        word.store(1, Ordering::Release);
        futex_wake(&word, u32::MAX).unwrap();
        let waited = waiter.join().unwrap();
        assert!(waited < Duration::from_secs(4), "waited {waited:?}");
    }

    #[test]
    fn wake_counts_sleepers() {
        let word = Arc::new(AtomicU32::new(0));
        let handles: Vec<_> = (0..3)
            .map(|_| {
                let w = Arc::clone(&word);
                std::thread::spawn(move || {
                    while w.load(Ordering::Acquire) == 0 {
                        futex_wait(&w, 0, Some(Duration::from_secs(5))).unwrap();
                    }
                })
            })
            .collect();
        // Wait until all three are (very likely) asleep, then count the wake.
        std::thread::sleep(Duration::from_millis(50));
        word.store(1, Ordering::Release);
        let n = futex_wake(&word, u32::MAX).unwrap();
        assert!(n <= 3);
        for h in handles {
            h.join().unwrap();
        }
    }

    #[test]
    fn timeout_returns_in_roughly_the_timeout() {
        let word = AtomicU32::new(7);
        let start = Instant::now();
        let r = futex_wait(&word, 7, Some(Duration::from_millis(50))).unwrap();
        let took = start.elapsed();
        assert_eq!(r, WaitOutcome::TimedOut);
        assert!(took >= Duration::from_millis(45), "returned early: {took:?}");
        assert!(took < Duration::from_secs(2), "returned late: {took:?}");
    }

    #[test]
    fn value_mismatch_returns_at_once() {
        let word = AtomicU32::new(3);
        let start = Instant::now();
        let r = futex_wait(&word, 4, Some(Duration::from_secs(5))).unwrap();
        assert_eq!(r, WaitOutcome::Woken);
        assert!(start.elapsed() < Duration::from_secs(1));
    }

    #[test]
    fn works_across_two_mappings_of_one_segment() {
        use crate::segment::ShmSegment;
        let name = format!("/ferroccl-test-{}-futex", std::process::id());
        let a = ShmSegment::create(&name, 4096).unwrap();
        let b = ShmSegment::open(&name, 4096).unwrap();
        ShmSegment::unlink(&name).unwrap();
        std::thread::scope(|s| {
            let waiter = s.spawn(|| {
                let w = b.atomic_u32(64);
                while w.load(Ordering::Acquire) == 0 {
                    let r = futex_wait(w, 0, Some(Duration::from_secs(5))).unwrap();
                    assert_eq!(r, WaitOutcome::Woken);
                }
            });
            std::thread::sleep(Duration::from_millis(20));
            // A different virtual address for the same physical word: only a
            // shared futex is woken through it.
            a.atomic_u32(64).store(1, Ordering::Release);
            futex_wake(a.atomic_u32(64), 1).unwrap();
            waiter.join().unwrap();
        });
    }
}
