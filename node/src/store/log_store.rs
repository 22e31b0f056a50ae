//! The Raft log and vote on redb.
//!
//! Every append is one redb write transaction committed with immediate durability
//! (fsync) before openraft's callback is called: an entry is never acknowledged before
//! it is on disk. Appends arrive from openraft's single log-I/O task in order, and each
//! completes before the next starts, so callbacks fire in submission order.

use std::fmt::Debug;
use std::ops::{Bound, RangeBounds};
use std::sync::Arc;

use openraft::storage::{LogFlushed, RaftLogStorage};
use openraft::{Entry, LogId, LogState, RaftLogId, RaftLogReader, StorageIOError, Vote};
use redb::{Database, ReadableTable, TableDefinition};

use crate::raft_types::{NodeId, StorageError, TypeConfig};

const LOG: TableDefinition<u64, &[u8]> = TableDefinition::new("raft_log");
const META: TableDefinition<&str, &[u8]> = TableDefinition::new("raft_meta");

const VOTE_KEY: &str = "vote";
const COMMITTED_KEY: &str = "committed";
const PURGED_KEY: &str = "last_purged";

#[derive(Clone)]
pub struct LogStore {
    db: Arc<Database>,
    /// Observes the duration of each durable append, when metrics are wired.
    append_timer: Option<prometheus::Histogram>,
    /// The committed index openraft last reported (its metrics do not carry it).
    pub committed_index: Arc<std::sync::atomic::AtomicU64>,
}

fn read_err(e: impl std::error::Error + Send + Sync + 'static) -> StorageError {
    StorageIOError::read_logs(openraft::AnyError::new(&e)).into()
}

fn write_err(e: impl std::error::Error + Send + Sync + 'static) -> StorageError {
    StorageIOError::write_logs(openraft::AnyError::new(&e)).into()
}

impl LogStore {
    pub fn with_append_timer(mut self, timer: prometheus::Histogram) -> Self {
        self.append_timer = Some(timer);
        self
    }

    /// Opens the log tables in `db`, creating them if needed.
    pub fn open(db: Arc<Database>) -> Result<Self, redb::Error> {
        let txn = db.begin_write()?;
        txn.open_table(LOG)?;
        txn.open_table(META)?;
        txn.commit()?;
        Ok(LogStore {
            db,
            append_timer: None,
            committed_index: Arc::default(),
        })
    }

    fn get_meta<T: serde::de::DeserializeOwned>(
        &self,
        key: &str,
    ) -> Result<Option<T>, StorageError> {
        let txn = self.db.begin_read().map_err(read_err)?;
        let table = txn.open_table(META).map_err(read_err)?;
        let Some(value) = table.get(key).map_err(read_err)? else {
            return Ok(None);
        };
        serde_json::from_slice(value.value())
            .map(Some)
            .map_err(read_err)
    }

    fn put_meta<T: serde::Serialize>(
        &self,
        key: &str,
        value: &T,
        durability: redb::Durability,
    ) -> Result<(), StorageError> {
        let bytes = serde_json::to_vec(value).map_err(write_err)?;
        let mut txn = self.db.begin_write().map_err(write_err)?;
        txn.set_durability(durability);
        {
            let mut table = txn.open_table(META).map_err(write_err)?;
            table.insert(key, bytes.as_slice()).map_err(write_err)?;
        }
        txn.commit().map_err(write_err)
    }

    fn last_entry_id(&self) -> Result<Option<LogId<NodeId>>, StorageError> {
        let txn = self.db.begin_read().map_err(read_err)?;
        let table = txn.open_table(LOG).map_err(read_err)?;
        let Some((_, value)) = table.last().map_err(read_err)? else {
            return Ok(None);
        };
        let entry: Entry<TypeConfig> = serde_json::from_slice(value.value()).map_err(read_err)?;
        Ok(Some(*entry.get_log_id()))
    }

    /// Deletes entries with index in `range`, in one durable transaction.
    fn delete_range(&self, from: u64, to_inclusive: Option<u64>) -> Result<(), StorageError> {
        let txn = self.db.begin_write().map_err(write_err)?;
        {
            let mut table = txn.open_table(LOG).map_err(write_err)?;
            let end = to_inclusive.map_or(Bound::Unbounded, Bound::Included);
            table
                .retain_in((Bound::Included(from), end), |_, _| false)
                .map_err(write_err)?;
        }
        txn.commit().map_err(write_err)
    }
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + Send>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry<TypeConfig>>, StorageError> {
        let txn = self.db.begin_read().map_err(read_err)?;
        let table = txn.open_table(LOG).map_err(read_err)?;
        let start = range.start_bound().cloned();
        let end = range.end_bound().cloned();
        let mut entries = Vec::new();
        for item in table.range::<u64>((start, end)).map_err(read_err)? {
            let (_, value) = item.map_err(read_err)?;
            entries.push(serde_json::from_slice(value.value()).map_err(read_err)?);
        }
        Ok(entries)
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError> {
        let last_purged: Option<LogId<NodeId>> = self.get_meta(PURGED_KEY)?;
        let last = self.last_entry_id()?.or(last_purged);
        Ok(LogState {
            last_purged_log_id: last_purged,
            last_log_id: last,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), StorageError> {
        self.put_meta(VOTE_KEY, vote, redb::Durability::Immediate)
            .map_err(|e| StorageIOError::write_vote(openraft::AnyError::new(&e)).into())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError> {
        self.get_meta(VOTE_KEY)
    }

    async fn save_committed(
        &mut self,
        committed: Option<LogId<NodeId>>,
    ) -> Result<(), StorageError> {
        self.committed_index.store(
            committed.map_or(0, |l| l.index),
            std::sync::atomic::Ordering::Relaxed,
        );
        // Only a hint for re-applying after a restart; the next durable commit (any log
        // append) persists it. Losing it costs re-application, never correctness.
        self.put_meta(COMMITTED_KEY, &committed, redb::Durability::None)
    }

    async fn read_committed(&mut self) -> Result<Option<LogId<NodeId>>, StorageError> {
        Ok(self
            .get_meta::<Option<LogId<NodeId>>>(COMMITTED_KEY)?
            .flatten())
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
        let _timer = self.append_timer.as_ref().map(|t| t.start_timer());
        let result = (|| {
            let txn = self.db.begin_write().map_err(write_err)?;
            {
                let mut table = txn.open_table(LOG).map_err(write_err)?;
                for entry in entries {
                    let bytes = serde_json::to_vec(&entry).map_err(write_err)?;
                    table
                        .insert(entry.get_log_id().index, bytes.as_slice())
                        .map_err(write_err)?;
                }
            }
            // Immediate durability: commit returns after fsync.
            txn.commit().map_err(write_err)
        })();
        match result {
            Ok(()) => {
                callback.log_io_completed(Ok(()));
                Ok(())
            }
            Err(e) => {
                callback.log_io_completed(Err(std::io::Error::other(e.to_string())));
                Err(e)
            }
        }
    }

    async fn truncate(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError> {
        self.delete_range(log_id.index, None)
    }

    async fn purge(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError> {
        // Record the purge point first: if we crash before deleting, the entries are
        // simply purged again on the next purge.
        self.put_meta(PURGED_KEY, &log_id, redb::Durability::Immediate)?;
        self.delete_range(0, Some(log_id.index))
    }
}
