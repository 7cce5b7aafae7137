//! Element types, reduction operations and reduction kernels of FerroCCL.
//!
//! Every buffer that FerroCCL reduces is a slice of one of the [`Element`] types (its
//! data-movement calls also take other plain-old-data types, which cross the wire as
//! bytes). The element type travels as a [`DType`] tag so that a receiver can check that
//! both sides agree. f16 and
//! bf16 are the `half` crate's types and stay 2 bytes wide on the wire and in buffers; their
//! arithmetic widens to f32 inside a register and rounds once, to nearest-even.
//!
//! The [`reference`](mod@reference) module *defines* what each [`ReduceOp`] computes for each element type;
//! the fast kernels (portable loops, AVX2 + F16C, AVX-512 with and without AVX512-BF16, chosen
//! at run time by [`SimdLevel::detected`]) produce exactly the same bytes.
//!
//! ```
//! use ferroccl_kernels::{as_bytes, as_bytes_mut, bf16, reduce_into, reduce_into_bytes, reduce_many, DType, ReduceOp};
//!
//! // Typed: one pairwise step, as a ring does.
//! let mut acc = [1.0f32, 2.0, 3.0];
//! reduce_into(ReduceOp::Sum, &mut acc, &[10.0, 20.0, 30.0]);
//! assert_eq!(acc, [11.0, 22.0, 33.0]);
//!
//! // The rank-order reduction of three ranks' bf16 buffers, accumulated in f32.
//! let ranks: Vec<Vec<bf16>> = (1..=3).map(|r| vec![bf16::from_f32(r as f32); 4]).collect();
//! let srcs: Vec<&[bf16]> = ranks.iter().map(|v| v.as_slice()).collect();
//! let mut out = [bf16::ZERO; 4];
//! reduce_many(ReduceOp::Avg, &srcs, &mut out);
//! assert_eq!(out[0].to_f32(), 2.0);
//!
//! // Byte buffers with a dtype tag, as the runtime receives them.
//! let mut acc = [5i32, -7];
//! reduce_into_bytes(DType::I32, ReduceOp::Max, as_bytes_mut(&mut acc), as_bytes(&[6i32, -8])).unwrap();
//! assert_eq!(acc, [6, -7]);
//! assert_eq!(<bf16 as ferroccl_kernels::Element>::DTYPE, DType::Bf16);
//! ```
#![deny(unsafe_code)]
#![warn(missing_docs)]

/// Expands `$body` with the type alias `$T` bound to the Rust type of `$dtype`.
macro_rules! by_dtype {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::F64 => {
                type $T = f64;
                $body
            }
            DType::F16 => {
                type $T = f16;
                $body
            }
            DType::Bf16 => {
                type $T = bf16;
                $body
            }
            DType::I8 => {
                type $T = i8;
                $body
            }
            DType::U8 => {
                type $T = u8;
                $body
            }
            DType::I32 => {
                type $T = i32;
                $body
            }
            DType::U32 => {
                type $T = u32;
                $body
            }
            DType::I64 => {
                type $T = i64;
                $body
            }
            DType::U64 => {
                type $T = u64;
                $body
            }
        }
    };
}

mod arith;
mod error;
mod kernels;
mod op;
mod par;
mod portable;
pub mod reference;
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod x86;

pub use error::KernelError;
pub use half;
pub use half::{bf16, f16};
pub use kernels::{Kernels, SimdLevel};
pub use op::ReduceOp;
pub use par::ParPool;

/// The element types FerroCCL moves and reduces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DType {
    /// 32-bit IEEE float.
    F32 = 0,
    /// 64-bit IEEE float.
    F64 = 1,
    /// 16-bit IEEE float (binary16).
    F16 = 2,
    /// bfloat16.
    Bf16 = 3,
    /// signed 8-bit integer.
    I8 = 4,
    /// unsigned 8-bit integer.
    U8 = 5,
    /// signed 32-bit integer.
    I32 = 6,
    /// unsigned 32-bit integer.
    U32 = 7,
    /// signed 64-bit integer.
    I64 = 8,
    /// unsigned 64-bit integer.
    U64 = 9,
}

