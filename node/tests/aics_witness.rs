//! Interoperability with an independent implementation of C2SP tlog-witness:
//! `aics-witness` 0.1.0 (Python, from PyPI; `.ci/run` installs it pinned in a Python 3.12
//! venv and requires this test). It runs as a real process beside our `lineage-witness`:
//! - our checkpointer gets both to cosign the first checkpoint, its growth, and a long
//!   consistency proof after a gap, and a fresh checkpointer resyncs from aics's 409;
//! - a node stores a witnessed checkpoint only with both (quorum 2 of 2), and our
//!   verifier accepts the result;
//! - aics's own verifier (`aics-tlog verify-checkpoint`) accepts our log signature and
//!   our witness's cosignature, with a quorum of 2.

#[path = "cluster/util.rs"]
mod util;
#[path = "cluster/witness.rs"]
mod witness;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lineage_checkpointer::checkpointer::{Checkpointer, RoundReport, WitnessTarget};
use serde_json::json;
use util::{free_port, program_or_skip, Cluster};
use witness::{Witness, ORIGIN};

/// An `aics-witness` process.
struct Aics {
    config: PathBuf,
    addr: String,
    vkey: String,
    child: Option<Child>,
}

impl Aics {
    fn init(program: &Path, dir: &Path) -> Aics {
        std::fs::create_dir_all(dir).expect("aics dir");
        let addr = format!("127.0.0.1:{}", free_port());
        let config = dir.join("witness.json");
        let output = Command::new(program)
            .arg("init")
            .arg("--config")
            .arg(&config)
            .args(["--name", "aics.test/w1", "--listen", &addr])
            .args(["--db", "witness.db", "--key-file", "witness.key"])
            .output()
            .expect("aics-witness init");
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success(),
            "aics-witness init: {stdout}{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let vkey = stdout
            .lines()
            .rev()
            .find(|l| l.starts_with("aics.test/w1+"))
            .unwrap_or_else(|| panic!("no vkey from aics-witness init: {stdout}"))
            .trim()
            .to_string();
        Aics {
            config,
            addr,
            vkey,
            child: None,
        }
    }

