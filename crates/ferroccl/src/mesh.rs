//! Mesh setup: what each rank publishes about itself (one packed [`Descriptor`] per rank,
//! one store round trip), the choice of a transport per peer (both sides decide from the
//! same facts), and connecting every endpoint: shm inboxes mapped through the peer's memfd,
//! tcp sockets authenticated with the job's token (the lower rank connects), verbs queue
//! pairs (their own setup data through a [`SetupExchange`] over the store). The result is a
//! [`Mesh`]: one endpoint per peer, and the processes to watch.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferroccl_mem::process::{can_read_process, ProcessWatch};

use crate::bootstrap::auth;
use crate::bootstrap::StoreClient;
use crate::error::{Error, Fault, Op, Result};
use crate::inbox::{Bell, BellWords, Inbox};
use crate::params::{Params, TransportChoice};
use crate::transport::shm::{LocalShm, ShmEndpoint};
use crate::transport::tcp::TcpEndpoint;
use crate::transport::verbs::{VerbsDevice, VerbsEndpoint, VerbsNet};
use crate::transport::{Endpoint, SetupExchange, TransportKind};
use crate::wire::{DResult, Reader, Writer};

/// What each rank publishes about itself, in one packed store value.
#[derive(Debug, Clone)]
struct Descriptor {
    pid: u32,
    host_id: String,
    hostname: String,
    /// The inbox segment's memfd name and descriptor number ("" / 0 when none).
    shm_name: String,
    shm_fd: u32,
    tcp_addr: String,
    probe_addr: u64,
    ring_bytes: u64,
    eager_max: u64,
    /// The RDMA device this rank can use for verbs ("" when none).
    ib_dev: String,
}

impl Descriptor {
    fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        w.u32(self.pid)
            .str(&self.host_id)
            .str(&self.hostname)
            .str(&self.shm_name)
            .u32(self.shm_fd)
            .str(&self.tcp_addr)
            .u64(self.probe_addr)
            .u64(self.ring_bytes)
            .u64(self.eager_max)
            .str(&self.ib_dev);
        w.finish()
    }
    fn decode(b: &[u8]) -> DResult<Descriptor> {
        let mut r = Reader::new(b);
        let d = Descriptor {
            pid: r.u32()?,
            host_id: r.str()?.to_string(),
            hostname: r.str()?.to_string(),
            shm_name: r.str()?.to_string(),
            shm_fd: r.u32()?,
            tcp_addr: r.str()?.to_string(),
            probe_addr: r.u64()?,
            ring_bytes: r.u64()?,
            eager_max: r.u64()?,
            ib_dev: r.str()?.to_string(),
        };
        r.end()?;
        Ok(d)
    }
}

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
}

/// A watched process: a peer on this host (world rank), or the launcher (`None`).
pub(crate) type Watch = (Option<usize>, ProcessWatch);

/// This process's connections to every other rank.
#[derive(Debug)]
pub(crate) struct Mesh {
    rank: usize,
    endpoints: Vec<Option<Endpoint>>,
    local_shm: Option<Arc<LocalShm>>,
    /// The verbs mesh (polled in `progress`), when any peer uses verbs.
    verbs: Option<Arc<VerbsNet>>,
    pub(crate) peers: Vec<PeerInfo>,
    /// shm peers still to greet, and whether each may pull from us.
    hellos: Vec<(usize, bool)>,
    /// Kept alive: peers probe cross-memory attach by reading it.
    _probe: Box<[u8; 64]>,
}

/// Publishes and gathers a transport's own setup data through the job's store, under the
/// init's key prefix (only verbs has any).
#[cfg_attr(not(feature = "verbs"), allow(dead_code))]
struct StoreExchange<'a> {
    store: &'a StoreClient,
    key_prefix: &'a str,
    rank: usize,
}

