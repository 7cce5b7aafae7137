//! Bruck allreduce: every chunk of every rank's input is gathered by Bruck's dissemination
//! (`ceil(log2 n)` rounds, `(n - 1)` times the chunk received per rank) into scratch, then
//! reduced with one `ReduceMany` over the `n` inputs in rank order (bit-equal to the
//! reference `reduce_many`, as oneshot; `Avg` divides by `n`, exact for integers). For
//! small messages where a message costs more than its bytes: on 4 ranks each rank sends 2
//! messages where oneshot sends 3.

use super::super::plan::{Emitter, Geometry, LOOKAHEAD};
use super::super::{Action, Schedule, Shape};

pub(in crate::algo) fn build(shape: &Shape) -> Schedule {
    let cx = Geometry::new(shape);
    let (n, r) = (cx.n, cx.rank);
    let total = cx.count * cx.elem;
    let mut em = Emitter::<()>::new(LOOKAHEAD);
    if n == 1 {
        if !cx.in_place {
            em.now(Action::Copy { dst: cx.output(0, total), src: cx.input(0, total) }, vec![]);
        }
        return em.finish(0);
    }
    for (off, len) in cx.chunks(total) {
        // Chunk `c`'s n pieces sit together, from n times the chunk's offset.
        let base = n * off;
        let deps = super::gather(&cx, &mut em, cx.input(off, len), base, len);
        let srcs = (0..n).map(|q| cx.scratch(base + cx.back(q, r) * len, len)).collect();
        em.now(Action::ReduceMany { dst: cx.output(off, len), srcs }, deps);
    }
    em.finish(n * total)
}
