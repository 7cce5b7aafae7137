//! The setup contract (NCCL's `canConnect` / `connect`, gloo's device and pair): what every
//! transport offers mesh setup (`crate::mesh`), which drives them all alike, in the order
//! of [`TRANSPORTS`]:
//!
//! 1. **Open** ([`Transport::open`]): this rank's side, made before anything is published
//!    (shm's inbox segment, tcp's listener, verbs' device with a queue pair and eager ring
//!    per other rank), and the transport's part of this rank's [`Descriptor`]; all
//!    descriptors are exchanged in one all-gather.
//! 2. **Can connect** ([`Transport::can_connect`]): whether the transport reaches a peer,
//!    decided from this rank's descriptor and the peer's alone, so both ends decide alike.
//!    Mesh setup asks the transports in [`TRANSPORTS`] order (restricted by
//!    `FERROCCL_TRANSPORT`, [`Transport::allowed`]) and takes the first that can; the
//!    reason a transport cannot is the error when none is left.
//! 3. **Connect** ([`Setup::connect`], given the peers chosen for it and a [`SetupCx`]):
//!    the endpoints to those peers ([`Connected`]), and the [`Net`] the transport keeps for
//!    all of them (polled by the fabric's progress).
//!
//! What a transport needs from above while it connects comes through [`SetupCx`]: the
//! descriptors, the inbox to deliver into, a [`Handshake`] for new connections (the job's
//! token belongs to the bootstrap) and a [`SetupExchange`] for a round after the
//! descriptors (verbs' ready mark); no transport touches the store or the token.

use std::net::{IpAddr, TcpStream};
use std::sync::Arc;
use std::time::Instant;

use ferroccl_mem::process::ProcessWatch;

use crate::error::{Error, Result};
use crate::inbox::{Bell, Inbox};
use crate::params::{Params, TransportChoice};
use crate::transport::{shm, tcp, verbs, Descriptor, Endpoint, Net, TransportKind};

/// The transports, in mesh setup's order of preference: the first that `FERROCCL_TRANSPORT`
/// allows and that can reach a peer carries its traffic. Every rank opens, chooses and
/// connects in this order. A new transport is one more entry here.
pub(crate) const TRANSPORTS: [&dyn Transport; 3] = [&shm::Shm, &verbs::Verbs, &tcp::Tcp];

/// One transport as mesh setup sees it before any peer is connected.
pub(crate) trait Transport: Sync {
    /// Which transport it is (for reports, errors and `FERROCCL_TRANSPORT`).
    fn kind(&self) -> TransportKind;

    /// Whether `choice` (`FERROCCL_TRANSPORT`) lets it carry the traffic between two ranks
    /// (`same_host`: on one host). By default `auto` allows every transport and a named
    /// choice only itself.
    fn allowed(&self, choice: TransportChoice, same_host: bool) -> bool {
        let _ = same_host;
        choice.named().is_none_or(|k| k == self.kind())
    }

    /// Opens this rank's side and writes the transport's part of this rank's descriptor
    /// (`me`). Called only when [`Transport::allowed`] lets it carry some peer's traffic and
    /// there are other ranks. An `Err` ends setup at once; [`Opened::Failed`] ends it once
    /// the descriptors are exchanged (the descriptor says why, so the peers fail at once
    /// too, naming this rank).
    fn open(&self, cx: &OpenCx<'_>, me: &mut Descriptor) -> Result<Opened>;

    /// Whether it reaches `peer`, from this rank's descriptor (`me`) and the peer's alone:
    /// both ends of a pair get the same answer. `Err` says why not, in words that may follow
    /// "FERROCCL_TRANSPORT=... but" (mesh setup reports it when no other transport is
    /// allowed or able).
    fn can_connect(&self, me: &Descriptor, peer: &Descriptor) -> std::result::Result<(), String>;
}

/// What a transport's [`Transport::open`] is given.
#[derive(Debug)]
pub(crate) struct OpenCx<'a> {
    pub(crate) rank: usize,
    pub(crate) size: usize,
    pub(crate) params: &'a Params,
    /// The address this rank reaches the job's store from (tcp listens on its interface).
    pub(crate) store_ip: IpAddr,
    /// `FERROCCL_TRANSPORT` names this transport: failing to open it is an error.
    pub(crate) required: bool,
}

