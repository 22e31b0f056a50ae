//! Snapshots: the whole state as one JSON body (`snapshot_body.rs`), written from the
//! committed tables when a follower needs one. Building a snapshot only checkpoints and
//! notes the point; no copy of the records is kept beside the tables.
//!
//! A body goes through a spool file, never through memory whole: the leader writes it
//! into one (on a blocking thread, while openraft already holds it: `snapshot_spool`)
//! and openraft sends it from there in chunks; a follower receives the chunks
//! into one and installs from it as it parses. A spool has no name (it is freed when
//! closed, and by a crash) and lives in the data directory, not in `/tmp`, which may be
//! memory. Where that directory cannot take a body beside the disk reserve (the leader's
//! own writes need that space), or the spool there fails, the leader spools it in memory
//! instead: a snapshot that costs memory is better than a leader that cannot send, or
//! one whose log writes meet a full disk.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::Path;

use openraft::storage::Snapshot;
use openraft::{AnyError, BasicNode, RaftSnapshotBuilder, SnapshotMeta, StorageIOError};

use super::super::idempotency_expiry;
use super::snapshot_body::{install_body, write_body};
use super::{sm_read_err, sm_write_err, write_applied, StateMachine};
use crate::raft_types::{NodeId, StorageError, TypeConfig};
use crate::snapshot_spool::{BodySeal, RunningSeal, SnapshotSpool};

/// The buffer between a body and its spool, each way.
const SPOOL_BUFFER_BYTES: usize = 256 * 1024;

/// A new spool in `dir`: a file without a name.
pub(super) fn spool(dir: &Path) -> std::io::Result<File> {
    tempfile::tempfile_in(dir)
}

/// A spool in memory (a memfd), for when the data directory cannot take one.
pub(super) fn memory_spool() -> std::io::Result<File> {
    let fd = rustix::fs::memfd_create("lineage-snapshot", rustix::fs::MemfdFlags::CLOEXEC)?;
    Ok(File::from(fd))
}

/// Whether `dir` keeps `reserve` bytes free after a body of about `estimate` bytes: a
/// spool must not take the space the leader's own writes rely on (`disk_reserve`).
fn disk_can_take(dir: &Path, estimate: u64, reserve: u64) -> bool {
    rustix::fs::statvfs(dir).is_ok_and(|stats| {
        stats.f_bavail.saturating_mul(stats.f_frsize) >= estimate.saturating_add(reserve)
    })
}

/// Why a body could not be spooled.
enum SpoolError {
    /// The spool failed (made, written or flushed): another spool may do.
    Spool(String),
    /// The body could not be written from the tables: no spool would do better.
    Body(String),
}

/// A writer that remembers whether its file failed, to tell a spool's failure from the
/// body's, and hashes what it took, so the spool can be held to it when read back.
struct Watched<W> {
    inner: W,
    failed: bool,
    seal: RunningSeal,
}

impl<W: Write> Write for Watched<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let written = self.inner.write(buf);
        match &written {
            Ok(n) => self.seal.update(&buf[..*n]),
            Err(_) => self.failed = true,
        }
        written
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let flushed = self.inner.flush();
        self.failed |= flushed.is_err();
        flushed
    }
}

/// The body of `txn`'s state written into `spool`, rewound for reading, and its seal.
fn spool_body(
    txn: &redb::ReadTransaction,
    spool: std::io::Result<File>,
) -> Result<(File, BodySeal), SpoolError> {
    let spool = spool.map_err(|e| SpoolError::Spool(format!("cannot make a spool: {e}")))?;
    let mut out = Watched {
        inner: BufWriter::with_capacity(SPOOL_BUFFER_BYTES, spool),
        failed: false,
        seal: RunningSeal::default(),
    };
    if let Err(e) = write_body(txn, &mut out) {
        return Err(if out.failed {
            SpoolError::Spool(e)
        } else {
            SpoolError::Body(e)
        });
    }
    let mut spool = out
        .inner
        .into_inner()
        .map_err(|e| SpoolError::Spool(e.error().to_string()))?;
    spool
        .rewind()
        .map_err(|e| SpoolError::Spool(e.to_string()))?;
    Ok((spool, out.seal.seal()))
}

/// The body of `txn`'s state in a spool: on disk in `dir` when it has room for it beside
/// `reserve`, else (or when the disk spool fails) in memory.
fn spool_anywhere(
    txn: &redb::ReadTransaction,
    dir: &Path,
    estimate: u64,
    reserve: u64,
) -> Result<(File, BodySeal), String> {
    let on_disk = if disk_can_take(dir, estimate, reserve) {
        spool_body(txn, spool(dir))
    } else {
        Err(SpoolError::Spool(format!(
            "no room for about {estimate} bytes beside the {reserve}-byte reserve"
        )))
    };
    match on_disk {
        Ok(spool) => Ok(spool),
        Err(SpoolError::Body(e)) => Err(e),
        Err(SpoolError::Spool(e)) => {
            tracing::warn!(dir = %dir.display(), error = %e,
                "cannot spool a snapshot body on disk; spooling it in memory");
            spool_body(txn, memory_spool())
                .map_err(|(SpoolError::Spool(e) | SpoolError::Body(e))| e)
        }
    }
}

/// A reader that hashes what it reads, to hold a spool to its seal.
struct Sealing<R> {
    inner: R,
    seal: RunningSeal,
}

impl<R: Read> Read for Sealing<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.seal.update(&buf[..n]);
        Ok(n)
    }
}

