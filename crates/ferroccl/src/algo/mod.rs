//! Collective algorithms as schedules: pure data, no I/O.
//!
//! A [`Schedule`] is what one rank does for one collective call: an ordered list of
//! [`Step`]s over byte ranges of three buffers (the caller's input, the caller's output,
//! and a scratch area the executor allocates). Building a schedule does no I/O, so the same
//! schedule is run by the executor (`crate::exec`) over real transports, by a deterministic
//! simulator in tests, and by persistent plans, many times.
//!
//! Rules every builder follows, and the executor and simulator rely on:
//! * Transfers between two ranks match in schedule order: the k-th `Send` from a to b pairs
//!   with the k-th `Recv` on b from a, and both have the same length.
//! * A step may start only when every step in `deps` has completed. The executor starts
//!   steps in index order (transfers are posted without waiting; local steps run at once),
//!   so independent transfers overlap with each other and with reductions.
//! * A step never reads or writes a range that an unfinished step writes (the deps say so).
//! * Builders never emit a transfer of length 0 (they drop it) unless a count of 0 makes the
//!   whole schedule empty; except alltoallv's, which sends every peer one message, empty
//!   or not, so that its receiver can compare the length with its own count (the
//!   simulator, which refuses empty transfers, does not run it).
//!
//! # Buffers and in-place calls
//!
//! Out of place (`Shape::in_place == false`), `Input` and `Output` are the caller's two
//! buffers, with the sizes listed on [`Collective`]. In place (`Shape::in_place == true`) the
//! caller passes ONE buffer, and schedules reference only `Output` (and `Scratch`), never
//! `Input` (an executor that aliases `Input` to `Output` is therefore also correct). That one
//! buffer is laid out as NCCL does it:
//!
//! | collective | the one buffer (`Output`) | where the input is | where the result goes |
//! | --- | --- | --- | --- |
//! | allreduce | `count` | all of it | all of it |
//! | allgather | `n * count` | block `rank` (NCCL: `sendbuf == recvbuf + rank * count`) | all of it |
//! | reduce_scatter | `n * count` | all of it | block `rank` (NCCL: `recvbuf == sendbuf + rank * count`); the other blocks are left unchanged |
//! | alltoall | `n * count` | all of it | all of it |
//! | broadcast | `count` | all of it on the root | all of it (the root's is unchanged) |
//! | reduce | `count` | all of it | all of it on the root; unchanged elsewhere |
//!
//! # Building
//!
//! [`build`] dispatches to one builder per (algorithm, collective), one file each
//! (`ring/allreduce.rs`, `mesh/alltoall.rs`, ...); [`select::choose`] picks an algorithm from
//! a cost model; [`sim`] runs the schedules of all ranks of one call in memory (the tests).
//! `docs/algorithms.md` lists every algorithm's steps, bytes on the wire, reduction order and
//! scratch.

mod binomial;
mod bruck;
mod chain;
pub(crate) mod control;
pub(crate) mod ll;
mod mesh;
mod oneshot;
mod pairwise;
mod plan;
mod ring;
pub(crate) mod select;
#[cfg(test)]
pub(crate) mod sim;
#[cfg(test)]
mod tests;

use std::ops::Range;

use ferroccl_kernels::{DType, ReduceOp};

/// Which of the three buffers a range lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Buf {
    /// The caller's input (for in-place calls, the executor aliases it to `Output`).
    Input,
    /// The caller's output.
    Output,
    /// Scratch owned by the executor, `Schedule::scratch_bytes` long.
    Scratch,
}

/// A byte range of one buffer.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Slice {
    pub(crate) buf: Buf,
    pub(crate) range: Range<usize>,
}

impl Slice {
    pub(crate) fn new(buf: Buf, start: usize, len: usize) -> Slice {
        Slice { buf, range: start..start + len }
    }
    pub(crate) fn len(&self) -> usize {
        self.range.len()
    }
}

