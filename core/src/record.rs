//! The `lineage-audit-v1` record: its line format, content hash and signature.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::canonical::{write_str, write_value};
use crate::keys::AuditKey;

/// The domain prefix hashed before every record's canonical content.
pub const DOMAIN: &[u8] = b"lineage-audit-v1\n";
/// `prev_hash` of the genesis record.
pub const ZERO_HASH: &str = "0000000000000000000000000000000000000000000000000000000000000000";
/// The longest line a parser accepts (a record's input is bounded by the request body
/// limit; escaping can grow it, so leave generous room).
pub const MAX_RECORD_BYTES: usize = 16 * 1024 * 1024;

/// One signed record. Field order is the fixed line order of the format.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Record {
    pub seq: u64,
    pub timestamp: String,
    pub actor: String,
    pub kind: String,
    pub payload: Value,
    pub prev_hash: String,
    pub hash: String,
    pub signature: String,
}

/// A record whose line would not read back as the same record (`Record::to_checked_line`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("record does not round-trip through its line: {0}")]
pub struct RoundTripError(pub String);

/// The last record of a log, as published in checkpoints: `seq:hash`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Head {
    pub seq: u64,
    pub hash: String,
}

impl std::fmt::Display for Head {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.seq, self.hash)
    }
}

impl std::str::FromStr for Head {
    type Err = String;
    /// Parses `SEQ:HASH`.
    fn from_str(text: &str) -> Result<Self, String> {
        let (seq, hash) = text
            .trim()
            .split_once(':')
            .ok_or_else(|| format!("checkpoint must be SEQ:HASH, got {text:?}"))?;
        let seq = seq
            .parse()
            .map_err(|_| format!("checkpoint seq is not a number: {seq:?}"))?;
        if hash.len() != 64 || !hash.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(format!(
                "checkpoint hash must be 64 hex characters: {hash:?}"
            ));
        }
        Ok(Head {
            seq,
            hash: hash.to_string(),
        })
    }
}

/// The canonical text of a record's content (all fields but `hash` and `signature`),
/// with keys in sorted order: actor, kind, payload, prev_hash, seq, timestamp.
pub fn canonical_content(
    seq: u64,
    timestamp: &str,
    actor: &str,
    kind: &str,
    payload: &Value,
    prev_hash: &str,
) -> String {
    let mut out = String::with_capacity(160);
    out.push_str("{\"actor\":");
    write_str(&mut out, actor);
    out.push_str(",\"kind\":");
    write_str(&mut out, kind);
    out.push_str(",\"payload\":");
    write_value(&mut out, payload);
    out.push_str(",\"prev_hash\":");
    write_str(&mut out, prev_hash);
    out.push_str(",\"seq\":");
    out.push_str(&seq.to_string());
    out.push_str(",\"timestamp\":");
    write_str(&mut out, timestamp);
    out.push('}');
    out
}

/// SHA-256 over the domain prefix and the canonical content.
pub fn content_hash(canonical: &str) -> [u8; 32] {
    let mut hasher = Sha256::new();
    hasher.update(DOMAIN);
    hasher.update(canonical.as_bytes());
    hasher.finalize().into()
}

impl Record {
    /// Builds, hashes and signs a record.
    pub fn seal(
        key: &AuditKey,
        seq: u64,
        timestamp: String,
        actor: &str,
        kind: &str,
        payload: Value,
        prev_hash: &str,
    ) -> Record {
        let canonical = canonical_content(seq, &timestamp, actor, kind, &payload, prev_hash);
        let hash = content_hash(&canonical);
        let signature = key.sign_hash(&hash);
        Record {
            seq,
            timestamp,
            actor: actor.to_string(),
            kind: kind.to_string(),
            payload,
            prev_hash: prev_hash.to_string(),
            hash: hex::encode(hash),
            signature: hex::encode(signature),
        }
    }

