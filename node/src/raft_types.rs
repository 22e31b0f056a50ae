//! The Raft type configuration and its four kinds of application entry
//! ([`Proposal`]): a batch of "append these signed records to this agent's log"
//! (group commit), a heads-log round, a witnessed checkpoint to store, and an operator
//! change for the system log.

use std::borrow::Cow;
use std::sync::Arc;

use lineage_core::record::RoundTripError;
use lineage_core::Record;
use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::value::RawValue;

pub type NodeId = u64;

/// One Raft entry: the writes of many agents, decided concurrently by the leader and
/// committed together (group commit). Shared, because openraft clones an entry for every
/// follower it sends it to and the log keeps recent entries in memory; on the wire it is
/// the plain list.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Batch(pub Arc<Vec<AppendRecords>>);

/// What a Raft entry asks the state machine to do.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Proposal {
    /// Agents' records, many agents per entry (group commit).
    Writes(Batch),
    /// A heads-log round: a head statement for every agent whose log grew since its
    /// last statement, built by each node from its own applied state. `origin` names
    /// the heads log the first time.
    HeadsRound { origin: String },
    /// A cosigned heads checkpoint, kept for auditors to fetch.
    Witnessed { note: String },
    /// Signed records that extend the system log (operator changes,
    /// `lineage_core::operators`).
    System { records: Vec<RecordLine> },
    /// A step of importing one agent's log from a reference guard (`store::imports`).
    Import(ImportStep),
}

/// What an import says it brings, recorded when it begins.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImportManifest {
    /// The hash of the source log's genesis record.
    pub genesis_hash: String,
    /// SHA-256 of the source file as it was read.
    pub source_sha256: String,
    /// The head the source ends with: the commit must be at it, so a shorter copy of
    /// the file cannot finish an import begun from the whole one.
    #[serde(default)]
    pub head: Option<lineage_core::Head>,
}

/// The steps of importing one agent (`store::imports`): begin, its records in order
/// (each entry at most `MAX_IMPORT_BATCH_BYTES` of lines), then commit at the head the
/// source ends with, with the termination record the reference would have added on
/// opening the log, if one is missing (sealed by the leader).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum ImportStep {
    Begin {
        agent_id: String,
        manifest: ImportManifest,
    },
    Records {
        agent_id: String,
        records: Vec<RecordLine>,
    },
    Commit {
        agent_id: String,
        head: lineage_core::Head,
        sealed: Vec<RecordLine>,
    },
    /// An import given up by an admin (a wrong file begun, a record too large to
    /// send): its records so far are deleted on every node and the id is free again.
    Abort { agent_id: String },
    /// A source log that failed verification: nothing of it is imported (its verified
    /// prefix would refund the agent), and its id stays reserved for good.
    Tombstone {
        agent_id: String,
        tombstone: Tombstone,
    },
}

/// Why an agent id is reserved for good: its reference log failed verification.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tombstone {
    pub reason: String,
    /// SHA-256 of the source file, so the evidence kept elsewhere can be matched.
    pub source_sha256: String,
}

/// The most record bytes one import entry carries.
pub const MAX_IMPORT_BATCH_BYTES: usize = 128 * 1024;

impl ImportStep {
    pub fn agent_id(&self) -> &str {
        match self {
            ImportStep::Begin { agent_id, .. }
            | ImportStep::Records { agent_id, .. }
            | ImportStep::Commit { agent_id, .. }
            | ImportStep::Abort { agent_id }
            | ImportStep::Tombstone { agent_id, .. } => agent_id,
        }
    }
}

/// One outcome per write of a batch, in order.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct BatchOutcome(pub Vec<ApplyOutcome>);

/// A write: records that extend one agent's log, and optionally the answer to
/// remember under an idempotency key so a retry returns it without appending again.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AppendRecords {
    pub agent_id: String,
    pub records: Vec<RecordLine>,
    pub idempotency: Option<IdempotentAnswer>,
    /// Who the leader let make this write, checked again at apply against the system
    /// log as replicated up to the entry (`None`: the shared admin token, or an entry
    /// from before this was recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub authority: Option<Authority>,
}

