//! Operations as values: each collective, point-to-point and one-sided call described once,
//! run by any of four runners.
//!
//! A constructor here (`op::allreduce(&mut buf, ReduceOp::Sum)`) makes an [`Operation`]
//! that borrows its buffers, so the borrow checker holds them for as long as the operation
//! can touch them. Per-call [options](Operation::timeout) go on the value. Then:
//!
//! | runner | returns | |
//! | --- | --- | --- |
//! | [`Communicator::run`](crate::Communicator::run) | when done | blocking |
//! | [`Scope::start`](crate::Scope::start) | a [`Request`](crate::Request) | non-blocking |
//! | [`Group::add`](crate::Group::add) | at once; the group runs its operations as one unit | grouped |
//! | [`Communicator::plan`](crate::Communicator::plan) | a [`Plan`](crate::Plan), run many times | persistent |
//!
//! The short methods on [`Communicator`](crate::Communicator) (`comm.allreduce(&mut buf, op)`, ...) are
//! `comm.run(op::...)`, nothing more.
//!
//! ```
//! # use ferroccl::bootstrap::{env::StoreRole, new_token, StoreServer};
//! # use ferroccl::{Communicator, InitConfig, Params};
//! # let token = new_token();
//! # let store = StoreServer::start("127.0.0.1:0".parse().unwrap(), &token, 1 << 20)?;
//! # let cfg = InitConfig { rank: 0, world_size: 1, store: StoreRole::Connect(store.addr().to_string()), token };
//! # let comm = Communicator::init_with(cfg, Params::default())?;
//! use std::time::Duration;
//! use ferroccl::{op, ReduceOp};
//!
//! let mut grads = vec![1.0f32; 1024];
//! // Blocking, with a deadline of its own and a name in logs, errors and flight records.
//! comm.run(op::allreduce(&mut grads, ReduceOp::Sum).timeout(Duration::from_secs(5)).tag("grads"))?;
//! // Non-blocking.
//! comm.scope(|s| {
//!     let r = s.start(op::allreduce(&mut grads, ReduceOp::Sum))?;
//!     r.wait()
//! })?;
//! // Persistent: checked and built once, run many times.
//! let mut plan = comm.plan(op::allreduce(&mut grads, ReduceOp::Sum))?;
//! plan.run()?;
//! # Ok::<(), ferroccl::Error>(())
//! ```
//!
//! # Names
//!
//! A collective with an in-place form is in place under its bare name (`allreduce`,
//! `allgather`, `reduce_scatter`, `reduce`, `broadcast`), and out of place under `_into`
//! (`allreduce_into(send, recv, ..)`). The collectives that exist only out of place
//! (`alltoall`, `alltoallv`, `allgatherv`, `reduce_scatterv`, `gather`, `scatter`,
//! `gatherv`, `scatterv`) take `(send, .., recv, ..)` under their bare name.
//!
//! # Inputs
//!
//! An input (`send`) is any of `&[T]`, `&mut [T]`, `&Vec<T>`, `&mut Vec<T>`, `&[T; N]` or
//! `&mut [T; N]` ([`Src`]). Lent mutably, a [`Plan`](crate::Plan) of the operation may
//! refill it between runs ([`Plan::input_mut`](crate::Plan::input_mut)).
//!
//! The buffers of an operation cannot alias: the borrow checker refuses it, in every
//! runner, so a plan can never read an input that its output overwrites:
//!
//! ```compile_fail
//! # fn f(comm: &ferroccl::Communicator) -> ferroccl::Result<()> {
//! let mut buf = vec![0f32; 8];
//! let mut plan = comm.plan(ferroccl::op::allreduce_into(&buf, &mut buf, ferroccl::ReduceOp::Sum))?;
//! # Ok(()) }
//! ```

use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use bytemuck::Pod;
use ferroccl_kernels::{Element, ReduceOp};

use crate::algo::Algo;
use crate::pod::Wire;

/// One operation, its buffers borrowed, with its per-call options; see the
/// [module documentation](self). Made by the functions of this module.
#[must_use = "an operation does nothing until a runner (Communicator::run, Scope::start, Group::add, Communicator::plan) takes it"]
pub struct Operation<'a, T: Pod = u8> {
    pub(crate) body: Body<'a>,
    pub(crate) opts: Options,
    _t: PhantomData<fn() -> T>,
}

impl<T: Pod> std::fmt::Debug for Operation<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Operation").field("kind", &self.body.kind).field("options", &self.opts).finish()
    }
}

