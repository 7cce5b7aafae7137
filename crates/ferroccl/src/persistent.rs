//! Persistent plans: a collective built once and run many times (MPI-4's
//! `MPI_Allreduce_init` + `MPI_Start`).
//!
//! Building a plan checks the arguments, picks the algorithm, builds the schedule, numbers
//! its transfers, allocates its scratch memory and registers its buffers with the fabric;
//! [`Plan::run`] then only moves data: it allocates nothing and registers nothing (a test
//! counts both). The plan borrows its buffers for its whole life; between runs they are
//! read and rewritten through [`Plan::output_mut`] / [`Plan::input_mut`].
//!
//! ```
//! # use ferroccl::bootstrap::{env::StoreRole, new_token, StoreServer};
//! # use ferroccl::{Communicator, InitConfig, Params, ReduceOp};
//! # let token = new_token();
//! # let store = StoreServer::start("127.0.0.1:0".parse().unwrap(), &token, 1 << 20)?;
//! # let cfg = InitConfig { rank: 0, world_size: 1, store: StoreRole::Connect(store.addr().to_string()), token };
//! # let comm = Communicator::init_with(cfg, Params::default())?;
//! let mut grads = vec![0.0f32; 1024];
//! let mut plan = comm.allreduce_plan(&mut grads, ReduceOp::Sum)?;
//! for step in 0..10 {
//!     plan.output_mut().fill(step as f32); // this step's gradients
//!     plan.run()?;
//!     assert_eq!(plan.output()[0], step as f32 * comm.size() as f32);
//! }
//! # Ok::<(), ferroccl::Error>(())
//! ```
//!
//! The plans of the data-movement calls (allgather, broadcast, alltoallv, gather, scatter,
//! gatherv, scatterv) take any plain-old-data type, as the calls do (see the
//! [crate documentation](crate#plain-old-data)); the reductions' plans take the
//! [`Element`] types.
//!
//! Every rank must run its plans in the same order as its other operations on the
//! communicator (a plan's run is an operation like any other).
//!
//! The clear-to-send of each rendezvous transfer still goes over the wire on every run: it
//! is the receiver's flow control (its buffer is free again), and carries the descriptor
//! registered when the plan was built.

use std::marker::PhantomData;
use std::sync::Arc;

use bytemuck::Pod;
use ferroccl_kernels::{Element, ReduceOp};
use ferroccl_mem::region::{RegionHandle, RegionScope, Registration};

use crate::algo::ll::LlSpec;
use crate::coll::CallSpec;
use crate::comm::Communicator;
use crate::engine::Job;
use crate::error::{Error, Op, Result};
use crate::logging::flog;
use crate::prepared::Prepared;
use crate::proto::Desc;

/// A collective built once, run many times; see the [module documentation](self).
pub struct Plan<'a, T: Pod> {
    comm: &'a Communicator,
    job: Arc<Job>,
    output: Registration<'a>,
    input: Option<Registration<'a>>,
    scratch: RegionHandle,
    runs: u64,
    /// A low-latency plan (see `crate::ll`): what its runs on the caller's thread need.
    ll: Option<(LlSpec, Desc, Op)>,
    _t: PhantomData<T>,
}

impl<T: Pod> std::fmt::Debug for Plan<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = self.job.body().parts.first().map(|p| p.name.to_string()).unwrap_or_default();
        f.debug_struct("Plan").field("op", &name).field("runs", &self.runs).finish()
    }
}

