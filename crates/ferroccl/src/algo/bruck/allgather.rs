//! Bruck allgather: every chunk of every rank's block is gathered by Bruck's dissemination
//! (`ceil(log2 n)` rounds) into scratch, rotated, then copied to its block of `Output` (two
//! copies when the block is one chunk: the pieces of ranks `r..n` and of ranks `0..r` each
//! sit together).

use super::super::plan::{Emitter, Geometry, LOOKAHEAD};
use super::super::{Action, Schedule, Shape};

pub(in crate::algo) fn build(shape: &Shape) -> Schedule {
    let cx = Geometry::new(shape);
    let (n, r) = (cx.n, cx.rank);
    let blocks = cx.equal_blocks();
    let blk = blocks.len(0);
    let mut em = Emitter::<()>::new(LOOKAHEAD);
    if n == 1 {
        if !cx.in_place {
            em.now(Action::Copy { dst: cx.output(0, blk), src: cx.input(0, blk) }, vec![]);
        }
        return em.finish(0);
    }
    let chunks = cx.chunks(blk);
    for &(off, len) in &chunks {
        let base = n * off;
        let deps = super::gather(&cx, &mut em, cx.own_block(&blocks, off, len), base, len);
        if chunks.len() == 1 {
            // Pieces 0..n - r are ranks r..n, pieces n - r..n ranks 0..r, each run whole (in
            // place, this rank's block is already where it belongs).
            let skip = usize::from(cx.in_place);
            for (piece, rank, pieces) in [(skip, r + skip, n - r - skip), (n - r, 0, r)] {
                if pieces > 0 {
                    let dst = cx.output(blocks.off(rank), pieces * len);
                    em.now(Action::Copy { dst, src: cx.scratch(base + piece * len, pieces * len) }, deps.clone());
                }
            }
        } else {
            for piece in 0..n {
                let q = (r + piece) % n;
                if piece == 0 && cx.in_place {
                    continue;
                }
                em.now(Action::Copy { dst: cx.output(blocks.off(q) + off, len), src: cx.scratch(base + piece * len, len) }, deps.clone());
            }
        }
    }
    em.finish(n * blk)
}
