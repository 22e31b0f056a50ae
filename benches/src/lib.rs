//! Shared pieces of the benchmarks in `benches/` (see README.md): the machine ceilings
//! every figure is printed against, and what the benchmark binaries all need.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use lineage_core::{AuditKey, AuditLog};

pub mod wrk;

/// Durable single-record appends (one fdatasync each) per second on this disk, over 1 s.
pub fn durable_appends_per_second() -> Result<f64, String> {
    durable_appends_per_second_with(1)
}

/// Durable single-record appends per second, over 1 s, with `writers` threads each
/// appending to its own signed log at once: the reference guard's storage path (one file
/// per agent, every record sealed and fdatasynced before the answer), without its HTTP
/// and guard work. A single node storing that way does fewer decisions/s here than this
/// figure ÷ 2 (2 records per decision).
pub fn durable_appends_per_second_with(writers: usize) -> Result<f64, String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let logs = (0..writers.max(1))
        .map(|i| {
            AuditLog::create(
                dir.path().join(format!("ceiling-{i}.jsonl")),
                AuditKey::from_seed([6; 32]),
                "ceiling",
            )
            .map_err(|e| e.to_string())
        })
        .collect::<Result<Vec<_>, _>>()?;
    let start = Instant::now();
    let deadline = start + Duration::from_secs(1);
    let counts = std::thread::scope(|scope| {
        let threads: Vec<_> = logs
            .into_iter()
            .map(|mut log| {
                scope.spawn(move || -> Result<u64, String> {
                    let mut n = 0u64;
                    while Instant::now() < deadline {
                        log.append("ceiling", "tick", serde_json::json!({"n": n}))
                            .map_err(|e| e.to_string())?;
                        n += 1;
                    }
                    Ok(n)
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().unwrap_or_else(|_| Err("a writer panicked".into())))
            .collect::<Result<Vec<_>, _>>()
    })?;
    Ok(counts.iter().sum::<u64>() as f64 / start.elapsed().as_secs_f64())
}

/// The two builds an A/B benchmark runs in alternate rounds, for its clap arguments
/// (`#[command(flatten)]`).
#[derive(clap::Args)]
pub struct Builds {
    /// The lineage-node build measured.
    #[arg(long, default_value = "target/release/lineage-node")]
    pub node: PathBuf,
    /// The build it is compared with (for example the build before a change).
    #[arg(long = "baseline-node")]
    pub baseline: PathBuf,
    /// Rounds, each running both builds.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=10))]
    pub rounds: u64,
}

/// The end of a benchmark's `main`: an error is printed after the benchmark's name, and
/// the process exits 1.
pub fn exit_on_error(name: &str, outcome: Result<(), String>) {
    if let Err(e) = outcome {
        eprintln!("{name}: {e}");
        std::process::exit(1);
    }
}

/// A binary built beside this benchmark (same target dir and profile); `build` says
/// which packages build it when it is missing.
pub fn sibling_binary(name: &str, build: &str) -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let path = exe.with_file_name(name);
    if path.exists() {
        Ok(path)
    } else {
        Err(format!(
            "{} not found: cargo build --release {build}",
            path.display()
        ))
    }
}

/// `lineage-node keygen` (the build at `binary`) into `keys`; returns the admin token.
pub fn keygen(binary: &Path, keys: &Path) -> Result<String, String> {
    let ok = std::process::Command::new(binary)
        .arg("keygen")
        .arg(keys)
        .stdout(std::process::Stdio::null())
        .status()
        .map_err(|e| e.to_string())?;
    if !ok.success() {
        return Err("keygen failed".into());
    }
    std::fs::read_to_string(keys.join("admin.token")).map_err(|e| e.to_string())
}

/// A loopback address (`127.0.0.1:PORT`) nothing listens on right now.
pub fn free_loopback_addr() -> Result<String, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.to_string())
        .map_err(|e| e.to_string())
}

/// A `lineage-node` process, killed when dropped, whatever the benchmark did.
pub struct NodeProcess(pub std::process::Child);

