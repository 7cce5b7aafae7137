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
//! # use ferroccl::{Communicator, InitConfig, Params, ReduceOp};
//! # let token = new_token();
//! # let store = StoreServer::start("127.0.0.1:0".parse().unwrap(), &token, 1 << 20)?;
//! # let cfg = InitConfig { rank: 0, world_size: 1, store: StoreRole::Connect(store.addr().to_string()), token };
//! # let comm = Communicator::init_with(cfg, Params::default())?;
//! let mut grads = vec![1.0f32; 1 << 16];
//! let mut stats = vec![2u64; 4];
//! comm.scope(|s| {
//!     let g = s.allreduce(&mut grads, ReduceOp::Sum)?; // starts, returns at once
//!     drop(s.allreduce(&mut stats, ReduceOp::Max)?); // not waited for: the scope waits
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
use ferroccl_kernels::{as_bytes_mut, DType, Element, ReduceOp};
use ferroccl_mem::region::{region_scope_with, RegionHandle, RegionScope};

use crate::algo::Collective;
use crate::coll::Call;
use crate::comm::Communicator;
use crate::engine::Engine;
use crate::engine::{Job, Part};
use crate::error::{Error, Op, Result};
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
    fn call_part(&self, call: Call<'s>) -> Result<Part> {
        let out_len = call.output_len();
        let spec = call.spec();
        let Call { input, output, .. } = call;
        let prep = self.comm.prepare_call(spec, input.is_none())?;
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
        let job = Job::new(self.comm.job_body(parts));
        self.comm.submit(&job, false, false)?;
        self.state.jobs.lock().unwrap_or_else(|e| e.into_inner()).push(job.clone());
        Ok(Request { job, engine: self.comm.engine().clone(), _scope: PhantomData })
    }

    fn start_call(&self, call: Result<Call<'s>>) -> Result<Request<'s>> {
        let part = self.call_part(call?)?;
        self.submit(vec![part])
    }

    /// Starts one run of a persistent [`Plan`](crate::Plan) (non-blocking
    /// [`Plan::run`](crate::Plan::run)); the plan stays borrowed until the scope ends.
    pub fn start<T: Pod>(&self, plan: &'s mut crate::persistent::Plan<'_, T>) -> Result<Request<'s>> {
        let job = plan.start_in(self.regions)?;
        self.state.jobs.lock().unwrap_or_else(|e| e.into_inner()).push(job.clone());
        Ok(Request { job, engine: self.comm.engine().clone(), _scope: PhantomData })
    }

    /// Non-blocking [`Communicator::allreduce`].
    pub fn allreduce<T: Element>(&self, buf: &'s mut [T], op: ReduceOp) -> Result<Request<'s>> {
        self.start_call(Ok(self.comm.allreduce_call(buf, op)))
    }

    /// Non-blocking [`Communicator::allreduce_into`].
    pub fn allreduce_into<T: Element>(&self, send: &'s [T], recv: &'s mut [T], op: ReduceOp) -> Result<Request<'s>> {
        self.start_call(self.comm.allreduce_into_call(send, recv, op))
    }

    /// Non-blocking [`Communicator::allgather`].
    pub fn allgather<T: Pod>(&self, send: &'s [T], recv: &'s mut [T]) -> Result<Request<'s>> {
        self.start_call(self.comm.allgather_call(send, recv))
    }

    /// Non-blocking [`Communicator::allgather_in_place`].
    pub fn allgather_in_place<T: Pod>(&self, buf: &'s mut [T]) -> Result<Request<'s>> {
        self.start_call(self.comm.allgather_in_place_call(buf))
    }

    /// Non-blocking [`Communicator::reduce_scatter`].
    pub fn reduce_scatter<T: Element>(&self, send: &'s [T], recv: &'s mut [T], op: ReduceOp) -> Result<Request<'s>> {
        self.start_call(self.comm.reduce_scatter_call(send, recv, op))
    }

    /// Non-blocking [`Communicator::reduce_scatter_in_place`].
    pub fn reduce_scatter_in_place<T: Element>(&self, buf: &'s mut [T], op: ReduceOp) -> Result<Request<'s>> {
        self.start_call(self.comm.reduce_scatter_in_place_call(buf, op))
    }

    /// Non-blocking [`Communicator::broadcast`].
    pub fn broadcast<T: Pod>(&self, buf: &'s mut [T], root: usize) -> Result<Request<'s>> {
        self.start_call(self.comm.broadcast_call(buf, root))
    }

    /// Non-blocking [`Communicator::reduce`].
    pub fn reduce<T: Element>(&self, send: &'s [T], recv: &'s mut [T], op: ReduceOp, root: usize) -> Result<Request<'s>> {
        self.start_call(self.comm.reduce_call(send, recv, op, root))
    }

    /// Non-blocking [`Communicator::reduce_in_place`].
    pub fn reduce_in_place<T: Element>(&self, buf: &'s mut [T], op: ReduceOp, root: usize) -> Result<Request<'s>> {
        self.start_call(self.comm.reduce_in_place_call(buf, op, root))
    }

    /// Non-blocking [`Communicator::alltoall`].
    pub fn alltoall<T: Pod>(&self, send: &'s [T], recv: &'s mut [T]) -> Result<Request<'s>> {
        self.start_call(self.comm.alltoall_call(send, recv))
    }

    /// Non-blocking [`Communicator::alltoallv`] (the same checks, before anything starts).
    pub fn alltoallv<T: Pod>(
        &self,
        send: &'s [T],
        send_counts: &[usize],
        send_displs: &[usize],
        recv: &'s mut [T],
        recv_counts: &[usize],
        recv_displs: &[usize],
    ) -> Result<Request<'s>> {
        let prep = self.comm.alltoallv_prepare(
            self.comm.wire::<T>("alltoallv")?,
            (send.len(), send_counts, send_displs),
            (recv.len(), recv_counts, recv_displs),
        )?;
        self.start_prepared(prep, bytemuck::cast_slice(send), bytemuck::cast_slice_mut(recv))
    }

    /// Non-blocking [`Communicator::gather`].
    pub fn gather<T: Pod>(&self, send: &'s [T], recv: &'s mut [T], root: usize) -> Result<Request<'s>> {
        let prep = self.comm.gather_prepare(self.comm.wire::<T>("gather")?, send.len(), recv.len(), root)?;
        self.start_prepared(prep, bytemuck::cast_slice(send), bytemuck::cast_slice_mut(recv))
    }

    /// Non-blocking [`Communicator::scatter`].
    pub fn scatter<T: Pod>(&self, send: &'s [T], recv: &'s mut [T], root: usize) -> Result<Request<'s>> {
        let prep = self.comm.scatter_prepare(self.comm.wire::<T>("scatter")?, send.len(), recv.len(), root)?;
        self.start_prepared(prep, bytemuck::cast_slice(send), bytemuck::cast_slice_mut(recv))
    }

    /// Non-blocking [`Communicator::gatherv`].
    pub fn gatherv<T: Pod>(
        &self,
        send: &'s [T],
        recv: &'s mut [T],
        recv_counts: &[usize],
        recv_displs: &[usize],
        root: usize,
    ) -> Result<Request<'s>> {
        let prep = self.comm.gatherv_prepare(self.comm.wire::<T>("gatherv")?, send.len(), (recv.len(), recv_counts, recv_displs), root)?;
        self.start_prepared(prep, bytemuck::cast_slice(send), bytemuck::cast_slice_mut(recv))
    }

    /// Non-blocking [`Communicator::scatterv`].
    pub fn scatterv<T: Pod>(
        &self,
        send: &'s [T],
        send_counts: &[usize],
        send_displs: &[usize],
        recv: &'s mut [T],
        root: usize,
    ) -> Result<Request<'s>> {
        let prep =
            self.comm.scatterv_prepare(self.comm.wire::<T>("scatterv")?, (send.len(), send_counts, send_displs), recv.len(), root)?;
        self.start_prepared(prep, bytemuck::cast_slice(send), bytemuck::cast_slice_mut(recv))
    }

    /// Registers a per-call collective's buffers (alltoallv, gather, scatter) in the scope
    /// and starts it.
    fn start_prepared(&self, prep: crate::prepared::Prepared, send: &'s [u8], recv: &'s mut [u8]) -> Result<Request<'s>> {
        let part = self.prepared_part(prep, send, recv);
        self.submit(vec![part])
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

    /// Non-blocking [`Communicator::send`]. `peer` may not be this rank itself: a send to
    /// itself goes in a group with its receive (see [`Group::send`]).
    pub fn send<T: Pod>(&self, data: &'s [T], peer: usize) -> Result<Request<'s>> {
        let part = self.send_part(data, peer)?;
        self.submit(vec![part])
    }

    /// Non-blocking [`Communicator::recv`].
    pub fn recv<T: Pod>(&self, buf: &'s mut [T], peer: usize) -> Result<Request<'s>> {
        let part = self.recv_part(buf, peer)?;
        self.submit(vec![part])
    }

    fn send_part<T: Pod>(&self, data: &'s [T], peer: usize) -> Result<Part> {
        let w = self.comm.wire::<T>("send")?;
        let data: &[u8] = bytemuck::cast_slice(data);
        let name = Op::Send { peer, count: data.len(), dtype: DType::U8, pod: None }.per_element(w.size, w.dtype, w.pod);
        self.comm.check_peer(peer, &name)?;
        let sched = crate::algo::control::send(peer, data.len());
        Ok(self.comm.p2p_part(name, CHAN_USER, sched, None, self.regions.register_ro(data)))
    }

    fn recv_part<T: Pod>(&self, buf: &'s mut [T], peer: usize) -> Result<Part> {
        let w = self.comm.wire::<T>("recv")?;
        let buf: &mut [u8] = bytemuck::cast_slice_mut(buf);
        let name = Op::Recv { peer, count: buf.len(), dtype: DType::U8, pod: None }.per_element(w.size, w.dtype, w.pod);
        self.comm.check_peer(peer, &name)?;
        let sched = crate::algo::control::recv(peer, buf.len());
        Ok(self.comm.p2p_part(name, CHAN_USER, sched, None, self.regions.register(buf)))
    }

    /// Starts the operations `f` adds to a [`Group`] as one unit: one submission, one
    /// request; their transfers are in flight together and progress in the same rounds.
    /// Nothing is started if `f` fails (then nothing went on the wire either).
    pub fn group(&self, f: impl for<'g> FnOnce(&'g Group<'s, 'env>) -> Result<()>) -> Result<Request<'s>> {
        let g =
            Group { scope: *self, parts: Mutex::new(Vec::new()), fusable: Mutex::new(Vec::new()), selfs: Mutex::new(SelfP2p::default()) };
        f(&g)?;
        let mut parts = g.parts.into_inner().unwrap_or_else(|e| e.into_inner());
        let fusable = g.fusable.into_inner().unwrap_or_else(|e| e.into_inner());
        let copies = self.self_copies(g.selfs.into_inner().unwrap_or_else(|e| e.into_inner()))?;
        parts.extend(self.fuse(fusable)?);
        parts.extend(copies);
        self.submit(parts)
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
                let call =
                    Call { name: "allreduce", coll: Collective::AllReduce, dtype, op, count, pod: None, input: None, output: Some(buf) };
                parts.push(self.call_part(call)?);
                continue;
            }
            let k = bufs.len();
            let mut prep = self.comm.prepare("allreduce", Collective::AllReduce, dtype, op, count, true)?;
            if let Op::Collective { fused, .. } = &mut prep.name {
                *fused = k;
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
/// group (see [`Group::send`]).
pub struct Group<'s, 'env> {
    scope: Scope<'s, 'env>,
    parts: Mutex<Vec<Part>>,
    /// Small in-place allreduces (call index, dtype, op, buffer), fused when the group ends.
    fusable: Mutex<Vec<Fusable<'s>>>,
    /// Sends to this rank itself and receives from it, matched when the group ends.
    selfs: Mutex<SelfP2p>,
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
    fn add(&self, part: Result<Part>) -> Result<()> {
        let part = part?;
        self.parts.lock().unwrap_or_else(|e| e.into_inner()).push(part);
        Ok(())
    }

    fn add_call(&self, call: Result<Call<'s>>) -> Result<()> {
        self.add(call.and_then(|c| self.scope.call_part(c)))
    }

    /// Adds an [`Communicator::allreduce`]. Small ones (up to `FERROCCL_EAGER_MAX` bytes)
    /// with the same element type and op are fused: packed into one buffer and reduced by
    /// one allreduce, so a group of many small reductions costs about one.
    pub fn allreduce<T: Element>(&self, buf: &'s mut [T], op: ReduceOp) -> Result<()> {
        let bytes = std::mem::size_of_val(buf);
        if bytes == 0 || bytes > self.scope.comm.fabric().params.eager_max {
            return self.add_call(Ok(self.scope.comm.allreduce_call(buf, op)));
        }
        self.fusable.lock().unwrap_or_else(|e| e.into_inner()).push(Fusable { dtype: T::DTYPE, op, buf: as_bytes_mut(buf) });
        Ok(())
    }

    /// Adds an [`Communicator::allreduce_into`].
    pub fn allreduce_into<T: Element>(&self, send: &'s [T], recv: &'s mut [T], op: ReduceOp) -> Result<()> {
        self.add_call(self.scope.comm.allreduce_into_call(send, recv, op))
    }

    /// Adds an [`Communicator::allgather`].
    pub fn allgather<T: Pod>(&self, send: &'s [T], recv: &'s mut [T]) -> Result<()> {
        self.add_call(self.scope.comm.allgather_call(send, recv))
    }

    /// Adds an [`Communicator::allgather_in_place`].
    pub fn allgather_in_place<T: Pod>(&self, buf: &'s mut [T]) -> Result<()> {
        self.add_call(self.scope.comm.allgather_in_place_call(buf))
    }

    /// Adds an [`Communicator::reduce_scatter`].
    pub fn reduce_scatter<T: Element>(&self, send: &'s [T], recv: &'s mut [T], op: ReduceOp) -> Result<()> {
        self.add_call(self.scope.comm.reduce_scatter_call(send, recv, op))
    }

    /// Adds an [`Communicator::reduce_scatter_in_place`].
    pub fn reduce_scatter_in_place<T: Element>(&self, buf: &'s mut [T], op: ReduceOp) -> Result<()> {
        self.add_call(self.scope.comm.reduce_scatter_in_place_call(buf, op))
    }

    /// Adds a [`Communicator::broadcast`].
    pub fn broadcast<T: Pod>(&self, buf: &'s mut [T], root: usize) -> Result<()> {
        self.add_call(self.scope.comm.broadcast_call(buf, root))
    }

    /// Adds a [`Communicator::reduce`].
    pub fn reduce<T: Element>(&self, send: &'s [T], recv: &'s mut [T], op: ReduceOp, root: usize) -> Result<()> {
        self.add_call(self.scope.comm.reduce_call(send, recv, op, root))
    }

    /// Adds a [`Communicator::reduce_in_place`].
    pub fn reduce_in_place<T: Element>(&self, buf: &'s mut [T], op: ReduceOp, root: usize) -> Result<()> {
        self.add_call(self.scope.comm.reduce_in_place_call(buf, op, root))
    }

    /// Adds an [`Communicator::alltoall`].
    pub fn alltoall<T: Pod>(&self, send: &'s [T], recv: &'s mut [T]) -> Result<()> {
        self.add_call(self.scope.comm.alltoall_call(send, recv))
    }

    /// Adds an [`Communicator::alltoallv`] (checked at once, as there).
    pub fn alltoallv<T: Pod>(
        &self,
        send: &'s [T],
        send_counts: &[usize],
        send_displs: &[usize],
        recv: &'s mut [T],
        recv_counts: &[usize],
        recv_displs: &[usize],
    ) -> Result<()> {
        let c = self.scope.comm;
        let prep =
            c.alltoallv_prepare(c.wire::<T>("alltoallv")?, (send.len(), send_counts, send_displs), (recv.len(), recv_counts, recv_displs))?;
        self.add(Ok(self.scope.prepared_part(prep, bytemuck::cast_slice(send), bytemuck::cast_slice_mut(recv))))
    }

    /// Adds a [`Communicator::gather`].
    pub fn gather<T: Pod>(&self, send: &'s [T], recv: &'s mut [T], root: usize) -> Result<()> {
        let prep = self.scope.comm.gather_prepare(self.scope.comm.wire::<T>("gather")?, send.len(), recv.len(), root)?;
        self.add(Ok(self.scope.prepared_part(prep, bytemuck::cast_slice(send), bytemuck::cast_slice_mut(recv))))
    }

    /// Adds a [`Communicator::scatter`].
    pub fn scatter<T: Pod>(&self, send: &'s [T], recv: &'s mut [T], root: usize) -> Result<()> {
        let prep = self.scope.comm.scatter_prepare(self.scope.comm.wire::<T>("scatter")?, send.len(), recv.len(), root)?;
        self.add(Ok(self.scope.prepared_part(prep, bytemuck::cast_slice(send), bytemuck::cast_slice_mut(recv))))
    }

    /// Adds a [`Communicator::gatherv`].
    pub fn gatherv<T: Pod>(
        &self,
        send: &'s [T],
        recv: &'s mut [T],
        recv_counts: &[usize],
        recv_displs: &[usize],
        root: usize,
    ) -> Result<()> {
        let prep = self.scope.comm.gatherv_prepare(
            self.scope.comm.wire::<T>("gatherv")?,
            send.len(),
            (recv.len(), recv_counts, recv_displs),
            root,
        )?;
        self.add(Ok(self.scope.prepared_part(prep, bytemuck::cast_slice(send), bytemuck::cast_slice_mut(recv))))
    }

    /// Adds a [`Communicator::scatterv`].
    pub fn scatterv<T: Pod>(
        &self,
        send: &'s [T],
        send_counts: &[usize],
        send_displs: &[usize],
        recv: &'s mut [T],
        root: usize,
    ) -> Result<()> {
        let prep = self.scope.comm.scatterv_prepare(
            self.scope.comm.wire::<T>("scatterv")?,
            (send.len(), send_counts, send_displs),
            recv.len(),
            root,
        )?;
        self.add(Ok(self.scope.prepared_part(prep, bytemuck::cast_slice(send), bytemuck::cast_slice_mut(recv))))
    }

    /// Adds a [`Communicator::send`] (a group of sends and receives cannot deadlock,
    /// whatever order they are added in: every receive is posted in the first round).
    ///
    /// `peer` may be this rank itself, as in NCCL: the group must then also have a
    /// [`Group::recv`] from this rank of the same length, and the data is copied into it
    /// (the k-th send to itself into the k-th receive from itself). A send to itself left
    /// without its receive, or of another length, fails the group when it ends, before
    /// anything starts.
    pub fn send<T: Pod>(&self, data: &'s [T], peer: usize) -> Result<()> {
        if peer == self.scope.comm.rank() {
            let w = self.scope.comm.wire::<T>("send")?;
            let data: &[u8] = bytemuck::cast_slice(data);
            let name = Op::Send { peer, count: data.len(), dtype: DType::U8, pod: None }.per_element(w.size, w.dtype, w.pod);
            return self.add_self(true, name, self.scope.regions.register_ro(data));
        }
        self.add(self.scope.send_part(data, peer))
    }

    /// Adds a [`Communicator::recv`]. `peer` may be this rank itself: see [`Group::send`].
    pub fn recv<T: Pod>(&self, buf: &'s mut [T], peer: usize) -> Result<()> {
        if peer == self.scope.comm.rank() {
            let w = self.scope.comm.wire::<T>("recv")?;
            let buf: &mut [u8] = bytemuck::cast_slice_mut(buf);
            let name = Op::Recv { peer, count: buf.len(), dtype: DType::U8, pod: None }.per_element(w.size, w.dtype, w.pod);
            return self.add_self(false, name, self.scope.regions.register(buf));
        }
        self.add(self.scope.recv_part(buf, peer))
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
