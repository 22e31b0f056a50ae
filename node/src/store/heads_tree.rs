//! The heads log's Merkle tree, kept on disk so a node's memory does not grow with the
//! number of statements. Subtrees of 256 leaves and up are stored as they complete
//! (`heads_nodes`: about half a hash per leaf); smaller ranges are hashed from the stored
//! leaves when a proof needs them (at most 256 leaves per range, a few ranges per
//! proof). Memory holds only the right edge: the leaf hashes of the unfinished chunk
//! of 256 and one node per level above it waiting for its right sibling.
//!
//! Every statement is also indexed by agent (`heads_by_agent`), so a head proof finds an
//! agent's statement with one range read instead of a map of every statement. Each index
//! row carries the SHA-256 of its key: the size an agent was last stated at is read
//! through it at open, and a key with a flipped index that still named one of the agent's
//! own statements would have this replica alone state that agent again (another tree).
//!
//! Leaves and nodes are stored sealed (`checked_row`) and checked at every read: a byte
//! changed on disk is an error, never a root this node would sign. Leaves from before
//! the seals are checked and sealed once at open, and the nodes rebuilt from them
//! (`seal_if_needed`), before anything reads them.

use lineage_core::transparency::{
    self, leaf_hash_of, parent_hash, Hash, SubtreeSource, TransparencyError,
};
use redb::{ReadableTable, TableDefinition};

use super::checked_row;
use super::heads_leaves::{self, LeafLookup};
use super::heads_meta;

/// (level, index) → the hash of the perfect subtree of 2^level leaves at
/// `index * 2^level`, for levels from `CHUNK_LEVEL` (8) up, sealed.
pub const HEADS_NODES: TableDefinition<(u8, u64), &[u8]> = TableDefinition::new("heads_nodes");
/// (agent, leaf index) of each statement (the statement itself is the leaf) →
/// `checked_row::key_seal(agent ‖ 0 ‖ index, big-endian)`.
pub const HEADS_BY_AGENT: TableDefinition<(&str, u64), &[u8]> =
    TableDefinition::new("heads_by_agent_sealed");
/// The same index with no seals, as data directories from before them hold it: dropped
/// at open, and the index built again from the leaves ([`drop_old_index`]).
pub const OLD_HEADS_BY_AGENT: TableDefinition<(&str, u64), ()> =
    TableDefinition::new("heads_by_agent");

/// Subtrees of `2^CHUNK_LEVEL` leaves and up are stored.
const CHUNK_LEVEL: u32 = 8;
const CHUNK: u64 = 1 << CHUNK_LEVEL;

type StorageResult<T> = Result<T, redb::Error>;

/// A heads leaf as it is stored.
pub fn seal_leaf(leaf: &str) -> String {
    checked_row::seal_text(leaf)
}

/// The leaf a stored row holds, checked (`index` names it in the error).
pub fn leaf_text(row: &str, index: u64) -> StorageResult<&str> {
    checked_row::unseal_text(row).map_err(|e| corrupted(format!("heads leaf {index}: {e}")))
}

/// The hash a stored node row holds, checked.
fn node_hash(row: &[u8], level: u8, index: u64) -> StorageResult<Hash> {
    let hash = checked_row::unseal(row)
        .map_err(|e| corrupted(format!("heads node {level}/{index}: {e}")))?;
    Hash::try_from(hash)
        .map_err(|_| corrupted(format!("heads node {level}/{index} is not 32 bytes")))
}

/// Whether the rows are sealed: `seal_if_needed` has run on this file (older rows read
/// as sealed ones would all look damaged).
pub fn rows_sealed(meta: &impl ReadableTable<&'static str, &'static [u8]>) -> StorageResult<bool> {
    Ok(heads_meta::get(meta, heads_meta::SEALED)?.is_some())
}

/// Marks the rows sealed (a snapshot install writes them sealed).
pub fn mark_sealed(meta: &mut redb::Table<&str, &[u8]>) -> StorageResult<()> {
    heads_meta::put(meta, heads_meta::SEALED, "1")
}

