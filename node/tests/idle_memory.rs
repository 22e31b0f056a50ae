//! Memory a node has freed goes back to the OS while the node is idle.
//!
//! mimalloc gives freed pages back only when some thread next calls into it, after its
//! purge delay; a node that goes quiet after a burst would keep the burst's peak until
//! the next load (`return_freed_memory_while_idle` in `main.rs` makes that call every
//! second). The burst here is requests with inputs of about 1 MiB, each read whole,
//! parsed and refused (413): what a misbehaving agent sends.

#[path = "cluster/util.rs"]
mod util;

use std::time::{Duration, Instant};

use serde_json::json;
use util::Cluster;

/// A liveness bound, not a timing claim: the node returns freed memory within about two
/// seconds of going idle.
const RETURN_BOUND: Duration = Duration::from_secs(30);

fn rss_anon_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|line| line.strip_prefix("RssAnon:"))
        .and_then(|rest| rest.trim().trim_end_matches(" kB").trim().parse().ok())
        .expect("RssAnon in /proc/PID/status")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_a_burst_freed_goes_back_while_the_node_is_idle() {
    let cluster = Cluster::start(1).await;
    cluster.wait_for_leader(Duration::from_secs(20)).await;
    let pid = cluster.pid(0).expect("node 1 runs");
    let policy = json!({"budget": 100, "scar_limit": 10, "tools": {"search": {"cost": 1}}});
    let token = cluster.create_agent(0, "bursty", policy).await;
    // What start-up freed goes back first, so the burst's rise is measured on its own.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let before = rss_anon_kib(pid);

    let input = "x".repeat(1 << 20);
    let mut peak = before;
    for _round in 0..4 {
        let mut requests = Vec::new();
        for _ in 0..16 {
            let http = cluster.http.clone();
            let url = cluster.url(0, "/v1/agents/bursty/actions");
            let token = token.clone();
            let body = json!({"tool": "search", "input": {"text": input}});
            requests.push(tokio::spawn(async move {
                let reply = http.post(url).bearer_auth(token).json(&body).send().await;
                reply.map(|r| r.status().as_u16())
            }));
        }
        for request in requests {
            let status = request.await.expect("task").expect("answered");
            assert_eq!(status, 413, "an input over 64 KiB is refused");
        }
        peak = peak.max(rss_anon_kib(pid));
    }
    let raised = peak.saturating_sub(before);
    assert!(
        raised >= 16 * 1024,
        "the burst raised RssAnon by only {raised} KiB ({before} to {peak}): no test"
    );

    // Idle now: nothing calls into the allocator but the node's own timers. Measured
    // here (debug build, after six seconds): with the idle thread 52-65% of the rise went
    // back, and one CI run gave back 28% within 30 s; without the thread 19-37%. The rest
    // may not all be garbage (the 16 client connections stay open, presumably with their
    // buffers), so this asks for a quarter: that memory comes back, not how much of it.
    let target = peak - raised / 4;
    let start = Instant::now();
    let mut now = peak;
    while start.elapsed() < RETURN_BOUND {
        tokio::time::sleep(Duration::from_millis(250)).await;
        now = rss_anon_kib(pid);
        if now <= target {
            eprintln!(
                "RssAnon KiB: {before} before, {peak} at the peak, {now} after {:?}",
                start.elapsed()
            );
            return;
        }
    }
    panic!(
        "RssAnon stayed at {now} KiB after the burst (before {before}, peak {peak}): freed \
         memory was not given back within {RETURN_BOUND:?}"
    );
}
