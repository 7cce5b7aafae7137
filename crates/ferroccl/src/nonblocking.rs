//! Non-blocking operations: [`Scope`], [`Request`] and group calls ([`Group`]).
//!
//! A scope is to operations what `std::thread::scope` is to threads: inside
//! [`Communicator::scope`], collectives and point-to-point calls return a [`Request`] at
//! once and run in the background (the progress engine); their buffers stay borrowed until
//! the scope ends, so the type system, not documentation, keeps the caller from touching
//! them while the operation may still read or write them. When the scope's closure returns,
//! the scope waits for every operation still in flight.
//!
//! ```
//! # use ferroccl::bootstrap::{env::StoreRole, new_token, StoreServer};
//! # use ferroccl::{op, Communicator, InitConfig, Params, ReduceOp};
//! # let token = new_token();
//! # let store = StoreServer::start("127.0.0.1:0".parse().unwrap(), &token, 1 << 20)?;
//! # let cfg = InitConfig { rank: 0, world_size: 1, store: StoreRole::Connect(store.addr().to_string()), token };
//! # let comm = Communicator::init_with(cfg, Params::default())?;
//! let mut grads = vec![1.0f32; 1 << 16];
//! let mut stats = vec![2u64; 4];
//! comm.scope(|s| {
//!     let g = s.start(op::allreduce(&mut grads, ReduceOp::Sum))?; // starts, returns at once
//!     drop(s.start(op::allreduce(&mut stats, ReduceOp::Max))?); // not waited for: the scope waits
//!     // ... compute something that touches neither buffer ...
//!     g.wait()
//! })?;
//! assert_eq!(stats, [2; 4]);
//! # Ok::<(), ferroccl::Error>(())
//! ```
//!
//! # Semantics
//!
//! * Operations of one communicator are matched between ranks in the order they are
//!   issued, so every rank must issue them in the same order; several may be in flight at
//!   once, and they complete as if run one after the other in that order.
//! * Dropping a [`Request`] neither cancels nor waits: the operation goes on, and the end
//!   of the scope waits for it (a collective cannot be cancelled on one rank alone). An
//!   error of an operation nobody waited for is what the scope returns.
//! * A fatal error (a peer's death, a timeout, an [`Communicator::abort`]) fails every
//!   operation in flight, and every later one, on this communicator and the ones sharing
//!   its connections.
//! * [`Request`] implements [`Future`]: an async caller can `.await` it (the progress
//!   engine's thread drives it and wakes the task).

use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytemuck::Pod;
use ferroccl_kernels::{DType, ReduceOp};
use ferroccl_mem::region::{region_scope_with, RegionHandle, RegionScope};

use crate::algo::{control, Collective};
use crate::checks::{Call, Work};
use crate::comm::Communicator;
use crate::engine::Engine;
use crate::engine::{Job, Part};
use crate::error::{Error, Op, Result};
use crate::op::{Input, Operation, Options};
use crate::proto::CHAN_USER;

/// What a scope keeps: its jobs, the scratch memory they borrowed from the
/// communicator's pool, and the ids of the windows made in it.
#[derive(Debug, Default)]
pub(crate) struct ScopeState {
    jobs: Mutex<Vec<Arc<Job>>>,
    scratch: Mutex<Vec<RegionHandle>>,
    /// Removed at the scope's end if still live (a window leaked with `mem::forget`):
    /// a window's verbs memory region holds a lease that the scope's end waits for.
    windows: Mutex<Vec<u32>>,
}

/// A scope for non-blocking operations; see [`Communicator::scope`] and the
/// [module documentation](self).
#[derive(Clone, Copy)]
pub struct Scope<'s, 'env> {
    pub(crate) comm: &'env Communicator,
    pub(crate) regions: &'s RegionScope<'s, 'env>,
    state: &'s ScopeState,
}