/// What a step does.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Action {
    /// Send `src` to communicator rank `peer`.
    Send { peer: usize, src: Slice },
    /// Receive from communicator rank `peer` into `dst` (same length as the matching send).
    Recv { peer: usize, dst: Slice },
    /// `dst[i] = dst[i] op src[i]`, rounding to the element type (one pairwise step).
    /// For `Avg` this is a `Sum` step; a `FinishAvg` divides at the end.
    Reduce { dst: Slice, src: Slice },
    /// `dst = srcs[0] op srcs[1] op ...` in this order, accumulating in f32 for f16/bf16 and
    /// rounding once (the reference semantics); `Avg` divides by `srcs.len()`.
    /// `dst` may be one of `srcs`.
    ReduceMany { dst: Slice, srcs: Vec<Slice> },
    /// `dst = src`.
    Copy { dst: Slice, src: Slice },
    /// Divides the sums in `dst` by `n` (the end of an `Avg` built from `Reduce` steps).
    FinishAvg { dst: Slice, n: usize },
    /// One-sided: read `dst.len()` bytes at byte `offset` of window `remote` of
    /// communicator rank `peer` into `dst` (the owner writes them; nothing is matched on
    /// any stream).
    Get { peer: usize, remote: Remote, offset: u64, dst: Slice, block: Block },
    /// One-sided: write `src` at byte `offset` of window `remote` of communicator rank
    /// `peer`; complete when the owner says the bytes have landed.
    Put { peer: usize, remote: Remote, offset: u64, src: Slice, block: Block },
    /// One-sided: raise this rank's signal on `slot` at communicator rank `peer` to `value`
    /// (`None`: the value the run is given), after the `Put`s to `peer` posted before it
    /// have landed; complete when `peer` says so. Slot 0 is the public signal.
    Signal { peer: usize, slot: u32, value: Option<u64> },
    /// Wait until the signal communicator rank `peer` gave this rank on `slot` is at least
    /// `value` (`None`: the value the run is given; a wait prepared once, run many times).
    WaitSignal { peer: usize, slot: u32, value: Option<u64> },
}

/// The shape of a one-sided step: `rows` rows of `row` bytes, `remote_stride` bytes apart
/// in the window and `local_stride` bytes apart in the local buffer (the step's slice spans
/// them all). A contiguous step is one row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Block {
    pub(crate) rows: u32,
    pub(crate) row: u64,
    pub(crate) remote_stride: u64,
    pub(crate) local_stride: u64,
}

impl Block {
    /// One contiguous row of `len` bytes.
    pub(crate) fn contiguous(len: u64) -> Block {
        Block { rows: 1, row: len, remote_stride: len, local_stride: len }
    }

    /// Bytes from the first row's start to the last row's end, with `stride` between rows.
    pub(crate) fn span(&self, stride: u64) -> Option<u64> {
        u64::from(self.rows.saturating_sub(1)).checked_mul(stride)?.checked_add(self.row)
    }
}

/// A window of another rank, as a one-sided step names it: the owner's window id and the
/// key that is the handle's capability, the window's length, and whether it is a shared
/// segment that a peer on the owner's host may map (`Communicator::alloc_window`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Remote {
    pub(crate) window: u32,
    pub(crate) key: u64,
    pub(crate) len: u64,
    pub(crate) shared: bool,
}

/// One step and what it waits for.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Step {
    pub(crate) op: Action,
    /// Indices of earlier steps that must complete first.
    pub(crate) deps: Vec<usize>,
}

/// One rank's part of one collective call.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Schedule {
    pub(crate) steps: Vec<Step>,
    pub(crate) scratch_bytes: usize,
}

impl Schedule {
    /// Appends a step; returns its index.
    pub(crate) fn push(&mut self, op: Action, deps: Vec<usize>) -> usize {
        debug_assert!(deps.iter().all(|&d| d < self.steps.len()));
        self.steps.push(Step { op, deps });
        self.steps.len() - 1
    }
}

