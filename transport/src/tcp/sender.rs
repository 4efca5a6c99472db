//! The sending side of a software QP's connection, shared by posters and the responder.
//!
//! `send` never blocks on the socket: a frame goes out at once with a non-blocking send when
//! nothing is queued, and otherwise joins a backlog that the writer thread flushes with blocking
//! writes, outside the lock. So the reader (the responder: the reader thread or a polling
//! application thread) can answer without ever waiting on the peer, and two engines can never
//! wait on each other, while the common case costs one syscall and no thread hop.

use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

use super::link::Link;

/// The largest emptied backlog buffer kept for reuse.
const SPARE_MAX: usize = 4 << 20;

#[derive(Default)]
struct State {
    backlog: Vec<u8>,
    /// The writer's last batch, emptied, kept for the next backlog (no allocation per batch).
    spare: Vec<u8>,
    /// The writer thread is writing a taken backlog: new frames must queue behind it.
    flushing: bool,
    /// Close the sending side once the backlog is out.
    close_after: bool,
    closed: bool,
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

    /// Sends or queues one frame given as its header and its payload (borrowed from registered
    /// memory: only what the link does not take at once is copied, into the backlog).
    pub(crate) fn send_parts(&self, head: &[u8], data: &[u8]) -> Result<(), ()> {
        let mut st = self.state.lock();
        if st.closed || st.close_after {
            return Err(());
        }
        let mut sent = 0;
        if st.backlog.is_empty() && !st.flushing {
            match self.link.try_write2(head, data) {
                Ok(n) => sent = n,
                Err(_) => {
                    st.closed = true;
                    return Err(());
                }
            }
        }
        if sent < head.len() + data.len() {
            if st.backlog.is_empty() && st.backlog.capacity() == 0 {
                st.backlog = std::mem::take(&mut st.spare);
            }
            let (h, d) = (sent.min(head.len()), sent.saturating_sub(head.len()));
            st.backlog.extend_from_slice(&head[h..]);
            st.backlog.extend_from_slice(&data[d..]);
            self.cv.notify_one();
        }
        Ok(())
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
            let ok = self.link.write_all(&batch).is_ok();
            batch.clear();
            st = self.state.lock();
            if !ok {
                st.closed = true;
                return;
            }
            // Kept for the next backlog unless it grew past what is worth holding on to.
            if batch.capacity() <= SPARE_MAX {
                st.spare = batch;
            }
        }
    }
}
