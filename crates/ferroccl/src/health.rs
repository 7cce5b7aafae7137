//! The failure policy of one fabric: watching the peers' processes (and the launcher), the
//! fatal state seen as errors, poisoning (a fatal error is kept with its scope and told to
//! the peers it concerns), and abort.
//!
//! A fault fails exactly the communicators it reaches (see `inbox::Scope`): a dead peer,
//! every communicator with that peer (its connection is cut); a call that timed out or was
//! made differently, its communicator (its members are told; the connections, shared with
//! other communicators, stay up); an abort, the communicator and those split from it; this
//! rank's own failure (a transport broken as a whole, a panic) or the launcher's exit,
//! everything (every peer is told and every connection cut). A communicator's calls fail
//! with the first fault that reaches it; the others go on.
//!
//! Connections that break without a reason are only *suspects* for a short grace (see
//! `inbox::SUSPECT_GRACE`), so that a reported cause wins; they are promoted here, on the
//! same 2 ms beat as the process watches.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Error, Fault, FaultKind, Op, Process};
use crate::inbox::{Inbox, Scope, View};
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
    /// Every world rank's process (launch rank, host, pid), named in the errors' root causes.
    processes: Arc<[Process]>,
}

impl Health {
    pub(crate) fn new(rank: usize, inbox: Arc<Inbox>, watches: Vec<Watch>, processes: Arc<[Process]>) -> Health {
        Health { rank, inbox, watches, looked_at: Mutex::new(Instant::now()), told_peers: AtomicBool::new(false), processes }
    }