/// The collectives, as data: what [`crate::Communicator::algorithm_for`] asks about and what
/// an [`crate::Op::Collective`] in an error names. `count` below means what the call's own
/// count means.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Collective {
    /// Every rank ends with the reduction of all inputs (`count` elements each).
    AllReduce,
    /// Input `count` elements per rank; output `count * n`, rank r's input at block r.
    AllGather,
    /// Input `count * n` elements per rank; output `count`: block r of the reduction.
    ReduceScatter,
    /// `count` elements from `root` to everyone (in the output buffer; the root's input is
    /// its output).
    Broadcast {
        /// The rank whose buffer is sent.
        root: usize,
    },
    /// The reduction of all inputs (`count` each) lands in `root`'s output.
    Reduce {
        /// The rank that receives the result.
        root: usize,
    },
    /// Input `count * n` per rank; block j goes to rank j; output block i comes from rank i.
    AllToAll,
    /// All-to-all with per-peer counts and displacements
    /// ([`Communicator::alltoallv`](crate::Communicator::alltoallv)): `count` is this rank's
    /// total of elements sent (it differs between ranks, so the call descriptor compared on
    /// the wire leaves it out).
    AllToAllV,
    /// Every rank's `count` elements land in `root`'s output (`n * count`, rank r's block at
    /// block r).
    Gather {
        /// The rank that receives.
        root: usize,
    },
    /// `root`'s input (`n * count`): block r goes to rank r's output (`count`).
    Scatter {
        /// The rank that sends.
        root: usize,
    },
    /// Gather with per-rank counts and displacements at the root
    /// ([`Communicator::gatherv`](crate::Communicator::gatherv)); `count` is this rank's.
    GatherV {
        /// The rank that receives.
        root: usize,
    },
    /// Scatter with per-rank counts and displacements at the root
    /// ([`Communicator::scatterv`](crate::Communicator::scatterv)); `count` is this rank's.
    ScatterV {
        /// The rank that sends.
        root: usize,
    },
    /// Allgather with per-rank counts and displacements
    /// ([`Communicator::allgatherv`](crate::Communicator::allgatherv)); `count` is this
    /// rank's.
    AllGatherV,
    /// Reduce-scatter with per-rank counts
    /// ([`Communicator::reduce_scatterv`](crate::Communicator::reduce_scatterv)); `count` is
    /// this rank's block of the result.
    ReduceScatterV,
}

/// How the ranks of a collective find that their counts differ.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Counts {
    /// The count is the same on every rank and in the call's descriptor.
    InDescriptor,
    /// Counts are per rank (or pair of ranks): each transfer carries one whole block, whose
    /// length the receiver compares with its count.
    PerTransfer,
    /// Every rank passes every rank's count: their fingerprint is in the descriptor.
    Fingerprint,
}

/// The collective algorithms (not every one implements every collective: see
/// [`Algo::supports`]). `FERROCCL_ALGO` / [`crate::Params::algo`] names one; docs/algorithms.md
/// describes each.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algo {
    /// Neighbour to neighbour around a ring, chunked and pipelined.
    Ring,
    /// Direct: every rank talks to every other at once (rank-order reductions).
    Mesh,
    /// Small messages: one round; every rank sends its whole input to every other and
    /// reduces locally in rank order.
    OneShot,
    /// Broadcast (and reduce) along a chain from the root, chunked and pipelined.
    Chain,
    /// The low-latency protocol on shared memory (communicators whose ranks are all on one
    /// host; calls that fit its slots): every rank writes its contribution into a slot the
    /// others poll, flag and data in one cache line, and every rank reduces all of them in
    /// rank order. Not a schedule: see the `ll` module.
    Ll,
    /// Pairwise exchange (alltoallv): `n - 1` steps, in step `s` rank `r` sends to `r + s`
    /// and receives from `r - s` (mod n), a small window of steps in flight: one peer
    /// sending to each rank at a time (no incast), bounded buffering.
    Pairwise,
    /// Small messages where every message costs (tcp, verbs, ranks that share CPUs):
    /// Bruck's dissemination, `ceil(log2 n)` rounds of one message each instead of one
    /// round of `n - 1`; allreduce gathers every input and reduces in rank order (bit-equal
    /// to the reference), allgather copies the gathered blocks into place.
    Bruck,
    /// Broadcast down a binomial tree: `ceil(log2 n)` hops, the root sends `ceil(log2 n)`
    /// messages where the mesh's sends `n - 1`; for small messages where every message
    /// costs.
    Binomial,
}

