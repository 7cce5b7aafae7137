//! [`Op`]: the operation an error is about, as data (which call, on what, its number among
//! the calls every member makes), rendered the same way errors always read.

use std::any::TypeId;
use std::fmt;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};

use ferroccl_kernels::{DType, ReduceOp};

use crate::algo::{Algo, Collective, Counts};

/// The operation an error is about, as data. `Display` gives the words errors use
/// ("allreduce (1000 x f32, sum, ring) call #3", "send to rank 2", "finalize").
///
/// Ranks here are ranks of the communicator the call ran on; `call` is the call's number
/// among the calls every member makes (collectives, barriers, splits), once the call has
/// one (it is assigned when the call starts).
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// A collective call.
    Collective {
        /// Which collective (with its root, for broadcast and reduce).
        coll: Collective,
        /// The element type (`u8` for a [`PodType`]).
        dtype: DType,
        /// The element type when it is a plain-old-data type that is not one of the
        /// [`DType`]s (then `dtype` is `u8`, what the wire carries, and the counts count
        /// elements of this type); `None` for the [`DType`] types.
        pod: Option<PodType>,
        /// The element count (per rank for allgather, reduce_scatter and alltoall; what this
        /// rank sends in all for alltoallv; of the packed buffer for a fused group).
        count: usize,
        /// The reduction, for the calls that reduce.
        reduce: Option<ReduceOp>,
        /// The algorithm that ran it.
        algo: Algo,
        /// How many calls of a group were packed into this one (1: not fused).
        fused: u32,
        /// Its number among the calls every member makes, once started.
        call: Option<u32>,
        /// The caller's name for the call ([`Operation::tag`](crate::op::Operation::tag)).
        tag: Option<Arc<String>>,
    },
    /// [`crate::Communicator::barrier`].
    Barrier {
        /// Its number among the calls every member makes, once started.
        call: Option<u32>,
    },
    /// [`crate::Communicator::split`].
    Split {
        /// Its number among the calls every member makes, once started.
        call: Option<u32>,
    },
    /// [`crate::Communicator::send`] of `count` elements of `dtype` to `peer`.
    Send {
        /// The receiver.
        peer: usize,
        /// Elements sent.
        count: usize,
        /// Their type (`u8` for a [`PodType`]).
        dtype: DType,
        /// The element type when it is a plain-old-data type that is not one of the
        /// [`DType`]s (then `dtype` is `u8`, what the wire carries, and the counts count
        /// elements of this type); `None` for the [`DType`] types.
        pod: Option<PodType>,
    },
    /// [`crate::Communicator::recv`] of `count` elements of `dtype` from `peer`.
    Recv {
        /// The sender.
        peer: usize,
        /// Elements expected.
        count: usize,
        /// Their type (`u8` for a [`PodType`]).
        dtype: DType,
        /// The element type when it is a plain-old-data type that is not one of the
        /// [`DType`]s (then `dtype` is `u8`, what the wire carries, and the counts count
        /// elements of this type); `None` for the [`DType`] types.
        pod: Option<PodType>,
    },
    /// [`crate::Communicator::sendrecv`].
    SendRecv {
        /// The receiver of `send` elements.
        to: usize,
        /// The sender of `recv` elements.
        from: usize,
        /// Elements sent.
        send: usize,
        /// Elements expected.
        recv: usize,
        /// Their type (`u8` for a [`PodType`]).
        dtype: DType,
        /// The element type when it is a plain-old-data type that is not one of the
        /// [`DType`]s (then `dtype` is `u8`, what the wire carries, and the counts count
        /// elements of this type); `None` for the [`DType`] types.
        pod: Option<PodType>,
    },
    /// A one-sided read of `count` elements of `dtype` from rank `owner`'s window, at
    /// element `offset` ([`crate::Communicator::read_into`]).
    Read {
        /// The window's owner (a world rank).
        owner: usize,
        /// Where in the window, in elements.
        offset: u64,
        /// Elements read.
        count: usize,
        /// Their type (`u8` for a [`PodType`]).
        dtype: DType,
        /// The element type when it is a plain-old-data type that is not one of the
        /// [`DType`]s (then `dtype` is `u8`, what the wire carries, and the counts count
        /// elements of this type); `None` for the [`DType`] types.
        pod: Option<PodType>,
    },
    /// A one-sided write of `count` elements of `dtype` into rank `owner`'s window, at
    /// element `offset` ([`crate::Communicator::write_from`]).
    Write {
        /// The window's owner (a world rank).
        owner: usize,
        /// Where in the window, in elements.
        offset: u64,
        /// Elements written.
        count: usize,
        /// Their type (`u8` for a [`PodType`]).
        dtype: DType,
        /// The element type when it is a plain-old-data type that is not one of the
        /// [`DType`]s (then `dtype` is `u8`, what the wire carries, and the counts count
        /// elements of this type); `None` for the [`DType`] types.
        pod: Option<PodType>,
    },
    /// [`crate::Communicator::finalize`].
    Finalize,
    /// Anything else, in words: setting up the communicator, a store request, a step of a
    /// transport ("shm send to rank 3 (its ring stayed full)").
    Other(String),
}

