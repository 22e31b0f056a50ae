//! Every kind of tampering is caught with its exact reason, and hostile input gives a
//! clear failure, never a panic.

use std::fs;

use lineage_core::record::{Head, Record};
use lineage_core::verify::{verify_reader, VerifyOptions, VerifyReport};
use lineage_core::{AuditKey, AuditLog, Guard, GuardFileError, Policy, ToolRule};
use serde_json::json;

struct Fixture {
    _dir: tempfile::TempDir,
    lines: Vec<String>,
    key: AuditKey,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let key = AuditKey::generate().unwrap();
    let path = dir.path().join("a.jsonl");
    let mut guard = Guard::create(
        &path,
        key.clone(),
        "a",
        Policy::new(100).allow("t", ToolRule::cost(1)),
    )
    .unwrap();
    for i in 0..3 {
        guard.request("t", json!({"i": i}), None).unwrap();
    }
    let lines = fs::read_to_string(&path)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    Fixture {
        _dir: dir,
        lines,
        key,
    }
}

fn verify_lines(lines: &[String], options: &VerifyOptions) -> VerifyReport {
    let text = lines.iter().map(|l| format!("{l}\n")).collect::<String>();
    verify_reader(text.as_bytes(), options)
}

fn failure(lines: &[String], options: &VerifyOptions) -> String {
    verify_lines(lines, options)
        .failure
        .map(|f| f.to_string())
        .unwrap_or_else(|| "ok".into())
}

fn trusted(f: &Fixture) -> VerifyOptions {
    VerifyOptions {
        public_key: Some(f.key.public_key_hex().to_string()),
        checkpoint: None,
    }
}

#[test]
fn an_untouched_log_verifies() {
    let f = fixture();
    let report = verify_lines(&f.lines, &trusted(&f));
    assert!(report.ok, "{report:?}");
    assert_eq!(report.records, 8);
    assert_eq!(report.log_id.as_deref(), Some("a"));
    assert!(report.key_trusted);
}

#[test]
fn an_edited_byte_is_caught() {
    let f = fixture();
    let mut lines = f.lines.clone();
    lines[4] = lines[4].replacen("\"i\":1", "\"i\":2", 1);
    assert_ne!(lines[4], f.lines[4]);
    assert_eq!(
        failure(&lines, &trusted(&f)),
        "line 5 (seq 4): hash does not match record content"
    );
}

#[test]
fn a_deleted_record_is_caught() {
    let f = fixture();
    let mut lines = f.lines.clone();
    lines.remove(4);
    assert_eq!(
        failure(&lines, &trusted(&f)),
        "line 5 (seq 5): expected seq 4, found 5"
    );
}

#[test]
fn reordered_records_are_caught() {
    let f = fixture();
    let mut lines = f.lines.clone();
    lines.swap(3, 4);
    assert_eq!(
        failure(&lines, &trusted(&f)),
        "line 4 (seq 4): expected seq 3, found 4"
    );
}

#[test]
fn a_truncated_tail_passes_alone_and_fails_against_a_checkpoint() {
    let f = fixture();
    let last: Record = Record::from_line(f.lines.last().unwrap()).unwrap();
    let cut = &f.lines[..5];
    assert_eq!(failure(cut, &trusted(&f)), "ok");
    let with_checkpoint = VerifyOptions {
        checkpoint: Some(last.head()),
        ..trusted(&f)
    };
    assert_eq!(
        failure(cut, &with_checkpoint),
        "log ends at seq 4 before checkpoint (truncated)"
    );
    let rewritten = VerifyOptions {
        checkpoint: Some(Head {
            seq: 2,
            hash: "ab".repeat(32),
        }),
        ..trusted(&f)
    };
    assert_eq!(
        failure(&f.lines, &rewritten),
        "line 3 (seq 2): record at checkpoint has a different hash (history rewritten)"
    );
}

#[test]
fn a_wrong_key_is_caught() {
    let f = fixture();
    let other = AuditKey::generate().unwrap();
    let options = VerifyOptions {
        public_key: Some(other.public_key_hex().to_string()),
        checkpoint: None,
    };
    assert_eq!(
        failure(&f.lines, &options),
        "line 1 (seq 0): log declares a different public key than the trusted one"
    );
    // The trusted key compares case-insensitively.
    let upper = VerifyOptions {
        public_key: Some(f.key.public_key_hex().to_uppercase()),
        checkpoint: None,
    };
    assert_eq!(failure(&f.lines, &upper), "ok");
}

