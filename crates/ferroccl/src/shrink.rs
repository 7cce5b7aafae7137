//! How the survivors of a failure agree on who carries on ([`crate::Communicator::shrink`]),
//! and how they survive a second failure while they do.
//!
//! One attempt, under store keys of its own (`<root>/<epoch>/...`):
//!
//! 1. **Alive.** Each survivor says it is alive, and which members it knows dead.
//! 2. **Wait.** Until every member has said so or is known dead: by this rank (a process
//!    watch on a member on this host, the old fabric's health) or by another survivor
//!    (what it said, or a death it published under `<root>/dead/<w>`). A member silent
//!    until the deadline (stopped) is left out.
//! 3. **Decide.** The first survivor to ask decides the membership; the others take it.
//! 4. **Build** the new communicator, watching the members meanwhile: a member that dies,
//!    or one that already said its build failed (step 5), ends the build at once, naming
//!    it (instead of leaving the others waiting for its store keys or connections until
//!    the timeout).
//! 5. **Confirm.** Each says whether its build succeeded (`ok`), failed because members
//!    died (`dead:<w>,...`), or failed otherwise (`error:<what>`). The attempt holds when
//!    every member said `ok`; it is tried again (without the dead) when a member died
//!    before it said `ok`, or said it saw one die; otherwise it fails, naming the member
//!    that failed. Every survivor reads the same words (a dead member's are final), so all
//!    reach the same outcome: all carry on in the new communicator, all try again, or all
//!    fail.

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use ferroccl_mem::process::ProcessWatch;

use crate::bootstrap::StoreClient;
use crate::error::{Error, FaultKind, Op, Process, Result, RootCause};
use crate::fabric::Fabric;

/// How often the members' liveness is looked at, at most (a store round trip per member
/// on another host).
const LOOK_EVERY: Duration = Duration::from_millis(10);
/// How long one wait on the store lasts before liveness is looked at again.
const WAIT_SLICE: Duration = Duration::from_millis(20);

/// A list of ranks as the store keeps it ("0,2,3").
pub(crate) fn encode(v: &[usize]) -> String {
    v.iter().map(usize::to_string).collect::<Vec<_>>().join(",")
}

fn decode(b: &[u8]) -> Vec<usize> {
    String::from_utf8_lossy(b).split(',').filter_map(|s| s.parse().ok()).collect()
}

/// What one attempt came to (see the module documentation, step 5).
#[derive(Debug)]
pub(crate) enum Outcome {
    /// Every member built the new communicator.
    Holds,
    /// These members (old world ranks) died before every member built it: try again
    /// without them.
    Died(Vec<usize>),
    /// A member's build failed for another reason: the error to report.
    Failed(Error),
}

/// The survivors' side of a shrink of one communicator, on one rank.
pub(crate) struct Survivors<'a> {
    /// The failed communicator's fabric (its health knows who died).
    fabric: &'a Fabric,
    store: StoreClient,
    /// `<fabric prefix>/shrink/<communicator>`: every attempt's keys start with it.
    root: String,
    /// The communicator's members (world ranks of the old fabric) and this rank's.
    members: Vec<usize>,
    me: usize,
    /// Members on this host: their processes, watched.
    watches: Vec<(usize, ProcessWatch)>,
    /// Members known dead so far, and when liveness was last looked at.
    known: Mutex<(BTreeSet<usize>, Option<Instant>)>,
    /// The attempt under way (see [`Attempt`]).
    attempt: Mutex<Attempt>,
}

/// What one attempt knows of deaths *during* it. Only fresh evidence counts against a
/// member that said it is alive in this attempt: its watched process exited, or the old
/// fabric learned of its death since the attempt began (its health may still blame a rank
/// that is alive, say one that gave up on a dead one), or a survivor published such
/// evidence under `<base>/died/<w>`.
#[derive(Debug, Default)]
struct Attempt {
    base: String,
    /// The old fabric's dead peers when the attempt began.
    stale: BTreeSet<usize>,
    died: BTreeSet<usize>,
    /// A member whose build already failed (its word in step 5 is not `ok`): the others
    /// need not wait for it to connect.
    gave_up: Option<usize>,
    looked: Option<Instant>,
}

