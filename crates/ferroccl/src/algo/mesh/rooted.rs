//! Mesh gather and scatter (equal counts, or per-rank counts and displacements at the
//! root: gatherv, scatterv): every other rank exchanges one message with the root, all
//! posted at once, in the order `root + 1, root + 2, ...` at the root; the root's own
//! block is one local copy. One latency; the root receives (sends) every other rank's
//! block.
//!
//! As for alltoallv, each message is whole (not chunked) and never dropped, even when
//! empty: the receiver compares its length with its own count, so a root's count for a
//! rank that differs from what that rank passes is a mismatch naming both, never a hang.

use super::super::{Action, Buf, Schedule, Slice};

/// See `algo::build_gather`.
pub(in crate::algo) fn gather(n: usize, rank: usize, root: usize, send: (usize, usize), recv: &[(usize, usize)]) -> Schedule {
    let mut s = Schedule::default();
    if rank != root {
        s.push(Action::Send { peer: root, src: Slice::new(Buf::Input, send.0, send.1) }, vec![]);
        return s;
    }
    for k in 1..n {
        let p = (root + k) % n;
        let (off, len) = recv[p];
        s.push(Action::Recv { peer: p, dst: Slice::new(Buf::Output, off, len) }, vec![]);
    }
    if send.1 > 0 {
        s.push(Action::Copy { dst: Slice::new(Buf::Output, recv[root].0, send.1), src: Slice::new(Buf::Input, send.0, send.1) }, vec![]);
    }
    s
}

/// See `algo::build_scatter`.
pub(in crate::algo) fn scatter(n: usize, rank: usize, root: usize, send: &[(usize, usize)], recv: (usize, usize)) -> Schedule {
    let mut s = Schedule::default();
    if rank != root {
        s.push(Action::Recv { peer: root, dst: Slice::new(Buf::Output, recv.0, recv.1) }, vec![]);
        return s;
    }
    for k in 1..n {
        let p = (root + k) % n;
        let (off, len) = send[p];
        s.push(Action::Send { peer: p, src: Slice::new(Buf::Input, off, len) }, vec![]);
    }
    if recv.1 > 0 {
        s.push(Action::Copy { dst: Slice::new(Buf::Output, recv.0, recv.1), src: Slice::new(Buf::Input, send[root].0, recv.1) }, vec![]);
    }
    s
}
