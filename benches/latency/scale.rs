//! What idle connections cost a process, by how many there are: connected QPs on one device,
//! both ends in this process (one PD and one CQ for each end), made one after another.
//!
//! For each count the row gives the set-up rate, then the threads, file descriptors,
//! registered bytes and resident memory that the connections added, per connection and per
//! side (both ends run here, and hold alike), and whether every QP then carried a message.
//! The process's descriptor limit is raised to its hard limit first (only for this process).

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use rdma_rpc::transport::*;
use serde::Serialize;

/// One row of the connection-scale table.
#[derive(Debug, Clone, Serialize)]
pub struct ScaleRow {
    /// Connections asked for.
    pub conns: usize,
    /// Connections made (fewer when set-up failed; `error` says why).
    pub made: usize,
    /// Connections set up per second, one after another.
    pub setup_per_s: f64,
    /// Per connection, per side.
    pub threads: f64,
    pub fds: f64,
    pub registered_bytes: f64,
    pub rss_kib: f64,
    /// The process's threads with the connections open.
    pub threads_total: usize,
    /// Every QP carried one Send after they were all made.
    pub carried: bool,
    pub error: Option<String>,
}

/// Threads, descriptors and resident KiB of this process, and what `dev` has registered.
fn snapshot(dev: &Device) -> (usize, usize, u64, u64) {
    let count = |dir: &str| std::fs::read_dir(dir).map(Iterator::count).unwrap_or(0);
    let rss_pages = std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1).and_then(|p| p.parse::<u64>().ok()))
        .unwrap_or(0);
    (
        count("/proc/self/task"),
        count("/proc/self/fd"),
        dev.registered_bytes(),
        rss_pages * 4,
    )
}

/// Raises this process's descriptor limit: to the kernel's ceiling (`fs.nr_open`) where it may
/// (as root), else to its hard limit.
pub fn raise_fd_limit() {
    let ceiling = std::fs::read_to_string("/proc/sys/fs/nr_open")
        .ok()
        .and_then(|s| s.trim().parse::<libc::rlim_t>().ok());
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid out-parameter.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return;
    }
    let hard = lim.rlim_max;
    if let Some(c) = ceiling.filter(|&c| c > hard) {
        let up = libc::rlimit {
            rlim_cur: c,
            rlim_max: c,
        };
        // SAFETY: setrlimit reads a valid rlimit; refused without the privilege, changing nothing.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &up) } == 0 {
            return;
        }
    }
    lim.rlim_cur = hard;
    // SAFETY: as above.
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) };
}

/// One row: `n` connections on `dev`.
pub fn measure(dev: &Device, ip: IpAddr, n: usize) -> Result<ScaleRow, String> {
    let e = |what: &'static str| move |err: Error| format!("{what}: {err}");
    let (spd, scq) = (dev.alloc_pd().map_err(e("PD"))?, dev.create_cq(4096).map_err(e("CQ"))?);
    let (cpd, ccq) = (dev.alloc_pd().map_err(e("PD"))?, dev.create_cq(4096).map_err(e("CQ"))?);
    let listener = Listener::bind(dev, SocketAddr::new(ip, 0)).map_err(e("listening"))?;
    let addr = listener.local_addr().map_err(e("listening"))?;
    let caps = QpCaps {
        max_send_wr: 4,
        max_recv_wr: 4,
        max_inline_data: 0,
    };
    let sopts = QpOptions::new(&spd, &scq).caps(caps);
    let copts = QpOptions::new(&cpd, &ccq).caps(caps);
    let before = snapshot(dev);
    let started = Instant::now();
    let server = std::thread::spawn(move || {
        let mut qps = Vec::with_capacity(n);
        while qps.len() < n {
            match listener
                .accept(Some(Duration::from_secs(30)))
                .and_then(|r| r.accept(&sopts, b""))
            {
                Ok(qp) => qps.push(qp),
                Err(err) => return (qps, Some(err.to_string())),
            }
        }
        (qps, None)
    });
    let mut clients = Vec::with_capacity(n);
    let mut error = None;
    while clients.len() < n {
        match connect(addr, &copts, b"", Duration::from_secs(30)) {
            Ok((qp, _)) => clients.push(qp),
            Err(err) => {
                error = Some(format!("connection {}: {err}", clients.len() + 1));
                break;
            }
        }
    }
    let setup = started.elapsed();
    let (servers, refused) = if error.is_some() {
        // The server waits for connections that will not come: it gives up after its timeout.
        let made = clients.len();
        drop(clients);
        return Ok(ScaleRow {
            conns: n,
            made,
            setup_per_s: 0.0,
            threads: 0.0,
            fds: 0.0,
            registered_bytes: 0.0,
            rss_kib: 0.0,
            threads_total: snapshot(dev).0,
            carried: false,
            error,
        });
    } else {
        server.join().map_err(|_| "the accepting thread panicked".to_owned())?
    };
    std::thread::sleep(Duration::from_millis(200));
    let after = snapshot(dev);
    let made = clients.len().min(servers.len());
    let per = |a: f64, b: f64| (a - b).max(0.0) / (2 * made.max(1)) as f64;
    let carried = refused.is_none() && carry(&spd, &scq, &servers, &ccq, &clients)?;
    Ok(ScaleRow {
        conns: n,
        made,
        setup_per_s: made as f64 / setup.as_secs_f64().max(1e-9),
        threads: per(after.0 as f64, before.0 as f64),
        fds: per(after.1 as f64, before.1 as f64),
        registered_bytes: per(after.2 as f64, before.2 as f64),
        rss_kib: per(after.3 as f64, before.3 as f64),
        threads_total: after.0,
        carried,
        error: refused,
    })
}

