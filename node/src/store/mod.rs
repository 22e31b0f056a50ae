//! Durable storage: the Raft log and vote in append-only segment files (`log_store`), the
//! replicated state machine on redb (`state_machine`). The engines stay behind this module.

pub mod agent_checkpoint;
pub mod agent_slot;
pub mod checked_row;
pub mod heads;
pub mod heads_leaves;
pub mod heads_meta;
pub mod heads_round_sizes;
pub mod heads_tree;
pub mod idempotency_expiry;
pub mod idempotency_rows;
pub mod imports;
mod log_recovery;
pub mod log_store;
pub mod packed_run;
pub mod record_ends;
pub mod record_rows;
pub mod repair_floor;
pub mod sm_writer;
pub mod state_machine;
pub mod system_log;
pub mod watermark;

use lineage_redb_header::OpenFailure::{Damaged, Failed};
use std::path::Path;
use std::sync::Arc;

pub use agent_slot::AgentSlot;
pub use log_store::LogStore;
pub use state_machine::StateMachine;

/// Default milliseconds between the state machine's fsynced commits (see
/// `state_machine`): rare enough that the fsync stall stays out of p99 latency.
pub const DEFAULT_STATE_FSYNC_INTERVAL_MS: u64 = 5_000;

/// The Raft log's directory inside a node's data dir.
pub const RAFT_LOG_DIR: &str = "raft-log";

/// Opens (or creates) the node's log and state machine.
pub fn open(data_dir: &Path) -> Result<(LogStore, StateMachine), String> {
    open_with(
        data_dir,
        std::time::Duration::from_millis(DEFAULT_STATE_FSYNC_INTERVAL_MS),
        false,
    )
}

/// Whether the node is its cluster's only voter: by the membership its state machine
/// holds, or, when that holds none yet (a new node, or one whose state machine rolled back
/// to before the membership), by `configured_alone` (its configured peers are itself).
pub fn single_voter(sm: &StateMachine, configured_alone: bool) -> bool {
    let data = sm.read_data();
    let voters = data.membership.membership().voter_ids().count();
    if voters == 0 {
        configured_alone
    } else {
        voters == 1
    }
}

/// `open`, with the state machine fsyncing its commits at most every `state_fsync_interval`;
/// `configured_alone` as in [`single_voter`].
pub fn open_with(
    data_dir: &Path,
    state_fsync_interval: std::time::Duration,
    configured_alone: bool,
) -> Result<(LogStore, StateMachine), String> {
    std::fs::create_dir_all(data_dir)
        .map_err(|e| format!("cannot create {}: {e}", data_dir.display()))?;
    let mut db = open_state_db(data_dir)?;
    refuse_redb_raft_log(&db, data_dir)?;
    compact_if_it_pays(&mut db, &data_dir.join(STATE_DB));
    let sm = StateMachine::open(Arc::new(db), data_dir)
        .map_err(|e| format!("state machine: {e}"))?
        .with_fsync_interval(state_fsync_interval);
    remove_old_snapshot_files(data_dir);
    let log_dir = data_dir.join(RAFT_LOG_DIR);
    let applied = sm.read_data().last_applied;
    let single_voter = single_voter(&sm, configured_alone);
    // The state machine behind the log's start (its file lost or damaged, or a crash in
    // the middle of installing a snapshot) cannot be replayed from the log, and a log
    // whose start is unreadable cannot be read: start the log afresh, under a repair
    // floor, and let the leader's snapshot rebuild both.
    let unusable = match log_store::read_purged(&log_dir) {
        Ok(Some(purged)) if applied < Some(purged) => Some(format!(
            "the state machine holds {}, behind the log's start after {purged}",
            applied.map_or("nothing".to_string(), |a| a.to_string())
        )),
        Ok(_) => None,
        Err(e) => Some(e),
    };
    if let Some(reason) = unusable {
        log_recovery::discard_for_snapshot(&log_dir, &reason)?;
    }
    let log = LogStore::open_with(&log_dir, log_store::SEGMENT_BYTES, single_voter)
        .map_err(|e| format!("raft log: {e}"))?;
    Ok((log, sm))
}

