//! Three real `lineage-node` processes on loopback: forwarding, replica agreement,
//! leader loss, whole-cluster restart, idempotent retries across failover.

mod util;

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use util::{verify_log as verify, Cluster};

fn policy(budget: u64) -> Value {
    json!({"budget": budget, "scar_limit": 10, "tools": {"search": {"cost": 1}, "pay": {"cost": 5, "requires_approval": true}}})
}

/// Sends one action through node `i` until it is answered 200 (bounded), returning the
/// answer and how long it took.
async fn act_until_served(
    cluster: &Cluster,
    i: usize,
    agent: &str,
    token: &str,
    key: &str,
) -> (Value, Duration) {
    let action = json!({"tool": "search"});
    request_until_served(cluster, i, agent, token, key, &action).await
}

/// [`act_until_served`] with the action's request body given.
async fn request_until_served(
    cluster: &Cluster,
    i: usize,
    agent: &str,
    token: &str,
    key: &str,
    action: &Value,
) -> (Value, Duration) {
    let start = Instant::now();
    loop {
        let (status, body) = cluster
            .post(
                i,
                &format!("/v1/agents/{agent}/actions"),
                token,
                action.clone(),
                Some(key),
            )
            .await;
        if status == 200 {
            return (body, start.elapsed());
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "not served within 10 s: {status} {body}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn followers_forward_and_every_replica_agrees_and_verifies() {
    let cluster = Cluster::start(3).await;
    let public_key = cluster.public_key().await;
    let token = cluster.create_agent(1, "bot", policy(100)).await;
    for i in 0..3 {
        let (status, body) = cluster
            .post_until_served(
                i,
                "/v1/agents/bot/actions",
                &token,
                json!({"tool": "search", "input": {"via": i}}),
                &format!("via-{i}"),
            )
            .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["decision"], "allowed");
        assert_eq!(body["action_id"], format!("act-{}", i + 1));
    }
    let (_, denied) = cluster
        .post_until_served(
            2,
            "/v1/agents/bot/actions",
            &token,
            json!({"tool": "rm"}),
            "rm-1",
        )
        .await;
    assert_eq!(denied["reason"]["code"], "tool_not_allowed");
    let (_, status) = cluster.get(0, "/v1/agents/bot", &token).await;
    assert_eq!(status["spent"], 3);
    assert_eq!(status["scar_score"], 3);

    let log = cluster.converged_log("bot", Duration::from_secs(5)).await;
    assert_eq!(log.len(), 2 + 3 * 2 + 3);
    verify(&log, &public_key);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_kill_elects_a_new_leader_and_the_old_one_catches_up() {
    let cluster = Cluster::start(3).await;
    let public_key = cluster.public_key().await;
    let token = cluster.create_agent(0, "bot", policy(1000)).await;
    for n in 0..5 {
        act_until_served(&cluster, n % 3, "bot", &token, &format!("warm-{n}")).await;
    }
    let leader = cluster.wait_for_leader(Duration::from_secs(5)).await;
    cluster.kill(leader);
    let survivor = (leader + 1) % 3;
    let (answer, took) = act_until_served(&cluster, survivor, "bot", &token, "after-kill").await;
    assert_eq!(answer["decision"], "allowed");
    assert!(
        took < Duration::from_secs(5),
        "new leader served after {took:?}"
    );

    cluster.start_node(leader);
    for n in 0..3 {
        act_until_served(&cluster, leader, "bot", &token, &format!("rejoined-{n}")).await;
    }
    let log = cluster.converged_log("bot", Duration::from_secs(10)).await;
    verify(&log, &public_key);
    let (_, status) = cluster.get(leader, "/v1/agents/bot", &token).await;
    assert_eq!(status["spent"], 9);
}

/// A leader that acknowledged its own entries early (the default), killed, and started
/// again with `--leader-early-ack false`, must not lead its old term again: entries it
/// acknowledged early and lost could be on followers under the same log ids. It comes
/// back in a later term, and what it had committed is all there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_restarted_without_early_acks_does_not_lead_its_old_term() {
    let mut cluster = Cluster::start(1).await;
    let token = cluster.create_agent(0, "bot", policy(1000)).await;
    for n in 0..3 {
        act_until_served(&cluster, 0, "bot", &token, &format!("before-{n}")).await;
    }
    cluster.wait_ready(0, Duration::from_secs(10)).await;
    let term = |metrics: std::collections::BTreeMap<String, f64>| metrics["lineage_raft_term"];
    let led = term(cluster.metrics(0).await);
    cluster.kill(0);
    cluster.extra_args = vec!["--leader-early-ack".into(), "false".into()];
    cluster.start_node(0);
    cluster.wait_ready(0, Duration::from_secs(20)).await;
    let now = term(cluster.metrics(0).await);
    assert!(now > led, "leads term {now} again after leading term {led}");
    act_until_served(&cluster, 0, "bot", &token, "after").await;
    let (_, status) = cluster.get(0, "/v1/agents/bot", &token).await;
    assert_eq!(status["spent"], 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_every_node_and_restarting_keeps_all_state() {
    let cluster = Cluster::start(3).await;
    let token = cluster.create_agent(2, "bot", policy(10)).await;
    for n in 0..4 {
        act_until_served(&cluster, n % 3, "bot", &token, &format!("k{n}")).await;
    }
    let (_, pending) = cluster
        .post_until_served(
            0,
            "/v1/agents/bot/actions",
            &token,
            json!({"tool": "pay", "input": {"to": "x"}}),
            "pay-1",
        )
        .await;
    assert_eq!(pending["decision"], "pending_approval");
    let (_, before) = cluster
        .get(0, "/v1/agents/bot", &cluster.admin.clone())
        .await;

    for i in 0..3 {
        cluster.kill(i);
    }
    for i in 0..3 {
        cluster.start_node(i);
    }
    cluster.wait_for_leader(Duration::from_secs(15)).await;
    let start = Instant::now();
    let after = loop {
        let (status, body) = cluster
            .get(1, "/v1/agents/bot", &cluster.admin.clone())
            .await;
        if status == 200 {
            break body;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "not served after restart: {status} {body}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(after, before, "state changed across a full restart");
    assert_eq!(after["spent"], 4);
    assert_eq!(after["actions_pending"], 1);
    // The restarted cluster decides on the same history: the pending payment still
    // needs approval, and approving it spends the rest of the budget and terminates.
    let (_, approved) = cluster
        .post_until_served(
            0,
            "/v1/agents/bot/actions/act-5/approve",
            &cluster.admin.clone(),
            json!({"approver": "alice"}),
            "approve-5",
        )
        .await;
    assert_eq!(approved["decision"], "allowed");
    assert_eq!(approved["remaining"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_with_the_same_key_on_another_node_after_a_leader_kill_is_charged_once() {
    let cluster = Cluster::start(3).await;
    let token = cluster.create_agent(0, "payer", policy(100)).await;
    let leader = cluster.wait_for_leader(Duration::from_secs(5)).await;
    let (first, _) = act_until_served(&cluster, leader, "payer", &token, "order-42").await;
    cluster.kill(leader);
    let other = (leader + 1) % 3;
    let (retry, _) = act_until_served(&cluster, other, "payer", &token, "order-42").await;
    assert_eq!(retry, first, "a retry must return the original answer");
    let (_, status) = cluster.get(other, "/v1/agents/payer", &token).await;
    assert_eq!(status["spent"], 1, "charged once");
    assert_eq!(status["actions_allowed"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_leader_kills_each_recover_within_five_seconds() {
    let cluster = Cluster::start(3).await;
    let token = cluster.create_agent(0, "bot", policy(1000)).await;
    let mut worst = Duration::ZERO;
    for round in 0..30 {
        let leader = cluster.wait_for_leader(Duration::from_secs(10)).await;
        cluster.kill(leader);
        let survivor = (leader + 1 + round % 2) % 3;
        let (answer, took) =
            act_until_served(&cluster, survivor, "bot", &token, &format!("round-{round}")).await;
        assert_eq!(answer["decision"], "allowed");
        eprintln!(
            "round {round}: killed node {}, served by node {} after {took:?}",
            leader + 1,
            survivor + 1
        );
        if took >= Duration::from_secs(5) {
            cluster.keep_logs();
        }
        assert!(
            took < Duration::from_secs(5),
            "round {round}: served after {took:?}"
        );
        worst = worst.max(took);
        cluster.start_node(leader);
    }
    // Node 0 may be the one the last round restarted: ask it once it is ready.
    cluster.wait_ready(0, Duration::from_secs(20)).await;
    let (code, status) = cluster.get(0, "/v1/agents/bot", &token).await;
    assert_eq!(code, 200, "{status}");
    assert_eq!(status["spent"], 30, "exactly one charge per round");
    eprintln!("worst recovery over 30 leader kills: {worst:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rust_client_fails_over_and_never_charges_twice() {
    let cluster = Cluster::start(3).await;
    let token = cluster.create_agent(0, "bot", policy(1000)).await;
    let urls: Vec<String> = (0..3).map(|i| cluster.url(i, "")).collect();
    let client = lineage_client::Client::new(&urls, &token).unwrap();
    let mut allowed = 0;
    for n in 0..20 {
        if n == 7 || n == 14 {
            let leader = cluster.wait_for_leader(Duration::from_secs(5)).await;
            cluster.kill(leader);
            if n == 14 {
                // Bring the first victim back so a quorum survives the second kill.
                for i in 0..3 {
                    if i != leader && !cluster.is_running(i) {
                        cluster.start_node(i);
                    }
                }
            }
        }
        let decision = client
            .request("bot", "search", json!({"n": n}), None)
            .await
            .expect("the client retries through failover");
        assert!(decision.is_allowed(), "{decision:?}");
        allowed += 1;
    }
    let status = client.status("bot").await.unwrap();
    assert_eq!(
        status.spent, allowed,
        "every logical call charged exactly once"
    );
    assert_eq!(status.actions_allowed, allowed);
}

/// A 3-node cluster with agent `bot` whose follower `victim` was killed and wiped.
struct WipedFollower {
    cluster: Cluster,
    public_key: String,
    token: String,
    leader: usize,
    victim: usize,
}

/// Creates agent `bot`, then kills and wipes a follower.
async fn wipe_a_follower(cluster: Cluster) -> WipedFollower {
    let public_key = cluster.public_key().await;
    let token = cluster.create_agent(0, "bot", policy(1000)).await;
    let leader = cluster.wait_for_leader(Duration::from_secs(5)).await;
    let victim = (leader + 1) % 3;
    WipedFollower::kill_and_wipe(cluster, public_key, token, leader, victim)
}

impl WipedFollower {
    /// Kills and wipes `victim`, a follower of `leader` in `cluster`.
    fn kill_and_wipe(
        cluster: Cluster,
        public_key: String,
        token: String,
        leader: usize,
        victim: usize,
    ) -> Self {
        cluster.kill(victim);
        cluster.wipe(victim);
        WipedFollower {
            cluster,
            public_key,
            token,
            leader,
            victim,
        }
    }

    /// Restarts the victim and checks that every replica, the victim's too, holds the
    /// same verifying log of `actions` charged actions; returns that log.
    async fn restart_and_check(&self, actions: u64, within: Duration) -> Vec<Value> {
        self.cluster.start_node(self.victim);
        let log = self.cluster.converged_log("bot", within).await;
        assert_eq!(log.len() as u64, 2 + actions * 2);
        verify(&log, &self.public_key);
        // The wiped node serves the agent's state again.
        let admin = self.cluster.admin.clone();
        let (status, body) = self
            .cluster
            .get(self.victim, "/v1/agents/bot?local=true", &admin)
            .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["spent"], actions);
        log
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wiped_node_rejoins_and_catches_up() {
    let cluster = Cluster::start(3).await;
    let public_key = cluster.public_key().await;
    let token = cluster.create_agent(0, "bot", policy(1000)).await;
    for n in 0..10 {
        act_until_served(&cluster, n % 3, "bot", &token, &format!("w{n}")).await;
    }
    let leader = cluster.wait_for_leader(Duration::from_secs(5)).await;
    let victim = (leader + 1) % 3;
    let wiped = WipedFollower::kill_and_wipe(cluster, public_key, token, leader, victim);
    for n in 0..5 {
        let cluster = &wiped.cluster;
        act_until_served(
            cluster,
            leader,
            "bot",
            &wiped.token,
            &format!("while-down-{n}"),
        )
        .await;
    }
    wiped.restart_and_check(15, Duration::from_secs(15)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wiped_node_installs_a_snapshot_of_several_chunks() {
    let wiped = wipe_a_follower(Cluster::start_with(3, &["--snapshot-every", "8"]).await).await;
    // Inputs of 50 KB: the snapshot grows past 1 MB, several chunks; sent as one chunk
    // (openraft's default) its JSON body would pass 3.5 MB.
    let big = "x".repeat(50_000);
    let (cluster, leader, token) = (&wiped.cluster, wiped.leader, &wiped.token);
    for n in 0..20 {
        let action = json!({"tool": "search", "input": {"blob": big, "n": n}});
        request_until_served(cluster, leader, "bot", token, &format!("big{n}"), &action).await;
    }
    wiped.restart_and_check(20, Duration::from_secs(30)).await;
}

/// A follower receiving a snapshot whose stream outlasts its election timeout does not
/// campaign (`election_hold`). openraft does not restart a follower's election timer on
/// snapshot chunks, and before the hold the follower campaigned in the middle of the
/// stream: its higher term unseated the leader, the next stream started again from
/// offset 0, and so on. Without the hold this test failed 3 runs of 3 here (and an
/// earlier form of it 8 of 9, six never converging in 90 s, terms up to 55). The peers
/// count the vote requests they get by candidate; elections started by others (a leader
/// starved of CPU on a loaded machine misses heartbeats) are allowed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_receiving_a_long_snapshot_stream_does_not_campaign() {
    let cluster = Cluster::start_with(3, &["--snapshot-every", "20"]).await;
    let public_key = cluster.public_key().await;
    let token = cluster.create_agent(0, "bot", policy(1000)).await;
    let leader = cluster.wait_for_leader(Duration::from_secs(5)).await;
    // The count is live: the leader's election reached the peers that voted for it.
    let votes = "lineage_raft_vote_requests_received_total{";
    let mut counted = 0.0;
    for i in (0..3).filter(|i| *i != leader) {
        let metrics = cluster.metrics(i).await;
        let series = metrics.range(votes.to_string()..);
        counted += series
            .take_while(|(name, _)| name.starts_with(votes))
            .map(|(_, n)| n)
            .sum::<f64>();
    }
    assert!(counted >= 1.0, "no vote request counted");
    // Not node 1: wiped, the lowest id initialises a cluster of its own at start, and
    // openraft's initialise campaigns whatever the election setting.
    let victim = (1..3).find(|i| *i != leader).unwrap_or(1);
    let wiped = WipedFollower::kill_and_wipe(cluster, public_key, token, leader, victim);
    // 200 inputs of 60 KB, on a second agent: a snapshot of about 12 MB, 46 chunks of
    // 256 KiB, each its own request; seconds of streaming in a debug build, against
    // timeouts of 0.7-1.2 s. The replicas are then compared on `bot`'s short log, which
    // the same snapshot carries: reading 12 MB logs from every node every 100 ms starved
    // the leader on a busy machine.
    let (cluster, token) = (&wiped.cluster, &wiped.token);
    let filler = cluster.create_agent(leader, "filler", policy(1000)).await;
    let big = "y".repeat(60_000);
    for n in 0..200 {
        let action = json!({"tool": "search", "input": {"blob": big, "n": n}});
        request_until_served(
            cluster,
            leader,
            "filler",
            &filler,
            &format!("big{n}"),
            &action,
        )
        .await;
    }
    for n in 0..10 {
        act_until_served(cluster, leader, "bot", token, &format!("s{n}")).await;
    }
    // The leader keeps at most 20 entries behind its snapshot: only a snapshot can
    // bring the wiped node back. The log holds at least 214 entries (the two creates,
    // 210 writes, the membership and a blank), heads rounds a varying few more, so the
    // last snapshot of every 20 lies at 180 or past it, with most of the 12 MB in it.
    // (A build of 12 MB may still be running: wait for it, bounded.)
    let mut snapshot_index = None;
    for _ in 0..300 {
        let leader_metrics = cluster.metrics(leader).await;
        snapshot_index = leader_metrics.get("lineage_raft_snapshot_index").copied();
        if snapshot_index >= Some(180.0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        snapshot_index >= Some(180.0),
        "snapshot index {snapshot_index:?}"
    );
    let before = vote_requests_from(cluster, victim).await;
    wiped.restart_and_check(10, Duration::from_secs(90)).await;
    // After the hold's quiet time its elections are on again, with nothing to start one.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let after = vote_requests_from(cluster, victim).await;
    assert_eq!(
        after,
        before,
        "vote requests from node {} while it received the snapshot; {}",
        victim + 1,
        cluster.log_tails(30)
    );
}

/// The vote requests node `candidate`'s running peers have counted from it.
async fn vote_requests_from(cluster: &Cluster, candidate: usize) -> f64 {
    let series = format!(
        "lineage_raft_vote_requests_received_total{{candidate=\"{}\"}}",
        candidate + 1
    );
    let mut total = 0.0;
    for i in (0..3).filter(|i| *i != candidate && cluster.is_running(*i)) {
        total += cluster
            .metrics(i)
            .await
            .get(&series)
            .copied()
            .unwrap_or(0.0);
    }
    total
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wiped_node_catches_up_from_a_snapshot_when_the_log_was_purged() {
    let wiped = wipe_a_follower(Cluster::start_with(3, &["--snapshot-every", "8"]).await).await;
    // Far more entries than one snapshot interval: the leader purges what the wiped
    // node would need, so only a snapshot can bring it back.
    let (cluster, leader, token) = (&wiped.cluster, wiped.leader, &wiped.token);
    for n in 0..40 {
        act_until_served(cluster, leader, "bot", token, &format!("s{n}")).await;
    }
    let log = wiped.restart_and_check(40, Duration::from_secs(20)).await;
    // And after a restart it still has it (the snapshot was installed durably).
    cluster.kill(wiped.victim);
    cluster.start_node(wiped.victim);
    let log_after = cluster.converged_log("bot", Duration::from_secs(20)).await;
    assert_eq!(log_after, log);
}

/// `POST /v1/node/snapshot` acts on the node asked, never forwarded: an admin gets that
/// node's snapshot with its log purged through it (others get 401/403). On the leader,
/// with a follower down, the purge means that follower can come back wiped only through
/// a snapshot, whose body is written then from the leader's tables.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_snapshot_purges_the_nodes_log_and_a_wiped_node_catches_up_from_it() {
    // The default policy: openraft builds no snapshot by itself in this test.
    let wiped = wipe_a_follower(Cluster::start(3).await).await;
    let (cluster, leader, token) = (&wiped.cluster, wiped.leader, &wiped.token);
    for n in 0..20 {
        act_until_served(cluster, leader, "bot", token, &format!("p{n}")).await;
    }
    let other = 3 - leader - wiped.victim;
    let (status, body) = cluster
        .post(other, "/v1/node/snapshot", "", json!({}), None)
        .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (401, Some("unauthorized")),
        "{body}"
    );
    let (status, body) = cluster
        .post(other, "/v1/node/snapshot", token, json!({}), None)
        .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (403, Some("forbidden")),
        "{body}"
    );

    let admin = cluster.admin.clone();
    for node in [other, leader] {
        let (_, before) = cluster.get(node, "/v1/cluster", &admin).await;
        let (status, body) = cluster
            .post(node, "/v1/node/snapshot", &admin, json!({}), None)
            .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(
            body["node_id"],
            node + 1,
            "answered by another node: {body}"
        );
        let snapshot = body["snapshot_index"].as_u64().unwrap_or(0);
        assert!(
            snapshot >= before["applied_index"].as_u64().unwrap_or(u64::MAX),
            "the snapshot is older than what the node had applied: {body} {before}"
        );
        assert_eq!(body["purged_index"], snapshot, "{body}");
    }
    // The wiped node needs entries from index 1, which the leader no longer has.
    let log = wiped.restart_and_check(20, Duration::from_secs(30)).await;
    assert_eq!(cluster.local_log(wiped.victim, "bot").await, Some(log));
}

/// Request bodies whose numbers and strings a careless parser changes on the way back:
/// 17-digit floats at both ends of the range, subnormals, integers at and past the u64
/// and i64 limits, escapes and astral-plane text; the rest drawn from a seeded generator.
fn hostile_inputs(count: usize, seed: u64) -> Vec<String> {
    let mut fixed: Vec<String> = [
        "3.4980118210031664e-13",
        "0.30000000000000004",
        "2.2250738585072014e-308",
        "1.7976931348623157e+308",
        "5e-324",
        "18446744073709551615",
        "18446744073709551616",
        "-9223372036854775808",
        "-9223372036854775809",
        "123456789012345678901234567890",
        "1e21",
        "-0.0",
        "\"\\u2028 \\ud83d\\ude00 \\\" \\\\ \\n \\u0000 \\/\"",
    ]
    .iter()
    .map(|n| format!(r#"{{"tool":"search","input":{{"v":{n},"w":[{n},{{"x":{n}}}]}}}}"#))
    .collect();
    let mut state = seed | 1;
    let mut next = move || {
        // xorshift64*: deterministic, so a failure names its seed and repeats.
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        state.wrapping_mul(0x2545_f491_4f6c_dd1d)
    };
    while fixed.len() < count {
        let float = f64::from_bits(next());
        let float = if float.is_finite() { float } else { 1.5 };
        let big = format!("{}{}", u64::MAX, next() % 100_000);
        fixed.push(format!(
            r#"{{"tool":"search","input":{{"f":{float:.16e},"g":{float:?},"big":{big},"i":{},"s":"\u00e9\u0001{}"}}}}"#,
            next() as i64,
            next() % 1000
        ));
    }
    fixed
}

/// Finding 0 of the storage-faults issue: the leader applied its in-memory record while
/// followers applied what they parsed from the line; a float that did not read back the
/// same made every follower refuse the record, and a failover then lost acknowledged
/// decisions. Every replica must hold the same head, and a failover must lose nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inputs_that_must_read_back_exactly_give_one_head_everywhere_and_survive_failover() {
    let cluster = Cluster::start(3).await;
    let public_key = cluster.public_key().await;
    let token = cluster.create_agent(0, "floats", policy(1000)).await;
    let seed = 0x5eed_f10a7;
    let inputs = hostile_inputs(40, seed);
    for (n, body) in inputs.iter().enumerate() {
        let start = Instant::now();
        loop {
            let reply = cluster
                .http
                .post(cluster.url(n % 3, "/v1/agents/floats/actions"))
                .bearer_auth(&token)
                .header("content-type", "application/json")
                .header("Idempotency-Key", format!("in-{n}"))
                .body(body.clone())
                .send()
                .await;
            if let Ok(reply) = reply {
                let status = reply.status().as_u16();
                let answer: Value = reply.json().await.unwrap_or(Value::Null);
                if status == 200 {
                    assert_eq!(
                        answer["decision"], "allowed",
                        "input {n} (seed {seed:#x}): {body}"
                    );
                    break;
                }
                assert!(
                    status >= 500,
                    "input {n} refused with {status}: {answer} for {body}"
                );
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "input {n} not served"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let log = cluster
        .converged_log("floats", Duration::from_secs(10))
        .await;
    assert_eq!(log.len(), 2 + 2 * inputs.len(), "seed {seed:#x}");
    verify(&log, &public_key);

    let leader = cluster.wait_for_leader(Duration::from_secs(5)).await;
    cluster.kill(leader);
    let survivor = (leader + 1) % 3;
    let (answer, _) =
        act_until_served(&cluster, survivor, "floats", &token, "after-failover").await;
    assert_eq!(
        answer["action_id"],
        format!("act-{}", inputs.len() + 1),
        "{answer}"
    );
    let (_, status) = cluster.get(survivor, "/v1/agents/floats", &token).await;
    assert_eq!(status["spent"], inputs.len() as u64 + 1, "{status}");
    let log = cluster
        .converged_log("floats", Duration::from_secs(10))
        .await;
    verify(&log, &public_key);
}