/// Everything a builder needs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Shape {
    pub(crate) coll: Collective,
    /// Ranks in the communicator.
    pub(crate) n: usize,
    /// This rank.
    pub(crate) rank: usize,
    /// Elements (see [`Collective`] for what `count` means for each).
    pub(crate) count: usize,
    pub(crate) dtype: DType,
    pub(crate) op: ReduceOp,
    /// Largest transfer a builder should emit (bytes; builders split larger pieces into
    /// chunks of at most this size, on element boundaries; a chunk is at least one element;
    /// 0 means no limit).
    pub(crate) chunk_bytes: usize,
    /// One buffer instead of two (see the module docs, "Buffers and in-place calls"): the
    /// schedule then references only `Output` and `Scratch`.
    pub(crate) in_place: bool,
    /// Chunks in flight per peer in the windowed builders (mesh, in-place ring): the
    /// pipeline's depth and the scratch it needs (`FERROCCL_SLOTS`; 0 means the default, 4).
    pub(crate) slots: usize,
}

impl Collective {
    /// The name users and docs use (`allreduce`, `broadcast`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "allreduce",
            Collective::AllGather => "allgather",
            Collective::ReduceScatter => "reduce_scatter",
            Collective::Broadcast { .. } => "broadcast",
            Collective::Reduce { .. } => "reduce",
            Collective::AllToAll => "alltoall",
            Collective::AllToAllV => "alltoallv",
            Collective::Gather { .. } => "gather",
            Collective::Scatter { .. } => "scatter",
            Collective::GatherV { .. } => "gatherv",
            Collective::ScatterV { .. } => "scatterv",
            Collective::AllGatherV => "allgatherv",
            Collective::ReduceScatterV => "reduce_scatterv",
        }
    }

    /// Whether the call's schedule is built per call from its arguments by the builders of
    /// `build_alltoallv`, `build_gather`, `build_scatter` (never from a [`Shape`], never on
    /// the low-latency slots).
    pub(crate) const fn per_call(self) -> bool {
        matches!(
            self,
            Collective::AllToAllV
                | Collective::Gather { .. }
                | Collective::Scatter { .. }
                | Collective::GatherV { .. }
                | Collective::ScatterV { .. }
                | Collective::AllGatherV
                | Collective::ReduceScatterV
        )
    }

    /// Its code in call descriptors (7 and 8 are the barrier's and the split's).
    pub(crate) const fn code(self) -> u8 {
        match self {
            Collective::AllReduce => 1,
            Collective::AllGather => 2,
            Collective::ReduceScatter => 3,
            Collective::Broadcast { .. } => 4,
            Collective::Reduce { .. } => 5,
            Collective::AllToAll => 6,
            Collective::AllToAllV => 9,
            Collective::Gather { .. } => 10,
            Collective::Scatter { .. } => 11,
            Collective::GatherV { .. } => 12,
            Collective::ScatterV { .. } => 13,
            Collective::AllGatherV => 14,
            Collective::ReduceScatterV => 15,
        }
    }

    /// The collective of descriptor code `code` ([`Collective::code`]), with `root` where
    /// it has one.
    pub(crate) fn from_code(code: u8, root: usize) -> Option<Collective> {
        let all = [
            Collective::AllReduce,
            Collective::AllGather,
            Collective::ReduceScatter,
            Collective::Broadcast { root },
            Collective::Reduce { root },
            Collective::AllToAll,
            Collective::AllToAllV,
            Collective::Gather { root },
            Collective::Scatter { root },
            Collective::GatherV { root },
            Collective::ScatterV { root },
            Collective::AllGatherV,
            Collective::ReduceScatterV,
        ];
        all.into_iter().find(|c| c.code() == code)
    }

    /// How ranks' counts are compared: see [`Counts`].
    pub(crate) const fn counts(self) -> Counts {
        match self {
            Collective::AllToAllV | Collective::GatherV { .. } | Collective::ScatterV { .. } | Collective::AllGatherV => {
                Counts::PerTransfer
            }
            Collective::ReduceScatterV => Counts::Fingerprint,
            _ => Counts::InDescriptor,
        }
    }

    /// Whether the collective combines values with a [`ReduceOp`].
    pub const fn reduces(self) -> bool {
        matches!(self, Collective::AllReduce | Collective::ReduceScatter | Collective::Reduce { .. } | Collective::ReduceScatterV)
    }

    /// The root, for rooted collectives.
    pub const fn root(self) -> Option<usize> {
        match self {
            Collective::Broadcast { root }
            | Collective::Reduce { root }
            | Collective::Gather { root }
            | Collective::Scatter { root }
            | Collective::GatherV { root }
            | Collective::ScatterV { root } => Some(root),
            _ => None,
        }
    }

    /// Elements in each rank's (input, output) buffer of an out-of-place call with `count`
    /// and `n` ranks (in place, the one buffer has the larger of the two sizes).
    pub(crate) fn elems(self, count: usize, n: usize) -> Option<(usize, usize)> {
        let all = count.checked_mul(n)?;
        Some(match self {
            Collective::AllReduce | Collective::Broadcast { .. } | Collective::Reduce { .. } => (count, count),
            Collective::AllGather => (count, all),
            Collective::ReduceScatter => (all, count),
            Collective::AllToAll => (all, all),
            Collective::AllToAllV
            | Collective::GatherV { .. }
            | Collective::ScatterV { .. }
            | Collective::AllGatherV
            | Collective::ReduceScatterV => (count, count),
            Collective::Gather { .. } => (count, all),
            Collective::Scatter { .. } => (all, count),
        })
    }
}

