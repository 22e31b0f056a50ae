//! The Raft type configuration: one kind of application entry, a batch of "append these
//! signed records to this agent's log".

use std::io::Cursor;
use std::sync::Arc;

use lineage_core::Record;
use serde::{Deserialize, Serialize};

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
}

/// One outcome per write of a batch, in order.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct BatchOutcome(pub Vec<ApplyOutcome>);

/// A write: records that extend one agent's log, and optionally the answer to
/// remember under an idempotency key so a retry returns it without appending again.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AppendRecords {
    pub agent_id: String,
    pub records: Vec<Record>,
    pub idempotency: Option<IdempotentAnswer>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct IdempotentAnswer {
    pub key: String,
    /// The HTTP status and JSON body first returned.
    pub status: u16,
    pub body: String,
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
        SnapshotData = Cursor<Vec<u8>>,
);

pub type Raft = openraft::Raft<TypeConfig>;
pub type StorageError = openraft::StorageError<NodeId>;
