//! Known-answer tests: logs the reference guard server wrote verify here, every line reads
//! back and writes out as the very same bytes, and replay gives the reference's own status.

use std::path::{Path, PathBuf};

use lineage_core::guard::AgentState;
use lineage_core::verify::{verify_file, VerifyOptions};
use lineage_core::Record;
use serde_json::Value;
use sha2::{Digest, Sha256};

const AGENTS: [&str; 6] = [
    "budget", "fatal", "floats", "operator", "payments", "scarred",
];

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/reference-logs")
}

fn read(name: &str) -> String {
    std::fs::read_to_string(dir().join(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn public_key() -> String {
    let key: Value = serde_json::from_str(&read("public_key.json")).unwrap();
    key["public_key"].as_str().unwrap().to_string()
}

#[test]
fn the_fixtures_are_the_files_the_reference_wrote() {
    let manifest = read("SHA256SUMS");
    let mut checked = 0;
    for line in manifest.lines().filter(|l| !l.trim().is_empty()) {
        let (digest, name) = line.split_once("  ").expect("sha256sum line");
        let bytes = std::fs::read(dir().join(name)).unwrap();
        assert_eq!(
            hex::encode(Sha256::digest(&bytes)),
            digest,
            "{name} changed"
        );
        checked += 1;
    }
    assert_eq!(
        checked,
        AGENTS.len() + 2,
        "every fixture is in the manifest"
    );
}

#[test]
fn every_reference_log_verifies_with_the_reference_key() {
    let options = VerifyOptions {
        public_key: Some(public_key()),
        checkpoint: None,
    };
    for agent in AGENTS {
        let report = verify_file(dir().join(format!("{agent}.jsonl")), &options);
        assert!(report.ok, "{agent}: {:?}", report.failure);
        assert!(report.records > 2, "{agent}: {} records", report.records);
    }
}

#[test]
fn every_reference_line_reads_back_and_writes_out_byte_for_byte() {
    for agent in AGENTS {
        for (n, line) in read(&format!("{agent}.jsonl")).lines().enumerate() {
            let record = Record::from_line(line).unwrap();
            assert_eq!(record.to_line(), line, "{agent} line {}", n + 1);
            let (checked, parsed) = record.to_checked_line().unwrap();
            assert_eq!(checked, line);
            assert_eq!(parsed, record);
        }
    }
}

#[test]
fn replay_gives_the_status_the_reference_answered() {
    let expected: Value = serde_json::from_str(&read("expected_status.json")).unwrap();
    for agent in AGENTS {
        let records: Vec<Record> = read(&format!("{agent}.jsonl"))
            .lines()
            .map(|l| Record::from_line(l).unwrap())
            .collect();
        let state = AgentState::replay(&records).unwrap();
        let status = serde_json::to_value(state.status()).unwrap();
        assert_eq!(status, expected[agent], "{agent}");
    }
}
