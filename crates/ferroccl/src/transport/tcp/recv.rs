//! tcp's receiving side: each socket's stage and reader thread ([`Reading`]), landing
//! messages in the inbox and one-sided writes (striped over lanes or not) straight into
//! registered memory.

use super::*;

/// Bytes staged from a socket, at least: frames up to the stage's size (header included)
/// are read with non-blocking `recv`s into the stage and landed from it; a larger frame's
/// body is read straight into its destination by the reader thread. The stage also holds
/// the largest eager message whole ([`stage_len`]): measured, 2 ranks, a 64 KiB allreduce
/// (one eager message each way) took 122 us with a 64 KiB stage (the message handed to the
/// reader thread) and 87 us with 68 KiB; a 256 KiB stage was slower for larger frames than
/// reading them straight into place.
pub(super) const STAGE_MIN: usize = 64 << 10;
/// What an eager message carries besides its data (its protocol header), at most.
pub(super) const EAGER_HEADROOM: usize = 4 << 10;

/// The stage of a socket for eager messages of up to `eager_max` bytes.
pub(super) fn stage_len(eager_max: usize) -> usize {
    (eager_max.min(MAX_MSG) + HDR + EAGER_HEADROOM).max(STAGE_MIN)
}

/// The reading side of a socket.
#[derive(Debug)]
pub(super) struct Rd {
    pub(super) s: TcpStream,
    pub(super) stage: Box<[u8]>,
    /// `stage[lo..hi]`: received, not yet landed (at most the start of one frame once a
    /// pump returns).
    pub(super) lo: usize,
    pub(super) hi: usize,
    /// The stream ended (goodbye, failure, a refused write): nothing more is read.
    pub(super) ended: bool,
    /// A one-sided write larger than the stage whose body is being received in place.
    pub(super) part: Option<Part>,
    /// Lane 0 only: a striped write whose first piece has landed, waiting for its other
    /// pieces; nothing more is read from this socket meanwhile.
    pub(super) wait: Option<Wait>,
}

/// A striped write waiting for its pieces on the other lanes (see [`K_STRIPED`]).
#[derive(Debug, Clone, Copy)]
pub(super) struct Wait {
    pub(super) id: u32,
    pub(super) others: u32,
    pub(super) imm: u32,
}

/// The pieces of striped writes landed on lanes 1 and up, by write number, and a futex
/// word bumped whenever one lands (lane 0's reader thread sleeps on it while it waits).
/// Shared by the lanes of one peer.
#[derive(Debug, Default)]
pub(super) struct Joined {
    pub(super) landed: Mutex<HashMap<u32, u32>>,
    pub(super) gen: AtomicU32,
}

impl Joined {
    pub(super) fn piece_landed(&self, id: u32) {
        *self.landed.lock().unwrap_or_else(|e| e.into_inner()).entry(id).or_default() += 1;
        self.bump();
    }

    /// Whether all `others` pieces of write `id` have landed (then it is forgotten).
    pub(super) fn take(&self, id: u32, others: u32) -> bool {
        let mut m = self.landed.lock().unwrap_or_else(|e| e.into_inner());
        if m.get(&id).copied().unwrap_or(0) < others {
            return false;
        }
        m.remove(&id);
        true
    }

    /// Wakes whoever waits for pieces (one landed, or the connection closes).
    pub(super) fn bump(&self) {
        self.gen.fetch_add(1, Ordering::SeqCst);
        let _ = futex_wake(&self.gen, u32::MAX);
    }
}

/// A one-sided write (`K_WRITE`) being received in place: its header, and the bytes of it
/// landed so far.
#[derive(Debug, Clone, Copy)]
pub(super) struct Part {
    pub(super) h: [u8; HDR],
    pub(super) done: usize,
}

/// What [`Reading::continue_write`] got to.
pub(super) enum Step {
    /// The write has fully landed.
    Done,
    /// Nothing more has arrived for now (whether anything did before).
    More(bool),
    /// The connection cannot go on.
    Failed,
}

