//! The host's network interfaces and their IP addresses (`getifaddrs`, through `nix`'s
//! safe wrapper): what the TCP transport chooses its listening address from
//! (`FERROCCL_SOCKET_IFNAME`); and zero-copy sends (`MSG_ZEROCOPY`): the kernel sends from
//! the caller's pages (pinned) instead of copying them, and reports on the socket's error
//! queue when it has let go of them ([`zerocopy_enable`], [`ZEROCOPY`], [`zerocopy_reap`]).

use std::net::IpAddr;
use std::os::fd::{AsRawFd, BorrowedFd};

use nix::ifaddrs::getifaddrs;
use nix::net::if_::InterfaceFlags;

/// One IP address of one network interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InterfaceAddr {
    /// The interface's name (`eth0`, `lo`, `ib0`, ...).
    pub name: String,
    /// The address (IPv4, or IPv6; link-local IPv6 addresses are left out: they need a
    /// scope to be reached).
    pub ip: IpAddr,
    /// The interface is up and running.
    pub up: bool,
    /// The interface is a loopback one.
    pub loopback: bool,
}

/// Every IPv4 and (not link-local) IPv6 address of every interface, in the kernel's order.
///
/// # Errors
///
/// The `getifaddrs` error.
pub fn interface_addrs() -> std::io::Result<Vec<InterfaceAddr>> {
    let list = getifaddrs().map_err(std::io::Error::from)?;
    let mut out = Vec::new();
    for a in list {
        let Some(addr) = a.address.as_ref() else { continue };
        let ip = if let Some(v4) = addr.as_sockaddr_in() {
            IpAddr::V4(v4.ip())
        } else if let Some(v6) = addr.as_sockaddr_in6() {
            let ip = v6.ip();
            // fe80::/10: link-local.
            if ip.segments()[0] & 0xffc0 == 0xfe80 {
                continue;
            }
            IpAddr::V6(ip)
        } else {
            continue;
        };
        let up = a.flags.contains(InterfaceFlags::IFF_UP) && a.flags.contains(InterfaceFlags::IFF_RUNNING);
        out.push(InterfaceAddr { name: a.interface_name, ip, up, loopback: a.flags.contains(InterfaceFlags::IFF_LOOPBACK) });
    }
    Ok(out)
}

/// `SO_ZEROCOPY` (asm-generic/socket.h; the `libc` crate lacks it).
const SO_ZEROCOPY: nix::libc::c_int = 60;
/// `SO_EE_ORIGIN_ZEROCOPY`: an error-queue entry that reports finished zero-copy sends.
const SO_EE_ORIGIN_ZEROCOPY: u8 = 5;
/// `SO_EE_CODE_ZEROCOPY_COPIED`: the kernel copied the data after all (loopback, a device
/// without scatter-gather or checksum offload).
const SO_EE_CODE_ZEROCOPY_COPIED: u8 = 1;

/// The `MSG_ZEROCOPY` send flag (Linux 4.14 and later), for `sendmsg` on a socket with
/// [`zerocopy_enable`]: each successful call is one zero-copy send, numbered from 0 per
/// socket; its pages must stay unchanged until [`zerocopy_reap`] has counted it.
/// `ENOBUFS` means the pages could not be pinned (the memlock limit: 8 MiB for non-root
/// users on many hosts) and nothing was sent: send those bytes without the flag.
pub const ZEROCOPY: u32 = nix::libc::MSG_ZEROCOPY as u32;

