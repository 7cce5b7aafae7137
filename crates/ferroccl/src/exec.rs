//! Runs a schedule (see `algo`) over the transports.
//!
//! Steps start in index order as soon as their dependencies have completed: transfers are
//! posted and left in flight (eager sends complete at once; rendezvous transfers complete
//! when the peer's side is there), local steps (reductions, copies) run immediately. So a
//! schedule that interleaves "post the receive of chunk k+1" before "reduce chunk k"
//! overlaps communication with computation without any thread of its own.
//!
//! Transfers in flight are kept in one queue per (peer, direction), in posting order, and
//! only the front of each queue is polled (and the ones behind it as long as the front
//! completes): a stream's messages arrive in order, so the rest could not complete before
//! the front anyway, except an eager message overtaking a rendezvous one, which then just
//! waits its turn. Polling everything in flight on every round would cost O(chunks^2) per
//! call (hundreds of chunks in a large broadcast).
//!
//! Memory: the three buffers are registered regions for the whole call (`with_region` in
//! the caller), so a rendezvous write lands straight in the output or scratch buffer, and
//! a failed call can never be written into after it returns.

use std::ops::Range;

use ferroccl_kernels::{finish_avg_bytes, reduce_into_bytes, reduce_many_bytes, DType, Kernels, ParPool, ReduceOp};
use ferroccl_mem::region::RegionHandle;

use crate::algo::{Action, Buf, Schedule, Slice};
use crate::error::{Error, Result};
use crate::p2p::{RecvOp, SendOp, XferCtx};
use crate::params::FaultSite;
use crate::poll::{poll_of, Poll};
use crate::rma::{GetOp, PutOp, SignalOp};

/// The registered buffers of one call. `input: None` means in place: `Buf::Input` ranges
/// address the output buffer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Buffers<'a> {
    pub(crate) input: Option<&'a RegionHandle>,
    pub(crate) output: &'a RegionHandle,
    pub(crate) scratch: &'a RegionHandle,
}

impl Buffers<'_> {
    fn handle(&self, b: Buf) -> &RegionHandle {
        match b {
            Buf::Input => self.input.unwrap_or(self.output),
            Buf::Output => self.output,
            Buf::Scratch => self.scratch,
        }
    }
}

#[derive(Debug)]
enum Xfer {
    Send(SendOp),
    Recv(RecvOp),
    Get(GetOp),
    Put(PutOp),
    Signal(SignalOp),
}

impl Xfer {
    fn advance(&mut self, cx: &XferCtx<'_>) -> Result<bool> {
        match self {
            Xfer::Send(s) => s.advance(cx),
            Xfer::Recv(r) => r.advance(cx),
            Xfer::Get(g) => g.advance(cx),
            Xfer::Put(p) => p.advance(cx),
            Xfer::Signal(s) => s.advance(cx),
        }
    }
    fn is_done(&self) -> bool {
        match self {
            Xfer::Send(s) => s.is_done(),
            Xfer::Recv(r) => r.is_done(),
            Xfer::Get(g) => g.is_done(),
            Xfer::Put(p) => p.is_done(),
            Xfer::Signal(s) => s.is_done(),
        }
    }
    /// A one-sided step's refusal: it is over, and the run fails when every step is.
    fn take_refusal(&mut self) -> Option<Error> {
        match self {
            Xfer::Get(g) => g.take_refusal(),
            Xfer::Put(p) => p.take_refusal(),
            _ => None,
        }
    }
    fn waiting_for(&self) -> Option<usize> {
        match self {
            Xfer::Send(s) => s.waiting_for(),
            Xfer::Recv(r) => r.waiting_for(),
            Xfer::Get(g) => g.waiting_for(),
            Xfer::Put(p) => p.waiting_for(),
            Xfer::Signal(s) => s.waiting_for(),
        }
    }
}