impl std::fmt::Debug for Scope<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scope").field("rank", &self.comm.rank()).field("size", &self.comm.size()).finish()
    }
}

/// An operation in flight: wait for it, test it, or `.await` it.
///
/// `Send + Sync`: it may be waited for on another thread (inside the scope).
pub struct Request<'s> {
    job: Arc<Job>,
    engine: Arc<Engine>,
    _scope: PhantomData<&'s ()>,
}

impl std::fmt::Debug for Request<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Request").field("done", &self.job.is_done()).finish()
    }
}

impl Request<'_> {
    /// Waits until the operation completes (at the latest its `FERROCCL_TIMEOUT` deadline,
    /// which fails it with [`Error::Timeout`]).
    pub fn wait(self) -> Result<()> {
        self.engine.wait(&self.job, None);
        self.job.observe()
    }

    /// Waits at most `limit`: `Ok(true)` if the operation completed, `Ok(false)` if it is
    /// still running (it goes on), `Err` if it failed.
    pub fn wait_timeout(&self, limit: Duration) -> Result<bool> {
        if self.engine.wait(&self.job, Some(Instant::now() + limit)) {
            self.job.observe().map(|()| true)
        } else {
            Ok(false)
        }
    }

    /// Whether the operation has completed (`Err` if it failed); never blocks, and moves
    /// the engine one round forward when no other thread is driving it.
    pub fn test(&self) -> Result<bool> {
        if !self.job.is_done() {
            self.engine.try_round();
        }
        if self.job.is_done() {
            self.job.observe().map(|()| true)
        } else {
            Ok(false)
        }
    }
}

impl Future for Request<'_> {
    type Output = Result<()>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        if self.job.is_done() || self.job.set_waker(cx.waker()) {
            return Poll::Ready(self.job.observe());
        }
        // The engine's thread drives the job and wakes the task.
        self.engine.ensure_background();
        Poll::Pending
    }
}

impl Communicator {
    /// Runs `f` with a [`Scope`] in which operations are non-blocking; when `f` returns, waits
    /// for every operation it started and left running. Returns `f`'s error if it failed,
    /// else the first error of an operation whose [`Request`] was not waited for, else `f`'s
    /// value. See the [module documentation](crate::nonblocking).
    pub fn scope<'env, R>(&'env self, f: impl for<'s> FnOnce(Scope<'s, 'env>) -> Result<R>) -> Result<R> {
        region_scope_with(ScopeState::default(), |regions, state| {
            let scope = Scope { comm: self, regions, state };
            // Waits also when `f` unwinds, before the registrations end.
            let wait_all = WaitAll(scope);
            let r = f(scope);
            let unobserved = wait_all.finish();
            match (r, unobserved) {
                (Err(e), _) => Err(e),
                (Ok(_), Some(e)) => Err(e),
                (Ok(v), None) => Ok(v),
            }
        })
    }

    /// Runs the operations `f` adds to a [`Group`] as one unit, and waits for them: one
    /// submission, their transfers in flight together.
    pub fn group<'env>(&'env self, f: impl for<'g, 's> FnOnce(&'g Group<'s, 'env>) -> Result<()>) -> Result<()> {
        self.scope(|s| s.group(f)?.wait())
    }
}

/// A small in-place allreduce of a group, waiting to be fused.
struct Fusable<'s> {
    dtype: DType,
    op: ReduceOp,
    buf: &'s mut [u8],
}

/// Waits for a scope's jobs when dropped (on unwind); [`WaitAll::finish`] does it on the
/// normal path and reports errors nobody looked at.
struct WaitAll<'s, 'env>(Scope<'s, 'env>);

impl WaitAll<'_, '_> {
    fn finish(self) -> Option<Error> {
        let e = self.wait();
        std::mem::forget(self);
        e
    }

