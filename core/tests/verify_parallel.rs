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

/// A reader's records go to the verifier in batches of at most 2,048 records or 8 MiB
/// of lines (memory holds one batch), with one progress call per batch: a log of
/// 8 KiB records is cut where its lines reach 8 MiB, and only there.
#[test]
fn a_reader_is_verified_in_batches_of_8_mib_with_progress_after_each() {
    const N: usize = 1_100;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("log.jsonl");
    let mut log = AuditLog::create(&path, AuditKey::from_seed([5; 32]), "big").unwrap();
    for n in 1..N {
        log.append(
            "big",
            "note",
            serde_json::json!({"n": n, "text": "y".repeat(8 * 1024)}),
        )
        .unwrap();
    }
    let text = std::fs::read(&path).unwrap();
    let mut total = 0;
    let first_cut = text
        .split(|b| *b == b'\n')
        .position(|line| {
            total += line.len();
            total >= 8 * 1024 * 1024
        })
        .unwrap()
        + 1;
    assert!(first_cut < N, "the log is over 8 MiB");
    let mut seen = Vec::new();
    let report = verify_reader_with(&text[..], &VerifyOptions::default(), 2, |n| seen.push(n));
    assert!(report.ok, "{report:?}");
    assert_eq!(report.records, N as u64);
    assert_eq!(seen, vec![first_cut as u64, N as u64]);

    // A small log is one batch, however many cores.
    let small: Vec<u8> = log_lines()
        .iter()
        .flat_map(|l| l.iter().copied().chain([b'\n']))
        .collect();
    for threads in [1, 3] {
        let mut seen = Vec::new();
        let report = verify_reader_with(&small[..], &VerifyOptions::default(), threads, |n| {
            seen.push(n)
        });
        assert!(report.ok, "{report:?}");
        assert_eq!(seen, vec![RECORDS as u64]);
    }
}

/// A line may be as long as the bound, newline or not; one byte more is refused.
#[test]
fn a_line_at_the_bound_is_read_and_one_byte_longer_is_refused() {
    use lineage_core::verify::read_line_bounded;
    let mut buf = Vec::new();
    let mut at_bound = &b"abc"[..];
    assert!(read_line_bounded(&mut at_bound, &mut buf, 3).unwrap());
    assert_eq!(buf, b"abc");
    assert!(!read_line_bounded(&mut at_bound, &mut buf, 3).unwrap());
    let mut with_newline = &b"abc\nd"[..];
    assert!(read_line_bounded(&mut with_newline, &mut buf, 3).unwrap());
    assert_eq!(buf, b"abc");
    assert!(read_line_bounded(&mut with_newline, &mut buf, 3).unwrap());
    assert_eq!(buf, b"d");
    let mut over = &b"abcd"[..];
    let error = read_line_bounded(&mut over, &mut buf, 3).unwrap_err();
    assert_eq!(error.to_string(), "line exceeds 3 bytes");
}

/// A reader that fails (a disk error, not bad data) fails the whole log as a read error,
/// never as a malformed record at some line; a line over the bound is a malformed record
/// at its line.
#[test]
fn a_read_error_is_the_whole_logs_and_an_overlong_line_is_its_lines() {
    struct FailsAfter(Vec<u8>, usize);
    impl std::io::Read for FailsAfter {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            if self.1 >= self.0.len() {
                return Err(std::io::Error::other("the disk went away"));
            }
            let n = buf.len().min(self.0.len() - self.1);
            buf[..n].copy_from_slice(&self.0[self.1..self.1 + n]);
            self.1 += n;
            Ok(n)
        }
    }
    let lines = log_lines();
    let first_two: Vec<u8> = lines[..2]
        .iter()
        .flat_map(|l| l.iter().copied().chain([b'\n']))
        .collect();
    let report = verify_reader_with(
        FailsAfter(first_two, 0),
        &VerifyOptions::default(),
        2,
        |_| {},
    );
    let failure = report.failure.expect("a failure");
    assert_eq!((failure.line, failure.seq), (None, None), "{failure}");
    assert_eq!(failure.reason, "read error: the disk went away");

    let mut overlong = lines[0].clone();
    overlong.push(b'\n');
    overlong.extend(std::iter::repeat_n(
        b'x',
        lineage_core::record::MAX_RECORD_BYTES + 1,
    ));
    let report = verify_reader_with(&overlong[..], &VerifyOptions::default(), 2, |_| {});
    let failure = report.failure.expect("a failure");
    assert_eq!(failure.line, Some(2), "{failure}");
    assert!(
        failure.reason.starts_with("malformed record: line exceeds"),
        "{failure}"
    );
}

/// Worker threads started while this test's verifier ran.
static WORKERS_STARTED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// The hook a server gives to lower its verification workers' priority runs on every
/// worker thread, and not on the caller's (which keeps its own priority).
#[test]
fn the_worker_start_hook_runs_on_each_worker_thread_only() {
    fn count_worker() {
        WORKERS_STARTED.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
    let lines = log_lines();
    let mut verifier =
        BatchVerifier::new(VerifyOptions::default(), 3).with_worker_start(count_worker);
    verifier.push_lines(&lines).unwrap();
    verifier.finish().unwrap();
    // One batch: the caller checks the genesis record, 3 workers the rest.
    assert_eq!(WORKERS_STARTED.load(std::sync::atomic::Ordering::SeqCst), 3);
    assert_eq!(verifier.count(), RECORDS as u64);
}
