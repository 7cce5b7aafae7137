//! Reliable-connected queue pairs, with the INIT -> RTR -> RTS transitions as types.

use std::collections::hash_map::RandomState;
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::marker::PhantomData;
use std::ops::Range;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use rdma_sys as sys;

use crate::cq::CompletionQueue;
use crate::device::{Gid, Mtu};
use crate::mr::{Access, LocalSlice, MemoryRegion, ProtectionDomain, RemoteSlice};
use crate::{Error, Result};

/// What a peer needs to connect its queue pair to ours: exchange these out of band
/// (FerroCCL: through the bootstrap store).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConnectInfo {
    /// Queue pair number.
    pub qpn: u32,
    /// First packet sequence number our send queue uses (24 bits).
    pub psn: u32,
    /// Port LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// Port GID at the chosen index (RoCE addresses ports by GID).
    pub gid: Gid,
}

impl ConnectInfo {
    /// Encoded length of [`to_bytes`](Self::to_bytes).
    pub const LEN: usize = 26;

    /// A fixed little-endian encoding: qpn, psn, lid, gid.
    pub fn to_bytes(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[0..4].copy_from_slice(&self.qpn.to_le_bytes());
        b[4..8].copy_from_slice(&self.psn.to_le_bytes());
        b[8..10].copy_from_slice(&self.lid.to_le_bytes());
        b[10..26].copy_from_slice(&self.gid.0);
        b
    }

    /// Decodes [`to_bytes`](Self::to_bytes)'s output.
    pub fn from_bytes(b: &[u8]) -> Result<Self> {
        let b: &[u8; Self::LEN] =
            b.try_into().map_err(|_| Error::InvalidArgument(format!("connect info is {} bytes, expected {}", b.len(), Self::LEN)))?;
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[10..26]);
        Ok(Self {
            qpn: u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            psn: u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
            lid: u16::from_le_bytes([b[8], b[9]]),
            gid: Gid(gid),
        })
    }
}

/// How to create and connect an RC queue pair. `Default` suits most uses; set
/// `gid_index` to the port's RoCEv2 GID (the IPv4-mapped one) on RoCE.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QpOptions {
    /// Port number (from 1).
    pub port: u8,
    /// Index of the local GID used as source address (RoCEv2: the entry holding the
    /// netdev's address). Default 0.
    pub gid_index: u8,
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
    /// Scatter/gather entries per send work request.
    pub max_send_sge: u32,
    /// Scatter/gather entries per receive work request.
    pub max_recv_sge: u32,
    /// What the peer may do to this host's memory through this QP. Default: remote
    /// write and read (each memory region restricts this further).
    pub remote_access: Access,
    /// Every send work request generates a completion, whatever its `signaled` flag.
    pub signal_all: bool,
    /// Path MTU; `None` uses the port's active MTU.
    pub path_mtu: Option<Mtu>,
    /// Outstanding RDMA READs/atomics, each way; clamped to the device's limits.
    pub max_rd_atomic: u8,
    /// Local ACK timeout: 4.096 µs * 2^timeout (14: about 67 ms).
    pub timeout: u8,
    /// Transport retries before an error completion (at most 7).
    pub retry_cnt: u8,
    /// Receiver-not-ready retries (7: forever).
    pub rnr_retry: u8,
    /// Receiver-not-ready NAK timer code (12: 0.64 ms).
    pub min_rnr_timer: u8,
}