impl<'a> Survivors<'a> {
    /// `members` and `me` in world ranks of `fabric`.
    pub(crate) fn new(fabric: &'a Fabric, store: StoreClient, root: String, members: Vec<usize>, me: usize) -> Survivors<'a> {
        let here = fabric.peer_info(me).map(|p| p.host_id.clone());
        let mut known = BTreeSet::new();
        let mut watches = Vec::new();
        for &m in members.iter().filter(|&&m| m != me) {
            let Some(p) = fabric.peer_info(m) else { continue };
            if Some(&p.host_id) != here.as_ref() {
                continue;
            }
            match ProcessWatch::new(i32::try_from(p.pid).unwrap_or(0)) {
                Ok(w) => watches.push((m, w)),
                // No such process: it is gone.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    known.insert(m);
                }
                Err(_) => {}
            }
        }
        Survivors { fabric, store, root, members, me, watches, known: Mutex::new((known, None)), attempt: Mutex::default() }
    }

    fn dead_key(&self, w: usize) -> String {
        format!("{}/dead/{w}", self.root)
    }

    /// Adds to `into` the members found dead now: watched processes that exited, the old
    /// fabric's dead peers not in `stale`, and deaths other survivors published under
    /// `key(w)` (looked up only for members this rank cannot watch itself). What this rank
    /// finds it publishes there (members on other hosts may have no other way to learn).
    fn look(&self, into: &mut BTreeSet<usize>, stale: &BTreeSet<usize>, key: &dyn Fn(usize) -> String) {
        self.fabric.check_health(Instant::now());
        let mut found: Vec<usize> = self.watches.iter().filter(|(_, w)| w.has_exited()).map(|(m, _)| *m).collect();
        found.extend(self.fabric.dead_peers().into_iter().filter(|p| self.members.contains(p) && !stale.contains(p)));
        for m in found {
            if m != self.me && into.insert(m) {
                let _ = self.store.set(&key(m), b"1");
            }
        }
        for &m in &self.members {
            if m == self.me || into.contains(&m) || self.watches.iter().any(|(w, _)| *w == m) {
                continue;
            }
            if matches!(self.store.try_get(&key(m)), Ok(Some(_))) {
                into.insert(m);
            }
        }
    }

    /// Whether a throttled look is due (at most every [`LOOK_EVERY`]); marks it done.
    fn due(looked: &mut Option<Instant>) -> bool {
        let now = Instant::now();
        if looked.is_some_and(|t| now.saturating_duration_since(t) < LOOK_EVERY) {
            return false;
        }
        *looked = Some(now);
        true
    }

    /// The members known dead now, whenever they died (see [`Survivors::look`]).
    pub(crate) fn dead(&self) -> BTreeSet<usize> {
        let mut k = self.known.lock().unwrap_or_else(|e| e.into_inner());
        let (known, looked) = &mut *k;
        if Self::due(looked) {
            self.look(known, &BTreeSet::new(), &|w| self.dead_key(w));
        }
        known.clone()
    }

    /// The members known to have died during the attempt under way (see [`Attempt`]).
    fn died(&self) -> BTreeSet<usize> {
        let mut a = self.attempt.lock().unwrap_or_else(|e| e.into_inner());
        if !Self::due(&mut a.looked) {
            return a.died.clone();
        }
        let Attempt { base, stale, died, .. } = &mut *a;
        self.look(died, stale, &|w| format!("{base}/died/{w}"));
        if a.gave_up.is_none() {
            a.gave_up = self
                .members
                .iter()
                .copied()
                .filter(|&m| m != self.me)
                .find(|m| matches!(self.store.try_get(&format!("{}/built/{m}", a.base)), Ok(Some(w)) if w != b"ok"));
        }
        a.died.clone()
    }

