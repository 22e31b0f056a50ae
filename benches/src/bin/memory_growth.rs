//! Memory and disk against history: one `lineage-node` loaded to a small and then a large
//! number of records, with VmRSS and RssAnon read from /proc after the load (the last
//! `--small` records of it loaded into a freshly started process, at every size, so each
//! size's figure follows the same load and differs only by the history under it) and
//! after a restart at each size, the restart's time to the first decision, and the data
//! directory's bytes per record after a snapshot and a purge of the log
//! (`POST /v1/node/snapshot`), both its files' lengths (`du -sb`) and their allocated
//! blocks (redb's file has a sparse tail: `lineage_benches::du_block_bytes`), beside the
//! bytes the reference guard stores for the same records (their lines in a JSONL file)
//! and the ratios. A node whose memory
//! does not grow with history shows a large/small ratio near 1.
//!
//!   cargo build --release -p lineage-node -p lineage-benches
//!   target/release/memory_growth [--small 100000] [--large 1000000] [--agents 16]
//!     [--clients 16] [--input-bytes 200] [--repeated-input 0|1] [--baseline-node PATH]
//!
//! Inputs are random lowercase letters and spaces, unless `--repeated-input 1` (one
//! letter repeated): stored records are compressed, and these two bound how well.
//!
//! With `--baseline-node`, another build is measured the same way in the same run (after
//! ours), and each figure is also printed as a ratio to it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lineage_benches::sibling_binary;
use serde_json::json;

struct Node {
    binary: PathBuf,
    dir: tempfile::TempDir,
    url: String,
    addr: String,
    admin: String,
    child: Option<Child>,
}

impl Node {
    fn start(binary: &Path) -> Result<Node, String> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let keys = dir.path().join("keys");
        let admin = lineage_benches::keygen(binary, &keys)?;
        let addr = lineage_benches::free_loopback_addr()?;
        let mut node = Node {
            binary: binary.to_path_buf(),
            url: format!("http://{addr}"),
            addr,
            admin: admin.trim().to_string(),
            dir,
            child: None,
        };
        node.spawn()?;
        Ok(node)
    }

    fn spawn(&mut self) -> Result<(), String> {
        // For a look at what the node did (its start-up's phases, say): its log, appended
        // to the file `LINEAGE_BENCH_NODE_LOG` names.
        let log = match std::env::var_os("LINEAGE_BENCH_NODE_LOG") {
            Some(path) => Some(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&path)
                    .map_err(|e| format!("{}: {e}", PathBuf::from(&path).display()))?,
            ),
            None => None,
        };
        let child = Command::new(&self.binary)
            .args(lineage_benches::node_run_args(
                1,
                std::slice::from_ref(&self.addr),
                &self.data_dir(),
                &self.dir.path().join("keys"),
            ))
            .env("LINEAGE_LOG", if log.is_some() { "info" } else { "warn" })
            .stdout(Stdio::null())
            .stderr(log.map_or_else(Stdio::null, Stdio::from))
            .spawn()
            .map_err(|e| e.to_string())?;
        self.child = Some(child);
        Ok(())
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.path().join("node")
    }

    /// SIGTERM (a clean stop, which checkpoints), then start again.
    fn restart(&mut self) -> Result<(), String> {
        if let Some(mut child) = self.child.take() {
            let pid = child.id().to_string();
            let _ = Command::new("kill").args(["-TERM", &pid]).status();
            let status = child.wait().map_err(|e| e.to_string())?;
            if !status.success() {
                return Err(format!("the node stopped with {status}"));
            }
        }
        self.spawn()
    }

    /// (VmRSS, RssAnon) in bytes.
    fn memory(&self) -> Result<(u64, u64), String> {
        let pid = self.child.as_ref().ok_or("not running")?.id();
        let status =
            std::fs::read_to_string(format!("/proc/{pid}/status")).map_err(|e| e.to_string())?;
        let field = |name: &str| {
            lineage_benches::status_field_bytes(&status, name)
                .ok_or_else(|| format!("no {name} in /proc/{pid}/status"))
        };
        Ok((field("VmRSS:")?, field("RssAnon:")?))
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        // For a look inside the files afterwards (redb's table statistics, say).
        if std::env::var_os("LINEAGE_BENCH_KEEP_DATA").is_some() {
            self.dir.disable_cleanup(true);
            eprintln!("  data kept in {}", self.dir.path().display());
        }
    }
}

