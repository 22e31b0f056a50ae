//! The checkpointer: the heads log's monitor and its witnesses' client.
//!
//! Each round it fetches the cluster's heads checkpoint and checks, before anyone is
//! asked to cosign it, that it extends the last one it accepted (the new leaves, folded
//! into the old tree's frontier, give the new root) and that every new head statement
//! extends that agent's previous head (a per-agent consistency proof from the cluster).
//! Then it submits the checkpoint to every witness (C2SP tlog-witness: old size,
//! consistency proof, note), resyncs on 409, and stores the cosigned note back in the
//! cluster. Anything inconsistent or refused is an alarm: a metric, an error line, and
//! an evidence file with the signed material. Work per round grows with the agents that
//! changed, not with all agents.
//!
//! Durability: what it accepted (checkpoint, frontier, agent heads) is written in one
//! redb transaction after the checks pass, and each witness's cosigned size after the
//! witness answered. Killed between the two, the next round finds the witness ahead or
//! behind and resyncs through 409.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

use base64::Engine;
use lineage_core::heads::{decode_hashes, HeadStatement};
use lineage_core::transparency::{self, Checkpoint, Frontier, Hash};
use redb::{Database, TableDefinition};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::checkpointer_metrics::Metrics;
use crate::cluster_client::{ClusterClient, FetchError};
use crate::reply_text::{text_within, MAX_WITNESS_ANSWER_BYTES};

const META: TableDefinition<&str, &str> = TableDefinition::new("meta");
/// agent id → JSON `AgentHead` (its last accepted statement).
const AGENT_HEADS: TableDefinition<&str, &str> = TableDefinition::new("agent_heads");
/// witness name → the size it last cosigned for us.
const WITNESS_SIZES: TableDefinition<&str, u64> = TableDefinition::new("witness_sizes");
const VKEY_KEY: &str = "log_vkey";
const ACCEPTED_KEY: &str = "accepted";

#[derive(Debug, thiserror::Error)]
pub enum CheckpointerError {
    #[error("storage: {0}")]
    Storage(String),
    #[error("{0}")]
    Config(String),
}

fn storage(e: impl std::fmt::Display) -> CheckpointerError {
    CheckpointerError::Storage(e.to_string())
}

/// A witness the checkpointer submits to: its submission prefix and cosignature vkey.
#[derive(Debug, Clone)]
pub struct WitnessTarget {
    pub url: String,
    pub vkey: String,
    pub name: String,
}

impl WitnessTarget {
    /// Parses `URL=VKEY`.
    pub fn parse(spec: &str) -> Result<Self, String> {
        let (url, vkey) = spec
            .split_once('=')
            .ok_or_else(|| format!("--witness {spec:?} is not URL=VKEY"))?;
        lineage_core::heads::CosignatureVerifier::new(vkey)
            .map_err(|e| format!("--witness {url}: {e}"))?;
        let name = vkey.split('+').next().unwrap_or_default().to_string();
        Ok(WitnessTarget {
            url: url.trim_end_matches('/').to_string(),
            vkey: vkey.to_string(),
            name,
        })
    }
}

/// The last checkpoint accepted: the signed note and the tree's frontier at its size.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Accepted {
    note: String,
    size: u64,
    root: Hash,
    frontier: Frontier,
}

