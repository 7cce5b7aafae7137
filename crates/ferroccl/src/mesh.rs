//! Mesh setup: every rank opens its transports' local sides, publishes one packed
//! [`Descriptor`] (one store round trip for everyone's), chooses a transport per peer by
//! asking the transports, in order of preference, whether they can reach it (both sides
//! decide from the same two descriptors), and lets each transport connect the peers chosen
//! for it. The result is a [`Mesh`]: one endpoint per peer, what the transports keep for
//! all their peers, and the processes to watch. See `crate::transport` for the setup
//! contract.

use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferroccl_mem::process::ProcessWatch;

use crate::bootstrap::auth;
use crate::bootstrap::StoreClient;
use crate::error::{Error, Result};
use crate::inbox::{Bell, Inbox};
use crate::params::{Params, TransportChoice};
use crate::transport::{
    Descriptor, DriveGuard, Endpoint, Handshake, Net, OpenCx, Opened, Paused, RemoteMemory, SetupCx, SetupExchange, TransportKind,
    VerbsInfo, TRANSPORTS,
};

/// This host's identity: ranks with equal ids use shared memory. Same boot, same mount
/// namespace (so the same /dev/shm) and same pid namespace (so pids mean the same process).
pub(crate) fn host_identity(params: &Params) -> String {
    if let Some(h) = &params.host_id {
        return h.clone();
    }
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let ns = |n: &str| std::fs::read_link(format!("/proc/self/ns/{n}")).map(|p| p.display().to_string()).unwrap_or_default();
    format!("{}/{}/{}", boot.trim(), ns("mnt"), ns("pid"))
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|s| s.trim().to_string()).unwrap_or_else(|_| "?".into())
}

/// Per-peer facts for reporting.
#[derive(Debug, Clone)]
pub(crate) struct PeerInfo {
    pub(crate) hostname: String,
    /// Its process id (meaningful on its host).
    pub(crate) pid: u32,
    /// Its host's identity (see [`host_identity`]): equal to ours, its pid is one we can watch.
    pub(crate) host_id: String,
}

/// A watched process: a peer on this host (world rank), or the launcher (`None`).
pub(crate) type Watch = (Option<usize>, ProcessWatch);

/// This process's connections to every other rank.
#[derive(Debug)]
pub(crate) struct Mesh {
    rank: usize,
    endpoints: Vec<Option<Arc<dyn Endpoint>>>,
    /// What each transport that carries a peer keeps for all its peers (polled in
    /// `progress`), in [`TRANSPORTS`] order.
    nets: Vec<Box<dyn Net>>,
    pub(crate) peers: Vec<PeerInfo>,
}

/// Publishes and gathers a transport's values after the descriptor exchange through the
/// job's store, under the init's key prefix (verbs' ready mark).
#[cfg_attr(not(feature = "verbs"), allow(dead_code))]
struct StoreExchange<'a> {
    store: &'a StoreClient,
    key_prefix: &'a str,
    rank: usize,
    watch: &'a (dyn Fn() -> Result<()> + Sync),
}

impl SetupExchange for StoreExchange<'_> {
    fn publish(&self, topic: &str, value: &[u8]) -> Result<()> {
        self.store.set(&format!("{}/{topic}/{}", self.key_prefix, self.rank), value)
    }
    fn gather(&self, topic: &str, peers: &[usize], deadline: Instant) -> Result<Vec<Vec<u8>>> {
        let keys: Vec<String> = peers.iter().map(|p| format!("{}/{topic}/{p}", self.key_prefix)).collect();
        multi_get_watched(self.store, &keys, deadline, self.watch)
    }
}

/// How long one store wait of setup lasts before `watch` is looked at again.
const WATCH_EVERY: Duration = Duration::from_millis(50);

/// The values of `keys`, waiting for them until `deadline`, with `watch` looked at every
/// [`WATCH_EVERY`] meanwhile (its error ends the wait: a peer known dead will never set
/// its key).
fn multi_get_watched(store: &StoreClient, keys: &[String], deadline: Instant, watch: &dyn Fn() -> Result<()>) -> Result<Vec<Vec<u8>>> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match store.multi_get(keys, left.min(WATCH_EVERY)) {
            Err(Error::Timeout { .. }) if left > WATCH_EVERY => watch()?,
            r => return r,
        }
    }
}

