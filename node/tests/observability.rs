//! Metrics against the audit logs, and the alert rules in a real Prometheus scraping a
//! live three-node cluster.

#[path = "cluster/util.rs"]
mod util;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use util::{free_port, program_or_skip, Cluster};

/// What the audit logs say, counted record by record.
#[derive(Debug, Default, PartialEq)]
struct LogCounts {
    allowed: u64,
    pending: u64,
    denied: BTreeMap<String, u64>,
    scars: BTreeMap<String, u64>,
    terminated: u64,
}

fn count(logs: &[Vec<Value>]) -> LogCounts {
    let mut c = LogCounts::default();
    for log in logs {
        for record in log {
            let payload = &record["payload"];
            match record["kind"].as_str().unwrap() {
                "action_allowed" => c.allowed += 1,
                "approval_required" => c.pending += 1,
                "action_denied" => {
                    let code = payload["reason"]["code"].as_str().unwrap().to_string();
                    *c.denied.entry(code).or_insert(0) += 1;
                }
                "action_rejected" => *c.denied.entry("rejected".into()).or_insert(0) += 1,
                "scar" => {
                    let severity = payload["severity"].as_str().unwrap().to_string();
                    *c.scars.entry(severity).or_insert(0) += 1;
                }
                "terminated" => c.terminated += 1,
                _ => {}
            }
        }
    }
    c
}

