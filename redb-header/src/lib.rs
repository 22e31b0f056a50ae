//! A redb file's header checked, before redb opens it, for what redb 2.6 itself does not
//! check (and would panic on, refuse without a cause, or read wrongly), and the file put
//! back to the length its header states after a power cut lost a growth. Used for the
//! node's state machine file and the witness's and checkpointer's stores.
//!
//! The lost growth: redb grows its file (`set_len`) during write transactions and writes
//! the header, which states the file's layout, at the next durable commit, whose fsync
//! makes both durable. A power cut during that fsync can leave the new header on disk (it
//! overwrites a block already allocated, which writeback may store at any time) without
//! the size change (metadata, durable only when the journal commits). redb 2.6 then
//! asserts at open that the file is at least as long as its header states, and the process
//! could never start again (seen in the node's `power_loss.rs`: a node exited 70 at every
//! start). redb fixed this upstream in a later major version (cberner/redb#1276). Here,
//! when the header says recovery is required (it is set on disk from open to a clean
//! close) and the file is shorter than the header states, the file is extended with zeros
//! to that length, and redb's own recovery runs: it recalculates the layout from the file
//! length and verifies the commit slots' checksummed trees, falling back to the previous
//! commit when the newest one's pages are gone. No durable commit's pages lie past the
//! length the file kept: its fsync made the growth durable together with the data.
//!
//! The header's first 64 bytes carry no checksum, and after a clean close redb reads the
//! newest commit slot without checking its checksum either. A sweep of every bit of the
//! header and both slots, flipped one at a time in a small file (redb alone: 164 of the
//! 2,560 flips panicked at open after a clean close, 4 read every table as absent, 98
//! failed to open or read with an I/O error, 14 were refused as corrupted), is what the
//! checks below answer. Damage, for the caller to handle (the node moves its state machine
//! file aside and rebuilds it from the Raft log; the witness and the checkpointer refuse to
//! start, saying why):
//! - a magic number that is not redb's (redb refuses it at every start with a bare
//!   "invalid data"). All zeros is redb's creation of the file cut off (it writes the
//!   magic number last), or a first block zeroed by the disk. Every caller passes a file
//!   redb created, so a file that is not redb's is damage too;
//! - a flag bit redb never sets;
//! - layout fields other than redb's builder writes (4 KiB pages, its default region size;
//!   every caller keeps both), or describing no file;
//! - a region tracker page outside the layout's data pages (redb reads it at every open);
//! - after a clean close: a length other than the stated one; a newest commit slot of a
//!   format redb never writes or failing its XXH3-128 checksum; a flag naming the slot
//!   with the earlier commit as the newest;
//! - with recovery required: a growth past twice the kept length and 4 GiB.
//!
//! What no header check can tell, and who answers it:
//! - a region tracker page moved within the file (11 of the sweep's flips after a clean
//!   close): redb panics at open. [`open_checked`] catches a panic while redb opens the
//!   file and takes it for damage: the node rebuilds its file, the witness and
//!   checkpointer refuse to start, naming the file (their `store_file`). A panic redb
//!   turns into an abort (one while it unwinds with a poisoned lock) cannot be caught;
//! - the recovery flag cleared on a file left open: redb opens and reads it, trusting a
//!   stale allocator state, and panics or aborts at its first write. redb's own check of
//!   its pages repairs it: the node runs that check after every stop without its
//!   clean-stop marker (which a file left open almost never has: the marker is written
//!   just before the file is closed), and after a clean one too while the file is at most
//!   1 GiB (a page damaged while the node was down); the witness and checkpointer at
//!   every start.
//!
//! Flips redb recovers from itself (the older commit slot; either slot with recovery
//! required, which falls back to the previous commit) are left to it. The tracker page
//! field is checked in format 3 files too, where redb no longer reads it: it keeps the
//! value it was created with, inside the file.
//!
//! Interrupted at each step: checking only reads; the extension is one `set_len` and an
//! fsync; a crash before the fsync meets the same short file at the next start, and one
//! after it a file redb recovers as above.
//!
//! The header fields read here are redb's file format (versions 2 and 3, which redb 2.6
//! reads and writes). The tests run the workspace's redb: a redb whose header differs
//! fails them.

