//! tcp's setup: the listener opened before the descriptor exchange ([`TcpSetup`], on the
//! interface [`listen_ip`] picks), and the sockets connected (lower rank) or accepted
//! (higher rank), each through the job's handshake ([`TcpSetup::connect_peers`]).

use super::*;

/// Whether tcp reaches `peer`: both listen (the lower rank of a pair connects to the
/// higher one's listener).
pub(crate) fn can_connect(me: &Descriptor, peer: &Descriptor) -> std::result::Result<(), String> {
    match (&me.tcp, &peer.tcp) {
        (Some(_), Some(_)) => Ok(()),
        (_, None) => Err("the peer has no tcp listener (FERROCCL_TRANSPORT differs between ranks?)".into()),
        (None, Some(_)) => Err("this rank has no tcp listener".into()),
    }
}

/// This rank's side of tcp while the mesh is built: a listener (the descriptor gives its
/// address) and the knobs its endpoints follow.
#[derive(Debug)]
pub(crate) struct TcpSetup {
    pub(super) listener: TcpListener,
    pub(super) knobs: Knobs,
}

/// The knobs of one rank's tcp endpoints (see [`Params`]).
#[derive(Debug, Clone, Copy)]
pub(super) struct Knobs {
    /// `FERROCCL_TCP_SOCKETS`.
    pub(super) sockets: usize,
    /// `FERROCCL_TCP_STRIPE_MIN`.
    pub(super) stripe_min: usize,
    /// `FERROCCL_TCP_ZEROCOPY_MIN`.
    pub(super) zerocopy_min: Option<usize>,
}

/// The address this rank's tcp listener binds and advertises: `FERROCCL_SOCKET_ADDR`, else
/// one of `FERROCCL_SOCKET_IFNAME`'s interfaces ([`pick_interface`]), else `store_side` (this
/// side's address of the connection to the store).
pub(crate) fn listen_ip(params: &Params, store_side: IpAddr) -> Result<IpAddr> {
    if let Some(ip) = params.socket_addr {
        return Ok(ip);
    }
    let Some(filter) = &params.socket_ifname else { return Ok(store_side) };
    let all = ferroccl_mem::interface_addrs().map_err(|e| Error::io("list the network interfaces (FERROCCL_SOCKET_IFNAME)", e))?;
    pick_interface(filter, &all).ok_or_else(|| {
        let have: Vec<String> = all.iter().map(|a| format!("{} {}{}", a.name, a.ip, if a.up { "" } else { " (down)" })).collect();
        Error::Env {
            var: "FERROCCL_SOCKET_IFNAME".into(),
            problem: format!("{filter} matches no interface that is up; this host has: {}", have.join(", ")),
        }
    })
}

/// The address of the first up interface (in the kernel's order) that `filter` selects: its
/// first IPv4 address, else its first IPv6 one.
pub(crate) fn pick_interface(filter: &IfnameFilter, all: &[ferroccl_mem::InterfaceAddr]) -> Option<IpAddr> {
    let first = all.iter().find(|a| a.up && filter.matches(&a.name))?;
    let mine = all.iter().filter(|a| a.name == first.name);
    mine.clone().find(|a| a.ip.is_ipv4()).or_else(|| mine.clone().next()).map(|a| a.ip)
}

impl TcpSetup {
    /// Listens on `ip` (see [`listen_ip`]).
    pub(crate) fn listen(rank: usize, ip: IpAddr, params: &Params) -> Result<TcpSetup> {
        let listener = TcpListener::bind(SocketAddr::new(ip, 0)).map_err(|e| Error::io(format!("rank {rank}: listen on {ip}"), e))?;
        let knobs =
            Knobs { sockets: params.tcp_sockets.clamp(1, 255), stripe_min: params.tcp_stripe_min, zerocopy_min: params.tcp_zerocopy_min };
        Ok(TcpSetup { listener, knobs })
    }

    /// Our part of the descriptor.
    pub(crate) fn info(&self) -> TcpInfo {
        TcpInfo {
            addr: self.listener.local_addr().map(|a| a.to_string()).unwrap_or_default(),
            sockets: u8::try_from(self.knobs.sockets).unwrap_or(u8::MAX),
        }
    }

