//! What one agent inclusion proof over a whole log costs a node in memory and time.
//! `GET /v1/agents/{id}/proof/inclusion` is public. A node (the release binary given,
//! then the baseline build, alternately) is loaded with `--records` records of one agent
//! (each request carries a 1 KB input), its peak RSS is reset (`clear_refs`), one proof
//! over every record is asked for, and the peak RSS growth and the time it took are
//! printed, with the ratio to the baseline in the same run.
//!
//! `cargo build --release -p lineage-node -p lineage-benches && target/release/proof_memory
//! --node target/release/lineage-node --baseline-node OLD/lineage-node [--records 100000]
//! [--rounds 2]`

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// Concurrent clients while loading.
const CLIENTS: u64 = 16;

/// Peak RSS growth and time of one inclusion proof over a whole log, this build against
/// a baseline.
#[derive(clap::Parser)]
struct Args {
    #[command(flatten)]
    builds: lineage_benches::Builds,
    /// Records of the one agent the proof covers.
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u64).range(100..=10_000_000))]
    records: u64,
}

fn main() {
    let args = <Args as clap::Parser>::parse();
    lineage_benches::exit_on_error("proof_memory", run(&args));
}

fn run(args: &Args) -> Result<(), String> {
    let runtime = tokio::runtime::Runtime::new().map_err(|e| e.to_string())?;
    let mut results: Vec<(bool, Measured)> = Vec::new();
    let builds = &args.builds;
    for round in 0..builds.rounds {
        for (is_baseline, binary) in [(false, &builds.node), (true, &builds.baseline)] {
            let measured = runtime.block_on(measure(binary, args.records))?;
            println!(
                "round {} {}: {} records ({:.0} MB of data): proof peak RSS growth {:.1} MB, {:.3} s",
                round + 1,
                if is_baseline { "baseline" } else { "this build" },
                measured.records,
                measured.data_bytes as f64 / 1e6,
                measured.peak_growth as f64 / 1e6,
                measured.seconds
            );
            results.push((is_baseline, measured));
        }
    }
    let median = |baseline: bool, pick: fn(&Measured) -> f64| {
        let mut values: Vec<f64> = results
            .iter()
            .filter(|(b, _)| *b == baseline)
            .map(|(_, m)| pick(m))
            .collect();
        lineage_benches::median(&mut values)
    };
    let growth = |m: &Measured| m.peak_growth as f64;
    let seconds = |m: &Measured| m.seconds;
    println!(
        "this build / baseline (medians): peak RSS growth {:.3}x, time {:.3}x",
        median(false, growth) / median(true, growth).max(1.0),
        median(false, seconds) / median(true, seconds).max(1e-9)
    );
    Ok(())
}

struct Measured {
    records: u64,
    data_bytes: u64,
    peak_growth: u64,
    seconds: f64,
}

async fn measure(binary: &Path, records: u64) -> Result<Measured, String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let data = dir.path().join("data");
    let (node, addr, admin) = lineage_benches::start_single_node(binary, dir.path())?;
    let base = format!("http://{addr}");
    let http = reqwest::Client::new();
    let policy = json!({"budget": 1u64 << 50, "scar_limit": 10, "tools": {"t": {"cost": 0}},
        "limits": {"max_requests_per_minute": 1_000_000}});
    let token = create_agent(&http, &base, &admin, policy).await?;
    load(&http, &base, &token, records).await?;
    let agent: Value = get(&http, &format!("{base}/v1/agents/bot"), &admin).await?;
    let size = agent["head"]["seq"].as_u64().ok_or("no head")? + 1;
    let pid = node.0.id();
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5")
        .map_err(|e| format!("clear_refs: {e}"))?;
    let before = status_bytes(pid, "VmRSS:")?;
    let started = Instant::now();
    let proof: Value = get(
        &http,
        &format!("{base}/v1/agents/bot/proof/inclusion?index=0&size={size}"),
        &admin,
    )
    .await?;
    let seconds = started.elapsed().as_secs_f64();
    if proof["size"].as_u64() != Some(size) {
        return Err(format!("not a proof of size {size}: {proof}"));
    }
    let peak_growth = status_bytes(pid, "VmHWM:")?.saturating_sub(before);
    Ok(Measured {
        records: size,
        data_bytes: lineage_benches::du_bytes(&data),
        peak_growth,
        seconds,
    })
}

fn status_bytes(pid: u32, field: &str) -> Result<u64, String> {
    let status =
        std::fs::read_to_string(format!("/proc/{pid}/status")).map_err(|e| e.to_string())?;
    lineage_benches::status_field_bytes(&status, field).ok_or_else(|| format!("no {field}"))
}

async fn get(http: &reqwest::Client, url: &str, token: &str) -> Result<Value, String> {
    let reply = http
        .get(url)
        .bearer_auth(token)
        .timeout(Duration::from_secs(600))
        .send()
        .await
        .map_err(|e| e.to_string())?;
    if !reply.status().is_success() {
        return Err(format!("GET {url}: {}", reply.status()));
    }
    reply.json().await.map_err(|e| e.to_string())
}

/// Creates agent `bot` once the node answers (a bounded wait); returns its token.
async fn create_agent(
    http: &reqwest::Client,
    base: &str,
    admin: &str,
    policy: Value,
) -> Result<String, String> {
    let started = Instant::now();
    loop {
        let reply = http
            .post(format!("{base}/v1/agents"))
            .bearer_auth(admin)
            .json(&json!({"agent_id": "bot", "policy": policy}))
            .send()
            .await;
        if let Ok(reply) = reply {
            if reply.status().is_success() {
                let body: Value = reply.json().await.map_err(|e| e.to_string())?;
                return body["token"]
                    .as_str()
                    .map(str::to_string)
                    .ok_or("no token".into());
            }
        }
        if started.elapsed() > Duration::from_secs(30) {
            return Err("the node did not take an agent within 30 s".into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// About `records` records (two per request) from [`CLIENTS`] clients at once.
async fn load(http: &reqwest::Client, base: &str, token: &str, records: u64) -> Result<(), String> {
    let per_client = records / 2 / CLIENTS;
    let blob = "x".repeat(1_000);
    let mut clients = Vec::new();
    for client in 0..CLIENTS {
        let (http, url, token, blob) = (
            http.clone(),
            format!("{base}/v1/agents/bot/actions"),
            token.to_string(),
            blob.clone(),
        );
        clients.push(tokio::spawn(async move {
            for n in 0..per_client {
                let reply = http
                    .post(&url)
                    .bearer_auth(&token)
                    .json(&json!({"tool": "t", "input": {"client": client, "n": n, "blob": blob}}))
                    .send()
                    .await
                    .map_err(|e| e.to_string())?;
                if !reply.status().is_success() {
                    return Err(format!("request {n}: {}", reply.status()));
                }
            }
            Ok::<(), String>(())
        }));
    }
    for client in clients {
        client.await.map_err(|e| e.to_string())??;
    }
    Ok(())
}
