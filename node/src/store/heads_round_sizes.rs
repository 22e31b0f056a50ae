//! The tree sizes at which heads rounds ended: the checkpoints the heads log ever had.
//! The last is the checkpoint a node serves and signs by default, and a cosigned note is
//! stored only for a size found here, on every replica alike (it is applied from the Raft
//! log). So each row carries the SHA-256 of its key (`checked_row::key_seal`), checked at
//! every read: a size with a bit flipped on disk is an error, never a checkpoint this node
//! alone believes it had.
//!
//! Before seals the sizes were keys with no value (`heads_rounds`); [`move_old_rows`]
//! seals them, once, at open, before anything reads them.

use redb::{ReadableTable, ReadableTableMetadata, Table, TableDefinition};

use super::{checked_row, heads_meta};

/// Tree size → `checked_row::key_seal` of its eight big-endian bytes.
pub const HEADS_ROUNDS: TableDefinition<u64, &[u8]> = TableDefinition::new("heads_rounds_sealed");
/// The same sizes with no value, as data directories from before seals hold them.
pub const OLD_HEADS_ROUNDS: TableDefinition<u64, ()> = TableDefinition::new("heads_rounds");

type StorageResult<T> = Result<T, redb::Error>;

/// Records that a round ended at `size`.
pub fn add(rounds: &mut Table<u64, &[u8]>, size: u64) -> StorageResult<()> {
    rounds.insert(size, checked_row::key_seal(&size.to_be_bytes()).as_slice())?;
    Ok(())
}

/// `size`, if the row stored under it is the one [`add`] wrote.
fn checked(size: u64, stored: &[u8]) -> StorageResult<u64> {
    checked_row::check_key_seal(&size.to_be_bytes(), stored)
        .map_err(|why| redb::Error::Corrupted(format!("heads round at size {size}: {why}")))?;
    Ok(size)
}

/// The size at which the last round ended, checked.
pub fn last(rounds: &impl ReadableTable<u64, &'static [u8]>) -> StorageResult<Option<u64>> {
    rounds
        .last()?
        .map(|(size, row)| checked(size.value(), row.value()))
        .transpose()
}

/// Whether a round ended at `size`, checked.
pub fn contains(rounds: &impl ReadableTable<u64, &'static [u8]>, size: u64) -> StorageResult<bool> {
    match rounds.get(size)? {
        Some(row) => checked(size, row.value()).map(|_| true),
        None => Ok(false),
    }
}

/// Every size at which a round ended, ascending, each checked.
pub fn all(rounds: &impl ReadableTable<u64, &'static [u8]>) -> StorageResult<Vec<u64>> {
    let mut sizes = Vec::new();
    for item in rounds.iter()? {
        let (size, row) = item?;
        sizes.push(checked(size.value(), row.value())?);
    }
    Ok(sizes)
}

/// Replaces every row with `sizes` (snapshot install).
pub fn replace(rounds: &mut Table<u64, &[u8]>, sizes: &[u64]) -> StorageResult<()> {
    rounds.retain(|_, _| false)?;
    for size in sizes {
        add(rounds, *size)?;
    }
    Ok(())
}

/// The last round for open's integrity check, which runs before [`move_old_rows`]: the
/// later of the sealed table's last (checked) and the old table's (which has no check).
pub fn last_at_open(txn: &redb::ReadTransaction) -> StorageResult<Option<u64>> {
    let sealed = match txn.open_table(HEADS_ROUNDS) {
        Ok(rounds) => last(&rounds)?,
        Err(redb::TableError::TableDoesNotExist(_)) => None,
        Err(other) => return Err(other.into()),
    };
    let old = match txn.open_table(OLD_HEADS_ROUNDS) {
        Ok(rounds) => rounds.last()?.map(|(size, _)| size.value()),
        Err(redb::TableError::TableDoesNotExist(_)) => None,
        Err(other) => return Err(other.into()),
    };
    Ok(sealed.max(old))
}

