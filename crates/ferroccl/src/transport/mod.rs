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
//! Setup is part of the contract too (NCCL's `canConnect` / `connect`, gloo's device and
//! pair). Each transport has the same three steps, which mesh setup (`crate::mesh`) drives:
//!
//! 1. **Open** (`ShmSetup::create`, `TcpSetup::listen`, `VerbsSetup::open`): this rank's
//!    side, made before anything is published: the inbox segment, the listener, the
//!    device with a queue pair and eager ring per other rank. Its `info` is the
//!    transport's part of this rank's [`Descriptor`]; all descriptors are exchanged in one
//!    all-gather.
//! 2. **Can connect** ([`can_connect`]): whether the transport reaches a peer, decided from
//!    this rank's descriptor and the peer's alone, so both ends decide alike. Mesh setup
//!    asks the transports in its order of preference (restricted by `FERROCCL_TRANSPORT`)
//!    and takes the first that can; the reason a transport cannot is the error when none is
//!    left.
//! 3. **Connect** (`connect` of each setup, given the peers chosen for it and a
//!    [`SetupCx`]): the endpoints to those peers ([`Connected`]), and whatever the
//!    transport keeps for all of them (shm's `ShmNet`, verbs' `VerbsNet`).
//!
//! What a transport needs from above while it connects comes through [`SetupCx`]: the
//! descriptors, the inbox to deliver into, a [`Handshake`] for new connections (the job's
//! token belongs to the bootstrap) and a [`SetupExchange`] for a round after the
//! descriptors (verbs' ready mark); no transport touches the store or the token.
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
pub(crate) mod shm;
pub(crate) mod tcp;
#[cfg(feature = "verbs")]
pub(crate) mod verbs;
#[cfg(not(feature = "verbs"))]
#[path = "verbs_off.rs"]
pub(crate) mod verbs;

use std::net::TcpStream;
use std::sync::Arc;
use std::time::Instant;

use ferroccl_mem::process::ProcessWatch;
use ferroccl_mem::region::RegionHandle;

use crate::error::Result;
use crate::inbox::Inbox;
pub(crate) use crate::transport_kind::TransportKind;
pub(crate) use crate::wire::RemoteBuf;
pub(crate) use descriptor::{Descriptor, ShmInfo, TcpInfo, VerbsInfo};

/// Whether transport `kind` can reach `peer`, from this rank's descriptor (`me`) and the
/// peer's alone: both ends of a pair get the same answer. `Err` says why not, in words
/// that may follow "FERROCCL_TRANSPORT=... but" (mesh setup reports it when no other
/// transport is allowed or able).
pub(crate) fn can_connect(kind: TransportKind, me: &Descriptor, peer: &Descriptor) -> std::result::Result<(), String> {
    match kind {
        TransportKind::Shm => shm::can_connect(me, peer),
        TransportKind::Tcp => tcp::can_connect(me, peer),
        TransportKind::Verbs => verbs::can_connect(me, peer),
    }
}

/// What mesh setup lends a transport while it connects.
pub(crate) struct SetupCx<'a> {
    pub(crate) rank: usize,
    pub(crate) size: usize,
    pub(crate) deadline: Instant,
    /// Every rank's descriptor, ours included (`descs[rank]`).
    pub(crate) descs: &'a [Descriptor],
    /// Where the endpoints deliver.
    pub(crate) inbox: &'a Arc<Inbox>,
    /// Authenticates new connections (tcp).
    pub(crate) handshake: &'a Arc<dyn Handshake>,
    /// Names this mesh (unique per init in the job): a connecting rank sends it after the
    /// handshake, so that a connection meant for another mesh is dropped.
    pub(crate) mesh_id: &'a str,
    /// Rounds among the peers after the descriptor exchange (verbs' ready mark).
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) exchange: &'a dyn SetupExchange,
    /// Looked at while waiting for a peer (tcp's connects and accepts): its error ends the
    /// setup (a shrink's member died meanwhile; see `FabricConfig::watch`).
    pub(crate) watch: &'a (dyn Fn() -> Result<()> + Sync),
}

