//! Reading a range of entries: planned under the index lock, read from disk outside it.
//!
//! A follower further behind than the decoded cache (`RECENT_BYTES`) is served from the
//! segment files. Reading those frames under the lock made the leader's appends, and the
//! writer's bookkeeping after each fsync, wait for a catching-up follower's disk reads
//! and JSON decodes. So the lock is held only to note where each frame is (and to clone
//! what is cached or pending); the frames are read after it is released, through the
//! segment's own file handle, which stays readable even if the segment is deleted.
//!
//! Meanwhile the log may move under the read: a purge deletes segments (the handle still
//! reads them), and a truncate cuts a segment, whose frames new appends then overwrite.
//! Every frame read is checked against what the index said it was: its header's length
//! and CRC, the CRC of its payload, and its log id. A frame that passes has the indexed
//! length, CRC and log id, so (short of a CRC32 collision at the same length and log id)
//! it is the entry that was indexed, and the range read is exactly the log as it stood
//! when the lock was held. A frame that fails
//! is either damage or a frame rewritten since: the range is read again with the lock
//! held throughout, where nothing moves, and only a failure then is a read error (which
//! openraft treats as fatal).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use openraft::Entry;

use super::{decode_frame, frame_header, read_err, Frame, LogIndex, FRAME_HEADER};
use crate::raft_types::{StorageError, TypeConfig};

/// One entry of a range: in hand already, or a frame still to read.
enum Planned {
    Ready(Entry<TypeConfig>),
    OnDisk(Frame, Arc<File>),
}

/// The entries with indexes in `start..end` that the log holds, in order.
pub(super) struct ReadPlan(Vec<Planned>);

impl LogIndex {
    /// Notes, under the lock, where each entry of `start..end` is: cached and pending
    /// entries are cloned, durable ones beyond the cache are frames to read.
    pub(super) fn plan_read(&self, start: u64, end: u64) -> Result<ReadPlan, StorageError> {
        let mut plan = Vec::new();
        // Both queues hold consecutive indexes: find the slice by arithmetic.
        let positions = |first: Option<u64>, len: usize| {
            let first = first.unwrap_or(0);
            let from = start.saturating_sub(first).min(len as u64) as usize;
            let to = end.saturating_sub(first).min(len as u64) as usize;
            from..to.max(from)
        };
        let durable_first = self.durable.front().map(|f| f.log_id.index);
        let cached_from = self.durable.len() - self.recent.len();
        for position in positions(durable_first, self.durable.len()) {
            plan.push(match position.checked_sub(cached_from) {
                Some(cached) => Planned::Ready(self.recent[cached].0.clone()),
                None => {
                    let frame = self.durable[position];
                    let segment = self
                        .segments
                        .get(&frame.segment)
                        .ok_or_else(|| read_err(format!("segment {} is gone", frame.segment)))?;
                    Planned::OnDisk(frame, segment.file.clone())
                }
            });
        }
        let pending_first = self.pending.front().map(|e| e.log_id.index);
        for entry in self
            .pending
            .range(positions(pending_first, self.pending.len()))
        {
            plan.push(Planned::Ready(entry.clone()));
        }
        Ok(ReadPlan(plan))
    }
}

impl ReadPlan {
    /// The entries, reading and checking each frame still to read.
    pub(super) fn read(self) -> Result<Vec<Entry<TypeConfig>>, StorageError> {
        self.0
            .into_iter()
            .map(|planned| match planned {
                Planned::Ready(entry) => Ok(entry),
                Planned::OnDisk(frame, file) => read_frame(&frame, &file),
            })
            .collect()
    }
}

/// Reads `frame` from `file`: an error unless its length, CRC and log id are the ones the
/// index holds.
fn read_frame(frame: &Frame, file: &File) -> Result<Entry<TypeConfig>, StorageError> {
    let mut buf = vec![0u8; FRAME_HEADER + frame.len as usize];
    file.read_exact_at(&mut buf, frame.offset)
        .map_err(read_err)?;
    if frame_header(&buf) != Some((frame.len, frame.crc)) {
        return Err(read_err(format!(
            "frame at {} of segment {} is not the one indexed for {}",
            frame.offset, frame.segment, frame.log_id
        )));
    }
    let entry = decode_frame(&buf).map_err(read_err)?;
    if entry.log_id != frame.log_id {
        return Err(read_err(format!(
            "frame at {} holds {} instead of {}",
            frame.offset, entry.log_id, frame.log_id
        )));
    }
    Ok(entry)
}

