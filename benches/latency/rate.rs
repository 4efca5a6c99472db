//! Message rate and bandwidth of the raw provider, the way perftest's `ib_send_bw` and
//! `ib_write_bw` measure them: one QP, requests kept in flight up to a depth, posted in lists,
//! a completion asked for only as often as the depth needs one.
//!
//! The sender posts a list of `post_list` requests with one call whenever the requests in
//! flight leave room for it, and asks for a completion on the last request of a list when the
//! next list would not fit otherwise (so it never waits for a completion nobody asked for); a
//! signaled completion retires every request before it. For Sends, a thread on the receiving
//! side keeps receives posted (twice the depth, at least 128), reposting each as it completes;
//! the first Send goes once they are all posted.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_rpc::transport::*;
use serde::Serialize;

/// One row: perftest's bandwidth columns, and what it was measured with.
#[derive(Debug, Clone, Serialize)]
pub struct RateRow {
    pub op: String,
    pub bytes: usize,
    pub depth: u32,
    pub post_list: u32,
    pub iterations: u64,
    /// The best of the run's twenty windows, the last (cut short) left out, MB/s (10^6 bytes).
    pub bw_peak: f64,
    pub bw_avg: f64,
    /// Millions of messages per second.
    pub msg_rate: f64,
}

/// Which operation a row moves.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Send,
    Write,
}

impl Op {
    pub fn parse(s: &str) -> Option<Op> {
        match s {
            "send" => Some(Op::Send),
            "write" => Some(Op::Write),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Op::Send => "send",
            Op::Write => "write",
        }
    }
}

/// Receives kept posted for a Send row of `depth`.
fn recv_ring(depth: u32) -> u32 {
    (2 * depth).max(128)
}

/// Two connected QPs with room for `depth` sends and their receives.
fn pair(dev: &Device, ip: IpAddr, depth: u32) -> Result<(crate::raw::Side, crate::raw::Side), String> {
    let e = |what: &'static str| move |err: Error| format!("{what}: {err}");
    let mk = || -> Result<_, String> {
        Ok((
            dev.alloc_pd().map_err(e("PD"))?,
            dev.create_cq(4 * recv_ring(depth)).map_err(e("CQ"))?,
        ))
    };
    let ((spd, scq), (cpd, ccq)) = (mk()?, mk()?);
    let listener = Listener::bind(dev, SocketAddr::new(ip, 0)).map_err(e("listening"))?;
    let addr = listener.local_addr().map_err(e("listening"))?;
    let caps = QpCaps {
        max_send_wr: depth.max(16),
        max_recv_wr: recv_ring(depth),
        max_inline_data: dev.caps().max_inline_data.min(64),
    };
    let sopts = QpOptions::new(&spd, &scq).caps(caps);
    let server = std::thread::spawn(move || listener.accept(None)?.accept(&sopts, b""));
    let (cqp, _) = connect(
        addr,
        &QpOptions::new(&cpd, &ccq).caps(caps),
        b"",
        Duration::from_secs(30),
    )
    .map_err(e("connecting"))?;
    let sqp = server
        .join()
        .map_err(|_| "the accepting thread panicked".to_owned())?
        .map_err(e("accepting"))?;
    Ok((
        crate::raw::Side {
            pd: cpd,
            cq: ccq,
            qp: cqp,
        },
        crate::raw::Side {
            pd: spd,
            cq: scq,
            qp: sqp,
        },
    ))
}

