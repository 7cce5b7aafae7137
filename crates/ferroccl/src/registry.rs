//! The registration table: which memory peers may write into, under which key. For shm
//! and tcp a registration is a key bound to a region handle in the inbox's table (where the
//! transports land one-sided writes), cached by address range (LRU-bounded,
//! `FERROCCL_REG_CACHE_ENTRIES`); for verbs, a memory region over exactly the advertised
//! range, held by the receive until the write lands. Also the immediates that name
//! rendezvous writes, and the table of one-sided windows (with, when verbs carries any
//! peer, each window's memory region: registered once, with the window).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use ferroccl_mem::region::RegionHandle;
use ferroccl_mem::ShmSegment;

use crate::error::Result;
use crate::inbox::Inbox;
use crate::logging::flog;
use crate::proto;
use crate::transport::{Endpoint, MemRegion, RemoteBuf, RemoteMemory, RemoteRegion, WriteGrant};

/// Counters of the registration cache ([`crate::Communicator::registration_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RegStats {
    /// Registrations made (cache misses).
    pub registrations: u64,
    /// Calls that reused a cached registration of the same address range.
    pub hits: u64,
    /// Registrations dropped to keep the cache within `FERROCCL_REG_CACHE_ENTRIES`.
    pub evictions: u64,
    /// Registrations cached now.
    pub entries: usize,
    /// Bytes covered by the cached registrations.
    pub registered_bytes: u64,
    /// One-sided windows live now (registered once, reached by handle; see
    /// [`crate::Window`]).
    pub windows: usize,
    /// Bytes of the live windows.
    pub window_bytes: u64,
    /// Windows registered so far.
    pub windows_registered: u64,
    /// Shared windows of peers on this host that this process has mapped (and reads and
    /// writes with a copy, without asking their owners): see
    /// [`crate::Communicator::alloc_window`].
    pub peer_windows_mapped: usize,
    /// Bytes of the live windows registered with the verbs device (one memory region per
    /// window, made with the window when any peer is reached over verbs): peers' reads of
    /// them are written from this memory with no copy.
    pub window_bytes_verbs: u64,
    /// Bytes verbs one-sided writes copied through the staging slots since `init` (the
    /// sources of rendezvous sends; reads of windows without a memory region).
    pub verbs_staged_bytes: u64,
    /// Bytes verbs one-sided writes sent straight from windows' memory regions since `init`
    /// (reads of this rank's windows served by this rank, zero copy).
    pub verbs_zero_copy_bytes: u64,
    /// Reads (`GET` requests) of this rank's windows that this rank served as their
    /// owner since `init`, whatever the transport. Verbs peers that read a window with
    /// RDMA READ add nothing here.
    pub gets_served: u64,
    /// Writes (`PUT` pieces) into this rank's windows that this rank served as their owner
    /// since `init`, whatever the transport. Verbs peers that write a read-write window
    /// with RDMA WRITE add nothing here.
    pub puts_served: u64,
    /// Signals (`put_signal`, `signal`, and library objects' `SIGNAL`s) raised here that
    /// this rank served as their target since `init`. The low-latency MoE path between
    /// ranks of one host raises words in shared windows instead, and adds nothing here.
    pub signals_served: u64,
    /// Bytes this rank wrote into verbs peers' read-write windows with RDMA WRITE since
    /// `init`, without their owners' CPUs.
    pub verbs_window_write_bytes: u64,
    /// Bytes this rank read from verbs peers' windows with RDMA READ since `init`, without
    /// their owners' CPUs.
    pub verbs_read_bytes: u64,
    /// Verbs peers' windows this rank may read with RDMA READ (and write with RDMA WRITE,
    /// when writable) now (the owner gave their memory regions and has not revoked them).
    pub peer_regions_held: usize,
}

