//! What tcp keeps for all its peers ([`TcpNet`]): who reads the sockets ([`Drive`]: a
//! driving thread or each socket's reader thread) and which have bytes ([`Ready`]).

use super::*;

/// What the mesh keeps of its tcp side: whoever drives the engine reads every socket
/// through it (see [`Drive`]).
#[derive(Debug)]
pub(crate) struct TcpNet {
    pub(super) drive: Arc<Drive>,
    pub(super) readings: Vec<Arc<Reading>>,
    /// Which sockets have something to read, when there are enough to ask (see [`Ready`]).
    pub(super) ready: Option<Ready>,
}

/// Sockets a driver asks about, from this many peers up: one `epoll_wait` says which have
/// bytes (without the socket lock a `recv` takes), where a round would otherwise `recv` on
/// every socket. Measured, 4 ranks on 2 CPUs over loopback (3 sockets each), alternated with
/// the build before it, 5-8 rounds: broadcast 8 B - 1 KiB 0.85-0.93x the time, allgather
/// 0.90-0.99x, allreduce 0.92-1.00x: a waiting rank's idle rounds, which take the CPU from
/// the rank it waits for, get cheaper. With one peer a `poll` before the `recv` was 1.08x
/// slower (a second system call per message), so one peer is read as before.
pub(super) const READY_MIN_PEERS: usize = 2;
/// Ready sockets taken from one `epoll_wait` (more are left for the next round).
pub(super) const READY_BATCH: usize = 32;

/// An epoll instance over the first socket of every peer whose endpoint has one socket
/// (level-triggered: a socket with unread bytes stays ready). Endpoints with several
/// sockets are pumped every round: lane 0 of a striped write waits for the other lanes'
/// pieces, which no readiness of its own socket announces.
#[derive(Debug)]
pub(super) struct Ready {
    pub(super) epoll: std::os::fd::OwnedFd,
    /// Indices (into [`TcpNet::readings`]) pumped every round whatever the epoll says.
    pub(super) always: Vec<usize>,
}

impl Ready {
    /// `readings`: the first socket of every peer, in [`TcpNet::readings`]'s order.
    pub(super) fn new(rank: usize, readings: &[Arc<Reading>]) -> Result<Option<Ready>> {
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
    pub(super) fn each(&self, mut f: impl FnMut(usize)) -> rustix::io::Result<()> {
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

/// Who reads a mesh's sockets: a thread that drives the engine reads them itself
/// ([`Drive::enter`], then [`TcpEndpoint::drive`] every round: no hand-off between threads
/// on the critical path); while none does, each socket's reader thread reads it. Shared by
/// every tcp endpoint of one mesh and their reader threads.
#[derive(Debug, Default)]
pub(crate) struct Drive {
    /// Low 16 bits: the threads driving now; above: a generation bumped by [`Drive::kick`].
    /// Reader threads sleep on it (a futex word) while a driver reads for them.
    pub(super) word: AtomicU32,
    /// Bumped on every driving round: a reader thread that sees it stand still for
    /// [`DRIVER_STALL`] reads its socket itself (a driver stuck in something else must not
    /// leave a peer's sends waiting).
    pub(super) rounds: AtomicU64,
}

pub(super) const DRIVERS: u32 = 0xffff;
/// How long a driver may go without a round before reader threads read for it.
pub(super) const DRIVER_STALL: Duration = Duration::from_millis(10);
/// What a reader thread waits at most before it looks at `closing` again.
pub(super) const READER_NAP: Duration = Duration::from_millis(100);

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
    pub(super) fn driven_here(&self) -> bool {
        DRIVING.with(|d| d.get()) == std::ptr::from_ref(self)
    }

    pub(super) fn leave(&self) {
        if self.word.fetch_sub(1, Ordering::SeqCst) & DRIVERS == 1 {
            let _ = futex_wake(&self.word, u32::MAX);
        }
    }

    /// Wakes every reader thread (a hand-off, a closing socket).
    pub(super) fn kick(&self) {
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
    pub(super) drive: Arc<Drive>,
    pub(super) before: *const Drive,
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
    pub(super) drive: &'a Drive,
}

impl Drop for Paused<'_> {
    fn drop(&mut self) {
        DRIVING.with(|d| d.set(std::ptr::from_ref(self.drive)));
        self.drive.word.fetch_add(1, Ordering::SeqCst);
    }
}

impl Net for TcpNet {
    /// Lands frames itself only in a thread that drives ([`Net::drive`]).
    fn progress(&self, _inbox: &Inbox) -> Result<()> {
        TcpNet::progress(self);
        Ok(())
    }

    fn drive(&self) -> Option<DriveGuard> {
        Some(TcpNet::drive(self))
    }

    fn pause(&self) -> Option<Paused<'_>> {
        TcpNet::pause(self)
    }
}
