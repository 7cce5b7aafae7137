//! The bootstrap key-value store: a small TCP server (run by the launcher or by rank 0) and
//! its client.
//!
//! # Wire format
//!
//! Every connection first passes the mutual token handshake of `bootstrap::auth` (context
//! `"store"`) within [`AUTH_TIMEOUT`]; a connection that fails it is closed without a byte of
//! store data. The server then sends one info frame (`OK | max_value u64`) so that the client
//! can refuse oversize values before sending them.
//!
//! After that, the client sends requests and the server answers each with one reply. A frame
//! is `len u32 | body`, `len` counting the body; a body is an opcode (requests) or a status
//! (replies) followed by fields written with `crate::wire` (strings and byte strings are
//! `u32` length + bytes):
//!
//! | opcode | request fields | OK reply fields |
//! |---|---|---|
//! | 1 set | key, value | |
//! | 2 get | timeout_ms u64, key | value |
//! | 3 multi_get | timeout_ms u64, n u32, n keys | n values |
//! | 4 wait | timeout_ms u64, n u32, n keys | |
//! | 5 try_get | key | present u8, value if present |
//! | 6 add | key, delta i64 | new value i64 |
//! | 7 delete | key | existed u8 |
//! | 8 num_keys | | count u64 |
//!
//! Reply statuses: `0` OK, `1` error (a reason string), `2` timed out (n u32, the n keys
//! still missing).
//!
//! # Limits and hostile input
//!
//! The server reads a frame's length before its body and refuses frames longer than
//! `max_value + 64 KiB` (it answers with an error and closes the connection, since it cannot
//! skip the body safely); a body is read incrementally, so memory follows the bytes actually
//! received, never a length a peer announces. Malformed bodies and unknown opcodes are
//! answered with an error and the connection is closed. Keys over [`MAX_KEY`] bytes and
//! values over `max_value` are refused with an error reply, and the connection stays usable.
//! A whole frame (length and body) must arrive within 30 s of its first byte, however it
//! trickles in; a slower one is cut (and counted as a bad frame).
//!
//! Connections that have not passed the handshake yet are bounded by [`MAX_PENDING`]: when
//! one more arrives, the oldest of them is shed (closed) to make room, so idle or slow
//! strangers can never lock a job's ranks out (a rank's handshake takes a millisecond; a
//! rank that was shed all the same connects again until its deadline). At most
//! [`MAX_CONNECTIONS`] authenticated connections are served at once; one more is told so
//! (an error frame in place of the info frame) and closed, and its client retries until its
//! deadline. Nothing a peer sends can make the server panic.
//!
//! Blocking requests (get, multi_get, wait) wait on the server with a condition variable,
//! for the client's timeout; a connection whose client goes away mid-wait is noticed within
//! about a second, and shutdown wakes every waiter at once.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crate::bootstrap::auth;
use crate::error::{Error, Op, Result};
use crate::wire::{DecodeError, Reader, Writer};

/// Longest key the store accepts, in bytes.
pub const MAX_KEY: usize = 4096;
/// Most authenticated connections one server serves at once; one more is refused (with an
/// error frame) after its handshake.
pub const MAX_CONNECTIONS: usize = 1024;
/// Most connections waiting for their handshake at once; one more sheds the oldest.
pub const MAX_PENDING: usize = 256;
/// How long a new connection has to pass the token handshake before it is dropped.
pub const AUTH_TIMEOUT: Duration = Duration::from_secs(10);
/// Room for a request's opcode, key and lengths on top of its value.
const FRAME_SLACK: usize = 64 * 1024;
/// How long the rest of a frame may take once its length has arrived (both directions).
const BODY_TIMEOUT: Duration = Duration::from_secs(30);
/// Extra time the client gives the server beyond a request's own timeout.
const CLIENT_MARGIN: Duration = Duration::from_secs(5);
/// How often a waiting server thread checks that its client is still connected.
const LIVENESS_EVERY: Duration = Duration::from_secs(1);
/// How often the accept loop looks at the stop flag when no one connects.
const ACCEPT_POLL: Duration = Duration::from_millis(10);
/// Longest wait the server honours (longer requests are clamped).
const MAX_WAIT: Duration = Duration::from_secs(30 * 24 * 3600);

mod op {
    pub(super) const SET: u8 = 1;
    pub(super) const GET: u8 = 2;
    pub(super) const MULTI_GET: u8 = 3;
    pub(super) const WAIT: u8 = 4;
    pub(super) const TRY_GET: u8 = 5;
    pub(super) const ADD: u8 = 6;
    pub(super) const DELETE: u8 = 7;
    pub(super) const NUM_KEYS: u8 = 8;
}

const ST_OK: u8 = 0;
const ST_ERR: u8 = 1;
const ST_TIMEOUT: u8 = 2;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn value_too_big(n: usize, max: usize) -> String {
    format!("value of {n} bytes exceeds the store's limit of {max} (FERROCCL_STORE_MAX_VALUE)")
}

fn key_too_long(n: usize) -> String {
    format!("key of {n} bytes exceeds the store's limit of {MAX_KEY} bytes")
}

/// Counters of what a [`StoreServer`] has seen since it started.
#[derive(Debug, Clone, Copy, Default)]
pub struct StoreStats {
    /// Connections accepted (before authentication).
    pub connections: u64,
    /// Connections refused at the token check (wrong token, no proof in time).
    pub refused_auth: u64,
    /// Malformed frames or handshakes: garbage, truncated frames, unknown opcodes, frames
    /// over the size limit.
    pub bad_frames: u64,
    /// Authenticated connections refused because [`MAX_CONNECTIONS`] were already served.
    pub refused_busy: u64,
    /// Connections closed before their handshake to make room for a newer one
    /// ([`MAX_PENDING`] were waiting).
    pub shed_pending: u64,
    /// Well-formed requests refused: keys or values over the limits.
    pub refused_requests: u64,
}

#[derive(Default)]
struct Counters {
    connections: AtomicU64,
    refused_auth: AtomicU64,
    bad_frames: AtomicU64,
    refused_busy: AtomicU64,
    shed_pending: AtomicU64,
    refused_requests: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

struct Data {
    map: HashMap<String, Vec<u8>>,
    shutdown: bool,
}

/// Where a connection stands.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Waiting for its handshake.
    Pending,
    /// Authenticated: a member of the job.
    Member,
    /// Closed to make room; its thread is on its way out.
    Shed,
}

/// One open connection: a handle on its socket (to shut it down), its thread, its stage.
struct ConnEntry {
    sock: TcpStream,
    thread: JoinHandle<()>,
    stage: Stage,
}

/// Limits of a server (tests make them small).
#[derive(Clone, Copy)]
pub(crate) struct Limits {
    pub(crate) max_conns: usize,
    pub(crate) max_pending: usize,
    /// How long a whole frame may take from its first byte.
    pub(crate) frame_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_conns: MAX_CONNECTIONS, max_pending: MAX_PENDING, frame_timeout: BODY_TIMEOUT }
    }
}

struct ServerState {
    token: String,
    max_value: usize,
    limits: Limits,
    data: Mutex<Data>,
    changed: Condvar,
    stop: AtomicBool,
    /// Open connections by id (ids grow with arrival: the smallest pending one is the oldest).
    conns: Mutex<HashMap<u64, ConnEntry>>,
    stats: Counters,
}

impl ServerState {
    fn max_frame(&self) -> usize {
        self.max_value + FRAME_SLACK
    }
}

