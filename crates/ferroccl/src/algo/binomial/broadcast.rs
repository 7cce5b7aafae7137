//! Binomial-tree broadcast: each chunk goes from the root to its children (farthest first),
//! and every rank forwards a chunk to its own children as soon as it has received it
//! (straight into `Output`). `ceil(log2 n)` hops; the root sends the message `ceil(log2 n)`
//! times (the mesh: `n - 1`), so it is the choice for small messages where every message
//! costs (large ones go along the chain). An out-of-place root also copies its input to its
//! output. No scratch.

use super::super::plan::{Emitter, Geometry, LOOKAHEAD};
use super::super::{Action, Schedule, Shape};
use super::{children, parent, position};

pub(in crate::algo) fn build(shape: &Shape, root: usize) -> Schedule {
    let cx = Geometry::new(shape);
    let (n, r) = (cx.n, cx.rank);
    let total = cx.count * cx.elem;
    let v = position(n, r, root);
    let rank_of = |pos: usize| (pos + root) % n;
    let mut em = Emitter::<()>::new(LOOKAHEAD);
    for (c, &(off, len)) in cx.chunks(total).iter().enumerate() {
        let (src, deps) = if v == 0 {
            (cx.input(off, len), vec![])
        } else {
            let recv = em.now(Action::Recv { peer: rank_of(parent(v)), dst: cx.output(off, len) }, vec![]);
            (cx.output(off, len), vec![recv])
        };
        for child in children(n, v) {
            em.now(Action::Send { peer: rank_of(child), src: src.clone() }, deps.clone());
        }
        if v == 0 && c == 0 && !cx.in_place {
            em.now(Action::Copy { dst: cx.output(0, total), src: cx.input(0, total) }, vec![]);
        }
    }
    em.finish(0)
}
