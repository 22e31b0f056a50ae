//! How agents' records sit in the state machine's `records` table: runs of consecutive
//! records, one row per run, keyed by (agent, seq of the run's first record), holding the
//! run's JSON lines joined by `\n` (a record's line never holds a raw newline).
//!
//! Why runs: the writer commits tens of milliseconds of applies at once, and with one row
//! per record, B-tree inserts and the pages they dirtied were about a seventh of every
//! node's CPU (perf, 3 nodes, 16 clients). One run per agent per commit is one insert. A row of
//! one record (every row of older data dirs) is a run of one and reads the same way.
//! Rows do not overlap: after a crash redb is back at its last durable commit, whose
//! last applied id says where openraft re-applies from, so new runs start where the
//! stored ones end. Readers still skip a seq they have already seen.

use redb::{ReadableTable, StorageError, Table};

/// redb's page size (its default; the node does not change it).
const PAGE_BYTES: usize = 4096;
/// What a leaf holding one row spends besides the row's text: the leaf's 4-byte header,
/// 4-byte end offsets for the key and the value, and the key (agent, seq) itself, a 4-byte
/// length, the agent's bytes and 8 bytes of seq (redb's tuple encoding).
const ONE_ROW_LEAF_OVERHEAD: usize = 4 + 4 + 4 + 4 + 8;

/// A run of `agent`'s takes another line only while the row still fits in a leaf of
/// four pages (16 KiB).
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
/// How many bytes of rows one [`merge_tail`] call rewrites at most.
pub const MERGE_LIMIT_BYTES: usize = 16 * 1024 * 1024;
/// Small rows are left to gather until there are this many, or a run's worth of bytes,
/// so an agent that writes a little at a time does not have its last, unsettled run
/// rewritten at every merge.
const MERGE_MIN_ROWS: usize = 16;

/// What [`merge_tail`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum Merged {
    /// No small rows to merge.
    Nothing,
    /// Small rows wait for more (`MERGE_MIN_ROWS`).
    NotYet,
    /// Rows holding this many bytes were rewritten as full runs.
    Rewrote(usize),
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
                && text.len() + 1 + line.len() <= max_run_bytes(agent)
            {
                text.push('\n');
                text.push_str(line);
                *next += 1;
                return Ok(());
            }
            table.insert((run_agent.as_str(), *first), text.as_str())?;
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
            table.insert((agent.as_str(), first), text.as_str())?;
        }
        Ok(())
    }
}

