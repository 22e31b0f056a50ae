//! Verification of a `lineage-audit-v1` log, one record at a time.
//!
//! [`Verifier`] holds only the previous hash and a few counters, so a log of any length
//! verifies in constant memory. [`verify_reader`] and [`verify_file`] split input on `\n`
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
        let line_no = self.count + 1;
        let text = std::str::from_utf8(line).map_err(|e| {
            VerifyFailure::at(
                line_no,
                None,
                format!("malformed record: invalid UTF-8: {e}"),
            )
        })?;
        let record = Record::from_line(text)
            .map_err(|e| VerifyFailure::at(line_no, None, format!("malformed record: {e}")))?;
        self.push(&record)?;
        Ok(record)
    }

    /// Verifies the next record.
    pub fn push(&mut self, record: &Record) -> Result<(), VerifyFailure> {
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
        let recomputed = record.recompute_hash();
        if hex::encode(recomputed) != record.hash {
            return Err(fail("hash does not match record content".into()));
        }
        let mut signature = [0u8; 64];
        if hex::decode_to_slice(&record.signature, &mut signature).is_err() {
            return Err(fail("signature is malformed".into()));
        }
        let key = match &self.key {
            Some(key) => key,
            // A genesis key that does not decode cannot verify anything.
            None => return Err(fail("signature is invalid".into())),
        };
        if key
            .verify_strict(&recomputed, &Signature::from_bytes(&signature))
            .is_err()
        {
            return Err(fail("signature is invalid".into()));
        }
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

/// Verifies a log from any reader, in constant memory.
pub fn verify_reader(reader: impl Read, options: &VerifyOptions) -> VerifyReport {
    let mut reader = BufReader::with_capacity(64 * 1024, reader);
    let mut verifier = Verifier::new(options.clone());
    let mut line = Vec::new();
    loop {
        match read_line_bounded(&mut reader, &mut line, MAX_RECORD_BYTES) {
            Ok(false) => break,
            Ok(true) => {
                if let Err(failure) = verifier.push_line(&line) {
                    return verifier.report(Some(failure));
                }
            }
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

/// Verifies a log file.
pub fn verify_file(path: impl AsRef<Path>, options: &VerifyOptions) -> VerifyReport {
    match std::fs::File::open(path.as_ref()) {
        Ok(file) => verify_reader(file, options),
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
