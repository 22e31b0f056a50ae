//! `lineage import --from DIR`: moves a reference guard's data directory into a running
//! cluster, through its Raft log (`/v1/agents/{id}/import/*`, admin), agent by agent.
//!
//! Each file is read once, under a try-lock (a reference guard still running holds its
//! lock, and the file is refused), and never written. The reference's own repair of a
//! torn last line is applied in memory (kept if it parses as a record, else dropped and
//! reported); anything else that fails verification is refused whole, since importing
//! the verified prefix of a tampered log would itself refund the agent. The cluster
//! checks the chain and every signature again as it applies the records, and seals the
//! termination the reference would have added on opening the log if it is missing.
//!
//! Resumable and idempotent: a run again skips what the cluster holds, resumes an
//! import cut short from the cluster's head, and refuses a file that differs from what
//! the cluster has (another genesis, or a log that grew after its import).

use std::io::Write;
use std::path::{Path, PathBuf};

use lineage_core::record::timestamp;
use lineage_core::verify::{verify_records, VerifyOptions};
use lineage_core::{AuditKey, Record};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::ops_cli::{runtime, Failure, Target};
use crate::Client;

/// The most record bytes sent in one step (the API's limit).
const BATCH_BYTES: usize = 128 * 1024;
/// Records stamped further ahead of this machine's clock than this are refused: the
/// agent's rate windows would throttle it until then.
const MAX_FUTURE_MICROS: i64 = 5 * 60 * 1_000_000;

/// One source log, read and checked.
struct Source {
    agent_id: String,
    lines: Vec<String>,
    records: Vec<Record>,
    sha256: String,
    /// What the torn-tail rule dropped.
    dropped: Option<String>,
    /// The open file, its lock held until this agent's import is done: a reference
    /// guard started meanwhile cannot append to it.
    _lock: Option<std::fs::File>,
}

/// What happened to one file.
enum Outcome {
    Imported { records: usize, sealed: usize },
    AlreadyThere,
    Refused(String),
}

/// Why a file is not imported.
enum Refusal {
    /// It failed a check of its content: its id is reserved for good (a tombstone),
    /// since a fresh agent of that id would be the refund the guard exists to prevent.
    Tampered { why: String, sha256: String },
    /// Anything else (locked, unreadable, an id the cluster does not accept): try again
    /// once it is fixed.
    Other(String),
}

/// Records sent between two progress lines of one long log.
const PROGRESS_RECORDS: usize = 2_000;

/// A long log says how far it is, on stderr, every `PROGRESS_RECORDS` or so, and at
/// its end.
fn report_progress(id: &str, before: usize, now: usize, total: usize) {
    if total > PROGRESS_RECORDS
        && (before / PROGRESS_RECORDS != now / PROGRESS_RECORDS || now == total)
    {
        eprintln!("  {id}: {now}/{total} records sent");
    }
}

/// What a run did, printed last.
#[derive(Default)]
struct Summary {
    imported: usize,
    records: usize,
    already: usize,
    torn_tails: usize,
    sealed: usize,
    tombstoned: usize,
    refused: usize,
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "summary: {} agent(s) imported ({} records), {} already imported, {} torn tail(s) \
             dropped, {} termination(s) sealed, {} failed verification (ids reserved for good), \
             {} refused in all",
            self.imported,
            self.records,
            self.already,
            self.torn_tails,
            self.sealed,
            self.tombstoned,
            self.refused
        )
    }
}

