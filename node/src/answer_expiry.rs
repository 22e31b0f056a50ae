//! The clock that removes stored Idempotency-Key answers once past their window
//! (`store::idempotency_expiry`). Every node prunes its own copy by its own clock:
//! pruning is not replicated, and nothing a node decides or applies depends on it, only
//! whether a request sent again after the window finds its answer.

use std::time::Duration;

use crate::metrics::Metrics;
use crate::store::idempotency_expiry::{now_secs, Pruned};
use crate::store::StateMachine;

/// Rows one transaction removes at most, so the state machine's writer, whose commits
/// wait for it, waits briefly.
const ROWS_PER_PASS: usize = 1_000;
/// Between two passes the write lock is left free this long, for the writer.
const PAUSE_BETWEEN_PASSES: Duration = Duration::from_millis(10);
/// Passes one tick makes at most; what is left waits for the next tick.
const PASSES_PER_TICK: usize = 1_000;

/// How often answers are looked at: a quarter of the window, from 100 ms to a minute.
fn tick(window: Duration) -> Duration {
    (window / 4).clamp(Duration::from_millis(100), Duration::from_secs(60))
}

/// A pass waits while the disk is below its reserve (`StateMachine::own_commits_wait`).
pub fn spawn(sm: StateMachine, window: Duration, metrics: std::sync::Arc<Metrics>) {
    if window < Duration::from_secs(60) {
        tracing::warn!(
            window_secs = window.as_secs(),
            "idempotency answers are kept under a minute: a client's retry may be decided again"
        );
    }
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(tick(window));
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            let sm = sm.clone();
            let pass = tokio::task::spawn_blocking(move || prune_due(&sm, window)).await;
            let (pruned, error) = match pass {
                Ok(done) => done,
                Err(e) => (Pruned::default(), Some(format!("task failed: {e}"))),
            };
            for (outcome, count) in [
                ("removed", pruned.answers),
                ("reindexed", pruned.reindexed),
                ("absent", pruned.absent),
            ] {
                metrics
                    .idempotency_expired
                    .with_label_values(&[outcome])
                    .inc_by(count);
            }
            if pruned.reindexed + pruned.absent > 0 {
                tracing::debug!(
                    reindexed = pruned.reindexed,
                    absent = pruned.absent,
                    "idempotency index rows that did not match their answer"
                );
            }
            if let Some(e) = error {
                tracing::warn!(error = %e, "could not prune idempotency answers");
            }
        }
    });
}

/// Prunes in passes, a pause between them, until one finds fewer rows due than it may
/// take (or the tick's passes are spent). Returns what was done, and the error that
/// stopped it early, if one did.
fn prune_due(sm: &StateMachine, window: Duration) -> (Pruned, Option<String>) {
    let mut done = Pruned::default();
    for pass in 0..PASSES_PER_TICK {
        if pass > 0 {
            std::thread::sleep(PAUSE_BETWEEN_PASSES);
        }
        // The expiry clock never runs ahead of real time (`now_secs`).
        let now = now_secs();
        let cutoff = now.saturating_sub(window.as_secs());
        match sm.prune_idempotency_answers(cutoff, now, ROWS_PER_PASS) {
            Ok(pruned) => {
                done.add(&pruned);
                if pruned.rows() < ROWS_PER_PASS as u64 {
                    break;
                }
            }
            Err(e) => return (done, Some(e)),
        }
    }
    (done, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tick_is_a_quarter_of_the_window_within_bounds() {
        assert_eq!(tick(Duration::from_secs(2)), Duration::from_millis(500));
        assert_eq!(tick(Duration::from_secs(1)), Duration::from_millis(250));
        assert_eq!(tick(Duration::ZERO), Duration::from_millis(100));
        assert_eq!(tick(Duration::from_secs(86_400)), Duration::from_secs(60));
    }
}
