//! Verification of a `lineage-audit-v1` log, one record at a time.
//!
//! [`Verifier`] holds only the previous hash and a few counters, so a log of any length
//! verifies in constant memory. [`BatchVerifier`] gives the same verdicts with each batch's
//! hashes and signatures checked on several cores. [`verify_reader`] and [`verify_file`] split input on `\n`
//! only (U+2028 may appear raw inside a record) and bound the length of a line.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use ed25519_dalek::{Signature, VerifyingKey};
use serde::{Deserialize, Serialize};

use crate::guard::RecordKind;
use crate::keys::parse_public_key;
use crate::record::{Head, Record, MAX_RECORD_BYTES, ZERO_HASH};

/// Where and why verification failed. `line` is 1-based.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerifyFailure {
    pub line: Option<u64>,
    pub seq: Option<u64>,
    pub reason: String,
}

impl VerifyFailure {
    fn at(line: u64, seq: Option<u64>, reason: impl Into<String>) -> Self {
        VerifyFailure {
            line: Some(line),
            seq,
            reason: reason.into(),
        }
    }

    fn whole_log(reason: impl Into<String>) -> Self {
        VerifyFailure {
            line: None,
            seq: None,
            reason: reason.into(),
        }
    }
}

impl std::fmt::Display for VerifyFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.line, self.seq) {
            (Some(line), Some(seq)) => write!(f, "line {line} (seq {seq}): {}", self.reason),
            (Some(line), None) => write!(f, "line {line}: {}", self.reason),
            _ => f.write_str(&self.reason),
        }
    }
}

impl std::error::Error for VerifyFailure {}

/// What to hold the log to, beyond its own consistency.
#[derive(Clone, Debug, Default)]
pub struct VerifyOptions {
    /// The key the genesis record must declare (hex, case-insensitive).
    pub public_key: Option<String>,
    /// A head published earlier: the record at that seq must exist with that hash.
    pub checkpoint: Option<Head>,
}

/// The outcome of verifying a whole log.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerifyReport {
    pub ok: bool,
    pub records: u64,
    pub log_id: Option<String>,
    pub public_key: Option<String>,
    pub key_trusted: bool,
    pub head: Option<Head>,
    pub failure: Option<VerifyFailure>,
}

/// Checks records in order; feed each with [`Verifier::push`], then call
/// [`Verifier::finish`].
#[derive(Debug)]
pub struct Verifier {
    options: VerifyOptions,
    trusted_key: Option<String>,
    key: Option<VerifyingKey>,
    count: u64,
    prev_hash: String,
    log_id: Option<String>,
    public_key: Option<String>,
    checkpoint_seen: bool,
}

impl Verifier {
    pub fn new(options: VerifyOptions) -> Self {
        let trusted_key = options
            .public_key
            .as_ref()
            .map(|k| k.trim().to_ascii_lowercase());
        Verifier {
            options,
            trusted_key,
            key: None,
            count: 0,
            prev_hash: ZERO_HASH.to_string(),
            log_id: None,
            public_key: None,
            checkpoint_seen: false,
        }
    }

    /// Verifies the next record's line. On failure the verifier must not be used again.
    pub fn push_line(&mut self, line: &[u8]) -> Result<Record, VerifyFailure> {
        let record =
            parse_line(line).map_err(|reason| VerifyFailure::at(self.count + 1, None, reason))?;
        self.push(&record)?;
        Ok(record)
    }

    /// Verifies the next record.
    pub fn push(&mut self, record: &Record) -> Result<(), VerifyFailure> {
        self.check_chain(record)?;
        let content = self.check_content(record);
        self.accept(record, content)
    }