impl Drop for NodeProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `lineage-node run`'s arguments for node `id` of a cluster on loopback: its address,
/// every node's (`id=addr`, in id order from 1), its data directory and the shared keys.
/// Every benchmark starts its nodes with these, adding only what it measures.
pub fn node_run_args(
    id: usize,
    peers: &[String],
    data_dir: &Path,
    keys: &Path,
) -> Vec<std::ffi::OsString> {
    let addr = id
        .checked_sub(1)
        .and_then(|i| peers.get(i))
        .map_or("", String::as_str);
    let peer_list: Vec<String> = peers
        .iter()
        .enumerate()
        .map(|(i, a)| format!("{}={a}", i + 1))
        .collect();
    let mut args: Vec<std::ffi::OsString> = ["run", "--id", &id.to_string(), "--listen", addr]
        .iter()
        .map(Into::into)
        .collect();
    args.extend(["--peers".into(), peer_list.join(",").into()]);
    args.extend(["--data-dir".into(), data_dir.into()]);
    args.extend(["--keys-dir".into(), keys.into()]);
    args
}

/// A one-node cluster of `binary` in `dir` (keys in `dir/keys`, data in `dir/data`) on a
/// free loopback port, logging warnings only: the process, its address and the admin
/// token. It may not be listening yet.
pub fn start_single_node(
    binary: &Path,
    dir: &Path,
) -> Result<(NodeProcess, String, String), String> {
    let keys = dir.join("keys");
    let admin = keygen(binary, &keys)?;
    let addr = free_loopback_addr()?;
    let child = std::process::Command::new(binary)
        .args(node_run_args(
            1,
            std::slice::from_ref(&addr),
            &dir.join("data"),
            &keys,
        ))
        .env("LINEAGE_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|e| format!("{}: {e}", binary.display()))?;
    Ok((NodeProcess(child), addr, admin))
}

/// The policy every benchmark's agents get: one tool, `work`, costing 1, with a budget
/// and a request rate no load reaches. `limits` is this build's; the reference guard
/// server ignores fields it does not know.
pub fn unbounded_policy() -> serde_json::Value {
    serde_json::json!({"budget": u64::MAX / 2, "scar_limit": 10, "tools": {"work": {"cost": 1}}, "limits": {"max_requests_per_minute": u32::MAX}})
}

/// Creates agents `agent-0..agents` through the node at `url` as `admin`, each with
/// `policy`; their tokens. An answer without a token is an error naming the agent, the
/// status and the answer.
pub async fn create_agents(
    http: &reqwest::Client,
    url: &str,
    admin: &str,
    agents: usize,
    policy: &serde_json::Value,
) -> Result<Vec<String>, String> {
    let mut tokens = Vec::new();
    for a in 0..agents {
        let body = serde_json::json!({"agent_id": format!("agent-{a}"), "policy": policy});
        let reply = http
            .post(format!("{url}/v1/agents"))
            .bearer_auth(admin)
            .json(&body)
            .send()
            .await
            .map_err(|e| e.to_string())?;
        let status = reply.status();
        let reply: serde_json::Value = reply.json().await.map_err(|e| e.to_string())?;
        let token = reply["token"].as_str().filter(|_| status.is_success());
        tokens.push(
            token
                .ok_or_else(|| format!("creating agent-{a}: {status} {reply}"))?
                .to_string(),
        );
    }
    Ok(tokens)
}

/// The median of `values` (the mean of the middle two for an even count; 0 for none).
pub fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    match values.len() {
        0 => 0.0,
        n if n.is_multiple_of(2) => (values[mid - 1] + values[mid]) / 2.0,
        _ => values[mid],
    }
}

/// A `kB` field of a `/proc/PID/status` text (`VmRSS:`, `VmHWM:`, `RssAnon:`), in bytes.
pub fn status_field_bytes(status: &str, field: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .map(|kb| kb * 1024)
}

/// Bytes of the files under `path` (their lengths, as `du -sb` counts them).
pub fn du_bytes(path: &Path) -> u64 {
    sum_files(path, &|m| m.len())
}

/// Bytes of disk the files under `path` take (`du -s --block-size=1`): their allocated
/// blocks, so a file's never-written (sparse) stretch counts nothing. redb grows its file
/// by doubling it (below 4 GiB), and the grown tail is sparse until pages are written
/// there: the file's length says how far it may grow before asking for more, its blocks
/// what it holds.
pub fn du_block_bytes(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    // st_blocks counts 512-byte units, whatever the file system's block size.
    sum_files(path, &|m| m.blocks() * 512)
}

/// `bytes` of every file under `path`, summed (unreadable entries count nothing).
fn sum_files(path: &Path, bytes: &dyn Fn(&std::fs::Metadata) -> u64) -> u64 {
    let mut total = 0;
    if let Ok(entries) = std::fs::read_dir(path) {
        for entry in entries.flatten() {
            match entry.metadata() {
                Ok(m) if m.is_dir() => total += sum_files(&entry.path(), bytes),
                Ok(m) => total += bytes(&m),
                Err(_) => {}
            }
        }
    }
    total
}

