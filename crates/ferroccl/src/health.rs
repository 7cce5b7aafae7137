//! The failure policy of one fabric: watching the peers' processes (and the launcher), the
//! fatal state seen as errors, poisoning (the first fatal error is kept and told to every
//! peer, and the connections are cut so that nothing stays blocked on them), and abort.
//!
//! Connections that break without a reason are only *suspects* for a short grace (see
//! `inbox::SUSPECT_GRACE`), so that a reported cause wins; they are promoted here, on the
//! same 2 ms beat as the process watches.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Error, Fault, FaultKind, Op};
use crate::inbox::Inbox;
use crate::logging::flog;
use crate::mesh::{Mesh, Watch};
use crate::proto;

/// How often the peers' processes are looked at, at most.
const HEALTH_EVERY: Duration = Duration::from_millis(2);

/// Watches and fatal state of one fabric.
#[derive(Debug)]
pub(crate) struct Health {
    rank: usize,
    inbox: Arc<Inbox>,
    /// Every shm peer (and verbs peer on this host) by world rank, and the launcher.
    watches: Vec<Watch>,
    looked_at: Mutex<Instant>,
    told_peers: AtomicBool,
}

impl Health {
    pub(crate) fn new(rank: usize, inbox: Arc<Inbox>, watches: Vec<Watch>) -> Health {
        Health { rank, inbox, watches, looked_at: Mutex::new(Instant::now()), told_peers: AtomicBool::new(false) }
    }

    /// Looks at the peers' processes (and the launcher) at most every 2 ms; `now` is the
    /// caller's clock reading, so a wait loop reads the clock once per round.
    pub(crate) fn check(&self, now: Instant, mesh: &Mesh) {
        {
            let mut at = self.looked_at.lock().unwrap_or_else(|e| e.into_inner());
            if now.saturating_duration_since(*at) < HEALTH_EVERY {
                return;
            }
            *at = now;
        }
        self.inbox.promote_suspects(now);
        // One zero-timeout poll per watch: no allocation on this path (it runs every 2 ms
        // of every wait).
        if !self.watches.iter().any(|(_, w)| w.has_exited()) {
            return;
        }
        // Anything the peer sent before exiting (its goodbye included) counts first, and
        // so do the last words of a peer whose `ERR` a full ring lost: a rank that gave up
        // because a third one died, and exited, is not the one to blame.
        let _ = mesh.progress(&self.inbox);
        self.hear_last_words(mesh);
        let mut ev = self.inbox.lock();
        for (p, w) in self.watches.iter().filter(|(_, w)| w.has_exited()) {
            match p {
                None => {
                    let first = Error::LauncherExited { rank: self.rank, pid: u32::try_from(w.pid()).unwrap_or_default() };
                    ev.set_fault_from(Fault::from_error(&first, &|r| r), Some(first));
                }
                Some(p) if !ev.closed.contains(p) => {
                    flog!(Warn, Health, "rank {}: rank {p} exited (pid {}) without closing its communicator", self.rank, w.pid());
                    ev.set_fatal(*p, format!("exited (pid {}) without closing its communicator (killed or crashed?)", w.pid()))
                }
                Some(_) => {}
            }
        }
    }

    /// Takes the last words (see `transport::shm::LAST_LEN_OFF`) of the first exited shm
    /// peer that left any as the `ERR` they are, while nothing is fatal here yet. Only
    /// exited peers: a live one's `ERR` comes through its ring, and a timeout of its own
    /// stays this rank's own finding.
    fn hear_last_words(&self, mesh: &Mesh) {
        if self.inbox.has_fatal() {
            return;
        }
        let exited = |p: usize| self.watches.iter().any(|(q, w)| *q == Some(p) && w.has_exited());
        if let Some((peer, words)) = mesh.last_words(exited) {
            self.inbox.deliver_last_words(peer, words);
        }
    }

