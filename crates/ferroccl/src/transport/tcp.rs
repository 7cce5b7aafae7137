//! TCP transport: one authenticated socket per peer.
//!
//! Frames are a 40-byte header (kind, immediate, length, registration key, address)
//! followed by the payload. The caller's thread writes frames (under a per-socket lock); a
//! reader thread per socket lands them: messages go to the fabric's queues, one-sided writes
//! are received straight from the socket into the registered destination (no intermediate
//! copy), then their immediate is reported. EOF or an error without a goodbye marks the
//! peer failed, which wakes and fails every waiter.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Error, Op, Result};
use crate::inbox::Inbox;
use crate::transport::{TransportKind, WriteReq};

const HDR: usize = 40;
const K_MSG: u8 = 1;
const K_WRITE: u8 = 2;
const K_BYE: u8 = 3;
/// Largest two-sided message on tcp.
const MAX_MSG: usize = 4 << 20;

fn header(kind: u8, imm: u32, len: u64, key: u64, addr: u64) -> [u8; HDR] {
    let mut h = [0u8; HDR];
    h[0] = kind;
    h[4..8].copy_from_slice(&imm.to_le_bytes());
    h[8..16].copy_from_slice(&len.to_le_bytes());
    h[16..24].copy_from_slice(&key.to_le_bytes());
    h[24..32].copy_from_slice(&addr.to_le_bytes());
    h
}

/// This rank's socket to one peer.
#[derive(Debug)]
pub(crate) struct TcpEndpoint {
    rank: usize,
    peer: usize,
    writer: Mutex<TcpStream>,
    /// A handle to shut the socket down without waiting for the writer's lock.
    ctl: TcpStream,
    reader: Mutex<Option<JoinHandle<()>>>,
    inbox: Arc<Inbox>,
    closing: Arc<AtomicBool>,
    /// Set when a frame was cut short by a send timeout: the stream is unusable.
    broken: AtomicBool,
}

