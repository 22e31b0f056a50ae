//! Load benchmark: N concurrent clients over M agents against a 1-node and a 3-node
//! cluster of real `lineage-node` processes on loopback. Reports decisions/s and p50/p99
//! latency, checks afterwards that every node holds identical logs, and measures the
//! machine's ceiling in the same run (records signed per second on one core, durable
//! commits per second) so the figures read as ratios.
//!
//! Build the node first, then run:
//!   cargo build --release -p lineage-node -p lineage-benches
//!   target/release/cluster_load [--clients 16] [--agents 16] [--seconds 10] [--nodes N]
//!     [--history RECORDS] (load that many records first; then also each node's VmRSS,
//!                         disk bytes per record and verify rate at that history)
//!     [--baseline-node PATH]   (alternating rounds against another build, with ratios)
//!     [--node PATH]      (measure that lineage-node build instead of the sibling one)
//!     [--no-early-ack]   (nodes run with --leader-early-ack false)
//!     [--reqwest]        (clients use reqwest, as before: about twice the generator's CPU)
//!     [--wrk]            (the load comes from wrk, an external generator, instead:
//!                         `apt-get install wrk`; --clients connections, 2 threads)
//!     [--tls]            (with --wrk: this build over plain HTTP, the baseline, against
//!                         this build with TLS between nodes and to wrk, alternating)
//!     [--idempotency-keys] (each request carries its own Idempotency-Key, as both
//!                         clients send: every decision also stores its answer; with
//!                         --wrk too)
//!     [--reads]          (with --wrk: each request reads its agent's status instead, a
//!                         linearizable read, so figures are reads where they say
//!                         decisions)
//!
//! Each node's line gives its CPU time per decision (user + system): on a shared machine
//! that varies far less than decisions/s, so compare builds by it. The `machine` line
//! says how busy the CPUs were and what the load generator itself took, since nodes and
//! clients share them. So the clients are lean: each holds one keep-alive HTTP/1.1
//! connection through hyper, with its request's body and headers built once.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lineage_core::record::{timestamp, Record};
use lineage_core::AuditKey;
use serde_json::{json, Value};

/// Decisions/s and latency of real nodes on loopback, with the machine's ceilings.
#[derive(clap::Parser)]
struct Args {
    /// Clients (with --wrk: connections), spread over the agents.
    #[arg(long, default_value_t = 16, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=256))]
    clients: usize,
    /// Agents the clients write to.
    #[arg(long, default_value_t = 16, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=10_000))]
    agents: usize,
    /// Seconds each measured load runs.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=300))]
    seconds: u64,
    /// Only this cluster size (default: a 1-node and a 3-node cluster).
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=7))]
    nodes: Option<usize>,
    /// Start the nodes with `--leader-early-ack false`.
    #[arg(long)]
    no_early_ack: bool,
    /// Clients send through reqwest (the generator before its clients went lean).
    #[arg(long)]
    reqwest: bool,
    /// The load comes from `wrk` (its connections spread over the agents request by request).
    #[arg(long)]
    wrk: bool,
    /// Compare this build over plain HTTP with this build over TLS.
    #[arg(long, requires = "wrk")]
    tls: bool,
    /// Every request carries an Idempotency-Key of its own.
    #[arg(long)]
    idempotency_keys: bool,
    /// Each request is a linearizable read of its agent's status (`GET /v1/agents/{id}`).
    #[arg(long, requires = "wrk", conflicts_with = "idempotency_keys")]
    reads: bool,
    /// Another `lineage-node` build to measure against, in alternating rounds.
    #[arg(long = "baseline-node")]
    baseline: Option<std::path::PathBuf>,
    /// The `lineage-node` build to measure (default: the one built beside this program).
    #[arg(long)]
    node: Option<std::path::PathBuf>,
    /// Records to load before the measured load, so it runs against that much history;
    /// then each node's VmRSS, disk bytes per record and verify rate are reported too.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=100_000_000))]
    history: u64,
}

struct Cluster {
    children: Vec<Child>,
    urls: Vec<String>,
    admin: String,
    /// The CA the nodes' certificates chain to, when they speak TLS.
    ca: Option<std::path::PathBuf>,
    _dir: tempfile::TempDir,
    /// Each node's data directory, in node order.
    data_dirs: Vec<std::path::PathBuf>,
}

impl Cluster {
    /// Each node's CPU time so far (user + system, all threads). CPU per decision varies
    /// far less than throughput on a shared machine.
    fn cpu_times(&self) -> Vec<Option<Duration>> {
        self.children
            .iter()
            .map(|child| process_cpu(&child.id().to_string()))
            .collect()
    }
}

