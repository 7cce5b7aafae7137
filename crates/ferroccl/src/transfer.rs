//! Transfer plans: many one-sided reads and writes between local windows and remote
//! handles, checked once and run many times (Monarch's `RDMAAction`, NIXL's prepared
//! transfers, Mooncake's batches).
//!
//! A plan is built from entries, each a read (a range of a remote window into a range of
//! a local [`Window`]) or a write (the other way), contiguous or a 2-D block ([`Strided`]:
//! a column shard of a matrix moves as one transfer, without a packing buffer). Building checks every entry once:
//! lengths and offsets against both windows, the access each needs (a read lands in a
//! local window that must be writable; a write needs a read-write handle), handles of
//! another job, owners outside the communicator, and destinations that overlap (two
//! entries landing in the same bytes would race: refused, naming both; rows are compared
//! one by one, so interleaved column shards are fine). [`TransferPlan::run`]
//! then starts every transfer at once (all in flight together, not one round trip each)
//! and waits for all of them; a run allocates nothing and registers nothing, because the
//! local memory is windows, registered when they were made.
//!
//! ```
//! # use ferroccl::bootstrap::{env::StoreRole, new_token, StoreServer};
//! # use ferroccl::{Communicator, InitConfig, Params};
//! # let token = new_token();
//! # let store = StoreServer::start("127.0.0.1:0".parse().unwrap(), &token, 1 << 20)?;
//! # let cfg = InitConfig { rank: 0, world_size: 1, store: StoreRole::Connect(store.addr().to_string()), token };
//! # let comm = Communicator::init_with(cfg, Params::default())?;
//! // The "trainer" side: scattered tensors, each a window (here on the same rank).
//! let (mut a, mut b) = (vec![1.0f32; 10_000], vec![2.0f32; 50_000]);
//! // The "inference" side: one buffer the tensors land in.
//! let mut dst = vec![0.0f32; 60_000];
//! comm.scope(|s| {
//!     let (wa, wb) = (s.register_mut(&mut a)?, s.register_mut(&mut b)?);
//!     let wd = s.register_mut(&mut dst)?;
//!     let (ha, hb) = (wa.handle(), wb.handle()); // what the trainer would publish
//!     let mut plan = comm
//!         .transfer_plan()
//!         .read::<f32>(&ha, 0, &wd, 0, 10_000)
//!         .read::<f32>(&hb, 0, &wd, 10_000, 50_000)
//!         .build()?;
//!     for step in 0..3 {
//!         wa.write(0, &[step as f32])?; // the trainer updates a weight in place
//!         plan.run()?; // both reads in flight at once
//!         let mut first = [0.0f32];
//!         wd.read(0, &mut first)?;
//!         assert_eq!(first[0], step as f32);
//!     }
//!     Ok(())
//! })?;
//! # Ok::<(), ferroccl::Error>(())
//! ```

use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::Arc;

use ferroccl_kernels::{DType, Element};
use ferroccl_mem::region::RegionHandle;

use crate::algo::{Action, Block, Buf, Remote, Schedule, Slice, Step};
use crate::comm::Communicator;
use crate::engine::{Job, Part};
use crate::error::{Error, Op, Result};
use crate::proto::CHAN_USER;
use crate::window::{Access, RemoteHandle, Window};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dir {
    Read,
    Write,
}

/// Where a transfer lands: (0 for a local window, 1 for a remote one; the owner's world
/// rank; the window's id).
type DestKey = (u8, u64, u64);
/// A destination range: (first byte, end, entry index).
type DestRange = (u64, u64, usize);

/// A 2-D block of a transfer plan entry, in elements: `rows` rows of `row_len` elements,
/// `from_stride` elements apart where they are read and `to_stride` apart where they land
/// (a column shard of a row-major matrix: `rows` = its rows, `row_len` = the shard's
/// columns, the strides = the two matrices' row lengths). It moves as one transfer: one
/// request, no packing buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Strided {
    /// Rows.
    pub rows: usize,
    /// Elements per row.
    pub row_len: usize,
    /// Elements from one row's start to the next where they are read.
    pub from_stride: usize,
    /// Elements from one row's start to the next where they land.
    pub to_stride: usize,
}

/// One entry.
#[derive(Debug)]
struct Entry<'w> {
    dir: Dir,
    remote: RemoteHandle,
    /// In elements.
    remote_offset: usize,
    local: &'w Window<'w>,
    local_offset: usize,
    shape: Strided,
    dtype: DType,
    size: usize,
}

