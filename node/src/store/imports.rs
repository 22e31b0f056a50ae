//! Agents being imported from a reference guard's data directory, part of the replicated
//! state machine. An import is atomic per agent: a `Begin` entry opens the agent in
//! this map (not in `SmData::agents`: the API answers 503 for it, a create 409, and it
//! has no heads statements and no metrics), `Records` entries carry its original signed
//! lines in order (each checked to extend the head and signed by the log's own genesis
//! key), and `Commit { head }` moves it to the agents once the head is the one the
//! source file ends with. Interrupted anywhere, a second run resumes from the head the
//! cluster holds; nothing half-imported is ever served.
//!
//! The records are stored as any agent's (table `records`, `agent_index`); a marker row
//! in `imports` says the agent is not active yet, so a restart puts it back here.

use lineage_core::guard::AgentState;
use lineage_core::record::{check_chain, Record, ZERO_HASH};
use redb::TableDefinition;

use super::checked_row;
use crate::raft_types::{ImportManifest, Tombstone};

/// agent id → its import manifest (sealed JSON).
pub const IMPORTS: TableDefinition<&str, &[u8]> = TableDefinition::new("imports");
/// agent id → why it is reserved for good (sealed JSON `Tombstone`).
pub const TOMBSTONES: TableDefinition<&str, &[u8]> = TableDefinition::new("tombstones");
/// agent id → its figures when its import committed (sealed JSON `ImportPoint`).
pub const IMPORT_POINTS: TableDefinition<&str, &[u8]> = TableDefinition::new("import_points");

/// An imported agent's guard figures as its import committed. The metrics count only
/// what happened after it, so an import fires no scar-burst or termination alert.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ImportPoint {
    pub allowed: u64,
    pub approvals_requested: u64,
    pub denied_by_code: std::collections::BTreeMap<String, u64>,
    /// Scars by severity.
    pub scars: std::collections::BTreeMap<String, u64>,
    pub terminated: bool,
}

impl ImportPoint {
    pub fn of(state: &AgentState) -> Self {
        let mut scars = std::collections::BTreeMap::new();
        for scar in &state.scars {
            *scars.entry(scar.severity.as_str().to_string()).or_insert(0) += 1;
        }
        ImportPoint {
            allowed: state.actions_allowed,
            approvals_requested: state.approvals_requested,
            denied_by_code: state.denied_by_code.clone(),
            scars,
            terminated: !state.is_alive(),
        }
    }
}

pub fn import_points(txn: &redb::ReadTransaction) -> Result<Vec<(String, ImportPoint)>, String> {
    rows(txn, IMPORT_POINTS)
}

pub fn put_import_point(
    txn: &redb::WriteTransaction,
    agent_id: &str,
    point: &ImportPoint,
) -> Result<(), String> {
    put(txn, IMPORT_POINTS, agent_id, point)
}

/// An agent being imported: what the import said it brings, and the fold so far.
#[derive(Clone, Debug, Default)]
pub struct Importing {
    pub manifest: ImportManifest,
    pub state: AgentState,
}

impl Importing {
    /// Checks `records` as the next lines of the source log and folds them into a copy of
    /// the state, returned if all hold: the chain (seq, prev_hash, hash, actor), the
    /// first record's hash against the manifest's genesis hash, each signature against
    /// the key the genesis names, and the guard fold. Deterministic: every node agrees.
    pub fn extended(&self, agent_id: &str, records: &[Record]) -> Result<AgentState, String> {
        let head_hash = self
            .state
            .head
            .as_ref()
            .map_or(ZERO_HASH, |h| h.hash.as_str());
        check_chain(self.state.next_seq(), head_hash, agent_id, records)?;
        if let Some(genesis) = records.iter().find(|r| r.seq == 0) {
            if genesis.hash != self.manifest.genesis_hash {
                return Err("the genesis record is not the one the import began with".into());
            }
        }
        let mut state = self.state.clone();
        // The key the genesis names, parsed once (the genesis may be in this batch).
        let mut key = None;
        for record in records {
            state
                .apply(record)
                .map_err(|e| format!("seq {}: {e}", record.seq))?;
            if key.is_none() {
                let parsed =
                    lineage_core::keys::parse_public_key(&state.public_key).ok_or_else(|| {
                        format!("seq {}: the genesis names no valid public key", record.seq)
                    })?;
                key = Some(parsed);
            }
            if let Some(key) = &key {
                lineage_core::verify::check_signature(record, key)
                    .map_err(|e| format!("seq {}: {e}", record.seq))?;
            }
        }
        Ok(state)
    }
}

