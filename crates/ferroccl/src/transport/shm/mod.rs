//! Shared-memory transport for ranks on the same host.
//!
//! Each rank creates one anonymous shared-memory segment (a memfd), its *inbox*: a header
//! (doorbell, sleep flag, pull-slot table) and one single-producer/single-consumer byte ring
//! per sender. A peer maps the segment (opening it through `/proc/<pid>/fd/<fd>`, checked to
//! be that memfd by name and size) and produces records into its own ring there; the owner
//! drains every ring when it polls. The owner closes the descriptor as soon as every peer has
//! mapped it (each peer's HELLO record proves it). The segment has no name in any file
//! system, so a rank killed at any moment, even in the middle of building the mesh, leaves
//! nothing behind (nothing in /dev/shm): the kernel frees it with the last mapping.
//!
//! Records are 64-byte headers followed by the payload padded to 64 bytes:
//! * `MSG`: a two-sided message (payload inline);
//! * `WRITE`: one chunk of a one-sided write, copied through the ring (small writes, or all
//!   writes when cross-memory attach is not allowed); the chunk flagged `LAST` completes it;
//! * `PULL`: a large one-sided write as a descriptor: the target copies the bytes straight
//!   from the writer's memory into its registered region with `process_vm_readv` (one
//!   copy), then checks the writer's pull slot still holds the same generation (the writer
//!   revokes the slot before it lets go of the buffer, so a late pull is detected, never
//!   delivered as data), and marks the slot done;
//! * `HELLO` (first record from each peer; says whether that peer can pull from us), `BYE`
//!   (clean shutdown), `PAD` (skip to the ring's start).
//!
//! Ordering: a producer copies the record, then publishes `tail` with Release; the consumer
//! reads `tail` with Acquire, copies the record out, then publishes `head` with Release.
//! Waking: producers bump the owner's doorbell word and `futex_wake` it when the owner has
//! said it sleeps (see `fabric` for the sleeping side).

use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use ferroccl_mem::futex::futex_wake;
use ferroccl_mem::process::{can_read_process, read_process_memory, ProcessWatch};
use ferroccl_mem::segment::ShmSegment;

use crate::error::{Error, Op, Result};
use crate::inbox::{Backoff, Bell, BellWords, Inbox};
use crate::params::Params;
use crate::transport::{
    Connected, Descriptor, Endpoint, Net, OpenCx, Opened, PendingWrite, Setup, SetupCx, ShmInfo, Transport, TransportKind, WriteReq,
    WriteTicket,
};

mod net;
mod setup;
#[cfg(test)]
mod tests;
mod wire;

pub(crate) use net::*;
pub(crate) use setup::*;
pub(crate) use wire::*;

/// A pull slot lent to a peer for one write (see [`WriteTicket::Pending`]): the peer may
/// read the source while the ticket lives; dropping it revokes that, whatever happened.
#[derive(Debug)]
pub(crate) struct PullTicket {
    shm: Arc<LocalShm>,
    slot: usize,
    gen: u64,
}

impl PullTicket {
    /// `None` while the peer pulls; then whether it could copy the data.
    pub(crate) fn status(&self) -> Option<std::result::Result<(), ()>> {
        self.shm.pull_status(self.slot, self.gen)
    }
}

impl Drop for PullTicket {
    fn drop(&mut self) {
        self.shm.release_slot(self.slot);
    }
}

/// The producing side of this rank's connection to one same-host peer.
#[derive(Debug)]
pub(crate) struct ShmEndpoint {
    rank: usize,
    peer: usize,
    peer_pid: i32,
    /// The peer's inbox segment; we produce into ring `rank` there.
    peer_seg: Arc<ShmSegment>,
    local: Arc<LocalShm>,
    ring_bytes: usize,
    inline_max: usize,
    cma: bool,
    tail: Mutex<u64>,
    /// 0 unknown (no HELLO yet), 1 the peer can pull from us, 2 it cannot.
    peer_can_pull: AtomicU8,
}

