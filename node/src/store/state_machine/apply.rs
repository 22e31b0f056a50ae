//! Apply: each write checked to extend its agent's head, then folded; rows handed to the
//! writer; heads-log entries.

use std::borrow::{Borrow, Cow};

use lineage_core::guard::AgentState;
use lineage_core::record::{timestamp, Record, ZERO_HASH};
use openraft::{Entry, EntryPayload, LogId, StoredMembership};

use super::super::agent_slot::AgentSlot;
use super::super::idempotency_expiry;
use super::super::idempotency_rows;
use super::super::record_ends;
use super::super::sm_writer::RowBatch;
use super::overlay::MAX_UNFLUSHED_BATCHES;
use super::{idempotency_key, meta_row, sm_err, sm_write_err, write_applied, SmData, StateMachine};
use crate::raft_types::{
    AppendRecords, ApplyOutcome, Batch, BatchOutcome, ImportStep, NodeId, Proposal, RecordLine,
    StorageError, TypeConfig,
};

/// Checks that `records` extend `state`'s head (seq, prev_hash, recomputed hash, actor)
/// without changing anything.
pub fn check_extends<R: Borrow<Record>>(
    state: &AgentState,
    agent_id: &str,
    records: &[R],
) -> Result<(), String> {
    let head_hash = state.head.as_ref().map_or(ZERO_HASH, |h| h.hash.as_str());
    lineage_core::record::check_chain(state.next_seq(), head_hash, agent_id, records)
}

/// Checks and folds `records` into `slot`. A chain mismatch rejects the entry and
/// changes nothing; a record the guard fold refuses after the chain checked out means
/// the leader wrote something no guard decides, so the agent is quarantined (on every
/// node alike) rather than left half-applied.
pub(super) fn fold_into<R: Borrow<Record>>(
    slot: &mut AgentSlot,
    agent_id: &str,
    records: &[R],
) -> ApplyOutcome {
    let state = match slot {
        AgentSlot::Quarantined(reason) => {
            return ApplyOutcome::Rejected(format!("agent is quarantined: {reason}"))
        }
        AgentSlot::Active(state) => state,
    };
    if let Err(reason) = check_extends(state, agent_id, records) {
        return ApplyOutcome::Rejected(reason);
    }
    for record in records {
        let record: &Record = record.borrow();
        if let Err(e) = state.apply(record) {
            let reason = format!("seq {}: {e}", record.seq);
            *slot = AgentSlot::Quarantined(reason.clone());
            return ApplyOutcome::Rejected(reason);
        }
    }
    ApplyOutcome::Applied
}

impl StateMachine {
    pub(super) fn apply_batch(
        &self,
        entries: Vec<Entry<TypeConfig>>,
    ) -> Result<Vec<BatchOutcome>, StorageError> {
        // Log entries are durable in order: waiting for the last covers them all. Waited
        // before the lock, so readers go on meanwhile.
        if let (Some(log), Some(last)) = (&self.durable_log, entries.last()) {
            log.wait_durable(last.log_id).map_err(sm_err)?;
        }
        // Errors end here for good: openraft stops the node on a state machine error, and
        // a restart rebuilds memory from disk and re-applies from the log.
        let mut outcomes = Vec::with_capacity(entries.len());
        let mut run = Vec::new();
        for entry in entries {
            match entry.payload {
                EntryPayload::Normal(proposal) if !matches!(proposal, Proposal::Writes(_)) => {
                    if !run.is_empty() {
                        outcomes.extend(self.apply_run(std::mem::take(&mut run))?);
                    }
                    outcomes.push(self.apply_own_commit(entry.log_id, proposal)?);
                }
                payload => run.push(Entry {
                    log_id: entry.log_id,
                    payload,
                }),
            }
        }
        if !run.is_empty() {
            outcomes.extend(self.apply_run(run)?);
        }
        Ok(outcomes)
    }

    /// Applies writes (and blank and membership entries) under the lock, their rows
    /// handed to the writer. A wait for the writer is made without the lock, so readers
    /// go on meanwhile: the writer's backlog is only the apply's own rows, and nothing
    /// else applies while this thread waits.
    fn apply_run(
        &self,
        entries: Vec<Entry<TypeConfig>>,
    ) -> Result<Vec<BatchOutcome>, StorageError> {
        let mut data = self.write_data();
        self.writer.check().map_err(sm_err)?;
        data.unflushed.prune(self.writer.flushed_through());
        if data.unflushed.batches.len() >= MAX_UNFLUSHED_BATCHES {
            // The writer is behind: wait for it rather than grow the overlay.
            drop(data);
            self.writer.barrier().map_err(sm_err)?;
            data = self.write_data();
            data.unflushed.prune(self.writer.flushed_through());
        }
        let outcomes = self.apply_writes_locked(&mut data, entries)?;
        drop(data);
        if self.writer.writes_through() {
            self.writer.barrier().map_err(sm_err)?;
        }
        Ok(outcomes)
    }

