//! The heads log, part of the replicated state machine: one head statement per agent
//! whose log grew, appended in rounds, as an RFC 6962 tree whose checkpoints witnesses
//! cosign.
//!
//! A round is a Raft entry that carries nothing but the origin: every node builds the
//! round's statements from its own applied state at the entry's place in the log, so all
//! replicas append the same leaves (apply is deterministic) and the leader never has to
//! ship them. Checkpoints are signed when served: Ed25519 is deterministic, so every node
//! signs a given tree head identically.

use std::collections::{BTreeMap, BTreeSet};

use lineage_core::heads::HeadStatement;
use lineage_core::transparency::{self, Hash};
use redb::{ReadableTable, ReadableTableMetadata, TableDefinition};

use super::agent_slot::AgentSlot;
use super::heads_leaves::{self, LeafLookup, HEADS_LEAF_RUNS};
use super::heads_meta::{self, HEADS_META, INDEXED, ORIGIN, WITNESSED};
use super::heads_round_sizes::{self, HEADS_ROUNDS};
use super::heads_tree::{
    self, HeadsTree, StatedDigest, StoredTree, HEADS_BY_AGENT, HEADS_NODES, HEADS_STATED,
};

/// Leaf index → head statement (canonical JSON), sealed (`heads_tree::seal_leaf`): how
/// leaves were stored before runs (`heads_leaves`). Rows found here are moved into runs
/// at open ([`pack_old_leaves`]); nothing else reads them.
pub const HEADS_LEAVES: TableDefinition<u64, &str> = TableDefinition::new("heads_leaves");
/// Largest cosigned note accepted (a checkpoint with many cosignatures is ~2 KiB).
pub const MAX_WITNESSED_NOTE: usize = 64 * 1024;
/// Most signature lines a stored note may hold: `signed_note` refuses to parse one with
/// more, so a stored note past it could not be verified by anyone.
const MAX_NOTE_SIGNATURES: usize = 100;

/// What memory holds of the heads log: the tree's right edge, the last round, and per
/// agent the size it was last stated at; statements, interior nodes and rounds stay on
/// disk (`heads_tree`).
#[derive(Debug, Default)]
pub struct HeadsLog {
    pub origin: Option<String>,
    pub tree: HeadsTree,
    /// The size at which the last round ended.
    pub last_round: Option<u64>,
    /// The size each agent was last stated at.
    stated: BTreeMap<String, u64>,
    /// Agents whose logs grew since their last statement.
    pub pending: BTreeSet<String>,
    pub witnessed: Option<String>,
    /// Every agent's last statement, as stored with each round (`HEADS_STATED`).
    stated_digest: StatedDigest,
}

type StorageResult<T> = Result<T, redb::Error>;

impl HeadsLog {
    /// Rebuilds the heads log from its tables (indexed: [`index_if_needed`]); `agents`
    /// decides what is pending.
    pub fn load(
        txn: &redb::ReadTransaction,
        agents: &BTreeMap<String, AgentSlot>,
    ) -> StorageResult<HeadsLog> {
        let mut heads = HeadsLog::default();
        let meta = txn.open_table(HEADS_META)?;
        heads.origin = heads_meta::get(&meta, ORIGIN)?;
        heads.witnessed = heads_meta::get(&meta, WITNESSED)?;
        let leaves = txn.open_table(HEADS_LEAF_RUNS)?;
        let size = heads_leaves::count(&leaves)?;
        heads.tree = HeadsTree::load(size, &txn.open_table(HEADS_NODES)?, &leaves)?;
        heads.last_round = heads_round_sizes::last(&txn.open_table(HEADS_ROUNDS)?)?;
        let by_agent = txn.open_table(HEADS_BY_AGENT)?;
        // Stored by open's upgrade where it was missing, and checked there.
        heads.stated_digest = match heads_tree::stored_stated(&txn.open_table(HEADS_STATED)?)? {
            Some(digest) => digest,
            None => heads_tree::stated_digest(&by_agent)?,
        };
        // Each agent's last statement, read in leaf order so each run is unpacked once.
        let mut last_statements = Vec::new();
        for agent_id in agents.keys() {
            if let Some(index) = heads_tree::statement_below(&by_agent, agent_id, u64::MAX)? {
                last_statements.push((index, agent_id));
            }
        }
        last_statements.sort_unstable();
        let mut lookup = LeafLookup::new(&leaves);
        for (index, agent_id) in last_statements {
            let size = heads_tree::stated_size(&mut lookup, index, agent_id)?;
            heads.stated.insert(agent_id.clone(), size);
        }
        for (agent_id, slot) in agents {
            heads.mark_if_grown(agent_id, slot);
        }
        Ok(heads)
    }