#[cfg(test)]
mod tests {
    use openraft::storage::RaftLogStorage;
    use openraft::testing::log_id;
    use openraft::{Entry, EntryPayload, RaftLogReader};

    use super::super::LogStore;
    use crate::raft_types::TypeConfig;

    fn blanks(term: u64, indexes: std::ops::RangeInclusive<u64>) -> Vec<Entry<TypeConfig>> {
        indexes
            .map(|index| Entry {
                log_id: log_id(term, 1, index),
                payload: EntryPayload::Blank,
            })
            .collect()
    }

    /// Entries 1..=10 of term 1 in segments of `segment_bytes`, reopened so that none is
    /// held decoded: every read goes to the segments.
    async fn reopened(dir: &std::path::Path, segment_bytes: u64) -> LogStore {
        {
            let mut log = LogStore::open_with_segment_bytes(dir, segment_bytes).unwrap();
            for index in 1..=10 {
                log.append_and_wait(blanks(1, index..=index)).await.unwrap();
            }
        }
        LogStore::open_with_segment_bytes(dir, segment_bytes).unwrap()
    }

    /// The interleavings a race test meets only by luck, each made to happen: a range
    /// planned, then the log changed under it, then the frames read.
    #[tokio::test]
    async fn a_frame_changed_after_planning_is_never_read_as_the_planned_entry() {
        // Cut, then written again in a new term, in one segment: each frame of the same
        // size lands where the planned one was, and is refused by its CRC against the index.
        let dir = tempfile::tempdir().unwrap();
        let mut log = reopened(dir.path(), super::super::SEGMENT_BYTES).await;
        let plan = log.shared.lock().plan_read(1, 11).unwrap();
        log.truncate(log_id(1, 1, 4)).await.unwrap();
        log.append_and_wait(blanks(2, 4..=10)).await.unwrap();
        let read = plan.read();
        assert!(read.is_err(), "read the planned term-1 entries as {read:?}");
        // Read through the reader, the same range is the log as it now stands.
        let now = log.try_get_log_entries(1..=10).await.unwrap();
        let terms: Vec<u64> = now.iter().map(|e| e.log_id.leader_id.term).collect();
        assert_eq!(terms, [1, 1, 1, 2, 2, 2, 2, 2, 2, 2]);

        // Cut and not yet written again: a short read, refused.
        let dir = tempfile::tempdir().unwrap();
        let mut log = reopened(dir.path(), super::super::SEGMENT_BYTES).await;
        let plan = log.shared.lock().plan_read(1, 11).unwrap();
        log.truncate(log_id(1, 1, 4)).await.unwrap();
        assert!(plan.read().is_err());
        assert_eq!(log.try_get_log_entries(1..=10).await.unwrap().len(), 3);

        // Segments deleted by a purge, or by a truncate and written again in new files
        // (200-byte segments): their handles still read the planned entries, the log as
        // it stood when the range was planned.
        let dir = tempfile::tempdir().unwrap();
        let mut log = reopened(dir.path(), 200).await;
        let plan = log.shared.lock().plan_read(1, 11).unwrap();
        log.purge(log_id(1, 1, 6)).await.unwrap();
        let read = plan.read().unwrap();
        assert_eq!(read, blanks(1, 1..=10));
        let dir = tempfile::tempdir().unwrap();
        let mut log = reopened(dir.path(), 200).await;
        assert!(
            super::super::segment_path(dir.path(), 4).exists(),
            "entry 4 starts a segment, so the truncate deletes whole files"
        );
        let plan = log.shared.lock().plan_read(1, 11).unwrap();
        log.truncate(log_id(1, 1, 4)).await.unwrap();
        log.append_and_wait(blanks(2, 4..=10)).await.unwrap();
        assert_eq!(plan.read().unwrap(), blanks(1, 1..=10));
    }
}
