//! The replicated state machine: every agent's records on redb, and each agent's guard
//! state (the fold of its records) in memory.
//!
//! Apply checks that each entry's records extend the agent's head — consecutive seq,
//! `prev_hash` equal to the head's hash, recomputed hash equal to the stored one, actor
//! equal to the agent — and that the guard fold accepts them. An entry that fails changes
//! nothing and fails the same way on every node (apply is deterministic). Applies fold
//! into memory at once; `sm_writer` commits their rows (records, idempotency answers,
//! agent index, last applied id) in one redb transaction per about 60 ms, in apply order.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use lineage_core::guard::AgentState;
use lineage_core::record::Record;
use lineage_core::verify::{BatchVerifier, VerifyReport, BATCH_RECORDS};
use openraft::storage::{RaftStateMachine, Snapshot};
use openraft::{BasicNode, Entry, LogId, SnapshotMeta, StorageIOError, StoredMembership};
use redb::{Database, ReadableTable, TableDefinition};
use serde::Serialize;

mod apply;
mod data_lock;
mod overlay;
mod snapshot;
mod snapshot_body;

pub use apply::check_extends;
use apply::fold_into;
use data_lock::{DataLock, WriteHold};
use overlay::Unflushed;

use super::agent_checkpoint;
use super::agent_slot::AgentSlot;
use super::checked_row;
use super::heads::{self, HeadsLog};
use super::heads_leaves;
use super::heads_meta;
use super::heads_tree::{self, StoredTree};
use super::idempotency_expiry;
use super::idempotency_rows::{self, IDEMPOTENCY};
use super::log_store::DurableLog;
use super::record_ends;
use super::record_rows;
use super::sm_writer::{SmWriter, Tables};
use super::system_log;
use crate::disk_reserve::DiskReserve;
use crate::raft_types::{
    ApplyOutcome, BatchOutcome, IdempotentAnswer, NodeId, StorageError, TypeConfig,
};
use crate::snapshot_spool::SnapshotSpool;

/// (agent_id, seq) → the record's line.
const RECORDS: TableDefinition<(&str, u64), &str> = TableDefinition::new("records");
const SM_META: TableDefinition<&str, &[u8]> = TableDefinition::new("sm_meta");
/// Every agent that has records (written with its first record).
const AGENT_INDEX: TableDefinition<&str, ()> = TableDefinition::new("agent_index");
/// Checkpointed agent states (JSON): start-up loads these and replays only the records
/// after each checkpoint's head, so it does not grow with the length of the logs.
const AGENT_CHECKPOINTS: TableDefinition<&str, &[u8]> = TableDefinition::new("agent_checkpoints");
const APPLIED_KEY: &str = "last_applied";
/// The last applied id as of which `record_ends` is current: written with it by this
/// version. A build from before ends were kept moves the last applied id without it, so
/// a difference at open means the ends are stale and are taken from the rows again.
const ENDS_APPLIED_KEY: &str = "record_ends_applied";
const MEMBERSHIP_KEY: &str = "membership";
/// The file's layout version ([`STATE_FORMAT`]), sealed as the rows above.
const FORMAT_KEY: &str = "format";

/// The layout of the state machine file this build writes, and the newest it reads. A
/// file marked newer was written by a later build: this one refuses to open it rather
/// than take tables it does not know for damage (`store::open_state_db`). Raise it when
/// a change makes files that an older build would misread.
/// 1: the heads log's round sizes, by-agent index and `heads_stated` sealed.
/// 2: raw record rows sealed (`record_rows::raw_lines`); a build of 1 would read a sealed
///    row's first line as a damaged record.
pub const STATE_FORMAT: u64 = 2;

/// The layout version `db` is marked with: `None` where unmarked (before versions), or
/// where the row does not read back intact (`meta_intact` says so).
pub fn format_of(db: &Database) -> Result<Option<u64>, String> {
    let txn = db.begin_read().map_err(|e| e.to_string())?;
    let meta = match txn.open_table(SM_META) {
        Ok(meta) => meta,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(None),
        Err(e) => return Err(e.to_string()),
    };
    let row = meta.get(FORMAT_KEY).map_err(|e| e.to_string())?;
    Ok(row.and_then(|v| checked_row::unseal_json::<u64>(v.value()).ok()))
}

/// Marks `db` with this build's layout, [`STATE_FORMAT`] (after its upgrades at open).
pub fn mark_format(db: &Database) -> Result<(), String> {
    if format_of(db)? == Some(STATE_FORMAT) {
        return Ok(());
    }
    let txn = db.begin_write().map_err(|e| e.to_string())?;
    txn.open_table(SM_META)
        .map_err(|e| e.to_string())?
        .insert(
            FORMAT_KEY,
            meta_row(&STATE_FORMAT)
                .map_err(|e| e.to_string())?
                .as_slice(),
        )
        .map_err(|e| e.to_string())?;
    txn.commit().map_err(|e| e.to_string())
}

/// Which copy of a record line `StateMachine::walk_record_lines` met.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LineCopy {
    /// Applied, not yet committed to the tables.
    Overlay,
    /// In the tables.
    Table,
}

/// Why a stored record could not be read back ([`StateMachine::record_at`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordError {
    /// The store cannot be read at all here (a read transaction or a table would not
    /// open): nothing about this record in particular.
    Store(String),
    /// What is stored for this record does not read back: its row is damaged, or its
    /// line is not a record.
    Damaged(String),
}

impl std::fmt::Display for RecordError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RecordError::Store(why) => write!(f, "the store cannot be read: {why}"),
            RecordError::Damaged(why) => f.write_str(why),
        }
    }
}

#[derive(Debug, Default)]
pub struct SmData {
    pub last_applied: Option<LogId<NodeId>>,
    pub membership: StoredMembership<NodeId, BasicNode>,
    pub agents: BTreeMap<String, AgentSlot>,
    /// Agents changed since their last checkpoint.
    dirty: std::collections::BTreeSet<String>,
    /// Records folded while loading from disk (what start-up cost).
    pub records_replayed_at_open: u64,
    pub heads: HeadsLog,
    /// The operators, folded from the system log.
    pub operators: lineage_core::operators::Operators,
    /// Agents being imported (`store::imports`): not in `agents` until committed.
    pub imports: BTreeMap<String, super::imports::Importing>,
    /// Ids reserved for good: their reference logs failed verification.
    pub tombstones: BTreeMap<String, crate::raft_types::Tombstone>,
    /// Imported agents' figures as their imports committed (the metrics start there).
    pub import_points: BTreeMap<String, super::imports::ImportPoint>,
    /// Rows applied in memory that the writer has not committed yet (`sm_writer`).
    unflushed: Unflushed,
}

