//! TCP transport: one authenticated socket per peer.
//!
//! Frames are a 40-byte header (kind, immediate, length, registration key, address)
//! followed by the payload. The caller's thread writes frames (under a per-socket lock): a
//! small frame goes in one non-blocking `sendmsg` (header and body gathered), the rest of a
//! large one with waiting. Reading has two roads ([`Drive`]): the thread that drives the
//! engine reads every socket itself with non-blocking `recv`s into a stage (64 KiB, or the
//! largest eager message) and lands
//! whole frames from it (no hand-off between threads on the critical path: the latency
//! path); while no thread drives (between calls, or while the driver sleeps or blocks in a
//! write), each socket's reader thread does the same, and it also takes every frame larger
//! than the stage, whose body it reads straight into the registered destination (no
//! intermediate copy). Messages go to the fabric's queues; a one-sided write's immediate is
//! reported once it has landed. EOF or an error without a goodbye marks the peer failed,
//! which wakes and fails every waiter.

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
/// address).
#[derive(Debug)]
pub(crate) struct TcpSetup {
    listener: TcpListener,
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
    pub(crate) fn listen(rank: usize, ip: IpAddr) -> Result<TcpSetup> {
        let listener = TcpListener::bind(SocketAddr::new(ip, 0)).map_err(|e| Error::io(format!("rank {rank}: listen on {ip}"), e))?;
        Ok(TcpSetup { listener })
    }

    /// Our part of the descriptor.
    pub(crate) fn info(&self) -> TcpInfo {
        TcpInfo { addr: self.listener.local_addr().map(|a| a.to_string()).unwrap_or_default() }
    }

    /// One authenticated socket to every peer in `peers` (chosen for tcp): the lower rank
    /// of each pair connects, the higher accepts; both run the job's handshake, then the
    /// connecting side names its rank and the mesh. The listener closes when this returns.
    pub(crate) fn connect(self, cx: &SetupCx<'_>, peers: &[usize]) -> Result<(TcpNet, Connected)> {
        let rank = cx.rank;
        let expect: Vec<usize> = peers.iter().copied().filter(|&p| p < rank).collect();
        let (listener, handshake, mesh_id, deadline) = (&self.listener, cx.handshake, cx.mesh_id, cx.deadline);
        let streams = std::thread::scope(|s| -> Result<Vec<(usize, TcpStream)>> {
            let acceptor = s.spawn(|| accept_peers(listener, rank, &expect, handshake, mesh_id, deadline));
            let mut out = Vec::new();
            for &p in peers.iter().filter(|&&p| p > rank) {
                let addr = cx.descs[p].tcp.as_ref().map_or("", |t| t.addr.as_str());
                out.push((p, connect_peer(cx, p, addr)?));
            }
            let accepted = acceptor.join().map_err(|_| Error::internal("tcp acceptor panicked"))??;
            out.extend(accepted);
            Ok(out)
        })?;
        let mut connected = Connected::default();
        let net = TcpNet { drive: Arc::new(Drive::default()), readings: Vec::new() };
        let mut readings = Vec::new();
        for (p, stream) in streams {
            let stage = stage_len(usize::try_from(cx.descs[rank].eager_max).unwrap_or(MAX_MSG));
            let e = TcpEndpoint::start(rank, p, stream, cx.inbox.clone(), net.drive.clone(), stage)?;
            readings.push(e.reading.clone());
            connected.endpoints.push((p, Endpoint::Tcp(e)));
        }
        Ok((TcpNet { readings, ..net }, connected))
    }
}

/// What the connecting side sends after the handshake: the mesh it means and its rank.
fn encode_hello(mesh_id: &str, rank: usize) -> Vec<u8> {
    let mut w = Writer::new();
    w.str(mesh_id).u32(rank as u32);
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

fn connect_peer(cx: &SetupCx<'_>, peer: usize, addr: &str) -> Result<TcpStream> {
    let (rank, deadline) = (cx.rank, cx.deadline);
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
    cx.handshake.connecting(&mut s, &label, deadline)?;
    s.set_write_timeout(Some(deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))))
        .map_err(|e| Error::io("set timeout", e))?;
    write_frame(&mut s, &encode_hello(cx.mesh_id, rank)).map_err(|e| Error::io(format!("rank {rank}: hello to {label}"), e))?;
    s.set_read_timeout(None).and_then(|_| s.set_write_timeout(None)).map_err(|e| Error::io("clear timeouts", e))?;
    Ok(s)
}

