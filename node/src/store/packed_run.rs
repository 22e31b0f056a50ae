//! A run of consecutive lines, compressed: how a row of the `packed_runs` table (an
//! agent's records, `record_rows`) and of `heads_leaf_runs` (the heads log's statements,
//! `heads_leaves`) is encoded, checked, and sized to a page.
//!
//! A row is a format byte, the run's line count (u32, little-endian) and one zstd frame
//! of the run's text (its lines joined by `\n`) that declares its size and carries
//! zstd's checksum of the text. Reading checks all of it: the format, the declared size
//! against a bound, the checksum, and that the text holds the stated number of lines.
//! Any failure is damage, reported as such, never fewer or other lines.
//!
//! Why: a record's line is mostly JSON keys repeated in every record, a `prev_hash` equal
//! to the line before's `hash`, and hex; level 3 stores a run in 0.4 of its text with
//! 200-byte inputs of random letters (`benches` `memory_growth`, `redb_tables`). A head
//! statement is JSON keys and hex: it packs to about half.

use std::cell::RefCell;

/// redb's page size (its default; the node does not change it). Runs are sized to fit
/// in one page's leaf, so a small run shares a page with its neighbours.
pub const PAGE_BYTES: usize = 4096;
/// The only format so far.
const FORMAT_ZSTD: u8 = 1;
/// The format byte and the line count.
pub const HEADER_BYTES: usize = 1 + 4;
/// zstd's level: 3 is its default, fast enough to run beside applies.
const LEVEL: i32 = 3;
/// The most text a row may declare. A run is far smaller (it packs to about a page, or is
/// one line); a declared size above this is damage, refused before anything is allocated
/// for it.
pub const MAX_TEXT_BYTES: usize = 64 * 1024 * 1024;

thread_local! {
    /// A compressor per thread: its context is reused rather than built for every run.
    static COMPRESSOR: RefCell<Option<zstd::bulk::Compressor<'static>>> = const { RefCell::new(None) };
}

/// Encodes a run of `lines` lines whose text is `text`.
pub fn pack(text: &str, lines: u32) -> Result<Vec<u8>, String> {
    let frame = COMPRESSOR.with(|cell| {
        let mut cell = cell.borrow_mut();
        let compressor = match cell.as_mut() {
            Some(compressor) => compressor,
            None => {
                let mut compressor = zstd::bulk::Compressor::new(LEVEL)?;
                compressor.set_parameter(zstd::zstd_safe::CParameter::ChecksumFlag(true))?;
                cell.insert(compressor)
            }
        };
        compressor.compress(text.as_bytes())
    });
    let frame = frame.map_err(|e| format!("compressing a run: {e}"))?;
    let mut row = Vec::with_capacity(HEADER_BYTES + frame.len());
    row.push(FORMAT_ZSTD);
    row.extend_from_slice(&lines.to_le_bytes());
    row.extend_from_slice(&frame);
    Ok(row)
}

/// How many lines a row says it holds (its header only: not checked against the text).
pub fn stated_lines(row: &[u8]) -> Result<u32, String> {
    match row {
        [FORMAT_ZSTD, a, b, c, d, ..] => Ok(u32::from_le_bytes([*a, *b, *c, *d])),
        [format, ..] if *format != FORMAT_ZSTD => {
            Err(format!("unknown packed run format {format}"))
        }
        _ => Err(format!("a packed run of {} bytes", row.len())),
    }
}

/// A row's text, checked: the format, its declared size (at most [`MAX_TEXT_BYTES`]),
/// zstd's checksum, and its line count.
pub fn unpack(row: &[u8]) -> Result<String, String> {
    unpack_within(row, MAX_TEXT_BYTES)
}

/// [`unpack`], with the declared size bounded by `max_text` instead.
pub fn unpack_within(row: &[u8], max_text: usize) -> Result<String, String> {
    let lines = stated_lines(row)?;
    let frame = &row[HEADER_BYTES..];
    let size = match zstd::zstd_safe::get_frame_content_size(frame) {
        Ok(Some(size)) if size <= max_text as u64 => size as usize,
        Ok(Some(size)) => return Err(format!("a packed run declares {size} bytes of text")),
        Ok(None) | Err(_) => return Err("a packed run's frame declares no size".into()),
    };
    let text = zstd::bulk::decompress(frame, size)
        .map_err(|e| format!("a packed run does not decompress: {e}"))?;
    if text.len() != size {
        return Err(format!(
            "a packed run holds {} bytes of text, not the {size} it declares",
            text.len()
        ));
    }
    let text = String::from_utf8(text).map_err(|_| "a packed run's text is not UTF-8")?;
    let found = text.split('\n').count();
    if found != lines as usize {
        return Err(format!(
            "a packed run holds {found} lines, not the {lines} its header says"
        ));
    }
    Ok(text)
}