impl Op {
    /// An operation that is not a call of the communicator, in words.
    pub(crate) fn other(what: impl Into<String>) -> Op {
        Op::Other(what.into())
    }

    /// The collective calls' identity, before it has a call number.
    pub(crate) fn collective(coll: Collective, dtype: DType, count: usize, op: ReduceOp, algo: Algo) -> Op {
        Op::Collective { coll, dtype, count, reduce: coll.reduces().then_some(op), algo, fused: 1, call: None, pod: None, tag: None }
    }

    /// This operation with the caller's tag, or none (collectives; others are left as they
    /// are).
    pub(crate) fn tagged(mut self, t: Option<&Arc<String>>) -> Op {
        if let Op::Collective { tag, .. } = &mut self {
            *tag = t.cloned();
        }
        self
    }

    /// This operation on elements of the plain-old-data type `pod` (`None`: a [`DType`]
    /// type, the operation is left as it is): its counts, given in bytes (the wire's `u8`),
    /// become counts of `pod` elements.
    pub(crate) fn with_pod(self, pod: Option<PodType>) -> Op {
        match pod {
            Some(p) => self.in_elements_of(p.size(), None, Some(p)),
            None => self,
        }
    }

    /// A data-movement operation whose counts are given in bytes, on elements of `size`
    /// bytes of the caller's type: counts in its elements, named by `dtype` (the wire's,
    /// `u8` for a [`PodType`]) and `pod`.
    pub(crate) fn per_element(self, size: usize, dtype: DType, pod: Option<PodType>) -> Op {
        self.in_elements_of(size, Some(dtype), pod)
    }

    fn in_elements_of(mut self, size: usize, to: Option<DType>, p: Option<PodType>) -> Op {
        let per = size.max(1);
        let (count, other, dtype, pod) = match &mut self {
            Op::Collective { count, dtype, pod, .. }
            | Op::Send { count, dtype, pod, .. }
            | Op::Recv { count, dtype, pod, .. }
            | Op::Read { count, dtype, pod, .. }
            | Op::Write { count, dtype, pod, .. } => (count, None, dtype, pod),
            Op::SendRecv { send, recv, dtype, pod, .. } => (send, Some(recv), dtype, pod),
            _ => return self,
        };
        *count /= per;
        if let Some(c) = other {
            *c /= per;
        }
        if let Some(d) = to {
            *dtype = d;
        }
        *pod = p;
        self
    }

    /// The call's number among the calls every member makes, if it has one.
    pub fn call(&self) -> Option<u64> {
        match self {
            Op::Collective { call, .. } | Op::Barrier { call } | Op::Split { call } => call.map(u64::from),
            _ => None,
        }
    }