/// Per-call options (see [`Operation::timeout`], [`Operation::algo`], [`Operation::tag`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Options {
    pub(crate) timeout: Option<Duration>,
    pub(crate) algo: Option<Algo>,
    pub(crate) tag: Option<Arc<String>>,
}

impl<'a, T: Pod> Operation<'a, T> {
    #[inline]
    fn new(kind: Kind, wire: Option<Wire>, input: Input<'a>, output: Option<&'a mut [u8]>) -> Self {
        Operation { body: Body { kind, wire, ty: std::any::type_name::<T>(), input, output }, opts: Options::default(), _t: PhantomData }
    }

    /// Gives up on this call after `limit` instead of `FERROCCL_TIMEOUT` (a limit of zero
    /// is refused when the operation is run, before anything is sent). In a group, the
    /// group's deadline is the shortest of its operations'. A call that gives up fails as
    /// any timeout does: the communicator is poisoned.
    pub fn timeout(mut self, limit: Duration) -> Self {
        self.opts.timeout = Some(limit);
        self
    }

    /// Runs this collective with `algo` instead of the one `FERROCCL_ALGO` or the cost model
    /// picks. Every rank must pick the same (compared on the wire like the count and dtype:
    /// ranks that differ fail with [`Error::Mismatch`](crate::Error::Mismatch)). An algorithm
    /// that does not implement the collective, or [`Algo::Ll`] for a call that does not fit
    /// the low-latency slots, is refused before anything is sent. Ignored by point-to-point
    /// and one-sided operations, which have no algorithm.
    pub fn algo(mut self, algo: Algo) -> Self {
        self.opts.algo = Some(algo);
        self
    }

    /// Names this call: the tag appears with the collective in errors, in the flight record
    /// and in `FERROCCL_DEBUG=INFO`'s explanation of how it runs, and in the `TRACE` log of
    /// every call.
    pub fn tag(mut self, tag: impl Into<String>) -> Self {
        self.opts.tag = Some(Arc::new(tag.into()));
        self
    }
}

/// The element-type-free part of an operation.
#[derive(Debug)]
pub(crate) struct Body<'a> {
    pub(crate) kind: Kind,
    /// How the caller's element type crosses the wire; `None`: a zero-sized type (refused
    /// when run).
    pub(crate) wire: Option<Wire>,
    /// The caller's element type, for errors.
    pub(crate) ty: &'static str,
    pub(crate) input: Input<'a>,
    pub(crate) output: Option<&'a mut [u8]>,
}

/// What an operation does (its buffers aside); counts and displacements in elements.
#[derive(Debug, Clone)]
pub(crate) enum Kind {
    AllReduce { op: ReduceOp },
    AllGather,
    ReduceScatter { op: ReduceOp },
    Broadcast { root: usize },
    Reduce { op: ReduceOp, root: usize },
    AllToAll,
    AllToAllV { send_counts: Vec<usize>, send_displs: Vec<usize>, recv_counts: Vec<usize>, recv_displs: Vec<usize> },
    AllGatherV { recv_counts: Vec<usize>, recv_displs: Vec<usize> },
    ReduceScatterV { recv_counts: Vec<usize>, op: ReduceOp },
    Gather { root: usize },
    Scatter { root: usize },
    GatherV { root: usize, recv_counts: Vec<usize>, recv_displs: Vec<usize> },
    ScatterV { root: usize, send_counts: Vec<usize>, send_displs: Vec<usize> },
    Send { peer: usize },
    Recv { peer: usize },
    SendRecv { to: usize, from: usize },
    Barrier,
}

impl Kind {
    /// The name users call it by.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Kind::AllReduce { .. } => "allreduce",
            Kind::AllGather => "allgather",
            Kind::ReduceScatter { .. } => "reduce_scatter",
            Kind::Broadcast { .. } => "broadcast",
            Kind::Reduce { .. } => "reduce",
            Kind::AllToAll => "alltoall",
            Kind::AllToAllV { .. } => "alltoallv",
            Kind::AllGatherV { .. } => "allgatherv",
            Kind::ReduceScatterV { .. } => "reduce_scatterv",
            Kind::Gather { .. } => "gather",
            Kind::Scatter { .. } => "scatter",
            Kind::GatherV { .. } => "gatherv",
            Kind::ScatterV { .. } => "scatterv",
            Kind::Send { .. } => "send",
            Kind::Recv { .. } => "recv",
            Kind::SendRecv { .. } => "sendrecv",
            Kind::Barrier => "barrier",
        }
    }
}