/// `lines` (numbered from `first`) packed into runs of at most `limit` bytes each (a
/// single line that alone packs bigger is a run of its own), as (first number, row).
/// Every run but the last is at least `closed` bytes where the lines allow: a run smaller
/// than that is left open, for its owner to reopen with more lines. How many lines a run
/// takes is guessed from `ratio` (packed to text bytes), then from the run before's, and
/// corrected from what it packed to (a few tries; the fullest that fits).
pub fn pack_runs(
    first: u64,
    lines: &[&str],
    mut ratio: f64,
    limit: usize,
    closed: usize,
) -> Result<Vec<(u64, Vec<u8>)>, String> {
    const TRIES: usize = 4;
    let mut runs = Vec::new();
    let mut at = 0;
    while at < lines.len() {
        let rest = &lines[at..];
        let mut target = (limit as f64 / ratio * 0.97) as usize;
        // (lines taken, row, text bytes) of the fullest try that fits.
        let mut best: Option<(usize, Vec<u8>, usize)> = None;
        for _ in 0..TRIES {
            let take = lines_within(rest, target);
            let text = rest[..take].join("\n");
            let row = pack(&text, take as u32)?;
            let (text_len, row_len) = (text.len(), row.len());
            let fits = row_len <= limit || take == 1;
            let done = fits && (row_len >= closed || take == rest.len());
            if fits && best.as_ref().is_none_or(|(taken, _, _)| take > *taken) {
                best = Some((take, row, text_len));
            }
            if done {
                break;
            }
            let scaled = (text_len as f64 * limit as f64 / row_len as f64 * 0.97) as usize;
            target = if fits {
                scaled.max(text_len + 1)
            } else {
                scaled.min(text_len.saturating_sub(1))
            };
        }
        let (take, row, text_len) = match best {
            Some(best) => best,
            None => {
                let text = rest[0];
                (1, pack(text, 1)?, text.len())
            }
        };
        ratio = (row.len() as f64 / text_len.max(1) as f64).clamp(0.02, 2.0);
        runs.push((first + at as u64, row));
        at += take;
    }
    Ok(runs)
}

/// How many of `lines` (at least one) fit in `bytes` of text joined by newlines.
fn lines_within(lines: &[&str], bytes: usize) -> usize {
    let mut used = 0;
    let mut take = 0;
    for line in lines {
        let with = used + usize::from(take > 0) + line.len();
        if take > 0 && with > bytes {
            break;
        }
        used = with;
        take += 1;
    }
    take
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run() -> String {
        (0..40)
            .map(|seq| format!(r#"{{"seq":{seq},"kind":"action_requested","hash":"{seq:064x}"}}"#))
            .collect::<Vec<_>>()
            .join("\n")
    }

    #[test]
    fn a_run_reads_back_as_packed_and_smaller() {
        let text = run();
        let row = pack(&text, 40).unwrap();
        assert!(
            row.len() * 3 < text.len(),
            "{} of {}",
            row.len(),
            text.len()
        );
        assert_eq!(stated_lines(&row), Ok(40));
        assert_eq!(unpack(&row).unwrap(), text);
    }

    /// No single flipped bit, zeroed row, cut or wrong line count reads back as other
    /// text. Most are refused; a few flips land where zstd does not look (the frame
    /// header's unused bit, padding in its entropy tables) and read back the same text:
    /// the checksum covers the text, not the encoding.
    #[test]
    fn a_damaged_row_is_refused_never_read_as_other_lines() {
        let text = run();
        let row = pack(&text, 40).unwrap();
        let mut same = Vec::new();
        for byte in 0..row.len() {
            for bit in 0..8 {
                let mut damaged = row.clone();
                damaged[byte] ^= 1 << bit;
                if let Ok(read) = unpack(&damaged) {
                    assert_eq!(read, text, "bit {bit} of byte {byte} flipped");
                    same.push((byte, bit));
                }
            }
        }
        // The frame header descriptor's unused bit (RFC 8878 3.1.1.1.1.3) among them.
        assert!(same.contains(&(HEADER_BYTES + 4, 4)), "{same:?}");
        assert!(same.len() * 10 < row.len() * 8, "{same:?}");
        assert!(unpack(&vec![0; row.len()]).is_err());
        for len in 0..row.len() {
            assert!(unpack(&row[..len]).is_err(), "cut to {len} read back");
        }
        let mut miscounted = pack(&text, 39).unwrap();
        assert!(unpack(&miscounted).unwrap_err().contains("40 lines"));
        miscounted[1..5].copy_from_slice(&41u32.to_le_bytes());
        assert!(unpack(&miscounted).is_err());
    }
}