/// Who a write was authorized as. A leader checks tokens against the system log it has
/// applied, which may be behind what is committed (a new leader applies its
/// predecessor's last entries only after its own first one commits): a revocation or a
/// reissue committed before the write would be missed. Apply checks again, in log
/// order, and rejects the write if the operator was revoked or the agent's token is of
/// another generation by then.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Authority {
    /// A named operator.
    Operator(String),
    /// The agent itself, with a token of this generation.
    AgentGeneration(u64),
}

impl Authority {
    /// Why `operators` (the system log's state at this entry) no longer allows it.
    pub fn revoked(
        &self,
        operators: &lineage_core::operators::Operators,
        agent_id: &str,
    ) -> Option<String> {
        match self {
            Authority::Operator(name) => (!operators.get(name).is_some_and(|o| o.is_active()))
                .then(|| format!("operator {name} was revoked before this write")),
            Authority::AgentGeneration(generation) => {
                let current = operators.token_generation(agent_id);
                (*generation != current).then(|| {
                    format!("the agent's token of generation {generation} was replaced by generation {current}")
                })
            }
        }
    }
}

impl AppendRecords {
    /// About how many bytes this write takes in a Raft entry.
    pub fn size(&self) -> usize {
        const FRAMING: usize = 64;
        FRAMING
            + self.agent_id.len()
            + self.records.iter().map(|r| r.line().len()).sum::<usize>()
            + self
                .idempotency
                .as_ref()
                .map_or(0, |a| a.key.len() + a.body.len())
    }
}

/// A sealed record and its line. The leader makes the line once, when it seals; Raft
/// messages, every node's Raft log and every node's store then carry those same bytes,
/// with no encoding on the way (the line is written out as raw JSON). On the wire it
/// is the record object, as it always was.
///
/// A line that arrives (in an AppendEntries, or read back from the Raft log) is only
/// checked to be one JSON object on one line; it is parsed into a record when it is
/// applied. So a follower makes an entry durable and answers its leader without
/// parsing the records first (that parse was ~15% of a follower's append on the
/// replication round trip), and the decoded records it keeps for replication are just
/// lines.
#[derive(Clone, Debug)]
pub struct RecordLine {
    line: Box<RawValue>,
    /// The record parsed back from `line`, there on the leader that sealed it. Every
    /// node, this one included, applies the record its line reads back as, never the
    /// one the leader held before writing the line. Boxed: a `Record` is 184 bytes
    /// inline, which every line read from the log or a peer (`None`) would carry too.
    parsed: Option<Box<Record>>,
}

impl RecordLine {
    /// The line of a record sealed here. A record whose line would not read back as the
    /// same record is refused here, before it can be proposed.
    pub fn new(record: Record) -> Result<Self, RoundTripError> {
        let (line, parsed) = record.to_checked_line()?;
        let line = RawValue::from_string(line)
            .map_err(|e| RoundTripError(format!("record seq {}: {e}", record.seq)))?;
        Ok(RecordLine {
            line,
            parsed: Some(Box::new(parsed)),
        })
    }

    /// The record its line reads back as: parsed when sealed here, or now. Every node
    /// parses the same bytes, so a line that is not a record fails alike everywhere.
    pub fn record(&self) -> Result<Cow<'_, Record>, String> {
        match &self.parsed {
            Some(record) => Ok(Cow::Borrowed(record.as_ref())),
            None => Record::from_line(self.line.get())
                .map(Cow::Owned)
                .map_err(|e| format!("not a record: {e}")),
        }
    }

    /// The line as stored, without its newline.
    pub fn line(&self) -> &str {
        self.line.get()
    }
}

impl PartialEq for RecordLine {
    fn eq(&self, other: &Self) -> bool {
        self.line.get() == other.line.get()
    }
}

