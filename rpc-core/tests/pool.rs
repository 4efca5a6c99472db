//! A server on a receive pool (`Config::receive_pool`): every connection's receives come from
//! one shared receive queue, its Sends from one pool of buffers, and it lends nothing. Over
//! `RDMA_RPC_PROVIDER` (default `tcp`).

use std::net::SocketAddr;
use std::sync::Arc;

#[allow(dead_code)]
mod common;

use common::{bounded, device, test_ip};

use rdma_rpc_core::transport::{
    AccessFlags, BufferPool, CompletionQueue, Device, QpOptions, QueuePair, RecvWr, SendWr,
};
use rdma_rpc_core::{Body, Buffers, Client, Config, RpcError, Server};

/// Echoes the request.
const ECHO: u32 = 1;
/// Answers `len` bytes (little-endian u64 in the request) of pattern `len`.
const MAKE: u32 = 2;
/// As MAKE, from a registered buffer of the connection's (a `RegisteredBuf` of the `Buffers` it takes).
const MAKE_BUF: u32 = 3;

fn pattern(len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(len as u8))
        .collect()
}

fn size_of(req: &[u8]) -> usize {
    req.get(..8)
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map_or(0, |b| u64::from_le_bytes(b) as usize)
}

/// A server on a pool of `slots` receive slots of 4 KiB pieces for `max` connections.
fn pooled(max: u32, slots: u32) -> Config {
    Config::default().piece(4096).receive_pool(slots).max_connections(max)
}

fn serve(dev: &Device, config: Config) -> SocketAddr {
    let server = Server::builder(config)
        .handler(ECHO, |req: Vec<u8>| async move { Ok::<_, RpcError>(req) })
        .handler(
            MAKE,
            |req: Vec<u8>| async move { Ok::<_, RpcError>(pattern(size_of(&req))) },
        )
        .handler(MAKE_BUF, |req: Body, bufs: Buffers| async move {
            let len = size_of(&req.bytes());
            let mut b = bufs.buffer(len)?;
            b.bytes_mut().copy_from_slice(&pattern(len));
            Ok(b)
        })
        .bind(dev, SocketAddr::new(test_ip(), 0))
        .expect("bind");
    let addr = server.local_addr().expect("addr");
    tokio::spawn(server.serve());
    addr
}

/// Calls of every size through one pool: small ones, ones in several 4 KiB pieces, requests
/// lent to the server, and answers above the threshold (which a server that lends nothing
/// sends in pieces), `depth` at once on each of `clients` connections.
async fn load(client_dev: &Device, addr: SocketAddr, clients: usize, depth: usize) {
    let sizes = [1usize, 3000, 20_000, 300_000];
    let mut conns = Vec::new();
    for _ in 0..clients {
        conns.push(Arc::new(connect_when_free(client_dev, addr).await));
    }
    let mut tasks = Vec::new();
    for (c, client) in conns.iter().enumerate() {
        for d in 0..depth {
            let client = client.clone();
            tasks.push(tokio::spawn(async move {
                for round in 0..3 {
                    let len = sizes[(c + d + round) % sizes.len()];
                    let req = pattern(len);
                    assert_eq!(
                        client.call(ECHO, req.clone()).await.expect("echo"),
                        req,
                        "echo of {len} B"
                    );
                    let ask = (len as u64 * 3).to_le_bytes().to_vec();
                    let method = if round % 2 == 0 { MAKE } else { MAKE_BUF };
                    let got = client.call(method, ask).await.expect("make");
                    assert_eq!(got, pattern(len * 3), "an answer of {} B", len * 3);
                }
            }));
        }
    }
    for t in tasks {
        bounded(t).await.expect("caller");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_connections_share_one_pool_and_every_call_is_answered_byte_for_byte() {
    let (server_dev, client_dev) = (device(), device());
    let addr = serve(&server_dev, pooled(24, 24 * 2 + 64));
    load(&client_dev, addr, 24, 4).await;
}

/// With exactly two slots per connection there is no spare credit: every connection keeps a
/// window of 2 (one message at a time) and no Send meets an empty queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_of_two_slots_a_connection_still_answers_every_call() {
    let (server_dev, client_dev) = (device(), device());
    let addr = serve(&server_dev, pooled(8, 16));
    load(&client_dev, addr, 8, 3).await;
}

/// Connections that come and go, idle or dropped with calls in flight, are noticed going (a
/// QP on a shared receive queue has no receives of its own to flush, so nothing comes to its
/// CQ to say so) and give their place back: the server takes as many again, and a full load
/// after them is answered. (That a dropped connection's slots are posted again is the pool's
/// own test.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_that_come_and_go_give_their_slots_and_credits_back() {
    let (server_dev, client_dev) = (device(), device());
    let addr = serve(&server_dev, pooled(6, 12 + 24));
    for round in 0..4 {
        let mut clients = Vec::new();
        for _ in 0..6 {
            clients.push(Arc::new(connect_when_free(&client_dev, addr).await));
        }
        let mut tasks = Vec::new();
        for c in &clients {
            for _ in 0..8 {
                let c = c.clone();
                tasks.push(tokio::spawn(async move {
                    let _ = c.call(ECHO, pattern(3000 + round)).await;
                }));
            }
        }
        // Half the rounds end with the calls still in flight.
        if round % 2 == 0 {
            for t in tasks {
                bounded(t).await.expect("caller");
            }
        } else {
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
            for t in &tasks {
                t.abort();
            }
        }
        drop(clients);
    }
    // Every connection of the rounds gone: the server takes 6 again.
    for _ in 0..6 {
        drop(connect_when_free(&client_dev, addr).await);
    }
    load(&client_dev, addr, 6, 4).await;
}