    fn wait(&self) -> Option<Error> {
        let s = &self.0;
        let jobs = std::mem::take(&mut *s.state.jobs.lock().unwrap_or_else(|e| e.into_inner()));
        let engine = s.comm.engine();
        let mut first = None;
        for job in &jobs {
            engine.wait(job, None);
            if let Err(e) = job.observe_if_unobserved() {
                first.get_or_insert(e);
            }
        }
        for h in std::mem::take(&mut *s.state.scratch.lock().unwrap_or_else(|e| e.into_inner())) {
            s.comm.scratch().put(h);
        }
        // Windows that were dropped are gone already; a leaked one goes now, before the
        // scope's registrations end (which wait for its memory region's lease).
        for id in std::mem::take(&mut *s.state.windows.lock().unwrap_or_else(|e| e.into_inner())) {
            if engine.fabric().windows.remove(id) {
                engine.unserve_window();
            }
        }
        first
    }
}

impl Drop for WaitAll<'_, '_> {
    fn drop(&mut self) {
        let _ = self.wait();
    }
}

impl<'s, 'env> Scope<'s, 'env> {
    /// The communicator.
    pub fn comm(&self) -> &'env Communicator {
        self.comm
    }

    /// Notes window `id` as made in this scope (see `ScopeState::windows`).
    pub(crate) fn made_window(&self, id: u32) {
        self.state.windows.lock().unwrap_or_else(|e| e.into_inner()).push(id);
    }

    /// Registers a call's buffers in the scope and makes its part.
    fn call_part(&self, call: Call<'s>, opts: &Options) -> Result<Part> {
        let out_len = call.output_len();
        let spec = call.spec();
        let Call { input, output, .. } = call;
        let input = input.into_bytes();
        let prep = self.comm.prepare_call(spec, input.is_none(), opts)?;
        let scratch = self.comm.scratch().get(prep.sched.scratch_bytes);
        self.state.scratch.lock().unwrap_or_else(|e| e.into_inner()).push(scratch.clone());
        let output = match output {
            Some(o) => self.regions.register(o),
            None => RegionHandle::owned(out_len),
        };
        let input = input.map(|i| self.regions.register_ro(i));
        Ok(self.comm.coll_part(prep, input, output, scratch))
    }

    pub(crate) fn submit(&self, parts: Vec<Part>) -> Result<Request<'s>> {
        self.submit_within(parts, None)
    }

    /// Submits `parts` as one job whose deadline is `timeout` from now (`None`:
    /// `FERROCCL_TIMEOUT`).
    fn submit_within(&self, parts: Vec<Part>, timeout: Option<Duration>) -> Result<Request<'s>> {
        let job = Job::new(self.comm.job_body_within(parts, timeout));
        self.comm.submit(&job, false, false)?;
        self.state.jobs.lock().unwrap_or_else(|e| e.into_inner()).push(job.clone());
        Ok(Request { job, engine: self.comm.engine().clone(), _scope: PhantomData })
    }

    /// Starts `op` in the background and returns at once: the non-blocking runner (see
    /// [`crate::op`]). Its buffers stay borrowed until the scope ends.
    pub fn start<T: Pod>(&self, op: Operation<'s, T>) -> Result<Request<'s>> {
        let Operation { body, opts, .. } = op;
        let work = self.comm.check(body, &opts)?;
        let parts = self.work_part(work, &opts)?.into_iter().collect();
        self.submit_within(parts, opts.timeout)
    }

    /// Starts one run of a persistent [`Plan`](crate::Plan) (non-blocking
    /// [`Plan::run`](crate::Plan::run)); the plan stays borrowed until the scope ends.
    pub fn start_plan<T: Pod>(&self, plan: &'s mut crate::persistent::Plan<'_, T>) -> Result<Request<'s>> {
        let job = plan.start_in(self.regions)?;
        self.state.jobs.lock().unwrap_or_else(|e| e.into_inner()).push(job.clone());
        Ok(Request { job, engine: self.comm.engine().clone(), _scope: PhantomData })
    }

    /// The part of checked work, its buffers registered in the scope (`None`: nothing to
    /// run, a sendrecv to and from this rank itself, done here).
    fn work_part(&self, work: Work<'s>, opts: &Options) -> Result<Option<Part>> {
        let c = self.comm;
        Ok(Some(match work {
            Work::Coll(call) => self.call_part(call, opts)?,
            Work::V { prep, input, output } => self.prepared_part(prep, input.into_bytes().unwrap_or_default(), output),
            Work::Send { name, peer, data } => {
                c.check_peer(peer, &name)?;
                let data = data.into_bytes().unwrap_or_default();
                c.p2p_part(name, CHAN_USER, control::send(peer, data.len()), None, self.regions.register_ro(data))
            }
            Work::Recv { name, peer, buf } => {
                c.check_peer(peer, &name)?;
                c.p2p_part(name, CHAN_USER, control::recv(peer, buf.len()), None, self.regions.register(buf))
            }
            Work::SendRecv { name, to, from, data, buf } => {
                let data = data.into_bytes().unwrap_or_default();
                let Some(sched) = c.sendrecv_sched(&name, (to, data.len()), (from, buf.len()))? else {
                    buf.copy_from_slice(data);
                    return Ok(None);
                };
                c.p2p_part(name, CHAN_USER, sched, Some(self.regions.register_ro(data)), self.regions.register(buf))
            }
            Work::Barrier => {
                let name = Op::Barrier { call: None };
                c.check_usable(&name)?;
                c.barrier_part(name)
            }
        }))
    }

    /// The part of a per-call collective (alltoallv, gather, scatter), its buffers
    /// registered in the scope.
    fn prepared_part(&self, prep: crate::prepared::Prepared, send: &'s [u8], recv: &'s mut [u8]) -> Part {
        let scratch = self.comm.scratch().get(prep.sched.scratch_bytes);
        self.state.scratch.lock().unwrap_or_else(|e| e.into_inner()).push(scratch.clone());
        let output = self.regions.register(recv);
        let input = self.regions.register_ro(send);
        self.comm.coll_part(prep, Some(input), output, scratch)
    }

    /// Starts the operations `f` adds to a [`Group`] as one unit: one submission, one
    /// request; their transfers are in flight together and progress in the same rounds.
    /// Nothing is started if `f` fails (then nothing went on the wire either).
    pub fn group(&self, f: impl for<'g> FnOnce(&'g Group<'s, 'env>) -> Result<()>) -> Result<Request<'s>> {
        let g = Group {
            scope: *self,
            parts: Mutex::new(Vec::new()),
            fusable: Mutex::new(Vec::new()),
            selfs: Mutex::new(SelfP2p::default()),
            timeout: Mutex::new(None),
        };
        f(&g)?;
        let mut parts = g.parts.into_inner().unwrap_or_else(|e| e.into_inner());
        let fusable = g.fusable.into_inner().unwrap_or_else(|e| e.into_inner());
        let copies = self.self_copies(g.selfs.into_inner().unwrap_or_else(|e| e.into_inner()))?;
        parts.extend(self.fuse(fusable)?);
        parts.extend(copies);
        self.submit_within(parts, g.timeout.into_inner().unwrap_or_else(|e| e.into_inner()))
    }

    /// The local copies of a group's sends to this rank itself (NCCL's self send/receive in
    /// a group): the k-th send to itself goes to the k-th receive from itself, which must
    /// have the same length in bytes; one left without its partner is an error (nothing
    /// could ever match it: the group would wait forever).
    fn self_copies(&self, SelfP2p { sends, recvs }: SelfP2p) -> Result<Vec<Part>> {
        let me = self.comm.rank();
        let (n_sends, n_recvs) = (sends.len(), recvs.len());
        let (mut sends, mut recvs) = (sends.into_iter(), recvs.into_iter());
        let mut parts = Vec::with_capacity(n_sends);
        for k in 1.. {
            match (sends.next(), recvs.next()) {
                (None, None) => break,
                (Some((s, sent)), Some((r, got))) if sent.len() != got.len() => {
                    return Err(Error::invalid(format!(
                        "rank {me}: group: its send #{k} to itself ({s}, {} bytes) and its receive #{k} from itself ({r}, {} \
                         bytes) differ in length (the k-th send to this rank itself goes to the k-th receive from it)",
                        sent.len(),
                        got.len()
                    )))
                }
                (Some((_, sent)), Some((r, got))) => {
                    let sched = crate::algo::control::self_copy(got.len());
                    parts.push(self.comm.p2p_part(r, CHAN_USER, sched, Some(sent), got));
                }
                (Some((s, _)), None) => {
                    return Err(Error::invalid(format!(
                        "rank {me}: group: {s} (send #{k} to itself) has no matching receive from rank {me} in the group \
                         ({n_sends} sends to itself, {n_recvs} receives): a send to this rank itself is a copy into a receive \
                         from itself added to the same group"
                    )))
                }
                (None, Some((r, _))) => {
                    return Err(Error::invalid(format!(
                        "rank {me}: group: {r} (receive #{k} from itself) has no matching send to rank {me} in the group \
                         ({n_sends} sends to itself, {n_recvs} receives): a receive from this rank itself is a copy of a send \
                         to itself added to the same group"
                    )))
                }
            }
        }
        Ok(parts)
    }

    /// The parts of a group's small in-place allreduces: those with the same element type
    /// and op are packed into one buffer and reduced by one allreduce (one message per
    /// peer instead of one per call), then copied back; a call with no partner runs alone.
    fn fuse(&self, calls: Vec<Fusable<'s>>) -> Result<Vec<Part>> {
        let mut parts = Vec::new();
        let mut groups: Vec<(DType, ReduceOp, Vec<&'s mut [u8]>)> = Vec::new();
        for Fusable { dtype, op, buf } in calls {
            match groups.iter_mut().find(|(d, o, _)| *d == dtype && *o == op) {
                Some(g) => g.2.push(buf),
                None => groups.push((dtype, op, vec![buf])),
            }
        }
        for (dtype, op, bufs) in groups {
            let total: usize = bufs.iter().map(|b| b.len()).sum();
            let count = total / dtype.size();
            if bufs.len() == 1 {
                let buf = bufs.into_iter().next().unwrap_or_default();
                let call = Call {
                    name: "allreduce",
                    coll: Collective::AllReduce,
                    dtype,
                    op,
                    count,
                    pod: None,
                    input: Input::None,
                    output: Some(buf),
                };
                parts.push(self.call_part(call, &Options::default())?);
                continue;
            }
            let k = bufs.len();
            let mut prep = self.comm.prepare("allreduce", Collective::AllReduce, dtype, op, count, true, &Options::default())?;
            if let Op::Collective { fused, .. } = &mut prep.name {
                *fused = u32::try_from(k).unwrap_or(u32::MAX);
            }
            let staging = RegionHandle::owned(total);
            let mut unpack = Vec::with_capacity(k);
            let mut off = 0;
            for b in bufs {
                staging.write_at(off, b).map_err(|e| Error::internal(format!("allreduce (fused): {e}")))?;
                let len = b.len();
                unpack.push((self.regions.register(b), off));
                off += len;
            }
            let scratch = self.comm.scratch().get(prep.sched.scratch_bytes);
            self.state.scratch.lock().unwrap_or_else(|e| e.into_inner()).push(scratch.clone());
            let mut part = self.comm.coll_part(prep, None, staging, scratch);
            part.unpack = unpack;
            parts.push(part);
        }
        Ok(parts)
    }
}