/// An operation's input buffer, in bytes.
#[derive(Debug, Default)]
pub(crate) enum Input<'a> {
    /// In place, or no input (recv, barrier).
    #[default]
    None,
    Shared(&'a [u8]),
    /// Lent mutably: a plan may refill it.
    Unique(&'a mut [u8]),
}

impl<'a> Input<'a> {
    pub(crate) fn bytes(&self) -> Option<&[u8]> {
        match self {
            Input::None => None,
            Input::Shared(b) => Some(b),
            Input::Unique(b) => Some(b),
        }
    }

    /// The input for the operation's whole life.
    pub(crate) fn into_bytes(self) -> Option<&'a [u8]> {
        match self {
            Input::None => None,
            Input::Shared(b) => Some(b),
            Input::Unique(b) => Some(b),
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.bytes().map_or(0, <[u8]>::len)
    }
}

/// An operation's input: `&[T]`, `&mut [T]`, `&Vec<T>`, `&mut Vec<T>`, `&[T; N]` or
/// `&mut [T; N]`. Lent mutably, a plan of the operation may refill it between runs.
#[derive(Debug)]
pub struct Src<'a, T>(SrcInner<'a, T>);

#[derive(Debug)]
enum SrcInner<'a, T> {
    Shared(&'a [T]),
    Unique(&'a mut [T]),
}

impl<'a, T> From<&'a [T]> for Src<'a, T> {
    fn from(s: &'a [T]) -> Self {
        Src(SrcInner::Shared(s))
    }
}
impl<'a, T> From<&'a mut [T]> for Src<'a, T> {
    fn from(s: &'a mut [T]) -> Self {
        Src(SrcInner::Unique(s))
    }
}
impl<'a, T> From<&'a Vec<T>> for Src<'a, T> {
    fn from(s: &'a Vec<T>) -> Self {
        Src(SrcInner::Shared(s))
    }
}
impl<'a, T> From<&'a mut Vec<T>> for Src<'a, T> {
    fn from(s: &'a mut Vec<T>) -> Self {
        Src(SrcInner::Unique(s))
    }
}
impl<'a, T, const N: usize> From<&'a [T; N]> for Src<'a, T> {
    fn from(s: &'a [T; N]) -> Self {
        Src(SrcInner::Shared(s))
    }
}
impl<'a, T, const N: usize> From<&'a mut [T; N]> for Src<'a, T> {
    fn from(s: &'a mut [T; N]) -> Self {
        Src(SrcInner::Unique(s))
    }
}

impl<'a, T: Pod> Src<'a, T> {
    fn input(self) -> Input<'a> {
        match self.0 {
            SrcInner::Shared(s) => Input::Shared(bytemuck::cast_slice(s)),
            SrcInner::Unique(s) => Input::Unique(bytemuck::cast_slice_mut(s)),
        }
    }
}

/// How `T` crosses the wire (`None`: zero-sized).
#[inline]
fn wire<T: Pod>() -> Option<Wire> {
    Wire::of_type::<T>()
}

/// The wire of an element type: its own dtype.
#[inline]
fn elem<T: Element>() -> Option<Wire> {
    Some(Wire { dtype: T::DTYPE, size: std::mem::size_of::<T>(), per: 1, pod: None })
}

#[inline]
fn out<T: Pod>(buf: &mut [T]) -> Option<&mut [u8]> {
    Some(bytemuck::cast_slice_mut(buf))
}

/// Reduces `buf` across all ranks, in place: every rank ends with the same result.
#[inline]
pub fn allreduce<T: Element>(buf: &mut [T], op: ReduceOp) -> Operation<'_, T> {
    Operation::new(Kind::AllReduce { op }, elem::<T>(), Input::None, out(buf))
}

/// Reduces `send` across all ranks into `recv` (same length).
#[inline]
pub fn allreduce_into<'a, T: Element>(send: impl Into<Src<'a, T>>, recv: &'a mut [T], op: ReduceOp) -> Operation<'a, T> {
    Operation::new(Kind::AllReduce { op }, elem::<T>(), send.into().input(), out(recv))
}

/// Allgather in place: `buf` has `size()` equal blocks and this rank's contribution is
/// already in block `rank()`; every rank ends with every block. `T` may be any
/// plain-old-data type (see the [crate documentation](crate#plain-old-data)).
pub fn allgather<T: Pod>(buf: &mut [T]) -> Operation<'_, T> {
    Operation::new(Kind::AllGather, wire::<T>(), Input::None, out(buf))
}

