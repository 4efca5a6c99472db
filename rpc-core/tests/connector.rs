//! Clients made by one `Connector`: their connections share completion queues, 64 to one.
//! Every call still reaches its own server and comes back to its own caller, byte for byte;
//! one server's end fails only its own clients. Over `RDMA_RPC_PROVIDER` (default `tcp`).

use std::net::SocketAddr;
use std::sync::Arc;

#[allow(dead_code)]
mod common;

use common::{bounded, device, test_ip};

use rdma_rpc_core::transport::Device;
use rdma_rpc_core::{CompletionMode, Config, Connector, RpcError, Server};

/// Answers the server's tag, then the request.
const TAGGED: u32 = 1;

fn pattern(len: usize, seed: usize) -> Vec<u8> {
    (0..len).map(|i| (i.wrapping_mul(31) ^ seed) as u8).collect()
}

/// A server whose answers start with `tag`; stops when `stop` fires.
fn serve(dev: &Device, tag: u8, stop: tokio::sync::oneshot::Receiver<()>) -> SocketAddr {
    let server = Server::builder(Config::default())
        .handler(TAGGED, move |req: Vec<u8>| async move {
            let mut v = Vec::with_capacity(req.len() + 1);
            v.push(tag);
            v.extend_from_slice(&req);
            Ok::<_, RpcError>(v)
        })
        .bind(dev, SocketAddr::new(test_ip(), 0))
        .expect("bind");
    let addr = server.local_addr().expect("addr");
    tokio::spawn(server.serve_with_shutdown(async move {
        let _ = stop.await;
    }));
    addr
}

/// 150 clients of one connector (three shared CQs), half to each of two servers, each with
/// four calls in flight of sizes from one byte to past the rendezvous threshold.
async fn every_call_reaches_its_own_server(mode: CompletionMode) {
    let (sdev, cdev) = (device(), device());
    let (_stop_a, a) = tokio::sync::oneshot::channel();
    let (_stop_b, b) = tokio::sync::oneshot::channel();
    let servers = [serve(&sdev, 0xa0, a), serve(&sdev, 0xb0, b)];
    let connector = Connector::new(&cdev, Config::default().ring(8).mode(mode)).expect("connector");
    let mut clients = Vec::new();
    for i in 0..150 {
        clients.push(Arc::new(connector.connect(servers[i % 2]).await.expect("connect")));
    }
    let sizes = [1usize, 700, 9000, 200_000];
    let mut tasks = Vec::new();
    for (c, client) in clients.iter().enumerate() {
        for d in 0..4 {
            let client = client.clone();
            tasks.push(tokio::spawn(async move {
                let tag = [0xa0, 0xb0][c % 2];
                for round in 0..3 {
                    let len = sizes[(c + d + round) % sizes.len()];
                    let req = pattern(len, c * 16 + d);
                    let got = client.call(TAGGED, req.clone()).await.expect("call");
                    assert_eq!(got.first(), Some(&tag), "client {c}: answered by its own server");
                    assert!(got[1..] == req[..], "client {c}, call {d}: {len} B back byte for byte");
                }
            }));
        }
    }
    for t in tasks {
        bounded(t).await.expect("caller");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_call_of_many_clients_on_shared_queues_reaches_its_own_server_adaptive() {
    every_call_reaches_its_own_server(CompletionMode::default()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_call_of_many_clients_on_shared_queues_reaches_its_own_server_event() {
    every_call_reaches_its_own_server(CompletionMode::Event).await;
}

/// Clients of two servers on the same shared CQs: when one server shuts down, its clients'
/// calls fail and the other's go on being answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_ends_fails_only_its_own_clients_on_a_shared_queue() {
    let (sdev, cdev) = (device(), device());
    let (stop_a, a) = tokio::sync::oneshot::channel();
    let (_stop_b, b) = tokio::sync::oneshot::channel();
    let servers = [serve(&sdev, 0xa0, a), serve(&sdev, 0xb0, b)];
    let connector = Connector::new(&cdev, Config::default().ring(8)).expect("connector");
    let mut clients = Vec::new();
    for i in 0..20 {
        clients.push(connector.connect(servers[i % 2]).await.expect("connect"));
    }
    for c in &clients {
        c.call(TAGGED, vec![1]).await.expect("a call before");
    }
    stop_a.send(()).expect("stop server a");
    // Server a's clients hear of its end: a call soon fails, and keeps failing.
    for (i, c) in clients.iter().enumerate().filter(|(i, _)| i % 2 == 0) {
        let failed = bounded(async {
            loop {
                if c.call(TAGGED, vec![2]).await.is_err() {
                    break true;
                }
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
        })
        .await;
        assert!(failed, "client {i} of the server that ended");
    }
    for (i, c) in clients.iter().enumerate().filter(|(i, _)| i % 2 == 1) {
        let got = c.call(TAGGED, vec![3]).await.expect("a call to the server still there");
        assert_eq!(got, [0xb0, 3], "client {i}");
    }
}
