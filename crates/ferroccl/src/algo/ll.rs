//! What a low-latency call moves (the sans-IO half of `crate::ll`): which of this rank's
//! bytes go into its slot, and how many bytes a slot must hold.

use ferroccl_kernels::{DType, ReduceOp};

use super::Collective;

/// What a low-latency call does: a collective, or a barrier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LlKind {
    Coll(Collective),
    Barrier,
}

/// One low-latency call without its buffers.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LlSpec {
    pub(crate) kind: LlKind,
    pub(crate) dtype: DType,
    pub(crate) op: ReduceOp,
    /// Elements, as in [`crate::algo::Shape`].
    pub(crate) count: usize,
    /// One buffer (the output) instead of two.
    pub(crate) in_place: bool,
}

impl LlKind {
    /// Whether the call reduces (on this rank or another).
    pub(crate) fn reduces(self) -> bool {
        matches!(self, LlKind::Coll(c) if c.reduces())
    }
}

impl LlSpec {
    /// Bytes of a rank's slot the call fills, for `n` members.
    pub(crate) fn slot_bytes(kind: LlKind, n: usize, bytes: usize) -> Option<usize> {
        match kind {
            LlKind::Barrier => Some(0),
            LlKind::Coll(Collective::ReduceScatter | Collective::AllToAll) => bytes.checked_mul(n),
            LlKind::Coll(_) => Some(bytes),
        }
    }

    pub(crate) fn bytes(&self) -> usize {
        self.count * self.dtype.size()
    }

    /// Where this rank's contribution is: (in the output buffer, offset, length).
    pub(crate) fn contribution(&self, rank: usize, n: usize) -> (bool, usize, usize) {
        let b = self.bytes();
        let from_output = self.in_place;
        match self.kind {
            LlKind::Barrier => (false, 0, 0),
            LlKind::Coll(Collective::AllGather) => (from_output, if self.in_place { rank * b } else { 0 }, b),
            LlKind::Coll(Collective::ReduceScatter | Collective::AllToAll) => (from_output, 0, b * n),
            LlKind::Coll(Collective::Broadcast { root }) => (true, 0, if rank == root { b } else { 0 }),
            // AllReduce and Reduce; the per-call collectives never run on the slots.
            LlKind::Coll(_) => (from_output, 0, b),
        }
    }
}