/// Gathers every rank's `send` into `recv` (`send.len() * size()` elements, rank r's block
/// at `r * send.len()`).
pub fn allgather_into<'a, T: Pod>(send: impl Into<Src<'a, T>>, recv: &'a mut [T]) -> Operation<'a, T> {
    Operation::new(Kind::AllGather, wire::<T>(), send.into().input(), out(recv))
}

/// Allgather with per-rank counts (MPI's `Allgatherv`): every rank sends its whole `send`;
/// rank p's block lands in every rank's `recv` at `recv_displs[p]` and must have
/// `recv_counts[p]` elements (counts may be 0, blocks may leave gaps, must not overlap).
/// A rank whose `send.len()` differs from another rank's count for it is an
/// [`Error::Mismatch`](crate::Error::Mismatch) naming both, found by the receiver from the
/// message and relayed to every member.
pub fn allgatherv<'a, T: Pod>(
    send: impl Into<Src<'a, T>>,
    recv: &'a mut [T],
    recv_counts: &[usize],
    recv_displs: &[usize],
) -> Operation<'a, T> {
    let kind = Kind::AllGatherV { recv_counts: recv_counts.to_vec(), recv_displs: recv_displs.to_vec() };
    Operation::new(kind, wire::<T>(), send.into().input(), out(recv))
}

/// Reduce-scatter in place: `buf` has `size()` equal blocks; block `rank()` receives this
/// rank's part of the result (the other blocks are left as they were).
pub fn reduce_scatter<T: Element>(buf: &mut [T], op: ReduceOp) -> Operation<'_, T> {
    Operation::new(Kind::ReduceScatter { op }, elem::<T>(), Input::None, out(buf))
}

/// Reduces `send` (`recv.len() * size()` elements) across ranks; rank r receives block r
/// of the result in `recv`.
pub fn reduce_scatter_into<'a, T: Element>(send: impl Into<Src<'a, T>>, recv: &'a mut [T], op: ReduceOp) -> Operation<'a, T> {
    Operation::new(Kind::ReduceScatter { op }, elem::<T>(), send.into().input(), out(recv))
}

/// Reduce-scatter with per-rank counts (MPI's `Reduce_scatter`): `send` holds `size()`
/// consecutive blocks, block p of `recv_counts[p]` elements (`send.len()` is their sum);
/// rank r receives block r of the reduction in `recv` (`recv_counts[r]` elements). Every
/// rank must pass the same `recv_counts` (compared on the wire: ranks that differ fail with
/// [`Error::Mismatch`](crate::Error::Mismatch)).
pub fn reduce_scatterv<'a, T: Element>(
    send: impl Into<Src<'a, T>>,
    recv: &'a mut [T],
    recv_counts: &[usize],
    op: ReduceOp,
) -> Operation<'a, T> {
    let kind = Kind::ReduceScatterV { recv_counts: recv_counts.to_vec(), op };
    Operation::new(kind, elem::<T>(), send.into().input(), out(recv))
}

/// Copies `root`'s `buf` into every rank's `buf` (all of the same length). `T` may be any
/// plain-old-data type.
pub fn broadcast<T: Pod>(buf: &mut [T], root: usize) -> Operation<'_, T> {
    Operation::new(Kind::Broadcast { root }, wire::<T>(), Input::None, out(buf))
}

/// Reduce in place: `root`'s `buf` receives the reduction of every rank's `buf` (left as
/// it was elsewhere).
pub fn reduce<T: Element>(buf: &mut [T], op: ReduceOp, root: usize) -> Operation<'_, T> {
    Operation::new(Kind::Reduce { op, root }, elem::<T>(), Input::None, out(buf))
}

/// Reduces `send` across ranks into `root`'s `recv` (same length as `send` on the root;
/// ignored, and may be empty, elsewhere).
pub fn reduce_into<'a, T: Element>(send: impl Into<Src<'a, T>>, recv: &'a mut [T], op: ReduceOp, root: usize) -> Operation<'a, T> {
    Operation::new(Kind::Reduce { op, root }, elem::<T>(), send.into().input(), out(recv))
}

/// All-to-all with equal counts: `send` and `recv` have `size()` equal blocks; block j of
/// `send` goes to rank j, block i of `recv` comes from rank i.
pub fn alltoall<'a, T: Pod>(send: impl Into<Src<'a, T>>, recv: &'a mut [T]) -> Operation<'a, T> {
    Operation::new(Kind::AllToAll, wire::<T>(), send.into().input(), out(recv))
}

