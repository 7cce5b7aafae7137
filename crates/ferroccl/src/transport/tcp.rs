//! TCP transport: authenticated sockets to each peer, one by default
//! (`FERROCCL_TCP_SOCKETS`).
//!
//! Frames are a 40-byte header (kind, immediate, length, registration key, address)
//! followed by the payload. The caller's thread writes frames (under a per-socket lock): a
//! small frame goes in one non-blocking `sendmsg` (header and body gathered), the rest of a
//! large one with waiting. Reading has two roads ([`Drive`]): the thread that drives the
//! engine reads every socket itself with non-blocking `recv`s into a stage (64 KiB, or the
//! largest eager message; with two or more peers only the sockets one `epoll_wait` says
//! have bytes, see [`READY_MIN_PEERS`]) and lands
//! whole frames from it (no hand-off between threads on the critical path: the latency
//! path); while no thread drives (between calls, or while the driver sleeps or blocks in a
//! write), each socket's reader thread does the same, and it also takes every frame larger
//! than the stage, whose body it reads straight into the registered destination (no
//! intermediate copy). Messages go to the fabric's queues; a one-sided write's immediate is
//! reported once it has landed. EOF or an error without a goodbye marks the peer failed,
//! which wakes and fails every waiter.
//!
//! With several sockets to a peer (lanes), lane 0 carries everything above; a one-sided
//! write of at least `FERROCCL_TCP_STRIPE_MIN` bytes is cut into one piece per lane
//! ([`K_STRIPED`] on lane 0, [`K_STRIPE`] on the others), written with non-blocking sends
//! round the lanes (a `poll` when none has room), each piece received in place by its
//! lane's reader thread (lanes 1 and up are never read by drivers: on a host with cores to
//! spare they copy side by side). Lane 0 reports the write's immediate, and reads on, only
//! once every piece has landed, so a message sent after a write is still delivered after
//! it. Close sends a goodbye on every lane; only lane 0's, which follows the peer's last
//! messages, marks the peer closed (another lane's may be read first). With
//! `FERROCCL_TCP_ZEROCOPY_MIN`, write bodies go with `MSG_ZEROCOPY`, and the post returns
//! once the kernel has let go of the source's pages (the peer's ACK).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ferroccl_mem::futex::{futex_wait, futex_wake};

use crate::error::{Error, Op, Result};
use crate::inbox::Inbox;
use crate::params::{IfnameFilter, Params};
use crate::transport::{row_imm, Connected, Descriptor, Endpoint, Handshake, SetupCx, TcpInfo, TransportKind, WriteReq};
use crate::wire::{Reader, Writer};

const HDR: usize = 40;
const K_MSG: u8 = 1;
const K_WRITE: u8 = 2;
const K_BYE: u8 = 3;
/// A strided write: `len` bytes in rows of the u32 at header byte 32, landing the u32 at
/// byte 36 apart from `addr` on; every row's immediate is reported (`row_imm`).
const K_WRITE_ROWS: u8 = 4;
/// The first piece of a striped write (on lane 0): lands like `K_WRITE`; the u32 at byte 32
/// numbers the write, the u32 at byte 36 says how many pieces (`K_STRIPE`) went on the
/// other lanes. Its immediate is reported, and lane 0 reads on, once they have all landed.
const K_STRIPED: u8 = 5;
/// Another piece of a striped write (lanes 1 and up, the only kind they carry besides
/// `K_BYE`): lands like `K_WRITE`, numbered by the u32 at byte 32, no immediate of its own.
const K_STRIPE: u8 = 6;
/// Largest two-sided message on tcp.
const MAX_MSG: usize = 4 << 20;
/// Rows shorter than this are gathered into batches of up to this many bytes before they
/// go into the socket (one system call per batch, not per row).
const GATHER_MAX: usize = 256 << 10;

/// The little-endian u32 at `h[at..at + 4]`.
fn u32_at(h: &[u8; HDR], at: usize) -> u32 {
    u32::from_le_bytes([h[at], h[at + 1], h[at + 2], h[at + 3]])
}

/// The little-endian u64 at `h[at..at + 8]`.
fn u64_at(h: &[u8; HDR], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&h[at..at + 8]);
    u64::from_le_bytes(a)
}

fn header(kind: u8, imm: u32, len: u64, key: u64, addr: u64) -> [u8; HDR] {
    let mut h = [0u8; HDR];
    h[0] = kind;
    h[4..8].copy_from_slice(&imm.to_le_bytes());
    h[8..16].copy_from_slice(&len.to_le_bytes());
    h[16..24].copy_from_slice(&key.to_le_bytes());
    h[24..32].copy_from_slice(&addr.to_le_bytes());
    h
}

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
    listener: TcpListener,
    knobs: Knobs,
}

/// The knobs of one rank's tcp endpoints (see [`Params`]).
#[derive(Debug, Clone, Copy)]
struct Knobs {
    /// `FERROCCL_TCP_SOCKETS`.
    sockets: usize,
    /// `FERROCCL_TCP_STRIPE_MIN`.
    stripe_min: usize,
    /// `FERROCCL_TCP_ZEROCOPY_MIN`.
    zerocopy_min: Option<usize>,
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
    pub(crate) fn connect(self, cx: &SetupCx<'_>, peers: &[usize]) -> Result<(TcpNet, Connected)> {
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
            connected.endpoints.push((p, Endpoint::Tcp(e)));
        }
        let ready = Ready::new(rank, &readings)?;
        Ok((TcpNet { drive, readings, ready }, connected))
    }
}