/// GET `url` with `token` as the bearer; the answer's body as JSON.
pub async fn get_json(
    http: &reqwest::Client,
    url: &str,
    token: &str,
) -> Result<serde_json::Value, String> {
    http.get(url)
        .bearer_auth(token)
        .send()
        .await
        .map_err(|e| e.to_string())?
        .json()
        .await
        .map_err(|e| e.to_string())
}

/// The bytes the reference guard would store for agents `agent-0..agents`' records: each
/// record's line (`Record::to_line`) and its newline, in its JSONL file. Read through
/// the node's log pages at `url`.
pub async fn line_bytes(
    http: &reqwest::Client,
    url: &str,
    admin: &str,
    agents: usize,
) -> Result<u64, String> {
    let mut total = 0u64;
    for a in 0..agents {
        let mut after: Option<u64> = None;
        // Bounded: each page moves `after` forward, and a log has at most u64::MAX records.
        loop {
            let mut page_url = format!("{url}/v1/agents/agent-{a}/log?limit=5000");
            if let Some(after) = after {
                page_url.push_str(&format!("&after={after}"));
            }
            let page = get_json(http, &page_url, admin).await?;
            let records = page["records"]
                .as_array()
                .ok_or("a log page without records")?;
            let Some(last) = records.last() else {
                break;
            };
            for record in records {
                let record: lineage_core::Record =
                    serde_json::from_value(record.clone()).map_err(|e| e.to_string())?;
                total += record.to_line().len() as u64 + 1;
            }
            after = Some(last["seq"].as_u64().ok_or("a record without a seq")?);
        }
    }
    Ok(total)
}

/// Records per second one core verifies the way the reference does (`Verifier`, one
/// line after another: parse, hash, chain, signature), over a log of `records` sealed
/// here: the baseline for a node's verify rate.
pub fn one_core_verify_rate(records: u64) -> Result<f64, String> {
    use lineage_core::record::{timestamp, Record, ZERO_HASH};
    let key = AuditKey::from_seed([7; 32]);
    let genesis = Record::seal(
        &key,
        0,
        timestamp::format(0),
        "bench",
        "genesis",
        serde_json::json!({"log_id": "bench", "public_key": key.public_key_hex()}),
        ZERO_HASH,
    );
    let mut lines = vec![genesis.to_line()];
    let mut prev = genesis.hash;
    for seq in 1..records.max(2) {
        let record = Record::seal(
            &key,
            seq,
            timestamp::format(seq as i64),
            "bench",
            "action_requested",
            serde_json::json!({"tool": "work", "input": {"n": seq}}),
            &prev,
        );
        lines.push(record.to_line());
        prev = record.hash;
    }
    let started = Instant::now();
    let mut verifier = lineage_core::verify::Verifier::new(Default::default());
    for line in &lines {
        verifier
            .push_line(line.as_bytes())
            .map_err(|e| e.to_string())?;
    }
    verifier.finish().map_err(|e| e.to_string())?;
    Ok(lines.len() as f64 / started.elapsed().as_secs_f64())
}

/// Where the `report` driver collects figures: when `LINEAGE_BENCH_FIGURES` names a
/// file, each figure is appended to it as one JSON line, `{"name", "value", ...labels}`.
/// Without it, nothing is written (the benchmark's printed lines are its output).
pub fn figure(name: &str, value: f64, labels: serde_json::Value) {
    let Some(path) = std::env::var_os("LINEAGE_BENCH_FIGURES") else {
        return;
    };
    let mut line = match labels {
        serde_json::Value::Object(map) => map,
        _ => serde_json::Map::new(),
    };
    line.insert("name".into(), name.into());
    line.insert("value".into(), value.into());
    let text = format!("{}\n", serde_json::Value::Object(line));
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut file| std::io::Write::write_all(&mut file, text.as_bytes()));
    if let Err(e) = written {
        eprintln!(
            "figure {name}: cannot append to {}: {e}",
            path.to_string_lossy()
        );
    }
}

/// A node's count of durable Raft log writes so far, from its metrics. Each is two
/// fdatasyncs: the frames, then the watermark (`store::watermark`).
pub async fn log_write_count(http: &reqwest::Client, url: &str) -> Result<f64, String> {
    let text = http
        .get(format!("{url}/metrics"))
        .send()
        .await
        .map_err(|e| e.to_string())?
        .text()
        .await
        .map_err(|e| e.to_string())?;
    Ok(text
        .lines()
        .filter(|l| l.starts_with("lineage_raft_log_append_duration_seconds_count"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum())
}
