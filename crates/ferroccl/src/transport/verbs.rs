//! RDMA verbs transport: one reliable-connected queue pair per peer (the QP mesh), data
//! and notification in one RDMA WRITE WITH IMMEDIATE.
//!
//! # Wire
//!
//! Every work request that the peer must notice is an RDMA WRITE WITH IMMEDIATE; the
//! receiver keeps zero-length receives posted (one is consumed per immediate) and learns
//! what arrived from the 32-bit immediate:
//!
//! | immediate | meaning |
//! | --- | --- |
//! | `0xxx...` (top bit clear) | a one-sided write ([`VerbsEndpoint::post_write`]) has landed; the value is the caller's immediate (31 bits: the fabric's immediates are) |
//! | `100` + 29-bit length | a two-sided message of that length landed in the next eager slot |
//! | `101` + 29-bit count | the peer consumed that many more of our messages (credits back) |
//! | `110` | the peer closes cleanly (goodbye) |
//! | `111` | keepalive: nothing to do (its failure is what counts) |
//!
//! # Setup
//!
//! Which peers verbs will carry is known only once every rank's descriptor is in, and the
//! queue pairs' data must be in the descriptors: so [`VerbsSetup::open`] makes a queue pair
//! and an eager receive ring for every other rank before the descriptor is published, and
//! its `info` (QPN, PSN, LID, GID, ring address and rkey per peer, the port MTU) is verbs'
//! part of it. [`VerbsSetup::connect`] connects the queue pairs of the peers mesh setup
//! chose for verbs (RTR with the smaller of the two MTUs, then RTS; the others are dropped)
//! and then waits in one store round, `verbs-ready`, until each of them has connected too:
//! a queue pair not yet ready to receive silently drops what arrives, and the sender would
//! learn of it only through its retries (seconds at the default ACK timeout), or not at all
//! once they run out. A rank that fails before publishing puts the reason in its descriptor
//! (under `FERROCCL_TRANSPORT=verbs`), one that fails while connecting in place of its ready
//! mark: either way its peers fail at once, naming it and the reason.
//!
//! # Memory
//!
//! * **Eager slots.** Each side of each connection has [`SLOTS`] receive slots of
//!   [`SLOT_BYTES`] in one registered region, advertised to the peer at setup; the
//!   sender copies a message into its own registered send slot and writes it into the
//!   peer's slot of the same index (slots are used in order, so the index is implicit).
//!   **Credits:** a sender posts message `k` only when message `k - SLOTS` has completed
//!   locally (its send slot is free) and the receiver has handed the slot back; the
//!   receiver copies each message out as soon as it polls it and returns credits in
//!   batches of `SLOTS / 2`. A sender can never overrun the receiver's slots.
//! * **Rendezvous targets (zero copy).** The receiver registers exactly the range it
//!   advertises in its clear-to-send ([`register_user`]): the memory region holds a
//!   [`RegionLease`](ferroccl_mem::RegionLease) on the caller's region, which keeps the
//!   region's scope (`with_region`) from ending while the device may write the bytes.
//!   The receive operation drops the memory region (deregistering it, then releasing the
//!   lease) as soon as the write's immediate is seen, or when it is dropped on an error
//!   path, always inside the scope. The lease takes no byte-range lock (local steps view
//!   whole buffers); the schedule leaves a receive's bytes alone until it has completed.
//! * **Write sources: windows zero copy, the rest one copy.** A one-sided window is
//!   registered once, when it is made ([`register_window`]: one memory region over the
//!   whole window, local read only, holding a read [`RegionLease`](ferroccl_mem::RegionLease)
//!   so the window's scope cannot end under it); a read of it (`WriteReq::src_mr`) is
//!   written by the device straight from the window's memory, in pieces of at most
//!   [`DIRECT_BYTES`], no copy on either side. Every such work request holds a clone of
//!   the memory region in a slot that its completion frees when it is polled, so the
//!   region is not deregistered (and the lease not released) under a work request in
//!   flight; dropping the window waits for them ([`wait_unused`]). Every other source (a
//!   rendezvous send's) is copied through registered staging slots ([`STAGE_SLOTS`] x
//!   [`STAGE_BYTES`] per process) and written from there, so `post_write` returns with the
//!   source free to reuse and the call's scope never waits for a send completion: one
//!   memcpy on the sending side, and no `ibv_reg_mr` per transfer. [`VerbsNet::write_bytes`]
//!   counts the bytes of both paths.
//! * **Reads of peers' windows (RDMA READ).** Windows are registered with `REMOTE_READ` and
//!   the queue pairs allow remote reads. A reader given a window's region (address, rkey,
//!   length: a [`RemoteRegion`]) posts RDMA READs into its registered destination
//!   ([`VerbsEndpoint::post_read`]); each holds a clone of the destination's memory region
//!   and of the [`RemoteRegion`] in a slot that its completion frees, and the completion of
//!   each row's last piece delivers the row's immediate to the reader's own inbox. A
//!   [`RemoteRegion`] counts its READs in flight and, once revoked, issues none, so its
//!   holder can tell its owner when no READ of its can still reach the region.
//! * **Writes of peers' windows (RDMA WRITE).** Read-write windows are registered with
//!   `REMOTE_WRITE` too ([`register_window`]), and the owner says so in the region it gives
//!   ([`RemoteRegion::writable`]). A writer posts RDMA WRITEs (no immediate) from a memory
//!   region over its source ([`register_source`]) with [`VerbsEndpoint::post_write_to`],
//!   which refuses a region that is not writable; they go through the same slots, in-flight
//!   count and revocation as READs, and the completion of each row's last piece delivers
//!   the row's immediate to the writer's own inbox (on RC: the bytes are placed).
//!
//! # Progress and failures
//!
//! One completion queue per process, polled by [`VerbsNet::poll`] from `Fabric::progress`
//! (every round of every wait); polling allocates nothing unless a message arrives
//! (delivered as a `Vec`). A failed completion (the peer's QP is gone: retry exceeded,
//! remote access error, flush) fails the peer with the verbs status named. A peer
//! process that dies on the same host is also seen by the fabric's process watch. On
//! another host nothing but traffic can tell: so every [`PING_EVERY`] the completion
//! thread posts a zero-length keepalive to each peer with nothing in flight, and a dead
//! peer's queue pair, gone with its process, makes that keepalive fail after the
//! transport's retries (7 tries of 4.096 us x 2^`FERROCCL_IB_TIMEOUT`: about 7.5 s at the
//! default 18, NCCL's default too; shorter ones fail live peers behind a stalled link) instead of
//! leaving a waiter to its deadline. A stopped (not dead) peer still ACKs (the NIC or the
//! kernel answers), so it is caught by the deadline, as with tcp.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ferroccl_mem::process::ProcessWatch;
use ferroccl_mem::region::RegionHandle;
use ferroccl_verbs::{
    Access, Completion, CompletionQueue, ConnectInfo, Context, DeviceList, MemoryRegion, Mtu, ProtectionDomain, QpOptions, QueuePair,
    ReadyToSend, RemoteSlice, WcOpcode,
};

use crate::error::{Error, Op, Result};
use crate::inbox::{Backoff, Inbox};
use crate::params::Params;
use crate::transport::descriptor::{QpInfo, VerbsReady, QP_CONNECT_LEN};
use crate::transport::{Connected, Descriptor, Endpoint, ReadReq, RemoteBuf, SetupCx, TransportKind, VerbsInfo, WriteReq};
use crate::wire::{Reader, Writer};

const _: () = assert!(ConnectInfo::LEN == QP_CONNECT_LEN, "the descriptor's queue-pair entries hold a ConnectInfo");

