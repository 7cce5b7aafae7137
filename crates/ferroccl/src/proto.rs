//! Point-to-point protocols over the transport contract: eager and rendezvous.
//!
//! Every message carries a small header: the communicator id, a channel (user
//! point-to-point, collectives, or internal traffic such as barriers and splits, so they
//! never mix), a kind, a per-(communicator, channel, peer, direction) sequence number, and
//! a 16-byte descriptor of the call it belongs to (collective, dtype, op, algorithm, root,
//! count; zero for point-to-point), so that ranks that call a collective differently fail
//! with an error that says how, instead of exchanging garbage.
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
//!
//! Both sides know the length (typed buffers), so both pick the same protocol. A length
//! mismatch is found on the wire: the side that sees it fails and sends `ERR` so the other
//! side fails too, instead of hanging or truncating.

use crate::transport::RemoteBuf;
use crate::wire::{DResult, DecodeError, Reader, Writer};

/// Channels: separate ordered streams inside one communicator.
pub(crate) const CHAN_USER: u8 = 0;
/// Internal traffic (barrier, split, setup).
pub(crate) const CHAN_INTERNAL: u8 = 1;
/// Collectives.
pub(crate) const CHAN_COLL: u8 = 2;

/// What call a message belongs to; compared by the receiver.
pub(crate) type Desc = [u8; 16];
/// The descriptor of point-to-point traffic.
pub(crate) const NO_DESC: Desc = [0; 16];

const K_EAGER: u8 = 1;
const K_CTS: u8 = 2;
const K_ERR: u8 = 3;
const K_RTS: u8 = 4;

/// Where a message belongs: (communicator id, channel, peer world rank).
pub(crate) type StreamKey = (u32, u8, usize);

/// A clear-to-send: the receiver's buffer, ready for a write.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Cts {
    pub(crate) seq: u32,
    pub(crate) desc: Desc,
    pub(crate) len: u64,
    pub(crate) buf: RemoteBuf,
    pub(crate) imm: u32,
}

/// A decoded protocol message.
#[derive(Debug)]
pub(crate) enum ProtoMsg {
    Eager {
        comm: u32,
        chan: u8,
        seq: u32,
        desc: Desc,
        data: Vec<u8>,
    },
    Cts {
        comm: u32,
        chan: u8,
        cts: Cts,
    },
    Err {
        what: String,
    },
    /// A rendezvous sender's announcement: lets an eager receiver see the mismatch.
    Rts {
        comm: u32,
        chan: u8,
        seq: u32,
        desc: Desc,
        len: u64,
    },
}

/// Bytes of the eager header (data follows it).
pub(crate) const EAGER_HEADER: usize = 28;

fn head(w: &mut Writer, comm: u32, chan: u8, kind: u8, seq: u32, desc: &Desc) {
    w.u32(comm).u8(chan).u8(kind).u8(0).u8(0).u32(seq).raw(desc);
}

/// An eager message: the header, then `fill` appends `len` bytes of data.
#[cfg(test)]
pub(crate) fn encode_eager_with(comm: u32, chan: u8, seq: u32, desc: &Desc, len: usize, fill: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut w = Writer { buf: Vec::with_capacity(EAGER_HEADER + len) };
    head(&mut w, comm, chan, K_EAGER, seq, desc);
    fill(&mut w.buf);
    w.finish()
}

#[cfg(test)]
pub(crate) fn encode_eager(comm: u32, chan: u8, seq: u32, data: &[u8]) -> Vec<u8> {
    encode_eager_with(comm, chan, seq, &NO_DESC, data.len(), |b| b.extend_from_slice(data))
}

/// The header of an eager message, on the stack (the data follows it on the wire).
pub(crate) fn eager_header(comm: u32, chan: u8, seq: u32, desc: &Desc) -> [u8; EAGER_HEADER] {
    let mut b = [0u8; EAGER_HEADER];
    put_head(&mut b, comm, chan, K_EAGER, seq, desc);
    b
}

fn put_head(b: &mut [u8], comm: u32, chan: u8, kind: u8, seq: u32, desc: &Desc) {
    b[0..4].copy_from_slice(&comm.to_le_bytes());
    b[4] = chan;
    b[5] = kind;
    b[6] = 0;
    b[7] = 0;
    b[8..12].copy_from_slice(&seq.to_le_bytes());
    b[12..28].copy_from_slice(desc);
}

/// Bytes of a clear-to-send.
pub(crate) const CTS_LEN: usize = EAGER_HEADER + 36;
/// Bytes of a ready-to-send.
pub(crate) const RTS_LEN: usize = EAGER_HEADER + 8;

