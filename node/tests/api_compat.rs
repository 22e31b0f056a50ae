//! Every endpoint and error case of the reference guard server's HTTP API, driven
//! against `lineage-node` started the reference's way (no subcommand, GUARD_* env).

#[path = "cluster/util.rs"]
mod util;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine;
use reqwest::{Client, Method, StatusCode};
use serde_json::{json, Value};

const ADMIN: &str = "an-admin-token-that-is-long-enough-0123456789";

struct Node {
    child: Child,
    base: String,
    http: Client,
    _dir: tempfile::TempDir,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_reference_mode(admin: Option<&str>) -> (tempfile::TempDir, String, Child) {
    start_reference_mode_with(admin, &[])
}

/// The drop-in mode with `settings` in its environment as well.
fn start_reference_mode_with(
    admin: Option<&str>,
    settings: &[(&str, &str)],
) -> (tempfile::TempDir, String, Child) {
    let dir = tempfile::tempdir().unwrap();
    let port = util::free_port();
    let bind = format!("127.0.0.1:{port}");
    let mut command = Command::new(env!("CARGO_BIN_EXE_lineage-node"));
    command
        .env("GUARD_DATA_DIR", dir.path().join("guard-data"))
        .env("GUARD_BIND", &bind)
        .stdout(Stdio::null())
        .stderr(
            std::fs::File::create(dir.path().join("node.stderr"))
                .map(Stdio::from)
                .unwrap_or_else(|_| Stdio::null()),
        );
    match admin {
        Some(token) => command.env("GUARD_ADMIN_TOKEN", token),
        None => command.env_remove("GUARD_ADMIN_TOKEN"),
    };
    // Only what the test sets: a LINEAGE_* variable of the runner's would tune the node.
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("LINEAGE_") {
            command.env_remove(name);
        }
    }
    command.envs(settings.iter().copied());
    let child = command.spawn().unwrap();
    (dir, format!("http://{bind}"), child)
}

