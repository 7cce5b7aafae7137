//! Shared-memory segments: anonymous (`memfd_create`) or named POSIX
//! (`shm_open`) objects, mapped with `mmap(MAP_SHARED)`.
//!
//! A [`ShmSegment`] is one mapping of a shared-memory object. Two kinds:
//!
//! - **Anonymous** (what FerroCCL's shm transport uses): the owner
//!   [`create_anonymous`](ShmSegment::create_anonymous)s a memfd, advertises
//!   its pid, [`fd`](ShmSegment::fd) number and name (through the bootstrap
//!   store), and its peers [`open_from`](ShmSegment::open_from) it through
//!   `/proc/<pid>/fd/<fd>`; once every peer has mapped it the owner
//!   [`withdraw`](ShmSegment::withdraw)s it (closes the fd, so nobody else can
//!   open it). The object has no name in any file system: the kernel frees it
//!   when the last mapping and descriptor are gone, so a process killed at any
//!   moment (even before its peers mapped the segment) leaves nothing behind.
//!   Opening needs the same permission as reading `/proc/<pid>/fd` (same user,
//!   a dumpable process).
//! - **Named**: the owner [`create`](ShmSegment::create)s `/dev/shm/<name>`,
//!   its peers [`open`](ShmSegment::open) it with the length they were told,
//!   and the owner [`unlink`](ShmSegment::unlink)s the name once every peer has
//!   mapped it (mappings stay valid after unlink). A process that dies before
//!   unlinking leaves the file behind.
//!
//! # Concurrency contract and why the API is sound
//!
//! The bytes of a segment are shared with other processes, which may write
//! them at any moment; nothing this process does can stop that. So the
//! segment never hands its bytes out as Rust references (`&[u8]` /
//! `&mut [u8]`), whose no-mutation/no-alias guarantees another process could
//! break. There are exactly two ways in:
//!
//! - [`atomic_u32`](ShmSegment::atomic_u32) / [`atomic_u64`](ShmSegment::atomic_u64)
//!   return references to atomics, which are allowed to be mutated
//!   concurrently by anyone (they are `UnsafeCell`s inside);
//! - [`write`](ShmSegment::write) / [`read`](ShmSegment::read) *copy* a byte
//!   range between the mapping and an ordinary Rust buffer
//!   (`ptr::copy_nonoverlapping` on the raw mapping).
//!
//! Callers (the shm transport) must order the byte copies with acquire/release
//! operations on atomics in the segment, e.g. a ring whose producer writes a
//! slot and then publishes it with a `Release` store of the head, and whose
//! consumer `Acquire`-loads the head before reading the slot and then hands
//! the slot back with a `Release` store of the tail. A copy that races with a
//! write to the same bytes (a protocol bug in this process or a misbehaving
//! peer) yields unspecified byte values in the destination buffer; `u8` has
//! no invalid values and no reference to the shared bytes ever exists, so the
//! damage stays in the data and never becomes a broken Rust invariant in
//! this process. This is the same stance every shared-memory transport has
//! to take; it is the reason the copies are the only byte-level access.

use std::fmt;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::sync::Mutex;

use rustix::fs::{MemfdFlags, Mode, OFlags};
use rustix::mm::{MapFlags, ProtFlags};
use rustix::shm;

/// A mapping of a named POSIX shared-memory object.
///
/// Dropping the segment unmaps it; it never unlinks the name (see
/// [`ShmSegment::unlink`]). See the [module documentation](self) for the
/// concurrency contract.
pub struct ShmSegment {
    name: String,
    base: NonNull<u8>,
    len: usize,
    /// An anonymous segment's own descriptor, kept open (so that peers can
    /// open it through `/proc`) until [`ShmSegment::withdraw`].
    handle: Mutex<Option<OwnedFd>>,
}