    /// Takes `dead` as dead from now on (they died during an attempt).
    pub(crate) fn mark_dead(&self, dead: &[usize]) {
        let mut k = self.known.lock().unwrap_or_else(|e| e.into_inner());
        for &m in dead {
            if m != self.me && k.0.insert(m) {
                let _ = self.store.set(&self.dead_key(m), b"1");
            }
        }
    }

    /// The process of old world rank `w`.
    fn process(&self, w: usize) -> Option<Process> {
        self.fabric.process(w)
    }

    /// Steps 1-3 of attempt `base`: the members that carry on (world ranks of the old
    /// fabric, in order).
    pub(crate) fn agree(&self, base: &str, deadline: Instant) -> Result<Vec<usize>> {
        let key = |what: &str, w: usize| format!("{base}/{what}/{w}");
        self.fabric.check_health(Instant::now());
        *self.attempt.lock().unwrap_or_else(|e| e.into_inner()) =
            Attempt { base: base.to_string(), stale: self.fabric.dead_peers().into_iter().collect(), ..Attempt::default() };
        let dead_now: Vec<usize> = self.dead().into_iter().collect();
        self.store.set(&key("alive", self.me), encode(&dead_now).as_bytes())?;
        let (mut alive, mut said_dead): (BTreeSet<usize>, BTreeSet<usize>) = Default::default();
        loop {
            let dead = self.dead();
            for &m in &self.members {
                if alive.contains(&m) {
                    continue;
                }
                if let Some(v) = self.store.try_get(&key("alive", m))? {
                    alive.insert(m);
                    said_dead.extend(decode(&v));
                }
            }
            let settled = |m: &usize| alive.contains(m) || dead.contains(m) || said_dead.contains(m);
            if self.members.iter().all(settled) || Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        if self.store.add(&format!("{base}/ticket"), 1)? == 1 {
            let v: Vec<usize> = self.members.iter().copied().filter(|m| alive.contains(m)).collect();
            self.store.set(&format!("{base}/decided"), encode(&v).as_bytes())?;
            return Ok(v);
        }
        // The decider said it is alive a moment ago; its decision follows at once.
        let left = deadline.saturating_duration_since(Instant::now()) + self.fabric.params.timeout;
        Ok(decode(&self.store.get(&format!("{base}/decided"), left)?))
    }

    /// For the build of attempt `decided` (step 4): an error naming a member of it that
    /// died during the attempt (`rank`: this rank in the new communicator), if one did.
    pub(crate) fn check(&self, decided: &[usize], rank: usize) -> Result<()> {
        let dead = self.died();
        if let Some(r) = decided.iter().position(|m| dead.contains(m)) {
            return Err(self.died_error(decided[r], Some(r), rank, decided.len()));
        }
        // A member that gave up on its build will not connect: stop waiting for it.
        let gave_up = self.attempt.lock().unwrap_or_else(|e| e.into_inner()).gave_up;
        match gave_up.and_then(|w| decided.iter().position(|&m| m == w)) {
            None => Ok(()),
            Some(r) => Err(Error::PeerFailed {
                rank,
                peer: r,
                op: Op::other("shrink"),
                reason: "could not build the shrunk communicator".into(),
                cause: None,
            }),
        }
    }

    /// The error of a shrink on new rank `rank` of `size` for old world rank `w` (`as_new`:
    /// its rank in the new communicator) that died during it.
    fn died_error(&self, w: usize, as_new: Option<usize>, rank: usize, size: usize) -> Error {
        let process = self.process(w);
        let pid = process.as_ref().map_or(String::new(), |p| format!(" (pid {})", p.pid));
        let reason = format!("exited{pid} during the shrink to {size} ranks");
        let peer = as_new.unwrap_or(w);
        let cause = RootCause {
            kind: FaultKind::Failed,
            rank: Some(peer),
            process,
            found_by: Some(rank),
            found_by_process: self.process(self.me),
            op: "shrink".into(),
            message: reason.clone(),
        };
        Error::PeerFailed { rank, peer, op: Op::other("shrink"), reason, cause: Some(Box::new(cause)) }
    }

    /// Step 5 of attempt `base` with members `decided`: says how this rank's build went
    /// (`built`: its error, if it failed) and reads the others' words until the outcome is
    /// known (see [`Outcome`]), or the deadline passes.
    pub(crate) fn confirm(&self, base: &str, decided: &[usize], built: Option<&Error>, deadline: Instant) -> Result<Outcome> {
        let key = |w: usize| format!("{base}/built/{w}");
        let mine = match built {
            None => "ok".to_string(),
            Some(e) => {
                let dead: Vec<usize> = self.died().into_iter().filter(|m| decided.contains(m)).collect();
                if dead.is_empty() {
                    format!("error:{e}")
                } else {
                    format!("dead:{}", encode(&dead))
                }
            }
        };
        self.store.set(&key(self.me), mine.as_bytes())?;
        let keys: Vec<String> = decided.iter().map(|&m| key(m)).collect();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.store.multi_get(&keys, left.min(WAIT_SLICE)) {
                Ok(words) => return Ok(self.outcome(decided, &words)),
                Err(Error::Timeout { .. }) => {}
                Err(e) => return Err(e),
            }
            // A member dead before it said a word never will: its silence is final.
            let dead = self.died();
            let mut words = Vec::with_capacity(decided.len());
            let mut all_known = true;
            for &m in decided {
                match self.store.try_get(&key(m))? {
                    Some(w) => words.push(w),
                    None if dead.contains(&m) => words.push(format!("dead:{m}").into_bytes()),
                    None => {
                        all_known = false;
                        break;
                    }
                }
            }
            if all_known {
                return Ok(self.outcome(decided, &words));
            }
            if Instant::now() >= deadline {
                let waiting: Vec<String> =
                    decided.iter().filter(|&&m| !matches!(self.store.try_get(&key(m)), Ok(Some(_)))).map(|m| format!("rank {m}")).collect();
                return Err(Error::Timeout {
                    rank: Some(self.me),
                    op: Op::other("shrink (confirming the new communicator)"),
                    after: self.fabric.params.timeout,
                    waiting_for: waiting,
                });
            }
        }
    }

