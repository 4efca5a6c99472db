//! What idle connections cost a process, by how many there are: a server here accepts QPs on
//! one device (one PD, one CQ, one shared receive queue) that a child process connects one
//! after another, as clients would.
//!
//! For each count the row gives the set-up rate, then the threads, file descriptors,
//! registered bytes and resident memory that the connections added to the server, per
//! connection, and whether every QP then carried a message. Both processes raise their
//! descriptor limit first (only for themselves).

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

/// The environment variable that makes this binary the connecting end of a scale row: the
/// listener's address; with [`COUNT_ENV`], how many QPs to connect.
pub const CONNECT_ENV: &str = "RDMA_RPC_SCALE_CONNECT";
pub const COUNT_ENV: &str = "RDMA_RPC_SCALE_COUNT";

fn caps() -> QpCaps {
    QpCaps {
        max_send_wr: 4,
        max_recv_wr: 4,
        max_inline_data: 0,
    }
}

/// The connecting end (a child process): connects the QPs one after another, says
/// `CONNECTED`, waits for a line on stdin, sends one message on each, says `SENT`, and holds
/// them until its stdin ends.
pub fn connecting_end(dev: &Device, addr: &str, n: usize) -> Result<(), String> {
    raise_fd_limit();
    let e = |what: &'static str| move |err: Error| format!("{what}: {err}");
    let addr: SocketAddr = addr.parse().map_err(|err| format!("{addr}: {err}"))?;
    let (pd, cq) = (
        dev.alloc_pd().map_err(e("PD"))?,
        dev.create_cq(1 << 16).map_err(e("CQ"))?,
    );
    let opts = QpOptions::new(&pd, &cq).caps(caps());
    let mut qps = Vec::with_capacity(n);
    for i in 0..n {
        let (qp, _) = connect(addr, &opts, &(i as u32).to_le_bytes(), Duration::from_secs(30))
            .map_err(|err| format!("connection {}: {err}", i + 1))?;
        qps.push(qp);
    }
    println!("CONNECTED");
    // The server posts its receives first, then says go.
    let mut go = String::new();
    std::io::stdin().read_line(&mut go).map_err(|err| err.to_string())?;
    let pool = BufferPool::new(&pd, 4, n.max(1), AccessFlags::NONE).map_err(e("buffers"))?;
    for (i, qp) in qps.iter().enumerate() {
        let b = pool.take().ok_or("a buffer")?;
        qp.post_send(SendWr::send(i as u64, b))
            .map_err(|err| format!("post: {}", err.error))?;
    }
    let mut out = Vec::new();
    let (mut done, deadline) = (0, Instant::now() + Duration::from_secs(60));
    while done < n && Instant::now() < deadline {
        out.clear();
        done += cq.poll(&mut out, 256).map_err(e("poll"))?;
        if out.iter().any(|c| !c.status.is_success()) {
            return Err("a Send failed".into());
        }
        std::thread::yield_now();
    }
    println!("SENT {done}");
    let _ = std::io::stdin().lines().count();
    Ok(())
}

/// One row: `n` connections on `dev`, made by a child process (the connecting end) to a
/// listener here; the figures are this side's, as a server sees its clients.
pub fn measure(dev: &Device, ip: IpAddr, n: usize) -> Result<ScaleRow, String> {
    use std::io::BufRead;
    let e = |what: &'static str| move |err: Error| format!("{what}: {err}");
    let (pd, cq) = (
        dev.alloc_pd().map_err(e("PD"))?,
        dev.create_cq(1 << 16).map_err(e("CQ"))?,
    );
    let srq = pd.create_srq(n.max(1) as u32).map_err(e("SRQ"))?;
    let listener = Listener::bind(dev, SocketAddr::new(ip, 0)).map_err(e("listening"))?;
    let addr = listener.local_addr().map_err(e("listening"))?;
    let opts = QpOptions::new(&pd, &cq).caps(caps()).srq(&srq);
    let before = snapshot(dev);
    let mut child = std::process::Command::new(std::env::current_exe().map_err(|err| err.to_string())?)
        .env(CONNECT_ENV, addr.to_string())
        .env(COUNT_ENV, n.to_string())
        .env(rdma_rpc::transport::PROVIDER_ENV, dev.spec().to_string())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .map_err(|err| format!("starting the connecting end: {err}"))?;
    let mut lines = std::io::BufReader::new(child.stdout.take().ok_or("the child's output")?).lines();
    let started = Instant::now();
    let mut qps = Vec::with_capacity(n);
    let mut error = None;
    while qps.len() < n {
        match listener
            .accept(Some(Duration::from_secs(30)))
            .and_then(|r| r.accept(&opts, b""))
        {
            Ok(qp) => qps.push(qp),
            Err(err) => {
                error = Some(format!("connection {}: {err}", qps.len() + 1));
                break;
            }
        }
    }
    let setup = started.elapsed();
    std::thread::sleep(Duration::from_millis(200));
    let after = snapshot(dev);
    let made = qps.len();
    let per = |a: f64, b: f64| (a - b).max(0.0) / made.max(1) as f64;
    let mut carried = false;
    if error.is_none() {
        let pool = BufferPool::new(&pd, 4, n.max(1), AccessFlags::LOCAL_WRITE).map_err(e("buffers"))?;
        let recvs: Vec<RecvWr> = (0..n)
            .map(|k| pool.take().map(|b| RecvWr::new(k as u64, b)))
            .collect::<Option<_>>()
            .ok_or("receive buffers")?;
        srq.post_recv_batch(recvs)
            .map_err(|err| format!("posting receives: {}", err.error))?;
        if let Some(stdin) = child.stdin.as_mut() {
            use std::io::Write;
            let _ = writeln!(stdin, "go");
        }
        if lines.by_ref().map_while(Result::ok).any(|l| l.starts_with("SENT")) {
            let mut out = Vec::new();
            let (mut got, deadline) = (0, Instant::now() + Duration::from_secs(60));
            let mut seen = vec![false; n];
            while got < n && Instant::now() < deadline {
                out.clear();
                cq.poll(&mut out, 256).map_err(e("poll"))?;
                for c in out.drain(..) {
                    let i = c.qp_num;
                    let from = qps.iter().position(|q| q.qp_num() == i);
                    if let (true, Some(k)) = (c.status.is_success(), from) {
                        if !std::mem::replace(&mut seen[k], true) {
                            got += 1;
                        }
                    }
                }
                std::thread::yield_now();
            }
            carried = got == n;
        }
    }
    drop(child.stdin.take());
    let _ = child.wait();
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
        error,
    })
}

/// The connection-scale table.
pub fn table(rows: &[ScaleRow]) {
    println!();
    println!("---------------------------------------------------------------------------------------");
    println!(" connection scale: idle connected QPs on one device, the server's side, per connection");
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