/// Connects once the server has room: connections of an earlier round may still be going.
async fn connect_when_free(dev: &Device, addr: SocketAddr) -> Client {
    for _ in 0..100 {
        match Client::connect(dev, addr, Config::default()).await {
            Ok(c) => return c,
            Err(RpcError::ConnectionRefused) => tokio::time::sleep(std::time::Duration::from_millis(50)).await,
            Err(e) => panic!("connect: {e}"),
        }
    }
    panic!("the server never had room again: connections that went are still counted");
}

/// What a connection costs a pooled server in registered memory: nothing of its own once it
/// is idle (the pool was registered when the server bound).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_connection_registers_no_memory_of_its_own() {
    let (server_dev, client_dev) = (device(), device());
    let addr = serve(&server_dev, pooled(64, 64 * 2));
    let bound = server_dev.registered_bytes();
    let mut clients = Vec::new();
    for _ in 0..32 {
        let c = Client::connect(&client_dev, addr, Config::default())
            .await
            .expect("connect");
        assert_eq!(c.call(ECHO, vec![7; 100]).await.expect("echo"), vec![7; 100]);
        clients.push(c);
    }
    let grown = server_dev.registered_bytes().saturating_sub(bound);
    println!("32 idle connections registered {grown} bytes on the server beyond its pool");
    assert_eq!(grown, 0, "a pooled server's connection registers nothing of its own");
}

#[test]
fn a_pool_below_two_slots_a_connection_is_refused_at_bind() {
    let dev = device();
    let err = Server::builder(pooled(100, 199))
        .handler(ECHO, |req: Vec<u8>| async move { Ok::<_, RpcError>(req) })
        .bind(&dev, SocketAddr::new(test_ip(), 0))
        .err()
        .expect("refused");
    assert!(
        matches!(&err, RpcError::Config(m) if m.contains("at least 200")),
        "{err}"
    );
}

