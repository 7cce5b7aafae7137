//! The transport contract, shaped by RDMA verbs, and its implementations.
//!
//! An [`Endpoint`] connects this rank to one peer (the set of them is the "QP mesh"). It
//! offers the three verbs-shaped operations every layer above is written against:
//!
//! * **two-sided send**: [`Endpoint::post_send`] delivers a small message (at most
//!   [`Endpoint::max_send`] bytes) to the peer's receive queue, in order;
//! * **one-sided write with immediate**: [`Endpoint::post_write`] copies bytes from a
//!   registered local region into a region the peer registered and advertised as a
//!   [`RemoteBuf`]; the peer sees a `WriteImm` completion carrying the 32-bit immediate;
//! * **completions**: local completions (`WriteDone`) and remote events (messages,
//!   immediates, peer failures) land in the inbox (`crate::inbox`) below every transport,
//!   which the waiting thread polls.
//!
//! Setup is part of the contract too: see [`setup`] (open, can connect, connect), which mesh
//! setup drives for every transport of [`setup::TRANSPORTS`] alike.
//!
//! Memory registration and one-sided access without the owner (RDMA READ and WRITE) are
//! endpoint methods too ([`Endpoint::register_for_write`], [`Endpoint::remote_access`],
//! [`Endpoint::post_read`], [`Endpoint::post_write_to`]), whose defaults say "not
//! supported: the owner serves it"; a transport whose peers reach registered memory on
//! their own also gives its [`Net`] a [`RemoteMemory`] (window registration). So nothing
//! above this module asks which transport carries a peer.
//!
//! Each transport is a folder with the same files for the same jobs: `mod.rs` (the
//! endpoint), `setup.rs` (open, can connect, connect), `net.rs` (what it keeps for all its
//! peers, polled by progress), `wire.rs` (what goes on its wire), `tests.rs`; and where the
//! job exists, `mem.rs` (registration and remote reads and writes: verbs), `recv.rs` (tcp's
//! readers) and `off.rs` (verbs without the `verbs` feature).
//!
//! A local completion means the local buffer may be reused; that the data has landed at the
//! target is signalled only by the target's `WriteImm` (the weakest guarantee of the three
//! implementations, and all the protocol layer relies on).
//!
//! Implementations: [`shm`] (same host: rings in shared memory for messages and small
//! writes, single-copy `process_vm_readv` pulls for large ones), [`tcp`] (one socket per
//! peer, a reader thread landing writes straight into registered memory) and [`verbs`]
//! (one RC queue pair per peer, RDMA WRITE WITH IMMEDIATE into registered memory; only
//! with the `verbs` cargo feature, otherwise its types are uninhabited).

pub(crate) mod descriptor;
pub(crate) mod setup;
pub(crate) mod shm;
pub(crate) mod tcp;
#[cfg(feature = "verbs")]
pub(crate) mod verbs;
#[cfg(not(feature = "verbs"))]
#[path = "verbs/off.rs"]
pub(crate) mod verbs;

use std::sync::Arc;
use std::time::Instant;

use ferroccl_mem::region::RegionHandle;

use crate::error::{Error, Result};
use crate::inbox::{Events, Inbox};
pub(crate) use crate::transport_kind::TransportKind;
pub(crate) use crate::wire::RemoteBuf;
pub(crate) use descriptor::{Descriptor, ShmInfo, TcpInfo, VerbsInfo};
pub(crate) use setup::{Connected, Handshake, OpenCx, Opened, Setup, SetupCx, SetupExchange, Transport, TRANSPORTS};
pub(crate) use tcp::{DriveGuard, Paused};
/// A peer's window as its owner registered it with the device (address, key, length),
/// which this rank reads and writes without the owner ([`Endpoint::post_read`]).
pub(crate) use verbs::RemoteRegion;
/// Memory registered with an RDMA device (a window's, a write source's, a receive
/// target's): what the device reads from or writes into.
pub(crate) use verbs::UserMr as MemRegion;

