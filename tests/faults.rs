//! Faults across hosts, on the `tcp` provider: the server runs as a separate process in its own
//! network namespace, joined to this one by a veth pair; the tests cut the link, drop packets
//! with nftables, delay traffic through a proxy, and kill and restart the server mid-transfer.
//!
//! Promises checked: every pending call ends with a clear error — `DeadlineExceeded` within its
//! deadline, `ConnectionLost` within the transport's dead-peer bound (TCP user timeout 5 s plus
//! keepalive) — never a hang; a new connection works once the network does; every transfer in
//! flight is accounted for against what the server ran (answered: ran once; failed as not run:
//! never ran; failed otherwise: at most once), and no handler runs twice for one call (calls
//! are never retried by the framework); registered bytes return to their starting level on
//! both sides.
//!
//! Needs root, `ip` (iproute2) and `nft` (nftables). Without them the tests say so and pass,
//! unless `RDMA_RPC_REQUIRE_NETNS=1` (set by scripts/test.sh), which makes that a failure.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdma_rpc::transport::Device;
use rdma_rpc::{CallOptions, Client, Config, RpcError, Server};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};

const ECHO: u32 = 1;
const SLOW: u32 = 2;
const BIG: u32 = 3;
const STATS: u32 = 4;
const CHILD_ENV: &str = "RDMA_RPC_FAULT_CHILD";
/// Longest a call may take to fail once its peer is unreachable: TCP user timeout (5 s),
/// keepalive (2 s idle + probes), scheduling slack on a loaded 2-core machine.
const DEAD_PEER_BOUND: Duration = Duration::from_secs(20);

fn sh(args: &[&str]) -> Result<(), String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .map_err(|e| format!("{}: {e}", args[0]))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn nft(script: &str) -> Result<(), String> {
    use std::io::Write;
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| format!("nft: {e}"))?;
    child
        .stdin
        .take()
        .ok_or("stdin")?
        .write_all(script.as_bytes())
        .map_err(|e| e.to_string())?;
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("nft: {}", String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// A second "host": a network namespace joined to this one by a veth pair.
struct Net {
    ns: String,
    host_if: String,
    table: String,
    server_ip: IpAddr,
}

static NEXT_NET: AtomicU32 = AtomicU32::new(1);

impl Net {
    /// `None` (with a message) where namespaces cannot be made, unless they are required.
    fn new() -> Option<Net> {
        let n = NEXT_NET.fetch_add(1, Ordering::Relaxed);
        let tag = format!("{}{n}", std::process::id() % 100_000);
        let subnet = format!("10.{}.{n}", 100 + std::process::id() % 100);
        let net = Net {
            ns: format!("rrns{tag}"),
            host_if: format!("rrh{tag}"),
            table: format!("rrfault{tag}"),
            server_ip: format!("{subnet}.1").parse().ok()?,
        };
        let peer_if = format!("rrp{tag}");
        let setup = || -> Result<(), String> {
            sh(&["ip", "netns", "add", &net.ns])?;
            sh(&[
                "ip",
                "link",
                "add",
                &net.host_if,
                "type",
                "veth",
                "peer",
                "name",
                &peer_if,
            ])?;
            sh(&["ip", "link", "set", &peer_if, "netns", &net.ns])?;
            sh(&["ip", "addr", "add", &format!("{subnet}.2/24"), "dev", &net.host_if])?;
            sh(&["ip", "link", "set", &net.host_if, "up"])?;
            let inns = |args: &[&str]| {
                let mut a = vec!["ip", "netns", "exec", &net.ns];
                a.extend_from_slice(args);
                sh(&a)
            };
            inns(&["ip", "addr", "add", &format!("{subnet}.1/24"), "dev", &peer_if])?;
            inns(&["ip", "link", "set", &peer_if, "up"])?;
            inns(&["ip", "link", "set", "lo", "up"])?;
            nft("")?; // nft is there
            Ok(())
        };
        match setup() {
            Ok(()) => Some(net),
            Err(e) => {
                drop(net);
                assert!(
                    std::env::var("RDMA_RPC_REQUIRE_NETNS").is_err(),
                    "network namespaces are required here but could not be set up: {e}"
                );
                println!("skipped: cannot build network namespaces here ({e}); run as root with iproute2 and nftables");
                None
            }
        }
    }

    /// Takes the link down (or up).
    fn link(&self, up: bool) {
        sh(&["ip", "link", "set", &self.host_if, if up { "up" } else { "down" }]).expect("ip link set");
    }

    /// Drops every packet on the link, both ways (or stops dropping).
    fn drop_packets(&self, on: bool) {
        if on {
            nft(&format!(
                "table inet {t} {{\n chain o {{ type filter hook output priority 0; oifname \"{i}\" drop; }}\n \
                 chain i {{ type filter hook input priority 0; iifname \"{i}\" drop; }}\n}}\n",
                t = self.table,
                i = self.host_if
            ))
            .expect("nft add");
        } else {
            nft(&format!("delete table inet {}\n", self.table)).expect("nft delete");
        }
    }

    /// Starts the server process inside the namespace.
    async fn server(&self) -> Child {
        let mut child = tokio::process::Command::new("ip")
            .args(["netns", "exec", &self.ns])
            .arg(std::env::current_exe().expect("exe"))
            .args([
                "--ignored",
                "--exact",
                "fault_server",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, self.server_ip.to_string())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn the server");
        let mut lines = tokio::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
        let addr: SocketAddr = loop {
            let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
                .await
                .expect("the server starts")
                .expect("read")
                .expect("a line");
            if let Some(at) = line.find("LISTEN ") {
                break line[at + 7..].trim().parse().expect("addr");
            }
        };
        let ran = Arc::new(Mutex::new(HashMap::<u64, u32>::new()));
        let r = ran.clone();
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(id) = line.strip_prefix("RAN ").and_then(|n| n.trim().parse().ok()) {
                    *r.lock().expect("ran").entry(id).or_default() += 1;
                }
            }
        });
        Child { child, addr, ran }
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        let _ = nft(&format!("delete table inet {}\n", self.table));
        let _ = sh(&["ip", "netns", "del", &self.ns]); // takes the veth pair with it
        let _ = sh(&["ip", "link", "del", &self.host_if]);
    }
}