/// The store's server: one thread accepting connections and one thread per connection.
///
/// Served by the launcher (`ferroccl-run`) or by rank 0 under other launchers. Dropping it
/// or calling [`StoreServer::shutdown`] stops accepting, wakes every waiting request, closes
/// every connection and joins every thread.
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<ServerState>,
    acceptor: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for StoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreServer")
            .field("addr", &self.addr)
            .field("max_value", &self.shared.max_value)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl StoreServer {
    /// Binds `bind` (port 0 picks a free port: see [`StoreServer::addr`]) and starts serving.
    /// Every connection must prove it knows `token`; values over `max_value` bytes are
    /// refused.
    pub fn start(bind: SocketAddr, token: &str, max_value: usize) -> Result<StoreServer> {
        Self::start_with(bind, token, max_value, Limits::default())
    }

    pub(crate) fn start_with(bind: SocketAddr, token: &str, max_value: usize, limits: Limits) -> Result<StoreServer> {
        if token.is_empty() {
            return Err(Error::invalid("the store's job token is empty"));
        }
        let limit = u32::MAX as usize - FRAME_SLACK;
        if max_value > limit {
            return Err(Error::invalid(format!(
                "store max_value {max_value} is over the wire limit of {limit} bytes (FERROCCL_STORE_MAX_VALUE)"
            )));
        }
        let listener = TcpListener::bind(bind).map_err(|e| Error::io(format!("bind the store to {bind}"), e))?;
        let addr = listener.local_addr().map_err(|e| Error::io("read the store's bound address", e))?;
        listener.set_nonblocking(true).map_err(|e| Error::io(format!("make the store listener {addr} non-blocking"), e))?;
        let shared = Arc::new(ServerState {
            token: token.to_owned(),
            max_value,
            limits: Limits { max_conns: limits.max_conns.max(1), max_pending: limits.max_pending.max(1), ..limits },
            data: Mutex::new(Data { map: HashMap::new(), shutdown: false }),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
            conns: Mutex::new(HashMap::new()),
            stats: Counters::default(),
        });
        let sh = Arc::clone(&shared);
        let acceptor = thread::Builder::new()
            .name("ferroccl-store-accept".into())
            .spawn(move || accept_loop(listener, sh))
            .map_err(|e| Error::io("spawn the store's accept thread", e))?;
        Ok(StoreServer { addr, shared, acceptor: Some(acceptor) })
    }

    /// The address the server listens on, with the real port when bound to port 0 (and the
    /// unspecified IP when bound to `0.0.0.0` / `::`).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// A snapshot of the server's counters.
    pub fn stats(&self) -> StoreStats {
        let s = &self.shared.stats;
        StoreStats {
            connections: s.connections.load(Ordering::Relaxed),
            refused_auth: s.refused_auth.load(Ordering::Relaxed),
            bad_frames: s.bad_frames.load(Ordering::Relaxed),
            refused_busy: s.refused_busy.load(Ordering::Relaxed),
            shed_pending: s.shed_pending.load(Ordering::Relaxed),
            refused_requests: s.refused_requests.load(Ordering::Relaxed),
        }
    }

    /// Connections currently open (each holds one server thread).
    #[cfg(test)]
    pub(crate) fn open_connections(&self) -> usize {
        lock(&self.shared.conns).len()
    }

    /// Stops accepting, wakes waiting requests (they get an error), closes every connection
    /// and joins every thread. Dropping the server does the same.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        lock(&self.shared.data).shutdown = true;
        self.shared.changed.notify_all();
        if let Some(a) = self.acceptor.take() {
            let _ = a.join();
        }
        // The acceptor has exited: no connection can be added any more.
        let conns: Vec<_> = lock(&self.shared.conns).drain().map(|(_, c)| c).collect();
        for c in &conns {
            let _ = c.sock.shutdown(Shutdown::Both);
        }
        for c in conns {
            let _ = c.thread.join();
        }
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop();
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<ServerState>) {
    let mut next_id: u64 = 0;
    while !shared.stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((s, peer)) => {
                bump(&shared.stats.connections);
                next_id += 1;
                admit(&shared, s, peer, next_id);
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            // WouldBlock: nobody is connecting; anything else (EMFILE, ...): back off a bit.
            Err(_) => thread::sleep(ACCEPT_POLL),
        }
    }
}

fn admit(shared: &Arc<ServerState>, s: TcpStream, peer: SocketAddr, id: u64) {
    // Accepted sockets must block (whether they inherit the listener's mode is platform
    // specific).
    if s.set_nonblocking(false).is_err() {
        return;
    }
    let mut conns = lock(&shared.conns);
    // Room for one more stranger: shed the oldest one still in its handshake.
    let pending: Vec<u64> = conns.iter().filter(|(_, c)| c.stage == Stage::Pending).map(|(&i, _)| i).collect();
    if pending.len() >= shared.limits.max_pending {
        if let Some(oldest) = pending.iter().min().and_then(|i| conns.get_mut(i)) {
            oldest.stage = Stage::Shed;
            let _ = oldest.sock.shutdown(Shutdown::Both);
            bump(&shared.stats.shed_pending);
        }
    }
    let Ok(handle) = s.try_clone() else { return };
    let sh = Arc::clone(shared);
    let spawned = thread::Builder::new().name("ferroccl-store-conn".into()).spawn(move || {
        serve(&sh, s, id, &format!("store client {peer}"));
        // Drops our own JoinHandle (the thread is ending anyway).
        lock(&sh.conns).remove(&id);
    });
    if let Ok(thread) = spawned {
        conns.insert(id, ConnEntry { sock: handle, thread, stage: Stage::Pending });
    }
}

/// Moves connection `id` from pending to member, unless that would exceed the limit (or it
/// was shed meanwhile). Returns whether it may go on.
fn admit_member(shared: &ServerState, id: u64) -> std::result::Result<(), String> {
    let mut conns = lock(&shared.conns);
    let members = conns.values().filter(|c| c.stage == Stage::Member).count();
    let Some(me) = conns.get_mut(&id) else { return Err(String::new()) };
    if me.stage == Stage::Shed {
        return Err(String::new());
    }
    if members >= shared.limits.max_conns {
        return Err(format!(
            "the store is serving its maximum of {} connections (ferroccl store MAX_CONNECTIONS); try again later",
            shared.limits.max_conns
        ));
    }
    me.stage = Stage::Member;
    Ok(())
}

/// What to do after answering a request.
enum After {
    Continue,
    Close,
}

fn serve(shared: &ServerState, mut s: TcpStream, id: u64, peer: &str) {
    let _ = s.set_nodelay(true);
    match auth::server_handshake(&mut s, &shared.token, "store", peer, Instant::now() + AUTH_TIMEOUT) {
        Ok(()) => {}
        Err(Error::Auth { .. }) => return bump(&shared.stats.refused_auth),
        Err(Error::Protocol { .. }) => return bump(&shared.stats.bad_frames),
        Err(_) => return,
    }
    if s.set_write_timeout(Some(BODY_TIMEOUT)).is_err() {
        return;
    }
    if let Err(why) = admit_member(shared, id) {
        if !why.is_empty() {
            bump(&shared.stats.refused_busy);
            let _ = send_frame(&mut s, &err_reply(&why));
        }
        return;
    }
    let mut info = Writer::new();
    info.u8(ST_OK).u64(shared.max_value as u64);
    if send_frame(&mut s, &info.finish()).is_err() {
        return;
    }
    while !shared.stop.load(Ordering::SeqCst) {
        let body = match read_request(shared, &mut s) {
            Ok(Some(b)) => b,
            Ok(None) => return,
            Err(reply) => {
                bump(&shared.stats.bad_frames);
                if let Some(r) = reply {
                    let _ = send_frame(&mut s, &r);
                }
                return;
            }
        };
        let (reply, after) = handle(shared, &s, &body);
        // An empty reply means the client is gone: nothing to send.
        if reply.is_empty() || send_frame(&mut s, &reply).is_err() {
            return;
        }
        if let After::Close = after {
            return;
        }
    }
}