/// Keeps receives posted on `s` until `stop`, reposting each one that completes; the count of
/// receives that completed, or the first failed completion.
fn receiver(
    s: &crate::raw::Side,
    size: usize,
    ring: u32,
    stop: &AtomicBool,
    sent: &std::sync::atomic::AtomicU64,
    posted: std::sync::mpsc::Sender<()>,
) -> Result<u64, String> {
    let access = AccessFlags::LOCAL_WRITE;
    let recvs: Vec<RecvWr> = (0..ring)
        .map(|i| Ok(RecvWr::new(u64::from(i), s.pd.register(size.max(1), access)?)))
        .collect::<Result<_, Error>>()
        .map_err(|e| format!("receive buffers: {e}"))?;
    s.qp.post_recv_batch(recvs)
        .map_err(|e| format!("posting receives: {}", e.error))?;
    // The sender may start: a receive is there for each Send it can have in flight.
    let _ = posted.send(());
    let (mut out, mut again, mut got) = (Vec::new(), Vec::new(), 0u64);
    let mut idle = 0u32;
    // After `stop`, until the receives match the Sends the sender saw complete (`sent`): on
    // `shm` a Send completes once it is staged, before the receiver has taken it.
    let mut drain_until = None;
    loop {
        if stop.load(Ordering::Acquire) {
            let want = sent.load(Ordering::Acquire);
            let deadline = *drain_until.get_or_insert_with(|| std::time::Instant::now() + Duration::from_secs(10));
            if got >= want || std::time::Instant::now() > deadline {
                break;
            }
        }
        out.clear();
        if s.cq.poll(&mut out, 64).map_err(|e| format!("polling: {e}"))? == 0 {
            idle += 1;
            if idle % 1024 == 0 {
                std::thread::yield_now();
            }
            continue;
        }
        idle = 0;
        for c in out.drain(..) {
            if !c.status.is_success() {
                return Err(format!("a receive completed with {:?}", c.status));
            }
            got += 1;
            let id = c.wr_id;
            if let Some(buf) = c.buf {
                again.push(RecvWr::new(id, buf));
            }
        }
        s.qp.post_recv_batch(again.drain(..))
            .map_err(|e| format!("reposting receives: {}", e.error))?;
    }
    Ok(got)
}

