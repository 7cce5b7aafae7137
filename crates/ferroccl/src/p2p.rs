//! Non-blocking point-to-point transfers: the state machines behind `send`/`recv` and the
//! collective executor. A transfer is started, then advanced by whoever drives the fabric
//! until it reports completion; nothing here blocks except posting into a full ring.
//!
//! Protocol (see `proto`): eager up to `FERROCCL_EAGER_MAX` (one message), rendezvous above
//! (ready-to-send, clear-to-send, one-sided write with immediate straight into the
//! receiver's registered buffer).

use std::time::Instant;

use ferroccl_mem::region::RegionHandle;

use crate::error::{in_elements, Error, Op, Result};
use crate::fabric::Fabric;
use crate::inbox::{Events, Incoming, View};
use crate::params::FaultSite;
use crate::proto::{self, Cts, Desc, Head, Leave, CHAN_USER};
use crate::transport::{PendingWrite, WriteGrant, WriteReq, WriteTicket};

/// Which ordered stream a transfer belongs to, and what is reported in errors.
#[derive(Clone, Copy, Debug)]
pub(crate) struct XferCtx<'a> {
    pub(crate) fabric: &'a Fabric,
    /// Communicator id.
    pub(crate) comm: u32,
    /// Its members' world ranks.
    pub(crate) members: &'a [usize],
    pub(crate) chan: u8,
    /// This rank in the communicator (for messages).
    pub(crate) rank: usize,
    /// The operation, for errors ("allreduce", "send to rank 3").
    pub(crate) op: &'a Op,
    pub(crate) deadline: Instant,
    /// The call's descriptor (zero for point-to-point).
    pub(crate) desc: Desc,
    /// The call's number among the calls every member makes (0 for point-to-point).
    pub(crate) call: u32,
    /// Largest transfer sent eagerly (both sides must agree: it is part of the call).
    pub(crate) eager_max: usize,
}

