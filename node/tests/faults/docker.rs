//! Network partitions between real hosts: the `deploy/compose.yaml` stack (three nodes over TLS, a
//! witness, a checkpointer), provisioned by `deploy/provision-keys.sh` and run from an
//! image built from this build's own binaries, with links cut by
//! `docker network disconnect`. Needs a Docker engine and docker-compose, so it is
//! `#[ignore]`d: `cargo test` reports it as ignored, never as passed, and it runs with
//! `cargo test -p lineage-node --test faults -- --ignored` (as `.ci/run` does, unless
//! `LINEAGE_ALLOW_NO_DOCKER=1`), where a missing engine fails it.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use super::run_scenario_on;
use super::util::{free_port, Cluster};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn run(command: &mut Command) -> bool {
    command
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn docker_available() -> bool {
    run(Command::new("docker").arg("info")) && run(Command::new("docker-compose").arg("version"))
}

/// One compose project: its containers, their keys, their published ports.
struct Stack {
    project: String,
    keys: tempfile::TempDir,
    ports: Vec<u16>,
    witness_port: u16,
}

impl Stack {
    fn compose(&self) -> Command {
        let mut command = Command::new("docker-compose");
        command
            .arg("--env-file")
            .arg(self.keys.path().join("compose.env"))
            .arg("-p")
            .arg(&self.project)
            .arg("-f")
            .arg(repo().join("deploy/compose.yaml"))
            .env("LINEAGE_IMAGE", "lineage-node:test")
            .env("LINEAGE_WITNESS_PORT", self.witness_port.to_string())
            .env("LINEAGE_WITNESS2_PORT", free_port().to_string())
            // Not scraped here; any free port keeps parallel stacks apart.
            .env("LINEAGE_CHECKPOINTER_PORT", free_port().to_string());
        for (i, port) in self.ports.iter().enumerate() {
            command.env(format!("LINEAGE_PORT_{}", i + 1), port.to_string());
        }
        command
    }

    fn up(name: &str) -> Stack {
        let keys = tempfile::tempdir().unwrap();
        let bin_dir = Path::new(env!("CARGO_BIN_EXE_lineage-node"))
            .parent()
            .unwrap();
        assert!(
            run(Command::new(repo().join("deploy/provision-keys.sh"))
                .arg(keys.path())
                .arg(bin_dir)),
            "deploy/provision-keys.sh failed"
        );
        // Secrets are bind-mounted: run as root, the script gives them to the
        // containers' user (uid 10001) and a host group, 0640, and no one else; the CA's
        // key stays root's, 0600.
        for entry in std::fs::read_dir(keys.path()).unwrap() {
            use std::os::unix::fs::{MetadataExt, PermissionsExt};
            let entry = entry.unwrap();
            let meta = entry.metadata().unwrap();
            let (uid, mode) = if entry.file_name() == "ca.key" {
                (0, 0o600)
            } else {
                (10001, 0o640)
            };
            assert_eq!(meta.uid(), uid, "{:?}", entry.file_name());
            assert_eq!(
                meta.permissions().mode() & 0o777,
                mode,
                "{:?}",
                entry.file_name()
            );
        }
        let ports = (0..3).map(|_| free_port()).collect();
        let stack = Stack {
            project: format!("lineagetest{}{}", std::process::id(), name.replace('-', "")),
            keys,
            ports,
            witness_port: free_port(),
        };
        assert!(
            run(stack.compose().args(["up", "-d"])),
            "docker-compose up failed"
        );
        // The checkpointer waits for the nodes' health (`lineage-node healthcheck
        // --ready`, from a scratch image with no curl): by now every node says healthy.
        for i in 0..3 {
            let output = Command::new("docker")
                .args(["inspect", "--format", "{{.State.Health.Status}}"])
                .arg(stack.container(i))
                .output()
                .unwrap();
            let health = String::from_utf8_lossy(&output.stdout).trim().to_string();
            assert_eq!(health, "healthy", "node {} after `up`", i + 1);
        }
        stack
    }

    /// The development CA the nodes' certificates chain to (`provision-keys.sh`).
    fn ca(&self) -> std::path::PathBuf {
        self.keys.path().join("ca.pem")
    }

    fn admin(&self) -> String {
        std::fs::read_to_string(self.keys.path().join("admin.token")).unwrap()
    }

    fn addrs(&self) -> Vec<String> {
        self.ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect()
    }

    /// A value `provision-keys.sh` wrote into compose.env.
    fn env_value(&self, name: &str) -> String {
        let env = std::fs::read_to_string(self.keys.path().join("compose.env")).unwrap();
        env.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}=")).map(str::to_string))
            .unwrap_or_else(|| panic!("{name} missing from compose.env"))
    }

    fn container(&self, i: usize) -> String {
        format!("{}_node{}_1", self.project, i + 1)
    }

    fn network(&self) -> String {
        format!("{}_default", self.project)
    }

    /// Cuts node `i` off from every other node (and from its published port).
    fn disconnect(&self, i: usize) {
        assert!(run(Command::new("docker").args([
            "network",
            "disconnect",
            &self.network(),
            &self.container(i)
        ])));
    }

    fn connect(&self, i: usize) {
        assert!(run(Command::new("docker").args([
            "network",
            "connect",
            "--alias",
            &format!("node{}", i + 1),
            &self.network(),
            &self.container(i),
        ])));
    }
}