/// The server process and what it reported running.
struct Child {
    child: tokio::process::Child,
    addr: SocketAddr,
    ran: Arc<Mutex<HashMap<u64, u32>>>,
}

impl Child {
    fn runs_of(&self, id: u64) -> u32 {
        self.ran.lock().expect("ran").get(&id).copied().unwrap_or(0)
    }

    fn assert_nothing_ran_twice(&self) {
        let ran = self.ran.lock().expect("ran");
        let twice: Vec<_> = ran.iter().filter(|(_, n)| **n > 1).collect();
        assert!(twice.is_empty(), "handlers ran more than once: {twice:?}");
    }
}

fn slow(id: u64, ms: u64) -> Vec<u8> {
    let mut v = id.to_le_bytes().to_vec();
    v.extend_from_slice(&ms.to_le_bytes());
    v
}

/// A `len`-byte BIG request whose first 8 bytes are its id (the server reports it as run).
fn big_request(id: u64, len: usize, fill: u8) -> Vec<u8> {
    let mut v = vec![fill; len.max(8)];
    v[..8].copy_from_slice(&id.to_le_bytes());
    v
}

/// Checks what became of call `id` against what the server reported running: answered, it ran
/// exactly once; failed as not run, it never ran (also not later); failed otherwise, at most once.
async fn assert_fate(server: &Child, id: u64, result: &Result<Vec<u8>, RpcError>) {
    match result {
        Ok(_) => {
            // The server reports the run before it answers; its line may still be on its way.
            let deadline = Instant::now() + Duration::from_secs(5);
            while server.runs_of(id) == 0 && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert_eq!(server.runs_of(id), 1, "call {id} was answered");
        }
        Err(e) if e.did_not_run() => assert_eq!(server.runs_of(id), 0, "call {id} failed as not run: {e}"),
        Err(e) => assert!(server.runs_of(id) <= 1, "call {id}: {e}"),
    }
}

fn u64_of(b: &[u8]) -> u64 {
    u64::from_le_bytes(b.get(..8).and_then(|s| s.try_into().ok()).unwrap_or([0; 8]))
}

