//! The low-latency protocol on shared memory (`FERROCCL_ALGO=ll`, [`Algo::Ll`](crate::Algo::Ll)):
//! small collectives of a communicator whose members all live on this host, with no
//! message, no lock, no allocation and no system call on the path.
//!
//! Each member owns one anonymous segment per communicator (made when the communicator is:
//! `init` or `split`), which every other member maps at that time: a control line, then
//! *header lines* of two cache lines each, then two *data slots*. The header lines are two
//! *sync lines*, used in turn by every call but the ring's (call `s` posts in sync line
//! `s % 2`), and [`RING`] (128) *ring lines*, used in turn by the *ring calls*: broadcasts
//! and reduces whose data fits a line (call `s` posts in ring line `s % 128`). A header is
//! 32 bytes (the call's number `s`, the collective call number with a digest of every call
//! the rank posted so far beside it, and the call's 16-byte descriptor),
//! followed by up to 96 bytes of data, the first 32 in the header's own cache line; a call
//! whose data does not fit uses data slot `s % 2`. A call:
//!
//! 1. *posts*: copies this rank's contribution into its header line or data slot, writes
//!    the header, and publishes `s` (a release store, so that nothing waits for the line
//!    to come back from the members that read it last; members asleep on their doorbells
//!    are woken after the finish, see `LlChannel::wake_sleepers`);
//! 2. *waits* until the members whose data it needs have posted `s` (every member, except
//!    for a broadcast, which needs only the root's, and for the root of a broadcast and a
//!    reduce off its root, which need nobody's), comparing each one's call number and
//!    descriptor with its own (a member in another call is a mismatch, named like any
//!    other; a member that posted `s` in the other kind of line, where this rank does not
//!    look, is found by the probe the waiter sends after 50 ms, like a member in a call off
//!    the slots);
//! 3. *finishes*: reads what it needs from the members' lines or slots, and reduces in rank
//!    order with the same `reduce_many` as the mesh and oneshot algorithms (so f16/bf16
//!    results are bit-identical to theirs and to the reference), through a small
//!    cache-resident bounce buffer (shared memory is only ever copied, never borrowed: see
//!    `ferroccl_mem::segment`).
//!
//! No acknowledgement is ever sent; what keeps a post from overwriting what a member still
//! reads is when a rank may post. Call it *settling* call `t`: this rank has seen every
//! member's post of `t` and checked its header. A member posts `t` only after finishing
//! `t - 1`, so once `t` is settled, every member is done reading what any call before `t`
//! posted. Hence a rank posts call `s` only once it has settled
//! - `s - 1`, when `s` is not a ring call or waits for every member anyway (allreduce,
//!   allgather, reduce_scatter, alltoall, barrier, a reduce's root, every call past a
//!   line: the sync line and the data slot `s` uses were last used by `s - 2` or before);
//! - `s - LEAD` (`s - 64`) and the last call outside the ring, when `s` is a ring call that
//!   waits for fewer members than all (a broadcast, a reduce off its root): its ring line
//!   was last used by `s - 128` or before, which every member finished before posting
//!   `s - 127`; and the sync line and data slot of a call outside the ring are used again
//!   by the next such call, which the members post only after this rank's post of the one
//!   after it.
//!
//! So a broadcast's root may run up to 64 calls ahead of the members, and the members
//! ahead of each other, as a sender of eager messages does (with 4 ranks on 2 CPUs a
//! rank that gets the CPU finishes many calls at once instead of handing the CPU over for
//! each). A call a rank did not wait for every member in is settled later: by its next
//! calls, as the rule above needs, by the communicator's next operation off the slots
//! (`Communicator::submit`), and by `finalize`, so a mismatch in it (two ranks that each
//! take themselves for the root) is still an error on every rank, at one of those. A rank
//! that must settle settles many calls at once, up to `s - SETTLE_BEHIND` (8), reading one
//! line per member: that call's, whose header is checked and whose digest stands for the
//! calls before it (`LlChannel::settle`). Why 64
//! is safe: a member posts ring call `u` only after settling `u - 64` (or more), i.e.
//! after this rank posted `u - 64`; this rank reads a member's line of a ring call `t`
//! (settling up to `t`, or, when something differs, settling up to a later call) no
//! earlier than at its call `t + 1` and no later than before posting `t + 64`, so the
//! members have posted at most `t + 127` by then: the member's header of `t` is still in
//! its line (overwritten by `t + 128` at the earliest). A call outside the ring is settled
//! before the next call posts, and overwritten by the member's `t + 2` at the earliest. Why the ring is apart
//! from the lines of the other calls: so that its depth (128 lines: a 4-rank 8 B broadcast
//! took 0.7x the time it took with 32) leaves alone how the other calls use their lines
//! (with every call in one ring, a 2-rank 8 B allreduce, which never runs ahead, measured
//! 1.04x the time of two lines with 32 lines, 0.99-1.10x with 64; alternated, noisy).
//!
//! Waiting: the waiter spins while that is cheap for the machine ([`WaitPolicy`]): for a few
//! tens of microseconds when every rank of the host has a core of its own, not at all when
//! ranks share cores (there, spinning takes the core from the very rank being waited for),
//! then yields, then sleeps on the fabric's doorbell, which a poster rings when it sees the
//! waiter asleep. While it waits past the spin it also drains the transports, watches the
//! peers' processes, answers probes and sends its own: a peer killed mid-call is named within
//! the usual few milliseconds, and a peer in another call (even one that is not a low-latency
//! call) is a mismatch, as on the other paths.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferroccl_kernels::reduce_many_bytes;
use ferroccl_mem::ShmSegment;

use crate::algo::ll::{LlKind, LlSpec};
use crate::algo::{select, Collective};
use crate::error::{Error, Op, Result};
use crate::fabric::{Fabric, PARK_NAP};
use crate::inbox::View;
use crate::logging::flog;
use crate::params::FaultSite;
use crate::poll::Poll;
use crate::proto::{self, Desc};

/// The collectives, one of each kind (roots do not matter to the cost).
const COLLS: [Collective; 6] = [
    Collective::AllReduce,
    Collective::AllGather,
    Collective::ReduceScatter,
    Collective::Broadcast { root: 0 },
    Collective::Reduce { root: 0 },
    Collective::AllToAll,
];

