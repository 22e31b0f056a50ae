//! The heads log's settings: its origin, the latest witnessed note, how many leaves are
//! indexed, and whether its rows are sealed. Each row is sealed over its key and value
//! (`checked_row`), because each steers what the node signs or trusts: a flipped byte in
//! the origin would have it sign checkpoints under another name, one in `indexed` would
//! have it index again a tree whose last leaves were lost, and believe it whole.
//!
//! Before seals these rows were plain text in `heads_meta`; [`move_old_rows`] seals them,
//! once, at open, before anything reads them.

use redb::{ReadableTable, ReadableTableMetadata, Table, TableDefinition};

use super::checked_row;

/// Key → `checked_row::seal(key ‖ 0 ‖ value)`.
pub const HEADS_META: TableDefinition<&str, &[u8]> = TableDefinition::new("heads_meta_sealed");
/// The same settings as plain text, as data directories from before seals hold them.
pub const OLD_HEADS_META: TableDefinition<&str, &str> = TableDefinition::new("heads_meta");

/// The origin every checkpoint is signed under (fixed by the first round).
pub const ORIGIN: &str = "origin";
/// The latest cosigned checkpoint note.
pub const WITNESSED: &str = "witnessed";
/// How many leaves `heads_nodes` and `heads_by_agent` cover.
pub const INDEXED: &str = "indexed";
/// Present once the leaf and node rows are sealed (`heads_tree::seal_if_needed`).
pub const SEALED: &str = "sealed";
/// Where two builds of this session kept `heads_tree::HEADS_STATED`'s row; moved out at
/// open (`heads_tree::move_stated_out_of_settings`).
pub const OLD_STATED: &str = "stated";
const KEYS: [&str; 5] = [ORIGIN, WITNESSED, INDEXED, SEALED, OLD_STATED];

type StorageResult<T> = Result<T, redb::Error>;

/// What a row seals: the key too, so a value read under another key is caught.
fn sealed_content(key: &str, value: &str) -> Vec<u8> {
    let mut content = Vec::with_capacity(key.len() + 1 + value.len());
    content.extend_from_slice(key.as_bytes());
    content.push(0);
    content.extend_from_slice(value.as_bytes());
    content
}

/// Commits `txn` if it `changed` anything, else aborts it, so that a step of the one-time
/// upgrades at open leaves no trace where it had nothing to do (not even a table it
/// opened, which a write transaction creates). Whether it committed.
pub fn commit_if(txn: redb::WriteTransaction, changed: bool) -> StorageResult<bool> {
    if changed {
        txn.commit()?;
    } else {
        txn.abort()?;
    }
    Ok(changed)
}

/// Stores `value` under `key`, sealed (also in other tables of this form:
/// `heads_tree::HEADS_STATED`).
pub fn put(meta: &mut Table<&str, &[u8]>, key: &str, value: &str) -> StorageResult<()> {
    meta.insert(
        key,
        checked_row::seal(&sealed_content(key, value)).as_slice(),
    )?;
    Ok(())
}

/// The value under `key`, checked: `None` where there is no row, an error where the row
/// is not what [`put`] wrote for that key.
pub fn get(
    meta: &impl ReadableTable<&'static str, &'static [u8]>,
    key: &str,
) -> StorageResult<Option<String>> {
    meta.get(key)?
        .map(|row| decode(key, row.value()))
        .transpose()
}

fn decode(key: &str, row: &[u8]) -> StorageResult<String> {
    let corrupted = |why: String| redb::Error::Corrupted(format!("heads meta {key:?}: {why}"));
    let content = checked_row::unseal(row).map_err(corrupted)?;
    let value = content
        .strip_prefix(key.as_bytes())
        .and_then(|rest| rest.strip_prefix(&[0]))
        .ok_or_else(|| corrupted("the row was sealed under another key".into()))?;
    String::from_utf8(value.to_vec()).map_err(|_| corrupted("the value is not UTF-8".into()))
}

/// How many leaves are indexed: `None` where no row says (a data directory from before
/// the index); a value that is not a number is damage.
pub fn indexed(
    meta: &impl ReadableTable<&'static str, &'static [u8]>,
) -> StorageResult<Option<u64>> {
    get(meta, INDEXED)?
        .map(|v| {
            v.parse::<u64>().map_err(|_| {
                redb::Error::Corrupted(format!("heads meta \"indexed\" is {v:?}, not a size"))
            })
        })
        .transpose()
}

