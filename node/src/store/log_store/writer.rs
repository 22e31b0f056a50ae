//! The writer thread: group commits, truncate, purge, the vote and the committed hint.

use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};

use openraft::{StorageIOError, Vote};

use super::super::checked_row;
use super::super::repair_floor;
use super::super::watermark::{Mark, Watermark};
use super::segment::{
    create_segment, encode_frame, remove_file, segment_path, sync_dir, write_json_file,
};
use super::{
    write_err, Flushed, Frame, Id, LogIndex, Op, Segment, Shared, COMMITTED_FILE, FRAME_HEADER,
    PURGED_FILE, VOTE_FILE, ZERO_AHEAD,
};
use crate::raft_types::{NodeId, StorageError};

pub(super) fn run_writer(shared: &Shared, ops: &mpsc::Receiver<Op>, mut watermark: Watermark) {
    /// Tells waiters the writer is gone, also when it panics.
    struct Running<'a>(&'a Shared);
    impl Drop for Running<'_> {
        fn drop(&mut self) {
            self.0.writer_running.store(false, Ordering::Release);
            self.0.flushed.notify_all();
        }
    }
    let _running = Running(shared);
    let mut hint = CommittedHint {
        written: None,
        at: std::time::Instant::now(),
    };
    loop {
        // Wakes up when idle too, so a newer committed id gets written without waiting for
        // the next append.
        let first = match ops.recv_timeout(COMMITTED_HINT_EVERY) {
            Ok(op) => op,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let _writing = writing(shared);
                save_committed_hint(shared, &mut hint);
                continue;
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        };
        let _writing = writing(shared);
        let mut batch = vec![first];
        batch.extend(ops.try_iter());
        let mut appends = Vec::new();
        for op in batch {
            // Appends queued before another operation are written before it runs.
            let (result, done) = match op {
                Op::Append { count, callback } => {
                    appends.push((count, callback));
                    continue;
                }
                Op::Truncate { index, done } => {
                    flush_appends(shared, &mut watermark, std::mem::take(&mut appends));
                    (truncate(shared, &mut watermark, index), done)
                }
                Op::Purge { log_id, done } => {
                    flush_appends(shared, &mut watermark, std::mem::take(&mut appends));
                    (purge(shared, log_id), done)
                }
                Op::SaveVote { vote, done } => {
                    flush_appends(shared, &mut watermark, std::mem::take(&mut appends));
                    (save_vote(shared, vote), done)
                }
            };
            if let Err(e) = &result {
                shared.lock().failed.get_or_insert_with(|| e.to_string());
            }
            let _ = done.send(result);
        }
        flush_appends(shared, &mut watermark, appends);
        save_committed_hint(shared, &mut hint);
    }
}

/// The writer's disk work from now until the guard drops (`disk_watch`), when wired.
fn writing(shared: &Shared) -> Option<crate::disk_watch::Writing<'_>> {
    shared
        .disk_watch
        .get()
        .map(|watch| watch.writing(crate::disk_watch::DiskWrite::RaftLog))
}

/// Writes the pending entries of `appends` with one write and one fdatasync, then calls
/// their callbacks in order.
fn flush_appends(shared: &Shared, watermark: &mut Watermark, appends: Vec<(usize, Flushed)>) {
    if appends.is_empty() {
        return;
    }
    let count: usize = appends.iter().map(|(n, _)| n).sum();
    let _timer = shared.append_timer.get().map(|t| t.start_timer());
    let result = write_pending(shared, watermark, count).and_then(|()| clear_passed_floor(shared));
    if let Err(e) = &result {
        shared.lock().failed.get_or_insert_with(|| e.to_string());
    }
    shared.flushed.notify_all();
    for (_, callback) in appends {
        let outcome = match &result {
            Ok(()) => Ok(()),
            Err(e) => Err(io::Error::other(e.to_string())),
        };
        callback.completed(outcome);
    }
}

