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

use bytemuck::Pod;
use ferroccl_kernels::{as_bytes, as_bytes_mut, DType, Element, ReduceOp};
use ferroccl_mem::region::{with_region, with_region_ro, RegionHandle};

use crate::algo::ll::{LlKind, LlSpec};
use crate::algo::select;
use crate::algo::{self, Algo, Collective, Schedule, Shape};
use crate::comm::{Communicator, PartBufs};
use crate::engine::{Job, Part};
use crate::error::{Error, Op, PodType, Result};
use crate::ll::{LlChannel, LlRun};
use crate::logging::{flog, Subsys};
use crate::params::LlChoice;
use crate::pod::Wire;
use crate::prepared::Prepared;
use crate::proto::{self, encode_desc, CHAN_COLL};

use crate::algo::select::{SHM_LINK, TCP_LINK};

/// The element-type-free description of one call.
#[derive(Debug)]
pub(crate) struct Call<'a> {
    pub(crate) name: &'static str,
    pub(crate) coll: Collective,
    pub(crate) dtype: DType,
    pub(crate) op: ReduceOp,
    pub(crate) count: usize,
    /// The caller's element type where it is not one of the dtypes (then `dtype` is `U8` and
    /// `count` counts bytes).
    pub(crate) pod: Option<PodType>,
    /// `None`: in place (one buffer, `output`).
    pub(crate) input: Option<&'a [u8]>,
    /// `None`: the call's output is not wanted (reduce off the root); it runs into memory of
    /// its own of the input's size.
    pub(crate) output: Option<&'a mut [u8]>,
}

/// A call without its buffers.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CallSpec {
    pub(crate) name: &'static str,
    pub(crate) coll: Collective,
    pub(crate) dtype: DType,
    pub(crate) op: ReduceOp,
    pub(crate) count: usize,
    pub(crate) pod: Option<PodType>,
}

impl Call<'_> {
    pub(crate) fn spec(&self) -> CallSpec {
        CallSpec { name: self.name, coll: self.coll, dtype: self.dtype, op: self.op, count: self.count, pod: self.pod }
    }

    /// Bytes of the output buffer the schedule addresses.
    pub(crate) fn output_len(&self) -> usize {
        match &self.output {
            Some(o) => o.len(),
            None => self.input.map_or(0, <[u8]>::len),
        }
    }
}

impl Communicator {
    /// Whether a call of `kind` runs on the low-latency channel: the communicator has one,
    /// the call fits its slots, and it is forced (`FERROCCL_PROTO=ll`, `FERROCCL_ALGO=ll`)
    /// or, unless another algorithm is forced, the cost model picks it.
    pub(crate) fn takes_ll(&self, kind: LlKind, dtype: DType, op: ReduceOp, count: usize) -> bool {
        let Some(ch) = &self.ll else { return false };
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
        match (p.ll, p.algo) {
            (LlChoice::Force, _) | (_, Some(Algo::Ll)) => true,
            (_, Some(a)) if a.supports_op(coll, dtype, op) => false,
            _ => bytes <= ch.limit(coll),
        }
    }

