//! Collectives: the public calls, their argument checks, the call descriptor compared on
//! the wire, algorithm selection, and running the schedule.
//!
//! Every collective is one code path: check the arguments (an error here leaves the
//! communicator usable), pick an algorithm (`FERROCCL_ALGO`, else the cost model), build
//! this rank's schedule, register the buffers for the call, and run the schedule with the
//! executor. Every transfer carries a 16-byte descriptor of the call, so ranks that call
//! differently (another collective, dtype, op, count, root, algorithm or protocol) fail with
//! an error that shows both calls.

use std::sync::Arc;
use std::time::Duration;

use bytemuck::Pod;
use ferroccl_kernels::{DType, Element, ReduceOp};
use ferroccl_mem::region::{with_region, with_region_ro, RegionHandle};

use crate::algo::ll::{LlKind, LlSpec};
use crate::algo::select;
use crate::algo::{self, Algo, Collective, Schedule, Shape};
use crate::checks::{Call, CallSpec, Work};
use crate::comm::{Communicator, PartBufs};
use crate::engine::{Job, Part};
use crate::error::{Error, Op, Result};
use crate::ll::{LlChannel, LlRun};
use crate::logging::{flog, Subsys};
use crate::op::{self, Operation, Options};
use crate::params::LlChoice;
use crate::prepared::Prepared;
use crate::proto::{self, encode_desc, CHAN_COLL};

use crate::algo::select::{SHM_LINK, TCP_LINK};

impl Communicator {
    /// Whether a call of `kind` runs on the low-latency channel: the communicator has one,
    /// the call fits its slots, and it is forced (`FERROCCL_PROTO=ll`, `FERROCCL_ALGO=ll`)
    /// or, unless another algorithm is forced, the cost model picks it.
    pub(crate) fn takes_ll(&self, kind: LlKind, dtype: DType, op: ReduceOp, count: usize, forced: Option<Algo>) -> bool {
        let Some(ch) = &self.ll else { return false };
        if forced.is_some_and(|a| a != Algo::Ll) {
            return false;
        }
        if matches!(kind, LlKind::Coll(c) if c.per_call()) {
            // Per-call schedules (alltoallv, gather, scatter) do not run on the slots.
            return false;
        }
        let p = &self.fabric().params;
        let Some(bytes) = count.checked_mul(dtype.size()) else { return false };
        if p.ll == LlChoice::Off || (count == 0 && kind != LlKind::Barrier) || !ch.fits(kind, bytes) {
            return false;
        }
        let LlKind::Coll(coll) = kind else { return true };
        if forced == Some(Algo::Ll) {
            return true;
        }
        match (p.ll, p.algo) {
            (LlChoice::Force, _) | (_, Some(Algo::Ll)) => true,
            (_, Some(a)) if a.supports_op(coll, dtype, op) => false,
            _ => bytes <= ch.limit(coll),
        }
    }

    /// The algorithm of a call: `forced` (the operation's own, checked by
    /// [`Communicator::check_algo`]), else `FERROCCL_ALGO` where it implements the call, else
    /// the cost model's.
    pub(crate) fn pick_algo(&self, coll: Collective, dtype: DType, op: ReduceOp, count: usize, forced: Option<Algo>) -> Algo {
        if self.takes_ll(LlKind::Coll(coll), dtype, op, count, forced) {
            return Algo::Ll;
        }
        if let Some(a) = forced {
            return a;
        }
        let p = &self.fabric().params;
        if let Some(a) = p.algo.filter(|&a| a != Algo::Ll) {
            if a.supports_op(coll, dtype, op) {
                return a;
            }
        }
        let bytes = count.saturating_mul(dtype.size());
        select::choose(coll, self.size(), bytes, dtype, op, self.link())
    }

    /// The link the cost model assumes: tcp when any member is reached over it.
    fn link(&self) -> select::LinkCost {
        if self.any_tcp() {
            TCP_LINK
        } else {
            SHM_LINK
        }
    }

