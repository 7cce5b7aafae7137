//! The progress engine: runs every operation in flight on a fabric (the communicators that
//! share one set of connections) to completion.
//!
//! # Threading model
//!
//! An operation is submitted as a [`Job`] and completes when its schedule has run. Whoever
//! holds the engine's *driver* role advances every job in flight, round after round: drain
//! the shared-memory inbox, advance each job's transfers and local steps, complete what is
//! finished, watch the peers and the deadlines. Two kinds of thread take that role:
//!
//! * a thread waiting for a job (`wait`, a blocking call) drives itself, so a blocking call
//!   costs no hand-off between threads;
//! * the engine's background thread (one per fabric, started on first use) drives while jobs
//!   are in flight and nobody waits: a non-blocking collective progresses while its caller
//!   computes. It gives the role up as soon as a thread starts waiting.
//!
//! Idle rounds back off: spin, then yield, then sleep on the fabric's doorbell (a futex that
//! peers and transport threads bump when something arrives, for at most a few ms so that
//! peer health and deadlines are still looked at). With no job in flight the background
//! thread parks on a condition variable and uses no CPU.
//!
//! Low-latency calls (`crate::ll`) of a communicator whose ranks are all on this host run
//! outside the engine, on the caller's thread, when they are blocking calls or plans and no
//! earlier low-latency call of the communicator is still a job here; otherwise they are
//! parts of jobs like any other (`Part::ll`), and a waiter's tending (`Engine::tend`) does
//! for them what a round does: drain, watch, answer probes, serve one-sided requests.
//!
//! Completion order: jobs of one communicator are matched between ranks by the sequence
//! numbers assigned when they are submitted, so several may be in flight at once and they
//! complete as if issued in order (every rank must issue them in the same order).

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::task::Waker;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ferroccl_kernels::{DType, ReduceOp};
use ferroccl_mem::region::RegionHandle;

use crate::algo::Schedule;
use crate::error::{Departure, Error, Fault, FaultKind, Op, Result};
use crate::exec::{Buffers, Exec, RunSpec};
use crate::fabric::{Fabric, PARK_NAP};
use crate::flight::{self, Flight, Who};
use crate::inbox::{Backoff, Scope, View};
use crate::ll::LlRun;
use crate::p2p::XferCtx;
use crate::params::{FaultSite, FlightDest};
use crate::poll::Poll;
use crate::proto::{self, Desc, Leave, CHANNELS};
use crate::rma::RmaServer;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Where one communicator's ordered streams stand: the next sequence number of each
/// (channel, direction, peer), flattened, the number of calls every member makes
/// (collectives, barriers, splits) submitted so far, and the flight recorder of the last
/// calls (it knows the communicator's id and members; the engine reaches it through a weak
/// reference, to answer probes and to dump it). Owned by the communicator.
#[derive(Debug)]
pub(crate) struct Streams {
    next: Vec<u32>,
    calls: u32,
    /// Low-latency calls numbered so far (see `crate::ll`).
    ll: u64,
    /// The communicator's flight recorder: every numbered call is written to it.
    flight: Arc<Flight>,
}

/// Calls whose descriptors a communicator remembers for probes, at least (the flight
/// recorder's ring, whatever `FERROCCL_FLIGHT_ENTRIES` says).
const RECENT_CALLS: usize = 16;

impl Streams {
    fn new(id: u32, members: Arc<[usize]>, rank: usize, flight_entries: usize) -> Streams {
        let n = members.len();
        let flight = Arc::new(Flight::new(id, rank, members, flight_entries));
        Streams { next: vec![0; CHANNELS * 2 * n], calls: 0, ll: 0, flight }
    }

    /// The communicator's flight recorder.
    pub(crate) fn flight(&self) -> &Arc<Flight> {
        &self.flight
    }

    fn index(&self, chan: u8, send: bool, peer: usize) -> usize {
        let n = self.next.len() / (CHANNELS * 2);
        (usize::from(chan).min(CHANNELS - 1) * 2 + usize::from(send)) * n + peer.min(n.saturating_sub(1))
    }

    /// Takes the next number of the stream (`chan`, send or receive, `peer`).
    pub(crate) fn next(&mut self, chan: u8, send: bool, peer: usize) -> u32 {
        let i = self.index(chan, send, peer);
        let v = self.next[i];
        self.next[i] = v.wrapping_add(1);
        v
    }

    /// Numbers the next call every member makes (from 1), with descriptor `desc`.
    pub(crate) fn next_call(&mut self, desc: &Desc) -> u32 {
        self.calls = self.calls.wrapping_add(1);
        self.flight.posted(self.calls, desc);
        self.calls
    }

    /// Low-latency calls numbered so far.
    pub(crate) fn ll_calls(&self) -> u64 {
        self.ll
    }

    /// Numbers the next low-latency call (from 1).
    pub(crate) fn next_ll(&mut self) -> u64 {
        self.ll += 1;
        self.ll
    }

