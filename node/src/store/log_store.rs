//! The Raft log: append-only segment files of checksummed entries, written by one thread
//! that group-commits.
//!
//! Layout of `<data>/raft-log/`: segments named by their first index (`<20 digits>.seg`),
//! each a run of frames `[len: u32 LE][crc32: u32 LE][the entry as JSON]` with consecutive
//! indexes; `watermark`, the last entry reported durable (`watermark.rs`); `vote.json` and
//! `purged.json`, replaced atomically and fsynced; `committed.json`, a start-up hint that
//! is never ahead of what is durable, sealed with a SHA-256 and ignored when damaged; `repair-floor.json` while the node is being repaired
//! (`repair_floor.rs`); `format`, which marks a log kept with a watermark.
//!
//! Why not redb for the log: a durable redb commit costs about five fdatasyncs of appended
//! bytes here, and redb's single writer made log appends and state-machine applies wait
//! for each other. The state machine stays on redb (`state_machine.rs`).
//!
//! `append` makes entries readable at once (openraft replicates an entry before it is
//! flushed) and queues them for the writer thread. The writer takes everything queued,
//! writes all appended frames with one write and one fdatasync, and only then calls
//! openraft's callbacks, in order: a follower never acknowledges an entry before it is on
//! disk.
//!
//! The leader's own entries may be the one exception (`leading_as`; the node's
//! `--leader-early-ack`, on by default), and why: openraft 0.9 awaits each log
//! flush inside its core task and only then tells the followers about the entry, so the
//! leader's fsync and a follower's fsync ran one after the other. Raft lets the leader
//! write its disk while it replicates (Ongaro's thesis §10.2.1); here the leader's append
//! is reported flushed at once, and two gates keep every effect behind the real fsync:
//! the state machine applies an entry only once it is durable here
//! ([`DurableLog::wait_durable`]), and the commit index sent to followers is cut to what
//! is durable here ([`DurableLog::clamp_commit`]). So before any node applies an entry or
//! any client hears of it, it is on the leader's disk and on a follower's: a majority.
//! Interrupted at each step:
//! - append: the frames are written and fdatasynced, then the watermark is overwritten
//!   and fdatasynced, and only then is anyone told. A crash before the watermark leaves
//!   frames beyond it (kept if whole, cut if torn: never acknowledged); start-up cuts a bad
//!   frame silently only beyond the watermark. Damage at or below it is an acknowledged
//!   entry lost: the node stores a repair floor and is repaired by its peers
//!   (`log_recovery.rs`). A leader that loses its early-acknowledged, unflushed entries
//!   had applied none of them and sent no commit for them: a follower's copy or the next
//!   leader's log replaces them.
//! - a new segment: created, then the directory fsynced, before its frames are acknowledged.
//! - truncate: refused at or below the committed index (a fatal assertion). The watermark
//!   comes down to the new last entry first, then later segments are deleted, then the
//!   containing one is cut; a crash in between leaves the longer log (valid frames beyond
//!   the watermark, kept), a state it had before, which Raft truncates again.
//! - purge: `purged.json` is made durable first, then whole segments are deleted; segments
//!   left by a crash in between are deleted at start-up.
//! - vote: a temporary file, fsynced, renamed over the old one, directory fsynced.
//!
//! A failed write or fsync leaves the file in an unknown state: the log then refuses every
//! later operation (fail-stop), openraft stops, and the process exits (`lib.rs`) for its
//! supervisor to restart it; start-up recovers from disk.

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Debug;
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::ops::{Bound, RangeBounds};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard, OnceLock};

use openraft::storage::{LogFlushed, RaftLogStorage};
use openraft::{Entry, LogId, LogState, RaftLogReader, StorageIOError, Vote};
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::checked_row;
use super::log_recovery;
use super::repair_floor::{self, Floor, RepairFloor};
use super::watermark::{Mark, Watermark};
use crate::raft_types::{NodeId, StorageError, TypeConfig};

/// A segment is closed and a new one started once it reaches this size.
pub const SEGMENT_BYTES: u64 = 64 * 1024 * 1024;
pub(super) const FRAME_HEADER: usize = 8;
/// How many bytes of frames the newest durable entries may hold decoded in memory.
const RECENT_BYTES: u64 = 16 * 1024 * 1024;
/// Zeros written ahead of the frames, extended by this much whenever a write reaches
/// their end. Overwriting blocks the file already has lets fdatasync skip the journal
/// commit that growing a file costs (ext4 here: 4 KB write + fdatasync went from 4.5k to
/// 5.4k a second for one writer, and from 1.45k to 2.4k each for three writers on one
/// disk). A zero frame header marks where the frames end.
const ZERO_AHEAD: u64 = 4 * 1024 * 1024;
const VOTE_FILE: &str = "vote.json";
pub(super) const PURGED_FILE: &str = "purged.json";
pub(super) const COMMITTED_FILE: &str = "committed.json";

