//! The fabric: this process's endpoints to every other rank (the mesh), the event state the
//! transports fill, the registration table (and its cache), the progress engine that runs
//! every operation (`crate::engine`), and the wait loop of mesh setup and shutdown.
//!
//! Communicators (the world one and every `split` of it) share one fabric. Threading: any
//! thread may call into a fabric; transports deliver into [`Shared`] under a mutex, and
//! whoever drives the engine (a waiting thread, or the engine's own thread) drains the shm
//! rings.
//!
//! Waiting: a waiter polls (spin), then yields, then sleeps on its doorbell (a futex word
//! that producers bump) for at most a few milliseconds at a time, checking every peer's
//! health as it goes: a peer process that exits without saying goodbye, a TCP connection
//! that drops, or the launcher dying fails every waiter promptly with the peer named.

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use ferroccl_mem::futex::{futex_wait, futex_wake};
use ferroccl_mem::process::{can_read_process, ProcessWatch};
use ferroccl_mem::region::RegionHandle;

use crate::bootstrap::auth;
use crate::bootstrap::{StoreClient, StoreServer};
use crate::engine::Engine;
use crate::error::{Error, Fault, FaultKind, Result};
use crate::params::{Params, TransportChoice};
use crate::poll::Poll;
use crate::proto::{self, Cts, Leave, ProtoMsg, StreamKey};
use crate::transport::shm::{LocalShm, ShmEndpoint};
use crate::transport::tcp::TcpEndpoint;
use crate::transport::verbs::{self, VerbsDevice, VerbsEndpoint, VerbsNet};
use crate::transport::{Endpoint, Registration, RemoteBuf};
use crate::wire::{Reader, Writer};

/// An eager message waiting to be received.
#[derive(Debug)]
pub(crate) struct Incoming {
    pub(crate) seq: u32,
    /// The sender's call number (0 for point-to-point).
    pub(crate) call: u32,
    pub(crate) desc: proto::Desc,
    pub(crate) data: Vec<u8>,
    /// `Some(len)` for a rendezvous sender's ready-to-send (no data).
    pub(crate) rts: Option<u64>,
}

/// Everything transports report, waiting to be matched by a caller.
#[derive(Debug, Default)]
pub(crate) struct Events {
    pub(crate) data: HashMap<StreamKey, VecDeque<Incoming>>,
    pub(crate) cts: HashMap<StreamKey, VecDeque<Cts>>,
    pub(crate) imms: HashSet<(usize, u32)>,
    /// The first fatal fault. Poisons the fabric.
    pub(crate) fatal: Option<Fault>,
    /// Peers that said goodbye.
    pub(crate) closed: HashSet<usize>,
    /// Where peers stopped on communicators they left: (communicator id, peer world
    /// rank) -> its `LEAVE` record.
    pub(crate) left: HashMap<(u32, usize), Leave>,
    /// (communicator, world rank) of every member whose `AGREED` arrived (finalize's
    /// second round).
    pub(crate) agreed: HashSet<(u32, usize)>,
    /// Probes from peers, not yet answered: (peer world rank, communicator id, call
    /// number, descriptor). At most [`MAX_PROBES`]; more are dropped (peers probe again).
    pub(crate) probes: Vec<(usize, u32, u32, proto::Desc)>,
    /// Set by an abort: `Some(None)` by this rank, `Some(Some(r))` by rank `r`.
    pub(crate) aborted: Option<Option<usize>>,
    /// Raised with `fatal`, readable without the lock (the driver looks every round).
    pub(crate) fatal_flag: Arc<AtomicBool>,
    /// Connections that broke without a reason (peer, what, when), not yet fatal: a
    /// peer that gives up because a third rank died closes its connections right after
    /// telling us why, and its close can overtake the reason (or the reason was skipped).
    /// So a broken connection becomes the fatal error only after [`SUSPECT_GRACE`], unless
    /// a reported cause (an `ERR`, a watched process's death) comes first; and then the
    /// earliest one.
    pub(crate) suspects: Vec<(usize, String, Instant)>,
}

/// Probes kept for the engine at most.
const MAX_PROBES: usize = 256;

/// How long a connection that broke without a reason waits for a better explanation.
pub(crate) const SUSPECT_GRACE: Duration = Duration::from_millis(100);

impl Events {
    /// Makes `peer` (a world rank; `usize::MAX` for none) the cause of a fatal failure found
    /// by this rank, unless something is fatal already.
    pub(crate) fn set_fatal(&mut self, peer: usize, what: String) {
        let culprit = (peer != usize::MAX).then_some(peer);
        self.set_fault(Fault { kind: FaultKind::Failed, culprit, reporter: None, op: String::new(), what });
    }

    /// Makes `f` the fabric's fatal fault, unless something is fatal already.
    pub(crate) fn set_fault(&mut self, f: Fault) {
        if self.fatal.is_none() {
            self.fatal = Some(f);
            self.fatal_flag.store(true, Ordering::SeqCst);
        }
    }
}

enum Bell {
    Shm(Arc<LocalShm>),
    Heap(AtomicU32, AtomicU32),
}

impl std::fmt::Debug for Bell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Bell::Shm(_) => "Bell::Shm",
            Bell::Heap(..) => "Bell::Heap",
        })
    }
}

impl Bell {
    fn word(&self) -> &AtomicU32 {
        match self {
            Bell::Shm(s) => s.bell(),
            Bell::Heap(w, _) => w,
        }
    }
    fn sleeping(&self) -> &AtomicU32 {
        match self {
            Bell::Shm(s) => s.sleeping(),
            Bell::Heap(_, s) => s,
        }
    }
}

/// The part of the fabric transports' background threads share.
#[derive(Debug)]
pub(crate) struct Shared {
    rank: usize,
    pub(crate) events: Mutex<Events>,
    regions: RwLock<HashMap<u64, RegionHandle>>,
    bell: Bell,
    fatal_flag: Arc<AtomicBool>,
    /// Raised when the first `LEAVE` arrives: until then a send need not look for one.
    any_left: AtomicBool,
    /// Raised while probes wait in [`Events::probes`].
    any_probe: AtomicBool,
    /// Message buffers for reuse, so that receiving an eager message allocates nothing once
    /// the pool is warm.
    bufs: Mutex<Vec<Vec<u8>>>,
}

