//! Opening a redb file safely: its header checked and a lost growth put back
//! ([`restore`](crate::restore)), then redb's open and, when asked, its check of every
//! page, with a panic inside redb taken for damage to the file rather than the end of the
//! process. redb 2.6 asserts on a header field no check can judge (a region tracker page
//! moved within the file by a flipped bit), so without this such a file stopped its
//! process at every start. A process whose panic hook exits (the node's) asks
//! [`is_catching`] and lets a panic inside [`open_checked`] unwind to here. A panic redb
//! turns into an abort (one while it unwinds with a poisoned lock) is not caught.

use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

use crate::{panic_message, restore, Restored};

thread_local! {
    static CATCHING: Cell<bool> = const { Cell::new(false) };
}

/// Whether the current thread is inside [`open_checked`]'s call into redb (for a panic
/// hook; false for a thread whose thread-locals are already gone, so the hook never
/// panics itself).
pub fn is_catching() -> bool {
    CATCHING.try_with(Cell::get).unwrap_or(false)
}

/// Runs `work`; a panic in it is returned as its message.
fn catching<T>(work: impl FnOnce() -> T) -> Result<T, String> {
    let was = CATCHING.with(|c| c.replace(true));
    let outcome = catch_unwind(AssertUnwindSafe(work));
    CATCHING.with(|c| c.set(was));
    outcome.map_err(|panic| panic_message(panic.as_ref()))
}

/// Why a redb file could not be opened.
#[derive(Debug, PartialEq, Eq)]
pub enum OpenFailure {
    /// Its content is damaged (its header, a panic in redb, pages redb calls corrupted):
    /// rebuild it from elsewhere, or restore it.
    Damaged(String),
    /// Anything else (permissions, I/O, a lock held by another process).
    Failed(String),
}

/// A redb file opened by [`open_checked`], and what opening it had to mend.
pub struct Opened {
    pub db: redb::Database,
    /// redb's check of its pages found a commit cut off by a crash and went back to the
    /// one before (never past a commit that returned: each is durable when it returns).
    pub repaired: bool,
}

/// Opens (or creates) the redb file at `path` with `builder`: header first, then redb's
/// open and, with `check_pages`, its check of every page (which reads the whole file).
/// `extended(from, to)` is told, before redb opens it, that the file was shorter than
/// its header states (a growth a power cut lost) and was extended for redb's recovery,
/// so the caller can say so whatever the open then finds. The header checks assume
/// redb's default page and region sizes, as every caller's builder has.
pub fn open_checked(
    path: &Path,
    builder: &redb::Builder,
    check_pages: bool,
    extended: impl FnOnce(u64, u64),
) -> Result<Opened, OpenFailure> {
    match restore(path) {
        Ok(Restored::AsIs) => {}
        Ok(Restored::Extended { from, to }) => extended(from, to),
        Ok(Restored::Damaged(why)) => return Err(OpenFailure::Damaged(why)),
        Err(e) => return Err(OpenFailure::Failed(format!("reading its header: {e}"))),
    }
    let opened = catching(|| {
        let mut db = builder.create(path).map_err(open_failure)?;
        let intact = if check_pages {
            db.check_integrity().map_err(|e| match open_failure(e) {
                OpenFailure::Failed(why) => {
                    OpenFailure::Failed(format!("redb's check of its pages failed: {why}"))
                }
                damaged => damaged,
            })?
        } else {
            true
        };
        Ok((db, !intact))
    });
    let (db, repaired) = opened.unwrap_or_else(|panic| {
        Err(OpenFailure::Damaged(format!(
            "redb panicked opening it: {panic}"
        )))
    })?;
    Ok(Opened { db, repaired })
}

fn open_failure(error: redb::DatabaseError) -> OpenFailure {
    match error {
        redb::DatabaseError::Storage(redb::StorageError::Corrupted(why)) => {
            OpenFailure::Damaged(why)
        }
        other => OpenFailure::Failed(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_inside_is_its_message_and_the_flag_is_only_set_inside() {
        assert!(!is_catching());
        assert_eq!(catching(is_catching), Ok(true));
        let caught = catching(|| -> u8 { panic!("assertion failed: tracker") });
        assert_eq!(caught, Err("assertion failed: tracker".to_string()));
        assert!(!is_catching());
    }

    #[test]
    fn a_file_that_is_not_redb_is_damaged_and_a_new_one_opens() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("store.redb");
        let not_extended = |from, to| panic!("extended from {from} to {to}");
        let opened = open_checked(&path, &redb::Builder::new(), true, not_extended).unwrap();
        assert!(!opened.repaired);
        drop(opened);
        let other = dir.path().join("other.redb");
        std::fs::write(&other, vec![7u8; 8192]).unwrap();
        let refused = open_checked(&other, &redb::Builder::new(), true, not_extended).err();
        assert!(
            matches!(&refused, Some(OpenFailure::Damaged(why)) if why.contains("magic")),
            "{refused:?}"
        );
    }
}
