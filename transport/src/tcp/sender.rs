//! The sending side of a software QP's connection, shared by posters and the responder.
//!
//! `send` never blocks on the socket: a frame goes out at once with a non-blocking send when
//! nothing is queued, and otherwise joins a backlog that the writer thread flushes with blocking
//! writes, outside the lock. So the reader (the responder: the reader thread or a polling
//! application thread) can answer without ever waiting on the peer, and two engines can never
//! wait on each other, while the common case costs one syscall and no thread hop.
//!
//! A read response's payload is not copied into the backlog: it waits there as a reference to
//! the registered memory it comes from, and the writer thread copies it out a chunk at a time
//! as the link takes it, as a NIC reads host memory while it transmits. A peer that asks for
//! reads and does not take the answers (hostile, or its own reader stuck) then costs this side
//! a few dozen bytes per request, not a copy of each response: 64 reads of a 16 MiB
//! registration grew the process by 1 GiB before (`tcp_hostile`'s test of it).

use std::collections::VecDeque;
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

use super::link::Link;
use super::wire::Encoder;
use crate::mr::{Region, Rmw};

/// The largest emptied backlog buffer kept for reuse.
const SPARE_MAX: usize = 4 << 20;

/// How much of a waiting read response the writer thread copies out of registered memory at a
/// time: the region's lock is held only for that copy, never while the link is full.
const CHUNK: usize = 256 << 10;

/// A piece of the backlog.
enum Piece {
    Bytes(Vec<u8>),
    /// `len` bytes of `region` from `off`, read as they go out.
    Memory {
        region: Arc<Region>,
        off: usize,
        len: usize,
    },
    /// An atomic the responder found its region locked for: run, and answered, when its turn
    /// to go out comes (RC lets later requests overtake an atomic; fences order them).
    Atomic {
        ssn: u64,
        region: Arc<Region>,
        off: usize,
        op: Rmw,
    },
}

#[derive(Default)]
struct State {
    backlog: VecDeque<Piece>,
    /// The writer's last batch, emptied, kept for the next backlog (no allocation per batch).
    spare: Vec<u8>,
    /// Frames to go out ahead of the next one sent, in its write ([`Sender::ahead`]).
    ahead: Vec<u8>,
    /// The writer thread is writing a taken backlog: new frames must queue behind it.
    flushing: bool,
    /// Close the sending side once the backlog is out.
    close_after: bool,
    closed: bool,
}

impl State {
    /// `head` with whatever waits to go ahead of it in front; `joined` holds the two when
    /// something does.
    fn with_ahead<'a>(&mut self, head: &'a [u8], joined: &'a mut Vec<u8>) -> &'a [u8] {
        if self.ahead.is_empty() {
            return head;
        }
        *joined = std::mem::take(&mut self.ahead);
        joined.extend_from_slice(head);
        joined
    }

    fn push_bytes(&mut self, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        if let Some(Piece::Bytes(last)) = self.backlog.back_mut() {
            last.extend_from_slice(bytes);
            return;
        }
        let mut b = std::mem::take(&mut self.spare);
        b.extend_from_slice(bytes);
        self.backlog.push_back(Piece::Bytes(b));
    }
}

pub(crate) struct Sender {
    link: Arc<dyn Link>,
    state: Mutex<State>,
    cv: Condvar,
}

impl Sender {
    pub(crate) fn new(link: Arc<dyn Link>) -> Self {
        Self {
            link,
            state: Mutex::new(State::default()),
            cv: Condvar::new(),
        }
    }

    /// Sends or queues one whole frame. Fails only once the connection is closed.
    pub(crate) fn send(&self, frame: &[u8]) -> Result<(), ()> {
        self.send_parts(frame, &[])
    }

    /// Puts whole `frames` ahead of the next frame sent, to go out in its write (the engine's
    /// deferred acknowledgement, ahead of the request that carries it). The caller holds what
    /// orders the frames it sends (the engine's state), so nothing sent later overtakes them.
    pub(crate) fn ahead(&self, frames: &[u8]) {
        self.state.lock().ahead.extend_from_slice(frames);
    }

    /// Sends or queues one frame given as its header and its payload (borrowed from registered
    /// memory: only what the link does not take at once is copied, into the backlog).
    pub(crate) fn send_parts(&self, head: &[u8], data: &[u8]) -> Result<(), ()> {
        let mut st = self.state.lock();
        if st.closed || st.close_after {
            return Err(());
        }
        let mut joined = Vec::new();
        let head = st.with_ahead(head, &mut joined);
        let mut sent = 0;
        if st.backlog.is_empty() && !st.flushing {
            sent = self.try_now(&mut st, head, data)?;
        }
        if sent < head.len() + data.len() {
            let (h, d) = (sent.min(head.len()), sent.saturating_sub(head.len()));
            st.push_bytes(&head[h..]);
            st.push_bytes(&data[d..]);
            self.cv.notify_one();
        }
        Ok(())
    }