/// Reads one request body. `Ok(None)`: the client closed cleanly (or shutdown closed the
/// socket) between frames. `Err(reply)`: a bad frame, with the error reply to send if any.
fn read_request(shared: &ServerState, s: &mut TcpStream) -> std::result::Result<Option<Vec<u8>>, Option<Vec<u8>>> {
    if s.set_read_timeout(None).is_err() {
        return Ok(None);
    }
    // The whole frame must arrive within `frame_timeout` of its first byte, however slowly
    // it trickles: before each read, the read timeout is what is left of that.
    let mut deadline = None;
    let arm = |s: &TcpStream, deadline: Instant| -> bool {
        let left = deadline.saturating_duration_since(Instant::now());
        !left.is_zero() && s.set_read_timeout(Some(left)).is_ok()
    };
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match s.read(&mut len[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(None),
            Ok(n) => {
                got += n;
                let d = *deadline.get_or_insert_with(|| Instant::now() + shared.limits.frame_timeout);
                if !arm(s, d) {
                    return Err(None);
                }
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) if got == 0 => return Ok(None),
            Err(_) => return Err(None),
        }
    }
    let deadline = deadline.unwrap_or_else(|| Instant::now() + shared.limits.frame_timeout);
    let len = u32::from_le_bytes(len) as usize;
    if len == 0 {
        return Err(Some(err_reply("malformed request: empty frame")));
    }
    if len > shared.max_frame() {
        return Err(Some(err_reply(&format!(
            "request frame of {len} bytes exceeds the store's limit of {} bytes \
             (FERROCCL_STORE_MAX_VALUE + 64 KiB); closing the connection",
            shared.max_frame()
        ))));
    }
    // Grows with the bytes that actually arrive, never to an announced size up front.
    let mut body = Vec::new();
    let mut chunk = vec![0u8; len.min(64 * 1024)];
    while body.len() < len {
        if !arm(s, deadline) {
            return Err(None);
        }
        let want = (len - body.len()).min(chunk.len());
        match s.read(&mut chunk[..want]) {
            Ok(0) => return Err(None),
            Ok(n) => body.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return Err(None),
        }
    }
    Ok(Some(body))
}

fn err_reply(reason: &str) -> Vec<u8> {
    let mut w = Writer::new();
    w.u8(ST_ERR).str(reason);
    w.finish()
}

fn send_frame(s: &mut TcpStream, body: &[u8]) -> std::io::Result<()> {
    let len = u32::try_from(body.len()).map_err(|_| std::io::Error::new(ErrorKind::InvalidData, "frame over 4 GiB"))?;
    let mut f = Vec::with_capacity(4 + body.len());
    f.extend_from_slice(&len.to_le_bytes());
    f.extend_from_slice(body);
    s.write_all(&f)
}

/// A decoded request.
enum Req<'a> {
    Set(&'a str, &'a [u8]),
    Get(Duration, &'a str),
    MultiGet(Duration, Vec<&'a str>),
    Wait(Duration, Vec<&'a str>),
    TryGet(&'a str),
    Add(&'a str, i64),
    Delete(&'a str),
    NumKeys,
}

/// Why a request was not decoded.
enum Bad {
    /// Not a frame we understand: refuse and close.
    Malformed(String),
    /// Well formed but over a limit: refuse, keep the connection.
    Refused(String),
}

impl From<DecodeError> for Bad {
    fn from(e: DecodeError) -> Self {
        Bad::Malformed(format!("malformed request: {e}"))
    }
}

fn key<'a>(r: &mut Reader<'a>) -> std::result::Result<&'a str, Bad> {
    let k = r.str()?;
    if k.len() > MAX_KEY {
        return Err(Bad::Refused(key_too_long(k.len())));
    }
    Ok(k)
}

fn keys<'a>(r: &mut Reader<'a>) -> std::result::Result<Vec<&'a str>, Bad> {
    let n = r.u32()? as usize;
    // Each key takes at least its 4-byte length: never reserve more than the frame can hold.
    let mut ks = Vec::with_capacity(n.min(r.remaining() / 4));
    for _ in 0..n {
        ks.push(key(r)?);
    }
    Ok(ks)
}

fn wait_time(r: &mut Reader<'_>) -> std::result::Result<Duration, Bad> {
    Ok(Duration::from_millis(r.u64()?).min(MAX_WAIT))
}

fn decode(body: &[u8], max_value: usize) -> std::result::Result<Req<'_>, Bad> {
    let mut r = Reader::new(body);
    let req = match r.u8()? {
        op::SET => {
            let k = key(&mut r)?;
            let v = r.bytes()?;
            if v.len() > max_value {
                return Err(Bad::Refused(value_too_big(v.len(), max_value)));
            }
            Req::Set(k, v)
        }
        op::GET => {
            let t = wait_time(&mut r)?;
            Req::Get(t, key(&mut r)?)
        }
        op::MULTI_GET => {
            let t = wait_time(&mut r)?;
            Req::MultiGet(t, keys(&mut r)?)
        }
        op::WAIT => {
            let t = wait_time(&mut r)?;
            Req::Wait(t, keys(&mut r)?)
        }
        op::TRY_GET => Req::TryGet(key(&mut r)?),
        op::ADD => {
            let k = key(&mut r)?;
            Req::Add(k, r.i64()?)
        }
        op::DELETE => Req::Delete(key(&mut r)?),
        op::NUM_KEYS => Req::NumKeys,
        other => return Err(Bad::Malformed(format!("unknown opcode {other}"))),
    };
    r.end()?;
    Ok(req)
}

/// The outcome of a blocking wait.
enum Waited {
    Ready(Vec<Vec<u8>>),
    TimedOut(Vec<String>),
    Shutdown,
    ClientGone,
}

/// Is the client still connected? (A peek that sees end-of-file or an error says no.)
fn client_alive(s: &TcpStream) -> bool {
    if s.set_nonblocking(true).is_err() {
        return false;
    }
    let alive = match s.peek(&mut [0u8; 1]) {
        Ok(0) => false,
        Ok(_) => true,
        Err(e) => matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted),
    };
    s.set_nonblocking(false).is_ok() && alive
}

fn wait_for(shared: &ServerState, s: &TcpStream, keys: &[&str], timeout: Duration) -> Waited {
    let start = Instant::now();
    let deadline = start + timeout;
    let mut last_check = start;
    let mut data = lock(&shared.data);
    loop {
        if data.shutdown {
            return Waited::Shutdown;
        }
        if keys.iter().all(|k| data.map.contains_key(*k)) {
            return Waited::Ready(keys.iter().map(|k| data.map.get(*k).cloned().unwrap_or_default()).collect());
        }
        let now = Instant::now();
        if now >= deadline {
            let missing = keys.iter().filter(|k| !data.map.contains_key(**k)).map(|k| (*k).to_owned()).collect();
            return Waited::TimedOut(missing);
        }
        if now.duration_since(last_check) >= LIVENESS_EVERY {
            drop(data);
            if !client_alive(s) {
                return Waited::ClientGone;
            }
            last_check = Instant::now();
            data = lock(&shared.data);
            continue;
        }
        let slice = (deadline - now).min(LIVENESS_EVERY);
        data = shared.changed.wait_timeout(data, slice).unwrap_or_else(|p| p.into_inner()).0;
    }
}