/// What the connecting side sends after the handshake: the mesh it means, its rank and the
/// socket's place among the pair's sockets (its lane).
fn encode_hello(mesh_id: &str, rank: usize, lane: usize) -> Vec<u8> {
    let mut w = Writer::new();
    w.str(mesh_id).u32(rank as u32).u32(lane as u32);
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

fn connect_peer(cx: &SetupCx<'_>, peer: usize, addr: &str, lane: usize) -> Result<TcpStream> {
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
fn accept_peers(
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

/// What writes the body of a frame through the `put` it is given (see
/// [`TcpEndpoint::send_frame_locked`]).
type Body<'a> = &'a mut dyn FnMut(&mut dyn FnMut(&[u8]) -> std::io::Result<()>) -> std::io::Result<()>;

/// What the mesh keeps of its tcp side: whoever drives the engine reads every socket
/// through it (see [`Drive`]).
#[derive(Debug)]
pub(crate) struct TcpNet {
    drive: Arc<Drive>,
    readings: Vec<Arc<Reading>>,
    /// Which sockets have something to read, when there are enough to ask (see [`Ready`]).
    ready: Option<Ready>,
}

/// Sockets a driver asks about, from this many peers up: one `epoll_wait` says which have
/// bytes (without the socket lock a `recv` takes), where a round would otherwise `recv` on
/// every socket. Measured, 4 ranks on 2 CPUs over loopback (3 sockets each), alternated with
/// the build before it, 5-8 rounds: broadcast 8 B - 1 KiB 0.85-0.93x the time, allgather
/// 0.90-0.99x, allreduce 0.92-1.00x: a waiting rank's idle rounds, which take the CPU from
/// the rank it waits for, get cheaper. With one peer a `poll` before the `recv` was 1.08x
/// slower (a second system call per message), so one peer is read as before.
const READY_MIN_PEERS: usize = 2;
/// Ready sockets taken from one `epoll_wait` (more are left for the next round).
const READY_BATCH: usize = 32;

/// An epoll instance over the first socket of every peer whose endpoint has one socket
/// (level-triggered: a socket with unread bytes stays ready). Endpoints with several
/// sockets are pumped every round: lane 0 of a striped write waits for the other lanes'
/// pieces, which no readiness of its own socket announces.
#[derive(Debug)]
struct Ready {
    epoll: std::os::fd::OwnedFd,
    /// Indices (into [`TcpNet::readings`]) pumped every round whatever the epoll says.
    always: Vec<usize>,
}

impl Ready {
    /// `readings`: the first socket of every peer, in [`TcpNet::readings`]'s order.
    fn new(rank: usize, readings: &[Arc<Reading>]) -> Result<Option<Ready>> {
        use rustix::event::epoll;
        if readings.iter().filter(|r| r.lanes == 1).count() < READY_MIN_PEERS {
            return Ok(None);
        }
        let fail = |what: &str, e: rustix::io::Errno| Error::io(format!("rank {rank}: {what}"), std::io::Error::from(e));
        let ep = epoll::create(epoll::CreateFlags::CLOEXEC).map_err(|e| fail("epoll_create", e))?;
        let mut always = Vec::new();
        for (i, r) in readings.iter().enumerate() {
            if r.lanes == 1 {
                let rd = r.rd.lock().unwrap_or_else(|e| e.into_inner());
                epoll::add(&ep, &rd.s, epoll::EventData::new_u64(i as u64), epoll::EventFlags::IN)
                    .map_err(|e| fail(&format!("epoll_ctl for the socket to rank {}", r.peer), e))?;
            } else {
                always.push(i);
            }
        }
        Ok(Some(Ready { epoll: ep, always }))
    }

    /// Calls `f` with the index of every socket that has bytes now (without waiting), then
    /// of every socket read every round.
    fn each(&self, mut f: impl FnMut(usize)) -> rustix::io::Result<()> {
        use rustix::event::epoll;
        let mut events = [const { std::mem::MaybeUninit::<epoll::Event>::uninit() }; READY_BATCH];
        let zero = rustix::time::Timespec { tv_sec: 0, tv_nsec: 0 };
        let (events, _) = epoll::wait(&self.epoll, &mut events, Some(&zero))?;
        for e in events.iter() {
            f(e.data.u64() as usize);
        }
        for &i in &self.always {
            f(i);
        }
        Ok(())
    }
}

impl TcpNet {
    /// This thread reads the sockets in [`TcpNet::progress`] until the guard drops; the
    /// reader threads stand by meanwhile.
    pub(crate) fn drive(&self) -> DriveGuard {
        Drive::enter(&self.drive)
    }

    /// See [`Drive::pause`].
    pub(crate) fn pause(&self) -> Option<Paused<'_>> {
        Drive::pause(&self.drive)
    }

    /// A driver's round: lands what has arrived on every socket, without waiting. Nothing
    /// for a thread that does not drive (the reader threads read for it). Whether
    /// anything arrived.
    pub(crate) fn progress(&self) -> bool {
        if !self.drive.driven_here() {
            return false;
        }
        self.drive.rounds.fetch_add(1, Ordering::Relaxed);
        let mut moved = false;
        if let Some(ready) = &self.ready {
            if ready.each(|i| moved |= self.readings.get(i).is_some_and(|r| r.drive_once())).is_ok() {
                return moved;
            }
            // epoll failed (it should not): ask every socket, as without it.
        }
        for r in &self.readings {
            moved |= r.drive_once();
        }
        moved
    }
}

/// The writing side of a socket.
#[derive(Debug)]
struct Wr {
    s: TcpStream,
    /// `MSG_ZEROCOPY` is enabled on the socket (`FERROCCL_TCP_ZEROCOPY_MIN`).
    zc: bool,
    /// The end of a frame that [`TcpEndpoint::try_post_send_now`] could not write without
    /// waiting: written first by the next send (the stream stays whole).
    tail: Vec<u8>,
}

/// Who reads a mesh's sockets: a thread that drives the engine reads them itself
/// ([`Drive::enter`], then [`TcpEndpoint::drive`] every round: no hand-off between threads
/// on the critical path); while none does, each socket's reader thread reads it. Shared by
/// every tcp endpoint of one mesh and their reader threads.
#[derive(Debug, Default)]
pub(crate) struct Drive {
    /// Low 16 bits: the threads driving now; above: a generation bumped by [`Drive::kick`].
    /// Reader threads sleep on it (a futex word) while a driver reads for them.
    word: AtomicU32,
    /// Bumped on every driving round: a reader thread that sees it stand still for
    /// [`DRIVER_STALL`] reads its socket itself (a driver stuck in something else must not
    /// leave a peer's sends waiting).
    rounds: AtomicU64,
}

const DRIVERS: u32 = 0xffff;
/// How long a driver may go without a round before reader threads read for it.
const DRIVER_STALL: Duration = Duration::from_millis(10);
/// What a reader thread waits at most before it looks at `closing` again.
const READER_NAP: Duration = Duration::from_millis(100);

thread_local! {
    /// The [`Drive`] this thread drives, if any (compared by address).
    static DRIVING: std::cell::Cell<*const Drive> = const { std::cell::Cell::new(std::ptr::null()) };
}

impl Drive {
    /// This thread drives `drive`'s sockets until the guard drops (nested guards for the
    /// same drive are free).
    pub(crate) fn enter(drive: &Arc<Drive>) -> DriveGuard {
        let before = DRIVING.with(|d| d.replace(Arc::as_ptr(drive)));
        if before != Arc::as_ptr(drive) {
            drive.word.fetch_add(1, Ordering::SeqCst);
        }
        DriveGuard { drive: drive.clone(), before }
    }

    /// Whether this thread drives `self`.
    fn driven_here(&self) -> bool {
        DRIVING.with(|d| d.get()) == std::ptr::from_ref(self)
    }

    fn leave(&self) {
        if self.word.fetch_sub(1, Ordering::SeqCst) & DRIVERS == 1 {
            let _ = futex_wake(&self.word, u32::MAX);
        }
    }

    /// Wakes every reader thread (a hand-off, a closing socket).
    fn kick(&self) {
        self.word.fetch_add(DRIVERS + 1, Ordering::SeqCst);
        let _ = futex_wake(&self.word, u32::MAX);
    }

    /// While the returned guard lives, this thread does not drive (it is about to sleep or
    /// block in a write): reader threads read for it.
    pub(crate) fn pause(drive: &Drive) -> Option<Paused<'_>> {
        drive.driven_here().then(|| {
            DRIVING.with(|d| d.set(std::ptr::null()));
            drive.leave();
            Paused { drive }
        })
    }
}

/// See [`Drive::enter`].
#[derive(Debug)]
pub(crate) struct DriveGuard {
    drive: Arc<Drive>,
    before: *const Drive,
}

impl Drop for DriveGuard {
    fn drop(&mut self) {
        let me = Arc::as_ptr(&self.drive);
        if self.before != me {
            DRIVING.with(|d| d.set(self.before));
            // Quietly: waking the reader threads here would cost every call a wakeup of
            // them (on this thread's core when pinned). They look again within
            // `DRIVER_STALL`; the kernel holds what arrives meanwhile.
            self.drive.word.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// See [`Drive::pause`].
#[derive(Debug)]
pub(crate) struct Paused<'a> {
    drive: &'a Drive,
}

impl Drop for Paused<'_> {
    fn drop(&mut self) {
        DRIVING.with(|d| d.set(std::ptr::from_ref(self.drive)));
        self.drive.word.fetch_add(1, Ordering::SeqCst);
    }
}

/// Bytes staged from a socket, at least: frames up to the stage's size (header included)
/// are read with non-blocking `recv`s into the stage and landed from it; a larger frame's
/// body is read straight into its destination by the reader thread. The stage also holds
/// the largest eager message whole ([`stage_len`]): measured, 2 ranks, a 64 KiB allreduce
/// (one eager message each way) took 122 us with a 64 KiB stage (the message handed to the
/// reader thread) and 87 us with 68 KiB; a 256 KiB stage was slower for larger frames than
/// reading them straight into place.
const STAGE_MIN: usize = 64 << 10;
/// What an eager message carries besides its data (its protocol header), at most.
const EAGER_HEADROOM: usize = 4 << 10;

/// The stage of a socket for eager messages of up to `eager_max` bytes.
fn stage_len(eager_max: usize) -> usize {
    (eager_max.min(MAX_MSG) + HDR + EAGER_HEADROOM).max(STAGE_MIN)
}

/// The reading side of a socket.
#[derive(Debug)]
struct Rd {
    s: TcpStream,
    stage: Box<[u8]>,
    /// `stage[lo..hi]`: received, not yet landed (at most the start of one frame once a
    /// pump returns).
    lo: usize,
    hi: usize,
    /// The stream ended (goodbye, failure, a refused write): nothing more is read.
    ended: bool,
    /// A one-sided write larger than the stage whose body is being received in place.
    part: Option<Part>,
    /// Lane 0 only: a striped write whose first piece has landed, waiting for its other
    /// pieces; nothing more is read from this socket meanwhile.
    wait: Option<Wait>,
}

/// A striped write waiting for its pieces on the other lanes (see [`K_STRIPED`]).
#[derive(Debug, Clone, Copy)]
struct Wait {
    id: u32,
    others: u32,
    imm: u32,
}

/// The pieces of striped writes landed on lanes 1 and up, by write number, and a futex
/// word bumped whenever one lands (lane 0's reader thread sleeps on it while it waits).
/// Shared by the lanes of one peer.
#[derive(Debug, Default)]
struct Joined {
    landed: Mutex<HashMap<u32, u32>>,
    gen: AtomicU32,
}

impl Joined {
    fn piece_landed(&self, id: u32) {
        *self.landed.lock().unwrap_or_else(|e| e.into_inner()).entry(id).or_default() += 1;
        self.bump();
    }

    /// Whether all `others` pieces of write `id` have landed (then it is forgotten).
    fn take(&self, id: u32, others: u32) -> bool {
        let mut m = self.landed.lock().unwrap_or_else(|e| e.into_inner());
        if m.get(&id).copied().unwrap_or(0) < others {
            return false;
        }
        m.remove(&id);
        true
    }

    /// Wakes whoever waits for pieces (one landed, or the connection closes).
    fn bump(&self) {
        self.gen.fetch_add(1, Ordering::SeqCst);
        let _ = futex_wake(&self.gen, u32::MAX);
    }
}

/// A one-sided write (`K_WRITE`) being received in place: its header, and the bytes of it
/// landed so far.
#[derive(Debug, Clone, Copy)]
struct Part {
    h: [u8; HDR],
    done: usize,
}

/// What [`Reading::continue_write`] got to.
enum Step {
    /// The write has fully landed.
    Done,
    /// Nothing more has arrived for now (whether anything did before).
    More(bool),
    /// The connection cannot go on.
    Failed,
}

/// What a socket's reader thread and its drivers share.
#[derive(Debug)]
struct Reading {
    peer: usize,
    /// The socket's place among the pair's sockets: lane 0 carries every kind of frame and
    /// is read by drivers too; lanes 1 and up carry pieces of striped writes and are read by
    /// their own reader threads alone (on a host with cores to spare, side by side).
    lane: u32,
    lanes: u32,
    joined: Arc<Joined>,
    rd: Mutex<Rd>,
    /// Set by a driver that met a frame larger than the stage: the reader thread reads it
    /// (blocking, straight into place); drivers leave the socket alone until it is done.
    handoff: AtomicBool,
    inbox: Arc<Inbox>,
    closing: Arc<AtomicBool>,
    drive: Arc<Drive>,
}

/// One of the sockets to a peer (see [`Reading::lane`]).
#[derive(Debug)]
struct Lane {
    writer: Mutex<Wr>,
    /// A handle to shut the socket down without waiting for the writer's lock.
    ctl: TcpStream,
    reading: Arc<Reading>,
    reader: Mutex<Option<JoinHandle<()>>>,
}

/// This rank's sockets to one peer: one, or `FERROCCL_TCP_SOCKETS` lanes that large writes
/// are striped over.
#[derive(Debug)]
pub(crate) struct TcpEndpoint {
    rank: usize,
    peer: usize,
    lanes: Vec<Lane>,
    /// Numbers striped writes (see [`K_STRIPED`]).
    next_stripe: AtomicU32,
    knobs: Knobs,
    inbox: Arc<Inbox>,
    closing: Arc<AtomicBool>,
    /// Set when a frame was cut short by a send timeout: the stream is unusable.
    broken: AtomicBool,
    /// Where [`TcpEndpoint::post_write_rows`] gathers short rows (taken before the writer's
    /// lock, never after it; kept, so a strided write allocates nothing once it has grown).
    gather: Mutex<Vec<u8>>,
}

impl TcpEndpoint {
    /// Starts the endpoint over `streams` (lane 0 first; at least one) and their reader
    /// threads.
    fn start(
        rank: usize,
        peer: usize,
        streams: Vec<TcpStream>,
        inbox: Arc<Inbox>,
        drive: Arc<Drive>,
        stage: usize,
        knobs: Knobs,
    ) -> Result<TcpEndpoint> {
        if streams.is_empty() {
            return Err(Error::internal(format!("rank {rank}: no tcp socket to rank {peer}")));
        }
        let closing = Arc::new(AtomicBool::new(false));
        let joined = Arc::new(Joined::default());
        let n = streams.len() as u32;
        let mut lanes: Vec<Lane> = Vec::with_capacity(streams.len());
        for (lane, stream) in streams.into_iter().enumerate() {
            let clone = || stream.try_clone().map_err(|e| Error::io(format!("rank {rank}: clone socket to rank {peer}"), e));
            let (rd, ctl, watch) = (clone()?, clone()?, clone()?);
            let zc = knobs.zerocopy_min.is_some();
            if zc {
                use std::os::fd::AsFd;
                ferroccl_mem::net::zerocopy_enable(stream.as_fd()).map_err(|e| {
                    Error::io(format!("rank {rank}: enable MSG_ZEROCOPY on the socket to rank {peer} (FERROCCL_TCP_ZEROCOPY_MIN)"), e)
                })?;
            }
            let reading = Arc::new(Reading {
                peer,
                lane: lane as u32,
                lanes: n,
                joined: joined.clone(),
                rd: Mutex::new(Rd {
                    s: rd,
                    // Lanes 1 and up carry pieces of large writes only, received in place.
                    stage: vec![0u8; if lane == 0 { stage } else { STAGE_MIN }].into_boxed_slice(),
                    lo: 0,
                    hi: 0,
                    ended: false,
                    part: None,
                    wait: None,
                }),
                handoff: AtomicBool::new(false),
                inbox: inbox.clone(),
                closing: closing.clone(),
                drive: drive.clone(),
            });
            let r2 = reading.clone();
            let name = if lane == 0 { format!("ferroccl-tcp-{peer}") } else { format!("ferroccl-tcp-{peer}.{lane}") };
            let reader = std::thread::Builder::new()
                .name(name)
                .spawn(move || reader_loop(&r2, &watch))
                .map_err(|e| Error::io("spawn tcp reader thread", e))?;
            lanes.push(Lane { writer: Mutex::new(Wr { s: stream, zc, tail: Vec::new() }), ctl, reading, reader: Mutex::new(Some(reader)) });
        }
        Ok(TcpEndpoint {
            rank,
            peer,
            lanes,
            next_stripe: AtomicU32::new(0),
            knobs,
            inbox,
            closing,
            broken: AtomicBool::new(false),
            gather: Mutex::new(Vec::new()),
        })
    }

    pub(crate) fn max_send(&self) -> usize {
        MAX_MSG
    }

    fn io_err(&self, what: &str, e: std::io::Error, start: Instant) -> Error {
        if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) {
            return Error::Timeout {
                rank: Some(self.rank),
                op: Op::other(format!("tcp {what} to rank {}", self.peer)),
                after: start.elapsed(),
                waiting_for: vec![format!("rank {} (to read its socket)", self.peer)],
            };
        }
        Error::PeerFailed {
            rank: self.rank,
            peer: self.peer,
            op: Op::other(format!("tcp {what}")),
            reason: format!("broke the connection: {e}"),
            cause: None,
        }
    }

    /// Writes one frame under the socket's lock: `first` (the header, and the body when it
    /// is at hand; at most 4 pieces) goes in one non-blocking `sendmsg` when the socket has
    /// room (one system call for a small message); the rest of it, and what `body`
    /// produces, with waiting. The deadline holds for the whole frame (the body is written
    /// in pieces, each with the time that is left). A frame cut short leaves the stream
    /// unusable: the socket is shut down so the peer sees it at once.
    fn send_frame_locked(&self, w: &mut Wr, first: &[&[u8]], body: Option<Body<'_>>, deadline: Instant, what: &str) -> Result<()> {
        use rustix::net::SendFlags;
        if self.broken.load(Ordering::Acquire) {
            return Err(self.unusable());
        }
        let start = Instant::now();
        let Wr { s, tail, .. } = w;
        let total: usize = first.iter().map(|b| b.len()).sum();
        let (mut sent, mut fast_err) = (0usize, None);
        if tail.is_empty() && total > 0 && first.len() <= 4 {
            let iov: [std::io::IoSlice<'_>; 4] = std::array::from_fn(|i| std::io::IoSlice::new(first.get(i).copied().unwrap_or(&[])));
            match rustix::net::sendmsg(&*s, &iov[..first.len()], &mut Default::default(), SendFlags::DONTWAIT | SendFlags::NOSIGNAL) {
                Ok(k) => sent = k,
                Err(e) if e == rustix::io::Errno::AGAIN || e == rustix::io::Errno::INTR => {}
                Err(e) => fast_err = Some(std::io::Error::from(e)),
            }
        }
        if fast_err.is_none() && sent == total && body.is_none() {
            return Ok(());
        }
        let r = match fast_err {
            Some(e) => Err(e),
            None => {
                // Whatever waits here lets the reader threads read for this thread (the
                // peer may be writing to us as we write to it).
                let _pause = Drive::pause(&self.lanes[0].reading.drive);
                // Each `write` waits at most the time left (a `write_all` would give every
                // partial write the whole timeout again: a link cut mid-frame then took twice
                // the timeout to be reported).
                let mut put = |mut b: &[u8]| -> std::io::Result<()> {
                    while !b.is_empty() {
                        let left = deadline.saturating_duration_since(Instant::now());
                        if left.is_zero() {
                            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "deadline passed"));
                        }
                        s.set_write_timeout(Some(left))?;
                        match s.write(&b[..b.len().min(1 << 20)]) {
                            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                            Ok(n) => b = &b[n..],
                            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                            Err(e) => return Err(e),
                        }
                    }
                    Ok(())
                };
                (|| {
                    // The end of a best-effort frame first (see `try_post_send_now`).
                    put(tail)?;
                    tail.clear();
                    let mut skip = sent;
                    for b in first {
                        let k = skip.min(b.len());
                        skip -= k;
                        put(&b[k..])?;
                    }
                    match body {
                        Some(body) => body(&mut put),
                        None => Ok(()),
                    }
                })()
            }
        };
        r.map_err(|e| self.send_failed(e, start, what))
    }

    fn unusable(&self) -> Error {
        Error::Transport {
            rank: self.rank,
            peer: Some(self.peer),
            transport: TransportKind::Tcp,
            what: "connection is unusable after an earlier failed send".into(),
        }
    }

    /// Sends a one-sided write without waiting on any one socket: cut into one piece per
    /// lane (4 KiB multiples) when `stripe`, each piece's body sent with `MSG_ZEROCOPY` when
    /// `zc`. Every lane's writer is held for the whole write (taken in lane order, as every
    /// writer takes them), so the pieces of consecutive striped writes keep their order on
    /// every lane. Returns once the kernel holds every byte (with zero copy: once it has let
    /// go of the source's pages).
    #[allow(clippy::too_many_arguments)]
    fn send_spread(&self, body: &[u8], imm: u32, key: u64, addr: u64, stripe: bool, zc: bool, deadline: Instant) -> Result<()> {
        let n = if stripe { self.lanes.len() } else { 1 };
        let piece = body.len().div_ceil(n).next_multiple_of(4096).max(4096);
        let others = u32::try_from(body.len().div_ceil(piece).saturating_sub(1)).unwrap_or(0);
        let id = self.next_stripe.fetch_add(1, Ordering::Relaxed);
        let mut outs: Vec<Out<'_>> = body
            .chunks(piece)
            .enumerate()
            .map(|(i, b)| {
                let mut h = match (others, i) {
                    (0, _) => header(K_WRITE, imm, b.len() as u64, key, addr),
                    (_, 0) => header(K_STRIPED, imm, b.len() as u64, key, addr),
                    _ => header(K_STRIPE, 0, b.len() as u64, key, addr + (i * piece) as u64),
                };
                if others > 0 {
                    h[32..36].copy_from_slice(&id.to_le_bytes());
                    h[36..40].copy_from_slice(&(if i == 0 { others } else { 0 }).to_le_bytes());
                }
                Out { pre: Vec::new(), h, body: b, sent: 0, zc, zc_calls: 0 }
            })
            .collect();
        let mut ws: Vec<_> = self.lanes[..outs.len()].iter().map(|l| l.writer.lock().unwrap_or_else(|e| e.into_inner())).collect();
        if self.broken.load(Ordering::Acquire) {
            return Err(self.unusable());
        }
        for (o, w) in outs.iter_mut().zip(&ws) {
            o.zc &= w.zc;
        }
        // The end of a best-effort frame goes first (see `try_post_send_now`).
        outs[0].pre = std::mem::take(&mut ws[0].tail);
        let start = Instant::now();
        self.spread_io(&ws, &mut outs, deadline).map_err(|e| self.send_failed(e, start, "write"))
    }

    /// [`TcpEndpoint::send_spread`]'s system calls: one non-blocking send per unfinished
    /// lane per round; when no lane takes anything, a `poll` for room on all of them; then,
    /// for zero-copy sends, the kernel's reports that it has finished with them.
    fn spread_io(&self, ws: &[std::sync::MutexGuard<'_, Wr>], outs: &mut [Out<'_>], deadline: Instant) -> std::io::Result<()> {
        use rustix::event::PollFlags;
        use rustix::io::Errno;
        use rustix::net::SendFlags;
        use std::os::fd::AsFd;
        let flags = SendFlags::DONTWAIT | SendFlags::NOSIGNAL;
        let zero_copy = flags | SendFlags::from_bits_retain(ferroccl_mem::net::ZEROCOPY);
        // Whatever waits here lets the reader threads read for this thread.
        let mut pause = None;
        loop {
            let (mut moved, mut left) = (false, false);
            for (o, w) in outs.iter_mut().zip(ws) {
                if o.done() {
                    continue;
                }
                let head = o.pre.len() + HDR;
                let r = if o.sent < head {
                    // What is left of the header (with the body, unless it goes zero-copy).
                    let pre = &o.pre[o.sent.min(o.pre.len())..];
                    let h = &o.h[o.sent.saturating_sub(o.pre.len())..];
                    let b = if o.zc { &[][..] } else { o.body };
                    let iov = [std::io::IoSlice::new(pre), std::io::IoSlice::new(h), std::io::IoSlice::new(b)];
                    rustix::net::sendmsg(&w.s, &iov, &mut Default::default(), flags)
                } else {
                    rustix::net::send(&w.s, &o.body[o.sent - head..], if o.zc { zero_copy } else { flags })
                };
                match r {
                    Ok(k) => {
                        if o.zc && o.sent >= head {
                            o.zc_calls += 1;
                        }
                        o.sent += k;
                        moved |= k > 0;
                    }
                    Err(e) if e == Errno::AGAIN || e == Errno::INTR => {}
                    // The pages could not be pinned (the memlock limit): nothing was sent;
                    // the rest of this piece is copied as usual.
                    Err(e) if e == Errno::NOBUFS && o.zc => {
                        o.zc = false;
                        moved = true;
                    }
                    Err(e) => return Err(e.into()),
                }
                left |= !o.done();
            }
            if !left {
                break;
            }
            if !moved {
                pause.get_or_insert_with(|| Drive::pause(&self.lanes[0].reading.drive));
                let busy = ws.iter().zip(outs.iter()).filter(|(_, o)| !o.done()).map(|(w, _)| &w.s);
                wait_ready(busy, PollFlags::OUT, deadline)?;
            }
        }
        // Zero copy: the source is the caller's again only once the kernel says so.
        for (o, w) in outs.iter().zip(ws).filter(|(o, _)| o.zc_calls > 0) {
            let mut done = 0u64;
            loop {
                done += ferroccl_mem::net::zerocopy_reap(w.s.as_fd())?.done;
                if done >= o.zc_calls {
                    break;
                }
                pause.get_or_insert_with(|| Drive::pause(&self.lanes[0].reading.drive));
                if wait_ready(std::iter::once(&w.s), PollFlags::ERR, deadline)? {
                    // Hung up with reports still due: they come as the kernel drops the
                    // data; do not spin meanwhile.
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
        Ok(())
    }

    /// The error for a frame cut short by `e`: the connection is unusable from here on.
    fn send_failed(&self, e: std::io::Error, start: Instant, what: &str) -> Error {
        self.broken.store(true, Ordering::Release);
        if matches!(e.kind(), std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset) {
            // The peer closed on us. If it said why first (an ERR ahead of its FIN), our
            // reader thread (or a driver) is about to deliver it: report that root cause
            // instead.
            let until = Instant::now() + Duration::from_millis(200);
            let main = &self.lanes[0];
            while Instant::now() < until && main.reader.lock().unwrap_or_else(|p| p.into_inner()).as_ref().is_some_and(|h| !h.is_finished())
            {
                main.reading.drive_once();
                std::thread::sleep(Duration::from_millis(2));
            }
            // A broken connection is only a suspect for a moment (see `Events::suspects`):
            // wait for its grace too, then report the best-known cause.
            let settle = Instant::now() + crate::inbox::SUSPECT_GRACE + Duration::from_millis(20);
            if let Some(fault) = self.inbox.root_cause(settle) {
                self.shut_down();
                return fault.to_error(self.rank, &Op::other(format!("tcp {what} to rank {}", self.peer)), None);
            }
        }
        self.shut_down();
        self.io_err(what, e, start)
    }

    fn send_frame(&self, first: &[&[u8]], body: Option<Body<'_>>, deadline: Instant, what: &str) -> Result<()> {
        let mut w = self.lanes[0].writer.lock().unwrap_or_else(|e| e.into_inner());
        self.send_frame_locked(&mut w, first, body, deadline, what)
    }

    /// Sends only if no other frame is being written right now and the socket takes the
    /// frame without waiting (a best-effort message: a probe, an `ERR`); never waits. A full
    /// socket is `WouldBlock` and leaves the connection as it was (waiting for room with a
    /// short deadline would cut the frame short when the deadline passed, and a frame cut
    /// short breaks the connection for good: a probe sent while a large transfer filled the
    /// socket did that). When the socket takes only part of the frame, the rest waits in
    /// the endpoint and goes first with the next send, so the stream stays whole.
    pub(crate) fn try_post_send_now(&self, msg: &[u8], deadline: Instant) -> Result<()> {
        use rustix::net::SendFlags;
        let Ok(mut w) = self.lanes[0].writer.try_lock() else {
            return Err(Error::WouldBlock("socket busy".into()));
        };
        if self.broken.load(Ordering::Acquire) {
            return self.send_frame_locked(&mut w, &[], None, deadline, "send");
        }
        let nowait = |s: &TcpStream, b: &[u8]| match rustix::net::send(s, b, SendFlags::DONTWAIT | SendFlags::NOSIGNAL) {
            Ok(n) => Ok(n),
            Err(e) if e == rustix::io::Errno::AGAIN || e == rustix::io::Errno::INTR => Ok(0),
            Err(e) => Err(e),
        };
        let start = Instant::now();
        let Wr { s, tail, .. } = &mut *w;
        let mut frame = [&header(K_MSG, 0, msg.len() as u64, 0, 0)[..], msg].concat();
        let r = (|| -> std::result::Result<bool, rustix::io::Errno> {
            if !tail.is_empty() {
                let n = nowait(s, tail)?;
                tail.drain(..n);
                if !tail.is_empty() {
                    return Ok(false);
                }
            }
            let n = nowait(s, &frame)?;
            if n > 0 {
                frame.drain(..n);
                *tail = frame;
            }
            Ok(n > 0)
        })();
        match r {
            Ok(true) => Ok(()),
            Ok(false) => Err(Error::WouldBlock("socket full".into())),
            Err(e) => {
                self.broken.store(true, Ordering::Release);
                self.shut_down();
                Err(self.io_err("send", std::io::Error::from(e), start))
            }
        }
    }

    /// Shuts every socket to the peer down (the peer sees it at once); reader threads
    /// waiting for anything wake.
    fn shut_down(&self) {
        for l in &self.lanes {
            let _ = l.ctl.shutdown(Shutdown::Both);
        }
        self.lanes[0].reading.drive.kick();
        self.lanes[0].reading.joined.bump();
    }

    /// Shuts the sockets down (after a fatal error); the reader threads end.
    pub(crate) fn cut(&self) {
        self.closing.store(true, Ordering::Release);
        self.shut_down();
    }

    pub(crate) fn post_send(&self, msg: &[u8], deadline: Instant) -> Result<()> {
        self.post_send2(msg, &[], deadline)
    }

    /// One message, `head` then `body`, in one frame.
    pub(crate) fn post_send2(&self, head: &[u8], body: &[u8], deadline: Instant) -> Result<()> {
        let len = head.len() + body.len();
        if len > MAX_MSG {
            return Err(Error::invalid(format!("tcp message of {len} bytes exceeds {MAX_MSG}")));
        }
        self.send_frame(&[&header(K_MSG, 0, len as u64, 0, 0), head, body], None, deadline, "send")
    }

    /// Posts a write already checked by [`WriteReq`]'s bounds check: one frame, written
    /// straight from the source region.
    pub(crate) fn post_write(&self, w: &WriteReq<'_>, deadline: Instant) -> Result<()> {
        let WriteReq { src, offset, len, dst, imm, .. } = *w;
        let (key, addr) = (dst.key, w.dst_addr(0));
        let stripe = self.lanes.len() > 1 && len >= self.knobs.stripe_min;
        let zc = self.knobs.zerocopy_min.is_some_and(|m| len >= m);
        src.with_slice(offset, len, |b| {
            if len > 0 && (stripe || zc) {
                return self.send_spread(b, imm, key, addr, stripe, zc, deadline);
            }
            self.send_frame(&[&header(K_WRITE, imm, len as u64, key, addr), b], None, deadline, "write")
        })
        .unwrap_or_else(|e| Err(Error::internal(format!("tcp write to rank {}: its source: {e}", self.peer))))
    }

    /// `rows` rows of `w.len` bytes, `src_stride` apart from `w.offset` in the source and
    /// `dst_stride` apart from `w.dst_offset` at the peer, as one frame (`K_WRITE_ROWS`),
    /// each row's immediate `row_imm(w.imm, r)` reported when all have landed. Rows are
    /// gathered into the socket in batches of up to 256 KiB. A row or stride over 4 GiB
    /// goes as one frame per row.
    pub(crate) fn post_write_rows(&self, w: &WriteReq<'_>, rows: u32, src_stride: u64, dst_stride: u64, deadline: Instant) -> Result<()> {
        let row = w.len;
        let span = |stride: u64| u64::from(rows.saturating_sub(1)).checked_mul(stride).and_then(|s| s.checked_add(row as u64));
        let (Some(src_span), Some(dst_span)) = (span(src_stride), span(dst_stride)) else {
            return Err(Error::invalid(format!("a strided write of {rows} rows of {row} bytes overflows")));
        };
        if rows == 0 || row == 0 {
            return Ok(());
        }
        if rows > 1 && (src_stride < row as u64 || dst_stride < row as u64) {
            return Err(Error::invalid(format!("strided write: strides {src_stride}/{dst_stride} shorter than a row of {row} bytes")));
        }
        if (w.offset as u64).checked_add(src_span).is_none_or(|e| e > w.src.len() as u64) {
            return Err(Error::invalid(format!(
                "strided write source [{}, +{src_span}) overruns the local region of {} bytes",
                w.offset,
                w.src.len()
            )));
        }
        if w.dst.addr.checked_add(w.dst.len).is_none() || w.dst_offset.checked_add(dst_span).is_none_or(|e| e > w.dst.len) {
            return Err(Error::invalid(format!(
                "strided write of {dst_span} bytes at offset {} overruns the peer's region of {} bytes",
                w.dst_offset, w.dst.len
            )));
        }
        let (Ok(row32), Ok(stride32)) = (u32::try_from(row), u32::try_from(dst_stride)) else {
            for r in 0..rows {
                let one = WriteReq {
                    offset: w.offset + (u64::from(r) * src_stride) as usize,
                    dst_offset: w.dst_offset + u64::from(r) * dst_stride,
                    imm: row_imm(w.imm, r),
                    ..*w
                };
                self.post_write(&one, deadline)?;
            }
            return Ok(());
        };
        let mut hdr = header(K_WRITE_ROWS, w.imm, row as u64 * u64::from(rows), w.dst.key, w.dst_addr(0));
        hdr[32..36].copy_from_slice(&row32.to_le_bytes());
        hdr[36..40].copy_from_slice(&stride32.to_le_bytes());
        let mut gather = self.gather.lock().unwrap_or_else(|e| e.into_inner());
        let gather = &mut *gather;
        self.send_frame(
            &[&hdr],
            Some(&mut |put| {
                w.src
                    .with_slice(w.offset, src_span as usize, |b| {
                        gather.clear();
                        for r in 0..rows as usize {
                            let at = r * src_stride as usize;
                            let one = &b[at..at + row];
                            if row >= GATHER_MAX {
                                put(one)?;
                                continue;
                            }
                            if gather.len() + row > GATHER_MAX {
                                put(gather)?;
                                gather.clear();
                            }
                            gather.extend_from_slice(one);
                        }
                        if !gather.is_empty() {
                            put(gather)?;
                        }
                        Ok(())
                    })
                    .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())))
            }),
            deadline,
            "write",
        )
    }

    pub(crate) fn close(&self, deadline: Instant) {
        self.closing.store(true, Ordering::Release);
        for l in &self.lanes {
            if let Ok(mut w) = l.writer.try_lock() {
                let _ = self.send_frame_locked(&mut w, &[&header(K_BYE, 0, 0, 0, 0)], None, deadline, "goodbye");
            }
        }
        self.shut_down();
        for l in &self.lanes {
            if let Some(h) = l.reader.lock().unwrap_or_else(|e| e.into_inner()).take() {
                let _ = h.join();
            }
        }
    }
}

