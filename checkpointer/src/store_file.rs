//! Opening the witness's and the checkpointer's redb store, which nothing can rebuild:
//! damage refuses the start, saying why, rather than serving from a file read wrongly
//! (or panicking on it).

use std::path::Path;

use redb::Database;

/// Opens (or creates) the store at `path`: its header checked and a growth a power cut
/// lost put back (`lineage_redb_header`), then every page checked by redb. redb checks its
/// pages at open only when it finds the file left open, and a file left open whose
/// recovery flag the disk cleared opens and reads, and panics or aborts at its first
/// write; these stores are small, so the check runs at every start (redb repairs what its
/// checksums allow).
pub fn open(path: &Path) -> Result<Database, String> {
    use lineage_redb_header::OpenFailure::{Damaged, Failed};
    let extended = |from, to| {
        tracing::warn!(file = %path.display(), from, to, "store extended to the length its header states, for redb's recovery");
    };
    let opened = lineage_redb_header::open_checked(path, &redb::Builder::new(), true, extended);
    let opened = opened.map_err(|failure| match failure {
        Damaged(why) => format!(
            "{} cannot be opened safely: {why}; restore it from a backup",
            path.display()
        ),
        Failed(why) => format!("{}: {why}", path.display()),
    })?;
    if opened.repaired {
        // After a crash in the middle of a commit: redb went back to the previous one,
        // never past a commit that returned (each is durable when it returns here).
        tracing::warn!(file = %path.display(), "store repaired by redb's check of its pages: a commit cut off by a crash may be gone");
    }
    Ok(opened.db)
}

#[cfg(test)]
mod tests {
    use super::*;
    use redb::{ReadableTableMetadata, TableDefinition};

    const ROWS: TableDefinition<u64, &[u8]> = TableDefinition::new("rows");

    fn add(db: &Database, from: u64, rows: u64) {
        let txn = db.begin_write().unwrap();
        {
            let mut table = txn.open_table(ROWS).unwrap();
            for n in from..from + rows {
                table.insert(n, vec![n as u8; 300].as_slice()).unwrap();
            }
        }
        txn.commit().unwrap();
    }

    /// A store left open (its process killed) whose recovery flag the disk then cleared:
    /// redb would trust an allocator state it never wrote and, at the first write, panic
    /// or abort. Opened here, it is repaired first, keeps every row and takes writes.
    #[test]
    fn a_store_left_open_with_its_recovery_flag_cleared_is_repaired_and_takes_writes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("store.redb");
        let db = open(&path).unwrap();
        for commit in 0..3 {
            add(&db, commit * 20, 20);
        }
        let mut image = std::fs::read(&path).unwrap();
        drop(db);
        assert_eq!(
            image[9] & 2,
            2,
            "the file open for writing says recovery is required"
        );
        image[9] &= !2;
        std::fs::write(&path, &image).unwrap();

        let db = open(&path).unwrap();
        add(&db, 60, 20);
        let txn = db.begin_read().unwrap();
        assert_eq!(txn.open_table(ROWS).unwrap().len().unwrap(), 80);
    }

    /// A store of 20 rows, closed, with bit 0 of byte `at` flipped: why opening it failed.
    fn refusal_with_bit_flipped_at(at: usize) -> String {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("store.redb");
        let db = open(&path).unwrap();
        add(&db, 0, 20);
        drop(db);
        let mut image = std::fs::read(&path).unwrap();
        image[at] ^= 1;
        std::fs::write(&path, &image).unwrap();
        open(&path).map(drop).unwrap_err()
    }

    /// Damage the header check finds refuses the start, naming the file.
    #[test]
    fn a_damaged_header_refuses_the_start() {
        let refused = refusal_with_bit_flipped_at(4);
        assert!(
            refused.contains("store.redb") && refused.contains("magic number"),
            "{refused}"
        );
    }

    /// A tracker page number moved within the file by one flipped bit, which no header
    /// check can tell: redb panics opening it, and the start is refused naming the file.
    #[test]
    fn a_panic_opening_the_store_refuses_the_start() {
        let refused = refusal_with_bit_flipped_at(32);
        assert!(
            refused.contains("store.redb") && refused.contains("panicked"),
            "{refused}"
        );
    }
}