    /// A heads round, a witnessed note, an operator change or an import step: committed
    /// on its own once the writer has committed every earlier row (waited for without
    /// the lock), so redb never holds them out of order.
    fn apply_own_commit(
        &self,
        log_id: LogId<NodeId>,
        proposal: Proposal,
    ) -> Result<BatchOutcome, StorageError> {
        self.writer.barrier().map_err(sm_err)?;
        let mut data = self.write_data();
        self.writer.check().map_err(sm_err)?;
        let outcome = self.apply_heads_entry(&mut data, log_id, proposal)?;
        Ok(BatchOutcome(vec![outcome]))
    }

    /// Whether `apply_batch` would neither wait nor commit to redb: only writes (and
    /// blank or membership entries), their log entries already on disk, the writer
    /// neither behind nor writing through. Only openraft's apply task adds to the
    /// writer's backlog and durability never goes back, so this holds through the
    /// apply. The apply may still wait for the data lock, as request handlers do (a
    /// snapshot holds it while it checkpoints agents).
    pub(super) fn applies_without_waiting(&self, entries: &[Entry<TypeConfig>]) -> bool {
        let only_writes = entries.iter().all(|entry| {
            matches!(
                entry.payload,
                EntryPayload::Blank
                    | EntryPayload::Membership(_)
                    | EntryPayload::Normal(Proposal::Writes(_))
            )
        });
        let on_disk = match (&self.durable_log, entries.last()) {
            (Some(log), Some(last)) => log.is_durable(last.log_id).unwrap_or(false),
            _ => true,
        };
        only_writes
            && on_disk
            && !self.writer.writes_through()
            && self.read_data().unflushed.batches.len() + 1 < MAX_UNFLUSHED_BATCHES
    }

    /// Folds writes into memory and hands their rows to the writer (`apply_run`).
    fn apply_writes_locked(
        &self,
        data: &mut SmData,
        entries: Vec<Entry<TypeConfig>>,
    ) -> Result<Vec<BatchOutcome>, StorageError> {
        let mut outcomes = Vec::with_capacity(entries.len());
        let mut rows = self.new_rows();
        for entry in entries {
            let batch = match entry.payload {
                EntryPayload::Blank => {
                    data.last_applied = Some(entry.log_id);
                    outcomes.push(BatchOutcome::default());
                    continue;
                }
                EntryPayload::Membership(m) => {
                    data.last_applied = Some(entry.log_id);
                    data.membership = StoredMembership::new(Some(entry.log_id), m);
                    outcomes.push(BatchOutcome::default());
                    continue;
                }
                EntryPayload::Normal(Proposal::Writes(batch)) => batch,
                EntryPayload::Normal(_) => {
                    return Err(sm_err(
                        "an entry that commits on its own was given to the writes' apply".into(),
                    ));
                }
            };
            data.last_applied = Some(entry.log_id);
            let Batch(batch) = batch;
            let mut batch_outcomes = Vec::with_capacity(batch.len());
            for append in batch.iter() {
                if data.imports.contains_key(&append.agent_id)
                    || data.tombstones.contains_key(&append.agent_id)
                {
                    let reason =
                        format!("agent id {} is being imported or reserved", append.agent_id);
                    batch_outcomes.push(ApplyOutcome::Rejected(reason));
                    continue;
                }
                if let Some(reason) = append
                    .authority
                    .as_ref()
                    .and_then(|authority| authority.revoked(&data.operators, &append.agent_id))
                {
                    batch_outcomes.push(ApplyOutcome::Rejected(reason));
                    continue;
                }
                // Lines that arrived are parsed here, not on the append path.
                let records = match append
                    .records
                    .iter()
                    .map(RecordLine::record)
                    .collect::<Result<Vec<_>, _>>()
                {
                    Ok(records) => records,
                    Err(reason) => {
                        batch_outcomes.push(ApplyOutcome::Rejected(reason));
                        continue;
                    }
                };
                let slot = data
                    .agents
                    .entry(append.agent_id.clone())
                    .or_insert_with(|| AgentSlot::Active(Box::default()));
                let outcome = fold_into(slot, &append.agent_id, &records);
                if outcome == ApplyOutcome::Applied {
                    data.heads.mark_if_grown(&append.agent_id, slot);
                    add_rows(append, &records, &mut rows)?;
                    data.dirty.insert(append.agent_id.clone());
                } else if matches!(slot, AgentSlot::Active(s) if s.head.is_none()) {
                    // A rejected first write leaves no agent behind.
                    data.agents.remove(&append.agent_id);
                }
                batch_outcomes.push(outcome);
            }
            outcomes.push(BatchOutcome(batch_outcomes));
        }
        self.send_rows(data, rows)?;
        Ok(outcomes)
    }