/// Not a test: the server process, started inside a namespace by the tests below.
#[test]
#[ignore = "helper process for the fault tests"]
fn fault_server() {
    let Ok(ip) = std::env::var(CHILD_ENV) else {
        return;
    };
    let ip: IpAddr = ip.parse().expect("ip");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let dev = Device::open("tcp").expect("tcp");
        let stats_dev = dev.clone();
        let server = Server::builder(fault_config())
            .handler(ECHO, |r: Vec<u8>| async move { Ok(r) })
            .handler(SLOW, |r: Vec<u8>| async move {
                let (id, ms) = (u64_of(&r), u64_of(&r[8.min(r.len())..]));
                println!("RAN {id}");
                tokio::time::sleep(Duration::from_millis(ms)).await;
                Ok(id.to_le_bytes().to_vec())
            })
            .handler(BIG, |r: Vec<u8>| async move {
                println!("RAN {}", u64_of(&r));
                let sum = r
                    .iter()
                    .fold(0u64, |a, b| a.wrapping_mul(31).wrapping_add(u64::from(*b)));
                let mut out = sum.to_le_bytes().to_vec();
                out.resize(r.len(), 7);
                Ok(out)
            })
            .handler(STATS, move |_: Vec<u8>| {
                let n = stats_dev.registered_bytes();
                async move { Ok(n.to_le_bytes().to_vec()) }
            })
            .bind(&dev, SocketAddr::new(ip, 0))
            .expect("bind");
        println!("LISTEN {}", server.local_addr().expect("addr"));
        let _ = server.serve().await;
    });
}

/// Both sides: 64 KiB and up go by rendezvous (the tcp provider's own default would send even
/// 8 MiB eagerly), so that the faults hit RDMA Reads in flight; 32-64 KiB go in pieces.
fn fault_config() -> Config {
    Config::default().eager_threshold(64 << 10)
}

fn with_deadline(ms: u64) -> CallOptions {
    CallOptions::default().deadline(Duration::from_millis(ms))
}

