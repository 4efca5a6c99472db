//! A [`Channel`] outlives its server: restarted under load (killed, or shut down gracefully),
//! the server is connected to again and serves new calls; every call that failed says whether
//! it may have run, and none ran twice. Runs on the provider named by `RDMA_RPC_PROVIDER`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[allow(dead_code)]
mod common;

use common::{bounded, device, test_ip};
use rdma_rpc_core::{Channel, Config, Reconnect, RpcError, Server};

const COUNT: u32 = 1;

/// Runs of each call id (the request's 8 bytes), across the server's lives.
type Runs = Arc<Mutex<HashMap<u64, usize>>>;

/// An address on the test IP that a server can bind: one a server held a moment ago.
fn free_addr() -> SocketAddr {
    let probe = Server::builder(Config::default())
        .bind(&device(), SocketAddr::new(test_ip(), 0))
        .expect("bind");
    probe.local_addr().expect("addr")
}

/// A server counting runs, bound on `addr`.
fn bind(addr: SocketAddr, runs: &Runs) -> Result<Server, RpcError> {
    let runs = runs.clone();
    Server::builder(Config::default())
        .handler(COUNT, move |req: Vec<u8>| {
            let runs = runs.clone();
            async move {
                let id = u64::from_le_bytes(req[..8].try_into().map_err(|_| RpcError::BadRequest("an id".into()))?);
                *runs.lock().expect("runs").entry(id).or_default() += 1;
                Ok(req)
            }
        })
        .bind(&device(), addr)
}

/// A server counting runs on `addr`, served until `stop` fires (gracefully) or the task is
/// aborted (its connections dropped at once).
fn start(addr: SocketAddr, runs: &Runs, stop: tokio::sync::oneshot::Receiver<()>) -> tokio::task::JoinHandle<()> {
    let server = bind(addr, runs).expect("bind");
    serve(server, stop)
}

fn serve(server: Server, stop: tokio::sync::oneshot::Receiver<()>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let _ = server
            .serve_with_shutdown(async move {
                let _ = stop.await;
            })
            .await;
    })
}

/// Binds `addr` again as soon as the old server has let it go.
async fn restart(
    addr: SocketAddr,
    runs: &Runs,
    stop: tokio::sync::oneshot::Receiver<()>,
) -> tokio::task::JoinHandle<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match bind(addr, runs) {
            Ok(server) => return serve(server, stop),
            Err(_) if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(10)).await,
            Err(e) => panic!("binding {addr} again: {}", e.report()),
        }
    }
}

/// Each call's id and result, as a caller saw them.
type Results = Vec<(u64, Result<(), RpcError>)>;

/// Callers that keep calling through `channel` until told to stop.
fn callers(
    channel: &Channel,
    n: u64,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> Vec<tokio::task::JoinHandle<Results>> {
    (0..n)
        .map(|t| {
            let (channel, stop) = (channel.clone(), stop.clone());
            tokio::spawn(async move {
                let mut out = Vec::new();
                let mut i = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let id = (t << 32) | i;
                    i += 1;
                    let r = channel.call(COUNT, id.to_le_bytes().to_vec()).await;
                    if let Ok(body) = &r {
                        assert_eq!(body, &id.to_le_bytes(), "call {id}'s answer");
                    }
                    let failed = r.is_err();
                    out.push((id, r.map(|_| ())));
                    if failed {
                        // Not a busy loop while the server is away.
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                }
                out
            })
        })
        .collect()
}

/// Restarts the server under the callers' load, `gracefully` or not, and checks what each
/// call's result says against what the server ran.
async fn restart_under_load(gracefully: bool) {
    let runs = Runs::default();
    let (stop1, stopped1) = tokio::sync::oneshot::channel();
    let addr = free_addr();
    let first = start(addr, &runs, stopped1);
    let policy = Reconnect {
        give_up_after: Duration::from_secs(20),
        ..Reconnect::default()
    };
    let channel = bounded(Channel::connect(&device(), addr, Config::default(), policy))
        .await
        .expect("connect");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let tasks = callers(&channel, 8, stop.clone());
    tokio::time::sleep(Duration::from_millis(200)).await;
    if gracefully {
        let _ = stop1.send(());
        bounded(first).await.expect("the first server's task");
    } else {
        drop(stop1);
        first.abort();
        let _ = first.await;
    }
    let before = runs.lock().expect("runs").len();
    let (stop2, stopped2) = tokio::sync::oneshot::channel();
    let second = restart(addr, &runs, stopped2).await;
    // Until the new server has served a good number of calls.
    let deadline = Instant::now() + Duration::from_secs(60);
    while runs.lock().expect("runs").len() < before + 500 {
        assert!(Instant::now() < deadline, "the restarted server served too few calls");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut results = Vec::new();
    for t in tasks {
        results.extend(bounded(t).await.expect("a caller"));
    }
    let _ = stop2.send(());
    bounded(second).await.expect("the second server's task");
    let runs = runs.lock().expect("runs");
    let (mut ok, mut unrun, mut maybe) = (0, 0, 0);
    for (id, r) in &results {
        let ran = runs.get(id).copied().unwrap_or(0);
        assert!(ran <= 1, "call {id} ran {ran} times");
        match r {
            Ok(()) => {
                assert_eq!(ran, 1, "call {id} answered without running");
                ok += 1;
            }
            Err(e) if e.did_not_run() => {
                assert_eq!(ran, 0, "call {id} failed as not run ({e}), yet ran");
                unrun += 1;
            }
            Err(RpcError::ConnectionLost(_)) => maybe += 1,
            Err(e) => panic!("call {id}: {}", e.report()),
        }
    }
    assert!(channel.reconnects() >= 1, "the channel never connected again");
    eprintln!(
        "{} restart: {ok} ok, {unrun} failed unrun, {maybe} lost in flight, {} reconnects",
        if gracefully { "graceful" } else { "abrupt" },
        channel.reconnects()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_channel_serves_new_calls_after_its_server_is_killed_and_restarted_under_load() {
    restart_under_load(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_channel_serves_new_calls_after_its_server_shuts_down_and_restarts_under_load() {
    restart_under_load(true).await;
}

/// With nothing to connect to, a call waits for at most the channel's bound and then fails
/// with the last attempt's error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_channel_gives_up_after_its_bound() {
    let runs = Runs::default();
    let (stop, stopped) = tokio::sync::oneshot::channel();
    let addr = free_addr();
    let server = start(addr, &runs, stopped);
    let policy = Reconnect {
        give_up_after: Duration::from_millis(300),
        ..Reconnect::default()
    };
    let channel = bounded(Channel::connect(&device(), addr, Config::default(), policy))
        .await
        .expect("connect");
    assert!(bounded(channel.call(COUNT, 7u64.to_le_bytes().to_vec())).await.is_ok());
    let _ = stop.send(());
    bounded(server).await.expect("the server's task");
    let t = Instant::now();
    let r = bounded(channel.call(COUNT, 8u64.to_le_bytes().to_vec())).await;
    let took = t.elapsed();
    // The connection's end first (ShuttingDown, not run), then the refused connections.
    let r = match r {
        Err(RpcError::ShuttingDown) => bounded(channel.call(COUNT, 9u64.to_le_bytes().to_vec())).await,
        other => other,
    };
    assert!(
        matches!(&r, Err(RpcError::Transport(_)) | Err(RpcError::ConnectionRefused)),
        "{r:?}"
    );
    assert!(took < Duration::from_secs(10), "gave up after {took:?}");
    assert_eq!(channel.reconnects(), 0);
}
