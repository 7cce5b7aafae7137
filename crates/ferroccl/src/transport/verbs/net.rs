//! What verbs keeps for all its peers ([`VerbsNet`]): the device, the completion queue
//! polled every round, the peers' queue pairs and eager rings, the staging slots, and
//! the completion thread (waking, keepalives).

use super::*;

/// The remote side of one peer's eager ring.
#[derive(Debug, Clone, Copy)]
pub(super) struct RemoteRing {
    pub(super) addr: u64,
    pub(super) rkey: u32,
}

#[derive(Debug, Default)]
pub(super) struct PeerState {
    /// Messages posted to the peer.
    pub(super) sent: u64,
    /// Of those, how many completed locally (their send slot is free again).
    pub(super) msg_done: u64,
    /// How many of our messages the peer has consumed (credits it returned).
    pub(super) credits: u64,
    /// Messages consumed from the peer, and how many of those we have credited back.
    pub(super) consumed: u64,
    pub(super) returned: u64,
    /// Send work requests outstanding on the QP.
    pub(super) sq_used: u32,
    /// Set by `cut` or a failed completion: nothing more is posted.
    pub(super) dead: bool,
    /// The peer said goodbye: no keepalives any more.
    pub(super) bye: bool,
    /// `cut` waits until `msg_done` reaches this (the `ERR` it follows).
    pub(super) flush_until: u64,
}

#[derive(Debug)]
pub(super) struct Peer {
    pub(super) peer: usize,
    pub(super) qp: QueuePair<ReadyToSend>,
    pub(super) send_ring: MemoryRegion,
    pub(super) recv_ring: MemoryRegion,
    pub(super) remote: RemoteRing,
    pub(super) st: Mutex<PeerState>,
}

