//! Mesh reduce-scatter: rank `r` sends block `j` of its input to rank `j` for every `j != r`
//! and receives block `r` from every other rank; per chunk, one `ReduceMany` over the `n`
//! ranks' pieces in rank order (`x_0 op x_1 op ... op x_{n-1}`, accumulating in f32 for
//! f16/bf16 and rounding once; `Avg` divides by `n`, exact for integers) writes the result.
//! Bit-equal to the reference `reduce_many`.
//!
//! [`phase`] is also the first half of the mesh allreduce.

use super::super::plan::{Blocks, Emitter, Geometry, LOOKAHEAD};
use super::super::{Action, Schedule, Shape};
use super::Key;

pub(in crate::algo) fn build(shape: &Shape) -> Schedule {
    let cx = Geometry::new(shape);
    let blocks = cx.equal_blocks();
    let res_off = if cx.in_place { blocks.off(cx.rank) } else { 0 };
    let mut em = Emitter::new(LOOKAHEAD);
    if cx.n == 1 {
        if !cx.in_place {
            em.now(Action::Copy { dst: cx.output(0, blocks.len(0)), src: cx.input(0, blocks.len(0)) }, vec![]);
        }
        return em.finish(0);
    }
    let ph = phase(&cx, &blocks, res_off, &mut em);
    em.finish(ph.scratch_bytes)
}

/// Rank `shape.rank`'s schedule of a reduce-scatter with per-rank blocks (MPI's
/// `Reduce_scatter`, out of place): block `p` of the input is `lens[p]` bytes, the blocks
/// consecutive; this rank's block of the reduction lands at the start of `Output`. The same
/// chunked, windowed exchange as the equal-block form.
pub(in crate::algo) fn build_v(shape: &Shape, lens: &[usize]) -> Schedule {
    let cx = Geometry::new(shape);
    let blocks = Blocks::from_lens(lens);
    let mut em = Emitter::new(LOOKAHEAD);
    if cx.n == 1 {
        if blocks.len(0) > 0 {
            em.now(Action::Copy { dst: cx.output(0, blocks.len(0)), src: cx.input(0, blocks.len(0)) }, vec![]);
        }
        return em.finish(0);
    }
    let ph = phase(&cx, &blocks, 0, &mut em);
    em.finish(ph.scratch_bytes)
}

/// What [`phase`] leaves for the steps after it.
pub(super) struct Phase {
    /// Index of the send of chunk `c` of block `p` to rank `p`: `sends[p][c]`.
    pub(super) sends: Vec<Vec<usize>>,
    pub(super) scratch_bytes: usize,
}

/// Emits the reduce-scatter of `blocks` of the input (read through [`Geometry::input`] at the
/// blocks' offsets), reducing block `rank` into `Output` at `res_off`. The reduction of own
/// chunk `c` is held back under `Key::Reduce(c)`. Needs `n >= 2`.
pub(super) fn phase(cx: &Geometry, blocks: &Blocks, res_off: usize, em: &mut Emitter<Key>) -> Phase {
    let (n, r) = (cx.n, cx.rank);
    let chunks: Vec<Vec<(usize, usize)>> = (0..n).map(|j| cx.chunks(blocks.len(j))).collect();
    let slot_len = cx.chunk_cap(blocks.len(r));
    // Slots per peer: no more than the chunks.
    let per = chunks[r].len().clamp(1, cx.slots);
    let slot = |k: usize, c: usize, len: usize| cx.scratch(((k - 1) * per + c % per) * slot_len, len);
    let mut sends: Vec<Vec<usize>> = vec![Vec::new(); n];
    let rounds = chunks.iter().map(Vec::len).max().unwrap_or(0);
    for c in 0..rounds {
        let mut recvs = Vec::with_capacity(n - 1);
        for k in 1..n {
            let p = cx.peer(k);
            if let Some(&(_, len)) = chunks[r].get(c) {
                let deps = if c >= cx.slots { vec![em.idx(Key::Reduce(c - cx.slots))] } else { vec![] };
                recvs.push(em.now(Action::Recv { peer: p, dst: slot(k, c, len) }, deps));
            }
            if let Some(&(off, len)) = chunks[p].get(c) {
                sends[p].push(em.now(Action::Send { peer: p, src: cx.input(blocks.off(p) + off, len) }, vec![]));
            }
        }
        if let Some(&(off, len)) = chunks[r].get(c) {
            let srcs = (0..n).map(|q| if q == r { cx.input(blocks.off(r) + off, len) } else { slot(cx.back(q, r), c, len) }).collect();
            em.later(Key::Reduce(c), Action::ReduceMany { dst: cx.output(res_off + off, len), srcs }, recvs);
        }
    }
    let slots_per_peer = chunks[r].len().min(cx.slots);
    Phase { sends, scratch_bytes: (n - 1) * slots_per_peer * slot_len }
}