    fn new_rows(&self) -> RowBatch {
        RowBatch {
            seq: self
                .next_batch
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                + 1,
            ..RowBatch::default()
        }
    }

    /// Puts a batch's rows in the overlay and queues them for the writer, with the last
    /// applied log id as of now.
    fn send_rows(&self, data: &mut SmData, mut rows: RowBatch) -> Result<(), StorageError> {
        rows.applied = meta_row(&data.last_applied)?;
        rows.membership = meta_row(&data.membership)?;
        data.unflushed.add(&rows);
        self.writer.send(rows).map_err(sm_err)?;
        Ok(())
    }

    /// Commits a heads round, a witnessed note or an operator change with the last
    /// applied id, in one transaction (every earlier row is committed already).
    fn apply_heads_entry(
        &self,
        data: &mut SmData,
        log_id: LogId<NodeId>,
        proposal: Proposal,
    ) -> Result<ApplyOutcome, StorageError> {
        let mut txn = self.db.begin_write().map_err(sm_write_err)?;
        // Its pages may reach the disk before the commit (redb's write buffer).
        let _in_flight = self.writer.state_file_write();
        if !self.writer.take_durable_turn() {
            txn.set_durability(redb::Durability::None);
        }
        let outcome = match proposal {
            Proposal::HeadsRound { origin } => {
                let SmData { heads, agents, .. } = &mut *data;
                heads
                    .apply_round(&origin, agents, &txn)
                    .map_err(sm_write_err)?;
                ApplyOutcome::Applied
            }
            Proposal::Witnessed { note } => match data
                .heads
                .apply_witnessed(&note, &txn)
                .map_err(sm_write_err)?
            {
                Ok(()) => ApplyOutcome::Applied,
                Err(reason) => ApplyOutcome::Rejected(reason),
            },
            Proposal::System { records } => {
                let parsed: Result<Vec<Record>, String> = records
                    .iter()
                    .map(|line| line.record().map(Cow::into_owned))
                    .collect();
                match parsed.and_then(|parsed| data.operators.apply(&parsed).map(|()| parsed)) {
                    Ok(parsed) => {
                        let lines = parsed
                            .iter()
                            .map(|r| r.seq)
                            .zip(records.iter().map(RecordLine::line));
                        super::super::system_log::append(&txn, lines).map_err(sm_write_err)?;
                        ApplyOutcome::Applied
                    }
                    Err(reason) => ApplyOutcome::Rejected(reason),
                }
            }
            Proposal::Import(step) => apply_import(data, &txn, step)?,
            Proposal::Writes(_) => {
                return Err(sm_err(
                    "writes are not committed one entry at a time".into(),
                ));
            }
        };
        data.last_applied = Some(log_id);
        write_applied(&txn, &data.last_applied, &data.membership)?;
        txn.commit().map_err(sm_write_err)?;
        Ok(outcome)
    }
}

