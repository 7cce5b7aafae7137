//! Ring allgather: in step `s` (0-based, `n - 1` steps) rank `r` sends block `r - s` to
//! `r + 1` and receives block `r - s - 1` from `r - 1` into `Output`, forwarding it in the
//! next step. Step 0 sends straight from the input; an out-of-place call also copies its
//! input to block `r` of `Output` (once the first sends are posted). No scratch, no
//! arithmetic.

use super::super::plan::{Emitter, Geometry, LOOKAHEAD};
use super::super::{Action, Schedule, Shape};

pub(in crate::algo) fn build(shape: &Shape) -> Schedule {
    let cx = Geometry::new(shape);
    let (n, r) = (cx.n, cx.rank);
    let blocks = cx.equal_blocks();
    let blk = blocks.len(0);
    let input = |off: usize, len: usize| cx.own_block(&blocks, off, len);
    let mut em = Emitter::<()>::new(LOOKAHEAD);
    let copy = Action::Copy { dst: cx.output(blocks.off(r), blk), src: input(0, blk) };
    if n == 1 {
        if !cx.in_place {
            em.now(copy, vec![]);
        }
        return em.finish(0);
    }
    let (left, right) = (cx.back(r, 1), cx.peer(1));
    let chunks = cx.chunks(blk);
    let mut prev_recv: Vec<usize> = Vec::new();
    for s in 0..n - 1 {
        let (sb, rb) = (cx.back(r, s), cx.back(r, s + 1));
        let mut this_recv = Vec::with_capacity(chunks.len());
        for (c, &(off, len)) in chunks.iter().enumerate() {
            this_recv.push(em.now(Action::Recv { peer: left, dst: cx.output(blocks.off(rb) + off, len) }, vec![]));
            let (src, deps) = if s == 0 { (input(off, len), vec![]) } else { (cx.output(blocks.off(sb) + off, len), vec![prev_recv[c]]) };
            em.now(Action::Send { peer: right, src }, deps);
        }
        if s == 0 && !cx.in_place {
            em.now(copy.clone(), vec![]);
        }
        prev_recv = this_recv;
    }
    em.finish(0)
}