    fn pick_algo(&self, coll: Collective, dtype: DType, op: ReduceOp, count: usize) -> Algo {
        if self.takes_ll(LlKind::Coll(coll), dtype, op, count) {
            return Algo::Ll;
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
    fn identity(&self, coll: Collective, dtype: DType, op: ReduceOp, count: usize, in_place: bool, algo: Algo) -> (Shape, proto::Desc, Op) {
        let p = &self.fabric().params;
        let shape =
            Shape { coll, n: self.size(), rank: self.rank(), count, dtype, op, chunk_bytes: p.chunk_bytes, in_place, slots: p.slots };
        let desc = encode_desc(&shape, algo, p.proto);
        (shape, desc, Op::collective(coll, dtype, count, op, algo))
    }

    /// Picks the algorithm and builds this rank's schedule. Errors here leave the
    /// communicator usable.
    pub(crate) fn prepare(
        &self,
        name: &'static str,
        coll: Collective,
        dtype: DType,
        op: ReduceOp,
        count: usize,
        in_place: bool,
    ) -> Result<Prepared> {
        let key = (coll, dtype, op, count, in_place);
        let cached = self.sched_cache.get(&key);
        let prep = match cached {
            Some(p) => p,
            None => {
                let algo = self.pick_algo(coll, dtype, op, count);
                let (shape, desc, id) = self.identity(coll, dtype, op, count, in_place, algo);
                let ll = (algo == Algo::Ll).then_some(LlSpec { kind: LlKind::Coll(coll), dtype, op, count, in_place });
                let sched = match ll {
                    Some(_) => Default::default(),
                    None => algo::build(algo, &shape).map_err(|e| Error::invalid(format!("rank {}: {name}: {e}", self.rank())))?,
                };
                let prep = Prepared { name: id, desc, sched: Arc::new(sched), dtype, op, ll };
                self.explain_once(&shape, algo, &prep.name, &prep.sched);
                self.sched_cache.insert(key, prep.clone());
                prep
            }
        };
        self.check_usable(&prep.name)?;
        Ok(prep)
    }

    /// [`Communicator::prepare`] for `call`, named in errors by the caller's element type.
    pub(crate) fn prepare_call(&self, call: CallSpec, in_place: bool) -> Result<Prepared> {
        let CallSpec { name, coll, dtype, op, count, pod } = call;
        let mut prep = self.prepare(name, coll, dtype, op, count, in_place)?;
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
    ) -> Result<()> {
        let fabric = self.fabric();
        let r = ch.run(fabric, s, call, desc, spec, input, output, fabric.params.timeout, &|now| self.engine().tend(now), &|| {
            name.numbered(call)
        });
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

    fn collective(&self, call: Call<'_>) -> Result<()> {
        let out_len = call.output_len();
        let spec = call.spec();
        let Call { coll, dtype, op, count, pod, input, output, .. } = call;
        // One load and a compare when nothing is logged (the messages live out of line).
        let logging = log::max_level() >= log::LevelFilter::Info;
        if logging {
            self.log_call(spec);
        }
        // The low-latency path needs no schedule: nothing to look up.
        if let Some(ch) = self.ll.as_ref().filter(|_| self.takes_ll(LlKind::Coll(coll), dtype, op, count)) {
            let in_place = input.is_none();
            let (shape, desc, id) = self.identity(coll, dtype, op, count, in_place, Algo::Ll);
            let id = id.with_pod(pod);
            self.check_usable(&id)?;
            if logging {
                self.explain_once(&shape, Algo::Ll, &id, &Schedule::default());
            }
            if let Some(numbers) = self.begin_ll(ch, &desc) {
                let spec = LlSpec { kind: LlKind::Coll(coll), dtype, op, count, in_place };
                return self.run_ll(ch, numbers, &desc, &spec, &id, input, output);
            }
        }
        let prep = self.prepare_call(spec, input.is_none())?;
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
            Some(i) => with_region_ro(i, |inp| self.run_coll(prep, Some(inp.clone()), out.clone(), scratch.clone())),
            None => self.run_coll(prep, None, out.clone(), scratch.clone()),
        });
        self.scratch().put(scratch);
        r
    }

    /// How a call runs, for the `coll` log at its first occurrence: the algorithm and why,
    /// the protocol, the chunks, and what the cost model estimated for each candidate.
    fn explain(&self, shape: &Shape, algo: Algo, name: &Op, sched: &Schedule) -> String {
        let p = &self.fabric().params;
        let bytes = shape.count.saturating_mul(shape.dtype.size());
        let place = if shape.in_place { "in place" } else { "out of place" };
        let mut s = format!("rank {}: {} on {} ranks, {bytes} B per rank, {place}: ", self.rank(), name, shape.n);
        if algo == Algo::Ll {
            s += "low-latency protocol (one round through the shared slots)";
        } else {
            let why = if p.algo == Some(algo) { "FERROCCL_ALGO" } else { "the cost model" };
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
    fn log_call(&self, call: CallSpec) {
        flog!(Trace, Coll, "rank {}: {} of {} x {} ({})", self.rank(), call.name, call.count, call.dtype, call.op);
    }

    /// The `coll` log of a call shape's first occurrence, when it is enabled (a schedule's
    /// when it is built, a low-latency call's on the path that looks nothing up).
    #[cold]
    #[inline(never)]
    fn explain_once(&self, shape: &Shape, algo: Algo, name: &Op, sched: &Schedule) {
        if !crate::logging::enabled(Subsys::Coll, log::Level::Info) {
            return;
        }
        let key = (shape.coll, shape.dtype, shape.op, shape.count, shape.in_place);
        if self.explained.lock().unwrap_or_else(|e| e.into_inner()).insert(key) {
            flog!(Info, Coll, "{}", self.explain(shape, algo, name, sched));
        }
    }

    fn run_coll(&self, prep: Prepared, input: Option<RegionHandle>, output: RegionHandle, scratch: RegionHandle) -> Result<()> {
        let job = Job::new(self.job_body(vec![self.coll_part(prep, input, output, scratch)]));
        self.submit(&job, true, false)?;
        self.wait_job(&job)
    }

    pub(crate) fn check_root(&self, name: &str, root: usize) -> Result<()> {
        if root >= self.size() {
            return Err(Error::invalid(format!(
                "rank {}: {name}: root {root} is out of range (communicator of {} ranks)",
                self.rank(),
                self.size()
            )));
        }
        Ok(())
    }

    pub(crate) fn check_len(&self, name: &str, what: &str, got: usize, want: usize) -> Result<()> {
        if got != want {
            return Err(Error::invalid(format!("rank {}: {name}: {what} has {got} elements, expected {want}", self.rank())));
        }
        Ok(())
    }

    pub(crate) fn blocks(&self, name: &str, len: usize) -> Result<usize> {
        let n = self.size();
        if !len.is_multiple_of(n) {
            return Err(Error::invalid(format!(
                "rank {}: {name}: the buffer's {len} elements do not split into {n} equal blocks",
                self.rank()
            )));
        }
        Ok(len / n)
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
        self.pick_algo(collective, dtype, op, count)
    }

    /// Reduces `buf` across all ranks, in place: every rank ends with the same result.
    ///
    /// ```no_run
    /// # let comm = ferroccl::Communicator::init()?;
    /// let mut grads = vec![1.0f32; 1024];
    /// comm.allreduce(&mut grads, ferroccl::ReduceOp::Sum)?;
    /// # Ok::<(), ferroccl::Error>(())
    /// ```
    pub fn allreduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.collective(self.allreduce_call(buf, op))
    }

    /// Reduces `send` across all ranks into `recv` (same length).
    pub fn allreduce_into<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        self.collective(self.allreduce_into_call(send, recv, op)?)
    }

    /// Gathers every rank's `send` into `recv` (`send.len() * size()` elements, rank r's
    /// block at `r * send.len()`). `T` may be any plain-old-data type (see the
    /// [crate documentation](crate#plain-old-data)).
    pub fn allgather<T: Pod>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.collective(self.allgather_call(send, recv)?)
    }

