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
use crate::transport::{
    row_imm, Connected, Descriptor, Endpoint, Handshake, Net, OpenCx, Opened, PendingWrite, Setup, SetupCx, TcpInfo, Transport,
    TransportKind, WriteReq, WriteTicket,
};
use crate::wire::{Reader, Writer};

mod net;
mod recv;
mod setup;
#[cfg(test)]
mod tests;
mod wire;

pub(crate) use net::*;
use recv::*;
pub(crate) use setup::*;
use wire::*;

/// What writes the body of a frame through the `put` it is given (see
/// [`TcpEndpoint::send_frame_locked`]).
type Body<'a> = &'a mut dyn FnMut(&mut dyn FnMut(&[u8]) -> std::io::Result<()>) -> std::io::Result<()>;

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
    /// socket is `Ok(false)` and leaves the connection as it was (waiting for room with a
    /// short deadline would cut the frame short when the deadline passed, and a frame cut
    /// short breaks the connection for good: a probe sent while a large transfer filled the
    /// socket did that). When the socket takes only part of the frame, the rest waits in
    /// the endpoint and goes first with the next send, so the stream stays whole.
    pub(crate) fn try_post_send_now(&self, msg: &[u8], deadline: Instant) -> Result<bool> {
        use rustix::net::SendFlags;
        let Ok(mut w) = self.lanes[0].writer.try_lock() else {
            return Ok(false);
        };
        if self.broken.load(Ordering::Acquire) {
            return self.send_frame_locked(&mut w, &[], None, deadline, "send").map(|()| true);
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
            Ok(sent) => Ok(sent),
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
            return Err(Error::internal(format!("tcp message of {len} bytes exceeds {MAX_MSG}")));
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
            return Err(Error::internal(format!("a strided write of {rows} rows of {row} bytes overflows")));
        };
        if rows == 0 || row == 0 {
            return Ok(());
        }
        if rows > 1 && (src_stride < row as u64 || dst_stride < row as u64) {
            return Err(Error::internal(format!("strided write: strides {src_stride}/{dst_stride} shorter than a row of {row} bytes")));
        }
        if (w.offset as u64).checked_add(src_span).is_none_or(|e| e > w.src.len() as u64) {
            return Err(Error::internal(format!(
                "strided write source [{}, +{src_span}) overruns the local region of {} bytes",
                w.offset,
                w.src.len()
            )));
        }
        if w.dst.addr.checked_add(w.dst.len).is_none() || w.dst_offset.checked_add(dst_span).is_none_or(|e| e > w.dst.len) {
            return Err(Error::internal(format!(
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

impl Endpoint for TcpEndpoint {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn max_send(&self) -> usize {
        TcpEndpoint::max_send(self)
    }

    fn post_send(&self, msg: &[u8], deadline: Instant, _poll: &dyn Fn() -> Result<()>) -> Result<()> {
        TcpEndpoint::post_send(self, msg, deadline)
    }

    fn post_send2(&self, head: &[u8], body: &[u8], deadline: Instant, _poll: &dyn Fn() -> Result<()>) -> Result<()> {
        TcpEndpoint::post_send2(self, head, body, deadline)
    }

    fn write(&self, w: &WriteReq<'_>, deadline: Instant, _poll: &dyn Fn() -> Result<()>) -> Result<WriteTicket> {
        TcpEndpoint::post_write(self, w, deadline).map(|()| WriteTicket::Done)
    }

    /// Every row in one frame (a column shard of 1,024 rows of 2 KiB was 1,024 frames, each
    /// a few system calls on both sides); one row as any write.
    fn post_write_rows(
        &self,
        first: &WriteReq<'_>,
        rows: u32,
        src_stride: u64,
        dst_stride: u64,
        deadline: Instant,
        poll: &dyn Fn() -> Result<()>,
        pending: &mut dyn FnMut(PendingWrite),
    ) -> Result<()> {
        if rows > 1 {
            TcpEndpoint::post_write_rows(self, first, rows, src_stride, dst_stride, deadline)
        } else {
            crate::transport::post_rows_each(self, first, rows, src_stride, dst_stride, deadline, poll, pending)
        }
    }

    fn try_post_send_now(&self, msg: &[u8], deadline: Instant) -> Result<bool> {
        TcpEndpoint::try_post_send_now(self, msg, deadline)
    }

    fn cut(&self) {
        TcpEndpoint::cut(self);
    }

    fn close(&self, deadline: Instant, _poll: &dyn Fn() -> Result<()>) {
        TcpEndpoint::close(self, deadline);
    }
}
