//! Mesh all-to-all: rank `r` sends block `j` of its input to rank `j` and receives block `i`
//! of its output from rank `i`; block `r` is copied locally. One latency; every rank sends
//! `(n - 1) / n` of its buffer.
//!
//! Out of place, blocks are received straight into `Output` (no scratch). In place, block
//! `p` of the one buffer is both what goes to `p` and where `p`'s block lands, so a chunk
//! from `p` is received into a scratch slot and copied over once the chunk sent to `p`
//! has left.

use super::super::plan::{Emitter, Geometry, LOOKAHEAD};
use super::super::{Action, Schedule, Shape};
use super::Key;

pub(in crate::algo) fn build(shape: &Shape) -> Schedule {
    let cx = Geometry::new(shape);
    let (n, r) = (cx.n, cx.rank);
    let blocks = cx.equal_blocks();
    let blk = blocks.len(0);
    let chunks = cx.chunks(blk);
    let slot_len = cx.chunk_cap(blk);
    // Slots per peer: no more than the chunks.
    let per = chunks.len().clamp(1, cx.slots);
    let slot = |k: usize, c: usize, len: usize| cx.scratch(((k - 1) * per + c % per) * slot_len, len);
    // Hold back a whole round of copies, so that every rank posts all transfers of a round
    // before it waits for any of them (with rendezvous sends, anything else can deadlock).
    let mut em = Emitter::new(LOOKAHEAD.max(n - 1));
    for (c, &(off, len)) in chunks.iter().enumerate() {
        let mut copies = Vec::new();
        for k in 1..n {
            let p = cx.peer(k);
            let at = blocks.off(p) + off;
            if cx.in_place {
                let deps = if c >= cx.slots { vec![em.idx(Key::Copy(k, c - cx.slots))] } else { vec![] };
                let recv = em.now(Action::Recv { peer: p, dst: slot(k, c, len) }, deps);
                let send = em.now(Action::Send { peer: p, src: cx.output(at, len) }, vec![]);
                copies.push((Key::Copy(k, c), Action::Copy { dst: cx.output(at, len), src: slot(k, c, len) }, vec![recv, send]));
            } else {
                em.now(Action::Recv { peer: p, dst: cx.output(at, len) }, vec![]);
                em.now(Action::Send { peer: p, src: cx.input(at, len) }, vec![]);
            }
        }
        for (key, op, deps) in copies {
            em.later(key, op, deps);
        }
        if c == 0 && !cx.in_place {
            em.now(Action::Copy { dst: cx.output(blocks.off(r), blk), src: cx.input(blocks.off(r), blk) }, vec![]);
        }
    }
    let scratch = if cx.in_place && n > 1 { (n - 1) * per * slot_len } else { 0 };
    em.finish(scratch)
}
