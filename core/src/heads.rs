//! The heads log and what auditors check against it.
//!
//! A cluster appends one head statement `{agent_id, size, root, head_hash}` per changed
//! agent per round to its heads log, an RFC 6962 tree whose C2SP checkpoint (origin = the
//! cluster name, signed with the audit key) witnesses cosign. A witnessed heads checkpoint
//! fixes every agent's size and root at that round; this module verifies the witnessed
//! note (log signature plus a quorum of `cosignature/v1` signatures), the inclusion of an
//! agent's statement in it, and an agent log against the statement.

use base64::Engine;
use serde::{Deserialize, Serialize};

use crate::record::Record;
use crate::transparency::{self, Checkpoint, Frontier, Hash, TransparencyError};

fn err(message: impl Into<String>) -> TransparencyError {
    TransparencyError(message.into())
}

/// One leaf of the heads log: an agent's log had `size` records, with Merkle `root` and
/// last record hash `head_hash`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeadStatement {
    pub agent_id: String,
    pub size: u64,
    /// Hex of the agent tree's root over its first `size` record hashes.
    pub root: String,
    /// Hex hash of record `size - 1`.
    pub head_hash: String,
}

impl HeadStatement {
    /// The leaf bytes: canonical JSON (keys sorted, no spaces), as hashed into the tree.
    pub fn to_leaf(&self) -> String {
        // Field order here is the sorted key order; serde_json escapes the strings.
        let quoted = |s: &str| serde_json::Value::String(s.to_string()).to_string();
        format!(
            "{{\"agent_id\":{},\"head_hash\":{},\"root\":{},\"size\":{}}}",
            quoted(&self.agent_id),
            quoted(&self.head_hash),
            quoted(&self.root),
            self.size
        )
    }

    /// Parses leaf bytes, accepting only the exact canonical form.
    pub fn from_leaf(leaf: &str) -> Result<HeadStatement, TransparencyError> {
        let statement: HeadStatement = serde_json::from_str(leaf)
            .map_err(|e| err(format!("head statement is not valid JSON: {e}")))?;
        if statement.to_leaf() != leaf {
            return Err(err("head statement is not in canonical form"));
        }
        Ok(statement)
    }

    pub fn leaf_hash(&self) -> Hash {
        transparency::leaf_hash_of(self.to_leaf().as_bytes())
    }
}

/// A witness's `cosignature/v1` signer (C2SP tlog-cosignature): its verifier key and
/// the signature lines it adds to checkpoints.
pub struct Cosigner {
    name: String,
    key: crate::AuditKey,
    /// Key type 0x04 followed by the public key, as the vkey and key id encode it.
    encoded: Vec<u8>,
    key_id: u32,
}

impl Cosigner {
    pub fn new(name: &str, key: crate::AuditKey) -> Result<Self, TransparencyError> {
        if !signed_note::is_key_name_valid(name) {
            return Err(err(format!("{name:?} is not a valid key name")));
        }
        let mut encoded = vec![0x04];
        encoded.extend_from_slice(key.verifying_key().as_bytes());
        let key_id = signed_note::key_id(name, &encoded);
        Ok(Cosigner {
            name: name.to_string(),
            key,
            encoded,
            key_id,
        })
    }

    /// `name+keyid+base64(0x04 || pubkey)`, what verifiers are configured with.
    pub fn vkey(&self) -> String {
        let key = base64::engine::general_purpose::STANDARD.encode(&self.encoded);
        format!("{}+{:08x}+{key}", self.name, self.key_id)
    }

    /// The signature line `— name base64(keyid || time || signature)` for a checkpoint's
    /// text, signed at `time` (seconds since the epoch).
    pub fn cosign(&self, checkpoint_text: &str, time: u64) -> String {
        let message = format!("cosignature/v1\ntime {time}\n{checkpoint_text}");
        let signature = self.key.sign_bytes(message.as_bytes());
        let mut blob = Vec::with_capacity(76);
        blob.extend_from_slice(&self.key_id.to_be_bytes());
        blob.extend_from_slice(&time.to_be_bytes());
        blob.extend_from_slice(&signature);
        let blob = base64::engine::general_purpose::STANDARD.encode(blob);
        format!("\u{2014} {} {blob}\n", self.name)
    }
}

/// Verifies `cosignature/v1` (timestamped Ed25519, key type 0x04) signature lines.
pub struct CosignatureVerifier {
    name: String,
    id: u32,
    key: ed25519_dalek::VerifyingKey,
}

