//! One-shot allreduce: every rank sends its whole input to every other rank and receives
//! everyone's input into scratch (`(n - 1)` times the message), then reduces each chunk
//! with one `ReduceMany` over the `n` inputs in rank order (bit-equal to the reference
//! `reduce_many`; `Avg` divides by `n`, exact for integers). One latency, `(n - 1)` times the
//! message on the wire per rank: for small messages.

use super::super::plan::{Emitter, Geometry, LOOKAHEAD};
use super::super::{Action, Schedule, Shape};

pub(in crate::algo) fn build(shape: &Shape) -> Schedule {
    let cx = Geometry::new(shape);
    let (n, r) = (cx.n, cx.rank);
    let total = cx.count * cx.elem;
    let mut em = Emitter::<usize>::new(LOOKAHEAD);
    if n == 1 {
        if !cx.in_place {
            em.now(Action::Copy { dst: cx.output(0, total), src: cx.input(0, total) }, vec![]);
        }
        return em.finish(0);
    }
    let peer_buf = |k: usize, off: usize, len: usize| cx.scratch((k - 1) * total + off, len);
    for (c, &(off, len)) in cx.chunks(total).iter().enumerate() {
        let mut deps = Vec::with_capacity(2 * (n - 1));
        for k in 1..n {
            let p = cx.peer(k);
            deps.push(em.now(Action::Recv { peer: p, dst: peer_buf(k, off, len) }, vec![]));
            let send = em.now(Action::Send { peer: p, src: cx.input(off, len) }, vec![]);
            // In place, the reduction overwrites what the sends read.
            if cx.in_place {
                deps.push(send);
            }
        }
        let srcs = (0..n).map(|q| if q == r { cx.input(off, len) } else { peer_buf(cx.back(q, r), off, len) }).collect();
        em.later(c, Action::ReduceMany { dst: cx.output(off, len), srcs }, deps);
    }
    em.finish((n - 1) * total)
}