/// What a transport's `connect` returns besides what it keeps for all its peers.
#[derive(Debug, Default)]
pub(crate) struct Connected {
    /// One endpoint per peer it connected.
    pub(crate) endpoints: Vec<(usize, Endpoint)>,
    /// Peer processes to watch (world rank, watch): peers on this host, whose death the
    /// fabric then sees at once instead of through the transport.
    pub(crate) watches: Vec<(usize, ProcessWatch)>,
}

/// How a transport publishes a value to its peers after the descriptor exchange, and
/// collects theirs (mesh setup implements it over the job's store). `topic` names the
/// round; every rank publishes once per topic.
#[cfg_attr(not(feature = "verbs"), allow(dead_code))]
pub(crate) trait SetupExchange {
    /// Publishes this rank's value for `topic`.
    fn publish(&self, topic: &str, value: &[u8]) -> Result<()>;
    /// Waits (until `deadline`) for the values `peers` published for `topic`, in order.
    fn gather(&self, topic: &str, peers: &[usize], deadline: Instant) -> Result<Vec<Vec<u8>>>;
}

/// The job's handshake on a new connection: each end proves it knows the job's token
/// (mesh setup implements it over the bootstrap's authentication). Shared with the
/// threads that vet incoming connections, hence `Send + Sync`.
pub(crate) trait Handshake: Send + Sync {
    /// On a connection this rank opened to `peer` (named in errors).
    fn connecting(&self, s: &mut TcpStream, peer: &str, deadline: Instant) -> Result<()>;
    /// On a connection this rank accepted from `peer`.
    fn accepting(&self, s: &mut TcpStream, peer: &str, deadline: Instant) -> Result<()>;
}

/// One peer's connection, whichever transport carries it.
#[derive(Debug)]
pub(crate) enum Endpoint {
    Shm(Arc<shm::ShmEndpoint>),
    Tcp(tcp::TcpEndpoint),
    /// Never built without the `verbs` feature (no verbs endpoint can exist then).
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    Verbs(verbs::VerbsEndpoint),
}

impl Endpoint {
    /// Which transport carries it.
    pub(crate) fn kind(&self) -> TransportKind {
        match self {
            Endpoint::Shm(_) => TransportKind::Shm,
            Endpoint::Tcp(_) => TransportKind::Tcp,
            Endpoint::Verbs(_) => TransportKind::Verbs,
        }
    }

    /// The peer's process id, when it is on this host and reached over shm (so that it can
    /// share memory with this process directly).
    pub(crate) fn shm_pid(&self) -> Option<i32> {
        match self {
            Endpoint::Shm(e) => Some(e.peer_pid()),
            _ => None,
        }
    }

    /// Wakes the peer if it sleeps on its doorbell (shm: a peer that published something
    /// in shared memory itself, outside the rings; the other transports' messages wake
    /// their receivers already).
    ///
    /// The caller has just made a sequentially consistent write (a swap) of what it
    /// published, which orders it before the look at the peer's sleep flag as the fence of
    /// the doorbell protocol would.
    pub(crate) fn wake_if_sleeping_after_fence(&self) {
        if let Endpoint::Shm(e) = self {
            e.ring_peer_bell_if_sleeping();
        }
    }

    /// Largest message [`Endpoint::post_send`] takes.
    pub(crate) fn max_send(&self) -> usize {
        match self {
            Endpoint::Shm(e) => e.max_send(),
            Endpoint::Tcp(e) => e.max_send(),
            Endpoint::Verbs(e) => e.max_send(),
        }
    }

    /// Sends a two-sided message. `poll` is called while waiting for room, so that two
    /// ranks sending to each other keep draining their own inboxes.
    pub(crate) fn post_send(&self, msg: &[u8], deadline: Instant, poll: &dyn Fn() -> Result<()>) -> Result<()> {
        match self {
            Endpoint::Shm(e) => e.post_send(msg, deadline, poll),
            Endpoint::Tcp(e) => e.post_send(msg, deadline),
            Endpoint::Verbs(e) => e.post_send(msg, deadline, poll),
        }
    }

