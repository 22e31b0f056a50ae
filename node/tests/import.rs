//! Moving a reference guard's data directory into a live three-node cluster with
//! `lineage import --from DIR` (the binary), through Raft:
//!
//! - the cluster's keys come from the reference (`lineage-node keygen --from-reference`),
//!   so imported logs keep their original signatures and every agent token works;
//! - each agent's status after the import is the one the reference guard reaches on the
//!   same file (the embedded guard, which writes the reference's format), every replica
//!   holds the same lines, and the cluster goes on deciding for the agent;
//! - the reference's repairs, in memory only: a torn last line is dropped and reported;
//!   a missing termination is sealed at commit and reported; the source files are never
//!   written;
//! - a tampered log is refused whole (exit 1), nothing of it imported;
//! - an import cut short resumes from the cluster's head, an agent being imported
//!   answers 503 and cannot be created (409), and a second run changes nothing.

#[path = "cluster/util.rs"]
mod util;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use lineage_core::guard::Outcome;
use lineage_core::{AuditKey, Guard, Policy, ToolRule};
use serde_json::{json, Value};
use util::{lineage_bin, Cluster};

fn policy(budget: u64) -> Policy {
    Policy::new(budget)
        .allow("work", ToolRule::cost(1))
        .allow("pay", ToolRule::cost(3).with_approval())
}

/// A reference guard's data directory: keys, and agent logs the embedded guard wrote
/// (the reference's format) with the statuses it reached.
fn reference_dir(dir: &Path) -> Vec<(String, Value)> {
    let keys = dir.join("keys");
    std::fs::create_dir_all(&keys).unwrap();
    let key = AuditKey::create(keys.join("audit.key")).unwrap();
    lineage_core::keys::create_secret_file(&keys.join("token.key")).unwrap();
    let agents = dir.join("agents");
    std::fs::create_dir_all(&agents).unwrap();
    let mut statuses = Vec::new();
    // alpha: work, an approval, a failure (a scar).
    let mut alpha =
        Guard::create(agents.join("alpha.jsonl"), key.clone(), "alpha", policy(50)).unwrap();
    for _ in 0..40 {
        alpha
            .request("work", json!({"n": 1.25e-7, "text": "ünïcode"}), None)
            .unwrap();
    }
    let pending = alpha.request("pay", json!({"eur": 12}), None).unwrap();
    let action = pending.action_id().to_string();
    alpha.approve(&action, "alice").unwrap();
    alpha.report(&action, Outcome::failure("bounced")).unwrap();
    statuses.push((
        "alpha".to_string(),
        serde_json::to_value(alpha.status()).unwrap(),
    ));
    // spent: its budget used up, terminated by the guard.
    let mut spent =
        Guard::create(agents.join("spent.jsonl"), key.clone(), "spent", policy(2)).unwrap();
    spent.request("work", json!({}), None).unwrap();
    spent.request("work", json!({}), None).unwrap();
    statuses.push((
        "spent".to_string(),
        serde_json::to_value(spent.status()).unwrap(),
    ));
    // cut: the same, with its termination record lost (the reference would add one).
    let mut cut = Guard::create(agents.join("cut.jsonl"), key.clone(), "cut", policy(2)).unwrap();
    cut.request("work", json!({}), None).unwrap();
    cut.request("work", json!({}), None).unwrap();
    let expected_cut = serde_json::to_value(cut.status()).unwrap();
    drop(cut);
    drop_last_line(&agents.join("cut.jsonl"));
    statuses.push(("cut".to_string(), expected_cut));
    // torn: a write cut mid-line after its last whole record.
    let mut torn =
        Guard::create(agents.join("torn.jsonl"), key.clone(), "torn", policy(9)).unwrap();
    torn.request("work", json!({}), None).unwrap();
    statuses.push((
        "torn".to_string(),
        serde_json::to_value(torn.status()).unwrap(),
    ));
    drop(torn);
    // Cut inside a character ("ü" is two bytes): the reference drops such a tail too.
    append(
        &agents.join("torn.jsonl"),
        b"{\"seq\":4,\"timestamp\":\"\xc3",
    );
    // tampered: a spend lowered in the middle of the log.
    let mut bad = Guard::create(agents.join("tampered.jsonl"), key, "tampered", policy(9)).unwrap();
    bad.request("pay", json!({"eur": 900}), None).unwrap();
    drop(bad);
    let text = std::fs::read_to_string(agents.join("tampered.jsonl")).unwrap();
    std::fs::write(
        agents.join("tampered.jsonl"),
        text.replacen("\"eur\":900", "\"eur\":9", 1),
    )
    .unwrap();
    statuses
}