impl CosignatureVerifier {
    /// From a witness vkey `name+hexid+base64(0x04 || pubkey)`.
    pub fn new(vkey: &str) -> Result<Self, TransparencyError> {
        let mut parts = vkey.splitn(3, '+');
        let (Some(name), Some(id_hex), Some(key_b64)) = (parts.next(), parts.next(), parts.next())
        else {
            return Err(err(format!("witness key {vkey:?} is not name+id+key")));
        };
        let encoded = base64::engine::general_purpose::STANDARD
            .decode(key_b64)
            .map_err(|_| err("witness key is not base64"))?;
        let [0x04, key @ ..] = encoded.as_slice() else {
            return Err(err(
                "witness key is not a cosignature/v1 (0x04) Ed25519 key",
            ));
        };
        let key: [u8; 32] = key
            .try_into()
            .map_err(|_| err("witness key is not 32 bytes"))?;
        let key = ed25519_dalek::VerifyingKey::from_bytes(&key)
            .map_err(|_| err("witness key is not a valid Ed25519 point"))?;
        let id = signed_note::key_id(name, &encoded);
        if format!("{id:08x}") != id_hex {
            return Err(err("witness key id does not match its name and key"));
        }
        if !signed_note::is_key_name_valid(name) {
            return Err(err(format!("{name:?} is not a valid key name")));
        }
        Ok(CosignatureVerifier {
            name: name.to_string(),
            id,
            key,
        })
    }
}

impl signed_note::Verifier for CosignatureVerifier {
    fn name(&self) -> &str {
        &self.name
    }
    fn key_id(&self) -> u32 {
        self.id
    }
    fn verify(&self, msg: &[u8], sig: &[u8]) -> bool {
        let (Some(time), Some(signature)) = (sig.get(..8), sig.get(8..)) else {
            return false;
        };
        let Ok(time) = <[u8; 8]>::try_from(time).map(u64::from_be_bytes) else {
            return false;
        };
        let Ok(signature) = ed25519_dalek::Signature::from_slice(signature) else {
            return false;
        };
        if time == 0 || time > i64::MAX as u64 {
            return false;
        }
        let mut message = format!("cosignature/v1\ntime {time}\n").into_bytes();
        message.extend_from_slice(msg);
        self.key.verify_strict(&message, &signature).is_ok()
    }
}

/// A heads checkpoint that verified: the log's signature and enough witnesses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Witnessed {
    pub checkpoint: Checkpoint,
    /// Names of the witnesses whose cosignatures verified.
    pub witnesses: Vec<String>,
}

/// Verifies a witnessed checkpoint note: signed by `log_vkey`, cosigned by at least
/// `quorum` of `witness_vkeys`. A signature by a known key that fails rejects the note.
pub fn verify_witnessed(
    note: &str,
    log_vkey: &str,
    witness_vkeys: &[String],
    quorum: usize,
) -> Result<Witnessed, TransparencyError> {
    let log = signed_note::StandardVerifier::new(log_vkey)
        .map_err(|e| err(format!("bad log key: {e}")))?;
    let cosigners = witness_vkeys
        .iter()
        .map(|vkey| CosignatureVerifier::new(vkey))
        .collect::<Result<Vec<_>, _>>()?;
    let mut verifiers: Vec<&dyn signed_note::Verifier> = vec![&log];
    verifiers.extend(cosigners.iter().map(|c| c as &dyn signed_note::Verifier));
    let verified = crate::note::verify_note(note, &verifiers)
        .map_err(|e| err(format!("note does not verify: {e}")))?;
    if !verified.signed_by(&log) {
        return Err(err("the note is not signed by the log's key"));
    }
    // Distinct witness keys count towards the quorum, not lines.
    let mut witnesses: Vec<String> = cosigners
        .iter()
        .filter(|c| verified.signed_by(*c))
        .map(|c| signed_note::Verifier::name(c).to_string())
        .collect();
    witnesses.sort();
    witnesses.dedup();
    if witnesses.len() < quorum {
        return Err(err(format!(
            "{} of the required {quorum} witnesses cosigned",
            witnesses.len()
        )));
    }
    Ok(Witnessed {
        checkpoint: Checkpoint::parse(&verified.text)?,
        witnesses,
    })
}

/// The note verifier key of a cluster's heads log: its audit key under the origin.
pub fn log_vkey(origin: &str, public_key_hex: &str) -> Result<String, TransparencyError> {
    let mut bytes = [0u8; 32];
    hex::decode_to_slice(public_key_hex, &mut bytes)
        .map_err(|_| err("public key is not 64 hex digits"))?;
    let key = ed25519_dalek::VerifyingKey::from_bytes(&bytes)
        .map_err(|_| err("public key is not a valid Ed25519 point"))?;
    if !signed_note::is_key_name_valid(origin) {
        return Err(err(format!("{origin:?} is not a valid origin")));
    }
    Ok(signed_note::new_ed25519_verifier_key(origin, &key))
}

