//! The overlay: rows applied in memory that the writer has not committed yet; reads
//! consult it before the tables.

use std::collections::BTreeMap;

use super::super::sm_writer::RowBatch;

/// The overlay of rows on their way to redb: reads consult it before the tables.
#[derive(Debug, Default)]
pub(super) struct Unflushed {
    pub(super) records: BTreeMap<(String, u64), String>,
    pub(super) idempotency: std::collections::HashMap<String, Vec<u8>>,
    /// Each batch's keys, oldest first, to drop them once the batch is committed.
    pub(super) batches: std::collections::VecDeque<UnflushedKeys>,
}

#[derive(Debug)]
pub(super) struct UnflushedKeys {
    seq: u64,
    records: Vec<(String, u64)>,
    idempotency: Vec<String>,
}

impl Unflushed {
    /// Forgets rows of batches committed through `flushed` (they are in redb now).
    pub(super) fn prune(&mut self, flushed: u64) {
        while self.batches.front().is_some_and(|b| b.seq <= flushed) {
            let Some(batch) = self.batches.pop_front() else {
                break;
            };
            for key in &batch.records {
                self.records.remove(key);
            }
            for key in &batch.idempotency {
                self.idempotency.remove(key);
            }
        }
    }

    pub(super) fn add(&mut self, rows: &RowBatch) {
        let mut keys = UnflushedKeys {
            seq: rows.seq,
            records: Vec::with_capacity(rows.records.len()),
            idempotency: Vec::with_capacity(rows.idempotency.len()),
        };
        for (agent, seq, line) in &rows.records {
            self.records.insert((agent.clone(), *seq), line.clone());
            keys.records.push((agent.clone(), *seq));
        }
        for (key, value, _) in &rows.idempotency {
            self.idempotency.insert(key.clone(), value.clone());
            keys.idempotency.push(key.clone());
        }
        self.batches.push_back(keys);
    }
}

/// Batches written behind before an apply waits for the writer (backpressure).
pub(super) const MAX_UNFLUSHED_BATCHES: usize = 256;
