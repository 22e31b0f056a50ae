//! What encoding a Raft entry costs, before and after records carry their lines.
//!
//! One entry of 16 writes (an agent's request and decision records each, with realistic
//! payloads), as the 3-node benchmark's batches are. Per entry, the leader encodes it
//! for its own log and for each of two followers and makes every record's line; a
//! follower decodes it, encodes it for its log and makes the lines for its store.
//! Baseline: entries holding plain records (every encode walks them, every store makes
//! each line again). Measured: entries holding `RecordLine`s (the line is made once, by
//! the leader; everything else copies it). Best of five rounds, so a busy machine skews
//! both sides less. A follower's measured side decodes lines only: it parses their
//! records when it applies the entry, which is not counted here (the baseline parses on
//! decode), so the follower's ratio says how much lighter its append path became, not
//! its total.
//!
//!   cargo build --release -p lineage-benches && target/release/entry_codec [--rounds 2000]

use std::hint::black_box;
use std::time::{Duration, Instant};

use lineage_core::guard::{decide, seal, AgentState, Command};
use lineage_core::{AuditKey, Policy, Record, ToolRule};
use lineage_node::raft_types::RecordLine;
use serde::{Deserialize, Serialize};

const WRITES: usize = 16;
const FOLLOWERS: usize = 2;

/// The entry shape before: one agent's records as plain records.
#[derive(Serialize, Deserialize)]
struct PlainWrite {
    agent_id: String,
    records: Vec<Record>,
}

#[derive(Serialize, Deserialize)]
struct LineWrite {
    agent_id: String,
    records: Vec<RecordLine>,
}

/// What encoding a Raft entry costs.
#[derive(clap::Parser)]
struct Args {
    /// Rounds over the sample records.
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(10..=1_000_000))]
    rounds: u64,
}

fn main() {
    let args = <Args as clap::Parser>::parse();
    if let Err(e) = run(args.rounds) {
        eprintln!("entry_codec: {e}");
        std::process::exit(1);
    }
}

/// Each agent's request and decision records for one allowed action.
fn sample_records() -> Result<Vec<(String, Vec<Record>)>, String> {
    let key = AuditKey::generate().map_err(|e| e.to_string())?;
    let mut writes = Vec::new();
    for agent in 0..WRITES {
        let agent_id = format!("agent-{agent}");
        let mut state = AgentState::new();
        let create = Command::Create {
            agent_id: agent_id.clone(),
            policy: Policy::new(1_000_000).allow("send_email", ToolRule::cost(3)),
        };
        let request = Command::Request {
            tool: "send_email".into(),
            input: serde_json::json!({
                "to": "ops@example.com",
                "subject": "weekly report",
                "body": "Numbers for the week, as attached.\nRegards",
            }),
            cost: None,
        };
        let mut last = Vec::new();
        for (i, command) in [create, request].iter().enumerate() {
            let now = 1_800_000_000_000_000 + i as i64;
            let decided =
                decide(&state, command, now, key.public_key_hex()).map_err(|e| format!("{e:?}"))?;
            last = seal(&state, decided.drafts, &key, now);
            for record in &last {
                state.apply(record).map_err(|e| e.to_string())?;
            }
        }
        writes.push((agent_id, last));
    }
    Ok(writes)
}

/// The lines every node's store gets, made again from each record (the baseline).
fn stored_lines_remade(writes: &[PlainWrite]) -> usize {
    let lines = writes
        .iter()
        .flat_map(|w| w.records.iter().map(Record::to_line));
    lines.map(|line| line.len()).sum()
}

/// The lines every node's store gets, copied from the entry.
fn stored_lines_copied(writes: &[LineWrite]) -> usize {
    let lines = writes
        .iter()
        .flat_map(|w| w.records.iter().map(|r| r.line().to_string()));
    lines.map(|line| line.len()).sum()
}

/// The best time of five rounds of `rounds` calls.
fn best_of_five(rounds: u64, mut f: impl FnMut() -> usize) -> Duration {
    (0..5)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..rounds {
                black_box(f());
            }
            start.elapsed() / rounds as u32
        })
        .min()
        .unwrap_or_default()
}

fn run(rounds: u64) -> Result<(), String> {
    let samples = sample_records()?;
    let plain: Vec<PlainWrite> = samples
        .iter()
        .map(|(agent_id, records)| PlainWrite {
            agent_id: agent_id.clone(),
            records: records.clone(),
        })
        .collect();
    let encoded = serde_json::to_vec(&plain).map_err(|e| e.to_string())?;

    let plain_leader = best_of_five(rounds, || {
        let mut bytes = 0;
        for _ in 0..1 + FOLLOWERS {
            bytes += serde_json::to_vec(&plain).map(|v| v.len()).unwrap_or(0);
        }
        bytes + stored_lines_remade(&plain)
    });
    let line_leader = best_of_five(rounds, || {
        let lines: Vec<LineWrite> = plain
            .iter()
            .map(|w| LineWrite {
                agent_id: w.agent_id.clone(),
                records: w
                    .records
                    .iter()
                    .filter_map(|r| RecordLine::new(r.clone()).ok())
                    .collect(),
            })
            .collect();
        let mut bytes = 0;
        for _ in 0..1 + FOLLOWERS {
            bytes += serde_json::to_vec(&lines).map(|v| v.len()).unwrap_or(0);
        }
        bytes + stored_lines_copied(&lines)
    });
    // The leader's side of the baseline clones nothing, the measured side clones each
    // record once (into its RecordLine), which the node does not: it moves them.
    let clone_cost = best_of_five(rounds, || {
        plain
            .iter()
            .map(|w| {
                w.records
                    .iter()
                    .map(|r| black_box(r.clone()).seq as usize)
                    .sum::<usize>()
            })
            .sum()
    });
    let line_leader = line_leader.saturating_sub(clone_cost);

    let plain_follower = best_of_five(rounds, || {
        let Ok(entry) = serde_json::from_slice::<Vec<PlainWrite>>(&encoded) else {
            return 0;
        };
        serde_json::to_vec(&entry).map_or(0, |v| v.len()) + stored_lines_remade(&entry)
    });
    let line_follower = best_of_five(rounds, || {
        let Ok(entry) = serde_json::from_slice::<Vec<LineWrite>>(&encoded) else {
            return 0;
        };
        serde_json::to_vec(&entry).map_or(0, |v| v.len()) + stored_lines_copied(&entry)
    });
    // Both decode the same bytes into the same records.
    let check: Vec<LineWrite> = serde_json::from_slice(&encoded).map_err(|e| e.to_string())?;
    if check.iter().zip(&plain).any(|(a, b)| {
        a.records.len() != b.records.len()
            || a.records
                .iter()
                .zip(&b.records)
                .any(|(x, y)| x.record().ok().as_deref() != Some(y))
    }) {
        return Err("line entries decode to other records".into());
    }

    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!(
        "entry of {WRITES} writes ({} records, {} bytes), {rounds} rounds, best of 5:",
        WRITES * 2,
        encoded.len()
    );
    println!(
        "  leader   (encode for own log + {FOLLOWERS} followers, make lines): plain records {:.1} µs, record lines {:.1} µs: {:.2}x",
        us(plain_leader),
        us(line_leader),
        us(line_leader) / us(plain_leader).max(f64::MIN_POSITIVE)
    );
    println!(
        "  follower (decode, encode for own log, make lines):         plain records {:.1} µs, record lines {:.1} µs: {:.2}x",
        us(plain_follower),
        us(line_follower),
        us(line_follower) / us(plain_follower).max(f64::MIN_POSITIVE)
    );
    Ok(())
}
