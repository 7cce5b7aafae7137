//! RDMA verbs transport: one reliable-connected queue pair per peer (the QP mesh), data
//! and notification in one RDMA WRITE WITH IMMEDIATE.
//!
//! # Wire
//!
//! Every work request that the peer must notice is an RDMA WRITE WITH IMMEDIATE; the
//! receiver keeps zero-length receives posted (one is consumed per immediate) and learns
//! what arrived from the 32-bit immediate:
//!
//! | immediate | meaning |
//! | --- | --- |
//! | `0xxx...` (top bit clear) | a one-sided write ([`VerbsEndpoint::post_write`]) has landed; the value is the caller's immediate (31 bits: the fabric's immediates are) |
//! | `100` + 29-bit length | a two-sided message of that length landed in the next eager slot |
//! | `101` + 29-bit count | the peer consumed that many more of our messages (credits back) |
//! | `110` | the peer closes cleanly (goodbye) |
//! | `111` | keepalive: nothing to do (its failure is what counts) |
//!
//! # Setup
//!
//! Which peers verbs will carry is known only once every rank's descriptor is in, and the
//! queue pairs' data must be in the descriptors: so [`VerbsSetup::open`] makes a queue pair
//! and an eager receive ring for every other rank before the descriptor is published, and
//! its `info` (QPN, PSN, LID, GID, ring address and rkey per peer, the port MTU) is verbs'
//! part of it. [`VerbsSetup::connect_peers`] connects the queue pairs of the peers mesh setup
//! chose for verbs (RTR with the smaller of the two MTUs, then RTS; the others are dropped)
//! and then waits in one store round, `verbs-ready`, until each of them has connected too:
//! a queue pair not yet ready to receive silently drops what arrives, and the sender would
//! learn of it only through its retries (seconds at the default ACK timeout), or not at all
//! once they run out. A rank that fails before publishing puts the reason in its descriptor
//! (under `FERROCCL_TRANSPORT=verbs`), one that fails while connecting in place of its ready
//! mark: either way its peers fail at once, naming it and the reason.
//!
//! # Memory
//!
//! * **Eager slots.** Each side of each connection has [`SLOTS`] receive slots of
//!   [`SLOT_BYTES`] in one registered region, advertised to the peer at setup; the
//!   sender copies a message into its own registered send slot and writes it into the
//!   peer's slot of the same index (slots are used in order, so the index is implicit).
//!   **Credits:** a sender posts message `k` only when message `k - SLOTS` has completed
//!   locally (its send slot is free) and the receiver has handed the slot back; the
//!   receiver copies each message out as soon as it polls it and returns credits in
//!   batches of `SLOTS / 2`. A sender can never overrun the receiver's slots.
//! * **Rendezvous targets (zero copy).** The receiver registers exactly the range it
//!   advertises in its clear-to-send ([`register_user`]): the memory region holds a
//!   [`RegionLease`](ferroccl_mem::RegionLease) on the caller's region, which keeps the
//!   region's scope (`with_region`) from ending while the device may write the bytes.
//!   The receive operation drops the memory region (deregistering it, then releasing the
//!   lease) as soon as the write's immediate is seen, or when it is dropped on an error
//!   path, always inside the scope. The lease takes no byte-range lock (local steps view
//!   whole buffers); the schedule leaves a receive's bytes alone until it has completed.
//! * **Write sources: windows zero copy, the rest one copy.** A one-sided window is
//!   registered once, when it is made ([`register_window`]: one memory region over the
//!   whole window, local read only, holding a read [`RegionLease`](ferroccl_mem::RegionLease)
//!   so the window's scope cannot end under it); a read of it (`WriteReq::src_mr`) is
//!   written by the device straight from the window's memory, in pieces of at most
//!   [`DIRECT_BYTES`], no copy on either side. Every such work request holds a clone of
//!   the memory region in a slot that its completion frees when it is polled, so the
//!   region is not deregistered (and the lease not released) under a work request in
//!   flight; dropping the window waits for them ([`wait_unused`]). Every other source (a
//!   rendezvous send's) is copied through registered staging slots ([`STAGE_SLOTS`] x
//!   [`STAGE_BYTES`] per process) and written from there, so `post_write` returns with the
//!   source free to reuse and the call's scope never waits for a send completion: one
//!   memcpy on the sending side, and no `ibv_reg_mr` per transfer. [`VerbsNet::write_bytes`]
//!   counts the bytes of both paths.
//! * **Reads of peers' windows (RDMA READ).** Windows are registered with `REMOTE_READ` and
//!   the queue pairs allow remote reads. A reader given a window's region (address, rkey,
//!   length: a [`RemoteRegion`]) posts RDMA READs into its registered destination
//!   ([`VerbsEndpoint::post_read`]); each holds a clone of the destination's memory region
//!   and of the [`RemoteRegion`] in a slot that its completion frees, and the completion of
//!   each row's last piece delivers the row's immediate to the reader's own inbox. A
//!   [`RemoteRegion`] counts its READs in flight and, once revoked, issues none, so its
//!   holder can tell its owner when no READ of its can still reach the region.
//! * **Writes of peers' windows (RDMA WRITE).** Read-write windows are registered with
//!   `REMOTE_WRITE` too ([`register_window`]), and the owner says so in the region it gives
//!   ([`RemoteRegion::writable`]). A writer posts RDMA WRITEs (no immediate) from a memory
//!   region over its source ([`register_source`]) with [`VerbsEndpoint::post_write_to`],
//!   which refuses a region that is not writable; they go through the same slots, in-flight
//!   count and revocation as READs, and the completion of each row's last piece delivers
//!   the row's immediate to the writer's own inbox (on RC: the bytes are placed).
//!
//! # Progress and failures
//!
//! One completion queue per process, polled by [`VerbsNet::poll`] from `Fabric::progress`
//! (every round of every wait); polling allocates nothing unless a message arrives
//! (delivered as a `Vec`). A failed completion (the peer's QP is gone: retry exceeded,
//! remote access error, flush) fails the peer with the verbs status named. A peer
//! process that dies on the same host is also seen by the fabric's process watch. On
//! another host nothing but traffic can tell: so every [`PING_EVERY`] the completion
//! thread posts a zero-length keepalive to each peer with nothing in flight, and a dead
//! peer's queue pair, gone with its process, makes that keepalive fail after the
//! transport's retries (7 tries of 4.096 us x 2^`FERROCCL_IB_TIMEOUT`: about 7.5 s at the
//! default 18, NCCL's default too; shorter ones fail live peers behind a stalled link) instead of
//! leaving a waiter to its deadline. A stopped (not dead) peer still ACKs (the NIC or the
//! kernel answers), so it is caught by the deadline, as with tcp.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ferroccl_mem::process::ProcessWatch;
use ferroccl_mem::region::RegionHandle;
use ferroccl_verbs::{
    Access, Completion, CompletionQueue, ConnectInfo, Context, DeviceList, MemoryRegion, Mtu, ProtectionDomain, QpOptions, QueuePair,
    ReadyToSend, RemoteSlice, WcOpcode,
};