impl ShmEndpoint {
    /// The peer's process id.
    pub(crate) fn peer_pid(&self) -> i32 {
        self.peer_pid
    }

    #[allow(clippy::too_many_arguments)]
    fn connect(
        rank: usize,
        peer: usize,
        peer_pid: i32,
        peer_seg_fd: i32,
        peer_seg_name: &str,
        world: usize,
        ring_bytes: usize,
        inline_max: usize,
        cma: bool,
        local: Arc<LocalShm>,
    ) -> Result<ShmEndpoint> {
        let seg = ShmSegment::open_from(peer_pid, peer_seg_fd, peer_seg_name, segment_len(world, ring_bytes)).map_err(|e| {
            let hint = match e.kind() {
                std::io::ErrorKind::NotFound => "that rank exited, or closed the segment, before this rank mapped it",
                std::io::ErrorKind::PermissionDenied => {
                    "opening another process's /proc/<pid>/fd needs the same user and a dumpable process; FERROCCL_TRANSPORT=tcp avoids shm"
                }
                _ => "FERROCCL_TRANSPORT=tcp avoids shm",
            };
            Error::Transport {
                rank,
                peer: Some(peer),
                transport: TransportKind::Shm,
                what: format!("cannot map its segment: {e} ({hint})"),
            }
        })?;
        // Fault in now, not in the first calls that fill them (a 64 KiB message stream
        // touched a fresh page of each ring per 4 KiB for the first megabyte): our ring in
        // the peer's segment, and the peer's ring in ours.
        touch_pages(&seg, ring_off(rank, ring_bytes), RING_CTRL + ring_bytes);
        touch_pages(&local.seg, ring_off(peer, ring_bytes), RING_CTRL + ring_bytes);
        Ok(ShmEndpoint {
            rank,
            peer,
            peer_pid,
            peer_seg: Arc::new(seg),
            local,
            ring_bytes,
            inline_max,
            cma,
            tail: Mutex::new(0),
            peer_can_pull: AtomicU8::new(0),
        })
    }

    pub(crate) fn max_send(&self) -> usize {
        self.ring_bytes / 2 - REC
    }

    /// The peer's last words (see [`LAST_LEN_OFF`]), once it left them. One load while
    /// it has not: cheap enough to look every health beat.
    fn last_words(&self) -> Option<Vec<u8>> {
        let len = self.peer_seg.atomic_u32(LAST_LEN_OFF).load(Ordering::Acquire) as usize;
        if len == 0 || len > LAST_MAX {
            return None;
        }
        let mut msg = vec![0u8; len];
        self.peer_seg.read(LAST_OFF, &mut msg);
        Some(msg)
    }

    fn err(&self, what: impl Into<String>) -> Error {
        Error::Transport { rank: self.rank, peer: Some(self.peer), transport: TransportKind::Shm, what: what.into() }
    }

    /// Wakes the peer if it sleeps. Only then is its doorbell touched: a message costs no
    /// write to the peer's doorbell line while the peer polls. The fence pairs with the one
    /// in [`LocalShm::has_pending`]: either the peer, having announced it sleeps, sees our
    /// record, or we see the announcement and wake it.
    fn ring_peer_bell_always(&self) {
        self.peer_seg.atomic_u32(BELL_OFF).fetch_add(1, Ordering::SeqCst);
        if self.peer_seg.atomic_u32(SLEEPING_OFF).load(Ordering::SeqCst) != 0 {
            let _ = futex_wake(self.peer_seg.atomic_u32(BELL_OFF), u32::MAX);
        }
    }

    fn ring_peer_bell(&self) {
        fence(Ordering::SeqCst);
        self.ring_peer_bell_if_sleeping();
    }

    /// [`ShmEndpoint::ring_peer_bell`] for a caller whose last write was sequentially
    /// consistent (it orders that write before the look at the sleep flag, as the fence).
    pub(crate) fn ring_peer_bell_if_sleeping(&self) {
        if self.peer_seg.atomic_u32(SLEEPING_OFF).load(Ordering::SeqCst) != 0 {
            self.peer_seg.atomic_u32(BELL_OFF).fetch_add(1, Ordering::SeqCst);
            let _ = futex_wake(self.peer_seg.atomic_u32(BELL_OFF), u32::MAX);
        }
    }

