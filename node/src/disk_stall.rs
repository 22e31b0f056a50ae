//! A node whose disk stops finishing writes steps back until it answers again.
//!
//! Why: a leader whose disk hangs (a stalled volume, a frozen file system, an fsync
//! queued behind gigabytes of someone else's writeback) still runs its Raft core, so it
//! keeps sending heartbeats and no follower campaigns, while no write can become durable
//! on it and every request routed to it waits. The whole cluster stopped answering for as
//! long as one disk did (`tests/disk_stall.rs`, before this module: no write answered in
//! 60 s with the leader's file system frozen, and no election).
//!
//! What it does, once a durable write (`disk_watch`) has been in flight longer than
//! `--disk-stall-ms`: this node sends no heartbeats, runs no heads rounds and stands for
//! no election, so the others elect a leader among themselves once their leases run out;
//! while it believes it leads it answers 503 to what it would serve itself
//! (`api::forward`; a stalled follower still relays, which needs no disk), and
//! `/readyz` says not ready, so clients and load balancers go elsewhere at once instead
//! of waiting. When the write returns, all of that ends. Nothing here touches what is
//! stored or decided: heartbeats and elections are liveness only, and a write refused
//! with 503 was never decided.
//!
//! A stalled node also sends no entries and no snapshot (`network::raft_client`):
//! openraft 0.9 has no way to hand leadership over, and a catch-up or snapshot stream
//! to a lagging follower would otherwise renew that follower's lease with every batch
//! and delay the election until it ended.
//!
//! The check runs on its own thread: it must see the stall even when the async runtime's
//! workers are the ones waiting on the disk, and everything it sets is an atomic or a
//! short lock.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::disk_watch::{DiskWatch, DiskWrite};

/// Long against one group commit or one commit of the state file's rows (a false alarm
/// costs an election), short against what a stall costs: every request the cluster gets
/// meanwhile. Not measured against the slowest disks in service; operators of slow
/// volumes raise it.
pub const DEFAULT_STALL_AFTER: Duration = Duration::from_secs(5);

/// The shortest `--disk-stall-ms` taken: below it ordinary fsyncs would make heartbeats
/// and elections flap.
pub const MIN_STALL_AFTER: Duration = Duration::from_secs(1);

const CHECK_EVERY: Duration = Duration::from_millis(200);

/// What a stall turns off, and back on.
pub struct StepBack {
    /// `raft.runtime_config().heartbeat`.
    pub heartbeats: Box<dyn Fn(bool) + Send>,
    /// `ElectionHold::disk_stalled`.
    pub elections: Box<dyn Fn(bool) + Send>,
}

/// The stall state machine, apart from its thread and clock.
struct Stall {
    after: Duration,
    stalled: bool,
}

impl Stall {
    /// The new state given the oldest write in flight; `Some` when it changed.
    fn judge(&mut self, oldest: Option<(DiskWrite, Duration)>) -> Option<bool> {
        let stalled = oldest.is_some_and(|(_, age)| age >= self.after);
        (stalled != self.stalled).then(|| {
            self.stalled = stalled;
            stalled
        })
    }
}

/// Runs the check until the returned handle is dropped.
pub fn spawn(
    watch: Arc<DiskWatch>,
    after: Duration,
    step_back: StepBack,
    metrics: Arc<crate::metrics::Metrics>,
) -> Result<Monitor, String> {
    let stop = Arc::new(AtomicBool::new(false));
    let stopped = stop.clone();
    std::thread::Builder::new()
        .name("disk-stall".into())
        .spawn(move || {
            let mut stall = Stall {
                after,
                stalled: false,
            };
            let mut since: Option<(DiskWrite, Duration)> = None;
            while !stopped.load(Ordering::Relaxed) {
                let oldest = watch.oldest();
                metrics
                    .disk_write_in_flight
                    .set(oldest.map_or(0.0, |(_, age)| age.as_secs_f64()));
                // Act first, then say so: the log may be written to the stalled disk.
                match stall.judge(oldest) {
                    Some(true) => {
                        watch.set_stalled(true);
                        metrics.disk_stalled.set(1);
                        (step_back.heartbeats)(false);
                        (step_back.elections)(true);
                        let (which, age) = oldest.unwrap_or((DiskWrite::RaftLog, after));
                        since = oldest;
                        tracing::warn!(
                            write = which.name(),
                            waited_ms = age.as_millis() as u64,
                            "the disk has not finished a write: this node steps back (no \
                             heartbeats, no elections, no heads rounds, 503 to what it \
                             would serve itself) until it does"
                        );
                    }
                    Some(false) => {
                        watch.set_stalled(false);
                        metrics.disk_stalled.set(0);
                        (step_back.heartbeats)(true);
                        (step_back.elections)(false);
                        tracing::info!(
                            write = since.map_or("", |(w, _)| w.name()),
                            "the disk answers again: this node takes part again"
                        );
                    }
                    None => {}
                }
                std::thread::sleep(CHECK_EVERY);
            }
        })
        .map_err(|e| format!("cannot start the disk stall check: {e}"))?;
    Ok(Monitor { stop })
}

/// Stops the check when dropped (at shutdown).
pub struct Monitor {
    stop: Arc<AtomicBool>,
}

impl Drop for Monitor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_older_than_the_limit_is_a_stall_until_none_is() {
        let mut stall = Stall {
            after: Duration::from_secs(5),
            stalled: false,
        };
        let log = |ms| Some((DiskWrite::RaftLog, Duration::from_millis(ms)));
        assert_eq!(stall.judge(None), None);
        assert_eq!(stall.judge(log(4_999)), None, "slow, not stalled");
        assert_eq!(stall.judge(log(5_000)), Some(true));
        assert_eq!(stall.judge(log(9_000)), None, "said once");
        // The stalled write returned and a new one is young: the disk answers.
        assert_eq!(stall.judge(log(10)), Some(false));
        assert_eq!(stall.judge(None), None);
        assert_eq!(
            stall.judge(Some((DiskWrite::StateFile, Duration::from_secs(6)))),
            Some(true)
        );
        assert_eq!(stall.judge(None), Some(false));
    }
}