impl std::fmt::Display for Collective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.root() {
            Some(root) => write!(f, "{}(root {root})", self.name()),
            None => f.write_str(self.name()),
        }
    }
}

impl Algo {
    /// Every algorithm.
    pub const ALL: [Algo; 8] = [Algo::Ring, Algo::Mesh, Algo::OneShot, Algo::Chain, Algo::Ll, Algo::Pairwise, Algo::Bruck, Algo::Binomial];

    /// The algorithms [`build`] makes schedules of (all but [`Algo::Ll`]).
    pub(crate) const SCHEDULED: [Algo; 7] =
        [Algo::Ring, Algo::Mesh, Algo::OneShot, Algo::Chain, Algo::Pairwise, Algo::Bruck, Algo::Binomial];

    /// The name users write (`FERROCCL_ALGO`): `ring`, `mesh`, `oneshot`, `chain`, `ll`,
    /// `pairwise`.
    pub const fn name(self) -> &'static str {
        match self {
            Algo::Ring => "ring",
            Algo::Mesh => "mesh",
            Algo::OneShot => "oneshot",
            Algo::Chain => "chain",
            Algo::Ll => "ll",
            Algo::Pairwise => "pairwise",
            Algo::Bruck => "bruck",
            Algo::Binomial => "binomial",
        }
    }

    /// Parses [`Algo::name`] (case-insensitive, surrounding blanks ignored).
    pub fn parse(name: &str) -> Option<Algo> {
        Algo::ALL.into_iter().find(|a| a.name().eq_ignore_ascii_case(name.trim()))
    }

    /// Whether this algorithm implements `coll` (for some dtype and op: the ring refuses
    /// integer `Avg`, whose pairwise sums may wrap).
    pub const fn supports(self, coll: Collective) -> bool {
        match self {
            Algo::Ring => matches!(coll, Collective::AllReduce | Collective::AllGather | Collective::ReduceScatter),
            Algo::Mesh => true,
            Algo::OneShot => matches!(coll, Collective::AllReduce),
            Algo::Chain => matches!(coll, Collective::Broadcast { .. }),
            // Per-peer counts do not fit the slots' layout.
            Algo::Ll => !coll.per_call(),
            Algo::Pairwise => matches!(coll, Collective::AllToAllV),
            Algo::Bruck => matches!(coll, Collective::AllReduce | Collective::AllGather),
            Algo::Binomial => matches!(coll, Collective::Broadcast { .. }),
        }
    }

    /// Whether [`build`] accepts `coll` with this `dtype` and `op`: [`Algo::supports`], except
    /// that the ring refuses integer `Avg` (its pairwise sums in the element type may wrap,
    /// so the average would not be exact; mesh and oneshot reduce with `reduce_many`, exact).
    pub(crate) fn supports_op(self, coll: Collective, dtype: DType, op: ReduceOp) -> bool {
        self.supports(coll) && !(self == Algo::Ring && coll.reduces() && op == ReduceOp::Avg && !is_float(dtype))
    }
}

