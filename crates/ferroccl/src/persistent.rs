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
//! let mut plan = comm.plan(ferroccl::op::allreduce(&mut grads, ReduceOp::Sum))?;
//! for step in 0..10 {
//!     plan.output_mut().fill(step as f32); // this step's gradients
//!     plan.run()?;
//!     assert_eq!(plan.output()[0], step as f32 * comm.size() as f32);
//! }
//! # Ok::<(), ferroccl::Error>(())
//! ```
//!
//! A plan is made of any collective operation ([`Communicator::plan`] of an
//! [`op`](crate::op) value); the data-movement calls' plans take any plain-old-data type, as
//! the calls do (see the [crate documentation](crate#plain-old-data)); the reductions'
//! plans take the [`Element`](crate::Element) types.
//!
//! Every rank must run its plans in the same order as its other operations on the
//! communicator (a plan's run is an operation like any other).
//!
//! The clear-to-send of each rendezvous transfer still goes over the wire on every run: it
//! is the receiver's flow control (its buffer is free again), and carries the descriptor
//! registered when the plan was built.

use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use bytemuck::Pod;
use ferroccl_mem::region::{RegionHandle, RegionScope, Registration};

use crate::algo::ll::LlSpec;
use crate::algo::Collective;
use crate::checks::{Call, Work};
use crate::comm::Communicator;
use crate::engine::Job;
use crate::error::{Error, Op, Result};
use crate::logging::flog;
use crate::op::{Input, Operation};
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
    /// The operation's own timeout.
    timeout: Option<Duration>,
    _t: PhantomData<T>,
}

impl<T: Pod> std::fmt::Debug for Plan<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = self.job.body().parts.first().map(|p| p.name.to_string()).unwrap_or_default();
        f.debug_struct("Plan").field("op", &name).field("runs", &self.runs).finish()
    }
}

impl<'a, T: Pod> Plan<'a, T> {
    /// A plan of the prepared call `prep` (checked against `input` / `output`).
    fn build(
        comm: &'a Communicator,
        prep: Prepared,
        input: Input<'a>,
        output: &'a mut [u8],
        timeout: Option<Duration>,
    ) -> Result<Plan<'a, T>> {
        let scratch = RegionHandle::owned(prep.sched.scratch_bytes);
        let out = Registration::new(output);
        // Lent mutably, writable, so that the owner can refill it between runs; the
        // schedules never write into an input.
        let inp = match input {
            Input::None => None,
            Input::Shared(i) => Some(Registration::new_ro(i)),
            Input::Unique(i) => Some(Registration::new(i)),
        };
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
        let job = Job::new(comm.job_body_within(vec![part], timeout));
        Ok(Plan { comm, job, output: out, input: inp, scratch, runs: 0, ll, timeout, _t: PhantomData })
    }

    /// Runs the collective once and waits for it. Moves data only: no allocation, no
    /// registration. An error is fatal for the communicator, as for any call.
    pub fn run(&mut self) -> Result<()> {
        if let (Some((spec, desc, name)), Some(ch)) = (&self.ll, &self.comm.ll) {
            // A low-latency plan runs on this thread unless an earlier low-latency call is
            // still in the engine.
            if let Some(numbers) = self.comm.begin_ll(ch, desc) {
                self.runs += 1;
                let Plan { comm, output, input, timeout, .. } = self;
                let out = output.bytes_mut().map_err(|e| Error::internal(format!("{name}: the plan's output: {e}")))?;
                return comm.run_ll(ch, numbers, desc, spec, name, input.as_ref().map(Registration::bytes), Some(out), *timeout);
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

    /// The separate input buffer of an out-of-place plan, to write the next run's input
    /// into: `None` for in-place plans, and for inputs lent shared (`&[T]`) rather than
    /// mutably (see [`Src`](crate::op::Src)).
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
    /// Builds `op` once as a persistent plan, run many times with [`Plan::run`] (or started
    /// in a scope): the persistent runner (see [`crate::op`]). Collectives only; the plan
    /// holds the operation's buffers for its life.
    ///
    /// # Errors
    ///
    /// The operation's argument errors, as when it is run; a plan of an out-of-place reduce
    /// (plan the in-place one), a point-to-point operation or a barrier is refused on every
    /// rank (for repeated one-sided transfers, see
    /// [`TransferPlan`](crate::TransferPlan)).
    pub fn plan<'a, T: Pod>(&'a self, op: Operation<'a, T>) -> Result<Plan<'a, T>> {
        let Operation { body, opts, .. } = op;
        let name = body.kind.name();
        match self.check(body, &opts)? {
            Work::Coll(call) => {
                let (spec, in_place) = (call.spec(), matches!(call.input, Input::None));
                // Refused on every rank alike (off the root the call has no output of its
                // own to hold), so that no root runs a plan its peers never built.
                if matches!(spec.coll, Collective::Reduce { .. }) && !in_place {
                    return Err(Error::invalid(format!(
                        "rank {}: plan of reduce_into: not available (off the root there is no output to hold); plan the \
                         in-place reduce (op::reduce)",
                        self.rank()
                    )));
                }
                let Call { input, output, .. } = call;
                let Some(output) = output else {
                    return Err(Error::internal(format!("rank {}: plan of {name}: a collective without its output", self.rank())));
                };
                let prep = self.prepare_call(spec, in_place, &opts)?;
                Plan::build(self, prep, input, output, opts.timeout)
            }
            Work::V { prep, input, output } => Plan::build(self, prep, input, output, opts.timeout),
            Work::Send { .. } | Work::Recv { .. } | Work::SendRecv { .. } | Work::Barrier => Err(Error::invalid(format!(
                "rank {}: plan of {name}: plans are built for collectives; run it with Communicator::run, or plan repeated \
                 one-sided transfers with a TransferPlan",
                self.rank()
            ))),
        }
    }
}