use crate::error::{Error, Op, Result};
use crate::inbox::{Backoff, Events, Inbox};
use crate::params::{Params, TransportChoice};
use crate::transport::descriptor::{QpInfo, VerbsReady, QP_CONNECT_LEN};
use crate::transport::{
    Connected, Descriptor, Endpoint, Net, OpenCx, Opened, ReadReq, RemoteBuf, RemoteBytes, RemoteMemory, Setup, SetupCx, Transport,
    TransportKind, VerbsInfo, WriteGrant, WriteReq, WriteTicket,
};
use crate::wire::{Reader, Writer};

mod mem;
mod net;
mod setup;
mod wire;

pub(crate) use mem::*;
pub(crate) use net::*;
pub(crate) use setup::*;
pub(crate) use wire::*;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn verr(rank: usize, what: impl Into<String>) -> impl FnOnce(ferroccl_verbs::Error) -> Error {
    let what = what.into();
    move |source| Error::Verbs { rank, what, source }
}

/// The memory region of each zero-copy write in flight, by slot (the work request's id
/// names its slot): kept until the completion is polled.
#[derive(Debug, Default)]
struct DirectSlots {
    slots: Vec<Option<Arc<UserMr>>>,
    free: Vec<u32>,
}

/// An RDMA READ in flight: its target's memory region (kept registered, with its lease on
/// the reader's buffer, until the completion is polled), the peer's region it reads (whose
/// count of reads in flight the completion lowers), and the immediate the completion
/// reports to the reader's inbox (the last piece of a row only).
#[derive(Debug)]
struct ReadHold {
    _dst: Arc<UserMr>,
    region: Arc<RemoteRegion>,
    imm: Option<u32>,
}

