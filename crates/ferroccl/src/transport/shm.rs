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
use crate::inbox::{Backoff, BellWords, Inbox};
use crate::params::Params;
use crate::transport::{Connected, Descriptor, Endpoint, PendingWrite, SetupCx, ShmInfo, TransportKind, WriteReq, WriteTicket};

/// Bytes before the first ring: doorbell, sleep flag, pull slots.
const HEADER_BYTES: usize = 4096;
const BELL_OFF: usize = 0;
const SLEEPING_OFF: usize = 64;
const SLOTS_OFF: usize = 128;
/// Outstanding single-copy pulls per rank.
pub(crate) const PULL_SLOTS: usize = 128;
const SLOT_BYTES: usize = 16;
/// Ring control words (tail, head) each on their own cache line, then the data.
const RING_CTRL: usize = 128;
const REC: usize = 64;
/// How long a producer facing a full ring sleeps at a time, once done spinning.
const FULL_RING_NAP: std::time::Duration = std::time::Duration::from_micros(50);

const K_MSG: u32 = 1;
const K_WRITE: u32 = 2;
const K_PULL: u32 = 3;
const K_HELLO: u32 = 4;
const K_BYE: u32 = 5;
const K_PAD: u32 = 6;
const F_LAST: u32 = 1;
const F_CAN_PULL: u32 = 2;
/// A pull slot's `done` word: the generation on success, with this bit on failure.
const DONE_FAILED: u64 = 1 << 63;

/// The owner's last words: why it gave up, as the `ERR` it sends its peers, written once
/// into its own segment's header (length word, then the bytes). A message in a ring can be
/// lost when the ring is full as the rank gives up (it cannot wait then), and a peer that
/// then sees the process gone would blame it, not the rank it blamed; the header always
/// has room, and a peer reads it before it blames an exited (or silent) rank.
const LAST_LEN_OFF: usize = SLOTS_OFF + PULL_SLOTS * SLOT_BYTES;
const LAST_OFF: usize = LAST_LEN_OFF + 64;
/// The longest last words (a longer `ERR` is not left: the ring message is all there is).
pub(crate) const LAST_MAX: usize = HEADER_BYTES - LAST_OFF;

const _: () = assert!(LAST_OFF < HEADER_BYTES && LAST_MAX >= 1024);

/// Total size of a rank's inbox segment.
pub(crate) fn segment_len(world: usize, ring_bytes: usize) -> usize {
    HEADER_BYTES + world * (RING_CTRL + ring_bytes)
}

fn ring_off(sender: usize, ring_bytes: usize) -> usize {
    HEADER_BYTES + sender * (RING_CTRL + ring_bytes)
}

/// Reads a byte of every page of `len` bytes at `off`: the pages are allocated (shared
/// memory is, on a read fault) and mapped in this process.
fn touch_pages(seg: &ShmSegment, off: usize, len: usize) {
    let mut b = [0u8; 1];
    let end = (off + len).min(seg.len());
    let mut at = off;
    while at < end {
        seg.read(at, &mut b);
        at = (at / 4096 + 1) * 4096;
    }
}

fn pad64(n: usize) -> usize {
    n.div_ceil(REC) * REC
}

#[derive(Default, Clone, Copy, Debug)]
struct Header {
    kind: u32,
    flags: u32,
    len: u64,
    imm: u32,
    key: u64,
    dst_addr: u64,
    src_addr: u64,
    slot: u32,
    gen: u64,
}

impl Header {
    fn encode(&self) -> [u8; REC] {
        let mut b = [0u8; REC];
        b[0..4].copy_from_slice(&self.kind.to_le_bytes());
        b[4..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..16].copy_from_slice(&self.len.to_le_bytes());
        b[16..20].copy_from_slice(&self.imm.to_le_bytes());
        b[24..32].copy_from_slice(&self.key.to_le_bytes());
        b[32..40].copy_from_slice(&self.dst_addr.to_le_bytes());
        b[40..48].copy_from_slice(&self.src_addr.to_le_bytes());
        b[48..52].copy_from_slice(&self.slot.to_le_bytes());
        b[56..64].copy_from_slice(&self.gen.to_le_bytes());
        b
    }
    fn decode(b: &[u8; REC]) -> Header {
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let u64_at = |o: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[o..o + 8]);
            u64::from_le_bytes(a)
        };
        Header {
            kind: u32_at(0),
            flags: u32_at(4),
            len: u64_at(8),
            imm: u32_at(16),
            key: u64_at(24),
            dst_addr: u64_at(32),
            src_addr: u64_at(40),
            slot: u32_at(48),
            gen: u64_at(56),
        }
    }
}

