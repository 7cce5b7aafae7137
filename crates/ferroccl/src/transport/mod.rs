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
//! Setup is part of the contract too: which transport reaches which peer is a
//! [`TransportKind`], chosen by mesh setup (`crate::mesh`) from the descriptors every rank
//! publishes; a transport that needs more setup data than the descriptor carries (verbs:
//! its queue-pair numbers) exchanges it through a [`SetupExchange`], never through the
//! store directly.
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

pub(crate) mod shm;
pub(crate) mod tcp;
#[cfg(feature = "verbs")]
pub(crate) mod verbs;
#[cfg(not(feature = "verbs"))]
#[path = "verbs_off.rs"]
pub(crate) mod verbs;

use std::time::Instant;

use ferroccl_mem::region::RegionHandle;

use crate::error::Result;
pub(crate) use crate::transport_kind::TransportKind;
pub(crate) use crate::wire::RemoteBuf;

/// How a transport publishes its own setup data to its peers while the mesh is built, and
/// collects theirs (mesh setup implements it over the job's store). `topic` names the
/// round; every rank publishes once per topic.
#[cfg_attr(not(feature = "verbs"), allow(dead_code))]
pub(crate) trait SetupExchange {
    /// Publishes this rank's value for `topic`.
    fn publish(&self, topic: &str, value: &[u8]) -> Result<()>;
    /// Waits (until `deadline`) for the values `peers` published for `topic`, in order.
    fn gather(&self, topic: &str, peers: &[usize], deadline: Instant) -> Result<Vec<Vec<u8>>>;
}

/// One peer's connection, whichever transport carries it.
#[derive(Debug)]
pub(crate) enum Endpoint {
    Shm(shm::ShmEndpoint),
    Tcp(tcp::TcpEndpoint),
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
            // The source is copied into staging slots while posting.
            Endpoint::Verbs(e) => e.post_write(w, deadline, poll).map(|()| WriteTicket::Done),
        }
    }

    /// Sends a message only if that needs no waiting (a full ring or a socket busy with
    /// another frame is skipped); used to tell peers why this rank gives up.
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
    _mr: Option<verbs::UserMr>,
}

impl WriteGrant {
    pub(crate) fn verbs(mr: verbs::UserMr) -> WriteGrant {
        WriteGrant { _mr: Some(mr) }
    }
}

/// A one-sided write: `len` bytes from `src[offset..]` to `dst` at `dst_offset`, with the
/// immediate `imm` reported to the target when the bytes have landed.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WriteReq<'a> {
    pub(crate) src: &'a RegionHandle,
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
