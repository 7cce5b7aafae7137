//! Mesh broadcast: the root sends the whole message to every other rank, which receives it
//! straight into `Output`. One latency, but the root sends `n - 1` times the message: the
//! choice for small messages (large ones go along the chain).

use super::super::plan::{Emitter, Geometry, LOOKAHEAD};
use super::super::{Action, Schedule, Shape};

pub(in crate::algo) fn build(shape: &Shape, root: usize) -> Schedule {
    let cx = Geometry::new(shape);
    let (n, r) = (cx.n, cx.rank);
    let total = cx.count * cx.elem;
    let mut em = Emitter::<()>::new(LOOKAHEAD);
    for (c, &(off, len)) in cx.chunks(total).iter().enumerate() {
        if r == root {
            for k in 1..n {
                em.now(Action::Send { peer: cx.peer(k), src: cx.input(off, len) }, vec![]);
            }
            if c == 0 && !cx.in_place {
                em.now(Action::Copy { dst: cx.output(0, total), src: cx.input(0, total) }, vec![]);
            }
        } else {
            em.now(Action::Recv { peer: root, dst: cx.output(off, len) }, vec![]);
        }
    }
    em.finish(0)
}