    /// What this rank tells member `peer` when it leaves.
    pub(crate) fn leave(&self, how: Departure, peer: usize) -> Leave {
        let mut l = Leave { how, calls: self.calls, sent: [0; CHANNELS], recv: [0; CHANNELS] };
        for c in 0..CHANNELS {
            l.sent[c] = self.next[self.index(c as u8, true, peer)];
            l.recv[c] = self.next[self.index(c as u8, false, peer)];
        }
        l
    }
}

/// One schedule of a job, with its buffers and its stream positions. A group job has
/// several.
#[derive(Debug)]
pub(crate) struct Part {
    /// For errors: "allreduce (1024 x f32, sum, ring)".
    pub(crate) name: Op,
    pub(crate) chan: u8,
    pub(crate) desc: Desc,
    /// The call's number among the calls every member makes (collective channel; assigned
    /// at submission), 0 for point-to-point.
    pub(crate) call: u32,
    pub(crate) eager_max: usize,
    pub(crate) sched: Arc<Schedule>,
    /// Sequence number of every transfer step.
    pub(crate) seqs: Vec<u32>,
    pub(crate) dtype: DType,
    pub(crate) op: ReduceOp,
    pub(crate) input: Option<RegionHandle>,
    pub(crate) output: RegionHandle,
    pub(crate) scratch: RegionHandle,
    pub(crate) exec: Exec,
    pub(crate) finished: bool,
    /// A fused group's results to copy out when the part finishes: (destination,
    /// offset in `output`).
    pub(crate) unpack: Vec<(RegionHandle, usize)>,
    /// Starts only once every earlier part of its job has finished (a transfer plan's
    /// signals, raised after all of its writes have landed).
    pub(crate) after_others: bool,
    /// A low-latency call (see `crate::ll`): runs instead of the (empty) schedule.
    pub(crate) ll: Option<LlRun>,
}

impl Part {
    /// Gets the part ready to run (again): fresh progress, same buffers.
    pub(crate) fn reset(&mut self, size: usize) {
        self.exec.reset(self.sched.steps.len(), size);
        self.finished = false;
    }

    /// Makes room for every transfer the part's schedule has in flight at once (see
    /// `Exec::reserve`): for a part run many times, so that no run allocates.
    pub(crate) fn reserve(&mut self, size: usize) {
        self.exec.reserve(&self.sched, size);
    }

    /// World ranks the part waits for.
    fn waiting_for(&self) -> Vec<usize> {
        match &self.ll {
            Some(ll) => ll.waiting_for(),
            None => self.exec.waiting_for(),
        }
    }
}

/// What a job runs: its parts, the communicator they belong to, and the deadline.
#[derive(Debug)]
pub(crate) struct JobBody {
    pub(crate) comm: u32,
    pub(crate) rank: usize,
    pub(crate) members: Arc<[usize]>,
    pub(crate) parts: Vec<Part>,
    pub(crate) deadline: Instant,
    /// From a start to the deadline: `FERROCCL_TIMEOUT`, or the operation's own.
    pub(crate) timeout: Duration,
    pub(crate) started: Instant,
    /// When to probe the peers this job waits for next (see [`ProtoMsg::Probe`]), and the
    /// gap before the one after.
    ///
    /// [`ProtoMsg::Probe`]: crate::proto::ProtoMsg::Probe
    pub(crate) probe_at: Instant,
    pub(crate) probe_gap: Duration,
    /// The value the signal steps of this run raise (a transfer plan's version).
    pub(crate) signal: u64,
    /// The communicator's flight recorder: told when a collective part finishes.
    pub(crate) flight: Option<Arc<Flight>>,
}

/// A collective call that has waited this long tells the peers it waits for which call it
/// is in; then again after twice as long, up to [`PROBE_GAP_MAX`].
pub(crate) const PROBE_AFTER: Duration = Duration::from_millis(50);
const PROBE_GAP_MAX: Duration = Duration::from_secs(1);

impl JobBody {
    /// Starts the job's clocks at `now`, with `timeout` to its deadline.
    pub(crate) fn start_clock(&mut self, now: Instant, timeout: Duration) {
        self.timeout = timeout;
        self.started = now;
        self.deadline = now + timeout;
        self.probe_at = now + PROBE_AFTER;
        self.probe_gap = PROBE_AFTER;
    }

    /// Tells each peer a waiting collective part waits for which call it is in (best
    /// effort, nothing waits), once the job has waited long enough.
    fn probe(&mut self, fabric: &Fabric, now: Instant) {
        if now < self.probe_at {
            return;
        }
        self.probe_at = now + self.probe_gap;
        self.probe_gap = (self.probe_gap * 2).min(PROBE_GAP_MAX);
        for p in self.parts.iter().filter(|p| !p.finished && p.call != 0) {
            let msg = proto::encode_probe(self.comm, p.call, &p.desc);
            for w in p.waiting_for() {
                fabric.try_send_now(w, &msg);
            }
        }
    }
    /// The job as errors name it: its first part, with its call number.
    fn label(&self) -> Op {
        self.parts.first().map(|p| p.name.numbered(p.call)).unwrap_or_else(|| Op::other("operation"))
    }

