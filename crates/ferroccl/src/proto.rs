//! Point-to-point protocols over the transport contract: eager and rendezvous, and the
//! control messages that keep ranks honest with each other (`ERR`, `LEAVE`).
//!
//! Every message carries a 32-byte header: the communicator id, a channel (user
//! point-to-point, collectives, or internal traffic, so they never mix), a kind, a
//! per-(communicator, channel, peer, direction) sequence number, the *call number* (the
//! position of the call among the calls every member of the communicator makes in the same
//! order: collectives, barriers, splits; 0 for point-to-point), and a 16-byte descriptor of
//! the call (collective, dtype, op, algorithm, root, count; zero for point-to-point). A
//! receiver compares both with its own, so ranks that call differently, or that are one
//! call apart, fail with an error that says how, instead of exchanging garbage.
//!
//! * **Eager** (`len <= FERROCCL_EAGER_MAX`): the sender posts one message holding the data;
//!   the receiver copies it out of its queue. One trip.
//! * **Rendezvous** (larger): the sender announces the message with a ready-to-send (`RTS`:
//!   its sequence number and length), the receiver registers its buffer and sends a clear-to-send
//!   (`CTS`: its length, the remote descriptor and an immediate); the sender checks the
//!   lengths match, writes straight into the receiver's buffer with one-sided
//!   write-with-immediate (zero copy on tcp's receive side, a single `process_vm_readv` on
//!   shm) and the receiver completes on the immediate. The receiver can send the CTS before
//!   the sender arrives, so the data moves as soon as both are there.
//! * **`ERR`**: a rank that gives up tells its peers why, as a [`Fault`] (kind, the rank at
//!   fault, the rank that found it, what happened), so that every rank builds its own error
//!   from the same facts.
//! * **`LEAVE`**: a rank that finalizes or drops a communicator tells each member where it
//!   stopped: its call count and, for each channel, how many messages it sent to and
//!   received from that member. A member waiting for something the leaver will never send
//!   fails at once; `finalize` compares the counts both ways (nothing sent and lost).
//! * **`AGREED`**: `finalize`'s second round: "I found nothing wrong with anyone's `LEAVE`".
//!   A rank that found something sends `ERR` instead, so `finalize` returns `Ok` on a rank
//!   only when every member agreed, and fails on every member otherwise.
//!
//! * **`GET`, `PUT`, `REPLY`** (one-sided access to a registered window, see
//!   `crate::rma`): a `GET` asks the window's owner to write a range of it into the
//!   requester's registered buffer (it completes on the write's immediate); a `PUT` carries
//!   bytes for a range of the window (at most one message's worth; larger writes are several
//!   `PUT`s); the owner answers a `PUT`, and any request it refuses, with a `REPLY` (the
//!   request's number and a [`RmaStatus`]). They belong to no stream: a window is reached by
//!   whoever holds its handle, in any order.
//!
//! Both sides know the length (typed buffers), so both pick the same protocol. A length
//! mismatch is found on the wire: the side that sees it fails and sends `ERR` so the other
//! side fails too, instead of hanging or truncating.

use ferroccl_kernels::{DType, ReduceOp};

use crate::algo::{Algo, Collective, Counts, Shape};
use crate::error::{Departure, Fault, FaultKind};
use crate::params::ProtoChoice;
use crate::wire::{DResult, DecodeError, Reader, RemoteBuf, Writer};

/// Channels: separate ordered streams inside one communicator.
pub(crate) const CHAN_USER: u8 = 0;
/// Internal traffic.
pub(crate) const CHAN_INTERNAL: u8 = 1;
/// Collectives, barriers and splits: the calls every member makes in the same order.
pub(crate) const CHAN_COLL: u8 = 2;
/// Number of channels.
pub(crate) const CHANNELS: usize = 3;

/// What call a message belongs to; compared by the receiver.
pub(crate) type Desc = [u8; 16];
/// The descriptor of point-to-point traffic.
pub(crate) const NO_DESC: Desc = [0; 16];

// Call descriptors: what a call is, packed into the 16 bytes every message carries.