#[derive(Clone)]
pub struct StateMachine {
    db: Arc<Database>,
    data: Arc<DataLock<SmData>>,
    /// The last snapshot built or installed (`snapshot::snapshot_now`).
    latest_snapshot: Arc<RwLock<Option<SnapshotMeta<NodeId, BasicNode>>>>,
    /// Commits applied rows behind the applies (and durably every fsync interval: the
    /// Raft log is the durable copy, and a crash rolls the state machine back to its last
    /// durable commit, from where openraft re-applies the log; durable commits also let
    /// redb reuse the pages earlier commits freed, so the file does not grow unbounded).
    writer: SmWriter,
    /// Numbers row batches for the writer; never reset, so "flushed through" stays true.
    next_batch: Arc<std::sync::atomic::AtomicU64>,
    /// When set, an entry is applied only once it is durable in this node's Raft log (the
    /// leader acknowledges its own appends before their fsync: `log_store` docs).
    durable_log: Option<DurableLog>,
    /// Where snapshot bodies are spooled: the data directory (`snapshot.rs`).
    spool_dir: Arc<std::path::Path>,
    /// Free space the node's own commits and a body spooled on disk must leave
    /// (`disk_reserve`): below it, merges, checkpoints, snapshot builds and answer expiry
    /// wait.
    disk: DiskReserve,
    /// Whether the last look found the disk below its reserve (to log the change only).
    waiting_for_disk: Arc<std::sync::atomic::AtomicBool>,
}

const WRITER_TABLES: Tables = Tables {
    records: RECORDS,
    idempotency: IDEMPOTENCY,
    agent_index: AGENT_INDEX,
    meta: SM_META,
    applied_key: APPLIED_KEY,
    ends_applied_key: ENDS_APPLIED_KEY,
    membership_key: MEMBERSHIP_KEY,
};

fn sm_read_err(e: impl std::error::Error + Send + Sync + 'static) -> StorageError {
    StorageIOError::read_state_machine(openraft::AnyError::new(&e)).into()
}

fn sm_write_err(e: impl std::error::Error + Send + Sync + 'static) -> StorageError {
    StorageIOError::write_state_machine(openraft::AnyError::new(&e)).into()
}

fn sm_err(e: String) -> StorageError {
    StorageIOError::write_state_machine(openraft::AnyError::error(e)).into()
}

fn idempotency_key(agent_id: &str, key: &str) -> String {
    format!("{agent_id}\n{key}")
}

/// The heads tree as a read transaction sees it.
pub type ReadOnlyHeadsTree<'a> = StoredTree<
    'a,
    redb::ReadOnlyTable<(u8, u64), &'static [u8]>,
    redb::ReadOnlyTable<u64, &'static [u8]>,
>;

/// The heads tree and its by-agent index inside one read transaction
/// ([`StateMachine::read_heads_tree`]).
pub struct HeadsTreeView<'a> {
    pub tree: ReadOnlyHeadsTree<'a>,
    pub by_agent: &'a redb::ReadOnlyTable<(&'static str, u64), &'static [u8]>,
}

impl HeadsTreeView<'_> {
    /// The agent's latest statement with an index below `below`.
    pub fn statement_below(&self, agent_id: &str, below: u64) -> Result<Option<u64>, String> {
        heads_tree::statement_below(self.by_agent, agent_id, below).map_err(|e| e.to_string())
    }
}

impl StateMachine {
    /// Opens the tables and rebuilds every agent's state by replaying its records.
    /// Snapshot bodies are spooled in `spool_dir` (the data directory).
    pub fn open(db: Arc<Database>, spool_dir: &std::path::Path) -> Result<Self, StorageError> {
        {
            let txn = db.begin_write().map_err(sm_write_err)?;
            refill_stale_ends(&txn).map_err(sm_write_err)?;
            if idempotency_expiry::needs_indexing(&txn).map_err(sm_err)? {
                let indexed = idempotency_expiry::index_all(&txn, idempotency_expiry::now_secs())
                    .map_err(sm_err)?;
                tracing::info!(indexed, "idempotency answers indexed for expiry");
            }
            txn.open_table(RECORDS).map_err(sm_write_err)?;
            txn.open_table(record_rows::PACKED_RUNS)
                .map_err(sm_write_err)?;
            txn.open_table(record_ends::RECORD_ENDS)
                .map_err(sm_write_err)?;
            txn.open_table(IDEMPOTENCY).map_err(sm_write_err)?;
            txn.open_table(SM_META).map_err(sm_write_err)?;
            txn.open_table(AGENT_INDEX).map_err(sm_write_err)?;
            txn.open_table(AGENT_CHECKPOINTS).map_err(sm_write_err)?;
            txn.open_table(heads::HEADS_LEAVES).map_err(sm_write_err)?;
            txn.open_table(heads_leaves::HEADS_LEAF_RUNS)
                .map_err(sm_write_err)?;
            txn.open_table(super::heads_round_sizes::HEADS_ROUNDS)
                .map_err(sm_write_err)?;
            txn.open_table(heads_meta::HEADS_META)
                .map_err(sm_write_err)?;
            txn.open_table(heads_tree::HEADS_NODES)
                .map_err(sm_write_err)?;
            txn.open_table(heads_tree::HEADS_BY_AGENT)
                .map_err(sm_write_err)?;
            txn.open_table(heads_tree::HEADS_STATED)
                .map_err(sm_write_err)?;
            txn.open_table(system_log::SYSTEM_LOG)
                .map_err(sm_write_err)?;
            txn.open_table(super::imports::IMPORTS)
                .map_err(sm_write_err)?;
            txn.open_table(super::imports::TOMBSTONES)
                .map_err(sm_write_err)?;
            txn.open_table(super::imports::IMPORT_POINTS)
                .map_err(sm_write_err)?;
            txn.commit().map_err(sm_write_err)?;
        }
        // The heads tables were upgraded when the file was opened (`store::open_state_db`).
        let writer = SmWriter::spawn(
            db.clone(),
            WRITER_TABLES,
            std::time::Duration::from_millis(super::DEFAULT_STATE_FSYNC_INTERVAL_MS),
        )
        .map_err(sm_err)?;
        let sm = StateMachine {
            db,
            data: Arc::new(DataLock::new(SmData::default())),
            latest_snapshot: Arc::new(RwLock::new(None)),
            writer,
            next_batch: Arc::default(),
            durable_log: None,
            spool_dir: Arc::from(spool_dir),
            disk: DiskReserve::new(spool_dir, 0),
            waiting_for_disk: Arc::default(),
        };
        let loaded = sm.load_from_disk()?;
        *sm.write_data() = loaded;
        Ok(sm)
    }

