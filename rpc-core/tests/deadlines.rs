//! Deadlines that hold: a call whose deadline passed before it could be run is not run, and
//! says so ([`RpcError::Expired`], [`RpcError::did_not_run`]); a call is never run twice,
//! and one answered `Ok` ran exactly once. Runs on the provider named by `RDMA_RPC_PROVIDER`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[allow(dead_code)]
mod common;

use common::{bounded, device, test_ip};
use rdma_rpc_core::{Body, CallOptions, Client, Config, RpcError, Server, ServerBuilder};

const COUNT: u32 = 1;
const SLOW: u32 = 2;

fn within(d: Duration) -> CallOptions {
    CallOptions::default().deadline(d)
}

async fn serve_and_connect(builder: ServerBuilder) -> Client {
    let dev = device();
    let server = builder.bind(&dev, SocketAddr::new(test_ip(), 0)).expect("bind");
    let addr = server.local_addr().expect("addr");
    tokio::spawn(server.serve());
    bounded(Client::connect(&dev, addr, Config::default()))
        .await
        .expect("connect")
}

/// Runs of each request id (its first 8 bytes) at the server.
type Runs = Arc<Mutex<HashMap<u64, usize>>>;

fn counting(runs: &Runs) -> ServerBuilder {
    let runs = runs.clone();
    Server::builder(Config::default()).handler_sync(COUNT, move |req: &Body| {
        let req = req.bytes();
        let id = u64::from_le_bytes(req[..8].try_into().map_err(|_| RpcError::BadRequest("an id".into()))?);
        *runs.lock().expect("runs").entry(id).or_default() += 1;
        Ok(req.to_vec())
    })
}

/// The case: a thousand calls with a deadline of one nanosecond. None is sent, none
/// runs, and each says it did not run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_whose_deadline_is_under_a_microsecond_fail_unsent_and_never_run() {
    let runs = Runs::default();
    let client = serve_and_connect(counting(&runs)).await;
    for id in 0..1000u64 {
        let r = bounded(
            client
                .with_options(within(Duration::from_nanos(1)))
                .call(COUNT, id.to_le_bytes().to_vec()),
        )
        .await;
        assert_eq!(r, Err(RpcError::Expired), "call {id}");
        assert!(RpcError::Expired.did_not_run());
    }
    // Everything sent before this call was handled before it.
    let sync = 1_000_000u64;
    let r = bounded(client.call(COUNT, sync.to_le_bytes().to_vec())).await;
    assert!(r.is_ok(), "{r:?}");
    let runs = runs.lock().expect("runs");
    assert_eq!(runs.len(), 1, "only the call without a deadline ran: {runs:?}");
}

/// Calls whose deadlines straddle the round trip, at once: whatever answered `Ok` ran exactly
/// once, what expired never ran, and nothing ran twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn across_the_deadline_race_a_call_runs_at_most_once_and_an_expired_one_never() {
    let runs = Runs::default();
    let client = serve_and_connect(counting(&runs)).await;
    // The round trip on this provider and machine, to spread the deadlines around it.
    let t = Instant::now();
    for id in 0..20u64 {
        bounded(client.call(COUNT, (u64::MAX - id).to_le_bytes().to_vec()))
            .await
            .expect("a timed call");
    }
    let rtt = t.elapsed() / 20;
    let n = 600u64;
    let calls: Vec<_> = (0..n)
        .map(|id| {
            let client = client.clone();
            // From nothing to three round trips.
            let d = rtt * 3 * id as u32 / n as u32;
            tokio::spawn(async move {
                (
                    id,
                    client
                        .with_options(within(d))
                        .call(COUNT, id.to_le_bytes().to_vec())
                        .await,
                )
            })
        })
        .collect();
    let mut results = HashMap::new();
    for c in calls {
        let (id, r) = bounded(c).await.expect("a caller");
        results.insert(id, r);
    }
    // Everything sent before this call was handled before it.
    bounded(client.call(COUNT, (u64::MAX - 100).to_le_bytes().to_vec()))
        .await
        .expect("the last call");
    let runs = runs.lock().expect("runs");
    let (mut ok, mut expired, mut late) = (0, 0, 0);
    for (id, r) in &results {
        let ran = runs.get(id).copied().unwrap_or(0);
        assert!(ran <= 1, "call {id} ran {ran} times");
        match r {
            Ok(body) => {
                assert_eq!(body, &id.to_le_bytes(), "call {id}'s answer");
                assert_eq!(ran, 1, "call {id} answered without running");
                ok += 1;
            }
            Err(RpcError::Expired) => {
                assert_eq!(ran, 0, "call {id} expired unrun, yet ran");
                expired += 1;
            }
            Err(RpcError::DeadlineExceeded) => late += 1,
            Err(e) => panic!("call {id}: {e}"),
        }
    }
    assert_eq!(ok + expired + late, n as usize);
    assert!(expired > 0, "no call expired: the deadlines start at zero");
    eprintln!("round trip {rtt:?}: {ok} ok, {expired} expired unrun, {late} past their deadline");
}

/// A request that arrives with others and whose deadline passes while the handlers before it
/// run (synchronous ones, on the connection's own thread) is not run, and neither is one
/// cancelled before its handler started.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_past_its_deadline_or_cancelled_before_its_handler_starts_is_not_run() {
    let counted = Arc::new(AtomicUsize::new(0));
    let seen = counted.clone();
    let client = serve_and_connect(
        Server::builder(Config::default())
            .handler_sync(SLOW, |req: &Body| {
                std::thread::sleep(Duration::from_millis(u64::from(req.bytes()[0])));
                Ok(req.bytes().to_vec())
            })
            .handler_sync(COUNT, move |req: &Body| {
                seen.fetch_add(1, Ordering::SeqCst);
                Ok(req.bytes().to_vec())
            }),
    )
    .await;
    // The first request holds the connection's thread for 100 ms; the next two arrive
    // meanwhile and are taken in one poll after it: a 250 ms handler, then the counted call
    // with a 150 ms deadline, which passes while that handler runs. Its caller gives up at
    // 150 ms and sends a Cancel, which comes after the request's turn.
    let first = tokio::spawn({
        let c = client.clone();
        async move { c.call(SLOW, vec![100]).await }
    });
    tokio::time::sleep(Duration::from_millis(10)).await;
    // `join!` starts them in this order: the slow one is sent first.
    let within150 = client.with_options(within(Duration::from_millis(150)));
    let (second, late) =
        bounded(async { tokio::join!(client.call(SLOW, vec![250]), within150.call(COUNT, vec![1])) }).await;
    assert_eq!(late, Err(RpcError::DeadlineExceeded), "the caller's own deadline");
    assert!(second.is_ok());
    assert!(bounded(first).await.expect("task").is_ok());
    assert_eq!(
        counted.load(Ordering::SeqCst),
        0,
        "the request past its deadline before its handler started ran"
    );
    // Cancelled: the caller drops it while the connection's thread is held, before the
    // server takes it.
    let first = tokio::spawn({
        let c = client.clone();
        async move { c.call(SLOW, vec![100]).await }
    });
    tokio::time::sleep(Duration::from_millis(10)).await;
    let dropped = tokio::time::timeout(Duration::from_millis(20), client.call(COUNT, vec![2])).await;
    assert!(dropped.is_err(), "the call was dropped mid-way");
    assert!(bounded(first).await.expect("task").is_ok());
    let r = bounded(client.call(COUNT, vec![3])).await;
    assert_eq!(r.as_deref(), Ok(&[3u8][..]));
    assert_eq!(counted.load(Ordering::SeqCst), 1, "only the last call ran");
}