    /// A call's shape, its descriptor on the wire (or in a low-latency slot) and its name in
    /// errors, with `algo`.
    pub(crate) fn identity(
        &self,
        coll: Collective,
        dtype: DType,
        op: ReduceOp,
        count: usize,
        in_place: bool,
        algo: Algo,
    ) -> (Shape, proto::Desc, Op) {
        let p = &self.fabric().params;
        let shape =
            Shape { coll, n: self.size(), rank: self.rank(), count, dtype, op, chunk_bytes: p.chunk_bytes, in_place, slots: p.slots };
        let desc = encode_desc(&shape, algo, p.proto);
        (shape, desc, Op::collective(coll, dtype, count, op, algo))
    }

    /// Picks the algorithm and builds this rank's schedule. Errors here leave the
    /// communicator usable.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn prepare(
        &self,
        name: &'static str,
        coll: Collective,
        dtype: DType,
        op: ReduceOp,
        count: usize,
        in_place: bool,
        opts: &Options,
    ) -> Result<Prepared> {
        let key = (coll, dtype, op, count, in_place, opts.algo);
        let cached = self.sched_cache.get(&key);
        let mut prep = match cached {
            Some(p) => p,
            None => {
                let algo = self.pick_algo(coll, dtype, op, count, opts.algo);
                let (shape, desc, id) = self.identity(coll, dtype, op, count, in_place, algo);
                let id = id.tagged(opts.tag.as_ref());
                let ll = (algo == Algo::Ll).then_some(LlSpec { kind: LlKind::Coll(coll), dtype, op, count, in_place });
                let sched = match ll {
                    Some(_) => Default::default(),
                    None => algo::build(algo, &shape).map_err(|e| Error::invalid(format!("rank {}: {name}: {e}", self.rank())))?,
                };
                let prep = Prepared { name: id, desc, sched: Arc::new(sched), dtype, op, ll };
                self.explain_once(&shape, algo, &prep.name, &prep.sched, opts.algo.is_some());
                self.sched_cache.insert(key, prep.clone());
                prep
            }
        };
        prep.name = prep.name.tagged(opts.tag.as_ref());
        self.check_usable(&prep.name)?;
        Ok(prep)
    }

    /// [`Communicator::prepare`] for `call`, named in errors by the caller's element type.
    pub(crate) fn prepare_call(&self, call: CallSpec, in_place: bool, opts: &Options) -> Result<Prepared> {
        let CallSpec { name, coll, dtype, op, count, pod } = call;
        let mut prep = self.prepare(name, coll, dtype, op, count, in_place, opts)?;
        prep.name = prep.name.with_pod(pod);
        Ok(prep)
    }

    /// The part running `prep` over registered buffers (`input: None`: in place).
    pub(crate) fn coll_part(&self, prep: Prepared, input: Option<RegionHandle>, output: RegionHandle, scratch: RegionHandle) -> Part {
        let ll = prep.ll.zip(self.ll.clone()).map(|(spec, ch)| LlRun::new(ch, spec));
        let bufs = PartBufs { dtype: prep.dtype, op: prep.op, input, output, scratch };
        let mut part = self.part(prep.name, CHAN_COLL, prep.desc, prep.sched, bufs);
        part.ll = ll;
        part
    }

    /// Runs low-latency call `s` (collective call number `call`) on this thread; an error
    /// is fatal for the communicator (peers may wait for this rank), as in the engine.
    /// Inlined, the failure out of line: the fastest calls pay for nothing else (kept out
    /// of line, this step alone cost about 4 % of a 2-rank 8 B allreduce).
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub(crate) fn run_ll(
        &self,
        ch: &LlChannel,
        (call, s): (u32, u64),
        desc: &proto::Desc,
        spec: &LlSpec,
        name: &Op,
        input: Option<&[u8]>,
        output: Option<&mut [u8]>,
        timeout: Option<Duration>,
    ) -> Result<()> {
        let fabric = self.fabric();
        let limit = timeout.unwrap_or(fabric.params.timeout);
        let r = ch.run(fabric, s, call, desc, spec, input, output, limit, &|now| self.engine().tend(now), &|| name.numbered(call));
        match r {
            Ok(()) => {
                self.flight.finished(call);
                Ok(())
            }
            Err(e) => Err(self.ll_failed(e)),
        }
    }

    /// A low-latency call's error, made fatal for the communicator.
    #[cold]
    #[inline(never)]
    fn ll_failed(&self, e: Error) -> Error {
        self.fabric().poison_in(e, &|r| self.world_rank(r).unwrap_or(r), Some(self.view()))
    }

    /// Runs a collective of fixed shape and waits for it.
    pub(crate) fn collective(&self, call: Call<'_>, opts: &Options) -> Result<()> {
        let out_len = call.output_len();
        let spec = call.spec();
        let Call { coll, dtype, op, count, pod, input, output, .. } = call;
        let input = input.into_bytes();
        // One load and a compare when nothing is logged (the messages live out of line).
        let logging = log::max_level() >= log::LevelFilter::Info;
        if logging {
            self.log_call(spec, opts);
        }
        // The low-latency path needs no schedule: nothing to look up.
        if let Some(ch) = self.ll.as_ref().filter(|_| self.takes_ll(LlKind::Coll(coll), dtype, op, count, opts.algo)) {
            let in_place = input.is_none();
            let (shape, desc, id) = self.identity(coll, dtype, op, count, in_place, Algo::Ll);
            let id = id.with_pod(pod).tagged(opts.tag.as_ref());
            self.check_usable(&id)?;
            if logging {
                self.explain_once(&shape, Algo::Ll, &id, &Schedule::default(), opts.algo.is_some());
            }
            if let Some(numbers) = self.begin_ll(ch, &desc) {
                let spec = LlSpec { kind: LlKind::Coll(coll), dtype, op, count, in_place };
                return self.run_ll(ch, numbers, &desc, &spec, &id, input, output, opts.timeout);
            }
        }
        let prep = self.prepare_call(spec, input.is_none(), opts)?;
        let mut sink = Vec::new();
        let output = match output {
            Some(o) => o,
            None => {
                sink.resize(out_len, 0u8);
                &mut sink[..]
            }
        };
        let scratch = self.scratch().get(prep.sched.scratch_bytes);
        let r = with_region(output, |out| match input {
            Some(i) => with_region_ro(i, |inp| self.run_coll(prep, Some(inp.clone()), out.clone(), scratch.clone(), opts.timeout)),
            None => self.run_coll(prep, None, out.clone(), scratch.clone(), opts.timeout),
        });
        self.scratch().put(scratch);
        r
    }

    /// How a call runs, for the `coll` log at its first occurrence: the algorithm and why,
    /// the protocol, the chunks, and what the cost model estimated for each candidate.
    fn explain(&self, shape: &Shape, algo: Algo, name: &Op, sched: &Schedule, forced: bool) -> String {
        let p = &self.fabric().params;
        let bytes = shape.count.saturating_mul(shape.dtype.size());
        let place = if shape.in_place { "in place" } else { "out of place" };
        let mut s = format!("rank {}: {} on {} ranks, {bytes} B per rank, {place}: ", self.rank(), name, shape.n);
        if algo == Algo::Ll {
            s += "low-latency protocol (one round through the shared slots)";
        } else {
            let why = if forced {
                "the call's option"
            } else if p.algo == Some(algo) {
                "FERROCCL_ALGO"
            } else {
                "the cost model"
            };
            let chunk = p.chunk_bytes.min(bytes.max(1));
            let proto = match p.proto {
                crate::params::ProtoChoice::Eager => "eager (FERROCCL_PROTO)".to_string(),
                crate::params::ProtoChoice::Rendezvous => "rendezvous (FERROCCL_PROTO)".to_string(),
                _ if chunk <= p.eager_max => format!("eager (pieces up to {} B)", p.eager_max),
                _ => format!("rendezvous (pieces over {} B)", p.eager_max),
            };
            s += &format!(
                "{algo} by {why}; {proto}; chunks of up to {chunk} B, {} in flight per peer; schedule of {} steps, {} B of scratch",
                p.slots,
                sched.steps.len(),
                sched.scratch_bytes
            );
        }
        let est = select::estimates(shape.coll, shape.n, bytes, shape.dtype, shape.op, self.link());
        let est: Vec<String> = est.iter().map(|(a, t)| format!("{a} {t:.1}")).collect();
        s += &format!("; estimates over {} (us): {}", if self.any_tcp() { "tcp" } else { "shm" }, est.join(", "));
        if self.ll.is_some() {
            s += &format!(", ll {:.1}", select::ll_estimate(shape.coll, shape.n, bytes));
        }
        s
    }

    /// The `coll` log's line for every call (`TRACE`).
    #[cold]
    #[inline(never)]
    fn log_call(&self, call: CallSpec, opts: &Options) {
        let tag = opts.tag.as_ref().map(|t| format!(" [{t}]")).unwrap_or_default();
        flog!(Trace, Coll, "rank {}: {}{tag} of {} x {} ({})", self.rank(), call.name, call.count, call.dtype, call.op);
    }

    /// The `coll` log of a call shape's first occurrence, when it is enabled (a schedule's
    /// when it is built, a low-latency call's on the path that looks nothing up).
    #[cold]
    #[inline(never)]
    fn explain_once(&self, shape: &Shape, algo: Algo, name: &Op, sched: &Schedule, forced: bool) {
        if !crate::logging::enabled(Subsys::Coll, log::Level::Info) {
            return;
        }
        let tag = match name {
            Op::Collective { tag, .. } => tag.clone(),
            _ => None,
        };
        let key = ((shape.coll, shape.dtype, shape.op, shape.count, shape.in_place), tag);
        if self.explained.lock().unwrap_or_else(|e| e.into_inner()).insert(key) {
            flog!(Info, Coll, "{}", self.explain(shape, algo, name, sched, forced));
        }
    }

    fn run_coll(
        &self,
        prep: Prepared,
        input: Option<RegionHandle>,
        output: RegionHandle,
        scratch: RegionHandle,
        timeout: Option<Duration>,
    ) -> Result<()> {
        let job = Job::new(self.job_body_within(vec![self.coll_part(prep, input, output, scratch)], timeout));
        self.submit(&job, true, false)?;
        self.wait_job(&job)
    }

    /// The algorithm this communicator uses for a call of `collective` with `dtype`, `op` and
    /// `count` (what `count` means for that call: per rank for allgather, reduce_scatter and
    /// alltoall; for alltoallv, this rank's total of elements sent):
    /// [`Params::algo`](crate::Params::algo) where it implements the call, else the cost
    /// model's choice. Every rank answers the same for the same arguments (alltoallv's ranks
    /// pass different totals, and may run different algorithms: mesh and pairwise
    /// interoperate).
    ///
    /// ```no_run
    /// # let comm = ferroccl::Communicator::init()?;
    /// use ferroccl::{Algo, Collective, DType, ReduceOp};
    /// let algo = comm.algorithm_for(Collective::AllReduce, DType::F32, ReduceOp::Sum, 1 << 20);
    /// println!("1 Mi f32 allreduce runs {algo}"); // "ring", on most setups
    /// # let _: Algo = algo;
    /// # Ok::<(), ferroccl::Error>(())
    /// ```
    pub fn algorithm_for(&self, collective: Collective, dtype: DType, op: ReduceOp, count: usize) -> Algo {
        self.pick_algo(collective, dtype, op, count, None)
    }

    /// Runs `op` and waits for it: the blocking runner (see [`crate::op`]). The methods
    /// below (`allreduce`, `send`, ...) are this with the operation of their name.
    #[inline(always)]
    pub fn run<T: Pod>(&self, op: Operation<'_, T>) -> Result<()> {
        let Operation { body, opts, .. } = op;
        let body = match crate::checks::in_place_allreduce(body, &opts) {
            Ok(call) => return self.collective(call, &opts),
            Err(body) => body,
        };
        match self.check(body, &opts)? {
            Work::Coll(call) => self.collective(call, &opts),
            Work::V { prep, input, output } => self.run_v(prep, input.bytes().unwrap_or_default(), output, opts.timeout),
            Work::Send { name, peer, data } => self.run_send(name, peer, data.bytes().unwrap_or_default(), opts.timeout),
            Work::Recv { name, peer, buf } => self.run_recv(name, peer, buf, opts.timeout),
            Work::SendRecv { name, to, from, data, buf } => {
                self.run_sendrecv(name, (to, data.bytes().unwrap_or_default()), (from, buf), opts.timeout)
            }
            Work::Barrier => self.run_barrier(opts.timeout),
        }
    }

    /// Runs a prepared out-of-place call over `send` and `recv`.
    fn run_v(&self, prep: Prepared, send: &[u8], recv: &mut [u8], timeout: Option<Duration>) -> Result<()> {
        let scratch = self.scratch().get(prep.sched.scratch_bytes);
        let r = with_region(recv, |out| {
            with_region_ro(send, |inp| self.run_coll(prep, Some(inp.clone()), out.clone(), scratch.clone(), timeout))
        });
        self.scratch().put(scratch);
        r
    }

    /// Reduces `buf` across all ranks, in place: every rank ends with the same result
    /// ([`op::allreduce`]).
    ///
    /// ```no_run
    /// # let comm = ferroccl::Communicator::init()?;
    /// let mut grads = vec![1.0f32; 1024];
    /// comm.allreduce(&mut grads, ferroccl::ReduceOp::Sum)?;
    /// # Ok::<(), ferroccl::Error>(())
    /// ```
    #[inline]
    pub fn allreduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.run(op::allreduce(buf, op))
    }

    /// Reduces `send` across all ranks into `recv` (same length) ([`op::allreduce_into`]).
    pub fn allreduce_into<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        self.run(op::allreduce_into(send, recv, op))
    }

    /// Allgather in place ([`op::allgather`]): `buf` has `size()` equal blocks and this
    /// rank's contribution is already in block `rank()`. `T` may be any plain-old-data type
    /// (see the [crate documentation](crate#plain-old-data)).
    pub fn allgather<T: Pod>(&self, buf: &mut [T]) -> Result<()> {
        self.run(op::allgather(buf))
    }

    /// Gathers every rank's `send` into `recv` (`send.len() * size()` elements, rank r's
    /// block at `r * send.len()`) ([`op::allgather_into`]).
    pub fn allgather_into<T: Pod>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.run(op::allgather_into(send, recv))
    }

    /// Allgather with per-rank counts and displacements (MPI's `Allgatherv`); see
    /// [`op::allgatherv`].
    ///
    /// ```no_run
    /// # let comm = ferroccl::Communicator::init()?;
    /// // Rank r contributes r + 1 elements; every rank ends with all of them, in rank order.
    /// let (n, r) = (comm.size(), comm.rank());
    /// let send = vec![r as u32; r + 1];
    /// let counts: Vec<usize> = (0..n).map(|p| p + 1).collect();
    /// let displs: Vec<usize> = (0..n).map(|p| p * (p + 1) / 2).collect();
    /// let mut recv = vec![0u32; n * (n + 1) / 2];
    /// comm.allgatherv(&send, &mut recv, &counts, &displs)?;
    /// # Ok::<(), ferroccl::Error>(())
    /// ```
    pub fn allgatherv<T: Pod>(&self, send: &[T], recv: &mut [T], recv_counts: &[usize], recv_displs: &[usize]) -> Result<()> {
        self.run(op::allgatherv(send, recv, recv_counts, recv_displs))
    }

    /// Reduce-scatter in place ([`op::reduce_scatter`]): `buf` has `size()` equal blocks;
    /// block `rank()` receives this rank's part of the result (the other blocks are left as
    /// they were).
    pub fn reduce_scatter<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.run(op::reduce_scatter(buf, op))
    }

    /// Reduces `send` (`recv.len() * size()` elements) across ranks; rank r receives block r
    /// of the result in `recv` ([`op::reduce_scatter_into`]).
    pub fn reduce_scatter_into<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        self.run(op::reduce_scatter_into(send, recv, op))
    }

    /// Reduce-scatter with per-rank counts (MPI's `Reduce_scatter`); see
    /// [`op::reduce_scatterv`].
    ///
    /// ```no_run
    /// # let comm = ferroccl::Communicator::init()?;
    /// // Rank p receives p + 1 elements of the sum.
    /// let (n, r) = (comm.size(), comm.rank());
    /// let counts: Vec<usize> = (0..n).map(|p| p + 1).collect();
    /// let send = vec![1.0f32; n * (n + 1) / 2];
    /// let mut recv = vec![0f32; r + 1];
    /// comm.reduce_scatterv(&send, &mut recv, &counts, ferroccl::ReduceOp::Sum)?;
    /// assert!(recv.iter().all(|&x| x == n as f32));
    /// # Ok::<(), ferroccl::Error>(())
    /// ```
    pub fn reduce_scatterv<T: Element>(&self, send: &[T], recv: &mut [T], recv_counts: &[usize], op: ReduceOp) -> Result<()> {
        self.run(op::reduce_scatterv(send, recv, recv_counts, op))
    }

    /// Copies `root`'s `buf` into every rank's `buf` (all of the same length)
    /// ([`op::broadcast`]). `T` may be any plain-old-data type.
    pub fn broadcast<T: Pod>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.run(op::broadcast(buf, root))
    }

    /// Reduce in place ([`op::reduce`]): `root`'s `buf` receives the reduction of every
    /// rank's `buf`.
    pub fn reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp, root: usize) -> Result<()> {
        self.run(op::reduce(buf, op, root))
    }

    /// Reduces `send` across ranks into `root`'s `recv` (same length as `send` on the root;
    /// ignored, and may be empty, elsewhere) ([`op::reduce_into`]).
    pub fn reduce_into<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp, root: usize) -> Result<()> {
        self.run(op::reduce_into(send, recv, op, root))
    }

    /// All-to-all with equal counts ([`op::alltoall`]): `send` and `recv` have `size()`
    /// equal blocks; block j of `send` goes to rank j, block i of `recv` comes from rank i.
    /// `T` may be any plain-old-data type.
    pub fn alltoall<T: Pod>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.run(op::alltoall(send, recv))
    }

    /// All-to-all with per-peer counts and displacements (MPI's `Alltoallv`), all in
    /// elements, one per member: `send_counts[p]` elements of `send` from
    /// `send_displs[p]` go to rank `p`, which receives them into its `recv` at
    /// `recv_displs[rank()]`; `recv_counts[p]` is what rank `p` sends this rank. Counts may
    /// be 0 and blocks need not be contiguous (gaps are left as they were); receive ranges
    /// must not overlap. This rank's own block is copied locally. `T` may be any
    /// plain-old-data type (counts and displacements are then in elements of `T`).
    ///
    /// # Errors
    ///
    /// Found before anything moves (the communicator stays usable): count or displacement
    /// lists that do not have `size()` entries, a block past the end of its buffer (the
    /// error names the peer), overlapping receive blocks (naming both peers),
    /// `send_counts[rank()] != recv_counts[rank()]`.
    ///
    /// Found on the wire: a rank's `recv_counts[p]` that differs from what `p` sends it is
    /// an [`Error::Mismatch`] naming both ranks and both counts. Every pair of ranks
    /// exchanges one message each way (empty ones included), whose length the receiver
    /// compares with its count, so a disagreement never hangs and never writes past a
    /// block. The receiver's call fails (and the sender's, if its data went by
    /// rendezvous); the error is fatal for the communicator, and every member learns of
    /// it at once: in this call if still in it, else in its next call (a sender whose
    /// eager message has already left).
    ///
    /// ```no_run
    /// # let comm = ferroccl::Communicator::init()?;
    /// // Rank r sends r + 1 elements to every rank: rank r receives p + 1 from each rank p.
    /// let (n, r) = (comm.size(), comm.rank());
    /// let send = vec![r as f32; n * (r + 1)];
    /// let send_counts = vec![r + 1; n];
    /// let send_displs: Vec<usize> = (0..n).map(|p| p * (r + 1)).collect();
    /// let recv_counts: Vec<usize> = (0..n).map(|p| p + 1).collect();
    /// let recv_displs: Vec<usize> = (0..n).map(|p| p * (p + 1) / 2).collect();
    /// let mut recv = vec![0f32; n * (n + 1) / 2];
    /// comm.alltoallv(&send, &send_counts, &send_displs, &mut recv, &recv_counts, &recv_displs)?;
    /// # Ok::<(), ferroccl::Error>(())
    /// ```
    pub fn alltoallv<T: Pod>(
        &self,
        send: &[T],
        send_counts: &[usize],
        send_displs: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
        recv_displs: &[usize],
    ) -> Result<()> {
        self.run(op::alltoallv(send, send_counts, send_displs, recv, recv_counts, recv_displs))
    }

    /// Gathers every rank's `send` (the same length on every rank) into `root`'s `recv`
    /// (`size() * send.len()` elements, rank r's block at `r * send.len()`); off the root
    /// `recv` is ignored (it may be empty). Every rank must pass the same length (checked on
    /// the wire, like every collective's arguments). `T` may be any plain-old-data type.
    pub fn gather<T: Pod>(&self, send: &[T], recv: &mut [T], root: usize) -> Result<()> {
        self.run(op::gather(send, recv, root))
    }

    /// Scatters `root`'s `send` (`size() * recv.len()` elements): rank r receives block r
    /// in `recv` (the same length on every rank); off the root `send` is ignored (it may be
    /// empty). `T` may be any plain-old-data type.
    pub fn scatter<T: Pod>(&self, send: &[T], recv: &mut [T], root: usize) -> Result<()> {
        self.run(op::scatter(send, recv, root))
    }

    /// Gather with per-rank counts (MPI's `Gatherv`): every rank sends its whole `send`;
    /// on the root, rank p's block lands in `recv` at `recv_displs[p]` and must have
    /// `recv_counts[p]` elements (counts may be 0, blocks may leave gaps, must not
    /// overlap). Off the root `recv`, `recv_counts` and `recv_displs` are ignored. `T` may
    /// be any plain-old-data type (counts and displacements in elements of `T`).
    ///
    /// # Errors
    ///
    /// As for [`Communicator::alltoallv`]: bad counts or displacements on the root before
    /// anything moves (naming the peer); a rank whose `send.len()` differs from the root's
    /// count for it is an [`Error::Mismatch`] naming both, found by the root from the
    /// message (one per rank, empty ones included), fatal for the communicator and relayed
    /// to every member (a rank whose message has left learns of it at its next call).
    pub fn gatherv<T: Pod>(&self, send: &[T], recv: &mut [T], recv_counts: &[usize], recv_displs: &[usize], root: usize) -> Result<()> {
        self.run(op::gatherv(send, recv, recv_counts, recv_displs, root))
    }

    /// Scatter with per-rank counts (MPI's `Scatterv`): on the root, `send_counts[p]`
    /// elements of `send` from `send_displs[p]` go to rank p (counts may be 0; send blocks
    /// may overlap); every rank receives into its whole `recv`, whose length must equal the
    /// root's count for it. Off the root `send`, `send_counts` and `send_displs` are
    /// ignored. Errors as for [`Communicator::gatherv`] (the receiver finds a mismatch).
    /// `T` may be any plain-old-data type (counts and displacements in elements of `T`).
    pub fn scatterv<T: Pod>(&self, send: &[T], send_counts: &[usize], send_displs: &[usize], recv: &mut [T], root: usize) -> Result<()> {
        self.run(op::scatterv(send, send_counts, send_displs, recv, root))
    }
}