/// Seals the leaves written before rows were sealed: once, at open, before anything
/// reads them (the meta table's `sealed` marks it done; a new data directory is marked at
/// once). Each old leaf must still be a canonical statement to be sealed, and the stored
/// nodes are not trusted: they are dropped with the by-agent index, for `index_if_needed`
/// (which runs next) to rebuild from the checked leaves. Only here is a row read without
/// its seal.
pub fn seal_if_needed(db: &redb::Database) -> StorageResult<()> {
    use super::heads::HEADS_LEAVES;
    use super::heads_meta::HEADS_META;
    let txn = db.begin_write()?;
    let sealed = {
        let mut meta = txn.open_table(HEADS_META)?;
        if rows_sealed(&meta)? {
            drop(meta);
            txn.abort()?;
            return Ok(());
        }
        let mut leaves = txn.open_table(HEADS_LEAVES)?;
        let mut plain = Vec::new();
        for item in leaves.iter()? {
            let (index, row) = item?;
            let row = row.value();
            // A plain row begins with `{`; no flipped or zeroed byte makes a sealed row
            // (hex first) begin so. A sealed row here (the marker was lost) must check out.
            if !row.starts_with('{') {
                leaf_text(row, index.value())?;
                continue;
            }
            lineage_core::heads::HeadStatement::from_leaf(row).map_err(|e| {
                corrupted(format!(
                    "heads leaf {} (written before seals): {e}",
                    index.value()
                ))
            })?;
            plain.push((index.value(), row.to_string()));
        }
        for (index, leaf) in &plain {
            leaves.insert(*index, seal_leaf(leaf).as_str())?;
        }
        if !plain.is_empty() {
            txn.open_table(HEADS_NODES)?.retain(|_, _| false)?;
            txn.open_table(HEADS_BY_AGENT)?.retain(|_, _| false)?;
            meta.remove(heads_meta::INDEXED)?;
        }
        mark_sealed(&mut meta)?;
        plain.len()
    };
    txn.commit()?;
    if sealed > 0 {
        tracing::info!(
            leaves = sealed,
            "heads log leaves sealed; its nodes are rebuilt from them"
        );
    }
    Ok(())
}

/// The right edge of the heads tree: enough to append leaves and store the subtrees
/// they complete.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct HeadsTree {
    size: u64,
    /// Leaf hashes of the unfinished chunk (fewer than [`CHUNK`]).
    chunk: Vec<Hash>,
    /// For each level from [`CHUNK_LEVEL`] up, a stored node still waiting for its right
    /// sibling.
    waiting: Vec<Option<Hash>>,
}

impl HeadsTree {
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Appends a leaf (its stored text), storing each subtree it completes.
    pub fn push(
        &mut self,
        leaf: &str,
        nodes: &mut redb::Table<(u8, u64), &[u8]>,
    ) -> StorageResult<()> {
        self.chunk.push(leaf_hash_of(leaf.as_bytes()));
        self.size += 1;
        if (self.chunk.len() as u64) < CHUNK {
            return Ok(());
        }
        let mut hash = transparency::root_of_leaf_hashes(&self.chunk);
        self.chunk.clear();
        let mut level = CHUNK_LEVEL;
        let mut index = self.size / CHUNK - 1;
        loop {
            nodes.insert((level as u8, index), checked_row::seal(&hash).as_slice())?;
            let slot = (level - CHUNK_LEVEL) as usize;
            if self.waiting.len() <= slot {
                self.waiting.resize(slot + 1, None);
            }
            match self.waiting[slot].take() {
                None => {
                    self.waiting[slot] = Some(hash);
                    return Ok(());
                }
                Some(left) => {
                    hash = parent_hash(&left, &hash);
                    level += 1;
                    index /= 2;
                }
            }
        }
    }

    /// The right edge of the tree of `size` leaves, read from the tables.
    pub fn load(
        size: u64,
        nodes: &impl ReadableTable<(u8, u64), &'static [u8]>,
        leaves: &impl ReadableTable<u64, &'static [u8]>,
    ) -> StorageResult<HeadsTree> {
        let mut tree = HeadsTree {
            size,
            ..HeadsTree::default()
        };
        let chunk_start = size - size % CHUNK;
        heads_leaves::visit(leaves, chunk_start, size, |_, leaf| {
            tree.chunk.push(leaf_hash_of(leaf.as_bytes()));
            Ok(())
        })?;
        if tree.chunk.len() as u64 != size - chunk_start {
            return Err(corrupted(format!(
                "heads leaves {chunk_start}..{size} are not all stored"
            )));
        }
        let mut level = CHUNK_LEVEL;
        while size >> level > 0 {
            let complete = size >> level;
            let slot = (level - CHUNK_LEVEL) as usize;
            tree.waiting.resize(slot + 1, None);
            if complete % 2 == 1 {
                tree.waiting[slot] =
                    Some(stored_node(nodes, level, complete - 1)?.ok_or_else(|| {
                        corrupted(format!("heads node {level}/{} is not stored", complete - 1))
                    })?);
            }
            level += 1;
        }
        Ok(tree)
    }
}

fn corrupted(why: String) -> redb::Error {
    redb::Error::Corrupted(why)
}

fn stored_node(
    nodes: &impl ReadableTable<(u8, u64), &'static [u8]>,
    level: u32,
    index: u64,
) -> StorageResult<Option<Hash>> {
    let Ok(level) = u8::try_from(level) else {
        return Ok(None);
    };
    match nodes.get((level, index))? {
        None => Ok(None),
        Some(row) => node_hash(row.value(), level, index).map(Some),
    }
}

