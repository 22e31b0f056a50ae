//! The repair floor: what a node keeps, durably, after its Raft log was found damaged
//! below its watermark (or its watermark or vote was lost). Such a node may have
//! acknowledged entries it no longer holds, so its copy cannot be trusted to decide who
//! is up to date. Until its log passes the floor again (repaired by normal replication or
//! a snapshot from a leader) it does not campaign, refuses its vote to any candidate whose
//! log is behind the floor, and serves no reads. It is repaired, not trusted and not
//! stopped: a corrupted block does not turn into an operator call or a crash loop.
//!
//! The file (`raft-log/repair-floor.json`) is written, atomically and durably, before the
//! damaged part of the log is cut, and removed once the log passes it: a crash at any step
//! finds the floor again (or, after the removal, a log that passed it).

use std::io;
use std::path::Path;

use openraft::LogId;
use serde::{Deserialize, Serialize};

use super::log_store::{remove_file, sync_dir, write_json_file};
use crate::raft_types::NodeId;

pub const FLOOR_FILE: &str = "repair-floor.json";

type Id = LogId<NodeId>;

/// How far the log must reach again before the node takes part in elections.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Floor {
    /// The last entry this node had acknowledged (its watermark).
    Entry(Id),
    /// Not known (the watermark or the vote was lost): the node votes for nobody until it
    /// holds everything a leader tells it is committed.
    Unknown,
}

impl Floor {
    /// The stricter of two floors.
    pub fn max(self, other: Floor) -> Floor {
        match (self, other) {
            (Floor::Unknown, _) | (_, Floor::Unknown) => Floor::Unknown,
            (Floor::Entry(a), Floor::Entry(b)) => Floor::Entry(a.max(b)),
        }
    }

    /// Whether a log whose last entry is `last` has passed this floor.
    pub fn passed_by(&self, last: Option<Id>) -> bool {
        match self {
            Floor::Entry(floor) => last.is_some_and(|last| last >= *floor),
            Floor::Unknown => false,
        }
    }

    /// Whether a candidate whose log ends at `last` may get this node's vote.
    pub fn allows_candidate(&self, last: Option<Id>) -> bool {
        self.passed_by(last)
    }
}

/// A floor and why it was set, as stored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RepairFloor {
    pub floor: Floor,
    pub reason: String,
}

/// The floor stored in `dir`, if any.
pub fn read(dir: &Path) -> Result<Option<RepairFloor>, String> {
    let path = dir.join(FLOOR_FILE);
    match std::fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            // A damaged floor file is still a floor: the strictest one.
            .or_else(|e| {
                Ok(Some(RepairFloor {
                    floor: Floor::Unknown,
                    reason: format!("{} is unreadable: {e}", path.display()),
                }))
            }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("cannot read {}: {e}", path.display())),
    }
}

/// Stores `floor` in `dir`, replacing any earlier one, durably.
pub fn write(dir: &Path, floor: &RepairFloor) -> io::Result<()> {
    write_json_file(dir, FLOOR_FILE, floor)
}

/// Removes the floor from `dir`, durably.
pub fn clear(dir: &Path) -> io::Result<()> {
    remove_file(&dir.join(FLOOR_FILE))?;
    sync_dir(dir)
}

#[cfg(test)]
mod tests {
    use super::*;
    use openraft::CommittedLeaderId;

    fn id(term: u64, index: u64) -> Id {
        LogId::new(CommittedLeaderId::new(term, 1), index)
    }

    #[test]
    fn a_floor_is_passed_by_a_log_at_least_as_up_to_date() {
        let floor = Floor::Entry(id(2, 95));
        assert!(!floor.passed_by(None));
        assert!(!floor.passed_by(Some(id(2, 94))));
        assert!(floor.passed_by(Some(id(2, 95))));
        // A later term is more up to date whatever its length (Raft's order).
        assert!(floor.passed_by(Some(id(3, 40))));
        assert!(!floor.passed_by(Some(id(1, 200))));
        assert!(!Floor::Unknown.passed_by(Some(id(9, 9))));
        assert_eq!(floor.max(Floor::Entry(id(2, 96))), Floor::Entry(id(2, 96)));
        assert_eq!(floor.max(Floor::Unknown), Floor::Unknown);
    }

    #[test]
    fn the_floor_file_survives_reopen_and_a_damaged_one_is_the_strictest() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(read(dir.path()).unwrap(), None);
        let floor = RepairFloor {
            floor: Floor::Entry(id(2, 95)),
            reason: "test".into(),
        };
        write(dir.path(), &floor).unwrap();
        assert_eq!(read(dir.path()).unwrap(), Some(floor));
        std::fs::write(dir.path().join(FLOOR_FILE), b"{not json").unwrap();
        assert_eq!(read(dir.path()).unwrap().unwrap().floor, Floor::Unknown);
        clear(dir.path()).unwrap();
        assert_eq!(read(dir.path()).unwrap(), None);
    }
}
