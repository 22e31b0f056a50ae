//! Issue #17's side-by-side table: the same wrk loads, on one machine, against a server
//! that keeps the reference guard server's contract (one process, configured by
//! `GUARD_BIND`, `GUARD_DATA_DIR` and `GUARD_ADMIN_TOKEN`, serving the same HTTP API) and
//! against this build as a one-node and a three-node cluster. The three take turns
//! (reference, one node, three nodes; then the other way round), each started afresh.
//!
//! Rows: decisions/s with 16 connections over 16 agents, 16 connections on one agent
//! and one connection (sequential), p50 with one connection and p99 at 16x16. Then,
//! for one process each, started afresh and loaded to `--history` records: the time
//! from a restart (SIGTERM, start again) to the first decision, VmRSS after it, and then
//! the data directory's bytes per record, by length (`du -sb`) and by allocated blocks,
//! after `POST /v1/node/snapshot` where the server has it (ours then purges its Raft
//! log; the reference answers 404 and is measured as it is). Each of ours comes as its
//! ratio to the reference in the same round, as a range over the rounds.
//!
//!   apt-get install wrk
//!   cargo build --release -p lineage-node -p lineage-benches
//!   target/release/side_by_side [--reference PATH] [--node PATH] [--seconds 10]
//!     [--rounds 2] [--history 300000]
//!
//! Without `--reference`, this build's own drop-in mode (`lineage-node` with no
//! subcommand, which keeps that contract) stands in: that checks the harness, and
//! measures what moving over without a cluster gives. The reference's binary itself is
//! not on this machine.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lineage_benches::wrk::{self, WrkReport};
use lineage_benches::NodeProcess;
use serde_json::{json, Value};

#[derive(clap::Parser)]
struct Args {
    /// A server keeping the reference's contract (default: this build's drop-in mode).
    #[arg(long)]
    reference: Option<PathBuf>,
    /// The lineage-node build measured (default: the one beside this program).
    #[arg(long)]
    node: Option<PathBuf>,
    /// Seconds each load runs.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=300))]
    seconds: u64,
    /// Rounds, each running all three in turn.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=10))]
    rounds: u64,
    /// Records loaded before the restart and disk rows (0 leaves those rows out).
    #[arg(long, default_value_t = 300_000, value_parser = clap::value_parser!(u64).range(0..=10_000_000))]
    history: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Contestant {
    Reference,
    OneNode,
    ThreeNodes,
}

impl Contestant {
    fn name(self) -> &'static str {
        match self {
            Contestant::Reference => "reference",
            Contestant::OneNode => "ours, 1 node",
            Contestant::ThreeNodes => "ours, 3 nodes",
        }
    }
}

