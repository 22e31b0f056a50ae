//! A C2SP tlog-witness: cosigns a log's checkpoint only if it extends the last one it
//! cosigned for that origin, and keeps what it cosigned on disk before it answers.
//!
//! It trusts nothing the log says: each origin and its verifier key are configured here
//! (`add-log`), never learned from requests. Check-old-size, verify, sign and persist run
//! under one lock and one durable redb transaction, so no two requests can both extend
//! the same size. A request signed by the log's key that is inconsistent with what was
//! cosigned is kept whole as evidence of misbehaviour: a checkpoint of the cosigned size
//! with another root (a fork: only the log's key can make one), or a larger one whose
//! proof from the cosigned root fails (unproven: a proof is not signed, so anyone can
//! send a true checkpoint with a wrong one). Each is kept once per signed checkpoint
//! (its text and the log's own signature lines: other lines are anyone's to vary);
//! unproven ones at most [`MAX_UNPROVEN_EVIDENCE`], in a table of their own, so they
//! can never crowd out a fork. A replayed older checkpoint is not kept: the log did
//! sign it once.

use std::path::Path;
use std::sync::Mutex;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use lineage_core::heads::Cosigner;
use lineage_core::transparency::{verify_consistency, Checkpoint, Hash};
use lineage_core::AuditKey;
use redb::{Database, ReadableTable, ReadableTableMetadata, TableDefinition};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// origin → JSON `LogState`.
const LOGS: TableDefinition<&str, &[u8]> = TableDefinition::new("logs");
/// sequence → the full body of a signed but inconsistent request.
const EVIDENCE: TableDefinition<u64, &[u8]> = TableDefinition::new("evidence");
/// Requests with a larger checkpoint whose proof failed (see the module's docs).
const EVIDENCE_UNPROVEN: TableDefinition<u64, &[u8]> = TableDefinition::new("evidence_unproven");
/// SHA-256 of each kept request's signed checkpoint (text and the log's lines) → 1.
const EVIDENCE_NOTES: TableDefinition<&[u8; 32], u64> = TableDefinition::new("evidence_notes");
/// The most unproven requests kept (each at most `MAX_REQUEST_BYTES`).
pub const MAX_UNPROVEN_EVIDENCE: u64 = 1_000;

/// What a kept request shows.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Evidence {
    /// Two roots signed for one size.
    Fork,
    /// A larger checkpoint that the proof sent does not join to the cosigned one.
    Unproven,
}
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const LAST_SIGNED_AT: &str = "last_signed_at";
/// The spec caps consistency proofs at 63 lines.
pub const MAX_PROOF_LINES: usize = 63;
/// Requests larger than this are refused before parsing.
pub const MAX_REQUEST_BYTES: usize = 64 * 1024;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LogState {
    pub vkey: String,
    pub size: u64,
    /// Base64 root of the latest cosigned checkpoint (empty tree until the first one).
    pub root: String,
    /// The latest cosigned checkpoint note with the log's and this witness's signatures.
    pub note: Option<String>,
}

/// What the HTTP layer sends back.
#[derive(Debug, PartialEq, Eq)]
pub struct Reply {
    pub status: u16,
    pub content_type: &'static str,
    pub body: String,
}