impl Drop for TcpEndpoint {
    fn drop(&mut self) {
        self.close(Instant::now() + Duration::from_millis(200));
    }
}

/// One lane's frame of a write sent by [`TcpEndpoint::send_spread`]: `pre` (the end of a
/// best-effort frame, lane 0 only), the header, then the body.
struct Out<'a> {
    pre: Vec<u8>,
    h: [u8; HDR],
    body: &'a [u8],
    /// Bytes of `pre`, header and body sent so far.
    sent: usize,
    /// The body goes with `MSG_ZEROCOPY`.
    zc: bool,
    /// Zero-copy sends made (each is reported finished on the socket's error queue).
    zc_calls: u64,
}

impl Out<'_> {
    fn done(&self) -> bool {
        self.sent == self.pre.len() + HDR + self.body.len()
    }
}

/// Waits (at most 100 ms, and not past `deadline`: then `TimedOut`) until one of `socks`
/// shows `what`, an error or a hang-up. Whether one hung up.
fn wait_ready<'a>(socks: impl Iterator<Item = &'a TcpStream>, what: rustix::event::PollFlags, deadline: Instant) -> std::io::Result<bool> {
    use rustix::event::{poll, PollFd, PollFlags};
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "deadline passed"));
    }
    let mut fds: Vec<PollFd<'_>> = socks.map(|s| PollFd::new(s, what)).collect();
    let ts = rustix::time::Timespec { tv_sec: 0, tv_nsec: left.min(Duration::from_millis(100)).as_nanos() as _ };
    match poll(&mut fds, Some(&ts)) {
        Ok(_) => Ok(fds.iter().any(|f| f.revents().contains(PollFlags::HUP))),
        Err(e) if e == rustix::io::Errno::INTR => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Reads `rows` rows of `row` bytes into `dst`, `stride` bytes apart, with `readv` of up
/// to 64 rows at a time (a column shard's rows are often a few KiB: one `read` each would
/// cost more than the copy).
fn read_rows(s: &mut impl Read, dst: &mut [u8], rows: usize, row: usize, stride: usize) -> std::io::Result<()> {
    use std::io::IoSliceMut;
    const BATCH: usize = 64;
    let (mut r, mut done) = (0usize, 0usize);
    while r < rows {
        let mut chunks = dst.chunks_mut(stride.max(row)).skip(r).take(rows - r);
        let mut first = true;
        let mut iov: [IoSliceMut<'_>; BATCH] = std::array::from_fn(|_| {
            let c = chunks.next().map_or(&mut [][..], |c| &mut c[..row]);
            let c = if std::mem::take(&mut first) { &mut c[done..] } else { c };
            IoSliceMut::new(c)
        });
        let n = match s.read_vectored(&mut iov) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        let mut n = n;
        while n > 0 {
            let left = row - done;
            if n >= left {
                n -= left;
                r += 1;
                done = 0;
            } else {
                done += n;
                n = 0;
            }
        }
    }
    Ok(())
}