impl<'a, T: Pod> Plan<'a, T> {
    /// `call` was checked on temporary borrows of `input` / `output`, which the plan then
    /// holds for its life.
    fn build(comm: &'a Communicator, call: CallSpec, input: Option<&'a mut [T]>, output: &'a mut [T]) -> Result<Plan<'a, T>> {
        let prep = comm.prepare_call(call, input.is_none())?;
        Self::build_prepared(comm, prep, input, output)
    }

    /// A plan of the prepared call `prep` (checked against `input` / `output`).
    fn build_prepared(comm: &'a Communicator, prep: Prepared, input: Option<&'a mut [T]>, output: &'a mut [T]) -> Result<Plan<'a, T>> {
        let scratch = RegionHandle::owned(prep.sched.scratch_bytes);
        let out = Registration::new(bytemuck::cast_slice_mut(output));
        // Writable, so that the owner can refill it between runs; the schedules never
        // write into an input.
        let inp = input.map(|i| Registration::new(bytemuck::cast_slice_mut(i)));
        let fabric = comm.fabric();
        fabric.register_cached(out.handle());
        fabric.register_cached(&scratch);
        let ll = prep.ll.filter(|_| comm.ll.is_some()).map(|spec| (spec, prep.desc, prep.name.clone()));
        flog!(
            Info,
            Plan,
            "rank {}: plan of {}: {}, buffers registered once ({} B out, {} B scratch)",
            comm.rank(),
            prep.name,
            if ll.is_some() {
                "runs on the low-latency slots".to_string()
            } else {
                format!("a schedule of {} steps", prep.sched.steps.len())
            },
            out.handle().len(),
            prep.sched.scratch_bytes
        );
        let part = comm.coll_part(prep, inp.as_ref().map(|r| r.handle().clone()), out.handle().clone(), scratch.clone());
        let job = Job::new(comm.job_body(vec![part]));
        Ok(Plan { comm, job, output: out, input: inp, scratch, runs: 0, ll, _t: PhantomData })
    }

    /// Runs the collective once and waits for it. Moves data only: no allocation, no
    /// registration. An error is fatal for the communicator, as for any call.
    pub fn run(&mut self) -> Result<()> {
        if let (Some((spec, desc, name)), Some(ch)) = (&self.ll, &self.comm.ll) {
            // A low-latency plan runs on this thread unless an earlier low-latency call is
            // still in the engine.
            if let Some(numbers) = self.comm.begin_ll(ch, desc) {
                self.runs += 1;
                let Plan { comm, output, input, .. } = self;
                let out = output.bytes_mut().map_err(|e| Error::internal(format!("{name}: the plan's output: {e}")))?;
                return comm.run_ll(ch, numbers, desc, spec, name, input.as_ref().map(Registration::bytes), Some(out));
            }
        }
        let Plan { comm, job, output, input, .. } = self;
        let r = output.active(|_| match input {
            Some(i) => i.active(|_| Self::run_job(comm, job)),
            None => Self::run_job(comm, job),
        });
        self.runs += 1;
        r
    }

    fn run_job(comm: &Communicator, job: &Arc<Job>) -> Result<()> {
        comm.submit(job, true, true)?;
        comm.wait_job(job)
    }

    /// Starts one run inside a scope (see [`Communicator::scope`]): the plan stays borrowed
    /// until the scope ends; wait for the run with the returned request.
    pub(crate) fn start_in<'s>(&'s mut self, regions: &'s RegionScope<'s, '_>) -> Result<Arc<Job>> {
        regions.activate(&mut self.output);
        if let Some(i) = self.input.as_mut() {
            regions.activate(i);
        }
        self.comm.submit(&self.job, false, true)?;
        self.runs += 1;
        Ok(self.job.clone())
    }

    /// How many times the plan has run (or been started).
    pub fn runs(&self) -> u64 {
        self.runs
    }

    /// The output buffer (the result of the last run).
    pub fn output(&self) -> &[T] {
        bytemuck::cast_slice(self.output.bytes())
    }

    /// The output buffer, to write the next run's input into (in-place plans).
    pub fn output_mut(&mut self) -> &mut [T] {
        match self.output.bytes_mut() {
            Ok(b) => bytemuck::cast_slice_mut(b),
            Err(_) => &mut [],
        }
    }

    /// The separate input buffer of an out-of-place plan (`None` for in-place ones), to
    /// write the next run's input into.
    pub fn input_mut(&mut self) -> Option<&mut [T]> {
        self.input.as_mut().and_then(|r| r.bytes_mut().ok()).map(bytemuck::cast_slice_mut)
    }
}

impl<T: Pod> Drop for Plan<'_, T> {
    fn drop(&mut self) {
        let fabric = self.comm.fabric();
        fabric.deregister(self.output.handle());
        fabric.deregister(&self.scratch);
    }
}

impl Communicator {
    /// A persistent in-place allreduce of `buf`; see [`Plan`].
    pub fn allreduce_plan<'a, T: Element>(&'a self, buf: &'a mut [T], op: ReduceOp) -> Result<Plan<'a, T>> {
        let call = self.allreduce_call(&mut *buf, op).spec();
        Plan::build(self, call, None, buf)
    }

