//! Secrets rotate without a restart, on a live three-node cluster with requests flowing:
//!
//! - the cluster secret in three phases (accept both, send the new one, drop the old
//!   one), each written to `cluster.secret`, taken up on SIGHUP, and confirmed by the
//!   fingerprints every node reports in `GET /v1/cluster`, with no failed request; at the
//!   end every node refuses the old secret;
//! - the admin token: the new one in `admin.token`, the old one in `admin.token.previous`
//!   until its `not_after`, then refused; a malformed file is refused on reload and the
//!   secrets in use stay (`lineage_secret_reload_failures_total`).

#[path = "cluster/util.rs"]
mod util;

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lineage_core::record::timestamp;
use lineage_node::rotating_secrets::fingerprint;
use serde_json::{json, Value};
use util::Cluster;

/// Replaces a key file whole (a reader sees the old file or the new one).
fn replace(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).expect("write");
    std::fs::rename(&tmp, path).expect("rename");
}

/// Requests through every node in turn until stopped: counts answers, keeps failures.
struct Load {
    stop: Arc<AtomicBool>,
    answered: Arc<AtomicU64>,
    failures: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

fn start_load(cluster: &Arc<Cluster>, token: String) -> Load {
    let stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(AtomicU64::new(0));
    let failures = Arc::new(Mutex::new(Vec::new()));
    let task = tokio::spawn({
        let (cluster, stop, answered, failures) = (
            cluster.clone(),
            stop.clone(),
            answered.clone(),
            failures.clone(),
        );
        async move {
            // Bounded: at most this many requests, whatever happens.
            for n in 0..20_000usize {
                if stop.load(Ordering::Relaxed) {
                    return;
                }
                let (status, body) = cluster
                    .post(
                        n % 3,
                        "/v1/agents/steady/actions",
                        &token,
                        json!({"tool": "work"}),
                        None,
                    )
                    .await;
                if status == 200 && body["decision"] == "allowed" {
                    answered.fetch_add(1, Ordering::Relaxed);
                } else {
                    let failure = format!("node {}: {status} {body}", n % 3);
                    failures.lock().expect("lock").push(failure);
                }
            }
        }
    });
    Load {
        stop,
        answered,
        failures,
        task,
    }
}

/// Waits until every node reports `sends` and `accepts` (as fingerprints) in the
/// leader's `GET /v1/cluster`.
async fn phase_confirmed(cluster: &Cluster, leader: usize, sends: &str, accepts: &[&str]) -> Value {
    let want = json!({
        "sends": fingerprint(sends),
        "accepts": accepts.iter().map(|s| fingerprint(s)).collect::<Vec<_>>(),
    });
    let start = Instant::now();
    loop {
        let (status, view) = cluster.get(leader, "/v1/cluster", &cluster.admin).await;
        assert_eq!(status, 200, "{view}");
        let nodes = view["nodes"].as_array().cloned().unwrap_or_default();
        let done = nodes.len() == 3
            && nodes.iter().all(|node| {
                node["secrets"]["sends"] == want["sends"]
                    && node["secrets"]["accepts"] == want["accepts"]
            });
        if done {
            return view;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the nodes did not all report {want}: {view}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A Raft request to node `i` with `secret`: its status (the body is not a vote, so a
/// node that accepts the secret answers 4xx other than 401).
async fn raft_status(cluster: &Cluster, i: usize, secret: &str) -> u16 {
    cluster
        .http
        .post(cluster.url(i, "/raft/vote"))
        .header("x-lineage-cluster-secret", secret)
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await
        .map(|r| r.status().as_u16())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_secret_rotates_in_three_phases_without_a_failed_request() {
    let cluster = Arc::new(Cluster::start(3).await);
    let leader = cluster.wait_for_leader(Duration::from_secs(20)).await;
    let file = cluster.dir.path().join("keys").join("cluster.secret");
    let old = std::fs::read_to_string(&file)
        .expect("cluster.secret")
        .trim()
        .to_string();
    let new = format!(
        "rotated-{}",
        lineage_core::operators::generate_token().expect("random")
    );
    let token = cluster
        .create_agent(
            leader,
            "steady",
            json!({"budget": 1_000_000, "scar_limit": 10, "tools": {"work": {"cost": 1}}}),
        )
        .await;
    let term = phase_confirmed(&cluster, leader, &old, &[&old]).await["term"].clone();
    let load = start_load(&cluster, token);

    // Each phase on every node, confirmed by what the nodes say, before the next.
    for (text, sends, accepts) in [
        (
            format!("{old}\n{new}\n"),
            &old,
            vec![old.as_str(), new.as_str()],
        ),
        (
            format!("{new}\n{old}\n"),
            &new,
            vec![new.as_str(), old.as_str()],
        ),
        (format!("{new}\n"), &new, vec![new.as_str()]),
    ] {
        // The nodes share the keys directory but read it only on SIGHUP: one at a time,
        // with requests decided between, so the cluster runs with nodes in two phases.
        replace(&file, &text);
        for i in 0..3 {
            cluster.hangup(i);
            let before = load.answered.load(Ordering::Relaxed);
            let start = Instant::now();
            while load.answered.load(Ordering::Relaxed) < before + 10 {
                assert!(
                    start.elapsed() < Duration::from_secs(20),
                    "the load stalled"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        phase_confirmed(&cluster, leader, sends, &accepts).await;
    }
    load.stop.store(true, Ordering::Relaxed);
    load.task.await.expect("load task");
    let failures = load.failures.lock().expect("lock").clone();
    assert!(
        failures.is_empty(),
        "{} failed requests: {failures:?}",
        failures.len()
    );
    assert!(load.answered.load(Ordering::Relaxed) >= 90);

    // No node ever refused another's secret during the rotation (counted before the
    // probes below, which are refused on purpose). An election alone would prove nothing
    // here: a leader starved of CPU on a loaded machine misses heartbeats.
    for i in 0..3 {
        let refused =
            cluster.metrics(i).await["lineage_raft_requests_refused_total{reason=\"secret\"}"];
        assert_eq!(refused, 0.0, "node {} refused a peer's secret", i + 1);
    }
    for i in 0..3 {
        assert_eq!(
            raft_status(&cluster, i, &old).await,
            401,
            "node {i} took the old secret"
        );
        let status = raft_status(&cluster, i, &new).await;
        assert!(
            status != 401 && status != 0,
            "node {i} refused the new secret: {status}"
        );
        // The count is live: the probe with the old secret was counted.
        let refused =
            cluster.metrics(i).await["lineage_raft_requests_refused_total{reason=\"secret\"}"];
        assert_eq!(refused, 1.0, "node {}: the refused probe", i + 1);
    }
    let (_, view) = cluster.get(leader, "/v1/cluster", &cluster.admin).await;
    if view["term"] != term {
        println!("an election during the rotation, with no refused call: {view}");
    }
}

/// Waits until every node reports `until` as its own previous admin token's not_after
/// (in its `GET /v1/cluster`): each has reloaded the file that says so.
async fn previous_until_confirmed(cluster: &Cluster, token: &str, until: &str) {
    for i in 0..3 {
        let start = Instant::now();
        loop {
            let (status, view) = cluster.get(i, "/v1/cluster", token).await;
            assert_eq!(status, 200, "{view}");
            let me = view["nodes"]
                .as_array()
                .and_then(|nodes| nodes.iter().find(|n| n["id"] == view["node_id"]))
                .cloned()
                .unwrap_or_default();
            if me["secrets"]["admin_previous_until"] == until {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "node {i} did not report admin_previous_until {until}: {view}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_token_rolls_over_and_the_previous_one_ends_at_its_not_after() {
    let cluster = Cluster::start(3).await;
    let leader = cluster.wait_for_leader(Duration::from_secs(20)).await;
    let keys = cluster.dir.path().join("keys");
    let old = cluster.admin.trim().to_string();
    let new = format!(
        "admin-{}",
        lineage_core::operators::generate_token().expect("random")
    );
    // An hour ahead, so the old token is still good whenever the checks below run, on
    // however slow a machine; its end is tested after, with a not_after a moment away.
    let not_after = timestamp::format(timestamp::now_micros() + 3_600_000_000);
    replace(
        &keys.join("admin.token.previous"),
        &format!("{old}\nnot_after={not_after}\n"),
    );
    replace(&keys.join("admin.token"), &format!("{new}\n"));
    for i in 0..3 {
        cluster.hangup(i);
    }
    // Every node takes the new token, and still the old one.
    for i in 0..3 {
        let start = Instant::now();
        while cluster.get(i, "/v1/agents?local=true", &new).await.0 != 200 {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "node {i} never took the new token"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let status = cluster.get(i, "/v1/agents?local=true", &old).await.0;
        assert_eq!(
            status, 200,
            "node {i} refused the old token before its not_after"
        );
    }
    previous_until_confirmed(&cluster, &new, &not_after).await;

    // A malformed file is refused on reload, counted, and changes nothing.
    replace(&keys.join("admin.token.previous"), &format!("{old}\n"));
    cluster.hangup(leader);
    let start = Instant::now();
    while cluster
        .metrics(leader)
        .await
        .get("lineage_secret_reload_failures_total")
        .copied()
        != Some(1.0)
    {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the failed reload was not counted"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(cluster.get(leader, "/v1/agents", &new).await.0, 200);
    assert_eq!(
        cluster.get(leader, "/v1/agents?local=true", &old).await.0,
        200
    );

    // A not_after two seconds away, taken by every node; past it, the old token is
    // refused everywhere (no reload needed).
    let until = timestamp::now_micros() + 2_000_000;
    let soon = timestamp::format(until);
    replace(
        &keys.join("admin.token.previous"),
        &format!("{old}\nnot_after={soon}\n"),
    );
    for i in 0..3 {
        cluster.hangup(i);
    }
    previous_until_confirmed(&cluster, &new, &soon).await;
    while timestamp::now_micros() <= until {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for i in 0..3 {
        assert_eq!(
            cluster.get(i, "/v1/agents?local=true", &old).await.0,
            401,
            "node {i}"
        );
        assert_eq!(cluster.get(i, "/v1/agents", &new).await.0, 200, "node {i}");
    }
}
