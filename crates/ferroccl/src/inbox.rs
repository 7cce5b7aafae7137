//! The inbox: what transports deliver into, below them all. Messages, clear-to-sends,
//! write-with-immediate completions, goodbyes, peers' reports (`ERR`, `LEAVE`, `AGREED`,
//! probes) and broken connections land here as [`Events`], under one mutex, and ring the
//! doorbell; writes land in the registered regions it holds. Whoever waits (the engine's
//! driver, a setup or shutdown wait) matches them. Also here: the doorbell itself and the
//! one [`Backoff`] every wait loop uses, and the pool of message buffers.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use ferroccl_mem::futex::{futex_wait, futex_wake};
use ferroccl_mem::region::RegionHandle;

use crate::error::{Error, Fault, FaultKind, Result};
use crate::proto::{self, Cts, Leave, ProtoMsg, RmaStatus, RmaTarget, StreamKey};
use crate::transport_kind::TransportKind;
use crate::wire::RemoteBuf;

/// An eager message waiting to be received.
#[derive(Debug)]
pub(crate) struct Incoming {
    pub(crate) seq: u32,
    /// The sender's call number (0 for point-to-point).
    pub(crate) call: u32,
    pub(crate) desc: proto::Desc,
    pub(crate) data: Vec<u8>,
    /// `Some(len)` for a rendezvous sender's ready-to-send (no data).
    pub(crate) rts: Option<u64>,
}

/// Everything transports report, waiting to be matched by a caller.
#[derive(Debug, Default)]
pub(crate) struct Events {
    pub(crate) data: HashMap<StreamKey, VecDeque<Incoming>>,
    pub(crate) cts: HashMap<StreamKey, VecDeque<Cts>>,
    pub(crate) imms: HashSet<(usize, u32)>,
    /// The fatal faults, in the order they became known, each with what it makes unusable
    /// (see [`Scope`]): a communicator's calls fail with the first one that reaches it (an
    /// abort first).
    pub(crate) faults: Vec<Scoped>,
    /// Each split communicator's parent (by id): an abort reaches the aborted
    /// communicator's descendants.
    pub(crate) parents: HashMap<u32, u32>,
    /// Peers that said goodbye.
    pub(crate) closed: HashSet<usize>,
    /// Where peers stopped on communicators they left: (communicator id, peer world
    /// rank) -> its `LEAVE` record.
    pub(crate) left: HashMap<(u32, usize), Leave>,
    /// (communicator, world rank) of every member whose `AGREED` arrived (finalize's
    /// second round).
    pub(crate) agreed: HashSet<(u32, usize)>,
    /// Probes from peers, not yet answered: (peer world rank, communicator id, call
    /// number, descriptor). At most [`MAX_PROBES`]; more are dropped (peers probe again).
    pub(crate) probes: Vec<(usize, u32, u32, proto::Desc)>,
    /// Raised with the first of `faults`, readable without the lock (the driver looks
    /// every round; only then does a call look for a fault that reaches it).
    pub(crate) fatal_flag: Arc<AtomicBool>,
    /// Connections that broke without a reason (peer, what, when), not yet fatal: a
    /// peer that gives up because a third rank died closes its connections right after
    /// telling us why, and its close can overtake the reason (or the reason was skipped).
    /// So a broken connection becomes the fatal error only after [`SUSPECT_GRACE`], unless
    /// a reported cause (an `ERR`, a watched process's death) comes first; and then the
    /// earliest one.
    pub(crate) suspects: Vec<(usize, String, Instant)>,
    /// One-sided requests for this rank's windows, not yet served: (requester world
    /// rank, request), in arrival order (a requester has at most its transfers in flight
    /// here, and the server takes them all every round).
    pub(crate) rma_requests: VecDeque<(usize, RmaRequest)>,
    /// The owners' answers to this rank's one-sided requests: (owner world rank, request
    /// number) -> status.
    pub(crate) rma_replies: HashMap<(usize, u64), RmaStatus>,
    /// The last value each peer (world rank) signalled this rank on each slot
    /// (`put_signal`, `signal`: slot 0; library objects own other slots).
    pub(crate) signals: HashMap<(usize, u32), u64>,
    /// The owners' answers to this rank's `WINFO` requests: (owner world rank, request
    /// number) -> (status, the window's verbs memory region if it has one).
    pub(crate) win_infos: HashMap<(usize, u64), (RmaStatus, Option<proto::RegionInfo>)>,
    /// `REVOKED` answers from holders of this rank's windows: (holder, window, key).
    pub(crate) revoked: HashSet<(usize, u32, u64)>,
}

