//! Element types of FerroCCL.
//!
//! Every buffer that crosses the wire is a slice of one of the [`Element`] types below. The
//! element type travels as a [`DType`] tag so that a receiver can check that both sides agree.
//! f16 and bf16 are the `half` crate's types and stay 2 bytes wide on the wire.
//!
//! ```
//! use ferroccl_kernels::{DType, Element};
//! assert_eq!(<half::bf16 as Element>::DTYPE, DType::Bf16);
//! assert_eq!(DType::Bf16.size(), 2);
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub use half::{bf16, f16};

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

/// A type whose slices FerroCCL can send, receive and (in later layers) reduce.
///
/// Implemented for exactly the types of [`DType`]; `bytemuck::Pod` gives the safe byte views.
pub trait Element: bytemuck::Pod + Send + Sync + std::fmt::Debug + PartialEq + 'static {
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

#[cfg(test)]
mod tests {
    use super::*;

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
