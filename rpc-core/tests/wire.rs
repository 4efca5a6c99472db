//! Two hosts over a wire: what one host cannot show. Run by the test command's two-host lane
//! (`scripts/rxe-wire.sh`, two VMs with soft-RoCE on a virtual Ethernet wire) as
//! `RDMA_RPC_ROLE=server` on one host and `RDMA_RPC_ROLE=client` on the other, each with its
//! own address in `RDMA_RPC_TEST_IP` and the other's in `RDMA_RPC_PEER_IP`. The server's host
//! pulls its own link when asked (`ip link`), and the client's drops its own packets (`tc
//! netem`), so it needs root and hosts of its own: `cargo test` does not run it (`test = false`).
//!
//! The client checks, in order, and prints how long each took:
//! 1. calls cross the wire, byte for byte, from 1 B to 1 MiB;
//! 2. with 2% of its packets dropped, every call still completes (RC retransmits);
//! 3. after the server's link went down and came back, a new connection works;
//! 4. with the server's link pulled, every call ends within the documented bound, with and
//!    without a deadline: one whose request the server had acknowledged (nothing outstanding
//!    at the transport level, so only the keepalive's probe can tell), one made after the
//!    link went, and an idle connection's (`Client::is_connected` turns false).
//!
//! Step 3 flaps the link while no connection is up, and step 4 comes last: after a flap that
//! dropped live connections, Linux 6.1's rxe takes no new rdma_cm connection to that host
//! (none within 200 s in this lane, to a new listener either; a flap without connections, as
//! in step 3, leaves it working), so nothing can follow it in the same boot.

use std::net::{IpAddr, SocketAddr};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use rdma_rpc_core::transport::Device;
use rdma_rpc_core::{CallOptions, Client, Config, LostKind, RpcError, Server};

const PORT: u16 = 7700;
/// Echoes the request.
const ECHO: u32 = 1;
/// Never answers.
const HANG: u32 = 2;
/// Answers, then pulls the server's link: the request's u32 milliseconds later, for its u32
/// seconds; when its third u32 is 1, the server ends once the link is back.
const PULL: u32 = 3;
/// How long the server's link stays down in step 4.
const DOWN: Duration = Duration::from_secs(15);
/// Within how long every call on a dead path must end: 2 keepalive intervals (5 s each) to
/// notice the quiet, 7 tries of 1.07 s for the probe, and slack for the emulated hosts.
const BOUND: Duration = Duration::from_secs(30);

fn ip(var: &str) -> Option<IpAddr> {
    std::env::var(var).ok()?.parse().ok()
}

fn main() -> ExitCode {
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("wire: no runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let (Some(me), Some(peer)) = (ip("RDMA_RPC_TEST_IP"), ip("RDMA_RPC_PEER_IP")) else {
        eprintln!("wire: set RDMA_RPC_TEST_IP (this host) and RDMA_RPC_PEER_IP (the other): see scripts/rxe-wire.sh");
        return ExitCode::from(2);
    };
    let role = std::env::var("RDMA_RPC_ROLE").unwrap_or_default();
    let run = async {
        match role.as_str() {
            "server" => serve(me).await,
            "client" => client(SocketAddr::new(peer, PORT)).await,
            other => Err(format!("RDMA_RPC_ROLE is {other:?}: server or client")),
        }
    };
    match rt.block_on(async { tokio::time::timeout(Duration::from_secs(400), run).await }) {
        Ok(Ok(())) => {
            println!("wire: {role}: ok");
            ExitCode::SUCCESS
        }
        Ok(Err(e)) => {
            println!("wire: {role}: FAILED: {e}");
            ExitCode::FAILURE
        }
        Err(_) => {
            println!("wire: {role}: FAILED: not done within 400 s");
            ExitCode::FAILURE
        }
    }
}

fn device() -> Result<Device, String> {
    Device::open_default().map_err(|e| format!("opening the provider: {e}"))
}

/// Runs `cmd`, failing with its output when it fails.
fn sh(cmd: &[&str]) -> Result<(), String> {
    let out = Command::new(cmd[0])
        .args(&cmd[1..])
        .output()
        .map_err(|e| format!("{cmd:?}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{cmd:?}: {} {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// A PULL request: after `after_ms`, the link down for `secs`; `last`: the server ends after.
fn pull(after_ms: u32, secs: u32, last: bool) -> Vec<u8> {
    [after_ms, secs, u32::from(last)]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect()
}

async fn serve(me: IpAddr) -> Result<(), String> {
    let server = Server::builder(Config::default())
        .handler(ECHO, |req: Vec<u8>| async move { Ok::<_, RpcError>(req) })
        .handler(HANG, |_: Vec<u8>| std::future::pending::<Result<Vec<u8>, RpcError>>())
        .handler(PULL, |req: Vec<u8>| async move {
            let word = |i: usize| {
                req.get(4 * i..4 * i + 4)
                    .and_then(|b| b.try_into().ok())
                    .map_or(0, u32::from_le_bytes)
            };
            let (after, secs, last) = (word(0), word(1), word(2) == 1);
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(u64::from(after)));
                let down = sh(&["ip", "link", "set", "eth0", "down"]);
                println!("server: link down: {down:?}");
                std::thread::sleep(Duration::from_secs(u64::from(secs)));
                let up = sh(&["ip", "link", "set", "eth0", "up"]);
                println!("server: link up again: {up:?}");
                if last {
                    println!("wire: server: ok");
                    std::process::exit(if up.is_ok() { 0 } else { 1 });
                }
            });
            Ok::<_, RpcError>(Vec::new())
        })
        .bind(&device()?, SocketAddr::new(me, PORT))
        .map_err(|e| format!("bind: {}", e.report()))?;
    println!("server: listening on {me}:{PORT}");
    server.serve().await.map_err(|e| format!("serve: {}", e.report()))
}