/// Eager receive slots per peer (and send slots: one each).
pub(crate) const SLOTS: usize = 8;
/// Bytes per eager slot: a 64 KiB eager message plus its protocol header fits.
pub(crate) const SLOT_BYTES: usize = 68 << 10;
/// Staging slots for write sources, shared by all peers of the process.
pub(crate) const STAGE_SLOTS: usize = 8;
/// Bytes per staging slot: the largest piece one staged RDMA WRITE carries.
pub(crate) const STAGE_BYTES: usize = 256 << 10;
/// The largest piece one RDMA WRITE from a window's memory region carries (far below any
/// device's maximum message size: 2 GiB for rxe, at least 1 GiB on NICs).
pub(crate) const DIRECT_BYTES: usize = 8 << 20;
const SQ_DEPTH: u32 = 128;
/// How long the completion thread sleeps before it looks at its stop flag.
const WAKER_NAP: Duration = Duration::from_millis(50);
/// How long `cut` waits for the peer to acknowledge the fabric's last word.
const CUT_WAIT: Duration = Duration::from_millis(100);
/// How long a sender waiting for room parks at a time, once done spinning (the completion
/// thread rings the doorbell sooner when something completes).
const WAIT_NAP: Duration = Duration::from_micros(200);
/// How often idle peers get a keepalive (see the module docs).
pub(crate) const PING_EVERY: Duration = Duration::from_secs(1);
const RQ_DEPTH: u32 = 256;

const IMM_CTRL: u32 = 1 << 31;
const IMM_KIND_SHIFT: u32 = 29;
const IMM_LOW: u32 = (1 << IMM_KIND_SHIFT) - 1;
const KIND_MSG: u32 = 0;
const KIND_CREDIT: u32 = 1;
const KIND_BYE: u32 = 2;
const KIND_PING: u32 = 3;

const WR_RECV: u64 = 1;
const WR_MSG: u64 = 2;
const WR_STAGE: u64 = 3;
const WR_CTRL: u64 = 4;
const WR_DIRECT: u64 = 5;
const WR_READ: u64 = 6;

fn wr_id(kind: u64, peer: usize, extra: u32) -> u64 {
    (kind << 56) | ((peer as u64 & 0xff_ffff) << 32) | u64::from(extra)
}

