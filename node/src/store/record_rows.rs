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

/// A run stops growing at about this many bytes, so no row gets huge (a snapshot install
/// writes whole agents at once).
const MAX_RUN_BYTES: usize = 64 * 1024;

/// Inserts `records`, sorted by (agent, seq), as runs of consecutive seqs.
pub fn insert_runs<'a>(
    table: &mut Table<(&'static str, u64), &'static str>,
    records: impl IntoIterator<Item = (&'a str, u64, &'a str)>,
) -> Result<(), StorageError> {
    let mut run: Option<(&str, u64, u64, String)> = None;
    for (agent, seq, line) in records {
        if let Some((run_agent, first, next, text)) = &mut run {
            if *run_agent == agent && *next == seq && text.len() < MAX_RUN_BYTES {
                text.push('\n');
                text.push_str(line);
                *next += 1;
                continue;
            }
            table.insert((*run_agent, *first), text.as_str())?;
        }
        run = Some((agent, seq, seq + 1, line.to_string()));
    }
    if let Some((agent, first, _, text)) = run {
        table.insert((agent, first), text.as_str())?;
    }
    Ok(())
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
        let rows = table.iter().unwrap().count();
        assert!((3..=4).contains(&rows), "{rows} rows");
        drop(table);
        drop(txn);
        assert_eq!(lines(&db, "a", 0, usize::MAX).len(), 200);
        assert_eq!(lines(&db, "a", 150, 1), [(150, line.clone())]);
    }
}