    /// Applies entries only once `log` has them on disk.
    pub fn behind(mut self, log: DurableLog) -> Self {
        self.durable_log = Some(log);
        self
    }

    /// Keeps `bytes` free in the data directory (the disk reserve): below it the state
    /// machine makes no commit of its own (record merges, checkpoints, snapshot builds,
    /// answer expiry), and a snapshot body is spooled in memory instead of on disk.
    /// Applies are not held back: they carry entries the cluster already committed.
    pub fn with_disk_reserve(mut self, bytes: u64) -> Self {
        self.disk = DiskReserve::new(&self.spool_dir, bytes);
        self
    }

    /// Tells `watch` when each of the writer's commits is in flight (`disk_stall`).
    pub fn with_disk_watch(self, watch: Arc<crate::disk_watch::DiskWatch>) -> Self {
        self.writer.watch_disk(watch);
        self
    }

    /// Whether the state machine's own commits wait now (`with_disk_reserve`).
    pub fn own_commits_wait(&self) -> bool {
        self.headroom_for_own_commits().is_none()
    }

    /// The data directory's disk reserve, for the leader's admission control to check
    /// the same figure as the state machine's own commits.
    pub fn disk_reserve(&self) -> DiskReserve {
        self.disk.clone()
    }

    /// The free bytes above the disk reserve, or `None` while the state machine's own
    /// commits wait: a commit that meets ENOSPC leaves redb refusing every later one
    /// ("Previous I/O error occurred"), applies included, and the node exits. Said once
    /// when they start waiting and once when they resume: openraft asks for a snapshot
    /// again after every apply while none is built.
    fn headroom_for_own_commits(&self) -> Option<u64> {
        let headroom = self.disk.headroom();
        let was_waiting = self
            .waiting_for_disk
            .swap(headroom.is_err(), std::sync::atomic::Ordering::Relaxed);
        match (&headroom, was_waiting) {
            (Err(full), false) => tracing::warn!(
                free_kib = full.free_bytes / 1024,
                reserve_kib = full.reserve_bytes / 1024,
                "the disk is below its reserve: record merges, checkpoints, snapshots and answer expiry wait"
            ),
            (Ok(_), true) => tracing::info!(
                "disk space above the reserve again: merges, checkpoints, snapshots and answer expiry resume"
            ),
            _ => {}
        }
        headroom.ok()
    }

    pub fn with_fsync_interval(self, interval: std::time::Duration) -> Self {
        self.writer.set_fsync_interval(interval);
        self
    }

    /// Waits until every applied row is committed to redb.
    pub fn flush(&self) -> Result<(), StorageError> {
        self.writer.barrier().map_err(sm_err)
    }

