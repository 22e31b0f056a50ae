//! One agent's concurrent requests, pipelined (the default) and not (`--pipelining
//! false`): sixteen clients send one agent more requests than its budget, with some
//! requests sent twice at once under one Idempotency-Key. Either way every decision is
//! made on the state the one before it left: the allowed answers' `remaining` values
//! are each budget step exactly once, a repeated key gets one answer, every node's log
//! verifies and holds each answered action once. The leader's metrics show whether
//! writes were decided on a pending state, and that none was rejected at apply. The
//! kill -9 of a leader while it pipelines is in the fault suite (`faults/main.rs`).

#[path = "cluster/util.rs"]
mod util;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use util::{verify_log, Cluster};

const CLIENTS: usize = 16;
const REQUESTS_PER_CLIENT: usize = 30;
/// Less than the requests, so the last credits are raced for.
const BUDGET: u64 = 200;
/// Every this many requests a client sends the same request twice at once.
const TWIN_EVERY: usize = 5;

/// One logical call: the same key until a 200, on 503 (leadership settling) only.
async fn call(cluster: &Cluster, node: usize, token: &str, key: &str) -> Value {
    let start = Instant::now();
    loop {
        let (status, body) = cluster
            .post(
                node,
                "/v1/agents/solo/actions",
                token,
                json!({"tool": "work", "input": {"key": key}}),
                Some(key),
            )
            .await;
        match status {
            200 => return body,
            503 if start.elapsed() < Duration::from_secs(20) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => panic!("{key}: {other} {body}"),
        }
    }
}

/// What the leader counted during the load.
struct LeaderCounts {
    /// `lineage_writes_pipelined_total`
    pipelined: f64,
    /// `lineage_writes_rejected_at_apply_total`, or `None` when leadership changed
    /// during the load (a new leader's first writes may be rejected, and retried).
    rejected: Option<f64>,
}

/// Runs the load and checks the invariants.
async fn load_one_agent(cluster: Arc<Cluster>) -> LeaderCounts {
    let leader = cluster.wait_for_leader(Duration::from_secs(20)).await;
    let term_before = cluster.metrics(leader).await["lineage_raft_term"];
    let policy = json!({"budget": BUDGET, "scar_limit": 10, "tools": {"work": {"cost": 1}}});
    let token = cluster.create_agent(leader, "solo", policy).await;
    let mut clients = Vec::new();
    for c in 0..CLIENTS {
        let (cluster, token) = (cluster.clone(), token.clone());
        clients.push(tokio::spawn(async move {
            let mut answers = Vec::new();
            for n in 0..REQUESTS_PER_CLIENT {
                let key = format!("c{c}-n{n}");
                // Through the leader: a follower forwards, which only adds latency.
                if n % TWIN_EVERY == 0 {
                    let (a, b) = tokio::join!(
                        call(&cluster, leader, &token, &key),
                        call(&cluster, leader, &token, &key)
                    );
                    assert_eq!(a, b, "{key}: one key, two answers");
                    answers.push((key, a));
                } else {
                    let answer = call(&cluster, leader, &token, &key).await;
                    answers.push((key, answer));
                }
            }
            answers
        }));
    }
    let mut answers = BTreeMap::new();
    for client in clients {
        answers.extend(client.await.expect("client task"));
    }
    assert_eq!(answers.len(), CLIENTS * REQUESTS_PER_CLIENT);

    // Each allowed decision spent one credit of what the decision before it left.
    let mut remaining: Vec<u64> = answers
        .values()
        .filter(|a| a["decision"] == "allowed")
        .map(|a| a["remaining"].as_u64().expect("remaining"))
        .collect();
    remaining.sort_unstable();
    let expected: Vec<u64> = (0..BUDGET).collect();
    assert_eq!(remaining, expected, "allowed answers' remaining budgets");
    let action_ids: BTreeSet<&str> = answers
        .values()
        .map(|a| a["action_id"].as_str().expect("action_id"))
        .collect();
    assert_eq!(
        action_ids.len(),
        answers.len(),
        "an action id answered twice"
    );

    // Every node holds the same log, it verifies, and it holds each answered action once.
    let log = cluster.converged_log("solo", Duration::from_secs(20)).await;
    verify_log(&log, &cluster.public_key().await);
    let requested: Vec<&str> = log
        .iter()
        .filter(|r| r["kind"] == "action_requested")
        .filter_map(|r| r["payload"]["action_id"].as_str())
        .collect();
    assert_eq!(
        requested.len(),
        answers.len(),
        "requests in the log vs requests answered"
    );
    assert_eq!(
        requested.iter().copied().collect::<BTreeSet<_>>(),
        action_ids,
        "the log's actions are the answered ones"
    );
    let (status, agent) = cluster.get(leader, "/v1/agents/solo", &token).await;
    assert_eq!(status, 200, "{agent}");
    assert_eq!(agent["spent"], BUDGET, "{agent}");

    let metrics = cluster.metrics(leader).await;
    let read = |name: &str| {
        *metrics
            .get(name)
            .unwrap_or_else(|| panic!("no {name} in the leader's metrics"))
    };
    let same_leader = read("lineage_raft_term") == term_before
        && cluster.wait_for_leader(Duration::from_secs(5)).await == leader;
    if !same_leader {
        eprintln!("leadership changed during the load: not checking rejections");
    }
    LeaderCounts {
        pipelined: read("lineage_writes_pipelined_total"),
        rejected: same_leader.then(|| read("lineage_writes_rejected_at_apply_total")),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_agents_concurrent_requests_are_pipelined_and_exact() {
    let cluster = Arc::new(Cluster::start(3).await);
    let counts = load_one_agent(cluster).await;
    assert!(
        counts.pipelined > 0.0,
        "no write was decided on a pending state: the load did not pipeline"
    );
    if let Some(rejected) = counts.rejected {
        assert_eq!(rejected, 0.0, "a pipelined write was rejected at apply");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_pipelining_off_each_write_waits_for_the_one_before() {
    let cluster = Arc::new(Cluster::start_with(3, &["--pipelining", "false"]).await);
    let counts = load_one_agent(cluster).await;
    // Fails if the flag does not reach the node.
    assert_eq!(counts.pipelined, 0.0, "pipelining is off");
    if let Some(rejected) = counts.rejected {
        assert_eq!(rejected, 0.0, "a write was rejected at apply");
    }
}