/// Where the data directory's bytes go, per record (stderr): each entry at its top, its
/// length and (after the slash) its allocated blocks.
fn print_disk_parts(dir: &Path, records: u64) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    use std::os::unix::fs::MetadataExt;
    let mut parts: Vec<(String, u64, u64)> = entries
        .flatten()
        .map(|entry| {
            let (bytes, blocks) = match entry.metadata() {
                Ok(m) if m.is_dir() => (
                    lineage_benches::du_bytes(&entry.path()),
                    lineage_benches::du_block_bytes(&entry.path()),
                ),
                Ok(m) => (m.len(), m.blocks() * 512),
                Err(_) => (0, 0),
            };
            (
                entry.file_name().to_string_lossy().into_owned(),
                bytes,
                blocks,
            )
        })
        .collect();
    parts.sort_by_key(|part| std::cmp::Reverse(part.1));
    let per_record = |bytes: u64| bytes as f64 / records.max(1) as f64;
    let line: Vec<String> = parts
        .iter()
        .filter(|(_, bytes, _)| *bytes > 0)
        .map(|(name, bytes, blocks)| {
            format!(
                "{name} {:.0}/{:.0}",
                per_record(*bytes),
                per_record(*blocks)
            )
        })
        .collect();
    eprintln!("  disk bytes per record: {}", line.join(", "));
}

/// Asks the node for a snapshot and a purge of its log (`POST /v1/node/snapshot`), so the
/// data directory is measured as it is after one. A build without the route (a baseline)
/// is measured as it is, and says so.
async fn snapshot_and_purge(http: &reqwest::Client, node: &Node) {
    let answer = http
        .post(format!("{}/v1/node/snapshot", node.url))
        .bearer_auth(&node.admin)
        .send()
        .await;
    match answer {
        Ok(reply) if reply.status().is_success() => {
            let body: serde_json::Value = reply.json().await.unwrap_or_default();
            eprintln!(
                "  snapshot at {}, log purged through {}",
                body["snapshot_index"], body["purged_index"]
            );
        }
        Ok(reply) => eprintln!("  no snapshot ({}): disk measured as it is", reply.status()),
        Err(e) => eprintln!("  no snapshot ({e}): disk measured as it is"),
    }
}

