//! How agents' records sit in the state machine: runs of consecutive records, one row per
//! run, keyed by (agent, seq of the run's first record), in two tables.
//!
//! - `records` holds raw runs: the hex SHA-256 of the run's JSON lines joined by `\n` (a
//!   record's line never holds a raw newline), then those lines (`checked_row::seal_text`).
//!   Applies write here, one run per agent per commit. Every read checks the seal
//!   ([`raw_lines`]); a row written before rows were sealed is its lines alone.
//! - [`PACKED_RUNS`] holds packed runs (`packed_run`: compressed and checked), about a
//!   page each. [`merge_tail`] packs an agent's raw rows there once a few have gathered,
//!   with its last packed run if that is not full, and removes them from `records`.
//!
//! Why runs: the writer commits tens of milliseconds of applies at once, and with one row
//! per record, B-tree inserts and the pages they dirtied were about a seventh of every
//! node's CPU (perf, 3 nodes, 16 clients). One run per agent per commit is one insert. A row of
//! one record (every row of older data dirs) is a run of one and reads the same way.
//! Why packed: stored raw, a record took its line's bytes and more on disk; packed, 0.4
//! of them with 200-byte inputs of random letters (`benches` `memory_growth`).
//!
//! Rows do not overlap: after a crash redb is back at its last durable commit, whose
//! last applied id says where openraft re-applies from, so new runs start where the
//! stored ones end, and a merge moves rows between the tables in one transaction.
//! Readers go through both tables in key order and still skip a seq they have already
//! seen, each table from its own last row at or before the seq asked for. A data
//! directory from before packed runs has every row raw; an agent's rows are packed from
//! its first after its next write (or at a snapshot), [`MERGE_LIMIT_BYTES`] a pass.

use redb::{AccessGuard, ReadableTable, StorageError, Table, TableDefinition};

use super::checked_row;
use super::packed_run::{self, PAGE_BYTES};

/// (agent, seq of the run's first record) → a packed run (`packed_run`).
pub const PACKED_RUNS: TableDefinition<(&str, u64), &[u8]> = TableDefinition::new("packed_runs");

/// What a leaf holding one row spends besides the row's text: the leaf's 4-byte header,
/// 4-byte end offsets for the key and the value, and the key (agent, seq) itself, a 4-byte
/// length, the agent's bytes and 8 bytes of seq (redb's tuple encoding).
const ONE_ROW_LEAF_OVERHEAD: usize = 4 + 4 + 4 + 4 + 8;

/// A raw run of `agent`'s takes another line only while the row still fits in a leaf of
/// four pages (16 KiB): its lines within `max_raw_lines_bytes`, its seal beside them.
/// (Raw runs last until the merge packs them; before packing they were the records'
/// lasting form, which is what the figures below measured.)
///
/// Why four: redb gives a leaf bigger than a page a block of a power-of-two number of
/// contiguous pages, and frees it as one when the row is rewritten. The pages merges free
/// (small rows, one per commit) lie scattered between full runs. Runs of 64 KiB needed
/// blocks of sixteen free pages, which those seldom made, so the file kept growing with
/// written pages free; runs of one page are served by any free page but a page holds few
/// lines, so its unfilled end was a fifth of it. At 200k records (16 agents, 567-byte
/// lines, memory_growth) the data file held 168 MB of blocks with 64 KiB runs, 172 MB
/// with 4 KiB runs, and 147 MB with 16 KiB. A line longer than this is a row of its own.
pub fn max_run_bytes(agent: &str) -> usize {
    (4 * PAGE_BYTES).saturating_sub(ONE_ROW_LEAF_OVERHEAD + agent.len())
}
/// A raw row's seal: the hex SHA-256 of its lines, before them.
const RAW_SEAL_BYTES: usize = 64;

/// The lines a raw run may hold within [`max_run_bytes`], its seal beside them.
fn max_raw_lines_bytes(agent: &str) -> usize {
    max_run_bytes(agent).saturating_sub(RAW_SEAL_BYTES)
}

/// A raw row's lines, once its seal is checked: a `Corrupted` error naming the row when a
/// byte of it changed. A row written before raw rows were sealed starts with its first
/// record's `{` and is read as it is (its readers still check its lines as records); a
/// sealed row starts with a hex digit, and no single flipped bit makes one a `{`.
pub fn raw_lines<'a>(agent_id: &str, first: u64, row: &'a str) -> Result<&'a str, StorageError> {
    if row.starts_with('{') {
        return Ok(row);
    }
    checked_row::unseal_text(row).map_err(|why| {
        StorageError::Corrupted(format!("{agent_id}'s raw run from seq {first}: {why}"))
    })
}

/// How many bytes of raw rows one [`merge_tail`] call reads at most.
pub const MERGE_LIMIT_BYTES: usize = 16 * 1024 * 1024;
/// Raw rows are left to gather until there are this many, or a raw run's worth of bytes,
/// so an agent that writes a little at a time does not have its last, open packed run
/// repacked at every merge.
const MERGE_MIN_ROWS: usize = 16;

/// What [`merge_tail`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum Merged {
    /// No small rows to merge.
    Nothing,
    /// Small rows wait for more (`MERGE_MIN_ROWS`).
    NotYet,
    /// Raw rows holding this many bytes were packed.
    Rewrote(usize),
    /// Raw rows holding this many bytes were packed, and more wait beyond the call's
    /// limit: the agent wants another pass.
    Partly(usize),
    /// The rows do not agree (a gap, or an overlap that differs): left as they are, for
    /// the scrub and start-up's chain checks to find.
    Inconsistent,
}