impl Accepted {
    /// The log's origin: the note's first line.
    fn origin(&self) -> &str {
        self.note.split('\n').next().unwrap_or_default()
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct AgentHead {
    size: u64,
    root: String,
}

/// What one round did.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct RoundReport {
    /// The heads checkpoint size accepted after this round.
    pub size: u64,
    pub new_statements: usize,
    /// Witnesses that cosigned the accepted checkpoint this round.
    pub cosigned_by: Vec<String>,
    /// Alarms raised this round, one line each.
    pub alarms: Vec<String>,
    /// Whether a cosigned note was stored in the cluster.
    pub stored: bool,
}

pub struct Checkpointer {
    db: Database,
    evidence_dir: PathBuf,
    cluster: ClusterClient,
    witnesses: Vec<WitnessTarget>,
    quorum: usize,
    log_vkey: String,
    metrics: Metrics,
    /// For witness requests (the cluster client has its own, with failover).
    http: reqwest::Client,
    /// Since when the newest accepted checkpoint has waited for a quorum of cosigners.
    uncosigned_since: Mutex<Option<Instant>>,
    /// A cosigned note the cluster has not stored yet.
    unstored: Mutex<Option<String>>,
    /// Notes already alarmed on, so a standing fault alarms once, not every round.
    alarmed: Mutex<std::collections::HashSet<String>>,
}

/// What to do after a witness's 409.
enum After409 {
    /// Submit again from the size it named.
    Resend,
    /// It is ahead of the checkpoint we accepted (`Checkpointer::witness_ahead`).
    Ahead,
    Alarm(Blame, &'static str, String),
}

/// How a submission to one witness went.
enum Submission {
    /// Cosigned now: its verified cosignature lines.
    Cosigned(String),
    /// The witness has cosigned this size (or a later one) before.
    AlreadyCosigned,
    /// Not reachable or not answering well now: tried again next round.
    NotNow,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Blame {
    Log,
    Witness,
    Checkpointer,
}

impl Blame {
    fn as_str(self) -> &'static str {
        match self {
            Blame::Log => "log",
            Blame::Witness => "witness",
            Blame::Checkpointer => "checkpointer",
        }
    }
}

/// One alarm: which label it counts under (a witness name or `monitor`), what happened,
/// and the signed material that shows it.
struct Alarm {
    label: String,
    /// Whose fault it shows (the metric's `kind`): the log, a witness, or this
    /// checkpointer's own storage.
    blame: Blame,
    kind: &'static str,
    detail: String,
    evidence: String,
}

impl Checkpointer {
    /// Opens the state in `dir`. The log's verifier key is `log_vkey` if given, else the
    /// one pinned at the first start, else fetched from the cluster and pinned.
    pub async fn open(
        dir: &Path,
        cluster: ClusterClient,
        witnesses: Vec<WitnessTarget>,
        quorum: usize,
        log_vkey: Option<String>,
        metrics: Metrics,
    ) -> Result<Checkpointer, CheckpointerError> {
        std::fs::create_dir_all(dir.join("evidence")).map_err(storage)?;
        let path = dir.join("checkpointer.redb");
        let db = crate::store_file::open(&path).map_err(storage)?;
        let txn = db.begin_write().map_err(storage)?;
        txn.open_table(META).map_err(storage)?;
        txn.open_table(AGENT_HEADS).map_err(storage)?;
        txn.open_table(WITNESS_SIZES).map_err(storage)?;
        txn.commit().map_err(storage)?;
        let pinned = {
            let txn = db.begin_read().map_err(storage)?;
            let meta = txn.open_table(META).map_err(storage)?;
            let value = meta.get(VKEY_KEY).map_err(storage)?;
            value.map(|v| v.value().to_string())
        };
        let log_vkey = match (log_vkey, pinned) {
            (Some(given), Some(pinned)) if given != pinned => {
                return Err(CheckpointerError::Config(format!(
                    "--log-vkey {given} differs from the key pinned in this data dir ({pinned}); \
                     a log key never changes"
                )))
            }
            (Some(given), _) => given,
            (None, Some(pinned)) => pinned,
            (None, None) => cluster.vkey().await.map_err(|e| {
                CheckpointerError::Config(format!("cannot fetch the cluster's vkey: {e}"))
            })?,
        };
        signed_note::StandardVerifier::new(&log_vkey)
            .map_err(|e| CheckpointerError::Config(format!("log vkey {log_vkey:?}: {e}")))?;
        let txn = db.begin_write().map_err(storage)?;
        txn.open_table(META)
            .map_err(storage)?
            .insert(VKEY_KEY, log_vkey.as_str())
            .map_err(storage)?;
        txn.commit().map_err(storage)?;
        metrics.witnesses.set(witnesses.len() as i64);
        // Every alarm series exists from the start, at 0: a rule on increase() cannot
        // see a series whose first sample is already 1, so the first alarm would pass.
        metrics
            .inconsistencies
            .with_label_values(&["monitor", "log"]);
        for witness in &witnesses {
            for blame in [Blame::Witness, Blame::Log] {
                metrics
                    .inconsistencies
                    .with_label_values(&[&witness.name, blame.as_str()]);
            }
            metrics.witness_errors.with_label_values(&[&witness.name]);
        }
        let http = reqwest::Client::builder()
            .timeout(std::time::Duration::from_secs(10))
            .build()
            .map_err(|e| CheckpointerError::Config(format!("http client: {e}")))?;
        Ok(Checkpointer {
            http,
            db,
            evidence_dir: dir.join("evidence"),
            cluster,
            witnesses,
            quorum,
            log_vkey,
            metrics,
            uncosigned_since: Mutex::new(None),
            unstored: Mutex::new(None),
            alarmed: Mutex::new(Default::default()),
        })
    }

