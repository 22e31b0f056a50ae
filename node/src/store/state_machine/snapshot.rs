//! Snapshots: the whole state as one JSON body, written from the committed tables into a
//! file as the rows are read, and read back only when a follower needs it.

use std::collections::BTreeMap;
use std::io::{Cursor, Write};
use std::path::PathBuf;

use openraft::storage::Snapshot;
use openraft::{BasicNode, RaftSnapshotBuilder, SnapshotMeta};
use redb::ReadableTable;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

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

/// The last snapshot built or installed, served to followers that need one: its meta,
/// and its body in a file (or, for a state machine opened without a directory, memory).
pub(super) struct StoredSnapshot {
    pub(super) meta: SnapshotMeta<NodeId, BasicNode>,
    pub(super) body: SnapshotBytes,
}

pub(super) enum SnapshotBytes {
    Memory(Vec<u8>),
    /// The file, and the SHA-256 of what was written to it (kept in memory: the file
    /// never outlives this process, since start-up empties the snapshot directory).
    File(PathBuf, [u8; 32]),
}

impl StoredSnapshot {
    /// The body, read back for a follower that needs it (callers hold the snapshot lock,
    /// so a newer snapshot cannot remove the file meanwhile). A file whose bytes are not
    /// the ones written (flipped, zeroed, cut short) is an error, never a smaller
    /// snapshot: openraft stops on it, the node restarts and builds a new one.
    pub(super) fn bytes(&self) -> Result<Vec<u8>, StorageError> {
        let failed = |e: String| {
            StorageError::from(openraft::StorageIOError::read_snapshot(
                Some(self.meta.signature()),
                openraft::AnyError::error(e),
            ))
        };
        match &self.body {
            SnapshotBytes::Memory(bytes) => Ok(bytes.clone()),
            SnapshotBytes::File(path, digest) => {
                let bytes =
                    std::fs::read(path).map_err(|e| failed(format!("{}: {e}", path.display())))?;
                if <[u8; 32]>::from(Sha256::digest(&bytes)) != *digest {
                    return Err(failed(format!(
                        "{}: the snapshot file is not what was written ({} bytes read)",
                        path.display(),
                        bytes.len()
                    )));
                }
                Ok(bytes)
            }
        }
    }
}

/// A writer that hashes what passes through it.
struct Hashing<W> {
    inner: W,
    hasher: Sha256,
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
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

/// A new file name for a snapshot body: never the current one's, which a follower may be
/// reading (the same snapshot id can be built twice).
fn snapshot_file(dir: &std::path::Path, meta: &SnapshotMeta<NodeId, BasicNode>) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    dir.join(format!("snapshot-{}-{n}.json", meta.snapshot_id))
}

impl StateMachine {
    /// Writes the state that `txn` sees as the snapshot `meta` names: into a new file in
    /// the snapshot directory (the one before it is removed once this one is current),
    /// or into memory without one.
    fn store_snapshot(
        &self,
        meta: &SnapshotMeta<NodeId, BasicNode>,
        txn: &redb::ReadTransaction,
    ) -> Result<StoredSnapshot, StorageError> {
        let failed = |e: String| {
            StorageError::from(openraft::StorageIOError::write_snapshot(
                Some(meta.signature()),
                openraft::AnyError::error(e),
            ))
        };
        let body = match &self.snapshot_dir {
            None => {
                let mut bytes = Vec::new();
                write_body(txn, &mut bytes).map_err(failed)?;
                SnapshotBytes::Memory(bytes)
            }
            Some(dir) => {
                let path = snapshot_file(dir, meta);
                let written = std::fs::File::create(&path)
                    .map_err(|e| e.to_string())
                    .and_then(|file| {
                        let mut out = Hashing {
                            inner: std::io::BufWriter::with_capacity(1 << 20, file),
                            hasher: Sha256::new(),
                        };
                        write_body(txn, &mut out)?;
                        out.flush().map_err(|e| e.to_string())?;
                        Ok(out.hasher.finalize().into())
                    });
                match written {
                    Ok(digest) => SnapshotBytes::File(path, digest),
                    Err(e) => {
                        // A part-written body would only take disk space (a full disk, say).
                        let _ = std::fs::remove_file(&path);
                        return Err(failed(e));
                    }
                }
            }
        };
        Ok(StoredSnapshot {
            meta: meta.clone(),
            body,
        })
    }

    /// Makes `stored` the snapshot served to followers, unless a newer one is already
    /// current (a build runs beside installs: a snapshot received while an older one was
    /// being written must stay), and removes the file of the one that lost (after the
    /// swap, which waits for a reader: readers hold the lock).
    pub(super) fn set_current_snapshot(&self, stored: StoredSnapshot) {
        let loser = {
            let mut current = self
                .current_snapshot
                .write()
                .unwrap_or_else(|p| p.into_inner());
            match current.as_ref() {
                Some(newer) if newer.meta.last_log_id > stored.meta.last_log_id => Some(stored),
                _ => current.replace(stored),
            }
        };
        if let Some(StoredSnapshot {
            body: SnapshotBytes::File(old, _),
            ..
        }) = loser
        {
            let _ = std::fs::remove_file(old);
        }
    }

    /// Keeps a received snapshot's body as the current one (in its file, when there is a
    /// snapshot directory, so memory lets it go).
    pub(super) fn keep_installed(
        &self,
        meta: &SnapshotMeta<NodeId, BasicNode>,
        bytes: Vec<u8>,
    ) -> Result<(), StorageError> {
        let body = match &self.snapshot_dir {
            None => SnapshotBytes::Memory(bytes),
            Some(dir) => {
                let path = snapshot_file(dir, meta);
                std::fs::write(&path, &bytes).map_err(|e| {
                    StorageError::from(openraft::StorageIOError::write_snapshot(
                        Some(meta.signature()),
                        openraft::AnyError::new(&e),
                    ))
                })?;
                SnapshotBytes::File(path, Sha256::digest(&bytes).into())
            }
        };
        self.set_current_snapshot(StoredSnapshot {
            meta: meta.clone(),
            body,
        });
        Ok(())
    }
}

impl RaftSnapshotBuilder<TypeConfig> for StateMachine {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, StorageError> {
        // Logs up to this snapshot may be purged next: make the applied state durable,
        // with fresh checkpoints so a restart replays only what follows.
        self.checkpoint_agents()?;
        // Under the data lock, only long enough to fix the state: flushed, the tables
        // hold what memory does, and a read transaction keeps that view while the body
        // is written without the lock (applies carry on meanwhile).
        let (meta, txn) = {
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
            (meta, txn)
        };
        let sm = self.clone();
        let for_writer = meta.clone();
        let stored = tokio::task::spawn_blocking(move || sm.store_snapshot(&for_writer, &txn))
            .await
            .map_err(|e| sm_read_err(std::io::Error::other(e.to_string())))??;
        self.set_current_snapshot(stored);
        // openraft keeps only the meta of a snapshot it asked to build; followers get the
        // body from `get_current_snapshot`.
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(Vec::new())),
        })
    }
}
