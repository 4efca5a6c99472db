//! Where a test's servers run: in the test's own process, or on another host.
//!
//! A test binds its server as usual and hands it to [`serve`], which gives the address to
//! connect to. Three roles, from the environment:
//! - **here** (the default): the server is served in this process.
//! - **client** (`RDMA_RPC_ROLE=client` and `RDMA_RPC_PEER_IP`, as the two-host lane's host B
//!   runs the suites): the server bound here is dropped; the same test binary runs the same test
//!   on the peer host (through `split_agent` there, `rpc-core/tests/split_agent.rs`) up to its
//!   own `serve` of that server, which serves there. The test goes on here against the peer's
//!   address; the peer's process ends when the test's thread does.
//! - **server half** (`RDMA_RPC_SERVE_INDEX=K`, set by the agent or by [`serve_apart`]): the
//!   test runs up to its `K`th `serve` (counting from 0), prints the address and serves until
//!   killed. Earlier `serve`s of the test serve here, so the test runs as it would alone up to
//!   there.
//!
//! Servers are counted per test, so `serve` must be called on the test's own thread (libtest
//! names it after the test), as a `#[tokio::test]` body's future is polled.

use std::cell::RefCell;
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A server bound in this process, as [`serve`] takes it: an RPC server, or a transport test's
/// listening peer. Each test binary implements it for its own.
pub trait Serve: Sized + Send + 'static {
    /// The address it listens on.
    fn addr(&self) -> SocketAddr;
    /// Serves, spawned on the current runtime (or a thread of its own).
    fn start(self);
}

/// The port `split_agent` listens on, at its host's `RDMA_RPC_TEST_IP`.
pub const AGENT_PORT: u16 = 7900;
/// What a server half prints before it serves: this, then its address.
const SERVING: &str = "rdma-rpc-serving ";
/// The variable that makes a process a server half, and says which of the test's servers.
const INDEX_ENV: &str = "RDMA_RPC_SERVE_INDEX";

enum Role {
    Here,
    Client(IpAddr),
    Half(usize),
}

fn role() -> Role {
    if let Some(k) = std::env::var(INDEX_ENV).ok().and_then(|v| v.parse().ok()) {
        return Role::Half(k);
    }
    let client = std::env::var("RDMA_RPC_ROLE").is_ok_and(|r| r == "client");
    match std::env::var("RDMA_RPC_PEER_IP").ok().and_then(|p| p.parse().ok()) {
        Some(peer) if client => Role::Client(peer),
        _ => Role::Here,
    }
}

/// The running test's name (its thread's) and the number of this `serve` within it.
fn next_index() -> (String, usize) {
    static COUNTS: Mutex<Option<HashMap<String, usize>>> = Mutex::new(None);
    let name = std::thread::current()
        .name()
        .filter(|n| *n != "main")
        .unwrap_or_else(|| {
            panic!("split::serve runs on the test's own thread (libtest names it after the test), not in a spawned task or thread")
        })
        .to_owned();
    let mut counts = COUNTS.lock().unwrap_or_else(|e| e.into_inner());
    let n = counts.get_or_insert_with(HashMap::new).entry(name.clone()).or_insert(0);
    let k = *n;
    *n += 1;
    (name, k)
}

/// The command that runs test `name` of this binary as the server half for its `index`th
/// server: run by [`serve_apart`] here, and by the agent on the peer host.
pub fn half_command(exe: &str, name: &str, index: usize) -> Command {
    let mut cmd = Command::new(exe);
    cmd.args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(INDEX_ENV, index.to_string())
        .env_remove("RDMA_RPC_ROLE")
        .stdout(Stdio::piped());
    cmd
}

thread_local! {
    /// The peer host's processes serving this test: they end with the test's thread.
    static REMOTES: RefCell<Vec<Apart>> = const { RefCell::new(Vec::new()) };
}

/// Serves `server` where this run's servers live (see the module's text), started as
/// [`Serve::start`] starts it, and gives the address to connect to.
pub async fn serve<S: Serve>(server: S) -> SocketAddr {
    serve_on(server, S::start).await
}

/// As [`serve`], but `run` starts the server wherever the test wants it (a runtime or thread of
/// its own); `run` is called on the host that serves.
pub async fn serve_on<S: Serve>(server: S, run: impl FnOnce(S)) -> SocketAddr {
    match role() {
        Role::Here => here(server, run),
        Role::Half(k) => {
            let (_, i) = next_index();
            if i == k {
                serve_as_half(server, run).await
            } else {
                here(server, run)
            }
        }
        Role::Client(peer) => {
            let (name, i) = next_index();
            drop(server);
            let apart = Apart::start(Where::Peer(peer), &name, i).await;
            let addr = apart.addr;
            REMOTES.with(|r| r.borrow_mut().push(apart));
            addr
        }
    }
}

/// Serves `server` in this process whatever the role: for tests whose point is one host (both
/// ends on one core, say).
pub fn serve_here<S: Serve>(server: S) -> SocketAddr {
    here(server, S::start)
}