/// Checks every row (open's integrity check): a known key, its seal, sealed under it.
pub fn check_all(meta: &impl ReadableTable<&'static str, &'static [u8]>) -> StorageResult<()> {
    for item in meta.iter()? {
        let (key, row) = item?;
        let key = key.value();
        if !KEYS.contains(&key) {
            return Err(redb::Error::Corrupted(format!(
                "heads meta holds an unknown key {key:?}"
            )));
        }
        decode(key, row.value())?;
    }
    Ok(())
}

/// What open's integrity check needs of the settings ([`read_at_open`]).
pub struct AtOpen {
    /// How many leaves were indexed, if the settings say.
    pub indexed: Option<u64>,
    /// Whether the leaf and node rows are sealed.
    pub rows_sealed: bool,
}

/// The settings as open's integrity check reads them, before the upgrade runs: from the
/// plain table while a file from before seals still holds rows there (they are trusted as
/// older rows are, until [`move_old_rows`] seals them), else from the sealed one, every
/// row checked ([`check_all`]).
pub fn read_at_open(txn: &redb::ReadTransaction) -> StorageResult<AtOpen> {
    match txn.open_table(OLD_HEADS_META) {
        Ok(old) if !old.is_empty()? => {
            return Ok(AtOpen {
                indexed: old.get(INDEXED)?.and_then(|v| v.value().parse().ok()),
                rows_sealed: old.get(SEALED)?.is_some(),
            })
        }
        Ok(_) | Err(redb::TableError::TableDoesNotExist(_)) => {}
        Err(other) => return Err(other.into()),
    }
    let meta = match txn.open_table(HEADS_META) {
        Ok(meta) => meta,
        Err(redb::TableError::TableDoesNotExist(_)) => {
            return Ok(AtOpen {
                indexed: None,
                rows_sealed: false,
            })
        }
        Err(other) => return Err(other.into()),
    };
    check_all(&meta)?;
    Ok(AtOpen {
        indexed: indexed(&meta)?,
        rows_sealed: get(&meta, SEALED)?.is_some(),
    })
}