/// A process's CPU time so far (user + system, all threads), from Linux's
/// `/proc/PID/stat` in 10 ms ticks; `pid` may be `self`.
fn process_cpu(pid: &str) -> Option<Duration> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which is in parentheses: utime is the 12th, stime
    // the 13th.
    let fields: Vec<&str> = text.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(Duration::from_millis(ticks * 10))
}

/// The whole machine's CPU ticks so far from `/proc/stat`, summed over its CPUs.
#[derive(Clone, Copy)]
struct MachineTicks {
    /// user, nice, system, irq and softirq.
    busy: u64,
    /// Taken by the hypervisor for others.
    steal: u64,
    total: u64,
}

fn machine_ticks() -> Option<MachineTicks> {
    let text = std::fs::read_to_string("/proc/stat").ok()?;
    // user nice system idle iowait irq softirq steal (guest time is inside user).
    let ticks: Vec<u64> = text
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(|t| t.parse().ok())
        .collect::<Option<_>>()?;
    let [user, nice, system, _idle, _iowait, irq, softirq, steal] = ticks[..] else {
        return None;
    };
    Some(MachineTicks {
        busy: user + nice + system + irq + softirq,
        steal,
        total: ticks.iter().sum::<u64>().max(1),
    })
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn start_cluster(
    binary: &Path,
    nodes: usize,
    no_early_ack: bool,
    tls: bool,
) -> Result<Cluster, String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let keys = dir.path().join("keys");
    let admin = lineage_benches::keygen(binary, &keys)?;
    let addrs: Vec<String> = (0..nodes)
        .map(|_| lineage_benches::free_loopback_addr())
        .collect::<Result<_, _>>()?;
    let tls_dir = dir.path().join("tls");
    if tls {
        let mut certs = Command::new(binary);
        certs.arg("certs").arg("--out").arg(&tls_dir);
        for i in 0..nodes {
            certs.args(["--node", &format!("{}=127.0.0.1", i + 1)]);
        }
        let ok = certs
            .stdout(Stdio::null())
            .status()
            .map_err(|e| e.to_string())?;
        if !ok.success() {
            return Err("lineage-node certs failed".into());
        }
    }
    let mut children = Vec::new();
    for i in 0..nodes {
        let child = Command::new(binary)
            .args(lineage_benches::node_run_args(
                i + 1,
                &addrs,
                &data_dir(dir.path(), i),
                &keys,
            ))
            .args(
                no_early_ack
                    .then_some(["--leader-early-ack", "false"])
                    .into_iter()
                    .flatten(),
            )
            .args(
                tls.then(|| {
                    let file = |name: String| tls_dir.join(name).display().to_string();
                    [
                        "--tls-cert".to_string(),
                        file(format!("node-{}.pem", i + 1)),
                        "--tls-key".into(),
                        file(format!("node-{}.key", i + 1)),
                        "--tls-ca".into(),
                        file("ca.pem".into()),
                    ]
                })
                .into_iter()
                .flatten(),
            )
            .env("LINEAGE_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| e.to_string())?;
        children.push(child);
    }
    let scheme = if tls { "https" } else { "http" };
    Ok(Cluster {
        children,
        urls: addrs.iter().map(|a| format!("{scheme}://{a}")).collect(),
        admin,
        ca: tls.then(|| tls_dir.join("ca.pem")),
        data_dirs: (0..nodes).map(|i| data_dir(dir.path(), i)).collect(),
        _dir: dir,
    })
}

fn data_dir(cluster_dir: &Path, index: usize) -> std::path::PathBuf {
    cluster_dir.join(format!("node-{}", index + 1))
}

async fn wait_ready(http: &reqwest::Client, cluster: &Cluster) -> Result<(), String> {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(20) {
        let reply = http
            .get(format!("{}/v1/cluster", cluster.urls[0]))
            .bearer_auth(&cluster.admin)
            .send()
            .await;
        if let Ok(r) = reply {
            if r.status().is_success() {
                return Ok(());
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err("cluster did not elect a leader in 20 s".into())
}

struct LoadResult {
    decisions: u64,
    errors: u64,
    per_second: f64,
    p50: Duration,
    p99: Duration,
}

/// Creates `agent-0..agents` with a budget and rate no load reaches; their tokens.
async fn create_agents(
    http: &reqwest::Client,
    cluster: &Cluster,
    agents: usize,
) -> Result<Vec<String>, String> {
    let policy = lineage_benches::unbounded_policy();
    lineage_benches::create_agents(http, &cluster.urls[0], &cluster.admin, agents, &policy).await
}

async fn run_load(cluster: &Cluster, args: &Args) -> Result<LoadResult, String> {
    let mut http = reqwest::Client::builder()
        .pool_max_idle_per_host(args.clients)
        .timeout(Duration::from_secs(10));
    if let Some(ca) = &cluster.ca {
        // Only the cluster's CA: never the roots the checkpointer's features compile in.
        http = http.tls_built_in_root_certs(false);
        let pem = std::fs::read(ca).map_err(|e| e.to_string())?;
        for certificate in reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| e.to_string())? {
            http = http.add_root_certificate(certificate);
        }
    }
    let http = http.build().map_err(|e| e.to_string())?;
    wait_ready(&http, cluster).await?;
    let tokens = create_agents(&http, cluster, args.agents).await?;
    // Clients talk to the leader's URL, as a failover client would after discovery.
    let leader: Value = lineage_benches::get_json(
        &http,
        &format!("{}/v1/cluster", cluster.urls[0]),
        &cluster.admin,
    )
    .await?;
    let leader_index = leader["leader"].as_u64().unwrap_or(1) as usize - 1;
    let url = cluster.urls[leader_index].clone();
    if args.history > 0 {
        preload(&url, &tokens, args).await?;
    }
    let mut writes_before = Vec::new();
    for url in &cluster.urls {
        writes_before.push(lineage_benches::log_write_count(&http, url).await.ok());
    }
    let cpu_before = cluster.cpu_times();
    let own_before = process_cpu("self");
    let machine_before = machine_ticks();
    if args.wrk {
        let result = run_wrk(&url, &tokens, args)?;
        print_machine(machine_before, own_before, &result, None);
        return finish(
            &http,
            cluster,
            args,
            (cpu_before, writes_before),
            leader_index,
            result,
        )
        .await;
    }
    let deadline = Instant::now() + Duration::from_secs(args.seconds);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..args.clients {
        let agent = c % args.agents;
        let path = format!("/v1/agents/agent-{agent}/actions");
        let body = json!({"tool": "work", "input": {"client": c}}).to_string();
        let token = tokens[agent].clone();
        let client = ActionClient::new(
            &url,
            &path,
            &token,
            body,
            args.reqwest.then(|| http.clone()),
        )?
        .with_keys(args.idempotency_keys.then(|| format!("load-{c}")));
        let task = tokio::spawn(client.run_until(deadline));
        tasks.push(task);
    }
    let mut latencies = Vec::new();
    let mut errors = 0;
    for task in tasks {
        let (l, e) = task.await.map_err(|e| e.to_string())?;
        latencies.extend(l);
        errors += e;
    }
    let elapsed = started.elapsed();
    latencies.sort();
    let pick = |q: f64| {
        latencies
            .get(((latencies.len() as f64 * q) as usize).min(latencies.len().saturating_sub(1)))
            .copied()
            .unwrap_or_default()
    };
    let result = LoadResult {
        decisions: latencies.len() as u64,
        errors,
        per_second: latencies.len() as f64 / elapsed.as_secs_f64(),
        p50: pick(0.50),
        p99: pick(0.99),
    };
    let labels = json!({"nodes": cluster.urls.len(), "history": args.history});
    print_machine(machine_before, own_before, &result, Some(labels));
    finish(
        &http,
        cluster,
        args,
        (cpu_before, writes_before),
        leader_index,
        result,
    )
    .await
}

/// Whether the machine itself was the limit: every node and the load generator share its
/// CPUs. (With wrk the generator's own CPU is not in this process's figure, so
/// `generator_labels` is `None` then; otherwise its CPU per decision is handed over as a
/// figure with those labels.)
fn print_machine(
    machine_before: Option<MachineTicks>,
    own_before: Option<Duration>,
    result: &LoadResult,
    generator_labels: Option<Value>,
) {
    let own_used = own_before.and_then(|before| Some(process_cpu("self")?.saturating_sub(before)));
    let machine_used = machine_before.and_then(|before| {
        let after = machine_ticks()?;
        Some(MachineTicks {
            busy: after.busy.saturating_sub(before.busy),
            steal: after.steal.saturating_sub(before.steal),
            total: after.total.saturating_sub(before.total).max(1),
        })
    });
    if let (Some(machine), Some(own)) = (machine_used, own_used) {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let own_per_decision = own.as_secs_f64() * 1e6 / result.decisions.max(1) as f64;
        println!(
            "  machine: {:.0}% of {cpus} CPUs busy, {:.0}% stolen; load generator CPU {own_per_decision:.0} µs per decision",
            100.0 * machine.busy as f64 / machine.total as f64,
            100.0 * machine.steal as f64 / machine.total as f64,
        );
        if let Some(labels) = generator_labels {
            lineage_benches::figure("generator_cpu_us_per_decision", own_per_decision, labels);
        }
    }
}

/// After a load: the replicas must agree; each node's CPU per decision and time breakdown.
async fn finish(
    http: &reqwest::Client,
    cluster: &Cluster,
    args: &Args,
    (cpu_before, writes_before): (Vec<Option<Duration>>, Vec<Option<f64>>),
    leader_index: usize,
    result: LoadResult,
) -> Result<LoadResult, String> {
    let cpu_used: Vec<Option<Duration>> = cluster
        .cpu_times()
        .iter()
        .zip(&cpu_before)
        .map(|(after, before)| Some(after.as_ref()?.saturating_sub(*before.as_ref()?)))
        .collect();
    check_replicas_agree(http, cluster, args.agents).await?;
    let labels = |node: usize| node_labels(cluster, args, leader_index, node);
    for (i, url) in cluster.urls.iter().enumerate() {
        let cpu = match cpu_used.get(i).copied().flatten() {
            Some(cpu) if result.decisions > 0 => {
                let micros = cpu.as_secs_f64() * 1e6 / result.decisions as f64;
                lineage_benches::figure("cpu_us_per_decision", micros, labels(i + 1));
                format!("CPU {micros:.0} µs per decision")
            }
            _ => "CPU unknown".into(),
        };
        let writes_before = writes_before.get(i).copied().flatten();
        let (fsyncs, breakdown) = time_breakdown(http, url, result.decisions, writes_before).await;
        if let Some(fsyncs) = fsyncs {
            lineage_benches::figure("fsyncs_per_decision", fsyncs, labels(i + 1));
        }
        println!("  node {}: {cpu}, {breakdown}", i + 1);
    }
    if args.history > 0 {
        history_figures(http, cluster, args, leader_index).await?;
    }
    Ok(result)
}

/// The labels of one node's figures (`node` counts from 1).
fn node_labels(cluster: &Cluster, args: &Args, leader_index: usize, node: usize) -> Value {
    json!({"nodes": cluster.urls.len(), "history": args.history, "node": node, "leader": node == leader_index + 1})
}

/// Loads about `args.history` records (two per decision) through the leader at `url`,
/// every client acting until its share is done, before the measured load.
async fn preload(url: &str, tokens: &[String], args: &Args) -> Result<(), String> {
    let started = Instant::now();
    let per_client = args.history.div_ceil(2 * args.clients as u64);
    let mut tasks = Vec::new();
    for c in 0..args.clients {
        let agent = c % args.agents;
        let path = format!("/v1/agents/agent-{agent}/actions");
        let body = json!({"tool": "work", "input": {"client": c, "history": true}}).to_string();
        let client = ActionClient::new(url, &path, &tokens[agent], body, None)?
            .with_keys(args.idempotency_keys.then(|| format!("history-{c}")));
        tasks.push(tokio::spawn(client.run_count(per_client)));
    }
    let mut errors = 0;
    for task in tasks {
        errors += task.await.map_err(|e| e.to_string())?;
    }
    println!(
        "  history: {} records loaded in {:.1?} ({errors} errors)",
        per_client * 2 * args.clients as u64,
        started.elapsed()
    );
    Ok(())
}

/// With a history: each node's VmRSS, its data directory's bytes per record, and how
/// fast it verifies an agent's whole log (`GET /v1/agents/{id}/verify?local=true`:
/// every hash, the chain and every signature).
async fn history_figures(
    http: &reqwest::Client,
    cluster: &Cluster,
    args: &Args,
    leader_index: usize,
) -> Result<(), String> {
    let agents = args.agents;
    let mut records = 0u64;
    for a in 0..agents {
        let reply: Value = lineage_benches::get_json(
            http,
            &format!("{}/v1/agents/agent-{a}/log?limit=0", cluster.urls[0]),
            &cluster.admin,
        )
        .await?;
        records += reply["head"]["seq"].as_u64().unwrap_or(0) + 1;
    }
    // What the reference stores for these records: their lines, read from node 1.
    let lines = lineage_benches::line_bytes(http, &cluster.urls[0], &cluster.admin, agents).await?;
    let line_per_record = lines as f64 / records.max(1) as f64;
    for (i, (child, url)) in cluster.children.iter().zip(&cluster.urls).enumerate() {
        let status = std::fs::read_to_string(format!("/proc/{}/status", child.id()))
            .map_err(|e| e.to_string())?;
        let rss = lineage_benches::status_field_bytes(&status, "VmRSS:").unwrap_or(0);
        let disk = lineage_benches::du_bytes(&cluster.data_dirs[i]);
        let started = Instant::now();
        let report: Value = http
            .get(format!("{url}/v1/agents/agent-0/verify?local=true"))
            .bearer_auth(&cluster.admin)
            .timeout(Duration::from_secs(600))
            .send()
            .await
            .map_err(|e| e.to_string())?
            .json()
            .await
            .map_err(|e| e.to_string())?;
        let verified = report["records"].as_u64().unwrap_or(0);
        let verify_rate = verified as f64 / started.elapsed().as_secs_f64();
        let ok = report["ok"].as_bool() == Some(true);
        if !ok {
            return Err(format!(
                "node {}: agent-0's log does not verify: {report}",
                i + 1
            ));
        }
        let disk_per_record = disk as f64 / records.max(1) as f64;
        println!(
            "  node {} at {records} records: VmRSS {:.1} MB, disk {disk_per_record:.0} B/record ({:.2}x the {line_per_record:.0} B of its line), verify {verify_rate:.0} records/s ({verified} records)",
            i + 1,
            rss as f64 / 1e6,
            disk_per_record / line_per_record,
        );
        let labels = node_labels(cluster, args, leader_index, i + 1);
        lineage_benches::figure("vmrss_bytes", rss as f64, labels.clone());
        lineage_benches::figure("disk_bytes_per_record", disk_per_record, labels.clone());
        lineage_benches::figure("line_bytes_per_record", line_per_record, labels.clone());
        lineage_benches::figure("verify_records_per_second", verify_rate, labels);
    }
    Ok(())
}

/// The load from `wrk` (2 threads, or 1 for one connection, `--clients` connections, `--seconds`): a Lua script
/// with every agent's request built once, taken in turn. Reads wrk's own report:
/// requests, non-2xx answers, requests/s and its latency distribution.
fn run_wrk(url: &str, tokens: &[String], args: &Args) -> Result<LoadResult, String> {
    let script = if args.idempotency_keys {
        // Each request built as it is sent, with a key of its own: the thread's number
        // (given by `setup`) and the request's.
        let agents: Vec<String> = tokens
            .iter()
            .enumerate()
            .map(|(a, token)| format!("{{\"/v1/agents/agent-{a}/actions\", \"Bearer {token}\"}}"))
            .collect();
        format!(
            "local threads = 0\nsetup = function(thread)\n  threads = threads + 1\n  thread:set(\"tid\", threads)\nend\nlocal agents = {{ {} }}\nlocal n = 0\nrequest = function()\n  n = n + 1\n  local agent = agents[n % #agents + 1]\n  return wrk.format(\"POST\", agent[1], {{[\"Authorization\"] = agent[2], [\"Content-Type\"] = \"application/json\", [\"Idempotency-Key\"] = \"wrk-\" .. tid .. \"-\" .. n}}, '{{\"tool\":\"work\",\"input\":{{}}}}')\nend\n",
            agents.join(", ")
        )
    } else {
        let requests: Vec<String> = tokens
            .iter()
            .enumerate()
            .map(|(a, token)| {
                if args.reads {
                    format!(
                        "wrk.format(\"GET\", \"/v1/agents/agent-{a}\", {{[\"Authorization\"] = \"Bearer {token}\"}})"
                    )
                } else {
                    lineage_benches::wrk::decide_request(&format!("agent-{a}"), token)
                }
            })
            .collect();
        lineage_benches::wrk::round_robin(&requests)
    };
    let report = lineage_benches::wrk::run(url, &script, args.clients, args.seconds)?;
    Ok(LoadResult {
        decisions: report.decisions,
        errors: report.errors,
        per_second: report.per_second,
        p50: report.p50,
        p99: report.p99,
    })
}

/// One client of the load, sending the same action again and again with its request
/// built once. Lean: one keep-alive HTTP/1.1 connection through hyper, so the generator
/// takes little of the CPU the nodes share; or through reqwest (about twice the CPU), as
/// the generator did before, for comparison.
struct ActionClient {
    addr: String,
    uri: hyper::Uri,
    host: hyper::header::HeaderValue,
    authorization: hyper::header::HeaderValue,
    body: bytes::Bytes,
    via: Via,
    /// With keys: each request's Idempotency-Key is this, a dash and its number.
    key_prefix: Option<String>,
    sent: u64,
}

type Sender = hyper::client::conn::http1::SendRequest<http_body_util::Full<bytes::Bytes>>;

enum Via {
    /// The connection, once open (opened anew after it breaks).
    Hyper(Option<Sender>),
    Reqwest {
        http: reqwest::Client,
        url: String,
    },
}

impl ActionClient {
    fn new(
        url: &str,
        path: &str,
        token: &str,
        body: String,
        reqwest: Option<reqwest::Client>,
    ) -> Result<Self, String> {
        let addr = url.trim_start_matches("http://").to_string();
        Ok(ActionClient {
            uri: path.parse().map_err(|e| format!("{path}: {e}"))?,
            host: addr.parse().map_err(|e| format!("{addr}: {e}"))?,
            authorization: format!("Bearer {token}")
                .parse()
                .map_err(|e| format!("token: {e}"))?,
            body: body.into(),
            via: match reqwest {
                Some(http) => Via::Reqwest {
                    http,
                    url: format!("{url}{path}"),
                },
                None => Via::Hyper(None),
            },
            addr,
            key_prefix: None,
            sent: 0,
        })
    }

    /// Each request then carries a key of its own, `PREFIX-N`.
    fn with_keys(mut self, prefix: Option<String>) -> Self {
        self.key_prefix = prefix;
        self
    }

    /// The next request's Idempotency-Key, if keys are sent.
    fn next_key(&mut self) -> Option<String> {
        self.sent += 1;
        let prefix = self.key_prefix.as_ref()?;
        Some(format!("{prefix}-{}", self.sent))
    }

    async fn connect(addr: &str) -> Result<Sender, String> {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| e.to_string())?;
        stream.set_nodelay(true).map_err(|e| e.to_string())?;
        let (sender, connection) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .map_err(|e| e.to_string())?;
        tokio::spawn(connection);
        Ok(sender)
    }

    /// One action; Ok(true) when the guard answered 2xx.
    async fn act(&mut self) -> Result<bool, String> {
        use http_body_util::BodyExt;
        use hyper::header::{AUTHORIZATION, CONTENT_TYPE, HOST};
        let key = self.next_key();
        let connection = match &mut self.via {
            Via::Reqwest { http, url } => {
                let mut request = http
                    .post(url.as_str())
                    .header(AUTHORIZATION, self.authorization.clone())
                    .header(CONTENT_TYPE, "application/json");
                if let Some(key) = &key {
                    request = request.header("Idempotency-Key", key.as_str());
                }
                let reply = request
                    .body(self.body.clone())
                    .send()
                    .await
                    .map_err(|e| e.to_string())?;
                return Ok(reply.status().is_success());
            }
            Via::Hyper(connection) => connection,
        };
        let mut sender = match connection.take() {
            Some(sender) => sender,
            None => match Self::connect(&self.addr).await {
                Ok(sender) => sender,
                Err(e) => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    return Err(e);
                }
            },
        };
        let mut request = hyper::Request::post(self.uri.clone())
            .header(HOST, self.host.clone())
            .header(AUTHORIZATION, self.authorization.clone())
            .header(CONTENT_TYPE, "application/json");
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key);
        }
        let request = request
            .body(http_body_util::Full::new(self.body.clone()))
            .map_err(|e| e.to_string())?;
        sender.ready().await.map_err(|e| e.to_string())?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| e.to_string())?;
        let ok = response.status().is_success();
        // Read to its end, so the connection can carry the next request.
        response
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?;
        *connection = Some(sender);
        Ok(ok)
    }

    /// Acts until `decisions` answers were 2xx; how many were not (at most as many
    /// again, so a refusing node does not keep it going).
    async fn run_count(mut self, decisions: u64) -> u64 {
        let (mut done, mut errors) = (0u64, 0u64);
        while done < decisions && errors <= decisions {
            match self.act().await {
                Ok(true) => done += 1,
                Ok(false) | Err(_) => errors += 1,
            }
        }
        errors
    }

    /// Acts until `deadline`: the latency of each 2xx answer, and how many were not.
    async fn run_until(mut self, deadline: Instant) -> (Vec<Duration>, u64) {
        let mut latencies = Vec::new();
        let mut errors = 0u64;
        while Instant::now() < deadline {
            let t = Instant::now();
            match self.act().await {
                Ok(true) => latencies.push(t.elapsed()),
                Ok(false) | Err(_) => errors += 1,
            }
        }
        (latencies, errors)
    }
}

