//! Who listens where on this host, read from `/proc/net` without touching the listeners: what a
//! refused connection says about its likely cause (a server of another provider at the
//! address), and the shm endpoints' names, which follow TCP's rules for addresses.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// The prefix of an shm endpoint's abstract Unix socket name: `rdma-rpc-shm:<ip>:<port>`.
pub(crate) const SHM_PREFIX: &str = "rdma-rpc-shm:";

/// The abstract name of the shm endpoint bound to `addr` (without the leading NUL).
pub(crate) fn shm_name(addr: SocketAddr) -> String {
    format!("{SHM_PREFIX}{addr}")
}

/// The wildcard endpoints that take connections to `addr`, as TCP's would: `0.0.0.0:P` and
/// `[::]:P` for a local IPv4 address, `[::]:P` for a local IPv6 one; none for an address that
/// is not this host's (shm reaches processes of this host only) or is a wildcard itself.
pub(crate) fn wildcards(addr: SocketAddr) -> Vec<SocketAddr> {
    if addr.ip().is_unspecified() || !is_local(addr.ip()) {
        return Vec::new();
    }
    let v6 = SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), addr.port());
    match addr.ip() {
        IpAddr::V4(_) => vec![SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), addr.port()), v6],
        IpAddr::V6(_) => vec![v6],
    }
}

/// Whether `ip` is an address of this host: binding a UDP socket to it succeeds (no packet
/// is sent).
pub(crate) fn is_local(ip: IpAddr) -> bool {
    std::net::UdpSocket::bind(SocketAddr::new(ip, 0)).is_ok()
}

/// The shm endpoints bound on this host (in this network namespace).
pub(crate) fn shm_endpoints() -> Vec<SocketAddr> {
    let Ok(text) = std::fs::read_to_string("/proc/net/unix") else {
        return Vec::new();
    };
    text.lines()
        .filter_map(|l| l.split_whitespace().last())
        .filter_map(|path| path.strip_prefix('@')?.strip_prefix(SHM_PREFIX)?.parse().ok())
        .collect()
}

/// Whether an shm endpoint takes connections to `addr`: its own, or a wildcard's.
pub(crate) fn shm_listens(addr: SocketAddr) -> bool {
    let bound = shm_endpoints();
    let mut names = wildcards(addr);
    names.push(addr);
    bound.iter().any(|b| names.contains(b))
}

/// Whether a TCP socket listens on `addr`'s port (at `addr`'s address or a wildcard).
pub(crate) fn tcp_listens(addr: SocketAddr) -> bool {
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|f| {
        let Ok(text) = std::fs::read_to_string(f) else {
            return false;
        };
        text.lines().skip(1).any(|l| {
            let mut fields = l.split_whitespace();
            let local = fields.nth(1).unwrap_or_default();
            let state = fields.nth(1).unwrap_or_default();
            // 0A is TCP_LISTEN; the local address is hex, its port after the colon.
            state == "0A"
                && local
                    .rsplit_once(':')
                    .and_then(|(_, port)| u16::from_str_radix(port, 16).ok())
                    == Some(addr.port())
        })
    })
}

/// What a refused connection to `addr` on `provider` most likely means, for its error.
pub(crate) fn refused_hint(addr: SocketAddr, provider: &str) -> String {
    let shm = provider != "shm" && shm_listens(addr);
    let tcp = provider != "tcp" && tcp_listens(addr);
    match (shm, tcp) {
        (true, _) => {
            format!("an shm server listens at {addr}: open the client's device with `shm` (the server's provider)")
        }
        (false, true) => format!(
            "a TCP socket listens on port {} (a `tcp` server?): open the client's device with the server's provider",
            addr.port()
        ),
        (false, false) => {
            format!("start the server, or check the address and that the server runs the same provider ({provider})")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wildcards_follow_tcp() {
        let v4: SocketAddr = "127.0.0.1:7601".parse().expect("addr");
        assert_eq!(
            wildcards(v4),
            vec![
                "0.0.0.0:7601".parse::<SocketAddr>().expect("addr"),
                "[::]:7601".parse().expect("addr")
            ]
        );
        assert_eq!(
            wildcards("[::1]:7601".parse().expect("addr")),
            vec!["[::]:7601".parse().expect("addr")]
        );
        assert!(wildcards("0.0.0.0:7601".parse().expect("addr")).is_empty());
        // TEST-NET-1: never an address of this host.
        assert!(wildcards("192.0.2.1:7601".parse().expect("addr")).is_empty());
    }

    #[test]
    fn a_tcp_listener_is_seen_by_its_port() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr");
        assert!(tcp_listens(addr));
        drop(l);
        assert!(!tcp_listens(addr));
    }
}