/// The descriptor of a barrier (a call every member makes, on the collective channel).
pub(crate) const BARRIER_DESC: Desc = [7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
/// The descriptor of a split.
pub(crate) const SPLIT_DESC: Desc = [8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
const OPS: [ReduceOp; 5] = [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max, ReduceOp::Avg];
const PROTOS: [&str; 3] = ["auto", "eager", "rendezvous"];

fn proto_code(p: ProtoChoice) -> u8 {
    match p {
        ProtoChoice::Auto => 0,
        ProtoChoice::Eager => 1,
        ProtoChoice::Rendezvous => 2,
    }
}

/// Packs a call: collective, dtype, op, algorithm | protocol << 4, root (u32), count (48
/// bits), log2 of the chunk size, pipeline slots (at least 1, so no call is all zeros, the
/// point-to-point mark).
pub(crate) fn encode_desc(shape: &Shape, algo: Algo, proto: ProtoChoice) -> Desc {
    let Shape { coll, dtype, op, count, chunk_bytes: chunk, slots, .. } = *shape;
    let mut d = [0u8; 16];
    d[0] = coll.code();
    d[1] = dtype as u8;
    d[2] = OPS.iter().position(|&o| o == op).unwrap_or(0) as u8;
    d[3] = Algo::ALL.iter().position(|&a| a == algo).unwrap_or(0) as u8 | (proto_code(proto) << 4);
    d[4..8].copy_from_slice(&(coll.root().unwrap_or(0) as u32).to_le_bytes());
    d[8..14].copy_from_slice(&(count as u64).to_le_bytes()[..6]);
    d[14] = chunk.trailing_zeros() as u8;
    d[15] = slots.clamp(1, 255) as u8;
    d
}

/// Renders a call descriptor for mismatch errors.
pub(crate) fn describe(d: &Desc) -> String {
    if *d == NO_DESC {
        return "point-to-point send/recv".into();
    }
    if *d == BARRIER_DESC {
        return "barrier".into();
    }
    if *d == SPLIT_DESC {
        return "split".into();
    }
    let root = u32::from_le_bytes([d[4], d[5], d[6], d[7]]);
    let c = Collective::from_code(d[0], root as usize);
    let coll = c.map_or("?", Collective::name);
    let dtype = DType::from_tag(d[1]).map(|t| t.name()).unwrap_or("?");
    let op = OPS.get(usize::from(d[2])).map(|o| o.name()).unwrap_or("?");
    let algo = Algo::ALL.get(usize::from(d[3] & 0xf)).map(|a| a.name()).unwrap_or("?");
    let proto = PROTOS.get(usize::from(d[3] >> 4)).copied().unwrap_or("?");
    let mut b = [0u8; 8];
    b[..6].copy_from_slice(&d[8..14]);
    let count = u64::from_le_bytes(b);
    let rooted = c.and_then(Collective::root).is_some();
    let reduces = c.is_some_and(Collective::reduces);
    match c.map(Collective::counts) {
        // Every rank's counts, as a fingerprint (in the root's place), and their total.
        Some(Counts::Fingerprint) => {
            return format!("{coll}(total {count}, {dtype}, {op}, counts #{root:08x}, algo {algo}, proto {proto})");
        }
        // The counts are per rank and pair, checked transfer by transfer.
        Some(Counts::PerTransfer) if rooted => return format!("{coll}({dtype}, root {root}, algo {algo}, proto {proto})"),
        Some(Counts::PerTransfer) => return format!("{coll}({dtype}, algo {algo}, proto {proto})"),
        _ => {}
    }
    format!(
        "{coll}(count {count}, {dtype}{}{}, algo {algo}, proto {proto}, chunk {} B, slots {})",
        if reduces { format!(", {op}") } else { String::new() },
        if rooted { format!(", root {root}") } else { String::new() },
        1u64 << d[14].min(63),
        d[15]
    )
}

const K_EAGER: u8 = 1;
const K_CTS: u8 = 2;
const K_ERR: u8 = 3;
const K_RTS: u8 = 4;
const K_LEAVE: u8 = 5;
const K_PROBE: u8 = 6;
const K_AGREED: u8 = 7;
const K_GET: u8 = 8;
const K_PUT: u8 = 9;
const K_REPLY: u8 = 10;
const K_SIGNAL: u8 = 11;
const K_WINFO: u8 = 12;
const K_WINFO_REPLY: u8 = 13;
const K_REVOKE: u8 = 14;
const K_REVOKED: u8 = 15;

/// What a one-sided request names: a window of the receiving rank, by id and key (the
/// handle's capability), in the job `job`, and a byte range of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RmaTarget {
    /// The request's number at the requester (replies name it).
    pub(crate) req: u64,
    pub(crate) job: u64,
    pub(crate) window: u32,
    pub(crate) key: u64,
    pub(crate) offset: u64,
    pub(crate) len: u64,
}

/// How the owner of a window answered a one-sided request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RmaStatus {
    /// A `PUT`'s bytes landed.
    Done,
    /// No live window has this id and key (never had, or dropped since).
    NoWindow,
    /// The handle belongs to another job.
    OtherJob,
    /// The range is not inside the window.
    OutOfRange,
    /// A write through a read-only window.
    ReadOnly,
    /// The owner could not serve it (it is closing, or its side of the transfer failed).
    Failed,
}

impl RmaStatus {
    fn code(self) -> u8 {
        match self {
            RmaStatus::Done => 0,
            RmaStatus::NoWindow => 1,
            RmaStatus::OtherJob => 2,
            RmaStatus::OutOfRange => 3,
            RmaStatus::ReadOnly => 4,
            RmaStatus::Failed => 5,
        }
    }
    fn from_code(c: u8) -> Option<RmaStatus> {
        Some(match c {
            0 => RmaStatus::Done,
            1 => RmaStatus::NoWindow,
            2 => RmaStatus::OtherJob,
            3 => RmaStatus::OutOfRange,
            4 => RmaStatus::ReadOnly,
            5 => RmaStatus::Failed,
            _ => return None,
        })
    }
}

/// Where a message belongs: (communicator id, channel, peer world rank).
pub(crate) type StreamKey = (u32, u8, usize);

/// A clear-to-send: the receiver's buffer, ready for a write.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Cts {
    pub(crate) seq: u32,
    pub(crate) call: u32,
    pub(crate) desc: Desc,
    pub(crate) len: u64,
    pub(crate) buf: RemoteBuf,
    pub(crate) imm: u32,
}