    fn write_data(&self) -> WriteHold<'_, SmData> {
        self.data.write()
    }

    pub fn read_data(&self) -> parking_lot::RwLockReadGuard<'_, SmData> {
        self.data.read()
    }

    /// The state to read if no write holds it or waits for it now (`None`: try later).
    pub fn try_read_data(&self) -> Option<parking_lot::RwLockReadGuard<'_, SmData>> {
        self.data.try_read()
    }

    /// How long a reader of the state arriving now would have been kept out (`None`:
    /// it would not be). An apply holds the state for a few hundred µs; a heads,
    /// operator or import entry's commit, or a checkpoint's flush, holds it while the
    /// disk takes a write, and a snapshot's view flushes under a read hold that a
    /// writer then queues behind.
    pub fn state_blocked_for(&self) -> Option<std::time::Duration> {
        self.data.readers_kept_out_for()
    }

    /// Threads waiting for the state's lock now.
    pub fn state_waiters(&self) -> usize {
        self.data.waiters()
    }

    fn load_from_disk(&self) -> Result<SmData, StorageError> {
        let txn = self.db.begin_read().map_err(sm_read_err)?;
        let meta = txn.open_table(SM_META).map_err(sm_read_err)?;
        let mut data = SmData::default();
        if let Some(v) = meta.get(APPLIED_KEY).map_err(sm_read_err)? {
            data.last_applied = checked_row::unseal_json(v.value()).map_err(sm_err)?;
        }
        if let Some(v) = meta.get(MEMBERSHIP_KEY).map_err(sm_read_err)? {
            data.membership = checked_row::unseal_json(v.value()).map_err(sm_err)?;
        }
        let records = txn.open_table(RECORDS).map_err(sm_read_err)?;
        let packed = txn
            .open_table(record_rows::PACKED_RUNS)
            .map_err(sm_read_err)?;
        let index = txn.open_table(AGENT_INDEX).map_err(sm_read_err)?;
        let checkpoints = txn.open_table(AGENT_CHECKPOINTS).map_err(sm_read_err)?;
        let ends = txn
            .open_table(record_ends::RECORD_ENDS)
            .map_err(sm_read_err)?;
        for item in index.iter().map_err(sm_read_err)? {
            let (agent, _) = item.map_err(sm_read_err)?;
            let agent_id = agent.value();
            // A checkpoint that fails its checksum or does not parse is not used: the
            // records are the truth, replay them all (a changed `spent` would refund).
            let start: AgentState = match checkpoints.get(agent_id).map_err(sm_read_err)? {
                Some(row) => agent_checkpoint::decode(row.value()).unwrap_or_else(|e| {
                    tracing::warn!(agent_id, error = %e, "agent checkpoint unusable; replaying all its records");
                    AgentState::new()
                }),
                None => AgentState::new(),
            };
            // A checkpoint whose Merkle frontier does not cover exactly its records
            // (written before the tree was kept, or damaged) is not used: replay all.
            let start = if start.tree.size() == start.next_seq() && start.tree.is_well_formed() {
                start
            } else {
                AgentState::new()
            };
            let mut slot = AgentSlot::Active(Box::new(start));
            data.records_replayed_at_open +=
                replay_stored(&records, &packed, agent_id, &mut slot).map_err(sm_read_err)?;
            // Lines that all chain can still be a log cut short: its end was committed
            // with its rows.
            if let AgentSlot::Active(state) = &slot {
                let replayed_to = Some(state.next_seq());
                let checked =
                    match record_ends::check(&ends, &records, &packed, agent_id, replayed_to) {
                        Err(redb::StorageError::Corrupted(why)) => Ok(Some(why)),
                        checked => checked,
                    };
                if let Some(reason) = checked.map_err(sm_read_err)? {
                    tracing::error!(
                        agent_id,
                        reason,
                        "stored records do not end where they were committed; agent quarantined on this node"
                    );
                    slot = AgentSlot::Quarantined(reason);
                }
            }
            data.agents.insert(agent_id.to_string(), slot);
        }
        // An agent whose records were committed but whose index entry is gone would
        // otherwise start afresh at seq 0 on this node.
        for agent_id in record_ends::missing_from_index(&ends, &index).map_err(sm_read_err)? {
            let reason = "its records were committed, but its index entry is missing".to_string();
            tracing::error!(agent_id, reason, "agent quarantined on this node");
            data.agents.insert(agent_id, AgentSlot::Quarantined(reason));
        }
        // Agents still being imported go back to the imports (their records so far were
        // loaded like any agent's).
        for (agent_id, manifest) in super::imports::markers(&txn).map_err(sm_err)? {
            let state = match data.agents.remove(&agent_id) {
                Some(AgentSlot::Active(state)) => *state,
                Some(quarantined) => {
                    data.agents.insert(agent_id, quarantined);
                    continue;
                }
                None => AgentState::new(),
            };
            data.imports
                .insert(agent_id, super::imports::Importing { manifest, state });
        }
        data.tombstones = super::imports::tombstones(&txn)
            .map_err(sm_err)?
            .into_iter()
            .collect();
        data.import_points = super::imports::import_points(&txn)
            .map_err(sm_err)?
            .into_iter()
            .collect();
        data.heads = HeadsLog::load(&txn, &data.agents).map_err(sm_read_err)?;
        data.operators = system_log::load(&txn).map_err(sm_err)?;
        Ok(data)
    }

    /// Verifies this node's copy of an agent's log a batch at a time with `verifier`
    /// (its cores parse the lines too): memory holds one batch, never the whole log.
    pub fn verify_stored(
        &self,
        agent_id: &str,
        mut verifier: BatchVerifier,
    ) -> Result<VerifyReport, String> {
        let mut from = 0;
        loop {
            let batch = match self.record_lines(agent_id, from, BATCH_RECORDS) {
                Ok(batch) => batch,
                // Stored records that do not read back (a row damaged, records missing)
                // are this copy failing verification, not a store that cannot be read.
                Err(RecordError::Damaged(why)) => {
                    let failure = lineage_core::verify::VerifyFailure {
                        line: None,
                        seq: None,
                        reason: format!("stored records do not read back: {why}"),
                    };
                    return Ok(verifier.report(Some(failure)));
                }
                Err(e) => return Err(e.to_string()),
            };
            let Some(&(last, _)) = batch.last() else {
                break;
            };
            from = last.saturating_add(1);
            let lines: Vec<&str> = batch.iter().map(|(_, line)| line.as_str()).collect();
            if let Err(failure) = verifier.push_lines(&lines) {
                return Ok(verifier.report(Some(failure)));
            }
            if batch.len() < BATCH_RECORDS {
                break;
            }
        }
        let failure = verifier.finish().err();
        Ok(verifier.report(failure))
    }

    /// An agent's records with seq in `from..` (at most `limit`), read from this node's
    /// copy: `Damaged` when what is stored does not read back (a row damaged, records
    /// missing, a line that is not a record), `Store` when the store cannot be read.
    pub fn records(
        &self,
        agent_id: &str,
        from: u64,
        limit: usize,
    ) -> Result<Vec<Record>, RecordError> {
        self.record_lines(agent_id, from, limit)?
            .iter()
            .map(|(seq, line)| {
                Record::from_line(line).map_err(|e| {
                    RecordError::Damaged(format!(
                        "record {seq} does not parse (line {}, column {})",
                        e.line(),
                        e.column()
                    ))
                })
            })
            .collect()
    }

    /// The `hash` of each of `agent_id`'s first `size` records (the leaves of its tree of
    /// that size), read row by row: 32 bytes a record in memory, never the records
    /// themselves (a proof over a long log held every line and every parsed record
    /// before). Each line must parse as a record's seq and hash, in order, all `size`
    /// of them, else it is an error, never a shorter list.
    pub fn record_hashes(&self, agent_id: &str, size: u64) -> Result<Vec<[u8; 32]>, String> {
        #[derive(serde::Deserialize)]
        struct Leaf<'a> {
            seq: u64,
            #[serde(borrow)]
            hash: std::borrow::Cow<'a, str>,
        }
        let capacity = usize::try_from(size).map_err(|e| e.to_string())?;
        let mut hashes: Vec<Option<[u8; 32]>> = vec![None; capacity];
        let mut take = |seq: u64, line: &str| -> Result<(), String> {
            let leaf: Leaf = serde_json::from_str(line)
                .map_err(|e| format!("record {seq} does not parse: {e}"))?;
            if leaf.seq != seq {
                return Err(format!(
                    "the line stored as record {seq} holds {}",
                    leaf.seq
                ));
            }
            let mut hash = [0u8; 32];
            hex::decode_to_slice(leaf.hash.as_bytes(), &mut hash)
                .map_err(|e| format!("record {seq}'s hash: {e}"))?;
            if let Some(slot) = usize::try_from(seq).ok().and_then(|i| hashes.get_mut(i)) {
                slot.get_or_insert(hash);
            }
            Ok(())
        };
        let mut failed = None;
        self.walk_record_lines(agent_id, 0, |_, seq, line| {
            if failed.is_some() || seq >= size {
                return false;
            }
            failed = take(seq, line).err();
            // Done after the last leaf: a row past it is not read (nor its seal checked).
            failed.is_none() && seq + 1 < size
        })
        .map_err(|e| e.to_string())?;
        if let Some(error) = failed {
            return Err(error);
        }
        hashes
            .into_iter()
            .enumerate()
            .map(|(seq, hash)| hash.ok_or_else(|| format!("record {seq} is not stored here")))
            .collect()
    }

    /// The record at `seq` of `agent_id`, telling a store that cannot be read at all
    /// apart from what is stored for this record not reading back (its row damaged,
    /// or its line not a record). A parse error names no content of the line.
    pub fn record_at(&self, agent_id: &str, seq: u64) -> Result<Option<Record>, RecordError> {
        let lines = self.record_lines(agent_id, seq, 1)?;
        let Some((found, line)) = lines.into_iter().next() else {
            return Ok(None);
        };
        if found != seq {
            return Ok(None);
        }
        Record::from_line(&line).map(Some).map_err(|e| {
            RecordError::Damaged(format!(
                "record {seq} does not parse (line {}, column {})",
                e.line(),
                e.column()
            ))
        })
    }

    /// [`Self::records`] as (seq, line), unparsed.
    fn record_lines(
        &self,
        agent_id: &str,
        from: u64,
        limit: usize,
    ) -> Result<Vec<(u64, String)>, RecordError> {
        let mut lines: BTreeMap<u64, String> = BTreeMap::new();
        let (mut from_overlay, mut from_tables) = (0, 0);
        self.walk_record_lines(agent_id, from, |copy, seq, line| {
            // The first copy met wins: the overlay's.
            lines.entry(seq).or_insert_with(|| line.to_string());
            let taken = match copy {
                LineCopy::Overlay => &mut from_overlay,
                LineCopy::Table => &mut from_tables,
            };
            *taken += 1;
            *taken < limit
        })?;
        Ok(lines.into_iter().take(limit).collect())
    }

    /// Walks `agent_id`'s stored record lines from seq `from`: the overlay's in order,
    /// then the tables' in order, each while `visit` returns true. A row leaves the
    /// overlay only after it is committed, so every applied row is met at least once; a
    /// row in both is met twice, the overlay's copy first. A row of the tables that does
    /// not read back, or records missing between rows (`record_rows::visit_lines`), end
    /// the walk with `RecordError::Damaged`; any other read error with `Store`.
    fn walk_record_lines(
        &self,
        agent_id: &str,
        from: u64,
        mut visit: impl FnMut(LineCopy, u64, &str) -> bool,
    ) -> Result<(), RecordError> {
        {
            let data = self.read_data();
            let overlay = data
                .unflushed
                .records
                .range((agent_id.to_string(), from)..=(agent_id.to_string(), u64::MAX));
            for ((_, seq), line) in overlay {
                if !visit(LineCopy::Overlay, *seq, line) {
                    break;
                }
            }
        }
        let store = |e: &dyn std::fmt::Display| RecordError::Store(e.to_string());
        let txn = self.db.begin_read().map_err(|e| store(&e))?;
        let table = txn.open_table(RECORDS).map_err(|e| store(&e))?;
        let packed = txn
            .open_table(record_rows::PACKED_RUNS)
            .map_err(|e| store(&e))?;
        record_rows::visit_lines(&table, &packed, agent_id, from, |seq, line| {
            visit(LineCopy::Table, seq, line)
        })
        .map_err(|e| match e {
            // Rows that do not unpack, records missing: this copy, not the store.
            redb::StorageError::Corrupted(why) => RecordError::Damaged(why),
            other => store(&other),
        })
    }

    /// System log lines with seq in `from..` (at most `limit`), from this node's copy
    /// (committed with their entry, so every applied one is in the table).
    pub fn system_log_lines(&self, from: u64, limit: usize) -> Result<Vec<String>, String> {
        let txn = self.db.begin_read().map_err(|e| e.to_string())?;
        system_log::lines(&txn, from, limit)
    }

    /// Heads-log leaves `start..end` from this node's copy.
    /// Runs `read` on the heads tree as applied (roots and proofs: `transparency::root_at`
    /// and the rest) and its by-agent index, in one read transaction opened under the
    /// data lock, so the size memory holds and the tables agree.
    pub fn read_heads_tree<T>(
        &self,
        read: impl FnOnce(&HeadsTreeView<'_>) -> T,
    ) -> Result<T, String> {
        let (txn, size) = {
            let data = self.read_data();
            let txn = self.db.begin_read().map_err(|e| e.to_string())?;
            (txn, data.heads.tree.size())
        };
        let open = |e: redb::TableError| format!("heads tables: {e}");
        let nodes = txn.open_table(heads_tree::HEADS_NODES).map_err(open)?;
        let leaves = txn
            .open_table(heads_leaves::HEADS_LEAF_RUNS)
            .map_err(open)?;
        let by_agent = txn.open_table(heads_tree::HEADS_BY_AGENT).map_err(open)?;
        Ok(read(&HeadsTreeView {
            tree: StoredTree {
                size,
                nodes: &nodes,
                leaves: &leaves,
            },
            by_agent: &by_agent,
        }))
    }

    /// Every size at which a heads round ended (each a checkpoint of the heads log).
    pub fn heads_rounds(&self) -> Result<Vec<u64>, String> {
        let txn = self.db.begin_read().map_err(|e| e.to_string())?;
        HeadsLog::rounds(&txn).map_err(|e| e.to_string())
    }

    /// The heads log's leaves `start..end` (up to its size), each checked: all of them,
    /// or an error, never fewer.
    pub fn heads_leaves(&self, start: u64, end: u64) -> Result<Vec<String>, String> {
        let (txn, size) = {
            let data = self.read_data();
            let txn = self.db.begin_read().map_err(|e| e.to_string())?;
            (txn, data.heads.tree.size())
        };
        let end = end.min(size).max(start);
        let leaves = HeadsLog::leaves(&txn, start, end).map_err(|e| e.to_string())?;
        if (leaves.len() as u64) < end - start {
            return Err(format!(
                "heads leaves {start}..{end}: only {} are stored",
                leaves.len()
            ));
        }
        Ok(leaves)
    }

    /// Marks an agent's copy on this node as untrustworthy: nothing is served or applied
    /// for it here until it is repaired.
    pub fn quarantine(&self, agent_id: &str, reason: String) {
        let mut data = self.write_data();
        data.agents
            .insert(agent_id.to_string(), AgentSlot::Quarantined(reason));
    }

    /// The answer stored under an idempotency key (scoped to its caller), if any. A row
    /// that cannot be read, or reads back changed, is an error: never "no answer", which
    /// would decide (and charge) again.
    pub fn idempotent_answer(
        &self,
        agent_id: &str,
        key: &str,
    ) -> Result<Option<IdempotentAnswer>, String> {
        let key_text = idempotency_key(agent_id, key);
        if let Some(row) = self.read_data().unflushed.idempotency.get(&key_text) {
            return idempotency_rows::decode(row, key).map(Some);
        }
        let read = |e: &dyn std::fmt::Display| format!("idempotency table: {e}");
        let txn = self.db.begin_read().map_err(|e| read(&e))?;
        let table = match txn.open_table(IDEMPOTENCY) {
            Ok(table) => table,
            // Nothing was ever stored under any key.
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(None),
            Err(e) => return Err(read(&e)),
        };
        match table.get(key_text.as_str()).map_err(|e| read(&e))? {
            Some(row) => idempotency_rows::decode(row.value(), key).map(Some),
            None => Ok(None),
        }
    }

    /// Removes up to `limit` idempotency answers stored before `cutoff_secs`
    /// (`idempotency_expiry`; one that no longer matches its index row is indexed again
    /// at `now_secs`). Only committed rows are indexed, so an answer still waiting for
    /// the writer is never among them; committed rows are dropped from the overlay
    /// first, where reads would otherwise still find an answer removed here.
    pub fn prune_idempotency_answers(
        &self,
        cutoff_secs: u64,
        now_secs: u64,
        limit: usize,
    ) -> Result<idempotency_expiry::Pruned, String> {
        if self.own_commits_wait() {
            return Ok(idempotency_expiry::Pruned::default()); // a removal is a commit too
        }
        let flushed = self.writer.flushed_through();
        self.write_data().unflushed.prune(flushed);
        idempotency_expiry::prune(&self.db, cutoff_secs, now_secs, limit)
    }

    /// Writes the state of every agent changed since its last checkpoint, durably. The
    /// states are read, and the write transaction begun, under the data lock: they match
    /// the committed records (both are published under that lock), and no later commit
    /// (an install, a heads round) can land before this one. Packing and sealing them,
    /// the slow part (about 10 µs an agent), runs after the lock is released, so applies
    /// go on meanwhile; commits of other writers wait for this one. Below the disk
    /// reserve nothing is written and the agents stay due (start-up replays more).
    pub fn checkpoint_agents(&self) -> Result<usize, StorageError> {
        if self.own_commits_wait() {
            return Ok(0);
        }
        self.checkpoint_due_agents()
    }

    /// [`Self::checkpoint_agents`], the disk already looked at.
    fn checkpoint_due_agents(&self) -> Result<usize, StorageError> {
        let (txn, states, dirty) = {
            let mut data = self.write_data();
            // Checkpoints must not run ahead of the records and last applied id they follow.
            self.flush()?;
            let dirty = std::mem::take(&mut data.dirty);
            let count = dirty.len();
            let mut states = Vec::with_capacity(count);
            for agent_id in dirty {
                if let Some(AgentSlot::Active(state)) = data.agents.get(&agent_id) {
                    let json = agent_checkpoint::json(state).map_err(sm_err)?;
                    states.push((agent_id, json));
                }
            }
            let txn = self.db.begin_write().map_err(sm_write_err)?;
            (txn, states, count)
        };
        {
            let mut table = txn.open_table(AGENT_CHECKPOINTS).map_err(sm_write_err)?;
            for (agent_id, json) in &states {
                let row = agent_checkpoint::row(json).map_err(sm_err)?;
                table
                    .insert(agent_id.as_str(), row.as_slice())
                    .map_err(sm_write_err)?;
            }
        }
        // Counted from the commit: the packing before it is CPU.
        let _in_flight = self.writer.state_file_write();
        txn.commit().map_err(sm_write_err)?;
        Ok(dirty)
    }
}