/// What a socket's reader thread and its drivers share.
#[derive(Debug)]
pub(super) struct Reading {
    pub(super) peer: usize,
    /// The socket's place among the pair's sockets: lane 0 carries every kind of frame and
    /// is read by drivers too; lanes 1 and up carry pieces of striped writes and are read by
    /// their own reader threads alone (on a host with cores to spare, side by side).
    pub(super) lane: u32,
    pub(super) lanes: u32,
    pub(super) joined: Arc<Joined>,
    pub(super) rd: Mutex<Rd>,
    /// Set by a driver that met a frame larger than the stage: the reader thread reads it
    /// (blocking, straight into place); drivers leave the socket alone until it is done.
    pub(super) handoff: AtomicBool,
    pub(super) inbox: Arc<Inbox>,
    pub(super) closing: Arc<AtomicBool>,
    pub(super) drive: Arc<Drive>,
}

/// Reads `rows` rows of `row` bytes into `dst`, `stride` bytes apart, with `readv` of up
/// to 64 rows at a time (a column shard's rows are often a few KiB: one `read` each would
/// cost more than the copy).
pub(super) fn read_rows(s: &mut impl Read, dst: &mut [u8], rows: usize, row: usize, stride: usize) -> std::io::Result<()> {
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

impl Reading {
    /// The body length of the frame with header `h` on this lane, checked (see
    /// [`body_len`]): lanes 1 and up carry only pieces of striped writes and goodbyes; a
    /// striped write's first piece comes on lane 0 and names at most the other lanes.
    pub(super) fn frame_len(&self, h: &[u8; HDR]) -> std::result::Result<usize, String> {
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
    pub(super) fn write_landed(&self, h: &[u8; HDR], wait: &mut Option<Wait>) {
        match h[0] {
            K_STRIPE => self.joined.piece_landed(u32_at(h, 32)),
            K_STRIPED => {
                *wait = Some(Wait { id: u32_at(h, 32), others: u32_at(h, 36), imm: u32_at(h, 4) });
            }
            _ => self.report_imm(u32_at(h, 4)),
        }
    }

    /// A write (all of it) has landed: its immediate is reported and waiters wake.
    pub(super) fn report_imm(&self, imm: u32) {
        self.inbox.write_imm(self.peer, imm);
        self.inbox.notify();
    }

    /// Lands what has arrived on the socket, without waiting (a driving thread's round,
    /// see [`Drive`]). Whether anything arrived.
    pub(super) fn drive_once(&self) -> bool {
        if self.handoff.load(Ordering::Acquire) {
            return false;
        }
        match self.rd.try_lock() {
            Ok(mut rd) => self.pump(&mut rd, false),
            Err(_) => false,
        }
    }

    pub(super) fn fail(&self, why: String) {
        if !self.closing.load(Ordering::Acquire) {
            self.inbox.peer_failed(self.peer, why);
        }
    }

    /// Lands what has arrived: complete frames from the stage, then one non-blocking
    /// `recv` at a time into it, until the socket has nothing more. A frame larger than the
    /// stage is read straight into place when `may_block` (the reader thread), or handed
    /// to the reader thread otherwise (see [`Reading::handoff`]). Whether anything arrived.
    pub(super) fn pump(&self, rd: &mut Rd, may_block: bool) -> bool {
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
    pub(super) fn continue_write(&self, rd: &mut Rd, part: Part) -> Step {
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
    pub(super) fn end(&self, rd: &mut Rd) -> bool {
        rd.ended = true;
        self.handoff.store(false, Ordering::Release);
        self.drive.kick();
        self.joined.bump();
        self.inbox.notify();
        true
    }

    /// Lands the frame with header `h` (its body length checked by [`body_len`]), its body
    /// read from `r`. Whether the stream goes on.
    pub(super) fn land(&self, h: &[u8; HDR], r: &mut impl Read, wait: &mut Option<Wait>) -> bool {
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
pub(super) fn reader_loop(r: &Reading, watch: &TcpStream) {
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
