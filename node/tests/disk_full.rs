//! A full disk is admission control, not an I/O error: a node whose data directory sits on
//! a small ext4 image (a loop device, made with `mkfs.ext4 -m 0` so that root cannot write
//! into reserved blocks) answers 507 while the disk is full, records nothing for those
//! requests, stays up, and serves again by itself once space returns. A follower takes
//! what the leader committed whatever its disk: a full one stops alone (fail-stop) and
//! catches up once space returns and it is restarted.
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
    // Nothing may be left to write when the disk fills up (an external filler takes
    // the reserve too, and a commit that meets ENOSPC stops the node by design): a
    // snapshot flushes the state machine's write-behind rows and packs every record
    // row, so no merge follows either. (A fixed wait raced the low-priority writer.)
    let (status, body) = node
        .post("/v1/node/snapshot", &admin, "snapshot-before", json!({}))
        .await;
    assert_eq!(status, 200, "{body}\n{}", node_log());

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

/// A follower's disk filling up stops no one else: followers take what the leader
/// committed without looking at their reserve, so the full one keeps up while its log's
/// zeros written ahead and its state file's free pages last, then fails a write and stops
/// (fail-stop: its log or redb refuses, Raft stops, the node exits), never a panic. The
/// leader and the other follower go on as a quorum. Once space returns and the node is
/// restarted (its supervisor's job), it catches up, and every replica's log is the same
/// and verifies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_whose_disk_fills_stops_alone_and_catches_up_once_space_returns() {
    let tmp = tempfile::tempdir().unwrap();
    let mut disks = Vec::new();
    for i in 0..3 {
        let Some(disk) = loop_disk::loop_disk_or_skip(tmp.path(), &format!("node-{}", i + 1), 64)
        else {
            return;
        };
        disks.push(disk);
    }
    let dirs = disks.iter().map(|d| d.dir.join("data")).collect();
    // (openraft's default snapshot interval: the restarted follower catches up from the
    // leader's log. A follower catching up from a long snapshot stream is the `cluster`
    // test `a_follower_receiving_a_long_snapshot_stream_does_not_campaign`.)
    let cluster = util::Cluster::start_on(3, &["--disk-reserve-mb", "8"], Some(dirs)).await;
    let leader = cluster.wait_for_leader(Duration::from_secs(20)).await;
    let follower = (leader + 1) % 3;
    let policy = json!({"budget": 100_000, "scar_limit": 10, "tools": {"search": {"cost": 1}}});
    let token = cluster.create_agent(leader, "bot", policy).await;
    let path = "/v1/agents/bot/actions";
    // Inputs of 32 KiB: the full follower's log outgrows the 4 MiB of zeros it wrote ahead.
    let filling = "a".repeat(32 * 1024);
    let mut filler = None;
    for n in 0..250 {
        if n == 20 {
            filler = Some(fill(&disks[follower].dir, 64));
        }
        // From then on, the leader and the other follower are a quorum: every write goes on.
        let key = format!("act-{n}");
        let body = json!({"tool": "search", "input": {"n": n, "text": filling}});
        let (status, reply) = cluster
            .post_until_served(leader, path, &token, body, &key)
            .await;
        assert_eq!(
            (status, &reply["decision"]),
            (200, &json!("allowed")),
            "{reply}\n{}",
            cluster.log_tails(40)
        );
    }
    let follower_log = || {
        std::fs::read_to_string(
            cluster
                .dir
                .path()
                .join(format!("node-{}.log", follower + 1)),
        )
        .unwrap_or_default()
    };
    let stopped = cluster.has_exited(follower);
    let last_words = follower_log()
        .lines()
        .rev()
        .find(|l| l.contains("fatal"))
        .map(str::to_string);
    println!("the full follower: {last_words:?}");
    assert!(!follower_log().contains("panicked"), "{}", follower_log());
    if stopped {
        assert!(follower_log().contains("fatal"), "{}", follower_log());
    }

    std::fs::remove_file(filler.unwrap()).unwrap();
    cluster.kill(follower);
    cluster.start_node(follower);
    cluster.wait_ready(follower, Duration::from_secs(60)).await;
    let records = cluster.converged_log("bot", Duration::from_secs(60)).await;
    let actions = records
        .iter()
        .filter(|r| r["kind"] == "action_requested")
        .count();
    assert_eq!(actions, 250);
    util::verify_log(&records, &cluster.public_key().await);
}
