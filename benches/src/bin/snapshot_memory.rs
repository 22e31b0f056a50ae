//! What a snapshot costs in memory on each side. A state machine (the node's own, over a
//! temp dir) is loaded with `--agents` agents of `--requests` allowed actions each (two
//! records per action), then the peak RSS growth of this process is read from /proc
//! (VmHWM, reset through `clear_refs` before each step) while:
//! - the leader writes the body a follower is sent (into its spool file);
//! - a fresh state machine installs that body (read from the spool as it is parsed);
//! - the baseline, in the same run: what the build before spooling did with the same
//!   body, held whole in memory on the way out and parsed whole on the way in.
//!
//! Each step runs in a process of its own (this binary again, `--measure STEP DIR`), so
//! none reuses pages another step freed.
//!
//! `cargo build --release -p lineage-benches && target/release/snapshot_memory
//! [--agents 16] [--requests 6250]`

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use lineage_core::guard::{decide, seal, AgentState, Command};
use lineage_core::{AuditKey, Policy, ToolRule};
use lineage_node::raft_types::{AppendRecords, Batch, Proposal, RecordLine, TypeConfig};
use lineage_node::snapshot_spool::SnapshotSpool;
use lineage_node::store;
use openraft::storage::RaftStateMachine;
use openraft::testing::log_id;
use openraft::{Entry, EntryPayload, RaftSnapshotBuilder};

/// Actions per Raft entry while loading.
const ACTIONS_PER_ENTRY: u64 = 250;

/// A field of /proc/self/status, in bytes.
fn status_bytes(field: &str) -> Result<u64, String> {
    let status = std::fs::read_to_string("/proc/self/status").map_err(|e| e.to_string())?;
    lineage_benches::status_field_bytes(&status, field)
        .ok_or_else(|| format!("no {field} in /proc/self/status"))
}

/// Resets the peak (VmHWM) to the current RSS, and returns the current RSS.
fn reset_peak() -> Result<u64, String> {
    std::fs::write("/proc/self/clear_refs", "5").map_err(|e| format!("clear_refs: {e}"))?;
    status_bytes("VmRSS:")
}

/// How far the peak rose above `base` since [`reset_peak`].
fn peak_growth(base: u64) -> Result<u64, String> {
    Ok(status_bytes("VmHWM:")?.saturating_sub(base))
}

/// Entries creating `agents` agents and allowing `requests` actions for each.
fn load(agents: u64, requests: u64) -> Result<Vec<Entry<TypeConfig>>, String> {
    let key = AuditKey::from_seed([7; 32]);
    let mut entries = Vec::new();
    let mut now = 1_800_000_000_000_000i64;
    for agent in 0..agents {
        let agent_id = format!("agent-{agent:05}");
        let mut state = AgentState::new();
        let mut commands = vec![Command::Create {
            agent_id: agent_id.clone(),
            policy: Policy::new(u64::MAX / 2).allow("search", ToolRule::cost(1)),
        }];
        commands.extend((0..requests).map(|i| Command::Request {
            tool: "search".into(),
            input: serde_json::json!({"q": format!("query number {i} of {agent_id}")}),
            cost: None,
        }));
        for chunk in commands.chunks(ACTIONS_PER_ENTRY as usize) {
            let mut lines = Vec::new();
            for command in chunk {
                now += 1;
                let decided = decide(&state, command, now, key.public_key_hex())
                    .map_err(|e| e.to_string())?;
                for record in seal(&state, decided.drafts, &key, now) {
                    state.apply(&record).map_err(|e| e.to_string())?;
                    lines.push(RecordLine::new(record).map_err(|e| e.to_string())?);
                }
            }
            let index = entries.len() as u64 + 1;
            entries.push(Entry {
                log_id: log_id(1, 1, index),
                payload: EntryPayload::Normal(Proposal::Writes(Batch(Arc::new(vec![
                    AppendRecords {
                        agent_id: agent_id.clone(),
                        records: lines,
                        idempotency: None,
                        authority: None,
                    },
                ])))),
            });
        }
    }
    Ok(entries)
}