/// Every marker: the agents still being imported, with their manifests.
pub fn markers(txn: &redb::ReadTransaction) -> Result<Vec<(String, ImportManifest)>, String> {
    rows(txn, IMPORTS)
}

/// Every tombstone.
pub fn tombstones(txn: &redb::ReadTransaction) -> Result<Vec<(String, Tombstone)>, String> {
    rows(txn, TOMBSTONES)
}

pub fn put_tombstone(
    txn: &redb::WriteTransaction,
    agent_id: &str,
    tombstone: &Tombstone,
) -> Result<(), String> {
    put(txn, TOMBSTONES, agent_id, tombstone)
}

fn put<T: serde::Serialize>(
    txn: &redb::WriteTransaction,
    table: TableDefinition<&str, &[u8]>,
    agent_id: &str,
    value: &T,
) -> Result<(), String> {
    let json = serde_json::to_vec(value).map_err(|e| e.to_string())?;
    let mut table = txn.open_table(table).map_err(|e| e.to_string())?;
    table
        .insert(agent_id, checked_row::seal(&json).as_slice())
        .map_err(|e| e.to_string())?;
    Ok(())
}

fn rows<T: serde::de::DeserializeOwned>(
    txn: &redb::ReadTransaction,
    definition: TableDefinition<&str, &[u8]>,
) -> Result<Vec<(String, T)>, String> {
    use redb::ReadableTable;
    let table = match txn.open_table(definition) {
        Ok(table) => table,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
        Err(e) => return Err(format!("imports: {e}")),
    };
    let mut rows = Vec::new();
    for item in table.iter().map_err(|e| format!("imports: {e}"))? {
        let (agent, row) = item.map_err(|e| format!("imports: {e}"))?;
        let value = checked_row::unseal_json(row.value())
            .map_err(|e| format!("import row of {}: {e}", agent.value()))?;
        rows.push((agent.value().to_string(), value));
    }
    Ok(rows)
}

pub fn put_marker(
    txn: &redb::WriteTransaction,
    agent_id: &str,
    manifest: &ImportManifest,
) -> Result<(), String> {
    put(txn, IMPORTS, agent_id, manifest)
}

pub fn remove_marker(txn: &redb::WriteTransaction, agent_id: &str) -> Result<(), String> {
    let mut table = txn.open_table(IMPORTS).map_err(|e| e.to_string())?;
    table.remove(agent_id).map_err(|e| e.to_string())?;
    Ok(())
}

/// Replaces every marker, tombstone and import point with a snapshot's.
pub fn install(
    txn: &redb::WriteTransaction,
    markers: &[(String, ImportManifest)],
    tombstones: &[(String, Tombstone)],
    points: &[(String, ImportPoint)],
) -> Result<(), String> {
    for definition in [IMPORTS, TOMBSTONES, IMPORT_POINTS] {
        let mut table = txn.open_table(definition).map_err(|e| e.to_string())?;
        table.retain(|_, _| false).map_err(|e| e.to_string())?;
    }
    for (agent_id, manifest) in markers {
        put_marker(txn, agent_id, manifest)?;
    }
    for (agent_id, tombstone) in tombstones {
        put_tombstone(txn, agent_id, tombstone)?;
    }
    for (agent_id, point) in points {
        put_import_point(txn, agent_id, point)?;
    }
    Ok(())
}
