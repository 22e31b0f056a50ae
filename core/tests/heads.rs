//! Head statements, witnessed heads checkpoints (log signature + cosignature/v1 quorum)
//! and the auditor's comparison of an agent log with its witnessed head.

use base64::Engine;
use ed25519_dalek::Signer;
use lineage_core::heads::{
    check_log_against_head, log_vkey, verify_witnessed, HeadCheck, HeadProof, HeadStatement,
};
use lineage_core::record::Record;
use lineage_core::transparency::{Checkpoint, Frontier, MerkleLevels};
use lineage_core::{AuditKey, Guard, Policy, ToolRule};
use serde_json::json;

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

/// A test witness: its vkey and a function that cosigns checkpoint text at a time.
struct TestWitness {
    name: String,
    key: ed25519_dalek::SigningKey,
}

impl TestWitness {
    fn new(name: &str, seed: u8) -> Self {
        TestWitness {
            name: name.into(),
            key: ed25519_dalek::SigningKey::from_bytes(&[seed; 32]),
        }
    }
    fn encoded(&self) -> Vec<u8> {
        let mut e = vec![0x04];
        e.extend_from_slice(self.key.verifying_key().as_bytes());
        e
    }
    fn vkey(&self) -> String {
        let id = signed_note::key_id(&self.name, &self.encoded());
        format!("{}+{id:08x}+{}", self.name, B64.encode(self.encoded()))
    }
    fn cosign(&self, text: &str, time: u64) -> String {
        let id = signed_note::key_id(&self.name, &self.encoded());
        let sig = self
            .key
            .sign(format!("cosignature/v1\ntime {time}\n{text}").as_bytes());
        let mut blob = id.to_be_bytes().to_vec();
        blob.extend_from_slice(&time.to_be_bytes());
        blob.extend_from_slice(&sig.to_bytes());
        format!("\u{2014} {} {}\n", self.name, B64.encode(blob))
    }
}

fn agent_log(requests: usize) -> (Vec<Record>, AuditKey) {
    let dir = tempfile::tempdir().unwrap();
    let key = AuditKey::generate().unwrap();
    let mut guard = Guard::create(
        dir.path().join("a.jsonl"),
        key.clone(),
        "a",
        Policy::new(1000).allow("t", ToolRule::cost(1)),
    )
    .unwrap();
    for i in 0..requests {
        guard.request("t", json!({"i": i}), None).unwrap();
    }
    (guard.records().unwrap(), key)
}

fn statement_for(records: &[Record], size: usize) -> HeadStatement {
    let mut tree = Frontier::new();
    for r in &records[..size] {
        tree.push(&hex::decode(&r.hash).unwrap());
    }
    HeadStatement {
        agent_id: "a".into(),
        size: size as u64,
        root: hex::encode(tree.root()),
        head_hash: records[size - 1].hash.clone(),
    }
}