impl StateMachine {
    /// Packs the raw record rows of the agents with rows committed since the last call
    /// (`record_rows::merge_tail`, `SmWriter::take_committed`), at most `merge_budget`
    /// bytes of rows per call (the rest waits for the next).
    /// An agent whose few raw rows are not worth a repack yet waits for its next
    /// write; `all` (at a snapshot) packs every agent's rows however few. Runs beside
    /// applies: only rows already committed are rewritten, in one write transaction the
    /// writer's commits wait for, committed durably (a crash leaves the old rows or the
    /// packed ones, the same records). Returns the bytes of rows rewritten. A pass writes
    /// the packed runs before it frees the raw rows: below the disk reserve it waits, its
    /// agents still due (`disk_full.rs` saw one meet ENOSPC and the node exit), and above
    /// it a pass reads about half the free bytes above the reserve at most.
    pub fn merge_record_runs(&self, all: bool) -> Result<usize, StorageError> {
        match self.headroom_for_own_commits() {
            Some(headroom) => self.merge_within(all, merge_budget(headroom)),
            None => Ok(0),
        }
    }

    /// [`Self::merge_record_runs`] rewriting about `budget` bytes of raw rows at most.
    fn merge_within(&self, all: bool, budget: usize) -> Result<usize, StorageError> {
        let agents: Vec<String> = if all {
            self.writer.take_committed();
            self.read_data().agents.keys().cloned().collect()
        } else {
            self.writer.take_committed().into_iter().collect()
        };
        if agents.is_empty() {
            return Ok(0);
        }
        let mut later = Vec::new();
        let mut rewritten = 0;
        // Durable (an fsync a pass): redb reuses the pages a commit frees only after a
        // durable commit, and the writer's come every few seconds; with this pass's
        // commits made without one, the raw rows it frees and the pages it rewrites were
        // fresh pages each time, and the file grew to twice what a durable pass left it
        // at (10,000 agents, 1M records: 1.93 GB before a restart, against 0.96 GB).
        let txn = self.db.begin_write().map_err(sm_write_err)?;
        {
            let mut table = txn.open_table(RECORDS).map_err(sm_write_err)?;
            let mut packed = txn
                .open_table(record_rows::PACKED_RUNS)
                .map_err(sm_write_err)?;
            for agent_id in agents {
                if rewritten >= budget {
                    later.push(agent_id); // for the next pass
                    continue;
                }
                let limit = (budget - rewritten).min(record_rows::MERGE_LIMIT_BYTES);
                let merged =
                    record_rows::merge_tail(&mut table, &mut packed, &agent_id, all, limit)
                        .map_err(sm_write_err)?;
                match merged {
                    record_rows::Merged::Rewrote(bytes) => rewritten += bytes,
                    record_rows::Merged::Partly(bytes) => {
                        rewritten += bytes;
                        later.push(agent_id); // the rest of its rows
                    }
                    record_rows::Merged::Inconsistent => tracing::error!(
                        agent_id = %agent_id,
                        "stored record rows do not fit together: not merged (the scrub checks them)"
                    ),
                    record_rows::Merged::Nothing | record_rows::Merged::NotYet => {}
                }
            }
        }
        if rewritten == 0 {
            txn.abort().map_err(sm_write_err)?;
        } else {
            // Counted from the commit: the pass before it is mostly compression.
            let _in_flight = self.writer.state_file_write();
            txn.commit().map_err(sm_write_err)?;
        }
        for agent_id in later {
            self.writer.put_back(agent_id);
        }
        Ok(rewritten)
    }