    /// The hash recomputed from the content (the 32 bytes; `hex::encode` it to compare
    /// with [`Record::hash`]).
    pub fn recompute_hash(&self) -> [u8; 32] {
        content_hash(&canonical_content(
            self.seq,
            &self.timestamp,
            &self.actor,
            &self.kind,
            &self.payload,
            &self.prev_hash,
        ))
    }

    /// The record's line, without the trailing newline, in the fixed field order.
    pub fn to_line(&self) -> String {
        let mut out = String::with_capacity(400);
        out.push_str("{\"seq\":");
        out.push_str(&self.seq.to_string());
        out.push_str(",\"timestamp\":");
        write_str(&mut out, &self.timestamp);
        out.push_str(",\"actor\":");
        write_str(&mut out, &self.actor);
        out.push_str(",\"kind\":");
        write_str(&mut out, &self.kind);
        out.push_str(",\"payload\":");
        write_value(&mut out, &self.payload);
        out.push_str(",\"prev_hash\":");
        write_str(&mut out, &self.prev_hash);
        out.push_str(",\"hash\":");
        write_str(&mut out, &self.hash);
        out.push_str(",\"signature\":");
        write_str(&mut out, &self.signature);
        out.push('}');
        out
    }

    /// The record's line, checked to be a fixed point of the format: the record parsed
    /// back from it writes the same line and has the same content hash. Returns the line
    /// and that parsed record, which is what every reader of the line will hold.
    ///
    /// A record that fails was never stored or replicated: a reader would get other
    /// content than was hashed, so the record could not be verified or applied.
    pub fn to_checked_line(&self) -> Result<(String, Record), RoundTripError> {
        let line = self.to_line();
        let parsed = Record::from_line(&line)
            .map_err(|e| RoundTripError(format!("record seq {}: {e}", self.seq)))?;
        if parsed.to_line() != line {
            return Err(RoundTripError(format!(
                "record seq {}: its line does not read back as the same line",
                self.seq
            )));
        }
        if hex::encode(parsed.recompute_hash()) != self.hash {
            return Err(RoundTripError(format!(
                "record seq {}: its line reads back with another content hash",
                self.seq
            )));
        }
        Ok((line, parsed))
    }

    /// Parses one line (without its newline). Unknown fields are ignored.
    pub fn from_line(line: &str) -> Result<Record, serde_json::Error> {
        serde_json::from_str(line)
    }

    pub fn head(&self) -> Head {
        Head {
            seq: self.seq,
            hash: self.hash.clone(),
        }
    }
}

/// Checks that `records` extend a log whose next seq is `next_seq` and whose head hash
/// is `head_hash` (`ZERO_HASH` when empty): consecutive seq, `prev_hash` equal to the
/// previous hash, recomputed hash equal to the stored one, and `actor` equal to
/// `log_id`. Changes nothing; apply runs it before folding anything in.
pub fn check_chain<R: std::borrow::Borrow<Record>>(
    next_seq: u64,
    head_hash: &str,
    log_id: &str,
    records: &[R],
) -> Result<(), String> {
    if records.is_empty() {
        return Err("no records".into());
    }
    let mut prev = head_hash;
    for (expected_seq, record) in (next_seq..).zip(records) {
        let record: &Record = record.borrow();
        if record.seq != expected_seq {
            return Err(format!(
                "record seq {} does not extend head (expected {expected_seq})",
                record.seq
            ));
        }
        if record.prev_hash != prev {
            return Err(format!(
                "record seq {}: prev_hash does not match head",
                record.seq
            ));
        }
        if hex::encode(record.recompute_hash()) != record.hash {
            return Err(format!(
                "record seq {}: hash does not match content",
                record.seq
            ));
        }
        if record.actor != log_id {
            return Err(format!(
                "record seq {}: actor is not the log's id",
                record.seq
            ));
        }
        prev = &record.hash;
    }
    Ok(())
}

/// Record timestamps: UTC RFC 3339 with exactly six fractional digits and `Z`.
pub mod timestamp {
    use chrono::{DateTime, SecondsFormat, Utc};

