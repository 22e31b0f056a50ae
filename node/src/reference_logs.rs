//! Agent logs of the reference guard server (`agents/<id>.jsonl`) found in a node's data
//! directory are never ignored. A node started on a reference guard's directory used to
//! serve on, answering `agent not found` for every agent there: creating one again would
//! have given it a fresh budget and no scars, and its old tokens (an HMAC of the id)
//! would have worked. That is the refund the guard exists to prevent.
//!
//! So at start-up each such file must already be held by the cluster (same genesis, same
//! head: imported), or the node refuses to start and names the files. With
//! `LINEAGE_IGNORE_REFERENCE_LOGS=1` the cluster's only voter (drop-in mode) starts
//! anyway, and those ids stay reserved on it: creating one is refused (409). A node of a
//! larger cluster refuses the override, since the reservation would hold on this node
//! only. The files are only read, never written.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use lineage_core::record::Record;

use crate::store::agent_slot::AgentSlot;
use crate::store::StateMachine;

/// The environment variable that starts a node despite reference logs it does not hold.
pub const IGNORE_VAR: &str = "LINEAGE_IGNORE_REFERENCE_LOGS";

/// A reference log the cluster does not hold, and why.
struct Unheld {
    path: PathBuf,
    why: String,
}

/// The first and last record of a reference log's bytes (a last line without its
/// newline that does not parse, even one cut inside a character, is a torn write, as the
/// reference treats it).
fn genesis_and_head(bytes: &[u8]) -> Result<(Record, Record), String> {
    let mut lines: Vec<&[u8]> = bytes.split(|b| *b == b'\n').collect();
    let last = lines.pop().unwrap_or_default();
    let whole = std::str::from_utf8(last)
        .ok()
        .is_some_and(|line| Record::from_line(line).is_ok());
    if !last.is_empty() && whole {
        lines.push(last);
    }
    let lines: Vec<&[u8]> = lines.into_iter().filter(|l| !l.is_empty()).collect();
    let (Some(first), Some(last)) = (lines.first(), lines.last()) else {
        return Err("no record in it".into());
    };
    let parse = |line: &[u8], which: &str| {
        std::str::from_utf8(line)
            .map_err(|_| format!("{which} line: not UTF-8"))
            .and_then(|line| Record::from_line(line).map_err(|e| format!("{which} line: {e}")))
    };
    Ok((parse(first, "first")?, parse(last, "last")?))
}

/// Whether the cluster holds `path`'s log: the agent exists with the same genesis, and
/// the cluster's record at the file's last seq is the file's last record (the cluster
/// may have gone on from there); or the id is tombstoned for this very file (it failed
/// verification at import: nothing of it is served, and the id stays reserved).
fn held(path: &Path, agent_id: &str, sm: &StateMachine) -> Result<(), String> {
    let bytes = std::fs::read(path).map_err(|e| e.to_string())?;
    if let Some(tombstone) = sm.read_data().tombstones.get(agent_id) {
        use sha2::Digest;
        let sha256 = hex::encode(sha2::Sha256::digest(&bytes));
        return if sha256 == tombstone.source_sha256 {
            Ok(())
        } else {
            Err("its id is tombstoned for another file".into())
        };
    }
    let (genesis, head) = genesis_and_head(&bytes)?;
    match sm.read_data().agents.get(agent_id) {
        None => return Err("the cluster has no such agent".into()),
        Some(AgentSlot::Quarantined(reason)) => {
            return Err(format!("the cluster's copy is quarantined: {reason}"))
        }
        Some(AgentSlot::Active(_)) => {}
    }
    let record_at = |seq: u64| {
        sm.records(agent_id, seq, 1)
            .map(|records| records.into_iter().next().filter(|r| r.seq == seq))
            .map_err(|e| format!("reading the cluster's copy: {e}"))
    };
    if record_at(0)?.map(|r| r.hash) != Some(genesis.hash) {
        return Err("the cluster's agent of that id has another genesis".into());
    }
    if record_at(head.seq)?.map(|r| r.hash) != Some(head.hash) {
        return Err(format!(
            "the cluster's copy ends elsewhere (the file's head is seq {})",
            head.seq
        ));
    }
    Ok(())
}

/// Whether `dir/agents/` holds any `*.jsonl` (only then is the log replayed and checked
/// before serving).
pub fn present(dir: &Path) -> Result<bool, String> {
    reference_logs(dir).map(|logs| !logs.is_empty())
}

/// The ids of the reference logs in `dir/agents/` (file stems of `*.jsonl`). A name that
/// is not UTF-8 is refused, not skipped: it could be an agent's log.
fn reference_logs(dir: &Path) -> Result<Vec<(String, PathBuf)>, String> {
    let agents = dir.join("agents");
    let entries = match std::fs::read_dir(&agents) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(format!("{}: {e}", agents.display())),
    };
    let mut logs = Vec::new();
    for entry in entries {
        let path = entry
            .map_err(|e| format!("{}: {e}", agents.display()))?
            .path();
        if path.extension().and_then(|e| e.to_str()) != Some("jsonl") {
            continue;
        }
        let Some(id) = path.file_stem().and_then(|s| s.to_str()) else {
            return Err(format!("{}: a file name that is not UTF-8", path.display()));
        };
        logs.push((id.to_string(), path.clone()));
    }
    logs.sort();
    Ok(logs)
}

/// Checks `dir/agents/*.jsonl` against the cluster's state. Returns the ids to keep
/// reserved (those not held, when `ignore` allows starting anyway), or the refusal.
pub fn check(
    dir: &Path,
    sm: &StateMachine,
    ignore: bool,
    only_voter: bool,
) -> Result<BTreeSet<String>, String> {
    let mut unheld = Vec::new();
    for (id, path) in reference_logs(dir)? {
        if let Err(why) = held(&path, &id, sm) {
            unheld.push((id, Unheld { path, why }));
        }
    }
    if unheld.is_empty() {
        return Ok(BTreeSet::new());
    }
    let listing: Vec<String> = unheld
        .iter()
        .map(|(_, u)| format!("  {}: {}", u.path.display(), u.why))
        .collect();
    if ignore && !only_voter {
        return Err(format!(
            "{IGNORE_VAR}=1 reserves the ids of reference logs on this node only, and this \
             node is one voter of several: another leader would create those agents \
             afresh. Move these files out of {} instead:\n{}",
            dir.join("agents").display(),
            listing.join("\n")
        ));
    }
    if ignore {
        tracing::warn!(
            files = %listing.join("; "),
            "reference guard logs this cluster does not hold: their agent ids stay reserved here ({IGNORE_VAR}=1)"
        );
        return Ok(unheld.into_iter().map(|(id, _)| id).collect());
    }
    Err(format!(
        "{} holds agent logs of the reference guard server that this cluster does not:\n{}\n\
         Serving without them would let those agents be created afresh, with a new budget \
         and no scars, while their old tokens still work. Import them through Raft: start \
         with {IGNORE_VAR}=1 (their ids stay reserved meanwhile), then run \
         `lineage import --from {}`; once the cluster holds them this check passes. Or keep \
         running the reference guard for them, or move the files out of {}.",
        dir.display(),
        listing.join("\n"),
        dir.display(),
        dir.join("agents").display()
    ))
}