    /// Makes every commit so far durable (an empty commit with an fsync: redb's commits
    /// are ordered, so it carries the ones made without).
    fn make_durable(&self) -> Result<(), StorageError> {
        let txn = self.db.begin_write().map_err(sm_write_err)?;
        let _in_flight = self.writer.state_file_write();
        txn.commit().map_err(sm_write_err)
    }
}

/// Bytes of raw rows one merge pass reads at most with `headroom` bytes free above the
/// disk reserve: four merge limits, and half that headroom (the packed runs are written
/// before the raw rows' pages are freed; a pass may pass it by one row and the agent's
/// open packed run, a few KiB).
fn merge_budget(headroom: u64) -> usize {
    let limit = 4 * record_rows::MERGE_LIMIT_BYTES;
    usize::try_from(headroom / 2).map_or(limit, |half| half.min(limit))
}

/// Replays `agent_id`'s stored records onto `slot` from where its state is (all of
/// them for a quarantined one), stopping at the first that does not apply, which
/// quarantines it. Returns how many records were read.
fn replay_stored(
    records: &impl record_rows::RawRows,
    packed: &impl record_rows::PackedRows,
    agent_id: &str,
    slot: &mut AgentSlot,
) -> Result<u64, redb::StorageError> {
    let from = match &*slot {
        AgentSlot::Active(state) => state.next_seq(),
        AgentSlot::Quarantined(_) => 0,
    };
    let mut replayed = 0;
    let read = record_rows::visit_lines(records, packed, agent_id, from, |_, line| {
        replayed += 1;
        let outcome = match Record::from_line(line) {
            Ok(record) => fold_into(slot, agent_id, std::slice::from_ref(&record)),
            Err(e) => ApplyOutcome::Rejected(format!("malformed stored record: {e}")),
        };
        match outcome {
            ApplyOutcome::Rejected(reason) => {
                if !matches!(slot, AgentSlot::Quarantined(_)) {
                    *slot = AgentSlot::Quarantined(reason);
                }
                false
            }
            ApplyOutcome::Applied => true,
        }
    });
    match read {
        Ok(()) => Ok(replayed),
        // A damaged row (a packed run that does not unpack) is this agent's copy gone
        // bad, like a line that does not parse: the agent is quarantined, the node starts.
        Err(redb::StorageError::Corrupted(why)) => {
            let reason = format!("stored records damaged: {why}");
            tracing::error!(agent_id, reason, "agent quarantined on this node");
            *slot = AgentSlot::Quarantined(reason);
            Ok(replayed)
        }
        Err(e) => Err(e),
    }
}

