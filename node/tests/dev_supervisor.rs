//! `lineage-node dev` supervises its children (three nodes, the witness and the
//! checkpointer, which `cargo test --workspace` builds beside it): a node that dies
//! (kill -9 here; a node also exits by itself on a panic or a failed fsync) is started
//! again, one that keeps dying stops `dev` with an error, SIGTERM to `dev` stops every
//! child, and no child outlives a `dev` killed with -9. Output lines carry the child's
//! name; ports in use are refused before anything starts.

#[path = "cluster/util.rs"]
mod util;

use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// The pids of every process whose command line contains `needle`.
fn pids_of(needle: &str) -> Vec<u32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        // A process that exited meanwhile reads as empty: not a match.
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if cmdline.contains(needle) {
            found.push(pid);
        }
    }
    found
}

/// The pid of the process whose command line contains `needle`, if exactly one (two
/// would be a leaked child: which one to kill is not known).
fn pid_of(needle: &str) -> Option<u32> {
    match pids_of(needle)[..] {
        [pid] => Some(pid),
        _ => None,
    }
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

/// Five consecutive free ports: three nodes, the witness, the checkpointer's metrics.
fn free_ports() -> u16 {
    util::free_consecutive_ports(5)
}

/// `dev` with its output in DIR/../NAME.out (a file: a pipe nobody reads would fill and
/// block it).
fn start_dev(base: u16, dir: &std::path::Path) -> Child {
    let out = std::fs::File::create(output_path(dir)).unwrap();
    Command::new(env!("CARGO_BIN_EXE_lineage-node"))
        .args(["dev", "--nodes", "3", "--base-port", &base.to_string()])
        .arg("--data-dir")
        .arg(dir.join("data"))
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .spawn()
        .unwrap()
}

fn output_path(dir: &std::path::Path) -> std::path::PathBuf {
    dir.join("dev.out")
}

/// What tells each child of `dev` on these ports: the nodes by their listen address,
/// the witness and checkpointer by theirs.
fn child_needles(base: u16) -> Vec<String> {
    let mut needles: Vec<String> = (0..4)
        .map(|i| format!("--listen 127.0.0.1:{}", base + i))
        .collect();
    needles.push(format!("--metrics-listen 127.0.0.1:{}", base + 4));
    needles
}

/// Every child of `dev` on these ports, once per process: a leaked second copy of a
/// child is listed twice, not hidden.
fn children_running(base: u16) -> Vec<String> {
    let mut running = Vec::new();
    for needle in child_needles(base) {
        for _ in pids_of(&needle) {
            running.push(needle.clone());
        }
    }
    running
}

async fn all_up(http: &reqwest::Client, base: u16) {
    for i in 0..3 {
        let addr = format!("127.0.0.1:{}", base + i);
        wait_until("node up", Duration::from_secs(30), async || {
            healthy(http, &addr).await
        })
        .await;
    }
    wait_until(
        "witness and checkpointer up",
        Duration::from_secs(30),
        async || children_running(base) == child_needles(base),
    )
    .await;
}

fn kill(signal: &str, pid: u32) {
    let status = Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill {signal} {pid}");
}

async fn none_left(base: u16) {
    wait_until("every child stopped", Duration::from_secs(20), async || {
        children_running(base).is_empty()
    })
    .await;
}

fn output(dir: &std::path::Path) -> String {
    std::fs::read_to_string(output_path(dir)).unwrap()
}

fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_restarts_a_node_that_dies_and_sigterm_stops_every_child() {
    let dir = tempfile::tempdir().unwrap();
    let base = free_ports();
    let mut dev = start_dev(base, dir.path());
    let http = http();
    all_up(&http, base).await;
    let needle = format!("--listen 127.0.0.1:{}", base + 1);
    let first = pid_of(&needle).expect("node 2's process");
    kill("-9", first);
    wait_until("node 2 restarted", Duration::from_secs(20), async || {
        pid_of(&needle).is_some_and(|pid| pid != first)
            && healthy(&http, &format!("127.0.0.1:{}", base + 1)).await
    })
    .await;

    kill("-TERM", dev.id());
    let status = dev.wait().unwrap();
    let text = output(dir.path());
    assert!(
        status.success(),
        "dev exits cleanly on SIGTERM: {status}\n{text}"
    );
    none_left(base).await;
    // What a newcomer needs is printed, and each child's lines carry its name.
    for expected in [
        "audit public key ",
        "witness vkey     dev.witness/w1+",
        "lineage --url http://127.0.0.1:",
        "node 2      | ",
        "witness     | ",
        "checkpointer| ",
        "node 2 exited (signal: 9",
        "SIGTERM: stopping everything",
    ] {
        assert!(
            text.contains(expected),
            "{expected:?} missing from:\n{text}"
        );
    }
    assert!(
        !text.contains("\u{1b}["),
        "colour codes in output that is not a terminal"
    );
    assert!(
        !text.contains("ERROR"),
        "a healthy start and stop logs no ERROR:\n{text}"
    );
    // A node down for a moment is a WARN or two, not one per heartbeat (every 50 ms).
    let warnings = text.lines().filter(|l| l.contains(" WARN ")).count();
    assert!(warnings <= 12, "{warnings} WARN lines:\n{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_child_outlives_a_killed_dev_and_busy_ports_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let base = free_ports();
    let mut dev = start_dev(base, dir.path());
    all_up(&http(), base).await;
    // A second dev on the same ports says so and starts nothing.
    let other = tempfile::tempdir().unwrap();
    let mut second = start_dev(base, other.path());
    let status = second.wait().unwrap();
    let text = output(other.path());
    assert!(!status.success(), "{text}");
    assert!(
        text.contains(&format!("port {base} on 127.0.0.1 is not free")),
        "{text}"
    );
    assert!(!other.path().join("data").exists(), "nothing was created");

    kill("-9", dev.id());
    let _ = dev.wait();
    none_left(base).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_keeps_dying_stops_dev_with_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let base = free_ports();
    let mut dev = start_dev(base, dir.path());
    all_up(&http(), base).await;
    let needle = format!("--listen 127.0.0.1:{}", base + 2);
    // Five deaths, each of a freshly restarted process (restart delays 1, 2, 4, 8 s).
    let mut last = None;
    for _ in 0..5 {
        wait_until("node 3 (re)started", Duration::from_secs(30), async || {
            pid_of(&needle).is_some_and(|pid| Some(pid) != last)
        })
        .await;
        let pid = pid_of(&needle).expect("node 3");
        kill("-9", pid);
        last = Some(pid);
    }
    let start = Instant::now();
    let status = loop {
        if let Some(status) = dev.try_wait().unwrap() {
            break status;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "dev did not give up"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let text = output(dir.path());
    assert!(!status.success(), "{text}");
    assert!(
        text.contains("node 3 failed 5 times within 120 s"),
        "{text}"
    );
    none_left(base).await;
}
