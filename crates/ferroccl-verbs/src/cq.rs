//! Completion queues and completions.

use std::fmt;
use std::io;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_sys as sys;

use crate::device::Context;
use crate::{Error, Result};

/// A completion queue (`ibv_cq`). Clones share it; it keeps its [`Context`] alive.
#[derive(Clone)]
pub struct CompletionQueue {
    pub(crate) inner: Arc<CqInner>,
}

pub(crate) struct CqInner {
    cq: NonNull<sys::ibv_cq>,
    capacity: u32,
    /// The channel its events go to, if any: destroyed after the CQ (fields drop after
    /// `Drop::drop`).
    channel: Option<CompletionChannel>,
    _ctx: Context,
}

// SAFETY: polling and destroying a CQ are thread safe in libibverbs; the CQ is destroyed
// only in `Drop`, after every QP using it (QPs hold clones) is gone.
unsafe impl Send for CqInner {}
// SAFETY: as for `Send`.
unsafe impl Sync for CqInner {}

impl Drop for CqInner {
    fn drop(&mut self) {
        // SAFETY: no QP refers to the CQ any more (each holds a clone).
        unsafe { sys::ibv_destroy_cq(self.cq.as_ptr()) };
    }
}

impl fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionQueue").field("capacity", &self.inner.capacity).finish_non_exhaustive()
    }
}

/// How many work completions one `ibv_poll_cq` call may return.
const POLL_BATCH: usize = 32;

impl CompletionQueue {
    pub(crate) fn new(ctx: &Context, capacity: u32, channel: Option<&CompletionChannel>) -> Result<Self> {
        let cqe = i32::try_from(capacity.max(1))
            .map_err(|_| Error::InvalidArgument(format!("completion queue capacity {capacity} is too large")))?;
        let chan = channel.map_or(std::ptr::null_mut(), |c| c.inner.chan.as_ptr());
        // SAFETY: the context is open; the channel (if any) is alive and kept alive by
        // the CQ; no context pointer; destroyed in `Drop`.
        let raw = unsafe { sys::ibv_create_cq(ctx.as_ptr(), cqe, std::ptr::null_mut(), chan, 0) };
        let cq = NonNull::new(raw).ok_or_else(|| Error::Verb { verb: "ibv_create_cq", source: io::Error::last_os_error() })?;
        // SAFETY: `cq` was just created; `cqe` is the capacity the provider granted.
        let capacity = u32::try_from(unsafe { (*cq.as_ptr()).cqe }).unwrap_or(capacity);
        Ok(Self { inner: Arc::new(CqInner { cq, capacity, channel: channel.cloned(), _ctx: ctx.clone() }) })
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::ibv_cq {
        self.inner.cq.as_ptr()
    }

    /// The number of completions the queue holds (at least what was asked for).
    pub fn capacity(&self) -> u32 {
        self.inner.capacity
    }

    /// Appends up to `max` waiting completions to `out` without blocking; returns how
    /// many were appended. Failed work requests are completions too: check
    /// [`Completion::status`] (or use [`Completion::into_result`]).
    pub fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<usize> {
        let mut got = 0;
        while got < max {
            // SAFETY: all-zero is a valid `ibv_wc` (integers and an integer union).
            let mut wcs: [sys::ibv_wc; POLL_BATCH] = unsafe { std::mem::zeroed() };
            let want = (max - got).min(POLL_BATCH);
            // SAFETY: the CQ is alive and `wcs` has room for `want` entries.
            let n = unsafe { sys::ibv_poll_cq(self.as_ptr(), want as i32, wcs.as_mut_ptr()) };
            if n < 0 {
                return Err(Error::Verb { verb: "ibv_poll_cq", source: io::Error::other(format!("returned {n}")) });
            }
            let n = n as usize;
            out.extend(wcs[..n].iter().map(Completion::from_wc));
            got += n;
            if n < want {
                break;
            }
        }
        Ok(got)
    }

    /// Arms the queue: the next completion added to it sends one event to its
    /// [`CompletionChannel`] (`ibv_req_notify_cq`). Completions already queued send none:
    /// arm, then poll, then wait for the event.
    pub fn req_notify(&self) -> Result<()> {
        if self.inner.channel.is_none() {
            return Err(Error::InvalidArgument("the completion queue has no completion channel".into()));
        }
        // SAFETY: the CQ is alive; arming is thread safe.
        let rc = unsafe { sys::ibv_req_notify_cq(self.as_ptr(), 0) };
        match rc {
            0 => Ok(()),
            rc => Err(Error::Verb { verb: "ibv_req_notify_cq", source: io::Error::from_raw_os_error(rc.abs()) }),
        }
    }

    /// Polls until `count` completions have arrived or `timeout` has passed
    /// ([`Error::Timeout`]). Spins, yielding the CPU between empty polls.
    pub fn wait(&self, count: usize, timeout: Duration) -> Result<Vec<Completion>> {
        let start = Instant::now();
        let mut out = Vec::with_capacity(count);
        while out.len() < count {
            let missing = count - out.len();
            if self.poll(&mut out, missing)? == 0 {
                let waited = start.elapsed();
                if waited >= timeout {
                    return Err(Error::Timeout { waited, wanted: count, got: out.len() });
                }
                std::thread::yield_now();
            }
        }
        Ok(out)
    }
}

/// One work completion.
///
/// As `ibv_poll_cq(3)` says, when the status is not success only `wr_id`, `status`,
/// `qp_num` and `vendor_err` are meaningful.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Completion {
    /// The id given when the work request was posted.
    pub wr_id: u64,
    /// Success, or why the work request failed.
    pub status: WcStatus,
    /// What completed.
    pub opcode: WcOpcode,
    /// Bytes received (receives and RDMA READs).
    pub byte_len: u32,
    /// The immediate data of a SEND or RDMA WRITE with immediate, in host order.
    pub imm: Option<u32>,
    /// The local QP the work request belonged to.
    pub qp_num: u32,
    /// The provider's vendor error code (for failed completions).
    pub vendor_err: u32,
}

