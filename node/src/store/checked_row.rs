//! Rows that carry their own checksum: 32 bytes of SHA-256 over the rest, then the
//! content. redb keeps a crashed commit out, but not a byte that changed on disk later;
//! rows whose loss or change could refund budget or repeat a decision (stored idempotent
//! answers, agent checkpoints) are read back only if the checksum still matches.

use sha2::{Digest, Sha256};

const DIGEST_BYTES: usize = 32;

/// The row stored for `content`.
pub fn seal(content: &[u8]) -> Vec<u8> {
    let mut row = Vec::with_capacity(DIGEST_BYTES + content.len());
    row.extend_from_slice(&Sha256::digest(content));
    row.extend_from_slice(content);
    row
}

/// The content of a row read back, if its checksum matches.
pub fn unseal(row: &[u8]) -> Result<&[u8], String> {
    if row.len() < DIGEST_BYTES {
        return Err(format!("stored row is {} bytes, too short", row.len()));
    }
    let (digest, content) = row.split_at(DIGEST_BYTES);
    if Sha256::digest(content).as_slice() != digest {
        return Err("stored row does not match its checksum".into());
    }
    Ok(content)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_changed_byte_is_caught() {
        let row = seal(br#"{"spent":90}"#);
        assert_eq!(unseal(&row).unwrap(), br#"{"spent":90}"#);
        for i in 0..row.len() {
            let mut flipped = row.clone();
            flipped[i] ^= 0x04;
            assert!(unseal(&flipped).is_err(), "flip at byte {i} not caught");
        }
        assert!(unseal(&row[..row.len() - 1]).is_err());
        assert!(unseal(&row[..10]).is_err());
    }
}
