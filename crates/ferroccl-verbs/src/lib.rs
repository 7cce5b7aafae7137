//! FerroCCL's RDMA verbs layer: safe RAII wrappers over [`rdma-sys`] (libibverbs), and the
//! only FerroCCL crate that touches it.
//!
//! ```no_run
//! # #[cfg(feature = "verbs")]
//! # fn main() -> Result<(), ferroccl_verbs::Error> {
//! use std::time::Duration;
//! use ferroccl_verbs::{Access, Context, QpOptions};
//!
//! // Open the device, allocate a protection domain and a completion queue.
//! let ctx = Context::open("rxe0")?;
//! let pd = ctx.alloc_pd()?;
//! let cq = ctx.create_cq(64)?;
//! // Memory: a send-only source and a target the peer may write into.
//! let src = pd.alloc_region(4096, Access::empty())?;
//! let dst = pd.alloc_region(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
//! src.write(0, b"hello");
//! // Two RC queue pairs connected to each other (on two hosts, exchange `info()`).
//! // On RoCE, `gid_index` picks the port's RoCEv2 GID (the one holding its IPv4 address).
//! let options = QpOptions { gid_index: 1, ..QpOptions::default() };
//! let a = pd.create_rc_qp(&cq, &cq, &options)?;
//! let b = pd.create_rc_qp(&cq, &cq, &options)?;
//! let (ia, ib) = (a.info()?, b.info()?);
//! let a = a.ready_to_receive(&ib)?.ready_to_send()?;
//! let _b = b.ready_to_receive(&ia)?.ready_to_send()?;
//! // SAFETY: `src` and `dst` stay registered and untouched until the completion below.
//! unsafe { a.post_write(7, src.local(0..5)?, dst.remote(0..5)?, true)? };
//! let done = cq.wait(1, Duration::from_secs(5))?;
//! done[0].clone().into_result()?;
//! let mut got = [0u8; 5];
//! dst.read(0, &mut got);
//! assert_eq!(&got, b"hello");
//! # Ok(())
//! # }
//! # #[cfg(not(feature = "verbs"))]
//! # fn main() {}
//! ```
//!
//! # The `verbs` feature
//!
//! Real verbs need the cargo feature `verbs` (off by default), which builds `rdma-sys`
//! and so needs `libibverbs-dev`, `librdmacm-dev`, `libclang-dev` and `pkg-config` at
//! build time. Without it this crate compiles to a stub: [`available`] is `false` and
//! [`check_available`] returns [`Error::FeatureDisabled`], so callers can report a
//! clear error instead of failing to build.
//!
//! # Lifetimes and threads
//!
//! Handles are reference counted and a child keeps its parents alive: a
//! `ProtectionDomain` and a `CompletionQueue` keep their `Context`; a `MemoryRegion`
//! keeps its protection domain; a `QueuePair` keeps its protection domain and both
//! completion queues (these types exist with the `verbs` feature). Every handle is `Send + Sync` (libibverbs is
//! thread safe) and is destroyed when its last clone drops.
//!
//! # DMA and `unsafe`
//!
//! Posting work hands memory to the device, which reads or writes it until the work
//! request's completion is polled; the borrow checker cannot see that. So the `post_*`
//! methods are `unsafe fn`s whose `# Safety` sections state the rule: the memory must
//! stay registered, and must not be touched by the CPU, until the completion is seen.
//! The safe layer above (FerroCCL's transport) owns the buffers until then.
//!
//! [`rdma-sys`]: https://docs.rs/rdma-sys
#![warn(missing_docs)]

mod error;

pub use error::{Error, Result};

#[cfg(feature = "verbs")]
mod cq;
#[cfg(feature = "verbs")]
mod device;
#[cfg(feature = "verbs")]
mod mr;
#[cfg(feature = "verbs")]
mod qp;

#[cfg(feature = "verbs")]
pub use cq::{Completion, CompletionChannel, CompletionQueue, WcOpcode, WcStatus};
#[cfg(feature = "verbs")]
pub use device::{Context, Device, DeviceList, Gid, Mtu, PortAttr, PortState};
#[cfg(feature = "verbs")]
pub use mr::{Access, LocalSlice, MemoryRegion, ProtectionDomain, RemoteSlice};
#[cfg(feature = "verbs")]
pub use qp::{ConnectInfo, Init, QpOptions, QpState, QueuePair, ReadyToReceive, ReadyToSend};

/// Whether this build has verbs support compiled in (the `verbs` cargo feature).
pub const ENABLED: bool = cfg!(feature = "verbs");

/// Whether RDMA verbs can be used here: the `verbs` feature is on and at least one
/// device exists.
pub fn available() -> bool {
    check_available().is_ok()
}

/// `Ok` when verbs can be used here; otherwise the reason: [`Error::FeatureDisabled`],
/// [`Error::NoDevice`], or the error of `ibv_get_device_list`.
pub fn check_available() -> Result<()> {
    #[cfg(feature = "verbs")]
    {
        if DeviceList::new()?.is_empty() {
            return Err(Error::NoDevice);
        }
        Ok(())
    }
    #[cfg(not(feature = "verbs"))]
    {
        Err(Error::FeatureDisabled)
    }
}

#[cfg(all(test, not(feature = "verbs")))]
mod stub_tests {
    #[test]
    fn stub_says_the_feature_is_off() {
        const { assert!(!super::ENABLED) };
        assert!(!super::available());
        assert!(matches!(super::check_available(), Err(super::Error::FeatureDisabled)));
    }
}
