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
//!   straight into the buffer from the socket; verbs: RDMA WRITE from the window's memory
//!   region, registered with the window, into the requester's: no copy), and the read
//!   completes on the immediate. One round trip.
//! * **read over verbs, without the owner** (RDMA READ): a requester that reaches the owner
//!   over verbs asks once per window for its memory region (`WINFO`: checked like any
//!   request; the owner records it as a holder) and keeps it in the fabric's
//!   [`PeerRegions`](crate::registry::PeerRegions); from then on a read of the window is
//!   checked against the length the owner gave and posted as RDMA READs into the
//!   requester's registered destination, and completes on their completions (which report
//!   each row's immediate, as the owner's writes would). Dropping the window revokes the
//!   region (`REVOKE`, answered `REVOKED` by [`RmaServer`] once the holder's READs on it
//!   are over); a revoked region's reads go to the owner, which refuses them.
//! * **write** (`PUT`): the bytes travel in messages of at most one send's size, each
//!   checked and landed by the owner, which answers each with a `REPLY`; the write
//!   completes when every piece is answered. One round trip, pipelined over the pieces.
//! * **write over verbs, without the owner** (RDMA WRITE): as a read over verbs, with the
//!   same cached region, when the owner said it is writable (`WINFO_REPLY`: a read-write
//!   window, registered with `REMOTE_WRITE`; otherwise the write is refused here,
//!   `ReadOnly`). The source is registered per write and posted as signaled RDMA WRITEs;
//!   the write completes on their completions (on RC, the owner's NIC has placed the
//!   bytes), so a `SIGNAL` queued behind it is sent after the data. Writes count as in
//!   flight on the region like READs, so a revocation waits for them.
//!
//! Requests belong to no stream: they are served in arrival order, whatever the owner is
//! doing, by whichever thread drives its engine (a waiting call, or the engine's own
//! thread, which keeps running while windows exist).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use ferroccl_mem::region::RegionHandle;

use crate::algo::{Block, Remote};
use crate::error::{Error, Op, Refusal, Result};
use crate::fabric::Fabric;
use crate::inbox::{Events, RmaRequest, View};
use crate::p2p::XferCtx;
use crate::proto::{self, GetShape, RegionInfo, RmaStatus, RmaTarget};
use crate::registry::{PeerWindow, RegionLookup, SharedWindow};
use crate::transport::{row_imm, PendingWrite, ReadReq, RemoteRegion, WriteGrant, WriteReq};

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

/// An access to world rank `owner`'s window `remote` done here, with a copy, when the window
/// is a shared segment on this host ([`crate::registry::SharedWindow`]): `Ok(None)` when it
/// is not one this rank can map (the owner serves the access then), `Ok(Some(Ok(())))` when
/// `copy` has moved the bytes, `Ok(Some(Err(refusal)))` when the window was dropped (before
/// or while copying), is read-only and this is a write, or the `span` bytes at `offset` are
/// not inside it (nothing copied). `copy` returns an error only for a local failure.
pub(crate) fn direct(
    fabric: &Fabric,
    owner: usize,
    remote: &Remote,
    offset: u64,
    span: u64,
    write: bool,
    copy: impl FnOnce(&SharedWindow) -> Result<()>,
) -> Result<Option<std::result::Result<(), Refusal>>> {
    if !remote.shared || owner == fabric.rank {
        return Ok(None);
    }
    let Some(w) = fabric.shared_window(owner, remote.window, remote.key, remote.len) else { return Ok(None) };
    let gone = || {
        fabric.forget_shared_window(owner, remote.window, remote.key);
        Ok(Some(Err(Refusal::NoWindow)))
    };
    if !w.live() {
        return gone();
    }
    if write && !w.writable() {
        return Ok(Some(Err(Refusal::ReadOnly)));
    }
    if !w.contains(offset, span) {
        return Ok(Some(Err(Refusal::OutOfRange)));
    }
    copy(&w)?;
    // Dropped while we copied: what was read may be the dropped window's last bytes, what
    // was written landed in memory nobody reads any more. Either way the access failed.
    if !w.live() {
        return gone();
    }
    Ok(Some(Ok(())))
}