    /// Sends a two-sided message made of `head` followed by `body` (no copy into an
    /// intermediate buffer: the eager path of every transfer).
    pub(crate) fn post_send2(&self, head: &[u8], body: &[u8], deadline: Instant, poll: &dyn Fn() -> Result<()>) -> Result<()> {
        match self {
            Endpoint::Shm(e) => e.post_send2(head, body, deadline, poll),
            Endpoint::Tcp(e) => e.post_send2(head, body, deadline),
            Endpoint::Verbs(e) => e.post_send2(head, body, deadline, poll),
        }
    }

    /// Writes `len` bytes from `src[offset..]` into `dst` at the peer, with immediate `imm`.
    /// Returns the work-request id whose `WriteDone` completion says `src` may be reused
    /// (already completed for the synchronous cases).
    pub(crate) fn post_write(&self, w: &WriteReq<'_>, deadline: Instant, poll: &dyn Fn() -> Result<()>) -> Result<WriteTicket> {
        w.check()?;
        match self {
            Endpoint::Shm(e) => e.post_write(w, deadline, poll),
            Endpoint::Tcp(e) => e.post_write(w, deadline).map(|()| WriteTicket::Done),
            // The source is copied into staging slots while posting, or (a window with a
            // memory region) held by the transport until the device has read it.
            Endpoint::Verbs(e) => e.post_write(w, deadline, poll).map(|()| WriteTicket::Done),
        }
    }

    /// Sends a message only if that needs no waiting (a full ring, a full socket or one
    /// busy with another frame is skipped, `WouldBlock`, and the connection stays usable);
    /// used to tell peers why this rank gives up, and for probes.
    pub(crate) fn try_post_send_now(&self, msg: &[u8], deadline: Instant) -> Result<()> {
        match self {
            Endpoint::Shm(e) => e.post_send(msg, deadline, &|| Err(crate::error::Error::WouldBlock("ring full".into()))),
            Endpoint::Tcp(e) => e.try_post_send_now(msg, deadline),
            Endpoint::Verbs(e) => e.try_post_send_now(msg),
        }
    }

    /// Breaks the connection off after a fatal error, so that nothing stays blocked on it.
    pub(crate) fn cut(&self) {
        match self {
            Endpoint::Shm(_) => {}
            Endpoint::Tcp(e) => e.cut(),
            Endpoint::Verbs(e) => e.cut(),
        }
    }

    /// Says goodbye: the peer will treat our exit as clean.
    pub(crate) fn close(&self, deadline: Instant, poll: &dyn Fn() -> Result<()>) {
        match self {
            Endpoint::Shm(e) => e.close(deadline, poll),
            Endpoint::Tcp(e) => e.close(deadline),
            Endpoint::Verbs(e) => e.close(deadline, poll),
        }
    }
}

/// What a receiver holds while a peer may write into its advertised range: nothing for
/// shm and tcp (their writes are landed by this process, through the region's checks); for
/// verbs, the memory region over that range, whose drop deregisters it and releases the
/// range. It must be dropped inside the region's scope (it is: receive operations live
/// inside `with_region`, and a leaked one makes the scope wait, never unsound).
#[derive(Debug, Default)]
pub(crate) struct WriteGrant {
    mr: Option<Arc<verbs::UserMr>>,
}

impl WriteGrant {
    pub(crate) fn verbs(mr: verbs::UserMr) -> WriteGrant {
        WriteGrant { mr: Some(Arc::new(mr)) }
    }

    /// The verbs memory region over the range, if verbs registered it (an RDMA READ's
    /// target: a READ in flight keeps a clone until its completion).
    pub(crate) fn verbs_mr(&self) -> Option<&Arc<verbs::UserMr>> {
        self.mr.as_ref()
    }
}

/// An RDMA READ of a peer's window (see `VerbsEndpoint::post_read`): `rows` rows of
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
    pub(crate) src_mr: Option<&'a Arc<verbs::UserMr>>,
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
            return Err(crate::error::Error::invalid(format!(
                "write source [{}, +{}) overruns the local region of {} bytes",
                self.offset,
                self.len,
                self.src.len()
            )));
        }
        if self.dst_offset.checked_add(self.len as u64).is_none_or(|e| e > self.dst.len)
            || self.dst.addr.checked_add(self.dst.len).is_none()
        {
            return Err(crate::error::Error::invalid(format!(
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
