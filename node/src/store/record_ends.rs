//! Where each agent's stored records end: the seq after its last record, in a sealed row
//! (`checked_row`) written in the same transaction as every row that extends the agent's
//! records (the writer's commits, imports, snapshot installs), and checked at start-up.
//!
//! Why: the chain checks at start-up catch a record that changed, not one that is gone
//! from the end. Records cut from the end of an agent's newest row at a line boundary
//! leave lines that all parse and chain, and would read back as a shorter log: budget
//! they spent refunded, approvals they used usable again. Merges rewrite rows but never
//! move an end, so a merge cannot bless a cut either.
//!
//! The ends are current as of a last applied id stored beside them (`state_machine`): a
//! build from before ends were kept moves that id without them, and the ends are then
//! taken from the rows again at open rather than quarantining what it wrote.

use redb::{ReadableTable, StorageError, Table, TableDefinition};

use super::{checked_row, record_rows};

/// agent → the seq after its last stored record (8 bytes little-endian), sealed.
pub const RECORD_ENDS: TableDefinition<&str, &[u8]> = TableDefinition::new("record_ends");

/// Records that `agent`'s stored records now end before seq `end`.
pub fn put(
    ends: &mut Table<&'static str, &'static [u8]>,
    agent: &str,
    end: u64,
) -> Result<(), StorageError> {
    ends.insert(agent, checked_row::seal(&end.to_le_bytes()).as_slice())?;
    Ok(())
}

/// The stored end of `agent`'s records: `None` when there is no row, an error when the
/// row fails its checksum or is not eight bytes.
fn read(
    ends: &impl ReadableTable<&'static str, &'static [u8]>,
    agent: &str,
) -> Result<Option<Result<u64, String>>, StorageError> {
    Ok(ends.get(agent)?.map(|row| decode(row.value())))
}

/// An end from its stored row, if its checksum matches and it is eight bytes.
fn decode(row: &[u8]) -> Result<u64, String> {
    checked_row::unseal(row).and_then(|content| {
        <[u8; 8]>::try_from(content)
            .map(u64::from_le_bytes)
            .map_err(|_| format!("stored end is {} bytes, not 8", content.len()))
    })
}

/// Checks `agent`'s stored end against its rows and against `replayed_to`, the seq its
/// state was replayed to (`None`: the state was not loaded, it is quarantined already).
/// Returns why the agent's copy cannot be trusted, if it cannot.
pub fn check(
    ends: &impl ReadableTable<&'static str, &'static [u8]>,
    records: &impl record_rows::RawRows,
    packed: &impl record_rows::PackedRows,
    agent: &str,
    replayed_to: Option<u64>,
) -> Result<Option<String>, StorageError> {
    let end = match read(ends, agent)? {
        None => return Ok(Some("no stored end for its records".into())),
        Some(Err(why)) => return Ok(Some(format!("the stored end of its records: {why}"))),
        Some(Ok(end)) => end,
    };
    let rows_end = record_rows::rows_end(records, packed, agent)?;
    if rows_end != end {
        return Ok(Some(format!(
            "its stored records end before seq {rows_end}, but were committed up to before seq {end}"
        )));
    }
    match replayed_to {
        Some(replayed) if replayed != end => Ok(Some(format!(
            "its state replays to seq {replayed}, but its records were committed up to before seq {end}"
        ))),
        _ => Ok(None),
    }
}

/// Checks the records a snapshot body carries (agent → the seq after its last line sent)
/// against the stored ends: a body must not hand another node a log cut short, which it
/// would install as the whole log.
pub fn check_sent(
    ends: &impl ReadableTable<&'static str, &'static [u8]>,
    sent: &std::collections::BTreeMap<String, u64>,
) -> Result<(), String> {
    let mut matched = 0;
    for item in ends.iter().map_err(|e| e.to_string())? {
        let (agent, row) = item.map_err(|e| e.to_string())?;
        let agent = agent.value();
        let end = decode(row.value())
            .map_err(|why| format!("{agent}: the stored end of its records: {why}"))?;
        let sent_to = sent.get(agent).copied().unwrap_or(0);
        if sent_to != end {
            return Err(format!(
                "{agent}: its stored records end before seq {sent_to}, but were committed up to before seq {end}"
            ));
        }
        matched += usize::from(sent.contains_key(agent));
    }
    if matched != sent.len() {
        let unrecorded = sent
            .keys()
            .find(|agent| matches!(read(ends, agent), Ok(None)))
            .map_or("an agent", String::as_str);
        return Err(format!("{unrecorded}: no stored end for its records"));
    }
    Ok(())
}