/// The owner's answer to this rank's `WINFO` request `req` for window `remote` of world
/// rank `wpeer`: `None` while it has not come, `Some(Some(refusal))` when the owner refused,
/// `Some(None)` once the region (or its absence) is recorded in the fabric's `PeerRegions`.
fn region_answer(cx: &XferCtx<'_>, wpeer: usize, req: u64, remote: &Remote) -> Result<Option<Option<Refusal>>> {
    let mut ev = cx.fabric.inbox.lock();
    let Some((st, region)) = ev.win_infos.remove(&(wpeer, req)) else {
        if ev.closed.contains(&wpeer) {
            return Err(cx.closed(wpeer));
        }
        return Ok(None);
    };
    drop(ev);
    if let Some(r) = st.refusal() {
        return Ok(Some(Some(r)));
    }
    let ep = cx.fabric.endpoint(wpeer)?;
    let region = region.and_then(|i| ep.remote_region(i.addr, i.rkey, i.len, i.writable));
    cx.fabric.peer_regions.insert(wpeer, remote.window, remote.key, region);
    Ok(Some(None))
}

fn refused(cx: &XferCtx<'_>, owner: usize, reason: Refusal) -> Error {
    Error::Refused { rank: cx.rank, owner, op: cx.op.clone(), reason }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Start,
    /// A read waiting for the owner's `WINFO_REPLY` (its window's verbs memory region).
    Info,
    Wait,
    Done,
}

/// Runs `f(remote offset, local offset, bytes)` for each row of `block`, from `offset` in
/// the window and `local` in the local buffer.
pub(crate) fn for_rows(block: &Block, offset: u64, local: usize, mut f: impl FnMut(u64, usize, usize) -> Result<()>) -> Result<()> {
    for r in 0..u64::from(block.rows) {
        let (ro, lo) = (offset.saturating_add(r * block.remote_stride), local + (r * block.local_stride) as usize);
        f(ro, lo, block.row as usize)?;
    }
    Ok(())
}

/// A one-sided read in flight: `block` (rows of bytes) at byte `offset` of window `remote`
/// of world rank `wpeer` into `dst[dst_offset..]`.
#[derive(Debug)]
pub(crate) struct GetOp {
    wpeer: usize,
    remote: Remote,
    offset: u64,
    dst: RegionHandle,
    dst_offset: usize,
    /// Bytes the step's local slice spans.
    len: usize,
    block: Block,
    req: u64,
    /// The first row's immediate (row `r` lands with `imm + r`), and rows landed so far.
    imm: u32,
    landed: u32,
    grant: WriteGrant,
    state: State,
    /// The owner's refusal: the step is over, and its job fails once its other transfers
    /// are over too (so that none of them is still landing when the job returns).
    refusal: Option<Error>,
}

/// Takes the immediates of the rows of a transfer (first immediate `imm`) from `wpeer` that
/// have landed, in order, after the `landed` already counted (at most `rows`); whether any did.
fn take_landed_rows(ev: &mut Events, wpeer: usize, imm: u32, landed: &mut u32, rows: u32) -> bool {
    let start = *landed;
    while *landed < rows && ev.imms.remove(&(wpeer, row_imm(imm, *landed))) {
        *landed += 1;
    }
    *landed > start
}