/// Where a rank stopped on a communicator, as it tells each member when it leaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Leave {
    pub(crate) how: Departure,
    /// Calls every member makes (collectives, barriers, splits) it had made.
    pub(crate) calls: u32,
    /// Per channel: messages it had sent to the member it tells.
    pub(crate) sent: [u32; CHANNELS],
    /// Per channel: messages it had received (receives submitted) from that member.
    pub(crate) recv: [u32; CHANNELS],
}

/// A decoded protocol message.
#[derive(Debug)]
pub(crate) enum ProtoMsg {
    Eager {
        comm: u32,
        chan: u8,
        seq: u32,
        call: u32,
        desc: Desc,
        data: Vec<u8>,
    },
    Cts {
        comm: u32,
        chan: u8,
        cts: Cts,
    },
    /// Why the sender gave up (`reporter` is filled with the sender when it found the
    /// fault itself), on the communicator named (its id), or (`None`) on a peer or on
    /// everything (see `inbox::Scope`).
    Err(Fault, Option<u32>),
    /// A rendezvous sender's announcement: lets an eager receiver see the mismatch.
    Rts {
        comm: u32,
        chan: u8,
        seq: u32,
        call: u32,
        desc: Desc,
        len: u64,
    },
    Leave {
        comm: u32,
        leave: Leave,
    },
    /// `finalize`'s second round: the sender found every member's `LEAVE` in order.
    Agreed {
        comm: u32,
    },
    /// "I am in call `call` of communicator `comm`, described by `desc`, and wait for
    /// you": sent by a collective call that has waited a while, so that a peer in a
    /// different call with the same number says so even when neither sends the other data.
    Probe {
        comm: u32,
        call: u32,
        desc: Desc,
    },
    /// "Write this range of your window into my buffer `buf`, with immediate `imm`."
    Get {
        target: RmaTarget,
        buf: RemoteBuf,
        imm: u32,
        /// Rows of a 2-D read (1: contiguous): `row` bytes each, `src_stride` apart in
        /// the window (`target` spans them) and `dst_stride` apart in `buf`; row `r` is
        /// written with immediate `imm + r` (31 bits, wrapping).
        rows: u32,
        row: u64,
        src_stride: u64,
        dst_stride: u64,
    },
    /// "Land these bytes in this range of your window" (`target.len == data.len()`).
    Put {
        target: RmaTarget,
        data: Vec<u8>,
    },
    /// The owner's answer to request `req`.
    Reply {
        req: u64,
        status: RmaStatus,
    },
    /// "Tell me your window's verbs memory region, so that I read it with RDMA READ":
    /// `target` names the window (its range is empty); answered with `WINFO_REPLY`.
    WinInfo {
        target: RmaTarget,
    },
    /// The owner's answer to `WINFO` request `req`: a refusal, or the region (`None`: the
    /// window has none, its reads stay owner-served).
    WinInfoReply {
        req: u64,
        status: RmaStatus,
        region: Option<RegionInfo>,
    },
    /// The owner drops window (`window`, `key`): stop reading its memory region, wait for
    /// the reads in flight, then answer `REVOKED`.
    Revoke {
        window: u32,
        key: u64,
    },
    /// A holder's answer to `REVOKE`: it will not read the window's region again.
    Revoked {
        window: u32,
        key: u64,
    },
    /// "Raise the signal I give you on `slot` to `value`" (sent after a `PUT`'s pieces, so
    /// the owner, serving in order, raises it once they have landed); answered with a
    /// `REPLY`. Slot 0 is the public one; library objects (a MoE layer) own others.
    Signal {
        req: u64,
        slot: u32,
        value: u64,
    },
}

/// Bytes of the header every message starts with (eager data follows it).
pub(crate) const EAGER_HEADER: usize = 32;

/// The header fields of a message.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Head {
    pub(crate) comm: u32,
    pub(crate) chan: u8,
    pub(crate) seq: u32,
    pub(crate) call: u32,
    pub(crate) desc: Desc,
}

fn put_head(b: &mut [u8], kind: u8, h: &Head) {
    b[0..4].copy_from_slice(&h.comm.to_le_bytes());
    b[4] = h.chan;
    b[5] = kind;
    b[6] = 0;
    b[7] = 0;
    b[8..12].copy_from_slice(&h.seq.to_le_bytes());
    b[12..16].copy_from_slice(&h.call.to_le_bytes());
    b[16..32].copy_from_slice(&h.desc);
}

fn head_vec(kind: u8, h: &Head, extra: usize) -> Writer {
    let mut w = Writer { buf: Vec::with_capacity(EAGER_HEADER + extra) };
    w.buf.resize(EAGER_HEADER, 0);
    put_head(&mut w.buf, kind, h);
    w
}

/// An eager message: the header, then `fill` appends `len` bytes of data.
#[cfg(test)]
pub(crate) fn encode_eager_with(h: &Head, len: usize, fill: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut w = head_vec(K_EAGER, h, len);
    fill(&mut w.buf);
    w.finish()
}