/// Message buffers kept for reuse at most, and the largest kept.
const BUF_POOL: usize = 64;
const BUF_POOL_MAX_BYTES: usize = 1 << 20;
/// Every pooled buffer holds at least this much, and the pool starts with
/// [`BUF_POOL_START`] of them: messages up to this size (every control message, small
/// eager data) find a buffer even when several wait to be matched at once.
const BUF_MIN_BYTES: usize = 16 << 10;
const BUF_POOL_START: usize = 8;

impl Shared {
    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, Events> {
        self.events.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wakes a waiter of this process (used by in-process producers: tcp reader threads).
    pub(crate) fn notify(&self) {
        self.bell.word().fetch_add(1, Ordering::SeqCst);
        if self.bell.sleeping().load(Ordering::SeqCst) != 0 {
            let _ = futex_wake(self.bell.word(), i32::MAX as u32);
        }
    }

    /// Whether the fabric has a fatal error (or was aborted); no lock.
    pub(crate) fn has_fatal(&self) -> bool {
        self.fatal_flag.load(Ordering::SeqCst)
    }

    /// The doorbell's current value: read it before looking for work, then sleep with
    /// [`Fabric::sleep_on_bell`] only if it has not moved.
    pub(crate) fn bell_seen(&self) -> u32 {
        self.bell.word().load(Ordering::SeqCst)
    }

    /// A buffer of `len` bytes for an incoming message (from the pool when one fits).
    pub(crate) fn take_buf(&self, len: usize) -> Vec<u8> {
        let mut pool = self.bufs.lock().unwrap_or_else(|e| e.into_inner());
        // The smallest that fits, so that small messages do not take the large buffers.
        let best = pool.iter().enumerate().filter(|(_, b)| b.capacity() >= len).min_by_key(|(_, b)| b.capacity()).map(|(i, _)| i);
        let mut v = match best {
            Some(i) => pool.swap_remove(i),
            None => Vec::with_capacity(len.max(BUF_MIN_BYTES)),
        };
        drop(pool);
        v.clear();
        v.resize(len, 0);
        v
    }

    /// Gives a message buffer back for reuse.
    pub(crate) fn give_buf(&self, v: Vec<u8>) {
        if v.capacity() < BUF_MIN_BYTES || v.capacity() > BUF_POOL_MAX_BYTES {
            return;
        }
        let mut pool = self.bufs.lock().unwrap_or_else(|e| e.into_inner());
        if pool.len() < BUF_POOL {
            pool.push(v);
        }
    }

    /// A two-sided message arrived from `peer`.
    pub(crate) fn deliver_msg(&self, peer: usize, bytes: Vec<u8>) {
        let decoded = match proto::decode_keep(bytes) {
            Ok((m, spare)) => {
                if let Some(v) = spare {
                    self.give_buf(v);
                }
                Ok(m)
            }
            Err(e) => Err(e),
        };
        let mut ev = self.lock();
        match decoded {
            Ok(ProtoMsg::Eager { comm, chan, seq, call, desc, data }) => {
                ev.data.entry((comm, chan, peer)).or_default().push_back(Incoming { seq, call, desc, data, rts: None })
            }
            Ok(ProtoMsg::Cts { comm, chan, cts }) => ev.cts.entry((comm, chan, peer)).or_default().push_back(cts),
            Ok(ProtoMsg::Rts { comm, chan, seq, call, desc, len }) => {
                ev.data.entry((comm, chan, peer)).or_default().push_back(Incoming { seq, call, desc, data: Vec::new(), rts: Some(len) })
            }
            Ok(ProtoMsg::Err(mut f)) => {
                // A report carries the rank that found the fault; a peer that relays one
                // keeps it. Never trust a report to speak for this rank.
                if f.reporter.is_none_or(|r| r == self.rank) {
                    f.reporter = Some(peer);
                }
                if f.kind == FaultKind::Aborted {
                    ev.aborted.get_or_insert(f.reporter);
                }
                ev.set_fault(f);
            }
            Ok(ProtoMsg::Leave { comm, leave }) => {
                ev.left.insert((comm, peer), leave);
                self.any_left.store(true, Ordering::Release);
            }
            Ok(ProtoMsg::Agreed { comm }) => {
                ev.agreed.insert((comm, peer));
            }
            Ok(ProtoMsg::Probe { comm, call, desc }) => {
                if ev.probes.len() < MAX_PROBES {
                    ev.probes.push((peer, comm, call, desc));
                    self.any_probe.store(true, Ordering::Release);
                }
            }
            Err(e) => ev.set_fatal(peer, format!("sent a malformed message: {e}")),
        }
    }

    /// The probes that arrived since the last call (see [`ProtoMsg::Probe`]); no lock when
    /// there are none.
    pub(crate) fn take_probes(&self) -> Vec<(usize, u32, u32, proto::Desc)> {
        if !self.any_probe.swap(false, Ordering::AcqRel) {
            return Vec::new();
        }
        std::mem::take(&mut self.lock().probes)
    }

    /// Whether any peer has left a communicator (a `LEAVE` arrived); no lock.
    pub(crate) fn any_left(&self) -> bool {
        self.any_left.load(Ordering::Acquire)
    }

    /// Lands `len` bytes of a one-sided write at `addr` in registration `key`, using `fill`
    /// to produce them straight into the registered memory.
    pub(crate) fn land_write(
        &self,
        peer: usize,
        key: u64,
        addr: u64,
        len: usize,
        fill: impl FnOnce(&mut [u8]) -> std::result::Result<(), String>,
    ) -> Result<()> {
        let region = self.regions.read().unwrap_or_else(|e| e.into_inner()).get(&key).cloned();
        let fail = |what: String| {
            let e = Error::Transport { rank: self.rank, peer, transport: "fabric", what: what.clone() };
            self.lock().set_fatal(peer, what);
            e
        };
        let Some(region) = region else {
            return Err(fail(format!("wrote into registration {key:#x}, which is not (or no longer) registered")));
        };
        let off = addr.checked_sub(region.addr()).and_then(|o| usize::try_from(o).ok());
        let Some(off) = off.filter(|&o| o.checked_add(len).is_some_and(|e| e <= region.len())) else {
            return Err(fail(format!("wrote {len} bytes at {addr:#x}, outside registration {key:#x}")));
        };
        match region.with_slice_mut(off, len, fill) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(what)) => Err(fail(what)),
            Err(e) => Err(fail(format!("its write into registration {key:#x} failed: {e}"))),
        }
    }

    /// A write with immediate `imm` from `peer` has fully landed.
    pub(crate) fn write_imm(&self, peer: usize, imm: u32) {
        self.lock().imms.insert((peer, imm));
    }

    /// `peer` said goodbye.
    pub(crate) fn peer_closed(&self, peer: usize) {
        self.lock().closed.insert(peer);
    }

    /// `peer`'s connection broke (a suspect until [`SUSPECT_GRACE`] passes: see
    /// [`Events::suspects`]).
    pub(crate) fn peer_failed(&self, peer: usize, reason: String) {
        let mut ev = self.lock();
        if !ev.closed.contains(&peer) && ev.fatal.is_none() && !ev.suspects.iter().any(|s| s.0 == peer) {
            ev.suspects.push((peer, reason, Instant::now()));
        }
        drop(ev);
        self.notify();
    }

    /// Makes the earliest suspect fatal once it is [`SUSPECT_GRACE`] old (and nothing else
    /// became fatal meanwhile).
    pub(crate) fn promote_suspects(&self, now: Instant) {
        let mut ev = self.lock();
        if ev.fatal.is_some() || ev.suspects.is_empty() {
            return;
        }
        if let Some((peer, what, at)) = ev.suspects.iter().min_by_key(|s| s.2).cloned() {
            if now.saturating_duration_since(at) >= SUSPECT_GRACE {
                ev.set_fatal(peer, what);
                drop(ev);
                self.notify();
            }
        }
    }

    /// The root cause to report for a connection that broke under a write: a reported
    /// cause if there is one; else, if connections broke without a reason, the earliest of
    /// them once its grace has passed (a reported cause may still arrive meanwhile; at most
    /// until `until`); else `None` at once.
    pub(crate) fn root_cause(&self, until: Instant) -> Option<Fault> {
        loop {
            let now = Instant::now();
            self.promote_suspects(now);
            let ev = self.lock();
            if let Some(f) = ev.fatal.as_ref().filter(|f| f.culprit.is_some() || f.reporter.is_some()) {
                return Some(f.clone());
            }
            let earliest = ev.suspects.iter().min_by_key(|s| s.2)?;
            if now >= until {
                let (culprit, what) = (Some(earliest.0), earliest.1.clone());
                return Some(Fault { kind: FaultKind::Failed, culprit, reporter: None, op: String::new(), what });
            }
            drop(ev);
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

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

/// What each rank publishes about itself, in one packed store value.
#[derive(Debug, Clone)]
struct Descriptor {
    pid: u32,
    host_id: String,
    hostname: String,
    /// The inbox segment's memfd name and descriptor number ("" / 0 when none).
    shm_name: String,
    shm_fd: u32,
    tcp_addr: String,
    probe_addr: u64,
    ring_bytes: u64,
    eager_max: u64,
    /// The RDMA device this rank can use for verbs ("" when none).
    ib_dev: String,
}

impl Descriptor {
    fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        w.u32(self.pid)
            .str(&self.host_id)
            .str(&self.hostname)
            .str(&self.shm_name)
            .u32(self.shm_fd)
            .str(&self.tcp_addr)
            .u64(self.probe_addr)
            .u64(self.ring_bytes)
            .u64(self.eager_max)
            .str(&self.ib_dev);
        w.finish()
    }
    fn decode(b: &[u8]) -> crate::wire::DResult<Descriptor> {
        let mut r = Reader::new(b);
        let d = Descriptor {
            pid: r.u32()?,
            host_id: r.str()?.to_string(),
            hostname: r.str()?.to_string(),
            shm_name: r.str()?.to_string(),
            shm_fd: r.u32()?,
            tcp_addr: r.str()?.to_string(),
            probe_addr: r.u64()?,
            ring_bytes: r.u64()?,
            eager_max: r.u64()?,
            ib_dev: r.str()?.to_string(),
        };
        r.end()?;
        Ok(d)
    }
}

/// This host's identity: ranks with equal ids use shared memory. Same boot, same mount
/// namespace (so the same /dev/shm) and same pid namespace (so pids mean the same process).
pub(crate) fn host_identity(params: &Params) -> String {
    if let Some(h) = &params.host_id {
        return h.clone();
    }
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let ns = |n: &str| std::fs::read_link(format!("/proc/self/ns/{n}")).map(|p| p.display().to_string()).unwrap_or_default();
    format!("{}/{}/{}", boot.trim(), ns("mnt"), ns("pid"))
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|s| s.trim().to_string()).unwrap_or_else(|_| "?".into())
}