impl TcpEndpoint {
    pub(crate) fn start(rank: usize, peer: usize, stream: TcpStream, inbox: Arc<Inbox>) -> Result<TcpEndpoint> {
        let rd = stream.try_clone().map_err(|e| Error::io(format!("rank {rank}: clone socket to rank {peer}"), e))?;
        let ctl = stream.try_clone().map_err(|e| Error::io(format!("rank {rank}: clone socket to rank {peer}"), e))?;
        let closing = Arc::new(AtomicBool::new(false));
        let c2 = closing.clone();
        let sh = inbox.clone();
        let reader = std::thread::Builder::new()
            .name(format!("ferroccl-tcp-{peer}"))
            .spawn(move || reader_loop(peer, rd, sh, c2))
            .map_err(|e| Error::io("spawn tcp reader thread", e))?;
        Ok(TcpEndpoint {
            rank,
            peer,
            writer: Mutex::new(stream),
            ctl,
            reader: Mutex::new(Some(reader)),
            inbox,
            closing,
            broken: AtomicBool::new(false),
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

    /// Writes one frame under the socket's lock. The deadline holds for the whole frame
    /// (the body is written in pieces, each with the time that is left). A frame cut short
    /// leaves the stream unusable: the socket is shut down so the peer sees it at once.
    fn send_frame_locked(
        &self,
        s: &mut TcpStream,
        hdr: &[u8; HDR],
        body: impl FnOnce(&mut dyn FnMut(&[u8]) -> std::io::Result<()>) -> std::io::Result<()>,
        deadline: Instant,
        what: &str,
    ) -> Result<()> {
        if self.broken.load(Ordering::Acquire) {
            return Err(Error::Transport {
                rank: self.rank,
                peer: Some(self.peer),
                transport: TransportKind::Tcp,
                what: "connection is unusable after an earlier failed send".into(),
            });
        }
        let start = Instant::now();
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
        let r = put(hdr).and_then(|()| body(&mut put));
        r.map_err(|e| {
            self.broken.store(true, Ordering::Release);
            if matches!(e.kind(), std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset) {
                // The peer closed on us. If it said why first (an ERR ahead of its FIN), our
                // reader thread is about to deliver it: report that root cause instead.
                let until = Instant::now() + Duration::from_millis(200);
                while Instant::now() < until
                    && self.reader.lock().unwrap_or_else(|p| p.into_inner()).as_ref().is_some_and(|h| !h.is_finished())
                {
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
        })
    }

    fn send_frame(
        &self,
        hdr: &[u8; HDR],
        body: impl FnOnce(&mut dyn FnMut(&[u8]) -> std::io::Result<()>) -> std::io::Result<()>,
        deadline: Instant,
        what: &str,
    ) -> Result<()> {
        let mut s = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        self.send_frame_locked(&mut s, hdr, body, deadline, what)
    }

    /// Sends only if no other frame is being written right now.
    pub(crate) fn try_post_send_now(&self, msg: &[u8], deadline: Instant) -> Result<()> {
        let Ok(mut s) = self.writer.try_lock() else {
            return Err(Error::WouldBlock("socket busy".into()));
        };
        self.send_frame_locked(&mut s, &header(K_MSG, 0, msg.len() as u64, 0, 0), |put| put(msg), deadline, "send")
    }

    /// Shuts the socket down (after a fatal error); the reader thread ends.
    pub(crate) fn cut(&self) {
        self.closing.store(true, Ordering::Release);
        let _ = self.ctl.shutdown(Shutdown::Both);
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
        self.send_frame(
            &header(K_MSG, 0, len as u64, 0, 0),
            |put| {
                put(head)?;
                if body.is_empty() {
                    Ok(())
                } else {
                    put(body)
                }
            },
            deadline,
            "send",
        )
    }

    /// Posts a write already checked by [`WriteReq`]'s bounds check: one frame, written
    /// straight from the source region.
    pub(crate) fn post_write(&self, w: &WriteReq<'_>, deadline: Instant) -> Result<()> {
        let WriteReq { src, offset, len, dst, imm, .. } = *w;
        let hdr = header(K_WRITE, imm, len as u64, dst.key, w.dst_addr(0));
        self.send_frame(
            &hdr,
            |put| src.with_slice(offset, len, |b| put(b)).unwrap_or_else(|e| Err(std::io::Error::other(e.to_string()))),
            deadline,
            "write",
        )
    }

    pub(crate) fn close(&self, deadline: Instant) {
        self.closing.store(true, Ordering::Release);
        if let Ok(mut s) = self.writer.try_lock() {
            let _ = self.send_frame_locked(&mut s, &header(K_BYE, 0, 0, 0, 0), |_| Ok(()), deadline, "goodbye");
        }
        let _ = self.ctl.shutdown(Shutdown::Both);
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

fn reader_loop(peer: usize, mut s: TcpStream, inbox: Arc<Inbox>, closing: Arc<AtomicBool>) {
    let fail = |why: String| {
        if !closing.load(Ordering::Acquire) {
            inbox.peer_failed(peer, why);
        }
    };
    loop {
        let mut h = [0u8; HDR];
        if let Err(e) = s.read_exact(&mut h) {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                fail("closed its TCP connection without saying goodbye (process died?)".into());
            } else {
                fail(format!("broke its TCP connection: {e}"));
            }
            return;
        }
        let kind = h[0];
        let imm = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
        let u64_at = |o: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&h[o..o + 8]);
            u64::from_le_bytes(a)
        };
        let (len, key, addr) = (u64_at(8), u64_at(16), u64_at(24));
        match kind {
            K_MSG => {
                if len as usize > MAX_MSG {
                    fail(format!("sent a {len}-byte message, over the {MAX_MSG}-byte limit"));
                    return;
                }
                let mut b = vec![0u8; len as usize];
                if let Err(e) = s.read_exact(&mut b) {
                    fail(format!("TCP connection broke mid-message: {e}"));
                    return;
                }
                inbox.deliver_msg(peer, b);
                inbox.notify();
            }
            K_WRITE => {
                let r = inbox.land_write(TransportKind::Tcp, peer, key, addr, len as usize, |dst| {
                    s.read_exact(dst).map_err(|e| format!("TCP connection to rank {peer} broke mid-write: {e}"))
                });
                if r.is_err() {
                    // The stream position is lost (or the write was refused): the
                    // connection cannot continue. land_write recorded why.
                    inbox.notify();
                    return;
                }
                inbox.write_imm(peer, imm);
                inbox.notify();
            }
            K_BYE => {
                inbox.peer_closed(peer);
                inbox.notify();
                return;
            }
            k => {
                fail(format!("sent an unknown TCP frame kind {k}"));
                return;
            }
        }
    }
}