/// A client that ignores its credits: it says hello as a client does, then sends `n` echo
/// requests at once, whatever the server granted (2 first, more as its pool allows, up to
/// `Config::ring`). Returns its QP and CQ, to watch.
async fn flooder(dev: &Device, addr: SocketAddr, n: usize) -> (QueuePair, CompletionQueue) {
    use rdma_rpc_core::proto::{Header, Hello, Kind};
    let (pd, cq) = (dev.alloc_pd().expect("pd"), dev.create_cq(1024).expect("cq"));
    // Room for every answer the server may give, so that none of them waits for a receive.
    let ring = BufferPool::new(&pd, 8 << 10, n, AccessFlags::LOCAL_WRITE).expect("ring");
    let recvs = (0..n as u64)
        .map(|i| RecvWr::new(i, ring.take().expect("slot")))
        .collect();
    let hello = Hello::from(&Config::default()).encode();
    let opts = QpOptions::new(&pd, &cq);
    let (qp, reply) = tokio::task::spawn_blocking(move || {
        rdma_rpc_core::transport::connect_with_recvs(addr, &opts, &hello, std::time::Duration::from_secs(30), recvs)
    })
    .await
    .expect("task")
    .expect("connect");
    let theirs = Hello::decode(&reply).expect("an rdma-rpc server");
    assert_eq!(theirs.credits, 2, "a pooled server grants 2 credits first");
    let sends = BufferPool::new(&pd, 256, n, AccessFlags::LOCAL_WRITE).expect("sends");
    for i in 0..n {
        let mut msg = Vec::new();
        Header {
            kind: Kind::Request,
            flags: 0,
            call_id: i as u32 + 1,
            method: ECHO,
            status: 0,
            credits: 0,
            body_len: 8,
            budget_us: 0,
        }
        .encode(&mut msg);
        msg.extend_from_slice(&(i as u64).to_le_bytes());
        let mut buf = sends.take().expect("a send buffer");
        buf.bytes_mut()[..msg.len()].copy_from_slice(&msg);
        qp.post_send(SendWr::send(FLOOD_SENT + i as u64, buf).len(msg.len()))
            .map_err(|e| e.error)
            .expect("post a send");
    }
    (qp, cq)
}

/// Work request ids of the flooder's Sends (its receives are numbered from 0).
const FLOOD_SENT: u64 = 1 << 32;

/// A client that ignores its credits floods a pool with room for the flood: the server drops
/// it at its first message beyond what it granted (at most `Config::ring`), a well-behaved
/// client's calls made meanwhile all complete, and every slot the flood took comes back, so
/// the server then takes its whole `max_connections` again, each connection answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_ignores_its_credits_is_dropped_and_the_others_are_served() {
    flood_a_pool(512, 200).await;
}

/// The same with a flood three times the pool: the flood's messages take every receive of the
/// pool before the server has looked at them, so the well-behaved client's Sends may wait for
/// receives (RNR retries) until the server has dropped the flooder and posted the slots again;
/// its calls still all complete, and every slot comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_larger_than_the_pool_is_dropped_and_the_others_are_served() {
    flood_a_pool(64, 200).await;
}

async fn flood_a_pool(slots: u32, flood: usize) {
    let (server_dev, client_dev) = (device(), device());
    let max = 8;
    let addr = serve(&server_dev, pooled(max, slots));
    let good = Client::connect(&client_dev, addr, Config::default())
        .await
        .expect("connect");
    let calls = tokio::spawn(async move {
        for i in 0..30u8 {
            let r = good.call(ECHO, vec![i; 100]).await;
            assert_eq!(r.as_deref(), Ok(&[i; 100][..]), "call {i} of the well-behaved client");
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
        good
    });
    let (qp, cq) = flooder(&client_dev, addr, flood).await;
    // The server ends the flooder's connection: its QP goes to the error state (its sends
    // unreceived, its receives flushed).
    let start = std::time::Instant::now();
    let mut out = Vec::new();
    while !qp.is_error()
        && !out
            .iter()
            .any(|c: &rdma_rpc_core::transport::Completion| !c.status.is_success())
    {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(30),
            "the flooding client was not dropped"
        );
        cq.poll(&mut out, 64).expect("poll");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    // Answers that came before the drop, as far as its receives say.
    cq.poll(&mut out, 1024).expect("poll");
    let answered = out
        .iter()
        .filter(|c| c.status.is_success() && c.wr_id < FLOOD_SENT)
        .count();
    println!(
        "the flooder was dropped after {:?}; {answered} of its requests answered",
        start.elapsed()
    );
    let most = Config::default().ring as usize;
    assert!(
        answered <= most,
        "the server answered {answered} of {flood} requests, beyond the {most} credits it can grant"
    );
    drop((qp, cq));
    let good = bounded(calls).await.expect("the well-behaved client's calls");
    // Every slot and credit came back: the whole `max_connections` again, each answered.
    let mut clients = vec![good];
    for _ in 1..max {
        clients.push(connect_when_free(&client_dev, addr).await);
    }
    for (i, c) in clients.iter().enumerate() {
        let want = pattern(3000 + i);
        assert_eq!(
            bounded(c.call(ECHO, want.clone())).await.as_deref(),
            Ok(&want[..]),
            "client {i}"
        );
    }
}
