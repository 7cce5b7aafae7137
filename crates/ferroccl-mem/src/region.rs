//! Registered memory views: the memory that transports land data into and
//! send data from.
//!
//! A [`RegionHandle`] names a byte range that other threads (a TCP reader
//! thread, an shm copy engine) may access while a collective runs. A handle is
//! cheap to clone and to send to another thread; every access goes through a
//! method that checks the registration is still live and that no conflicting
//! access to the same bytes is in progress.
//!
//! ```
//! use ferroccl_mem::region::{with_region, RegionError};
//!
//! let mut buf = vec![0u8; 8];
//! let kept = with_region(&mut buf, |h| {
//!     let h2 = h.clone();
//!     std::thread::spawn(move || h2.write_at(4, b"data")).join().unwrap()?;
//!     Ok::<_, RegionError>(h.clone())
//! })
//! .unwrap();
//! assert_eq!(&buf[4..], b"data");
//! assert_eq!(kept.write_at(0, b"x"), Err(RegionError::Gone));
//! ```
//!
//! # Two kinds of region
//!
//! - [`with_region`] / [`with_region_ro`] register a caller's buffer for the
//!   duration of a closure (a collective's user buffer);
//! - [`RegionHandle::owned`] allocates zeroed memory owned by the handle and
//!   its clones (bounce buffers, staging slots);
//! - [`RegionHandle::in_segment`] views bytes of a shared segment
//!   ([`ShmSegment`]) that the handle and its clones keep mapped (a window
//!   that peers on the same host also map, see below).
//!
//! # Soundness
//!
//! *Validity ends with the scope, not with a handle.* [`with_region`] takes
//! `&mut [u8]` and keeps that borrow for its whole call; the handles only
//! carry a raw pointer. Validity is a flag inside the shared state, checked
//! under a mutex by every access; when the closure returns (or unwinds),
//! `with_region` clears the flag and then waits until no access is in
//! progress. Only then does it return, ending the borrow and giving the buffer
//! back. A clone that outlives the scope (stored somewhere, sent to a thread,
//! or leaked with `mem::forget`, which skips its `Drop`) still points at the
//! shared state, which is kept alive by its `Arc`, and every access through it
//! sees the cleared flag and returns [`RegionError::Gone`] without touching
//! the memory. Nothing depends on a handle's `Drop` running, so leaking cannot
//! extend validity. For owned regions the memory belongs to the shared state
//! itself and is freed only when the last clone is dropped, so it can never be
//! reached after it is freed either.
//!
//! *No aliasing violations.* Each access registers its byte range (and whether
//! it is mutable) in a small range lock before it creates a slice: it waits
//! while an overlapping access that conflicts is active (mutable with
//! anything, or shared with mutable), and disjoint ranges proceed
//! concurrently, so several peers can land data into different parts of one
//! buffer at once. So a `&mut [u8]` handed to [`RegionHandle::with_slice_mut`]
//! never coexists with another reference to any of its bytes. The slice lives
//! only for the closure (the closure is generic over the slice's lifetime, so
//! it cannot escape), and the range is released when the closure returns or
//! unwinds. Read-only registrations borrow `&[u8]`, under which no `&mut` may
//! exist: mutable access through them returns [`RegionError::ReadOnly`].
//!
//! *Segment regions.* The bytes of a region made by
//! [`RegionHandle::in_segment`] are shared with other processes, which may
//! copy into them at any moment (that is their purpose: peers on the host
//! reach a window there without this process). The range lock orders this
//! process's own accesses as for any region; it cannot order other
//! processes'. So the slices handed to the closures of `with_slice` /
//! `with_slice_mut` over such a region are given only to copies of bytes
//! (`u8`, every value valid) and never outlive the closure, the same stance
//! as [`ShmSegment`]'s raw copies: a peer writing the same bytes at the same
//! time (an unordered race in the user's program, which FerroCCL documents as
//! giving unspecified bytes, as RDMA does) changes data, never a Rust
//! invariant of this process.
//!
//! # Blocking and deadlock
//!
//! An access blocks while a conflicting access runs, and ending a registration
//! blocks until in-flight accesses finish, so closures passed to
//! [`with_slice_mut`](RegionHandle::with_slice_mut) /
//! [`with_slice`](RegionHandle::with_slice) must be bounded (e.g. a socket read
//! with a timeout). A thread that asks for a range overlapping one it already
//! holds in a conflicting way gets [`RegionError::Reentrant`] instead of
//! deadlocking itself; two threads each holding a range the other wants still
//! deadlock, which the transports avoid by holding one range at a time.

use std::fmt;
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::ThreadId;

use crate::segment::ShmSegment;

/// Why an access to a region failed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RegionError {
    /// The registration has ended (its [`with_region`] scope returned).
    Gone,
    /// `[offset, offset + len)` does not lie within the region.
    OutOfBounds {
        /// Start of the requested range.
        offset: usize,
        /// Length of the requested range.
        len: usize,
        /// Length of the region.
        region_len: usize,
    },
    /// Mutable access to a read-only registration.
    ReadOnly,
    /// The calling thread already holds an access that overlaps
    /// `[offset, offset + len)` in a conflicting way; waiting would deadlock.
    Reentrant {
        /// Start of the requested range.
        offset: usize,
        /// Length of the requested range.
        len: usize,
    },
}

impl fmt::Display for RegionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RegionError::Gone => f.write_str("memory region is no longer registered"),
            RegionError::OutOfBounds { offset, len, region_len } => {
                write!(f, "range at offset {offset} of {len} bytes is outside the {region_len}-byte memory region")
            }
            RegionError::ReadOnly => f.write_str("memory region is registered read-only"),
            RegionError::Reentrant { offset, len } => {
                write!(f, "this thread already accesses bytes overlapping offset {offset} (+{len}) of the memory region")
            }
        }
    }
}

