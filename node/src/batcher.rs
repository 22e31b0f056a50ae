//! Group commit on the leader: writes decided concurrently (for different agents) are
//! collected into one Raft entry. While a batch is being committed the next one fills,
//! so batches grow with load and each costs one log append on every node.
//!
//! Cohorts: with one batch in flight, N writers settle into two halves that take turns
//! (one half is queued while the other's batch commits, and the first half comes back
//! just after the second has been cut). Every batch has a fixed cost on every node (a
//! log append and fsync, two Raft round trips, wake-ups), so two half batches cost
//! nearly twice one full one. So when a batch is cut with fewer writes than were pending
//! during the last commit (the writers that are about to come back), the batcher waits
//! for them, at most `COHORT_LINGER`. If they do not come, the wait stops and the next
//! target is what was pending meanwhile, so one slow writer costs one linger, not one
//! per batch; a single writer sending one request after another never waits.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, Semaphore};

use crate::raft_types::{AppendRecords, ApplyOutcome, Batch, Proposal, Raft};
use openraft::error::{ClientWriteError, RaftError};

/// Most writes in one Raft entry.
const MAX_BATCH_WRITES: usize = 512;
/// A batch takes no more writes once it holds this many bytes, so that one entry fits
/// well within an AppendEntries (`raft_client`).
const MAX_BATCH_BYTES: usize = 128 * 1024;
/// Writes waiting for a batch; a full queue makes callers wait (backpressure).
const MAX_QUEUED_WRITES: usize = 8192;
/// Batches being committed at once.
const MAX_BATCHES_IN_FLIGHT: usize = 1;
// Each batch's `client_write` runs on a task of its own; with one in flight, batches reach
// Raft in the order they were cut, and so one agent's writes in the order its lane queued
// them (`agent_lanes`). With more, a later batch could overtake an earlier one, and every
// pipelined write behind the swap would be rejected at apply: order the proposals first.
// Tried (2026-12-07): batches handed to Raft in order (`client_write_ff` from this loop)
// with two in flight gave 0.999x decisions/s on one node and 0.943x on three (16 clients
// over 16 agents, three alternating rounds): one batch already carries every pending
// write (16 decisions a log write), so a second finds nothing to take. Without the
// cohort linger below (one sitting, 2026-12-07, one node, three alternating rounds):
// 0.923x with one batch in flight, 0.915x with two handed over in order; batches fell to
// 14.5 and 11.7 writes and CPU per decision rose (147 against 139 us): the fixed cost of
// a batch outweighs overlapping one batch's log write with the next one's deciding.
const _: () = assert!(MAX_BATCHES_IN_FLIGHT == 1);
/// Longest wait for writers expected back before a batch is proposed.
const COHORT_LINGER: Duration = Duration::from_millis(1);

#[derive(Debug, Clone)]
pub enum WriteError {
    /// This node is not (or no longer) the leader; the write may or may not commit.
    NotLeader,
    Failed(String),
}

type Reply = oneshot::Sender<Result<ApplyOutcome, WriteError>>;

#[derive(Clone)]
pub struct Batcher {
    queue: mpsc::Sender<(AppendRecords, Reply)>,
    pending: Arc<Pending>,
}

/// Writes between `Batcher::write` being called and answered.
#[derive(Default)]
struct Pending {
    now: AtomicUsize,
    /// The most pending at once since the last batch was cut.
    peak: AtomicUsize,
}

/// Counts one write as pending for as long as it lives (also when its caller gives up).
struct PendingWrite(Arc<Pending>);

impl PendingWrite {
    fn new(pending: &Arc<Pending>) -> Self {
        let now = pending.now.fetch_add(1, Ordering::Relaxed) + 1;
        pending.peak.fetch_max(now, Ordering::Relaxed);
        PendingWrite(pending.clone())
    }
}

