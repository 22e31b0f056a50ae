//! The leader's write path for the system log: operator changes one at a time, each
//! decided on the applied registry, sealed with the audit key, proposed as an entry of
//! its own and answered once applied (`store::system_log` keeps it).
//!
//! Interrupted anywhere, nothing is half done: before the proposal nothing was written;
//! after it, the entry commits or not as a whole, and a retried add of the same operator
//! (same name, role and token hash) is answered as done without a second record.

use lineage_core::operators::{Change, ChangeError};
use lineage_core::record::timestamp;
use lineage_core::AuditKey;

use crate::raft_types::{ApplyOutcome, Proposal, Raft, RecordLine};
use crate::store::StateMachine;

/// Why a change was not made.
#[derive(Debug, thiserror::Error)]
pub enum ChangeFailed {
    /// The registry refuses it; nothing was proposed.
    #[error(transparent)]
    Refused(#[from] ChangeError),
    /// It did not commit (leadership moved, no quorum): retry.
    #[error("the operator change did not commit: {0}; retry")]
    NotCommitted(String),
    /// Decided on a registry that was behind the log: refused at apply, retry.
    #[error("the operator change was decided on stale state ({0}); retry")]
    Stale(String),
    #[error("{0}")]
    Internal(String),
}

/// One change at a time on this leader: each is decided on the state the one before
/// left (a stale leader's change fails the chain check at apply instead).
#[derive(Default)]
pub struct OperatorChanges {
    turn: tokio::sync::Mutex<()>,
}

impl OperatorChanges {
    /// Makes `change`, asked for by `by`; once this returns, this node has applied it.
    /// The caller has confirmed this node leads with everything committed applied.
    pub async fn apply(
        &self,
        raft: &Raft,
        sm: &StateMachine,
        key: &AuditKey,
        change: Change,
        by: &str,
    ) -> Result<(), ChangeFailed> {
        let _turn = self.turn.lock().await;
        let records = {
            let data = sm.read_data();
            match data.operators.decide(&change, by, key.public_key_hex())? {
                Some(drafts) => data.operators.seal(drafts, key, timestamp::now_micros()),
                None => Vec::new(),
            }
        };
        if !records.is_empty() {
            let lines = records
                .into_iter()
                .map(RecordLine::new)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| ChangeFailed::Internal(e.to_string()))?;
            let response = raft
                .client_write(Proposal::System { records: lines })
                .await
                .map_err(|e| ChangeFailed::NotCommitted(e.to_string()))?;
            match response.data.0.first() {
                Some(ApplyOutcome::Applied) => {}
                Some(ApplyOutcome::Rejected(reason)) => {
                    return Err(ChangeFailed::Stale(reason.clone()))
                }
                None => return Err(ChangeFailed::Internal("no outcome for the change".into())),
            }
        }
        Ok(())
    }
}
