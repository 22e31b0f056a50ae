//! The durable writes a node has in flight, and since when: the Raft log writer's group
//! commit and the state machine writer's redb commit. A write that does not come back
//! (a hung disk, a frozen or stalled volume) is what `disk_stall` watches for.
//!
//! Each kind of write has one writer thread, so each has one slot: set when its write
//! starts, cleared when it returns, with or without an error.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The writes watched, one thread each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DiskWrite {
    /// A group commit of the Raft log (write and fdatasync), a truncation, a purge or a
    /// saved vote.
    RaftLog,
    /// A commit of the state machine's rows to its redb file.
    StateFile,
}

impl DiskWrite {
    const ALL: [DiskWrite; 2] = [DiskWrite::RaftLog, DiskWrite::StateFile];

    pub fn name(self) -> &'static str {
        match self {
            DiskWrite::RaftLog => "raft_log",
            DiskWrite::StateFile => "state_file",
        }
    }

    fn slot(self) -> usize {
        self as usize
    }
}

pub struct DiskWatch {
    epoch: Instant,
    /// Per kind of write: when the one in flight started, in milliseconds after `epoch`
    /// plus one; 0 when none is.
    started: [AtomicU64; 2],
    /// Set by `disk_stall` while it holds the disk for stalled.
    stalled: AtomicBool,
}

impl Default for DiskWatch {
    fn default() -> Self {
        DiskWatch {
            epoch: Instant::now(),
            started: [AtomicU64::new(0), AtomicU64::new(0)],
            stalled: AtomicBool::new(false),
        }
    }
}

impl DiskWatch {
    /// A write of this kind starts; it counts as in flight until the guard is dropped.
    pub fn writing(&self, which: DiskWrite) -> Writing<'_> {
        let now = self.epoch.elapsed().as_millis() as u64 + 1;
        self.started[which.slot()].store(now, Ordering::Release);
        Writing { watch: self, which }
    }

    /// The write in flight the longest, and for how long.
    pub fn oldest(&self) -> Option<(DiskWrite, Duration)> {
        let now = self.epoch.elapsed().as_millis() as u64 + 1;
        DiskWrite::ALL
            .into_iter()
            .filter_map(|which| {
                let started = self.started[which.slot()].load(Ordering::Acquire);
                (started != 0).then(|| (which, Duration::from_millis(now.saturating_sub(started))))
            })
            .max_by_key(|(_, age)| *age)
    }

    /// Whether `disk_stall` holds this node's disk for stalled.
    pub fn stalled(&self) -> bool {
        self.stalled.load(Ordering::Acquire)
    }

    pub(crate) fn set_stalled(&self, stalled: bool) {
        self.stalled.store(stalled, Ordering::Release);
    }
}

/// One write in flight (`DiskWatch::writing`).
pub struct Writing<'a> {
    watch: &'a DiskWatch,
    which: DiskWrite,
}

impl Drop for Writing<'_> {
    fn drop(&mut self) {
        self.watch.started[self.which.slot()].store(0, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_is_in_flight_until_its_guard_is_dropped() {
        let watch = DiskWatch::default();
        assert_eq!(watch.oldest(), None);
        let log = watch.writing(DiskWrite::RaftLog);
        std::thread::sleep(Duration::from_millis(20));
        let state = watch.writing(DiskWrite::StateFile);
        let (which, age) = watch.oldest().expect("in flight");
        assert_eq!(which, DiskWrite::RaftLog, "the older of the two");
        assert!(age >= Duration::from_millis(20), "{age:?}");
        drop(log);
        assert_eq!(watch.oldest().map(|(w, _)| w), Some(DiskWrite::StateFile));
        drop(state);
        assert_eq!(watch.oldest(), None);
    }
}
