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
        }
    }

    /// Shorthand for [`Error::Protocol`].
    pub(crate) fn protocol(peer: impl Into<String>, what: impl Into<String>) -> Self {
        Error::Protocol { peer: peer.into(), what: what.into() }
    }
}
