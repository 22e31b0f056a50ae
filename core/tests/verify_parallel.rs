//! The batched, multi-core verifier gives the sequential verifier's verdict, first failure
//! included, on intact logs and on tampered ones, however the log is cut into batches.

use lineage_core::verify::{
    verify_reader_with, BatchVerifier, Verifier, VerifyOptions, VerifyReport,
};
use lineage_core::{AuditKey, AuditLog};
use proptest::prelude::*;

const RECORDS: usize = 300;

/// A signed log of `RECORDS` records, as lines.
fn log_lines() -> Vec<Vec<u8>> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("log.jsonl");
    let mut log = AuditLog::create(&path, AuditKey::from_seed([4; 32]), "bot").unwrap();
    for n in 1..RECORDS {
        log.append(
            "bot",
            "note",
            serde_json::json!({"n": n, "text": "x".repeat(n % 40)}),
        )
        .unwrap();
    }
    std::fs::read(&path)
        .unwrap()
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .map(<[u8]>::to_vec)
        .collect()
}

/// The reference: one record at a time.
fn sequential(lines: &[Vec<u8>], options: &VerifyOptions) -> (bool, u64, Option<String>) {
    let mut verifier = Verifier::new(options.clone());
    for line in lines {
        if let Err(failure) = verifier.push_line(line) {
            return (false, verifier.count(), Some(failure.to_string()));
        }
    }
    match verifier.finish() {
        Ok(()) => (true, verifier.count(), None),
        Err(failure) => (false, verifier.count(), Some(failure.to_string())),
    }
}

fn batched(
    lines: &[Vec<u8>],
    options: &VerifyOptions,
    cuts: &[usize],
) -> (bool, u64, Option<String>) {
    let mut verifier = BatchVerifier::new(options.clone(), 4);
    let mut start = 0;
    for &cut in cuts.iter().chain(std::iter::once(&lines.len())) {
        let end = cut.clamp(start, lines.len());
        if let Err(failure) = verifier.push_lines(&lines[start..end]) {
            return (false, verifier.count(), Some(failure.to_string()));
        }
        start = end;
    }
    match verifier.finish() {
        Ok(()) => (true, verifier.count(), None),
        Err(failure) => (false, verifier.count(), Some(failure.to_string())),
    }
}

fn summary(report: &VerifyReport) -> (bool, u64, Option<String>) {
    (
        report.ok,
        report.records,
        report.failure.as_ref().map(ToString::to_string),
    )
}

#[derive(Clone, Debug)]
enum Tamper {
    FlipBit { line: usize, byte: usize, bit: u8 },
    Delete { line: usize },
    Swap { a: usize, b: usize },
    Duplicate { line: usize },
    Truncate { line: usize, keep: usize },
}

fn tamper() -> impl Strategy<Value = Tamper> {
    prop_oneof![
        (0..RECORDS, 0..400usize, 0..8u8).prop_map(|(line, byte, bit)| Tamper::FlipBit {
            line,
            byte,
            bit
        }),
        (0..RECORDS).prop_map(|line| Tamper::Delete { line }),
        (0..RECORDS, 0..RECORDS).prop_map(|(a, b)| Tamper::Swap { a, b }),
        (0..RECORDS).prop_map(|line| Tamper::Duplicate { line }),
        (0..RECORDS, 0..400usize).prop_map(|(line, keep)| Tamper::Truncate { line, keep }),
    ]
}

/// Applies one tamper. Indexes are taken modulo the lines there are now: an earlier
/// tamper may have deleted one (or emptied a line), and a tamper must never panic.
fn apply(lines: &mut Vec<Vec<u8>>, tamper: &Tamper) {
    if lines.is_empty() {
        return;
    }
    let n = lines.len();
    match *tamper {
        Tamper::FlipBit { line, byte, bit } => {
            let l = &mut lines[line % n];
            if !l.is_empty() {
                let i = byte % l.len();
                l[i] ^= 1 << bit;
            }
        }
        Tamper::Delete { line } => {
            lines.remove(line % n);
        }
        Tamper::Swap { a, b } => lines.swap(a % n, b % n),
        Tamper::Duplicate { line } => {
            let copy = lines[line % n].clone();
            lines.insert(line % n, copy);
        }
        Tamper::Truncate { line, keep } => {
            let l = &mut lines[line % n];
            if !l.is_empty() {
                l.truncate(keep % l.len());
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn batches_give_the_sequential_verdict(
        tampers in proptest::collection::vec(tamper(), 0..3),
        mut cuts in proptest::collection::vec(0..RECORDS, 0..6),
        trust_key in any::<bool>(),
    ) {
        let mut lines = log_lines();
        for t in &tampers {
            apply(&mut lines, t);
        }
        cuts.sort_unstable();
        let options = VerifyOptions {
            public_key: trust_key.then(|| AuditKey::from_seed([4; 32]).public_key_hex().to_string()),
            checkpoint: None,
        };
        let expected = sequential(&lines, &options);
        prop_assert_eq!(batched(&lines, &options, &cuts), expected.clone());
        // The reader path too (its own batching), on one core and on four.
        let text: Vec<u8> = lines.iter().flat_map(|l| l.iter().copied().chain([b'\n'])).collect();
        for threads in [1, 4] {
            let report = verify_reader_with(&text[..], &options, threads, |_| {});
            prop_assert_eq!(summary(&report), expected.clone());
        }
    }
}

#[test]
fn an_intact_log_verifies_in_batches_with_progress() {
    let lines = log_lines();
    let text: Vec<u8> = lines
        .iter()
        .flat_map(|l| l.iter().copied().chain([b'\n']))
        .collect();
    let mut seen = Vec::new();
    let report = verify_reader_with(&text[..], &VerifyOptions::default(), 2, |n| seen.push(n));
    assert!(report.ok, "{report:?}");
    assert_eq!(report.records, RECORDS as u64);
    assert_eq!(seen.last(), Some(&(RECORDS as u64)));
}