pub(super) type Id = LogId<NodeId>;

fn read_err(e: impl std::fmt::Display) -> StorageError {
    StorageIOError::read_logs(openraft::AnyError::error(e.to_string())).into()
}

fn write_err(e: impl std::fmt::Display) -> StorageError {
    StorageIOError::write_logs(openraft::AnyError::error(e.to_string())).into()
}

/// Where a durable entry's frame is.
#[derive(Clone, Copy)]
pub(super) struct Frame {
    pub log_id: Id,
    pub segment: u64,
    pub offset: u64,
    pub len: u32,
    /// The CRC in the frame's header.
    pub crc: u32,
}

impl Frame {
    /// Where the frame ends in its segment.
    pub fn end(&self) -> u64 {
        self.offset + FRAME_HEADER as u64 + u64::from(self.len)
    }

    /// The watermark that says this frame (and all before it) is durable.
    pub fn mark(&self) -> Mark {
        Mark {
            log_id: Some(self.log_id),
            segment: self.segment,
            end: self.end(),
            frame_crc: self.crc,
        }
    }
}

pub(super) struct Segment {
    pub file: Arc<File>,
    /// Where the frames end and the next write goes.
    pub len: u64,
    /// The file holds zeros from `len` up to here (see [`ZERO_AHEAD`]).
    pub zeroed: u64,
}

/// Everything readers and the writer share, under one lock.
struct LogIndex {
    vote: Option<Vote<NodeId>>,
    last_purged: Option<Id>,
    committed: Option<Id>,
    /// Durable entries, consecutive indexes.
    durable: VecDeque<Frame>,
    /// Entries handed to the writer and not yet durable; they follow `durable`.
    pending: VecDeque<Entry<TypeConfig>>,
    /// The newest durable entries (a suffix of `durable`) with their frame sizes, kept
    /// decoded so replication reads them without a disk read and a JSON decode each.
    recent: VecDeque<(Entry<TypeConfig>, u32)>,
    /// Frame bytes held in `recent`, at most [`RECENT_BYTES`].
    recent_bytes: u64,
    /// Segment files by first index; the last one takes appends.
    segments: BTreeMap<u64, Segment>,
    /// Set after a failed write: the log refuses everything from then on.
    failed: Option<String>,
    /// Set while this node may have lost acknowledged entries (`repair_floor`).
    floor: Option<RepairFloor>,
}

impl LogIndex {
    fn last_durable(&self) -> Option<Id> {
        self.durable.back().map(|f| f.log_id).or(self.last_purged)
    }

    fn last_log_id(&self) -> Option<Id> {
        self.pending
            .back()
            .map(|e| e.log_id)
            .or_else(|| self.last_durable())
    }

    fn next_index(&self) -> u64 {
        self.last_log_id().map_or(0, |id| id.index + 1)
    }

    fn check(&self) -> Result<(), StorageError> {
        match &self.failed {
            Some(reason) => Err(write_err(format!("the raft log failed earlier: {reason}"))),
            None => Ok(()),
        }
    }

    /// Drops entries from `recent` until it is a suffix of `durable` within budget.
    fn trim_recent(&mut self) {
        while self.recent.len() > self.durable.len() || self.recent_bytes > RECENT_BYTES {
            match self.recent.pop_front() {
                Some((_, len)) => self.recent_bytes -= u64::from(len),
                None => break,
            }
        }
    }

    fn read_frame(&self, frame: &Frame) -> Result<Entry<TypeConfig>, StorageError> {
        let segment = self
            .segments
            .get(&frame.segment)
            .ok_or_else(|| read_err(format!("segment {} is gone", frame.segment)))?;
        let mut buf = vec![0u8; FRAME_HEADER + frame.len as usize];
        segment
            .file
            .read_exact_at(&mut buf, frame.offset)
            .map_err(read_err)?;
        let entry = decode_frame(&buf).map_err(read_err)?;
        if entry.log_id != frame.log_id {
            return Err(read_err(format!(
                "frame at {} holds {} instead of {}",
                frame.offset, entry.log_id, frame.log_id
            )));
        }
        Ok(entry)
    }
}