    /// Notes that `agent_id` may have grown (called for every applied write).
    pub fn mark_if_grown(&mut self, agent_id: &str, slot: &AgentSlot) {
        if let AgentSlot::Active(state) = slot {
            if self.stated.get(agent_id).copied().unwrap_or(0) != state.next_seq() {
                self.pending.insert(agent_id.to_string());
            }
        }
    }

    /// Applies a round: appends a statement for every pending agent (sorted by id) and
    /// records the new tree size as a round. Returns how many statements it appended.
    pub fn apply_round(
        &mut self,
        origin: &str,
        agents: &BTreeMap<String, AgentSlot>,
        txn: &redb::WriteTransaction,
    ) -> StorageResult<usize> {
        let size_before = self.tree.size();
        let mut nodes = txn.open_table(HEADS_NODES)?;
        let mut by_agent = txn.open_table(HEADS_BY_AGENT)?;
        let mut leaves = Vec::new();
        for agent_id in std::mem::take(&mut self.pending) {
            let Some(AgentSlot::Active(state)) = agents.get(&agent_id) else {
                continue;
            };
            let Some(head) = &state.head else {
                continue;
            };
            if self.stated.get(&agent_id) == Some(&state.next_seq()) {
                continue;
            }
            let statement = HeadStatement {
                agent_id: agent_id.clone(),
                size: state.next_seq(),
                root: hex::encode(state.tree.root()),
                head_hash: head.hash.clone(),
            };
            let index = self.tree.size();
            let leaf = statement.to_leaf();
            self.tree.push(&leaf, &mut nodes)?;
            if let Some(previous) = heads_tree::statement_below(&by_agent, &agent_id, index)? {
                self.stated_digest.toggle(&agent_id, previous);
            }
            self.stated_digest.toggle(&agent_id, index);
            heads_tree::index_statement(&mut by_agent, &agent_id, index)?;
            self.stated.insert(agent_id, statement.size);
            leaves.push(leaf);
        }
        let appended = leaves.len();
        if appended > 0 {
            heads_leaves::append(&mut txn.open_table(HEADS_LEAF_RUNS)?, size_before, &leaves)?;
            let mut meta = txn.open_table(HEADS_META)?;
            // The first round fixes the origin; a node configured with another name
            // later does not change what every replica already signs under.
            if self.origin.is_none() {
                heads_meta::put(&mut meta, ORIGIN, origin)?;
                self.origin = Some(origin.to_string());
            }
            heads_meta::put(&mut meta, INDEXED, &self.tree.size().to_string())?;
            heads_tree::store_stated(&mut txn.open_table(HEADS_STATED)?, self.stated_digest)?;
            heads_round_sizes::add(&mut txn.open_table(HEADS_ROUNDS)?, self.tree.size())?;
            self.last_round = Some(self.tree.size());
        }
        Ok(appended)
    }

    /// Whether `size` with `root` is a checkpoint this log had.
    fn had_checkpoint(
        &self,
        size: u64,
        root: &Hash,
        txn: &redb::WriteTransaction,
    ) -> StorageResult<bool> {
        if size > self.tree.size()
            || !heads_round_sizes::contains(&txn.open_table(HEADS_ROUNDS)?, size)?
        {
            return Ok(false);
        }
        let nodes = txn.open_table(HEADS_NODES)?;
        let leaves = txn.open_table(HEADS_LEAF_RUNS)?;
        let tree = StoredTree {
            size: self.tree.size(),
            nodes: &nodes,
            leaves: &leaves,
        };
        // Within the tree, a failure is the tables' (a read error, a missing node): an
        // error, never a refusal that this node alone would record.
        let stored = transparency::root_at(&tree, size)
            .map_err(|e| redb::Error::Corrupted(format!("heads tree at size {size}: {e}")))?;
        Ok(&stored == root)
    }

    /// Stores a cosigned note for a checkpoint this log had, unless a later one is
    /// stored already; cosignatures for the stored size are merged.
    pub fn apply_witnessed(
        &mut self,
        note: &str,
        txn: &redb::WriteTransaction,
    ) -> StorageResult<Result<(), String>> {
        // A read error of the tables is an error, not a refusal this node alone records.
        let had = split_note(note)
            .ok()
            .and_then(|(text, _)| lineage_core::transparency::Checkpoint::parse(text).ok())
            .map(|c| self.had_checkpoint(c.size, &c.root, txn))
            .transpose()?
            .unwrap_or(false);
        let merged = match self.accept_witnessed(note, had) {
            Ok(merged) => merged,
            Err(reason) => return Ok(Err(reason)),
        };
        heads_meta::put(&mut txn.open_table(HEADS_META)?, WITNESSED, &merged)?;
        self.witnessed = Some(merged);
        Ok(Ok(()))
    }