    /// World rank `w`'s process.
    pub(crate) fn process(&self, w: usize) -> Option<Process> {
        self.processes.get(w).cloned()
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
                Some(p) if !ev.closed.contains(p) && !ev.is_dead(*p) => {
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
        // The peers known dead already (their news is in): read once, not per peer.
        let dead: Vec<usize> = {
            let ev = self.inbox.lock();
            if ev.all_failed() {
                return;
            }
            ev.faults.iter().filter_map(|s| if let Scope::Peer(p) = s.scope { Some(p) } else { None }).collect()
        };
        let exited = |p: usize| !dead.contains(&p) && self.watches.iter().any(|(q, w)| *q == Some(p) && w.has_exited());
        if let Some((peer, words)) = mesh.last_words(exited) {
            self.inbox.deliver_last_words(peer, words);
        }
    }

    /// The world ranks known dead or gone (see `Fabric::dead_peers`).
    pub(crate) fn dead_peers(&self) -> Vec<usize> {
        let mut v: Vec<usize> = self.watches.iter().filter(|(_, w)| w.has_exited()).filter_map(|(p, _)| *p).collect();
        for s in &self.inbox.lock().faults {
            match s.scope {
                Scope::Peer(p) => v.push(p),
                _ if matches!(s.fault.kind, FaultKind::Failed | FaultKind::Left) => v.extend(s.fault.culprit),
                _ => {}
            }
        }
        v.sort_unstable();
        v.dedup();
        v.retain(|&p| p != self.rank);
        v
    }

    /// The error for the fault that reaches communicator `view` (`None`: the fabric, which
    /// every fault reaches), if any, as seen by an operation `op` on it.
    pub(crate) fn fatal_error(&self, op: &Op, view: Option<View<'_>>) -> Option<Error> {
        let ev = self.inbox.lock();
        let s = &ev.faults[ev.fault_for(view)?];
        Some(s.fault.to_error(self.rank, op, s.first.as_ref()).identify(&|w| self.process(w)))
    }

    /// What a fault found by this rank on communicator `view` (`None`: outside any)
    /// makes unusable.
    fn scope_of(&self, fault: &Fault, view: Option<View<'_>>) -> Scope {
        let Some(v) = view else { return Scope::Fabric };
        match (fault.kind, fault.culprit) {
            // A peer died, its connection broke, or it broke the protocol.
            (FaultKind::Failed, Some(c)) if c != self.rank => Scope::Peer(c),
            // The call could not complete; the members are alive as far as this rank knows.
            (FaultKind::Timeout | FaultKind::Mismatch | FaultKind::Left | FaultKind::Aborted, _) => Scope::Comm(v.comm),
            // This rank's own failure.
            _ => Scope::Fabric,
        }
    }

    /// Makes `err` (of a call on communicator `view`, whose rank `r` is world rank
    /// `world(r)`; `None`: outside any) fatal for what it reaches (see
    /// [`Health::scope_of`]), unless an earlier fault already reaches `view`; tells the
    /// peers it concerns (see [`Health::tell`]). Returns `err` for the caller to report,
    /// with its root cause attached (in world ranks).
    ///
    /// Callers pass only errors of operations that have started on the wire (the engine's
    /// jobs, setup and finalize waits): whatever their variant, a peer may be waiting for
    /// this rank, so it must be told. Errors found before (argument checks) are returned
    /// without coming here, and leave the communicator usable. A call refused because the
    /// world was finalized is not a fault, and passes through.
    pub(crate) fn poison_in(&self, mesh: &Mesh, err: Error, world: &dyn Fn(usize) -> usize, view: Option<View<'_>>) -> Error {
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
        let scope = self.scope_of(&fault, view);
        let (new, i) = {
            let mut ev = self.inbox.lock();
            // The first fault that reaches a communicator is the one its calls report: an
            // error that follows from it (a cut connection, the fault itself seen again)
            // adds nothing. Outside any communicator, only a failure of everything does.
            let reached = match view {
                None => ev.all_failed(),
                Some(_) => ev.fault_for(view).is_some(),
            };
            let new = !reached && ev.add(scope, fault, Some(err.duplicate())).1;
            let i = match view {
                None => ev.faults.iter().position(|s| s.scope == Scope::Fabric).or_else(|| ev.fault_for(None)),
                Some(_) => ev.fault_for(view),
            };
            (new, i)
        };
        let err = err.with_cause(cause).identify(&|w| self.process(w));
        // Said once per fault: when this rank finds it, or first meets one a peer reported.
        let first_met = i.is_some_and(|i| self.tell_once(mesh, i, view));
        if new || first_met {
            flog!(Warn, Health, "rank {}: fatal ({scope:?}): {err}", self.rank);
        }
        self.inbox.notify();
        err
    }

    /// Makes `fault` (found by this rank) fatal for `scope` and tells the peers it
    /// concerns (`view`: the communicator it was found on, whose members hear of a
    /// communicator's fault).
    pub(crate) fn poison_fault(&self, mesh: &Mesh, fault: Fault, scope: Scope, view: Option<View<'_>>) {
        flog!(Warn, Health, "rank {}: fatal ({scope:?}): {} ({})", self.rank, fault.what, fault.op);
        let (i, _) = self.inbox.lock().add(scope, fault, None);
        self.tell_once(mesh, i, view);
        self.inbox.notify();
    }

    /// Aborts communicator `view` (the world, id 0: everything) and those split from it:
    /// every operation on them, pending and later, fails; their members are told.
    pub(crate) fn abort(&self, mesh: &Mesh, view: View<'_>) {
        flog!(Info, Health, "rank {}: communicator {:#x} aborted by this process", self.rank, view.comm);
        let aborted = Fault { kind: FaultKind::Aborted, culprit: None, reporter: None, op: String::new(), what: "aborted".into() };
        let (i, _) = self.inbox.lock().add(Scope::Comm(view.comm), aborted, None);
        self.tell_once(mesh, i, Some(view));
        self.inbox.notify();
    }

    /// Tells the peers fault `i` concerns, once (see [`Health::tell`]); whether it did now.
    fn tell_once(&self, mesh: &Mesh, i: usize, view: Option<View<'_>>) -> bool {
        let (scope, fault) = {
            let mut ev = self.inbox.lock();
            let Some(s) = ev.faults.get_mut(i) else { return false };
            if std::mem::replace(&mut s.told, true) {
                return false;
            }
            (s.scope, s.fault.clone())
        };
        self.tell(mesh, scope, &fault, view);
        true
    }

    /// Sends the peers a fault concerns an `ERR` with it (without waiting long: a full
    /// ring or a busy socket is skipped): for the whole fabric, every peer, and every
    /// connection is cut (once); for a dead peer, every other peer (news of its death
    /// only: a peer that gave up on this rank is not news to pass on), and its connection
    /// is cut; for a communicator, its members (`view`, when it is that communicator; an
    /// abort of the world, every peer, and every connection is cut).
    fn tell(&self, mesh: &Mesh, scope: Scope, fault: &Fault, view: Option<View<'_>>) {
        let tell_all = |comm: Option<u32>| {
            if !self.told_peers.swap(true, Ordering::AcqRel) {
                mesh.tell_all_and_cut(&proto::encode_err(fault, self.rank, comm));
            }
        };
        match scope {
            // Everything failed: this rank's own failure, or the world's abort.
            Scope::Fabric => tell_all(None),
            Scope::Comm(0) if fault.kind == FaultKind::Aborted => tell_all(Some(0)),
            Scope::Peer(p) => {
                if fault.culprit == Some(p) {
                    let msg = proto::encode_err(fault, self.rank, None);
                    mesh.tell((0..mesh.size()).filter(|&q| q != p && q != self.rank), &msg);
                }
                mesh.cut(p);
            }
            Scope::Comm(c) => {
                if let Some(v) = view.filter(|v| v.comm == c) {
                    let msg = proto::encode_err(fault, self.rank, Some(c));
                    mesh.tell(v.members.iter().copied().filter(|&q| q != self.rank), &msg);
                }
            }
        }
    }

    /// When the fabric closes: tells the peers about every fault that reached the world
    /// and was not told yet (so that they report the root cause, not this rank's exit):
    /// news of a dead peer to everyone, the world's own failure to its members. A split's
    /// own fault is not told: the world may have finalized cleanly since. The goodbyes
    /// that follow say this rank left the rest cleanly. `world`: the world communicator.
    pub(crate) fn tell_at_close(&self, mesh: &Mesh, world: View<'_>) {
        let reaching: Vec<usize> = {
            let ev = self.inbox.lock();
            (0..ev.faults.len()).filter(|&i| ev.reaches(&ev.faults[i], Some(world))).collect()
        };
        for i in reaching {
            self.tell_once(mesh, i, Some(world));
        }
    }
}
