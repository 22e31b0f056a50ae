//! What a follower catching up from disk costs the leader's appends.
//!
//! A Raft log on this machine's disk holds `--history` entries of 18 KB (the size 16
//! clients over 16 agents make), so most of it lies beyond the 4 MiB of decoded entries
//! and is read back from the segment files. One task appends an entry at a time and
//! waits until it is durable (the writer's write + fdatasync), timing each append. It
//! does so alone (the baseline), then while a reader plays a follower that is far
//! behind: it reads 300 entries (openraft's default batch) from the oldest part, pauses
//! `--pause-ms` for the follower's round trip, and goes on. Rounds alternate the two
//! phases. Prints each phase's append p50/p99/max, their ratios to the baseline, and
//! the reader's entries/s.
//!
//!   cargo build --release -p lineage-benches
//!   target/release/log_reads [--rounds 3] [--appends 400] [--history 1500] [--pause-ms 2]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lineage_node::raft_types::{Proposal, TypeConfig};
use lineage_node::store::LogStore;
use openraft::storage::RaftLogStorage;
use openraft::{CommittedLeaderId, Entry, EntryPayload, LogId, RaftLogReader};

const ENTRY_BYTES: usize = 18_000;
/// openraft's default `max_payload_entries`: what one replication read asks for.
const READ_BATCH: u64 = 300;

/// What a follower catching up from disk costs the leader's appends.
#[derive(clap::Parser)]
struct Args {
    /// Rounds, each running both ways.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=100))]
    rounds: u64,
    /// Appends during each read.
    #[arg(long, default_value_t = 400, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    appends: u64,
    /// Entries in the log before the reads (at least two read batches).
    #[arg(long, default_value_t = 1500, value_parser = clap::value_parser!(u64).range(2 * READ_BATCH..=10_000_000))]
    history: u64,
    /// The follower's round trip between two reads, in milliseconds.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(0..=10_000))]
    pause_ms: u64,
}

fn main() {
    let args = <Args as clap::Parser>::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("log_reads: cannot start a runtime: {e}");
            std::process::exit(1);
        }
    };
    if let Err(e) = runtime.block_on(run(&args)) {
        eprintln!("log_reads: {e}");
        std::process::exit(1);
    }
}

fn entry(index: u64) -> Entry<TypeConfig> {
    Entry {
        log_id: LogId::new(CommittedLeaderId::new(1, 1), index),
        payload: EntryPayload::Normal(Proposal::Witnessed {
            note: format!("{index:>20}{}", "x".repeat(ENTRY_BYTES - 20)),
        }),
    }
}

async fn run(args: &Args) -> Result<(), String> {
    let (rounds, appends, history) = (args.rounds, args.appends, args.history);
    let pause = Duration::from_millis(args.pause_ms);
    let dir = tempfile::Builder::new()
        .prefix("log_reads")
        .tempdir_in(std::env::current_dir().map_err(|e| e.to_string())?)
        .map_err(|e| e.to_string())?;
    let mut log = LogStore::open(dir.path())?;
    for first in (1..=history).step_by(100) {
        let batch = (first..=history.min(first + 99)).map(entry).collect();
        log.append_and_wait(batch)
            .await
            .map_err(|e| e.to_string())?;
    }
    let mut next = history + 1;
    println!(
        "log_reads: {history} entries of {ENTRY_BYTES} B, {appends} durable appends per phase, \
         reader: {READ_BATCH} entries then a {} ms pause",
        pause.as_millis()
    );
    let (mut alone, mut beside) = (Vec::new(), Vec::new());
    let mut read_rates = Vec::new();
    for round in 1..=rounds {
        alone.extend(time_appends(&mut log, &mut next, appends).await?);
        let stop = Arc::new(AtomicBool::new(false));
        let read = Arc::new(AtomicU64::new(0));
        let reader = tokio::spawn(follow_from_disk(
            log.get_log_reader().await,
            history,
            pause,
            stop.clone(),
            read.clone(),
        ));
        let started = Instant::now();
        beside.extend(time_appends(&mut log, &mut next, appends).await?);
        stop.store(true, Ordering::Relaxed);
        reader
            .await
            .map_err(|e| format!("the reader panicked: {e}"))??;
        let rate = read.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64();
        read_rates.push(rate);
        println!("round {round}: reader {rate:.0} entries/s");
    }
    let (a, b) = (Percentiles::of(&mut alone), Percentiles::of(&mut beside));
    println!("appends alone (baseline):          {a}");
    println!("appends beside a catching-up read: {b}");
    println!(
        "ratio beside / alone: p50 {:.2}x  p99 {:.2}x  max {:.2}x",
        b.p50 / a.p50,
        b.p99 / a.p99,
        b.max / a.max
    );
    read_rates.sort_by(f64::total_cmp);
    if let Some(median) = read_rates.get(read_rates.len() / 2) {
        println!("reader: median {median:.0} entries/s from disk");
    }
    Ok(())
}

/// Appends `count` entries one at a time, each awaited until durable; their times in µs.
async fn time_appends(log: &mut LogStore, next: &mut u64, count: u64) -> Result<Vec<f64>, String> {
    let mut times = Vec::new();
    for _ in 0..count {
        let started = Instant::now();
        log.append_and_wait(vec![entry(*next)])
            .await
            .map_err(|e| e.to_string())?;
        times.push(started.elapsed().as_secs_f64() * 1e6);
        *next += 1;
    }
    Ok(times)
}

/// Reads the oldest part of the log in replication-sized batches until told to stop.
async fn follow_from_disk(
    mut reader: LogStore,
    history: u64,
    pause: Duration,
    stop: Arc<AtomicBool>,
    read: Arc<AtomicU64>,
) -> Result<(), String> {
    let mut from = 1;
    while !stop.load(Ordering::Relaxed) {
        let entries = reader
            .try_get_log_entries(from..from + READ_BATCH)
            .await
            .map_err(|e| format!("read from {from}: {e}"))?;
        if entries.len() as u64 != READ_BATCH {
            return Err(format!("read {} entries from {from}", entries.len()));
        }
        read.fetch_add(READ_BATCH, Ordering::Relaxed);
        from = if from + 2 * READ_BATCH > history {
            1
        } else {
            from + READ_BATCH
        };
        tokio::time::sleep(pause).await;
    }
    Ok(())
}

struct Percentiles {
    p50: f64,
    p99: f64,
    max: f64,
}

impl Percentiles {
    fn of(times: &mut [f64]) -> Self {
        times.sort_by(f64::total_cmp);
        let at = |q: f64| {
            times
                .get(((times.len() as f64 - 1.0) * q).round() as usize)
                .copied()
                .unwrap_or(f64::NAN)
        };
        Percentiles {
            p50: at(0.50),
            p99: at(0.99),
            max: at(1.0),
        }
    }
}

impl std::fmt::Display for Percentiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "p50 {:.0} µs  p99 {:.0} µs  max {:.0} µs",
            self.p50, self.p99, self.max
        )
    }
}