    /// Appends one record (header + `len` payload bytes written by `fill`) to our ring in
    /// the peer's segment, waiting for room.
    fn produce(
        &self,
        h: &Header,
        len: usize,
        fill: impl FnOnce(&ShmSegment, usize) -> Result<()>,
        deadline: Instant,
        poll: &dyn Fn() -> Result<()>,
    ) -> Result<()> {
        let need = (REC + pad64(len)) as u64;
        let r = self.ring_bytes as u64;
        debug_assert!(need <= r);
        let base = ring_off(self.rank, self.ring_bytes);
        let mut tail = self.tail.lock().unwrap_or_else(|e| e.into_inner());
        let mut backoff = Backoff::default();
        let start = Instant::now();
        loop {
            let pos = *tail % r;
            let contiguous = r - pos;
            let want = if contiguous < need { contiguous } else { need };
            let head = self.peer_seg.atomic_u64(base + 64).load(Ordering::Acquire);
            if head > *tail || *tail - head > r {
                return Err(self.err(format!("corrupt ring: head {head} is not within one ring of tail {}", *tail)));
            }
            if r - (*tail - head) >= want {
                if contiguous < need {
                    let pad = Header { kind: K_PAD, len: contiguous, ..Header::default() };
                    self.peer_seg.write(base + RING_CTRL + pos as usize, &pad.encode());
                    *tail += contiguous;
                    self.peer_seg.atomic_u64(base).store(*tail, Ordering::Release);
                    continue;
                }
                let off = base + RING_CTRL + pos as usize;
                self.peer_seg.write(off, &h.encode());
                fill(&self.peer_seg, off + REC)?;
                *tail += need;
                self.peer_seg.atomic_u64(base).store(*tail, Ordering::Release);
                self.ring_peer_bell();
                return Ok(());
            }
            // Ring full: keep draining our own inbox so a peer sending to us can go on, and
            // watch the peers (a dead consumer never drains).
            poll()?;
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    rank: Some(self.rank),
                    op: Op::other(format!("shm send to rank {} (its ring stayed full)", self.peer)),
                    after: start.elapsed(),
                    waiting_for: vec![format!("rank {}", self.peer)],
                });
            }
            // The consumer rings no bell when it makes room: park in short naps.
            backoff.idle(FULL_RING_NAP, Some(deadline), |until| std::thread::sleep(until.saturating_duration_since(Instant::now())));
        }
    }

    pub(crate) fn post_send(&self, msg: &[u8], deadline: Instant, poll: &dyn Fn() -> Result<()>) -> Result<()> {
        self.post_send2(msg, &[], deadline, poll)
    }

    /// One message, `head` then `body`, copied straight into the ring.
    pub(crate) fn post_send2(&self, head: &[u8], body: &[u8], deadline: Instant, poll: &dyn Fn() -> Result<()>) -> Result<()> {
        let len = head.len() + body.len();
        if len > self.max_send() {
            return Err(self.err(format!("message of {len} bytes exceeds the ring's limit of {}", self.max_send())));
        }
        let h = Header { kind: K_MSG, len: len as u64, ..Header::default() };
        self.produce(
            &h,
            len,
            |seg, off| {
                seg.write(off, head);
                seg.write(off + head.len(), body);
                Ok(())
            },
            deadline,
            poll,
        )
    }

    /// Tells the peer whether it may pull from us (`we_can_be_pulled` is the peer's probe
    /// result as seen from our side: can *we* pull from *it*; see `fabric`).
    fn post_hello(&self, we_can_pull_from_peer: bool, deadline: Instant, poll: &dyn Fn() -> Result<()>) -> Result<()> {
        let h = Header { kind: K_HELLO, flags: if we_can_pull_from_peer { F_CAN_PULL } else { 0 }, ..Header::default() };
        self.produce(&h, 0, |_, _| Ok(()), deadline, poll)
    }

    fn hello_received(&self) -> bool {
        self.peer_can_pull.load(Ordering::Acquire) != 0
    }

    /// Posts a write already checked by [`WriteReq`]'s bounds check.
    pub(crate) fn post_write(&self, w: &WriteReq<'_>, deadline: Instant, poll: &dyn Fn() -> Result<()>) -> Result<WriteTicket> {
        let WriteReq { src, offset, len, dst, imm, .. } = *w;
        let pull = self.cma && len > self.inline_max && self.peer_can_pull.load(Ordering::Acquire) == 1;
        if pull {
            if let Some((slot, gen)) = self.local.alloc_slot() {
                let h = Header {
                    kind: K_PULL,
                    len: len as u64,
                    imm,
                    key: dst.key,
                    dst_addr: w.dst_addr(0),
                    src_addr: src.addr() + offset as u64,
                    slot: slot as u32,
                    gen,
                    ..Header::default()
                };
                // The ticket releases the slot if the post fails, or when the send ends.
                let ticket = PullTicket { shm: self.local.clone(), slot, gen };
                self.produce(&h, 0, |_, _| Ok(()), deadline, poll)?;
                return Ok(WriteTicket::Pending(PendingWrite(ticket)));
            }
            // Every pull slot busy: fall through and copy through the ring.
        }
        let chunk = (self.max_send() / 2).max(REC);
        let mut pos = 0usize;
        loop {
            let n = chunk.min(len - pos);
            let last = pos + n == len;
            let h = Header {
                kind: K_WRITE,
                flags: if last { F_LAST } else { 0 },
                len: n as u64,
                imm,
                key: dst.key,
                dst_addr: w.dst_addr(pos),
                ..Header::default()
            };
            self.produce(
                &h,
                n,
                |seg, off| src.with_slice(offset + pos, n, |s| seg.write(off, s)).map_err(|e| self.err(format!("write source: {e}"))),
                deadline,
                poll,
            )?;
            pos += n;
            if last {
                return Ok(WriteTicket::Done);
            }
        }
    }

    pub(crate) fn close(&self, deadline: Instant, poll: &dyn Fn() -> Result<()>) {
        let h = Header { kind: K_BYE, ..Header::default() };
        let _ = self.produce(&h, 0, |_, _| Ok(()), deadline, poll);
    }
}

