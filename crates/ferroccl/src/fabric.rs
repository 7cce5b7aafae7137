//! The fabric: this process's mesh (one endpoint per peer), the inbox its transports
//! deliver into, the registration table, and the failure policy (`health`), put together;
//! and the wait loop of mesh setup, finalize and shutdown. The progress engine
//! (`crate::engine`) owns a fabric and runs every call over it.
//!
//! Communicators (the world one and every `split` of it) share one fabric. Threading: any
//! thread may call into a fabric; transports deliver into the inbox under a mutex, and
//! whoever drives (a waiting thread, or the engine's own thread) drains the shm rings.
//!
//! Waiting: a waiter polls (spin), then yields, then sleeps on its doorbell (a futex word
//! that producers bump) for at most a few milliseconds at a time, checking every peer's
//! health as it goes: a peer process that exits without saying goodbye, a TCP connection
//! that drops, or the launcher dying fails every waiter promptly with the peer named.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferroccl_mem::region::RegionHandle;

use crate::bootstrap::{StoreClient, StoreServer};
use crate::error::{Error, Fault, FaultKind, Op, Process, Result};
use crate::health::Health;
use crate::inbox::{Backoff, Events, Inbox, Scope, View};
use crate::logging::{flog, Subsys};
use crate::mesh::{Mesh, PeerInfo};
use crate::params::Params;
use crate::poll::Poll;
use crate::registry::{PeerRegions, PeerWindows, RegStats, Registry, SharedWindow, Windows};
use crate::transport::{DriveGuard, Endpoint, RemoteBuf, TransportKind, WriteGrant};

/// The longest a waiter sleeps on the doorbell before it looks at the peers' health and
/// its deadline again.
pub(crate) const PARK_NAP: Duration = Duration::from_millis(5);
/// How long a rank that found a peer in another call looks for a cause reported behind it
/// (see [`Fabric::cause_behind`]) before it reports the mismatch.
pub(crate) const MISMATCH_GRACE: Duration = Duration::from_millis(50);

/// Everything needed to build a fabric.
pub(crate) struct FabricConfig<'a> {
    pub(crate) rank: usize,
    pub(crate) size: usize,
    pub(crate) token: String,
    pub(crate) params: Params,
    pub(crate) store: StoreClient,
    /// Where the store is (`host:port`), for connections made later (a shrink).
    pub(crate) store_addr: String,
    pub(crate) server: Option<StoreServer>,
    /// Prefix of this communicator's store keys (unique per init in the job).
    pub(crate) key_prefix: String,
    /// The launch rank of each world rank (see [`crate::Process`]): `0..size` for the world
    /// `init` builds; after a shrink, the survivors' own.
    pub(crate) launch: Arc<[usize]>,
    /// Looked at while setup waits for the peers (a shrink's: fails it at once, naming the
    /// member, when one dies meanwhile); `None`: nothing but the deadline.
    pub(crate) watch: Option<&'a (dyn Fn() -> Result<()> + Sync)>,
}

/// The job's token, kept for a shrink: never shown (`Debug` prints a placeholder).
pub(crate) struct Secret(pub(crate) String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// See [`Fabric::on_fatal`].
pub(crate) type FatalHook = Box<dyn Fn(&str) + Send + Sync>;

/// Runs when a call fails for good (see [`Fabric::on_fatal`]).
#[derive(Default)]
struct FatalHookCell(std::sync::OnceLock<FatalHook>);

impl std::fmt::Debug for FatalHookCell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.get().is_some() { "FatalHook(set)" } else { "FatalHook(unset)" })
    }
}