    pub fn log_vkey(&self) -> &str {
        &self.log_vkey
    }

    fn accepted(&self) -> Result<Option<Accepted>, CheckpointerError> {
        let txn = self.db.begin_read().map_err(storage)?;
        let meta = txn.open_table(META).map_err(storage)?;
        let value = meta.get(ACCEPTED_KEY).map_err(storage)?;
        value
            .map(|v| serde_json::from_str(v.value()).map_err(storage))
            .transpose()
    }

    /// The last accepted heads of these agents, read in one transaction.
    fn agent_heads<'a>(
        &self,
        agent_ids: impl Iterator<Item = &'a str>,
    ) -> Result<HashMap<String, AgentHead>, CheckpointerError> {
        let txn = self.db.begin_read().map_err(storage)?;
        let table = txn.open_table(AGENT_HEADS).map_err(storage)?;
        let mut heads = HashMap::new();
        for agent_id in agent_ids {
            if let Some(value) = table.get(agent_id).map_err(storage)? {
                let head = serde_json::from_str(value.value()).map_err(storage)?;
                heads.insert(agent_id.to_string(), head);
            }
        }
        Ok(heads)
    }

    fn witness_size(&self, name: &str) -> Result<u64, CheckpointerError> {
        let txn = self.db.begin_read().map_err(storage)?;
        let table = txn.open_table(WITNESS_SIZES).map_err(storage)?;
        let value = table.get(name).map_err(storage)?;
        Ok(value.map_or(0, |v| v.value()))
    }

    fn set_witness_size(&self, name: &str, size: u64) -> Result<(), CheckpointerError> {
        let txn = self.db.begin_write().map_err(storage)?;
        txn.open_table(WITNESS_SIZES)
            .map_err(storage)?
            .insert(name, size)
            .map_err(storage)?;
        txn.commit().map_err(storage)
    }

    /// One round: monitor, then witnesses, then store. Fetch failures end the round
    /// early (tried again next round); they are not alarms.
    pub async fn round(&self) -> Result<RoundReport, CheckpointerError> {
        let started = Instant::now();
        let mut report = RoundReport::default();
        let result = self.round_inner(&mut report).await;
        self.metrics
            .round_duration
            .observe(started.elapsed().as_secs_f64());
        self.metrics.rounds.inc();
        if let Err(e) = &result {
            self.metrics.fetch_errors.inc();
            tracing::warn!(error = %e, "round ended early");
        }
        self.update_age();
        self.count_evidence();
        Ok(report)
    }

    /// Sets `unresolved_evidence` to the files the evidence directory holds now.
    fn count_evidence(&self) {
        match std::fs::read_dir(&self.evidence_dir) {
            Ok(entries) => {
                let files = entries
                    .filter_map(Result::ok)
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
                    .count();
                self.metrics
                    .unresolved_evidence
                    .set(i64::try_from(files).unwrap_or(i64::MAX));
            }
            Err(e) => tracing::warn!(error = %e, "cannot read the evidence directory"),
        }
    }