impl SetupExchange for StoreExchange<'_> {
    fn publish(&self, topic: &str, value: &[u8]) -> Result<()> {
        self.store.set(&format!("{}/{topic}/{}", self.key_prefix, self.rank), value)
    }
    fn gather(&self, topic: &str, peers: &[usize], deadline: Instant) -> Result<Vec<Vec<u8>>> {
        let keys: Vec<String> = peers.iter().map(|p| format!("{}/{topic}/{p}", self.key_prefix)).collect();
        self.store.multi_get(&keys, deadline.saturating_duration_since(Instant::now()))
    }
}

impl Mesh {
    /// Builds the mesh: publishes this rank's descriptor, fetches everyone's in one round
    /// trip, picks a transport per peer and connects shm, verbs and tcp endpoints. Returns
    /// the mesh, the inbox its transports deliver into, and the processes to watch. The shm
    /// greeting ([`Mesh::greet`], [`Mesh::ungreeted`]) is left to the caller, which owns the
    /// wait loop.
    pub(crate) fn connect(
        rank: usize,
        size: usize,
        token: &str,
        params: &Params,
        store: &StoreClient,
        key_prefix: &str,
        deadline: Instant,
    ) -> Result<(Mesh, Arc<Inbox>, Vec<Watch>)> {
        let host_id = host_identity(params);
        let probe = Box::new([0x5au8; 64]);

        // This rank's inbox segment (unless shm is switched off or unavailable).
        let local_shm = if matches!(params.transport, TransportChoice::Auto | TransportChoice::Shm) && size > 1 {
            let name = format!("ferroccl-{}-{}-{}", std::process::id(), rank, unique_suffix());
            match LocalShm::create(&name, rank, size, params.shm_ring_bytes) {
                Ok(s) => Some(Arc::new(s)),
                Err(e) if params.transport == TransportChoice::Shm => {
                    return Err(Error::io(format!("rank {rank}: create shared-memory segment {name}"), e))
                }
                Err(_) => None,
            }
        } else {
            None
        };
        let bell = match &local_shm {
            Some(s) => Bell::Mapped(s.clone() as Arc<dyn BellWords>),
            None => Bell::heap(),
        };
        let inbox = Arc::new(Inbox::new(rank, bell));

        // A listener for tcp peers.
        let listener = if matches!(params.transport, TransportChoice::Auto | TransportChoice::Tcp) && size > 1 {
            let ip: IpAddr = params.socket_addr.unwrap_or_else(|| store.local_addr().ip());
            let l = TcpListener::bind(SocketAddr::new(ip, 0)).map_err(|e| Error::io(format!("rank {rank}: listen on {ip}"), e))?;
            Some(l)
        } else {
            None
        };
        // verbs: FERROCCL_TRANSPORT=verbs needs a usable device; auto uses one if there is.
        // Without one, this rank still publishes its descriptor (with no device) before it
        // fails, so that its peers fail at once too, instead of waiting for it.
        let (ib, ib_err) = match params.transport {
            TransportChoice::Verbs if size > 1 => match VerbsDevice::open(rank, params) {
                Ok(d) => (Some(d), None),
                Err(e) => (None, Some(e)),
            },
            TransportChoice::Auto if size > 1 && ferroccl_verbs::ENABLED => (VerbsDevice::open(rank, params).ok(), None),
            _ => (None, None),
        };
        let me = Descriptor {
            pid: std::process::id(),
            host_id: host_id.clone(),
            hostname: hostname(),
            shm_name: local_shm.as_ref().map(|s| s.name().to_string()).unwrap_or_default(),
            shm_fd: local_shm.as_ref().and_then(|s| s.fd()).and_then(|f| u32::try_from(f).ok()).unwrap_or(0),
            tcp_addr: listener.as_ref().and_then(|l| l.local_addr().ok()).map(|a| a.to_string()).unwrap_or_default(),
            probe_addr: probe.as_ptr() as u64,
            ring_bytes: params.shm_ring_bytes as u64,
            eager_max: params.eager_max as u64,
            ib_dev: ib.as_ref().map(|d| d.name()).unwrap_or_default(),
        };
        store.set(&format!("{key_prefix}/ep/{rank}"), &me.encode())?;
        let keys: Vec<String> = (0..size).map(|r| format!("{key_prefix}/ep/{r}")).collect();
        let left = deadline.saturating_duration_since(Instant::now());
        let raw = store.multi_get(&keys, left)?;
        let mut descs = Vec::with_capacity(size);
        for (r, b) in raw.iter().enumerate() {
            let d = Descriptor::decode(b).map_err(|e| Error::protocol(format!("rank {r}'s descriptor"), e.to_string()))?;
            if d.eager_max != me.eager_max {
                return Err(Error::invalid(format!(
                    "FERROCCL_EAGER_MAX differs between ranks: {} on rank {rank}, {} on rank {r}",
                    me.eager_max, d.eager_max
                )));
            }
            descs.push(d);
        }
        if let Some(e) = ib_err {
            return Err(e);
        }

        let kinds = choose_transports(rank, params, &me, &descs, local_shm.is_some())?;
        let mut endpoints: Vec<Option<Endpoint>> = (0..size).map(|_| None).collect();
        let mut watches: Vec<Watch> = Vec::new();
        let mut hellos = Vec::new();
        for p in 0..size {
            if kinds[p] != Some(TransportKind::Shm) {
                continue;
            }
            let d = &descs[p];
            let local = local_shm.clone().ok_or_else(|| Error::internal("shm peer without a local segment"))?;
            let ep = ShmEndpoint::connect(
                rank,
                p,
                d.pid as i32,
                d.shm_fd as i32,
                &d.shm_name,
                size,
                params.shm_ring_bytes,
                params.shm_inline_max,
                params.shm_cma,
                local,
            )?;
            let watch =
                ProcessWatch::new(d.pid as i32).map_err(|e| Error::io(format!("rank {rank}: watch rank {p} (pid {})", d.pid), e))?;
            watches.push((Some(p), watch));
            let can_pull = params.shm_cma && can_read_process(d.pid as i32, d.probe_addr);
            hellos.push((p, can_pull));
            endpoints[p] = Some(Endpoint::Shm(ep));
        }
        // verbs: one RC queue pair per peer. Peers on this host are watched like shm peers,
        // so that a dead one is noticed without waiting for a work request to fail.
        let verbs_peers: Vec<usize> = (0..size).filter(|&p| kinds[p] == Some(TransportKind::Verbs)).collect();
        let verbs = match ib {
            Some(dev) if !verbs_peers.is_empty() => {
                let exchange = StoreExchange { store, key_prefix, rank };
                Some(VerbsNet::connect(dev, rank, &verbs_peers, &exchange, size, deadline, inbox.clone())?)
            }
            _ => None,
        };
        if let Some(net) = &verbs {
            for &p in &verbs_peers {
                endpoints[p] = Some(Endpoint::Verbs(VerbsEndpoint::new(net.clone(), p)));
                if descs[p].host_id == host_id {
                    if let Ok(w) = ProcessWatch::new(descs[p].pid as i32) {
                        watches.push((Some(p), w));
                    }
                }
            }
        }
        if let Some(pid) = params.launcher_pid {
            if let Ok(w) = ProcessWatch::new(pid) {
                watches.push((None, w));
            }
        }

        // TCP: the lower rank connects, the higher accepts.
        let tcp_peers: Vec<usize> = (0..size).filter(|&p| kinds[p] == Some(TransportKind::Tcp)).collect();
        if !tcp_peers.is_empty() {
            let listener = listener.as_ref().ok_or_else(|| Error::internal("tcp peer without a listener"))?;
            let expect: Vec<usize> = tcp_peers.iter().copied().filter(|&p| p < rank).collect();
            let streams = std::thread::scope(|s| -> Result<Vec<(usize, TcpStream)>> {
                let acceptor = s.spawn(|| accept_peers(listener, rank, &expect, token, key_prefix, deadline));
                let mut out = Vec::new();
                for &p in tcp_peers.iter().filter(|&&p| p > rank) {
                    out.push((p, connect_peer(rank, p, &descs[p].tcp_addr, token, key_prefix, deadline)?));
                }
                let accepted = acceptor.join().map_err(|_| Error::internal("tcp acceptor panicked"))??;
                out.extend(accepted);
                Ok(out)
            })?;
            for (p, stream) in streams {
                endpoints[p] = Some(Endpoint::Tcp(TcpEndpoint::start(rank, p, stream, inbox.clone())?));
            }
        }
        drop(listener);

        let peers = descs.iter().map(|d| PeerInfo { hostname: d.hostname.clone() }).collect();
        let mesh = Mesh { rank, endpoints, local_shm, verbs, peers, hellos, _probe: probe };
        Ok((mesh, inbox, watches))
    }