fn write_pending(shared: &Shared, watermark: &mut Watermark, count: usize) -> Result<(), String> {
    let (frames_buf, frames, segment_first, file, offset, zeroed) = {
        let mut index = shared.lock();
        index.check().map_err(|e| e.to_string())?;
        if count == 0 {
            return Ok(());
        }
        if index.pending.len() < count {
            return Err("pending entries went missing".into());
        }
        let Some(first_index) = index.pending.front().map(|e| e.log_id.index) else {
            return Ok(());
        };
        let mut buf = Vec::new();
        let mut frames = Vec::with_capacity(count);
        for entry in index.pending.iter().take(count) {
            let start = buf.len();
            let crc = encode_frame(entry, &mut buf)?;
            frames.push((
                entry.log_id,
                start as u64,
                (buf.len() - start - FRAME_HEADER) as u32,
                crc,
            ));
        }
        let needs_new = index
            .segments
            .last_key_value()
            .is_none_or(|(_, s)| s.len >= shared.segment_bytes);
        if needs_new {
            let file = create_segment(&shared.dir, first_index)?;
            index.segments.insert(
                first_index,
                Segment {
                    file: Arc::new(file),
                    len: 0,
                    zeroed: 0,
                },
            );
        }
        let Some((&segment_first, segment)) = index.segments.last_key_value() else {
            return Err("no segment to append to".into());
        };
        (
            buf,
            frames,
            segment_first,
            segment.file.clone(),
            segment.len,
            segment.zeroed,
        )
    };
    let frames_len = frames_buf.len() as u64;
    let mut write = frames_buf;
    let end = offset + frames_len;
    if end > zeroed {
        // The same write and fdatasync lay down the next stretch of zeros, no further
        // than where the segment closes.
        let zero_to = (end + ZERO_AHEAD).min(shared.segment_bytes.max(end));
        write.resize((zero_to - offset) as usize, 0);
    }
    // The slow part runs without the lock: readers keep reading meanwhile.
    file.write_all_at(&write, offset)
        .and_then(|()| file.sync_data())
        .map_err(|e| format!("raft log write: {e}"))?;
    // The entries are on disk; the watermark says so (durably) before anyone hears it.
    if let Some(&(log_id, start, len, crc)) = frames.last() {
        let last = Frame {
            log_id,
            segment: segment_first,
            offset: offset + start,
            len,
            crc,
        };
        watermark
            .write(&last.mark())
            .map_err(|e| format!("raft log watermark write: {e}"))?;
    }
    let mut index = shared.lock();
    if let Some(segment) = index.segments.get_mut(&segment_first) {
        segment.len = offset + frames_len;
        segment.zeroed = segment.zeroed.max(offset + write.len() as u64);
    }
    for (log_id, start, len, crc) in frames {
        if let Some(entry) = index.pending.pop_front() {
            index.recent.push_back((entry, len));
            index.recent_bytes += u64::from(len);
        }
        index.durable.push_back(Frame {
            log_id,
            segment: segment_first,
            offset: offset + start,
            len,
            crc,
        });
    }
    index.trim_recent();
    Ok(())
}

/// Deletes entries from `index` on. The watermark comes down first: a crash after it
/// finds the longer log, which is beyond the watermark and valid, so it is kept and
/// truncated again by Raft.
fn truncate(shared: &Shared, watermark: &mut Watermark, index: u64) -> Result<(), StorageError> {
    let mut log = shared.lock();
    log.check()?;
    if let Some(committed) = log.committed.filter(|c| index <= c.index) {
        // Raft only ever truncates entries that are not committed; doing so would lose
        // decisions. Stop here (the node exits; module docs) rather than obey.
        let reason = format!(
            "refusing to truncate the raft log at {index}: entries up to {committed} are committed"
        );
        tracing::error!(%reason, "fatal storage assertion");
        log.failed.get_or_insert(reason.clone());
        return Err(write_err(reason));
    }
    // Nothing is pending: every earlier append was flushed before this op ran.
    let Some(position) = log.durable.iter().position(|f| f.log_id.index >= index) else {
        return Ok(());
    };
    let frame = log.durable[position];
    let new_last = match position.checked_sub(1) {
        Some(p) => log.durable[p].mark(),
        None => Mark {
            log_id: log.last_purged,
            ..Mark::EMPTY
        },
    };
    watermark.write(&new_last).map_err(write_err)?;
    let later: Vec<u64> = log
        .segments
        .range(frame.segment + 1..)
        .map(|(&first, _)| first)
        .collect();
    for first in later.iter().rev() {
        log.segments.remove(first);
        remove_file(&segment_path(&shared.dir, *first)).map_err(write_err)?;
    }
    if frame.offset == 0 {
        log.segments.remove(&frame.segment);
        remove_file(&segment_path(&shared.dir, frame.segment)).map_err(write_err)?;
    }
    sync_dir(&shared.dir).map_err(write_err)?;
    if let Some(segment) = log.segments.get_mut(&frame.segment) {
        segment
            .file
            .set_len(frame.offset)
            .and_then(|()| segment.file.sync_data())
            .map_err(write_err)?;
        segment.len = frame.offset;
        segment.zeroed = frame.offset;
    }
    log.durable.truncate(position);
    // Rare (a new leader overwrote this one's tail): start the cache afresh.
    log.recent.clear();
    log.recent_bytes = 0;
    Ok(())
}