/// A live one-sided window, as the window server checks requests against it.
#[derive(Debug, Clone)]
pub(crate) struct WindowEntry {
    /// The capability: a random 64-bit key that every request must name.
    pub(crate) key: u64,
    pub(crate) region: RegionHandle,
    pub(crate) writable: bool,
    /// The verbs memory region over the whole window (when verbs carries a peer): the
    /// source of zero-copy reads. Every work request posted from it holds a clone until
    /// its completion is polled.
    pub(crate) mr: Option<Arc<MemRegion>>,
    /// The verbs peers given the memory region (`WINFO`), which must answer `REVOKE`
    /// before it is deregistered.
    pub(crate) holders: Arc<Mutex<Holders>>,
}

/// The holders of a window's memory region (see [`WindowEntry::holders`]).
#[derive(Debug, Default)]
pub(crate) struct Holders {
    /// Set when the window is removed: no peer is given the region after that.
    pub(crate) closed: bool,
    pub(crate) peers: Vec<usize>,
}

/// The windows of one fabric, by id. Ids are never reused, so a handle to a dropped
/// window finds nothing (and a key is random, so a forged one finds nothing either).
#[derive(Debug, Default)]
pub(crate) struct Windows {
    table: Mutex<HashMap<u32, WindowEntry>>,
    next: AtomicU32,
    registered: std::sync::atomic::AtomicU64,
    /// Registration with the device of the transport whose peers reach this rank's memory
    /// on their own (verbs), when any peer is reached over one: windows are registered
    /// with it.
    memory: Option<Weak<dyn RemoteMemory>>,
    /// How long a removal waits for the zero-copy reads in flight and for the holders'
    /// answers to `REVOKE` (`FERROCCL_TIMEOUT`).
    timeout: Duration,
    /// `GET`s served (see [`RegStats::gets_served`]).
    gets_served: std::sync::atomic::AtomicU64,
    /// `PUT`s served (see [`RegStats::puts_served`]).
    puts_served: std::sync::atomic::AtomicU64,
    /// `SIGNAL`s served (see [`RegStats::signals_served`]).
    signals_served: std::sync::atomic::AtomicU64,
}

impl Windows {
    /// The window table of a fabric whose peers reach registered memory through `memory`
    /// (`None`: no such peer).
    pub(crate) fn new(memory: Option<Arc<dyn RemoteMemory>>, timeout: Duration) -> Windows {
        Windows { memory: memory.as_ref().map(Arc::downgrade), timeout, ..Windows::default() }
    }

    /// A fresh window id and a random key, for [`Windows::insert`].
    pub(crate) fn new_id(&self) -> Result<(u32, u64)> {
        let mut k = [0u8; 8];
        getrandom::fill(&mut k).map_err(|e| crate::error::Error::internal(format!("the OS random number generator failed: {e}")))?;
        let key = u64::from_le_bytes(k);
        let id = self.next.fetch_add(1, Ordering::Relaxed).wrapping_add(1);
        Ok((id, key))
    }

