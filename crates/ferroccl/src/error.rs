//! The one error type of FerroCCL. Every variant says what failed and, where there is one,
//! which rank, which peer and which operation.

use std::io;
use std::time::Duration;

/// Result alias used throughout FerroCCL.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in FerroCCL.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A launcher or FerroCCL environment variable is missing or malformed.
    #[error("environment variable {var}: {problem}")]
    Env {
        /// The variable's name.
        var: String,
        /// What is wrong with it.
        problem: String,
    },

    /// A caller passed an argument that cannot work (lengths, ranks, sizes...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// An I/O call failed; `what` says which call and with whom.
    #[error("{what}: {source}")]
    Io {
        /// The call and its context ("connect to store 127.0.0.1:2345", ...).
        what: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },

    /// The bootstrap store (or a peer's listener) refused us, or we refused it, at the
    /// token check.
    #[error("authentication with {peer} failed: {reason}")]
    Auth {
        /// Who we were talking to (an address or a rank).
        peer: String,
        /// Why ("wrong job token", "peer did not prove it knows the token", ...).
        reason: String,
    },

    /// The other side of a store or mesh connection broke the wire protocol.
    #[error("protocol error with {peer}: {what}")]
    Protocol {
        /// Who sent the bad bytes.
        peer: String,
        /// What was wrong with them.
        what: String,
    },

    /// The store answered a request with an error.
    #[error("store refused {op}: {reason}")]
    StoreRefused {
        /// The request.
        op: &'static str,
        /// The server's reason.
        reason: String,
    },

    /// A deadline passed.
    #[error("rank {rank}: {op} timed out after {after:?}{}", fmt_waiting(.waiting_for))]
    Timeout {
        /// The rank that gave up (`usize::MAX` before the rank is known).
        rank: usize,
        /// What it was doing.
        op: String,
        /// How long it waited.
        after: Duration,
        /// What it was waiting for (peers, store keys), if known.
        waiting_for: Vec<String>,
    },

    /// A peer died, closed its connections, or reported a fatal error.
    #[error("rank {rank}: {op} failed because rank {peer} {reason}")]
    PeerFailed {
        /// The rank reporting.
        rank: usize,
        /// The peer that failed (a world rank).
        peer: usize,
        /// What the reporting rank was doing.
        op: String,
        /// What happened to the peer.
        reason: String,
    },

    /// A transport could not be set up or used with a peer.
    #[error("rank {rank}: {transport} transport to rank {peer}: {what}")]
    Transport {
        /// The rank reporting.
        rank: usize,
        /// The peer (a world rank).
        peer: usize,
        /// `shm`, `tcp`, ...
        transport: &'static str,
        /// What went wrong.
        what: String,
    },

    /// An RDMA verbs call failed (setting up the device, registering memory, posting work):
    /// `source` names the verb and carries the OS error.
    #[error("rank {rank}: verbs: {what}: {source}")]
    Verbs {
        /// The rank reporting.
        rank: usize,
        /// What it was doing ("register a 1048576-byte receive buffer", ...).
        what: String,
        /// The verbs error (the failing verb and its OS error, or the memlock limit).
        #[source]
        source: ferroccl_verbs::Error,
    },

    /// Two ranks called matching operations with arguments that do not match.
    #[error("rank {rank}: {op} with rank {peer} does not match: {what}")]
    Mismatch {
        /// The rank reporting.
        rank: usize,
        /// The peer whose call differs.
        peer: usize,
        /// The operation.
        op: String,
        /// The difference ("this rank receives 16 bytes, rank 1 sends 32").
        what: String,
    },

    /// The communicator was aborted ([`crate::Communicator::abort`]); every pending and later
    /// operation fails with this.
    #[error("rank {rank}: {op} failed: the communicator was aborted{}", fmt_by(*.by))]
    Aborted {
        /// The rank reporting.
        rank: usize,
        /// The operation that was pending or called.
        op: String,
        /// The rank that called `abort` (a world rank), if it was another one.
        by: Option<usize>,
    },

    /// The communicator was poisoned by an earlier fatal error; the first error is kept.
    #[error("communicator is unusable after an earlier error: {0}")]
    Poisoned(String),

    /// A peer left the communicator ([`crate::Communicator::finalize`] or drop) before it
    /// took part in this operation, which therefore can never complete. It says where the
    /// peer stopped: after how many calls that every member makes (collectives, barriers,
    /// splits), and for point-to-point how many messages it took from this rank.
    #[error("rank {rank}: {op} cannot complete: rank {peer} {how} the communicator after call #{peer_calls}{}", fmt_p2p(*.p2p))]
    PeerLeft {
        /// The rank reporting (a rank of the communicator).
        rank: usize,
        /// The rank that left (a rank of the communicator).
        peer: usize,
        /// What this rank was doing, with its call number ("allreduce (...) call #42").
        op: String,
        /// How the peer left.
        how: Departure,
        /// The number of the peer's last collective call on the communicator (0: none).
        peer_calls: u64,
        /// For point-to-point traffic: how many messages on this stream the peer had sent
        /// or received, as (sent to this rank, received from this rank).
        p2p: Option<(u64, u64)>,
    },

    /// The communicator, or the world communicator it was split from, was finalized: no
    /// call can run on it any more.
    #[error("rank {rank}: {op}: {} communicator was finalized", if *.world { "the world" } else { "this" })]
    Finalized {
        /// The rank reporting.
        rank: usize,
        /// The call that was refused.
        op: String,
        /// Whether it was the world communicator (this one being a split of it).
        world: bool,
    },
}