impl std::error::Error for RegionError {}

/// One in-progress access.
#[derive(Debug)]
struct Active {
    start: usize,
    end: usize,
    mutable: bool,
    thread: ThreadId,
    ticket: u64,
}

#[derive(Debug)]
struct State {
    valid: bool,
    active: Vec<Active>,
    next_ticket: u64,
    /// Live [`RegionLease`]s: the scope's end waits for them as for `active`.
    leases: usize,
    /// Threads blocked on `changed`. A notification costs a system call even with nobody
    /// waiting, so releases notify only when this is non-zero (it is read and changed
    /// under the same mutex the waiters sleep on, so no wake-up is lost).
    waiters: usize,
}

struct Inner {
    id: u64,
    base: NonNull<u8>,
    len: usize,
    writable: bool,
    /// `base`/`len` came from `Box::<[u8]>::into_raw` and are freed on drop.
    owned: bool,
    /// For [`RegionHandle::in_segment`]: the mapping `base` points into, kept
    /// mapped until the last handle is gone.
    backing: Option<Arc<ShmSegment>>,
    state: Mutex<State>,
    changed: Condvar,
}

// SAFETY: `Inner` is shared by handles on several threads. Its only
// non-thread-safe field is the raw pointer `base`; the memory it points to is
// only dereferenced inside `with_slice`/`with_slice_mut`, after the range lock
// (a `Mutex`) has established that the registration is live and that no
// conflicting access exists, so access from any thread is synchronised.
unsafe impl Send for Inner {}
// SAFETY: see `Send` above: all shared-state mutation goes through the
// `Mutex`, and memory access is serialised per byte range by the range lock.
unsafe impl Sync for Inner {}

impl Drop for Inner {
    fn drop(&mut self) {
        if self.owned {
            let raw = std::ptr::slice_from_raw_parts_mut(self.base.as_ptr(), self.len);
            // SAFETY: for owned regions `base`/`len` are exactly the pointer
            // and length that `Box::into_raw` returned in `RegionHandle::owned`,
            // and this is the only place that frees them. `&mut self` means no
            // handle (and so no access) is left.
            drop(unsafe { Box::from_raw(raw) });
        }
    }
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    // The lock is never held across user code, so poisoning can only come
    // from an allocation failure; the state is still consistent then.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A handle on registered memory; cheap to clone, `Send + Sync`.
///
/// See the [module documentation](self) for the validity rules.
#[derive(Clone)]
pub struct RegionHandle {
    inner: Arc<Inner>,
}

impl fmt::Debug for RegionHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegionHandle")
            .field("id", &self.inner.id)
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.inner.len)
            .field("writable", &self.inner.writable)
            .field("owned", &self.inner.owned)
            .field("segment", &self.inner.backing.as_ref().map(|s| s.name()))
            .field("valid", &self.is_valid())
            .finish()
    }
}

/// Releases an access's range when dropped (also on unwind).
struct AccessGuard<'a> {
    inner: &'a Inner,
    ticket: u64,
}

impl Drop for AccessGuard<'_> {
    fn drop(&mut self) {
        let mut st = lock(&self.inner.state);
        if let Some(i) = st.active.iter().position(|a| a.ticket == self.ticket) {
            st.active.swap_remove(i);
        }
        let notify = st.waiters > 0;
        drop(st);
        if notify {
            self.inner.changed.notify_all();
        }
    }
}

/// Ends a scoped registration when dropped (also on unwind): marks it gone
/// and waits for in-progress accesses.
struct EndRegistration<'a>(&'a Inner);

impl Drop for EndRegistration<'_> {
    fn drop(&mut self) {
        let mut st = lock(&self.0.state);
        st.valid = false;
        if st.waiters > 0 {
            self.0.changed.notify_all();
        }
        while !st.active.is_empty() || st.leases > 0 {
            st.waiters += 1;
            st = self.0.changed.wait(st).unwrap_or_else(PoisonError::into_inner);
            st.waiters -= 1;
        }
    }
}

impl RegionHandle {
    fn new(base: NonNull<u8>, len: usize, writable: bool, owned: bool) -> RegionHandle {
        Self::with_validity(base, len, writable, owned, true)
    }

    fn with_validity(base: NonNull<u8>, len: usize, writable: bool, owned: bool, valid: bool) -> RegionHandle {
        Self::build(base, len, writable, owned, valid, None)
    }

    fn build(base: NonNull<u8>, len: usize, writable: bool, owned: bool, valid: bool, backing: Option<Arc<ShmSegment>>) -> RegionHandle {
        RegionHandle {
            inner: Arc::new(Inner {
                id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
                base,
                len,
                writable,
                owned,
                backing,
                state: Mutex::new(State { valid, active: Vec::new(), next_ticket: 0, leases: 0, waiters: 0 }),
                changed: Condvar::new(),
            }),
        }
    }

    /// Allocates `len` zeroed bytes owned by the handle; the memory stays
    /// valid (and [`is_valid`](Self::is_valid) stays `true`) until the last
    /// clone is dropped. `len` may be zero.
    pub fn owned(len: usize) -> RegionHandle {
        let raw: *mut [u8] = Box::into_raw(vec![0u8; len].into_boxed_slice());
        let base = NonNull::new(raw.cast::<u8>()).unwrap_or(NonNull::dangling());
        RegionHandle::new(base, len, true, true)
    }

    /// A writable region over bytes `[offset, offset + len)` of `seg`, which
    /// stays mapped until the last clone is dropped (`None` when the range is
    /// not inside the segment). Other processes that map the same segment may
    /// write these bytes at any time: see the [module documentation](self).
    pub fn in_segment(seg: Arc<ShmSegment>, offset: usize, len: usize) -> Option<RegionHandle> {
        if offset.checked_add(len).is_none_or(|e| e > seg.len()) {
            return None;
        }
        // `wrapping_add` computes the address without dereferencing it; the
        // range was checked to lie inside the live mapping, which `backing`
        // keeps mapped for as long as the region exists.
        let base = NonNull::new(seg.as_ptr().wrapping_add(offset).cast_mut())?;
        Some(RegionHandle::build(base, len, true, false, true, Some(seg)))
    }