    /// A persistent out-of-place allreduce of `send` into `recv` (see
    /// [`Communicator::allreduce_into`]); refill `send` through [`Plan::input_mut`].
    pub fn allreduce_into_plan<'a, T: Element>(&'a self, send: &'a mut [T], recv: &'a mut [T], op: ReduceOp) -> Result<Plan<'a, T>> {
        let call = self.allreduce_into_call(&*send, &mut *recv, op)?.spec();
        Plan::build(self, call, Some(send), recv)
    }

    /// A persistent allgather of `send` into `recv` (see [`Communicator::allgather`]).
    pub fn allgather_plan<'a, T: Pod>(&'a self, send: &'a mut [T], recv: &'a mut [T]) -> Result<Plan<'a, T>> {
        let call = self.allgather_call(&*send, &mut *recv)?.spec();
        Plan::build(self, call, Some(send), recv)
    }

    /// A persistent reduce-scatter of `send` into `recv` (see
    /// [`Communicator::reduce_scatter`]).
    pub fn reduce_scatter_plan<'a, T: Element>(&'a self, send: &'a mut [T], recv: &'a mut [T], op: ReduceOp) -> Result<Plan<'a, T>> {
        let call = self.reduce_scatter_call(&*send, &mut *recv, op)?.spec();
        Plan::build(self, call, Some(send), recv)
    }

    /// A persistent alltoallv (see [`Communicator::alltoallv`]): the counts and
    /// displacements are checked and the schedule is built once, for every run; refill
    /// `send` through [`Plan::input_mut`].
    pub fn alltoallv_plan<'a, T: Pod>(
        &'a self,
        send: &'a mut [T],
        send_counts: &[usize],
        send_displs: &[usize],
        recv: &'a mut [T],
        recv_counts: &[usize],
        recv_displs: &[usize],
    ) -> Result<Plan<'a, T>> {
        let prep = self.alltoallv_prepare(
            self.wire::<T>("alltoallv")?,
            (send.len(), send_counts, send_displs),
            (recv.len(), recv_counts, recv_displs),
        )?;
        Plan::build_prepared(self, prep, Some(send), recv)
    }

    /// A persistent gather (see [`Communicator::gather`]); refill `send` through
    /// [`Plan::input_mut`].
    pub fn gather_plan<'a, T: Pod>(&'a self, send: &'a mut [T], recv: &'a mut [T], root: usize) -> Result<Plan<'a, T>> {
        let prep = self.gather_prepare(self.wire::<T>("gather")?, send.len(), recv.len(), root)?;
        Plan::build_prepared(self, prep, Some(send), recv)
    }

    /// A persistent scatter (see [`Communicator::scatter`]); refill `send` (on the root)
    /// through [`Plan::input_mut`].
    pub fn scatter_plan<'a, T: Pod>(&'a self, send: &'a mut [T], recv: &'a mut [T], root: usize) -> Result<Plan<'a, T>> {
        let prep = self.scatter_prepare(self.wire::<T>("scatter")?, send.len(), recv.len(), root)?;
        Plan::build_prepared(self, prep, Some(send), recv)
    }

    /// A persistent gatherv (see [`Communicator::gatherv`]), checked and built once.
    pub fn gatherv_plan<'a, T: Pod>(
        &'a self,
        send: &'a mut [T],
        recv: &'a mut [T],
        recv_counts: &[usize],
        recv_displs: &[usize],
        root: usize,
    ) -> Result<Plan<'a, T>> {
        let prep = self.gatherv_prepare(self.wire::<T>("gatherv")?, send.len(), (recv.len(), recv_counts, recv_displs), root)?;
        Plan::build_prepared(self, prep, Some(send), recv)
    }

    /// A persistent scatterv (see [`Communicator::scatterv`]), checked and built once.
    pub fn scatterv_plan<'a, T: Pod>(
        &'a self,
        send: &'a mut [T],
        send_counts: &[usize],
        send_displs: &[usize],
        recv: &'a mut [T],
        root: usize,
    ) -> Result<Plan<'a, T>> {
        let prep = self.scatterv_prepare(self.wire::<T>("scatterv")?, (send.len(), send_counts, send_displs), recv.len(), root)?;
        Plan::build_prepared(self, prep, Some(send), recv)
    }

    /// A persistent broadcast of `root`'s `buf` (see [`Communicator::broadcast`]).
    pub fn broadcast_plan<'a, T: Pod>(&'a self, buf: &'a mut [T], root: usize) -> Result<Plan<'a, T>> {
        let call = self.broadcast_call(&mut *buf, root)?.spec();
        Plan::build(self, call, None, buf)
    }
}