/// Control lines before the first slot: the readiness word and this rank's CPUs.
const CTL: usize = 128;
/// `u32`: 0 while connecting, [`READY_OK`] once every peer's segment is mapped,
/// [`READY_FAILED`] if one could not be.
const READY_OFF: usize = 0;
const READY_OK: u32 = 1;
const READY_FAILED: u32 = 2;
/// `u64` x [`CPU_WORDS`]: the CPUs this rank may run on (the first 256).
const CPUS_OFF: usize = 8;
const CPU_WORDS: usize = 4;
/// A slot's header: the call's number `s` (`u64`, published last), the collective call
/// number (`u32`), 4 bytes unused, the call's descriptor (16 bytes); the data follows.
const HDR: usize = 32;
const SEQ_OFF: usize = 0;
const CALL_OFF: usize = 8;
const DESC_OFF: usize = 16;
/// A header line: the header, then up to [`INLINE`] data bytes.
const LINE: usize = 64;
/// Header lines lie this far apart (a pair of cache lines each).
const LINE_GAP: usize = 128;
/// Data bytes a call keeps after its header (rather than in a data slot): up to
/// [`INLINE`] in the header's own cache line, the rest in the next.
const LINE_DATA: usize = LINE_GAP - HDR;
/// Data bytes that share the header's cache line.
const INLINE: usize = LINE - HDR;
/// Header lines per member for every call but the ring's (below), used in turn: call `s`
/// posts in sync line `s % 2`.
const SYNC_LINES: u64 = 2;
/// Header lines per member for broadcasts and reduces whose data fits a line, used in
/// turn: call `s` posts in ring line `s % RING`.
pub(crate) const RING: u64 = 128;
/// How far a rank may run ahead: a ring call that needs no member's post to finish (a
/// broadcast's root, a reduce off its root) or only the root's (a broadcast elsewhere)
/// posts once every member has posted the call `LEAD` before it (other calls: the call
/// before). At most half the ring, so that a member's header is still in its line when
/// this rank checks it (see the module documentation).
const LEAD: u64 = RING / 2;

/// A rank that must settle (a ring call `s` once `s - LEAD` is not settled) settles up to
/// `s - SETTLE_BEHIND` (or further: the last call outside the ring), so that it settles once
/// every `LEAD - SETTLE_BEHIND` calls, each time reading one header line per member (see
/// [`LlChannel::settle`]). 4 ranks on 2 CPUs, 8 B broadcast, alternated: settling one call
/// per call (as before this constant) took 1.24x the time of 32, 32 took 1.2x the time of
/// 8, 48 1.07x, 16 1.04x, 4 1.0x, 1 (catching up all but one call) 1.04x.
const SETTLE_BEHIND: u64 = 8;
/// Most members a low-latency communicator may have (each call reads every member's slot).
pub(crate) const MAX_RANKS: usize = 32;
/// The bounce buffer reductions read slots through, split among the members.
const BOUNCE: usize = 16 << 10;
/// How often a waiter past its spin drains the transports, watches the peers and answers
/// probes.
const TEND_EVERY: Duration = Duration::from_micros(500);
/// A waiting call tells the members it waits for which call it is in after this long, then
/// again after twice as long, up to a second (as the engine's jobs do).
const PROBE_AFTER: Duration = Duration::from_millis(50);
const PROBE_GAP_MAX: Duration = Duration::from_secs(1);

#[repr(align(64))]
struct Bounce<const N: usize>([u8; N]);

/// `N` slots' first data bytes, each line 32-byte aligned.
#[repr(align(64))]
struct Lines<const N: usize>([[u8; INLINE]; N]);

/// How a waiter spends the time before it sleeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct WaitPolicy {
    /// Spin this long.
    pub(crate) spin: Duration,
    /// Then yield the CPU this long; then sleep on the doorbell.
    pub(crate) yield_for: Duration,
}

impl WaitPolicy {
    /// The policy for ranks that share cores (`shared`) or have one each, with the spin
    /// `FERROCCL_SPIN_US` sets (else the default for the case).
    pub(crate) fn new(shared: bool, spin_us: Option<u64>) -> WaitPolicy {
        let spin = match spin_us {
            Some(us) => Duration::from_micros(us),
            // Measured with 4 ranks on 2 CPUs: any spin slows every call (the rank being
            // waited for needs this CPU); yielding at once and for ~50 us before sleeping
            // is fastest (8 B: spin 0 us 5.8 us, 1 us 9.1, 5 us 12.5, 20 us 26).
            None if shared => Duration::ZERO,
            None => Duration::from_micros(50),
        };
        let yield_for = if shared { Duration::from_micros(50) } else { Duration::from_micros(500) };
        WaitPolicy { spin, yield_for }
    }
}

impl WaitPolicy {
    /// The policy for a rank of this fabric outside a low-latency channel: CPUs count as
    /// shared when the ranks of this host outnumber the machine's.
    pub(crate) fn for_fabric(fabric: &Fabric) -> WaitPolicy {
        let online = std::thread::available_parallelism().map_or(1, usize::from);
        WaitPolicy::new(fabric.local_ranks() > online, fabric.params.spin_us)
    }
}

/// Waits, as a low-latency call does (spin for `policy.spin`, yield for
/// `policy.yield_for`, then sleep on the doorbell in naps), until `done()` holds; the
/// fabric's fatal state, the peers' health and the deadline (`FERROCCL_TIMEOUT`) end it,
/// a timeout naming the world ranks `waiting()` gives. For flags that peers raise in shared
/// memory and that ring this rank's doorbell when it sleeps (the low-latency MoE's signal
/// words); `op` names the wait in an error, and is only made then.
pub(crate) fn wait_until(
    fabric: &Fabric,
    view: View<'_>,
    policy: WaitPolicy,
    done: &dyn Fn() -> bool,
    waiting: &dyn Fn() -> Vec<usize>,
    op: &dyn Fn() -> Op,
) -> Result<()> {
    let mut spins = 0u32;
    let mut start = None::<Instant>;
    let mut slow = false;
    let limit = fabric.params.timeout;
    loop {
        let seen = if slow { fabric.inbox.bell_seen() } else { 0 };
        if done() {
            return Ok(());
        }
        if fabric.inbox.has_fatal() {
            if let Some(e) = fabric.fatal_error(&op(), Some(view)) {
                return Err(e);
            }
        }
        spins = spins.wrapping_add(1);
        if !policy.spin.is_zero() && !spins.is_multiple_of(64) {
            std::hint::spin_loop();
            continue;
        }
        let now = Instant::now();
        let t0 = *start.get_or_insert(now);
        let waited = now - t0;
        if waited < policy.spin {
            std::hint::spin_loop();
            continue;
        }
        if !slow {
            // Look once more with the doorbell read first, before anything may sleep.
            slow = true;
            continue;
        }
        // Messages (a peer's `ERR`) and the peers' processes, as every wait looks at them.
        if let Err(e) = fabric.progress() {
            return Err(fabric.poison_in(fabric.fatal_error(&op(), Some(view)).unwrap_or(e), &|r| r, Some(view)));
        }
        fabric.check_health(now);
        if waited >= limit {
            let e = Error::Timeout {
                rank: Some(fabric.rank),
                op: op(),
                after: waited,
                waiting_for: waiting().iter().map(|w| format!("rank {w}")).collect(),
            };
            return Err(fabric.poison_in(e, &|r| r, Some(view)));
        }
        if waited < policy.spin + policy.yield_for {
            std::thread::yield_now();
        } else {
            fabric.sleep_on_bell_or(seen, (now + PARK_NAP).min(t0 + limit), done);
        }
    }
}

impl LlChannel {
    /// The channel's communicator as fault scopes see it.
    fn view(&self) -> View<'_> {
        View { comm: self.comm, members: &self.members }
    }
}

