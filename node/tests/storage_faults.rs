//! Storage faults on one node of three real processes: the scenario that lost 60
//! acknowledged decisions before the durable watermark (issue: "never lose an acknowledged
//! decision", finding 1). 30 actions; kill -9 follower F2; 60 more actions, acknowledged
//! by the leader and F3 only; kill -9 the leader and F3; damage F3's Raft log where the 60
//! are; restart F2 and F3, then the old leader. Every node must end with all 90, agree,
//! verify, and be ready (F3's repair floor cleared), with no operator.

#[path = "cluster/util.rs"]
mod util;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use util::{verify_log as verify, Cluster};

/// Where F3's copy is damaged: the bytes of one phase-two action's entry.
#[derive(Clone, Copy, Debug)]
enum Damage {
    /// No fault: the control run.
    None,
    /// One bit flipped in the entry holding this phase-two action.
    FlipAt(usize),
    /// The 4 KiB block holding this action's entry zeroed.
    ZeroBlockAt(usize),
    /// The segment cut inside this action's entry.
    TruncateAt(usize),
}

const BEFORE: usize = 30;
const AFTER: usize = 60;

fn marker(n: usize) -> String {
    format!("\"mark\":\"p2-{n}\"")
}

/// The Raft-log segment of node `i` holding `needle`, and the needle's offset in it.
fn find_in_segments(dir: &Path, needle: &str) -> (PathBuf, usize) {
    let log_dir = dir.join("raft-log");
    for entry in std::fs::read_dir(&log_dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|x| x == "seg") {
            let bytes = std::fs::read(&path).unwrap();
            if let Some(at) = bytes
                .windows(needle.len())
                .position(|w| w == needle.as_bytes())
            {
                return (path, at);
            }
        }
    }
    panic!("{needle} is in no segment of {}", log_dir.display());
}

fn damage(dir: &Path, damage: Damage) {
    let write = |path: &Path, at: u64, bytes: &[u8]| {
        let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
        file.write_all_at(bytes, at).unwrap();
        file.sync_all().unwrap();
    };
    match damage {
        Damage::None => {}
        Damage::FlipAt(n) => {
            let (path, at) = find_in_segments(dir, &marker(n));
            let byte = std::fs::read(&path).unwrap()[at + 3];
            write(&path, at as u64 + 3, &[byte ^ 0x01]);
        }
        Damage::ZeroBlockAt(n) => {
            let (path, at) = find_in_segments(dir, &marker(n));
            write(&path, (at / 4096 * 4096) as u64, &[0u8; 4096]);
        }
        Damage::TruncateAt(n) => {
            let (path, at) = find_in_segments(dir, &marker(n));
            let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
            file.set_len(at as u64).unwrap();
            file.sync_all().unwrap();
        }
    }
}

async fn act(cluster: &Cluster, via: usize, token: &str, key: &str) -> Value {
    let (status, body) = cluster
        .post_until_served(
            via,
            "/v1/agents/bot/actions",
            token,
            json!({"tool": "search", "input": {"mark": key}}),
            key,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["decision"], "allowed", "{body}");
    body
}