/// What a fatal fault makes unusable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scope {
    /// Everything on the fabric: this rank's own failure (a transport failed as a whole,
    /// it panicked), or the launcher exited.
    Fabric,
    /// Every communicator with this member (a world rank): it died, its connection broke
    /// or carried garbage, its whole fabric failed, or it gave up on this rank.
    Peer(usize),
    /// This communicator (by id): a call on it timed out, was made differently by its
    /// members, or lost a member that left it; for an abort, also every communicator split
    /// from it (from the world, id 0: everything).
    Comm(u32),
}

/// A fatal fault and its scope.
#[derive(Debug)]
pub(crate) struct Scoped {
    pub(crate) scope: Scope,
    pub(crate) fault: Fault,
    /// The error that made the fault, when this rank found it (later calls keep it in
    /// [`Error::Poisoned`]).
    pub(crate) first: Option<Error>,
    /// Whether the peers it concerns were told (see `Health::tell`).
    pub(crate) told: bool,
}

/// A communicator as the fault scopes see it: its id and its members' world ranks.
/// `None` where a view is taken stands for the whole fabric (every fault reaches it).
#[derive(Debug, Clone, Copy)]
pub(crate) struct View<'a> {
    pub(crate) comm: u32,
    pub(crate) members: &'a [usize],
}

impl View<'static> {
    /// No communicator: what the window server and other fabric-wide work see, reached
    /// only by the fabric's own failure and an abort of the world.
    pub(crate) const NONE: View<'static> = View { comm: u32::MAX, members: &[] };
}

/// A one-sided request from a peer (see [`ProtoMsg::Get`], [`ProtoMsg::Put`]).
#[derive(Debug)]
pub(crate) enum RmaRequest {
    /// Write `target`'s range of the window into `buf` with immediate `imm`.
    Get { target: RmaTarget, buf: RemoteBuf, imm: u32, shape: proto::GetShape },
    /// Land `data` in `target`'s range of the window.
    Put { target: RmaTarget, data: Vec<u8> },
    /// Raise the requester's signal on `slot` to `value`.
    Signal { req: u64, slot: u32, value: u64 },
    /// Give the requester the window's verbs memory region (and make it a holder).
    Info { target: RmaTarget },
    /// The owner (the requester) drops its window (`window`, `key`): stop reading it.
    Revoke { window: u32, key: u64 },
}

/// Probes kept for the engine at most.
const MAX_PROBES: usize = 256;

/// How long a connection that broke without a reason waits for a better explanation.
pub(crate) const SUSPECT_GRACE: Duration = Duration::from_millis(100);

impl Events {
    /// `peer` (world rank) told this rank (`me`) why it gives up (an `ERR`) on
    /// communicator `comm`, or (`None`) on a peer or on everything.
    fn peer_gave_up(&mut self, me: usize, peer: usize, mut f: Fault, comm: Option<u32>) {
        // A report carries the rank that found the fault; a peer that relays one keeps
        // it. Never trust a report to speak for this rank.
        if f.reporter.is_none_or(|r| r == me) {
            f.reporter = Some(peer);
        }
        let scope = match (comm, f.kind, f.culprit) {
            (Some(c), ..) => Scope::Comm(c),
            // News of a third rank's death or lost connection.
            (None, FaultKind::Failed, Some(c)) if c != me => Scope::Peer(c),
            // It gave up on this rank, or its whole fabric failed: it is gone for every
            // communicator it is in.
            (None, ..) => Scope::Peer(peer),
        };
        self.add(scope, f, None);
    }

    /// Records fault `f` with `scope` (`first`: the error of this rank's that made it),
    /// unless a fault of that scope is known already (an abort is kept next to another
    /// fault). The index of the scope's entry, and whether it is new.
    pub(crate) fn add(&mut self, scope: Scope, f: Fault, first: Option<Error>) -> (usize, bool) {
        let aborted = f.kind == FaultKind::Aborted;
        if let Some(i) = self.faults.iter().position(|s| s.scope == scope && (s.fault.kind == FaultKind::Aborted) == aborted) {
            return (i, false);
        }
        self.faults.push(Scoped { scope, fault: f, first, told: false });
        self.fatal_flag.store(true, Ordering::SeqCst);
        (self.faults.len() - 1, true)
    }

    /// Makes world rank `peer` dead for every communicator it is in (a failure found by
    /// this rank: `what`).
    pub(crate) fn set_fatal(&mut self, peer: usize, what: String) {
        let f = Fault { kind: FaultKind::Failed, culprit: Some(peer), reporter: None, op: String::new(), what };
        self.add(Scope::Peer(peer), f, None);
    }