/// One row: `op` of `size` bytes with `depth` in flight, posted `post_list` at a time, for
/// about `time`.
pub fn measure(
    dev: &Device,
    ip: IpAddr,
    op: Op,
    size: usize,
    depth: u32,
    post_list: u32,
    time: Duration,
) -> Result<RateRow, String> {
    let post_list = post_list.min(depth).max(1);
    let (c, s) = pair(dev, ip, depth)?;
    let target =
        s.pd.register(size.max(1), AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
            .map_err(|e| format!("target: {e}"))?;
    let remote = target.remote().at(0);
    let stop = Arc::new(AtomicBool::new(false));
    let count = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let s = Arc::new(s);
    let (posted, ready) = std::sync::mpsc::channel();
    let echo = (op == Op::Send).then(|| {
        let (s, stop, count) = (s.clone(), stop.clone(), count.clone());
        std::thread::spawn(move || receiver(&s, size, recv_ring(depth), &stop, &count, posted))
    });
    // The first Send waits for the receives: registering the ring touches hundreds of MiB at
    // 1 MiB, and a Send posted before the receives are would wait past its RNR budget.
    if echo.is_some() && ready.recv().is_err() {
        // The receiver ended before posting: its error says why.
        if let Some(t) = echo {
            t.join().map_err(|_| "the receiving thread panicked".to_owned())??;
        }
        return Err("the receiver ended before posting its receives".to_owned());
    }
    let sent = sender(&c, op, remote, size, depth, post_list, time);
    if let Ok((n, _)) = &sent {
        count.store(*n, Ordering::Release);
    }
    stop.store(true, Ordering::Release);
    if let Some(t) = echo {
        let got = t.join().map_err(|_| "the receiving thread panicked".to_owned())??;
        if let Ok((n, _)) = &sent {
            if got != *n {
                return Err(format!("{n} Sends completed but {got} receives"));
            }
        }
    }
    let (n, windows) = sent?;
    let secs = windows.iter().map(|w| w.1).sum::<f64>().max(1e-9);
    let mb = |msgs: f64, secs: f64| msgs * size as f64 / secs / 1e6;
    // The best full window (a twentieth of the row). The last one is cut short where the
    // time ran out, and a signaled completion can retire a whole depth of requests at once:
    // over a few microseconds that reads as hundreds of times the real rate.
    let full = (time / 20).as_secs_f64() * 0.9;
    let peak = windows
        .iter()
        .filter(|w| w.1 >= full)
        .map(|w| mb(w.0 as f64, w.1))
        .fold(mb(n as f64, secs), f64::max);
    Ok(RateRow {
        op: op.name().to_owned(),
        bytes: size,
        depth,
        post_list,
        iterations: n,
        bw_peak: peak,
        bw_avg: mb(n as f64, secs),
        msg_rate: n as f64 / secs / 1e6,
    })
}

/// The sending loop; the requests that completed, and per window (twenty of `time`) how many
/// completed in how many seconds.
fn sender(
    c: &crate::raw::Side,
    op: Op,
    remote: RemoteAddr,
    size: usize,
    depth: u32,
    post_list: u32,
    time: Duration,
) -> Result<(u64, Vec<(u64, f64)>), String> {
    let (depth, list) = (u64::from(depth), u64::from(post_list));
    let pool = BufferPool::new(&c.pd, size.max(1), depth as usize, AccessFlags::NONE)
        .map_err(|e| format!("send buffers: {e}"))?;
    let inline = size <= c.qp.caps().max_inline_data as usize;
    let (mut posted, mut done, mut unsignaled) = (0u64, 0u64, 0u64);
    let mut out = Vec::new();
    let window = time / 20;
    let start = Instant::now();
    let (mut w_start, mut w_done) = (start, 0u64);
    let mut windows = Vec::new();
    // The time is up: the next list is the last, and asks for its completion.
    let (mut time_up, mut stopping) = (false, false);
    while !(stopping && done == posted) {
        if !stopping && posted - done + list <= depth {
            // Ask for a completion on this list's last request when the next list would not
            // fit beside the requests not asked about, and on the last list.
            let signal = time_up || unsignaled + 2 * list > depth;
            stopping = time_up;
            let wrs: Vec<SendWr> = (0..list)
                .map(|i| {
                    let buf = pool.take().ok_or("a free send buffer")?;
                    let mut wr = match op {
                        Op::Send => SendWr::send(posted + i, buf),
                        Op::Write => SendWr::new(posted + i, SendOp::Write { remote, imm: None }).buf(buf),
                    };
                    if inline {
                        wr = wr.inline();
                    }
                    if !(signal && i == list - 1) {
                        wr = wr.unsignaled();
                    }
                    Ok(wr)
                })
                .collect::<Result<_, &str>>()?;
            c.qp.post_send_batch(wrs).map_err(|e| format!("posting: {}", e.error))?;
            posted += list;
            unsignaled = if signal { 0 } else { unsignaled + list };
            continue;
        }
        out.clear();
        if c.cq.poll(&mut out, 16).map_err(|e| format!("polling: {e}"))? == 0 {
            std::hint::spin_loop();
        }
        for wc in out.drain(..) {
            if !wc.status.is_success() {
                return Err(format!("{} failed: {:?}", op.name(), wc.status));
            }
            done = wc.wr_id + 1;
        }
        let now = Instant::now();
        if now - w_start >= window {
            windows.push((done - w_done, (now - w_start).as_secs_f64()));
            (w_start, w_done) = (now, done);
            time_up = now - start >= time;
            stopping |= time_up && unsignaled == 0;
        }
    }
    let now = Instant::now();
    windows.push((done - w_done, (now - w_start).as_secs_f64()));
    Ok((done, windows))
}

/// One table per operation, in perftest's columns.
pub fn table(rows: &[RateRow]) {
    let mut ops: Vec<&str> = rows.iter().map(|r| r.op.as_str()).collect();
    ops.dedup();
    for op in ops {
        println!();
        println!("---------------------------------------------------------------------------------------");
        println!(" {op} bandwidth (ib_{op}_bw's columns)");
        println!("---------------------------------------------------------------------------------------");
        println!(
            " {:>9} {:>6} {:>10} {:>11} {:>17} {:>20} {:>14}",
            "#bytes", "depth", "post_list", "#iterations", "BW peak[MB/sec]", "BW average[MB/sec]", "MsgRate[Mpps]"
        );
        for r in rows.iter().filter(|r| r.op == op) {
            println!(
                " {:>9} {:>6} {:>10} {:>11} {:>17.2} {:>20.2} {:>14.6}",
                r.bytes, r.depth, r.post_list, r.iterations, r.bw_peak, r.bw_avg, r.msg_rate
            );
        }
    }
}
