//! Errors of the byte-level kernel entry points.

use crate::DType;

/// Why a byte-level reduction was refused. Nothing was written when one is returned.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum KernelError {
    /// `reduce_into_bytes`: `src` and `acc` differ in length.
    LengthMismatch {
        /// The accumulator's length in bytes.
        acc: usize,
        /// The source's length in bytes.
        src: usize,
    },
    /// `reduce_many_bytes`: source `index` differs in length from `out`.
    SourceLengthMismatch {
        /// Which source.
        index: usize,
        /// The source's length in bytes.
        src: usize,
        /// The output's length in bytes.
        out: usize,
    },
    /// A buffer's length is not a multiple of the element size.
    NotMultipleOfElement {
        /// The element type.
        dtype: DType,
        /// The buffer's length in bytes.
        len: usize,
    },
    /// `reduce_many_bytes` was called with no sources.
    NoInputs,
    /// `finish_avg_bytes` was called with `n == 0` contributions.
    ZeroContributions,
}

impl std::fmt::Display for KernelError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KernelError::LengthMismatch { acc, src } => {
                write!(f, "length mismatch: acc is {acc} bytes but src is {src} bytes")
            }
            KernelError::SourceLengthMismatch { index, src, out } => {
                write!(f, "length mismatch: srcs[{index}] is {src} bytes but out is {out} bytes")
            }
            KernelError::NotMultipleOfElement { dtype, len } => {
                write!(f, "a buffer of {len} bytes is not a whole number of {dtype} elements ({} bytes each)", dtype.size())
            }
            KernelError::NoInputs => f.write_str("reduce_many needs at least one source"),
            KernelError::ZeroContributions => f.write_str("finish_avg needs n >= 1 contributions"),
        }
    }
}

impl std::error::Error for KernelError {}