/// An entry's geometry in bytes: (remote offset, local offset, block), or `None` if it
/// overflows.
fn geometry(e: &Entry<'_>) -> Option<(u64, usize, Block)> {
    let b = |n: usize| n.checked_mul(e.size);
    let (remote_stride, local_stride) = match e.dir {
        Dir::Read => (b(e.shape.from_stride)?, b(e.shape.to_stride)?),
        Dir::Write => (b(e.shape.to_stride)?, b(e.shape.from_stride)?),
    };
    let rows = u32::try_from(e.shape.rows).ok()?;
    let block = Block { rows, row: b(e.shape.row_len)? as u64, remote_stride: remote_stride as u64, local_stride: local_stride as u64 };
    block.span(block.remote_stride)?;
    usize::try_from(block.span(block.local_stride)?).ok()?;
    Some((b(e.remote_offset)? as u64, b(e.local_offset)?, block))
}

/// Builds a [`TransferPlan`]; see the [module documentation](self).
#[must_use = "a builder does nothing until `build`"]
#[derive(Debug)]
pub struct TransferPlanBuilder<'w> {
    comm: &'w Communicator,
    entries: Vec<Entry<'w>>,
    /// Members to signal at the end of every run.
    signals: Vec<usize>,
    /// The signal slot of those signals (0: the public signal).
    slot: u32,
}

impl<'w> TransferPlanBuilder<'w> {
    /// Adds a read of `count` elements at element `from_offset` of the window `from` names,
    /// into `into` at element `into_offset`.
    pub fn read<T: Element>(self, from: &RemoteHandle, from_offset: usize, into: &'w Window<'w>, into_offset: usize, count: usize) -> Self {
        self.read_strided::<T>(
            from,
            from_offset,
            into,
            into_offset,
            Strided { rows: 1, row_len: count, from_stride: count, to_stride: count },
        )
    }

    /// Adds a read of a 2-D block ([`Strided`]) starting at element `from_offset` of the
    /// window `from` names, landing from element `into_offset` of `into`.
    pub fn read_strided<T: Element>(
        mut self,
        from: &RemoteHandle,
        from_offset: usize,
        into: &'w Window<'w>,
        into_offset: usize,
        shape: Strided,
    ) -> Self {
        let (remote, remote_offset, local, local_offset) = (*from, from_offset, into, into_offset);
        self.entries.push(Entry {
            dir: Dir::Read,
            remote,
            remote_offset,
            local,
            local_offset,
            shape,
            dtype: T::DTYPE,
            size: T::DTYPE.size(),
        });
        self
    }

    /// Adds a write of `count` elements at element `from_offset` of the local window
    /// `from`, into the window `to` names at element `to_offset`.
    pub fn write<T: Element>(self, from: &'w Window<'w>, from_offset: usize, to: &RemoteHandle, to_offset: usize, count: usize) -> Self {
        self.write_strided::<T>(from, from_offset, to, to_offset, Strided { rows: 1, row_len: count, from_stride: count, to_stride: count })
    }

    /// Adds a write of a 2-D block ([`Strided`]) starting at element `from_offset` of the
    /// local window `from`, landing from element `to_offset` of the window `to` names.
    pub fn write_strided<T: Element>(
        mut self,
        from: &'w Window<'w>,
        from_offset: usize,
        to: &RemoteHandle,
        to_offset: usize,
        shape: Strided,
    ) -> Self {
        let (remote, remote_offset, local, local_offset) = (*to, to_offset, from, from_offset);
        self.entries.push(Entry {
            dir: Dir::Write,
            remote,
            remote_offset,
            local,
            local_offset,
            shape,
            dtype: T::DTYPE,
            size: T::DTYPE.size(),
        });
        self
    }

    /// Raises this rank's signal at member `peer` at the end of every run, once every
    /// transfer of the run has landed: to the run's number by [`TransferPlan::run`] (1, 2,
    /// ...), or to the value given to [`TransferPlan::run_with_signal`] (a version). The
    /// peer's [`Communicator::wait_signal`] then says which run's data it holds.
    pub fn signal(mut self, peer: usize) -> Self {
        self.signals.push(peer);
        self
    }