/// Serves `server` in another process that the test can kill: on the peer host in the client
/// role, else a child process of this one running the same test as its server half.
pub async fn serve_apart<S: Serve>(server: S) -> Apart {
    let (name, i) = next_index();
    match role() {
        Role::Half(k) if i == k => serve_as_half(server, S::start).await,
        Role::Half(_) => panic!("split::serve_apart: a server half serves its own server only"),
        Role::Here => {
            drop(server);
            Apart::start(Where::Child, &name, i).await
        }
        Role::Client(peer) => {
            drop(server);
            Apart::start(Where::Peer(peer), &name, i).await
        }
    }
}

fn here<S: Serve>(server: S, run: impl FnOnce(S)) -> SocketAddr {
    let addr = server.addr();
    run(server);
    addr
}

/// The server half's end: starts the server, prints its address and waits to be killed.
async fn serve_as_half<S: Serve, T>(server: S, run: impl FnOnce(S)) -> T {
    let addr = server.addr();
    run(server);
    println!("{SERVING}{addr}");
    let _ = std::io::stdout().flush();
    std::future::pending().await
}

enum Where {
    Child,
    Peer(IpAddr),
}

/// A server in another process: a child of this one, or one on the peer host.
pub struct Apart {
    pub addr: SocketAddr,
    /// The child here, or the connection to the agent on the peer host (its end kills it).
    child: Option<Child>,
    agent: Option<TcpStream>,
    /// Ends when the process's output does, which is when it has ended.
    drained: Option<std::thread::JoinHandle<()>>,
}

impl Apart {
    async fn start(at: Where, name: &str, index: usize) -> Apart {
        let exe = std::env::current_exe().expect("this test binary's path");
        let exe = exe.to_str().expect("a UTF-8 path").to_owned();
        let name = name.to_owned();
        tokio::task::spawn_blocking(move || Apart::start_blocking(at, &exe, &name, index))
            .await
            .expect("starting the server's process")
    }

    fn start_blocking(at: Where, exe: &str, name: &str, index: usize) -> Apart {
        let (child, agent, out): (_, _, Box<dyn std::io::Read + Send>) = match at {
            Where::Child => {
                let mut child = half_command(exe, name, index).spawn().expect("spawn the server half");
                let out = child.stdout.take().expect("its stdout");
                (Some(child), None, Box::new(out))
            }
            Where::Peer(peer) => {
                let agent = connect_agent(peer);
                let mut w = agent.try_clone().expect("a second handle on the agent's socket");
                writeln!(w, "serve\t{index}\t{exe}\t{name}").expect("asking the peer's agent");
                let r = agent.try_clone().expect("a third handle on the agent's socket");
                (None, Some(agent), Box::new(r))
            }
        };
        let mut lines = BufReader::new(out).lines();
        let mut seen = Vec::new();
        let addr = loop {
            match lines.next() {
                Some(Ok(line)) => {
                    // libtest may have begun the line ("test NAME ... ").
                    if let Some(at) = line.find(SERVING) {
                        let a = &line[at + SERVING.len()..];
                        break a.trim().parse::<SocketAddr>().expect("the server half's address");
                    }
                    seen.push(line);
                }
                _ => panic!(
                    "the server half of {name} (server {index}) ended before it served; it said:\n{}",
                    seen.join("\n")
                ),
            }
        };
        // The rest of its output, shown as it comes, until it ends.
        let drained = std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                println!("server half| {line}");
            }
        });
        Apart {
            addr,
            child,
            agent,
            drained: Some(drained),
        }
    }

    /// Kills the server's process at once (SIGKILL) and waits until it is gone.
    pub async fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = tokio::task::spawn_blocking(move || c.wait()).await;
        }
        if let Some(a) = self.agent.take() {
            // The agent kills its child when this end closes, then closes its own.
            let _ = a.shutdown(std::net::Shutdown::Write);
        }
        if let Some(d) = self.drained.take() {
            let _ = tokio::task::spawn_blocking(move || d.join()).await;
        }
    }
}

impl Drop for Apart {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if let Some(a) = self.agent.take() {
            let _ = a.shutdown(std::net::Shutdown::Write);
            if let Some(d) = self.drained.take() {
                // The agent closes once its child is gone: the next test meets no stale server.
                let _ = d.join();
            }
        }
    }
}

/// Connects to the peer's agent, waiting up to 60 s for it to listen.
fn connect_agent(peer: IpAddr) -> TcpStream {
    let at = SocketAddr::new(peer, AGENT_PORT);
    let t0 = Instant::now();
    loop {
        match TcpStream::connect_timeout(&at, Duration::from_secs(5)) {
            Ok(s) => return s,
            Err(e) if t0.elapsed() > Duration::from_secs(60) => {
                panic!("no split_agent at {at} (the peer host runs rpc-core/tests/split_agent.rs): {e}")
            }
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}