/// A communicator's low-latency channel: every member's segment, mapped.
#[derive(Debug)]
pub(crate) struct LlChannel {
    /// By member; this rank's own at `rank`.
    segs: Vec<ShmSegment>,
    rank: usize,
    /// World rank of each member.
    members: Arc<[usize]>,
    comm: u32,
    /// Data bytes per slot.
    cap: usize,
    slot_len: usize,
    pub(crate) policy: WaitPolicy,
    /// The number of the last low-latency call this rank finished.
    done: AtomicU64,
    /// The number of the last call whose every member's post this rank has seen and
    /// checked (and of every call before it): `done`, or less after calls that needed
    /// fewer members' posts than all (a broadcast, a reduce off its root: see
    /// [`LlChannel::needs`]), which later calls settle as they must (see the module
    /// documentation), and the communicator's next operation off the slots all at once.
    settled: AtomicU64,
    /// The number of the last call outside the ring this rank ran on its thread.
    last_sync: AtomicU64,
    /// The digest of the calls this rank posted (see [`chained`]).
    chain: AtomicU64,
    /// Low-latency calls waiting in the engine (whoever finishes a call rings the doorbell
    /// for them).
    queued: AtomicUsize,
    /// The largest message the cost model sends over the channel, by collective (see
    /// [`LlChannel::limit`]).
    limits: [usize; 6],
}

/// The name of member (`comm`, world rank `world`)'s segment in job `job`.
fn seg_name(job: u64, comm: u32, world: usize) -> String {
    format!("ferroccl-ll-{job:016x}-{comm:08x}-{world}")
}

fn slot_len(cap: usize) -> usize {
    cap.div_ceil(128) * 128
}

fn seg_len(cap: usize) -> usize {
    CTL + (SYNC_LINES + RING) as usize * LINE_GAP + 2 * slot_len(cap)
}

/// This process's CPUs (the first 256), as a bit mask.
fn my_cpus() -> [u64; CPU_WORDS] {
    let mut m = [0u64; CPU_WORDS];
    match rustix::thread::sched_getaffinity(None) {
        Ok(set) => {
            for c in 0..(64 * CPU_WORDS) {
                if set.is_set(c) {
                    m[c / 64] |= 1 << (c % 64);
                }
            }
        }
        Err(_) => m[0] = u64::MAX,
    }
    m
}

/// Up to 8 bytes as the little-endian word they start (zero-padded).
fn word(b: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    w[..b.len()].copy_from_slice(b);
    u64::from_le_bytes(w)
}

/// `dst.len()` bytes at `at` (8-aligned) of `seg`, by word loads (ordered by the caller's
/// acquire of the slot's `s`).
fn load_words(seg: &ShmSegment, at: usize, dst: &mut [u8]) {
    for (i, c) in dst.chunks_mut(8).enumerate() {
        let w = seg.atomic_u64(at + 8 * i).load(Ordering::Relaxed).to_le_bytes();
        c.copy_from_slice(&w[..c.len()]);
    }
}

/// A slot's bytes into `dst`: word loads when they are few and aligned, a copy otherwise.
fn read_small(seg: &ShmSegment, at: usize, dst: &mut [u8]) {
    if dst.len() <= INLINE && at.is_multiple_of(8) {
        load_words(seg, at, dst);
    } else {
        seg.read(at, dst);
    }
}

/// Makes this rank's segment of communicator `comm` (before the members look for it), with
/// slots of `cap` data bytes. Its pages are touched now, so that no call pays for them.
pub(crate) fn create(job: u64, comm: u32, world: usize, cap: usize) -> std::io::Result<ShmSegment> {
    let len = seg_len(cap);
    let seg = ShmSegment::create_anonymous(&seg_name(job, comm, world), len)?;
    let zero = [0u8; 64];
    for off in (0..len).step_by(4096) {
        seg.write(off, &zero[..64.min(len - off)]);
    }
    for (i, w) in my_cpus().iter().enumerate() {
        seg.atomic_u64(CPUS_OFF + 8 * i).store(*w, Ordering::Relaxed);
    }
    Ok(seg)
}

