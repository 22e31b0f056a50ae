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
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const BODY_BYTES: usize = 2_000_000;

struct Args {
    node: PathBuf,
    baseline: PathBuf,
    connections: usize,
    rounds: usize,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        node: PathBuf::from("target/release/lineage-node"),
        baseline: PathBuf::new(),
        connections: 200,
        rounds: 2,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        let number = || value.parse::<usize>().map_err(|e| format!("{flag}: {e}"));
        match flag.as_str() {
            "--node" => args.node = value.clone().into(),
            "--baseline-node" => args.baseline = value.clone().into(),
            "--connections" => args.connections = number()?.clamp(1, 2_000),
            "--rounds" => args.rounds = number()?.clamp(1, 10),
            other => return Err(format!("unknown flag {other}")),
        }
    }
    if args.baseline.as_os_str().is_empty() {
        return Err("--baseline-node PATH is required (the build to compare with)".into());
    }
    Ok(args)
}

fn main() {
    if let Err(e) = run() {
        eprintln!("refused_bodies: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let args = parse_args()?;
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    for round in 1..=args.rounds {
        for (baseline, binary) in [(false, &args.node), (true, &args.baseline)] {
            let growth = measure(binary, args.connections)?;
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