/// The stream positions of one run of a schedule: the sequence number of every transfer
/// step, fixed when the operation is submitted (so that operations in flight together match
/// in the order they were issued, whatever order their steps start in).
pub(crate) fn assign_seqs(sched: &Schedule, next: &mut dyn FnMut(bool, usize) -> u32, out: &mut Vec<u32>) {
    out.clear();
    for step in &sched.steps {
        out.push(match &step.op {
            Action::Send { peer, .. } => next(true, *peer),
            Action::Recv { peer, .. } => next(false, *peer),
            _ => 0,
        });
    }
}

/// What one run of a schedule needs besides its progress: the schedule, the sequence number
/// of each transfer step, the world rank of each member, and the buffers.
#[derive(Debug)]
pub(crate) struct RunSpec<'a> {
    pub(crate) sched: &'a Schedule,
    pub(crate) seqs: &'a [u32],
    pub(crate) members: &'a [usize],
    pub(crate) dtype: DType,
    pub(crate) op: ReduceOp,
    pub(crate) bufs: Buffers<'a>,
    /// The value of this run's signal steps that take it from the run.
    pub(crate) signal: u64,
}

/// The progress of one run of a schedule: which steps are done, the transfers in flight.
/// Reusable: [`Exec::reset`] keeps every allocation, so a persistent plan's runs allocate
/// nothing here.
#[derive(Debug, Default)]
pub(crate) struct Exec {
    done: Vec<bool>,
    // Transfers in flight, one FIFO per (peer, direction): (step index, transfer). Dropped
    // (revoking any lent buffer) when the run ends, success or not, inside the caller's
    // registrations.
    queues: Vec<std::collections::VecDeque<(usize, Xfer)>>,
    next: usize,
    remaining: usize,
    in_flight: usize,
    /// Where a reduction's source that overlaps its destination is copied first (reused).
    aside: Vec<u8>,
    /// The first refusal of a one-sided step, reported once every step is over.
    refused: Option<Error>,
}

impl Exec {
    /// Prepares a run of `steps` steps over a communicator of `size` ranks.
    pub(crate) fn reset(&mut self, steps: usize, size: usize) {
        self.done.clear();
        self.done.resize(steps, false);
        for q in &mut self.queues {
            q.clear();
        }
        if self.queues.len() < 2 * size {
            self.queues.resize_with(2 * size, Default::default);
        }
        self.next = 0;
        self.remaining = steps;
        self.in_flight = 0;
        self.refused = None;
    }

    /// Gives each (peer, direction) queue room for every transfer step of `sched` that uses
    /// it (as `poll` files them), so that no run of a schedule prepared once and run many
    /// times (a transfer plan, a prepared signal wait) grows a queue the first time a step
    /// waits where it used to complete at once. Not for one-off schedules: a cost per call.
    pub(crate) fn reserve(&mut self, sched: &Schedule, size: usize) {
        if self.queues.len() < 2 * size {
            self.queues.resize_with(2 * size, Default::default);
        }
        let mut need = vec![0usize; 2 * size];
        for step in &sched.steps {
            let qi = match &step.op {
                Action::Recv { peer, .. } | Action::Get { peer, .. } | Action::WaitSignal { peer, .. } => 2 * *peer,
                Action::Send { peer, .. } | Action::Put { peer, .. } | Action::Signal { peer, .. } => 2 * *peer + 1,
                _ => continue,
            };
            if let Some(n) = need.get_mut(qi) {
                *n += 1;
            }
        }
        for (q, n) in self.queues.iter_mut().zip(need) {
            q.reserve(n);
        }
    }

    /// Drops every transfer in flight (after a failure): revokes lent buffers.
    pub(crate) fn abandon(&mut self) {
        for q in &mut self.queues {
            q.clear();
        }
        self.in_flight = 0;
    }

    /// The world ranks the transfers at the front of the queues wait for.
    pub(crate) fn waiting_for(&self) -> Vec<usize> {
        self.queues.iter().filter_map(|q| q.front()).filter_map(|(_, x)| x.waiting_for()).collect()
    }

