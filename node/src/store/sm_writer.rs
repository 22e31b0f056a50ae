//! Write-behind for the state machine: applies fold into memory and answer at once; this
//! thread commits their rows (records, idempotency answers, agent index, last applied) to
//! redb, everything queued in one transaction.
//!
//! Why: measured here, redb inserts and commits were a third of a node's busy CPU and sat on
//! the leader's path before every answer; with the rows written behind, one transaction
//! carries many applies. Until a batch is committed its rows stay in the state machine's
//! overlay (`Unflushed`), which reads consult, so nothing applied is ever invisible.
//!
//! Order and crash safety: batches commit in apply order, each transaction carrying the
//! last applied log id of its last batch, so redb always holds a prefix of the applies; a
//! crash loses only applies the Raft log still has, and openraft applies them again.
//! Every `fsync_interval` a commit is durable. A failed commit leaves the writer refusing
//! all later work (fail-stop): the next apply fails and openraft stops the node.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use redb::{Database, TableDefinition};

/// The rows one apply produced.
#[derive(Default)]
pub struct RowBatch {
    pub seq: u64,
    pub records: Vec<(String, u64, String)>,
    /// Each answer's row key, its row, and when it was stored (seconds since the epoch).
    pub idempotency: Vec<(String, Vec<u8>, u64)>,
    pub new_agents: Vec<String>,
    /// Serialized last applied log id and membership, as of this batch.
    pub applied: Vec<u8>,
    pub membership: Vec<u8>,
}

enum Message {
    Rows(RowBatch),
    /// Answered once everything sent before it is committed.
    Barrier(mpsc::Sender<Result<(), String>>),
}

/// Tables the writer fills (the state machine owns their definitions).
#[derive(Clone, Copy)]
pub struct Tables {
    pub records: TableDefinition<'static, (&'static str, u64), &'static str>,
    pub idempotency: TableDefinition<'static, &'static str, &'static [u8]>,
    pub agent_index: TableDefinition<'static, &'static str, ()>,
    pub meta: TableDefinition<'static, &'static str, &'static [u8]>,
    pub applied_key: &'static str,
    /// The last applied id again, as of which `record_ends` is current (`record_ends`).
    pub ends_applied_key: &'static str,
    pub membership_key: &'static str,
}

/// What the writer thread and the state machine share.
struct WriterState {
    /// Every batch with `seq` up to this is committed.
    flushed_through: AtomicU64,
    failed: Mutex<Option<String>>,
    /// When redb last committed with an fsync.
    last_durable: Mutex<Instant>,
    fsync_interval_ms: AtomicU64,
    /// Agents with record rows committed since the merge last took this
    /// (`StateMachine::merge_record_runs` packs theirs). Kept here, at the commit, not at
    /// the apply: a merge sees only committed rows, and an agent it took before its rows
    /// were committed would wait for its next write.
    committed_agents: Mutex<BTreeSet<String>>,
    /// Told when each commit is in flight (`disk_stall`), when wired.
    disk_watch: std::sync::OnceLock<Arc<crate::disk_watch::DiskWatch>>,
}

impl WriterState {
    /// Marks a commit to the state file as in flight until the guard is dropped. Take it
    /// once the write transaction is yours: redb allows one at a time, so every commit
    /// to the file shares this slot, and a wait behind another's is not the disk's.
    fn state_file_write(&self) -> Option<crate::disk_watch::Writing<'_>> {
        let watch = self.disk_watch.get()?;
        Some(watch.writing(crate::disk_watch::DiskWrite::StateFile))
    }

    fn check(&self) -> Result<(), String> {
        match &*self.failed.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(reason) => Err(format!("the state machine writer failed: {reason}")),
            None => Ok(()),
        }
    }

    fn take_durable_turn(&self) -> bool {
        let interval = Duration::from_millis(self.fsync_interval_ms.load(Ordering::Relaxed));
        let mut last = self.last_durable.lock().unwrap_or_else(|p| p.into_inner());
        if last.elapsed() >= interval {
            *last = Instant::now();
            true
        } else {
            false
        }
    }
}

