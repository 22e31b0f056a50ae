//! An append-only, signed log in one JSON Lines file, held under an exclusive lock.
//!
//! Write path, and what an interruption at each step leaves behind:
//! 1. all new lines are written with one `write_all` — a crash here may leave a prefix of
//!    them, possibly ending in a partial line;
//! 2. `sync_data` — only after it returns is anything reported as appended;
//! 3. the in-memory head moves.
//!
//! A partial last line (no trailing `\n`) was therefore never acknowledged; opening the
//! log for writing cuts it off. Complete lines that were written but not acknowledged
//! stay: they are valid, signed records.

use std::fs::{File, OpenOptions};
use std::io::{self, BufRead, BufReader, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::keys::{sync_parent_dir, AuditKey};
use crate::record::{timestamp, Head, Record, MAX_RECORD_BYTES, ZERO_HASH};
use crate::verify::{read_line_bounded, Verifier, VerifyFailure, VerifyOptions};

#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    #[error("{path}: {source}")]
    Io { path: String, source: io::Error },
    #[error("log is locked by another writer: {0}")]
    Locked(String),
    #[error("log already exists: {0}")]
    Exists(String),
    #[error("log was signed by key {log_key} but writer holds key {writer_key}")]
    KeyMismatch { log_key: String, writer_key: String },
    #[error("log is corrupt: {0}")]
    Corrupt(VerifyFailure),
    #[error(transparent)]
    NotRepresentable(#[from] crate::record::RoundTripError),
    #[error("records do not extend the log's head: {0}")]
    NotExtending(String),
    #[error("an earlier write to {0} failed; reopen the log to continue")]
    Poisoned(String),
}

/// Every this many records the log keeps where one starts in the file, so that reading
/// a record back scans at most this many lines, never the whole file. Eight bytes per
/// this many records: 62 KB for a million.
const MARK_EVERY: u64 = 128;

pub struct AuditLog {
    path: PathBuf,
    file: File,
    key: AuditKey,
    log_id: String,
    head: Head,
    last_timestamp_micros: i64,
    /// Where record `i * MARK_EVERY` starts in the file, for every `i` up to the head.
    marks: Vec<u64>,
    /// Where the file's records end: where the next write's lines go.
    end: u64,
    /// A write failed and what it left could not be cut off: no more writes or reads by
    /// place until the log is opened again.
    poisoned: bool,
}

impl std::fmt::Debug for AuditLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuditLog")
            .field("path", &self.path)
            .field("log_id", &self.log_id)
            .field("head", &self.head)
            .finish_non_exhaustive()
    }
}

fn io_error(path: &Path) -> impl Fn(io::Error) -> AuditError + '_ {
    move |source| AuditError::Io {
        path: path.display().to_string(),
        source,
    }
}

fn lock(file: &File, path: &Path) -> Result<(), AuditError> {
    match file.try_lock() {
        Ok(()) => Ok(()),
        Err(std::fs::TryLockError::WouldBlock) => {
            Err(AuditError::Locked(path.display().to_string()))
        }
        Err(std::fs::TryLockError::Error(e)) => Err(io_error(path)(e)),
    }
}

impl AuditLog {
    /// Creates a new log whose genesis names `log_id`. Refuses an existing file.
    pub fn create(path: impl AsRef<Path>, key: AuditKey, log_id: &str) -> Result<Self, AuditError> {
        let mut log = Self::create_empty(path.as_ref(), key, log_id)?;
        let genesis = Record::seal(
            &log.key,
            0,
            timestamp::format(timestamp::now_micros()),
            log_id,
            "genesis",
            serde_json::json!({"log_id": log_id, "public_key": log.key.public_key_hex()}),
            ZERO_HASH,
        );
        log.write_records(std::slice::from_ref(&genesis))?;
        Ok(log)
    }

    /// Creates the file for a new log (locked, empty). Used by [`crate::Guard`], which
    /// writes its own genesis and policy records.
    pub(crate) fn create_empty(
        path: &Path,
        key: AuditKey,
        log_id: &str,
    ) -> Result<Self, AuditError> {
        let file = Self::create_file(path)?;
        Ok(AuditLog {
            path: path.to_path_buf(),
            file,
            key,
            log_id: log_id.to_string(),
            head: Head {
                seq: 0,
                hash: ZERO_HASH.into(),
            },
            last_timestamp_micros: 0,
            marks: Vec::new(),
            end: 0,
            poisoned: false,
        })
    }