/// Everything needed to build a fabric.
#[derive(Debug)]
pub(crate) struct FabricConfig {
    pub(crate) rank: usize,
    pub(crate) size: usize,
    pub(crate) token: String,
    pub(crate) params: Params,
    pub(crate) store: StoreClient,
    pub(crate) server: Option<StoreServer>,
    /// Prefix of this communicator's store keys (unique per init in the job).
    pub(crate) key_prefix: String,
}

/// Per-peer facts for reporting.
#[derive(Debug, Clone)]
pub(crate) struct PeerInfo {
    pub(crate) hostname: String,
}

/// This process's mesh.
#[derive(Debug)]
pub(crate) struct Fabric {
    pub(crate) rank: usize,
    pub(crate) size: usize,
    pub(crate) params: Params,
    pub(crate) shared: Arc<Shared>,
    endpoints: Vec<Option<Endpoint>>,
    local_shm: Option<Arc<LocalShm>>,
    /// The verbs mesh (polled in `progress`), when any peer uses verbs.
    verbs: Option<Arc<VerbsNet>>,
    /// (world rank, watch) for every shm peer, plus the launcher as usize::MAX.
    watches: Vec<(usize, ProcessWatch)>,
    pub(crate) peers: Vec<PeerInfo>,
    /// Runs every operation in flight (see `engine`).
    pub(crate) engine: Arc<Engine>,
    reg_cache: Mutex<RegCache>,
    store: Mutex<Option<StoreClient>>,
    server: Mutex<Option<StoreServer>>,
    key_prefix: String,
    next_imm: AtomicU32,
    health_at: Mutex<Instant>,
    closed: AtomicBool,
    /// Set when the world communicator is finalized: every later call fails.
    finalized: AtomicBool,
    told_peers: AtomicBool,
    /// Kept alive: peers probe cross-memory attach by reading it.
    _probe: Box<[u8; 64]>,
    pub(crate) setup_time: Duration,
}