#[cfg(test)]
pub(crate) fn encode_eager(comm: u32, chan: u8, seq: u32, data: &[u8]) -> Vec<u8> {
    encode_eager_with(&Head { comm, chan, seq, call: 0, desc: NO_DESC }, data.len(), |b| b.extend_from_slice(data))
}

/// The header of an eager message, on the stack (the data follows it on the wire).
pub(crate) fn eager_header(h: &Head) -> [u8; EAGER_HEADER] {
    let mut b = [0u8; EAGER_HEADER];
    put_head(&mut b, K_EAGER, h);
    b
}

/// Bytes of a clear-to-send.
pub(crate) const CTS_LEN: usize = EAGER_HEADER + 36;
/// Bytes of a ready-to-send.
pub(crate) const RTS_LEN: usize = EAGER_HEADER + 8;

pub(crate) fn encode_cts(comm: u32, chan: u8, cts: &Cts) -> [u8; CTS_LEN] {
    let mut b = [0u8; CTS_LEN];
    put_head(&mut b, K_CTS, &Head { comm, chan, seq: cts.seq, call: cts.call, desc: cts.desc });
    let mut o = EAGER_HEADER;
    for v in [cts.len, cts.buf.addr, cts.buf.len, cts.buf.key] {
        b[o..o + 8].copy_from_slice(&v.to_le_bytes());
        o += 8;
    }
    b[o..o + 4].copy_from_slice(&cts.imm.to_le_bytes());
    b
}

pub(crate) fn encode_rts(h: &Head, len: u64) -> [u8; RTS_LEN] {
    let mut b = [0u8; RTS_LEN];
    put_head(&mut b, K_RTS, h);
    b[EAGER_HEADER..].copy_from_slice(&len.to_le_bytes());
    b
}

const NO_RANK: u32 = u32::MAX;

fn rank_u32(r: Option<usize>) -> u32 {
    r.and_then(|r| u32::try_from(r).ok()).filter(|&r| r != NO_RANK).unwrap_or(NO_RANK)
}

fn rank_opt(r: u32) -> Option<usize> {
    (r != NO_RANK).then_some(r as usize)
}

/// An `ERR` telling a peer why `sender` gives up on communicator `comm` (`None`: on a
/// peer, or on everything). A fault this rank found itself goes out with `sender` as its
/// reporter; a relayed one keeps the rank that found it.
pub(crate) fn encode_err(fault: &Fault, sender: usize, comm: Option<u32>) -> Vec<u8> {
    let h = Head { comm: comm.unwrap_or(0), chan: CHAN_INTERNAL, seq: 0, call: 0, desc: NO_DESC };
    let mut w = head_vec(K_ERR, &h, 64 + fault.op.len() + fault.what.len());
    w.u8(fault.kind.code())
        .u8(u8::from(comm.is_some()))
        .u32(rank_u32(fault.culprit))
        .u32(rank_u32(Some(fault.reporter.unwrap_or(sender))))
        .str(&fault.op)
        .str(&fault.what);
    w.finish()
}

/// Bytes of a `LEAVE`.
pub(crate) const LEAVE_LEN: usize = EAGER_HEADER + 1 + 4 + 8 * CHANNELS;

pub(crate) fn encode_leave(comm: u32, l: &Leave) -> Vec<u8> {
    let h = Head { comm, chan: CHAN_INTERNAL, seq: 0, call: 0, desc: NO_DESC };
    let mut w = head_vec(K_LEAVE, &h, LEAVE_LEN - EAGER_HEADER);
    w.u8(match l.how {
        Departure::Finalized => 1,
        Departure::Dropped => 2,
    })
    .u32(l.calls);
    for c in 0..CHANNELS {
        w.u32(l.sent[c]).u32(l.recv[c]);
    }
    w.finish()
}

/// A probe (see [`ProtoMsg::Probe`]).
/// `finalize`'s "nothing wrong here" for communicator `comm`.
pub(crate) fn encode_agreed(comm: u32) -> [u8; EAGER_HEADER] {
    let mut b = [0u8; EAGER_HEADER];
    put_head(&mut b, K_AGREED, &Head { comm, chan: CHAN_INTERNAL, seq: 0, call: 0, desc: NO_DESC });
    b
}

pub(crate) fn encode_probe(comm: u32, call: u32, desc: &Desc) -> [u8; EAGER_HEADER] {
    let mut b = [0u8; EAGER_HEADER];
    put_head(&mut b, K_PROBE, &Head { comm, chan: CHAN_COLL, seq: 0, call, desc: *desc });
    b
}

fn read_target(r: &mut Reader<'_>) -> DResult<RmaTarget> {
    Ok(RmaTarget { req: r.u64()?, job: r.u64()?, window: r.u32()?, key: r.u64()?, offset: r.u64()?, len: r.u64()? })
}

/// Bytes of a `PUT` before its data.
pub(crate) const PUT_HEADER: usize = EAGER_HEADER + 44;

/// Bytes of a `GET`.
pub(crate) const GET_LEN: usize = PUT_HEADER + 28 + 28;

/// The shape of a `GET` (see [`ProtoMsg::Get`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GetShape {
    pub(crate) rows: u32,
    pub(crate) row: u64,
    pub(crate) src_stride: u64,
    pub(crate) dst_stride: u64,
}