/// `lineage import --from DIR`.
pub fn import(target: &Target, dir: &Path, out: &mut dyn Write) -> Result<(), Failure> {
    let w = |e: std::io::Error| Failure::Usage(e.to_string());
    let key = AuditKey::load(dir.join("keys").join("audit.key"))
        .map_err(|e| Failure::Usage(format!("{}: {e}", dir.join("keys/audit.key").display())))?;
    let client = target.admin_client()?;
    let rt = runtime()?;
    let cluster_key = rt.block_on(client.get_json("/v1/public-key"))?["public_key"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    if !cluster_key.eq_ignore_ascii_case(key.public_key_hex()) {
        return Err(Failure::Negative(format!(
            "{}'s audit key ({}) is not this cluster's ({cluster_key}): its logs cannot be \
             continued under lineage-audit-v1. Start the cluster with keys made by \
             `lineage-node keygen KEYS_DIR --from-reference {}`",
            dir.display(),
            key.public_key_hex(),
            dir.display()
        )));
    }
    let mut files = source_files(dir)?;
    files.sort();
    let mut refused = 0;
    let mut summary = Summary::default();
    for path in files {
        let outcome = match read_source(&path, key.public_key_hex()) {
            Ok(source) => {
                if let Some(dropped) = &source.dropped {
                    summary.torn_tails += 1;
                    writeln!(
                        out,
                        "{}: dropped a torn last line ({dropped})",
                        path.display()
                    )
                    .map_err(w)?;
                }
                rt.block_on(import_one(&client, &source))
                    .unwrap_or_else(|e| Outcome::Refused(e.to_string()))
            }
            Err(Refusal::Other(why)) => Outcome::Refused(why),
            Err(Refusal::Tampered { why, sha256 }) => {
                summary.tombstoned += 1;
                Outcome::Refused(rt.block_on(tombstone(&client, &path, &why, &sha256)))
            }
        };
        let line = match outcome {
            Outcome::Imported { records, sealed } => {
                summary.imported += 1;
                summary.records += records;
                summary.sealed += sealed;
                let sealed = match sealed {
                    0 => String::new(),
                    n => {
                        format!(", sealed {n} missing termination record(s) as the reference would")
                    }
                };
                format!("imported {} ({records} records{sealed})", path.display())
            }
            Outcome::AlreadyThere => {
                summary.already += 1;
                format!("already imported {}", path.display())
            }
            Outcome::Refused(why) => {
                refused += 1;
                format!("REFUSED {}: {why}", path.display())
            }
        };
        writeln!(out, "{line}").map_err(w)?;
    }
    summary.refused = refused;
    writeln!(out, "{summary}").map_err(w)?;
    if refused > 0 {
        return Err(Failure::Negative(format!(
            "{refused} file(s) refused; nothing was imported from them"
        )));
    }
    Ok(())
}

fn source_files(dir: &Path) -> Result<Vec<PathBuf>, Failure> {
    let agents = dir.join("agents");
    let entries = std::fs::read_dir(&agents)
        .map_err(|e| Failure::Usage(format!("{}: {e}", agents.display())))?;
    Ok(entries
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "jsonl"))
        .collect())
}

/// Reads and checks one file: locked, the torn-tail rule, every line verified under the
/// cluster's key, the genesis naming the file's id, no record far in the future.
fn read_source(path: &Path, public_key: &str) -> Result<Source, Refusal> {
    let (agent_id, bytes, lock) = read_locked(path).map_err(Refusal::Other)?;
    let sha256 = hex::encode(Sha256::digest(&bytes));
    let mut source = checked_source(agent_id, bytes, public_key)
        .map_err(|why| Refusal::Tampered { why, sha256 })?;
    source._lock = Some(lock);
    // Not the content's fault: refused, to be tried again once fixed.
    let horizon = timestamp::now_micros() + MAX_FUTURE_MICROS;
    if let Some(late) = source
        .records
        .iter()
        .find(|r| timestamp::parse(&r.timestamp).is_some_and(|t| t > horizon))
    {
        return Err(Refusal::Other(format!(
            "record seq {} is stamped {}, more than 5 minutes ahead of this machine's clock \
             (the agent's rate windows would hold it back until then): fix the clock",
            late.seq, late.timestamp
        )));
    }
    for (line, record) in source.lines.iter().zip(&source.records) {
        if record.to_line() != *line {
            return Err(Refusal::Other(format!(
                "record seq {} is not written in the format's line form, which the cluster \
                 stores and serves",
                record.seq
            )));
        }
    }
    Ok(source)
}

