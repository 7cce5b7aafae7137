//! Chain broadcast: the root sends the message, chunk by chunk, to `root + 1`, which stores
//! each chunk in `Output` and forwards it to `root + 2`, and so on to `root - 1` (mod n).
//! `n - 1` hops of latency (plus one chunk's time per hop to fill the pipeline); every link
//! carries the message once, so for large messages the time is about `S / bandwidth`.
//! An out-of-place root also copies its input to its output. No scratch.
//!
//! This is the ring variant of broadcast.

use super::super::plan::{Emitter, Geometry, LOOKAHEAD};
use super::super::{Action, Schedule, Shape};

pub(in crate::algo) fn build(shape: &Shape, root: usize) -> Schedule {
    let cx = Geometry::new(shape);
    let (n, r) = (cx.n, cx.rank);
    let total = cx.count * cx.elem;
    let pos = cx.back(r, root);
    let (prev, next) = (cx.back(r, 1), cx.peer(1));
    let mut em = Emitter::<()>::new(LOOKAHEAD);
    for (c, &(off, len)) in cx.chunks(total).iter().enumerate() {
        if pos == 0 {
            if n > 1 {
                em.now(Action::Send { peer: next, src: cx.input(off, len) }, vec![]);
            }
            if c == 0 && !cx.in_place {
                em.now(Action::Copy { dst: cx.output(0, total), src: cx.input(0, total) }, vec![]);
            }
        } else {
            let recv = em.now(Action::Recv { peer: prev, dst: cx.output(off, len) }, vec![]);
            if pos + 1 < n {
                em.now(Action::Send { peer: next, src: cx.output(off, len) }, vec![recv]);
            }
        }
    }
    em.finish(0)
}