/// The RDMA READs in flight, by slot (the work request's id names its slot).
#[derive(Debug, Default)]
struct ReadSlots {
    slots: Vec<Option<ReadHold>>,
    free: Vec<u32>,
}

/// This rank's connection to one peer over verbs.
#[derive(Debug)]
pub(crate) struct VerbsEndpoint {
    rank: usize,
    peer: usize,
    net: Arc<VerbsNet>,
}

impl VerbsEndpoint {
    fn new(net: Arc<VerbsNet>, peer: usize) -> VerbsEndpoint {
        VerbsEndpoint { rank: net.rank, peer, net }
    }

    pub(crate) fn net(&self) -> &Arc<VerbsNet> {
        &self.net
    }

    /// The peer's window region at `addr` (`len` bytes, `rkey`, writable or not), as its
    /// owner gave it.
    pub(crate) fn remote_region(&self, addr: u64, rkey: u32, len: u64, writable: bool) -> Arc<RemoteRegion> {
        Arc::new(RemoteRegion { addr, rkey, len, writable, state: Mutex::default() })
    }

    /// Whether the queue pair is cut or failed (nothing can be posted, and nothing it
    /// posted can still reach the peer's memory).
    pub(crate) fn is_dead(&self) -> bool {
        self.net.peer(self.peer).map_or(true, |pe| lock(&pe.st).dead)
    }

    /// The connection to world rank `peer` (a window's owner telling its holders).
    pub(crate) fn to(net: &Arc<VerbsNet>, peer: usize) -> VerbsEndpoint {
        VerbsEndpoint::new(net.clone(), peer)
    }

    pub(crate) fn max_send(&self) -> usize {
        SLOT_BYTES
    }

    fn dead_err(&self) -> Error {
        Error::Transport {
            rank: self.rank,
            peer: Some(self.peer),
            transport: TransportKind::Verbs,
            what: "the queue pair is cut or failed".into(),
        }
    }

    /// Sends a message through the next eager slot, waiting (polling) for a credit.
    pub(crate) fn post_send(&self, msg: &[u8], deadline: Instant, poll: &dyn Fn() -> Result<()>) -> Result<()> {
        self.post_send2(msg, &[], deadline, poll)
    }

    /// One message, `head` then `body`, copied straight into a send slot.
    pub(crate) fn post_send2(&self, head: &[u8], body: &[u8], deadline: Instant, poll: &dyn Fn() -> Result<()>) -> Result<()> {
        let pe = self.net.peer(self.peer)?;
        let start = Instant::now();
        let mut backoff = Backoff::default();
        loop {
            match self.try_send(pe, head, body)? {
                true => return Ok(()),
                false => self.net.wait_round(self.peer, "verbs send (waiting for a credit)", start, deadline, &mut backoff, poll)?,
            }
        }
    }