    /// Makes `f` fatal for the whole fabric.
    pub(crate) fn set_fault(&mut self, f: Fault) {
        self.set_fault_from(f, None);
    }

    /// [`Events::set_fault`], keeping `first`, the error of this rank's that made `f`.
    pub(crate) fn set_fault_from(&mut self, f: Fault, first: Option<Error>) {
        self.add(Scope::Fabric, f, first);
    }

    /// Whether the whole fabric is failed or aborted (a fault of scope `Fabric`, or an
    /// abort of the world).
    pub(crate) fn all_failed(&self) -> bool {
        self.faults.iter().any(|s| s.scope == Scope::Fabric || (s.scope == Scope::Comm(0) && s.fault.kind == FaultKind::Aborted))
    }

    /// Whether world rank `peer` is known dead or gone (a fault of scope `Peer(peer)`).
    pub(crate) fn is_dead(&self, peer: usize) -> bool {
        self.faults.iter().any(|s| s.scope == Scope::Peer(peer))
    }

    /// Whether communicator `comm` was split, at any depth, from `ancestor` (every one
    /// from the world, id 0).
    fn descends(&self, comm: u32, ancestor: u32) -> bool {
        if ancestor == 0 {
            return true;
        }
        let mut id = comm;
        // Bounded: ids are hashes, and a cycle must not hang a call.
        for _ in 0..64 {
            match self.parents.get(&id) {
                Some(&p) if p == ancestor => return true,
                Some(&p) => id = p,
                None => return false,
            }
        }
        false
    }

    /// Whether fault `s` reaches communicator `view` (`None`: the whole fabric, which
    /// every fault reaches).
    pub(crate) fn reaches(&self, s: &Scoped, view: Option<View<'_>>) -> bool {
        let Some(v) = view else { return true };
        match s.scope {
            Scope::Fabric => true,
            Scope::Peer(p) => v.members.contains(&p),
            Scope::Comm(c) => c == v.comm || (s.fault.kind == FaultKind::Aborted && self.descends(v.comm, c)),
        }
    }

    /// The index of the fault that fails calls on `view`: the first abort that reaches it,
    /// else the first fault that does.
    pub(crate) fn fault_for(&self, view: Option<View<'_>>) -> Option<usize> {
        let hits = |s: &&Scoped| self.reaches(s, view);
        let abort = self.faults.iter().position(|s| s.fault.kind == FaultKind::Aborted && hits(&s));
        abort.or_else(|| self.faults.iter().position(|s| hits(&s)))
    }
}

/// The two futex words of a doorbell that lives in shared memory (an shm inbox segment, so
/// that peers on this host can ring it): implemented by the shm transport.
pub(crate) trait BellWords: Send + Sync {
    /// The word producers bump.
    fn bell(&self) -> &AtomicU32;
    /// How many threads sleep on it (producers ring only when some do).
    fn sleeping(&self) -> &AtomicU32;
}

/// Where the doorbell's words live: in a shared-memory segment (peers ring it), or on the
/// heap (only this process's threads do).
pub(crate) enum Bell {
    Mapped(Arc<dyn BellWords>),
    Heap(AtomicU32, AtomicU32),
}

impl std::fmt::Debug for Bell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Bell::Mapped(_) => "Bell::Mapped",
            Bell::Heap(..) => "Bell::Heap",
        })
    }
}

impl Bell {
    /// A doorbell only this process rings.
    pub(crate) fn heap() -> Bell {
        Bell::Heap(AtomicU32::new(0), AtomicU32::new(0))
    }
    fn word(&self) -> &AtomicU32 {
        match self {
            Bell::Mapped(s) => s.bell(),
            Bell::Heap(w, _) => w,
        }
    }
    fn sleeping(&self) -> &AtomicU32 {
        match self {
            Bell::Mapped(s) => s.sleeping(),
            Bell::Heap(_, s) => s,
        }
    }
}

/// Rounds an idle wait spins, then yields, before it parks.
const SPINS: u32 = 64;
const YIELDS: u32 = 32;

/// The one backoff of every wait loop (the engine's driver, the fabric's setup and
/// shutdown waits, a transport waiting for room): spin, then yield, then park (on the
/// doorbell, or a short nap where nothing rings it), never past the wait's deadline. After
/// a park it spins again only briefly: a waiter that has slept is likely to sleep again.
#[derive(Debug, Default)]
pub(crate) struct Backoff {
    idle: u32,
    /// Yield at once instead of spinning (the CPUs are shared with the ranks waited for).
    no_spin: bool,
}

