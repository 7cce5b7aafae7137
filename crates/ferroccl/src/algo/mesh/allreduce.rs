//! Mesh allreduce: a mesh reduce-scatter (rank `r` reduces block `r` of the even split, in
//! rank order, bit-equal to the reference) then a mesh allgather (rank `r` sends its reduced
//! block to every rank). Two phases of one latency each; every rank sends and receives
//! `2 (n - 1) / n` of the message.

use super::super::plan::{Emitter, Geometry, LOOKAHEAD};
use super::super::{Action, Schedule, Shape};
use super::{reduce_scatter, Key};

pub(in crate::algo) fn build(shape: &Shape) -> Schedule {
    let cx = Geometry::new(shape);
    let (n, r) = (cx.n, cx.rank);
    let blocks = cx.even_blocks();
    let mut em = Emitter::new(LOOKAHEAD);
    if n == 1 {
        if !cx.in_place {
            em.now(Action::Copy { dst: cx.output(0, blocks.len(0)), src: cx.input(0, blocks.len(0)) }, vec![]);
        }
        return em.finish(0);
    }
    let rs = reduce_scatter::phase(&cx, &blocks, blocks.off(r), &mut em);
    let chunks: Vec<Vec<(usize, usize)>> = (0..n).map(|j| cx.chunks(blocks.len(j))).collect();
    let rounds = chunks.iter().map(Vec::len).max().unwrap_or(0);
    for c in 0..rounds {
        for k in 1..n {
            let p = cx.peer(k);
            if let Some(&(off, len)) = chunks[p].get(c) {
                // In place, block `p` of `Output` is also the input this rank sent to `p`.
                let deps = if cx.in_place { vec![rs.sends[p][c]] } else { vec![] };
                em.now(Action::Recv { peer: p, dst: cx.output(blocks.off(p) + off, len) }, deps);
            }
        }
        if let Some(&(off, len)) = chunks[r].get(c) {
            let reduced = em.idx(Key::Reduce(c));
            for k in 1..n {
                em.now(Action::Send { peer: cx.peer(k), src: cx.output(blocks.off(r) + off, len) }, vec![reduced]);
            }
        }
    }
    em.finish(rs.scratch_bytes)
}