impl Default for QpOptions {
    fn default() -> Self {
        Self {
            port: 1,
            gid_index: 0,
            max_send_wr: 128,
            max_recv_wr: 128,
            max_send_sge: 1,
            max_recv_sge: 1,
            remote_access: Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
            signal_all: false,
            path_mtu: None,
            max_rd_atomic: 16,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
        }
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A queue pair state, as a type: [`Init`], [`ReadyToReceive`] or [`ReadyToSend`].
pub trait QpState: sealed::Sealed + fmt::Debug {
    /// The state's name in the verbs specification.
    const NAME: &'static str;
}

/// Created, not connected: post receives, then [`QueuePair::ready_to_receive`].
#[derive(Debug)]
pub enum Init {}
/// Connected to a peer, receiving: [`QueuePair::ready_to_send`] next.
#[derive(Debug)]
pub enum ReadyToReceive {}
/// Connected both ways: post sends, writes and reads.
#[derive(Debug)]
pub enum ReadyToSend {}

impl sealed::Sealed for Init {}
impl sealed::Sealed for ReadyToReceive {}
impl sealed::Sealed for ReadyToSend {}
impl QpState for Init {
    const NAME: &'static str = "INIT";
}
impl QpState for ReadyToReceive {
    const NAME: &'static str = "RTR";
}
impl QpState for ReadyToSend {
    const NAME: &'static str = "RTS";
}

/// A reliable-connected queue pair (`ibv_qp`) in state `S`. It keeps its protection
/// domain and completion queues alive. A QP in [`ReadyToSend`] can be cloned to post
/// from several threads.
#[must_use = "dropping a queue pair destroys it"]
pub struct QueuePair<S: QpState> {
    inner: Arc<QpInner>,
    _state: PhantomData<fn() -> S>,
}

struct QpInner {
    qp: NonNull<sys::ibv_qp>,
    qpn: u32,
    psn: u32,
    options: QpOptions,
    max_rd_atomic: u8,
    max_dest_rd_atomic: u8,
    pd: ProtectionDomain,
    _send_cq: CompletionQueue,
    _recv_cq: CompletionQueue,
}

// SAFETY: posting to and modifying a QP are thread safe in libibverbs; the QP is
// destroyed only in `Drop`, when no handle is left.
unsafe impl Send for QpInner {}
// SAFETY: as for `Send`.
unsafe impl Sync for QpInner {}

impl Drop for QpInner {
    fn drop(&mut self) {
        // SAFETY: the last handle is gone; the PD and CQs (fields) are released after.
        unsafe { sys::ibv_destroy_qp(self.qp.as_ptr()) };
    }
}

impl<S: QpState> fmt::Debug for QueuePair<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QueuePair")
            .field("state", &S::NAME)
            .field("qpn", &self.inner.qpn)
            .field("psn", &self.inner.psn)
            .finish_non_exhaustive()
    }
}

impl Clone for QueuePair<ReadyToSend> {
    fn clone(&self) -> Self {
        Self { inner: self.inner.clone(), _state: PhantomData }
    }
}

fn random_psn() -> u32 {
    let mut h = RandomState::new().build_hasher();
    h.write_u64(std::process::id().into());
    (h.finish() as u32) & 0x00ff_ffff
}

fn verb_rc(verb: &'static str, rc: i32) -> Result<()> {
    match rc {
        0 => Ok(()),
        rc if rc > 0 => Err(Error::Verb { verb, source: io::Error::from_raw_os_error(rc) }),
        _ => Err(Error::Verb { verb, source: io::Error::last_os_error() }),
    }
}

impl QueuePair<Init> {
    pub(crate) fn create(pd: &ProtectionDomain, send_cq: &CompletionQueue, recv_cq: &CompletionQueue, options: &QpOptions) -> Result<Self> {
        let ctx = pd.context();
        // SAFETY: all-zero is a valid `ibv_device_attr` (integers and arrays).
        let mut dev: sys::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open and `dev` is a valid out-pointer.
        verb_rc("ibv_query_device", unsafe { sys::ibv_query_device(ctx.as_ptr(), &mut dev) })?;
        let clamp = |limit: i32| options.max_rd_atomic.min(u8::try_from(limit.max(0)).unwrap_or(u8::MAX));
        let (max_rd_atomic, max_dest_rd_atomic) = (clamp(dev.max_qp_init_rd_atom), clamp(dev.max_qp_rd_atom));

        // SAFETY: all-zero is a valid `ibv_qp_init_attr` (null pointers, integers).
        let mut init: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = send_cq.as_ptr();
        init.recv_cq = recv_cq.as_ptr();
        init.qp_type = sys::ibv_qp_type::IBV_QPT_RC;
        init.sq_sig_all = i32::from(options.signal_all);
        init.cap.max_send_wr = options.max_send_wr;
        init.cap.max_recv_wr = options.max_recv_wr;
        init.cap.max_send_sge = options.max_send_sge;
        init.cap.max_recv_sge = options.max_recv_sge;
        // SAFETY: the PD and both CQs are alive (and kept alive by the QP); `init` is
        // fully initialised. The QP is destroyed in `Drop`.
        let raw = unsafe { sys::ibv_create_qp(pd.as_ptr(), &mut init) };
        let qp = NonNull::new(raw).ok_or_else(|| Error::Verb { verb: "ibv_create_qp", source: io::Error::last_os_error() })?;
        // SAFETY: `qp` was just created.
        let qpn = unsafe { (*qp.as_ptr()).qp_num };
        let inner = Arc::new(QpInner {
            qp,
            qpn,
            psn: random_psn(),
            options: options.clone(),
            max_rd_atomic,
            max_dest_rd_atomic,
            pd: pd.clone(),
            _send_cq: send_cq.clone(),
            _recv_cq: recv_cq.clone(),
        });

        // RESET -> INIT
        // SAFETY: all-zero is a valid `ibv_qp_attr`.
        let mut attr: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_INIT;
        attr.pkey_index = 0;
        attr.port_num = options.port;
        attr.qp_access_flags = options.remote_access.normalized().bits();
        let mask = sys::ibv_qp_attr_mask::IBV_QP_STATE
            | sys::ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
            | sys::ibv_qp_attr_mask::IBV_QP_PORT
            | sys::ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS;
        // SAFETY: the QP is alive; `attr` holds every field `mask` names.
        verb_rc("ibv_modify_qp(INIT)", unsafe { sys::ibv_modify_qp(qp.as_ptr(), &mut attr, mask.0 as i32) })?;
        Ok(Self { inner, _state: PhantomData })
    }

