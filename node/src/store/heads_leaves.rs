//! The heads log's statements on disk: runs of consecutive leaves, each packed
//! (`packed_run`: one zstd frame of the leaves joined by `\n`) and sealed with SHA-256
//! (`checked_row`), keyed by the index of the run's first leaf.
//!
//! Why runs: a leaf is about 200 bytes of JSON keys and hex. Stored one per row (with a
//! 64-character seal each), the leaves took 262 bytes each in pages half full, since redb
//! splits a full leaf page in half even when keys only ascend: 165 MB of pages for 84 MB
//! of rows at 10,000 agents and 1M records. A run fills about a page by itself, as the
//! records' packed runs do.
//!
//! A run is at most a page; the last one, while under 7/8 of a page, is reopened and
//! packed again with the next round's leaves, so every closed run is nearly full. Every
//! read checks the seal, then the frame (`packed_run::unpack`), and that runs follow one
//! another without a gap: damage is an error naming the run, never another leaf or a
//! shorter list.

use redb::{ReadableTable, Table, TableDefinition};

use super::{checked_row, packed_run};

/// Index of a run's first leaf → the run, packed and sealed.
pub const HEADS_LEAF_RUNS: TableDefinition<u64, &[u8]> = TableDefinition::new("heads_leaf_runs");

type StorageResult<T> = Result<T, redb::Error>;

/// What a leaf page holding one row spends besides the row: its 4-byte header, 4-byte
/// end offsets for the key and the value, and the 8-byte key.
const ONE_ROW_LEAF_OVERHEAD: usize = 4 + 4 + 4 + 8;
/// The seal's SHA-256.
const SEAL_BYTES: usize = 32;
/// The most packed bytes a run may hold: sealed, it fits a page's leaf alone.
const PACKED_LIMIT: usize = packed_run::PAGE_BYTES - ONE_ROW_LEAF_OVERHEAD - SEAL_BYTES;
/// A run at least this big is never reopened.
const CLOSED_BYTES: usize = PACKED_LIMIT * 7 / 8;
/// Packed to text bytes, for the first run (statements pack to about half).
const FIRST_RATIO: f64 = 0.5;

fn corrupted(why: String) -> redb::Error {
    redb::Error::Corrupted(why)
}

fn damaged(first: u64, why: impl std::fmt::Display) -> redb::Error {
    corrupted(format!("heads leaves from {first}: {why}"))
}

/// A stored run's packed bytes, its seal checked.
fn unsealed(first: u64, row: &[u8]) -> StorageResult<&[u8]> {
    checked_row::unseal(row).map_err(|e| damaged(first, e))
}

/// Where a run starting at `first` ends, from its unsealed header. A key near the end of
/// the index space (a flipped high bit: keys are not sealed) is damage, never an end
/// that wraps.
fn end_of(first: u64, packed: &[u8]) -> StorageResult<u64> {
    let len = packed_run::stated_lines(packed).map_err(|e| damaged(first, e))?;
    first
        .checked_add(u64::from(len))
        .ok_or_else(|| damaged(first, "ends beyond the index space"))
}

/// Where a stored run ends (its seal checked; the frame is not unpacked).
fn run_end(first: u64, row: &[u8]) -> StorageResult<u64> {
    end_of(first, unsealed(first, row)?)
}

/// A stored run's end and its text, checked: the seal, the frame, and its count of
/// leaves.
fn run_text(first: u64, row: &[u8]) -> StorageResult<(u64, String)> {
    let packed = unsealed(first, row)?;
    let text = packed_run::unpack(packed).map_err(|e| damaged(first, e))?;
    Ok((end_of(first, packed)?, text))
}

/// How many leaves the heads log holds: where its last run ends.
pub fn count(runs: &impl ReadableTable<u64, &'static [u8]>) -> StorageResult<u64> {
    match runs.last()? {
        None => Ok(0),
        Some((first, row)) => run_end(first.value(), row.value()),
    }
}