    /// The checks that need the records before this one: genesis, seq, prev_hash.
    fn check_chain(&mut self, record: &Record) -> Result<(), VerifyFailure> {
        let index = self.count;
        let line = index + 1;
        let fail = |reason: String| VerifyFailure::at(line, Some(record.seq), reason);
        if index == 0 {
            if record.kind != RecordKind::Genesis.as_str() {
                return Err(fail("first record is not a genesis record".into()));
            }
            let declared = match record.payload.get("public_key").and_then(|k| k.as_str()) {
                Some(k) => k.to_string(),
                None => return Err(fail("genesis record has no public_key".into())),
            };
            if let Some(trusted) = &self.trusted_key {
                if declared.trim().to_ascii_lowercase() != *trusted {
                    return Err(fail(
                        "log declares a different public key than the trusted one".into(),
                    ));
                }
            }
            self.key = parse_public_key(&declared);
            self.log_id = record
                .payload
                .get("log_id")
                .and_then(|v| v.as_str())
                .map(str::to_string);
            self.public_key = Some(declared);
        }
        if record.seq != index {
            return Err(fail(format!("expected seq {index}, found {}", record.seq)));
        }
        if index > 0 && record.kind == RecordKind::Genesis.as_str() {
            return Err(fail("genesis record after start of log".into()));
        }
        if record.prev_hash != self.prev_hash {
            return Err(fail("prev_hash does not match previous record".into()));
        }
        Ok(())
    }

    /// The checks of one record alone (its hash and signature), given the log's key:
    /// the costly part, which [`BatchVerifier`] runs on several cores.
    fn check_content(&self, record: &Record) -> Result<(), String> {
        content_check(self.key.as_ref(), record)
    }

    /// Ends a record's verification: its content verdict, then the checkpoint.
    fn accept(
        &mut self,
        record: &Record,
        content: Result<(), String>,
    ) -> Result<(), VerifyFailure> {
        let fail = |reason: String| VerifyFailure::at(self.count + 1, Some(record.seq), reason);
        content.map_err(fail)?;
        if let Some(checkpoint) = &self.options.checkpoint {
            if checkpoint.seq == record.seq {
                if !checkpoint.hash.eq_ignore_ascii_case(&record.hash) {
                    return Err(fail(
                        "record at checkpoint has a different hash (history rewritten)".into(),
                    ));
                }
                self.checkpoint_seen = true;
            }
        }
        self.prev_hash.clone_from(&record.hash);
        self.count += 1;
        Ok(())
    }

    /// Checks what can only be checked at the end: emptiness and the checkpoint.
    pub fn finish(&self) -> Result<(), VerifyFailure> {
        if self.count == 0 {
            return Err(VerifyFailure::whole_log("log is empty"));
        }
        if self.options.checkpoint.is_some() && !self.checkpoint_seen {
            return Err(VerifyFailure::whole_log(format!(
                "log ends at seq {} before checkpoint (truncated)",
                self.count - 1
            )));
        }
        Ok(())
    }

    /// Records verified so far.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// The last verified record's seq and hash.
    pub fn head(&self) -> Option<Head> {
        (self.count > 0).then(|| Head {
            seq: self.count - 1,
            hash: self.prev_hash.clone(),
        })
    }

    fn report(&self, failure: Option<VerifyFailure>) -> VerifyReport {
        VerifyReport {
            ok: failure.is_none(),
            records: self.count,
            log_id: self.log_id.clone(),
            public_key: self.public_key.clone(),
            key_trusted: self.trusted_key.is_some(),
            head: self.head(),
            failure,
        }
    }
}

/// A record's own hash and its signature under `key` (strict Ed25519), as verification
/// checks every record: for callers that take records one by one (an import's apply).
pub fn check_signature(record: &Record, key: &VerifyingKey) -> Result<(), String> {
    content_check(Some(key), record)
}

/// A record's own hash and signature, under the log's key (`None`: the genesis key did
/// not decode, so nothing verifies).
fn content_check(key: Option<&VerifyingKey>, record: &Record) -> Result<(), String> {
    let recomputed = record.recompute_hash();
    if hex::encode(recomputed) != record.hash {
        return Err("hash does not match record content".into());
    }
    let mut signature = [0u8; 64];
    if hex::decode_to_slice(&record.signature, &mut signature).is_err() {
        return Err("signature is malformed".into());
    }
    let Some(key) = key else {
        return Err("signature is invalid".into());
    };
    key.verify_strict(&recomputed, &Signature::from_bytes(&signature))
        .map_err(|_| "signature is invalid".to_string())
}