fn wr_parts(id: u64) -> (u64, usize, u32) {
    (id >> 56, ((id >> 32) & 0xff_ffff) as usize, id as u32)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn verr(rank: usize, what: impl Into<String>) -> impl FnOnce(ferroccl_verbs::Error) -> Error {
    let what = what.into();
    move |source| Error::Verbs { rank, what, source }
}

/// An opened, usable device.
#[derive(Debug)]
struct VerbsDevice {
    ctx: Context,
    gid_index: u8,
    /// `FERROCCL_IB_TIMEOUT`.
    ack_timeout: u8,
}

impl VerbsDevice {
    /// Opens `FERROCCL_IB_DEV` (or the first device) and checks that port 1 is active
    /// and has a usable GID. Every failure says why verbs cannot be used here.
    fn open(rank: usize, params: &Params) -> Result<VerbsDevice> {
        let list = DeviceList::new().map_err(verr(rank, "list RDMA devices"))?;
        let dev = match &params.ib_dev {
            Some(name) => list.find(name).map_err(verr(rank, "FERROCCL_IB_DEV"))?,
            None => list.iter().next().ok_or(ferroccl_verbs::Error::NoDevice).map_err(verr(rank, "find an RDMA device"))?,
        };
        let name = dev.name();
        let ctx = dev.open().map_err(verr(rank, format!("open RDMA device {name}")))?;
        let port = ctx.query_port(1).map_err(verr(rank, format!("query port 1 of {name}")))?;
        if port.state != ferroccl_verbs::PortState::Active {
            return Err(Error::Transport {
                rank,
                peer: None,
                transport: TransportKind::Verbs,
                what: format!("port 1 of RDMA device {name} is not active ({:?})", port.state),
            });
        }
        let gid_index = match params.ib_gid_index {
            Some(i) => i,
            None => {
                // RoCE: an IPv4-mapped GID, RoCE v2 if the port says which (NICs list a v1
                // and a v2 entry per address); InfiniBand: index 0.
                let n = u8::try_from(port.gid_table_len.clamp(0, 255)).unwrap_or(u8::MAX);
                let ipv4: Vec<u8> = (0..n).filter(|&i| ctx.query_gid(1, i).is_ok_and(|g| g.ipv4().is_some())).collect();
                let v2 = |i: &&u8| {
                    std::fs::read_to_string(format!("/sys/class/infiniband/{name}/ports/1/gid_attrs/types/{i}"))
                        .is_ok_and(|t| t.trim().eq_ignore_ascii_case("RoCE v2"))
                };
                ipv4.iter().find(v2).or(ipv4.first()).copied().unwrap_or(0)
            }
        };
        Ok(VerbsDevice { ctx, gid_index, ack_timeout: params.ib_timeout })
    }

    /// The device's name, advertised in the rank's descriptor.
    fn name(&self) -> String {
        self.ctx.name().to_string()
    }

    /// How every queue pair on this device is made.
    fn qp_options(&self) -> QpOptions {
        QpOptions {
            gid_index: self.gid_index,
            max_send_wr: SQ_DEPTH,
            max_recv_wr: RQ_DEPTH,
            // Writes into the eager rings and rendezvous targets; reads of windows.
            remote_access: Access::REMOTE_WRITE | Access::REMOTE_READ,
            // Dead peers must be noticed: retry transport errors a bounded number of
            // times; receiver-not-ready (a busy peer) forever. 6, not 7: soft-RoCE (rxe)
            // treats a retry count of 7 like the RNR count's 7, as "retry forever", and a
            // keepalive to a dead peer then never fails.
            retry_cnt: 6,
            timeout: self.ack_timeout,
            rnr_retry: 7,
            ..QpOptions::default()
        }
    }
}

/// The remote side of one peer's eager ring.
#[derive(Debug, Clone, Copy)]
struct RemoteRing {
    addr: u64,
    rkey: u32,
}

#[derive(Debug, Default)]
struct PeerState {
    /// Messages posted to the peer.
    sent: u64,
    /// Of those, how many completed locally (their send slot is free again).
    msg_done: u64,
    /// How many of our messages the peer has consumed (credits it returned).
    credits: u64,
    /// Messages consumed from the peer, and how many of those we have credited back.
    consumed: u64,
    returned: u64,
    /// Send work requests outstanding on the QP.
    sq_used: u32,
    /// Set by `cut` or a failed completion: nothing more is posted.
    dead: bool,
    /// The peer said goodbye: no keepalives any more.
    bye: bool,
    /// `cut` waits until `msg_done` reaches this (the `ERR` it follows).
    flush_until: u64,
}

#[derive(Debug)]
struct Peer {
    peer: usize,
    qp: QueuePair<ReadyToSend>,
    send_ring: MemoryRegion,
    recv_ring: MemoryRegion,
    remote: RemoteRing,
    st: Mutex<PeerState>,
}

/// The process's verbs resources: device, protection domain, one completion queue, the
/// staging slots and every peer's queue pair and eager rings.
#[derive(Debug)]
pub(crate) struct VerbsNet {
    rank: usize,
    pd: ProtectionDomain,
    cq: CompletionQueue,
    stage: MemoryRegion,
    /// Bit i set: staging slot i is free.
    stage_free: Mutex<u64>,
    peers: Vec<Option<Peer>>,
    /// The memory regions that zero-copy writes in flight read from (after `peers`, so
    /// that the queue pairs are gone before they are deregistered).
    direct: Mutex<DirectSlots>,
    /// The RDMA READs in flight (see [`ReadSlots`]).
    reads: Mutex<ReadSlots>,
    /// Bytes written through the staging slots, and straight from windows' memory regions.
    staged_bytes: AtomicU64,
    direct_bytes: AtomicU64,
    /// Bytes read from peers' windows with RDMA READ.
    read_bytes: AtomicU64,
    /// Bytes written into peers' windows with RDMA WRITE (see [`VerbsEndpoint::post_write_to`]).
    window_write_bytes: AtomicU64,
    /// Completions polled in one go; preallocated so that polling does not allocate.
    polled: Mutex<Vec<Completion>>,
    credits_owed: AtomicBool,
    inbox: Arc<Inbox>,
    /// The thread that sleeps on the completion channel and rings the fabric's doorbell.
    waker_stop: Arc<AtomicBool>,
    waker: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Drop for VerbsNet {
    fn drop(&mut self) {
        self.waker_stop.store(true, Ordering::Release);
        if let Some(h) = lock(&self.waker).take() {
            // The completion thread may hold the last reference for a moment (keepalive):
            // then it is the one dropping, and it ends by itself.
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }
}

/// The memory region of each zero-copy write in flight, by slot (the work request's id
/// names its slot): kept until the completion is polled.
#[derive(Debug, Default)]
struct DirectSlots {
    slots: Vec<Option<Arc<UserMr>>>,
    free: Vec<u32>,
}

/// An RDMA READ in flight: its target's memory region (kept registered, with its lease on
/// the reader's buffer, until the completion is polled), the peer's region it reads (whose
/// count of reads in flight the completion lowers), and the immediate the completion
/// reports to the reader's inbox (the last piece of a row only).
#[derive(Debug)]
struct ReadHold {
    _dst: Arc<UserMr>,
    region: Arc<RemoteRegion>,
    imm: Option<u32>,
}

/// The RDMA READs in flight, by slot (the work request's id names its slot).
#[derive(Debug, Default)]
struct ReadSlots {
    slots: Vec<Option<ReadHold>>,
    free: Vec<u32>,
}

/// A peer's window as this rank reads it with RDMA READ: the address, rkey and length of
/// its memory region, as the owner gave them (`WINFO`), and whether the owner has revoked
/// them (`REVOKE`). A read is issued only while not revoked, and counts as in flight from
/// then until its completion is polled; the holder answers a revocation only once none
/// is, so no READ reaches the owner's region after it answered.
#[derive(Debug)]
pub(crate) struct RemoteRegion {
    addr: u64,
    rkey: u32,
    len: u64,
    /// Whether the owner registered the region with `REMOTE_WRITE` (a read-write window):
    /// only then are RDMA WRITEs posted to it (the NIC would refuse them otherwise).
    writable: bool,
    state: Mutex<RegionState>,
}

#[derive(Debug, Default)]
struct RegionState {
    revoked: bool,
    /// Work requests reserved or posted and not yet completed.
    in_flight: u64,
}

impl RemoteRegion {
    /// The window's length in bytes.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// Whether the owner lets this rank write the region with RDMA WRITE.
    pub(crate) fn writable(&self) -> bool {
        self.writable
    }

    /// No read is issued from now on.
    pub(crate) fn revoke(&self) {
        lock(&self.state).revoked = true;
    }

    /// Whether reads issued before [`revoke`](Self::revoke) are still in flight.
    pub(crate) fn in_flight(&self) -> bool {
        lock(&self.state).in_flight > 0
    }

    /// Reserves `n` reads unless revoked.
    fn reserve(&self, n: u64) -> bool {
        let mut st = lock(&self.state);
        if st.revoked {
            return false;
        }
        st.in_flight += n;
        true
    }

    fn done(&self, n: u64) {
        let mut st = lock(&self.state);
        st.in_flight = st.in_flight.saturating_sub(n);
    }
}

/// Sleeps until the completion queue has news and then rings the fabric's doorbell, so a
/// waiter parked on it (the wait loop's last backoff stage) wakes for verbs completions as
/// it does for shm and tcp traffic. Arm, ring, sleep: a completion that arrived before the
/// arming is covered by the ring after it (the woken waiter polls the queue itself).
/// It also sends the keepalives, through a weak reference (the mesh owns the thread).
fn wake_loop(
    chan: &ferroccl_verbs::CompletionChannel,
    cq: &CompletionQueue,
    inbox: &Inbox,
    stop: &AtomicBool,
    net: &std::sync::Weak<VerbsNet>,
) {
    let mut pinged = Instant::now();
    while !stop.load(Ordering::Acquire) {
        if cq.req_notify().is_err() {
            return;
        }
        inbox.notify();
        if chan.wait(cq, WAKER_NAP).is_err() {
            return;
        }
        if pinged.elapsed() >= PING_EVERY {
            pinged = Instant::now();
            match net.upgrade() {
                Some(n) => n.ping_idle(),
                None => return,
            }
        }
    }
}

/// Whether verbs reaches `peer`: both ranks have a usable device and made a queue pair for
/// each other.
pub(crate) fn can_connect(me: &Descriptor, peer: &Descriptor) -> std::result::Result<(), String> {
    let them = format!("rank {} (on {})", peer.rank, peer.hostname);
    match (&me.verbs, &peer.verbs) {
        (VerbsInfo::Ready(mine), VerbsInfo::Ready(theirs)) => {
            if theirs.qp_for(me.rank as usize).is_some() && mine.qp_for(peer.rank as usize).is_some() {
                Ok(())
            } else {
                Err(format!("{them} and rank {} made no queue pair for each other (FERROCCL_TRANSPORT differs between ranks?)", me.rank))
            }
        }
        (VerbsInfo::Ready(_), VerbsInfo::Failed(why)) => Err(format!("{them} has no usable RDMA device: {why}")),
        (VerbsInfo::Ready(_), VerbsInfo::Off) => {
            Err(format!("{them} has no usable RDMA device (FERROCCL_TRANSPORT differs between ranks?)"))
        }
        (_, _) => Err(format!("rank {} has no usable RDMA device", me.rank)),
    }
}

/// One queue pair made before the descriptor is published, for one peer: its data and
/// its receive ring's go into the descriptor.
struct PreparedQp {
    qp: QueuePair<ferroccl_verbs::Init>,
    recv_ring: MemoryRegion,
}

/// This rank's side of verbs while the mesh is built: the device, the protection domain,
/// the completion queue, and a queue pair with its eager receive ring for every other rank
/// (which peers verbs will carry is known only once every descriptor is in; the queue
/// pairs of the others are dropped then).
pub(crate) struct VerbsSetup {
    rank: usize,
    dev: VerbsDevice,
    pd: ProtectionDomain,
    cq: CompletionQueue,
    chan: ferroccl_verbs::CompletionChannel,
    /// This port's active MTU.
    mtu: Mtu,
    /// Indexed by world rank (`None` for this rank).
    qps: Vec<Option<PreparedQp>>,
}

impl std::fmt::Debug for VerbsSetup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsSetup").field("rank", &self.rank).field("dev", &self.dev.name()).finish_non_exhaustive()
    }
}

impl VerbsSetup {
    /// Opens `FERROCCL_IB_DEV` (or the first device) and creates the protection domain,
    /// the completion queue and channel, and per other rank a queue pair with its eager
    /// receive slots. Every failure says why verbs cannot be used here.
    pub(crate) fn open(rank: usize, size: usize, params: &Params) -> Result<VerbsSetup> {
        let dev = VerbsDevice::open(rank, params)?;
        let ctx = &dev.ctx;
        let pd = ctx.alloc_pd().map_err(verr(rank, "ibv_alloc_pd"))?;
        let npeers = size.saturating_sub(1) as u32;
        let cq_cap = npeers.saturating_mul(SQ_DEPTH + RQ_DEPTH).saturating_add(64);
        let chan = ctx.create_comp_channel().map_err(verr(rank, "ibv_create_comp_channel"))?;
        let cq = ctx.create_cq_with_channel(cq_cap, &chan).map_err(verr(rank, "ibv_create_cq"))?;
        let options = dev.qp_options();
        // Both ends of a queue pair must use one path MTU: each publishes its port's, and
        // each uses the smaller of the two.
        let mtu = ctx.query_port(1).map_err(verr(rank, "query port 1"))?.active_mtu;
        let mut qps = Vec::with_capacity(size);
        for p in 0..size {
            if p == rank {
                qps.push(None);
                continue;
            }
            let qp = pd.create_rc_qp(&cq, &cq, &options).map_err(verr(rank, format!("create a queue pair for rank {p}")))?;
            let recv_ring = pd
                .alloc_region(SLOTS * SLOT_BYTES, Access::REMOTE_WRITE)
                .map_err(verr(rank, format!("register receive slots for rank {p}")))?;
            qps.push(Some(PreparedQp { qp, recv_ring }));
        }
        Ok(VerbsSetup { rank, dev, pd, cq, chan, mtu, qps })
    }

    /// Our part of the descriptor: the device, the MTU, and per peer the queue pair's
    /// (QPN, PSN, LID, GID) and the receive ring's address and key.
    pub(crate) fn info(&self) -> Result<VerbsInfo> {
        let rank = self.rank;
        let mut qps = Vec::with_capacity(self.qps.len());
        for (p, prep) in self.qps.iter().enumerate() {
            let Some(prep) = prep else { continue };
            let info = prep.qp.info().map_err(verr(rank, format!("connect info for rank {p}")))?;
            let ring = prep.recv_ring.remote(0..SLOTS * SLOT_BYTES).map_err(verr(rank, "receive slots"))?;
            qps.push(QpInfo { peer: p as u32, connect: info.to_bytes(), ring_addr: ring.addr, ring_rkey: ring.rkey });
        }
        Ok(VerbsInfo::Ready(VerbsReady { dev: self.dev.name(), mtu: self.mtu.bytes(), qps }))
    }

    /// Connects the queue pairs of `peers` (chosen for verbs) to theirs, with the data in
    /// their descriptors (RTR, then RTS), then waits until every one of them is connected
    /// too (the `verbs-ready` round): a queue pair not yet ready to receive drops what
    /// arrives, and the sender would see it only after its retries (seconds). A rank that
    /// fails here publishes why in place of its ready mark, so its peers fail at once.
    /// The queue pairs made for other peers are dropped.
    pub(crate) fn connect(mut self, cx: &SetupCx<'_>, peers: &[usize]) -> Result<(Arc<VerbsNet>, Connected)> {
        const READY: &str = "verbs-ready";
        let rank = cx.rank;
        let (stage, slots) = match self.connect_qps(cx, peers) {
            Ok(x) => x,
            Err(e) => {
                let mut w = Writer::new();
                w.u8(TAG_ERR).str(&e.to_string());
                let _ = cx.exchange.publish(READY, &w.finish());
                return Err(e);
            }
        };
        cx.exchange.publish(READY, &[TAG_OK])?;
        let readies = cx.exchange.gather(READY, peers, cx.deadline)?;
        for (&p, b) in peers.iter().zip(&readies) {
            if let Some(why) = peer_error(b) {
                return Err(Error::Transport {
                    rank,
                    peer: Some(p),
                    transport: TransportKind::Verbs,
                    what: format!("rank {p} could not connect: {why}"),
                });
            }
        }
        let VerbsSetup { pd, cq, chan, .. } = self;
        let stop = Arc::new(AtomicBool::new(false));
        let inbox = cx.inbox.clone();
        let net = Arc::new(VerbsNet {
            waker_stop: stop.clone(),
            waker: Mutex::new(None),
            rank,
            pd,
            cq,
            stage,
            stage_free: Mutex::new(if STAGE_SLOTS == 64 { u64::MAX } else { (1u64 << STAGE_SLOTS) - 1 }),
            peers: slots,
            direct: Mutex::new(DirectSlots::default()),
            reads: Mutex::new(ReadSlots::default()),
            staged_bytes: AtomicU64::new(0),
            direct_bytes: AtomicU64::new(0),
            read_bytes: AtomicU64::new(0),
            window_write_bytes: AtomicU64::new(0),
            polled: Mutex::new(Vec::with_capacity(256)),
            credits_owed: AtomicBool::new(false),
            inbox: inbox.clone(),
        });
        let waker = {
            let (cq, weak) = (net.cq.clone(), Arc::downgrade(&net));
            std::thread::Builder::new()
                .name("ferroccl-verbs-cq".into())
                .spawn(move || wake_loop(&chan, &cq, &inbox, &stop, &weak))
                .map_err(|e| Error::io(format!("rank {rank}: spawn the verbs completion thread"), e))?
        };
        *lock(&net.waker) = Some(waker);
        // Peers on this host are watched like shm peers, so that a dead one is noticed
        // without waiting for a work request to fail.
        let mut out = Connected::default();
        let me = &cx.descs[rank];
        for &p in peers {
            out.endpoints.push((p, Endpoint::Verbs(VerbsEndpoint::new(net.clone(), p))));
            let d = &cx.descs[p];
            if d.host_id == me.host_id {
                if let Ok(w) = ProcessWatch::new(d.pid as i32) {
                    out.watches.push((p, w));
                }
            }
        }
        Ok((net, out))
    }

    /// Registers the staging slots, and per peer in `peers` the send slots, posts its
    /// receives and connects its queue pair (RTR, RTS) to the peer's.
    fn connect_qps(&mut self, cx: &SetupCx<'_>, peers: &[usize]) -> Result<(MemoryRegion, Vec<Option<Peer>>)> {
        let rank = self.rank;
        let stage = self.pd.alloc_region(STAGE_SLOTS * STAGE_BYTES, Access::empty()).map_err(verr(rank, "register the staging slots"))?;
        let mut slots: Vec<Option<Peer>> = (0..cx.size).map(|_| None).collect();
        for &p in peers {
            let bad = |what: String| Error::protocol(format!("rank {p}"), format!("verbs connect info: {what}"));
            let Some(VerbsInfo::Ready(theirs)) = cx.descs.get(p).map(|d| &d.verbs) else {
                return Err(bad("it published no queue pairs".into()));
            };
            let entry = theirs
                .qp_for(rank)
                .ok_or_else(|| bad(format!("no queue pair for rank {rank} (FERROCCL_TRANSPORT differs between ranks?)")))?;
            let info = ConnectInfo::from_bytes(&entry.connect).map_err(|e| bad(e.to_string()))?;
            let their_mtu = Mtu::from_bytes(theirs.mtu).ok_or_else(|| bad(format!("path MTU {}", theirs.mtu)))?;
            let mtu = if their_mtu.bytes() < self.mtu.bytes() { their_mtu } else { self.mtu };
            let prep = self
                .qps
                .get_mut(p)
                .and_then(Option::take)
                .ok_or_else(|| Error::internal(format!("rank {rank}: no verbs queue pair made for rank {p}")))?;
            let send_ring = self
                .pd
                .alloc_region(SLOTS * SLOT_BYTES, Access::empty())
                .map_err(verr(rank, format!("register send slots for rank {p}")))?;
            for _ in 0..RQ_DEPTH {
                prep.qp.post_recv_empty(wr_id(WR_RECV, p, 0)).map_err(verr(rank, format!("post receives for rank {p}")))?;
            }
            let qp = prep
                .qp
                .ready_to_receive_with_mtu(&info, Some(mtu))
                .and_then(|q| q.ready_to_send())
                .map_err(verr(rank, format!("connect the queue pair to rank {p}")))?;
            slots[p] = Some(Peer {
                peer: p,
                qp,
                send_ring,
                recv_ring: prep.recv_ring,
                remote: RemoteRing { addr: entry.ring_addr, rkey: entry.ring_rkey },
                st: Mutex::new(PeerState::default()),
            });
        }
        Ok((stage, slots))
    }
}

impl VerbsNet {
    /// Posts a keepalive to every peer with nothing in flight (see the module docs).
    fn ping_idle(&self) {
        for pe in self.peers.iter().flatten() {
            let mut st = lock(&pe.st);
            if st.dead || st.bye || st.sq_used > 0 {
                continue;
            }
            if post_ctrl(pe, IMM_CTRL | (KIND_PING << IMM_KIND_SHIFT)).is_ok() {
                st.sq_used += 1;
            }
        }
    }

    fn peer(&self, p: usize) -> Result<&Peer> {
        self.peers
            .get(p)
            .and_then(|x| x.as_ref())
            .ok_or_else(|| Error::internal(format!("rank {}: no verbs queue pair to rank {p}", self.rank)))
    }

    fn fail(&self, peer: usize, what: String) {
        if let Some(Some(pe)) = self.peers.get(peer) {
            lock(&pe.st).dead = true;
        }
        self.inbox.peer_failed(peer, what);
    }

    /// Drains the completion queue: lands messages, immediates, credits and goodbyes in
    /// the fabric's event state, frees slots whose sends completed. Returns whether
    /// anything happened. A failed completion fails its peer (the fabric's fatal state).
    pub(crate) fn poll(&self) -> Result<bool> {
        // One poller at a time; a thread that finds another polling has nothing to do.
        let Ok(mut out) = self.polled.try_lock() else { return Ok(false) };
        out.clear();
        let cap = out.capacity();
        let n = self.cq.poll(&mut out, cap).map_err(verr(self.rank, "poll the completion queue"))?;
        let mut delivered = false;
        for c in out.drain(..) {
            delivered |= self.complete(c);
        }
        drop(out);
        if self.credits_owed.swap(false, Ordering::AcqRel) {
            for pe in self.peers.iter().flatten() {
                self.return_credits(pe);
            }
        }
        if delivered {
            self.inbox.notify();
        }
        Ok(n > 0)
    }

    /// Keeps `mr` until the completion of the work request given the returned slot.
    fn hold_direct(&self, mr: &Arc<UserMr>) -> u32 {
        let mut d = lock(&self.direct);
        match d.free.pop() {
            Some(i) => {
                d.slots[i as usize] = Some(mr.clone());
                i
            }
            None => {
                d.slots.push(Some(mr.clone()));
                (d.slots.len() - 1) as u32
            }
        }
    }

    /// Lets go of a zero-copy write's memory region (its completion was polled, or it was
    /// never posted). The last clone deregisters it, outside the lock.
    fn release_direct(&self, slot: u32) {
        let mr = {
            let mut d = lock(&self.direct);
            let mr = d.slots.get_mut(slot as usize).and_then(Option::take);
            if mr.is_some() {
                d.free.push(slot);
            }
            mr
        };
        drop(mr);
    }

    /// Bytes one-sided writes have moved since setup: (copied through the staging slots,
    /// written straight from windows' memory regions).
    pub(crate) fn write_bytes(&self) -> (u64, u64) {
        (self.staged_bytes.load(Ordering::Relaxed), self.direct_bytes.load(Ordering::Relaxed))
    }

    /// Bytes this rank has read from peers' windows with RDMA READ since setup.
    pub(crate) fn read_bytes(&self) -> u64 {
        self.read_bytes.load(Ordering::Relaxed)
    }

    /// Bytes this rank has written into peers' windows with RDMA WRITE since setup.
    pub(crate) fn window_write_bytes(&self) -> u64 {
        self.window_write_bytes.load(Ordering::Relaxed)
    }

    /// The inbox the transport delivers into.
    pub(crate) fn inbox(&self) -> &Arc<Inbox> {
        &self.inbox
    }

    /// Keeps `h` until the completion of the RDMA READ given the returned slot.
    fn hold_read(&self, h: ReadHold) -> u32 {
        let mut d = lock(&self.reads);
        match d.free.pop() {
            Some(i) => {
                d.slots[i as usize] = Some(h);
                i
            }
            None => {
                d.slots.push(Some(h));
                (d.slots.len() - 1) as u32
            }
        }
    }

    /// Takes an RDMA READ's hold out of its slot (its completion was polled, or it was
    /// never posted). The caller drops it outside the lock (the last clone of the target's
    /// memory region deregisters it).
    fn take_read(&self, slot: u32) -> Option<ReadHold> {
        let mut d = lock(&self.reads);
        let h = d.slots.get_mut(slot as usize).and_then(Option::take);
        if h.is_some() {
            d.free.push(slot);
        }
        h
    }

    /// Handles one completion; returns whether an event was delivered.
    fn complete(&self, c: Completion) -> bool {
        let (kind, p, extra) = wr_parts(c.wr_id);
        if kind == WR_DIRECT {
            // Failed or not, the device is done with the source.
            self.release_direct(extra);
        }
        // Failed or not, the device is done with the READ's target and the peer's region.
        let read_imm = match (kind == WR_READ).then(|| self.take_read(extra)).flatten() {
            Some(h) => {
                h.region.done(1);
                h.imm
            }
            None => None,
        };
        let Some(Some(pe)) = self.peers.get(p) else { return false };
        if kind != WR_RECV {
            let mut st = lock(&pe.st);
            st.sq_used = st.sq_used.saturating_sub(1);
            match kind {
                WR_MSG => st.msg_done += 1,
                WR_STAGE => {
                    drop(st);
                    *lock(&self.stage_free) |= 1u64 << extra;
                }
                _ => {}
            }
        }
        if !c.status.is_success() {
            let what = match kind {
                WR_RECV => "a receive",
                WR_MSG => "an RDMA WRITE WITH IMMEDIATE (message)",
                WR_STAGE | WR_DIRECT => "an RDMA WRITE (one-sided data)",
                WR_READ => "an RDMA READ or WRITE (of a window)",
                _ => "an RDMA WRITE WITH IMMEDIATE (control)",
            };
            self.fail(
                p,
                format!(
                    "is unreachable over verbs: {what} completed with {} (vendor error {:#x}; peer died or its queue pair is gone?)",
                    c.status, c.vendor_err
                ),
            );
            return true;
        }
        if let Some(imm) = read_imm {
            // A row of a read has landed here.
            self.inbox.write_imm(p, imm);
            return true;
        }
        if kind != WR_RECV {
            return false;
        }
        if let Err(e) = pe.qp.post_recv_empty(wr_id(WR_RECV, p, 0)) {
            self.fail(p, format!("could not be received from: ibv_post_recv failed: {e}"));
            return true;
        }
        let Some(imm) = c.imm.filter(|_| c.opcode == WcOpcode::RecvRdmaWithImm) else {
            self.fail(p, "sent a work request without an immediate".into());
            return true;
        };
        if imm & IMM_CTRL == 0 {
            self.inbox.write_imm(p, imm);
            return true;
        }
        let low = imm & IMM_LOW;
        match (imm & !IMM_CTRL) >> IMM_KIND_SHIFT {
            KIND_MSG => {
                let len = low as usize;
                let slot = {
                    let st = lock(&pe.st);
                    (st.consumed % SLOTS as u64) as usize
                };
                if len > SLOT_BYTES {
                    self.fail(p, format!("sent a {len}-byte message, over the {SLOT_BYTES}-byte slot"));
                    return true;
                }
                let mut msg = vec![0u8; len];
                pe.recv_ring.read(slot * SLOT_BYTES, &mut msg);
                {
                    let mut st = lock(&pe.st);
                    st.consumed += 1;
                }
                self.inbox.deliver_msg(p, msg);
                self.return_credits(pe);
            }
            KIND_CREDIT => lock(&pe.st).credits += u64::from(low),
            KIND_BYE => {
                lock(&pe.st).bye = true;
                self.inbox.peer_closed(p);
            }
            KIND_PING => {}
            k => self.fail(p, format!("sent an unknown verbs control kind {k}")),
        }
        true
    }

    /// Hands consumed slots back to the peer, in batches of `SLOTS / 2` (a sender that
    /// waits for credits has all `SLOTS` messages in flight, so every batch fills). If the
    /// send queue is full now, the next poll tries again.
    fn return_credits(&self, pe: &Peer) {
        let mut st = lock(&pe.st);
        let owed = st.consumed - st.returned;
        if st.dead || owed < (SLOTS / 2) as u64 {
            return;
        }
        if st.sq_used >= SQ_DEPTH {
            self.credits_owed.store(true, Ordering::Release);
            return;
        }
        let imm = IMM_CTRL | (KIND_CREDIT << IMM_KIND_SHIFT) | (owed as u32 & IMM_LOW);
        match post_ctrl(pe, imm) {
            Ok(()) => {
                st.returned += owed;
                st.sq_used += 1;
            }
            Err(e) => {
                drop(st);
                self.fail(pe.peer, format!("could not be sent credits: {e}"));
            }
        }
    }

    /// Takes a free staging slot, polling while none is free.
    fn take_stage(&self, peer: usize, deadline: Instant, poll: &dyn Fn() -> Result<()>) -> Result<u32> {
        let start = Instant::now();
        let mut backoff = Backoff::default();
        loop {
            {
                let mut free = lock(&self.stage_free);
                if *free != 0 {
                    let i = free.trailing_zeros();
                    *free &= !(1u64 << i);
                    return Ok(i);
                }
            }
            self.wait_round(peer, "verbs write (waiting for a staging slot)", start, deadline, &mut backoff, poll)?;
        }
    }

    /// One round of waiting for room (a credit, a send-queue entry, a staging slot): the
    /// caller's `poll` (our inbox, the peers' health), our completions, the deadline, then
    /// the backoff, parking on the doorbell that the completion thread rings.
    fn wait_round(
        &self,
        peer: usize,
        op: &str,
        start: Instant,
        deadline: Instant,
        backoff: &mut Backoff,
        poll: &dyn Fn() -> Result<()>,
    ) -> Result<()> {
        let seen = self.inbox.bell_seen();
        poll()?;
        if self.poll()? {
            backoff.moved();
        }
        if Instant::now() >= deadline {
            return Err(Error::Timeout {
                rank: Some(self.rank),
                op: Op::other(op),
                after: start.elapsed(),
                waiting_for: vec![format!("rank {peer}")],
            });
        }
        backoff.idle(WAIT_NAP, Some(deadline), |until| self.inbox.sleep(seen, until, || false));
        Ok(())
    }
}

/// Posts a zero-length WRITE WITH IMMEDIATE carrying control information.
fn post_ctrl(pe: &Peer, imm: u32) -> ferroccl_verbs::Result<()> {
    let target = RemoteSlice { addr: pe.remote.addr, len: 0, rkey: pe.remote.rkey };
    pe.qp.post_write_imm_empty(wr_id(WR_CTRL, pe.peer, 0), target, imm)
}

/// First byte of a published ready mark: the rest is empty, or the reason the rank could
/// not connect.
const TAG_OK: u8 = 1;
const TAG_ERR: u8 = 2;

/// The reason a peer published instead of its data, if it did.
fn peer_error(b: &[u8]) -> Option<String> {
    let mut r = Reader::new(b);
    match r.u8() {
        Ok(TAG_ERR) => Some(r.str().map(str::to_string).unwrap_or_else(|_| "(unreadable reason)".into())),
        _ => None,
    }
}

/// Address, rkey and length of a window's memory region, as its owner gives them to a
/// reader (`WINFO_REPLY`).
pub(crate) fn region_info(mr: &UserMr) -> (u64, u32, u64) {
    (mr.as_ptr() as u64, mr.rkey(), mr.len() as u64)
}

/// A memory region over a receive target: the rendezvous registration of a verbs peer.
pub(crate) type UserMr = MemoryRegion;

/// Registers `[offset, offset + len)` of `h` for a peer's RDMA WRITE, leasing the range
/// (see the module docs) until the returned region drops.
pub(crate) fn register_user(net: &VerbsNet, h: &RegionHandle, offset: usize, len: usize) -> Result<(RemoteBuf, UserMr)> {
    let lease = h.lease_mut(offset, len).map_err(|e| Error::invalid(format!("rank {}: verbs receive buffer: {e}", net.rank)))?;
    let mr = net.pd.register_lease(lease, Access::REMOTE_WRITE).map_err(verr(net.rank, format!("register a {len}-byte receive buffer")))?;
    Ok((RemoteBuf { addr: mr.as_ptr() as u64, len: len as u64, key: u64::from(mr.rkey()) }, mr))
}

/// Registers the whole of window `h` as the source of zero-copy RDMA WRITEs (local read
/// only), once, when the window is made. The memory region holds a read lease on the
/// window's region, so the window's scope cannot end while it (or a work request posted
/// from it, see [`DirectSlots`]) lives. Fails naming the window's size (and, when the
/// memlock limit refused it, that limit and how to raise it).
///
/// A read-write window (`writable`) is registered over a writable lease with
/// `REMOTE_WRITE` too, so verbs peers write it with RDMA WRITE; a read-only window's
/// region allows `REMOTE_READ` only, and the NIC refuses a write through its rkey.
pub(crate) fn register_window(net: &VerbsNet, h: &RegionHandle, writable: bool) -> Result<UserMr> {
    let len = h.len();
    let bad = |e| Error::invalid(format!("rank {}: a {len}-byte window: {e}", net.rank));
    let what = format!("register a {len}-byte window for zero-copy reads and writes by verbs peers");
    if writable {
        let lease = h.lease_mut(0, len).map_err(bad)?;
        net.pd.register_lease(lease, Access::REMOTE_READ | Access::REMOTE_WRITE).map_err(verr(net.rank, what))
    } else {
        let lease = h.lease(0, len).map_err(bad)?;
        net.pd.register_lease(lease, Access::REMOTE_READ).map_err(verr(net.rank, what))
    }
}

/// Registers `[offset, offset + len)` of `h` as the source of RDMA WRITEs to a peer's
/// window (local read only), over a read lease held until the region drops (the last
/// work request posted from it holds a clone until its completion is polled).
pub(crate) fn register_source(net: &VerbsNet, h: &RegionHandle, offset: usize, len: usize) -> Result<Arc<UserMr>> {
    let lease = h.lease(offset, len).map_err(|e| Error::invalid(format!("rank {}: verbs write source: {e}", net.rank)))?;
    net.pd
        .register_lease(lease, Access::empty())
        .map(Arc::new)
        .map_err(verr(net.rank, format!("register a {len}-byte source of a write to a window")))
}

/// Waits until no work request posted from `mr` is in flight (the caller holds the only
/// other clone), polling the completion queue, until `deadline`; returns whether it is
/// unused. A window's removal calls it, so its memory region (and lease) outlives every
/// read posted from it; past the deadline the region goes when the last completion is
/// polled.
pub(crate) fn wait_unused(net: &VerbsNet, mr: &Arc<UserMr>, deadline: Instant) -> bool {
    let mut backoff = Backoff::default();
    loop {
        if Arc::strong_count(mr) == 1 {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        let seen = net.inbox.bell_seen();
        if matches!(net.poll(), Ok(true)) {
            backoff.moved();
            continue;
        }
        backoff.idle(WAIT_NAP, Some(deadline), |until| net.inbox.sleep(seen, until, || false));
    }
}

/// This rank's connection to one peer over verbs.
#[derive(Debug)]
pub(crate) struct VerbsEndpoint {
    rank: usize,
    peer: usize,
    net: Arc<VerbsNet>,
}

impl VerbsEndpoint {
    fn new(net: Arc<VerbsNet>, peer: usize) -> VerbsEndpoint {
        VerbsEndpoint { rank: net.rank, peer, net }
    }

    pub(crate) fn net(&self) -> &Arc<VerbsNet> {
        &self.net
    }

    /// The peer's window region at `addr` (`len` bytes, `rkey`, writable or not), as its
    /// owner gave it.
    pub(crate) fn remote_region(&self, addr: u64, rkey: u32, len: u64, writable: bool) -> Arc<RemoteRegion> {
        Arc::new(RemoteRegion { addr, rkey, len, writable, state: Mutex::default() })
    }

    /// Whether the queue pair is cut or failed (nothing can be posted, and nothing it
    /// posted can still reach the peer's memory).
    pub(crate) fn is_dead(&self) -> bool {
        self.net.peer(self.peer).map_or(true, |pe| lock(&pe.st).dead)
    }

    /// The connection to world rank `peer` (a window's owner telling its holders).
    pub(crate) fn to(net: &Arc<VerbsNet>, peer: usize) -> VerbsEndpoint {
        VerbsEndpoint::new(net.clone(), peer)
    }

    pub(crate) fn max_send(&self) -> usize {
        SLOT_BYTES
    }

    /// Reads `r`'s rows of the peer's window `region` into `dst` with RDMA READs (pieces of
    /// at most [`DIRECT_BYTES`]; the last piece of each row reports the row's immediate to
    /// this rank's inbox when its completion is polled, as a peer's write with immediate
    /// does). Returns `Ok(false)`, having posted nothing, when the owner has revoked the
    /// region. Every piece must lie inside the region and inside `dst` (checked here, as
    /// the device checks the rkey's bounds), and `dst` must allow local writes.
    pub(crate) fn post_read(
        &self,
        region: &Arc<RemoteRegion>,
        dst: &Arc<UserMr>,
        r: &ReadReq,
        deadline: Instant,
        poll: &dyn Fn() -> Result<()>,
    ) -> Result<bool> {
        self.post_rma(region, dst, r, false, deadline, poll)
    }

    /// Writes `r`'s rows from `src` (the local side: `local_offset`, `local_stride`) into
    /// the peer's window `region` with RDMA WRITEs (no immediate: the owner's CPU takes no
    /// part), as [`post_read`](Self::post_read) reads: the last piece of each row reports
    /// the row's immediate to this rank's own inbox when its (signaled) completion is
    /// polled, which on a reliable connection means the peer's NIC has acknowledged it,
    /// so its bytes are placed in the window. Returns `Ok(false)`, having posted nothing,
    /// when the owner has revoked the region. The region must be writable (checked here:
    /// the NIC would refuse the write and break the connection).
    pub(crate) fn post_write_to(
        &self,
        region: &Arc<RemoteRegion>,
        src: &Arc<UserMr>,
        r: &ReadReq,
        deadline: Instant,
        poll: &dyn Fn() -> Result<()>,
    ) -> Result<bool> {
        if !region.writable {
            return Err(Error::internal(format!("rank {}: RDMA WRITE to a read-only window of rank {}", self.rank, self.peer)));
        }
        self.post_rma(region, src, r, true, deadline, poll)
    }

    /// [`post_read`](Self::post_read) (`write` false) or
    /// [`post_write_to`](Self::post_write_to) (`write` true).
    fn post_rma(
        &self,
        region: &Arc<RemoteRegion>,
        dst: &Arc<UserMr>,
        r: &ReadReq,
        write: bool,
        deadline: Instant,
        poll: &dyn Fn() -> Result<()>,
    ) -> Result<bool> {
        let pe = self.net.peer(self.peer)?;
        let pieces_per_row = r.row.div_ceil(DIRECT_BYTES).max(1) as u64;
        let total = pieces_per_row * u64::from(r.rows);
        for i in 0..r.rows {
            let (ro, lo) = (
                r.remote_offset.checked_add(u64::from(i).saturating_mul(r.remote_stride)),
                (i as usize).checked_mul(r.local_stride).and_then(|x| x.checked_add(r.local_offset)),
            );
            let fits_remote = ro.and_then(|o| o.checked_add(r.row as u64)).is_some_and(|e| e <= region.len);
            let fits_local = lo.and_then(|o| o.checked_add(r.row)).is_some_and(|e| e <= dst.len());
            if !fits_remote || !fits_local {
                return Err(Error::internal(format!(
                    "rank {}: RDMA {} row {i} of {} bytes does not fit the {}-byte window of rank {} or the {}-byte local buffer",
                    self.rank,
                    if write { "WRITE" } else { "READ" },
                    r.row,
                    region.len,
                    self.peer,
                    dst.len()
                )));
            }
        }
        if !region.reserve(total) {
            return Ok(false);
        }
        let mut posted = 0u64;
        let res = self.post_rma_pieces(pe, region, dst, r, write, pieces_per_row, &mut posted, deadline, poll);
        // What was reserved and not posted is not in flight.
        region.done(total - posted);
        res.map(|()| true)
    }

    #[allow(clippy::too_many_arguments)]
    fn post_rma_pieces(
        &self,
        pe: &Peer,
        region: &Arc<RemoteRegion>,
        dst: &Arc<UserMr>,
        r: &ReadReq,
        write: bool,
        pieces_per_row: u64,
        posted: &mut u64,
        deadline: Instant,
        poll: &dyn Fn() -> Result<()>,
    ) -> Result<()> {
        let start = Instant::now();
        let mut backoff = Backoff::default();
        for i in 0..r.rows {
            let ro = r.remote_offset + u64::from(i) * r.remote_stride;
            let lo = r.local_offset + i as usize * r.local_stride;
            let mut k = 0u64;
            while k < pieces_per_row {
                let pos = k as usize * DIRECT_BYTES;
                let piece = (r.row - pos.min(r.row)).min(DIRECT_BYTES);
                let last = k + 1 == pieces_per_row;
                let mut st = lock(&pe.st);
                if st.dead {
                    return Err(self.dead_err());
                }
                if st.sq_used >= SQ_DEPTH {
                    drop(st);
                    self.net.wait_round(self.peer, "verbs read (send queue full)", start, deadline, &mut backoff, poll)?;
                    continue;
                }
                let remote = RemoteSlice { addr: region.addr + ro + pos as u64, len: piece as u32, rkey: region.rkey };
                let slot = self.net.hold_read(ReadHold {
                    _dst: dst.clone(),
                    region: region.clone(),
                    imm: last.then(|| r.imm.wrapping_add(i) & !IMM_CTRL),
                });
                let off = lo + pos;
                let id = wr_id(WR_READ, self.peer, slot);
                let res = if write {
                    pe.qp.post_write_from(id, dst, off..off + piece, remote, None, true)
                } else {
                    pe.qp.post_read_into(id, dst, off..off + piece, remote, true)
                };
                if let Err(e) = res {
                    drop(st);
                    // Not posted: let go of the slot without counting a completion.
                    let _ = self.net.take_read(slot);
                    let what = if write { "write" } else { "read" };
                    return Err(verr(self.rank, format!("{what} {piece} bytes of a window of rank {}", self.peer))(e));
                }
                st.sq_used += 1;
                *posted += 1;
                drop(st);
                if write {
                    self.net.window_write_bytes.fetch_add(piece as u64, Ordering::Relaxed);
                } else {
                    self.net.read_bytes.fetch_add(piece as u64, Ordering::Relaxed);
                }
                k += 1;
            }
        }
        Ok(())
    }

    fn dead_err(&self) -> Error {
        Error::Transport {
            rank: self.rank,
            peer: Some(self.peer),
            transport: TransportKind::Verbs,
            what: "the queue pair is cut or failed".into(),
        }
    }

    /// Sends a message through the next eager slot, waiting (polling) for a credit.
    pub(crate) fn post_send(&self, msg: &[u8], deadline: Instant, poll: &dyn Fn() -> Result<()>) -> Result<()> {
        self.post_send2(msg, &[], deadline, poll)
    }

    /// One message, `head` then `body`, copied straight into a send slot.
    pub(crate) fn post_send2(&self, head: &[u8], body: &[u8], deadline: Instant, poll: &dyn Fn() -> Result<()>) -> Result<()> {
        let pe = self.net.peer(self.peer)?;
        let start = Instant::now();
        let mut backoff = Backoff::default();
        loop {
            match self.try_send(pe, head, body)? {
                true => return Ok(()),
                false => self.net.wait_round(self.peer, "verbs send (waiting for a credit)", start, deadline, &mut backoff, poll)?,
            }
        }
    }

    /// Posts `msg` if a slot and a send-queue entry are free now.
    fn try_send(&self, pe: &Peer, head: &[u8], body: &[u8]) -> Result<bool> {
        let len = head.len() + body.len();
        if len > SLOT_BYTES {
            return Err(Error::invalid(format!("verbs message of {len} bytes exceeds the {SLOT_BYTES}-byte slot")));
        }
        let mut st = lock(&pe.st);
        if st.dead {
            return Err(self.dead_err());
        }
        let free_from = st.msg_done.min(st.credits);
        if st.sent - free_from >= SLOTS as u64 || st.sq_used >= SQ_DEPTH {
            return Ok(false);
        }
        let slot = (st.sent % SLOTS as u64) as usize;
        let off = slot * SLOT_BYTES;
        pe.send_ring.write(off, head);
        pe.send_ring.write(off + head.len(), body);
        let remote = RemoteSlice { addr: pe.remote.addr + off as u64, len: len as u32, rkey: pe.remote.rkey };
        let imm = IMM_CTRL | (KIND_MSG << IMM_KIND_SHIFT) | len as u32;
        // The send slot is not written again until this work request has completed
        // (`msg_done` counts it) and the peer has handed the slot back (credits).
        pe.qp
            .post_write_from(wr_id(WR_MSG, self.peer, slot as u32), &pe.send_ring, off..off + len, remote, Some(imm), true)
            .map_err(verr(self.rank, format!("send a message to rank {}", self.peer)))?;
        st.sent += 1;
        st.sq_used += 1;
        Ok(true)
    }

    /// Sends only if a slot is free now (telling a peer why we give up).
    /// The message is the fabric's `ERR` before it cuts: [`cut`](Self::cut) waits for it to
    /// be acknowledged.
    pub(crate) fn try_post_send_now(&self, msg: &[u8]) -> Result<()> {
        let pe = self.net.peer(self.peer)?;
        match self.try_send(pe, msg, &[])? {
            true => {
                let mut st = lock(&pe.st);
                st.flush_until = st.sent;
                Ok(())
            }
            false => Err(Error::WouldBlock("no verbs slot free".into())),
        }
    }

    /// Writes `w` into the peer's registered memory, each piece an RDMA WRITE, the last one
    /// WITH IMMEDIATE (RC delivers them in order, so the immediate means every byte has
    /// landed). With a memory region over the source (`w.src_mr`, a window's), the device
    /// reads the source itself (zero copy; the region stays registered until the pieces
    /// complete); otherwise the source is copied through staging slots and may be reused
    /// when this returns.
    pub(crate) fn post_write(&self, w: &WriteReq<'_>, deadline: Instant, poll: &dyn Fn() -> Result<()>) -> Result<()> {
        if w.imm & IMM_CTRL != 0 {
            return Err(Error::internal(format!("verbs write immediate {:#x} uses the control bit", w.imm)));
        }
        let rkey =
            u32::try_from(w.dst.key).map_err(|_| Error::invalid(format!("verbs write target key {:#x} is not an rkey", w.dst.key)))?;
        let pe = self.net.peer(self.peer)?;
        if let Some(mr) = w.src_mr {
            if mr.as_ptr() as u64 != w.src.addr() || mr.len() != w.src.len() {
                return Err(Error::internal(format!(
                    "verbs write source: a memory region of {} bytes at {:#x} is not that of the {}-byte region at {:#x}",
                    mr.len(),
                    mr.as_ptr() as u64,
                    w.src.len(),
                    w.src.addr()
                )));
            }
            return self.post_write_direct(pe, w, mr, rkey, deadline, poll);
        }
        let start = Instant::now();
        let mut backoff = Backoff::default();
        let mut pos = 0usize;
        loop {
            let piece = (w.len - pos).min(STAGE_BYTES);
            let last = pos + piece == w.len;
            // Room in the send queue first, so that a taken staging slot is always posted.
            loop {
                let st = lock(&pe.st);
                if st.dead {
                    return Err(self.dead_err());
                }
                if st.sq_used < SQ_DEPTH {
                    break;
                }
                drop(st);
                self.net.wait_round(self.peer, "verbs write (send queue full)", start, deadline, &mut backoff, poll)?;
            }
            let slot = self.net.take_stage(self.peer, deadline, poll)?;
            let free_slot = || *lock(&self.net.stage_free) |= 1u64 << slot;
            let off = slot as usize * STAGE_BYTES;
            let copied = w.src.with_slice(w.offset + pos, piece, |b| self.net.stage.write(off, b));
            if let Err(e) = copied {
                free_slot();
                return Err(Error::internal(format!("verbs write source: {e}")));
            }
            let remote = RemoteSlice { addr: w.dst_addr(pos), len: piece as u32, rkey };
            let mut st = lock(&pe.st);
            if st.dead {
                drop(st);
                free_slot();
                return Err(self.dead_err());
            }
            if st.sq_used >= SQ_DEPTH {
                // Another thread filled the send queue meanwhile: try this piece again.
                drop(st);
                free_slot();
                self.net.wait_round(self.peer, "verbs write (send queue full)", start, deadline, &mut backoff, poll)?;
                continue;
            }
            let id = wr_id(WR_STAGE, self.peer, slot);
            // The staging slot is not written again until this work request's completion
            // has been polled (which frees it).
            let posted = pe.qp.post_write_from(id, &self.net.stage, off..off + piece, remote, last.then_some(w.imm), true);
            if let Err(e) = posted {
                drop(st);
                free_slot();
                return Err(verr(self.rank, format!("write {piece} bytes to rank {}", self.peer))(e));
            }
            st.sq_used += 1;
            drop(st);
            self.net.staged_bytes.fetch_add(piece as u64, Ordering::Relaxed);
            pos += piece;
            if last {
                return Ok(());
            }
        }
    }

    /// [`post_write`](Self::post_write) from `mr`, the memory region over the whole source:
    /// pieces of at most [`DIRECT_BYTES`], each holding a clone of `mr` until its completion
    /// is polled.
    fn post_write_direct(
        &self,
        pe: &Peer,
        w: &WriteReq<'_>,
        mr: &Arc<UserMr>,
        rkey: u32,
        deadline: Instant,
        poll: &dyn Fn() -> Result<()>,
    ) -> Result<()> {
        let start = Instant::now();
        let mut backoff = Backoff::default();
        let mut pos = 0usize;
        loop {
            let piece = (w.len - pos).min(DIRECT_BYTES);
            let last = pos + piece == w.len;
            let mut st = lock(&pe.st);
            if st.dead {
                return Err(self.dead_err());
            }
            if st.sq_used >= SQ_DEPTH {
                drop(st);
                self.net.wait_round(self.peer, "verbs write (send queue full)", start, deadline, &mut backoff, poll)?;
                continue;
            }
            let remote = RemoteSlice { addr: w.dst_addr(pos), len: piece as u32, rkey };
            let slot = self.net.hold_direct(mr);
            let off = w.offset + pos;
            let posted =
                pe.qp.post_write_from(wr_id(WR_DIRECT, self.peer, slot), mr, off..off + piece, remote, last.then_some(w.imm), true);
            if let Err(e) = posted {
                drop(st);
                self.net.release_direct(slot);
                return Err(verr(self.rank, format!("write {piece} bytes to rank {}", self.peer))(e));
            }
            st.sq_used += 1;
            drop(st);
            self.net.direct_bytes.fetch_add(piece as u64, Ordering::Relaxed);
            pos += piece;
            if last {
                return Ok(());
            }
        }
    }

    /// Stops posting to the peer (after a fatal error).
    ///
    /// First it waits (polling, at most [`CUT_WAIT`]) until the peer has acknowledged the
    /// message [`try_post_send_now`](Self::try_post_send_now) just posted (the fabric's
    /// `ERR` with the root cause): once acknowledged, it sits in the peer's completion queue
    /// ahead of anything our giving up causes there later (a write of theirs refused because
    /// we deregistered its target puts their queue pair in the error state, and an `ERR`
    /// arriving after that would be lost), so the peer reports the root cause, not us.
    pub(crate) fn cut(&self) {
        let Ok(pe) = self.net.peer(self.peer) else { return };
        let until = Instant::now() + CUT_WAIT;
        let mut backoff = Backoff::default();
        loop {
            let seen = self.net.inbox.bell_seen();
            {
                let st = lock(&pe.st);
                if st.dead || st.msg_done >= st.flush_until || Instant::now() >= until {
                    break;
                }
            }
            let _ = self.net.poll();
            backoff.idle(WAIT_NAP, Some(until), |t| self.net.inbox.sleep(seen, t, || false));
        }
        lock(&pe.st).dead = true;
    }

    /// Says goodbye and waits (polling, until `deadline`) for our sends to the peer to
    /// complete, so that nothing is in flight when the queue pair goes.
    pub(crate) fn close(&self, deadline: Instant, poll: &dyn Fn() -> Result<()>) {
        let Ok(pe) = self.net.peer(self.peer) else { return };
        {
            let mut st = lock(&pe.st);
            if st.dead || st.sq_used >= SQ_DEPTH {
                return;
            }
            if post_ctrl(pe, IMM_CTRL | (KIND_BYE << IMM_KIND_SHIFT)).is_err() {
                return;
            }
            st.sq_used += 1;
        }
        let deadline = deadline.min(Instant::now() + Duration::from_secs(2));
        let mut backoff = Backoff::default();
        while Instant::now() < deadline {
            let seen = self.net.inbox.bell_seen();
            let _ = poll();
            let _ = self.net.poll();
            let st = lock(&pe.st);
            if st.sq_used == 0 || st.dead {
                return;
            }
            drop(st);
            backoff.idle(WAIT_NAP, Some(deadline), |t| self.net.inbox.sleep(seen, t, || false));
        }
    }
}