/// What [`Transport::open`] made.
#[derive(Debug)]
pub(crate) enum Opened {
    /// Nothing (not available here, and not required): its descriptor part says so.
    No,
    /// This rank's side, to connect the peers chosen for it.
    Yes(Box<dyn Setup>),
    /// It was required and failed: the error ends setup once the descriptors (which say
    /// why) are exchanged.
    Failed(Error),
}

/// This rank's open side of one transport while the mesh is built.
pub(crate) trait Setup: std::fmt::Debug + Send {
    /// The doorbell the inbox rings, if this transport's peers must reach it through shared
    /// memory (shm: a word in the inbox segment). The first transport that has one gives it.
    fn bell(&self) -> Option<Bell> {
        None
    }

    /// Connects `peers` (world ranks, never empty), the same order on every rank: what the
    /// transport keeps for all of them, and the endpoints.
    fn connect(self: Box<Self>, cx: &SetupCx<'_>, peers: &[usize]) -> Result<(Box<dyn Net>, Connected)>;

    /// No peer was chosen for it: let go of what was opened (shm closes its segment's
    /// descriptor, so that nobody can open it).
    fn unused(self: Box<Self>) {}
}

/// What mesh setup lends a transport while it connects.
pub(crate) struct SetupCx<'a> {
    pub(crate) rank: usize,
    pub(crate) size: usize,
    pub(crate) deadline: Instant,
    /// Every rank's descriptor, ours included (`descs[rank]`).
    pub(crate) descs: &'a [Descriptor],
    /// Where the endpoints deliver.
    pub(crate) inbox: &'a Arc<Inbox>,
    /// Authenticates new connections (tcp).
    pub(crate) handshake: &'a Arc<dyn Handshake>,
    /// Names this mesh (unique per init in the job): a connecting rank sends it after the
    /// handshake, so that a connection meant for another mesh is dropped.
    pub(crate) mesh_id: &'a str,
    /// Rounds among the peers after the descriptor exchange (verbs' ready mark).
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) exchange: &'a dyn SetupExchange,
    /// Looked at while waiting for a peer (tcp's connects and accepts): its error ends the
    /// setup (a shrink's member died meanwhile; see `FabricConfig::watch`).
    pub(crate) watch: &'a (dyn Fn() -> Result<()> + Sync),
}

/// What a transport's [`Setup::connect`] returns besides its [`Net`].
#[derive(Debug, Default)]
pub(crate) struct Connected {
    /// One endpoint per peer it connected.
    pub(crate) endpoints: Vec<(usize, Arc<dyn Endpoint>)>,
    /// Peer processes to watch (world rank, watch): peers on this host, whose death the
    /// fabric then sees at once instead of through the transport.
    pub(crate) watches: Vec<(usize, ProcessWatch)>,
}

/// How a transport publishes a value to its peers after the descriptor exchange, and
/// collects theirs (mesh setup implements it over the job's store). `topic` names the
/// round; every rank publishes once per topic.
#[cfg_attr(not(feature = "verbs"), allow(dead_code))]
pub(crate) trait SetupExchange {
    /// Publishes this rank's value for `topic`.
    fn publish(&self, topic: &str, value: &[u8]) -> Result<()>;
    /// Waits (until `deadline`) for the values `peers` published for `topic`, in order.
    fn gather(&self, topic: &str, peers: &[usize], deadline: Instant) -> Result<Vec<Vec<u8>>>;
}

/// The job's handshake on a new connection: each end proves it knows the job's token
/// (mesh setup implements it over the bootstrap's authentication). Shared with the
/// threads that vet incoming connections, hence `Send + Sync`.
pub(crate) trait Handshake: Send + Sync {
    /// On a connection this rank opened to `peer` (named in errors).
    fn connecting(&self, s: &mut TcpStream, peer: &str, deadline: Instant) -> Result<()>;
    /// On a connection this rank accepted from `peer`.
    fn accepting(&self, s: &mut TcpStream, peer: &str, deadline: Instant) -> Result<()>;
}