    /// The job's communicator as fault scopes see it.
    fn view(&self) -> View<'_> {
        View { comm: self.comm, members: &self.members }
    }

    /// The world rank of member `r` (`r` itself if out of range: errors only).
    fn world(&self, r: usize) -> usize {
        self.members.get(r).copied().unwrap_or(r)
    }

    /// One round: advance every unfinished part.
    fn poll(&mut self, fabric: &Fabric) -> Result<Poll<()>> {
        let mut moved = false;
        let mut all = true;
        let JobBody { comm, rank, members, parts, deadline, signal, flight, .. } = self;
        let mut earlier_done = true;
        for p in parts.iter_mut() {
            if p.finished {
                continue;
            }
            if p.after_others && !earlier_done {
                all = false;
                continue;
            }
            let cx = XferCtx {
                fabric,
                comm: *comm,
                members,
                chan: p.chan,
                rank: *rank,
                op: &p.name,
                deadline: *deadline,
                desc: p.desc,
                call: p.call,
                eager_max: p.eager_max,
            };
            let run = RunSpec {
                sched: &p.sched,
                seqs: &p.seqs,
                members,
                dtype: p.dtype,
                op: p.op,
                bufs: Buffers { input: p.input.as_ref(), output: &p.output, scratch: &p.scratch },
                signal: *signal,
            };
            let polled = match &mut p.ll {
                Some(ll) => ll.poll(fabric, p.call, &p.desc, p.input.as_ref(), &p.output, &p.name)?,
                None => p.exec.poll(&cx, &run)?,
            };
            match polled {
                Poll::Ready(()) => {
                    if !p.unpack.is_empty() && fabric.params.injects(FaultSite::FusedCopy, fabric.rank) {
                        return Err(Error::internal(format!("{}: copying a fused result out: injected by FERROCCL_INJECT_FAULT", p.name)));
                    }
                    for (dst, off) in &p.unpack {
                        let len = dst.len();
                        p.output
                            .with_slice(*off, len, |s| dst.write_at(0, s))
                            .and_then(|r| r)
                            .map_err(|e| Error::internal(format!("{}: copying a fused result out: {e}", p.name)))?;
                    }
                    if p.chan == proto::CHAN_COLL && p.ll.is_none() {
                        // Nothing a member sent for this call (or an earlier one) is left.
                        cx.left_over(&|c| flight.as_ref().is_some_and(|f| f.is_done(c)))?;
                    }
                    p.finished = true;
                    if p.chan == proto::CHAN_COLL && p.call != 0 {
                        if let Some(f) = flight {
                            f.finished(p.call);
                        }
                    }
                    moved = true;
                }
                Poll::Moved => {
                    moved = true;
                    all = false;
                }
                Poll::Idle => all = false,
            }
            earlier_done &= p.finished;
        }
        Ok(if all {
            Poll::Ready(())
        } else if moved {
            Poll::Moved
        } else {
            Poll::Idle
        })
    }

    fn waiting_for(&self) -> Vec<usize> {
        let mut w: Vec<usize> = self.parts.iter().filter(|p| !p.finished).flat_map(|p| p.waiting_for()).collect();
        w.sort_unstable();
        w.dedup();
        w
    }

    /// After the last round (success or failure): drop transfers still in flight (revoking
    /// lent buffers). Registrations stay in the fabric's cache (their handles end with the
    /// call's scope).
    fn end(&mut self) {
        for p in &mut self.parts {
            p.exec.abandon();
            if let Some(ll) = &mut p.ll {
                ll.leave();
            }
        }
    }

    /// Whether a low-latency part could move now (looked at before the driver sleeps:
    /// their peers ring the doorbell only for sleepers).
    fn ll_ready(&self) -> bool {
        self.parts.iter().any(|p| !p.finished && p.ll.as_ref().is_some_and(LlRun::ready))
    }
}

/// An operation in flight and its completion.
#[derive(Debug)]
pub(crate) struct Job {
    body: Mutex<JobBody>,
    done: AtomicBool,
    /// Whether a thread has waited for it (a blocking call, or a scope's wait): that
    /// thread makes no other call until it is done.
    waited: AtomicBool,
    /// Whether a caller has seen the outcome (a scope reports errors nobody saw).
    observed: AtomicBool,
    error: Mutex<Option<Error>>,
    waker: Mutex<Option<Waker>>,
}

impl Job {
    pub(crate) fn new(body: JobBody) -> Arc<Job> {
        Arc::new(Job {
            body: Mutex::new(body),
            done: AtomicBool::new(false),
            waited: AtomicBool::new(false),
            observed: AtomicBool::new(false),
            error: Mutex::new(None),
            waker: Mutex::new(None),
        })
    }