    /// Adds window `id` (from [`Windows::new_id`]) over `region`. With a verbs mesh the
    /// window is registered with the device first (one memory region over all of it); a
    /// failed registration fails the window (see `docs/one-sided.md`: no silent fallback to
    /// the staging copy), naming the size and, when the memlock limit refused it, the limit.
    pub(crate) fn insert(&self, id: u32, key: u64, region: RegionHandle, writable: bool) -> Result<()> {
        let mr = match self.memory.as_ref().and_then(Weak::upgrade) {
            Some(net) if !region.is_empty() => Some(Arc::new(net.register_window(&region, writable)?)),
            _ => None,
        };
        let holders = Arc::default();
        self.table.lock().unwrap_or_else(|e| e.into_inner()).insert(id, WindowEntry { key, region, writable, mr, holders });
        self.registered.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Removes window `id`: requests naming it are refused from now on. A request being
    /// served finishes first: with a verbs memory region, this sends `REVOKE` to every
    /// holder of the region and waits (polling, at most `FERROCCL_TIMEOUT` in all) until
    /// each has answered and no read posted from it is in flight, and then drops it
    /// (deregistering it and releasing its lease). Returns whether the window was live.
    pub(crate) fn remove(&self, id: u32) -> bool {
        let entry = self.table.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
        let Some(entry) = entry else { return false };
        if let (Some(mr), Some(net)) = (&entry.mr, self.memory.as_ref().and_then(Weak::upgrade)) {
            let deadline = Instant::now() + self.timeout;
            let holders = {
                let mut h = entry.holders.lock().unwrap_or_else(|e| e.into_inner());
                h.closed = true;
                std::mem::take(&mut h.peers)
            };
            // Past the deadline a holder that never answered may still read: its READ then
            // meets the NIC's refusal, which breaks its connection to this rank only.
            let key = entry.key;
            net.clone().revoke(&proto::encode_revoke(id, key, false), &holders, &|ev, p| ev.revoked.remove(&(p, id, key)), deadline);
            // Past the deadline the region goes when its last completion is polled.
            net.wait_unused(mr, deadline);
        }
        true
    }

    /// Registration with the device of the transport whose peers read windows on their
    /// own (see [`Windows::new`]), while the mesh lives.
    pub(crate) fn memory(&self) -> Option<Arc<dyn RemoteMemory>> {
        self.memory.as_ref().and_then(Weak::upgrade)
    }

    /// Counts a `GET` served by this rank as the window's owner.
    pub(crate) fn count_get_served(&self) {
        self.gets_served.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a `PUT` served by this rank as the window's owner.
    pub(crate) fn count_put_served(&self) {
        self.puts_served.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a `SIGNAL` served by this rank as its target.
    pub(crate) fn count_signal_served(&self) {
        self.signals_served.fetch_add(1, Ordering::Relaxed);
    }

    /// Window `id`, if it is live and `key` is its key.
    pub(crate) fn get(&self, id: u32, key: u64) -> Option<WindowEntry> {
        self.table.lock().unwrap_or_else(|e| e.into_inner()).get(&id).filter(|e| e.key == key).cloned()
    }

    /// The windows' part of the statistics: live windows, their bytes, windows registered
    /// so far, and the bytes registered with verbs.
    pub(crate) fn stats(&self) -> RegStats {
        let t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        RegStats {
            windows: t.len(),
            window_bytes: t.values().map(|e| e.region.len() as u64).sum(),
            windows_registered: self.registered.load(Ordering::Relaxed),
            window_bytes_verbs: t.values().filter(|e| e.mr.is_some()).map(|e| e.region.len() as u64).sum(),
            gets_served: self.gets_served.load(Ordering::Relaxed),
            puts_served: self.puts_served.load(Ordering::Relaxed),
            signals_served: self.signals_served.load(Ordering::Relaxed),
            ..RegStats::default()
        }
    }
}

/// Verbs peers' windows this rank reads with RDMA READ and writes with RDMA WRITE (see
/// `crate::rma`), by (owner, window id, key): the memory region the owner gave (`WINFO`),
/// or `None` once it revoked it (also when its `REVOKE` came before the answer it follows
/// on the wire was taken: the entry stays, so that answer is not used), or when the window
/// has no region.
#[derive(Debug, Default)]
pub(crate) struct PeerRegions {
    map: Mutex<HashMap<PeerWindow, Option<Arc<RemoteRegion>>>>,
    /// Regions held and not yet given back (the engine's background thread keeps running
    /// while there are any, so that `REVOKE` is answered outside calls too).
    held: Arc<AtomicUsize>,
}

/// A peer's window: (owner world rank, window id, key).
pub(crate) type PeerWindow = (usize, u32, u64);

/// What [`PeerRegions::get`] knows of a window.
#[derive(Debug)]
pub(crate) enum RegionLookup {
    /// Nothing yet: ask the owner (`WINFO`).
    Unknown,
    /// Read it with RDMA READ, or write it with RDMA WRITE when writable (unless revoked
    /// meanwhile).
    Read(Arc<RemoteRegion>),
    /// Its owner serves its reads.
    Owner,
}

impl PeerRegions {
    pub(crate) fn get(&self, owner: usize, window: u32, key: u64) -> RegionLookup {
        match self.map.lock().unwrap_or_else(|e| e.into_inner()).get(&(owner, window, key)) {
            None => RegionLookup::Unknown,
            Some(Some(r)) => RegionLookup::Read(r.clone()),
            Some(None) => RegionLookup::Owner,
        }
    }

    /// Records the owner's answer, unless an entry exists (another read's answer, or a
    /// `REVOKE` that came first); returns what the entry is now.
    pub(crate) fn insert(&self, owner: usize, window: u32, key: u64, region: Option<Arc<RemoteRegion>>) -> RegionLookup {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        let e = map.entry((owner, window, key)).or_insert_with(|| {
            if region.is_some() {
                self.held.fetch_add(1, Ordering::SeqCst);
            }
            region
        });
        match e {
            Some(r) => RegionLookup::Read(r.clone()),
            None => RegionLookup::Owner,
        }
    }

    /// The owner revoked the window: no READ is issued on its region from now on. Returns
    /// the region (whose reads in flight the holder waits for before answering, and then
    /// calls [`released`](Self::released)), if this rank held it.
    pub(crate) fn revoke(&self, owner: usize, window: u32, key: u64) -> Option<Arc<RemoteRegion>> {
        let r = self.map.lock().unwrap_or_else(|e| e.into_inner()).insert((owner, window, key), None).flatten();
        if let Some(r) = &r {
            r.revoke();
        }
        r
    }

    /// A revoked region was answered for.
    pub(crate) fn released(&self) {
        self.held.fetch_sub(1, Ordering::SeqCst);
    }

    /// The count of regions held (shared with the engine).
    pub(crate) fn held_counter(&self) -> Arc<AtomicUsize> {
        self.held.clone()
    }

    pub(crate) fn held(&self) -> usize {
        self.held.load(Ordering::SeqCst)
    }
}

/// Bytes of a shared window's segment before its data: one page of header, so that the
/// data starts page-aligned and peers reading the header never share a cache line with it.
pub(crate) const SHARED_HEADER: usize = 4096;
/// Header word: the window's key while it is live, 0 from the moment its owner drops it.
const SHARED_LIVE: usize = 0;
/// Header word: 1 when peers may write the window.
const SHARED_WRITABLE: usize = 8;
/// Header bytes before the signal words (see [`SharedWindow::word`]).
const SHARED_WORDS: usize = 64;
/// Sources a shared window's header has a signal word for: one cache line each, so that
/// writers raising theirs never touch a line another writer raises.
pub(crate) const SHARED_WORD_SOURCES: usize = (SHARED_HEADER - SHARED_WORDS) / 64;

/// A window whose memory is a shared segment ([`crate::Communicator::alloc_window`]): its
/// owner made it, and peers on the same host map it and copy straight in and out, with no
/// request and no work by the owner. The segment is an anonymous memfd named after a hash
/// of (job, owner, window id, key): only a holder of the handle can compute the name, and
/// nothing but the window is in it (the header, then exactly the window's bytes). The owner
/// keeps its descriptor open (so that peers can open it through `/proc`) until it drops
/// the window; dropping first clears the header's live word, which every direct access
/// checks before and after it copies.
#[derive(Debug, Clone)]
pub(crate) struct SharedWindow {
    seg: Arc<ShmSegment>,
    key: u64,
}

impl SharedWindow {
    fn name(job: u64, owner: usize, window: u32, key: u64) -> String {
        use sha2::{Digest, Sha256};
        use std::fmt::Write as _;
        let d = Sha256::new()
            .chain_update(b"ferroccl-shared-window\0")
            .chain_update(job.to_le_bytes())
            .chain_update((owner as u64).to_le_bytes())
            .chain_update(window.to_le_bytes())
            .chain_update(key.to_le_bytes())
            .finalize();
        let mut name = String::from("ferroccl-win-");
        for b in &d[..16] {
            let _ = write!(name, "{b:02x}");
        }
        name
    }

    /// The owner's side: a live, zeroed, writable shared window of `len` bytes.
    pub(crate) fn create(job: u64, owner: usize, window: u32, key: u64, len: usize) -> std::io::Result<SharedWindow> {
        let total =
            SHARED_HEADER.checked_add(len).ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, "window too large"))?;
        let seg = ShmSegment::create_anonymous(&Self::name(job, owner, window, key), total)?;
        seg.atomic_u64(SHARED_WRITABLE).store(1, Ordering::Relaxed);
        seg.atomic_u64(SHARED_LIVE).store(key, Ordering::Release);
        Ok(SharedWindow { seg: Arc::new(seg), key })
    }

    /// The owner's view of the window's bytes (its memory, as any window's region).
    pub(crate) fn region(&self) -> Option<RegionHandle> {
        RegionHandle::in_segment(self.seg.clone(), SHARED_HEADER, self.len())
    }

    /// The owner's side, when the window is dropped: every direct access from now on is
    /// refused, and no peer can map the segment any more (those that have keep their
    /// mapping until they notice; the memory is freed when the last one is gone).
    pub(crate) fn end(&self) {
        self.seg.atomic_u64(SHARED_LIVE).store(0, Ordering::Release);
        self.seg.withdraw();
    }

    /// A peer's side: maps window (`window`, `key`) of `len` bytes that world rank `owner`,
    /// process `pid`, shares; fails when it has no such live window.
    fn open(pid: i32, job: u64, owner: usize, window: u32, key: u64, len: u64) -> std::io::Result<SharedWindow> {
        let name = Self::name(job, owner, window, key);
        let total = usize::try_from(len)
            .ok()
            .and_then(|l| l.checked_add(SHARED_HEADER))
            .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, "window too large"))?;
        // Looked up again when a thread-rank's short-lived descriptor closes under the
        // lookup; not when nothing is found (a dropped or forged window costs no wait).
        let seg = ShmSegment::open_anonymous(pid, &name, total, false)?;
        let w = SharedWindow { seg: Arc::new(seg), key };
        if !w.live() {
            return Err(std::io::Error::new(std::io::ErrorKind::NotFound, format!("shared window {name} was dropped")));
        }
        Ok(w)
    }

    /// Signal word of `source` (a member rank of the communicator that uses them) in the
    /// header: a peer that writes the window directly raises it with Release after its
    /// data, and the owner that reads it with Acquire sees the data (the low-latency MoE
    /// path: no message, no work by either engine). `None` past [`SHARED_WORD_SOURCES`].
    pub(crate) fn word(&self, source: usize) -> Option<&AtomicU64> {
        (source < SHARED_WORD_SOURCES).then(|| self.seg.atomic_u64(SHARED_WORDS + source * 64))
    }

    /// Whether the owner still has the window.
    pub(crate) fn live(&self) -> bool {
        self.seg.atomic_u64(SHARED_LIVE).load(Ordering::Acquire) == self.key
    }

    pub(crate) fn writable(&self) -> bool {
        self.seg.atomic_u64(SHARED_WRITABLE).load(Ordering::Relaxed) == 1
    }

    /// The window's length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.seg.len() - SHARED_HEADER
    }

    /// Whether bytes `[offset, offset + len)` lie inside the window.
    pub(crate) fn contains(&self, offset: u64, len: u64) -> bool {
        offset.checked_add(len).is_some_and(|e| e <= self.len() as u64)
    }

    fn fits(&self, offset: u64, n: usize) -> Option<usize> {
        let off = usize::try_from(offset).ok()?;
        (off.checked_add(n)? <= self.len()).then_some(SHARED_HEADER + off)
    }

    /// Copies window bytes `[offset, offset + dst.len())` into `dst`; `false` (nothing
    /// copied) when the range is not inside the window.
    pub(crate) fn read(&self, offset: u64, dst: &mut [u8]) -> bool {
        match self.fits(offset, dst.len()) {
            Some(at) => {
                self.seg.read(at, dst);
                true
            }
            None => false,
        }
    }

    /// Copies `src` to window bytes `[offset, offset + src.len())`; `false` (nothing
    /// copied) when the range is not inside the window.
    pub(crate) fn write(&self, offset: u64, src: &[u8]) -> bool {
        match self.fits(offset, src.len()) {
            Some(at) => {
                self.seg.write(at, src);
                true
            }
            None => false,
        }
    }
}