/// A connection to `addr`, retried for up to `patience` (the other host may still boot, or
/// its link come back).
async fn connect(addr: SocketAddr, patience: Duration) -> Result<Client, String> {
    let start = Instant::now();
    loop {
        match Client::connect(&device()?, addr, Config::default()).await {
            Ok(c) => return Ok(c),
            Err(e) if start.elapsed() < patience => {
                println!("client: connect: {} (retrying)", e.report());
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => return Err(format!("connect to {addr}: {}", e.report())),
        }
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Whether `r` is the end a dead path gives: the connection lost, the transport's doing.
fn dead_path(r: &Result<Vec<u8>, RpcError>) -> bool {
    matches!(r, Err(RpcError::ConnectionLost(why) | RpcError::Unsent(why)) if why.kind() == LostKind::Transport)
}

async fn client(addr: SocketAddr) -> Result<(), String> {
    let c = connect(addr, Duration::from_secs(120)).await?;

    // 1. Byte for byte across the wire.
    let t = Instant::now();
    for (i, len) in [1usize, 64, 4096, 65536, 1 << 20].into_iter().enumerate() {
        let want = pattern(len, i as u8);
        let got = c
            .call(ECHO, want.clone())
            .await
            .map_err(|e| format!("echo {len} B: {}", e.report()))?;
        if got != want {
            return Err(format!("echo {len} B came back changed"));
        }
    }
    println!("client: 1. echo 1 B to 1 MiB across the wire: ok in {:?}", t.elapsed());

    // 2. A lossy link: RC retransmits, every call completes.
    sh(&["tc", "qdisc", "add", "dev", "eth0", "root", "netem", "loss", "2%"])?;
    let t = Instant::now();
    let mut lossy = Ok(());
    for i in 0..40usize {
        let len = [64, 4096][i % 2];
        let want = pattern(len, i as u8);
        match c.call(ECHO, want.clone()).await {
            Ok(got) if got == want => {}
            Ok(_) => lossy = Err(format!("call {i} ({len} B) came back changed under loss")),
            Err(e) => lossy = Err(format!("call {i} ({len} B) failed under 2% loss: {}", e.report())),
        }
        if lossy.is_err() {
            break;
        }
    }
    sh(&["tc", "qdisc", "del", "dev", "eth0", "root"])?;
    lossy?;
    println!(
        "client: 2. 40 calls with 2% of packets dropped: all completed in {:?}",
        t.elapsed()
    );

    // 3. A flap with no connection up: then a new connection works.
    c.call(PULL, pull(1000, 5, false))
        .await
        .map_err(|e| format!("asking the server to flap its link: {}", e.report()))?;
    drop(c);
    tokio::time::sleep(Duration::from_secs(8)).await;
    let t = Instant::now();
    let c = connect(addr, Duration::from_secs(60)).await?;
    let got = c
        .call(ECHO, b"back".to_vec())
        .await
        .map_err(|e| format!("echo after the flap: {}", e.report()))?;
    if got != b"back" {
        return Err("the echo after the flap came back changed".into());
    }
    println!(
        "client: 3. a new connection after the link came back: ok in {:?}",
        t.elapsed()
    );

    // 4. The server's link pulled: every call ends within the bound.
    let acked = connect(addr, Duration::from_secs(10)).await?;
    let idle = connect(addr, Duration::from_secs(10)).await?;
    let hang = tokio::spawn(async move { acked.call(HANG, b"wait".to_vec()).await });
    // Long enough for the request to be acknowledged: nothing is outstanding at the transport.
    tokio::time::sleep(Duration::from_secs(1)).await;
    c.call(PULL, pull(300, DOWN.as_secs() as u32, true))
        .await
        .map_err(|e| format!("asking the server to pull its link: {}", e.report()))?;
    // The server pulls it 300 ms after its answer left.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let t0 = Instant::now();
    let deadline = CallOptions::default().deadline(Duration::from_secs(60));
    let after = tokio::spawn({
        let c = c.clone();
        async move { c.call(ECHO, b"after".to_vec()).await }
    });
    let with_deadline = tokio::spawn({
        let c = c.with_options(deadline);
        async move { c.call(ECHO, b"deadline".to_vec()).await }
    });
    for (what, task) in [
        ("the acknowledged call (no deadline)", hang),
        ("a call made after the link went (no deadline)", after),
        ("a call with a 60 s deadline", with_deadline),
    ] {
        let r = tokio::time::timeout(BOUND, task)
            .await
            .map_err(|_| format!("{what} did not end within {BOUND:?} of the link going"))?
            .map_err(|e| format!("{what}: its task: {e}"))?;
        if !dead_path(&r) {
            return Err(format!(
                "{what} ended as {r:?}, not as a connection lost to the transport"
            ));
        }
        let why = r.err().map(|e| e.report().to_string()).unwrap_or_default();
        println!("client: 4. {what} ended {:?} after the link went: {why}", t0.elapsed());
    }
    while idle.is_connected() {
        if t0.elapsed() > BOUND {
            return Err(format!(
                "an idle connection still looked alive {BOUND:?} after the link went"
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!(
        "client: 4. an idle connection was found lost {:?} after the link went",
        t0.elapsed()
    );

    Ok(())
}