/// The process's verbs resources: device, protection domain, one completion queue, the
/// staging slots and every peer's queue pair and eager rings.
#[derive(Debug)]
pub(crate) struct VerbsNet {
    pub(super) rank: usize,
    pub(super) pd: ProtectionDomain,
    pub(super) cq: CompletionQueue,
    pub(super) stage: MemoryRegion,
    /// Bit i set: staging slot i is free.
    pub(super) stage_free: Mutex<u64>,
    pub(super) peers: Vec<Option<Peer>>,
    /// The memory regions that zero-copy writes in flight read from (after `peers`, so
    /// that the queue pairs are gone before they are deregistered).
    pub(super) direct: Mutex<DirectSlots>,
    /// The RDMA READs in flight (see [`ReadSlots`]).
    pub(super) reads: Mutex<ReadSlots>,
    /// Bytes written through the staging slots, and straight from windows' memory regions.
    pub(super) staged_bytes: AtomicU64,
    pub(super) direct_bytes: AtomicU64,
    /// Bytes read from peers' windows with RDMA READ.
    pub(super) read_bytes: AtomicU64,
    /// Bytes written into peers' windows with RDMA WRITE (see [`VerbsEndpoint::post_write_to`]).
    pub(super) window_write_bytes: AtomicU64,
    /// Completions polled in one go; preallocated so that polling does not allocate.
    pub(super) polled: Mutex<Vec<Completion>>,
    pub(super) credits_owed: AtomicBool,
    pub(super) inbox: Arc<Inbox>,
    /// The thread that sleeps on the completion channel and rings the fabric's doorbell.
    pub(super) waker_stop: Arc<AtomicBool>,
    pub(super) waker: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Drop for VerbsNet {
    fn drop(&mut self) {
        self.waker_stop.store(true, Ordering::Release);
        if let Some(h) = lock(&self.waker).take() {
            // The completion thread may hold the last reference for a moment (keepalive):
            // then it is the one dropping, and it ends by itself.
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }
}

/// Sleeps until the completion queue has news and then rings the fabric's doorbell, so a
/// waiter parked on it (the wait loop's last backoff stage) wakes for verbs completions as
/// it does for shm and tcp traffic. Arm, ring, sleep: a completion that arrived before the
/// arming is covered by the ring after it (the woken waiter polls the queue itself).
/// It also sends the keepalives, through a weak reference (the mesh owns the thread).
pub(super) fn wake_loop(
    chan: &ferroccl_verbs::CompletionChannel,
    cq: &CompletionQueue,
    inbox: &Inbox,
    stop: &AtomicBool,
    net: &std::sync::Weak<VerbsNet>,
) {
    let mut pinged = Instant::now();
    while !stop.load(Ordering::Acquire) {
        if cq.req_notify().is_err() {
            return;
        }
        inbox.notify();
        if chan.wait(cq, WAKER_NAP).is_err() {
            return;
        }
        if pinged.elapsed() >= PING_EVERY {
            pinged = Instant::now();
            match net.upgrade() {
                Some(n) => n.ping_idle(),
                None => return,
            }
        }
    }
}

impl VerbsNet {
    /// Posts a keepalive to every peer with nothing in flight (see the module docs).
    pub(super) fn ping_idle(&self) {
        for pe in self.peers.iter().flatten() {
            let mut st = lock(&pe.st);
            if st.dead || st.bye || st.sq_used > 0 {
                continue;
            }
            if post_ctrl(pe, IMM_CTRL | (KIND_PING << IMM_KIND_SHIFT)).is_ok() {
                st.sq_used += 1;
            }
        }
    }

    pub(super) fn peer(&self, p: usize) -> Result<&Peer> {
        self.peers
            .get(p)
            .and_then(|x| x.as_ref())
            .ok_or_else(|| Error::internal(format!("rank {}: no verbs queue pair to rank {p}", self.rank)))
    }

    pub(super) fn fail(&self, peer: usize, what: String) {
        if let Some(Some(pe)) = self.peers.get(peer) {
            lock(&pe.st).dead = true;
        }
        self.inbox.peer_failed(peer, what);
    }

    /// Drains the completion queue: lands messages, immediates, credits and goodbyes in
    /// the fabric's event state, frees slots whose sends completed. Returns whether
    /// anything happened. A failed completion fails its peer (the fabric's fatal state).
    pub(crate) fn poll(&self) -> Result<bool> {
        // One poller at a time; a thread that finds another polling has nothing to do.
        let Ok(mut out) = self.polled.try_lock() else { return Ok(false) };
        out.clear();
        let cap = out.capacity();
        let n = self.cq.poll(&mut out, cap).map_err(verr(self.rank, "poll the completion queue"))?;
        let mut delivered = false;
        for c in out.drain(..) {
            delivered |= self.complete(c);
        }
        drop(out);
        if self.credits_owed.swap(false, Ordering::AcqRel) {
            for pe in self.peers.iter().flatten() {
                self.return_credits(pe);
            }
        }
        if delivered {
            self.inbox.notify();
        }
        Ok(n > 0)
    }

    /// Keeps `mr` until the completion of the work request given the returned slot.
    pub(super) fn hold_direct(&self, mr: &Arc<UserMr>) -> u32 {
        let mut d = lock(&self.direct);
        match d.free.pop() {
            Some(i) => {
                d.slots[i as usize] = Some(mr.clone());
                i
            }
            None => {
                d.slots.push(Some(mr.clone()));
                (d.slots.len() - 1) as u32
            }
        }
    }

    /// Lets go of a zero-copy write's memory region (its completion was polled, or it was
    /// never posted). The last clone deregisters it, outside the lock.
    pub(super) fn release_direct(&self, slot: u32) {
        let mr = {
            let mut d = lock(&self.direct);
            let mr = d.slots.get_mut(slot as usize).and_then(Option::take);
            if mr.is_some() {
                d.free.push(slot);
            }
            mr
        };
        drop(mr);
    }

    /// Bytes one-sided writes have moved since setup: (copied through the staging slots,
    /// written straight from windows' memory regions).
    pub(crate) fn write_bytes(&self) -> (u64, u64) {
        (self.staged_bytes.load(Ordering::Relaxed), self.direct_bytes.load(Ordering::Relaxed))
    }

    /// Bytes this rank has read from peers' windows with RDMA READ since setup.
    pub(crate) fn read_bytes(&self) -> u64 {
        self.read_bytes.load(Ordering::Relaxed)
    }

    /// Bytes this rank has written into peers' windows with RDMA WRITE since setup.
    pub(crate) fn window_write_bytes(&self) -> u64 {
        self.window_write_bytes.load(Ordering::Relaxed)
    }

    /// The inbox the transport delivers into.
    pub(crate) fn inbox(&self) -> &Arc<Inbox> {
        &self.inbox
    }

    /// Keeps `h` until the completion of the RDMA READ given the returned slot.
    pub(super) fn hold_read(&self, h: ReadHold) -> u32 {
        let mut d = lock(&self.reads);
        match d.free.pop() {
            Some(i) => {
                d.slots[i as usize] = Some(h);
                i
            }
            None => {
                d.slots.push(Some(h));
                (d.slots.len() - 1) as u32
            }
        }
    }

    /// Takes an RDMA READ's hold out of its slot (its completion was polled, or it was
    /// never posted). The caller drops it outside the lock (the last clone of the target's
    /// memory region deregisters it).
    pub(super) fn take_read(&self, slot: u32) -> Option<ReadHold> {
        let mut d = lock(&self.reads);
        let h = d.slots.get_mut(slot as usize).and_then(Option::take);
        if h.is_some() {
            d.free.push(slot);
        }
        h
    }

    /// Handles one completion; returns whether an event was delivered.
    pub(super) fn complete(&self, c: Completion) -> bool {
        let (kind, p, extra) = wr_parts(c.wr_id);
        if kind == WR_DIRECT {
            // Failed or not, the device is done with the source.
            self.release_direct(extra);
        }
        // Failed or not, the device is done with the READ's target and the peer's region.
        let read_imm = match (kind == WR_READ).then(|| self.take_read(extra)).flatten() {
            Some(h) => {
                h.region.done(1);
                h.imm
            }
            None => None,
        };
        let Some(Some(pe)) = self.peers.get(p) else { return false };
        if kind != WR_RECV {
            let mut st = lock(&pe.st);
            st.sq_used = st.sq_used.saturating_sub(1);
            match kind {
                WR_MSG => st.msg_done += 1,
                WR_STAGE => {
                    drop(st);
                    *lock(&self.stage_free) |= 1u64 << extra;
                }
                _ => {}
            }
        }
        if !c.status.is_success() {
            let what = match kind {
                WR_RECV => "a receive",
                WR_MSG => "an RDMA WRITE WITH IMMEDIATE (message)",
                WR_STAGE | WR_DIRECT => "an RDMA WRITE (one-sided data)",
                WR_READ => "an RDMA READ or WRITE (of a window)",
                _ => "an RDMA WRITE WITH IMMEDIATE (control)",
            };
            self.fail(
                p,
                format!(
                    "is unreachable over verbs: {what} completed with {} (vendor error {:#x}; peer died or its queue pair is gone?)",
                    c.status, c.vendor_err
                ),
            );
            return true;
        }
        if let Some(imm) = read_imm {
            // A row of a read has landed here.
            self.inbox.write_imm(p, imm);
            return true;
        }
        if kind != WR_RECV {
            return false;
        }
        if let Err(e) = pe.qp.post_recv_empty(wr_id(WR_RECV, p, 0)) {
            self.fail(p, format!("could not be received from: ibv_post_recv failed: {e}"));
            return true;
        }
        let Some(imm) = c.imm.filter(|_| c.opcode == WcOpcode::RecvRdmaWithImm) else {
            self.fail(p, "sent a work request without an immediate".into());
            return true;
        };
        if imm & IMM_CTRL == 0 {
            self.inbox.write_imm(p, imm);
            return true;
        }
        let low = imm & IMM_LOW;
        match (imm & !IMM_CTRL) >> IMM_KIND_SHIFT {
            KIND_MSG => {
                let len = low as usize;
                let slot = {
                    let st = lock(&pe.st);
                    (st.consumed % SLOTS as u64) as usize
                };
                if len > SLOT_BYTES {
                    self.fail(p, format!("sent a {len}-byte message, over the {SLOT_BYTES}-byte slot"));
                    return true;
                }
                let mut msg = vec![0u8; len];
                pe.recv_ring.read(slot * SLOT_BYTES, &mut msg);
                {
                    let mut st = lock(&pe.st);
                    st.consumed += 1;
                }
                self.inbox.deliver_msg(p, msg);
                self.return_credits(pe);
            }
            KIND_CREDIT => lock(&pe.st).credits += u64::from(low),
            KIND_BYE => {
                lock(&pe.st).bye = true;
                self.inbox.peer_closed(p);
            }
            KIND_PING => {}
            k => self.fail(p, format!("sent an unknown verbs control kind {k}")),
        }
        true
    }

    /// Hands consumed slots back to the peer, in batches of `SLOTS / 2` (a sender that
    /// waits for credits has all `SLOTS` messages in flight, so every batch fills). If the
    /// send queue is full now, the next poll tries again.
    pub(super) fn return_credits(&self, pe: &Peer) {
        let mut st = lock(&pe.st);
        let owed = st.consumed - st.returned;
        if st.dead || owed < (SLOTS / 2) as u64 {
            return;
        }
        if st.sq_used >= SQ_DEPTH {
            self.credits_owed.store(true, Ordering::Release);
            return;
        }
        let imm = IMM_CTRL | (KIND_CREDIT << IMM_KIND_SHIFT) | (owed as u32 & IMM_LOW);
        match post_ctrl(pe, imm) {
            Ok(()) => {
                st.returned += owed;
                st.sq_used += 1;
            }
            Err(e) => {
                drop(st);
                self.fail(pe.peer, format!("could not be sent credits: {e}"));
            }
        }
    }

    /// Takes a free staging slot, polling while none is free.
    pub(super) fn take_stage(&self, peer: usize, deadline: Instant, poll: &dyn Fn() -> Result<()>) -> Result<u32> {
        let start = Instant::now();
        let mut backoff = Backoff::default();
        loop {
            {
                let mut free = lock(&self.stage_free);
                if *free != 0 {
                    let i = free.trailing_zeros();
                    *free &= !(1u64 << i);
                    return Ok(i);
                }
            }
            self.wait_round(peer, "verbs write (waiting for a staging slot)", start, deadline, &mut backoff, poll)?;
        }
    }

    /// One round of waiting for room (a credit, a send-queue entry, a staging slot): the
    /// caller's `poll` (our inbox, the peers' health), our completions, the deadline, then
    /// the backoff, parking on the doorbell that the completion thread rings.
    pub(super) fn wait_round(
        &self,
        peer: usize,
        op: &str,
        start: Instant,
        deadline: Instant,
        backoff: &mut Backoff,
        poll: &dyn Fn() -> Result<()>,
    ) -> Result<()> {
        let seen = self.inbox.bell_seen();
        poll()?;
        if self.poll()? {
            backoff.moved();
        }
        if Instant::now() >= deadline {
            return Err(Error::Timeout {
                rank: Some(self.rank),
                op: Op::other(op),
                after: start.elapsed(),
                waiting_for: vec![format!("rank {peer}")],
            });
        }
        backoff.idle(WAIT_NAP, Some(deadline), |until| self.inbox.sleep(seen, until, || false));
        Ok(())
    }
}

/// Posts a zero-length WRITE WITH IMMEDIATE carrying control information.
pub(super) fn post_ctrl(pe: &Peer, imm: u32) -> ferroccl_verbs::Result<()> {
    let target = RemoteSlice { addr: pe.remote.addr, len: 0, rkey: pe.remote.rkey };
    pe.qp.post_write_imm_empty(wr_id(WR_CTRL, pe.peer, 0), target, imm)
}

impl Net for Arc<VerbsNet> {
    /// Polls the completion queue: lands messages and immediates; a failed completion
    /// fails its peer.
    fn progress(&self, _inbox: &Inbox) -> Result<()> {
        self.poll().map(|_| ())
    }

    fn remote_memory(&self) -> Option<Arc<dyn RemoteMemory>> {
        Some(self.clone())
    }
}
