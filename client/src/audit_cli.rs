//! `lineage audit …`: key files and offline verification of `lineage-audit-v1` logs.
//!
//! Each command returns its exit code and writes to the given streams, so tests drive
//! it in-process as well as through the binary. Exit codes: 0 valid, 1 verification
//! failed, 2 usage or I/O error.

use std::io::Write;
use std::path::Path;

use lineage_core::canonical::{depth, MAX_VALUE_DEPTH};
use lineage_core::record::{Head, Record, MAX_RECORD_BYTES};
use lineage_core::verify::{read_line_bounded, verify_file_with, BatchVerifier, VerifyOptions};

/// When `audit verify` starts saying how far it has got, and how often.
const PROGRESS_AFTER: std::time::Duration = std::time::Duration::from_secs(2);
const PROGRESS_EVERY: std::time::Duration = std::time::Duration::from_secs(1);
use crate::terminal_text::printable;
use lineage_core::{AuditKey, AuditLog};

pub const EXIT_OK: i32 = 0;
pub const EXIT_FAILED: i32 = 1;
pub const EXIT_USAGE: i32 = 2;

/// `keygen PATH`: a new signing key file (0600), never overwriting one.
pub fn keygen(path: &Path, out: &mut dyn Write, err: &mut dyn Write) -> i32 {
    match AuditKey::create(path) {
        Ok(key) => {
            let _ = writeln!(out, "secret key written to {}", path.display());
            let _ = writeln!(out, "public key: {}", key.public_key_hex());
            EXIT_OK
        }
        Err(e) => fail_usage(err, e),
    }
}

/// `pubkey PATH`: the public key of a signing key file.
pub fn pubkey(path: &Path, out: &mut dyn Write, err: &mut dyn Write) -> i32 {
    match AuditKey::load(path) {
        Ok(key) => {
            let _ = writeln!(out, "{}", key.public_key_hex());
            EXIT_OK
        }
        Err(e) => fail_usage(err, e),
    }
}

