//! AVX2 + F16C kernels.
//!
//! f32, f16 and bf16 are hand-written: blocks of 16 elements as two vectors of 8 f32, f16 widened and rounded by
//! `vcvtph2ps` / `vcvtps2ph` (round to nearest-even), bf16 widened by a 16-bit shift and rounded
//! by integer round-to-nearest-even. Tails (fewer than 16 elements) use the per-element
//! arithmetic of the reference. f64 and the integers use the portable loops compiled for AVX2.

use std::arch::x86_64::*;

use super::{with_op, MAX, MIN, PROD, SUM};
use crate::arith::{Arith, CANONICAL_NAN_F32};
use crate::{bf16, f16, portable, ReduceOp};

/// Elements per block.
const LANES: usize = 16;
/// Round to nearest-even (the F16C immediate has no exception-suppression bit).
const RNE: i32 = _MM_FROUND_TO_NEAREST_INT;

/// One element op on 8 f32 lanes with the crate's semantics (canonical NaN, -0 < +0).
#[inline]
#[target_feature(enable = "avx2")]
fn apply<const OP: u8>(a: __m256, b: __m256) -> __m256 {
    match OP {
        SUM => _mm256_add_ps(a, b),
        PROD => _mm256_mul_ps(a, b),
        _ => {
            // min/max_ps pick correctly whenever a != b and neither is NaN.
            let (r, eq_val) = if OP == MIN {
                (_mm256_min_ps(a, b), _mm256_or_ps(a, b))
            } else {
                debug_assert_eq!(OP, MAX);
                (_mm256_max_ps(a, b), _mm256_and_ps(a, b))
            };
            // Equal lanes differ at most in a zero's sign: OR (min) / AND (max) orders -0 < +0.
            let r = _mm256_blendv_ps(r, eq_val, _mm256_cmp_ps::<_CMP_EQ_OQ>(a, b));
            let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(a, b);
            _mm256_blendv_ps(r, _mm256_castsi256_ps(_mm256_set1_epi32(CANONICAL_NAN_F32 as i32)), nan)
        }
    }
}

/// 16 elements widened to f32, as two vectors. The lane order inside a block is the codec's
/// own (bf16 interleaves); loads and stores of one codec are inverse to each other, and ops are
/// lane-wise, so the order never shows.
type Block = (__m256, __m256);

/// Loads 16 f32.
///
/// # Safety
///
/// 16 elements must be readable at `p`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn ld_f32(p: *const f32) -> Block {
    // SAFETY: the caller guarantees 16 readable elements; the loads are unaligned.
    unsafe { (_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))) }
}

/// Stores 16 f32.
///
/// # Safety
///
/// 16 elements must be writable at `p`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn st_f32(p: *mut f32, v: Block) {
    // SAFETY: the caller guarantees 16 writable elements; the stores are unaligned.
    unsafe {
        _mm256_storeu_ps(p, v.0);
        _mm256_storeu_ps(p.add(8), v.1);
    }
}

/// Loads 16 f16 and widens them to f32 (exact).
///
/// # Safety
///
/// 16 elements must be readable at `p`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn ld_f16(p: *const f16) -> Block {
    // SAFETY: the caller guarantees 16 readable elements (32 bytes); the loads are unaligned.
    let (lo, hi) = unsafe { (_mm_loadu_si128(p.cast::<__m128i>()), _mm_loadu_si128(p.add(8).cast::<__m128i>())) };
    (_mm256_cvtph_ps(lo), _mm256_cvtph_ps(hi))
}

/// Rounds 16 f32 to f16 (nearest-even) and stores them.
///
/// # Safety
///
/// 16 elements must be writable at `p`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn st_f16(p: *mut f16, v: Block) {
    let (lo, hi) = (_mm256_cvtps_ph::<RNE>(v.0), _mm256_cvtps_ph::<RNE>(v.1));
    // SAFETY: the caller guarantees 16 writable elements (32 bytes); the stores are unaligned.
    unsafe {
        _mm_storeu_si128(p.cast::<__m128i>(), lo);
        _mm_storeu_si128(p.add(8).cast::<__m128i>(), hi);
    }
}