/// Where a node's time went, from its own histograms: durable log writes (group
/// commits), Raft appends it served as a follower, and decisions it served.
/// Also the node's fsyncs per decision over the measured load (its log writes since
/// `writes_before`), when its metrics answered both times.
async fn time_breakdown(
    http: &reqwest::Client,
    url: &str,
    decisions: u64,
    writes_before: Option<f64>,
) -> (Option<f64>, String) {
    let Ok(reply) = http.get(format!("{url}/metrics")).send().await else {
        return (None, "metrics unavailable".into());
    };
    let text = reply.text().await.unwrap_or_default();
    let sum_count = |name: &str, filter: &str| {
        let pick = |suffix: &str| -> f64 {
            text.lines()
                .filter(|l| l.contains(&format!("{name}{suffix}")) && l.contains(filter))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum()
        };
        (pick("_sum"), pick("_count"))
    };
    let mean = |(sum, count): (f64, f64)| {
        if count > 0.0 {
            format!("{count:.0} × {:.3} ms", sum / count * 1e3)
        } else {
            "none".into()
        }
    };
    let log_writes = sum_count("raft_log_append_duration_seconds", "");
    // Each log write is two fdatasyncs: the frames, then the watermark (`store::watermark`).
    let fsyncs =
        writes_before.map(|before| 2.0 * (log_writes.1 - before) / decisions.max(1) as f64);
    let per_decision = match fsyncs {
        Some(fsyncs) => format!("{fsyncs:.3} fsyncs per decision"),
        None => "fsyncs per decision unknown".into(),
    };
    let text = format!(
        "log writes {} in its life ({per_decision} in this load), raft appends served {}, decisions served {}",
        mean(log_writes),
        mean(sum_count("http_request_duration_seconds", "/raft/append")),
        mean(sum_count("http_request_duration_seconds", "/actions")),
    );
    (fsyncs, text)
}