/// Peers' shared windows this process has mapped (and the handles it found unmappable),
/// by (owner, window id, key). A mapping is made at the first access through a handle and
/// kept; one found dropped by its owner is unmapped then, and whenever a new one is made.
#[derive(Debug, Default)]
pub(crate) struct PeerWindows {
    map: Mutex<HashMap<(usize, u32, u64), Option<SharedWindow>>>,
}

impl PeerWindows {
    /// The mapping of window (`window`, `key`, `len` bytes) of world rank `owner`, whose
    /// process is `pid` on this host; `None` when it cannot be mapped (remembered: the next
    /// access asks the owner at once).
    pub(crate) fn get(&self, pid: i32, job: u64, owner: usize, window: u32, key: u64, len: u64) -> Option<SharedWindow> {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(m) = map.get(&(owner, window, key)) {
            return m.clone();
        }
        map.retain(|_, m| m.as_ref().is_none_or(SharedWindow::live));
        let m = SharedWindow::open(pid, job, owner, window, key, len).ok();
        map.insert((owner, window, key), m.clone());
        m
    }

    /// Forgets (unmaps) a window its owner has dropped.
    pub(crate) fn forget(&self, owner: usize, window: u32, key: u64) {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(slot) = map.get_mut(&(owner, window, key)) {
            *slot = None;
        }
    }