/// [`Verifier`] for lines that come in batches: each batch's parsing, hashes and signatures
/// (about 50 µs a record for strict Ed25519 alone) are checked on up to `threads` cores,
/// then its chain in order. The verdict, and the first failure, are the same as
/// [`Verifier`]'s record for record; memory holds one batch.
#[derive(Debug)]
pub struct BatchVerifier {
    inner: Verifier,
    threads: usize,
    /// Run first on each worker thread (a node lowers the workers' priority with it).
    worker_start: fn(),
}

/// Records a reader gathers into one batch (and at most 8 MiB of lines).
pub const BATCH_RECORDS: usize = 2_048;
const BATCH_BYTES: usize = 8 * 1024 * 1024;

impl BatchVerifier {
    /// `threads`: how many cores to use (at least 1).
    pub fn new(options: VerifyOptions, threads: usize) -> Self {
        BatchVerifier {
            inner: Verifier::new(options),
            threads: threads.max(1),
            worker_start: || {},
        }
    }

    /// Calls `start` first on every worker thread this verifier spawns: a server uses it
    /// to run the workers below its request threads' priority, so that a long
    /// verification takes idle cores but never the ones its writes need.
    pub fn with_worker_start(mut self, start: fn()) -> Self {
        self.worker_start = start;
        self
    }

    /// All of this machine's cores.
    pub fn all_cores() -> usize {
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    }

    /// Verifies the next lines (each a record without its newline). Each worker parses
    /// its lines and checks their hashes and signatures in one pass, so the cores do not
    /// wait for one another between parsing and checking.
    pub fn push_lines(&mut self, lines: &[impl AsRef<[u8]> + Sync]) -> Result<(), VerifyFailure> {
        let mut rest = lines;
        // The genesis record names the key every later signature is checked against.
        if self.inner.count == 0 {
            let Some((first, later)) = rest.split_first() else {
                return Ok(());
            };
            self.inner.push_line(first.as_ref())?;
            rest = later;
        }
        let key = self.inner.key;
        let verdicts = parallel_map(rest, self.threads, self.worker_start, |line| {
            let record = parse_line(line.as_ref())?;
            let content = content_check(key.as_ref(), &record);
            Ok::<_, String>((record, content))
        });
        // In log order: an earlier failure wins, and a malformed line fails only once
        // everything before it is verified.
        for verdict in verdicts {
            let (record, content) =
                verdict.map_err(|reason| VerifyFailure::at(self.inner.count + 1, None, reason))?;
            self.inner.check_chain(&record)?;
            self.inner.accept(&record, content)?;
        }
        Ok(())
    }

    pub fn finish(&self) -> Result<(), VerifyFailure> {
        self.inner.finish()
    }

    pub fn count(&self) -> u64 {
        self.inner.count()
    }

    pub fn report(&self, failure: Option<VerifyFailure>) -> VerifyReport {
        self.inner.report(failure)
    }
}

/// One record's line (without its newline), or why it is malformed.
fn parse_line(line: &[u8]) -> Result<Record, String> {
    let text =
        std::str::from_utf8(line).map_err(|e| format!("malformed record: invalid UTF-8: {e}"))?;
    Record::from_line(text).map_err(|e| format!("malformed record: {e}"))
}