/// Who hears that an append is durable: openraft, a caller of `append_and_wait`, or
/// nobody (the leader's own entries, acknowledged at once; module docs).
enum Flushed {
    Raft(LogFlushed<TypeConfig>),
    Caller(tokio::sync::oneshot::Sender<io::Result<()>>),
    Early,
}

impl Flushed {
    fn completed(self, outcome: io::Result<()>) {
        match self {
            Flushed::Raft(callback) => callback.log_io_completed(outcome),
            Flushed::Caller(done) => {
                let _ = done.send(outcome);
            }
            Flushed::Early => {}
        }
    }
}

enum Op {
    Append {
        count: usize,
        callback: Flushed,
    },
    Truncate {
        index: u64,
        done: tokio::sync::oneshot::Sender<Result<(), StorageError>>,
    },
    Purge {
        log_id: Id,
        done: tokio::sync::oneshot::Sender<Result<(), StorageError>>,
    },
    SaveVote {
        vote: Vote<NodeId>,
        done: tokio::sync::oneshot::Sender<Result<(), StorageError>>,
    },
}

struct Shared {
    dir: PathBuf,
    segment_bytes: u64,
    index: Mutex<LogIndex>,
    /// Signalled after every group commit (or failure) for [`DurableLog::wait_durable`].
    flushed: Condvar,
    /// This node's id, once set: entries it appends as the leader of its vote are
    /// reported flushed at once (module docs).
    leader_self: OnceLock<NodeId>,
    /// Cleared when the writer thread ends, however it ends.
    writer_running: std::sync::atomic::AtomicBool,
    /// Observes each group commit's write + fdatasync, when metrics are wired.
    append_timer: OnceLock<prometheus::Histogram>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, LogIndex> {
        // A panic under the lock is a bug; the index is rebuilt from disk on restart.
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[derive(Clone)]
pub struct LogStore {
    shared: Arc<Shared>,
    writer: mpsc::Sender<Op>,
    /// The committed index openraft last reported (its metrics do not carry it).
    pub committed_index: Arc<AtomicU64>,
}

impl LogStore {
    pub fn with_append_timer(self, timer: prometheus::Histogram) -> Self {
        let _ = self.shared.append_timer.set(timer);
        self
    }

    /// Lets node `id` report its own entries flushed at once while it leads (module docs).
    /// Without it every append waits for its fsync, as tests and tools want.
    ///
    /// A node that led before it stopped comes back as a candidate, not as the leader of
    /// its old term (which openraft 0.9 would restore from a committed vote for itself).
    /// Entries it reported flushed early may never have reached its disk, while
    /// followers hold them; leading that term again, it would give new entries the same
    /// log ids (term, leader, index) as those lost ones. Raft tells entries apart by log
    /// id alone, so when it later follows a leader holding the lost ones, the consistency
    /// check passes on entries that differ and its state forks (seen: the fault test's
    /// restarted leader stopped applying, every batch refused). An uncommitted vote for
    /// itself in the same term still refuses every other candidate of that term, so
    /// nothing Raft relies on is lost; the node wins a later term or follows whoever did.
    pub fn leading_as(self, id: NodeId) -> Self {
        let _ = self.shared.leader_self.set(id);
        self.demote_own_leadership(id);
        self
    }

    /// Comes back as a candidate, not as the leader of its old term, when node `id`'s
    /// committed vote is for itself. A node under repair must (whatever the early-ack
    /// setting): openraft restores a leader from such a vote regardless of elections
    /// being off, and leading its old term on a cut log would reuse log ids that
    /// followers hold for other entries.
    pub fn demote_own_leadership(&self, id: NodeId) {
        let mut index = self.shared.lock();
        if let Some(vote) = index.vote.filter(|vote| is_leader_vote(vote, id)) {
            index.vote = Some(Vote::new(vote.leader_id().get_term(), id));
        }
    }

    /// The handle the state machine and the Raft client use to stay behind the disk.
    pub fn durability(&self) -> DurableLog {
        DurableLog(self.shared.clone())
    }

    /// Opens the log in `dir` (creating it), recovering from an interrupted write.
    pub fn open(dir: &Path) -> Result<Self, String> {
        Self::open_with(dir, SEGMENT_BYTES, false)
    }

    /// `open` with another segment size (tests use small ones to cross segments).
    pub fn open_with_segment_bytes(dir: &Path, segment_bytes: u64) -> Result<Self, String> {
        Self::open_with(dir, segment_bytes, false)
    }

    /// `open` for a node that is its cluster's only voter when `single_voter`: a lost
    /// vote cannot let it vote twice against anyone, so it is no fault there.
    pub fn open_with(dir: &Path, segment_bytes: u64, single_voter: bool) -> Result<Self, String> {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        // An unreadable vote is a lost vote: recovery judges it so (a repair floor).
        let vote: Option<Vote<NodeId>> = read_json_file(&dir.join(VOTE_FILE)).unwrap_or_else(|e| {
            tracing::error!(error = %e, "the vote file is unreadable; treated as lost");
            None
        });
        let last_purged: Option<Id> = read_json_file(&dir.join(PURGED_FILE))?;
        let committed = read_committed_hint(dir);
        let log_recovery::Recovered {
            segments,
            durable,
            watermark,
            mut floor,
            seeded_vote,
        } = log_recovery::recover(dir, last_purged, vote.is_some(), single_voter)?;
        if let Some(seed) = seeded_vote {
            // The highest term the log shows, voted for nobody that exists: no vote in
            // that term again, and no leader of an older term is followed.
            write_json_file(dir, VOTE_FILE, &seed)
                .map_err(|e| format!("cannot write {}: {e}", dir.join(VOTE_FILE).display()))?;
        }
        let vote = vote.or(seeded_vote);
        // A floor the log already passes (a crash between passing it and clearing it).
        let last = durable.back().map(|f: &Frame| f.log_id).or(last_purged);
        if floor.as_ref().is_some_and(|f| f.floor.passed_by(last)) {
            repair_floor::clear(dir).map_err(|e| format!("cannot clear the repair floor: {e}"))?;
            floor = None;
        }
        let committed = committed.filter(|c| {
            durable
                .back()
                .map(|f: &Frame| f.log_id)
                .or(last_purged)
                .is_some_and(|last| c.index <= last.index)
        });
        let shared = Arc::new(Shared {
            dir: dir.to_path_buf(),
            segment_bytes: segment_bytes.max(1),
            index: Mutex::new(LogIndex {
                vote,
                last_purged,
                committed,
                durable,
                pending: VecDeque::new(),
                recent: VecDeque::new(),
                recent_bytes: 0,
                segments,
                failed: None,
                floor,
            }),
            append_timer: OnceLock::new(),
            flushed: Condvar::new(),
            leader_self: OnceLock::new(),
            writer_running: std::sync::atomic::AtomicBool::new(true),
        });
        let (writer, ops) = mpsc::channel();
        let for_thread = shared.clone();
        std::thread::Builder::new()
            .name("raft-log-writer".into())
            .spawn(move || run_writer(&for_thread, &ops, watermark))
            .map_err(|e| format!("cannot start the raft log writer: {e}"))?;
        Ok(LogStore {
            shared,
            writer,
            committed_index: Arc::new(AtomicU64::new(committed.map_or(0, |c| c.index))),
        })
    }

    /// Appends `entries` and waits until they are durable: `append` without openraft's
    /// callback, for tools and tests.
    pub async fn append_and_wait(
        &mut self,
        entries: Vec<Entry<TypeConfig>>,
    ) -> Result<(), StorageError> {
        let (done, flushed) = tokio::sync::oneshot::channel();
        self.append_entries(entries, Flushed::Caller(done)).await?;
        flushed
            .await
            .map_err(|_| write_err("the raft log writer has stopped"))?
            .map_err(write_err)
    }

    async fn request(
        &self,
        make: impl FnOnce(tokio::sync::oneshot::Sender<Result<(), StorageError>>) -> Op,
    ) -> Result<(), StorageError> {
        let (done, answer) = tokio::sync::oneshot::channel();
        self.writer
            .send(make(done))
            .map_err(|_| write_err("the raft log writer has stopped"))?;
        answer
            .await
            .map_err(|_| write_err("the raft log writer has stopped"))?
    }
}

/// The last purged entry recorded in `dir`, if any.
pub fn read_purged(dir: &Path) -> Result<Option<Id>, String> {
    read_json_file(&dir.join(PURGED_FILE))
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + Send>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry<TypeConfig>>, StorageError> {
        let index = self.shared.lock();
        let start = match range.start_bound() {
            Bound::Included(&s) => s,
            Bound::Excluded(&s) => s.saturating_add(1),
            Bound::Unbounded => 0,
        };
        let end = match range.end_bound() {
            Bound::Included(&e) => e.saturating_add(1),
            Bound::Excluded(&e) => e,
            Bound::Unbounded => u64::MAX,
        };
        let mut entries = Vec::new();
        // Both queues hold consecutive indexes: find the slice by arithmetic.
        let positions = |first: Option<u64>, len: usize| {
            let first = first.unwrap_or(0);
            let from = start.saturating_sub(first).min(len as u64) as usize;
            let to = end.saturating_sub(first).min(len as u64) as usize;
            from..to.max(from)
        };
        let durable_first = index.durable.front().map(|f| f.log_id.index);
        let cached_from = index.durable.len() - index.recent.len();
        for position in positions(durable_first, index.durable.len()) {
            match position.checked_sub(cached_from) {
                Some(cached) => entries.push(index.recent[cached].0.clone()),
                None => entries.push(index.read_frame(&index.durable[position])?),
            }
        }
        let pending_first = index.pending.front().map(|e| e.log_id.index);
        for entry in index
            .pending
            .range(positions(pending_first, index.pending.len()))
        {
            entries.push(entry.clone());
        }
        Ok(entries)
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError> {
        let index = self.shared.lock();
        Ok(LogState {
            last_purged_log_id: index.last_purged,
            last_log_id: index.last_log_id(),
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), StorageError> {
        let vote = *vote;
        self.request(|done| Op::SaveVote { vote, done }).await
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError> {
        Ok(self.shared.lock().vote)
    }

    async fn save_committed(&mut self, committed: Option<Id>) -> Result<(), StorageError> {
        self.committed_index
            .store(committed.map_or(0, |l| l.index), Ordering::Relaxed);
        // Written by the writer after its next flush, never ahead of the durable log.
        self.shared.lock().committed = committed;
        Ok(())
    }

    async fn read_committed(&mut self) -> Result<Option<Id>, StorageError> {
        Ok(self.shared.lock().committed)
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: LogFlushed<TypeConfig>,
    ) -> Result<(), StorageError>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + Send,
        I::IntoIter: Send,
    {
        self.append_entries(entries.into_iter().collect(), Flushed::Raft(callback))
            .await
    }

    async fn truncate(&mut self, log_id: Id) -> Result<(), StorageError> {
        let index = log_id.index;
        self.request(|done| Op::Truncate { index, done }).await
    }

    async fn purge(&mut self, log_id: Id) -> Result<(), StorageError> {
        self.request(|done| Op::Purge { log_id, done }).await
    }
}

impl LogStore {
    async fn append_entries(
        &mut self,
        entries: Vec<Entry<TypeConfig>>,
        callback: Flushed,
    ) -> Result<(), StorageError> {
        // Openraft truncates before it overwrites and never leaves a hole; its storage suite
        // does both directly (over existing entries, past the end). Treat an overwrite as a
        // truncate from there, and a hole as replacing the whole log (slow, never on the
        // node's path).
        if let Some(first) = entries.first() {
            let (next, front) = {
                let index = self.shared.lock();
                let front = index.durable.front().map(|f| f.log_id);
                (
                    index.next_index(),
                    front.or(index.pending.front().map(|e| e.log_id)),
                )
            };
            if let Some(front) = front {
                if first.log_id.index < next {
                    self.truncate(first.log_id).await?;
                } else if first.log_id.index > next {
                    tracing::warn!(
                        at = first.log_id.index,
                        next,
                        "append leaves a hole: replacing the log"
                    );
                    self.truncate(front).await?;
                }
            }
        }
        let mut index = self.shared.lock();
        index.check()?;
        // Check them all before taking any: a refused append leaves the log as it was.
        // An empty log may start anywhere (openraft's own suite starts below what it
        // purged); after that, indexes are consecutive.
        let empty = index.durable.is_empty() && index.pending.is_empty();
        let start = entries
            .first()
            .filter(|_| empty)
            .map_or(index.next_index(), |e| e.log_id.index);
        for (expected, entry) in (start..).zip(&entries) {
            if entry.log_id.index != expected {
                return Err(write_err(format!(
                    "append at index {} but the log continues at {expected}",
                    entry.log_id.index
                )));
            }
        }
        let count = entries.len();
        let early = matches!(callback, Flushed::Raft(_)) && self.leads(&index, &entries);
        index.pending.extend(entries);
        drop(index);
        let (for_writer, answer_now) = if early {
            (Flushed::Early, Some(callback))
        } else {
            (callback, None)
        };
        self.writer
            .send(Op::Append {
                count,
                callback: for_writer,
            })
            .map_err(|_| write_err("the raft log writer has stopped"))?;
        // Only once the writer has the entries: a refused append is never reported flushed.
        if let Some(callback) = answer_now {
            callback.completed(Ok(()));
        }
        Ok(())
    }

    /// Whether these are this node's own entries, proposed under the vote it leads with.
    fn leads(&self, index: &LogIndex, entries: &[Entry<TypeConfig>]) -> bool {
        let (Some(me), Some(vote)) = (self.shared.leader_self.get(), index.vote) else {
            return false;
        };
        is_leader_vote(&vote, *me)
            && entries
                .iter()
                .all(|e| e.log_id.leader_id == *vote.leader_id())
    }
}

/// Whether `vote` makes `id` the leader of its term: granted by a quorum, for `id`.
fn is_leader_vote(vote: &Vote<NodeId>, id: NodeId) -> bool {
    vote.is_committed() && vote.leader_id().voted_for() == Some(id)
}

/// What is on this node's disk, for the gates that keep the leader's early
/// acknowledgement from being seen (module docs).
#[derive(Clone)]
pub struct DurableLog(Arc<Shared>);

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

// ---- the writer thread ----

fn run_writer(shared: &Shared, ops: &mpsc::Receiver<Op>, mut watermark: Watermark) {
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
                save_committed_hint(shared, &mut hint);
                continue;
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        };
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

fn clear_floor(shared: &Shared, log: &mut LogIndex) -> Result<(), String> {
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
fn read_committed_hint(dir: &Path) -> Option<Id> {
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

// ---- files ----

pub(super) fn segment_path(dir: &Path, first: u64) -> PathBuf {
    dir.join(format!("{first:020}.seg"))
}

fn create_segment(dir: &Path, first: u64) -> Result<File, String> {
    let path = segment_path(dir, first);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
    sync_dir(dir).map_err(|e| format!("cannot sync {}: {e}", dir.display()))?;
    Ok(file)
}

pub(super) fn remove_file(path: &Path) -> io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

pub(super) fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Replaces `dir/name` atomically and durably.
pub(super) fn write_json_file<T: Serialize>(dir: &Path, name: &str, value: &T) -> io::Result<()> {
    let tmp = dir.join(format!("{name}.tmp"));
    let bytes = serde_json::to_vec(value).map_err(io::Error::other)?;
    {
        let mut file = File::create(&tmp)?;
        file.write_all(&bytes)?;
        file.sync_all()?;
    }
    std::fs::rename(&tmp, dir.join(name))?;
    sync_dir(dir)
}

fn read_json_file<T: DeserializeOwned>(path: &Path) -> Result<Option<T>, String> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| format!("{} is unreadable: {e}", path.display())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("cannot read {}: {e}", path.display())),
    }
}

/// Appends `entry`'s frame to `buf` and returns the frame's CRC.
fn encode_frame(entry: &Entry<TypeConfig>, buf: &mut Vec<u8>) -> Result<u32, String> {
    let start = buf.len();
    buf.extend_from_slice(&[0; FRAME_HEADER]);
    serde_json::to_writer(&mut *buf, entry).map_err(|e| format!("encode entry: {e}"))?;
    let payload = &buf[start + FRAME_HEADER..];
    let len = u32::try_from(payload.len()).map_err(|_| "entry too large".to_string())?;
    let crc = crc32fast::hash(payload);
    buf[start..start + 4].copy_from_slice(&len.to_le_bytes());
    buf[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
    Ok(crc)
}

/// Decodes one whole frame (header + payload).
pub(super) fn decode_frame(frame: &[u8]) -> Result<Entry<TypeConfig>, String> {
    let (len, crc) = frame_header(frame).ok_or("short frame")?;
    let payload = frame
        .get(FRAME_HEADER..FRAME_HEADER + len as usize)
        .ok_or("short frame")?;
    if crc32fast::hash(payload) != crc {
        return Err("checksum mismatch".into());
    }
    serde_json::from_slice(payload).map_err(|e| format!("bad entry: {e}"))
}

pub(super) fn frame_header(bytes: &[u8]) -> Option<(u32, u32)> {
    let len = u32::from_le_bytes(bytes.get(0..4)?.try_into().ok()?);
    let crc = u32::from_le_bytes(bytes.get(4..8)?.try_into().ok()?);
    Some((len, crc))
}
