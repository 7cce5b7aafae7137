//! Fingerprints: a deterministic 64-bit hash of a canonical encoding of a layout, so that
//! ranks can check cheaply that they were given the same layouts (a weight sync's setup).

use super::layout::ModelLayout;

/// The encoding's version, hashed first: a change to the encoding changes every
/// fingerprint.
const TAG: &[u8] = b"ferroccl.reshard.layout.v1";

/// FNV-1a, 64 bits: fixed constants, no random keys, the same on every rank and platform.
/// Not a defence against a forger, a check that ranks passed the same arguments.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fingerprint(u64);

impl Fingerprint {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;

    /// An empty hash.
    pub(crate) const fn new() -> Fingerprint {
        Fingerprint(Self::OFFSET)
    }

    /// Hashes `bytes` as they are (callers prefix variable-length data with its length).
    pub(crate) fn bytes(&mut self, bytes: &[u8]) -> &mut Self {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(Self::PRIME);
        }
        self
    }

    /// Hashes `v` as 8 little-endian bytes (a `usize` as a `u64`: the same on every 64-bit
    /// rank).
    pub(crate) fn u64(&mut self, v: u64) -> &mut Self {
        self.bytes(&v.to_le_bytes())
    }

    /// Hashes a `usize` (as a `u64`).
    pub(crate) fn usize(&mut self, v: usize) -> &mut Self {
        self.u64(v as u64)
    }

    /// Hashes a length-prefixed string.
    pub(crate) fn str(&mut self, s: &str) -> &mut Self {
        self.usize(s.len()).bytes(s.as_bytes())
    }

    /// The hash so far.
    pub(crate) const fn finish(&self) -> u64 {
        self.0
    }
}

impl ModelLayout {
    /// A deterministic 64-bit fingerprint (FNV-1a) of the layout: the ranks, the
    /// alignment, and each tensor's name, dtype, shape and every rank's resolved block, in
    /// list order. Equal layouts have equal fingerprints on every rank and platform; any
    /// change to one of those (a renamed or reordered tensor, another dtype, shape, shard
    /// or alignment) gives another one (but for 64-bit collisions). Two placements that
    /// give every rank the same block ([`Placement::rows`](super::Placement::rows) and the
    /// equivalent [`Placement::blocks`](super::Placement::blocks)) have the same
    /// fingerprint: they give the same buffers and routing tables.
    ///
    /// [`Communicator::weight_sync`](crate::Communicator::weight_sync) compares every
    /// member's fingerprint of its arguments at setup.
    pub fn fingerprint(&self) -> u64 {
        let mut h = Fingerprint::new();
        self.hash_into(&mut h);
        h.finish()
    }

    /// Adds the layout's canonical encoding to `h`.
    pub(crate) fn hash_into(&self, h: &mut Fingerprint) {
        h.bytes(TAG).usize(self.ranks()).usize(self.align()).usize(self.tensors().len());
        for (t, tl) in self.tensors().iter().enumerate() {
            let [rows, cols] = tl.shape();
            h.str(tl.name()).str(tl.dtype().name()).usize(rows).usize(cols);
            for b in self.blocks_of(t) {
                h.usize(b.row0).usize(b.rows).usize(b.col0).usize(b.cols);
            }
        }
    }
}
