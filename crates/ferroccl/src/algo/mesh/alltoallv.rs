//! Mesh all-to-all with per-peer counts and displacements (MPI's `Alltoallv`): rank `r`
//! sends `send[p]` (a byte range of `Input`) to every peer `p` and receives `recv[p]` (a
//! byte range of `Output`) from it; its own block is copied locally. Every transfer is
//! posted at once, in the pairwise order (step `k`: send to `r + k`, receive from `r - k`,
//! mod n), so that the ranks do not all start with the same peer.
//!
//! One transfer per ordered pair of ranks, whole (not chunked) and never dropped, even when
//! its count is 0: the receiver learns the sender's length from the message (eager) or its
//! ready-to-send (rendezvous) and compares it with its own count, so counts that disagree
//! between a sender and its receiver are a mismatch error naming both ranks (see the
//! point-to-point protocols), never a hang or a truncated block.

use super::super::{Action, Buf, Schedule, Slice};

/// Rank `rank`'s schedule among `n` ranks: `send[p]` and `recv[p]` are (byte offset, byte
/// length) of the block for / from rank `p` (`send[rank]` and `recv[rank]` have the same
/// length, checked by the caller).
pub(in crate::algo) fn build(n: usize, rank: usize, send: &[(usize, usize)], recv: &[(usize, usize)]) -> Schedule {
    let mut s = Schedule::default();
    for k in 1..n {
        let to = (rank + k) % n;
        let from = (rank + n - k) % n;
        let (off, len) = recv[from];
        s.push(Action::Recv { peer: from, dst: Slice::new(Buf::Output, off, len) }, vec![]);
        let (off, len) = send[to];
        s.push(Action::Send { peer: to, src: Slice::new(Buf::Input, off, len) }, vec![]);
    }
    let ((src, len), (dst, _)) = (send[rank], recv[rank]);
    if len > 0 {
        s.push(Action::Copy { dst: Slice::new(Buf::Output, dst, len), src: Slice::new(Buf::Input, src, len) }, vec![]);
    }
    s
}
