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
use std::io::{self, BufReader, Seek, SeekFrom, Write};
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
}

pub struct AuditLog {
    path: PathBuf,
    file: File,
    key: AuditKey,
    log_id: String,
    head: Head,
    last_timestamp_micros: i64,
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
    pub fn write_records(&mut self, records: &[Record]) -> Result<(), AuditError> {
        // Every line is checked to read back as the record it holds before any is
        // written, so a batch is written whole or not at all.
        let mut text = String::new();
        for record in records {
            let (line, _) = record.to_checked_line()?;
            text.push_str(&line);
            text.push('\n');
        }
        self.file
            .write_all(text.as_bytes())
            .map_err(io_error(&self.path))?;
        self.file.sync_data().map_err(io_error(&self.path))?;
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