/// A `GET` (see [`ProtoMsg::Get`]), on the stack: a plan's reads allocate nothing.
pub(crate) fn encode_get(t: &RmaTarget, buf: &RemoteBuf, imm: u32, shape: &GetShape) -> [u8; GET_LEN] {
    let mut b = [0u8; GET_LEN];
    b[..PUT_HEADER].copy_from_slice(&put_header(t));
    b[5] = K_GET;
    let mut at = PUT_HEADER;
    for v in [buf.addr, buf.len, buf.key] {
        b[at..at + 8].copy_from_slice(&v.to_le_bytes());
        at += 8;
    }
    b[at..at + 4].copy_from_slice(&imm.to_le_bytes());
    at += 4;
    b[at..at + 4].copy_from_slice(&shape.rows.to_le_bytes());
    at += 4;
    for v in [shape.row, shape.src_stride, shape.dst_stride] {
        b[at..at + 8].copy_from_slice(&v.to_le_bytes());
        at += 8;
    }
    b
}

/// The header of a `PUT` of `t.len` bytes (the data follows it in the same message), on
/// the stack.
pub(crate) fn put_header(t: &RmaTarget) -> [u8; PUT_HEADER] {
    let mut b = [0u8; PUT_HEADER];
    put_head(&mut b, K_PUT, &Head { comm: 0, chan: CHAN_INTERNAL, seq: 0, call: 0, desc: NO_DESC });
    let mut at = EAGER_HEADER;
    for v in [t.req, t.job] {
        b[at..at + 8].copy_from_slice(&v.to_le_bytes());
        at += 8;
    }
    b[at..at + 4].copy_from_slice(&t.window.to_le_bytes());
    at += 4;
    for v in [t.key, t.offset, t.len] {
        b[at..at + 8].copy_from_slice(&v.to_le_bytes());
        at += 8;
    }
    b
}

/// Bytes of a `SIGNAL`.
pub(crate) const SIGNAL_LEN: usize = EAGER_HEADER + 20;

/// A `SIGNAL` (see [`ProtoMsg::Signal`]), on the stack.
pub(crate) fn encode_signal(req: u64, slot: u32, value: u64) -> [u8; SIGNAL_LEN] {
    let mut b = [0u8; SIGNAL_LEN];
    put_head(&mut b, K_SIGNAL, &Head { comm: 0, chan: CHAN_INTERNAL, seq: 0, call: 0, desc: NO_DESC });
    b[EAGER_HEADER..EAGER_HEADER + 8].copy_from_slice(&req.to_le_bytes());
    b[EAGER_HEADER + 8..EAGER_HEADER + 12].copy_from_slice(&slot.to_le_bytes());
    b[EAGER_HEADER + 12..].copy_from_slice(&value.to_le_bytes());
    b
}

/// Bytes of a `REPLY`.
pub(crate) const REPLY_LEN: usize = EAGER_HEADER + 9;

/// A `REPLY` to request `req`, on the stack.
pub(crate) fn encode_reply(req: u64, status: RmaStatus) -> [u8; REPLY_LEN] {
    let mut b = [0u8; REPLY_LEN];
    put_head(&mut b, K_REPLY, &Head { comm: 0, chan: CHAN_INTERNAL, seq: 0, call: 0, desc: NO_DESC });
    b[EAGER_HEADER..EAGER_HEADER + 8].copy_from_slice(&req.to_le_bytes());
    b[EAGER_HEADER + 8] = status.code();
    b
}

/// A window's verbs memory region as its owner gives it to a reader (`WINFO_REPLY`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RegionInfo {
    pub(crate) addr: u64,
    pub(crate) rkey: u32,
    pub(crate) len: u64,
    /// Registered with `REMOTE_WRITE` (a read-write window): the reader may write it with
    /// RDMA WRITE too.
    pub(crate) writable: bool,
}

/// A `WINFO` for window (`t.window`, `t.key`) in job `t.job`, on the stack.
pub(crate) fn encode_winfo(t: &RmaTarget) -> [u8; PUT_HEADER] {
    let mut b = put_header(&RmaTarget { offset: 0, len: 0, ..*t });
    b[5] = K_WINFO;
    b
}

/// Bytes of a `WINFO_REPLY`.
pub(crate) const WINFO_REPLY_LEN: usize = EAGER_HEADER + 8 + 1 + 1 + 8 + 4 + 8 + 1;

/// A `WINFO_REPLY` (see [`ProtoMsg::WinInfoReply`]), on the stack.
pub(crate) fn encode_winfo_reply(req: u64, status: RmaStatus, region: Option<RegionInfo>) -> [u8; WINFO_REPLY_LEN] {
    let mut b = [0u8; WINFO_REPLY_LEN];
    put_head(&mut b, K_WINFO_REPLY, &Head { comm: 0, chan: CHAN_INTERNAL, seq: 0, call: 0, desc: NO_DESC });
    let mut at = EAGER_HEADER;
    b[at..at + 8].copy_from_slice(&req.to_le_bytes());
    at += 8;
    b[at] = status.code();
    b[at + 1] = u8::from(region.is_some());
    at += 2;
    let r = region.unwrap_or(RegionInfo { addr: 0, rkey: 0, len: 0, writable: false });
    b[at..at + 8].copy_from_slice(&r.addr.to_le_bytes());
    b[at + 8..at + 12].copy_from_slice(&r.rkey.to_le_bytes());
    b[at + 12..at + 20].copy_from_slice(&r.len.to_le_bytes());
    b[at + 20] = u8::from(r.writable);
    b
}

