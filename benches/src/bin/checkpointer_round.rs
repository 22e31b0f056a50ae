//! Checkpointer round time with many agents of which few changed: a real `lineage-node`
//! and a real `lineage-witness` process, the checkpointer library in this process.
//! Reports the first round (every agent's statement is new), an idle round (nothing
//! changed: the baseline, one checkpoint fetch) and rounds after 1% of agents acted,
//! as times and as ratios to the idle round measured in the same run.
//!
//!   cargo build --release -p lineage-node -p lineage-checkpointer -p lineage-benches
//!   target/release/checkpointer_round [--agents 10000] [--changed-percent 1] [--rounds 5]

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lineage_benches::sibling_binary;
use lineage_checkpointer::checkpointer::{Checkpointer, WitnessTarget};
use lineage_checkpointer::checkpointer_metrics::Metrics;
use lineage_checkpointer::cluster_client::ClusterClient;
use serde_json::json;

struct Processes(Vec<Child>);

impl Drop for Processes {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn run_quiet(program: &Path, args: &[&str]) -> Result<String, String> {
    let output = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| e.to_string())?;
    if !output.status.success() {
        return Err(format!(
            "{} {args:?}: {}",
            program.display(),
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_string())
}

/// One checkpointer round against a witness, at a share of agents changed.
#[derive(clap::Parser)]
struct Args {
    /// Agents in the node.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(10..=100_000))]
    agents: u64,
    /// Share of them changed before each round, in percent.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=100))]
    changed_percent: u64,
    /// Rounds measured.
    #[arg(long, default_value_t = 5, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=50))]
    rounds: usize,
}

fn main() {
    let args = <Args as clap::Parser>::parse();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("checkpointer_round: {e}");
            std::process::exit(1);
        }
    };
    if let Err(e) = runtime.block_on(run(&args)) {
        eprintln!("checkpointer_round: {e}");
        std::process::exit(1);
    }
}

/// POSTs with bounded concurrency; every answer must be 200.
async fn post_all(
    http: &reqwest::Client,
    admin: &str,
    requests: Vec<(String, serde_json::Value)>,
) -> Result<(), String> {
    let mut tasks = tokio::task::JoinSet::new();
    let mut pending = requests.into_iter();
    let mut failures = 0;
    loop {
        while tasks.len() < 32 {
            let Some((url, body)) = pending.next() else {
                break;
            };
            let request = http.post(url).bearer_auth(admin).json(&body);
            tasks.spawn(async move { request.send().await.map(|r| r.status().is_success()) });
        }
        match tasks.join_next().await {
            Some(Ok(Ok(true))) => {}
            Some(_) => failures += 1,
            None => break,
        }
    }
    if failures > 0 {
        return Err(format!("{failures} requests failed"));
    }
    Ok(())
}

async fn heads_size(http: &reqwest::Client, url: &str) -> u64 {
    let text = match http
        .get(format!("{url}/v1/transparency/checkpoint"))
        .send()
        .await
    {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    };
    text.lines()
        .nth(1)
        .and_then(|l| l.parse().ok())
        .unwrap_or(0)
}