/// The state machine's file, where the marker of a clean stop is kept.
pub(crate) const STATE_DB: &str = "node.redb";
/// Where earlier builds kept snapshot bodies.
const SNAPSHOT_DIR: &str = "snapshot";

/// Earlier builds kept each snapshot's body in `DATA/snapshot/`, a second copy of every
/// record, and emptied it at start. Bodies are now written only while being sent; a
/// directory left by an older version is removed (best effort: it is never read).
fn remove_old_snapshot_files(data_dir: &Path) {
    let dir = data_dir.join(SNAPSHOT_DIR);
    if dir.exists() {
        if let Err(e) = std::fs::remove_dir_all(&dir) {
            tracing::warn!(dir = %dir.display(), error = %e, "cannot remove old snapshot files");
        }
    }
}
/// redb's page cache. Its default (1 GiB) let a node's memory grow with its history:
/// replay and the scrub read every record once, and each page read stayed cached. Reads
/// here are mostly of recent records (and the scrub's one pass), which the OS page cache
/// serves as well. 8 MiB rather than 32: measured at 1M records (release, one node, 16
/// clients), the same CPU per decision (130 µs) and 40 MB less VmRSS after load.
pub const STATE_DB_CACHE_BYTES: usize = 8 * 1024 * 1024;
const CLEAN_STOP: &str = "clean-stop";
/// After a clean stop redb's pages are checked at start anyway while the file is at most
/// this large (about 1.1 ms per MB here, so up to about 1.2 s, some 1M records): redb
/// checks a page's checksum only then, and a byte flipped while the node was down was
/// otherwise read as it is (an agent's key changed answered 404 "agent not found",
/// `integrity.rs`). A larger file keeps its start bounded and relies on the rows' own
/// checks and the scrub.
const CHECK_PAGES_AFTER_CLEAN_STOP_BYTES: u64 = 1 << 30;

