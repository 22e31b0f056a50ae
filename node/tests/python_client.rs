//! Runs the Python client's own tests (`client/python/test_lineage_guard.py`) with this
//! build's `lineage-node`: they start real three-node clusters on 127.0.0.1, drive every
//! client call against them, and kill a leader under the client.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// Longer than the suite's own bound (900 s), so that one reports first.
const PROCESS_TIMEOUT: Duration = Duration::from_secs(1_000);

#[test]
fn the_python_client_passes_its_tests_against_real_nodes() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../client/python");
    // Output goes to files (a full pipe would stall the child), and the run is bounded:
    // the suite ends itself after 900 s (faulthandler); past this, it is killed.
    let logs = tempfile::tempdir().expect("tempdir");
    let out_path = logs.path().join("stdout");
    let err_path = logs.path().join("stderr");
    let mut child = Command::new("python3")
        .args(["-m", "unittest", "-v", "test_lineage_guard"])
        .current_dir(&dir)
        .env("LINEAGE_NODE_BIN", env!("CARGO_BIN_EXE_lineage-node"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .stdout(std::fs::File::create(&out_path).expect("stdout file"))
        .stderr(std::fs::File::create(&err_path).expect("stderr file"))
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run python3 (it is needed for this test): {e}"));
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for python3") {
            break Some(status);
        }
        if started.elapsed() > PROCESS_TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let report = std::fs::read_to_string(&err_path).unwrap_or_default();
    let stdout = std::fs::read_to_string(&out_path).unwrap_or_default();
    let Some(status) = status else {
        panic!("the Python client's tests still ran after {PROCESS_TIMEOUT:?}; killed:\n{report}\n{stdout}");
    };
    assert!(
        status.success(),
        "the Python client's tests failed ({status}):\n{report}\n{stdout}"
    );
    // unittest ends with "Ran N tests in …" and "OK"; a run of no test would also pass.
    let ran = report
        .lines()
        .find_map(|line| line.strip_prefix("Ran "))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse::<usize>().ok());
    assert!(
        ran.is_some_and(|n| n >= 10),
        "expected at least 10 Python tests to run:\n{report}"
    );
}