async fn wait_heads(http: &reqwest::Client, url: &str, at_least: u64) -> Result<u64, String> {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(120) {
        let size = heads_size(http, url).await;
        if size >= at_least {
            return Ok(size);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(format!("heads log did not reach {at_least} in 120 s"))
}

#[expect(
    clippy::too_many_lines,
    reason = "one measured run, step by step: setup, the rounds, the report"
)]
async fn run(args: &Args) -> Result<(), String> {
    let (agents, percent, rounds) = (args.agents, args.changed_percent, args.rounds);
    let build = "-p lineage-node -p lineage-checkpointer";
    let node_bin = sibling_binary("lineage-node", build)?;
    let witness_bin = sibling_binary("lineage-witness", build)?;
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let keys = dir.path().join("keys");
    let admin = lineage_benches::keygen(&node_bin, &keys)?;
    let node_addr = lineage_benches::free_loopback_addr()?;
    let url = format!("http://{node_addr}");
    let mut processes = Processes(Vec::new());
    processes.0.push(
        Command::new(&node_bin)
            .args(lineage_benches::node_run_args(
                1,
                std::slice::from_ref(&node_addr),
                &dir.path().join("node"),
                &keys,
            ))
            .args(["--heads-interval-ms", "200"])
            .env("LINEAGE_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| e.to_string())?,
    );
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .map_err(|e| e.to_string())?;
    let start = Instant::now();
    let vkey = loop {
        if let Ok(r) = http.get(format!("{url}/v1/transparency/vkey")).send().await {
            if r.status().is_success() {
                break r
                    .text()
                    .await
                    .map_err(|e| e.to_string())?
                    .trim()
                    .to_string();
            }
        }
        if start.elapsed() > Duration::from_secs(20) {
            return Err("node did not start".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };

    let origin = vkey.split('+').next().unwrap_or_default().to_string();
    let wdir = dir.path().join("witness");
    let wdir_s = wdir.to_str().ok_or("path")?;
    let witness_vkey = run_quiet(
        &witness_bin,
        &["--data-dir", wdir_s, "--name", "w.bench", "keygen"],
    )?;
    run_quiet(
        &witness_bin,
        &[
            "--data-dir",
            wdir_s,
            "--name",
            "w.bench",
            "add-log",
            "--origin",
            &origin,
            "--vkey",
            &vkey,
        ],
    )?;
    let witness_addr = lineage_benches::free_loopback_addr()?;
    processes.0.push(
        Command::new(&witness_bin)
            .args([
                "--data-dir",
                wdir_s,
                "--name",
                "w.bench",
                "--listen",
                &witness_addr,
            ])
            .env("LINEAGE_LOG", "error")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| e.to_string())?,
    );

    println!("creating {agents} agents ...");
    let policy = json!({"budget": 1_000_000, "scar_limit": 10, "tools": {"t": {"cost": 1}}});
    let creates = (0..agents)
        .map(|i| {
            (
                format!("{url}/v1/agents"),
                json!({"agent_id": format!("agent-{i}"), "policy": policy}),
            )
        })
        .collect();
    post_all(&http, &admin, creates).await?;
    let size = wait_heads(&http, &url, agents).await?;

    let cluster = ClusterClient::new(vec![url.clone()], Some(admin.clone()))?;
    let witness = WitnessTarget::parse(&format!("http://{witness_addr}={witness_vkey}"))?;
    let metrics = Metrics::new(1.0).map_err(|e| e.to_string())?;
    let checkpointer = Checkpointer::open(
        &dir.path().join("checkpointer"),
        cluster,
        vec![witness],
        1,
        None,
        metrics,
    )
    .await
    .map_err(|e| e.to_string())?;

    let timed = |label: &'static str| {
        let checkpointer = &checkpointer;
        async move {
            let start = Instant::now();
            let report = checkpointer.round().await.map_err(|e| e.to_string())?;
            let elapsed = start.elapsed();
            if !report.alarms.is_empty() {
                return Err(format!("{label}: alarms {:?}", report.alarms));
            }
            Ok::<_, String>((elapsed, report))
        }
    };
    let (first, report) = timed("first round").await?;
    if report.cosigned_by.is_empty() {
        return Err("the first round was not cosigned".into());
    }
    let mut idle = Vec::new();
    for _ in 0..rounds {
        idle.push(timed("idle round").await?.0);
    }
    let changed = (agents * percent / 100).max(1);
    let mut changed_rounds = Vec::new();
    let mut statements = 0;
    let mut heads = size;
    for round in 0..rounds {
        let actions = (0..changed)
            .map(|i| {
                let agent = (i * (100 / percent) + round as u64) % agents;
                (
                    format!("{url}/v1/agents/agent-{agent}/actions"),
                    json!({"tool": "t", "input": {"round": round}}),
                )
            })
            .collect();
        post_all(&http, &admin, actions).await?;
        heads = wait_heads(&http, &url, heads + changed).await?;
        let (elapsed, report) = timed("changed round").await?;
        statements += report.new_statements;
        if report.cosigned_by.is_empty() {
            return Err("a changed round was not cosigned".into());
        }
        changed_rounds.push(elapsed);
    }
    let median = |mut v: Vec<Duration>| {
        v.sort();
        v[v.len() / 2]
    };
    let idle = median(idle);
    let changed_median = median(changed_rounds);
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    println!("agents                         {agents}");
    println!(
        "first round ({size} statements)  {:>9.1} ms  ({:.1}x idle)",
        ms(first),
        ms(first) / ms(idle)
    );
    println!("idle round (baseline)          {:>9.1} ms", ms(idle));
    println!(
        "{percent}% changed ({changed} agents)     {:>9.1} ms  ({:.1}x idle, {:.3}x first)  median of {rounds}, {} statements in all",
        ms(changed_median),
        ms(changed_median) / ms(idle),
        ms(changed_median) / ms(first),
        statements
    );
    drop(processes);
    Ok(())
}
