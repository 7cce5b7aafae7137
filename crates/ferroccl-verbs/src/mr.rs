//! Protection domains and registered memory.

use std::alloc::{self, Layout};
use std::fmt;
use std::io;
use std::ops::{BitOr, BitOrAssign, Range};
use std::ptr::NonNull;
use std::sync::Arc;

use ferroccl_mem::RegionLease;
use rdma_sys as sys;

use crate::device::Context;
use crate::{Error, Result};

/// A protection domain (`ibv_pd`): memory regions and queue pairs of one PD work
/// together. Clones share it; it keeps its [`Context`] alive.
#[derive(Clone)]
pub struct ProtectionDomain {
    pub(crate) inner: Arc<PdInner>,
}

pub(crate) struct PdInner {
    pd: NonNull<sys::ibv_pd>,
    pub(crate) ctx: Context,
}

// SAFETY: verbs on a PD are thread safe; the PD is freed only in `Drop`, when no clone
// and no child (MR, QP: they hold clones) is left.
unsafe impl Send for PdInner {}
// SAFETY: as for `Send`.
unsafe impl Sync for PdInner {}

impl Drop for PdInner {
    fn drop(&mut self) {
        // SAFETY: no MR or QP of this PD is left (each holds a clone of the PD).
        unsafe { sys::ibv_dealloc_pd(self.pd.as_ptr()) };
    }
}

impl fmt::Debug for ProtectionDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProtectionDomain").field("device", &self.inner.ctx.name()).finish_non_exhaustive()
    }
}

impl ProtectionDomain {
    pub(crate) fn new(ctx: &Context) -> Result<Self> {
        // SAFETY: the context is open; the PD is deallocated in `Drop`.
        let raw = unsafe { sys::ibv_alloc_pd(ctx.as_ptr()) };
        let pd = NonNull::new(raw).ok_or_else(|| Error::Verb { verb: "ibv_alloc_pd", source: io::Error::last_os_error() })?;
        Ok(Self { inner: Arc::new(PdInner { pd, ctx: ctx.clone() }) })
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::ibv_pd {
        self.inner.pd.as_ptr()
    }

    /// The device context.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    /// Allocates `len` zeroed, page-aligned bytes and registers them with `access`.
    ///
    /// Local reads are always allowed; ask only for the remote access the use needs.
    pub fn alloc_region(&self, len: usize, access: Access) -> Result<MemoryRegion> {
        if len == 0 {
            return Err(Error::InvalidArgument("a memory region needs at least one byte".into()));
        }
        let layout =
            Layout::from_size_align(len, PAGE).map_err(|_| Error::InvalidArgument(format!("cannot allocate a region of {len} bytes")))?;
        // SAFETY: `layout` has a non-zero size.
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(ptr) else { alloc::handle_alloc_error(layout) };
        // SAFETY: `ptr` is a fresh allocation of `len` bytes that the region owns and
        // frees after deregistering it.
        match unsafe { self.register_inner(ptr, len, access, Some(layout), None) } {
            Ok(mr) => Ok(mr),
            Err(e) => {
                // SAFETY: registration failed, so nothing else refers to the allocation.
                unsafe { alloc::dealloc(ptr.as_ptr(), layout) };
                Err(e)
            }
        }
    }

    /// Registers caller-owned memory: `len` bytes at `addr`.
    ///
    /// # Safety
    ///
    /// The memory must stay allocated (and must not be unmapped or remapped) for as long
    /// as the returned region or any work request using it is alive. With remote access,
    /// a peer may write into it at any time: the caller must not hold Rust references to
    /// it that assume it does not change.
    pub unsafe fn register_raw(&self, addr: NonNull<u8>, len: usize, access: Access) -> Result<MemoryRegion> {
        if len == 0 {
            return Err(Error::InvalidArgument("a memory region needs at least one byte".into()));
        }
        // SAFETY: forwarded from the caller's contract.
        unsafe { self.register_inner(addr, len, access, None, None) }
    }

    /// Registers the bytes of a [`RegionLease`] (a range of a FerroCCL registered region)
    /// and keeps the lease for the memory region's life.
    ///
    /// Safe, because the lease guarantees the allocation part of what
    /// [`register_raw`](Self::register_raw) asks: while it lives the memory stays
    /// allocated (its `with_region` scope cannot end), and the memory region is
    /// deregistered before the lease is released (when its last clone drops). Leases are
    /// only given on writable registrations, so the device writing the bytes never
    /// breaks a shared borrow; a read lease ([`RegionLease::is_writable`] is `false`, as
    /// for a read-only registration) takes only [`Access::empty`] (the device reads the
    /// bytes, as the source of RDMA WRITEs) or [`Access::REMOTE_READ`] (peers' RDMA READs
    /// read them too), and any write right is refused. Keeping the
    /// CPU off the leased bytes while the device may write them is the protocol's part:
    /// see [`RegionLease`].
    pub fn register_lease(&self, lease: RegionLease, access: Access) -> Result<MemoryRegion> {
        if !lease.is_writable() && !Access::REMOTE_READ.contains(access) {
            return Err(Error::InvalidArgument(format!("a read lease can only be registered for reads, not with {access:?}")));
        }
        let (addr, len) = (lease.as_ptr(), lease.len());
        // SAFETY: see above: `lease` keeps the `len` bytes at `addr` allocated and mutably
        // borrowed by its scope, and the region keeps `lease` until after `ibv_dereg_mr`.
        unsafe { self.register_inner(addr, len, access, None, Some(lease)) }
    }

    /// # Safety
    /// `addr..addr+len` is allocated memory that outlives the region; if `owned` is set
    /// the region owns it and frees it with that layout.
    unsafe fn register_inner(
        &self,
        addr: NonNull<u8>,
        len: usize,
        access: Access,
        owned: Option<Layout>,
        lease: Option<RegionLease>,
    ) -> Result<MemoryRegion> {
        let access = access.normalized();
        // SAFETY: the PD is alive; the memory is valid for `len` bytes (caller contract).
        let raw = unsafe { sys::ibv_reg_mr(self.as_ptr(), addr.as_ptr().cast(), len, access.0 as i32) };
        let Some(mr) = NonNull::new(raw) else {
            return Err(reg_mr_error(len, io::Error::last_os_error()));
        };
        // SAFETY: `mr` is a valid MR just returned by `ibv_reg_mr`.
        let (lkey, rkey) = unsafe { ((*mr.as_ptr()).lkey, (*mr.as_ptr()).rkey) };
        Ok(MemoryRegion { inner: Arc::new(MrInner { mr, addr, len, lkey, rkey, access, owned, _lease: lease, _pd: self.clone() }) })
    }
}

impl Context {
    /// Allocates a protection domain.
    pub fn alloc_pd(&self) -> Result<ProtectionDomain> {
        ProtectionDomain::new(self)
    }
}

const PAGE: usize = 4096;

/// Turns a failed `ibv_reg_mr` into an error; ENOMEM under a finite `RLIMIT_MEMLOCK`
/// is almost always that limit (pinned pages count against it), and EPERM is the kernel's
/// answer when the limit is 0 (and the process lacks `CAP_IPC_LOCK`).
fn reg_mr_error(requested: usize, source: io::Error) -> Error {
    use rustix::process::{getrlimit, Resource};
    let code = source.raw_os_error();
    let limited = code == Some(rustix::io::Errno::NOMEM.raw_os_error()) || code == Some(rustix::io::Errno::PERM.raw_os_error());
    match getrlimit(Resource::Memlock).current {
        Some(limit) if limited => Error::MemlockLimit { requested, limit, source },
        _ => Error::Verb { verb: "ibv_reg_mr", source },
    }
}

/// Memory access rights of a [`MemoryRegion`] (and of a queue pair's remote peer).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Access(u32);

impl Access {
    /// The local device may write (receives, RDMA READ targets).
    pub const LOCAL_WRITE: Access = Access(sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0);
    /// Peers may RDMA WRITE into it (implies `LOCAL_WRITE`).
    pub const REMOTE_WRITE: Access = Access(sys::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0);
    /// Peers may RDMA READ from it.
    pub const REMOTE_READ: Access = Access(sys::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0);
    /// Peers may run atomics on it (implies `LOCAL_WRITE`).
    pub const REMOTE_ATOMIC: Access = Access(sys::ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC.0);

