//! A node never ignores the reference guard's agent logs in its data directory: started
//! in drop-in mode on a reference guard's directory (`GUARD_DATA_DIR` with
//! `agents/<id>.jsonl`, here a log the reference server itself wrote), it refuses to
//! start and names the file; with `LINEAGE_IGNORE_REFERENCE_LOGS=1` it starts, and that
//! id can never be created afresh (409 `agent_id_reserved`). A log the cluster holds (same
//! genesis, and its head is the cluster's record at that seq) is no obstacle; one that
//! went on past the cluster's copy is refused.

#[path = "cluster/util.rs"]
mod util;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

const ADMIN: &str = "reference-logs-test-admin-token-0123456789";

fn fixture(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../core/tests/fixtures/reference-logs")
        .join(name)
}

/// `lineage-node` in drop-in mode on `data`, with `extra` environment.
fn drop_in(data: &Path, bind: &str, extra: &[(&str, &str)]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_lineage-node"));
    command
        .env("GUARD_DATA_DIR", data)
        .env("GUARD_BIND", bind)
        .env("GUARD_ADMIN_TOKEN", ADMIN)
        .env_remove("LINEAGE_IGNORE_REFERENCE_LOGS")
        .stdin(Stdio::null());
    for (name, value) in extra {
        command.env(name, value);
    }
    command
}

/// Runs `command`, which must refuse to start: exits 1 within 30 s. Returns its stderr.
fn refused(mut command: Command) -> String {
    let mut child = command
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run");
    let status = util::exit_within(&mut child, Duration::from_secs(30))
        .unwrap_or_else(|| panic!("the node started instead of refusing"));
    let mut stderr = String::new();
    if let Some(mut pipe) = child.stderr.take() {
        let _ = std::io::Read::read_to_string(&mut pipe, &mut stderr);
    }
    assert_eq!(status.code(), Some(1), "{stderr}");
    stderr
}

struct Running(Child);

/// Starts the node, its stderr to `log`.
fn start(data: &Path, bind: &str, extra: &[(&str, &str)], log: &Path) -> Running {
    let stderr = std::fs::File::create(log).expect("log file");
    Running(
        drop_in(data, bind, extra)
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("start"),
    )
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn wait_ready(http: &reqwest::Client, base: &str, node: &mut Running, log: &Path) {
    let start = Instant::now();
    loop {
        if let Ok(reply) = http.get(format!("{base}/readyz")).send().await {
            if reply.status().is_success() {
                return;
            }
        }
        if node.0.try_wait().expect("try_wait").is_some() {
            panic!(
                "the node exited: {}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        assert!(start.elapsed() < Duration::from_secs(20), "not ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn create(http: &reqwest::Client, base: &str, id: &str) -> (u16, Value) {
    let reply = http
        .post(format!("{base}/v1/agents"))
        .bearer_auth(ADMIN)
        .json(&json!({"agent_id": id, "policy": {"budget": 10, "scar_limit": 3, "tools": {"work": {"cost": 1}}}}))
        .send()
        .await
        .expect("create");
    let status = reply.status().as_u16();
    (status, reply.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reference_guards_logs_are_never_ignored() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("guard-data");
    std::fs::create_dir_all(data.join("agents")).unwrap();
    std::fs::copy(fixture("budget.jsonl"), data.join("agents/budget.jsonl")).unwrap();
    let bind = format!("127.0.0.1:{}", util::free_port());
    let base = format!("http://{bind}");
    let node_log = dir.path().join("node.stderr");

    // Refused, with the file named and the way out said.
    let stderr = refused(drop_in(&data, &bind, &[]));
    assert!(stderr.contains("agents/budget.jsonl"), "{stderr}");
    assert!(
        stderr.contains("LINEAGE_IGNORE_REFERENCE_LOGS=1"),
        "{stderr}"
    );
    let before = std::fs::read(fixture("budget.jsonl")).unwrap();
    assert_eq!(
        std::fs::read(data.join("agents/budget.jsonl")).unwrap(),
        before,
        "the reference log was written to"
    );

    // Started anyway: the id is reserved, others are not.
    let http = reqwest::Client::new();
    let mut node = start(
        &data,
        &bind,
        &[("LINEAGE_IGNORE_REFERENCE_LOGS", "1")],
        &node_log,
    );
    wait_ready(&http, &base, &mut node, &node_log).await;
    let (status, body) = create(&http, &base, "budget").await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(body["code"], "agent_id_reserved", "{body}");
    let (status, body) = create(&http, &base, "fresh").await;
    assert_eq!(status, 200, "{body}");
    drop(node);

    // A log the cluster holds (its own agent's, written out as the reference would) is no
    // obstacle: the node starts without the override. First, the log to write.
    let mut node = start(
        &data,
        &bind,
        &[("LINEAGE_IGNORE_REFERENCE_LOGS", "1")],
        &node_log,
    );
    wait_ready(&http, &base, &mut node, &node_log).await;
    let log: Value = http
        .get(format!("{base}/v1/agents/fresh/log"))
        .bearer_auth(ADMIN)
        .send()
        .await
        .expect("log")
        .json()
        .await
        .expect("log JSON");
    drop(node);
    let records = log["records"].as_array().expect("records").clone();
    assert!(!records.is_empty(), "{log}");
    let lines: String = records
        .iter()
        .map(|r| format!("{}\n", serde_json::to_string(r).unwrap()))
        .collect();
    std::fs::remove_file(data.join("agents/budget.jsonl")).unwrap();
    std::fs::write(data.join("agents/fresh.jsonl"), &lines).unwrap();
    let mut node = start(&data, &bind, &[], &node_log);
    wait_ready(&http, &base, &mut node, &node_log).await;

    // The file one record short: the cluster went on from its head, so it still holds it.
    drop(node);
    let short: String = lines
        .lines()
        .take(records.len() - 1)
        .map(|l| format!("{l}\n"))
        .collect();
    assert!(records.len() > 1, "{log}");
    std::fs::write(data.join("agents/fresh.jsonl"), short).unwrap();
    let mut node = start(&data, &bind, &[], &node_log);
    wait_ready(&http, &base, &mut node, &node_log).await;
    drop(node);

    // The file went on past the cluster's copy (a record the cluster never had): refused.
    let mut extra: Value = records.last().cloned().expect("a record");
    extra["seq"] = json!(records.len());
    let grown = format!("{lines}{}\n", serde_json::to_string(&extra).unwrap());
    std::fs::write(data.join("agents/fresh.jsonl"), grown).unwrap();
    let stderr = refused(drop_in(&data, &bind, &[]));
    assert!(stderr.contains("ends elsewhere"), "{stderr}");
}