impl Completion {
    fn from_wc(wc: &sys::ibv_wc) -> Self {
        let with_imm = wc.wc_flags & sys::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0;
        // SAFETY: both union fields are `u32`; every bit pattern is valid.
        let imm_raw = unsafe { wc.imm_data_invalidated_rkey_union.imm_data };
        Completion {
            wr_id: wc.wr_id,
            status: WcStatus(wc.status),
            opcode: WcOpcode::from_raw(wc.opcode),
            byte_len: wc.byte_len,
            imm: with_imm.then(|| u32::from_be(imm_raw)),
            qp_num: wc.qp_num,
            vendor_err: wc.vendor_err,
        }
    }

    /// `Ok(self)` on success, else [`Error::WorkCompletion`].
    pub fn into_result(self) -> Result<Self> {
        if self.status.is_success() {
            Ok(self)
        } else {
            Err(Error::WorkCompletion { wr_id: self.wr_id, qp_num: self.qp_num, status: self.status.name(), vendor_err: self.vendor_err })
        }
    }
}

/// A work completion status (`ibv_wc_status`).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct WcStatus(sys::ibv_wc_status::Type);

impl WcStatus {
    /// The work request succeeded.
    pub const SUCCESS: WcStatus = WcStatus(sys::ibv_wc_status::IBV_WC_SUCCESS);
    /// The peer refused the access (bad rkey, range or rights).
    pub const REMOTE_ACCESS_ERROR: WcStatus = WcStatus(sys::ibv_wc_status::IBV_WC_REM_ACCESS_ERR);
    /// The work request was flushed because the QP went to the error state.
    pub const FLUSHED: WcStatus = WcStatus(sys::ibv_wc_status::IBV_WC_WR_FLUSH_ERR);
    /// The peer did not answer within the retry budget.
    pub const RETRY_EXCEEDED: WcStatus = WcStatus(sys::ibv_wc_status::IBV_WC_RETRY_EXC_ERR);

    /// Whether this is success.
    pub fn is_success(self) -> bool {
        self == Self::SUCCESS
    }

    /// The raw value.
    pub fn raw(self) -> u32 {
        self.0
    }

