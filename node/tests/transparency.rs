//! End to end, with real processes: three nodes, an external witness and the
//! checkpointer. Agents act; the checkpointer gets the heads checkpoint cosigned. Then an
//! operator with disk access and the signing key truncates one agent's log on every
//! node and rewrites another's. The checkpointer raises the alarm (metric + evidence
//! file), and the auditor's check fails precisely for both, while an honest log passes.
//!
//! The witness and checkpointer binaries belong to another package: this test runs them
//! from the same target directory, which `cargo test --workspace` builds.

#[path = "cluster/util.rs"]
mod util;
#[path = "cluster/witness.rs"]
mod witness;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use lineage_client::witnessed_cli::{
    fetch_head_proofs, fetch_witnessed, verify_log, WitnessedInput,
};
use lineage_core::heads::Cosigner;
use lineage_core::record::Record;
use lineage_core::AuditKey;
use lineage_node::store::record_ends;
use redb::{ReadableTable, TableDefinition};
use serde_json::{json, Value};
use util::{free_port, Cluster};
use witness::{run_ok, sibling_binary, ORIGIN};

const RECORDS: TableDefinition<(&str, u64), &str> = TableDefinition::new("records");
const AGENT_CHECKPOINTS: TableDefinition<&str, &[u8]> = TableDefinition::new("agent_checkpoints");

