//! Mesh allgather: rank `r` sends its input to every other rank and receives block `j`
//! from rank `j` straight into `Output`; an out-of-place call also copies its input to
//! block `r`. One latency; no scratch.

use super::super::plan::{Emitter, Geometry, LOOKAHEAD};
use super::super::{Action, Schedule, Shape};

pub(in crate::algo) fn build(shape: &Shape) -> Schedule {
    let cx = Geometry::new(shape);
    let (n, r) = (cx.n, cx.rank);
    let blocks = cx.equal_blocks();
    let blk = blocks.len(0);
    let input = |off: usize, len: usize| cx.own_block(&blocks, off, len);
    let mut em = Emitter::<()>::new(LOOKAHEAD);
    for (c, &(off, len)) in cx.chunks(blk).iter().enumerate() {
        for k in 1..n {
            let p = cx.peer(k);
            em.now(Action::Recv { peer: p, dst: cx.output(blocks.off(p) + off, len) }, vec![]);
            em.now(Action::Send { peer: p, src: input(off, len) }, vec![]);
        }
        if c == 0 && !cx.in_place {
            em.now(Action::Copy { dst: cx.output(blocks.off(r), blk), src: cx.input(0, blk) }, vec![]);
        }
    }
    em.finish(0)
}
