//! A server's graceful shutdown (`Server::serve_with_shutdown`) over a real provider (from
//! `RDMA_RPC_PROVIDER`, default `tcp`; in the VM lane `verbs` on rxe0, with `RDMA_RPC_TEST_IP`):
//! every call either runs once and gets its answer or fails as not run, with callers busy,
//! handlers in flight, payloads on both sides of the threshold and idle clients connected.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

// Not every helper there is used here.
#[allow(dead_code)]
mod common;

use common::{bounded, device, test_ip, Rng};

use rdma_rpc_core::transport::Device;
use rdma_rpc_core::{Client, Config, RpcError, Server};

const ECHO: u32 = 1;
const STUCK: u32 = 2;
const THRESHOLD: usize = 16 * 1024;

fn config() -> Config {
    Config::default().eager_threshold(THRESHOLD)
}

/// A server whose echo handler counts its runs and sometimes takes a while (so that calls are
/// in flight, in handler tasks, when the shutdown starts), and whose `STUCK` handler never
/// finishes.
fn server(dev: &Device, runs: Arc<AtomicUsize>) -> Server {
    Server::builder(config())
        .handler(ECHO, move |req: Vec<u8>| {
            let runs = runs.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                if req.first().is_some_and(|b| b % 4 == 0) {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                Ok(req)
            }
        })
        .handler(STUCK, |_req: Vec<u8>| {
            std::future::pending::<Result<Vec<u8>, RpcError>>()
        })
        .bind(dev, SocketAddr::new(test_ip(), 0))
        .expect("bind")
}

/// What one caller saw: calls answered (each echo checked), and whether it ended on a call
/// refused as not run.
async fn caller(client: Arc<Client>, n: u64, shutting: Arc<AtomicBool>) -> (usize, bool) {
    let mut rng = Rng::new(n);
    let mut ok = 0;
    // Until the shutdown refuses a call (with a bound, should it never come).
    for _ in 0..1_000_000 {
        let len = if rng.next() % 4 == 0 { 64 * 1024 } else { 64 };
        let seed = rng.next();
        let req: Vec<u8> = (0..len).map(|i| (seed as usize).wrapping_add(i * 7) as u8).collect();
        match client.call(ECHO, req.clone()).await {
            Ok(resp) => {
                assert_eq!(resp, req, "caller {n}: an echo came back changed");
                ok += 1;
            }
            Err(RpcError::ShuttingDown) => {
                assert!(
                    shutting.load(Ordering::SeqCst),
                    "caller {n}: refused before the shutdown"
                );
                assert!(
                    client.is_shutting_down(),
                    "caller {n}: refused, and the client does not say why"
                );
                // Refused at once from now on, and still as not run.
                let again = client.call(ECHO, vec![1; 64]).await;
                assert_eq!(
                    again,
                    Err(RpcError::ShuttingDown),
                    "caller {n}: a call after the refusal"
                );
                return (ok, true);
            }
            Err(e) => panic!("caller {n}: {e} (a call must run or fail as not run)"),
        }
    }
    (ok, false)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_runs_each_call_once_or_fails_it_as_not_run() {
    let dev = device();
    let runs = Arc::new(AtomicUsize::new(0));
    let server = server(&dev, runs.clone());
    let addr = server.local_addr().expect("addr");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(server.serve_with_shutdown(async move {
        let _ = stopped.await;
    }));
    let shutting = Arc::new(AtomicBool::new(false));
    // Two busy clients with three callers each, and an idle one that called once.
    let mut callers = Vec::new();
    for c in 0..2u64 {
        let client = Arc::new(bounded(Client::connect(&dev, addr, config())).await.expect("connect"));
        for k in 0..3u64 {
            callers.push(tokio::spawn(caller(client.clone(), c * 10 + k + 1, shutting.clone())));
        }
    }
    let idle = bounded(Client::connect(&dev, addr, config())).await.expect("connect");
    assert_eq!(
        bounded(idle.call(ECHO, vec![1; 64])).await.expect("idle call"),
        vec![1; 64]
    );
    assert!(!idle.is_shutting_down(), "nothing said so before the shutdown");
    // Traffic first: a few hundred calls, so that the shutdown finds some in every state. The
    // runs count the idle client's call too: 301 runs are 300 of the callers' (checked below).
    for _ in 0..20_000 {
        if runs.load(Ordering::SeqCst) >= 301 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    shutting.store(true, Ordering::SeqCst);
    stop.send(()).expect("the server is serving");
    bounded(serving)
        .await
        .expect("serve task")
        .expect("serve_with_shutdown");
    let mut answered = 0;
    for t in callers {
        let (ok, refused) = bounded(t).await.expect("caller");
        assert!(refused, "every caller was still calling when the server shut down");
        answered += ok;
    }
    // Each answered call ran once; no call ran that was not answered.
    assert_eq!(
        answered + 1,
        runs.load(Ordering::SeqCst),
        "answered calls (and the idle one) against handler runs"
    );
    assert!(
        answered >= 300,
        "the shutdown came after the traffic: {answered} calls answered"
    );
    // The idle client did not hold the shutdown up; it sees it when it looks, and its next
    // call is refused as not run.
    assert!(
        idle.is_shutting_down(),
        "the idle client hears of the shutdown when it looks"
    );
    assert_eq!(bounded(idle.call(ECHO, vec![2; 64])).await, Err(RpcError::ShuttingDown));
    // Nobody listens any more.
    let late = tokio::time::timeout(Duration::from_secs(60), Client::connect(&dev, addr, config())).await;
    assert!(!matches!(late, Ok(Ok(_))), "a connection accepted after the shutdown");
    println!("{answered} calls answered before the shutdown, none lost");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_shutdown_that_waits_on_a_stuck_handler_closes_its_connection() {
    let dev = device();
    let server = server(&dev, Arc::new(AtomicUsize::new(0)));
    let addr = server.local_addr().expect("addr");
    let (stop, stopped) = tokio::sync::watch::channel(false);
    // Served until `stop`, then given a grace period of 300 ms, as `tokio::time::timeout`
    // around the shutdown would: past it, the future is dropped.
    let serving = tokio::spawn(async move {
        let mut grace = stopped.clone();
        let mut signal = stopped;
        let serve = server.serve_with_shutdown(async move {
            let _ = signal.wait_for(|s| *s).await;
        });
        tokio::select! {
            r = serve => Some(r),
            () = async {
                let _ = grace.wait_for(|s| *s).await;
                tokio::time::sleep(Duration::from_millis(300)).await;
            } => None,
        }
    });
    let client = Arc::new(bounded(Client::connect(&dev, addr, config())).await.expect("connect"));
    let stuck = tokio::spawn({
        let client = client.clone();
        async move { client.call(STUCK, vec![0; 64]).await }
    });
    // The stuck call reaches its handler: an echo sent after it is answered.
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(
        bounded(client.call(ECHO, vec![1; 64])).await.expect("echo"),
        vec![1; 64]
    );
    stop.send(true).expect("the server is serving");
    let ended = bounded(serving).await.expect("serving task");
    assert!(
        ended.is_none(),
        "the shutdown finished with a handler still running: {ended:?}"
    );
    // Dropped, the shutdown closed the connection: the stuck call fails as lost (it may have
    // run), and so does the next.
    let result = bounded(stuck).await.expect("stuck caller");
    assert!(
        matches!(
            &result,
            Err(RpcError::ConnectionLost(why))
                if matches!(why.kind(), rdma_rpc_core::LostKind::Closed | rdma_rpc_core::LostKind::Transport)
        ),
        "the stuck call fails as lost, its peer gone, once its connection closes: {result:?}"
    );
}