async fn connect(dev: &Device, addr: SocketAddr) -> Client {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let config = fault_config().connect_timeout(Duration::from_secs(3));
        match Client::connect(dev, addr, config).await {
            Ok(c) => return c,
            Err(e) if Instant::now() < deadline => {
                println!("reconnect: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("could not connect to {addr}: {e}"),
        }
    }
}

async fn stats(client: &Client) -> u64 {
    u64_of(&client.call(STATS, vec![]).await.expect("stats"))
}

/// Waits until the server's registered bytes (seen through `client`, one connection) are
/// back at `want`: the server noticed the dead connections and freed their memory.
async fn server_settles(client: &Client, want: u64) {
    let deadline = Instant::now() + DEAD_PEER_BOUND;
    loop {
        let now = stats(client).await;
        if now == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "server registered bytes {now}, expected {want}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn client_settles(dev: &Device) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while dev.registered_bytes() != 0 {
        assert!(
            Instant::now() < deadline,
            "client registered bytes {}",
            dev.registered_bytes()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_link_ends_every_pending_call_in_time_and_clients_reconnect() {
    let Some(net) = Net::new() else { return };
    let server = net.server().await;
    let dev = Device::open("tcp").expect("tcp");
    let probe = connect(&dev, server.addr).await;
    let one_connection = stats(&probe).await;
    drop(probe);

    let client = connect(&dev, server.addr).await;
    let t0 = Instant::now();
    let (c1, c2, c3) = (client.clone(), client.clone(), client.clone());
    let with_deadline =
        tokio::spawn(async move { c1.with_options(with_deadline(1500)).call(SLOW, slow(1, 5000)).await });
    let without = tokio::spawn(async move { c2.call(SLOW, slow(2, 5000)).await });
    // Rendezvous transfers back to back, so that one is in flight when the link goes; each
    // with its id and outcome.
    let big = tokio::spawn(async move {
        let mut fates = Vec::new();
        for id in 100.. {
            let r = c3.call(BIG, big_request(id, 4 << 20, 1)).await;
            let failed = r.is_err();
            fates.push((id, r));
            if failed {
                break;
            }
        }
        fates
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    net.link(false);

    let r1 = with_deadline.await.expect("task");
    assert_eq!(r1, Err(RpcError::DeadlineExceeded));
    assert!(
        t0.elapsed() < Duration::from_millis(1500) + Duration::from_secs(2),
        "{:?}",
        t0.elapsed()
    );
    let without = without.await.expect("task");
    // The link is down: the transport gave up on the peer (not a close, not a protocol breach).
    assert!(
        matches!(&without, Err(RpcError::ConnectionLost(why)) if why.kind() == rdma_rpc::LostKind::Transport),
        "{without:?}"
    );
    let bigs = big.await.expect("task");
    let last = bigs.last().map(|(_, r)| r);
    assert!(matches!(last, Some(Err(RpcError::ConnectionLost(_)))), "{last:?}");
    let failed_after = t0.elapsed();
    assert!(failed_after < DEAD_PEER_BOUND, "calls took {failed_after:?} to fail");
    assert!(matches!(
        client.call(ECHO, vec![1]).await,
        Err(RpcError::ConnectionLost(_))
    ));
    drop(client);
    client_settles(&dev).await;

    net.link(true);
    let again = connect(&dev, server.addr).await;
    assert_eq!(again.call(ECHO, b"back".to_vec()).await.expect("echo"), b"back");
    server_settles(&again, one_connection).await;
    // Every transfer in flight: answered and run once, or failed and run at most once (never,
    // where the error says it did not run).
    assert_fate(&server, 1, &r1).await;
    assert_fate(&server, 2, &without).await;
    for (id, r) in &bigs {
        assert_fate(&server, *id, r).await;
    }
    server.assert_nothing_ran_twice();
    println!(
        "cut link: pending calls failed after {failed_after:?} ({} transfers, the last in flight); reconnected; server memory back to one connection's",
        bigs.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_packets_stall_calls_that_then_complete_once_or_fail_in_time() {
    let Some(net) = Net::new() else { return };
    let server = net.server().await;
    let dev = Device::open("tcp").expect("tcp");
    let client = connect(&dev, server.addr).await;
    let one_connection = stats(&client).await;

    // A short outage: TCP retransmits, every call completes, each handler ran once.
    net.drop_packets(true);
    let calls: Vec<_> = (10..16u64)
        .map(|id| {
            let c = client.clone();
            tokio::spawn(async move { c.call(SLOW, slow(id, 50)).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    net.drop_packets(false);
    for (id, call) in (10..16u64).zip(calls) {
        let r = call.await.expect("task").expect("a call survives a short outage");
        assert_eq!(u64_of(&r), id);
        assert_eq!(server.runs_of(id), 1, "call {id}");
    }

    // A long one: deadlines fire on time, the rest fail once the peer is declared dead.
    net.drop_packets(true);
    let t0 = Instant::now();
    let c = client.clone();
    let pending = tokio::spawn(async move { c.call(SLOW, slow(20, 10)).await });
    let r = client.with_options(with_deadline(500)).call(SLOW, slow(21, 10)).await;
    assert_eq!(r, Err(RpcError::DeadlineExceeded));
    assert!(t0.elapsed() < Duration::from_millis(2500), "{:?}", t0.elapsed());
    let r = pending.await.expect("task");
    assert!(matches!(r, Err(RpcError::ConnectionLost(_))), "{r:?}");
    assert!(t0.elapsed() < DEAD_PEER_BOUND, "{:?}", t0.elapsed());
    net.drop_packets(false);
    drop(client);
    client_settles(&dev).await;
    let again = connect(&dev, server.addr).await;
    server_settles(&again, one_connection).await;
    server.assert_nothing_ran_twice();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_mid_rendezvous_fails_the_call_and_a_restarted_one_serves() {
    let Some(net) = Net::new() else { return };
    let mut server = net.server().await;
    let dev = Device::open("tcp").expect("tcp");
    let client = connect(&dev, server.addr).await;
    let c = client.clone();
    let t0 = Instant::now();
    // 32 MiB requests: the server is reading one by RDMA Read when it dies.
    let big = tokio::spawn(async move {
        let mut fates = Vec::new();
        for id in 200.. {
            let r = c.call(BIG, big_request(id, 32 << 20, 3)).await;
            let failed = r.is_err();
            fates.push((id, r));
            if failed {
                break;
            }
        }
        fates
    });
    tokio::time::sleep(Duration::from_millis(400)).await;
    server.child.start_kill().expect("kill");
    let killed = Instant::now();
    let bigs = big.await.expect("task");
    let e = bigs
        .last()
        .and_then(|(_, r)| r.as_ref().err())
        .expect("the last transfer failed");
    assert!(matches!(e, RpcError::ConnectionLost(_)), "{e:?}");
    assert!(
        killed.elapsed() < Duration::from_secs(5),
        "a killed peer is noticed at once: {:?}",
        killed.elapsed()
    );
    let _ = server.child.wait().await;
    // What the killed server reported running before it died: each transfer answered ran
    // once, the one in flight at most once.
    for (id, r) in &bigs {
        assert_fate(&server, *id, r).await;
    }
    drop(client);
    client_settles(&dev).await;

    let restarted = net.server().await;
    let again = connect(&dev, restarted.addr).await;
    let r = again
        .call(BIG, big_request(300, 1 << 20, 5))
        .await
        .expect("the restarted server serves");
    assert_eq!(r.len(), 1 << 20);
    println!(
        "killed after {:?} of transfers; the call failed {:?} after the kill",
        killed - t0,
        killed.elapsed()
    );
}

/// Forwards TCP connections to `to`, holding every chunk `delay` in each direction.
async fn delaying_proxy(to: SocketAddr, delay: Duration) -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((inbound, _)) = l.accept().await {
            let outbound = match tokio::net::TcpStream::connect(to).await {
                Ok(s) => s,
                Err(e) => {
                    println!("proxy: connecting to {to}: {e}");
                    continue;
                }
            };
            let (_, _) = (inbound.set_nodelay(true), outbound.set_nodelay(true));
            let (ri, wi) = inbound.into_split();
            let (ro, wo) = outbound.into_split();
            tokio::spawn(pump(ri, wo, delay));
            tokio::spawn(pump(ro, wi, delay));
        }
    });
    addr
}

async fn pump(mut r: tokio::net::tcp::OwnedReadHalf, w: tokio::net::tcp::OwnedWriteHalf, delay: Duration) {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    tokio::spawn(async move {
        let mut w = w;
        while let Some((at, chunk)) = rx.recv().await {
            tokio::time::sleep_until(tokio::time::Instant::from_std(at)).await;
            if w.write_all(&chunk).await.is_err() {
                return;
            }
        }
    });
    let mut buf = vec![0u8; 64 << 10];
    while let Ok(n) = r.read(&mut buf).await {
        if n == 0 || tx.send((Instant::now() + delay, buf[..n].to_vec())).is_err() {
            return;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delaying_proxy_fires_deadlines_and_runs_nothing_twice() {
    let Some(net) = Net::new() else { return };
    let server = net.server().await;
    let proxy = delaying_proxy(server.addr, Duration::from_millis(150)).await;
    let dev = Device::open("tcp").expect("tcp");
    let client = connect(&dev, proxy).await;
    let t0 = Instant::now();
    let r = client.with_options(with_deadline(200)).call(SLOW, slow(30, 0)).await;
    assert_eq!(r, Err(RpcError::DeadlineExceeded), "300 ms round trip, 200 ms deadline");
    assert!(t0.elapsed() < Duration::from_millis(1200), "{:?}", t0.elapsed());
    let r = client
        .with_options(with_deadline(3000))
        .call(SLOW, slow(31, 0))
        .await
        .expect("fits");
    assert_eq!(u64_of(&r), 31);
    let r = client
        .call(BIG, big_request(32, 1 << 20, 9))
        .await
        .expect("rendezvous through the proxy");
    assert_eq!(r.len(), 1 << 20);
    // Let the late request of call 30 reach the server; it runs once at most, never twice.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(server.runs_of(30) <= 1);
    assert_eq!(server.runs_of(31), 1);
    assert_eq!(server.runs_of(32), 1);
    server.assert_nothing_ran_twice();
}
