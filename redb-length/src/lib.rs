//! A redb file put back to the length its header states, before redb opens it, after a
//! power cut in the middle of a commit that grew the file. Used for the node's state
//! machine file and the witness's and checkpointer's stores.
//!
//! Why: redb grows its file (`set_len`) during a write transaction and writes the header,
//! which states the file's layout, at the next durable commit, whose fsync makes both
//! durable. A power cut during that fsync can leave the header page on disk (data pages
//! are written first) without the size change (metadata, committed to the journal last).
//! redb 2.6 then asserts at open that the file is at least as long as its header states,
//! and the process could never start again (seen in the node's `power_loss.rs`: a node
//! exited 70 at every start). redb fixed this upstream (cberner/redb#1276, in a later major version) by
//! trusting the file's length when recovery is required.
//!
//! Here, when the header says recovery is required (it is set on disk from open to a clean
//! close) and the file is shorter than the header states, the file is extended with zeros
//! to that length, and redb's own recovery runs: it recalculates the layout from the file
//! length and verifies the commit slots' checksummed trees, falling back to the previous
//! commit when the newest one's pages are gone. No durable commit's pages lie past the
//! length the file kept: its fsync made the growth durable together with the data.
//!
//! A file shorter than its header states after a clean close, or one whose header states
//! an implausible length (the layout fields carry no checksum), is damage, for the caller
//! to handle: the node moves its state machine file aside and rebuilds it from the Raft
//! log; the witness and the checkpointer refuse to start, saying why.
//!
//! Interrupted at each step: the extension is one `set_len` and an fsync; a crash before
//! the fsync meets the same short file at the next start, and one after it a file redb
//! recovers as above.
//!
//! The header fields read here are redb's file format (versions 2 and 3, which redb 2.6
//! reads and writes). The tests run the workspace's redb: a redb whose header differs
//! fails them.

use std::fs::OpenOptions;
use std::io::{self, Read};
use std::path::Path;

/// redb's magic number, at the start of its header.
const MAGIC: [u8; 9] = [b'r', b'e', b'd', b'b', 0x1A, 0x0A, 0xA9, 0x0D, 0x0A];
/// The header byte after the magic number holds flags; this one is set on disk while the
/// file is open for writing, and cleared at a clean close.
const GOD_BYTE: usize = 9;
const RECOVERY_REQUIRED: u8 = 2;
/// Little-endian u32 fields after the flags (and two bytes of padding).
const PAGE_SIZE: usize = 12;
const REGION_HEADER_PAGES: usize = 16;
const REGION_MAX_DATA_PAGES: usize = 20;
const FULL_REGIONS: usize = 24;
const TRAILING_REGION_DATA_PAGES: usize = 28;
const HEADER_BYTES: usize = 32;
/// A stated length this much past the file's, and twice it, is not a growth redb makes in
/// one commit (it grows by at most a region, 4 GiB at its defaults, or doubles a small
/// file): torn or damaged fields.
const MOST_GROWTH: u64 = 4 << 30;

/// What [`restore`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum Restored {
    /// Nothing to do: no file, not a redb file (redb says what is wrong), or one at least
    /// as long as its header states.
    AsIs,
    /// The file was shorter than its header states after an unclean stop, and was
    /// extended with zeros to that length.
    Extended { from: u64, to: u64 },
    /// The file cannot be trusted: why.
    Damaged(String),
}

/// Checks the redb file at `path` against the length its header states, and extends it
/// where a power cut lost its growth (module docs). Errors are I/O errors.
pub fn restore(path: &Path) -> io::Result<Restored> {
    let mut file = match OpenOptions::new().read(true).write(true).open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Restored::AsIs),
        Err(e) => return Err(e),
    };
    let length = file.metadata()?.len();
    let mut header = [0u8; HEADER_BYTES];
    if length < HEADER_BYTES as u64 {
        return Ok(Restored::AsIs);
    }
    file.read_exact(&mut header)?;
    let restored = judge(&header, length);
    if let Restored::Extended { to, .. } = restored {
        file.set_len(to)?;
        file.sync_all()?;
    }
    Ok(restored)
}

/// [`restore`] for a file that cannot be rebuilt from elsewhere: damage, and an I/O error
/// reading the header, are an error naming the file.
pub fn restore_or_refuse(path: &Path) -> Result<Restored, String> {
    match restore(path) {
        Ok(Restored::Damaged(why)) => {
            Err(format!("{} cannot be opened safely: {why}", path.display()))
        }
        Ok(restored) => Ok(restored),
        Err(e) => Err(format!("reading the header of {}: {e}", path.display())),
    }
}

/// What to do with a file of `length` bytes that starts with `header`.
fn judge(header: &[u8; HEADER_BYTES], length: u64) -> Restored {
    if header[..MAGIC.len()] != MAGIC {
        return Restored::AsIs;
    }
    let Some(stated) = stated_length(header) else {
        return Restored::Damaged("its header states no possible layout".into());
    };
    if stated <= length {
        return Restored::AsIs;
    }
    if header[GOD_BYTE] & RECOVERY_REQUIRED == 0 {
        return Restored::Damaged(format!(
            "it is {length} bytes, shorter than the {stated} its header states, after a clean close"
        ));
    }
    if stated > length.saturating_mul(2).saturating_add(MOST_GROWTH) {
        return Restored::Damaged(format!(
            "its header states {stated} bytes, too far past its {length} to be one commit's growth"
        ));
    }
    Restored::Extended {
        from: length,
        to: stated,
    }
}

