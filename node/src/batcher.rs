//! Group commit on the leader: writes decided concurrently (for different agents) are
//! collected into one Raft entry. While a batch is being committed the next one fills,
//! so batches grow with load and each costs one log append on every node.

use std::sync::Arc;

use tokio::sync::{mpsc, oneshot, Semaphore};

use crate::raft_types::{AppendRecords, ApplyOutcome, Batch, Proposal, Raft};
use openraft::error::{ClientWriteError, RaftError};

/// Most writes in one Raft entry.
const MAX_BATCH_WRITES: usize = 512;
/// Writes waiting for a batch; a full queue makes callers wait (backpressure).
const MAX_QUEUED_WRITES: usize = 8192;
/// Batches being committed at once.
const MAX_BATCHES_IN_FLIGHT: usize = 1;

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
}

impl Batcher {
    pub fn spawn(raft: Raft) -> Self {
        let (queue, receiver) = mpsc::channel(MAX_QUEUED_WRITES);
        tokio::spawn(run(raft, receiver));
        Batcher { queue }
    }

    /// Proposes one write and waits until it is applied on this node.
    pub async fn write(&self, append: AppendRecords) -> Result<ApplyOutcome, WriteError> {
        let (reply, answer) = oneshot::channel();
        self.queue
            .send((append, reply))
            .await
            .map_err(|_| WriteError::Failed("the node is shutting down".into()))?;
        answer
            .await
            .map_err(|_| WriteError::Failed("the write was dropped".into()))?
    }
}

async fn run(raft: Raft, mut receiver: mpsc::Receiver<(AppendRecords, Reply)>) {
    let in_flight = Arc::new(Semaphore::new(MAX_BATCHES_IN_FLIGHT));
    while let Some(first) = receiver.recv().await {
        // Wait for a commit slot first: writes arriving meanwhile join this batch.
        let Ok(permit) = in_flight.clone().acquire_owned().await else {
            return;
        };
        let mut appends = vec![first.0];
        let mut replies = vec![first.1];
        while appends.len() < MAX_BATCH_WRITES {
            match receiver.try_recv() {
                Ok((append, reply)) => {
                    appends.push(append);
                    replies.push(reply);
                }
                Err(_) => break,
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
