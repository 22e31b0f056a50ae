//! Transparency primitives: each agent's log as an RFC 6962 Merkle tree, and C2SP
//! checkpoints (`tlog-checkpoint` signed notes) over such trees.
//!
//! A leaf is a record's 32-byte content hash, so the tree commits to exactly what the
//! hash chain commits to. Tree arithmetic is `ct-merkle`'s; note encoding and signature
//! checking are `signed_note`'s (Cloudflare's implementation of c2sp.org/signed-note).
//! Both are checked here against the public RFC 6962 vectors and the C2SP example.

use base64::Engine;
use ct_merkle::mem_backed_tree::MemoryBackedTree;
use ct_merkle::{ConsistencyProof, InclusionProof, RootHash};
use sha2::Digest;
// ct-merkle is generic over digest 0.11 hashes: the same SHA-256, a newer trait version.
use sha2_for_merkle::Sha256;

use crate::keys::AuditKey;

pub type Hash = [u8; 32];

/// Why a proof or a checkpoint was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct TransparencyError(pub String);

fn err(message: impl Into<String>) -> TransparencyError {
    TransparencyError(message.into())
}

/// The Merkle tree over `leaves` (record hashes for agent logs; any bytes in general).
fn tree<T: AsRef<[u8]> + Clone>(leaves: &[T]) -> MemoryBackedTree<Sha256, T> {
    let mut tree = MemoryBackedTree::new();
    for leaf in leaves {
        tree.push(leaf.clone());
    }
    tree
}

/// RFC 6962 `MTH` of the leaves (`SHA-256("")` for none).
pub fn root<T: AsRef<[u8]> + Clone>(leaves: &[T]) -> Hash {
    (*tree(leaves).root().as_bytes()).into()
}

/// The audit path for leaf `index` in the tree of all `leaves`, leaf to root.
pub fn inclusion_proof<T: AsRef<[u8]> + Clone>(
    leaves: &[T],
    index: u64,
) -> Result<Vec<Hash>, TransparencyError> {
    if index >= leaves.len() as u64 {
        return Err(err(format!(
            "index {index} is not below size {}",
            leaves.len()
        )));
    }
    let proof = tree(leaves).prove_inclusion(index as usize);
    Ok(split_hashes(proof.as_bytes()))
}

/// The proof that the tree of the first `old_size` leaves is a prefix of the tree of all
/// `leaves`. Empty when `old_size` is 0 or equals the size.
pub fn consistency_proof<T: AsRef<[u8]> + Clone>(
    leaves: &[T],
    old_size: u64,
) -> Result<Vec<Hash>, TransparencyError> {
    let size = leaves.len() as u64;
    if old_size > size {
        return Err(err(format!("old size {old_size} is above size {size}")));
    }
    if old_size == 0 || old_size == size {
        return Ok(Vec::new());
    }
    let proof = tree(leaves).prove_consistency((size - old_size) as usize);
    Ok(split_hashes(proof.as_bytes()))
}

fn split_hashes(bytes: &[u8]) -> Vec<Hash> {
    bytes
        .chunks_exact(32)
        .map(|c| c.try_into().unwrap_or([0; 32]))
        .collect()
}

fn join_hashes(hashes: &[Hash]) -> Vec<u8> {
    hashes.iter().flatten().copied().collect()
}

/// Checks that `leaf` (a record hash) is at `index` in the tree of `size` with `root`.
pub fn verify_inclusion(
    root: &Hash,
    size: u64,
    index: u64,
    leaf: &[u8],
    proof: &[Hash],
) -> Result<(), TransparencyError> {
    if index >= size {
        return Err(err(format!("index {index} is not below size {size}")));
    }
    let root = RootHash::<Sha256>::new((*root).into(), size);
    let proof = InclusionProof::<Sha256>::try_from_bytes(join_hashes(proof))
        .map_err(|e| err(format!("malformed inclusion proof: {e}")))?;
    root.verify_inclusion(&leaf, index, &proof)
        .map_err(|e| err(format!("inclusion proof does not verify: {e}")))
}

/// Checks that the tree (`old_size`, `old_root`) is a prefix of (`size`, `root`).
pub fn verify_consistency(
    old_root: &Hash,
    old_size: u64,
    root: &Hash,
    size: u64,
    proof: &[Hash],
) -> Result<(), TransparencyError> {
    if old_size > size {
        return Err(err(format!("old size {old_size} is above size {size}")));
    }
    if old_size == 0 {
        // Every tree extends the empty one; C2SP tlog-witness sends no proof for it.
        return if proof.is_empty() {
            Ok(())
        } else {
            Err(err("a consistency proof from size 0 must be empty"))
        };
    }
    if old_size == size {
        return if proof.is_empty() && old_root == root {
            Ok(())
        } else {
            Err(err("same size with another root (or a non-empty proof)"))
        };
    }
    let old = RootHash::<Sha256>::new((*old_root).into(), old_size);
    let new = RootHash::<Sha256>::new((*root).into(), size);
    let proof = ConsistencyProof::<Sha256>::try_from_bytes(join_hashes(proof))
        .map_err(|e| err(format!("malformed consistency proof: {e}")))?;
    new.verify_consistency(&old, &proof)
        .map_err(|e| err(format!("consistency proof does not verify: {e}")))
}