impl Backoff {
    /// A backoff that spins first, or (`shared_cpus`) yields from the start.
    pub(crate) fn new(shared_cpus: bool) -> Backoff {
        Backoff { idle: if shared_cpus { SPINS } else { 0 }, no_spin: shared_cpus }
    }

    /// Something moved: spin again.
    pub(crate) fn moved(&mut self) {
        self.idle = if self.no_spin { SPINS } else { 0 };
    }

    /// Whether the wait has stopped spinning (it yields or parks): a loop that reads the
    /// clock only every few busy rounds reads it on every such round.
    pub(crate) fn is_slow(&self) -> bool {
        self.idle >= SPINS
    }

    /// One idle round: spin, yield, or `park(until)`, where `until` is `nap` from now or
    /// the wait's `deadline`, whichever comes first; `park` must return by then.
    pub(crate) fn idle(&mut self, nap: Duration, deadline: Option<Instant>, park: impl FnOnce(Instant)) {
        self.idle += 1;
        if self.idle < SPINS {
            std::hint::spin_loop();
        } else if self.idle < SPINS + YIELDS {
            std::thread::yield_now();
        } else {
            let cap = Instant::now() + nap;
            park(deadline.map_or(cap, |d| d.min(cap)));
            self.idle = if self.no_spin { SPINS } else { SPINS / 2 };
        }
    }
}

/// What transports deliver into: the event state, the doorbell, the message buffer pool
/// and the table of registered regions that one-sided writes land in. Shared by the
/// fabric and every transport's background thread.
#[derive(Debug)]
pub(crate) struct Inbox {
    rank: usize,
    pub(crate) events: Mutex<Events>,
    /// Registered regions by key: where one-sided writes land (see `registry`).
    pub(crate) regions: RwLock<HashMap<u64, RegionHandle>>,
    bell: Bell,
    fatal_flag: Arc<AtomicBool>,
    /// Raised when the first `LEAVE` arrives: until then a send need not look for one.
    any_left: AtomicBool,
    /// Raised while probes wait in [`Events::probes`].
    any_probe: AtomicBool,
    /// Raised when a one-sided request arrives (the window server looks every round).
    any_rma: AtomicBool,
    /// Collective-channel messages (data and ready-to-sends) waiting in [`Events::data`]:
    /// while none wait, a collective that finishes has left nothing of its peers' behind
    /// (see `XferCtx::left_over`).
    coll_backlog: AtomicUsize,
    /// Message buffers for reuse, so that receiving an eager message allocates nothing once
    /// the pool is warm.
    bufs: Mutex<Vec<Vec<u8>>>,
}

/// Message buffers kept for reuse at most, and the largest kept.
const BUF_POOL: usize = 64;
const BUF_POOL_MAX_BYTES: usize = 1 << 20;
/// Every pooled buffer holds at least this much, and the pool starts with
/// [`BUF_POOL_START`] of them: messages up to this size (every control message, small
/// eager data) find a buffer even when several wait to be matched at once.
const BUF_MIN_BYTES: usize = 16 << 10;
const BUF_POOL_START: usize = 8;

