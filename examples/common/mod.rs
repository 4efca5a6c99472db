//! What the examples share: opening a provider, one connection with its PD and CQ, waiting for
//! completions, passing a `RemoteRegion` in the connection's private data, and latency summaries.
//! Included by each example with `#[path = "../common/mod.rs"] mod common;`.

#![allow(dead_code)] // each example uses a different part

use std::collections::VecDeque;
use std::error::Error;
use std::net::SocketAddr;
use std::time::Duration;

use rdma_rpc::transport::{
    self, Completion, CompletionQueue, Device, Listener, ProtectionDomain, QpCaps, QpOptions, QueuePair, RecvWr,
    RemoteRegion, WcStatus,
};

/// Errors of the examples: any error, with its message.
pub type Result<T> = std::result::Result<T, Box<dyn Error + Send + Sync>>;

/// How an example ends: on an error, its message on stderr and exit status 1.
///
/// `main` returning the `Result` itself would print the error's `Debug` form
/// (`Error: Transport(TransportError { what: ... })`), which hides the message the library
/// wrote for people: what was being done, naming the address, and what to do about it.
pub fn exit_code(r: Result<()>) -> std::process::ExitCode {
    match r {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // The error and its causes, each once (`a: b: c`).
            eprintln!("error: {}", rdma_rpc::transport::Report(&*e));
            std::process::ExitCode::FAILURE
        }
    }
}

/// How long connection setup may take.
pub const SETUP: Duration = Duration::from_secs(10);

/// The provider named on the command line, else `RDMA_RPC_PROVIDER`, else `tcp`.
pub fn device(provider: Option<&str>) -> Result<Device> {
    Ok(match provider {
        Some(p) => Device::open(p)?,
        None => Device::open_default()?,
    })
}

/// One connected queue pair with its protection domain and completion queue, and completions
/// already reaped but not yet handed out.
pub struct Peer {
    pub pd: ProtectionDomain,
    pub cq: CompletionQueue,
    pub qp: QueuePair,
    ready: VecDeque<Completion>,
}

fn caps(device: &Device, depth: usize) -> QpCaps {
    QpCaps {
        max_send_wr: (depth as u32).min(device.caps().max_qp_wr),
        max_recv_wr: (depth as u32).min(device.caps().max_qp_wr),
        max_inline_data: device.caps().max_inline_data.min(64),
    }
}

impl Peer {
    /// A PD and CQ for a connection not yet made.
    pub fn resources(device: &Device, depth: usize) -> Result<(ProtectionDomain, CompletionQueue)> {
        Ok((device.alloc_pd()?, device.create_cq(depth as u32 * 2 + 16)?))
    }

    /// Accepts one connection on `listener` with `pd`/`cq`, posting `recvs` first; answers with
    /// `private`. Returns the peer and the client's private data.
    pub async fn accept(
        listener: &std::sync::Arc<Listener>,
        pd: ProtectionDomain,
        cq: CompletionQueue,
        depth: usize,
        private: Vec<u8>,
        recvs: Vec<RecvWr>,
    ) -> Result<(Peer, Vec<u8>)> {
        let l = listener.clone();
        let req = tokio::task::spawn_blocking(move || l.accept(None)).await??;
        let theirs = req.private_data().to_vec();
        let opts = QpOptions::new(&pd, &cq).caps(caps(listener.device(), depth));
        let qp = tokio::task::spawn_blocking(move || req.accept_with_recvs(&opts, &private, recvs)).await??;
        Ok((
            Peer {
                pd,
                cq,
                qp,
                ready: VecDeque::new(),
            },
            theirs,
        ))
    }

    /// Connects to `addr` with `pd`/`cq`, posting `recvs` first. Returns the peer and the
    /// server's private data.
    pub async fn connect(
        device: &Device,
        addr: SocketAddr,
        pd: ProtectionDomain,
        cq: CompletionQueue,
        depth: usize,
        private: Vec<u8>,
        recvs: Vec<RecvWr>,
    ) -> Result<(Peer, Vec<u8>)> {
        let opts = QpOptions::new(&pd, &cq).caps(caps(device, depth));
        let (qp, theirs) =
            tokio::task::spawn_blocking(move || transport::connect_with_recvs(addr, &opts, &private, SETUP, recvs))
                .await??;
        Ok((
            Peer {
                pd,
                cq,
                qp,
                ready: VecDeque::new(),
            },
            theirs,
        ))
    }

    /// Posts a send-queue work request.
    pub fn post(&self, wr: transport::SendWr) -> Result<()> {
        self.qp.post_send(wr).map_err(|e| e.error)?;
        Ok(())
    }

    /// Posts a receive.
    pub fn post_recv(&self, wr: RecvWr) -> Result<()> {
        self.qp.post_recv(wr).map_err(|e| e.error)?;
        Ok(())
    }

    /// The next completion, waiting for it; an error completion is an error.
    pub async fn next(&mut self) -> Result<Completion> {
        while self.ready.is_empty() {
            let mut got = Vec::new();
            self.cq.wait(&mut got, 64).await?;
            self.ready.extend(got);
        }
        self.take_ready()
    }

