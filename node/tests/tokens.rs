//! An agent token acts only as its agent: agent A's token on every route of agent B
//! (reads, writes, operator routes) gets 403 `forbidden` and changes nothing in B's log;
//! the same routes with B's own token are not refused as forbidden; and a token with a
//! forged MAC is 401 everywhere. Through a follower too, since it forwards.

#[path = "cluster/util.rs"]
mod util;

use std::time::Duration;

use serde_json::{json, Value};
use util::Cluster;

/// One route: method, path, body, and whether the agent's own token may use it (the
/// others are the operators').
type Route = (&'static str, String, Option<Value>, bool);

/// Every route under `/v1/agents/{id}`, with a well-formed body for the writes (a body
/// is checked before the token). The proofs (`proof/inclusion`, `proof/consistency`,
/// `head-proof`) take no token by design (anyone with the public key checks them) and are
/// not listed.
fn agent_routes(id: &str, action: &str) -> Vec<Route> {
    let base = format!("/v1/agents/{id}");
    let act = format!("{base}/actions/{action}");
    vec![
        ("GET", base.clone(), None, true),
        ("GET", format!("{base}/token"), None, false),
        (
            "POST",
            format!("{base}/actions"),
            Some(json!({"tool": "work"})),
            true,
        ),
        ("GET", format!("{base}/actions/pending"), None, false),
        ("GET", act.clone(), None, true),
        (
            "POST",
            format!("{act}/outcome"),
            Some(json!({"status": "success"})),
            true,
        ),
        (
            "POST",
            format!("{act}/approve"),
            Some(json!({"approver": "m"})),
            false,
        ),
        (
            "POST",
            format!("{act}/reject"),
            Some(json!({"approver": "m", "reason": "x"})),
            false,
        ),
        (
            "POST",
            format!("{base}/scars"),
            Some(json!({"severity": "minor", "reason": "x"})),
            false,
        ),
        (
            "POST",
            format!("{base}/terminate"),
            Some(json!({"reason": "x", "by": "m"})),
            false,
        ),
        ("GET", format!("{base}/log"), None, false),
        ("GET", format!("{base}/verify"), None, false),
    ]
}

async fn send(cluster: &Cluster, node: usize, token: &str, route: &Route) -> (u16, Value) {
    let (method, path, body, _) = route;
    match (*method, body) {
        ("POST", Some(body)) => cluster.post(node, path, token, body.clone(), None).await,
        _ => cluster.get(node, path, token).await,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_token_acts_only_as_its_agent_on_every_route() {
    let cluster = Cluster::start(3).await;
    let leader = cluster.wait_for_leader(Duration::from_secs(20)).await;
    let follower = (leader + 1) % 3;
    let policy = json!({"budget": 10, "scar_limit": 5, "tools": {"work": {"cost": 1}}});
    let alice = cluster.create_agent(leader, "alice", policy.clone()).await;
    let bob = cluster.create_agent(leader, "bob", policy).await;
    let (status, first) = cluster
        .post(
            leader,
            "/v1/agents/bob/actions",
            &bob,
            json!({"tool": "work"}),
            None,
        )
        .await;
    assert_eq!(status, 200, "{first}");
    let action = first["action_id"].as_str().expect("action id").to_string();
    let log_before = cluster.converged_log("bob", Duration::from_secs(20)).await;

    // Bob's token with its last MAC character changed.
    let last = if bob.ends_with('a') { 'b' } else { 'a' };
    let forged = format!("{}{last}", &bob[..bob.len() - 1]);
    for node in [leader, follower] {
        for route in agent_routes("bob", &action) {
            let (status, body) = send(&cluster, node, &alice, &route).await;
            assert_eq!(
                status, 403,
                "alice's token on {} {}: {body}",
                route.0, route.1
            );
            assert_eq!(body["code"], "forbidden", "{} {}: {body}", route.0, route.1);
            let (status, body) = send(&cluster, node, &forged, &route).await;
            assert_eq!(
                status, 401,
                "a forged token on {} {}: {body}",
                route.0, route.1
            );
        }
    }
    let log_after = cluster.converged_log("bob", Duration::from_secs(20)).await;
    assert_eq!(
        log_after, log_before,
        "bob's log changed under alice's token"
    );

    // Bob's own token is not refused on the routes an agent may use; the operators'
    // routes stay theirs.
    for route in agent_routes("bob", &action) {
        let (status, body) = send(&cluster, leader, &bob, &route).await;
        if route.3 {
            assert!(
                status != 401 && status != 403,
                "bob's token on {} {}: {status} {body}",
                route.0,
                route.1
            );
        } else {
            assert_eq!(
                status, 403,
                "bob's token on {} {}: {body}",
                route.0, route.1
            );
        }
    }
}

/// Every file under `dir`, read whole (a node's data directory is small here).
fn files_under(dir: &std::path::Path) -> Vec<(std::path::PathBuf, Vec<u8>)> {
    let mut found = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                pending.push(path);
            } else if let Ok(bytes) = std::fs::read(&path) {
                found.push((path, bytes));
            }
        }
    }
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_token_is_never_stored_and_a_replayed_create_still_returns_it() {
    let cluster = Cluster::start(3).await;
    let leader = cluster.wait_for_leader(Duration::from_secs(20)).await;
    let body = json!({"agent_id": "kept", "policy": {"budget": 5, "scar_limit": 3, "tools": {}}});
    let (status, first) = cluster
        .post(
            leader,
            "/v1/agents",
            &cluster.admin,
            body.clone(),
            Some("create-kept"),
        )
        .await;
    assert_eq!(status, 200, "{first}");
    let token = first["token"].as_str().expect("a token").to_string();
    // The retry gets the stored answer, and the same token with it.
    let (status, again) = cluster
        .post(
            leader,
            "/v1/agents",
            &cluster.admin,
            body,
            Some("create-kept"),
        )
        .await;
    assert_eq!((status, &again), (200, &first));
    cluster.converged_log("kept", Duration::from_secs(20)).await;
    for i in 0..3 {
        // The state machine's rows reach redb within its commit interval; the Raft
        // log's at once. Stopping the node flushes everything.
        cluster.stop_gracefully(i);
        let files = files_under(&cluster.data_dir(i));
        assert!(files.len() > 2, "node {i} has its files");
        let mac = token.rsplit('.').next().expect("a mac").as_bytes();
        for (path, bytes) in files {
            assert!(
                !bytes.windows(mac.len()).any(|w| w == mac),
                "node {i}: the token is in {}",
                path.display()
            );
        }
    }
}
