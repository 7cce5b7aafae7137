//! Helpers the builders share: the call's geometry (blocks, chunks, which buffer holds the
//! input) and an [`Emitter`] that orders steps for a pipelining executor.

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;

use super::{Action, Buf, Schedule, Shape, Slice};

/// Receive slots per peer that the windowed builders (mesh, in-place ring) cycle through
/// when `Shape::slots` is 0: up to this many chunks from one peer are in flight at once.
pub(super) const DEFAULT_SLOTS: usize = 4;

/// Local steps (reductions, copies) that an [`Emitter`] holds back, so that the transfers
/// behind them are posted first and overlap with them.
pub(super) const LOOKAHEAD: usize = 2;

/// The geometry of one call, in bytes.
#[derive(Clone, Copy, Debug)]
pub(super) struct Geometry {
    pub(super) n: usize,
    pub(super) rank: usize,
    pub(super) elem: usize,
    pub(super) count: usize,
    pub(super) in_place: bool,
    /// Receive slots per peer (at least 1).
    pub(super) slots: usize,
    /// Elements per chunk (at least 1).
    chunk_elems: usize,
}

impl Geometry {
    pub(super) fn new(shape: &Shape) -> Geometry {
        let elem = shape.dtype.size();
        let chunk_elems = if shape.chunk_bytes == 0 { usize::MAX } else { (shape.chunk_bytes / elem).max(1) };
        let slots = if shape.slots == 0 { DEFAULT_SLOTS } else { shape.slots };
        Geometry { n: shape.n, rank: shape.rank, elem, count: shape.count, in_place: shape.in_place, slots, chunk_elems }
    }

    /// `len` bytes of the caller's input at byte `off` of the input's layout: `Input`, or
    /// `Output` for in-place calls (whose input lives in the one buffer, at the same offsets
    /// for every collective whose input is the whole buffer; callers of collectives whose
    /// input is one block, like allgather, pass the block's offset in `Output`).
    pub(super) fn input(&self, off: usize, len: usize) -> Slice {
        Slice::new(if self.in_place { Buf::Output } else { Buf::Input }, off, len)
    }

    /// `len` bytes at byte `off` of this rank's block of an allgather's input: `Input`, or
    /// in place block `rank` of `Output` (the one buffer holds every block).
    pub(super) fn own_block(&self, blocks: &Blocks, off: usize, len: usize) -> Slice {
        if self.in_place {
            self.output(blocks.off(self.rank) + off, len)
        } else {
            self.input(off, len)
        }
    }

    pub(super) fn output(&self, off: usize, len: usize) -> Slice {
        Slice::new(Buf::Output, off, len)
    }

    pub(super) fn scratch(&self, off: usize, len: usize) -> Slice {
        Slice::new(Buf::Scratch, off, len)
    }

    /// Bytes of a whole chunk (the largest a chunk can be), capped at `len` bytes.
    pub(super) fn chunk_cap(&self, len: usize) -> usize {
        len.min(self.chunk_elems.saturating_mul(self.elem))
    }

    /// `len` bytes (whole elements) cut into chunks of at most the chunk size: (offset,
    /// length) pairs relative to the start, in order, none empty.
    pub(super) fn chunks(&self, len: usize) -> Vec<(usize, usize)> {
        debug_assert_eq!(len % self.elem, 0);
        let step = self.chunk_cap(len).max(self.elem);
        let mut out = Vec::with_capacity(len.div_ceil(step));
        let mut off = 0;
        while off < len {
            let l = step.min(len - off);
            out.push((off, l));
            off += l;
        }
        out
    }

    /// `count` elements split into `n` blocks as evenly as possible (the first `count % n`
    /// blocks one element larger), in bytes.
    pub(super) fn even_blocks(&self) -> Blocks {
        let (q, rem) = (self.count / self.n, self.count % self.n);
        let mut starts = Vec::with_capacity(self.n + 1);
        let mut at = 0;
        for j in 0..self.n {
            starts.push(at * self.elem);
            at += q + usize::from(j < rem);
        }
        starts.push(at * self.elem);
        Blocks { starts }
    }