    /// Raises the plan's signals on `slot` instead of the public signal (a library object's
    /// own slot, see [`Communicator::agree_signal_slots`]).
    pub(crate) fn signal_slot(mut self, slot: u32) -> Self {
        self.slot = slot;
        self
    }

    /// Checks every entry and builds the plan (see the [module documentation](self)).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the entry (by its index, in the order added) and
    /// what is wrong with it, or the two entries whose destinations overlap.
    pub fn build(self) -> Result<TransferPlan<'w>> {
        let comm = self.comm;
        let me = comm.rank();
        let bad = |i: usize, what: String| Error::invalid(format!("rank {me}: transfer plan entry {i}: {what}"));
        let mut dests: HashMap<DestKey, Vec<DestRange>> = HashMap::new();
        let mut parts: Vec<(&'w Window<'w>, Vec<Step>)> = Vec::new();
        let mut direct: Vec<Direct> = Vec::new();
        let mut count = 0;
        for (i, e) in self.entries.iter().enumerate() {
            let what = || format!("{} row(s) of {} {}", e.shape.rows, e.shape.row_len, e.dtype);
            let Some((roff, loff, block)) = geometry(e) else {
                return Err(bad(i, format!("{} overflow the address space", what())));
            };
            let (rspan, lspan) = (block.span(block.remote_stride).unwrap_or(u64::MAX), block.span(block.local_stride).unwrap_or(u64::MAX));
            let h = &e.remote;
            if h.job() != comm.fabric().job {
                return Err(bad(i, "the handle belongs to another job".into()));
            }
            if roff.checked_add(rspan).is_none_or(|end| end > h.len_bytes()) {
                return Err(bad(
                    i,
                    format!("{} at byte {roff} do not fit in rank {}'s window of {} bytes", what(), h.owner(), h.len_bytes()),
                ));
            }
            if (loff as u64).checked_add(lspan).is_none_or(|end| end > e.local.len_bytes() as u64) {
                return Err(bad(i, format!("{} at byte {loff} do not fit in the local window of {} bytes", what(), e.local.len_bytes())));
            }
            match e.dir {
                Dir::Write if h.access() != Access::ReadWrite => return Err(bad(i, format!("rank {}'s window is read-only", h.owner()))),
                Dir::Read if e.local.handle().access() != Access::ReadWrite => {
                    return Err(bad(i, "a read lands in a read-only local window".into()))
                }
                _ => {}
            }
            let peer = comm
                .rank_of_world(h.owner())
                .ok_or_else(|| bad(i, format!("world rank {} is not a member of this communicator", h.owner())))?;
            if block.rows == 0 || block.row == 0 {
                continue;
            }
            let lh = e.local.handle();
            let (key, start, stride) = match e.dir {
                Dir::Read => ((0, lh.owner() as u64, u64::from(lh.window_id())), loff as u64, block.local_stride),
                Dir::Write => ((1, h.owner() as u64, u64::from(h.window_id())), roff, block.remote_stride),
            };
            let ranges = dests.entry(key).or_default();
            for r in 0..u64::from(block.rows) {
                let s = start + r * stride;
                ranges.push((s, s + block.row, i));
            }
            let remote = h.remote();
            direct.push(Direct {
                owner: h.owner(),
                remote,
                offset: roff,
                span: rspan,
                local: e.local.region().clone(),
                at: loff,
                block,
                dir: e.dir,
            });
            let len = lspan as usize;
            let action = match e.dir {
                Dir::Read => Action::Get { peer, remote, offset: roff, dst: Slice::new(Buf::Output, loff, len), block },
                Dir::Write => Action::Put { peer, remote, offset: roff, src: Slice::new(Buf::Output, loff, len), block },
            };
            let step = Step { op: action, deps: vec![] };
            match parts.iter_mut().find(|(w, _)| std::ptr::eq(*w, e.local)) {
                Some((_, steps)) => steps.push(step),
                None => parts.push((e.local, vec![step])),
            }
            count += 1;
        }
        for ranges in dests.values_mut() {
            ranges.sort_unstable();
            for pair in ranges.windows(2) {
                let ((_, end_a, a), (start_b, _, b)) = (pair[0], pair[1]);
                if start_b < end_a {
                    if a == b {
                        return Err(bad(a, "its rows land on each other (a stride shorter than a row)".into()));
                    }
                    let (a, b) = (a.min(b), a.max(b));
                    return Err(Error::invalid(format!("rank {me}: transfer plan entries {a} and {b} land in overlapping bytes")));
                }
            }
        }
        let op = Op::other(format!("transfer plan of {count} transfers"));
        let parts: Vec<Part> = parts
            .into_iter()
            .map(|(w, steps)| {
                let sched = Schedule { steps, scratch_bytes: 0 };
                comm.p2p_part(op.clone(), CHAN_USER, sched, None, w.region().clone())
            })
            .collect();
        let mut parts = parts;
        if !self.signals.is_empty() {
            let mut steps = Vec::new();
            for &peer in &self.signals {
                if peer >= comm.size() {
                    return Err(Error::invalid(format!(
                        "rank {me}: transfer plan signal to member {peer}: out of range (communicator of {} ranks)",
                        comm.size()
                    )));
                }
                steps.push(Step { op: Action::Signal { peer, slot: self.slot, value: None }, deps: vec![] });
            }
            let sched = Schedule { steps, scratch_bytes: 0 };
            let mut part = comm.p2p_part(op.clone(), CHAN_USER, sched, None, RegionHandle::owned(0));
            part.after_others = true;
            parts.push(part);
        }
        for p in &mut parts {
            p.reserve(comm.size());
        }
        let job = Job::new(comm.job_body(parts));
        // Every entry a same-host peer's shared window (mapped now, not at the first run),
        // and no signal: a run is copies by this thread, no job.
        let fabric = comm.fabric();
        let all_direct = self.signals.is_empty()
            && !direct.is_empty()
            && direct.iter().all(|d| {
                d.remote.shared
                    && d.owner != fabric.rank
                    && fabric.shared_window(d.owner, d.remote.window, d.remote.key, d.remote.len).is_some()
            });
        let direct = if all_direct { direct } else { Vec::new() };
        Ok(TransferPlan { comm, plan: OwnedPlan { job, transfers: count, runs: 0, direct, op }, _windows: PhantomData })
    }
}