pub(crate) fn encode_cts(comm: u32, chan: u8, cts: &Cts) -> [u8; CTS_LEN] {
    let mut b = [0u8; CTS_LEN];
    put_head(&mut b, comm, chan, K_CTS, cts.seq, &cts.desc);
    let mut o = EAGER_HEADER;
    for v in [cts.len, cts.buf.addr, cts.buf.len, cts.buf.key] {
        b[o..o + 8].copy_from_slice(&v.to_le_bytes());
        o += 8;
    }
    b[o..o + 4].copy_from_slice(&cts.imm.to_le_bytes());
    b
}

pub(crate) fn encode_rts(comm: u32, chan: u8, seq: u32, desc: &Desc, len: u64) -> [u8; RTS_LEN] {
    let mut b = [0u8; RTS_LEN];
    put_head(&mut b, comm, chan, K_RTS, seq, desc);
    b[EAGER_HEADER..].copy_from_slice(&len.to_le_bytes());
    b
}

pub(crate) fn encode_err(comm: u32, chan: u8, seq: u32, what: &str) -> Vec<u8> {
    let mut w = Writer::new();
    head(&mut w, comm, chan, K_ERR, seq, &NO_DESC);
    w.str(what);
    w.finish()
}

#[cfg(test)]
pub(crate) fn decode(msg: Vec<u8>) -> DResult<ProtoMsg> {
    decode_keep(msg).map(|(m, _)| m)
}

/// [`decode`], handing back the message's buffer when the decoded message does not own it
/// (everything but eager data), so that it can be reused.
pub(crate) fn decode_keep(mut msg: Vec<u8>) -> DResult<(ProtoMsg, Option<Vec<u8>>)> {
    let m = {
        let mut r = Reader::new(&msg);
        let comm = r.u32()?;
        let chan = r.u8()?;
        let kind = r.u8()?;
        r.raw(2)?;
        let seq = r.u32()?;
        let mut desc = NO_DESC;
        desc.copy_from_slice(r.raw(16)?);
        match kind {
            K_EAGER => None,
            K_CTS => {
                let len = r.u64()?;
                let buf = RemoteBuf { addr: r.u64()?, len: r.u64()?, key: r.u64()? };
                let imm = r.u32()?;
                r.end()?;
                Some(ProtoMsg::Cts { comm, chan, cts: Cts { seq, desc, len, buf, imm } })
            }
            K_RTS => {
                let len = r.u64()?;
                r.end()?;
                Some(ProtoMsg::Rts { comm, chan, seq, desc, len })
            }
            K_ERR => {
                let what = r.str()?.to_string();
                Some(ProtoMsg::Err { what })
            }
            k => return Err(DecodeError(format!("unknown message kind {k}"))),
        }
        .ok_or((comm, chan, seq, desc))
    };
    match m {
        Ok(m) => Ok((m, Some(msg))),
        Err((comm, chan, seq, desc)) => {
            msg.drain(..EAGER_HEADER);
            Ok((ProtoMsg::Eager { comm, chan, seq, desc, data: msg }, None))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip() {
        match decode(encode_eager(7, CHAN_USER, 3, b"abc")).unwrap() {
            ProtoMsg::Eager { comm: 7, chan: CHAN_USER, seq: 3, data, desc } => assert_eq!((data, desc), (b"abc".to_vec(), NO_DESC)),
            m => panic!("{m:?}"),
        }
        let cts = Cts { seq: 9, desc: [7; 16], len: 100, buf: RemoteBuf { addr: 1, len: 2, key: 3 }, imm: 4 };
        match decode(encode_cts(1, CHAN_INTERNAL, &cts).to_vec()).unwrap() {
            ProtoMsg::Cts { comm: 1, chan: CHAN_INTERNAL, cts: c } => {
                assert_eq!((c.seq, c.desc, c.len, c.buf, c.imm), (9, [7; 16], 100, cts.buf, 4))
            }
            m => panic!("{m:?}"),
        }
        match decode(encode_err(1, 0, 2, "bad")).unwrap() {
            ProtoMsg::Err { what, .. } => assert_eq!(what, "bad"),
            m => panic!("{m:?}"),
        }
        match decode(encode_rts(2, 1, 5, &[1; 16], 1 << 40).to_vec()).unwrap() {
            ProtoMsg::Rts { comm: 2, chan: 1, seq: 5, len, desc } => assert_eq!((len, desc), (1 << 40, [1; 16])),
            m => panic!("{m:?}"),
        }
        assert!(decode(vec![1, 2, 3]).is_err());
        assert!(decode(vec![0; 28].into_iter().chain([0]).collect()).is_err());
    }
}
