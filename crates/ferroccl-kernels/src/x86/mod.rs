//! x86_64 kernels: AVX2 + F16C and AVX-512 (F, BW, VL, DQ, optionally BF16).
//!
//! Every function here is compiled with `#[target_feature]` for its level and is called only
//! through [`Kernels`](crate::Kernels), which is constructed for a level only after
//! `is_x86_feature_detected!` confirmed every feature of that level on the running CPU. The
//! floating-point control register (MXCSR) is never touched: no flush-to-zero,
//! no denormals-are-zero.

pub(crate) mod avx2;
pub(crate) mod avx512;

/// Op codes of the const-generic SIMD kernels.
pub(crate) const SUM: u8 = 0;
pub(crate) const PROD: u8 = 1;
pub(crate) const MIN: u8 = 2;
pub(crate) const MAX: u8 = 3;

/// Whether the CPU has everything the AVX2 level uses.
pub(crate) fn has_avx2() -> bool {
    std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("f16c")
}

/// Whether the CPU has everything the AVX-512 level uses.
pub(crate) fn has_avx512() -> bool {
    has_avx2()
        && std::is_x86_feature_detected!("avx512f")
        && std::is_x86_feature_detected!("avx512bw")
        && std::is_x86_feature_detected!("avx512vl")
        && std::is_x86_feature_detected!("avx512dq")
}

/// Whether the CPU has everything the AVX-512 + BF16 level uses.
pub(crate) fn has_avx512_bf16() -> bool {
    has_avx512() && std::is_x86_feature_detected!("avx512bf16")
}

/// Expands `$body` once per element op, binding `$OP` to its const op code.
macro_rules! with_op {
    ($op:expr, $OP:ident => $body:expr) => {
        match $op.step() {
            $crate::ReduceOp::Sum | $crate::ReduceOp::Avg => {
                const $OP: u8 = $crate::x86::SUM;
                $body
            }
            $crate::ReduceOp::Prod => {
                const $OP: u8 = $crate::x86::PROD;
                $body
            }
            $crate::ReduceOp::Min => {
                const $OP: u8 = $crate::x86::MIN;
                $body
            }
            $crate::ReduceOp::Max => {
                const $OP: u8 = $crate::x86::MAX;
                $body
            }
        }
    };
}
pub(crate) use with_op;

use crate::arith::Arith;
use crate::{bf16, f16, ReduceOp, SimdLevel};

/// An x86 SIMD level whose features were detected on this CPU. Holding one is the proof that
/// the `#[target_feature]` kernels of that level may run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Level(Inner);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Inner {
    Avx2,
    Avx512,
    Avx512Bf16,
}

impl Level {
    /// The level, if it is a SIMD level and the CPU has all its features.
    pub(crate) fn new(level: SimdLevel) -> Option<Level> {
        match level {
            SimdLevel::Scalar => None,
            SimdLevel::Avx2 => has_avx2().then_some(Level(Inner::Avx2)),
            SimdLevel::Avx512 => has_avx512().then_some(Level(Inner::Avx512)),
            SimdLevel::Avx512Bf16 => has_avx512_bf16().then_some(Level(Inner::Avx512Bf16)),
        }
    }
}