mod open;

pub use open::{is_catching, open_checked, OpenFailure, Opened};

use std::fs::OpenOptions;
use std::io::{self, Read};
use std::path::Path;

/// redb's magic number, at the start of its header.
const MAGIC: [u8; 9] = [b'r', b'e', b'd', b'b', 0x1A, 0x0A, 0xA9, 0x0D, 0x0A];
/// The header byte after the magic number holds flags; this one is set on disk while the
/// file is open for writing, and cleared at a clean close.
const GOD_BYTE: usize = 9;
const RECOVERY_REQUIRED: u8 = 2;
/// The other flags: the primary commit slot, and a two-phase commit. No other bit is set.
const PRIMARY_BIT: u8 = 1;
const KNOWN_FLAGS: u8 = PRIMARY_BIT | RECOVERY_REQUIRED | 4;
/// Little-endian u32 fields after the flags (and two bytes of padding).
const PAGE_SIZE: usize = 12;
const REGION_HEADER_PAGES: usize = 16;
const REGION_MAX_DATA_PAGES: usize = 20;
const FULL_REGIONS: usize = 24;
const TRAILING_REGION_DATA_PAGES: usize = 28;
/// A little-endian page number: page index (20 bits), region (20 bits), order (5 bits).
const REGION_TRACKER_PAGE: usize = 32;
/// Two commit slots follow the 64-byte header, each ending in an XXH3-128 checksum of the
/// rest; its first byte is the file format version (2 or 3).
const COMMIT_SLOTS: usize = 64;
const COMMIT_SLOT_BYTES: usize = 128;
const SLOT_CHECKSUM_BYTES: usize = 16;
/// A slot's transaction id (little-endian u64), after its flags and three tree roots.
const SLOT_TRANSACTION_ID: usize = 104;
const HEADER_BYTES: usize = COMMIT_SLOTS + 2 * COMMIT_SLOT_BYTES;
/// The page size redb's `Builder` uses, which every caller keeps.
const REDB_PAGE_BYTES: u64 = 4096;
/// What redb's `Builder` writes for its default region size at 4 KiB pages: a region's
/// header pages and its most data pages (every caller keeps the default).
const REGION_HEADER_PAGES_WRITTEN: u64 = 130;
const REGION_MAX_DATA_PAGES_WRITTEN: u64 = 1 << 20;
/// How far past the kept length a stated length may be. One `grow` adds at most about two
/// regions (4 GiB each at redb's defaults) or doubles a small file, and the commits made
/// without fsync between two durable ones (the node's, for up to its fsync interval) add
/// theirs; past twice the kept length and 4 GiB, the fields are taken for damage. (A
/// snapshot installed in one transaction can grow a small file further: the node's file is
/// then moved aside and rebuilt, which the snapshot lost to the power cut needs anyway.)
const MOST_GROWTH: u64 = 4 << 30;

/// What [`restore`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum Restored {
    /// Nothing to do: no file, an empty one (redb creates it), or a header that passes
    /// every check with the file at least as long as it states.
    AsIs,
    /// The file was shorter than its header states after an unclean stop, and was
    /// extended with zeros to that length.
    Extended { from: u64, to: u64 },
    /// The file cannot be trusted: why.
    Damaged(String),
}

/// Checks the header of the redb file at `path` (module docs), and extends the file where
/// a power cut lost its growth. Errors are I/O errors, opening, reading or extending it.
pub fn restore(path: &Path) -> io::Result<Restored> {
    let mut file = match OpenOptions::new().read(true).write(true).open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Restored::AsIs),
        Err(e) => return Err(e),
    };
    // A process that has the database open (it holds redb's lock) is not ours to change:
    // redb will say so when it opens the file.
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => return Ok(Restored::AsIs),
        Err(std::fs::TryLockError::Error(e)) => return Err(e),
    }
    let length = file.metadata()?.len();
    if length == 0 {
        return Ok(Restored::AsIs);
    }
    // A file too short for a header (redb's creation cut off, or not a redb file) reads
    // as its bytes and then zeros.
    let mut header = [0u8; HEADER_BYTES];
    let present = length.min(HEADER_BYTES as u64) as usize;
    file.read_exact(&mut header[..present])?;
    let restored = judge(&header, length);
    if let Restored::Extended { to, .. } = restored {
        file.set_len(to)?;
        file.sync_all()?;
    }
    Ok(restored)
}

