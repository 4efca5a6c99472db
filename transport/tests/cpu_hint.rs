//! `QueuePair::peer_shares_cpu`: on shm each end tells the other which CPU its poller runs on,
//! so that a poller can stop spinning for a peer it keeps off its own core, or move to another
//! (`QueuePair::leave_peer_cpu`). Other providers cannot know: they always say no and never
//! move a thread.

use std::time::Duration;

use rdma_rpc_transport::{connect, Device, Listener, QpOptions, QueuePair};

mod affinity;

use affinity::{mask, set_mask};

const WAIT: Duration = Duration::from_secs(20);

/// A connected pair of queue pairs on `provider`: (client, server).
fn pair(provider: &str) -> (QueuePair, QueuePair) {
    let dev = Device::open(provider).expect("open the device");
    let (pd, cq) = (dev.alloc_pd().expect("a PD"), dev.create_cq(64).expect("a CQ"));
    let listener = Listener::bind(&dev, "127.0.0.1:0".parse().expect("an address")).expect("bind");
    let addr = listener.local_addr().expect("the listener's address");
    let opts = QpOptions::new(&pd, &cq);
    let server = std::thread::spawn({
        let opts = opts.clone();
        move || listener.accept(Some(WAIT))?.accept(&opts, b"")
    });
    let (client, _) = connect(addr, &opts, b"", WAIT).expect("connect");
    let server = server.join().expect("the accepting thread").expect("accept");
    (client, server)
}

/// Runs `f` on a thread pinned to `core`.
fn on_core<T: Send>(core: core_affinity::CoreId, f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        s.spawn(|| {
            assert!(core_affinity::set_for_current(core), "pin a thread to {core:?}");
            f()
        })
        .join()
        .expect("the pinned thread")
    })
}

#[test]
fn shm_ends_learn_whether_they_share_a_core() {
    let (client, server) = pair("shm");
    let cores = core_affinity::get_core_ids().expect("this machine's cores");
    let first = cores[0];
    // The server has not said where it runs: no.
    assert!(!on_core(first, || client.peer_shares_cpu()));
    // Both on one core: yes, from either end, each having told the other.
    on_core(first, || server.peer_shares_cpu());
    assert!(on_core(first, || client.peer_shares_cpu()));
    assert!(on_core(first, || server.peer_shares_cpu()));
    let Some(&second) = cores.get(1) else {
        eprintln!("one core only: the two-core half of this test needs two");
        return;
    };
    // The server moves to another core and says so: no longer.
    on_core(second, || server.peer_shares_cpu());
    assert!(!on_core(first, || client.peer_shares_cpu()));
    // The client follows it there: yes again.
    assert!(on_core(second, || client.peer_shares_cpu()));
}

#[test]
fn tcp_never_claims_a_shared_core() {
    let (client, server) = pair("tcp");
    let core = core_affinity::get_core_ids().expect("this machine's cores")[0];
    on_core(core, || server.peer_shares_cpu());
    assert!(!on_core(core, || client.peer_shares_cpu()));
    assert!(!on_core(core, || server.peer_shares_cpu()));
}

#[test]
fn an_end_on_its_peers_core_moves_to_another_and_keeps_its_mask() {
    let (client, server) = pair("shm");
    let all = mask();
    if all.len() < 2 {
        eprintln!("one CPU only: moving apart needs two");
        return;
    }
    let here = all[0];
    // The client's poller says it runs on `here`.
    std::thread::scope(|s| {
        s.spawn(|| {
            set_mask(&[here]);
            client.peer_shares_cpu();
        });
    });
    std::thread::scope(|s| {
        s.spawn(|| {
            // On `here` with every CPU allowed: it moves, says where to, and has its mask back.
            set_mask(&[here]);
            set_mask(&all);
            assert!(server.leave_peer_cpu(), "moved off the peer's CPU");
            let now = rustix::thread::sched_getcpu();
            assert_ne!(now, here, "on another CPU");
            assert_eq!(mask(), all, "the same mask as before");
            assert!(!server.peer_shares_cpu(), "no longer on the peer's CPU");
            // Elsewhere already: nothing to do.
            assert!(!server.leave_peer_cpu());
            // Pinned to the peer's CPU by its owner: it stays.
            set_mask(&[here]);
            assert!(server.peer_shares_cpu());
            assert!(!server.leave_peer_cpu(), "a pinned thread stays");
            assert_eq!(mask(), vec![here]);
        });
    });
}

#[test]
fn tcp_never_moves_a_thread() {
    let (client, server) = pair("tcp");
    let core = core_affinity::get_core_ids().expect("this machine's cores")[0];
    on_core(core, || client.peer_shares_cpu());
    assert!(!on_core(core, || server.leave_peer_cpu()));
}
