//! The system log in the state machine: the signed operator records
//! (`lineage_core::operators`), one sealed row per record, folded into the registry the
//! API looks tokens up in.
//!
//! An operator change is rare, so its entry is committed in its own transaction when it
//! is applied (like a heads round), after every earlier row. Each row carries its
//! checksum (`checked_row`): a changed byte is a read error that stops the node, never an
//! operator that silently lost its revocation.

use lineage_core::operators::Operators;
use lineage_core::Record;
use redb::TableDefinition;

use super::checked_row;

/// seq → the record's line, sealed.
pub const SYSTEM_LOG: TableDefinition<u64, &[u8]> = TableDefinition::new("system_log");

/// Every line of the system log, in order, each checked against its checksum.
pub fn lines(txn: &redb::ReadTransaction, from: u64, limit: usize) -> Result<Vec<String>, String> {
    let table = match txn.open_table(SYSTEM_LOG) {
        Ok(table) => table,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
        Err(e) => return Err(format!("system log: {e}")),
    };
    let mut lines = Vec::new();
    for item in table
        .range(from..)
        .map_err(|e| format!("system log: {e}"))?
        .take(limit)
    {
        let (seq, row) = item.map_err(|e| format!("system log: {e}"))?;
        let content = checked_row::unseal(row.value())
            .map_err(|e| format!("system log seq {}: {e}", seq.value()))?;
        let line = std::str::from_utf8(content)
            .map_err(|e| format!("system log seq {}: {e}", seq.value()))?;
        lines.push(line.to_string());
    }
    Ok(lines)
}

/// The registry, rebuilt from every stored record (a few per operator change).
pub fn load(txn: &redb::ReadTransaction) -> Result<Operators, String> {
    let mut operators = Operators::default();
    for line in lines(txn, 0, usize::MAX)? {
        let record = Record::from_line(&line).map_err(|e| format!("system log: {e}"))?;
        operators.apply(std::slice::from_ref(&record))?;
    }
    Ok(operators)
}

/// Appends applied records' lines.
pub fn append<'a>(
    txn: &redb::WriteTransaction,
    records: impl IntoIterator<Item = (u64, &'a str)>,
) -> Result<(), redb::Error> {
    let mut table = txn.open_table(SYSTEM_LOG)?;
    for (seq, line) in records {
        table.insert(seq, checked_row::seal(line.as_bytes()).as_slice())?;
    }
    Ok(())
}

/// Replaces the whole log with a snapshot's lines.
pub fn install(txn: &redb::WriteTransaction, lines: &[String]) -> Result<(), redb::Error> {
    let mut table = txn.open_table(SYSTEM_LOG)?;
    table.retain(|_, _| false)?;
    drop(table);
    append(txn, (0u64..).zip(lines.iter().map(String::as_str)))
}
