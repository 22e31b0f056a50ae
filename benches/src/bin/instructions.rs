//! Instructions per decision, counted by callgrind (repeatable, unlike time on a shared
//! machine): a one-node cluster runs under `valgrind --tool=callgrind`, gets `--small`
//! and then, in a second run, `--large` sequential decisions for one agent, and stops
//! gracefully so callgrind writes its totals. The difference between the two runs'
//! instruction counts, divided by the difference in decisions, is what one decision
//! costs the node: start-up, election and shutdown cancel out. Fsyncs per decision come
//! from the node's own log-write histogram (two fdatasyncs per log write: the frames,
//! then the watermark).
//!
//!   apt-get install valgrind
//!   cargo build --release -p lineage-node -p lineage-benches
//!   target/release/instructions [--small 100] [--large 400] [--baseline-node PATH]
//!
//! With `--baseline-node`, the same is measured for another build, and the ratio printed.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

struct Run {
    instructions: u64,
    log_writes: f64,
}

/// `summary:` or `totals:` from a callgrind output file: the first event (Ir).
fn callgrind_total(path: &Path) -> Result<u64, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    text.lines()
        .filter_map(|l| {
            l.strip_prefix("summary:")
                .or_else(|| l.strip_prefix("totals:"))
        })
        .filter_map(|rest| rest.split_whitespace().next()?.parse().ok())
        .next()
        .ok_or_else(|| format!("{}: no summary line", path.display()))
}

/// One node under callgrind, `decisions` sequential decisions, a graceful stop.
async fn run(binary: &Path, decisions: usize) -> Result<Run, String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let keys = dir.path().join("keys");
    let admin = lineage_benches::keygen(binary, &keys)?;
    let addr = lineage_benches::free_loopback_addr()?;
    let out = dir.path().join("callgrind.out");
    let mut child = Command::new("valgrind")
        .arg("--tool=callgrind")
        .arg(format!("--callgrind-out-file={}", out.display()))
        .arg(binary)
        .args(lineage_benches::node_run_args(
            1,
            std::slice::from_ref(&addr),
            &dir.path().join("data"),
            &keys,
        ))
        .env("LINEAGE_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("valgrind: {e} (apt-get install valgrind)"))?;
    let url = format!("http://{addr}");
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .map_err(|e| e.to_string())?;
    let result = async {
        let start = Instant::now();
        while !http
            .get(format!("{url}/readyz"))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
        {
            if start.elapsed() > Duration::from_secs(300) {
                return Err("the node under callgrind was not ready in 300 s".to_string());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let policy = lineage_benches::unbounded_policy();
        let created: Value = http
            .post(format!("{url}/v1/agents"))
            .bearer_auth(admin.trim())
            .json(&json!({"agent_id": "bench", "policy": policy}))
            .send()
            .await
            .map_err(|e| e.to_string())?
            .json()
            .await
            .map_err(|e| e.to_string())?;
        let token = created["token"].as_str().ok_or("no token")?.to_string();
        let before = lineage_benches::log_write_count(&http, &url).await?;
        for _ in 0..decisions {
            let reply = http
                .post(format!("{url}/v1/agents/bench/actions"))
                .bearer_auth(&token)
                .json(&json!({"tool": "work", "input": {"q": "same input each time"}}))
                .send()
                .await
                .map_err(|e| e.to_string())?;
            if !reply.status().is_success() {
                return Err(format!("a decision failed: {}", reply.status()));
            }
        }
        let after = lineage_benches::log_write_count(&http, &url).await?;
        Ok(after - before)
    }
    .await;
    // SIGTERM: a graceful stop, after which callgrind writes its totals.
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let status = child.wait().map_err(|e| e.to_string())?;
    let log_writes = result?;
    if !status.success() {
        return Err(format!("the node under callgrind exited with {status}"));
    }
    Ok(Run {
        instructions: callgrind_total(&out)?,
        log_writes,
    })
}

/// Instructions and fsyncs per decision for `binary`.
/// `build` names it among the figures (`this` or `baseline`).
async fn per_decision(
    binary: &Path,
    build: &str,
    small: usize,
    large: usize,
) -> Result<(f64, f64), String> {
    let a = run(binary, small).await?;
    let b = run(binary, large).await?;
    let extra = (large - small) as f64;
    let instructions = b.instructions.saturating_sub(a.instructions) as f64 / extra;
    let fsyncs = 2.0 * b.log_writes / large as f64;
    println!(
        "{}: {small} decisions {} instructions, {large} decisions {} instructions: {instructions:.0} instructions per decision, {fsyncs:.2} fsyncs per decision (one client, sequential)",
        binary.display(),
        a.instructions,
        b.instructions,
    );
    let labels = json!({"build": build, "nodes": 1, "history": 0});
    lineage_benches::figure("instructions_per_decision", instructions, labels.clone());
    lineage_benches::figure("sequential_fsyncs_per_decision", fsyncs, labels);
    Ok((instructions, fsyncs))
}

/// Instructions per decision, counted by callgrind.
#[derive(clap::Parser)]
struct Args {
    /// Decisions in the shorter run.
    #[arg(long, default_value_t = 100, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1_000_000))]
    small: usize,
    /// Decisions in the longer run (more than --small: the difference is measured).
    #[arg(long, default_value_t = 400, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(2..=1_000_000))]
    large: usize,
    /// Another build measured the same way, for a ratio.
    #[arg(long = "baseline-node")]
    baseline: Option<std::path::PathBuf>,
}

fn main() {
    let args = <Args as clap::Parser>::parse();
    lineage_benches::exit_on_error("instructions", measure(args));
}

fn measure(args: Args) -> Result<(), String> {
    let Args {
        small,
        large,
        baseline,
    } = args;
    if large <= small {
        return Err("--large must be more than --small".into());
    }
    let binary = lineage_benches::sibling_binary("lineage-node", "-p lineage-node")?;
    let runtime = tokio::runtime::Runtime::new().map_err(|e| e.to_string())?;
    let (this, _) = runtime.block_on(per_decision(&binary, "this", small, large))?;
    if let Some(baseline) = baseline {
        let (base, _) = runtime.block_on(per_decision(&baseline, "baseline", small, large))?;
        println!(
            "instructions per decision, this build / baseline: {:.3}x",
            this / base
        );
    }
    Ok(())
}