/// Opens the state machine's redb file. Its header is checked first
/// (`lineage_redb_header`), and its pages after a stop that was not clean, or after a clean
/// one while the file is small (`CHECK_PAGES_AFTER_CLEAN_STOP_BYTES`); a file
/// whose header is damaged, on which redb panics while opening or checking it, that redb
/// finds corrupted, or whose sealed last-applied id or membership fails its checksum, is
/// moved aside (kept for inspection) and the node
/// starts with an empty one, rebuilt from the Raft log or a snapshot: the log, not this
/// file, is the durable copy.
fn open_state_db(data_dir: &Path) -> Result<redb::Database, String> {
    let path = data_dir.join(STATE_DB);
    let clean = std::fs::remove_file(data_dir.join(CLEAN_STOP)).is_ok();
    // Whether the file is marked with a layout at all: every marked layout keeps the
    // heads log's digest of last statements, so its row missing is a lost row.
    let mut marked = false;
    let check_pages = !clean
        || std::fs::metadata(&path).is_ok_and(|m| m.len() <= CHECK_PAGES_AFTER_CLEAN_STOP_BYTES);
    let builder = state_db_builder();
    let extended = |from, to| {
        tracing::warn!(
            file = %path.display(),
            from,
            to,
            "state machine file shorter than its header states after an unclean stop \
             (a growth lost to a power cut): extended for redb's recovery"
        );
    };
    let opened = lineage_redb_header::open_checked(&path, &builder, check_pages, extended)
        .map(|opened| {
            if opened.repaired {
                tracing::warn!(file = %path.display(), clean, "state machine file repaired by redb's check of its pages");
            }
            opened.db
        })
        // A file from a later build is refused, not moved aside: its tables are not
        // damage. (A read error here is left to `meta_intact`, which reads the same table.)
        .and_then(|db| match state_machine::format_of(&db) {
            Ok(Some(format)) if format > state_machine::STATE_FORMAT => Err(Failed(format!(
                "it was written by a later build (layout {format}; this build reads up to \
                 {}): run that build, or restore the data directory's backup",
                state_machine::STATE_FORMAT
            ))),
            Ok(format) => {
                marked = format.is_some();
                Ok(db)
            }
            Err(_) => Ok(db),
        })
        .and_then(|db| match state_machine::meta_intact(&db) {
            Ok(()) => Ok(db),
            Err(why) => Err(Damaged(why)),
        })
        .and_then(|db| match heads::upgrade(&db, marked) {
            Ok(()) => Ok(db),
            Err(redb::Error::Corrupted(why)) => Err(Damaged(format!("heads log: {why}"))),
            Err(other) => Err(Failed(other.to_string())),
        })
        .and_then(|db| match heads_tree::check_stated(&db) {
            Ok(()) => Ok(db),
            Err(redb::Error::Corrupted(why)) => Err(Damaged(format!("heads log: {why}"))),
            Err(other) => Err(Failed(other.to_string())),
        })
        .and_then(|db| match state_machine::mark_format(&db) {
            Ok(()) => Ok(db),
            Err(e) => Err(Failed(e)),
        });
    match opened {
        Ok(db) => Ok(db),
        Err(Damaged(why)) => {
            let stamp = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            let aside = data_dir.join(format!("{STATE_DB}.damaged-{stamp}"));
            std::fs::rename(&path, &aside)
                .map_err(|e| format!("cannot move the damaged {} aside: {e}", path.display()))?;
            tracing::error!(
                file = %path.display(),
                kept_as = %aside.display(),
                reason = %why,
                "state machine file corrupted: moved aside, rebuilding from the raft log or a snapshot"
            );
            let db = state_db_builder()
                .create(&path)
                .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
            heads::upgrade(&db, false)
                .map_err(|e| format!("cannot set up {}: {e}", path.display()))?;
            state_machine::mark_format(&db)
                .map_err(|e| format!("cannot set up {}: {e}", path.display()))?;
            Ok(db)
        }
        Err(Failed(e)) => Err(format!("cannot open {}: {e}", path.display())),
    }
}

/// Free space in the state machine's file worth compacting away at start: at least this
/// much, and at least half the file (redb gives space back only when, its pages moved
/// down, half the file's tail is free: with less, compaction moves pages and shrinks
/// nothing; 140 ms wasted at every start on a 1 GB file).
const COMPACT_FREE_BYTES: u64 = 64 * 1024 * 1024;

/// redb reuses freed pages but never gives them back to the file system: the file stays
/// as large as it ever was (merging record rows and snapshot installs free much). Only a
/// database nothing else holds yet can be compacted, so it is done here, at start, when
/// the free space is worth it. A failed or interrupted compaction leaves a valid file
/// (redb commits each step), so it is reported and the node goes on.
fn compact_if_it_pays(db: &mut redb::Database, path: &Path) {
    let Ok(file_bytes) = std::fs::metadata(path).map(|m| m.len()) else {
        return;
    };
    // Too small to have half of it and the threshold free: no commits at start.
    if file_bytes < 2 * COMPACT_FREE_BYTES {
        return;
    }
    // Pages a commit frees are released by the commits after it: two empty ones first,
    // so the count is of pages in use.
    let empty_commit = || {
        db.begin_write()
            .map_err(redb::Error::from)?
            .commit()
            .map_err(redb::Error::from)
    };
    let used_bytes = match empty_commit().and_then(|()| empty_commit()).and_then(|()| {
        let txn = db.begin_write()?;
        let stats = txn.stats()?;
        txn.abort()?;
        Ok(stats.allocated_pages() * stats.page_size() as u64)
    }) {
        Ok(bytes) => bytes,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the state machine file's page use");
            return;
        }
    };
    let free = file_bytes.saturating_sub(used_bytes);
    if free < COMPACT_FREE_BYTES || free < file_bytes / 2 {
        return;
    }
    let started = std::time::Instant::now();
    match db.compact() {
        Ok(_) => tracing::info!(
            before = file_bytes,
            after = std::fs::metadata(path).map_or(0, |m| m.len()),
            millis = started.elapsed().as_millis() as u64,
            "state machine file compacted"
        ),
        Err(e) => tracing::warn!(error = %e, "state machine file not compacted"),
    }
}