    /// What the members' words (one per member of `decided`) say.
    fn outcome(&self, decided: &[usize], words: &[Vec<u8>]) -> Outcome {
        let mut died = Vec::new();
        let mut failed = None;
        for (i, w) in words.iter().enumerate() {
            let w = String::from_utf8_lossy(w);
            if let Some(d) = w.strip_prefix("dead:") {
                died.extend(decode(d.as_bytes()));
            } else if let Some(what) = w.strip_prefix("error:") {
                if failed.is_none() {
                    let rank = decided.iter().position(|&m| m == self.me).unwrap_or(self.me);
                    let reason = format!("could not join the shrunk communicator: {what}");
                    let cause = RootCause {
                        kind: FaultKind::Failed,
                        rank: Some(i),
                        process: self.process(decided[i]),
                        found_by: Some(i),
                        found_by_process: self.process(decided[i]),
                        op: "shrink".into(),
                        message: reason.clone(),
                    };
                    failed = Some(Error::PeerFailed { rank, peer: i, op: Op::other("shrink"), reason, cause: Some(Box::new(cause)) });
                }
            }
        }
        died.sort_unstable();
        died.dedup();
        died.retain(|&d| d != self.me);
        match (died.is_empty(), failed) {
            (false, _) => Outcome::Died(died),
            (true, Some(e)) => Outcome::Failed(e),
            (true, None) => Outcome::Holds,
        }
    }

    /// The error to report when no attempt held before the members ran out: the last
    /// death, in old world ranks.
    pub(crate) fn gave_up(&self, died: &[usize]) -> Error {
        let w = died.first().copied().unwrap_or(self.me);
        self.died_error(w, None, self.me, self.members.len() - died.len())
    }
}