fn handle(shared: &ServerState, s: &TcpStream, body: &[u8]) -> (Vec<u8>, After) {
    let req = match decode(body, shared.max_value) {
        Ok(r) => r,
        Err(Bad::Malformed(why)) => {
            bump(&shared.stats.bad_frames);
            return (err_reply(&why), After::Close);
        }
        Err(Bad::Refused(why)) => {
            bump(&shared.stats.refused_requests);
            return (err_reply(&why), After::Continue);
        }
    };
    let mut w = Writer::new();
    match req {
        Req::Set(k, v) => {
            lock(&shared.data).map.insert(k.to_owned(), v.to_vec());
            shared.changed.notify_all();
            w.u8(ST_OK);
        }
        Req::Get(t, k) => return waited(shared, s, &[k], t, false),
        Req::MultiGet(t, ks) => return waited(shared, s, &ks, t, true),
        Req::Wait(t, ks) => {
            return match wait_for(shared, s, &ks, t) {
                Waited::Ready(_) => (vec![ST_OK], After::Continue),
                other => not_ready(other),
            }
        }
        Req::TryGet(k) => {
            let data = lock(&shared.data);
            match data.map.get(k) {
                Some(v) => w.u8(ST_OK).u8(1).bytes(v),
                None => w.u8(ST_OK).u8(0),
            };
        }
        Req::Add(k, delta) => {
            let mut data = lock(&shared.data);
            let old = match data.map.get(k) {
                None => 0,
                Some(v) => match <[u8; 8]>::try_from(v.as_slice()) {
                    Ok(b) => i64::from_le_bytes(b),
                    Err(_) => {
                        let why = format!("key {k:?} holds {} bytes, not an 8-byte counter", v.len());
                        return (err_reply(&why), After::Continue);
                    }
                },
            };
            let Some(new) = old.checked_add(delta) else {
                return (err_reply(&format!("counter {k:?} would overflow ({old} + {delta})")), After::Continue);
            };
            data.map.insert(k.to_owned(), new.to_le_bytes().to_vec());
            drop(data);
            shared.changed.notify_all();
            w.u8(ST_OK).i64(new);
        }
        Req::Delete(k) => {
            let existed = lock(&shared.data).map.remove(k).is_some();
            w.u8(ST_OK).u8(u8::from(existed));
        }
        Req::NumKeys => {
            let n = lock(&shared.data).map.len();
            w.u8(ST_OK).u64(n as u64);
        }
    }
    (w.finish(), After::Continue)
}

fn waited(shared: &ServerState, s: &TcpStream, ks: &[&str], t: Duration, multi: bool) -> (Vec<u8>, After) {
    let values = match wait_for(shared, s, ks, t) {
        Waited::Ready(v) => v,
        other => return not_ready(other),
    };
    let total: usize = 1 + 4 + values.iter().map(|v| 4 + v.len()).sum::<usize>();
    if total > u32::MAX as usize {
        return (err_reply(&format!("reply of {total} bytes does not fit in one frame; ask for fewer keys at a time")), After::Continue);
    }
    let mut w = Writer::new();
    w.u8(ST_OK);
    if multi {
        w.u32(values.len() as u32);
    }
    for v in &values {
        w.bytes(v);
    }
    (w.finish(), After::Continue)
}

fn not_ready(w: Waited) -> (Vec<u8>, After) {
    match w {
        Waited::TimedOut(missing) => {
            let mut w = Writer::new();
            w.u8(ST_TIMEOUT).u32(missing.len() as u32);
            for k in &missing {
                w.str(k);
            }
            (w.finish(), After::Continue)
        }
        Waited::Shutdown => (err_reply("the store is shutting down"), After::Close),
        // The reply will not be read; closing is all that is left.
        Waited::ClientGone | Waited::Ready(_) => (Vec::new(), After::Close),
    }
}

#[derive(Debug)]
struct Conn {
    stream: TcpStream,
    /// Set after an I/O or protocol error leaves the stream out of step.
    broken: Option<String>,
}

/// A connection to the store. `Send + Sync`: requests from several threads are serialized
/// on one socket.
///
/// Requests that do not wait (set, try_get, add, delete, num_keys) fail if the store does
/// not answer within the operation timeout (the `timeout` given to
/// [`StoreClient::connect`], at least 5 s); waiting requests get their own timeout plus a
/// margin of 5 s. After an I/O or protocol error the connection is marked broken and every
/// later request fails with the first error.
#[derive(Debug)]
pub struct StoreClient {
    addr: String,
    local: SocketAddr,
    rank: usize,
    max_value: usize,
    op_timeout: Duration,
    conn: Mutex<Conn>,
}