/// Safe entry points: dispatch on a detected [`Level`].
macro_rules! entry {
    ($(#[$doc:meta])* $name:ident => $kmod:ident / $native:ident :: $f:ident ( $($arg:ident : $ty:ty),* )) => {
        $(#[$doc])*
        pub(crate) fn $name(level: Level, $($arg: $ty),*) {
            match level.0 {
                Inner::Avx2 => {
                    // SAFETY: `Level(Avx2)` exists only after AVX2 and F16C were detected.
                    unsafe { avx2::$kmod::$f($($arg),*) }
                }
                Inner::Avx512 => {
                    // SAFETY: `Level(Avx512)` exists only after AVX-512 F/BW/VL/DQ, AVX2 and
                    // F16C were detected.
                    unsafe { avx512::$kmod::$f($($arg),*) }
                }
                Inner::Avx512Bf16 => {
                    // SAFETY: `Level(Avx512Bf16)` exists only after AVX-512 F/BW/VL/DQ/BF16,
                    // AVX2 and F16C were detected.
                    unsafe { avx512::$native::$f($($arg),*) }
                }
            }
        }
    };
}

entry!(/// f32 `reduce_into`.
    reduce_into_f32 => f32k / f32k :: reduce_into(op: ReduceOp, acc: &mut [f32], src: &[f32]));
entry!(/// f16 `reduce_into`.
    reduce_into_f16 => f16k / f16k :: reduce_into(op: ReduceOp, acc: &mut [f16], src: &[f16]));
entry!(/// bf16 `reduce_into`.
    reduce_into_bf16 => bf16k / bf16k_native :: reduce_into(op: ReduceOp, acc: &mut [bf16], src: &[bf16]));
entry!(/// f32 `reduce_many`.
    reduce_many_f32 => f32k / f32k :: reduce_many(op: ReduceOp, srcs: &[&[f32]], out: &mut [f32]));
entry!(/// f16 `reduce_many`.
    reduce_many_f16 => f16k / f16k :: reduce_many(op: ReduceOp, srcs: &[&[f16]], out: &mut [f16]));
entry!(/// bf16 `reduce_many`.
    reduce_many_bf16 => bf16k / bf16k_native :: reduce_many(op: ReduceOp, srcs: &[&[bf16]], out: &mut [bf16]));
entry!(/// f32 `finish_avg`.
    finish_avg_f32 => f32k / f32k :: finish_avg(acc: &mut [f32], n: usize));
entry!(/// f16 `finish_avg`.
    finish_avg_f16 => f16k / f16k :: finish_avg(acc: &mut [f16], n: usize));
entry!(/// bf16 `finish_avg`.
    finish_avg_bf16 => bf16k / bf16k_native :: finish_avg(acc: &mut [bf16], n: usize));

entry!(/// f32 `weighted_sum`.
    weighted_sum_f32 => f32k / f32k :: weighted_sum(srcs: &[(&[f32], f32)], out: &mut [f32]));
entry!(/// f16 `weighted_sum`.
    weighted_sum_f16 => f16k / f16k :: weighted_sum(srcs: &[(&[f16], f32)], out: &mut [f16]));
entry!(/// bf16 `weighted_sum`.
    weighted_sum_bf16 => bf16k / bf16k_native :: weighted_sum(srcs: &[(&[bf16], f32)], out: &mut [bf16]));

/// The portable `reduce_into` compiled for `level`.
pub(crate) fn reduce_into_generic<T: Arith>(level: Level, op: ReduceOp, acc: &mut [T], src: &[T]) {
    if level.0 == Inner::Avx2 {
        // SAFETY: `Level(Avx2)` exists only after AVX2 and F16C were detected.
        unsafe { avx2::reduce_into_generic(op, acc, src) }
    } else {
        // SAFETY: the other levels exist only after AVX-512 F/BW/VL/DQ, AVX2 and F16C were detected.
        unsafe { avx512::reduce_into_generic(op, acc, src) }
    }
}

/// The portable `reduce_many` compiled for `level`.
pub(crate) fn reduce_many_generic<T: Arith>(level: Level, op: ReduceOp, srcs: &[&[T]], out: &mut [T]) {
    if level.0 == Inner::Avx2 {
        // SAFETY: `Level(Avx2)` exists only after AVX2 and F16C were detected.
        unsafe { avx2::reduce_many_generic(op, srcs, out) }
    } else {
        // SAFETY: the other levels exist only after AVX-512 F/BW/VL/DQ, AVX2 and F16C were detected.
        unsafe { avx512::reduce_many_generic(op, srcs, out) }
    }
}

/// The portable `finish_avg` compiled for `level`.
pub(crate) fn finish_avg_generic<T: Arith>(level: Level, acc: &mut [T], n: usize) {
    if level.0 == Inner::Avx2 {
        // SAFETY: `Level(Avx2)` exists only after AVX2 and F16C were detected.
        unsafe { avx2::finish_avg_generic(acc, n) }
    } else {
        // SAFETY: the other levels exist only after AVX-512 F/BW/VL/DQ, AVX2 and F16C were detected.
        unsafe { avx512::finish_avg_generic(acc, n) }
    }
}

/// Stamps out, in a level's module, the portable row kernels (bf16 widening and narrowing,
/// `scale_add`) compiled with that level's features.
macro_rules! portable_rows {
    ($feat:literal, $lvl:literal) => {
        #[doc = concat!("The portable bf16 widening compiled for ", $lvl, ".")]
        #[target_feature(enable = $feat)]
        pub(crate) fn widen_bf16(src: &[bf16], dst: &mut [f32]) {
            portable::widen_bf16(src, dst)
        }

        #[doc = concat!("The portable bf16 narrowing compiled for ", $lvl, ".")]
        #[target_feature(enable = $feat)]
        pub(crate) fn narrow_bf16(src: &[f32], dst: &mut [bf16]) {
            portable::narrow_bf16(src, dst)
        }

        #[doc = concat!("The portable `scale_add` compiled for ", $lvl, ".")]
        #[target_feature(enable = $feat)]
        pub(crate) fn scale_add(w: f32, x: &[f32], acc: &mut [f32]) {
            portable::scale_add(w, x, acc)
        }
    };
}
pub(crate) use portable_rows;

/// A portable kernel compiled for `level` (AVX2, or AVX-512 for both AVX-512 levels).
macro_rules! compiled_for {
    ($(#[$doc:meta])* $name:ident ( $($arg:ident : $ty:ty),* )) => {
        $(#[$doc])*
        pub(crate) fn $name(level: Level, $($arg: $ty),*) {
            if level.0 == Inner::Avx2 {
                // SAFETY: `Level(Avx2)` exists only after AVX2 and F16C were detected.
                unsafe { avx2::$name($($arg),*) }
            } else {
                // SAFETY: the other levels exist only after AVX-512 F/BW/VL/DQ, AVX2 and F16C
                // were detected.
                unsafe { avx512::$name($($arg),*) }
            }
        }
    };
}

compiled_for!(/// bf16 -> f32 widening.
    widen_bf16(src: &[bf16], dst: &mut [f32]));
compiled_for!(/// f32 -> bf16 narrowing.
    narrow_bf16(src: &[f32], dst: &mut [bf16]));
compiled_for!(/// `acc[i] += w * x[i]`.
    scale_add(w: f32, x: &[f32], acc: &mut [f32]));
