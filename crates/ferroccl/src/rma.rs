//! One-sided access to registered windows: the requester's transfers (`GetOp`, `PutOp`,
//! driven by the executor like sends and receives) and the owner's window server
//! ([`RmaServer`], run by the engine every round while this rank has windows).
//!
//! The handle a window gives out names its owner, its id, a random 64-bit key (the
//! capability), its job and its length; a request carries the id, the key, the job and the
//! byte range, and the *owner* checks all of them against its live windows before any byte
//! moves, so a forged, stale, out-of-range or wrong-access handle gets a refusal
//! ([`RmaStatus`], an [`Error::Refused`] at the requester) and never reaches memory outside
//! a live window of the right access. Over every transport:
//!
//! * **read** (`GET`): the requester registers its destination (as a rendezvous receiver
//!   does) and asks; the owner writes the window's range into it with write-with-immediate
//!   through the transport contract (shm: through the rings or a single-copy pull; tcp:
//!   straight into the buffer from the socket; verbs: RDMA WRITE into the requester's
//!   memory region), and the read completes on the immediate. One round trip.
//! * **write** (`PUT`): the bytes travel in messages of at most one send's size, each
//!   checked and landed by the owner, which answers each with a `REPLY`; the write
//!   completes when every piece is answered. One round trip, pipelined over the pieces.
//!
//! Requests belong to no stream: they are served in arrival order, whatever the owner is
//! doing, by whichever thread drives its engine (a waiting call, or the engine's own
//! thread, which keeps running while windows exist).

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Instant;

use ferroccl_mem::region::RegionHandle;

use crate::algo::Remote;
use crate::error::{Error, Op, Refusal, Result};
use crate::fabric::Fabric;
use crate::inbox::RmaRequest;
use crate::p2p::XferCtx;
use crate::proto::{self, RmaStatus, RmaTarget};
use crate::transport::{PendingWrite, WriteGrant, WriteReq, WriteTicket};

impl RmaStatus {
    /// The refusal a status means at the requester (`None`: the access succeeded).
    fn refusal(self) -> Option<Refusal> {
        match self {
            RmaStatus::Done => None,
            RmaStatus::NoWindow => Some(Refusal::NoWindow),
            RmaStatus::OtherJob => Some(Refusal::OtherJob),
            RmaStatus::OutOfRange => Some(Refusal::OutOfRange),
            RmaStatus::ReadOnly => Some(Refusal::ReadOnly),
            RmaStatus::Failed => Some(Refusal::Failed),
        }
    }
}

fn refused(cx: &XferCtx<'_>, owner: usize, reason: Refusal) -> Error {
    Error::Refused { rank: cx.rank, owner, op: cx.op.clone(), reason }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Start,
    Wait,
    Done,
}

/// A one-sided read in flight: `len` bytes at byte `offset` of window `remote` of world
/// rank `wpeer` into `dst[dst_offset..]`.
#[derive(Debug)]
pub(crate) struct GetOp {
    wpeer: usize,
    remote: Remote,
    offset: u64,
    dst: RegionHandle,
    dst_offset: usize,
    len: usize,
    req: u64,
    imm: u32,
    grant: WriteGrant,
    state: State,
    /// The owner's refusal: the step is over, and its job fails once its other transfers
    /// are over too (so that none of them is still landing when the job returns).
    refusal: Option<Error>,
}

impl GetOp {
    pub(crate) fn new(_peer: usize, wpeer: usize, remote: Remote, offset: u64, dst: RegionHandle, dst_offset: usize, len: usize) -> GetOp {
        GetOp {
            wpeer,
            remote,
            offset,
            dst,
            dst_offset,
            len,
            req: 0,
            imm: 0,
            grant: WriteGrant::default(),
            state: State::Start,
            refusal: None,
        }
    }

    pub(crate) fn is_done(&self) -> bool {
        self.state == State::Done
    }

    pub(crate) fn waiting_for(&self) -> Option<usize> {
        (self.state == State::Wait).then_some(self.wpeer)
    }

    fn refuse(&mut self, e: Error) -> bool {
        self.refusal = Some(e);
        self.state = State::Done;
        true
    }

    /// The owner's refusal, once (see `refusal`).
    pub(crate) fn take_refusal(&mut self) -> Option<Error> {
        self.refusal.take()
    }

    fn target(&self, cx: &XferCtx<'_>, req: u64) -> RmaTarget {
        RmaTarget { req, job: cx.fabric.job, window: self.remote.window, key: self.remote.key, offset: self.offset, len: self.len as u64 }
    }