/// Whether shm reaches `peer`: both on one host (equal host identities) and both with an
/// inbox segment.
pub(crate) fn can_connect(me: &Descriptor, peer: &Descriptor) -> std::result::Result<(), String> {
    if peer.host_id != me.host_id {
        return Err(format!("it is on another host ({}, this is {})", peer.hostname, me.hostname));
    }
    match (&me.shm, &peer.shm) {
        (Some(_), Some(_)) => Ok(()),
        (_, None) => Err("it has no shared-memory segment".into()),
        (None, Some(_)) => Err("this rank has no shared-memory segment".into()),
    }
}

/// This rank's side of shm while the mesh is built: its inbox segment (the descriptor
/// names it) and the probe its peers read to learn whether they may pull from us.
#[derive(Debug)]
pub(crate) struct ShmSetup {
    local: Arc<LocalShm>,
    /// Kept alive: peers probe cross-memory attach by reading it.
    probe: Box<[u8; 64]>,
    ring_bytes: usize,
    inline_max: usize,
    cma: bool,
}

impl ShmSetup {
    /// Creates this rank's inbox segment, sized for `world` senders.
    pub(crate) fn create(rank: usize, world: usize, params: &Params) -> Result<ShmSetup> {
        let name = format!("ferroccl-{}-{}-{}", std::process::id(), rank, unique_suffix());
        let local = LocalShm::create(&name, rank, world, params.shm_ring_bytes)
            .map_err(|e| Error::io(format!("rank {rank}: create shared-memory segment {name}"), e))?;
        Ok(ShmSetup {
            local: Arc::new(local),
            probe: Box::new([0x5a; 64]),
            ring_bytes: params.shm_ring_bytes,
            inline_max: params.shm_inline_max,
            cma: params.shm_cma,
        })
    }

    /// The doorbell peers ring (it lives in the segment, so that they can).
    pub(crate) fn bell(&self) -> Arc<dyn BellWords> {
        self.local.clone()
    }

    /// Closes the descriptor peers would open the segment through (when no peer uses shm;
    /// otherwise [`ShmNet::withdraw`], once every peer mapped it).
    pub(crate) fn withdraw(&self) {
        self.local.withdraw();
    }

    /// Our part of the descriptor.
    pub(crate) fn info(&self) -> ShmInfo {
        ShmInfo {
            name: self.local.name().to_string(),
            fd: self.local.fd().and_then(|f| u32::try_from(f).ok()).unwrap_or(0),
            probe_addr: self.probe.as_ptr() as u64,
            ring_bytes: self.ring_bytes as u64,
        }
    }

    /// Maps the inbox of every peer in `peers` (chosen for shm), opens a watch on each
    /// peer's process (a dead peer never drains its ring, so the fabric must see it go),
    /// and probes whether we may pull from it (said in our hello, [`ShmNet::greet`]).
    pub(crate) fn connect(self, cx: &SetupCx<'_>, peers: &[usize]) -> Result<(ShmNet, Connected)> {
        let rank = cx.rank;
        let mut out = Connected::default();
        let mut net = ShmNet { local: self.local.clone(), peers: Vec::with_capacity(peers.len()), _probe: self.probe };
        for &p in peers {
            let d = &cx.descs[p];
            let info = d.shm.as_ref().ok_or_else(|| Error::internal(format!("shm chosen for rank {p}, which has no segment")))?;
            if info.ring_bytes != self.ring_bytes as u64 {
                return Err(Error::invalid(format!(
                    "FERROCCL_SHM_RING_BYTES differs between ranks: {} on rank {rank}, {} on rank {p}",
                    self.ring_bytes, info.ring_bytes
                )));
            }
            let ep = Arc::new(ShmEndpoint::connect(
                rank,
                p,
                d.pid as i32,
                info.fd as i32,
                &info.name,
                cx.size,
                self.ring_bytes,
                self.inline_max,
                self.cma,
                self.local.clone(),
            )?);
            let watch =
                ProcessWatch::new(d.pid as i32).map_err(|e| Error::io(format!("rank {rank}: watch rank {p} (pid {})", d.pid), e))?;
            out.watches.push((p, watch));
            let can_pull = self.cma && can_read_process(d.pid as i32, info.probe_addr);
            net.peers.push(ShmPeer { peer: p, ep: ep.clone(), can_pull });
            out.endpoints.push((p, Endpoint::Shm(ep)));
        }
        Ok((net, out))
    }
}