    async fn round_inner(&self, report: &mut RoundReport) -> Result<(), FetchError> {
        let accepted = self
            .accepted()
            .map_err(|e| FetchError::Refused(e.to_string()))?;
        let before = accepted.as_ref().map_or(0, |a| a.size);
        let note = self.cluster.checkpoint().await?;
        let (accepted, alarms) = self.monitor(accepted, note).await?;
        self.raise(alarms, report);
        let Some(accepted) = accepted else {
            return Ok(());
        };
        report.size = accepted.size;
        report.new_statements = accepted.size.saturating_sub(before) as usize;
        self.metrics.checkpoint_size.set(accepted.size as i64);
        if accepted.size == 0 {
            return Ok(());
        }
        let mut cosignatures = Vec::new();
        let mut cosigners = 0;
        for witness in &self.witnesses {
            match self.submit(witness, &accepted).await {
                Ok(Submission::Cosigned(lines)) => {
                    report.cosigned_by.push(witness.name.clone());
                    cosignatures.push(lines);
                    cosigners += 1;
                }
                Ok(Submission::AlreadyCosigned) => cosigners += 1,
                Ok(Submission::NotNow) => {}
                Err(alarm) => self.raise(vec![alarm], report),
            }
        }
        if cosigners >= self.quorum.max(1) {
            *self
                .uncosigned_since
                .lock()
                .unwrap_or_else(|p| p.into_inner()) = None;
        }
        if !cosignatures.is_empty() {
            let note = format!("{}{}", accepted.note, cosignatures.concat());
            *self.unstored.lock().unwrap_or_else(|p| p.into_inner()) = Some(note);
        }
        let unstored = self
            .unstored
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if let Some(note) = unstored {
            match self.cluster.store_witnessed(&note).await {
                Ok(()) => {
                    report.stored = true;
                    *self.unstored.lock().unwrap_or_else(|p| p.into_inner()) = None;
                }
                Err(e) => tracing::warn!(error = %e, "cosigned checkpoint not stored yet"),
            }
        }
        Ok(())
    }

