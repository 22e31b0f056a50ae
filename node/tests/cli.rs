//! The `lineage` CLI against a live three-node cluster, as an operator uses it: global
//! options in any position, a status table that shows a stopped node as unreachable,
//! daily agent work, fetching a log that then verifies, and exit codes that say what
//! happened (0 ok, 1 negative, 2 usage, 3 unreachable, 4 token refused).
//!
//! `lineage` belongs to another package: this test runs it from the same target
//! directory, which `cargo test --workspace` builds.

#[path = "cluster/util.rs"]
mod util;

use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use util::{lineage_bin, Cluster};

struct Run {
    code: i32,
    out: String,
    err: String,
}

fn run(args: &[&str]) -> Run {
    let output = Command::new(lineage_bin())
        .args(args)
        .env_remove("LINEAGE_URL")
        .env_remove("LINEAGE_ADMIN_TOKEN_FILE")
        .env_remove("GUARD_ADMIN_TOKEN")
        .output()
        .expect("run lineage");
    Run {
        code: output.status.code().unwrap_or(-1),
        out: String::from_utf8_lossy(&output.stdout).into_owned(),
        err: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

/// Runs `lineage` with the cluster's URLs and admin token file after `args`' command.
fn on(cluster: &Cluster, args: &[&str]) -> Run {
    on_from(cluster, 0, args)
}

/// `on`, with node `first`'s URL first in `--url` (the node the CLI asks first).
fn on_from(cluster: &Cluster, first: usize, args: &[&str]) -> Run {
    let n = cluster.addrs.len();
    let urls: Vec<String> = (0..n).map(|i| cluster.url((first + i) % n, "")).collect();
    let token = cluster.dir.path().join("keys").join("admin.token");
    let mut all: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    all.extend([
        "--url".into(),
        urls.join(","),
        "--token-file".into(),
        token.display().to_string(),
    ]);
    let all: Vec<&str> = all.iter().map(String::as_str).collect();
    run(&all)
}

fn ok(run: Run, what: &str) -> String {
    assert_eq!(run.code, 0, "{what}: {}{}", run.out, run.err);
    run.out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[expect(
    clippy::too_many_lines,
    reason = "a scenario test: an operator's day, in order, against one cluster"
)]
async fn an_operators_day_with_the_cli() {
    let cluster = Cluster::start(3).await;

    // Status: options after the subcommand; every node reachable.
    let status = ok(on(&cluster, &["cluster", "status"]), "status");
    assert!(status.contains("LAST CONTACT"), "{status}");
    assert_eq!(status.matches("follower").count(), 2, "{status}");
    assert!(!status.contains("UNREACHABLE"), "{status}");
    let parsed: Value =
        serde_json::from_str(&ok(on(&cluster, &["cluster", "status", "--json"]), "json"))
            .expect("--json prints the API body");
    assert_eq!(parsed["nodes"].as_array().map(Vec::len), Some(3));

    // Create, ask, queue, approve, reject.
    let policy = json!({"budget": 10, "scar_limit": 10,
        "tools": {"pay": {"cost": 3, "requires_approval": true}}});
    let created = ok(
        on(
            &cluster,
            &["agent", "create", "bot", "--policy", &policy.to_string()],
        ),
        "create",
    );
    let token = created
        .lines()
        .find_map(|l| l.strip_prefix("token "))
        .expect("the token is printed")
        .trim()
        .to_string();
    for input in ["a", "b", "c", "d", "e"] {
        let (code, decision) = cluster
            .post(
                0,
                "/v1/agents/bot/actions",
                &token,
                json!({"tool": "pay", "input": {"to": input}}),
                None,
            )
            .await;
        assert_eq!(
            (code, decision["decision"].as_str()),
            (200, Some("pending_approval"))
        );
    }
    let queue = ok(on(&cluster, &["agent", "pending"]), "pending");
    for action in ["act-1", "act-2", "act-3", "act-4"] {
        assert!(queue.contains(action), "{action} in:\n{queue}");
    }
    let approved = ok(
        on(
            &cluster,
            &["agent", "approve", "bot", "act-1", "--approver", "alice"],
        ),
        "approve",
    );
    assert!(approved.contains("allowed act-1"), "{approved}");
    // Deciding again is refused by the cluster: a negative result, exit 1.
    let again = on(&cluster, &["agent", "approve", "bot", "act-1"]);
    assert_eq!(again.code, 1, "{}{}", again.out, again.err);
    let rejected = ok(
        on(
            &cluster,
            &["agent", "reject", "bot", "act-2", "--reason", "no"],
        ),
        "reject",
    );
    assert!(rejected.contains("denied act-2"), "{rejected}");
    ok(
        on(&cluster, &["agent", "approve", "bot", "act-3"]),
        "approve 3",
    );
    ok(
        on(&cluster, &["agent", "approve", "bot", "act-4"]),
        "approve 4",
    );
    // 9 of 10 spent: the fifth request, asked when it fitted, no longer does.
    let denied = on(&cluster, &["agent", "approve", "bot", "act-5"]);
    assert_eq!(
        denied.code, 1,
        "an approval the guard denies: {}{}",
        denied.out, denied.err
    );
    assert!(denied.out.contains("insufficient_budget"), "{}", denied.out);
    let shown = ok(on(&cluster, &["agent", "show", "bot"]), "show");
    assert!(shown.contains("9 spent of 10"), "{shown}");
    let listed = ok(on(&cluster, &["agent", "list"]), "list");
    assert!(
        listed.contains("bot") && listed.contains("9/10"),
        "{listed}"
    );

    // The fetched log is exactly the signed lines: it verifies with the cluster's key.
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("bot.jsonl");
    ok(
        on(
            &cluster,
            &["audit", "fetch", "bot", "--out", &log.display().to_string()],
        ),
        "fetch",
    );
    let public_key = cluster.public_key().await;
    let verified = ok(
        run(&[
            "audit",
            "verify",
            &log.display().to_string(),
            "--public-key",
            &public_key,
        ]),
        "verify",
    );
    assert!(verified.starts_with("OK  "), "{verified}");
    let (_, page) = cluster.get(0, "/v1/agents/bot/log", &cluster.admin).await;
    let page_file = dir.path().join("page.json");
    std::fs::write(&page_file, page.to_string()).expect("write page");
    let refused = run(&["audit", "verify", &page_file.display().to_string()]);
    assert_eq!(refused.code, 2, "{}{}", refused.out, refused.err);
    assert!(refused.err.contains("is an API page"), "{}", refused.err);
    assert!(
        !refused.out.contains("FAILED"),
        "it is not reported as tampering"
    );

    let terminated = ok(
        on(&cluster, &["agent", "terminate", "bot", "--reason", "done"]),
        "terminate",
    );
    assert!(terminated.contains("terminated bot"), "{terminated}");

    // A snapshot of the node asked first, whichever leads, with its log purged.
    let snapshot: Value = serde_json::from_str(&ok(
        on_from(&cluster, 2, &["cluster", "snapshot"]),
        "snapshot",
    ))
    .expect("the answer is printed as JSON");
    assert_eq!(snapshot["node_id"], 3, "{snapshot}");
    assert!(snapshot["snapshot_index"].as_u64() > Some(0), "{snapshot}");

    // A stopped node shows as unreachable, while the leader keeps serving.
    let leader = cluster.wait_for_leader(Duration::from_secs(15)).await;
    let stopped = (leader + 1) % 3;
    cluster.pause(stopped);
    let start = Instant::now();
    let status = loop {
        // The stopped node is asked first: it accepts the connection and never answers,
        // so the CLI must give up on it after --timeout and ask the next.
        let status = ok(
            on_from(&cluster, stopped, &["cluster", "status"]),
            "status with a node down",
        );
        if status.contains("UNREACHABLE") {
            break status;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "never unreachable:\n{status}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let line = status
        .lines()
        .find(|l| l.contains("UNREACHABLE"))
        .expect("a line");
    assert!(line.starts_with(&(stopped + 1).to_string()), "{status}");
    // The leader's metric says the same, for the alert on a dead follower in an idle
    // cluster (its replication lag can stay 0).
    let metrics = cluster
        .http
        .get(cluster.url(leader, "/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    let silence = metrics
        .lines()
        .find_map(|l| {
            l.strip_prefix("lineage_raft_peer_last_contact_seconds{")
                .filter(|rest| rest.contains(&format!("peer=\"{}\"", stopped + 1)))
                .and_then(|rest| rest.rsplit(' ').next())
                .and_then(|v| v.parse::<f64>().ok())
        })
        .expect("the stopped peer's last contact");
    assert!(
        silence >= 3.0,
        "{silence} s since the stopped peer answered"
    );
    assert!(metrics.contains("lineage_build_info{"), "build info");
    assert!(
        metrics.contains("\nprocess_resident_memory_bytes "),
        "process metrics"
    );
    cluster.resume(stopped);

    // Exit codes for what went wrong.
    let unreachable = run(&[
        "--url",
        "http://127.0.0.1:1",
        "--timeout",
        "0.5",
        "agent",
        "list",
        "--token-file",
        &cluster
            .dir
            .path()
            .join("keys/admin.token")
            .display()
            .to_string(),
    ]);
    assert_eq!(unreachable.code, 3, "{}", unreachable.err);
    assert!(
        unreachable.err.contains("Connection refused"),
        "{}",
        unreachable.err
    );
    let wrong_token = dir.path().join("wrong.token");
    std::fs::write(&wrong_token, "not-the-token").expect("write");
    let refused = run(&[
        "agent",
        "list",
        "--url",
        &cluster.url(0, ""),
        "--token-file",
        &wrong_token.display().to_string(),
    ]);
    assert_eq!(refused.code, 4, "{}", refused.err);
    let usage = run(&["agent", "approve"]);
    assert_eq!(usage.code, 2, "{}", usage.err);
}

/// Decides `n` actions for `bot` through node `via`, each allowed; a 503 while
/// leadership moves is retried under the same key, as a client would.
async fn act(cluster: &Cluster, via: usize, token: &str, tag: &str, n: usize) {
    for i in 0..n {
        let (status, decision) = cluster
            .post_until_served(
                via,
                "/v1/agents/bot/actions",
                token,
                json!({"tool": "work", "input": {"n": format!("{tag}-{i}")}}),
                &format!("{tag}-{i}"),
            )
            .await;
        assert_eq!(
            (status, decision["decision"].as_str()),
            (200, Some("allowed")),
            "{decision}"
        );
    }
}

/// The members, as (id, role), and the leader, as the leader `node` knows tells them
/// (the route is answered by the leader); `None` while there is none (503).
async fn members(cluster: &Cluster, node: usize) -> Option<(Vec<(u64, String)>, Option<u64>)> {
    let (status, view) = cluster.get(node, "/v1/cluster", &cluster.admin).await;
    if status == 503 {
        return None;
    }
    assert_eq!(status, 200, "{view}");
    let nodes = view["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .map(|n| {
            (
                n["id"].as_u64().expect("id"),
                n["role"].as_str().expect("role").to_string(),
            )
        })
        .collect();
    Some((nodes, view["leader"].as_u64()))
}

/// `members`, waited for (bounded) while there is no leader.
async fn members_once_led(cluster: &Cluster, node: usize) -> (Vec<(u64, String)>, Option<u64>) {
    let start = Instant::now();
    loop {
        if let Some(view) = members(cluster, node).await {
            return view;
        }
        assert!(start.elapsed() < Duration::from_secs(15), "no leader");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Membership changes with `lineage cluster add` and `remove`, run as binaries against
/// real nodes: a spare node joins as a voter with the whole log; the leader's removal
/// is refused with the procedure, which is then followed (stop it, remove it) and the
/// cluster decides on without it; a node whose disk is replaced comes back by the
/// procedure ARCHITECTURE.md gives (remove, wipe, add). Every node left has
/// the same log, which verifies, and counts every decision.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[expect(
    clippy::too_many_lines,
    reason = "a scenario test: three membership changes in order, against one cluster"
)]
async fn membership_changes_with_the_cli() {
    let cluster = Cluster::start_with_spares(3, 1).await;
    let token = cluster
        .create_agent(
            0,
            "bot",
            json!({"budget": 1000, "scar_limit": 10, "tools": {"work": {"cost": 1}}}),
        )
        .await;
    act(&cluster, 0, &token, "before", 20).await;

    // A spare node, running but not a member, joins: a learner until caught up, then a
    // voter (the command answers when it is one).
    cluster.start_node(3);
    let addr4 = cluster.addrs[3].clone();
    ok(on(&cluster, &["cluster", "add", "4", &addr4]), "add 4");
    let (nodes, leader) = members_once_led(&cluster, 0).await;
    assert_eq!(
        nodes.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
        vec![1, 2, 3, 4],
        "{nodes:?}"
    );
    assert!(
        nodes.iter().all(|(_, role)| role != "learner"),
        "node 4 is a voter: {nodes:?}"
    );
    let status = ok(on(&cluster, &["cluster", "status"]), "status");
    assert!(
        status
            .lines()
            .any(|l| l.starts_with('4') && l.contains(&addr4)),
        "{status}"
    );
    cluster.wait_ready(3, Duration::from_secs(30)).await;
    act(&cluster, 3, &token, "after-add", 10).await;
    // Two records to create an agent, two per decision (request and answer).
    let log = cluster.converged_log("bot", Duration::from_secs(30)).await;
    assert_eq!(log.len(), 2 + 2 * 30);

    // A node that is not a member cannot be removed; the answer says why.
    let refused = on(&cluster, &["cluster", "remove", "9"]);
    assert_eq!(refused.code, 1, "{}{}", refused.out, refused.err);
    assert!(
        refused
            .err
            .contains("node 9 is not a member of the cluster (members: 1, 2, 3, 4)"),
        "{}",
        refused.err
    );

    // The leader cannot remove itself (openraft 0.9 fails a leader removed under it):
    // refused, saying what to do. Stopped, another node leads, and it is removed.
    let removed_id = leader.expect("a leader");
    let leader = usize::try_from(removed_id).expect("id") - 1;
    let refused = on(&cluster, &["cluster", "remove", &removed_id.to_string()]);
    assert_eq!(refused.code, 1, "{}{}", refused.out, refused.err);
    assert!(
        refused
            .err
            .contains("is the leader and cannot remove itself: stop it"),
        "{}",
        refused.err
    );
    cluster.stop_gracefully(leader);
    let survivor = (leader + 1) % 4;
    ok(
        on_from(
            &cluster,
            survivor,
            &["cluster", "remove", &removed_id.to_string()],
        ),
        "remove the stopped leader",
    );
    let start = Instant::now();
    let new_leader = loop {
        let view = members(&cluster, survivor).await;
        if let Some((nodes, Some(new_leader))) = view {
            assert_eq!(nodes.len(), 3, "{nodes:?}");
            assert!(nodes.iter().all(|(id, _)| *id != removed_id), "{nodes:?}");
            break usize::try_from(new_leader).expect("id") - 1;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no leader after the old one was removed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    act(&cluster, survivor, &token, "after-remove", 10).await;

    // A replaced disk: remove the node, wipe it, and add it back under its old id.
    let replaced = (0..4)
        .find(|i| *i != leader && *i != new_leader)
        .expect("a follower");
    let replaced_id = (replaced + 1).to_string();
    ok(
        on_from(&cluster, new_leader, &["cluster", "remove", &replaced_id]),
        "remove for a new disk",
    );
    cluster.stop_gracefully(replaced);
    cluster.wipe(replaced);
    cluster.start_node(replaced);
    let addr = cluster.addrs[replaced].clone();
    ok(
        on_from(
            &cluster,
            new_leader,
            &["cluster", "add", &replaced_id, &addr],
        ),
        "add the new disk",
    );
    cluster.wait_ready(replaced, Duration::from_secs(30)).await;
    act(&cluster, replaced, &token, "after-replace", 10).await;

    let log = cluster.converged_log("bot", Duration::from_secs(30)).await;
    assert_eq!(
        log.len(),
        2 + 2 * 50,
        "the agent's creation and 50 decisions"
    );
    util::verify_log(&log, &cluster.public_key().await);
    let (status, bot) = cluster.get(replaced, "/v1/agents/bot", &token).await;
    assert_eq!(status, 200, "{bot}");
    assert_eq!(bot["spent"], 50, "{bot}");
}