/// The message of a panic caught around redb's open or page check (the callers take such a
/// panic for damage to the file, see the module docs).
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// What to do with a file of `length` bytes that starts with `header` (zeros past the
/// file's end when it is shorter than a header).
fn judge(header: &[u8; HEADER_BYTES], length: u64) -> Restored {
    match judge_fields(header, length) {
        Ok(restored) => restored,
        Err(why) => Restored::Damaged(why),
    }
}

fn judge_fields(header: &[u8; HEADER_BYTES], length: u64) -> Result<Restored, String> {
    if header[..MAGIC.len()] == [0u8; MAGIC.len()] {
        return Err(
            "its magic number is zeros: redb's creation of it was cut off, or its \
                    first block was zeroed"
                .into(),
        );
    }
    if header[..MAGIC.len()] != MAGIC {
        return Err(format!(
            "its magic number is {:02x?}, not redb's {MAGIC:02x?}: the disk changed it",
            &header[..MAGIC.len()]
        ));
    }
    let flags = header[GOD_BYTE];
    if flags & !KNOWN_FLAGS != 0 {
        return Err(format!(
            "its flags byte is {flags:#04x}, with bits redb never sets"
        ));
    }
    let stated = stated_length(header).ok_or("its header's layout fields describe no redb file")?;
    tracker_page_within(header, stated)?;
    if flags & RECOVERY_REQUIRED == 0 {
        // Closed cleanly: redb opens it as it stands, reading the primary commit slot
        // without checking it and taking the layout as stated.
        if stated != length {
            return Err(format!(
                "it is {length} bytes, not the {stated} its header states, after a clean close"
            ));
        }
        let primary = usize::from(flags & PRIMARY_BIT);
        slot_intact(header, primary)?;
        // The flag naming the newest slot must name the one with the later commit.
        let older = 1 - primary;
        if slot_intact(header, older).is_ok()
            && slot_transaction(header, older) > slot_transaction(header, primary)
        {
            return Err("its flags name the older commit slot as the newest".into());
        }
        return Ok(Restored::AsIs);
    }
    // Open when it stopped: redb's recovery checks both slots and takes the layout from
    // the file's length, which must be at least the stated one.
    if stated <= length {
        return Ok(Restored::AsIs);
    }
    if stated > length.saturating_mul(2).saturating_add(MOST_GROWTH) {
        return Err(format!(
            "its header states {stated} bytes, implausibly far past its {length}"
        ));
    }
    Ok(Restored::Extended {
        from: length,
        to: stated,
    })
}

/// Commit slot `slot`: a file format redb reads, and its checksum intact.
fn slot_intact(header: &[u8; HEADER_BYTES], slot: usize) -> Result<(), String> {
    let start = COMMIT_SLOTS + slot * COMMIT_SLOT_BYTES;
    let bytes = &header[start..start + COMMIT_SLOT_BYTES];
    let (content, stored) = bytes.split_at(COMMIT_SLOT_BYTES - SLOT_CHECKSUM_BYTES);
    if !matches!(content[0], 2 | 3) {
        return Err(format!(
            "its newest commit slot states file format {}; redb 2.6 reads only 2 and 3",
            content[0]
        ));
    }
    let computed = xxhash_rust::xxh3::xxh3_128(content).to_le_bytes();
    if computed != stored {
        return Err(
            "its newest commit slot fails its checksum after a clean close (redb would \
             read it unchecked)"
                .into(),
        );
    }
    Ok(())
}

/// The id of the transaction commit slot `slot` holds.
fn slot_transaction(header: &[u8; HEADER_BYTES], slot: usize) -> u64 {
    let at = COMMIT_SLOTS + slot * COMMIT_SLOT_BYTES + SLOT_TRANSACTION_ID;
    let mut id = [0u8; 8];
    id.copy_from_slice(&header[at..at + 8]);
    u64::from_le_bytes(id)
}