/// Whether any agent's end is stored (a data directory this version has written to).
fn any_record_end(txn: &redb::ReadTransaction) -> Result<bool, String> {
    match txn.open_table(record_ends::RECORD_ENDS) {
        Ok(ends) => Ok(!redb::ReadableTableMetadata::is_empty(&ends).map_err(|e| e.to_string())?),
        Err(redb::TableError::TableDoesNotExist(_)) => Ok(false),
        Err(e) => Err(e.to_string()),
    }
}

/// Takes every agent's end from its rows when the ends are not current as of the last
/// applied id ([`ENDS_APPLIED_KEY`]): a data directory from before ends were kept, or
/// one an older build has written to since. What the rows hold then is trusted, as
/// before ends were kept; from here on a cut is caught.
fn refill_stale_ends(txn: &redb::WriteTransaction) -> Result<(), redb::Error> {
    let mut meta = txn.open_table(SM_META)?;
    let applied = meta.get(APPLIED_KEY)?.map(|v| v.value().to_vec());
    let ends_applied = meta.get(ENDS_APPLIED_KEY)?.map(|v| v.value().to_vec());
    if applied == ends_applied {
        return Ok(());
    }
    let agents = record_ends::refill(txn, RECORDS, AGENT_INDEX)?;
    match &applied {
        Some(applied) => meta.insert(ENDS_APPLIED_KEY, applied.as_slice())?,
        None => meta.remove(ENDS_APPLIED_KEY)?,
    };
    tracing::warn!(
        agents,
        "where each agent's records end taken from its rows: they were not current (a data \
         directory from before they were kept, or one an older build wrote to)"
    );
    Ok(())
}