/// The body length of the frame with header `h`, checked; `Err` says what is wrong with it.
fn body_len(h: &[u8; HDR]) -> std::result::Result<usize, String> {
    let len = u64_at(h, 8);
    match h[0] {
        K_MSG if len > MAX_MSG as u64 => Err(format!("sent a {len}-byte message, over the {MAX_MSG}-byte limit")),
        K_MSG | K_WRITE | K_STRIPED | K_STRIPE => usize::try_from(len).map_err(|_| format!("sent a write of {len} bytes")),
        K_WRITE_ROWS => {
            let (row, stride) = (u64::from(u32_at(h, 32)), u64::from(u32_at(h, 36)));
            match len.checked_div(row) {
                Some(n) if len.is_multiple_of(row) && n <= u64::from(u32::MAX) && (n <= 1 || stride >= row) => {
                    usize::try_from(len).map_err(|_| format!("sent a strided write of {len} bytes"))
                }
                _ => Err(format!("sent a strided write of {len} bytes in rows of {row}, {stride} apart")),
            }
        }
        K_BYE => Ok(0),
        k => Err(format!("sent an unknown TCP frame kind {k}")),
    }
}

impl Reading {
    /// The body length of the frame with header `h` on this lane, checked (see
    /// [`body_len`]): lanes 1 and up carry only pieces of striped writes and goodbyes; a
    /// striped write's first piece comes on lane 0 and names at most the other lanes.
    fn frame_len(&self, h: &[u8; HDR]) -> std::result::Result<usize, String> {
        let ok = match h[0] {
            K_BYE => true,
            K_STRIPE => self.lane > 0,
            K_STRIPED => self.lane == 0 && (1..self.lanes).contains(&u32_at(h, 36)),
            _ => self.lane == 0,
        };
        if !ok {
            return Err(format!("sent a TCP frame of kind {} that socket {} of {} does not carry", h[0], self.lane, self.lanes));
        }
        body_len(h)
    }