    /// `had`: whether the note's checkpoint is one this log had (`had_checkpoint`).
    fn accept_witnessed(&self, note: &str, had: bool) -> Result<String, String> {
        if note.len() > MAX_WITNESSED_NOTE {
            return Err(format!("note is over {MAX_WITNESSED_NOTE} bytes"));
        }
        let (text, signatures) = split_note(note)?;
        let checkpoint = lineage_core::transparency::Checkpoint::parse(text)
            .map_err(|e| format!("not a checkpoint: {e}"))?;
        if self.origin.as_deref() != Some(checkpoint.origin.as_str()) {
            return Err(format!("origin {:?} is not this log's", checkpoint.origin));
        }
        if !had {
            return Err(format!(
                "size {} with this root is not a checkpoint of this log",
                checkpoint.size
            ));
        }
        let Some(current) = &self.witnessed else {
            return Ok(note.to_string());
        };
        let (current_text, current_signatures) = split_note(current)?;
        let current_size = lineage_core::transparency::Checkpoint::parse(current_text)
            .map(|c| c.size)
            .unwrap_or(0);
        if checkpoint.size < current_size {
            return Err(format!(
                "a checkpoint of size {current_size} is witnessed already"
            ));
        }
        if checkpoint.size > current_size {
            return Ok(note.to_string());
        }
        // One line per signer: a signer's new line (a witness cosigning the same size
        // again, at a later time) takes the place of its old one.
        let mut lines: Vec<&str> = current_signatures.lines().collect();
        for line in signatures.lines() {
            match lines
                .iter()
                .position(|kept| signer_of(kept) == signer_of(line))
            {
                Some(at) => lines[at] = line,
                None => lines.push(line),
            }
        }
        let merged = format!("{text}\n{}\n", lines.join("\n"));
        // Within what a note may hold, or auditors could not read it.
        if lines.len() > MAX_NOTE_SIGNATURES || merged.len() > MAX_WITNESSED_NOTE {
            return Err(format!(
                "merged with the stored note it would hold {} signatures in {} bytes (at most {MAX_NOTE_SIGNATURES} in {MAX_WITNESSED_NOTE})",
                lines.len(),
                merged.len()
            ));
        }
        Ok(merged)
    }

    /// The leaves `start..end`, each checked; a run missing inside the range is an error,
    /// never a shorter list (a snapshot sent from one would shift every later leaf on the
    /// follower).
    pub fn leaves(txn: &redb::ReadTransaction, start: u64, end: u64) -> StorageResult<Vec<String>> {
        heads_leaves::read(&txn.open_table(HEADS_LEAF_RUNS)?, start, end)
    }

    /// Replaces the tables' content (snapshot install).
    pub fn install(txn: &redb::WriteTransaction, body: &HeadsSnapshot) -> StorageResult<()> {
        txn.open_table(HEADS_LEAVES)?.retain(|_, _| false)?;
        heads_leaves::replace(&mut txn.open_table(HEADS_LEAF_RUNS)?, &body.leaves)?;
        let mut nodes = txn.open_table(HEADS_NODES)?;
        nodes.retain(|_, _| false)?;
        let mut by_agent = txn.open_table(HEADS_BY_AGENT)?;
        by_agent.retain(|_, _| false)?;
        let mut tree = HeadsTree::default();
        for (index, leaf) in body.leaves.iter().enumerate() {
            index_leaf(&mut tree, index as u64, leaf, &mut nodes, &mut by_agent)?;
        }
        heads_round_sizes::replace(&mut txn.open_table(HEADS_ROUNDS)?, &body.rounds)?;
        txn.delete_table(heads_round_sizes::OLD_HEADS_ROUNDS)?;
        txn.delete_table(heads_tree::OLD_HEADS_BY_AGENT)?;
        txn.delete_table(heads_meta::OLD_HEADS_META)?;
        let mut meta = txn.open_table(HEADS_META)?;
        meta.retain(|_, _| false)?;
        if let Some(origin) = &body.origin {
            heads_meta::put(&mut meta, ORIGIN, origin)?;
        }
        if let Some(note) = &body.witnessed {
            heads_meta::put(&mut meta, WITNESSED, note)?;
        }
        heads_meta::put(&mut meta, INDEXED, &tree.size().to_string())?;
        let stated = heads_tree::stated_digest(&by_agent)?;
        heads_tree::store_stated(&mut txn.open_table(HEADS_STATED)?, stated)?;
        heads_tree::mark_sealed(&mut meta)?;
        Ok(())
    }