    /// The first completion that `pred` picks, waiting for it; the others stay queued, in order,
    /// for later calls. It polls for up to `spin` before it sleeps on the CQ: a wake-up costs
    /// tens of microseconds, more than most answers take.
    pub async fn next_where_spinning(
        &mut self,
        pred: impl Fn(&Completion) -> bool,
        spin: Duration,
    ) -> Result<Completion> {
        let until = std::time::Instant::now() + spin;
        loop {
            if let Some(i) = self.ready.iter().position(|c| c.status != WcStatus::Success || pred(c)) {
                let c = self.ready.remove(i).ok_or("no completion")?;
                self.ready.push_front(c);
                return self.take_ready();
            }
            if std::time::Instant::now() > until {
                return self.next_where(pred).await;
            }
            let mut got = Vec::new();
            self.cq.poll(&mut got, 64)?;
            self.ready.extend(got);
            std::hint::spin_loop();
        }
    }

    /// The first completion that `pred` picks, waiting for it; the others stay queued, in order,
    /// for later calls.
    pub async fn next_where(&mut self, pred: impl Fn(&Completion) -> bool) -> Result<Completion> {
        loop {
            // An error completion ends the wait whatever it is: after it, the QP is in error.
            if let Some(i) = self.ready.iter().position(|c| c.status != WcStatus::Success || pred(c)) {
                let c = self.ready.remove(i).ok_or("no completion")?;
                self.ready.push_front(c);
                return self.take_ready();
            }
            let mut got = Vec::new();
            self.cq.wait(&mut got, 64).await?;
            self.ready.extend(got);
        }
    }

    /// The next completion if one is there already.
    pub fn try_next(&mut self) -> Result<Option<Completion>> {
        if self.ready.is_empty() {
            let mut got = Vec::new();
            self.cq.poll(&mut got, 64)?;
            self.ready.extend(got);
        }
        if self.ready.is_empty() {
            return Ok(None);
        }
        self.take_ready().map(Some)
    }

    fn take_ready(&mut self) -> Result<Completion> {
        let c = self.ready.pop_front().ok_or("no completion")?;
        Ok(c.ok()
            .map_err(|e| format!("work request {} failed: {:?}", e.completion.wr_id, e.completion.status))?)
    }
}

/// Accepts connections forever, answering each with `private` (where the peer's one-sided
/// operations may go), and keeps their queue pairs open: a one-sided peer needs nothing more
/// from this side's CPU.
pub fn keep_accepting(listener: Listener, pd: ProtectionDomain, cq: CompletionQueue, private: Vec<u8>) -> ! {
    let mut peers = Vec::new();
    loop {
        let opts = QpOptions::new(&pd, &cq);
        match listener.accept(None).and_then(|req| req.accept(&opts, &private)) {
            Ok(qp) => peers.push(qp),
            Err(e) => eprintln!("a peer failed to connect: {e}"),
        }
    }
}

/// A remote region in a connection's private data (20 bytes; the limit is 56).
pub fn region_bytes(r: &RemoteRegion) -> Result<Vec<u8>> {
    Ok(postcard::to_allocvec(r)?)
}

/// The remote region a peer sent in its private data.
pub fn region_from(bytes: &[u8]) -> Result<RemoteRegion> {
    Ok(postcard::from_bytes(bytes).map_err(|e| format!("the peer's private data is not a region: {e}"))?)
}

/// Round-trip times kept in a histogram (1 ns to an hour, 3 significant digits) rather than a
/// list, so a run of any length uses the same few tens of KiB.
pub struct Latencies(hdrhistogram::Histogram<u64>);

impl Latencies {
    /// An empty record.
    pub fn new() -> Result<Self> {
        Ok(Self(hdrhistogram::Histogram::new_with_bounds(1, 3_600_000_000_000, 3)?))
    }

    /// Records one time (longer than an hour counts as an hour).
    pub fn record(&mut self, d: Duration) {
        self.0
            .saturating_record(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX).max(1));
    }

    /// How many times were recorded.
    pub fn len(&self) -> u64 {
        self.0.len()
    }

    /// The `q` quantile (0.5 is the median) in microseconds; 0 when nothing was recorded.
    pub fn quantile_us(&self, q: f64) -> f64 {
        if self.0.is_empty() {
            return 0.0;
        }
        self.0.value_at_quantile(q) as f64 / 1e3
    }

    /// p50 and p99 in microseconds.
    pub fn p50_p99(&self) -> (f64, f64) {
        (self.quantile_us(0.50), self.quantile_us(0.99))
    }
}

/// FNV-1a 64 over `bytes`, continuing from `h` (start with [`FNV64`]).
pub fn fnv64(h: u64, bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(h, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3))
}

/// FNV-1a 64's offset basis.
pub const FNV64: u64 = 0xcbf2_9ce4_8422_2325;

/// A deterministic byte pattern for record `seq` (xorshift).
pub fn pattern(seq: u64, len: usize) -> Vec<u8> {
    let mut x = seq.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// This process's CPU time so far, user and system.
pub fn process_cpu_time() -> Duration {
    cpu_time::ProcessTime::now().as_duration()
}