/// Reads and writes between local windows and remote ones, checked once and run many
/// times; see the [module documentation](self). It borrows its local windows, which
/// therefore outlive it.
#[derive(Debug)]
pub struct TransferPlan<'w> {
    comm: &'w Communicator,
    plan: OwnedPlan,
    _windows: PhantomData<&'w Window<'w>>,
}

/// A built plan without its borrows, run with the communicator it was built on: for a
/// crate type that owns the plan's local windows next to the plan (`weights`), which a
/// [`TransferPlan`]'s borrow would make self-referential. Its job holds the local windows'
/// regions, so it never reaches freed memory; its owner keeps the windows alive as long as
/// the plan, so that runs land in live windows.
#[derive(Debug)]
pub(crate) struct OwnedPlan {
    job: Arc<Job>,
    transfers: usize,
    runs: u64,
    /// When every entry is a copy to or from a same-host peer's shared window (and the
    /// plan raises no signal): the entries, run by the calling thread without a job.
    direct: Vec<Direct>,
    op: Op,
}

/// One entry of a plan that runs as copies (see `OwnedPlan::direct`).
#[derive(Debug)]
struct Direct {
    owner: usize,
    remote: Remote,
    offset: u64,
    span: u64,
    local: RegionHandle,
    at: usize,
    block: Block,
    dir: Dir,
}

impl TransferPlan<'_> {
    /// Runs every transfer of the plan, all in flight at once, and waits for all of them.
    /// Moves data only: no allocation, no registration, no handle exchange.
    ///
    /// # Errors
    ///
    /// [`Error::Refused`] when an owner refuses an entry (its window was dropped since the
    /// plan was built, or the handle was forged), once every other entry is over (their
    /// data has landed); the communicator stays usable. A dead owner or the deadline fail
    /// it as any call.
    pub fn run(&mut self) -> Result<()> {
        self.plan.run_with_signal(self.comm, self.plan.runs + 1)
    }

    /// [`TransferPlan::run`], raising the plan's signals ([`TransferPlanBuilder::signal`])
    /// to `value` at the end (signals only rise: give increasing values).
    pub fn run_with_signal(&mut self, value: u64) -> Result<()> {
        self.plan.run_with_signal(self.comm, value)
    }

    /// Transfers in the plan (entries of length 0 are not counted).
    pub fn transfers(&self) -> usize {
        self.plan.transfers
    }

    /// How many times the plan has run.
    pub fn runs(&self) -> u64 {
        self.plan.runs
    }

    /// The plan without its borrows (see [`OwnedPlan`]).
    pub(crate) fn into_owned(self) -> OwnedPlan {
        self.plan
    }
}