/// Operations collected to start as one unit; see [`Scope::group`] and
/// [`Communicator::group`]. Its calls check their arguments at once and start nothing until
/// the group is complete.
///
/// It takes the collective and point-to-point calls a [`Scope`] takes, and one more: as in
/// NCCL, a send to this rank itself, copied into a receive from itself added to the same
/// group (see [`Group::add`]).
pub struct Group<'s, 'env> {
    scope: Scope<'s, 'env>,
    parts: Mutex<Vec<Part>>,
    /// Small in-place allreduces (call index, dtype, op, buffer), fused when the group ends.
    fusable: Mutex<Vec<Fusable<'s>>>,
    /// Sends to this rank itself and receives from it, matched when the group ends.
    selfs: Mutex<SelfP2p>,
    /// The shortest of the operations' own timeouts.
    timeout: Mutex<Option<Duration>>,
}

/// A group's sends to this rank itself and receives from it, in the order they were added
/// (each with its name and registered buffer).
#[derive(Default)]
struct SelfP2p {
    sends: Vec<(Op, RegionHandle)>,
    recvs: Vec<(Op, RegionHandle)>,
}

impl std::fmt::Debug for Group<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.parts.lock().unwrap_or_else(|e| e.into_inner()).len();
        f.debug_struct("Group").field("operations", &n).finish()
    }
}

