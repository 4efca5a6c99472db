//! The same ring all-reduce over plain TCP, for comparison in the same run: one socket to the
//! right neighbour, one from the left; each step writes a chunk (on a writer thread that lives
//! as long as the ring, so no step pays a thread's start) while reading the left's.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::common;

pub struct TcpRing {
    /// Chunks to write to the right neighbour, and the writer thread's word on each.
    to_right: mpsc::SyncSender<Vec<u8>>,
    written: mpsc::Receiver<std::io::Result<Vec<u8>>>,
    left: TcpStream,
}

/// The TCP address of a rank: its RDMA address's port plus one.
pub fn addr_of(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip(), a.port().wrapping_add(1))
}

impl TcpRing {
    pub fn connect(peers: &[SocketAddr], rank: usize) -> common::Result<Self> {
        let listener = TcpListener::bind(addr_of(peers[rank]))?;
        let right_addr = addr_of(peers[(rank + 1) % peers.len()]);
        std::thread::scope(|s| {
            let accepting = s.spawn(|| listener.accept().map(|(s, _)| s));
            let deadline = Instant::now() + Duration::from_secs(60);
            let right = loop {
                match TcpStream::connect(right_addr) {
                    Ok(s) => break s,
                    Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused && Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(20))
                    }
                    Err(e) => return Err(e.into()),
                }
            };
            let left = accepting.join().map_err(|_| "the accepting thread panicked")??;
            right.set_nodelay(true)?;
            left.set_nodelay(true)?;
            let (to_right, chunks) = mpsc::sync_channel::<Vec<u8>>(1);
            let (done, written) = mpsc::sync_channel(1);
            std::thread::spawn(move || {
                let mut right = right;
                for chunk in chunks {
                    // The buffer goes back for the next step.
                    if done.send(right.write_all(&chunk).map(|()| chunk)).is_err() {
                        return;
                    }
                }
            });
            Ok(Self {
                to_right,
                written,
                left,
            })
        })
    }

    /// All-reduces `v` (sum) over the ring of `n` ranks in which this is `rank`.
    pub fn allreduce(&mut self, v: &mut [f32], n: usize, rank: usize) -> common::Result<()> {
        let c = v.len() / n;
        let mut out = vec![0u8; c * 4];
        let mut inc = vec![0u8; c * 4];
        for k in 0..2 * (n - 1) {
            let (send, recv, add) = if k < n - 1 {
                ((rank + n - k) % n, (rank + 2 * n - k - 1) % n, true)
            } else {
                let s = k - (n - 1);
                ((rank + 1 + n - s) % n, (rank + n - s) % n, false)
            };
            for (b, x) in out.chunks_exact_mut(4).zip(&v[send * c..(send + 1) * c]) {
                b.copy_from_slice(&x.to_ne_bytes());
            }
            self.to_right.send(out).map_err(|_| "the writer thread ended")?;
            self.left.read_exact(&mut inc)?;
            out = self.written.recv().map_err(|_| "the writer thread ended")??;
            for (x, b) in v[recv * c..(recv + 1) * c].iter_mut().zip(inc.chunks_exact(4)) {
                let y = f32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
                *x = if add { *x + y } else { y };
            }
        }
        Ok(())
    }
}