    /// This operation with call number `call` (0: none), for the calls that are numbered.
    pub(crate) fn numbered(&self, call: u32) -> Op {
        let mut op = self.clone();
        if call != 0 {
            match &mut op {
                Op::Collective { call: c, .. } | Op::Barrier { call: c } | Op::Split { call: c } => *c = Some(call),
                _ => {}
            }
        }
        op
    }

    /// The element type of a point-to-point call or an alltoallv, as (size in bytes, name)
    /// (sizes in their errors speak in it).
    pub(crate) fn p2p_elem(&self) -> Option<(usize, &'static str)> {
        let (dtype, pod) = match self {
            Op::Send { dtype, pod, .. } | Op::Recv { dtype, pod, .. } | Op::SendRecv { dtype, pod, .. } => (dtype, pod),
            // One whole block per transfer: its length is a count the caller passed.
            Op::Collective { coll, dtype, pod, .. } if coll.counts() == Counts::PerTransfer => (dtype, pod),
            _ => return None,
        };
        Some(elem_of(*dtype, *pod))
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Op::Collective { coll, dtype, count, reduce, algo, fused, pod, tag, .. } => {
                write!(f, "{} ({count} x {}", coll.name(), elem_of(*dtype, *pod).1)?;
                if let Some(r) = reduce {
                    write!(f, ", {r}")?;
                }
                write!(f, ", {algo})")?;
                if *fused > 1 {
                    write!(f, " fused from {fused} calls")?;
                }
                if let Some(t) = tag {
                    write!(f, " [{t}]")?;
                }
            }
            Op::Barrier { .. } => f.write_str("barrier")?,
            Op::Split { .. } => f.write_str("split")?,
            Op::Send { peer, .. } => write!(f, "send to rank {peer}")?,
            Op::Recv { peer, .. } => write!(f, "recv from rank {peer}")?,
            Op::SendRecv { to, from, .. } => write!(f, "sendrecv (to rank {to}, from rank {from})")?,
            Op::Read { owner, offset, count, dtype, pod } => {
                write!(f, "read of {count} {} at element {offset} of rank {owner}'s window", elem_of(*dtype, *pod).1)?
            }
            Op::Write { owner, offset, count, dtype, pod } => {
                write!(f, "write of {count} {} at element {offset} of rank {owner}'s window", elem_of(*dtype, *pod).1)?
            }
            Op::Finalize => f.write_str("finalize")?,
            Op::Other(s) => f.write_str(s)?,
        }
        match self.call() {
            Some(c) => write!(f, " call #{c}"),
            None => Ok(()),
        }
    }
}

/// A plain-old-data element type that is not one of the [`DType`]s (a `#[repr(C)]` struct
/// moved by a data-movement call), as an [`Op`] names it: it crosses the wire as bytes.
///
/// A small handle (the type's number in this process), so that operations stay as small
/// as they were; [`PodType::name`] and [`PodType::size`] describe the type.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct PodType(NonZeroU32);

/// Every [`PodType`] of this process: its type, Rust name and size, at its number - 1.
static POD_TYPES: Mutex<Vec<(TypeId, &'static str, usize)>> = Mutex::new(Vec::new());

impl PodType {
    /// The handle of the type `id` (named `name`, `size` bytes), numbered at its first use.
    pub(crate) fn of(id: TypeId, name: &'static str, size: usize) -> PodType {
        let mut types = POD_TYPES.lock().unwrap_or_else(|e| e.into_inner());
        let at = match types.iter().position(|(t, _, _)| *t == id) {
            Some(at) => at,
            None => {
                types.push((id, name, size));
                types.len() - 1
            }
        };
        PodType(u32::try_from(at + 1).ok().and_then(NonZeroU32::new).unwrap_or(NonZeroU32::MAX))
    }

    fn get(self) -> (&'static str, usize) {
        let types = POD_TYPES.lock().unwrap_or_else(|e| e.into_inner());
        types.get(self.0.get() as usize - 1).map_or(("?", 1), |&(_, name, size)| (name, size))
    }

    /// Its Rust name (`std::any::type_name`).
    pub fn name(self) -> &'static str {
        self.get().0
    }

    /// Its size in bytes (never 0: zero-sized types are refused).
    pub fn size(self) -> usize {
        self.get().1
    }
}