/// Inserts `records`, sorted by (agent, seq), as runs of consecutive seqs.
pub fn insert_runs<'a>(
    table: &mut Table<(&'static str, u64), &'static str>,
    records: impl IntoIterator<Item = (&'a str, u64, &'a str)>,
) -> Result<(), StorageError> {
    let mut runs = RunWriter::default();
    for (agent, seq, line) in records {
        runs.push(table, agent, seq, line)?;
    }
    runs.finish(table)
}

/// Gathers records pushed one at a time, sorted by (agent, seq), into runs: for a caller
/// that is handed records rather than iterating them (a snapshot body parsed as it is
/// read). Holds at most one run.
#[derive(Default)]
pub struct RunWriter {
    /// The run being gathered: its agent, first seq, next seq and lines.
    run: Option<(String, u64, u64, String)>,
}

impl RunWriter {
    pub fn push(
        &mut self,
        table: &mut Table<(&'static str, u64), &'static str>,
        agent: &str,
        seq: u64,
        line: &str,
    ) -> Result<(), StorageError> {
        if let Some((run_agent, first, next, text)) = &mut self.run {
            if run_agent == agent
                && *next == seq
                && text.len() + 1 + line.len() <= max_raw_lines_bytes(agent)
            {
                text.push('\n');
                text.push_str(line);
                *next += 1;
                return Ok(());
            }
            table.insert(
                (run_agent.as_str(), *first),
                checked_row::seal_text(text).as_str(),
            )?;
        }
        self.run = Some((agent.to_string(), seq, seq + 1, line.to_string()));
        Ok(())
    }

    /// Inserts the last run.
    pub fn finish(
        self,
        table: &mut Table<(&'static str, u64), &'static str>,
    ) -> Result<(), StorageError> {
        if let Some((agent, first, _, text)) = self.run {
            table.insert(
                (agent.as_str(), first),
                checked_row::seal_text(&text).as_str(),
            )?;
        }
        Ok(())
    }
}

/// `agent_id`'s newest rows, packed (`packed_run`): the raw rows written since its last
/// packed run, and that run itself if it is not yet full, become packed runs of about a
/// page each, the last of them possibly small (it is reopened at the next merge).
/// Waits (`NotYet`) while there are fewer than `MERGE_MIN_ROWS` raw rows holding less than
/// a raw run's worth of text, unless `however_few`. At most `limit` bytes of raw rows (and
/// at least one row) are read per call; the rest, which follows them, waits for the next.
///
/// One transaction: a crash leaves either the old rows or the packed ones, the same
/// records under the same seqs. Rows that do not fit together (a gap, an overlap that
/// differs, a packed run that does not unpack) are left as they are, for the scrub and
/// start-up's checks to find.
pub fn merge_tail(
    raw: &mut Table<(&'static str, u64), &'static str>,
    packed: &mut Table<(&'static str, u64), &'static [u8]>,
    agent_id: &str,
    however_few: bool,
    limit: usize,
) -> Result<Merged, StorageError> {
    // Where the raw tail starts: after the last packed run, or at that run if it is open.
    let last_packed = match packed
        .range((agent_id, 0)..=(agent_id, u64::MAX))?
        .next_back()
    {
        Some(row) => {
            let (key, row) = row?;
            Some((key.value().1, row.value().to_vec()))
        }
        None => None,
    };
    let (from, open) = match &last_packed {
        Some((first, row)) if row.len() < closed_row_bytes(agent_id) => {
            match packed_run::unpack(row) {
                Ok(text) => (*first, Some((*first, text))),
                Err(_) => return Ok(Merged::Inconsistent),
            }
        }
        Some((first, row)) => match packed_run::stated_lines(row) {
            Ok(lines) => (first.saturating_add(u64::from(lines)), None),
            Err(_) => return Ok(Merged::Inconsistent),
        },
        None => (0, None),
    };
    let mut tail: Vec<(u64, String)> = Vec::new();
    let mut bytes = 0;
    let mut more = false;
    for row in table_range(raw, agent_id, from)? {
        let (key, text) = row?;
        if bytes > 0 && bytes + text.value().len() > limit {
            more = true;
            break;
        }
        bytes += text.value().len();
        let first = key.value().1;
        // A row whose seal does not check is left as it is, as a gap is (below).
        let Ok(lines) = raw_lines(agent_id, first, text.value()) else {
            return Ok(Merged::Inconsistent);
        };
        tail.push((first, lines.to_string()));
    }
    if tail.is_empty() {
        return Ok(Merged::Nothing);
    }
    // A tail the limit cut is never left waiting: the agent must stay due.
    if !however_few && !more && tail.len() < MERGE_MIN_ROWS && bytes < max_run_bytes(agent_id) {
        return Ok(Merged::NotYet);
    }
    // Every line from the open run (or the first raw row) on, each once, without a gap.
    let mut lines: Vec<&str> = Vec::new();
    let start = match &open {
        Some((first, text)) => {
            lines.extend(text.split('\n'));
            *first
        }
        None if last_packed.is_some() => from,
        None => tail[0].0,
    };
    for (first, text) in &tail {
        for (seq, line) in row_lines(*first, text) {
            let next = start + lines.len() as u64;
            if seq > next {
                // A gap: a row holds fewer lines than the next row's key says (a byte
                // changed into or out of a newline, a row lost). Rewriting would make
                // the damage permanent and could drop records: leave it for the scrub.
                return Ok(Merged::Inconsistent);
            }
            if seq == next {
                lines.push(line);
            } else if lines.get((seq - start) as usize) != Some(&line) {
                // An older overlapping row counts once only if it says the same; one that
                // differs (a row holding more lines than its place allows) is damage.
                return Ok(Merged::Inconsistent);
            }
        }
    }
    // The ratio the open run was packed at guesses the next runs' (`pack_runs`).
    let ratio = match (&open, &last_packed) {
        (Some((_, text)), Some((_, row))) if !text.is_empty() => {
            row.len() as f64 / text.len() as f64
        }
        _ => 0.34,
    };
    let runs = packed_run::pack_runs(
        start,
        &lines,
        ratio,
        packed_row_bytes(agent_id),
        closed_row_bytes(agent_id),
    )
    .map_err(StorageError::Corrupted)?;
    if let Some((first, _)) = &open {
        packed.remove((agent_id, *first))?;
    }
    for (first, _) in &tail {
        raw.remove((agent_id, *first))?;
    }
    for (first, row) in &runs {
        packed.insert((agent_id, *first), row.as_slice())?;
    }
    Ok(if more {
        Merged::Partly(bytes)
    } else {
        Merged::Rewrote(bytes)
    })
}

/// A packed run takes more lines only while it still fits in a leaf of one page: rows
/// no bigger share leaves with their neighbours, so the last, small run of an agent
/// costs its bytes, not a block of pages.
pub fn packed_row_bytes(agent: &str) -> usize {
    PAGE_BYTES.saturating_sub(ONE_ROW_LEAF_OVERHEAD + agent.len())
}

/// A packed run at least this big is closed: it is never reopened to take more lines.
fn closed_row_bytes(agent: &str) -> usize {
    packed_row_bytes(agent) * 7 / 8
}

/// `agent_id`'s rows of `table` from first seq `from` on.
fn table_range<'t, V: redb::Value + 'static>(
    table: &'t impl ReadableTable<(&'static str, u64), V>,
    agent_id: &str,
    from: u64,
) -> Result<redb::Range<'t, (&'static str, u64), V>, StorageError> {
    table.range((agent_id, from)..=(agent_id, u64::MAX))
}

/// The first seq of `agent_id`'s last row in `table` at or before `seq` (`seq` with none).
fn run_start<V: redb::Value + 'static>(
    table: &impl ReadableTable<(&'static str, u64), V>,
    agent_id: &str,
    seq: u64,
) -> Result<u64, StorageError> {
    match table.range((agent_id, 0)..=(agent_id, seq))?.next_back() {
        Some(row) => Ok(row?.0.value().1),
        None => Ok(seq),
    }
}

/// A packed run that does not unpack, or whose header does not read, named.
fn damaged_run(agent_id: &str, first: u64, why: String) -> StorageError {
    StorageError::Corrupted(format!("{agent_id}'s packed run from seq {first}: {why}"))
}

/// A row's records as (seq, line): the run starts at `first`.
fn row_lines(first: u64, text: &str) -> impl Iterator<Item = (u64, &str)> {
    (first..).zip(text.split('\n'))
}

/// The raw rows of the `records` table.
pub trait RawRows: ReadableTable<(&'static str, u64), &'static str> {}
impl<T: ReadableTable<(&'static str, u64), &'static str>> RawRows for T {}
/// The packed rows of the [`PACKED_RUNS`] table.
pub trait PackedRows: ReadableTable<(&'static str, u64), &'static [u8]> {}
impl<T: ReadableTable<(&'static str, u64), &'static [u8]>> PackedRows for T {}

/// A row's lines: borrowed from a raw row whose seal checked (from this byte on), or
/// unpacked.
enum RowText<'a> {
    Raw(AccessGuard<'a, &'static str>, usize),
    Packed(String),
}

impl RowText<'_> {
    fn as_str(&self) -> &str {
        match self {
            RowText::Raw(guard, lines_at) => guard.value().get(*lines_at..).unwrap_or_default(),
            RowText::Packed(text) => text,
        }
    }
}

type RowKey<'a> = AccessGuard<'a, (&'static str, u64)>;

/// The rows of both tables in key order: (agent, first seq) and the row's text. A
/// packed run that does not unpack is a `Corrupted` error naming it.
struct StoredRows<'a> {
    raw: std::iter::Peekable<redb::Range<'a, (&'static str, u64), &'static str>>,
    packed: std::iter::Peekable<redb::Range<'a, (&'static str, u64), &'static [u8]>>,
}

impl<'a> Iterator for StoredRows<'a> {
    type Item = Result<(RowKey<'a>, RowText<'a>), StorageError>;

    fn next(&mut self) -> Option<Self::Item> {
        let raw_first = match (self.raw.peek(), self.packed.peek()) {
            (None, None) => return None,
            (Some(_), None) | (Some(Err(_)), _) => true,
            (None, Some(_)) | (_, Some(Err(_))) => false,
            (Some(Ok((raw, _))), Some(Ok((packed, _)))) => raw.value() <= packed.value(),
        };
        if raw_first {
            let row = self.raw.next()?;
            return Some(row.and_then(|(key, text)| {
                let (agent, first) = key.value();
                let row = text.value();
                let lines_at = row.len() - raw_lines(agent, first, row)?.len();
                Ok((key, RowText::Raw(text, lines_at)))
            }));
        }
        let row = self.packed.next()?;
        Some(row.and_then(|(key, row)| {
            let (agent, first) = key.value();
            let text = packed_run::unpack(row.value()).map_err(|e| damaged_run(agent, first, e))?;
            Ok((key, RowText::Packed(text)))
        }))
    }
}

/// Calls `visit(seq, line)` for `agent_id`'s records from seq `from` on, in order, each
/// once, until it returns false. An agent's records are dense from seq 0, so a row that
/// starts past the seq wanted next means records went missing from the store (a row's
/// end cut off, a row gone): a `Corrupted` error naming them, never a shorter or gapped
/// read. (Records missing after the last row are the stored ends' to catch:
/// `record_ends`, and the callers that know the agent's head.)
pub fn visit_lines(
    raw: &impl RawRows,
    packed: &impl PackedRows,
    agent_id: &str,
    from: u64,
    mut visit: impl FnMut(u64, &str) -> bool,
) -> Result<(), StorageError> {
    // The run holding `from` starts at or before it, in one table or the other: each
    // table is read from its own last row at or before `from` (an older overlapping row
    // in one must not hide the other's run that holds `from`).
    let rows = StoredRows {
        raw: table_range(raw, agent_id, run_start(raw, agent_id, from)?)?.peekable(),
        packed: table_range(packed, agent_id, run_start(packed, agent_id, from)?)?.peekable(),
    };
    let mut next = from;
    for row in rows {
        let (key, text) = row?;
        for (seq, line) in row_lines(key.value().1, text.as_str()) {
            if seq < next {
                continue;
            }
            if seq > next {
                return Err(StorageError::Corrupted(format!(
                    "{agent_id}'s records {next}..{seq} are missing from the store"
                )));
            }
            if !visit(seq, line) {
                return Ok(());
            }
            next = seq + 1;
        }
    }
    Ok(())
}

/// The seq after `agent_id`'s last stored record (0 with none), read from its newest row
/// in either table (a packed run's from its header).
pub fn rows_end(
    raw: &impl RawRows,
    packed: &impl PackedRows,
    agent_id: &str,
) -> Result<u64, StorageError> {
    let raw_end = match table_range(raw, agent_id, 0)?.next_back() {
        Some(row) => {
            let (key, text) = row?;
            let first = key.value().1;
            let lines = raw_lines(agent_id, first, text.value())?
                .split('\n')
                .count() as u64;
            first.saturating_add(lines)
        }
        None => 0,
    };
    let packed_end = match table_range(packed, agent_id, 0)?.next_back() {
        Some(row) => {
            let (key, row) = row?;
            let first = key.value().1;
            let lines = packed_run::stated_lines(row.value())
                .map_err(|e| damaged_run(agent_id, first, e))?;
            first.saturating_add(u64::from(lines))
        }
        None => 0,
    };
    Ok(raw_end.max(packed_end))
}

/// Calls `visit(agent, seq, line)` for every record in both tables, in (agent, seq)
/// order, each once.
pub fn visit_all(
    raw: &impl RawRows,
    packed: &impl PackedRows,
    mut visit: impl FnMut(&str, u64, &str) -> Result<(), String>,
) -> Result<(), String> {
    let rows = StoredRows {
        raw: raw.iter().map_err(|e| e.to_string())?.peekable(),
        packed: packed.iter().map_err(|e| e.to_string())?.peekable(),
    };
    let mut current: Option<(String, u64)> = None;
    for row in rows {
        let (key, text) = row.map_err(|e| e.to_string())?;
        let (agent, first) = key.value();
        if current.as_ref().is_none_or(|(a, _)| a != agent) {
            current = Some((agent.to_string(), 0));
        }
        let Some((_, next)) = current.as_mut() else {
            continue;
        };
        for (seq, line) in row_lines(first, text.as_str()) {
            if seq < *next {
                continue;
            }
            visit(agent, seq, line)?;
            *next = seq + 1;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use redb::{Database, TableDefinition};

    const RECORDS: TableDefinition<(&str, u64), &str> = TableDefinition::new("records");

    fn create() -> (tempfile::TempDir, Database) {
        let dir = tempfile::tempdir().unwrap();
        let db = Database::create(dir.path().join("t.redb")).unwrap();
        let txn = db.begin_write().unwrap();
        txn.open_table(RECORDS).unwrap();
        txn.open_table(PACKED_RUNS).unwrap();
        txn.commit().unwrap();
        (dir, db)
    }

    fn lines(db: &Database, agent: &str, from: u64, limit: usize) -> Vec<(u64, String)> {
        try_lines(db, agent, from, limit).unwrap()
    }

    fn try_lines(
        db: &Database,
        agent: &str,
        from: u64,
        limit: usize,
    ) -> Result<Vec<(u64, String)>, StorageError> {
        let txn = db.begin_read().unwrap();
        let raw = txn.open_table(RECORDS).unwrap();
        let packed = txn.open_table(PACKED_RUNS).unwrap();
        let mut out = Vec::new();
        visit_lines(&raw, &packed, agent, from, |seq, line| {
            out.push((seq, line.to_string()));
            out.len() < limit
        })?;
        Ok(out)
    }

    fn all(db: &Database) -> Result<Vec<String>, String> {
        let txn = db.begin_read().unwrap();
        let raw = txn.open_table(RECORDS).unwrap();
        let packed = txn.open_table(PACKED_RUNS).unwrap();
        let mut every = Vec::new();
        visit_all(&raw, &packed, |agent, seq, line| {
            every.push(format!("{agent}{seq}={line}"));
            Ok(())
        })?;
        Ok(every)
    }

    fn end(db: &Database, agent: &str) -> Result<u64, StorageError> {
        let txn = db.begin_read().unwrap();
        let raw = txn.open_table(RECORDS).unwrap();
        let packed = txn.open_table(PACKED_RUNS).unwrap();
        rows_end(&raw, &packed, agent)
    }

    /// `merge_tail` for `agent` in a transaction of its own, committed.
    fn merge_committed(db: &Database, agent: &str, however_few: bool) -> Merged {
        merge_committed_within(db, agent, however_few, MERGE_LIMIT_BYTES)
    }

    fn merge_committed_within(
        db: &Database,
        agent: &str,
        however_few: bool,
        limit: usize,
    ) -> Merged {
        let txn = db.begin_write().unwrap();
        let merged = {
            let mut raw = txn.open_table(RECORDS).unwrap();
            let mut packed = txn.open_table(PACKED_RUNS).unwrap();
            merge_tail(&mut raw, &mut packed, agent, however_few, limit).unwrap()
        };
        txn.commit().unwrap();
        merged
    }

    /// Rows as (first seq, row bytes).
    type Rows = Vec<(u64, Vec<u8>)>;

    /// Each table's rows of `agent`: raw, packed.
    fn rows(db: &Database, agent: &str) -> (Rows, Rows) {
        let txn = db.begin_read().unwrap();
        let raw = txn.open_table(RECORDS).unwrap();
        let packed = txn.open_table(PACKED_RUNS).unwrap();
        let raw = table_range(&raw, agent, 0)
            .unwrap()
            .map(|row| {
                let (key, text) = row.unwrap();
                (key.value().1, text.value().as_bytes().to_vec())
            })
            .collect();
        let packed = table_range(&packed, agent, 0)
            .unwrap()
            .map(|row| {
                let (key, row) = row.unwrap();
                (key.value().1, row.value().to_vec())
            })
            .collect();
        (raw, packed)
    }

    /// A line like a record's: JSON keys, a counter, and a hash that differs per line.
    fn record_line(agent: &str, seq: u64) -> String {
        let hash: String = (0..8)
            .map(|i| {
                format!(
                    "{:08x}",
                    (seq + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15 >> i) as u32
                )
            })
            .collect();
        format!(
            r#"{{"seq":{seq},"actor":"{agent}","kind":"action_requested","payload":{{"tool":"search","input":{{"n":{}}}}},"hash":"{hash}"}}"#,
            seq * 7 % 1000
        )
    }

    fn write_one_row_each(db: &Database, agent: &str, seqs: std::ops::Range<u64>) {
        let txn = db.begin_write().unwrap();
        {
            let mut table = txn.open_table(RECORDS).unwrap();
            for seq in seqs {
                let text = record_line(agent, seq);
                insert_runs(&mut table, [(agent, seq, text.as_str())]).unwrap();
            }
        }
        txn.commit().unwrap();
    }

    /// A limit of one row packs one row a call, and each call that leaves rows says so
    /// (`Partly`), never `NotYet`: the caller keeps the agent due until all are packed.
    #[test]
    fn a_tail_cut_by_the_limit_is_partly_merged_never_left_waiting() {
        let (_dir, db) = create();
        write_one_row_each(&db, "a", 0..5);
        let before = lines(&db, "a", 0, 100);
        let one_row = record_line("a", 0).len();
        for left in (1..5).rev() {
            assert!(
                matches!(
                    merge_committed_within(&db, "a", false, one_row),
                    Merged::Partly(_)
                ),
                "{left} rows left"
            );
            assert_eq!(rows(&db, "a").0.len(), left);
        }
        // The last, uncut, waits for more like any small tail, unless told otherwise.
        assert_eq!(
            merge_committed_within(&db, "a", false, one_row),
            Merged::NotYet
        );
        assert!(matches!(
            merge_committed_within(&db, "a", true, one_row),
            Merged::Rewrote(_)
        ));
        assert!(rows(&db, "a").0.is_empty(), "raw rows left");
        assert_eq!(lines(&db, "a", 0, 100), before);
    }

    #[test]
    fn runs_read_back_from_any_seq_and_overlaps_count_once() {
        let (_dir, db) = create();
        let txn = db.begin_write().unwrap();
        {
            let mut table = txn.open_table(RECORDS).unwrap();
            // a: 0..=2 in one run, then 3..=4 (a later commit), and a single old-style
            // row at 4 that overlaps; b: one run.
            insert_runs(
                &mut table,
                [
                    ("a", 0, "a0"),
                    ("a", 1, "a1"),
                    ("a", 2, "a2"),
                    ("b", 0, "b0"),
                ],
            )
            .unwrap();
            insert_runs(&mut table, [("a", 3, "a3"), ("a", 4, "a4")]).unwrap();
            insert_runs(&mut table, [("a", 4, "a4")]).unwrap();
            insert_runs(&mut table, [("c", 0, "c0"), ("c", 2, "c2")]).unwrap();
        }
        txn.commit().unwrap();
        let every: Vec<String> = lines(&db, "a", 0, usize::MAX)
            .into_iter()
            .map(|(seq, line)| format!("{seq}:{line}"))
            .collect();
        assert_eq!(every, ["0:a0", "1:a1", "2:a2", "3:a3", "4:a4"]);
        assert_eq!(lines(&db, "a", 1, 2), [(1, "a1".into()), (2, "a2".into())]);
        assert_eq!(lines(&db, "a", 4, 9), [(4, "a4".into())]);
        assert!(lines(&db, "a", 5, 9).is_empty());
        assert_eq!(lines(&db, "b", 0, 9), [(0, "b0".into())]);
        // A gap starts a new run: both records are stored, under their own seqs, but a
        // read across the gap says records are missing instead of skipping them.
        let (c_rows, _) = rows(&db, "c");
        assert_eq!(
            c_rows.iter().map(|(first, _)| *first).collect::<Vec<_>>(),
            [0, 2]
        );
        let across = try_lines(&db, "c", 0, 9).unwrap_err().to_string();
        assert!(across.contains("c's records 1..2 are missing"), "{across}");
        assert_eq!(lines(&db, "c", 2, 9), [(2, "c2".into())]);
        assert_eq!(
            all(&db).unwrap(),
            ["a0=a0", "a1=a1", "a2=a2", "a3=a3", "a4=a4", "b0=b0", "c0=c0", "c2=c2"]
        );
        assert_eq!(end(&db, "a").unwrap(), 5);
    }

    #[test]
    fn runs_stop_growing_at_the_size_limit() {
        let (_dir, db) = create();
        let line = "x".repeat(1000);
        let txn = db.begin_write().unwrap();
        {
            let mut table = txn.open_table(RECORDS).unwrap();
            insert_runs(&mut table, (0..200).map(|seq| ("a", seq, line.as_str()))).unwrap();
        }
        txn.commit().unwrap();
        let (raw, _) = rows(&db, "a");
        let rows: Vec<usize> = raw.iter().map(|(_, text)| text.len()).collect();
        // As many 1000-byte lines as fit in one run, and a row per that many.
        let per_run = (max_run_bytes("a") + 1) / (line.len() + 1);
        assert_eq!(per_run, 16);
        assert_eq!(rows.len(), 200usize.div_ceil(per_run), "{rows:?}");
        assert!(
            rows.iter().all(|&len| len <= max_run_bytes("a")),
            "{rows:?}"
        );
        assert_eq!(lines(&db, "a", 0, usize::MAX).len(), 200);
        assert_eq!(lines(&db, "a", 150, 1), [(150, line.clone())]);
    }

    /// Rows of one record each (one commit each), plus an older row overlapping them,
    /// pack into runs of at most a page that read back the same, from any seq, in both
    /// tables' order with the raw rows written after; a second merge changes nothing; rows
    /// written later wait for a few more, then go into the last, open run and new ones,
    /// and the closed runs are not rewritten.
    #[test]
    fn raw_rows_pack_into_page_sized_runs_that_read_the_same() {
        let (_dir, db) = create();
        write_one_row_each(&db, "a", 0..500);
        write_one_row_each(&db, "b", 0..3);
        let txn = db.begin_write().unwrap();
        {
            let mut table = txn.open_table(RECORDS).unwrap();
            let pair = format!("{}\n{}", record_line("a", 40), record_line("a", 41));
            table.insert(("a", 40), pair.as_str()).unwrap();
        }
        txn.commit().unwrap();
        let expected = |n: u64| -> Vec<(u64, String)> {
            (0..n).map(|seq| (seq, record_line("a", seq))).collect()
        };
        assert_eq!(lines(&db, "a", 0, usize::MAX), expected(500));
        let text_bytes: usize = expected(500).iter().map(|(_, l)| l.len() + 1).sum();

        assert!(matches!(
            merge_committed(&db, "a", false),
            Merged::Rewrote(_)
        ));
        let (raw, packed) = rows(&db, "a");
        assert!(raw.is_empty(), "{} raw rows left", raw.len());
        let packed_bytes: usize = packed.iter().map(|(_, row)| row.len()).sum();
        assert!(
            packed_bytes * 2 < text_bytes,
            "{packed_bytes} packed of {text_bytes}"
        );
        let (last, closed) = packed.split_last().unwrap();
        assert!(
            closed
                .iter()
                .all(|(_, row)| row.len() <= packed_row_bytes("a")
                    && row.len() >= closed_row_bytes("a")),
            "{:?}",
            packed.iter().map(|(_, r)| r.len()).collect::<Vec<_>>()
        );
        assert!(last.1.len() <= packed_row_bytes("a"));
        assert_eq!(lines(&db, "a", 0, usize::MAX), expected(500));
        assert_eq!(lines(&db, "a", 300, 1), [(300, record_line("a", 300))]);
        assert_eq!(end(&db, "a").unwrap(), 500);
        assert_eq!(merge_committed(&db, "a", false), Merged::Nothing);
        assert_eq!(rows(&db, "a").1, packed, "a second merge rewrote rows");
        let b: Vec<String> = (0..3)
            .map(|s| format!("b{s}={}", record_line("b", s)))
            .collect();
        let every = all(&db).unwrap();
        assert_eq!(every.len(), 503);
        assert_eq!(every[500..], b);

        // A few rows wait for more; enough of them repack the open run with them.
        write_one_row_each(&db, "a", 500..505);
        assert_eq!(merge_committed(&db, "a", false), Merged::NotYet);
        assert_eq!(rows(&db, "a").0.len(), 5);
        assert_eq!(lines(&db, "a", 0, usize::MAX), expected(505));
        assert_eq!(lines(&db, "a", 498, 4).len(), 4);
        assert_eq!(end(&db, "a").unwrap(), 505);
        write_one_row_each(&db, "a", 505..520);
        assert!(matches!(
            merge_committed(&db, "a", false),
            Merged::Rewrote(_)
        ));
        let (raw, after) = rows(&db, "a");
        assert!(raw.is_empty());
        let reopened = usize::from(last.1.len() < closed_row_bytes("a"));
        assert_eq!(
            after[..packed.len() - reopened],
            packed[..packed.len() - reopened],
            "closed runs were rewritten"
        );
        assert_eq!(lines(&db, "a", 0, usize::MAX), expected(520));
        assert_eq!(end(&db, "a").unwrap(), 520);
        // At a snapshot even one raw row is packed.
        write_one_row_each(&db, "a", 520..521);
        assert_eq!(merge_committed(&db, "a", false), Merged::NotYet);
        assert!(matches!(
            merge_committed(&db, "a", true),
            Merged::Rewrote(_)
        ));
        assert!(rows(&db, "a").0.is_empty());
        assert_eq!(lines(&db, "a", 0, usize::MAX), expected(521));
    }

    /// An older raw row overlapping a packed run (the same lines twice) hides none of the
    /// run's lines from a read that starts inside both.
    #[test]
    fn an_overlapping_raw_row_hides_no_packed_line() {
        let (_dir, db) = create();
        let text: Vec<String> = (30..43).map(|seq| record_line("a", seq)).collect();
        let txn = db.begin_write().unwrap();
        {
            let mut packed = txn.open_table(PACKED_RUNS).unwrap();
            let row = packed_run::pack(&text.join("\n"), 13).unwrap();
            packed.insert(("a", 30), row.as_slice()).unwrap();
            let mut raw = txn.open_table(RECORDS).unwrap();
            raw.insert(("a", 41), text[11].as_str()).unwrap();
        }
        txn.commit().unwrap();
        for from in [30, 40, 41, 42] {
            let expected: Vec<(u64, String)> = (from..43)
                .map(|seq| (seq, text[(seq - 30) as usize].clone()))
                .collect();
            assert_eq!(lines(&db, "a", from, usize::MAX), expected, "from {from}");
        }
        assert_eq!(end(&db, "a").unwrap(), 43);
    }

    /// Commits of more than a raw run's worth (full raw runs and a remainder each), and a
    /// line that alone is bigger than a packed run, pack in seq order.
    #[test]
    fn full_raw_runs_and_a_huge_line_pack_in_order() {
        let (_dir, db) = create();
        let huge = "q".repeat(3 * PAGE_BYTES) + &record_line("a", 999);
        let line = |seq: u64| {
            if seq == 70 {
                huge.clone()
            } else {
                record_line("a", seq)
            }
        };
        for chunk in 0..4u64 {
            let texts: Vec<(u64, String)> = (chunk * 40..(chunk + 1) * 40)
                .map(|s| (s, line(s)))
                .collect();
            let txn = db.begin_write().unwrap();
            {
                let mut table = txn.open_table(RECORDS).unwrap();
                insert_runs(&mut table, texts.iter().map(|(s, l)| ("a", *s, l.as_str()))).unwrap();
            }
            txn.commit().unwrap();
        }
        assert!(matches!(
            merge_committed(&db, "a", false),
            Merged::Rewrote(_)
        ));
        let expected: Vec<(u64, String)> = (0..160).map(|s| (s, line(s))).collect();
        assert_eq!(lines(&db, "a", 0, usize::MAX), expected);
        assert_eq!(lines(&db, "a", 70, 1), [(70, huge.clone())]);
        assert!(rows(&db, "a").0.is_empty());
        assert_eq!(end(&db, "a").unwrap(), 160);
    }

    /// Rows that do not fit together are never rewritten: a flipped byte that became a
    /// newline (a row with one line too many, overlapping the next row with other text),
    /// a row with a line too few (a gap before the next row), or an open packed run that
    /// does not unpack leaves every row as it was.
    #[test]
    fn damaged_rows_are_not_merged() {
        for damage in ["newline", "cut", "packed"] {
            let (_dir, db) = create();
            write_one_row_each(&db, "a", 0..3);
            assert!(matches!(
                merge_committed(&db, "a", true),
                Merged::Rewrote(_)
            ));
            write_one_row_each(&db, "a", 3..40);
            let txn = db.begin_write().unwrap();
            {
                let mut table = txn.open_table(RECORDS).unwrap();
                match damage {
                    "newline" => {
                        let damaged = record_line("a", 5).replacen('s', "\n", 1);
                        table.insert(("a", 5), damaged.as_str()).unwrap();
                    }
                    "cut" => {
                        table.remove(("a", 5)).unwrap();
                    }
                    _ => {
                        let mut packed = txn.open_table(PACKED_RUNS).unwrap();
                        let mut row = packed.get(("a", 0)).unwrap().unwrap().value().to_vec();
                        let at = row.len() - 6;
                        row[at] ^= 0x10;
                        packed.insert(("a", 0), row.as_slice()).unwrap();
                    }
                }
            }
            txn.commit().unwrap();
            let before = rows(&db, "a");
            assert_eq!(
                merge_committed(&db, "a", true),
                Merged::Inconsistent,
                "{damage}"
            );
            assert_eq!(rows(&db, "a"), before, "{damage}: rows were rewritten");
        }
    }

    /// A packed run flipped, zeroed or cut is an error for every read over it (never its
    /// lines missing or others in their place); the lines before it still read.
    #[test]
    fn a_damaged_packed_run_is_an_error_never_fewer_lines() {
        let (_dir, db) = create();
        write_one_row_each(&db, "a", 0..600);
        assert!(matches!(
            merge_committed(&db, "a", true),
            Merged::Rewrote(_)
        ));
        let (_, packed) = rows(&db, "a");
        assert!(packed.len() >= 3, "{} packed runs", packed.len());
        let (first, row) = packed[1].clone();
        let damaged_rows = [
            {
                let mut r = row.clone();
                r[row.len() / 2] ^= 0x01;
                r
            },
            vec![0; row.len()],
            row[..row.len() - 1].to_vec(),
            row[..3].to_vec(),
        ];
        for damaged in damaged_rows {
            let txn = db.begin_write().unwrap();
            txn.open_table(PACKED_RUNS)
                .unwrap()
                .insert(("a", first), damaged.as_slice())
                .unwrap();
            txn.commit().unwrap();
            for from in [0, first, first + 1] {
                let read = try_lines(&db, "a", from, usize::MAX);
                assert!(
                    matches!(&read, Err(StorageError::Corrupted(_))),
                    "from {from}: {:?}",
                    read.map(|l| l.len())
                );
            }
            assert!(all(&db).is_err());
            assert_eq!(lines(&db, "a", 0, first as usize).len(), first as usize);
        }
    }

    /// A raw row that lost lines from its end (a changed byte at a line boundary, a bad
    /// page) must not read as a log with a hole in it: every read across the hole fails
    /// and names the missing seqs; reads that start past it are whole.
    #[test]
    fn a_row_cut_short_is_an_error_for_every_read_across_it() {
        let (_dir, db) = create();
        let txn = db.begin_write().unwrap();
        {
            let mut table = txn.open_table(RECORDS).unwrap();
            insert_runs(&mut table, [("a", 0, "a0"), ("a", 1, "a1"), ("a", 2, "a2")]).unwrap();
            insert_runs(&mut table, [("a", 3, "a3"), ("a", 4, "a4")]).unwrap();
            // The first run loses its last line (and is sealed again: the seal alone
            // would catch a cut, below).
            table
                .insert(("a", 0), checked_row::seal_text("a0\na1").as_str())
                .unwrap();
        }
        txn.commit().unwrap();
        for from in [0, 1, 2] {
            let error = try_lines(&db, "a", from, 9).unwrap_err().to_string();
            assert!(
                error.contains("a's records 2..3 are missing"),
                "from {from}: {error}"
            );
        }
        assert_eq!(lines(&db, "a", 3, 9), [(3, "a3".into()), (4, "a4".into())]);
        // A read that stops before the hole still reads what it asked for.
        assert_eq!(lines(&db, "a", 0, 2), [(0, "a0".into()), (1, "a1".into())]);
    }

    /// A sealed raw row with any one bit flipped is an error for every read of it (lines,
    /// its end), and a merge leaves it as it is, never other lines nor fewer. Flips that
    /// leave the row no longer UTF-8 are not written: redb's `&str` reads would panic on
    /// them (the node then exits, and the page check after that unclean stop finds the
    /// page).
    #[test]
    fn every_bit_flipped_in_a_sealed_raw_row_is_an_error() {
        let (_dir, db) = create();
        let text: Vec<String> = (0..3).map(|seq| record_line("a", seq)).collect();
        let write = |row: &str| {
            let mut txn = db.begin_write().unwrap();
            txn.set_durability(redb::Durability::None);
            {
                let mut table = txn.open_table(RECORDS).unwrap();
                table.retain(|_, _| false).unwrap();
                table.insert(("a", 0), row).unwrap();
            }
            txn.commit().unwrap();
        };
        {
            let txn = db.begin_write().unwrap();
            insert_runs(
                &mut txn.open_table(RECORDS).unwrap(),
                text.iter()
                    .zip(0..)
                    .map(|(line, seq)| ("a", seq, line.as_str())),
            )
            .unwrap();
            txn.commit().unwrap();
        }
        let sealed = String::from_utf8(rows(&db, "a").0.pop().expect("one row").1).unwrap();
        assert_ne!(sealed, text.join("\n"), "the row carries its seal");
        assert_eq!(lines(&db, "a", 0, 9).len(), 3);
        let (mut flips, mut not_utf8) = (0, 0);
        for at in 0..sealed.len() {
            for bit in 0..8 {
                let mut bytes = sealed.clone().into_bytes();
                bytes[at] ^= 1 << bit;
                let Ok(damaged) = String::from_utf8(bytes) else {
                    not_utf8 += 1;
                    continue;
                };
                write(&damaged);
                flips += 1;
                let read = try_lines(&db, "a", 0, 9);
                assert!(
                    matches!(&read, Err(StorageError::Corrupted(why)) if why.contains("raw run from seq 0")),
                    "byte {at} bit {bit}: {read:?}"
                );
                assert!(end(&db, "a").is_err(), "byte {at} bit {bit}");
                assert!(all(&db).is_err(), "byte {at} bit {bit}");
                if at % 16 == 0 {
                    assert_eq!(merge_committed(&db, "a", true), Merged::Inconsistent);
                    let left = [(0, damaged.clone().into_bytes())];
                    assert_eq!(rows(&db, "a").0, left, "left as it is");
                }
            }
        }
        // Every flip of the seven low bits of these ASCII bytes was written and read.
        assert_eq!(flips + not_utf8, 8 * sealed.len());
        assert!(
            flips >= 7 * sealed.len(),
            "{flips} flips, {not_utf8} not UTF-8"
        );
    }

    /// A raw row written before rows were sealed (its lines alone, from the first record's
    /// `{`) reads as it did, and is packed like any other.
    #[test]
    fn a_raw_row_from_before_seals_reads_as_it_did() {
        let (_dir, db) = create();
        let text: Vec<String> = (0..3).map(|seq| record_line("a", seq)).collect();
        let txn = db.begin_write().unwrap();
        txn.open_table(RECORDS)
            .unwrap()
            .insert(("a", 0), text.join("\n").as_str())
            .unwrap();
        txn.commit().unwrap();
        let expected: Vec<(u64, String)> = (0..).zip(text.iter().cloned()).collect();
        assert_eq!(lines(&db, "a", 0, 9), expected);
        assert_eq!(end(&db, "a").unwrap(), 3);
        assert!(matches!(
            merge_committed(&db, "a", true),
            Merged::Rewrote(_)
        ));
        assert!(rows(&db, "a").0.is_empty(), "packed");
        assert_eq!(lines(&db, "a", 0, 9), expected);
    }
}
