//! Watching other processes (pidfds) and reading their memory
//! (`process_vm_readv`).
//!
//! A [`ProcessWatch`] holds a pidfd: a file descriptor that refers to one
//! process (not to a pid number, so it cannot be fooled by pid reuse once
//! opened) and becomes readable when that process exits. Ranks on one host
//! watch each other so that a dead peer becomes an error quickly instead of
//! a timeout.
//!
//! [`read_process_memory`] is the single-copy path of the shm transport: it
//! copies bytes straight from a peer's registered buffer into ours. The kernel
//! allows it only where `ptrace` would be allowed (same user and a permissive
//! `kernel.yama.ptrace_scope`, or `CAP_SYS_PTRACE`); [`can_read_process`]
//! probes that once so the transport can fall back to copying through a
//! segment.
//!
//! Requires Linux 5.3 or later (`pidfd_open`); `process_vm_readv` needs 3.2.

use std::io;
use std::io::IoSliceMut;
use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use nix::sys::uio::{process_vm_readv, RemoteIoVec};
use rustix::event::{poll, PollFd, PollFlags};
use rustix::io::Errno;
use rustix::process::{pidfd_open, Pid, PidfdFlags};

use crate::futex::to_timespec;

/// A handle on one process that tells whether it has exited.
///
/// Create it while the process is known to be alive (e.g. right after its
/// handshake), so that the pid cannot have been reused by then.
#[derive(Debug)]
pub struct ProcessWatch {
    pid: i32,
    fd: OwnedFd,
}

/// The error kind for an OS error, with `ESRCH` ("no such process", which
/// std leaves uncategorized) reported as [`io::ErrorKind::NotFound`].
fn kind_of(e: &io::Error) -> io::ErrorKind {
    if e.raw_os_error() == Some(Errno::SRCH.raw_os_error()) {
        io::ErrorKind::NotFound
    } else {
        e.kind()
    }
}

fn pid_err(pid: i32, what: &str, e: impl Into<io::Error>) -> io::Error {
    let e = e.into();
    io::Error::new(kind_of(&e), format!("process {pid}: {what}: {e}"))
}

impl ProcessWatch {
    /// Opens a pidfd on `pid`.
    ///
    /// Fails with [`io::ErrorKind::NotFound`] (`ESRCH`) if there is no such
    /// process, and [`io::ErrorKind::InvalidInput`] for a pid that is not
    /// positive.
    pub fn new(pid: i32) -> io::Result<ProcessWatch> {
        // (`Pid::from_raw` asserts on negative values, so check first.)
        let p = (pid > 0)
            .then(|| Pid::from_raw(pid))
            .flatten()
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, format!("process {pid}: invalid pid")))?;
        let fd = pidfd_open(p, PidfdFlags::empty()).map_err(|e| pid_err(pid, "pidfd_open", e))?;
        Ok(ProcessWatch { pid, fd })
    }

    /// The watched pid.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Whether the process has exited (it may not have been reaped yet).
    ///
    /// One non-blocking `poll`, cheap enough for a progress loop. An
    /// unexpected `poll` failure reports `false` (the caller's deadline still
    /// applies).
    pub fn has_exited(&self) -> bool {
        loop {
            let mut fds = [PollFd::new(&self.fd, PollFlags::IN)];
            let zero = to_timespec(Duration::ZERO);
            match poll(&mut fds, Some(&zero)) {
                Ok(_) => return !fds[0].revents().is_empty(),
                Err(Errno::INTR) => continue,
                Err(_) => return false,
            }
        }
    }
}

/// Waits until at least one of `watches` has exited, or `timeout` passes;
/// returns the indices (into `watches`) of all that have exited, in order,
/// or an empty vector on timeout.
///
/// Signals do not cut the wait short: an interrupted `poll` is resumed with
/// the time that is left. With no watches it simply sleeps for `timeout`.
pub fn wait_any_exited(watches: &[&ProcessWatch], timeout: Duration) -> io::Result<Vec<usize>> {
    let deadline = Instant::now().checked_add(timeout);
    loop {
        let mut fds: Vec<PollFd<'_>> = watches.iter().map(|w| PollFd::new(&w.fd, PollFlags::IN)).collect();
        let left = match deadline {
            Some(d) => d.saturating_duration_since(Instant::now()),
            None => timeout,
        };
        match poll(&mut fds, Some(&to_timespec(left))) {
            Ok(_) => {
                return Ok(fds.iter().enumerate().filter(|(_, f)| !f.revents().is_empty()).map(|(i, _)| i).collect());
            }
            Err(Errno::INTR) => continue,
            Err(e) => {
                let e = io::Error::from(e);
                return Err(io::Error::new(e.kind(), format!("poll on {} process watches: {e}", watches.len())));
            }
        }
    }
}