    /// A one-sided write (or a piece of one) with header `h` has landed: its immediate is
    /// reported, or the piece counted (`K_STRIPE`), or lane 0 waits for the other pieces
    /// (`K_STRIPED`).
    fn write_landed(&self, h: &[u8; HDR], wait: &mut Option<Wait>) {
        match h[0] {
            K_STRIPE => self.joined.piece_landed(u32_at(h, 32)),
            K_STRIPED => {
                *wait = Some(Wait { id: u32_at(h, 32), others: u32_at(h, 36), imm: u32_at(h, 4) });
            }
            _ => self.report_imm(u32_at(h, 4)),
        }
    }

    /// A write (all of it) has landed: its immediate is reported and waiters wake.
    fn report_imm(&self, imm: u32) {
        self.inbox.write_imm(self.peer, imm);
        self.inbox.notify();
    }

    /// Lands what has arrived on the socket, without waiting (a driving thread's round,
    /// see [`Drive`]). Whether anything arrived.
    fn drive_once(&self) -> bool {
        if self.handoff.load(Ordering::Acquire) {
            return false;
        }
        match self.rd.try_lock() {
            Ok(mut rd) => self.pump(&mut rd, false),
            Err(_) => false,
        }
    }

    fn fail(&self, why: String) {
        if !self.closing.load(Ordering::Acquire) {
            self.inbox.peer_failed(self.peer, why);
        }
    }

