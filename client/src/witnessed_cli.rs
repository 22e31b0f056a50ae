//! The auditor's witnessed check (`lineage audit verify … --witnessed`) and
//! `lineage checkpoint fetch|verify`.
//!
//! Trust: the auditor brings the cluster's audit public key and the witnesses' keys.
//! Everything fetched from the cluster (head proofs, the note) is checked against
//! those, so a lying cluster can make the check fail but never pass.

use lineage_core::heads::{
    check_log_against_head, log_vkey, verify_witnessed, HeadCheck, HeadProof, Witnessed,
};
use lineage_core::record::Record;
use lineage_core::verify::{verify_file, VerifyOptions};
use std::io::Write;
use std::path::Path;

use crate::audit_cli::{EXIT_FAILED, EXIT_OK, EXIT_USAGE};
use crate::client::{Client, ClientError};
use crate::terminal_text::printable;

/// Earlier statements fetched to narrow down where a log was rewritten.
const MAX_EARLIER_STATEMENTS: usize = 64;

/// What the auditor checks a log against.
pub struct WitnessedInput<'a> {
    pub note: &'a str,
    pub witness_keys: &'a [String],
    pub quorum: usize,
}

/// Verifies a witnessed checkpoint note with the cluster's audit public key (the note
/// key is that key under the note's origin).
pub fn verify_note(
    note: &str,
    public_key: &str,
    witness_keys: &[String],
    quorum: usize,
) -> Result<Witnessed, String> {
    let origin = note.split('\n').next().unwrap_or_default();
    let vkey = log_vkey(origin, public_key).map_err(|e| e.to_string())?;
    verify_witnessed(note, &vkey, witness_keys, quorum).map_err(|e| e.to_string())
}

/// Reads an agent log's records (after its chain verified, so each line parses).
fn read_records(log: &Path) -> Result<Vec<Record>, String> {
    let text = std::fs::read_to_string(log).map_err(|e| format!("cannot read log: {e}"))?;
    text.split('\n')
        .filter(|l| !l.is_empty())
        .map(|l| Record::from_line(l).map_err(|e| e.to_string()))
        .collect()
}

/// The agent's id, from its verified log.
pub fn log_agent_id(log: &Path, public_key: &str) -> Result<String, String> {
    let report = verify_file(
        log,
        &VerifyOptions {
            public_key: Some(public_key.to_string()),
            checkpoint: None,
        },
    );
    match (report.failure, report.log_id) {
        (Some(f), _) => Err(format!("the log does not verify: {f}")),
        (None, Some(id)) => Ok(id),
        (None, None) => Err("the log has no genesis record".into()),
    }
}