/// The stored tree of `size` leaves, for roots and proofs (`transparency::root_at`,
/// `inclusion_proof_at`, `consistency_proof_at`) inside one transaction.
pub struct StoredTree<'a, N, L> {
    pub size: u64,
    pub nodes: &'a N,
    pub leaves: &'a L,
}

impl<N, L> SubtreeSource for StoredTree<'_, N, L>
where
    N: ReadableTable<(u8, u64), &'static [u8]>,
    L: ReadableTable<u64, &'static [u8]>,
{
    fn size(&self) -> u64 {
        self.size
    }

    fn perfect(&self, level: u32, index: u64) -> Result<Option<Hash>, TransparencyError> {
        if level < CHUNK_LEVEL {
            return Ok(None);
        }
        stored_node(self.nodes, level, index).map_err(|e| TransparencyError(e.to_string()))
    }

    fn leaf_batch(&self) -> u64 {
        CHUNK
    }

    fn leaf_hashes(&self, start: u64, end: u64) -> Result<Vec<Hash>, TransparencyError> {
        let mut hashes = Vec::new();
        heads_leaves::visit(self.leaves, start, end, |_, leaf| {
            hashes.push(leaf_hash_of(leaf.as_bytes()));
            Ok(())
        })
        .map_err(|e| TransparencyError(format!("heads leaves: {e}")))?;
        Ok(hashes)
    }
}