    pub(crate) fn advance(&mut self, cx: &XferCtx<'_>) -> Result<bool> {
        match self.state {
            State::Start => {
                if self.wpeer == cx.fabric.rank {
                    // This rank's own window: the same checks, then a copy.
                    let t = self.target(cx, 0);
                    let e = match check(cx.fabric, &t, false) {
                        Ok(e) => e,
                        Err(st) => return Ok(self.refuse(refused(cx, self.wpeer, st.refusal().unwrap_or(Refusal::Failed)))),
                    };
                    e.region
                        .with_slice(t.offset as usize, self.len, |s| self.dst.write_at(self.dst_offset, s))
                        .and_then(|r| r)
                        .map_err(|err| Error::invalid(format!("{}: {err}", cx.op)))?;
                    self.state = State::Done;
                    return Ok(true);
                }
                let (buf, grant) = cx.fabric.register(&self.dst, self.dst_offset, self.len, self.wpeer)?;
                self.grant = grant;
                self.imm = cx.fabric.next_imm();
                self.req = cx.fabric.next_reqs(1);
                let target = self.target(cx, self.req);
                cx.fabric.endpoint(self.wpeer)?.post_send(&proto::encode_get(&target, &buf, self.imm), cx.deadline, &|| cx.pump())?;
                self.state = State::Wait;
                Ok(true)
            }
            State::Wait => {
                let mut ev = cx.fabric.inbox.lock();
                if ev.imms.remove(&(self.wpeer, self.imm)) {
                    drop(ev);
                    // Every byte has landed: end the owner's access to our buffer.
                    self.grant = WriteGrant::default();
                    self.state = State::Done;
                    return Ok(true);
                }
                if let Some(st) = ev.rma_replies.remove(&(self.wpeer, self.req)) {
                    drop(ev);
                    self.grant = WriteGrant::default();
                    return Ok(self.refuse(refused(cx, self.wpeer, st.refusal().unwrap_or(Refusal::Failed))));
                }
                if ev.closed.contains(&self.wpeer) {
                    return Err(cx.closed(self.wpeer));
                }
                Ok(false)
            }
            State::Done => Ok(false),
        }
    }
}

/// A one-sided write in flight: `len` bytes of `src[src_offset..]` to byte `offset` of
/// window `remote` of world rank `wpeer`, in pieces of at most one message each.
#[derive(Debug)]
pub(crate) struct PutOp {
    wpeer: usize,
    remote: Remote,
    offset: u64,
    src: RegionHandle,
    src_offset: usize,
    len: usize,
    /// The first piece's request number (piece `i` is `req + i`).
    req: u64,
    pieces: u64,
    /// Pieces sent, and pieces the owner has answered.
    sent: u64,
    acked: u64,
    piece: usize,
    state: State,
    /// As `GetOp::refusal`.
    refusal: Option<Error>,
}

impl PutOp {
    /// The owner's refusal, once (see `GetOp::refusal`).
    pub(crate) fn take_refusal(&mut self) -> Option<Error> {
        self.refusal.take()
    }

    pub(crate) fn new(_peer: usize, wpeer: usize, remote: Remote, offset: u64, src: RegionHandle, src_offset: usize, len: usize) -> PutOp {
        PutOp {
            wpeer,
            remote,
            offset,
            src,
            src_offset,
            len,
            req: 0,
            pieces: 0,
            sent: 0,
            acked: 0,
            piece: 0,
            state: State::Start,
            refusal: None,
        }
    }

    pub(crate) fn is_done(&self) -> bool {
        self.state == State::Done
    }

    pub(crate) fn waiting_for(&self) -> Option<usize> {
        (self.state == State::Wait).then_some(self.wpeer)
    }

