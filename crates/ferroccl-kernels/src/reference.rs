//! The scalar CPU reference: it *defines* what every reduction computes.
//!
//! Every fast kernel of this crate (SIMD or portable) must produce exactly the bytes this
//! module produces, for every element type, operation, length and input, with one exception:
//! where the reference result is a NaN, a kernel's result must be a NaN too, but its payload
//! may differ for [`Sum`](ReduceOp::Sum), [`Prod`](ReduceOp::Prod) and
//! [`Avg`](ReduceOp::Avg) (see "NaN" below). The tests of this crate check exactly that.
//!
//! # Arithmetic per element type
//!
//! * **f32, f64**: IEEE 754 binary32 / binary64 arithmetic in the element type itself, rounding
//!   to nearest, ties to even. Subnormal inputs and results are kept (no flush-to-zero, no
//!   denormals-are-zero): the kernels never change the floating-point control register.
//! * **f16, bf16**: each input is widened to f32 (exact), the operation is performed in f32
//!   (IEEE binary32, rounding to nearest-even), and the f32 result is rounded *once* to the
//!   element type, to nearest, ties to even, keeping subnormals and overflowing to infinity.
//!   Within one [`reduce_many`] call the accumulator stays in f32 across all inputs and is
//!   rounded only at the end; one [`reduce_into`] call rounds after its single step.
//! * **Integers** (i8, u8, i32, u32, i64, u64): [`Sum`](ReduceOp::Sum) and
//!   [`Prod`](ReduceOp::Prod) wrap (two's complement, modulo 2^bits);
//!   [`Min`](ReduceOp::Min) and [`Max`](ReduceOp::Max) are exact.
//!
//! # Min and Max on floats
//!
//! * NaN propagates: if either operand is a NaN, the result is the **canonical quiet NaN** of
//!   the type: positive sign, only the quiet bit set in the significand (f32 `0x7FC0_0000`,
//!   f64 `0x7FF8_0000_0000_0000`, f16 `0x7E00`, bf16 `0x7FC0`). Every kernel produces exactly
//!   this NaN for Min and Max.
//! * Zeros are ordered: -0.0 < +0.0, so `max(-0.0, +0.0) = +0.0` and `min(-0.0, +0.0) = -0.0`.
//! * Infinities and subnormals compare as IEEE numbers.
//!
//! # NaN from arithmetic
//!
//! Sum, Prod and Avg produce a NaN whenever IEEE arithmetic does (a NaN input, `inf - inf`,
//! `0 * inf`). Which NaN (sign and payload) is left unspecified: it is what the hardware's
//! IEEE operation returns, which is deterministic for given inputs and a given kernel, but
//! may differ between kernels or CPU architectures.
//!
//! # Avg
//!
//! Avg is the sum of the `n` contributions divided by `n` at the end.
//!
//! * Floats: the sum is accumulated as for Sum (in f32 for f16/bf16), then divided once by
//!   `n` converted to the accumulation type (f32 for f32, f16 and bf16; f64 for f64; exact for
//!   `n < 2^24`), and rounded once to the element type.
//! * Integers, in [`reduce_many`]: exact. The contributions are summed in `i128` (no
//!   overflow is possible), the sum is divided by `n` truncating toward zero (so the average of
//!   `-3` and `0` is `-1`), and the quotient, which lies between the smallest and the largest
//!   input, is converted back to the element type.
//!
//! # The two entry points
//!
//! * [`reduce_many`]`(op, srcs, out)` is the **rank-order reduction** and the reference result
//!   of an allreduce over `srcs.len()` ranks: `out[i] = (...((srcs[0][i] op srcs[1][i]) op
//!   srcs[2][i]) ...) op srcs[n-1][i]`, evaluated left to right in the accumulation type (f32
//!   for f32, f16 and bf16; f64 for f64; the element type, wrapping, for integer Sum and Prod;
//!   exact for integer Min and Max; `i128` for integer Avg), rounded once at the end; Avg then
//!   divides by `n = srcs.len()` as described above.
//! * [`reduce_into`]`(op, acc, src)` is one pairwise step, `acc[i] = acc[i] op src[i]`,
//!   rounded to the element type after the step: what one step of a ring does when partial
//!   results travel in their element type. For Avg the step is a Sum; [`finish_avg`]`(acc, n)`
//!   then divides each element by `n` (floats: in the accumulation type, rounding once).
//!   Because the partial sums are rounded to the element type after every step, a chain of
//!   `reduce_into` calls on f16/bf16 data can differ from `reduce_many` on the same inputs.
//!
//! **Integer Avg through `reduce_into` + `finish_avg` is exact only if the running sum never
//! wraps**: the pairwise steps are wrapping sums in the element type, and `finish_avg` divides
//! the (wrapped) sum, read as a value of the element type, by `n`, truncating toward zero. The
//! collectives layer computes integer Avg with `reduce_many` (or with a wider type) when the
//! sum may not fit.
//!
//! ```
//! use ferroccl_kernels::{reference, ReduceOp, f16};
//!
//! // -0.0 < +0.0 and NaN propagation for Max.
//! let mut acc = [-0.0f32, 1.0];
//! reference::reduce_into(ReduceOp::Max, &mut acc, &[0.0, f32::NAN]);
//! assert_eq!(acc[0].to_bits(), 0.0f32.to_bits());
//! assert_eq!(acc[1].to_bits(), 0x7FC0_0000);
//!
//! // Integer Avg is exact and truncates toward zero.
//! let mut out = [0i8];
//! reference::reduce_many(ReduceOp::Avg, &[&[-3i8][..], &[100], &[-100]], &mut out);
//! assert_eq!(out, [-1]);
//!
//! // f16 sums accumulate in f32 and round once.
//! let x = f16::from_f32(2048.0);
//! let one = f16::from_f32(1.0);
//! let mut out = [f16::ZERO];
//! reference::reduce_many(ReduceOp::Sum, &[&[x][..], &[one], &[one]], &mut out);
//! assert_eq!(out[0].to_f32(), 2050.0); // stepwise f16 rounding would give 2048
//! ```