    /// Every size at which a round ended, ascending, each checked.
    pub fn rounds(txn: &redb::ReadTransaction) -> StorageResult<Vec<u64>> {
        heads_round_sizes::all(&txn.open_table(HEADS_ROUNDS)?)
    }

    /// The tables' content for a snapshot. Every leaf indexed must be there: a body with
    /// fewer would have the follower append its next rounds at other indices.
    pub fn snapshot(txn: &redb::ReadTransaction) -> StorageResult<HeadsSnapshot> {
        let meta = txn.open_table(HEADS_META)?;
        let leaves = Self::leaves(txn, 0, u64::MAX)?;
        if let Some(indexed) = heads_meta::indexed(&meta)?.filter(|i| *i != leaves.len() as u64) {
            return Err(redb::Error::Corrupted(format!(
                "heads log: {} leaves are stored where {indexed} were indexed",
                leaves.len()
            )));
        }
        Ok(HeadsSnapshot {
            leaves,
            rounds: Self::rounds(txn)?,
            origin: heads_meta::get(&meta, ORIGIN)?,
            witnessed: heads_meta::get(&meta, WITNESSED)?,
        })
    }
}

/// Checks the rows the tree's right edge is read from (the leaves of the unfinished
/// chunk, one node per level), for the state machine's integrity check at open: every
/// later root is computed from them. Skipped where the rows are not sealed or the nodes
/// not indexed yet ([`upgrade`] does both at open); fewer leaves than were indexed is
/// damage in any case.
pub fn check_right_edge(txn: &redb::ReadTransaction) -> Result<(), String> {
    fn fail(e: &dyn std::fmt::Display) -> String {
        format!("heads log: {e}")
    }
    /// A table a data directory from before it does not have yet.
    fn optional<T>(table: Result<T, redb::TableError>) -> Result<Option<T>, String> {
        match table {
            Ok(table) => Ok(Some(table)),
            Err(redb::TableError::TableDoesNotExist(_)) => Ok(None),
            Err(other) => Err(fail(&other)),
        }
    }
    let settings = heads_meta::read_at_open(txn).map_err(|e| fail(&e))?;
    let indexed = settings.indexed;
    let fewer_than_indexed = |size: u64| none_lost(size, indexed).map_err(|e| fail(&e));
    // Leaves still stored one per row (before runs) are checked one by one when
    // `pack_old_leaves` moves them; here, only that none is missing at the end.
    if let Some(old) = optional(txn.open_table(HEADS_LEAVES))? {
        if let Some((last, _)) = old.last().map_err(|e| fail(&e))? {
            return fewer_than_indexed(last.value().saturating_add(1));
        }
    }
    let Some(leaves) = optional(txn.open_table(HEADS_LEAF_RUNS))? else {
        return fewer_than_indexed(0);
    };
    let size = heads_leaves::count(&leaves).map_err(|e| fail(&e))?;
    fewer_than_indexed(size)?;
    let Some(nodes) = optional(txn.open_table(HEADS_NODES))? else {
        return Ok(());
    };
    if indexed != Some(size) || !settings.rows_sealed {
        return Ok(());
    }
    HeadsTree::load(size, &nodes, &leaves).map_err(|e| fail(&e))?;
    // The last round is the checkpoint this node serves and signs by default: one whose
    // key changed (its seal) or beyond the tree (a row from before seals) would have it
    // sign a size it never had.
    let last_round = heads_round_sizes::last_at_open(txn).map_err(|e| fail(&e))?;
    if let Some(round) = last_round.filter(|round| *round > size) {
        return Err(fail(&format!(
            "round at size {round} is beyond the tree's {size} leaves"
        )));
    }
    Ok(())
}

/// Every round records the size it indexed to, in the same commit as its leaves: `size`
/// leaves stored where more were indexed is the last ones lost, and indexing them again
/// would shrink the tree.
fn none_lost(size: u64, indexed: Option<u64>) -> Result<(), String> {
    match indexed {
        Some(indexed) if indexed > size => Err(format!(
            "{size} leaves are stored where {indexed} were indexed"
        )),
        _ => Ok(()),
    }
}