struct Process(Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn text(url: &str) -> (u16, String) {
    match reqwest::get(url).await {
        Ok(r) => (r.status().as_u16(), r.text().await.unwrap_or_default()),
        Err(_) => (0, String::new()),
    }
}

/// Acts `n` times for an agent (the admin may act for any agent).
async fn act(cluster: &Cluster, agent: &str, n: usize, tag: &str) {
    for i in 0..n {
        let (status, body) = cluster
            .post_until_served(
                i % 3,
                &format!("/v1/agents/{agent}/actions"),
                &cluster.admin.clone(),
                json!({"tool": "pay", "input": {"amount": 1, "tag": tag, "i": i}}),
                &format!("{agent}-{tag}-{i}"),
            )
            .await;
        assert_eq!(status, 200, "{body}");
    }
}

/// Waits until the witnessed checkpoint covers every agent's current log.
async fn wait_witnessed(cluster: &Cluster, agents: &[&str]) -> String {
    let start = Instant::now();
    loop {
        let (status, note) = text(&cluster.url(0, "/v1/transparency/checkpoint/witnessed")).await;
        if status == 200 {
            let size: u64 = note
                .lines()
                .nth(1)
                .and_then(|l| l.parse().ok())
                .unwrap_or(0);
            let mut covered = true;
            for agent in agents {
                let log = cluster.converged_log(agent, Duration::from_secs(10)).await;
                let (_, proof) =
                    text(&cluster.url(0, &format!("/v1/agents/{agent}/head-proof?size={size}")))
                        .await;
                let proof: Value = serde_json::from_str(&proof).unwrap_or(Value::Null);
                covered &= proof["statement"]["size"].as_u64() == Some(log.len() as u64);
            }
            if covered {
                return note;
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no witnessed checkpoint covering every agent within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// What an operator with disk access does to one node's database: cut `cut` back to
/// `keep` records, and rewrite `rewritten` from seq `from` (re-signed with the real key,
/// so its chain still verifies). Agent-state checkpoints are dropped so the node
/// rebuilds the agents from the edited records, and the cut agent's stored end is
/// moved back with its records (its seal is a plain checksum, not a keyed one: it
/// catches damage, not someone who rewrites the file; the witness catches them).
fn tamper(db_path: &Path, key: &AuditKey, keep: u64, from: u64) {
    let db = redb::Database::create(db_path).expect("open node db");
    let txn = db.begin_write().unwrap();
    {
        let mut records = txn.open_table(RECORDS).unwrap();
        util::one_row_per_record(&mut records, "cut");
        util::one_row_per_record(&mut records, "rewritten");
        let cut_seqs: Vec<u64> = records
            .range(("cut", keep)..=("cut", u64::MAX))
            .unwrap()
            .map(|item| item.unwrap().0.value().1)
            .collect();
        assert!(!cut_seqs.is_empty(), "nothing to cut");
        for seq in cut_seqs {
            records.remove(("cut", seq)).unwrap();
        }
        let originals: Vec<Record> = records
            .range(("rewritten", 0)..=("rewritten", u64::MAX))
            .unwrap()
            .map(|item| Record::from_line(item.unwrap().1.value()).unwrap())
            .collect();
        let mut prev = originals[from as usize - 1].hash.clone();
        for original in &originals[from as usize..] {
            let mut payload = original.payload.clone();
            if original.seq == from {
                payload["input"]["amount"] = json!(999);
            }
            let record = Record::seal(
                key,
                original.seq,
                original.timestamp.clone(),
                &original.actor,
                &original.kind,
                payload,
                &prev,
            );
            prev = record.hash.clone();
            records
                .insert(("rewritten", record.seq), record.to_line().as_str())
                .unwrap();
        }
        let mut ends = txn.open_table(record_ends::RECORD_ENDS).unwrap();
        record_ends::put(&mut ends, "cut", keep).unwrap();
        let mut checkpoints = txn.open_table(AGENT_CHECKPOINTS).unwrap();
        checkpoints.remove("cut").unwrap();
        checkpoints.remove("rewritten").unwrap();
    }
    txn.commit().unwrap();
}

async fn audit(
    cluster: &Cluster,
    agent: &str,
    public_key: &str,
    note: &str,
    witness_vkey: &str,
) -> (i32, String) {
    let log = cluster.converged_log(agent, Duration::from_secs(10)).await;
    let path = cluster.dir.path().join(format!("{agent}.jsonl"));
    let lines: String = log
        .iter()
        .map(|r| {
            let record: Record = serde_json::from_value(r.clone()).unwrap();
            record.to_line() + "\n"
        })
        .collect();
    std::fs::write(&path, lines).unwrap();
    let size: u64 = note.lines().nth(1).unwrap().parse().unwrap();
    let urls: Vec<String> = cluster
        .addrs
        .iter()
        .map(|a| format!("http://{a}"))
        .collect();
    let proofs = fetch_head_proofs(&urls, None, agent, size)
        .await
        .expect("head proofs");
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let keys = vec![witness_vkey.to_string()];
    let code = verify_log(
        &path,
        public_key,
        &WitnessedInput {
            note,
            witness_keys: &keys,
            quorum: 1,
        },
        &proofs,
        &mut out,
        &mut err,
    );
    let output = String::from_utf8_lossy(&out).to_string() + &String::from_utf8_lossy(&err);
    (code, output)
}

fn alarms(metrics: &str) -> u64 {
    metrics
        .lines()
        .filter(|l| {
            l.starts_with("lineage_checkpointer_inconsistencies_total{")
                && l.contains("witness=\"monitor\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[expect(
    clippy::too_many_lines,
    reason = "a scenario test: the whole transparency story against one cluster, in order"
)]
async fn truncation_and_rewrite_are_caught_by_checkpointer_and_auditor() {
    let witness_bin = sibling_binary("lineage-witness");
    let checkpointer_bin = sibling_binary("lineage-checkpointer");
    let cluster = Cluster::start_with(3, &["--heads-interval-ms", "200"]).await;
    let dir = cluster.dir.path().to_path_buf();
    let public_key = cluster.public_key().await;
    let (_, log_vkey) = text(&cluster.url(0, "/v1/transparency/vkey")).await;
    let log_vkey = log_vkey.trim().to_string();
    assert!(log_vkey.starts_with(&format!("{ORIGIN}+")), "{log_vkey}");

    // The witness: its own key and storage, trusting the cluster's origin and key.
    let wdir = dir.join("witness");
    let wdir_s = wdir.to_str().unwrap();
    let witness_vkey = run_ok(
        &witness_bin,
        &["--data-dir", wdir_s, "--name", "w1.test", "keygen"],
    );
    run_ok(
        &witness_bin,
        &[
            "--data-dir",
            wdir_s,
            "--name",
            "w1.test",
            "add-log",
            "--origin",
            ORIGIN,
            "--vkey",
            &log_vkey,
        ],
    );
    let witness_addr = format!("127.0.0.1:{}", free_port());
    let _witness = Process(
        Command::new(&witness_bin)
            .args([
                "--data-dir",
                wdir_s,
                "--name",
                "w1.test",
                "--listen",
                &witness_addr,
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );

    let policy = json!({"budget": 1000, "scar_limit": 10, "tools": {"pay": {"cost": 1}}});
    for agent in ["honest", "cut", "rewritten"] {
        cluster.create_agent(0, agent, policy.clone()).await;
        act(&cluster, agent, 4, "before").await;
    }

    let metrics_addr = format!("127.0.0.1:{}", free_port());
    let cluster_urls: Vec<String> = cluster
        .addrs
        .iter()
        .map(|a| format!("http://{a}"))
        .collect();
    let cp_dir = dir.join("checkpointer");
    let _checkpointer = Process(
        Command::new(&checkpointer_bin)
            .arg("--cluster")
            .arg(cluster_urls.join(","))
            .arg("--witness")
            .arg(format!("http://{witness_addr}={witness_vkey}"))
            .arg("--data-dir")
            .arg(&cp_dir)
            .arg("--admin-token-file")
            .arg(dir.join("keys/admin.token"))
            .args(["--interval-ms", "200", "--metrics-listen", &metrics_addr])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("checkpointer.log")).unwrap())
            .spawn()
            .unwrap(),
    );
    let note = wait_witnessed(&cluster, &["honest", "cut", "rewritten"]).await;
    // `lineage checkpoint fetch` gets the same note through the client's failover.
    assert_eq!(
        fetch_witnessed(&cluster_urls, None).await.expect("fetch"),
        note
    );

    // Before any tampering every log passes the auditor's check.
    for agent in ["honest", "cut", "rewritten"] {
        let (code, output) = audit(&cluster, agent, &public_key, &note, &witness_vkey).await;
        assert_eq!(code, 0, "{agent}: {output}");
        assert!(
            output.contains("complete up to its witnessed head"),
            "{output}"
        );
    }
    let (_, metrics) = text(&format!("http://{metrics_addr}/metrics")).await;
    assert_eq!(alarms(&metrics), 0, "no alarm while honest: {metrics}");
    // The alarm series exist at 0 before any alarm, for the monitor and the witness, so
    // the alert rules (increase over a window) see the first one.
    for series in [
        "lineage_checkpointer_unresolved_evidence 0",
        "lineage_checkpointer_inconsistencies_total{kind=\"log\",witness=\"monitor\"} 0",
        "lineage_checkpointer_inconsistencies_total{kind=\"witness\",witness=\"",
        "lineage_checkpointer_inconsistencies_total{kind=\"log\",witness=\"w1",
        "lineage_checkpointer_witness_errors_total{witness=\"",
    ] {
        assert!(
            metrics.lines().filter(|l| l.starts_with(series)).count() >= 1,
            "{series} missing: {metrics}"
        );
    }
    // The metrics port is served by the bounded accept loop, which counts this very
    // connection.
    let open: Option<f64> = metrics
        .lines()
        .find_map(|l| l.strip_prefix("lineage_checkpointer_http_connections "))
        .and_then(|v| v.trim().parse().ok());
    assert!(open.is_some_and(|n| n >= 1.0), "open connections: {open:?}");
    assert_eq!(
        metrics
            .lines()
            .filter(|l| l.starts_with("lineage_checkpointer_inconsistencies_total{"))
            .count(),
        3,
        "the monitor (log), and the one witness (its own faults, and the log's it shows): {metrics}"
    );

    // The operator stops every node, edits every copy, restarts.
    let key = AuditKey::load(dir.join("keys/audit.key")).expect("audit key");
    for i in 0..3 {
        cluster.stop_gracefully(i);
    }
    for i in 0..3 {
        tamper(&cluster.data_dir(i).join("node.redb"), &key, 5, 4);
    }
    for i in 0..3 {
        cluster.start_node(i);
    }
    cluster.wait_for_leader(Duration::from_secs(15)).await;
    // Both agents act again, so the cluster states new heads for them.
    act(&cluster, "cut", 1, "after").await;
    act(&cluster, "rewritten", 1, "after").await;

    // The checkpointer raises the alarm: metric and evidence files naming both agents.
    let start = Instant::now();
    let evidence = loop {
        let (_, metrics) = text(&format!("http://{metrics_addr}/metrics")).await;
        let files: Vec<String> = std::fs::read_dir(cp_dir.join("evidence"))
            .map(|d| {
                d.filter_map(|e| std::fs::read_to_string(e.ok()?.path()).ok())
                    .collect()
            })
            .unwrap_or_default();
        let named = |agent: &str| files.iter().any(|f| f.contains(&format!("agent {agent}:")));
        if alarms(&metrics) >= 2 && named("cut") && named("rewritten") {
            break files;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "checkpointer raised no alarm for both agents: {metrics}\n{files:?}\n{}",
            std::fs::read_to_string(dir.join("checkpointer.log")).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let cut_evidence = evidence.iter().find(|f| f.contains("agent cut:")).unwrap();
    assert!(cut_evidence.contains("log cut short"), "{cut_evidence}");
    assert!(
        cut_evidence.contains("lineage.local/cluster\n"),
        "the signed checkpoint is kept"
    );
    let rewrite_evidence = evidence
        .iter()
        .find(|f| f.contains("agent rewritten:"))
        .unwrap();
    assert!(
        rewrite_evidence.contains("log rewritten"),
        "{rewrite_evidence}"
    );
    assert!(!evidence.iter().any(|f| f.contains("agent honest:")));
    // The evidence gauge counts the files (it pages, and unlike a counter it is still
    // above 0 after a restart), until an operator moves them out.
    let start = Instant::now();
    loop {
        let (_, metrics) = text(&format!("http://{metrics_addr}/metrics")).await;
        let unresolved = metrics
            .lines()
            .find_map(|l| l.strip_prefix("lineage_checkpointer_unresolved_evidence "))
            .and_then(|v| v.trim().parse::<usize>().ok());
        let files = std::fs::read_dir(cp_dir.join("evidence")).map_or(0, |d| d.count());
        if unresolved == Some(files) && files >= evidence.len() {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "unresolved_evidence {unresolved:?}, files {files}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // The auditor, with the note witnessed before the tampering and with the latest one.
    let latest = wait_witnessed(&cluster, &["honest", "cut", "rewritten"]).await;
    for note in [&note, &latest] {
        let (code, output) = audit(&cluster, "honest", &public_key, note, &witness_vkey).await;
        assert_eq!(code, 0, "honest: {output}");
        let (code, output) = audit(&cluster, "cut", &public_key, note, &witness_vkey).await;
        assert_eq!(code, 1, "cut: {output}");
        // `cut` kept seq 0..=4 and then acted again, so its seq 5 and 6 are new. Against
        // the witnessed head of 10 records it is cut short. If a heads round also caught
        // it at 6 records while it acted before (rounds come every 200 ms, so that
        // depends on timing), the auditor reports the earliest difference instead: seq 5
        // rewritten. Both are the tampering, found.
        let cut_short = output.contains("log cut short") && output.contains("are missing");
        let rewritten_at_the_cut = output.contains("log rewritten") && output.contains(" to 5\n");
        assert!(cut_short || rewritten_at_the_cut, "cut: {output}");
        let (code, output) = audit(&cluster, "rewritten", &public_key, note, &witness_vkey).await;
        assert_eq!(code, 1, "rewritten: {output}");
        assert!(output.contains("log rewritten"), "rewritten: {output}");
    }
    // A note checked against a witness the auditor trusts but that never cosigned it:
    // refused.
    let w2 = dir.join("witness2");
    let stranger = run_ok(
        &witness_bin,
        &[
            "--data-dir",
            w2.to_str().unwrap(),
            "--name",
            "w2.test",
            "keygen",
        ],
    );
    let (code, output) = audit(&cluster, "honest", &public_key, &note, &stranger).await;
    assert_eq!(code, 1, "{output}");
    assert!(output.contains("0 of the required 1"), "{output}");
}

/// Posts a witnessed checkpoint note as the operator (the checkpointer's call).
async fn store_witnessed(cluster: &Cluster, note: &str) -> (u16, String) {
    let reply = reqwest::Client::new()
        .post(cluster.url(0, "/v1/transparency/checkpoint/witnessed"))
        .bearer_auth(cluster.admin.trim())
        .body(note.to_string())
        .send()
        .await
        .expect("post");
    (
        reply.status().as_u16(),
        reply.text().await.unwrap_or_default(),
    )
}

/// A node started with `--witness-key` stores a witnessed checkpoint only when the
/// cluster's own signature verifies and a trusted witness cosigned it; a node given a
/// malformed witness key does not start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_witnessed_checkpoint_is_stored_only_when_a_trusted_witness_cosigned_it() {
    let trusted = Cosigner::new("w1.test", AuditKey::generate().unwrap()).unwrap();
    let stranger = Cosigner::new("w2.test", AuditKey::generate().unwrap()).unwrap();
    let cluster = Cluster::start_with(
        1,
        &[
            "--heads-interval-ms",
            "100",
            "--witness-key",
            &trusted.vkey(),
        ],
    )
    .await;
    let policy = json!({"budget": 10, "scar_limit": 10, "tools": {"pay": {"cost": 1}}});
    cluster.create_agent(0, "bot", policy).await;
    act(&cluster, "bot", 1, "w").await;
    let start = Instant::now();
    let note = loop {
        let (status, note) = text(&cluster.url(0, "/v1/transparency/checkpoint")).await;
        if status == 200 && note.lines().nth(1).is_some_and(|size| size != "0") {
            break note;
        }
        assert!(start.elapsed() < Duration::from_secs(15), "no checkpoint");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let (body, signatures) = note.split_once("\n\n").expect("a signed note");
    let checkpoint_text = format!("{body}\n");
    let time = 1_800_000_000;
    let cosigned_by = |witness: &Cosigner| {
        format!(
            "{checkpoint_text}\n{signatures}{}",
            witness.cosign(&checkpoint_text, time)
        )
    };

    let (status, answer) = store_witnessed(&cluster, &note).await;
    assert_eq!(status, 400, "no cosignature: {answer}");
    assert!(answer.contains("0 of the required 1 witnesses"), "{answer}");
    let (status, answer) = store_witnessed(&cluster, &cosigned_by(&stranger)).await;
    assert_eq!(status, 400, "an untrusted witness: {answer}");
    // The trusted witness's cosignature over a checkpoint whose log signature is forged.
    let forged_log_signature = {
        let line = signatures.lines().next().expect("the log's signature");
        let (prefix, blob) = line.rsplit_once(' ').expect("name and signature");
        // Flip a bit of the decoded signature itself: editing a base64 character could
        // change only the unused padding bits, which decode to the same signature.
        let mut bytes = STANDARD.decode(blob).expect("base64 signature");
        let last = bytes.len() - 1;
        bytes[last] ^= 0x01;
        format!("{prefix} {}\n", STANDARD.encode(bytes))
    };
    let forged = format!(
        "{checkpoint_text}\n{forged_log_signature}{}",
        trusted.cosign(&checkpoint_text, time)
    );
    let (status, answer) = store_witnessed(&cluster, &forged).await;
    assert_eq!(status, 400, "a forged log signature: {answer}");
    let (status, _) = text(&cluster.url(0, "/v1/transparency/checkpoint/witnessed")).await;
    assert_eq!(status, 404, "nothing refused may have been stored");

    let good = cosigned_by(&trusted);
    let (status, answer) = store_witnessed(&cluster, &good).await;
    assert_eq!((status, answer.as_str()), (200, r#"{"stored":true}"#));
    let (status, stored) = text(&cluster.url(0, "/v1/transparency/checkpoint/witnessed")).await;
    assert_eq!((status, stored), (200, good.clone()));
    cli_fetches_and_verifies(&cluster, &good, &trusted.vkey(), &stranger.vkey()).await;
    // The same checkpoint cosigned again, twice, by a witness this node does not know
    // (an auditor may): its lines merge in, one per signer, the later in place of the
    // earlier, so posting again and again does not grow the note.
    for later in 1..=2 {
        let with_stranger = format!("{good}{}", stranger.cosign(&checkpoint_text, time + later));
        let (status, answer) = store_witnessed(&cluster, &with_stranger).await;
        assert_eq!(status, 200, "{answer}");
    }
    let (_, merged) = text(&cluster.url(0, "/v1/transparency/checkpoint/witnessed")).await;
    assert_eq!(
        merged,
        format!("{good}{}", stranger.cosign(&checkpoint_text, time + 2))
    );
    let (status, answer) = store_witnessed(&cluster, &good).await;
    assert_eq!(status, 200, "{answer}");

    let output = Command::new(env!("CARGO_BIN_EXE_lineage-node"))
        .args(["run", "--id", "1", "--listen", "127.0.0.1:1"])
        .args(["--data-dir", "/nonexistent", "--keys-dir", "/nonexistent"])
        .args(["--witness-key", "w1.test+00000000+not-a-key"])
        .output()
        .expect("run lineage-node");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("witness key"), "{stderr}");
}

/// `lineage checkpoint fetch` and `verify`, run as the binary: the fetched note is the
/// stored one and verifies with the trusted witness; an unknown witness, a quorum above
/// the cosigners and a changed byte each fail with exit 1 and say why.
async fn cli_fetches_and_verifies(cluster: &Cluster, stored: &str, trusted: &str, stranger: &str) {
    let lineage = util::lineage_bin();
    let dir = tempfile::tempdir().expect("tempdir");
    let fetched = dir.path().join("witnessed.txt");
    let output = Command::new(&lineage)
        .args(["checkpoint", "fetch", "--url", &cluster.url(0, ""), "--out"])
        .arg(&fetched)
        .env_remove("LINEAGE_URL")
        .output()
        .expect("run lineage checkpoint fetch");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(std::fs::read_to_string(&fetched).expect("fetched"), stored);
    let public_key = cluster.public_key().await;
    let verify = |note: &std::path::Path, witness: &str, quorum: &str| {
        let output = Command::new(&lineage)
            .args(["checkpoint", "verify"])
            .arg(note)
            .args(["--public-key", &public_key, "--witness-key", witness])
            .args(["--quorum", quorum])
            .output()
            .expect("run lineage checkpoint verify");
        (
            output.status.code(),
            String::from_utf8_lossy(&output.stdout).into_owned(),
        )
    };
    let (code, out) = verify(&fetched, trusted, "1");
    assert_eq!(code, Some(0), "{out}");
    assert!(out.starts_with("OK  lineage.local/cluster size "), "{out}");
    assert!(out.contains("cosigned by w1.test"), "{out}");
    let (code, out) = verify(&fetched, stranger, "1");
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("0 of the required 1 witnesses"), "{out}");
    let (code, out) = verify(&fetched, trusted, "2");
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("1 of the required 2 witnesses"), "{out}");
    let tampered = dir.path().join("tampered.txt");
    let root_line = stored.lines().nth(2).expect("root line");
    let other_root = STANDARD.encode([0u8; 32]);
    std::fs::write(&tampered, stored.replacen(root_line, &other_root, 1)).expect("write");
    let (code, out) = verify(&tampered, trusted, "1");
    assert_eq!(code, Some(1), "{out}");
    assert!(out.starts_with("FAILED  "), "{out}");
}

/// A signed checkpoint's size and root.
fn size_and_root(note: &str) -> (u64, [u8; 32]) {
    let mut lines = note.lines().skip(1);
    let size = lines
        .next()
        .and_then(|l| l.parse().ok())
        .expect("size line");
    let root = lines
        .next()
        .and_then(|l| STANDARD.decode(l).ok())
        .and_then(|b| <[u8; 32]>::try_from(b).ok())
        .expect("root line");
    (size, root)
}

fn hashes(proof: &Value) -> Vec<[u8; 32]> {
    proof
        .as_array()
        .expect("a proof array")
        .iter()
        .map(|h| {
            let bytes = STANDARD
                .decode(h.as_str().expect("base64"))
                .expect("base64");
            <[u8; 32]>::try_from(bytes).expect("32 bytes")
        })
        .collect()
}

async fn json_at(url: &str) -> (u16, Value) {
    let (status, body) = text(url).await;
    (status, serde_json::from_str(&body).unwrap_or(Value::Null))
}

/// The latest checkpoint, once the heads log holds at least `size` statements.
async fn checkpoint_of_at_least(cluster: &Cluster, size: u64) -> (u64, [u8; 32]) {
    let start = Instant::now();
    loop {
        let (status, note) = text(&cluster.url(0, "/v1/transparency/checkpoint")).await;
        assert_eq!(status, 200, "{note}");
        let (got, root) = size_and_root(&note);
        if got >= size {
            return (got, root);
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "size {got} < {size}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `agent`'s head proof at `size` verifies against `root`; returns the answer.
async fn head_proof_verifies(cluster: &Cluster, agent: &str, size: u64, root: &[u8; 32]) -> Value {
    let path = format!("/v1/agents/{agent}/head-proof?size={size}");
    let (status, body) = json_at(&cluster.url(0, &path)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["tree_size"], size, "{body}");
    let statement: lineage_core::heads::HeadStatement =
        serde_json::from_value(body["statement"].clone()).expect("a statement");
    assert_eq!(statement.agent_id, agent);
    let index = body["index"].as_u64().expect("index");
    lineage_core::transparency::verify_inclusion(
        root,
        size,
        index,
        statement.to_leaf().as_bytes(),
        &hashes(&body["proof"]),
    )
    .unwrap_or_else(|e| panic!("{agent} at {size}: {e}: {body}"));
    body
}

/// `PROOF(old, size)` from the node verifies between the two roots; returns the answer.
async fn consistency_verifies(
    cluster: &Cluster,
    (old, old_root): (u64, [u8; 32]),
    (size, root): (u64, [u8; 32]),
) -> Value {
    let path = format!("/v1/transparency/proof/consistency?old={old}&size={size}");
    let (status, body) = json_at(&cluster.url(0, &path)).await;
    assert_eq!(status, 200, "{body}");
    lineage_core::transparency::verify_consistency(
        &old_root,
        old,
        &root,
        size,
        &hashes(&body["proof"]),
    )
    .unwrap_or_else(|e| panic!("{old} -> {size}: {e}: {body}"));
    body
}

/// The heads log's proofs over HTTP at its edges: sizes 0 and 1, and a tree past 256
/// statements (whose subtrees the node keeps on disk, hashing smaller ranges from the
/// stored leaves), before and after a kill -9 and restart (the tree's right edge read
/// back). Every head proof verifies against its signed checkpoint's root, and every
/// consistency proof between the checkpoints seen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heads_proofs_hold_at_sizes_zero_one_and_past_a_stored_chunk() {
    let cluster = Cluster::start_with(1, &["--heads-interval-ms", "50"]).await;
    let policy = json!({"budget": 10, "scar_limit": 3, "tools": {"t": {"cost": 1}}});

    let empty = checkpoint_of_at_least(&cluster, 0).await;
    assert_eq!(empty.0, 0);
    let sha256_of_nothing: [u8; 32] = {
        use sha2::Digest;
        sha2::Sha256::digest([]).into()
    };
    assert_eq!(empty.1, sha256_of_nothing, "the empty tree's root");
    let body = consistency_verifies(&cluster, empty, empty).await;
    assert_eq!(body["proof"], json!([]));
    let (status, body) = json_at(&cluster.url(0, "/v1/agents/a0/head-proof")).await;
    assert_eq!(status, 404, "{body}");

    cluster.create_agent(0, "a0", policy.clone()).await;
    let one = checkpoint_of_at_least(&cluster, 1).await;
    assert_eq!(one.0, 1, "one agent, one statement");
    let body = head_proof_verifies(&cluster, "a0", 1, &one.1).await;
    assert_eq!(
        (body["index"].as_u64(), &body["proof"]),
        (Some(0), &json!([]))
    );
    consistency_verifies(&cluster, empty, one).await;
    consistency_verifies(&cluster, one, one).await;

    let agents: Vec<String> = (0..300).map(|i| format!("b{i:03}")).collect();
    for agent in &agents {
        cluster.create_agent(0, agent, policy.clone()).await;
    }
    let many = checkpoint_of_at_least(&cluster, 301).await;
    let before = consistency_verifies(&cluster, one, many).await;
    let mut proofs = Vec::new();
    for agent in ["a0", "b000", "b150", "b299"] {
        proofs.push(head_proof_verifies(&cluster, agent, many.0, &many.1).await);
    }
    // The root the node signs is the RFC 6962 root of the leaves it serves, computed
    // here from scratch (a wrong stored subtree would give proofs that agree with it).
    let (status, page) = json_at(&cluster.url(
        0,
        &format!("/v1/transparency/leaves?start=0&end={}", many.0),
    ))
    .await;
    assert_eq!(status, 200, "{page}");
    let leaves: Vec<String> = page["leaves"]
        .as_array()
        .expect("leaves")
        .iter()
        .map(|l| {
            serde_json::from_value::<lineage_core::heads::HeadStatement>(l.clone())
                .expect("a statement")
                .to_leaf()
        })
        .collect();
    assert_eq!(leaves.len() as u64, many.0);
    assert_eq!(
        lineage_core::transparency::root(&leaves),
        many.1,
        "the signed root"
    );

    // Two agents stated again (each round replaces their last statement in the summed
    // up last statements, which open checks against the index).
    for agent in ["a0", "b150"] {
        let (status, body) = cluster
            .post_until_served(
                0,
                &format!("/v1/agents/{agent}/actions"),
                &cluster.admin.clone(),
                json!({"tool": "t", "input": {}}),
                &format!("{agent}-again"),
            )
            .await;
        assert_eq!(status, 200, "{body}");
    }
    checkpoint_of_at_least(&cluster, many.0 + 2).await;
    // A clean stop first: the file then holds every round, and open checks it.
    let moved_aside = || {
        std::fs::read_dir(cluster.data_dir(0))
            .unwrap()
            .flatten()
            .any(|e| e.file_name().to_string_lossy().contains("damaged"))
    };
    cluster.stop_gracefully(0);
    cluster.start_node(0);
    cluster.wait_for_leader(Duration::from_secs(20)).await;
    assert!(!moved_aside(), "an intact state file counted as damaged");

    cluster.kill(0);
    cluster.start_node(0);
    cluster.wait_for_leader(Duration::from_secs(20)).await;
    assert!(!moved_aside(), "an intact state file counted as damaged");
    let after = consistency_verifies(&cluster, one, many).await;
    assert_eq!(
        after, before,
        "the consistency proof changed across a restart"
    );
    for (agent, before) in ["a0", "b000", "b150", "b299"].into_iter().zip(&proofs) {
        let after = head_proof_verifies(&cluster, agent, many.0, &many.1).await;
        assert_eq!(
            &after, before,
            "{agent}'s head proof changed across a restart"
        );
    }
}