/// Lets `sock` (a TCP socket) take [`ZEROCOPY`] sends (`setsockopt(SO_ZEROCOPY, 1)`).
///
/// # Errors
///
/// The `setsockopt` error (`ENOPROTOOPT` on kernels before 4.14).
pub fn zerocopy_enable(sock: BorrowedFd<'_>) -> std::io::Result<()> {
    let one: nix::libc::c_int = 1;
    // SAFETY: `sock` is a live descriptor for the call; the option value is a c_int read
    // by the kernel through the pointer and length given, and `one` outlives the call.
    let r = unsafe {
        nix::libc::setsockopt(
            sock.as_raw_fd(),
            nix::libc::SOL_SOCKET,
            SO_ZEROCOPY,
            std::ptr::from_ref(&one).cast(),
            std::mem::size_of::<nix::libc::c_int>() as nix::libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// What [`zerocopy_reap`] found on a socket's error queue.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Reaped {
    /// Zero-copy sends the kernel has finished with (their pages are the caller's again).
    pub done: u64,
    /// Whether the kernel copied any of them after all (zero copy did not pay for them).
    pub copied: bool,
}

/// Counts the zero-copy sends the kernel reports finished on `sock`'s error queue, without
/// waiting (`recvmsg(MSG_ERRQUEUE | MSG_DONTWAIT)` until it is empty). A socket shows
/// `POLLERR` while entries wait there.
///
/// # Errors
///
/// A `recvmsg` error other than "nothing queued", or an error-queue entry that is not a
/// zero-copy report (a real socket error: the connection is broken).
pub fn zerocopy_reap(sock: BorrowedFd<'_>) -> std::io::Result<Reaped> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
    let mut out = Reaped::default();
    loop {
        let mut space = nix::cmsg_space!(nix::libc::sock_extended_err, nix::libc::sockaddr_in6);
        let flags = MsgFlags::MSG_ERRQUEUE | MsgFlags::MSG_DONTWAIT;
        let msg = match recvmsg::<()>(sock.as_raw_fd(), &mut [], Some(&mut space), flags) {
            Ok(m) => m,
            Err(nix::errno::Errno::EAGAIN) => return Ok(out),
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        };
        for c in msg.cmsgs().map_err(std::io::Error::from)? {
            let e = match c {
                ControlMessageOwned::Ipv4RecvErr(e, _) | ControlMessageOwned::Ipv6RecvErr(e, _) => e,
                _ => continue,
            };
            if e.ee_origin != SO_EE_ORIGIN_ZEROCOPY || e.ee_errno != 0 {
                let code = i32::try_from(e.ee_errno).unwrap_or(nix::libc::EIO);
                return Err(std::io::Error::from_raw_os_error(if code == 0 { nix::libc::EIO } else { code }));
            }
            // Sends ee_info to ee_data (inclusive, wrapping u32 counters) are done.
            out.done += u64::from(e.ee_data.wrapping_sub(e.ee_info)) + 1;
            out.copied |= e.ee_code & SO_EE_CODE_ZEROCOPY_COPIED != 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every Linux host (and network namespace) has `lo` with 127.0.0.1.
    #[test]
    fn loopback_is_listed() {
        let all = interface_addrs().unwrap();
        assert!(all.iter().any(|a| a.loopback && a.ip == IpAddr::from([127, 0, 0, 1])), "{all:?}");
    }

    /// Zero-copy sends arrive whole and are each reported finished (over loopback the
    /// kernel copies them after all, and says so).
    #[test]
    fn zerocopy_sends_arrive_and_are_reported_finished() {
        use std::io::Read;
        use std::os::fd::AsFd;
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut b, _) = l.accept().unwrap();
        zerocopy_enable(a.as_fd()).unwrap();
        let data: Vec<u8> = (0..(1usize << 20)).map(|i| (i % 251) as u8).collect();
        let n = data.len();
        let reader = std::thread::spawn(move || {
            let mut got = vec![0u8; n];
            b.read_exact(&mut got).map(|()| got)
        });
        let (mut sent, mut calls) = (0usize, 0u64);
        while sent < data.len() {
            sent += rustix::net::send(&a, &data[sent..], rustix::net::SendFlags::from_bits_retain(ZEROCOPY)).unwrap();
            calls += 1;
        }
        assert_eq!(reader.join().unwrap().unwrap(), data);
        let (mut done, mut copied) = (0u64, false);
        let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while done < calls {
            assert!(std::time::Instant::now() < until, "{done} of {calls} zero-copy sends reported");
            let r = zerocopy_reap(a.as_fd()).unwrap();
            (done, copied) = (done + r.done, copied | r.copied);
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(done, calls);
        assert!(copied, "loopback copies zero-copy sends");
        assert_eq!(zerocopy_reap(a.as_fd()).unwrap(), Reaped::default());
    }
}