    /// Length of the region in bytes.
    pub fn len(&self) -> usize {
        self.inner.len
    }

    /// Whether the region has zero length.
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// Base address of the region in this process (what a remote descriptor
    /// advertises). Meaningful only while the region is valid.
    pub fn addr(&self) -> u64 {
        self.inner.base.as_ptr() as usize as u64
    }

    /// A process-unique id (never reused within the process).
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// Whether the registration is still live. A scoped registration becomes
    /// invalid for good when its [`with_region`] call ends.
    pub fn is_valid(&self) -> bool {
        lock(&self.inner.state).valid
    }

    /// Whether mutable access is refused ([`with_region_ro`]).
    pub fn is_read_only(&self) -> bool {
        !self.inner.writable
    }

    /// Checks and registers an access to `[offset, offset + len)`; `Ok(None)`
    /// for a valid zero-length access (which touches no memory).
    fn acquire(&self, offset: usize, len: usize, mutable: bool) -> Result<Option<AccessGuard<'_>>, RegionError> {
        let inner = &*self.inner;
        let mut st = lock(&inner.state);
        if !st.valid {
            return Err(RegionError::Gone);
        }
        let end = match offset.checked_add(len) {
            Some(end) if end <= inner.len => end,
            _ => return Err(RegionError::OutOfBounds { offset, len, region_len: inner.len }),
        };
        if mutable && !inner.writable {
            return Err(RegionError::ReadOnly);
        }
        if len == 0 {
            return Ok(None);
        }
        let me = std::thread::current().id();
        loop {
            let conflict = st.active.iter().find(|a| a.start < end && offset < a.end && (a.mutable || mutable));
            match conflict {
                None => break,
                Some(a) if a.thread == me => return Err(RegionError::Reentrant { offset, len }),
                Some(_) => {
                    st.waiters += 1;
                    st = inner.changed.wait(st).unwrap_or_else(PoisonError::into_inner);
                    st.waiters -= 1;
                    if !st.valid {
                        return Err(RegionError::Gone);
                    }
                }
            }
        }
        let ticket = st.next_ticket;
        st.next_ticket += 1;
        st.active.push(Active { start: offset, end, mutable, thread: me, ticket });
        Ok(Some(AccessGuard { inner, ticket }))
    }

    /// Runs `f` on a mutable view of `[offset, offset + len)`, e.g. to `recv`
    /// from a socket straight into the region.
    ///
    /// Waits while another thread accesses overlapping bytes. Fails with
    /// [`RegionError::Gone`] once the registration has ended (also if it ends
    /// while waiting), [`RegionError::OutOfBounds`],
    /// [`RegionError::ReadOnly`] on a read-only registration, and
    /// [`RegionError::Reentrant`] if this thread already accesses overlapping
    /// bytes. The registration cannot end while `f` runs.
    pub fn with_slice_mut<R>(&self, offset: usize, len: usize, f: impl FnOnce(&mut [u8]) -> R) -> Result<R, RegionError> {
        let Some(_guard) = self.acquire(offset, len, true)? else {
            return Ok(f(&mut []));
        };
        // SAFETY: `acquire` checked, under the state mutex, that the
        // registration is live (so `base` points to `len` bytes that are
        // borrowed mutably by a running `with_region`, or owned by `inner`,
        // which our `Arc` keeps alive), that `[offset, offset + len)` lies
        // within it, and that it is writable (never a `with_region_ro`
        // buffer). It registered the range as mutably held, so no other
        // access (slice) overlapping it exists or can start until `_guard`
        // drops, and the registration cannot end before that either
        // (`EndRegistration` waits for all active ranges). `f` is generic over
        // the slice lifetime, so the slice cannot outlive this call, and
        // `_guard` is dropped after `f` returns or unwinds.
        let slice = unsafe { std::slice::from_raw_parts_mut(self.inner.base.as_ptr().add(offset), len) };
        Ok(f(slice))
    }

    /// Runs `f` on a shared view of `[offset, offset + len)`.
    ///
    /// Waits while another thread mutably accesses overlapping bytes; errors
    /// as for [`with_slice_mut`](Self::with_slice_mut), except that read-only
    /// registrations are fine.
    pub fn with_slice<R>(&self, offset: usize, len: usize, f: impl FnOnce(&[u8]) -> R) -> Result<R, RegionError> {
        let Some(_guard) = self.acquire(offset, len, false)? else {
            return Ok(f(&[]));
        };
        // SAFETY: `acquire` checked that the registration is live and the
        // range in bounds (see `with_slice_mut`), and registered it as shared:
        // no mutable access overlapping it exists or can start until `_guard`
        // drops, and the registration cannot end before then. The slice
        // cannot escape `f`.
        let slice = unsafe { std::slice::from_raw_parts(self.inner.base.as_ptr().add(offset), len) };
        Ok(f(slice))
    }

    /// Copies `src` into the region at `offset`.
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<(), RegionError> {
        self.with_slice_mut(offset, src.len(), |dst| dst.copy_from_slice(src))
    }

    /// Copies `dst.len()` bytes out of the region, starting at `offset`.
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<(), RegionError> {
        self.with_slice(offset, dst.len(), |src| dst.copy_from_slice(src))
    }
}

