//! The connection's task: progress, events to the role, and the completion mode's wait.

use super::*;

/// Polls a spinning connection makes between turns through the runtime.
pub(super) const INNER_SPINS: u32 = 64;

/// How long a connection waiting for a buffer of a shared send pool sleeps before it looks
/// again.
const STARVED_RETRY: std::time::Duration = std::time::Duration::from_micros(100);

/// How often an idle connection of a server on a receive pool looks whether its QP failed.
const POOLED_ALIVE: std::time::Duration = std::time::Duration::from_secs(1);

/// How often a connection may move its thread off its peer's CPU at most.
pub(super) const MOVE_EVERY: std::time::Duration = std::time::Duration::from_millis(10);

/// Runs a connection until it is lost or its role is finished.
pub(crate) async fn run<R: Role + Send>(mut conn: Conn, mut role: R, mode: CompletionMode) {
    let mut budget = Budget::default();
    let mut backoff = Backoff::default();
    // When this connection last moved its thread off its peer's CPU.
    let mut moved: Option<Instant> = None;
    // This connection's leave to spin (adaptive), held while it spins and given back as it
    // sleeps.
    let mut token: Option<SpinToken> = None;
    loop {
        conn.link.driven_here();
        let mut busy = role.drain_inputs(&mut conn);
        busy |= conn.progress();
        let mut events = false;
        while let Some(ev) = conn.session.poll_event() {
            role.on_event(&mut conn, ev);
            events = true;
        }
        // What the events made the session send (`progress` flushed what came before them).
        if events {
            conn.flush();
            busy = true;
        }
        if let Some(why) = conn.lost.clone() {
            role.on_lost(&why);
            conn.drain_flushed();
            return;
        }
        if role.finished(&conn) {
            return;
        }
        if busy {
            budget.restart();
            continue;
        }
        if budget.spins(mode, &mut backoff) && !conn.peer_on_this_thread(mode) && Conn::may_spin(mode, &mut token) {
            // Poll a while before giving way: a turn through the runtime costs more than the
            // polls, and a message usually comes within them.
            let mut found = false;
            conn.spin_round();
            for _ in 0..INNER_SPINS {
                std::hint::spin_loop();
                if conn.poll_cq() {
                    // Straight to what it brought (a request's handler, its response).
                    while let Some(ev) = conn.session.poll_event() {
                        role.on_event(&mut conn, ev);
                    }
                    conn.flush();
                    found = true;
                    break;
                }
            }
            // What the polls found is handled at once; only an idle round gives way (and its
            // core too, when the provider's own threads need it).
            if found {
                // Activity: the budget starts again, as after a busy round above. Without
                // this, a message found late in the budget left the rest of it (down to
                // nothing) for the peer's next one: the server answered and went to sleep.
                budget.restart();
            } else if matches!(mode, CompletionMode::Adaptive { .. }) && conn.peer_shares_cpu() {
                // The peer's poller is on this core: spinning only keeps it from running
                // (both budgets spent per round trip). Move to another core, where both
                // can spin (at most once per `MOVE_EVERY`: a peer that keeps following is
                // left to sleeping); else sleep now, and the scheduler may keep the two on one
                // core a while longer (docs/guide.md, "Completion modes").
                if moved.is_none_or(|t| t.elapsed() >= MOVE_EVERY) && conn.leave_peer_cpu() {
                    moved = Some(Instant::now());
                    tracing::trace!("moved off the client's CPU");
                } else {
                    token = None;
                    wait(&mut conn, &mut role).await;
                }
                budget.restart();
            } else {
                budget.idle_round(mode);
                conn.keepalive_spun();
                if conn.yield_cpu {
                    std::thread::yield_now();
                }
                reschedule().await;
            }
            continue;
        }
        token = None;
        wait(&mut conn, &mut role).await;
        budget.restart();
    }
}

/// Sleeps until a completion, a command or a deadline.
pub(super) async fn wait<R: Role>(conn: &mut Conn, role: &mut R) {
    conn.spin_end();
    let mut deadline = conn.session.poll_timeout();
    let soon = if conn.starved() {
        // No completion of ours may say a shared send buffer is free: look again soon.
        Some(STARVED_RETRY)
    } else if conn.on_pool() {
        // A QP on a shared receive queue has no receives of its own to flush when its peer
        // goes: nothing may come to the CQ to say so (see `Conn::check_alive`).
        Some(POOLED_ALIVE)
    } else {
        None
    };
    if let Some(soon) = soon.map(|s| Instant::now() + s) {
        deadline = Some(deadline.map_or(soon, |d| d.min(soon)));
    }
    if let Some(k) = conn.keepalive_due() {
        deadline = Some(deadline.map_or(k, |d| d.min(k)));
    }
    let sleep = async move {
        match deadline {
            Some(d) => tokio::time::sleep_until(d.into()).await,
            None => std::future::pending().await,
        }
    };
    // A pooled connection waits for its group's poller to hand it completions; any other on
    // its own CQ.
    let inbox = conn.inbox();
    let cq = conn.cq.clone();
    let mut got = Vec::new();
    let completions = async {
        match &inbox {
            Some(inbox) => {
                inbox.notified().await;
                Ok(0)
            }
            None => cq.wait(&mut got, 64).await,
        }
    };
    tokio::select! {
        r = completions => {
            if let Err(e) = r {
                conn.lose(super::local_loss(format!("waiting on the CQ: {}", rdma_rpc_transport::Report(&e))));
            }
            if inbox.is_some() {
                conn.poll_cq();
            }
            for c in got.drain(..) {
                conn.on_completion(c);
            }
        }
        input = role.wait_input() => {
            if let Some(i) = input {
                role.on_input(conn, i);
            }
        }
        () = sleep => {}
    }
    conn.check_alive();
    if conn.keepalive_due().is_some() {
        conn.keepalive_look(Instant::now());
    }
}
