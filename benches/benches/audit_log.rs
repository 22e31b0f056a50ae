//! Audit log throughput: sealing (hash + sign), durable append, and verification, each
//! beside the raw SHA-256 + Ed25519 work measured in the same run.
//!
//! Run: `cargo bench -p lineage-benches --bench audit_log`
//! Criterion prints per-iteration times; the summary at the end prints records/s and
//! the ratio to the raw-crypto baseline, so figures compare across machines.

use std::time::{Duration, Instant};

use criterion::{criterion_group, Criterion, Throughput};
use ed25519_dalek::{Signer, SigningKey, Verifier};
use lineage_core::guard::{decide, seal, AgentState, Command};
use lineage_core::record::{timestamp, Record};
use lineage_core::verify::{verify_records, VerifyOptions};
use lineage_core::{AuditKey, AuditLog, Policy, ToolRule};
use serde_json::json;
use sha2::{Digest, Sha256};

fn sample_record(key: &AuditKey, seq: u64) -> Record {
    Record::seal(
        key,
        seq,
        timestamp::format(1_800_000_000_000_000 + seq as i64),
        "support-bot",
        "action_requested",
        json!({"action_id": format!("act-{seq}"), "cost": 1, "tool": "send_email",
               "input": {"to": "ops@example.com", "subject": "weekly report", "n": seq}}),
        &"ab".repeat(32),
    )
}

fn sample_log(key: &AuditKey, n: u64) -> Vec<Record> {
    let mut state = AgentState::new();
    let mut records = Vec::new();
    let policy = Policy::new(u64::MAX).allow("send_email", ToolRule::cost(1));
    let create = Command::Create {
        agent_id: "support-bot".into(),
        policy,
    };
    let mut commands = vec![create];
    commands.extend((0..n / 2).map(|i| Command::Request {
        tool: "send_email".into(),
        input: json!({"to": "ops@example.com", "n": i}),
        cost: None,
    }));
    for (i, command) in commands.iter().enumerate() {
        let now = 1_800_000_000_000_000 + i as i64;
        let decided = decide(&state, command, now, key.public_key_hex()).expect("decide");
        for record in seal(&state, decided.drafts, key, now) {
            state.apply(&record).expect("apply");
            records.push(record);
        }
    }
    records
}

fn raw_sign(signing: &SigningKey, message: &[u8]) -> [u8; 64] {
    let hash: [u8; 32] = Sha256::digest(message).into();
    signing.sign(&hash).to_bytes()
}

fn benches(c: &mut Criterion) {
    let key = AuditKey::from_seed([1; 32]);
    let signing = SigningKey::from_bytes(&[1; 32]);
    let canonical = sample_record(&key, 1).to_line();

    let mut group = c.benchmark_group("audit");
    group.throughput(Throughput::Elements(1));
    group.bench_function("raw sha256+ed25519 sign", |b| {
        b.iter(|| raw_sign(&signing, canonical.as_bytes()))
    });
    group.bench_function("seal record (canonical+hash+sign)", |b| {
        let mut seq = 0;
        b.iter(|| {
            seq += 1;
            sample_record(&key, seq)
        })
    });
    let signature = signing.sign(&[7; 32]);
    let verifying = signing.verifying_key();
    group.bench_function("raw sha256+ed25519 verify", |b| {
        b.iter(|| {
            let hash: [u8; 32] = Sha256::digest(canonical.as_bytes()).into();
            let _ = hash;
            verifying.verify(&[7; 32], &signature)
        })
    });
    let log = sample_log(&key, 1000);
    group.throughput(Throughput::Elements(log.len() as u64));
    group.bench_function("verify log (per log of ~1000)", |b| {
        b.iter(|| verify_records(&log, &VerifyOptions::default()))
    });
    group.finish();
}

/// Runs `f` repeatedly for about `budget` and returns operations per second.
fn rate(budget: Duration, mut f: impl FnMut() -> u64) -> f64 {
    let start = Instant::now();
    let mut ops = 0u64;
    while start.elapsed() < budget {
        ops += f();
    }
    ops as f64 / start.elapsed().as_secs_f64()
}

fn summary() {
    let budget = Duration::from_millis(1500);
    let key = AuditKey::from_seed([2; 32]);
    let signing = SigningKey::from_bytes(&[2; 32]);
    let line = sample_record(&key, 1).to_line();

    let raw_sign_rate = rate(budget, || {
        raw_sign(&signing, line.as_bytes());
        1
    });
    let mut seq = 0;
    let seal_rate = rate(budget, || {
        seq += 1;
        sample_record(&key, seq);
        1
    });

    let dir = tempfile::tempdir().expect("tempdir");
    let mut audit_log =
        AuditLog::create(dir.path().join("bench.jsonl"), key.clone(), "bench").expect("create log");
    let mut n = 0u64;
    let append_rate = rate(budget, || {
        n += 1;
        audit_log
            .append("bench", "event", json!({"n": n}))
            .expect("append");
        1
    });
    // Group commit: 16 records per fsync, as a decision with several records does.
    let mut batch_log =
        AuditLog::create(dir.path().join("batch.jsonl"), key.clone(), "batch").expect("create log");
    let batched_rate = rate(budget, || {
        let head = batch_log.head();
        let at = timestamp::format(timestamp::now_micros());
        let mut prev = head.hash.clone();
        let chained: Vec<Record> = (1..=16)
            .map(|i| {
                let record = Record::seal(
                    &key,
                    head.seq + i,
                    at.clone(),
                    "batch",
                    "event",
                    json!({"i": i}),
                    &prev,
                );
                prev.clone_from(&record.hash);
                record
            })
            .collect();
        batch_log.write_records(&chained).expect("write");
        16
    });

    let verifying = signing.verifying_key();
    let signature = signing.sign(&[9; 32]);
    let raw_verify_rate = rate(budget, || {
        let _: [u8; 32] = Sha256::digest(line.as_bytes()).into();
        let _ = verifying.verify_strict(&[9; 32], &signature);
        1
    });
    let log = sample_log(&key, 2000);
    let verify_rate = rate(budget, || {
        let report = verify_records(&log, &VerifyOptions::default());
        assert!(report.ok);
        log.len() as u64
    });

    println!("\n== audit log summary (records per second, single core) ==");
    println!("raw sha256+ed25519 sign      {raw_sign_rate:>10.0}/s  (baseline 1.00)");
    println!(
        "seal record                  {seal_rate:>10.0}/s  ({:.2} of raw sign)",
        seal_rate / raw_sign_rate
    );
    println!(
        "durable append, 1 per fsync  {append_rate:>10.0}/s  ({:.2} of raw sign)",
        append_rate / raw_sign_rate
    );
    println!(
        "durable append, 16 per fsync {batched_rate:>10.0}/s  ({:.2} of raw sign)",
        batched_rate / raw_sign_rate
    );
    println!("raw sha256+ed25519 verify    {raw_verify_rate:>10.0}/s  (baseline 1.00)");
    println!(
        "verify log                   {verify_rate:>10.0}/s  ({:.2} of raw verify)",
        verify_rate / raw_verify_rate
    );
}

criterion_group!(audit, benches);

fn main() {
    audit();
    Criterion::default().configure_from_args().final_summary();
    summary();
}
