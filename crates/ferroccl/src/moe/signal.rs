//! Every signal call of the `moe` module, in one place (so that per-user signal slots can
//! replace them later).
//!
//! The fabric has one signal per ordered pair of ranks, and a signal only rises. Each
//! low-latency send (a dispatch or a combine, of any [`Moe`](super::Moe) object of this
//! rank's fabric) takes the next value of a per-rank sequence, [`next`]; every rank makes
//! its sends in the same order, so every rank gives an operation the same value, and a
//! receiver that sees a peer's signal at `v` or above knows that the peer's operation `v`
//! (and every earlier one) has landed. The sequence is kept per (job, world rank), i.e.
//! per fabric; a new `Moe` object starts it above every signal any member has seen and
//! every value any member has used ([`sync_floor`]).

use std::collections::BTreeMap;
use std::sync::Mutex;

use crate::comm::Communicator;
use crate::error::Result;
use crate::window::RemoteHandle;

/// The last sequence value each (job, world rank) has used.
static SEQ: Mutex<BTreeMap<(u64, usize), u64>> = Mutex::new(BTreeMap::new());

/// The map (a panic elsewhere while it was held leaves it whole: every update is one
/// store).
fn seq() -> std::sync::MutexGuard<'static, BTreeMap<(u64, usize), u64>> {
    SEQ.lock().unwrap_or_else(|e| e.into_inner())
}

fn key(comm: &Communicator) -> (u64, usize) {
    (comm.fabric().job, comm.fabric().rank)
}

/// This rank's floor for a new object: the highest of the values it has used and the
/// signals it has seen from any member.
pub(crate) fn floor(comm: &Communicator) -> u64 {
    let used = seq().get(&key(comm)).copied().unwrap_or(0);
    (0..comm.size()).map(|p| comm.signal_value(p)).fold(used, u64::max)
}

/// Raises this rank's sequence to `v` (the highest floor of the members, agreed in the
/// setup's allgather).
pub(crate) fn sync_floor(comm: &Communicator, v: u64) {
    let mut m = seq();
    let e = m.entry(key(comm)).or_insert(0);
    *e = (*e).max(v);
}

/// The value of this rank's next send.
pub(crate) fn next(comm: &Communicator) -> u64 {
    let mut m = seq();
    let e = m.entry(key(comm)).or_insert(0);
    *e += 1;
    *e
}

/// Writes `bytes` at byte `offset` of the window `h` names, then raises this rank's signal
/// at its owner to `value`.
pub(crate) fn put(comm: &Communicator, h: &RemoteHandle, offset: usize, bytes: &[u8], value: u64) -> Result<()> {
    comm.put_signal(h, offset, bytes, value)
}

/// Waits until `from` has raised its signal here to `value` or above.
pub(crate) fn wait(comm: &Communicator, from: usize, value: u64) -> Result<()> {
    comm.wait_signal(from, value).map(|_| ())
}