/// Agents with a stored end but no entry in `index`: their records were committed, but
/// start-up would not load them (the entry lost), so they would start afresh.
pub fn missing_from_index(
    ends: &impl ReadableTable<&'static str, &'static [u8]>,
    index: &impl ReadableTable<&'static str, ()>,
) -> Result<Vec<String>, StorageError> {
    let mut missing = Vec::new();
    for item in ends.iter()? {
        let (agent, _) = item?;
        if index.get(agent.value())?.is_none() {
            missing.push(agent.value().to_string());
        }
    }
    Ok(missing)
}

/// Replaces every stored end with the one `index`ed agents' rows have now (when the ends
/// are not current: `state_machine`'s `ENDS_APPLIED_KEY`). Returns how many were stored.
pub fn refill(
    txn: &redb::WriteTransaction,
    records: TableDefinition<(&'static str, u64), &'static str>,
    index: TableDefinition<&'static str, ()>,
) -> Result<usize, redb::Error> {
    let mut ends = txn.open_table(RECORD_ENDS)?;
    ends.retain(|_, _| false)?;
    let records = txn.open_table(records)?;
    let packed = txn.open_table(record_rows::PACKED_RUNS)?;
    let index = txn.open_table(index)?;
    let mut stored = 0;
    for item in index.iter()? {
        let (agent, _) = item?;
        let end = match record_rows::rows_end(&records, &packed, agent.value()) {
            Ok(end) => end,
            // A packed run whose header, or a raw row whose seal, cannot be read: no end
            // is stored, so start-up quarantines the agent ("no stored end") instead of
            // failing to open.
            Err(StorageError::Corrupted(why)) => {
                tracing::error!(
                    agent = agent.value(),
                    why,
                    "cannot tell where its records end"
                );
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        put(&mut ends, agent.value(), end)?;
        stored += 1;
    }
    Ok(stored)
}

#[cfg(test)]
mod tests {
    use super::*;

    const RECORDS: TableDefinition<(&str, u64), &str> = TableDefinition::new("records");
    const INDEX: TableDefinition<&str, ()> = TableDefinition::new("index");

    fn db() -> (tempfile::TempDir, redb::Database) {
        let dir = tempfile::tempdir().unwrap();
        let db = redb::Database::create(dir.path().join("t.redb")).unwrap();
        let txn = db.begin_write().unwrap();
        txn.open_table(record_rows::PACKED_RUNS).unwrap();
        txn.commit().unwrap();
        (dir, db)
    }

    fn check_now(db: &redb::Database, agent: &str, replayed: Option<u64>) -> Option<String> {
        let txn = db.begin_read().unwrap();
        let ends = txn.open_table(RECORD_ENDS).unwrap();
        let records = txn.open_table(RECORDS).unwrap();
        let packed = txn.open_table(record_rows::PACKED_RUNS).unwrap();
        check(&ends, &records, &packed, agent, replayed).unwrap()
    }

    /// Rows and end agree: nothing to say. Each way they can disagree (a line cut from
    /// the newest row, the newest row gone, a replay that stopped early, a damaged or
    /// missing end) is named.
    #[test]
    fn an_end_that_the_rows_or_the_replay_do_not_reach_is_reported() {
        let (_dir, db) = db();
        let write = |rows: &[(u64, &str)], end: Option<u64>| {
            let txn = db.begin_write().unwrap();
            {
                let mut records = txn.open_table(RECORDS).unwrap();
                records.retain(|_, _| false).unwrap();
                for (first, text) in rows {
                    let row = crate::store::checked_row::seal_text(text);
                    records.insert(("a", *first), row.as_str()).unwrap();
                }
                let mut ends = txn.open_table(RECORD_ENDS).unwrap();
                match end {
                    Some(end) => put(&mut ends, "a", end).unwrap(),
                    None => {
                        ends.remove("a").unwrap();
                    }
                }
            }
            txn.commit().unwrap();
        };
        write(&[(0, "r0\nr1\nr2"), (3, "r3\nr4")], Some(5));
        assert_eq!(check_now(&db, "a", Some(5)), None);
        assert_eq!(check_now(&db, "a", None), None);

        let replay_short = check_now(&db, "a", Some(4)).unwrap();
        assert!(replay_short.contains("replays to seq 4"), "{replay_short}");

        write(&[(0, "r0\nr1\nr2"), (3, "r3")], Some(5));
        let cut = check_now(&db, "a", Some(4)).unwrap();
        assert!(cut.contains("end before seq 4"), "{cut}");

        write(&[(0, "r0\nr1\nr2")], Some(5));
        let row_gone = check_now(&db, "a", Some(3)).unwrap();
        assert!(row_gone.contains("end before seq 3"), "{row_gone}");

        write(&[(0, "r0\nr1\nr2"), (3, "r3\nr4")], None);
        assert!(check_now(&db, "a", Some(5))
            .unwrap()
            .contains("no stored end"));

        // The end's row flipped (in its checksum, in its content), zeroed, or cut short.
        let sealed = checked_row::seal(&5u64.to_le_bytes());
        let flipped = |at: usize| {
            let mut row = sealed.clone();
            row[at] ^= 0x01;
            row
        };
        for row in [
            flipped(0),
            flipped(35),
            vec![0; sealed.len()],
            sealed[..39].to_vec(),
            sealed[..20].to_vec(),
        ] {
            let txn = db.begin_write().unwrap();
            txn.open_table(RECORD_ENDS)
                .unwrap()
                .insert("a", row.as_slice())
                .unwrap();
            txn.commit().unwrap();
            let damaged = check_now(&db, "a", Some(5)).unwrap();
            assert!(
                damaged.starts_with("the stored end of its records: "),
                "{damaged}"
            );
        }

        // A newline flipped away in a row is a line lost, never a shorter log that fits.
        write(&[(0, "r0\nr1\nr2"), (3, "r3\x0br4")], Some(5));
        let joined = check_now(&db, "a", Some(4)).unwrap();
        assert!(joined.contains("end before seq 4"), "{joined}");

        // The newest run packed: its end is read from its header, and a header that says
        // one line too few, or cannot be read, is reported, never taken for the end.
        let pack = |lines: u32| crate::store::packed_run::pack("r3\nr4", lines).unwrap();
        write(&[(0, "r0\nr1\nr2")], Some(5));
        let put_packed = |row: &[u8]| {
            let txn = db.begin_write().unwrap();
            txn.open_table(record_rows::PACKED_RUNS)
                .unwrap()
                .insert(("a", 3), row)
                .unwrap();
            txn.commit().unwrap();
        };
        put_packed(&pack(2));
        assert_eq!(check_now(&db, "a", Some(5)), None);
        put_packed(&pack(1));
        let short = check_now(&db, "a", Some(5)).unwrap();
        assert!(short.contains("end before seq 4"), "{short}");
        let mut unknown = pack(2);
        unknown[0] ^= 0x40;
        put_packed(&unknown);
        let txn = db.begin_read().unwrap();
        let damaged = check(
            &txn.open_table(RECORD_ENDS).unwrap(),
            &txn.open_table(RECORDS).unwrap(),
            &txn.open_table(record_rows::PACKED_RUNS).unwrap(),
            "a",
            Some(5),
        );
        assert!(
            matches!(&damaged, Err(StorageError::Corrupted(why)) if why.contains("format")),
            "{damaged:?}"
        );
    }

    /// A refill takes each indexed agent's end from its rows and drops any other; an end
    /// without an index entry is found.
    #[test]
    fn a_refill_takes_the_ends_from_the_rows_and_orphans_are_found() {
        let (_dir, db) = db();
        let txn = db.begin_write().unwrap();
        {
            let mut records = txn.open_table(RECORDS).unwrap();
            let sealed = crate::store::checked_row::seal_text;
            records.insert(("a", 0), sealed("r0\nr1").as_str()).unwrap();
            records.insert(("a", 2), sealed("r2").as_str()).unwrap();
            records.insert(("b", 0), sealed("r0").as_str()).unwrap();
            let mut index = txn.open_table(INDEX).unwrap();
            index.insert("a", ()).unwrap();
            index.insert("b", ()).unwrap();
            let mut ends = txn.open_table(RECORD_ENDS).unwrap();
            put(&mut ends, "a", 9).unwrap();
            put(&mut ends, "gone", 4).unwrap();
            // "c": its newest run packed, with a header that cannot be read.
            index.insert("c", ()).unwrap();
            let mut packed = txn.open_table(record_rows::PACKED_RUNS).unwrap();
            let mut row = crate::store::packed_run::pack("r0\nr1", 2).unwrap();
            row[0] ^= 0x40;
            packed.insert(("c", 0), row.as_slice()).unwrap();
        }
        // "c" gets no end (start-up then quarantines it), rather than a failed open.
        assert_eq!(refill(&txn, RECORDS, INDEX).unwrap(), 2);
        txn.commit().unwrap();
        assert_eq!(check_now(&db, "a", Some(3)), None);
        assert_eq!(check_now(&db, "b", Some(1)), None);
        assert!(check_now(&db, "gone", None)
            .unwrap()
            .contains("no stored end"));
        assert!(check_now(&db, "c", None).unwrap().contains("no stored end"));

        let txn = db.begin_write().unwrap();
        txn.open_table(INDEX).unwrap().remove("a").unwrap();
        txn.commit().unwrap();
        let txn = db.begin_read().unwrap();
        let missing = missing_from_index(
            &txn.open_table(RECORD_ENDS).unwrap(),
            &txn.open_table(INDEX).unwrap(),
        )
        .unwrap();
        assert_eq!(missing, vec!["a".to_string()]);
    }
}