/// `append LOG --key K --actor A --kind K [--payload JSON]`: one durable signed record;
/// prints the new head as `seq:hash`.
pub fn append(
    log: &Path,
    key: &Path,
    actor: &str,
    kind: &str,
    payload: Option<&str>,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> i32 {
    let payload = match payload {
        None => serde_json::Value::Object(Default::default()),
        Some(text) => match serde_json::from_str::<serde_json::Value>(text) {
            Ok(value) if depth(&value) <= MAX_VALUE_DEPTH => value,
            Ok(_) => {
                return fail_usage(
                    err,
                    format!("--payload is nested deeper than {MAX_VALUE_DEPTH} levels"),
                )
            }
            Err(e) => return fail_usage(err, format!("--payload is not valid JSON: {e}")),
        },
    };
    if kind == "genesis" {
        return fail_usage(err, "kind 'genesis' is reserved for the first record");
    }
    let key = match AuditKey::load(key) {
        Ok(key) => key,
        Err(e) => return fail_usage(err, e),
    };
    let log_id = log
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut audit_log = match AuditLog::open_or_create(log, key, &log_id) {
        Ok(l) => l,
        Err(e) => return fail_usage(err, e),
    };
    match audit_log.append(actor, kind, payload) {
        Ok(record) => {
            let _ = writeln!(out, "{}", record.head());
            EXIT_OK
        }
        Err(e) => fail_usage(err, e),
    }
}

/// `verify LOG [--public-key HEX] [--checkpoint SEQ:HASH] [--json]`.
pub fn verify(
    log: &Path,
    public_key: Option<&str>,
    checkpoint: Option<&str>,
    json: bool,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> i32 {
    let checkpoint = match checkpoint.map(str::parse::<Head>).transpose() {
        Ok(c) => c,
        Err(e) => return fail_usage(err, e),
    };
    if let Some(key) = public_key {
        if lineage_core::keys::parse_public_key(key).is_none() {
            return fail_usage(
                err,
                "--public-key must be 64 hex characters (an Ed25519 key)",
            );
        }
    }
    if let Err(e) = std::fs::metadata(log) {
        return fail_usage(err, format!("cannot open log {}: {e}", log.display()));
    }
    if is_api_page(log) {
        return fail_usage(
            err,
            format!(
                "{} is an API page (the JSON that GET /v1/agents/ID/log answers), not a log \
                 file; nothing was verified. Fetch the signed lines with \
                 `lineage audit fetch AGENT > AGENT.jsonl` and verify that file",
                log.display()
            ),
        );
    }
    if public_key.is_none() {
        let _ = writeln!(
            err,
            "warning: no --public-key given: this only shows the log is self-consistent, \
             not that the key you trust signed it"
        );
    }
    // A long log says how far it has got, once a second after the first two (stderr).
    let started = std::time::Instant::now();
    let mut last_said = started;
    let report = verify_file_with(
        log,
        &VerifyOptions {
            public_key: public_key.map(str::to_string),
            checkpoint,
        },
        BatchVerifier::all_cores(),
        |records| {
            let now = std::time::Instant::now();
            if now.duration_since(started) >= PROGRESS_AFTER
                && now.duration_since(last_said) >= PROGRESS_EVERY
            {
                last_said = now;
                let rate = records as f64 / now.duration_since(started).as_secs_f64();
                let _ = writeln!(err, "verified {records} records ({rate:.0}/s)...");
            }
        },
    );
    if json {
        let _ = writeln!(
            out,
            "{}",
            serde_json::to_string_pretty(&report).unwrap_or_default()
        );
    } else if let Some(failure) = &report.failure {
        let _ = writeln!(out, "FAILED  {}", printable(&failure.to_string()));
    } else {
        let _ = writeln!(
            out,
            "OK  {} records, log {}",
            report.records,
            report.log_id.as_deref().unwrap_or("?")
        );
        if let Some(head) = &report.head {
            let _ = writeln!(out, "    head       {head}");
        }
        let _ = writeln!(
            out,
            "    public key {}",
            report.public_key.as_deref().unwrap_or("?")
        );
    }
    if report.ok {
        EXIT_OK
    } else {
        EXIT_FAILED
    }
}

/// `show LOG [--json]`: the records as a table, or as JSON Lines. Does not verify.
pub fn show(log: &Path, json: bool, out: &mut dyn Write, err: &mut dyn Write) -> i32 {
    let file = match std::fs::File::open(log) {
        Ok(f) => f,
        Err(e) => return fail_usage(err, format!("cannot open log {}: {e}", log.display())),
    };
    let mut reader = std::io::BufReader::new(file);
    let mut line = Vec::new();
    let mut number = 0u64;
    if !json {
        let _ = writeln!(
            out,
            "{:>5}  {:<27}  {:<16}  {:<18}  payload",
            "seq", "timestamp", "actor", "kind"
        );
    }
    loop {
        match read_line_bounded(&mut reader, &mut line, MAX_RECORD_BYTES) {
            Ok(false) => return EXIT_OK,
            Ok(true) => number += 1,
            Err(e) => return fail_usage(err, format!("line {}: {e}", number + 1)),
        }
        let record = match std::str::from_utf8(&line)
            .map_err(|e| e.to_string())
            .and_then(|t| Record::from_line(t).map_err(|e| e.to_string()))
        {
            Ok(r) => r,
            Err(e) => return fail_usage(err, format!("line {number}: malformed record: {e}")),
        };
        let _ = if json {
            writeln!(out, "{}", record.to_line())
        } else {
            // From a file nothing has verified: every field shown as text only.
            writeln!(
                out,
                "{:>5}  {:<27}  {:<16}  {:<18}  {}",
                record.seq,
                printable(&record.timestamp),
                printable(&record.actor),
                printable(&record.kind),
                printable(&lineage_core::canonical::to_string(&record.payload))
            )
        };
    }
}

/// Whether the file holds a page of the log API (`{"head": …, "records": [...]}`, on one
/// line or pretty-printed) rather than one record per line: verifying it would report a
/// malformed record, which reads like tampering.
fn is_api_page(log: &Path) -> bool {
    const PAGE_PEEK_BYTES: u64 = 64 * 1024 * 1024;
    let Ok(file) = std::fs::File::open(log) else {
        return false;
    };
    let mut first = Vec::new();
    if !matches!(
        read_line_bounded(
            &mut std::io::BufReader::new(&file),
            &mut first,
            MAX_RECORD_BYTES
        ),
        Ok(true)
    ) {
        return false;
    }
    let first = String::from_utf8_lossy(&first);
    if Record::from_line(&first).is_ok() {
        return false;
    }
    let is_page = |value: &serde_json::Value| {
        value
            .get("records")
            .is_some_and(serde_json::Value::is_array)
    };
    if let Ok(value) = serde_json::from_str::<serde_json::Value>(&first) {
        return is_page(&value);
    }
    // Pretty-printed: the whole document, if it is of a size a page can have.
    use std::io::Read;
    let mut text = String::new();
    let read =
        std::fs::File::open(log).and_then(|f| f.take(PAGE_PEEK_BYTES).read_to_string(&mut text));
    read.is_ok()
        && serde_json::from_str::<serde_json::Value>(&text).is_ok_and(|value| is_page(&value))
}

fn fail_usage(err: &mut dyn Write, message: impl std::fmt::Display) -> i32 {
    let _ = writeln!(err, "error: {message}");
    EXIT_USAGE
}
