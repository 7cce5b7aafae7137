//! The flight recorder: each communicator keeps its last calls (the collectives, barriers
//! and splits every member makes, by call number) in a fixed ring, and a rank whose call
//! fails for good (a fatal error, a timeout) writes them out; `ferroccl-run` reads every
//! rank's record and says which call the ranks parted at and who never reached it.
//!
//! Recording costs a few relaxed stores per call into memory of its own: a call is written
//! when it is numbered (under the lock that numbers it) and marked done when it finishes.
//! Calls carry no time (reading even the coarse clock on every eighth call cost 4-6 % of an
//! 8 B low-latency allreduce); a record says when it was written (`at_ms`), and the reason
//! (the error) how long a failed call waited. Nothing is formatted until a dump. Measured at
//! 8 B in docs/performance.md (*Fault detection and overhead*).
//!
//! ## The record
//!
//! One line per communicator, then one per call (oldest first), each starting with
//! `ferroccl-flight ` so that the lines can be picked out of a rank's stderr:
//!
//! ```text
//! ferroccl-flight rank=2 world=2 fabric=5d41402a comm=0x0 member=2 size=4 members=0,1,2,3 pid=4711 host=node7 entries=64 at_ms=812346 reason=allreduce (4 x f32, sum, ll) call #57 timed out ...
//! ferroccl-flight rank=2 fabric=5d41402a comm=0x0 call=56 state=done op=allreduce(count 4, f32, sum, algo ll, ...)
//! ferroccl-flight rank=2 fabric=5d41402a comm=0x0 call=57 state=pending op=allreduce(count 4, f32, sum, algo ll, ...)
//! ```
//!
//! Processes are named as the launcher names them: `rank` is the writer's launch rank
//! ([`crate::Process::launch_rank`]) and `members` the members' launch ranks, whatever a
//! shrink renumbered; `world` is the writer's rank in its world communicator, `member` its
//! rank in the communicator; `fabric` tells apart the worlds of one job (the one `init`
//! built, and each one a shrink built: their communicator ids start at 0 again); `at_ms`
//! is when the record was written (the coarse monotonic clock, ms: comparable between the
//! ranks of one host).
//! [`parse`]
//! reads such lines back and [`verdict`] compares the ranks' records.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use crate::proto::{self, Desc};

/// What every line of a record starts with.
pub const PREFIX: &str = "ferroccl-flight ";

/// The coarse monotonic clock, in nanoseconds (0 if it cannot be read).
fn coarse_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::MonotonicCoarse);
    u64::try_from(t.tv_sec).unwrap_or(0).saturating_mul(1_000_000_000).saturating_add(u64::try_from(t.tv_nsec).unwrap_or(0))
}

/// One call's place in the ring.
#[derive(Debug, Default)]
struct Slot {
    /// The call number written here (0 while it is being written, or never).
    call: AtomicU32,
    desc: [AtomicU64; 2],
    /// The call number marked done here.
    done_call: AtomicU32,
}

impl Slot {
    /// The call written here, its descriptor and whether it finished; `None` when empty,
    /// or rewritten while it was read (left out rather than shown torn).
    fn read(&self) -> Option<(u32, Desc, bool)> {
        let call = self.call.load(Ordering::Acquire);
        if call == 0 {
            return None;
        }
        let mut desc = [0u8; 16];
        desc[..8].copy_from_slice(&self.desc[0].load(Ordering::Relaxed).to_le_bytes());
        desc[8..].copy_from_slice(&self.desc[1].load(Ordering::Relaxed).to_le_bytes());
        let done = self.done_call.load(Ordering::Acquire) == call;
        (self.call.load(Ordering::Acquire) == call).then_some((call, desc, done))
    }
}

/// Who writes a record: this process's world rank, the launch rank of every world rank
/// (empty: the same), and the world's tag (see the module documentation).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Who<'a> {
    pub(crate) world: usize,
    pub(crate) launch: &'a [usize],
    pub(crate) fabric: &'a str,
}

impl Who<'_> {
    fn launch_of(&self, w: usize) -> usize {
        self.launch.get(w).copied().unwrap_or(w)
    }
}

/// One communicator's flight recorder (see the module documentation).
#[derive(Debug)]
pub(crate) struct Flight {
    comm: u32,
    member: usize,
    members: Arc<[usize]>,
    slots: Box<[Slot]>,
    /// The first call refused because the fabric had already failed (its number had it
    /// been made, and what it was): it shows that this rank got that far.
    refused: std::sync::Mutex<Option<(u32, String)>>,
    /// What the last dump covered (the last call posted then, and whether a refusal was
    /// in it); `None` before the first.
    dumped: std::sync::Mutex<Option<(u32, bool)>>,
}

