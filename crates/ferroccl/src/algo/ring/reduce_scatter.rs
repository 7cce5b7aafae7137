//! Ring reduce-scatter: in step `s` (0-based, `n - 1` steps) rank `r` sends block
//! `r - s - 1` to `r + 1` and receives block `r - s - 2` from `r - 1`, reducing it with its
//! own input block; after the last step it holds block `r` reduced over all ranks (then
//! divided by `n` for `Avg`).
//!
//! Reduction order of block `j`: `(((x_{j+1} op x_{j+2}) op ...) op x_j)` (ranks mod n),
//! rounded to the element type after every step. Integer `Avg` is refused by
//! [`super::super::build`].
//!
//! Partial sums travel through scratch: two blocks used alternately (step `s` receives into
//! buffer `s % 2`, which step `s + 1` sends from), so the caller's buffers are never written
//! except for the result; the last step receives straight into `Output` (out of place) or
//! into scratch (in place, where `Output` is the input).

use super::super::plan::{Emitter, Geometry, LOOKAHEAD};
use super::super::{Action, Schedule, Shape};

pub(in crate::algo) fn build(shape: &Shape) -> Schedule {
    let cx = Geometry::new(shape);
    let (n, r) = (cx.n, cx.rank);
    let blocks = cx.equal_blocks();
    let blk = blocks.len(0);
    // Where the result goes: all of `Output`, or block `r` of the one buffer.
    let res_off = if cx.in_place { blocks.off(r) } else { 0 };
    let mut em = Emitter::<(usize, usize)>::new(LOOKAHEAD);
    if n == 1 {
        if !cx.in_place {
            em.now(Action::Copy { dst: cx.output(0, blk), src: cx.input(0, blk) }, vec![]);
        }
        return em.finish(0);
    }
    let (left, right) = (cx.back(r, 1), cx.peer(1));
    let chunks = cx.chunks(blk);
    let last = n - 2;
    // Scratch buffers in use: steps 0..last (and the last step too when in place).
    let used_steps = if cx.in_place { n - 1 } else { n - 2 };
    let nbuf = used_steps.min(2);
    let tmp = |s: usize, off: usize, len: usize| cx.scratch((s % 2) * blk + off, len);
    // Send index per (step, chunk): a receive into a scratch buffer waits for the send that
    // last read it (two steps back).
    let mut sends: Vec<Vec<usize>> = Vec::with_capacity(n - 1);
    for s in 0..n - 1 {
        let (sb, rb) = (cx.back(r, s + 1), cx.back(r, s + 2));
        let mut this_send = Vec::with_capacity(chunks.len());
        for (c, &(off, len)) in chunks.iter().enumerate() {
            let own = cx.input(blocks.off(rb) + off, len);
            let (dst, reduce) = if s < last {
                (tmp(s, off, len), Action::Reduce { dst: tmp(s, off, len), src: own })
            } else if cx.in_place {
                (tmp(s, off, len), Action::Reduce { dst: cx.output(res_off + off, len), src: tmp(s, off, len) })
            } else {
                (cx.output(res_off + off, len), Action::Reduce { dst: cx.output(res_off + off, len), src: own })
            };
            let deps = if s >= 2 { vec![sends[s - 1][c]] } else { vec![] };
            let recv = em.now(Action::Recv { peer: left, dst }, deps);
            em.later((s, c), reduce, vec![recv]);
            let (src, deps) =
                if s == 0 { (cx.input(blocks.off(sb) + off, len), vec![]) } else { (tmp(s - 1, off, len), vec![em.idx((s - 1, c))]) };
            this_send.push(em.now(Action::Send { peer: right, src }, deps));
        }
        sends.push(this_send);
    }
    if shape.op == ferroccl_kernels::ReduceOp::Avg {
        for (c, &(off, len)) in chunks.iter().enumerate() {
            let reduced = em.idx((last, c));
            em.later((n, c), Action::FinishAvg { dst: cx.output(res_off + off, len), n }, vec![reduced]);
        }
    }
    em.finish(nbuf * blk)
}