/// All-to-all with per-peer counts and displacements (MPI's `Alltoallv`); see
/// [`Communicator::alltoallv`](crate::Communicator::alltoallv).
pub fn alltoallv<'a, T: Pod>(
    send: impl Into<Src<'a, T>>,
    send_counts: &[usize],
    send_displs: &[usize],
    recv: &'a mut [T],
    recv_counts: &[usize],
    recv_displs: &[usize],
) -> Operation<'a, T> {
    let kind = Kind::AllToAllV {
        send_counts: send_counts.to_vec(),
        send_displs: send_displs.to_vec(),
        recv_counts: recv_counts.to_vec(),
        recv_displs: recv_displs.to_vec(),
    };
    Operation::new(kind, wire::<T>(), send.into().input(), out(recv))
}

/// Gathers every rank's `send` (the same length on every rank) into `root`'s `recv`
/// (`size() * send.len()` elements, rank r's block at `r * send.len()`); off the root
/// `recv` is ignored (it may be empty).
pub fn gather<'a, T: Pod>(send: impl Into<Src<'a, T>>, recv: &'a mut [T], root: usize) -> Operation<'a, T> {
    Operation::new(Kind::Gather { root }, wire::<T>(), send.into().input(), out(recv))
}

/// Scatters `root`'s `send` (`size() * recv.len()` elements): rank r receives block r in
/// `recv` (the same length on every rank); off the root `send` is ignored (it may be empty).
pub fn scatter<'a, T: Pod>(send: impl Into<Src<'a, T>>, recv: &'a mut [T], root: usize) -> Operation<'a, T> {
    Operation::new(Kind::Scatter { root }, wire::<T>(), send.into().input(), out(recv))
}

/// Gather with per-rank counts (MPI's `Gatherv`); see [`Communicator::gatherv`](crate::Communicator::gatherv).
pub fn gatherv<'a, T: Pod>(
    send: impl Into<Src<'a, T>>,
    recv: &'a mut [T],
    recv_counts: &[usize],
    recv_displs: &[usize],
    root: usize,
) -> Operation<'a, T> {
    let kind = Kind::GatherV { root, recv_counts: recv_counts.to_vec(), recv_displs: recv_displs.to_vec() };
    Operation::new(kind, wire::<T>(), send.into().input(), out(recv))
}

/// Scatter with per-rank counts (MPI's `Scatterv`); see [`Communicator::scatterv`](crate::Communicator::scatterv).
pub fn scatterv<'a, T: Pod>(
    send: impl Into<Src<'a, T>>,
    send_counts: &[usize],
    send_displs: &[usize],
    recv: &'a mut [T],
    root: usize,
) -> Operation<'a, T> {
    let kind = Kind::ScatterV { root, send_counts: send_counts.to_vec(), send_displs: send_displs.to_vec() };
    Operation::new(kind, wire::<T>(), send.into().input(), out(recv))
}

/// Sends `data` to member `peer`, which receives it with a buffer of the same length. In a
/// [`Group`](crate::Group), `peer` may be this rank itself (see
/// [`Group::add`](crate::Group::add)).
pub fn send<'a, T: Pod>(data: impl Into<Src<'a, T>>, peer: usize) -> Operation<'a, T> {
    Operation::new(Kind::Send { peer }, wire::<T>(), data.into().input(), None)
}

/// Receives into `buf` from member `peer`; the sender's length must equal `buf.len()`.
pub fn recv<T: Pod>(buf: &mut [T], peer: usize) -> Operation<'_, T> {
    Operation::new(Kind::Recv { peer }, wire::<T>(), Input::None, out(buf))
}

/// Sends `data` to member `to` and receives `buf` from member `from` in one operation,
/// which cannot deadlock whatever pattern the members form; see
/// [`Communicator::sendrecv`](crate::Communicator::sendrecv).
pub fn sendrecv<'a, T: Pod>(data: impl Into<Src<'a, T>>, to: usize, buf: &'a mut [T], from: usize) -> Operation<'a, T> {
    Operation::new(Kind::SendRecv { to, from }, wire::<T>(), data.into().input(), out(buf))
}

/// Waits until every member has entered the barrier.
pub fn barrier() -> Operation<'static, u8> {
    Operation::new(Kind::Barrier, Wire::of_type::<u8>(), Input::None, None)
}
