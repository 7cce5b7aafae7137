//! The communicator: a group of ranks that can talk to each other.

use std::collections::{HashMap, HashSet};
use std::net::ToSocketAddrs;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytemuck::Pod;
use ferroccl_kernels::{DType, ReduceOp};
use ferroccl_mem::region::{with_region, with_region_ro, RegionHandle};

use crate::algo::ll::{LlKind, LlSpec};
use crate::algo::{control, Collective, Schedule};
use crate::bootstrap::env::{self, LaunchEnv, StoreRole};
use crate::bootstrap::{StoreClient, StoreServer};
use crate::engine::{Engine, Job, JobBody, Part, Streams};
use crate::error::{Departure, Error, Fault, FaultKind, Op, Result};
use crate::exec::{assign_seqs, Exec};
use crate::fabric::{job_id, Fabric, FabricConfig};
use crate::flight::Flight;
use crate::inbox::{Scope, View};
use crate::ll::{self, LlChannel};
use crate::logging::{flog, Subsys};
use crate::params::{FaultSite, LlChoice, Params, ProtoChoice};
use crate::poll::Poll;
use crate::prepared::{SchedCache, ScratchCache};
use crate::proto::{self, Desc, Leave, BARRIER_DESC, CHANNELS, CHAN_COLL, CHAN_USER, NO_DESC, SPLIT_DESC};
use crate::registry::RegStats;
use crate::shrink::{self, Outcome, Survivors};
use crate::transport_kind::TransportKind;

/// How to reach the other ranks of a job, when not read from the environment.
#[derive(Debug, Clone)]
pub struct InitConfig {
    /// This rank, `0..world_size`.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// The bootstrap store: connect to one, or serve it on rank 0.
    pub store: StoreRole,
    /// The job's token (see `FERROCCL_TOKEN`).
    pub token: String,
}

impl From<LaunchEnv> for InitConfig {
    fn from(e: LaunchEnv) -> Self {
        InitConfig { rank: e.rank, world_size: e.world_size, store: e.store, token: e.token }
    }
}

/// A group of ranks: the world (from [`Communicator::init`]) or a part of it (from
/// [`Communicator::split`]). Sub-communicators share the world's connections.
///
/// Point-to-point calls between two ranks match in the order they are made, like NCCL's
/// (there are no tags). Every blocking call gives up after `FERROCCL_TIMEOUT` and fails
/// promptly, naming the rank, if a peer dies.
///
/// Every call is submitted to the progress engine (see the [`nonblocking`](crate::nonblocking)
/// module and [`Communicator::scope`]) and the blocking ones wait for it; the communicator is
/// `Send + Sync`. Calls made from several threads at once on one communicator are ordered
/// by whoever gets there first, so every rank must issue them in the same order: order them
/// yourself (as with NCCL streams).
#[derive(Debug)]
pub struct Communicator {
    /// The engine that runs every call, over the fabric it owns (shared with the world
    /// and every split of it).
    engine: Arc<Engine>,
    id: u32,
    rank: usize,
    /// World rank of each member.
    members: Arc<[usize]>,
    /// Stream positions; held while a job is numbered and submitted, so that jobs enter the
    /// engine in the order their sequence numbers say.
    seqs: Arc<Mutex<Streams>>,
    splits: Mutex<u32>,
    /// Shrinks of this communicator so far (see [`Communicator::shrink`]).
    shrinks: std::sync::atomic::AtomicU32,
    scratch: ScratchCache,
    /// Schedules of recent calls, so that a repeated call does not build its schedule again.
    pub(crate) sched_cache: SchedCache,
    /// Whether any member is reached over tcp (fixed with the membership; the cost model
    /// reads it on every collective).
    any_tcp: bool,
    /// Set once this rank has told the members it leaves (finalize), so that the drop that
    /// follows does not tell them again.
    departed: AtomicBool,
    /// The low-latency channel (every member on this host, reached over shm; see `crate::ll`).
    pub(crate) ll: Option<Arc<LlChannel>>,
    /// The flight recorder of this communicator's calls (also held by its streams).
    pub(crate) flight: Arc<Flight>,
    /// Low-latency calls already explained in the `coll` log (touched only when it is on).
    pub(crate) explained: Mutex<HashSet<(CallKey, Option<Arc<String>>)>>,
}

/// A call's shape as the schedule cache keys it: collective, dtype, op, count, in place.
pub(crate) type CallKey = (Collective, DType, ReduceOp, usize, bool);

fn lock_streams(s: &Mutex<Streams>) -> std::sync::MutexGuard<'_, Streams> {
    s.lock().unwrap_or_else(|e| e.into_inner())
}

/// Counts inits per (store, job token, world size, rank) so that several communicators in
/// one job get distinct store keys (every rank of a world inits them in the same order),
/// also when one store serves several jobs of different sizes in turn.
fn init_generation(store: &str, token: &str, world: usize, rank: usize) -> u64 {
    type Gens = HashMap<(String, String, usize, usize), u64>;
    static GEN: Mutex<Option<Gens>> = Mutex::new(None);
    let mut g = GEN.lock().unwrap_or_else(|e| e.into_inner());
    let m = g.get_or_insert_with(HashMap::new);
    let n = m.entry((store.to_string(), token.to_string(), world, rank)).or_insert(0);
    let v = *n;
    *n += 1;
    v
}

fn fnv(parts: &[u64]) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for p in parts {
        for b in p.to_le_bytes() {
            h ^= u32::from(b);
            h = h.wrapping_mul(0x0100_0193);
        }
    }
    h
}

impl Communicator {
    /// Joins the job described by the environment: FerroCCL's own variables (set by
    /// `ferroccl-run`), torchrun's, Slurm's or Open MPI's, and the `FERROCCL_*` knobs.
    pub fn init() -> Result<Communicator> {
        let launch = env::detect()?;
        let params = Params::from_env()?;
        Self::init_with(launch.into(), params)
    }

