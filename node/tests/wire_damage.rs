//! A Raft request changed on its way between nodes. Over plain HTTP only TCP's 16-bit
//! checksum guards the bytes; a record changed there would pass the follower's parse and
//! be rejected at its apply alone, leaving its copy of the agent behind the others' for
//! good. Each request carries the SHA-256 of its body (`x-lineage-body-sha256`), so the
//! follower refuses such a body and the leader sends it again. Answers carry the same
//! header, so a vote answer whose term changed on its way back is refused too; a
//! request or answer without it (a node of an older build) is read as before.

#[path = "cluster/util.rs"]
mod util;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use util::Cluster;

/// A change the proxies make to one read of the bytes going one way: the bytes to send
/// instead, or `None` to send them as they came.
type Change = fn(&[u8]) -> Option<Vec<u8>>;

/// Requests to a node: the first digit of a record's `"hash"` into another hex digit
/// (the JSON still parses).
fn change_a_record_hash(chunk: &[u8]) -> Option<Vec<u8>> {
    const FIELD: &[u8] = br#""hash":""#;
    let at = find(chunk, FIELD)? + FIELD.len();
    let mut changed = chunk.to_vec();
    let digit = changed.get_mut(at).filter(|b| b.is_ascii_hexdigit())?;
    *digit = if *digit == b'a' { b'b' } else { b'a' };
    Some(changed)
}

