//! Durable storage on one redb file: the Raft log and vote (`log_store`) and the
//! replicated state machine (`state_machine`). The engine stays behind this module.

pub mod heads;
pub mod log_store;
pub mod state_machine;

use std::path::Path;
use std::sync::Arc;

pub use log_store::LogStore;
pub use state_machine::{AgentSlot, StateMachine};

/// Opens (or creates) the node's database and both stores.
pub fn open(data_dir: &Path) -> Result<(LogStore, StateMachine), String> {
    std::fs::create_dir_all(data_dir)
        .map_err(|e| format!("cannot create {}: {e}", data_dir.display()))?;
    let path = data_dir.join("node.redb");
    let db = redb::Database::create(&path)
        .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    let db = Arc::new(db);
    let log = LogStore::open(db.clone()).map_err(|e| format!("raft log: {e}"))?;
    let sm = StateMachine::open(db).map_err(|e| format!("state machine: {e}"))?;
    Ok((log, sm))
}