/// The region tracker page (where redb keeps which regions have free pages) must lie
/// within the stated layout's data pages: redb reads it at every open, and one past them
/// panics or fails to read.
fn tracker_page_within(header: &[u8; HEADER_BYTES], stated: u64) -> Result<(), String> {
    let mut raw = [0u8; 8];
    raw.copy_from_slice(&header[REGION_TRACKER_PAGE..REGION_TRACKER_PAGE + 8]);
    let raw = u64::from_le_bytes(raw);
    let index = raw & 0x000F_FFFF;
    let region = (raw >> 20) & 0x000F_FFFF;
    let order = raw >> 59;
    let unused = raw & !((1 << 40) - 1) & !(0x1F << 59);
    let region_pages = REGION_HEADER_PAGES_WRITTEN + REGION_MAX_DATA_PAGES_WRITTEN;
    let pages = 1u64 << order.min(20);
    let start = 1 + region * region_pages + REGION_HEADER_PAGES_WRITTEN + index * pages;
    let end = (start + pages) * REDB_PAGE_BYTES;
    if unused != 0
        || order > 20
        || index * pages + pages > REGION_MAX_DATA_PAGES_WRITTEN
        || end > stated
    {
        return Err(format!(
            "its region tracker page ({raw:#018x}) lies outside the file its header states"
        ));
    }
    Ok(())
}

/// The file length the header's layout fields describe, as redb computes it: a header
/// page, then the full regions and a trailing partial region, each region its header
/// pages and data pages. `None` for fields redb never writes (and would panic on): a page
/// size other than its builder's, no region, a region without header or data pages, a
/// trailing region larger than a full one, or a length past `u64`.
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
    let region_header = field(REGION_HEADER_PAGES);
    let region_data = field(REGION_MAX_DATA_PAGES);
    let (full_regions, trailing_data) = (field(FULL_REGIONS), field(TRAILING_REGION_DATA_PAGES));
    let possible = page == REDB_PAGE_BYTES
        && region_header == REGION_HEADER_PAGES_WRITTEN
        && region_data == REGION_MAX_DATA_PAGES_WRITTEN
        && trailing_data <= region_data
        && (full_regions > 0 || trailing_data > 0);
    if !possible {
        return None;
    }
    let trailing = match trailing_data {
        0 => 0,
        pages => region_header.checked_add(pages)?,
    };
    full_regions
        .checked_mul(region_header.checked_add(region_data)?)?
        .checked_add(trailing)?
        .checked_add(1)?
        .checked_mul(page)
}

#[cfg(test)]
mod tests {
    use super::*;
    use redb::{Database, ReadableTable, ReadableTableMetadata, TableDefinition};

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