    /// The job's body, for a plan to reset between runs (never while it runs).
    pub(crate) fn body(&self) -> MutexGuard<'_, JobBody> {
        lock(&self.body)
    }

    pub(crate) fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    /// The outcome once done (`Err` stays for later calls: it is cloned out).
    pub(crate) fn result(&self) -> Result<()> {
        match &*lock(&self.error) {
            None => Ok(()),
            Some(e) => Err(e.duplicate()),
        }
    }

    /// The outcome of a finished job, marked as seen.
    pub(crate) fn observe(&self) -> Result<()> {
        self.observed.store(true, Ordering::Release);
        self.result()
    }

    /// The outcome of a finished job if nobody has seen it yet.
    pub(crate) fn observe_if_unobserved(&self) -> Result<()> {
        if self.observed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        self.result()
    }

    /// Registers the waker of an async caller; `true` if the job finished meanwhile.
    pub(crate) fn set_waker(&self, w: &Waker) -> bool {
        let mut g = lock(&self.waker);
        match &*g {
            Some(old) if old.will_wake(w) => {}
            _ => *g = Some(w.clone()),
        }
        drop(g);
        self.is_done()
    }

    /// Marks a plan's job as not done before it is submitted again.
    pub(crate) fn rearm(&self) {
        *lock(&self.error) = None;
        self.observed.store(false, Ordering::Release);
        self.done.store(false, Ordering::Release);
    }

    fn finish(&self, r: Result<()>) {
        lock(&self.body).end();
        if let Err(e) = r {
            *lock(&self.error) = Some(e);
        }
        self.done.store(true, Ordering::Release);
        if let Some(w) = lock(&self.waker).take() {
            w.wake();
        }
    }
}

/// What the background thread shares with the engine without keeping it alive: the counts
/// it decides by and where it parks.
#[derive(Debug, Default)]
struct Park {
    /// Jobs submitted and not yet finished.
    pending: AtomicUsize,
    /// Threads in `wait`.
    waiters: AtomicUsize,
    /// Live one-sided windows: while there are any, the background thread keeps driving
    /// (asleep on the doorbell between requests), so that peers' requests are served
    /// whether or not this rank is in a call.
    serving: AtomicUsize,
    /// Verbs peers' window regions this rank holds (shared with the fabric's
    /// `PeerRegions`): while there are any, the background thread keeps driving too, so
    /// that their owners' `REVOKE`s are answered whether or not this rank is in a call.
    held: Arc<AtomicUsize>,
    /// Set once the background thread has been started.
    started: AtomicBool,
    state: Mutex<ParkState>,
    wake: Condvar,
}

#[derive(Debug, Default)]
struct ParkState {
    shutdown: bool,
    thread: Option<JoinHandle<()>>,
}

/// The engine: owns the fabric (one per world: the communicators split from it share it)
/// and runs every call over it. Communicators hold it; the last one to go closes it.
#[derive(Debug)]
pub(crate) struct Engine {
    fabric: Fabric,
    /// Jobs submitted and not yet picked up by the driver.
    submitted: Mutex<Vec<Arc<Job>>>,
    /// The driver role, and the jobs it is running (in submission order).
    driver: Mutex<Vec<Arc<Job>>>,
    park: Arc<Park>,
    /// Driver rounds so far (the clock is read every [`CLOCK_EVERY`]).
    rounds: AtomicU32,
    /// The flight recorder of every communicator on this fabric: its calls answer probes
    /// and are dumped on failure, without the streams' locks (a dump may happen where they
    /// must not be taken).
    flights: Mutex<Vec<Weak<Flight>>>,
    /// Set once the flight records are written (see [`Engine::dump_flight`]).
    flight_dumped: AtomicBool,
    flight_dumping: Mutex<()>,
    closed: AtomicBool,
    /// The window server (see `crate::rma`).
    rma: RmaServer,
    /// The ranks on this machine outnumber its CPUs: an idle driver yields at once instead
    /// of spinning (the rank it waits for may need this CPU).
    shared_cpus: bool,
}

/// Rounds between clock reads.
const CLOCK_EVERY: u32 = 16;

impl Drop for Engine {
    fn drop(&mut self) {
        self.close();
    }
}

impl Engine {
    /// The engine of `fabric`.
    pub(crate) fn new(fabric: Fabric) -> Arc<Engine> {
        let park = Arc::new(Park { held: fabric.peer_regions.held_counter(), ..Park::default() });
        let online = std::thread::available_parallelism().map_or(1, usize::from);
        let shared_cpus = fabric.ranks_on_this_machine() > online;
        let engine = Arc::new(Engine {
            shared_cpus,
            fabric,
            submitted: Mutex::default(),
            driver: Mutex::default(),
            park,
            rounds: AtomicU32::new(0),
            flights: Mutex::default(),
            flight_dumped: AtomicBool::new(false),
            flight_dumping: Mutex::default(),
            closed: AtomicBool::new(false),
            rma: RmaServer::default(),
        });
        let weak = Arc::downgrade(&engine);
        engine.fabric.on_fatal(Box::new(move |reason| {
            if let Some(e) = weak.upgrade() {
                e.dump_flight(reason);
            }
        }));
        engine
    }