/// Answers from a node: the first digit of the term in a vote answer into a 9 (an 8 if
/// it was one), so a granted vote reads as the voter having seen a far later term.
fn change_a_vote_term(chunk: &[u8]) -> Option<Vec<u8>> {
    const FIELD: &[u8] = br#""term":"#;
    find(chunk, br#""vote_granted""#)?;
    let at = find(chunk, FIELD)? + FIELD.len();
    let mut changed = chunk.to_vec();
    let digit = changed.get_mut(at).filter(|b| b.is_ascii_digit())?;
    *digit = if *digit == b'9' { b'8' } else { b'9' };
    Some(changed)
}

/// Both ways: the body digest's header line taken out, as a node of a build before
/// digests sends its requests and answers.
fn strip_the_digest(chunk: &[u8]) -> Option<Vec<u8>> {
    const HEADER: &[u8] = b"x-lineage-body-sha256: ";
    let at = find(chunk, HEADER)?;
    let end = at + find(&chunk[at..], b"\r\n")? + 2;
    let mut stripped = chunk[..at].to_vec();
    stripped.extend_from_slice(&chunk[end..]);
    Some(stripped)
}

/// What the proxies in front of every node share: whether to change bytes, what to
/// change, which ways, and how many changes were made.
#[derive(Clone)]
struct Damage {
    armed: Arc<AtomicBool>,
    changed: Arc<AtomicUsize>,
    /// Of those, the changes to answers, and to requests that carried a record.
    answers_changed: Arc<AtomicUsize>,
    records_changed: Arc<AtomicUsize>,
    change: Change,
    /// One change in all (the proxies disarm), or every read the change applies to.
    once: bool,
    /// The change applies to requests (to the node), to answers (from it), or both.
    requests: bool,
    answers: bool,
}

impl Damage {
    fn new(change: Change, once: bool, requests: bool, answers: bool) -> Self {
        Damage {
            armed: Arc::new(AtomicBool::new(false)),
            changed: Arc::new(AtomicUsize::new(0)),
            answers_changed: Arc::new(AtomicUsize::new(0)),
            records_changed: Arc::new(AtomicUsize::new(0)),
            change,
            once,
            requests,
            answers,
        }
    }
}

/// Forwards each connection made to `listener` to `target`, applying `damage`.
async fn damaging_proxy(listener: TcpListener, target: String, damage: Damage) {
    while let Ok((inbound, _)) = listener.accept().await {
        let Ok(outbound) = TcpStream::connect(&target).await else {
            continue; // the node is down; the caller's connection just closes
        };
        let (from_caller, to_caller) = inbound.into_split();
        let (from_node, to_node) = outbound.into_split();
        let to_node_damage = damage.requests.then(|| damage.clone());
        let to_caller_damage = damage.answers.then(|| damage.clone());
        tokio::spawn(pump(from_caller, to_node, to_node_damage, false));
        tokio::spawn(pump(from_node, to_caller, to_caller_damage, true));
    }
}

/// Copies one way of a connection (`answers`: from the node) until either end closes,
/// applying `damage` if given.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    damage: Option<Damage>,
    answers: bool,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let chunk = &buf[..n];
        let mut changed = None;
        if let Some(damage) = damage.as_ref().filter(|d| d.armed.load(Ordering::Acquire)) {
            changed = (damage.change)(chunk)
                .filter(|_| !damage.once || damage.armed.swap(false, Ordering::AcqRel));
            if changed.is_some() {
                damage.changed.fetch_add(1, Ordering::AcqRel);
                if answers {
                    damage.answers_changed.fetch_add(1, Ordering::AcqRel);
                } else if find(chunk, br#""hash":""#).is_some() {
                    damage.records_changed.fetch_add(1, Ordering::AcqRel);
                }
            }
        }
        if to
            .write_all(changed.as_deref().unwrap_or(chunk))
            .await
            .is_err()
        {
            break;
        }
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// A cluster of three whose nodes are reached (by peers and by the test) through
/// proxies that apply `damage`.
async fn cluster_behind_proxies(damage: &Damage) -> Cluster {
    cluster_behind_proxies_each(&[damage.clone(), damage.clone(), damage.clone()], &[]).await
}

/// A cluster of three started with `args`, node `i` reached through a proxy that
/// applies `damages[i]`.
async fn cluster_behind_proxies_each(damages: &[Damage; 3], args: &[&str]) -> Cluster {
    let mut cluster = Cluster::prepare(3, args);
    for (i, damage) in damages.iter().enumerate() {
        let listen = cluster.listen_apart(i);
        let proxy = TcpListener::bind(&cluster.addrs[i])
            .await
            .expect("bind proxy");
        tokio::spawn(damaging_proxy(proxy, listen, damage.clone()));
    }
    for i in 0..3 {
        cluster.start_node(i);
    }
    cluster
}

/// The sum of a metric over the three nodes, each of which must report it.
async fn summed(cluster: &Cluster, metric: &str) -> f64 {
    let mut sum = 0.0;
    for i in 0..3 {
        sum += cluster
            .metrics(i)
            .await
            .get(metric)
            .copied()
            .unwrap_or_else(|| panic!("node {} reports no {metric}", i + 1));
    }
    sum
}

/// Every node is reached by its peers through a proxy that changes one record's hash in
/// one Raft request after the agent exists. The node that receives it refuses it
/// (counted `digest`), the leader sends it again, and every replica's copy of the agent
/// ends the same, every write there. Without the digest the changed entry was appended,
/// rejected at that node's apply alone, and that copy never caught up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raft_request_changed_on_its_way_is_refused_and_sent_again() {
    let damage = Damage::new(change_a_record_hash, true, true, false);
    let (armed, changed) = (damage.armed.clone(), damage.changed.clone());
    let cluster = cluster_behind_proxies(&damage).await;
    cluster.wait_for_leader(Duration::from_secs(15)).await;
    let policy = json!({"budget": 1_000, "scar_limit": 10, "tools": {"search": {"cost": 1}}});
    let token = cluster.create_agent(0, "victim", policy).await;
    let mut writes = 0;
    let mut refused = 0.0;
    // A round arms the proxies and writes until one changed a request, then a few more,
    // decided on the copies that took it. A changed request the leader gave up on before
    // the receiver read it (openraft's 50 ms bound) is refused by nobody: another round.
    for round in 1..=5 {
        armed.store(true, Ordering::Release);
        let round_end = writes + 10;
        while writes < round_end || (changed.load(Ordering::Acquire) < round && writes < 200) {
            write(&cluster, writes % 3, "victim", &token, writes).await;
            writes += 1;
        }
        assert_eq!(
            changed.load(Ordering::Acquire),
            round,
            "no Raft request with a record passed a proxy by write {writes}"
        );
        let log = cluster
            .converged_log("victim", Duration::from_secs(30))
            .await;
        // Genesis and policy, then a request and its decision for each write.
        assert_eq!(log.len(), 2 + 2 * writes, "{log:?}");
        refused = summed(
            &cluster,
            r#"lineage_raft_requests_refused_total{reason="digest"}"#,
        )
        .await;
        if refused > 0.0 {
            break;
        }
    }
    assert_eq!(refused, 1.0, "one changed request refused, in five rounds");
}