/// The agent's latest statement with an index below `below`.
pub fn statement_below(
    by_agent: &impl ReadableTable<(&'static str, u64), &'static [u8]>,
    agent_id: &str,
    below: u64,
) -> StorageResult<Option<u64>> {
    if below == 0 {
        return Ok(None);
    }
    let Some((key, seal)) = by_agent
        .range((agent_id, 0)..(agent_id, below))?
        .next_back()
        .transpose()?
    else {
        return Ok(None);
    };
    let (stored_agent, index) = key.value();
    checked_row::check_key_seal(&by_agent_key(stored_agent, index), seal.value()).map_err(
        |why| {
            corrupted(format!(
                "heads by-agent row ({stored_agent}, {index}): {why}"
            ))
        },
    )?;
    Ok(Some(index))
}

/// Indexes statement `index` as `agent_id`'s.
pub fn index_statement(
    by_agent: &mut redb::Table<(&str, u64), &[u8]>,
    agent_id: &str,
    index: u64,
) -> StorageResult<()> {
    let seal = checked_row::key_seal(&by_agent_key(agent_id, index));
    by_agent.insert((agent_id, index), seal.as_slice())?;
    Ok(())
}

/// The [`stated_digest`] stored with each round: one row, `stated`, sealed as the
/// settings are (`heads_meta::put`). A table of its own: builds before it take any key
/// they do not know in the settings table for damage, and would move the file aside.
pub const HEADS_STATED: TableDefinition<&str, &[u8]> = TableDefinition::new("heads_stated");
const STATED: &str = "stated";

/// The stored [`stated_digest`], checked; `None` in a file from before it.
pub fn stored_stated(
    table: &impl ReadableTable<&'static str, &'static [u8]>,
) -> StorageResult<Option<StatedDigest>> {
    heads_meta::get(table, STATED)?
        .map(|hex| StatedDigest::from_hex(&hex))
        .transpose()
}

/// Stores `digest` as the [`stated_digest`].
pub fn store_stated(
    table: &mut redb::Table<&str, &[u8]>,
    digest: StatedDigest,
) -> StorageResult<()> {
    heads_meta::put(table, STATED, &digest.to_hex())
}

/// What every agent's last statement is, in 32 bytes: the XOR of the seals of each
/// agent's last by-agent row (each checked). It is stored with each round
/// ([`HEADS_STATED`]) and compared at open ([`check_stated`]): the size an agent was
/// last stated at is read through its last row, and a row moved by a flipped key bit
/// (under an earlier statement, another agent, an unknown one) or lost changes which row
/// is last without a seal that fails. One pair of range reads per agent.
pub fn stated_digest(
    by_agent: &impl ReadableTable<(&'static str, u64), &'static [u8]>,
) -> StorageResult<StatedDigest> {
    use std::ops::Bound::{Excluded, Unbounded};
    let mut digest = StatedDigest::default();
    let mut next = by_agent.first()?.map(|(key, _)| key.value().0.to_string());
    while let Some(agent_id) = next {
        let index = statement_below(by_agent, &agent_id, u64::MAX)?
            .ok_or_else(|| corrupted(format!("heads by-agent rows of {agent_id} vanished")))?;
        digest.toggle(&agent_id, index);
        let after = (agent_id.as_str(), u64::MAX);
        next = by_agent
            .range::<(&str, u64)>((Excluded(after), Unbounded))?
            .next()
            .transpose()?
            .map(|(key, _)| key.value().0.to_string());
    }
    Ok(digest)
}

/// An XOR of by-agent row seals ([`stated_digest`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatedDigest([u8; 32]);

impl StatedDigest {
    /// Adds `agent_id`'s statement `index` if it is not in, removes it if it is.
    pub fn toggle(&mut self, agent_id: &str, index: u64) {
        let seal = checked_row::key_seal(&by_agent_key(agent_id, index));
        for (byte, s) in self.0.iter_mut().zip(seal) {
            *byte ^= s;
        }
    }

    pub fn to_hex(self) -> String {
        hex::encode(self.0)
    }

    pub fn from_hex(text: &str) -> StorageResult<StatedDigest> {
        let mut bytes = [0; 32];
        hex::decode_to_slice(text, &mut bytes)
            .map_err(|_| corrupted(format!("heads meta \"stated\" is {text:?}, not 32 bytes")))?;
        Ok(StatedDigest(bytes))
    }
}

/// Whether the stored [`stated_digest`] matches the by-agent rows (open's check, after
/// the upgrades, which store it where it is missing). A key other than `stated` in its
/// table is damage (a flipped key byte would otherwise read as no digest).
pub fn check_stated(db: &redb::Database) -> StorageResult<()> {
    let txn = db.begin_read()?;
    let table = txn.open_table(HEADS_STATED)?;
    for item in table.iter()? {
        let (key, _) = item?;
        if key.value() != STATED {
            return Err(corrupted(format!(
                "heads_stated holds an unknown key {:?}",
                key.value()
            )));
        }
    }
    let Some(stored) = stored_stated(&table)? else {
        return Ok(());
    };
    let found = stated_digest(&txn.open_table(HEADS_BY_AGENT)?)?;
    if found != stored {
        return Err(corrupted(
            "the by-agent index's last statements are not the ones stored with the last \
             round (a row lost, or moved by a changed key)"
                .into(),
        ));
    }
    Ok(())
}

/// Moves the digest two builds of this session kept in the settings
/// (`heads_meta::OLD_STATED`) into [`HEADS_STATED`], replacing what is there (it is the
/// newer: a build that wrote it there ignores this table). Once, at open; one transaction.
pub fn move_stated_out_of_settings(db: &redb::Database) -> StorageResult<()> {
    let txn = db.begin_write()?;
    let moved = {
        let mut meta = txn.open_table(heads_meta::HEADS_META)?;
        match heads_meta::get(&meta, heads_meta::OLD_STATED)? {
            None => false,
            Some(hex) => {
                store_stated(
                    &mut txn.open_table(HEADS_STATED)?,
                    StatedDigest::from_hex(&hex)?,
                )?;
                meta.remove(heads_meta::OLD_STATED)?;
                true
            }
        }
    };
    heads_meta::commit_if(txn, moved)?;
    Ok(())
}

/// Stores the [`stated_digest`] of the by-agent rows where none is stored: once, at open,
/// after the index is complete. `kept`: the file's layout keeps the digest (it is marked
/// with a layout that has it), so none stored is a lost row, damage, never "from before
/// it", which would take the rows as they are.
pub fn store_stated_if_missing(db: &redb::Database, kept: bool) -> StorageResult<()> {
    let txn = db.begin_write()?;
    let stored = {
        let mut stated = txn.open_table(HEADS_STATED)?;
        if stored_stated(&stated)?.is_some() {
            false
        } else if kept {
            return Err(corrupted(
                "the digest of the agents' last statements (heads_stated) is missing".into(),
            ));
        } else {
            store_stated(
                &mut stated,
                stated_digest(&txn.open_table(HEADS_BY_AGENT)?)?,
            )?;
            true
        }
    };
    heads_meta::commit_if(txn, stored)?;
    Ok(())
}

/// What a by-agent row's seal covers.
fn by_agent_key(agent_id: &str, index: u64) -> Vec<u8> {
    let mut key = Vec::with_capacity(agent_id.len() + 9);
    key.extend_from_slice(agent_id.as_bytes());
    key.push(0);
    key.extend_from_slice(&index.to_be_bytes());
    key
}

/// Drops a by-agent index from before seals and forgets how many leaves were indexed,
/// so that `heads::index_if_needed` builds the index (and the nodes) again from the
/// sealed leaves: once, at open. Also where an older build ran on an upgraded file and
/// indexed its statements there. One transaction.
pub fn drop_old_index(db: &redb::Database) -> StorageResult<()> {
    let txn = db.begin_write()?;
    if !txn.delete_table(OLD_HEADS_BY_AGENT)? {
        txn.abort()?;
        return Ok(());
    }
    // The digest stays: the rebuilt index stores its own, and without leaves it is the
    // empty one still.
    let mut meta = txn.open_table(heads_meta::HEADS_META)?;
    meta.remove(heads_meta::INDEXED)?;
    meta.remove(heads_meta::OLD_STATED)?;
    drop(meta);
    txn.commit()?;
    tracing::info!("heads log's unsealed by-agent index dropped; it is built again");
    Ok(())
}

/// The size statement `index`, the agent's latest, gives its log, read from the leaf
/// itself (the by-agent index only points at it): a leaf not stored, not canonical, or
/// naming another agent is an error, never "not stated".
pub fn stated_size<T: ReadableTable<u64, &'static [u8]>>(
    leaves: &mut LeafLookup<'_, T>,
    index: u64,
    agent_id: &str,
) -> StorageResult<u64> {
    let leaf = leaves
        .get(index)?
        .ok_or_else(|| corrupted(format!("heads leaf {index} ({agent_id}'s) is not stored")))?;
    let statement = lineage_core::heads::HeadStatement::from_leaf(leaf)
        .map_err(|e| corrupted(format!("heads leaf {index}: {e}")))?;
    if statement.agent_id != agent_id {
        return Err(corrupted(format!(
            "heads leaf {index} is {}'s, indexed as {agent_id}'s",
            statement.agent_id
        )));
    }
    Ok(statement.size)
}

#[cfg(test)]
mod tests {
    use lineage_core::heads::HeadStatement;
    use lineage_core::transparency::{
        consistency_proof_at, inclusion_proof_at, root_at, MerkleLevels,
    };

    use super::super::heads::{pack_old_leaves, HEADS_LEAVES};
    use super::super::heads_leaves::HEADS_LEAF_RUNS;
    use super::*;
    use redb::ReadableTableMetadata;
    use sha2::Digest;

    fn leaf(i: u64) -> String {
        HeadStatement {
            agent_id: format!("agent-{}", i % 7),
            size: i + 1,
            // Hashes as real statements hold: hex that packs to about half, so a run
            // holds some 35 leaves.
            root: hex::encode(sha2::Sha256::digest(i.to_le_bytes())),
            head_hash: hex::encode(sha2::Sha256::digest((i * 3).to_le_bytes())),
        }
        .to_leaf()
    }

    /// What open does to a data directory's heads tables before anything reads them.
    fn upgrade(db: &redb::Database) {
        super::super::heads::upgrade(db, false).unwrap();
    }

    /// Roots and proofs from the stored tree equal the whole in-memory tree's at sizes
    /// around chunk and level boundaries, for a tree grown leaf by leaf and for one
    /// indexed from its leaves alone (a data directory from before the tables, with a
    /// sealed row per leaf, packed into runs at open); the right edge read back equals
    /// the one grown; statements are found per agent.
    #[test]
    fn the_stored_tree_proves_what_the_whole_tree_proves() {
        const N: u64 = 1_100;
        let dir = tempfile::tempdir().unwrap();
        let grown = redb::Database::create(dir.path().join("grown.redb")).unwrap();
        let indexed = redb::Database::create(dir.path().join("indexed.redb")).unwrap();
        let mut whole = MerkleLevels::new();
        let mut edges = Vec::new();
        let txn = grown.begin_write().unwrap();
        {
            let mut leaves = txn.open_table(HEADS_LEAF_RUNS).unwrap();
            let mut nodes = txn.open_table(HEADS_NODES).unwrap();
            let mut tree = HeadsTree::default();
            for i in 0..N {
                edges.push(tree.clone());
                heads_leaves::append(&mut leaves, i, &[leaf(i)]).unwrap();
                tree.push(&leaf(i), &mut nodes).unwrap();
                whole.push_leaf_hash(leaf_hash_of(leaf(i).as_bytes()));
            }
            edges.push(tree);
        }
        txn.commit().unwrap();
        let txn = indexed.begin_write().unwrap();
        {
            let mut leaves = txn.open_table(HEADS_LEAVES).unwrap();
            for i in 0..N {
                leaves.insert(i, seal_leaf(&leaf(i)).as_str()).unwrap();
            }
        }
        txn.commit().unwrap();
        upgrade(&indexed);
        let txn = indexed.begin_read().unwrap();
        assert!(txn.open_table(HEADS_LEAVES).unwrap().is_empty().unwrap());
        drop(txn);

        let sizes = [
            0, 1, 2, 3, 255, 256, 257, 300, 511, 512, 513, 767, 768, 1023, 1024, 1025, N,
        ];
        for db in [&grown, &indexed] {
            let txn = db.begin_read().unwrap();
            let nodes = txn.open_table(HEADS_NODES).unwrap();
            let leaves = txn.open_table(HEADS_LEAF_RUNS).unwrap();
            let stored = StoredTree {
                size: N,
                nodes: &nodes,
                leaves: &leaves,
            };
            for &size in &sizes {
                assert_eq!(
                    root_at(&stored, size),
                    whole.root_at(size),
                    "root at {size}"
                );
                assert_eq!(
                    HeadsTree::load(size, &nodes, &leaves).unwrap(),
                    edges[size as usize]
                );
                for &old in &sizes {
                    assert_eq!(
                        consistency_proof_at(&stored, old, size),
                        whole.consistency_proof(old, size),
                        "consistency {old} -> {size}"
                    );
                }
                for index in [
                    0,
                    1,
                    size / 2,
                    size.saturating_sub(257),
                    size.saturating_sub(1),
                ] {
                    assert_eq!(
                        inclusion_proof_at(&stored, index, size),
                        whole.inclusion_proof(index, size),
                        "inclusion of {index} in {size}"
                    );
                }
            }
            assert!(root_at(&stored, N + 1).is_err());
        }
        the_index_finds_each_agents_statements(&indexed);
    }

    /// `n` leaves and their nodes, as a version before the seals stored them.
    fn write_unsealed_tables(db: &redb::Database, n: u64) {
        let txn = db.begin_write().unwrap();
        {
            let mut leaves = txn.open_table(HEADS_LEAVES).unwrap();
            let mut nodes = txn.open_table(HEADS_NODES).unwrap();
            let mut tree = HeadsTree::default();
            for i in 0..n {
                leaves.insert(i, leaf(i).as_str()).unwrap();
                tree.push(&leaf(i), &mut nodes).unwrap();
            }
            // The bare 32-byte hash.
            let sealed: Vec<((u8, u64), Vec<u8>)> = nodes
                .iter()
                .unwrap()
                .map(|item| {
                    let (key, row) = item.unwrap();
                    (key.value(), row.value().to_vec())
                })
                .collect();
            for (key, row) in sealed {
                let hash = checked_row::unseal(&row).unwrap().to_vec();
                nodes.insert(key, hash.as_slice()).unwrap();
            }
        }
        txn.commit().unwrap();
    }

    /// Flips one bit of the stored run holding leaf `index` (near its end: inside the
    /// frame); returns the run's first leaf.
    fn flip_leaf(db: &redb::Database, index: u64) -> u64 {
        let txn = db.begin_write().unwrap();
        let first = {
            let mut leaves = txn.open_table(HEADS_LEAF_RUNS).unwrap();
            let (first, mut row) = {
                let (first, row) = leaves
                    .range(..=index)
                    .unwrap()
                    .next_back()
                    .unwrap()
                    .unwrap();
                (first.value(), row.value().to_vec())
            };
            let at = row.len() - 5;
            row[at] ^= 1;
            leaves.insert(first, row.as_slice()).unwrap();
            first
        };
        txn.commit().unwrap();
        first
    }

    /// Flips one bit of a stored node's row (inside the hash).
    fn flip_node(db: &redb::Database, key: (u8, u64)) {
        let txn = db.begin_write().unwrap();
        {
            let mut nodes = txn.open_table(HEADS_NODES).unwrap();
            let mut row = nodes.get(key).unwrap().unwrap().value().to_vec();
            row[40] ^= 0x10;
            nodes.insert(key, row.as_slice()).unwrap();
        }
        txn.commit().unwrap();
    }

    /// An old leaf that is no longer a canonical statement is not sealed: an error.
    #[test]
    fn an_old_leaf_that_is_no_longer_a_statement_is_not_sealed() {
        let dir = tempfile::tempdir().unwrap();
        let damaged = redb::Database::create(dir.path().join("damaged.redb")).unwrap();
        write_unsealed_tables(&damaged, 10);
        {
            let txn = damaged.begin_write().unwrap();
            txn.open_table(HEADS_LEAVES)
                .unwrap()
                .insert(5, leaf(5).replace("size", "sizf").as_str())
                .unwrap();
            txn.commit().unwrap();
        }
        let error = seal_if_needed(&damaged).unwrap_err().to_string();
        assert!(
            error.contains("heads leaf 5 (written before seals)"),
            "{error}"
        );
    }

    /// Sealed leaf rows from before runs are moved into runs only if every one checks out
    /// and none is missing: otherwise open fails and the rows stay where they were.
    #[test]
    fn old_leaf_rows_are_packed_only_if_all_check_out() {
        const N: u64 = 100;
        let dir = tempfile::tempdir().unwrap();
        let db = redb::Database::create(dir.path().join("heads.redb")).unwrap();
        let write_old = |damage: Option<u64>, lost: Option<u64>| {
            let txn = db.begin_write().unwrap();
            {
                let mut old = txn.open_table(HEADS_LEAVES).unwrap();
                for i in 0..N {
                    let mut row = seal_leaf(&leaf(i));
                    if damage == Some(i) {
                        row = row.replacen("agent-", "agent_", 1);
                    }
                    if lost != Some(i) {
                        old.insert(i, row.as_str()).unwrap();
                    }
                }
            }
            txn.commit().unwrap();
        };
        let old_rows = |db: &redb::Database| {
            let txn = db.begin_read().unwrap();
            let rows = txn.open_table(HEADS_LEAVES).unwrap().len().unwrap();
            let runs = match txn.open_table(HEADS_LEAF_RUNS) {
                Ok(runs) => heads_leaves::count(&runs).unwrap(),
                Err(_) => 0,
            };
            (rows, runs)
        };
        write_old(Some(40), None);
        let error = pack_old_leaves(&db).unwrap_err().to_string();
        assert!(error.contains("heads leaf 40"), "{error}");
        assert_eq!(old_rows(&db), (N, 0));
        let txn = db.begin_write().unwrap();
        txn.delete_table(HEADS_LEAVES).unwrap();
        txn.commit().unwrap();
        write_old(None, Some(40));
        let error = pack_old_leaves(&db).unwrap_err().to_string();
        assert!(error.contains("heads leaf 40 is not stored"), "{error}");
        assert_eq!(old_rows(&db), (N - 1, 0));
        write_old(None, None);
        upgrade(&db);
        assert_eq!(old_rows(&db), (0, N));
        let txn = db.begin_read().unwrap();
        let runs = txn.open_table(HEADS_LEAF_RUNS).unwrap();
        let expected: Vec<String> = (0..N).map(leaf).collect();
        assert_eq!(heads_leaves::read(&runs, 0, N).unwrap(), expected);
    }

    /// Rows from before the seals (plain leaves, 32-byte nodes) are migrated once at open:
    /// leaves checked, sealed and packed into runs, nodes rebuilt (an old wrong node is
    /// not kept), giving the whole tree's roots. Then a flipped bit in a run or a node row
    /// is an error wherever it is read (the right edge at open, a root), never another
    /// root.
    #[test]
    fn rows_are_sealed_once_and_a_flipped_bit_is_an_error_not_another_root() {
        const N: u64 = 600;
        let dir = tempfile::tempdir().unwrap();
        let db = redb::Database::create(dir.path().join("heads.redb")).unwrap();
        write_unsealed_tables(&db, N);
        let sizes = [1, 255, 256, 300, 512, N];
        let roots = |db: &redb::Database| -> Vec<Result<Hash, TransparencyError>> {
            let txn = db.begin_read().unwrap();
            let (nodes, leaves) = (
                txn.open_table(HEADS_NODES).unwrap(),
                txn.open_table(HEADS_LEAF_RUNS).unwrap(),
            );
            let stored = StoredTree {
                size: N,
                nodes: &nodes,
                leaves: &leaves,
            };
            sizes.iter().map(|&size| root_at(&stored, size)).collect()
        };
        let mut whole = MerkleLevels::new();
        for i in 0..N {
            whole.push_leaf_hash(leaf_hash_of(leaf(i).as_bytes()));
        }
        let before: Vec<_> = sizes.iter().map(|&size| whole.root_at(size)).collect();
        {
            // Old rows are read only by the upgrade: no run holds them yet.
            let txn = db.begin_read().unwrap();
            assert!(txn.open_table(HEADS_LEAF_RUNS).is_err());
        }

        // An old node that was already wrong is not sealed as it is: nodes are rebuilt.
        {
            let txn = db.begin_write().unwrap();
            txn.open_table(HEADS_NODES)
                .unwrap()
                .insert((8, 0), [9u8; 32].as_slice())
                .unwrap();
            txn.commit().unwrap();
        }
        upgrade(&db);
        assert_eq!(roots(&db), before);
        {
            let txn = db.begin_read().unwrap();
            let old = txn.open_table(HEADS_LEAVES).unwrap();
            assert!(old.is_empty().unwrap(), "a leaf row is left");
            let runs = txn.open_table(HEADS_LEAF_RUNS).unwrap();
            assert_eq!(heads_leaves::count(&runs).unwrap(), N);
            let nodes = txn.open_table(HEADS_NODES).unwrap();
            for item in nodes.iter().unwrap() {
                assert_eq!(item.unwrap().1.value().len(), 64, "a plain node is left");
            }
        }
        upgrade(&db);
        assert_eq!(roots(&db), before, "sealing twice changes nothing");
        // The marker lost (the meta table is not sealed): the rows are found sealed and
        // checked, nothing is resealed or rebuilt.
        {
            let txn = db.begin_write().unwrap();
            txn.open_table(super::super::heads_meta::HEADS_META)
                .unwrap()
                .remove(super::super::heads_meta::SEALED)
                .unwrap();
            txn.commit().unwrap();
        }
        upgrade(&db);
        assert_eq!(roots(&db), before, "a lost marker changes nothing");

        // A leaf of the unfinished chunk: the right edge at open and the root fail.
        let first = flip_leaf(&db, 550);
        {
            let txn = db.begin_read().unwrap();
            let (nodes, leaves) = (
                txn.open_table(HEADS_NODES).unwrap(),
                txn.open_table(HEADS_LEAF_RUNS).unwrap(),
            );
            let error = HeadsTree::load(N, &nodes, &leaves).unwrap_err().to_string();
            assert!(
                error.contains(&format!("heads leaves from {first}")),
                "{error}"
            );
        }
        let after = roots(&db);
        assert!(first > 300, "the run holding 550 starts at {first}");
        assert_eq!(after[..5], before[..5], "sizes that do not read leaf 550");
        assert!(after[5].is_err(), "{:?}", after[5]);
        flip_leaf(&db, 550);
        assert_eq!(roots(&db), before, "flipped back");

        // The stored subtree of leaves 0..512 and the one of 0..256.
        flip_node(&db, (9, 0));
        let after = roots(&db);
        assert!(after[4].is_err() && after[5].is_err(), "{after:?}");
        assert_eq!(after[..4], before[..4]);
        flip_node(&db, (8, 0));
        let after = roots(&db);
        assert!(after[2].is_err() && after[3].is_err(), "{after:?}");
        assert_eq!(after[..2], before[..2]);
    }

    /// Statements found per agent in the tree indexed from leaves of `leaf(i)`; an index
    /// entry pointing at another agent's leaf is an error, not "not stated".
    fn the_index_finds_each_agents_statements(indexed: &redb::Database) {
        let txn = indexed.begin_read().unwrap();
        let by_agent = txn.open_table(HEADS_BY_AGENT).unwrap();
        assert_eq!(statement_below(&by_agent, "agent-3", 0).unwrap(), None);
        assert_eq!(statement_below(&by_agent, "agent-3", 4).unwrap(), Some(3));
        assert_eq!(statement_below(&by_agent, "agent-3", 10).unwrap(), Some(3));
        assert_eq!(statement_below(&by_agent, "agent-3", 11).unwrap(), Some(10));
        let leaves = txn.open_table(HEADS_LEAF_RUNS).unwrap();
        let mut lookup = LeafLookup::new(&leaves);
        let last = statement_below(&by_agent, "agent-0", u64::MAX).unwrap();
        assert_eq!(last, Some(1_099));
        assert_eq!(
            stated_size(&mut lookup, 1_099, "agent-0").unwrap(),
            1_099 + 1
        );
        assert_eq!(
            statement_below(&by_agent, "nobody", u64::MAX).unwrap(),
            None
        );
        let error = stated_size(&mut lookup, 5_000, "agent-0").unwrap_err();
        assert!(error.to_string().contains("is not stored"), "{error}");
        // A key with a bit flipped (a row moved under another index, or another agent)
        // is an error, never a statement: seen when it is the one a lookup meets.
        drop(lookup);
        let agent_3_last = statement_below(&by_agent, "agent-3", u64::MAX)
            .unwrap()
            .unwrap();
        drop((by_agent, leaves, txn));
        let txn = indexed.begin_write().unwrap();
        {
            let mut by_agent = txn.open_table(HEADS_BY_AGENT).unwrap();
            let seal = by_agent
                .remove(("agent-3", agent_3_last))
                .unwrap()
                .unwrap()
                .value()
                .to_vec();
            for bit in 0..64 {
                let flipped = agent_3_last ^ (1 << bit);
                by_agent
                    .insert(("agent-3", flipped), seal.as_slice())
                    .unwrap();
                let error = statement_below(&by_agent, "agent-3", flipped + 1).unwrap_err();
                assert!(error.to_string().contains("checksum"), "bit {bit}: {error}");
                by_agent.remove(("agent-3", flipped)).unwrap();
            }
            by_agent
                .insert(("agent-2", agent_3_last), seal.as_slice())
                .unwrap();
            assert!(statement_below(&by_agent, "agent-2", u64::MAX).is_err());
            by_agent.remove(("agent-2", agent_3_last)).unwrap();
            index_statement(&mut by_agent, "agent-3", agent_3_last).unwrap();
        }
        txn.abort().unwrap();
        // An index entry pointing at another agent's leaf is an error, not "not stated".
        let txn = indexed.begin_write().unwrap();
        index_statement(
            &mut txn.open_table(HEADS_BY_AGENT).unwrap(),
            "agent-3",
            1_099,
        )
        .unwrap();
        txn.commit().unwrap();
        let txn = indexed.begin_read().unwrap();
        let by_agent = txn.open_table(HEADS_BY_AGENT).unwrap();
        let leaves = txn.open_table(HEADS_LEAF_RUNS).unwrap();
        let last = statement_below(&by_agent, "agent-3", u64::MAX)
            .unwrap()
            .unwrap();
        let error = stated_size(&mut LeafLookup::new(&leaves), last, "agent-3").unwrap_err();
        assert!(error.to_string().contains("agent-0's"), "{error}");
    }
}
