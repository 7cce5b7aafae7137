//! Faults as data: [`FaultKind`] and [`RootCause`] (public: which rank is at fault and
//! how, the same on every rank), and [`Fault`], what poisons a fabric and travels between
//! ranks in an `ERR` message.

use super::{fmt_waiting, Error, Op};

/// The kind of a fault of the job ([`RootCause::kind`]); it also travels between ranks in
/// `ERR` messages.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FaultKind {
    /// A rank died, lost its connection, broke the protocol, or panicked.
    Failed,
    /// Two ranks' calls disagree.
    Mismatch,
    /// A rank left the communicator before a call it had to take part in.
    Left,
    /// A deadline passed (on the rank that found it; the rank at fault is not known).
    Timeout,
    /// The communicator was aborted.
    Aborted,
    /// A rank's FerroCCL found a bug in itself ([`Error::Internal`]).
    Internal,
    /// Anything else that made a rank give up (a verbs call failed, an argument that could
    /// only be checked mid-transfer).
    Other,
}

/// A process of the job as its launcher knows it: the rank it was launched as (the rank
/// [`crate::Communicator::init`] read from `ferroccl-run`, torchrun, Slurm or Open MPI,
/// which a shrink does not renumber), its host and its process id. What a supervisor acts
/// on: after a [`crate::Communicator::shrink`] the ranks of a communicator are renumbered,
/// the process is not.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Process {
    /// The rank the launcher gave it (`FERROCCL_RANK`, `RANK`, `SLURM_PROCID`, ...).
    pub launch_rank: usize,
    /// Its host's name.
    pub host: String,
    /// Its process id on that host.
    pub pid: u32,
}

impl std::fmt::Display for Process {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "launch rank {}, pid {} on {}", self.launch_rank, self.pid, self.host)
    }
}

/// Which rank is at fault and what kind of fault it is, as data: the same on every rank of
/// the job, whichever rank found the fault and however the news travelled
/// ([`Error::root_cause`]).
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RootCause {
    /// What kind of fault.
    pub kind: FaultKind,
    /// The rank at fault, as a world rank: its rank in the world communicator of the
    /// failing one (the communicator [`crate::Communicator::init`] returned or, after a
    /// shrink, the one [`crate::Communicator::shrink`] returned); `None` when no rank is
    /// known to be (a deadline passed, the launcher exited, this rank's own internal
    /// error). To act on the process, use [`RootCause::process`].
    pub rank: Option<usize>,
    /// The process at fault, as the launcher knows it (its launch rank, host and pid),
    /// where the rank at fault is known.
    pub process: Option<Process>,
    /// The world rank that found the fault, when known.
    pub found_by: Option<usize>,
    /// The process that found the fault, when known.
    pub found_by_process: Option<Process>,
    /// What the finding rank was doing ("allreduce (1000 x f32, sum, ring) call #3").
    pub op: String,
    /// What happened, in the finding rank's words ("exited (pid 7) without closing its
    /// communicator (killed or crashed?)").
    pub message: String,
}

impl std::fmt::Display for RootCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.rank, &self.process) {
            (Some(r), Some(p)) => write!(f, "{:?} fault of rank {r} ({p}): {}", self.kind, self.message),
            (Some(r), None) => write!(f, "{:?} fault of rank {r}: {}", self.kind, self.message),
            (None, _) => write!(f, "{:?} fault: {}", self.kind, self.message),
        }
    }
}

impl RootCause {
    /// Fills in the processes behind the ranks named, where not known yet (`who`: a world
    /// rank's process).
    pub(crate) fn identify(&mut self, who: &dyn Fn(usize) -> Option<Process>) {
        if self.process.is_none() {
            self.process = self.rank.and_then(who);
        }
        if self.found_by_process.is_none() {
            self.found_by_process = self.found_by.and_then(who);
        }
    }
}

impl FaultKind {
    pub(crate) fn code(self) -> u8 {
        match self {
            FaultKind::Failed => 1,
            FaultKind::Mismatch => 2,
            FaultKind::Left => 3,
            FaultKind::Timeout => 4,
            FaultKind::Aborted => 5,
            FaultKind::Other => 6,
            FaultKind::Internal => 7,
        }
    }

    pub(crate) fn from_code(c: u8) -> Option<FaultKind> {
        Some(match c {
            1 => FaultKind::Failed,
            2 => FaultKind::Mismatch,
            3 => FaultKind::Left,
            4 => FaultKind::Timeout,
            5 => FaultKind::Aborted,
            6 => FaultKind::Other,
            7 => FaultKind::Internal,
            _ => return None,
        })
    }
}

/// A fatal fault as data: what poisons a fabric, and what an `ERR` message carries to the
/// peers, so that every rank can build its own error from fields (which rank found it,
/// which rank is at fault, what kind of fault) instead of nesting another rank's message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Fault {
    pub(crate) kind: FaultKind,
    /// The world rank at fault, if one is known.
    pub(crate) culprit: Option<usize>,
    /// The world rank that found the fault; `None`: this rank.
    pub(crate) reporter: Option<usize>,
    /// What the reporter was doing ("allreduce (1000 x f32, sum, mesh) call #3").
    pub(crate) op: String,
    /// What happened, in words that read the same on every rank (ranks are named, never
    /// "this rank"), without the reporter's prefix: "exited (pid 7) without closing its
    /// communicator", "rank 0 called broadcast(...) as call #1, rank 1 broadcast(...)".
    pub(crate) what: String,
}

