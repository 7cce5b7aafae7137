//! Run-time dispatch: [`SimdLevel`], [`Kernels`] and the typed and byte-level entry points.

use std::sync::OnceLock;

use crate::arith::Arith;
use crate::{bf16, f16, portable, DType, Element, KernelError, ReduceOp};

#[cfg(target_arch = "x86_64")]
use crate::x86;

/// A set of kernels, from the portable loops up to AVX-512 with BF16. Ordered: a later level
/// is faster where the CPU has it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SimdLevel {
    /// No hand-written SIMD: portable loops over the reference arithmetic, which the compiler
    /// may vectorize for the baseline target (SSE2 on x86_64). Available everywhere.
    Scalar,
    /// x86_64 AVX2 + F16C.
    Avx2,
    /// x86_64 AVX-512 F, BW, VL and DQ (plus AVX2 and F16C); bf16 rounds in integer arithmetic.
    Avx512,
    /// [`SimdLevel::Avx512`] plus AVX512-BF16: bf16 rounds with `vcvtneps2bf16`.
    Avx512Bf16,
}

impl SimdLevel {
    /// Every level, slowest first.
    pub const ALL: [SimdLevel; 4] = [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512, SimdLevel::Avx512Bf16];

    /// A short name (`scalar`, `avx2`, `avx512`, `avx512bf16`).
    pub const fn name(self) -> &'static str {
        match self {
            SimdLevel::Scalar => "scalar",
            SimdLevel::Avx2 => "avx2",
            SimdLevel::Avx512 => "avx512",
            SimdLevel::Avx512Bf16 => "avx512bf16",
        }
    }

    /// Whether the running CPU has every feature this level uses.
    pub fn is_available(self) -> bool {
        match self {
            SimdLevel::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            level => x86::Level::new(level).is_some(),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The levels available on the running CPU, slowest first.
    pub fn available() -> Vec<SimdLevel> {
        SimdLevel::ALL.into_iter().filter(|l| l.is_available()).collect()
    }

    /// The best level of the running CPU, detected once and cached.
    pub fn detected() -> SimdLevel {
        static DETECTED: OnceLock<SimdLevel> = OnceLock::new();
        *DETECTED.get_or_init(|| SimdLevel::ALL.into_iter().rev().find(|l| l.is_available()).unwrap_or(SimdLevel::Scalar))
    }
}

impl std::fmt::Display for SimdLevel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Imp {
    Portable,
    #[cfg(target_arch = "x86_64")]
    X86(x86::Level),
}

/// The reduction kernels of one [`SimdLevel`]: a copyable handle, checked against the CPU when
/// it is made. Every level computes exactly what the [`reference`](mod@crate::reference) does.
///
/// ```
/// use ferroccl_kernels::{Kernels, ReduceOp, SimdLevel};
///
/// let k = Kernels::for_level(SimdLevel::Scalar).expect("the scalar level is always available");
/// let mut acc = [1.0f32, 2.0];
/// k.reduce_into(ReduceOp::Prod, &mut acc, &[3.0, 4.0]);
/// assert_eq!(acc, [3.0, 8.0]);
/// assert!(Kernels::detected().level() >= SimdLevel::Scalar);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kernels {
    level: SimdLevel,
    imp: Imp,
}

/// Casts a slice of `T` to a slice of `U` when they are the same type (checked by the caller
/// through `T::DTYPE`); bytemuck checks size and alignment, which then always match.
fn same<T: Element, U: Element>(s: &[T]) -> &[U] {
    bytemuck::cast_slice(s)
}

fn same_mut<T: Element, U: Element>(s: &mut [T]) -> &mut [U] {
    bytemuck::cast_slice_mut(s)
}

