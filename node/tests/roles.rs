//! Named operators and their roles, against a live three-node cluster, every request
//! through a follower (which forwards it, bearer token and all, to the leader):
//!
//! - the endpoint × role table of `docs/SECURITY.md`, cell by cell: each role is either
//!   let through (anything but 401/403) or refused with 403 `forbidden` and a message
//!   naming its role, and refused requests leave the agent's log unchanged;
//! - records name the operator (`approved_by`, `rejected_by`'s `by`, the terminator, the
//!   scar's author) and keep a name the body gave beside it as `claimed_by`; the shared
//!   admin token keeps the reference's behaviour (the body's name);
//! - a revoked token gets 401 on every node once applied, names are never reused,
//!   `admin` is reserved, the last named admin cannot be revoked;
//! - the system log is the same signed `lineage-audit-v1` log on every replica, verifies
//!   with the cluster key, holds token hashes only, and survives a kill -9;
//! - `lineage operator add` (the binary) makes a token only it ever sees.

#[path = "cluster/util.rs"]
mod util;

use std::path::Path;
use std::time::{Duration, Instant};

use lineage_core::operators::{generate_token, token_sha256};
use lineage_core::Record;
use serde_json::{json, Value};
use util::{lineage_bin, Cluster};

/// What a route needs, as `docs/SECURITY.md`'s table says.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Need {
    Read,
    Decide,
    Admin,
    Publish,
    AnyToken,
}

const ROLES: [&str; 4] = ["admin", "approver", "auditor", "publisher"];

fn allowed(need: Need, role: &str) -> bool {
    match need {
        Need::Read => matches!(role, "admin" | "approver" | "auditor"),
        Need::Decide => matches!(role, "admin" | "approver"),
        Need::Admin => role == "admin",
        Need::Publish => matches!(role, "admin" | "publisher"),
        Need::AnyToken => true,
    }
}

struct Route {
    method: &'static str,
    path: String,
    body: Option<Value>,
    need: Need,
}

fn route(method: &'static str, path: impl Into<String>, body: Option<Value>, need: Need) -> Route {
    Route {
        method,
        path: path.into(),
        body,
        need,
    }
}

/// Every operator route but membership changes (`cluster_routes` below), with bodies
/// that are well formed, so the answer is the role's.
#[expect(
    clippy::too_many_lines,
    reason = "the endpoint table, one entry per route, reads best in one place"
)]
fn routes(agent: &str, action: &str, fresh: &str) -> Vec<Route> {
    let base = format!("/v1/agents/{agent}");
    let act = format!("{base}/actions/{action}");
    vec![
        route("GET", "/v1/agents", None, Need::Read),
        route(
            "POST",
            "/v1/agents",
            Some(json!({"agent_id": fresh, "policy": {"budget": 5, "scar_limit": 3, "tools": {}}})),
            Need::Admin,
        ),
        route("GET", base.clone(), None, Need::Read),
        route("GET", format!("{base}/token"), None, Need::Admin),
        route(
            "POST",
            format!("/v1/agents/{fresh}/token/reissue"),
            Some(json!({})),
            Need::Admin,
        ),
        route(
            "POST",
            format!("{base}/actions"),
            Some(json!({"tool": "work"})),
            Need::Admin,
        ),
        route("GET", format!("{base}/actions/pending"), None, Need::Read),
        route("GET", "/v1/actions/pending", None, Need::Read),
        route("GET", act.clone(), None, Need::Read),
        route(
            "POST",
            format!("{act}/outcome"),
            Some(json!({"status": "success"})),
            Need::Admin,
        ),
        route(
            "POST",
            format!("{act}/approve"),
            Some(json!({"approver": "m"})),
            Need::Decide,
        ),
        route(
            "POST",
            format!("{act}/reject"),
            Some(json!({"approver": "m", "reason": "x"})),
            Need::Decide,
        ),
        // A scar can terminate: approvers may reject, but not with one.
        route(
            "POST",
            format!("{act}/reject"),
            Some(json!({"approver": "m", "reason": "x", "scar": "minor"})),
            Need::Admin,
        ),
        route(
            "POST",
            format!("{base}/scars"),
            Some(json!({"severity": "minor", "reason": "x"})),
            Need::Admin,
        ),
        route(
            "POST",
            format!("{base}/terminate"),
            Some(json!({"reason": "x", "by": "m"})),
            Need::Admin,
        ),
        route("GET", format!("{base}/log"), None, Need::Read),
        route("GET", format!("{base}/verify"), None, Need::Read),
        route(
            "POST",
            "/v1/transparency/checkpoint/witnessed",
            Some(Value::String("not a note".into())),
            Need::Publish,
        ),
        route(
            "GET",
            format!("/v1/agents/{fresh}/import"),
            None,
            Need::Admin,
        ),
        route(
            "POST",
            format!("/v1/agents/{fresh}/import/begin"),
            Some(
                json!({"genesis_hash": "00".repeat(32), "source_sha256": "00".repeat(32),
                        "head": {"seq": 0, "hash": "00".repeat(32)}}),
            ),
            Need::Admin,
        ),
        route("GET", "/v1/cluster", None, Need::Read),
        route("GET", "/v1/operators", None, Need::Read),
        route("GET", "/v1/operators/log", None, Need::Read),
        route(
            "POST",
            "/v1/operators",
            Some(json!({"name": format!("{fresh}-op"), "role": "auditor",
                        "token_sha256": token_sha256(fresh)})),
            Need::Admin,
        ),
        route(
            "POST",
            format!("/v1/operators/{fresh}-op/revoke"),
            Some(json!({})),
            Need::Admin,
        ),
        route("GET", "/v1/whoami", None, Need::AnyToken),
    ]
}

