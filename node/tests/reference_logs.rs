//! A node never ignores the reference guard's agent logs in its data directory: started
//! in drop-in mode on a reference guard's directory (`GUARD_DATA_DIR` with
//! `agents/<id>.jsonl`, here a log the reference server itself wrote), it refuses to
//! start and names the file; with `LINEAGE_IGNORE_REFERENCE_LOGS=1` it starts, and that
//! id can never be created afresh (409 `agent_id_reserved`). A log the cluster holds (same
//! genesis and head) is no obstacle.

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

struct Running(Child);

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

    // Refused, with the file named and the way out said.
    let output = drop_in(&data, &bind, &[]).output().expect("run");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
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
    let mut node = Running(
        drop_in(&data, &bind, &[("LINEAGE_IGNORE_REFERENCE_LOGS", "1")])
            .stdout(Stdio::null())
            .stderr(
                std::fs::File::create(dir.path().join("node.stderr"))
                    .expect("log")
                    .try_clone()
                    .map(Stdio::from)
                    .expect("log"),
            )
            .spawn()
            .expect("start"),
    );
    wait_ready(&http, &base, &mut node, &dir.path().join("node.stderr")).await;
    let (status, body) = create(&http, &base, "budget").await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(body["code"], "agent_id_reserved", "{body}");
    let (status, body) = create(&http, &base, "fresh").await;
    assert_eq!(status, 200, "{body}");
    drop(node);

    // A log the cluster holds (its own agent's, written out as the reference would) is no
    // obstacle: the node starts without the override.
    let mut node = Running(
        drop_in(&data, &bind, &[("LINEAGE_IGNORE_REFERENCE_LOGS", "1")])
            .stdout(Stdio::null())
            .stderr(
                std::fs::File::create(dir.path().join("node.stderr"))
                    .expect("log")
                    .try_clone()
                    .map(Stdio::from)
                    .expect("log"),
            )
            .spawn()
            .expect("start"),
    );
    wait_ready(&http, &base, &mut node, &dir.path().join("node.stderr")).await;
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
    let mut node = Running(
        drop_in(&data, &bind, &[])
            .stdout(Stdio::null())
            .stderr(
                std::fs::File::create(dir.path().join("node.stderr"))
                    .expect("log")
                    .try_clone()
                    .map(Stdio::from)
                    .expect("log"),
            )
            .spawn()
            .expect("start"),
    );
    wait_ready(&http, &base, &mut node, &dir.path().join("node.stderr")).await;

    // The same file one record short is not what the cluster holds: refused again.
    drop(node);
    let short: String = lines
        .lines()
        .take(records.len() - 1)
        .map(|l| format!("{l}\n"))
        .collect();
    if records.len() > 1 {
        std::fs::write(data.join("agents/fresh.jsonl"), short).unwrap();
        let output = drop_in(&data, &bind, &[]).output().expect("run");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains("ends elsewhere"), "{stderr}");
    }
}