    /// Checks `note` against what was accepted; returns the checkpoint to submit (the
    /// new one if it checked out, else the old one) and any alarms.
    #[expect(
        clippy::too_many_lines,
        reason = "the monitor's checks run in the order C2SP and the alarms need; split, each piece would take the whole round's state"
    )]
    async fn monitor(
        &self,
        accepted: Option<Accepted>,
        note: String,
    ) -> Result<(Option<Accepted>, Vec<Alarm>), FetchError> {
        let alarm = |kind, detail: String, evidence: String| Alarm {
            label: "monitor".into(),
            blame: Blame::Log,
            kind,
            detail,
            evidence,
        };
        let checkpoint = match Checkpoint::verify(&note, &self.log_vkey) {
            Ok(c) => c,
            Err(e) => {
                let a = alarm(
                    "bad_checkpoint_signature",
                    format!("the cluster's checkpoint does not verify: {e}"),
                    note,
                );
                return Ok((accepted, vec![a]));
            }
        };
        let (old_size, old_root, old_frontier) = match &accepted {
            Some(a) => (a.size, a.root, a.frontier.clone()),
            None => (0, Frontier::new().root(), Frontier::new()),
        };
        if checkpoint.size < old_size
            || (checkpoint.size == old_size && checkpoint.root != old_root)
        {
            let what = if checkpoint.size < old_size {
                "rollback"
            } else {
                "fork"
            };
            let previous = accepted.as_ref().map_or("", |a| a.note.as_str());
            let a = alarm(
                if what == "rollback" {
                    "heads_rollback"
                } else {
                    "heads_fork"
                },
                format!(
                    "heads checkpoint {what}: size {} (root {}) after accepting size {old_size} (root {})",
                    checkpoint.size,
                    b64(&checkpoint.root),
                    b64(&old_root)
                ),
                format!("accepted:\n{previous}\nserved now:\n{note}"),
            );
            return Ok((accepted, vec![a]));
        }
        if checkpoint.size == old_size {
            return Ok((accepted, Vec::new()));
        }
        // New leaves, folded into the old frontier, must give the new root: the new
        // tree extends the old one and these are its leaves.
        let statements = self.cluster.leaves(old_size, checkpoint.size).await?;
        let mut frontier = old_frontier;
        for s in &statements {
            frontier.push(s.to_leaf().as_bytes());
        }
        if frontier.root() != checkpoint.root || frontier.size() != checkpoint.size {
            let a = alarm(
                "heads_not_extending",
                format!(
                    "the heads leaves {old_size}..{} do not extend the accepted tree to the signed root",
                    checkpoint.size
                ),
                format!(
                    "accepted:\n{}\nserved now:\n{note}\nleaves:\n{}",
                    accepted.as_ref().map_or("", |a| a.note.as_str()),
                    statements
                        .iter()
                        .map(|s| s.to_leaf() + "\n")
                        .collect::<String>()
                ),
            );
            return Ok((accepted, vec![a]));
        }
        let mut alarms = Vec::new();
        // Each statement is checked against the agent's previous head: the stored one,
        // or an earlier statement of this same batch.
        let mut heads = self
            .agent_heads(statements.iter().map(|s| s.agent_id.as_str()))
            .map_err(|e| FetchError::Refused(e.to_string()))?;
        for s in &statements {
            let previous = heads.get(&s.agent_id).cloned();
            if let Some(problem) = self.check_statement(previous.as_ref(), s).await? {
                alarms.push(alarm(
                    "agent_head_inconsistent",
                    format!("agent {}: {problem}", s.agent_id),
                    format!(
                        "heads checkpoint:\n{note}\nprevious head: {}\nnew statement: {}\n",
                        previous
                            .as_ref()
                            .map(|p| format!("size {} root {}", p.size, p.root))
                            .unwrap_or_default(),
                        s.to_leaf()
                    ),
                ));
            }
            heads.insert(
                s.agent_id.clone(),
                AgentHead {
                    size: s.size,
                    root: s.root.clone(),
                },
            );
        }
        let new = Accepted {
            note,
            size: checkpoint.size,
            root: checkpoint.root,
            frontier,
        };
        self.persist_accepted(&new, &heads)
            .map_err(|e| FetchError::Refused(e.to_string()))?;
        let mut since = self
            .uncosigned_since
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        since.get_or_insert_with(Instant::now);
        Ok((Some(new), alarms))
    }

    /// Whether `statement` extends the agent's previous head; `Some(problem)` if not.
    async fn check_statement(
        &self,
        previous: Option<&AgentHead>,
        statement: &HeadStatement,
    ) -> Result<Option<String>, FetchError> {
        let Some(previous) = previous else {
            return Ok(None);
        };
        if statement.size < previous.size {
            return Ok(Some(format!(
                "log cut short: size {} after a witnessed head of size {}",
                statement.size, previous.size
            )));
        }
        if statement.size == previous.size {
            return Ok((statement.root != previous.root).then(|| {
                format!(
                    "log rewritten: size {} stated again with another root",
                    statement.size
                )
            }));
        }
        let (Ok(old_root), Ok(new_root)) = (hex_hash(&previous.root), hex_hash(&statement.root))
        else {
            return Ok(Some("a stated root is not 64 hex digits".into()));
        };
        let proof = match self
            .cluster
            .agent_consistency(&statement.agent_id, previous.size, statement.size)
            .await
        {
            Ok(proof) => proof,
            Err(FetchError::Refused(e)) => {
                return Ok(Some(format!(
                    "the cluster cannot prove size {} extends size {}: {e}",
                    statement.size, previous.size
                )))
            }
            Err(e) => return Err(e),
        };
        let verified = decode_hashes(&proof).and_then(|proof| {
            transparency::verify_consistency(
                &old_root,
                previous.size,
                &new_root,
                statement.size,
                &proof,
            )
        });
        Ok(verified.err().map(|e| {
            format!(
                "log rewritten: size {} does not extend the witnessed size {}: {e}",
                statement.size, previous.size
            )
        }))
    }

    fn persist_accepted(
        &self,
        accepted: &Accepted,
        heads: &HashMap<String, AgentHead>,
    ) -> Result<(), CheckpointerError> {
        let txn = self.db.begin_write().map_err(storage)?;
        {
            let json = serde_json::to_string(accepted).map_err(storage)?;
            txn.open_table(META)
                .map_err(storage)?
                .insert(ACCEPTED_KEY, json.as_str())
                .map_err(storage)?;
            let mut table = txn.open_table(AGENT_HEADS).map_err(storage)?;
            for (agent_id, head) in heads {
                let json = serde_json::to_string(head).map_err(storage)?;
                table
                    .insert(agent_id.as_str(), json.as_str())
                    .map_err(storage)?;
            }
        }
        txn.commit().map_err(storage)
    }

    /// A witness's 200 answer, checked: the log's signature and the witness's cosignature
    /// over our note verify (every line of either key, `note::verify_note`), and the
    /// witness's own verified lines are what we keep.
    fn cosigned_by(&self, cosigned: &str, witness: &WitnessTarget) -> Result<String, String> {
        let log = signed_note::StandardVerifier::new(&self.log_vkey).map_err(|e| e.to_string())?;
        let cosigner = lineage_core::heads::CosignatureVerifier::new(&witness.vkey)
            .map_err(|e| e.to_string())?;
        let verified = lineage_core::note::verify_note(cosigned, &[&log, &cosigner])
            .map_err(|e| e.to_string())?;
        if !verified.signed_by(&log) {
            return Err("the note is not signed by the log's key".into());
        }
        if !verified.signed_by(&cosigner) {
            return Err("no cosignature by the witness's key".into());
        }
        Ok(verified.lines_by(&cosigner))
    }

    /// Submits the accepted checkpoint to one witness; `Err` is an alarm.
    #[expect(
        clippy::too_many_lines,
        reason = "one witness request and every answer the protocol allows, each with its own handling"
    )]
    async fn submit(
        &self,
        witness: &WitnessTarget,
        accepted: &Accepted,
    ) -> Result<Submission, Alarm> {
        let storage_alarm = |e: CheckpointerError| Alarm {
            label: witness.name.clone(),
            blame: Blame::Checkpointer,
            kind: "checkpointer_storage",
            detail: e.to_string(),
            evidence: String::new(),
        };
        // The size this witness cosigned for us, stored only from a 200 we verified: a
        // size a 409 names is never stored (add-checkpoint is open to anyone, so the
        // witness may be ahead for reasons of its own, or wrong).
        let cosigned = self.witness_size(&witness.name).map_err(storage_alarm)?;
        if cosigned >= accepted.size {
            return Ok(Submission::AlreadyCosigned);
        }
        let mut old = cosigned;
        let mut resent_at_our_size = false;
        for _attempt in 0..3 {
            let proof = if old == accepted.size {
                Vec::new()
            } else {
                match self.cluster.heads_consistency(old, accepted.size).await {
                    Ok(proof) => proof,
                    Err(e) => {
                        tracing::warn!(witness = %witness.name, error = %e, "no consistency proof");
                        return Ok(Submission::NotNow);
                    }
                }
            };
            let body = format!(
                "old {old}\n{}\n{}",
                proof.iter().map(|p| format!("{p}\n")).collect::<String>(),
                accepted.note
            );
            let reply = match self
                .http
                .post(format!("{}/add-checkpoint", witness.url))
                .body(body.clone())
                .send()
                .await
            {
                Ok(reply) => reply,
                Err(e) => {
                    self.metrics
                        .witness_errors
                        .with_label_values(&[&witness.name])
                        .inc();
                    tracing::warn!(witness = %witness.name, error = %e, "witness unreachable");
                    return Ok(Submission::NotNow);
                }
            };
            let status = reply.status().as_u16();
            let text = match text_within(reply, MAX_WITNESS_ANSWER_BYTES).await {
                Ok(text) => text,
                // A refusal stays a refusal (an alarm) whatever its body held.
                Err(e) if !matches!(status, 200 | 409) && status < 500 => {
                    format!("<answer unreadable: {e}>")
                }
                Err(e) => {
                    // No answer to act on (cut off, or more than any witness sends):
                    // like an unreachable witness, counted, and tried again next round.
                    self.metrics
                        .witness_errors
                        .with_label_values(&[&witness.name])
                        .inc();
                    tracing::warn!(witness = %witness.name, status, error = %e, "witness answer unreadable");
                    return Ok(Submission::NotNow);
                }
            };
            match status {
                200 => {
                    let cosigned = format!("{}{text}", accepted.note);
                    return match self.cosigned_by(&cosigned, witness) {
                        Ok(own_lines) => {
                            self.set_witness_size(&witness.name, accepted.size)
                                .map_err(storage_alarm)?;
                            self.metrics
                                .cosigned_size
                                .with_label_values(&[&witness.name])
                                .set(accepted.size as i64);
                            Ok(Submission::Cosigned(own_lines))
                        }
                        Err(e) => Err(Alarm {
                            label: witness.name.clone(),
                            blame: Blame::Witness,
                            kind: "bad_cosignature",
                            detail: format!("the witness's cosignature does not verify: {e}"),
                            evidence: format!("request:\n{body}\nresponse:\n{text}"),
                        }),
                    };
                }
                409 => {
                    let size = text.trim().parse::<u64>().map_err(|_| Alarm {
                        label: witness.name.clone(),
                        blame: Blame::Witness,
                        kind: "witness_protocol",
                        detail: "409 without a decimal size".into(),
                        evidence: format!("request:\n{body}\nresponse:\n{text}"),
                    })?;
                    let evidence = format!("request:\n{body}\nresponse 409:\n{text}");
                    let next = self
                        .after_409(witness, accepted, cosigned, size, &mut resent_at_our_size)
                        .await;
                    match next {
                        After409::Resend => {}
                        After409::Alarm(blame, kind, detail) => {
                            return Err(Alarm {
                                label: witness.name.clone(),
                                blame,
                                kind,
                                detail,
                                evidence,
                            })
                        }
                        After409::Ahead => {
                            return self.witness_ahead(witness, accepted, size, evidence).await
                        }
                    }
                    old = size;
                }
                400 | 403 | 404 | 422 => {
                    return Err(Alarm {
                        label: witness.name.clone(),
                        blame: Blame::Witness,
                        kind: "witness_refused",
                        detail: format!("the witness refused with {status}: {}", text.trim()),
                        evidence: format!("request:\n{body}\nresponse {status}:\n{text}"),
                    })
                }
                other => {
                    self.metrics
                        .witness_errors
                        .with_label_values(&[&witness.name])
                        .inc();
                    tracing::warn!(witness = %witness.name, status = other, body = text.trim(), "witness error");
                    return Ok(Submission::NotNow);
                }
            }
        }
        Ok(Submission::NotNow)
    }

    /// What a witness's 409 naming `size` means, given what it cosigned for us
    /// (`cosigned`) and the checkpoint we submit (`accepted`).
    async fn after_409(
        &self,
        witness: &WitnessTarget,
        accepted: &Accepted,
        cosigned: u64,
        size: u64,
        resent_at_our_size: &mut bool,
    ) -> After409 {
        if size < cosigned {
            return After409::Alarm(
                Blame::Witness,
                "witness_lost_state",
                format!("the witness says it holds size {size}, below the {cosigned} it cosigned for us"),
            );
        }
        if size > accepted.size {
            return After409::Ahead;
        }
        if size == accepted.size {
            // It holds our size but we hold no cosignature of it (another checkpointer's,
            // or our state was lost): ask once for ours.
            if *resent_at_our_size {
                return After409::Alarm(
                    Blame::Witness,
                    "witness_fork",
                    format!("the witness holds size {size} yet refuses our checkpoint of that size: another root at the same size?"),
                );
            }
            *resent_at_our_size = true;
        }
        tracing::info!(witness = %witness.name, to = size, "witness resync");
        After409::Resend
    }

    /// A witness at size `ahead`, beyond the checkpoint we accepted. Someone submitted a
    /// larger checkpoint of this log to it: fine if the cluster serves one that large
    /// now (the next round takes it up), a split view if only the witness has one the
    /// log signed, and the witness's fault if it cannot show one.
    async fn witness_ahead(
        &self,
        witness: &WitnessTarget,
        accepted: &Accepted,
        ahead: u64,
        evidence: String,
    ) -> Result<Submission, Alarm> {
        if let Ok(note) = self.cluster.checkpoint().await {
            if Checkpoint::verify(&note, &self.log_vkey).is_ok_and(|c| c.size >= ahead) {
                return Ok(Submission::NotNow);
            }
        }
        let origin_hash = hex::encode(Sha256::digest(accepted.origin().as_bytes()));
        let monitored = match self
            .http
            .get(format!("{}/{origin_hash}/checkpoint", witness.url))
            .send()
            .await
        {
            Ok(reply) if reply.status().is_success() => {
                text_within(reply, MAX_WITNESS_ANSWER_BYTES).await.ok()
            }
            _ => None,
        };
        let signed_by_log = monitored
            .as_deref()
            .and_then(|note| Checkpoint::verify(note, &self.log_vkey).ok())
            .filter(|c| c.size >= ahead);
        match (signed_by_log, monitored) {
            (Some(longer), Some(note)) => Err(Alarm {
                label: witness.name.clone(),
                blame: Blame::Log,
                kind: "log_split_view",
                detail: format!(
                    "the log signed a checkpoint of size {} that the cluster does not serve (it serves {})",
                    longer.size, accepted.size
                ),
                evidence: format!(
                    "the cluster's checkpoint:\n{}\nthe witness's checkpoint:\n{note}\n{evidence}",
                    accepted.note
                ),
            }),
            (_, monitored) => Err(Alarm {
                label: witness.name.clone(),
                blame: Blame::Witness,
                kind: "witness_ahead_unproven",
                detail: format!(
                    "the witness says it holds size {ahead}, beyond the log's {}, and shows no checkpoint the log signed at that size",
                    accepted.size
                ),
                evidence: format!(
                    "{evidence}\nits checkpoint:\n{}",
                    monitored.unwrap_or_default()
                ),
            }),
        }
    }

    fn raise(&self, alarms: Vec<Alarm>, report: &mut RoundReport) {
        for alarm in alarms {
            let fingerprint = format!("{}\n{}\n{}", alarm.label, alarm.kind, alarm.evidence);
            let first = self
                .alarmed
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(fingerprint);
            report
                .alarms
                .push(format!("{}: {}", alarm.kind, alarm.detail));
            if !first {
                continue;
            }
            self.metrics
                .inconsistencies
                .with_label_values(&[&alarm.label, alarm.blame.as_str()])
                .inc();
            let path = self.write_evidence(&alarm);
            tracing::error!(
                alarm = alarm.kind,
                source = %alarm.label,
                evidence = %path.as_deref().map(|p| p.display().to_string()).unwrap_or_default(),
                "{}",
                alarm.detail
            );
        }
    }

    /// Writes an evidence file (never overwriting one) and returns its path.
    fn write_evidence(&self, alarm: &Alarm) -> Option<PathBuf> {
        use std::io::Write;
        let millis = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        for n in 0..100 {
            let path = self
                .evidence_dir
                .join(format!("{millis}-{n}-{}.txt", alarm.kind));
            let file = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path);
            let Ok(mut file) = file else { continue };
            let text = format!(
                "alarm: {}\nsource: {}\ndetail: {}\nlog vkey: {}\n\n{}",
                alarm.kind, alarm.label, alarm.detail, self.log_vkey, alarm.evidence
            );
            if file
                .write_all(text.as_bytes())
                .and_then(|()| file.sync_all())
                .is_ok()
            {
                return Some(path);
            }
        }
        tracing::error!("could not write an evidence file");
        None
    }

    fn update_age(&self) {
        let since = *self
            .uncosigned_since
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        self.metrics
            .checkpoint_age
            .set(since.map_or(0.0, |s| s.elapsed().as_secs_f64()));
    }
}

fn b64(hash: &Hash) -> String {
    base64::engine::general_purpose::STANDARD.encode(hash)
}

fn hex_hash(text: &str) -> Result<Hash, hex::FromHexError> {
    let mut hash = [0u8; 32];
    hex::decode_to_slice(text, &mut hash).map(|()| hash)
}
