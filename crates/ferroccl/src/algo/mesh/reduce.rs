//! Mesh reduce: every rank but the root sends its input to the root; the root reduces each
//! chunk with one `ReduceMany` over the `n` ranks' data in rank order (bit-equal to the
//! reference `reduce_many`; `Avg` divides by `n`, exact for integers). One latency; the root
//! receives `(n - 1)` times the message, through `Shape::slots` scratch slots per peer.

use super::super::plan::{Emitter, Geometry, LOOKAHEAD};
use super::super::{Action, Schedule, Shape};
use super::Key;

pub(in crate::algo) fn build(shape: &Shape, root: usize) -> Schedule {
    let cx = Geometry::new(shape);
    let (n, r) = (cx.n, cx.rank);
    let total = cx.count * cx.elem;
    let chunks = cx.chunks(total);
    let mut em = Emitter::new(LOOKAHEAD);
    if r != root {
        for &(off, len) in &chunks {
            em.now(Action::Send { peer: root, src: cx.input(off, len) }, vec![]);
        }
        return em.finish(0);
    }
    if n == 1 {
        if !cx.in_place {
            em.now(Action::Copy { dst: cx.output(0, total), src: cx.input(0, total) }, vec![]);
        }
        return em.finish(0);
    }
    let slot_len = cx.chunk_cap(total);
    // Slots per peer: no more than the chunks.
    let per = chunks.len().clamp(1, cx.slots);
    let slot = |k: usize, c: usize, len: usize| cx.scratch(((k - 1) * per + c % per) * slot_len, len);
    for (c, &(off, len)) in chunks.iter().enumerate() {
        let deps = if c >= cx.slots { vec![em.idx(Key::Reduce(c - cx.slots))] } else { vec![] };
        let recvs = (1..n).map(|k| em.now(Action::Recv { peer: cx.peer(k), dst: slot(k, c, len) }, deps.clone())).collect();
        let srcs = (0..n).map(|q| if q == r { cx.input(off, len) } else { slot(cx.back(q, r), c, len) }).collect();
        em.later(Key::Reduce(c), Action::ReduceMany { dst: cx.output(off, len), srcs }, recvs);
    }
    em.finish((n - 1) * chunks.len().min(cx.slots) * slot_len)
}