/// A lease on a byte range of a region for a device (an RDMA memory registration): while
/// it lives, the region's scope cannot end (a [`with_region`] call waits for every lease
/// to drop before it returns), so the memory stays allocated and borrowed by that call.
///
/// It does not take the range lock: the device writes the bytes behind the CPU's back, and
/// the code around it (a collective's local steps, which view whole buffers) keeps off the
/// leased bytes by construction (a receive's range is not read or written until the
/// receive has completed, when its memory registration, and with it the lease, is gone).
/// The holder must drop the lease (deregistering the device's access first) inside the
/// scope; a leaked lease makes that `with_region` call wait forever, which is a hang,
/// never unsoundness.
pub struct RegionLease {
    inner: Arc<Inner>,
    offset: usize,
    len: usize,
    /// Taken by [`RegionHandle::lease_mut`] (the device may write the bytes), not by
    /// [`RegionHandle::lease`] (it only reads them).
    writable: bool,
}

impl fmt::Debug for RegionLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegionLease").field("region", &self.inner.id).field("offset", &self.offset).field("len", &self.len).finish()
    }
}

impl RegionLease {
    /// Start of the leased bytes in this process; valid for [`len`](Self::len) bytes for
    /// as long as `self` lives.
    pub fn as_ptr(&self) -> NonNull<u8> {
        // SAFETY: `offset + len <= inner.len` and `len > 0` were checked when the lease was
        // taken, so the result lies inside the region's (non-null) allocation.
        unsafe { NonNull::new_unchecked(self.inner.base.as_ptr().add(self.offset)) }
    }

    /// Length of the leased range in bytes (never zero).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always `false`: [`RegionHandle::lease_mut`] refuses empty ranges.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Offset of the leased range in its region.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Whether the device may write the leased bytes ([`RegionHandle::lease_mut`]); a
    /// lease from [`RegionHandle::lease`] is for reading only.
    pub fn is_writable(&self) -> bool {
        self.writable
    }
}

impl Drop for RegionLease {
    fn drop(&mut self) {
        let mut st = lock(&self.inner.state);
        st.leases -= 1;
        let notify = st.waiters > 0;
        drop(st);
        if notify {
            self.inner.changed.notify_all();
        }
    }
}

impl RegionHandle {
    /// Leases `[offset, offset + len)` for a device that will write it (see
    /// [`RegionLease`]). Fails with [`RegionError::Gone`] once the scope has ended,
    /// [`RegionError::ReadOnly`] on a read-only registration, and
    /// [`RegionError::OutOfBounds`] for a range outside the region or an empty one.
    pub fn lease_mut(&self, offset: usize, len: usize) -> Result<RegionLease, RegionError> {
        let mut st = lock(&self.inner.state);
        if !st.valid {
            return Err(RegionError::Gone);
        }
        if len == 0 || offset.checked_add(len).is_none_or(|end| end > self.inner.len) {
            return Err(RegionError::OutOfBounds { offset, len, region_len: self.inner.len });
        }
        if !self.inner.writable {
            return Err(RegionError::ReadOnly);
        }
        st.leases += 1;
        Ok(RegionLease { inner: Arc::clone(&self.inner), offset, len, writable: true })
    }

    /// Leases `[offset, offset + len)` for a device that will only read it (the source of
    /// RDMA WRITEs, or of peers' RDMA READs), on read-only registrations too: [`lease_mut`](Self::lease_mut) without
    /// the write right ([`RegionLease::is_writable`] is `false`). The CPU may go on writing
    /// the bytes through the handle meanwhile; what the device reads then is the holder's
    /// concern, not a memory-safety one.
    pub fn lease(&self, offset: usize, len: usize) -> Result<RegionLease, RegionError> {
        let mut st = lock(&self.inner.state);
        if !st.valid {
            return Err(RegionError::Gone);
        }
        if len == 0 || offset.checked_add(len).is_none_or(|end| end > self.inner.len) {
            return Err(RegionError::OutOfBounds { offset, len, region_len: self.inner.len });
        }
        st.leases += 1;
        Ok(RegionLease { inner: Arc::clone(&self.inner), offset, len, writable: false })
    }
}

/// Registers `buf` for the duration of `f`.
///
/// The handle passed to `f`, and its clones (which may be sent to other
/// threads), can read and write the memory until `f` returns; after that every
/// access through any clone returns [`RegionError::Gone`]. When `f` returns
/// (or unwinds), `with_region` waits until no access is in progress, so the
/// caller gets `buf` back with no thread still touching it.
pub fn with_region<R>(buf: &mut [u8], f: impl FnOnce(&RegionHandle) -> R) -> R {
    let len = buf.len();
    let handle = RegionHandle::new(NonNull::from(buf).cast::<u8>(), len, true, false);
    // Dropped before `handle` (reverse declaration order), on return and on
    // unwind alike; this, not any handle's drop, ends validity.
    let _end = EndRegistration(&handle.inner);
    f(&handle)
}

/// Registers `buf` read-only for the duration of `f` (a send source).
///
/// Same as [`with_region`], except that mutable access
/// ([`write_at`](RegionHandle::write_at),
/// [`with_slice_mut`](RegionHandle::with_slice_mut)) fails with
/// [`RegionError::ReadOnly`].
pub fn with_region_ro<R>(buf: &[u8], f: impl FnOnce(&RegionHandle) -> R) -> R {
    // The pointer is only ever read through (`writable` is false), so deriving
    // it from a shared borrow is fine.
    let handle = RegionHandle::new(NonNull::from(buf).cast::<u8>(), buf.len(), false, false);
    let _end = EndRegistration(&handle.inner);
    f(&handle)
}

/// A scope in which buffers borrowed for the scope's whole life can be registered one by
/// one; every registration made in it ends when [`region_scope`] returns.
///
/// This is [`with_region`] for a number of buffers that is not known up front (one per
/// non-blocking operation): like `std::thread::scope`, the end of the scope, not any
/// handle's `Drop`, ends validity, so leaking a handle cannot extend it.
pub struct RegionScope<'scope, 'env: 'scope> {
    regs: Mutex<Vec<RegionHandle>>,
    _scope: PhantomData<&'scope mut &'scope ()>,
    _env: PhantomData<&'env mut &'env ()>,
}