fn drop_last_line(path: &Path) {
    let text = std::fs::read_to_string(path).unwrap();
    let mut lines: Vec<&str> = text.lines().collect();
    lines.pop();
    std::fs::write(path, lines.join("\n") + "\n").unwrap();
}

fn append(path: &Path, bytes: &[u8]) {
    use std::io::Write;
    let mut file = std::fs::OpenOptions::new().append(true).open(path).unwrap();
    file.write_all(bytes).unwrap();
}

/// Every file's bytes, to show the import never wrote the source.
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut files: Vec<_> = std::fs::read_dir(dir.join("agents"))
        .unwrap()
        .flatten()
        .map(|e| (e.path(), std::fs::read(e.path()).unwrap()))
        .collect();
    files.sort();
    files
}

struct Run {
    code: i32,
    out: String,
    err: String,
}

fn import(cluster: &Cluster, reference: &Path, admin: &Path) -> Run {
    let urls: Vec<String> = (0..3).map(|i| cluster.url(i, "")).collect();
    let output = std::process::Command::new(lineage_bin())
        .args(["--url", &urls.join(","), "--token-file"])
        .arg(admin)
        .arg("import")
        .arg("--from")
        .arg(reference)
        .output()
        .expect("run lineage import");
    Run {
        code: output.status.code().unwrap_or(-1),
        out: String::from_utf8_lossy(&output.stdout).to_string(),
        err: String::from_utf8_lossy(&output.stderr).to_string(),
    }
}

/// `id`'s status on the cluster is `expected` (the reference's; the cut agent has the
/// sealed termination on top), its log verifies, and every replica holds the source's
/// lines.
async fn holds_as_the_reference_left_it(
    cluster: &Cluster,
    leader: usize,
    reference: &Path,
    id: &str,
    expected: &Value,
) {
    let (status, got) = cluster
        .get(leader, &format!("/v1/agents/{id}"), &cluster.admin)
        .await;
    assert_eq!(status, 200, "{got}");
    let mut got = got;
    // The cluster's cut agent has the sealed termination: one record more.
    if id == "cut" {
        assert_eq!(got["alive"], false, "{got}");
        assert!(
            got["termination_reason"]
                .as_str()
                .unwrap_or_default()
                .contains("missing"),
            "{got}"
        );
        for field in ["head", "termination_reason", "alive"] {
            got[field] = expected[field].clone();
        }
    }
    assert_eq!(&got, expected, "{id}");
    let log = cluster.converged_log(id, Duration::from_secs(20)).await;
    let (_, verify) = cluster
        .get(leader, &format!("/v1/agents/{id}/verify"), &cluster.admin)
        .await;
    assert_eq!(verify["ok"], true, "{verify}");
    let bytes = std::fs::read(reference.join("agents").join(format!("{id}.jsonl"))).unwrap();
    let source = String::from_utf8_lossy(&bytes);
    let mut lines: Vec<&str> = source.lines().collect();
    // Only torn.jsonl ends in a partial write, which the import drops.
    let torn = lines
        .last()
        .is_some_and(|line| serde_json::from_str::<Value>(line).is_err());
    assert_eq!(torn, id == "torn", "{id}: a last line that does not parse");
    if torn {
        lines.pop();
    }
    // Every complete line is on the replicas, and the cut agent's sealed termination
    // after them.
    let sealed = usize::from(id == "cut");
    assert_eq!(
        log.len(),
        lines.len() + sealed,
        "{id}: records on the replicas"
    );
    for (line, record) in lines.iter().zip(&log) {
        let parsed: Value = serde_json::from_str(line).unwrap();
        assert_eq!(&parsed, record, "{id}: a record changed on the way");
    }
    if sealed == 1 {
        assert_eq!(log[lines.len()]["kind"], "terminated", "{id}: {log:?}");
    }
}