/// One peer's connection, whichever transport carries it: the verbs-shaped operations
/// every layer above is written against. The methods with defaults are what a transport
/// without the feature leaves as it is: no shared memory, no waking, nothing to cut, and
/// no remote memory access (the window's owner serves every one-sided access then).
pub(crate) trait Endpoint: std::fmt::Debug + Send + Sync {
    /// Which transport carries it.
    fn kind(&self) -> TransportKind;

    /// The peer's process id, when it is on this host and shares memory with this process
    /// (shm: so that it can map memory this process allocates).
    fn shm_pid(&self) -> Option<i32> {
        None
    }

    /// Wakes the peer if it sleeps on its doorbell (shm: a peer that published something
    /// in shared memory itself, outside the rings; the other transports' messages wake
    /// their receivers already).
    ///
    /// The caller has just made a sequentially consistent write (a swap) of what it
    /// published, which orders it before the look at the peer's sleep flag as the fence of
    /// the doorbell protocol would.
    fn wake_if_sleeping_after_fence(&self) {}

    /// Largest message [`Endpoint::post_send`] takes.
    fn max_send(&self) -> usize;

    /// Sends a two-sided message. `poll` is called while waiting for room, so that two
    /// ranks sending to each other keep draining their own inboxes.
    fn post_send(&self, msg: &[u8], deadline: Instant, poll: &dyn Fn() -> Result<()>) -> Result<()>;

    /// Sends a two-sided message made of `head` followed by `body` (no copy into an
    /// intermediate buffer: the eager path of every transfer).
    fn post_send2(&self, head: &[u8], body: &[u8], deadline: Instant, poll: &dyn Fn() -> Result<()>) -> Result<()>;