impl std::fmt::Display for Algo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Algo {
    type Err = String;

    /// [`Algo::parse`], with an error that lists the names.
    fn from_str(s: &str) -> Result<Algo, String> {
        Algo::parse(s).ok_or_else(|| {
            let names: Vec<&str> = Algo::ALL.iter().map(|a| a.name()).collect();
            format!("{s:?} is not one of {}", names.join(", "))
        })
    }
}

/// Whether `dtype` is a floating-point type.
pub(crate) const fn is_float(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F64 | DType::F16 | DType::Bf16)
}

/// Builds rank `rank`'s schedule of an alltoallv among `n` ranks with `algo` ([`Algo::Mesh`]
/// or [`Algo::Pairwise`]; any other is taken as mesh): `send[p]` / `recv[p]` are the (byte
/// offset, byte length) of the block of `Input` for rank `p` / of `Output` from rank `p`,
/// already checked against the buffers, with `send[rank].1 == recv[rank].1`. One transfer
/// per ordered pair of ranks, zero-length ones included (see `mesh/alltoallv.rs`), in the
/// same order with either algorithm, so that ranks of one call may run different ones.
pub(crate) fn build_alltoallv(algo: Algo, n: usize, rank: usize, send: &[(usize, usize)], recv: &[(usize, usize)]) -> Schedule {
    debug_assert!(send.len() == n && recv.len() == n && rank < n && send[rank].1 == recv[rank].1);
    match algo {
        Algo::Pairwise => pairwise::alltoallv::build(n, rank, send, recv, pairwise::alltoallv::WINDOW),
        _ => mesh::alltoallv::build(n, rank, send, recv),
    }
}

/// Builds rank `rank`'s schedule of a gather (or gatherv) to `root` among `n` ranks (always
/// [`Algo::Mesh`]): `send` is the (byte offset, byte length) of this rank's block of
/// `Input`; on the root, `recv[p]` is where rank `p`'s block lands in `Output` (elsewhere
/// `recv` is not read), with `recv[root].1 == send.1`. Every other rank sends the root one
/// message, empty or not (see `mesh/rooted.rs`).
pub(crate) fn build_gather(n: usize, rank: usize, root: usize, send: (usize, usize), recv: &[(usize, usize)]) -> Schedule {
    mesh::rooted::gather(n, rank, root, send, recv)
}

/// Builds rank `rank`'s schedule of a scatter (or scatterv) from `root` among `n` ranks:
/// on the root `send[p]` is rank `p`'s block of `Input` (elsewhere not read); `recv` is
/// where this rank's block lands in `Output`, with `send[root].1 == recv.1` on the root.
pub(crate) fn build_scatter(n: usize, rank: usize, root: usize, send: &[(usize, usize)], recv: (usize, usize)) -> Schedule {
    mesh::rooted::scatter(n, rank, root, send, recv)
}

