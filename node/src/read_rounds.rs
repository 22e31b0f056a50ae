//! Linearizable reads share leadership confirmations.
//!
//! A read served by the leader must first confirm that it still leads: openraft's
//! `ensure_linearizable` sends a heartbeat to every follower and waits for a quorum. One
//! round per read meant a flood of reads, anyone's (several are public), became a flood
//! of heartbeats, one per follower per read. Here rounds run one at a time, and a read
//! takes the result of the first round that *started after it arrived*: that round
//! confirms leadership at a moment after the read arrived, which is all a linearizable
//! read needs. Every read waiting while a round runs shares the next one, so at most one
//! round runs at a time, and each read waits for at most two (more only if a round is
//! dropped part-way: its caller's client went away, and the next caller runs another).
//! A round that never ends (openraft waits for its apply without a timeout) holds every
//! read queued behind it, as it held each read before.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};

/// Rounds of a confirmation whose result is `R`, shared by the callers that may use it.
pub struct ReadRounds<R> {
    /// The last completed round's result. Holding the lock is running a round.
    latest: tokio::sync::Mutex<Option<R>>,
    /// Rounds completed.
    completed: AtomicU64,
}

impl<R> Default for ReadRounds<R> {
    fn default() -> Self {
        ReadRounds {
            latest: tokio::sync::Mutex::new(None),
            completed: AtomicU64::new(0),
        }
    }
}

impl<R: Clone> ReadRounds<R> {
    /// The result of a round that started after this call: `round` run now, or the
    /// result of one another caller ran.
    pub async fn confirm<F, Fut>(&self, round: F) -> R
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = R>,
    {
        // Rounds run one at a time, so when this caller arrived at most one was running
        // (it may have started earlier). The one after it started after this arrival:
        // two completions from here on mean the latest result is from such a round.
        let arrived = self.completed.load(Ordering::SeqCst);
        let mut latest = self.latest.lock().await;
        if self.completed.load(Ordering::SeqCst) >= arrived + 2 {
            if let Some(result) = latest.as_ref() {
                return result.clone();
            }
        }
        // A caller dropped here (its client went away) leaves no result and no count:
        // the next caller runs its own round.
        let result = round().await;
        *latest = Some(result.clone());
        self.completed.fetch_add(1, Ordering::SeqCst);
        result
    }

    /// Rounds completed so far.
    pub fn rounds(&self) -> u64 {
        self.completed.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;

    /// Every caller gets a round that started after it arrived, and a crowd arriving
    /// together shares rounds instead of running one each.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn each_caller_gets_a_round_started_after_it_arrived_and_crowds_share() {
        let rounds: Arc<ReadRounds<u64>> = Arc::default();
        // A clock of round starts: each round returns the tick it started at.
        let ticks = Arc::new(AtomicU64::new(0));
        let mut callers = Vec::new();
        for i in 0..200u64 {
            let (rounds, ticks) = (rounds.clone(), ticks.clone());
            callers.push(tokio::spawn(async move {
                if i % 20 == 0 {
                    tokio::time::sleep(Duration::from_millis(i / 4)).await;
                }
                let arrived = ticks.fetch_add(1, Ordering::SeqCst);
                let started = rounds
                    .confirm(|| async {
                        let started = ticks.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        started
                    })
                    .await;
                (arrived, started)
            }));
        }
        for caller in callers {
            let (arrived, started) = caller.await.expect("caller");
            assert!(
                started > arrived,
                "a round started at tick {started} served a caller that arrived at {arrived}"
            );
        }
        let run = rounds.rounds();
        assert!(run >= 1);
        assert!(
            run < 100,
            "{run} rounds for 200 callers: they were not shared"
        );
    }

    /// A caller whose round is dropped part-way leaves nothing behind: the next caller
    /// runs a round of its own.
    #[tokio::test]
    async fn a_dropped_round_counts_for_nothing() {
        let rounds: ReadRounds<u32> = ReadRounds::default();
        let dropped = tokio::time::timeout(
            Duration::from_millis(10),
            rounds.confirm(|| async {
                tokio::time::sleep(Duration::from_secs(60)).await;
                1
            }),
        )
        .await;
        assert!(dropped.is_err());
        assert_eq!(rounds.rounds(), 0);
        assert_eq!(rounds.confirm(|| async { 2 }).await, 2);
        assert_eq!(rounds.confirm(|| async { 3 }).await, 3);
        assert_eq!(rounds.rounds(), 2);
    }
}
