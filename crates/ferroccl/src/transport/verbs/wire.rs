//! What verbs puts on the wire: the immediates (a one-sided write's, or a control
//! word: message, credits, goodbye, keepalive), the work-request ids, and the sizes of
//! the slots, queue depths and naps.

use super::*;

const _: () = assert!(ConnectInfo::LEN == QP_CONNECT_LEN, "the descriptor's queue-pair entries hold a ConnectInfo");

/// Eager receive slots per peer (and send slots: one each).
pub(crate) const SLOTS: usize = 8;
/// Bytes per eager slot: a 64 KiB eager message plus its protocol header fits.
pub(crate) const SLOT_BYTES: usize = 68 << 10;
/// Staging slots for write sources, shared by all peers of the process.
pub(crate) const STAGE_SLOTS: usize = 8;
/// Bytes per staging slot: the largest piece one staged RDMA WRITE carries.
pub(crate) const STAGE_BYTES: usize = 256 << 10;
/// The largest piece one RDMA WRITE from a window's memory region carries (far below any
/// device's maximum message size: 2 GiB for rxe, at least 1 GiB on NICs).
pub(crate) const DIRECT_BYTES: usize = 8 << 20;
pub(super) const SQ_DEPTH: u32 = 128;
/// How long the completion thread sleeps before it looks at its stop flag.
pub(super) const WAKER_NAP: Duration = Duration::from_millis(50);
/// How long `cut` waits for the peer to acknowledge the fabric's last word.
pub(super) const CUT_WAIT: Duration = Duration::from_millis(100);
/// How long a sender waiting for room parks at a time, once done spinning (the completion
/// thread rings the doorbell sooner when something completes).
pub(super) const WAIT_NAP: Duration = Duration::from_micros(200);
/// How often idle peers get a keepalive (see the module docs).
pub(crate) const PING_EVERY: Duration = Duration::from_secs(1);
pub(super) const RQ_DEPTH: u32 = 256;

pub(super) const IMM_CTRL: u32 = 1 << 31;
pub(super) const IMM_KIND_SHIFT: u32 = 29;
pub(super) const IMM_LOW: u32 = (1 << IMM_KIND_SHIFT) - 1;
pub(super) const KIND_MSG: u32 = 0;
pub(super) const KIND_CREDIT: u32 = 1;
pub(super) const KIND_BYE: u32 = 2;
pub(super) const KIND_PING: u32 = 3;

pub(super) const WR_RECV: u64 = 1;
pub(super) const WR_MSG: u64 = 2;
pub(super) const WR_STAGE: u64 = 3;
pub(super) const WR_CTRL: u64 = 4;
pub(super) const WR_DIRECT: u64 = 5;
pub(super) const WR_READ: u64 = 6;

pub(super) fn wr_id(kind: u64, peer: usize, extra: u32) -> u64 {
    (kind << 56) | ((peer as u64 & 0xff_ffff) << 32) | u64::from(extra)
}

pub(super) fn wr_parts(id: u64) -> (u64, usize, u32) {
    (id >> 56, ((id >> 32) & 0xff_ffff) as usize, id as u32)
}