impl Reply {
    fn text(status: u16, body: impl Into<String>) -> Reply {
        Reply {
            status,
            content_type: "text/plain; charset=utf-8",
            body: body.into(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum WitnessError {
    #[error("storage: {0}")]
    Storage(String),
    #[error("{0}")]
    Config(String),
}

fn storage(e: impl std::fmt::Display) -> WitnessError {
    WitnessError::Storage(e.to_string())
}

pub struct Witness {
    cosigner: Cosigner,
    db: Database,
    /// Serialises check-and-persist across requests.
    lock: Mutex<()>,
}

/// SHA-256 of the empty string: the root of an empty tree.
fn empty_root() -> Hash {
    Sha256::digest(b"").into()
}

impl Witness {
    /// Opens (or creates) the witness state in `dir` with the signing key `seed`.
    pub fn open(dir: &Path, name: &str, seed: [u8; 32]) -> Result<Witness, WitnessError> {
        let cosigner = Cosigner::new(name, AuditKey::from_seed(seed))
            .map_err(|e| WitnessError::Config(e.0))?;
        std::fs::create_dir_all(dir).map_err(storage)?;
        let path = dir.join("witness.redb");
        let db = crate::store_file::open(&path).map_err(storage)?;
        let txn = db.begin_write().map_err(storage)?;
        txn.open_table(LOGS).map_err(storage)?;
        txn.open_table(EVIDENCE).map_err(storage)?;
        txn.open_table(EVIDENCE_NOTES).map_err(storage)?;
        txn.open_table(EVIDENCE_UNPROVEN).map_err(storage)?;
        txn.open_table(META).map_err(storage)?;
        txn.commit().map_err(storage)?;
        Ok(Witness {
            cosigner,
            db,
            lock: Mutex::new(()),
        })
    }

    /// The cosignature verifier key: `name+keyid+base64(0x04 || pubkey)`.
    pub fn vkey(&self) -> String {
        self.cosigner.vkey()
    }

    /// Trusts `origin` with the log verifier key `vkey`. A log is never removed, and an
    /// origin, once added, cannot be re-added with another key.
    pub fn add_log(&self, origin: &str, vkey: &str) -> Result<(), WitnessError> {
        signed_note::StandardVerifier::new(vkey)
            .map_err(|e| WitnessError::Config(format!("bad log verifier key: {e}")))?;
        let _guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let txn = self.db.begin_write().map_err(storage)?;
        {
            let mut logs = txn.open_table(LOGS).map_err(storage)?;
            if let Some(existing) = logs.get(origin).map_err(storage)? {
                let state: LogState = serde_json::from_slice(existing.value()).map_err(storage)?;
                return if state.vkey == vkey {
                    Ok(())
                } else {
                    Err(WitnessError::Config(format!(
                        "{origin} is already configured with another key"
                    )))
                };
            }
            let state = LogState {
                vkey: vkey.to_string(),
                size: 0,
                root: B64.encode(empty_root()),
                note: None,
            };
            let bytes = serde_json::to_vec(&state).map_err(storage)?;
            logs.insert(origin, bytes.as_slice()).map_err(storage)?;
        }
        txn.commit().map_err(storage)
    }

    pub fn log_state(&self, origin: &str) -> Result<Option<LogState>, WitnessError> {
        let txn = self.db.begin_read().map_err(storage)?;
        let logs = txn.open_table(LOGS).map_err(storage)?;
        let state = logs.get(origin).map_err(storage)?;
        state
            .map(|v| serde_json::from_slice(v.value()).map_err(storage))
            .transpose()
    }

    /// The latest cosigned checkpoint for the origin whose SHA-256 is `origin_hash_hex`.
    pub fn monitoring_checkpoint(
        &self,
        origin_hash_hex: &str,
    ) -> Result<Option<String>, WitnessError> {
        let txn = self.db.begin_read().map_err(storage)?;
        let logs = txn.open_table(LOGS).map_err(storage)?;
        for item in logs.iter().map_err(storage)? {
            let (origin, value) = item.map_err(storage)?;
            if hex::encode(Sha256::digest(origin.value().as_bytes())) == origin_hash_hex {
                let state: LogState = serde_json::from_slice(value.value()).map_err(storage)?;
                return Ok(state.note);
            }
        }
        Ok(None)
    }

    /// Evidence kept so far (full request bodies): forks, then unproven requests.
    pub fn evidence(&self) -> Result<Vec<String>, WitnessError> {
        let txn = self.db.begin_read().map_err(storage)?;
        let mut out = Vec::new();
        for table in [EVIDENCE, EVIDENCE_UNPROVEN] {
            let table = txn.open_table(table).map_err(storage)?;
            for item in table.iter().map_err(storage)? {
                let (_, v) = item.map_err(storage)?;
                out.push(String::from_utf8_lossy(v.value()).into_owned());
            }
        }
        Ok(out)
    }

    /// `POST /add-checkpoint`. `clock` gives POSIX seconds; it is read under the lock, so
    /// concurrent requests sign with non-decreasing timestamps.
    #[expect(
        clippy::too_many_lines,
        reason = "the tlog-witness add-checkpoint procedure, in the spec's order, under one lock and one commit"
    )]
    pub fn add_checkpoint(
        &self,
        body: &[u8],
        clock: impl Fn() -> u64,
    ) -> Result<Reply, WitnessError> {
        if body.len() > MAX_REQUEST_BYTES {
            return Ok(Reply::text(400, "request too large\n"));
        }
        let Ok(text) = std::str::from_utf8(body) else {
            return Ok(Reply::text(400, "request is not UTF-8\n"));
        };
        let request = match parse_request(text) {
            Ok(r) => r,
            Err(e) => return Ok(Reply::text(400, format!("{e}\n"))),
        };
        // The note's form first (400), the origin from its text, then its signatures
        // against the trusted log key (403).
        if let Err(e) = signed_note::Note::from_bytes(request.note.as_bytes()) {
            return Ok(Reply::text(
                400,
                format!("malformed checkpoint note: {e}\n"),
            ));
        }
        let origin = request
            .note
            .split('\n')
            .next()
            .unwrap_or_default()
            .to_string();

        let _guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let Some(mut state) = self.log_state(&origin)? else {
            return Ok(Reply::text(404, format!("unknown origin {origin:?}\n")));
        };
        let verifier = signed_note::StandardVerifier::new(&state.vkey)
            .map_err(|e| WitnessError::Config(format!("stored verifier key: {e}")))?;
        // Every line by the log's key must verify, not only the first (tlog-witness: 403
        // when a line's name and key ID match a trusted key but it fails).
        let verified = match lineage_core::note::verify_note(&request.note, &[&verifier]) {
            Ok(v) if v.signed_by(&verifier) => v,
            Ok(_) => {
                return Ok(Reply::text(
                    403,
                    "no valid signature by the log's trusted key\n",
                ))
            }
            Err(lineage_core::note::NoteError::BadSignature { .. }) => {
                return Ok(Reply::text(
                    403,
                    "a signature line by the log's trusted key does not verify\n",
                ))
            }
            Err(e) => return Ok(Reply::text(400, format!("{e}\n"))),
        };
        let note_text = verified.text.clone();
        let checkpoint = match Checkpoint::parse(&note_text) {
            Ok(c) => c,
            Err(e) => return Ok(Reply::text(400, format!("malformed checkpoint: {e}\n"))),
        };
        if request.old > checkpoint.size {
            return Ok(Reply::text(
                400,
                "old size is larger than the checkpoint's size\n",
            ));
        }
        let stored_root: Hash = B64
            .decode(&state.root)
            .ok()
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| WitnessError::Storage("stored root is not 32 bytes".into()))?;
        // Two roots the log signed for one size: a fork, whatever else the request says.
        let fork = checkpoint.size == state.size && checkpoint.root != stored_root;
        // What the log itself signed: the text and its own lines.
        let signed = format!("{}\n{}", verified.text, verified.lines_by(&verifier));
        if request.old != state.size {
            // A smaller checkpoint may be one the log signed before: not evidence.
            if fork {
                self.keep_evidence(body, &signed, Evidence::Fork)?;
            }
            return Ok(Reply {
                status: 409,
                content_type: "text/x.tlog.size",
                body: format!("{}\n", state.size),
            });
        }
        if checkpoint.size == 0 && checkpoint.root != empty_root() {
            return Ok(Reply::text(
                422,
                "a size-0 checkpoint must have the empty root\n",
            ));
        }
        if request.old == 0 && !request.proof.is_empty() {
            return Ok(Reply::text(
                422,
                "no consistency proof is sent from size 0\n",
            ));
        }
        if let Err(e) = verify_consistency(
            &stored_root,
            state.size,
            &checkpoint.root,
            checkpoint.size,
            &request.proof,
        ) {
            // Signed by the log, yet not shown to extend what was cosigned: keep it,
            // unless it is the cosigned checkpoint itself sent with a needless proof.
            if fork {
                self.keep_evidence(body, &signed, Evidence::Fork)?;
            } else if checkpoint.size > state.size {
                self.keep_evidence(body, &signed, Evidence::Unproven)?;
            }
            return Ok(Reply::text(
                422,
                format!("checkpoint is not consistent with the cosigned one: {e}\n"),
            ));
        }

        // Sign, then persist, then answer: never answer before the state is durable.
        let now = clock();
        let last_signed_at = self.last_signed_at()?;
        if now < last_signed_at {
            return Ok(Reply::text(
                500,
                "the witness clock went backwards; refusing to sign\n",
            ));
        }
        let cosignature = self.cosigner.cosign(&note_text, now);
        // Stored and served: the text, the log's lines that verified, our cosignature;
        // never a line from the request that nobody here checked.
        let mut cosigned = verified.with_verified_lines();
        cosigned.push_str(&cosignature);
        state.size = checkpoint.size;
        state.root = B64.encode(checkpoint.root);
        state.note = Some(cosigned);
        let txn = self.db.begin_write().map_err(storage)?;
        {
            let mut logs = txn.open_table(LOGS).map_err(storage)?;
            let bytes = serde_json::to_vec(&state).map_err(storage)?;
            logs.insert(origin.as_str(), bytes.as_slice())
                .map_err(storage)?;
            let mut meta = txn.open_table(META).map_err(storage)?;
            meta.insert(LAST_SIGNED_AT, now).map_err(storage)?;
        }
        txn.commit().map_err(storage)?;
        Ok(Reply::text(200, cosignature))
    }

    fn last_signed_at(&self) -> Result<u64, WitnessError> {
        let txn = self.db.begin_read().map_err(storage)?;
        let meta = txn.open_table(META).map_err(storage)?;
        Ok(meta
            .get(LAST_SIGNED_AT)
            .map_err(storage)?
            .map_or(0, |v| v.value()))
    }

    /// Keeps `body` as evidence of `kind`, once per `signed` checkpoint; unproven ones
    /// up to [`MAX_UNPROVEN_EVIDENCE`].
    fn keep_evidence(&self, body: &[u8], signed: &str, kind: Evidence) -> Result<(), WitnessError> {
        let digest: [u8; 32] = Sha256::digest(signed.as_bytes()).into();
        let txn = self.db.begin_write().map_err(storage)?;
        {
            let mut notes = txn.open_table(EVIDENCE_NOTES).map_err(storage)?;
            if notes.get(&digest).map_err(storage)?.is_some() {
                return Ok(());
            }
            let mut table = txn
                .open_table(match kind {
                    Evidence::Fork => EVIDENCE,
                    Evidence::Unproven => EVIDENCE_UNPROVEN,
                })
                .map_err(storage)?;
            if kind == Evidence::Unproven && table.len().map_err(storage)? >= MAX_UNPROVEN_EVIDENCE
            {
                tracing::warn!(
                    kept = MAX_UNPROVEN_EVIDENCE,
                    "a checkpoint whose proof failed was not kept: the witness holds its most"
                );
                return Ok(());
            }
            let next = table
                .last()
                .map_err(storage)?
                .map_or(0, |(k, _)| k.value() + 1);
            table.insert(next, body).map_err(storage)?;
            notes.insert(&digest, 1).map_err(storage)?;
        }
        txn.commit().map_err(storage)
    }
}

/// A witness's cosignature verifier key from its name and key alone (no storage), so
/// `lineage-witness vkey` works while the witness is serving.
pub fn vkey_for(name: &str, seed: [u8; 32]) -> Result<String, String> {
    Cosigner::new(name, AuditKey::from_seed(seed))
        .map(|c| c.vkey())
        .map_err(|e| e.0)
}

struct Request {
    old: u64,
    proof: Vec<Hash>,
    note: String,
}

fn parse_request(text: &str) -> Result<Request, String> {
    let (head, note) = text
        .split_once("\n\n")
        .ok_or("request has no blank line before the checkpoint")?;
    let mut lines = head.split('\n');
    let old_line = lines.next().unwrap_or_default();
    let old = old_line
        .strip_prefix("old ")
        .filter(|n| {
            !n.is_empty()
                && (n == &"0" || !n.starts_with('0'))
                && n.bytes().all(|b| b.is_ascii_digit())
        })
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| format!("first line must be `old <size>`, got {old_line:?}"))?;
    let mut proof = Vec::new();
    for line in lines {
        if proof.len() == MAX_PROOF_LINES {
            return Err(format!("more than {MAX_PROOF_LINES} proof lines"));
        }
        let hash: Hash = B64
            .decode(line)
            .ok()
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| format!("proof line is not a base64 32-byte hash: {line:?}"))?;
        proof.push(hash);
    }
    Ok(Request {
        old,
        proof,
        note: note.to_string(),
    })
}