    /// [`post_write`](<dyn Endpoint>::post_write) once `w` is checked.
    fn write(&self, w: &WriteReq<'_>, deadline: Instant, poll: &dyn Fn() -> Result<()>) -> Result<WriteTicket>;

    /// Writes `rows` rows: `first`, then each `src_stride` further in the source and
    /// `dst_stride` further at the peer, row `r` with immediate `row_imm(first.imm, r)`, in
    /// order; hands each write the target completes later to `pending`. By default one
    /// write per row (tcp sends them all in one frame).
    #[allow(clippy::too_many_arguments)]
    fn post_write_rows(
        &self,
        first: &WriteReq<'_>,
        rows: u32,
        src_stride: u64,
        dst_stride: u64,
        deadline: Instant,
        poll: &dyn Fn() -> Result<()>,
        pending: &mut dyn FnMut(PendingWrite),
    ) -> Result<()> {
        post_rows_each(self, first, rows, src_stride, dst_stride, deadline, poll, pending)
    }

    /// Sends a message only if that needs no waiting: `Ok(false)` when it would have to
    /// wait (a full ring, a full socket or one busy with another frame; nothing was sent and
    /// the connection stays usable); used to tell peers why this rank gives up, and for
    /// probes.
    fn try_post_send_now(&self, msg: &[u8], deadline: Instant) -> Result<bool>;

    /// Breaks the connection off after a fatal error, so that nothing stays blocked on it.
    fn cut(&self) {}

    /// Says goodbye: the peer will treat our exit as clean.
    fn close(&self, deadline: Instant, poll: &dyn Fn() -> Result<()>);

    /// Registers `[offset, offset + len)` of `h` for a one-sided write by this peer, when
    /// the transport must (verbs: a memory region over exactly that range, held by the
    /// returned grant). `None`: a key of the registration cache serves (this process lands
    /// the peer's writes itself).
    fn register_for_write(&self, h: &RegionHandle, offset: usize, len: usize) -> Result<Option<(RemoteBuf, WriteGrant)>> {
        let _ = (h, offset, len);
        Ok(None)
    }

    /// Whether this rank reads and writes the peer's windows without the peer (RDMA READ
    /// and WRITE): then it asks the owner once per window for its region (`WINFO`).
    fn remote_access(&self) -> bool {
        false
    }

    /// The peer's window region its owner gave (address, rkey, length, writable), if this
    /// transport can use it.
    fn remote_region(&self, addr: u64, rkey: u32, len: u64, writable: bool) -> Option<Arc<RemoteRegion>> {
        let _ = (addr, rkey, len, writable);
        None
    }

    /// Reads `r`'s rows of the peer's window `region` into `dst` (memory this transport
    /// registered, [`WriteGrant::mr`]) without the peer; the last piece of each row reports
    /// the row's immediate to this rank's inbox. `Ok(false)`, having posted nothing: the
    /// owner serves it (no remote access, or the region was revoked).
    fn post_read(
        &self,
        region: &Arc<RemoteRegion>,
        dst: &Arc<MemRegion>,
        r: &ReadReq,
        deadline: Instant,
        poll: &dyn Fn() -> Result<()>,
    ) -> Result<bool> {
        let _ = (region, dst, r, deadline, poll);
        Ok(false)
    }

    /// Registers `[offset, offset + len)` of `h` as the source of [`Endpoint::post_write_to`].
    fn register_source(&self, h: &RegionHandle, offset: usize, len: usize) -> Result<Arc<MemRegion>> {
        let _ = (h, offset, len);
        Err(Error::internal(format!("the {} transport has no remote memory access", self.kind())))
    }

    /// Writes `r`'s rows from `src` into the peer's (writable) window `region` without the
    /// peer, as [`Endpoint::post_read`] reads. `Ok(false)`, having posted nothing: the
    /// owner serves it.
    fn post_write_to(
        &self,
        region: &Arc<RemoteRegion>,
        src: &Arc<MemRegion>,
        r: &ReadReq,
        deadline: Instant,
        poll: &dyn Fn() -> Result<()>,
    ) -> Result<bool> {
        let _ = (region, src, r, deadline, poll);
        Ok(false)
    }
}

/// [`Endpoint::post_write_rows`] as one write per row.
#[allow(clippy::too_many_arguments)]
pub(crate) fn post_rows_each<E: Endpoint + ?Sized>(
    ep: &E,
    first: &WriteReq<'_>,
    rows: u32,
    src_stride: u64,
    dst_stride: u64,
    deadline: Instant,
    poll: &dyn Fn() -> Result<()>,
    pending: &mut dyn FnMut(PendingWrite),
) -> Result<()> {
    for r in 0..rows {
        let w = WriteReq {
            offset: (first.offset as u64 + u64::from(r) * src_stride) as usize,
            dst_offset: first.dst_offset + u64::from(r) * dst_stride,
            imm: row_imm(first.imm, r),
            ..*first
        };
        w.check()?;
        if let WriteTicket::Pending(p) = ep.write(&w, deadline, poll)? {
            pending(p);
        }
    }
    Ok(())
}

impl dyn Endpoint + '_ {
    /// Writes `len` bytes from `src[offset..]` into `dst` at the peer, with immediate `imm`.
    /// Returns the work-request id whose `WriteDone` completion says `src` may be reused
    /// (already completed for the synchronous cases).
    pub(crate) fn post_write(&self, w: &WriteReq<'_>, deadline: Instant, poll: &dyn Fn() -> Result<()>) -> Result<WriteTicket> {
        w.check()?;
        self.write(w, deadline, poll)
    }
}

/// What a transport keeps for all its peers, made by its [`Setup::connect`]: what the
/// fabric's progress polls every round, and the transport's part in setup, failure and
/// shutdown. The defaults are a transport with nothing of the kind to do.
pub(crate) trait Net: std::fmt::Debug + Send + Sync {
    /// Lands what arrived (drains rings, polls completions, reads sockets in a thread that
    /// drives), handing it to `inbox`. Called on every round of every wait: no allocation
    /// unless something arrives. An error is fatal for the fabric (recorded in `inbox`).
    fn progress(&self, inbox: &Inbox) -> Result<()>;