/// The body as the build before spooling parsed it, whole.
#[derive(serde::Deserialize)]
#[expect(dead_code, reason = "parsed only to hold it, as that build did")]
struct WholeBody {
    records: BTreeMap<String, Vec<String>>,
    idempotency: serde_json::Value,
    heads: serde_json::Value,
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// Loads a state machine in `dir/leader`, and writes its snapshot's meta and body beside it.
/// Also prints how long openraft's state machine task (and with it every apply) was held
/// by the request for the body, beside how long the body took to write behind it.
async fn prepare(dir: &Path, agents: u64, requests: u64) -> Result<u64, String> {
    let (_log, mut leader) = store::open(&dir.join("leader"))?;
    leader
        .apply(load(agents, requests)?)
        .await
        .map_err(|e| e.to_string())?;
    leader
        .get_snapshot_builder()
        .await
        .build_snapshot()
        .await
        .map_err(|e| e.to_string())?;
    let asked = std::time::Instant::now();
    let mut snapshot = leader
        .get_current_snapshot()
        .await
        .map_err(|e| e.to_string())?
        .ok_or("no snapshot")?;
    let held = asked.elapsed();
    tokio::io::AsyncSeekExt::seek(&mut snapshot.snapshot, std::io::SeekFrom::Start(0))
        .await
        .map_err(|e| e.to_string())?;
    println!(
        "state machine task held {held:.1?} by the request for the body; the body written behind it in {:.1?}",
        asked.elapsed()
    );
    let meta = serde_json::to_string(&snapshot.meta).map_err(|e| e.to_string())?;
    std::fs::write(dir.join("meta.json"), meta).map_err(|e| e.to_string())?;
    let mut body = snapshot.snapshot;
    let mut out = tokio::fs::File::create(dir.join("body.json"))
        .await
        .map_err(|e| e.to_string())?;
    tokio::io::copy(&mut body, &mut out)
        .await
        .map_err(|e| e.to_string())
}

/// One step, in a process of its own (so no step reuses pages another freed): the peak
/// RSS growth it caused, in bytes.
async fn measure(step: &str, dir: &Path) -> Result<u64, String> {
    let read = |e: std::io::Error| e.to_string();
    match step {
        "send" => {
            let (_log, mut leader) = store::open(&dir.join("leader"))?;
            leader
                .get_snapshot_builder()
                .await
                .build_snapshot()
                .await
                .map_err(|e| e.to_string())?;
            let base = reset_peak()?;
            let mut sent = leader
                .get_current_snapshot()
                .await
                .map_err(|e| e.to_string())?
                .ok_or("no snapshot")?
                .snapshot;
            // The body is written behind the spool: its end is known once it is whole.
            tokio::io::AsyncSeekExt::seek(&mut sent, std::io::SeekFrom::End(0))
                .await
                .map_err(read)?;
            peak_growth(base)
        }
        "install" => {
            let meta = std::fs::read_to_string(dir.join("meta.json")).map_err(read)?;
            let meta = serde_json::from_str(&meta).map_err(|e| e.to_string())?;
            let body = std::fs::File::open(dir.join("body.json")).map_err(read)?;
            let target = tempfile::tempdir_in(dir).map_err(read)?;
            let (_log, mut follower) = store::open(target.path())?;
            let base = reset_peak()?;
            follower
                .install_snapshot(&meta, Box::new(SnapshotSpool::ready(body)))
                .await
                .map_err(|e| e.to_string())?;
            peak_growth(base)
        }
        "whole-send" | "whole-install" => {
            let base = reset_peak()?;
            let whole = std::fs::read(dir.join("body.json")).map_err(read)?;
            if step == "whole-send" {
                return peak_growth(base);
            }
            let parsed: WholeBody = serde_json::from_slice(&whole).map_err(|e| e.to_string())?;
            let growth = peak_growth(base)?;
            drop(parsed);
            Ok(growth)
        }
        other => Err(format!("no step {other}")),
    }
}

/// Runs `step` in a child process of this binary; its growth in bytes.
fn measured(step: &str, dir: &Path) -> Result<u64, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let out = std::process::Command::new(exe)
        .arg("--measure")
        .arg(step)
        .arg(dir)
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(format!(
            "step {step}: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .map_err(|e| format!("step {step}: {e}"))
}

fn report(agents: u64, requests: u64) -> Result<(), String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let body_bytes = runtime()?.block_on(prepare(dir.path(), agents, requests))?;
    let records = agents * (2 + 2 * requests);
    println!(
        "snapshot of {agents} agents, {records} records: body {:.1} MiB",
        mib(body_bytes)
    );
    println!("peak RSS growth (MiB)      spooled    held whole (baseline)   ratio");
    for (step, spooled, whole) in [
        ("leader writes the body", "send", "whole-send"),
        ("follower installs it ", "install", "whole-install"),
    ] {
        let spooled = measured(spooled, dir.path())?;
        let baseline = measured(whole, dir.path())?;
        println!(
            "  {step}  {:>9.1}    {:>9.1}               {:.3}x",
            mib(spooled),
            mib(baseline),
            spooled as f64 / baseline.max(1) as f64
        );
    }
    Ok(())
}

fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())
}

/// What a snapshot costs in memory on each side.
#[derive(clap::Parser)]
struct Args {
    /// Agents in the state machine.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    agents: u64,
    /// Allowed actions per agent (two records each).
    #[arg(long, default_value_t = 6250, value_parser = clap::value_parser!(u64).range(0..=100_000_000))]
    requests: u64,
    /// (This program runs itself so for each step: the step measured, in a data
    /// directory.)
    #[arg(long, num_args = 2, value_names = ["STEP", "DIR"], action = clap::ArgAction::Set)]
    measure: Option<Vec<String>>,
}

fn main() -> Result<(), String> {
    let args = <Args as clap::Parser>::parse();
    if let Some([step, dir]) = args.measure.as_deref() {
        let growth = runtime()?.block_on(measure(step, Path::new(dir)))?;
        println!("{growth}");
        return Ok(());
    }
    report(args.agents, args.requests)
}
