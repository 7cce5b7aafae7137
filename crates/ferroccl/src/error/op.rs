//! [`Op`]: the operation an error is about, as data (which call, on what, its number among
//! the calls every member makes), rendered the same way errors always read.

use std::fmt;

use ferroccl_kernels::{DType, ReduceOp};

use crate::algo::{Algo, Collective};

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
        /// The element type.
        dtype: DType,
        /// The element count (per rank for allgather, reduce_scatter and alltoall; what this
        /// rank sends in all for alltoallv; of the packed buffer for a fused group).
        count: usize,
        /// The reduction, for the calls that reduce.
        reduce: Option<ReduceOp>,
        /// The algorithm that ran it.
        algo: Algo,
        /// How many calls of a group were packed into this one (1: not fused).
        fused: usize,
        /// Its number among the calls every member makes, once started.
        call: Option<u64>,
    },
    /// [`crate::Communicator::barrier`].
    Barrier {
        /// Its number among the calls every member makes, once started.
        call: Option<u64>,
    },
    /// [`crate::Communicator::split`].
    Split {
        /// Its number among the calls every member makes, once started.
        call: Option<u64>,
    },
    /// [`crate::Communicator::send`] of `count` elements of `dtype` to `peer`.
    Send {
        /// The receiver.
        peer: usize,
        /// Elements sent.
        count: usize,
        /// Their type.
        dtype: DType,
    },
    /// [`crate::Communicator::recv`] of `count` elements of `dtype` from `peer`.
    Recv {
        /// The sender.
        peer: usize,
        /// Elements expected.
        count: usize,
        /// Their type.
        dtype: DType,
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
        /// Their type.
        dtype: DType,
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
        /// Their type.
        dtype: DType,
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
        /// Their type.
        dtype: DType,
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
        Op::Collective { coll, dtype, count, reduce: coll.reduces().then_some(op), algo, fused: 1, call: None }
    }

    /// The call's number among the calls every member makes, if it has one.
    pub fn call(&self) -> Option<u64> {
        match self {
            Op::Collective { call, .. } | Op::Barrier { call } | Op::Split { call } => *call,
            _ => None,
        }
    }

    /// This operation with call number `call` (0: none), for the calls that are numbered.
    pub(crate) fn numbered(&self, call: u32) -> Op {
        let mut op = self.clone();
        if call != 0 {
            match &mut op {
                Op::Collective { call: c, .. } | Op::Barrier { call: c } | Op::Split { call: c } => *c = Some(u64::from(call)),
                _ => {}
            }
        }
        op
    }

    /// The element type of a point-to-point call or an alltoallv (sizes in their errors speak
    /// in it).
    pub(crate) fn p2p_dtype(&self) -> Option<DType> {
        match self {
            Op::Send { dtype, .. } | Op::Recv { dtype, .. } | Op::SendRecv { dtype, .. } => Some(*dtype),
            // One whole block per transfer: its length is a count the caller passed.
            Op::Collective { coll: Collective::AllToAllV | Collective::GatherV { .. } | Collective::ScatterV { .. }, dtype, .. } => {
                Some(*dtype)
            }
            _ => None,
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Op::Collective { coll, dtype, count, reduce, algo, fused, .. } => {
                write!(f, "{} ({count} x {dtype}", coll.name())?;
                if let Some(r) = reduce {
                    write!(f, ", {r}")?;
                }
                write!(f, ", {algo})")?;
                if *fused > 1 {
                    write!(f, " fused from {fused} calls")?;
                }
            }
            Op::Barrier { .. } => f.write_str("barrier")?,
            Op::Split { .. } => f.write_str("split")?,
            Op::Send { peer, .. } => write!(f, "send to rank {peer}")?,
            Op::Recv { peer, .. } => write!(f, "recv from rank {peer}")?,
            Op::SendRecv { to, from, .. } => write!(f, "sendrecv (to rank {to}, from rank {from})")?,
            Op::Read { owner, offset, count, dtype } => write!(f, "read of {count} {dtype} at element {offset} of rank {owner}'s window")?,
            Op::Write { owner, offset, count, dtype } => {
                write!(f, "write of {count} {dtype} at element {offset} of rank {owner}'s window")?
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

/// `n` bytes said in elements of `dtype` ("250 f32"), or in bytes where they do not make
/// whole elements.
pub(crate) fn in_elements(n: u64, dtype: Option<DType>) -> String {
    match dtype {
        Some(d) if d.size() > 1 && n.is_multiple_of(d.size() as u64) => format!("{} {d}", n / d.size() as u64),
        Some(d) if d.size() == 1 => format!("{n} {d}"),
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
        assert_eq!(Op::Send { peer: 2, count: 4, dtype: DType::F32 }.numbered(9).to_string(), "send to rank 2");
        assert_eq!(Op::SendRecv { to: 1, from: 2, send: 1, recv: 1, dtype: DType::I32 }.to_string(), "sendrecv (to rank 1, from rank 2)");
        assert_eq!(Op::other("store wait").to_string(), "store wait");
    }

    #[test]
    fn sizes_speak_in_elements_where_they_can() {
        assert_eq!(in_elements(4000, Some(DType::F32)), "1000 f32");
        assert_eq!(in_elements(4002, Some(DType::F32)), "4002 bytes");
        assert_eq!(in_elements(5, Some(DType::U8)), "5 u8");
        assert_eq!(in_elements(8, None), "8 bytes");
    }
}