/// Loads 16 bf16 and widens them to f32 (exact: the bf16 bits become the high half of each
/// f32). Interleaving with zero keeps each 128-bit half in place: the block holds elements
/// 0-3 and 8-11 in `.0`, 4-7 and 12-15 in `.1`.
///
/// # Safety
///
/// 16 elements must be readable at `p`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn ld_bf16(p: *const bf16) -> Block {
    // SAFETY: the caller guarantees 16 readable elements (32 bytes); the load is unaligned.
    let x = unsafe { _mm256_loadu_si256(p.cast::<__m256i>()) };
    let z = _mm256_setzero_si256();
    (_mm256_castsi256_ps(_mm256_unpacklo_epi16(z, x)), _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, x)))
}

/// f32 -> bf16 bits in the low half of each 32-bit lane, round to nearest-even in integer
/// arithmetic (subnormals kept; NaN: the high half with the quiet bit set, as `half` does).
#[inline]
#[target_feature(enable = "avx2")]
fn round_bf16(v: __m256) -> __m256i {
    let x = _mm256_castps_si256(v);
    let hi = _mm256_srli_epi32::<16>(x);
    let lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
    let bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF));
    let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(x, bias));
    let quiet = _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
    let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
    _mm256_blendv_epi8(rounded, quiet, nan)
}

/// Rounds a block to bf16 and stores it (the inverse of [`ld_bf16`]: the per-128-bit-lane
/// unsigned pack puts elements back in order; every lane is <= 0xFFFF, so it never saturates).
///
/// # Safety
///
/// 16 elements must be writable at `p`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn st_bf16(p: *mut bf16, v: Block) {
    let h = _mm256_packus_epi32(round_bf16(v.0), round_bf16(v.1));
    // SAFETY: the caller guarantees 16 writable elements (32 bytes); the store is unaligned.
    unsafe { _mm256_storeu_si256(p.cast::<__m256i>(), h) }
}

/// [`apply`] on both halves of a block.
#[inline]
#[target_feature(enable = "avx2")]
fn apply2<const OP: u8>(a: Block, b: Block) -> Block {
    (apply::<OP>(a.0, b.0), apply::<OP>(a.1, b.1))
}

/// Divides both halves of a block by `count`.
#[inline]
#[target_feature(enable = "avx2")]
fn div2(a: Block, count: __m256) -> Block {
    (_mm256_div_ps(a.0, count), _mm256_div_ps(a.1, count))
}