/// Bytes of a `REVOKE` or `REVOKED`.
pub(crate) const REVOKE_LEN: usize = EAGER_HEADER + 12;

/// A `REVOKE` (`answer == false`) or `REVOKED` of window (`window`, `key`), on the stack.
pub(crate) fn encode_revoke(window: u32, key: u64, answer: bool) -> [u8; REVOKE_LEN] {
    let mut b = [0u8; REVOKE_LEN];
    let kind = if answer { K_REVOKED } else { K_REVOKE };
    put_head(&mut b, kind, &Head { comm: 0, chan: CHAN_INTERNAL, seq: 0, call: 0, desc: NO_DESC });
    b[EAGER_HEADER..EAGER_HEADER + 4].copy_from_slice(&window.to_le_bytes());
    b[EAGER_HEADER + 4..].copy_from_slice(&key.to_le_bytes());
    b
}

#[cfg(test)]
pub(crate) fn decode(msg: Vec<u8>) -> DResult<ProtoMsg> {
    decode_keep(msg).map(|(m, _)| m)
}

/// [`decode`], handing back the message's buffer when the decoded message does not own it
/// (everything but eager data), so that it can be reused.
pub(crate) fn decode_keep(mut msg: Vec<u8>) -> DResult<(ProtoMsg, Option<Vec<u8>>)> {
    let mut put_target_later = None;
    let m = {
        let mut r = Reader::new(&msg);
        let comm = r.u32()?;
        let chan = r.u8()?;
        let kind = r.u8()?;
        r.raw(2)?;
        let seq = r.u32()?;
        let call = r.u32()?;
        let mut desc = NO_DESC;
        desc.copy_from_slice(r.raw(16)?);
        match kind {
            K_EAGER => None,
            K_CTS => {
                let len = r.u64()?;
                let buf = RemoteBuf { addr: r.u64()?, len: r.u64()?, key: r.u64()? };
                let imm = r.u32()?;
                r.end()?;
                Some(ProtoMsg::Cts { comm, chan, cts: Cts { seq, call, desc, len, buf, imm } })
            }
            K_RTS => {
                let len = r.u64()?;
                r.end()?;
                Some(ProtoMsg::Rts { comm, chan, seq, call, desc, len })
            }
            K_ERR => {
                let code = r.u8()?;
                let kind = FaultKind::from_code(code).ok_or_else(|| DecodeError(format!("unknown fault kind {code}")))?;
                let scoped = match r.u8()? {
                    0 => None,
                    1 => Some(comm),
                    f => return Err(DecodeError(format!("ERR scope flag {f}"))),
                };
                let culprit = rank_opt(r.u32()?);
                let reporter = rank_opt(r.u32()?);
                let op = r.str()?.to_string();
                let what = r.str()?.to_string();
                r.end()?;
                Some(ProtoMsg::Err(Fault { kind, culprit, reporter, op, what }, scoped))
            }
            K_LEAVE => {
                let how = match r.u8()? {
                    1 => Departure::Finalized,
                    2 => Departure::Dropped,
                    h => return Err(DecodeError(format!("unknown departure {h}"))),
                };
                let calls = r.u32()?;
                let (mut sent, mut recv) = ([0u32; CHANNELS], [0u32; CHANNELS]);
                for c in 0..CHANNELS {
                    sent[c] = r.u32()?;
                    recv[c] = r.u32()?;
                }
                r.end()?;
                Some(ProtoMsg::Leave { comm, leave: Leave { how, calls, sent, recv } })
            }
            K_PROBE => {
                r.end()?;
                Some(ProtoMsg::Probe { comm, call, desc })
            }
            K_AGREED => {
                r.end()?;
                Some(ProtoMsg::Agreed { comm })
            }
            K_GET => {
                let target = read_target(&mut r)?;
                let buf = RemoteBuf { addr: r.u64()?, len: r.u64()?, key: r.u64()? };
                let imm = r.u32()?;
                let (rows, row, src_stride, dst_stride) = (r.u32()?, r.u64()?, r.u64()?, r.u64()?);
                r.end()?;
                Some(ProtoMsg::Get { target, buf, imm, rows, row, src_stride, dst_stride })
            }
            K_PUT => {
                let target = read_target(&mut r)?;
                if r.remaining() as u64 != target.len {
                    return Err(DecodeError(format!("a PUT of {} bytes carries {}", target.len, r.remaining())));
                }
                // The data is the rest of the message: handed over below without a copy.
                put_target_later = Some(target);
                None
            }
            K_SIGNAL => {
                let req = r.u64()?;
                let slot = r.u32()?;
                let value = r.u64()?;
                r.end()?;
                Some(ProtoMsg::Signal { req, slot, value })
            }
            K_REPLY => {
                let req = r.u64()?;
                let code = r.u8()?;
                let status = RmaStatus::from_code(code).ok_or_else(|| DecodeError(format!("unknown one-sided status {code}")))?;
                r.end()?;
                Some(ProtoMsg::Reply { req, status })
            }
            K_WINFO => {
                let target = read_target(&mut r)?;
                r.end()?;
                Some(ProtoMsg::WinInfo { target })
            }
            K_WINFO_REPLY => {
                let req = r.u64()?;
                let code = r.u8()?;
                let status = RmaStatus::from_code(code).ok_or_else(|| DecodeError(format!("unknown one-sided status {code}")))?;
                let has = r.u8()?;
                let (addr, rkey, len) = (r.u64()?, r.u32()?, r.u64()?);
                let writable = match r.u8()? {
                    0 => false,
                    1 => true,
                    w => return Err(DecodeError(format!("WINFO_REPLY writable flag {w}"))),
                };
                let region = RegionInfo { addr, rkey, len, writable };
                r.end()?;
                let region = match has {
                    0 => None,
                    1 => Some(region),
                    h => return Err(DecodeError(format!("WINFO_REPLY region flag {h}"))),
                };
                Some(ProtoMsg::WinInfoReply { req, status, region })
            }
            K_REVOKE | K_REVOKED => {
                let window = r.u32()?;
                let key = r.u64()?;
                r.end()?;
                Some(if kind == K_REVOKE { ProtoMsg::Revoke { window, key } } else { ProtoMsg::Revoked { window, key } })
            }
            k => return Err(DecodeError(format!("unknown message kind {k}"))),
        }
        .ok_or((comm, chan, seq, call, desc))
    };
    match m {
        Ok(m) => Ok((m, Some(msg))),
        Err(head) => {
            if let Some(target) = put_target_later {
                msg.drain(..PUT_HEADER);
                return Ok((ProtoMsg::Put { target, data: msg }, None));
            }
            let (comm, chan, seq, call, desc) = head;
            msg.drain(..EAGER_HEADER);
            Ok((ProtoMsg::Eager { comm, chan, seq, call, desc, data: msg }, None))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_sided_messages_round_trip() {
        let t = RmaTarget { req: 11, job: 0xfeed, window: 3, key: 0xdead_beef, offset: 4096, len: 5 };
        let buf = RemoteBuf { addr: 0x1000, len: 5, key: 77 };
        let shape = GetShape { rows: 3, row: 4, src_stride: 10, dst_stride: 6 };
        match decode(encode_get(&t, &buf, 9, &shape).to_vec()).unwrap() {
            ProtoMsg::Get { target, buf: b, imm: 9, rows: 3, row: 4, src_stride: 10, dst_stride: 6 } => assert_eq!((target, b), (t, buf)),
            m => panic!("{m:?}"),
        }
        let mut put = put_header(&t).to_vec();
        put.extend_from_slice(b"hello");
        match decode(put.clone()).unwrap() {
            ProtoMsg::Put { target, data } => assert_eq!((target, data), (t, b"hello".to_vec())),
            m => panic!("{m:?}"),
        }
        // A PUT whose data is not the length its header says is malformed.
        put.push(0);
        assert!(decode(put).is_err());
        for st in [RmaStatus::Done, RmaStatus::NoWindow, RmaStatus::OtherJob, RmaStatus::OutOfRange, RmaStatus::ReadOnly, RmaStatus::Failed]
        {
            match decode(encode_reply(5, st).to_vec()).unwrap() {
                ProtoMsg::Reply { req: 5, status } => assert_eq!(status, st),
                m => panic!("{m:?}"),
            }
        }
        let mut bad = encode_reply(5, RmaStatus::Done).to_vec();
        bad[EAGER_HEADER + 8] = 200;
        assert!(decode(bad).is_err());
        match decode(encode_signal(8, 7, u64::MAX).to_vec()).unwrap() {
            ProtoMsg::Signal { req: 8, slot: 7, value: u64::MAX } => {}
            m => panic!("{m:?}"),
        }
        match decode(encode_winfo(&t).to_vec()).unwrap() {
            ProtoMsg::WinInfo { target } => assert_eq!(target, RmaTarget { offset: 0, len: 0, ..t }),
            m => panic!("{m:?}"),
        }
        let region = RegionInfo { addr: 0x1234_5678_9abc, rkey: 0xdead_beef, len: 77, writable: true };
        for (st, reg) in [(RmaStatus::Done, Some(region)), (RmaStatus::Done, None), (RmaStatus::NoWindow, None)] {
            match decode(encode_winfo_reply(3, st, reg).to_vec()).unwrap() {
                ProtoMsg::WinInfoReply { req: 3, status, region } => assert_eq!((status, region), (st, reg)),
                m => panic!("{m:?}"),
            }
        }
        for answer in [false, true] {
            match (answer, decode(encode_revoke(9, u64::MAX - 1, answer).to_vec()).unwrap()) {
                (false, ProtoMsg::Revoke { window: 9, key }) | (true, ProtoMsg::Revoked { window: 9, key }) => {
                    assert_eq!(key, u64::MAX - 1)
                }
                m => panic!("{m:?}"),
            }
        }
        let get = encode_get(&t, &buf, 9, &shape);
        assert!(decode(get[..GET_LEN - 1].to_vec()).is_err());
    }

    #[test]
    fn messages_round_trip() {
        match decode(encode_eager(7, CHAN_USER, 3, b"abc")).unwrap() {
            ProtoMsg::Eager { comm: 7, chan: CHAN_USER, seq: 3, call: 0, data, desc } => {
                assert_eq!((data, desc), (b"abc".to_vec(), NO_DESC))
            }
            m => panic!("{m:?}"),
        }
        let h = Head { comm: 7, chan: CHAN_COLL, seq: 3, call: 41, desc: [9; 16] };
        let mut b = eager_header(&h).to_vec();
        b.extend_from_slice(b"xy");
        match decode(b).unwrap() {
            ProtoMsg::Eager { call: 41, desc, data, .. } => assert_eq!((desc, data), ([9; 16], b"xy".to_vec())),
            m => panic!("{m:?}"),
        }
        let cts = Cts { seq: 9, call: 5, desc: [7; 16], len: 100, buf: RemoteBuf { addr: 1, len: 2, key: 3 }, imm: 4 };
        match decode(encode_cts(1, CHAN_INTERNAL, &cts).to_vec()).unwrap() {
            ProtoMsg::Cts { comm: 1, chan: CHAN_INTERNAL, cts: c } => {
                assert_eq!((c.seq, c.call, c.desc, c.len, c.buf, c.imm), (9, 5, [7; 16], 100, cts.buf, 4))
            }
            m => panic!("{m:?}"),
        }
        let f = Fault { kind: FaultKind::Mismatch, culprit: Some(2), reporter: None, op: "allreduce".into(), what: "bad".into() };
        match decode(encode_err(&f, 1, None)).unwrap() {
            ProtoMsg::Err(g, None) => assert_eq!(g, Fault { reporter: Some(1), ..f.clone() }),
            m => panic!("{m:?}"),
        }
        // Scoped to a communicator (the world's id, 0, included).
        for c in [0, 7] {
            match decode(encode_err(&f, 1, Some(c))).unwrap() {
                ProtoMsg::Err(g, Some(got)) => assert_eq!((g.kind, got), (f.kind, c)),
                m => panic!("{m:?}"),
            }
        }
        // A relayed fault keeps the rank that found it.
        let relayed = Fault { reporter: Some(3), culprit: None, ..f };
        match decode(encode_err(&relayed, 1, None)).unwrap() {
            ProtoMsg::Err(g, None) => assert_eq!(g, relayed),
            m => panic!("{m:?}"),
        }
        match decode(encode_rts(&Head { comm: 2, chan: 1, seq: 5, call: 6, desc: [1; 16] }, 1 << 40).to_vec()).unwrap() {
            ProtoMsg::Rts { comm: 2, chan: 1, seq: 5, call: 6, len, desc } => assert_eq!((len, desc), (1 << 40, [1; 16])),
            m => panic!("{m:?}"),
        }
        let l = Leave { how: Departure::Dropped, calls: 12, sent: [1, 2, 3], recv: [4, 5, 6] };
        let e = encode_leave(9, &l);
        assert_eq!(e.len(), LEAVE_LEN);
        match decode(e).unwrap() {
            ProtoMsg::Leave { comm: 9, leave } => assert_eq!(leave, l),
            m => panic!("{m:?}"),
        }
        match decode(encode_probe(4, 8, &[3; 16]).to_vec()).unwrap() {
            ProtoMsg::Probe { comm: 4, call: 8, desc } => assert_eq!(desc, [3; 16]),
            m => panic!("{m:?}"),
        }
        assert!(matches!(decode(encode_agreed(11).to_vec()).unwrap(), ProtoMsg::Agreed { comm: 11 }));
        assert!(decode(encode_agreed(11).into_iter().chain([0]).collect()).is_err(), "AGREED has no body");
        assert!(decode(vec![1, 2, 3]).is_err());
        assert!(decode(vec![0; EAGER_HEADER].into_iter().chain([0]).collect()).is_err());
    }

    proptest::proptest! {
        #[test]
        fn garbage_never_panics(data in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..128)) {
            let _ = decode(data);
        }
    }
}

#[cfg(test)]
mod desc_tests {
    use super::*;

    #[test]
    fn descriptors_describe_calls() {
        let shape = |coll, dtype, op, count, chunk_bytes, slots| Shape {
            coll,
            n: 4,
            rank: 0,
            count,
            dtype,
            op,
            chunk_bytes,
            in_place: false,
            slots,
        };
        let d = encode_desc(
            &shape(Collective::Reduce { root: 3 }, DType::Bf16, ReduceOp::Max, 1000, 1 << 19, 4),
            Algo::Mesh,
            ProtoChoice::Eager,
        );
        let s = describe(&d);
        assert!(s.contains("reduce(count 1000, bf16, max, root 3, algo mesh, proto eager, chunk 524288 B, slots 4)"), "{s}");
        let a = encode_desc(&shape(Collective::AllReduce, DType::F32, ReduceOp::Sum, 0, 4096, 1), Algo::Ring, ProtoChoice::Auto);
        assert_ne!(a, NO_DESC);
        assert!(describe(&a).starts_with("allreduce(count 0, f32, sum,"), "{}", describe(&a));
        assert_eq!(describe(&NO_DESC), "point-to-point send/recv");
    }
}
