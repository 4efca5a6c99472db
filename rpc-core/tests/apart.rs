//! On shm, a server connection whose thread finds itself on its client's CPU moves to another
//! one it may run on, instead of taking turns with the client on one core (about 17 µs a call
//! on a 2-vCPU guest, against 1 µs apart), and keeps its affinity mask.

use std::net::SocketAddr;

use rdma_rpc_core::transport::Device;
use rdma_rpc_core::{Client, Config, RpcError, Server};

#[path = "../../transport/tests/affinity/mod.rs"]
mod affinity;

use affinity::{mask, set_mask};

/// Puts the server's thread on the client's CPU, every CPU still allowed.
const JOIN: u32 = 1;
/// Answers the CPU the server's thread runs on.
const WHERE: u32 = 2;

#[test]
fn a_server_thread_on_its_clients_cpu_moves_to_another() {
    let all = mask();
    if all.len() < 2 {
        eprintln!("one CPU only: moving apart needs two");
        return;
    }
    let here = all[0];
    let dev = Device::open("shm").expect("the shm provider");
    let server_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("the server's runtime");
    let everywhere = all.clone();
    let server = Server::builder(Config::default())
        .handler(JOIN, move |_req: Vec<u8>| {
            let everywhere = everywhere.clone();
            async move {
                set_mask(&[here]);
                set_mask(&everywhere);
                Ok::<_, RpcError>(mask().len().to_le_bytes().to_vec())
            }
        })
        .handler(WHERE, |_req: Vec<u8>| async move {
            Ok::<_, RpcError>(rustix::thread::sched_getcpu().to_le_bytes().to_vec())
        })
        .bind(&dev, SocketAddr::from(([127, 0, 0, 1], 0)))
        .expect("bind");
    let addr = server.local_addr().expect("the server's address");
    let serving = server_rt.spawn(async move {
        let _ = server.serve().await;
    });
    // Every other CPU busy with a spinning thread of its own: the scheduler then has no idle
    // CPU to wake the server's thread on and no imbalance to even out, so the two stay on one
    // core unless the connection moves its thread (a move puts it beside a spinner, which is
    // enough to see it move).
    let stop = std::sync::atomic::AtomicBool::new(false);
    let cpus = std::thread::scope(|s| {
        for &cpu in &all[1..] {
            let stop = &stop;
            s.spawn(move || {
                set_mask(&[cpu]);
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            });
        }
        let cpus = s
            .spawn(|| {
                // The client's thread on `here` alone.
                set_mask(&[here]);
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("the client's runtime");
                rt.block_on(async {
                    let client = Client::connect(&dev, addr, Config::default()).await.expect("connect");
                    let n = client.call(JOIN, Vec::new()).await.expect("join");
                    assert_eq!(n, all.len().to_le_bytes(), "the server's thread keeps every CPU");
                    let mut cpus = Vec::new();
                    for _ in 0..CALLS {
                        let r = client.call(WHERE, Vec::new()).await.expect("where");
                        cpus.push(usize::from_le_bytes(r.try_into().expect("a usize")));
                    }
                    cpus
                })
            })
            .join();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        cpus.expect("the client's thread")
    });
    serving.abort();
    assert!(
        cpus.iter().any(|&c| c != here),
        "the server's thread stayed on the client's CPU {here} for {CALLS} calls"
    );
}

/// Calls after the server's thread joined the client's CPU.
const CALLS: usize = 200;