/// One import step (`store::imports`), committed with its entry. A step that does not
/// hold (an agent that exists, records that do not extend the import's head or are not
/// signed by the log's key, a commit at another head) is rejected and changes nothing.
fn apply_import(
    data: &mut SmData,
    txn: &redb::WriteTransaction,
    step: ImportStep,
) -> Result<ApplyOutcome, StorageError> {
    use super::super::imports::remove_marker;
    let rejected = |reason: String| Ok(ApplyOutcome::Rejected(reason));
    let parse = |lines: &[RecordLine]| -> Result<Vec<Record>, String> {
        lines
            .iter()
            .map(|line| line.record().map(Cow::into_owned))
            .collect()
    };
    match step {
        ImportStep::Begin { agent_id, manifest } => apply_begin(data, txn, agent_id, manifest),
        ImportStep::Tombstone {
            agent_id,
            tombstone,
        } => apply_tombstone(data, txn, agent_id, tombstone),
        ImportStep::Abort { agent_id } => {
            if data.imports.remove(&agent_id).is_none() {
                return rejected(format!("no import of {agent_id} is under way"));
            }
            remove_marker(txn, &agent_id).map_err(sm_err)?;
            remove_lines(txn, &agent_id)?;
            Ok(ApplyOutcome::Applied)
        }
        ImportStep::Records { agent_id, records } => {
            let Some(importing) = data.imports.get_mut(&agent_id) else {
                return rejected(format!("no import of {agent_id} is under way"));
            };
            let parsed = match parse(&records) {
                Ok(parsed) => parsed,
                Err(reason) => return rejected(reason),
            };
            match importing.extended(&agent_id, &parsed) {
                Ok(state) => {
                    store_lines(txn, &agent_id, &parsed, &records)?;
                    importing.state = state;
                    Ok(ApplyOutcome::Applied)
                }
                Err(reason) => rejected(reason),
            }
        }
        ImportStep::Commit {
            agent_id,
            head,
            sealed,
        } => {
            let Some(importing) = data.imports.get(&agent_id) else {
                return rejected(format!("no import of {agent_id} is under way"));
            };
            if importing.state.head.as_ref() != Some(&head) {
                return rejected(format!(
                    "the import of {agent_id} is at {:?}, not at {head}",
                    importing.state.head
                ));
            }
            if importing
                .manifest
                .head
                .as_ref()
                .is_some_and(|end| *end != head)
            {
                return rejected(format!(
                    "the import of {agent_id} began from a file ending at {:?}, not at {head}",
                    importing.manifest.head
                ));
            }
            let parsed = match parse(&sealed) {
                Ok(parsed) => parsed,
                Err(reason) => return rejected(reason),
            };
            let state = if parsed.is_empty() {
                importing.state.clone()
            } else {
                match importing.extended(&agent_id, &parsed) {
                    Ok(state) => state,
                    Err(reason) => return rejected(reason),
                }
            };
            store_lines(txn, &agent_id, &parsed, &sealed)?;
            remove_marker(txn, &agent_id).map_err(sm_err)?;
            data.imports.remove(&agent_id);
            let point = super::super::imports::ImportPoint::of(&state);
            super::super::imports::put_import_point(txn, &agent_id, &point).map_err(sm_err)?;
            data.import_points.insert(agent_id.clone(), point);
            let slot = AgentSlot::Active(Box::new(state));
            data.heads.mark_if_grown(&agent_id, &slot);
            data.agents.insert(agent_id.clone(), slot);
            data.dirty.insert(agent_id);
            Ok(ApplyOutcome::Applied)
        }
    }
}

/// `ImportStep::Begin`: the agent opened as being imported, unless an agent, a tombstone
/// or another copy's import holds the id; the same source again is answered as done.
fn apply_begin(
    data: &mut SmData,
    txn: &redb::WriteTransaction,
    agent_id: String,
    manifest: crate::raft_types::ImportManifest,
) -> Result<ApplyOutcome, StorageError> {
    use super::super::imports::{put_marker, Importing};
    if data.agents.contains_key(&agent_id) {
        return Ok(ApplyOutcome::Rejected(format!("agent {agent_id} exists")));
    }
    if let Some(tombstone) = data.tombstones.get(&agent_id) {
        return Ok(ApplyOutcome::Rejected(format!(
            "agent id {agent_id} is reserved: its reference log failed verification ({})",
            tombstone.reason
        )));
    }
    if let Some(under_way) = data.imports.get(&agent_id) {
        // The same source again (a run resumed) is answered as done; another copy
        // (another genesis, head or file) may not finish this import.
        return if under_way.manifest == manifest {
            Ok(ApplyOutcome::Applied)
        } else {
            Ok(ApplyOutcome::Rejected(format!(
                "another copy of {agent_id}'s log is being imported (ending at {}, \
                 file sha256 {})",
                under_way
                    .manifest
                    .head
                    .as_ref()
                    .map_or("?".to_string(), ToString::to_string),
                under_way.manifest.source_sha256
            )))
        };
    }
    put_marker(txn, &agent_id, &manifest).map_err(sm_err)?;
    data.imports.insert(
        agent_id,
        Importing {
            manifest,
            state: AgentState::new(),
        },
    );
    Ok(ApplyOutcome::Applied)
}