    /// Says hello to the peers that must answer before setup ends ([`Net::ungreeted`]).
    fn greet(&self, deadline: Instant, poll: &dyn Fn() -> Result<()>) -> Result<()> {
        let _ = (deadline, poll);
        Ok(())
    }

    /// The peers whose hello has not arrived yet.
    fn ungreeted(&self) -> Vec<usize> {
        Vec::new()
    }

    /// The peers on this host that share memory with this process (those greeted at setup).
    fn local_peers(&self) -> Vec<usize> {
        Vec::new()
    }

    /// Every peer has answered the hello: closes what peers opened this rank's side
    /// through (shm's segment descriptor; the mapping stays).
    fn withdraw(&self) {}

    /// Whether something waits to be landed (looked at before sleeping on the doorbell).
    fn has_pending(&self) -> bool {
        false
    }

    /// Leaves `msg` (an `ERR`) where the peers read it even if this process dies and its
    /// rings are full (shm); looked at by [`Net::last_words`].
    fn leave_last_words(&self, msg: &[u8]) {
        let _ = msg;
    }

    /// The first peer that `which` picks and that left last words, and the words.
    fn last_words(&self, which: &dyn Fn(usize) -> bool) -> Option<(usize, Vec<u8>)> {
        let _ = which;
        None
    }

    /// While the guard lives, this thread (the engine's driver) lands what arrives itself
    /// in [`Net::progress`] (tcp: reads the sockets, no hand-off from a reader thread).
    fn drive(&self) -> Option<DriveGuard> {
        None
    }

    /// While the guard lives, this thread (about to sleep) lands nothing: the transport's
    /// own threads do.
    fn pause(&self) -> Option<Paused<'_>> {
        None
    }

    /// Registration with the device, when the peers reach this rank's memory on their own.
    fn remote_memory(&self) -> Option<Arc<dyn RemoteMemory>> {
        None
    }
}

/// A transport whose peers reach registered memory without its owner (RDMA): windows are
/// registered with it once, when they are made, and revoked from the peers given them.
pub(crate) trait RemoteMemory: std::fmt::Debug + Send + Sync {
    /// Registers a window (all of `h`) for the peers' reads, and writes when `writable`.
    fn register_window(&self, h: &RegionHandle, writable: bool) -> Result<MemRegion>;

    /// Sends `msg` (a revocation) to each of `holders` and waits, polling completions, until
    /// `answered` says each has answered, its connection is gone, or `deadline` passes.
    /// Returns how many never answered.
    fn revoke(self: Arc<Self>, msg: &[u8], holders: &[usize], answered: &dyn Fn(&mut Events, usize) -> bool, deadline: Instant) -> usize;

    /// Waits (polling completions) until no work request posted from `mr` is in flight, or
    /// `deadline`; whether none is.
    fn wait_unused(&self, mr: &Arc<MemRegion>, deadline: Instant) -> bool;

    /// Address, rkey and length of a window's region, as its owner gives them to a peer.
    fn region_info(&self, mr: &MemRegion) -> (u64, u32, u64);

    /// Bytes moved since `init`.
    fn bytes(&self) -> RemoteBytes;
}

/// Bytes a [`RemoteMemory`] transport moved since `init` (see `RegStats`).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RemoteBytes {
    /// One-sided writes copied through staging slots.
    pub(crate) staged: u64,
    /// One-sided writes sent straight from windows' regions.
    pub(crate) zero_copy: u64,
    /// Written into peers' windows without their owners.
    pub(crate) window_writes: u64,
    /// Read from peers' windows without their owners.
    pub(crate) reads: u64,
}

/// What a receiver holds while a peer may write into its advertised range: nothing for
/// shm and tcp (their writes are landed by this process, through the region's checks); for
/// verbs, the memory region over that range, whose drop deregisters it and releases the
/// range. It must be dropped inside the region's scope (it is: receive operations live
/// inside `with_region`, and a leaked one makes the scope wait, never unsound).
#[derive(Debug, Default)]
pub(crate) struct WriteGrant {
    mr: Option<Arc<MemRegion>>,
}

