//! What writes a node refuses cost it in memory: `--connections` connections each send
//! the head of a 2 MB write with a forged agent token and all of its body but the last
//! kilobyte, then stall. The node's VmRSS growth 3 s later is printed for this build and
//! for the baseline build, alternately, with the ratio of their medians.
//!
//! `cargo build --release -p lineage-node -p lineage-benches && target/release/refused_bodies
//! --node target/release/lineage-node --baseline-node OLD/lineage-node [--connections 200]
//! [--rounds 2]`

use std::io::Write;
use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

const BODY_BYTES: usize = 2_000_000;

/// VmRSS growth of a node while refused writes stall, this build against a baseline.
#[derive(clap::Parser)]
struct Args {
    #[command(flatten)]
    builds: lineage_benches::Builds,
    /// Connections that stall a refused body each.
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u64).range(1..=2_000))]
    connections: u64,
}

fn main() {
    let args = <Args as clap::Parser>::parse();
    lineage_benches::exit_on_error("refused_bodies", run(&args));
}

fn run(args: &Args) -> Result<(), String> {
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    let builds = &args.builds;
    for round in 1..=builds.rounds {
        for (baseline, binary) in [(false, &builds.node), (true, &builds.baseline)] {
            let growth = measure(binary, args.connections as usize)?;
            println!(
                "round {round} {}: {} stalled forged-token writes of 2 MB: VmRSS +{:.1} MB",
                if baseline { "baseline" } else { "this build" },
                args.connections,
                growth as f64 / 1e6
            );
            if baseline { &mut theirs } else { &mut ours }.push(growth as f64);
        }
    }
    println!(
        "this build / baseline (medians): VmRSS growth {:.3}x",
        lineage_benches::median(&mut ours) / lineage_benches::median(&mut theirs).max(1.0)
    );
    Ok(())
}

/// VmRSS growth of a fresh node of `binary` while `connections` refused bodies stall.
fn measure(binary: &Path, connections: usize) -> Result<u64, String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let (node, addr, _admin) = lineage_benches::start_single_node(binary, dir.path())?;
    let started = Instant::now();
    while TcpStream::connect(&addr).is_err() {
        if started.elapsed() > Duration::from_secs(20) {
            return Err("the node did not start".into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_secs(1));
    let pid = node.0.id();
    let before = vm_rss(pid)?;
    let head = format!(
        "POST /v1/agents/bot/actions HTTP/1.1\r\nHost: node\r\nContent-Type: application/json\r\n\
         Authorization: Bearer agt_bot.forged\r\nContent-Length: {BODY_BYTES}\r\n\r\n"
    );
    let body = vec![b'x'; BODY_BYTES - 1_000];
    let mut held = Vec::with_capacity(connections);
    for _ in 0..connections {
        let mut stream = TcpStream::connect(&addr).map_err(|e| e.to_string())?;
        stream
            .set_write_timeout(Some(Duration::from_secs(10)))
            .map_err(|e| e.to_string())?;
        stream
            .write_all(head.as_bytes())
            .map_err(|e| e.to_string())?;
        // A node that answered and stopped reading may refuse the rest: that is fine.
        let _ = stream.write_all(&body);
        held.push(stream);
    }
    std::thread::sleep(Duration::from_secs(3));
    let after = vm_rss(pid)?;
    drop(held);
    Ok(after.saturating_sub(before))
}

fn vm_rss(pid: u32) -> Result<u64, String> {
    let status =
        std::fs::read_to_string(format!("/proc/{pid}/status")).map_err(|e| e.to_string())?;
    lineage_benches::status_field_bytes(&status, "VmRSS:").ok_or_else(|| "no VmRSS".into())
}