    /// No rights beyond local reads (a send or RDMA WRITE source).
    pub const fn empty() -> Access {
        Access(0)
    }

    /// Whether all of `other`'s rights are in `self`.
    pub const fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }

    /// The raw `ibv_access_flags` bits.
    pub const fn bits(self) -> u32 {
        self.0
    }

    /// Remote write and atomics require local write (`ibv_reg_mr(3)`): add it.
    pub(crate) fn normalized(self) -> Access {
        if self.contains(Access::REMOTE_WRITE) || self.contains(Access::REMOTE_ATOMIC) {
            self | Access::LOCAL_WRITE
        } else {
            self
        }
    }
}

impl BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        Access(self.0 | rhs.0)
    }
}

impl BitOrAssign for Access {
    fn bitor_assign(&mut self, rhs: Access) {
        self.0 |= rhs.0;
    }
}

impl fmt::Debug for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = [
            (Access::LOCAL_WRITE, "LOCAL_WRITE"),
            (Access::REMOTE_WRITE, "REMOTE_WRITE"),
            (Access::REMOTE_READ, "REMOTE_READ"),
            (Access::REMOTE_ATOMIC, "REMOTE_ATOMIC"),
        ];
        let set: Vec<&str> = names.iter().filter(|(a, _)| self.contains(*a)).map(|(_, n)| *n).collect();
        write!(f, "Access({})", if set.is_empty() { "local read".to_owned() } else { set.join(" | ") })
    }
}

/// Registered memory (`ibv_mr`). Clones share it; it keeps its protection domain alive.
///
/// The memory may be written by the device (receives, RDMA READ results) and, with
/// remote access, by peers at any time, so the region hands out no references to it:
/// [`read`](Self::read) and [`write`](Self::write) copy, and [`as_ptr`](Self::as_ptr)
/// is there for zero-copy users who follow the completion rules themselves.
#[derive(Clone)]
pub struct MemoryRegion {
    inner: Arc<MrInner>,
}