async fn send(cluster: &Cluster, node: usize, token: &str, route: &Route) -> (u16, Value) {
    match (route.method, &route.body) {
        ("POST", Some(Value::String(text))) => {
            let reply = cluster
                .http
                .post(cluster.url(node, &route.path))
                .bearer_auth(token)
                .body(text.clone())
                .send()
                .await;
            match reply {
                Ok(reply) => {
                    let status = reply.status().as_u16();
                    (status, reply.json().await.unwrap_or(Value::Null))
                }
                Err(e) => (0, json!({"transport_error": e.to_string()})),
            }
        }
        ("POST", Some(body)) => {
            cluster
                .post(node, &route.path, token, body.clone(), None)
                .await
        }
        _ => cluster.get(node, &route.path, token).await,
    }
}

/// Adds an operator through node `node` with the admin token; returns its token.
async fn add_operator(cluster: &Cluster, node: usize, name: &str, role: &str) -> String {
    let token = generate_token().expect("token");
    let (status, body) = cluster
        .post(
            node,
            "/v1/operators",
            &cluster.admin,
            json!({"name": name, "role": role, "token_sha256": token_sha256(&token)}),
            None,
        )
        .await;
    assert_eq!(status, 200, "adding {name}: {body}");
    assert_eq!(body["role"], role, "{body}");
    assert_eq!(body["added_by"], "admin", "{body}");
    token
}

/// An action of `agent` waiting for approval, requested with its token.
async fn pending_action(cluster: &Cluster, node: usize, agent: &str, token: &str) -> String {
    let (status, body) = cluster
        .post(
            node,
            &format!("/v1/agents/{agent}/actions"),
            token,
            json!({"tool": "pay", "input": {"eur": 5}}),
            None,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["decision"], "pending_approval", "{body}");
    body["action_id"].as_str().expect("action id").to_string()
}

