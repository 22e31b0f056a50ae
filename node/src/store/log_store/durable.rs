//! The gates that keep the leader's early acknowledgement from being seen (module docs
//! of `log_store`): what is on this node's disk.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::super::repair_floor::{Floor, RepairFloor};
use super::writer::clear_floor;
use super::{Id, LogIndex, Shared};

/// What is on this node's disk, for the gates that keep the leader's early
/// acknowledgement from being seen (module docs).
#[derive(Clone)]
pub struct DurableLog(pub(super) Arc<Shared>);

/// Whether `log_id` is on disk (or was purged after a snapshot); false while it is
/// still pending, an error when the log holds another entry there or none.
fn durable_in(index: &LogIndex, log_id: Id) -> Result<bool, String> {
    if index.last_purged.is_some_and(|p| p.index >= log_id.index) {
        return Ok(true);
    }
    let durable_first = index.durable.front().map(|f| f.log_id.index);
    let position = durable_first.and_then(|first| log_id.index.checked_sub(first));
    if let Some(frame) = position.and_then(|p| index.durable.get(p as usize)) {
        return if frame.log_id == log_id {
            Ok(true)
        } else {
            Err(format!(
                "the log holds {} instead of {log_id}",
                frame.log_id
            ))
        };
    }
    if index.pending.iter().any(|e| e.log_id == log_id) {
        Ok(false)
    } else {
        Err(format!("the log does not hold {log_id}"))
    }
}

impl DurableLog {
    /// Blocks until entry `log_id` is on disk (or was purged after a snapshot). Errors when
    /// the log failed, its writer stopped, or it no longer holds the entry. A slow disk
    /// only makes this wait longer.
    pub fn wait_durable(&self, log_id: Id) -> Result<(), String> {
        let mut index = self.0.lock();
        loop {
            if durable_in(&index, log_id)? {
                return Ok(());
            }
            index.check().map_err(|e| e.to_string())?;
            if !self.0.writer_running.load(Ordering::Acquire) {
                return Err("the raft log writer has stopped".into());
            }
            // Woken by every flush; the timeout only re-checks that the writer runs.
            index = self
                .0
                .flushed
                .wait_timeout(index, std::time::Duration::from_secs(1))
                .map(|(guard, _)| guard)
                .unwrap_or_else(|p| p.into_inner().0);
        }
    }

    /// The repair floor while this node may have lost acknowledged entries (`repair_floor`).
    pub fn repair_floor(&self) -> Option<RepairFloor> {
        self.0.lock().floor.clone()
    }

    /// Called after a leader's AppendEntries succeeded: a floor of unknown height is
    /// cleared once this node holds, durably, everything that leader says is committed
    /// (an entry a quorum holds is in every later leader's log; this node now has them).
    pub fn caught_up_with(&self, leader_commit: Option<Id>) -> Result<(), String> {
        let Some(committed) = leader_commit else {
            return Ok(());
        };
        let mut log = self.0.lock();
        let unknown = log
            .floor
            .as_ref()
            .is_some_and(|f| f.floor == Floor::Unknown);
        if unknown && durable_in(&log, committed).unwrap_or(false) {
            clear_floor(&self.0, &mut log)?;
        }
        Ok(())
    }

    /// Whether entry `log_id` is on disk now, without waiting; errors as `wait_durable`.
    pub fn is_durable(&self, log_id: Id) -> Result<bool, String> {
        durable_in(&self.0.lock(), log_id)
    }

    /// `committed`, or the last durable entry if that is earlier: what followers may hear
    /// is committed.
    pub fn clamp_commit(&self, committed: Option<Id>) -> Option<Id> {
        let durable = self.0.lock().last_durable();
        match (committed, durable) {
            (Some(c), Some(d)) if d.index < c.index => Some(d),
            (Some(_), None) => None,
            (c, _) => c,
        }
    }
}