    /// Joins a job described explicitly.
    pub fn init_with(cfg: InitConfig, params: Params) -> Result<Communicator> {
        if cfg.world_size == 0 || cfg.rank >= cfg.world_size {
            return Err(Error::invalid(format!("rank {} is not in a world of {} ranks", cfg.rank, cfg.world_size)));
        }
        params.validate()?;
        let timeout = params.timeout;
        let (addr, server) = match &cfg.store {
            StoreRole::Connect(a) => (a.clone(), None),
            StoreRole::ServeOnRank0(a) => {
                let server = if cfg.rank == 0 {
                    let sa = a
                        .to_socket_addrs()
                        .map_err(|e| Error::io(format!("resolve store address {a}"), e))?
                        .next()
                        .ok_or_else(|| Error::invalid(format!("store address {a} resolves to nothing")))?;
                    Some(StoreServer::start(sa, &cfg.token, params.store_max_value)?)
                } else {
                    None
                };
                (a.clone(), server)
            }
        };
        let store = StoreClient::connect(&addr, &cfg.token, cfg.rank, timeout)?;
        let gen = init_generation(&addr, &cfg.token, cfg.world_size, cfg.rank);
        let key_prefix = format!("ferroccl/{}/{gen}", cfg.world_size);
        Self::build(cfg.rank, cfg.world_size, cfg.token, addr, store, server, params, key_prefix, (0..cfg.world_size).collect(), None)
    }

    /// A world communicator of `world_size` ranks over a new fabric whose store keys start
    /// with `key_prefix` (unique in the job).
    #[allow(clippy::too_many_arguments)]
    fn build(
        rank: usize,
        world_size: usize,
        token: String,
        store_addr: String,
        store: StoreClient,
        server: Option<StoreServer>,
        params: Params,
        key_prefix: String,
        launch: Arc<[usize]>,
        watch: Option<&(dyn Fn() -> Result<()> + Sync)>,
    ) -> Result<Communicator> {
        // The low-latency slots exist before this rank greets anyone, so that a member that
        // has been greeted by every other finds them (see `LlChannel::connect`).
        let ll_seg =
            ll_wanted(&params, world_size).then(|| ll::create(job_id(&token, &key_prefix), 0, rank, params.ll_max_bytes).ok()).flatten();
        let fabric =
            Fabric::connect(FabricConfig { rank, size: world_size, token, params, store, store_addr, server, key_prefix, launch, watch })?;
        if crate::logging::enabled(Subsys::Init, log::Level::Info) {
            for p in 0..fabric.size {
                if p != fabric.rank {
                    flog!(Info, Init, "rank {} -> rank {p}: {}", fabric.rank, fabric.transport_kind(p).map_or("?", TransportKind::name));
                }
            }
            flog!(Info, Init, "rank {} connected in {:?}", fabric.rank, fabric.setup_time);
        }
        let members: Arc<[usize]> = (0..world_size).collect();
        let any_tcp = members.iter().any(|&w| fabric.transport_kind(w) == Some(TransportKind::Tcp));
        let ll = connect_ll(&fabric, ll_seg, 0, &members, rank)?;
        let engine = Engine::new(fabric);
        let seqs = engine.streams(0, members.clone(), rank);
        let flight = lock_streams(&seqs).flight().clone();
        Ok(Communicator {
            flight,
            any_tcp,
            engine,
            id: 0,
            rank,
            seqs,
            members,
            splits: Mutex::new(0),
            shrinks: std::sync::atomic::AtomicU32::new(0),
            scratch: ScratchCache::default(),
            sched_cache: Default::default(),
            departed: AtomicBool::new(false),
            ll,
            explained: Mutex::default(),
        })
    }