impl fmt::Debug for PodType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PodType").field("name", &self.name()).field("size", &self.size()).finish()
    }
}

/// The (size, name) of the elements of an operation on `dtype`, or on `pod` where it has one.
fn elem_of(dtype: DType, pod: Option<PodType>) -> (usize, &'static str) {
    match pod {
        Some(p) => (p.size(), p.name()),
        None => (dtype.size(), dtype.name()),
    }
}

/// `n` bytes said in elements of `elem` (size, name: "250 f32"), or in bytes where they do
/// not make whole elements.
pub(crate) fn in_elements(n: u64, elem: Option<(usize, &str)>) -> String {
    match elem {
        Some((size, name)) if size > 1 && n.is_multiple_of(size as u64) => format!("{} {name}", n / size as u64),
        Some((1, name)) => format!("{n} {name}"),
        _ => format!("{n} bytes"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ops_read_as_errors_always_said_them() {
        let ar = Op::collective(Collective::AllReduce, DType::F32, 1000, ReduceOp::Sum, Algo::Ring);
        assert_eq!(ar.to_string(), "allreduce (1000 x f32, sum, ring)");
        assert_eq!(ar.numbered(3).to_string(), "allreduce (1000 x f32, sum, ring) call #3");
        assert_eq!(ar.numbered(3).call(), Some(3));
        assert_eq!(ar.numbered(0), ar);
        let bc = Op::collective(Collective::Broadcast { root: 1 }, DType::U8, 7, ReduceOp::Sum, Algo::Chain);
        assert_eq!(bc.to_string(), "broadcast (7 x u8, chain)");
        assert_eq!(Op::Barrier { call: Some(2) }.to_string(), "barrier call #2");
        assert_eq!(Op::Send { peer: 2, count: 4, dtype: DType::F32, pod: None }.numbered(9).to_string(), "send to rank 2");
        assert_eq!(
            Op::SendRecv { to: 1, from: 2, send: 1, recv: 1, dtype: DType::I32, pod: None }.to_string(),
            "sendrecv (to rank 1, from rank 2)"
        );
        assert_eq!(Op::other("store wait").to_string(), "store wait");
    }

    #[test]
    fn sizes_speak_in_elements_where_they_can() {
        let f32s = Some((4, "f32"));
        assert_eq!(in_elements(4000, f32s), "1000 f32");
        assert_eq!(in_elements(4002, f32s), "4002 bytes");
        assert_eq!(in_elements(5, Some((1, "u8"))), "5 u8");
        assert_eq!(in_elements(8, None), "8 bytes");
        assert_eq!(in_elements(48, Some((16, "m::Route"))), "3 m::Route");
    }

    #[test]
    fn pod_operations_name_their_type() {
        struct Route;
        let route = Some(PodType::of(TypeId::of::<Route>(), "m::Route", 16));
        assert_eq!(route, Some(PodType::of(TypeId::of::<Route>(), "m::Route", 16)), "one number per type");
        assert_eq!(route.map(|p| (p.name(), p.size())), Some(("m::Route", 16)));
        let ag = Op::collective(Collective::AllGather, DType::U8, 160, ReduceOp::Sum, Algo::Ring).with_pod(route);
        assert_eq!(ag.to_string(), "allgather (10 x m::Route, ring)");
        let sr = Op::SendRecv { to: 1, from: 2, send: 32, recv: 48, dtype: DType::U8, pod: None }.with_pod(route);
        assert_eq!(sr.p2p_elem(), Some((16, "m::Route")));
        assert!(matches!(sr, Op::SendRecv { send: 2, recv: 3, .. }));
    }
}
