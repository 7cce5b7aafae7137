//! AVX-512 kernels (F, BW, VL, DQ; BF16 for the native bf16 rounding).
//!
//! f32, f16 and bf16 are hand-written: 16 lanes of f32 per vector, f16 widened and rounded by
//! `vcvtph2ps` / `vcvtps2ph` (round to nearest-even), bf16 widened by a 16-bit shift and
//! rounded either by `vcvtneps2bf16` (AVX512-BF16) or by integer round-to-nearest-even. Tails
//! use masked loads and stores. f64 and the integers use the portable loops compiled for
//! AVX-512.

use std::arch::x86_64::*;

use super::{with_op, MAX, MIN, PROD, SUM};
use crate::arith::{Arith, CANONICAL_NAN_F32};
use crate::{bf16, f16, portable, ReduceOp};

const LANES: usize = 16;
const FULL: __mmask16 = 0xFFFF;
/// Round to nearest-even, exceptions suppressed.
const RNE: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

/// The mask of the first `min(rem, 16)` lanes.
#[inline(always)]
fn tail_mask(rem: usize) -> __mmask16 {
    if rem >= LANES {
        FULL
    } else {
        ((1u32 << rem) - 1) as __mmask16
    }
}

/// One element op on 16 f32 lanes with the crate's semantics (canonical NaN, -0 < +0).
#[inline]
#[target_feature(enable = "avx512f")]
fn apply<const OP: u8>(a: __m512, b: __m512) -> __m512 {
    match OP {
        SUM => _mm512_add_ps(a, b),
        PROD => _mm512_mul_ps(a, b),
        _ => {
            let (ai, bi) = (_mm512_castps_si512(a), _mm512_castps_si512(b));
            // min/max_ps pick correctly whenever a != b and neither is NaN.
            let (r, eq_val) = if OP == MIN {
                (_mm512_min_ps(a, b), _mm512_or_si512(ai, bi))
            } else {
                debug_assert_eq!(OP, MAX);
                (_mm512_max_ps(a, b), _mm512_and_si512(ai, bi))
            };
            // Equal lanes differ at most in a zero's sign: OR (min) / AND (max) orders -0 < +0.
            let eq = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(a, b);
            let r = _mm512_mask_mov_ps(r, eq, _mm512_castsi512_ps(eq_val));
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(a, b);
            _mm512_mask_mov_ps(r, nan, _mm512_castsi512_ps(_mm512_set1_epi32(CANONICAL_NAN_F32 as i32)))
        }
    }
}

/// Loads the lanes of `k` from `p` as f32.
///
/// # Safety
///
/// Every lane enabled in `k` must be readable at `p`.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn ld_f32(p: *const f32, k: __mmask16) -> __m512 {
    // SAFETY: the caller guarantees the enabled lanes are readable; masked lanes are not accessed.
    unsafe { _mm512_maskz_loadu_ps(k, p) }
}

/// Stores the lanes of `k` of `v` to `p`.
///
/// # Safety
///
/// Every lane enabled in `k` must be writable at `p`.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn st_f32(p: *mut f32, k: __mmask16, v: __m512) {
    // SAFETY: the caller guarantees the enabled lanes are writable; masked lanes are not accessed.
    unsafe { _mm512_mask_storeu_ps(p, k, v) }
}

/// Loads the lanes of `k` from `p` and widens them from f16 to f32 (exact).
///
/// # Safety
///
/// Every lane enabled in `k` must be readable at `p`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn ld_f16(p: *const f16, k: __mmask16) -> __m512 {
    // SAFETY: the caller guarantees the enabled lanes are readable; masked lanes are not accessed.
    let h = unsafe { _mm256_maskz_loadu_epi16(k, p.cast::<i16>()) };
    _mm512_cvtph_ps(h)
}

/// Rounds `v` to f16 (nearest-even) and stores the lanes of `k` to `p`.
///
/// # Safety
///
/// Every lane enabled in `k` must be writable at `p`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn st_f16(p: *mut f16, k: __mmask16, v: __m512) {
    let h = _mm512_cvtps_ph::<RNE>(v);
    // SAFETY: the caller guarantees the enabled lanes are writable; masked lanes are not accessed.
    unsafe { _mm256_mask_storeu_epi16(p.cast::<i16>(), k, h) }
}