    /// The fabric every call runs over.
    pub(crate) fn fabric(&self) -> &Fabric {
        &self.fabric
    }

    /// Stops the background thread, then closes the fabric (says goodbye to every peer).
    /// Idempotent.
    pub(crate) fn close(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        self.shutdown();
        self.fabric.close();
    }

    /// The stream state of a new communicator (`id`, its members' world ranks, this rank
    /// in it), known to the engine from now on.
    pub(crate) fn streams(&self, id: u32, members: Arc<[usize]>, rank: usize) -> Arc<Mutex<Streams>> {
        let p = &self.fabric.params;
        let entries = if p.flight_recorder == FlightDest::Off { 0 } else { p.flight_entries };
        // The ring also answers the peers' probes: it keeps the last RECENT_CALLS at least.
        let entries = entries.max(RECENT_CALLS);
        let st = Streams::new(id, members, rank, entries);
        let mut flights = lock(&self.flights);
        flights.retain(|w| w.strong_count() > 0);
        flights.push(Arc::downgrade(st.flight()));
        Arc::new(Mutex::new(st))
    }

    /// Writes the flight record of every communicator on this fabric (see
    /// `crate::flight`) to stderr, or to the file `FERROCCL_FLIGHT_RECORDER` names; called
    /// whenever a call fails for good (see `Fabric::fatal_seen`): the first time the whole records,
    /// later only what was added to them since (usually nothing).
    pub(crate) fn dump_flight(&self, reason: &str) {
        if self.fabric.params.flight_recorder == FlightDest::Off {
            return;
        }
        // One dump at a time, so that the pieces of a record are written in order.
        let _one = lock(&self.flight_dumping);
        let flights: Vec<Arc<Flight>> = lock(&self.flights).iter().filter_map(Weak::upgrade).collect();
        let tag = self.fabric.tag();
        let launch: Vec<usize> = (0..self.fabric.size).map(|w| self.fabric.launch_rank(w)).collect();
        let who = Who { world: self.fabric.rank, launch: &launch, fabric: &tag };
        let lines: Vec<String> = flights.iter().flat_map(|f| f.take_dump(who, reason)).collect();
        if lines.is_empty() {
            return;
        }
        self.flight_dumped.store(true, Ordering::Release);
        self.write_flight(&lines);
    }

