//! Ring allreduce: a ring reduce-scatter (`n - 1` steps) then a ring allgather (`n - 1`
//! steps).
//!
//! `count` is split into `n` blocks (the first `count % n` one element larger). In
//! reduce-scatter step `s` (0-based) rank `r` sends block `r - s` to `r + 1` and receives
//! block `r - s - 1` from `r - 1`, reducing it with its own input; after `n - 1` steps rank
//! `r` holds block `o = r + 1` reduced over all ranks. For `Avg` it then divides it by `n`
//! (a `FinishAvg`). In allgather step `s` rank `r` sends block `r + 1 - s` and receives block
//! `r - s`, which it stores and forwards. Every block is reduced once, by its owner, so all
//! ranks end with identical bytes.
//!
//! Reduction order of block `j`: `(((x_j op x_{j+1}) op x_{j+2}) ... op x_{j+n-1})` (ranks
//! mod n), rounded to the element type after every step (`n - 1` roundings for f16/bf16:
//! see docs/algorithms.md for the bound). Integer `Avg` is refused by [`super::super::build`].
//!
//! Buffers: out of place, partial sums travel through `Output` itself (block `j` is
//! received there, reduced with `Input`, sent on, and later overwritten by the final value):
//! no scratch. In place, a received chunk lands in one of [`cx.slots`] scratch slots and is
//! reduced into `Output`.

use super::super::plan::{Emitter, Geometry, LOOKAHEAD};
use super::super::{Action, Schedule, Shape};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Key {
    /// The reduction of reduce-scatter step `s`, chunk `c`.
    Reduce(usize, usize),
}

pub(in crate::algo) fn build(shape: &Shape) -> Schedule {
    let cx = Geometry::new(shape);
    let (n, r) = (cx.n, cx.rank);
    let blocks = cx.even_blocks();
    let mut em = Emitter::<Key>::new(LOOKAHEAD);
    if n == 1 {
        if !cx.in_place {
            em.now(Action::Copy { dst: cx.output(0, blocks.len(0)), src: cx.input(0, blocks.len(0)) }, vec![]);
        }
        return em.finish(0);
    }
    let (left, right) = (cx.back(r, 1), cx.peer(1));
    let chunks: Vec<Vec<(usize, usize)>> = (0..n).map(|j| cx.chunks(blocks.len(j))).collect();
    let slot_len = cx.chunk_cap(blocks.max_len());
    let slots = if cx.in_place { cx.slots } else { 0 };
    // The reduction that last read each slot (a receive into the slot waits for it).
    let mut slot_user: Vec<Option<Key>> = vec![None; slots];
    let mut next_slot = 0;
    // The reduce-scatter send that read each (block, chunk): the allgather's receive into
    // that chunk of `Output` waits for it.
    let mut rs_send: Vec<Vec<usize>> = vec![Vec::new(); n];

    for s in 0..n - 1 {
        let (sb, rb) = (cx.back(r, s), cx.back(r, s + 1));
        for c in 0..chunks[sb].len().max(chunks[rb].len()) {
            if let Some(&(off, len)) = chunks[rb].get(c) {
                let at = blocks.off(rb) + off;
                let (dst, deps, reduce) = if cx.in_place {
                    let slot = next_slot % slots;
                    next_slot += 1;
                    let deps = slot_user[slot].map(|k| vec![em.idx(k)]).unwrap_or_default();
                    slot_user[slot] = Some(Key::Reduce(s, c));
                    let tmp = cx.scratch(slot * slot_len, len);
                    (tmp.clone(), deps, Action::Reduce { dst: cx.output(at, len), src: tmp })
                } else {
                    (cx.output(at, len), vec![], Action::Reduce { dst: cx.output(at, len), src: cx.input(at, len) })
                };
                let recv = em.now(Action::Recv { peer: left, dst }, deps);
                em.later(Key::Reduce(s, c), reduce, vec![recv]);
            }
            if let Some(&(off, len)) = chunks[sb].get(c) {
                let at = blocks.off(sb) + off;
                let (src, deps) =
                    if s == 0 { (cx.input(at, len), vec![]) } else { (cx.output(at, len), vec![em.idx(Key::Reduce(s - 1, c))]) };
                let send = em.now(Action::Send { peer: right, src }, deps);
                rs_send[sb].push(send);
            }
        }
    }

    let own = cx.peer(1);
    let avg = shape.op == ferroccl_kernels::ReduceOp::Avg;
    let mut ag_recv: Vec<usize> = Vec::new();
    for s in 0..n - 1 {
        let (sb, rb) = (cx.back(own, s), cx.back(r, s));
        let mut this_recv = Vec::with_capacity(chunks[rb].len());
        for c in 0..chunks[sb].len().max(chunks[rb].len()) {
            if let Some(&(off, len)) = chunks[rb].get(c) {
                let dst = cx.output(blocks.off(rb) + off, len);
                this_recv.push(em.now(Action::Recv { peer: left, dst }, vec![rs_send[rb][c]]));
            }
            if let Some(&(off, len)) = chunks[sb].get(c) {
                let deps = if s > 0 {
                    vec![ag_recv[c]]
                } else if avg {
                    // Divide the owned chunk by n just before it is first shared.
                    let reduced = em.idx(Key::Reduce(n - 2, c));
                    vec![em.now(Action::FinishAvg { dst: cx.output(blocks.off(sb) + off, len), n }, vec![reduced])]
                } else {
                    vec![em.idx(Key::Reduce(n - 2, c))]
                };
                em.now(Action::Send { peer: right, src: cx.output(blocks.off(sb) + off, len) }, deps);
            }
        }
        ag_recv = this_recv;
    }
    em.finish(slots * slot_len)
}