/// Rewrites `agent_id`'s newest rows as full runs, back to the last settled row before
/// `since` (the first seq written since the last merge; `None`: the last settled row),
/// once there are enough of them to be worth it (or `however_few`). A row is settled when
/// the line after it would not have fitted in it. A commit leaves an agent's records as
/// full runs and a remainder (one small row, for tens of milliseconds of records): the
/// remainders behind a commit's full runs are why the walk goes back to `since`. Merged,
/// every row but the agent's last is full and the small rows' pages are reused by later
/// ones. One transaction, so a crash leaves either the old rows or the merged ones; the
/// records and their seqs are the same either way.
pub fn merge_tail(
    table: &mut Table<(&'static str, u64), &'static str>,
    agent_id: &str,
    since: Option<u64>,
    however_few: bool,
) -> Result<Merged, StorageError> {
    let run_limit = max_run_bytes(agent_id);
    let full = |row: &str, next_first_line: usize| row.len() + 1 + next_first_line > run_limit;
    let first_line = |row: &str| row.split('\n').next().map_or(0, str::len);
    // Newest first.
    let mut tail: Vec<(u64, String)> = Vec::new();
    let mut bytes = 0;
    for row in table.range((agent_id, 0)..=(agent_id, u64::MAX))?.rev() {
        let (key, text) = row?;
        let (first, text) = (key.value().1, text.value());
        let settled = tail
            .last()
            .is_some_and(|(_, next)| full(text, first_line(next)));
        if (settled && since.is_none_or(|since| first < since))
            || bytes + text.len() > MERGE_LIMIT_BYTES
        {
            break;
        }
        bytes += text.len();
        tail.push((first, text.to_string()));
    }
    // Full rows at the old end of what was read stay as they are.
    while tail.len() >= 2 && full(&tail[tail.len() - 1].1, first_line(&tail[tail.len() - 2].1)) {
        if let Some((_, text)) = tail.pop() {
            bytes -= text.len();
        }
    }
    if tail.len() < 2 {
        return Ok(Merged::Nothing);
    }
    if !however_few && tail.len() < MERGE_MIN_ROWS && bytes < run_limit {
        return Ok(Merged::NotYet);
    }
    tail.reverse();
    let mut lines: Vec<(&str, u64, &str)> = Vec::new();
    let mut next = tail[0].0;
    for (first, text) in &tail {
        for (seq, line) in row_lines(*first, text) {
            if seq >= next {
                if seq > next {
                    // A gap: a row holds fewer lines than the next row's key says (a byte
                    // changed into or out of a newline, a row lost). Rewriting would make
                    // the damage permanent and could drop records: leave it for the scrub.
                    return Ok(Merged::Inconsistent);
                }
                lines.push((agent_id, seq, line));
                next = seq + 1;
            } else if lines.get((seq - tail[0].0) as usize).map(|l| l.2) != Some(line) {
                // An older overlapping row counts once only if it says the same; one that
                // differs (a row holding more lines than its place allows) is damage.
                return Ok(Merged::Inconsistent);
            }
        }
    }
    for (first, _) in &tail {
        table.remove((agent_id, *first))?;
    }
    insert_runs(table, lines)?;
    Ok(Merged::Rewrote(bytes))
}

/// A row's records as (seq, line): the run starts at `first`.
fn row_lines(first: u64, text: &str) -> impl Iterator<Item = (u64, &str)> {
    (first..).zip(text.split('\n'))
}

/// Calls `visit(seq, line)` for `agent_id`'s records from seq `from` on, in order, each
/// once, until it returns false.
pub fn visit_lines(
    table: &impl ReadableTable<(&'static str, u64), &'static str>,
    agent_id: &str,
    from: u64,
    mut visit: impl FnMut(u64, &str) -> bool,
) -> Result<(), StorageError> {
    // The run holding `from` starts at or before it.
    let start = match table.range((agent_id, 0)..=(agent_id, from))?.next_back() {
        Some(row) => row?.0.value().1,
        None => from,
    };
    let mut next = from;
    for row in table.range((agent_id, start)..=(agent_id, u64::MAX))? {
        let (key, text) = row?;
        for (seq, line) in row_lines(key.value().1, text.value()) {
            if seq < next {
                continue;
            }
            if !visit(seq, line) {
                return Ok(());
            }
            next = seq + 1;
        }
    }
    Ok(())
}

/// The seq after `agent_id`'s last stored record (0 with none), read from its newest row.
pub fn rows_end(
    table: &impl ReadableTable<(&'static str, u64), &'static str>,
    agent_id: &str,
) -> Result<u64, StorageError> {
    match table
        .range((agent_id, 0)..=(agent_id, u64::MAX))?
        .next_back()
    {
        Some(row) => {
            let (key, text) = row?;
            let lines = text.value().split('\n').count() as u64;
            Ok(key.value().1.saturating_add(lines))
        }
        None => Ok(0),
    }
}

/// Calls `visit(agent, seq, line)` for every record in the table, in (agent, seq) order,
/// each once.
pub fn visit_all(
    table: &impl ReadableTable<(&'static str, u64), &'static str>,
    mut visit: impl FnMut(&str, u64, &str) -> Result<(), String>,
) -> Result<(), String> {
    let mut current: Option<(String, u64)> = None;
    for row in table.iter().map_err(|e| e.to_string())? {
        let (key, text) = row.map_err(|e| e.to_string())?;
        let (agent, first) = key.value();
        if current.as_ref().is_none_or(|(a, _)| a != agent) {
            current = Some((agent.to_string(), 0));
        }
        let Some((_, next)) = current.as_mut() else {
            continue;
        };
        for (seq, line) in row_lines(first, text.value()) {
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

    fn lines(db: &Database, agent: &str, from: u64, limit: usize) -> Vec<(u64, String)> {
        let txn = db.begin_read().unwrap();
        let table = txn.open_table(RECORDS).unwrap();
        let mut out = Vec::new();
        visit_lines(&table, agent, from, |seq, line| {
            out.push((seq, line.to_string()));
            out.len() < limit
        })
        .unwrap();
        out
    }

    /// `merge_tail` for agent "a" in a transaction of its own, committed.
    fn merge_committed(db: &Database, since: Option<u64>) -> Merged {
        let txn = db.begin_write().unwrap();
        let merged = {
            let mut table = txn.open_table(RECORDS).unwrap();
            merge_tail(&mut table, "a", since, false).unwrap()
        };
        txn.commit().unwrap();
        merged
    }

    #[test]
    fn runs_read_back_from_any_seq_and_overlaps_count_once() {
        let dir = tempfile::tempdir().unwrap();
        let db = Database::create(dir.path().join("t.redb")).unwrap();
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
            table.insert(("a", 4), "a4").unwrap();
            insert_runs(&mut table, [("c", 0, "c0"), ("c", 2, "c2")]).unwrap();
        }
        txn.commit().unwrap();
        let all: Vec<String> = lines(&db, "a", 0, usize::MAX)
            .into_iter()
            .map(|(seq, line)| format!("{seq}:{line}"))
            .collect();
        assert_eq!(all, ["0:a0", "1:a1", "2:a2", "3:a3", "4:a4"]);
        assert_eq!(lines(&db, "a", 1, 2), [(1, "a1".into()), (2, "a2".into())]);
        assert_eq!(lines(&db, "a", 4, 9), [(4, "a4".into())]);
        assert!(lines(&db, "a", 5, 9).is_empty());
        assert_eq!(lines(&db, "b", 0, 9), [(0, "b0".into())]);
        // A gap starts a new run: both records are there, under their own seqs.
        assert_eq!(lines(&db, "c", 0, 9), [(0, "c0".into()), (2, "c2".into())]);
        let txn = db.begin_read().unwrap();
        let table = txn.open_table(RECORDS).unwrap();
        let mut every = Vec::new();
        visit_all(&table, |agent, seq, line| {
            every.push(format!("{agent}{seq}={line}"));
            Ok(())
        })
        .unwrap();
        assert_eq!(
            every,
            ["a0=a0", "a1=a1", "a2=a2", "a3=a3", "a4=a4", "b0=b0", "c0=c0", "c2=c2"]
        );
    }

    #[test]
    fn runs_stop_growing_at_the_size_limit() {
        let dir = tempfile::tempdir().unwrap();
        let db = Database::create(dir.path().join("t.redb")).unwrap();
        let line = "x".repeat(1000);
        let txn = db.begin_write().unwrap();
        {
            let mut table = txn.open_table(RECORDS).unwrap();
            insert_runs(&mut table, (0..200).map(|seq| ("a", seq, line.as_str()))).unwrap();
        }
        txn.commit().unwrap();
        let txn = db.begin_read().unwrap();
        let table = txn.open_table(RECORDS).unwrap();
        let rows: Vec<usize> = table
            .iter()
            .unwrap()
            .map(|row| row.unwrap().1.value().len())
            .collect();
        // As many 1000-byte lines as fit in one run, and a row per that many.
        let per_run = (max_run_bytes("a") + 1) / (line.len() + 1);
        assert_eq!(per_run, 16);
        assert_eq!(rows.len(), 200usize.div_ceil(per_run), "{rows:?}");
        assert!(
            rows.iter().all(|&len| len <= max_run_bytes("a")),
            "{rows:?}"
        );
        drop(table);
        drop(txn);
        assert_eq!(lines(&db, "a", 0, usize::MAX).len(), 200);
        assert_eq!(lines(&db, "a", 150, 1), [(150, line.clone())]);
    }

    /// Rows of one record each (one commit each), plus an older row overlapping them,
    /// merge into full runs that read back the same; a second merge changes nothing, and
    /// the rows written after a merge merge with its last, unsettled run.
    #[test]
    fn small_rows_merge_into_full_runs_that_read_the_same() {
        let dir = tempfile::tempdir().unwrap();
        let db = Database::create(dir.path().join("t.redb")).unwrap();
        let line = |seq: u64| format!("{seq:03}:{}", "y".repeat(300));
        // Lines of one length: a full run holds this many.
        let per_run = (max_run_bytes("a") + 1) / (line(0).len() + 1);
        let full_run = per_run * (line(0).len() + 1) - 1;
        let write = |range: std::ops::Range<u64>| {
            let txn = db.begin_write().unwrap();
            {
                let mut table = txn.open_table(RECORDS).unwrap();
                for seq in range {
                    let text = line(seq);
                    insert_runs(&mut table, [("a", seq, text.as_str())]).unwrap();
                }
                insert_runs(&mut table, [("b", 0, "b0")]).unwrap();
            }
            txn.commit().unwrap();
        };
        let rows = |db: &Database| -> Vec<(u64, usize)> {
            let txn = db.begin_read().unwrap();
            let table = txn.open_table(RECORDS).unwrap();
            let rows = table
                .range(("a", 0)..=("a", u64::MAX))
                .unwrap()
                .map(|row| {
                    let (key, text) = row.unwrap();
                    (key.value().1, text.value().len())
                })
                .collect();
            rows
        };
        let merge = |db: &Database| merge_committed(db, None);
        write(0..500);
        let txn = db.begin_write().unwrap();
        {
            let mut table = txn.open_table(RECORDS).unwrap();
            let pair = format!("{}\n{}", line(40), line(41));
            table.insert(("a", 40), pair.as_str()).unwrap();
        }
        txn.commit().unwrap();
        let expected: Vec<(u64, String)> = (0..500).map(|seq| (seq, line(seq))).collect();
        assert_eq!(lines(&db, "a", 0, usize::MAX), expected);

        assert!(matches!(merge(&db), Merged::Rewrote(_)));
        let merged = rows(&db);
        assert_eq!(merged.len(), 500usize.div_ceil(per_run), "{merged:?}");
        let (last, settled) = merged.split_last().unwrap();
        assert!(
            settled.iter().all(|&(_, len)| len == full_run),
            "{merged:?}"
        );
        assert_eq!(last.0, (settled.len() * per_run) as u64);
        assert_eq!(lines(&db, "a", 0, usize::MAX), expected);
        assert_eq!(lines(&db, "a", 300, 1), [(300, line(300))]);
        assert_eq!(lines(&db, "b", 0, 9), [(0, "b0".into())]);
        assert_eq!(merge(&db), Merged::Nothing);
        assert_eq!(rows(&db), merged, "a second merge rewrote rows");

        // A few small rows wait for more; enough of them merge with the unsettled run.
        write(500..505);
        assert_eq!(merge(&db), Merged::NotYet);
        assert_eq!(rows(&db).len(), merged.len() + 5);
        write(505..520);
        assert!(matches!(merge(&db), Merged::Rewrote(_)));
        let after = rows(&db);
        assert_eq!(
            after[..settled.len()],
            *settled,
            "settled runs were rewritten"
        );
        assert_eq!(after.len(), 520usize.div_ceil(per_run), "{after:?}");
        let expected: Vec<(u64, String)> = (0..520).map(|seq| (seq, line(seq))).collect();
        assert_eq!(lines(&db, "a", 0, usize::MAX), expected);
    }

    /// A commit of more than a run's worth leaves full runs and a remainder: the
    /// remainders behind later commits' full runs are merged when the merge is told where
    /// the new rows start, and only then; after it every row but the last is full.
    #[test]
    fn remainders_behind_full_runs_merge_from_the_first_new_seq() {
        let dir = tempfile::tempdir().unwrap();
        let db = Database::create(dir.path().join("t.redb")).unwrap();
        let line = |seq: u64| format!("{seq:03}:{}", "w".repeat(300));
        let per_run = (max_run_bytes("a") + 1) / (line(0).len() + 1);
        let commit = |seqs: std::ops::Range<u64>| {
            let texts: Vec<(u64, String)> = seqs.map(|seq| (seq, line(seq))).collect();
            let txn = db.begin_write().unwrap();
            {
                let mut table = txn.open_table(RECORDS).unwrap();
                insert_runs(&mut table, texts.iter().map(|(s, l)| ("a", *s, l.as_str()))).unwrap();
            }
            txn.commit().unwrap();
        };
        let merge = |since: Option<u64>| merge_committed(&db, since);
        let row_lines = || -> Vec<usize> {
            let txn = db.begin_read().unwrap();
            let table = txn.open_table(RECORDS).unwrap();
            let rows = table
                .iter()
                .unwrap()
                .map(|row| row.unwrap().1.value().split('\n').count())
                .collect();
            rows
        };
        let commit_size = per_run as u64 + 7;
        for n in 0..3 {
            commit(n * commit_size..(n + 1) * commit_size);
        }
        assert_eq!(row_lines().len(), 6, "{:?}", row_lines());
        // Told nothing, the walk stops at the newest commit's full run.
        assert_eq!(merge(None), Merged::Nothing);
        assert!(matches!(merge(Some(0)), Merged::Rewrote(_)));
        let rows = row_lines();
        assert!(
            rows[..rows.len() - 1].iter().all(|&n| n == per_run),
            "{rows:?}"
        );
        assert_eq!(rows.iter().sum::<usize>() as u64, 3 * commit_size);

        for n in 3..5 {
            commit(n * commit_size..(n + 1) * commit_size);
        }
        assert!(matches!(merge(Some(3 * commit_size)), Merged::Rewrote(_)));
        let rows = row_lines();
        assert!(
            rows[..rows.len() - 1].iter().all(|&n| n == per_run),
            "{rows:?}"
        );
        let expected: Vec<(u64, String)> = (0..5 * commit_size).map(|s| (s, line(s))).collect();
        assert_eq!(lines(&db, "a", 0, usize::MAX), expected);
    }

    /// Rows that do not fit together are never rewritten: a flipped byte that became a
    /// newline (a row with one line too many, overlapping the next row with other text)
    /// or a row with a line too few (a gap before the next row) leaves every row as it was.
    #[test]
    fn damaged_rows_are_not_merged() {
        let line = |seq: u64| format!("{seq}:{}", "z".repeat(200));
        for damage in ["newline", "cut"] {
            let dir = tempfile::tempdir().unwrap();
            let db = Database::create(dir.path().join("t.redb")).unwrap();
            let txn = db.begin_write().unwrap();
            {
                let mut table = txn.open_table(RECORDS).unwrap();
                for seq in 0..40 {
                    let text = line(seq);
                    insert_runs(&mut table, [("a", seq, text.as_str())]).unwrap();
                }
                let damaged = match damage {
                    "newline" => line(5).replacen('z', "\n", 1),
                    _ => String::new(),
                };
                if damage == "newline" {
                    table.insert(("a", 5), damaged.as_str()).unwrap();
                } else {
                    table.remove(("a", 5)).unwrap();
                }
            }
            txn.commit().unwrap();
            let before: Vec<(u64, String)> = {
                let txn = db.begin_read().unwrap();
                let table = txn.open_table(RECORDS).unwrap();
                let rows = table
                    .iter()
                    .unwrap()
                    .map(|r| {
                        let (k, v) = r.unwrap();
                        (k.value().1, v.value().to_string())
                    })
                    .collect();
                rows
            };
            let txn = db.begin_write().unwrap();
            let merged = {
                let mut table = txn.open_table(RECORDS).unwrap();
                merge_tail(&mut table, "a", None, true).unwrap()
            };
            txn.commit().unwrap();
            assert_eq!(merged, Merged::Inconsistent, "{damage}");
            let txn = db.begin_read().unwrap();
            let table = txn.open_table(RECORDS).unwrap();
            let after: Vec<(u64, String)> = table
                .iter()
                .unwrap()
                .map(|r| {
                    let (k, v) = r.unwrap();
                    (k.value().1, v.value().to_string())
                })
                .collect();
            assert_eq!(after, before, "{damage}: rows were rewritten");
        }
    }
}
