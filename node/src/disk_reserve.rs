//! Admission control for disk space: a full disk refuses new writes up front instead of
//! failing them half-way. The leader checks the free space of its data directory against
//! a reserve before it seals anything; below the reserve a write is answered 507
//! `insufficient_storage` with nothing sealed or proposed, and the node serves again by
//! itself as soon as space returns. The reserve leaves room for what is already under way
//! (entries in flight, the state machine's commits, the log's zeros written ahead), so on
//! the leader ENOSPC does not reach a log write or an fsync in normal operation. The
//! state machine's own commits to redb (record merges, checkpoints, snapshot builds,
//! answer expiry) wait below the reserve too, on every node (`StateMachine::
//! own_commits_wait`): redb refuses every commit after one that failed with ENOSPC.
//! Followers do not check (they must take what the leader committed): a follower whose
//! disk fills fails a write (its log's, or its state machine writer's commit), exits
//! (`lib.rs`) and is restarted by its supervisor, catching up once space returns; the
//! quorum goes on meanwhile (`disk_full.rs`).

use std::path::{Path, PathBuf};

/// Default free space, in MiB, below which the leader refuses new writes.
pub const DEFAULT_DISK_RESERVE_MB: u64 = 64;

#[derive(Clone, Debug)]
pub struct DiskReserve {
    dir: PathBuf,
    reserve_bytes: u64,
}

/// The disk is below its reserve: nothing is written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BelowReserve {
    pub free_bytes: u64,
    pub reserve_bytes: u64,
}

impl std::fmt::Display for BelowReserve {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the node's disk has {} KiB free, below its reserve of {} KiB; nothing was recorded, retry once space is freed",
            self.free_bytes / 1024,
            self.reserve_bytes / 1024
        )
    }
}

impl DiskReserve {
    pub fn new(dir: &Path, reserve_bytes: u64) -> Self {
        DiskReserve {
            dir: dir.to_path_buf(),
            reserve_bytes,
        }
    }

    pub fn reserve_bytes(&self) -> u64 {
        self.reserve_bytes
    }

    /// Ok when the data directory's file system has at least the reserve free. A
    /// `statvfs` that fails counts as no space: never write blind.
    pub fn check(&self) -> Result<(), BelowReserve> {
        self.headroom().map(drop)
    }

    /// The free bytes above the reserve, or why there are none. With no reserve, a
    /// `statvfs` that fails holds nothing back (as [`DiskReserve::check`] does not).
    pub fn headroom(&self) -> Result<u64, BelowReserve> {
        let unknown = if self.reserve_bytes == 0 { u64::MAX } else { 0 };
        let free_bytes = free_bytes(&self.dir).unwrap_or(unknown);
        free_bytes
            .checked_sub(self.reserve_bytes)
            .ok_or(BelowReserve {
                free_bytes,
                reserve_bytes: self.reserve_bytes,
            })
    }
}

/// Bytes an unprivileged writer may still use on the file system holding `dir`.
pub fn free_bytes(dir: &Path) -> std::io::Result<u64> {
    let stats = rustix::fs::statvfs(dir)?;
    Ok(stats.f_bavail.saturating_mul(stats.f_frsize))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reserve_above_the_free_space_refuses() {
        let dir = tempfile::tempdir().unwrap();
        let free = free_bytes(dir.path()).unwrap();
        assert!(free > 0);
        assert!(DiskReserve::new(dir.path(), 0).check().is_ok());
        // (Other processes change the free space between two looks.)
        assert!(DiskReserve::new(dir.path(), 1024).headroom().unwrap() > 0);
        let refused = DiskReserve::new(dir.path(), u64::MAX).check().unwrap_err();
        assert_eq!(refused.reserve_bytes, u64::MAX);
        assert!(refused.to_string().contains("nothing was recorded"));
        // A directory that does not exist has no space to offer, unless nothing is reserved.
        let nowhere = Path::new("/nonexistent/lineage");
        assert!(DiskReserve::new(nowhere, 1).check().is_err());
        assert!(DiskReserve::new(nowhere, 0).headroom().unwrap() > 0);
    }
}
