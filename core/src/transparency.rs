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
        let verified = crate::note::verify_note(note, &[&verifier])
            .map_err(|e| err(format!("note signature does not verify: {e}")))?;
        if !verified.signed_by(&verifier) {
            return Err(err(
                "note signature does not verify: no signature by the key",
            ));
        }
        Checkpoint::parse(&verified.text)
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
    leaf_hash_of(leaf)
}

/// The right edge of an RFC 6962 tree: the roots of its perfect subtrees, largest
/// first (one per set bit of the size). Enough to append a leaf and compute the root in
/// O(log n) without the leaves, so a node keeps every agent's root current as it
/// applies records, and the checkpointer follows the heads log with constant state.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Frontier {
    size: u64,
    subtrees: Vec<Hash>,
}

fn node_hash(left: &Hash, right: &Hash) -> Hash {
    let mut hasher = sha2::Sha256::new();
    hasher.update([1u8]);
    hasher.update(left);
    hasher.update(right);
    hasher.finalize().into()
}

/// RFC 6962 leaf hash of arbitrary leaf bytes: `SHA-256(0x00 || data)`.
pub fn leaf_hash_of(data: &[u8]) -> Hash {
    let mut hasher = sha2::Sha256::new();
    hasher.update([0u8]);
    hasher.update(data);
    hasher.finalize().into()
}

impl Frontier {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// Appends a leaf given its data (for agent logs: the record's 32-byte hash).
    pub fn push(&mut self, data: &[u8]) {
        let mut hash = leaf_hash_of(data);
        let mut size = self.size;
        // Each trailing 1 bit of the old size is a subtree of the new leaf's height that
        // now merges with it.
        while size & 1 == 1 {
            let Some(left) = self.subtrees.pop() else {
                break;
            };
            hash = node_hash(&left, &hash);
            size >>= 1;
        }
        self.subtrees.push(hash);
        self.size += 1;
    }

    /// The tree's root (`SHA-256("")` when empty).
    pub fn root(&self) -> Hash {
        let mut subtrees = self.subtrees.iter().rev();
        let Some(last) = subtrees.next() else {
            return sha2::Sha256::digest([]).into();
        };
        subtrees.fold(*last, |right, left| node_hash(left, &right))
    }

    /// Whether this is a well-formed frontier (one subtree per set bit of the size), as
    /// a frontier read back from storage must be.
    pub fn is_well_formed(&self) -> bool {
        self.subtrees.len() == self.size.count_ones() as usize
    }
}

/// Where an RFC 6962 tree's hashes come from, for roots and proofs at any earlier size:
/// the hashes of perfect, aligned subtrees it keeps, and leaf hashes for the rest. Kept
/// whole in memory ([`MerkleLevels`]) or on disk with a bounded part in memory (the heads
/// log's tree on a node).
pub trait SubtreeSource {
    /// How many leaves the tree holds.
    fn size(&self) -> u64;
    /// The hash of the perfect subtree of `2^level` leaves starting at leaf
    /// `index * 2^level`, when it is kept.
    fn perfect(&self, level: u32, index: u64) -> Result<Option<Hash>, TransparencyError>;
    /// Ranges of at most this many leaves are hashed from their leaf hashes.
    fn leaf_batch(&self) -> u64;
    /// The leaf hashes of leaves `start..end` (`end - start` at most [`Self::leaf_batch`]).
    fn leaf_hashes(&self, start: u64, end: u64) -> Result<Vec<Hash>, TransparencyError>;
}

/// `MTH(D[start..start+len])`, for ranges within the tree and `len > 0`.
fn subtree(source: &impl SubtreeSource, start: u64, len: u64) -> Result<Hash, TransparencyError> {
    if len.is_power_of_two() && start.is_multiple_of(len) {
        if let Some(hash) = source.perfect(len.trailing_zeros(), start / len)? {
            return Ok(hash);
        }
    }
    if len <= source.leaf_batch().max(1) {
        let hashes = source.leaf_hashes(start, start + len)?;
        if hashes.len() as u64 != len {
            return Err(err(format!(
                "{} leaf hashes for leaves {start}..{}",
                hashes.len(),
                start + len
            )));
        }
        return Ok(mth_of_leaf_hashes(&hashes));
    }
    let k = split_point(len);
    Ok(node_hash(
        &subtree(source, start, k)?,
        &subtree(source, start + k, len - k)?,
    ))
}

/// RFC 6962 `MTH` of a run of leaf hashes (`SHA-256("")` for none).
pub fn root_of_leaf_hashes(hashes: &[Hash]) -> Hash {
    if hashes.is_empty() {
        return sha2::Sha256::digest([]).into();
    }
    mth_of_leaf_hashes(hashes)
}

/// RFC 6962 `MTH` of a non-empty run of leaf hashes.
fn mth_of_leaf_hashes(hashes: &[Hash]) -> Hash {
    if hashes.len() == 1 {
        return hashes[0];
    }
    let k = split_point(hashes.len() as u64) as usize;
    node_hash(
        &mth_of_leaf_hashes(&hashes[..k]),
        &mth_of_leaf_hashes(&hashes[k..]),
    )
}

/// The root of the tree of the first `size` leaves.
pub fn root_at(source: &impl SubtreeSource, size: u64) -> Result<Hash, TransparencyError> {
    if size > source.size() {
        return Err(err(format!(
            "size {size} is above the tree's {}",
            source.size()
        )));
    }
    if size == 0 {
        return Ok(sha2::Sha256::digest([]).into());
    }
    subtree(source, 0, size)
}

