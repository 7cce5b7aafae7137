//! Portable kernels: chunked loops over the reference's per-element arithmetic, written so the
//! compiler can vectorize them (the op is hoisted out of the loop, partial results of
//! `reduce_many` live in a small block of accumulators).
//!
//! They are the `Scalar` level and, compiled inside `#[target_feature]` wrappers, the AVX2 and
//! AVX-512 kernels of the types without hand-written intrinsics (f64 and the integers).

use crate::arith::Arith;
use crate::ReduceOp;

/// Elements per block of `reduce_many`.
const BLOCK: usize = 256;

#[inline(always)]
fn zip_with<T: Arith>(acc: &mut [T], src: &[T], f: impl Fn(T::Acc, T::Acc) -> T::Acc) {
    for (a, &s) in acc.iter_mut().zip(src) {
        *a = T::narrow(f(a.widen(), s.widen()));
    }
}

/// `acc[i] = acc[i] op src[i]` (Avg steps are sums). Lengths must be equal.
#[inline(always)]
pub(crate) fn reduce_into<T: Arith>(op: ReduceOp, acc: &mut [T], src: &[T]) {
    debug_assert_eq!(acc.len(), src.len());
    match op.step() {
        ReduceOp::Sum | ReduceOp::Avg => zip_with(acc, src, |a, b| T::combine(ReduceOp::Sum, a, b)),
        ReduceOp::Prod => zip_with(acc, src, |a, b| T::combine(ReduceOp::Prod, a, b)),
        ReduceOp::Min => zip_with(acc, src, |a, b| T::combine(ReduceOp::Min, a, b)),
        ReduceOp::Max => zip_with(acc, src, |a, b| T::combine(ReduceOp::Max, a, b)),
    }
}

#[inline(always)]
fn many_with<T: Arith>(srcs: &[&[T]], out: &mut [T], f: impl Fn(T::Acc, T::Acc) -> T::Acc, avg: bool) {
    let n = srcs.len();
    let mut acc = [T::Acc::default(); BLOCK];
    let mut start = 0;
    while start < out.len() {
        let len = BLOCK.min(out.len() - start);
        let acc = &mut acc[..len];
        for (a, &x) in acc.iter_mut().zip(&srcs[0][start..start + len]) {
            *a = x.widen();
        }
        for s in &srcs[1..] {
            for (a, &x) in acc.iter_mut().zip(&s[start..start + len]) {
                *a = f(*a, x.widen());
            }
        }
        for (o, &a) in out[start..start + len].iter_mut().zip(acc.iter()) {
            *o = T::narrow(if avg { T::acc_div(a, n) } else { a });
        }
        start += len;
    }
}

/// The rank-order reduction of `srcs` into `out`. `srcs` is non-empty, all lengths are equal.
#[inline(always)]
pub(crate) fn reduce_many<T: Arith>(op: ReduceOp, srcs: &[&[T]], out: &mut [T]) {
    debug_assert!(!srcs.is_empty() && srcs.iter().all(|s| s.len() == out.len()));
    match op {
        ReduceOp::Sum => many_with(srcs, out, |a, b| T::combine(ReduceOp::Sum, a, b), false),
        ReduceOp::Prod => many_with(srcs, out, |a, b| T::combine(ReduceOp::Prod, a, b), false),
        ReduceOp::Min => many_with(srcs, out, |a, b| T::combine(ReduceOp::Min, a, b), false),
        ReduceOp::Max => many_with(srcs, out, |a, b| T::combine(ReduceOp::Max, a, b), false),
        ReduceOp::Avg if T::IS_INT => {
            for (i, o) in out.iter_mut().enumerate() {
                *o = T::avg_many(srcs, i);
            }
        }
        ReduceOp::Avg => many_with(srcs, out, |a, b| T::combine(ReduceOp::Sum, a, b), true),
    }
}

/// `acc[i] = acc[i] / n`, `n >= 1`.
#[inline(always)]
pub(crate) fn finish_avg<T: Arith>(acc: &mut [T], n: usize) {
    for a in acc {
        *a = T::div(*a, n);
    }
}

/// The rank-order reduction of element `i` alone (tails of the SIMD kernels).
#[inline(always)]
pub(crate) fn reduce_many_at<T: Arith>(op: ReduceOp, srcs: &[&[T]], i: usize) -> T {
    if op == ReduceOp::Avg && T::IS_INT {
        return T::avg_many(srcs, i);
    }
    let step = op.step();
    let mut acc = srcs[0][i].widen();
    for s in &srcs[1..] {
        acc = T::combine(step, acc, s[i].widen());
    }
    if op == ReduceOp::Avg {
        acc = T::acc_div(acc, srcs.len());
    }
    T::narrow(acc)
}