    /// Moves the run as far as it goes now: completes what can complete, starts every step
    /// whose dependencies are done. `Ready` when every step has completed.
    pub(crate) fn poll(&mut self, cx: &XferCtx<'_>, run: &RunSpec<'_>) -> Result<Poll<()>> {
        let steps = &run.sched.steps;
        let mut moved = false;
        if self.in_flight > 0 {
            for q in self.queues.iter_mut() {
                while let Some((step, x)) = q.front_mut() {
                    moved |= x.advance(cx)?;
                    if !x.is_done() {
                        break;
                    }
                    if let Some(e) = x.take_refusal() {
                        self.refused.get_or_insert(e);
                    }
                    self.done[*step] = true;
                    self.remaining -= 1;
                    self.in_flight -= 1;
                    q.pop_front();
                }
            }
        }
        while self.next < steps.len() && steps[self.next].deps.iter().all(|&d| self.done[d]) {
            let i = self.next;
            let step = &steps[i];
            let world = |peer: usize| {
                run.members.get(peer).copied().ok_or_else(|| Error::internal(format!("{}: step {i}: rank {peer} out of range", cx.op)))
            };
            let started = match &step.op {
                Action::Send { peer, src } => {
                    let h = run.bufs.handle(src.buf).clone();
                    Some((2 * *peer + 1, Xfer::Send(SendOp::new(*peer, world(*peer)?, run.seqs[i], h, src.range.start, src.len()))))
                }
                Action::Recv { peer, dst } => {
                    let h = run.bufs.handle(dst.buf).clone();
                    Some((2 * *peer, Xfer::Recv(RecvOp::new(*peer, world(*peer)?, run.seqs[i], h, dst.range.start, dst.len()))))
                }
                // One-sided steps share the (peer, direction) queues: they complete in the
                // order they were posted to one owner.
                Action::Get { peer, remote, offset, dst, block } => {
                    let h = run.bufs.handle(dst.buf).clone();
                    let op = GetOp::new(*peer, world(*peer)?, *remote, *offset, h, dst.range.start, dst.len(), *block);
                    Some((2 * *peer, Xfer::Get(op)))
                }
                Action::Put { peer, remote, offset, src, block } => {
                    let h = run.bufs.handle(src.buf).clone();
                    Some((2 * *peer + 1, Xfer::Put(PutOp::new(*peer, world(*peer)?, *remote, *offset, h, src.range.start, *block))))
                }
                // Behind the puts to the same peer, so raised after they landed.
                Action::Signal { peer, slot, value } => {
                    Some((2 * *peer + 1, Xfer::Signal(SignalOp::raise(world(*peer)?, *slot, value.unwrap_or(run.signal)))))
                }
                Action::WaitSignal { peer, slot, value } => {
                    Some((2 * *peer, Xfer::Signal(SignalOp::wait(world(*peer)?, *slot, value.unwrap_or(run.signal)))))
                }
                local => {
                    if matches!(local, Action::Reduce { .. } | Action::ReduceMany { .. })
                        && cx.fabric.params.injects(FaultSite::ReduceStep, cx.fabric.rank)
                    {
                        return Err(Error::internal(format!("{}: step {i}: injected by FERROCCL_INJECT_FAULT", cx.op)));
                    }
                    run_local(local, run.dtype, run.op, &run.bufs, &mut self.aside, &|bytes| cx.fabric.local_pool(bytes))
                        .map_err(|e| Error::internal(format!("{}: step {i}: {e}", cx.op)))?;
                    None
                }
            };
            match started {
                Some((qi, mut x)) => {
                    let q = self.queues.get_mut(qi).ok_or_else(|| Error::internal(format!("{}: step {i}: peer out of range", cx.op)))?;
                    // A signal behind a write that is not (yet) `PUT` messages on the
                    // connection (an RDMA WRITE, or one still asking for the region)
                    // starts only at the front of the queue, once that write has
                    // completed: its bytes are placed before the signal is sent.
                    let defer = matches!(x, Xfer::Signal(_)) && q.iter().any(|(_, y)| matches!(y, Xfer::Put(p) if !p.sent_as_puts()));
                    if !defer {
                        x.advance(cx)?;
                    }
                    if let Some(e) = x.take_refusal() {
                        self.refused.get_or_insert(e);
                    }
                    if x.is_done() && q.is_empty() {
                        self.done[i] = true;
                        self.remaining -= 1;
                    } else {
                        // Completion is reported in stream order (see the module docs).
                        q.push_back((i, x));
                        self.in_flight += 1;
                    }
                }
                None => {
                    self.done[i] = true;
                    self.remaining -= 1;
                }
            }
            self.next += 1;
            moved = true;
        }
        if self.remaining == 0 {
            if let Some(e) = self.refused.take() {
                return Err(e);
            }
        }
        Ok(poll_of(self.remaining == 0, moved))
    }
}