/// The tampered log's id is reserved for good, on every node: a fresh agent of that id
/// would be the refund the guard exists to prevent.
async fn the_tampered_id_is_reserved_everywhere(cluster: &Cluster, leader: usize) {
    let (status, body) = cluster
        .post(
            leader,
            "/v1/agents",
            &cluster.admin,
            json!({"agent_id": "tampered", "policy": {"budget": 5, "scar_limit": 3, "tools": {}}}),
            None,
        )
        .await;
    assert_eq!(
        (status, &body["code"]),
        (409, &json!("agent_id_reserved")),
        "{body}"
    );
    for node in 0..3 {
        let start = std::time::Instant::now();
        loop {
            let path = "/v1/agents/tampered/import?local=true";
            let (_, state) = cluster.get(node, path, &cluster.admin).await;
            if state["state"] == "tombstoned" {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "node {node}: {state}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// The guard counters hold nothing of the imported history.
async fn the_metrics_start_at_the_import(cluster: &Cluster, leader: usize) {
    let metrics = cluster.metrics(leader).await;
    for family in [
        "lineage_scars_total",
        "lineage_terminations_total",
        "lineage_decisions_total",
    ] {
        let counted: f64 = metrics
            .iter()
            .filter(|(name, _)| name.starts_with(family))
            .map(|(_, value)| value)
            .sum();
        assert_eq!(counted, 0.0, "{family} counts imported history");
    }
}

/// The first run's report: each file's outcome, then a summary adding them up.
fn the_report_says_what_was_done(report: &str, reference: &Path) {
    for id in ["alpha", "spent", "cut", "torn"] {
        assert!(
            report.contains(&format!(
                "imported {}",
                reference
                    .join("agents")
                    .join(format!("{id}.jsonl"))
                    .display()
            )),
            "{report}"
        );
    }
    assert!(report.contains("dropped a torn last line"), "{report}");
    assert!(
        report.contains("cut.jsonl (6 records, sealed 1 missing termination"),
        "{report}"
    );
    assert!(
        report.contains("REFUSED")
            && report.contains("tampered.jsonl")
            && report.contains("fails verification"),
        "{report}"
    );
    // The summary adds up the lines above it.
    let records: usize = report
        .lines()
        .filter_map(|l| {
            l.strip_prefix("imported ")?
                .split_once(" (")?
                .1
                .split(' ')
                .next()
        })
        .map(|n| n.parse::<usize>().unwrap())
        .sum();
    assert!(records > 0, "{report}");
    assert!(
        report.contains(&format!(
            "summary: 4 agent(s) imported ({records} records), 0 already imported, 1 torn \
             tail(s) dropped, 1 termination(s) sealed, 1 failed verification (ids reserved \
             for good), 1 refused in all"
        )),
        "{report}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reference_data_directory_moves_in_through_raft() {
    let scratch = tempfile::tempdir().unwrap();
    let reference = scratch.path().join("guard-data");
    let statuses = reference_dir(&reference);
    let before = snapshot(&reference);
    let cluster = Cluster::start_from_reference(3, &reference).await;
    let leader = cluster.wait_for_leader(Duration::from_secs(20)).await;
    let admin = scratch.path().join("admin.token");
    std::fs::write(&admin, &cluster.admin).unwrap();

    let run = import(&cluster, &reference, &admin);
    assert_eq!(
        run.code, 1,
        "the tampered log makes the run fail: {}{}",
        run.out, run.err
    );
    let report = run.out.clone();
    the_report_says_what_was_done(&report, &reference);
    assert_eq!(snapshot(&reference), before, "the source was written");

    // Every status is the reference's; every replica holds the same lines.
    for (id, expected) in &statuses {
        holds_as_the_reference_left_it(&cluster, leader, &reference, id, expected).await;
    }
    let (status, _) = cluster
        .get(leader, "/v1/agents/tampered", &cluster.admin)
        .await;
    assert_eq!(status, 404, "nothing of a tampered log is imported");
    assert!(report.contains("reserved for good"), "{report}");
    the_tampered_id_is_reserved_everywhere(&cluster, leader).await;

    // An import is history: the metrics start at it, so it pages nobody.
    the_metrics_start_at_the_import(&cluster, leader).await;

    // The agent's old token works, and the cluster decides on from the imported state.
    let token_key =
        lineage_core::keys::read_secret_file(&reference.join("keys/token.key")).unwrap();
    let token = lineage_core::token::issue(&token_key, "alpha");
    let (_, given) = cluster
        .get(leader, "/v1/agents/alpha/token", &cluster.admin)
        .await;
    assert_eq!(given["token"], json!(token));
    let (status, decision) = cluster
        .post(
            (leader + 1) % 3,
            "/v1/agents/alpha/actions",
            &token,
            json!({"tool": "work"}),
            None,
        )
        .await;
    assert_eq!(
        (status, &decision["decision"]),
        (200, &json!("allowed")),
        "{decision}"
    );
    let spent_before = statuses[0].1["spent"].as_u64().unwrap();
    assert_eq!(
        decision["remaining"],
        json!(50 - spent_before - 1),
        "{decision}"
    );

    // What happens after the import counts.
    let metrics = cluster.metrics(leader).await;
    let allowed = metrics
        .get("lineage_decisions_total{code=\"\",outcome=\"allowed\"}")
        .copied();
    assert_eq!(allowed, Some(1.0), "{metrics:?}");

    // A second run changes nothing.
    let again = import(&cluster, &reference, &admin);
    assert_eq!(again.code, 1, "{}{}", again.out, again.err);
    assert_eq!(
        again.out.matches("already imported").count(),
        5,
        "4 files and the summary: {}",
        again.out
    );
    assert!(
        again
            .out
            .contains("summary: 0 agent(s) imported (0 records), 4 already imported"),
        "{}",
        again.out
    );

    a_follower_wiped_after_the_import_gets_it_by_snapshot(&cluster, leader, &statuses).await;
}

/// A follower wiped after the import, once the leader's log is purged behind a snapshot
/// (`POST /v1/node/snapshot`), comes back by that snapshot alone: it holds every imported
/// agent's log as the leader does, and the tombstone.
async fn a_follower_wiped_after_the_import_gets_it_by_snapshot(
    cluster: &Cluster,
    leader: usize,
    statuses: &[(String, Value)],
) {
    let victim = (leader + 1) % 3;
    cluster.kill(victim);
    cluster.wipe(victim);
    let (status, body) = cluster
        .post(leader, "/v1/node/snapshot", &cluster.admin, json!({}), None)
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["purged_index"], body["snapshot_index"], "{body}");
    cluster.start_node(victim);
    cluster.wait_ready(victim, Duration::from_secs(30)).await;
    for (id, _) in statuses {
        let want = cluster.local_log(leader, id).await;
        assert!(want.as_ref().is_some_and(|log| !log.is_empty()), "{id}");
        let start = std::time::Instant::now();
        loop {
            let got = cluster.local_log(victim, id).await;
            if got == want {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "{id} on the wiped node: {got:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    the_tampered_id_is_reserved_everywhere(cluster, leader).await;
}

/// `lineage-node import --from REF` on node 0's data directory and keys (its own Raft),
/// killed if it takes over three minutes.
fn node_import(cluster: &Cluster, reference: &Path) -> Run {
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_lineage-node"))
        .arg("import")
        .arg("--from")
        .arg(reference)
        .arg("--data-dir")
        .arg(cluster.data_dir(0))
        .arg("--keys-dir")
        .arg(cluster.dir.path().join("keys"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run lineage-node import");
    let started = std::time::Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if started.elapsed() > Duration::from_secs(180) {
            let _ = child.kill();
            panic!("lineage-node import did not finish within 180 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let output = child.wait_with_output().expect("output");
    Run {
        code: output.status.code().unwrap_or(-1),
        out: String::from_utf8_lossy(&output.stdout).to_string(),
        err: String::from_utf8_lossy(&output.stderr).to_string(),
    }
}

/// `lineage-node import` without `--url` goes through the node's own Raft: the node runs
/// as a single-node cluster for the import and stops cleanly after. Started again, it
/// serves every agent as the reference left it and keeps the tampered id reserved; a
/// second run finds everything imported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lineage_node_import_goes_through_the_nodes_own_raft() {
    let scratch = tempfile::tempdir().unwrap();
    let reference = scratch.path().join("guard-data");
    let statuses = reference_dir(&reference);
    let before = snapshot(&reference);
    let cluster = Cluster::prepare_from_reference(1, &reference);

    let run = node_import(&cluster, &reference);
    assert_eq!(
        run.code, 1,
        "the tampered log fails the run: {}{}",
        run.out, run.err
    );
    assert!(
        run.out
            .contains("cut.jsonl (6 records, sealed 1 missing termination"),
        "{}",
        run.out
    );
    assert!(
        run.out.contains("REFUSED") && run.out.contains("tampered.jsonl"),
        "{}",
        run.out
    );
    assert!(
        run.err.contains("to import through its Raft"),
        "{}",
        run.err
    );
    assert!(
        cluster.data_dir(0).join("clean-stop").exists(),
        "the node did not stop cleanly: {}",
        run.err
    );
    assert_eq!(snapshot(&reference), before, "the source was written");

    cluster.start_node(0);
    let leader = cluster.wait_for_leader(Duration::from_secs(20)).await;
    for (id, expected) in &statuses {
        holds_as_the_reference_left_it(&cluster, leader, &reference, id, expected).await;
    }
    let (_, state) = cluster
        .get(0, "/v1/agents/tampered/import?local=true", &cluster.admin)
        .await;
    assert_eq!(state["state"], "tombstoned", "{state}");

    cluster.stop_gracefully(0);
    let again = node_import(&cluster, &reference);
    assert_eq!(again.code, 1, "{}{}", again.out, again.err);
    assert_eq!(
        again.out.matches("already imported").count(),
        5,
        "{}",
        again.out
    );
}

/// A reference data directory with keys and no agents yet; its audit key.
fn empty_reference(reference: &Path) -> AuditKey {
    std::fs::create_dir_all(reference.join("keys")).unwrap();
    std::fs::create_dir_all(reference.join("agents")).unwrap();
    lineage_core::keys::create_secret_file(&reference.join("keys/token.key")).unwrap();
    AuditKey::create(reference.join("keys/audit.key")).unwrap()
}

/// `lineage audit fetch AGENT` from node `node`: the bytes it writes.
fn audit_fetch(
    cluster: &Cluster,
    node: usize,
    admin: &Path,
    agent: &str,
    scratch: &Path,
) -> Vec<u8> {
    let out = scratch.join(format!("{agent}.fetched.jsonl"));
    let output = std::process::Command::new(lineage_bin())
        .args(["--url", &cluster.url(node, ""), "--token-file"])
        .arg(admin)
        .args(["audit", "fetch", agent, "--out"])
        .arg(&out)
        .output()
        .expect("run lineage audit fetch");
    assert!(output.status.success(), "{output:?}");
    std::fs::read(&out).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[expect(
    clippy::too_many_lines,
    reason = "one scenario, step by step: an import cut short, then finished"
)]
async fn an_import_cut_short_resumes_and_is_served_only_once_committed() {
    let scratch = tempfile::tempdir().unwrap();
    let reference = scratch.path().join("guard-data");
    let key = empty_reference(&reference);
    let path = reference.join("agents/long.jsonl");
    let mut long = Guard::create(&path, key, "long", policy(100_000)).unwrap();
    for i in 0..2_000 {
        long.request("work", json!({"i": i, "pad": "x".repeat(100)}), None)
            .unwrap();
    }
    let expected = serde_json::to_value(long.status()).unwrap();
    drop(long);
    let cluster = Cluster::start_from_reference(3, &reference).await;
    let leader = cluster.wait_for_leader(Duration::from_secs(20)).await;

    // Begun and one batch sent, as a run killed midway leaves it.
    let text = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let genesis: Value = serde_json::from_str(lines[0]).unwrap();
    let last: Value = serde_json::from_str(lines[lines.len() - 1]).unwrap();
    let sha256 = {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(text.as_bytes()))
    };
    let begin = |sha256: &str| {
        json!({"genesis_hash": genesis["hash"], "source_sha256": sha256,
               "head": {"seq": last["seq"], "hash": last["hash"]}})
    };
    let path_begin = "/v1/agents/long/import/begin";
    let (status, body) = cluster
        .post(leader, path_begin, &cluster.admin, begin(&sha256), None)
        .await;
    assert_eq!(status, 200, "{body}");
    // Another copy of the file (here: another SHA-256) may not take the import over.
    let (status, body) = cluster
        .post(
            leader,
            path_begin,
            &cluster.admin,
            begin(&"11".repeat(32)),
            None,
        )
        .await;
    assert_eq!(
        (status, &body["code"]),
        (409, &json!("import_refused")),
        "{body}"
    );
    let batch = format!("{{\"records\":[{}]}}", lines[..100].join(","));
    let reply = cluster
        .http
        .post(cluster.url(leader, "/v1/agents/long/import/records"))
        .bearer_auth(&cluster.admin)
        .header("content-type", "application/json")
        .body(batch)
        .send()
        .await
        .unwrap();
    assert_eq!(reply.status(), 200, "{:?}", reply.text().await);
    // Not served while importing, and not creatable.
    let (status, body) = cluster.get(leader, "/v1/agents/long", &cluster.admin).await;
    assert_eq!(
        (status, &body["code"]),
        (503, &json!("importing")),
        "{body}"
    );
    let (status, body) = cluster
        .post(
            leader,
            "/v1/agents",
            &cluster.admin,
            json!({"agent_id": "long", "policy": {"budget": 5, "scar_limit": 3, "tools": {}}}),
            None,
        )
        .await;
    assert_eq!(status, 409, "{body}");
    let (status, body) = cluster
        .get(leader, "/v1/agents/long/import", &cluster.admin)
        .await;
    assert_eq!(
        (status, &body["state"], &body["next_seq"]),
        (200, &json!("importing"), &json!(100)),
        "{body}"
    );

    // A node restarted meanwhile still knows the import is under way.
    let follower = (leader + 1) % 3;
    cluster.kill(follower);
    cluster.start_node(follower);
    cluster.wait_ready(follower, Duration::from_secs(30)).await;
    // Ready means it applied its own log; the import's entries may still be on their
    // way to it (a quorum acknowledged them, maybe without this node): bounded wait.
    let restarted = Instant::now();
    loop {
        let (_, body) = cluster
            .get(
                follower,
                "/v1/agents/long/import?local=true",
                &cluster.admin,
            )
            .await;
        if body["state"] == "importing" {
            break;
        }
        assert!(
            restarted.elapsed() < Duration::from_secs(20),
            "the restarted node does not know the import is under way: {body}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let admin = scratch.path().join("admin.token");
    std::fs::write(&admin, &cluster.admin).unwrap();
    let run = import(&cluster, &reference, &admin);
    assert_eq!(run.code, 0, "{}{}", run.out, run.err);
    // A long log says how far it is, to its end.
    let total = lines.len();
    assert!(
        run.err.matches("  long: ").count() == 2
            && run
                .err
                .contains(&format!("long: {total}/{total} records sent")),
        "{}",
        run.err
    );
    let (status, got) = cluster.get(leader, "/v1/agents/long", &cluster.admin).await;
    assert_eq!((status, &got), (200, &expected));
    let log = cluster.converged_log("long", Duration::from_secs(30)).await;
    assert_eq!(log.len(), lines.len());
    // `lineage audit fetch` gives back the source's bytes exactly.
    let fetched = audit_fetch(&cluster, leader, &admin, "long", scratch.path());
    assert_eq!(fetched, std::fs::read(&path).unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pending_approval_survives_and_renamed_locked_or_foreign_logs_are_refused() {
    let scratch = tempfile::tempdir().unwrap();
    let reference = scratch.path().join("guard-data");
    std::fs::create_dir_all(reference.join("keys")).unwrap();
    std::fs::create_dir_all(reference.join("agents")).unwrap();
    let key = AuditKey::create(reference.join("keys/audit.key")).unwrap();
    lineage_core::keys::create_secret_file(&reference.join("keys/token.key")).unwrap();
    let agents = reference.join("agents");
    let mut waiting = Guard::create(
        agents.join("waiting.jsonl"),
        key.clone(),
        "waiting",
        policy(9),
    )
    .unwrap();
    let pending = waiting.request("pay", json!({"eur": 7}), None).unwrap();
    let action = pending.action_id().to_string();
    drop(waiting);
    // A log copied under another name: its genesis names "waiting".
    std::fs::copy(agents.join("waiting.jsonl"), agents.join("renamed.jsonl")).unwrap();
    // A log a running reference guard still holds (its lock).
    drop(Guard::create(agents.join("busy.jsonl"), key, "busy", policy(9)).unwrap());
    let held = std::fs::File::open(agents.join("busy.jsonl")).unwrap();
    held.lock().unwrap();

    let cluster = Cluster::start_from_reference(3, &reference).await;
    let leader = cluster.wait_for_leader(Duration::from_secs(20)).await;
    let admin = scratch.path().join("admin.token");
    std::fs::write(&admin, &cluster.admin).unwrap();
    let run = import(&cluster, &reference, &admin);
    assert_eq!(run.code, 1, "{}{}", run.out, run.err);
    assert!(
        run.out.contains("REFUSED") && run.out.contains("busy.jsonl: it is locked"),
        "{}",
        run.out
    );
    assert!(
        run.out
            .contains("renamed.jsonl: its genesis names another log id"),
        "{}",
        run.out
    );
    assert!(
        run.out.contains("imported") && run.out.contains("waiting.jsonl"),
        "{}",
        run.out
    );
    // The locked file is not reserved (fix and run again); the renamed one is.
    let (_, busy) = cluster
        .get(leader, "/v1/agents/busy/import", &cluster.admin)
        .await;
    assert_eq!(busy["state"], "absent", "{busy}");
    let (_, renamed) = cluster
        .get(leader, "/v1/agents/renamed/import", &cluster.admin)
        .await;
    assert_eq!(renamed["state"], "tombstoned", "{renamed}");
    // Released, it imports.
    drop(held);
    let again = import(&cluster, &reference, &admin);
    assert!(
        again.out.contains("imported") && again.out.contains("busy.jsonl"),
        "{}",
        again.out
    );

    // The pending approval is still there, bound to its input, and approvable.
    let (status, queue) = cluster
        .get(leader, "/v1/agents/waiting/actions/pending", &cluster.admin)
        .await;
    assert_eq!(status, 200, "{queue}");
    assert_eq!(
        queue["pending"][0]["action"]["input"],
        json!({"eur": 7}),
        "{queue}"
    );
    let (status, decision) = cluster
        .post(
            leader,
            &format!("/v1/agents/waiting/actions/{action}/approve"),
            &cluster.admin,
            json!({"approver": "alice"}),
            None,
        )
        .await;
    assert_eq!(
        (status, &decision["decision"]),
        (200, &json!("allowed")),
        "{decision}"
    );

    a_foreign_directory_is_refused_whole(&cluster, leader, scratch.path(), &admin).await;
}

/// A directory signed by another key is refused whole: its logs cannot continue here.
async fn a_foreign_directory_is_refused_whole(
    cluster: &Cluster,
    leader: usize,
    scratch: &Path,
    admin: &Path,
) {
    let foreign = scratch.join("foreign");
    std::fs::create_dir_all(foreign.join("keys")).unwrap();
    std::fs::create_dir_all(foreign.join("agents")).unwrap();
    let other = AuditKey::create(foreign.join("keys/audit.key")).unwrap();
    drop(
        Guard::create(
            foreign.join("agents/stranger.jsonl"),
            other,
            "stranger",
            policy(9),
        )
        .unwrap(),
    );
    let run = import(cluster, &foreign, admin);
    assert_eq!(run.code, 1, "{}{}", run.out, run.err);
    assert!(run.err.contains("is not this cluster's"), "{}", run.err);
    let (_, stranger) = cluster
        .get(leader, "/v1/agents/stranger/import", &cluster.admin)
        .await;
    assert_eq!(stranger["state"], "absent", "{stranger}");
}