    /// Sends or queues a read response: `head`, then `len` bytes of `region` from `off`. What
    /// the link does not take at once waits as a reference to the region, not as a copy; so
    /// does all of it while somebody holds the region for writing (the application, which may
    /// post on this QP meanwhile: the responder never waits for a registration's lock while it
    /// holds the QP's).
    pub(crate) fn send_from(&self, head: &[u8], region: &Arc<Region>, off: usize, len: usize) -> Result<(), ()> {
        // The region first, then our lock, in the order a post takes them (`send_parts` from a
        // registered buffer).
        let bytes = region.try_read_range(off, len);
        let mut st = self.state.lock();
        if st.closed || st.close_after {
            return Err(());
        }
        let mut joined = Vec::new();
        let head = st.with_ahead(head, &mut joined);
        let mut sent = 0;
        if let Some(bytes) = bytes.filter(|_| st.backlog.is_empty() && !st.flushing) {
            sent = self.try_now(&mut st, head, &bytes)?;
        }
        if sent < head.len() + len {
            let (h, d) = (sent.min(head.len()), sent.saturating_sub(head.len()));
            st.push_bytes(&head[h..]);
            st.backlog.push_back(Piece::Memory {
                region: region.clone(),
                off: off + d,
                len: len - d,
            });
            self.cv.notify_one();
        }
        Ok(())
    }

    /// Runs a target's atomic on `region` and sends its answer; if somebody holds the region,
    /// or anything waits in the backlog (an atomic deferred before it may be there), the atomic
    /// waits in the backlog for the writer thread, which runs them in the order they came and
    /// may wait for the lock.
    pub(crate) fn send_atomic(&self, ssn: u64, region: &Arc<Region>, off: usize, op: Rmw) -> Result<(), ()> {
        let mut st = self.state.lock();
        if st.closed || st.close_after {
            return Err(());
        }
        // What waits to go ahead goes first, from the backlog (the atomic then queues behind it).
        let ahead = std::mem::take(&mut st.ahead);
        st.push_bytes(&ahead);
        // Only a try: no lock taken under ours is waited for.
        let now = (st.backlog.is_empty() && !st.flushing)
            .then(|| region.try_atomic(off, op))
            .flatten();
        if let Some(old) = now {
            drop(st);
            return self.send(&Encoder::atomic_resp(ssn, old).finish());
        }
        st.backlog.push_back(Piece::Atomic {
            ssn,
            region: region.clone(),
            off,
            op,
        });
        self.cv.notify_one();
        Ok(())
    }

    /// One non-blocking write of `head` then `data`: the bytes taken. A broken link closes.
    fn try_now(&self, st: &mut State, head: &[u8], data: &[u8]) -> Result<usize, ()> {
        self.link.try_write2(head, data).map_err(|_| st.closed = true)
    }

    /// Lets what is queued go out, then closes the sending side.
    pub(crate) fn close_after_flush(&self) {
        let mut st = self.state.lock();
        st.close_after = true;
        self.cv.notify_one();
    }

    /// Stops at once; the writer thread exits.
    pub(crate) fn close(&self) {
        let mut st = self.state.lock();
        st.closed = true;
        self.cv.notify_one();
    }

    /// The writer thread: flushes the backlog with blocking writes, without holding the lock.
    pub(crate) fn run_writer(&self) {
        let mut scratch = Vec::new();
        let mut st = self.state.lock();
        loop {
            if st.closed {
                return;
            }
            if st.backlog.is_empty() {
                st.flushing = false;
                if st.close_after {
                    self.link.shutdown_write();
                    st.closed = true;
                    return;
                }
                self.cv.wait(&mut st);
                continue;
            }
            let mut batch = std::mem::take(&mut st.backlog);
            st.flushing = true;
            drop(st);
            let mut ok = true;
            let mut spare = None;
            for piece in batch.drain(..) {
                ok = ok && self.write_piece(&piece, &mut scratch);
                match piece {
                    Piece::Bytes(mut b) if b.capacity() <= SPARE_MAX => {
                        b.clear();
                        spare = Some(b);
                    }
                    _ => {}
                }
            }
            st = self.state.lock();
            if !ok {
                st.closed = true;
                return;
            }
            // Kept for the next backlog unless it grew past what is worth holding on to.
            if let Some(b) = spare {
                st.spare = b;
            }
            if st.backlog.is_empty() {
                st.backlog = batch;
            }
        }
    }

    /// Writes one piece, waiting for room; a read response's payload a chunk at a time, each
    /// copied out under the region's lock and written without it. False if the link broke.
    fn write_piece(&self, piece: &Piece, scratch: &mut Vec<u8>) -> bool {
        match piece {
            Piece::Bytes(b) => self.link.write_all(b).is_ok(),
            Piece::Memory { region, off, len } => {
                let mut done = 0;
                while done < *len {
                    let n = CHUNK.min(len - done);
                    scratch.clear();
                    scratch.extend_from_slice(&region.read_range(off + done, n));
                    if self.link.write_all(scratch).is_err() {
                        return false;
                    }
                    done += n;
                }
                true
            }
            Piece::Atomic { ssn, region, off, op } => {
                let old = region.atomic(*off, *op);
                self.link.write_all(&Encoder::atomic_resp(*ssn, old).finish()).is_ok()
            }
        }
    }
}
