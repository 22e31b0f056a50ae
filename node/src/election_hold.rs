//! When this node may stand for election: never while it is under repair
//! (`store::repair_floor`), never while a current leader streams it a snapshot, and
//! never while its disk is stalled (`disk_stall`: it could not keep the vote it asks
//! for, nor the entries it would lead with).
//!
//! Why the second: openraft 0.9 does not restart a follower's election timer on
//! snapshot chunks, and while a large body streamed and was installed the heartbeats
//! that would have restarted it came too late. The follower campaigned mid-stream;
//! without pre-vote its higher term unseated a healthy leader, whose next stream started
//! again from offset 0: a livelock (ARCHITECTURE.md, "Snapshot streams"). A leader that
//! dies mid-stream is still replaced: the other voters campaign as ever, and this one
//! may once the stream has been quiet for [`STREAM_QUIET`].

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

/// How long after its last chunk a stream counts as over. Chunks of a live stream follow
/// each other within a few hundred milliseconds (256 KiB each, from a local file); this
/// is over twice the longest election timeout with its lease (1.4 s, node id 4), and what
/// a leader that died mid-stream costs this node before it may campaign.
pub const STREAM_QUIET: Duration = Duration::from_secs(3);

/// Turns this node's elections on or off (`raft.runtime_config().elect`).
type SetElect = Box<dyn Fn(bool) + Send + Sync>;

pub struct ElectionHold {
    set_elect: SetElect,
    hold: Mutex<Hold>,
}

#[derive(Debug)]
struct Hold {
    repairing: bool,
    disk_stalled: bool,
    /// Snapshot requests in hand right now (their bodies read, their chunks being
    /// stored, or, for the last, the snapshot being installed).
    chunks_in_hand: usize,
    /// When the last snapshot request arrived or finished.
    last_chunk: Option<Instant>,
    /// What `set_elect` was last told (the Raft config's value at first).
    electing: bool,
    /// A task is waiting for the stream to go quiet.
    watching: bool,
}

impl Hold {
    fn streaming(&self, now: Instant) -> bool {
        self.chunks_in_hand > 0
            || self
                .last_chunk
                .is_some_and(|t| now.saturating_duration_since(t) < STREAM_QUIET)
    }

    fn may_elect(&self, now: Instant) -> bool {
        !self.repairing && !self.disk_stalled && !self.streaming(now)
    }
}

impl ElectionHold {
    /// `repairing`: the node starts under repair, with elections off in its Raft config.
    pub fn new(set_elect: impl Fn(bool) + Send + Sync + 'static, repairing: bool) -> Arc<Self> {
        Arc::new(ElectionHold {
            set_elect: Box::new(set_elect),
            hold: Mutex::new(Hold {
                repairing,
                disk_stalled: false,
                chunks_in_hand: 0,
                last_chunk: None,
                electing: !repairing,
                watching: false,
            }),
        })
    }

    /// A snapshot request from a current leader arrived; elections stay off at least until
    /// the returned turn is dropped (after the chunk is stored, or for the last one,
    /// after the snapshot is installed: an install that hangs keeps this node from
    /// campaigning, never from voting) and the stream has been quiet since.
    pub fn snapshot_chunk(self: &Arc<Self>) -> ChunkTurn {
        let now = Instant::now();
        let start_watch = {
            let mut hold = self.lock();
            hold.chunks_in_hand += 1;
            hold.last_chunk = Some(now);
            self.settle(&mut hold, now);
            !std::mem::replace(&mut hold.watching, true)
        };
        if start_watch {
            tokio::spawn(self.clone().watch_until_quiet());
        }
        ChunkTurn { hold: self.clone() }
    }

    /// The repair is over (the log has passed its floor).
    pub fn repaired(&self) {
        let mut hold = self.lock();
        hold.repairing = false;
        self.settle(&mut hold, Instant::now());
    }

    /// This node's disk stalled (`true`) or answers again (`false`). Called from
    /// `disk_stall`'s own thread: nothing here needs the async runtime.
    pub fn disk_stalled(&self, stalled: bool) {
        let mut hold = self.lock();
        hold.disk_stalled = stalled;
        self.settle(&mut hold, Instant::now());
    }

    /// Whether this node may stand for election now (the Raft config's flag follows it).
    #[cfg(test)]
    fn may_elect(&self) -> bool {
        self.lock().electing
    }

    /// Turns elections back on once the stream has gone quiet; bounded by the stream
    /// itself, since every step without a new chunk brings the quiet time closer.
    async fn watch_until_quiet(self: Arc<Self>) {
        loop {
            tokio::time::sleep(STREAM_QUIET / 4).await;
            let mut hold = self.lock();
            let now = Instant::now();
            self.settle(&mut hold, now);
            if !hold.streaming(now) {
                hold.watching = false;
                return;
            }
        }
    }

