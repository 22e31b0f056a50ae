//! The `idempotency` table's rows: a stored answer as JSON in a checksummed row
//! (`checked_row`). A changed answer is an error (the API answers 503), never a wrong
//! decision and never "no answer, decide again".
//!
//! Rows written before answers were checksummed are plain JSON; they are still read
//! (`checked_row::unseal_json`), so an upgrade keeps every stored answer.

use redb::TableDefinition;

use super::checked_row;
use crate::raft_types::IdempotentAnswer;

/// "agent_id\n scoped key" → an answer with its checksum; kept for a window
/// (`idempotency_expiry`).
pub const IDEMPOTENCY: TableDefinition<&str, &[u8]> = TableDefinition::new("idempotency");

/// What a snapshot carries for a row that cannot be read back: an answer that refuses
/// (503), so a retry under that key is refused on every node rather than decided again.
pub fn damaged(scoped_key: &str, reason: &str) -> IdempotentAnswer {
    IdempotentAnswer {
        key: scoped_key.to_string(),
        status: 503,
        body: serde_json::json!({
            "code": "unavailable",
            "error": format!("the answer stored under this Idempotency-Key was damaged: {reason}"),
        })
        .to_string(),
        request: String::new(),
    }
}

/// The row stored for `answer`.
pub fn encode(answer: &IdempotentAnswer) -> Result<Vec<u8>, serde_json::Error> {
    Ok(checked_row::seal(&serde_json::to_vec(answer)?))
}

/// The answer in a row read back under `scoped_key`, checked: its checksum, its JSON,
/// and that it was stored under that key.
pub fn decode(row: &[u8], scoped_key: &str) -> Result<IdempotentAnswer, String> {
    let answer: IdempotentAnswer =
        checked_row::unseal_json(row).map_err(|e| format!("stored answer: {e}"))?;
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

    #[test]
    fn a_row_from_before_checksums_still_reads() {
        let legacy = br#"{"key":"k1","status":200,"body":"{}"}"#;
        let answer = decode(legacy, "k1").unwrap();
        assert_eq!((answer.status, answer.request.as_str()), (200, ""));
        assert!(decode(legacy, "k2").is_err());
        assert!(decode(br#"{"key":"k1","sta"#, "k1").is_err());
    }
}