    /// Lands what has arrived: complete frames from the stage, then one non-blocking
    /// `recv` at a time into it, until the socket has nothing more. A frame larger than the
    /// stage is read straight into place when `may_block` (the reader thread), or handed
    /// to the reader thread otherwise (see [`Reading::handoff`]). Whether anything arrived.
    fn pump(&self, rd: &mut Rd, may_block: bool) -> bool {
        use rustix::net::RecvFlags;
        let mut moved = false;
        let mut drained = false;
        'frames: loop {
            if rd.ended {
                return moved;
            }
            // A striped write on lane 0 waits for its other pieces before anything after it.
            if let Some(w) = rd.wait {
                if !self.joined.take(w.id, w.others) {
                    return moved;
                }
                rd.wait = None;
                self.report_imm(w.imm);
                moved = true;
            }
            // A one-sided write larger than the stage, received in place piece by piece.
            if let Some(part) = rd.part {
                match self.continue_write(rd, part) {
                    Step::Done => {
                        moved = true;
                        continue 'frames;
                    }
                    Step::More(got) => return moved || got,
                    Step::Failed => return self.end(rd),
                }
            }
            while rd.hi - rd.lo >= HDR {
                let mut h = [0u8; HDR];
                h.copy_from_slice(&rd.stage[rd.lo..rd.lo + HDR]);
                let need = match self.frame_len(&h) {
                    Ok(n) => n,
                    Err(why) => {
                        self.fail(why);
                        return self.end(rd);
                    }
                };
                if rd.hi - rd.lo - HDR >= need {
                    let at = rd.lo + HDR;
                    let ok = self.land(&h, &mut &rd.stage[at..at + need], &mut rd.wait);
                    rd.lo = at + need;
                    moved = true;
                    if !ok {
                        return self.end(rd);
                    }
                    if rd.wait.is_some() {
                        continue 'frames;
                    }
                    continue;
                }
                if HDR + need <= rd.stage.len() {
                    break;
                }
                if matches!(h[0], K_WRITE | K_STRIPED | K_STRIPE) {
                    // Straight into place, with non-blocking reads: whoever pumps next
                    // (this driver, another, or the reader thread) goes on with it.
                    rd.lo += HDR;
                    rd.part = Some(Part { h, done: 0 });
                    moved = true;
                    break;
                }
                if !may_block {
                    if !self.handoff.swap(true, Ordering::AcqRel) {
                        self.drive.kick();
                    }
                    return moved;
                }
                let Rd { s, stage, lo, hi, wait, .. } = rd;
                let ok = self.land(&h, &mut Read::chain(&stage[*lo + HDR..*hi], &*s), wait);
                (*lo, *hi) = (0, 0);
                self.handoff.store(false, Ordering::Release);
                moved = true;
                if !ok {
                    return self.end(rd);
                }
            }
            if rd.part.is_some() {
                continue;
            }
            if drained {
                return moved;
            }
            if rd.lo == rd.hi {
                (rd.lo, rd.hi) = (0, 0);
            } else if rd.lo > 0 {
                rd.stage.copy_within(rd.lo..rd.hi, 0);
                (rd.lo, rd.hi) = (0, rd.hi - rd.lo);
            }
            let free = rd.stage.len() - rd.hi;
            match rustix::net::recv(&rd.s, &mut rd.stage[rd.hi..], RecvFlags::DONTWAIT) {
                Ok((0, _)) => {
                    self.fail("closed its TCP connection without saying goodbye (process died?)".into());
                    return self.end(rd);
                }
                Ok((n, _)) => {
                    rd.hi += n;
                    // Less than the room: that was all there is (no second `recv` to learn it).
                    drained = n < free;
                }
                Err(e) if e == rustix::io::Errno::AGAIN => return moved,
                Err(e) if e == rustix::io::Errno::INTR => {}
                Err(e) => {
                    self.fail(format!("broke its TCP connection: {e}"));
                    return self.end(rd);
                }
            }
        }
    }

    /// Receives what has arrived of the write `part` (the staged bytes first, then one
    /// non-blocking `recv`) straight into its registered destination.
    fn continue_write(&self, rd: &mut Rd, part: Part) -> Step {
        use rustix::net::RecvFlags;
        let (peer, h) = (self.peer, &part.h);
        let (len, key, addr) = (u64_at(h, 8) as usize, u64_at(h, 16), u64_at(h, 24));
        let mut got_any = false;
        let mut done = part.done;
        loop {
            let mut got = 0usize;
            let Rd { s, stage, lo, hi, .. } = rd;
            let landed = self.inbox.land_write(TransportKind::Tcp, peer, key, addr + done as u64, len - done, |dst| {
                if *lo < *hi {
                    got = (*hi - *lo).min(dst.len());
                    dst[..got].copy_from_slice(&stage[*lo..*lo + got]);
                    *lo += got;
                    return Ok(());
                }
                loop {
                    return match rustix::net::recv(&*s, &mut *dst, RecvFlags::DONTWAIT) {
                        Ok((0, _)) => Err(format!("TCP connection to rank {peer} closed mid-write (process died?)")),
                        Ok((n, _)) => {
                            got = n;
                            Ok(())
                        }
                        Err(e) if e == rustix::io::Errno::AGAIN => Ok(()),
                        Err(e) if e == rustix::io::Errno::INTR => continue,
                        Err(e) => Err(format!("TCP connection to rank {peer} broke mid-write: {e}")),
                    };
                }
            });
            if landed.is_err() {
                // land_write recorded why (a refused write, or the connection's end).
                return Step::Failed;
            }
            if got == 0 {
                rd.part = Some(Part { h: part.h, done });
                return Step::More(got_any);
            }
            got_any = true;
            done += got;
            if done == len {
                rd.part = None;
                if rd.lo == rd.hi {
                    (rd.lo, rd.hi) = (0, 0);
                }
                self.write_landed(h, &mut rd.wait);
                return Step::Done;
            }
        }
    }

    /// The stream has ended: nothing more is read; the reader thread, if asleep, wakes to
    /// leave.
    fn end(&self, rd: &mut Rd) -> bool {
        rd.ended = true;
        self.handoff.store(false, Ordering::Release);
        self.drive.kick();
        self.joined.bump();
        self.inbox.notify();
        true
    }

    /// Lands the frame with header `h` (its body length checked by [`body_len`]), its body
    /// read from `r`. Whether the stream goes on.
    fn land(&self, h: &[u8; HDR], r: &mut impl Read, wait: &mut Option<Wait>) -> bool {
        let (peer, inbox) = (self.peer, &self.inbox);
        let imm = u32_at(h, 4);
        let (len, key, addr) = (u64_at(h, 8) as usize, u64_at(h, 16), u64_at(h, 24));
        match h[0] {
            K_MSG => {
                let mut b = inbox.take_buf(len);
                if let Err(e) = r.read_exact(&mut b) {
                    self.fail(format!("TCP connection broke mid-message: {e}"));
                    return false;
                }
                inbox.deliver_msg(peer, b);
            }
            K_WRITE | K_STRIPED | K_STRIPE => {
                let landed = inbox.land_write(TransportKind::Tcp, peer, key, addr, len, |dst| {
                    r.read_exact(dst).map_err(|e| format!("TCP connection to rank {peer} broke mid-write: {e}"))
                });
                if landed.is_err() {
                    // The stream position is lost (or the write was refused): the
                    // connection cannot continue. land_write recorded why.
                    return false;
                }
                self.write_landed(h, wait);
                return true;
            }
            K_WRITE_ROWS => {
                let (row, stride) = (u32_at(h, 32) as usize, u32_at(h, 36) as usize);
                let rows = len / row;
                let span = rows.saturating_sub(1) * stride + row;
                let landed = inbox.land_write(TransportKind::Tcp, peer, key, addr, span, |dst| {
                    read_rows(r, dst, rows, row, stride).map_err(|e| format!("TCP connection to rank {peer} broke mid-write: {e}"))
                });
                if landed.is_err() {
                    return false;
                }
                inbox.write_imms(peer, imm, rows as u32);
            }
            _ => {
                // A goodbye (the only other kind `frame_len` lets through). Lane 0's follows
                // everything the peer sent on it (its LEAVE saying where it stopped, its
                // last messages); another lane's may be read first and ends only that lane
                // (marking the peer closed then made a waiting receive report "closed its
                // communicator" instead of the LEAVE still unread on lane 0).
                if self.lane == 0 {
                    inbox.peer_closed(peer);
                    inbox.notify();
                }
                return false;
            }
        }
        inbox.notify();
        true
    }
}