/// The last record of `kind` in `agent`'s log.
async fn last_record(cluster: &Cluster, agent: &str, kind: &str) -> Value {
    let (status, body) = cluster
        .get(
            0,
            &format!("/v1/agents/{agent}/log?limit=5000"),
            &cluster.admin,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    body["records"]
        .as_array()
        .and_then(|records| records.iter().rev().find(|r| r["kind"] == kind))
        .cloned()
        .unwrap_or_else(|| panic!("no {kind} record in {agent}'s log: {body}"))
}

fn policy() -> Value {
    json!({"budget": 1000, "scar_limit": 1000,
           "tools": {"work": {"cost": 1}, "pay": {"cost": 1, "requires_approval": true}}})
}

/// Membership changes and node snapshots: admin only. An admin "adds" a member as a
/// learner, which changes nothing; a removal of a node that is not a member is refused
/// (404).
async fn membership_changes_are_admin_only(
    cluster: &Cluster,
    via: usize,
    tokens: &[(&str, String)],
) {
    let (status, cluster_view) = cluster.get(via, "/v1/cluster", &cluster.admin).await;
    assert_eq!(status, 200, "{cluster_view}");
    let member = &cluster_view["nodes"][0];
    let add = json!({"id": member["id"], "addr": member["addr"], "learner_only": true});
    for (role, token) in tokens {
        for (path, body) in [
            ("/v1/cluster/nodes", add.clone()),
            ("/v1/cluster/nodes/remove", json!({"id": 77})),
            ("/v1/node/snapshot", json!({})),
        ] {
            let (status, answer) = cluster.post(via, path, token, body, None).await;
            if *role == "admin" {
                assert!(
                    status != 401 && status != 403 && status != 0,
                    "{path}: {status} {answer}"
                );
            } else {
                assert_eq!(status, 403, "{role} on {path}: {answer}");
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_answers_each_role_as_the_table_says() {
    let cluster = Cluster::start(3).await;
    let leader = cluster.wait_for_leader(Duration::from_secs(20)).await;
    let via = (leader + 1) % 3;
    let mut tokens = Vec::new();
    for role in ROLES {
        tokens.push((
            role,
            add_operator(&cluster, via, &format!("op-{role}"), role).await,
        ));
    }
    let agent_token = cluster.create_agent(via, "table", policy()).await;

    // Refusals first: they must leave the log as it was.
    let action = pending_action(&cluster, via, "table", &agent_token).await;
    let before = cluster
        .converged_log("table", Duration::from_secs(20))
        .await;
    let mut cells = 0;
    for (role, token) in &tokens {
        for r in routes("table", &action, &format!("fresh-{role}")) {
            if allowed(r.need, role) {
                continue;
            }
            let (status, body) = send(&cluster, via, token, &r).await;
            assert_eq!(status, 403, "{role} on {} {}: {body}", r.method, r.path);
            assert_eq!(
                body["code"], "forbidden",
                "{role} on {} {}: {body}",
                r.method, r.path
            );
            let message = body["error"].as_str().unwrap_or_default();
            assert!(
                message.contains(role) || message.contains("admin"),
                "{role} on {} {}: the refusal names the role: {body}",
                r.method,
                r.path
            );
            cells += 1;
        }
    }
    assert_eq!(
        cluster
            .converged_log("table", Duration::from_secs(20))
            .await,
        before,
        "a refused request changed the log"
    );

    // Then each role where it is allowed: never 401 or 403. Each role gets its own
    // pending action, so approving or rejecting finds one; the admin goes last, since
    // it terminates the agent.
    for (role, token) in tokens.iter().rev() {
        let action = pending_action(&cluster, via, "table", &agent_token).await;
        for r in routes("table", &action, &format!("fresh-{role}")) {
            if !allowed(r.need, role) {
                continue;
            }
            let (status, body) = send(&cluster, via, token, &r).await;
            // Let through: an answer of the route's own (not 401/403, and no failure).
            assert!(
                status != 401 && status != 403 && status != 0 && status < 500,
                "{role} on {} {}: {status} {body}",
                r.method,
                r.path
            );
            cells += 1;
        }
    }
    let table_len = routes("table", "a", "f").len();
    assert_eq!(cells, table_len * ROLES.len(), "every cell was tried");

    membership_changes_are_admin_only(&cluster, via, &tokens).await;

    // An agent's token is no operator: 403 on the operator routes, and whoami names it.
    for path in ["/v1/operators", "/v1/operators/log", "/v1/cluster"] {
        assert_eq!(cluster.get(via, path, &agent_token).await.0, 403, "{path}");
    }
    let (status, me) = cluster.get(via, "/v1/whoami", &agent_token).await;
    assert_eq!(
        (status, &me["kind"], &me["agent_id"]),
        (200, &json!("agent"), &json!("table"))
    );
    let (_, me) = cluster.get(via, "/v1/whoami", &tokens[1].1).await;
    assert_eq!(
        me,
        json!({"kind": "operator", "name": "op-approver", "role": "approver", "attributed": true})
    );
    let (_, me) = cluster.get(via, "/v1/whoami", &cluster.admin).await;
    assert_eq!(
        (&me["kind"], &me["attributed"]),
        (&json!("shared_admin"), &json!(false))
    );
    // A token that is nobody's is 401, not 403.
    let nobody = generate_token().expect("token");
    assert_eq!(cluster.get(via, "/v1/agents", &nobody).await.0, 401);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_name_the_operator_and_keep_the_claimed_name_beside_it() {
    let cluster = Cluster::start(3).await;
    let leader = cluster.wait_for_leader(Duration::from_secs(20)).await;
    let via = (leader + 1) % 3;
    let carol = add_operator(&cluster, via, "carol", "approver").await;
    let root = add_operator(&cluster, via, "root", "admin").await;
    let agent = cluster.create_agent(via, "attributed", policy()).await;

    // An approver approves, claiming another name: the log names carol.
    let first = pending_action(&cluster, via, "attributed", &agent).await;
    let path = format!("/v1/agents/attributed/actions/{first}/approve");
    let (status, body) = cluster
        .post(via, &path, &carol, json!({"approver": "the-ceo"}), None)
        .await;
    assert_eq!(body["decision"], "allowed", "{status} {body}");
    let allowed = last_record(&cluster, "attributed", "action_allowed").await;
    assert_eq!(allowed["payload"]["approved_by"], "carol", "{allowed}");
    assert_eq!(allowed["payload"]["claimed_by"], "the-ceo", "{allowed}");
    // Without a name in the body, a named operator still approves (and claims nothing).
    let second = pending_action(&cluster, via, "attributed", &agent).await;
    let path = format!("/v1/agents/attributed/actions/{second}/reject");
    let (status, body) = cluster
        .post(via, &path, &carol, json!({"reason": "not today"}), None)
        .await;
    assert_eq!(status, 200, "{body}");
    let rejected = last_record(&cluster, "attributed", "action_rejected").await;
    assert_eq!(rejected["payload"]["by"], "carol", "{rejected}");
    assert!(
        rejected["payload"].get("claimed_by").is_none(),
        "{rejected}"
    );

    // The shared admin token: the body's name, as the reference records it.
    let third = pending_action(&cluster, via, "attributed", &agent).await;
    let path = format!("/v1/agents/attributed/actions/{third}/approve");
    let (status, body) = cluster
        .post(
            via,
            &path,
            &cluster.admin,
            json!({"approver": "alice"}),
            None,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let allowed = last_record(&cluster, "attributed", "action_allowed").await;
    assert_eq!(allowed["payload"]["approved_by"], "alice", "{allowed}");
    assert!(allowed["payload"].get("claimed_by").is_none(), "{allowed}");
    // ... but never under a named operator's name: that is carol's token's to make.
    let (status, body) = cluster
        .post(
            via,
            &path,
            &cluster.admin,
            json!({"approver": "carol"}),
            None,
        )
        .await;
    assert_eq!(
        (status, &body["code"]),
        (403, &json!("forbidden")),
        "{body}"
    );
    // ... and without one it is refused, as before.
    let fourth = pending_action(&cluster, via, "attributed", &agent).await;
    let path = format!("/v1/agents/attributed/actions/{fourth}/approve");
    let (status, body) = cluster
        .post(via, &path, &cluster.admin, json!({}), None)
        .await;
    assert_eq!(
        (status, &body["code"]),
        (422, &json!("invalid_body")),
        "{body}"
    );

    // An admin operator scars and terminates: both records name root.
    let (status, body) = cluster
        .post(
            via,
            "/v1/agents/attributed/scars",
            &root,
            json!({"severity": "minor", "reason": "late"}),
            None,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let scar = last_record(&cluster, "attributed", "scar").await;
    assert_eq!(scar["payload"]["by"], "root", "{scar}");
    let (status, body) = cluster
        .post(
            via,
            "/v1/agents/attributed/terminate",
            &root,
            json!({"reason": "done", "by": "someone"}),
            None,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let terminated = last_record(&cluster, "attributed", "terminated").await;
    assert_eq!(terminated["payload"]["by"], "root", "{terminated}");
    assert_eq!(
        terminated["payload"]["claimed_by"], "someone",
        "{terminated}"
    );

    // The agent's log still verifies as lineage-audit-v1 with the extra fields.
    let (status, report) = cluster
        .get(via, "/v1/agents/attributed/verify", &carol)
        .await;
    assert_eq!((status, &report["ok"]), (200, &json!(true)), "{report}");
}

/// Node `node`'s own copy of the system log.
async fn local_system_log(cluster: &Cluster, node: usize) -> Vec<Value> {
    let (status, body) = cluster
        .get(node, "/v1/operators/log?local=true", &cluster.admin)
        .await;
    assert_eq!(status, 200, "{body}");
    body["records"].as_array().cloned().unwrap_or_default()
}

/// Waits until every node's copy of the system log has `len` records, and returns them.
async fn converged_system_log(cluster: &Cluster, len: usize) -> Vec<Value> {
    let start = Instant::now();
    loop {
        let logs = [
            local_system_log(cluster, 0).await,
            local_system_log(cluster, 1).await,
            local_system_log(cluster, 2).await,
        ];
        if logs.iter().all(|log| log.len() == len && *log == logs[0]) {
            return logs[0].clone();
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "system logs did not converge to {len} records: {logs:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The status of `GET /v1/agents?local=true` on `node` with `token`, once it is
/// `want` (a follower applies a change shortly after the leader), or what it was.
async fn local_status_becomes(cluster: &Cluster, node: usize, token: &str, want: u16) -> u16 {
    let start = Instant::now();
    loop {
        let status = cluster.get(node, "/v1/agents?local=true", token).await.0;
        if status == want || start.elapsed() > Duration::from_secs(20) {
            return status;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Operator changes the registry refuses, each with its code.
async fn refusals_have_their_codes(cluster: &Cluster, via: usize, dave: &str) {
    // Refusals, each with its code.
    let cases = [
        (
            json!({"name": "dave", "role": "auditor", "token_sha256": token_sha256("new")}),
            409,
            "operator_exists",
        ),
        (
            json!({"name": "admin", "role": "admin", "token_sha256": token_sha256("x")}),
            409,
            "name_reserved",
        ),
        (
            json!({"name": "erin", "role": "auditor", "token_sha256": token_sha256(dave)}),
            409,
            "token_in_use",
        ),
        (
            json!({"name": "Erin!", "role": "auditor", "token_sha256": token_sha256("y")}),
            400,
            "bad_request",
        ),
        (
            json!({"name": "erin", "role": "root", "token_sha256": token_sha256("y")}),
            400,
            "bad_request",
        ),
        (
            json!({"name": "erin", "role": "auditor", "token_sha256": "abc"}),
            400,
            "bad_request",
        ),
        // The token itself is never accepted in place of its hash.
        (
            json!({"name": "erin", "role": "auditor", "token_sha256": token_sha256("y"), "token": "y"}),
            422,
            "invalid_body",
        ),
    ];
    for (body, want, code) in cases {
        let (status, answer) = cluster
            .post(via, "/v1/operators", &cluster.admin, body.clone(), None)
            .await;
        assert_eq!(
            (status, answer["code"].as_str()),
            (want, Some(code)),
            "{body}: {answer}"
        );
    }
    let (status, answer) = cluster
        .post(
            via,
            "/v1/operators/first-admin/revoke",
            &cluster.admin,
            json!({}),
            None,
        )
        .await;
    assert_eq!(
        (status, &answer["code"]),
        (409, &json!("last_admin")),
        "{answer}"
    );
    for (name, want, code) in [
        ("dave", 409, "already_revoked"),
        ("nobody", 404, "operator_not_found"),
        ("admin", 409, "name_reserved"),
    ] {
        let (status, answer) = cluster
            .post(
                via,
                &format!("/v1/operators/{name}/revoke"),
                &cluster.admin,
                json!({}),
                None,
            )
            .await;
        assert_eq!(
            (status, answer["code"].as_str()),
            (want, Some(code)),
            "{name}: {answer}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revocation_reserved_names_and_the_system_log_on_every_replica() {
    let cluster = Cluster::start(3).await;
    let leader = cluster.wait_for_leader(Duration::from_secs(20)).await;
    let via = (leader + 1) % 3;
    let dave = add_operator(&cluster, via, "dave", "auditor").await;
    let first_admin = add_operator(&cluster, via, "first-admin", "admin").await;
    for node in 0..3 {
        assert_eq!(
            local_status_becomes(&cluster, node, &dave, 200).await,
            200,
            "node {node}"
        );
    }
    // A retried add of the same operator is answered as done, and appends nothing.
    let (status, body) = cluster
        .post(
            via,
            "/v1/operators",
            &cluster.admin,
            json!({"name": "dave", "role": "auditor", "token_sha256": token_sha256(&dave)}),
            None,
        )
        .await;
    assert_eq!((status, &body["active"]), (200, &json!(true)), "{body}");

    // Revoked by a named admin: 401 on every node once applied, and the record says who.
    let (status, body) = cluster
        .post(
            via,
            "/v1/operators/dave/revoke",
            &first_admin,
            json!({}),
            None,
        )
        .await;
    assert_eq!(
        (status, &body["revoked_by"]),
        (200, &json!("first-admin")),
        "{body}"
    );
    assert_eq!(cluster.get(via, "/v1/agents", &dave).await.0, 401);
    for node in 0..3 {
        assert_eq!(
            local_status_becomes(&cluster, node, &dave, 401).await,
            401,
            "node {node}"
        );
    }

    refusals_have_their_codes(&cluster, via, &dave).await;

    // The system log: genesis + two adds + one revoke, the same on every replica, signed
    // by the cluster's key, and with no token in it.
    let records = converged_system_log(&cluster, 4).await;
    let parsed: Vec<Record> = records
        .iter()
        .map(|r| serde_json::from_value(r.clone()).expect("a record"))
        .collect();
    let options = lineage_core::VerifyOptions {
        public_key: Some(cluster.public_key().await),
        checkpoint: None,
    };
    let report = lineage_core::verify_records(&parsed, &options);
    assert!(report.ok, "{report:?}");
    let kinds: Vec<&str> = parsed.iter().map(|r| r.kind.as_str()).collect();
    assert_eq!(
        kinds,
        [
            "genesis",
            "operator_added",
            "operator_added",
            "operator_revoked"
        ]
    );
    let text = serde_json::to_string(&records).expect("json");
    assert!(
        !text.contains(&dave) && !text.contains(&first_admin),
        "a token reached the log"
    );
    assert!(text.contains(&token_sha256(&dave)));

    // kill -9 a follower and restart it: its registry comes back from its own store.
    let follower = (leader + 2) % 3;
    cluster.kill(follower);
    cluster.start_node(follower);
    cluster.wait_ready(follower, Duration::from_secs(30)).await;
    assert_eq!(
        local_status_becomes(&cluster, follower, &first_admin, 200).await,
        200
    );
    assert_eq!(
        local_status_becomes(&cluster, follower, &dave, 401).await,
        401
    );
    assert_eq!(local_system_log(&cluster, follower).await, records);
}

/// Exit code, stdout and stderr of `lineage` with a token file.
type Run<'a> = dyn Fn(&[&str], &Path) -> (i32, String, String) + 'a;

/// `--token-out` again: the token the file holds is registered (done, nothing new); the
/// file is never overwritten, so another name with it is refused, and a file that holds
/// something else is left alone.
fn the_token_file_is_reused_never_overwritten(
    run: &Run<'_>,
    admin_file: &Path,
    token_file: &Path,
    token: &str,
) {
    let to = token_file.to_str().expect("utf-8 path");
    let scratch = admin_file.parent().expect("scratch");
    // Run again, the command registers the token the file holds (done, nothing new);
    // the file is never overwritten, so another name with it is refused.
    let (code, out, err) = run(
        &[
            "operator",
            "add",
            "frank",
            "--role",
            "approver",
            "--token-out",
            to,
        ],
        admin_file,
    );
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(
        std::fs::read_to_string(token_file).expect("token file"),
        token
    );
    let (code, _, err) = run(
        &[
            "operator",
            "add",
            "gina",
            "--role",
            "auditor",
            "--token-out",
            to,
        ],
        admin_file,
    );
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("token hash belongs to another operator"),
        "{err}"
    );
    // A file that holds something else is refused, and left alone.
    let junk = scratch.join("junk");
    std::fs::write(&junk, "not a token").expect("junk");
    let (code, _, err) = run(
        &[
            "operator",
            "add",
            "gina",
            "--role",
            "auditor",
            "--token-out",
            junk.to_str().expect("utf-8"),
        ],
        admin_file,
    );
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("never overwritten"), "{err}");
    assert_eq!(std::fs::read_to_string(&junk).expect("junk"), "not a token");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_adds_lists_and_revokes_operators() {
    let cluster = Cluster::start(1).await;
    cluster.wait_for_leader(Duration::from_secs(20)).await;
    let scratch = tempfile::tempdir().expect("scratch");
    let admin_file = scratch.path().join("admin.token");
    std::fs::write(&admin_file, &cluster.admin).expect("admin token file");
    let token_file = scratch.path().join("frank.token");
    let url = cluster.url(0, "");
    let run = |args: &[&str], token: &Path| {
        let output = std::process::Command::new(lineage_bin())
            .args(["--url", &url, "--token-file"])
            .arg(token)
            .args(args)
            .output()
            .expect("run lineage");
        (
            output.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&output.stdout).to_string(),
            String::from_utf8_lossy(&output.stderr).to_string(),
        )
    };
    let to = token_file.to_str().expect("utf-8 path");
    let (code, out, err) = run(
        &[
            "operator",
            "add",
            "frank",
            "--role",
            "approver",
            "--token-out",
            to,
        ],
        &admin_file,
    );
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("added operator frank (approver)"), "{out}");
    let token = std::fs::read_to_string(&token_file).expect("token file");
    assert!(
        token.trim().starts_with("lop_") && !out.contains(token.trim()),
        "{out}"
    );
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&token_file)
            .expect("meta")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "the token file is private");
    }
    the_token_file_is_reused_never_overwritten(&run, &admin_file, &token_file, &token);

    let (code, out, err) = run(&["whoami"], &token_file);
    assert_eq!(
        (code, out.trim()),
        (0, "operator frank (role approver)"),
        "{err}"
    );
    let (code, out, _) = run(&["operator", "list"], &admin_file);
    assert_eq!(code, 0);
    assert!(
        out.lines()
            .any(|l| l.starts_with("frank") && l.contains("approver") && l.contains("active")),
        "{out}"
    );
    // An approver may not add operators: exit 4, the API's refusal.
    let (code, _, err) = run(&["operator", "add", "hal", "--role", "admin"], &token_file);
    assert_eq!(code, 4, "{err}");
    assert!(err.contains("approver role may not"), "{err}");
    let (code, out, err) = run(&["operator", "revoke", "frank"], &admin_file);
    assert_eq!(code, 0, "{out}{err}");
    let (code, _, err) = run(&["whoami"], &token_file);
    assert_eq!(code, 4, "a revoked token is refused: {err}");
    let (code, out, _) = run(&["operator", "list"], &admin_file);
    assert_eq!(code, 0);
    assert!(
        out.lines()
            .any(|l| l.starts_with("frank") && l.contains("revoked")),
        "{out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wiped_node_gets_the_operators_back_from_a_snapshot() {
    let cluster = Cluster::start_with(3, &["--snapshot-every", "16"]).await;
    let leader = cluster.wait_for_leader(Duration::from_secs(20)).await;
    let kept = add_operator(&cluster, leader, "kept", "auditor").await;
    let gone = add_operator(&cluster, leader, "gone", "auditor").await;
    let (status, body) = cluster
        .post(
            leader,
            "/v1/operators/gone/revoke",
            &cluster.admin,
            json!({}),
            None,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let records = converged_system_log(&cluster, 4).await;

    // A follower loses its disk; the others go on past what their logs keep, so it can
    // only come back through a snapshot.
    let follower = (leader + 1) % 3;
    cluster.kill(follower);
    cluster.wipe(follower);
    let agent = cluster
        .create_agent(
            leader,
            "busy",
            json!({"budget": 1000, "scar_limit": 10, "tools": {"work": {"cost": 1}}}),
        )
        .await;
    for _ in 0..60 {
        let (status, body) = cluster
            .post(
                leader,
                "/v1/agents/busy/actions",
                &agent,
                json!({"tool": "work"}),
                None,
            )
            .await;
        assert_eq!(status, 200, "{body}");
    }
    cluster.start_node(follower);
    cluster.wait_ready(follower, Duration::from_secs(60)).await;
    let start = Instant::now();
    while local_system_log(&cluster, follower).await != records {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the system log did not come back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        local_status_becomes(&cluster, follower, &kept, 200).await,
        200
    );
    assert_eq!(
        local_status_becomes(&cluster, follower, &gone, 401).await,
        401
    );
    let (status, body) = cluster
        .get(follower, "/v1/cluster?local=true", &cluster.admin)
        .await;
    assert_eq!(status, 200, "{body}");
}
