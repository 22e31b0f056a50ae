//! A `lineage-witness` process for tests that drive witnesses themselves (included with
//! `#[path]`, beside `util.rs`).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lineage_checkpointer::checkpointer::{Checkpointer, WitnessTarget};
use lineage_checkpointer::checkpointer_metrics::Metrics;
use lineage_checkpointer::cluster_client::ClusterClient;

use super::util::{free_port, Cluster};

/// A checkpointer with its state in `dir`, driven by the test's own `round()` calls.
pub async fn open_checkpointer(
    cluster: &Cluster,
    dir: &Path,
    witnesses: Vec<WitnessTarget>,
    quorum: usize,
) -> Checkpointer {
    let urls = cluster
        .addrs
        .iter()
        .map(|a| format!("http://{a}"))
        .collect();
    let client = ClusterClient::new(urls, Some(cluster.admin.clone())).expect("client");
    Checkpointer::open(
        dir,
        client,
        witnesses,
        quorum,
        None,
        Metrics::new(1.0).expect("metrics"),
    )
    .await
    .expect("open checkpointer")
}

/// The origin of a test cluster's heads log (`--cluster-name` default).
pub const ORIGIN: &str = "lineage.local/cluster";

pub fn sibling_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test exe");
    let dir = exe.parent().and_then(Path::parent).expect("target dir");
    let path = dir.join(name);
    assert!(
        path.is_file(),
        "{} is missing: run `cargo build --workspace` (or `cargo test --workspace`) first",
        path.display()
    );
    path
}

pub fn run_ok(program: &Path, args: &[&str]) -> String {
    let out = Command::new(program).args(args).output().expect("run");
    assert!(
        out.status.success(),
        "{} {args:?}: {}",
        program.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// A `lineage-witness` process trusting the cluster's log.
pub struct Witness {
    pub dir: PathBuf,
    pub name: String,
    pub addr: String,
    pub vkey: String,
    pub log_vkey: String,
    child: Option<Child>,
}

impl Witness {
    /// Makes its key, trusts the log and starts.
    pub fn new(dir: PathBuf, name: &str, log_vkey: &str) -> Witness {
        let bin = sibling_binary("lineage-witness");
        let d = dir.to_str().expect("utf-8 path").to_string();
        let vkey = run_ok(&bin, &["--data-dir", &d, "--name", name, "keygen"]);
        Witness::with_key(dir, name, &vkey, log_vkey)
    }

    /// One whose key `keygen` already made in `dir` (its vkey is `vkey`).
    pub fn with_key(dir: PathBuf, name: &str, vkey: &str, log_vkey: &str) -> Witness {
        let vkey = vkey.to_string();
        let mut witness = Witness {
            dir,
            name: name.into(),
            addr: format!("127.0.0.1:{}", free_port()),
            vkey,
            log_vkey: log_vkey.into(),
            child: None,
        };
        witness.trust_log();
        witness.start();
        witness
    }

    pub fn trust_log(&self) {
        let d = self.dir.to_str().expect("utf-8 path");
        run_ok(
            &sibling_binary("lineage-witness"),
            &[
                "--data-dir",
                d,
                "--name",
                &self.name,
                "add-log",
                "--origin",
                ORIGIN,
                "--vkey",
                &self.log_vkey,
            ],
        );
    }

    pub fn start(&mut self) {
        let child = Command::new(sibling_binary("lineage-witness"))
            .arg("--data-dir")
            .arg(&self.dir)
            .args(["--name", &self.name, "--listen", &self.addr])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start lineage-witness");
        self.child = Some(child);
    }

    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Loses everything but its key, as a witness restored without its state would.
    pub fn lose_state(&mut self) {
        self.stop();
        std::fs::remove_file(self.dir.join("witness.redb")).expect("remove the witness db");
        self.trust_log();
        self.start();
    }

    pub fn target(&self) -> WitnessTarget {
        WitnessTarget::parse(&format!("http://{}={}", self.addr, self.vkey)).expect("target")
    }

    pub async fn wait_up(&self) {
        let start = Instant::now();
        while tokio::net::TcpStream::connect(&self.addr).await.is_err() {
            assert!(start.elapsed() < Duration::from_secs(20), "witness not up");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Witness {
    fn drop(&mut self) {
        self.stop();
    }
}