impl OwnedPlan {
    /// A plan of no transfer whose run waits (with the communicator's deadline) until every
    /// member of `peers` has raised its signal at this rank to at least the run's value:
    /// [`Communicator::wait_signal`] prepared once, so that a run allocates nothing (a
    /// weight sync's waits). `op` names the waits in errors.
    pub(crate) fn signal_waits(comm: &Communicator, peers: &[usize], slot: u32, op: Op) -> Result<OwnedPlan> {
        if let Some(&peer) = peers.iter().find(|&&p| p >= comm.size()) {
            return Err(Error::invalid(format!(
                "rank {}: {op}: member {peer} out of range (communicator of {} ranks)",
                comm.rank(),
                comm.size()
            )));
        }
        let steps = peers.iter().map(|&peer| Step { op: Action::WaitSignal { peer, slot, value: None }, deps: vec![] }).collect();
        let sched = Schedule { steps, scratch_bytes: 0 };
        let mut part = comm.p2p_part(op.clone(), CHAN_USER, sched, None, RegionHandle::owned(0));
        part.reserve(comm.size());
        let job = Job::new(comm.job_body(vec![part]));
        Ok(OwnedPlan { job, transfers: 0, runs: 0, direct: Vec::new(), op })
    }

    /// [`TransferPlan::run_with_signal`] on `comm`, the communicator the plan was built on.
    pub(crate) fn run_with_signal(&mut self, comm: &Communicator, value: u64) -> Result<()> {
        if !self.direct.is_empty() {
            if let Some(r) = self.run_direct(comm) {
                self.runs += 1;
                return r;
            }
        }
        self.job.body().signal = value;
        comm.submit(&self.job, true, true)?;
        self.runs += 1;
        comm.wait_job(&self.job)
    }

    /// A run as copies into and out of peers' shared windows; `None` when one of them is no
    /// longer mapped (the job runs the plan then, and the owner answers).
    fn run_direct(&self, comm: &Communicator) -> Option<Result<()>> {
        let fabric = comm.fabric();
        if let Err(e) = comm.check_usable(&self.op) {
            return Some(Err(e));
        }
        let mut refusal = None;
        for d in &self.direct {
            let local = &d.local;
            let write = d.dir == Dir::Write;
            // The local bytes the entry spans are taken once (one range lock), not per row:
            // a column shard of 1024 rows would otherwise lock 1024 times.
            let lspan = d.block.span(d.block.local_stride).unwrap_or(0) as usize;
            let copied = crate::rma::direct(fabric, d.owner, &d.remote, d.offset, d.span, write, |w| {
                let bad_row = || Error::internal(format!("{}: a checked row did not fit the shared window", self.op));
                let r = match d.dir {
                    Dir::Read => local.with_slice_mut(d.at, lspan, |buf| {
                        crate::rma::for_rows(&d.block, d.offset, 0, |ro, lo, n| match buf.get_mut(lo..lo + n).map(|b| w.read(ro, b)) {
                            Some(true) => Ok(()),
                            _ => Err(bad_row()),
                        })
                    }),
                    Dir::Write => local.with_slice(d.at, lspan, |buf| {
                        crate::rma::for_rows(&d.block, d.offset, 0, |ro, lo, n| match buf.get(lo..lo + n) {
                            Some(b) if w.write(ro, b) => Ok(()),
                            _ => Err(bad_row()),
                        })
                    }),
                };
                r.map_err(|e| Error::invalid(format!("{}: {e}", self.op)))?
            });
            match copied {
                Err(e) => return Some(Err(e)),
                Ok(None) => return None,
                Ok(Some(Ok(()))) => {}
                Ok(Some(Err(reason))) => {
                    refusal.get_or_insert(Error::Refused { rank: comm.rank(), owner: d.owner, op: self.op.clone(), reason });
                }
            }
        }
        Some(refusal.map_or(Ok(()), Err))
    }
}

impl Communicator {
    /// Starts a [`TransferPlan`]: add reads and writes, then `build`.
    pub fn transfer_plan(&self) -> TransferPlanBuilder<'_> {
        TransferPlanBuilder { comm: self, entries: Vec::new(), signals: Vec::new(), slot: 0 }
    }
}