/// Builds rank `shape.rank`'s schedule of a reduce-scatter with per-rank blocks of `lens`
/// bytes (always [`Algo::Mesh`]; `shape.count` is this rank's block, in elements).
pub(crate) fn build_reduce_scatterv(shape: &Shape, lens: &[usize]) -> Schedule {
    mesh::reduce_scatter::build_v(shape, lens)
}

/// Builds `shape.rank`'s schedule of one call of `shape.coll` with `algo`.
///
/// Every rank of the call builds its own schedule from the same shape (but its own `rank`);
/// together they match (see the module docs).
///
/// # Errors
///
/// A message naming what is wrong: `n == 0`, `rank` or `root` out of range, an algorithm
/// that does not implement the collective, a (dtype, op) it refuses (ring + integer avg), or
/// a size that overflows `usize`.
pub(crate) fn build(algo: Algo, shape: &Shape) -> Result<Schedule, String> {
    if shape.n == 0 {
        return Err("a communicator has at least one rank (n == 0)".into());
    }
    if shape.rank >= shape.n {
        return Err(format!("rank {} out of range for {} ranks", shape.rank, shape.n));
    }
    if let Some(root) = shape.coll.root() {
        if root >= shape.n {
            return Err(format!("{}: root {root} out of range for {} ranks", shape.coll.name(), shape.n));
        }
    }
    if !algo.supports(shape.coll) {
        return Err(format!("algorithm {algo} does not implement {}", shape.coll.name()));
    }
    if !algo.supports_op(shape.coll, shape.dtype, shape.op) {
        return Err(format!(
            "algorithm {algo} cannot compute {} with avg on {} exactly (its pairwise sums may wrap); use mesh or oneshot",
            shape.coll.name(),
            shape.dtype
        ));
    }
    let bytes = shape.coll.elems(shape.count, shape.n).and_then(|(i, o)| i.max(o).checked_mul(shape.dtype.size()));
    if bytes.is_none() {
        return Err(format!("{}: count {} x {} ranks overflows the address space", shape.coll.name(), shape.count, shape.n));
    }
    if shape.count == 0 {
        return Ok(Schedule::default());
    }
    let s = match (algo, shape.coll) {
        (Algo::Ring, Collective::AllReduce) => ring::allreduce::build(shape),
        (Algo::Ring, Collective::AllGather) => ring::allgather::build(shape),
        (Algo::Ring, Collective::ReduceScatter) => ring::reduce_scatter::build(shape),
        (Algo::Mesh, Collective::AllReduce) => mesh::allreduce::build(shape),
        (Algo::Mesh, Collective::AllGather) => mesh::allgather::build(shape),
        (Algo::Mesh, Collective::ReduceScatter) => mesh::reduce_scatter::build(shape),
        (Algo::Mesh, Collective::AllToAll) => mesh::alltoall::build(shape),
        (_, c) if c.per_call() => return Err(format!("{} is built per call (build_alltoallv, build_gather, build_scatter)", c.name())),
        (Algo::Mesh, Collective::Reduce { root }) => mesh::reduce::build(shape, root),
        (Algo::Mesh, Collective::Broadcast { root }) => mesh::broadcast::build(shape, root),
        (Algo::OneShot, Collective::AllReduce) => oneshot::allreduce::build(shape),
        (Algo::Bruck, Collective::AllReduce) => bruck::allreduce::build(shape),
        (Algo::Bruck, Collective::AllGather) => bruck::allgather::build(shape),
        (Algo::Binomial, Collective::Broadcast { root }) => binomial::broadcast::build(shape, root),
        (Algo::Chain, Collective::Broadcast { root }) => chain::broadcast::build(shape, root),
        (Algo::Ll, _) => return Err("ll runs on shared-memory slots, not as a schedule".into()),
        (algo, coll) => return Err(format!("algorithm {algo} has no builder for {}", coll.name())),
    };
    Ok(s)
}