/// The first vote answer of the cluster's first election has its term changed on its
/// way back to the candidate, into a term far beyond any the cluster has had. The
/// candidate refuses the answer (counted), and the cluster elects a leader in an early
/// term. Taken as it came (the check disabled, three runs of three), the candidate moved
/// its vote to the changed term while its election went on; the other voter's grant
/// then made it leader on a vote it no longer held, openraft panicked ("commit vote can
/// not fail") and the node exited, and no leader was elected in 15 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raft_answer_changed_on_its_way_back_is_refused() {
    let damage = Damage::new(change_a_vote_term, true, false, true);
    damage.armed.store(true, Ordering::Release);
    let cluster = cluster_behind_proxies(&damage).await;
    let mut leader = cluster.wait_for_leader(Duration::from_secs(15)).await;
    let mut refused = 0.0;
    // A changed answer whose call openraft gave up on before it was read (its vote
    // timeout, on a slow start) is refused by nobody: the proxies are armed again and
    // the leader paused, so that the other two hold another election.
    for round in 1..=3 {
        assert_eq!(
            damage.changed.load(Ordering::Acquire),
            round,
            "no vote answer passed a proxy in election round {round}\n{}",
            cluster.log_tails(20)
        );
        refused = summed(&cluster, "lineage_raft_answers_refused_total").await;
        if refused > 0.0 || round == 3 {
            break;
        }
        damage.armed.store(true, Ordering::Release);
        cluster.pause(leader);
        let others: Vec<usize> = (0..3).filter(|&i| i != leader).collect();
        let deadline = std::time::Instant::now() + Duration::from_secs(15);
        loop {
            let seen = [
                cluster.leader_seen_by(others[0]).await,
                cluster.leader_seen_by(others[1]).await,
            ];
            if seen[0].is_some_and(|l| l != leader) && seen[0] == seen[1] {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no other leader while node {} was paused\n{}",
                leader + 1,
                cluster.log_tails(20)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        cluster.resume(leader);
        leader = cluster.wait_for_leader(Duration::from_secs(15)).await;
    }
    assert_eq!(refused, 1.0, "the changed answer was refused");
    let policy = json!({"budget": 1_000, "scar_limit": 10, "tools": {"search": {"cost": 1}}});
    let token = cluster.create_agent(leader, "voter", policy).await;
    let (status, body) = cluster
        .post_until_served(
            leader,
            "/v1/agents/voter/actions",
            &token,
            json!({"tool": "search", "input": {}}),
            "after-the-election",
        )
        .await;
    assert_eq!(status, 200, "{body}");
    for i in 0..3 {
        let term = cluster
            .metrics(i)
            .await
            .get("lineage_raft_term")
            .copied()
            .unwrap_or_else(|| panic!("node {i} reports no term\n{}", cluster.log_tails(20)));
        assert!(
            term < 9.0,
            "node {i} is at term {term}: it took the changed answer's term\n{}",
            cluster.log_tails(20)
        );
    }
}

/// Every request and answer between the nodes loses its digest header on the way, as
/// between nodes of a build before digests (a rolling upgrade): they are read as
/// before, so the cluster elects, writes and replicates, and nothing is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raft_messages_without_a_digest_are_read_as_before() {
    let damage = Damage::new(strip_the_digest, false, true, true);
    damage.armed.store(true, Ordering::Release);
    let cluster = cluster_behind_proxies(&damage).await;
    let leader = cluster.wait_for_leader(Duration::from_secs(15)).await;
    let policy = json!({"budget": 1_000, "scar_limit": 10, "tools": {"search": {"cost": 1}}});
    let token = cluster.create_agent(leader, "old-build", policy).await;
    for n in 0..20 {
        write(&cluster, n % 3, "old-build", &token, n).await;
    }
    let log = cluster
        .converged_log("old-build", Duration::from_secs(30))
        .await;
    assert_eq!(log.len(), 2 + 2 * 20, "{log:?}");
    // Requests with records, and answers, went by without their header.
    let with_records = damage.records_changed.load(Ordering::Acquire);
    let answers = damage.answers_changed.load(Ordering::Acquire);
    assert!(
        with_records >= 20 && answers > 0,
        "{with_records} requests with records and {answers} answers lost their digest"
    );
    let refused = summed(
        &cluster,
        r#"lineage_raft_requests_refused_total{reason="digest"}"#,
    )
    .await
        + summed(&cluster, "lineage_raft_answers_refused_total").await;
    assert_eq!(refused, 0.0, "a message without a digest was refused");
    for way in ["request", "answer"] {
        let metric = format!(r#"lineage_raft_messages_without_digest_total{{way="{way}"}}"#);
        assert!(
            summed(&cluster, &metric).await > 0.0,
            "none counted: {metric}"
        );
    }
}

/// With `--require-raft-digests`, a follower whose Raft requests lose their digest header
/// on the way refuses every one (counted) before reading it, so it takes nothing while
/// the other two carry on. Once the header comes through again, it catches up, every
/// write there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_digests_required_a_request_without_one_is_refused() {
    let damages = [0, 1, 2].map(|_| Damage::new(strip_the_digest, false, true, false));
    let cluster = cluster_behind_proxies_each(&damages, &["--require-raft-digests", "true"]).await;
    // Elected first: the check below is of messages a running cluster sent.
    cluster.wait_for_leader(Duration::from_secs(15)).await;
    // Before any header is taken out, no message came without one.
    for way in ["request", "answer"] {
        let metric = format!(r#"lineage_raft_messages_without_digest_total{{way="{way}"}}"#);
        assert_eq!(summed(&cluster, &metric).await, 0.0, "{metric}");
    }
    let (_, cut_off) = ten_writes_with_a_follower_cut_off(&cluster, &damages).await;
    let refused = cluster
        .metrics(cut_off)
        .await
        .get(r#"lineage_raft_requests_refused_total{reason="missing_digest"}"#)
        .copied();
    assert!(
        refused.is_some_and(|n| n > 0.0),
        "node {} refused {refused:?} Raft requests without a digest\n{}",
        cut_off + 1,
        cluster.log_tails(20)
    );
    let held = cluster
        .local_log(cut_off, "strict")
        .await
        .map_or(0, |l| l.len());
    assert!(
        held < 2 + 2 * 10,
        "node {} took the writes anyway: {held} records",
        cut_off + 1
    );
    caught_up_once_mended(&cluster, &damages[cut_off]).await;
}

/// With `--require-raft-digests`, the leader refuses a follower's answers that lost their
/// digest header on the way: it counts them (not as bytes changed), never counts that
/// follower's appends, and commits with the other. Once the header comes through again,
/// the follower is counted caught up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_digests_required_an_answer_without_one_is_refused() {
    let damages = [0, 1, 2].map(|_| Damage::new(strip_the_digest, false, false, true));
    let cluster = cluster_behind_proxies_each(&damages, &["--require-raft-digests", "true"]).await;
    let (leader, cut_off) = ten_writes_with_a_follower_cut_off(&cluster, &damages).await;
    let metrics = cluster.metrics(leader).await;
    let figure = |name: &str| {
        metrics
            .get(name)
            .copied()
            .unwrap_or_else(|| panic!("the leader reports no {name}"))
    };
    assert!(figure(r#"lineage_raft_messages_without_digest_total{way="answer"}"#) > 0.0);
    assert_eq!(figure("lineage_raft_answers_refused_total"), 0.0);
    let lag = figure(&format!(
        r#"lineage_raft_replication_lag_entries{{follower="{}"}}"#,
        cut_off + 1
    ));
    assert!(
        lag >= 10.0,
        "the leader counted node {}'s appends from answers it should refuse (lag {lag})",
        cut_off + 1
    );
    caught_up_once_mended(&cluster, &damages[cut_off]).await;
}

/// Agent "strict" created, then ten writes through the leader with the damage of the
/// follower after it armed: (the leader, that follower).
async fn ten_writes_with_a_follower_cut_off(
    cluster: &Cluster,
    damages: &[Damage; 3],
) -> (usize, usize) {
    let leader = cluster.wait_for_leader(Duration::from_secs(15)).await;
    let policy = json!({"budget": 1_000, "scar_limit": 10, "tools": {"search": {"cost": 1}}});
    let token = cluster.create_agent(leader, "strict", policy).await;
    let leader = cluster.wait_for_leader(Duration::from_secs(15)).await;
    let cut_off = (leader + 1) % 3;
    damages[cut_off].armed.store(true, Ordering::Release);
    write_ten(cluster, leader, "strict", &token).await;
    (leader, cut_off)
}

/// Once `damage` is disarmed, every node holds all of "strict"'s records (its two, and
/// two for each of the ten writes).
async fn caught_up_once_mended(cluster: &Cluster, damage: &Damage) {
    damage.armed.store(false, Ordering::Release);
    let log = cluster
        .converged_log("strict", Duration::from_secs(30))
        .await;
    assert_eq!(log.len(), 2 + 2 * 10, "{log:?}");
}

/// Ten writes to `agent` through `leader`, each allowed.
async fn write_ten(cluster: &Cluster, leader: usize, agent: &str, token: &str) {
    for n in 0..10 {
        write(cluster, leader, agent, token, n).await;
    }
}

/// Write `n` (its input, and its Idempotency-Key `w{n}`) to `agent` through node `via`,
/// served and allowed.
async fn write(cluster: &Cluster, via: usize, agent: &str, token: &str, n: usize) {
    let (status, body) = cluster
        .post_until_served(
            via,
            &format!("/v1/agents/{agent}/actions"),
            token,
            json!({"tool": "search", "input": {"n": n}}),
            &format!("w{n}"),
        )
        .await;
    assert_eq!(status, 200, "write {n}: {body}");
    assert_eq!(body["decision"], "allowed", "write {n}: {body}");
}
