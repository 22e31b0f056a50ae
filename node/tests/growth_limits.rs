//! One agent token cannot grow the logs without bound: a policy's `limits` cap the input
//! size (413, nothing recorded) and the requests per minute (429 with Retry-After,
//! nothing recorded), and a terminated agent, whose every request is denied and logged,
//! is held to them too. Nor can it grow every replica's memory with actions left
//! waiting for an approval (each keeps its input): `max_pending_approvals` caps them
//! (409, nothing recorded). Nor do the answers stored for its retries pile up: each is
//! removed from every replica after its window.

#[path = "cluster/util.rs"]
mod util;

use std::time::{Duration, Instant};

use serde_json::json;
use util::Cluster;

const PER_MINUTE: u64 = 30;
const MAX_INPUT: usize = 1_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminated_agent_cannot_flood_the_log() {
    let cluster = Cluster::start(1).await;
    cluster.wait_for_leader(Duration::from_secs(20)).await;
    let policy = json!({
        "budget": 100, "scar_limit": 1000, "tools": {"search": {"cost": 1}},
        "limits": {"max_input_bytes": MAX_INPUT, "max_requests_per_minute": PER_MINUTE},
    });
    let token = cluster.create_agent(0, "spammer", policy).await;
    let other = cluster
        .create_agent(
            0,
            "neighbour",
            json!({"budget": 100, "scar_limit": 10, "tools": {"search": {"cost": 1}}}),
        )
        .await;
    let admin = cluster.admin.clone();
    let (status, _) = cluster
        .post(
            0,
            "/v1/agents/spammer/terminate",
            &admin,
            json!({"reason": "misbehaving", "by": "ops"}),
            None,
        )
        .await;
    assert_eq!(status, 200);
    let head_before = log_len(&cluster).await;

    // An input over the policy's size: refused, nothing recorded.
    let (status, answer) = cluster
        .post(
            0,
            "/v1/agents/spammer/actions",
            &token,
            json!({"tool": "search", "input": {"blob": "x".repeat(MAX_INPUT)}}),
            None,
        )
        .await;
    assert_eq!(status, 413, "{answer}");
    assert_eq!(answer["code"], "input_too_large", "{answer}");
    assert_eq!(
        log_len(&cluster).await,
        head_before,
        "a refused input left a record"
    );

    // As fast as it can: a minute's worth gets through (each denied `terminated` and
    // logged), then 429s that leave nothing.
    let start = Instant::now();
    let (mut answered, mut refused) = (0u64, 0u64);
    for n in 0..(3 * PER_MINUTE) {
        let reply = cluster
            .http
            .post(cluster.url(0, "/v1/agents/spammer/actions"))
            .bearer_auth(&token)
            .json(&json!({"tool": "search", "input": {"n": n}}))
            .send()
            .await
            .expect("send");
        match reply.status().as_u16() {
            200 => answered += 1,
            429 => {
                let retry_after: u64 = reply
                    .headers()
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse().ok())
                    .expect("a 429 says when to retry");
                assert!(retry_after >= 1);
                let body: serde_json::Value = reply.json().await.expect("json");
                assert_eq!(body["code"], "too_many_requests", "{body}");
                refused += 1;
            }
            other => panic!("request {n}: {other}"),
        }
    }
    // What the bucket could have refilled while we sent, rounded up.
    let refill = (start.elapsed().as_secs_f64() * PER_MINUTE as f64 / 60.0).ceil() as u64;
    println!("{answered} answered, {refused} refused (refill allowance {refill})");
    // The oversized request above counted as one of the minute's requests.
    assert!(
        answered >= PER_MINUTE - 1,
        "only {answered} of a minute's worth answered"
    );
    assert!(
        answered < PER_MINUTE + refill,
        "{answered} answered: more than the limit allows"
    );
    assert_eq!(answered + refused, 3 * PER_MINUTE);
    // Two records per answered request (requested, denied), none for a refused one.
    assert_eq!(log_len(&cluster).await, head_before + 2 * answered);

    // Another agent, on the defaults, is not held back by its neighbour.
    let (status, answer) = cluster
        .post(
            0,
            "/v1/agents/neighbour/actions",
            &other,
            json!({"tool": "search"}),
            None,
        )
        .await;
    assert_eq!(
        (status, &answer["decision"]),
        (200, &json!("allowed")),
        "{answer}"
    );
    outcome_details_are_held_to_the_input_limit(&cluster, &other, &answer).await;
}

