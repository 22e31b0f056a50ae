//! What the embedded guard's `pending()` and `action()` cost on a long log: each reads
//! back only the request records it shows (`AuditLog::records_at`), against reading and
//! parsing the whole file (`Guard::records`, what both did before), the baseline, in the
//! same run. The log holds `--records` records of allowed actions (200-byte inputs),
//! then one action waiting for an approval; it is written in one go, then opened (and
//! verified) by `Guard::open` as an agent would.
//!
//!   cargo build --release -p lineage-benches && target/release/embedded_reads [--records 200000]

use std::io::Write;
use std::time::{Duration, Instant};

use lineage_core::guard::{decide, seal, AgentState, Command};
use lineage_core::record::timestamp;
use lineage_core::{AuditKey, Guard, Policy, ToolRule};

/// What the embedded guard's `pending()` and `action()` cost on a long log.
#[derive(clap::Parser)]
struct Args {
    /// Records in the log.
    #[arg(long, default_value_t = 200_000, value_parser = clap::value_parser!(u64).range(10..))]
    records: u64,
}

fn main() {
    let args = <Args as clap::Parser>::parse();
    if let Err(e) = real_main(args.records) {
        eprintln!("embedded_reads: {e}");
        std::process::exit(1);
    }
}

/// The mean time of `runs` calls of `call` (at least one).
fn mean_time<T>(
    runs: u32,
    mut call: impl FnMut() -> Result<T, String>,
) -> Result<Duration, String> {
    let runs = runs.max(1);
    let started = Instant::now();
    for _ in 0..runs {
        call()?;
    }
    Ok(started.elapsed() / runs)
}

fn real_main(records: u64) -> Result<(), String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let path = dir.path().join("agent.jsonl");
    let key = AuditKey::from_seed([9; 32]);
    let policy = Policy::new(u64::MAX / 2)
        .allow("search", ToolRule::cost(1))
        .allow("refund", ToolRule::cost(1).with_approval())
        .rate_limit(u32::MAX, 60);
    let mut commands = vec![Command::Create {
        agent_id: "agent".into(),
        policy,
    }];
    let filler = "x".repeat(200);
    // Each request makes two records (requested, decided).
    commands.extend((0..records / 2).map(|n| Command::Request {
        tool: "search".into(),
        input: serde_json::json!({"n": n, "text": filler}),
        cost: None,
    }));
    commands.push(Command::Request {
        tool: "refund".into(),
        input: serde_json::json!({"order": 42}),
        cost: None,
    });
    let mut state = AgentState::new();
    let mut file =
        std::io::BufWriter::new(std::fs::File::create(&path).map_err(|e| e.to_string())?);
    let start = timestamp::now_micros();
    for (i, command) in commands.iter().enumerate() {
        let now = start + i as i64;
        let decided =
            decide(&state, command, now, key.public_key_hex()).map_err(|e| e.to_string())?;
        for record in seal(&state, decided.drafts, &key, now) {
            state.apply(&record).map_err(|e| e.to_string())?;
            writeln!(file, "{}", record.to_line()).map_err(|e| e.to_string())?;
        }
    }
    file.flush().map_err(|e| e.to_string())?;
    drop(file);
    let bytes = std::fs::metadata(&path).map_err(|e| e.to_string())?.len();
    let opened = Instant::now();
    let guard = Guard::open(&path, key).map_err(|e| e.to_string())?;
    println!(
        "log: {} records, {:.1} MB; Guard::open (verify and replay) {:.2?}",
        guard.head().seq + 1,
        bytes as f64 / 1e6,
        opened.elapsed()
    );
    let waiting = guard.pending().map_err(|e| e.to_string())?;
    if waiting.len() != 1 {
        return Err(format!(
            "expected one waiting action, found {}",
            waiting.len()
        ));
    }
    let pending = mean_time(100, || guard.pending().map_err(|e| e.to_string()))?;
    let action = mean_time(100, || guard.action("act-1").map_err(|e| e.to_string()))?;
    let whole = mean_time(3, || guard.records().map_err(|e| e.to_string()))?;
    println!("pending(): {pending:.2?} a call; action(): {action:.2?} a call");
    println!("the whole file read (the baseline, what each did before): {whole:.2?} a call");
    println!(
        "pending() / baseline: {:.5}x; action() / baseline: {:.5}x",
        pending.as_secs_f64() / whole.as_secs_f64(),
        action.as_secs_f64() / whole.as_secs_f64()
    );
    Ok(())
}