/// `f` over `items` on up to `threads` scoped threads, each calling `worker_start`
/// first, results in order. Workers take blocks of `BLOCK` items as they finish the
/// last, so one that is slowed (a busy core) does not leave the others waiting.
fn parallel_map<T: Sync, R: Send>(
    items: &[T],
    threads: usize,
    worker_start: fn(),
    f: impl Fn(&T) -> R + Sync,
) -> Vec<R> {
    const BLOCK: usize = 16;
    let blocks = items.len().div_ceil(BLOCK);
    // Always on workers, even one, so the hook holds for every item.
    let threads = threads.min(blocks).max(1);
    let next_block = std::sync::atomic::AtomicUsize::new(0);
    let (f, next_block) = (&f, &next_block);
    let mut done: Vec<(usize, Vec<R>)> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(move || {
                    worker_start();
                    let mut mine = Vec::new();
                    loop {
                        let block = next_block.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let start = block * BLOCK;
                        if start >= items.len() {
                            return mine;
                        }
                        let part = &items[start..(start + BLOCK).min(items.len())];
                        mine.push((block, part.iter().map(f).collect::<Vec<R>>()));
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    done.sort_unstable_by_key(|(block, _)| *block);
    done.into_iter().flat_map(|(_, results)| results).collect()
}

/// Reads the next `\n`-terminated line into `buf` (without the newline), refusing
/// lines longer than `max_bytes`. Returns `Ok(false)` at end of input.
pub fn read_line_bounded(
    reader: &mut impl BufRead,
    buf: &mut Vec<u8>,
    max_bytes: usize,
) -> std::io::Result<bool> {
    buf.clear();
    let mut limited = reader.take(max_bytes as u64 + 1);
    let n = limited.read_until(b'\n', buf)?;
    if n == 0 {
        return Ok(false);
    }
    if buf.last() == Some(&b'\n') {
        buf.pop();
    } else if buf.len() > max_bytes {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("line exceeds {max_bytes} bytes"),
        ));
    }
    Ok(true)
}

/// Verifies a log from any reader on all cores, in memory bounded by one batch.
pub fn verify_reader(reader: impl Read, options: &VerifyOptions) -> VerifyReport {
    verify_reader_with(reader, options, BatchVerifier::all_cores(), |_| {})
}

/// [`verify_reader`] on `threads` cores, calling `progress` with the records verified
/// after each batch.
pub fn verify_reader_with(
    reader: impl Read,
    options: &VerifyOptions,
    threads: usize,
    mut progress: impl FnMut(u64),
) -> VerifyReport {
    let mut reader = BufReader::with_capacity(64 * 1024, reader);
    let mut verifier = BatchVerifier::new(options.clone(), threads);
    let mut batch: Vec<Vec<u8>> = Vec::with_capacity(BATCH_RECORDS);
    let mut batch_bytes = 0;
    let mut line = Vec::new();
    loop {
        let read = read_line_bounded(&mut reader, &mut line, MAX_RECORD_BYTES);
        let at_end = !matches!(read, Ok(true));
        if let Ok(true) = read {
            batch_bytes += line.len();
            batch.push(std::mem::take(&mut line));
        }
        if at_end || batch.len() >= BATCH_RECORDS || batch_bytes >= BATCH_BYTES {
            if let Err(failure) = verifier.push_lines(&batch) {
                return verifier.report(Some(failure));
            }
            batch.clear();
            batch_bytes = 0;
            progress(verifier.count());
        }
        match read {
            Ok(true) => {}
            Ok(false) => break,
            Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                let failure =
                    VerifyFailure::at(verifier.count() + 1, None, format!("malformed record: {e}"));
                return verifier.report(Some(failure));
            }
            Err(e) => {
                return verifier.report(Some(VerifyFailure::whole_log(format!("read error: {e}"))))
            }
        }
    }
    let failure = verifier.finish().err();
    verifier.report(failure)
}

/// Verifies a log file on all cores.
pub fn verify_file(path: impl AsRef<Path>, options: &VerifyOptions) -> VerifyReport {
    verify_file_with(path, options, BatchVerifier::all_cores(), |_| {})
}

/// [`verify_file`] on `threads` cores, with `progress` called after each batch.
pub fn verify_file_with(
    path: impl AsRef<Path>,
    options: &VerifyOptions,
    threads: usize,
    progress: impl FnMut(u64),
) -> VerifyReport {
    match std::fs::File::open(path.as_ref()) {
        Ok(file) => verify_reader_with(file, options, threads, progress),
        Err(e) => Verifier::new(options.clone()).report(Some(VerifyFailure::whole_log(format!(
            "cannot open log: {e}"
        )))),
    }
}

/// Verifies records already in memory (for example from the HTTP API).
pub fn verify_records(records: &[Record], options: &VerifyOptions) -> VerifyReport {
    let mut verifier = Verifier::new(options.clone());
    for record in records {
        if let Err(failure) = verifier.push(record) {
            return verifier.report(Some(failure));
        }
    }
    let failure = verifier.finish().err();
    verifier.report(failure)
}