/// Stamps out `reduce_into`, `reduce_many` and `finish_avg` for one element type from its
/// load/store pair.
macro_rules! kernels {
    ($feat:literal, $T:ty, $ld:path, $st:path) => {
        use super::*;

        #[target_feature(enable = $feat)]
        fn into_op<const OP: u8>(op: ReduceOp, acc: &mut [$T], src: &[$T]) {
            assert_eq!(acc.len(), src.len());
            let n = acc.len();
            let a = acc.as_mut_ptr();
            let s = src.as_ptr();
            let mut i = 0;
            while i + 4 * LANES <= n {
                // SAFETY: i + 64 <= n = acc.len() = src.len(): all 64 elements are in bounds of
                // both slices, which do not overlap.
                unsafe {
                    let x0 = $ld(a.add(i));
                    let x1 = $ld(a.add(i + LANES));
                    let x2 = $ld(a.add(i + 2 * LANES));
                    let x3 = $ld(a.add(i + 3 * LANES));
                    let y0 = $ld(s.add(i));
                    let y1 = $ld(s.add(i + LANES));
                    let y2 = $ld(s.add(i + 2 * LANES));
                    let y3 = $ld(s.add(i + 3 * LANES));
                    $st(a.add(i), apply2::<OP>(x0, y0));
                    $st(a.add(i + LANES), apply2::<OP>(x1, y1));
                    $st(a.add(i + 2 * LANES), apply2::<OP>(x2, y2));
                    $st(a.add(i + 3 * LANES), apply2::<OP>(x3, y3));
                }
                i += 4 * LANES;
            }
            while i + LANES <= n {
                // SAFETY: i + 16 <= n: all 16 elements are in bounds of both slices.
                unsafe { $st(a.add(i), apply2::<OP>($ld(a.add(i)), $ld(s.add(i)))) };
                i += LANES;
            }
            portable::reduce_into(op, &mut acc[i..], &src[i..]);
        }

        #[target_feature(enable = $feat)]
        fn many_op<const OP: u8, const AVG: bool>(op: ReduceOp, srcs: &[&[$T]], out: &mut [$T]) {
            let n = out.len();
            assert!(!srcs.is_empty() && srcs.iter().all(|s| s.len() == n));
            let count = _mm256_set1_ps(srcs.len() as f32);
            let (first, rest) = (srcs[0].as_ptr(), &srcs[1..]);
            let o = out.as_mut_ptr();
            let mut i = 0;
            while i + 4 * LANES <= n {
                // SAFETY: i + 64 <= n and every source and `out` hold n elements; `out` is
                // exclusively borrowed, so it overlaps no source.
                unsafe {
                    let mut x0 = $ld(first.add(i));
                    let mut x1 = $ld(first.add(i + LANES));
                    let mut x2 = $ld(first.add(i + 2 * LANES));
                    let mut x3 = $ld(first.add(i + 3 * LANES));
                    for s in rest {
                        let p = s.as_ptr();
                        x0 = apply2::<OP>(x0, $ld(p.add(i)));
                        x1 = apply2::<OP>(x1, $ld(p.add(i + LANES)));
                        x2 = apply2::<OP>(x2, $ld(p.add(i + 2 * LANES)));
                        x3 = apply2::<OP>(x3, $ld(p.add(i + 3 * LANES)));
                    }
                    if AVG {
                        x0 = div2(x0, count);
                        x1 = div2(x1, count);
                        x2 = div2(x2, count);
                        x3 = div2(x3, count);
                    }
                    $st(o.add(i), x0);
                    $st(o.add(i + LANES), x1);
                    $st(o.add(i + 2 * LANES), x2);
                    $st(o.add(i + 3 * LANES), x3);
                }
                i += 4 * LANES;
            }
            while i + LANES <= n {
                // SAFETY: i + 16 <= n: all 16 elements are in bounds of every source and of `out`.
                unsafe {
                    let mut x = $ld(first.add(i));
                    for s in rest {
                        x = apply2::<OP>(x, $ld(s.as_ptr().add(i)));
                    }
                    if AVG {
                        x = div2(x, count);
                    }
                    $st(o.add(i), x);
                }
                i += LANES;
            }
            for (j, o) in out.iter_mut().enumerate().skip(i) {
                *o = portable::reduce_many_at(op, srcs, j);
            }
        }

        /// `acc[i] = acc[i] op src[i]`, rounded to the element type (Avg steps are sums).
        #[target_feature(enable = $feat)]
        pub(crate) fn reduce_into(op: ReduceOp, acc: &mut [$T], src: &[$T]) {
            with_op!(op, OP => into_op::<OP>(op, acc, src))
        }

        /// The rank-order reduction of `srcs` into `out`, accumulating in f32.
        #[target_feature(enable = $feat)]
        pub(crate) fn reduce_many(op: ReduceOp, srcs: &[&[$T]], out: &mut [$T]) {
            if op == ReduceOp::Avg {
                many_op::<SUM, true>(op, srcs, out)
            } else {
                with_op!(op, OP => many_op::<OP, false>(op, srcs, out))
            }
        }

        /// `out[i] = round(0 + w_0 · x_0[i] + w_1 · x_1[i] + ...)` for `(x_k, w_k)` in
        /// `srcs`, in f32, each product and sum rounded (never fused), in order.
        #[target_feature(enable = $feat)]
        pub(crate) fn weighted_sum(srcs: &[(&[$T], f32)], out: &mut [$T]) {
            let n = out.len();
            assert!(srcs.iter().all(|(s, _)| s.len() == n));
            let o = out.as_mut_ptr();
            let z = _mm256_setzero_ps();
            let step = |a: Block, w: __m256, x: Block| {
                (_mm256_add_ps(a.0, _mm256_mul_ps(w, x.0)), _mm256_add_ps(a.1, _mm256_mul_ps(w, x.1)))
            };
            let mut i = 0;
            while i + 2 * LANES <= n {
                // SAFETY: i + 32 <= n and every source and `out` hold n elements; `out` is
                // exclusively borrowed, so it overlaps no source.
                unsafe {
                    let (mut a0, mut a1) = ((z, z), (z, z));
                    for &(s, w) in srcs {
                        let (p, w) = (s.as_ptr(), _mm256_set1_ps(w));
                        a0 = step(a0, w, $ld(p.add(i)));
                        a1 = step(a1, w, $ld(p.add(i + LANES)));
                    }
                    $st(o.add(i), a0);
                    $st(o.add(i + LANES), a1);
                }
                i += 2 * LANES;
            }
            while i + LANES <= n {
                // SAFETY: i + 16 <= n: all 16 elements are in bounds of every source and of `out`.
                unsafe {
                    let mut a = (z, z);
                    for &(s, w) in srcs {
                        a = step(a, _mm256_set1_ps(w), $ld(s.as_ptr().add(i)));
                    }
                    $st(o.add(i), a);
                }
                i += LANES;
            }
            portable::weighted_sum_from(srcs, out, i);
        }

        /// `acc[i] = acc[i] / n` in f32, rounded once.
        #[target_feature(enable = $feat)]
        pub(crate) fn finish_avg(acc: &mut [$T], n: usize) {
            let count = _mm256_set1_ps(n as f32);
            let len = acc.len();
            let a = acc.as_mut_ptr();
            let mut i = 0;
            while i + LANES <= len {
                // SAFETY: i + 16 <= len: all 16 elements are in bounds.
                unsafe { $st(a.add(i), div2($ld(a.add(i)), count)) };
                i += LANES;
            }
            portable::finish_avg(&mut acc[i..], n);
        }
    };
}