fn unique_suffix() -> String {
    let mut b = [0u8; 6];
    let _ = getrandom::fill(&mut b);
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// One connected shm peer, as [`ShmNet`] keeps it.
#[derive(Debug)]
struct ShmPeer {
    peer: usize,
    ep: Arc<ShmEndpoint>,
    /// Whether we may pull from it (our hello says so).
    can_pull: bool,
}

/// This rank's shm side once connected: the inbox segment it drains, and the peers that
/// produce into it (each greeted once at setup).
#[derive(Debug)]
pub(crate) struct ShmNet {
    local: Arc<LocalShm>,
    peers: Vec<ShmPeer>,
    /// Kept alive while a peer may still probe it.
    _probe: Box<[u8; 64]>,
}

impl ShmNet {
    /// Says hello to every shm peer: once each has said hello back ([`ShmNet::ungreeted`]
    /// is empty), it has mapped our segment, whose descriptor can then go
    /// ([`ShmNet::withdraw`]).
    pub(crate) fn greet(&self, deadline: Instant, poll: &dyn Fn() -> Result<()>) -> Result<()> {
        for p in &self.peers {
            p.ep.post_hello(p.can_pull, deadline, poll)?;
        }
        Ok(())
    }

    /// The peers whose hello has not arrived yet.
    pub(crate) fn ungreeted(&self) -> Vec<usize> {
        self.peers.iter().filter(|p| !p.ep.hello_received()).map(|p| p.peer).collect()
    }

    /// The shm peers (world ranks).
    pub(crate) fn peers(&self) -> Vec<usize> {
        self.peers.iter().map(|p| p.peer).collect()
    }

    /// Closes the descriptor peers open our inbox segment through (the mapping stays).
    pub(crate) fn withdraw(&self) {
        self.local.withdraw();
    }

    /// Drains every peer's ring in our segment into `inbox` (allocates nothing unless a
    /// message arrives); returns whether anything was consumed.
    pub(crate) fn drain(&self, inbox: &Inbox) -> Result<bool> {
        self.local.drain(self.peers.iter().map(|p| (p.peer, &*p.ep)), inbox)
    }

    /// Whether records wait in our rings (looked at before sleeping on the doorbell).
    pub(crate) fn has_pending(&self) -> bool {
        self.local.has_pending()
    }

    /// Leaves `msg` (an `ERR`) as this rank's last words, where every shm peer can read
    /// them even if this process is gone; the first words stay (a rank gives up once).
    /// Returns whether they were left (not when too long, or already left).
    pub(crate) fn leave_last_words(&self, msg: &[u8]) -> bool {
        self.local.leave_last_words(msg)
    }

    /// The first shm peer that `which` picks (by world rank) and that left last words,
    /// with the words. Allocates nothing unless some peer left words.
    pub(crate) fn last_words(&self, which: impl Fn(usize) -> bool) -> Option<(usize, Vec<u8>)> {
        self.peers.iter().filter(|p| which(p.peer)).find_map(|p| p.ep.last_words().map(|w| (p.peer, w)))
    }
}

/// This rank's own segment and what goes with it, shared by all shm endpoints.
#[derive(Debug)]
struct LocalShm {
    seg: Arc<ShmSegment>,
    rank: usize,
    ring_bytes: usize,
    /// Consumer positions, one per sender (only the polling thread touches them).
    heads: Mutex<Vec<u64>>,
    slots_used: Mutex<Vec<bool>>,
    next_gen: AtomicU64,
    withdrawn: AtomicBool,
}

impl LocalShm {
    fn create(name: &str, rank: usize, world: usize, ring_bytes: usize) -> std::io::Result<LocalShm> {
        let seg = ShmSegment::create_anonymous(name, segment_len(world, ring_bytes))?;
        Ok(LocalShm {
            seg: Arc::new(seg),
            rank,
            ring_bytes,
            heads: Mutex::new(vec![0; world]),
            slots_used: Mutex::new(vec![false; PULL_SLOTS]),
            next_gen: AtomicU64::new(1),
            withdrawn: AtomicBool::new(false),
        })
    }

    fn name(&self) -> &str {
        self.seg.name()
    }

    /// The descriptor number peers open the segment through (`/proc/<pid>/fd/<fd>`), until
    /// [`LocalShm::withdraw`].
    fn fd(&self) -> Option<i32> {
        self.seg.fd()
    }

    /// The doorbell word producers bump.
    fn bell(&self) -> &AtomicU32 {
        self.seg.atomic_u32(BELL_OFF)
    }

    /// Set while the owner sleeps on the doorbell.
    fn sleeping(&self) -> &AtomicU32 {
        self.seg.atomic_u32(SLEEPING_OFF)
    }

    /// Closes the descriptor peers open the segment through (the mappings stay); done once
    /// every peer mapped it.
    fn withdraw(&self) {
        if !self.withdrawn.swap(true, Ordering::AcqRel) {
            self.seg.withdraw();
        }
    }

    fn slot_gen(&self, slot: usize) -> &AtomicU64 {
        self.seg.atomic_u64(SLOTS_OFF + slot * SLOT_BYTES)
    }

    fn slot_done(&self, slot: usize) -> &AtomicU64 {
        self.seg.atomic_u64(SLOTS_OFF + slot * SLOT_BYTES + 8)
    }

    /// See [`ShmNet::leave_last_words`]: the bytes, then their length published with
    /// Release (a reader that sees the length sees the bytes).
    fn leave_last_words(&self, msg: &[u8]) -> bool {
        if msg.is_empty() || msg.len() > LAST_MAX {
            return false;
        }
        let len = self.seg.atomic_u32(LAST_LEN_OFF);
        // Only this process writes its own last words; a second fault keeps the first.
        if len.load(Ordering::Acquire) != 0 {
            return false;
        }
        self.seg.write(LAST_OFF, msg);
        len.store(msg.len() as u32, Ordering::Release);
        true
    }

    fn alloc_slot(&self) -> Option<(usize, u64)> {
        let mut used = self.slots_used.lock().unwrap_or_else(|e| e.into_inner());
        let slot = used.iter().position(|u| !u)?;
        used[slot] = true;
        let gen = self.next_gen.fetch_add(1, Ordering::Relaxed);
        self.slot_done(slot).store(0, Ordering::Relaxed);
        self.slot_gen(slot).store(gen, Ordering::Release);
        Some((slot, gen))
    }

    /// `Some(Ok)` when the target finished pulling, `Some(Err)` if it refused, `None` while
    /// pending.
    fn pull_status(&self, slot: usize, gen: u64) -> Option<std::result::Result<(), ()>> {
        let d = self.slot_done(slot).load(Ordering::Acquire);
        if d == gen {
            Some(Ok(()))
        } else if d == gen | DONE_FAILED {
            Some(Err(()))
        } else {
            None
        }
    }

    /// Revokes a pull slot: after this, a target that has not finished its copy will see the
    /// generation change and refuse the data. Must be called before the source is released.
    fn release_slot(&self, slot: usize) {
        // SeqCst + fence: the revocation must be visible before the caller's later writes to
        // the buffer (the target checks it after its copy, as a seqlock reader does).
        self.slot_gen(slot).swap(0, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        let mut used = self.slots_used.lock().unwrap_or_else(|e| e.into_inner());
        used[slot] = false;
    }

    /// Whether any sender's ring holds a record not yet drained. A waiter calls it after
    /// announcing that it sleeps (see `ShmEndpoint::ring_peer_bell`) and sleeps only if it
    /// is `false`.
    fn has_pending(&self) -> bool {
        fence(Ordering::SeqCst);
        let heads = self.heads.lock().unwrap_or_else(|e| e.into_inner());
        heads.iter().enumerate().any(|(p, &h)| self.seg.atomic_u64(ring_off(p, self.ring_bytes)).load(Ordering::SeqCst) != h)
    }

    /// Drains the ring of every sender in `peers` (world rank, endpoint), handing records to
    /// `inbox`. Returns whether anything was consumed.
    fn drain<'e>(&self, peers: impl IntoIterator<Item = (usize, &'e ShmEndpoint)>, inbox: &Inbox) -> Result<bool> {
        let mut heads = self.heads.lock().unwrap_or_else(|e| e.into_inner());
        let mut any = false;
        let r = self.ring_bytes as u64;
        for (peer, ep) in peers {
            let base = ring_off(peer, self.ring_bytes);
            let mut tail = self.seg.atomic_u64(base).load(Ordering::Acquire);
            let mut head = heads[peer];
            let mut revoked = false;
            let corrupt = |what: String| Error::Transport {
                rank: self.rank,
                peer: Some(peer),
                transport: TransportKind::Shm,
                what: format!("corrupt ring: {what}"),
            };
            if tail < head || tail - head > r {
                return Err(corrupt(format!("tail {tail} is not within one ring of head {head}")));
            }
            loop {
                if head >= tail {
                    if !revoked {
                        break;
                    }
                    // The writer revoked a pull because it gave up; it posted the reason
                    // before revoking, so read on to it.
                    tail = self.seg.atomic_u64(base).load(Ordering::Acquire);
                    if head >= tail {
                        break;
                    }
                }
                any = true;
                // Everything below comes from another process: check before using it.
                let pos = (head % r) as usize;
                let avail = tail - head;
                let mut hb = [0u8; REC];
                self.seg.read(base + RING_CTRL + pos, &mut hb);
                let h = Header::decode(&hb);
                let payload_off = base + RING_CTRL + pos + REC;
                let step = match h.kind {
                    K_PAD if h.len == r - pos as u64 => h.len,
                    K_PAD => return Err(corrupt(format!("padding of {} bytes at {pos} does not reach the end", h.len))),
                    K_MSG | K_WRITE if h.len <= r / 2 => (REC + pad64(h.len as usize)) as u64,
                    K_MSG | K_WRITE => return Err(corrupt(format!("record of {} bytes", h.len))),
                    _ => REC as u64,
                };
                if step > avail || (h.kind != K_PAD && pos + step as usize > self.ring_bytes) {
                    return Err(corrupt(format!("record (kind {}, len {}) overruns the ring", h.kind, h.len)));
                }
                match h.kind {
                    K_PAD => {}
                    K_MSG => {
                        let mut data = inbox.take_buf(h.len as usize);
                        self.seg.read(payload_off, &mut data);
                        inbox.deliver_msg(peer, data);
                    }
                    K_WRITE => {
                        let seg = &self.seg;
                        inbox.land_write(TransportKind::Shm, peer, h.key, h.dst_addr, h.len as usize, |s| {
                            seg.read(payload_off, s);
                            Ok(())
                        })?;
                        if h.flags & F_LAST != 0 {
                            inbox.write_imm(peer, h.imm);
                        }
                    }
                    K_PULL => revoked |= !self.serve_pull(peer, ep, &h, inbox)?,
                    K_HELLO => ep.peer_can_pull.store(if h.flags & F_CAN_PULL != 0 { 1 } else { 2 }, Ordering::Release),
                    K_BYE => inbox.peer_closed(peer),
                    k => {
                        return Err(Error::Transport {
                            rank: self.rank,
                            peer: Some(peer),
                            transport: TransportKind::Shm,
                            what: format!("unknown ring record kind {k}"),
                        })
                    }
                }
                head += step;
                heads[peer] = head;
                self.seg.atomic_u64(base + 64).store(head, Ordering::Release);
            }
            if revoked {
                let what = "gave up on a single-copy write while this rank was copying it".to_string();
                inbox.lock().set_fatal(peer, what.clone());
                return Err(Error::PeerFailed { rank: self.rank, peer, op: Op::other("shm receive"), reason: what, cause: None });
            }
        }
        Ok(any)
    }

    /// Serves one pull. `Ok(false)` when the writer revoked it (gave up) during the copy:
    /// nothing is delivered, and the writer's reason follows in the ring.
    fn serve_pull(&self, peer: usize, ep: &ShmEndpoint, h: &Header, inbox: &Inbox) -> Result<bool> {
        let slot = h.slot as usize;
        if slot >= PULL_SLOTS {
            return Err(Error::Transport {
                rank: self.rank,
                peer: Some(peer),
                transport: TransportKind::Shm,
                what: format!("pull slot {slot} out of range"),
            });
        }
        let pid = ep.peer_pid;
        let mut read_err = None;
        // A bad destination is a protocol error (fatal in land_write); a failed read is judged
        // below, together with the slot's generation.
        inbox.land_write(TransportKind::Shm, peer, h.key, h.dst_addr, h.len as usize, |s| {
            if let Err(e) = read_process_memory(pid, h.src_addr, s) {
                read_err = Some(e);
            }
            Ok(())
        })?;
        // The writer revokes the slot (generation 0) before it releases its buffer; if the
        // generation is unchanged after our copy, the copy read live data (a seqlock read:
        // the fence keeps the copy before the check).
        fence(Ordering::SeqCst);
        let gen_now = ep.peer_seg.atomic_u64(SLOTS_OFF + slot * SLOT_BYTES).load(Ordering::SeqCst);
        if gen_now != h.gen {
            // Revoked: the slot may already belong to a newer transfer, leave it alone.
            return Ok(false);
        }
        let ok = read_err.is_none();
        ep.peer_seg.atomic_u64(SLOTS_OFF + slot * SLOT_BYTES + 8).store(if ok { h.gen } else { h.gen | DONE_FAILED }, Ordering::Release);
        // A finished pull is not a ring record, which is all a sleeper re-checks: always
        // ring for it.
        ep.ring_peer_bell_always();
        if let Some(e) = read_err {
            return Err(Error::Transport {
                rank: self.rank,
                peer: Some(peer),
                transport: TransportKind::Shm,
                what: format!("single-copy read of {} bytes from pid {pid} failed: {e}", h.len),
            });
        }
        inbox.write_imm(peer, h.imm);
        Ok(true)
    }
}