/// An agent's head statement with its place in the heads tree (what
/// `GET /v1/agents/:id/head-proof` serves).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeadProof {
    pub statement: HeadStatement,
    pub index: u64,
    pub tree_size: u64,
    /// Base64 hashes, leaf to root.
    pub proof: Vec<String>,
}

impl HeadProof {
    /// Checks the statement is leaf `index` of the heads tree fixed by `checkpoint`.
    pub fn verify(&self, checkpoint: &Checkpoint) -> Result<(), TransparencyError> {
        if self.tree_size != checkpoint.size {
            return Err(err(format!(
                "the head proof is for heads tree size {}, the checkpoint has size {}",
                self.tree_size, checkpoint.size
            )));
        }
        let proof = decode_hashes(&self.proof)?;
        transparency::verify_inclusion(
            &checkpoint.root,
            checkpoint.size,
            self.index,
            self.statement.to_leaf().as_bytes(),
            &proof,
        )
    }
}

/// Decodes base64 hashes as the proof endpoints serve them.
pub fn decode_hashes(hashes: &[String]) -> Result<Vec<Hash>, TransparencyError> {
    hashes
        .iter()
        .map(|h| {
            base64::engine::general_purpose::STANDARD
                .decode(h)
                .ok()
                .and_then(|b| Hash::try_from(b.as_slice()).ok())
                .ok_or_else(|| err(format!("{h:?} is not a base64 32-byte hash")))
        })
        .collect()
}

/// How an agent log compares with its witnessed head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeadCheck {
    /// The log's first `size` records are exactly the witnessed ones; `later` records
    /// follow that are not witnessed yet.
    Complete { size: u64, later: u64 },
    /// The statement itself is unusable (no cluster writes it).
    BadStatement(String),
    /// The log ends before the witnessed head.
    CutShort { witnessed: u64, present: u64 },
    /// The log has as many records, but not the witnessed ones: the first record that
    /// differs has a seq in `first_differing` (inclusive), narrowed by the agent's earlier
    /// witnessed statements when they are given.
    Rewritten {
        witnessed: u64,
        first_differing: (u64, u64),
        detail: String,
    },
}

/// Compares an agent's records (seq 0.., as read from its log) with a witnessed head
/// statement, and with the agent's earlier witnessed statements if known, to say where
/// the log differs.
pub fn check_log_against_head(
    records: &[Record],
    statement: &HeadStatement,
    earlier: &[HeadStatement],
) -> HeadCheck {
    if statement.size == 0 {
        return HeadCheck::BadStatement("a head statement of size 0 covers no records".into());
    }
    let present = records.len() as u64;
    if present < statement.size {
        return HeadCheck::CutShort {
            witnessed: statement.size,
            present,
        };
    }
    let mut tree = Frontier::new();
    let mut roots_at: std::collections::HashMap<u64, String> = Default::default();
    let wanted: std::collections::HashSet<u64> = earlier
        .iter()
        .map(|s| s.size)
        .chain([statement.size])
        .collect();
    for record in records.iter().take(statement.size as usize) {
        let mut leaf = [0u8; 32];
        if hex::decode_to_slice(&record.hash, &mut leaf).is_err() {
            return HeadCheck::Rewritten {
                witnessed: statement.size,
                first_differing: (0, record.seq),
                detail: format!("record seq {} has a malformed hash", record.seq),
            };
        }
        tree.push(&leaf);
        if wanted.contains(&tree.size()) {
            roots_at.insert(tree.size(), hex::encode(tree.root()));
        }
    }
    let Some(head) = records.get(statement.size as usize - 1) else {
        return HeadCheck::CutShort {
            witnessed: statement.size,
            present,
        };
    };
    let root_matches = roots_at.get(&statement.size) == Some(&statement.root);
    if root_matches && head.hash == statement.head_hash {
        return HeadCheck::Complete {
            size: statement.size,
            later: present - statement.size,
        };
    }
    // The smallest earlier witnessed size that no longer matches bounds where the
    // rewrite starts: it lies after the largest matching size and before it.
    let mut sizes: Vec<&HeadStatement> = earlier
        .iter()
        .filter(|s| s.size > 0 && s.size <= statement.size)
        .collect();
    sizes.sort_by_key(|s| s.size);
    let mut last_good = 0;
    let mut first_bad = statement.size;
    for s in sizes {
        if roots_at.get(&s.size) == Some(&s.root) {
            last_good = s.size;
        } else {
            first_bad = s.size;
            break;
        }
    }
    HeadCheck::Rewritten {
        witnessed: statement.size,
        first_differing: (last_good, first_bad - 1),
        detail: format!(
            "the first {} records are not the witnessed ones: the first difference is at a \
             seq from {last_good} to {} (witnessed head hash {}, the log's record seq {} has {})",
            statement.size,
            first_bad - 1,
            statement.head_hash,
            statement.size - 1,
            head.hash
        ),
    }
}
