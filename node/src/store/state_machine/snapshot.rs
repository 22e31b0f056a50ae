//! Snapshots: the whole state as one JSON body, written from the committed tables when a
//! follower needs one. Building a snapshot only checkpoints and notes the point; no copy
//! of the records is kept beside the tables.

use std::collections::BTreeMap;
use std::io::{Cursor, Write};

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
    /// The system log's lines.
    #[serde(default)]
    pub(super) system: Vec<String>,
    /// Agents still being imported (their records are in `records`).
    #[serde(default)]
    pub(super) imports: Vec<(String, crate::raft_types::ImportManifest)>,
    /// Ids reserved for good (`store::imports`).
    #[serde(default)]
    pub(super) tombstones: Vec<(String, crate::raft_types::Tombstone)>,
    /// Imported agents' figures at their imports' commits.
    #[serde(default)]
    pub(super) import_points: Vec<(String, super::super::imports::ImportPoint)>,
}

/// One value as JSON onto `out`.
fn json(out: &mut impl Write, value: &impl Serialize) -> Result<(), String> {
    serde_json::to_writer(out, value).map_err(|e| e.to_string())
}

/// Writes the snapshot body, the JSON of [`SnapshotBody`] byte for byte, straight from a
/// read transaction: rows go out as they are read, so memory never holds the whole state
/// (only the heads log's leaves, which grow with rounds, not records).
pub(super) fn write_body(txn: &redb::ReadTransaction, out: &mut impl Write) -> Result<(), String> {
    let io = |e: std::io::Error| e.to_string();
    let records = txn.open_table(RECORDS).map_err(|e| e.to_string())?;
    out.write_all(b"{\"records\":{").map_err(io)?;
    let mut current: Option<(String, u64)> = None;
    record_rows::visit_all(&records, |agent, seq, line| {
        match &mut current {
            Some((name, next)) if name == agent => {
                // Snapshots carry each agent's records from seq 0 without a gap.
                if seq != *next {
                    return Err(format!("{agent}: stored records jump to seq {seq}"));
                }
                out.write_all(b",").map_err(io)?;
                *next += 1;
            }
            _ => {
                if seq != 0 {
                    return Err(format!("{agent}: stored records start at seq {seq}"));
                }
                if current.is_some() {
                    out.write_all(b"],").map_err(io)?;
                }
                json(out, &agent)?;
                out.write_all(b":[").map_err(io)?;
                current = Some((agent.to_string(), 1));
            }
        }
        json(out, &line)
    })?;
    if current.is_some() {
        out.write_all(b"]").map_err(io)?;
    }
    out.write_all(b"},\"idempotency\":[").map_err(io)?;
    let idem = txn.open_table(IDEMPOTENCY).map_err(|e| e.to_string())?;
    for (n, item) in idem.iter().map_err(|e| e.to_string())?.enumerate() {
        let (key, value) = item.map_err(|e| e.to_string())?;
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
        out.write_all(if n == 0 { b"[" } else { b",[" })
            .map_err(io)?;
        json(out, &key.value())?;
        out.write_all(b",").map_err(io)?;
        json(out, &answer)?;
        out.write_all(b"]").map_err(io)?;
    }
    out.write_all(b"],\"heads\":").map_err(io)?;
    let heads = HeadsLog::snapshot(txn).map_err(|e| e.to_string())?;
    json(out, &heads)?;
    // Written only when there is one, so a cluster without operators keeps the body
    // older versions wrote (and read).
    let system = super::super::system_log::lines(txn, 0, usize::MAX)?;
    if !system.is_empty() {
        out.write_all(b",\"system\":").map_err(io)?;
        json(out, &system)?;
    }
    let imports = super::super::imports::markers(txn)?;
    if !imports.is_empty() {
        out.write_all(b",\"imports\":").map_err(io)?;
        json(out, &imports)?;
    }
    let tombstones = super::super::imports::tombstones(txn)?;
    if !tombstones.is_empty() {
        out.write_all(b",\"tombstones\":").map_err(io)?;
        json(out, &tombstones)?;
    }
    let points = super::super::imports::import_points(txn)?;
    if !points.is_empty() {
        out.write_all(b",\"import_points\":").map_err(io)?;
        json(out, &points)?;
    }
    out.write_all(b"}").map_err(io)?;
    Ok(())
}