    fn create_file(path: &Path) -> Result<File, AuditError> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io_error(dir))?;
        }
        let file = OpenOptions::new()
            .read(true)
            .append(true)
            .create_new(true)
            .open(path)
            .map_err(|e| {
                if e.kind() == io::ErrorKind::AlreadyExists {
                    AuditError::Exists(path.display().to_string())
                } else {
                    io_error(path)(e)
                }
            })?;
        lock(&file, path)?;
        sync_parent_dir(path).map_err(io_error(path))?;
        Ok(file)
    }

    /// Opens an existing log for appending: lock, cut an unacknowledged partial line,
    /// check the key, verify every record. `each` sees every verified record in order
    /// (the guard replays through it), so the log is read once, in constant memory.
    pub fn open_with(
        path: impl AsRef<Path>,
        key: AuditKey,
        mut each: impl FnMut(&Record) -> Result<(), String>,
    ) -> Result<Self, AuditError> {
        let path = path.as_ref();
        let mut file = OpenOptions::new()
            .read(true)
            .append(true)
            .open(path)
            .map_err(io_error(path))?;
        lock(&file, path)?;
        cut_partial_tail(&mut file).map_err(io_error(path))?;
        file.seek(SeekFrom::Start(0)).map_err(io_error(path))?;

        let mut reader = BufReader::with_capacity(64 * 1024, &file);
        let mut verifier = Verifier::new(VerifyOptions::default());
        let mut line = Vec::new();
        let mut log_id = String::new();
        let mut last_timestamp_micros = 0;
        let mut marks = Vec::new();
        let mut offset = 0u64;
        loop {
            match read_line_bounded(&mut reader, &mut line, MAX_RECORD_BYTES) {
                Ok(false) => break,
                Ok(true) => {}
                Err(e) => {
                    return Err(AuditError::Corrupt(VerifyFailure {
                        line: Some(verifier.count() + 1),
                        seq: None,
                        reason: format!("malformed record: {e}"),
                    }))
                }
            }
            let record = verifier.push_line(&line).map_err(AuditError::Corrupt)?;
            // Verified: the records run from seq 0 up, one a line, each line ending in
            // its newline (`cut_partial_tail`).
            if record.seq % MARK_EVERY == 0 {
                marks.push(offset);
            }
            offset += line.len() as u64 + 1;
            if record.seq == 0 {
                let log_key = record
                    .payload
                    .get("public_key")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                if !log_key.eq_ignore_ascii_case(key.public_key_hex()) {
                    return Err(AuditError::KeyMismatch {
                        log_key: log_key.to_string(),
                        writer_key: key.public_key_hex().to_string(),
                    });
                }
                log_id = record
                    .payload
                    .get("log_id")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string();
            }
            if let Some(at) = timestamp::parse(&record.timestamp) {
                last_timestamp_micros = last_timestamp_micros.max(at);
            }
            each(&record).map_err(|reason| {
                AuditError::Corrupt(VerifyFailure {
                    line: Some(record.seq + 1),
                    seq: Some(record.seq),
                    reason,
                })
            })?;
        }
        verifier.finish().map_err(AuditError::Corrupt)?;
        let head = verifier.head().ok_or_else(|| {
            AuditError::Corrupt(VerifyFailure {
                line: None,
                seq: None,
                reason: "log is empty".into(),
            })
        })?;
        drop(reader);
        Ok(AuditLog {
            path: path.to_path_buf(),
            file,
            key,
            log_id,
            head,
            last_timestamp_micros,
            marks,
            end: offset,
            poisoned: false,
        })
    }

    /// Opens an existing log for appending.
    pub fn open(path: impl AsRef<Path>, key: AuditKey) -> Result<Self, AuditError> {
        Self::open_with(path, key, |_| Ok(()))
    }

    /// Opens the log, or creates it with the file stem as its id.
    pub fn open_or_create(
        path: impl AsRef<Path>,
        key: AuditKey,
        log_id: &str,
    ) -> Result<Self, AuditError> {
        let path = path.as_ref();
        if path.exists() {
            Self::open(path, key)
        } else {
            Self::create(path, key, log_id)
        }
    }

    /// Appends one record signed by this log's key and returns it once it is durable.
    pub fn append(
        &mut self,
        actor: &str,
        kind: &str,
        payload: Value,
    ) -> Result<Record, AuditError> {
        let now = timestamp::now_micros().max(self.last_timestamp_micros);
        let record = Record::seal(
            &self.key,
            self.head.seq + 1,
            timestamp::format(now),
            actor,
            kind,
            payload,
            &self.head.hash,
        );
        self.write_records(std::slice::from_ref(&record))?;
        Ok(record)
    }

    /// Writes already-sealed records that extend the head, in one write and one sync.
    /// If either fails, what was written is cut off again; if that fails too, the log
    /// refuses further writes until it is opened again (which cuts a partial line).
    pub fn write_records(&mut self, records: &[Record]) -> Result<(), AuditError> {
        if self.poisoned {
            return Err(AuditError::Poisoned(self.path.display().to_string()));
        }
        // The next seq and hash: 0 and the zero hash for a log with no record yet
        // (`create_empty`).
        let (first, mut prev_hash) = if self.marks.is_empty() {
            (0, ZERO_HASH)
        } else {
            (self.head.seq + 1, self.head.hash.as_str())
        };
        for (record, next) in records.iter().zip(first..) {
            if record.seq != next || record.prev_hash != prev_hash {
                return Err(AuditError::NotExtending(format!(
                    "record seq {} (prev_hash {}) where seq {next} after {prev_hash} comes next",
                    record.seq, record.prev_hash
                )));
            }
            prev_hash = &record.hash;
        }
        // Every line is checked to read back as the record it holds before any is
        // written, so a batch is written whole or not at all.
        let mut text = String::new();
        let mut starts = Vec::new();
        for record in records {
            let (line, _) = record.to_checked_line()?;
            if record.seq % MARK_EVERY == 0 {
                starts.push(text.len() as u64);
            }
            text.push_str(&line);
            text.push('\n');
        }
        let end = self.end;
        let written = self
            .file
            .write_all(text.as_bytes())
            .and_then(|()| self.file.sync_data());
        if let Err(e) = written {
            // Not acknowledged: cut it off, so that the file holds only acknowledged
            // lines and the next write lands where the marks say.
            let cut = self.file.set_len(end).and_then(|()| self.file.sync_data());
            if cut.is_err() {
                self.poisoned = true;
            }
            return Err(io_error(&self.path)(e));
        }
        self.marks
            .extend(starts.into_iter().map(|start| end + start));
        self.end = end + text.len() as u64;
        if let Some(last) = records.last() {
            self.head = last.head();
            if let Some(at) = timestamp::parse(&last.timestamp) {
                self.last_timestamp_micros = self.last_timestamp_micros.max(at);
            }
        }
        Ok(())
    }

    pub fn head(&self) -> Head {
        self.head.clone()
    }

    pub fn log_id(&self) -> &str {
        &self.log_id
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn key(&self) -> &AuditKey {
        &self.key
    }

    pub fn public_key_hex(&self) -> &str {
        self.key.public_key_hex()
    }

    /// Reads every record back from disk.
    pub fn records(&self) -> Result<Vec<Record>, AuditError> {
        read_records(&self.path)
    }

    /// The records at `seqs` (in any order; ascending reads least), read back from disk;
    /// `None` for a seq past the head. Each is found from the mark before it: at most
    /// `MARK_EVERY` lines are read for one, and seqs close together share the reading.
    /// A line that does not hold the record its place says (the file changed since it
    /// was opened) is an error.
    pub fn records_at(&self, seqs: &[u64]) -> Result<Vec<Option<Record>>, AuditError> {
        let path = &self.path;
        let corrupt = |seq: u64, reason: String| {
            AuditError::Corrupt(VerifyFailure {
                line: Some(seq + 1),
                seq: Some(seq),
                reason,
            })
        };
        if self.poisoned {
            return Err(AuditError::Poisoned(path.display().to_string()));
        }
        let file = File::open(path).map_err(io_error(path))?;
        let mut reader = BufReader::with_capacity(64 * 1024, file);
        let mut line = Vec::new();
        // The seq of the line the reader gives next, once it has been placed.
        let mut next: Option<u64> = None;
        let mut found = Vec::with_capacity(seqs.len());
        for &seq in seqs {
            if self.marks.is_empty() || seq > self.head.seq {
                found.push(None);
                continue;
            }
            let mark = seq / MARK_EVERY;
            let Some(&mark_offset) = usize::try_from(mark).ok().and_then(|m| self.marks.get(m))
            else {
                return Err(corrupt(seq, "no mark kept before this record".into()));
            };
            let mark_seq = mark * MARK_EVERY;
            // Read on from where the reader is, unless it is past `seq` or before the mark.
            if next.is_none_or(|next| next > seq || next < mark_seq) {
                reader
                    .seek(SeekFrom::Start(mark_offset))
                    .map_err(io_error(path))?;
                next = Some(mark_seq);
            }
            let mut at = next.unwrap_or(mark_seq);
            while at < seq {
                let skipped = reader.skip_until(b'\n').map_err(io_error(path))?;
                if skipped == 0 {
                    return Err(corrupt(seq, "the file ends before this record".into()));
                }
                at += 1;
            }
            // An over-long line is the record's fault; any other read error is the
            // disk's, and fails the call rather than naming one record damaged.
            let read =
                read_line_bounded(&mut reader, &mut line, MAX_RECORD_BYTES).map_err(|e| {
                    if e.kind() == io::ErrorKind::InvalidData {
                        corrupt(seq, format!("malformed record: {e}"))
                    } else {
                        io_error(path)(e)
                    }
                })?;
            if !read {
                return Err(corrupt(seq, "the file ends before this record".into()));
            }
            next = Some(seq + 1);
            let record = std::str::from_utf8(&line)
                .map_err(|e| e.to_string())
                .and_then(|text| Record::from_line(text).map_err(|e| e.to_string()))
                .map_err(|e| corrupt(seq, format!("malformed record: {e}")))?;
            if record.seq != seq {
                return Err(corrupt(
                    seq,
                    format!("the line in its place holds seq {}", record.seq),
                ));
            }
            found.push(Some(record));
        }
        Ok(found)
    }
}