    /// `n` blocks of `count` elements each, in bytes.
    pub(super) fn equal_blocks(&self) -> Blocks {
        Blocks { starts: (0..=self.n).map(|j| j * self.count * self.elem).collect() }
    }

    /// The rank `k` places after this one around the ring.
    pub(super) fn peer(&self, k: usize) -> usize {
        (self.rank + k) % self.n
    }

    /// `j - k` modulo `n` (ring arithmetic without underflow).
    pub(super) fn back(&self, j: usize, k: usize) -> usize {
        (j + self.n - k % self.n) % self.n
    }
}

/// Byte offsets of `n` consecutive blocks.
#[derive(Clone, Debug)]
pub(super) struct Blocks {
    starts: Vec<usize>,
}

impl Blocks {
    /// Consecutive blocks of `lens` bytes.
    pub(super) fn from_lens(lens: &[usize]) -> Blocks {
        let mut starts = Vec::with_capacity(lens.len() + 1);
        let mut at = 0;
        starts.push(0);
        for l in lens {
            at += l;
            starts.push(at);
        }
        Blocks { starts }
    }

    pub(super) fn off(&self, j: usize) -> usize {
        self.starts[j]
    }
    pub(super) fn len(&self, j: usize) -> usize {
        self.starts[j + 1] - self.starts[j]
    }
    pub(super) fn max_len(&self) -> usize {
        (0..self.starts.len() - 1).map(|j| self.len(j)).max().unwrap_or(0)
    }
}

/// Builds a [`Schedule`] in an order that pipelines on an executor that starts steps in
/// index order: transfers are appended at once ([`Emitter::now`]); local steps may be held
/// back ([`Emitter::later`], up to [`LOOKAHEAD`] of them) so that the transfers of the next
/// chunks are posted before a reduction waits for its data. A held-back step is appended as
/// soon as a later step needs its index ([`Emitter::idx`]).
#[derive(Debug)]
pub(super) struct Emitter<K> {
    sched: Schedule,
    pending: VecDeque<(K, Action, Vec<usize>)>,
    emitted: HashMap<K, usize>,
    lookahead: usize,
}

impl<K: Copy + Eq + Hash + std::fmt::Debug> Emitter<K> {
    pub(super) fn new(lookahead: usize) -> Emitter<K> {
        Emitter { sched: Schedule::default(), pending: VecDeque::new(), emitted: HashMap::new(), lookahead }
    }

    /// Appends a step now; returns its index.
    pub(super) fn now(&mut self, op: Action, deps: Vec<usize>) -> usize {
        self.sched.push(op, deps)
    }

    /// Queues a local step under `key`; appends the oldest queued steps beyond the lookahead.
    pub(super) fn later(&mut self, key: K, op: Action, deps: Vec<usize>) {
        self.pending.push_back((key, op, deps));
        while self.pending.len() > self.lookahead {
            self.pop();
        }
    }

    /// The index of the step queued under `key`, appending it (and every step queued before
    /// it) if it is still held back.
    pub(super) fn idx(&mut self, key: K) -> usize {
        while !self.emitted.contains_key(&key) {
            assert!(!self.pending.is_empty(), "step {key:?} was never queued");
            self.pop();
        }
        self.emitted[&key]
    }

    fn pop(&mut self) {
        if let Some((k, op, deps)) = self.pending.pop_front() {
            let i = self.sched.push(op, deps);
            self.emitted.insert(k, i);
        }
    }

    /// Appends what is still held back and returns the schedule.
    pub(super) fn finish(mut self, scratch_bytes: usize) -> Schedule {
        while !self.pending.is_empty() {
            self.pop();
        }
        self.sched.scratch_bytes = scratch_bytes;
        self.sched
    }
}