/// Copies `dst.len()` bytes from address `remote_addr` of process `pid` into
/// `dst` with `process_vm_readv` (one copy, no intermediate buffer), looping
/// over partial reads.
///
/// Errors carry the pid, the address and the length:
/// - `EPERM` ([`io::ErrorKind::PermissionDenied`]): ptrace rules forbid it
///   (different user, `kernel.yama.ptrace_scope`, no `CAP_SYS_PTRACE`);
/// - `ESRCH` ([`io::ErrorKind::NotFound`]): no such process (it exited);
/// - `EFAULT`: the remote range is not (entirely) mapped in that process.
pub fn read_process_memory(pid: i32, remote_addr: u64, dst: &mut [u8]) -> io::Result<()> {
    let len = dst.len();
    let ctx = |what: &str, e: io::Error| {
        io::Error::new(kind_of(&e), format!("process_vm_readv from process {pid} at {remote_addr:#x} (+{len} bytes): {what}{e}"))
    };
    let p = nix::unistd::Pid::from_raw(pid);
    if pid <= 0 {
        return Err(ctx("", io::Error::new(io::ErrorKind::InvalidInput, "invalid pid")));
    }
    let mut done = 0usize;
    while done < len {
        let addr = usize::try_from(remote_addr)
            .ok()
            .and_then(|a| a.checked_add(done))
            .ok_or_else(|| ctx("", io::Error::from(io::ErrorKind::InvalidInput)))?;
        let remote = [RemoteIoVec { base: addr, len: len - done }];
        let mut local = [IoSliceMut::new(&mut dst[done..])];
        match process_vm_readv(p, &mut local, &remote) {
            Ok(0) => {
                return Err(ctx(
                    &format!("no progress after {done} bytes: "),
                    io::Error::from_raw_os_error(nix::errno::Errno::EFAULT as i32),
                ))
            }
            Ok(n) => done += n,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => {
                let what = if done > 0 { format!("after {done} bytes: ") } else { String::new() };
                return Err(ctx(&what, io::Error::from(e)));
            }
        }
    }
    Ok(())
}