impl DType {
    /// Every dtype, in tag order.
    pub const ALL: [DType; 10] =
        [DType::F32, DType::F64, DType::F16, DType::Bf16, DType::I8, DType::U8, DType::I32, DType::U32, DType::I64, DType::U64];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F64 | DType::I64 | DType::U64 => 8,
            DType::F16 | DType::Bf16 => 2,
            DType::I8 | DType::U8 => 1,
        }
    }

    /// The name users write (`f32`, `bf16`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::I32 => "i32",
            DType::U32 => "u32",
            DType::I64 => "i64",
            DType::U64 => "u64",
        }
    }

    /// The dtype with the given wire tag, if any.
    pub fn from_tag(tag: u8) -> Option<DType> {
        DType::ALL.get(usize::from(tag)).copied()
    }

    /// Parses a user-facing name (`f32`, `bf16`, ...).
    pub fn parse(name: &str) -> Option<DType> {
        DType::ALL.iter().copied().find(|d| d.name() == name)
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A type whose slices FerroCCL can reduce (and send and receive; its data-movement calls
/// take any `bytemuck::Pod` type, these keep their [`DType`] on the wire).
///
/// Implemented for exactly the types of [`DType`] (the trait is sealed); `bytemuck::Pod` gives
/// the safe byte views.
pub trait Element: arith::Arith + bytemuck::Pod + Send + Sync + std::fmt::Debug + PartialEq + 'static {
    /// The dtype tag of this element type.
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => { $( impl Element for $t { const DTYPE: DType = DType::$d; } )* };
}
element!(f32 => F32, f64 => F64, f16 => F16, bf16 => Bf16, i8 => I8, u8 => U8, i32 => I32, u32 => U32, i64 => I64, u64 => U64);

/// Views a slice of elements as bytes.
pub fn as_bytes<T: Element>(s: &[T]) -> &[u8] {
    bytemuck::cast_slice(s)
}

/// Views a mutable slice of elements as bytes.
pub fn as_bytes_mut<T: Element>(s: &mut [T]) -> &mut [u8] {
    bytemuck::cast_slice_mut(s)
}

/// [`Kernels::reduce_into`] with the [detected](Kernels::detected) kernels: one pairwise step,
/// `acc[i] = acc[i] op src[i]`, rounded to `T` (Avg steps are sums).
///
/// # Panics
///
/// If `acc.len() != src.len()`.
pub fn reduce_into<T: Element>(op: ReduceOp, acc: &mut [T], src: &[T]) {
    Kernels::detected().reduce_into(op, acc, src)
}

/// [`Kernels::reduce_many`] with the [detected](Kernels::detected) kernels: the rank-order
/// reduction of `srcs` into `out`, rounding once.
///
/// # Panics
///
/// If `srcs` is empty or a source's length differs from `out.len()`.
pub fn reduce_many<T: Element>(op: ReduceOp, srcs: &[&[T]], out: &mut [T]) {
    Kernels::detected().reduce_many(op, srcs, out)
}

/// [`Kernels::finish_avg`] with the [detected](Kernels::detected) kernels: `acc[i] = acc[i] / n`.
///
/// # Panics
///
/// If `n == 0`.
pub fn finish_avg<T: Element>(acc: &mut [T], n: usize) {
    Kernels::detected().finish_avg(acc, n)
}

/// [`Kernels::reduce_into_bytes`] with the [detected](Kernels::detected) kernels.
///
/// # Errors
///
/// See [`Kernels::reduce_into_bytes`].
pub fn reduce_into_bytes(dtype: DType, op: ReduceOp, acc: &mut [u8], src: &[u8]) -> Result<(), KernelError> {
    Kernels::detected().reduce_into_bytes(dtype, op, acc, src)
}

/// [`Kernels::reduce_many_bytes`] with the [detected](Kernels::detected) kernels.
///
/// # Errors
///
/// See [`Kernels::reduce_many_bytes`].
pub fn reduce_many_bytes(dtype: DType, op: ReduceOp, srcs: &[&[u8]], out: &mut [u8]) -> Result<(), KernelError> {
    Kernels::detected().reduce_many_bytes(dtype, op, srcs, out)
}

/// [`Kernels::finish_avg_bytes`] with the [detected](Kernels::detected) kernels.
///
/// # Errors
///
/// See [`Kernels::finish_avg_bytes`].
pub fn finish_avg_bytes(dtype: DType, acc: &mut [u8], n: usize) -> Result<(), KernelError> {
    Kernels::detected().finish_avg_bytes(dtype, acc, n)
}

/// [`Kernels::widen_bf16`] with the [detected](Kernels::detected) kernels.
///
/// # Panics
///
/// If the lengths differ.
pub fn widen_bf16(src: &[bf16], dst: &mut [f32]) {
    Kernels::detected().widen_bf16(src, dst)
}

/// [`Kernels::narrow_bf16`] with the [detected](Kernels::detected) kernels.
///
/// # Panics
///
/// If the lengths differ.
pub fn narrow_bf16(src: &[f32], dst: &mut [bf16]) {
    Kernels::detected().narrow_bf16(src, dst)
}

/// [`Kernels::scale_add`] with the [detected](Kernels::detected) kernels: `acc[i] += w * x[i]`.
///
/// # Panics
///
/// If the lengths differ.
pub fn scale_add(w: f32, x: &[f32], acc: &mut [f32]) {
    Kernels::detected().scale_add(w, x, acc)
}

/// [`Kernels::weighted_sum`] with the [detected](Kernels::detected) kernels:
/// `out[i] = round_T(Σ_k w_k · x_k[i])` in f32, in order.
///
/// # Panics
///
/// If a source's length differs from `out.len()`, or `T` is not `f32`, `f16` or `bf16`.
pub fn weighted_sum<T: Element>(srcs: &[(&[T], f32)], out: &mut [T]) {
    Kernels::detected().weighted_sum(srcs, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every level's conversions and `scale_add` give exactly the reference's bits (half's
    /// `bf16::from_f32` / `to_f32`, a product and a sum), on every length up to 100 (the
    /// vector tails) and on values that take every rounding path: NaNs of any payload,
    /// infinities, subnormals, ties.
    #[test]
    fn conversions_and_scale_add_match_the_reference_on_every_level() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 32) as u32
        };
        let special = [
            0u32,
            0x8000_0000,
            0x7f80_0000,
            0xff80_0000,
            0x7fc0_0001,
            0xffa0_1234,
            0x0000_8000,
            0x0001_8000,
            0x3f80_8000,
            0x3f81_8000,
            0x0000_0001,
            0x007f_ffff,
            0x7f7f_ffff,
        ];
        for k in SimdLevel::available().into_iter().filter_map(Kernels::for_level) {
            for len in 0..100usize {
                let bits: Vec<u32> = (0..len).map(|i| if i % 3 == 0 { special[i / 3 % special.len()] } else { next() }).collect();
                let x: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
                let mut got = vec![bf16::ZERO; len];
                k.narrow_bf16(&x, &mut got);
                for (i, (&g, &v)) in got.iter().zip(&x).enumerate() {
                    assert_eq!(
                        g.to_bits(),
                        bf16::from_f32(v).to_bits(),
                        "{:?} narrow {:#010x} (index {i} of {len})",
                        k.level(),
                        v.to_bits()
                    );
                }
                let mut wide = vec![0f32; len];
                k.widen_bf16(&got, &mut wide);
                for (&w, &g) in wide.iter().zip(&got) {
                    assert_eq!(w.to_bits(), g.to_f32().to_bits(), "{:?} widen {:#06x}", k.level(), g.to_bits());
                }
                let y: Vec<f32> = (0..len).map(|_| f32::from_bits(next() & 0xbfff_ffff)).collect();
                let w = f32::from_bits(0x3f00_0000 | (next() & 0x007f_ffff));
                let mut acc = y.clone();
                k.scale_add(w, &x, &mut acc);
                for i in 0..len {
                    let want = y[i] + w * x[i];
                    assert!(acc[i].to_bits() == want.to_bits() || (acc[i].is_nan() && want.is_nan()), "{:?} scale_add at {i}", k.level());
                }
            }
        }
    }

    /// `weighted_sum` on every level gives the per-element loop's bits (a NaN result: a
    /// NaN) for f32, f16 and bf16, 0 to 4 sources, every length up to 100, special values
    /// (NaN, infinities, subnormals, ties) among random ones.
    #[test]
    fn weighted_sums_match_the_per_element_loop_on_every_level() {
        fn check<T: Element + crate::arith::Arith<Acc = f32>>(k: Kernels, from: impl Fn(u32) -> T, next: &mut impl FnMut() -> u32) {
            let special = [0u32, 0x8000_0000, 0x7f80_0000, 0xff80_0000, 0x7fc0_0001, 0x0000_8000, 0x3f80_8000, 0x0000_0001, 0x7f7f_ffff];
            for sources in 0..5usize {
                for len in 0..100usize {
                    let rows: Vec<Vec<T>> = (0..sources)
                        .map(|s| {
                            (0..len).map(|i| from(if (i + s) % 7 == 0 { special[(i / 7 + s) % special.len()] } else { next() })).collect()
                        })
                        .collect();
                    let weights: Vec<f32> = (0..sources).map(|_| f32::from_bits(0x3e00_0000 | (next() & 0x01ff_ffff))).collect();
                    let srcs: Vec<(&[T], f32)> = rows.iter().zip(&weights).map(|(r, &w)| (&r[..], w)).collect();
                    let mut got: Vec<T> = vec![from(0x3f80_0000); len];
                    k.weighted_sum(&srcs, &mut got);
                    for i in 0..len {
                        let mut acc = 0.0f32;
                        for &(r, w) in &srcs {
                            acc += w * r[i].widen();
                        }
                        let (g, want) = (got[i].widen(), T::narrow(acc).widen());
                        assert!(
                            g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
                            "{:?} {} weighted_sum of {sources} at {i} of {len}: {g} want {want}",
                            k.level(),
                            T::DTYPE.name()
                        );
                    }
                }
            }
        }
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 32) as u32
        };
        for k in SimdLevel::available().into_iter().filter_map(Kernels::for_level) {
            check::<f32>(k, f32::from_bits, &mut next);
            check::<bf16>(k, |b| bf16::from_f32(f32::from_bits(b)), &mut next);
            check::<f16>(k, |b| f16::from_f32(f32::from_bits(b)), &mut next);
        }
    }

    #[test]
    fn tags_round_trip() {
        for d in DType::ALL {
            assert_eq!(DType::from_tag(d as u8), Some(d));
            assert_eq!(DType::parse(d.name()), Some(d));
        }
        assert_eq!(DType::from_tag(10), None);
        assert_eq!(DType::parse("f128"), None);
    }

    #[test]
    fn sizes_match_rust_types() {
        assert_eq!(DType::F16.size(), std::mem::size_of::<f16>());
        assert_eq!(DType::Bf16.size(), std::mem::size_of::<bf16>());
        assert_eq!(as_bytes(&[1u32, 2]).len(), 8);
    }
}

#[cfg(test)]
mod conformance;