/// This process's mesh, inbox, registrations and health: everything the engine runs calls
/// over.
#[derive(Debug)]
pub(crate) struct Fabric {
    fatal_hook: FatalHookCell,
    pub(crate) rank: usize,
    pub(crate) size: usize,
    pub(crate) params: Params,
    pub(crate) inbox: Arc<Inbox>,
    mesh: Mesh,
    registry: Registry,
    /// The one-sided windows of this process (see `crate::rma`).
    pub(crate) windows: Windows,
    /// Same-host peers' shared windows this process has mapped (see
    /// [`Fabric::shared_window`]).
    peer_windows: PeerWindows,
    /// Verbs peers' windows this process reads with RDMA READ (see `crate::rma`).
    pub(crate) peer_regions: PeerRegions,
    /// This job's (and this `init`'s) identity in one-sided handles: a handle made by
    /// another job, or another `init` of this one, is refused.
    pub(crate) job: u64,
    /// The job's token and the store's address: what a shrink needs to build a new fabric.
    pub(crate) token: Secret,
    pub(crate) store_addr: String,
    /// Numbers of this rank's one-sided requests (their owners' replies name them).
    next_req: std::sync::atomic::AtomicU64,
    /// The lowest signal slot no library object of this process has claimed (slot 0 is the
    /// public signal; see [`Fabric::claim_signal_slots`]).
    next_signal_slot: std::sync::atomic::AtomicU32,
    health: Health,
    store: Mutex<Option<StoreClient>>,
    server: Mutex<Option<StoreServer>>,
    key_prefix: String,
    closed: AtomicBool,
    /// Set when the world communicator is finalized: every later call fails.
    finalized: AtomicBool,
    pub(crate) setup_time: Duration,
    /// The threads of large local reductions and copies (see [`Fabric::local_pool`]), made
    /// at the first that needs them; `None` inside when one thread is all this rank gets.
    local_pool: std::sync::OnceLock<Option<ferroccl_kernels::ParPool>>,
}