impl Fault {
    /// The fault behind `err`, found by this rank. `world` maps a rank of the failing
    /// call's communicator to a world rank (the ranks in `Mismatch` and `PeerLeft` are
    /// communicator ranks; in `PeerFailed` and `Transport` they are world ranks already).
    /// An error that names no rank at fault (an internal error, an argument only checked
    /// mid-transfer) blames the rank that found it, when the error says which that is.
    pub(crate) fn from_error(err: &Error, world: &dyn Fn(usize) -> usize) -> Fault {
        let me = err.reporter();
        let (kind, culprit, op, what) = match err {
            Error::PeerFailed { peer, op, reason, .. } => (FaultKind::Failed, Some(*peer), op.to_string(), reason.clone()),
            // Said as what happened to the peer, as the other faults are ("rank 1 is
            // unreachable over verbs: the queue pair is cut or failed").
            Error::Transport { peer: Some(peer), transport, what, .. } => {
                (FaultKind::Failed, Some(*peer), format!("{transport} transport"), format!("is unreachable over {transport}: {what}"))
            }
            // No peer involved: the trouble is this rank's own (as with a verbs call).
            Error::Transport { peer: None, transport, what, .. } => (FaultKind::Other, me, format!("{transport} transport"), what.clone()),
            Error::Mismatch { peer, op, what, .. } => (FaultKind::Mismatch, Some(world(*peer)), op.to_string(), what.clone()),
            Error::PeerLeft { peer, op, how, peer_calls, p2p, .. } => {
                // Said so that it reads the same on every rank.
                let stream = match (p2p, me) {
                    (Some((s, r)), Some(me)) => {
                        format!(", having sent rank {me} {s} and received {r} point-to-point messages from it")
                    }
                    _ => String::new(),
                };
                let what = format!("{how} the communicator after call #{peer_calls}{stream}");
                (FaultKind::Left, Some(world(*peer)), op.to_string(), what)
            }
            Error::Timeout { op, after, waiting_for, .. } => {
                (FaultKind::Timeout, None, op.to_string(), format!("timed out after {after:?}{}", fmt_waiting(waiting_for)))
            }
            Error::Aborted { op, by, .. } => (FaultKind::Aborted, *by, op.to_string(), "aborted its communicator".into()),
            Error::Verbs { what, source, .. } => (FaultKind::Other, me, what.clone(), source.to_string()),
            Error::Internal { what, .. } => (FaultKind::Internal, me, String::new(), format!("internal error: {what}")),
            Error::Poisoned { first, .. } => return Fault::from_error(first, world),
            Error::LauncherExited { pid, .. } => (FaultKind::Failed, None, String::new(), format!("the launcher (pid {pid}) exited")),
            other => (FaultKind::Other, me, String::new(), other.to_string()),
        };
        Fault { kind, culprit, reporter: None, op, what }
    }

    /// The fault as [`RootCause`], on rank `me` (the reporter when the fault is this
    /// rank's own).
    pub(crate) fn root_cause(&self, me: Option<usize>) -> RootCause {
        RootCause {
            kind: self.kind,
            rank: self.culprit,
            process: None,
            found_by: self.reporter.or(me),
            found_by_process: None,
            op: self.op.clone(),
            message: self.what.clone(),
        }
    }

    /// The error an operation `op` of rank `rank` (a world rank) reports for this fault.
    /// `first` is the error that made the fault, when this rank found it: later calls fail
    /// with [`Error::Poisoned`] keeping it.
    pub(crate) fn to_error(&self, rank: usize, op: &Op, first: Option<&Error>) -> Error {
        let op = op.clone();
        let cause = Some(Box::new(self.root_cause(Some(rank))));
        // Who passed the news on, when that is not the culprit itself.
        let via = |s: &str| match self.reporter {
            Some(r) if Some(r) != self.culprit => format!("{s} (reported by rank {r})"),
            _ => s.to_string(),
        };
        match (self.kind, self.culprit, self.reporter) {
            (FaultKind::Aborted, _, by) => Error::Aborted { rank, op, by },
            // Another rank blames this one (it saw our connection break, or we left or
            // called differently): the other rank is the one to name.
            // A rank still waited for this one in a call this rank never made.
            (FaultKind::Left, Some(c), Some(r)) if c == rank => Error::Mismatch {
                rank,
                peer: r,
                op,
                what: format!("rank {r} is in {}, which needs this rank, but this rank {}", self.op, self.what),
                cause,
            },
            (FaultKind::Failed, Some(c), Some(r)) if c == rank => {
                Error::PeerFailed { rank, peer: r, op, reason: format!("gave up on this rank: {}", self.what), cause }
            }
            (FaultKind::Mismatch, Some(c), Some(r)) if c == rank => {
                Error::Mismatch { rank, peer: r, op, what: format!("{} (found by rank {r} in {})", self.what, self.op), cause }
            }
            (FaultKind::Failed | FaultKind::Left, Some(c), _) => Error::PeerFailed { rank, peer: c, op, reason: via(&self.what), cause },
            (FaultKind::Mismatch, Some(c), _) => Error::Mismatch { rank, peer: c, op, what: via(&self.what), cause },
            (_, _, Some(r)) => {
                let doing = if self.op.is_empty() { String::new() } else { format!(" in {}", self.op) };
                Error::PeerFailed { rank, peer: r, op, reason: format!("gave up{doing}: {}", self.what), cause }
            }
            (_, _, None) => {
                let first = match first {
                    Some(e) => e.duplicate(),
                    None => {
                        let doing = if self.op.is_empty() { String::new() } else { format!("{}: ", self.op) };
                        Error::internal(format!("rank {rank}: {doing}{} (the first error was not kept)", self.what))
                    }
                };
                Error::Poisoned { rank, op, first: Box::new(first) }
            }
        }
    }
}
