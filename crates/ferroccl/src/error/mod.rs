//! The one error type of FerroCCL. Every variant says what failed and, where there is one,
//! which rank, which peer and which operation ([`Op`], as data). A fault of the job (a
//! rank died, calls did not match, a deadline passed) also says, on every rank, which rank
//! is at fault and what kind of fault it is: [`Error::root_cause`].

mod fault;
mod op;

use std::io;
use std::time::Duration;

pub(crate) use fault::Fault;
pub use fault::{FaultKind, Process, RootCause};
pub(crate) use op::in_elements;
pub use op::{Op, PodType};

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

    /// A caller passed an argument that cannot work (lengths, ranks, sizes...). Found
    /// before anything went on the wire: the communicator stays usable.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// Something FerroCCL itself got wrong (an internal invariant did not hold): a bug to
    /// report. Once an operation has started on the wire it is fatal for the communicator
    /// and the peers are told, like any other fault.
    #[error("{}internal error: {what}", fmt_rank(*.rank))]
    Internal {
        /// The rank it happened on, once known.
        rank: Option<usize>,
        /// What did not hold.
        what: String,
    },

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
    #[error("{}{op} timed out after {after:?}{}", fmt_rank(*.rank), fmt_waiting(.waiting_for))]
    Timeout {
        /// The rank that gave up (`None` before the rank is known).
        rank: Option<usize>,
        /// What it was doing.
        op: Op,
        /// How long it waited.
        after: Duration,
        /// What it was waiting for (peers, store keys), if known.
        waiting_for: Vec<String>,
    },

    /// A peer died, closed its connections, or reported a fatal error.
    #[error("rank {rank}: {op} failed because rank {peer} {reason}{}", fmt_process(.cause))]
    PeerFailed {
        /// The rank reporting.
        rank: usize,
        /// The peer that failed, or that told this rank of a failure (a world rank).
        peer: usize,
        /// What the reporting rank was doing.
        op: Op,
        /// What happened to the peer.
        reason: String,
        /// The fault behind it, when another rank reported it (see [`Error::root_cause`]).
        cause: Option<Box<RootCause>>,
    },

    /// The launcher that started this rank (`ferroccl-run`, torchrun's agent) exited while
    /// the rank still ran: the job is over.
    #[error("rank {rank}: the launcher (pid {pid}) exited")]
    LauncherExited {
        /// The rank reporting (a world rank).
        rank: usize,
        /// The launcher's process id.
        pid: u32,
    },

    /// A transport could not be set up or used (with a peer, where one is involved).
    #[error("rank {rank}: {transport} transport{}: {what}", .peer.map_or(String::new(), |p| format!(" to rank {p}")))]
    Transport {
        /// The rank reporting.
        rank: usize,
        /// The peer (a world rank); `None` when the trouble is this rank's own (its RDMA
        /// port is not active).
        peer: Option<usize>,
        /// Which transport.
        transport: crate::transport_kind::TransportKind,
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
    #[error("rank {rank}: {op} with rank {peer} does not match: {what}{}", fmt_process(.cause))]
    Mismatch {
        /// The rank reporting.
        rank: usize,
        /// The peer whose call differs.
        peer: usize,
        /// The operation.
        op: Op,
        /// The difference ("rank 0 receives 5 f32, rank 1 sends 4 f32").
        what: String,
        /// The fault as data, with the peer as a world rank (see [`Error::root_cause`]).
        cause: Option<Box<RootCause>>,
    },

    /// The communicator was aborted ([`crate::Communicator::abort`]); every pending and later
    /// operation fails with this.
    #[error("rank {rank}: {op} failed: the communicator was aborted{}", fmt_by(*.by))]
    Aborted {
        /// The rank reporting.
        rank: usize,
        /// The operation that was pending or called.
        op: Op,
        /// The rank that called `abort` (a world rank), if it was another one.
        by: Option<usize>,
    },

    /// The communicator was poisoned by an earlier fatal error of this rank's; the first
    /// error is kept, as the source of this one.
    #[error("rank {rank}: {op}: the communicator is unusable after an earlier error: {first}")]
    Poisoned {
        /// The rank reporting.
        rank: usize,
        /// The call that was refused.
        op: Op,
        /// The error that poisoned the communicator.
        #[source]
        first: Box<Error>,
    },

    /// A peer left the communicator ([`crate::Communicator::finalize`] or drop) before it
    /// took part in this operation, which therefore can never complete. It says where the
    /// peer stopped: after how many calls that every member makes (collectives, barriers,
    /// splits), and for point-to-point how many messages it took from this rank.
    #[error("rank {rank}: {op} cannot complete: rank {peer} {how} the communicator after call #{peer_calls}{}{}", fmt_p2p(*.p2p), fmt_process(.cause))]
    PeerLeft {
        /// The rank reporting (a rank of the communicator).
        rank: usize,
        /// The rank that left (a rank of the communicator).
        peer: usize,
        /// What this rank was doing, with its call number ("allreduce (...) call #42").
        op: Op,
        /// How the peer left.
        how: Departure,
        /// The number of the peer's last collective call on the communicator (0: none).
        peer_calls: u64,
        /// For point-to-point traffic: how many messages on this stream the peer had sent
        /// or received, as (sent to this rank, received from this rank).
        p2p: Option<(u64, u64)>,
        /// The fault as data, with the peer as a world rank (see [`Error::root_cause`]).
        cause: Option<Box<RootCause>>,
    },

    /// The communicator, or the world communicator it was split from, was finalized: no
    /// call can run on it any more.
    #[error("rank {rank}: {op}: {} communicator was finalized", if *.world { "the world" } else { "this" })]
    Finalized {
        /// The rank reporting.
        rank: usize,
        /// The call that was refused.
        op: Op,
        /// Whether it was the world communicator (this one being a split of it).
        world: bool,
    },

    /// The owner of a window refused a one-sided access made through a handle: the window
    /// was dropped (or never existed: a forged key), the handle belongs to another job, the
    /// range is outside the window, or the window is read-only. Nothing was read or
    /// written, and the communicator stays usable.
    #[error("rank {rank}: {op} was refused by rank {owner}: {reason}")]
    Refused {
        /// The rank reporting.
        rank: usize,
        /// The window's owner (a world rank).
        owner: usize,
        /// The access.
        op: Op,
        /// Why.
        reason: Refusal,
    },
}