/// `audit verify LOG --public-key K --witnessed NOTE --witness-key W [--quorum k]`:
/// the log verifies, and it is complete up to its witnessed head (`proofs[0]`, the
/// latest; the rest are the agent's earlier statements, newest first).
pub fn verify_log(
    log: &Path,
    public_key: &str,
    input: &WitnessedInput,
    proofs: &[HeadProof],
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> i32 {
    match log_agent_id(log, public_key) {
        Ok(agent_id) => verify_verified_log(log, &agent_id, public_key, input, proofs, out, err),
        Err(e) => {
            let _ = writeln!(out, "FAILED  {}", printable(&e));
            EXIT_FAILED
        }
    }
}

/// [`verify_log`] for a log whose chain and signatures the caller has just verified
/// ([`log_agent_id`] gave `agent_id`), so it is not read and verified a second time.
pub fn verify_verified_log(
    log: &Path,
    agent_id: &str,
    public_key: &str,
    input: &WitnessedInput,
    proofs: &[HeadProof],
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> i32 {
    let witnessed = match verify_note(input.note, public_key, input.witness_keys, input.quorum) {
        Ok(w) => w,
        Err(e) => {
            let _ = writeln!(out, "FAILED  witnessed checkpoint: {}", printable(&e));
            return EXIT_FAILED;
        }
    };
    if proofs.is_empty() {
        let _ = writeln!(err, "error: no head proof for agent {agent_id}");
        return EXIT_USAGE;
    }
    for proof in proofs {
        if proof.statement.agent_id != agent_id {
            let _ = writeln!(
                out,
                "FAILED  the head proof is for agent {}, the log is agent {agent_id}'s",
                proof.statement.agent_id
            );
            return EXIT_FAILED;
        }
        if let Err(e) = proof.verify(&witnessed.checkpoint) {
            let _ = writeln!(
                out,
                "FAILED  head statement at index {} is not in the witnessed checkpoint: {e}",
                proof.index
            );
            return EXIT_FAILED;
        }
    }
    let records = match read_records(log) {
        Ok(r) => r,
        Err(e) => {
            let _ = writeln!(err, "error: {e}");
            return EXIT_USAGE;
        }
    };
    // Every witnessed statement must hold, not only the latest: a log cut short and then
    // extended has a latest statement that matches it, and an earlier one that does not.
    let statements: Vec<_> = proofs.iter().map(|p| p.statement.clone()).collect();
    let witnesses = witnessed.witnesses.join(", ");
    let mut verdict = None;
    for (i, statement) in statements.iter().enumerate() {
        let check = check_log_against_head(&records, statement, &statements[i + 1..]);
        if !matches!(check, HeadCheck::Complete { .. }) || verdict.is_none() {
            verdict = Some((statement, check));
        }
    }
    let Some((statement, check)) = verdict else {
        return EXIT_USAGE;
    };
    match check {
        HeadCheck::Complete { size, later } => {
            let _ = writeln!(
                out,
                "OK  agent {agent_id}: complete up to its witnessed head ({size} records, \
                 head {}:{})",
                size - 1,
                statement.head_hash
            );
            let _ = writeln!(
                out,
                "    heads checkpoint {} size {}, cosigned by {witnesses}",
                witnessed.checkpoint.origin, witnessed.checkpoint.size
            );
            if later > 0 {
                let _ = writeln!(out, "    {later} later records are not witnessed yet");
            }
            EXIT_OK
        }
        HeadCheck::CutShort { witnessed, present } => {
            let _ = writeln!(
                out,
                "FAILED  log cut short: the witnessed head is seq {} (hash {}), the log ends \
                 at seq {}; records {present}..{} are missing",
                witnessed - 1,
                statement.head_hash,
                present as i64 - 1,
                witnessed - 1
            );
            EXIT_FAILED
        }
        HeadCheck::Rewritten {
            first_differing: (from, to),
            detail,
            ..
        } => {
            let _ = writeln!(
                out,
                "FAILED  log rewritten: it differs from the witnessed one starting at a seq \
                 from {from} to {to}"
            );
            let _ = writeln!(out, "    {detail}");
            EXIT_FAILED
        }
        HeadCheck::BadStatement(e) => {
            let _ = writeln!(out, "FAILED  {}", printable(&e));
            EXIT_FAILED
        }
    }
}

/// Fetches the agent's head proof in the witnessed tree and up to
/// `MAX_EARLIER_STATEMENTS` earlier statements, newest first, from any node in `urls`.
pub async fn fetch_head_proofs(
    urls: &[String],
    ca: Option<&std::path::Path>,
    agent_id: &str,
    tree_size: u64,
) -> Result<Vec<HeadProof>, String> {
    // The transparency endpoints are public: no token.
    let client = Client::new(urls, "")
        .and_then(|c| c.with_ca_file(ca))
        .map_err(|e| e.to_string())?;
    let mut proofs: Vec<HeadProof> = Vec::new();
    let mut before = tree_size;
    while proofs.len() <= MAX_EARLIER_STATEMENTS {
        let proof = match client.head_proof(agent_id, tree_size, before).await {
            Ok(proof) => proof,
            Err(ClientError::Api { status: 404, .. }) if !proofs.is_empty() => break,
            Err(e) => return Err(e.to_string()),
        };
        if proof.index >= before {
            return Err("the cluster returned a statement out of order".into());
        }
        before = proof.index;
        proofs.push(proof);
        if before == 0 {
            break;
        }
    }
    Ok(proofs)
}

/// `checkpoint fetch`: the cluster's latest witnessed heads checkpoint.
pub async fn fetch_witnessed(
    urls: &[String],
    ca: Option<&std::path::Path>,
) -> Result<String, String> {
    let client = Client::new(urls, "")
        .and_then(|c| c.with_ca_file(ca))
        .map_err(|e| e.to_string())?;
    client
        .witnessed_checkpoint()
        .await
        .map_err(|e| e.to_string())
}