/// Has every client QP send one message to its server QP, at most 256 at a time; whether all
/// arrived.
fn carry(
    spd: &ProtectionDomain,
    scq: &CompletionQueue,
    servers: &[QueuePair],
    ccq: &CompletionQueue,
    clients: &[QueuePair],
) -> Result<bool, String> {
    let cpd = clients.first().map(|q| q.pd().clone());
    let Some(cpd) = cpd else { return Ok(true) };
    let rpool = BufferPool::new(spd, 8, 256, AccessFlags::LOCAL_WRITE).map_err(|e| format!("buffers: {e}"))?;
    let spool = BufferPool::new(&cpd, 8, 256, AccessFlags::NONE).map_err(|e| format!("buffers: {e}"))?;
    let mut out = Vec::new();
    for (chunk_s, chunk_c) in servers.chunks(256).zip(clients.chunks(256)) {
        for (i, (s, c)) in chunk_s.iter().zip(chunk_c).enumerate() {
            let r = rpool.take().ok_or("a receive buffer")?;
            s.post_recv(RecvWr::new(i as u64, r))
                .map_err(|e| format!("post_recv: {}", e.error))?;
            let b = spool.take().ok_or("a send buffer")?;
            c.post_send(SendWr::send(i as u64, b))
                .map_err(|e| format!("post_send: {}", e.error))?;
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        let (mut recvd, mut sent) = (0, 0);
        while recvd < chunk_s.len() || sent < chunk_c.len() {
            if Instant::now() > deadline {
                return Ok(false);
            }
            for (cq, count) in [(scq, &mut recvd), (ccq, &mut sent)] {
                out.clear();
                cq.poll(&mut out, 64).map_err(|e| format!("poll: {e}"))?;
                for c in out.drain(..) {
                    if !c.status.is_success() {
                        return Ok(false);
                    }
                    *count += 1;
                }
            }
            std::thread::yield_now();
        }
    }
    Ok(true)
}

/// The connection-scale table.
pub fn table(rows: &[ScaleRow]) {
    println!();
    println!("---------------------------------------------------------------------------------------");
    println!(" connection scale: idle connected QPs on one device, per connection and side");
    println!("---------------------------------------------------------------------------------------");
    println!(
        " {:>7} {:>6} {:>11} {:>8} {:>6} {:>11} {:>9} {:>13} {:>8}",
        "#conns", "made", "set-up[/s]", "threads", "fds", "registered", "RSS[KiB]", "threads total", "carried"
    );
    for r in rows {
        println!(
            " {:>7} {:>6} {:>11.0} {:>8.2} {:>6.2} {:>11.0} {:>9.1} {:>13} {:>8}",
            r.conns,
            r.made,
            r.setup_per_s,
            r.threads,
            r.fds,
            r.registered_bytes,
            r.rss_kib,
            r.threads_total,
            if r.carried { "yes" } else { "NO" }
        );
        if let Some(e) = &r.error {
            println!("         failed: {e}");
        }
    }
}
