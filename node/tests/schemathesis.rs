//! Schemathesis (pinned in `.ci/schemathesis-requirements.txt`, configured by
//! `schemathesis.toml` at the repository root) generates valid and invalid requests for
//! every operation in `docs/openapi.yaml` and sends them to one live node: no answer may
//! be a server error, and every status and body must be one the document describes.
//! Skips, saying so, where schemathesis is not installed, unless
//! `LINEAGE_REQUIRE_SCHEMATHESIS` is set (CI sets it).

#[path = "cluster/util.rs"]
mod util;

use std::path::Path;
use std::process::Command;

use serde_json::json;
use util::Cluster;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_reference_holds_for_generated_requests() {
    let Some(schemathesis) =
        util::program_or_skip(&["schemathesis", "st"], "LINEAGE_REQUIRE_SCHEMATHESIS")
    else {
        return;
    };
    let cluster = Cluster::start(1).await;
    // What the configuration's fixed parameters name: an agent with an action waiting.
    let policy = json!({"budget": 1_000_000, "scar_limit": 1_000_000,
        "tools": {"pay": {"cost": 1, "requires_approval": true}}});
    cluster.create_agent(0, "fuzz", policy).await;
    let (status, decision) = cluster
        .post(
            0,
            "/v1/agents/fuzz/actions",
            &cluster.admin,
            json!({"tool": "pay", "input": {}}),
            None,
        )
        .await;
    assert_eq!(status, 200, "{decision}");
    assert_eq!(decision["action_id"], "act-1", "{decision}");

    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let base = cluster.url(0, "");
    // Its cache (.schemathesis/) goes to a scratch directory, not into the repository.
    let scratch = tempfile::tempdir().expect("scratch dir");
    let output = Command::new(&schemathesis)
        .current_dir(scratch.path())
        .env("LINEAGE_ADMIN_TOKEN", cluster.admin.trim())
        .arg("--no-color")
        .arg("--config-file")
        .arg(repo.join("schemathesis.toml"))
        .args(["run", &format!("{base}/v1/openapi.json"), "--url", &base])
        .output()
        .expect("run schemathesis");
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.status.success(), "schemathesis found:\n{report}");
    // A run that tested nothing would also exit 0: every selected operation was tested.
    let figure = |label: &str| {
        report
            .lines()
            .find_map(|line| line.trim().strip_prefix(label))
            .and_then(|rest| rest.split('/').next())
            .and_then(|n| n.trim().parse::<usize>().ok())
    };
    let (selected, tested) = (figure("Selected:"), figure("Tested:"));
    assert!(
        selected.is_some_and(|n| n >= 30) && tested == selected,
        "schemathesis did not test every selected operation:\n{report}"
    );
    assert!(
        cluster.get(0, "/healthz", "").await.0 == 200,
        "the node stayed up"
    );
}
