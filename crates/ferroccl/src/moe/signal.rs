//! Every signal call of the `moe` module, in one place.
//!
//! Each [`Moe`](super::Moe) object owns a signal slot, agreed by the members in the
//! construction's allgather (each proposes its lowest unclaimed slot, the highest wins and
//! is claimed on every member; see `Communicator::agree_signal_slots`), so neither the
//! public signals nor another object's between the same ranks can pass for its own. On
//! that slot each low-latency send (a dispatch or a combine) takes the object's next value:
//! every rank makes an object's sends in the same order, so every rank gives an operation
//! the same value, and a receiver that sees a peer's signal at `v` or above knows that the
//! peer's operation `v` (and every earlier one) has landed.

use crate::comm::Communicator;
use crate::error::Result;
use crate::window::RemoteHandle;

/// An object's signal slot and the value of its last send.
#[derive(Debug)]
pub(crate) struct Signals {
    slot: u32,
    seq: u64,
}

impl Signals {
    /// The slot this rank proposes in the construction's allgather.
    pub(crate) fn proposal(comm: &Communicator) -> u64 {
        u64::from(comm.fabric().free_signal_slot())
    }

    /// The object's signals on `slot` (the highest proposal of the members), claimed here.
    pub(crate) fn claim(comm: &Communicator, slot: u64) -> Signals {
        let slot = u32::try_from(slot).unwrap_or(u32::MAX);
        comm.fabric().claim_signal_slots(slot, 1);
        Signals { slot, seq: 0 }
    }

    /// The value of this object's next send.
    pub(crate) fn next(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    /// Writes to different owners in one job (one round trip in all): `src[range]` at
    /// byte `offset` of each window `h`, then this object's signal at each owner, raised
    /// to `value`.
    pub(crate) fn put_many(
        &self,
        comm: &Communicator,
        items: &[(RemoteHandle, usize, std::ops::Range<usize>)],
        src: &[u8],
        value: u64,
    ) -> Result<()> {
        comm.put_signal_many_on(items, src, self.slot, value)
    }

    /// Waits until every rank of `from` has raised this object's signal here to `value`
    /// or above (one job for all).
    pub(crate) fn wait_all(&self, comm: &Communicator, from: &[usize], value: u64) -> Result<()> {
        comm.wait_signals_on(from, self.slot, value)
    }
}