/// Waits (bounded) until the cluster serves a heads checkpoint of at least one statement
/// cosigned by both of the stack's witnesses (its quorum, 2 of 2): the checkpointer
/// fetched it, each witness trusted the cluster's key and cosigned, and the checkpointer
/// stored the cosigned note back. Then the auditor's CLI accepts it with `--quorum 2`.
async fn assert_witnessed(stack: &Stack, cluster: &Cluster) {
    let log_vkey = stack.env_value("LINEAGE_CLUSTER_VKEY");
    let witness_vkeys = [
        stack.env_value("LINEAGE_WITNESS_VKEY"),
        stack.env_value("LINEAGE_WITNESS2_VKEY"),
    ];
    let mut last = String::from("nothing fetched");
    for _ in 0..120 {
        for i in 0..3 {
            let reply = cluster
                .http
                .get(cluster.url(i, "/v1/transparency/checkpoint/witnessed"))
                .send()
                .await;
            let Ok(reply) = reply else { continue };
            let status = reply.status().as_u16();
            let note = reply.text().await.unwrap_or_default();
            if status != 200 {
                last = format!("{status}: {note}");
                continue;
            }
            match lineage_core::heads::verify_witnessed(&note, &log_vkey, &witness_vkeys, 2) {
                Ok(w) if w.checkpoint.size >= 1 => {
                    assert_cli_accepts(cluster, &note, &witness_vkeys).await;
                    return;
                }
                Ok(w) => last = format!("witnessed at size {}", w.checkpoint.size),
                Err(e) => last = format!("{e}: {note}"),
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    panic!("no checkpoint cosigned by both compose witnesses within 60 s; last: {last}");
}

/// `lineage checkpoint verify NOTE --public-key K --witness-key W1 --witness-key W2
/// --quorum 2` exits 0.
async fn assert_cli_accepts(cluster: &Cluster, note: &str, witness_vkeys: &[String]) {
    let lineage = Path::new(env!("CARGO_BIN_EXE_lineage-node")).with_file_name("lineage");
    assert!(
        lineage.is_file(),
        "{} is missing: cargo build --workspace --bins",
        lineage.display()
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("note.txt");
    std::fs::write(&path, note).unwrap();
    let public_key = cluster.public_key().await;
    let mut command = Command::new(&lineage);
    command.args(["checkpoint", "verify"]).arg(&path).args([
        "--public-key",
        &public_key,
        "--quorum",
        "2",
    ]);
    for vkey in witness_vkeys {
        command.args(["--witness-key", vkey]);
    }
    let output = command.output().unwrap();
    assert!(
        output.status.success(),
        "lineage checkpoint verify --quorum 2: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

impl Drop for Stack {
    fn drop(&mut self) {
        let _ = run(self.compose().args(["down", "-v", "--timeout", "1"]));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Docker engine: cargo test -p lineage-node --test faults -- --ignored"]
async fn network_partitions_in_docker() {
    assert!(
        docker_available(),
        "a Docker engine and docker-compose are needed to run this (it was asked for with --ignored)"
    );
    let script = repo().join("deploy/docker/build-local-image.sh");
    assert!(
        run(Command::new(script)
            .arg(env!("CARGO_BIN_EXE_lineage-node"))
            .arg("lineage-node:test")),
        "building the image from this build's binary failed"
    );

    // The leader cut off from both followers, then healed.
    let stack = Stack::up("leader-cut");
    let cluster = Arc::new(Cluster::attach(stack.addrs(), stack.admin(), Some(&stack.ca())).await);
    run_scenario_on(
        "docker-leader-partitioned",
        cluster.clone(),
        async |cluster: &Cluster| {
            let leader = cluster.wait_for_leader(Duration::from_secs(10)).await;
            stack.disconnect(leader);
            tokio::time::sleep(Duration::from_secs(5)).await;
            stack.connect(leader);
        },
    )
    .await;
    assert_witnessed(&stack, &cluster).await;
    drop(stack);

    // One follower cut off, then healed.
    let stack = Stack::up("follower-cut");
    let cluster = Arc::new(Cluster::attach(stack.addrs(), stack.admin(), Some(&stack.ca())).await);
    run_scenario_on(
        "docker-follower-partitioned",
        cluster,
        async |cluster: &Cluster| {
            let leader = cluster.wait_for_leader(Duration::from_secs(10)).await;
            let follower = (leader + 1) % 3;
            stack.disconnect(follower);
            tokio::time::sleep(Duration::from_secs(5)).await;
            stack.connect(follower);
        },
    )
    .await;
    drop(stack);

    // A flapping link: the leader's connection drops and returns, again and again.
    let stack = Stack::up("flapping");
    let cluster = Arc::new(Cluster::attach(stack.addrs(), stack.admin(), Some(&stack.ca())).await);
    run_scenario_on(
        "docker-flapping-link",
        cluster,
        async |cluster: &Cluster| {
            for _ in 0..5 {
                let leader = cluster.wait_for_leader(Duration::from_secs(15)).await;
                stack.disconnect(leader);
                tokio::time::sleep(Duration::from_millis(800)).await;
                stack.connect(leader);
                tokio::time::sleep(Duration::from_millis(800)).await;
            }
        },
    )
    .await;
}