/// Loads the lanes of `k` from `p` and widens them from bf16 to f32 (exact: a 16-bit shift).
///
/// # Safety
///
/// Every lane enabled in `k` must be readable at `p`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn ld_bf16(p: *const bf16, k: __mmask16) -> __m512 {
    // SAFETY: the caller guarantees the enabled lanes are readable; masked lanes are not accessed.
    let h = unsafe { _mm256_maskz_loadu_epi16(k, p.cast::<i16>()) };
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
}

/// f32 -> bf16 bits in the low half of each 32-bit lane, round to nearest-even in integer
/// arithmetic (subnormals kept; NaN: the high half with the quiet bit set, as `half` does).
#[inline]
#[target_feature(enable = "avx512f")]
fn round_bf16_int(v: __m512) -> __m512i {
    let x = _mm512_castps_si512(v);
    let hi = _mm512_srli_epi32::<16>(x);
    let lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    let bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF));
    let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(x, bias));
    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
    _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)))
}

/// Rounds `v` to bf16 in integer arithmetic and stores the lanes of `k` to `p`.
///
/// # Safety
///
/// Every lane enabled in `k` must be writable at `p`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn st_bf16(p: *mut bf16, k: __mmask16, v: __m512) {
    let h = _mm512_cvtepi32_epi16(round_bf16_int(v));
    // SAFETY: the caller guarantees the enabled lanes are writable; masked lanes are not accessed.
    unsafe { _mm256_mask_storeu_epi16(p.cast::<i16>(), k, h) }
}

/// Rounds `v` to bf16 with `vcvtneps2bf16` and stores the lanes of `k` to `p`.
///
/// `vcvtneps2bf16` rounds to nearest-even and quiets NaNs like the reference, but flushes
/// subnormal inputs to zero; vectors with a subnormal lane (which is what a subnormal bf16
/// result comes from, bf16 and f32 sharing their exponent range) take the integer rounding.
///
/// # Safety
///
/// Every lane enabled in `k` must be writable at `p`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")]
unsafe fn st_bf16_native(p: *mut bf16, k: __mmask16, v: __m512) {
    /// `vfpclassps` category: denormal.
    const DENORMAL: i32 = 0x20;
    let tiny = _mm512_fpclass_ps_mask::<DENORMAL>(v);
    let h = if tiny == 0 {
        let b: __m256bh = _mm512_cvtneps_pbh(v);
        // SAFETY: __m256bh and __m256i are both 256-bit plain vector types; any bits are valid.
        unsafe { std::mem::transmute::<__m256bh, __m256i>(b) }
    } else {
        _mm512_cvtepi32_epi16(round_bf16_int(v))
    };
    // SAFETY: the caller guarantees the enabled lanes are writable; masked lanes are not accessed.
    unsafe { _mm256_mask_storeu_epi16(p.cast::<i16>(), k, h) }
}

