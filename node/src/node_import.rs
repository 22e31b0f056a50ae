//! `lineage-node import --from DIR`: moves a reference guard's data directory in through
//! Raft, never around it. With `--url`, through a running cluster's API (as `lineage
//! import`). Without, through this node's own Raft: the node is started on its data
//! directory as a single-node cluster on a loopback port, the directory is imported
//! through its API, and the node is stopped gracefully. Nothing is written to redb
//! offline: every record goes through apply's chain checks like any other.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lineage_client::import_cli;
use lineage_client::ops_cli::Target;

use lineage_node::keys;

/// How long the node may take to start and lead its single-node cluster.
const READY_WITHIN: Duration = Duration::from_secs(120);
/// How long the node may take to stop after SIGTERM.
const STOP_WITHIN: Duration = Duration::from_secs(60);
/// How long one API call of the import may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// What the import reads and where it writes.
pub struct ImportTarget {
    /// The reference guard's data directory.
    pub from: PathBuf,
    /// A running cluster's node URLs: import through its API.
    pub urls: Vec<String>,
    /// With `urls`: the admin token's file.
    pub token_file: Option<PathBuf>,
    /// Without `urls`: this node's data directory and keys.
    pub data_dir: Option<PathBuf>,
    pub keys_dir: Option<PathBuf>,
}

/// Imports and reports on stdout; `Err` when any file was refused or the node failed.
pub fn import(target: &ImportTarget) -> Result<(), String> {
    if !target.urls.is_empty() {
        return import_through(&target.urls, target.token_file.clone(), &target.from);
    }
    let (Some(data_dir), Some(keys_dir)) = (&target.data_dir, &target.keys_dir) else {
        return Err(
            "give --data-dir and --keys-dir (this node's own Raft), or --url (a running cluster)"
                .into(),
        );
    };
    let node = LocalNode::start(data_dir, keys_dir)?;
    let result = node.wait_ready().and_then(|()| {
        import_through(
            &[node.url()],
            Some(keys_dir.join(keys::ADMIN_TOKEN)),
            &target.from,
        )
    });
    let stopped = node.stop();
    result.and(stopped)
}

fn import_through(urls: &[String], token_file: Option<PathBuf>, from: &Path) -> Result<(), String> {
    let target = Target {
        urls: urls.to_vec(),
        token_file,
        ca: None,
        timeout: CALL_TIMEOUT,
        json: false,
    };
    let mut out = std::io::stdout();
    let result = import_cli::import(&target, from, &mut out);
    let _ = out.flush();
    result.map_err(|failure| failure.message().to_string())
}

/// This node, run as a child process on a loopback port for the import's duration.
struct LocalNode {
    child: Child,
    addr: String,
}

impl LocalNode {
    fn start(data_dir: &Path, keys_dir: &Path) -> Result<LocalNode, String> {
        let exe =
            std::env::current_exe().map_err(|e| format!("cannot find own executable: {e}"))?;
        // The port is free when asked; another process could take it before the node
        // binds, and then the node fails to start with a clear message.
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| format!("no loopback port: {e}"))?
            .to_string();
        let child = Command::new(exe)
            .args(["run", "--id", "1", "--listen", &addr, "--peers"])
            .arg(format!("1={addr}"))
            .arg("--data-dir")
            .arg(data_dir)
            .arg("--keys-dir")
            .arg(keys_dir)
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start the node: {e}"))?;
        eprintln!("started this node on {addr} to import through its Raft");
        Ok(LocalNode { child, addr })
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Waits until the node leads its cluster and has applied its log.
    fn wait_ready(&self) -> Result<(), String> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("runtime: {e}"))?;
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(2))
            .build()
            .map_err(|e| e.to_string())?;
        let url = format!("{}/readyz", self.url());
        let started = Instant::now();
        while started.elapsed() < READY_WITHIN {
            let ready = runtime.block_on(async {
                http.get(&url)
                    .send()
                    .await
                    .is_ok_and(|r| r.status().is_success())
            });
            if ready {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(format!(
            "the node did not become ready within {} s: a data directory of a cluster of \
             several nodes cannot lead alone; import through that cluster with --url",
            READY_WITHIN.as_secs()
        ))
    }

    /// SIGTERM, then waits for a graceful exit (a checkpoint and the clean-stop marker).
    fn stop(mut self) -> Result<(), String> {
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        let started = Instant::now();
        while started.elapsed() < STOP_WITHIN {
            match self.child.try_wait() {
                Ok(Some(status)) if status.success() => return Ok(()),
                Ok(Some(status)) => return Err(format!("the node stopped with {status}")),
                Ok(None) => std::thread::sleep(Duration::from_millis(50)),
                Err(e) => return Err(format!("cannot wait for the node: {e}")),
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        Err(format!(
            "the node did not stop within {} s of SIGTERM and was killed",
            STOP_WITHIN.as_secs()
        ))
    }
}

impl Drop for LocalNode {
    fn drop(&mut self) {
        // Stopped already, or the import failed early: never leave the child behind.
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