    /// Peers' windows mapped now.
    pub(crate) fn mapped(&self) -> usize {
        self.map.lock().unwrap_or_else(|e| e.into_inner()).values().filter(|m| m.is_some()).count()
    }
}

#[derive(Debug)]
struct RegEntry {
    /// The key peers address (the id of the first region registered over the range).
    key: u64,
    /// Id of the region the key reaches now.
    bound: u64,
    last_use: u64,
}

#[derive(Debug, Default)]
struct RegCache {
    entries: HashMap<(u64, usize), RegEntry>,
    clock: u64,
    stats: RegStats,
}

/// The registration table and cache of one fabric.
#[derive(Debug)]
pub(crate) struct Registry {
    inbox: Arc<Inbox>,
    cache: Mutex<RegCache>,
    max_entries: usize,
    next_imm: AtomicU32,
}

impl Registry {
    /// An empty table binding keys in `inbox`, caching at most `max_entries` ranges.
    pub(crate) fn new(inbox: Arc<Inbox>, max_entries: usize) -> Registry {
        Registry { inbox, cache: Mutex::default(), max_entries, next_imm: AtomicU32::new(1) }
    }

    /// Registers `[offset, offset + len)` of a region for a remote write by world rank
    /// `peer`; returns the descriptor to advertise and what the receiver holds until the
    /// write has landed (for a verbs peer: the memory region, see [`WriteGrant`]).
    ///
    /// shm and tcp peers go through the registration cache ([`Registry::register_cached`]). A
    /// verbs peer gets a memory region over exactly that range, held by the receive until
    /// the write lands (inside the call's scope): user memory is not cached in verbs
    /// registrations, because nothing tells the library when it is freed and remapped.
    /// Those registrations count as misses in the statistics.
    pub(crate) fn register(
        &self,
        h: &RegionHandle,
        offset: usize,
        len: usize,
        peer: Option<&dyn Endpoint>,
    ) -> Result<(RemoteBuf, WriteGrant)> {
        if let Some(registered) = peer.map(|ep| ep.register_for_write(h, offset, len)).transpose()?.flatten() {
            self.cache.lock().unwrap_or_else(|e| e.into_inner()).stats.registrations += 1;
            return Ok(registered);
        }
        let key = self.register_cached(h);
        Ok((RemoteBuf { addr: h.addr() + offset as u64, len: len as u64, key }, WriteGrant::default()))
    }