    /// Tells Raft what the hold now says, when that changed.
    fn settle(&self, hold: &mut Hold, now: Instant) {
        let may_elect = hold.may_elect(now);
        if may_elect != hold.electing {
            hold.electing = may_elect;
            (self.set_elect)(may_elect);
            if may_elect {
                tracing::info!("this node takes part in elections again");
            } else if hold.disk_stalled {
                tracing::info!("the disk is stalled: elections off until it answers");
            } else if hold.streaming(now) {
                tracing::info!("receiving a snapshot: elections off until its stream is over");
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Hold> {
        // The hold's fields are consistent after every statement: a panic elsewhere
        // while it was locked leaves nothing half-done.
        self.hold.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One snapshot request in hand (`ElectionHold::snapshot_chunk`).
pub struct ChunkTurn {
    hold: Arc<ElectionHold>,
}

impl Drop for ChunkTurn {
    fn drop(&mut self) {
        let now = Instant::now();
        let mut hold = self.hold.lock();
        hold.chunks_in_hand = hold.chunks_in_hand.saturating_sub(1);
        hold.last_chunk = Some(now);
        self.hold.settle(&mut hold, now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// A hold whose Raft flag is a bool the test reads.
    fn recorded(repairing: bool) -> (Arc<ElectionHold>, Arc<AtomicBool>) {
        let flag = Arc::new(AtomicBool::new(!repairing));
        let set = flag.clone();
        let hold = ElectionHold::new(move |on| set.store(on, Ordering::SeqCst), repairing);
        (hold, flag)
    }

    /// Lets paused time run `by` in small steps, so the watcher sees each.
    async fn pass(by: Duration) {
        let step = Duration::from_millis(50);
        let mut passed = Duration::ZERO;
        while passed < by {
            tokio::time::sleep(step).await;
            passed += step;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn elections_are_off_from_the_first_chunk_until_the_stream_is_quiet() {
        let (hold, raft_elects) = recorded(false);
        let elects = || raft_elects.load(Ordering::SeqCst);
        assert!(elects());
        drop(hold.snapshot_chunk());
        assert!(!elects(), "the next chunk may follow");
        pass(STREAM_QUIET / 2).await;
        // A chunk within the quiet time restarts it.
        drop(hold.snapshot_chunk());
        pass(STREAM_QUIET * 3 / 4).await;
        assert!(!elects(), "{:?} after the last chunk", STREAM_QUIET * 3 / 4);
        pass(STREAM_QUIET / 2).await;
        assert!(elects() && hold.may_elect());
        // A second stream holds them again.
        drop(hold.snapshot_chunk());
        assert!(!elects() && !hold.may_elect());
        pass(STREAM_QUIET * 2).await;
        assert!(elects());
    }

    #[tokio::test(start_paused = true)]
    async fn a_chunk_in_hand_holds_elections_however_long_it_takes() {
        let (hold, raft_elects) = recorded(false);
        // The last chunk installs the whole snapshot, which takes seconds for a large state.
        let installing = hold.snapshot_chunk();
        pass(STREAM_QUIET * 4).await;
        assert!(!raft_elects.load(Ordering::SeqCst));
        drop(installing);
        pass(STREAM_QUIET / 2).await;
        assert!(!raft_elects.load(Ordering::SeqCst));
        pass(STREAM_QUIET).await;
        assert!(raft_elects.load(Ordering::SeqCst));
    }

    #[tokio::test(start_paused = true)]
    async fn a_node_under_repair_elects_only_once_repaired_and_its_stream_is_over() {
        let (hold, raft_elects) = recorded(true);
        let elects = || raft_elects.load(Ordering::SeqCst);
        assert!(!hold.may_elect());
        drop(hold.snapshot_chunk());
        pass(STREAM_QUIET * 2).await;
        assert!(!elects(), "a quiet stream does not end a repair");
        let turn = hold.snapshot_chunk();
        hold.repaired();
        assert!(!elects(), "a repair's end does not end a stream");
        drop(turn);
        pass(STREAM_QUIET * 2).await;
        assert!(elects() && hold.may_elect());
    }

    #[tokio::test(start_paused = true)]
    async fn a_stalled_disk_holds_elections_until_it_answers_and_any_stream_is_over() {
        let (hold, raft_elects) = recorded(false);
        let elects = || raft_elects.load(Ordering::SeqCst);
        hold.disk_stalled(true);
        assert!(!elects());
        drop(hold.snapshot_chunk());
        hold.disk_stalled(false);
        assert!(!elects(), "the disk answering does not end a stream");
        pass(STREAM_QUIET * 2).await;
        assert!(elects());
        hold.disk_stalled(true);
        pass(STREAM_QUIET * 2).await;
        assert!(
            !elects(),
            "a stall has no quiet time: it lasts until the disk answers"
        );
        hold.disk_stalled(false);
        assert!(elects());
    }
}
