//! Every operation's argument checks, in one place: from an [`Operation`]'s body to the
//! work it makes (a call of fixed shape, a schedule built per call from its counts, a
//! point-to-point transfer, a barrier), which the four runners (blocking, scope, group,
//! plan) then run. An error here leaves the communicator usable: nothing has been sent.

use std::sync::Arc;
use std::time::Duration;

use ferroccl_kernels::{DType, ReduceOp};

use crate::algo::ll::LlKind;
use crate::algo::{self, Algo, Collective, Schedule, Shape};
use crate::comm::Communicator;
use crate::error::{Error, Op, PodType, Result};
use crate::op::{Body, Input, Kind, Options};
use crate::pod::{zero_sized, Wire};
use crate::prepared::Prepared;

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
    /// `Input::None`: in place (one buffer, `output`).
    pub(crate) input: Input<'a>,
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
            None => self.input.len(),
        }
    }
}

/// What an operation makes once checked.
#[derive(Debug)]
pub(crate) enum Work<'a> {
    /// A collective of fixed shape (its schedule from the shape's cache, or the low-latency
    /// slots).
    Coll(Call<'a>),
    /// A collective whose schedule was built from this call's counts.
    V {
        prep: Prepared,
        input: Input<'a>,
        output: &'a mut [u8],
    },
    Send {
        name: Op,
        peer: usize,
        data: Input<'a>,
    },
    Recv {
        name: Op,
        peer: usize,
        buf: &'a mut [u8],
    },
    SendRecv {
        name: Op,
        to: usize,
        from: usize,
        data: Input<'a>,
        buf: &'a mut [u8],
    },
    Barrier,
}

/// The work of an in-place allreduce without options, the call whose latency matters most:
/// nothing to check (its one buffer is its count), so no `Work` to build; any other
/// operation is given back. Measured: going through [`Communicator::check`] cost an 8-byte
/// blocking allreduce on 2 shm ranks about 0.1 us (1.25x).
#[inline(always)]
#[allow(clippy::result_large_err)] // the operation handed back by value: boxing it would allocate on the hot path
pub(crate) fn in_place_allreduce<'a>(body: Body<'a>, opts: &Options) -> std::result::Result<Call<'a>, Body<'a>> {
    match body {
        Body { kind: Kind::AllReduce { op }, wire: Some(w), input: Input::None, output: Some(out), .. }
            if opts.timeout.is_none() && opts.algo.is_none() && w.pod.is_none() =>
        {
            let count = out.len() / w.size;
            Ok(Call {
                name: "allreduce",
                coll: Collective::AllReduce,
                dtype: w.dtype,
                op,
                count,
                pod: None,
                input: Input::None,
                output: Some(out),
            })
        }
        body => Err(body),
    }
}