// SAFETY: `ShmSegment` owns its mapping (a raw pointer that is only
// dereferenced through atomics or raw byte copies, see the module docs); the
// mapping is process-wide memory, not tied to the thread that created it, so
// moving the owner to another thread is fine.
unsafe impl Send for ShmSegment {}
// SAFETY: every `&self` access to the mapping is either through an atomic
// (`AtomicU32`/`AtomicU64`, which are `Sync`) or a raw copy whose ordering the
// caller establishes with those atomics; no `&self` method hands out a plain
// reference to the shared bytes, so sharing `&ShmSegment` between threads adds
// nothing that another process could not already do to the same memory.
unsafe impl Sync for ShmSegment {}

impl fmt::Debug for ShmSegment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShmSegment")
            .field("name", &self.name)
            .field("len", &self.len)
            .field("addr", &self.base)
            .field("fd", &self.fd())
            .finish()
    }
}

fn seg_err(name: &str, kind: io::ErrorKind, what: impl fmt::Display) -> io::Error {
    io::Error::new(kind, format!("shm segment {name}: {what}"))
}

fn seg_os_err(name: &str, op: &str, e: rustix::io::Errno) -> io::Error {
    let e = io::Error::from(e);
    seg_err(name, e.kind(), format_args!("{op}: {e}"))
}

/// Checks the portable POSIX shm name form: a leading `/`, no other `/`,
/// 2..=255 bytes, no NUL.
fn check_name(name: &str) -> io::Result<()> {
    let ok = name.len() >= 2 && name.len() <= 255 && name.starts_with('/') && !name[1..].contains('/') && !name.contains('\0');
    if ok {
        Ok(())
    } else {
        Err(seg_err(name, io::ErrorKind::InvalidInput, "invalid name (must be \"/\" followed by 1 to 254 bytes without '/' or NUL)"))
    }
}

/// Checks an anonymous segment's name: 1 to 200 bytes, no `/` or NUL (so that
/// the `/memfd:<name> (deleted)` link text is unambiguous).
fn check_anon_name(name: &str) -> io::Result<()> {
    let ok = !name.is_empty() && name.len() <= 200 && !name.contains('/') && !name.contains('\0');
    if ok {
        Ok(())
    } else {
        Err(seg_err(name, io::ErrorKind::InvalidInput, "invalid anonymous segment name (1 to 200 bytes without '/' or NUL)"))
    }
}

impl ShmSegment {
    /// Creates a new shared-memory object `name` of `len` bytes (zero-filled)
    /// and maps it read-write.
    ///
    /// The object is created with `O_CREAT | O_EXCL | O_RDWR` and mode `0o600`
    /// (owner only), so creating an existing name fails with
    /// [`io::ErrorKind::AlreadyExists`]. `name` must look like
    /// `"/ferroccl-<...>"`: a leading `/` and no other `/`. `len` must be
    /// non-zero. If sizing or mapping fails after the object was created, the
    /// name is unlinked again before the error is returned.
    ///
    /// Every error message names the segment.
    pub fn create(name: &str, len: usize) -> io::Result<ShmSegment> {
        check_name(name)?;
        if len == 0 {
            return Err(seg_err(name, io::ErrorKind::InvalidInput, "length must be non-zero"));
        }
        let fd = shm::open(name, shm::OFlags::CREATE | shm::OFlags::EXCL | shm::OFlags::RDWR, Mode::from_raw_mode(0o600))
            .map_err(|e| seg_os_err(name, "shm_open(O_CREAT|O_EXCL)", e))?;
        let sized = u64::try_from(len)
            .map_err(|_| seg_err(name, io::ErrorKind::InvalidInput, "length too large"))
            .and_then(|l| rustix::fs::ftruncate(&fd, l).map_err(|e| seg_os_err(name, "ftruncate", e)))
            .and_then(|()| Self::map(name, &fd, len));
        match sized {
            Ok(seg) => Ok(seg),
            Err(e) => {
                // Best effort: the object is ours (O_EXCL), do not leave it behind.
                let _ = shm::unlink(name);
                Err(e)
            }
        }
    }

