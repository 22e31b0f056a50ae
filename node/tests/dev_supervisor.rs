//! `lineage-node dev` supervises its nodes: a node that dies (kill -9 here; a node also
//! exits by itself on a panic or a failed fsync) is started again, and SIGTERM to `dev`
//! stops every node it started.

#[path = "cluster/util.rs"]
mod util;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The pid of the process whose command line contains `needle`, if exactly one.
fn pid_of(needle: &str) -> Option<u32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").ok()? {
        let entry = entry.ok()?;
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if cmdline.contains(needle) {
            found.push(pid);
        }
    }
    (found.len() == 1).then(|| found[0])
}

async fn healthy(http: &reqwest::Client, addr: &str) -> bool {
    http.get(format!("http://{addr}/healthz"))
        .send()
        .await
        .is_ok_and(|r| r.status().is_success())
}

async fn wait_until(what: &str, limit: Duration, mut check: impl AsyncFnMut() -> bool) {
    let start = Instant::now();
    while !check().await {
        assert!(start.elapsed() < limit, "{what} within {limit:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_restarts_a_node_that_dies_and_sigterm_stops_them_all() {
    let dir = tempfile::tempdir().unwrap();
    // Three consecutive free ports for the nodes (the witness and checkpointer are not
    // built beside a test binary, so dev runs without them).
    let base = loop {
        let p = util::free_port();
        let next: Vec<u16> = (0..2).map(|_| util::free_port()).collect();
        if next == [p + 1, p + 2] {
            break p;
        }
    };
    let addrs: Vec<String> = (0..3).map(|i| format!("127.0.0.1:{}", base + i)).collect();
    let mut dev = Command::new(env!("CARGO_BIN_EXE_lineage-node"))
        .args(["dev", "--nodes", "3", "--base-port", &base.to_string()])
        .arg("--data-dir")
        .arg(dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    for addr in &addrs {
        wait_until("node up", Duration::from_secs(20), async || {
            healthy(&http, addr).await
        })
        .await;
    }
    let needle = format!("--listen {}", addrs[1]);
    let first = pid_of(&needle).expect("node 2's process");
    Command::new("kill")
        .args(["-9", &first.to_string()])
        .status()
        .unwrap();
    wait_until("node 2 restarted", Duration::from_secs(20), async || {
        pid_of(&needle).is_some_and(|pid| pid != first) && healthy(&http, &addrs[1]).await
    })
    .await;

    Command::new("kill")
        .args(["-TERM", &dev.id().to_string()])
        .status()
        .unwrap();
    let status = dev.wait().unwrap();
    assert!(status.success(), "dev exits cleanly on SIGTERM: {status}");
    for addr in &addrs {
        wait_until("node stopped", Duration::from_secs(10), async || {
            !healthy(&http, addr).await
        })
        .await;
        assert_eq!(
            pid_of(&format!("--listen {addr}")),
            None,
            "{addr} still running"
        );
    }
}