    #[test]
    fn a_panic_message_is_its_words_whatever_their_type() {
        let words = |payload: Box<dyn std::any::Any + Send>| panic_message(payload.as_ref());
        assert_eq!(words(Box::new("assertion failed")), "assertion failed");
        assert_eq!(words(Box::new(format!("index {}", 7))), "index 7");
        assert_eq!(words(Box::new(7u8)), "a panic without a message");
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
        // Recovery required, but the stated length is far past any plausible growth.
        header[GOD_BYTE] |= RECOVERY_REQUIRED;
        header[FULL_REGIONS..FULL_REGIONS + 4].copy_from_slice(&10_000u32.to_le_bytes());
        assert!(
            matches!(judge(&header, length), Restored::Damaged(why) if why.contains("implausibly far"))
        );
        // Fields whose product is past u64, and a page size redb never writes.
        header[FULL_REGIONS..FULL_REGIONS + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        header[REGION_MAX_DATA_PAGES..REGION_MAX_DATA_PAGES + 4]
            .copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(
            matches!(judge(&header, length), Restored::Damaged(why) if why.contains("describe no"))
        );
        header[PAGE_SIZE..PAGE_SIZE + 4].copy_from_slice(&3000u32.to_le_bytes());
        assert!(matches!(judge(&header, length), Restored::Damaged(_)));
        // An empty file, or no file: left to redb, which creates it.
        let empty = dir.path().join("empty.redb");
        std::fs::write(&empty, b"").unwrap();
        assert_eq!(restore(&empty).unwrap(), Restored::AsIs);
        assert_eq!(
            restore(&dir.path().join("none.redb")).unwrap(),
            Restored::AsIs
        );
        // A magic number of zeros (redb's creation cut off), at any length.
        for bytes in [5usize, 4096] {
            let cut = dir.path().join(format!("cut-{bytes}.redb"));
            std::fs::write(&cut, vec![0u8; bytes]).unwrap();
            let restored = restore(&cut).unwrap();
            assert!(
                matches!(&restored, Restored::Damaged(why) if why.contains("magic number is zeros")),
                "{bytes} bytes: {restored:?}"
            );
        }
    }

    /// A header as redb writes it at its defaults (4 KiB pages, 130 header pages and 4 GiB
    /// of data pages a region), with recovery required.
    fn header_of(full_regions: u32, trailing_pages: u32) -> [u8; HEADER_BYTES] {
        let mut header = [0u8; HEADER_BYTES];
        header[..MAGIC.len()].copy_from_slice(&MAGIC);
        header[GOD_BYTE] = RECOVERY_REQUIRED;
        for (at, value) in [
            (PAGE_SIZE, 4096u32),
            (REGION_HEADER_PAGES, 130),
            (REGION_MAX_DATA_PAGES, 1 << 20),
            (FULL_REGIONS, full_regions),
            (TRAILING_REGION_DATA_PAGES, trailing_pages),
        ] {
            header[at..at + 4].copy_from_slice(&value.to_le_bytes());
        }
        header
    }

    #[test]
    fn layouts_redb_never_writes_are_damage_and_the_growth_bound_is_exact() {
        // No region at all (a torn pair of counts), and a trailing region past a full one.
        assert!(matches!(
            judge(&header_of(0, 0), 4096),
            Restored::Damaged(_)
        ));
        assert!(matches!(
            judge(&header_of(0, (1 << 20) + 1), 4096),
            Restored::Damaged(_)
        ));
        // A full trailing region is a layout redb writes: (1 + 130 + 2^20) pages.
        let stated = (131 + (1u64 << 20)) * 4096;
        assert_eq!(stated_length(&header_of(0, 1 << 20)), Some(stated));
        assert_eq!(
            stated_length(&header_of(2, 5)),
            Some((1 + 2 * (130 + (1u64 << 20)) + 130 + 5) * 4096)
        );
        // Twice the kept length and 4 GiB is the most growth taken for real.
        let kept = (stated - MOST_GROWTH) / 2;
        assert_eq!(
            judge(&header_of(0, 1 << 20), kept),
            Restored::Extended {
                from: kept,
                to: stated
            }
        );
        let past = judge(&header_of(0, 1 << 20), kept - 1);
        assert!(
            matches!(&past, Restored::Damaged(why) if why.contains("implausibly")),
            "{past:?}"
        );
    }

    /// One bit flipped in the magic number: redb's own open refuses the file with an I/O
    /// error that names no cause, at every start. It is damage, as is another program's
    /// file and a start of the magic number alone.
    #[test]
    fn a_magic_number_that_is_not_redbs_is_damage() {
        let dir = tempfile::tempdir().unwrap();
        let (path, _) = cut_after_growth(dir.path());
        // Put the growth back: the file is whole, only its magic number differs.
        assert!(matches!(restore(&path).unwrap(), Restored::Extended { .. }));
        let mut image = std::fs::read(&path).unwrap();
        image[4] ^= 0x01;
        std::fs::write(&path, &image).unwrap();
        let copy = dir.path().join("copy.redb");
        std::fs::copy(&path, &copy).unwrap();
        let refused = Database::create(&copy).map(drop).unwrap_err();
        assert!(
            matches!(&refused, redb::DatabaseError::Storage(redb::StorageError::Io(e))
                if e.kind() == io::ErrorKind::InvalidData),
            "{refused:?}"
        );
        let restored = restore(&path).unwrap();
        assert!(
            matches!(&restored, Restored::Damaged(why) if why.contains("not redb's")),
            "{restored:?}"
        );
        let mut other = [0u8; HEADER_BYTES];
        other[..4].copy_from_slice(b"SQLi");
        assert!(matches!(judge(&other, 4096), Restored::Damaged(_)));
        let mut start = [0u8; HEADER_BYTES];
        start[..4].copy_from_slice(&MAGIC[..4]);
        assert!(matches!(judge(&start, 4), Restored::Damaged(_)));
    }

    /// Every bit of the header's fields, and one bit of every other byte of the header and
    /// both commit slots (each slot is one checksum's worth: a bit per byte, rotating,
    /// covers every field and keeps the test short), flipped one at a time, in a file
    /// closed cleanly and in one left open: each flip is damage here, or redb refuses the
    /// file naming corruption, or opens it, reads back the last commit (or, left open, the
    /// one before it) and takes a write, after which the file, closed and opened again,
    /// passes redb's check of every page. A file left open gets that check first, as every
    /// caller does (it repairs the recovery flag cleared). Only a tracker page moved within
    /// the file makes redb panic (every caller catches that); no flip reads wrong or
    /// missing rows, or fails to open without a cause.
    #[test]
    fn every_header_bit_flipped_is_damage_or_read_back_whole() {
        const COMMITS: u64 = 3;
        const ROWS: u64 = 20;
        // Each case writes the whole file: in memory where there is a tmpfs.
        let shm = Path::new("/dev/shm");
        let dir = tempfile::tempdir_in(shm)
            .or_else(|_| tempfile::tempdir())
            .unwrap();
        for left_open in [false, true] {
            let path = dir.path().join("whole.redb");
            let _ = std::fs::remove_file(&path);
            let db = Database::create(&path).unwrap();
            for commit in 0..COMMITS {
                fill(&db, commit * ROWS, ROWS, 300);
            }
            let image = if left_open {
                let image = std::fs::read(&path).unwrap();
                drop(db);
                image
            } else {
                drop(db);
                std::fs::read(&path).unwrap()
            };
            let case = dir.path().join("case.redb");
            let mut panicked = Vec::new();
            for byte in 0..HEADER_BYTES {
                let bits = if byte < REGION_TRACKER_PAGE + 8 {
                    0..8
                } else {
                    byte % 8..byte % 8 + 1
                };
                for bit in bits {
                    let mut flipped = image.clone();
                    flipped[byte] ^= 1 << bit;
                    std::fs::write(&case, &flipped).unwrap();
                    if let Restored::Damaged(_) = restore(&case).unwrap() {
                        continue;
                    }
                    let read = std::panic::catch_unwind(|| rows_read_back(&case, left_open));
                    match read {
                        Err(_) => panicked.push((byte, bit)),
                        Ok(Ok(rows)) => {
                            let last = COMMITS * ROWS;
                            assert!(
                                rows == last || (left_open && rows == last - ROWS),
                                "byte {byte} bit {bit}: {rows} rows read back"
                            );
                        }
                        // redb's own refusal naming corruption (an older slot's format).
                        Ok(Err(why)) => assert!(
                            why.contains("corrupted"),
                            "byte {byte} bit {bit}, left open {left_open}: {why}"
                        ),
                    }
                }
            }
            let known = |&(byte, _): &(usize, usize)| {
                (REGION_TRACKER_PAGE..REGION_TRACKER_PAGE + 8).contains(&byte)
            };
            assert!(
                panicked.iter().all(known),
                "left open {left_open}: redb panicked on {panicked:?}"
            );
        }
    }

    /// How many rows read back, each with its value, with redb's check of its pages first
    /// if `check_pages`, and a write after; or why not.
    fn rows_read_back(path: &Path, check_pages: bool) -> Result<u64, String> {
        let mut db = Database::create(path).map_err(|e| e.to_string())?;
        if check_pages {
            db.check_integrity().map_err(|e| e.to_string())?;
        }
        let mut rows = 0;
        let txn = db.begin_read().map_err(|e| e.to_string())?;
        let table = txn.open_table(ROWS).map_err(|e| e.to_string())?;
        for row in table.iter().map_err(|e| e.to_string())? {
            let (key, value) = row.map_err(|e| e.to_string())?;
            if value.value() != vec![key.value() as u8; 300].as_slice() {
                return Err(format!("row {} reads back changed", key.value()));
            }
            rows += 1;
        }
        drop((table, txn));
        fill(&db, 1000, 1, 300);
        drop(db);
        // Closed again, the file is whole: every page checks, and the write is there.
        let mut db = Database::create(path).map_err(|e| e.to_string())?;
        if !db.check_integrity().map_err(|e| e.to_string())? {
            return Err("closed after the write, it needed repair".into());
        }
        let txn = db.begin_read().map_err(|e| e.to_string())?;
        let table = txn.open_table(ROWS).map_err(|e| e.to_string())?;
        if table.len().map_err(|e| e.to_string())? != rows + 1 {
            return Err("the write did not read back".into());
        }
        Ok(rows)
    }

    /// Healthy files must never be taken for damage (the witness and checkpointer would
    /// refuse to start): after every kind of use redb allows, closed cleanly, the header
    /// passes and redb opens the file again. Both file formats.
    #[test]
    fn healthy_files_after_every_kind_of_use_are_left_as_they_are() {
        let dir = tempfile::tempdir().unwrap();
        for v3 in [false, true] {
            let mut builder = redb::Builder::new();
            builder.create_with_file_format_v3(v3);
            let path = dir.path().join(format!("v3-{v3}.redb"));
            let closed_as = |what: &str, db: Database| {
                drop(db);
                assert_eq!(restore(&path).unwrap(), Restored::AsIs, "v3 {v3}: {what}");
                let mut db = builder.open(&path).unwrap();
                assert!(db.check_integrity().unwrap(), "v3 {v3}: {what}");
                db
            };
            let db = builder.create(&path).unwrap();
            let db = closed_as("created", db);
            for n in 0..50 {
                fill(&db, n * 10, 10, 500);
            }
            let db = closed_as("many commits", db);
            // A write that grew the file, aborted; and one dropped unfinished.
            for abort in [true, false] {
                let txn = db.begin_write().unwrap();
                {
                    let mut table = txn.open_table(ROWS).unwrap();
                    for n in 10_000..10_400 {
                        table.insert(n, vec![1u8; 16 * 1024].as_slice()).unwrap();
                    }
                }
                if abort {
                    txn.abort().unwrap();
                } else {
                    drop(txn);
                }
            }
            let db = closed_as("growing writes aborted", db);
            for n in 0..5 {
                let mut txn = db.begin_write().unwrap();
                txn.set_durability(redb::Durability::None);
                txn.open_table(ROWS)
                    .unwrap()
                    .insert(20_000 + n, [2u8; 100].as_slice())
                    .unwrap();
                txn.commit().unwrap();
            }
            let db = closed_as("commits without fsync", db);
            let mut txn = db.begin_write().unwrap();
            txn.set_two_phase_commit(true);
            txn.open_table(ROWS).unwrap().remove(0).unwrap();
            txn.commit().unwrap();
            let mut db = closed_as("a two-phase commit", db);
            fill(&db, 30_000, 300, 16 * 1024);
            let txn = db.begin_write().unwrap();
            txn.open_table(ROWS)
                .unwrap()
                .retain(|key, _| key < 30_000)
                .unwrap();
            txn.commit().unwrap();
            db.compact().unwrap();
            let db = closed_as("compacted", db);
            let txn = db.begin_write().unwrap();
            let savepoint = txn.persistent_savepoint().unwrap();
            txn.commit().unwrap();
            fill(&db, 40_000, 10, 100);
            let db = closed_as("a persistent savepoint held", db);
            let mut txn = db.begin_write().unwrap();
            let restored = txn.get_persistent_savepoint(savepoint).unwrap();
            txn.restore_savepoint(&restored).unwrap();
            txn.commit().unwrap();
            let mut db = closed_as("a savepoint restored", db);
            assert!(db.check_integrity().unwrap());
            closed_as("checked", db);
        }
    }
}