    /// The world ranks known dead or gone (see `Fabric::dead_peers`).
    pub(crate) fn dead_peers(&self) -> Vec<usize> {
        let mut v: Vec<usize> = self.watches.iter().filter(|(_, w)| w.has_exited()).filter_map(|(p, _)| *p).collect();
        if let Some(f) = &self.inbox.lock().fatal {
            if matches!(f.kind, crate::error::FaultKind::Failed | crate::error::FaultKind::Left) {
                v.extend(f.culprit);
            }
        }
        v.sort_unstable();
        v.dedup();
        v.retain(|&p| p != self.rank);
        v
    }

    /// The error for the fabric's fatal state, if any, as seen by an operation.
    pub(crate) fn fatal_error(&self, op: &Op) -> Option<Error> {
        let ev = self.inbox.lock();
        if let Some(by) = ev.aborted {
            return Some(Error::Aborted { rank: self.rank, op: op.clone(), by });
        }
        ev.fatal.as_ref().map(|f| f.to_error(self.rank, op, ev.first.as_ref()))
    }

    /// Makes `err` (of a call on a communicator whose rank `r` is world rank `world(r)`)
    /// fatal for the fabric, unless an earlier error already is; tells every peer the root
    /// cause and cuts the connections. Returns `err` for the caller to report, with its
    /// root cause attached (in world ranks).
    ///
    /// Callers pass only errors of operations that have started on the wire (the engine's
    /// jobs, setup and finalize waits): whatever their variant, a peer may be waiting for
    /// this rank, so it must be told. Errors found before (argument checks) are returned
    /// without coming here, and leave the communicator usable. A call refused because the
    /// world was finalized is not a fault, and passes through.
    pub(crate) fn poison_in(&self, mesh: &Mesh, err: Error, world: &dyn Fn(usize) -> usize) -> Error {
        // A call refused because the world was finalized is not a fault; nor is a window
        // owner's refusal of a one-sided access (an answer: nothing moved, no stream is out
        // of step).
        if matches!(err, Error::Finalized { .. } | Error::Refused { .. }) {
            return err;
        }
        let mut fault = Fault::from_error(&err, world);
        if fault.culprit.is_none() && matches!(fault.kind, FaultKind::Internal | FaultKind::Other) {
            // This rank's own failure (an internal error, a check only possible
            // mid-transfer): it is the one at fault.
            fault.culprit = Some(self.rank);
        }
        let cause = fault.root_cause(Some(self.rank));
        self.inbox.lock().set_fault_from(fault, Some(err.duplicate()));
        self.tell_peers_and_cut(mesh);
        let err = err.with_cause(cause);
        flog!(Warn, Health, "rank {}: fatal: {err}", self.rank);
        err
    }

    /// Makes `fault` (found by this rank) fatal for the fabric and tells every peer.
    pub(crate) fn poison_fault(&self, mesh: &Mesh, fault: Fault) {
        flog!(Warn, Health, "rank {}: fatal: {} ({})", self.rank, fault.what, fault.op);
        self.inbox.lock().set_fault(fault);
        self.tell_peers_and_cut(mesh);
        self.inbox.notify();
    }

    /// Aborts every operation on the fabric, pending and later, and tells every peer.
    pub(crate) fn abort(&self, mesh: &Mesh) {
        flog!(Info, Health, "rank {}: aborted by this process", self.rank);
        let aborted = || Fault { kind: FaultKind::Aborted, culprit: None, reporter: None, op: String::new(), what: "aborted".into() };
        {
            let mut ev = self.inbox.lock();
            ev.aborted.get_or_insert(None);
            ev.set_fault(aborted());
        }
        if !self.told_peers.swap(true, Ordering::AcqRel) {
            mesh.tell_all_and_cut(&proto::encode_err(&aborted(), self.rank));
        }
        self.inbox.notify();
    }

    /// Once: sends every peer an `ERR` with the fatal cause (without waiting: a full ring
    /// or a busy socket is skipped), then cuts the connections.
    pub(crate) fn tell_peers_and_cut(&self, mesh: &Mesh) {
        let Some(fault) = self.inbox.lock().fatal.clone() else { return };
        if self.told_peers.swap(true, Ordering::AcqRel) {
            return;
        }
        mesh.tell_all_and_cut(&proto::encode_err(&fault, self.rank));
    }
}
