//! Point-to-point protocols over the transport contract: eager and rendezvous.
//!
//! Every message carries a small header: the communicator id, a channel (user
//! point-to-point, or internal traffic such as barriers and splits, so the two never
//! mix), a kind and a per-(communicator, channel, peer, direction) sequence number.
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
        len: u64,
    },
}

/// Bytes of the eager header (data follows it).
pub(crate) const EAGER_HEADER: usize = 12;

fn head(w: &mut Writer, comm: u32, chan: u8, kind: u8, seq: u32) {
    w.u32(comm).u8(chan).u8(kind).u8(0).u8(0).u32(seq);
}

pub(crate) fn encode_eager(comm: u32, chan: u8, seq: u32, data: &[u8]) -> Vec<u8> {
    let mut w = Writer { buf: Vec::with_capacity(EAGER_HEADER + data.len()) };
    head(&mut w, comm, chan, K_EAGER, seq);
    w.raw(data);
    w.finish()
}

pub(crate) fn encode_cts(comm: u32, chan: u8, cts: &Cts) -> Vec<u8> {
    let mut w = Writer::new();
    head(&mut w, comm, chan, K_CTS, cts.seq);
    w.u64(cts.len).u64(cts.buf.addr).u64(cts.buf.len).u64(cts.buf.key).u32(cts.imm);
    w.finish()
}

pub(crate) fn encode_rts(comm: u32, chan: u8, seq: u32, len: u64) -> Vec<u8> {
    let mut w = Writer::new();
    head(&mut w, comm, chan, K_RTS, seq);
    w.u64(len);
    w.finish()
}

pub(crate) fn encode_err(comm: u32, chan: u8, seq: u32, what: &str) -> Vec<u8> {
    let mut w = Writer::new();
    head(&mut w, comm, chan, K_ERR, seq);
    w.str(what);
    w.finish()
}

pub(crate) fn decode(mut msg: Vec<u8>) -> DResult<ProtoMsg> {
    let mut r = Reader::new(&msg);
    let comm = r.u32()?;
    let chan = r.u8()?;
    let kind = r.u8()?;
    r.raw(2)?;
    let seq = r.u32()?;
    match kind {
        K_EAGER => {
            msg.drain(..EAGER_HEADER);
            Ok(ProtoMsg::Eager { comm, chan, seq, data: msg })
        }
        K_CTS => {
            let len = r.u64()?;
            let buf = RemoteBuf { addr: r.u64()?, len: r.u64()?, key: r.u64()? };
            let imm = r.u32()?;
            r.end()?;
            Ok(ProtoMsg::Cts { comm, chan, cts: Cts { seq, len, buf, imm } })
        }
        K_RTS => {
            let len = r.u64()?;
            r.end()?;
            Ok(ProtoMsg::Rts { comm, chan, seq, len })
        }
        K_ERR => {
            let what = r.str()?.to_string();
            let _ = (comm, chan, seq);
            Ok(ProtoMsg::Err { what })
        }
        k => Err(DecodeError(format!("unknown message kind {k}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip() {
        match decode(encode_eager(7, CHAN_USER, 3, b"abc")).unwrap() {
            ProtoMsg::Eager { comm: 7, chan: CHAN_USER, seq: 3, data } => assert_eq!(data, b"abc"),
            m => panic!("{m:?}"),
        }
        let cts = Cts { seq: 9, len: 100, buf: RemoteBuf { addr: 1, len: 2, key: 3 }, imm: 4 };
        match decode(encode_cts(1, CHAN_INTERNAL, &cts)).unwrap() {
            ProtoMsg::Cts { comm: 1, chan: CHAN_INTERNAL, cts: c } => {
                assert_eq!((c.seq, c.len, c.buf, c.imm), (9, 100, cts.buf, 4))
            }
            m => panic!("{m:?}"),
        }
        match decode(encode_err(1, 0, 2, "bad")).unwrap() {
            ProtoMsg::Err { what, .. } => assert_eq!(what, "bad"),
            m => panic!("{m:?}"),
        }
        match decode(encode_rts(2, 1, 5, 1 << 40)).unwrap() {
            ProtoMsg::Rts { comm: 2, chan: 1, seq: 5, len } => assert_eq!(len, 1 << 40),
            m => panic!("{m:?}"),
        }
        assert!(decode(vec![1, 2, 3]).is_err());
        assert!(decode(vec![0; 12].into_iter().chain([0]).collect()).is_err());
    }
}