    /// Says hello to every shm peer: once each has said hello back ([`Mesh::ungreeted`] is
    /// empty), it has mapped our segment, whose descriptor can then go ([`Mesh::withdraw`]).
    pub(crate) fn greet(&self, deadline: Instant, poll: &dyn Fn() -> Result<()>) -> Result<()> {
        for &(p, can_pull) in &self.hellos {
            if let Some(Endpoint::Shm(ep)) = &self.endpoints[p] {
                ep.post_hello(can_pull, deadline, poll)?;
            }
        }
        Ok(())
    }

    /// The shm peers whose hello has not arrived yet.
    pub(crate) fn ungreeted(&self) -> Vec<usize> {
        self.hellos
            .iter()
            .filter(|(p, _)| matches!(&self.endpoints[*p], Some(Endpoint::Shm(ep)) if !ep.hello_received()))
            .map(|(p, _)| *p)
            .collect()
    }

    /// The shm peers (those greeted at setup).
    pub(crate) fn shm_peers(&self) -> Vec<usize> {
        self.hellos.iter().map(|(p, _)| *p).collect()
    }

    /// Closes the descriptor peers open our inbox segment through (the mapping stays).
    pub(crate) fn withdraw(&self) {
        if let Some(s) = &self.local_shm {
            s.withdraw();
        }
    }