/// RFC 6962 `PATH(index, D[0:size])`, leaf to root.
pub fn inclusion_proof_at(
    source: &impl SubtreeSource,
    index: u64,
    size: u64,
) -> Result<Vec<Hash>, TransparencyError> {
    if size > source.size() || index >= size {
        return Err(err(format!(
            "index {index} must be below size {size}, at most {}",
            source.size()
        )));
    }
    let mut proof = Vec::new();
    path(source, index, 0, size, &mut proof)?;
    Ok(proof)
}

fn path(
    source: &impl SubtreeSource,
    index: u64,
    start: u64,
    len: u64,
    proof: &mut Vec<Hash>,
) -> Result<(), TransparencyError> {
    if len <= 1 {
        return Ok(());
    }
    let k = split_point(len);
    if index < k {
        path(source, index, start, k, proof)?;
        proof.push(subtree(source, start + k, len - k)?);
    } else {
        path(source, index - k, start + k, len - k, proof)?;
        proof.push(subtree(source, start, k)?);
    }
    Ok(())
}

/// RFC 6962 `PROOF(old, D[0:size])`; empty when `old` is 0 or `size`.
pub fn consistency_proof_at(
    source: &impl SubtreeSource,
    old: u64,
    size: u64,
) -> Result<Vec<Hash>, TransparencyError> {
    if size > source.size() || old > size {
        return Err(err(format!(
            "old size {old} must not exceed size {size}, at most {}",
            source.size()
        )));
    }
    let mut proof = Vec::new();
    if old > 0 && old < size {
        subproof(source, old, 0, size, true, &mut proof)?;
    }
    Ok(proof)
}

fn subproof(
    source: &impl SubtreeSource,
    m: u64,
    start: u64,
    len: u64,
    whole: bool,
    proof: &mut Vec<Hash>,
) -> Result<(), TransparencyError> {
    if m == len {
        if !whole {
            proof.push(subtree(source, start, len)?);
        }
        return Ok(());
    }
    let k = split_point(len);
    if m <= k {
        subproof(source, m, start, k, whole, proof)?;
        proof.push(subtree(source, start + k, len - k)?);
    } else {
        subproof(source, m - k, start + k, len - k, false, proof)?;
        proof.push(subtree(source, start, k)?);
    }
    Ok(())
}

/// The parent of two nodes, `SHA-256(0x01 || left || right)`.
pub fn parent_hash(left: &Hash, right: &Hash) -> Hash {
    node_hash(left, right)
}

/// A whole RFC 6962 tree kept in memory as levels of perfect-subtree hashes (level 0 =
/// leaf hashes, level k = every complete, aligned subtree of 2^k leaves): about two
/// hashes per leaf, and inclusion and consistency proofs for any earlier size in
/// O(log² n) without rehashing leaves. The reference for [`SubtreeSource`]s kept
/// elsewhere.
#[derive(Debug, Clone, Default)]
pub struct MerkleLevels {
    levels: Vec<Vec<Hash>>,
}

impl SubtreeSource for MerkleLevels {
    fn size(&self) -> u64 {
        self.levels.first().map_or(0, |l| l.len() as u64)
    }

    fn perfect(&self, level: u32, index: u64) -> Result<Option<Hash>, TransparencyError> {
        Ok(self
            .levels
            .get(level as usize)
            .and_then(|l| l.get(index as usize))
            .copied())
    }

    fn leaf_batch(&self) -> u64 {
        1
    }

    fn leaf_hashes(&self, start: u64, end: u64) -> Result<Vec<Hash>, TransparencyError> {
        let leaves = self.levels.first().map_or(&[][..], Vec::as_slice);
        leaves
            .get(start as usize..end as usize)
            .map(<[Hash]>::to_vec)
            .ok_or_else(|| err(format!("no leaves {start}..{end}")))
    }
}

impl MerkleLevels {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn size(&self) -> u64 {
        SubtreeSource::size(self)
    }

    /// Appends a leaf by its leaf hash (`SHA-256(0x00 || data)`).
    pub fn push_leaf_hash(&mut self, hash: Hash) {
        let mut level = 0;
        let mut hash = hash;
        loop {
            if self.levels.len() == level {
                self.levels.push(Vec::new());
            }
            let nodes = &mut self.levels[level];
            nodes.push(hash);
            if nodes.len() % 2 == 1 {
                return;
            }
            hash = node_hash(&nodes[nodes.len() - 2], &nodes[nodes.len() - 1]);
            level += 1;
        }
    }

    pub fn leaf_hash(&self, index: u64) -> Option<Hash> {
        self.levels.first()?.get(index as usize).copied()
    }

    /// The root of the tree of the first `size` leaves.
    pub fn root_at(&self, size: u64) -> Result<Hash, TransparencyError> {
        root_at(self, size)
    }

    /// RFC 6962 `PATH(index, D[0:size])`, leaf to root.
    pub fn inclusion_proof(&self, index: u64, size: u64) -> Result<Vec<Hash>, TransparencyError> {
        inclusion_proof_at(self, index, size)
    }

    /// RFC 6962 `PROOF(old, D[0:size])`; empty when `old` is 0 or `size`.
    pub fn consistency_proof(&self, old: u64, size: u64) -> Result<Vec<Hash>, TransparencyError> {
        consistency_proof_at(self, old, size)
    }
}

/// The largest power of two below `n` (n > 1), where RFC 6962 splits a tree.
fn split_point(n: u64) -> u64 {
    let mut k = 1;
    while k << 1 < n {
        k <<= 1;
    }
    k
}