/// The state machine's file, with its cache bound (`STATE_DB_CACHE_BYTES`).
fn state_db_builder() -> redb::Builder {
    let mut builder = redb::Builder::new();
    builder.set_cache_size(STATE_DB_CACHE_BYTES);
    builder
}

/// Records a clean stop (everything committed, and checkpointed unless the disk was below
/// its reserve): the next start checks the state machine's file's pages only while it is
/// small (`CHECK_PAGES_AFTER_CLEAN_STOP_BYTES`).
pub fn mark_clean_stop(data_dir: &Path) {
    if let Err(e) = std::fs::write(data_dir.join(CLEAN_STOP), b"") {
        tracing::warn!(error = %e, "cannot record the clean stop");
    }
}

/// Data dirs from before the log moved out of redb kept it in table `raft_log`; starting
/// on one would silently forget its vote and entries, so say so instead.
fn refuse_redb_raft_log(db: &redb::Database, data_dir: &Path) -> Result<(), String> {
    use redb::ReadableTableMetadata;
    const OLD_LOG: redb::TableDefinition<u64, &[u8]> = redb::TableDefinition::new("raft_log");
    let old_entries = db
        .begin_read()
        .ok()
        .and_then(|txn| txn.open_table(OLD_LOG).ok())
        .and_then(|table| table.len().ok())
        .unwrap_or(0);
    if old_entries > 0 && !data_dir.join(RAFT_LOG_DIR).exists() {
        return Err(format!(
            "{} holds a Raft log in the older in-redb format ({old_entries} entries); \
             this version keeps it in {RAFT_LOG_DIR}/. Start this node with an empty data \
             dir: it catches up from the cluster",
            data_dir.display()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROWS: redb::TableDefinition<u64, &[u8]> = redb::TableDefinition::new("rows");

    fn fill(db: &redb::Database, rows: std::ops::Range<u64>, remove: bool) {
        let txn = db.begin_write().unwrap();
        {
            let mut table = txn.open_table(ROWS).unwrap();
            let value = vec![7u8; 60 * 1024];
            for n in rows {
                if remove {
                    table.remove(n).unwrap();
                } else {
                    table.insert(n, value.as_slice()).unwrap();
                }
            }
        }
        txn.commit().unwrap();
    }

    /// A file with a few MiB free is left alone; one with more free than the threshold and
    /// half the file shrinks, and what it still holds reads back.
    #[test]
    fn the_state_file_is_compacted_at_start_only_when_it_pays() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.redb");
        let mut db = redb::Database::create(&path).unwrap();
        fill(&db, 0..1_500, false);
        fill(&db, 1_400..1_500, true);
        let size = || std::fs::metadata(&path).unwrap().len();
        let before = size();
        compact_if_it_pays(&mut db, &path);
        assert_eq!(size(), before, "compacted for a few MiB");

        fill(&db, 100..1_400, true);
        compact_if_it_pays(&mut db, &path);
        let after = size();
        assert!(after < before / 4, "{before} -> {after}");
        let txn = db.begin_read().unwrap();
        let table = txn.open_table(ROWS).unwrap();
        assert_eq!(redb::ReadableTableMetadata::len(&table).unwrap(), 100);
        assert_eq!(table.get(99).unwrap().unwrap().value().len(), 60 * 1024);
    }
}