/// Forgets entries up to and including `log_id`.
fn purge(shared: &Shared, log_id: Id) -> Result<(), StorageError> {
    let mut log = shared.lock();
    log.check()?;
    write_json_file(&shared.dir, PURGED_FILE, &log_id).map_err(write_err)?;
    log.last_purged = Some(log_id);
    while log
        .durable
        .front()
        .is_some_and(|f| f.log_id.index <= log_id.index)
    {
        log.durable.pop_front();
    }
    log.trim_recent();
    // Pending entries the purge passes (a snapshot replaced them) are dropped too.
    while log
        .pending
        .front()
        .is_some_and(|e| e.log_id.index <= log_id.index)
    {
        log.pending.pop_front();
    }
    let keep_from = log.durable.front().map(|f| f.segment);
    let firsts: Vec<u64> = log.segments.keys().copied().collect();
    let mut removed = false;
    for first in firsts {
        // A segment goes when no kept entry is in it; with nothing kept, every segment
        // goes and the next append starts a new one.
        if keep_from.is_none_or(|keep| first < keep) {
            log.segments.remove(&first);
            remove_file(&segment_path(&shared.dir, first)).map_err(write_err)?;
            removed = true;
        }
    }
    if removed {
        sync_dir(&shared.dir).map_err(write_err)?;
    }
    drop(log);
    // A snapshot installed past the floor repairs the node too.
    clear_passed_floor(shared).map_err(write_err)
}

/// Clears the repair floor, durably, once the durable log has passed it.
fn clear_passed_floor(shared: &Shared) -> Result<(), String> {
    let mut log = shared.lock();
    let passed = log
        .floor
        .as_ref()
        .is_some_and(|f| f.floor.passed_by(log.last_durable()));
    if passed {
        clear_floor(shared, &mut log)?;
    }
    Ok(())
}

pub(super) fn clear_floor(shared: &Shared, log: &mut LogIndex) -> Result<(), String> {
    repair_floor::clear(&shared.dir).map_err(|e| format!("cannot clear the repair floor: {e}"))?;
    if let Some(floor) = log.floor.take() {
        tracing::info!(floor = ?floor.floor, last = ?log.last_durable(), "raft log repaired: the repair floor is cleared");
    }
    Ok(())
}

fn save_vote(shared: &Shared, vote: Vote<NodeId>) -> Result<(), StorageError> {
    shared.lock().check()?;
    write_json_file(&shared.dir, VOTE_FILE, &vote)
        .map_err(|e| StorageIOError::write_vote(openraft::AnyError::error(e.to_string())))?;
    shared.lock().vote = Some(vote);
    Ok(())
}

/// The committed hint last written, and when.
struct CommittedHint {
    written: Option<Id>,
    at: std::time::Instant,
}

/// The committed id, clamped to the durable log (never ahead of what a restart finds).
fn clamped_committed(shared: &Shared) -> Option<Id> {
    let log = shared.lock();
    match (log.committed, log.last_durable()) {
        (Some(c), Some(d)) if c.index <= d.index => Some(c),
        (Some(_), durable) => durable,
        (None, _) => None,
    }
}

/// How often the committed hint may be rewritten: a file rename per group commit cost
/// about 4% of a node's CPU under load, and a hint a little behind only means openraft
/// re-applies a little less at start-up before the leader tells it the rest.
const COMMITTED_HINT_EVERY: std::time::Duration = std::time::Duration::from_millis(50);

/// The committed hint, if it reads back intact. It is sealed (`checked_row`) because a
/// changed byte that still parsed could name a later index than was committed, and
/// start-up would apply entries that a leader may yet replace. Absent or damaged, it only
/// means "apply from what the state machine has" until a leader says more: it never
/// stood for anything acknowledged.
pub(super) fn read_committed_hint(dir: &Path) -> Option<Id> {
    let bytes = std::fs::read(dir.join(COMMITTED_FILE)).ok()?;
    let parsed = checked_row::unseal(&bytes)
        .and_then(|json| serde_json::from_slice(json).map_err(|e| e.to_string()));
    parsed.unwrap_or_else(|e| {
        tracing::warn!(error = %e, "the committed hint is unreadable; ignored");
        None
    })
}

/// Writes the committed hint, clamped to the durable log, when it changed. Not fsynced:
/// losing it costs re-applying later, never correctness.
fn save_committed_hint(shared: &Shared, last: &mut CommittedHint) {
    if last.at.elapsed() < COMMITTED_HINT_EVERY {
        return;
    }
    let hint = clamped_committed(shared);
    if hint.is_some() && hint != last.written {
        let path = shared.dir.join(COMMITTED_FILE);
        let tmp = shared.dir.join(format!("{COMMITTED_FILE}.tmp"));
        let result = serde_json::to_vec(&hint)
            .map_err(io::Error::other)
            .and_then(|json| std::fs::write(&tmp, checked_row::seal(&json)))
            .and_then(|()| std::fs::rename(&tmp, &path));
        match result {
            Ok(()) => {
                last.written = hint;
                last.at = std::time::Instant::now();
            }
            Err(e) => {
                // Tried again after the same pause; the next append fails loudly anyway
                // if the directory is gone.
                last.at = std::time::Instant::now();
                tracing::warn!(error = %e, "could not write the committed hint");
            }
        }
    }
}
