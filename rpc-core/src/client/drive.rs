//! The connection's driver task: polls for sleeping calls, keeps the connection going when no call
//! does, and closes it after the last handle.

use super::*;

/// The connection's driver task: polls for sleeping calls, keeps the connection going when no
/// call does, and closes it (dropping the QP and buffers) after the last handle.
pub(super) async fn drive(gone: OnDriverGone) {
    // The guard is the future's from its making: dropped with it even if it never ran.
    let shared = &gone.0;
    let cq = shared.state.lock().conn.cq().clone();
    // The last wait ended at its deadline: the keepalive may be due.
    let mut timed_out = false;
    // Turns given way to woken calls in a row ([`State::driver_posts`]).
    let mut held = 0;
    loop {
        let next = {
            let mut st = shared.state.lock();
            st.conn.link.driven_here();
            st.progress();
            if std::mem::take(&mut timed_out) {
                st.conn.keepalive_look(std::time::Instant::now());
            }
            let lost = st.conn.lost().is_some();
            if st.closed && (lost || !st.conn.has_work()) {
                st.driver_posts = false;
                return;
            }
            // What the flush left (a long message's further pieces) goes before any sleep,
            // unless a spinning call posts it.
            if st.driver_must_post() {
                None
            } else if (st.driver_posts || st.commit_driver()) && st.woken >= 2 && held < super::state::HOLD_BACK_POLLS {
                // Calls woken with their results (by this task, or by a call's poll) have not
                // run yet: each may start its next call. Their requests go out together when
                // this task runs again, after them, in one Send where each went alone (a
                // system call and a loopback TCP round of the kernel each on `tcp`).
                st.driver_posts = true;
                held += 1;
                None
            } else {
                held = 0;
                // What it held back for the calls it gave way to.
                if std::mem::take(&mut st.driver_posts) {
                    st.conn.flush();
                }
                let watch = st.needs_watch();
                let deadline = if lost {
                    None
                } else {
                    let timeout = st.conn.session.poll_timeout();
                    match (timeout, st.conn.keepalive_due()) {
                        (Some(t), Some(k)) => Some(t.min(k)),
                        (t, k) => t.or(k),
                    }
                };
                st.driver_on_cq = watch;
                st.driver_until = deadline;
                Some((watch, deadline, st.conn.inbox()))
            }
        };
        let Some((watch, deadline, inbox)) = next else {
            crate::driver::reschedule().await;
            continue;
        };
        let sleep = async move {
            match deadline {
                Some(d) => tokio::time::sleep_until(d.into()).await,
                None => std::future::pending().await,
            }
        };
        // A connection of a group ([`Connector`](crate::Connector)) waits for the group's
        // poller to hand it completions; any other on its own CQ.
        let completions = async {
            match &inbox {
                Some(inbox) => {
                    inbox.notified().await;
                    Ok(())
                }
                None => cq.ready().await,
            }
        };
        tokio::select! {
            r = completions, if watch => {
                if let Err(e) = r {
                    tracing::debug!(%e, "waiting on the CQ");
                    // The next progress polls the CQ and sees the error as the connection's loss.
                    tokio::task::yield_now().await;
                }
            }
            () = shared.kick.notified() => {}
            () = sleep => timed_out = true,
        }
    }
}

/// Dropped with the driver task. Unless the client was closed, that is its runtime shutting
/// down (a client connected on one runtime, such as a test's, and used on another): then
/// nothing would ever wake a call that sleeps, so the connection fails at once, and its
/// calls, pending and later, with it.
pub(super) struct OnDriverGone(pub(super) Arc<Shared>);

impl Drop for OnDriverGone {
    fn drop(&mut self) {
        let mut st = self.0.state.lock();
        if st.closed || st.conn.lost().is_some() {
            return;
        }
        st.conn.lose(crate::driver::local_loss(
            "the connection's driver task ended with the tokio runtime the client was connected on: \
             use a Client on that runtime while it runs, or connect again on this one",
        ));
        st.settle();
    }
}