/// Reserves `path`'s agent id for good, since its log failed verification; says what
/// was done.
async fn tombstone(client: &Client, path: &Path, why: &str, sha256: &str) -> String {
    let id = path
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or_default();
    let reason = format!("{why}; a tampered log is not imported, not even its valid prefix");
    let answer = client
        .post_json(
            &format!("/v1/agents/{id}/import/tombstone"),
            json!({"reason": reason, "source_sha256": sha256}),
        )
        .await;
    match answer {
        Ok(_) => format!(
            "{reason}. Its id is reserved for good; keep the file as evidence (sha256 {sha256})"
        ),
        Err(e) => format!("{reason}. Reserving its id failed too: {e}"),
    }
}

/// The file's agent id and bytes, read under a try-lock.
fn read_locked(path: &Path) -> Result<(String, Vec<u8>, std::fs::File), String> {
    let agent_id = path
        .file_stem()
        .and_then(|s| s.to_str())
        .ok_or("the file name is not UTF-8")?
        .to_string();
    if !lineage_core::guard::is_agent_id(&agent_id) {
        return Err(format!(
            "{agent_id:?} is not an agent id this cluster accepts ([A-Za-z0-9_-], 1-64)"
        ));
    }
    let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
    file.try_lock().map_err(|_| {
        "it is locked: a reference guard still has it open (stop it first)".to_string()
    })?;
    let bytes = std::fs::read(path).map_err(|e| e.to_string())?;
    Ok((agent_id, bytes, file))
}

/// The torn-tail rule, then every check of the content: records, verification under the
/// cluster's key, the genesis naming the file's id.
fn checked_source(agent_id: String, bytes: Vec<u8>, public_key: &str) -> Result<Source, String> {
    let sha256 = hex::encode(Sha256::digest(&bytes));
    let mut raw: Vec<&[u8]> = bytes.split(|b| *b == b'\n').collect();
    // `split` leaves an empty piece after a final newline; anything else there is a last
    // line without one (a torn write, which may end inside a character): the reference
    // keeps it if it parses as a record, else drops it. Only then must all be UTF-8.
    let mut dropped = None;
    if let Some(last) = raw.pop() {
        if !last.is_empty() {
            let whole = std::str::from_utf8(last)
                .ok()
                .is_some_and(|line| Record::from_line(line).is_ok());
            if whole {
                raw.push(last);
            } else {
                dropped = Some(format!("{} bytes", last.len()));
            }
        }
    }
    let lines = raw
        .iter()
        .enumerate()
        .map(|(n, line)| {
            std::str::from_utf8(line)
                .map(str::to_string)
                .map_err(|_| format!("line {} is not UTF-8", n + 1))
        })
        .collect::<Result<Vec<String>, String>>()?;
    let records = lines
        .iter()
        .enumerate()
        .map(|(n, line)| {
            Record::from_line(line).map_err(|e| format!("line {}: not a record: {e}", n + 1))
        })
        .collect::<Result<Vec<_>, _>>()?;
    if records.is_empty() {
        return Err("no records".into());
    }
    let report = verify_records(
        &records,
        &VerifyOptions {
            public_key: Some(public_key.to_string()),
            checkpoint: None,
        },
    );
    if !report.ok {
        return Err(format!(
            "it fails verification ({})",
            report.failure.map_or_else(String::new, |f| f.to_string())
        ));
    }
    if records[0].payload.get("log_id").and_then(Value::as_str) != Some(agent_id.as_str()) {
        return Err("its genesis names another log id than the file's name".into());
    }
    Ok(Source {
        agent_id,
        lines,
        records,
        sha256,
        dropped,
        _lock: None,
    })
}

