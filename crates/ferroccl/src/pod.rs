//! Plain-old-data element types in the data-movement calls: how a call's `T: bytemuck::Pod`
//! is described on the wire.
//!
//! One of the [`Element`](ferroccl_kernels::Element) types keeps its own [`DType`] and count,
//! so that the descriptor compared between ranks, and every error, read exactly as for the
//! typed calls; any other type crosses the wire as bytes (`u8`, `size_of::<T>()` of them
//! per element) and errors name it by its Rust name.

use std::any::TypeId;

use bytemuck::Pod;
use ferroccl_kernels::{bf16, f16, DType};

use crate::error::{Error, PodType, Result};

/// How the elements of a call's type cross the wire.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Wire {
    /// The dtype of an element type, else `U8`.
    pub(crate) dtype: DType,
    /// Bytes per element of the caller's type.
    pub(crate) size: usize,
    /// Elements of `dtype` per element of the caller's type (1 for an element type, `size`
    /// otherwise).
    pub(crate) per: usize,
    /// The caller's type, where it is not an element type.
    pub(crate) pod: Option<PodType>,
}

impl Wire {
    /// The wire description of `T` for call `call` of rank `rank`; a zero-sized `T` is
    /// refused (there is nothing to move, and element offsets and counts would mean
    /// nothing).
    pub(crate) fn of<T: Pod>(rank: usize, call: &str) -> Result<Wire> {
        Wire::of_type::<T>().ok_or_else(|| zero_sized(rank, call, std::any::type_name::<T>()))
    }

    /// The wire description of `T`; `None` for a zero-sized `T`.
    pub(crate) fn of_type<T: Pod>() -> Option<Wire> {
        let size = std::mem::size_of::<T>();
        if size == 0 {
            return None;
        }
        let id = TypeId::of::<T>();
        Some(match DType::ALL.into_iter().find(|&d| type_id(d) == id) {
            Some(dtype) => Wire { dtype, size, per: 1, pod: None },
            None => Wire { dtype: DType::U8, size, per: size, pod: Some(PodType::of(id, std::any::type_name::<T>(), size)) },
        })
    }

    /// `n` elements of the caller's type in elements of `dtype`.
    pub(crate) fn count(&self, n: usize) -> usize {
        n.saturating_mul(self.per)
    }
}

/// The error for a zero-sized type `name` in call `call` of rank `rank`: there is nothing to
/// move, and element offsets and counts would mean nothing.
pub(crate) fn zero_sized(rank: usize, call: &str, name: &str) -> Error {
    Error::invalid(format!(
        "rank {rank}: {call}: {name} is a zero-sized type (a data-movement call takes a plain-old-data type of at least one byte)"
    ))
}

/// The Rust type of `d`.
fn type_id(d: DType) -> TypeId {
    match d {
        DType::F32 => TypeId::of::<f32>(),
        DType::F64 => TypeId::of::<f64>(),
        DType::F16 => TypeId::of::<f16>(),
        DType::Bf16 => TypeId::of::<bf16>(),
        DType::I8 => TypeId::of::<i8>(),
        DType::U8 => TypeId::of::<u8>(),
        DType::I32 => TypeId::of::<i32>(),
        DType::U32 => TypeId::of::<u32>(),
        DType::I64 => TypeId::of::<i64>(),
        DType::U64 => TypeId::of::<u64>(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
    #[repr(C)]
    struct Pair {
        a: u32,
        b: f32,
    }

    #[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
    #[repr(C)]
    struct Nothing;

    #[test]
    fn element_types_keep_their_dtype_others_go_as_bytes() {
        let w = Wire::of::<bf16>(0, "send").unwrap();
        assert_eq!((w.dtype, w.per, w.pod), (DType::Bf16, 1, None));
        let w = Wire::of::<u8>(0, "send").unwrap();
        assert_eq!((w.dtype, w.per, w.pod), (DType::U8, 1, None));
        let w = Wire::of::<Pair>(0, "send").unwrap();
        assert_eq!((w.dtype, w.size, w.per, w.count(3)), (DType::U8, 8, 8, 24));
        assert_eq!(w.pod.map(|p| (p.name(), p.size())), Some((std::any::type_name::<Pair>(), 8)));
        let w = Wire::of::<[f32; 2]>(0, "send").unwrap();
        assert_eq!((w.dtype, w.per), (DType::U8, 8));
        let (a, b) = (Wire::of::<Pair>(0, "send").unwrap().pod.unwrap(), Wire::of::<Pair>(1, "recv").unwrap().pod.unwrap());
        assert_eq!(a, b, "one PodType per type");
    }

    #[test]
    fn zero_sized_types_are_refused() {
        match Wire::of::<Nothing>(2, "alltoall") {
            Err(Error::InvalidArgument(m)) => assert!(m.contains("Nothing") && m.contains("zero-sized"), "{m}"),
            other => panic!("{other:?}"),
        }
    }
}