    /// Authenticated sockets to every peer in `peers` (chosen for tcp), as many per peer as
    /// the smaller `FERROCCL_TCP_SOCKETS` of the pair: the lower rank of each pair
    /// connects, the higher accepts; both run the job's handshake, then the connecting side
    /// names the mesh, its rank and the socket's place. The listener closes when this
    /// returns.
    pub(crate) fn connect_peers(self, cx: &SetupCx<'_>, peers: &[usize]) -> Result<(TcpNet, Connected)> {
        let rank = cx.rank;
        let lanes = |p: usize| cx.descs[p].tcp.as_ref().map_or(1, |t| usize::from(t.sockets).min(self.knobs.sockets).max(1));
        let expect: Vec<(usize, usize)> = peers.iter().copied().filter(|&p| p < rank).map(|p| (p, lanes(p))).collect();
        let (listener, handshake, mesh_id, deadline) = (&self.listener, cx.handshake, cx.mesh_id, cx.deadline);
        let streams = std::thread::scope(|s| -> Result<Vec<(usize, Vec<TcpStream>)>> {
            let watch = cx.watch;
            let acceptor = s.spawn(|| accept_peers(listener, rank, &expect, handshake, mesh_id, deadline, watch));
            let mut out = Vec::new();
            for &p in peers.iter().filter(|&&p| p > rank) {
                let addr = cx.descs[p].tcp.as_ref().map_or("", |t| t.addr.as_str());
                let socks = (0..lanes(p)).map(|lane| connect_peer(cx, p, addr, lane)).collect::<Result<Vec<_>>>()?;
                out.push((p, socks));
            }
            let accepted = acceptor.join().map_err(|_| Error::internal("tcp acceptor panicked"))??;
            out.extend(accepted);
            Ok(out)
        })?;
        let mut connected = Connected::default();
        let drive = Arc::new(Drive::default());
        let mut readings = Vec::new();
        for (p, socks) in streams {
            let stage = stage_len(usize::try_from(cx.descs[rank].eager_max).unwrap_or(MAX_MSG));
            let e = TcpEndpoint::start(rank, p, socks, cx.inbox.clone(), drive.clone(), stage, self.knobs)?;
            readings.push(e.lanes[0].reading.clone());
            connected.endpoints.push((p, Arc::new(e) as Arc<dyn Endpoint>));
        }
        let ready = Ready::new(rank, &readings)?;
        Ok((TcpNet { drive, readings, ready }, connected))
    }
}

/// What the connecting side sends after the handshake: the mesh it means, its rank and the
/// socket's place among the pair's sockets (its lane).
pub(super) fn encode_hello(mesh_id: &str, rank: usize, lane: usize) -> Vec<u8> {
    let mut w = Writer::new();
    w.str(mesh_id).u32(rank as u32).u32(lane as u32);
    w.finish()
}

pub(super) fn write_frame(s: &mut TcpStream, b: &[u8]) -> std::io::Result<()> {
    s.write_all(&(b.len() as u32).to_le_bytes())?;
    s.write_all(b)
}

pub(super) fn read_frame(s: &mut TcpStream, max: usize) -> std::io::Result<Vec<u8>> {
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

pub(super) fn connect_peer(cx: &SetupCx<'_>, peer: usize, addr: &str, lane: usize) -> Result<TcpStream> {
    let (rank, deadline) = (cx.rank, cx.deadline);
    let sa: SocketAddr = addr.parse().map_err(|_| Error::protocol(format!("rank {peer}"), format!("bad tcp address {addr:?}")))?;
    let label = if lane == 0 { format!("rank {peer} ({addr})") } else { format!("rank {peer} ({addr}, socket {lane})") };
    let mut s = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(&sa, left.max(Duration::from_millis(1))) {
            Ok(s) => break s,
            Err(e) if Instant::now() < deadline && e.kind() == std::io::ErrorKind::ConnectionRefused => {
                (cx.watch)()?;
                std::thread::sleep(Duration::from_millis(10))
            }
            Err(e) => return Err(Error::io(format!("rank {rank}: connect to {label}"), e)),
        }
    };
    s.set_nodelay(true).map_err(|e| Error::io("set TCP_NODELAY", e))?;
    cx.handshake.connecting(&mut s, &label, deadline)?;
    s.set_write_timeout(Some(deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))))
        .map_err(|e| Error::io("set timeout", e))?;
    write_frame(&mut s, &encode_hello(cx.mesh_id, rank, lane)).map_err(|e| Error::io(format!("rank {rank}: hello to {label}"), e))?;
    s.set_read_timeout(None).and_then(|_| s.set_write_timeout(None)).map_err(|e| Error::io("clear timeouts", e))?;
    Ok(s)
}