/// An outcome's detail (logged twice when it scars) is held to the policy's input limit:
/// a longer one is logged cut, and marked, never refused (a client reporting a long
/// exception text keeps its outcome and scar).
async fn outcome_details_are_held_to_the_input_limit(
    cluster: &Cluster,
    token: &str,
    allowed: &serde_json::Value,
) {
    const DEFAULT_MAX_INPUT: usize = 65_536;
    let action_id = allowed["action_id"].as_str().expect("an action id");
    let path = format!("/v1/agents/neighbour/actions/{action_id}/outcome");
    let (status, answer) = cluster
        .post(
            0,
            &path,
            token,
            json!({"status": "failure", "detail": "x".repeat(2 * DEFAULT_MAX_INPUT)}),
            None,
        )
        .await;
    assert_eq!(status, 200, "{answer}");
    let admin = cluster.admin.clone();
    let (status, log) = cluster
        .get(0, "/v1/agents/neighbour/log?limit=1000", &admin)
        .await;
    assert_eq!(status, 200, "{log}");
    let records = log["records"].as_array().expect("records");
    let outcome = records
        .iter()
        .find(|r| r["kind"] == "outcome")
        .unwrap_or_else(|| panic!("no outcome: {log}"));
    let detail = outcome["payload"]["detail"].as_str().expect("detail");
    assert!(
        detail.len() <= DEFAULT_MAX_INPUT,
        "{} bytes logged",
        detail.len()
    );
    assert!(
        detail.ends_with(" bytes cut]"),
        "{}",
        &detail[detail.len() - 40..]
    );
    let scar = records
        .iter()
        .find(|r| r["kind"] == "scar")
        .unwrap_or_else(|| panic!("no scar: {log}"));
    assert_eq!(
        scar["payload"]["reason"],
        format!("action failed: {detail}")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn actions_waiting_for_an_approval_are_capped() {
    const CAP: u64 = 3;
    let cluster = Cluster::start(1).await;
    cluster.wait_for_leader(Duration::from_secs(20)).await;
    let policy = json!({
        "budget": 100, "scar_limit": 10,
        "tools": {"refund": {"cost": 1, "requires_approval": true}, "search": {"cost": 1}},
        "limits": {"max_pending_approvals": CAP},
    });
    let token = cluster.create_agent(0, "spammer", policy).await;
    let request = |tool: &'static str, n: u64| {
        let token = token.clone();
        let cluster = &cluster;
        async move {
            cluster
                .post(
                    0,
                    "/v1/agents/spammer/actions",
                    &token,
                    json!({"tool": tool, "input": {"blob": "x".repeat(500), "n": n}}),
                    None,
                )
                .await
        }
    };
    for n in 0..CAP {
        let (status, answer) = request("refund", n).await;
        assert_eq!(
            (status, &answer["decision"]),
            (200, &json!("pending_approval")),
            "{answer}"
        );
    }
    let head_before = log_len(&cluster).await;
    let (status, answer) = request("refund", CAP).await;
    assert_eq!(status, 409, "{answer}");
    assert_eq!(answer["code"], "too_many_pending_approvals", "{answer}");
    assert_eq!(
        log_len(&cluster).await,
        head_before,
        "a refused request left a record"
    );
    // Tools that need no approval go on.
    let (status, answer) = request("search", 0).await;
    assert_eq!(
        (status, &answer["decision"]),
        (200, &json!("allowed")),
        "{answer}"
    );
    // An operator's approval makes room for one more.
    let admin = cluster.admin.clone();
    let (status, answer) = cluster
        .post(
            0,
            "/v1/agents/spammer/actions/act-1/approve",
            &admin,
            json!({"approver": "ops"}),
            None,
        )
        .await;
    assert_eq!(status, 200, "{answer}");
    let (status, answer) = request("refund", CAP + 1).await;
    assert_eq!(
        (status, &answer["decision"]),
        (200, &json!("pending_approval")),
        "{answer}"
    );
    let (status, answer) = request("refund", CAP + 2).await;
    assert_eq!(status, 409, "{answer}");
}

/// Records in the spammer's log.
/// A request costs one of the minute's requests however often it is decided: one refused
/// on a state its writes ahead had not reached yet (pipelined) is decided again once they
/// are applied, and spends no second token. Sent at once, a minute's worth on one agent
/// whose approvals run out partway: each is answered (waiting for an approval, or 409
/// with nothing recorded), none refused 429.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_decided_again_spends_one_request_of_the_minute() {
    const SENT: u64 = 24;
    const CAP: u64 = 2;
    let cluster = Cluster::start(1).await;
    cluster.wait_for_leader(Duration::from_secs(20)).await;
    let policy = json!({
        "budget": 100, "scar_limit": 1000,
        "tools": {"refund": {"cost": 1, "requires_approval": true}},
        "limits": {"max_requests_per_minute": SENT, "max_pending_approvals": CAP},
    });
    let token = cluster.create_agent(0, "eager", policy).await;
    let mut requests = Vec::new();
    for n in 0..SENT {
        let http = cluster.http.clone();
        let url = cluster.url(0, "/v1/agents/eager/actions");
        let token = token.clone();
        requests.push(tokio::spawn(async move {
            let reply = http
                .post(url)
                .bearer_auth(token)
                .json(&json!({"tool": "refund", "input": {"n": n}}))
                .send()
                .await
                .expect("send");
            let status = reply.status().as_u16();
            let body: serde_json::Value = reply.json().await.expect("json");
            (status, body)
        }));
    }
    let (mut waiting, mut refused) = (0, 0);
    for request in requests {
        let (status, body) = request.await.expect("task");
        match (status, body["decision"].as_str(), body["code"].as_str()) {
            (200, Some("pending_approval"), _) => waiting += 1,
            (409, _, Some("too_many_pending_approvals")) => refused += 1,
            _ => panic!("{status}: {body}"),
        }
    }
    assert_eq!((waiting, refused), (CAP, SENT - CAP));
}

