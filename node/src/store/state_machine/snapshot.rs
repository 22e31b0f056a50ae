//! Snapshots: the whole state as one JSON body, built from the committed tables.

use std::collections::BTreeMap;
use std::io::Cursor;

use openraft::storage::Snapshot;
use openraft::{BasicNode, RaftSnapshotBuilder, SnapshotMeta};
use redb::ReadableTable;
use serde::{Deserialize, Serialize};

use super::super::heads::{HeadsLog, HeadsSnapshot};
use super::super::{idempotency_rows, record_rows};
use super::{sm_read_err, StateMachine, IDEMPOTENCY, RECORDS};
use crate::raft_types::{IdempotentAnswer, NodeId, StorageError, TypeConfig};

/// The whole state machine as a snapshot carries it.
#[derive(Serialize, Deserialize)]
pub(super) struct SnapshotBody {
    pub(super) records: BTreeMap<String, Vec<String>>,
    pub(super) idempotency: Vec<(String, IdempotentAnswer)>,
    #[serde(default)]
    pub(super) heads: HeadsSnapshot,
}

/// The last snapshot built or installed, served to followers that need one.
pub(super) type StoredSnapshot = (SnapshotMeta<NodeId, BasicNode>, Vec<u8>);

impl StateMachine {
    /// The whole state as committed; callers hold the data lock, so after the flush the
    /// tables hold exactly what memory does.
    pub(super) fn snapshot_body(&self) -> Result<Vec<u8>, StorageError> {
        self.flush()?;
        let txn = self.db.begin_read().map_err(sm_read_err)?;
        let records = txn.open_table(RECORDS).map_err(sm_read_err)?;
        let mut body = SnapshotBody {
            records: BTreeMap::new(),
            idempotency: Vec::new(),
            heads: HeadsLog::snapshot(&txn).map_err(sm_read_err)?,
        };
        record_rows::visit_all(&records, |agent, seq, line| {
            let lines = body.records.entry(agent.to_string()).or_default();
            // Snapshots carry each agent's records from seq 0 without a gap.
            if seq != lines.len() as u64 {
                return Err(format!("{agent}: stored records jump to seq {seq}"));
            }
            lines.push(line.to_string());
            Ok(())
        })
        .map_err(|e| sm_read_err(std::io::Error::other(e)))?;
        let idem = txn.open_table(IDEMPOTENCY).map_err(sm_read_err)?;
        for item in idem.iter().map_err(sm_read_err)? {
            let (key, value) = item.map_err(sm_read_err)?;
            let scoped = key
                .value()
                .split_once('\n')
                .map_or("", |(_agent, scoped)| scoped);
            // One damaged row must not stop every snapshot (and with it the node): it
            // travels as an answer that refuses, as it is refused here.
            let answer = idempotency_rows::decode(value.value(), scoped).unwrap_or_else(|e| {
                tracing::error!(key = %key.value(), error = %e, "stored idempotent answer damaged");
                idempotency_rows::damaged(scoped, &e)
            });
            body.idempotency.push((key.value().to_string(), answer));
        }
        serde_json::to_vec(&body).map_err(sm_read_err)
    }
}

impl RaftSnapshotBuilder<TypeConfig> for StateMachine {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, StorageError> {
        // Logs up to this snapshot may be purged next: make the applied state durable,
        // with fresh checkpoints so a restart replays only what follows.
        self.checkpoint_agents()?;
        // Hold the data lock so the snapshot and its log id describe the same state.
        let (meta, bytes) = {
            let data = self.read_data();
            let bytes = self.snapshot_body()?;
            let snapshot_id = match data.last_applied {
                Some(id) => format!("{}-{}", id.leader_id, id.index),
                None => "empty".to_string(),
            };
            let meta = SnapshotMeta {
                last_log_id: data.last_applied,
                last_membership: data.membership.clone(),
                snapshot_id,
            };
            (meta, bytes)
        };
        *self
            .current_snapshot
            .write()
            .unwrap_or_else(|p| p.into_inner()) = Some((meta.clone(), bytes.clone()));
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(bytes)),
        })
    }
}