impl Flight {
    /// A recorder of the last `entries` calls, rounded up to a power of two (0: records
    /// nothing).
    pub(crate) fn new(comm: u32, member: usize, members: Arc<[usize]>, entries: usize) -> Flight {
        let entries = if entries == 0 { 0 } else { entries.next_power_of_two() };
        Flight {
            comm,
            member,
            members,
            slots: (0..entries).map(|_| Slot::default()).collect(),
            refused: Default::default(),
            dumped: Default::default(),
        }
    }

    /// The call after the last one posted (`what`) was not made: the fabric had failed
    /// already. Only the first such call is kept. Takes no lock of the caller's: it may
    /// hold the one that numbers calls.
    pub(crate) fn refused(&self, what: &str) {
        if self.slots.is_empty() {
            return;
        }
        let call = self.last_call().wrapping_add(1);
        let mut r = self.refused.lock().unwrap_or_else(|e| e.into_inner());
        if r.is_none() {
            *r = Some((call, what.to_string()));
        }
    }

    /// The lines to write now for a dump for `reason`: the whole record the first time;
    /// later, the header and whatever was made or refused since the last dump (calls can
    /// still be numbered after the fatal state is first met: [`parse`] adds such lines to
    /// the record); nothing if nothing changed.
    pub(crate) fn take_dump(&self, who: Who<'_>, reason: &str) -> Vec<String> {
        let now = (self.last_call(), self.refused.lock().unwrap_or_else(|e| e.into_inner()).is_some());
        let mut dumped = self.dumped.lock().unwrap_or_else(|e| e.into_inner());
        if *dumped == Some(now) {
            return Vec::new();
        }
        let after = dumped.map(|(last, _)| last);
        *dumped = Some(now);
        drop(dumped);
        self.lines_after(who, reason, after)
    }

    /// The newest call in the ring (0: none; also when nothing is recorded).
    pub(crate) fn last_call(&self) -> u32 {
        let calls: Vec<u32> = self.slots.iter().map(|s| s.call.load(Ordering::Acquire)).filter(|&c| c != 0).collect();
        let pivot = calls.first().copied().unwrap_or(0);
        calls.into_iter().max_by_key(|c| c.wrapping_sub(pivot).wrapping_add(1 << 31)).unwrap_or(0)
    }

    fn slot(&self, call: u32) -> Option<&Slot> {
        // The length is a power of two (or 0): a mask, not a division, on every call.
        self.slots.get(call as usize & self.slots.len().wrapping_sub(1))
    }

    /// Call `call` (numbered from 1) was made with descriptor `desc`. Called by the one
    /// thread that numbers the communicator's calls, under its lock.
    #[inline]
    pub(crate) fn posted(&self, call: u32, desc: &Desc) {
        let Some(s) = self.slot(call) else { return };
        // No clock here: reading even the coarse clock on every eighth call cost 4-6 % of a
        // 0.13 us low-latency allreduce (2 ranks, alternated); the stores, nothing measurable.
        s.call.store(0, Ordering::Relaxed);
        let (a, b) = desc.split_at(8);
        s.desc[0].store(u64::from_le_bytes(a.try_into().unwrap_or_default()), Ordering::Relaxed);
        s.desc[1].store(u64::from_le_bytes(b.try_into().unwrap_or_default()), Ordering::Relaxed);
        s.call.store(call, Ordering::Release);
    }

    /// Whether call `call` finished on this rank, as far as the ring still holds it.
    pub(crate) fn is_done(&self, call: u32) -> bool {
        self.slot(call).and_then(Slot::read).is_some_and(|(c, _, done)| c == call && done)
    }

    /// The descriptor call `call` was made with, if the ring still holds it.
    pub(crate) fn desc_of(&self, call: u32) -> Option<Desc> {
        self.slot(call).and_then(Slot::read).filter(|r| r.0 == call).map(|r| r.1)
    }

    /// The communicator's id, this rank in it and its members (world ranks).
    pub(crate) fn comm(&self) -> (u32, usize, &[usize]) {
        (self.comm, self.member, &self.members)
    }

    /// Call `call` finished on this rank (successfully). One store: no clock (the next
    /// call's time bounds when this one ended).
    #[inline]
    pub(crate) fn finished(&self, call: u32) {
        if let Some(s) = self.slot(call) {
            s.done_call.store(call, Ordering::Release);
        }
    }

    /// The record's lines (header first), for `world_rank` and a dump for `reason`.
    #[cfg(test)]
    pub(crate) fn lines(&self, who: Who<'_>, reason: &str) -> Vec<String> {
        self.lines_after(who, reason, None)
    }