/// The file length the header's layout fields describe: a header page, the full regions
/// and a trailing partial region, each region its header pages and data pages. `None`
/// when the fields cannot describe a file (a page size that is not a power of two from
/// 512 bytes to 1 MiB, or a length past `u64`).
fn stated_length(header: &[u8; HEADER_BYTES]) -> Option<u64> {
    let field = |at: usize| {
        u64::from(u32::from_le_bytes([
            header[at],
            header[at + 1],
            header[at + 2],
            header[at + 3],
        ]))
    };
    let page = field(PAGE_SIZE);
    if !page.is_power_of_two() || !(512..=1 << 20).contains(&page) {
        return None;
    }
    let region_header = field(REGION_HEADER_PAGES);
    let full_region = region_header.checked_add(field(REGION_MAX_DATA_PAGES))?;
    let trailing = match field(TRAILING_REGION_DATA_PAGES) {
        0 => 0,
        pages => region_header.checked_add(pages)?,
    };
    let pages = field(FULL_REGIONS)
        .checked_mul(full_region)?
        .checked_add(trailing)?
        .checked_add(1)?;
    pages.checked_mul(page)
}

#[cfg(test)]
mod tests {
    use super::*;
    use redb::{Database, TableDefinition};

    const ROWS: TableDefinition<u64, &[u8]> = TableDefinition::new("rows");

    fn fill(db: &Database, from: u64, rows: u64, bytes: usize) {
        let txn = db.begin_write().unwrap();
        {
            let mut table = txn.open_table(ROWS).unwrap();
            for n in from..from + rows {
                table.insert(n, vec![n as u8; bytes].as_slice()).unwrap();
            }
        }
        txn.commit().unwrap();
    }

    /// The file as a power cut during the commit that grew it can leave it: the newest
    /// header (open, so recovery required) on a file cut back to the length it had before
    /// that commit.
    fn cut_after_growth(dir: &Path) -> (std::path::PathBuf, u64) {
        let path = dir.join("state.redb");
        let db = Database::create(&path).unwrap();
        fill(&db, 0, 10, 100);
        let before = std::fs::metadata(&path).unwrap().len();
        fill(&db, 10, 400, 16 * 1024);
        let image = std::fs::read(&path).unwrap();
        drop(db);
        assert!(
            image.len() as u64 > before,
            "the second commit did not grow the file"
        );
        std::fs::write(&path, &image[..before as usize]).unwrap();
        (path, before)
    }

    #[test]
    fn a_file_whose_growth_was_lost_opens_at_its_last_commit_that_kept_its_pages() {
        let dir = tempfile::tempdir().unwrap();
        let (path, before) = cut_after_growth(dir.path());
        // Without this module, redb 2.6 asserts at open (a panic, not an error).
        let copy = dir.path().join("copy.redb");
        std::fs::copy(&path, &copy).unwrap();
        let opened = std::panic::catch_unwind(|| Database::create(&copy).map(drop));
        assert!(opened.is_err(), "redb opened the short file by itself");

        let restored = restore(&path).unwrap();
        let Restored::Extended { from, to } = restored else {
            panic!("{restored:?}");
        };
        assert_eq!(from, before);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), to);
        let db = Database::create(&path).unwrap();
        // The first commit's rows all read back; the second's are whole or absent.
        let txn = db.begin_read().unwrap();
        let table = txn.open_table(ROWS).unwrap();
        for n in 0..10 {
            assert_eq!(table.get(n).unwrap().unwrap().value(), vec![n as u8; 100]);
        }
        for row in table.range(10..).unwrap() {
            let (key, value) = row.unwrap();
            assert_eq!(value.value(), vec![key.value() as u8; 16 * 1024]);
        }
        drop(table);
        drop(txn);
        drop(db);
        // Closed cleanly now, it is left as it is.
        assert_eq!(restore(&path).unwrap(), Restored::AsIs);
    }

    #[test]
    fn a_short_file_after_a_clean_close_or_an_implausible_header_is_damage() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.redb");
        let db = Database::create(&path).unwrap();
        fill(&db, 0, 400, 16 * 1024);
        drop(db);
        let image = std::fs::read(&path).unwrap();
        let mut header = [0u8; HEADER_BYTES];
        header.copy_from_slice(&image[..HEADER_BYTES]);
        let length = image.len() as u64;
        assert_eq!(judge(&header, length), Restored::AsIs);
        assert!(
            matches!(judge(&header, length / 2), Restored::Damaged(why) if why.contains("clean close"))
        );
        // Recovery required, but the stated length is far past any one commit's growth.
        header[GOD_BYTE] |= RECOVERY_REQUIRED;
        header[FULL_REGIONS..FULL_REGIONS + 4].copy_from_slice(&10_000u32.to_le_bytes());
        assert!(
            matches!(judge(&header, length), Restored::Damaged(why) if why.contains("too far"))
        );
        // Fields whose product is past u64, and a page size redb never writes.
        header[FULL_REGIONS..FULL_REGIONS + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        header[REGION_MAX_DATA_PAGES..REGION_MAX_DATA_PAGES + 4]
            .copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(
            matches!(judge(&header, length), Restored::Damaged(why) if why.contains("no possible"))
        );
        header[PAGE_SIZE..PAGE_SIZE + 4].copy_from_slice(&3000u32.to_le_bytes());
        assert!(matches!(judge(&header, length), Restored::Damaged(_)));
        // Not a redb file, or no file: left to redb.
        assert_eq!(judge(&[0u8; HEADER_BYTES], 10), Restored::AsIs);
        assert_eq!(
            restore(&dir.path().join("none.redb")).unwrap(),
            Restored::AsIs
        );
    }
}