    /// Allgather in place: `buf` has `size()` equal blocks and this rank's contribution is
    /// already in block `rank()`. `T` may be any plain-old-data type.
    pub fn allgather_in_place<T: Pod>(&self, buf: &mut [T]) -> Result<()> {
        self.collective(self.allgather_in_place_call(buf)?)
    }

    /// Reduces `send` (`recv.len() * size()` elements) across ranks; rank r receives block r
    /// of the result in `recv`.
    pub fn reduce_scatter<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        self.collective(self.reduce_scatter_call(send, recv, op)?)
    }

    /// Reduce-scatter in place: `buf` has `size()` equal blocks; block `rank()` receives this
    /// rank's part of the result (the other blocks are left as they were).
    pub fn reduce_scatter_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.collective(self.reduce_scatter_in_place_call(buf, op)?)
    }

    /// Copies `root`'s `buf` into every rank's `buf` (all of the same length). `T` may be
    /// any plain-old-data type.
    pub fn broadcast<T: Pod>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.collective(self.broadcast_call(buf, root)?)
    }

    /// Reduces `send` across ranks into `root`'s `recv` (same length as `send` on the root;
    /// ignored, and may be empty, elsewhere).
    pub fn reduce<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp, root: usize) -> Result<()> {
        self.collective(self.reduce_call(send, recv, op, root)?)
    }

    /// Reduce in place: `root`'s `buf` receives the reduction of every rank's `buf`.
    pub fn reduce_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp, root: usize) -> Result<()> {
        self.collective(self.reduce_in_place_call(buf, op, root)?)
    }

    /// All-to-all with equal counts: `send` and `recv` have `size()` equal blocks; block j of
    /// `send` goes to rank j, block i of `recv` comes from rank i. `T` may be any
    /// plain-old-data type.
    pub fn alltoall<T: Pod>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.collective(self.alltoall_call(send, recv)?)
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
        let w = self.wire::<T>("alltoallv")?;
        let prep = self.alltoallv_prepare(w, (send.len(), send_counts, send_displs), (recv.len(), recv_counts, recv_displs))?;
        self.run_v(prep, bytemuck::cast_slice(send), bytemuck::cast_slice_mut(recv))
    }

    /// Gathers every rank's `send` (the same length on every rank) into `root`'s `recv`
    /// (`size() * send.len()` elements, rank r's block at `r * send.len()`); off the root
    /// `recv` is ignored (it may be empty). Every rank must pass the same length (checked on
    /// the wire, like every collective's arguments). `T` may be any plain-old-data type.
    pub fn gather<T: Pod>(&self, send: &[T], recv: &mut [T], root: usize) -> Result<()> {
        let prep = self.gather_prepare(self.wire::<T>("gather")?, send.len(), recv.len(), root)?;
        self.run_v(prep, bytemuck::cast_slice(send), bytemuck::cast_slice_mut(recv))
    }

    /// A gather's checks (lengths in elements), schedule and identity.
    pub(crate) fn gather_prepare(&self, w: Wire, send_len: usize, recv_len: usize, root: usize) -> Result<Prepared> {
        self.check_root("gather", root)?;
        let (n, me, c, elem) = (self.size(), self.rank(), send_len, w.size);
        let mut recvs = Vec::new();
        if me == root {
            let want = c.checked_mul(n).ok_or_else(|| Error::invalid("gather: size overflows"))?;
            self.check_len("gather", "recv", recv_len, want)?;
            recvs = (0..n).map(|p| (p * c * elem, c * elem)).collect();
        }
        let sched = algo::build_gather(n, me, root, (0, c * elem), &recvs);
        self.v_prepared(Collective::Gather { root }, w, c, c, Algo::Mesh, sched)
    }

    /// Scatters `root`'s `send` (`size() * recv.len()` elements): rank r receives block r
    /// in `recv` (the same length on every rank); off the root `send` is ignored (it may be
    /// empty). `T` may be any plain-old-data type.
    pub fn scatter<T: Pod>(&self, send: &[T], recv: &mut [T], root: usize) -> Result<()> {
        let prep = self.scatter_prepare(self.wire::<T>("scatter")?, send.len(), recv.len(), root)?;
        self.run_v(prep, bytemuck::cast_slice(send), bytemuck::cast_slice_mut(recv))
    }

    /// A scatter's checks (lengths in elements), schedule and identity.
    pub(crate) fn scatter_prepare(&self, w: Wire, send_len: usize, recv_len: usize, root: usize) -> Result<Prepared> {
        self.check_root("scatter", root)?;
        let (n, me, c, elem) = (self.size(), self.rank(), recv_len, w.size);
        let mut sends = Vec::new();
        if me == root {
            let want = c.checked_mul(n).ok_or_else(|| Error::invalid("scatter: size overflows"))?;
            self.check_len("scatter", "send", send_len, want)?;
            sends = (0..n).map(|p| (p * c * elem, c * elem)).collect();
        }
        let sched = algo::build_scatter(n, me, root, &sends, (0, c * elem));
        self.v_prepared(Collective::Scatter { root }, w, c, c, Algo::Mesh, sched)
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
        let prep = self.gatherv_prepare(self.wire::<T>("gatherv")?, send.len(), (recv.len(), recv_counts, recv_displs), root)?;
        self.run_v(prep, bytemuck::cast_slice(send), bytemuck::cast_slice_mut(recv))
    }

    /// A gatherv's checks (lengths, counts, displacements in elements), schedule and
    /// identity.
    pub(crate) fn gatherv_prepare(&self, w: Wire, send_len: usize, recv: (usize, &[usize], &[usize]), root: usize) -> Result<Prepared> {
        const NAME: &str = "gatherv";
        self.check_root(NAME, root)?;
        let (n, me, elem) = (self.size(), self.rank(), w.size);
        let mut recvs = Vec::new();
        if me == root {
            recvs = self.v_blocks(NAME, elem, "recv", recv, true)?;
            if recvs[root].1 != send_len * elem {
                return Err(Error::invalid(format!(
                    "rank {me}: {NAME}: the root sends itself {send_len} elements but recv_counts[{root}] is {}",
                    recvs[root].1 / elem
                )));
            }
        }
        let sched = algo::build_gather(n, me, root, (0, send_len * elem), &recvs);
        self.v_prepared(Collective::GatherV { root }, w, 0, send_len, Algo::Mesh, sched)
    }

    /// Scatter with per-rank counts (MPI's `Scatterv`): on the root, `send_counts[p]`
    /// elements of `send` from `send_displs[p]` go to rank p (counts may be 0; send blocks
    /// may overlap); every rank receives into its whole `recv`, whose length must equal the
    /// root's count for it. Off the root `send`, `send_counts` and `send_displs` are
    /// ignored. Errors as for [`Communicator::gatherv`] (the receiver finds a mismatch).
    /// `T` may be any plain-old-data type (counts and displacements in elements of `T`).
    pub fn scatterv<T: Pod>(&self, send: &[T], send_counts: &[usize], send_displs: &[usize], recv: &mut [T], root: usize) -> Result<()> {
        let prep = self.scatterv_prepare(self.wire::<T>("scatterv")?, (send.len(), send_counts, send_displs), recv.len(), root)?;
        self.run_v(prep, bytemuck::cast_slice(send), bytemuck::cast_slice_mut(recv))
    }

    /// A scatterv's checks (lengths, counts, displacements in elements), schedule and
    /// identity.
    pub(crate) fn scatterv_prepare(&self, w: Wire, send: (usize, &[usize], &[usize]), recv_len: usize, root: usize) -> Result<Prepared> {
        const NAME: &str = "scatterv";
        self.check_root(NAME, root)?;
        let (n, me, elem) = (self.size(), self.rank(), w.size);
        let mut sends = Vec::new();
        if me == root {
            sends = self.v_blocks(NAME, elem, "send", send, false)?;
            if sends[root].1 != recv_len * elem {
                return Err(Error::invalid(format!(
                    "rank {me}: {NAME}: the root expects {recv_len} elements from itself but send_counts[{root}] is {}",
                    sends[root].1 / elem
                )));
            }
        }
        let sched = algo::build_scatter(n, me, root, &sends, (0, recv_len * elem));
        self.v_prepared(Collective::ScatterV { root }, w, 0, recv_len, Algo::Mesh, sched)
    }

    /// The (byte offset, byte length) of every block of a buffer of `len` elements given by
    /// per-member `counts` and `displs` (elements), for call `name`'s `side` ("send",
    /// "recv"); with `exclusive`, blocks that overlap are refused (receive sides).
    fn v_blocks(
        &self,
        name: &str,
        elem: usize,
        side: &str,
        (len, counts, displs): (usize, &[usize], &[usize]),
        exclusive: bool,
    ) -> Result<Vec<(usize, usize)>> {
        let (n, me) = (self.size(), self.rank());
        let bad = |what: String| Error::invalid(format!("rank {me}: {name}: {what}"));
        for (what, v) in [("counts", counts), ("displacements", displs)] {
            if v.len() != n {
                return Err(bad(format!("{side}_{what} has {} entries, expected one per member ({n})", v.len())));
            }
        }
        let mut out = Vec::with_capacity(n);
        for (p, (&c, &d)) in counts.iter().zip(displs).enumerate() {
            match d.checked_add(c) {
                Some(end) if end <= len => out.push((d * elem, c * elem)),
                _ => {
                    return Err(bad(format!(
                        "the {side} block of peer {p} ({c} elements at displacement {d}) runs past the {side} buffer's {len} elements"
                    )))
                }
            }
        }
        if exclusive {
            // Empty blocks never overlap.
            let mut order: Vec<usize> = (0..n).filter(|&p| out[p].1 > 0).collect();
            order.sort_by_key(|&p| out[p].0);
            for w in order.windows(2) {
                let (a, b) = (w[0], w[1]);
                if out[a].0 + out[a].1 > out[b].0 {
                    let (ea, eb) = (out[a].0 / elem, out[b].0 / elem);
                    return Err(bad(format!(
                        "the {side} blocks of peers {a} ({} elements at {ea}) and {b} ({} elements at {eb}) overlap",
                        out[a].1 / elem,
                        out[b].1 / elem
                    )));
                }
            }
        }
        Ok(out)
    }

    /// A per-call schedule's identity: its descriptor (with `desc_count`, the same on every
    /// rank, and the mesh for the algorithm: alltoallv's ranks pick theirs from their own
    /// counts, and its two schedules interoperate) and its name in errors (with `count`,
    /// this rank's, in elements of the caller's type, and `algo`, the schedule's).
    fn v_prepared(&self, coll: Collective, w: Wire, desc_count: usize, count: usize, algo: Algo, sched: Schedule) -> Result<Prepared> {
        let dtype = w.dtype;
        let (_, desc, _) = self.identity(coll, dtype, ReduceOp::Sum, w.count(desc_count), false, Algo::Mesh);
        let name = Op::collective(coll, dtype, w.count(count), ReduceOp::Sum, algo).with_pod(w.pod);
        self.check_usable(&name)?;
        Ok(Prepared { name, desc, sched: Arc::new(sched), dtype, op: ReduceOp::Sum, ll: None })
    }

    /// Runs a prepared out-of-place call over `send` and `recv`.
    fn run_v(&self, prep: Prepared, send: &[u8], recv: &mut [u8]) -> Result<()> {
        let scratch = self.scratch().get(prep.sched.scratch_bytes);
        let r = with_region(recv, |out| with_region_ro(send, |inp| self.run_coll(prep, Some(inp.clone()), out.clone(), scratch.clone())));
        self.scratch().put(scratch);
        r
    }

    /// Checks an alltoallv's counts and displacements against its buffers (`(length,
    /// counts, displacements)` of each, in elements) and builds its schedule and identity.
    /// Errors here leave the communicator usable.
    pub(crate) fn alltoallv_prepare(
        &self,
        w: Wire,
        send: (usize, &[usize], &[usize]),
        recv: (usize, &[usize], &[usize]),
    ) -> Result<Prepared> {
        const NAME: &str = "alltoallv";
        let (n, me) = (self.size(), self.rank());
        let bad = |what: String| Error::invalid(format!("rank {me}: {NAME}: {what}"));
        let elem = w.size;
        let sends = self.v_blocks(NAME, elem, "send", send, false)?;
        let recvs = self.v_blocks(NAME, elem, "recv", recv, true)?;
        if sends[me].1 != recvs[me].1 {
            return Err(bad(format!(
                "rank {me} sends itself {} elements but expects {} from itself (send_counts[{me}] != recv_counts[{me}])",
                sends[me].1 / elem,
                recvs[me].1 / elem
            )));
        }
        let total = send.1.iter().fold(0usize, |a, &c| a.saturating_add(c));
        // The descriptor compared on the wire leaves the counts out (they are per rank);
        // errors name this rank's total sent. The algorithm: the forced one, else the cost
        // model's for this rank's total (`algorithm_for`), so ranks may differ (mesh and
        // pairwise send the same messages, see `algo::build_alltoallv`).
        let algo = self.pick_algo(Collective::AllToAllV, w.dtype, ReduceOp::Sum, w.count(total));
        self.v_prepared(Collective::AllToAllV, w, 0, total, algo, algo::build_alltoallv(algo, n, me, &sends, &recvs))
    }

    // The argument checks and call descriptions, shared by the blocking calls, the
    // non-blocking ones (`Scope`) and group calls.

    pub(crate) fn allreduce_call<'a, T: Element>(&self, buf: &'a mut [T], op: ReduceOp) -> Call<'a> {
        let count = buf.len();
        Call {
            name: "allreduce",
            coll: Collective::AllReduce,
            dtype: T::DTYPE,
            op,
            count,
            pod: None,
            input: None,
            output: Some(as_bytes_mut(buf)),
        }
    }

    pub(crate) fn allreduce_into_call<'a, T: Element>(&self, send: &'a [T], recv: &'a mut [T], op: ReduceOp) -> Result<Call<'a>> {
        self.check_len("allreduce", "recv", recv.len(), send.len())?;
        Ok(Call {
            name: "allreduce",
            coll: Collective::AllReduce,
            dtype: T::DTYPE,
            op,
            count: send.len(),
            pod: None,
            input: Some(as_bytes(send)),
            output: Some(as_bytes_mut(recv)),
        })
    }

    /// How `T` crosses the wire in call `name` (a zero-sized `T` is refused).
    pub(crate) fn wire<T: Pod>(&self, name: &str) -> Result<Wire> {
        Wire::of::<T>(self.rank(), name)
    }

    pub(crate) fn allgather_call<'a, T: Pod>(&self, send: &'a [T], recv: &'a mut [T]) -> Result<Call<'a>> {
        let w = self.wire::<T>("allgather")?;
        let want = send.len().checked_mul(self.size()).ok_or_else(|| Error::invalid("allgather: size overflows"))?;
        self.check_len("allgather", "recv", recv.len(), want)?;
        Ok(Call {
            name: "allgather",
            coll: Collective::AllGather,
            dtype: w.dtype,
            op: ReduceOp::Sum,
            count: w.count(send.len()),
            pod: w.pod,
            input: Some(bytemuck::cast_slice(send)),
            output: Some(bytemuck::cast_slice_mut(recv)),
        })
    }

    pub(crate) fn allgather_in_place_call<'a, T: Pod>(&self, buf: &'a mut [T]) -> Result<Call<'a>> {
        let w = self.wire::<T>("allgather")?;
        let count = self.blocks("allgather", buf.len())?;
        Ok(Call {
            name: "allgather",
            coll: Collective::AllGather,
            dtype: w.dtype,
            op: ReduceOp::Sum,
            count: w.count(count),
            pod: w.pod,
            input: None,
            output: Some(bytemuck::cast_slice_mut(buf)),
        })
    }

    pub(crate) fn reduce_scatter_call<'a, T: Element>(&self, send: &'a [T], recv: &'a mut [T], op: ReduceOp) -> Result<Call<'a>> {
        let want = recv.len().checked_mul(self.size()).ok_or_else(|| Error::invalid("reduce_scatter: size overflows"))?;
        self.check_len("reduce_scatter", "send", send.len(), want)?;
        Ok(Call {
            name: "reduce_scatter",
            coll: Collective::ReduceScatter,
            dtype: T::DTYPE,
            op,
            count: recv.len(),
            pod: None,
            input: Some(as_bytes(send)),
            output: Some(as_bytes_mut(recv)),
        })
    }

    pub(crate) fn reduce_scatter_in_place_call<'a, T: Element>(&self, buf: &'a mut [T], op: ReduceOp) -> Result<Call<'a>> {
        let count = self.blocks("reduce_scatter", buf.len())?;
        Ok(Call {
            name: "reduce_scatter",
            coll: Collective::ReduceScatter,
            dtype: T::DTYPE,
            op,
            count,
            pod: None,
            input: None,
            output: Some(as_bytes_mut(buf)),
        })
    }

    pub(crate) fn broadcast_call<'a, T: Pod>(&self, buf: &'a mut [T], root: usize) -> Result<Call<'a>> {
        let w = self.wire::<T>("broadcast")?;
        self.check_root("broadcast", root)?;
        Ok(Call {
            name: "broadcast",
            coll: Collective::Broadcast { root },
            dtype: w.dtype,
            op: ReduceOp::Sum,
            count: w.count(buf.len()),
            pod: w.pod,
            input: None,
            output: Some(bytemuck::cast_slice_mut(buf)),
        })
    }

    pub(crate) fn reduce_call<'a, T: Element>(&self, send: &'a [T], recv: &'a mut [T], op: ReduceOp, root: usize) -> Result<Call<'a>> {
        self.check_root("reduce", root)?;
        if self.rank() == root {
            self.check_len("reduce", "recv", recv.len(), send.len())?;
        }
        Ok(Call {
            name: "reduce",
            coll: Collective::Reduce { root },
            dtype: T::DTYPE,
            op,
            count: send.len(),
            pod: None,
            input: Some(as_bytes(send)),
            // Off the root the output is never written; the schedule still addresses one
            // of the right size, which the call allocates.
            output: (self.rank() == root).then_some(as_bytes_mut(recv)),
        })
    }

    pub(crate) fn reduce_in_place_call<'a, T: Element>(&self, buf: &'a mut [T], op: ReduceOp, root: usize) -> Result<Call<'a>> {
        self.check_root("reduce", root)?;
        let count = buf.len();
        Ok(Call {
            name: "reduce",
            coll: Collective::Reduce { root },
            dtype: T::DTYPE,
            op,
            count,
            pod: None,
            input: None,
            output: Some(as_bytes_mut(buf)),
        })
    }

    pub(crate) fn alltoall_call<'a, T: Pod>(&self, send: &'a [T], recv: &'a mut [T]) -> Result<Call<'a>> {
        let w = self.wire::<T>("alltoall")?;
        self.check_len("alltoall", "recv", recv.len(), send.len())?;
        let count = self.blocks("alltoall", send.len())?;
        Ok(Call {
            name: "alltoall",
            coll: Collective::AllToAll,
            dtype: w.dtype,
            op: ReduceOp::Sum,
            count: w.count(count),
            pod: w.pod,
            input: Some(bytemuck::cast_slice(send)),
            output: Some(bytemuck::cast_slice_mut(recv)),
        })
    }
}
