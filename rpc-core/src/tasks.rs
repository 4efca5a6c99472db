//! The handler tasks of one server connection: those that did not finish on their first poll
//! and run in a tokio task of their own, the ones aborted (cancel, deadline) and the channel
//! their results come back through.
//!
//! A result belongs to its call only while the call runs. A task aborted after it sent its
//! result leaves that result (maybe a registered buffer of the connection) in the channel, and
//! it must be taken out and dropped there, not left until the connection ends: so aborted tasks
//! are kept until they are finished, and the channel is drained while any is kept.

use std::future::Future;

use foldhash::HashMap;
use tokio::sync::mpsc;
use tokio::task::AbortHandle;

pub(crate) struct Tasks<T> {
    running: HashMap<u32, AbortHandle>,
    /// Aborted before they finished: one may still have sent its result.
    aborted: Vec<AbortHandle>,
    tx: mpsc::UnboundedSender<(u32, T)>,
    rx: mpsc::UnboundedReceiver<(u32, T)>,
}

impl<T: Send + 'static> Tasks<T> {
    pub(crate) fn new() -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        Self {
            running: HashMap::default(),
            aborted: Vec::new(),
            tx,
            rx,
        }
    }

    /// Runs `fut` for `call` in a task of its own; its output comes back through
    /// [`Tasks::drain`] or [`Tasks::recv`] unless the call is aborted first. Aborting the task
    /// drops `fut` and sends nothing.
    pub(crate) fn spawn(&mut self, call: u32, fut: impl Future<Output = T> + Send + 'static) {
        let tx = self.tx.clone();
        let task = tokio::spawn(async move {
            let out = fut.await;
            let _ = tx.send((call, out));
        });
        self.running.insert(call, task.abort_handle());
    }

    /// The call is over without its result (cancelled, past its deadline): aborts its task.
    /// A result it sent already is dropped by the next [`Tasks::drain`].
    pub(crate) fn abort(&mut self, call: u32) {
        if let Some(h) = self.running.remove(&call) {
            h.abort();
            self.aborted.push(h);
        }
    }

    /// The connection is lost: aborts every task. What they sent is dropped with `self`.
    pub(crate) fn abort_all(&mut self) {
        for (_, h) in self.running.drain() {
            h.abort();
        }
        self.aborted.clear();
    }

    /// Hands `each` the results that came, without waiting, and drops those of aborted calls;
    /// returns whether any result of a running call came.
    pub(crate) fn drain(&mut self, mut each: impl FnMut(u32, T)) -> bool {
        // Only a task sends here: with none running or aborted, nothing can be waiting.
        if self.running.is_empty() && self.aborted.is_empty() {
            return false;
        }
        // A finished task sent whatever it sent before it finished: the loop below takes it.
        self.aborted.retain(|h| !h.is_finished());
        let mut any = false;
        while let Ok((call, out)) = self.rx.try_recv() {
            if self.running.remove(&call).is_some() {
                each(call, out);
                any = true;
            }
        }
        any
    }

    /// Waits for the next result of a running call (dropping those of aborted ones). Cancel
    /// safe: a result taken is returned by the same poll.
    pub(crate) async fn recv(&mut self) -> Option<(u32, T)> {
        loop {
            let (call, out) = self.rx.recv().await?;
            if self.running.remove(&call).is_some() {
                return Some((call, out));
            }
        }
    }

    /// Tasks running or aborted and not known to be finished.
    #[cfg(test)]
    fn kept(&self) -> usize {
        self.running.len() + self.aborted.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// Yields until every task but those still pending has finished.
    async fn settle(tasks: &Tasks<Arc<()>>, pending: usize) {
        for _ in 0..10_000 {
            let finished = tasks
                .running
                .values()
                .chain(&tasks.aborted)
                .filter(|h| h.is_finished())
                .count();
            if tasks.kept() - finished == pending {
                return;
            }
            tokio::task::yield_now().await;
        }
        panic!("the tasks did not finish");
    }

    #[tokio::test]
    async fn a_result_sent_before_its_call_was_aborted_is_dropped_by_the_next_drain() {
        let mut tasks = Tasks::new();
        let held = Arc::new(()); // stands for a registered buffer of the connection
        let answer = held.clone();
        tasks.spawn(7, async move { answer });
        // The task sent its result and finished; the cancel is handled only now, with no
        // drain in between (the window between the driver's drain and its events).
        settle(&tasks, 0).await;
        tasks.abort(7);
        let mut handed = Vec::new();
        assert!(
            !tasks.drain(|call, out| handed.push((call, out))),
            "no running call answered"
        );
        assert!(handed.is_empty(), "an aborted call's result is not handed on");
        assert_eq!(Arc::strong_count(&held), 1, "the aborted call's result was dropped");
        assert_eq!(tasks.kept(), 0, "nothing kept once the aborted task is known finished");
        assert!(!tasks.drain(|_, _| unreachable!()), "and later drains find nothing");
    }

    #[tokio::test]
    async fn results_of_running_calls_are_handed_on_once_and_aborted_pending_tasks_are_let_go() {
        let mut tasks = Tasks::new();
        let held = Arc::new(());
        let answer = held.clone();
        tasks.spawn(1, async move { answer });
        let stuck = held.clone();
        tasks.spawn(2, async move {
            std::future::pending::<()>().await;
            stuck
        });
        settle(&tasks, 1).await;
        let mut handed = Vec::new();
        assert!(tasks.drain(|call, out| handed.push((call, out))));
        assert_eq!(handed.len(), 1);
        assert_eq!(handed[0].0, 1);
        handed.clear();
        assert!(!tasks.drain(|call, out| handed.push((call, out))), "handed on once");
        assert!(handed.is_empty());
        tasks.abort(2);
        settle(&tasks, 0).await;
        assert!(!tasks.drain(|_, _| unreachable!()));
        assert_eq!(tasks.kept(), 0, "the aborted task is let go once finished");
        assert_eq!(Arc::strong_count(&held), 1, "the aborted task's future was dropped");
    }

    #[tokio::test]
    async fn recv_waits_for_a_running_call_and_skips_aborted_ones() {
        let mut tasks = Tasks::new();
        let (go, wait) = tokio::sync::oneshot::channel::<()>();
        tasks.spawn(3, async move { Arc::new(()) });
        settle(&tasks, 0).await;
        tasks.abort(3);
        tasks.spawn(4, async move {
            let _ = wait.await;
            Arc::new(())
        });
        let _ = go.send(());
        let got = tokio::time::timeout(std::time::Duration::from_secs(10), tasks.recv()).await;
        assert_eq!(
            got.ok().flatten().map(|(call, _)| call),
            Some(4),
            "call 3's result skipped"
        );
    }
}