    /// Moves to RTR, connected to the peer described by `remote`.
    pub fn ready_to_receive(self, remote: &ConnectInfo) -> Result<QueuePair<ReadyToReceive>> {
        let mtu = self.inner.options.path_mtu;
        self.ready_to_receive_with_mtu(remote, mtu)
    }

    /// As [`ready_to_receive`](Self::ready_to_receive), with the path MTU given (both ends
    /// must use the same one: the smaller of their ports' active MTUs); `None` uses the
    /// port's active MTU.
    pub fn ready_to_receive_with_mtu(self, remote: &ConnectInfo, path_mtu: Option<Mtu>) -> Result<QueuePair<ReadyToReceive>> {
        let o = &self.inner.options;
        let path_mtu = match path_mtu {
            Some(m) => m,
            None => self.inner.pd.context().query_port(o.port)?.active_mtu,
        };
        // SAFETY: all-zero is a valid `ibv_qp_attr`.
        let mut attr: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_RTR;
        attr.path_mtu = path_mtu.raw();
        attr.dest_qp_num = remote.qpn;
        attr.rq_psn = remote.psn & 0x00ff_ffff;
        attr.max_dest_rd_atomic = self.inner.max_dest_rd_atomic;
        attr.min_rnr_timer = o.min_rnr_timer;
        attr.ah_attr.is_global = 1;
        attr.ah_attr.dlid = remote.lid;
        attr.ah_attr.port_num = o.port;
        attr.ah_attr.grh.dgid = sys::ibv_gid { raw: remote.gid.0 };
        attr.ah_attr.grh.sgid_index = o.gid_index;
        attr.ah_attr.grh.hop_limit = 64;
        let mask = sys::ibv_qp_attr_mask::IBV_QP_STATE
            | sys::ibv_qp_attr_mask::IBV_QP_AV
            | sys::ibv_qp_attr_mask::IBV_QP_PATH_MTU
            | sys::ibv_qp_attr_mask::IBV_QP_DEST_QPN
            | sys::ibv_qp_attr_mask::IBV_QP_RQ_PSN
            | sys::ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
            | sys::ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER;
        // SAFETY: the QP is alive; `attr` holds every field `mask` names.
        verb_rc("ibv_modify_qp(RTR)", unsafe { sys::ibv_modify_qp(self.as_ptr(), &mut attr, mask.0 as i32) })?;
        Ok(QueuePair { inner: self.inner, _state: PhantomData })
    }
}

impl QueuePair<ReadyToReceive> {
    /// Moves to RTS: the send queue starts working.
    pub fn ready_to_send(self) -> Result<QueuePair<ReadyToSend>> {
        let o = &self.inner.options;
        // SAFETY: all-zero is a valid `ibv_qp_attr`.
        let mut attr: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_RTS;
        attr.sq_psn = self.inner.psn;
        attr.timeout = o.timeout;
        attr.retry_cnt = o.retry_cnt;
        attr.rnr_retry = o.rnr_retry;
        attr.max_rd_atomic = self.inner.max_rd_atomic;
        let mask = sys::ibv_qp_attr_mask::IBV_QP_STATE
            | sys::ibv_qp_attr_mask::IBV_QP_SQ_PSN
            | sys::ibv_qp_attr_mask::IBV_QP_TIMEOUT
            | sys::ibv_qp_attr_mask::IBV_QP_RETRY_CNT
            | sys::ibv_qp_attr_mask::IBV_QP_RNR_RETRY
            | sys::ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC;
        // SAFETY: the QP is alive; `attr` holds every field `mask` names.
        verb_rc("ibv_modify_qp(RTS)", unsafe { sys::ibv_modify_qp(self.as_ptr(), &mut attr, mask.0 as i32) })?;
        Ok(QueuePair { inner: self.inner, _state: PhantomData })
    }
}