/// Accepts the authenticated connections `expect` lists (a rank and how many sockets it
/// opens). Strangers (wrong token, garbage, unexpected ranks or sockets) are dropped and do
/// not disturb the job. Each rank's sockets in lane order.
pub(super) fn accept_peers(
    listener: &TcpListener,
    rank: usize,
    expect: &[(usize, usize)],
    handshake: &Arc<dyn Handshake>,
    mesh_id: &str,
    deadline: Instant,
    watch: &(dyn Fn() -> Result<()> + Sync),
) -> Result<Vec<(usize, Vec<TcpStream>)>> {
    let mut got: HashMap<(usize, usize), TcpStream> = HashMap::new();
    let want: usize = expect.iter().map(|e| e.1).sum();
    if want == 0 {
        return Ok(vec![]);
    }
    let wanted = |p: usize, lane: usize| expect.iter().any(|&(q, n)| q == p && lane < n);
    listener.set_nonblocking(true).map_err(|e| Error::io("listener nonblocking", e))?;
    let (tx, rx) = std::sync::mpsc::channel::<((usize, usize), TcpStream)>();
    while got.len() < want {
        while let Ok((k, st)) = rx.try_recv() {
            if wanted(k.0, k.1) && !got.contains_key(&k) {
                got.insert(k, st);
            }
        }
        if got.len() == want {
            break;
        }
        if Instant::now() >= deadline {
            let missing: Vec<String> = expect
                .iter()
                .filter(|&&(p, n)| (0..n).any(|l| !got.contains_key(&(p, l))))
                .map(|&(p, n)| if n == 1 { format!("rank {p}") } else { format!("rank {p} ({n} sockets)") })
                .collect();
            return Err(Error::Timeout { rank: Some(rank), op: Op::other("tcp mesh accept"), after: Duration::ZERO, waiting_for: missing });
        }
        match listener.accept() {
            Ok((mut st, from)) => {
                let tx = tx.clone();
                let (handshake, mesh_id) = (handshake.clone(), mesh_id.to_string());
                // Detached: a silent stranger must not hold up the job; it is dropped
                // within a few seconds by its own deadline.
                std::thread::spawn(move || {
                    // A stranger gets at most a few seconds of our attention.
                    let dl = deadline.min(Instant::now() + Duration::from_secs(5));
                    let _ = st.set_nonblocking(false);
                    if handshake.accepting(&mut st, &format!("{from}"), dl).is_err() {
                        return;
                    }
                    let _ = st.set_read_timeout(Some(dl.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))));
                    let Ok(b) = read_frame(&mut st, 4096) else { return };
                    let mut r = Reader::new(&b);
                    let (Ok(id), Ok(p), Ok(lane)) = (r.str(), r.u32(), r.u32()) else { return };
                    if id != mesh_id {
                        return;
                    }
                    let _ = st.set_read_timeout(None);
                    let _ = st.set_nodelay(true);
                    let _ = tx.send(((p as usize, lane as usize), st));
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                watch()?;
                std::thread::sleep(Duration::from_millis(1))
            }
            Err(e) => return Err(Error::io(format!("rank {rank}: accept"), e)),
        }
    }
    let mut out: Vec<(usize, Vec<TcpStream>)> = expect.iter().map(|&(p, _)| (p, Vec::new())).collect();
    for (p, socks) in &mut out {
        let n = expect.iter().find(|e| e.0 == *p).map_or(0, |e| e.1);
        socks.extend((0..n).filter_map(|l| got.remove(&(*p, l))));
    }
    Ok(out)
}

/// The tcp transport: sockets to any rank that listens (see the module docs).
#[derive(Debug)]
pub(crate) struct Tcp;

impl Transport for Tcp {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    /// A listener on the interface that reaches the store (or the one the knobs pick).
    fn open(&self, cx: &OpenCx<'_>, me: &mut Descriptor) -> Result<Opened> {
        let ip = listen_ip(cx.params, cx.store_ip)?;
        crate::logging::flog!(Info, Transport, "rank {}: tcp listens on {ip}", cx.rank);
        let s = TcpSetup::listen(cx.rank, ip, cx.params)?;
        me.tcp = Some(s.info());
        Ok(Opened::Yes(Box::new(s)))
    }

    fn can_connect(&self, me: &Descriptor, peer: &Descriptor) -> std::result::Result<(), String> {
        can_connect(me, peer)
    }
}

impl Setup for TcpSetup {
    fn connect(self: Box<Self>, cx: &SetupCx<'_>, peers: &[usize]) -> Result<(Box<dyn Net>, Connected)> {
        let (net, c) = self.connect_peers(cx, peers)?;
        Ok((Box::new(net), c))
    }
}