/// Calls `visit` with each leaf `start..end` (index, text) in order, stopping early only
/// where the log ends. A run missing inside the range is an error: a list shorter in the
/// middle would shift every later leaf (a snapshot sent from it, a root).
pub fn visit(
    runs: &impl ReadableTable<u64, &'static [u8]>,
    start: u64,
    end: u64,
    mut visit: impl FnMut(u64, &str) -> StorageResult<()>,
) -> StorageResult<()> {
    if start >= end {
        return Ok(());
    }
    // The run holding `start` begins at or before it; with none there, leaf 0 is lost.
    let begin = match runs.range(..=start)?.next_back() {
        Some(item) => item?.0.value(),
        None => 0,
    };
    let mut expected = begin;
    for item in runs.range(begin..end)? {
        let (first, row) = item?;
        let first = first.value();
        if first != expected {
            return Err(corrupted(format!(
                "heads leaf {expected} is not stored (the next run starts at {first})"
            )));
        }
        let (run_end, text) = run_text(first, row.value())?;
        for (index, leaf) in (first..run_end).zip(text.split('\n')) {
            if index >= end {
                return Ok(());
            }
            if index >= start {
                visit(index, leaf)?;
            }
        }
        expected = run_end;
    }
    Ok(())
}

/// The leaves `start..end` (fewer only where the log ends first), each checked.
pub fn read(
    runs: &impl ReadableTable<u64, &'static [u8]>,
    start: u64,
    end: u64,
) -> StorageResult<Vec<String>> {
    let mut leaves = Vec::new();
    visit(runs, start, end, |_, leaf| {
        leaves.push(leaf.to_string());
        Ok(())
    })?;
    Ok(leaves)
}

/// Reads single leaves, keeping the last run it unpacked: lookups in ascending order
/// unpack each run once.
pub struct LeafLookup<'t, T> {
    runs: &'t T,
    /// The last run unpacked: its first index, its end and its leaves.
    cached: Option<(u64, u64, Vec<String>)>,
}

impl<'t, T: ReadableTable<u64, &'static [u8]>> LeafLookup<'t, T> {
    pub fn new(runs: &'t T) -> Self {
        LeafLookup { runs, cached: None }
    }

    /// Leaf `index`, checked; `None` when no stored run holds it.
    pub fn get(&mut self, index: u64) -> StorageResult<Option<&str>> {
        let holds = |(first, end, _): &(u64, u64, Vec<String>)| (*first..*end).contains(&index);
        if !self.cached.as_ref().is_some_and(holds) {
            self.cached = None;
            let Some(item) = self.runs.range(..=index)?.next_back() else {
                return Ok(None);
            };
            let (first, row) = item?;
            let first = first.value();
            let (end, text) = run_text(first, row.value())?;
            self.cached = Some((first, end, text.split('\n').map(str::to_string).collect()));
        }
        Ok(self
            .cached
            .as_ref()
            .filter(|run| holds(run))
            .and_then(|(first, _, leaves)| leaves.get((index - first) as usize))
            .map(String::as_str))
    }
}

/// Appends `leaves`, the log holding `size` leaves before them: the last run is reopened
/// if it is still open, and the rest packed into runs of a page.
pub fn append(
    runs: &mut Table<u64, &'static [u8]>,
    size: u64,
    leaves: &[String],
) -> StorageResult<()> {
    if leaves.is_empty() {
        return Ok(());
    }
    if let Some(index) = leaves.iter().position(|leaf| leaf.contains('\n')) {
        return Err(corrupted(format!(
            "heads leaf {} holds a newline",
            size + index as u64
        )));
    }
    let last = runs
        .last()?
        .map(|(first, row)| (first.value(), row.value().to_vec()));
    // Where the runs end, and the last run's text if it is still open (unsealed once).
    let (ends, open) = match &last {
        Some((first, row)) if row.len() < CLOSED_BYTES + SEAL_BYTES => {
            let (end, text) = run_text(*first, row)?;
            (end, Some((*first, text, row.len())))
        }
        Some((first, row)) => (run_end(*first, row)?, None),
        None => (0, None),
    };
    if ends != size {
        return Err(corrupted(format!(
            "heads leaves end at {ends}, not at the tree's {size}"
        )));
    }
    let mut lines: Vec<&str> = Vec::new();
    let (start, ratio) = match &open {
        Some((first, text, row_len)) => {
            lines.extend(text.split('\n'));
            (*first, *row_len as f64 / text.len().max(1) as f64)
        }
        None => (size, FIRST_RATIO),
    };
    lines.extend(leaves.iter().map(String::as_str));
    let packed = packed_run::pack_runs(start, &lines, ratio, PACKED_LIMIT, CLOSED_BYTES)
        .map_err(corrupted)?;
    for (first, row) in packed {
        runs.insert(first, checked_row::seal(&row).as_slice())?;
    }
    Ok(())
}

