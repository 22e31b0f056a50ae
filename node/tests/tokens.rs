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

/// The status of `GET /v1/agents/{agent}?local=true` on `node` with `token`, once it is
/// `want` (a follower applies a reissue shortly after the leader), or what it was.
async fn local_status_becomes(
    cluster: &Cluster,
    node: usize,
    agent: &str,
    token: &str,
    want: u16,
) -> u16 {
    let start = std::time::Instant::now();
    loop {
        let (status, _) = cluster
            .get(node, &format!("/v1/agents/{agent}?local=true"), token)
            .await;
        if status == want || start.elapsed() > Duration::from_secs(20) {
            return status;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Reissues `rolled`'s token twice through `via`: the first token and the two new ones.
async fn reissue_twice(cluster: &Cluster, via: usize, first: String) -> Vec<String> {
    let mut tokens = vec![first];
    for generation in 1..=2u64 {
        let (status, body) = cluster
            .post(
                via,
                "/v1/agents/rolled/token/reissue",
                &cluster.admin,
                json!({}),
                None,
            )
            .await;
        assert_eq!(
            (status, &body["generation"]),
            (200, &json!(generation)),
            "{body}"
        );
        let token = body["token"].as_str().expect("a token").to_string();
        assert!(
            token.starts_with(&format!("agt_rolled.{generation}.")),
            "{token}"
        );
        tokens.push(token);
    }
    tokens
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reissued_token_revokes_every_earlier_one_on_every_node() {
    let cluster = Cluster::start(3).await;
    let leader = cluster.wait_for_leader(Duration::from_secs(20)).await;
    let follower = (leader + 1) % 3;
    let policy = json!({"budget": 100, "scar_limit": 5, "tools": {"work": {"cost": 1}}});
    let first = cluster.create_agent(leader, "rolled", policy).await;
    let log_before = cluster
        .converged_log("rolled", Duration::from_secs(20))
        .await;

    let tokens = reissue_twice(&cluster, follower, first).await;
    let (current, revoked) = (&tokens[2], &tokens[..2]);
    // The leader applied each reissue before it answered: it refuses at once.
    for old in revoked {
        let (status, _) = cluster.get(leader, "/v1/agents/rolled", old).await;
        assert_eq!(status, 401, "the leader still took a revoked token");
    }
    let (status, body) = cluster
        .get(leader, "/v1/agents/rolled/token", &cluster.admin)
        .await;
    assert_eq!(
        (status, body["token"].as_str()),
        (200, Some(current.as_str()))
    );
    for node in 0..3 {
        for (token, want) in std::iter::once((current, 200)).chain(revoked.iter().map(|t| (t, 401)))
        {
            let status = local_status_becomes(&cluster, node, "rolled", token, want).await;
            assert_eq!(status, want, "node {node}");
        }
    }
    for old in revoked {
        let (status, _) = cluster
            .post(
                follower,
                "/v1/agents/rolled/actions",
                old,
                json!({"tool": "work"}),
                None,
            )
            .await;
        assert_eq!(status, 401);
    }
    let (status, body) = cluster
        .post(
            follower,
            "/v1/agents/rolled/actions",
            current,
            json!({"tool": "work"}),
            None,
        )
        .await;
    assert_eq!(
        (status, &body["decision"]),
        (200, &json!("allowed")),
        "{body}"
    );
    // The agent's log holds its decisions only: the reissues are in the system log.
    let log_after = cluster
        .converged_log("rolled", Duration::from_secs(20))
        .await;
    assert_eq!(log_after[..log_before.len()], log_before[..]);
    assert!(log_after
        .iter()
        .all(|r| r["kind"] != "agent_token_reissued"));
    let (_, system) = cluster
        .get(leader, "/v1/operators/log", &cluster.admin)
        .await;
    let reissues = system["records"].as_array().map_or(0, |r| {
        r.iter()
            .filter(|r| r["kind"] == "agent_token_reissued")
            .count()
    });
    assert_eq!(reissues, 2, "{system}");

    // Restarted after kill -9, a node still refuses the revoked tokens.
    cluster.kill(follower);
    cluster.start_node(follower);
    cluster.wait_ready(follower, Duration::from_secs(30)).await;
    assert_eq!(
        local_status_becomes(&cluster, follower, "rolled", current, 200).await,
        200
    );
    assert_eq!(
        cluster
            .get(follower, "/v1/agents/rolled?local=true", &revoked[0])
            .await
            .0,
        401
    );
    // An unknown agent has no token to reissue.
    let (status, _) = cluster
        .post(
            leader,
            "/v1/agents/ghost/token/reissue",
            &cluster.admin,
            json!({}),
            None,
        )
        .await;
    assert_eq!(status, 404);
}