    fn trust_and_serve(&mut self, program: &Path, log_vkey: &str) {
        let output = Command::new(program)
            .arg("add-log")
            .arg("--config")
            .arg(&self.config)
            .args(["--origin", ORIGIN, "--vkey", log_vkey])
            .output()
            .expect("aics-witness add-log");
        assert!(
            output.status.success(),
            "aics-witness add-log: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let log = std::fs::File::create(self.config.with_file_name("serve.log")).expect("log");
        let child = Command::new(program)
            .arg("serve")
            .arg("--config")
            .arg(&self.config)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("aics-witness serve");
        self.child = Some(child);
    }

    fn target(&self) -> WitnessTarget {
        WitnessTarget::parse(&format!("http://{}={}", self.addr, self.vkey)).expect("target")
    }

    async fn wait_up(&self) {
        let start = Instant::now();
        while tokio::net::TcpStream::connect(&self.addr).await.is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "aics-witness not up: {}",
                std::fs::read_to_string(self.config.with_file_name("serve.log"))
                    .unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Aics {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// New agents, each acting once: each adds a statement to the next heads round.
async fn new_agents(cluster: &Cluster, prefix: &str, n: usize) {
    for a in 0..n {
        let agent = format!("{prefix}{a}");
        let token = cluster
            .create_agent(
                0,
                &agent,
                json!({"budget": 100, "scar_limit": 10, "tools": {"search": {"cost": 1}}}),
            )
            .await;
        let (status, answer) = cluster
            .post_until_served(
                0,
                &format!("/v1/agents/{agent}/actions"),
                &token,
                json!({"tool": "search"}),
                &format!("{agent}-1"),
            )
            .await;
        assert_eq!(status, 200, "{answer}");
    }
}

/// Rounds until both witnesses cosigned a checkpoint larger than `above` and it was
/// stored (bounded); returns that round's report.
async fn cosigned_by_both(checkpointer: &Checkpointer, above: u64, what: &str) -> RoundReport {
    let start = Instant::now();
    loop {
        let report = checkpointer.round().await.expect("round");
        assert!(report.alarms.is_empty(), "{what}: {report:?}");
        if report.size > above && report.cosigned_by.len() == 2 && report.stored {
            return report;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{what}: not cosigned by both within 30 s; last round {report:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// With only one of the two cosignatures, the node (quorum 2) refuses the note.
async fn assert_refused_with_our_line_removed(cluster: &Cluster, note: &str) {
    let without_ours: String = note
        .split_inclusive('\n')
        .filter(|line| !line.starts_with("\u{2014} ours.test/w1 "))
        .collect();
    assert_ne!(without_ours, note, "our witness's line was in the note");
    let reply = cluster
        .http
        .post(cluster.url(0, "/v1/transparency/checkpoint/witnessed"))
        .bearer_auth(cluster.admin.trim())
        .body(without_ours)
        .send()
        .await
        .expect("post");
    let status = reply.status().as_u16();
    let body = reply.text().await.unwrap_or_default();
    assert_eq!(status, 400, "one cosignature of two was stored: {body}");
    assert!(body.contains("1 of the required 2"), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aics_witness_and_ours_cosign_every_checkpoint_and_verify_each_other() {
    let Some(aics_bin) = program_or_skip(&["aics-witness"], "LINEAGE_REQUIRE_AICS") else {
        return;
    };
    let aics_tlog = aics_bin.with_file_name("aics-tlog");
    let scratch = tempfile::tempdir().expect("tempdir");
    let mut aics = Aics::init(&aics_bin, &scratch.path().join("aics"));
    // Our witness's key first: the nodes must know both vkeys when they start.
    let ours_dir = scratch.path().join("ours");
    let ours_vkey = witness::run_ok(
        &witness::sibling_binary("lineage-witness"),
        &[
            "--data-dir",
            ours_dir.to_str().expect("utf-8"),
            "--name",
            "ours.test/w1",
            "keygen",
        ],
    );
    let cluster = Cluster::start_with(
        1,
        &[
            "--heads-interval-ms",
            "100",
            "--witness-key",
            &aics.vkey,
            "--witness-key",
            &ours_vkey,
            "--witness-quorum",
            "2",
        ],
    )
    .await;
    cluster.wait_for_leader(Duration::from_secs(20)).await;
    let log_vkey = cluster
        .get_text(0, "/v1/transparency/vkey")
        .await
        .trim()
        .to_string();
    aics.trust_and_serve(&aics_bin, &log_vkey);
    let ours = Witness::with_key(ours_dir, "ours.test/w1", &ours_vkey, &log_vkey);
    aics.wait_up().await;
    ours.wait_up().await;
    let witnesses = vec![aics.target(), ours.target()];

    // The first checkpoint (old 0), growth, and a long proof after a gap.
    new_agents(&cluster, "first", 1).await;
    let dir = cluster.dir.path().to_path_buf();
    let checkpointer =
        witness::open_checkpointer(&cluster, &dir.join("cp1"), witnesses.clone(), 2).await;
    let first = cosigned_by_both(&checkpointer, 0, "the first checkpoint").await;
    new_agents(&cluster, "grow", 2).await;
    let grown = cosigned_by_both(&checkpointer, first.size, "growth").await;
    new_agents(&cluster, "gap", 24).await;
    let after_gap = cosigned_by_both(&checkpointer, grown.size, "a long proof after a gap").await;
    println!(
        "cosigned by aics-witness and ours at sizes {}, {}, {}",
        first.size, grown.size, after_gap.size
    );
    drop(checkpointer);

    // A fresh checkpointer asks from 0: aics answers 409 with its size, and it resyncs.
    new_agents(&cluster, "fresh", 1).await;
    let fresh = witness::open_checkpointer(&cluster, &dir.join("cp2"), witnesses, 2).await;
    cosigned_by_both(&fresh, after_gap.size, "a fresh checkpointer's resync").await;

    // What the node stored carries both cosignatures; our verifier and aics's accept it.
    let note = cluster
        .get_text(0, "/v1/transparency/checkpoint/witnessed")
        .await;
    let witnessed = lineage_core::heads::verify_witnessed(
        &note,
        &log_vkey,
        &[aics.vkey.clone(), ours_vkey.clone()],
        2,
    )
    .unwrap_or_else(|e| panic!("our verifier: {e}: {note}"));
    assert_eq!(witnessed.witnesses.len(), 2, "{note}");
    assert_refused_with_our_line_removed(&cluster, &note).await;
    let note_file = scratch.path().join("note.txt");
    std::fs::write(&note_file, &note).expect("write note");
    let output = Command::new(&aics_tlog)
        .arg("verify-checkpoint")
        .arg("--note")
        .arg(&note_file)
        .args(["--log-key", &log_vkey])
        .args(["--witness-key", &aics.vkey, "--witness-key", &ours_vkey])
        .args(["--quorum", "2"])
        .output()
        .expect("aics-tlog");
    assert!(
        output.status.success(),
        "aics-tlog verify-checkpoint refused our note: {}{}\n{note}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}
