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
//!
//! Between two ranks of one host whose windows are shared segments the same values travel
//! without a message: the writer maps the destination's window once (at construction),
//! copies its rows in and raises its own signal word in the window's header (Release); the
//! destination polls the words of such sources (Acquire), and neither engine takes part
//! (a `SIGNAL` message is served by the owner's engine and answered, a round trip per
//! destination that made a decode step cost tens of microseconds). Which pairs go that way
//! is agreed at construction (each member says whose windows it mapped), so a destination
//! knows which sources raise a word and which send a `SIGNAL`.

use std::ops::Range;

use crate::comm::Communicator;
use crate::error::Result;
use crate::window::{MappedWindow, RemoteHandle, Window};

/// Which of an object's two windows a send writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Which {
    Dispatch,
    Combine,
}

/// An object's signal slot, the value of its last send, and the direct pairs.
#[derive(Debug)]
pub(crate) struct Signals {
    slot: u32,
    seq: u64,
    /// Per member: its (dispatch, combine) windows, mapped here, when this rank writes
    /// them directly.
    to: Vec<Option<(MappedWindow, MappedWindow)>>,
    /// The members that write this rank's windows directly (raise words here), and the
    /// others (send `SIGNAL`s); this rank in neither.
    direct: Vec<usize>,
    slow: Vec<usize>,
}

impl Signals {
    /// The slot this rank proposes in the construction's allgather.
    pub(crate) fn proposal(comm: &Communicator) -> u64 {
        u64::from(comm.fabric().free_signal_slot())
    }

    /// The object's signals on `slot` (the highest proposal of the members), claimed here;
    /// every pair goes by messages until [`Signals::connect`].
    pub(crate) fn claim(comm: &Communicator, slot: u64) -> Signals {
        let slot = u32::try_from(slot).unwrap_or(u32::MAX);
        comm.fabric().claim_signal_slots(slot, 1);
        let (me, n) = (comm.rank(), comm.size());
        Signals { slot, seq: 0, to: vec![None; n], direct: Vec::new(), slow: (0..n).filter(|&s| s != me).collect() }
    }

    /// Maps every member's (dispatch, combine) windows that this rank can write directly
    /// (`windows`, by member) and agrees with the members which pairs do (an allgather of
    /// one word per member: whose windows it mapped). Collective.
    pub(crate) fn connect(&mut self, comm: &Communicator, windows: &[(RemoteHandle, RemoteHandle)]) -> Result<()> {
        let (me, n) = (comm.rank(), comm.size());
        let mut mask = 0u64;
        for (d, (dh, ch)) in windows.iter().enumerate().take(64) {
            if d == me {
                continue;
            }
            if let (Some(dw), Some(cw)) = (comm.map_window(dh), comm.map_window(ch)) {
                self.to[d] = Some((dw, cw));
                mask |= 1 << d;
            }
        }
        let mut all = vec![0u8; 8 * n];
        comm.allgather_into(&mask.to_le_bytes(), &mut all)?;
        let writes_me = |s: usize| {
            let m = u64::from_le_bytes(all[8 * s..8 * s + 8].try_into().unwrap_or([0; 8]));
            me < 64 && m & (1 << me) != 0
        };
        (self.direct, self.slow) = (0..n).filter(|&s| s != me).partition(|&s| writes_me(s));
        Ok(())
    }

    /// The value of this object's next send.
    pub(crate) fn next(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    /// Writes `src[range]` at byte `offset` of member `d`'s `which` window (`h`, its
    /// handle) for each item, signalled at `value` (once per member, after its last item;
    /// a member's items are consecutive): directly where this rank maps the window, the
    /// others in one job (one round trip in all).
    pub(crate) fn put_many(
        &self,
        comm: &Communicator,
        which: Which,
        items: &[(usize, RemoteHandle, usize, Range<usize>)],
        src: &[u8],
        value: u64,
    ) -> Result<()> {
        let mut slow = Vec::new();
        let mut i = 0;
        while i < items.len() {
            let d = items[i].0;
            let end = items[i..].iter().position(|it| it.0 != d).map_or(items.len(), |p| i + p);
            let mine = &items[i..end];
            if !self.put_parts(comm, which, d, mine.iter().map(|(_, _, offset, range)| (*offset, &src[range.clone()])), value)? {
                slow.extend(mine.iter().map(|(_, h, offset, range)| (*h, *offset, range.clone())));
            }
            i = end;
        }
        if slow.is_empty() {
            return Ok(());
        }
        comm.put_signal_many_on(&slow, src, self.slot, value)
    }

    /// Writes the `(offset, bytes)` pieces into member `d`'s `which` window and raises this
    /// rank's word there to `value`, when this rank maps that window (`Ok(true)`); `Ok(false)`
    /// (nothing written) when it does not: the pieces then go by [`Signals::put_many`].
    pub(crate) fn put_parts<'b>(
        &self,
        comm: &Communicator,
        which: Which,
        d: usize,
        parts: impl IntoIterator<Item = (usize, &'b [u8])>,
        value: u64,
    ) -> Result<bool> {
        match (self.to.get(d), which) {
            (Some(Some((w, _))), Which::Dispatch) | (Some(Some((_, w))), Which::Combine) => {
                comm.put_parts_raise(w, parts, value)?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// Waits until every other member has signalled this rank's window `w` (the object's
    /// `which` window) at `value` or above: the direct ones' words, then the others'
    /// `SIGNAL`s (one job for all).
    pub(crate) fn wait_all(&self, comm: &Communicator, w: &Window<'_>, which: Which, value: u64) -> Result<()> {
        if !self.direct.is_empty() {
            let what = match which {
                Which::Dispatch => "moe dispatch",
                Which::Combine => "moe combine",
            };
            comm.wait_words(w, &self.direct, value, what)?;
        }
        if self.slow.is_empty() {
            return Ok(());
        }
        comm.wait_signals_on(&self.slow, self.slot, value)
    }
}
