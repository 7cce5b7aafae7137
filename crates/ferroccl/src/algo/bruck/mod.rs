//! Bruck's dissemination, for small messages where every message costs (tcp, verbs, ranks
//! that share CPUs): `ceil(log2 n)` rounds instead of one round of `n - 1` messages. In
//! round `k` (distance `d = 2^k`) rank `r` sends the pieces it has gathered so far (the
//! first `min(d, n - d)`) to rank `r - d` and receives as many from rank `r + d` (mod n),
//! so every rank sends and receives `ceil(log2 n)` messages per chunk and ends with every
//! rank's piece. Pieces are gathered rotated, in scratch: piece `i` is rank `r + i`'s.
//! Allreduce then reduces the `n` pieces in rank order (bit-equal to the reference, as
//! oneshot); allgather copies them to their blocks.

pub(super) mod allgather;
pub(super) mod allreduce;

use super::plan::{Emitter, Geometry};
use super::{Action, Slice};

/// Gathers every rank's `len`-byte piece (this rank's is `own`) into `n * len` bytes of
/// scratch from `base`, rotated (piece `i` at `base + i * len` is rank `r + i`'s). Returns
/// the steps after which the area is whole (the copy of `own` and every receive).
pub(super) fn gather(cx: &Geometry, em: &mut Emitter<()>, own: Slice, base: usize, len: usize) -> Vec<usize> {
    let (n, r) = (cx.n, cx.rank);
    let mut have = vec![em.now(Action::Copy { dst: cx.scratch(base, len), src: own }, vec![])];
    let mut d = 1;
    while d < n {
        let pieces = d.min(n - d);
        let recv = em.now(Action::Recv { peer: (r + d) % n, dst: cx.scratch(base + d * len, pieces * len) }, vec![]);
        // What this rank sends in round k arrived by the end of round k - 1.
        em.now(Action::Send { peer: (r + n - d) % n, src: cx.scratch(base, pieces * len) }, have.clone());
        have.push(recv);
        d *= 2;
    }
    have
}
