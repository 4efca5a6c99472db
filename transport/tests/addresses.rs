//! Addresses as TCP has them, on every software provider: a wildcard listener (`0.0.0.0:P`,
//! `[::]:P`) takes connections to any address of this host with port P, a wildcard and a
//! specific address of one port exclude each other, and a connection nothing of this provider
//! listens for says what most likely went wrong (a server of another provider there).

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use rdma_rpc_transport::{connect, Device, Error, Listener, QpOptions};

const WAIT: Duration = Duration::from_secs(10);

/// Connects to `to` on `dev` while `listener` accepts; the accepted side's private data.
fn connects(dev: &Device, listener: &Listener, to: SocketAddr) -> Result<(), Error> {
    let pd = dev.alloc_pd()?;
    let cq = dev.create_cq(16)?;
    let accepting = std::thread::scope(|s| {
        let acc = s.spawn(|| {
            let apd = dev.alloc_pd()?;
            let acq = dev.create_cq(16)?;
            let req = listener.accept(Some(WAIT))?;
            req.accept(&QpOptions::new(&apd, &acq), b"")
        });
        let c = connect(to, &QpOptions::new(&pd, &cq), b"hi", WAIT);
        (c, acc.join().expect("the accepting thread"))
    });
    let (client, server) = accepting;
    client?;
    server?;
    Ok(())
}

/// This host's first address that is not loopback, if it has one.
fn other_local_ip() -> Option<IpAddr> {
    // The address a UDP socket would send from towards a public one: no packet is sent.
    let s = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
    s.connect("192.0.2.1:9").ok()?;
    let ip = s.local_addr().ok()?.ip();
    (!ip.is_loopback() && !ip.is_unspecified()).then_some(ip)
}

#[test]
fn an_shm_wildcard_listener_takes_connections_to_every_local_address() {
    let dev = Device::open("shm").expect("shm");
    for wild in ["0.0.0.0:0", "[::]:0"] {
        let listener = Listener::bind(&dev, wild.parse().expect("addr")).expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let mut targets = vec![SocketAddr::from(([127, 0, 0, 1], port))];
        targets.extend(other_local_ip().map(|ip| SocketAddr::new(ip, port)));
        if wild.starts_with('[') {
            targets.push(SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, port)));
        }
        for to in targets {
            connects(&dev, &listener, to).unwrap_or_else(|e| panic!("{wild}: connecting to {to}: {e}"));
        }
    }
}

#[test]
fn an_shm_wildcard_and_a_specific_address_of_one_port_exclude_each_other() {
    let dev = Device::open("shm").expect("shm");
    let specific = Listener::bind(&dev, "127.0.0.1:0".parse().expect("addr")).expect("bind");
    let port = specific.local_addr().expect("addr").port();
    for wild in [
        SocketAddr::from(([0, 0, 0, 0], port)),
        SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, port)),
    ] {
        let e = Listener::bind(&dev, wild).err().expect("the wildcard is refused");
        assert_eq!(
            e.io_error().map(|e| e.kind()),
            Some(std::io::ErrorKind::AddrInUse),
            "{e}"
        );
    }
    drop(specific);
    let wild = Listener::bind(&dev, SocketAddr::from(([0, 0, 0, 0], port))).expect("the port is free again");
    let e = Listener::bind(&dev, SocketAddr::from(([127, 0, 0, 1], port)))
        .err()
        .expect("the specific address is refused");
    assert_eq!(
        e.io_error().map(|e| e.kind()),
        Some(std::io::ErrorKind::AddrInUse),
        "{e}"
    );
    // Another address's port is its own.
    let other = Listener::bind(&dev, "127.0.0.1:0".parse().expect("addr")).expect("another port");
    assert_ne!(other.local_addr().expect("addr").port(), port);
    drop(wild);
}

#[test]
fn an_shm_client_reaches_no_wildcard_for_an_address_of_another_host() {
    let dev = Device::open("shm").expect("shm");
    let listener = Listener::bind(&dev, "0.0.0.0:0".parse().expect("addr")).expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let pd = dev.alloc_pd().expect("pd");
    let cq = dev.create_cq(4).expect("cq");
    // TEST-NET-1: not this host, so the local wildcard listener is not it.
    let to = SocketAddr::from(([192, 0, 2, 1], port));
    let e = refused(connect(to, &QpOptions::new(&pd, &cq), b"", WAIT));
    assert!(matches!(e, Error::Refused { .. }), "{e}");
}

/// The error of a connection to `to` on `dev`.
fn refusal(dev: &Device, to: SocketAddr) -> Error {
    let pd = dev.alloc_pd().expect("pd");
    let cq = dev.create_cq(4).expect("cq");
    refused(connect(to, &QpOptions::new(&pd, &cq), b"", WAIT))
}

/// The error of a connection that must fail.
fn refused<T>(r: Result<T, Error>) -> Error {
    match r {
        Ok(_) => panic!("connected where nothing should take the connection"),
        Err(e) => e,
    }
}

#[test]
fn a_client_of_another_provider_than_its_server_is_told_so() {
    let (tcp, shm) = (Device::open("tcp").expect("tcp"), Device::open("shm").expect("shm"));
    // A tcp server, an shm client.
    let at_tcp = Listener::bind(&tcp, "127.0.0.1:0".parse().expect("addr")).expect("bind");
    let e = refusal(&shm, at_tcp.local_addr().expect("addr"));
    assert_eq!(
        e.io_error().map(|e| e.kind()),
        Some(std::io::ErrorKind::ConnectionRefused)
    );
    assert!(e.to_string().contains("TCP socket listens on port"), "{e}");
    // An shm server (on a wildcard), a tcp client.
    let at_shm = Listener::bind(&shm, "0.0.0.0:0".parse().expect("addr")).expect("bind");
    let port = at_shm.local_addr().expect("addr").port();
    let e = refusal(&tcp, SocketAddr::from(([127, 0, 0, 1], port)));
    assert_eq!(
        e.io_error().map(|e| e.kind()),
        Some(std::io::ErrorKind::ConnectionRefused)
    );
    assert!(e.to_string().contains("an shm server listens"), "{e}");
    // Nothing at all.
    drop(at_shm);
    for dev in [&tcp, &shm] {
        let e = refusal(dev, SocketAddr::from(([127, 0, 0, 1], port)));
        let text = e.to_string();
        assert!(
            text.contains("nothing listens") && text.contains("start the server"),
            "{text}"
        );
        // The message or the source, not both: the OS's words are the source's alone.
        assert!(!text.contains("os error"), "{text}");
    }
}
