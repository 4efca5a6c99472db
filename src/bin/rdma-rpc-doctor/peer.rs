//! The measurements with a peer (`--listen` on one host, `--peer` on the other): a Send
//! ping-pong, RDMA Write bandwidth, and CPU per byte on both sides beside a TCP transfer of the
//! same bytes: the test of whether offload works. Synchronous, on the transport's queue pairs.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use rdma_rpc::transport::{
    self, AccessFlags, Completion, CompletionQueue, Device, Listener, MemoryRegion, QpOptions, QueuePair, RecvWr,
    RemoteRegion, SendOp, SendWr, WcOpcode,
};

use crate::Finding;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// The region a peer writes into, and the size of a message.
const TARGET: usize = 8 << 20;
const MSG: usize = 4096;
const PINGS: usize = 1000;
const WRITE: usize = 1 << 20;
const TOTAL: usize = 128 << 20;
const WAIT: Duration = Duration::from_secs(30);

/// This process's CPU time so far, in microseconds: the sum of its threads' time on a CPU
/// (`/proc/self/task/*/schedstat`, nanoseconds; `/proc/self/stat` counts in 10 ms ticks).
fn cpu_us() -> u64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    let ns: u64 = tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum();
    ns / 1000
}

/// The next completion, polling (bounded).
fn next(cq: &CompletionQueue) -> Result<Completion> {
    let deadline = Instant::now() + WAIT;
    let mut out = Vec::new();
    loop {
        cq.poll(&mut out, 1)?;
        if let Some(c) = out.pop() {
            return Ok(c
                .ok()
                .map_err(|e| format!("work request failed: {:?}", e.completion.status))?);
        }
        if Instant::now() > deadline {
            return Err("no completion within 30 s: is the peer alive?".into());
        }
        std::hint::spin_loop();
    }
}

/// A queue pair's Sends from buffers registered once (a registration per message would be
/// timed with the ping-pong), and the completions that came while one was awaited.
struct Sends {
    free: Vec<MemoryRegion>,
    held: std::collections::VecDeque<Completion>,
}

impl Sends {
    fn new(pd: &transport::ProtectionDomain) -> Result<Self> {
        let free = (0..8)
            .map(|_| pd.register(MSG, AccessFlags::LOCAL_WRITE))
            .collect::<std::result::Result<_, _>>()?;
        Ok(Self {
            free,
            held: Default::default(),
        })
    }

    /// The next completion that is not a Send's (those give their buffers back).
    fn next(&mut self, cq: &CompletionQueue) -> Result<Completion> {
        if let Some(c) = self.held.pop_front() {
            return Ok(c);
        }
        loop {
            let c = next(cq)?;
            if c.opcode != WcOpcode::Send {
                return Ok(c);
            }
            self.free.extend(c.buf);
        }
    }

    fn send(&mut self, qp: &QueuePair, cq: &CompletionQueue, bytes: &[u8]) -> Result<()> {
        let mut b = loop {
            if let Some(b) = self.free.pop() {
                break b;
            }
            let c = next(cq)?;
            if c.opcode == WcOpcode::Send {
                self.free.extend(c.buf);
            } else {
                self.held.push_back(c);
            }
        };
        b.write_at(0, bytes)?;
        qp.post_send(SendWr::send(1, b).len(bytes.len())).map_err(|e| e.error)?;
        Ok(())
    }
}