#[test]
fn a_log_resigned_with_another_key_fails_its_signatures() {
    let f = fixture();
    let mut lines = f.lines.clone();
    let other = AuditKey::generate().unwrap();
    let mut record = Record::from_line(&lines[2]).unwrap();
    record.signature = hex::encode(other.sign_hash(&record.recompute_hash()));
    lines[2] = record.to_line();
    assert_eq!(
        failure(&lines, &VerifyOptions::default()),
        "line 3 (seq 2): signature is invalid"
    );
    record.signature = "zz".repeat(64);
    lines[2] = record.to_line();
    assert_eq!(
        failure(&lines, &VerifyOptions::default()),
        "line 3 (seq 2): signature is malformed"
    );
}

#[test]
fn uppercase_hex_is_caught() {
    let f = fixture();
    let mut lines = f.lines.clone();
    let mut record = Record::from_line(&lines[2]).unwrap();
    record.hash = record.hash.to_uppercase();
    lines[2] = record.to_line();
    assert_eq!(
        failure(&lines, &trusted(&f)),
        "line 3 (seq 2): hash does not match record content"
    );
}

#[test]
fn a_duplicate_genesis_is_caught() {
    let f = fixture();
    let mut lines = f.lines.clone();
    let prev = Record::from_line(&lines[1]).unwrap();
    let genesis = Record::seal(
        &f.key,
        2,
        prev.timestamp.clone(),
        "a",
        "genesis",
        json!({"log_id": "a", "public_key": f.key.public_key_hex()}),
        &prev.hash,
    );
    lines.truncate(2);
    lines.push(genesis.to_line());
    assert_eq!(
        failure(&lines, &trusted(&f)),
        "line 3 (seq 2): genesis record after start of log"
    );
    // And a log that does not start with genesis.
    assert_eq!(
        failure(&f.lines[1..], &trusted(&f)),
        "line 1 (seq 1): first record is not a genesis record"
    );
}

#[test]
fn a_broken_chain_is_caught() {
    let f = fixture();
    let mut lines = f.lines.clone();
    let mut record = Record::from_line(&lines[3]).unwrap();
    record.prev_hash = "0".repeat(64);
    lines[3] = record.to_line();
    assert_eq!(
        failure(&lines, &trusted(&f)),
        "line 4 (seq 3): prev_hash does not match previous record"
    );
}

#[test]
fn empty_log() {
    assert_eq!(failure(&[], &VerifyOptions::default()), "log is empty");
}

#[test]
fn hostile_lines_fail_cleanly() {
    let f = fixture();
    let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (b"{not json".to_vec(), "line 2: malformed record: "),
        (b"\xff\xfe\x00garbage".to_vec(), "line 2: malformed record: invalid UTF-8"),
        (b"{\"seq\":NaN}".to_vec(), "line 2: malformed record: "),
        (b"{\"seq\":1e400}".to_vec(), "line 2: malformed record: "),
        (
            format!(r#"{{"seq":1,"timestamp":"t","actor":"a","kind":"k","payload":{deep},"prev_hash":"","hash":"","signature":""}}"#).into_bytes(),
            "line 2: malformed record: recursion limit exceeded",
        ),
        (b"".to_vec(), "line 2: malformed record: EOF"),
        (b"{\"seq\":1}".to_vec(), "line 2: malformed record: missing field"),
    ];
    for (bad, expected) in cases {
        let mut text = format!("{}\n", f.lines[0]).into_bytes();
        text.extend_from_slice(&bad);
        text.push(b'\n');
        let report = verify_reader(&text[..], &trusted(&f));
        let got = report.failure.map(|x| x.to_string()).unwrap_or_default();
        assert!(
            got.starts_with(expected),
            "got {got:?}, expected {expected:?}"
        );
        assert!(!report.ok);
    }
}

#[test]
fn a_huge_line_is_refused_without_reading_it_whole() {
    let mut text = vec![b'x'; lineage_core::record::MAX_RECORD_BYTES + 10];
    text.push(b'\n');
    let report = verify_reader(&text[..], &VerifyOptions::default());
    assert_eq!(
        report.failure.unwrap().to_string(),
        format!(
            "line 1: malformed record: line exceeds {} bytes",
            lineage_core::record::MAX_RECORD_BYTES
        )
    );
}