impl XferCtx<'_> {
    fn eager(&self, wpeer: usize, len: usize) -> Result<bool> {
        let ep = self.fabric.endpoint(wpeer)?;
        Ok(len <= self.eager_max && proto::EAGER_HEADER.saturating_add(len) <= ep.max_send())
    }

    pub(crate) fn pump(&self) -> Result<()> {
        self.fabric.pump(self.op, Some(View { comm: self.comm, members: self.members }))
    }

    pub(crate) fn closed(&self, peer: usize) -> Error {
        Error::PeerFailed {
            rank: self.rank,
            peer,
            op: self.op_named(),
            reason: "closed its communicator before this operation matched (finalized or dropped early?)".into(),
            cause: None,
        }
    }

    /// The operation as errors name it: with its call number, if it has one.
    pub(crate) fn op_named(&self) -> Op {
        self.op.numbered(self.call)
    }

    /// `n` bytes as the caller's elements ("250 f32") where the call has an element type.
    fn size(&self, n: u64) -> String {
        in_elements(n, self.op.p2p_elem())
    }

    fn head(&self, seq: u32) -> Head {
        Head { comm: self.comm, chan: self.chan, seq, call: self.call, desc: self.desc }
    }

    fn call_text(&self, call: u32, desc: &Desc) -> String {
        if call == 0 {
            proto::describe(desc)
        } else {
            format!("{} as call #{call}", proto::describe(desc))
        }
    }

    /// A message of `peer`'s (a rank of the communicator) for its call `call` / `theirs`
    /// against ours. The text names both ranks, so that it reads the same on every rank it
    /// is relayed to.
    fn check_call(&self, peer: usize, call: u32, theirs: &Desc) -> Result<()> {
        if *theirs == self.desc && call == self.call {
            return Ok(());
        }
        let what = if *theirs == self.desc {
            format!(
                "rank {} is in call #{}, rank {peer} sent for its call #{call}, both {}: one of them made a call the other did not",
                self.rank,
                self.call,
                proto::describe(theirs)
            )
        } else {
            format!(
                "rank {} called {}, rank {peer} called {}",
                self.rank,
                self.call_text(self.call, &self.desc),
                self.call_text(call, theirs)
            )
        };
        Err(Error::Mismatch { rank: self.rank, peer, op: self.op_named(), what, cause: None })
    }

    /// After this collective call finished here: a message a member sent this rank for it,
    /// or for an earlier call that has finished here too (`done`: calls still in flight, a
    /// scope's, may finish later), that nothing took is a mismatch (the member made the
    /// call otherwise: as a broadcast's root where this rank took another root, say; both
    /// sides returned, and the message would otherwise sit until finalize while later calls
    /// run on top of it). Free while no collective message waits anywhere (one load).
    pub(crate) fn left_over(&self, done: &dyn Fn(u32) -> bool) -> Result<()> {
        if self.call == 0 || self.fabric.inbox.coll_backlog() == 0 {
            return Ok(());
        }
        let ev = self.fabric.inbox.lock();
        for (p, &w) in self.members.iter().enumerate().filter(|&(p, _)| p != self.rank) {
            let Some(q) = ev.data.get(&(self.comm, proto::CHAN_COLL, w)) else { continue };
            // Calls at or before this one (numbers wrap: compared as a difference).
            let stale = |c: u32| c != 0 && (c == self.call || ((self.call.wrapping_sub(c) as i32) > 0 && done(c)));
            let Some(m) = q.iter().find(|m| stale(m.call)) else { continue };
            let me = self.rank;
            let made = if m.call == self.call { format!(" made as {} and", proto::describe(&self.desc)) } else { String::new() };
            let what = format!(
                "rank {p} sent rank {me} a message for {} as call #{}, which rank {me}{made} finished without it",
                proto::describe(&m.desc),
                m.call
            );
            return Err(Error::Mismatch { rank: self.rank, peer: p, op: self.op_named(), what, cause: None });
        }
        Ok(())
    }

    /// A message or clear-to-send from `wpeer` for this very call whose descriptor
    /// differs: the peer called something else, and whatever we wait for will never come.
    /// Looks only while waiting; collective calls only.
    fn conflict(&self, ev: &Events, peer: usize, wpeer: usize) -> Result<()> {
        if self.call == 0 {
            return Ok(());
        }
        let key = (self.comm, self.chan, wpeer);
        let data = ev.data.get(&key).and_then(|q| q.iter().find(|m| m.call == self.call && m.desc != self.desc)).map(|m| m.desc);
        let cts = || ev.cts.get(&key).and_then(|q| q.iter().find(|c| c.call == self.call && c.desc != self.desc)).map(|c| c.desc);
        match data.or_else(cts) {
            Some(theirs) => self.check_call(peer, self.call, &theirs),
            None => Ok(()),
        }
    }

    /// The error for waiting on `peer` (world rank `wpeer`), which left the communicator
    /// as `l` says.
    fn left(&self, peer: usize, l: &Leave) -> Error {
        let c = usize::from(CHAN_USER);
        Error::PeerLeft {
            rank: self.rank,
            peer,
            op: self.op_named(),
            how: l.how,
            peer_calls: u64::from(l.calls),
            p2p: (self.chan == CHAN_USER).then(|| (u64::from(l.sent[c]), u64::from(l.recv[c]))),
            cause: None,
        }
    }

    /// Whether the peer left before receiving our message `seq` on this stream.
    fn left_before_receiving(&self, ev: &Events, peer: usize, wpeer: usize, seq: u32) -> Result<()> {
        match ev.left.get(&(self.comm, wpeer)) {
            Some(l) if seq >= l.recv[usize::from(self.chan)] => Err(self.left(peer, l)),
            _ => Ok(()),
        }
    }

    /// Whether the peer left before sending its message `seq` on this stream.
    fn left_before_sending(&self, ev: &Events, peer: usize, wpeer: usize, seq: u32) -> Result<()> {
        match ev.left.get(&(self.comm, wpeer)) {
            Some(l) if seq >= l.sent[usize::from(self.chan)] => Err(self.left(peer, l)),
            _ => Ok(()),
        }
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
    /// A write the receiver pulls (shm single copy): revoked on completion or drop, so
    /// that whatever happens, the receiver cannot read our buffer once it is handed back.
    pull: Option<PendingWrite>,
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
    pub(crate) fn advance(&mut self, cx: &XferCtx<'_>) -> Result<bool> {
        match self.state {
            SendState::Start => {
                let ep = cx.fabric.endpoint(self.wpeer)?;
                if cx.fabric.inbox.any_left() {
                    // The receiver may have left already: then this message would be lost
                    // (and if it sent us something for this very call, the calls differ).
                    let ev = cx.fabric.inbox.lock();
                    cx.conflict(&ev, self.peer, self.wpeer)?;
                    cx.left_before_receiving(&ev, self.peer, self.wpeer, self.seq)?;
                }
                if cx.eager(self.wpeer, self.len)? {
                    // Header on the stack, data straight from the source: nothing allocated.
                    let head = proto::eager_header(&cx.head(self.seq));
                    if cx.fabric.params.injects(FaultSite::SendSource, cx.fabric.rank) {
                        return Err(Error::internal(format!("{}: send source: injected by FERROCCL_INJECT_FAULT", cx.op)));
                    }
                    self.src
                        .with_slice(self.offset, self.len, |b| ep.post_send2(&head, b, cx.deadline, &|| cx.pump()))
                        .map_err(|e| Error::internal(format!("{}: send source: {e}", cx.op)))??;
                    self.state = SendState::Done;
                } else {
                    ep.post_send(&proto::encode_rts(&cx.head(self.seq), self.len as u64), cx.deadline, &|| cx.pump())?;
                    self.state = SendState::WaitCts;
                }
                Ok(true)
            }
            SendState::WaitCts => {
                let key = (cx.comm, cx.chan, self.wpeer);
                let cts = {
                    let mut ev = cx.fabric.inbox.lock();
                    let closed = ev.closed.contains(&self.wpeer);
                    // Several transfers to one peer may be in flight: find ours by sequence.
                    let q = ev.cts.entry(key).or_default();
                    match q.iter().position(|c| c.seq == self.seq) {
                        Some(i) => q.remove(i),
                        None => {
                            cx.conflict(&ev, self.peer, self.wpeer)?;
                            cx.left_before_receiving(&ev, self.peer, self.wpeer, self.seq)?;
                            if closed {
                                return Err(cx.closed(self.peer));
                            }
                            None
                        }
                    }
                };
                let Some(cts) = cts else { return Ok(false) };
                cx.check_call(self.peer, cts.call, &cts.desc)?;
                if cts.len != self.len as u64 {
                    return Err(Error::Mismatch {
                        rank: cx.rank,
                        peer: self.peer,
                        op: cx.op_named(),
                        what: format!(
                            "rank {} sends {}, rank {} receives {}",
                            cx.rank,
                            cx.size(self.len as u64),
                            self.peer,
                            cx.size(cts.len)
                        ),
                        cause: None,
                    });
                }
                let ep = cx.fabric.endpoint(self.wpeer)?;
                let w = WriteReq {
                    src: &self.src,
                    src_mr: None,
                    offset: self.offset,
                    len: self.len,
                    dst: cts.buf,
                    dst_offset: 0,
                    imm: cts.imm,
                };
                match ep.post_write(&w, cx.deadline, &|| cx.pump())? {
                    WriteTicket::Done => self.state = SendState::Done,
                    WriteTicket::Pending(ticket) => {
                        self.pull = Some(ticket);
                        self.state = SendState::Pulling;
                    }
                }
                Ok(true)
            }
            SendState::Pulling => {
                let Some(ticket) = &self.pull else { return Err(Error::internal("pulling without a slot")) };
                match ticket.status() {
                    None => Ok(false),
                    Some(r) => {
                        let transport = ticket.transport();
                        self.pull = None;
                        r.map_err(|()| Error::Transport {
                            rank: cx.rank,
                            peer: Some(self.peer),
                            transport,
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
    reg: WriteGrant,
}

impl RecvOp {
    pub(crate) fn new(peer: usize, wpeer: usize, seq: u32, dst: RegionHandle, offset: usize, len: usize) -> RecvOp {
        RecvOp { peer, wpeer, seq, dst, offset, len, imm: 0, state: RecvState::Start, reg: WriteGrant::default() }
    }

    pub(crate) fn is_done(&self) -> bool {
        self.state == RecvState::Done
    }

    pub(crate) fn waiting_for(&self) -> Option<usize> {
        (!self.is_done()).then_some(self.wpeer)
    }

    fn mismatch(&self, cx: &XferCtx<'_>, sent: u64) -> Error {
        Error::Mismatch {
            rank: cx.rank,
            peer: self.peer,
            op: cx.op_named(),
            what: format!("rank {} receives {}, rank {} sends {}", cx.rank, cx.size(self.len as u64), self.peer, cx.size(sent)),
            cause: None,
        }
    }

    /// Moves the receive as far as it can go now; returns whether anything happened.
    pub(crate) fn advance(&mut self, cx: &XferCtx<'_>) -> Result<bool> {
        let key = (cx.comm, cx.chan, self.wpeer);
        match self.state {
            RecvState::Start => {
                if cx.eager(self.wpeer, self.len)? {
                    self.state = RecvState::WaitEager;
                } else {
                    let (remote, reg) = cx.fabric.register(&self.dst, self.offset, self.len, self.wpeer)?;
                    self.reg = reg;
                    self.imm = cx.fabric.next_imm();
                    let cts = Cts { seq: self.seq, call: cx.call, desc: cx.desc, len: self.len as u64, buf: remote, imm: self.imm };
                    cx.fabric.endpoint(self.wpeer)?.post_send(&proto::encode_cts(cx.comm, cx.chan, &cts), cx.deadline, &|| cx.pump())?;
                    self.state = RecvState::WaitImm { announced: false };
                }
                Ok(true)
            }
            RecvState::WaitEager => {
                let msg: Option<Incoming> = {
                    let mut ev = cx.fabric.inbox.lock();
                    let closed = ev.closed.contains(&self.wpeer);
                    let q = ev.data.entry(key).or_default();
                    match q.iter().position(|m| m.seq == self.seq) {
                        Some(i) => {
                            cx.fabric.inbox.count_coll(cx.chan, -1);
                            q.remove(i)
                        }
                        None => {
                            cx.conflict(&ev, self.peer, self.wpeer)?;
                            cx.left_before_sending(&ev, self.peer, self.wpeer, self.seq)?;
                            if closed {
                                return Err(cx.closed(self.peer));
                            }
                            None
                        }
                    }
                };
                let Some(msg) = msg else { return Ok(false) };
                if let Err(e) = cx.check_call(self.peer, msg.call, &msg.desc) {
                    cx.fabric.inbox.give_buf(msg.data);
                    return Err(e);
                }
                if let Some(sent) = msg.rts {
                    return Err(self.mismatch(cx, sent));
                }
                if msg.data.len() != self.len {
                    return Err(self.mismatch(cx, msg.data.len() as u64));
                }
                let r = if cx.fabric.params.injects(FaultSite::RecvBuffer, cx.fabric.rank) {
                    Err("injected by FERROCCL_INJECT_FAULT".to_string())
                } else {
                    self.dst.write_at(self.offset, &msg.data).map_err(|e| e.to_string())
                };
                cx.fabric.inbox.give_buf(msg.data);
                r.map_err(|e| Error::internal(format!("{}: receive buffer: {e}", cx.op)))?;
                self.state = RecvState::Done;
                Ok(true)
            }
            RecvState::WaitImm { announced } => {
                let mut ev = cx.fabric.inbox.lock();
                let mut moved = false;
                let mut announced = announced;
                if !announced {
                    // The sender's ready-to-send (or, if it thinks the message is small, the
                    // data itself) comes first on the stream.
                    let q = ev.data.entry(key).or_default();
                    if let Some(i) = q.iter().position(|m| m.seq == self.seq) {
                        let (call, desc, rts, dlen) = (q[i].call, q[i].desc, q[i].rts, q[i].data.len());
                        cx.check_call(self.peer, call, &desc)?;
                        match rts {
                            Some(sent) if sent == self.len as u64 => {
                                q.remove(i);
                                cx.fabric.inbox.count_coll(cx.chan, -1);
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
                    self.reg = WriteGrant::default();
                    self.state = RecvState::Done;
                    return Ok(true);
                }
                if !moved {
                    cx.conflict(&ev, self.peer, self.wpeer)?;
                    if !announced {
                        cx.left_before_sending(&ev, self.peer, self.wpeer, self.seq)?;
                    }
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