/// How a peer left a communicator ([`Error::PeerLeft`]).
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Departure {
    /// It called [`crate::Communicator::finalize`].
    Finalized,
    /// It dropped its communicator without finalizing it.
    Dropped,
}

impl std::fmt::Display for Departure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Departure::Finalized => "finalized",
            Departure::Dropped => "dropped",
        })
    }
}

fn fmt_p2p(p: Option<(u64, u64)>) -> String {
    p.map(|(s, r)| format!(", having sent this rank {s} and received {r} point-to-point messages on this stream")).unwrap_or_default()
}

fn fmt_by(by: Option<usize>) -> String {
    by.map(|r| format!(" by rank {r}")).unwrap_or_default()
}

fn fmt_waiting(w: &[String]) -> String {
    if w.is_empty() {
        String::new()
    } else {
        format!(" waiting for {}", w.join(", "))
    }
}

impl Error {
    /// Wraps an I/O error with what was being done.
    pub(crate) fn io(what: impl Into<String>, source: io::Error) -> Self {
        Error::Io { what: what.into(), source }
    }

    /// Shorthand for [`Error::InvalidArgument`].
    pub(crate) fn invalid(what: impl Into<String>) -> Self {
        Error::InvalidArgument(what.into())
    }

    /// A copy of the error, for reporting one failure to several waiters (an I/O error's
    /// copy keeps its kind and message).
    pub(crate) fn duplicate(&self) -> Error {
        match self {
            Error::Env { var, problem } => Error::Env { var: var.clone(), problem: problem.clone() },
            Error::InvalidArgument(s) => Error::InvalidArgument(s.clone()),
            Error::Io { what, source } => Error::Io { what: what.clone(), source: io::Error::new(source.kind(), source.to_string()) },
            Error::Auth { peer, reason } => Error::Auth { peer: peer.clone(), reason: reason.clone() },
            Error::Protocol { peer, what } => Error::Protocol { peer: peer.clone(), what: what.clone() },
            Error::StoreRefused { op, reason } => Error::StoreRefused { op, reason: reason.clone() },
            Error::Timeout { rank, op, after, waiting_for } => {
                Error::Timeout { rank: *rank, op: op.clone(), after: *after, waiting_for: waiting_for.clone() }
            }
            Error::PeerFailed { rank, peer, op, reason } => {
                Error::PeerFailed { rank: *rank, peer: *peer, op: op.clone(), reason: reason.clone() }
            }
            Error::Transport { rank, peer, transport, what } => {
                Error::Transport { rank: *rank, peer: *peer, transport, what: what.clone() }
            }
            Error::Mismatch { rank, peer, op, what } => Error::Mismatch { rank: *rank, peer: *peer, op: op.clone(), what: what.clone() },
            Error::Aborted { rank, op, by } => Error::Aborted { rank: *rank, op: op.clone(), by: *by },
            Error::Verbs { rank, what, source } => Error::Verbs { rank: *rank, what: what.clone(), source: source.duplicate() },
            Error::Poisoned(s) => Error::Poisoned(s.clone()),
            Error::PeerLeft { rank, peer, op, how, peer_calls, p2p } => {
                Error::PeerLeft { rank: *rank, peer: *peer, op: op.clone(), how: *how, peer_calls: *peer_calls, p2p: *p2p }
            }
            Error::Finalized { rank, op, world } => Error::Finalized { rank: *rank, op: op.clone(), world: *world },
        }
    }