/// Whether this process may read `pid`'s memory with [`read_process_memory`]:
/// a one-byte probe read of `probe_addr` (an address known to be mapped in
/// that process, e.g. one it advertised). `false` for a dead process, an
/// unmapped address or a ptrace refusal.
pub fn can_read_process(pid: i32, probe_addr: u64) -> bool {
    let mut b = [0u8; 1];
    read_process_memory(pid, probe_addr, &mut b).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Command, Stdio};

    fn sleeper() -> std::process::Child {
        Command::new("sleep").arg("30").stdin(Stdio::null()).spawn().expect("spawn sleep")
    }

    #[test]
    fn watch_reports_exit_of_child() {
        let mut child = sleeper();
        let pid = i32::try_from(child.id()).unwrap();
        let w = ProcessWatch::new(pid).unwrap();
        assert_eq!(w.pid(), pid);
        assert!(!w.has_exited());
        assert!(wait_any_exited(&[&w], Duration::from_millis(20)).unwrap().is_empty());
        child.kill().unwrap();
        // Readable as soon as it is a zombie, before it is reaped...
        let start = Instant::now();
        assert_eq!(wait_any_exited(&[&w], Duration::from_secs(5)).unwrap(), vec![0]);
        assert!(start.elapsed() < Duration::from_secs(4));
        assert!(w.has_exited());
        // ... and after.
        child.wait().unwrap();
        assert!(w.has_exited());
    }

    #[test]
    fn wait_any_exited_returns_the_dead_ones() {
        let mut a = sleeper();
        let mut b = sleeper();
        let mut c = sleeper();
        let wa = ProcessWatch::new(a.id() as i32).unwrap();
        let wb = ProcessWatch::new(b.id() as i32).unwrap();
        let wc = ProcessWatch::new(c.id() as i32).unwrap();
        b.kill().unwrap();
        b.wait().unwrap();
        assert_eq!(wait_any_exited(&[&wa, &wb, &wc], Duration::from_secs(5)).unwrap(), vec![1]);
        for ch in [&mut a, &mut c] {
            ch.kill().unwrap();
            ch.wait().unwrap();
        }
        assert_eq!(wait_any_exited(&[&wa, &wb, &wc], Duration::from_secs(5)).unwrap(), vec![0, 1, 2]);
    }

    #[test]
    fn timeout_with_nobody_exiting() {
        let mut a = sleeper();
        let wa = ProcessWatch::new(a.id() as i32).unwrap();
        let start = Instant::now();
        assert!(wait_any_exited(&[&wa], Duration::from_millis(50)).unwrap().is_empty());
        let took = start.elapsed();
        assert!(took >= Duration::from_millis(45) && took < Duration::from_secs(2), "{took:?}");
        a.kill().unwrap();
        a.wait().unwrap();
    }

    #[test]
    fn watch_on_missing_or_bad_pid_fails() {
        let mut a = sleeper();
        let pid = a.id() as i32;
        a.kill().unwrap();
        a.wait().unwrap();
        // Reaped: the pid names nobody (unless reused within microseconds).
        if let Err(e) = ProcessWatch::new(pid) {
            assert_eq!(e.kind(), io::ErrorKind::NotFound);
            assert!(e.to_string().contains(&pid.to_string()));
        }
        assert_eq!(ProcessWatch::new(0).unwrap_err().kind(), io::ErrorKind::InvalidInput);
        assert_eq!(ProcessWatch::new(-5).unwrap_err().kind(), io::ErrorKind::InvalidInput);
    }

    #[test]
    fn read_own_memory() {
        let me = std::process::id() as i32;
        let src: Vec<u8> = (0..100_000u32).map(|i| (i * 7 + 3) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        read_process_memory(me, src.as_ptr() as u64, &mut dst).unwrap();
        assert_eq!(src, dst);
        read_process_memory(me, src.as_ptr() as u64, &mut []).unwrap();
        assert!(can_read_process(me, src.as_ptr() as u64));
    }

    #[test]
    fn read_unmapped_address_fails_with_context() {
        let me = std::process::id() as i32;
        let mut dst = [0u8; 16];
        // Page 0 is never mapped.
        let e = read_process_memory(me, 16, &mut dst).unwrap_err();
        assert_eq!(e.raw_os_error(), None, "wrapped with context");
        let msg = e.to_string();
        assert!(msg.contains(&me.to_string()) && msg.contains("0x10"), "{msg}");
        assert!(!can_read_process(me, 16));
    }

    #[test]
    fn partial_read_reports_how_far_it_got() {
        use rustix::mm::{mmap_anonymous, mprotect, munmap, MapFlags, MprotectFlags, ProtFlags};
        // A multiple of every Linux page size (4 KiB to 64 KiB).
        let page = 64 * 1024;
        // SAFETY: a fresh private anonymous mapping (null hint, no MAP_FIXED)
        // replaces nothing; it is only accessed through the raw pointer below.
        let base = unsafe { mmap_anonymous(std::ptr::null_mut(), 2 * page, ProtFlags::READ | ProtFlags::WRITE, MapFlags::PRIVATE) }
            .unwrap()
            .cast::<u8>();
        // SAFETY: the first page is ours, mapped read-write and not aliased.
        unsafe { std::ptr::write_bytes(base, 0xab, page) };
        // SAFETY: makes the second page of our own mapping inaccessible; no
        // reference into it exists.
        unsafe { mprotect(base.add(page).cast(), page, MprotectFlags::empty()) }.unwrap();

        let me = std::process::id() as i32;
        let tail = 96;
        let mut dst = vec![0u8; 200];
        let addr = base as u64 + (page - tail) as u64;
        let e = read_process_memory(me, addr, &mut dst).unwrap_err();
        assert!(e.to_string().contains(&format!("after {tail} bytes")), "{e}");
        // What could be read was read.
        assert!(dst[..tail].iter().all(|&b| b == 0xab));
        // Exactly up to the hole works.
        read_process_memory(me, addr, &mut dst[..tail]).unwrap();

        // SAFETY: unmaps exactly the mapping made above; nothing refers to it.
        unsafe { munmap(base.cast(), 2 * page) }.unwrap();
    }

    #[test]
    fn read_from_a_child_process() {
        use std::io::{Read, Write};
        use std::os::unix::fs::FileExt;
        // `cat` echoing a line back proves it has finished exec'ing (right
        // after `spawn` returns, the new image may not be mapped yet).
        let mut child = Command::new("cat").stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().expect("spawn cat");
        child.stdin.as_mut().unwrap().write_all(b"x\n").unwrap();
        let mut echo = [0u8; 2];
        child.stdout.as_mut().unwrap().read_exact(&mut echo).unwrap();
        let pid = child.id() as i32;
        // `cat` advertises no buffer, so find a mapped address through
        // /proc: its first mapping is the start of its ELF image.
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
        let first = maps.lines().next().unwrap();
        let start = u64::from_str_radix(first.split('-').next().unwrap(), 16).unwrap();
        let mut head = vec![0u8; 4096];
        match read_process_memory(pid, start, &mut head) {
            Ok(()) => {
                assert_eq!(&head[..4], b"\x7fELF", "{maps}");
                // The same bytes through /proc/<pid>/mem.
                let mem = std::fs::File::open(format!("/proc/{pid}/mem")).unwrap();
                let mut oracle = vec![0u8; 4096];
                mem.read_exact_at(&mut oracle, start).unwrap();
                assert_eq!(head, oracle);
                assert!(can_read_process(pid, start));
            }
            Err(e) => {
                // Yama's ptrace_scope 3 (or a sandbox) forbids even reading a
                // child; that must surface as a permission error.
                assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{e}");
                assert!(!can_read_process(pid, start));
            }
        }
        child.kill().unwrap();
        child.wait().unwrap();
        // Dead and reaped: the probe fails cleanly.
        assert!(!can_read_process(pid, start));
        let e = read_process_memory(pid, start, &mut head[..4]).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound, "{e}");
        assert!(e.to_string().contains(&pid.to_string()));
    }
}
