//! The kernels against the reference: property tests over every dtype x op x available level
//! (`props`), and hand-written tests of the documented semantics (`semantics`).

mod props;
mod semantics;

use crate::{bf16, f16, Element, Kernels, SimdLevel};

/// Every level the running CPU has, as kernels.
pub(crate) fn levels() -> Vec<Kernels> {
    SimdLevel::available().into_iter().map(|l| Kernels::for_level(l).expect("available")).collect()
}

/// Bitwise comparison in which any NaN equals any NaN (floats) and plain equality otherwise.
pub(crate) trait SameAs: Element {
    fn is_nan_value(self) -> bool;
    fn same_as(self, other: Self) -> bool {
        (self.is_nan_value() && other.is_nan_value()) || bytemuck::bytes_of(&self) == bytemuck::bytes_of(&other)
    }
}

macro_rules! same_float {
    ($($t:ty),*) => { $( impl SameAs for $t { fn is_nan_value(self) -> bool { self.is_nan() } } )* };
}
same_float!(f32, f64, f16, bf16);
macro_rules! same_int {
    ($($t:ty),*) => { $( impl SameAs for $t { fn is_nan_value(self) -> bool { false } } )* };
}
same_int!(i8, u8, i32, u32, i64, u64);

/// The first index where `got` and `want` differ, with both values, if any.
pub(crate) fn first_difference<T: SameAs>(got: &[T], want: &[T]) -> Option<String> {
    assert_eq!(got.len(), want.len());
    got.iter().zip(want).enumerate().find(|(_, (g, w))| !g.same_as(**w)).map(|(i, (g, w))| format!("index {i}: got {g:?}, want {w:?}"))
}