/// Accepts one authenticated connection from each rank in `expect`. Strangers (wrong token,
/// garbage, unexpected ranks) are dropped and do not disturb the job.
fn accept_peers(
    listener: &TcpListener,
    rank: usize,
    expect: &[usize],
    handshake: &Arc<dyn Handshake>,
    mesh_id: &str,
    deadline: Instant,
) -> Result<Vec<(usize, TcpStream)>> {
    let mut got: HashMap<usize, TcpStream> = HashMap::new();
    if expect.is_empty() {
        return Ok(vec![]);
    }
    listener.set_nonblocking(true).map_err(|e| Error::io("listener nonblocking", e))?;
    let (tx, rx) = std::sync::mpsc::channel::<(usize, TcpStream)>();
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
                    let (Ok(id), Ok(p)) = (r.str(), r.u32()) else { return };
                    if id != mesh_id {
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
    Ok(got.into_iter().collect())
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
    rd: Mutex<Rd>,
    /// Set by a driver that met a frame larger than the stage: the reader thread reads it
    /// (blocking, straight into place); drivers leave the socket alone until it is done.
    handoff: AtomicBool,
    inbox: Arc<Inbox>,
    closing: Arc<AtomicBool>,
    drive: Arc<Drive>,
}

/// This rank's socket to one peer.
#[derive(Debug)]
pub(crate) struct TcpEndpoint {
    rank: usize,
    peer: usize,
    writer: Mutex<Wr>,
    /// A handle to shut the socket down without waiting for the writer's lock.
    ctl: TcpStream,
    reading: Arc<Reading>,
    reader: Mutex<Option<JoinHandle<()>>>,
    inbox: Arc<Inbox>,
    closing: Arc<AtomicBool>,
    /// Set when a frame was cut short by a send timeout: the stream is unusable.
    broken: AtomicBool,
    /// Where [`TcpEndpoint::post_write_rows`] gathers short rows (taken before the writer's
    /// lock, never after it; kept, so a strided write allocates nothing once it has grown).
    gather: Mutex<Vec<u8>>,
}

impl TcpEndpoint {
    pub(crate) fn start(
        rank: usize,
        peer: usize,
        stream: TcpStream,
        inbox: Arc<Inbox>,
        drive: Arc<Drive>,
        stage: usize,
    ) -> Result<TcpEndpoint> {
        let clone = || stream.try_clone().map_err(|e| Error::io(format!("rank {rank}: clone socket to rank {peer}"), e));
        let (rd, ctl, watch) = (clone()?, clone()?, clone()?);
        let closing = Arc::new(AtomicBool::new(false));
        let reading = Arc::new(Reading {
            peer,
            rd: Mutex::new(Rd { s: rd, stage: vec![0u8; stage].into_boxed_slice(), lo: 0, hi: 0, ended: false, part: None }),
            handoff: AtomicBool::new(false),
            inbox: inbox.clone(),
            closing: closing.clone(),
            drive,
        });
        let r2 = reading.clone();
        let reader = std::thread::Builder::new()
            .name(format!("ferroccl-tcp-{peer}"))
            .spawn(move || reader_loop(&r2, &watch))
            .map_err(|e| Error::io("spawn tcp reader thread", e))?;
        Ok(TcpEndpoint {
            rank,
            peer,
            writer: Mutex::new(Wr { s: stream, tail: Vec::new() }),
            ctl,
            reading,
            reader: Mutex::new(Some(reader)),
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
            return Err(Error::Transport {
                rank: self.rank,
                peer: Some(self.peer),
                transport: TransportKind::Tcp,
                what: "connection is unusable after an earlier failed send".into(),
            });
        }
        let start = Instant::now();
        let Wr { s, tail } = w;
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
                let _pause = Drive::pause(&self.reading.drive);
                let mut put = |mut b: &[u8]| -> std::io::Result<()> {
                    while !b.is_empty() {
                        let left = deadline.saturating_duration_since(Instant::now());
                        if left.is_zero() {
                            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "deadline passed"));
                        }
                        s.set_write_timeout(Some(left))?;
                        let n = b.len().min(1 << 20);
                        s.write_all(&b[..n])?;
                        b = &b[n..];
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

    /// The error for a frame cut short by `e`: the connection is unusable from here on.
    fn send_failed(&self, e: std::io::Error, start: Instant, what: &str) -> Error {
        self.broken.store(true, Ordering::Release);
        if matches!(e.kind(), std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset) {
            // The peer closed on us. If it said why first (an ERR ahead of its FIN), our
            // reader thread (or a driver) is about to deliver it: report that root cause
            // instead.
            let until = Instant::now() + Duration::from_millis(200);
            while Instant::now() < until && self.reader.lock().unwrap_or_else(|p| p.into_inner()).as_ref().is_some_and(|h| !h.is_finished())
            {
                self.reading.drive_once();
                std::thread::sleep(Duration::from_millis(2));
            }
            // A broken connection is only a suspect for a moment (see `Events::suspects`):
            // wait for its grace too, then report the best-known cause.
            let settle = Instant::now() + crate::inbox::SUSPECT_GRACE + Duration::from_millis(20);
            if let Some(fault) = self.inbox.root_cause(settle) {
                let _ = self.ctl.shutdown(Shutdown::Both);
                return fault.to_error(self.rank, &Op::other(format!("tcp {what} to rank {}", self.peer)), None);
            }
        }
        let _ = self.ctl.shutdown(Shutdown::Both);
        self.io_err(what, e, start)
    }

    fn send_frame(&self, first: &[&[u8]], body: Option<Body<'_>>, deadline: Instant, what: &str) -> Result<()> {
        let mut w = self.writer.lock().unwrap_or_else(|e| e.into_inner());
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
        let Ok(mut w) = self.writer.try_lock() else {
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
        let Wr { s, tail } = &mut *w;
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
                let _ = self.ctl.shutdown(Shutdown::Both);
                Err(self.io_err("send", std::io::Error::from(e), start))
            }
        }
    }

    /// Shuts the socket down (after a fatal error); the reader thread ends.
    pub(crate) fn cut(&self) {
        self.closing.store(true, Ordering::Release);
        let _ = self.ctl.shutdown(Shutdown::Both);
        self.reading.drive.kick();
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
        let hdr = header(K_WRITE, imm, len as u64, dst.key, w.dst_addr(0));
        src.with_slice(offset, len, |b| self.send_frame(&[&hdr, b], None, deadline, "write"))
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
        if let Ok(mut w) = self.writer.try_lock() {
            let _ = self.send_frame_locked(&mut w, &[&header(K_BYE, 0, 0, 0, 0)], None, deadline, "goodbye");
        }
        let _ = self.ctl.shutdown(Shutdown::Both);
        self.reading.drive.kick();
        if let Some(h) = self.reader.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = h.join();
        }
    }
}

impl Drop for TcpEndpoint {
    fn drop(&mut self) {
        self.close(Instant::now() + Duration::from_millis(200));
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
        K_MSG | K_WRITE => usize::try_from(len).map_err(|_| format!("sent a write of {len} bytes")),
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
        loop {
            if rd.ended {
                return moved;
            }
            // A one-sided write larger than the stage, received in place piece by piece.
            if let Some(part) = rd.part {
                match self.continue_write(rd, part) {
                    Step::Done => moved = true,
                    Step::More(got) => return moved || got,
                    Step::Failed => return self.end(rd),
                }
            }
            while rd.hi - rd.lo >= HDR {
                let mut h = [0u8; HDR];
                h.copy_from_slice(&rd.stage[rd.lo..rd.lo + HDR]);
                let need = match body_len(&h) {
                    Ok(n) => n,
                    Err(why) => {
                        self.fail(why);
                        return self.end(rd);
                    }
                };
                if rd.hi - rd.lo - HDR >= need {
                    let at = rd.lo + HDR;
                    let ok = self.land(&h, &mut &rd.stage[at..at + need]);
                    rd.lo = at + need;
                    moved = true;
                    if !ok {
                        return self.end(rd);
                    }
                    continue;
                }
                if HDR + need <= rd.stage.len() {
                    break;
                }
                if h[0] == K_WRITE {
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
                let Rd { s, stage, lo, hi, .. } = rd;
                let ok = self.land(&h, &mut Read::chain(&stage[*lo + HDR..*hi], &*s));
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
                self.inbox.write_imm(peer, u32_at(h, 4));
                self.inbox.notify();
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
        self.inbox.notify();
        true
    }

    /// Lands the frame with header `h` (its body length checked by [`body_len`]), its body
    /// read from `r`. Whether the stream goes on.
    fn land(&self, h: &[u8; HDR], r: &mut impl Read) -> bool {
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
            K_WRITE => {
                let landed = inbox.land_write(TransportKind::Tcp, peer, key, addr, len, |dst| {
                    r.read_exact(dst).map_err(|e| format!("TCP connection to rank {peer} broke mid-write: {e}"))
                });
                if landed.is_err() {
                    // The stream position is lost (or the write was refused): the
                    // connection cannot continue. land_write recorded why.
                    return false;
                }
                inbox.write_imm(peer, imm);
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
                inbox.peer_closed(peer);
                inbox.notify();
                return false;
            }
        }
        inbox.notify();
        true
    }
}

/// A socket's reader thread: reads the socket while no thread drives the mesh (or the
/// driver has stalled), and every frame a driver hands off.
fn reader_loop(r: &Reading, watch: &TcpStream) {
    use rustix::event::{poll, PollFd, PollFlags};
    let mut last_round = u64::MAX;
    loop {
        if r.closing.load(Ordering::Acquire) && r.rd.lock().map_or(true, |rd| rd.ended || rd.lo == rd.hi) {
            // Closing: whatever is still staged is of no use to anyone.
            return;
        }
        let w = r.drive.word.load(Ordering::SeqCst);
        let handoff = r.handoff.load(Ordering::Acquire);
        let mut nap = READER_NAP;
        if w & DRIVERS != 0 && !handoff {
            let round = r.drive.rounds.load(Ordering::Relaxed);
            if round != last_round {
                last_round = round;
                let _ = futex_wait(&r.drive.word, w, Some(DRIVER_STALL));
                continue;
            }
            // The driver has not been round for a while: read for it, briefly.
            nap = DRIVER_STALL;
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
        if let Ok(setup) = TcpSetup::listen(0, "::1".parse().unwrap()) {
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
        let ep = TcpEndpoint::start(0, 1, a, Arc::new(Inbox::new(0, Bell::heap())), Arc::new(Drive::default()), STAGE_MIN).unwrap();
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
}
