//! The `idempotency` table's rows: a stored answer with its own checksum. redb keeps a
//! crashed commit out, but not a byte that changed on disk afterwards; an answer read
//! back is served only if its SHA-256 still matches, so a changed answer is an error
//! (the API answers 503), never a wrong decision and never "no answer, decide again".
//!
//! Layout: 32 bytes of SHA-256 over the rest, then the answer as JSON.

use sha2::{Digest, Sha256};

use crate::raft_types::IdempotentAnswer;

const DIGEST_BYTES: usize = 32;

/// The row stored for `answer`.
pub fn encode(answer: &IdempotentAnswer) -> Result<Vec<u8>, serde_json::Error> {
    let json = serde_json::to_vec(answer)?;
    let mut row = Vec::with_capacity(DIGEST_BYTES + json.len());
    row.extend_from_slice(&Sha256::digest(&json));
    row.extend_from_slice(&json);
    Ok(row)
}

/// The answer in a row read back under `scoped_key`, checked: its checksum, its JSON,
/// and that it was stored under that key.
pub fn decode(row: &[u8], scoped_key: &str) -> Result<IdempotentAnswer, String> {
    if row.len() < DIGEST_BYTES {
        return Err(format!("stored answer is {} bytes, too short", row.len()));
    }
    let (digest, json) = row.split_at(DIGEST_BYTES);
    if Sha256::digest(json).as_slice() != digest {
        return Err("stored answer does not match its checksum".into());
    }
    let answer: IdempotentAnswer =
        serde_json::from_slice(json).map_err(|e| format!("stored answer: {e}"))?;
    if answer.key != scoped_key {
        return Err("stored answer belongs to another key".into());
    }
    Ok(answer)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer() -> IdempotentAnswer {
        IdempotentAnswer {
            key: "k1".into(),
            status: 200,
            body: r#"{"decision":"allowed"}"#.into(),
            request: "ab".repeat(32),
        }
    }

    #[test]
    fn a_row_reads_back_only_as_written() {
        let row = encode(&answer()).unwrap();
        assert_eq!(decode(&row, "k1").unwrap(), answer());
        assert!(decode(&row, "k2").unwrap_err().contains("another key"));
        for i in 0..row.len() {
            let mut flipped = row.clone();
            flipped[i] ^= 0x04;
            assert!(
                decode(&flipped, "k1").is_err(),
                "flip at byte {i} not caught"
            );
        }
        assert!(decode(&row[..row.len() - 1], "k1").is_err());
        assert!(decode(&row[..10], "k1").is_err());
    }
}