    /// Registers a region for remote writes through the registration cache; returns its key.
    ///
    /// The cache is keyed by address range: a region over a range registered before (the
    /// same buffer in a later call) reuses that registration's key, rebound to the new
    /// handle, instead of registering again. Nothing is pinned for shm and tcp, and a key
    /// only ever reaches memory through the handle bound to it, which is valid only while
    /// its call runs: a stale entry can never misdirect a write, it can only fail it.
    pub(crate) fn register_cached(&self, h: &RegionHandle) -> u64 {
        let range = (h.addr(), h.len());
        let mut guard = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        let cache = &mut *guard;
        cache.clock += 1;
        let clock = cache.clock;
        let key = match cache.entries.get_mut(&range) {
            Some(e) => {
                e.last_use = clock;
                if e.bound != h.id() {
                    e.bound = h.id();
                    cache.stats.hits += 1;
                    let key = e.key;
                    self.inbox.regions.write().unwrap_or_else(|e| e.into_inner()).insert(key, h.clone());
                    key
                } else {
                    e.key
                }
            }
            None => {
                let key = h.id();
                cache.entries.insert(range, RegEntry { key, bound: key, last_use: clock });
                cache.stats.registrations += 1;
                cache.stats.registered_bytes += h.len() as u64;
                flog!(Trace, Reg, "registered {} B at {:#x} as {key:#x} ({} entries)", h.len(), h.addr(), cache.entries.len());
                let mut regions = self.inbox.regions.write().unwrap_or_else(|e| e.into_inner());
                regions.insert(key, h.clone());
                if cache.entries.len() > self.max_entries {
                    // Evict the least recently used entry whose memory no call is using.
                    let victim = cache
                        .entries
                        .iter()
                        .filter(|(_, e)| regions.get(&e.key).is_none_or(|r| !r.is_valid()))
                        .min_by_key(|(_, e)| e.last_use)
                        .map(|(r, e)| (*r, e.key));
                    if let Some((r, k)) = victim {
                        cache.entries.remove(&r);
                        regions.remove(&k);
                        cache.stats.evictions += 1;
                        flog!(Trace, Reg, "evicted {} B at {:#x} ({k:#x}), least recently used", r.1, r.0);
                        cache.stats.registered_bytes -= r.1 as u64;
                    }
                }
                key
            }
        };
        key
    }

    /// Drops the registration of `h`'s address range (a plan's buffers, when it is dropped).
    pub(crate) fn deregister(&self, h: &RegionHandle) {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = cache.entries.remove(&(h.addr(), h.len())) {
            self.inbox.regions.write().unwrap_or_else(|e| e.into_inner()).remove(&e.key);
            cache.stats.registered_bytes -= h.len() as u64;
        }
    }

    /// The registration cache's counters.
    pub(crate) fn stats(&self) -> RegStats {
        let cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        RegStats { entries: cache.entries.len(), ..cache.stats }
    }

    /// A fresh immediate for a rendezvous write: 31 bits (verbs keeps the top bit for its
    /// own control messages).
    pub(crate) fn next_imm(&self) -> u32 {
        self.next_imms(1)
    }

    /// `n` fresh consecutive immediates (the first; the others follow it, wrapping in 31
    /// bits).
    pub(crate) fn next_imms(&self, n: u32) -> u32 {
        self.next_imm.fetch_add(n.max(1), Ordering::Relaxed) & 0x7fff_ffff
    }
}