/// A C2SP `tlog-checkpoint` body: origin, size, root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    pub origin: String,
    pub size: u64,
    pub root: Hash,
}

impl Checkpoint {
    /// The note text: three lines, each ending in `\n`.
    pub fn text(&self) -> String {
        format!(
            "{}\n{}\n{}\n",
            self.origin,
            self.size,
            base64::engine::general_purpose::STANDARD.encode(self.root)
        )
    }

    /// Parses a checkpoint body (extension lines are ignored, as the spec allows).
    pub fn parse(text: &str) -> Result<Checkpoint, TransparencyError> {
        let mut lines = text.split('\n');
        let origin = lines
            .next()
            .filter(|l| !l.is_empty())
            .ok_or_else(|| err("checkpoint has no origin"))?;
        let size_line = lines.next().ok_or_else(|| err("checkpoint has no size"))?;
        if size_line.is_empty()
            || (size_line.len() > 1 && size_line.starts_with('0'))
            || !size_line.bytes().all(|b| b.is_ascii_digit())
        {
            return Err(err(format!(
                "checkpoint size {size_line:?} is not a decimal without leading zeros"
            )));
        }
        let size = size_line
            .parse()
            .map_err(|_| err("checkpoint size is out of range"))?;
        let root_line = lines.next().ok_or_else(|| err("checkpoint has no root"))?;
        let root_bytes = base64::engine::general_purpose::STANDARD
            .decode(root_line)
            .map_err(|_| err("checkpoint root is not base64"))?;
        let root: Hash = root_bytes
            .try_into()
            .map_err(|_| err("checkpoint root is not 32 bytes"))?;
        Ok(Checkpoint {
            origin: origin.to_string(),
            size,
            root,
        })
    }

    /// Signs the checkpoint as a note with `key`, under the key name `origin`.
    pub fn sign(&self, key: &AuditKey) -> Result<String, TransparencyError> {
        let signer = NoteSigner::new(&self.origin, key)?;
        let mut note = signed_note::Note::new(self.text().as_bytes(), &[])
            .map_err(|e| err(format!("cannot make a note: {e}")))?;
        note.add_sigs(&[&signer])
            .map_err(|e| err(format!("cannot sign the note: {e}")))?;
        String::from_utf8(note.to_bytes()).map_err(|e| err(e.to_string()))
    }

    /// Verifies a signed checkpoint note with the verifier key `vkey` and parses it.
    pub fn verify(note: &str, vkey: &str) -> Result<Checkpoint, TransparencyError> {
        let verifier = signed_note::StandardVerifier::new(vkey)
            .map_err(|e| err(format!("bad verifier key: {e}")))?;
        let parsed = signed_note::Note::from_bytes(note.as_bytes())
            .map_err(|e| err(format!("malformed note: {e}")))?;
        parsed
            .verify(&signed_note::VerifierList::new(vec![Box::new(verifier)]))
            .map_err(|e| err(format!("note signature does not verify: {e}")))?;
        let text = std::str::from_utf8(parsed.text()).map_err(|_| err("note text is not UTF-8"))?;
        Checkpoint::parse(text)
    }
}

/// Signs notes with an audit key (Ed25519, signature type 0x01).
pub struct NoteSigner {
    name: String,
    id: u32,
    key: AuditKey,
}

impl NoteSigner {
    pub fn new(name: &str, key: &AuditKey) -> Result<Self, TransparencyError> {
        if !signed_note::is_key_name_valid(name) {
            return Err(err(format!("{name:?} is not a valid note key name")));
        }
        let mut encoded = vec![0x01];
        encoded.extend_from_slice(key.verifying_key().as_bytes());
        Ok(NoteSigner {
            name: name.to_string(),
            id: signed_note::key_id(name, &encoded),
            key: key.clone(),
        })
    }

    /// The verifier key `name+hexid+base64(0x01||pubkey)` that auditors configure.
    pub fn vkey(&self) -> String {
        signed_note::new_ed25519_verifier_key(&self.name, &self.key.verifying_key())
    }
}

impl signed_note::Signer for NoteSigner {
    fn name(&self) -> &str {
        &self.name
    }
    fn key_id(&self) -> u32 {
        self.id
    }
    fn sign(&self, msg: &[u8]) -> Result<Vec<u8>, signature::Error> {
        Ok(self.key.sign_bytes(msg).to_vec())
    }
}

/// The RFC 6962 leaf hash of a record hash (for callers that store leaf hashes).
pub fn leaf_hash(leaf: &Hash) -> Hash {
    let mut hasher = sha2::Sha256::new();
    hasher.update([0u8]);
    hasher.update(leaf);
    hasher.finalize().into()
}