impl GetOp {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        _peer: usize,
        wpeer: usize,
        remote: Remote,
        offset: u64,
        dst: RegionHandle,
        dst_offset: usize,
        len: usize,
        block: Block,
    ) -> GetOp {
        GetOp {
            wpeer,
            remote,
            offset,
            dst,
            dst_offset,
            len,
            block,
            req: 0,
            imm: 0,
            landed: 0,
            grant: WriteGrant::default(),
            state: State::Start,
            refusal: None,
        }
    }

    pub(crate) fn is_done(&self) -> bool {
        self.state == State::Done
    }

    pub(crate) fn waiting_for(&self) -> Option<usize> {
        matches!(self.state, State::Wait | State::Info).then_some(self.wpeer)
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

    /// The request: the window range the rows span.
    fn target(&self, cx: &XferCtx<'_>, req: u64) -> RmaTarget {
        let span = self.block.span(self.block.remote_stride).unwrap_or(u64::MAX);
        RmaTarget { req, job: cx.fabric.job, window: self.remote.window, key: self.remote.key, offset: self.offset, len: span }
    }

    /// Starts the read of a peer's window that is not mapped here: with RDMA READs when
    /// the owner is reached over verbs and gave its window's region (asking for it first,
    /// once per window), otherwise (or once the owner revoked the region) by a `GET`.
    fn start_remote(&mut self, cx: &XferCtx<'_>) -> Result<bool> {
        let ep = cx.fabric.endpoint(self.wpeer)?;
        let (mut registered, mut read_region) = (None, None);
        if ep.remote_access() {
            match cx.fabric.peer_regions.get(self.wpeer, self.remote.window, self.remote.key) {
                RegionLookup::Unknown => {
                    self.req = cx.fabric.next_reqs(1);
                    let t = self.target(cx, self.req);
                    ep.post_send(&proto::encode_winfo(&t), cx.deadline, &|| cx.pump())?;
                    self.state = State::Info;
                    return Ok(true);
                }
                RegionLookup::Read(region) => {
                    // The range is checked here against what the owner gave (and by the
                    // device against the rkey's bounds).
                    let span = self.block.span(self.block.remote_stride).unwrap_or(u64::MAX);
                    if self.offset.checked_add(span).is_none_or(|end| end > region.len()) {
                        return Ok(self.refuse(refused(cx, self.wpeer, Refusal::OutOfRange)));
                    }
                    let (buf, grant) = cx.fabric.register(&self.dst, self.dst_offset, self.len, self.wpeer)?;
                    if let Some(mr) = grant.mr() {
                        self.imm = cx.fabric.next_imms(self.block.rows);
                        let r = ReadReq {
                            rows: self.block.rows,
                            row: self.block.row as usize,
                            remote_offset: self.offset,
                            remote_stride: self.block.remote_stride,
                            local_offset: 0,
                            local_stride: self.block.local_stride as usize,
                            imm: self.imm,
                        };
                        if ep.post_read(&region, mr, &r, cx.deadline, &|| cx.pump())? {
                            self.grant = grant;
                            self.state = State::Wait;
                            return Ok(true);
                        }
                    }
                    // Revoked (or nothing to read): the owner serves it, and refuses it
                    // once the window is gone.
                    registered = Some((buf, grant));
                    read_region = Some(region);
                }
                RegionLookup::Owner => {}
            }
        }
        drop(read_region);
        let (buf, grant) = match registered {
            Some(x) => x,
            None => cx.fabric.register(&self.dst, self.dst_offset, self.len, self.wpeer)?,
        };
        self.grant = grant;
        self.imm = cx.fabric.next_imms(self.block.rows);
        self.req = cx.fabric.next_reqs(1);
        let target = self.target(cx, self.req);
        let shape = GetShape {
            rows: self.block.rows,
            row: self.block.row,
            src_stride: self.block.remote_stride,
            dst_stride: self.block.local_stride,
        };
        ep.post_send(&proto::encode_get(&target, &buf, self.imm, &shape), cx.deadline, &|| cx.pump())?;
        self.state = State::Wait;
        Ok(true)
    }

    pub(crate) fn advance(&mut self, cx: &XferCtx<'_>) -> Result<bool> {
        match self.state {
            State::Start => {
                if self.wpeer == cx.fabric.rank {
                    // This rank's own window: the same checks, then a copy per row.
                    let t = self.target(cx, 0);
                    let e = match check(cx.fabric, &t, false) {
                        Ok(e) => e,
                        Err(st) => return Ok(self.refuse(refused(cx, self.wpeer, st.refusal().unwrap_or(Refusal::Failed)))),
                    };
                    for_rows(&self.block, self.offset, self.dst_offset, |ro, lo, n| {
                        e.region
                            .with_slice(ro as usize, n, |s| self.dst.write_at(lo, s))
                            .and_then(|r| r)
                            .map_err(|err| Error::invalid(format!("{}: {err}", cx.op)))
                    })?;
                    self.state = State::Done;
                    return Ok(true);
                }
                let span = self.block.span(self.block.remote_stride).unwrap_or(u64::MAX);
                let (block, offset, dst_offset, dst) = (self.block, self.offset, self.dst_offset, &self.dst);
                let copied = direct(cx.fabric, self.wpeer, &self.remote, offset, span, false, |w| {
                    for_rows(&block, offset, dst_offset, |ro, lo, n| {
                        dst.with_slice_mut(lo, n, |d| w.read(ro, d)).map_err(|err| Error::invalid(format!("{}: {err}", cx.op))).map(|_| ())
                    })
                })?;
                match copied {
                    Some(Ok(())) => {
                        self.state = State::Done;
                        return Ok(true);
                    }
                    Some(Err(r)) => return Ok(self.refuse(refused(cx, self.wpeer, r))),
                    None => {}
                }
                self.start_remote(cx)
            }
            State::Info => match region_answer(cx, self.wpeer, self.req, &self.remote)? {
                None => Ok(false),
                Some(Some(r)) => Ok(self.refuse(refused(cx, self.wpeer, r))),
                Some(None) => self.start_remote(cx).map(|_| true),
            },
            State::Wait => {
                let mut ev = cx.fabric.inbox.lock();
                // Rows land in order; each with its own immediate.
                let moved = take_landed_rows(&mut ev, self.wpeer, self.imm, &mut self.landed, self.block.rows);
                if self.landed == self.block.rows {
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
                Ok(moved)
            }
            State::Done => Ok(false),
        }
    }
}

/// A one-sided write in flight: `block` (rows of bytes) of `src[src_offset..]` to byte
/// `offset` of window `remote` of world rank `wpeer`, in pieces of at most one message
/// each.
#[derive(Debug)]
pub(crate) struct PutOp {
    wpeer: usize,
    remote: Remote,
    offset: u64,
    src: RegionHandle,
    src_offset: usize,
    block: Block,
    /// The first piece's request number (piece `i` is `req + i`).
    req: u64,
    /// Pieces sent, and pieces the owner has answered.
    sent: u64,
    acked: u64,
    /// Written with RDMA WRITEs (verbs): the first row's immediate (reported to this
    /// rank's inbox by the completion of the row's last piece, see `GetOp::imm`), and
    /// rows whose completions have been polled.
    rdma: bool,
    imm: u32,
    landed: u32,
    state: State,
    /// As `GetOp::refusal` (the first piece's refusal; the write ends when every piece is
    /// answered).
    refusal: Option<Error>,
}

impl PutOp {
    /// The owner's refusal, once (see `GetOp::refusal`).
    pub(crate) fn take_refusal(&mut self) -> Option<Error> {
        self.refusal.take()
    }

    pub(crate) fn new(
        _peer: usize,
        wpeer: usize,
        remote: Remote,
        offset: u64,
        src: RegionHandle,
        src_offset: usize,
        block: Block,
    ) -> PutOp {
        PutOp {
            wpeer,
            remote,
            offset,
            src,
            src_offset,
            block,
            req: 0,
            sent: 0,
            acked: 0,
            rdma: false,
            imm: 0,
            landed: 0,
            state: State::Start,
            refusal: None,
        }
    }

    fn refuse(&mut self, e: Error) -> bool {
        self.refusal = Some(e);
        self.state = State::Done;
        true
    }

    /// Whether every byte of the write is already ordered before a later message to the
    /// owner: done, or sent as `PUT` messages (the owner serves them in arrival order).
    /// Not while it asks for the region or writes with RDMA WRITE: a `SIGNAL` behind it
    /// must then wait for its completion.
    pub(crate) fn sent_as_puts(&self) -> bool {
        self.state == State::Done || (self.state == State::Wait && !self.rdma)
    }

    /// Starts the write of a peer's window that is not mapped here: with RDMA WRITEs when
    /// the owner is reached over verbs and gave its window's region (asking for it first,
    /// once per window, as a read does), refused here when that region is read-only (the
    /// owner registered it without `REMOTE_WRITE`), otherwise (or once the owner revoked
    /// the region) by `PUT`s. A write of at most `FERROCCL_EAGER_MAX` bytes goes by `PUT`s
    /// too: registering its source for the RDMA WRITEs (a system call that pins the pages,
    /// and another to let go) costs more than copying it through messages, and a stream
    /// of small writes was dominated by it (thousands of one-byte writes took minutes
    /// under soft-RoCE).
    fn start_remote(&mut self, cx: &XferCtx<'_>) -> Result<bool> {
        let ep = cx.fabric.endpoint(self.wpeer)?;
        let mut held = None;
        let local_span = self.block.span(self.block.local_stride).unwrap_or(u64::MAX);
        let rdma = self.block.row > 0 && self.block.rows > 0 && local_span > cx.fabric.params.eager_max as u64;
        if rdma && ep.remote_access() {
            match cx.fabric.peer_regions.get(self.wpeer, self.remote.window, self.remote.key) {
                RegionLookup::Unknown => {
                    self.req = cx.fabric.next_reqs(1);
                    let t = RmaTarget {
                        req: self.req,
                        job: cx.fabric.job,
                        window: self.remote.window,
                        key: self.remote.key,
                        offset: 0,
                        len: 0,
                    };
                    ep.post_send(&proto::encode_winfo(&t), cx.deadline, &|| cx.pump())?;
                    self.state = State::Info;
                    return Ok(true);
                }
                RegionLookup::Read(region) => {
                    if !region.writable() {
                        return Ok(self.refuse(refused(cx, self.wpeer, Refusal::ReadOnly)));
                    }
                    let span = self.block.span(self.block.remote_stride).unwrap_or(u64::MAX);
                    if self.offset.checked_add(span).is_none_or(|end| end > region.len()) {
                        return Ok(self.refuse(refused(cx, self.wpeer, Refusal::OutOfRange)));
                    }
                    let local = self.block.span(self.block.local_stride).and_then(|n| usize::try_from(n).ok());
                    let local = local.ok_or_else(|| Error::invalid(format!("{}: write source span overflows", cx.op)))?;
                    // The source's memory region holds a read lease on it; each piece's
                    // work request holds a clone until its completion is polled.
                    let mr = ep.register_source(&self.src, self.src_offset, local)?;
                    let imm = cx.fabric.next_imms(self.block.rows);
                    let r = ReadReq {
                        rows: self.block.rows,
                        row: self.block.row as usize,
                        remote_offset: self.offset,
                        remote_stride: self.block.remote_stride,
                        local_offset: 0,
                        local_stride: self.block.local_stride as usize,
                        imm,
                    };
                    if ep.post_write_to(&region, &mr, &r, cx.deadline, &|| cx.pump())? {
                        (self.rdma, self.imm) = (true, imm);
                        self.state = State::Wait;
                        return Ok(true);
                    }
                    // Revoked: the owner serves it, and refuses it once the window is gone.
                    held = Some(region);
                }
                RegionLookup::Owner => {}
            }
        }
        drop(held);
        self.send_puts(cx)
    }

    /// Sends the write to the owner as `PUT`s (pieces of at most one message each).
    fn send_puts(&mut self, cx: &XferCtx<'_>) -> Result<bool> {
        let ep = cx.fabric.endpoint(self.wpeer)?;
        let piece = ep.max_send().saturating_sub(proto::PUT_HEADER).max(1);
        let per_row = (self.block.row as usize).div_ceil(piece).max(1) as u64;
        let pieces = per_row * u64::from(self.block.rows);
        self.req = cx.fabric.next_reqs(pieces);
        let (block, offset, src_offset) = (self.block, self.offset, self.src_offset);
        for_rows(&block, offset, src_offset, |ro, lo, row| {
            for k in 0..per_row as usize {
                let start = k * piece;
                let n = piece.min(row - start.min(row));
                let target = self.target(cx, self.req + self.sent, ro.saturating_add(start as u64), n as u64);
                let head = proto::put_header(&target);
                self.src
                    .with_slice(lo + start, n, |b| ep.post_send2(&head, b, cx.deadline, &|| cx.pump()))
                    .map_err(|e| Error::internal(format!("{}: write source: {e}", cx.op)))??;
                self.sent += 1;
            }
            Ok(())
        })?;
        self.state = State::Wait;
        Ok(true)
    }

    pub(crate) fn is_done(&self) -> bool {
        self.state == State::Done
    }

    pub(crate) fn waiting_for(&self) -> Option<usize> {
        matches!(self.state, State::Wait | State::Info).then_some(self.wpeer)
    }

    fn target(&self, cx: &XferCtx<'_>, req: u64, offset: u64, len: u64) -> RmaTarget {
        RmaTarget { req, job: cx.fabric.job, window: self.remote.window, key: self.remote.key, offset, len }
    }

    pub(crate) fn advance(&mut self, cx: &XferCtx<'_>) -> Result<bool> {
        match self.state {
            State::Start => {
                if self.wpeer == cx.fabric.rank {
                    // This rank's own window: the same checks, then a copy per row.
                    let span = self.block.span(self.block.remote_stride).unwrap_or(u64::MAX);
                    let e = match check(cx.fabric, &self.target(cx, 0, self.offset, span), true) {
                        Ok(e) => e,
                        Err(st) => {
                            self.refusal = Some(refused(cx, self.wpeer, st.refusal().unwrap_or(Refusal::Failed)));
                            self.state = State::Done;
                            return Ok(true);
                        }
                    };
                    for_rows(&self.block, self.offset, self.src_offset, |ro, lo, n| {
                        self.src
                            .with_slice(lo, n, |s| e.region.write_at(ro as usize, s))
                            .and_then(|r| r)
                            .map_err(|err| Error::invalid(format!("{}: {err}", cx.op)))
                    })?;
                    self.state = State::Done;
                    return Ok(true);
                }
                let span = self.block.span(self.block.remote_stride).unwrap_or(u64::MAX);
                let (block, offset, src_offset, src) = (self.block, self.offset, self.src_offset, &self.src);
                let copied = direct(cx.fabric, self.wpeer, &self.remote, offset, span, true, |w| {
                    for_rows(&block, offset, src_offset, |ro, lo, n| {
                        src.with_slice(lo, n, |b| w.write(ro, b)).map_err(|err| Error::invalid(format!("{}: {err}", cx.op))).map(|_| ())
                    })
                })?;
                match copied {
                    Some(Ok(())) => {
                        self.state = State::Done;
                        return Ok(true);
                    }
                    Some(Err(r)) => {
                        self.refusal = Some(refused(cx, self.wpeer, r));
                        self.state = State::Done;
                        return Ok(true);
                    }
                    None => {}
                }
                self.start_remote(cx)
            }
            State::Info => match region_answer(cx, self.wpeer, self.req, &self.remote)? {
                None => Ok(false),
                Some(Some(r)) => Ok(self.refuse(refused(cx, self.wpeer, r))),
                Some(None) => self.start_remote(cx).map(|_| true),
            },
            State::Wait if self.rdma => {
                let mut ev = cx.fabric.inbox.lock();
                // Each row's last piece completes (the owner's NIC acknowledged it: its
                // bytes are in the window) with the row's immediate, in order.
                let moved = take_landed_rows(&mut ev, self.wpeer, self.imm, &mut self.landed, self.block.rows);
                if self.landed == self.block.rows {
                    self.state = State::Done;
                    return Ok(true);
                }
                if ev.closed.contains(&self.wpeer) {
                    return Err(cx.closed(self.wpeer));
                }
                Ok(moved)
            }
            State::Wait => {
                let mut ev = cx.fabric.inbox.lock();
                let mut moved = false;
                while self.acked < self.sent {
                    let Some(st) = ev.rma_replies.remove(&(self.wpeer, self.req + self.acked)) else { break };
                    moved = true;
                    self.acked += 1;
                    if let (Some(r), None) = (st.refusal(), &self.refusal) {
                        self.refusal = Some(refused(cx, self.wpeer, r));
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
    /// Which of the pair's signals (0: the public one).
    slot: u32,
    value: u64,
    /// Raise (send and wait for the answer) or wait.
    raise: bool,
    req: u64,
    state: State,
}

impl SignalOp {
    pub(crate) fn raise(wpeer: usize, slot: u32, value: u64) -> SignalOp {
        SignalOp { wpeer, slot, value, raise: true, req: 0, state: State::Start }
    }

    pub(crate) fn wait(wpeer: usize, slot: u32, value: u64) -> SignalOp {
        SignalOp { wpeer, slot, value, raise: false, req: 0, state: State::Start }
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
                let s = ev.signals.entry((self.wpeer, self.slot)).or_insert(0);
                *s = (*s).max(self.value);
                self.state = State::Done;
                Ok(true)
            }
            State::Start if self.raise => {
                self.req = cx.fabric.next_reqs(1);
                cx.fabric
                    .endpoint(self.wpeer)?
                    .post_send(&proto::encode_signal(self.req, self.slot, self.value), cx.deadline, &|| cx.pump())?;
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
                } else if ev.signals.get(&(self.wpeer, self.slot)).is_some_and(|&v| v >= self.value) {
                    self.state = State::Done;
                    return Ok(true);
                }
                if self.wpeer != cx.fabric.rank && ev.closed.contains(&self.wpeer) {
                    return Err(cx.closed(self.wpeer));
                }
                Ok(false)
            }
            // Signals ask for no region.
            State::Info | State::Done => Ok(false),
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
    /// Verbs peers' window regions whose owners revoked them while this rank's READs on
    /// them were in flight: (owner, window, key, region), answered `REVOKED` once none is.
    revoking: Mutex<Vec<(PeerWindow, Arc<RemoteRegion>)>>,
}

impl Default for RmaServer {
    fn default() -> RmaServer {
        RmaServer {
            op: Op::other("serving a one-sided access to a window"),
            pulls: Mutex::default(),
            queue: Mutex::default(),
            revoking: Mutex::default(),
        }
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
        let answered = self.answer_revokes(fabric);
        let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        fabric.inbox.take_rma_requests(&mut queue);
        if queue.is_empty() {
            return answered;
        }
        let deadline = Instant::now() + fabric.params.timeout;
        let pump = || fabric.pump(&self.op, Some(View::NONE));
        while let Some((peer, req)) = queue.pop_front() {
            let Ok(ep) = fabric.endpoint(peer) else { continue };
            match req {
                RmaRequest::Get { target, buf, imm, shape } => {
                    fabric.windows.count_get_served();
                    let status = match check_get(fabric, &target, &shape) {
                        Err(st) => st,
                        Ok(e) => {
                            // Each row with its own immediate, in order on this connection (a
                            // contiguous read is one row; the transport may gather the rows).
                            let first = WriteReq {
                                src: &e.region,
                                src_mr: e.mr.as_ref(),
                                offset: target.offset as usize,
                                len: shape.row as usize,
                                dst: buf,
                                dst_offset: 0,
                                imm: row_imm(imm, 0),
                            };
                            let mut pending = |p| self.pulls.lock().unwrap_or_else(|e| e.into_inner()).push(p);
                            let posted = ep
                                .post_write_rows(&first, shape.rows, shape.src_stride, shape.dst_stride, deadline, &pump, &mut pending)
                                .is_ok();
                            if posted {
                                continue;
                            }
                            RmaStatus::Failed
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
                    fabric.windows.count_put_served();
                    let _ = ep.post_send(&proto::encode_reply(target.req, status), deadline, &pump);
                }
                RmaRequest::Info { target } => {
                    let (status, region) = match check(fabric, &RmaTarget { offset: 0, len: 0, ..target }, false) {
                        Err(st) => (st, None),
                        Ok(e) => match (&e.mr, fabric.windows.memory()) {
                            (Some(mr), Some(memory)) if ep.remote_access() => {
                                let mut h = e.holders.lock().unwrap_or_else(|e| e.into_inner());
                                if h.closed {
                                    (RmaStatus::NoWindow, None)
                                } else {
                                    if !h.peers.contains(&peer) {
                                        h.peers.push(peer);
                                    }
                                    let (addr, rkey, len) = memory.region_info(mr);
                                    let region = Some(RegionInfo { addr, rkey, len, writable: e.writable });
                                    // Sent under the lock: the `REVOKE` of a removal that
                                    // follows goes after it on this connection.
                                    let _ = ep.post_send(&proto::encode_winfo_reply(target.req, RmaStatus::Done, region), deadline, &pump);
                                    continue;
                                }
                            }
                            // No region (an empty window): its reads stay owner-served.
                            _ => (RmaStatus::Done, None),
                        },
                    };
                    let _ = ep.post_send(&proto::encode_winfo_reply(target.req, status, region), deadline, &pump);
                }
                RmaRequest::Revoke { window, key } => match fabric.peer_regions.revoke(peer, window, key) {
                    Some(region) => self.revoking.lock().unwrap_or_else(|e| e.into_inner()).push(((peer, window, key), region)),
                    // Never held (or its `WINFO_REPLY` is still to be taken: the entry
                    // the revocation left makes that answer unused).
                    None => {
                        let _ = ep.post_send(&proto::encode_revoke(window, key, true), deadline, &pump);
                    }
                },
                RmaRequest::Signal { req, slot, value } => {
                    fabric.windows.count_signal_served();
                    {
                        let mut ev = fabric.inbox.lock();
                        let s = ev.signals.entry((peer, slot)).or_insert(0);
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

impl RmaServer {
    /// Answers `REVOKED` for each revoked region with no READ of this rank in flight any
    /// more (their completions are polled by every round's progress); returns whether it
    /// answered any.
    fn answer_revokes(&self, fabric: &Fabric) -> bool {
        let mut revoking = self.revoking.lock().unwrap_or_else(|e| e.into_inner());
        if revoking.is_empty() {
            return false;
        }
        let deadline = Instant::now() + fabric.params.timeout;
        let pump = || fabric.pump(&self.op, Some(View::NONE));
        let before = revoking.len();
        revoking.retain(|((owner, window, key), region)| {
            if region.in_flight() {
                return true;
            }
            // Counted as given back first: whoever sees the answer sees the count fall.
            fabric.peer_regions.released();
            if let Ok(ep) = fabric.endpoint(*owner) {
                let _ = ep.post_send(&proto::encode_revoke(*window, *key, true), deadline, &pump);
            }
            false
        });
        revoking.len() != before
    }
}

/// [`check`] for a read of `shape`'s rows: the rows must fit the range the request names,
/// and the requester's buffer the rows' span.
fn check_get(fabric: &Fabric, t: &RmaTarget, shape: &GetShape) -> std::result::Result<crate::registry::WindowEntry, RmaStatus> {
    let block = Block { rows: shape.rows, row: shape.row, remote_stride: shape.src_stride, local_stride: shape.dst_stride };
    // Rows of no bytes are never asked for (a plan drops empty entries): refusing them
    // keeps a request from making the owner loop over billions of empty writes.
    if shape.rows == 0 || shape.row == 0 || block.span(shape.src_stride) != Some(t.len) || block.span(shape.dst_stride).is_none() {
        return Err(RmaStatus::OutOfRange);
    }
    check(fabric, t, false)
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