/// Reads and parses every record of a log file, without verifying it.
pub fn read_records(path: &Path) -> Result<Vec<Record>, AuditError> {
    let file = File::open(path).map_err(io_error(path))?;
    let mut reader = BufReader::new(file);
    let mut line = Vec::new();
    let mut records = Vec::new();
    while read_line_bounded(&mut reader, &mut line, MAX_RECORD_BYTES).map_err(io_error(path))? {
        let text = std::str::from_utf8(&line).map_err(|e| {
            AuditError::Corrupt(VerifyFailure {
                line: Some(records.len() as u64 + 1),
                seq: None,
                reason: format!("malformed record: invalid UTF-8: {e}"),
            })
        })?;
        let record = Record::from_line(text).map_err(|e| {
            AuditError::Corrupt(VerifyFailure {
                line: Some(records.len() as u64 + 1),
                seq: None,
                reason: format!("malformed record: {e}"),
            })
        })?;
        records.push(record);
    }
    Ok(records)
}

/// Repairs a last line without its `\n`. A crash between write and sync can leave a
/// partial line, which was never acknowledged: it is cut off. A complete record that
/// merely lacks its newline (an edited file) is kept, and the newline added.
fn cut_partial_tail(file: &mut File) -> io::Result<()> {
    use std::io::Read;
    let len = file.metadata()?.len();
    let window = (MAX_RECORD_BYTES as u64 + 1).min(len);
    let start = len - window;
    let mut tail = vec![0u8; window as usize];
    file.seek(SeekFrom::Start(start))?;
    file.read_exact(&mut tail)?;
    if tail.last().is_none_or(|b| *b == b'\n') {
        return Ok(());
    }
    let line_start = tail.iter().rposition(|b| *b == b'\n').map_or(0, |p| p + 1);
    let partial = &tail[line_start..];
    let complete = std::str::from_utf8(partial)
        .ok()
        .is_some_and(|text| Record::from_line(text).is_ok());
    if complete {
        file.write_all(b"\n")?;
    } else if line_start > 0 || start == 0 {
        file.set_len(start + line_start as u64)?;
    } else {
        // A single line longer than any record: leave it for verification to report.
        return Ok(());
    }
    file.sync_data()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A log of `records` records (genesis and `records - 1` appends), and its records.
    fn log_of(dir: &Path, records: u64) -> (AuditLog, Vec<Record>) {
        let path = dir.join("a.jsonl");
        let mut log = AuditLog::create(&path, AuditKey::from_seed([3; 32]), "a").unwrap();
        for n in 1..records {
            log.append("a", "note", serde_json::json!({"n": n}))
                .unwrap();
        }
        let all = log.records().unwrap();
        assert_eq!(all.len() as u64, records);
        (log, all)
    }

    /// Replaces the line of record `seq` with text of the same length.
    fn overwrite_line(path: &Path, seq: usize, with: impl Fn(&str) -> String) {
        let text = std::fs::read_to_string(path).unwrap();
        let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
        let changed = with(&lines[seq]);
        assert_eq!(changed.len(), lines[seq].len());
        lines[seq] = changed;
        std::fs::write(path, lines.join("\n") + "\n").unwrap();
    }

    #[test]
    fn a_record_read_by_its_seq_is_the_record_in_the_file_before_and_after_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let records = 3 * MARK_EVERY + 5;
        let (mut log, all) = log_of(dir.path(), records);
        let every: Vec<u64> = (0..records).collect();
        let want: Vec<Option<Record>> = all.iter().cloned().map(Some).collect();
        assert_eq!(log.records_at(&every).unwrap(), want);
        // Out of order, repeated, and past the head.
        let mixed = [300, 2, 2, 129, 128, 127, records - 1, records, u64::MAX];
        let read = log.records_at(&mixed).unwrap();
        for (seq, record) in mixed.iter().zip(&read) {
            assert_eq!(record.as_ref(), all.get(*seq as usize), "seq {seq}");
        }
        // Appends keep the marks: a record written after opening reads back too.
        let appended = log
            .append("a", "note", serde_json::json!({"late": true}))
            .unwrap();
        assert_eq!(log.records_at(&[records]).unwrap(), [Some(appended)]);
        drop(log);
        let log = AuditLog::open(dir.path().join("a.jsonl"), AuditKey::from_seed([3; 32])).unwrap();
        assert_eq!(log.records_at(&every).unwrap(), want);
    }

    /// The marks count the file as opened: after a partial last line was cut, after a
    /// complete last record got its missing newline, and with lines ending in CRLF.
    #[test]
    fn marks_hold_after_a_repaired_tail_and_with_crlf_lines() {
        let key = AuditKey::from_seed([3; 32]);
        for case in ["partial line", "no newline", "crlf"] {
            let dir = tempfile::tempdir().unwrap();
            let records = MARK_EVERY + 10;
            let (log, all) = log_of(dir.path(), records);
            drop(log);
            let path = dir.path().join("a.jsonl");
            let text = std::fs::read_to_string(&path).unwrap();
            let changed = match case {
                "partial line" => text.clone() + "{\"seq\":",
                "no newline" => text.trim_end_matches('\n').to_string(),
                _ => text.replace('\n', "\r\n"),
            };
            std::fs::write(&path, changed).unwrap();
            let mut log = AuditLog::open(&path, key.clone()).unwrap();
            let every: Vec<u64> = (0..records).collect();
            let read = log.records_at(&every).unwrap();
            assert_eq!(
                read,
                all.iter().cloned().map(Some).collect::<Vec<_>>(),
                "{case}"
            );
            let next = log
                .append("a", "note", serde_json::json!({"after": case}))
                .unwrap();
            assert_eq!(log.records_at(&[records]).unwrap(), [Some(next)], "{case}");
        }
    }

    /// A batch that does not continue the head is refused before anything is written.
    #[test]
    fn records_that_do_not_extend_the_head_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (mut log, all) = log_of(dir.path(), 5);
        let before = std::fs::read(dir.path().join("a.jsonl")).unwrap();
        // The right seq, the wrong prev_hash.
        let mut forged = all[4].clone();
        forged.seq = 5;
        for batch in [
            &all[4..5],
            &all[0..1],
            &[all[3].clone(), all[3].clone()][..],
            std::slice::from_ref(&forged),
        ] {
            let error = log.write_records(batch).unwrap_err();
            assert!(matches!(error, AuditError::NotExtending(_)), "{error}");
        }
        assert_eq!(std::fs::read(dir.path().join("a.jsonl")).unwrap(), before);
    }

    /// Reading one record scans from the mark before it, not the file: a line damaged
    /// far before it does not stop it (it would stop a whole read), while the damaged
    /// record itself, or one whose line holds another seq, is an error.
    #[test]
    fn a_read_by_seq_reads_from_the_mark_before_it_and_checks_what_it_reads() {
        let dir = tempfile::tempdir().unwrap();
        let (log, all) = log_of(dir.path(), 2 * MARK_EVERY + 10);
        let path = dir.path().join("a.jsonl");
        overwrite_line(&path, 3, |line| line.replacen('{', "x", 1));
        assert!(log.records().is_err());
        let late = 2 * MARK_EVERY + 4;
        assert_eq!(
            log.records_at(&[late]).unwrap(),
            [Some(all[late as usize].clone())]
        );
        let error = log.records_at(&[3]).unwrap_err().to_string();
        assert!(error.contains("malformed record"), "{error}");
        // A line moved: its place holds another seq.
        let text = std::fs::read_to_string(&path).unwrap();
        let mut lines: Vec<&str> = text.lines().collect();
        lines.swap(200, 201);
        std::fs::write(&path, lines.join("\n") + "\n").unwrap();
        let error = log.records_at(&[200]).unwrap_err().to_string();
        assert!(error.contains("holds seq 201"), "{error}");
    }
}