impl StoreClient {
    /// Connects to the store at `addr` (`host:port`), retrying until `timeout` passes (the
    /// server may not be listening yet), then proves the job `token` and checks the
    /// server's proof. `rank` names this process in errors.
    ///
    /// A connection the server closes during the handshake (it sheds the oldest
    /// unauthenticated connections when flooded) or refuses as busy is tried again, with
    /// backoff, until `timeout`; a wrong token ([`Error::Auth`]) or a peer that is not a
    /// FerroCCL store fails at once.
    pub fn connect(addr: &str, token: &str, rank: usize, timeout: Duration) -> Result<StoreClient> {
        let start = Instant::now();
        let deadline = start + timeout;
        let mut pause = Duration::from_millis(10);
        let mut tries = 0u32;
        loop {
            tries += 1;
            match Self::connect_once(addr, token, rank, timeout, start) {
                Err(e) if Self::worth_retrying(&e) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(Error::Timeout {
                            rank: Some(rank),
                            op: Op::other("connect to the store"),
                            after: now - start,
                            waiting_for: vec![format!("store {addr} ({tries} tries; the last ended: {e})")],
                        });
                    }
                    thread::sleep(pause.min(deadline - now));
                    pause = (pause * 2).min(Duration::from_millis(200));
                }
                r => return r,
            }
        }
    }

    /// Whether a failed connection attempt says "try again" (shed, busy) rather than "never"
    /// (wrong token, not a store, our own deadline).
    fn worth_retrying(e: &Error) -> bool {
        match e {
            Error::Io { .. } => true,
            Error::Protocol { what, .. } => what.contains("connection closed"),
            Error::StoreRefused { reason, .. } => reason.contains("maximum of"),
            _ => false,
        }
    }

    /// One attempt: resolve, connect (every address once), authenticate, read the store's
    /// info. A failure to reach the store is an `Io` error, which [`Self::connect`] retries.
    fn connect_once(addr: &str, token: &str, rank: usize, timeout: Duration, start: Instant) -> Result<StoreClient> {
        let deadline = start + timeout;
        let unreachable = |e: std::io::Error| Error::io(format!("rank {rank}: connect to store {addr}"), e);
        let mut last = std::io::Error::new(ErrorKind::NotFound, format!("{addr:?} resolves to no address"));
        let mut stream = None;
        for a in addr.to_socket_addrs().map_err(unreachable)? {
            let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(10));
            match TcpStream::connect_timeout(&a, left.min(Duration::from_secs(2))) {
                Ok(s) => {
                    stream = Some(s);
                    break;
                }
                Err(e) => last = e,
            }
        }
        let mut stream = stream.ok_or_else(|| unreachable(last))?;
        let peer = format!("store {addr}");
        let _ = stream.set_nodelay(true);
        let hs_deadline = deadline.max(Instant::now() + Duration::from_secs(5));
        auth::client_handshake(&mut stream, token, "store", &peer, hs_deadline)?;
        let local = stream.local_addr().map_err(|e| Error::io(format!("local address of {peer}"), e))?;
        let op_timeout = timeout.max(Duration::from_secs(5));
        let mut conn = Conn { stream, broken: None };
        let info = read_reply(&mut conn.stream, &peer, rank, "connect", op_timeout)?;
        if info.first() == Some(&ST_ERR) {
            let mut r = Reader::new(&info[1..]);
            let reason = r.str().map(str::to_string).unwrap_or_else(|_| "an unreadable reason".into());
            return Err(Error::StoreRefused { op: "connect", reason });
        }
        let mut r = Reader::new(&info);
        let max_value = (|| -> std::result::Result<u64, DecodeError> {
            if r.u8()? != ST_OK {
                return Err(DecodeError("the store's info frame does not start with OK".into()));
            }
            let m = r.u64()?;
            r.end()?;
            Ok(m)
        })()
        .map_err(|e| Error::protocol(&peer, format!("bad info frame: {e}")))?;
        Ok(StoreClient {
            addr: addr.to_owned(),
            local,
            rank,
            max_value: usize::try_from(max_value).unwrap_or(usize::MAX),
            op_timeout,
            conn: Mutex::new(conn),
        })
    }

    /// This side's address of the connection (the interface that reaches the store, worth
    /// advertising to peers).
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Stores `value` under `key`, replacing any previous value and waking waiters.
    ///
    /// A value over the store's limit is refused with [`Error::StoreRefused`] before
    /// anything is sent, so the connection stays usable.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.check_key("set", key)?;
        if value.len() > self.max_value {
            return Err(Error::StoreRefused { op: "set", reason: value_too_big(value.len(), self.max_value) });
        }
        let mut w = Writer::new();
        w.u8(op::SET).str(key).bytes(value);
        let body = self.call("set", &w.finish(), None)?;
        self.done("set", &body)
    }

    /// The value of `key`, waiting up to `timeout` for another rank to set it.
    pub fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.check_key("get", key)?;
        let mut w = Writer::new();
        w.u8(op::GET).u64(millis(timeout)).str(key);
        let body = self.call("get", &w.finish(), Some(timeout))?;
        let mut r = Reader::new(&body);
        let v = r.bytes().and_then(|v| r.end().map(|()| v.to_vec()));
        v.map_err(|e| self.bad_reply("get", e))
    }

    /// The values of all `keys`, in order, waiting up to `timeout` for all of them: one
    /// round trip.
    pub fn multi_get(&self, keys: &[String], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        let req = self.keys_request("multi_get", op::MULTI_GET, keys, timeout)?;
        let body = self.call("multi_get", &req, Some(timeout))?;
        let mut r = Reader::new(&body);
        let decoded = (|| {
            let n = r.u32()? as usize;
            if n != keys.len() {
                return Err(DecodeError(format!("{n} values for {} keys", keys.len())));
            }
            let mut out = Vec::with_capacity(n);
            for _ in 0..n {
                out.push(r.bytes()?.to_vec());
            }
            r.end()?;
            Ok(out)
        })();
        decoded.map_err(|e| self.bad_reply("multi_get", e))
    }

    /// Waits up to `timeout` until every key in `keys` exists.
    pub fn wait(&self, keys: &[String], timeout: Duration) -> Result<()> {
        let req = self.keys_request("wait", op::WAIT, keys, timeout)?;
        let body = self.call("wait", &req, Some(timeout))?;
        self.done("wait", &body)
    }

    /// The value of `key` if it exists now; does not wait.
    pub fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        self.check_key("try_get", key)?;
        let mut w = Writer::new();
        w.u8(op::TRY_GET).str(key);
        let body = self.call("try_get", &w.finish(), None)?;
        let mut r = Reader::new(&body);
        let decoded = (|| {
            let v = match r.u8()? {
                0 => None,
                1 => Some(r.bytes()?.to_vec()),
                x => return Err(DecodeError(format!("presence byte {x}"))),
            };
            r.end()?;
            Ok(v)
        })();
        decoded.map_err(|e| self.bad_reply("try_get", e))
    }

    /// Adds `delta` to the counter at `key` (an 8-byte little-endian integer, created at 0)
    /// and returns the new value. Overflow and non-counter values are refused.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.check_key("add", key)?;
        let mut w = Writer::new();
        w.u8(op::ADD).str(key).i64(delta);
        let body = self.call("add", &w.finish(), None)?;
        let mut r = Reader::new(&body);
        let v = r.i64().and_then(|v| r.end().map(|()| v));
        v.map_err(|e| self.bad_reply("add", e))
    }

    /// Deletes `key`; returns whether it existed.
    pub fn delete(&self, key: &str) -> Result<bool> {
        self.check_key("delete", key)?;
        let mut w = Writer::new();
        w.u8(op::DELETE).str(key);
        let body = self.call("delete", &w.finish(), None)?;
        let mut r = Reader::new(&body);
        let v = r.u8().and_then(|v| r.end().map(|()| v != 0));
        v.map_err(|e| self.bad_reply("delete", e))
    }

    /// How many keys the store holds.
    pub fn num_keys(&self) -> Result<u64> {
        let body = self.call("num_keys", &[op::NUM_KEYS], None)?;
        let mut r = Reader::new(&body);
        let v = r.u64().and_then(|v| r.end().map(|()| v));
        v.map_err(|e| self.bad_reply("num_keys", e))
    }

    fn peer(&self) -> String {
        format!("store {}", self.addr)
    }

    fn check_key(&self, op: &'static str, key: &str) -> Result<()> {
        if key.len() > MAX_KEY {
            return Err(Error::StoreRefused { op, reason: key_too_long(key.len()) });
        }
        Ok(())
    }

    fn keys_request(&self, op: &'static str, code: u8, keys: &[String], timeout: Duration) -> Result<Vec<u8>> {
        for k in keys {
            self.check_key(op, k)?;
        }
        let size = 1 + 8 + 4 + keys.iter().map(|k| 4 + k.len()).sum::<usize>();
        let max = self.max_value.saturating_add(FRAME_SLACK);
        if size > max {
            return Err(Error::StoreRefused {
                op,
                reason: format!("request of {size} bytes ({} keys) exceeds the store's frame limit of {max}", keys.len()),
            });
        }
        let mut w = Writer::new();
        w.u8(code).u64(millis(timeout)).u32(keys.len() as u32);
        for k in keys {
            w.str(k);
        }
        Ok(w.finish())
    }

    fn done(&self, op: &'static str, body: &[u8]) -> Result<()> {
        Reader::new(body).end().map_err(|e| self.bad_reply(op, e))
    }

    fn bad_reply(&self, op: &str, e: DecodeError) -> Error {
        let err = Error::protocol(self.peer(), format!("bad reply to {op}: {e}"));
        lock(&self.conn).broken.get_or_insert_with(|| err.to_string());
        err
    }

    /// Sends one request and reads its reply; returns the reply's fields after an OK status.
    fn call(&self, op: &'static str, req: &[u8], wait: Option<Duration>) -> Result<Vec<u8>> {
        let peer = self.peer();
        let mut conn = lock(&self.conn);
        if let Some(first) = &conn.broken {
            return Err(Error::protocol(&peer, format!("connection unusable after an earlier error: {first}")));
        }
        let limit = wait.map_or(self.op_timeout, |w| w.saturating_add(CLIENT_MARGIN));
        let res = (|| {
            conn.stream.set_write_timeout(Some(self.op_timeout)).map_err(|e| Error::io(format!("set write timeout for {peer}"), e))?;
            send_frame(&mut conn.stream, req).map_err(|e| io_err(e, self.rank, op, &peer, self.op_timeout))?;
            read_reply(&mut conn.stream, &peer, self.rank, op, limit)
        })();
        let body = match res {
            Ok(b) => b,
            Err(e) => {
                conn.broken = Some(e.to_string());
                return Err(e);
            }
        };
        drop(conn);
        let mut r = Reader::new(&body);
        let status = r.u8().map_err(|e| self.bad_reply(op, e))?;
        match status {
            ST_OK => Ok(body[1..].to_vec()),
            ST_ERR => {
                let reason = r.str().map_err(|e| self.bad_reply(op, e))?;
                Err(Error::StoreRefused { op, reason: reason.to_owned() })
            }
            ST_TIMEOUT => {
                let decoded = (|| {
                    let n = r.u32()? as usize;
                    let mut missing = Vec::with_capacity(n.min(r.remaining() / 4));
                    for _ in 0..n {
                        missing.push(r.str()?.to_owned());
                    }
                    r.end()?;
                    Ok(missing)
                })();
                let missing = decoded.map_err(|e| self.bad_reply(op, e))?;
                Err(Error::Timeout {
                    rank: Some(self.rank),
                    op: Op::other("store wait"),
                    after: wait.unwrap_or_default(),
                    waiting_for: missing,
                })
            }
            other => Err(self.bad_reply(op, DecodeError(format!("unknown reply status {other}")))),
        }
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn io_err(e: std::io::Error, rank: usize, op: &str, peer: &str, after: Duration) -> Error {
    if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) {
        Error::Timeout { rank: Some(rank), op: Op::other(format!("store {op}: no answer")), after, waiting_for: vec![peer.to_owned()] }
    } else if e.kind() == ErrorKind::UnexpectedEof {
        Error::io(format!("rank {rank}: store {op}: {peer} closed the connection"), e)
    } else {
        Error::io(format!("rank {rank}: store {op} with {peer}"), e)
    }
}