    pub(crate) fn advance(&mut self, cx: &XferCtx<'_>) -> Result<bool> {
        match self.state {
            State::Start => {
                if self.wpeer == cx.fabric.rank {
                    // This rank's own window: the same checks, then a copy.
                    let t = RmaTarget {
                        req: 0,
                        job: cx.fabric.job,
                        window: self.remote.window,
                        key: self.remote.key,
                        offset: self.offset,
                        len: self.len as u64,
                    };
                    let e = match check(cx.fabric, &t, true) {
                        Ok(e) => e,
                        Err(st) => {
                            self.refusal = Some(refused(cx, self.wpeer, st.refusal().unwrap_or(Refusal::Failed)));
                            self.state = State::Done;
                            return Ok(true);
                        }
                    };
                    self.src
                        .with_slice(self.src_offset, self.len, |s| e.region.write_at(t.offset as usize, s))
                        .and_then(|r| r)
                        .map_err(|err| Error::invalid(format!("{}: {err}", cx.op)))?;
                    self.state = State::Done;
                    return Ok(true);
                }
                let ep = cx.fabric.endpoint(self.wpeer)?;
                self.piece = ep.max_send().saturating_sub(proto::PUT_HEADER).max(1);
                self.pieces = (self.len.div_ceil(self.piece) as u64).max(1);
                self.req = cx.fabric.next_reqs(self.pieces);
                for i in 0..self.pieces {
                    let start = i as usize * self.piece;
                    let n = self.piece.min(self.len - start.min(self.len));
                    let target = RmaTarget {
                        req: self.req + i,
                        job: cx.fabric.job,
                        window: self.remote.window,
                        key: self.remote.key,
                        offset: self.offset.saturating_add(start as u64),
                        len: n as u64,
                    };
                    let head = proto::put_header(&target);
                    self.src
                        .with_slice(self.src_offset + start, n, |b| ep.post_send2(&head, b, cx.deadline, &|| cx.pump()))
                        .map_err(|e| Error::internal(format!("{}: write source: {e}", cx.op)))??;
                    self.sent += 1;
                }
                self.state = State::Wait;
                Ok(true)
            }
            State::Wait => {
                let mut ev = cx.fabric.inbox.lock();
                let mut moved = false;
                while self.acked < self.sent {
                    let Some(st) = ev.rma_replies.remove(&(self.wpeer, self.req + self.acked)) else { break };
                    moved = true;
                    self.acked += 1;
                    if let Some(r) = st.refusal() {
                        // The rest are refused too, or landed: forget their answers.
                        for i in self.acked..self.sent {
                            ev.rma_replies.remove(&(self.wpeer, self.req + i));
                        }
                        self.refusal = Some(refused(cx, self.wpeer, r));
                        self.state = State::Done;
                        return Ok(true);
                    }
                }
                if self.acked == self.sent {
                    self.state = State::Done;
                    return Ok(true);
                }
                if ev.closed.contains(&self.wpeer) {
                    return Err(cx.closed(self.wpeer));
                }
                Ok(moved)
            }
            State::Done => Ok(false),
        }
    }
}

/// A signal to raise at a peer, or to wait for from one.
#[derive(Debug)]
pub(crate) struct SignalOp {
    wpeer: usize,
    value: u64,
    /// Raise (send and wait for the answer) or wait.
    raise: bool,
    req: u64,
    state: State,
}

impl SignalOp {
    pub(crate) fn raise(wpeer: usize, value: u64) -> SignalOp {
        SignalOp { wpeer, value, raise: true, req: 0, state: State::Start }
    }

    pub(crate) fn wait(wpeer: usize, value: u64) -> SignalOp {
        SignalOp { wpeer, value, raise: false, req: 0, state: State::Start }
    }

    pub(crate) fn is_done(&self) -> bool {
        self.state == State::Done
    }

    pub(crate) fn waiting_for(&self) -> Option<usize> {
        (self.state == State::Wait).then_some(self.wpeer)
    }

    pub(crate) fn advance(&mut self, cx: &XferCtx<'_>) -> Result<bool> {
        match self.state {
            State::Start if self.raise && self.wpeer == cx.fabric.rank => {
                let mut ev = cx.fabric.inbox.lock();
                let s = ev.signals.entry(self.wpeer).or_insert(0);
                *s = (*s).max(self.value);
                self.state = State::Done;
                Ok(true)
            }
            State::Start if self.raise => {
                self.req = cx.fabric.next_reqs(1);
                cx.fabric.endpoint(self.wpeer)?.post_send(&proto::encode_signal(self.req, self.value), cx.deadline, &|| cx.pump())?;
                self.state = State::Wait;
                Ok(true)
            }
            State::Start => {
                self.state = State::Wait;
                self.advance(cx).map(|_| true)
            }
            State::Wait => {
                let mut ev = cx.fabric.inbox.lock();
                if self.raise {
                    if let Some(st) = ev.rma_replies.remove(&(self.wpeer, self.req)) {
                        self.state = State::Done;
                        return match st.refusal() {
                            None => Ok(true),
                            Some(r) => Err(refused(cx, self.wpeer, r)),
                        };
                    }
                } else if ev.signals.get(&self.wpeer).is_some_and(|&v| v >= self.value) {
                    self.state = State::Done;
                    return Ok(true);
                }
                if self.wpeer != cx.fabric.rank && ev.closed.contains(&self.wpeer) {
                    return Err(cx.closed(self.wpeer));
                }
                Ok(false)
            }
            State::Done => Ok(false),
        }
    }
}

