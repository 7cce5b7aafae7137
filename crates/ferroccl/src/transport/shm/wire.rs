//! The layout of an inbox segment (header, pull slots, last words, rings) and of its
//! records (`MSG`, `WRITE`, `PULL`, `HELLO`, `BYE`, `PAD`).

use super::*;

/// Bytes before the first ring: doorbell, sleep flag, pull slots.
pub(super) const HEADER_BYTES: usize = 4096;
pub(super) const BELL_OFF: usize = 0;
pub(super) const SLEEPING_OFF: usize = 64;
pub(super) const SLOTS_OFF: usize = 128;
/// Outstanding single-copy pulls per rank.
pub(crate) const PULL_SLOTS: usize = 128;
pub(super) const SLOT_BYTES: usize = 16;
/// Ring control words (tail, head) each on their own cache line, then the data.
pub(super) const RING_CTRL: usize = 128;
pub(super) const REC: usize = 64;
/// How long a producer facing a full ring sleeps at a time, once done spinning.
pub(super) const FULL_RING_NAP: std::time::Duration = std::time::Duration::from_micros(50);

pub(super) const K_MSG: u32 = 1;
pub(super) const K_WRITE: u32 = 2;
pub(super) const K_PULL: u32 = 3;
pub(super) const K_HELLO: u32 = 4;
pub(super) const K_BYE: u32 = 5;
pub(super) const K_PAD: u32 = 6;
pub(super) const F_LAST: u32 = 1;
pub(super) const F_CAN_PULL: u32 = 2;
/// A pull slot's `done` word: the generation on success, with this bit on failure.
pub(super) const DONE_FAILED: u64 = 1 << 63;

/// The owner's last words: why it gave up, as the `ERR` it sends its peers, written once
/// into its own segment's header (length word, then the bytes). A message in a ring can be
/// lost when the ring is full as the rank gives up (it cannot wait then), and a peer that
/// then sees the process gone would blame it, not the rank it blamed; the header always
/// has room, and a peer reads it before it blames an exited (or silent) rank.
pub(super) const LAST_LEN_OFF: usize = SLOTS_OFF + PULL_SLOTS * SLOT_BYTES;
pub(super) const LAST_OFF: usize = LAST_LEN_OFF + 64;
/// The longest last words (a longer `ERR` is not left: the ring message is all there is).
pub(crate) const LAST_MAX: usize = HEADER_BYTES - LAST_OFF;

const _: () = assert!(LAST_OFF < HEADER_BYTES && LAST_MAX >= 1024);

/// Total size of a rank's inbox segment.
pub(crate) fn segment_len(world: usize, ring_bytes: usize) -> usize {
    HEADER_BYTES + world * (RING_CTRL + ring_bytes)
}

pub(super) fn ring_off(sender: usize, ring_bytes: usize) -> usize {
    HEADER_BYTES + sender * (RING_CTRL + ring_bytes)
}

/// Reads a byte of every page of `len` bytes at `off`: the pages are allocated (shared
/// memory is, on a read fault) and mapped in this process.
pub(super) fn touch_pages(seg: &ShmSegment, off: usize, len: usize) {
    let mut b = [0u8; 1];
    let end = (off + len).min(seg.len());
    let mut at = off;
    while at < end {
        seg.read(at, &mut b);
        at = (at / 4096 + 1) * 4096;
    }
}

pub(super) fn pad64(n: usize) -> usize {
    n.div_ceil(REC) * REC
}

#[derive(Default, Clone, Copy, Debug)]
pub(super) struct Header {
    pub(super) kind: u32,
    pub(super) flags: u32,
    pub(super) len: u64,
    pub(super) imm: u32,
    pub(super) key: u64,
    pub(super) dst_addr: u64,
    pub(super) src_addr: u64,
    pub(super) slot: u32,
    pub(super) gen: u64,
}

impl Header {
    pub(super) fn encode(&self) -> [u8; REC] {
        let mut b = [0u8; REC];
        b[0..4].copy_from_slice(&self.kind.to_le_bytes());
        b[4..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..16].copy_from_slice(&self.len.to_le_bytes());
        b[16..20].copy_from_slice(&self.imm.to_le_bytes());
        b[24..32].copy_from_slice(&self.key.to_le_bytes());
        b[32..40].copy_from_slice(&self.dst_addr.to_le_bytes());
        b[40..48].copy_from_slice(&self.src_addr.to_le_bytes());
        b[48..52].copy_from_slice(&self.slot.to_le_bytes());
        b[56..64].copy_from_slice(&self.gen.to_le_bytes());
        b
    }
    pub(super) fn decode(b: &[u8; REC]) -> Header {
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let u64_at = |o: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[o..o + 8]);
            u64::from_le_bytes(a)
        };
        Header {
            kind: u32_at(0),
            flags: u32_at(4),
            len: u64_at(8),
            imm: u32_at(16),
            key: u64_at(24),
            dst_addr: u64_at(32),
            src_addr: u64_at(40),
            slot: u32_at(48),
            gen: u64_at(56),
        }
    }
}