async fn start() -> Node {
    let (dir, base, child) = start_reference_mode(Some(ADMIN));
    let node = Node {
        child,
        base,
        http: Client::builder()
            .timeout(Duration::from_secs(5))
            .build()
            .unwrap(),
        _dir: dir,
    };
    let start = Instant::now();
    loop {
        if let Ok(r) = node.http.get(format!("{}/readyz", node.base)).send().await {
            if r.status() == StatusCode::OK {
                return node;
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "node did not become ready"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

impl Node {
    async fn call(
        &self,
        method: Method,
        path: &str,
        token: Option<&str>,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        let mut request = self.http.request(method, format!("{}{path}", self.base));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        if let Some(body) = body {
            request = request.json(&body);
        }
        let reply = request.send().await.unwrap();
        let status = reply.status();
        let text = reply.text().await.unwrap();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    async fn get(&self, path: &str, token: Option<&str>) -> (StatusCode, Value) {
        self.call(Method::GET, path, token, None).await
    }

    async fn post(&self, path: &str, token: Option<&str>, body: Value) -> (StatusCode, Value) {
        self.call(Method::POST, path, token, Some(body)).await
    }
}

fn assert_error(reply: (StatusCode, Value), status: u16, code: &str, message: &str) {
    assert_eq!(reply.0.as_u16(), status, "{:?}", reply.1);
    assert_eq!(reply.1["code"], code, "{:?}", reply.1);
    assert_eq!(reply.1["error"], message, "{:?}", reply.1);
}

/// Every object in a response has its keys in sorted order at every depth.
fn assert_sorted_keys(text: &str) {
    fn check(value: &Value) {
        match value {
            Value::Object(map) => {
                let keys: Vec<&String> = map.keys().collect();
                let mut sorted = keys.clone();
                sorted.sort();
                assert_eq!(keys, sorted);
                map.values().for_each(check);
            }
            Value::Array(items) => items.iter().for_each(check),
            _ => {}
        }
    }
    // Parse preserving order by walking the raw text's key sequence per object is
    // overkill; serde_json without preserve_order sorts on parse, so compare re-encoding.
    let value: Value = serde_json::from_str(text).unwrap();
    check(&value);
    assert_eq!(
        serde_json::to_string(&value).unwrap(),
        text,
        "keys not in sorted order"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[expect(
    clippy::too_many_lines,
    reason = "a scenario test: every endpoint and error case against one node, in order"
)]
async fn every_endpoint_and_error_case() {
    let node = start().await;
    let admin = Some(ADMIN);

    // Server endpoints.
    assert_eq!(
        node.get("/healthz", None).await,
        (StatusCode::OK, json!({"ok": true}))
    );
    let (status, key) = node.get("/v1/public-key", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(key["algorithm"], "ed25519");
    let public_key = key["public_key"].as_str().unwrap().to_string();

    // Auth.
    assert_error(
        node.get("/v1/agents", None).await,
        401,
        "unauthorized",
        "missing or invalid bearer token",
    );
    assert_error(
        node.get("/v1/agents", Some("wrong")).await,
        401,
        "unauthorized",
        "missing or invalid bearer token",
    );
    let lowercase_bearer = node
        .http
        .get(format!("{}/v1/agents", node.base))
        .header("Authorization", format!("bearer {ADMIN}"))
        .send()
        .await
        .unwrap();
    assert_eq!(lowercase_bearer.status(), StatusCode::UNAUTHORIZED);

    // Create.
    let policy = json!({"budget": 20, "scar_limit": 6, "tools": {"search": {"cost": 1, "max_calls": 3}, "pay": {"cost": 5, "requires_approval": true}}, "unknown": "ignored"});
    assert_error(
        node.post(
            "/v1/agents",
            admin,
            json!({"agent_id": "bad id!", "policy": policy}),
        )
        .await,
        400,
        "bad_request",
        "agent_id must be 1-64 characters of [A-Za-z0-9_-]",
    );
    // A malformed id in a path names no agent: 404, as the reference answers.
    for path in [
        "/v1/agents/bad.id",
        "/v1/agents/bad.id/log",
        "/v1/agents/bad.id/head-proof",
    ] {
        assert_error(
            node.get(path, admin).await,
            404,
            "not_found",
            "agent not found",
        );
    }
    let (status, created) = node
        .post(
            "/v1/agents",
            admin,
            json!({"agent_id": "bot", "policy": policy}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{created}");
    let token = created["token"].as_str().unwrap().to_string();
    assert!(token.starts_with("agt_bot."));
    assert_eq!(created["agent"]["budget"], 20);
    assert_eq!(created["agent"]["public_key"], public_key.as_str());
    assert_error(
        node.post(
            "/v1/agents",
            admin,
            json!({"agent_id": "bot", "policy": policy}),
        )
        .await,
        409,
        "agent_exists",
        "agent already exists",
    );
    let (_, other) = node
        .post(
            "/v1/agents",
            admin,
            json!({"agent_id": "other", "policy": policy}),
        )
        .await;
    let other_token = other["token"].as_str().unwrap().to_string();
    assert_error(
        node.post(
            "/v1/agents",
            Some(&token),
            json!({"agent_id": "x", "policy": policy}),
        )
        .await,
        403,
        "forbidden",
        "this token may not access this resource",
    );

    // Tokens act only as their agent.
    assert_error(
        node.get("/v1/agents/bot", Some(&other_token)).await,
        403,
        "forbidden",
        "this token may not access this resource",
    );
    let ghost = lineage_core_token_for(&node, "ghost").await;
    assert_error(
        node.get("/v1/agents/ghost", Some(&ghost)).await,
        404,
        "not_found",
        "agent not found",
    );
    let (_, reissued) = node.get("/v1/agents/bot/token", admin).await;
    assert_eq!(reissued["token"], token.as_str());
    assert_error(
        node.get("/v1/agents/bot/token", Some(&token)).await,
        403,
        "forbidden",
        "this token may not access this resource",
    );

    // Actions.
    assert_error(
        node.post("/v1/agents/bot/actions", Some(&token), json!({"tool": ""}))
            .await,
        400,
        "bad_request",
        "tool must be 1-128 characters",
    );
    let (_, allowed) = node
        .post(
            "/v1/agents/bot/actions",
            Some(&token),
            json!({"tool": "search", "input": {"q": "x"}}),
        )
        .await;
    assert_eq!(
        allowed,
        json!({"action_id": "act-1", "cost": 1, "decision": "allowed", "remaining": 19})
    );
    let (_, declared) = node
        .post(
            "/v1/agents/bot/actions",
            Some(&token),
            json!({"tool": "search", "cost": 4}),
        )
        .await;
    assert_eq!(declared["cost"], 4);
    let (_, pending) = node
        .post(
            "/v1/agents/bot/actions",
            Some(&token),
            json!({"tool": "pay", "input": {"to": "ACME", "amount": 40}}),
        )
        .await;
    assert_eq!(
        pending,
        json!({"action_id": "act-3", "decision": "pending_approval"})
    );
    let (_, action) = node.get("/v1/agents/bot/actions/act-3", Some(&token)).await;
    assert_eq!(
        action,
        json!({"action_id": "act-3", "cost": 5, "input": {"amount": 40, "to": "ACME"}, "outcome": null, "status": "pending_approval", "tool": "pay"})
    );
    assert_error(
        node.get("/v1/agents/bot/actions/act-99", Some(&token))
            .await,
        404,
        "not_found",
        "action not found",
    );
    let (_, queue) = node.get("/v1/agents/bot/actions/pending", admin).await;
    assert_eq!(
        queue["pending"][0]["action"],
        json!({"action_id": "act-3", "cost": 5, "input": {"amount": 40, "to": "ACME"}, "tool": "pay"})
    );
    assert_eq!(queue["pending"][0]["seq"], 6);
    assert_error(
        node.get("/v1/agents/bot/actions/pending", Some(&token))
            .await,
        403,
        "forbidden",
        "this token may not access this resource",
    );

    // Approve, reject.
    assert_error(
        node.post(
            "/v1/agents/bot/actions/act-3/approve",
            Some(&token),
            json!({"approver": "me"}),
        )
        .await,
        403,
        "forbidden",
        "this token may not access this resource",
    );
    assert_error(
        node.post(
            "/v1/agents/bot/actions/act-9/approve",
            admin,
            json!({"approver": "alice"}),
        )
        .await,
        404,
        "unknown_action",
        "unknown action: act-9",
    );
    let (_, approved) = node
        .post(
            "/v1/agents/bot/actions/act-3/approve",
            admin,
            json!({"approver": "alice", "note": "PO-1"}),
        )
        .await;
    assert_eq!(
        approved,
        json!({"action_id": "act-3", "cost": 5, "decision": "allowed", "remaining": 10})
    );
    assert_error(
        node.post(
            "/v1/agents/bot/actions/act-3/approve",
            admin,
            json!({"approver": "alice"}),
        )
        .await,
        409,
        "invalid_state",
        "action act-3 is Allowed; operation not permitted",
    );
    // Decided, its input is no longer in memory: it is read back from the request record.
    let (_, action) = node.get("/v1/agents/bot/actions/act-3", Some(&token)).await;
    assert_eq!(
        action,
        json!({"action_id": "act-3", "cost": 5, "input": {"amount": 40, "to": "ACME"}, "outcome": null, "status": "allowed", "tool": "pay"})
    );
    node.post(
        "/v1/agents/bot/actions",
        Some(&token),
        json!({"tool": "pay"}),
    )
    .await;
    let (_, rejected) = node
        .post(
            "/v1/agents/bot/actions/act-4/reject",
            admin,
            json!({"approver": "bob", "reason": "no", "scar": "minor"}),
        )
        .await;
    assert_eq!(
        rejected,
        json!({"action_id": "act-4", "decision": "denied", "reason": {"by": "bob", "code": "rejected", "reason": "no"}})
    );

    // Outcomes.
    let (status, after_outcome) = node
        .post(
            "/v1/agents/bot/actions/act-1/outcome",
            Some(&token),
            json!({"status": "success", "detail": "3 results"}),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(after_outcome["agent_id"], "bot");
    assert_error(
        node.post(
            "/v1/agents/bot/actions/act-1/outcome",
            Some(&token),
            json!({"status": "success"}),
        )
        .await,
        409,
        "invalid_state",
        "action act-1 is Completed; operation not permitted",
    );
    let (_, action) = node.get("/v1/agents/bot/actions/act-1", Some(&token)).await;
    assert_eq!(
        (&action["status"], &action["outcome"], &action["action_id"]),
        (&json!("completed"), &json!("success"), &json!("act-1"))
    );
    assert!(
        action["tool"].is_string() && action.get("input").is_some(),
        "{action}"
    );
    assert_error(
        node.post(
            "/v1/agents/bot/actions/act-2/outcome",
            Some(&token),
            json!({"status": "harmful"}),
        )
        .await,
        403,
        "forbidden",
        "this token may not access this resource",
    );
    assert_error(
        node.post(
            "/v1/agents/bot/actions/act-77/outcome",
            Some(&token),
            json!({"status": "success"}),
        )
        .await,
        404,
        "unknown_action",
        "unknown action: act-77",
    );

    // Scars and termination.
    assert_error(
        node.post(
            "/v1/agents/bot/scars",
            admin,
            json!({"severity": "minor", "reason": "x", "action_id": "act-404"}),
        )
        .await,
        404,
        "not_found",
        "action not found",
    );
    let (_, scarred) = node
        .post(
            "/v1/agents/bot/scars",
            admin,
            json!({"severity": "moderate", "reason": "monitor"}),
        )
        .await;
    assert_eq!(scarred["scar_score"], 4);
    let (_, terminated) = node
        .post(
            "/v1/agents/bot/terminate",
            admin,
            json!({"reason": "incident", "by": "oncall"}),
        )
        .await;
    assert_eq!(terminated["alive"], false);
    assert_eq!(terminated["termination_reason"], "incident");
    assert_error(
        node.post(
            "/v1/agents/bot/terminate",
            admin,
            json!({"reason": "again", "by": "oncall"}),
        )
        .await,
        409,
        "already_terminated",
        "agent is already terminated: incident",
    );
    let (_, denied) = node
        .post(
            "/v1/agents/bot/actions",
            Some(&token),
            json!({"tool": "search"}),
        )
        .await;
    assert_eq!(
        denied["reason"],
        json!({"code": "terminated", "reason": "incident"})
    );

    // Status, list, log, verify.
    let status_text = node
        .http
        .get(format!("{}/v1/agents/bot", node.base))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_sorted_keys(&status_text);
    let status: Value = serde_json::from_str(&status_text).unwrap();
    for field in [
        "actions_allowed",
        "actions_denied",
        "actions_pending",
        "agent_id",
        "alive",
        "budget",
        "head",
        "public_key",
        "remaining",
        "scar_limit",
        "scar_score",
        "scars",
        "spent",
        "termination_reason",
    ] {
        assert!(status.get(field).is_some(), "status lacks {field}");
    }
    assert_eq!(status["spent"], 10);
    let (_, list) = node.get("/v1/agents", admin).await;
    assert_eq!(list["agents"][0]["agent_id"], "bot");
    assert_eq!(list["agents"][0]["state"], "active");
    assert_eq!(list["agents"][1]["agent_id"], "other");

    let (_, page) = node.get("/v1/agents/bot/log?after=2&limit=3", admin).await;
    let seqs: Vec<u64> = page["records"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(seqs, [3, 4, 5]);
    assert_eq!(page["head"]["seq"], status["head"]["seq"]);
    assert_error(
        node.get("/v1/agents/bot/log?after=-1", admin).await,
        400,
        "bad_request",
        "after must be a non-negative integer, got \"-1\"",
    );
    let (_, empty) = node.get("/v1/agents/bot/log?limit=0", admin).await;
    assert_eq!(empty["records"], json!([]));
    let log_text = node
        .http
        .get(format!("{}/v1/agents/bot/log", node.base))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_sorted_keys(&log_text);
    let (_, verified) = node.get("/v1/agents/bot/verify", admin).await;
    assert_eq!(verified["ok"], true);
    assert_eq!(verified["public_key"], public_key.as_str());
    assert_eq!(
        verified["records"],
        status["head"]["seq"].as_u64().unwrap() + 1
    );

    // Transparency proofs over the agent's record hashes, readable without a token.
    let size = status["head"]["seq"].as_u64().unwrap() + 1;
    let (_, full_log) = node
        .get(&format!("/v1/agents/bot/log?limit={size}"), admin)
        .await;
    let hashes: Vec<[u8; 32]> = full_log["records"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            hex::decode(r["hash"].as_str().unwrap())
                .unwrap()
                .try_into()
                .unwrap()
        })
        .collect();
    let root = lineage_core::transparency::root(&hashes);
    let b64 = |v: &Value| -> [u8; 32] {
        base64::engine::general_purpose::STANDARD
            .decode(v.as_str().unwrap())
            .unwrap()
            .try_into()
            .unwrap()
    };
    // A proof's hashes, decoded.
    let path_of = |answer: &Value| -> Vec<[u8; 32]> {
        answer["proof"]
            .as_array()
            .unwrap()
            .iter()
            .map(b64)
            .collect()
    };
    let (status_code, inclusion) = node
        .get(
            &format!("/v1/agents/bot/proof/inclusion?index=2&size={size}"),
            None,
        )
        .await;
    assert_eq!(status_code, StatusCode::OK, "{inclusion}");
    assert_eq!(b64(&inclusion["root"]), root);
    let path = path_of(&inclusion);
    lineage_core::transparency::verify_inclusion(&root, size, 2, &hashes[2], &path).unwrap();
    let (_, consistency) = node
        .get(
            &format!("/v1/agents/bot/proof/consistency?old=3&size={size}"),
            None,
        )
        .await;
    let path = path_of(&consistency);
    lineage_core::transparency::verify_consistency(
        &b64(&consistency["old_root"]),
        3,
        &root,
        size,
        &path,
    )
    .unwrap();
    // The edges: a tree of one record (its root is that leaf's hash, its proofs empty),
    // and size 0, which no proof is over.
    let one = lineage_core::transparency::root(&hashes[..1]);
    let (status_code, inclusion) = node
        .get("/v1/agents/bot/proof/inclusion?index=0&size=1", None)
        .await;
    assert_eq!(status_code, StatusCode::OK, "{inclusion}");
    assert_eq!(b64(&inclusion["root"]), one);
    assert_eq!(inclusion["proof"], serde_json::json!([]), "{inclusion}");
    lineage_core::transparency::verify_inclusion(&one, 1, 0, &hashes[0], &[]).unwrap();
    let (status_code, consistency) = node
        .get("/v1/agents/bot/proof/consistency?old=1&size=1", None)
        .await;
    assert_eq!(status_code, StatusCode::OK, "{consistency}");
    assert_eq!(b64(&consistency["old_root"]), one, "{consistency}");
    assert_eq!(consistency["proof"], serde_json::json!([]), "{consistency}");
    let (status_code, consistency) = node
        .get(
            &format!("/v1/agents/bot/proof/consistency?old=1&size={size}"),
            None,
        )
        .await;
    assert_eq!(status_code, StatusCode::OK, "{consistency}");
    let path = path_of(&consistency);
    lineage_core::transparency::verify_consistency(&one, 1, &root, size, &path).unwrap();
    assert_error(
        node.get("/v1/agents/bot/proof/inclusion?index=0&size=0", None)
            .await,
        400,
        "bad_request",
        &format!("size must be between 1 and {size}"),
    );
    assert_error(
        node.get("/v1/agents/bot/proof/consistency?old=0&size=1", None)
            .await,
        400,
        "bad_request",
        "old must be between 1 and 1",
    );
    assert_error(
        node.get("/v1/agents/bot/proof/inclusion?size=3", None)
            .await,
        400,
        "bad_request",
        "index is required",
    );
    assert_error(
        node.get(
            &format!("/v1/agents/bot/proof/inclusion?index=0&size={}", size + 1),
            None,
        )
        .await,
        400,
        "bad_request",
        &format!("size must be between 1 and {size}"),
    );
    assert_error(
        node.get("/v1/agents/bot/proof/consistency?old=5&size=4", None)
            .await,
        400,
        "bad_request",
        "old must be between 1 and 4",
    );

    // Precise JSON errors for malformed input (an addition to the reference).
    let raw = |body: &'static str, content_type: &'static str| {
        node.http
            .post(format!("{}/v1/agents/bot/actions", node.base))
            .bearer_auth(&token)
            .header("content-type", content_type)
            .body(body)
    };
    let reply = raw("{not json", "application/json").send().await.unwrap();
    assert_eq!(reply.status(), StatusCode::BAD_REQUEST);
    assert_eq!(
        reply.json::<Value>().await.unwrap()["code"],
        "malformed_json"
    );
    let reply = raw(r#"{"tool": 5}"#, "application/json")
        .send()
        .await
        .unwrap();
    assert_eq!(reply.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(reply.json::<Value>().await.unwrap()["code"], "invalid_body");
    let reply = raw(r#"{"tool": "search", "cost": -1}"#, "application/json")
        .send()
        .await
        .unwrap();
    assert_eq!(reply.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let reply = raw(r#"{"tool": "search"}"#, "text/plain")
        .send()
        .await
        .unwrap();
    assert_eq!(reply.status(), StatusCode::UNSUPPORTED_MEDIA_TYPE);
    assert_eq!(
        reply.json::<Value>().await.unwrap()["code"],
        "unsupported_media_type"
    );
    let huge = format!(
        r#"{{"tool": "search", "input": "{}"}}"#,
        "x".repeat(3 * 1024 * 1024)
    );
    // The node answers 413 before reading the whole body and then closes the
    // connection; without `connection: close` the client could pool it and send the
    // next request into the closing socket (IncompleteMessage, seen 1 run in 10).
    let reply = node
        .http
        .post(format!("{}/v1/agents/bot/actions", node.base))
        .bearer_auth(&token)
        .header("content-type", "application/json")
        .header("connection", "close")
        .body(huge)
        .send()
        .await
        .unwrap();
    assert_eq!(reply.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(
        reply.json::<Value>().await.unwrap()["code"],
        "body_too_large"
    );
    let deep = format!(
        r#"{{"tool": "search", "input": {}{}}}"#,
        "[".repeat(120),
        "]".repeat(120)
    );
    let reply = node
        .http
        .post(format!("{}/v1/agents/other/actions", node.base))
        .bearer_auth(&other_token)
        .header("content-type", "application/json")
        .body(deep)
        .send()
        .await
        .unwrap();
    assert_eq!(reply.status(), StatusCode::BAD_REQUEST);
    assert_eq!(
        reply.json::<Value>().await.unwrap()["error"],
        "input is nested deeper than 100 levels"
    );
    let (_, other_status) = node.get("/v1/agents/other", Some(&other_token)).await;
    assert_eq!(
        other_status["head"]["seq"], 1,
        "refused input appended nothing"
    );
    let (status, body) = node.get("/v1/nope", admin).await;
    assert_eq!(
        (status.as_u16(), body["code"].as_str()),
        (404, Some("unknown_route"))
    );
    let (status, body) = node.call(Method::DELETE, "/v1/agents", admin, None).await;
    assert_eq!(
        (status.as_u16(), body["code"].as_str()),
        (405, Some("method_not_allowed"))
    );

    // Node-to-node Raft traffic needs the cluster secret.
    let reply = node
        .http
        .post(format!("{}/raft/vote", node.base))
        .json(&json!({"vote": {"leader_id": {"term": 99, "node_id": 7}, "committed": false}, "last_log_id": null}))
        .send()
        .await
        .unwrap();
    assert_eq!(reply.status(), StatusCode::UNAUTHORIZED);
    let reply = node
        .http
        .post(format!("{}/raft/append", node.base))
        .header("x-lineage-cluster-secret", "guess")
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(reply.status(), StatusCode::UNAUTHORIZED);

    // The node is still up after all of that.
    assert_eq!(node.get("/healthz", None).await.0, StatusCode::OK);
}

/// A valid token for an agent that does not exist, as the admin would re-derive it.
async fn lineage_core_token_for(node: &Node, agent_id: &str) -> String {
    // The node issues tokens only for agents it knows, so derive it from the key file.
    let key_path = node._dir.path().join("guard-data/keys/token.key");
    let key = lineage_core::keys::read_secret_file(&key_path).unwrap();
    lineage_core::token::issue(&key, agent_id)
}

#[test]
fn a_short_admin_token_is_refused_at_start() {
    let (dir, _base, child) = start_reference_mode(Some("short"));
    let output = child.wait_with_output().unwrap();
    // Refused for its length, not for something else (a port clash would also exit 1).
    let stderr = std::fs::read_to_string(dir.path().join("node.stderr")).unwrap_or_default();
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("the admin token must be at least"),
        "exited for another reason: {stderr}"
    );
}

/// The drop-in mode reads every one of `run`'s LINEAGE_* settings, checked as `run`
/// checks its flags: before, it read a few by hand and ignored the rest, so
/// `LINEAGE_PIPELINING=false` (say) left pipelining on without a word.
#[test]
fn the_drop_in_mode_reads_runs_settings_and_refuses_a_bad_one() {
    for (name, value) in [
        ("LINEAGE_PIPELINING", "sometimes"),
        ("LINEAGE_REQUIRE_RAFT_DIGESTS", "maybe"),
        ("LINEAGE_HEADS_INTERVAL_MS", "soon"),
        ("LINEAGE_IDEMPOTENCY_WINDOW_SECS", "0"),
    ] {
        let (dir, _base, mut child) = start_reference_mode_with(Some(ADMIN), &[(name, value)]);
        // A setting it ignored would leave it serving: bounded, then a failure.
        let status = util::exit_within(&mut child, Duration::from_secs(20)).unwrap_or_else(|| {
            panic!("{name}={value} was ignored: the node still runs after 20 s")
        });
        let stderr = std::fs::read_to_string(dir.path().join("node.stderr")).unwrap_or_default();
        assert_eq!(status.code(), Some(1), "{name}={value}: {stderr}");
        assert!(
            stderr.contains(&format!(
                "drop-in mode's settings: {name}: invalid value '{value}'"
            )),
            "{name}={value} refused for another reason, or not named: {stderr}"
        );
        // Refused before anything was written.
        assert!(
            !dir.path().join("guard-data").join("keys").exists(),
            "{name}={value}: keys written before the setting was checked"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_admin_token_it_creates_one_in_the_reference_layout() {
    let (dir, base, mut child) = start_reference_mode(None);
    let keys = dir.path().join("guard-data/keys");
    let start = Instant::now();
    while !keys.join("token.key").exists() {
        assert!(start.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for name in ["admin.token", "audit.key", "token.key"] {
        let text = std::fs::read_to_string(keys.join(name)).unwrap();
        assert_eq!(text.len(), 64, "{name}");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(keys.join(name))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600, "{name}");
        }
    }
    let admin = std::fs::read_to_string(keys.join("admin.token")).unwrap();
    let http = Client::new();
    let start = Instant::now();
    loop {
        let reply = http
            .get(format!("{base}/v1/agents"))
            .bearer_auth(&admin)
            .send()
            .await;
        if let Ok(r) = reply {
            if r.status() == StatusCode::OK {
                break;
            }
        }
        assert!(start.elapsed() < Duration::from_secs(15));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = child.kill();
    let _ = child.wait();
}

impl Node {
    /// A POST with an Idempotency-Key, answered as (status, JSON).
    async fn post_keyed(
        &self,
        path: &str,
        token: &str,
        key: &str,
        body: &str,
    ) -> (StatusCode, Value) {
        let reply = self
            .http
            .post(format!("{}{path}", self.base))
            .bearer_auth(token)
            .header("content-type", "application/json")
            .header("Idempotency-Key", key)
            .body(body.to_string())
            .send()
            .await
            .unwrap();
        let status = reply.status();
        let text = reply.text().await.unwrap();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }
}

/// An Idempotency-Key returns its stored answer only to the same request from the same
/// kind of caller: another body or route gets 422, and an operator's key never returns an
/// agent's decision (a terminate sent with a key the agent used still terminates).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotency_keys_are_bound_to_their_request_and_caller() {
    let node = start().await;
    let admin = Some(ADMIN);
    let policy = json!({"budget": 100, "scar_limit": 10, "tools": {"search": {"cost": 1}, "fetch": {"cost": 2}}});
    let (status, created) = node
        .post(
            "/v1/agents",
            admin,
            json!({"agent_id": "bot", "policy": policy}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{created}");
    let token = created["token"].as_str().unwrap().to_string();
    let actions = "/v1/agents/bot/actions";

    let first = node
        .post_keyed(
            actions,
            &token,
            "k1",
            r#"{"tool":"search","input":{"q":"a"}}"#,
        )
        .await;
    assert_eq!(first.0, StatusCode::OK, "{:?}", first.1);
    assert_eq!(first.1["decision"], "allowed");
    // The same request, spelled differently: the stored answer, nothing appended.
    let retry = node
        .post_keyed(
            actions,
            &token,
            "k1",
            r#"{ "input": {"q":"a"}, "tool": "search" }"#,
        )
        .await;
    assert_eq!(retry, first);
    let spent = |status: &Value| status["spent"].as_u64().unwrap();
    let (_, status) = node.get("/v1/agents/bot", admin).await;
    assert_eq!(spent(&status), 1);
    let head = status["head"]["seq"].as_u64().unwrap();

    // Another body, another tool, another route: refused, nothing appended.
    let reused = "this Idempotency-Key was already used for a different request; use a new key";
    for (path, body) in [
        (actions, r#"{"tool":"search","input":{"q":"b"}}"#),
        (actions, r#"{"tool":"fetch","input":{"q":"a"}}"#),
        (
            "/v1/agents/bot/actions/act-1/outcome",
            r#"{"status":"success"}"#,
        ),
    ] {
        assert_error(
            node.post_keyed(path, &token, "k1", body).await,
            422,
            "idempotency_key_reused",
            reused,
        );
    }
    let (_, status) = node.get("/v1/agents/bot", admin).await;
    assert_eq!(status["head"]["seq"].as_u64().unwrap(), head);

    // An operator's terminate with the agent's key terminates; its retry is its answer.
    let terminate = r#"{"reason":"stop","by":"ops"}"#;
    let (status, terminated) = node
        .post_keyed("/v1/agents/bot/terminate", ADMIN, "k1", terminate)
        .await;
    assert_eq!(status, StatusCode::OK, "{terminated}");
    assert_eq!(terminated["alive"], false, "{terminated}");
    let again = node
        .post_keyed("/v1/agents/bot/terminate", ADMIN, "k1", terminate)
        .await;
    assert_eq!(again, (StatusCode::OK, terminated.clone()));
    // The operator's key, reused for a fatal scar, is refused rather than answered.
    assert_error(
        node.post_keyed(
            "/v1/agents/bot/scars",
            ADMIN,
            "k1",
            r#"{"severity":"fatal","reason":"x"}"#,
        )
        .await,
        422,
        "idempotency_key_reused",
        reused,
    );
    // The agent's own retry still gets its own first answer.
    assert_eq!(
        node.post_keyed(
            actions,
            &token,
            "k1",
            r#"{"tool":"search","input":{"q":"a"}}"#
        )
        .await,
        first
    );
}

/// `?local=true` reads a node's own copy; on a write it is refused, not run locally.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_true_is_refused_on_a_write() {
    let node = start().await;
    let policy = json!({"budget": 5, "scar_limit": 5, "tools": {"search": {"cost": 1}}});
    assert_error(
        node.post(
            "/v1/agents?local=true",
            Some(ADMIN),
            json!({"agent_id": "bot", "policy": policy}),
        )
        .await,
        400,
        "bad_request",
        "local=true is for GET reads of this node's copy; writes always go to the leader",
    );
    assert_error(
        node.get("/v1/agents/bot?local=true", Some(ADMIN)).await,
        404,
        "not_found",
        "agent not found",
    );
}

/// Query strings, through the one parser every route uses: today's answers pinned
/// (status, code, message), and its intended differences from the hand-written parsers
/// it replaced: values are percent-decoded, and a name given twice is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn query_strings_are_parsed_one_way() {
    let node = start().await;
    let admin = Some(ADMIN);
    let policy = json!({"budget": 50, "scar_limit": 50, "tools": {"search": {"cost": 1}}});
    let (status, created) = node
        .post(
            "/v1/agents",
            admin,
            json!({"agent_id": "bot", "policy": policy}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{created}");
    let token = created["token"].as_str().unwrap().to_string();
    for i in 0..4 {
        let (status, _) = node
            .post(
                "/v1/agents/bot/actions",
                Some(&token),
                json!({"tool": "search", "input": {"i": i}}),
            )
            .await;
        assert_eq!(status, StatusCode::OK);
    }
    let seqs = |page: &Value| -> Vec<u64> {
        page["records"]
            .as_array()
            .map(|r| r.iter().filter_map(|x| x["seq"].as_u64()).collect())
            .unwrap_or_default()
    };
    // Pinned: after/limit, a bad number, a missing required one.
    let (status, page) = node.get("/v1/agents/bot/log?after=2&limit=3", admin).await;
    assert_eq!((status, seqs(&page)), (StatusCode::OK, vec![3, 4, 5]));
    assert_error(
        node.get("/v1/agents/bot/log?after=x", admin).await,
        400,
        "bad_request",
        "after must be a non-negative integer, got \"x\"",
    );
    assert_error(
        node.get("/v1/transparency/leaves?start=0", admin).await,
        400,
        "bad_request",
        "end is required",
    );
    // before= pages from the newest back, each page in ascending order.
    let (status, page) = node.get("/v1/agents/bot/log?before=6&limit=2", admin).await;
    assert_eq!((status, seqs(&page)), (StatusCode::OK, vec![4, 5]));
    // Intended differences: percent-decoding, and one value per name.
    let (status, page) = node
        .get("/v1/agents/bot/log?after=%32&limit=%31", admin)
        .await;
    assert_eq!((status, seqs(&page)), (StatusCode::OK, vec![3]));
    assert_error(
        node.get("/v1/agents/bot/log?limit=1&limit=2", admin).await,
        400,
        "bad_request",
        "query parameter limit is given more than once",
    );
    // ?local=true is read the same way (here, percent-encoded).
    let (status, _) = node.get("/v1/agents/bot?local=%74rue", admin).await;
    assert_eq!(status, StatusCode::OK);
}

/// Errors the framework would answer in plain text are JSON with a code, like every
/// other error: a path parameter that does not decode to UTF-8, and an oversized body
/// on the one route that takes text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_paths_and_oversized_text_bodies_get_json_errors() {
    let node = start().await;
    let admin = Some(ADMIN);
    for (method, path) in [
        (Method::GET, "/v1/agents/%FF"),
        (Method::GET, "/v1/agents/%C0%80/log"),
        (Method::GET, "/v1/agents/%FF/actions/pending"),
        (Method::GET, "/v1/agents/bot/actions/%FF"),
        (Method::GET, "/v1/agents/%FF/proof/inclusion?index=0&size=1"),
        (Method::POST, "/v1/operators/%FF/revoke"),
        (Method::POST, "/v1/agents/%FF/terminate"),
    ] {
        let (status, reply) = node
            .call(method.clone(), path, admin, Some(json!({})))
            .await;
        assert_eq!(status.as_u16(), 400, "{method} {path}: {reply}");
        assert_eq!(reply["code"], "bad_request", "{method} {path}: {reply}");
        assert!(
            reply["error"].as_str().is_some_and(|e| e.contains("UTF-8")),
            "{method} {path}: {reply}"
        );
    }
    let reply = node
        .http
        .post(format!(
            "{}/v1/transparency/checkpoint/witnessed",
            node.base
        ))
        .bearer_auth(ADMIN)
        .header("content-type", "text/plain")
        // Refused before all of it is read: the answer, not a reset, is what is tested.
        .header("connection", "close")
        .body("a".repeat(3 * 1024 * 1024))
        .send()
        .await
        .unwrap();
    assert_eq!(reply.status().as_u16(), 413);
    let reply: Value = reply.json().await.expect("a JSON error");
    assert_eq!(reply["code"], "body_too_large", "{reply}");
}