fn unique_suffix() -> String {
    let mut b = [0u8; 6];
    let _ = getrandom::fill(&mut b);
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl Fabric {
    /// Builds the mesh: publish our descriptor, fetch everyone's in one round trip, connect
    /// shm and tcp endpoints, wait until every peer has confirmed.
    pub(crate) fn connect(cfg: FabricConfig) -> Result<Fabric> {
        let t0 = Instant::now();
        let FabricConfig { rank, size, token, params, store, server, key_prefix } = cfg;
        let deadline = t0 + params.timeout;
        let host_id = host_identity(&params);
        let probe = Box::new([0x5au8; 64]);

        // This rank's inbox segment (unless shm is switched off or unavailable).
        let local_shm = if matches!(params.transport, TransportChoice::Auto | TransportChoice::Shm) && size > 1 {
            let name = format!("ferroccl-{}-{}-{}", std::process::id(), rank, unique_suffix());
            match LocalShm::create(&name, rank, size, params.shm_ring_bytes) {
                Ok(s) => Some(Arc::new(s)),
                Err(e) if params.transport == TransportChoice::Shm => {
                    return Err(Error::io(format!("rank {rank}: create shared-memory segment {name}"), e))
                }
                Err(_) => None,
            }
        } else {
            None
        };
        let bell = match &local_shm {
            Some(s) => Bell::Shm(s.clone()),
            None => Bell::Heap(AtomicU32::new(0), AtomicU32::new(0)),
        };
        let fatal_flag = Arc::new(AtomicBool::new(false));
        let shared = Arc::new(Shared {
            rank,
            events: Mutex::new(Events { fatal_flag: fatal_flag.clone(), ..Events::default() }),
            fatal_flag,
            any_left: AtomicBool::new(false),
            any_probe: AtomicBool::new(false),
            regions: RwLock::new(HashMap::new()),
            bell,
            bufs: Mutex::new((0..BUF_POOL_START).map(|_| Vec::with_capacity(BUF_MIN_BYTES)).collect()),
        });

        // A listener for tcp peers.
        let listener = if matches!(params.transport, TransportChoice::Auto | TransportChoice::Tcp) && size > 1 {
            let ip: IpAddr = params.socket_addr.unwrap_or_else(|| store.local_addr().ip());
            let l = TcpListener::bind(SocketAddr::new(ip, 0)).map_err(|e| Error::io(format!("rank {rank}: listen on {ip}"), e))?;
            Some(l)
        } else {
            None
        };
        // verbs: FERROCCL_TRANSPORT=verbs needs a usable device; auto uses one if there is.
        // Without one, this rank still publishes its descriptor (with no device) before it
        // fails, so that its peers fail at once too, instead of waiting for it.
        let (ib, ib_err) = match params.transport {
            TransportChoice::Verbs if size > 1 => match VerbsDevice::open(rank, &params) {
                Ok(d) => (Some(d), None),
                Err(e) => (None, Some(e)),
            },
            TransportChoice::Auto if size > 1 && ferroccl_verbs::ENABLED => (VerbsDevice::open(rank, &params).ok(), None),
            _ => (None, None),
        };
        let me = Descriptor {
            pid: std::process::id(),
            host_id: host_id.clone(),
            hostname: hostname(),
            shm_name: local_shm.as_ref().map(|s| s.name().to_string()).unwrap_or_default(),
            shm_fd: local_shm.as_ref().and_then(|s| s.fd()).and_then(|f| u32::try_from(f).ok()).unwrap_or(0),
            tcp_addr: listener.as_ref().and_then(|l| l.local_addr().ok()).map(|a| a.to_string()).unwrap_or_default(),
            probe_addr: probe.as_ptr() as u64,
            ring_bytes: params.shm_ring_bytes as u64,
            eager_max: params.eager_max as u64,
            ib_dev: ib.as_ref().map(|d| d.name()).unwrap_or_default(),
        };
        store.set(&format!("{key_prefix}/ep/{rank}"), &me.encode())?;
        let keys: Vec<String> = (0..size).map(|r| format!("{key_prefix}/ep/{r}")).collect();
        let left = deadline.saturating_duration_since(Instant::now());
        let raw = store.multi_get(&keys, left)?;
        let mut descs = Vec::with_capacity(size);
        for (r, b) in raw.iter().enumerate() {
            let d = Descriptor::decode(b).map_err(|e| Error::protocol(format!("rank {r}'s descriptor"), e.to_string()))?;
            if d.eager_max != me.eager_max {
                return Err(Error::invalid(format!(
                    "FERROCCL_EAGER_MAX differs between ranks: {} on rank {rank}, {} on rank {r}",
                    me.eager_max, d.eager_max
                )));
            }
            descs.push(d);
        }
        if let Some(e) = ib_err {
            return Err(e);
        }

        // Pick a transport per peer; both sides decide from the same facts.
        let mut kinds = vec![""; size];
        for (p, d) in descs.iter().enumerate() {
            if p == rank {
                continue;
            }
            let same_host = d.host_id == host_id;
            let shm_ok = same_host && local_shm.is_some() && !d.shm_name.is_empty();
            kinds[p] = match params.transport {
                TransportChoice::Tcp => "tcp",
                TransportChoice::Shm if shm_ok => "shm",
                TransportChoice::Shm => {
                    return Err(Error::Transport {
                        rank,
                        peer: p,
                        transport: "shm",
                        what: if same_host {
                            "FERROCCL_TRANSPORT=shm but it has no shared-memory segment".into()
                        } else {
                            format!("FERROCCL_TRANSPORT=shm but it is on another host ({}, this is {})", d.hostname, me.hostname)
                        },
                    })
                }
                TransportChoice::Auto if shm_ok => "shm",
                TransportChoice::Auto if !same_host && !me.ib_dev.is_empty() && !d.ib_dev.is_empty() => "verbs",
                TransportChoice::Auto => "tcp",
                TransportChoice::Verbs if !d.ib_dev.is_empty() => "verbs",
                TransportChoice::Verbs => {
                    return Err(Error::Transport {
                        rank,
                        peer: p,
                        transport: "verbs",
                        what: format!(
                            "FERROCCL_TRANSPORT=verbs but rank {p} (on {}) has no usable RDMA device (its own error says why), or FERROCCL_TRANSPORT differs between ranks",
                            d.hostname
                        ),
                    })
                }
            };
            if kinds[p] == "shm" && d.ring_bytes != me.ring_bytes {
                return Err(Error::invalid(format!(
                    "FERROCCL_SHM_RING_BYTES differs between ranks: {} on rank {rank}, {} on rank {p}",
                    me.ring_bytes, d.ring_bytes
                )));
            }
            if kinds[p] == "tcp" && d.tcp_addr.is_empty() {
                return Err(Error::Transport {
                    rank,
                    peer: p,
                    transport: "tcp",
                    what: "the peer has no tcp listener (FERROCCL_TRANSPORT differs between ranks?)".into(),
                });
            }
        }

        let mut endpoints: Vec<Option<Endpoint>> = (0..size).map(|_| None).collect();
        let mut watches = Vec::new();
        let mut hellos = Vec::new();
        for p in 0..size {
            if kinds[p] != "shm" {
                continue;
            }
            let d = &descs[p];
            let local = local_shm.clone().ok_or_else(|| Error::invalid("internal: shm peer without a local segment"))?;
            let ep = ShmEndpoint::connect(
                rank,
                p,
                d.pid as i32,
                d.shm_fd as i32,
                &d.shm_name,
                size,
                params.shm_ring_bytes,
                params.shm_inline_max,
                params.shm_cma,
                local,
            )?;
            let watch =
                ProcessWatch::new(d.pid as i32).map_err(|e| Error::io(format!("rank {rank}: watch rank {p} (pid {})", d.pid), e))?;
            watches.push((p, watch));
            let can_pull = params.shm_cma && can_read_process(d.pid as i32, d.probe_addr);
            hellos.push((p, can_pull));
            endpoints[p] = Some(Endpoint::Shm(ep));
        }
        // verbs: one RC queue pair per peer. Peers on this host are watched like shm peers,
        // so that a dead one is noticed without waiting for a work request to fail.
        let verbs_peers: Vec<usize> = (0..size).filter(|&p| kinds[p] == "verbs").collect();
        let verbs = match ib {
            Some(dev) if !verbs_peers.is_empty() => {
                Some(VerbsNet::connect(dev, rank, &verbs_peers, &store, &key_prefix, size, deadline, shared.clone())?)
            }
            _ => None,
        };
        if let Some(net) = &verbs {
            for &p in &verbs_peers {
                endpoints[p] = Some(Endpoint::Verbs(VerbsEndpoint::new(net.clone(), p)));
                if descs[p].host_id == host_id {
                    if let Ok(w) = ProcessWatch::new(descs[p].pid as i32) {
                        watches.push((p, w));
                    }
                }
            }
        }
        if let Some(pid) = params.launcher_pid {
            if let Ok(w) = ProcessWatch::new(pid) {
                watches.push((usize::MAX, w));
            }
        }

        // TCP: the lower rank connects, the higher accepts.
        let tcp_peers: Vec<usize> = (0..size).filter(|&p| kinds[p] == "tcp").collect();
        if !tcp_peers.is_empty() {
            let listener = listener.as_ref().ok_or_else(|| Error::invalid("internal: tcp peer without a listener"))?;
            let expect: Vec<usize> = tcp_peers.iter().copied().filter(|&p| p < rank).collect();
            let streams = std::thread::scope(|s| -> Result<Vec<(usize, TcpStream)>> {
                let acceptor = s.spawn(|| accept_peers(listener, rank, &expect, &token, &key_prefix, deadline));
                let mut out = Vec::new();
                for &p in tcp_peers.iter().filter(|&&p| p > rank) {
                    out.push((p, connect_peer(rank, p, &descs[p].tcp_addr, &token, &key_prefix, deadline)?));
                }
                let accepted = acceptor.join().map_err(|_| Error::invalid("internal: tcp acceptor panicked"))??;
                out.extend(accepted);
                Ok(out)
            })?;
            for (p, stream) in streams {
                endpoints[p] = Some(Endpoint::Tcp(TcpEndpoint::start(rank, p, stream, shared.clone())?));
            }
        }
        drop(listener);

        let peers = descs.iter().map(|d| PeerInfo { hostname: d.hostname.clone() }).collect();
        let fabric = Fabric {
            rank,
            size,
            params,
            shared,
            endpoints,
            local_shm,
            verbs,
            watches,
            peers,
            engine: Arc::default(),
            reg_cache: Mutex::default(),
            store: Mutex::new(Some(store)),
            server: Mutex::new(server),
            key_prefix,
            next_imm: AtomicU32::new(1),
            health_at: Mutex::new(Instant::now()),
            closed: AtomicBool::new(false),
            finalized: AtomicBool::new(false),
            told_peers: AtomicBool::new(false),
            _probe: probe,
            setup_time: Duration::ZERO,
        };

        // Say hello to every shm peer, then wait for theirs: proof that each has mapped our
        // segment, so its name can go.
        for &(p, can_pull) in &hellos {
            if let Some(Endpoint::Shm(ep)) = &fabric.endpoints[p] {
                ep.post_hello(can_pull, deadline, &|| fabric.pump("connect"))?;
            }
        }
        let shm_peers: Vec<usize> = hellos.iter().map(|(p, _)| *p).collect();
        fabric.wait_until("connect (waiting for shm peers)", deadline, &shm_peers, |_| {
            let missing: Vec<usize> = hellos
                .iter()
                .filter(|(p, _)| matches!(&fabric.endpoints[*p], Some(Endpoint::Shm(ep)) if !ep.hello_received()))
                .map(|(p, _)| *p)
                .collect();
            Ok(if missing.is_empty() { Some(()) } else { None })
        })?;
        if let Some(s) = &fabric.local_shm {
            s.withdraw();
        }
        // Tell rank 0 (which may be serving the store) that we no longer need the store.
        if let Some(st) = fabric.store.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            st.add(&format!("{}/ready", fabric.key_prefix), 1)?;
        }
        let mut fabric = fabric;
        fabric.setup_time = t0.elapsed();
        Ok(fabric)
    }

    /// The endpoint to world rank `peer`.
    pub(crate) fn endpoint(&self, peer: usize) -> Result<&Endpoint> {
        self.endpoints
            .get(peer)
            .and_then(|e| e.as_ref())
            .ok_or_else(|| Error::invalid(format!("rank {}: no endpoint to rank {peer} (out of range, or itself)", self.rank)))
    }

    /// `shm`, `tcp` or `self` for a world rank.
    pub(crate) fn transport_name(&self, peer: usize) -> &'static str {
        match self.endpoints.get(peer).and_then(|e| e.as_ref()) {
            Some(e) => e.name(),
            None => "self",
        }
    }

    /// Registers `[offset, offset + len)` of a region for a remote write by world rank
    /// `peer`; returns the descriptor to advertise and what the receiver holds until the
    /// write has landed (for a verbs peer: the memory region, see [`Registration`]).
    ///
    /// shm and tcp peers go through the registration cache ([`Fabric::register_cached`]). A
    /// verbs peer gets a memory region over exactly that range, held by the receive until
    /// the write lands (inside the call's scope): user memory is not cached in verbs
    /// registrations, because nothing tells the library when it is freed and remapped.
    /// Those registrations count as misses in the statistics.
    pub(crate) fn register(&self, h: &RegionHandle, offset: usize, len: usize, peer: usize) -> Result<(RemoteBuf, Registration)> {
        if let (Some(Endpoint::Verbs(ep)), true) = (self.endpoints.get(peer).and_then(|e| e.as_ref()), len > 0) {
            let (buf, mr) = verbs::register_user(ep.net(), h, offset, len)?;
            self.reg_cache.lock().unwrap_or_else(|e| e.into_inner()).stats.registrations += 1;
            return Ok((buf, Registration::verbs(mr)));
        }
        let key = self.register_cached(h);
        Ok((RemoteBuf { addr: h.addr() + offset as u64, len: len as u64, key }, Registration::default()))
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
        let mut guard = self.reg_cache.lock().unwrap_or_else(|e| e.into_inner());
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
                    self.shared.regions.write().unwrap_or_else(|e| e.into_inner()).insert(key, h.clone());
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
                let mut regions = self.shared.regions.write().unwrap_or_else(|e| e.into_inner());
                regions.insert(key, h.clone());
                if cache.entries.len() > self.params.reg_cache_entries {
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
        let mut cache = self.reg_cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = cache.entries.remove(&(h.addr(), h.len())) {
            self.shared.regions.write().unwrap_or_else(|e| e.into_inner()).remove(&e.key);
            cache.stats.registered_bytes -= h.len() as u64;
        }
    }

    /// The registration cache's counters.
    pub(crate) fn reg_stats(&self) -> RegStats {
        let cache = self.reg_cache.lock().unwrap_or_else(|e| e.into_inner());
        RegStats { entries: cache.entries.len(), ..cache.stats }
    }

    /// A fresh immediate for a rendezvous write: 31 bits (verbs keeps the top bit for its
    /// own control messages).
    pub(crate) fn next_imm(&self) -> u32 {
        self.next_imm.fetch_add(1, Ordering::Relaxed) & 0x7fff_ffff
    }

    pub(crate) fn local_shm(&self) -> Option<&Arc<LocalShm>> {
        self.local_shm.as_ref()
    }

    /// Drains the shm inbox, handing records to the event state. An error here is fatal
    /// for the fabric.
    pub(crate) fn progress(&self) -> Result<()> {
        if let Some(v) = &self.verbs {
            // Completions: lands messages and immediates; a failed one fails its peer.
            v.poll()?;
        }
        if let Some(shm) = &self.local_shm {
            // Called on every round of every wait: no allocation here.
            let peers = self.endpoints.iter().enumerate().filter_map(|(p, e)| match e {
                Some(Endpoint::Shm(ep)) => Some((p, ep)),
                _ => None,
            });
            match shm.drain(peers, &self.shared) {
                // Something arrived: another thread of this process may be waiting for it.
                Ok(true) => self.shared.notify(),
                Ok(false) => {}
                Err(e) => {
                    self.shared.lock().set_fault(Fault::from_error(&e, &|r| r));
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// What a sender runs while it waits for room: drain our inbox, watch the peers, and
    /// stop at once if the fabric has failed.
    pub(crate) fn pump(&self, op: &str) -> Result<()> {
        let _ = self.progress();
        self.check_health(Instant::now());
        match self.fatal_error(op) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Looks at the peers' processes (and the launcher) at most every 2 ms; `now` is the
    /// caller's clock reading, so a wait loop reads the clock once per round.
    pub(crate) fn check_health(&self, now: Instant) {
        {
            let mut at = self.health_at.lock().unwrap_or_else(|e| e.into_inner());
            if now.saturating_duration_since(*at) < Duration::from_millis(2) {
                return;
            }
            *at = now;
        }
        self.shared.promote_suspects(now);
        // One zero-timeout poll per watch: no allocation on this path (it runs every 2 ms
        // of every wait).
        if !self.watches.iter().any(|(_, w)| w.has_exited()) {
            return;
        }
        // Anything the peer sent before exiting (its goodbye included) counts first.
        let _ = self.progress();
        let mut ev = self.shared.lock();
        for (p, w) in self.watches.iter().filter(|(_, w)| w.has_exited()) {
            if *p == usize::MAX {
                ev.set_fatal(usize::MAX, format!("the launcher (pid {}) exited", w.pid()));
            } else if !ev.closed.contains(p) {
                ev.set_fatal(*p, format!("exited (pid {}) without closing its communicator (killed or crashed?)", w.pid()));
            }
        }
    }

    /// The error for the fabric's fatal state, if any, as seen by an operation.
    pub(crate) fn fatal_error(&self, op: &str) -> Option<Error> {
        let ev = self.shared.lock();
        if let Some(by) = ev.aborted {
            return Some(Error::Aborted { rank: self.rank, op: op.to_string(), by });
        }
        ev.fatal.as_ref().map(|f| f.to_error(self.rank, op))
    }

    /// The error for a call `op` on a fabric whose world communicator was finalized (`world`:
    /// the call is on a split of it), if it was.
    pub(crate) fn finalized_error(&self, rank: usize, op: &str, world: bool) -> Option<Error> {
        self.finalized.load(Ordering::Acquire).then(|| Error::Finalized { rank, op: op.to_string(), world })
    }

    /// Marks the world communicator finalized: every later call on it or its splits fails.
    pub(crate) fn set_finalized(&self) {
        self.finalized.store(true, Ordering::Release);
    }

    /// Makes `err` fatal for the fabric (unless an earlier error already is), tells every
    /// peer the root cause, and shuts the tcp sockets down so that no reader thread can keep
    /// a registered buffer busy. Returns `err` for the caller to report. The ranks in `err`
    /// are world ranks (see [`Fabric::poison_in`]).
    pub(crate) fn poison(&self, err: Error) -> Error {
        self.poison_in(err, &|r| r)
    }

    /// [`Fabric::poison`] for an error of a call on a communicator whose rank `r` is world
    /// rank `world(r)`.
    pub(crate) fn poison_in(&self, err: Error, world: &dyn Fn(usize) -> usize) -> Error {
        if matches!(err, Error::InvalidArgument(_) | Error::Finalized { .. }) {
            // Found before anything went on the wire: nothing to clean up.
            return err;
        }
        self.shared.lock().set_fault(Fault::from_error(&err, world));
        self.tell_peers_and_cut();
        err
    }

    /// Makes `fault` (found by this rank) fatal for the fabric and tells every peer.
    pub(crate) fn poison_fault(&self, fault: Fault) {
        self.shared.lock().set_fault(fault);
        self.tell_peers_and_cut();
        self.shared.notify();
    }

    /// Sends `msg` to world rank `peer` if that needs no waiting (a probe: best effort).
    pub(crate) fn try_send_now(&self, peer: usize, msg: &[u8]) {
        if let Some(Some(e)) = self.endpoints.get(peer) {
            let _ = e.try_post_send_now(msg, Instant::now() + Duration::from_millis(10));
        }
    }

    /// Aborts every operation on this fabric, pending and later, with [`Error::Aborted`], and
    /// tells every peer (whose operations then fail with [`Error::Aborted`] naming this rank).
    /// Returns at once; waiting threads wake within a round.
    pub(crate) fn abort(&self) {
        {
            let mut ev = self.shared.lock();
            ev.aborted.get_or_insert(None);
            ev.set_fault(Fault { kind: FaultKind::Aborted, culprit: None, reporter: None, op: String::new(), what: "aborted".into() });
        }
        if !self.told_peers.swap(true, Ordering::AcqRel) {
            let f = Fault { kind: FaultKind::Aborted, culprit: None, reporter: None, op: String::new(), what: "aborted".into() };
            self.send_fault_and_cut(&f);
        }
        self.shared.notify();
    }

    /// Once: sends every peer an `ERR` with the fatal cause (without waiting: a full ring
    /// or a busy socket is skipped), then shuts the tcp sockets down.
    fn tell_peers_and_cut(&self) {
        let Some(fault) = self.shared.lock().fatal.clone() else { return };
        if self.told_peers.swap(true, Ordering::AcqRel) {
            return;
        }
        self.send_fault_and_cut(&fault);
    }

    fn send_fault_and_cut(&self, fault: &Fault) {
        let msg = proto::encode_err(fault, self.rank);
        let deadline = Instant::now() + Duration::from_millis(200);
        for e in self.endpoints.iter().flatten() {
            let _ = e.try_post_send_now(&msg, deadline);
        }
        for e in self.endpoints.iter().flatten() {
            e.cut();
        }
    }

    /// Polls until `check` yields a value, a fatal error occurs, or `deadline` passes.
    /// `check` runs with the event state locked; it must not block. Every error returned
    /// here is fatal for the fabric (see [`Fabric::poison`]).
    pub(crate) fn wait_until<T>(
        &self,
        op: &str,
        deadline: Instant,
        waiting_for: &[usize],
        mut check: impl FnMut(&mut Events) -> Result<Option<T>>,
    ) -> Result<T> {
        self.run_until(op, deadline, &|| waiting_for.to_vec(), || {
            let mut ev = self.shared.lock();
            Ok(match check(&mut ev)? {
                Some(v) => Poll::Ready(v),
                None => Poll::Idle,
            })
        })
    }

    /// The one wait loop: drains the shm inbox, stops on a fatal error, runs `step` (which
    /// locks what it needs; it says whether it finished, moved, or found nothing to do),
    /// watches the peers, and backs off (spin, yield, futex sleep) while nothing moves.
    /// Every error returned here is fatal for the fabric (see [`Fabric::poison`]).
    pub(crate) fn run_until<T>(
        &self,
        op: &str,
        deadline: Instant,
        waiting_for: &dyn Fn() -> Vec<usize>,
        mut step: impl FnMut() -> Result<Poll<T>>,
    ) -> Result<T> {
        let start = Instant::now();
        let mut idle = 0u32;
        loop {
            // Read the doorbell before looking: whatever is published after this read
            // bumps the bell past `seen`, which makes the futex sleep below return at once.
            let seen = self.shared.bell.word().load(Ordering::SeqCst);
            if self.progress().is_err() {
                let e = self.fatal_error(op).unwrap_or_else(|| Error::Poisoned(op.into()));
                return Err(self.poison(e));
            }
            // A fatal error wins over whatever else arrived: the fabric is poisoned.
            if let Some(e) = self.fatal_error(op) {
                return Err(self.poison(e));
            }
            match step() {
                Ok(Poll::Ready(v)) => return Ok(v),
                Ok(Poll::Moved) => idle = 0,
                Ok(Poll::Idle) => {}
                Err(e) => return Err(self.poison(e)),
            }
            let now = Instant::now();
            self.check_health(now);
            if now >= deadline {
                let e = Error::Timeout {
                    rank: self.rank,
                    op: op.to_string(),
                    after: now - start,
                    waiting_for: waiting_for().iter().map(|p| format!("rank {p}")).collect(),
                };
                return Err(self.poison(e));
            }
            idle += 1;
            crate::engine::backoff(self, &mut idle, seen, Some(deadline));
        }
    }

    /// Sleeps until the doorbell moves past `seen` (or 5 ms, to look at peers' health).
    pub(crate) fn sleep_on_bell(&self, seen: u32, deadline: Instant) {
        self.sleep_on_bell_for(seen, deadline, true);
    }

    /// [`Fabric::sleep_on_bell`]; `drains` says whether the caller will drain the shm
    /// rings when it wakes (a thread waiting for another thread's driving does not, so it
    /// must not return early for data in them: only the driver's doorbell rings matter).
    pub(crate) fn sleep_on_bell_for(&self, seen: u32, deadline: Instant, drains: bool) {
        let bell = &self.shared.bell;
        bell.sleeping().fetch_add(1, Ordering::SeqCst);
        let nap = deadline.saturating_duration_since(Instant::now()).min(Duration::from_millis(5));
        // shm peers ring the bell only when they see us sleeping: look once more now that
        // we have said so.
        let pending = drains && self.local_shm.as_ref().is_some_and(|s| s.has_pending());
        if !nap.is_zero() && !pending {
            let _ = futex_wait(bell.word(), seen, Some(nap));
        }
        bell.sleeping().fetch_sub(1, Ordering::SeqCst);
    }

    /// Says goodbye to every peer and tears the mesh down. Idempotent.
    pub(crate) fn close(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        self.engine.shutdown();
        let deadline = Instant::now() + Duration::from_secs(2).min(self.params.timeout);
        // After a fatal error, tell every peer why we are leaving, so that they report the
        // root cause (the rank that died) rather than our exit.
        self.tell_peers_and_cut();
        for e in self.endpoints.iter().flatten() {
            e.close(deadline, &|| self.pump("close"));
        }
        if let Some(s) = &self.local_shm {
            s.withdraw();
        }
        // If this rank serves the store, keep it up until every rank has finished with it.
        let server = self.server.lock().unwrap_or_else(|e| e.into_inner()).take();
        let store = self.store.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let (Some(server), Some(store)) = (server, store) {
            let want = self.size as i64;
            let key = format!("{}/ready", self.key_prefix);
            let end = Instant::now() + self.params.timeout.min(Duration::from_secs(30));
            while Instant::now() < end {
                match store.add(&key, 0) {
                    Ok(n) if n >= want => break,
                    Ok(_) => std::thread::sleep(Duration::from_millis(5)),
                    Err(_) => break,
                }
            }
            drop(store);
            server.shutdown();
        }
    }
}

impl Drop for Fabric {
    fn drop(&mut self) {
        self.close();
    }
}

/// Mesh hello sent by the connecting side after authentication.
fn encode_hello(key_prefix: &str, rank: usize) -> Vec<u8> {
    let mut w = Writer::new();
    w.str(key_prefix).u32(rank as u32);
    w.finish()
}

fn write_frame(s: &mut TcpStream, b: &[u8]) -> std::io::Result<()> {
    s.write_all(&(b.len() as u32).to_le_bytes())?;
    s.write_all(b)
}

fn read_frame(s: &mut TcpStream, max: usize) -> std::io::Result<Vec<u8>> {
    let mut l = [0u8; 4];
    s.read_exact(&mut l)?;
    let n = u32::from_le_bytes(l) as usize;
    if n > max {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("frame of {n} bytes exceeds {max}")));
    }
    let mut b = vec![0u8; n];
    s.read_exact(&mut b)?;
    Ok(b)
}

fn connect_peer(rank: usize, peer: usize, addr: &str, token: &str, key_prefix: &str, deadline: Instant) -> Result<TcpStream> {
    let sa: SocketAddr = addr.parse().map_err(|_| Error::protocol(format!("rank {peer}"), format!("bad tcp address {addr:?}")))?;
    let label = format!("rank {peer} ({addr})");
    let mut s = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(&sa, left.max(Duration::from_millis(1))) {
            Ok(s) => break s,
            Err(e) if Instant::now() < deadline && e.kind() == std::io::ErrorKind::ConnectionRefused => {
                std::thread::sleep(Duration::from_millis(10))
            }
            Err(e) => return Err(Error::io(format!("rank {rank}: connect to {label}"), e)),
        }
    };
    s.set_nodelay(true).map_err(|e| Error::io("set TCP_NODELAY", e))?;
    auth::client_handshake(&mut s, token, "mesh", &label, deadline)?;
    s.set_write_timeout(Some(deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))))
        .map_err(|e| Error::io("set timeout", e))?;
    write_frame(&mut s, &encode_hello(key_prefix, rank)).map_err(|e| Error::io(format!("rank {rank}: hello to {label}"), e))?;
    s.set_read_timeout(None).and_then(|_| s.set_write_timeout(None)).map_err(|e| Error::io("clear timeouts", e))?;
    Ok(s)
}