    /// The libibverbs name, e.g. `IBV_WC_REM_ACCESS_ERR`.
    pub fn name(self) -> &'static str {
        use sys::ibv_wc_status as s;
        match self.0 {
            s::IBV_WC_SUCCESS => "IBV_WC_SUCCESS",
            s::IBV_WC_LOC_LEN_ERR => "IBV_WC_LOC_LEN_ERR",
            s::IBV_WC_LOC_QP_OP_ERR => "IBV_WC_LOC_QP_OP_ERR",
            s::IBV_WC_LOC_EEC_OP_ERR => "IBV_WC_LOC_EEC_OP_ERR",
            s::IBV_WC_LOC_PROT_ERR => "IBV_WC_LOC_PROT_ERR",
            s::IBV_WC_WR_FLUSH_ERR => "IBV_WC_WR_FLUSH_ERR",
            s::IBV_WC_MW_BIND_ERR => "IBV_WC_MW_BIND_ERR",
            s::IBV_WC_BAD_RESP_ERR => "IBV_WC_BAD_RESP_ERR",
            s::IBV_WC_LOC_ACCESS_ERR => "IBV_WC_LOC_ACCESS_ERR",
            s::IBV_WC_REM_INV_REQ_ERR => "IBV_WC_REM_INV_REQ_ERR",
            s::IBV_WC_REM_ACCESS_ERR => "IBV_WC_REM_ACCESS_ERR",
            s::IBV_WC_REM_OP_ERR => "IBV_WC_REM_OP_ERR",
            s::IBV_WC_RETRY_EXC_ERR => "IBV_WC_RETRY_EXC_ERR",
            s::IBV_WC_RNR_RETRY_EXC_ERR => "IBV_WC_RNR_RETRY_EXC_ERR",
            s::IBV_WC_LOC_RDD_VIOL_ERR => "IBV_WC_LOC_RDD_VIOL_ERR",
            s::IBV_WC_REM_INV_RD_REQ_ERR => "IBV_WC_REM_INV_RD_REQ_ERR",
            s::IBV_WC_REM_ABORT_ERR => "IBV_WC_REM_ABORT_ERR",
            s::IBV_WC_INV_EECN_ERR => "IBV_WC_INV_EECN_ERR",
            s::IBV_WC_INV_EEC_STATE_ERR => "IBV_WC_INV_EEC_STATE_ERR",
            s::IBV_WC_FATAL_ERR => "IBV_WC_FATAL_ERR",
            s::IBV_WC_RESP_TIMEOUT_ERR => "IBV_WC_RESP_TIMEOUT_ERR",
            s::IBV_WC_GENERAL_ERR => "IBV_WC_GENERAL_ERR",
            _ => "IBV_WC_(unknown status)",
        }
    }
}

impl fmt::Debug for WcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}({})", self.name(), self.0)
    }
}