    /// Posts `msg` if a slot and a send-queue entry are free now.
    fn try_send(&self, pe: &Peer, head: &[u8], body: &[u8]) -> Result<bool> {
        let len = head.len() + body.len();
        if len > SLOT_BYTES {
            return Err(Error::internal(format!("verbs message of {len} bytes exceeds the {SLOT_BYTES}-byte slot")));
        }
        let mut st = lock(&pe.st);
        if st.dead {
            return Err(self.dead_err());
        }
        let free_from = st.msg_done.min(st.credits);
        if st.sent - free_from >= SLOTS as u64 || st.sq_used >= SQ_DEPTH {
            return Ok(false);
        }
        let slot = (st.sent % SLOTS as u64) as usize;
        let off = slot * SLOT_BYTES;
        pe.send_ring.write(off, head);
        pe.send_ring.write(off + head.len(), body);
        let remote = RemoteSlice { addr: pe.remote.addr + off as u64, len: len as u32, rkey: pe.remote.rkey };
        let imm = IMM_CTRL | (KIND_MSG << IMM_KIND_SHIFT) | len as u32;
        // The send slot is not written again until this work request has completed
        // (`msg_done` counts it) and the peer has handed the slot back (credits).
        pe.qp
            .post_write_from(wr_id(WR_MSG, self.peer, slot as u32), &pe.send_ring, off..off + len, remote, Some(imm), true)
            .map_err(verr(self.rank, format!("send a message to rank {}", self.peer)))?;
        st.sent += 1;
        st.sq_used += 1;
        Ok(true)
    }

    /// Sends only if a slot is free now (telling a peer why we give up).
    /// The message is the fabric's `ERR` before it cuts: [`cut`](Self::cut) waits for it to
    /// be acknowledged.
    pub(crate) fn try_post_send_now(&self, msg: &[u8]) -> Result<bool> {
        let pe = self.net.peer(self.peer)?;
        let sent = self.try_send(pe, msg, &[])?;
        if sent {
            let mut st = lock(&pe.st);
            st.flush_until = st.sent;
        }
        Ok(sent)
    }

    /// Writes `w` into the peer's registered memory, each piece an RDMA WRITE, the last one
    /// WITH IMMEDIATE (RC delivers them in order, so the immediate means every byte has
    /// landed). With a memory region over the source (`w.src_mr`, a window's), the device
    /// reads the source itself (zero copy; the region stays registered until the pieces
    /// complete); otherwise the source is copied through staging slots and may be reused
    /// when this returns.
    pub(crate) fn post_write(&self, w: &WriteReq<'_>, deadline: Instant, poll: &dyn Fn() -> Result<()>) -> Result<()> {
        if w.imm & IMM_CTRL != 0 {
            return Err(Error::internal(format!("verbs write immediate {:#x} uses the control bit", w.imm)));
        }
        let rkey =
            u32::try_from(w.dst.key).map_err(|_| Error::internal(format!("verbs write target key {:#x} is not an rkey", w.dst.key)))?;
        let pe = self.net.peer(self.peer)?;
        if let Some(mr) = w.src_mr {
            if mr.as_ptr() as u64 != w.src.addr() || mr.len() != w.src.len() {
                return Err(Error::internal(format!(
                    "verbs write source: a memory region of {} bytes at {:#x} is not that of the {}-byte region at {:#x}",
                    mr.len(),
                    mr.as_ptr() as u64,
                    w.src.len(),
                    w.src.addr()
                )));
            }
            return self.post_write_direct(pe, w, mr, rkey, deadline, poll);
        }
        let start = Instant::now();
        let mut backoff = Backoff::default();
        let mut pos = 0usize;
        loop {
            let piece = (w.len - pos).min(STAGE_BYTES);
            let last = pos + piece == w.len;
            // Room in the send queue first, so that a taken staging slot is always posted.
            loop {
                let st = lock(&pe.st);
                if st.dead {
                    return Err(self.dead_err());
                }
                if st.sq_used < SQ_DEPTH {
                    break;
                }
                drop(st);
                self.net.wait_round(self.peer, "verbs write (send queue full)", start, deadline, &mut backoff, poll)?;
            }
            let slot = self.net.take_stage(self.peer, deadline, poll)?;
            let free_slot = || *lock(&self.net.stage_free) |= 1u64 << slot;
            let off = slot as usize * STAGE_BYTES;
            let copied = w.src.with_slice(w.offset + pos, piece, |b| self.net.stage.write(off, b));
            if let Err(e) = copied {
                free_slot();
                return Err(Error::internal(format!("verbs write source: {e}")));
            }
            let remote = RemoteSlice { addr: w.dst_addr(pos), len: piece as u32, rkey };
            let mut st = lock(&pe.st);
            if st.dead {
                drop(st);
                free_slot();
                return Err(self.dead_err());
            }
            if st.sq_used >= SQ_DEPTH {
                // Another thread filled the send queue meanwhile: try this piece again.
                drop(st);
                free_slot();
                self.net.wait_round(self.peer, "verbs write (send queue full)", start, deadline, &mut backoff, poll)?;
                continue;
            }
            let id = wr_id(WR_STAGE, self.peer, slot);
            // The staging slot is not written again until this work request's completion
            // has been polled (which frees it).
            let posted = pe.qp.post_write_from(id, &self.net.stage, off..off + piece, remote, last.then_some(w.imm), true);
            if let Err(e) = posted {
                drop(st);
                free_slot();
                return Err(verr(self.rank, format!("write {piece} bytes to rank {}", self.peer))(e));
            }
            st.sq_used += 1;
            drop(st);
            self.net.staged_bytes.fetch_add(piece as u64, Ordering::Relaxed);
            pos += piece;
            if last {
                return Ok(());
            }
        }
    }