impl fmt::Debug for RegionScope<'_, '_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.regs.lock().unwrap_or_else(PoisonError::into_inner).len();
        f.debug_struct("RegionScope").field("registrations", &n).finish()
    }
}

/// Ends every registration of a scope (also on unwind).
struct EndScope<'a>(&'a Mutex<Vec<RegionHandle>>);

impl Drop for EndScope<'_> {
    fn drop(&mut self) {
        let regs = std::mem::take(&mut *self.0.lock().unwrap_or_else(PoisonError::into_inner));
        for h in &regs {
            drop(EndRegistration(&h.inner));
        }
    }
}

/// Runs `f` with a [`RegionScope`]; when `f` returns (or unwinds), every registration made
/// through the scope ends, and this waits until no access to any of them is in progress.
///
/// ```
/// use ferroccl_mem::region::region_scope;
///
/// let (mut a, mut b) = (vec![0u8; 4], vec![0u8; 4]);
/// let kept = region_scope(|s| {
///     let ha = s.register(&mut a);
///     let hb = s.register(&mut b);
///     ha.write_at(0, b"abcd").unwrap();
///     hb.write_at(0, b"efgh").unwrap();
///     ha
/// });
/// assert!(!kept.is_valid());
/// assert_eq!((&a[..], &b[..]), (&b"abcd"[..], &b"efgh"[..]));
/// ```
pub fn region_scope<'env, R>(f: impl for<'scope> FnOnce(&'scope RegionScope<'scope, 'env>) -> R) -> R {
    region_scope_with((), |s, ()| f(s))
}

/// [`region_scope`] with a value that lives as long as the scope (dropped after the
/// registrations end), for state that refers to the scope's registrations.
pub fn region_scope_with<'env, T, R>(payload: T, f: impl for<'scope> FnOnce(&'scope RegionScope<'scope, 'env>, &'scope T) -> R) -> R {
    let scope = RegionScope { regs: Mutex::new(Vec::new()), _scope: PhantomData, _env: PhantomData };
    let _end = EndScope(&scope.regs);
    f(&scope, &payload)
}

impl<'scope> RegionScope<'scope, '_> {
    /// Registers `buf` (borrowed until the scope ends) for reading and writing.
    pub fn register(&'scope self, buf: &'scope mut [u8]) -> RegionHandle {
        let len = buf.len();
        let h = RegionHandle::new(NonNull::from(buf).cast::<u8>(), len, true, false);
        self.regs.lock().unwrap_or_else(PoisonError::into_inner).push(h.clone());
        h
    }

    /// Makes a persistent [`Registration`] valid until the scope ends (it stays borrowed
    /// until then); returns its handle. Its validity ends with the scope's other
    /// registrations, after which it can be activated again.
    pub fn activate(&'scope self, reg: &'scope mut Registration<'_>) -> RegionHandle {
        lock(&reg.handle.inner.state).valid = true;
        self.regs.lock().unwrap_or_else(PoisonError::into_inner).push(reg.handle.clone());
        reg.handle.clone()
    }

    /// Registers `buf` (borrowed until the scope ends) read-only.
    pub fn register_ro(&'scope self, buf: &'scope [u8]) -> RegionHandle {
        let h = RegionHandle::new(NonNull::from(buf).cast::<u8>(), buf.len(), false, false);
        self.regs.lock().unwrap_or_else(PoisonError::into_inner).push(h.clone());
        h
    }
}

/// A persistent registration of a borrowed buffer (a persistent plan's): the handle, its id
/// and address stay the same for the registration's life, but it is valid only inside
/// [`Registration::active`], so nothing can reach the memory between activations, and
/// leaking the `Registration` leaves it invalid. Between activations the owner reads and
/// writes the buffer through [`Registration::bytes`] / [`Registration::bytes_mut`].
pub struct Registration<'a> {
    handle: RegionHandle,
    _buf: PhantomData<&'a mut [u8]>,
}

impl fmt::Debug for Registration<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registration").field("handle", &self.handle).finish()
    }
}