/// Full views of the three buffers for one local step.
struct Views<'v> {
    input: Option<&'v [u8]>,
    out: &'v mut [u8],
    scr: &'v mut [u8],
}

/// The pool a local step of so many bytes runs on (`None`: the calling thread alone).
type PoolFor<'p> = dyn Fn(usize) -> Option<&'p ParPool> + 'p;

fn run_local(
    op: &Action,
    dtype: DType,
    rop: ReduceOp,
    bufs: &Buffers<'_>,
    aside: &mut Vec<u8>,
    pool: &PoolFor<'_>,
) -> std::result::Result<(), String> {
    let (out_len, scr_len) = (bufs.output.len(), bufs.scratch.len());
    let res = bufs.output.with_slice_mut(0, out_len, |out| {
        bufs.scratch.with_slice_mut(0, scr_len, |scr| match bufs.input {
            Some(inp) => {
                inp.with_slice(0, inp.len(), |input| local_on(op, dtype, rop, &mut Views { input: Some(input), out, scr }, aside, pool))
            }
            None => Ok(local_on(op, dtype, rop, &mut Views { input: None, out, scr }, aside, pool)),
        })
    });
    match res {
        Ok(Ok(Ok(r))) => r,
        Ok(Ok(Err(e))) | Ok(Err(e)) | Err(e) => Err(e.to_string()),
    }
}

/// Which physical buffer a slice lives in (input aliases output when in place).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Phys {
    In,
    Out,
    Scr,
}

fn phys(v: &Views<'_>, b: Buf) -> Phys {
    match b {
        Buf::Input if v.input.is_some() => Phys::In,
        Buf::Input | Buf::Output => Phys::Out,
        Buf::Scratch => Phys::Scr,
    }
}

fn overlaps(a: &Range<usize>, b: &Range<usize>) -> bool {
    a.start < b.end && b.start < a.end
}

fn read<'v>(v: &'v Views<'_>, s: &Slice) -> std::result::Result<&'v [u8], String> {
    let buf: &[u8] = match phys(v, s.buf) {
        Phys::In => v.input.unwrap_or(&[]),
        Phys::Out => v.out,
        Phys::Scr => v.scr,
    };
    buf.get(s.range.clone()).ok_or_else(|| format!("range {:?} of {:?} is outside its {} bytes", s.range, s.buf, buf.len()))
}

/// Sources a local step takes without allocating; more (a mesh reduction over more ranks)
/// go through a vector.
const INLINE_SRCS: usize = 16;