impl<S: QpState> QueuePair<S> {
    fn as_ptr(&self) -> *mut sys::ibv_qp {
        self.inner.qp.as_ptr()
    }

    /// The queue pair number.
    pub fn qpn(&self) -> u32 {
        self.inner.qpn
    }

    /// This QP's connect info (port LID, the GID at `options.gid_index`), for the peer.
    pub fn info(&self) -> Result<ConnectInfo> {
        let o = &self.inner.options;
        let ctx = self.inner.pd.context();
        let port = ctx.query_port(o.port)?;
        if i32::from(o.gid_index) >= port.gid_table_len {
            return Err(Error::InvalidArgument(format!(
                "GID index {} is past port {}'s GID table of {} entries on {}",
                o.gid_index,
                o.port,
                port.gid_table_len,
                ctx.name()
            )));
        }
        let gid = ctx.query_gid(o.port, o.gid_index)?;
        if gid.is_zero() && port.link_layer_ethernet {
            return Err(Error::InvalidArgument(format!(
                "GID index {} of port {} on {} is empty (does the netdev have an address?)",
                o.gid_index,
                o.port,
                ctx.name()
            )));
        }
        Ok(ConnectInfo { qpn: self.inner.qpn, psn: self.inner.psn, lid: port.lid, gid })
    }

    /// Posts a receive into `local` (`None`: a zero-byte receive, enough for an RDMA
    /// WRITE with immediate). May be posted from INIT on, before connecting.
    ///
    /// # Safety
    ///
    /// The memory behind `local` must stay registered, and must not be read or written
    /// by the CPU, until this work request's completion has been polled (or the QP is
    /// destroyed): the device writes into it at any time until then.
    pub unsafe fn post_recv(&self, wr_id: u64, local: Option<LocalSlice>) -> Result<()> {
        let mut sge = local.map(to_sge);
        // SAFETY: all-zero is a valid `ibv_recv_wr` (null pointers, integers).
        let mut wr: sys::ibv_recv_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        if let Some(sge) = sge.as_mut().filter(|s| s.length > 0) {
            wr.sg_list = sge;
            wr.num_sge = 1;
        }
        let mut bad = ptr::null_mut();
        // SAFETY: the QP is alive; `wr` and `sge` outlive the call (the provider copies
        // them); the buffer's lifetime is the caller's contract.
        verb_rc("ibv_post_recv", unsafe { sys::ibv_post_recv(self.as_ptr(), &mut wr, &mut bad) })
    }
}

impl<S: QpState> QueuePair<S> {
    /// Posts a zero-length receive: enough to catch one RDMA WRITE with immediate (the
    /// data goes where the writer says; the receive only carries the immediate). Safe,
    /// because it names no local memory.
    pub fn post_recv_empty(&self, wr_id: u64) -> Result<()> {
        // SAFETY: no memory is handed to the device.
        unsafe { self.post_recv(wr_id, None) }
    }
}

/// The send-queue operations, with their immediate data.
#[derive(Debug, Clone, Copy)]
enum SendOp {
    Send(Option<u32>),
    Write,
    WriteImm(u32),
    Read,
}

fn to_sge(s: LocalSlice) -> sys::ibv_sge {
    sys::ibv_sge { addr: s.addr, length: s.len, lkey: s.lkey }
}