    fn write_flight(&self, lines: &[String]) {
        let launch = self.fabric.launch_rank(self.fabric.rank);
        let mut text = String::new();
        for l in lines {
            text.push_str(l);
            text.push('\n');
        }
        match &self.fabric.params.flight_recorder {
            FlightDest::Off => {}
            FlightDest::Files(prefix) => {
                let said = match flight::write_file(prefix, launch, &text) {
                    Ok(None) => return,
                    Ok(Some(path)) => format!("ferroccl: rank {launch}: flight record written to {}\n", path.to_string_lossy()),
                    Err((path, e)) => {
                        format!("ferroccl: rank {launch}: cannot write the flight record to {}: {e}\n{text}", path.to_string_lossy())
                    }
                };
                let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), said.as_bytes());
            }
            FlightDest::Stderr => {
                let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), text.as_bytes());
            }
        }
    }

    /// Answers the peers' probes: a peer in call `k` of a communicator whose call `k` here
    /// had another descriptor is a mismatch, fatal at once, even if neither side ever sends
    /// the other data (both only receive, as in a reduce where each thinks itself the root).
    /// So is a peer in a call this rank has not made while a thread of this rank waits for
    /// a point-to-point transfer with that peer (see [`Engine::p2p_left_behind`]; `jobs`:
    /// the driver's jobs, `None` outside a round).
    fn answer_probes(&self, jobs: Option<&[Arc<Job>]>) {
        let fabric = &self.fabric;
        let probes = fabric.inbox.take_probes();
        for (peer, comm, call, theirs) in probes {
            let flight = lock(&self.flights).iter().filter_map(Weak::upgrade).find(|f| f.comm().0 == comm);
            let Some(flight) = flight else { continue };
            let (_, me, members) = flight.comm();
            let view = View { comm, members };
            let Some(mine) = flight.desc_of(call) else {
                if let Some(jobs) = jobs {
                    self.p2p_left_behind(jobs, &flight, peer, call, &theirs);
                }
                continue;
            };
            if mine == theirs {
                continue;
            }
            let p = members.iter().position(|&w| w == peer).unwrap_or(peer);
            let d = proto::describe;
            let fault = Fault {
                kind: FaultKind::Mismatch,
                culprit: Some(peer),
                reporter: None,
                op: format!("{} call #{call}", d(&mine)),
                what: format!("rank {me} called {} as call #{call}, rank {p} called {} as call #{call}", d(&mine), d(&theirs)),
            };
            fabric.poison_fault(fault, Scope::Comm(comm), Some(view));
        }
    }

    /// A peer (world rank `peer`) waits in collective call `call` (descriptor `theirs`) of
    /// `flight`'s communicator, which this rank has not made, while a thread of this rank
    /// waits for a point-to-point transfer with that peer on it (a blocking `send` or
    /// `recv`, or a scope's wait, with nothing but point-to-point transfers in it): neither
    /// can go on (this thread makes no call before the transfer ends, and the peer matches
    /// none before its call ends), so the calls do not match. Fails the communicator at once
    /// with a mismatch naming both calls, on both sides (the peer is told), instead of both
    /// waiting until the timeout.
    fn p2p_left_behind(&self, jobs: &[Arc<Job>], flight: &Flight, peer: usize, call: u32, theirs: &Desc) {
        let (comm, me, members) = flight.comm();
        let last = flight.last_call();
        // Only a call later than every call made here (a peer behind is not waiting for us).
        if (call.wrapping_sub(last) as i32) <= 0 {
            return;
        }
        for job in jobs.iter().filter(|j| !j.is_done() && j.waited.load(Ordering::Acquire)) {
            let body = lock(&job.body);
            // Two-sided transfers only: one-sided reads and writes are served by the owner
            // whatever call it is in.
            let two_sided =
                |p: &Part| p.chan == proto::CHAN_USER && matches!(p.name, Op::Send { .. } | Op::Recv { .. } | Op::SendRecv { .. });
            if body.comm != comm || !body.parts.iter().all(two_sided) {
                continue;
            }
            let Some(part) = body.parts.iter().find(|p| !p.finished && p.waiting_for().contains(&peer)) else { continue };
            let p = members.iter().position(|&w| w == peer).unwrap_or(peer);
            let after = if last == 0 { String::from("before any collective") } else { format!("after call #{last}") };
            let fault = Fault {
                kind: FaultKind::Mismatch,
                culprit: Some(peer),
                reporter: None,
                op: part.name.to_string(),
                what: format!(
                    "rank {me} waits in {} ({after}) while rank {p} called {} as call #{call}: the point-to-point transfer is never matched",
                    part.name,
                    proto::describe(theirs)
                ),
            };
            drop(body);
            self.fabric.poison_fault(fault, Scope::Comm(comm), Some(View { comm, members }));
            return;
        }
    }

    /// What a thread waiting outside the engine (a low-latency call) does every so often:
    /// drain the transports, watch the peers (`now`: the caller's clock reading), answer
    /// probes.
    pub(crate) fn tend(&self, now: Instant) {
        self.drain();
        self.fabric.check_health(now);
        self.answer_probes(None);
        if !self.fabric.all_failed() {
            self.serve_rma(self.serving());
        }
    }

    /// Whether this rank has windows to serve or verbs peers' regions to answer for.
    fn serving(&self) -> bool {
        self.park.serving.load(Ordering::Relaxed) > 0 || self.park.held.load(Ordering::Relaxed) > 0
    }

    /// Drains the transports into the inbox; a transport whose poll itself failed (without
    /// recording why) poisons the fabric.
    fn drain(&self) {
        if let Err(e) = self.fabric.progress() {
            if !self.fabric.all_failed() {
                let _ = self.fabric.poison(e);
            }
        }
    }

    /// Serves the peers' one-sided requests (they wait for nothing but this rank): while
    /// `serving`, or whenever one arrived (every access is refused with no window left, and
    /// signals need no window). Whether anything was served.
    fn serve_rma(&self, serving: bool) -> bool {
        (serving || self.fabric.inbox.rma_pending()) && self.rma.serve(&self.fabric)
    }

    /// Whether any job in `jobs` has a low-latency part that could move now.
    fn ll_ready(jobs: &[Arc<Job>]) -> bool {
        jobs.iter().any(|j| j.body.try_lock().is_ok_and(|b| b.ll_ready()))
    }

    /// Hands `job` to the engine. With `will_wait`, the caller is about to wait for it (and
    /// drive); otherwise the background thread is woken to drive it.
    pub(crate) fn submit(self: &Arc<Self>, job: Arc<Job>, will_wait: bool) {
        self.park.pending.fetch_add(1, Ordering::SeqCst);
        lock(&self.submitted).push(job);
        self.fabric.inbox.notify();
        if !will_wait {
            self.wake_background();
        } else if !self.park.started.load(Ordering::Relaxed) && self.fabric.any_remote_memory() {
            // A read of a verbs peer's window may make this rank a holder of its region,
            // which must answer the owner's `REVOKE` outside calls too: the thread must
            // exist by then (`wait` wakes it when it leaves with regions held).
            self.wake_background();
        }
    }

    fn wake_background(self: &Arc<Self>) {
        let mut p = lock(&self.park.state);
        if p.shutdown {
            return;
        }
        if p.thread.is_none() {
            let (park, weak) = (Arc::clone(&self.park), Arc::downgrade(self));
            let spawned = std::thread::Builder::new()
                .name(format!("ferroccl-progress-{}", self.fabric.rank))
                .spawn(move || Engine::background(&park, &weak));
            // Without the thread, jobs still progress when waited for.
            p.thread = spawned.ok();
            self.park.started.store(p.thread.is_some(), Ordering::Relaxed);
        }
        drop(p);
        self.park.wake.notify_one();
    }

    /// A window was registered: serve requests from now on, in the background too.
    pub(crate) fn serve_window(self: &Arc<Self>) {
        self.park.serving.fetch_add(1, Ordering::SeqCst);
        self.wake_background();
    }

    /// A window was dropped.
    pub(crate) fn unserve_window(&self) {
        self.park.serving.fetch_sub(1, Ordering::SeqCst);
    }

    /// Whether the background thread has anything to drive: jobs, or windows to serve.
    fn busy(park: &Park) -> bool {
        park.pending.load(Ordering::SeqCst) > 0 || park.serving.load(Ordering::SeqCst) > 0 || park.held.load(Ordering::SeqCst) > 0
    }

    /// Makes sure the background thread drives the jobs in flight (an async caller waits
    /// without driving).
    pub(crate) fn ensure_background(self: &Arc<Self>) {
        if self.park.pending.load(Ordering::SeqCst) > 0 {
            self.wake_background();
        }
    }

    /// One round, if no other thread is driving (`test`).
    pub(crate) fn try_round(&self) {
        if let Ok(mut jobs) = self.driver.try_lock() {
            self.round(&mut jobs, true);
        }
    }

    /// Stops the background thread.
    fn shutdown(&self) {
        let t = {
            let mut p = lock(&self.park.state);
            p.shutdown = true;
            p.thread.take()
        };
        self.park.wake.notify_all();
        if let Some(t) = t {
            // The last reference to the engine may be dropped on its thread itself.
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }

    /// The background thread: parks while nothing is in flight or a waiter drives; drives
    /// otherwise. Holds the engine only while it drives, so that the last communicator's
    /// drop ends it.
    fn background(park: &Park, engine: &Weak<Engine>) {
        loop {
            {
                let mut p = lock(&park.state);
                while !p.shutdown && (!Engine::busy(park) || park.waiters.load(Ordering::SeqCst) > 0) {
                    p = park.wake.wait(p).unwrap_or_else(|e| e.into_inner());
                }
                if p.shutdown {
                    return;
                }
            }
            let Some(engine) = engine.upgrade() else { return };
            match engine.driver.try_lock() {
                Ok(mut jobs) => {
                    let _drive = engine.fabric.drive_sockets();
                    let mut backoff = Backoff::new(engine.shared_cpus);
                    loop {
                        let seen = engine.fabric.inbox.bell_seen();
                        let moved = engine.round(&mut jobs, backoff.is_slow());
                        if !Engine::busy(park) || park.waiters.load(Ordering::SeqCst) > 0 || lock(&park.state).shutdown {
                            break;
                        }
                        if moved {
                            backoff.moved();
                        } else {
                            backoff.idle(PARK_NAP, None, |until| engine.fabric.sleep_on_bell_or(seen, until, &|| Engine::ll_ready(&jobs)));
                        }
                    }
                    // A waiter may be asleep until the driver role is free: ring.
                    drop(jobs);
                    engine.fabric.inbox.notify();
                }
                // A waiter drives; it wakes us when it leaves with jobs still in flight.
                Err(_) => std::thread::sleep(Duration::from_micros(200)),
            };
        }
    }

    /// Waits for `job` until it is done or `until` passes (then `false`), driving the
    /// engine whenever no other thread does.
    pub(crate) fn wait(&self, job: &Job, until: Option<Instant>) -> bool {
        let fabric = &self.fabric;
        job.waited.store(true, Ordering::Release);
        self.park.waiters.fetch_add(1, Ordering::SeqCst);
        // A background driver asleep on the doorbell gives the role up when it wakes.
        fabric.inbox.notify();
        let mut backoff = Backoff::new(self.shared_cpus);
        let done = loop {
            if job.is_done() {
                break true;
            }
            if until.is_some_and(|u| Instant::now() >= u) {
                break false;
            }
            match self.driver.try_lock() {
                Ok(mut jobs) => {
                    let _drive = fabric.drive_sockets();
                    loop {
                        let seen = fabric.inbox.bell_seen();
                        let moved = self.round(&mut jobs, backoff.is_slow());
                        if job.is_done() {
                            break;
                        }
                        if until.is_some_and(|u| Instant::now() >= u) {
                            break;
                        }
                        if moved {
                            backoff.moved();
                        } else {
                            backoff.idle(PARK_NAP, until, |t| fabric.sleep_on_bell_or(seen, t, &|| Engine::ll_ready(&jobs)));
                        }
                    }
                }
                Err(_) => {
                    // Another thread drives; it rings the doorbell when a job finishes and
                    // when it gives the role up.
                    let seen = fabric.inbox.bell_seen();
                    if !job.is_done() && self.driver.try_lock().is_err() {
                        fabric.sleep_on_bell_for(seen, Instant::now() + Duration::from_millis(1), false);
                    }
                }
            }
        };
        let left = self.park.waiters.fetch_sub(1, Ordering::SeqCst) - 1;
        if left > 0 {
            // Another waiter may be asleep until the driver role is free.
            fabric.inbox.notify();
        } else if Engine::busy(&self.park) {
            let _p = lock(&self.park.state);
            self.park.wake.notify_one();
        }
        done
    }

    /// One round of the driver; returns whether anything moved. Reads the clock (deadlines,
    /// peer health) only every few rounds: a clock read costs as much as the rest of a
    /// quiet round.
    fn round(&self, jobs: &mut Vec<Arc<Job>>, slow: bool) -> bool {
        let fabric = &self.fabric;
        // Jobs submitted since the last round are polled before the transports are read,
        // and polled again after it if any is left: a call's sends leave before the read,
        // and one whose data has arrived finishes in this round with one read (over tcp,
        // fewer `recv`s that find nothing). Every CLOCK_EVERY-th
        // round reads them first anyway: should calls keep finishing in their first poll, a
        // rank still reads what its peers report (an abort, a failure) every few calls.
        let fresh = {
            let mut s = lock(&self.submitted);
            let fresh = !s.is_empty();
            if fresh {
                jobs.append(&mut s);
            }
            fresh
        };
        let serving = self.serving();
        if jobs.is_empty() && !serving {
            return false;
        }
        // Busy rounds read the clock every CLOCK_EVERY rounds; rounds that yield or sleep
        // between them, every time.
        let tick = self.rounds.fetch_add(1, Ordering::Relaxed);
        let fresh = fresh && !tick.is_multiple_of(CLOCK_EVERY);
        if !fresh {
            self.drain();
        }
        let now = (slow || tick.is_multiple_of(CLOCK_EVERY)).then(Instant::now);
        if let Some(now) = now {
            fabric.check_health(now);
            self.answer_probes(Some(jobs));
        }
        let fatal = fabric.inbox.has_fatal();
        let mut moved = !(fatal && fabric.all_failed()) && self.serve_rma(serving);
        moved |= self.poll_jobs(jobs, fatal, now);
        if fresh && !jobs.is_empty() {
            // What has arrived may finish them now.
            self.drain();
            moved |= self.poll_jobs(jobs, fabric.inbox.has_fatal(), now);
        }
        moved
    }

    /// Polls every job once (`fatal`: the fabric is poisoned; `now`: the clock, on the
    /// rounds that read it), finishing those that are done; whether anything moved.
    fn poll_jobs(&self, jobs: &mut Vec<Arc<Job>>, fatal: bool, now: Option<Instant>) -> bool {
        let fabric = &self.fabric;
        let mut moved = false;
        let mut i = 0;
        while i < jobs.len() {
            let outcome = {
                let mut body = lock(&jobs[i].body);
                match fatal.then(|| fabric.fatal_error(&body.label(), Some(body.view()))).flatten() {
                    Some(e) => Err(fabric.poison_in(e, &|r| r, Some(body.view()))),
                    None => match body.poll(fabric) {
                        Ok(Poll::Ready(())) => Ok(true),
                        Ok(Poll::Moved) => {
                            moved = true;
                            Ok(false)
                        }
                        Ok(Poll::Idle) if now.is_some_and(|now| now >= body.deadline) => {
                            let now = now.unwrap_or(body.deadline);
                            let e = Error::Timeout {
                                rank: Some(body.rank),
                                op: body.label(),
                                after: now - body.started,
                                waiting_for: body.waiting_for().iter().map(|p| format!("rank {p}")).collect(),
                            };
                            Err(fabric.poison_in(e, &|r| r, Some(body.view())))
                        }
                        Ok(Poll::Idle) => {
                            if let Some(now) = now {
                                body.probe(fabric, now);
                            }
                            Ok(false)
                        }
                        Err(e) => match fabric.cause_behind(&e, &body.label(), Some(body.view()), &|| self.drain()) {
                            Some(cause) => Err(fabric.poison_in(cause, &|r| r, Some(body.view()))),
                            None => Err(fabric.poison_in(e, &|r| body.world(r), Some(body.view()))),
                        },
                    },
                }
            };
            match outcome {
                Ok(false) => i += 1,
                done => {
                    let job = jobs.remove(i);
                    job.finish(done.map(|_| ()));
                    self.park.pending.fetch_sub(1, Ordering::SeqCst);
                    moved = true;
                    // Wake threads sleeping in `wait` for this job.
                    fabric.inbox.notify();
                }
            }
        }
        moved
    }
}
