//! Shared pieces of the benchmarks in `benches/` (see README.md): the machine ceilings
//! every figure is printed against, and what the benchmark binaries all need.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use lineage_core::{AuditKey, AuditLog};

/// Durable single-record appends (one fdatasync each) per second on this disk, over 1 s.
pub fn durable_appends_per_second() -> Result<f64, String> {
    durable_appends_per_second_with(1)
}

/// Durable single-record appends per second, over 1 s, with `writers` threads each
/// appending to its own signed log at once: the reference guard's storage path (one file
/// per agent, every record sealed and fdatasynced before the answer), without its HTTP
/// and guard work. A single node storing that way does fewer decisions/s here than this
/// figure ÷ 2 (2 records per decision).
pub fn durable_appends_per_second_with(writers: usize) -> Result<f64, String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let logs = (0..writers.max(1))
        .map(|i| {
            AuditLog::create(
                dir.path().join(format!("ceiling-{i}.jsonl")),
                AuditKey::from_seed([6; 32]),
                "ceiling",
            )
            .map_err(|e| e.to_string())
        })
        .collect::<Result<Vec<_>, _>>()?;
    let start = Instant::now();
    let deadline = start + Duration::from_secs(1);
    let counts = std::thread::scope(|scope| {
        let threads: Vec<_> = logs
            .into_iter()
            .map(|mut log| {
                scope.spawn(move || -> Result<u64, String> {
                    let mut n = 0u64;
                    while Instant::now() < deadline {
                        log.append("ceiling", "tick", serde_json::json!({"n": n}))
                            .map_err(|e| e.to_string())?;
                        n += 1;
                    }
                    Ok(n)
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().unwrap_or_else(|_| Err("a writer panicked".into())))
            .collect::<Result<Vec<_>, _>>()
    })?;
    Ok(counts.iter().sum::<u64>() as f64 / start.elapsed().as_secs_f64())
}

/// The number after `name` on the command line, or `default`.
pub fn flag(name: &str, default: u64) -> u64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A binary built beside this benchmark (same target dir and profile); `build` says
/// which packages build it when it is missing.
pub fn sibling_binary(name: &str, build: &str) -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let path = exe.with_file_name(name);
    if path.exists() {
        Ok(path)
    } else {
        Err(format!(
            "{} not found: cargo build --release {build}",
            path.display()
        ))
    }
}

/// `lineage-node keygen` (the build at `binary`) into `keys`; returns the admin token.
pub fn keygen(binary: &Path, keys: &Path) -> Result<String, String> {
    let ok = std::process::Command::new(binary)
        .arg("keygen")
        .arg(keys)
        .stdout(std::process::Stdio::null())
        .status()
        .map_err(|e| e.to_string())?;
    if !ok.success() {
        return Err("keygen failed".into());
    }
    std::fs::read_to_string(keys.join("admin.token")).map_err(|e| e.to_string())
}

/// A loopback address (`127.0.0.1:PORT`) nothing listens on right now.
pub fn free_loopback_addr() -> Result<String, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.to_string())
        .map_err(|e| e.to_string())
}

/// A `kB` field of a `/proc/PID/status` text (`VmRSS:`, `VmHWM:`, `RssAnon:`), in bytes.
pub fn status_field_bytes(status: &str, field: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .map(|kb| kb * 1024)
}

/// Bytes of the files under `path` (their lengths, as `du -sb` counts them).
pub fn du_bytes(path: &Path) -> u64 {
    let mut total = 0;
    if let Ok(entries) = std::fs::read_dir(path) {
        for entry in entries.flatten() {
            match entry.metadata() {
                Ok(m) if m.is_dir() => total += du_bytes(&entry.path()),
                Ok(m) => total += m.len(),
                Err(_) => {}
            }
        }
    }
    total
}

/// GET `url` with `token` as the bearer; the answer's body as JSON.
pub async fn get_json(
    http: &reqwest::Client,
    url: &str,
    token: &str,
) -> Result<serde_json::Value, String> {
    http.get(url)
        .bearer_auth(token)
        .send()
        .await
        .map_err(|e| e.to_string())?
        .json()
        .await
        .map_err(|e| e.to_string())
}