    /// A new communicator of the members of this one that are still alive, in the order of
    /// their ranks here (as NCCL's `ncclCommShrink` and ULFM's `MPI_Comm_shrink`): for the
    /// survivors of a failure, to carry on without the failed ranks. Every surviving member
    /// must call it (the same number of times on this communicator); it works whether or not
    /// anything failed.
    ///
    /// The survivors agree through the job's store: each says it is alive and which members
    /// it knows dead (exited, or named by a failure); once every member has either said so
    /// or is known dead (or `FERROCCL_TIMEOUT` has passed: a stopped rank is left out then),
    /// the first survivor to ask decides the membership and the others take its decision.
    /// The new communicator has connections of its own (the old ones were cut by the
    /// failure); this one stays failed. A member left out (it answered too late) gets an
    /// error saying so. Needs the store: under `ferroccl-run` it lives in the launcher;
    /// where rank 0 serves it (torchrun, Slurm), rank 0 must be among the survivors.
    ///
    /// ```no_run
    /// # let comm = ferroccl::Communicator::init()?;
    /// let mut x = [1.0f32; 4];
    /// if let Err(e) = comm.allreduce(&mut x, ferroccl::ReduceOp::Sum) {
    ///     eprintln!("{e}: carrying on without the failed ranks");
    ///     let comm = comm.shrink()?;
    ///     comm.allreduce(&mut x, ferroccl::ReduceOp::Sum)?;
    /// }
    /// # Ok::<(), ferroccl::Error>(())
    /// ```
    pub fn shrink(&self) -> Result<Communicator> {
        let op = Op::other("shrink");
        if let Some(e) = self.fabric().finalized_error(self.rank, &op, self.id != 0) {
            return Err(e);
        }
        let fabric = self.fabric();
        let timeout = fabric.params.timeout;
        let start = Instant::now();
        let me = self.world_rank(self.rank).unwrap_or(self.rank);
        let store = StoreClient::connect(&fabric.store_addr, &fabric.token.0, me, timeout)
            .map_err(|e| Error::invalid(format!("rank {me}: shrink: cannot reach the job's store at {}: {e}", fabric.store_addr)))?;
        let root = format!("{}/shrink/{:x}", fabric.key_prefix(), self.id);
        let survivors = Survivors::new(fabric, store, root.clone(), self.members.to_vec(), me);
        let mut died: Vec<usize> = Vec::new();
        // Each attempt that fails leaves out at least one more dead member.
        for _ in 0..self.members.len() {
            let epoch = self.shrinks.fetch_add(1, Ordering::Relaxed) + 1;
            let deadline = Instant::now() + timeout;
            let base = format!("{root}/{epoch}");
            let decided = survivors.agree(&base, deadline)?;
            let Some(rank) = decided.iter().position(|&w| w == me) else {
                return Err(Error::invalid(format!(
                    "rank {me}: shrink: left out of the shrunk communicator (ranks {}): the others did not hear from this rank in time",
                    shrink::encode(&decided)
                )));
            };
            if fabric.params.injects(FaultSite::Shrink, fabric.rank) {
                std::process::abort();
            }
            // A fresh world over new connections, numbered in the survivors' order; a
            // member that dies meanwhile ends the build at once.
            let launch: Arc<[usize]> = decided.iter().map(|&w| fabric.launch_rank(w)).collect();
            let watch = || survivors.check(&decided, rank);
            let built = StoreClient::connect(&fabric.store_addr, &fabric.token.0, rank, timeout).and_then(|store| {
                Self::build(
                    rank,
                    decided.len(),
                    fabric.token.0.clone(),
                    fabric.store_addr.clone(),
                    store,
                    None,
                    fabric.params.clone(),
                    format!("{base}/world"),
                    launch,
                    Some(&watch),
                )
            });
            if built.is_ok() && fabric.params.injects(FaultSite::ShrinkBuilt, fabric.rank) {
                std::process::abort();
            }
            // A deadline of its own: waiting for a silent member may have used up the
            // agreement's (a stopped rank is left out only when it passes).
            match survivors.confirm(&base, &decided, built.as_ref().err(), Instant::now() + timeout)? {
                Outcome::Holds => {
                    let comm = built?;
                    // The store this rank serves (torchrun, Slurm) moves to the new
                    // fabric, so that dropping this one does not take it from the survivors.
                    if let Some(server) = fabric.take_server() {
                        comm.fabric().adopt_server(server);
                    }
                    flog!(
                        Info,
                        Health,
                        "rank {me}: shrink #{epoch} of communicator {:#x}: {} of {} members carry on (ranks {}), agreed in {:?}",
                        self.id,
                        decided.len(),
                        self.members.len(),
                        shrink::encode(&decided),
                        start.elapsed()
                    );
                    return Ok(comm);
                }
                Outcome::Died(dead) => {
                    flog!(Warn, Health, "rank {me}: shrink #{epoch}: ranks {dead:?} died during it; trying again without them");
                    survivors.mark_dead(&dead);
                    died.extend(dead);
                    drop(built);
                }
                Outcome::Failed(e) => return Err(e),
            }
        }
        Err(survivors.gave_up(&died))
    }

    /// This rank's index in the communicator.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks in the communicator.
    pub fn size(&self) -> usize {
        self.members.len()
    }

    /// The world rank of member `rank` of this communicator.
    pub fn world_rank(&self, rank: usize) -> Option<usize> {
        self.members.get(rank).copied()
    }

    /// The member of this communicator that is world rank `world` (the inverse of
    /// [`Communicator::world_rank`]); `None` if it is not a member.
    pub fn rank_of_world(&self, world: usize) -> Option<usize> {
        self.members.iter().position(|&w| w == world)
    }

    /// The transport that carries this rank's traffic to member `peer`: `None` for this
    /// rank itself (nothing goes over a transport) and for a `peer` out of range.
    ///
    /// ```no_run
    /// # fn show(comm: &ferroccl::Communicator) {
    /// use ferroccl::TransportKind;
    /// for p in (0..comm.size()).filter(|&p| p != comm.rank()) {
    ///     let t = comm.transport_to(p).map_or("?", TransportKind::name);
    ///     println!("rank {} -> rank {p}: {t}", comm.rank());
    /// }
    /// # }
    /// ```
    pub fn transport_to(&self, peer: usize) -> Option<TransportKind> {
        self.members.get(peer).and_then(|&w| self.fabric().transport_kind(w))
    }

    /// Host name of member `peer`.
    pub fn hostname_of(&self, peer: usize) -> Option<&str> {
        self.members.get(peer).and_then(|&w| self.fabric().peer_info(w)).map(|i| i.hostname.as_str())
    }

    /// How long connecting the mesh took on this rank (store exchange included).
    pub fn setup_time(&self) -> Duration {
        self.fabric().setup_time
    }

    /// The registration cache's counters (shared by the communicators of one world): how
    /// many registrations were made, how many calls reused one, evictions, and what is
    /// cached now.
    pub fn registration_stats(&self) -> RegStats {
        self.fabric().reg_stats()
    }

    /// Whether any member is reached over tcp.
    pub(crate) fn any_tcp(&self) -> bool {
        self.any_tcp
    }

    pub(crate) fn scratch(&self) -> &ScratchCache {
        &self.scratch
    }

    pub(crate) fn fabric(&self) -> &Fabric {
        self.engine.fabric()
    }