async fn wait_ready(http: &reqwest::Client, node: &Node) -> Result<(), String> {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(300) {
        if let Ok(r) = http.get(format!("{}/readyz", node.url)).send().await {
            if r.status().is_success() {
                return Ok(());
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Err("the node was not ready within 300 s".into())
}

struct Load {
    agents: usize,
    clients: usize,
    input_bytes: usize,
    /// Every input the same letter repeated (`--repeated-input 1`), as before 2026-12-05,
    /// instead of letters drawn at random: a bound on how well stored records compress,
    /// where the random letters (about 4.8 bits a byte) are the other.
    repeated_input: bool,
}

/// Decision `n`'s input text: `bytes` lowercase letters and spaces drawn from a
/// generator seeded by `n` (splitmix64), or one letter repeated.
fn input_text(n: u64, bytes: usize, repeated: bool) -> String {
    if repeated {
        return "x".repeat(bytes);
    }
    let mut state = n;
    let mut next = move || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    (0..bytes)
        .map(|_| match next() % 27 {
            26 => ' ',
            letter => char::from(b'a' + letter as u8),
        })
        .collect()
}

/// Sends decisions until the node holds about `records` records (2 per decision, plus
/// 2 per agent at creation).
async fn load_to(
    http: &reqwest::Client,
    node: &Node,
    tokens: &[String],
    load: &Load,
    records: u64,
) -> Result<(), String> {
    let held = du_records(http, node, tokens).await?;
    let decisions = records.saturating_sub(held) / 2;
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for c in 0..load.clients {
        let http = http.clone();
        let url = node.url.clone();
        let tokens = tokens.to_vec();
        let next = next.clone();
        let (input_bytes, repeated) = (load.input_bytes, load.repeated_input);
        let agents = load.agents;
        tasks.push(tokio::spawn(async move {
            loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= decisions {
                    return Ok::<(), String>(());
                }
                let a = (n as usize + c) % agents;
                let input = input_text(n, input_bytes, repeated);
                let reply = http
                    .post(format!("{url}/v1/agents/agent-{a}/actions"))
                    .bearer_auth(&tokens[a])
                    .json(&json!({"tool": "search", "input": {"query": input, "n": n}}))
                    .send()
                    .await
                    .map_err(|e| e.to_string())?;
                if !reply.status().is_success() {
                    return Err(format!("decision {n}: {}", reply.status()));
                }
            }
        }));
    }
    for task in tasks {
        task.await.map_err(|e| e.to_string())??;
    }
    Ok(())
}

/// Records the node holds, from the agents' heads.
async fn du_records(http: &reqwest::Client, node: &Node, tokens: &[String]) -> Result<u64, String> {
    let mut total = 0;
    for (a, token) in tokens.iter().enumerate() {
        let body: serde_json::Value =
            lineage_benches::get_json(http, &format!("{}/v1/agents/agent-{a}", node.url), token)
                .await?;
        total += body["head"]["seq"].as_u64().unwrap_or(0) + 1;
    }
    Ok(total)
}

/// One size's figures.
#[derive(Clone, Copy, Default)]
struct Figures {
    records: u64,
    rss_loaded: u64,
    anon_loaded: u64,
    rss_restarted: u64,
    anon_restarted: u64,
    first_decision: Duration,
    /// The data directory's file lengths (`du -sb`), per record.
    disk_per_record: f64,
    /// Its allocated blocks (`du -s --block-size=1`), per record: without the sparse tail
    /// of redb's file (`lineage_benches::du_block_bytes`).
    blocks_per_record: f64,
    /// What the reference stores per record: its line.
    line_per_record: f64,
}

async fn measure(binary: &Path, sizes: &[u64], load: &Load) -> Result<Vec<Figures>, String> {
    let http = reqwest::Client::new();
    let mut node = Node::start(binary)?;
    wait_ready(&http, &node).await?;
    let policy = json!({"budget": 1u64 << 50, "scar_limit": 10, "tools": {"search": {"cost": 1}}, "limits": {"max_requests_per_minute": u32::MAX}});
    let tokens =
        lineage_benches::create_agents(&http, &node.url, &node.admin, load.agents, &policy).await?;
    let mut out = Vec::new();
    let last_stretch = sizes.iter().copied().min().unwrap_or(0);
    for &size in sizes {
        let started = Instant::now();
        // Every size's "after load" follows the same load in a fresh process: the last
        // `last_stretch` records, after a restart. A process's memory under load climbs
        // for its first tens of seconds (allocator and caches filling; seen here: RssAnon
        // 94 MB after 3 s, a plateau of 170-187 MB from 20 s to 85 s), so a small size
        // loaded from nothing was measured before that plateau and a large one on it,
        // and the two read as growth with history.
        let restart_at = size.saturating_sub(last_stretch);
        if restart_at > 0 {
            load_to(&http, &node, &tokens, load, restart_at).await?;
            node.restart()?;
            wait_ready(&http, &node).await?;
        }
        load_to(&http, &node, &tokens, load, size).await?;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let records = du_records(&http, &node, &tokens).await?;
        eprintln!("  loaded {records} records in {:.0?}", started.elapsed());
        let (rss_loaded, anon_loaded) = node.memory()?;
        snapshot_and_purge(&http, &node).await;
        let restart = Instant::now();
        node.restart()?;
        wait_ready(&http, &node).await?;
        let reply = http
            .post(format!("{}/v1/agents/agent-0/actions", node.url))
            .bearer_auth(&tokens[0])
            .json(&json!({"tool": "search"}))
            .send()
            .await
            .map_err(|e| e.to_string())?;
        if !reply.status().is_success() {
            return Err(format!("first decision after restart: {}", reply.status()));
        }
        let first_decision = restart.elapsed();
        tokio::time::sleep(Duration::from_secs(1)).await;
        let (rss_restarted, anon_restarted) = node.memory()?;
        print_disk_parts(&node.data_dir(), records);
        let disk_per_record = lineage_benches::du_bytes(&node.data_dir()) as f64 / records as f64;
        let blocks_per_record =
            lineage_benches::du_block_bytes(&node.data_dir()) as f64 / records as f64;
        let line_per_record =
            lineage_benches::line_bytes(&http, &node.url, &node.admin, load.agents).await? as f64
                / records as f64;
        out.push(Figures {
            records,
            rss_loaded,
            anon_loaded,
            rss_restarted,
            anon_restarted,
            first_decision,
            disk_per_record,
            blocks_per_record,
            line_per_record,
        });
    }
    Ok(out)
}

fn mb(bytes: u64) -> f64 {
    bytes as f64 / 1e6
}

fn print(name: &str, figures: &[Figures], baseline: Option<&[Figures]>) {
    println!("{name}");
    println!(
        "  {:>9} {:>12} {:>12} {:>14} {:>14} {:>12} {:>10} {:>9} {:>12} {:>11} {:>10}",
        "records",
        "VmRSS load",
        "RssAnon load",
        "VmRSS restart",
        "RssAnon restart",
        "1st decision",
        "disk B/rec",
        "disk÷line",
        "blocks B/rec",
        "blocks÷line",
        "line B/rec"
    );
    for (i, f) in figures.iter().enumerate() {
        println!(
            "  {:>9} {:>10.1}MB {:>10.1}MB {:>12.1}MB {:>12.1}MB {:>12.2?} {:>10.0} {:>8.2}x {:>12.0} {:>10.2}x {:>10.0}",
            f.records,
            mb(f.rss_loaded),
            mb(f.anon_loaded),
            mb(f.rss_restarted),
            mb(f.anon_restarted),
            f.first_decision,
            f.disk_per_record,
            f.disk_per_record / f.line_per_record,
            f.blocks_per_record,
            f.blocks_per_record / f.line_per_record,
            f.line_per_record,
        );
        if let Some(base) = baseline.and_then(|b| b.get(i)) {
            println!(
                "  {:>9} {:>11.2}x {:>11.2}x {:>13.2}x {:>13.2}x {:>11.2}x {:>9.2}x {:>9} {:>11.2}x   (÷ baseline)",
                "",
                f.rss_loaded as f64 / base.rss_loaded as f64,
                f.anon_loaded as f64 / base.anon_loaded as f64,
                f.rss_restarted as f64 / base.rss_restarted as f64,
                f.anon_restarted as f64 / base.anon_restarted as f64,
                f.first_decision.as_secs_f64() / base.first_decision.as_secs_f64(),
                f.disk_per_record / base.disk_per_record,
                "",
                f.blocks_per_record / base.blocks_per_record,
            );
        }
    }
    if let (Some(small), Some(large)) = (figures.first(), figures.last()) {
        if figures.len() > 1 {
            println!(
                "  growth {}→{} records: VmRSS after restart {:.2}x, RssAnon after restart {:.2}x, after load {:.2}x",
                small.records,
                large.records,
                large.rss_restarted as f64 / small.rss_restarted as f64,
                large.anon_restarted as f64 / small.anon_restarted as f64,
                large.rss_loaded as f64 / small.rss_loaded as f64
            );
        }
    }
}

/// Each size's figures for the `report` driver, under the history size asked for.
fn report_figures(build: &str, sizes: &[u64], figures: &[Figures]) {
    for (size, f) in sizes.iter().zip(figures) {
        let labels = json!({"build": build, "nodes": 1, "history": size, "records": f.records});
        let figure = |name: &str, value: f64| lineage_benches::figure(name, value, labels.clone());
        figure("vmrss_after_load_bytes", f.rss_loaded as f64);
        figure("rssanon_after_load_bytes", f.anon_loaded as f64);
        figure("vmrss_after_restart_bytes", f.rss_restarted as f64);
        figure("rssanon_after_restart_bytes", f.anon_restarted as f64);
        figure(
            "first_decision_after_restart_s",
            f.first_decision.as_secs_f64(),
        );
        figure("purged_disk_bytes_per_record", f.disk_per_record);
        figure("purged_disk_block_bytes_per_record", f.blocks_per_record);
        figure("purged_line_bytes_per_record", f.line_per_record);
    }
}

/// Memory and disk of one node against history, at a small and a large size.
#[derive(clap::Parser)]
struct Args {
    /// Records at the small size.
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
    small: u64,
    /// Records at the large size.
    #[arg(long, default_value_t = 1_000_000, value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
    large: u64,
    /// Agents the records are spread over.
    #[arg(long, default_value_t = 16, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=10_000))]
    agents: usize,
    /// Clients loading them at once.
    #[arg(long, default_value_t = 16, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=256))]
    clients: usize,
    /// Bytes of each action's input.
    #[arg(long, default_value_t = 200, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(0..=1 << 20))]
    input_bytes: usize,
    /// 1: every input one letter repeated; 0: letters drawn at random.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=1))]
    repeated_input: u64,
    /// Another build measured the same way in the same run, for ratios.
    #[arg(long = "baseline-node")]
    baseline: Option<PathBuf>,
}

fn main() {
    let args = <Args as clap::Parser>::parse();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("memory_growth: runtime: {e}");
            std::process::exit(1);
        }
    };
    if let Err(e) = runtime.block_on(real_main(args)) {
        eprintln!("memory_growth: {e}");
        std::process::exit(1);
    }
}

async fn real_main(args: Args) -> Result<(), String> {
    let sizes = [args.small, args.large];
    let load = Load {
        agents: args.agents,
        clients: args.clients,
        input_bytes: args.input_bytes,
        repeated_input: args.repeated_input != 0,
    };
    let ours = sibling_binary("lineage-node", "-p lineage-node")?;
    let baseline = args.baseline;
    println!(
        "memory_growth: {} agents, {} clients, inputs of {} bytes ({}), sizes {:?}",
        load.agents,
        load.clients,
        load.input_bytes,
        if load.repeated_input {
            "one letter repeated"
        } else {
            "random letters"
        },
        sizes
    );
    eprintln!("this build: {}", ours.display());
    let mine = measure(&ours, &sizes, &load).await?;
    let base = match &baseline {
        Some(path) => {
            eprintln!("baseline: {}", path.display());
            Some(measure(path, &sizes, &load).await?)
        }
        None => None,
    };
    report_figures("this", &sizes, &mine);
    if let Some(base) = &base {
        report_figures("baseline", &sizes, base);
    }
    print("this build", &mine, base.as_deref());
    if let Some(base) = &base {
        print("baseline", base, None);
    }
    Ok(())
}