/// A tombstone (`ImportStep::Tombstone`): the id reserved for good, unless an agent
/// holds it or is being imported under it. Again, it is answered as done.
fn apply_tombstone(
    data: &mut SmData,
    txn: &redb::WriteTransaction,
    agent_id: String,
    tombstone: crate::raft_types::Tombstone,
) -> Result<ApplyOutcome, StorageError> {
    if data.agents.contains_key(&agent_id) || data.imports.contains_key(&agent_id) {
        return Ok(ApplyOutcome::Rejected(format!(
            "agent {agent_id} exists or is being imported"
        )));
    }
    if let std::collections::btree_map::Entry::Vacant(entry) = data.tombstones.entry(agent_id) {
        super::super::imports::put_tombstone(txn, entry.key(), &tombstone).map_err(sm_err)?;
        entry.insert(tombstone);
    }
    Ok(ApplyOutcome::Applied)
}

/// Stores imported records (their lines as received) and the agent's index entry.
fn store_lines(
    txn: &redb::WriteTransaction,
    agent_id: &str,
    records: &[Record],
    lines: &[RecordLine],
) -> Result<(), StorageError> {
    if records.is_empty() {
        return Ok(());
    }
    let mut table = txn.open_table(super::RECORDS).map_err(sm_write_err)?;
    super::super::record_rows::insert_runs(
        &mut table,
        records
            .iter()
            .zip(lines)
            .map(|(record, line)| (agent_id, record.seq, line.line())),
    )
    .map_err(sm_write_err)?;
    if let Some(last) = records.last() {
        let mut ends = txn
            .open_table(record_ends::RECORD_ENDS)
            .map_err(sm_write_err)?;
        record_ends::put(&mut ends, agent_id, last.seq.saturating_add(1)).map_err(sm_write_err)?;
    }
    if records.first().is_some_and(|r| r.seq == 0) {
        let mut index = txn.open_table(super::AGENT_INDEX).map_err(sm_write_err)?;
        index.insert(agent_id, ()).map_err(sm_write_err)?;
    }
    Ok(())
}

/// Removes an aborted import's records, with its end and index entry.
fn remove_lines(txn: &redb::WriteTransaction, agent_id: &str) -> Result<(), StorageError> {
    let mut records = txn.open_table(super::RECORDS).map_err(sm_write_err)?;
    records
        .retain_in((agent_id, 0)..=(agent_id, u64::MAX), |_, _| false)
        .map_err(sm_write_err)?;
    let mut packed = txn
        .open_table(super::super::record_rows::PACKED_RUNS)
        .map_err(sm_write_err)?;
    packed
        .retain_in((agent_id, 0)..=(agent_id, u64::MAX), |_, _| false)
        .map_err(sm_write_err)?;
    let mut ends = txn
        .open_table(record_ends::RECORD_ENDS)
        .map_err(sm_write_err)?;
    ends.remove(agent_id).map_err(sm_write_err)?;
    let mut index = txn.open_table(super::AGENT_INDEX).map_err(sm_write_err)?;
    index.remove(agent_id).map_err(sm_write_err)?;
    Ok(())
}

/// An applied write's rows: its records as stored lines, its idempotency answer, and the
/// agent's index entry when the write creates it.
fn add_rows(
    append: &AppendRecords,
    records: &[Cow<'_, Record>],
    rows: &mut RowBatch,
) -> Result<(), StorageError> {
    for (line, record) in append.records.iter().zip(records) {
        rows.records
            .push((append.agent_id.clone(), record.seq, line.line().to_string()));
    }
    if let Some(answer) = &append.idempotency {
        let bytes = idempotency_rows::encode(answer).map_err(sm_write_err)?;
        rows.idempotency.push((
            idempotency_key(&append.agent_id, &answer.key),
            bytes,
            stored_secs(records),
        ));
    }
    if records.first().is_some_and(|r| r.seq == 0) {
        rows.new_agents.push(append.agent_id.clone());
    }
    Ok(())
}

/// When a write's answer counts as stored, for its expiry (`idempotency_expiry`): the
/// later of its last record's time, as the leader stamped it, and this node's clock
/// now, so that no node keeps it less than a window by its own clock (a leader's clock
/// behind, or a replica applying late). Pruning is each node's own; nothing applied
/// reads this time.
fn stored_secs(records: &[Cow<'_, Record>]) -> u64 {
    let stamped = records
        .last()
        .and_then(|record| timestamp::parse(&record.timestamp))
        .and_then(|micros| u64::try_from(micros / 1_000_000).ok())
        .unwrap_or_default();
    stamped.max(idempotency_expiry::now_secs())
}