/// The job's token handshake (`bootstrap::auth`, context "mesh"), lent to tcp.
struct TokenHandshake {
    token: String,
}

impl Handshake for TokenHandshake {
    fn connecting(&self, s: &mut TcpStream, peer: &str, deadline: Instant) -> Result<()> {
        auth::client_handshake(s, &self.token, "mesh", peer, deadline)
    }
    fn accepting(&self, s: &mut TcpStream, peer: &str, deadline: Instant) -> Result<()> {
        auth::server_handshake(s, &self.token, "mesh", peer, deadline)
    }
}

impl Mesh {
    /// Builds the mesh: opens the local side of each transport `FERROCCL_TRANSPORT` allows,
    /// publishes this rank's descriptor, fetches everyone's in one round trip, picks a
    /// transport per peer and lets shm, verbs and tcp connect theirs. Returns the mesh, the
    /// inbox its transports deliver into, and the processes to watch. The shm greeting
    /// ([`Mesh::greet`], [`Mesh::ungreeted`]) is left to the caller, which owns the wait
    /// loop. `watch` is looked at while waiting for the peers: its error ends the setup.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn connect(
        rank: usize,
        size: usize,
        token: &str,
        params: &Params,
        store: &StoreClient,
        key_prefix: &str,
        deadline: Instant,
        watch: &(dyn Fn() -> Result<()> + Sync),
    ) -> Result<(Mesh, Arc<Inbox>, Vec<Watch>)> {
        let choice = params.transport;
        // Open the local side of each transport `FERROCCL_TRANSPORT` allows (with any peer).
        let mut me = Descriptor {
            rank: rank as u32,
            pid: std::process::id(),
            host_id: host_identity(params),
            hostname: hostname(),
            eager_max: params.eager_max as u64,
            shm: None,
            tcp: None,
            verbs: VerbsInfo::Off,
        };
        let mut setups = Vec::with_capacity(TRANSPORTS.len());
        let mut failed = None;
        for t in TRANSPORTS {
            if size < 2 || !(t.allowed(choice, false) || t.allowed(choice, true)) {
                setups.push(None);
                continue;
            }
            let cx = OpenCx { rank, size, params, store_ip: store.local_addr().ip(), required: choice.named() == Some(t.kind()) };
            setups.push(match t.open(&cx, &mut me)? {
                Opened::Yes(s) => Some(s),
                Opened::No => None,
                // Published first (the descriptor says why), so that the peers fail at once.
                Opened::Failed(e) => {
                    failed.get_or_insert(e);
                    None
                }
            });
        }
        // The inbox rings the doorbell a transport gives (shm's, in its segment, so that
        // peers on this host can wake us), else one on the heap.
        let bell = setups.iter().flatten().find_map(|s| s.bell());
        let inbox = Arc::new(Inbox::new(rank, bell.unwrap_or_else(Bell::heap)));
        store.set(&format!("{key_prefix}/ep/{rank}"), &me.encode())?;
        let keys: Vec<String> = (0..size).map(|r| format!("{key_prefix}/ep/{r}")).collect();
        let raw = multi_get_watched(store, &keys, deadline, watch)?;
        let mut descs = Vec::with_capacity(size);
        for (r, b) in raw.iter().enumerate() {
            let d = Descriptor::decode(b).map_err(|e| Error::protocol(format!("rank {r}'s descriptor"), e.to_string()))?;
            if d.rank as usize != r {
                return Err(Error::protocol(format!("rank {r}'s descriptor"), format!("it says rank {}", d.rank)));
            }
            if d.eager_max != me.eager_max {
                return Err(Error::invalid(format!(
                    "FERROCCL_EAGER_MAX differs between ranks: {} on rank {rank}, {} on rank {r}",
                    me.eager_max, d.eager_max
                )));
            }
            descs.push(d);
        }
        if let Some(e) = failed {
            return Err(e);
        }

        let chosen = choose_transports(rank, choice, &descs)?;
        let handshake: Arc<dyn Handshake> = Arc::new(TokenHandshake { token: token.to_string() });
        let exchange = StoreExchange { store, key_prefix, rank, watch };
        let cx = SetupCx {
            rank,
            size,
            deadline,
            descs: &descs,
            inbox: &inbox,
            handshake: &handshake,
            mesh_id: key_prefix,
            exchange: &exchange,
            watch,
        };
        let mut endpoints: Vec<Option<Arc<dyn Endpoint>>> = (0..size).map(|_| None).collect();
        let mut watches: Vec<Watch> = Vec::new();
        let mut nets = Vec::new();
        // In `TRANSPORTS` order, the same on every rank (shm, then verbs, whose ready round
        // waits in the store for every verbs peer, then tcp, where the lower rank connects
        // and the higher accepts).
        for (i, (t, setup)) in TRANSPORTS.iter().zip(setups).enumerate() {
            let peers: Vec<usize> = (0..size).filter(|&p| chosen[p] == Some(i)).collect();
            match setup {
                Some(s) if !peers.is_empty() => {
                    let (net, c) = s.connect(&cx, &peers)?;
                    for (p, e) in c.endpoints {
                        endpoints[p] = Some(e);
                    }
                    watches.extend(c.watches.into_iter().map(|(p, w)| (Some(p), w)));
                    nets.push(net);
                }
                // No peer for it: nobody opens what it opened (the inbox keeps shm's
                // segment for its doorbell).
                Some(s) => s.unused(),
                None if !peers.is_empty() => return Err(Error::internal(format!("{} peers without a local side", t.kind()))),
                None => {}
            }
        }
        if let Some(pid) = params.launcher_pid {
            if let Ok(w) = ProcessWatch::new(pid) {
                watches.push((None, w));
            }
        }

        let peers = descs.iter().map(|d| PeerInfo { hostname: d.hostname.clone(), pid: d.pid, host_id: d.host_id.clone() }).collect();
        let mesh = Mesh { rank, endpoints, nets, peers };
        Ok((mesh, inbox, watches))
    }

    /// Says hello to every peer that must answer before setup ends (shm's: once each has
    /// said hello back, [`Mesh::ungreeted`] is empty, it has mapped our segment, whose
    /// descriptor can then go, [`Mesh::withdraw`]).
    pub(crate) fn greet(&self, deadline: Instant, poll: &dyn Fn() -> Result<()>) -> Result<()> {
        self.nets.iter().try_for_each(|n| n.greet(deadline, poll))
    }

    /// The peers whose hello has not arrived yet.
    pub(crate) fn ungreeted(&self) -> Vec<usize> {
        self.nets.iter().flat_map(|n| n.ungreeted()).collect()
    }

    /// The peers on this host that share memory with this process (shm's, greeted at setup).
    pub(crate) fn shm_peers(&self) -> Vec<usize> {
        self.nets.iter().flat_map(|n| n.local_peers()).collect()
    }

    /// Closes what peers opened our side through (shm's segment descriptor; the mapping
    /// stays).
    pub(crate) fn withdraw(&self) {
        self.nets.iter().for_each(|n| n.withdraw());
    }

    /// The endpoint to world rank `peer`.
    pub(crate) fn endpoint(&self, peer: usize) -> Result<&dyn Endpoint> {
        self.get(peer).ok_or_else(|| Error::invalid(format!("rank {}: no endpoint to rank {peer} (out of range, or itself)", self.rank)))
    }

    /// The endpoint to world rank `peer`, if there is one.
    pub(crate) fn get(&self, peer: usize) -> Option<&dyn Endpoint> {
        self.endpoints.get(peer).and_then(|e| e.as_deref())
    }

    /// Registration with the device of the transport whose peers reach this rank's memory
    /// on their own (verbs), when any peer is reached over one.
    pub(crate) fn remote_memory(&self) -> Option<Arc<dyn RemoteMemory>> {
        self.nets.iter().find_map(|n| n.remote_memory())
    }

    /// The transport to world rank `peer` (`None`: itself, or out of range).
    pub(crate) fn kind(&self, peer: usize) -> Option<TransportKind> {
        self.get(peer).map(|e| e.kind())
    }

    /// Lands what arrived over every transport (shm's rings, verbs' completions, tcp's
    /// sockets in a thread that drives), handing it to `inbox`. Called on every round of
    /// every wait: no allocation here. An error here is fatal for the fabric (recorded in
    /// `inbox`).
    pub(crate) fn progress(&self, inbox: &Inbox) -> Result<()> {
        for n in &self.nets {
            n.progress(inbox)?;
        }
        Ok(())
    }

    /// While the guard lives, this thread reads the tcp sockets itself in
    /// [`Mesh::progress`] (no hand-off from a reader thread on the critical path); `None`
    /// without tcp peers. For the thread that drives the engine.
    pub(crate) fn drive_sockets(&self) -> Option<DriveGuard> {
        self.nets.iter().find_map(|n| n.drive())
    }

    /// While the guard lives, this thread (about to sleep) does not read the tcp sockets:
    /// their reader threads do.
    pub(crate) fn pause_sockets(&self) -> Option<Paused<'_>> {
        self.nets.iter().find_map(|n| n.pause())
    }

    /// The first peer on this host that `which` picks (by world rank) and that left last
    /// words (the `ERR` it gave up with), and the words.
    pub(crate) fn last_words(&self, which: impl Fn(usize) -> bool) -> Option<(usize, Vec<u8>)> {
        self.nets.iter().find_map(|n| n.last_words(&which))
    }

    /// Whether something waits to be landed (looked at before sleeping on the doorbell).
    pub(crate) fn has_pending(&self) -> bool {
        self.nets.iter().any(|n| n.has_pending())
    }

    /// The number of ranks (this one included).
    pub(crate) fn size(&self) -> usize {
        self.endpoints.len()
    }

    /// Sends `msg` to each of `peers` (world ranks), waiting a little (50 ms in all) for a
    /// full ring or a busy socket, then skipping it: how a rank tells the peers a fault
    /// concerns about it without breaking the connections other communicators share.
    pub(crate) fn tell(&self, peers: impl Iterator<Item = usize>, msg: &[u8]) {
        let deadline = Instant::now() + Duration::from_millis(50);
        for p in peers {
            let Some(e) = self.get(p) else { continue };
            loop {
                match e.try_post_send_now(msg, deadline) {
                    Ok(false) if Instant::now() < deadline => std::thread::yield_now(),
                    _ => break,
                }
            }
        }
    }

    /// Breaks the connection to `peer` off (it is dead or gave up on this rank), so that
    /// nothing stays blocked on it.
    pub(crate) fn cut(&self, peer: usize) {
        if let Some(e) = self.get(peer) {
            e.cut();
        }
    }

    /// Sends `msg` to every peer without waiting (a full ring or a busy socket is skipped),
    /// then breaks every connection off: how a rank that gives up tells its peers why.
    pub(crate) fn tell_all_and_cut(&self, msg: &[u8]) {
        // First where no full ring can lose them: shm peers read them before they blame
        // this rank for going silent or away.
        self.nets.iter().for_each(|n| n.leave_last_words(msg));
        let deadline = Instant::now() + Duration::from_millis(200);
        for e in self.endpoints.iter().flatten() {
            let _ = e.try_post_send_now(msg, deadline);
        }
        for e in self.endpoints.iter().flatten() {
            e.cut();
        }
    }

    /// Says goodbye on every connection.
    pub(crate) fn close(&self, deadline: Instant, poll: &dyn Fn() -> Result<()>) {
        for e in self.endpoints.iter().flatten() {
            e.close(deadline, poll);
        }
        self.withdraw();
    }
}

