//! A full disk is admission control, not an I/O error: a node whose data directory sits on
//! a small ext4 image (a loop device, made with `mkfs.ext4 -m 0` so that root cannot write
//! into reserved blocks) answers 507 while the disk is full, records nothing for those
//! requests, stays up, and serves again by itself once space returns.
//!
//! Needs root (losetup, mount). `.ci/run` sets LINEAGE_REQUIRE_LOOP=1: there a missing
//! capability fails the test instead of skipping it.

#[path = "cluster/loop_disk.rs"]
mod loop_disk;
#[path = "cluster/util.rs"]
mod util;

use std::io::Write;
use std::path::{Path, PathBuf};

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

struct Node {
    child: Child,
    base: String,
    http: reqwest::Client,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Node {
    async fn post(&self, path: &str, token: &str, key: &str, body: Value) -> (u16, Value) {
        match self
            .http
            .post(format!("{}{path}", self.base))
            .bearer_auth(token)
            .header("Idempotency-Key", key)
            .json(&body)
            .send()
            .await
        {
            Ok(reply) => {
                let status = reply.status().as_u16();
                (status, reply.json().await.unwrap_or(Value::Null))
            }
            Err(e) => (0, json!({"transport_error": e.to_string()})),
        }
    }

    async fn get(&self, path: &str, token: &str) -> (u16, Value) {
        match self
            .http
            .get(format!("{}{path}", self.base))
            .bearer_auth(token)
            .send()
            .await
        {
            Ok(reply) => {
                let status = reply.status().as_u16();
                (status, reply.json().await.unwrap_or(Value::Null))
            }
            Err(e) => (0, json!({"transport_error": e.to_string()})),
        }
    }
}

/// Writes a file until the disk refuses more (bounded by the image's size).
fn fill(dir: &Path, limit_mb: u64) -> PathBuf {
    let filler = dir.join("filler");
    let mut file = std::fs::File::create(&filler).unwrap();
    let chunk = vec![0xa5u8; 64 * 1024];
    for _ in 0..limit_mb * 16 {
        if file.write_all(&chunk).is_err() {
            break;
        }
    }
    let _ = file.sync_all();
    // Whatever is left in partial blocks too.
    for _ in 0..64 {
        if file
            .write_all(&[0u8; 512])
            .and_then(|()| file.sync_all())
            .is_err()
        {
            break;
        }
    }
    filler
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[expect(
    clippy::too_many_lines,
    reason = "a scenario test: fill, refuse, free, serve again, in order"
)]
async fn a_full_disk_refuses_writes_cleanly_and_serves_again_once_space_returns() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(mount) = loop_disk::loop_disk_or_skip(tmp.path(), "disk", 64) else {
        return;
    };
    let keys = tmp.path().join("keys");
    let status = Command::new(env!("CARGO_BIN_EXE_lineage-node"))
        .arg("keygen")
        .arg(&keys)
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    let admin = std::fs::read_to_string(keys.join("admin.token")).unwrap();
    let addr = format!("127.0.0.1:{}", util::free_port());
    let log = std::fs::File::create(tmp.path().join("node.log")).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_lineage-node"))
        .args([
            "run",
            "--id",
            "1",
            "--listen",
            &addr,
            "--peers",
            &format!("1={addr}"),
        ])
        .arg("--data-dir")
        .arg(mount.dir.join("node"))
        .arg("--keys-dir")
        .arg(&keys)
        .args(["--disk-reserve-mb", "8"])
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    let node = Node {
        child,
        base: format!("http://{addr}"),
        http: reqwest::Client::builder()
            .timeout(Duration::from_secs(5))
            .build()
            .unwrap(),
    };
    let node_log = || std::fs::read_to_string(tmp.path().join("node.log")).unwrap_or_default();
    let start = Instant::now();
    let token = loop {
        let (status, body) = node
            .post(
                "/v1/agents",
                &admin,
                "create",
                json!({"agent_id": "bot", "policy": {"budget": 1000, "scar_limit": 10, "tools": {"search": {"cost": 1}}}}),
            )
            .await;
        if status == 200 {
            break body["token"].as_str().unwrap().to_string();
        }
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "{status} {body}\n{}",
            node_log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let action = |n: &str| json!({"tool": "search", "input": {"n": n}});
    for n in 0..20 {
        let key = format!("ok-{n}");
        let (status, body) = node
            .post("/v1/agents/bot/actions", &token, &key, action(&key))
            .await;
        assert_eq!(status, 200, "{body}");
    }
    // Let the state machine's write-behind commit settle before the disk fills up.
    tokio::time::sleep(Duration::from_millis(500)).await;

    let filler = fill(&mount.dir, 64);
    for n in 0..10 {
        let key = format!("full-{n}");
        let (status, body) = node
            .post("/v1/agents/bot/actions", &token, &key, action(&key))
            .await;
        assert_eq!(status, 507, "{body}\n{}", node_log());
        assert_eq!(body["code"], "insufficient_storage", "{body}");
    }
    // Reads go on, the node stays up through a few heads-round and hint intervals.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (status, body) = node.get("/v1/agents/bot", &token).await;
    assert_eq!(status, 200, "{body}\n{}", node_log());
    assert_eq!(body["spent"], 20);
    let (status, body) = node
        .post("/v1/agents/bot/actions", &token, "full-0", action("full-0"))
        .await;
    assert_eq!(status, 507, "still full: {body}");
    // A snapshot commits to the state file: it waits for space too, and says so.
    let (status, body) = node
        .post("/v1/node/snapshot", &admin, "snapshot-full", json!({}))
        .await;
    assert_eq!(status, 507, "{body}\n{}", node_log());
    assert_eq!(body["code"], "insufficient_storage", "{body}");

    std::fs::remove_file(&filler).unwrap();
    let freed = Instant::now();
    let served_after = loop {
        let (status, body) = node
            .post("/v1/agents/bot/actions", &token, "full-0", action("full-0"))
            .await;
        if status == 200 {
            assert_eq!(body["decision"], "allowed");
            break freed.elapsed();
        }
        assert_eq!(status, 507, "{body}\n{}", node_log());
        assert!(
            freed.elapsed() < Duration::from_secs(10),
            "not serving again\n{}",
            node_log()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    println!(
        "serving again {:.0} ms after space returned",
        served_after.as_secs_f64() * 1000.0
    );

    // Only the answered-200 requests are in the log, and it verifies.
    let (status, verified) = node.get("/v1/agents/bot/verify", &admin).await;
    assert_eq!(status, 200, "{verified}\n{}", node_log());
    assert_eq!(verified["ok"], true, "{verified}");
    let (_, page) = node.get("/v1/agents/bot/log?limit=5000", &admin).await;
    let records = page["records"].as_array().unwrap();
    let inputs: Vec<String> = records
        .iter()
        .filter(|r| r["kind"] == "action_requested")
        .map(|r| {
            r["payload"]["input"]["n"]
                .as_str()
                .unwrap_or("")
                .to_string()
        })
        .collect();
    assert_eq!(inputs.len(), 21, "{inputs:?}");
    assert!(
        inputs
            .iter()
            .filter(|n| n.starts_with("full-"))
            .eq(["full-0"].iter()),
        "{inputs:?}"
    );
    let (_, body) = node.get("/v1/agents/bot", &token).await;
    assert_eq!(body["spent"], 21);
    let (status, body) = node
        .post("/v1/node/snapshot", &admin, "snapshot", json!({}))
        .await;
    assert_eq!(status, 200, "{body}\n{}", node_log());
    assert!(body["snapshot_index"].as_u64() > Some(20), "{body}");
    drop(node);
}