fn same_weighted<'a, T: Element, U: Element>(srcs: &[(&'a [T], f32)], f: impl FnOnce(&[(&'a [U], f32)])) {
    const STACK: usize = 16;
    if srcs.len() <= STACK {
        let mut arr: [(&[U], f32); STACK] = [(&[], 0.0); STACK];
        for (a, &(s, w)) in arr.iter_mut().zip(srcs) {
            *a = (bytemuck::cast_slice(s), w);
        }
        f(&arr[..srcs.len()])
    } else {
        let v: Vec<(&[U], f32)> = srcs.iter().map(|&(s, w)| (bytemuck::cast_slice(s), w)).collect();
        f(&v)
    }
}

fn same_srcs<'a, T: Element, U: Element>(srcs: &[&'a [T]], f: impl FnOnce(&[&'a [U]])) {
    const STACK: usize = 16;
    if srcs.len() <= STACK {
        let mut arr: [&[U]; STACK] = [&[]; STACK];
        for (a, s) in arr.iter_mut().zip(srcs) {
            *a = bytemuck::cast_slice(s);
        }
        f(&arr[..srcs.len()])
    } else {
        let v: Vec<&[U]> = srcs.iter().map(|s| bytemuck::cast_slice(s)).collect();
        f(&v)
    }
}

macro_rules! level_dispatch {
    ($self:ident, $portable:expr, $l:ident => $x86:expr) => {
        match $self.imp {
            Imp::Portable => $portable,
            #[cfg(target_arch = "x86_64")]
            Imp::X86($l) => $x86,
        }
    };
}

impl Kernels {
    /// The kernels of `level`, or `None` if the running CPU lacks one of its features.
    pub fn for_level(level: SimdLevel) -> Option<Kernels> {
        match level {
            SimdLevel::Scalar => Some(Kernels { level, imp: Imp::Portable }),
            #[cfg(target_arch = "x86_64")]
            _ => x86::Level::new(level).map(|l| Kernels { level, imp: Imp::X86(l) }),
            #[cfg(not(target_arch = "x86_64"))]
            _ => None,
        }
    }

    /// The kernels of [`SimdLevel::detected`].
    pub fn detected() -> Kernels {
        static DETECTED: OnceLock<Kernels> = OnceLock::new();
        *DETECTED.get_or_init(|| Kernels::for_level(SimdLevel::detected()).expect("the detected level is available"))
    }

    /// The level of these kernels.
    pub fn level(self) -> SimdLevel {
        self.level
    }

    /// One pairwise step, `acc[i] = acc[i] op src[i]`, rounded to `T` (Avg steps are sums);
    /// see [`reference::reduce_into`](crate::reference::reduce_into).
    ///
    /// # Panics
    ///
    /// If `acc.len() != src.len()`.
    pub fn reduce_into<T: Element>(self, op: ReduceOp, acc: &mut [T], src: &[T]) {
        assert_eq!(acc.len(), src.len(), "reduce_into: acc and src lengths differ");
        match T::DTYPE {
            DType::F32 => self.into_f32(op, same_mut(acc), same(src)),
            DType::F16 => self.into_f16(op, same_mut(acc), same(src)),
            DType::Bf16 => self.into_bf16(op, same_mut(acc), same(src)),
            _ => self.into_generic(op, acc, src),
        }
    }

    /// The rank-order reduction of `srcs` into `out`, rounding once; see
    /// [`reference::reduce_many`](crate::reference::reduce_many).
    ///
    /// # Panics
    ///
    /// If `srcs` is empty or a source's length differs from `out.len()`.
    pub fn reduce_many<T: Element>(self, op: ReduceOp, srcs: &[&[T]], out: &mut [T]) {
        assert!(!srcs.is_empty(), "reduce_many: no sources");
        for s in srcs {
            assert_eq!(s.len(), out.len(), "reduce_many: a source's length differs from out's");
        }
        match T::DTYPE {
            DType::F32 => same_srcs(srcs, |s| self.many_f32(op, s, same_mut(out))),
            DType::F16 => same_srcs(srcs, |s| self.many_f16(op, s, same_mut(out))),
            DType::Bf16 => same_srcs(srcs, |s| self.many_bf16(op, s, same_mut(out))),
            _ => self.many_generic(op, srcs, out),
        }
    }

    /// Finishes an Avg made of [`Kernels::reduce_into`] steps: `acc[i] = acc[i] / n`; see
    /// [`reference::finish_avg`](crate::reference::finish_avg).
    ///
    /// # Panics
    ///
    /// If `n == 0`.
    pub fn finish_avg<T: Element>(self, acc: &mut [T], n: usize) {
        assert!(n > 0, "finish_avg: n must be at least 1");
        match T::DTYPE {
            DType::F32 => self.finish_f32(same_mut(acc), n),
            DType::F16 => self.finish_f16(same_mut(acc), n),
            DType::Bf16 => self.finish_bf16(same_mut(acc), n),
            _ => self.finish_generic(acc, n),
        }
    }

    /// `dst[i] = src[i]` widened to f32 (exact).
    ///
    /// # Panics
    ///
    /// If the lengths differ.
    pub fn widen_bf16(self, src: &[bf16], dst: &mut [f32]) {
        assert_eq!(src.len(), dst.len(), "widen_bf16: lengths differ");
        level_dispatch!(self, portable::widen_bf16(src, dst), l => x86::widen_bf16(l, src, dst))
    }

    /// `dst[i] = src[i]` rounded to bf16 exactly as `bf16::from_f32` (and the reference)
    /// rounds: to nearest, ties to even, subnormals kept, NaNs quiet.
    ///
    /// # Panics
    ///
    /// If the lengths differ.
    pub fn narrow_bf16(self, src: &[f32], dst: &mut [bf16]) {
        assert_eq!(src.len(), dst.len(), "narrow_bf16: lengths differ");
        level_dispatch!(self, portable::narrow_bf16(src, dst), l => x86::narrow_bf16(l, src, dst))
    }

    /// `acc[i] += w * x[i]`, the product and the sum each rounded to f32 (never fused), so
    /// every level gives the same bits.
    ///
    /// # Panics
    ///
    /// If the lengths differ.
    pub fn scale_add(self, w: f32, x: &[f32], acc: &mut [f32]) {
        assert_eq!(x.len(), acc.len(), "scale_add: lengths differ");
        level_dispatch!(self, portable::scale_add(w, x, acc), l => x86::scale_add(l, w, x, acc))
    }

    /// `out[i] = round_T(0 + w_0 · x_0[i] + w_1 · x_1[i] + ...)` for the `(x_k, w_k)` of
    /// `srcs` in order, in f32: each product and each sum rounded to f32 (never fused), so
    /// every level gives the bits of the per-element loop; the one rounding to `T` at the
    /// end as [`Kernels::narrow_bf16`] (bf16) or the reference (f16) rounds. With no source,
    /// zeros. For `f32`, `f16` and `bf16`.
    ///
    /// # Panics
    ///
    /// If a source's length differs from `out.len()`, or `T` is not a float of 32 bits or
    /// fewer.
    pub fn weighted_sum<T: Element>(self, srcs: &[(&[T], f32)], out: &mut [T]) {
        for (s, _) in srcs {
            assert_eq!(s.len(), out.len(), "weighted_sum: a source's length differs from out's");
        }
        match T::DTYPE {
            DType::F32 => same_weighted(
                srcs,
                |s| level_dispatch!(self, portable::weighted_sum(s, same_mut(out)), l => x86::weighted_sum_f32(l, s, same_mut(out))),
            ),
            DType::F16 => same_weighted(
                srcs,
                |s| level_dispatch!(self, portable::weighted_sum(s, same_mut(out)), l => x86::weighted_sum_f16(l, s, same_mut(out))),
            ),
            DType::Bf16 => same_weighted(
                srcs,
                |s| level_dispatch!(self, portable::weighted_sum(s, same_mut(out)), l => x86::weighted_sum_bf16(l, s, same_mut(out))),
            ),
            d => panic!("weighted_sum: {} is not f32, f16 or bf16", d.name()),
        }
    }

    fn into_f32(self, op: ReduceOp, acc: &mut [f32], src: &[f32]) {
        level_dispatch!(self, portable::reduce_into(op, acc, src), l => x86::reduce_into_f32(l, op, acc, src))
    }
    fn into_f16(self, op: ReduceOp, acc: &mut [f16], src: &[f16]) {
        level_dispatch!(self, portable::reduce_into(op, acc, src), l => x86::reduce_into_f16(l, op, acc, src))
    }
    fn into_bf16(self, op: ReduceOp, acc: &mut [bf16], src: &[bf16]) {
        level_dispatch!(self, portable::reduce_into(op, acc, src), l => x86::reduce_into_bf16(l, op, acc, src))
    }
    fn into_generic<T: Arith>(self, op: ReduceOp, acc: &mut [T], src: &[T]) {
        level_dispatch!(self, portable::reduce_into(op, acc, src), l => x86::reduce_into_generic(l, op, acc, src))
    }
    fn many_f32(self, op: ReduceOp, srcs: &[&[f32]], out: &mut [f32]) {
        level_dispatch!(self, portable::reduce_many(op, srcs, out), l => x86::reduce_many_f32(l, op, srcs, out))
    }
    fn many_f16(self, op: ReduceOp, srcs: &[&[f16]], out: &mut [f16]) {
        level_dispatch!(self, portable::reduce_many(op, srcs, out), l => x86::reduce_many_f16(l, op, srcs, out))
    }
    fn many_bf16(self, op: ReduceOp, srcs: &[&[bf16]], out: &mut [bf16]) {
        level_dispatch!(self, portable::reduce_many(op, srcs, out), l => x86::reduce_many_bf16(l, op, srcs, out))
    }
    fn many_generic<T: Arith>(self, op: ReduceOp, srcs: &[&[T]], out: &mut [T]) {
        level_dispatch!(self, portable::reduce_many(op, srcs, out), l => x86::reduce_many_generic(l, op, srcs, out))
    }
    fn finish_f32(self, acc: &mut [f32], n: usize) {
        level_dispatch!(self, portable::finish_avg(acc, n), l => x86::finish_avg_f32(l, acc, n))
    }
    fn finish_f16(self, acc: &mut [f16], n: usize) {
        level_dispatch!(self, portable::finish_avg(acc, n), l => x86::finish_avg_f16(l, acc, n))
    }
    fn finish_bf16(self, acc: &mut [bf16], n: usize) {
        level_dispatch!(self, portable::finish_avg(acc, n), l => x86::finish_avg_bf16(l, acc, n))
    }
    fn finish_generic<T: Arith>(self, acc: &mut [T], n: usize) {
        level_dispatch!(self, portable::finish_avg(acc, n), l => x86::finish_avg_generic(l, acc, n))
    }

    /// [`Kernels::reduce_into`] on byte buffers holding `dtype` elements.
    ///
    /// The buffers may have any alignment: misaligned ones are processed through an aligned
    /// scratch buffer (slower, never undefined behaviour).
    ///
    /// # Errors
    ///
    /// [`KernelError::LengthMismatch`] if the lengths differ, and
    /// [`KernelError::NotMultipleOfElement`] if they are not a whole number of elements; nothing
    /// is written then.
    pub fn reduce_into_bytes(self, dtype: DType, op: ReduceOp, acc: &mut [u8], src: &[u8]) -> Result<(), KernelError> {
        if acc.len() != src.len() {
            return Err(KernelError::LengthMismatch { acc: acc.len(), src: src.len() });
        }
        check_multiple(dtype, acc.len())?;
        by_dtype!(dtype, T => into_bytes::<T>(self, op, acc, src));
        Ok(())
    }

    /// [`Kernels::reduce_many`] on byte buffers holding `dtype` elements, with any alignment.
    ///
    /// # Errors
    ///
    /// [`KernelError::NoInputs`] if `srcs` is empty, [`KernelError::SourceLengthMismatch`] if a
    /// source's length differs from `out`'s, [`KernelError::NotMultipleOfElement`] if `out` is
    /// not a whole number of elements; nothing is written then.
    pub fn reduce_many_bytes(self, dtype: DType, op: ReduceOp, srcs: &[&[u8]], out: &mut [u8]) -> Result<(), KernelError> {
        if srcs.is_empty() {
            return Err(KernelError::NoInputs);
        }
        if let Some((index, s)) = srcs.iter().enumerate().find(|(_, s)| s.len() != out.len()) {
            return Err(KernelError::SourceLengthMismatch { index, src: s.len(), out: out.len() });
        }
        check_multiple(dtype, out.len())?;
        by_dtype!(dtype, T => many_bytes::<T>(self, op, srcs, out));
        Ok(())
    }

    /// [`Kernels::finish_avg`] on a byte buffer holding `dtype` elements, with any alignment.
    ///
    /// # Errors
    ///
    /// [`KernelError::ZeroContributions`] if `n == 0`, [`KernelError::NotMultipleOfElement`] if
    /// `acc` is not a whole number of elements; nothing is written then.
    pub fn finish_avg_bytes(self, dtype: DType, acc: &mut [u8], n: usize) -> Result<(), KernelError> {
        if n == 0 {
            return Err(KernelError::ZeroContributions);
        }
        check_multiple(dtype, acc.len())?;
        by_dtype!(dtype, T => finish_bytes::<T>(self, acc, n));
        Ok(())
    }
}

pub(crate) fn check_multiple(dtype: DType, len: usize) -> Result<(), KernelError> {
    if len.is_multiple_of(dtype.size()) {
        Ok(())
    } else {
        Err(KernelError::NotMultipleOfElement { dtype, len })
    }
}

/// Bytes of the aligned scratch chunks of the misaligned paths.
const CHUNK_BYTES: usize = 8192;

/// An aligned scratch chunk.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Scratch([u8; CHUNK_BYTES]);

impl Scratch {
    fn new() -> Scratch {
        Scratch([0; CHUNK_BYTES])
    }

    /// The first `len` elements as `T` (aligned: 64 >= any element's alignment).
    fn elems<T: Element>(&mut self, len: usize) -> &mut [T] {
        &mut bytemuck::cast_slice_mut(&mut self.0[..])[..len]
    }
}

fn is_aligned<T: Element>(bytes: &[u8]) -> bool {
    bytes.as_ptr().cast::<T>().is_aligned()
}

fn into_bytes<T: Element>(k: Kernels, op: ReduceOp, acc: &mut [u8], src: &[u8]) {
    if is_aligned::<T>(acc) && is_aligned::<T>(src) {
        return k.reduce_into::<T>(op, bytemuck::cast_slice_mut(acc), bytemuck::cast_slice(src));
    }
    let size = std::mem::size_of::<T>();
    let (mut a, mut s) = (Scratch::new(), Scratch::new());
    for (ac, sc) in acc.chunks_mut(CHUNK_BYTES).zip(src.chunks(CHUNK_BYTES)) {
        let len = ac.len() / size;
        let at = a.elems::<T>(len);
        bytemuck::cast_slice_mut::<T, u8>(at).copy_from_slice(ac);
        let st = s.elems::<T>(len);
        bytemuck::cast_slice_mut::<T, u8>(st).copy_from_slice(sc);
        let at = a.elems::<T>(len);
        k.reduce_into(op, at, s.elems::<T>(len));
        ac.copy_from_slice(bytemuck::cast_slice(at));
    }
}

fn many_bytes<T: Element>(k: Kernels, op: ReduceOp, srcs: &[&[u8]], out: &mut [u8]) {
    if is_aligned::<T>(out) && srcs.iter().all(|s| is_aligned::<T>(s)) {
        return same_srcs::<u8, T>(srcs, |s| k.reduce_many(op, s, bytemuck::cast_slice_mut(out)));
    }
    // Misaligned: copy every source's chunk into an aligned scratch area.
    let size = std::mem::size_of::<T>();
    let chunk = CHUNK_BYTES / size;
    let mut scratch = vec![T::zeroed(); chunk * (srcs.len() + 1)];
    let total = out.len() / size;
    let mut start = 0;
    while start < total {
        let len = chunk.min(total - start);
        let bytes = start * size..(start + len) * size;
        let (ins, o) = scratch.split_at_mut(chunk * srcs.len());
        for (slot, s) in ins.chunks_mut(chunk).zip(srcs) {
            bytemuck::cast_slice_mut::<T, u8>(&mut slot[..len]).copy_from_slice(&s[bytes.clone()]);
        }
        let refs: Vec<&[T]> = ins.chunks(chunk).map(|c| &c[..len]).collect();
        let o = &mut o[..len];
        k.reduce_many(op, &refs, o);
        out[bytes].copy_from_slice(bytemuck::cast_slice(o));
        start += len;
    }
}

fn finish_bytes<T: Element>(k: Kernels, acc: &mut [u8], n: usize) {
    if is_aligned::<T>(acc) {
        return k.finish_avg::<T>(bytemuck::cast_slice_mut(acc), n);
    }
    let size = std::mem::size_of::<T>();
    let mut a = Scratch::new();
    for ac in acc.chunks_mut(CHUNK_BYTES) {
        let at = a.elems::<T>(ac.len() / size);
        bytemuck::cast_slice_mut::<T, u8>(at).copy_from_slice(ac);
        k.finish_avg(at, n);
        ac.copy_from_slice(bytemuck::cast_slice(at));
    }
}