/// A socket's reader thread: reads lane 0 while no thread drives the mesh (or the driver
/// has stalled), and every frame a driver hands off; reads lanes 1 and up always.
fn reader_loop(r: &Reading, watch: &TcpStream) {
    use rustix::event::{poll, PollFd, PollFlags};
    let mut last_round = u64::MAX;
    loop {
        if r.closing.load(Ordering::Acquire) && r.rd.lock().map_or(true, |rd| rd.ended || rd.lo == rd.hi || rd.wait.is_some()) {
            // Closing: whatever is still staged is of no use to anyone.
            return;
        }
        let w = r.drive.word.load(Ordering::SeqCst);
        let handoff = r.handoff.load(Ordering::Acquire);
        let mut nap = READER_NAP;
        if r.lane == 0 && w & DRIVERS != 0 && !handoff {
            let round = r.drive.rounds.load(Ordering::Relaxed);
            if round != last_round {
                last_round = round;
                let _ = futex_wait(&r.drive.word, w, Some(DRIVER_STALL));
                continue;
            }
            // The driver has not been round for a while: read for it, briefly.
            nap = DRIVER_STALL;
        }
        if r.lane == 0 && r.rd.lock().unwrap_or_else(|e| e.into_inner()).wait.is_some() {
            // A striped write waits for pieces on the other lanes: sleep until one lands
            // (the generation is read before the pump looks, so no landing is missed).
            let g = r.joined.gen.load(Ordering::SeqCst);
            let mut rd = r.rd.lock().unwrap_or_else(|e| e.into_inner());
            if rd.ended {
                return;
            }
            r.pump(&mut rd, true);
            let still = rd.wait.is_some() && !rd.ended;
            drop(rd);
            if still {
                let _ = futex_wait(&r.joined.gen, g, Some(nap));
            }
            continue;
        }
        if !handoff {
            let mut fds = [PollFd::new(watch, PollFlags::IN)];
            let ts = rustix::time::Timespec { tv_sec: 0, tv_nsec: nap.as_nanos() as _ };
            match poll(&mut fds, Some(&ts)) {
                Ok(0) => continue,
                Ok(_) => {}
                Err(e) if e == rustix::io::Errno::INTR => continue,
                Err(e) => {
                    r.fail(format!("cannot poll its TCP connection: {e}"));
                    return;
                }
            }
        }
        let mut rd = r.rd.lock().unwrap_or_else(|e| e.into_inner());
        if rd.ended {
            return;
        }
        r.pump(&mut rd, true);
        if rd.ended {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inbox::{Bell, Inbox};
    use ferroccl_mem::InterfaceAddr;

    fn iface(name: &str, ip: &str, up: bool) -> InterfaceAddr {
        InterfaceAddr { name: name.into(), ip: ip.parse().unwrap(), up, loopback: name == "lo" }
    }

    /// NCCL_SOCKET_IFNAME's rules: prefixes, `=` exact, `^` exclude; the first up match in
    /// the kernel's order; its IPv4 address before its IPv6 one.
    #[test]
    fn interfaces_are_picked_as_nccl_picks_them() {
        let all = [
            iface("lo", "127.0.0.1", true),
            iface("lo", "::1", true),
            iface("eth0", "fd00::2", true),
            iface("eth0", "10.0.0.2", true),
            iface("eth1", "10.1.0.2", false),
            iface("eth10", "10.10.0.2", true),
            iface("ib0", "fd01::5", true),
        ];
        let pick = |f: &str| pick_interface(&IfnameFilter::parse(f).unwrap(), &all).map(|ip| ip.to_string());
        assert_eq!(pick("eth").as_deref(), Some("10.0.0.2"));
        assert_eq!(pick("=eth1"), None, "eth1 is down");
        assert_eq!(pick("eth1").as_deref(), Some("10.10.0.2"), "a prefix: eth10 after the down eth1");
        assert_eq!(pick("^lo,eth").as_deref(), Some("fd01::5"), "IPv6 when that is all it has");
        assert_eq!(pick("^=lo").as_deref(), Some("10.0.0.2"));
        assert_eq!(pick("lo").as_deref(), Some("127.0.0.1"));
        assert_eq!(pick("docker"), None);
    }

    /// The knob wins over the store's side; an unmatched filter is an error naming the
    /// variable and the host's interfaces; an IPv6 listener advertises a parsable address.
    #[test]
    fn the_listen_address_follows_the_knobs() {
        let store_side: IpAddr = "127.0.0.1".parse().unwrap();
        let mut p = Params::default();
        assert_eq!(listen_ip(&p, store_side).unwrap(), store_side);
        p.socket_ifname = IfnameFilter::parse("lo");
        assert!(listen_ip(&p, "10.9.9.9".parse().unwrap()).unwrap().is_loopback());
        p.socket_ifname = IfnameFilter::parse("=no-such-interface");
        let e = listen_ip(&p, store_side).unwrap_err().to_string();
        assert!(e.contains("FERROCCL_SOCKET_IFNAME") && e.contains("=no-such-interface") && e.contains("lo 127.0.0.1"), "{e}");
        p.socket_addr = Some("::1".parse().unwrap());
        assert_eq!(listen_ip(&p, store_side).unwrap().to_string(), "::1");
        if let Ok(setup) = TcpSetup::listen(0, "::1".parse().unwrap(), &Params::default()) {
            let addr = setup.info().addr;
            assert!(addr.starts_with("[::1]:") && addr.parse::<SocketAddr>().is_ok(), "{addr}");
        }
    }
    use std::io::Read;
    use std::net::TcpListener;

    /// `read_rows` puts every row in its place and leaves the gaps alone, however the
    /// stream cuts the bytes (here in pieces of 1 to 997 bytes, so reads end mid-row and
    /// mid-batch), for more rows than one `readv` batch.
    #[test]
    fn read_rows_scatters_rows_from_any_cut_of_the_stream() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut a = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut b, _) = listener.accept().unwrap();
        let (rows, row, stride) = (150usize, 37usize, 50usize);
        let data: Vec<u8> = (0..rows * row).map(|i| (i % 251) as u8).collect();
        let sent = data.clone();
        let writer = std::thread::spawn(move || {
            let mut at = 0;
            let mut k = 1usize;
            while at < sent.len() {
                let n = (k * 389 % 997 + 1).min(sent.len() - at);
                a.write_all(&sent[at..at + n]).unwrap();
                a.flush().unwrap();
                std::thread::sleep(Duration::from_micros(200));
                at += n;
                k += 1;
            }
        });
        let mut dst = vec![0xeeu8; (rows - 1) * stride + row];
        read_rows(&mut b, &mut dst, rows, row, stride).unwrap();
        writer.join().unwrap();
        for r in 0..rows {
            assert_eq!(&dst[r * stride..r * stride + row], &data[r * row..(r + 1) * row], "row {r}");
            if r + 1 < rows {
                assert!(dst[r * stride + row..(r + 1) * stride].iter().all(|&x| x == 0xee), "gap after row {r}");
            }
        }
        // A stream that ends early is an error, not a short success.
        let mut c = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut d, _) = listener.accept().unwrap();
        c.write_all(&data[..row * 3 + 5]).unwrap();
        drop(c);
        assert!(read_rows(&mut d, &mut dst, rows, row, stride).is_err());
    }

    /// A best-effort send into a socket whose peer is not reading (its buffers full) is
    /// `WouldBlock` and leaves the stream intact: once the peer reads again, every frame
    /// arrives whole and in order, and ordinary sends go on. (Before, the send waited 10 ms
    /// for room, gave up mid-frame and broke the connection for good: a probe sent while a
    /// large transfer filled the socket killed the job.)
    #[test]
    fn a_best_effort_send_into_a_full_socket_leaves_the_stream_intact() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut b, _) = listener.accept().unwrap();
        let knobs = Knobs { sockets: 1, stripe_min: 1 << 20, zerocopy_min: None };
        let ep =
            TcpEndpoint::start(0, 1, vec![a], Arc::new(Inbox::new(0, Bell::heap())), Arc::new(Drive::default()), STAGE_MIN, knobs).unwrap();
        let msg = vec![7u8; 64 << 10];
        let mut sent = 0usize;
        let full = loop {
            match ep.try_post_send_now(&msg, Instant::now() + Duration::from_millis(10)) {
                Ok(()) => sent += 1,
                Err(Error::WouldBlock(why)) => break why,
                Err(e) => panic!("after {sent} frames: {e}"),
            }
            assert!(sent < 10_000, "the socket never filled");
        };
        assert_eq!(full, "socket full");
        // Again, after a while: still refused, still intact.
        std::thread::sleep(Duration::from_millis(30));
        assert!(matches!(ep.try_post_send_now(b"probe", Instant::now() + Duration::from_millis(10)), Err(Error::WouldBlock(_))));
        // The peer reads again: a blocking send waits for room meanwhile.
        let reader = std::thread::spawn(move || {
            let mut frames = Vec::new();
            loop {
                let mut h = [0u8; HDR];
                b.read_exact(&mut h).unwrap();
                let len = u64::from_le_bytes(h[8..16].try_into().unwrap()) as usize;
                let mut body = vec![0u8; len];
                b.read_exact(&mut body).unwrap();
                let last = body == b"last";
                frames.push((h[0], body));
                if last {
                    return frames;
                }
            }
        });
        ep.post_send(b"last", Instant::now() + Duration::from_secs(10)).unwrap();
        let frames = reader.join().unwrap();
        assert_eq!(frames.len(), sent + 1);
        assert!(frames[..sent].iter().all(|(k, body)| *k == K_MSG && *body == msg));
        ep.cut();
    }

    /// `lanes` connected loopback socket pairs: (this side's, the peer's).
    fn socket_pairs(lanes: usize) -> (Vec<TcpStream>, Vec<TcpStream>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        (0..lanes)
            .map(|_| {
                let ours = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
                (ours, listener.accept().unwrap().0)
            })
            .unzip()
    }

    /// With several peers of one socket a driver's round asks epoll: only a socket with
    /// bytes is named (by its index among the readings), a peer with several sockets every
    /// round; once read, the socket is quiet again.
    #[test]
    fn a_driver_asks_only_the_sockets_with_bytes() {
        let inbox = Arc::new(Inbox::new(0, Bell::heap()));
        let drive = Arc::new(Drive::default());
        // Peers 1-3 with one socket each, peer 4 with two (read every round).
        let (mut eps, mut theirs) = (Vec::new(), Vec::new());
        for (peer, lanes) in [(1, 1), (2, 1), (3, 1), (4, 2)] {
            let (ours, them) = socket_pairs(lanes);
            let knobs = Knobs { sockets: lanes, stripe_min: 1 << 20, zerocopy_min: None };
            eps.push(TcpEndpoint::start(0, peer, ours, inbox.clone(), drive.clone(), STAGE_MIN, knobs).unwrap());
            theirs.push(them);
        }
        let readings: Vec<Arc<Reading>> = eps.iter().map(|e| e.lanes[0].reading.clone()).collect();
        let ready = Ready::new(0, &readings).unwrap().expect("3 peers of one socket are asked about");
        let asked = || {
            let mut v = Vec::new();
            ready.each(|i| v.push(i)).unwrap();
            v
        };
        assert_eq!(asked(), [3], "nothing arrived: only the striped peer");
        // Peer 2's reader thread cannot take the bytes while this holds its socket's lock.
        let held = readings[1].rd.lock().unwrap();
        theirs[1][0].write_all(&header(K_MSG, 0, 4, 0, 0)).unwrap();
        theirs[1][0].write_all(b"ping").unwrap();
        let until = Instant::now() + Duration::from_secs(5);
        while asked() != [1, 3] {
            assert!(Instant::now() < until, "peer 2's bytes were never reported: {:?}", asked());
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(held);
        // Read (by a driver's pump here, or by the reader thread), the socket is quiet again.
        let _ = readings[1].drive_once();
        while asked() != [3] {
            assert!(Instant::now() < until, "peer 2's socket still reported after it was read: {:?}", asked());
            std::thread::sleep(Duration::from_millis(1));
        }
        // One peer of one socket (and any number of striped ones): nothing to ask.
        assert!(Ready::new(0, &readings[2..]).unwrap().is_none());
        for e in &eps {
            e.cut();
        }
    }

    /// A goodbye read on lane 1 before lane 0's (each lane has its own reader) ends that
    /// lane only: the peer counts as closed once lane 0, which carries its last messages,
    /// says goodbye too.
    #[test]
    fn only_lane_0s_goodbye_closes_the_peer() {
        let (ours, mut theirs) = socket_pairs(2);
        let inbox = Arc::new(Inbox::new(0, Bell::heap()));
        let knobs = Knobs { sockets: 2, stripe_min: 1 << 20, zerocopy_min: None };
        let ep = TcpEndpoint::start(0, 1, ours, inbox.clone(), Arc::new(Drive::default()), STAGE_MIN, knobs).unwrap();
        theirs[1].write_all(&header(K_BYE, 0, 0, 0, 0)).unwrap();
        let until = Instant::now() + Duration::from_secs(5);
        while !ep.lanes[1].reading.rd.lock().unwrap().ended {
            assert!(Instant::now() < until, "lane 1's goodbye was never read");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(!inbox.lock().closed.contains(&1), "lane 1's goodbye closed the peer");
        theirs[0].write_all(&header(K_BYE, 0, 0, 0, 0)).unwrap();
        while !inbox.lock().closed.contains(&1) {
            assert!(Instant::now() < until, "lane 0's goodbye did not close the peer");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(inbox.root_cause(Instant::now()).is_none(), "a goodbye is not a failure");
        ep.cut();
    }

    /// A frame its socket does not carry (a piece of a striped write on lane 0, a first
    /// piece that names more pieces than there are other lanes, a message on lane 1) fails
    /// the connection with a reason that names the frame's kind and the socket.
    #[test]
    fn frames_a_lane_does_not_carry_fail_the_connection() {
        let mut too_many = header(K_STRIPED, 0, 8, 1, 0);
        too_many[36..40].copy_from_slice(&2u32.to_le_bytes());
        for (lanes, bad_lane, h) in [(1, 0, header(K_STRIPE, 0, 8, 1, 0)), (2, 0, too_many), (2, 1, header(K_MSG, 0, 8, 0, 0))] {
            let (ours, mut theirs) = socket_pairs(lanes);
            let inbox = Arc::new(Inbox::new(0, Bell::heap()));
            let knobs = Knobs { sockets: lanes, stripe_min: 1 << 20, zerocopy_min: None };
            let ep = TcpEndpoint::start(0, 1, ours, inbox.clone(), Arc::new(Drive::default()), STAGE_MIN, knobs).unwrap();
            theirs[bad_lane].write_all(&h).unwrap();
            theirs[bad_lane].write_all(&[0u8; 8]).unwrap();
            let until = Instant::now() + Duration::from_secs(10);
            let fault = loop {
                if let Some(f) = inbox.root_cause(Instant::now()) {
                    break f;
                }
                assert!(Instant::now() < until, "kind {} on socket {bad_lane} of {lanes}: the connection did not fail", h[0]);
                std::thread::sleep(Duration::from_millis(5));
            };
            let want = format!("kind {} that socket {bad_lane} of {lanes} does not carry", h[0]);
            assert!(fault.what.contains(&want) && fault.culprit == Some(1), "{fault:?}");
            ep.cut();
        }
    }
}
