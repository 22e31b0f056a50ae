//! Power loss, for real: each node keeps its data on its own ext4 image on a loop device,
//! and a power cut is EXT4_IOC_SHUTDOWN without flushing the journal (unsynced bytes are
//! gone) followed by kill -9 and a remount. `kill -9` alone never loses page-cache data,
//! so this is the only test that sees lost and torn writes. A torn unacknowledged batch is
//! added by writing a partial frame after the frames of each node's last segment.
//!
//! Every decision a client heard as allowed must be in every replica's log afterwards; the
//! replicas agree and verify; no node is left under repair.

#[path = "cluster/loop_disk.rs"]
mod loop_disk;
#[path = "cluster/util.rs"]
mod util;

use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use loop_disk::LoopDisk;
use serde_json::json;
use util::{actions_by_key, verify_log as verify, Cluster};

const CLIENTS: usize = 4;
/// Requests each client sends at most (the load also stops at the power cut).
const REQUESTS_PER_CLIENT: usize = 400;

/// Acknowledged allowed decisions: idempotency key → action id.
type Acked = Arc<Mutex<BTreeMap<String, String>>>;

/// Clients sending actions through every node until `stop`, each with its own key, no
/// retries: a request that fails is simply not acknowledged.
fn start_load(
    cluster: &Arc<Cluster>,
    token: &str,
    stop: &Arc<AtomicBool>,
    acked: &Acked,
    tag: &str,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..CLIENTS)
        .map(|c| {
            let (cluster, token, stop, acked) = (
                cluster.clone(),
                token.to_string(),
                stop.clone(),
                acked.clone(),
            );
            let tag = tag.to_string();
            tokio::spawn(async move {
                for n in 0..REQUESTS_PER_CLIENT {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let key = format!("{tag}-{c}-{n}");
                    let (status, body) = cluster
                        .post(
                            (c + n) % 3,
                            "/v1/agents/bot/actions",
                            &token,
                            json!({"tool": "search", "input": {"k": key}}),
                            Some(&key),
                        )
                        .await;
                    if status == 200 && body["decision"] == "allowed" {
                        let id = body["action_id"].as_str().unwrap_or_default().to_string();
                        acked.lock().unwrap().insert(key, id);
                    } else if status == 0 || status >= 500 {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
            })
        })
        .collect()
}

/// Writes a torn, never-acknowledged frame after the frames of each segment's end: a
/// header announcing 300 bytes and only part of them.
fn tear_after_last_frame(data_dir: &Path) {
    let log_dir = data_dir.join("raft-log");
    let mut segments: Vec<_> = std::fs::read_dir(&log_dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "seg"))
        .collect();
    segments.sort();
    let Some(last) = segments.last() else { return };
    let bytes = std::fs::read(last).unwrap();
    let mut offset = 0;
    while offset + 8 <= bytes.len() {
        let len = u32::from_le_bytes(bytes[offset..offset + 4].try_into().unwrap()) as usize;
        if len == 0 || offset + 8 + len > bytes.len() {
            break;
        }
        offset += 8 + len;
    }
    let mut torn = vec![0u8; 8 + 120];
    torn[0..4].copy_from_slice(&300u32.to_le_bytes());
    torn[4..8].copy_from_slice(&0xdead_beefu32.to_le_bytes());
    torn[8..].fill(b'x');
    let file = std::fs::OpenOptions::new().write(true).open(last).unwrap();
    file.write_all_at(&torn, offset as u64).unwrap();
    file.sync_all().unwrap();
}

async fn power_cycle(cluster: &Cluster, disks: &[LoopDisk], nodes: &[usize]) {
    for &i in nodes {
        disks[i].power_off().unwrap();
    }
    for &i in nodes {
        cluster.kill(i);
    }
    for &i in nodes {
        disks[i].power_on().unwrap();
        tear_after_last_frame(&cluster.data_dir(i));
    }
    for &i in nodes {
        cluster.start_node(i);
    }
}