/// Stops the thread when the last handle goes: closes the queue (the thread commits what
/// is left), then joins it, so the database is closed when this returns.
struct Lifetime {
    sender: Option<mpsc::Sender<Message>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Lifetime {
    fn drop(&mut self) {
        self.sender.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The state machine's handle on the writer thread.
#[derive(Clone)]
pub struct SmWriter {
    lifetime: Arc<Lifetime>,
    state: Arc<WriterState>,
}

impl SmWriter {
    pub fn spawn(
        db: Arc<Database>,
        tables: Tables,
        fsync_interval: Duration,
    ) -> Result<SmWriter, String> {
        let (sender, receiver) = mpsc::channel();
        let state = Arc::new(WriterState {
            flushed_through: AtomicU64::new(0),
            failed: Mutex::new(None),
            last_durable: Mutex::new(Instant::now()),
            fsync_interval_ms: AtomicU64::new(fsync_interval.as_millis() as u64),
            committed_agents: Mutex::new(BTreeSet::new()),
            disk_watch: std::sync::OnceLock::new(),
        });
        let for_thread = state.clone();
        let thread = std::thread::Builder::new()
            .name("sm-writer".into())
            .spawn(move || {
                lower_this_threads_priority();
                run(&for_thread, &db, tables, &receiver)
            })
            .map_err(|e| format!("cannot start the state machine writer: {e}"))?;
        Ok(SmWriter {
            lifetime: Arc::new(Lifetime {
                sender: Some(sender),
                thread: Some(thread),
            }),
            state,
        })
    }

    /// Tells `watch` when each commit is in flight (`disk_stall`).
    pub fn watch_disk(&self, watch: Arc<crate::disk_watch::DiskWatch>) {
        let _ = self.state.disk_watch.set(watch);
    }

    /// Marks a commit to the state file made beside the writer (an entry's own, a merge,
    /// a checkpoint) as in flight until the guard is dropped, as the writer marks its
    /// own (`WriterState::state_file_write`).
    pub fn state_file_write(&self) -> Option<crate::disk_watch::Writing<'_>> {
        self.state.state_file_write()
    }

    pub fn set_fsync_interval(&self, interval: Duration) {
        self.state
            .fsync_interval_ms
            .store(interval.as_millis() as u64, Ordering::Relaxed);
    }

    /// With a zero fsync interval the state machine is written through: each apply waits
    /// for its rows to be committed, durably.
    pub fn writes_through(&self) -> bool {
        self.state.fsync_interval_ms.load(Ordering::Relaxed) == 0
    }

    pub fn flushed_through(&self) -> u64 {
        self.state.flushed_through.load(Ordering::Acquire)
    }

    pub fn check(&self) -> Result<(), String> {
        self.state.check()
    }

    /// The agents with record rows committed since the last call.
    pub fn take_committed(&self) -> BTreeSet<String> {
        std::mem::take(
            &mut *self
                .state
                .committed_agents
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
        )
    }

    /// Hands an agent back for the next [`take_committed`](Self::take_committed).
    pub fn put_back(&self, agent_id: String) {
        self.state
            .committed_agents
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(agent_id);
    }

    /// Whether a commit now should be durable (then the turn is taken).
    pub fn take_durable_turn(&self) -> bool {
        self.state.take_durable_turn()
    }

    fn sender(&self) -> Result<&mpsc::Sender<Message>, String> {
        self.lifetime
            .sender
            .as_ref()
            .ok_or_else(|| "the state machine writer has stopped".to_string())
    }

    pub fn send(&self, rows: RowBatch) -> Result<(), String> {
        self.check()?;
        self.sender()?
            .send(Message::Rows(rows))
            .map_err(|_| "the state machine writer has stopped".to_string())
    }

    /// Waits until every batch sent so far is committed.
    pub fn barrier(&self) -> Result<(), String> {
        let (reply, answer) = mpsc::channel();
        self.sender()?
            .send(Message::Barrier(reply))
            .map_err(|_| "the state machine writer has stopped".to_string())?;
        answer
            .recv()
            .map_err(|_| "the state machine writer has stopped".to_string())?
    }
}

/// The writer is write-behind (every record is durable in the Raft log before it gets
/// here), so it runs at a lower CPU priority: on a busy machine its commits take idle
/// time rather than the cores that decide and replicate. With the apply done inline,
/// 3-node `cluster_load` gained 8–15% in three alternating pairs, with less CPU per
/// decision on every node. On Linux the nice value is per thread (`None` names the
/// calling one). A failure (say, a seccomp filter) leaves the priority as it was, which
/// is only slower.
fn lower_this_threads_priority() {
    if let Err(e) = rustix::process::setpriority_process(None, 10) {
        tracing::debug!(error = %e, "cannot lower the state machine writer's priority");
    }
}

/// How long the writer gathers rows before it commits them (unless someone waits on a
/// barrier): one transaction then carries many applies. Nobody's answer waits for it.
/// Each redb commit has a fixed cost (copied pages, free-list and checksum upkeep): 5 ms
/// cost 420 µs CPU per decision on the leader of 3 nodes, 30 ms 370 µs and 100 ms 360 µs
/// with a longer p99; measured with `cluster_load --nodes 3`. Since records are stored as
/// one run per agent per commit (`record_rows`), 60 ms against 30 ms gave 5% more
/// decisions/s and 5% less CPU on every node in four alternating pairs, same p99.
const LINGER: Duration = Duration::from_millis(60);

fn run(state: &WriterState, db: &Database, tables: Tables, receiver: &mpsc::Receiver<Message>) {
    while let Ok(first) = receiver.recv() {
        let deadline = Instant::now() + LINGER;
        let mut rows = Vec::new();
        let mut next = Some(first);
        while let Some(message) = next.take() {
            match message {
                Message::Rows(batch) => rows.push(batch),
                Message::Barrier(reply) => {
                    commit(state, db, tables, std::mem::take(&mut rows));
                    let _ = reply.send(state.check());
                    // Whoever waited has what they need; start a new gathering.
                    break;
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            next = match receiver.recv_timeout(left) {
                Ok(message) => Some(message),
                Err(mpsc::RecvTimeoutError::Timeout) => None,
                Err(mpsc::RecvTimeoutError::Disconnected) => None,
            };
        }
        commit(state, db, tables, rows);
    }
}

fn commit(state: &WriterState, db: &Database, tables: Tables, rows: Vec<RowBatch>) {
    let Some(last_seq) = rows.last().map(|b| b.seq) else {
        return;
    };
    if state.check().is_err() {
        return;
    }
    let durable = state.take_durable_turn();
    match write_rows(state, db, tables, durable, &rows) {
        Ok(ends) => {
            state
                .committed_agents
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .extend(ends.into_keys().map(str::to_string));
            state.flushed_through.store(last_seq, Ordering::Release)
        }
        Err(e) => {
            tracing::error!(error = %e, "state machine commit failed; refusing further applies");
            *state.failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
        }
    }
}

/// Each agent with records in a commit, and the seq after its last one there.
type Ends<'a> = BTreeMap<&'a str, u64>;

/// Commits `rows` in one transaction; returns where each agent's records in it end.
/// The write counts as in flight from when the transaction is ours (waiting for
/// another transaction, a merge or a checkpoint, is not the disk stalling).
fn write_rows<'a>(
    state: &WriterState,
    db: &Database,
    tables: Tables,
    durable: bool,
    rows: &'a [RowBatch],
) -> Result<Ends<'a>, String> {
    let text = |e: redb::Error| e.to_string();
    let mut txn = db.begin_write().map_err(|e| text(e.into()))?;
    let _writing = state.state_file_write();
    if !durable {
        txn.set_durability(redb::Durability::None);
    }
    let ends = {
        let mut records = txn.open_table(tables.records).map_err(|e| text(e.into()))?;
        let mut idempotency = txn
            .open_table(tables.idempotency)
            .map_err(|e| text(e.into()))?;
        let mut expiry = txn
            .open_table(super::idempotency_expiry::IDEMPOTENCY_EXPIRY)
            .map_err(|e| text(e.into()))?;
        let mut index = txn
            .open_table(tables.agent_index)
            .map_err(|e| text(e.into()))?;
        let mut meta = txn.open_table(tables.meta).map_err(|e| text(e.into()))?;
        // Sorted, each agent's new records make one run (one row; `record_rows`).
        let mut sorted_records = BTreeMap::new();
        for batch in rows {
            for (agent, seq, line) in &batch.records {
                sorted_records.insert((agent.as_str(), *seq), line.as_str());
            }
            for (key, value, stored_secs) in &batch.idempotency {
                idempotency
                    .insert(key.as_str(), value.as_slice())
                    .map_err(|e| text(e.into()))?;
                super::idempotency_expiry::put(&mut expiry, *stored_secs, key, value)
                    .map_err(|e| text(e.into()))?;
            }
            for agent in &batch.new_agents {
                index
                    .insert(agent.as_str(), ())
                    .map_err(|e| text(e.into()))?;
            }
        }
        // Each agent's records here, in seq order: the last one's end is stored with the
        // rows, checked at start-up (`record_ends`).
        let mut ends: Ends<'a> = BTreeMap::new();
        for &(agent, seq) in sorted_records.keys() {
            ends.insert(agent, seq.saturating_add(1));
        }
        super::record_rows::insert_runs(
            &mut records,
            sorted_records
                .into_iter()
                .map(|((agent, seq), line)| (agent, seq, line)),
        )
        .map_err(|e| text(e.into()))?;
        let mut stored_ends = txn
            .open_table(super::record_ends::RECORD_ENDS)
            .map_err(|e| text(e.into()))?;
        for (agent, &end) in &ends {
            super::record_ends::put(&mut stored_ends, agent, end).map_err(|e| text(e.into()))?;
        }
        if let Some(last) = rows.last() {
            meta.insert(tables.applied_key, last.applied.as_slice())
                .map_err(|e| text(e.into()))?;
            meta.insert(tables.ends_applied_key, last.applied.as_slice())
                .map_err(|e| text(e.into()))?;
            meta.insert(tables.membership_key, last.membership.as_slice())
                .map_err(|e| text(e.into()))?;
        }
        ends
    };
    if rows.iter().any(|batch| !batch.idempotency.is_empty()) {
        super::idempotency_expiry::store_count(&txn)?;
    }
    txn.commit().map_err(|e| text(e.into()))?;
    Ok(ends)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLES: Tables = Tables {
        records: TableDefinition::new("records"),
        idempotency: TableDefinition::new("idempotency"),
        agent_index: TableDefinition::new("agent_index"),
        meta: TableDefinition::new("meta"),
        applied_key: "applied",
        ends_applied_key: "ends_applied",
        membership_key: "membership",
    };

    /// The nice value of each of this process's threads named `name`, from /proc (field
    /// 19 of a stat line, counted after the parenthesised name).
    fn nice_of_threads_named(name: &str) -> Vec<i32> {
        let mut nice = Vec::new();
        for task in std::fs::read_dir("/proc/self/task").unwrap() {
            let task = task.unwrap().path();
            let Ok(comm) = std::fs::read_to_string(task.join("comm")) else {
                continue; // the thread ended meanwhile
            };
            if comm.trim_end() != name {
                continue;
            }
            let stat = std::fs::read_to_string(task.join("stat")).unwrap();
            let after_name = &stat[stat.rfind(')').unwrap() + 2..];
            nice.push(after_name.split(' ').nth(16).unwrap().parse().unwrap());
        }
        nice
    }

    /// The writer's thread runs below normal priority once it has started (a barrier
    /// answered means it has), and the thread that spawned it keeps its own. Under a
    /// test run already niced past 10, lowering is refused and the writer keeps that.
    #[test]
    fn the_writer_thread_runs_at_a_lower_priority() {
        let before = rustix::process::getpriority_process(None).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let db = Arc::new(Database::create(dir.path().join("t.redb")).unwrap());
        let writer = SmWriter::spawn(db, TABLES, Duration::from_secs(5)).unwrap();
        writer.barrier().unwrap();
        let nice = nice_of_threads_named("sm-writer");
        assert!(!nice.is_empty(), "no sm-writer thread found");
        assert!(nice.iter().all(|n| *n == before.max(10)), "{nice:?}");
        assert_eq!(rustix::process::getpriority_process(None).unwrap(), before);
    }
}
