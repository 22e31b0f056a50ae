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
//! for each other. The state machine stays on redb (`state_machine/`).
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
use std::fs::File;
use std::io;
use std::ops::{Bound, RangeBounds};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard, OnceLock};

use openraft::storage::{LogFlushed, RaftLogStorage};
use openraft::{Entry, LogId, LogState, RaftLogReader, StorageIOError, Vote};

mod durable;
mod reader;
mod segment;
mod writer;

pub use durable::DurableLog;
use segment::read_json_file;
pub(super) use segment::{
    decode_frame, frame_header, remove_file, segment_path, sync_dir, write_json_file,
};
use writer::{read_committed_hint, run_writer};

use super::log_recovery;
use super::repair_floor::{self, RepairFloor};
use super::watermark::Mark;
use crate::raft_types::{NodeId, StorageError, TypeConfig};

/// A segment is closed and a new one started once it reaches this size. Purging behind
/// a snapshot deletes whole segments, so this is about what a purged log still keeps on
/// disk (64 MiB kept every record of a 100k-record node twice).
pub const SEGMENT_BYTES: u64 = 16 * 1024 * 1024;
pub(super) const FRAME_HEADER: usize = 8;
/// How many bytes of frames the newest durable entries may hold decoded in memory. The
/// leader's entries also hold each record parsed, about 2.5 times its line (heaptrack,
/// 200-byte inputs: 16 MiB of frames held 64 MB), a follower's only the lines. The
/// leader's applies and replication read the newest entries: 4 MiB is about 30 of the
/// batcher's largest (128 KiB), 230 of the 18 KB ones 16 clients made over 16 agents and
/// 800 of the 5 KB ones over 10,000 (memory_growth: 100k records in 3,150 and 12,500
/// entries). A follower further behind is served from disk, read outside the index lock
/// (`reader.rs`).
const RECENT_BYTES: u64 = 4 * 1024 * 1024;
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
    /// Told when each of the writer's operations starts and ends, when wired.
    disk_watch: OnceLock<Arc<crate::disk_watch::DiskWatch>>,
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

    /// Tells `watch` when each of the writer's operations is in flight (`disk_stall`).
    pub fn with_disk_watch(self, watch: Arc<crate::disk_watch::DiskWatch>) -> Self {
        let _ = self.shared.disk_watch.set(watch);
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
    /// committed vote is for itself. The node does so at every start, whatever its
    /// early-ack setting (`lib.rs`): it may have run with early acks before a crash, and
    /// a node under repair must anyway. openraft restores a leader from such a vote
    /// regardless of elections being off, and leading its old term on a cut log would
    /// reuse log ids that followers hold for other entries.
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
            disk_watch: OnceLock::new(),
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
        // Disk reads happen outside the lock (`reader.rs`); a frame that changed meanwhile
        // sends the range back to be read with the lock held.
        let plan = self.shared.lock().plan_read(start, end)?;
        match plan.read() {
            Ok(entries) => Ok(entries),
            Err(first) => {
                tracing::debug!(error = %first, "raft log read again under the lock");
                let index = self.shared.lock();
                index.plan_read(start, end)?.read()
            }
        }
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