    /// [`Flight::lines`], of the calls made after call `after` only (and a refusal).
    fn lines_after(&self, who: Who<'_>, reason: &str, after: Option<u32>) -> Vec<String> {
        let me = format!("{PREFIX}rank={} fabric={} comm={:#x}", who.launch_of(who.world), who.fabric, self.comm);
        // Call numbers wrap (a u32); the ring's calls lie within its length of each other,
        // so ordering them around any one of them orders them all.
        let later = |a: u32, b: u32| (a.wrapping_sub(b) as i32) > 0;
        let mut entries: Vec<(u32, String)> = Vec::with_capacity(self.slots.len());
        for (call, desc, done) in self.slots.iter().filter_map(Slot::read) {
            if after.is_some_and(|a| !later(call, a)) {
                continue;
            }
            let state = if done { "done" } else { "pending" };
            let op = one_line(&proto::describe(&desc));
            entries.push((call, format!("{me} call={call} state={state} op={op}")));
        }
        // Oldest first.
        let pivot = entries.first().map_or(0, |e| e.0);
        entries.sort_by_key(|e| e.0.wrapping_sub(pivot).wrapping_add(1 << 31));
        if let Some((call, what)) = self.refused.lock().unwrap_or_else(|e| e.into_inner()).clone() {
            entries.retain(|e| e.0 != call);
            entries.push((call, format!("{me} call={call} state=refused op={}", one_line(&what))));
        }
        let members: Vec<String> = self.members.iter().map(|&w| who.launch_of(w).to_string()).collect();
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().replace(' ', "_")).unwrap_or_default();
        let mut out = vec![format!(
            "{PREFIX}rank={} world={} fabric={} comm={:#x} member={} size={} members={} pid={} host={host} entries={} at_ms={} reason={}",
            who.launch_of(who.world),
            who.world,
            who.fabric,
            self.comm,
            self.member,
            self.members.len(),
            members.join(","),
            std::process::id(),
            self.slots.len(),
            coarse_ns() / 1_000_000,
            one_line(reason)
        )];
        out.extend(entries.into_iter().map(|e| e.1));
        out
    }
}

/// The file this process writes its records to, once made (see [`write_file`]).
static FILE: std::sync::Mutex<Option<(std::path::PathBuf, std::fs::File)>> = std::sync::Mutex::new(None);

/// Appends `text` to this process's record file, `PREFIX<launch rank>.<pid>`: made on the
/// first write, exclusively (an existing file or symbolic link at that path is never
/// followed, opened or truncated: the write fails instead), readable by its owner only;
/// later writes of the process (a shrunk world's too) go to the same open file. Returns
/// the path when this write made the file (to be said once), `None` for a later write.
pub(crate) fn write_file(
    prefix: &std::path::Path,
    launch_rank: usize,
    text: &str,
) -> Result<Option<std::path::PathBuf>, (std::path::PathBuf, std::io::Error)> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut path = prefix.as_os_str().to_owned();
    path.push(format!("{launch_rank}.{}", std::process::id()));
    let path = std::path::PathBuf::from(path);
    let mut file = FILE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((p, f)) = file.as_mut().filter(|(p, _)| *p == path) {
        return f.write_all(text.as_bytes()).map(|()| None).map_err(|e| (p.clone(), e));
    }
    let made = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
        .open(&path)
        .and_then(|mut f| f.write_all(text.as_bytes()).map(|()| f));
    match made {
        Ok(f) => {
            *file = Some((path.clone(), f));
            Ok(Some(path))
        }
        Err(e) => Err((path, e)),
    }
}

fn one_line(s: &str) -> String {
    s.replace(['\n', '\r'], " ")
}

/// What a record says a call was.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Its call number in the communicator (every member numbers the same calls alike).
    pub call: u32,
    /// Whether it finished on the rank.
    pub done: bool,
    /// Whether the rank got to it but did not make it, the fabric having failed already
    /// (`op` is then the call as the API names it, not its descriptor).
    pub refused: bool,
    /// What it was (collective, dtype, op, count, algorithm).
    pub op: String,
}

/// One rank's record of one communicator.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Record {
    /// The rank's launch rank (see [`crate::Process`]).
    pub rank: usize,
    /// The world the communicator belongs to (`init`'s, or a shrink's; empty when the
    /// record does not say).
    pub fabric: String,
    /// The communicator's id (in its world).
    pub comm: u32,
    /// The communicator's members, by launch rank.
    pub members: Vec<usize>,
    /// Why the rank wrote it (its error).
    pub reason: String,
    /// When it was written (the coarse monotonic clock, ms; 0 if not said).
    pub at_ms: u64,
    /// Its calls, oldest first.
    pub entries: Vec<Entry>,
}

impl Record {
    /// Its last call made, if any.
    pub fn last(&self) -> Option<&Entry> {
        self.entries.last()
    }
}

fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let at = line.find(&format!(" {key}="))? + key.len() + 2;
    let rest = &line[at..];
    // `op` and `reason` run to the end of the line; the others to the next space.
    if key == "op" || key == "reason" {
        return Some(rest);
    }
    Some(rest.split(' ').next().unwrap_or(""))
}