/// Stored Idempotency-Key answers do not pile up for good (both clients send a key with
/// every write): each is kept for the window (`--idempotency-window-secs`), answering
/// every retry alike, then every replica removes it, and the key sent again makes a new
/// request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_answers_leave_every_replica_after_their_window() {
    // Long enough that a loaded CI machine cannot stall past it between the first two
    // requests (the retry check below always runs).
    const WINDOW_SECS: u64 = 15;
    const EXPIRED: &str = "lineage_idempotency_answers_expired_total";
    let window = WINDOW_SECS.to_string();
    let cluster = Cluster::start_with(3, &["--idempotency-window-secs", &window]).await;
    cluster.wait_for_leader(Duration::from_secs(20)).await;
    let policy = json!({"budget": 100, "scar_limit": 10, "tools": {"search": {"cost": 1}}});
    let token = cluster.create_agent(0, "retrier", policy).await;
    let path = "/v1/agents/retrier/actions";
    let body = json!({"tool": "search", "input": {"q": "once"}});
    let sent = Instant::now();
    let (status, first) = cluster
        .post_until_served(0, path, &token, body.clone(), "call-1")
        .await;
    assert_eq!(status, 200, "{first}");
    let (status, again) = cluster
        .post_until_served(1, path, &token, body.clone(), "call-1")
        .await;
    assert_eq!(status, 200, "{again}");
    // Within the window a retry gets the first answer. Checked always: the two requests
    // take milliseconds; a machine that stalled for most of the window fails here, and
    // the time taken says so.
    let elapsed = sent.elapsed();
    assert_eq!(
        again,
        first,
        "a retry {elapsed:?} after the first request (window {WINDOW_SECS} s, answers removed \
         from {} s on) was decided again",
        WINDOW_SECS - 1
    );
    assert_eq!(spent(&cluster, &token).await, 1);

    // Each replica removes the agent's creation answer and this one.
    let removed = |metrics: &std::collections::BTreeMap<String, f64>, outcome: &str| {
        metrics
            .iter()
            .filter(|(name, _)| {
                name.starts_with(EXPIRED) && name.contains(&format!("outcome=\"{outcome}\""))
            })
            .map(|(_, value)| *value)
            .sum::<f64>()
    };
    let start = Instant::now();
    for node in 0..3 {
        loop {
            let metrics = cluster.metrics(node).await;
            assert_eq!(removed(&metrics, "reindexed"), 0.0, "node {node}");
            if removed(&metrics, "removed") >= 2.0 {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "node {node} kept its answers past the window: {:?}",
                metrics
                    .iter()
                    .filter(|(n, _)| n.starts_with(EXPIRED))
                    .collect::<Vec<_>>()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    let (status, later) = cluster
        .post_until_served(2, path, &token, body, "call-1")
        .await;
    assert_eq!(status, 200, "{later}");
    assert_eq!(later["decision"], "allowed", "{later}");
    assert_ne!(
        later["action_id"], first["action_id"],
        "an answer was served after every replica removed it"
    );
    assert_eq!(spent(&cluster, &token).await, 2);
}

async fn spent(cluster: &Cluster, token: &str) -> u64 {
    let (status, body) = cluster.get(0, "/v1/agents/retrier", token).await;
    assert_eq!(status, 200, "{body}");
    body["spent"].as_u64().expect("spent")
}

async fn log_len(cluster: &Cluster) -> u64 {
    let admin = cluster.admin.clone();
    let (status, body) = cluster.get(0, "/v1/agents/spammer", &admin).await;
    assert_eq!(status, 200, "{body}");
    body["head"]["seq"].as_u64().expect("head seq") + 1
}