/// Every node's own copy of every agent's log must be identical once replication settles.
async fn check_replicas_agree(
    http: &reqwest::Client,
    cluster: &Cluster,
    agents: usize,
) -> Result<(), String> {
    for a in 0..agents {
        let start = Instant::now();
        loop {
            let mut heads = Vec::new();
            for url in &cluster.urls {
                let reply: Value = lineage_benches::get_json(
                    http,
                    &format!("{url}/v1/agents/agent-{a}/log?local=true&limit=0"),
                    &cluster.admin,
                )
                .await?;
                heads.push(reply["head"].clone());
            }
            if heads.windows(2).all(|w| w[0] == w[1]) {
                break;
            }
            if start.elapsed() > Duration::from_secs(10) {
                return Err(format!("agent-{a}: replicas disagree: {heads:?}"));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    Ok(())
}

/// The most threads the reference storage bound uses (one per agent).
const MAX_CEILING_WRITERS: usize = 64;

/// Records sealed (canonical JSON + SHA-256 + Ed25519) per second on one core.
fn sign_ceiling() -> f64 {
    let key = AuditKey::from_seed([4; 32]);
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < Duration::from_secs(1) {
        let _ = Record::seal(
            &key,
            n,
            timestamp::format(0),
            "a",
            "action_requested",
            json!({"n": n}),
            &"0".repeat(64),
        );
        n += 1;
    }
    n as f64 / start.elapsed().as_secs_f64()
}

/// Rounds per build when comparing two builds; they alternate, so drifts of a shared
/// machine fall on both alike.
const COMPARE_ROUNDS: usize = 3;

/// Runs the same load against `baseline` and this build in alternating rounds, and prints
/// each round and the ratios (this build / baseline) of the medians.
/// One side of a comparison: a build, over plain HTTP or TLS.
struct Variant<'a> {
    name: &'static str,
    binary: &'a Path,
    tls: bool,
}

fn compare_with_baseline(
    runtime: &tokio::runtime::Runtime,
    variants: [Variant<'_>; 2],
    sizes: &[usize],
    args: &Args,
) -> Result<(), String> {
    for variant in &variants {
        if !variant.binary.exists() {
            return Err(format!("{}: no such file", variant.binary.display()));
        }
    }
    for &nodes in sizes {
        let mut results: [Vec<(f64, f64, f64)>; 2] = [Vec::new(), Vec::new()];
        for round in 0..COMPARE_ROUNDS {
            for (which, variant) in variants.iter().enumerate() {
                let cluster = start_cluster(variant.binary, nodes, args.no_early_ack, variant.tls)?;
                let r = runtime.block_on(run_load(&cluster, args))?;
                drop(cluster);
                let name = variant.name;
                println!(
                    "round {round}, {name}, {nodes} node(s): {:.0} decisions/s, p50 {:.2} ms, p99 {:.2} ms, {} errors",
                    r.per_second,
                    r.p50.as_secs_f64() * 1e3,
                    r.p99.as_secs_f64() * 1e3,
                    r.errors
                );
                results[which].push((r.per_second, r.p50.as_secs_f64(), r.p99.as_secs_f64()));
            }
        }
        let median = |values: &[(f64, f64, f64)], pick: fn(&(f64, f64, f64)) -> f64| {
            let mut v: Vec<f64> = values.iter().map(pick).collect();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let ratio = |pick: fn(&(f64, f64, f64)) -> f64| {
            median(&results[1], pick) / median(&results[0], pick)
        };
        println!(
            "{nodes} node(s), {} clients over {} agents: {} / {} (medians of {COMPARE_ROUNDS}): decisions/s {:.3}x, p50 {:.3}x, p99 {:.3}x",
            args.clients,
            args.agents,
            variants[1].name,
            variants[0].name,
            ratio(|r| r.0),
            ratio(|r| r.1),
            ratio(|r| r.2),
        );
    }
    Ok(())
}

fn main() {
    let args = <Args as clap::Parser>::parse();
    lineage_benches::exit_on_error("cluster_load", run(&args));
}

fn run(args: &Args) -> Result<(), String> {
    let binary = match &args.node {
        Some(path) => path.clone(),
        None => lineage_benches::sibling_binary("lineage-node", "-p lineage-node")?,
    };
    let sign = sign_ceiling();
    let fsync = lineage_benches::durable_appends_per_second()?;
    println!("machine ceiling: {sign:.0} records sealed/s on one core, {fsync:.0} durable appends/s (1 fsync each)");
    lineage_benches::figure("fsyncs_per_second_ceiling", fsync, json!({}));
    // The reference single node stores each agent's records in its own file, each one
    // fdatasynced: at this many agents, that alone allows no more decisions/s than this.
    let writers = args.agents.min(MAX_CEILING_WRITERS);
    let reference = lineage_benches::durable_appends_per_second_with(writers)? / 2.0;
    println!(
        "reference storage bound: {writers} agents' logs appended at once (seal + fdatasync per record) allow {reference:.0} decisions/s"
    );
    lineage_benches::figure(
        "reference_bound_decisions_per_second",
        reference,
        json!({"agents": args.agents}),
    );
    let runtime = tokio::runtime::Runtime::new().map_err(|e| e.to_string())?;
    let sizes = match args.nodes {
        Some(n) => vec![n],
        None => vec![1, 3],
    };
    if args.tls {
        let variants = [
            Variant {
                name: "plain HTTP",
                binary: &binary,
                tls: false,
            },
            Variant {
                name: "TLS",
                binary: &binary,
                tls: true,
            },
        ];
        return compare_with_baseline(&runtime, variants, &sizes, args);
    }
    if let Some(baseline) = &args.baseline {
        let variants = [
            Variant {
                name: "baseline",
                binary: baseline,
                tls: false,
            },
            Variant {
                name: "this build",
                binary: &binary,
                tls: false,
            },
        ];
        return compare_with_baseline(&runtime, variants, &sizes, args);
    }
    for nodes in sizes {
        let cluster = start_cluster(&binary, nodes, args.no_early_ack, false)?;
        let r = runtime.block_on(run_load(&cluster, args))?;
        println!(
            "{nodes} node(s), {} clients over {} agents, {} s: {:.0} decisions/s (p50 {:.2} ms, p99 {:.2} ms), {} decisions, {} errors; {:.2}x the fsync ceiling, {:.3}x the signing ceiling (2 records per decision), {:.2}x the reference storage bound",
            args.clients,
            args.agents,
            args.seconds,
            r.per_second,
            r.p50.as_secs_f64() * 1e3,
            r.p99.as_secs_f64() * 1e3,
            r.decisions,
            r.errors,
            r.per_second / fsync,
            r.per_second * 2.0 / sign,
            r.per_second / reference,
        );
        let labels = json!({"nodes": nodes, "history": args.history});
        lineage_benches::figure("decisions_per_second", r.per_second, labels.clone());
        lineage_benches::figure("p50_ms", r.p50.as_secs_f64() * 1e3, labels.clone());
        lineage_benches::figure("p99_ms", r.p99.as_secs_f64() * 1e3, labels.clone());
        lineage_benches::figure("errors", r.errors as f64, labels);
    }
    Ok(())
}