    /// [`post_write`](Self::post_write) from `mr`, the memory region over the whole source:
    /// pieces of at most [`DIRECT_BYTES`], each holding a clone of `mr` until its completion
    /// is polled.
    fn post_write_direct(
        &self,
        pe: &Peer,
        w: &WriteReq<'_>,
        mr: &Arc<UserMr>,
        rkey: u32,
        deadline: Instant,
        poll: &dyn Fn() -> Result<()>,
    ) -> Result<()> {
        let start = Instant::now();
        let mut backoff = Backoff::default();
        let mut pos = 0usize;
        loop {
            let piece = (w.len - pos).min(DIRECT_BYTES);
            let last = pos + piece == w.len;
            let mut st = lock(&pe.st);
            if st.dead {
                return Err(self.dead_err());
            }
            if st.sq_used >= SQ_DEPTH {
                drop(st);
                self.net.wait_round(self.peer, "verbs write (send queue full)", start, deadline, &mut backoff, poll)?;
                continue;
            }
            let remote = RemoteSlice { addr: w.dst_addr(pos), len: piece as u32, rkey };
            let slot = self.net.hold_direct(mr);
            let off = w.offset + pos;
            let posted =
                pe.qp.post_write_from(wr_id(WR_DIRECT, self.peer, slot), mr, off..off + piece, remote, last.then_some(w.imm), true);
            if let Err(e) = posted {
                drop(st);
                self.net.release_direct(slot);
                return Err(verr(self.rank, format!("write {piece} bytes to rank {}", self.peer))(e));
            }
            st.sq_used += 1;
            drop(st);
            self.net.direct_bytes.fetch_add(piece as u64, Ordering::Relaxed);
            pos += piece;
            if last {
                return Ok(());
            }
        }
    }

    /// Stops posting to the peer (after a fatal error).
    ///
    /// First it waits (polling, at most [`CUT_WAIT`]) until the peer has acknowledged the
    /// message [`try_post_send_now`](Self::try_post_send_now) just posted (the fabric's
    /// `ERR` with the root cause): once acknowledged, it sits in the peer's completion queue
    /// ahead of anything our giving up causes there later (a write of theirs refused because
    /// we deregistered its target puts their queue pair in the error state, and an `ERR`
    /// arriving after that would be lost), so the peer reports the root cause, not us.
    pub(crate) fn cut(&self) {
        let Ok(pe) = self.net.peer(self.peer) else { return };
        let until = Instant::now() + CUT_WAIT;
        let mut backoff = Backoff::default();
        loop {
            let seen = self.net.inbox.bell_seen();
            {
                let st = lock(&pe.st);
                if st.dead || st.msg_done >= st.flush_until || Instant::now() >= until {
                    break;
                }
            }
            let _ = self.net.poll();
            backoff.idle(WAIT_NAP, Some(until), |t| self.net.inbox.sleep(seen, t, || false));
        }
        lock(&pe.st).dead = true;
    }