    /// This communicator as fault scopes see it (see `inbox::Scope`).
    pub(crate) fn view(&self) -> View<'_> {
        View { comm: self.id, members: &self.members }
    }

    pub(crate) fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// The blocking-call deadline (`FERROCCL_TIMEOUT`).
    pub fn timeout(&self) -> Duration {
        self.fabric().params.timeout
    }

    fn peer_world(&self, peer: usize, op: &Op) -> Result<usize> {
        if peer == self.rank {
            // Alone, a send to itself would wait for a receive that can only come after it.
            return Err(Error::invalid(format!(
                "rank {}: {op}: peer is this rank itself (put the send to itself and the receive from itself in one \
                 group, `comm.group(|g| {{ g.add(op::send(..))?; g.add(op::recv(..)) }})`, or use `sendrecv`, which copies)",
                self.rank
            )));
        }
        self.member_world(peer, op)
    }

    /// The world rank of member `peer` (this rank included), or an invalid argument.
    pub(crate) fn member_world(&self, peer: usize, op: &Op) -> Result<usize> {
        self.members.get(peer).copied().ok_or_else(|| {
            Error::invalid(format!("rank {}: {op}: peer {peer} is out of range (communicator of {} ranks)", self.rank, self.size()))
        })
    }

    /// Everything that can be checked before a byte goes on the wire; errors here leave the
    /// communicator usable.
    pub(crate) fn check_peer(&self, peer: usize, op: &Op) -> Result<usize> {
        let wpeer = self.peer_world(peer, op)?;
        self.fabric().endpoint(wpeer)?;
        self.check_usable(op)?;
        Ok(wpeer)
    }

    /// A fault that reaches this communicator (an abort of it or of an ancestor, a dead
    /// member, its own failed call, the fabric's failure), or the world's finalize, as seen
    /// by a new call `op`.
    pub(crate) fn check_usable(&self, op: &Op) -> Result<()> {
        if let Some(e) = self.fabric().finalized_error(self.rank, op, self.id != 0) {
            return Err(e);
        }
        if !self.fabric().inbox.has_fatal() {
            return Ok(());
        }
        self.refuse(op)
    }

    /// [`Communicator::check_usable`] on a fabric that has failed (out of line: the check
    /// is on every call's path).
    #[cold]
    #[inline(never)]
    fn refuse(&self, op: &Op) -> Result<()> {
        // A fault elsewhere (another communicator's, a peer's that is no member) leaves
        // this one usable.
        let Some(e) = self.fabric().fatal_error(op, Some(self.view())) else { return Ok(()) };
        if matches!(op, Op::Collective { .. } | Op::Barrier { .. } | Op::Split { .. }) {
            // The flight record shows that this rank got to the call (before the fatal
            // error below writes it out). Not from the streams' count: `submit` checks
            // under their lock (taking it here deadlocked a call that met a fatal error
            // arriving between its first check and its submission).
            self.flight.refused(&op.to_string());
        }
        self.fabric().fatal_seen(&e);
        Err(e)
    }

    /// A part of a job: one schedule over one set of buffers, on channel `chan`.
    pub(crate) fn part(&self, op: Op, chan: u8, desc: Desc, sched: Arc<Schedule>, bufs: PartBufs) -> Part {
        let p = &self.fabric().params;
        let eager_max = match (chan, p.proto) {
            (CHAN_COLL, ProtoChoice::Eager) => usize::MAX,
            (CHAN_COLL, ProtoChoice::Rendezvous) => 0,
            _ => p.eager_max,
        };
        let mut exec = Exec::default();
        exec.reset(sched.steps.len(), self.size());
        Part {
            name: op,
            chan,
            desc,
            call: 0,
            eager_max,
            seqs: Vec::with_capacity(sched.steps.len()),
            sched,
            dtype: bufs.dtype,
            op: bufs.op,
            input: bufs.input,
            output: bufs.output,
            scratch: bufs.scratch,
            exec,
            finished: false,
            unpack: Vec::new(),
            after_others: false,
            ll: None,
        }
    }

    /// A job of `parts`, with the call deadline (`FERROCCL_TIMEOUT` from now).
    pub(crate) fn job_body(&self, parts: Vec<Part>) -> JobBody {
        self.job_body_within(parts, None)
    }

    /// A job of `parts` whose deadline is `timeout` from now (`None`: `FERROCCL_TIMEOUT`).
    pub(crate) fn job_body_within(&self, parts: Vec<Part>, timeout: Option<Duration>) -> JobBody {
        let now = Instant::now();
        let mut body = JobBody {
            comm: self.id,
            rank: self.rank,
            members: self.members.clone(),
            parts,
            deadline: now,
            timeout: Duration::ZERO,
            started: now,
            probe_at: now,
            probe_gap: Duration::ZERO,
            signal: 0,
            flight: Some(self.flight.clone()),
        };
        body.start_clock(now, timeout.unwrap_or(self.fabric().params.timeout));
        body
    }

    /// Numbers the transfers of `job` on this communicator's streams and hands it to the
    /// engine, as one step: jobs enter the engine in the order of their numbers.
    /// `restart`: a persistent plan's job, whose progress is reset and deadline renewed.
    pub(crate) fn submit(&self, job: &Arc<Job>, will_wait: bool, restart: bool) -> Result<()> {
        self.settle_ll()?;
        let mut seqs = self.seqs.lock().unwrap_or_else(|e| e.into_inner());
        {
            let mut body = job.body();
            if restart {
                let timeout = body.timeout;
                body.start_clock(Instant::now(), timeout);
                let n = self.size();
                for p in &mut body.parts {
                    p.reset(n);
                }
            }
            if let Some(p) = body.parts.first() {
                self.check_usable(&p.name)?;
            }
            for p in &mut body.parts {
                let Part { sched, seqs: out, chan, call, desc, ll, .. } = p;
                if *chan == CHAN_COLL {
                    *call = seqs.next_call(desc);
                }
                if let Some(ll) = ll {
                    ll.submitted(seqs.next_ll());
                }
                assign_seqs(sched, &mut |send, peer| seqs.next(*chan, send, peer), out);
            }
        }
        if restart {
            job.rearm();
        }
        self.engine.submit(job.clone(), will_wait);
        Ok(())
    }

    /// Checks, before any operation that does not run on the low-latency slots, that every
    /// member made this rank's last low-latency call if that call did not wait for all of
    /// them (a broadcast, a reduce off the root: see `LlChannel::settle`); waits for them
    /// if need be (their posts come at the start of their calls). An error is fatal.
    pub(crate) fn settle_ll(&self) -> Result<()> {
        let Some(ch) = &self.ll else { return Ok(()) };
        let fabric = self.fabric();
        ch.settle_last(fabric, fabric.params.timeout, &|now| self.engine().tend(now))
            .map_err(|e| fabric.poison_in(e, &|r| self.world_rank(r).unwrap_or(r), Some(self.view())))
    }

    /// Numbers a low-latency call to run on this thread, now: `None` when an earlier one
    /// is still in the engine (this one then queues behind it there).
    pub(crate) fn begin_ll(&self, ch: &LlChannel, desc: &proto::Desc) -> Option<(u32, u64)> {
        let mut seqs = self.seqs.lock().unwrap_or_else(|e| e.into_inner());
        if ch.done() != seqs.ll_calls() {
            return None;
        }
        let call = seqs.next_call(desc);
        Some((call, seqs.next_ll()))
    }

    /// Waits for a job this thread submitted with `will_wait`.
    pub(crate) fn wait_job(&self, job: &Job) -> Result<()> {
        self.engine.wait(job, None);
        job.result()
    }

    /// Submits a one-part job and waits for it: the blocking calls.
    pub(crate) fn run_part(&self, part: Part) -> Result<()> {
        self.run_part_within(part, None)
    }

    /// [`Communicator::run_part`] with the operation's own timeout (`None`:
    /// `FERROCCL_TIMEOUT`).
    pub(crate) fn run_part_within(&self, part: Part, timeout: Option<Duration>) -> Result<()> {
        let job = Job::new(self.job_body_within(vec![part], timeout));
        self.submit(&job, true, false)?;
        self.wait_job(&job)
    }

    /// Sends `data` to member `peer`, which must call [`Communicator::recv`] with a buffer of
    /// the same length. Returns once `data` may be reused. `peer` may not be this rank
    /// itself (it would wait for its own receive): a send to itself goes in a
    /// [`Group`](crate::Group) with the matching receive, or use [`Communicator::sendrecv`].
    /// `T` may be any plain-old-data type (see the [crate documentation](crate#plain-old-data)).
    pub fn send<T: Pod>(&self, data: &[T], peer: usize) -> Result<()> {
        self.run(crate::op::send(data, peer))
    }

    /// Receives into `buf` from member `peer`; the sender's length must equal `buf.len()`.
    /// `T` may be any plain-old-data type.
    pub fn recv<T: Pod>(&self, buf: &mut [T], peer: usize) -> Result<()> {
        self.run(crate::op::recv(buf, peer))
    }

    /// Runs a checked send (see [`Communicator::run`]).
    pub(crate) fn run_send(&self, op: Op, peer: usize, data: &[u8], timeout: Option<Duration>) -> Result<()> {
        self.check_peer(peer, &op)?;
        let part = |src: &RegionHandle| self.p2p_part(op, CHAN_USER, control::send(peer, data.len()), None, src.clone());
        with_region_ro(data, |src| self.run_part_within(part(src), timeout))
    }

    /// Runs a checked receive.
    pub(crate) fn run_recv(&self, op: Op, peer: usize, buf: &mut [u8], timeout: Option<Duration>) -> Result<()> {
        self.check_peer(peer, &op)?;
        let len = buf.len();
        with_region(buf, |dst| self.run_part_within(self.p2p_part(op, CHAN_USER, control::recv(peer, len), None, dst.clone()), timeout))
    }

    /// A point-to-point part: `output` is the buffer its steps address as `Output`, `input`
    /// the one they address as `Input` (sendrecv's source).
    pub(crate) fn p2p_part(&self, op: Op, chan: u8, sched: Schedule, input: Option<RegionHandle>, output: RegionHandle) -> Part {
        self.part(op, chan, NO_DESC, Arc::new(sched), self.bytes_part(input, output))
    }

    /// The buffers of a part that moves bytes without reducing them.
    fn bytes_part(&self, input: Option<RegionHandle>, output: RegionHandle) -> PartBufs {
        PartBufs { dtype: DType::U8, op: ReduceOp::Sum, input, output, scratch: self.scratch.empty() }
    }

    /// Sends `data` to member `to` and receives `buf` from member `from` in one call, which
    /// cannot deadlock whatever pattern the members form (rings, pairs, shifts). `to` and
    /// `from` may both be this rank itself (then `data` is copied into `buf`). `T` may be any
    /// plain-old-data type.
    pub fn sendrecv<T: Pod>(&self, data: &[T], to: usize, buf: &mut [T], from: usize) -> Result<()> {
        self.run(crate::op::sendrecv(data, to, buf, from))
    }

    /// Runs a checked sendrecv.
    pub(crate) fn run_sendrecv(
        &self,
        op: Op,
        (to, d): (usize, &[u8]),
        (from, b): (usize, &mut [u8]),
        timeout: Option<Duration>,
    ) -> Result<()> {
        let Some(sched) = self.sendrecv_sched(&op, (to, d.len()), (from, b.len()))? else {
            b.copy_from_slice(d);
            return Ok(());
        };
        with_region_ro(d, |src| {
            with_region(b, |dst| self.run_part_within(self.p2p_part(op, CHAN_USER, sched, Some(src.clone()), dst.clone()), timeout))
        })
    }

    /// A sendrecv's checks and schedule (`None`: to and from this rank itself, a copy of
    /// the send buffer into the receive buffer, which have the same length).
    pub(crate) fn sendrecv_sched(&self, op: &Op, (to, sent): (usize, usize), (from, got): (usize, usize)) -> Result<Option<Schedule>> {
        match (to == self.rank, from == self.rank) {
            (true, true) if sent == got => {
                self.check_usable(op)?;
                Ok(None)
            }
            (true, true) => Err(Error::invalid(format!("{op}: sends {sent} bytes to itself but receives {got}"))),
            (true, false) | (false, true) => Err(Error::invalid(format!("{op}: only one side is this rank itself"))),
            (false, false) => {
                self.check_peer(to, op)?;
                self.check_peer(from, op)?;
                Ok(Some(control::sendrecv(to, sent, from, got)))
            }
        }
    }

    /// Waits until every member has entered the barrier (dissemination: ⌈log2 n⌉ rounds of
    /// empty messages).
    pub fn barrier(&self) -> Result<()> {
        self.run(crate::op::barrier())
    }

    /// Runs a barrier.
    pub(crate) fn run_barrier(&self, timeout: Option<Duration>) -> Result<()> {
        let op = Op::Barrier { call: None };
        self.check_usable(&op)?;
        if let Some(ch) = self.ll.as_ref().filter(|_| self.takes_ll(LlKind::Barrier, DType::U8, ReduceOp::Sum, 0, None)) {
            if let Some(numbers) = self.begin_ll(ch, &BARRIER_DESC) {
                let spec = LlSpec { kind: LlKind::Barrier, dtype: DType::U8, op: ReduceOp::Sum, count: 0, in_place: true };
                return self.run_ll(ch, numbers, &BARRIER_DESC, &spec, &op, None, None, timeout);
            }
        }
        self.run_part_within(self.barrier_part(op), timeout)
    }

    /// A barrier's part (dissemination over the engine).
    pub(crate) fn barrier_part(&self, op: Op) -> Part {
        let empty = self.scratch.empty();
        let sched = control::barrier(self.rank, self.size());
        let mut part = self.part(op, CHAN_COLL, BARRIER_DESC, Arc::new(sched), self.bytes_part(None, empty));
        // Empty messages: eager whatever FERROCCL_PROTO says for collectives' data.
        part.eager_max = self.fabric().params.eager_max;
        part
    }

    /// Aborts the communicator: every pending operation (on any thread) and every later one
    /// fails promptly with [`Error::Aborted`], and the members are told, so that theirs fail
    /// too (naming this rank) instead of waiting for the timeout. Callable from any thread;
    /// returns at once.
    ///
    /// The abort reaches the communicators split from this one, at any depth (here and, by
    /// the message, in the members), not its parent or siblings: those stay usable. An
    /// abort of the world communicator aborts everything and closes the connections.
    pub fn abort(&self) {
        self.fabric().abort(self.view());
    }

    /// Splits the communicator, like `MPI_Comm_split`: members that pass the same `color`
    /// form a new communicator, ordered by `key` (ties by their rank here). `None` as the
    /// color leaves this rank out (it gets `Ok(None)`). Every member must call it.
    /// The new communicators share this one's connections.
    pub fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Communicator>> {
        self.check_usable(&Op::Split { call: None })?;
        let n = self.size();
        let mut mine = Vec::with_capacity(SPLIT_REC);
        mine.push(u8::from(color.is_some()));
        mine.extend_from_slice(&color.unwrap_or(0).to_le_bytes());
        mine.extend_from_slice(&key.to_le_bytes());
        let mut all = vec![0u8; SPLIT_REC * n];
        all[self.rank * SPLIT_REC..][..SPLIT_REC].copy_from_slice(&mine);
        // The new communicator's id, known before the exchange (the split's number on this
        // communicator, and the color), so that its low-latency slots exist before any
        // member can look for them.
        let next_split = *self.splits.lock().unwrap_or_else(|e| e.into_inner()) + 1;
        let new_id = color.map(|c| fnv(&[u64::from(self.id), u64::from(next_split), u64::from(c)]).max(1));
        let fabric = self.fabric();
        let ll_seg = new_id
            .filter(|_| ll_wanted(&fabric.params, 2))
            .and_then(|id| ll::create(fabric.job, id, fabric.rank, fabric.params.ll_max_bytes).ok());
        // Everyone sends its record to everyone (eager, so the sends never wait).
        let sched = control::exchange(self.rank, n, SPLIT_REC);
        with_region_ro(&mine, |src| {
            with_region(&mut all, |dst| {
                let bufs = self.bytes_part(Some(src.clone()), dst.clone());
                let mut part = self.part(Op::Split { call: None }, CHAN_COLL, SPLIT_DESC, Arc::new(sched), bufs);
                part.eager_max = self.fabric().params.eager_max;
                self.run_part(part)
            })
        })?;
        let count = {
            let mut s = self.splits.lock().unwrap_or_else(|e| e.into_inner());
            *s += 1;
            *s
        };
        let Some(c) = color else { return Ok(None) };
        let mut group: Vec<(i64, usize)> = all
            .chunks(SPLIT_REC)
            .enumerate()
            .filter(|(_, b)| b[0] == 1 && u32::from_le_bytes([b[1], b[2], b[3], b[4]]) == c)
            .map(|(p, b)| {
                let mut k = [0u8; 8];
                k.copy_from_slice(&b[5..13]);
                (i64::from_le_bytes(k), p)
            })
            .collect();
        group.sort();
        let members: Arc<[usize]> = group.iter().map(|&(_, p)| self.members[p]).collect();
        let rank = group.iter().position(|&(_, p)| p == self.rank).ok_or_else(|| Error::internal("split lost this rank"))?;
        let id = fnv(&[u64::from(self.id), u64::from(count), u64::from(c)]).max(1);
        if Some(id) != new_id {
            return Err(Error::internal("split: the communicator's id changed during the exchange (concurrent splits?)"));
        }
        // An abort of this communicator (or of an ancestor) reaches the new one.
        self.fabric().split_from(id, self.id);
        let any_tcp = members.iter().any(|&w| self.fabric().transport_kind(w) == Some(TransportKind::Tcp));
        let ll = connect_ll(self.fabric(), ll_seg, id, &members, rank)?;
        let seqs = self.engine.streams(id, members.clone(), rank);
        let flight = lock_streams(&seqs).flight().clone();
        Ok(Some(Communicator {
            flight,
            ll,
            any_tcp,
            engine: self.engine.clone(),
            id,
            rank,
            seqs,
            members,
            splits: Mutex::new(0),
            shrinks: std::sync::atomic::AtomicU32::new(0),
            scratch: ScratchCache::default(),
            sched_cache: Default::default(),
            departed: AtomicBool::new(false),
            explained: Mutex::default(),
        }))
    }

    /// Ends this rank's part in the communicator, as an agreement with every member: this
    /// rank tells each member where it stopped (how many calls it made, how many messages it
    /// sent to and received from that member), waits for the same from every member, and
    /// compares. It fails, naming the members and what went unmatched, if a message sent to
    /// this rank or by it was never received, or if the members made different numbers of
    /// calls; a member still waiting for this rank in a call it never made fails at once
    /// (see [`Error::PeerLeft`]) instead of at its timeout.
    ///
    /// Finalizing the world communicator (the one [`Communicator::init`] returned) then
    /// closes the connections: every later call on a communicator split from it returns
    /// [`Error::Finalized`]. Dropping a communicator without `finalize` still tells the
    /// members where this rank stopped, but does not wait for them or compare.
    pub fn finalize(self) -> Result<()> {
        self.departed.store(true, Ordering::Release);
        let r = self.agree_to_leave();
        if self.id == 0 {
            self.fabric().set_finalized();
            self.engine.close();
        }
        r
    }

    /// The `LEAVE` record this rank gives member `peer`.
    fn leave_record(&self, how: Departure, peer: usize) -> Leave {
        self.seqs.lock().unwrap_or_else(|e| e.into_inner()).leave(how, peer)
    }

    fn agree_to_leave(&self) -> Result<()> {
        let op = &Op::Finalize;
        self.check_usable(op)?;
        self.settle_ll()?;
        let n = self.size();
        if n == 1 {
            return Ok(());
        }
        let deadline = Instant::now() + self.fabric().params.timeout;
        let peers: Vec<usize> = (0..n).filter(|&p| p != self.rank).collect();
        for &p in &peers {
            let msg = proto::encode_leave(self.id, &self.leave_record(Departure::Finalized, p));
            let r = self.fabric().endpoint(self.members[p])?.post_send(&msg, deadline, &|| self.fabric().pump(op, Some(self.view())));
            r.map_err(|e| self.fabric().poison_in(e, &|r| r, Some(self.view())))?;
        }
        // Every member's record (each follows everything that member sent us).
        let waiting = || -> Vec<usize> {
            let ev = self.fabric().inbox.lock();
            peers.iter().map(|&p| self.members[p]).filter(|w| !ev.left.contains_key(&(self.id, *w))).collect()
        };
        let theirs: Vec<Leave> = self.fabric().run_until(op, Some(self.view()), deadline, &waiting, || {
            let ev = self.fabric().inbox.lock();
            let mut got = Vec::with_capacity(peers.len());
            for &p in &peers {
                let w = self.members[p];
                match ev.left.get(&(self.id, w)) {
                    Some(l) => got.push(*l),
                    // Said goodbye to the whole job without leaving this communicator.
                    None if ev.closed.contains(&w) => {
                        return Err(Error::PeerFailed {
                            rank: self.fabric().rank,
                            peer: w,
                            op: op.clone(),
                            reason: "closed its connections (finalized the world communicator) without finalizing or dropping this one"
                                .into(),
                            cause: None,
                        })
                    }
                    None => return Ok(Poll::Idle),
                }
            }
            Ok(Poll::Ready(got))
        })?;
        let problems = self.compare_leave(&peers, &theirs);
        let forget = || {
            // This communicator's traffic is over: forget what is left of it.
            let mut ev = self.fabric().inbox.lock();
            let id = self.id;
            let gone: usize = ev.data.iter().filter(|(k, _)| k.0 == id && k.1 == CHAN_COLL).map(|(_, q)| q.len()).sum();
            self.fabric().inbox.count_coll(CHAN_COLL, -(gone as isize));
            ev.data.retain(|k, _| k.0 != id);
            ev.cts.retain(|k, _| k.0 != id);
            ev.left.retain(|k, _| k.0 != id);
            ev.agreed.retain(|k| k.0 != id);
        };
        if let Some(&(peer, _)) = problems.first() {
            forget();
            let err = Error::Mismatch {
                rank: self.rank,
                peer,
                op: op.clone(),
                what: problems.iter().map(|(_, w)| w.as_str()).collect::<Vec<_>>().join("; "),
                cause: None,
            };
            // Fatal, and told to every rank (ERR in place of AGREED): no member's finalize
            // may return Ok while this one fails.
            return Err(self.fabric().poison_in(err, &|r| self.members[r], Some(self.view())));
        }
        // Second round: Ok only when every member that finalized found nothing wrong either
        // (a member that found something sends ERR, which fails this wait). Members that
        // dropped the communicator take no part.
        let agreeing: Vec<usize> =
            peers.iter().zip(&theirs).filter(|(_, l)| l.how == Departure::Finalized).map(|(&p, _)| self.members[p]).collect();
        let agreed = proto::encode_agreed(self.id);
        for &w in &agreeing {
            let r = self.fabric().endpoint(w)?.post_send(&agreed, deadline, &|| self.fabric().pump(op, Some(self.view())));
            r.map_err(|e| self.fabric().poison_in(e, &|r| r, Some(self.view())))?;
        }
        let missing = || -> Vec<usize> {
            let ev = self.fabric().inbox.lock();
            agreeing.iter().copied().filter(|w| !ev.agreed.contains(&(self.id, *w))).collect()
        };
        let r = self
            .fabric()
            .run_until(op, Some(self.view()), deadline, &missing, || Ok(if missing().is_empty() { Poll::Ready(()) } else { Poll::Idle }));
        forget();
        r
    }

    /// What does not match between this rank's streams and the members' `LEAVE` records:
    /// (member, description) for each problem.
    fn compare_leave(&self, peers: &[usize], theirs: &[Leave]) -> Vec<(usize, String)> {
        let me = self.rank;
        let chan_name = |c: usize| ["point-to-point", "internal", "collective"][c.min(2)];
        let seqs = self.seqs.lock().unwrap_or_else(|e| e.into_inner());
        let ev = self.fabric().inbox.lock();
        let mut out = Vec::new();
        for (&p, l) in peers.iter().zip(theirs) {
            let mine = seqs.leave(Departure::Finalized, p);
            if l.calls != mine.calls {
                out.push((p, format!("rank {p} {} after call #{}, rank {me} finalized after call #{}", l.how, l.calls, mine.calls)));
            }
            for c in 0..CHANNELS {
                let (they_sent, i_got) = (l.sent[c], mine.recv[c]);
                if they_sent > i_got {
                    // Unmatched messages are still in our queue: say what they were.
                    let key = (self.id, c as u8, self.members[p]);
                    let first = ev.data.get(&key).and_then(|q| q.iter().filter(|m| m.seq >= i_got).min_by_key(|m| m.seq));
                    let what = match first {
                        Some(m) if m.call != 0 => format!(": the first, {} as call #{}", proto::describe(&m.desc), m.call),
                        Some(m) => format!(": the first, {} bytes", m.rts.unwrap_or(m.data.len() as u64)),
                        None => String::new(),
                    };
                    out.push((
                        p,
                        format!(
                            "rank {p} sent rank {me} {} {} message(s) that rank {me} never received{what}",
                            they_sent - i_got,
                            chan_name(c)
                        ),
                    ));
                } else if they_sent < i_got {
                    out.push((
                        p,
                        format!("rank {me} received {} {} messages from rank {p}, which says it sent {they_sent}", i_got, chan_name(c)),
                    ));
                }
                let (i_sent, they_got) = (mine.sent[c], l.recv[c]);
                if i_sent > they_got {
                    out.push((
                        p,
                        format!(
                            "rank {me} sent rank {p} {} {} message(s) that rank {p} never received (stream positions {they_got} to {})",
                            i_sent - they_got,
                            chan_name(c),
                            i_sent - 1
                        ),
                    ));
                } else if i_sent < they_got {
                    out.push((p, format!("rank {p} waited for {} {} message(s) rank {me} never sent", they_got - i_sent, chan_name(c))));
                }
            }
        }
        out
    }
}