    /// The current time in microseconds since the Unix epoch.
    pub fn now_micros() -> i64 {
        Utc::now().timestamp_micros()
    }

    /// Formats microseconds since the epoch as a record timestamp.
    pub fn format(micros: i64) -> String {
        DateTime::<Utc>::from_timestamp_micros(micros)
            .unwrap_or_default()
            .to_rfc3339_opts(SecondsFormat::Micros, true)
    }

    /// Parses any RFC 3339 timestamp into microseconds since the epoch.
    pub fn parse(text: &str) -> Option<i64> {
        DateTime::parse_from_rfc3339(text)
            .ok()
            .map(|t| t.with_timezone(&Utc).timestamp_micros())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn line_round_trips_and_keeps_field_order() {
        let key = AuditKey::from_seed([7; 32]);
        let record = Record::seal(
            &key,
            0,
            timestamp::format(1_700_000_000_123_456),
            "bot",
            "genesis",
            json!({"public_key": key.public_key_hex(), "log_id": "bot"}),
            ZERO_HASH,
        );
        let line = record.to_line();
        assert!(line.starts_with(r#"{"seq":0,"timestamp":"2023-11-14T22:13:20.123456Z","actor":"bot","kind":"genesis","payload":{"log_id":"bot","public_key":""#));
        let parsed = Record::from_line(&line).unwrap();
        assert_eq!(parsed, record);
        assert_eq!(hex::encode(parsed.recompute_hash()), record.hash);
        // serde's own serialisation keeps the same order (struct field order).
        assert_eq!(serde_json::to_string(&record).unwrap(), line);
    }

    #[test]
    fn timestamps_have_six_digits() {
        assert_eq!(timestamp::format(0), "1970-01-01T00:00:00.000000Z");
        let micros = timestamp::parse("2026-11-29T22:12:03.940519Z").unwrap();
        assert_eq!(timestamp::format(micros), "2026-11-29T22:12:03.940519Z");
    }

    #[test]
    fn head_parses_seq_colon_hash() {
        let head: Head = format!("3:{}", "ab".repeat(32)).parse().unwrap();
        assert_eq!(head.seq, 3);
        assert!("3".parse::<Head>().is_err());
        assert!("x:ab".parse::<Head>().is_err());
        // Both the length and the digits are checked, each on its own.
        assert!(format!("3:{}", "zz".repeat(32)).parse::<Head>().is_err());
        assert!(format!("3:{}", "ab".repeat(31)).parse::<Head>().is_err());
        // Written as it is read.
        assert_eq!(head.to_string(), format!("3:{}", "ab".repeat(32)));
        assert_eq!(head.to_string().parse::<Head>().unwrap(), head);
    }

    #[test]
    fn the_clock_reads_the_time_of_day() {
        let now = timestamp::now_micros();
        let system = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_micros() as i64;
        assert!((now - system).abs() < 60_000_000, "{now} vs {system}");
    }

    #[test]
    fn a_record_far_larger_than_a_page_still_verifies() {
        // Bounded at MAX_RECORD_BYTES (16 MiB), not at some smaller size.
        let key = AuditKey::from_seed([7; 32]);
        let genesis = Record::seal(
            &key,
            0,
            timestamp::format(1),
            "bot",
            "genesis",
            json!({"public_key": key.public_key_hex(), "log_id": "bot"}),
            ZERO_HASH,
        );
        let big = Record::seal(
            &key,
            1,
            timestamp::format(2),
            "bot",
            "note",
            json!({"text": "x".repeat(1 << 20)}),
            &genesis.hash,
        );
        let text = format!("{}\n{}\n", genesis.to_line(), big.to_line());
        let report = crate::verify_reader(
            text.as_bytes(),
            &crate::VerifyOptions {
                public_key: Some(key.public_key_hex().to_string()),
                checkpoint: None,
            },
        );
        assert!(report.ok, "{report:?}");
    }
}