fn comm_id(v: &str) -> Option<u32> {
    u32::from_str_radix(v.strip_prefix("0x").unwrap_or(v), 16).ok()
}

/// Reads the records in `text` (lines that do not start with [`PREFIX`], after an
/// optional `[R] ` prefix of the launcher, are skipped; so are malformed ones). Records of
/// the same rank and communicator written twice are merged, the later one winning.
pub fn parse(text: &str) -> Vec<Record> {
    let mut recs: BTreeMap<(String, u32, usize), Record> = BTreeMap::new();
    for line in text.lines() {
        let line = match line.strip_prefix('[').and_then(|l| l.split_once("] ")) {
            Some((_, rest)) => rest,
            None => line,
        };
        let Some(body) = line.strip_prefix(PREFIX) else { continue };
        let body = format!(" {body}");
        let (Some(rank), Some(comm)) = (field(&body, "rank").and_then(|v| v.parse().ok()), field(&body, "comm").and_then(comm_id)) else {
            continue;
        };
        let fabric = field(&body, "fabric").unwrap_or("").to_string();
        let key = (fabric.clone(), comm, rank);
        if let Some(reason) = field(&body, "reason") {
            let members = field(&body, "members").unwrap_or("").split(',').filter_map(|m| m.parse().ok()).collect();
            // A later header of the same record (a refusal written after the dump) keeps
            // what was read of it.
            let at_ms = field(&body, "at_ms").and_then(|v| v.parse().ok()).unwrap_or(0);
            let rec = recs.entry(key).or_insert_with(|| Record {
                rank,
                fabric,
                comm,
                members,
                reason: reason.to_string(),
                at_ms,
                entries: Vec::new(),
            });
            rec.reason = reason.to_string();
            rec.at_ms = at_ms;
            continue;
        }
        let (Some(call), Some(state), Some(op)) =
            (field(&body, "call").and_then(|v| v.parse().ok()), field(&body, "state"), field(&body, "op"))
        else {
            continue;
        };
        if let Some(r) = recs.get_mut(&key) {
            r.entries.retain(|e| e.call != call);
            r.entries.push(Entry { call, done: state == "done", refused: state == "refused", op: op.to_string() });
        }
    }
    recs.into_values().collect()
}

/// What the records of one communicator say about where its members parted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// The world the communicator belongs to (see [`Record::fabric`]).
    pub fabric: String,
    /// The communicator.
    pub comm: u32,
    /// The first call the members did not all make alike, and what it was (on the ranks
    /// that made it); `None` when every rank that left a record made the same calls.
    pub call: Option<(u32, String)>,
    /// Members that made that call.
    pub reached: Vec<usize>,
    /// Members whose record ends before it, with their last call (`None`: none recorded).
    pub never_reached: Vec<(usize, Option<u32>)>,
    /// Members that made that call differently from most, with what they made.
    pub differed: Vec<(usize, String)>,
    /// Members that left no record.
    pub silent: Vec<usize>,
    /// The last call every recording member made, when they agree (`call` is `None`), and
    /// whether any of them finished it.
    pub all_in: Option<(u32, String, bool)>,
    /// The ranks this verdict blames: those that made the call differently from most; else
    /// those that left no record; else those that never reached the call though they had
    /// finished their last one; else those that never reached it.
    pub culprits: Vec<usize>,
}

fn list(v: &[usize]) -> String {
    v.iter().map(usize::to_string).collect::<Vec<_>>().join(", ")
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "communicator {:#x}", self.comm)?;
        if !self.fabric.is_empty() {
            write!(f, " of world {}", self.fabric)?;
        }
        f.write_str(": ")?;
        if let Some((call, op)) = &self.call {
            write!(f, "the members parted at call #{call} ({op}): made by rank(s) {}", list(&self.reached))?;
            for (r, last) in &self.never_reached {
                match last {
                    Some(l) => write!(f, "; rank {r} never reached it (its last call: #{l})")?,
                    None => write!(f, "; rank {r} never reached it (no call recorded)")?,
                }
            }
            for (r, op) in &self.differed {
                write!(f, "; rank {r} made {op} instead")?;
            }
        } else if let Some((call, op, done)) = &self.all_in {
            let how = if *done { "some finished it" } else { "none finished it" };
            write!(f, "every member that left a record made call #{call} ({op}) last; {how}")?;
        } else {
            f.write_str("no calls recorded")?;
        }
        if !self.silent.is_empty() {
            write!(f, "; no record from rank(s) {} (killed, stopped or hung before they could write one)", list(&self.silent))?;
        }
        Ok(())
    }
}