impl StateMachine {
    /// Fixes the state to snapshot: under the data lock, only long enough to flush (so the
    /// tables hold what memory does) and open a read transaction, which keeps that view
    /// while the body is written without the lock (and off openraft's state machine task:
    /// `SnapshotSpool::written_by`).
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

    /// The last snapshot built or installed here; with none, a meta naming no entry.
    fn latest_snapshot_meta(&self) -> SnapshotMeta<NodeId, BasicNode> {
        self.latest_snapshot
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .unwrap_or_default()
    }

    /// The snapshot a follower is sent: the body is written now, from the state as it is
    /// now, so no second copy of the records is ever kept on disk. Its meta names the
    /// applied id it was written at, which is never older than the last snapshot built
    /// (and so never behind the log's purge point). `None` until a snapshot was built or
    /// installed in this process (or asked to be built below the disk reserve): start-up
    /// asks for one only to learn its meta, and openraft builds one (cheap: a checkpoint)
    /// when the log was purged.
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
        let dir = self.spool_dir.clone();
        let reserve = self.disk.reserve_bytes();
        // The body is about the records' size, which the state file bounds.
        let estimate = std::fs::metadata(dir.join(super::super::STATE_DB)).map_or(0, |m| m.len());
        // Written on a blocking thread while openraft already holds the spool: the send
        // waits for the body, the applies do not.
        let body = SnapshotSpool::written_by(move || {
            spool_anywhere(&txn, &dir, estimate, reserve).map_err(|e| {
                tracing::error!(error = %e, "cannot write a snapshot body");
                std::io::Error::other(e)
            })
        });
        Ok(Some(Snapshot {
            meta,
            snapshot: Box::new(body),
        }))
    }

    /// Replaces the whole state with the body in `spool` (a snapshot received from the
    /// leader), held to `seal` (the bytes as they arrived) when there is one. One write
    /// transaction: an error, or a crash, leaves the state as it was. The data lock is
    /// held throughout, so reads wait for the install; only a wiped or far-behind node
    /// installs a snapshot.
    pub(super) fn install_from(
        &self,
        meta: &SnapshotMeta<NodeId, BasicNode>,
        mut spool: File,
        seal: Option<BodySeal>,
    ) -> Result<(), StorageError> {
        let failed = |e: String| {
            StorageError::from(StorageIOError::read_snapshot(
                Some(meta.signature()),
                AnyError::error(e),
            ))
        };
        spool
            .seek(SeekFrom::Start(0))
            .map_err(|e| failed(e.to_string()))?;
        let mut data = self.write_data();
        // Rows still queued belong to the state being replaced: let them land first, so
        // none is written over the snapshot afterwards.
        self.flush()?;
        let txn = self.db.begin_write().map_err(sm_write_err)?;
        let mut read = Sealing {
            inner: spool,
            seal: RunningSeal::default(),
        };
        install_body(
            &txn,
            BufReader::with_capacity(SPOOL_BUFFER_BYTES, &mut read),
        )
        .map_err(failed)?;
        if let Some(expected) = seal {
            // The parse stops at the body's end; bytes after it were refused, so the
            // rest of the file is what the seal may still cover.
            std::io::copy(&mut read, &mut std::io::sink()).map_err(|e| failed(e.to_string()))?;
            if read.seal.seal() != expected {
                return Err(failed(format!(
                    "the snapshot body read back from its spool ({} bytes) is not the body received ({} bytes): its SHA-256 differs, so the spool was damaged; nothing installed",
                    read.seal.seal().len,
                    expected.len
                )));
            }
        }
        // The body carries answers without their times: each is kept a window from now.
        idempotency_expiry::index_all(&txn, idempotency_expiry::now_secs()).map_err(failed)?;
        write_applied(&txn, &meta.last_log_id, &meta.last_membership)?;
        txn.commit().map_err(sm_write_err)?;
        *data = self.load_from_disk()?;
        Ok(())
    }
}

impl RaftSnapshotBuilder<TypeConfig> for StateMachine {
    /// A snapshot here is a point the state machine has made durable, after which openraft
    /// may purge the log: the body is written only when a follower needs it
    /// (`snapshot_now`).
    ///
    /// Decided once, by the disk: below its reserve nothing is committed (a commit that
    /// meets ENOSPC leaves redb refusing every later one, and an error here would stop
    /// Raft). The build then answers the last snapshot's meta, which openraft takes as
    /// nothing newer (no purge; it asks again later), and is still noted, so a follower
    /// behind the purge point gets a body written from the state as it is
    /// (`snapshot_now`): after a restart below the reserve there would be none to send.
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, StorageError> {
        let Some(headroom) = self.headroom_for_own_commits() else {
            let meta = self.latest_snapshot_meta();
            self.note_snapshot(&meta);
            return Ok(Snapshot {
                meta,
                snapshot: Box::new(SnapshotSpool::no_body()),
            });
        };
        // Fresh checkpoints, so a restart replays only what follows.
        self.checkpoint_due_agents()?;
        // Every agent's raw record rows packed, however few, once per snapshot (what the
        // disk's headroom leaves for later waits for the next pass).
        self.merge_within(true, super::merge_budget(headroom))?;
        let (meta, txn) = self.fixed_view()?;
        drop(txn);
        // openraft may purge the log up to this point once this returns: the point must
        // survive a power loss in redb, not only in a commit made without an fsync.
        self.make_durable()?;
        self.note_snapshot(&meta);
        // openraft keeps only the meta of a snapshot it asked to build.
        Ok(Snapshot {
            meta,
            snapshot: Box::new(SnapshotSpool::no_body()),
        })
    }
}
