//! What shm keeps for all its peers ([`ShmNet`]): this rank's inbox segment
//! ([`LocalShm`]: the rings drained every round, the pull slots, the last words) and the
//! greeting that ends setup.

use super::*;

/// One connected shm peer, as [`ShmNet`] keeps it.
#[derive(Debug)]
pub(super) struct ShmPeer {
    pub(super) peer: usize,
    pub(super) ep: Arc<ShmEndpoint>,
    /// Whether we may pull from it (our hello says so).
    pub(super) can_pull: bool,
}

/// This rank's shm side once connected: the inbox segment it drains, and the peers that
/// produce into it (each greeted once at setup).
#[derive(Debug)]
pub(crate) struct ShmNet {
    pub(super) local: Arc<LocalShm>,
    pub(super) peers: Vec<ShmPeer>,
    /// Kept alive while a peer may still probe it.
    pub(super) _probe: Box<[u8; 64]>,
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
pub(super) struct LocalShm {
    pub(super) seg: Arc<ShmSegment>,
    pub(super) rank: usize,
    pub(super) ring_bytes: usize,
    /// Consumer positions, one per sender (only the polling thread touches them).
    pub(super) heads: Mutex<Vec<u64>>,
    pub(super) slots_used: Mutex<Vec<bool>>,
    pub(super) next_gen: AtomicU64,
    pub(super) withdrawn: AtomicBool,
}

impl LocalShm {
    pub(super) fn create(name: &str, rank: usize, world: usize, ring_bytes: usize) -> std::io::Result<LocalShm> {
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

    pub(super) fn name(&self) -> &str {
        self.seg.name()
    }

    /// The descriptor number peers open the segment through (`/proc/<pid>/fd/<fd>`), until
    /// [`LocalShm::withdraw`].
    pub(super) fn fd(&self) -> Option<i32> {
        self.seg.fd()
    }

    /// The doorbell word producers bump.
    pub(super) fn bell(&self) -> &AtomicU32 {
        self.seg.atomic_u32(BELL_OFF)
    }

    /// Set while the owner sleeps on the doorbell.
    pub(super) fn sleeping(&self) -> &AtomicU32 {
        self.seg.atomic_u32(SLEEPING_OFF)
    }

    /// Closes the descriptor peers open the segment through (the mappings stay); done once
    /// every peer mapped it.
    pub(super) fn withdraw(&self) {
        if !self.withdrawn.swap(true, Ordering::AcqRel) {
            self.seg.withdraw();
        }
    }

    pub(super) fn slot_gen(&self, slot: usize) -> &AtomicU64 {
        self.seg.atomic_u64(SLOTS_OFF + slot * SLOT_BYTES)
    }

    pub(super) fn slot_done(&self, slot: usize) -> &AtomicU64 {
        self.seg.atomic_u64(SLOTS_OFF + slot * SLOT_BYTES + 8)
    }

    /// See [`ShmNet::leave_last_words`]: the bytes, then their length published with
    /// Release (a reader that sees the length sees the bytes).
    pub(super) fn leave_last_words(&self, msg: &[u8]) -> bool {
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

    pub(super) fn alloc_slot(&self) -> Option<(usize, u64)> {
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
    pub(super) fn pull_status(&self, slot: usize, gen: u64) -> Option<std::result::Result<(), ()>> {
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
    pub(super) fn release_slot(&self, slot: usize) {
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
    pub(super) fn has_pending(&self) -> bool {
        fence(Ordering::SeqCst);
        let heads = self.heads.lock().unwrap_or_else(|e| e.into_inner());
        heads.iter().enumerate().any(|(p, &h)| self.seg.atomic_u64(ring_off(p, self.ring_bytes)).load(Ordering::SeqCst) != h)
    }

    /// Drains the ring of every sender in `peers` (world rank, endpoint), handing records to
    /// `inbox`. Returns whether anything was consumed.
    pub(super) fn drain<'e>(&self, peers: impl IntoIterator<Item = (usize, &'e ShmEndpoint)>, inbox: &Inbox) -> Result<bool> {
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
    pub(super) fn serve_pull(&self, peer: usize, ep: &ShmEndpoint, h: &Header, inbox: &Inbox) -> Result<bool> {
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

impl Drop for LocalShm {
    fn drop(&mut self) {
        // Also on a failed setup (the descriptor would close with us anyway).
        self.withdraw();
    }
}

impl Net for ShmNet {
    /// Drains every ring of our inbox (no allocation unless a message arrives).
    fn progress(&self, inbox: &Inbox) -> Result<()> {
        match self.drain(inbox) {
            // Something arrived: another thread of this process may be waiting for it.
            Ok(true) => inbox.notify(),
            Ok(false) => {}
            Err(e) => {
                inbox.lock().set_fault(crate::error::Fault::from_error(&e, &|r| r));
                return Err(e);
            }
        }
        Ok(())
    }

    fn greet(&self, deadline: Instant, poll: &dyn Fn() -> Result<()>) -> Result<()> {
        ShmNet::greet(self, deadline, poll)
    }

    fn ungreeted(&self) -> Vec<usize> {
        ShmNet::ungreeted(self)
    }

    fn local_peers(&self) -> Vec<usize> {
        self.peers()
    }

    fn withdraw(&self) {
        ShmNet::withdraw(self);
    }

    fn has_pending(&self) -> bool {
        ShmNet::has_pending(self)
    }

    fn leave_last_words(&self, msg: &[u8]) {
        ShmNet::leave_last_words(self, msg);
    }

    fn last_words(&self, which: &dyn Fn(usize) -> bool) -> Option<(usize, Vec<u8>)> {
        ShmNet::last_words(self, which)
    }
}
