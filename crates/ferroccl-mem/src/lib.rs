//! FerroCCL's memory boundary: POSIX shared-memory segments, futex doorbells,
//! process watches, cross-process copies and registered-memory views.
//!
//! This crate is where FerroCCL's non-verbs `unsafe` lives, kept small: every
//! `unsafe` block says why it is sound, and everything above it is safe.
//!
//! ```
//! use std::sync::atomic::Ordering;
//! use ferroccl_mem::{with_region, ShmSegment};
//!
//! # fn main() -> std::io::Result<()> {
//! // One rank creates a segment, a peer opens it by name (here: the same process).
//! let name = format!("/ferroccl-doc-{}", std::process::id());
//! let owner = ShmSegment::create(&name, 4096)?;
//! let peer = ShmSegment::open(&name, 4096)?;
//! ShmSegment::unlink(&name)?; // both mappings stay valid
//!
//! owner.write(64, b"payload");
//! owner.atomic_u32(0).store(1, Ordering::Release); // publish
//! assert_eq!(peer.atomic_u32(0).load(Ordering::Acquire), 1);
//! let mut got = [0u8; 7];
//! peer.read(64, &mut got);
//! assert_eq!(&got, b"payload");
//!
//! // Register a buffer so another thread can land data into it.
//! let mut buf = vec![0u8; 7];
//! with_region(&mut buf, |h| {
//!     let h = h.clone();
//!     std::thread::spawn(move || h.write_at(0, &got)).join().unwrap()
//! })
//! .unwrap();
//! assert_eq!(&buf, b"payload");
//! # Ok(())
//! # }
//! ```
//!
//! # Modules
//!
//! - [`segment`]: [`ShmSegment`], named `shm_open` + `mmap(MAP_SHARED)` mappings;
//! - [`futex`]: [`futex_wait`] / [`futex_wake`] doorbells that work across processes;
//! - [`process`]: [`ProcessWatch`] (pidfd exit detection) and
//!   [`read_process_memory`] (`process_vm_readv` single copy);
//! - [`region`]: [`RegionHandle`], registered memory views that transports
//!   write into, with scoped validity ([`with_region`]);
//! - [`net`]: the host's network interfaces and their addresses ([`interface_addrs`]), and
//!   zero-copy socket sends ([`net::zerocopy_enable`], [`net::zerocopy_reap`]).
//!
//! # Platform
//!
//! Linux only for `segment`, `futex` and `process` (pidfds need Linux 5.3 or
//! later); `region` is portable.
#![warn(missing_docs)]

pub mod alloc_count;
#[cfg(target_os = "linux")]
pub mod futex;
#[cfg(target_os = "linux")]
pub mod net;
#[cfg(target_os = "linux")]
pub mod process;
pub mod region;
#[cfg(target_os = "linux")]
pub mod segment;

#[cfg(target_os = "linux")]
pub use futex::{futex_wait, futex_wake, WaitOutcome};
#[cfg(target_os = "linux")]
pub use net::{interface_addrs, InterfaceAddr};
#[cfg(target_os = "linux")]
pub use process::{can_read_process, read_process_memory, wait_any_exited, ProcessWatch};
pub use region::{
    region_scope, region_scope_with, with_region, with_region_ro, RegionError, RegionHandle, RegionLease, RegionScope, Registration,
};
#[cfg(target_os = "linux")]
pub use segment::ShmSegment;