impl StateMachine {
    /// Fixes the state to snapshot: under the data lock, only long enough to flush (so the
    /// tables hold what memory does) and open a read transaction, which keeps that view
    /// while the body is written without the lock. (openraft asks for the current snapshot
    /// from its state machine task, so applies wait while a body is written: about as long
    /// as reading and hashing the body file took before.)
    fn fixed_view(
        &self,
    ) -> Result<(SnapshotMeta<NodeId, BasicNode>, redb::ReadTransaction), StorageError> {
        let data = self.read_data();
        self.flush()?;
        let txn = self.db.begin_read().map_err(sm_read_err)?;
        let snapshot_id = match data.last_applied {
            Some(id) => format!("{}-{}", id.leader_id, id.index),
            None => "empty".to_string(),
        };
        let meta = SnapshotMeta {
            last_log_id: data.last_applied,
            last_membership: data.membership.clone(),
            snapshot_id,
        };
        Ok((meta, txn))
    }

    /// Records that a snapshot as new as `meta` exists (built, or installed from a
    /// leader), unless a newer one already does: a build runs beside installs.
    pub(super) fn note_snapshot(&self, meta: &SnapshotMeta<NodeId, BasicNode>) {
        let mut latest = self
            .latest_snapshot
            .write()
            .unwrap_or_else(|p| p.into_inner());
        if latest
            .as_ref()
            .is_none_or(|newer| newer.last_log_id <= meta.last_log_id)
        {
            *latest = Some(meta.clone());
        }
    }

    /// The snapshot a follower is sent: the body is written now, from the state as it is
    /// now, so no second copy of the records is ever kept on disk. Its meta names the
    /// applied id it was written at, which is never older than the last snapshot built
    /// (and so never behind the log's purge point). `None` until a snapshot was built or
    /// installed in this process: start-up asks for one only to learn its meta, and
    /// openraft builds one (cheap: a checkpoint) when the log was purged.
    pub(super) async fn snapshot_now(&self) -> Result<Option<Snapshot<TypeConfig>>, StorageError> {
        if self
            .latest_snapshot
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .is_none()
        {
            return Ok(None);
        }
        let (meta, txn) = self.fixed_view()?;
        let failed = |e: String| {
            StorageError::from(openraft::StorageIOError::read_snapshot(
                Some(meta.signature()),
                openraft::AnyError::error(e),
            ))
        };
        let bytes = tokio::task::spawn_blocking(move || {
            let mut bytes = Vec::new();
            write_body(&txn, &mut bytes).map(|()| bytes)
        })
        .await
        .map_err(|e| failed(e.to_string()))?
        .map_err(failed)?;
        Ok(Some(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(bytes)),
        }))
    }
}

impl RaftSnapshotBuilder<TypeConfig> for StateMachine {
    /// A snapshot here is a point the state machine has made durable, after which openraft
    /// may purge the log: the body is written only when a follower needs it
    /// (`snapshot_now`).
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, StorageError> {
        // Fresh checkpoints, so a restart replays only what follows.
        self.checkpoint_agents()?;
        // Small record rows of every agent into full runs, once per snapshot.
        self.merge_record_runs(true)?;
        let (meta, txn) = self.fixed_view()?;
        drop(txn);
        // openraft may purge the log up to this point once this returns: the point must
        // survive a power loss in redb, not only in a commit made without an fsync.
        self.make_durable()?;
        self.note_snapshot(&meta);
        // openraft keeps only the meta of a snapshot it asked to build.
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(Vec::new())),
        })
    }
}