/// Moves the sizes of a data directory from before seals into [`HEADS_ROUNDS`], sealed,
/// and drops the old table: once, at open (`heads::upgrade`). One transaction: a crash
/// leaves the old rows where they were, for the next open to move. Old rows beside sealed
/// ones are rounds an older build applied on an upgraded file: they are added.
pub fn move_old_rows(db: &redb::Database) -> StorageResult<()> {
    let txn = db.begin_write()?;
    let moved = {
        let old = txn.open_table(OLD_HEADS_ROUNDS)?;
        let found = !old.is_empty()?;
        if found {
            let mut rounds = txn.open_table(HEADS_ROUNDS)?;
            for item in old.iter()? {
                add(&mut rounds, item?.0.value())?;
            }
        }
        found
    };
    if moved {
        txn.delete_table(OLD_HEADS_ROUNDS)?;
    }
    if heads_meta::commit_if(txn, moved)? {
        tracing::info!("heads log rounds sealed");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn db() -> (tempfile::TempDir, redb::Database) {
        let dir = tempfile::tempdir().unwrap();
        let db = redb::Database::create(dir.path().join("t.redb")).unwrap();
        (dir, db)
    }

    #[test]
    fn a_size_reads_back_only_with_its_own_seal() {
        let (_dir, db) = db();
        let txn = db.begin_write().unwrap();
        {
            let mut rounds = txn.open_table(HEADS_ROUNDS).unwrap();
            for size in [3, 10, 300] {
                add(&mut rounds, size).unwrap();
            }
            assert_eq!(last(&rounds).unwrap(), Some(300));
            assert!(contains(&rounds, 10).unwrap());
            assert!(!contains(&rounds, 11).unwrap());
            assert_eq!(all(&rounds).unwrap(), vec![3, 10, 300]);

            // Every bit of the key flipped in turn (the row lands under another size):
            // an error from each read that meets it, never a round.
            let row = rounds.get(10).unwrap().unwrap().value().to_vec();
            rounds.remove(10).unwrap();
            for bit in 0..64 {
                let flipped = 10u64 ^ (1 << bit);
                rounds.insert(flipped, row.as_slice()).unwrap();
                assert!(all(&rounds).is_err(), "bit {bit}");
                assert!(contains(&rounds, flipped).is_err(), "bit {bit}");
                if flipped > 300 {
                    assert!(last(&rounds).is_err(), "bit {bit}");
                }
                rounds.remove(flipped).unwrap();
            }
            // Every bit of the seal flipped in turn.
            for bit in 0..row.len() * 8 {
                let mut flipped = row.clone();
                flipped[bit / 8] ^= 1 << (bit % 8);
                rounds.insert(300, flipped.as_slice()).unwrap();
                assert!(last(&rounds).is_err(), "bit {bit}");
                assert!(contains(&rounds, 300).is_err(), "bit {bit}");
            }
        }
        txn.abort().unwrap();
    }

    #[test]
    fn old_rows_are_moved_sealed_once() {
        let (_dir, db) = db();
        let txn = db.begin_write().unwrap();
        {
            let mut old = txn.open_table(OLD_HEADS_ROUNDS).unwrap();
            old.insert(4, ()).unwrap();
            old.insert(9, ()).unwrap();
        }
        txn.commit().unwrap();
        assert_eq!(last_at_open(&db.begin_read().unwrap()).unwrap(), Some(9));
        move_old_rows(&db).unwrap();
        move_old_rows(&db).unwrap();
        let txn = db.begin_read().unwrap();
        assert_eq!(all(&txn.open_table(HEADS_ROUNDS).unwrap()).unwrap(), [4, 9]);
        assert!(
            matches!(
                txn.open_table(OLD_HEADS_ROUNDS),
                Err(redb::TableError::TableDoesNotExist(_))
            ),
            "the old table is dropped"
        );

        // Old rows beside sealed ones (an older build ran on the upgraded file) are added.
        drop(txn);
        let txn = db.begin_write().unwrap();
        txn.open_table(OLD_HEADS_ROUNDS)
            .unwrap()
            .insert(12, ())
            .unwrap();
        txn.commit().unwrap();
        assert_eq!(last_at_open(&db.begin_read().unwrap()).unwrap(), Some(12));
        move_old_rows(&db).unwrap();
        let txn = db.begin_read().unwrap();
        let rounds = txn.open_table(HEADS_ROUNDS).unwrap();
        assert_eq!(all(&rounds).unwrap(), [4, 9, 12]);
    }
}