impl<'a> Registration<'a> {
    /// Registers `buf` for reading and writing (inactive until [`Registration::active`]).
    pub fn new(buf: &'a mut [u8]) -> Registration<'a> {
        let len = buf.len();
        Registration { handle: RegionHandle::with_validity(NonNull::from(buf).cast::<u8>(), len, true, false, false), _buf: PhantomData }
    }

    /// Registers `buf` read-only (inactive until [`Registration::active`]).
    pub fn new_ro(buf: &'a [u8]) -> Registration<'a> {
        let len = buf.len();
        Registration { handle: RegionHandle::with_validity(NonNull::from(buf).cast::<u8>(), len, false, false, false), _buf: PhantomData }
    }

    /// The handle (invalid outside [`Registration::active`]); its id and address are fixed.
    pub fn handle(&self) -> &RegionHandle {
        &self.handle
    }

    /// Makes the handle valid for the duration of `f`; when `f` returns (or unwinds), ends
    /// validity and waits until no access is in progress.
    pub fn active<R>(&mut self, f: impl FnOnce(&RegionHandle) -> R) -> R {
        lock(&self.handle.inner.state).valid = true;
        let _end = EndRegistration(&self.handle.inner);
        f(&self.handle)
    }

    /// The buffer, read between activations.
    pub fn bytes(&self) -> &[u8] {
        let inner = &*self.handle.inner;
        // SAFETY: `base`/`len` come from a `&'a [u8]` or `&'a mut [u8]` that this
        // registration holds (by `PhantomData`) for `'a`. Outside `active` (which needs
        // `&mut self`, so it cannot run while this borrow of `self` lives) the handle is
        // invalid, so no access through any clone of it can create a slice: this shared
        // view is the only one.
        unsafe { std::slice::from_raw_parts(inner.base.as_ptr(), inner.len) }
    }

    /// The buffer, written between activations; fails on a read-only registration.
    pub fn bytes_mut(&mut self) -> Result<&mut [u8], RegionError> {
        let inner = &*self.handle.inner;
        if !inner.writable {
            return Err(RegionError::ReadOnly);
        }
        // SAFETY: as in `bytes`, and the registration came from a `&'a mut [u8]`
        // (`writable`), which gives exclusive access for `'a`; `&mut self` keeps `active`
        // and `bytes` from running while this slice lives.
        Ok(unsafe { std::slice::from_raw_parts_mut(inner.base.as_ptr(), inner.len) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::mpsc;
    use std::thread;
    use std::time::{Duration, Instant};

    #[test]
    fn handle_is_send_sync_debug() {
        fn check<T: Send + Sync + fmt::Debug + Clone + 'static>() {}
        check::<RegionHandle>();
        let h = RegionHandle::owned(3);
        assert!(format!("{h:?}").contains("len: 3"));
    }

    #[test]
    fn segment_region_views_the_segment_and_keeps_it_mapped() {
        let name = format!("ferroccl-test-region-{}", std::process::id());
        let seg = Arc::new(ShmSegment::create_anonymous(&name, 8192).unwrap());
        assert!(RegionHandle::in_segment(seg.clone(), 4096, 4097).is_none());
        assert!(RegionHandle::in_segment(seg.clone(), usize::MAX, 2).is_none());
        let h = RegionHandle::in_segment(seg.clone(), 4096, 4096).unwrap();
        h.write_at(10, b"abc").unwrap();
        let mut got = [0u8; 3];
        seg.read(4106, &mut got);
        assert_eq!(&got, b"abc");
        seg.write(4096, b"z");
        let mut one = [0u8; 1];
        h.read_at(0, &mut one).unwrap();
        assert_eq!(&one, b"z");
        assert_eq!(h.write_at(4095, b"ab"), Err(RegionError::OutOfBounds { offset: 4095, len: 2, region_len: 4096 }));
        // The region keeps the mapping alive after every other reference is gone.
        drop(seg);
        h.read_at(10, &mut got).unwrap();
        assert_eq!(&got, b"abc");
    }

    #[test]
    fn owned_region_is_zeroed_and_lives_with_its_clones() {
        let h = RegionHandle::owned(1000);
        let mut got = vec![1u8; 1000];
        h.read_at(0, &mut got).unwrap();
        assert!(got.iter().all(|&b| b == 0));
        let h2 = h.clone();
        drop(h);
        h2.write_at(998, &[1, 2]).unwrap();
        let mut two = [0u8; 2];
        h2.read_at(998, &mut two).unwrap();
        assert_eq!(two, [1, 2]);
        assert!(h2.is_valid());
        assert_ne!(h2.id(), RegionHandle::owned(1).id());
    }

    #[test]
    fn concurrent_disjoint_writers_all_land() {
        const THREADS: usize = 8;
        const CHUNK: usize = 4096;
        let mut buf = vec![0u8; THREADS * CHUNK];
        with_region(&mut buf, |h| {
            let started = Arc::new(std::sync::Barrier::new(THREADS));
            let joins: Vec<_> = (0..THREADS)
                .map(|t| {
                    let h = h.clone();
                    let started = Arc::clone(&started);
                    thread::spawn(move || {
                        started.wait();
                        for round in 0..50u8 {
                            // Half the writes in small pieces, half by slice.
                            if round % 2 == 0 {
                                for i in 0..CHUNK / 256 {
                                    let off = t * CHUNK + i * 256;
                                    h.write_at(off, &[t as u8 + round; 256]).unwrap();
                                }
                            } else {
                                h.with_slice_mut(t * CHUNK, CHUNK, |s| s.fill(t as u8 + round)).unwrap();
                            }
                        }
                        h.write_at(t * CHUNK, &vec![t as u8 + 100; CHUNK]).unwrap();
                    })
                })
                .collect();
            for j in joins {
                j.join().unwrap();
            }
        });
        for (t, chunk) in buf.chunks(CHUNK).enumerate() {
            assert!(chunk.iter().all(|&b| b == t as u8 + 100), "chunk {t}");
        }
    }

    #[test]
    fn overlapping_mutable_accesses_exclude_each_other() {
        let h = RegionHandle::owned(512);
        let joins: Vec<_> = (0..4u8)
            .map(|t| {
                let h = h.clone();
                thread::spawn(move || {
                    for _ in 0..20 {
                        // Offsets overlap between threads.
                        let off = usize::from(t) * 64;
                        h.with_slice_mut(off, 256, |s| {
                            s.fill(t);
                            thread::yield_now();
                            assert!(s.iter().all(|&b| b == t), "another writer got in");
                        })
                        .unwrap();
                        h.with_slice(off, 256, |s| {
                            let snapshot = s.to_vec();
                            thread::yield_now();
                            assert_eq!(s, &snapshot[..], "changed under a shared view");
                        })
                        .unwrap();
                    }
                })
            })
            .collect();
        for j in joins {
            j.join().unwrap();
        }
    }

    #[test]
    fn clone_kept_after_scope_is_gone() {
        let mut buf = vec![5u8; 16];
        let (kept, forgotten_id) = with_region(&mut buf, |h| {
            assert!(h.is_valid());
            let forgotten = h.clone();
            let id = forgotten.id();
            // Leaking a clone must not keep the registration alive.
            std::mem::forget(forgotten);
            (h.clone(), id)
        });
        assert_eq!(kept.id(), forgotten_id);
        assert!(!kept.is_valid());
        assert_eq!(kept.write_at(0, &[1]), Err(RegionError::Gone));
        assert_eq!(kept.read_at(0, &mut [0]), Err(RegionError::Gone));
        assert_eq!(kept.with_slice(0, 0, |_| ()), Err(RegionError::Gone));
        assert_eq!(kept.with_slice_mut(0, 16, |_| ()), Err(RegionError::Gone));
        // The buffer is untouched and usable again.
        buf[0] = 9;
        assert!(buf[1..].iter().all(|&b| b == 5));
    }

    #[test]
    fn forgotten_clone_in_another_thread_is_gone_afterwards() {
        let mut buf = vec![0u8; 32];
        let (tx, rx) = mpsc::channel::<RegionHandle>();
        let holder = thread::spawn(move || {
            let h = rx.recv().unwrap();
            let probe = h.clone();
            std::mem::forget(h);
            // Wait until the scope has ended, then try to use it.
            while probe.is_valid() {
                thread::sleep(Duration::from_millis(1));
            }
            probe.write_at(0, &[0xff; 32])
        });
        with_region(&mut buf, |h| {
            tx.send(h.clone()).unwrap();
        });
        assert_eq!(holder.join().unwrap(), Err(RegionError::Gone));
        assert!(buf.iter().all(|&b| b == 0));
    }

    #[test]
    fn scope_end_waits_for_in_progress_access() {
        let mut buf = vec![0u8; 64];
        let (tx, rx) = mpsc::channel();
        let mut returned_from_f = None;
        let writer = with_region(&mut buf, |h| {
            let h2 = h.clone();
            let writer = thread::spawn(move || {
                h2.with_slice_mut(0, 64, |s| {
                    tx.send(()).unwrap();
                    thread::sleep(Duration::from_millis(50));
                    s.fill(9);
                })
            });
            rx.recv().unwrap(); // the writer is inside its access now
            returned_from_f = Some(Instant::now());
            writer
        });
        let waited = returned_from_f.unwrap().elapsed();
        assert!(waited >= Duration::from_millis(40), "did not wait: {waited:?}");
        assert!(buf.iter().all(|&b| b == 9), "the in-flight write finished before return");
        assert_eq!(writer.join().unwrap(), Ok(()));
    }

    #[test]
    fn waiter_on_conflicting_range_gets_gone_when_scope_ends() {
        let mut buf = vec![0u8; 64];
        let (tx, rx) = mpsc::channel();
        let (a, b) = with_region(&mut buf, |h| {
            let ha = h.clone();
            let a = thread::spawn(move || {
                ha.with_slice_mut(0, 32, |s| {
                    tx.send(()).unwrap();
                    thread::sleep(Duration::from_millis(60));
                    s.fill(1);
                })
            });
            rx.recv().unwrap();
            let hb = h.clone();
            let b = thread::spawn(move || hb.with_slice_mut(16, 32, |s| s.fill(2)));
            thread::sleep(Duration::from_millis(20)); // b is (very likely) waiting
            (a, b)
        });
        assert_eq!(a.join().unwrap(), Ok(()));
        assert_eq!(b.join().unwrap(), Err(RegionError::Gone));
        assert!(buf[..32].iter().all(|&x| x == 1));
        assert!(buf[32..].iter().all(|&x| x == 0));
    }

    #[test]
    fn scope_end_on_panic_still_invalidates() {
        let mut buf = vec![0u8; 8];
        let (tx, rx) = mpsc::channel();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            with_region(&mut buf, |h| {
                tx.send(h.clone()).unwrap();
                panic!("boom");
            })
        }));
        assert!(r.is_err());
        let h = rx.recv().unwrap();
        assert_eq!(h.write_at(0, &[1]), Err(RegionError::Gone));
    }

    #[test]
    fn panic_inside_access_releases_the_range() {
        let h = RegionHandle::owned(8);
        let h2 = h.clone();
        let r = thread::spawn(move || h2.with_slice_mut(0, 8, |_| panic!("in access"))).join();
        assert!(r.is_err());
        h.write_at(0, &[3; 8]).unwrap(); // would block forever if the range leaked
    }

    #[test]
    fn out_of_bounds_errors() {
        let h = RegionHandle::owned(10);
        let oob = |offset, len| RegionError::OutOfBounds { offset, len, region_len: 10 };
        assert_eq!(h.write_at(8, &[0; 3]), Err(oob(8, 3)));
        assert_eq!(h.read_at(11, &mut []), Err(oob(11, 0)));
        assert_eq!(h.with_slice(usize::MAX, 2, |_| ()), Err(oob(usize::MAX, 2)));
        assert_eq!(h.with_slice_mut(0, 11, |_| ()), Err(oob(0, 11)));
        assert!(oob(0, 11).to_string().contains("10-byte"));
        // Edges.
        h.write_at(7, &[1; 3]).unwrap();
        h.write_at(10, &[]).unwrap();
    }

    #[test]
    fn zero_length_regions_and_accesses() {
        let mut empty: [u8; 0] = [];
        with_region(&mut empty, |h| {
            assert_eq!(h.len(), 0);
            assert!(h.is_empty());
            h.write_at(0, &[]).unwrap();
            h.read_at(0, &mut []).unwrap();
            assert_eq!(h.with_slice_mut(0, 0, |s| s.len()), Ok(0));
            assert!(matches!(h.write_at(0, &[1]), Err(RegionError::OutOfBounds { .. })));
        });
        let owned = RegionHandle::owned(0);
        assert_eq!(owned.with_slice(0, 0, |s| s.len()), Ok(0));
        // A zero-length access inside a held range does not conflict.
        let h = RegionHandle::owned(4);
        h.with_slice_mut(0, 4, |_| h.with_slice_mut(2, 0, |_| ()).unwrap()).unwrap();
    }

    #[test]
    fn read_only_region_refuses_writes() {
        let buf = vec![1u8, 2, 3, 4];
        with_region_ro(&buf, |h| {
            assert!(h.is_read_only());
            assert_eq!(h.write_at(0, &[9]), Err(RegionError::ReadOnly));
            assert_eq!(h.with_slice_mut(0, 1, |_| ()), Err(RegionError::ReadOnly));
            let mut got = [0u8; 4];
            h.read_at(0, &mut got).unwrap();
            assert_eq!(got, [1, 2, 3, 4]);
            // Shared views may overlap, also on one thread.
            h.with_slice(0, 4, |a| h.with_slice(1, 2, |b| assert_eq!(b, &a[1..3])).unwrap()).unwrap();
        });
        assert_eq!(buf, [1, 2, 3, 4]);
    }

    #[test]
    fn reentrant_conflicting_access_errors_instead_of_deadlocking() {
        let h = RegionHandle::owned(16);
        let r = h.with_slice_mut(0, 8, |_| h.read_at(4, &mut [0; 8])).unwrap();
        assert_eq!(r, Err(RegionError::Reentrant { offset: 4, len: 8 }));
        let r = h.with_slice(0, 8, |_| h.write_at(7, &[0])).unwrap();
        assert_eq!(r, Err(RegionError::Reentrant { offset: 7, len: 1 }));
        // Disjoint nested access is fine.
        h.with_slice_mut(0, 8, |_| h.write_at(8, &[1; 8]).unwrap()).unwrap();
    }

    #[test]
    fn lease_keeps_the_scope_open_without_locking_bytes() {
        let mut buf = vec![0u8; 64];
        let (tx, rx) = mpsc::channel();
        let ended = with_region(&mut buf, |h| {
            let lease = h.lease_mut(16, 16).unwrap();
            assert_eq!(lease.as_ptr().as_ptr() as u64, h.addr() + 16);
            assert_eq!((lease.offset(), lease.len()), (16, 16));
            // No byte-range lock: whole-buffer access still works.
            h.with_slice_mut(0, 64, |s| s[..16].fill(1)).unwrap();
            assert!(matches!(h.lease_mut(0, 0), Err(RegionError::OutOfBounds { .. })));
            assert!(matches!(h.lease_mut(60, 8), Err(RegionError::OutOfBounds { .. })));
            // The scope's end waits for the holder (another thread) to let go.
            let t = thread::spawn(move || {
                rx.recv().unwrap();
                thread::sleep(Duration::from_millis(30));
                // The instant just before the drop: after it, this thread may be
                // descheduled while the scope's owner already returns.
                let before = Instant::now();
                drop(lease);
                before
            });
            tx.send(()).unwrap();
            t
        });
        let returned = Instant::now();
        let released = ended.join().unwrap();
        assert!(returned >= released, "with_region returned before the lease was dropped");
        assert_eq!(&buf[..16], &[1; 16]);
        with_region_ro(&[0u8; 4], |ro| assert_eq!(ro.lease_mut(0, 4).map(|_| ()), Err(RegionError::ReadOnly)));
        with_region_ro(&[0u8; 4], |ro| {
            let l = ro.lease(1, 3).unwrap();
            assert_eq!((l.offset(), l.len(), l.is_writable()), (1, 3, false));
            assert!(matches!(ro.lease(0, 5), Err(RegionError::OutOfBounds { .. })));
        });
        let kept = with_region(&mut buf, |h| h.clone());
        assert_eq!(kept.lease_mut(0, 4).map(|_| ()), Err(RegionError::Gone));
    }

    #[test]
    fn addr_matches_the_buffer() {
        let mut buf = vec![0u8; 4];
        let want = buf.as_ptr() as u64;
        let got = with_region(&mut buf, |h| h.addr());
        assert_eq!(got, want);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Write(usize, Vec<u8>),
        Read(usize, usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0usize..80, proptest::collection::vec(any::<u8>(), 0..24)).prop_map(|(o, b)| Op::Write(o, b)),
            (0usize..80, 0usize..24).prop_map(|(o, l)| Op::Read(o, l)),
        ]
    }

    fn run_against_shadow(h: &RegionHandle, shadow: &mut [u8], ops: &[Op]) {
        let n = shadow.len();
        for op in ops {
            match op {
                Op::Write(o, b) => {
                    let r = h.write_at(*o, b);
                    if o + b.len() <= n {
                        assert_eq!(r, Ok(()));
                        shadow[*o..o + b.len()].copy_from_slice(b);
                    } else {
                        assert_eq!(r, Err(RegionError::OutOfBounds { offset: *o, len: b.len(), region_len: n }));
                    }
                }
                Op::Read(o, l) => {
                    let mut got = vec![0u8; *l];
                    let r = h.read_at(*o, &mut got);
                    if o + l <= n {
                        assert_eq!(r, Ok(()));
                        assert_eq!(&got[..], &shadow[*o..o + l]);
                    } else {
                        assert!(matches!(r, Err(RegionError::OutOfBounds { .. })));
                    }
                }
            }
        }
    }

    proptest! {
        #[test]
        fn random_ops_match_a_shadow_vec(len in 0usize..64, ops in proptest::collection::vec(op(), 0..40)) {
            let mut shadow = vec![0u8; len];
            let mut buf = vec![0u8; len];
            with_region(&mut buf, |h| run_against_shadow(h, &mut shadow, &ops));
            prop_assert_eq!(&buf, &shadow);

            let owned = RegionHandle::owned(len);
            let mut shadow2 = vec![0u8; len];
            run_against_shadow(&owned, &mut shadow2, &ops);
            let mut all = vec![0u8; len];
            owned.read_at(0, &mut all).unwrap();
            prop_assert_eq!(all, shadow2);
        }
    }
}