impl LlChannel {
    /// Maps every member's segment and agrees with them that all could: `Ok(None)` (the
    /// low-latency path stays off, on every member alike) when one could not. `own` is this
    /// rank's segment from [`create`]; every member made its own before the exchange that
    /// precedes this call (the mesh's greetings, or `split`'s records), so a segment that
    /// cannot be found will never be. `local` is how many ranks of the job run on this host.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn connect(
        fabric: &Fabric,
        own: ShmSegment,
        comm: u32,
        members: Arc<[usize]>,
        rank: usize,
        cap: usize,
        local: usize,
        deadline: Instant,
    ) -> Result<Option<LlChannel>> {
        let n = members.len();
        let mut segs: Vec<Option<ShmSegment>> = Vec::with_capacity(n);
        let mut failed = None;
        for (p, &w) in members.iter().enumerate() {
            if p == rank {
                segs.push(None);
                continue;
            }
            let opened =
                fabric.endpoint(w).ok().and_then(|e| e.shm_pid()).ok_or_else(|| format!("rank {p} is not reached over shm")).and_then(
                    |pid| {
                        let name = seg_name(fabric.job, comm, w);
                        // The owner keeps its descriptor until every member has looked; ranks
                        // that are threads of one process also see each other's short-lived
                        // descriptors of it: look again (`open_anonymous`).
                        ShmSegment::open_anonymous(pid, &name, seg_len(cap), true).map_err(|e| format!("rank {p}'s segment: {e}"))
                    },
                );
            match opened {
                Ok(seg) => {
                    // Map its pages now (a read per page), not in the first call.
                    let mut b = [0u8; 1];
                    for off in (0..seg.len()).step_by(4096) {
                        seg.read(off, &mut b);
                    }
                    segs.push(Some(seg));
                }
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        let say = |why: &str| flog!(Info, Init, "rank {}: low-latency path off for communicator {comm:#x}: {why}", fabric.rank);
        if let Some(why) = failed {
            own.atomic_u32(READY_OFF).store(READY_FAILED, Ordering::SeqCst);
            say(&why);
            return Ok(None);
        }
        own.atomic_u32(READY_OFF).store(READY_OK, Ordering::SeqCst);
        segs[rank] = Some(own);
        let segs: Vec<ShmSegment> = segs.into_iter().flatten().collect();
        if segs.len() != n {
            return Err(Error::internal("low-latency setup lost a segment"));
        }
        let ready = |p: usize| segs[p].atomic_u32(READY_OFF).load(Ordering::SeqCst);
        let op = Op::other("communicator setup (low-latency slots)");
        let waiting = || members.iter().enumerate().filter(|&(p, _)| ready(p) == 0).map(|(_, &w)| w).collect::<Vec<_>>();
        let view = View { comm, members: &members };
        fabric.run_until(&op, Some(view), deadline, &waiting, || {
            Ok(if (0..n).all(|p| ready(p) != 0) { Poll::Ready(()) } else { Poll::Idle })
        })?;
        // Everyone has looked: nobody needs to open our segment any more.
        segs[rank].withdraw();
        if let Some(p) = (0..n).find(|&p| ready(p) == READY_FAILED) {
            say(&format!("rank {p} could not map every member's segment"));
            return Ok(None);
        }
        // The CPUs the members may use together, against the ranks of this host.
        let mut union = [0u64; CPU_WORDS];
        for s in &segs {
            for (i, u) in union.iter_mut().enumerate() {
                *u |= s.atomic_u64(CPUS_OFF + 8 * i).load(Ordering::Relaxed);
            }
        }
        let cpus = union.iter().map(|w| w.count_ones() as usize).sum::<usize>();
        let online = std::thread::available_parallelism().map_or(1, usize::from).max(cpus);
        let shared = n > cpus || local > online;
        let policy = WaitPolicy::new(shared, fabric.params.spin_us);
        flog!(
            Info,
            Init,
            "rank {}: low-latency path on for communicator {comm:#x} ({n} ranks, slots of {cap} B, {cpus} CPUs among them, {local} ranks on this host: {})",
            fabric.rank,
            if shared { "CPUs shared: waits yield at once" } else { "a CPU each: waits spin first" }
        );
        Ok(Some(LlChannel {
            segs,
            rank,
            members,
            comm,
            cap,
            slot_len: slot_len(cap),
            policy,
            done: AtomicU64::new(0),
            settled: AtomicU64::new(0),
            last_sync: AtomicU64::new(0),
            chain: AtomicU64::new(0),
            queued: AtomicUsize::new(0),
            limits: COLLS.map(|c| {
                let per = LlSpec::slot_bytes(LlKind::Coll(c), n, 1).unwrap_or(1).max(1);
                select::ll_limit(c, n, cap / per, shared)
            }),
        }))
    }
}

impl LlChannel {
    /// The largest message (`bytes` as in [`LlChannel::fits`]) of `coll` the cost model
    /// runs on the channel (what it predicts faster than the schedules).
    pub(crate) fn limit(&self, coll: Collective) -> usize {
        let i = COLLS.iter().position(|c| std::mem::discriminant(c) == std::mem::discriminant(&coll)).unwrap_or(0);
        self.limits[i]
    }

    /// Whether a call of `kind` on `bytes` (`count` x element size) fits the slots.
    pub(crate) fn fits(&self, kind: LlKind, bytes: usize) -> bool {
        LlSpec::slot_bytes(kind, self.segs.len(), bytes).is_some_and(|b| b <= self.cap)
    }

    /// The number of the last low-latency call this rank finished (the next one may post
    /// once this is the one before it).
    pub(crate) fn done(&self) -> u64 {
        self.done.load(Ordering::Acquire)
    }

    /// A low-latency call enters (`true`) or leaves the engine.
    pub(crate) fn queue(&self, enter: bool) {
        if enter {
            self.queued.fetch_add(1, Ordering::SeqCst);
        } else {
            self.queued.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Call `s`'s header line when it is not a ring call.
    fn sync_line(s: u64) -> usize {
        CTL + (s % SYNC_LINES) as usize * LINE_GAP
    }

    /// Call `s`'s header line when it is a ring call.
    fn ring_line(s: u64) -> usize {
        CTL + (SYNC_LINES + s % RING) as usize * LINE_GAP
    }

    /// The header line this rank posted call `s` in (which it has not overwritten yet:
    /// see the module documentation).
    fn posted_line(&self, s: u64) -> usize {
        let ring = Self::ring_line(s);
        if self.segs[self.rank].atomic_u64(ring + SEQ_OFF).load(Ordering::Relaxed) == s {
            ring
        } else {
            Self::sync_line(s)
        }
    }

    /// Where call `s` of `spec` keeps its data, whom it waits for, and what it settles
    /// first.
    fn place(&self, s: u64, spec: &LlSpec) -> Place {
        let all = self.all_but_me();
        let want = self.needs(spec);
        // A member's bytes fit its header line: there; else in data slot `s % 2`.
        let inline = LlSpec::slot_bytes(spec.kind, self.segs.len(), spec.bytes()).is_some_and(|b| b <= LINE_DATA);
        // Every member alike (the call's kind and size) tells a ring call.
        let ring = inline && matches!(spec.kind, LlKind::Coll(Collective::Broadcast { .. } | Collective::Reduce { .. }));
        let line = if ring { Self::ring_line(s) } else { Self::sync_line(s) };
        let data = if inline { line + HDR } else { CTL + (SYNC_LINES + RING) as usize * LINE_GAP + (s % 2) as usize * self.slot_len };
        // The call before, or, for a ring call that does not wait for every member, the
        // oldest call whose line it does not overwrite, and the last call outside the ring
        // (whose line the next one of its kind may overwrite: see the module documentation).
        let settle_to = if want == all || !ring { s - 1 } else { s.saturating_sub(LEAD).max(self.last_sync.load(Ordering::Relaxed)) };
        Place { want, ring, line, data, settle_to }
    }

    /// Step 1: this rank's contribution `src` (the call's own bytes: see
    /// [`LlSpec::contribution`]) at `data` (in its header line `at`, or a data slot), then
    /// the header, then `s` (a release store: nothing waits here for the line to come back
    /// from the members that read it last). Members asleep on their doorbells are woken by
    /// [`LlChannel::wake_sleepers`], which the caller runs after it (see there).
    fn post(&self, s: u64, call: u32, desc: &Desc, src: &[u8], at: usize, data: usize) {
        let seg = &self.segs[self.rank];
        // Calls post one after the other (each once the one before finished).
        let digest = chained(self.chain.load(Ordering::Relaxed) as u32, call, desc);
        self.chain.store(u64::from(digest), Ordering::Relaxed);
        let call_word = u64::from(call) | u64::from(digest) << 32;
        if data == at + HDR && src.len() <= INLINE {
            // Header and data share the cache line: word stores, no copy call.
            seg.atomic_u64(at + CALL_OFF).store(call_word, Ordering::Relaxed);
            let (d0, d1) = desc.split_at(8);
            seg.atomic_u64(at + DESC_OFF).store(word(d0), Ordering::Relaxed);
            seg.atomic_u64(at + DESC_OFF + 8).store(word(d1), Ordering::Relaxed);
            for (i, c) in src.chunks(8).enumerate() {
                seg.atomic_u64(at + HDR + 8 * i).store(word(c), Ordering::Relaxed);
            }
        } else {
            seg.write(data, src);
            seg.write(at + CALL_OFF, &call_word.to_le_bytes());
            seg.write(at + DESC_OFF, desc);
        }
        seg.atomic_u64(at + SEQ_OFF).store(s, Ordering::Release);
    }

    /// Wakes the members asleep on their doorbells after this rank posted. The fence pairs
    /// with a sleeper's announcement (`Inbox::sleep`, then a look at the slots): either the
    /// sleeper sees the post, or this rank sees it asleep and rings. A rank runs it before
    /// it may sleep itself and when its call ends, so a member waiting for its post is
    /// woken at the latest when this rank stops running: late only by this rank's own
    /// wait, which a member that sleeps waits out anyway (it needs every member's post).
    fn wake_sleepers(&self, fabric: &Fabric) {
        std::sync::atomic::fence(Ordering::SeqCst);
        for (p, &w) in self.members.iter().enumerate() {
            if p != self.rank {
                if let Ok(ep) = fabric.endpoint(w) {
                    ep.wake_if_sleeping_after_fence();
                }
            }
        }
    }

    fn arrived(&self, s: u64, line: usize, p: usize) -> bool {
        self.segs[p].atomic_u64(line + SEQ_OFF).load(Ordering::Acquire) == s
    }

    /// Members (by rank) that have not posted call `s` yet, as a bit set.
    fn missing(&self, s: u64, line: usize, mut set: u64) -> u64 {
        let mut left = set;
        while left != 0 {
            let p = left.trailing_zeros() as usize;
            left &= left - 1;
            if self.arrived(s, line, p) {
                set &= !(1 << p);
            }
        }
        set
    }

    fn all_but_me(&self) -> u64 {
        let n = self.segs.len();
        (if n >= 64 { u64::MAX } else { (1u64 << n) - 1 }) & !(1u64 << self.rank)
    }

    /// The digest of the calls member `p` posted up to the one in header line `at` (see
    /// [`chained`]).
    fn digest(&self, at: usize, p: usize) -> u32 {
        (self.segs[p].atomic_u64(at + CALL_OFF).load(Ordering::Relaxed) >> 32) as u32
    }

    /// The collective call number and descriptor member `p` posted in header line `at`.
    fn header(&self, at: usize, p: usize) -> (u32, Desc) {
        let seg = &self.segs[p];
        let call = seg.atomic_u64(at + CALL_OFF).load(Ordering::Relaxed) as u32;
        let mut d = [0u8; 16];
        d[..8].copy_from_slice(&seg.atomic_u64(at + DESC_OFF).load(Ordering::Relaxed).to_le_bytes());
        d[8..].copy_from_slice(&seg.atomic_u64(at + DESC_OFF + 8).load(Ordering::Relaxed).to_le_bytes());
        (call, d)
    }

    /// The members (as a bit set) whose posts of a call of `spec` this rank needs before it
    /// can finish: the root's for a broadcast off the root, nobody's for the broadcast's
    /// root and for a reduce off its root, everyone's otherwise. The posts it does not
    /// wait for are checked (call number, descriptor) later, by [`LlChannel::settle`].
    fn needs(&self, spec: &LlSpec) -> u64 {
        let r = self.rank;
        match spec.kind {
            LlKind::Coll(Collective::Broadcast { root }) if root == r => 0,
            LlKind::Coll(Collective::Broadcast { root }) if root < self.segs.len() => 1 << root,
            LlKind::Coll(Collective::Reduce { root }) if root != r => 0,
            _ => self.all_but_me(),
        }
    }

    /// Member `p`'s call number and descriptor in header line `line` (posted) against ours.
    fn check_call(&self, line: usize, p: usize, call: u32, desc: &Desc, op: &dyn Fn() -> Op) -> Result<()> {
        let (theirs, d) = self.header(line, p);
        if theirs == call && d == *desc {
            return Ok(());
        }
        let me = self.rank;
        let what = if d == *desc {
            format!(
                "rank {me} is in call #{call}, rank {p} in its call #{theirs}, both {}: one of them made a call the other did not",
                proto::describe(desc)
            )
        } else {
            format!("rank {me} called {} as call #{call}, rank {p} called {} as call #{theirs}", proto::describe(desc), proto::describe(&d))
        };
        Err(self.mismatch(p, op(), what))
    }

    /// This rank's mismatch with member `p` in `op`.
    fn mismatch(&self, p: usize, op: Op, what: String) -> Error {
        Error::Mismatch { rank: self.rank, peer: p, op, what, cause: None }
    }

    /// Step 3, once the members it needs have posted: the call's result into `out` (`None`:
    /// this rank wants none, e.g. reduce off the root). `own`: where this rank's own
    /// contribution is read from (see [`Own`]).
    fn finish(&self, fabric: &Fabric, data: usize, spec: &LlSpec, out: Option<&mut [u8]>, own: Own<'_>) -> Result<()> {
        let Some(out) = out else { return Ok(()) };
        if spec.kind.reduces() && fabric.params.injects(FaultSite::ReduceStep, fabric.rank) {
            return Err(Error::internal("low-latency reduction: injected by FERROCCL_INJECT_FAULT"));
        }
        let (r, b) = (self.rank, spec.bytes());
        // This rank's bytes of the block at `off` of its contribution.
        let block = |off: usize| match own {
            Own::Posted(c) => c.get(off..off + b).map_or(OwnBlock::Slot, OwnBlock::Here),
            Own::InPlace => OwnBlock::InOut,
            Own::Slot => OwnBlock::Slot,
        };
        match spec.kind {
            LlKind::Barrier => {}
            LlKind::Coll(Collective::AllReduce) => self.reduce(spec, data, &mut out[..b], block(0))?,
            LlKind::Coll(Collective::Reduce { root }) if root == r => self.reduce(spec, data, &mut out[..b], block(0))?,
            LlKind::Coll(Collective::Reduce { .. }) => {}
            LlKind::Coll(Collective::ReduceScatter) => {
                let at = if spec.in_place { r * b } else { 0 };
                self.reduce(spec, data + r * b, &mut out[at..at + b], block(r * b))?;
            }
            LlKind::Coll(Collective::AllGather) => {
                for (p, seg) in self.segs.iter().enumerate() {
                    let dst = &mut out[p * b..(p + 1) * b];
                    match (p == r, block(0)) {
                        (false, _) | (true, OwnBlock::Slot) => read_small(seg, data, dst),
                        (true, OwnBlock::Here(o)) => dst.copy_from_slice(o),
                        // In place: block r already is this rank's.
                        (true, OwnBlock::InOut) => {}
                    }
                }
            }
            LlKind::Coll(Collective::AllToAll) => {
                for (p, seg) in self.segs.iter().enumerate() {
                    seg.read(data + r * b, &mut out[p * b..(p + 1) * b]);
                }
            }
            LlKind::Coll(Collective::Broadcast { root }) => {
                if root != r {
                    read_small(&self.segs[root], data, &mut out[..b]);
                }
            }
            // Per-peer counts do not fit the slots' layout (`Collective::per_call`): never
            // taken (`takes_ll`).
            LlKind::Coll(c) => return Err(Error::internal(format!("{} does not run on the low-latency slots", c.name()))),
        }
        Ok(())
    }

    /// The rank-order reduction of every member's slot bytes at `at` into `out` (this
    /// rank's from where `own` says), through a bounce buffer on the stack, no larger than
    /// needed (it is zeroed on every call).
    fn reduce(&self, spec: &LlSpec, at: usize, out: &mut [u8], own: OwnBlock<'_>) -> Result<()> {
        let n = self.segs.len();
        if out.len() <= INLINE && at.is_multiple_of(8) {
            return if n <= 4 { self.reduce_inline::<4>(spec, at, out, own) } else { self.reduce_inline::<MAX_RANKS>(spec, at, out, own) };
        }
        let need = out.len().saturating_mul(n);
        if need <= 256 {
            self.reduce_via(&mut Bounce([0u8; 256]).0, spec, at, out, own)
        } else if need <= 1 << 10 {
            self.reduce_via(&mut Bounce([0u8; 1 << 10]).0, spec, at, out, own)
        } else if need <= 4 << 10 {
            self.reduce_via(&mut Bounce([0u8; 4 << 10]).0, spec, at, out, own)
        } else {
            self.reduce_via(&mut Bounce([0u8; BOUNCE]).0, spec, at, out, own)
        }
    }

    /// Bytes `range` of the reduction's sources into `dst`: member `p`'s from its slot at
    /// `at`, this rank's from where `own` says (`out`: the reduction's output, not yet
    /// written there).
    fn source(&self, p: usize, at: usize, range: std::ops::Range<usize>, own: OwnBlock<'_>, out: &[u8], dst: &mut [u8]) {
        match own {
            OwnBlock::Here(o) if p == self.rank => dst.copy_from_slice(&o[range]),
            OwnBlock::InOut if p == self.rank => dst.copy_from_slice(&out[range]),
            _ => read_small(&self.segs[p], at + range.start, dst),
        }
    }

    /// [`LlChannel::reduce`] of at most [`INLINE`] bytes at an aligned `at`, for at most `N`
    /// members: word loads into a stack buffer that is no larger than needed.
    fn reduce_inline<const N: usize>(&self, spec: &LlSpec, at: usize, out: &mut [u8], own: OwnBlock<'_>) -> Result<()> {
        let (n, len) = (self.segs.len(), out.len());
        // Aligned, so that the kernels take the elements in place (a misaligned source
        // would make them copy into scratch memory of their own).
        let mut bufs = Lines([[0u8; INLINE]; N]);
        for (p, b) in bufs.0.iter_mut().enumerate().take(n) {
            self.source(p, at, 0..len, own, out, &mut b[..len]);
        }
        let mut srcs: [&[u8]; N] = [&[]; N];
        for (src, b) in srcs.iter_mut().zip(bufs.0.iter()) {
            *src = &b[..len];
        }
        reduce_many_bytes(spec.dtype, spec.op, &srcs[..n], out).map_err(|e| Error::internal(format!("low-latency reduction: {e}")))
    }

    fn reduce_via(&self, bounce: &mut [u8], spec: &LlSpec, at: usize, out: &mut [u8], own: OwnBlock<'_>) -> Result<()> {
        let n = self.segs.len();
        // A multiple of every element size (8 at most), and never 0 (n <= MAX_RANKS).
        let per = (bounce.len() / n) & !7;
        let mut done = 0;
        while done < out.len() {
            let len = per.min(out.len() - done);
            for (p, part) in bounce.chunks_mut(per).enumerate().take(n) {
                self.source(p, at, done..done + len, own, out, &mut part[..len]);
            }
            let mut srcs: [&[u8]; MAX_RANKS] = [&[]; MAX_RANKS];
            for (src, part) in srcs.iter_mut().zip(bounce.chunks(per)).take(n) {
                *src = &part[..len];
            }
            reduce_many_bytes(spec.dtype, spec.op, &srcs[..n], &mut out[done..done + len])
                .map_err(|e| Error::internal(format!("low-latency reduction: {e}")))?;
            done += len;
        }
        Ok(())
    }

    /// This rank finished call `s` (`settled`: having seen and checked every member's post
    /// of it): the next may post.
    fn complete(&self, fabric: &Fabric, s: u64, settled: bool) {
        if settled {
            self.settled.store(s, Ordering::Release);
        }
        self.done.store(s, Ordering::Release);
        if self.queued.load(Ordering::SeqCst) > 0 {
            fabric.inbox.notify();
        }
    }

    /// Peers (world ranks) that left the communicator before call `call`.
    fn left_before(&self, fabric: &Fabric, missing: u64, call: u32, op: &dyn Fn() -> Op) -> Result<()> {
        if !fabric.inbox.any_left() {
            return Ok(());
        }
        let ev = fabric.inbox.lock();
        for (p, &w) in self.members.iter().enumerate() {
            if missing & (1 << p) == 0 {
                continue;
            }
            if let Some(l) = ev.left.get(&(self.comm, w)) {
                if l.calls < call {
                    return Err(Error::PeerLeft {
                        rank: self.rank,
                        peer: p,
                        op: op(),
                        how: l.how,
                        peer_calls: u64::from(l.calls),
                        p2p: None,
                        cause: None,
                    });
                }
            }
        }
        Ok(())
    }

    /// World ranks of the members in `set`.
    fn worlds(&self, set: u64) -> impl Iterator<Item = usize> + '_ {
        self.members.iter().enumerate().filter(move |(p, _)| set & (1 << p) != 0).map(|(_, &w)| w)
    }

    /// Runs call `s` (collective call number `call`, descriptor `desc`) on this thread:
    /// post, wait, finish. `input`: the separate input buffer (`None`: in place, the
    /// output holds it); `output`: `None` when this rank wants no result. `tend(now)`
    /// drains the transports, watches the peers and answers probes; `op` names the call
    /// for errors. An error here must be made fatal by the caller (peers may be waiting).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run(
        &self,
        fabric: &Fabric,
        s: u64,
        call: u32,
        desc: &Desc,
        spec: &LlSpec,
        input: Option<&[u8]>,
        output: Option<&mut [u8]>,
        deadline_after: Duration,
        tend: &dyn Fn(Instant),
        op: &dyn Fn() -> Op,
    ) -> Result<()> {
        let n = self.segs.len();
        let (from_out, off, len) = spec.contribution(self.rank, n);
        let src: &[u8] = match (from_out, input, output.as_deref()) {
            (_, _, _) if len == 0 => &[],
            (false, Some(i), _) => i.get(off..off + len).ok_or_else(|| Error::internal("low-latency call: input too short"))?,
            (_, _, Some(o)) => o.get(off..off + len).ok_or_else(|| Error::internal("low-latency call: output too short"))?,
            _ => return Err(Error::internal("low-latency call without its buffers")),
        };
        let place = self.place(s, spec);
        if self.settled.load(Ordering::Acquire) < place.settle_to {
            // Further than it must, so that it settles once in many calls.
            self.settle(fabric, place.settle_to.max(s.saturating_sub(SETTLE_BEHIND)), deadline_after, tend)?;
        }
        self.post(s, call, desc, src, place.line, place.data);
        // A small contribution is kept on the stack too (in place, the output it came
        // from is written before it is read).
        let mut mine = [0u8; INLINE];
        let small = src.len() <= INLINE;
        let len = src.len();
        if small {
            mine[..len].copy_from_slice(src);
        }
        let r = self.wait(fabric, s, place.line, place.want, call, desc, deadline_after, tend, op).and_then(|()| {
            let own = match input {
                _ if small => Own::Posted(&mine[..len]),
                Some(i) => Own::Posted(i),
                None => Own::InPlace,
            };
            self.finish(fabric, place.data, spec, output, own)
        });
        // After the finish, so that its work, not a stall, covers the time the post's
        // stores take to leave (the fence waits for them; see `post`).
        self.wake_sleepers(fabric);
        r?;
        if !place.ring {
            self.last_sync.store(s, Ordering::Relaxed);
        }
        // Waited for every member: the call settled itself.
        self.complete(fabric, s, place.want == self.all_but_me());
        Ok(())
    }

    /// Waits until every member has posted each call up to `upto` that this rank finished
    /// without waiting for all of them ([`LlChannel::needs`]), and checks that each called
    /// what this rank did: a member in another call is a mismatch, found here, late, on
    /// every rank that did not wait for it (two ranks that each broadcast from themselves
    /// both return `Ok`, then both fail at a later call, their next operation off the
    /// slots, or `finalize`). It reads one header line per member, call `upto`'s: its call
    /// number and descriptor are checked against this rank's (still in its own line), and
    /// its digest of the calls before ([`chained`]) stands for theirs; only when something
    /// differs are the calls in between read one by one, to name the first that differs
    /// (their lines still hold them: see the module documentation). An error names the
    /// call it found; it must be made fatal by the caller.
    #[cold]
    #[inline(never)]
    fn settle(&self, fabric: &Fabric, upto: u64, deadline_after: Duration, tend: &dyn Fn(Instant)) -> Result<()> {
        let from = self.settled.load(Ordering::Acquire);
        if from >= upto {
            return Ok(());
        }
        let line = self.posted_line(upto);
        let (call, desc) = self.header(line, self.rank);
        let op = || settled_op(call, &desc);
        let found = match self.wait(fabric, upto, line, self.all_but_me(), call, &desc, deadline_after, tend, &op) {
            Ok(()) => {
                let mine = self.digest(line, self.rank);
                match (0..self.segs.len()).find(|&p| p != self.rank && self.digest(line, p) != mine) {
                    None => {
                        self.settled.fetch_max(upto, Ordering::AcqRel);
                        return Ok(());
                    }
                    Some(p) => self.mismatch(
                        p,
                        op(),
                        format!(
                            "rank {} and rank {p} made different calls before call #{call} (their digests of the calls up to it differ)",
                            self.rank
                        ),
                    ),
                }
            }
            Err(e @ Error::Mismatch { .. }) => e,
            Err(e) => return Err(e),
        };
        // The first call in between that a member who posted `upto` posted differently (a
        // member not there yet is not looked at: the mismatch found names another).
        let there = !self.missing(upto, line, self.all_but_me()) & self.all_but_me();
        for t in from + 1..upto {
            let line = self.posted_line(t);
            let (call, desc) = self.header(line, self.rank);
            let op = || settled_op(call, &desc);
            for p in (0..self.segs.len()).filter(|&p| there & (1 << p) != 0) {
                if !self.arrived(t, line, p) {
                    // It posted `upto`, so `t` too, in the other kind of line.
                    let what = format!(
                        "rank {} called {} as call #{call}, rank {p} a call of another kind or size in its place",
                        self.rank,
                        proto::describe(&desc)
                    );
                    return Err(self.mismatch(p, op(), what));
                }
                self.check_call(line, p, call, &desc, &op)?;
            }
        }
        Err(found)
    }

    /// Settles this rank's last low-latency call if it did not wait for every member (see
    /// [`LlChannel::settle`]): what the communicator's operations that do not run on the
    /// slots do first, and `finalize`.
    pub(crate) fn settle_last(&self, fabric: &Fabric, deadline_after: Duration, tend: &dyn Fn(Instant)) -> Result<()> {
        let last = self.done();
        if self.settled.load(Ordering::Acquire) >= last {
            return Ok(());
        }
        self.settle(fabric, last, deadline_after, tend)
    }

    /// Step 2 on this thread: until every member in `want` (a bit set) has posted `s` (and
    /// called what we did).
    #[allow(clippy::too_many_arguments)]
    fn wait(
        &self,
        fabric: &Fabric,
        s: u64,
        line: usize,
        want: u64,
        call: u32,
        desc: &Desc,
        deadline_after: Duration,
        tend: &dyn Fn(Instant),
        op: &dyn Fn() -> Op,
    ) -> Result<()> {
        let mut missing = want;
        let mut checked = !want;
        let mut spins = 0u32;
        let mut start: Option<Instant> = None;
        let mut tended = None::<Instant>;
        let mut probe_at = None::<Instant>;
        let mut probe_gap = PROBE_AFTER;
        // The doorbell's value is read before each look only once the wait may sleep (past
        // the spin): a sleep needs the value from before its last look.
        let mut slow = false;
        loop {
            let seen = if slow { fabric.inbox.bell_seen() } else { 0 };
            missing = self.missing(s, line, missing);
            let fresh = !missing & !checked & want;
            if fresh != 0 {
                let mut f = fresh;
                while f != 0 {
                    let p = f.trailing_zeros() as usize;
                    f &= f - 1;
                    if let Err(e) = self.check_call(line, p, call, desc, op) {
                        // A cause a peer reports (an abort, a failure) wins over what it
                        // left in its slot.
                        return Err(fabric.cause_behind(&e, &op(), Some(self.view()), &|| tend(Instant::now())).unwrap_or(e));
                    }
                }
                checked |= fresh;
            }
            if missing == 0 {
                return Ok(());
            }
            if fabric.inbox.has_fatal() {
                if let Some(e) = fabric.fatal_error(&op(), Some(self.view())) {
                    return Err(e);
                }
            }
            spins = spins.wrapping_add(1);
            // Between clock reads, spin a little; with no spin at all (ranks share CPUs),
            // every round yields.
            if !self.policy.spin.is_zero() && !spins.is_multiple_of(64) {
                std::hint::spin_loop();
                continue;
            }
            let now = Instant::now();
            let t0 = *start.get_or_insert(now);
            let waited = now - t0;
            if waited < self.policy.spin {
                std::hint::spin_loop();
                continue;
            }
            if !slow {
                // Look once more with the doorbell read first, before anything may sleep;
                // and wake the members that sleep waiting for this rank's post, before this
                // rank may sleep itself.
                slow = true;
                self.wake_sleepers(fabric);
                continue;
            }
            if tended.is_none_or(|t| now - t >= TEND_EVERY) {
                tended = Some(now);
                tend(now);
                self.left_before(fabric, missing, call, op)?;
            }
            if waited >= deadline_after {
                return Err(Error::Timeout {
                    rank: Some(self.rank),
                    op: op(),
                    after: waited,
                    waiting_for: self.worlds(missing).map(|w| format!("rank {w}")).collect(),
                });
            }
            if now >= *probe_at.get_or_insert(t0 + PROBE_AFTER) {
                probe_at = Some(now + probe_gap);
                probe_gap = (probe_gap * 2).min(PROBE_GAP_MAX);
                let msg = proto::encode_probe(self.comm, call, desc);
                for w in self.worlds(missing) {
                    fabric.try_send_now(w, &msg);
                }
            }
            if waited < self.policy.spin + self.policy.yield_for {
                std::thread::yield_now();
            } else {
                let until = (now + PARK_NAP).min(t0 + deadline_after).min(tended.unwrap_or(now) + PARK_NAP);
                fabric.sleep_on_bell_or(seen, until, &|| self.missing(s, line, missing) != missing);
            }
        }
    }
}

/// How [`LlChannel::settle`] names a call it checks late: `call` with descriptor `desc`.
fn settled_op(call: u32, desc: &Desc) -> Op {
    Op::other(format!("{} as call #{call} (its members checked at a later operation)", proto::describe(desc)))
}

/// The digest of a rank's calls up to one (`call`, `desc`) from the digest of those before
/// it (0 before the first): posted with each call (in the high half of its call number's
/// word), so that [`LlChannel::settle`] checks many calls of a member by one word. Two
/// different sequences of calls share a digest by chance only (about 1 in 2^32).
fn chained(prev: u32, call: u32, desc: &Desc) -> u32 {
    const K: u64 = 0x9E37_79B9_7F4A_7C15;
    let (d0, d1) = desc.split_at(8);
    let mut h = (u64::from(prev) << 32 | u64::from(call)).wrapping_mul(K);
    h = (h.rotate_left(31) ^ word(d0)).wrapping_mul(K);
    h = (h.rotate_left(31) ^ word(d1)).wrapping_mul(K);
    (h >> 32) as u32
}

/// What [`LlChannel::place`] says of a call.
#[derive(Clone, Copy)]
struct Place {
    /// The members (a bit set) whose posts it waits for.
    want: u64,
    /// A ring call (see [`RING`]).
    ring: bool,
    /// Its header line in every member's segment.
    line: usize,
    /// Where every member's data for it lies in its segment.
    data: usize,
    /// Every member must have posted the calls up to this one (and this rank checked them)
    /// before this rank posts it.
    settle_to: u64,
}

/// Where a call's finish reads this rank's own contribution. Not from its slot when it can
/// be helped: the members have just read the slot's cache lines, and reading them back
/// measured slower than private memory (2 ranks pinned, alternating A/B: allreduce 8-32 B
/// 0.87-0.89x the time, 1 KiB 0.89-0.93x, 16-64 KiB 0.95-0.98x), as if the lines had left
/// this core (a protocol that hands a line over to the reader, as AMD's migratory sharing
/// does, would do that).
#[derive(Clone, Copy)]
enum Own<'a> {
    /// A private copy of the bytes posted (the contribution, or the call's separate input,
    /// which holds it at the same offsets).
    Posted(&'a [u8]),
    /// In place: the output holds the contribution until the finish writes it.
    InPlace,
    /// Only the slot (the engine's calls, whose buffers are regions).
    Slot,
}

/// [`Own`] for one block of the output.
#[derive(Clone, Copy)]
enum OwnBlock<'a> {
    Here(&'a [u8]),
    /// The block the reduction writes holds this rank's bytes until then.
    InOut,
    Slot,
}

/// A low-latency call run by the engine (a non-blocking call, a plan started in a scope, a
/// group's member, or a blocking call behind one of those).
#[derive(Debug)]
pub(crate) struct LlRun {
    pub(crate) chan: Arc<LlChannel>,
    pub(crate) spec: LlSpec,
    /// The call's number on the channel (assigned at submission).
    pub(crate) s: u64,
    /// Its header line and where its data lies ([`LlChannel::place`] of `s`).
    line: usize,
    data: usize,
    posted: bool,
    checked: u64,
    /// Counted in the channel's `queued`.
    queued: bool,
}

impl LlRun {
    pub(crate) fn new(chan: Arc<LlChannel>, spec: LlSpec) -> LlRun {
        LlRun { chan, spec, s: 0, line: 0, data: 0, posted: false, checked: 0, queued: false }
    }

    /// Numbered `s` and handed to the engine.
    pub(crate) fn submitted(&mut self, s: u64) {
        self.s = s;
        let place = self.chan.place(s, &self.spec);
        (self.line, self.data) = (place.line, place.data);
        self.posted = false;
        self.checked = 0;
        if !self.queued {
            self.queued = true;
            self.chan.queue(true);
        }
    }

    /// Out of the engine (finished, failed or abandoned).
    pub(crate) fn leave(&mut self) {
        if self.queued {
            self.queued = false;
            self.chan.queue(false);
        }
    }

    /// Whether a round would move it now (looked at before the engine sleeps).
    pub(crate) fn ready(&self) -> bool {
        if !self.posted {
            return self.may_post();
        }
        self.chan.missing(self.s, self.line, self.chan.all_but_me()) == 0
    }

    /// Whether this rank finished the call before (and so every member posted it: a call
    /// this rank finished without waiting for every member was settled when the
    /// communicator's next operation was submitted, see `Communicator::submit`).
    fn may_post(&self) -> bool {
        self.chan.done() + 1 == self.s
    }

    /// Members (world ranks) it waits for.
    pub(crate) fn waiting_for(&self) -> Vec<usize> {
        if !self.posted {
            return Vec::new();
        }
        self.chan.worlds(self.chan.missing(self.s, self.line, self.chan.all_but_me())).collect()
    }

    /// Moves the call as far as it goes now.
    pub(crate) fn poll(
        &mut self,
        fabric: &Fabric,
        call: u32,
        desc: &Desc,
        input: Option<&ferroccl_mem::region::RegionHandle>,
        output: &ferroccl_mem::region::RegionHandle,
        op: &Op,
    ) -> Result<Poll<()>> {
        let chan = &*self.chan;
        let named = || op.numbered(call);
        let mut moved = false;
        if !self.posted {
            if !self.may_post() {
                return Ok(Poll::Idle);
            }
            let (from_out, off, len) = self.spec.contribution(chan.rank, chan.segs.len());
            let region = match (from_out, input) {
                (false, Some(i)) => i,
                _ => output,
            };
            region
                .with_slice(off, len, |src| chan.post(self.s, call, desc, src, self.line, self.data))
                .map_err(|e| Error::internal(format!("{}: low-latency post: {e}", named())))?;
            // The engine may sleep before it looks again: wake sleeping members now.
            chan.wake_sleepers(fabric);
            self.posted = true;
            moved = true;
        }
        let all = chan.all_but_me();
        let line = self.line;
        let missing = chan.missing(self.s, line, all);
        let fresh = !missing & !self.checked & all;
        let mut f = fresh;
        while f != 0 {
            let p = f.trailing_zeros() as usize;
            f &= f - 1;
            chan.check_call(line, p, call, desc, &named)?;
        }
        self.checked |= fresh;
        if missing != 0 {
            chan.left_before(fabric, missing, call, &named)?;
            return Ok(if moved { Poll::Moved } else { Poll::Idle });
        }
        let len = output.len();
        output
            .with_slice_mut(0, len, |out| chan.finish(fabric, self.data, &self.spec, Some(out), Own::Slot))
            .map_err(|e| Error::internal(format!("{}: low-latency result: {e}", named())))??;
        chan.complete(fabric, self.s, true);
        self.leave();
        Ok(Poll::Ready(()))
    }
}