/// Compares the records of each communicator in `records` (one per rank that wrote one)
/// and says, per communicator, the first call its members did not all make alike (a rank
/// that stopped short of it, or made another call under its number) and who is to blame;
/// when all that recorded agree, the members that left no record are. Ranks are launch
/// ranks. Worlds in the order their first record was written (a shrunk world's follow
/// the one it was shrunk from), communicators in id order within each.
pub fn verdict(records: &[Record]) -> Vec<Verdict> {
    let mut first_at: BTreeMap<&str, u64> = BTreeMap::new();
    for r in records {
        let t = first_at.entry(r.fabric.as_str()).or_insert(u64::MAX);
        *t = (*t).min(r.at_ms);
    }
    let mut by_comm: BTreeMap<(u64, &str, u32), Vec<&Record>> = BTreeMap::new();
    for r in records {
        by_comm.entry((first_at[r.fabric.as_str()], r.fabric.as_str(), r.comm)).or_default().push(r);
    }
    let mut out = Vec::new();
    for ((_, fabric, comm), recs) in by_comm {
        let fabric = fabric.to_string();
        let members: BTreeSet<usize> = recs.iter().flat_map(|r| r.members.iter().copied()).chain(recs.iter().map(|r| r.rank)).collect();
        let recorded: BTreeSet<usize> = recs.iter().map(|r| r.rank).collect();
        let silent: Vec<usize> = members.difference(&recorded).copied().collect();
        // Every call number any member recorded, with what each made under it (refused
        // calls count as reached, but are not compared).
        let mut calls: BTreeMap<u32, Vec<(usize, &str)>> = BTreeMap::new();
        let mut refused: BTreeMap<u32, Vec<(usize, &str)>> = BTreeMap::new();
        for r in &recs {
            for e in &r.entries {
                let to = if e.refused { &mut refused } else { &mut calls };
                to.entry(e.call).or_default().push((r.rank, e.op.as_str()));
            }
        }
        for (&c, v) in &refused {
            // Nobody made it: the refusals alone say who got there.
            calls.entry(c).or_insert_with(|| v.iter().map(|&(r, _)| (r, "")).collect());
        }
        let reached_refused = |call: u32, rank: usize| refused.get(&call).is_some_and(|v| v.iter().any(|m| m.0 == rank));
        let first_of = |r: &Record| r.entries.first().map(|e| e.call);
        let last_of = |r: &Record| r.last().map(|e| e.call);
        let mut found: Option<Verdict> = None;
        for (&call, made) in &calls {
            // What most members made under this number (ties: the lowest rank's) is taken
            // for the call; the others made something else.
            let mut counts: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
            for &(rank, op) in made.iter().filter(|m| !m.1.is_empty()) {
                let c = counts.entry(op).or_insert((0, usize::MAX));
                c.0 += 1;
                c.1 = c.1.min(rank);
            }
            let op = counts.iter().max_by_key(|(_, &(n, low))| (n, std::cmp::Reverse(low))).map_or("", |(op, _)| *op);
            let op = if op.is_empty() { refused.get(&call).and_then(|v| v.first()).map_or("", |m| m.1) } else { op };
            let differed: Vec<(usize, String)> =
                made.iter().filter(|m| !m.1.is_empty() && m.1 != op).map(|m| (m.0, m.1.to_string())).collect();
            // Members whose record covers this call's place but stops before it.
            let never: Vec<(usize, Option<u32>)> = recs
                .iter()
                .filter(|r| !made.iter().any(|m| m.0 == r.rank) && !reached_refused(call, r.rank))
                .filter(|r| last_of(r).is_none_or(|l| l < call) && first_of(r).is_none_or(|f| f <= call))
                .map(|r| (r.rank, last_of(r)))
                .collect();
            if differed.is_empty() && never.is_empty() {
                continue;
            }
            let mut reached: Vec<usize> = made.iter().filter(|m| m.1 == op || m.1.is_empty()).map(|m| m.0).collect();
            reached.extend(refused.get(&call).into_iter().flatten().map(|m| m.0));
            reached.sort_unstable();
            reached.dedup();
            // A call made differently is to blame; else a member that left no record (dead,
            // stopped: the others then stop wherever the failure finds them); else the
            // members that finished their last call and did not make this one (they went
            // elsewhere), rather than those still waiting in an earlier call.
            let moved_on: Vec<usize> =
                never.iter().filter(|n| recs.iter().any(|r| r.rank == n.0 && r.last().is_some_and(|e| e.done))).map(|n| n.0).collect();
            let mut culprits: Vec<usize> = if !differed.is_empty() {
                differed.iter().map(|d| d.0).collect()
            } else if !silent.is_empty() {
                silent.clone()
            } else if !moved_on.is_empty() {
                moved_on
            } else {
                never.iter().map(|n| n.0).collect()
            };
            culprits.sort_unstable();
            found = Some(Verdict {
                fabric: fabric.clone(),
                comm,
                call: Some((call, op.to_string())),
                reached,
                never_reached: never,
                differed,
                silent: silent.clone(),
                all_in: None,
                culprits,
            });
            break;
        }
        let v = found.unwrap_or_else(|| {
            let all_in = calls.iter().next_back().map(|(&c, made)| {
                let done = recs.iter().any(|r| r.entries.iter().any(|e| e.call == c && e.done));
                (c, made[0].1.to_string(), done)
            });
            Verdict {
                fabric: fabric.clone(),
                comm,
                call: None,
                reached: Vec::new(),
                never_reached: Vec::new(),
                differed: Vec::new(),
                silent: silent.clone(),
                all_in,
                culprits: silent,
            }
        });
        out.push(v);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn who(world: usize) -> Who<'static> {
        Who { world, launch: &[], fabric: "" }
    }

    fn desc(tag: u8) -> Desc {
        let mut d = [0u8; 16];
        d[0] = tag;
        d
    }

    fn record(rank: usize, members: &[usize], calls: &[(u32, bool, &str)]) -> Record {
        Record {
            rank,
            fabric: String::new(),
            comm: 0,
            members: members.to_vec(),
            reason: "timed out".into(),
            at_ms: 0,
            entries: calls.iter().map(|&(call, done, op)| Entry { call, done, refused: false, op: op.into() }).collect(),
        }
    }

    #[test]
    fn a_record_reads_back_as_written_oldest_first_across_the_ring() {
        let f = Flight::new(7, 1, Arc::from(vec![4, 5, 6]), 4);
        for call in 1..=6 {
            f.posted(call, &desc(call as u8));
            if call < 6 {
                f.finished(call);
            }
        }
        let text: String = f.lines(who(5), "line one\nline two").iter().map(|l| format!("[5] {l}\n")).collect();
        let recs = parse(&text);
        assert_eq!(recs.len(), 1);
        let r = &recs[0];
        assert_eq!((r.rank, r.comm, r.members.clone(), r.reason.as_str()), (5, 7, vec![4, 5, 6], "line one line two"));
        let calls: Vec<(u32, bool)> = r.entries.iter().map(|e| (e.call, e.done)).collect();
        assert_eq!(calls, vec![(3, true), (4, true), (5, true), (6, false)]);
        assert_eq!(r.entries[3].op, proto::describe(&desc(6)));
    }

    #[test]
    fn an_empty_ring_records_nothing_and_zero_entries_keep_nothing() {
        let f = Flight::new(0, 0, Arc::from(vec![0, 1]), 0);
        f.posted(1, &desc(1));
        f.finished(1);
        assert_eq!(f.lines(who(0), "x").len(), 1);
        assert!(parse(&f.lines(who(0), "x").join("\n"))[0].entries.is_empty());
    }

    #[test]
    fn the_rank_that_stopped_short_is_blamed() {
        let m = [0, 1, 2, 3];
        let recs = vec![
            record(0, &m, &[(56, true, "allreduce"), (57, false, "allreduce")]),
            record(1, &m, &[(56, true, "allreduce"), (57, false, "allreduce")]),
            record(2, &m, &[(55, true, "allreduce"), (56, true, "allreduce")]),
            record(3, &m, &[(56, true, "allreduce"), (57, false, "allreduce")]),
        ];
        let v = &verdict(&recs)[0];
        assert_eq!(v.call, Some((57, "allreduce".into())));
        assert_eq!(v.reached, vec![0, 1, 3]);
        assert_eq!(v.never_reached, vec![(2, Some(56))]);
        assert_eq!(v.culprits, vec![2]);
        let s = v.to_string();
        assert!(s.contains("call #57") && s.contains("rank 2 never reached it (its last call: #56)"), "{s}");
    }

    #[test]
    fn a_rank_that_made_another_call_than_most_is_blamed() {
        let m = [0, 1, 2];
        let recs = vec![
            record(0, &m, &[(3, true, "allreduce"), (4, false, "broadcast")]),
            record(1, &m, &[(3, true, "allreduce"), (4, false, "allgather")]),
            record(2, &m, &[(3, true, "allreduce"), (4, false, "allgather")]),
        ];
        let v = &verdict(&recs)[0];
        assert_eq!(v.call, Some((4, "allgather".into())));
        assert_eq!(v.reached, vec![1, 2]);
        assert_eq!(v.differed, vec![(0, "broadcast".into())]);
        assert_eq!(v.culprits, vec![0]);
        // Two ranks, two calls: the lower rank's is taken for the call.
        let v = &verdict(&recs[..2])[0];
        assert_eq!((v.reached.clone(), v.culprits.clone()), (vec![0], vec![1]));
    }

    #[test]
    fn a_rank_refused_a_call_got_there_and_is_not_blamed() {
        // Ranks 0 and 2 learnt of the failure before they could make call #2; rank 1 made
        // it; rank 3 stopped after #1 (it left).
        let m = [0, 1, 2, 3];
        let mut recs = vec![
            record(0, &m, &[(1, true, "barrier")]),
            record(1, &m, &[(1, true, "barrier"), (2, false, "allreduce")]),
            record(2, &m, &[(1, true, "barrier")]),
            record(3, &m, &[(1, true, "barrier")]),
        ];
        for r in [0, 2] {
            recs[r].entries.push(Entry { call: 2, done: false, refused: true, op: "allreduce (4 x f32, sum, ll)".into() });
        }
        let v = &verdict(&recs)[0];
        assert_eq!(v.call, Some((2, "allreduce".into())));
        assert_eq!(v.reached, vec![0, 1, 2]);
        assert_eq!(v.never_reached, vec![(3, Some(1))]);
        assert_eq!(v.culprits, vec![3]);
        // A rank still waiting in call #1 never reached #2 either, but the one that finished
        // #1 and went elsewhere is to blame.
        recs[2].entries = vec![Entry { call: 1, done: false, refused: false, op: "barrier".into() }];
        let v = &verdict(&recs)[0];
        assert_eq!(v.never_reached, vec![(2, Some(1)), (3, Some(1))]);
        assert_eq!(v.culprits, vec![3]);
        // A refusal reads back from a record.
        let f = Flight::new(0, 0, Arc::from(vec![0, 1]), 4);
        f.posted(1, &desc(1));
        f.refused("allreduce (4 x f32, sum, ll)");
        f.refused("later");
        let r = &parse(&f.lines(who(0), "x").join("\n"))[0];
        assert_eq!(r.entries.iter().map(|e| (e.call, e.refused)).collect::<Vec<_>>(), vec![(1, false), (2, true)]);
    }

    #[test]
    fn later_dumps_add_what_changed_and_parse_joins_them() {
        let f = Flight::new(0, 0, Arc::from(vec![0, 1]), 8);
        f.posted(1, &desc(1));
        f.finished(1);
        let mut text = f.take_dump(who(0), "first").join("\n");
        assert!(f.take_dump(who(0), "again").is_empty(), "nothing changed");
        f.posted(2, &desc(2));
        let more = f.take_dump(who(0), "second");
        assert_eq!(more.len(), 2, "{more:?}");
        f.refused("allreduce (4 x f32, sum, ll)");
        let last = f.take_dump(who(0), "third");
        assert!(last.len() == 2 && last[1].contains("call=3 state=refused"), "{last:?}");
        text = [text, more.join("\n"), last.join("\n")].join("\n");
        let r = &parse(&text)[0];
        assert_eq!(
            r.entries.iter().map(|e| (e.call, e.done, e.refused)).collect::<Vec<_>>(),
            vec![(1, true, false), (2, false, false), (3, false, true)]
        );
        assert_eq!(r.reason, "third");
    }

    /// After two shrinks (8 ranks; launch ranks 2, then 5, killed), each world's records
    /// name processes by launch rank, and the worlds (their communicators all 0x0) are kept
    /// apart: each blames its own dead, never a live rank renumbered into its place.
    #[test]
    fn records_of_shrunk_worlds_name_launch_ranks_and_stay_apart() {
        let mut text = String::new();
        // The world of 8: launch rank 2 killed; every other writes a record.
        for w in (0..8).filter(|&w| w != 2) {
            let f = Flight::new(0, w, Arc::from((0..8).collect::<Vec<_>>()), 8);
            f.posted(1, &desc(1));
            let who = Who { world: w, launch: &[], fabric: "aaaa0000" };
            text += &f.lines(who, "rank 2 exited").join("\n");
            text.push('\n');
        }
        // The world of 7 after the first shrink (world rank 4 is launch rank 5): killed.
        let launch7 = [0, 1, 3, 4, 5, 6, 7];
        for w in (0..7).filter(|&w| w != 4) {
            let f = Flight::new(0, w, Arc::from((0..7).collect::<Vec<_>>()), 8);
            f.posted(1, &desc(1));
            f.finished(1);
            f.posted(2, &desc(2));
            let who = Who { world: w, launch: &launch7, fabric: "bbbb1111" };
            text += &f.lines(who, "rank 4 exited").join("\n");
            text.push('\n');
        }
        let recs = parse(&text);
        assert_eq!(recs.len(), 13);
        assert!(recs.iter().any(|r| r.fabric == "bbbb1111" && r.rank == 7 && r.members == launch7));
        let v = verdict(&recs);
        let blamed: Vec<(&str, Vec<usize>)> = v.iter().map(|v| (v.fabric.as_str(), v.culprits.clone())).collect();
        assert_eq!(blamed, vec![("aaaa0000", vec![2]), ("bbbb1111", vec![5])]);
        assert!(v[1].to_string().starts_with("communicator 0x0 of world bbbb1111: "), "{}", v[1]);
    }

    /// A record file is made afresh, the owner's only: a symbolic link or a file already at
    /// its path (planted in a shared directory) is refused, never followed or truncated.
    #[test]
    fn record_files_are_made_exclusively_and_never_follow_links() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("ferroccl-flight-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let victim = dir.join("victim");
        std::fs::write(&victim, "precious").unwrap();
        let own = |prefix: &str, rank: usize| dir.join(format!("{prefix}{rank}.{}", std::process::id()));
        std::os::unix::fs::symlink(&victim, own("link.", 3)).unwrap();
        let e = write_file(&dir.join("link."), 3, "record\n").expect_err("a planted link is refused");
        assert_eq!(e.1.kind(), std::io::ErrorKind::AlreadyExists, "{e:?}");
        std::fs::write(own("file.", 3), "someone else's").unwrap();
        assert!(write_file(&dir.join("file."), 3, "record\n").is_err(), "an existing file is refused");
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        assert_eq!(std::fs::read_to_string(own("file.", 3)).unwrap(), "someone else's");
        let made = write_file(&dir.join("fresh."), 3, "one\n").expect("a fresh file").expect("made now");
        assert_eq!(made, own("fresh.", 3));
        assert_eq!(std::fs::metadata(&made).unwrap().permissions().mode() & 0o777, 0o600);
        assert_eq!(write_file(&dir.join("fresh."), 3, "two\n").expect("appended"), None);
        assert_eq!(std::fs::read_to_string(&made).unwrap(), "one\ntwo\n");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn when_the_recorders_agree_the_silent_members_are_blamed() {
        let m = [0, 1, 2];
        let recs = vec![record(0, &m, &[(9, false, "barrier")]), record(2, &m, &[(9, false, "barrier")])];
        let v = &verdict(&recs)[0];
        assert_eq!(v.call, None);
        assert_eq!(v.all_in, Some((9, "barrier".into(), false)));
        assert_eq!(v.silent, vec![1]);
        assert_eq!(v.culprits, vec![1]);
        assert!(v.to_string().contains("no record from rank(s) 1"), "{v}");
    }

    #[test]
    fn a_call_older_than_a_rings_window_is_not_held_against_it() {
        // Rank 1's ring no longer holds calls 1-4 (entries of 2): it passed them.
        let m = [0, 1];
        let recs =
            vec![record(0, &m, &[(3, true, "a"), (4, true, "a"), (5, false, "a")]), record(1, &m, &[(5, true, "a"), (6, false, "a")])];
        let v = &verdict(&recs)[0];
        assert_eq!(v.call, Some((6, "a".into())));
        assert_eq!(v.never_reached, vec![(0, Some(5))]);
    }

    proptest::proptest! {
        /// Any text parses without panicking, and any records get a verdict without
        /// panicking, whose culprits are members.
        #[test]
        fn garbage_records_never_panic(text in "(ferroccl-flight (rank|comm|call|state|op|members|reason)=[0-9a-z,x#]{0,6} ?){0,8}\n?") {
            let recs = parse(&text);
            let _ = verdict(&recs);
        }

        #[test]
        fn verdicts_blame_members_only(
            lasts in proptest::collection::vec((0u32..6, proptest::prelude::any::<bool>(), 0u8..3), 1..6),
            silent in proptest::collection::vec(proptest::prelude::any::<bool>(), 6),
        ) {
            let n = lasts.len();
            let m: Vec<usize> = (0..n).collect();
            let recs: Vec<Record> = lasts
                .iter()
                .enumerate()
                .filter(|(r, _)| !silent[*r] || *r == 0)
                .map(|(r, &(last, done, op))| {
                    let mut calls: Vec<(u32, bool, String)> = (1..last).map(|c| (c, true, "a".to_string())).collect();
                    if last > 0 {
                        calls.push((last, done, ["a", "b", "c"][op as usize].to_string()));
                    }
                    Record {
                        rank: r,
                        fabric: String::new(),
                        comm: 0,
                        members: m.clone(),
                        reason: String::new(),
                        at_ms: 0,
                        entries: calls.into_iter().map(|(call, done, op)| Entry { call, done, refused: false, op }).collect(),
                    }
                })
                .collect();
            for v in verdict(&recs) {
                proptest::prop_assert!(v.culprits.iter().all(|c| *c < n), "{v:?}");
                proptest::prop_assert!(v.reached.iter().all(|c| !v.culprits.contains(c) || v.differed.iter().any(|d| d.0 == *c)), "{v:?}");
            }
        }
    }

    #[test]
    fn lines_of_other_programs_and_broken_lines_are_skipped() {
        let text = "hello\n[0] ferroccl-flight rank=x comm=0x0 member=0 size=1 members=0 pid=1 entries=1 reason=r\nferroccl-flight rank=0 comm=0x0 call=1 state=done op=a\n";
        assert!(parse(text).is_empty());
    }
}
