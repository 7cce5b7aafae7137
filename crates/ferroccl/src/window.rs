//! One-sided memory: registered windows, remote handles, `read_into` / `write_from`.
//!
//! A rank registers memory once as a [`Window`] and gives its [`RemoteHandle`] to other
//! ranks (in a message, through the store, in its own metadata: the handle is 40 bytes,
//! [`RemoteHandle::to_bytes`]); any rank of the job holding the handle reads the window with
//! [`Communicator::read_into`] and, if the window is writable, writes it with
//! [`Communicator::write_from`], while the owner goes on with its own work. Registration is
//! paid once; each access is one round trip.
//!
//! ```
//! # use ferroccl::bootstrap::{env::StoreRole, new_token, StoreServer};
//! # use ferroccl::{Communicator, InitConfig, Params};
//! # let token = new_token();
//! # let store = StoreServer::start("127.0.0.1:0".parse().unwrap(), &token, 1 << 20)?;
//! # let cfg = InitConfig { rank: 0, world_size: 1, store: StoreRole::Connect(store.addr().to_string()), token };
//! # let comm = Communicator::init_with(cfg, Params::default())?;
//! let mut weights = vec![1.5f32; 1024];
//! comm.scope(|s| {
//!     let w = s.register_mut(&mut weights)?; // registered once, for the scope
//!     let h = w.handle(); // Copy; send it anywhere (to_bytes / from_bytes)
//!     let mut got = [0f32; 4];
//!     comm.read_into(&h, 10, &mut got)?; // any rank holding `h` (here: the owner itself)
//!     assert_eq!(got, [1.5; 4]);
//!     comm.write_from(&h, 0, &[2.0f32, 3.0])?;
//!     w.read(0, &mut got[..2])?; // the owner reads and writes through its window
//!     assert_eq!(got[..2], [2.0, 3.0]);
//!     Ok(())
//! })?;
//! # Ok::<(), ferroccl::Error>(())
//! ```
//!
//! # Guarantees
//!
//! * **The borrow checker keeps the memory alive.** A window over caller memory is made in
//!   a [`Scope`] ([`Scope::register`], [`Scope::register_mut`]) and borrows the buffer until
//!   the scope ends; the scope's end (not the window's `Drop`, which a program may skip
//!   with `mem::forget`) ends every access, waiting for any in progress. A window the
//!   library allocates ([`Communicator::alloc_window`]) owns its memory and has no scope.
//! * **A handle is a capability.** It names the owner (a world rank), the window's id, a
//!   random 64-bit key, the job (and `init`) it belongs to, the window's length and the
//!   access it grants. The owner checks every request against its live windows before a
//!   byte moves; a forged key, a dropped window, another job's handle, a range outside the
//!   window or a write through a read-only window is refused with [`Error::Refused`] (the
//!   communicator stays usable) and nothing outside a live window of the right access is
//!   read or written.
//! * **Dropping a window while peers use it** ends it for new requests at once (they are
//!   refused, [`Refusal::NoWindow`]); a request already being served finishes first. A
//!   same-host peer copying a shared window directly (below) checks the window is live
//!   before and after its copy: an access that overlaps the drop is refused too (a read
//!   refused so may have filled part of its destination; a write refused so landed in
//!   memory nobody reads any more). Over verbs, `Drop` first revokes the window's memory
//!   region from the peers that read (or write) it with RDMA (below) and returns once each
//!   has answered (its reads and writes in flight completed) or at `FERROCCL_TIMEOUT`: a
//!   peer's access in flight then completes whole, and its later ones are refused.
//! * **Verbs peers read without the owner.** A rank that reaches the owner over verbs asks
//!   once per window for its memory region (the owner checks the handle as for any
//!   request) and then reads it with RDMA READs into its own registered destination, with
//!   no work by the owner, and writes a read-write window with RDMA WRITEs from its source
//!   (registered per write), completing when the owner's NIC has acknowledged them (a
//!   read-only window's region allows no remote write: such a write is refused, `ReadOnly`).
//!   [`RegStats::verbs_read_bytes`](crate::RegStats),
//!   [`RegStats::verbs_window_write_bytes`](crate::RegStats),
//!   [`RegStats::gets_served`](crate::RegStats) and [`RegStats::puts_served`](crate::RegStats)
//!   count both sides.
//! * **Shared windows.** [`Communicator::alloc_window`] puts the window in a shared segment
//!   (a memfd holding nothing but the window). Ranks reached over shm map it at their first
//!   access through the handle (finding it by a name derived from the handle's job, owner,
//!   id and key) and then read and write it with a plain copy: no request, no work by the
//!   owner, ~0.1 us for 8 bytes. Other ranks, and windows over caller memory, are served by
//!   the owner as below. [`RegStats::peer_windows_mapped`](crate::RegStats) counts the
//!   mappings.
//! * **Concurrent access.** Requests are served in arrival order by the owner's progress
//!   engine (its background thread runs while the owner has windows, so the owner need not
//!   be in a call). The owner's own [`Window::read`] / [`Window::write`] and the requests
//!   it serves exclude each other per byte range, so nobody sees a torn element; a
//!   same-host peer's direct copy into a shared window excludes nothing, and neither does a
//!   verbs peer's read or write, which the devices serve from the window's memory with no copy (as
//!   RDMA: an element written while it is read may be read torn). Nothing else is ordered:
//!   what a read returns while the owner (or another rank) writes the same range is
//!   unspecified (either version of each piece, or with direct copies any mix of bytes).
//!   Order them with a collective or a message (as with RDMA: a barrier after the writes,
//!   then the reads), or a signal (`put_signal` then `wait_signal`).
//! * **Every access has a deadline** (`FERROCCL_TIMEOUT`); an owner that dies fails it
//!   with [`Error::PeerFailed`] naming the owner.