impl BellWords for LocalShm {
    fn bell(&self) -> &AtomicU32 {
        LocalShm::bell(self)
    }
    fn sleeping(&self) -> &AtomicU32 {
        LocalShm::sleeping(self)
    }
}

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

impl Drop for LocalShm {
    fn drop(&mut self) {
        // Also on a failed setup (the descriptor would close with us anyway).
        self.withdraw();
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Rank 1's endpoint to rank 0, both segments in this process.
    fn pair() -> (Arc<LocalShm>, ShmEndpoint) {
        let ring = 1 << 16;
        let owner = Arc::new(LocalShm::create("ferroccl-test-last-words-0", 0, 2, ring).unwrap());
        let me = Arc::new(LocalShm::create("ferroccl-test-last-words-1", 1, 2, ring).unwrap());
        let pid = std::process::id() as i32;
        let ep = ShmEndpoint::connect(1, 0, pid, owner.fd().unwrap(), owner.name(), 2, ring, 4096, false, me).unwrap();
        (owner, ep)
    }

    #[test]
    fn last_words_are_read_by_a_peer_and_the_first_stay() {
        let (owner, ep) = pair();
        assert_eq!(ep.last_words(), None, "nothing left yet");
        assert!(!owner.leave_last_words(&vec![7u8; LAST_MAX + 1]), "too long: not left");
        assert!(!owner.leave_last_words(&[]), "empty: not left");
        assert_eq!(ep.last_words(), None);
        assert!(owner.leave_last_words(b"first"));
        assert!(!owner.leave_last_words(b"second"), "a rank gives up once");
        assert_eq!(ep.last_words().as_deref(), Some(&b"first"[..]));
    }
}