/// Records the last applied log id (with the record ends' copy of it) and membership in
/// `txn` (the writer thread stores the same keys for the batches it commits).
fn write_applied(
    txn: &redb::WriteTransaction,
    applied: &Option<LogId<NodeId>>,
    membership: &StoredMembership<NodeId, BasicNode>,
) -> Result<(), StorageError> {
    let mut meta = txn.open_table(SM_META).map_err(sm_write_err)?;
    let applied = meta_row(applied)?;
    meta.insert(APPLIED_KEY, applied.as_slice())
        .map_err(sm_write_err)?;
    meta.insert(ENDS_APPLIED_KEY, applied.as_slice())
        .map_err(sm_write_err)?;
    meta.insert(MEMBERSHIP_KEY, meta_row(membership)?.as_slice())
        .map_err(sm_write_err)?;
    Ok(())
}

/// The last applied id and the membership are stored sealed (`checked_row`): a changed
/// byte that still parsed would make openraft skip entries, or re-apply them, silently.
fn meta_row<T: Serialize>(value: &T) -> Result<Vec<u8>, StorageError> {
    Ok(checked_row::seal(
        &serde_json::to_vec(value).map_err(sm_write_err)?,
    ))
}

/// Whether the state machine's own bookkeeping in `db` reads back intact (sealed, or an
/// older plain row): the last applied id, the membership, the system log and the import
/// rows. A store that fails is rebuilt, not trusted (`store::open_state_db`).
pub fn meta_intact(db: &Database) -> Result<(), String> {
    let txn = db.begin_read().map_err(|e| e.to_string())?;
    let meta = match txn.open_table(SM_META) {
        Ok(meta) => meta,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(()),
        Err(e) => return Err(e.to_string()),
    };
    if let Some(v) = meta.get(APPLIED_KEY).map_err(|e| e.to_string())? {
        checked_row::unseal_json::<Option<LogId<NodeId>>>(v.value())
            .map_err(|e| format!("last applied id: {e}"))?;
    }
    if let Some(v) = meta.get(MEMBERSHIP_KEY).map_err(|e| e.to_string())? {
        checked_row::unseal_json::<StoredMembership<NodeId, BasicNode>>(v.value())
            .map_err(|e| format!("membership: {e}"))?;
    }
    if let Some(v) = meta.get(FORMAT_KEY).map_err(|e| e.to_string())? {
        checked_row::unseal_json::<u64>(v.value()).map_err(|e| format!("format: {e}"))?;
    }
    // The record ends' marker, damaged or lost, would read as stale and have the ends
    // taken from the rows as they are (a cut among them accepted). It is absent only in
    // a data directory from before ends were kept, which has none.
    let applied = meta.get(APPLIED_KEY).map_err(|e| e.to_string())?.is_some();
    match meta.get(ENDS_APPLIED_KEY).map_err(|e| e.to_string())? {
        Some(v) => {
            checked_row::unseal_json::<Option<LogId<NodeId>>>(v.value())
                .map_err(|e| format!("last applied id of the record ends: {e}"))?;
            if !applied {
                return Err(
                    "the last applied id is missing, the record ends' copy of it is not".into(),
                );
            }
        }
        None if applied && any_record_end(&txn)? => {
            return Err("the record ends' last applied id is missing".into());
        }
        None => {}
    }
    // The system log and the imports' rows are sealed too. None may be skipped as
    // absent: a lost revocation would let a revoked token back in, a lost import marker
    // would serve a half-imported agent, a lost tombstone would free a tampered log's id.
    system_log::lines(&txn, 0, usize::MAX)?;
    super::imports::markers(&txn)?;
    super::imports::tombstones(&txn)?;
    super::imports::import_points(&txn)?;
    // Every root this node will sign is computed from the heads tree's right edge.
    heads::check_right_edge(&txn)?;
    Ok(())
}

impl RaftStateMachine<TypeConfig> for StateMachine {
    type SnapshotBuilder = Self;

    async fn applied_state(
        &mut self,
    ) -> Result<(Option<LogId<NodeId>>, StoredMembership<NodeId, BasicNode>), StorageError> {
        let data = self.read_data();
        Ok((data.last_applied, data.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<BatchOutcome>, StorageError>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + Send,
        I::IntoIter: Send,
    {
        let entries: Vec<_> = entries.into_iter().collect();
        if self.applies_without_waiting(&entries) {
            // Memory work only (a few hundred µs for a full batch): a hop to a blocking
            // thread and back cost the leader's answer about as much again.
            return self.apply_batch(entries);
        }
        let this = self.clone();
        // redb commits fsync, and the log or the writer may make it wait; keep that
        // off the async worker threads.
        tokio::task::spawn_blocking(move || this.apply_batch(entries))
            .await
            .map_err(sm_write_err)?
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<SnapshotSpool>, StorageError> {
        // In memory when the data directory cannot take a spool: the install that follows
        // may still fail for want of space, but that is the install's to say.
        let spool = snapshot::spool(&self.spool_dir)
            .or_else(|e| {
                tracing::warn!(error = %e, "cannot spool a received snapshot on disk; in memory");
                snapshot::memory_spool()
            })
            .map_err(|e| {
                StorageError::from(StorageIOError::write_snapshot(
                    None,
                    openraft::AnyError::new(&e),
                ))
            })?;
        Ok(Box::new(SnapshotSpool::receiving(spool)))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<NodeId, BasicNode>,
        snapshot: Box<SnapshotSpool>,
    ) -> Result<(), StorageError> {
        let (spool, seal) = snapshot.into_file().await.map_err(sm_write_err)?;
        let this = self.clone();
        let owned_meta = meta.clone();
        // Parsing and writing a whole state: off the async workers.
        tokio::task::spawn_blocking(move || this.install_from(&owned_meta, spool, seal))
            .await
            .map_err(sm_write_err)??;
        self.note_snapshot(meta);
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<TypeConfig>>, StorageError> {
        self.snapshot_now().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_merge_pass_reads_at_most_half_the_headroom_and_four_limits() {
        assert_eq!(merge_budget(0), 0);
        assert_eq!(merge_budget(1), 0);
        assert_eq!(merge_budget(10 << 20), 5 << 20);
        let limit = 4 * record_rows::MERGE_LIMIT_BYTES;
        assert_eq!(merge_budget(u64::MAX), limit);
        assert_eq!(merge_budget(2 * limit as u64 + 2), limit);
    }
}