/// Picks a transport per peer: the first of [`TRANSPORTS`] that `choice` allows and that
/// can reach the peer ([`Transport::can_connect`]); its index there. Both sides decide from
/// the same two descriptors. When none is left, the error is the last candidate's reason.
fn choose_transports(rank: usize, choice: TransportChoice, descs: &[Descriptor]) -> Result<Vec<Option<usize>>> {
    let me = &descs[rank];
    let mut chosen = vec![None; descs.len()];
    for (p, d) in descs.iter().enumerate().filter(|&(p, _)| p != rank) {
        let same_host = d.host_id == me.host_id;
        let mut why_not = None;
        for (i, t) in TRANSPORTS.iter().enumerate().filter(|(_, t)| t.allowed(choice, same_host)) {
            match t.can_connect(me, d) {
                Ok(()) => {
                    chosen[p] = Some(i);
                    break;
                }
                Err(why) => why_not = Some((t.kind(), why)),
            }
        }
        if chosen[p].is_none() {
            let (kind, why) = why_not.ok_or_else(|| Error::internal(format!("FERROCCL_TRANSPORT={choice:?} allows no transport")))?;
            let what = match choice {
                TransportChoice::Auto => why,
                _ => format!("FERROCCL_TRANSPORT={kind} but {why}"),
            };
            return Err(Error::Transport { rank, peer: Some(p), transport: kind, what });
        }
    }
    Ok(chosen)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::FaultKind;
    use crate::transport::descriptor::{QpInfo, VerbsReady, QP_CONNECT_LEN};
    use crate::transport::{ShmInfo, TcpInfo};

    /// A descriptor of rank `rank` on host `host`, with shm and tcp, and verbs as given.
    fn desc(rank: u32, host: &str, verbs: VerbsInfo) -> Descriptor {
        Descriptor {
            rank,
            pid: 100 + rank,
            host_id: host.into(),
            hostname: format!("node-{host}"),
            eager_max: 65536,
            shm: Some(ShmInfo { name: format!("seg-{rank}"), fd: 3, probe_addr: 0x1000, ring_bytes: 1 << 20 }),
            tcp: Some(TcpInfo { addr: format!("10.0.0.{rank}:4000"), sockets: 1 }),
            verbs,
        }
    }

    /// The transports chosen, by kind.
    fn kinds(chosen: Vec<Option<usize>>) -> Vec<Option<TransportKind>> {
        chosen.into_iter().map(|c| c.map(|i| TRANSPORTS[i].kind())).collect()
    }

    /// Verbs ready on `rank`, with a queue pair for each of `world` ranks but itself.
    fn ready(rank: u32, world: u32) -> VerbsInfo {
        let qps = (0..world)
            .filter(|&p| p != rank)
            .map(|peer| QpInfo { peer, connect: [0; QP_CONNECT_LEN], ring_addr: 0x2000, ring_rkey: 7 })
            .collect();
        VerbsInfo::Ready(VerbsReady { dev: "rxe0".into(), mtu: 1024, qps })
    }

    #[test]
    fn auto_prefers_shm_on_a_host_and_verbs_across_hosts() {
        let descs = [desc(0, "a", ready(0, 3)), desc(1, "a", ready(1, 3)), desc(2, "b", ready(2, 3))];
        let chosen = kinds(choose_transports(0, TransportChoice::Auto, &descs).expect("auto always finds one"));
        // Without the `verbs` feature, verbs reaches nobody and tcp carries the other host.
        let across = if cfg!(feature = "verbs") { TransportKind::Verbs } else { TransportKind::Tcp };
        assert_eq!(chosen, [None, Some(TransportKind::Shm), Some(across)]);
        // A rank on this host without a segment: tcp, not verbs (auto keeps verbs for other hosts).
        let descs = [desc(0, "a", ready(0, 2)), Descriptor { shm: None, ..desc(1, "a", ready(1, 2)) }];
        assert_eq!(kinds(choose_transports(0, TransportChoice::Auto, &descs).unwrap()), [None, Some(TransportKind::Tcp)]);
    }

    #[test]
    fn a_forced_transport_that_cannot_reach_says_why() {
        let descs = [desc(0, "a", VerbsInfo::Off), desc(1, "b", VerbsInfo::Off)];
        let e = choose_transports(0, TransportChoice::Shm, &descs).expect_err("shm across hosts");
        assert_eq!(
            e.to_string(),
            "rank 0: shm transport to rank 1: FERROCCL_TRANSPORT=shm but it is on another host (node-b, this is node-a)"
        );
        let descs = [desc(0, "a", ready(0, 2)), desc(1, "a", VerbsInfo::Failed("rank 1: no device".into()))];
        let e = choose_transports(0, TransportChoice::Verbs, &descs).expect_err("a peer without verbs");
        let why = if cfg!(feature = "verbs") {
            "rank 1 (on node-a) has no usable RDMA device: rank 1: no device"
        } else {
            "this build lacks the `verbs` cargo feature"
        };
        assert_eq!(e.to_string(), format!("rank 0: verbs transport to rank 1: FERROCCL_TRANSPORT=verbs but {why}"));
        let cause = e.root_cause().expect("a fault of the job");
        assert_eq!((cause.kind, cause.rank), (FaultKind::Failed, Some(1)));
    }

    #[test]
    fn a_transport_error_without_a_peer_is_this_ranks_own() {
        let e = Error::Transport { rank: 1, peer: None, transport: TransportKind::Verbs, what: "port 1 is down".into() };
        assert_eq!(e.to_string(), "rank 1: verbs transport: port 1 is down");
        let cause = e.root_cause().expect("a fault of the job");
        assert_eq!((cause.kind, cause.rank), (FaultKind::Other, Some(1)));
    }
}