impl WriteGrant {
    /// Holds `mr` (the registration of the advertised range).
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) fn holding(mr: MemRegion) -> WriteGrant {
        WriteGrant { mr: Some(Arc::new(mr)) }
    }

    /// The memory region over the range, if the transport registered one (an RDMA READ's
    /// target: a READ in flight keeps a clone until its completion).
    pub(crate) fn mr(&self) -> Option<&Arc<MemRegion>> {
        self.mr.as_ref()
    }
}

/// An RDMA READ of a peer's window (see [`Endpoint::post_read`]): `rows` rows of
/// `row` bytes, from `remote_offset` in the window (`remote_stride` apart) into the target
/// memory region at `local_offset` (`local_stride` apart); row `r` reports the immediate
/// `(imm + r) mod 2^31` (as the owner's writes of a `GET`'s rows do).
#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(feature = "verbs"), allow(dead_code))]
pub(crate) struct ReadReq {
    pub(crate) rows: u32,
    pub(crate) row: usize,
    pub(crate) remote_offset: u64,
    pub(crate) remote_stride: u64,
    pub(crate) local_offset: usize,
    pub(crate) local_stride: usize,
    pub(crate) imm: u32,
}

/// A one-sided write: `len` bytes from `src[offset..]` to `dst` at `dst_offset`, with the
/// immediate `imm` reported to the target when the bytes have landed.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WriteReq<'a> {
    pub(crate) src: &'a RegionHandle,
    /// A verbs memory region over the whole of `src` (a window's, made once with it), if
    /// there is one: verbs then writes straight from it (zero copy) and keeps a clone of it
    /// until the write's completion; the other transports ignore it.
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) src_mr: Option<&'a Arc<MemRegion>>,
    pub(crate) offset: usize,
    pub(crate) len: usize,
    pub(crate) dst: RemoteBuf,
    pub(crate) dst_offset: u64,
    pub(crate) imm: u32,
}

impl WriteReq<'_> {
    /// Both ends in bounds, and the remote address arithmetic cannot overflow.
    fn check(&self) -> Result<()> {
        if self.offset.checked_add(self.len).is_none_or(|e| e > self.src.len()) {
            return Err(crate::error::Error::internal(format!(
                "write source [{}, +{}) overruns the local region of {} bytes",
                self.offset,
                self.len,
                self.src.len()
            )));
        }
        if self.dst_offset.checked_add(self.len as u64).is_none_or(|e| e > self.dst.len)
            || self.dst.addr.checked_add(self.dst.len).is_none()
        {
            return Err(crate::error::Error::internal(format!(
                "write of {} bytes at offset {} overruns the peer's region of {} bytes",
                self.len, self.dst_offset, self.dst.len
            )));
        }
        Ok(())
    }

    /// The target address of byte `pos` of the write.
    pub(crate) fn dst_addr(&self, pos: usize) -> u64 {
        self.dst.addr + self.dst_offset + pos as u64
    }
}

pub(crate) use crate::inbox::row_imm;

/// How a posted write completes.
#[derive(Debug)]
pub(crate) enum WriteTicket {
    /// The source was copied during the post; it may be reused now.
    Done,
    /// The target pulls the data; the source must stay registered until the ticket reports
    /// completion. Dropping the ticket revokes the target's access.
    Pending(PendingWrite),
}

/// A write that the target completes by copying from our memory (shm's single copy, a
/// pull slot lent to the peer): see [`WriteTicket::Pending`]. What it holds stays behind
/// the transport.
#[derive(Debug)]
pub(crate) struct PendingWrite(shm::PullTicket);

impl PendingWrite {
    /// `None` while the target copies; then whether it could.
    pub(crate) fn status(&self) -> Option<std::result::Result<(), ()>> {
        self.0.status()
    }

    /// The transport that carries it.
    pub(crate) fn transport(&self) -> TransportKind {
        TransportKind::Shm
    }
}