/// Accepts one authenticated connection from each rank in `expect`. Strangers (wrong token,
/// garbage, unexpected ranks) are dropped and do not disturb the job.
fn accept_peers(
    listener: &TcpListener,
    rank: usize,
    expect: &[usize],
    token: &str,
    key_prefix: &str,
    deadline: Instant,
) -> Result<Vec<(usize, TcpStream)>> {
    let mut got: HashMap<usize, TcpStream> = HashMap::new();
    if expect.is_empty() {
        return Ok(vec![]);
    }
    listener.set_nonblocking(true).map_err(|e| Error::io("listener nonblocking", e))?;
    let (tx, rx) = std::sync::mpsc::channel::<(usize, TcpStream)>();
    {
        while got.len() < expect.len() {
            while let Ok((p, st)) = rx.try_recv() {
                if expect.contains(&p) && !got.contains_key(&p) {
                    got.insert(p, st);
                }
            }
            if got.len() == expect.len() {
                break;
            }
            if Instant::now() >= deadline {
                let missing: Vec<String> = expect.iter().filter(|p| !got.contains_key(p)).map(|p| format!("rank {p}")).collect();
                return Err(Error::Timeout { rank, op: "tcp mesh accept".into(), after: Duration::ZERO, waiting_for: missing });
            }
            match listener.accept() {
                Ok((mut st, from)) => {
                    let tx = tx.clone();
                    let (token, key_prefix) = (token.to_string(), key_prefix.to_string());
                    // Detached: a silent stranger must not hold up the job; it is dropped
                    // within a few seconds by its own deadline.
                    std::thread::spawn(move || {
                        // A stranger gets at most a few seconds of our attention.
                        let dl = deadline.min(Instant::now() + Duration::from_secs(5));
                        let _ = st.set_nonblocking(false);
                        let label = format!("{from}");
                        if auth::server_handshake(&mut st, &token, "mesh", &label, dl).is_err() {
                            return;
                        }
                        let _ = st.set_read_timeout(Some(dl.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))));
                        let Ok(b) = read_frame(&mut st, 4096) else { return };
                        let mut r = Reader::new(&b);
                        let (Ok(prefix), Ok(p)) = (r.str(), r.u32()) else { return };
                        if prefix != key_prefix {
                            return;
                        }
                        let _ = st.set_read_timeout(None);
                        let _ = st.set_nodelay(true);
                        let _ = tx.send((p as usize, st));
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(1)),
                Err(e) => return Err(Error::io(format!("rank {rank}: accept"), e)),
            }
        }
    }
    Ok(got.into_iter().collect())
}
