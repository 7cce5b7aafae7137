//! Non-blocking point-to-point transfers: the state machines behind `send`/`recv` and the
//! collective executor. A transfer is started, then advanced by whoever drives the fabric
//! until it reports completion; nothing here blocks except posting into a full ring.
//!
//! Protocol (see `proto`): eager up to `FERROCCL_EAGER_MAX` (one message), rendezvous above
//! (ready-to-send, clear-to-send, one-sided write with immediate straight into the
//! receiver's registered buffer).

use std::sync::Arc;
use std::time::Instant;

use ferroccl_mem::region::RegionHandle;

use crate::error::{Error, Result};
use crate::fabric::{Fabric, Incoming};
use crate::proto::{self, Cts, Desc};
use crate::transport::shm::LocalShm;
use crate::transport::{Registration, WriteReq, WriteTicket};

/// Which ordered stream a transfer belongs to, and what is reported in errors.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ctx<'a> {
    pub(crate) fabric: &'a Fabric,
    /// Communicator id.
    pub(crate) comm: u32,
    pub(crate) chan: u8,
    /// This rank in the communicator (for messages).
    pub(crate) rank: usize,
    /// The operation, for errors ("allreduce", "send to rank 3").
    pub(crate) op: &'a str,
    pub(crate) deadline: Instant,
    /// The call's descriptor (zero for point-to-point).
    pub(crate) desc: Desc,
    /// Renders a descriptor for mismatch errors.
    pub(crate) describe: fn(&Desc) -> String,
    /// Largest transfer sent eagerly (both sides must agree: it is part of the call).
    pub(crate) eager_max: usize,
}

