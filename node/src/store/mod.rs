//! Durable storage: the Raft log and vote in append-only segment files (`log_store`), the
//! replicated state machine on redb (`state_machine`). The engines stay behind this module.

pub mod heads;
pub mod idempotency_rows;
mod log_recovery;
pub mod log_store;
pub mod record_rows;
pub mod repair_floor;
pub mod sm_writer;
pub mod state_machine;
pub mod watermark;

use std::path::Path;
use std::sync::Arc;

pub use log_store::LogStore;
pub use state_machine::{AgentSlot, StateMachine};

/// The Raft log's directory inside a node's data dir.
pub const RAFT_LOG_DIR: &str = "raft-log";

/// Opens (or creates) the node's log and state machine.
pub fn open(data_dir: &Path) -> Result<(LogStore, StateMachine), String> {
    open_with(
        data_dir,
        std::time::Duration::from_millis(crate::DEFAULT_STATE_FSYNC_INTERVAL_MS),
    )
}

/// `open`, with the state machine fsyncing its commits at most every `state_fsync_interval`.
pub fn open_with(
    data_dir: &Path,
    state_fsync_interval: std::time::Duration,
) -> Result<(LogStore, StateMachine), String> {
    std::fs::create_dir_all(data_dir)
        .map_err(|e| format!("cannot create {}: {e}", data_dir.display()))?;
    let path = data_dir.join("node.redb");
    let db = redb::Database::create(&path)
        .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    refuse_redb_raft_log(&db, data_dir)?;
    let log = LogStore::open(&data_dir.join(RAFT_LOG_DIR)).map_err(|e| format!("raft log: {e}"))?;
    let sm = StateMachine::open(Arc::new(db))
        .map_err(|e| format!("state machine: {e}"))?
        .with_fsync_interval(state_fsync_interval);
    Ok((log, sm))
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
