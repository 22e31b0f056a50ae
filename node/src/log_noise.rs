//! Log lines from openraft that report, once per retry, what `peer_contacts` already
//! reports once per outage. A peer that was not up yet made a healthy start print a red
//! ERROR every few hundred milliseconds, and a follower that was down did the same on
//! the leader.

use tracing::{Level, Metadata};

/// The call sites dropped, as (module, level, line) in openraft 0.9.25, which the
/// workspace manifest pins (`=0.9.25`): a version bump must check these lines again (the
/// `dev_supervisor` test fails on an ERROR, or on more than a few WARNs, while a node is
/// down and back).
const DROPPED: [(&str, Level, u32); 11] = [
    // Confirming leadership for a linearizable read timed out on one peer.
    ("openraft::core::raft_core", Level::ERROR, 383),
    // A vote request to one peer timed out, or failed.
    ("openraft::core::raft_core", Level::ERROR, 1099),
    ("openraft::core::raft_core", Level::ERROR, 1112),
    // A vote response came after this node's vote moved on; it is ignored, correctly.
    ("openraft::core::raft_core", Level::WARN, 1553),
    // An AppendEntries to one follower failed (said twice: as a WARN, then an ERROR),
    // and the replication to it waits before the next try (every 500 ms).
    ("openraft::replication", Level::WARN, 258),
    ("openraft::replication", Level::ERROR, 284),
    ("openraft::replication", Level::WARN, 596),
    // A snapshot chunk to one follower failed (said twice), and is tried again (a node
    // stepping back from a stalled disk withholds every one: `raft_client`).
    ("openraft::network::snapshot_transport", Level::WARN, 217),
    ("openraft::replication", Level::WARN, 798),
    // The leader's progress for one follower: a failed append or heartbeat (every 50 ms).
    (
        "openraft::engine::handler::replication_handler",
        Level::WARN,
        287,
    ),
    (
        "openraft::engine::handler::replication_handler",
        Level::WARN,
        294,
    ),
];

/// Whether an event is kept (`false` drops it).
pub fn keep(meta: &Metadata<'_>) -> bool {
    !(meta.is_event()
        && DROPPED.iter().any(|(target, level, line)| {
            meta.target() == *target && meta.level() == level && meta.line() == Some(*line)
        }))
}