/// Serves `--peer` runs on `addr` (RDMA; port 0 picks one) and on a TCP port of the same IP,
/// one at a time, for ever. Prints `listening on ADDR` first.
pub(crate) fn serve(provider: &str, addr: SocketAddr) -> Result<()> {
    let dev = Device::open(provider)?;
    let listener = Listener::bind(&dev, addr)?;
    let tcp = TcpListener::bind(SocketAddr::new(addr.ip(), 0))?;
    let tcp_port = tcp.local_addr()?.port();
    println!(
        "listening on {} ({provider}; TCP on port {tcp_port})",
        listener.local_addr()?
    );
    std::thread::spawn(move || {
        for s in tcp.incoming().flatten() {
            let _ = sink(s);
        }
    });
    loop {
        let req = listener.accept(None)?;
        let pd = dev.alloc_pd()?;
        let cq = dev.create_cq(256)?;
        let target = pd.register(TARGET, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
        let recvs = (0..64u64)
            .map(|i| Ok(RecvWr::new(i, pd.register(MSG, AccessFlags::LOCAL_WRITE)?)))
            .collect::<Result<Vec<_>>>()?;
        let private = postcard::to_allocvec(&(target.remote(), tcp_port))?;
        let qp = req.accept_with_recvs(&QpOptions::new(&pd, &cq), &private, recvs)?;
        if let Err(e) = answer(&qp, &mut Sends::new(&pd)?, &cq) {
            eprintln!("a peer run ended: {e}");
        }
    }
}

/// Answers one peer: `P` pings back, `C` with this process's CPU time, `Q` ends.
fn answer(qp: &QueuePair, sends: &mut Sends, cq: &CompletionQueue) -> Result<()> {
    loop {
        let c = sends.next(cq)?;
        if c.opcode != WcOpcode::Recv {
            continue;
        }
        let buf = c.buf.ok_or("a receive without its buffer")?;
        let msg = buf.bytes()[..c.byte_len as usize].to_vec();
        qp.post_recv(RecvWr::new(c.wr_id, buf)).map_err(|e| e.error)?;
        match msg.first() {
            Some(b'P') => sends.send(qp, cq, &msg)?,
            Some(b'C') => sends.send(qp, cq, &cpu_us().to_le_bytes())?,
            _ => return Ok(()),
        }
    }
}

/// Reads a TCP transfer to its end, then says so with one byte.
fn sink(mut s: TcpStream) -> std::io::Result<()> {
    let mut buf = vec![0u8; 1 << 20];
    while s.read(&mut buf)? > 0 {}
    s.write_all(b"k")
}

/// A connection to a `--listen` peer.
struct Link {
    qp: QueuePair,
    pd: transport::ProtectionDomain,
    cq: CompletionQueue,
    target: RemoteRegion,
    tcp_port: u16,
    sends: Sends,
}

impl Link {
    fn connect(provider: &str, addr: SocketAddr) -> Result<Self> {
        let dev = Device::open(provider)?;
        let pd = dev.alloc_pd()?;
        let cq = dev.create_cq(256)?;
        let recvs = (0..64u64)
            .map(|i| Ok(RecvWr::new(i, pd.register(MSG, AccessFlags::LOCAL_WRITE)?)))
            .collect::<Result<Vec<_>>>()?;
        let (qp, private) = transport::connect_with_recvs(addr, &QpOptions::new(&pd, &cq), b"", WAIT, recvs)?;
        let (target, tcp_port) =
            postcard::from_bytes(&private).map_err(|_| "the peer is not an rdma-rpc-doctor --listen")?;
        Ok(Self {
            sends: Sends::new(&pd)?,
            qp,
            pd,
            cq,
            target,
            tcp_port,
        })
    }

    /// Sends `msg` and waits for the answer's bytes.
    fn ask(&mut self, msg: &[u8]) -> Result<Vec<u8>> {
        self.sends.send(&self.qp, &self.cq, msg)?;
        loop {
            let c = self.sends.next(&self.cq)?;
            if c.opcode == WcOpcode::Recv {
                let buf = c.buf.ok_or("a receive without its buffer")?;
                let out = buf.bytes()[..c.byte_len as usize].to_vec();
                self.qp.post_recv(RecvWr::new(c.wr_id, buf)).map_err(|e| e.error)?;
                return Ok(out);
            }
        }
    }

    fn peer_cpu(&mut self) -> Result<u64> {
        let b = self.ask(b"C")?;
        Ok(u64::from_le_bytes(b.get(..8).ok_or("a short CPU answer")?.try_into()?))
    }
}

/// Runs the measurements against a `--listen` peer at `addr`.
pub(crate) fn measure(provider: &str, addr: SocketAddr) -> Vec<Finding> {
    match run(provider, addr) {
        Ok(f) => f,
        Err(e) => vec![Finding::fail(
            format!("peer {addr} on {provider}: {e}"),
            format!(
                "start `rdma-rpc-doctor --provider {provider} --listen <ip:port>` on the peer, and give its address"
            ),
        )],
    }
}

fn run(provider: &str, addr: SocketAddr) -> Result<Vec<Finding>> {
    let mut link = Link::connect(provider, addr)?;
    let mut out = Vec::new();
    // Ping-pong.
    let mut rtts = Vec::with_capacity(PINGS);
    let mut ping = vec![b'P'; 64];
    for i in 0..PINGS {
        ping[1] = i as u8;
        let t = Instant::now();
        let back = link.ask(&ping)?;
        rtts.push(t.elapsed());
        if back != ping {
            return Err("a ping came back changed".into());
        }
    }
    rtts.sort();
    out.push(Finding::ok(format!(
        "Send ping-pong 64 B on {provider}: p50 {:.1} us, p99 {:.1} us over {PINGS}",
        rtts[PINGS / 2].as_secs_f64() * 1e6,
        rtts[PINGS * 99 / 100].as_secs_f64() * 1e6
    )));
    // RDMA Write, 16 in flight.
    let bufs: Vec<MemoryRegion> = (0..16)
        .map(|_| link.pd.register(WRITE, AccessFlags::LOCAL_WRITE))
        .collect::<std::result::Result<_, _>>()?;
    let (s0, c0, t0) = (link.peer_cpu()?, cpu_us(), Instant::now());
    let mut free = bufs;
    let (mut posted, mut done) = (0usize, 0usize);
    let writes = TOTAL / WRITE;
    while done < writes {
        while posted < writes {
            let Some(b) = free.pop() else { break };
            let at = (posted * WRITE % TARGET) as u64;
            link.qp
                .post_send(
                    SendWr::new(
                        2,
                        SendOp::Write {
                            remote: link.target.at(at),
                            imm: None,
                        },
                    )
                    .buf(b),
                )
                .map_err(|e| e.error)?;
            posted += 1;
        }
        let c = link.sends.next(&link.cq)?;
        if c.opcode == WcOpcode::RdmaWrite {
            free.push(c.buf.ok_or("a write without its buffer")?);
            done += 1;
        }
    }
    let rdma_time = t0.elapsed();
    let (c1, s1) = (cpu_us(), link.peer_cpu()?);
    // TCP, the same bytes.
    let mut tcp = TcpStream::connect(SocketAddr::new(addr.ip(), link.tcp_port))?;
    let chunk = vec![7u8; WRITE];
    let (c2, t2) = (cpu_us(), Instant::now());
    for _ in 0..writes {
        tcp.write_all(&chunk)?;
    }
    tcp.shutdown(std::net::Shutdown::Write)?;
    let mut k = [0u8; 1];
    tcp.read_exact(&mut k)?;
    let tcp_time = t2.elapsed();
    let (c3, s3) = (cpu_us(), link.peer_cpu()?);
    let _ = link.sends.send(&link.qp, &link.cq, b"Q");
    let mib = (TOTAL >> 20) as f64;
    let gbs = |t: Duration| TOTAL as f64 / t.as_secs_f64() / 1e9;
    let per = |us: u64| us as f64 / mib;
    out.push(Finding::ok(format!(
        "RDMA Write {} MiB in 1 MiB writes: {:.2} GB/s; CPU per MiB: this side {:.0} us, the peer {:.0} us",
        TOTAL >> 20,
        gbs(rdma_time),
        per(c1 - c0),
        per(s1 - s0)
    )));
    // The peer's CPU over the TCP run, measured between the two queries around it.
    let tcp_peer = s3.saturating_sub(s1);
    out.push(Finding::ok(format!(
        "TCP {} MiB: {:.2} GB/s; CPU per MiB: this side {:.0} us, the peer {:.0} us",
        TOTAL >> 20,
        gbs(tcp_time),
        per(c3 - c2),
        per(tcp_peer)
    )));
    let (rdma_peer, tcp_peer) = (per(s1 - s0), per(tcp_peer).max(1.0));
    let ratio = rdma_peer / tcp_peer;
    out.push(if provider.starts_with("verbs") && ratio < 0.25 {
        Finding::ok(format!(
            "offload works: the peer spent {:.0}% of TCP's CPU per byte on RDMA Writes",
            ratio * 100.0
        ))
    } else if provider.starts_with("verbs") {
        Finding::warn(
            format!("the peer spent {:.0}% of TCP's CPU per byte on RDMA Writes", ratio * 100.0),
            "on soft-RoCE the kernel does the NIC's work, so this is expected; on a hardware NIC, check that the device is the one in use (`--ip`) and that nothing else loads the peer",
        )
    } else {
        Finding::ok(format!(
            "on {provider} the peer spent {:.0}% of TCP's CPU per byte: a software provider's NIC is the peer's CPU, so no offload is expected",
            ratio * 100.0
        ))
    });
    Ok(out)
}