impl Ctx<'_> {
    fn eager(&self, wpeer: usize, len: usize) -> Result<bool> {
        let ep = self.fabric.endpoint(wpeer)?;
        Ok(len <= self.eager_max && proto::EAGER_HEADER.saturating_add(len) <= ep.max_send())
    }

    fn pump(&self) -> Result<()> {
        self.fabric.pump(self.op)
    }

    fn closed(&self, peer: usize) -> Error {
        Error::PeerFailed {
            rank: self.rank,
            peer,
            op: self.op.to_string(),
            reason: "closed its communicator before this operation matched (finalized or dropped early?)".into(),
        }
    }

    fn check_desc(&self, peer: usize, theirs: &Desc) -> Result<()> {
        if *theirs == self.desc {
            return Ok(());
        }
        Err(Error::Mismatch {
            rank: self.rank,
            peer,
            op: self.op.to_string(),
            what: format!("this rank called {} but rank {peer} called {}", (self.describe)(&self.desc), (self.describe)(theirs)),
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SendState {
    Start,
    WaitCts,
    Pulling,
    Done,
}

/// A send in flight: `len` bytes of `src` from `offset`.
#[derive(Debug)]
pub(crate) struct SendOp {
    /// Communicator rank and world rank of the receiver.
    peer: usize,
    wpeer: usize,
    seq: u32,
    src: RegionHandle,
    offset: usize,
    len: usize,
    state: SendState,
    /// A pull slot lent to the receiver (shm single copy): revoked on completion or drop.
    pull: Option<(Arc<LocalShm>, usize, u64)>,
}

impl Drop for SendOp {
    fn drop(&mut self) {
        // Whatever happened, the receiver must not read our buffer once it is handed back.
        if let Some((shm, slot, _)) = self.pull.take() {
            shm.release_slot(slot);
        }
    }
}

impl SendOp {
    pub(crate) fn new(peer: usize, wpeer: usize, seq: u32, src: RegionHandle, offset: usize, len: usize) -> SendOp {
        SendOp { peer, wpeer, seq, src, offset, len, state: SendState::Start, pull: None }
    }

    pub(crate) fn is_done(&self) -> bool {
        self.state == SendState::Done
    }

    /// The world rank it waits for, while it waits.
    pub(crate) fn waiting_for(&self) -> Option<usize> {
        (!self.is_done()).then_some(self.wpeer)
    }

    /// Moves the send as far as it can go now; returns whether anything happened.
    pub(crate) fn advance(&mut self, cx: &Ctx<'_>) -> Result<bool> {
        match self.state {
            SendState::Start => {
                let ep = cx.fabric.endpoint(self.wpeer)?;
                if cx.eager(self.wpeer, self.len)? {
                    // Header on the stack, data straight from the source: nothing allocated.
                    let head = proto::eager_header(cx.comm, cx.chan, self.seq, &cx.desc);
                    self.src
                        .with_slice(self.offset, self.len, |b| ep.post_send2(&head, b, cx.deadline, &|| cx.pump()))
                        .map_err(|e| Error::invalid(format!("{}: send source: {e}", cx.op)))??;
                    self.state = SendState::Done;
                } else {
                    ep.post_send(&proto::encode_rts(cx.comm, cx.chan, self.seq, &cx.desc, self.len as u64), cx.deadline, &|| cx.pump())?;
                    self.state = SendState::WaitCts;
                }
                Ok(true)
            }
            SendState::WaitCts => {
                let key = (cx.comm, cx.chan, self.wpeer);
                let cts = {
                    let mut ev = cx.fabric.shared.lock();
                    let closed = ev.closed.contains(&self.wpeer);
                    // Several transfers to one peer may be in flight: find ours by sequence.
                    let q = ev.cts.entry(key).or_default();
                    match q.iter().position(|c| c.seq == self.seq) {
                        Some(i) => q.remove(i),
                        None if closed => return Err(cx.closed(self.peer)),
                        None => None,
                    }
                };
                let Some(cts) = cts else { return Ok(false) };
                cx.check_desc(self.peer, &cts.desc)?;
                if cts.len != self.len as u64 {
                    return Err(Error::Mismatch {
                        rank: cx.rank,
                        peer: self.peer,
                        op: cx.op.to_string(),
                        what: format!("this rank sends {} bytes, rank {} receives {}", self.len, self.peer, cts.len),
                    });
                }
                let ep = cx.fabric.endpoint(self.wpeer)?;
                let w = WriteReq { src: &self.src, offset: self.offset, len: self.len, dst: cts.buf, dst_offset: 0, imm: cts.imm };
                match ep.post_write(&w, cx.deadline, &|| cx.pump())? {
                    WriteTicket::Done => self.state = SendState::Done,
                    WriteTicket::Pending { slot, gen } => {
                        let shm = cx.fabric.local_shm().ok_or_else(|| Error::invalid("internal: pull without shm"))?.clone();
                        self.pull = Some((shm, slot, gen));
                        self.state = SendState::Pulling;
                    }
                }
                Ok(true)
            }
            SendState::Pulling => {
                let Some((shm, slot, gen)) = &self.pull else { return Err(Error::invalid("internal: pulling without a slot")) };
                match shm.pull_status(*slot, *gen) {
                    None => Ok(false),
                    Some(r) => {
                        if let Some((shm, slot, _)) = self.pull.take() {
                            shm.release_slot(slot);
                        }
                        r.map_err(|()| Error::Transport {
                            rank: cx.rank,
                            peer: self.peer,
                            transport: "shm",
                            what: format!("{}: rank {} could not copy the data", cx.op, self.peer),
                        })?;
                        self.state = SendState::Done;
                        Ok(true)
                    }
                }
            }
            SendState::Done => Ok(false),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RecvState {
    Start,
    WaitEager,
    WaitImm { announced: bool },
    Done,
}

/// A receive in flight into `len` bytes of `dst` from `offset`. For rendezvous the region
/// is registered with the fabric; whoever owns the region's scope deregisters it.
#[derive(Debug)]
pub(crate) struct RecvOp {
    peer: usize,
    wpeer: usize,
    seq: u32,
    dst: RegionHandle,
    offset: usize,
    len: usize,
    imm: u32,
    state: RecvState,
    /// Held while the sender may write into our range (verbs: the memory region).
    reg: Registration,
}

impl RecvOp {
    pub(crate) fn new(peer: usize, wpeer: usize, seq: u32, dst: RegionHandle, offset: usize, len: usize) -> RecvOp {
        RecvOp { peer, wpeer, seq, dst, offset, len, imm: 0, state: RecvState::Start, reg: Registration::default() }
    }

    pub(crate) fn is_done(&self) -> bool {
        self.state == RecvState::Done
    }

    pub(crate) fn waiting_for(&self) -> Option<usize> {
        (!self.is_done()).then_some(self.wpeer)
    }

    fn mismatch(&self, cx: &Ctx<'_>, sent: u64) -> Error {
        Error::Mismatch {
            rank: cx.rank,
            peer: self.peer,
            op: cx.op.to_string(),
            what: format!("this rank receives {} bytes, rank {} sends {sent}", self.len, self.peer),
        }
    }

    /// Moves the receive as far as it can go now; returns whether anything happened.
    pub(crate) fn advance(&mut self, cx: &Ctx<'_>) -> Result<bool> {
        let key = (cx.comm, cx.chan, self.wpeer);
        match self.state {
            RecvState::Start => {
                if cx.eager(self.wpeer, self.len)? {
                    self.state = RecvState::WaitEager;
                } else {
                    let (remote, reg) = cx.fabric.register(&self.dst, self.offset, self.len, self.wpeer)?;
                    self.reg = reg;
                    self.imm = cx.fabric.next_imm();
                    let cts = Cts { seq: self.seq, desc: cx.desc, len: self.len as u64, buf: remote, imm: self.imm };
                    cx.fabric.endpoint(self.wpeer)?.post_send(&proto::encode_cts(cx.comm, cx.chan, &cts), cx.deadline, &|| cx.pump())?;
                    self.state = RecvState::WaitImm { announced: false };
                }
                Ok(true)
            }
            RecvState::WaitEager => {
                let msg: Option<Incoming> = {
                    let mut ev = cx.fabric.shared.lock();
                    let closed = ev.closed.contains(&self.wpeer);
                    let q = ev.data.entry(key).or_default();
                    match q.iter().position(|m| m.seq == self.seq) {
                        Some(i) => q.remove(i),
                        None if closed => return Err(cx.closed(self.peer)),
                        None => None,
                    }
                };
                let Some(msg) = msg else { return Ok(false) };
                cx.check_desc(self.peer, &msg.desc)?;
                if let Some(sent) = msg.rts {
                    return Err(self.mismatch(cx, sent));
                }
                if msg.data.len() != self.len {
                    return Err(self.mismatch(cx, msg.data.len() as u64));
                }
                let r = self.dst.write_at(self.offset, &msg.data);
                cx.fabric.shared.give_buf(msg.data);
                r.map_err(|e| Error::invalid(format!("{}: receive buffer: {e}", cx.op)))?;
                self.state = RecvState::Done;
                Ok(true)
            }
            RecvState::WaitImm { announced } => {
                let mut ev = cx.fabric.shared.lock();
                let mut moved = false;
                let mut announced = announced;
                if !announced {
                    // The sender's ready-to-send (or, if it thinks the message is small, the
                    // data itself) comes first on the stream.
                    let q = ev.data.entry(key).or_default();
                    if let Some(i) = q.iter().position(|m| m.seq == self.seq) {
                        let (desc, rts, dlen) = (q[i].desc, q[i].rts, q[i].data.len());
                        cx.check_desc(self.peer, &desc)?;
                        match rts {
                            Some(sent) if sent == self.len as u64 => {
                                q.remove(i);
                                announced = true;
                                moved = true;
                            }
                            Some(sent) => return Err(self.mismatch(cx, sent)),
                            None => return Err(self.mismatch(cx, dlen as u64)),
                        }
                    }
                }
                if announced && ev.imms.remove(&(self.wpeer, self.imm)) {
                    drop(ev);
                    // Every byte has landed: end the peer's access before anyone reads.
                    self.reg = Registration::default();
                    self.state = RecvState::Done;
                    return Ok(true);
                }
                if ev.closed.contains(&self.wpeer) {
                    return Err(cx.closed(self.peer));
                }
                self.state = RecvState::WaitImm { announced };
                Ok(moved)
            }
            RecvState::Done => Ok(false),
        }
    }
}
