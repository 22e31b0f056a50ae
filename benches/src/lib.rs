//! Shared pieces of the benchmarks in `benches/` (see README.md): the machine ceilings
//! every figure is printed against.

use std::time::{Duration, Instant};

use lineage_core::{AuditKey, AuditLog};

/// Durable single-record appends (one fdatasync each) per second on this disk, over 1 s.
pub fn durable_appends_per_second() -> Result<f64, String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let mut log = AuditLog::create(
        dir.path().join("ceiling.jsonl"),
        AuditKey::from_seed([6; 32]),
        "ceiling",
    )
    .map_err(|e| e.to_string())?;
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < Duration::from_secs(1) {
        log.append("ceiling", "tick", serde_json::json!({"n": n}))
            .map_err(|e| e.to_string())?;
        n += 1;
    }
    Ok(n as f64 / start.elapsed().as_secs_f64())
}
