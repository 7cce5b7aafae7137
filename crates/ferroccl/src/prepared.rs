//! Calls made ready to run: a collective's schedule and identity ([`Prepared`]), and a
//! communicator's caches of them and of scratch memory, so that a loop repeating one call
//! builds nothing after its first iteration.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use ferroccl_kernels::{DType, ReduceOp};
use ferroccl_mem::region::RegionHandle;

use crate::algo::ll::LlSpec;
use crate::algo::{Algo, Collective, Schedule};
use crate::error::Op;
use crate::proto::Desc;

/// A call's schedule and identity, before buffers are attached.
#[derive(Debug, Clone)]
pub(crate) struct Prepared {
    /// What errors name it: the collective, its arguments and algorithm.
    pub(crate) name: Op,
    pub(crate) desc: Desc,
    pub(crate) sched: Arc<Schedule>,
    pub(crate) dtype: DType,
    pub(crate) op: ReduceOp,
    /// A low-latency call (`Algo::Ll`): its spec; the schedule is empty.
    pub(crate) ll: Option<LlSpec>,
}

/// Recently prepared calls of a communicator, keyed by what determines them (the knobs are
/// fixed per communicator). Small and cleared when full: it serves loops that repeat calls.
#[derive(Debug, Default)]
pub(crate) struct SchedCache(Mutex<HashMap<SchedKey, Prepared>>);

impl SchedCache {
    /// The prepared call for `key`, if cached.
    pub(crate) fn get(&self, key: &SchedKey) -> Option<Prepared> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).get(key).cloned()
    }

    /// Keeps `prep` for `key` (clearing the cache when it is full).
    pub(crate) fn insert(&self, key: SchedKey, prep: Prepared) {
        let mut cache = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if cache.len() >= SCHED_CACHE {
            cache.clear();
        }
        cache.insert(key, prep);
    }
}

/// What determines a prepared call: collective (with its root), dtype, op, count, in place,
/// the algorithm the call asked for.
pub(crate) type SchedKey = (Collective, DType, ReduceOp, usize, bool, Option<Algo>);

/// Prepared calls a communicator keeps at most.
const SCHED_CACHE: usize = 64;

/// Scratch memory of a communicator: a small pool, so that operations in flight together
/// each have their own, and repeated calls reuse it.
#[derive(Debug, Default)]
pub(crate) struct ScratchCache {
    pool: Mutex<Vec<RegionHandle>>,
    empty: Mutex<Option<RegionHandle>>,
}

/// Buffers kept in the pool at most, and their total size at most (beyond the largest).
const POOL: usize = 8;
const POOL_BYTES: usize = 256 << 20;

impl ScratchCache {
    /// A scratch region of at least `len` bytes, owned by the caller until [`Self::put`].
    pub(crate) fn get(&self, len: usize) -> RegionHandle {
        if len == 0 {
            return self.empty();
        }
        let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        // The smallest that fits.
        let best = pool.iter().enumerate().filter(|(_, h)| h.len() >= len).min_by_key(|(_, h)| h.len()).map(|(i, _)| i);
        match best {
            Some(i) => pool.swap_remove(i),
            None => RegionHandle::owned(len),
        }
    }

    /// Gives a region from [`Self::get`] back.
    pub(crate) fn put(&self, h: RegionHandle) {
        if h.is_empty() {
            return;
        }
        let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        pool.push(h);
        if pool.len() > POOL {
            // Drop the smallest.
            if let Some(i) = pool.iter().enumerate().min_by_key(|(_, h)| h.len()).map(|(i, _)| i) {
                pool.swap_remove(i);
            }
        }
        // Keep at most POOL_BYTES (but always the largest, as before there was a pool): drop
        // the largest of the others.
        while pool.len() > 1 && pool.iter().map(|h| h.len()).sum::<usize>() > POOL_BYTES {
            let mut by_len: Vec<usize> = (0..pool.len()).collect();
            by_len.sort_by_key(|&i| std::cmp::Reverse(pool[i].len()));
            pool.swap_remove(by_len[1]);
        }
    }

    /// A zero-length region (for schedules that need none).
    pub(crate) fn empty(&self) -> RegionHandle {
        self.empty.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert_with(|| RegionHandle::owned(0)).clone()
    }
}
