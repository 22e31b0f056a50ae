//! The leader's heads-log clock: every interval, if some agent's log grew since its last
//! head statement, propose a round. Followers do nothing; a new leader picks up where
//! the old one stopped, since what is pending is derived from the applied state.

use std::sync::Arc;
use std::time::Duration;

use crate::disk_reserve::DiskReserve;
use crate::disk_watch::DiskWatch;
use crate::raft_types::{NodeId, Proposal, Raft};
use crate::store::StateMachine;

/// Default interval between heads rounds.
pub const DEFAULT_HEADS_INTERVAL_MS: u64 = 1000;

pub fn spawn(
    raft: Raft,
    sm: StateMachine,
    disk: DiskReserve,
    disk_watch: Arc<DiskWatch>,
    id: NodeId,
    origin: String,
    interval: Duration,
) {
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            let leading = raft.metrics().borrow().current_leader == Some(id);
            // A stalled disk (`disk_stall`): a round would be one more entry whose
            // replication renews the followers' leases, and its apply would wait anyway.
            if !leading || disk_watch.stalled() || sm.read_data().heads.pending.is_empty() {
                continue;
            }
            if let Err(full) = disk.check() {
                // The round waits for space like every write (`disk_reserve`).
                tracing::debug!(%full, "heads round postponed");
                continue;
            }
            let round = Proposal::HeadsRound {
                origin: origin.clone(),
            };
            if let Err(e) = raft.client_write(round).await {
                // Lost leadership or shutting down: the next leader's clock takes over.
                tracing::debug!(error = %e, "heads round not committed");
            }
        }
    });
}
