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

/// The value stored beside a key that is all the row holds (an index entry, a size): the
/// SHA-256 of the key's bytes, so that a key changed on disk no longer matches its value.
pub fn key_seal(key: &[u8]) -> [u8; DIGEST_BYTES] {
    Sha256::digest(key).into()
}

/// Whether `stored` is [`key_seal`] of `key`.
pub fn check_key_seal(key: &[u8], stored: &[u8]) -> Result<(), String> {
    if stored.len() != DIGEST_BYTES {
        return Err(format!(
            "stored key checksum is {} bytes, not {DIGEST_BYTES}",
            stored.len()
        ));
    }
    if key_seal(key).as_slice() != stored {
        return Err("stored key does not match its checksum".into());
    }
    Ok(())
}

/// A row for a table of text: the hex SHA-256 of `content`, then `content`.
pub fn seal_text(content: &str) -> String {
    let mut row = hex::encode(Sha256::digest(content.as_bytes()));
    row.push_str(content);
    row
}

/// The content of a row written by [`seal_text`], if its checksum still matches.
pub fn unseal_text(row: &str) -> Result<&str, String> {
    let hex_bytes = DIGEST_BYTES * 2;
    let (Some(digest), Some(content)) = (row.get(..hex_bytes), row.get(hex_bytes..)) else {
        return Err(format!("stored row is {} bytes, too short", row.len()));
    };
    if hex::encode(Sha256::digest(content.as_bytes())) != digest {
        return Err("stored row does not match its checksum".into());
    }
    Ok(content)
}

/// The value in a row written by [`seal`] over its JSON. A row written before rows were
/// sealed is plain JSON; it is still read (unprotected, and rewritten sealed by the next
/// write). Anything else is an error, never "no value".
pub fn unseal_json<T: serde::de::DeserializeOwned>(row: &[u8]) -> Result<T, String> {
    match unseal(row) {
        Ok(json) => serde_json::from_slice(json).map_err(|e| format!("stored row: {e}")),
        // A sealed row parses as JSON only if its 32 digest bytes happen to be JSON text
        // that the rest completes: not a case that occurs.
        Err(unsealed) => serde_json::from_slice(row)
            .map_err(|e| format!("{unsealed}, and not an older unsealed row: {e}")),
    }
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

    #[test]
    fn every_changed_bit_of_a_key_or_its_seal_is_caught() {
        let key = b"agent-7\0\0\0\0\0\0\0\x01\x2c";
        let seal = key_seal(key);
        check_key_seal(key, &seal).unwrap();
        for bit in 0..key.len() * 8 {
            let mut flipped = key.to_vec();
            flipped[bit / 8] ^= 1 << (bit % 8);
            assert!(check_key_seal(&flipped, &seal).is_err(), "key bit {bit}");
        }
        for bit in 0..seal.len() * 8 {
            let mut flipped = seal;
            flipped[bit / 8] ^= 1 << (bit % 8);
            assert!(check_key_seal(key, &flipped).is_err(), "seal bit {bit}");
        }
        assert!(check_key_seal(key, &seal[..31]).is_err());
        assert!(check_key_seal(key, &[]).is_err());
    }

    #[test]
    fn every_changed_bit_of_a_text_row_is_caught() {
        let row = seal_text(r#"{"agent_id":"a","size":3}"#);
        assert_eq!(unseal_text(&row).unwrap(), r#"{"agent_id":"a","size":3}"#);
        for i in 0..row.len() {
            for bit in 0..7 {
                let mut bytes = row.clone().into_bytes();
                bytes[i] ^= 1 << bit;
                // A flip that leaves the row valid UTF-8 must still be caught.
                if let Ok(flipped) = String::from_utf8(bytes) {
                    assert!(unseal_text(&flipped).is_err(), "flip {bit} at byte {i}");
                }
            }
        }
        assert!(unseal_text(&row[..row.len() - 1]).is_err());
        assert!(unseal_text(&row[..40]).is_err());
    }

    #[test]
    fn json_rows_read_sealed_or_as_older_plain_json_and_nothing_else() {
        let row = seal(br#"{"index":7}"#);
        let value: serde_json::Value = unseal_json(&row).unwrap();
        assert_eq!(value["index"], 7);
        let older: serde_json::Value = unseal_json(br#"{"index":7}"#).unwrap();
        assert_eq!(older, value);
        for i in 0..row.len() {
            let mut flipped = row.clone();
            flipped[i] ^= 0x01;
            assert!(
                unseal_json::<serde_json::Value>(&flipped).is_err(),
                "flip at {i}"
            );
        }
        assert!(unseal_json::<serde_json::Value>(&row[..row.len() - 3]).is_err());
    }
}