impl QueuePair<ReadyToSend> {
    /// # Safety
    /// As for the public `post_*` methods.
    unsafe fn post(&self, wr_id: u64, op: SendOp, local: LocalSlice, remote: Option<RemoteSlice>, signaled: bool) -> Result<()> {
        use sys::ibv_wr_opcode as o;
        let (verb, opcode, imm) = match op {
            SendOp::Send(None) => ("ibv_post_send(SEND)", o::IBV_WR_SEND, None),
            SendOp::Send(Some(imm)) => ("ibv_post_send(SEND_WITH_IMM)", o::IBV_WR_SEND_WITH_IMM, Some(imm)),
            SendOp::Write => ("ibv_post_send(RDMA_WRITE)", o::IBV_WR_RDMA_WRITE, None),
            SendOp::WriteImm(imm) => ("ibv_post_send(RDMA_WRITE_WITH_IMM)", o::IBV_WR_RDMA_WRITE_WITH_IMM, Some(imm)),
            SendOp::Read => ("ibv_post_send(RDMA_READ)", o::IBV_WR_RDMA_READ, None),
        };
        if let Some(r) = remote {
            if local.len > r.len {
                return Err(Error::InvalidArgument(format!(
                    "{verb}: local slice of {} bytes is longer than the remote slice of {} bytes",
                    local.len, r.len
                )));
            }
        }
        let mut sge = to_sge(local);
        // SAFETY: all-zero is a valid `ibv_send_wr` (null pointers, integers, unions of
        // integers and pointers).
        let mut wr: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        if local.len > 0 {
            wr.sg_list = &mut sge;
            wr.num_sge = 1;
        }
        wr.opcode = opcode;
        if signaled {
            wr.send_flags = sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
        }
        if let Some(imm) = imm {
            wr.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
        }
        if let Some(r) = remote {
            wr.wr.rdma = sys::rdma_t { remote_addr: r.addr, rkey: r.rkey };
        }
        let mut bad = ptr::null_mut();
        // SAFETY: the QP is alive; `wr` and `sge` outlive the call (the provider copies
        // them); the buffers' lifetimes are the caller's contract.
        verb_rc(verb, unsafe { sys::ibv_post_send(self.as_ptr(), &mut wr, &mut bad) })
    }

    /// Posts a SEND of `local` (with `imm` as immediate data, when given); it consumes
    /// one receive on the peer.
    ///
    /// # Safety
    ///
    /// The memory behind `local` must stay registered, and must not be written by the
    /// CPU, until the completion has been polled (for an unsignaled request: the
    /// completion of a later signaled one on this QP); the device reads it until then.
    pub unsafe fn post_send(&self, wr_id: u64, local: LocalSlice, imm: Option<u32>, signaled: bool) -> Result<()> {
        // SAFETY: forwarded from the caller's contract.
        unsafe { self.post(wr_id, SendOp::Send(imm), local, None, signaled) }
    }

    /// Posts an RDMA WRITE of `local` into the peer's `remote` (its first
    /// `local.len` bytes). The peer sees no completion.
    ///
    /// # Safety
    ///
    /// As for [`post_send`](Self::post_send); also, the peer must not rely on the
    /// contents of `remote` until it learns (another message) that the write is done.
    pub unsafe fn post_write(&self, wr_id: u64, local: LocalSlice, remote: RemoteSlice, signaled: bool) -> Result<()> {
        // SAFETY: forwarded from the caller's contract.
        unsafe { self.post(wr_id, SendOp::Write, local, Some(remote), signaled) }
    }

    /// Posts an RDMA WRITE with immediate: the data lands in `remote`, then one of the
    /// peer's receives completes with `imm` (data and notification in one work request).
    ///
    /// # Safety
    ///
    /// As for [`post_send`](Self::post_send).
    pub unsafe fn post_write_imm(&self, wr_id: u64, local: LocalSlice, remote: RemoteSlice, imm: u32, signaled: bool) -> Result<()> {
        // SAFETY: forwarded from the caller's contract.
        unsafe { self.post(wr_id, SendOp::WriteImm(imm), local, Some(remote), signaled) }
    }

    /// Posts an RDMA WRITE of `src[range]` into the peer's `remote` (its first
    /// `range.len()` bytes), WITH IMMEDIATE `imm` when one is given.
    ///
    /// Safe, unlike [`post_write`](Self::post_write): the source is a range of a live
    /// [`MemoryRegion`], whose memory Rust code never references (the region hands out no
    /// references, only copies), stays allocated until after `ibv_dereg_mr`, and cannot be
    /// reached by the device once deregistered (a request still in flight then fails with
    /// a protection error). What is left is a logic rule, not a memory-safety one: bytes
    /// rewritten before the completion is polled may be the ones the peer receives.
    pub fn post_write_from(
        &self,
        wr_id: u64,
        src: &MemoryRegion,
        range: Range<usize>,
        remote: RemoteSlice,
        imm: Option<u32>,
        signaled: bool,
    ) -> Result<()> {
        let local = src.local(range)?;
        let op = match imm {
            Some(i) => SendOp::WriteImm(i),
            None => SendOp::Write,
        };
        // SAFETY: see above: `local` lies in a live registered region that no Rust
        // reference aliases and that stays allocated while registered.
        unsafe { self.post(wr_id, op, local, Some(remote), signaled) }
    }