impl fmt::Display for WcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What a completion completed (`ibv_wc_opcode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WcOpcode {
    /// A SEND (or SEND with immediate).
    Send,
    /// An RDMA WRITE (or WRITE with immediate), on the writer's side.
    RdmaWrite,
    /// An RDMA READ, on the reader's side.
    RdmaRead,
    /// A receive consumed by a SEND.
    Recv,
    /// A receive consumed by an RDMA WRITE with immediate.
    RecvRdmaWithImm,
    /// Another opcode, as libibverbs numbers it.
    Other(u32),
}

impl WcOpcode {
    fn from_raw(raw: sys::ibv_wc_opcode::Type) -> Self {
        use sys::ibv_wc_opcode as o;
        match raw {
            o::IBV_WC_SEND => Self::Send,
            o::IBV_WC_RDMA_WRITE => Self::RdmaWrite,
            o::IBV_WC_RDMA_READ => Self::RdmaRead,
            o::IBV_WC_RECV => Self::Recv,
            o::IBV_WC_RECV_RDMA_WITH_IMM => Self::RecvRdmaWithImm,
            other => Self::Other(other),
        }
    }
}

/// A completion channel (`ibv_comp_channel`): a file descriptor that becomes readable
/// when an armed [`CompletionQueue`] using it gets a completion, so a thread can sleep
/// until there is work instead of spinning. Clones share it.
#[derive(Clone)]
pub struct CompletionChannel {
    inner: Arc<ChannelInner>,
}

struct ChannelInner {
    chan: NonNull<sys::ibv_comp_channel>,
    _ctx: Context,
}

// SAFETY: the channel is a file descriptor plus libibverbs bookkeeping; waiting on and
// reading events from it are thread safe, and it is destroyed only in `Drop`, after every
// CQ using it (CQs hold clones).
unsafe impl Send for ChannelInner {}
// SAFETY: as for `Send`.
unsafe impl Sync for ChannelInner {}

impl Drop for ChannelInner {
    fn drop(&mut self) {
        // SAFETY: no CQ uses the channel any more (each holds a clone).
        unsafe { sys::ibv_destroy_comp_channel(self.chan.as_ptr()) };
    }
}

impl fmt::Debug for CompletionChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionChannel").finish_non_exhaustive()
    }
}

impl CompletionChannel {
    pub(crate) fn new(ctx: &Context) -> Result<Self> {
        // SAFETY: the context is open; the channel is destroyed in `Drop`.
        let raw = unsafe { sys::ibv_create_comp_channel(ctx.as_ptr()) };
        let chan = NonNull::new(raw).ok_or_else(|| Error::Verb { verb: "ibv_create_comp_channel", source: io::Error::last_os_error() })?;
        Ok(Self { inner: Arc::new(ChannelInner { chan, _ctx: ctx.clone() }) })
    }

    /// Waits up to `timeout` for an event from an armed completion queue; returns
    /// whether one came (and acknowledges it). The queue needs arming again
    /// ([`CompletionQueue::req_notify`]) for the next event.
    pub fn wait(&self, cq: &CompletionQueue, timeout: Duration) -> Result<bool> {
        use rustix::event::{poll, PollFd, PollFlags, Timespec};
        // SAFETY: the channel is alive while `self` is; `fd` is its descriptor, borrowed
        // only for this call.
        let fd = unsafe { rustix::fd::BorrowedFd::borrow_raw((*self.inner.chan.as_ptr()).fd) };
        let mut fds = [PollFd::new(&fd, PollFlags::IN)];
        let ts = Timespec { tv_sec: timeout.as_secs() as i64, tv_nsec: i64::from(timeout.subsec_nanos()) };
        match poll(&mut fds, Some(&ts)) {
            Ok(0) => return Ok(false),
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => return Ok(false),
            Err(e) => return Err(Error::Verb { verb: "poll(completion channel)", source: e.into() }),
        }
        let mut ev_cq: *mut sys::ibv_cq = std::ptr::null_mut();
        let mut ev_ctx: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: the channel is alive and readable; both out-pointers are valid.
        let rc = unsafe { sys::ibv_get_cq_event(self.inner.chan.as_ptr(), &mut ev_cq, &mut ev_ctx) };
        if rc != 0 {
            return Err(Error::Verb { verb: "ibv_get_cq_event", source: io::Error::last_os_error() });
        }
        if ev_cq != cq.as_ptr() {
            return Err(Error::InvalidArgument("an event for another completion queue arrived on this channel".into()));
        }
        // SAFETY: one event of this (live) CQ was just read; acknowledging it lets the CQ
        // be destroyed later.
        unsafe { sys::ibv_ack_cq_events(cq.as_ptr(), 1) };
        Ok(true)
    }
}

/// A context makes its completion queues and channels here, next to them (the device
/// module knows nothing above it).
impl Context {
    /// Creates a completion queue with room for at least `capacity` completions.
    pub fn create_cq(&self, capacity: u32) -> Result<CompletionQueue> {
        CompletionQueue::new(self, capacity, None)
    }

    /// Creates a completion channel, for completion queues whose waiters sleep.
    pub fn create_comp_channel(&self) -> Result<CompletionChannel> {
        CompletionChannel::new(self)
    }

    /// Creates a completion queue that reports to `channel` when armed
    /// ([`CompletionQueue::req_notify`]).
    pub fn create_cq_with_channel(&self, capacity: u32, channel: &CompletionChannel) -> Result<CompletionQueue> {
        CompletionQueue::new(self, capacity, Some(channel))
    }
}