impl Inbox {
    /// An empty inbox for `rank`, ringing `bell`.
    pub(crate) fn new(rank: usize, bell: Bell) -> Inbox {
        let fatal_flag = Arc::new(AtomicBool::new(false));
        Inbox {
            rank,
            events: Mutex::new(Events { fatal_flag: fatal_flag.clone(), ..Events::default() }),
            fatal_flag,
            any_left: AtomicBool::new(false),
            any_probe: AtomicBool::new(false),
            any_rma: AtomicBool::new(false),
            coll_backlog: AtomicUsize::new(0),
            regions: RwLock::new(HashMap::new()),
            bell,
            bufs: Mutex::new((0..BUF_POOL_START).map(|_| Vec::with_capacity(BUF_MIN_BYTES)).collect()),
        }
    }

    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, Events> {
        self.events.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wakes a waiter of this process (used by in-process producers: tcp reader threads).
    pub(crate) fn notify(&self) {
        self.bell.word().fetch_add(1, Ordering::SeqCst);
        if self.bell.sleeping().load(Ordering::SeqCst) != 0 {
            let _ = futex_wake(self.bell.word(), i32::MAX as u32);
        }
    }

    /// Whether the fabric has a fatal error (or was aborted); no lock.
    pub(crate) fn has_fatal(&self) -> bool {
        self.fatal_flag.load(Ordering::SeqCst)
    }

    /// The doorbell's current value: read it before looking for work, then sleep with
    /// [`Inbox::sleep`] only if it has not moved.
    pub(crate) fn bell_seen(&self) -> u32 {
        self.bell.word().load(Ordering::SeqCst)
    }

    /// Sleeps until the doorbell moves past `seen`, or until `until`. `pending` is looked at
    /// once this thread is counted as sleeping (shm peers ring only for sleepers): when it
    /// says there is work, the sleep is skipped.
    pub(crate) fn sleep(&self, seen: u32, until: Instant, pending: impl FnOnce() -> bool) {
        let bell = &self.bell;
        bell.sleeping().fetch_add(1, Ordering::SeqCst);
        let nap = until.saturating_duration_since(Instant::now());
        if !nap.is_zero() && !pending() {
            let _ = futex_wait(bell.word(), seen, Some(nap));
        }
        bell.sleeping().fetch_sub(1, Ordering::SeqCst);
    }

    /// A buffer of `len` bytes for an incoming message (from the pool when one fits).
    pub(crate) fn take_buf(&self, len: usize) -> Vec<u8> {
        let mut pool = self.bufs.lock().unwrap_or_else(|e| e.into_inner());
        // The smallest that fits, so that small messages do not take the large buffers.
        let best = pool.iter().enumerate().filter(|(_, b)| b.capacity() >= len).min_by_key(|(_, b)| b.capacity()).map(|(i, _)| i);
        let mut v = match best {
            Some(i) => pool.swap_remove(i),
            None => Vec::with_capacity(len.max(BUF_MIN_BYTES)),
        };
        drop(pool);
        v.clear();
        v.resize(len, 0);
        v
    }

    /// Gives a message buffer back for reuse.
    pub(crate) fn give_buf(&self, v: Vec<u8>) {
        if v.capacity() < BUF_MIN_BYTES || v.capacity() > BUF_POOL_MAX_BYTES {
            return;
        }
        let mut pool = self.bufs.lock().unwrap_or_else(|e| e.into_inner());
        if pool.len() < BUF_POOL {
            pool.push(v);
        }
    }

    /// `peer`'s last words (an shm peer's `ERR`, read from its segment): taken as that
    /// `ERR`; anything else there is ignored. Returns whether they were an `ERR`.
    pub(crate) fn deliver_last_words(&self, peer: usize, bytes: Vec<u8>) -> bool {
        let Ok((ProtoMsg::Err(f, comm), _)) = proto::decode_keep(bytes) else { return false };
        self.lock().peer_gave_up(self.rank, peer, f, comm);
        self.notify();
        true
    }

    /// `n` messages on channel `chan` arrived (`n > 0`) or were taken (`n < 0`): counted
    /// for the collective channel (see [`Inbox::coll_backlog`]). Called under the event lock.
    pub(crate) fn count_coll(&self, chan: u8, n: isize) {
        if chan == proto::CHAN_COLL {
            if n >= 0 {
                self.coll_backlog.fetch_add(n.unsigned_abs(), Ordering::Relaxed);
            } else {
                self.coll_backlog.fetch_sub(n.unsigned_abs(), Ordering::Relaxed);
            }
        }
    }

    /// Collective-channel messages waiting to be matched (any communicator).
    pub(crate) fn coll_backlog(&self) -> usize {
        self.coll_backlog.load(Ordering::Relaxed)
    }

    /// A two-sided message arrived from `peer`.
    pub(crate) fn deliver_msg(&self, peer: usize, bytes: Vec<u8>) {
        let decoded = match proto::decode_keep(bytes) {
            Ok((m, spare)) => {
                if let Some(v) = spare {
                    self.give_buf(v);
                }
                Ok(m)
            }
            Err(e) => Err(e),
        };
        let mut ev = self.lock();
        match decoded {
            Ok(ProtoMsg::Eager { comm, chan, seq, call, desc, data }) => {
                self.count_coll(chan, 1);
                ev.data.entry((comm, chan, peer)).or_default().push_back(Incoming { seq, call, desc, data, rts: None })
            }
            Ok(ProtoMsg::Cts { comm, chan, cts }) => ev.cts.entry((comm, chan, peer)).or_default().push_back(cts),
            Ok(ProtoMsg::Rts { comm, chan, seq, call, desc, len }) => {
                self.count_coll(chan, 1);
                ev.data.entry((comm, chan, peer)).or_default().push_back(Incoming { seq, call, desc, data: Vec::new(), rts: Some(len) })
            }
            Ok(ProtoMsg::Err(f, comm)) => ev.peer_gave_up(self.rank, peer, f, comm),
            Ok(ProtoMsg::Leave { comm, leave }) => {
                ev.left.insert((comm, peer), leave);
                self.any_left.store(true, Ordering::Release);
            }
            Ok(ProtoMsg::Agreed { comm }) => {
                ev.agreed.insert((comm, peer));
            }
            Ok(ProtoMsg::Probe { comm, call, desc }) => {
                if ev.probes.len() < MAX_PROBES {
                    ev.probes.push((peer, comm, call, desc));
                    self.any_probe.store(true, Ordering::Release);
                }
            }
            Ok(ProtoMsg::Get { target, buf, imm, rows, row, src_stride, dst_stride }) => {
                let shape = proto::GetShape { rows, row, src_stride, dst_stride };
                ev.rma_requests.push_back((peer, RmaRequest::Get { target, buf, imm, shape }));
                self.any_rma.store(true, Ordering::Release);
            }
            Ok(ProtoMsg::Put { target, data }) => {
                ev.rma_requests.push_back((peer, RmaRequest::Put { target, data }));
                self.any_rma.store(true, Ordering::Release);
            }
            Ok(ProtoMsg::Signal { req, slot, value }) => {
                ev.rma_requests.push_back((peer, RmaRequest::Signal { req, slot, value }));
                self.any_rma.store(true, Ordering::Release);
            }
            Ok(ProtoMsg::Reply { req, status }) => {
                ev.rma_replies.insert((peer, req), status);
            }
            Ok(ProtoMsg::WinInfo { target }) => {
                ev.rma_requests.push_back((peer, RmaRequest::Info { target }));
                self.any_rma.store(true, Ordering::Release);
            }
            Ok(ProtoMsg::WinInfoReply { req, status, region }) => {
                ev.win_infos.insert((peer, req), (status, region));
            }
            Ok(ProtoMsg::Revoke { window, key }) => {
                ev.rma_requests.push_back((peer, RmaRequest::Revoke { window, key }));
                self.any_rma.store(true, Ordering::Release);
            }
            Ok(ProtoMsg::Revoked { window, key }) => {
                ev.revoked.insert((peer, window, key));
            }
            Err(e) => ev.set_fatal(peer, format!("sent a malformed message: {e}")),
        }
    }

    /// The probes that arrived since the last call (see [`ProtoMsg::Probe`]); no lock when
    /// there are none.
    pub(crate) fn take_probes(&self) -> Vec<(usize, u32, u32, proto::Desc)> {
        if !self.any_probe.swap(false, Ordering::AcqRel) {
            return Vec::new();
        }
        std::mem::take(&mut self.lock().probes)
    }

    /// Moves the one-sided requests that arrived since the last call into `into` (empty,
    /// its capacity kept: the server reuses it), oldest first; no lock when there are none.
    pub(crate) fn take_rma_requests(&self, into: &mut VecDeque<(usize, RmaRequest)>) {
        if self.any_rma.swap(false, Ordering::AcqRel) {
            std::mem::swap(&mut self.lock().rma_requests, into);
        }
    }

    /// Whether one-sided requests have arrived that nobody has taken yet; no lock.
    pub(crate) fn rma_pending(&self) -> bool {
        self.any_rma.load(Ordering::Acquire)
    }

    /// Whether any peer has left a communicator (a `LEAVE` arrived); no lock.
    pub(crate) fn any_left(&self) -> bool {
        self.any_left.load(Ordering::Acquire)
    }

    /// Lands `len` bytes of a one-sided write at `addr` in registration `key`, using `fill`
    /// to produce them straight into the registered memory. `via` is the transport that
    /// carried it (named in the error when the write is refused).
    pub(crate) fn land_write(
        &self,
        via: TransportKind,
        peer: usize,
        key: u64,
        addr: u64,
        len: usize,
        fill: impl FnOnce(&mut [u8]) -> std::result::Result<(), String>,
    ) -> Result<()> {
        let region = self.regions.read().unwrap_or_else(|e| e.into_inner()).get(&key).cloned();
        let fail = |what: String| {
            let e = Error::Transport { rank: self.rank, peer: Some(peer), transport: via, what: what.clone() };
            self.lock().set_fatal(peer, what);
            e
        };
        let Some(region) = region else {
            return Err(fail(format!("wrote into registration {key:#x}, which is not (or no longer) registered")));
        };
        let off = addr.checked_sub(region.addr()).and_then(|o| usize::try_from(o).ok());
        let Some(off) = off.filter(|&o| o.checked_add(len).is_some_and(|e| e <= region.len())) else {
            return Err(fail(format!("wrote {len} bytes at {addr:#x}, outside registration {key:#x}")));
        };
        match region.with_slice_mut(off, len, fill) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(what)) => Err(fail(what)),
            Err(e) => Err(fail(format!("its write into registration {key:#x} failed: {e}"))),
        }
    }

    /// A write with immediate `imm` from `peer` has fully landed.
    pub(crate) fn write_imm(&self, peer: usize, imm: u32) {
        self.lock().imms.insert((peer, imm));
    }

    /// The rows of a strided write from `peer` have fully landed: immediates
    /// `row_imm(imm, 0..rows)`, under one lock.
    pub(crate) fn write_imms(&self, peer: usize, imm: u32, rows: u32) {
        let mut ev = self.lock();
        for r in 0..rows {
            ev.imms.insert((peer, row_imm(imm, r)));
        }
    }

    /// `peer` said goodbye.
    pub(crate) fn peer_closed(&self, peer: usize) {
        self.lock().closed.insert(peer);
    }

    /// `peer`'s connection broke (a suspect until [`SUSPECT_GRACE`] passes: see
    /// [`Events::suspects`]).
    pub(crate) fn peer_failed(&self, peer: usize, reason: String) {
        let mut ev = self.lock();
        if !ev.closed.contains(&peer) && !ev.all_failed() && !ev.is_dead(peer) && !ev.suspects.iter().any(|s| s.0 == peer) {
            ev.suspects.push((peer, reason, Instant::now()));
        }
        drop(ev);
        self.notify();
    }

    /// Makes the earliest suspect dead once it is [`SUSPECT_GRACE`] old (unless a reason
    /// for it, or the fabric's failure, came meanwhile).
    pub(crate) fn promote_suspects(&self, now: Instant) {
        let mut ev = self.lock();
        if ev.suspects.is_empty() {
            return;
        }
        if ev.all_failed() {
            ev.suspects.clear();
            return;
        }
        let Some(i) = ev.suspects.iter().enumerate().min_by_key(|s| s.1 .2).map(|s| s.0) else { return };
        if now.saturating_duration_since(ev.suspects[i].2) >= SUSPECT_GRACE {
            let (peer, what, _) = ev.suspects.remove(i);
            // A connection that broke because its peer gave up on this rank (it said why,
            // or a third rank's news explains it) or closed it is no new fault.
            if !ev.is_dead(peer) && !ev.closed.contains(&peer) {
                ev.set_fatal(peer, what);
                drop(ev);
                self.notify();
            }
        }
    }

    /// The root cause to report for a connection that broke under a write: a reported
    /// cause if there is one; else, if connections broke without a reason, the earliest of
    /// them once its grace has passed (a reported cause may still arrive meanwhile; at most
    /// until `until`); else `None` at once.
    pub(crate) fn root_cause(&self, until: Instant) -> Option<Fault> {
        loop {
            let now = Instant::now();
            self.promote_suspects(now);
            let ev = self.lock();
            if let Some(s) = ev.faults.iter().find(|s| s.fault.culprit.is_some() || s.fault.reporter.is_some()) {
                return Some(s.fault.clone());
            }
            let earliest = ev.suspects.iter().min_by_key(|s| s.2)?;
            if now >= until {
                let (culprit, what) = (Some(earliest.0), earliest.1.clone());
                return Some(Fault { kind: FaultKind::Failed, culprit, reporter: None, op: String::new(), what });
            }
            drop(ev);
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

/// The immediate of row `r` of a read whose first row's is `imm` (each row of a strided
/// read lands with its own; tcp sends all rows in one frame and reports them all).
pub(crate) fn row_imm(imm: u32, r: u32) -> u32 {
    imm.wrapping_add(r) & 0x7fff_ffff
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fault(kind: FaultKind, culprit: Option<usize>) -> Fault {
        Fault { kind, culprit, reporter: None, op: "allreduce".into(), what: "x".into() }
    }

    /// Each scope reaches exactly the communicators it must: a dead peer those with it, a
    /// communicator's own fault that one only, an abort the communicator and those split
    /// from it (at any depth) but not its parent, the world's abort and this rank's own
    /// failure everything; an abort wins over an earlier fault.
    #[test]
    fn faults_reach_the_communicators_of_their_scope() {
        const WORLD: [usize; 4] = [0, 1, 2, 3];
        let world = &WORLD;
        let view = |comm, members: &'static [usize]| Some(View { comm, members });
        let mut ev = Events::default();
        // 10 and 11 split from the world, 12 from 10.
        ev.parents.extend([(10, 0), (11, 0), (12, 10)]);
        assert_eq!(ev.fault_for(view(0, world)), None);
        assert_eq!(ev.add(Scope::Peer(3), fault(FaultKind::Failed, Some(3)), None), (0, true));
        assert_eq!(ev.add(Scope::Peer(3), fault(FaultKind::Failed, Some(3)), None), (0, false), "one fault per scope");
        assert_eq!(ev.fault_for(view(0, world)), Some(0));
        assert_eq!(ev.fault_for(view(11, &[2, 3])), Some(0));
        assert_eq!(ev.fault_for(view(10, &[0, 1])), None, "no member died");
        assert!(ev.is_dead(3) && !ev.is_dead(2) && !ev.all_failed());
        // A communicator's own fault (not an abort): that communicator only.
        ev.add(Scope::Comm(10), fault(FaultKind::Mismatch, Some(1)), None);
        assert_eq!(ev.fault_for(view(10, &[0, 1])), Some(1));
        assert_eq!(ev.fault_for(view(12, &[0, 1])), None, "a mismatch in the parent leaves the child");
        // An abort of 10: 10 and 12, not the world, not 11; and it wins over the mismatch.
        ev.add(Scope::Comm(10), fault(FaultKind::Aborted, None), None);
        assert_eq!(ev.fault_for(view(10, &[0, 1])), Some(2));
        assert_eq!(ev.fault_for(view(12, &[0, 1])), Some(2));
        assert_eq!(ev.fault_for(view(0, world)), Some(0));
        let mut only = Events::default();
        only.parents.extend([(10, 0), (12, 10)]);
        only.add(Scope::Comm(12), fault(FaultKind::Aborted, None), None);
        assert_eq!(only.fault_for(view(10, &[0, 1])), None, "a child's abort leaves its parent");
        assert_eq!(only.fault_for(view(0, world)), None);
        // The world's abort, or this rank's own failure: everything.
        only.add(Scope::Comm(0), fault(FaultKind::Aborted, None), None);
        assert!(only.all_failed());
        assert_eq!(only.fault_for(view(10, &[0, 1])), Some(1));
        let mut own = Events::default();
        own.add(Scope::Fabric, fault(FaultKind::Internal, Some(0)), None);
        assert!(own.all_failed());
        assert_eq!(own.fault_for(view(77, &[5])), Some(0));
        assert_eq!(own.fault_for(Some(View::NONE)), Some(0));
        // The window server's view: only the fabric's failure or the world's abort.
        assert_eq!(ev.fault_for(Some(View::NONE)), None);
    }

    /// An `ERR` scoped to a communicator fails that communicator; an unscoped one is news
    /// of a third rank's death, or says its sender is gone (it gave up on this rank, or on
    /// everything).
    #[test]
    fn a_peers_err_is_scoped_by_what_it_says() {
        let mut ev = Events::default();
        ev.peer_gave_up(0, 1, fault(FaultKind::Timeout, None), Some(9));
        assert_eq!(ev.faults[0].scope, Scope::Comm(9));
        assert_eq!(ev.faults[0].fault.reporter, Some(1));
        ev.peer_gave_up(0, 1, fault(FaultKind::Failed, Some(3)), None);
        assert_eq!(ev.faults[1].scope, Scope::Peer(3));
        ev.peer_gave_up(0, 2, fault(FaultKind::Failed, Some(0)), None);
        assert_eq!(ev.faults[2].scope, Scope::Peer(2), "it gave up on this rank");
        ev.peer_gave_up(0, 1, fault(FaultKind::Timeout, None), None);
        assert_eq!(ev.faults[3].scope, Scope::Peer(1), "its whole fabric failed");
        assert!(!ev.all_failed());
    }

    /// Last words (an shm peer's `ERR`, read from its segment) are taken as that `ERR`:
    /// the culprit it names stays the culprit and the peer is the reporter; anything else
    /// there is ignored.
    #[test]
    fn last_words_name_the_rank_that_was_blamed() {
        let fault =
            Fault { kind: FaultKind::Failed, culprit: Some(3), reporter: None, op: "weight sync".into(), what: "was killed".into() };
        let inbox = Inbox::new(1, Bell::heap());
        assert!(inbox.deliver_last_words(0, proto::encode_err(&fault, 0, None)));
        let ev = inbox.lock();
        let got = &ev.faults[0];
        assert_eq!(got.scope, Scope::Peer(3));
        assert_eq!((got.fault.culprit, got.fault.reporter, got.fault.what.as_str()), (Some(3), Some(0), "was killed"));
        let other = Inbox::new(1, Bell::heap());
        assert!(!other.deliver_last_words(0, b"not a message".to_vec()));
        assert!(other.lock().faults.is_empty());
    }
}