/// Reads one reply frame (its body), allowing `limit` of silence per read.
fn read_reply(s: &mut TcpStream, peer: &str, rank: usize, op: &str, limit: Duration) -> Result<Vec<u8>> {
    s.set_read_timeout(Some(limit.max(Duration::from_millis(1)))).map_err(|e| Error::io(format!("set read timeout for {peer}"), e))?;
    let mut len = [0u8; 4];
    s.read_exact(&mut len).map_err(|e| io_err(e, rank, op, peer, limit))?;
    let len = u32::from_le_bytes(len) as u64;
    if len == 0 {
        return Err(Error::protocol(peer, format!("empty reply frame to {op}")));
    }
    let mut body = Vec::new();
    let n = s.take(len).read_to_end(&mut body).map_err(|e| io_err(e, rank, op, peer, limit))?;
    if n as u64 != len {
        return Err(io_err(ErrorKind::UnexpectedEof.into(), rank, op, peer, limit));
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const TOKEN: &str = "test-token-0123456789";
    const T: Duration = Duration::from_secs(5);

    fn server(max_value: usize) -> StoreServer {
        StoreServer::start("127.0.0.1:0".parse().unwrap(), TOKEN, max_value).unwrap()
    }

    fn client(s: &StoreServer) -> StoreClient {
        StoreClient::connect(&s.addr().to_string(), TOKEN, 0, T).unwrap()
    }

    fn keys(k: &[&str]) -> Vec<String> {
        k.iter().map(|s| s.to_string()).collect()
    }

    /// A raw, authenticated connection (info frame consumed).
    fn raw_authed(s: &StoreServer) -> TcpStream {
        let mut c = TcpStream::connect(s.addr()).unwrap();
        auth::client_handshake(&mut c, TOKEN, "store", "test", Instant::now() + T).unwrap();
        read_reply(&mut c, "test", 0, "info", T).unwrap();
        c
    }

    fn raw_request(c: &mut TcpStream, body: &[u8]) -> Vec<u8> {
        send_frame(c, body).unwrap();
        read_reply(c, "test", 0, "raw", T).unwrap()
    }

    fn assert_server_healthy(s: &StoreServer) {
        let c = client(s);
        c.set("health", b"ok").unwrap();
        assert_eq!(c.get("health", T).unwrap(), b"ok");
    }

    /// After the server closed `c`, reading gives end-of-file or an error, never data.
    fn assert_closed(c: &mut TcpStream) {
        c.set_read_timeout(Some(T)).unwrap();
        let mut b = [0u8; 64];
        match c.read(&mut b) {
            Ok(0) | Err(_) => {}
            Ok(n) => panic!("expected a closed connection, read {n} bytes: {:?}", &b[..n]),
        }
    }

    #[test]
    fn round_trips() {
        let s = server(1 << 20);
        let c = client(&s);
        assert_eq!(c.num_keys().unwrap(), 0);
        c.set("a", b"alpha").unwrap();
        c.set("b", b"").unwrap();
        c.set("a", b"alpha2").unwrap();
        assert_eq!(c.get("a", T).unwrap(), b"alpha2");
        assert_eq!(c.get("b", T).unwrap(), b"");
        assert_eq!(c.try_get("a").unwrap(), Some(b"alpha2".to_vec()));
        assert_eq!(c.try_get("zz").unwrap(), None);
        assert_eq!(c.multi_get(&keys(&["b", "a"]), T).unwrap(), vec![b"".to_vec(), b"alpha2".to_vec()]);
        assert_eq!(c.multi_get(&[], T).unwrap(), Vec::<Vec<u8>>::new());
        c.wait(&keys(&["a", "b"]), T).unwrap();
        assert_eq!(c.add("n", 5).unwrap(), 5);
        assert_eq!(c.add("n", -7).unwrap(), -2);
        assert_eq!(c.get("n", T).unwrap(), (-2i64).to_le_bytes());
        assert_eq!(c.num_keys().unwrap(), 3);
        assert!(c.delete("a").unwrap());
        assert!(!c.delete("a").unwrap());
        assert_eq!(c.num_keys().unwrap(), 2);
        // Adding to a non-counter is refused, and the connection stays usable.
        let e = c.add("b", 1).unwrap_err();
        assert!(matches!(e, Error::StoreRefused { op: "add", ref reason } if reason.contains("not an 8-byte counter")), "{e}");
        c.set(&"k".repeat(MAX_KEY), b"long key ok").unwrap();
        assert!(matches!(c.set(&"k".repeat(MAX_KEY + 1), b"x"), Err(Error::StoreRefused { op: "set", .. })));
        assert_eq!(c.get(&"k".repeat(MAX_KEY), T).unwrap(), b"long key ok");
        assert!(c.local_addr().ip().is_loopback());
        let big = vec![0x5a; 1 << 20];
        c.set("big", &big).unwrap();
        assert_eq!(c.get("big", T).unwrap(), big);
    }

    #[test]
    fn get_waits_for_a_key_set_later() {
        let s = server(1024);
        let c = client(&s);
        let t0 = Instant::now();
        thread::scope(|sc| {
            sc.spawn(|| {
                let c2 = client(&s);
                thread::sleep(Duration::from_millis(150));
                c2.set("late", b"here").unwrap();
                c2.set("late2", b"too").unwrap();
            });
            assert_eq!(c.get("late", T).unwrap(), b"here");
            assert!(t0.elapsed() >= Duration::from_millis(100));
            assert_eq!(c.multi_get(&keys(&["late2", "late"]), T).unwrap(), vec![b"too".to_vec(), b"here".to_vec()]);
        });
    }

    #[test]
    fn wait_times_out_naming_the_missing_keys() {
        let s = server(1024);
        let c = StoreClient::connect(&s.addr().to_string(), TOKEN, 3, T).unwrap();
        c.set("a", b"1").unwrap();
        let t0 = Instant::now();
        let e = c.wait(&keys(&["a", "b", "c"]), Duration::from_millis(200)).unwrap_err();
        assert!(t0.elapsed() >= Duration::from_millis(200) && t0.elapsed() < Duration::from_secs(3));
        match e {
            Error::Timeout { rank, op, after, waiting_for } => {
                assert_eq!(rank, Some(3));
                assert_eq!(op, Op::other("store wait"));
                assert_eq!(after, Duration::from_millis(200));
                assert_eq!(waiting_for, keys(&["b", "c"]));
            }
            other => panic!("expected Timeout, got {other:?}"),
        }
        let e = c.get("nope", Duration::from_millis(50)).unwrap_err();
        assert!(matches!(e, Error::Timeout { ref waiting_for, .. } if waiting_for == &keys(&["nope"])), "{e}");
        // Still usable.
        assert_eq!(c.get("a", T).unwrap(), b"1");
    }

    #[test]
    fn concurrent_adds_give_exact_counts() {
        let s = server(1024);
        let shared = client(&s);
        let results = Mutex::new(Vec::new());
        thread::scope(|sc| {
            for i in 0..16 {
                let (s, shared, results) = (&s, &shared, &results);
                sc.spawn(move || {
                    let own;
                    // Half the threads share one client (it is Sync), half have their own.
                    let c = if i % 2 == 0 {
                        own = client(s);
                        &own
                    } else {
                        shared
                    };
                    let mut got = Vec::new();
                    for _ in 0..50 {
                        got.push(c.add("ctr", 1).unwrap());
                    }
                    results.lock().unwrap().extend(got);
                });
            }
        });
        let mut all = results.into_inner().unwrap();
        all.sort_unstable();
        assert_eq!(all, (1..=800).collect::<Vec<i64>>());
        assert_eq!(shared.add("ctr", 0).unwrap(), 800);
    }

    #[test]
    fn wrong_token_is_refused_and_gets_no_data() {
        let s = server(1024);
        client(&s).set("secret", b"data").unwrap();
        let t0 = Instant::now();
        let e = StoreClient::connect(&s.addr().to_string(), "wrong", 1, T).unwrap_err();
        // Not retried until the deadline: a wrong token never becomes right.
        assert!(t0.elapsed() < Duration::from_secs(2), "took {:?}", t0.elapsed());
        match &e {
            Error::Auth { reason, .. } => assert!(reason.contains("token"), "{reason}"),
            other => panic!("expected Auth, got {other:?}"),
        }
        // Raw: after the refusal, the server sends nothing more and closes.
        let mut c = TcpStream::connect(s.addr()).unwrap();
        assert!(auth::client_handshake(&mut c, "wrong", "store", "t", Instant::now() + T).is_err());
        let mut w = Writer::new();
        w.u8(op::TRY_GET).str("secret");
        let _ = send_frame(&mut c, &w.finish());
        assert_closed(&mut c);
        let deadline = Instant::now() + T;
        while s.stats().refused_auth < 2 && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(s.stats().refused_auth, 2);
        assert_server_healthy(&s);
    }

    fn wait_stat(s: &StoreServer, f: impl Fn(&StoreStats) -> u64, at_least: u64) {
        let deadline = Instant::now() + T;
        while f(&s.stats()) < at_least {
            assert!(Instant::now() < deadline, "stat stayed below {at_least}: {:?}", s.stats());
            thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn garbage_before_auth_is_survived() {
        let s = server(1024);
        let inputs: Vec<Vec<u8>> = vec![
            vec![],
            vec![0xff; 4],
            b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
            (0..=255u8).cycle().take(1000).collect(),
            b"FCCL\x01".iter().copied().chain([0u8; 64]).collect(),
        ];
        for junk in inputs {
            let mut c = TcpStream::connect(s.addr()).unwrap();
            let _ = c.write_all(&junk);
            let _ = c.shutdown(Shutdown::Write);
            // Whatever the server sends back (its hello, a refusal) is not store data.
            let mut sink = Vec::new();
            c.set_read_timeout(Some(T)).unwrap();
            let _ = c.read_to_end(&mut sink);
            assert!(sink.len() <= 6 + 5 + 32 + 2 + 255, "got {} bytes", sink.len());
        }
        assert_server_healthy(&s);
        let st = s.stats();
        assert!(st.bad_frames + st.refused_auth >= 4, "{st:?}");
    }

    #[test]
    fn bad_frames_after_auth_are_refused_and_survived() {
        let s = server(1024);
        // A huge length prefix: refused with a reason, then closed.
        let mut c = raw_authed(&s);
        c.write_all(&u32::MAX.to_le_bytes()).unwrap();
        let r = read_reply(&mut c, "t", 0, "raw", T).unwrap();
        assert_eq!(r[0], ST_ERR);
        assert!(String::from_utf8_lossy(&r).contains("exceeds the store's limit"));
        assert_closed(&mut c);
        assert_server_healthy(&s);

        // Half a frame, then close.
        let mut c = raw_authed(&s);
        c.write_all(&100u32.to_le_bytes()).unwrap();
        c.write_all(&[op::SET, 1, 2, 3]).unwrap();
        drop(c);
        assert_server_healthy(&s);

        // Half a length prefix, then close.
        let mut c = raw_authed(&s);
        c.write_all(&[9, 0]).unwrap();
        drop(c);

        // A well-delimited but malformed frame: set with a key length past the end.
        let mut c = raw_authed(&s);
        let r = raw_request(&mut c, &[op::SET, 0xff, 0xff, 0, 0, b'k']);
        assert_eq!(r[0], ST_ERR);
        assert!(String::from_utf8_lossy(&r).contains("malformed"));
        assert_closed(&mut c);

        // Trailing bytes, unknown opcode, empty frame.
        for body in [vec![op::NUM_KEYS, 0], vec![0xEE, 1, 2], vec![]] {
            let mut c = raw_authed(&s);
            let r = raw_request(&mut c, &body);
            assert_eq!(r[0], ST_ERR, "{body:?}");
            assert_closed(&mut c);
        }
        wait_stat(&s, |st| st.bad_frames, 7);
        assert_server_healthy(&s);
    }

    /// Oversize values and keys sent raw are refused with a reply and the connection stays
    /// usable (the frame itself was within the limit).
    #[test]
    fn oversize_value_is_refused_clearly() {
        let s = server(1024);
        let c = client(&s);
        let e = c.set("v", &[0u8; 2000]).unwrap_err();
        match &e {
            Error::StoreRefused { op, reason } => {
                assert_eq!(*op, "set");
                assert!(reason.contains("2000") && reason.contains("1024") && reason.contains("FERROCCL_STORE_MAX_VALUE"), "{reason}");
            }
            other => panic!("expected StoreRefused, got {other:?}"),
        }
        c.set("v", &[1u8; 1024]).unwrap();
        assert_eq!(c.get("v", T).unwrap().len(), 1024);

        // The server enforces the same limits for clients that do not check.
        let mut raw = raw_authed(&s);
        let mut w = Writer::new();
        w.u8(op::SET).str("w").bytes(&[0u8; 1500]);
        let r = raw_request(&mut raw, &w.finish());
        assert_eq!(r[0], ST_ERR);
        assert!(String::from_utf8_lossy(&r).contains("value of 1500 bytes exceeds the store's limit of 1024"));
        let mut w = Writer::new();
        w.u8(op::SET).str(&"k".repeat(MAX_KEY + 1)).bytes(b"x");
        let r = raw_request(&mut raw, &w.finish());
        assert!(String::from_utf8_lossy(&r).contains("key of 4097 bytes"));
        let r = raw_request(&mut raw, &[op::NUM_KEYS]);
        assert_eq!(r, [&[ST_OK][..], &1u64.to_le_bytes()].concat());
        assert_eq!(s.stats().refused_requests, 2);
        assert_eq!(c.try_get("w").unwrap(), None);
    }

    #[test]
    fn shutdown_wakes_a_waiting_client() {
        let s = server(1024);
        let c = client(&s);
        let t0 = Instant::now();
        thread::scope(|sc| {
            let h = sc.spawn(|| c.get("never", Duration::from_secs(30)));
            thread::sleep(Duration::from_millis(100));
            s.shutdown();
            let r = h.join().unwrap();
            assert!(r.is_err(), "{r:?}");
        });
        assert!(t0.elapsed() < Duration::from_secs(3), "took {:?}", t0.elapsed());
        // The connection is now broken for good.
        assert!(c.num_keys().is_err());
    }

    #[test]
    fn a_client_dying_mid_wait_frees_its_thread() {
        let s = server(1024);
        let mut c = raw_authed(&s);
        let mut w = Writer::new();
        w.u8(op::GET).u64(60_000).str("never");
        send_frame(&mut c, &w.finish()).unwrap();
        thread::sleep(Duration::from_millis(50));
        assert_eq!(s.open_connections(), 1);
        drop(c);
        let deadline = Instant::now() + Duration::from_secs(4);
        while s.open_connections() > 0 {
            assert!(Instant::now() < deadline, "the waiting thread outlived its client");
            thread::sleep(Duration::from_millis(20));
        }
    }

    #[test]
    fn connect_retries_until_the_server_listens() {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let addr = format!("127.0.0.1:{port}");
        thread::scope(|sc| {
            let h = sc.spawn(|| StoreClient::connect(&addr, TOKEN, 0, T));
            thread::sleep(Duration::from_millis(200));
            let s = StoreServer::start(addr.parse().unwrap(), TOKEN, 64).unwrap();
            let c = h.join().unwrap().unwrap();
            c.set("x", b"y").unwrap();
            drop(c);
            drop(s);
        });
        // Nobody listening at all: a timeout naming the store, promptly.
        let t0 = Instant::now();
        let e = StoreClient::connect(&addr, TOKEN, 7, Duration::from_millis(200)).unwrap_err();
        assert!(t0.elapsed() < Duration::from_secs(3));
        assert!(matches!(e, Error::Timeout { rank: Some(7), ref waiting_for, .. } if waiting_for[0].contains(&addr)), "{e}");
    }

    fn limited(limits: Limits) -> StoreServer {
        StoreServer::start_with("127.0.0.1:0".parse().unwrap(), TOKEN, 64, limits).unwrap()
    }

    #[test]
    fn connection_cap_is_enforced_and_named() {
        let s = limited(Limits { max_conns: 2, ..Limits::default() });
        let a = client(&s);
        let b = client(&s);
        // Busy: retried until the deadline, then an error that names the cap.
        let t0 = Instant::now();
        let e = StoreClient::connect(&s.addr().to_string(), TOKEN, 0, Duration::from_millis(300)).unwrap_err();
        assert!(t0.elapsed() < Duration::from_secs(3));
        assert!(e.to_string().contains("maximum of 2 connections"), "{e}");
        assert!(s.stats().refused_busy >= 2, "{:?}", s.stats());
        // A slot frees up while a client is retrying: it gets in.
        let addr = s.addr().to_string();
        let waiter = thread::spawn(move || StoreClient::connect(&addr, TOKEN, 0, T));
        thread::sleep(Duration::from_millis(100));
        drop(a);
        let c = waiter.join().unwrap().unwrap();
        c.set("k", b"v").unwrap();
        assert_eq!(b.get("k", T).unwrap(), b"v");
    }

    /// More idle strangers than the pending cap: the oldest are shed, and a rank still
    /// gets in at once.
    #[test]
    fn idle_strangers_cannot_lock_the_job_out() {
        let s = limited(Limits { max_pending: 8, ..Limits::default() });
        let idle: Vec<TcpStream> = (0..40).map(|_| TcpStream::connect(s.addr()).unwrap()).collect();
        let t0 = Instant::now();
        let c = client(&s);
        c.set("k", b"v").unwrap();
        assert!(t0.elapsed() < Duration::from_secs(2), "took {:?}", t0.elapsed());
        let st = s.stats();
        assert!(st.shed_pending >= 32, "{st:?}");
        // The shed ones were closed: reading gives their hello then EOF, never a hang.
        let mut first = idle.into_iter().next().unwrap();
        first.set_read_timeout(Some(T)).unwrap();
        let mut buf = Vec::new();
        let _ = first.read_to_end(&mut buf);
        assert!(buf.len() < 256, "{} bytes", buf.len());
        // Shed connections leave the table when their threads end (soon, but not at once
        // on a loaded machine).
        let until = Instant::now() + T;
        while s.open_connections() > 8 + 1 && Instant::now() < until {
            thread::sleep(Duration::from_millis(10));
        }
        assert!(s.open_connections() <= 8 + 1, "{}", s.open_connections());
    }

    /// An authenticated client cannot hold a frame open forever by trickling it.
    #[test]
    fn a_trickled_frame_is_cut_at_the_frame_deadline() {
        let s = limited(Limits { frame_timeout: Duration::from_millis(700), ..Limits::default() });
        let mut c = raw_authed(&s);
        let mut w = Writer::new();
        w.u8(op::SET).str("key").bytes(b"value");
        let body = w.finish();
        let mut frame = (body.len() as u32).to_le_bytes().to_vec();
        frame.extend_from_slice(&body);
        let t0 = Instant::now();
        let mut cut = None;
        for b in &frame {
            if c.write_all(std::slice::from_ref(b)).is_err() {
                cut = Some(t0.elapsed());
                break;
            }
            thread::sleep(Duration::from_millis(150));
            let mut peek = [0u8; 1];
            c.set_nonblocking(true).unwrap();
            let r = c.peek(&mut peek);
            c.set_nonblocking(false).unwrap();
            if matches!(r, Ok(0)) {
                cut = Some(t0.elapsed());
                break;
            }
        }
        let cut = cut.expect("the server never cut the trickling client");
        assert!(cut >= Duration::from_millis(600) && cut < Duration::from_secs(3), "cut after {cut:?}");
        assert_eq!(s.stats().bad_frames, 1, "{:?}", s.stats());
        assert_server_healthy(&s);
    }

    #[test]
    fn debug_does_not_show_the_token() {
        let s = server(64);
        let c = client(&s);
        assert!(!format!("{s:?}{c:?}").contains(TOKEN));
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
        /// Random bytes, before or after authentication, never hurt the server.
        #[test]
        fn random_bytes_never_hurt_the_server(junk in proptest::collection::vec(any::<u8>(), 0..300), authed: bool) {
            let s = server(256);
            let mut c = if authed { raw_authed(&s) } else { TcpStream::connect(s.addr()).unwrap() };
            let _ = c.write_all(&junk);
            let _ = c.shutdown(Shutdown::Write);
            let mut sink = Vec::new();
            c.set_read_timeout(Some(T)).unwrap();
            let _ = c.read_to_end(&mut sink);
            let good = client(&s);
            good.set("k", b"v").unwrap();
            prop_assert_eq!(good.get("k", T).unwrap(), b"v".to_vec());
        }
    }
}