    /// Posts an RDMA READ of the peer's `remote` (its first `range.len()` bytes) into
    /// `dst[range]`, which must have been registered with [`Access::LOCAL_WRITE`] (an
    /// [`Error::InvalidArgument`] otherwise, before anything reaches the device).
    ///
    /// Safe, unlike [`post_read`](Self::post_read), for the reasons
    /// [`post_write_from`](Self::post_write_from) is: the target is a range of a live
    /// [`MemoryRegion`], whose memory Rust code never references (the region hands out no
    /// references, only copies), stays allocated until after `ibv_dereg_mr`, and cannot be
    /// reached by the device once deregistered (a request still in flight then fails with
    /// a protection error). The device writing into it is what its registration with
    /// `LOCAL_WRITE` allows, as a peer's RDMA WRITE into a region registered with
    /// `REMOTE_WRITE` is. What is left is a logic rule: the bytes are the peer's only once
    /// the completion has been polled.
    pub fn post_read_into(&self, wr_id: u64, dst: &MemoryRegion, range: Range<usize>, remote: RemoteSlice, signaled: bool) -> Result<()> {
        if !dst.access().contains(Access::LOCAL_WRITE) {
            return Err(Error::InvalidArgument(format!(
                "ibv_post_send(RDMA_READ): the target memory region was registered without LOCAL_WRITE ({:?})",
                dst.access()
            )));
        }
        let local = dst.local(range)?;
        // SAFETY: see above: `local` lies in a live region registered for local writes,
        // which no Rust reference aliases and which stays allocated while registered.
        unsafe { self.post(wr_id, SendOp::Read, local, Some(remote), signaled) }
    }

    /// Posts a signaled zero-length RDMA WRITE with immediate into `remote`: a
    /// notification that consumes one of the peer's receives and carries only `imm`.
    /// Safe, because it names no local memory (and writes no remote bytes).
    pub fn post_write_imm_empty(&self, wr_id: u64, remote: RemoteSlice, imm: u32) -> Result<()> {
        let local = LocalSlice { addr: 0, len: 0, lkey: 0 };
        // SAFETY: a zero-length local slice: the device reads no local memory.
        unsafe { self.post(wr_id, SendOp::WriteImm(imm), local, Some(remote), true) }
    }

    /// Posts an RDMA READ of the peer's `remote` (its first `local.len` bytes) into
    /// `local`, whose region needs [`Access::LOCAL_WRITE`].
    ///
    /// # Safety
    ///
    /// The memory behind `local` must stay registered, and must not be read or written
    /// by the CPU, until the completion has been polled: the device writes into it.
    pub unsafe fn post_read(&self, wr_id: u64, local: LocalSlice, remote: RemoteSlice, signaled: bool) -> Result<()> {
        // SAFETY: forwarded from the caller's contract.
        unsafe { self.post(wr_id, SendOp::Read, local, Some(remote), signaled) }
    }
}

impl ProtectionDomain {
    /// Creates an RC queue pair in the INIT state; see [`QueuePair`].
    pub fn create_rc_qp(&self, send_cq: &CompletionQueue, recv_cq: &CompletionQueue, options: &QpOptions) -> Result<QueuePair<Init>> {
        QueuePair::create(self, send_cq, recv_cq, options)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_info_round_trips() {
        let info = ConnectInfo { qpn: 0x12345, psn: 0xabcdef, lid: 7, gid: Gid([9; 16]) };
        assert_eq!(ConnectInfo::from_bytes(&info.to_bytes()).unwrap(), info);
        assert!(matches!(ConnectInfo::from_bytes(&[0; 3]), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn mtu_from_bytes() {
        assert_eq!(Mtu::from_bytes(1024), Some(Mtu::MTU_1024));
        assert_eq!(Mtu::from_bytes(4096).map(Mtu::bytes), Some(4096));
        assert_eq!(Mtu::from_bytes(256).map(Mtu::bytes), Some(256));
        assert_eq!(Mtu::from_bytes(1500), None);
        assert_eq!(Mtu::from_bytes(8192), None);
    }

    #[test]
    fn psn_fits_24_bits() {
        for _ in 0..100 {
            assert!(random_psn() <= 0x00ff_ffff);
        }
    }
}