/// After the faults: every acknowledged decision is on every replica, they agree and
/// verify, and every node is ready (none left under repair).
async fn check_nothing_acknowledged_was_lost(cluster: &Cluster, acked: &Acked, public_key: &str) {
    let acked = acked.lock().unwrap().clone();
    assert!(!acked.is_empty(), "the load got no answers at all");
    // Right after every node restarts, the replicas can agree on a prefix their commit
    // hints reach before the new leader commits the rest: wait (bounded) until they
    // agree on a log with every acknowledged decision, or the last agreed log is judged.
    let settling = std::time::Instant::now();
    let (log, allowed) = loop {
        let log = cluster.converged_log("bot", Duration::from_secs(30)).await;
        let allowed = actions_by_key(&log);
        let complete = acked.iter().all(|(key, id)| allowed.get(key) == Some(id));
        if complete || settling.elapsed() > Duration::from_secs(30) {
            break (log, allowed);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    verify(&log, public_key);
    for (key, id) in &acked {
        assert_eq!(
            allowed.get(key),
            Some(id),
            "acknowledged {key} ({id}) is not in the log"
        );
    }
    for node in 0..3 {
        cluster.wait_ready(node, Duration::from_secs(20)).await;
    }
    println!(
        "{} acknowledged decisions, all in the log of {} records on every node",
        acked.len(),
        log.len()
    );
}

/// Node `i`'s log says it cut the torn frame as unacknowledged, `cuts` times, and never
/// took itself for damaged (no repair floor: a power cut loses only unacknowledged bytes).
fn assert_torn_writes_cut(cluster: &Cluster, i: usize, cuts: usize) {
    let text =
        std::fs::read_to_string(cluster.dir.path().join(format!("node-{}.log", i + 1))).unwrap();
    assert_eq!(
        text.matches("cutting an unacknowledged torn write").count(),
        cuts,
        "node {}: {}",
        i + 1,
        cluster.log_tails(20)
    );
    assert!(
        !text.contains("may have lost acknowledged entries"),
        "node {}",
        i + 1
    );
    // Not asserted (it happens only when the cut falls during a growing commit's fsync),
    // but said: the state file shorter than its header states, extended for redb's own
    // recovery (`lineage_redb_header`), where before the node could not start again.
    let extended = text.matches("extended for redb's recovery").count();
    if extended > 0 {
        println!(
            "node {}: state file extended after a cut {extended} time(s)",
            i + 1
        );
    }
    // Nor said here: the state file taken for damaged and rebuilt (safe, but a cut file
    // redb recovers by itself should not be; the header checks must not misjudge one).
    let moved_aside = text
        .matches("state machine file corrupted: moved aside")
        .count();
    if moved_aside > 0 {
        println!(
            "node {}: state file moved aside after a cut {moved_aside} time(s)",
            i + 1
        );
    }
}

async fn disks_and_cluster(tmp: &Path) -> Option<(Vec<LoopDisk>, Arc<Cluster>)> {
    let disks = loop_disk::three_disks(tmp, 96)?;
    let dirs = disks.iter().map(|d| d.dir.join("data")).collect();
    let cluster = Cluster::start_on(3, &["--disk-reserve-mb", "4"], Some(dirs)).await;
    Some((disks, Arc::new(cluster)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_power_cut_of_every_node_under_load_loses_no_acknowledged_decision() {
    let tmp = tempfile::tempdir().unwrap();
    let Some((disks, cluster)) = disks_and_cluster(tmp.path()).await else {
        return;
    };
    let public_key = cluster.public_key().await;
    let token = cluster
        .create_agent(
            0,
            "bot",
            json!({"budget": 1_000_000, "scar_limit": 10, "tools": {"search": {"cost": 1}}}),
        )
        .await;
    let acked: Acked = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let load = start_load(&cluster, &token, &stop, &acked, "a");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    power_cycle(&cluster, &disks, &[0, 1, 2]).await;
    stop.store(true, Ordering::Relaxed);
    for task in load {
        task.await.unwrap();
    }
    cluster.wait_for_leader(Duration::from_secs(20)).await;
    check_nothing_acknowledged_was_lost(&cluster, &acked, &public_key).await;
    for i in 0..3 {
        assert_torn_writes_cut(&cluster, i, 1);
    }
    drop(cluster);
    drop(disks);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_power_cut_of_the_leader_under_load_loses_no_acknowledged_decision() {
    let tmp = tempfile::tempdir().unwrap();
    let Some((disks, cluster)) = disks_and_cluster(tmp.path()).await else {
        return;
    };
    let public_key = cluster.public_key().await;
    let token = cluster
        .create_agent(
            0,
            "bot",
            json!({"budget": 1_000_000, "scar_limit": 10, "tools": {"search": {"cost": 1}}}),
        )
        .await;
    let acked: Acked = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let load = start_load(&cluster, &token, &stop, &acked, "b");
    let mut cycled = [0; 3];
    for _ in 0..2 {
        tokio::time::sleep(Duration::from_millis(1000)).await;
        let leader = cluster.wait_for_leader(Duration::from_secs(20)).await;
        power_cycle(&cluster, &disks, &[leader]).await;
        cycled[leader] += 1;
    }
    tokio::time::sleep(Duration::from_millis(1000)).await;
    stop.store(true, Ordering::Relaxed);
    for task in load {
        task.await.unwrap();
    }
    check_nothing_acknowledged_was_lost(&cluster, &acked, &public_key).await;
    for (i, cuts) in cycled.into_iter().enumerate() {
        assert_torn_writes_cut(&cluster, i, cuts);
    }
    drop(cluster);
    drop(disks);
}