impl Serialize for RecordLine {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.line.serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for RecordLine {
    /// Keeps the bytes received as the line, so they must be one line: JSON strings
    /// cannot hold a raw newline, but the whitespace between tokens can. The record in
    /// it is parsed when it is applied (`record`).
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let line = Box::<RawValue>::deserialize(deserializer)?;
        if line.get().contains(['\n', '\r']) {
            return Err(D::Error::custom(
                "a record line must not contain a line break",
            ));
        }
        if !line.get().starts_with('{') {
            return Err(D::Error::custom("a record line must be a JSON object"));
        }
        Ok(RecordLine { line, parsed: None })
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct IdempotentAnswer {
    /// The key in its caller's namespace (`api::idempotency::IdempotencyKey::scoped`).
    pub key: String,
    /// The HTTP status and JSON body first returned.
    pub status: u16,
    pub body: String,
    /// Digest of the request first sent with the key; only the same request gets this
    /// answer back. Empty in entries written before keys were bound to requests.
    #[serde(default)]
    pub request: String,
}

/// The result of applying one entry. Apply is deterministic: every node reports the same.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum ApplyOutcome {
    Applied,
    /// The records did not extend the agent's head (a stale leader decided them); nothing
    /// changed.
    Rejected(String),
}

openraft::declare_raft_types!(
    pub TypeConfig:
        D = Proposal,
        R = BatchOutcome,
        NodeId = NodeId,
        Node = openraft::BasicNode,
        // A spool file, so no snapshot is held in memory whole, and written off the
        // state machine's task (`snapshot_spool`).
        SnapshotData = crate::snapshot_spool::SnapshotSpool,
);

pub type Raft = openraft::Raft<TypeConfig>;
pub type StorageError = openraft::StorageError<NodeId>;

#[cfg(test)]
mod tests {
    use super::*;
    use lineage_core::record::ZERO_HASH;
    use lineage_core::AuditKey;
    use serde_json::json;

    fn record() -> Record {
        let key = AuditKey::generate().unwrap();
        Record::seal(
            &key,
            0,
            "2026-11-30T12:00:00.000000Z".into(),
            "bot",
            "genesis",
            json!({"note": "line\nbreak \"quoted\"", "n": 1.5}),
            ZERO_HASH,
        )
    }

    #[test]
    fn a_record_line_travels_as_the_record_object_and_keeps_its_bytes() {
        let record = record();
        let line = RecordLine::new(record.clone()).unwrap();
        assert_eq!(line.line(), record.to_line());
        // The same JSON as the record itself, so Raft logs written before keep decoding.
        let encoded = serde_json::to_string(&line).unwrap();
        assert_eq!(encoded, serde_json::to_string(&record).unwrap());
        let decoded: RecordLine = serde_json::from_str(&encoded).unwrap();
        assert_eq!(decoded.record().unwrap().as_ref(), &record);
        assert_eq!(decoded.line(), record.to_line());
        assert_eq!(line.record().unwrap().as_ref(), &record);
    }

    #[test]
    fn a_line_without_its_parsed_record_costs_only_pointers() {
        // Raft entries kept for replication hold their lines; a parsed record inline
        // would add its whole size to every one of them, parsed or not.
        let line = std::mem::size_of::<RecordLine>();
        assert!(
            line <= 3 * std::mem::size_of::<usize>(),
            "RecordLine is {line} bytes; a Record is {}",
            std::mem::size_of::<Record>()
        );
    }

    #[test]
    fn a_received_line_with_a_line_break_between_tokens_is_refused() {
        let record = record();
        let spaced = record
            .to_line()
            .replacen(",\"timestamp\"", ",\n\"timestamp\"", 1);
        let error = serde_json::from_str::<RecordLine>(&spaced).unwrap_err();
        assert!(error.to_string().contains("line break"), "{error}");
        // Not an object: refused on arrival. An object that is not a record arrives,
        // and fails (alike on every node) when it is applied.
        assert!(serde_json::from_str::<RecordLine>("[1]").is_err());
        let not_a_record: RecordLine = serde_json::from_str("{\"seq\":1}").unwrap();
        assert!(not_a_record.record().unwrap_err().contains("not a record"));
    }
}
