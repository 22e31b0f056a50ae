//! Network partitions between real hosts: the three-node `deploy/compose.yaml` stack, run
//! from an image built from this build's own binary, with links cut by
//! `docker network disconnect`. Needs a Docker engine and docker-compose; says clearly
//! when it skips (and fails instead when `LINEAGE_REQUIRE_DOCKER` is set).

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

/// One compose project: three containers, their keys, their published ports.
struct Stack {
    project: String,
    keys: tempfile::TempDir,
    ports: Vec<u16>,
}

impl Stack {
    fn compose(&self) -> Command {
        let mut command = Command::new("docker-compose");
        command
            .arg("-p")
            .arg(&self.project)
            .arg("-f")
            .arg(repo().join("deploy/compose.yaml"))
            .env("LINEAGE_KEYS", self.keys.path())
            .env("LINEAGE_IMAGE", "lineage-node:test");
        for (i, port) in self.ports.iter().enumerate() {
            command.env(format!("LINEAGE_PORT_{}", i + 1), port.to_string());
        }
        command
    }

    fn up(name: &str) -> Stack {
        let keys = tempfile::tempdir().unwrap();
        assert!(run(Command::new(env!("CARGO_BIN_EXE_lineage-node"))
            .arg("keygen")
            .arg(keys.path().join("k"))));
        // Secrets are bind-mounted: the container's unprivileged user must read them.
        for entry in std::fs::read_dir(keys.path().join("k")).unwrap() {
            let entry = entry.unwrap();
            std::fs::rename(entry.path(), keys.path().join(entry.file_name())).unwrap();
        }
        assert!(run(Command::new("chown")
            .arg("-R")
            .arg("10001:10001")
            .arg(keys.path())));
        let ports = (0..3).map(|_| free_port()).collect();
        let stack = Stack {
            project: format!("lineagetest{}{}", std::process::id(), name.replace('-', "")),
            keys,
            ports,
        };
        assert!(
            run(stack.compose().args(["up", "-d"])),
            "docker-compose up failed"
        );
        stack
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

impl Drop for Stack {
    fn drop(&mut self) {
        let _ = run(self.compose().args(["down", "-v", "--timeout", "1"]));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn network_partitions_in_docker() {
    if !docker_available() {
        assert!(
            std::env::var_os("LINEAGE_REQUIRE_DOCKER").is_none(),
            "a Docker engine and docker-compose are required here"
        );
        eprintln!("SKIPPED: no Docker engine or docker-compose; the partition suite did not run");
        return;
    }
    let script = repo().join("deploy/docker/build-local-image.sh");
    assert!(
        run(Command::new(script)
            .arg(env!("CARGO_BIN_EXE_lineage-node"))
            .arg("lineage-node:test")),
        "building the image from this build's binary failed"
    );

    // The leader cut off from both followers, then healed.
    let stack = Stack::up("leader-cut");
    let cluster = Arc::new(Cluster::attach(stack.addrs(), stack.admin()).await);
    run_scenario_on(
        "docker-leader-partitioned",
        cluster,
        async |cluster: &Cluster| {
            let leader = cluster.wait_for_leader(Duration::from_secs(10)).await;
            stack.disconnect(leader);
            tokio::time::sleep(Duration::from_secs(5)).await;
            stack.connect(leader);
        },
    )
    .await;
    drop(stack);

    // One follower cut off, then healed.
    let stack = Stack::up("follower-cut");
    let cluster = Arc::new(Cluster::attach(stack.addrs(), stack.admin()).await);
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
    let cluster = Arc::new(Cluster::attach(stack.addrs(), stack.admin()).await);
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