/// The owner's side: answers the one-sided requests for this rank's windows.
#[derive(Debug)]
pub(crate) struct RmaServer {
    /// What the server's waits are named in errors (made once: serving allocates nothing).
    op: Op,
    /// Reads whose data the requester pulls (shm single-copy): kept until the pull ends.
    pulls: Mutex<Vec<PendingWrite>>,
    /// The requests being served (kept between rounds for its capacity).
    queue: Mutex<VecDeque<(usize, RmaRequest)>>,
}

impl Default for RmaServer {
    fn default() -> RmaServer {
        RmaServer { op: Op::other("serving a one-sided access to a window"), pulls: Mutex::default(), queue: Mutex::default() }
    }
}

impl RmaServer {
    /// Serves every request that has arrived; returns whether there was any. A request
    /// that fails on this side (the requester died, the window's memory went away between
    /// the check and the copy) is refused, or left to the fabric's failure handling when
    /// the connection itself broke.
    pub(crate) fn serve(&self, fabric: &Fabric) -> bool {
        {
            let mut pulls = self.pulls.lock().unwrap_or_else(|e| e.into_inner());
            pulls.retain(|p| p.status().is_none());
        }
        let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        fabric.inbox.take_rma_requests(&mut queue);
        if queue.is_empty() {
            return false;
        }
        let deadline = Instant::now() + fabric.params.timeout;
        let pump = || fabric.pump(&self.op);
        while let Some((peer, req)) = queue.pop_front() {
            let Ok(ep) = fabric.endpoint(peer) else { continue };
            match req {
                RmaRequest::Get { target, buf, imm } => {
                    let status = match check(fabric, &target, false) {
                        Err(st) => st,
                        Ok(e) => {
                            let w = WriteReq {
                                src: &e.region,
                                offset: target.offset as usize,
                                len: target.len as usize,
                                dst: buf,
                                dst_offset: 0,
                                imm,
                            };
                            match ep.post_write(&w, deadline, &pump) {
                                Ok(WriteTicket::Done) => continue,
                                Ok(WriteTicket::Pending(p)) => {
                                    self.pulls.lock().unwrap_or_else(|e| e.into_inner()).push(p);
                                    continue;
                                }
                                Err(_) => RmaStatus::Failed,
                            }
                        }
                    };
                    let _ = ep.post_send(&proto::encode_reply(target.req, status), deadline, &pump);
                }
                RmaRequest::Put { target, data } => {
                    let status = match check(fabric, &target, true) {
                        Err(st) => st,
                        Ok(e) => match e.region.write_at(target.offset as usize, &data) {
                            Ok(()) => RmaStatus::Done,
                            Err(_) => RmaStatus::Failed,
                        },
                    };
                    fabric.inbox.give_buf(data);
                    let _ = ep.post_send(&proto::encode_reply(target.req, status), deadline, &pump);
                }
                RmaRequest::Signal { req, value } => {
                    {
                        let mut ev = fabric.inbox.lock();
                        let s = ev.signals.entry(peer).or_insert(0);
                        *s = (*s).max(value);
                    }
                    // A thread of this rank may be waiting for it.
                    fabric.inbox.notify();
                    let _ = ep.post_send(&proto::encode_reply(req, RmaStatus::Done), deadline, &pump);
                }
            }
        }
        true
    }
}

/// The live window a request names, if the request may have it: same job, a live window
/// with this id and key, the range inside it, and write access for writes.
fn check(fabric: &Fabric, t: &RmaTarget, write: bool) -> std::result::Result<crate::registry::WindowEntry, RmaStatus> {
    if t.job != fabric.job {
        return Err(RmaStatus::OtherJob);
    }
    let Some(e) = fabric.windows.get(t.window, t.key) else { return Err(RmaStatus::NoWindow) };
    if !e.region.is_valid() {
        return Err(RmaStatus::NoWindow);
    }
    if t.offset.checked_add(t.len).is_none_or(|end| end > e.region.len() as u64) {
        return Err(RmaStatus::OutOfRange);
    }
    if write && !e.writable {
        return Err(RmaStatus::ReadOnly);
    }
    Ok(e)
}