/// Waits (bounded) until every replica holds the same log of `records` records. Replicas
/// can agree for a moment on a prefix while they apply what was just committed, so
/// agreement alone is not the end; a log that never reaches `records` fails here.
async fn converged_with(cluster: &Cluster, records: usize, what: &str) -> Vec<Value> {
    let start = Instant::now();
    loop {
        let log = cluster.converged_log("bot", Duration::from_secs(30)).await;
        if log.len() == records {
            return log;
        }
        assert!(
            log.len() < records,
            "{what}: {} records, more than {records}",
            log.len()
        );
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{what}: the replicas agree on {} records, not {records}\n{}",
            log.len(),
            cluster.log_tails(30)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What `acknowledged_by_two` left: the agent's token, the nodes' roles, all down.
struct History {
    public_key: String,
    token: String,
    leader: usize,
    f2: usize,
    f3: usize,
}

/// Agent `bot`; 30 actions; kill -9 follower F2; 60 more actions acknowledged by the
/// leader and F3 only; kill -9 the leader and F3.
async fn acknowledged_by_two(cluster: &Cluster) -> History {
    let public_key = cluster.public_key().await;
    let token = cluster
        .create_agent(
            0,
            "bot",
            json!({"budget": 100_000, "scar_limit": 10, "tools": {"search": {"cost": 1}}}),
        )
        .await;
    for n in 0..BEFORE {
        act(cluster, n % 3, &token, &format!("p1-{n}")).await;
    }
    let leader = cluster.wait_for_leader(Duration::from_secs(5)).await;
    let (f2, f3) = ((leader + 1) % 3, (leader + 2) % 3);
    cluster.kill(f2);
    for n in 0..AFTER {
        act(cluster, leader, &token, &format!("p2-{n}")).await;
    }
    cluster.kill(leader);
    cluster.kill(f3);
    History {
        public_key,
        token,
        leader,
        f2,
        f3,
    }
}

async fn scenario(fault: Damage) {
    let cluster = Cluster::start(3).await;
    let History {
        public_key,
        token,
        leader,
        f2,
        f3,
    } = acknowledged_by_two(&cluster).await;
    damage(&cluster.data_dir(f3), fault);

    // F2 lacks the 60; F3 lost some of them. Together they must not elect a leader that
    // serves a history without them.
    cluster.start_node(f2);
    cluster.start_node(f3);
    let quiet = Instant::now();
    while quiet.elapsed() < Duration::from_secs(3) {
        for node in [f2, f3] {
            let (status, body) = cluster.get(node, "/v1/agents/bot", &token).await;
            if status == 200 {
                assert_eq!(
                    body["spent"],
                    (BEFORE + AFTER) as u64,
                    "{fault:?}: node {} served a history without acknowledged decisions: {body}\n{}",
                    node + 1,
                    cluster.log_tails(30)
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let restarted = Instant::now();
    cluster.start_node(leader);
    let log = converged_with(&cluster, 2 + 2 * (BEFORE + AFTER), &format!("{fault:?}")).await;
    let converged = restarted.elapsed();
    verify(&log, &public_key);
    for node in 0..3 {
        cluster.wait_ready(node, Duration::from_secs(20)).await;
        let (status, body) = cluster
            .get(node, "/v1/agents/bot?local=true", &cluster.admin.clone())
            .await;
        assert_eq!(status, 200, "{fault:?} node {}: {body}", node + 1);
        assert_eq!(
            body["spent"],
            (BEFORE + AFTER) as u64,
            "{fault:?} node {}",
            node + 1
        );
    }
    // The cluster decides on from the full history.
    let next = act(&cluster, f3, &token, "after").await;
    assert_eq!(
        next["action_id"],
        format!("act-{}", BEFORE + AFTER + 1),
        "{next}"
    );
    println!(
        "{fault:?}: all {} decisions on every node, {:.1} s after the old leader returned",
        BEFORE + AFTER,
        converged.as_secs_f64()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_run_without_a_fault() {
    scenario(Damage::None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flipped_bit_in_the_first_entry_the_lagging_follower_lacks() {
    scenario(Damage::FlipAt(0)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flipped_bit_in_the_middle_of_the_last_segment() {
    scenario(Damage::FlipAt(AFTER / 2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flipped_bit_in_the_last_acknowledged_entry() {
    scenario(Damage::FlipAt(AFTER - 1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zeroed_block_among_acknowledged_entries() {
    scenario(Damage::ZeroBlockAt(AFTER / 2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_segment_cut_inside_an_acknowledged_entry() {
    scenario(Damage::TruncateAt(AFTER * 3 / 4)).await;
}

/// A fault in one file of a follower's data directory, made while it is down.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    /// The state machine's redb file deleted (its log was purged behind a snapshot, so
    /// only a snapshot from the leader can rebuild it).
    RedbDeleted,
    /// Bytes of the redb file overwritten with garbage.
    RedbGarbage,
    /// One digit of the state machine's last applied index changed inside redb (the
    /// page stays valid to redb, which checks page checksums only when repairing).
    AppliedIndexChanged,
    /// The Raft log's watermark file deleted.
    WatermarkDeleted,
    /// Both watermark slots zeroed.
    WatermarkZeroed,
    /// The vote file deleted.
    VoteDeleted,
    /// The vote file overwritten with garbage.
    VoteGarbage,
    /// `purged.json` (where the log starts) overwritten with garbage.
    PurgedGarbage,
    /// The newest Raft-log segment deleted.
    NewestSegmentDeleted,
    /// The head (first frame) of the oldest segment flipped.
    OldestSegmentHeadFlipped,
    /// The whole data directory gone (a replaced disk).
    Wiped,
    /// One byte flipped inside the heads log's last run of statements (the tree's right
    /// edge, which every later root is computed from).
    HeadsRunFlipped,
    /// One byte of the heads log's origin changed (what the node signs checkpoints
    /// under).
    HeadsOriginChanged,
    /// The agent's last by-agent index row moved under another agent's name (a flipped
    /// bit in the key): read as is, the agent would seem stated earlier or never, and
    /// this node alone would state it again (another tree than its peers').
    HeadsIndexRowMoved,
    /// One byte of the last round's row changed (the checkpoint a node signs by default).
    HeadsRoundFlipped,
}

impl Place {
    /// Faults in the heads log, which needs its rounds running to have anything stored.
    fn in_heads_log(self) -> bool {
        matches!(
            self,
            Place::HeadsRunFlipped
                | Place::HeadsOriginChanged
                | Place::HeadsIndexRowMoved
                | Place::HeadsRoundFlipped
        )
    }
}

fn newest_segment(data_dir: &Path, oldest: bool) -> PathBuf {
    let mut segments: Vec<PathBuf> = std::fs::read_dir(data_dir.join("raft-log"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "seg"))
        .collect();
    segments.sort();
    if oldest {
        segments.remove(0)
    } else {
        segments.pop().unwrap()
    }
}

fn fault_in(data_dir: &Path, place: Place) {
    let overwrite = |path: &Path, at: u64, bytes: &[u8]| {
        let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
        file.write_all_at(bytes, at).unwrap();
        file.sync_all().unwrap();
    };
    match place {
        Place::RedbDeleted => std::fs::remove_file(data_dir.join("node.redb")).unwrap(),
        Place::RedbGarbage => {
            let path = data_dir.join("node.redb");
            let len = std::fs::metadata(&path).unwrap().len();
            // Every page after the header: the tables' contents.
            let mut at = 4096;
            while at + 64 < len {
                overwrite(&path, at, &[0x5a; 64]);
                at += 4096;
            }
        }
        Place::AppliedIndexChanged => {
            use redb::ReadableTable;
            const META: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("sm_meta");
            let db = redb::Database::create(data_dir.join("node.redb")).unwrap();
            let txn = db.begin_write().unwrap();
            {
                let mut meta = txn.open_table(META).unwrap();
                let mut row = meta
                    .get("last_applied")
                    .unwrap()
                    .expect("applied")
                    .value()
                    .to_vec();
                let at = row
                    .windows(8)
                    .position(|w| w == b"\"index\":")
                    .expect("the index in the row")
                    + 8;
                row[at] = if row[at] == b'9' { b'1' } else { row[at] + 1 };
                meta.insert("last_applied", row.as_slice()).unwrap();
            }
            txn.commit().unwrap();
        }
        Place::WatermarkDeleted => {
            std::fs::remove_file(data_dir.join("raft-log/watermark")).unwrap()
        }
        Place::WatermarkZeroed => {
            std::fs::write(data_dir.join("raft-log/watermark"), vec![0u8; 8192]).unwrap()
        }
        Place::VoteDeleted => std::fs::remove_file(data_dir.join("raft-log/vote.json")).unwrap(),
        Place::VoteGarbage => {
            std::fs::write(data_dir.join("raft-log/vote.json"), b"{\"lea").unwrap()
        }
        Place::PurgedGarbage => {
            let path = data_dir.join("raft-log/purged.json");
            assert!(
                path.exists(),
                "the follower's log was purged behind a snapshot"
            );
            std::fs::write(path, b"\x00\x00garbage").unwrap()
        }
        Place::NewestSegmentDeleted => {
            std::fs::remove_file(newest_segment(data_dir, false)).unwrap()
        }
        Place::OldestSegmentHeadFlipped => {
            let path = newest_segment(data_dir, true);
            let byte = std::fs::read(&path).unwrap()[12];
            overwrite(&path, 12, &[byte ^ 0x10]);
        }
        Place::Wiped => std::fs::remove_dir_all(data_dir).unwrap(),
        Place::HeadsRunFlipped
        | Place::HeadsOriginChanged
        | Place::HeadsIndexRowMoved
        | Place::HeadsRoundFlipped => fault_in_heads_log(data_dir, place),
    }
}

/// Waits (at most 30 s) until the follower has purged its log behind a snapshot of its
/// own: it builds and purges in the background, so on a busy machine the last action's
/// answer can come before the purge marker is written.
async fn follower_purged(data_dir: &Path) {
    let marker = data_dir.join("raft-log/purged.json");
    let started = Instant::now();
    while !marker.exists() {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the follower did not purge its log behind a snapshot within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A fault in the heads log's tables (`Place::in_heads_log`).
fn fault_in_heads_log(data_dir: &Path, place: Place) {
    match place {
        Place::HeadsRunFlipped | Place::HeadsOriginChanged => {
            use lineage_node::store::heads_leaves::HEADS_LEAF_RUNS;
            use lineage_node::store::heads_meta::{HEADS_META, ORIGIN};
            use redb::ReadableTable;
            let db = redb::Database::create(data_dir.join("node.redb")).unwrap();
            let txn = db.begin_write().unwrap();
            if place == Place::HeadsRunFlipped {
                let mut runs = txn.open_table(HEADS_LEAF_RUNS).unwrap();
                let (first, mut row) = {
                    let (first, row) = runs.last().unwrap().expect("a stored run");
                    (first.value(), row.value().to_vec())
                };
                // Past the 32 bytes of seal: inside the packed statements.
                let at = 32 + (row.len() - 32) / 2;
                row[at] ^= 0x04;
                runs.insert(first, row.as_slice()).unwrap();
            } else {
                let mut meta = txn.open_table(HEADS_META).unwrap();
                let mut row = meta
                    .get(ORIGIN)
                    .unwrap()
                    .expect("an origin")
                    .value()
                    .to_vec();
                *row.last_mut().unwrap() ^= 0x01;
                meta.insert(ORIGIN, row.as_slice()).unwrap();
            }
            txn.commit().unwrap();
        }
        Place::HeadsIndexRowMoved => {
            use lineage_node::store::heads_tree::HEADS_BY_AGENT;
            use redb::ReadableTable;
            let db = redb::Database::create(data_dir.join("node.redb")).unwrap();
            let txn = db.begin_write().unwrap();
            {
                let mut by_agent = txn.open_table(HEADS_BY_AGENT).unwrap();
                let (agent, index, seal) = {
                    let (key, seal) = by_agent.last().unwrap().expect("an indexed statement");
                    let (agent, index) = key.value();
                    (agent.to_string(), index, seal.value().to_vec())
                };
                assert_eq!(agent, "bot");
                by_agent.remove((agent.as_str(), index)).unwrap();
                by_agent.insert(("bou", index), seal.as_slice()).unwrap();
            }
            txn.commit().unwrap();
        }
        Place::HeadsRoundFlipped => {
            use lineage_node::store::heads_round_sizes::HEADS_ROUNDS;
            use redb::ReadableTable;
            let db = redb::Database::create(data_dir.join("node.redb")).unwrap();
            let txn = db.begin_write().unwrap();
            {
                let mut rounds = txn.open_table(HEADS_ROUNDS).unwrap();
                let (size, mut row) = {
                    let (size, row) = rounds.last().unwrap().expect("a round");
                    (size.value(), row.value().to_vec())
                };
                row[7] ^= 0x10;
                rounds.insert(size, row.as_slice()).unwrap();
            }
            txn.commit().unwrap();
        }
        _ => unreachable!("{place:?} is not in the heads log"),
    }
}

/// Node `i`'s own heads log: the size of its last round and its leaves up to `size`.
async fn local_heads(cluster: &Cluster, i: usize, size: Option<u64>) -> (u64, Value) {
    let checkpoint = cluster
        .get_text(i, "/v1/transparency/checkpoint?local=true")
        .await;
    let last_round: u64 = checkpoint.lines().nth(1).unwrap().parse().unwrap();
    let size = size.unwrap_or(last_round);
    let (status, leaves) = cluster
        .get(
            i,
            &format!("/v1/transparency/leaves?start=0&end={size}&local=true"),
            "",
        )
        .await;
    assert_eq!(status, 200, "node {i}: {leaves}");
    (last_round, leaves)
}

/// Waits (bounded) until every node's heads log has stated the agent's `records` records,
/// then checks every node holds the same leaves.
async fn heads_converged(cluster: &Cluster, records: u64, what: &str) {
    let start = Instant::now();
    'wait: loop {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{what}: the heads logs did not state all {records} records\n{}",
            cluster.log_tails(30)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut sizes = Vec::new();
        for i in 0..3 {
            let (size, leaves) = local_heads(cluster, i, None).await;
            let stated = leaves["leaves"]
                .as_array()
                .and_then(|l| l.last())
                .map(|l| l["size"].clone());
            if stated != Some(json!(records)) {
                continue 'wait;
            }
            sizes.push(size);
        }
        let size = sizes.into_iter().min().unwrap();
        let first = local_heads(cluster, 0, Some(size)).await.1;
        for i in 1..3 {
            let leaves = local_heads(cluster, i, Some(size)).await.1;
            assert_eq!(
                leaves, first,
                "{what}: node {i}'s heads leaves differ from node 0's"
            );
        }
        return;
    }
}

/// 30 actions; kill -9 a follower; fault one of its files; 30 more actions without it;
/// restart it. It must be repaired (or rebuilt) by the cluster with no operator: every
/// node ends with all 60, agrees, verifies and is ready, and the cluster decides on.
async fn follower_fault(place: Place) {
    let heads_rounds: &[&str] = if place.in_heads_log() {
        &["--heads-interval-ms", "100"]
    } else {
        &[]
    };
    let cluster =
        Cluster::start_with(3, &[&["--snapshot-every", "16"], heads_rounds].concat()).await;
    let public_key = cluster.public_key().await;
    let token = cluster
        .create_agent(
            0,
            "bot",
            json!({"budget": 100_000, "scar_limit": 10, "tools": {"search": {"cost": 1}}}),
        )
        .await;
    for n in 0..30 {
        act(&cluster, n % 3, &token, &format!("p1-{n}")).await;
    }
    let leader = cluster.wait_for_leader(Duration::from_secs(5)).await;
    let follower = (leader + 1) % 3;
    if place.in_heads_log() {
        heads_converged(&cluster, 2 + 2 * 30, &format!("{place:?}, before")).await;
    }
    if place == Place::PurgedGarbage {
        follower_purged(&cluster.data_dir(follower)).await;
    }
    cluster.kill(follower);
    fault_in(&cluster.data_dir(follower), place);
    for n in 0..30 {
        act(&cluster, leader, &token, &format!("p2-{n}")).await;
    }
    let restarted = Instant::now();
    cluster.start_node(follower);
    let log = converged_with(&cluster, 2 + 2 * 60, &format!("{place:?}")).await;
    verify(&log, &public_key);
    cluster.wait_ready(follower, Duration::from_secs(20)).await;
    let next = act(&cluster, follower, &token, "after").await;
    assert_eq!(next["action_id"], "act-61", "{place:?}: {next}");
    if place.in_heads_log() {
        let aside = std::fs::read_dir(cluster.data_dir(follower))
            .unwrap()
            .flatten()
            .any(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with("node.redb.damaged-")
            });
        assert!(aside, "{place:?}: the damaged state file was used");
        heads_converged(&cluster, 2 + 2 * 61, &format!("{place:?}")).await;
    }
    println!(
        "{place:?}: repaired, all 60 on every node, {:.1} s after the restart",
        restarted.elapsed().as_secs_f64()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follower_redb_deleted() {
    follower_fault(Place::RedbDeleted).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follower_redb_overwritten_with_garbage() {
    follower_fault(Place::RedbGarbage).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follower_watermark_deleted() {
    follower_fault(Place::WatermarkDeleted).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follower_watermark_zeroed() {
    follower_fault(Place::WatermarkZeroed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follower_vote_deleted() {
    follower_fault(Place::VoteDeleted).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follower_newest_segment_deleted() {
    follower_fault(Place::NewestSegmentDeleted).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follower_oldest_segment_head_flipped() {
    follower_fault(Place::OldestSegmentHeadFlipped).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follower_wiped() {
    follower_fault(Place::Wiped).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follower_vote_overwritten_with_garbage() {
    follower_fault(Place::VoteGarbage).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follower_purge_marker_overwritten_with_garbage() {
    follower_fault(Place::PurgedGarbage).await;
}

/// The damaged node is the old leader, without early acknowledgement (so it kept a
/// committed vote for itself), and it comes back first: it must not lead its old term on
/// a cut log (openraft would restore it as leader, elections off or not). Then the
/// lagging follower; neither may serve a history without the 60. Then the intact F3.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_former_leader_without_early_ack_does_not_lead_again() {
    let cluster = Cluster::start_with(3, &["--leader-early-ack", "false"]).await;
    let History {
        public_key,
        token,
        leader,
        f2,
        f3,
    } = acknowledged_by_two(&cluster).await;
    damage(&cluster.data_dir(leader), Damage::FlipAt(0));
    cluster.start_node(leader);
    tokio::time::sleep(Duration::from_millis(500)).await;
    cluster.start_node(f2);
    let quiet = Instant::now();
    while quiet.elapsed() < Duration::from_secs(3) {
        for node in [leader, f2] {
            let (status, body) = cluster.get(node, "/v1/agents/bot", &token).await;
            if status == 200 {
                assert_eq!(
                    body["spent"],
                    (BEFORE + AFTER) as u64,
                    "node {} served a history without acknowledged decisions: {body}\n{}",
                    node + 1,
                    cluster.log_tails(30)
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    cluster.start_node(f3);
    let log = converged_with(&cluster, 2 + 2 * (BEFORE + AFTER), "damaged leader").await;
    verify(&log, &public_key);
    let next = act(&cluster, leader, &token, "after").await;
    assert_eq!(
        next["action_id"],
        format!("act-{}", BEFORE + AFTER + 1),
        "{next}"
    );
}

/// A cluster's only voter has no peer to repair it: losing acknowledged entries makes it
/// stop with the reason and the procedure (never serve a shorter history), while a lost
/// vote, harmless with no one to vote against, does not stop it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_node_cannot_be_repaired_and_says_what_to_do() {
    let cluster = Cluster::start(1).await;
    let token = cluster
        .create_agent(
            0,
            "bot",
            json!({"budget": 100, "scar_limit": 10, "tools": {"search": {"cost": 1}}}),
        )
        .await;
    for n in 0..AFTER {
        act(&cluster, 0, &token, &format!("p2-{n}")).await;
    }
    cluster.kill(0);
    std::fs::remove_file(cluster.data_dir(0).join("raft-log/vote.json")).unwrap();
    cluster.start_node(0);
    cluster.wait_for_leader(Duration::from_secs(15)).await;
    let (status, body) = cluster.get(0, "/v1/agents/bot", &token).await;
    assert_eq!(
        (status, body["spent"].as_u64()),
        (200, Some(AFTER as u64)),
        "{body}"
    );

    cluster.kill(0);
    damage(&cluster.data_dir(0), Damage::FlipAt(AFTER / 2));
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_lineage-node"))
        .args(["run", "--id", "1", "--listen", &cluster.addrs[0], "--peers"])
        .arg(format!("1={}", cluster.addrs[0]))
        .arg("--data-dir")
        .arg(cluster.data_dir(0))
        .arg("--keys-dir")
        .arg(cluster.dir.path().join("keys"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(stderr.contains("only voter"), "{stderr}");
    assert!(stderr.contains("repair-floor.json"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follower_applied_index_changed_in_redb() {
    follower_fault(Place::AppliedIndexChanged).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follower_heads_run_flipped() {
    follower_fault(Place::HeadsRunFlipped).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follower_heads_origin_changed() {
    follower_fault(Place::HeadsOriginChanged).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follower_heads_index_row_moved() {
    follower_fault(Place::HeadsIndexRowMoved).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follower_heads_round_flipped() {
    follower_fault(Place::HeadsRoundFlipped).await;
}