impl<'s> Group<'s, '_> {
    /// Adds `op` to the group: checked at once, started with the others when the group is
    /// complete (see [`crate::op`]).
    ///
    /// Small in-place allreduces (up to `FERROCCL_EAGER_MAX` bytes, without options) with
    /// the same element type and op are fused: packed into one buffer and reduced by one
    /// allreduce, so a group of many small reductions costs about one.
    ///
    /// A group of sends and receives cannot deadlock, whatever order they are added in
    /// (every receive is posted in the first round). As in NCCL, a send's `peer` may be this
    /// rank itself: the group must then also have a receive from this rank of the same
    /// length, and the data is copied into it (the k-th send to itself into the k-th receive
    /// from itself). A send to itself left without its receive, or of another length, fails
    /// the group when it ends, before anything starts.
    ///
    /// An operation's own timeout bounds the whole group (the shortest one wins).
    pub fn add<T: Pod>(&self, op: Operation<'s, T>) -> Result<()> {
        let Operation { body, opts, .. } = op;
        let c = self.scope.comm;
        let me = c.rank();
        let work = c.check(body, &opts)?;
        if let Some(t) = opts.timeout {
            let mut g = self.timeout.lock().unwrap_or_else(|e| e.into_inner());
            *g = Some(g.map_or(t, |g| g.min(t)));
        }
        match work {
            Work::Coll(Call { coll: Collective::AllReduce, dtype, op, input: Input::None, output: Some(buf), .. })
                if !buf.is_empty() && buf.len() <= c.fabric().params.eager_max && opts == Options::default() =>
            {
                self.fusable.lock().unwrap_or_else(|e| e.into_inner()).push(Fusable { dtype, op, buf });
                Ok(())
            }
            Work::Send { name, peer, data } if peer == me => {
                self.add_self(true, name, self.scope.regions.register_ro(data.into_bytes().unwrap_or_default()))
            }
            Work::Recv { name, peer, buf } if peer == me => self.add_self(false, name, self.scope.regions.register(buf)),
            work => {
                if let Some(part) = self.scope.work_part(work, &opts)? {
                    self.parts.lock().unwrap_or_else(|e| e.into_inner()).push(part);
                }
                Ok(())
            }
        }
    }

    /// Notes a send to this rank itself (`send`) or a receive from it, to be matched when
    /// the group ends.
    fn add_self(&self, send: bool, name: Op, buf: RegionHandle) -> Result<()> {
        self.scope.comm.check_usable(&name)?;
        let mut selfs = self.selfs.lock().unwrap_or_else(|e| e.into_inner());
        if send { &mut selfs.sends } else { &mut selfs.recvs }.push((name, buf));
        Ok(())
    }
}