    /// Says goodbye and waits (polling, until `deadline`) for our sends to the peer to
    /// complete, so that nothing is in flight when the queue pair goes.
    pub(crate) fn close(&self, deadline: Instant, poll: &dyn Fn() -> Result<()>) {
        let Ok(pe) = self.net.peer(self.peer) else { return };
        {
            let mut st = lock(&pe.st);
            if st.dead || st.sq_used >= SQ_DEPTH {
                return;
            }
            if post_ctrl(pe, IMM_CTRL | (KIND_BYE << IMM_KIND_SHIFT)).is_err() {
                return;
            }
            st.sq_used += 1;
        }
        let deadline = deadline.min(Instant::now() + Duration::from_secs(2));
        let mut backoff = Backoff::default();
        while Instant::now() < deadline {
            let seen = self.net.inbox.bell_seen();
            let _ = poll();
            let _ = self.net.poll();
            let st = lock(&pe.st);
            if st.sq_used == 0 || st.dead {
                return;
            }
            drop(st);
            backoff.idle(WAIT_NAP, Some(deadline), |t| self.net.inbox.sleep(seen, t, || false));
        }
    }
}

impl Endpoint for VerbsEndpoint {
    fn kind(&self) -> TransportKind {
        TransportKind::Verbs
    }

    fn max_send(&self) -> usize {
        VerbsEndpoint::max_send(self)
    }

    fn post_send(&self, msg: &[u8], deadline: Instant, poll: &dyn Fn() -> Result<()>) -> Result<()> {
        VerbsEndpoint::post_send(self, msg, deadline, poll)
    }

    fn post_send2(&self, head: &[u8], body: &[u8], deadline: Instant, poll: &dyn Fn() -> Result<()>) -> Result<()> {
        VerbsEndpoint::post_send2(self, head, body, deadline, poll)
    }

    /// The source is copied into staging slots while posting, or (a window with a memory
    /// region) held by the transport until the device has read it.
    fn write(&self, w: &WriteReq<'_>, deadline: Instant, poll: &dyn Fn() -> Result<()>) -> Result<WriteTicket> {
        VerbsEndpoint::post_write(self, w, deadline, poll).map(|()| WriteTicket::Done)
    }

    fn try_post_send_now(&self, msg: &[u8], _deadline: Instant) -> Result<bool> {
        VerbsEndpoint::try_post_send_now(self, msg)
    }

    fn cut(&self) {
        VerbsEndpoint::cut(self);
    }

    fn close(&self, deadline: Instant, poll: &dyn Fn() -> Result<()>) {
        VerbsEndpoint::close(self, deadline, poll);
    }

    /// A memory region over exactly that range (see [`register_user`]), held by the receive
    /// until the write lands: user memory is not cached in verbs registrations, because
    /// nothing tells the library when it is freed and remapped.
    fn register_for_write(&self, h: &RegionHandle, offset: usize, len: usize) -> Result<Option<(RemoteBuf, WriteGrant)>> {
        if len == 0 {
            return Ok(None);
        }
        let (buf, mr) = register_user(self.net(), h, offset, len)?;
        Ok(Some((buf, WriteGrant::holding(mr))))
    }

    fn remote_access(&self) -> bool {
        true
    }

    fn remote_region(&self, addr: u64, rkey: u32, len: u64, writable: bool) -> Option<Arc<RemoteRegion>> {
        Some(VerbsEndpoint::remote_region(self, addr, rkey, len, writable))
    }

    fn post_read(
        &self,
        region: &Arc<RemoteRegion>,
        dst: &Arc<UserMr>,
        r: &ReadReq,
        deadline: Instant,
        poll: &dyn Fn() -> Result<()>,
    ) -> Result<bool> {
        VerbsEndpoint::post_read(self, region, dst, r, deadline, poll)
    }

    fn register_source(&self, h: &RegionHandle, offset: usize, len: usize) -> Result<Arc<UserMr>> {
        register_source(self.net(), h, offset, len)
    }

    fn post_write_to(
        &self,
        region: &Arc<RemoteRegion>,
        src: &Arc<UserMr>,
        r: &ReadReq,
        deadline: Instant,
        poll: &dyn Fn() -> Result<()>,
    ) -> Result<bool> {
        VerbsEndpoint::post_write_to(self, region, src, r, deadline, poll)
    }
}