async fn import_one(client: &Client, source: &Source) -> Result<Outcome, String> {
    let id = &source.agent_id;
    let status = import_status(client, id).await?;
    let genesis = &source.records[0].hash;
    let held = status["next_seq"].as_u64().unwrap_or(0) as usize;
    if held > 0 && status["genesis_hash"].as_str() != Some(genesis.as_str()) {
        return Err(format!(
            "the cluster holds another log for {id} (a different genesis)"
        ));
    }
    // The cluster's copy must be a prefix of the file (or, once active, may have gone on).
    let prefix_holds = |n: usize| {
        n == 0
            || status["head"]["hash"].as_str() == source.records.get(n - 1).map(|r| r.hash.as_str())
    };
    match status["state"].as_str() {
        Some("active") => {
            let file_len = source.records.len();
            return if held >= file_len
                && client_record_hash(client, id, file_len - 1).await?
                    == source.records[file_len - 1].hash
            {
                Ok(Outcome::AlreadyThere)
            } else {
                Err("the file grew, or differs, after its import: diverged".into())
            };
        }
        Some("quarantined") => return Err("the cluster's copy is quarantined".into()),
        Some("importing") if !prefix_holds(held) || held > source.records.len() => {
            return Err("the import under way does not match this file".into());
        }
        _ => {}
    }
    let last = &source.records[source.records.len() - 1];
    client
        .post_json(
            &format!("/v1/agents/{id}/import/begin"),
            json!({"genesis_hash": genesis, "source_sha256": source.sha256,
                   "head": {"seq": last.seq, "hash": last.hash}}),
        )
        .await
        .map_err(|e| e.to_string())?;
    let mut next = held;
    while next < source.lines.len() {
        let sent = next;
        let mut end = next;
        let mut bytes = 0;
        while end < source.lines.len()
            && (end == next || bytes + source.lines[end].len() <= BATCH_BYTES)
        {
            bytes += source.lines[end].len();
            end += 1;
        }
        let body = format!("{{\"records\":[{}]}}", source.lines[next..end].join(","));
        if let Err(e) = client
            .post_raw_json(&format!("/v1/agents/{id}/import/records"), body)
            .await
        {
            // A step retried after it had landed is refused (its records no longer
            // extend the head): what the cluster holds says which it was.
            let now = import_status(client, id).await?;
            let landed = now["state"] == "importing"
                && now["next_seq"].as_u64().is_some_and(|n| n >= end as u64);
            if !landed {
                return Err(e.to_string());
            }
        }
        next = end;
        report_progress(id, sent, next, source.lines.len());
    }
    match client
        .post_json(
            &format!("/v1/agents/{id}/import/commit"),
            json!({"head": {"seq": last.seq, "hash": last.hash}}),
        )
        .await
    {
        Ok(answer) => Ok(Outcome::Imported {
            records: source.records.len(),
            sealed: answer["sealed"].as_array().map_or(0, Vec::len),
        }),
        Err(e) => {
            let now = import_status(client, id).await?;
            let file_len = source.records.len();
            let landed = now["state"] == "active"
                && now["next_seq"]
                    .as_u64()
                    .is_some_and(|n| n >= file_len as u64)
                && client_record_hash(client, id, file_len - 1).await? == last.hash;
            if landed {
                Ok(Outcome::Imported {
                    records: file_len,
                    sealed: 0,
                })
            } else {
                Err(e.to_string())
            }
        }
    }
}

async fn import_status(client: &Client, agent_id: &str) -> Result<Value, String> {
    client
        .get_json(&format!("/v1/agents/{agent_id}/import"))
        .await
        .map_err(|e| e.to_string())
}

/// The hash of the cluster's record `seq` of `agent_id`.
async fn client_record_hash(client: &Client, agent_id: &str, seq: usize) -> Result<String, String> {
    let path = match seq.checked_sub(1) {
        Some(after) => format!("/v1/agents/{agent_id}/log?after={after}&limit=1"),
        None => format!("/v1/agents/{agent_id}/log?limit=1"),
    };
    let page = client.get_json(&path).await.map_err(|e| e.to_string())?;
    let record = &page["records"][0];
    if record["seq"].as_u64() != Some(seq as u64) {
        return Err(format!("the cluster has no record {seq} of {agent_id}"));
    }
    Ok(record["hash"].as_str().unwrap_or_default().to_string())
}