    /// The endpoint to world rank `peer`.
    pub(crate) fn endpoint(&self, peer: usize) -> Result<&Endpoint> {
        self.endpoints
            .get(peer)
            .and_then(|e| e.as_ref())
            .ok_or_else(|| Error::invalid(format!("rank {}: no endpoint to rank {peer} (out of range, or itself)", self.rank)))
    }

    /// The endpoint to world rank `peer`, if there is one.
    pub(crate) fn get(&self, peer: usize) -> Option<&Endpoint> {
        self.endpoints.get(peer).and_then(|e| e.as_ref())
    }

    /// The transport to world rank `peer` (`None`: itself, or out of range).
    pub(crate) fn kind(&self, peer: usize) -> Option<TransportKind> {
        self.get(peer).map(Endpoint::kind)
    }

    /// Drains the shm inbox and the verbs completions, handing what arrived to `inbox`. An
    /// error here is fatal for the fabric (recorded in `inbox`).
    pub(crate) fn progress(&self, inbox: &Inbox) -> Result<()> {
        if let Some(v) = &self.verbs {
            // Completions: lands messages and immediates; a failed one fails its peer.
            v.poll()?;
        }
        if let Some(shm) = &self.local_shm {
            // Called on every round of every wait: no allocation here.
            let peers = self.endpoints.iter().enumerate().filter_map(|(p, e)| match e {
                Some(Endpoint::Shm(ep)) => Some((p, ep)),
                _ => None,
            });
            match shm.drain(peers, inbox) {
                // Something arrived: another thread of this process may be waiting for it.
                Ok(true) => inbox.notify(),
                Ok(false) => {}
                Err(e) => {
                    inbox.lock().set_fault(Fault::from_error(&e, &|r| r));
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Whether records wait in our shm rings (looked at before sleeping on the doorbell).
    pub(crate) fn has_pending(&self) -> bool {
        self.local_shm.as_ref().is_some_and(|s| s.has_pending())
    }

    /// Sends `msg` to every peer without waiting (a full ring or a busy socket is skipped),
    /// then breaks every connection off: how a rank that gives up tells its peers why.
    pub(crate) fn tell_all_and_cut(&self, msg: &[u8]) {
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

/// Picks a transport per peer; both sides decide from the same facts.
fn choose_transports(
    rank: usize,
    params: &Params,
    me: &Descriptor,
    descs: &[Descriptor],
    have_shm: bool,
) -> Result<Vec<Option<TransportKind>>> {
    let mut kinds = vec![None; descs.len()];
    for (p, d) in descs.iter().enumerate() {
        if p == rank {
            continue;
        }
        let same_host = d.host_id == me.host_id;
        let shm_ok = same_host && have_shm && !d.shm_name.is_empty();
        let kind = match params.transport {
            TransportChoice::Tcp => TransportKind::Tcp,
            TransportChoice::Shm if shm_ok => TransportKind::Shm,
            TransportChoice::Shm => {
                return Err(Error::Transport {
                    rank,
                    peer: Some(p),
                    transport: TransportKind::Shm,
                    what: if same_host {
                        "FERROCCL_TRANSPORT=shm but it has no shared-memory segment".into()
                    } else {
                        format!("FERROCCL_TRANSPORT=shm but it is on another host ({}, this is {})", d.hostname, me.hostname)
                    },
                })
            }
            TransportChoice::Auto if shm_ok => TransportKind::Shm,
            TransportChoice::Auto if !same_host && !me.ib_dev.is_empty() && !d.ib_dev.is_empty() => TransportKind::Verbs,
            TransportChoice::Auto => TransportKind::Tcp,
            TransportChoice::Verbs if !d.ib_dev.is_empty() => TransportKind::Verbs,
            TransportChoice::Verbs => {
                return Err(Error::Transport {
                    rank,
                    peer: Some(p),
                    transport: TransportKind::Verbs,
                    what: format!(
                        "FERROCCL_TRANSPORT=verbs but rank {p} (on {}) has no usable RDMA device (its own error says why), or FERROCCL_TRANSPORT differs between ranks",
                        d.hostname
                    ),
                })
            }
        };
        if kind == TransportKind::Shm && d.ring_bytes != me.ring_bytes {
            return Err(Error::invalid(format!(
                "FERROCCL_SHM_RING_BYTES differs between ranks: {} on rank {rank}, {} on rank {p}",
                me.ring_bytes, d.ring_bytes
            )));
        }
        if kind == TransportKind::Tcp && d.tcp_addr.is_empty() {
            return Err(Error::Transport {
                rank,
                peer: Some(p),
                transport: TransportKind::Tcp,
                what: "the peer has no tcp listener (FERROCCL_TRANSPORT differs between ranks?)".into(),
            });
        }
        kinds[p] = Some(kind);
    }
    Ok(kinds)
}

fn unique_suffix() -> String {
    let mut b = [0u8; 6];
    let _ = getrandom::fill(&mut b);
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Mesh hello sent by the connecting side after authentication.
fn encode_hello(key_prefix: &str, rank: usize) -> Vec<u8> {
    let mut w = Writer::new();
    w.str(key_prefix).u32(rank as u32);
    w.finish()
}

fn write_frame(s: &mut TcpStream, b: &[u8]) -> std::io::Result<()> {
    s.write_all(&(b.len() as u32).to_le_bytes())?;
    s.write_all(b)
}

fn read_frame(s: &mut TcpStream, max: usize) -> std::io::Result<Vec<u8>> {
    let mut l = [0u8; 4];
    s.read_exact(&mut l)?;
    let n = u32::from_le_bytes(l) as usize;
    if n > max {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("frame of {n} bytes exceeds {max}")));
    }
    let mut b = vec![0u8; n];
    s.read_exact(&mut b)?;
    Ok(b)
}

fn connect_peer(rank: usize, peer: usize, addr: &str, token: &str, key_prefix: &str, deadline: Instant) -> Result<TcpStream> {
    let sa: SocketAddr = addr.parse().map_err(|_| Error::protocol(format!("rank {peer}"), format!("bad tcp address {addr:?}")))?;
    let label = format!("rank {peer} ({addr})");
    let mut s = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(&sa, left.max(Duration::from_millis(1))) {
            Ok(s) => break s,
            Err(e) if Instant::now() < deadline && e.kind() == std::io::ErrorKind::ConnectionRefused => {
                std::thread::sleep(Duration::from_millis(10))
            }
            Err(e) => return Err(Error::io(format!("rank {rank}: connect to {label}"), e)),
        }
    };
    s.set_nodelay(true).map_err(|e| Error::io("set TCP_NODELAY", e))?;
    auth::client_handshake(&mut s, token, "mesh", &label, deadline)?;
    s.set_write_timeout(Some(deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))))
        .map_err(|e| Error::io("set timeout", e))?;
    write_frame(&mut s, &encode_hello(key_prefix, rank)).map_err(|e| Error::io(format!("rank {rank}: hello to {label}"), e))?;
    s.set_read_timeout(None).and_then(|_| s.set_write_timeout(None)).map_err(|e| Error::io("clear timeouts", e))?;
    Ok(s)
}

/// Accepts one authenticated connection from each rank in `expect`. Strangers (wrong token,
/// garbage, unexpected ranks) are dropped and do not disturb the job.
fn accept_peers(
    listener: &TcpListener,
    rank: usize,
    expect: &[usize],
    token: &str,
    key_prefix: &str,
    deadline: Instant,
) -> Result<Vec<(usize, TcpStream)>> {
    let mut got: HashMap<usize, TcpStream> = HashMap::new();
    if expect.is_empty() {
        return Ok(vec![]);
    }
    listener.set_nonblocking(true).map_err(|e| Error::io("listener nonblocking", e))?;
    let (tx, rx) = std::sync::mpsc::channel::<(usize, TcpStream)>();
    {
        while got.len() < expect.len() {
            while let Ok((p, st)) = rx.try_recv() {
                if expect.contains(&p) && !got.contains_key(&p) {
                    got.insert(p, st);
                }
            }
            if got.len() == expect.len() {
                break;
            }
            if Instant::now() >= deadline {
                let missing: Vec<String> = expect.iter().filter(|p| !got.contains_key(p)).map(|p| format!("rank {p}")).collect();
                return Err(Error::Timeout {
                    rank: Some(rank),
                    op: Op::other("tcp mesh accept"),
                    after: Duration::ZERO,
                    waiting_for: missing,
                });
            }
            match listener.accept() {
                Ok((mut st, from)) => {
                    let tx = tx.clone();
                    let (token, key_prefix) = (token.to_string(), key_prefix.to_string());
                    // Detached: a silent stranger must not hold up the job; it is dropped
                    // within a few seconds by its own deadline.
                    std::thread::spawn(move || {
                        // A stranger gets at most a few seconds of our attention.
                        let dl = deadline.min(Instant::now() + Duration::from_secs(5));
                        let _ = st.set_nonblocking(false);
                        let label = format!("{from}");
                        if auth::server_handshake(&mut st, &token, "mesh", &label, dl).is_err() {
                            return;
                        }
                        let _ = st.set_read_timeout(Some(dl.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))));
                        let Ok(b) = read_frame(&mut st, 4096) else { return };
                        let mut r = Reader::new(&b);
                        let (Ok(prefix), Ok(p)) = (r.str(), r.u32()) else { return };
                        if prefix != key_prefix {
                            return;
                        }
                        let _ = st.set_read_timeout(None);
                        let _ = st.set_nodelay(true);
                        let _ = tx.send((p as usize, st));
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(1)),
                Err(e) => return Err(Error::io(format!("rank {rank}: accept"), e)),
            }
        }
    }
    Ok(got.into_iter().collect())
}