impl Communicator {
    /// Checks an operation's arguments and options; see the [module documentation](self).
    ///
    /// Inlined: an operation made at the call site (the short methods) folds to its own
    /// arm.
    #[inline(always)]
    pub(crate) fn check<'a>(&self, body: Body<'a>, opts: &Options) -> Result<Work<'a>> {
        let Body { kind, wire, ty, input, output } = body;
        let name = kind.name();
        let Some(w) = wire else { return Err(zero_sized(self.rank(), name, ty)) };
        if opts.timeout == Some(Duration::ZERO) {
            return Err(Error::invalid(format!("rank {}: {name}: a timeout of zero (the call could never finish)", self.rank())));
        }
        let (n, me) = (self.size(), self.rank());
        let in_place = matches!(input, Input::None);
        let in_len = input.len() / w.size;
        let out_len = output.as_ref().map_or(0, |o| o.len()) / w.size;
        let call = |coll: Collective, op: ReduceOp, count: usize, input: Input<'a>, output: Option<&'a mut [u8]>| -> Result<Work<'a>> {
            self.check_algo(name, coll, w, op, w.count(count), opts.algo)?;
            Ok(Work::Coll(Call { name, coll, dtype: w.dtype, op, count: w.count(count), pod: w.pod, input, output }))
        };
        let v = |prep: Result<Prepared>, input: Input<'a>, output: Option<&'a mut [u8]>| -> Result<Work<'a>> {
            let mut prep = prep?;
            prep.name = prep.name.tagged(opts.tag.as_ref());
            Ok(Work::V { prep, input, output: output.unwrap_or_default() })
        };
        let sum = ReduceOp::Sum;
        match kind {
            Kind::AllReduce { op } => {
                if !in_place {
                    self.check_len(name, "recv", out_len, in_len)?;
                }
                call(Collective::AllReduce, op, if in_place { out_len } else { in_len }, input, output)
            }
            Kind::AllGather => {
                let count = if in_place {
                    self.blocks(name, out_len)?
                } else {
                    let want = in_len.checked_mul(n).ok_or_else(|| Error::invalid(format!("rank {me}: {name}: size overflows")))?;
                    self.check_len(name, "recv", out_len, want)?;
                    in_len
                };
                call(Collective::AllGather, sum, count, input, output)
            }
            Kind::ReduceScatter { op } => {
                let count = if in_place {
                    self.blocks(name, out_len)?
                } else {
                    let want = out_len.checked_mul(n).ok_or_else(|| Error::invalid(format!("rank {me}: {name}: size overflows")))?;
                    self.check_len(name, "send", in_len, want)?;
                    out_len
                };
                call(Collective::ReduceScatter, op, count, input, output)
            }
            Kind::Broadcast { root } => {
                self.check_root(name, root)?;
                call(Collective::Broadcast { root }, sum, out_len, input, output)
            }
            Kind::Reduce { op, root } => {
                self.check_root(name, root)?;
                if in_place {
                    return call(Collective::Reduce { root }, op, out_len, input, output);
                }
                if me == root {
                    self.check_len(name, "recv", out_len, in_len)?;
                }
                // Off the root the output is never written; the schedule still addresses one
                // of the right size, which the runner allocates.
                call(Collective::Reduce { root }, op, in_len, input, output.filter(|_| me == root))
            }
            Kind::AllToAll => {
                self.check_len(name, "recv", out_len, in_len)?;
                let count = self.blocks(name, in_len)?;
                call(Collective::AllToAll, sum, count, input, output)
            }
            Kind::AllToAllV { send_counts, send_displs, recv_counts, recv_displs } => {
                let prep =
                    self.alltoallv_prepare(w, (in_len, &send_counts, &send_displs), (out_len, &recv_counts, &recv_displs), opts.algo);
                v(self.check_algo(name, Collective::AllToAllV, w, sum, 0, opts.algo).and(prep), input, output)
            }
            Kind::AllGatherV { recv_counts, recv_displs } => {
                let prep = self.allgatherv_prepare(w, in_len, (out_len, &recv_counts, &recv_displs));
                v(self.check_algo(name, Collective::AllGatherV, w, sum, 0, opts.algo).and(prep), input, output)
            }
            Kind::ReduceScatterV { recv_counts, op } => {
                let prep = self.reduce_scatterv_prepare(w, op, in_len, out_len, &recv_counts);
                v(self.check_algo(name, Collective::ReduceScatterV, w, op, 0, opts.algo).and(prep), input, output)
            }
            Kind::Gather { root } => {
                let prep = self.gather_prepare(w, in_len, out_len, root);
                v(self.check_algo(name, Collective::Gather { root }, w, sum, 0, opts.algo).and(prep), input, output)
            }
            Kind::Scatter { root } => {
                let prep = self.scatter_prepare(w, in_len, out_len, root);
                v(self.check_algo(name, Collective::Scatter { root }, w, sum, 0, opts.algo).and(prep), input, output)
            }
            Kind::GatherV { root, recv_counts, recv_displs } => {
                let prep = self.gatherv_prepare(w, in_len, (out_len, &recv_counts, &recv_displs), root);
                v(self.check_algo(name, Collective::GatherV { root }, w, sum, 0, opts.algo).and(prep), input, output)
            }
            Kind::ScatterV { root, send_counts, send_displs } => {
                let prep = self.scatterv_prepare(w, (in_len, &send_counts, &send_displs), out_len, root);
                v(self.check_algo(name, Collective::ScatterV { root }, w, sum, 0, opts.algo).and(prep), input, output)
            }
            Kind::Send { peer } => {
                let name = Op::Send { peer, count: input.len(), dtype: DType::U8, pod: None }.per_element(w.size, w.dtype, w.pod);
                Ok(Work::Send { name, peer, data: input })
            }
            Kind::Recv { peer } => {
                let buf = output.unwrap_or_default();
                let name = Op::Recv { peer, count: buf.len(), dtype: DType::U8, pod: None }.per_element(w.size, w.dtype, w.pod);
                Ok(Work::Recv { name, peer, buf })
            }
            Kind::SendRecv { to, from } => {
                let buf = output.unwrap_or_default();
                let name = Op::SendRecv { to, from, send: input.len(), recv: buf.len(), dtype: DType::U8, pod: None }
                    .per_element(w.size, w.dtype, w.pod);
                Ok(Work::SendRecv { name, to, from, data: input, buf })
            }
            Kind::Barrier => Ok(Work::Barrier),
        }
    }

    /// Checks the algorithm an operation asked for (`forced`) against its collective:
    /// one that does not implement it, or the low-latency protocol for a call that cannot
    /// take it, is refused.
    fn check_algo(&self, name: &str, coll: Collective, w: Wire, op: ReduceOp, count: usize, forced: Option<Algo>) -> Result<()> {
        let Some(a) = forced else { return Ok(()) };
        let me = self.rank();
        if a == Algo::Ll {
            if self.takes_ll(LlKind::Coll(coll), w.dtype, op, count, forced) {
                return Ok(());
            }
            let why = match &self.ll {
                None => "this communicator has no low-latency slots (its ranks are not all on one host, or FERROCCL_LL=off)",
                Some(_) if coll.per_call() => "its per-rank counts do not fit the slots' layout",
                Some(_) => "the call does not fit the low-latency slots",
            };
            return Err(Error::invalid(format!("rank {me}: {name}: algorithm ll was asked for, but {why}")));
        }
        if !a.supports_op(coll, w.dtype, op) {
            let does: Vec<&str> = Algo::ALL.iter().filter(|b| b.supports_op(coll, w.dtype, op)).map(|b| b.name()).collect();
            return Err(Error::invalid(format!(
                "rank {me}: {name}: algorithm {a} was asked for, which does not implement {name} of {} with {op} (these do: {})",
                w.dtype,
                does.join(", ")
            )));
        }
        Ok(())
    }

    /// An allgatherv's checks (lengths, counts, displacements in elements), schedule and
    /// identity: every rank sends its whole input to every other (one message each, empty
    /// ones included, so a count that disagrees with the sender's length is a mismatch the
    /// receiver finds).
    pub(crate) fn allgatherv_prepare(&self, w: Wire, send_len: usize, recv: (usize, &[usize], &[usize])) -> Result<Prepared> {
        const NAME: &str = "allgatherv";
        let (n, me, elem) = (self.size(), self.rank(), w.size);
        let recvs = self.v_blocks(NAME, elem, "recv", recv, true)?;
        if recvs[me].1 != send_len * elem {
            return Err(Error::invalid(format!(
                "rank {me}: {NAME}: this rank sends {send_len} elements but recv_counts[{me}] is {}",
                recvs[me].1 / elem
            )));
        }
        let sends = vec![(0, send_len * elem); n];
        let sched = algo::build_alltoallv(Algo::Mesh, n, me, &sends, &recvs);
        self.v_prepared(Collective::AllGatherV, w, 0, send_len, Algo::Mesh, sched)
    }

    /// A reduce_scatterv's checks and schedule: `recv_counts` (one per member, in elements)
    /// cut the input into consecutive blocks; its fingerprint goes into the call's
    /// descriptor, so that ranks whose counts differ fail with a mismatch on the first
    /// message between them.
    pub(crate) fn reduce_scatterv_prepare(
        &self,
        w: Wire,
        op: ReduceOp,
        send_len: usize,
        recv_len: usize,
        counts: &[usize],
    ) -> Result<Prepared> {
        const NAME: &str = "reduce_scatterv";
        let (n, me, elem) = (self.size(), self.rank(), w.size);
        let bad = |what: String| Error::invalid(format!("rank {me}: {NAME}: {what}"));
        if counts.len() != n {
            return Err(bad(format!("recv_counts has {} entries, expected one per member ({n})", counts.len())));
        }
        let total = counts.iter().try_fold(0usize, |a, &c| a.checked_add(c)).ok_or_else(|| bad("the counts overflow".into()))?;
        if send_len != total {
            return Err(bad(format!("send has {send_len} elements, expected the sum of recv_counts ({total})")));
        }
        if recv_len != counts[me] {
            return Err(bad(format!("recv has {recv_len} elements, expected recv_counts[{me}] ({})", counts[me])));
        }
        let lens: Vec<usize> = counts.iter().map(|c| c * elem).collect();
        let p = &self.fabric().params;
        let shape = Shape {
            coll: Collective::ReduceScatterV,
            n,
            rank: me,
            count: counts[me],
            dtype: w.dtype,
            op,
            chunk_bytes: p.chunk_bytes,
            in_place: false,
            slots: p.slots,
        };
        let sched = algo::build_reduce_scatterv(&shape, &lens);
        let mut prep = self.v_prepared_op(Collective::ReduceScatterV, w, op, (total, recv_len), Algo::Mesh, sched)?;
        prep.desc[4..8].copy_from_slice(&fingerprint(counts).to_le_bytes());
        Ok(prep)
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
        self.v_prepared_op(coll, w, ReduceOp::Sum, (desc_count, count), algo, sched)
    }

    /// [`Communicator::v_prepared`] of a call that reduces with `op`; `counts`: (for the
    /// descriptor, this rank's).
    fn v_prepared_op(
        &self,
        coll: Collective,
        w: Wire,
        op: ReduceOp,
        counts: (usize, usize),
        algo: Algo,
        sched: Schedule,
    ) -> Result<Prepared> {
        let dtype = w.dtype;
        let (_, desc, _) = self.identity(coll, dtype, op, w.count(counts.0), false, Algo::Mesh);
        let name = Op::collective(coll, dtype, w.count(counts.1), op, algo).with_pod(w.pod);
        self.check_usable(&name)?;
        Ok(Prepared { name, desc, sched: Arc::new(sched), dtype, op, ll: None })
    }

    /// Checks an alltoallv's counts and displacements against its buffers (`(length,
    /// counts, displacements)` of each, in elements) and builds its schedule and identity.
    /// Errors here leave the communicator usable.
    pub(crate) fn alltoallv_prepare(
        &self,
        w: Wire,
        send: (usize, &[usize], &[usize]),
        recv: (usize, &[usize], &[usize]),
        forced: Option<Algo>,
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
        let algo = self.pick_algo(Collective::AllToAllV, w.dtype, ReduceOp::Sum, w.count(total), forced);
        self.v_prepared(Collective::AllToAllV, w, 0, total, algo, algo::build_alltoallv(algo, n, me, &sends, &recvs))
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

    /// How `T` crosses the wire in call `name` (a zero-sized `T` is refused).
    pub(crate) fn wire<T: bytemuck::Pod>(&self, name: &str) -> Result<Wire> {
        Wire::of::<T>(self.rank(), name)
    }
}

/// A 32-bit fingerprint of a list of counts (FNV-1a over their bytes).
fn fingerprint(counts: &[usize]) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for c in counts {
        for b in (*c as u64).to_le_bytes() {
            h = (h ^ u32::from(b)).wrapping_mul(0x0100_0193);
        }
    }
    h
}
