//! The leader's side of importing a reference guard's agent logs (`store::imports` has
//! the rules every node applies): each step checked here first, for a clear answer, then
//! proposed as its own Raft entry and answered once applied. The commit seals the
//! termination record the reference would have added on opening the log, if it is
//! missing, with the cluster's key, stamped no earlier than the last imported record.

use lineage_core::guard::{missing_termination, seal};
use lineage_core::record::timestamp;
use lineage_core::{AuditKey, Record};

use crate::raft_types::{ApplyOutcome, ImportStep, Proposal, Raft, RecordLine};
use crate::store::StateMachine;

/// Why a step was not taken.
#[derive(Debug, thiserror::Error)]
pub enum ImportFailed {
    /// The step does not hold (refused here or at apply); nothing changed.
    #[error("{0}")]
    Refused(String),
    #[error("the import step did not commit: {0}; retry")]
    NotCommitted(String),
    #[error("{0}")]
    Internal(String),
}

/// Where an agent's import stands on this node.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ImportStatus {
    /// `absent`, `importing`, `active`, `quarantined` or `tombstoned`.
    pub state: &'static str,
    pub next_seq: u64,
    pub head: Option<lineage_core::Head>,
    /// What the import under way said it brings.
    pub manifest: Option<crate::raft_types::ImportManifest>,
}

/// One import step at a time on this leader.
#[derive(Default)]
pub struct ImportWrites {
    turn: tokio::sync::Mutex<()>,
}

impl ImportWrites {
    /// Takes `step` (the caller has confirmed this node leads, caught up). Returns the
    /// records the commit sealed (none for other steps).
    pub async fn take(
        &self,
        raft: &Raft,
        sm: &StateMachine,
        key: &AuditKey,
        step: ImportStep,
    ) -> Result<Vec<Record>, ImportFailed> {
        let _turn = self.turn.lock().await;
        let (step, sealed) = prepare(sm, key, step)?;
        let response = raft
            .client_write(Proposal::Import(step))
            .await
            .map_err(|e| ImportFailed::NotCommitted(e.to_string()))?;
        match response.data.0.first() {
            Some(ApplyOutcome::Applied) => Ok(sealed),
            Some(ApplyOutcome::Rejected(reason)) => Err(ImportFailed::Refused(reason.clone())),
            None => Err(ImportFailed::Internal(
                "no outcome for the import step".into(),
            )),
        }
    }
}

/// The checks only the leader can make (the cluster's key), and the commit's sealed
/// termination.
fn prepare(
    sm: &StateMachine,
    key: &AuditKey,
    step: ImportStep,
) -> Result<(ImportStep, Vec<Record>), ImportFailed> {
    let refused = |reason: String| ImportFailed::Refused(reason);
    match step {
        ImportStep::Records { agent_id, records } => {
            // Only a batch's first record can be the genesis (the rest must follow it).
            if let Some(line) = records.first() {
                let record = line.record().map_err(refused)?;
                if record.seq == 0 {
                    let genesis_key = record
                        .payload
                        .get("public_key")
                        .and_then(serde_json::Value::as_str)
                        .unwrap_or_default();
                    if !genesis_key.eq_ignore_ascii_case(key.public_key_hex()) {
                        return Err(refused(format!(
                            "{agent_id}'s log is signed by {genesis_key}, not by this cluster's \
                             audit key {}: it cannot be continued under lineage-audit-v1",
                            key.public_key_hex()
                        )));
                    }
                }
            }
            Ok((ImportStep::Records { agent_id, records }, Vec::new()))
        }
        ImportStep::Commit { agent_id, head, .. } => {
            let data = sm.read_data();
            let importing = data
                .imports
                .get(&agent_id)
                .ok_or_else(|| refused(format!("no import of {agent_id} is under way")))?;
            let sealed = match missing_termination(&importing.state) {
                Some(draft) => seal(&importing.state, vec![draft], key, timestamp::now_micros()),
                None => Vec::new(),
            };
            let lines = sealed
                .iter()
                .cloned()
                .map(RecordLine::new)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| ImportFailed::Internal(e.to_string()))?;
            Ok((
                ImportStep::Commit {
                    agent_id,
                    head,
                    sealed: lines,
                },
                sealed,
            ))
        }
        other @ (ImportStep::Begin { .. }
        | ImportStep::Tombstone { .. }
        | ImportStep::Abort { .. }) => Ok((other, Vec::new())),
    }
}

/// Where `agent_id`'s import stands on this node.
pub fn status(sm: &StateMachine, agent_id: &str) -> ImportStatus {
    use crate::store::AgentSlot;
    let data = sm.read_data();
    if data.tombstones.contains_key(agent_id) {
        return ImportStatus {
            state: "tombstoned",
            next_seq: 0,
            head: None,
            manifest: None,
        };
    }
    if let Some(importing) = data.imports.get(agent_id) {
        return ImportStatus {
            state: "importing",
            next_seq: importing.state.next_seq(),
            head: importing.state.head.clone(),
            manifest: Some(importing.manifest.clone()),
        };
    }
    match data.agents.get(agent_id) {
        Some(AgentSlot::Active(state)) => ImportStatus {
            state: "active",
            next_seq: state.next_seq(),
            head: state.head.clone(),
            manifest: None,
        },
        Some(AgentSlot::Quarantined(_)) => ImportStatus {
            state: "quarantined",
            next_seq: 0,
            head: None,
            manifest: None,
        },
        None => ImportStatus {
            state: "absent",
            next_seq: 0,
            head: None,
            manifest: None,
        },
    }
}
