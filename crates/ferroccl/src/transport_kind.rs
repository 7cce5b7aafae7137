//! The transports by name: which one carries the traffic to a peer
//! ([`Communicator::transport_to`](crate::Communicator::transport_to)) and which one an
//! [`Error::Transport`](crate::Error::Transport) is about. It sits below every other module
//! (errors name it), apart from the transports themselves (`crate::transport`).

use std::fmt;

/// A transport, as mesh setup chooses one per peer.
///
/// ```
/// use ferroccl::TransportKind;
/// assert_eq!(TransportKind::Shm.to_string(), "shm");
/// assert_eq!(format!("{:>5}", TransportKind::Tcp), "  tcp");
/// ```
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TransportKind {
    /// Shared memory, between ranks on the same host.
    Shm,
    /// TCP sockets.
    Tcp,
    /// RDMA verbs (the `verbs` cargo feature).
    Verbs,
}

impl TransportKind {
    /// `"shm"`, `"tcp"` or `"verbs"`, as `FERROCCL_TRANSPORT` spells it (and as it displays).
    pub const fn name(self) -> &'static str {
        match self {
            TransportKind::Shm => "shm",
            TransportKind::Tcp => "tcp",
            TransportKind::Verbs => "verbs",
        }
    }
}

impl fmt::Display for TransportKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}