#[test]
fn statements_have_one_canonical_leaf_form() {
    let s = HeadStatement {
        agent_id: "agent \"q\"".into(),
        size: 12,
        root: "ab".repeat(32),
        head_hash: "cd".repeat(32),
    };
    let leaf = s.to_leaf();
    assert!(leaf.starts_with(r#"{"agent_id":"agent \"q\"","head_hash":"#));
    assert_eq!(HeadStatement::from_leaf(&leaf).unwrap(), s);
    // Same content, other key order or spacing: not the leaf that was hashed.
    let reordered = format!(
        r#"{{"size":12,"agent_id":"agent \"q\"","head_hash":"{}","root":"{}"}}"#,
        s.head_hash, s.root
    );
    assert!(HeadStatement::from_leaf(&reordered).is_err());
    assert!(HeadStatement::from_leaf("not json").is_err());
}

#[test]
fn witnessed_checkpoints_need_the_log_signature_and_a_quorum() {
    let key = AuditKey::generate().unwrap();
    let origin = "lineage.test/heads";
    let vkey = log_vkey(origin, key.public_key_hex()).unwrap();
    let checkpoint = Checkpoint {
        origin: origin.into(),
        size: 3,
        root: [7; 32],
    };
    let signed = checkpoint.sign(&key).unwrap();
    let (w1, w2, w3) = (
        TestWitness::new("w1.test", 1),
        TestWitness::new("w2.test", 2),
        TestWitness::new("w3.test", 3),
    );
    let text = checkpoint.text();
    let note = format!(
        "{signed}{}{}",
        w1.cosign(&text, 1_700_000_000),
        w2.cosign(&text, 1_700_000_001)
    );
    let all = vec![w1.vkey(), w2.vkey(), w3.vkey()];

    let ok = verify_witnessed(&note, &vkey, &all, 2).unwrap();
    assert_eq!(ok.checkpoint, checkpoint);
    assert_eq!(ok.witnesses, vec!["w1.test", "w2.test"]);
    let short = verify_witnessed(&note, &vkey, &all, 3).unwrap_err();
    assert!(short.0.contains("2 of the required 3"), "{short}");
    // Only the log's signature: no witness.
    assert!(verify_witnessed(&signed, &vkey, &all, 1).is_err());
    assert!(verify_witnessed(&signed, &vkey, &all, 0).is_ok());
    // A cosignature over other text by a known witness rejects the note.
    let forged = format!("{signed}{}", w1.cosign("other\n", 1_700_000_000));
    let e = verify_witnessed(&forged, &vkey, &all, 1).unwrap_err();
    assert!(e.0.contains("does not verify"), "{e}");
    // A zero timestamp is not a cosignature.
    let zero = format!("{signed}{}", w1.cosign(&text, 0));
    assert!(verify_witnessed(&zero, &vkey, &all, 1).is_err());
    // Cosignatures without the log's own signature: refused.
    let unsigned = format!("{text}\n{}", w1.cosign(&text, 5));
    let e = verify_witnessed(&unsigned, &vkey, &all, 1).unwrap_err();
    assert!(e.0.contains("not signed by the log"), "{e}");
    // Another cluster key under the same origin: refused.
    let other = log_vkey(origin, AuditKey::generate().unwrap().public_key_hex()).unwrap();
    assert!(verify_witnessed(&note, &other, &all, 1).is_err());
    // A malformed witness key is a precise error. Quorum 0, so that only parsing the
    // key can fail: a key skipped instead would let the note through.
    let e = verify_witnessed(&note, &vkey, &["w1.test+00000000+AAAA".into()], 0).unwrap_err();
    assert!(e.0.contains("witness key is not a cosignature/v1"), "{e}");
}

#[test]
fn head_proofs_place_a_statement_in_the_heads_tree() {
    let (records, _) = agent_log(5);
    let statements: Vec<HeadStatement> = (1..=records.len())
        .map(|n| statement_for(&records, n))
        .collect();
    let mut levels = MerkleLevels::new();
    for s in &statements {
        levels.push_leaf_hash(s.leaf_hash());
    }
    let size = levels.size();
    let checkpoint = Checkpoint {
        origin: "o".into(),
        size,
        root: levels.root_at(size).unwrap(),
    };
    let proof = HeadProof {
        statement: statements[3].clone(),
        index: 3,
        tree_size: size,
        proof: levels
            .inclusion_proof(3, size)
            .unwrap()
            .iter()
            .map(|h| B64.encode(h))
            .collect(),
    };
    proof.verify(&checkpoint).unwrap();
    let mut lying = proof.clone();
    lying.statement.size += 1;
    assert!(lying.verify(&checkpoint).is_err());
    let mut moved = proof.clone();
    moved.index = 4;
    assert!(moved.verify(&checkpoint).is_err());
}

#[test]
fn logs_are_checked_against_their_witnessed_head() {
    let (records, key) = agent_log(10);
    let n = records.len();
    let head = statement_for(&records, n - 2);
    let earlier: Vec<HeadStatement> = [2, 4, 8]
        .iter()
        .map(|&k| statement_for(&records, k))
        .collect();

    assert_eq!(
        check_log_against_head(&records, &head, &earlier),
        HeadCheck::Complete {
            size: (n - 2) as u64,
            later: 2
        }
    );
    assert_eq!(
        check_log_against_head(&records[..5], &head, &earlier),
        HeadCheck::CutShort {
            witnessed: (n - 2) as u64,
            present: 5
        }
    );
    // Rewritten from seq 5 with the real key: a valid chain, but not the witnessed one.
    let mut rewritten = records[..5].to_vec();
    for seq in 5..n as u64 {
        let prev = rewritten.last().unwrap();
        rewritten.push(Record::seal(
            &key,
            seq,
            prev.timestamp.clone(),
            "a",
            "action_requested",
            json!({"action_id": format!("x{seq}"), "tool": "t", "input": {}}),
            &prev.hash.clone(),
        ));
    }
    match check_log_against_head(&rewritten, &head, &earlier) {
        HeadCheck::Rewritten {
            first_differing, ..
        } => assert_eq!(first_differing, (4, 7), "between witnessed sizes 4 and 8"),
        other => panic!("not caught: {other:?}"),
    }
    // Without earlier statements the range is the whole witnessed prefix.
    match check_log_against_head(&rewritten, &head, &[]) {
        HeadCheck::Rewritten {
            first_differing, ..
        } => assert_eq!(first_differing, (0, (n - 3) as u64)),
        other => panic!("not caught: {other:?}"),
    }
    let empty = HeadStatement {
        size: 0,
        ..head.clone()
    };
    assert!(matches!(
        check_log_against_head(&records, &empty, &[]),
        HeadCheck::BadStatement(_)
    ));
}