/// f32 kernels.
pub(crate) mod f32k {
    kernels!("avx2,f16c", f32, ld_f32, st_f32);
}

/// f16 kernels.
pub(crate) mod f16k {
    kernels!("avx2,f16c", f16, ld_f16, st_f16);
}

/// bf16 kernels.
pub(crate) mod bf16k {
    kernels!("avx2,f16c", bf16, ld_bf16, st_bf16);
}

/// The portable `reduce_into` compiled for AVX2.
#[target_feature(enable = "avx2,f16c")]
pub(crate) fn reduce_into_generic<T: Arith>(op: ReduceOp, acc: &mut [T], src: &[T]) {
    portable::reduce_into(op, acc, src)
}

/// The portable `reduce_many` compiled for AVX2.
#[target_feature(enable = "avx2,f16c")]
pub(crate) fn reduce_many_generic<T: Arith>(op: ReduceOp, srcs: &[&[T]], out: &mut [T]) {
    portable::reduce_many(op, srcs, out)
}

/// The portable `finish_avg` compiled for AVX2.
#[target_feature(enable = "avx2,f16c")]
pub(crate) fn finish_avg_generic<T: Arith>(acc: &mut [T], n: usize) {
    portable::finish_avg(acc, n)
}

super::portable_rows!("avx2,f16c", "AVX2");
