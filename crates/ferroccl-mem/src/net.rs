//! The host's network interfaces and their IP addresses (`getifaddrs`, through `nix`'s
//! safe wrapper): what the TCP transport chooses its listening address from
//! (`FERROCCL_SOCKET_IFNAME`).

use std::net::IpAddr;

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

#[cfg(test)]
mod tests {
    use super::*;

    /// Every Linux host (and network namespace) has `lo` with 127.0.0.1.
    #[test]
    fn loopback_is_listed() {
        let all = interface_addrs().unwrap();
        assert!(all.iter().any(|a| a.loopback && a.ip == IpAddr::from([127, 0, 0, 1])), "{all:?}");
    }
}