pub use crate::arith::{CANONICAL_NAN_BF16, CANONICAL_NAN_F16, CANONICAL_NAN_F32, CANONICAL_NAN_F64};
use crate::{Element, ReduceOp};

/// One pairwise step: `acc[i] = acc[i] op src[i]`, rounded to `T` (Avg steps are sums).
///
/// # Panics
///
/// If `acc.len() != src.len()`.
pub fn reduce_into<T: Element>(op: ReduceOp, acc: &mut [T], src: &[T]) {
    assert_eq!(acc.len(), src.len(), "reduce_into: acc and src lengths differ");
    let op = op.step();
    for (a, &s) in acc.iter_mut().zip(src) {
        *a = T::narrow(T::combine(op, a.widen(), s.widen()));
    }
}

/// The rank-order reduction of `srcs` into `out`, rounding once (see the [module docs](self)).
///
/// # Panics
///
/// If `srcs` is empty or a source's length differs from `out.len()`.
pub fn reduce_many<T: Element>(op: ReduceOp, srcs: &[&[T]], out: &mut [T]) {
    assert!(!srcs.is_empty(), "reduce_many: no sources");
    for s in srcs {
        assert_eq!(s.len(), out.len(), "reduce_many: a source's length differs from out's");
    }
    for (i, o) in out.iter_mut().enumerate() {
        *o = if op == ReduceOp::Avg {
            T::avg_many(srcs, i)
        } else {
            let mut acc = srcs[0][i].widen();
            for s in &srcs[1..] {
                acc = T::combine(op, acc, s[i].widen());
            }
            T::narrow(acc)
        };
    }
}

/// Finishes an Avg computed by [`reduce_into`] steps: `acc[i] = acc[i] / n`.
///
/// Floats divide in the accumulation type and round once; integers divide the element (the
/// possibly wrapped sum) truncating toward zero, which is the exact average only if the sum did
/// not wrap.
///
/// # Panics
///
/// If `n == 0`.
pub fn finish_avg<T: Element>(acc: &mut [T], n: usize) {
    assert!(n > 0, "finish_avg: n must be at least 1");
    for a in acc {
        *a = T::div(*a, n);
    }
}