fn counts_from_metrics(m: &BTreeMap<String, f64>) -> LogCounts {
    let get = |k: &str| m.get(k).copied().unwrap_or(0.0) as u64;
    let mut c = LogCounts {
        allowed: get("lineage_decisions_total{code=\"\",outcome=\"allowed\"}"),
        pending: get("lineage_decisions_total{code=\"\",outcome=\"pending_approval\"}"),
        ..LogCounts::default()
    };
    for code in [
        "terminated",
        "tool_not_allowed",
        "insufficient_budget",
        "tool_call_limit",
        "rate_limited",
        "rejected",
    ] {
        let n = get(&format!(
            "lineage_decisions_total{{code=\"{code}\",outcome=\"denied\"}}"
        ));
        if n > 0 {
            c.denied.insert(code.into(), n);
        }
    }
    for severity in ["minor", "moderate", "severe", "fatal"] {
        let n = get(&format!("lineage_scars_total{{severity=\"{severity}\"}}"));
        if n > 0 {
            c.scars.insert(severity.into(), n);
        }
    }
    c.terminated = ["budget", "scars", "operator", "replay"]
        .iter()
        .map(|cause| get(&format!("lineage_terminations_total{{cause=\"{cause}\"}}")))
        .sum();
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metric_values_match_the_audit_logs_on_every_node() {
    let cluster = Cluster::start(3).await;
    let admin = cluster.admin.clone();
    let policy = json!({"budget": 7, "scar_limit": 7, "rate_limit": null,
        "tools": {"read": {"cost": 1, "max_calls": 2}, "pay": {"cost": 5, "requires_approval": true}}});
    let a = cluster.create_agent(0, "alpha", policy.clone()).await;
    let b = cluster.create_agent(1, "beta", policy).await;
    let script: Vec<(usize, &str, &str, Value)> = vec![
        (0, "alpha", &a, json!({"tool": "read"})),
        (1, "alpha", &a, json!({"tool": "read"})),
        (2, "alpha", &a, json!({"tool": "read"})),
        (0, "alpha", &a, json!({"tool": "shell"})),
        (1, "alpha", &a, json!({"tool": "pay"})),
        (2, "beta", &b, json!({"tool": "pay"})),
        (0, "beta", &b, json!({"tool": "pay"})),
        (1, "beta", &b, json!({"tool": "read", "cost": 50})),
    ];
    for (n, (node, agent, token, body)) in script.into_iter().enumerate() {
        cluster
            .post_until_served(
                node,
                &format!("/v1/agents/{agent}/actions"),
                token,
                body,
                &format!("s{n}"),
            )
            .await;
    }
    let path = "/v1/agents/alpha/actions/act-5/approve";
    cluster
        .post_until_served(2, path, &admin, json!({"approver": "ops"}), "ap")
        .await;
    let path = "/v1/agents/beta/actions/act-1/reject";
    cluster
        .post_until_served(
            0,
            path,
            &admin,
            json!({"approver": "ops", "reason": "no", "scar": "severe"}),
            "rj",
        )
        .await;
    cluster
        .post_until_served(
            1,
            "/v1/agents/beta/terminate",
            &admin,
            json!({"reason": "drill", "by": "ops"}),
            "tm",
        )
        .await;

    let alpha = cluster
        .converged_log("alpha", Duration::from_secs(10))
        .await;
    let beta = cluster.converged_log("beta", Duration::from_secs(10)).await;
    let expected = count(&[alpha, beta]);
    assert_eq!(expected.allowed, 3, "{expected:?}");
    for i in 0..3 {
        let m = cluster.metrics(i).await;
        assert_eq!(counts_from_metrics(&m), expected, "node {}", i + 1);
        assert_eq!(
            m["lineage_agents{state=\"terminated\"}"], 2.0,
            "alpha spent its budget, beta was stopped"
        );
        assert_eq!(m["lineage_pending_approvals"], 1.0);
    }
    let m = cluster.metrics(0).await;
    // alpha spent its last credit; beta's severe scar reached its limit before the
    // operator's terminate (which was then refused as already terminated).
    assert_eq!(m["lineage_terminations_total{cause=\"budget\"}"], 1.0);
    assert_eq!(m["lineage_terminations_total{cause=\"scars\"}"], 1.0);
    assert_eq!(m["lineage_terminations_total{cause=\"operator\"}"], 0.0);
}

struct Prometheus {
    child: Child,
    url: String,
    _dir: tempfile::TempDir,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_prometheus(binary: &Path, targets: &[String]) -> Prometheus {
    let dir = tempfile::tempdir().unwrap();
    let rules = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/prometheus/alerts.yml");
    std::fs::copy(&rules, dir.path().join("alerts.yml")).unwrap();
    let targets: Vec<String> = targets.iter().map(|t| format!("\"{t}\"")).collect();
    let config = format!(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - alerts.yml\nscrape_configs:\n  - job_name: lineage-node\n    static_configs:\n      - targets: [{}]\n",
        targets.join(", ")
    );
    std::fs::write(dir.path().join("prometheus.yml"), config).unwrap();
    let port = free_port();
    let child = Command::new(binary)
        .arg(format!(
            "--config.file={}",
            dir.path().join("prometheus.yml").display()
        ))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.path().join("data").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    Prometheus {
        child,
        url: format!("http://127.0.0.1:{port}"),
        _dir: dir,
    }
}

async fn firing_alerts(http: &reqwest::Client, prometheus: &Prometheus) -> Vec<Value> {
    let reply = http
        .get(format!("{}/api/v1/alerts", prometheus.url))
        .send()
        .await;
    let Ok(reply) = reply else { return Vec::new() };
    let body: Value = reply.json().await.unwrap_or(Value::Null);
    body["data"]["alerts"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .filter(|a| a["state"] == "firing")
        .collect()
}

const RECORDS: redb::TableDefinition<(&str, u64), &str> = redb::TableDefinition::new("records");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[expect(
    clippy::too_many_lines,
    reason = "a scenario test: one Prometheus, the quiet state, then each alert's cause, in order"
)]
async fn prometheus_fires_the_quarantine_and_scar_burst_alerts() {
    let Some(binary) = program_or_skip(&["prometheus"], "LINEAGE_REQUIRE_PROMETHEUS") else {
        return;
    };
    // Each apply committed durably: node 3's records are in its file when it is killed below.
    let cluster = Cluster::start_with(3, &["--state-fsync-interval-ms", "0"]).await;
    let prometheus = start_prometheus(&binary, &cluster.addrs);
    let admin = cluster.admin.clone();
    let policy = json!({"budget": 100, "scar_limit": 100, "tools": {"read": {"cost": 1}}});
    let token = cluster.create_agent(0, "noisy", policy.clone()).await;
    cluster.create_agent(0, "victim", policy).await;
    cluster
        .post_until_served(
            0,
            "/v1/agents/victim/actions",
            &admin,
            json!({"tool": "read"}),
            "v1",
        )
        .await;
    // Let Prometheus see the quiet state first, so increase() has a baseline.
    let http = reqwest::Client::new();
    let start = Instant::now();
    loop {
        let reply = http
            .get(format!("{}/api/v1/query", prometheus.url))
            .query(&[("query", "count(lineage_scars_total)")])
            .send()
            .await;
        let scraped = match reply {
            Ok(r) => r
                .json::<Value>()
                .await
                .map(|v| {
                    v["data"]["result"]
                        .as_array()
                        .is_some_and(|a| !a.is_empty())
                })
                .unwrap_or(false),
            Err(_) => false,
        };
        if scraped {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "prometheus never scraped the nodes"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;

    // A scar burst: six forbidden-tool attempts, a moderate scar each.
    for n in 0..6 {
        cluster
            .post_until_served(
                n % 3,
                "/v1/agents/noisy/actions",
                &token,
                json!({"tool": "rm -rf"}),
                &format!("b{n}"),
            )
            .await;
    }
    // A quarantine: node 3's copy of one agent is edited on disk while it is down.
    cluster
        .converged_log("victim", Duration::from_secs(10))
        .await;
    cluster.kill(2);
    {
        let db = redb::Database::create(cluster.dir.path().join("node-3/node.redb")).unwrap();
        let txn = db.begin_write().unwrap();
        {
            let mut table = txn.open_table(RECORDS).unwrap();
            let line = redb::ReadableTable::get(&table, ("victim", 2))
                .unwrap()
                .unwrap()
                .value()
                .to_string();
            table
                .insert(
                    ("victim", 2),
                    line.replacen("\"read\"", "\"READ\"", 1).as_str(),
                )
                .unwrap();
        }
        txn.commit().unwrap();
    }
    cluster.start_node(2);

    let start = Instant::now();
    let (mut quarantine, mut burst) = (false, false);
    while !(quarantine && burst) {
        for alert in firing_alerts(&http, &prometheus).await {
            match alert["labels"]["alertname"].as_str() {
                Some("LineageAgentQuarantined") => {
                    assert_eq!(alert["labels"]["node"], "3", "{alert}");
                    quarantine = true;
                }
                Some("LineageScarBurst") => burst = true,
                _ => {}
            }
        }
        if start.elapsed() > Duration::from_secs(60) {
            let query = "sum by (node) (increase(lineage_scars_total[5m]))";
            let debug: Value = http
                .get(format!("{}/api/v1/query", prometheus.url))
                .query(&[("query", query)])
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            panic!("alerts not firing within 60 s (quarantine {quarantine}, scar burst {burst}); {query} = {debug}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// A node whose log nobody reads (its supervisor hung, or the disk its log driver writes
/// to stalled) goes on serving. Its stderr here is a pipe that is never read, full after
/// 64 KiB: the node queues what it cannot write, then drops lines and counts them, rather
/// than wait on the pipe with its workers (before, the first few hundred debug lines
/// filled it and the node answered nothing more).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_log_is_not_read_goes_on_serving() {
    let mut cluster = Cluster::prepare(1, &[]);
    // A debug line for every request.
    cluster.log_filter = Some("info,lineage_node=debug".into());
    let pipe = cluster.log_path(0);
    let made = Command::new("mkfifo").arg(&pipe).status().expect("mkfifo");
    assert!(made.success(), "mkfifo");
    // Held open for reading (and writing, so that the open waits for no one), never read.
    let _unread = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&pipe)
        .expect("open the pipe");
    cluster.start_node(0);
    cluster.wait_for_leader(Duration::from_secs(30)).await;

    let url = cluster.url(0, "/healthz");
    let mut dropped = 0.0;
    let mut answered = 0usize;
    // Rounds of 1,000 requests, 8 at a time, until lines are dropped (the queue holds
    // 8,192): each must be answered.
    for _round in 0..40 {
        let clients: Vec<_> = (0..8)
            .map(|_| {
                let (http, url) = (cluster.http.clone(), url.clone());
                tokio::spawn(async move {
                    for _ in 0..125 {
                        let reply = http.get(&url).send().await.map_err(|e| e.to_string())?;
                        if reply.status() != 200 {
                            return Err(format!("status {}", reply.status()));
                        }
                    }
                    Ok::<_, String>(125)
                })
            })
            .collect();
        for client in clients {
            match client.await.expect("client task") {
                Ok(n) => answered += n,
                Err(e) => panic!("after {answered} answered, a request failed: {e}"),
            }
        }
        dropped = cluster.metrics(0).await["lineage_log_lines_dropped_total"];
        if dropped > 0.0 {
            break;
        }
    }
    assert!(
        dropped > 0.0,
        "{answered} requests answered and no log line dropped: was the pipe ever full?"
    );

    // It decides as ever.
    let token = cluster
        .create_agent(
            0,
            "after-the-flood",
            json!({"budget": 10, "scar_limit": 3, "tools": {"search": {"cost": 1}}}),
        )
        .await;
    let (status, reply) = cluster
        .post(
            0,
            "/v1/agents/after-the-flood/actions",
            &token,
            json!({"tool": "search", "input": {}}),
            None,
        )
        .await;
    assert_eq!(
        (status, &reply["decision"]),
        (200, &json!("allowed")),
        "{reply}"
    );
}