/// Replaces every leaf with `leaves` (a snapshot install).
pub fn replace(runs: &mut Table<u64, &'static [u8]>, leaves: &[String]) -> StorageResult<()> {
    runs.retain(|_, _| false)?;
    append(runs, 0, leaves)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leaf(i: u64) -> String {
        lineage_core::heads::HeadStatement {
            agent_id: format!("agent-{}", i % 7),
            size: i + 1,
            root: hex::encode(sha2::Sha256::digest(i.to_le_bytes())),
            head_hash: hex::encode(sha2::Sha256::digest((i + 1).to_le_bytes())),
        }
        .to_leaf()
    }

    use sha2::Digest;

    fn create() -> (tempfile::TempDir, redb::Database) {
        let dir = tempfile::tempdir().unwrap();
        let db = redb::Database::create(dir.path().join("t.redb")).unwrap();
        (dir, db)
    }

    /// Appends leaves `from..to` in rounds of `round` leaves.
    fn append_rounds(db: &redb::Database, from: u64, to: u64, round: u64) {
        let mut at = from;
        while at < to {
            let upto = (at + round).min(to);
            let txn = db.begin_write().unwrap();
            {
                let mut runs = txn.open_table(HEADS_LEAF_RUNS).unwrap();
                let leaves: Vec<String> = (at..upto).map(leaf).collect();
                append(&mut runs, at, &leaves).unwrap();
            }
            txn.commit().unwrap();
            at = upto;
        }
    }

    fn rows_of(runs: &impl ReadableTable<u64, &'static [u8]>) -> Vec<(u64, Vec<u8>)> {
        runs.iter()
            .unwrap()
            .map(|item| {
                let (k, v) = item.unwrap();
                (k.value(), v.value().to_vec())
            })
            .collect()
    }

    fn stored_runs(db: &redb::Database) -> Vec<(u64, Vec<u8>)> {
        let txn = db.begin_read().unwrap();
        rows_of(&txn.open_table(HEADS_LEAF_RUNS).unwrap())
    }

    fn read_back(db: &redb::Database, start: u64, end: u64) -> StorageResult<Vec<String>> {
        let txn = db.begin_read().unwrap();
        let runs = txn.open_table(HEADS_LEAF_RUNS).unwrap();
        read(&runs, start, end)
    }

    /// Leaves appended a few at a time read back the same from any start, in runs that
    /// each fit a page, every closed one nearly full, in about half the leaves' bytes.
    #[test]
    fn leaves_appended_in_rounds_read_back_in_page_sized_runs() {
        let (_dir, db) = create();
        const N: u64 = 1000;
        append_rounds(&db, 0, N, 7);
        let expected: Vec<String> = (0..N).map(leaf).collect();
        assert_eq!(read_back(&db, 0, u64::MAX).unwrap(), expected);
        for start in [0, 1, 39, 40, 41, 500, 998, 999, 1000, 5000] {
            for end in [start, start + 1, start + 17, start + 300] {
                let want: Vec<String> = (start..end.min(N)).map(leaf).collect();
                assert_eq!(read_back(&db, start, end).unwrap(), want, "{start}..{end}");
            }
        }
        let runs = stored_runs(&db);
        let (last, closed) = runs.split_last().unwrap();
        assert!(closed.len() > 10, "{} runs", runs.len());
        for (first, row) in closed {
            assert!(
                row.len() <= PACKED_LIMIT + SEAL_BYTES && row.len() >= CLOSED_BYTES + SEAL_BYTES,
                "run {first}: {} bytes",
                row.len()
            );
        }
        assert!(last.1.len() <= PACKED_LIMIT + SEAL_BYTES);
        let stored: usize = runs.iter().map(|(_, row)| row.len()).sum();
        let text: usize = expected.iter().map(String::len).sum();
        assert!(stored * 10 < text * 6, "{stored} bytes for {text}");
        let txn = db.begin_read().unwrap();
        let table = txn.open_table(HEADS_LEAF_RUNS).unwrap();
        assert_eq!(count(&table).unwrap(), N);
        let mut lookup = LeafLookup::new(&table);
        for i in [0, 1, 2, 500, 999, 3, 998] {
            assert_eq!(lookup.get(i).unwrap(), Some(leaf(i).as_str()), "{i}");
        }
        assert_eq!(lookup.get(N).unwrap(), None);
    }

    /// Appending at a size other than where the runs end, or a leaf with a newline, is
    /// refused and writes nothing.
    #[test]
    fn an_append_that_does_not_extend_the_runs_is_refused() {
        let (_dir, db) = create();
        append_rounds(&db, 0, 10, 10);
        let before = stored_runs(&db);
        let txn = db.begin_write().unwrap();
        {
            let mut runs = txn.open_table(HEADS_LEAF_RUNS).unwrap();
            for size in [9, 11] {
                let error = append(&mut runs, size, &[leaf(size)]).unwrap_err();
                assert!(error.to_string().contains("end at 10"), "{error}");
            }
            let error = append(&mut runs, 10, &["{\n}".to_string()]).unwrap_err();
            assert!(error.to_string().contains("newline"), "{error}");
            // Inside the transaction, before anything could discard a write.
            assert_eq!(rows_of(&runs), before);
        }
        txn.abort().unwrap();
    }

    /// Any flipped bit, a zeroed or cut run, or a run lost in the middle is an error
    /// naming where, from every start that reads it: never other leaves or fewer.
    #[test]
    fn a_damaged_or_lost_run_is_an_error_never_other_or_fewer_leaves() {
        let (_dir, db) = create();
        append_rounds(&db, 0, 300, 50);
        let runs = stored_runs(&db);
        assert!(runs.len() >= 4);
        let (first, row) = runs[1].clone();
        let second = runs[2].0;
        let write = |row: Option<&[u8]>| {
            let txn = db.begin_write().unwrap();
            {
                let mut table = txn.open_table(HEADS_LEAF_RUNS).unwrap();
                match row {
                    Some(row) => table.insert(first, row).unwrap(),
                    None => table.remove(first).unwrap(),
                };
            }
            txn.commit().unwrap();
        };
        let mut damages: Vec<Vec<u8>> = Vec::new();
        for byte in (0..row.len()).step_by(97) {
            let mut flipped = row.clone();
            flipped[byte] ^= 0x10;
            damages.push(flipped);
        }
        damages.push(vec![0; row.len()]);
        damages.push(row[..row.len() / 2].to_vec());
        for damaged in &damages {
            write(Some(damaged));
            for start in [0, first, first + 1] {
                let error = read_back(&db, start, 300).unwrap_err().to_string();
                assert!(
                    error.contains(&format!("heads leaves from {first}")),
                    "{error}"
                );
            }
            // Outside the run, reads go on.
            assert_eq!(
                read_back(&db, second, 300).unwrap().len() as u64,
                300 - second
            );
            let txn = db.begin_read().unwrap();
            let table = txn.open_table(HEADS_LEAF_RUNS).unwrap();
            assert!(LeafLookup::new(&table).get(first).is_err());
        }
        write(None);
        for start in [0, first, first + 1, second - 1] {
            let error = read_back(&db, start, 300).unwrap_err().to_string();
            assert!(
                error.contains(&format!("heads leaf {first} is not stored")),
                "{start}: {error}"
            );
        }
        let txn = db.begin_read().unwrap();
        let table = txn.open_table(HEADS_LEAF_RUNS).unwrap();
        assert_eq!(LeafLookup::new(&table).get(first).unwrap(), None);
    }
}
