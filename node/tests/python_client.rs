//! Runs the Python client's own tests (`client/python/test_lineage_guard.py`) with this
//! build's `lineage-node`: they start real three-node clusters on 127.0.0.1, drive every
//! client call against them, and kill a leader under the client.

use std::path::Path;
use std::process::Command;

#[test]
fn the_python_client_passes_its_tests_against_real_nodes() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../client/python");
    let output = Command::new("python3")
        .args(["-m", "unittest", "-v", "test_lineage_guard"])
        .current_dir(&dir)
        .env("LINEAGE_NODE_BIN", env!("CARGO_BIN_EXE_lineage-node"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .unwrap_or_else(|e| panic!("cannot run python3 (it is needed for this test): {e}"));
    let report = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "the Python client's tests failed:\n{report}\n{}",
        String::from_utf8_lossy(&output.stdout)
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