/// Moves the plain rows of a data directory from before seals into [`HEADS_META`],
/// sealed, and drops the plain table: once, at open (`heads::upgrade`). One transaction:
/// a crash leaves the plain rows where they were, for the next open to move.
///
/// Plain rows beside sealed ones are what an older build run on an upgraded file wrote
/// (it saw no settings): they are the newer, and each replaces the sealed row under its
/// key. A plain key no version writes is damage; a plain `indexed` that is not a number
/// is dropped, which makes open index the leaves again (as older builds read it).
pub fn move_old_rows(db: &redb::Database) -> StorageResult<()> {
    let txn = db.begin_write()?;
    let moved = {
        let old = txn.open_table(OLD_HEADS_META)?;
        let mut rows = Vec::new();
        for item in old.iter()? {
            let (key, value) = item?;
            let (key, value) = (key.value(), value.value());
            if !KEYS.contains(&key) {
                return Err(redb::Error::Corrupted(format!(
                    "plain heads meta holds an unknown key {key:?}"
                )));
            }
            if key == INDEXED && value.parse::<u64>().is_err() {
                continue;
            }
            rows.push((key.to_string(), value.to_string()));
        }
        let found = !old.is_empty()?;
        drop(old);
        if found {
            let mut meta = txn.open_table(HEADS_META)?;
            if !meta.is_empty()? {
                tracing::warn!(
                    "heads log settings found both sealed and plain (an older build ran on \
                     this file): the plain ones replace the sealed ones under their keys"
                );
            }
            for (key, value) in &rows {
                put(&mut meta, key, value)?;
            }
            drop(meta);
            txn.delete_table(OLD_HEADS_META)?;
        }
        found
    };
    if commit_if(txn, moved)? {
        tracing::info!("heads log settings sealed");
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
    fn values_read_back_only_under_their_own_key_and_seal() {
        let (_dir, db) = db();
        let txn = db.begin_write().unwrap();
        {
            let mut meta = txn.open_table(HEADS_META).unwrap();
            put(&mut meta, ORIGIN, "example.org/log").unwrap();
            put(&mut meta, INDEXED, "300").unwrap();
            assert_eq!(
                get(&meta, ORIGIN).unwrap().as_deref(),
                Some("example.org/log")
            );
            assert_eq!(indexed(&meta).unwrap(), Some(300));
            assert_eq!(get(&meta, WITNESSED).unwrap(), None);
            check_all(&meta).unwrap();

            // Every bit of the origin's row flipped in turn: an error, never a value.
            let row = meta.get(ORIGIN).unwrap().unwrap().value().to_vec();
            for bit in 0..row.len() * 8 {
                let mut flipped = row.clone();
                flipped[bit / 8] ^= 1 << (bit % 8);
                meta.insert(ORIGIN, flipped.as_slice()).unwrap();
                assert!(get(&meta, ORIGIN).is_err(), "bit {bit} went unseen");
                assert!(check_all(&meta).is_err(), "bit {bit} went unseen");
            }
            // A whole row under another key (a flipped key byte lands it elsewhere).
            let indexed_row = meta.get(INDEXED).unwrap().unwrap().value().to_vec();
            meta.insert(ORIGIN, indexed_row.as_slice()).unwrap();
            let error = get(&meta, ORIGIN).unwrap_err().to_string();
            assert!(error.contains("another key"), "{error}");
            meta.remove(ORIGIN).unwrap();
            meta.insert("indexef", indexed_row.as_slice()).unwrap();
            let error = check_all(&meta).unwrap_err().to_string();
            assert!(error.contains("unknown key"), "{error}");
            meta.remove("indexef").unwrap();
            // A sealed value that is not a size is damage, not "not indexed".
            put(&mut meta, INDEXED, "3O0").unwrap();
            assert!(indexed(&meta).is_err());
        }
        txn.abort().unwrap();
    }

    #[test]
    fn plain_rows_are_moved_sealed_once() {
        let (_dir, db) = db();
        let txn = db.begin_write().unwrap();
        {
            let mut old = txn.open_table(OLD_HEADS_META).unwrap();
            old.insert(ORIGIN, "example.org/log").unwrap();
            old.insert(INDEXED, "7").unwrap();
            old.insert(SEALED, "1").unwrap();
        }
        txn.commit().unwrap();
        move_old_rows(&db).unwrap();
        move_old_rows(&db).unwrap();
        let txn = db.begin_read().unwrap();
        let meta = txn.open_table(HEADS_META).unwrap();
        assert_eq!(
            get(&meta, ORIGIN).unwrap().as_deref(),
            Some("example.org/log")
        );
        assert_eq!(indexed(&meta).unwrap(), Some(7));
        assert_eq!(get(&meta, SEALED).unwrap().as_deref(), Some("1"));
        assert!(
            matches!(
                txn.open_table(OLD_HEADS_META),
                Err(redb::TableError::TableDoesNotExist(_))
            ),
            "the plain table is dropped"
        );

        // Plain rows beside sealed ones (an older build ran on the upgraded file): each
        // replaces the sealed row under its key; the others stay.
        drop((meta, txn));
        let txn = db.begin_write().unwrap();
        {
            let mut old = txn.open_table(OLD_HEADS_META).unwrap();
            old.insert(INDEXED, "9").unwrap();
            old.insert(SEALED, "1").unwrap();
        }
        txn.commit().unwrap();
        move_old_rows(&db).unwrap();
        let txn = db.begin_read().unwrap();
        let meta = txn.open_table(HEADS_META).unwrap();
        assert_eq!(indexed(&meta).unwrap(), Some(9));
        assert_eq!(
            get(&meta, ORIGIN).unwrap().as_deref(),
            Some("example.org/log")
        );
        check_all(&meta).unwrap();

        // A plain key no version writes is damage; nothing is moved.
        drop((meta, txn));
        let txn = db.begin_write().unwrap();
        txn.open_table(OLD_HEADS_META)
            .unwrap()
            .insert("origio", "x")
            .unwrap();
        txn.commit().unwrap();
        assert!(move_old_rows(&db).is_err());
        let txn = db.begin_read().unwrap();
        assert!(!txn.open_table(OLD_HEADS_META).unwrap().is_empty().unwrap());

        // A plain `indexed` that is not a number is dropped: open indexes again.
        drop(txn);
        let txn = db.begin_write().unwrap();
        {
            let mut old = txn.open_table(OLD_HEADS_META).unwrap();
            old.remove("origio").unwrap();
            old.insert(INDEXED, "3O0").unwrap();
        }
        txn.commit().unwrap();
        move_old_rows(&db).unwrap();
        let txn = db.begin_read().unwrap();
        let meta = txn.open_table(HEADS_META).unwrap();
        assert_eq!(
            get(&meta, INDEXED).unwrap().as_deref(),
            Some("9"),
            "kept, not replaced"
        );
    }
}