/// How to start one process (again, after a restart).
struct Launch {
    program: PathBuf,
    args: Vec<OsString>,
    env: Vec<(&'static str, String)>,
}

impl Launch {
    fn spawn(&self) -> Result<NodeProcess, String> {
        Command::new(&self.program)
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .env("LINEAGE_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map(NodeProcess)
            .map_err(|e| format!("{}: {e}", self.program.display()))
    }
}

/// The processes of one contestant, in a directory of their own.
struct Server {
    launches: Vec<Launch>,
    processes: Vec<NodeProcess>,
    urls: Vec<String>,
    admin: String,
    data_dirs: Vec<PathBuf>,
    _dir: tempfile::TempDir,
}

impl Server {
    /// An error naming the first process that has exited, if any has.
    fn check_running(&mut self) -> Result<(), String> {
        for process in &mut self.processes {
            if let Some(status) = process.0.try_wait().map_err(|e| e.to_string())? {
                return Err(format!("a server process exited: {status}"));
            }
        }
        Ok(())
    }
}

/// The admin token the reference is given (it wants at least 32 characters).
const REFERENCE_ADMIN_TOKEN: &str = "side-by-side-admin-token-on-loopback-only";

fn start(contestant: Contestant, reference: &Path, node: &Path) -> Result<Server, String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let (launches, urls, admin, data_dirs) = match contestant {
        Contestant::Reference => {
            let addr = lineage_benches::free_loopback_addr()?;
            let data = dir.path().join("guard-data");
            let env = vec![
                ("GUARD_BIND", addr.clone()),
                ("GUARD_DATA_DIR", data.display().to_string()),
                ("GUARD_ADMIN_TOKEN", REFERENCE_ADMIN_TOKEN.to_string()),
            ];
            let launch = Launch {
                program: reference.to_path_buf(),
                args: Vec::new(),
                env,
            };
            let urls = vec![format!("http://{addr}")];
            (
                vec![launch],
                urls,
                REFERENCE_ADMIN_TOKEN.to_string(),
                vec![data],
            )
        }
        Contestant::OneNode | Contestant::ThreeNodes => {
            let nodes = if contestant == Contestant::OneNode {
                1
            } else {
                3
            };
            let keys = dir.path().join("keys");
            let admin = lineage_benches::keygen(node, &keys)?;
            let addrs: Vec<String> = (0..nodes)
                .map(|_| lineage_benches::free_loopback_addr())
                .collect::<Result<_, _>>()?;
            let data_dirs: Vec<PathBuf> = (1..=nodes)
                .map(|id| dir.path().join(format!("node-{id}")))
                .collect();
            let launches = data_dirs
                .iter()
                .enumerate()
                .map(|(i, data)| Launch {
                    program: node.to_path_buf(),
                    args: lineage_benches::node_run_args(i + 1, &addrs, data, &keys),
                    env: Vec::new(),
                })
                .collect();
            let urls = addrs.iter().map(|a| format!("http://{a}")).collect();
            (launches, urls, admin.trim().to_string(), data_dirs)
        }
    };
    let processes = launches
        .iter()
        .map(Launch::spawn)
        .collect::<Result<_, _>>()?;
    Ok(Server {
        launches,
        processes,
        urls,
        admin,
        data_dirs,
        _dir: dir,
    })
}

/// The URL decisions go to once the server answers: the leader's for a cluster (as a
/// client finds it), the one process's otherwise (the reference has no `/v1/cluster`).
async fn serving_url(http: &reqwest::Client, server: &mut Server) -> Result<String, String> {
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(60) {
        server.check_running()?;
        let cluster = http
            .get(format!("{}/v1/cluster", server.urls[0]))
            .bearer_auth(&server.admin)
            .send()
            .await;
        match cluster {
            Ok(r) if r.status() == reqwest::StatusCode::NOT_FOUND => {
                return Ok(server.urls[0].clone());
            }
            Ok(r) if r.status().is_success() => {
                let body: Value = r.json().await.map_err(|e| e.to_string())?;
                let leader = body["leader"].as_u64().and_then(|id| id.checked_sub(1));
                if let Some(url) = leader.and_then(|i| server.urls.get(i as usize)) {
                    return Ok(url.clone());
                }
            }
            _ => {}
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err("the server did not answer (with a leader) in 60 s".into())
}

/// The three loads of the table, in order: 16 connections over 16 agents, 16 on one
/// agent, one connection.
fn loads(url: &str, tokens: &[String], seconds: u64) -> Result<[WrkReport; 3], String> {
    let every_agent: Vec<String> = tokens
        .iter()
        .enumerate()
        .map(|(a, token)| wrk::decide_request(&format!("agent-{a}"), token))
        .collect();
    let one_agent = [wrk::decide_request("agent-0", &tokens[0])];
    let spread = wrk::run(url, &wrk::round_robin(&every_agent), 16, seconds)?;
    let crowded = wrk::run(url, &wrk::round_robin(&one_agent), 16, seconds)?;
    let sequential = wrk::run(url, &wrk::round_robin(&one_agent), 1, seconds)?;
    Ok([spread, crowded, sequential])
}

/// A contestant started afresh, answering, with agents `agent-0..16`.
struct Started {
    http: reqwest::Client,
    server: Server,
    /// Where decisions go (`serving_url`).
    url: String,
    tokens: Vec<String>,
}

async fn start_with_agents(
    contestant: Contestant,
    reference: &Path,
    node: &Path,
) -> Result<Started, String> {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .map_err(|e| e.to_string())?;
    let mut server = start(contestant, reference, node)?;
    let url = serving_url(&http, &mut server).await?;
    let tokens = lineage_benches::create_agents(
        &http,
        &url,
        &server.admin,
        16,
        &lineage_benches::unbounded_policy(),
    )
    .await?;
    Ok(Started {
        http,
        server,
        url,
        tokens,
    })
}

/// What a one-process contestant shows with a history.
#[derive(Clone, Copy)]
struct History {
    records: u64,
    restart_to_first_decision: Duration,
    vmrss_after_restart: u64,
    /// `du -sb`: the files' lengths.
    disk_per_record: f64,
    /// Their allocated blocks (redb's file has a sparse tail until written).
    disk_blocks_per_record: f64,
}

/// Records in `agent-0..agents`' logs (each status's head seq, plus one).
async fn records(
    http: &reqwest::Client,
    url: &str,
    admin: &str,
    agents: usize,
) -> Result<u64, String> {
    let mut total = 0;
    for a in 0..agents {
        let status =
            lineage_benches::get_json(http, &format!("{url}/v1/agents/agent-{a}"), admin).await?;
        let seq = status["head"]["seq"]
            .as_u64()
            .ok_or_else(|| format!("agent-{a}'s status has no head: {status}"))?;
        total += seq + 1;
    }
    Ok(total)
}

/// Decisions until the logs hold about `target` records (two a decision), 16 at a time.
async fn load_history(url: &str, tokens: &[String], have: u64, target: u64) -> Result<(), String> {
    let left = Arc::new(AtomicU64::new(target.saturating_sub(have) / 2));
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .map_err(|e| e.to_string())?;
    let mut tasks = Vec::new();
    for (a, token) in tokens.iter().enumerate() {
        let (http, left, token) = (http.clone(), left.clone(), token.clone());
        let action = format!("{url}/v1/agents/agent-{a}/actions");
        tasks.push(tokio::spawn(async move {
            // Bounded by the shared count.
            while left
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                .is_ok()
            {
                let reply = http
                    .post(&action)
                    .bearer_auth(&token)
                    .json(&json!({"tool": "work", "input": {"history": true}}))
                    .send()
                    .await
                    .map_err(|e| e.to_string())?;
                if !reply.status().is_success() {
                    return Err(format!("a history decision got {}", reply.status()));
                }
            }
            Ok::<(), String>(())
        }));
    }
    for task in tasks {
        task.await.map_err(|e| e.to_string())??;
    }
    Ok(())
}

/// Stops the one process (SIGTERM, then SIGKILL after 60 s), starts it again, and times
/// its first decision; then its VmRSS.
async fn restart(
    http: &reqwest::Client,
    server: &mut Server,
    token: &str,
) -> Result<(Duration, u64), String> {
    let mut old = server.processes.pop().ok_or("no process to restart")?;
    let signalled = Command::new("kill")
        .args(["-TERM", &old.0.id().to_string()])
        .status()
        .map_err(|e| format!("kill: {e}"))?;
    if !signalled.success() {
        return Err(format!("kill -TERM {}: {signalled}", old.0.id()));
    }
    let stopping = Instant::now();
    while old.0.try_wait().map_err(|e| e.to_string())?.is_none() {
        if stopping.elapsed() > Duration::from_secs(60) {
            break; // Dropping it kills it.
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(old);
    let started = Instant::now();
    server.processes.push(server.launches[0].spawn()?);
    let action = format!("{}/v1/agents/agent-0/actions", server.urls[0]);
    loop {
        server.check_running()?;
        let reply = http
            .post(&action)
            .bearer_auth(token)
            .json(&json!({"tool": "work", "input": {"after": "restart"}}))
            .send()
            .await;
        if reply.is_ok_and(|r| r.status().is_success()) {
            break;
        }
        if started.elapsed() > Duration::from_secs(600) {
            return Err("no decision within 600 s of the restart".into());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let first = started.elapsed();
    let pid = server.processes[0].0.id();
    let status =
        std::fs::read_to_string(format!("/proc/{pid}/status")).map_err(|e| e.to_string())?;
    let rss = lineage_benches::status_field_bytes(&status, "VmRSS:")
        .ok_or_else(|| format!("no VmRSS in /proc/{pid}/status"))?;
    Ok((first, rss))
}

/// A fresh process of `contestant` with its logs loaded to `target` records: the
/// restart to the first decision and VmRSS after it, then the data directory's bytes per
/// record after a snapshot where the server has one (ours must take it; the reference
/// answers 404), so the restart replays what a running server would, not a fresh
/// snapshot.
async fn history(
    contestant: Contestant,
    reference: &Path,
    node: &Path,
    target: u64,
) -> Result<History, String> {
    let Started {
        http,
        mut server,
        url,
        tokens,
    } = start_with_agents(contestant, reference, node).await?;
    let have = records(&http, &url, &server.admin, tokens.len()).await?;
    load_history(&url, &tokens, have, target).await?;
    let total = records(&http, &url, &server.admin, tokens.len()).await?;
    let (restart_to_first_decision, vmrss_after_restart) =
        restart(&http, &mut server, &tokens[0]).await?;
    let snapshot = http
        .post(format!("{url}/v1/node/snapshot"))
        .bearer_auth(&server.admin)
        .timeout(Duration::from_secs(600))
        .send()
        .await
        .map_err(|e| format!("POST /v1/node/snapshot: {e}"))?
        .status();
    let taken = snapshot.is_success();
    if !taken && (contestant != Contestant::Reference || snapshot != reqwest::StatusCode::NOT_FOUND)
    {
        return Err(format!("POST /v1/node/snapshot answered {snapshot}"));
    }
    let disk = lineage_benches::du_bytes(&server.data_dirs[0]);
    let blocks = lineage_benches::du_block_bytes(&server.data_dirs[0]);
    if disk == 0 || blocks == 0 {
        return Err(format!(
            "nothing on disk under {}",
            server.data_dirs[0].display()
        ));
    }
    println!(
        "    history: {total} records; first decision {:.2} s after a restart; VmRSS {:.1} MB; {}{:.1} MB on disk ({:.1} MB allocated)",
        restart_to_first_decision.as_secs_f64(),
        vmrss_after_restart as f64 / 1e6,
        if taken { "after a snapshot, " } else { "" },
        disk as f64 / 1e6,
        blocks as f64 / 1e6,
    );
    Ok(History {
        records: total,
        restart_to_first_decision,
        vmrss_after_restart,
        disk_per_record: disk as f64 / total.max(1) as f64,
        disk_blocks_per_record: blocks as f64 / total.max(1) as f64,
    })
}

/// One contestant's figures in one round.
struct Figures {
    loads: [WrkReport; 3],
    history: Option<History>,
}

async fn measure(
    contestant: Contestant,
    reference: &Path,
    node: &Path,
    args: &Args,
) -> Result<Figures, String> {
    let Started {
        server,
        url,
        tokens,
        ..
    } = start_with_agents(contestant, reference, node).await?;
    let loads = loads(&url, &tokens, args.seconds)?;
    drop(server);
    for (name, load) in ["16 over 16 agents", "16 on one agent", "one connection"]
        .iter()
        .zip(&loads)
    {
        println!(
            "    {name}: {:.0} decisions/s, p50 {:.2} ms, p99 {:.2} ms, {} errors",
            load.per_second,
            load.p50.as_secs_f64() * 1e3,
            load.p99.as_secs_f64() * 1e3,
            load.errors
        );
        if load.errors > 0 {
            return Err(format!(
                "{} answered {} requests with errors",
                contestant.name(),
                load.errors
            ));
        }
    }
    let history = if args.history > 0 && contestant != Contestant::ThreeNodes {
        Some(history(contestant, reference, node, args.history).await?)
    } else {
        None
    };
    Ok(Figures { loads, history })
}

/// `1234567.8` as `1,234,568`.
fn grouped(value: f64) -> String {
    let digits = format!("{:.0}", value.max(0.0));
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// `low–high` of `values` shown by `show` (one value if they agree).
fn range(values: &[f64], show: &dyn Fn(f64) -> String) -> String {
    let low = values.iter().copied().fold(f64::INFINITY, f64::min);
    let high = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if values.is_empty() {
        "–".into()
    } else if show(low) == show(high) {
        show(low)
    } else {
        format!("{}–{}", show(low), show(high))
    }
}

type Row = (&'static str, fn(&Figures) -> Option<f64>, fn(f64) -> String);

fn print_table(rounds: &[BTreeMap<Contestant, Figures>]) {
    let rows: [Row; 10] = [
        (
            "16 connections over 16 agents, decisions/s",
            |f| Some(f.loads[0].per_second),
            grouped,
        ),
        (
            "16 connections on 1 agent, decisions/s",
            |f| Some(f.loads[1].per_second),
            grouped,
        ),
        (
            "1 connection, sequential, decisions/s",
            |f| Some(f.loads[2].per_second),
            grouped,
        ),
        (
            "p50 with 1 connection, ms",
            |f| Some(f.loads[2].p50.as_secs_f64() * 1e3),
            |v| format!("{v:.2}"),
        ),
        (
            "p99 at 16x16, ms",
            |f| Some(f.loads[0].p99.as_secs_f64() * 1e3),
            |v| format!("{v:.1}"),
        ),
        (
            "records in the history",
            |f| Some(f.history?.records as f64),
            grouped,
        ),
        (
            "restart with the history, to the first decision, s",
            |f| Some(f.history?.restart_to_first_decision.as_secs_f64()),
            |v| format!("{v:.2}"),
        ),
        (
            "VmRSS after that restart, MB",
            |f| Some(f.history?.vmrss_after_restart as f64 / 1e6),
            |v| format!("{v:.0}"),
        ),
        (
            "data on disk per record, B (du -sb)",
            |f| Some(f.history?.disk_per_record),
            grouped,
        ),
        (
            "data on disk per record, B (allocated)",
            |f| Some(f.history?.disk_blocks_per_record),
            grouped,
        ),
    ];
    println!("\n| measure (same machine, same run) | reference | ours, 1 node | ours, 3 nodes |");
    println!("|---|---|---|---|");
    for (name, value, show) in rows {
        let of = |c: Contestant| -> Vec<f64> {
            rounds.iter().filter_map(|r| value(r.get(&c)?)).collect()
        };
        let ratios = |c: Contestant| -> Vec<f64> {
            rounds
                .iter()
                .filter_map(|r| Some(value(r.get(&c)?)? / value(r.get(&Contestant::Reference)?)?))
                .collect()
        };
        let ours = |c: Contestant| match of(c) {
            v if v.is_empty() => "–".to_string(),
            v => format!(
                "{} ({}x)",
                range(&v, &show),
                range(&ratios(c), &|r| format!("{r:.2}"))
            ),
        };
        println!(
            "| {name} | {} | {} | {} |",
            range(&of(Contestant::Reference), &show),
            ours(Contestant::OneNode),
            ours(Contestant::ThreeNodes)
        );
    }
    println!("(ratios: ours ÷ the reference in the same round; for p50, p99, restart, VmRSS and disk, lower is better)");
}

async fn run(args: Args) -> Result<(), String> {
    let node = match &args.node {
        Some(path) => path.clone(),
        None => lineage_benches::sibling_binary("lineage-node", "-p lineage-node")?,
    };
    let reference = args.reference.clone().unwrap_or_else(|| node.clone());
    println!(
        "reference: {}{}; ours: {}",
        reference.display(),
        if args.reference.is_none() {
            " (this build's drop-in mode standing in)"
        } else {
            ""
        },
        node.display()
    );
    let mut rounds = Vec::new();
    for round in 0..args.rounds {
        let mut order = [
            Contestant::Reference,
            Contestant::OneNode,
            Contestant::ThreeNodes,
        ];
        if round % 2 == 1 {
            order.reverse();
        }
        let mut figures = BTreeMap::new();
        for contestant in order {
            println!("round {}: {}", round + 1, contestant.name());
            figures.insert(
                contestant,
                measure(contestant, &reference, &node, &args).await?,
            );
        }
        rounds.push(figures);
    }
    print_table(&rounds);
    Ok(())
}

fn main() {
    let args = <Args as clap::Parser>::parse();
    let outcome = tokio::runtime::Runtime::new()
        .map_err(|e| e.to_string())
        .and_then(|runtime| runtime.block_on(run(args)));
    lineage_benches::exit_on_error("side_by_side", outcome);
}