/// A write in the queue: its outcome arrives once it is applied on this node (or fails).
pub struct Proposed {
    answer: oneshot::Receiver<Result<ApplyOutcome, WriteError>>,
    _pending: PendingWrite,
}

impl Proposed {
    pub async fn outcome(self) -> Result<ApplyOutcome, WriteError> {
        self.answer
            .await
            .map_err(|_| WriteError::Failed("the write was dropped".into()))?
    }
}

impl Drop for PendingWrite {
    fn drop(&mut self) {
        self.0.now.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Batcher {
    pub fn spawn(raft: Raft) -> Self {
        let (queue, receiver) = mpsc::channel(MAX_QUEUED_WRITES);
        let pending = Arc::new(Pending::default());
        tokio::spawn(run(raft, receiver, pending.clone()));
        Batcher { queue, pending }
    }

    /// Queues one write. Writes are proposed in the order they were queued: a caller
    /// that queues while it holds an agent's turn (`agent_lanes`) keeps that agent's
    /// writes in its order. Cancelling this leaves nothing queued.
    pub async fn propose(&self, append: AppendRecords) -> Result<Proposed, WriteError> {
        let pending = PendingWrite::new(&self.pending);
        let (reply, answer) = oneshot::channel();
        self.queue
            .send((append, reply))
            .await
            .map_err(|_| WriteError::Failed("the node is shutting down".into()))?;
        Ok(Proposed {
            answer,
            _pending: pending,
        })
    }
}

async fn run(
    raft: Raft,
    mut receiver: mpsc::Receiver<(AppendRecords, Reply)>,
    pending: Arc<Pending>,
) {
    let in_flight = Arc::new(Semaphore::new(MAX_BATCHES_IN_FLIGHT));
    while let Some(first) = receiver.recv().await {
        // Wait for a commit slot first: writes arriving meanwhile join this batch.
        let Ok(permit) = in_flight.clone().acquire_owned().await else {
            return;
        };
        let mut bytes = first.0.size();
        let mut appends = vec![first.0];
        let mut replies = vec![first.1];
        while appends.len() < MAX_BATCH_WRITES && bytes < MAX_BATCH_BYTES {
            match receiver.try_recv() {
                Ok((append, reply)) => {
                    bytes += append.size();
                    appends.push(append);
                    replies.push(reply);
                }
                Err(_) => break,
            }
        }
        // The writers pending during the last commit, less those in this batch, are
        // answered or about to be and will most likely write again at once.
        let expected = pending
            .peak
            .swap(pending.now.load(Ordering::Relaxed), Ordering::Relaxed)
            .min(MAX_BATCH_WRITES);
        if appends.len() < expected {
            let deadline = tokio::time::Instant::now() + COHORT_LINGER;
            while appends.len() < expected && bytes < MAX_BATCH_BYTES {
                match tokio::time::timeout_at(deadline, receiver.recv()).await {
                    Ok(Some((append, reply))) => {
                        bytes += append.size();
                        appends.push(append);
                        replies.push(reply);
                    }
                    Ok(None) | Err(_) => break,
                }
            }
        }
        let raft = raft.clone();
        tokio::spawn(async move {
            let result = raft
                .client_write(Proposal::Writes(Batch(Arc::new(appends))))
                .await;
            drop(permit);
            match result {
                Ok(response) => {
                    let outcomes = response.data.0;
                    for (i, reply) in replies.into_iter().enumerate() {
                        let outcome = outcomes
                            .get(i)
                            .cloned()
                            .ok_or_else(|| WriteError::Failed("no outcome for a write".into()));
                        let _ = reply.send(outcome);
                    }
                }
                Err(error) => {
                    let error = match error {
                        RaftError::APIError(ClientWriteError::ForwardToLeader(_)) => {
                            WriteError::NotLeader
                        }
                        other => WriteError::Failed(other.to_string()),
                    };
                    for reply in replies {
                        let _ = reply.send(Err(error.clone()));
                    }
                }
            }
        });
    }
}