/// Runs `f(dst, srcs)` with `dst` mutable and every source readable. A source that shares
/// bytes with `dst` (an in-place reduction) is copied into `aside` first. Allocates nothing
/// for up to [`INLINE_SRCS`] sources once `aside` has grown to its working size.
fn with_dst_srcs<R>(
    v: &mut Views<'_>,
    dst: &Slice,
    srcs: &[Slice],
    aside: &mut Vec<u8>,
    f: impl FnOnce(&mut [u8], &[&[u8]]) -> R,
) -> std::result::Result<R, String> {
    let dp = phys(v, dst.buf);
    if dp == Phys::In {
        return Err("a step writes into the input buffer".into());
    }
    // Sources overlapping the destination: copy them out first, one after the other.
    let overlapping = |s: &Slice| phys(v, s.buf) == dp && overlaps(&s.range, &dst.range);
    aside.clear();
    for s in srcs.iter().filter(|s| overlapping(s)) {
        aside.extend_from_slice(read(v, s)?);
    }
    let Views { input, out, scr } = v;
    let (same, other): (&mut [u8], &[u8]) = if dp == Phys::Out { (&mut **out, &**scr) } else { (&mut **scr, &**out) };
    let total = same.len();
    let r = dst.range.clone();
    if r.end > total {
        return Err(format!("range {r:?} of {:?} is outside its {total} bytes", dst.buf));
    }
    let (left, rest) = same.split_at_mut(r.start);
    let (mid, right) = rest.split_at_mut(r.len());
    let (left, right): (&[u8], &[u8]) = (left, right);
    let mut inline: [&[u8]; INLINE_SRCS] = [&[]; INLINE_SRCS];
    let mut heap: Vec<&[u8]> = Vec::new();
    let views: &mut [&[u8]] = if srcs.len() <= INLINE_SRCS {
        &mut inline[..srcs.len()]
    } else {
        heap.resize(srcs.len(), &[]);
        &mut heap
    };
    let mut aside_at = 0;
    for (s, view) in srcs.iter().zip(views.iter_mut()) {
        let p = match s.buf {
            Buf::Input if input.is_some() => Phys::In,
            Buf::Input | Buf::Output => Phys::Out,
            Buf::Scratch => Phys::Scr,
        };
        let bad = || format!("source range {:?} of {:?} is out of bounds", s.range, s.buf);
        *view = if p == dp && overlaps(&s.range, &r) {
            let copy = &aside[aside_at..aside_at + s.len()];
            aside_at += s.len();
            copy
        } else if p == Phys::In {
            input.and_then(|i| i.get(s.range.clone())).ok_or_else(bad)?
        } else if p == dp {
            if s.range.end <= r.start {
                left.get(s.range.clone()).ok_or_else(bad)?
            } else {
                right.get(s.range.start - r.end..s.range.end - r.end).ok_or_else(bad)?
            }
        } else {
            other.get(s.range.clone()).ok_or_else(bad)?
        };
    }
    Ok(f(mid, views))
}

fn local_on(
    op: &Action,
    dtype: DType,
    rop: ReduceOp,
    v: &mut Views<'_>,
    aside: &mut Vec<u8>,
    pool: &PoolFor<'_>,
) -> std::result::Result<(), String> {
    let step_op = if rop == ReduceOp::Avg { ReduceOp::Sum } else { rop };
    let k = Kernels::detected();
    match op {
        Action::Reduce { dst, src } => with_dst_srcs(v, dst, std::slice::from_ref(src), aside, |d, s| match pool(d.len()) {
            Some(p) => p.reduce_into_bytes(k, dtype, step_op, d, s[0]),
            None => reduce_into_bytes(dtype, step_op, d, s[0]),
        })?
        .map_err(|e| e.to_string()),
        Action::ReduceMany { dst, srcs } => with_dst_srcs(v, dst, srcs, aside, |d, s| match pool(d.len()) {
            Some(p) => p.reduce_many_bytes(k, dtype, rop, s, d),
            None => reduce_many_bytes(dtype, rop, s, d),
        })?
        .map_err(|e| e.to_string()),
        Action::Copy { dst, src } => with_dst_srcs(v, dst, std::slice::from_ref(src), aside, |d, s| {
            if d.len() != s[0].len() {
                return Err(format!("copy of {} bytes into {}", s[0].len(), d.len()));
            }
            match pool(d.len()) {
                Some(p) => p.copy(d, s[0]).map_err(|e| e.to_string()),
                None => {
                    d.copy_from_slice(s[0]);
                    Ok(())
                }
            }
        })?,
        Action::FinishAvg { dst, n } => {
            with_dst_srcs(v, dst, &[], aside, |d, _| finish_avg_bytes(dtype, d, *n))?.map_err(|e| e.to_string())
        }
        Action::Send { .. }
        | Action::Recv { .. }
        | Action::Get { .. }
        | Action::Put { .. }
        | Action::Signal { .. }
        | Action::WaitSignal { .. } => Err("internal: a transfer as a local step".into()),
    }
}