impl Drop for Communicator {
    /// Tells the members where this rank stopped (without waiting for them), so that a
    /// member waiting for this rank in a call it will never make fails at once.
    fn drop(&mut self) {
        if self.departed.swap(true, Ordering::AcqRel) || self.size() == 1 {
            return;
        }
        if std::thread::panicking() {
            // Not a clean goodbye: this rank failed. Every peer is told so (as the culprit),
            // and fails at once instead of reading this as an early finalize.
            let me = self.members[self.rank];
            let fault = Fault {
                kind: FaultKind::Failed,
                culprit: Some(me),
                reporter: None,
                op: String::new(),
                what: "panicked (its communicator was dropped while its thread unwound)".into(),
            };
            self.fabric().poison_fault(fault, Scope::Fabric, None);
            return;
        }
        let op = Op::other("drop");
        if self.fabric().finalized_error(self.rank, &op, false).is_some() || self.fabric().fatal_error(&op, Some(self.view())).is_some() {
            return;
        }
        let deadline = Instant::now() + self.fabric().params.timeout.min(Duration::from_secs(1));
        for p in (0..self.size()).filter(|&p| p != self.rank) {
            let msg = proto::encode_leave(self.id, &self.leave_record(Departure::Dropped, p));
            if let Ok(ep) = self.fabric().endpoint(self.members[p]) {
                let _ = ep.post_send(&msg, deadline, &|| self.fabric().pump(&op, Some(self.view())));
            }
        }
    }
}