impl Fabric {
    /// Builds the mesh (see `mesh`), then greets every shm peer and waits for their
    /// greetings: proof that each has mapped our segment, so that its descriptor can go.
    pub(crate) fn connect(cfg: FabricConfig<'_>) -> Result<Fabric> {
        let t0 = Instant::now();
        let FabricConfig { rank, size, token, params, store, store_addr, server, key_prefix, launch, watch } = cfg;
        crate::logging::install(params.debug, params.debug_subsys);
        if crate::logging::enabled(Subsys::Init, log::Level::Info) {
            // The knobs this rank's environment sets (the token is a secret: named, not shown).
            for var in crate::params::PARAMS.iter().map(|p| p.name) {
                if let Ok(v) = std::env::var(var) {
                    let v = if var == "FERROCCL_TOKEN" { "(set)" } else { v.as_str() };
                    flog!(Info, Init, "rank {rank}: {var}={v}");
                }
            }
        }
        let deadline = t0 + params.timeout;
        let no_watch = || Ok(());
        let watching: &(dyn Fn() -> Result<()> + Sync) = watch.unwrap_or(&no_watch);
        let (mesh, inbox, watches) = Mesh::connect(rank, size, &token, &params, &store, &key_prefix, deadline, watching)?;
        let processes: Arc<[Process]> = (0..size)
            .map(|w| {
                let p = &mesh.peers[w];
                Process { launch_rank: launch.get(w).copied().unwrap_or(w), host: p.hostname.clone(), pid: p.pid }
            })
            .collect();
        let fabric = Fabric {
            fatal_hook: FatalHookCell::default(),
            rank,
            size,
            registry: Registry::new(inbox.clone(), params.reg_cache_entries),
            windows: Windows::new(mesh.remote_memory(), params.timeout),
            peer_windows: PeerWindows::default(),
            peer_regions: PeerRegions::default(),
            job: job_id(&token, &key_prefix),
            token: Secret(token),
            store_addr,
            next_req: std::sync::atomic::AtomicU64::new(1),
            next_signal_slot: std::sync::atomic::AtomicU32::new(1),
            health: Health::new(rank, inbox.clone(), watches, processes),
            params,
            inbox,
            mesh,
            store: Mutex::new(Some(store)),
            server: Mutex::new(server),
            key_prefix,
            closed: AtomicBool::new(false),
            finalized: AtomicBool::new(false),
            setup_time: Duration::ZERO,
            local_pool: std::sync::OnceLock::new(),
        };
        fabric.mesh.greet(deadline, &|| {
            watching()?;
            fabric.pump(&Op::other("connect"), None)
        })?;
        let shm_peers = fabric.mesh.shm_peers();
        fabric.wait_until(&Op::other("connect (waiting for shm peers)"), None, deadline, &shm_peers, |_| {
            watching()?;
            Ok(if fabric.mesh.ungreeted().is_empty() { Some(()) } else { None })
        })?;
        fabric.mesh.withdraw();
        // Tell rank 0 (which may be serving the store) that we no longer need the store.
        if let Some(st) = fabric.store.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            st.add(&format!("{}/ready", fabric.key_prefix), 1)?;
        }
        let mut fabric = fabric;
        fabric.setup_time = t0.elapsed();
        Ok(fabric)
    }

    /// Window (`window`, `key`, `len` bytes) of world rank `owner` mapped into this process,
    /// when `owner` is on this host (reached over shm) and the window is a live shared one
    /// ([`crate::Communicator::alloc_window`]): then reads and writes copy straight in and
    /// out of it.
    pub(crate) fn shared_window(&self, owner: usize, window: u32, key: u64, len: u64) -> Option<SharedWindow> {
        let pid = self.endpoint(owner).ok()?.shm_pid()?;
        self.peer_windows.get(pid, self.job, owner, window, key, len)
    }

    /// Forgets a mapped shared window found dropped by its owner.
    pub(crate) fn forget_shared_window(&self, owner: usize, window: u32, key: u64) {
        self.peer_windows.forget(owner, window, key);
    }

    /// Ranks of the job on this host (this one and its shm peers).
    pub(crate) fn local_ranks(&self) -> usize {
        self.mesh.shm_peers().len() + 1
    }

    /// The pool to run a local reduction or copy of `bytes` bytes on, if it is large enough
    /// (`FERROCCL_REDUCE_PAR_MIN`) and this rank gets more than one thread for it
    /// (`FERROCCL_REDUCE_THREADS`); `None`: the calling thread does it alone.
    pub(crate) fn local_pool(&self, bytes: usize) -> Option<&ferroccl_kernels::ParPool> {
        if bytes < self.params.reduce_par_min {
            return None;
        }
        self.local_pool
            .get_or_init(|| {
                let threads = self.params.reduce_threads_here(self.ranks_on_this_machine());
                if threads < 2 {
                    return None;
                }
                match ferroccl_kernels::ParPool::new(threads) {
                    Ok(p) => Some(p),
                    Err(e) => {
                        flog!(Warn, Init, "rank {}: local reductions stay on one thread: {e}", self.rank);
                        None
                    }
                }
            })
            .as_ref()
    }

    /// The ranks (this one included) whose host name is this rank's: those that share
    /// this machine's CPUs, whatever transport joins them (network namespaces of one
    /// machine included).
    pub(crate) fn ranks_on_this_machine(&self) -> usize {
        let me = self.mesh.peers.get(self.rank).map(|p| p.hostname.as_str());
        self.mesh.peers.iter().filter(|p| Some(p.hostname.as_str()) == me).count().max(1)
    }

    /// The endpoint to world rank `peer`.
    pub(crate) fn endpoint(&self, peer: usize) -> Result<&dyn Endpoint> {
        self.mesh.endpoint(peer)
    }

    /// The transport to world rank `peer` (`None`: itself, or out of range).
    pub(crate) fn transport_kind(&self, peer: usize) -> Option<TransportKind> {
        self.mesh.kind(peer)
    }

    /// This world's tag in flight records: it tells the world `init` built from those
    /// shrinks built (whose communicator ids start at 0 again).
    pub(crate) fn tag(&self) -> String {
        format!("{:08x}", self.job as u32)
    }

    /// The launch rank of world rank `w` (see [`crate::Process`]).
    pub(crate) fn launch_rank(&self, w: usize) -> usize {
        self.process(w).map_or(w, |p| p.launch_rank)
    }

    /// World rank `w`'s process: its launch rank, host and pid.
    pub(crate) fn process(&self, w: usize) -> Option<Process> {
        self.health.process(w)
    }

    /// Facts about world rank `peer` for reports.
    pub(crate) fn peer_info(&self, peer: usize) -> Option<&PeerInfo> {
        self.mesh.peers.get(peer)
    }

    /// Registers `[offset, offset + len)` of a region for a remote write by world rank
    /// `peer` (see [`Registry::register`]).
    pub(crate) fn register(&self, h: &RegionHandle, offset: usize, len: usize, peer: usize) -> Result<(RemoteBuf, WriteGrant)> {
        self.registry.register(h, offset, len, self.mesh.get(peer))
    }

    /// Registers a region through the registration cache; returns its key.
    pub(crate) fn register_cached(&self, h: &RegionHandle) -> u64 {
        self.registry.register_cached(h)
    }

    /// Drops the registration of `h`'s address range.
    pub(crate) fn deregister(&self, h: &RegionHandle) {
        self.registry.deregister(h)
    }

    /// The registration cache's counters, the windows', and the bytes verbs one-sided
    /// writes moved (staged or zero copy).
    pub(crate) fn reg_stats(&self) -> RegStats {
        let w = self.windows.stats();
        let moved = self.mesh.remote_memory().map(|m| m.bytes()).unwrap_or_default();
        RegStats {
            windows: w.windows,
            window_bytes: w.window_bytes,
            windows_registered: w.windows_registered,
            peer_windows_mapped: self.peer_windows.mapped(),
            window_bytes_verbs: w.window_bytes_verbs,
            verbs_staged_bytes: moved.staged,
            verbs_zero_copy_bytes: moved.zero_copy,
            gets_served: w.gets_served,
            puts_served: w.puts_served,
            signals_served: w.signals_served,
            verbs_window_write_bytes: moved.window_writes,
            verbs_read_bytes: moved.reads,
            peer_regions_held: self.peer_regions.held(),
            ..self.registry.stats()
        }
    }

    /// Whether any peer is reached over a transport with remote memory access (verbs):
    /// this rank may then hold peers' window regions.
    pub(crate) fn any_remote_memory(&self) -> bool {
        self.mesh.remote_memory().is_some()
    }

    /// `n` fresh numbers for one-sided requests: the first of them.
    pub(crate) fn next_reqs(&self, n: u64) -> u64 {
        self.next_req.fetch_add(n.max(1), Ordering::Relaxed)
    }

    /// The lowest signal slot this process has not given to a library object: what this
    /// rank proposes when the members of a communicator agree on slots (they take the
    /// highest proposal, so the slots are free on every member).
    pub(crate) fn free_signal_slot(&self) -> u32 {
        self.next_signal_slot.load(Ordering::Relaxed)
    }

    /// Claims slots `first..first + n` (agreed by the members): later proposals are above.
    pub(crate) fn claim_signal_slots(&self, first: u32, n: u32) {
        self.next_signal_slot.fetch_max(first.saturating_add(n), Ordering::Relaxed);
    }

    /// A fresh immediate for a rendezvous write.
    pub(crate) fn next_imm(&self) -> u32 {
        self.registry.next_imm()
    }

    /// `n` fresh consecutive immediates (see [`Registry::next_imms`]).
    pub(crate) fn next_imms(&self, n: u32) -> u32 {
        self.registry.next_imms(n)
    }

    /// While the guard lives, this thread (the engine's driver) reads the tcp sockets itself
    /// in [`Fabric::progress`]; see [`Mesh::drive_sockets`].
    pub(crate) fn drive_sockets(&self) -> Option<DriveGuard> {
        self.mesh.drive_sockets()
    }

    /// Drains the shm inbox, the verbs completions, and (in a thread that drives) the tcp
    /// sockets. An error here is fatal for the fabric.
    pub(crate) fn progress(&self) -> Result<()> {
        self.mesh.progress(&self.inbox)
    }

    /// What a sender runs while it waits for room: drain our inbox, watch the peers, and
    /// stop at once if a fault reaches communicator `view` (`None`: any fault).
    pub(crate) fn pump(&self, op: &Op, view: Option<View<'_>>) -> Result<()> {
        let _ = self.progress();
        self.check_health(Instant::now());
        match self.fatal_error(op, view) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The world ranks known dead or gone: exited processes, and the culprit of a fatal
    /// failure or departure.
    pub(crate) fn dead_peers(&self) -> Vec<usize> {
        self.health.dead_peers()
    }

    /// The store server this rank runs, handed over (to a shrunk communicator's fabric, so
    /// that dropping this one does not take the store away from the survivors).
    pub(crate) fn take_server(&self) -> Option<StoreServer> {
        self.server.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// Takes over the store server a shrunk communicator's fabric handed over (see
    /// [`Fabric::take_server`]).
    pub(crate) fn adopt_server(&self, server: StoreServer) {
        *self.server.lock().unwrap_or_else(|e| e.into_inner()) = Some(server);
    }

    /// The key prefix of this fabric's store keys.
    pub(crate) fn key_prefix(&self) -> &str {
        &self.key_prefix
    }

    /// Looks at the peers' processes (and the launcher) at most every 2 ms.
    pub(crate) fn check_health(&self, now: Instant) {
        self.health.check(now, &self.mesh);
    }

    /// The error for the fault that reaches communicator `view` (`None`: any fault), if
    /// any, as seen by an operation `op` on it.
    pub(crate) fn fatal_error(&self, op: &Op, view: Option<View<'_>>) -> Option<Error> {
        if !self.inbox.has_fatal() {
            return None;
        }
        self.health.fatal_error(op, view)
    }

    /// Whether the whole fabric failed or was aborted (nothing on it can run: one-sided
    /// requests are no longer served).
    pub(crate) fn all_failed(&self) -> bool {
        self.inbox.has_fatal() && self.inbox.lock().all_failed()
    }

    /// Records, in this process, that communicator `child` was split from `parent` (an
    /// abort of the parent reaches it).
    pub(crate) fn split_from(&self, child: u32, parent: u32) {
        self.inbox.lock().parents.insert(child, parent);
    }

    /// Sets what runs when a call fails for good (the engine's
    /// flight-record dump; the fabric knows no engine). Set once.
    pub(crate) fn on_fatal(&self, hook: FatalHook) {
        let _ = self.fatal_hook.0.set(hook);
    }

    /// An operation met the fatal state, with error `e`: the hook runs (from
    /// [`Fabric::poison_in`], after the peers were told; and for a call refused on a failed
    /// fabric). Not for an abort (this process's or a peer's): it was asked for, not a
    /// failure to explain.
    pub(crate) fn fatal_seen(&self, e: &Error) {
        if matches!(e, Error::Aborted { .. }) {
            return;
        }
        if let Some(h) = self.fatal_hook.0.get() {
            h(&e.to_string());
        }
    }

    /// For a mismatch `err` found in what a peer left behind (a message, a slot), the cause
    /// that peer or another reports within [`MISMATCH_GRACE`] (an abort, a failure), which
    /// explains the mismatch and wins over it: a peer that aborted in the middle of a call
    /// leaves that call's messages behind, and the abort may still be on its way (over tcp
    /// it follows them on the same socket). A mismatch reported by a peer changes nothing
    /// (this rank's own report of it names the same two calls). `drain` moves the
    /// transports meanwhile. `None` for other errors, or when nothing is reported in time.
    pub(crate) fn cause_behind(&self, err: &Error, op: &Op, view: Option<View<'_>>, drain: &dyn Fn()) -> Option<Error> {
        if !matches!(err, Error::Mismatch { .. }) {
            return None;
        }
        let until = Instant::now() + MISMATCH_GRACE;
        loop {
            drain();
            if let Some(cause) = self.fatal_error(op, view) {
                let mismatch = cause.root_cause().is_some_and(|c| c.kind == FaultKind::Mismatch);
                return (!mismatch).then_some(cause);
            }
            if Instant::now() >= until {
                return None;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// The error for a call `op` on a fabric whose world communicator was finalized (`world`:
    /// the call is on a split of it), if it was.
    pub(crate) fn finalized_error(&self, rank: usize, op: &Op, world: bool) -> Option<Error> {
        self.finalized.load(Ordering::Acquire).then(|| Error::Finalized { rank, op: op.clone(), world })
    }

    /// Marks the world communicator finalized: every later call on it or its splits fails.
    pub(crate) fn set_finalized(&self) {
        self.finalized.store(true, Ordering::Release);
    }

    /// Makes `err`, found outside any communicator's call (setup, a transport's own
    /// failure), fatal for the whole fabric (unless an earlier error already is), tells
    /// every peer the root cause, and shuts the connections down so that no reader thread
    /// can keep a registered buffer busy. Returns `err` for the caller to report. The ranks
    /// in `err` are world ranks.
    pub(crate) fn poison(&self, err: Error) -> Error {
        self.poison_in(err, &|r| r, None)
    }

    /// Makes `err` of a call on communicator `view` (whose rank `r` is world rank
    /// `world(r)`; `None`: outside any) fatal for what it reaches (see `health`), unless a
    /// fault reaches `view` already, and tells the peers it concerns.
    pub(crate) fn poison_in(&self, err: Error, world: &dyn Fn(usize) -> usize, view: Option<View<'_>>) -> Error {
        let err = self.health.poison_in(&self.mesh, err, world, view);
        if self.inbox.has_fatal() {
            self.fatal_seen(&err);
        }
        err
    }

    /// Makes `fault` (found by this rank) fatal for `scope` and tells the peers it
    /// concerns (`view`: the communicator it was found on).
    pub(crate) fn poison_fault(&self, fault: Fault, scope: Scope, view: Option<View<'_>>) {
        self.health.poison_fault(&self.mesh, fault, scope, view)
    }

    /// Sends `msg` to world rank `peer` if that needs no waiting (a probe: best effort).
    pub(crate) fn try_send_now(&self, peer: usize, msg: &[u8]) {
        if let Some(e) = self.mesh.get(peer) {
            let _ = e.try_post_send_now(msg, Instant::now() + Duration::from_millis(10));
        }
    }

    /// Aborts every operation on communicator `view` and those split from it (the world:
    /// everything), pending and later, with [`Error::Aborted`], and tells its members
    /// (whose operations on it then fail with [`Error::Aborted`] naming this rank).
    /// Returns at once; waiting threads wake within a round.
    pub(crate) fn abort(&self, view: View<'_>) {
        self.health.abort(&self.mesh, view);
    }

    /// Polls until `check` yields a value, a fatal error occurs, or `deadline` passes.
    /// `check` runs with the event state locked; it must not block. Every error returned
    /// here is fatal for the fabric (see [`Fabric::poison`]).
    pub(crate) fn wait_until<T>(
        &self,
        op: &Op,
        view: Option<View<'_>>,
        deadline: Instant,
        waiting_for: &[usize],
        mut check: impl FnMut(&mut Events) -> Result<Option<T>>,
    ) -> Result<T> {
        self.run_until(op, view, deadline, &|| waiting_for.to_vec(), || {
            let mut ev = self.inbox.lock();
            Ok(match check(&mut ev)? {
                Some(v) => Poll::Ready(v),
                None => Poll::Idle,
            })
        })
    }

    /// The fabric's wait loop (setup, finalize and shutdown waits; calls run in the engine): drains the shm inbox, stops on a fatal error, runs `step` (which
    /// locks what it needs; it says whether it finished, moved, or found nothing to do),
    /// watches the peers, and backs off (spin, yield, futex sleep) while nothing moves.
    /// Every error returned here is fatal for the fabric (see [`Fabric::poison`]).
    pub(crate) fn run_until<T>(
        &self,
        op: &Op,
        view: Option<View<'_>>,
        deadline: Instant,
        waiting_for: &dyn Fn() -> Vec<usize>,
        mut step: impl FnMut() -> Result<Poll<T>>,
    ) -> Result<T> {
        let start = Instant::now();
        let mut backoff = Backoff::default();
        loop {
            // Read the doorbell before looking: whatever is published after this read
            // bumps the bell past `seen`, which makes the futex sleep below return at once.
            let seen = self.inbox.bell_seen();
            if let Err(e) = self.progress() {
                let e = self.fatal_error(op, view).unwrap_or(e);
                return Err(self.poison_in(e, &|r| r, view));
            }
            // A fault that reaches the waiting communicator wins over whatever else arrived.
            if let Some(e) = self.fatal_error(op, view) {
                return Err(self.poison_in(e, &|r| r, view));
            }
            match step() {
                Ok(Poll::Ready(v)) => return Ok(v),
                Ok(Poll::Moved) => backoff.moved(),
                Ok(Poll::Idle) => {}
                Err(e) => return Err(self.poison_in(e, &|r| r, view)),
            }
            let now = Instant::now();
            self.check_health(now);
            if now >= deadline {
                let e = Error::Timeout {
                    rank: Some(self.rank),
                    op: op.clone(),
                    after: now - start,
                    waiting_for: waiting_for().iter().map(|p| format!("rank {p}")).collect(),
                };
                return Err(self.poison_in(e, &|r| r, view));
            }
            backoff.idle(PARK_NAP, Some(deadline), |until| self.sleep_on_bell(seen, until));
        }
    }

    /// Sleeps until the doorbell moves past `seen`, or until `until` (at most [`PARK_NAP`]
    /// from now, to look at peers' health).
    pub(crate) fn sleep_on_bell(&self, seen: u32, until: Instant) {
        self.sleep_on_bell_for(seen, until, true);
    }

    /// [`Fabric::sleep_on_bell`]; `drains` says whether the caller will drain the shm
    /// rings when it wakes (a thread waiting for another thread's driving does not, so it
    /// must not return early for data in them: only the driver's doorbell rings matter).
    pub(crate) fn sleep_on_bell_for(&self, seen: u32, until: Instant, drains: bool) {
        let until = until.min(Instant::now() + PARK_NAP);
        // Asleep, this thread reads no sockets: their reader threads do.
        let _paused = self.mesh.pause_sockets();
        // shm peers ring the bell only when they see us sleeping: look once more once we
        // have said so.
        self.inbox.sleep(seen, until, || drains && self.mesh.has_pending());
    }

    /// [`Fabric::sleep_on_bell`] for a waiter that also waits for something shm peers
    /// publish outside the rings (and ring the bell for, when they see it asleep):
    /// `ready` is looked at once the waiter is counted as sleeping.
    pub(crate) fn sleep_on_bell_or(&self, seen: u32, until: Instant, ready: &dyn Fn() -> bool) {
        let until = until.min(Instant::now() + PARK_NAP);
        let _paused = self.mesh.pause_sockets();
        self.inbox.sleep(seen, until, || {
            std::sync::atomic::fence(Ordering::SeqCst);
            ready() || self.mesh.has_pending()
        });
    }

    /// Says goodbye to every peer and tears the mesh down. Idempotent. The engine running
    /// calls over this fabric must have stopped (`Engine::close`).
    pub(crate) fn close(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        let deadline = Instant::now() + Duration::from_secs(2).min(self.params.timeout);
        // After a fault that reached the world, tell the peers why we are leaving, so that
        // they report the root cause (the rank that died) rather than our exit.
        let members: Vec<usize> = (0..self.size).collect();
        let world = View { comm: 0, members: &members };
        self.health.tell_at_close(&self.mesh, world);
        self.mesh.close(deadline, &|| self.pump(&Op::other("close"), Some(world)));
        // If this rank serves the store, keep it up until every rank has finished with it.
        let server = self.server.lock().unwrap_or_else(|e| e.into_inner()).take();
        let store = self.store.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let (Some(server), Some(store)) = (server, store) {
            let want = self.size as i64;
            let key = format!("{}/ready", self.key_prefix);
            let end = Instant::now() + self.params.timeout.min(Duration::from_secs(30));
            while Instant::now() < end {
                match store.add(&key, 0) {
                    Ok(n) if n >= want => break,
                    Ok(_) => std::thread::sleep(Duration::from_millis(5)),
                    Err(_) => break,
                }
            }
            drop(store);
            server.shutdown();
        }
    }
}

impl Drop for Fabric {
    fn drop(&mut self) {
        self.close();
    }
}

/// The identity of a job's `init` in one-sided handles: the first 8 bytes of SHA-256 over
/// the job's token and the init's store prefix (every rank computes the same; another job,
/// or another `init` of this one, gets another).
pub(crate) fn job_id(token: &str, key_prefix: &str) -> u64 {
    use sha2::{Digest, Sha256};
    let d =
        Sha256::new().chain_update(b"ferroccl-window-job\0").chain_update(token).chain_update(b"\0").chain_update(key_prefix).finalize();
    let mut b = [0u8; 8];
    b.copy_from_slice(&d[..8]);
    u64::from_le_bytes(b)
}
