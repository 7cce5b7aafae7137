//! The inbox: what transports deliver into, below them all. Messages, clear-to-sends,
//! write-with-immediate completions, goodbyes, peers' reports (`ERR`, `LEAVE`, `AGREED`,
//! probes) and broken connections land here as [`Events`], under one mutex, and ring the
//! doorbell; writes land in the registered regions it holds. Whoever waits (the engine's
//! driver, a setup or shutdown wait) matches them. Also here: the doorbell itself and the
//! one [`Backoff`] every wait loop uses, and the pool of message buffers.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
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
    /// The first fatal fault. Poisons the fabric.
    pub(crate) fatal: Option<Fault>,
    /// The error that made `fatal`, when this rank found it (later calls keep it in
    /// [`Error::Poisoned`]).
    pub(crate) first: Option<Error>,
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
    /// Set by an abort: `Some(None)` by this rank, `Some(Some(r))` by rank `r`.
    pub(crate) aborted: Option<Option<usize>>,
    /// Raised with `fatal`, readable without the lock (the driver looks every round).
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
    /// `peer` (world rank) told this rank (`me`) why it gives up (an `ERR`).
    fn peer_gave_up(&mut self, me: usize, peer: usize, mut f: Fault) {
        // A report carries the rank that found the fault; a peer that relays one keeps
        // it. Never trust a report to speak for this rank.
        if f.reporter.is_none_or(|r| r == me) {
            f.reporter = Some(peer);
        }
        if f.kind == FaultKind::Aborted {
            self.aborted.get_or_insert(f.reporter);
        }
        self.set_fault(f);
    }

    /// Makes world rank `peer` the cause of a fatal failure found by this rank, unless
    /// something is fatal already.
    pub(crate) fn set_fatal(&mut self, peer: usize, what: String) {
        self.set_fault(Fault { kind: FaultKind::Failed, culprit: Some(peer), reporter: None, op: String::new(), what });
    }

    /// Makes `f` the fabric's fatal fault, unless something is fatal already.
    pub(crate) fn set_fault(&mut self, f: Fault) {
        self.set_fault_from(f, None);
    }

    /// [`Events::set_fault`], keeping `first`, the error of this rank's that made `f`.
    pub(crate) fn set_fault_from(&mut self, f: Fault, first: Option<Error>) {
        if self.fatal.is_none() {
            self.fatal = Some(f);
            self.first = first;
            self.fatal_flag.store(true, Ordering::SeqCst);
        }
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
        let Ok((ProtoMsg::Err(f), _)) = proto::decode_keep(bytes) else { return false };
        self.lock().peer_gave_up(self.rank, peer, f);
        self.notify();
        true
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
                ev.data.entry((comm, chan, peer)).or_default().push_back(Incoming { seq, call, desc, data, rts: None })
            }
            Ok(ProtoMsg::Cts { comm, chan, cts }) => ev.cts.entry((comm, chan, peer)).or_default().push_back(cts),
            Ok(ProtoMsg::Rts { comm, chan, seq, call, desc, len }) => {
                ev.data.entry((comm, chan, peer)).or_default().push_back(Incoming { seq, call, desc, data: Vec::new(), rts: Some(len) })
            }
            Ok(ProtoMsg::Err(f)) => ev.peer_gave_up(self.rank, peer, f),
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
        if !ev.closed.contains(&peer) && ev.fatal.is_none() && !ev.suspects.iter().any(|s| s.0 == peer) {
            ev.suspects.push((peer, reason, Instant::now()));
        }
        drop(ev);
        self.notify();
    }

    /// Makes the earliest suspect fatal once it is [`SUSPECT_GRACE`] old (and nothing else
    /// became fatal meanwhile).
    pub(crate) fn promote_suspects(&self, now: Instant) {
        let mut ev = self.lock();
        if ev.fatal.is_some() || ev.suspects.is_empty() {
            return;
        }
        if let Some((peer, what, at)) = ev.suspects.iter().min_by_key(|s| s.2).cloned() {
            if now.saturating_duration_since(at) >= SUSPECT_GRACE {
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
            if let Some(f) = ev.fatal.as_ref().filter(|f| f.culprit.is_some() || f.reporter.is_some()) {
                return Some(f.clone());
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

    /// Last words (an shm peer's `ERR`, read from its segment) are taken as that `ERR`:
    /// the culprit it names stays the culprit and the peer is the reporter; anything else
    /// there is ignored.
    #[test]
    fn last_words_name_the_rank_that_was_blamed() {
        let fault =
            Fault { kind: FaultKind::Failed, culprit: Some(3), reporter: None, op: "weight sync".into(), what: "was killed".into() };
        let inbox = Inbox::new(1, Bell::heap());
        assert!(inbox.deliver_last_words(0, proto::encode_err(&fault, 0)));
        let got = inbox.lock().fatal.clone().unwrap();
        assert_eq!((got.culprit, got.reporter, got.what.as_str()), (Some(3), Some(0), "was killed"));
        let other = Inbox::new(1, Bell::heap());
        assert!(!other.deliver_last_words(0, b"not a message".to_vec()));
        assert!(other.lock().fatal.is_none());
    }
}