use std::marker::PhantomData;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytemuck::Pod;
use ferroccl_mem::region::{with_region, with_region_ro, RegionHandle};

use crate::algo::{Action, Block, Buf, Remote, Schedule, Slice, Step};
use crate::comm::Communicator;
use crate::engine::{Engine, Part};
use crate::error::{Error, Op, PodType, Refusal, Result};
use crate::ll::WaitPolicy;
use crate::nonblocking::{Request, Scope};
use crate::pod::Wire;
use crate::proto::CHAN_USER;
use crate::registry::{SharedWindow, SHARED_HEADER};

/// The access a window grants to the ranks holding its handle.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Access {
    /// Reads only (a window over `&[T]`).
    ReadOnly,
    /// Reads and writes (a window over `&mut [T]`, or one the library allocated).
    ReadWrite,
}

/// A window of some rank, as any rank of the job reaches it: small, `Copy`, and a
/// capability (see the [module documentation](self)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RemoteHandle {
    owner: u32,
    window: u32,
    key: u64,
    job: u64,
    len: u64,
    access: Access,
    /// A shared segment (byte 13 of the serialised form is 1).
    shared: bool,
}

/// The first bytes of a serialised handle: "FCW" and the format's version.
const HANDLE_MAGIC: [u8; 4] = *b"FCW1";

impl RemoteHandle {
    /// Bytes of [`RemoteHandle::to_bytes`].
    pub const BYTES: usize = 40;

    /// The owner's world rank.
    pub fn owner(&self) -> usize {
        self.owner as usize
    }

    /// The window's length in bytes.
    pub fn len_bytes(&self) -> u64 {
        self.len
    }

    /// The access the window grants.
    pub fn access(&self) -> Access {
        self.access
    }

    pub(crate) fn job(&self) -> u64 {
        self.job
    }

    pub(crate) fn window_id(&self) -> u32 {
        self.window
    }

    /// Whether the window is a shared segment that ranks on its owner's host map
    /// ([`Communicator::alloc_window`]).
    pub fn is_shared(&self) -> bool {
        self.shared
    }

    /// The window as a one-sided step names it.
    pub(crate) fn remote(&self) -> Remote {
        Remote { window: self.window, key: self.key, len: self.len, shared: self.shared }
    }

    /// The handle as bytes, to travel in a message, through the store or in the
    /// program's own metadata.
    pub fn to_bytes(&self) -> [u8; Self::BYTES] {
        let mut b = [0u8; Self::BYTES];
        b[0..4].copy_from_slice(&HANDLE_MAGIC);
        b[4..8].copy_from_slice(&self.owner.to_le_bytes());
        b[8..12].copy_from_slice(&self.window.to_le_bytes());
        b[12] = match self.access {
            Access::ReadOnly => 1,
            Access::ReadWrite => 2,
        };
        b[13] = u8::from(self.shared);
        b[16..24].copy_from_slice(&self.key.to_le_bytes());
        b[24..32].copy_from_slice(&self.job.to_le_bytes());
        b[32..40].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// A handle from [`RemoteHandle::to_bytes`]. Fails on bytes that are not a handle
    /// (wrong length or format); whether the handle reaches a live window is for its owner
    /// to say, at the first access.
    pub fn from_bytes(b: &[u8]) -> Result<RemoteHandle> {
        let bad = |what: &str| Error::invalid(format!("RemoteHandle::from_bytes: {what}"));
        if b.len() != Self::BYTES {
            return Err(bad(&format!("{} bytes, a handle has {}", b.len(), Self::BYTES)));
        }
        if b[0..4] != HANDLE_MAGIC {
            return Err(bad("not a FerroCCL window handle (or another version's)"));
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(x)
        };
        let access = match b[12] {
            1 => Access::ReadOnly,
            2 => Access::ReadWrite,
            a => return Err(bad(&format!("unknown access {a}"))),
        };
        let shared = match b[13] {
            0 => false,
            1 => true,
            f => return Err(bad(&format!("unknown segment flag {f}"))),
        };
        if b[14..16] != [0, 0] {
            return Err(bad("reserved bytes are not zero"));
        }
        Ok(RemoteHandle { owner: u32_at(4), window: u32_at(8), key: u64_at(16), job: u64_at(24), len: u64_at(32), access, shared })
    }
}

/// A registered window: memory that ranks holding its [`RemoteHandle`] read (and, if
/// writable, write) one-sidedly. Made by [`Scope::register`], [`Scope::register_mut`] or
/// [`Communicator::alloc_window`]; dropping it ends peers' access (see the
/// [module documentation](self)).
pub struct Window<'s> {
    engine: Arc<Engine>,
    handle: RemoteHandle,
    region: RegionHandle,
    /// An allocated window's shared segment (peers on this host map it).
    shared: Option<SharedWindow>,
    _mem: PhantomData<&'s mut [u8]>,
}