    /// Opens and maps an existing shared-memory object `name`, which must be
    /// exactly `expected_len` bytes long.
    ///
    /// A size mismatch (including an object whose creator has not sized it
    /// yet) fails with [`io::ErrorKind::InvalidData`], a missing name with
    /// [`io::ErrorKind::NotFound`]. Every error message names the segment.
    pub fn open(name: &str, expected_len: usize) -> io::Result<ShmSegment> {
        check_name(name)?;
        let fd = shm::open(name, shm::OFlags::RDWR, Mode::empty()).map_err(|e| seg_os_err(name, "shm_open", e))?;
        let st = rustix::fs::fstat(&fd).map_err(|e| seg_os_err(name, "fstat", e))?;
        let actual = u64::try_from(st.st_size).unwrap_or(0);
        if usize::try_from(actual).ok() != Some(expected_len) || expected_len == 0 {
            return Err(seg_err(name, io::ErrorKind::InvalidData, format_args!("size is {actual} bytes, expected {expected_len}")));
        }
        Self::map(name, &fd, expected_len)
    }

    /// Creates an anonymous shared-memory object (`memfd_create`) of `len`
    /// bytes (zero-filled), maps it read-write and keeps its descriptor open
    /// for peers to [`open_from`](Self::open_from) until
    /// [`withdraw`](Self::withdraw).
    ///
    /// `name` (1 to 200 bytes, no `/` or NUL) is what `/proc/<pid>/fd/<fd>`
    /// shows (`/memfd:<name> (deleted)`); make it unique (e.g. with a random
    /// part) so that a peer can tell this object from any other. Nothing is
    /// created in a file system: the kernel frees the memory when the last
    /// mapping and descriptor are gone, whatever happens to this process.
    pub fn create_anonymous(name: &str, len: usize) -> io::Result<ShmSegment> {
        check_anon_name(name)?;
        if len == 0 {
            return Err(seg_err(name, io::ErrorKind::InvalidInput, "length must be non-zero"));
        }
        let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC).map_err(|e| seg_os_err(name, "memfd_create", e))?;
        let l = u64::try_from(len).map_err(|_| seg_err(name, io::ErrorKind::InvalidInput, "length too large"))?;
        rustix::fs::ftruncate(&fd, l).map_err(|e| seg_os_err(name, "ftruncate", e))?;
        let seg = Self::map(name, &fd, len)?;
        *seg.handle.lock().unwrap_or_else(|p| p.into_inner()) = Some(fd);
        Ok(seg)
    }

    /// Opens and maps the anonymous segment `name` that process `pid` holds
    /// as descriptor `fd` (see [`create_anonymous`](Self::create_anonymous)),
    /// which must be exactly `expected_len` bytes long.
    ///
    /// The object opened must be a memfd called `name` (checked on the
    /// descriptor actually opened, so a reused pid or descriptor number is
    /// refused with [`io::ErrorKind::InvalidData`], never mapped); a process or
    /// descriptor that no longer exists (its owner withdrew it or died) fails
    /// with [`io::ErrorKind::NotFound`], a process this one may not inspect
    /// with [`io::ErrorKind::PermissionDenied`]. Every error message names
    /// the segment and the path.
    pub fn open_from(pid: i32, fd: i32, name: &str, expected_len: usize) -> io::Result<ShmSegment> {
        check_anon_name(name)?;
        let path = format!("/proc/{pid}/fd/{fd}");
        let label = |what: &str| format!("{path} ({what})");
        let want = format!("/memfd:{name} (deleted)");
        // A first look before opening, so that a reused descriptor number (a
        // socket, a device) is not even opened.
        let before = std::fs::read_link(&path).map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => {
                seg_err(name, e.kind(), format_args!("{path} does not exist (the process or its descriptor is gone)"))
            }
            _ => seg_err(name, e.kind(), label(&format!("readlink: {e}"))),
        })?;
        if before.as_os_str() != want.as_str() {
            return Err(seg_err(
                name,
                io::ErrorKind::InvalidData,
                label(&format!("is {}, not this segment (the process or descriptor was reused)", before.display())),
            ));
        }
        let file = rustix::fs::open(&path, OFlags::RDWR | OFlags::CLOEXEC | OFlags::NONBLOCK, Mode::empty()).map_err(|e| {
            // The process (or its descriptor) went away between the look and the open:
            // the same news as above, in the same words.
            if e == rustix::io::Errno::NOENT {
                seg_err(name, io::ErrorKind::NotFound, format_args!("{path} does not exist (the process or its descriptor is gone)"))
            } else {
                seg_os_err(name, &label("open"), e)
            }
        })?;
        // The decisive check, on the descriptor we hold: nothing can swap it now.
        let mine = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()))
            .map_err(|e| seg_err(name, e.kind(), label(&format!("readlink of the opened descriptor: {e}"))))?;
        if mine.as_os_str() != want.as_str() {
            return Err(seg_err(name, io::ErrorKind::InvalidData, label(&format!("opened {}, not this segment", mine.display()))));
        }
        let st = rustix::fs::fstat(&file).map_err(|e| seg_os_err(name, "fstat", e))?;
        let actual = u64::try_from(st.st_size).unwrap_or(0);
        if usize::try_from(actual).ok() != Some(expected_len) || expected_len == 0 {
            return Err(seg_err(name, io::ErrorKind::InvalidData, format_args!("size is {actual} bytes, expected {expected_len}")));
        }
        Self::map(name, &file, expected_len)
    }

    /// The descriptor number under which process `pid` holds the anonymous
    /// segment `name` (see [`create_anonymous`](Self::create_anonymous)), found
    /// by looking through `/proc/<pid>/fd`; then
    /// [`open_from`](Self::open_from) maps it (and checks it again, on the
    /// descriptor it opens). For a peer that was given a segment's name but not
    /// its descriptor: costs one `readlink` per descriptor of `pid`. Fails with
    /// [`io::ErrorKind::NotFound`] when `pid` holds no such segment (never
    /// made, withdrawn, or the process is gone), and
    /// [`io::ErrorKind::PermissionDenied`] for a process this one may not
    /// inspect.
    pub fn find_anonymous(pid: i32, name: &str) -> io::Result<i32> {
        check_anon_name(name)?;
        let dir = format!("/proc/{pid}/fd");
        let want = format!("/memfd:{name} (deleted)");
        let entries = std::fs::read_dir(&dir).map_err(|e| seg_err(name, e.kind(), format_args!("{dir}: {e}")))?;
        for entry in entries {
            let Ok(entry) = entry else { continue };
            // A descriptor closed while we look is simply not the one.
            let Ok(target) = std::fs::read_link(entry.path()) else { continue };
            if target.as_os_str() == want.as_str() {
                if let Some(fd) = entry.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) {
                    return Ok(fd);
                }
            }
        }
        Err(seg_err(name, io::ErrorKind::NotFound, format_args!("process {pid} holds no such segment")))
    }

    /// [`find_anonymous`](Self::find_anonymous) then [`open_from`](Self::open_from),
    /// looked up again (up to 20 times, 200 us apart) when the open fails: threads of one
    /// process that map the same segment each hold a short-lived descriptor of it, which
    /// a lookup may find and which may close before the open. `retry_missing`: also look
    /// again when nothing is found (else that fails at once).
    pub fn open_anonymous(pid: i32, name: &str, expected_len: usize, retry_missing: bool) -> io::Result<ShmSegment> {
        const TRIES: u32 = 20;
        let mut tries = 1;
        loop {
            let r = match Self::find_anonymous(pid, name) {
                Ok(fd) => Self::open_from(pid, fd, name, expected_len),
                Err(e) if !retry_missing => return Err(e),
                Err(e) => Err(e),
            };
            match r {
                Err(_) if tries < TRIES => {
                    tries += 1;
                    std::thread::sleep(std::time::Duration::from_micros(200));
                }
                r => return r,
            }
        }
    }

    /// The descriptor number peers open an anonymous segment through (`None`
    /// for named segments, segments opened from a peer, and after
    /// [`withdraw`](Self::withdraw)).
    pub fn fd(&self) -> Option<i32> {
        self.handle.lock().unwrap_or_else(|p| p.into_inner()).as_ref().map(|f| f.as_raw_fd())
    }

    /// Stops peers from opening this anonymous segment (closes its
    /// descriptor; the mappings stay valid). Idempotent; a no-op for named
    /// segments (see [`unlink`](Self::unlink)).
    pub fn withdraw(&self) {
        drop(self.handle.lock().unwrap_or_else(|p| p.into_inner()).take());
    }

    fn map(name: &str, fd: &OwnedFd, len: usize) -> io::Result<ShmSegment> {
        // SAFETY: we ask for a fresh mapping (null hint, no MAP_FIXED), so no
        // existing memory of this process is replaced; `len` is non-zero and
        // the object is at least `len` bytes long (we sized it, or checked
        // its size). The returned memory is only ever accessed through
        // atomics and raw copies (see the module docs), never through Rust
        // references to the bytes, so the fact that other processes mutate it
        // cannot break a reference invariant.
        let ptr = unsafe { rustix::mm::mmap(std::ptr::null_mut(), len, ProtFlags::READ | ProtFlags::WRITE, MapFlags::SHARED, fd, 0) }
            .map_err(|e| seg_os_err(name, "mmap", e))?;
        let base = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| seg_err(name, io::ErrorKind::Other, "mmap returned null"))?;
        // The fd can be closed now: the mapping keeps the object alive.
        Ok(ShmSegment { name: name.to_owned(), base, len, handle: Mutex::new(None) })
    }

    /// Removes the name `name`. Existing mappings (in this and other
    /// processes) stay valid; later [`open`](Self::open)s of the name fail.
    pub fn unlink(name: &str) -> io::Result<()> {
        check_name(name)?;
        shm::unlink(name).map_err(|e| seg_os_err(name, "shm_unlink", e))
    }

    /// The name this segment was created or opened with.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The length of the mapping in bytes (never zero).
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always `false`: segments have a non-zero length.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address of the mapping in this process.
    pub fn as_ptr(&self) -> *const u8 {
        self.base.as_ptr()
    }

    /// Panics unless `[offset, offset + size)` lies in the segment and
    /// `offset` is a multiple of `align`.
    #[inline]
    fn check_range(&self, offset: usize, size: usize, align: usize, what: &str) {
        let end = offset.checked_add(size);
        assert!(
            end.is_some_and(|e| e <= self.len) && offset.is_multiple_of(align),
            "shm segment {}: {what} at offset {offset} (size {size}, align {align}) \
             outside the {}-byte segment or misaligned",
            self.name,
            self.len,
        );
    }

    /// The `AtomicU32` at byte `offset` of the segment.
    ///
    /// # Panics
    ///
    /// If `offset` is not a multiple of 4 or `offset + 4 > len()`. Offsets
    /// come from the transport's own layout, so a bad one is a FerroCCL bug,
    /// not a runtime condition.
    #[inline]
    pub fn atomic_u32(&self, offset: usize) -> &AtomicU32 {
        self.check_range(offset, 4, 4, "atomic_u32");
        // SAFETY: `offset + 4 <= len`, so the 4 bytes lie inside our mapping,
        // which stays mapped for as long as `&self` lives (it is unmapped only
        // in `Drop`). The mapping is page-aligned and `offset % 4 == 0`, so the
        // pointer is aligned for `AtomicU32`. Any bit pattern is a valid
        // `u32`, and an atomic may be mutated concurrently by other threads or
        // processes: that is what its interior mutability allows.
        unsafe { &*self.base.as_ptr().add(offset).cast::<AtomicU32>() }
    }

    /// The `AtomicU64` at byte `offset` of the segment.
    ///
    /// # Panics
    ///
    /// If `offset` is not a multiple of 8 or `offset + 8 > len()` (a FerroCCL
    /// bug, as for [`atomic_u32`](Self::atomic_u32)).
    #[inline]
    pub fn atomic_u64(&self, offset: usize) -> &AtomicU64 {
        self.check_range(offset, 8, 8, "atomic_u64");
        // SAFETY: as in `atomic_u32`: in bounds of a mapping that outlives
        // `&self`, 8-byte aligned (page-aligned base, `offset % 8 == 0`), any
        // bit pattern is a valid `u64`, and atomics tolerate concurrent
        // mutation.
        unsafe { &*self.base.as_ptr().add(offset).cast::<AtomicU64>() }
    }

    /// Copies `src` into the segment at `offset`.
    ///
    /// The copy must be ordered against other accesses to the same bytes by
    /// atomics in the segment (see the [module docs](self)).
    ///
    /// # Panics
    ///
    /// If `offset + src.len() > len()` (a FerroCCL bug).
    #[inline]
    pub fn write(&self, offset: usize, src: &[u8]) {
        self.check_range(offset, src.len(), 1, "write");
        // SAFETY: the destination range is inside our live mapping (checked
        // above; the mapping lives as long as `&self`), which is writable
        // (PROT_WRITE). `src` is an ordinary Rust slice and cannot overlap the
        // mapping, since no Rust reference into the mapping is ever created.
        // Concurrent access to the same bytes is excluded by the caller's
        // atomic protocol (module docs); a violation only yields unspecified
        // bytes, never a reference to them.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.base.as_ptr().add(offset), src.len());
        }
    }

    /// Copies `dst.len()` bytes out of the segment, starting at `offset`.
    ///
    /// The copy must be ordered against writes to the same bytes by atomics
    /// in the segment (see the [module docs](self)).
    ///
    /// # Panics
    ///
    /// If `offset + dst.len() > len()` (a FerroCCL bug).
    #[inline]
    pub fn read(&self, offset: usize, dst: &mut [u8]) {
        self.check_range(offset, dst.len(), 1, "read");
        // SAFETY: the source range is inside our live, readable mapping
        // (checked above). `dst` is an exclusive Rust slice, which cannot
        // overlap the mapping because no Rust reference into the mapping ever
        // exists. Any byte value is a valid `u8`.
        unsafe {
            std::ptr::copy_nonoverlapping(self.base.as_ptr().add(offset), dst.as_mut_ptr(), dst.len());
        }
    }
}

