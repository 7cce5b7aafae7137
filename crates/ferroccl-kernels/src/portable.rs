//! Portable kernels: chunked loops over the reference's per-element arithmetic, written so the
//! compiler can vectorize them (the op is hoisted out of the loop, partial results of
//! `reduce_many` live in a small block of accumulators).
//!
//! They are the `Scalar` level and, compiled inside `#[target_feature]` wrappers, the AVX2 and
//! AVX-512 kernels of the types without hand-written intrinsics (f64 and the integers).

use crate::arith::Arith;
use crate::{bf16, ReduceOp};

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

/// `dst[i] = src[i]` as f32 (exact: bf16 is the top half of an f32).
pub(crate) fn widen_bf16(src: &[bf16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "widen_bf16: lengths differ");
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f32::from_bits(u32::from(s.to_bits()) << 16);
    }
}

/// `dst[i] = src[i]` rounded to bf16 as `bf16::from_f32` rounds (to nearest, ties to even;
/// subnormals kept; a NaN keeps its top half with the quiet bit set), branch-free so that
/// it vectorizes.
pub(crate) fn narrow_bf16(src: &[f32], dst: &mut [bf16]) {
    assert_eq!(src.len(), dst.len(), "narrow_bf16: lengths differ");
    for (d, &x) in dst.iter_mut().zip(src) {
        let b = x.to_bits();
        let nan = (b & 0x7fff_ffff) > 0x7f80_0000;
        let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
        *d = bf16::from_bits(if nan { ((b >> 16) | 0x40) as u16 } else { rounded as u16 });
    }
}

/// `out[i] = round(0 + w_0 · x_0[i] + w_1 · x_1[i] + ...)` in f32, each product and sum
/// rounded, in the order of `srcs`.
pub(crate) fn weighted_sum<T: Arith<Acc = f32>>(srcs: &[(&[T], f32)], out: &mut [T]) {
    assert!(srcs.iter().all(|(s, _)| s.len() == out.len()), "weighted_sum: a source's length differs from out's");
    weighted_sum_from(srcs, out, 0)
}

/// [`weighted_sum`] of the elements from `start` on (the SIMD kernels' tails).
pub(crate) fn weighted_sum_from<T: Arith<Acc = f32>>(srcs: &[(&[T], f32)], out: &mut [T], start: usize) {
    for (j, o) in out.iter_mut().enumerate().skip(start) {
        let mut acc = 0.0f32;
        for &(s, w) in srcs {
            acc += w * s[j].widen();
        }
        *o = T::narrow(acc);
    }
}

/// `acc[i] += w * x[i]`: a product, then a sum, each rounded (no fused multiply-add, so
/// every level gives the same bits).
pub(crate) fn scale_add(w: f32, x: &[f32], acc: &mut [f32]) {
    assert_eq!(x.len(), acc.len(), "scale_add: lengths differ");
    for (a, &v) in acc.iter_mut().zip(x) {
        *a += w * v;
    }
}