/// Adds leaf `index` to the tree and the by-agent index.
fn index_leaf(
    tree: &mut HeadsTree,
    index: u64,
    leaf: &str,
    nodes: &mut redb::Table<(u8, u64), &[u8]>,
    by_agent: &mut redb::Table<(&str, u64), &[u8]>,
) -> StorageResult<()> {
    let statement = HeadStatement::from_leaf(leaf)
        .map_err(|e| redb::Error::Corrupted(format!("heads leaf {index}: {e}")))?;
    tree.push(leaf, nodes)?;
    heads_tree::index_statement(by_agent, &statement.agent_id, index)
}

/// The heads tables' one-time upgrades, at open, before anything reads them: the plain
/// settings sealed ([`heads_meta::move_old_rows`]), leaves from before seals sealed
/// ([`heads_tree::seal_if_needed`]), leaves stored one per row packed into runs
/// ([`pack_old_leaves`]), round sizes sealed ([`heads_round_sizes::move_old_rows`]), a
/// by-agent index from before seals dropped ([`heads_tree::drop_old_index`]), the nodes
/// and by-agent index built where they do not cover every leaf ([`index_if_needed`]), and
/// the agents' last statements summed up where that is not stored
/// ([`heads_tree::store_stated_if_missing`]; moved out of the settings first where two
/// builds of this session kept it, [`heads_tree::move_stated_out_of_settings`]).
/// `stated_kept`: the file's layout keeps that summary, so its row missing is damage. A
/// `Corrupted` error is damage in the file.
pub fn upgrade(db: &redb::Database, stated_kept: bool) -> StorageResult<()> {
    heads_meta::move_old_rows(db)?;
    heads_tree::seal_if_needed(db)?;
    pack_old_leaves(db)?;
    heads_round_sizes::move_old_rows(db)?;
    // Before the index may be built again: a rebuilt index stores its own digest.
    heads_tree::move_stated_out_of_settings(db)?;
    heads_tree::drop_old_index(db)?;
    index_if_needed(db)?;
    heads_tree::store_stated_if_missing(db, stated_kept)
}

/// Moves leaves stored one per row (`HEADS_LEAVES`, before runs) into runs
/// (`heads_leaves`), each checked against its seal: once, at open ([`upgrade`]). One
/// transaction: a crash leaves the rows where they were, for the next open to move.
pub fn pack_old_leaves(db: &redb::Database) -> StorageResult<()> {
    /// Leaves packed at a time, so memory holds a batch, not the whole log.
    const BATCH: usize = 4096;
    let txn = db.begin_write()?;
    let moved = {
        let mut old = txn.open_table(HEADS_LEAVES)?;
        let mut runs = txn.open_table(HEADS_LEAF_RUNS)?;
        if old.is_empty()? {
            0
        } else {
            if !runs.is_empty()? {
                return Err(redb::Error::Corrupted(
                    "heads leaves are stored both in runs and one per row".into(),
                ));
            }
            let mut size = 0;
            let mut batch = Vec::with_capacity(BATCH);
            for item in old.iter()? {
                let (index, row) = item?;
                let expected = size + batch.len() as u64;
                if index.value() != expected {
                    return Err(redb::Error::Corrupted(format!(
                        "heads leaf {expected} is not stored (the next is {})",
                        index.value()
                    )));
                }
                batch.push(heads_tree::leaf_text(row.value(), index.value())?.to_string());
                if batch.len() == BATCH {
                    heads_leaves::append(&mut runs, size, &batch)?;
                    size += batch.len() as u64;
                    batch.clear();
                }
            }
            heads_leaves::append(&mut runs, size, &batch)?;
            size += batch.len() as u64;
            old.retain(|_, _| false)?;
            size
        }
    };
    if heads_meta::commit_if(txn, moved > 0)? {
        tracing::info!(leaves = moved, "heads log leaves packed into runs");
    }
    Ok(())
}