struct MrInner {
    mr: NonNull<sys::ibv_mr>,
    addr: NonNull<u8>,
    len: usize,
    lkey: u32,
    rkey: u32,
    access: Access,
    owned: Option<Layout>,
    /// The lease on caller memory ([`ProtectionDomain::register_lease`]); released after
    /// `ibv_dereg_mr` (fields drop after `Drop::drop`).
    _lease: Option<RegionLease>,
    _pd: ProtectionDomain,
}

// SAFETY: an MR is an address range plus keys; deregistration is thread safe and only
// happens in `Drop`. The memory itself is only reached through raw pointers.
unsafe impl Send for MrInner {}
// SAFETY: as for `Send`; `read`/`write` copy through raw pointers without references.
unsafe impl Sync for MrInner {}

impl Drop for MrInner {
    fn drop(&mut self) {
        // SAFETY: the last handle is gone; `mr` is deregistered once, then the owned
        // allocation (if any) is freed with the layout it was allocated with.
        unsafe {
            sys::ibv_dereg_mr(self.mr.as_ptr());
            if let Some(layout) = self.owned {
                alloc::dealloc(self.addr.as_ptr(), layout);
            }
        }
    }
}

impl fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &self.inner.addr)
            .field("len", &self.inner.len)
            .field("lkey", &self.inner.lkey)
            .field("rkey", &self.inner.rkey)
            .field("access", &self.inner.access)
            .finish()
    }
}

impl MemoryRegion {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.len
    }

    /// Always `false`: regions are at least one byte.
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// Start of the memory.
    pub fn as_ptr(&self) -> *mut u8 {
        self.inner.addr.as_ptr()
    }

    /// The local key (for this host's work requests).
    pub fn lkey(&self) -> u32 {
        self.inner.lkey
    }

    /// The remote key (for peers' RDMA to this region).
    pub fn rkey(&self) -> u32 {
        self.inner.rkey
    }

    /// The access rights it was registered with.
    pub fn access(&self) -> Access {
        self.inner.access
    }

    fn check(&self, range: &Range<usize>) -> Result<u32> {
        if range.start > range.end || range.end > self.inner.len {
            return Err(Error::InvalidArgument(format!("range {range:?} is outside the {}-byte memory region", self.inner.len)));
        }
        u32::try_from(range.end - range.start)
            .map_err(|_| Error::InvalidArgument(format!("range {range:?} is longer than one work request can move (4 GiB - 1)")))
    }

    /// `range` of this region as the local side of a work request.
    pub fn local(&self, range: Range<usize>) -> Result<LocalSlice> {
        let len = self.check(&range)?;
        Ok(LocalSlice { addr: self.as_ptr() as u64 + range.start as u64, len, lkey: self.inner.lkey })
    }

    /// `range` of this region as a peer's target (send it to the peer).
    pub fn remote(&self, range: Range<usize>) -> Result<RemoteSlice> {
        let len = self.check(&range)?;
        Ok(RemoteSlice { addr: self.as_ptr() as u64 + range.start as u64, len, rkey: self.inner.rkey })
    }

    /// Copies `data` into the region at `offset`.
    ///
    /// # Panics
    ///
    /// If `offset + data.len()` is past the end of the region.
    pub fn write(&self, offset: usize, data: &[u8]) {
        assert!(offset.checked_add(data.len()).is_some_and(|end| end <= self.inner.len), "write past the region's end");
        // SAFETY: the range is inside the live allocation (checked above); raw copies
        // create no references to memory the device may be writing.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.as_ptr().add(offset), data.len()) };
    }

    /// Copies the region's bytes at `offset` into `out`.
    ///
    /// # Panics
    ///
    /// If `offset + out.len()` is past the end of the region.
    pub fn read(&self, offset: usize, out: &mut [u8]) {
        assert!(offset.checked_add(out.len()).is_some_and(|end| end <= self.inner.len), "read past the region's end");
        // SAFETY: as in `write`.
        unsafe { std::ptr::copy_nonoverlapping(self.as_ptr().add(offset), out.as_mut_ptr(), out.len()) };
    }
}

/// The local side of a work request: registered bytes on this host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalSlice {
    /// Start address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u32,
    /// Local key of the region holding it.
    pub lkey: u32,
}

/// A peer's registered bytes, the target of an RDMA WRITE or the source of a READ.
/// Peers exchange these (address, length, remote key) as plain data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteSlice {
    /// Start address in the peer's address space.
    pub addr: u64,
    /// Length in bytes.
    pub len: u32,
    /// Remote key of the region holding it.
    pub rkey: u32,
}

impl RemoteSlice {
    /// The sub-range `offset..offset + len` of this slice.
    pub fn slice(&self, offset: u32, len: u32) -> Result<RemoteSlice> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(RemoteSlice { addr: self.addr + u64::from(offset), len, rkey: self.rkey }),
            _ => {
                Err(Error::InvalidArgument(format!("remote range {offset}..{offset}+{len} is outside the {}-byte remote slice", self.len)))
            }
        }
    }
}
