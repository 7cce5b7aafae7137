//! FerroCCL: collective communication for Rust.
//!
//! A job of N processes (ranks) builds a [`Communicator`] and moves data between ranks over
//! shared memory (same host), RDMA verbs (cargo feature `verbs`) or TCP. Ranks are normally started by `ferroccl-run` (or
//! torchrun, Slurm, mpirun) and call [`Communicator::init`]; this example builds a one-rank
//! job by hand, so it runs anywhere:
//!
//! ```
//! use ferroccl::bootstrap::{env::StoreRole, new_token, StoreServer};
//! use ferroccl::{Communicator, InitConfig, Params};
//!
//! let token = new_token();
//! let store = StoreServer::start("127.0.0.1:0".parse().unwrap(), &token, 1 << 20)?;
//! let cfg = InitConfig { rank: 0, world_size: 1, store: StoreRole::Connect(store.addr().to_string()), token };
//! let comm = Communicator::init_with(cfg, Params::default())?;
//! assert_eq!((comm.rank(), comm.size()), (0, 1));
//! let mut out = [0u32; 3];
//! comm.sendrecv(&[1u32, 2, 3], 0, &mut out, 0)?; // to and from itself
//! assert_eq!(out, [1, 2, 3]);
//! comm.barrier()?;
//! comm.finalize()?;
//! # Ok::<(), ferroccl::Error>(())
//! ```
//!
//! # Plain-old-data
//!
//! The reductions (allreduce, reduce_scatter, reduce_scatterv, reduce, in every runner) take
//! the [`Element`] types, whose arithmetic they know. The data-movement calls (send, recv,
//! sendrecv, allgather, allgatherv, broadcast, alltoall, alltoallv, gather, scatter,
//! gatherv, scatterv, in every runner: see [`op`], and the one-sided [`Window`] accesses)
//! take any plain-old-data type (`T: bytemuck::Pod`), such as a `#[repr(C)]` struct of
//! routing metadata. An [`Element`] type is described on the wire as always (its
//! [`DType`] and count, compared between ranks); any other type crosses as bytes, and
//! errors name it by its Rust name. A zero-sized type is refused
//! ([`Error::InvalidArgument`]).
//!
//! ```
//! # use ferroccl::bootstrap::{env::StoreRole, new_token, StoreServer};
//! # use ferroccl::{Communicator, InitConfig, Params};
//! # let token = new_token();
//! # let store = StoreServer::start("127.0.0.1:0".parse().unwrap(), &token, 1 << 20)?;
//! # let cfg = InitConfig { rank: 0, world_size: 1, store: StoreRole::Connect(store.addr().to_string()), token };
//! # let comm = Communicator::init_with(cfg, Params::default())?;
//! #[repr(C)]
//! #[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
//! struct Route {
//!     token: u32,
//!     expert: u16,
//!     slot: u16,
//!     gate: f32,
//! }
//!
//! let mine = [Route { token: 7, expert: 3, slot: 0, gate: 0.5 }];
//! let mut all = vec![Route { token: 0, expert: 0, slot: 0, gate: 0.0 }; comm.size()];
//! comm.allgather_into(&mine, &mut all)?;
//! assert_eq!(all[comm.rank()], mine[0]);
//! # Ok::<(), ferroccl::Error>(())
//! ```
//!
//! # Threading
//!
//! A [`Communicator`] is `Send + Sync`; calls on one communicator are serialised. The
//! communicators made by [`Communicator::split`] share the world's connections and may be
//! used from different threads at the same time.
//!
//! # Errors
//!
//! Every call returns [`Result`]; nothing panics on bad input. Blocking calls give up after
//! `FERROCCL_TIMEOUT`; a dead peer is reported within milliseconds as
//! [`Error::PeerFailed`] naming it, and poisons the communicator.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub(crate) mod algo;
pub mod bootstrap;
pub(crate) mod checks;
pub(crate) mod coll;
pub mod comm;
pub(crate) mod engine;
pub mod error;
pub(crate) mod exec;
pub(crate) mod fabric;
pub mod flight;
pub(crate) mod health;
pub(crate) mod inbox;
pub(crate) mod ll;
pub mod logging;
pub(crate) mod mesh;
pub mod moe;
pub mod nonblocking;
pub mod op;
pub(crate) mod p2p;
pub mod params;
pub mod persistent;
pub(crate) mod pod;
pub(crate) mod poll;
pub(crate) mod prepared;
pub(crate) mod proto;
pub(crate) mod registry;
pub mod reshard;
pub(crate) mod rma;
pub(crate) mod shrink;
pub mod tp;
pub mod transfer;
pub(crate) mod transport;
pub(crate) mod transport_kind;
pub mod weights;
pub mod window;
pub(crate) mod wire;

pub use algo::{Algo, Collective};
/// The `bytemuck` FerroCCL is built with (its `Pod` bound is on every typed call), so that
/// a program needs no second copy to pin: `#[derive(ferroccl::bytemuck::Pod,
/// ferroccl::bytemuck::Zeroable)]` with `#[bytemuck(crate = "ferroccl::bytemuck")]` on its
/// own `#[repr(C)]` element types, `ferroccl::bytemuck::cast_slice` on the typed views.
pub use bytemuck;
pub use comm::{Communicator, InitConfig};
pub use error::{Departure, Error, FaultKind, Op, Process, Refusal, Result, RootCause};
/// The `half` crate that FerroCCL's [`f16`](struct@f16) and [`bf16`] come from (the same
/// version), for its other items (e.g. `half::slice::HalfFloatSliceExt`) without a second
/// copy to pin.
pub use ferroccl_kernels::half;
/// IEEE 754 half precision and bfloat16, re-exported from the `half` crate: the element
/// types [`DType::F16`] and [`DType::Bf16`].
pub use ferroccl_kernels::{bf16, f16};
pub use ferroccl_kernels::{DType, Element, ReduceOp};
pub use moe::{Dispatched, Moe, MoeConfig, MoeFloat, MoeHandle, MoeMode, PendingCombine, PendingDispatch};
pub use nonblocking::{Group, Request, Scope};
pub use op::Operation;
pub use params::{FaultSite, FlightDest, InjectedFault, LlChoice, Params, ProtoChoice, TransportChoice};
pub use persistent::Plan;
pub use registry::RegStats;
pub use tp::TensorParallel;
pub use transfer::{Strided, TransferPlan, TransferPlanBuilder};
pub use transport_kind::TransportKind;
pub use weights::{WeightRole, WeightSync};
pub use window::{Access, RemoteHandle, Window};

/// The README's examples, compiled with the doc tests (`no_run`: they need a launcher).
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;