/// Whether a communicator of `n` ranks made with `params` may have low-latency slots.
fn ll_wanted(params: &Params, n: usize) -> bool {
    params.ll != LlChoice::Off && params.ll_max_bytes > 0 && (2..=ll::MAX_RANKS).contains(&n)
}

/// The low-latency channel of communicator `id` (`members`, this rank `rank`), when every
/// member is reached over shm and each could map every other's slots (`own`: this rank's,
/// made before the exchange that preceded this call; `None` if it could not be made, which
/// the members then see).
fn connect_ll(
    fabric: &Fabric,
    own: Option<ferroccl_mem::ShmSegment>,
    id: u32,
    members: &Arc<[usize]>,
    rank: usize,
) -> Result<Option<Arc<LlChannel>>> {
    let n = members.len();
    let Some(own) = own.filter(|_| ll_wanted(&fabric.params, n)) else { return Ok(None) };
    let all_shm = members.iter().enumerate().all(|(p, &w)| p == rank || fabric.transport_kind(w) == Some(TransportKind::Shm));
    if !all_shm {
        return Ok(None);
    }
    let deadline = Instant::now() + fabric.params.timeout;
    let ch = LlChannel::connect(fabric, own, id, members.clone(), rank, fabric.params.ll_max_bytes, fabric.local_ranks(), deadline)
        .map_err(|e| fabric.poison_in(e, &|r| r, Some(View { comm: id, members })))?;
    Ok(ch.map(Arc::new))
}

/// Bytes of a rank's `split` record: has-color, color, key.
const SPLIT_REC: usize = 13;

/// The buffers and element semantics of a part.
#[derive(Debug)]
pub(crate) struct PartBufs {
    pub(crate) dtype: DType,
    pub(crate) op: ReduceOp,
    pub(crate) input: Option<RegionHandle>,
    pub(crate) output: RegionHandle,
    pub(crate) scratch: RegionHandle,
}