impl Drop for ShmSegment {
    fn drop(&mut self) {
        // SAFETY: `base`/`len` describe exactly the mapping made in `map`,
        // which nothing else unmaps. `&mut self` proves no `&AtomicU32`/
        // `&AtomicU64` borrowed from this segment is still alive, and no other
        // reference into the mapping exists, so nothing can touch it after
        // this call.
        let r = unsafe { rustix::mm::munmap(self.base.as_ptr().cast(), self.len) };
        debug_assert!(r.is_ok(), "munmap of shm segment {} failed: {r:?}", self.name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A unique name per test, removed again when the guard drops.
    struct Name(String);
    impl Name {
        fn new(tag: &str) -> Name {
            static N: AtomicUsize = AtomicUsize::new(0);
            let n = N.fetch_add(1, Ordering::Relaxed);
            Name(format!("/ferroccl-test-{}-{n}-{tag}", std::process::id()))
        }
    }
    impl Drop for Name {
        fn drop(&mut self) {
            let _ = ShmSegment::unlink(&self.0);
        }
    }

    #[test]
    fn create_and_open_share_memory() {
        let name = Name::new("share");
        let a = ShmSegment::create(&name.0, 8192).unwrap();
        let b = ShmSegment::open(&name.0, 8192).unwrap();
        assert_ne!(a.as_ptr(), b.as_ptr(), "two distinct mappings");
        assert_eq!(a.len(), 8192);
        assert_eq!(b.name(), name.0);

        // Zero-filled.
        let mut buf = [0xffu8; 16];
        b.read(4096, &mut buf);
        assert_eq!(buf, [0u8; 16]);

        a.write(5000, b"hello, peer");
        let mut got = [0u8; 11];
        b.read(5000, &mut got);
        assert_eq!(&got, b"hello, peer");

        a.atomic_u32(0).store(0xdead_beef, Ordering::Release);
        assert_eq!(b.atomic_u32(0).load(Ordering::Acquire), 0xdead_beef);
        b.atomic_u64(8).fetch_add(41, Ordering::AcqRel);
        a.atomic_u64(8).fetch_add(1, Ordering::AcqRel);
        assert_eq!(b.atomic_u64(8).load(Ordering::Acquire), 42);
        // The atomic and the byte view agree (little-endian layout).
        let mut raw = [0u8; 8];
        a.read(8, &mut raw);
        assert_eq!(u64::from_ne_bytes(raw), 42);
    }

    #[test]
    fn open_with_wrong_size_fails() {
        let name = Name::new("size");
        let _a = ShmSegment::create(&name.0, 4096).unwrap();
        let e = ShmSegment::open(&name.0, 8192).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        let msg = e.to_string();
        assert!(msg.contains(&name.0) && msg.contains("4096"), "{msg}");
    }

    #[test]
    fn create_twice_fails() {
        let name = Name::new("excl");
        let _a = ShmSegment::create(&name.0, 4096).unwrap();
        let e = ShmSegment::create(&name.0, 4096).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists);
        assert!(e.to_string().contains(&name.0));
    }

    #[test]
    fn unlink_then_open_fails_but_mapping_survives() {
        let name = Name::new("unlink");
        let a = ShmSegment::create(&name.0, 4096).unwrap();
        let b = ShmSegment::open(&name.0, 4096).unwrap();
        ShmSegment::unlink(&name.0).unwrap();
        let e = ShmSegment::open(&name.0, 4096).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
        assert!(e.to_string().contains(&name.0));
        // Existing mappings still work and still share memory.
        a.write(100, &[7, 8, 9]);
        let mut got = [0u8; 3];
        b.read(100, &mut got);
        assert_eq!(got, [7, 8, 9]);
        // Unlinking twice reports NotFound.
        assert_eq!(ShmSegment::unlink(&name.0).unwrap_err().kind(), io::ErrorKind::NotFound);
    }

    #[test]
    fn bad_names_and_lengths_are_rejected() {
        for bad in ["", "/", "noslash", "/a/b", "/nul\0"] {
            let e = ShmSegment::create(bad, 4096).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{bad:?}");
        }
        let name = Name::new("zero");
        let e = ShmSegment::create(&name.0, 0).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        assert_eq!(ShmSegment::open(&name.0, 16).unwrap_err().kind(), io::ErrorKind::NotFound);
    }

    #[test]
    fn out_of_bounds_and_misaligned_access_panics() {
        let name = Name::new("oob");
        let a = ShmSegment::create(&name.0, 64).unwrap();
        let r = std::panic::catch_unwind(|| a.write(60, &[0; 8]));
        assert!(r.is_err());
        let r = std::panic::catch_unwind(|| a.atomic_u32(2).load(Ordering::Relaxed));
        assert!(r.is_err());
        let r = std::panic::catch_unwind(|| a.atomic_u64(64).load(Ordering::Relaxed));
        assert!(r.is_err());
        let r = std::panic::catch_unwind(|| a.read(usize::MAX, &mut [0; 2]));
        assert!(r.is_err());
        // Edges are fine.
        a.write(56, &[1; 8]);
        a.atomic_u64(56).load(Ordering::Relaxed);
        a.write(64, &[]);
    }

    fn anon_name(tag: &str) -> String {
        static N: AtomicUsize = AtomicUsize::new(0);
        format!("ferroccl-test-{}-{}-{tag}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
    }

    #[test]
    fn anonymous_segment_is_shared_through_proc_and_withdrawn() {
        let name = anon_name("anon");
        let a = ShmSegment::create_anonymous(&name, 8192).unwrap();
        let fd = a.fd().expect("a fresh anonymous segment keeps its descriptor");
        let pid = std::process::id() as i32;
        let b = ShmSegment::open_from(pid, fd, &name, 8192).unwrap();
        b.atomic_u64(64).store(0xfeed, Ordering::Release);
        assert_eq!(a.atomic_u64(64).load(Ordering::Acquire), 0xfeed);
        a.write(100, b"hello");
        let mut got = [0u8; 5];
        b.read(100, &mut got);
        assert_eq!(&got, b"hello");
        // Wrong size, wrong name: refused, naming what was wrong.
        let e = ShmSegment::open_from(pid, fd, &name, 4096).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
        assert!(e.to_string().contains("expected 4096"), "{e}");
        let e = ShmSegment::open_from(pid, fd, &anon_name("other"), 8192).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
        assert!(e.to_string().contains(&format!("/proc/{pid}/fd/{fd}")), "{e}");
        // A descriptor that is not a memfd at all (stdin, whatever it is) is not opened.
        assert!(ShmSegment::open_from(pid, 0, &name, 8192).is_err());
        // Withdrawn: nobody can open it any more, the mappings still work.
        a.withdraw();
        a.withdraw();
        assert_eq!(a.fd(), None);
        let e = ShmSegment::open_from(pid, fd, &name, 8192).unwrap_err();
        assert!(matches!(e.kind(), io::ErrorKind::NotFound | io::ErrorKind::InvalidData), "{e}");
        b.atomic_u32(8).store(7, Ordering::Release);
        assert_eq!(a.atomic_u32(8).load(Ordering::Acquire), 7);
        assert_eq!(b.fd(), None, "an opened segment has no descriptor to hand out");
        // Bad names and lengths.
        assert_eq!(ShmSegment::create_anonymous("a/b", 10).unwrap_err().kind(), io::ErrorKind::InvalidInput);
        assert_eq!(ShmSegment::create_anonymous("", 10).unwrap_err().kind(), io::ErrorKind::InvalidInput);
        assert_eq!(ShmSegment::create_anonymous(&name, 0).unwrap_err().kind(), io::ErrorKind::InvalidInput);
    }

    #[test]
    fn anonymous_segment_is_found_by_name_until_withdrawn() {
        let name = anon_name("find");
        let a = ShmSegment::create_anonymous(&name, 4096).unwrap();
        let pid = std::process::id() as i32;
        let fd = ShmSegment::find_anonymous(pid, &name).unwrap();
        assert_eq!(Some(fd), a.fd());
        let b = ShmSegment::open_from(pid, fd, &name, 4096).unwrap();
        a.write(8, b"x");
        let mut got = [0u8; 1];
        b.read(8, &mut got);
        assert_eq!(&got, b"x");
        let e = ShmSegment::find_anonymous(pid, &anon_name("nobody")).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound, "{e}");
        a.withdraw();
        assert_eq!(ShmSegment::find_anonymous(pid, &name).unwrap_err().kind(), io::ErrorKind::NotFound);
        assert_eq!(ShmSegment::find_anonymous(pid, "a/b").unwrap_err().kind(), io::ErrorKind::InvalidInput);
    }

    #[test]
    fn anonymous_segment_of_a_dead_process_is_gone() {
        // A child holds a memfd and is killed: nothing of it can be opened, and nothing
        // was ever created under /dev/shm.
        let name = anon_name("dead");
        let before: Vec<_> = std::fs::read_dir("/dev/shm").map(|d| d.flatten().map(|e| e.file_name()).collect()).unwrap_or_default();
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let pid = child.id() as i32;
        child.kill().unwrap();
        child.wait().unwrap();
        let e = ShmSegment::open_from(pid, 3, &name, 4096).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound, "{e}");
        let seg = ShmSegment::create_anonymous(&name, 4096).unwrap();
        let after: Vec<_> = std::fs::read_dir("/dev/shm").map(|d| d.flatten().map(|e| e.file_name()).collect()).unwrap_or_default();
        assert!(after.iter().all(|f| before.contains(f) || !f.to_string_lossy().contains(&name)), "{after:?}");
        drop(seg);
    }

    #[test]
    fn segment_is_send_and_sync() {
        fn check<T: Send + Sync + fmt::Debug>() {}
        check::<ShmSegment>();
    }
}