    /// Shorthand for [`Error::Protocol`].
    pub(crate) fn protocol(peer: impl Into<String>, what: impl Into<String>) -> Self {
        Error::Protocol { peer: peer.into(), what: what.into() }
    }
}

/// The kind of a fatal fault, as it travels between ranks in an `ERR` message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FaultKind {
    /// A rank died, lost its connection or broke the protocol (`culprit`).
    Failed,
    /// Two ranks' calls disagree (`reporter` and `culprit`).
    Mismatch,
    /// A rank left the communicator before a call it had to take part in (`culprit`).
    Left,
    /// A deadline passed on the reporter.
    Timeout,
    /// The communicator was aborted (by the reporter).
    Aborted,
    /// Anything else that made the reporter give up.
    Other,
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
    pub(crate) fn from_error(err: &Error, world: &dyn Fn(usize) -> usize) -> Fault {
        let me = match err {
            Error::PeerFailed { rank, .. }
            | Error::Transport { rank, .. }
            | Error::Mismatch { rank, .. }
            | Error::PeerLeft { rank, .. }
            | Error::Timeout { rank, .. }
            | Error::Aborted { rank, .. } => Some(*rank),
            _ => None,
        };
        let (kind, culprit, op, what) = match err {
            Error::PeerFailed { peer, op, reason, .. } => (FaultKind::Failed, Some(*peer), op.clone(), reason.clone()),
            Error::Transport { peer, transport, what, .. } => {
                (FaultKind::Failed, Some(*peer), format!("{transport} transport"), what.clone())
            }
            Error::Mismatch { peer, op, what, .. } => (FaultKind::Mismatch, Some(world(*peer)), op.clone(), what.clone()),
            Error::PeerLeft { peer, op, how, peer_calls, p2p, .. } => {
                // Said so that it reads the same on every rank.
                let stream = match (p2p, me) {
                    (Some((s, r)), Some(me)) => {
                        format!(", having sent rank {me} {s} and received {r} point-to-point messages from it")
                    }
                    _ => String::new(),
                };
                let what = format!("{how} the communicator after call #{peer_calls}{stream}");
                (FaultKind::Left, Some(world(*peer)), op.clone(), what)
            }
            Error::Timeout { op, after, waiting_for, .. } => {
                (FaultKind::Timeout, None, op.clone(), format!("timed out after {after:?}{}", fmt_waiting(waiting_for)))
            }
            Error::Aborted { op, by, .. } => (FaultKind::Aborted, *by, op.clone(), "aborted its communicator".into()),
            Error::Verbs { what, source, .. } => (FaultKind::Other, None, what.clone(), source.to_string()),
            other => (FaultKind::Other, None, String::new(), other.to_string()),
        };
        Fault { kind, culprit, reporter: None, op, what }
    }

    /// The error an operation `op` of rank `rank` (a world rank; `me` is the same rank)
    /// reports for this fault.
    pub(crate) fn to_error(&self, rank: usize, op: &str) -> Error {
        let op = op.to_string();
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
            },
            (FaultKind::Failed, Some(c), Some(r)) if c == rank => {
                Error::PeerFailed { rank, peer: r, op, reason: format!("gave up on this rank: {}", self.what) }
            }
            (FaultKind::Mismatch, Some(c), Some(r)) if c == rank => {
                Error::Mismatch { rank, peer: r, op, what: format!("{} (found by rank {r} in {})", self.what, self.op) }
            }
            (FaultKind::Failed | FaultKind::Left, Some(c), _) => Error::PeerFailed { rank, peer: c, op, reason: via(&self.what) },
            (FaultKind::Mismatch, Some(c), _) => Error::Mismatch { rank, peer: c, op, what: via(&self.what) },
            (_, _, Some(r)) => {
                let doing = if self.op.is_empty() { String::new() } else { format!(" in {}", self.op) };
                Error::PeerFailed { rank, peer: r, op, reason: format!("gave up{doing}: {}", self.what) }
            }
            (_, _, None) => {
                let doing = if self.op.is_empty() { String::new() } else { format!("{}: ", self.op) };
                Error::Poisoned(format!("rank {rank}: {doing}{}", self.what))
            }
        }
    }
}