impl std::fmt::Debug for Window<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Window").field("handle", &self.handle).finish()
    }
}

impl<'s> Window<'s> {
    fn new(comm: &Communicator, region: RegionHandle, access: Access) -> Result<Window<'s>> {
        Self::make(comm, access, |_, _| Ok((region, None)))
    }

    /// A window over the region `memory(id, key)` gives (and its shared segment, if any).
    fn make(
        comm: &Communicator,
        access: Access,
        memory: impl FnOnce(u32, u64) -> Result<(RegionHandle, Option<SharedWindow>)>,
    ) -> Result<Window<'s>> {
        let fabric = comm.fabric();
        let owner = u32::try_from(fabric.rank).map_err(|_| Error::invalid("a window's owner must be a rank below 2^32"))?;
        let (window, key) = fabric.windows.new_id()?;
        let (region, shared) = memory(window, key)?;
        fabric.windows.insert(window, key, region.clone(), access == Access::ReadWrite)?;
        let handle = RemoteHandle { owner, window, key, job: fabric.job, len: region.len() as u64, access, shared: shared.is_some() };
        comm.engine().serve_window();
        Ok(Window { engine: comm.engine().clone(), handle, region, shared, _mem: PhantomData })
    }

    /// The handle to give to the ranks that may access this window.
    pub fn handle(&self) -> RemoteHandle {
        self.handle
    }

    /// The window's length in bytes.
    pub fn len_bytes(&self) -> usize {
        self.region.len()
    }

    pub(crate) fn region(&self) -> &RegionHandle {
        &self.region
    }

    /// Reads `dst.len()` elements at element `offset` of the window (the owner's own view;
    /// excludes peers' accesses to the same bytes while it copies). `T` may be any
    /// plain-old-data type (offsets count its elements), as in every window access.
    pub fn read<T: Pod>(&self, offset: usize, dst: &mut [T]) -> Result<()> {
        let (start, _) = self.range::<T>("window read", offset, dst.len())?;
        self.region.read_at(start, bytemuck::cast_slice_mut(dst)).map_err(|e| Error::invalid(format!("window read: {e}")))
    }

    /// Writes `src` at element `offset` of the window (a trainer updating its weights in
    /// place); fails on a read-only window.
    pub fn write<T: Pod>(&self, offset: usize, src: &[T]) -> Result<()> {
        let (start, _) = self.range::<T>("window write", offset, src.len())?;
        self.region.write_at(start, bytemuck::cast_slice(src)).map_err(|e| Error::invalid(format!("window write: {e}")))
    }

    /// Runs `f` on a view of the whole window (crate-internal: the low-latency MoE parses
    /// its peers' messages in place). The window's range lock is held while `f` runs: an
    /// owner-served write into it (a `PUT`) waits until `f` returns; peers that write a
    /// shared window directly do not, so `f` must only read what a signal already covers.
    pub(crate) fn with_bytes<R>(&self, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
        self.region.with_slice(0, self.region.len(), f).map_err(|e| Error::invalid(format!("window read: {e}")))
    }

    /// The value of member `source`'s signal word in this window's header (an allocated,
    /// shared window; see [`MappedWindow`]); `None` for a registered window or a source
    /// past the header's words.
    pub(crate) fn word_value(&self, source: usize) -> Option<u64> {
        Some(self.shared.as_ref()?.word(source)?.load(Ordering::Acquire))
    }

    fn range<T: Pod>(&self, what: &str, offset: usize, count: usize) -> Result<(usize, usize)> {
        let w = Wire::of::<T>(self.engine.fabric().rank, what)?;
        let size = w.size;
        let r = offset.checked_mul(size).and_then(|s| Some((s, count.checked_mul(size)?)));
        match r {
            Some((s, n)) if s.checked_add(n).is_some_and(|e| e <= self.region.len()) => Ok((s, n)),
            _ => Err(Error::invalid(format!(
                "{count} {} at element {offset} do not fit in a window of {} bytes",
                w.pod.map_or(w.dtype.name(), PodType::name),
                self.region.len()
            ))),
        }
    }
}