/// Why the owner of a window refused an access ([`Error::Refused`]).
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No live window has the handle's id and key: it was dropped, or the key is wrong.
    NoWindow,
    /// The handle was made by another job (or another `init` of this one).
    OtherJob,
    /// The range is not inside the window.
    OutOfRange,
    /// A write through a read-only window.
    ReadOnly,
    /// The owner could not serve the access (it is closing, or its side failed).
    Failed,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Refusal::NoWindow => "no live window has this handle's id and key (dropped, or a forged handle)",
            Refusal::OtherJob => "the handle belongs to another job",
            Refusal::OutOfRange => "the range is outside the window",
            Refusal::ReadOnly => "the window is read-only",
            Refusal::Failed => "the owner could not serve it",
        })
    }
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

/// The process at fault, where its launch rank is not the rank the message names (after a
/// shrink renumbered the ranks): so that a reader acts on the right process.
fn fmt_process(cause: &Option<Box<RootCause>>) -> String {
    match cause.as_deref() {
        Some(RootCause { rank: Some(r), process: Some(p), .. }) if p.launch_rank != *r => format!(" [rank {r} at fault is {p}]"),
        _ => String::new(),
    }
}

fn fmt_rank(rank: Option<usize>) -> String {
    rank.map(|r| format!("rank {r}: ")).unwrap_or_default()
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

    /// An [`Error::Internal`]; the rank is filled in when the error poisons the fabric.
    pub(crate) fn internal(what: impl Into<String>) -> Self {
        Error::Internal { rank: None, what: what.into() }
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
            Error::Internal { rank, what } => Error::Internal { rank: *rank, what: what.clone() },
            Error::Io { what, source } => Error::Io { what: what.clone(), source: io::Error::new(source.kind(), source.to_string()) },
            Error::Auth { peer, reason } => Error::Auth { peer: peer.clone(), reason: reason.clone() },
            Error::Protocol { peer, what } => Error::Protocol { peer: peer.clone(), what: what.clone() },
            Error::StoreRefused { op, reason } => Error::StoreRefused { op, reason: reason.clone() },
            Error::Timeout { rank, op, after, waiting_for } => {
                Error::Timeout { rank: *rank, op: op.clone(), after: *after, waiting_for: waiting_for.clone() }
            }
            Error::PeerFailed { rank, peer, op, reason, cause } => {
                Error::PeerFailed { rank: *rank, peer: *peer, op: op.clone(), reason: reason.clone(), cause: cause.clone() }
            }
            Error::Transport { rank, peer, transport, what } => {
                Error::Transport { rank: *rank, peer: *peer, transport: *transport, what: what.clone() }
            }
            Error::Mismatch { rank, peer, op, what, cause } => {
                Error::Mismatch { rank: *rank, peer: *peer, op: op.clone(), what: what.clone(), cause: cause.clone() }
            }
            Error::Aborted { rank, op, by } => Error::Aborted { rank: *rank, op: op.clone(), by: *by },
            Error::Verbs { rank, what, source } => Error::Verbs { rank: *rank, what: what.clone(), source: source.duplicate() },
            Error::Poisoned { rank, op, first } => Error::Poisoned { rank: *rank, op: op.clone(), first: Box::new(first.duplicate()) },
            Error::PeerLeft { rank, peer, op, how, peer_calls, p2p, cause } => Error::PeerLeft {
                rank: *rank,
                peer: *peer,
                op: op.clone(),
                how: *how,
                peer_calls: *peer_calls,
                p2p: *p2p,
                cause: cause.clone(),
            },
            Error::Finalized { rank, op, world } => Error::Finalized { rank: *rank, op: op.clone(), world: *world },
            Error::Refused { rank, owner, op, reason } => Error::Refused { rank: *rank, owner: *owner, op: op.clone(), reason: *reason },
            Error::LauncherExited { rank, pid } => Error::LauncherExited { rank: *rank, pid: *pid },
        }
    }

    /// Which rank is at fault and what kind of fault it is, as data, on every rank of the
    /// job: the rank that found a fault and every rank it told get the same answer (the
    /// text of each rank's error differs; this does not). `None` for errors that are not a
    /// fault of the job: an invalid argument found before anything went on the wire, a bad
    /// environment, a call after finalize, setup I/O.
    ///
    /// ```
    /// # fn handle(e: ferroccl::Error) {
    /// use ferroccl::FaultKind;
    /// if let Some(c) = e.root_cause() {
    ///     match (c.kind, c.rank) {
    ///         (FaultKind::Failed, Some(r)) => eprintln!("rank {r} died or broke: {}", c.message),
    ///         (FaultKind::Mismatch, Some(r)) => eprintln!("rank {r} called something else: {}", c.message),
    ///         (kind, rank) => eprintln!("{kind:?} at {rank:?}: {}", c.message),
    ///     }
    /// }
    /// # }
    /// ```
    pub fn root_cause(&self) -> Option<RootCause> {
        match self {
            Error::PeerFailed { cause: Some(c), .. } | Error::Mismatch { cause: Some(c), .. } | Error::PeerLeft { cause: Some(c), .. } => {
                Some((**c).clone())
            }
            Error::Poisoned { first, .. } => first.root_cause(),
            Error::PeerFailed { .. }
            | Error::Mismatch { .. }
            | Error::PeerLeft { .. }
            | Error::Transport { .. }
            | Error::Timeout { .. }
            | Error::Aborted { .. }
            | Error::Verbs { .. }
            | Error::Internal { .. }
            | Error::LauncherExited { .. } => Some(Fault::from_error(self, &|r| r).root_cause(self.reporter())),
            _ => None,
        }
    }

    /// The rank that reports this error, where the variant says.
    fn reporter(&self) -> Option<usize> {
        match self {
            Error::PeerFailed { rank, .. }
            | Error::Transport { rank, .. }
            | Error::Mismatch { rank, .. }
            | Error::PeerLeft { rank, .. }
            | Error::Aborted { rank, .. }
            | Error::Verbs { rank, .. }
            | Error::Poisoned { rank, .. }
            | Error::Finalized { rank, .. }
            | Error::Refused { rank, .. }
            | Error::LauncherExited { rank, .. } => Some(*rank),
            Error::Timeout { rank, .. } | Error::Internal { rank, .. } => *rank,
            _ => None,
        }
    }

    /// `self` with `cause` attached as its root cause, where the variant keeps one and has
    /// none yet.
    pub(crate) fn with_cause(mut self, c: RootCause) -> Error {
        match &mut self {
            Error::PeerFailed { cause, .. } | Error::Mismatch { cause, .. } | Error::PeerLeft { cause, .. } if cause.is_none() => {
                *cause = Some(Box::new(c));
            }
            Error::Internal { rank, .. } if rank.is_none() => *rank = c.rank,
            _ => {}
        }
        self
    }

    /// `self` with the processes behind its root cause named (`who`: a world rank's
    /// process), where the variant keeps a root cause (one is attached if it has none
    /// yet), and in the first error of a [`Error::Poisoned`].
    pub(crate) fn identify(self, who: &dyn Fn(usize) -> Option<Process>) -> Error {
        match self {
            Error::Poisoned { rank, op, first } => Error::Poisoned { rank, op, first: Box::new(first.identify(who)) },
            e @ (Error::PeerFailed { .. } | Error::Mismatch { .. } | Error::PeerLeft { .. }) => {
                let cause = e.root_cause();
                let mut e = match cause {
                    Some(c) => e.with_cause(c),
                    None => e,
                };
                if let Error::PeerFailed { cause: Some(c), .. }
                | Error::Mismatch { cause: Some(c), .. }
                | Error::PeerLeft { cause: Some(c), .. } = &mut e
                {
                    c.identify(who);
                }
                e
            }
            e => e,
        }
    }

    /// Shorthand for [`Error::Protocol`].
    pub(crate) fn protocol(peer: impl Into<String>, what: impl Into<String>) -> Self {
        Error::Protocol { peer: peer.into(), what: what.into() }
    }
}