/// Stamps out `reduce_into`, `reduce_many` and `finish_avg` for one element type from its
/// load/store pair.
macro_rules! kernels {
    ($feat:literal, $T:ty, $ld:path, $st:path) => {
        use super::*;

        #[target_feature(enable = $feat)]
        fn into_op<const OP: u8>(acc: &mut [$T], src: &[$T]) {
            assert_eq!(acc.len(), src.len());
            let n = acc.len();
            let a = acc.as_mut_ptr();
            let s = src.as_ptr();
            let mut i = 0;
            while i + 4 * LANES <= n {
                // SAFETY: i + 64 <= n = acc.len() = src.len(): all 64 elements are in bounds of
                // both slices, which do not overlap.
                unsafe {
                    let x0 = $ld(a.add(i), FULL);
                    let x1 = $ld(a.add(i + LANES), FULL);
                    let x2 = $ld(a.add(i + 2 * LANES), FULL);
                    let x3 = $ld(a.add(i + 3 * LANES), FULL);
                    let y0 = $ld(s.add(i), FULL);
                    let y1 = $ld(s.add(i + LANES), FULL);
                    let y2 = $ld(s.add(i + 2 * LANES), FULL);
                    let y3 = $ld(s.add(i + 3 * LANES), FULL);
                    $st(a.add(i), FULL, apply::<OP>(x0, y0));
                    $st(a.add(i + LANES), FULL, apply::<OP>(x1, y1));
                    $st(a.add(i + 2 * LANES), FULL, apply::<OP>(x2, y2));
                    $st(a.add(i + 3 * LANES), FULL, apply::<OP>(x3, y3));
                }
                i += 4 * LANES;
            }
            while i < n {
                let k = tail_mask(n - i);
                // SAFETY: i < n, and k enables only the lanes i..min(i + 16, n), in bounds of both.
                unsafe {
                    let x = $ld(a.add(i), k);
                    let y = $ld(s.add(i), k);
                    $st(a.add(i), k, apply::<OP>(x, y));
                }
                i += LANES;
            }
        }

        #[target_feature(enable = $feat)]
        fn many_op<const OP: u8, const AVG: bool>(srcs: &[&[$T]], out: &mut [$T]) {
            let n = out.len();
            assert!(!srcs.is_empty() && srcs.iter().all(|s| s.len() == n));
            let count = _mm512_set1_ps(srcs.len() as f32);
            let (first, rest) = (srcs[0].as_ptr(), &srcs[1..]);
            let o = out.as_mut_ptr();
            let mut i = 0;
            while i + 4 * LANES <= n {
                // SAFETY: i + 64 <= n and every source and `out` hold n elements; `out` is
                // exclusively borrowed, so it overlaps no source.
                unsafe {
                    let mut x0 = $ld(first.add(i), FULL);
                    let mut x1 = $ld(first.add(i + LANES), FULL);
                    let mut x2 = $ld(first.add(i + 2 * LANES), FULL);
                    let mut x3 = $ld(first.add(i + 3 * LANES), FULL);
                    for s in rest {
                        let p = s.as_ptr();
                        x0 = apply::<OP>(x0, $ld(p.add(i), FULL));
                        x1 = apply::<OP>(x1, $ld(p.add(i + LANES), FULL));
                        x2 = apply::<OP>(x2, $ld(p.add(i + 2 * LANES), FULL));
                        x3 = apply::<OP>(x3, $ld(p.add(i + 3 * LANES), FULL));
                    }
                    if AVG {
                        x0 = _mm512_div_ps(x0, count);
                        x1 = _mm512_div_ps(x1, count);
                        x2 = _mm512_div_ps(x2, count);
                        x3 = _mm512_div_ps(x3, count);
                    }
                    $st(o.add(i), FULL, x0);
                    $st(o.add(i + LANES), FULL, x1);
                    $st(o.add(i + 2 * LANES), FULL, x2);
                    $st(o.add(i + 3 * LANES), FULL, x3);
                }
                i += 4 * LANES;
            }
            while i < n {
                let k = tail_mask(n - i);
                // SAFETY: i < n, and k enables only the lanes i..min(i + 16, n), in bounds of
                // every source and of `out`.
                unsafe {
                    let mut x = $ld(first.add(i), k);
                    for s in rest {
                        x = apply::<OP>(x, $ld(s.as_ptr().add(i), k));
                    }
                    if AVG {
                        x = _mm512_div_ps(x, count);
                    }
                    $st(o.add(i), k, x);
                }
                i += LANES;
            }
        }

        /// `acc[i] = acc[i] op src[i]`, rounded to the element type (Avg steps are sums).
        #[target_feature(enable = $feat)]
        pub(crate) fn reduce_into(op: ReduceOp, acc: &mut [$T], src: &[$T]) {
            with_op!(op, OP => into_op::<OP>(acc, src))
        }

        /// The rank-order reduction of `srcs` into `out`, accumulating in f32.
        #[target_feature(enable = $feat)]
        pub(crate) fn reduce_many(op: ReduceOp, srcs: &[&[$T]], out: &mut [$T]) {
            if op == ReduceOp::Avg {
                many_op::<SUM, true>(srcs, out)
            } else {
                with_op!(op, OP => many_op::<OP, false>(srcs, out))
            }
        }

        /// `out[i] = round(0 + w_0 · x_0[i] + w_1 · x_1[i] + ...)` for `(x_k, w_k)` in
        /// `srcs`, in f32, each product and sum rounded (never fused), in order.
        #[target_feature(enable = $feat)]
        pub(crate) fn weighted_sum(srcs: &[(&[$T], f32)], out: &mut [$T]) {
            let n = out.len();
            assert!(srcs.iter().all(|(s, _)| s.len() == n));
            let o = out.as_mut_ptr();
            let z = _mm512_setzero_ps();
            let mut i = 0;
            while i + 2 * LANES <= n {
                // SAFETY: i + 32 <= n and every source and `out` hold n elements; `out` is
                // exclusively borrowed, so it overlaps no source.
                unsafe {
                    let (mut a0, mut a1) = (z, z);
                    for &(s, w) in srcs {
                        let (p, w) = (s.as_ptr(), _mm512_set1_ps(w));
                        a0 = _mm512_add_ps(a0, _mm512_mul_ps(w, $ld(p.add(i), FULL)));
                        a1 = _mm512_add_ps(a1, _mm512_mul_ps(w, $ld(p.add(i + LANES), FULL)));
                    }
                    $st(o.add(i), FULL, a0);
                    $st(o.add(i + LANES), FULL, a1);
                }
                i += 2 * LANES;
            }
            while i < n {
                let k = tail_mask(n - i);
                // SAFETY: i < n, and k enables only the lanes i..min(i + 16, n), in bounds of
                // every source and of `out`.
                unsafe {
                    let mut a = z;
                    for &(s, w) in srcs {
                        a = _mm512_add_ps(a, _mm512_mul_ps(_mm512_set1_ps(w), $ld(s.as_ptr().add(i), k)));
                    }
                    $st(o.add(i), k, a);
                }
                i += LANES;
            }
        }

        /// `acc[i] = acc[i] / n` in f32, rounded once.
        #[target_feature(enable = $feat)]
        pub(crate) fn finish_avg(acc: &mut [$T], n: usize) {
            let count = _mm512_set1_ps(n as f32);
            let len = acc.len();
            let a = acc.as_mut_ptr();
            let mut i = 0;
            while i < len {
                let k = tail_mask(len - i);
                // SAFETY: i < len, and k enables only the lanes i..min(i + 16, len), in bounds.
                unsafe { $st(a.add(i), k, _mm512_div_ps($ld(a.add(i), k), count)) };
                i += LANES;
            }
        }
    };
}

