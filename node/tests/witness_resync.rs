//! How the checkpointer reads a witness's 409 (issue 21), against a real cluster and real
//! `lineage-witness` processes, with the checkpointer's rounds driven in-process:
//! - the witness holds our size but we hold no cosignature of it (our state was lost):
//!   resend once at that size and store the cosignature;
//! - the witness lost its state (its 409 names a size below what it cosigned for us): a
//!   witness alarm;
//! - the witness is ahead with a checkpoint the log signed that the cluster does not
//!   serve: a log alarm (split view), with both notes as evidence.
//!
//! A size a 409 names is never stored, so "already cosigned" counts only cosignatures the
//! checkpointer holds.

#[path = "cluster/util.rs"]
mod util;
#[path = "cluster/witness.rs"]
mod witness;

use std::path::Path;
use std::time::{Duration, Instant};

use lineage_checkpointer::checkpointer::{Checkpointer, RoundReport};
use lineage_core::transparency::Checkpoint;
use lineage_core::AuditKey;
use serde_json::json;
use util::Cluster;
use witness::{Witness, ORIGIN};

async fn checkpointer(cluster: &Cluster, dir: &Path, witness: &Witness) -> Checkpointer {
    witness::open_checkpointer(cluster, dir, vec![witness.target()], 1).await
}