impl Drop for Window<'_> {
    fn drop(&mut self) {
        // Direct accesses first (they check the segment's live word), then the owner's.
        if let Some(s) = &self.shared {
            s.end();
        }
        self.engine.fabric().windows.remove(self.handle.window);
        self.engine.unserve_window();
    }
}

impl<'s> Scope<'s, '_> {
    /// Registers `buf` (of any plain-old-data type) as a read-only window until the scope
    /// ends (or the window is dropped): ranks holding its handle may read it.
    pub fn register<T: Pod>(&self, buf: &'s [T]) -> Result<Window<'s>> {
        let region = self.regions.register_ro(bytemuck::cast_slice(buf));
        let w = Window::new(self.comm, region, Access::ReadOnly)?;
        self.made_window(w.handle.window);
        Ok(w)
    }

    /// Registers `buf` as a readable and writable window until the scope ends (or the
    /// window is dropped). The owner reaches the memory through the window
    /// ([`Window::read`], [`Window::write`]) meanwhile.
    pub fn register_mut<T: Pod>(&self, buf: &'s mut [T]) -> Result<Window<'s>> {
        let region = self.regions.register(bytemuck::cast_slice_mut(buf));
        let w = Window::new(self.comm, region, Access::ReadWrite)?;
        self.made_window(w.handle.window);
        Ok(w)
    }

    /// [`Communicator::read_into`], in the background: `dst` stays borrowed until the scope
    /// ends.
    pub fn read_into<T: Pod>(&self, h: &RemoteHandle, offset: usize, dst: &'s mut [T]) -> Result<Request<'s>> {
        let (op, w) = rma_op::<T>(self.comm, h, offset, dst.len(), false)?;
        let plan = self.comm.rma_plan(w, h, offset, dst.len(), &op, false)?;
        if plan.len == 0 {
            return self.submit(Vec::new());
        }
        let region = self.regions.register(bytemuck::cast_slice_mut(dst));
        let part = self.comm.rma_part(op, plan, region);
        self.submit(vec![part])
    }

    /// [`Communicator::write_from`], in the background: `src` stays borrowed until the scope
    /// ends.
    pub fn write_from<T: Pod>(&self, h: &RemoteHandle, offset: usize, src: &'s [T]) -> Result<Request<'s>> {
        let (op, w) = rma_op::<T>(self.comm, h, offset, src.len(), true)?;
        let plan = self.comm.rma_plan(w, h, offset, src.len(), &op, true)?;
        if plan.len == 0 {
            return self.submit(Vec::new());
        }
        let region = self.regions.register_ro(bytemuck::cast_slice(src));
        let part = self.comm.rma_part(op, plan, region);
        self.submit(vec![part])
    }
}

/// A one-sided read (or, with `write`, write) of `count` elements of `T`, as errors name
/// it, and how `T` crosses the wire (a zero-sized `T` is refused).
fn rma_op<T: Pod>(comm: &Communicator, h: &RemoteHandle, offset: usize, count: usize, write: bool) -> Result<(Op, Wire)> {
    let w = comm.wire::<T>(if write { "write" } else { "read" })?;
    let (owner, offset, dtype, pod) = (h.owner(), offset as u64, w.dtype, w.pod);
    let op = match write {
        true => Op::Write { owner, offset, count, dtype, pod },
        false => Op::Read { owner, offset, count, dtype, pod },
    };
    Ok((op, w))
}

/// One access, checked: the owner as a member of the communicator, and the byte range.
struct RmaPlan {
    peer: usize,
    remote: Remote,
    offset: u64,
    len: usize,
}

/// A peer's allocated window mapped by this rank (the owner is an shm peer): written with
/// a copy and a signal word in its header (crate-internal: the low-latency MoE path, where
/// a decode step must not wait on either side's engine).
#[derive(Debug, Clone)]
pub(crate) struct MappedWindow {
    /// The owner's world rank.
    owner: usize,
    w: SharedWindow,
}

impl Communicator {
    /// Maps the window `h` names, when it is an allocated (shared) read-write window of an
    /// shm peer, still live, with a signal word for every member of this communicator;
    /// `None` otherwise (its accesses then go through the engine).
    pub(crate) fn map_window(&self, h: &RemoteHandle) -> Option<MappedWindow> {
        let fabric = self.fabric();
        if !h.shared || h.access != Access::ReadWrite || h.owner() == fabric.rank || h.job != fabric.job {
            return None;
        }
        if self.size() > crate::registry::SHARED_WORD_SOURCES {
            return None;
        }
        let r = h.remote();
        let w = fabric.shared_window(h.owner(), r.window, r.key, r.len)?;
        (w.live() && w.writable()).then_some(MappedWindow { owner: h.owner(), w })
    }

    /// Copies each `(offset, bytes)` piece into the mapped window `m`, then raises this
    /// rank's signal word there to `value`, once, after the last piece (Release: the owner
    /// that reads the word at `value` or above sees the bytes), and wakes the owner if it
    /// sleeps.
    ///
    /// # Errors
    ///
    /// [`Error::Refused`] when the owner dropped the window (before or while this copied),
    /// or a piece is not inside it (the pieces before it are written, the word is not
    /// raised).
    pub(crate) fn put_parts_raise<'b>(
        &self,
        m: &MappedWindow,
        parts: impl IntoIterator<Item = (usize, &'b [u8])>,
        value: u64,
    ) -> Result<()> {
        let me = self.rank();
        let refuse = |reason| Error::Refused { rank: me, owner: m.owner, op: Op::other("a write to a mapped window"), reason };
        if !m.w.live() {
            return Err(refuse(Refusal::NoWindow));
        }
        let word = m.w.word(me).ok_or_else(|| refuse(Refusal::OutOfRange))?;
        for (offset, src) in parts {
            if !m.w.write(offset as u64, src) {
                return Err(refuse(Refusal::OutOfRange));
            }
        }
        word.fetch_max(value, Ordering::Release);
        if !m.w.live() {
            return Err(refuse(Refusal::NoWindow));
        }
        // The doorbell protocol: the word is published before the look at the sleep flag.
        std::sync::atomic::fence(Ordering::SeqCst);
        if let Ok(ep) = self.fabric().endpoint(m.owner) {
            ep.wake_if_sleeping_after_fence();
        }
        Ok(())
    }

    /// Waits until the signal word of every member in `from` in this rank's own window `w`
    /// (see [`Communicator::put_parts_raise`]) is `value` or above; `what` names the wait in a
    /// timeout. Peers' deaths and the deadline end it as any wait.
    pub(crate) fn wait_words(&self, w: &Window<'_>, from: &[usize], value: u64, what: &str) -> Result<()> {
        let arrived = |s: usize| w.word_value(s).is_some_and(|v| v >= value);
        let done = || from.iter().all(|&s| arrived(s));
        if done() {
            return Ok(());
        }
        let fabric = self.fabric();
        // As a low-latency collective waits (the channel's policy where the communicator
        // has one): a parked waiter costs a futex wake-up (measured: a 1-token step's
        // combine took 21 us of its 30 with the engine's backoff, which parks after a few
        // microseconds).
        let policy = self.ll.as_ref().map_or_else(|| WaitPolicy::for_fabric(fabric), |c| c.policy);
        let waiting = || from.iter().filter(|&&s| !arrived(s)).filter_map(|&s| self.world_rank(s)).collect();
        let op = || Op::other(format!("{what} (waiting for signal {value})"));
        crate::ll::wait_until(fabric, self.view(), policy, &done, &waiting, &op)
    }
    /// Allocates a zeroed window of `len` elements, owned by the library (no scope: it
    /// lives until dropped) and readable and writable by the ranks holding its handle.
    ///
    /// Its memory is a shared segment: ranks on this host reached over shm map it at their
    /// first access through the handle and from then on read and write it with a plain
    /// copy, without a request to this rank or any work by it (see the
    /// [module documentation](crate::window) for what that means for concurrent access).
    /// Where a shared segment cannot be made (`memfd_create` fails), the window is ordinary
    /// memory served by this rank, as a registered one ([`RemoteHandle::is_shared`] says
    /// which). `T` may be any plain-old-data type (a zero-sized one is refused).
    pub fn alloc_window<T: Pod>(&self, len: usize) -> Result<Window<'static>> {
        let w = self.wire::<T>("alloc_window")?;
        let name = w.pod.map_or(w.dtype.name(), PodType::name);
        let bytes = len
            .checked_mul(w.size)
            .filter(|&b| b <= isize::MAX as usize - SHARED_HEADER)
            .ok_or_else(|| Error::invalid(format!("alloc_window: {len} {name} do not fit in memory")))?;
        self.check_usable(&Op::other("alloc_window"))?;
        let (job, rank) = (self.fabric().job, self.fabric().rank);
        Window::make(self, Access::ReadWrite, |id, key| {
            let shared = SharedWindow::create(job, rank, id, key, bytes).ok();
            match shared.as_ref().and_then(SharedWindow::region) {
                Some(region) => Ok((region, shared)),
                None => Ok((RegionHandle::owned(bytes), None)),
            }
        })
    }

    /// Reads `dst.len()` elements at element `offset` of the window `h` names into `dst`;
    /// returns when they have landed. The owner may be any member of this communicator,
    /// this rank included.
    ///
    /// # Errors
    ///
    /// [`Error::Refused`] when the owner refuses (see [`Refusal`]) or the handle is already
    /// known to be wrong here (another job's, a range outside its length): nothing was
    /// read, and the communicator stays usable. [`Error::InvalidArgument`] for an owner
    /// that is not a member, or a zero-sized `T` (any other plain-old-data type may be
    /// read). A dead owner or a deadline fail it as any call.
    pub fn read_into<T: Pod>(&self, h: &RemoteHandle, offset: usize, dst: &mut [T]) -> Result<()> {
        let (op, w) = rma_op::<T>(self, h, offset, dst.len(), false)?;
        let plan = self.rma_plan(w, h, offset, dst.len(), &op, false)?;
        if plan.len == 0 {
            return Ok(());
        }
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(dst);
        let copied = self.direct_rma(h, &plan, &op, false, |w| match w.read(plan.offset, bytes) {
            true => Ok(()),
            false => Err(Error::internal(format!("{op}: a checked range did not fit the shared window"))),
        })?;
        if copied {
            return Ok(());
        }
        with_region(bytes, |region| self.run_part(self.rma_part(op, plan, region.clone())))
    }

    /// Writes `src` at element `offset` of the window `h` names; returns when the owner has
    /// landed every byte. Errors as [`Communicator::read_into`], and [`Refusal::ReadOnly`]
    /// for a read-only window.
    pub fn write_from<T: Pod>(&self, h: &RemoteHandle, offset: usize, src: &[T]) -> Result<()> {
        let (op, w) = rma_op::<T>(self, h, offset, src.len(), true)?;
        let plan = self.rma_plan(w, h, offset, src.len(), &op, true)?;
        if plan.len == 0 {
            return Ok(());
        }
        let bytes: &[u8] = bytemuck::cast_slice(src);
        let copied = self.direct_rma(h, &plan, &op, true, |w| match w.write(plan.offset, bytes) {
            true => Ok(()),
            false => Err(Error::internal(format!("{op}: a checked range did not fit the shared window"))),
        })?;
        if copied {
            return Ok(());
        }
        with_region_ro(bytes, |region| self.run_part(self.rma_part(op, plan, region.clone())))
    }

    /// [`Communicator::write_from`], then raises this rank's signal at the window's owner to
    /// `value` once every byte has landed (NCCL's `ncclPutSignal`): the owner's
    /// [`Communicator::wait_signal`] for this rank and `value` returns only after the data
    /// is in its window. Returns when the owner has raised it.
    pub fn put_signal<T: Pod>(&self, h: &RemoteHandle, offset: usize, src: &[T], value: u64) -> Result<()> {
        self.put_signal_on(h, offset, src, 0, value)
    }

    /// [`Communicator::put_signal`] on signal `slot` (0: the public signal; library objects
    /// own the others, see [`Communicator::agree_signal_slots`]).
    pub(crate) fn put_signal_on<T: Pod>(&self, h: &RemoteHandle, offset: usize, src: &[T], slot: u32, value: u64) -> Result<()> {
        let (op, w) = rma_op::<T>(self, h, offset, src.len(), true)?;
        let plan = self.rma_plan(w, h, offset, src.len(), &op, true)?;
        let peer = plan.peer;
        let mut steps: Vec<Step> = Some(plan).filter(|p| p.len > 0).into_iter().map(rma_step(&op)).collect();
        steps.push(Step { op: Action::Signal { peer, slot, value: Some(value) }, deps: vec![] });
        let sched = Schedule { steps, scratch_bytes: 0 };
        with_region_ro(bytemuck::cast_slice(src), |region| self.run_part(self.p2p_part(op, CHAN_USER, sched, None, region.clone())))
    }

    /// Several [`Communicator::put_signal_on`]s in one job: for each `(h, offset, range)`,
    /// `src[range]` is written at byte `offset` of the window `h` names, then this rank's
    /// signal on `slot` at its owner is raised to `value` (once for consecutive items to
    /// one owner, after the last of them). The writes and signals to
    /// different owners are in flight together (one round trip in all, not one per
    /// owner); returns when every owner has raised its signal. An access that is refused
    /// fails the whole call before anything moves.
    pub(crate) fn put_signal_many_on(
        &self,
        items: &[(RemoteHandle, usize, std::ops::Range<usize>)],
        src: &[u8],
        slot: u32,
        value: u64,
    ) -> Result<()> {
        let mut steps = Vec::with_capacity(2 * items.len());
        let mut first_op = None;
        for (i, (h, offset, range)) in items.iter().enumerate() {
            if range.end > src.len() || range.start > range.end {
                return Err(Error::internal(format!("put_signal_many: range {range:?} outside a source of {} bytes", src.len())));
            }
            let (op, w) = rma_op::<u8>(self, h, *offset, range.len(), true)?;
            let plan = self.rma_plan(w, h, *offset, range.len(), &op, true)?;
            let peer = plan.peer;
            if plan.len > 0 {
                let src = Slice::new(Buf::Output, range.start, plan.len);
                let block = Block::contiguous(plan.len as u64);
                steps.push(Step { op: Action::Put { peer, remote: plan.remote, offset: plan.offset, src, block }, deps: vec![] });
            }
            // Consecutive items to one owner: one signal, after the last (a signal covers
            // the writes to its owner before it).
            if items.get(i + 1).is_none_or(|next| next.0.owner() != h.owner()) {
                steps.push(Step { op: Action::Signal { peer, slot, value: Some(value) }, deps: vec![] });
            }
            first_op.get_or_insert(op);
        }
        let Some(op) = first_op else { return Ok(()) };
        let sched = Schedule { steps, scratch_bytes: 0 };
        with_region_ro(src, |region| self.run_part(self.p2p_part(op, CHAN_USER, sched, None, region.clone())))
    }

    /// Raises this rank's signal at member `peer` to `value` (no data): `peer`'s
    /// [`Communicator::wait_signal`] for this rank sees it. Signals are ordered after this
    /// rank's earlier completed writes to `peer`'s windows (over verbs, a write still in
    /// flight in a [`Request`] may be an RDMA WRITE that the signal overtakes: wait for
    /// the request first, or use [`Communicator::put_signal`]). A signal only rises: raising it to a value
    /// below the current one leaves it.
    pub fn signal(&self, peer: usize, value: u64) -> Result<()> {
        self.signal_on(peer, 0, value)
    }

    /// [`Communicator::signal`] on signal `slot`.
    pub(crate) fn signal_on(&self, peer: usize, slot: u32, value: u64) -> Result<()> {
        let op = Op::other(format!("signal {value} to rank {peer}"));
        self.check_peer_or_self(peer, &op)?;
        let sched =
            Schedule { steps: vec![Step { op: Action::Signal { peer, slot, value: Some(value) }, deps: vec![] }], scratch_bytes: 0 };
        let part = self.p2p_part(op, CHAN_USER, sched, None, RegionHandle::owned(0));
        self.run_part(part)
    }

    /// Waits until member `from` has raised its signal at this rank to at least `value`
    /// (with [`Communicator::put_signal`] or [`Communicator::signal`]); returns the signal.
    /// Fails as any call at the deadline (`FERROCCL_TIMEOUT`) or when `from` dies.
    pub fn wait_signal(&self, from: usize, value: u64) -> Result<u64> {
        self.wait_signal_on(from, 0, value)
    }

    /// [`Communicator::wait_signal`] on signal `slot`.
    pub(crate) fn wait_signal_on(&self, from: usize, slot: u32, value: u64) -> Result<u64> {
        let op = Op::other(format!("wait for signal {value} from rank {from}"));
        let wfrom = self.check_peer_or_self(from, &op)?;
        let sched = Schedule {
            steps: vec![Step { op: Action::WaitSignal { peer: from, slot, value: Some(value) }, deps: vec![] }],
            scratch_bytes: 0,
        };
        let part = self.p2p_part(op, CHAN_USER, sched, None, RegionHandle::owned(0));
        self.run_part(part)?;
        Ok(self.fabric().inbox.lock().signals.get(&(wfrom, slot)).copied().unwrap_or(0))
    }

    /// Waits until every member of `from` has raised its signal on `slot` at this rank to
    /// at least `value`: the waits of [`Communicator::wait_signal_on`] in one job.
    pub(crate) fn wait_signals_on(&self, from: &[usize], slot: u32, value: u64) -> Result<()> {
        let op = Op::other(format!("wait for signal {value} from ranks {from:?}"));
        for &f in from {
            self.check_peer_or_self(f, &op)?;
        }
        let steps = from.iter().map(|&peer| Step { op: Action::WaitSignal { peer, slot, value: Some(value) }, deps: vec![] }).collect();
        let part = self.p2p_part(op, CHAN_USER, Schedule { steps, scratch_bytes: 0 }, None, RegionHandle::owned(0));
        self.run_part(part)
    }

    /// The signal member `peer` has raised at this rank so far (0 if none); never waits.
    pub fn signal_value(&self, peer: usize) -> u64 {
        self.signal_value_on(peer, 0)
    }

    /// [`Communicator::signal_value`] on signal `slot`.
    pub(crate) fn signal_value_on(&self, peer: usize, slot: u32) -> u64 {
        self.world_rank(peer).and_then(|w| self.fabric().inbox.lock().signals.get(&(w, slot)).copied()).unwrap_or(0)
    }

    /// Agrees with the other members on `n` signal slots free on every member, for a
    /// library object made collectively (a MoE layer): an allgather of each rank's lowest
    /// free slot; the highest wins and is claimed everywhere. Signals on those slots are
    /// the object's own: another object's (or the public) signals between the same ranks
    /// cannot satisfy its waits. Collective: every member calls it, in the same order as
    /// its other collectives.
    pub(crate) fn agree_signal_slots(&self, n: u32) -> Result<u32> {
        let mine = [self.fabric().free_signal_slot()];
        let mut all = vec![0u32; self.size()];
        self.allgather_into(&mine, &mut all)?;
        let first = all.iter().copied().max().unwrap_or(mine[0]);
        self.fabric().claim_signal_slots(first, n);
        Ok(first)
    }

    /// Member `peer` (this rank included) as a world rank, for a one-sided call.
    fn check_peer_or_self(&self, peer: usize, op: &Op) -> Result<usize> {
        let w = self.member_world(peer, op)?;
        self.check_usable(op)?;
        Ok(w)
    }

    /// Checks an access before anything goes on the wire (one of length 0 moves nothing).
    fn rma_plan(&self, w: Wire, h: &RemoteHandle, offset: usize, count: usize, op: &Op, write: bool) -> Result<RmaPlan> {
        let refuse = |reason| Error::Refused { rank: self.rank(), owner: h.owner(), op: op.clone(), reason };
        if h.job != self.fabric().job {
            return Err(refuse(Refusal::OtherJob));
        }
        if write && h.access != Access::ReadWrite {
            return Err(refuse(Refusal::ReadOnly));
        }
        let size = w.size as u64;
        let range = (offset as u64).checked_mul(size).and_then(|s| Some((s, (count as u64).checked_mul(size)?)));
        let Some((start, len)) = range.filter(|&(s, n)| s.checked_add(n).is_some_and(|e| e <= h.len)) else {
            return Err(refuse(Refusal::OutOfRange));
        };
        let peer = self.rank_of_world(h.owner()).ok_or_else(|| {
            Error::invalid(format!("rank {}: {op}: world rank {} is not a member of this communicator", self.rank(), h.owner()))
        })?;
        self.check_usable(op)?;
        let len = usize::try_from(len).map_err(|_| refuse(Refusal::OutOfRange))?;
        Ok(RmaPlan { peer, remote: h.remote(), offset: start, len })
    }

    /// A checked access done here with `copy`, when `h` names a shared window on this host
    /// that this rank maps (`Ok(false)`: it does not, the owner serves the access).
    fn direct_rma(
        &self,
        h: &RemoteHandle,
        plan: &RmaPlan,
        op: &Op,
        write: bool,
        copy: impl FnOnce(&SharedWindow) -> Result<()>,
    ) -> Result<bool> {
        match crate::rma::direct(self.fabric(), h.owner(), &plan.remote, plan.offset, plan.len as u64, write, copy)? {
            None => Ok(false),
            Some(Ok(())) => Ok(true),
            Some(Err(reason)) => Err(Error::Refused { rank: self.rank(), owner: h.owner(), op: op.clone(), reason }),
        }
    }

    /// The part that runs one checked access over `local` (the destination of a read, the
    /// source of a write). An access to this rank's own window is served locally by the
    /// same checks.
    fn rma_part(&self, op: Op, plan: RmaPlan, local: RegionHandle) -> Part {
        let sched = Schedule { steps: vec![rma_step(&op)(plan)], scratch_bytes: 0 };
        self.p2p_part(op, CHAN_USER, sched, None, local)
    }
}

/// The step of one checked access whose local side is `Output` from byte 0: a write for
/// [`Op::Write`], a read otherwise.
fn rma_step(op: &Op) -> impl Fn(RmaPlan) -> Step + '_ {
    move |RmaPlan { peer, remote, offset, len }| {
        let action = match op {
            Op::Write { .. } => {
                Action::Put { peer, remote, offset, src: Slice::new(Buf::Output, 0, len), block: Block::contiguous(len as u64) }
            }
            _ => Action::Get { peer, remote, offset, dst: Slice::new(Buf::Output, 0, len), block: Block::contiguous(len as u64) },
        };
        Step { op: action, deps: vec![] }
    }
}
