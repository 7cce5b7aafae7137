//! Pairwise all-to-all with per-peer counts and displacements: the same messages as the
//! mesh's (`mesh/alltoallv.rs`: one whole message per ordered pair of ranks, empty or not,
//! so that counts that disagree are a mismatch error), in the same order, but at most
//! [`WINDOW`] steps in flight: step `s` (send to `r + s`, receive from `r - s`, mod n)
//! starts once step `s - WINDOW` has completed. Each rank then has at most `WINDOW`
//! messages arriving at once (the mesh: `n - 1`, an incast), and an eager transport
//! buffers at most `WINDOW` unexpected messages per rank. The cost is one latency per
//! `WINDOW` steps instead of one in all.
//!
//! Deadlock-free under rendezvous: in step `s`, rank `r`'s send is matched by rank
//! `r + s`'s receive of the same step, and its receive by rank `r - s`'s send; a step waits
//! only on earlier steps. The local block is copied once the first window's transfers are
//! posted (before any step that waits), overlapping them.
//!
//! The two schedules send the same messages per pair in the same order (one), so ranks may
//! run different ones in the same call (each picks from its own counts).

use super::super::{Action, Buf, Schedule, Slice};

/// Steps in flight: the next step starts once the one `WINDOW` steps before it has
/// completed (measured: see docs/algorithms.md, "alltoallv").
pub(crate) const WINDOW: usize = 2;

/// Rank `rank`'s schedule among `n` ranks with `window` steps in flight (at least 1):
/// `send[p]` and `recv[p]` as in `mesh::alltoallv::build`.
pub(in crate::algo) fn build(n: usize, rank: usize, send: &[(usize, usize)], recv: &[(usize, usize)], window: usize) -> Schedule {
    let window = window.max(1);
    let mut s = Schedule::default();
    let ((src, len), (dst, _)) = (send[rank], recv[rank]);
    let copy = Action::Copy { dst: Slice::new(Buf::Output, dst, len), src: Slice::new(Buf::Input, src, len) };
    let mut copy = (len > 0).then_some(copy);
    // The (recv, send) step indices of each pairwise step.
    let mut steps: Vec<(usize, usize)> = Vec::with_capacity(n.saturating_sub(1));
    for k in 1..n {
        if k == window + 1 {
            if let Some(c) = copy.take() {
                s.push(c, vec![]);
            }
        }
        let to = (rank + k) % n;
        let from = (rank + n - k) % n;
        let deps = match k.checked_sub(window + 1) {
            Some(i) => vec![steps[i].0, steps[i].1],
            None => vec![],
        };
        let (off, len) = recv[from];
        let r = s.push(Action::Recv { peer: from, dst: Slice::new(Buf::Output, off, len) }, deps.clone());
        let (off, len) = send[to];
        let t = s.push(Action::Send { peer: to, src: Slice::new(Buf::Input, off, len) }, deps);
        steps.push((r, t));
    }
    if let Some(c) = copy {
        s.push(c, vec![]);
    }
    s
}