/// Rounds until `done` holds of one (bounded); returns that round's report.
async fn round_until(
    checkpointer: &Checkpointer,
    what: &str,
    done: impl Fn(&RoundReport) -> bool,
) -> RoundReport {
    let start = Instant::now();
    loop {
        let report = checkpointer.round().await.expect("round");
        if done(&report) {
            return report;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{what}: not within 30 s; last round {report:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn act(cluster: &Cluster, token: &str, tag: &str) {
    for n in 0..3 {
        let (status, answer) = cluster
            .post_until_served(
                0,
                "/v1/agents/bot/actions",
                token,
                json!({"tool": "search"}),
                &format!("{tag}-{n}"),
            )
            .await;
        assert_eq!(status, 200, "{answer}");
    }
}

async fn setup() -> (Cluster, String, String) {
    let cluster = Cluster::start_with(1, &["--heads-interval-ms", "100"]).await;
    cluster.wait_for_leader(Duration::from_secs(20)).await;
    let token = cluster
        .create_agent(
            0,
            "bot",
            json!({"budget": 1000, "scar_limit": 10, "tools": {"search": {"cost": 1}}}),
        )
        .await;
    act(&cluster, &token, "first").await;
    let vkey = cluster.get_text(0, "/v1/transparency/vkey").await;
    let vkey = vkey.trim().to_string();
    settled_checkpoint(&cluster, &vkey).await;
    (cluster, token, vkey)
}

/// The cluster's checkpoint once a heads round has stated `bot`'s whole log (rounds run
/// every 100 ms, in the background: one may have stated an earlier head, and the round
/// stating the last action may not have run yet). No write follows in these tests, so
/// the checkpoint stays this size. Bounded at 20 s.
async fn settled_checkpoint(cluster: &Cluster, vkey: &str) -> Checkpoint {
    let log = cluster.converged_log("bot", Duration::from_secs(10)).await;
    let start = Instant::now();
    loop {
        let note = cluster.get_text(0, "/v1/transparency/checkpoint").await;
        let checkpoint = Checkpoint::verify(&note, vkey).expect("the cluster's checkpoint");
        // Before the first round (size 0) there is no statement: 404, read as no proof.
        let url = cluster.url(
            0,
            &format!("/v1/agents/bot/head-proof?size={}", checkpoint.size),
        );
        let proof: serde_json::Value = match cluster.http.get(url).send().await {
            Ok(reply) => reply.json().await.unwrap_or_default(),
            Err(_) => serde_json::Value::Null,
        };
        if proof["statement"]["size"].as_u64() == Some(log.len() as u64) {
            return checkpoint;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "no heads round stated bot's {} records within 20 s: {proof}",
            log.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_checkpointer_state_is_resent_once_and_a_witness_that_lost_state_alarms() {
    let (cluster, token, log_vkey) = setup().await;
    let dir = cluster.dir.path().to_path_buf();
    let mut witness = Witness::new(dir.join("w1"), "w1.test", &log_vkey);
    witness.wait_up().await;

    let first = checkpointer(&cluster, &dir.join("cp1"), &witness).await;
    let cosigned = round_until(&first, "a first cosignature", |r| {
        r.size > 0 && r.cosigned_by.len() == 1 && r.stored
    })
    .await;
    drop(first);

    // A checkpointer whose state was lost asks from size 0; the witness answers 409
    // with our very size. It asks once more at that size and gets its own cosignature.
    let fresh = checkpointer(&cluster, &dir.join("cp2"), &witness).await;
    let report = fresh.round().await.expect("round");
    assert_eq!(
        report.size, cosigned.size,
        "the cluster did not move: {report:?}"
    );
    assert_eq!(
        report.cosigned_by,
        vec!["w1.test".to_string()],
        "a 409 at our size must be resent, not counted as cosigned: {report:?}"
    );
    assert!(report.alarms.is_empty(), "{report:?}");
    assert!(
        report.stored,
        "the new cosignature was stored in the cluster: {report:?}"
    );

    // The witness loses its state, the log grows: its 409 names a size below what it
    // cosigned for us.
    witness.lose_state();
    witness.wait_up().await;
    act(&cluster, &token, "second").await;
    let alarmed = round_until(&fresh, "the lost-state alarm", |r| !r.alarms.is_empty()).await;
    assert!(
        alarmed
            .alarms
            .iter()
            .any(|a| a.starts_with("witness_lost_state")),
        "{alarmed:?}"
    );
    assert!(alarmed.cosigned_by.is_empty(), "{alarmed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_witness_ahead_with_a_longer_log_signed_checkpoint_raises_the_log_alarm() {
    let (cluster, _token, log_vkey) = setup().await;
    let dir = cluster.dir.path().to_path_buf();
    let witness = Witness::new(dir.join("w2"), "w2.test", &log_vkey);
    witness.wait_up().await;

    // Someone with the log's key signs a longer checkpoint the cluster never served,
    // and shows it to this witness first.
    let served = settled_checkpoint(&cluster, &log_vkey).await;
    let key = AuditKey::load(dir.join("keys/audit.key")).expect("audit key");
    let longer = Checkpoint {
        origin: ORIGIN.into(),
        size: served.size + 5,
        root: [9; 32],
    };
    let reply = reqwest::Client::new()
        .post(format!("http://{}/add-checkpoint", witness.addr))
        .body(format!("old 0\n\n{}", longer.sign(&key).expect("sign")))
        .send()
        .await
        .expect("submit");
    assert_eq!(reply.status().as_u16(), 200, "the witness cosigns from 0");

    let checkpointer = checkpointer(&cluster, &dir.join("cp"), &witness).await;
    let report = round_until(&checkpointer, "the split-view alarm", |r| {
        !r.alarms.is_empty()
    })
    .await;
    assert!(
        report
            .alarms
            .iter()
            .any(|a| a.starts_with("log_split_view")),
        "{report:?}"
    );
    assert!(report.cosigned_by.is_empty(), "{report:?}");
    // The evidence holds both notes.
    let evidence: Vec<String> = std::fs::read_dir(dir.join("cp/evidence"))
        .expect("evidence dir")
        .filter_map(|e| std::fs::read_to_string(e.ok()?.path()).ok())
        .collect();
    assert!(
        evidence
            .iter()
            .any(|e| e.contains(&format!("{ORIGIN}\n{}\n", longer.size))
                && e.contains(&format!("{ORIGIN}\n{}\n", served.size))),
        "{evidence:?}"
    );
}
