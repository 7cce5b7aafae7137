//! Per-element arithmetic: the building blocks of the reference and of the portable kernels.
//!
//! The trait lives in a private module, so [`Element`](crate::Element) (which requires it) stays
//! sealed.

use crate::{bf16, f16, ReduceOp};

/// The canonical quiet NaN of f32 returned by Min and Max.
pub const CANONICAL_NAN_F32: u32 = 0x7FC0_0000;
/// The canonical quiet NaN of f64 returned by Min and Max.
pub const CANONICAL_NAN_F64: u64 = 0x7FF8_0000_0000_0000;
/// The canonical quiet NaN of f16 returned by Min and Max.
pub const CANONICAL_NAN_F16: u16 = 0x7E00;
/// The canonical quiet NaN of bf16 returned by Min and Max.
pub const CANONICAL_NAN_BF16: u16 = 0x7FC0;

macro_rules! float_minmax {
    ($min:ident, $max:ident, $t:ty, $nan:expr) => {
        /// Min with the crate's semantics (canonical NaN, -0 < +0).
        #[inline(always)]
        pub(crate) fn $min(a: $t, b: $t) -> $t {
            if a.is_nan() || b.is_nan() {
                <$t>::from_bits($nan)
            } else if a == b {
                // Equal values differ at most in the sign of a zero: OR keeps -0.
                <$t>::from_bits(a.to_bits() | b.to_bits())
            } else if a < b {
                a
            } else {
                b
            }
        }

        /// Max with the crate's semantics (canonical NaN, -0 < +0).
        #[inline(always)]
        pub(crate) fn $max(a: $t, b: $t) -> $t {
            if a.is_nan() || b.is_nan() {
                <$t>::from_bits($nan)
            } else if a == b {
                // Equal values differ at most in the sign of a zero: AND keeps +0.
                <$t>::from_bits(a.to_bits() & b.to_bits())
            } else if a > b {
                a
            } else {
                b
            }
        }
    };
}
float_minmax!(min_f32, max_f32, f32, CANONICAL_NAN_F32);
float_minmax!(min_f64, max_f64, f64, CANONICAL_NAN_F64);

/// One step of `op` (never Avg: callers pass `op.step()`) in f32.
#[inline(always)]
pub(crate) fn combine_f32(op: ReduceOp, a: f32, b: f32) -> f32 {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => a + b,
        ReduceOp::Prod => a * b,
        ReduceOp::Min => min_f32(a, b),
        ReduceOp::Max => max_f32(a, b),
    }
}

/// One step of `op` (never Avg: callers pass `op.step()`) in f64.
#[inline(always)]
pub(crate) fn combine_f64(op: ReduceOp, a: f64, b: f64) -> f64 {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => a + b,
        ReduceOp::Prod => a * b,
        ReduceOp::Min => min_f64(a, b),
        ReduceOp::Max => max_f64(a, b),
    }
}

/// Per-type arithmetic of the reference. Sealed: implemented for exactly the `Element` types.
pub trait Arith: Copy {
    /// The type partial results of [`reduce_many`] are kept in (f32 for f16 and bf16).
    type Acc: Copy + Default;
    /// Exact conversion to the accumulation type.
    fn widen(self) -> Self::Acc;
    /// Rounds (floats, to nearest-even) or keeps (integers) an accumulated value.
    fn narrow(acc: Self::Acc) -> Self;
    /// One step of `op` in the accumulation type; Avg steps are sums.
    fn combine(op: ReduceOp, a: Self::Acc, b: Self::Acc) -> Self::Acc;
    /// The exact Avg of `srcs[..][i]` as documented in the `reference` module.
    fn avg_many(srcs: &[&[Self]], i: usize) -> Self;
    /// Divides one (already reduced) sum by `n` as documented for `finish_avg`.
    fn div(sum: Self, n: usize) -> Self;
    /// Divides an accumulated float sum by `n` in the accumulation type (integers: unused).
    fn acc_div(acc: Self::Acc, n: usize) -> Self::Acc;
    /// Whether this is an integer type (Avg then goes through `avg_many`).
    const IS_INT: bool;
}

macro_rules! float_arith {
    ($t:ty, $acc:ty, $widen:expr, $narrow:expr, $combine:ident) => {
        impl Arith for $t {
            type Acc = $acc;
            #[inline(always)]
            fn widen(self) -> $acc {
                ($widen)(self)
            }
            #[inline(always)]
            fn narrow(acc: $acc) -> $t {
                ($narrow)(acc)
            }
            #[inline(always)]
            fn combine(op: ReduceOp, a: $acc, b: $acc) -> $acc {
                $combine(op, a, b)
            }
            fn avg_many(srcs: &[&[$t]], i: usize) -> $t {
                let mut acc = srcs[0][i].widen();
                for s in &srcs[1..] {
                    acc += s[i].widen();
                }
                <$t>::narrow(acc / srcs.len() as $acc)
            }
            #[inline(always)]
            fn div(sum: $t, n: usize) -> $t {
                <$t>::narrow(sum.widen() / n as $acc)
            }
            #[inline(always)]
            fn acc_div(acc: $acc, n: usize) -> $acc {
                acc / n as $acc
            }
            const IS_INT: bool = false;
        }
    };
}
float_arith!(f32, f32, |x: f32| x, |a: f32| a, combine_f32);
float_arith!(f64, f64, |x: f64| x, |a: f64| a, combine_f64);
float_arith!(f16, f32, f16::to_f32, f16::from_f32, combine_f32);
float_arith!(bf16, f32, bf16::to_f32, bf16::from_f32, combine_f32);

macro_rules! int_arith {
    ($($t:ty),*) => { $(
        impl Arith for $t {
            type Acc = $t;
            #[inline(always)]
            fn widen(self) -> $t {
                self
            }
            #[inline(always)]
            fn narrow(acc: $t) -> $t {
                acc
            }
            #[inline(always)]
            fn combine(op: ReduceOp, a: $t, b: $t) -> $t {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a.wrapping_add(b),
                    ReduceOp::Prod => a.wrapping_mul(b),
                    ReduceOp::Min => a.min(b),
                    ReduceOp::Max => a.max(b),
                }
            }
            fn avg_many(srcs: &[&[$t]], i: usize) -> $t {
                let sum: i128 = srcs.iter().map(|s| i128::from(s[i])).sum();
                let avg = sum / srcs.len() as i128;
                // The truncated mean lies between the smallest and the largest input.
                <$t>::try_from(avg).expect("the mean of values of a type fits the type")
            }
            #[inline(always)]
            fn acc_div(acc: $t, _n: usize) -> $t {
                acc
            }
            const IS_INT: bool = true;
            #[inline(always)]
            fn div(sum: $t, n: usize) -> $t {
                let q = i128::from(sum) / n as i128;
                <$t>::try_from(q).expect("a quotient by n >= 1 fits the type")
            }
        }
    )* };
}
int_arith!(i8, u8, i32, u32, i64, u64);