/// Builds `heads_nodes` and `heads_by_agent` from the leaves when they do not cover them
/// all (a data directory written before those tables existed): once, at open.
pub fn index_if_needed(db: &redb::Database) -> StorageResult<()> {
    let txn = db.begin_write()?;
    let indexed = {
        let leaves = txn.open_table(HEADS_LEAF_RUNS)?;
        let size = heads_leaves::count(&leaves)?;
        let mut meta = txn.open_table(HEADS_META)?;
        let indexed = heads_meta::indexed(&meta)?;
        // Indexing never shrinks the tree (open's integrity check says so first; this
        // holds without it).
        none_lost(size, indexed).map_err(redb::Error::Corrupted)?;
        if indexed == Some(size) || (size == 0 && indexed.is_none()) {
            None
        } else {
            let mut nodes = txn.open_table(HEADS_NODES)?;
            nodes.retain(|_, _| false)?;
            let mut by_agent = txn.open_table(HEADS_BY_AGENT)?;
            by_agent.retain(|_, _| false)?;
            let mut tree = HeadsTree::default();
            heads_leaves::visit(&leaves, 0, size, |index, leaf| {
                index_leaf(&mut tree, index, leaf, &mut nodes, &mut by_agent)
            })?;
            heads_meta::put(&mut meta, INDEXED, &size.to_string())?;
            let stated = heads_tree::stated_digest(&by_agent)?;
            heads_tree::store_stated(&mut txn.open_table(HEADS_STATED)?, stated)?;
            Some(size)
        }
    };
    match indexed {
        None => txn.abort()?,
        Some(size) => {
            txn.commit()?;
            tracing::info!(leaves = size, "heads log indexed");
        }
    }
    Ok(())
}

/// The heads log as a snapshot carries it.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct HeadsSnapshot {
    pub leaves: Vec<String>,
    pub rounds: Vec<u64>,
    pub origin: Option<String>,
    pub witnessed: Option<String>,
}

/// Who signed a note's signature line (`— name base64(key id ‖ signature)`): its name
/// and key id. A line that does not decode is its own signer.
fn signer_of(line: &str) -> (&str, Option<[u8; 4]>) {
    use base64::Engine;
    let Some((name, blob)) = line
        .strip_prefix("\u{2014} ")
        .and_then(|rest| rest.rsplit_once(' '))
    else {
        return (line, None);
    };
    let key_id = base64::engine::general_purpose::STANDARD
        .decode(blob)
        .ok()
        .and_then(|bytes| bytes.get(..4).and_then(|id| id.try_into().ok()));
    match key_id {
        Some(id) => (name, Some(id)),
        None => (line, None),
    }
}

/// Splits a signed note into its text (with final newline) and its signature lines.
pub fn split_note(note: &str) -> Result<(&str, &str), String> {
    let at = note
        .rfind("\n\n")
        .ok_or("note has no blank line before its signatures")?;
    let signatures = &note[at + 2..];
    if signatures.is_empty() || !signatures.ends_with('\n') {
        return Err("note has no signature lines".into());
    }
    if !signatures.lines().all(|l| l.starts_with("\u{2014} ")) {
        return Err("a signature line does not start with an em dash and a space".into());
    }
    Ok((&note[..at + 1], signatures))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Cosignatures of one size merge, one line per signer, but never past what a note
    /// may hold: a merged note of more than `MAX_NOTE_SIGNATURES` lines (which
    /// `signed_note` would refuse to parse) is refused and the stored one kept.
    #[test]
    fn merged_cosignatures_stay_within_what_a_note_may_hold() {
        let text = format!("log.test/heads\n5\n{}\n", "A".repeat(43) + "=");
        let line = |n: usize| format!("\u{2014} w{n}.test AAAA{n:04}\n");
        let note_with = |lines: std::ops::Range<usize>| {
            format!("{text}\n{}", lines.map(line).collect::<String>())
        };
        let mut heads = HeadsLog {
            origin: Some("log.test/heads".into()),
            witnessed: Some(note_with(0..2)),
            ..HeadsLog::default()
        };
        let merged = heads.accept_witnessed(&note_with(1..4), true).unwrap();
        assert_eq!(merged, note_with(0..4));
        // A signer's later line (same name and key id) replaces its earlier one.
        let again = format!("{text}\n\u{2014} w1.test AAAA0999\n");
        assert_eq!(
            heads.accept_witnessed(&again, true).unwrap(),
            format!("{text}\n{}\u{2014} w1.test AAAA0999\n", line(0))
        );
        heads.witnessed = Some(note_with(0..MAX_NOTE_SIGNATURES));
        assert_eq!(
            heads
                .accept_witnessed(&note_with(0..MAX_NOTE_SIGNATURES), true)
                .unwrap(),
            note_with(0..MAX_NOTE_SIGNATURES)
        );
        let refused = heads
            .accept_witnessed(&note_with(50..MAX_NOTE_SIGNATURES + 1), true)
            .unwrap_err();
        assert!(refused.contains("signatures"), "{refused}");
    }
}