#[test]
fn input_nesting_is_bounded_so_every_record_reads_back() {
    use lineage_core::canonical::MAX_VALUE_DEPTH;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("n.jsonl");
    let mut guard = Guard::create(
        &path,
        AuditKey::generate().unwrap(),
        "n",
        Policy::new(10).allow("t", ToolRule::cost(0)),
    )
    .unwrap();
    let nested = |levels: usize| {
        let mut input = json!("leaf");
        for _ in 0..levels {
            input = json!([input]);
        }
        input
    };
    guard.request("t", nested(MAX_VALUE_DEPTH), None).unwrap();
    let too_deep = guard
        .request("t", nested(MAX_VALUE_DEPTH + 1), None)
        .unwrap_err();
    assert_eq!(
        too_deep.to_string(),
        format!("input is nested deeper than {MAX_VALUE_DEPTH} levels")
    );
    let key = guard.state().public_key.clone();
    let records_before = guard.records().unwrap().len();
    drop(guard);
    let report = lineage_core::verify_file(
        &path,
        &VerifyOptions {
            public_key: Some(key),
            checkpoint: None,
        },
    );
    assert!(report.ok, "{report:?}");
    assert_eq!(
        report.records as usize, records_before,
        "the refused request appended nothing"
    );
}

#[test]
fn a_second_writer_is_locked_out() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("l.jsonl");
    let key = AuditKey::generate().unwrap();
    let _first = AuditLog::create(&path, key.clone(), "l").unwrap();
    match AuditLog::open(&path, key) {
        Err(lineage_core::AuditError::Locked(p)) => assert!(p.ends_with("l.jsonl")),
        other => panic!("expected Locked, got {other:?}"),
    }
}

#[test]
fn opening_with_another_key_is_a_key_mismatch() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("k.jsonl");
    drop(AuditLog::create(&path, AuditKey::generate().unwrap(), "k").unwrap());
    let err = AuditLog::open(&path, AuditKey::generate().unwrap()).unwrap_err();
    assert!(
        err.to_string().starts_with("log was signed by key "),
        "{err}"
    );
}

#[test]
fn a_torn_last_line_is_cut_and_a_complete_one_kept() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.jsonl");
    let key = AuditKey::generate().unwrap();
    let mut log = AuditLog::create(&path, key.clone(), "t").unwrap();
    log.append("ci", "deploy", json!({"v": 1})).unwrap();
    drop(log);
    let good = fs::read_to_string(&path).unwrap();

    // A crash mid-write: half a line with no newline.
    fs::write(&path, format!("{good}{{\"seq\":2,\"times")).unwrap();
    let log = AuditLog::open(&path, key.clone()).unwrap();
    assert_eq!(log.head().seq, 1);
    drop(log);
    assert_eq!(fs::read_to_string(&path).unwrap(), good);

    // A complete record whose newline was removed is kept.
    fs::write(&path, good.trim_end_matches('\n')).unwrap();
    let mut log = AuditLog::open(&path, key).unwrap();
    assert_eq!(log.head().seq, 1);
    log.append("ci", "deploy", json!({"v": 2})).unwrap();
    assert_eq!(log.records().unwrap().len(), 3);
}

#[test]
fn a_guard_log_that_is_not_a_guard_log_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("g.jsonl");
    let key = AuditKey::generate().unwrap();
    let mut log = AuditLog::create(&path, key.clone(), "g").unwrap();
    log.append("g", "deploy", json!({})).unwrap();
    drop(log);
    match Guard::open(&path, key) {
        Err(GuardFileError::Audit(e)) => {
            assert_eq!(
                e.to_string(),
                "log is corrupt: line 2 (seq 1): seq 1: record before policy"
            )
        }
        other => panic!("expected a replay failure, got {other:?}"),
    }
}

/// `check_signature`, the one-record check an import applies to each line it receives:
/// every record of an intact log passes; a changed payload, a flipped signature bit, a
/// malformed signature and another key each fail with their reason.
#[test]
fn one_record_at_a_time_the_hash_and_signature_are_checked() {
    use lineage_core::verify::check_signature;
    let f = fixture();
    let key = f.key.verifying_key();
    let records: Vec<Record> = f
        .lines
        .iter()
        .map(|l| Record::from_line(l).unwrap())
        .collect();
    for record in &records {
        assert_eq!(check_signature(record, &key), Ok(()));
    }
    let record = &records[1];

    let mut edited = record.clone();
    edited.actor.push('x');
    assert_eq!(
        check_signature(&edited, &key),
        Err("hash does not match record content".to_string())
    );

    let mut flipped = record.clone();
    let last = flipped.signature.pop().unwrap();
    flipped.signature.push(if last == '0' { '1' } else { '0' });
    assert_eq!(
        check_signature(&flipped, &key),
        Err("signature is invalid".to_string())
    );

    let mut malformed = record.clone();
    malformed.signature.truncate(10);
    assert_eq!(
        check_signature(&malformed, &key),
        Err("signature is malformed".to_string())
    );

    let stranger = AuditKey::generate().unwrap().verifying_key();
    assert_eq!(
        check_signature(record, &stranger),
        Err("signature is invalid".to_string())
    );
}