/// f32 kernels.
pub(crate) mod f32k {
    kernels!("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c", f32, ld_f32, st_f32);
}

/// f16 kernels.
pub(crate) mod f16k {
    kernels!("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c", f16, ld_f16, st_f16);
}

/// bf16 kernels, integer rounding.
pub(crate) mod bf16k {
    kernels!("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c", bf16, ld_bf16, st_bf16);
}

/// bf16 kernels, `vcvtneps2bf16` rounding.
pub(crate) mod bf16k_native {
    kernels!("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c,avx512bf16", bf16, ld_bf16, st_bf16_native);
}

/// The portable `reduce_into` compiled for AVX-512.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c")]
pub(crate) fn reduce_into_generic<T: Arith>(op: ReduceOp, acc: &mut [T], src: &[T]) {
    portable::reduce_into(op, acc, src)
}

/// The portable `reduce_many` compiled for AVX-512.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c")]
pub(crate) fn reduce_many_generic<T: Arith>(op: ReduceOp, srcs: &[&[T]], out: &mut [T]) {
    portable::reduce_many(op, srcs, out)
}

/// The portable `finish_avg` compiled for AVX-512.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c")]
pub(crate) fn finish_avg_generic<T: Arith>(acc: &mut [T], n: usize) {
    portable::finish_avg(acc, n)
}

super::portable_rows!("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c", "AVX-512");