impl Endpoint for ShmEndpoint {
    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }

    fn shm_pid(&self) -> Option<i32> {
        Some(self.peer_pid())
    }

    fn wake_if_sleeping_after_fence(&self) {
        self.ring_peer_bell_if_sleeping();
    }

    fn max_send(&self) -> usize {
        ShmEndpoint::max_send(self)
    }

    fn post_send(&self, msg: &[u8], deadline: Instant, poll: &dyn Fn() -> Result<()>) -> Result<()> {
        ShmEndpoint::post_send(self, msg, deadline, poll)
    }

    fn post_send2(&self, head: &[u8], body: &[u8], deadline: Instant, poll: &dyn Fn() -> Result<()>) -> Result<()> {
        ShmEndpoint::post_send2(self, head, body, deadline, poll)
    }

    fn write(&self, w: &WriteReq<'_>, deadline: Instant, poll: &dyn Fn() -> Result<()>) -> Result<WriteTicket> {
        ShmEndpoint::post_write(self, w, deadline, poll)
    }

    fn try_post_send_now(&self, msg: &[u8], deadline: Instant) -> Result<bool> {
        // The ring is full when the send would have to wait: then nothing was written.
        let full = std::cell::Cell::new(false);
        let stop = || {
            full.set(true);
            Err(Error::internal("shm ring full"))
        };
        match ShmEndpoint::post_send(self, msg, deadline, &stop) {
            Ok(()) => Ok(true),
            Err(_) if full.get() => Ok(false),
            Err(e) => Err(e),
        }
    }

    fn close(&self, deadline: Instant, poll: &dyn Fn() -> Result<()>) {
        ShmEndpoint::close(self, deadline, poll);
    }
}
