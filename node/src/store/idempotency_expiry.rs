//! How long a stored idempotency answer is kept. Both clients send an Idempotency-Key
//! with every write, so without an end every decision would leave an answer (about 500
//! bytes of pages) on every replica for good: as much disk as its records. An answer is
//! there for retries, which come within seconds or minutes; after the window (a day by
//! default) it is removed, and a request sent again under its key is a new request.
//!
//! `idempotency_expiry` indexes the answers by when they were stored: (seconds since the
//! epoch, the answer's row key) → SHA-256 of those and of the answer's row. The row is
//! written in the transaction that stores the answer (`sm_writer`), so no answer goes
//! unindexed. Its time is the later of the write's record time and this node's clock
//! when it applied the write, so each node keeps an answer a whole window by its own
//! clock, whatever the leader's said. That clock ([`now_secs`]) never runs faster than
//! real time within a run: a wall clock stepped forward, or back and then forward again,
//! does not make answers look older than they are (across a restart it does not know
//! what the clock did before). Pruning removes an answer only where
//! its index row matches the answer under that key now: a changed index row (its time or
//! key) or an answer stored again under the key after it expired never leads to
//! removing an answer early. The answer is then indexed again as of now: at worst it
//! outlives its window. (Two answers under one key never have the same bytes: each
//! names what its write appended, an action id or the agent's new head.)
//!
//! Every transaction that changes the answers also stores how many there are
//! (`idempotency_count`). A file from before the index has no `idempotency_expiry`
//! table, one a build from before the index has written to since holds another count
//! than it stores, and one whose index lost rows holds fewer rows than answers: opening
//! any of them indexes every stored answer as of then
//! (`index_all`), and so does installing a snapshot, whose answers come without their
//! times. Such a re-indexed answer is kept a window from the opening, never less than
//! a window from when this node applied it.

use redb::{
    ReadableTable, ReadableTableMetadata, Table, TableDefinition, TableHandle, WriteTransaction,
};
use sha2::{Digest, Sha256};

use super::idempotency_rows::IDEMPOTENCY;

/// (seconds since the epoch the answer was stored, its row key) → `index_digest`.
pub const IDEMPOTENCY_EXPIRY: TableDefinition<(u64, &str), &[u8]> =
    TableDefinition::new("idempotency_expiry");

/// `answers` → how many rows `idempotency` held after the last transaction this build
/// made to it. Unsealed: any difference, a damaged value included, only has every answer
/// indexed again, which keeps answers longer, never shorter.
const IDEMPOTENCY_COUNT: TableDefinition<&str, u64> = TableDefinition::new("idempotency_count");
const COUNT_KEY: &str = "answers";

/// Default for how long an answer is kept: a day.
pub const DEFAULT_WINDOW_SECS: u64 = 24 * 60 * 60;

/// Seconds since the epoch by this process's expiry clock: the wall clock, except that
/// it never moves on faster than the monotonic clock since its anchor (its first
/// reading, or the last time it followed the wall clock back). A wall clock stepped back
/// is followed; stepped forward again, it is not (this clock stays behind by the step
/// until the process restarts). A process started with its clock ahead believes it.
pub fn now_secs() -> u64 {
    static CLOCK: std::sync::Mutex<Option<SteadyWall>> = std::sync::Mutex::new(None);
    let wall = lineage_core::record::timestamp::now_micros();
    let mut clock = CLOCK.lock().unwrap_or_else(|p| p.into_inner());
    let now = match clock.as_mut() {
        Some(clock) => clock.read(wall, std::time::Instant::now()),
        None => {
            *clock = Some(SteadyWall {
                micros: wall,
                at: std::time::Instant::now(),
            });
            wall
        }
    };
    u64::try_from(now / 1_000_000).unwrap_or_default()
}

/// [`now_secs`]'s clock: an anchor (a wall reading and when it was taken), from which
/// it runs on with the monotonic clock. It moves the anchor only to follow a wall clock
/// stepped back, so no rounding builds up between readings.
struct SteadyWall {
    micros: i64,
    at: std::time::Instant,
}

impl SteadyWall {
    /// The clock at `at`, given the wall clock then: never further on than the time
    /// that passed since the anchor.
    fn read(&mut self, wall_micros: i64, at: std::time::Instant) -> i64 {
        let passed = at.saturating_duration_since(self.at).as_micros();
        let steady = self
            .micros
            .saturating_add(i64::try_from(passed).unwrap_or(i64::MAX));
        if wall_micros < steady {
            self.micros = wall_micros;
            self.at = at;
            return wall_micros;
        }
        steady
    }
}

/// What an index row holds: SHA-256 over its time, its key and the answer's stored row.
fn index_digest(stored_secs: u64, key: &str, answer_row: &[u8]) -> [u8; 32] {
    let mut hasher = Sha256::new();
    hasher.update(stored_secs.to_be_bytes());
    hasher.update((key.len() as u64).to_be_bytes());
    hasher.update(key.as_bytes());
    hasher.update(answer_row);
    hasher.finalize().into()
}

/// Indexes the answer stored as `answer_row` under `key` at `stored_secs`.
pub fn put(
    table: &mut Table<(u64, &'static str), &'static [u8]>,
    stored_secs: u64,
    key: &str,
    answer_row: &[u8],
) -> Result<(), redb::StorageError> {
    let digest = index_digest(stored_secs, key, answer_row);
    table.insert((stored_secs, key), digest.as_slice())?;
    Ok(())
}

/// Whether some stored answer may have no index row: the file has no index (from
/// before it), the answers are not as many as this build last counted (a build from
/// before the index stored some since), or the index holds fewer rows than there are
/// answers (rows lost). redb keeps the counts, so this reads no rows.
pub fn needs_indexing(txn: &WriteTransaction) -> Result<bool, String> {
    let text = |e: &dyn std::fmt::Display| format!("counting idempotency answers: {e}");
    let kept = txn
        .list_tables()
        .map_err(|e| text(&e))?
        .any(|table| table.name() == IDEMPOTENCY_EXPIRY.name());
    if !kept {
        return Ok(true);
    }
    let answers = txn.open_table(IDEMPOTENCY).map_err(|e| text(&e))?;
    let counted = txn.open_table(IDEMPOTENCY_COUNT).map_err(|e| text(&e))?;
    let counted = counted
        .get(COUNT_KEY)
        .map_err(|e| text(&e))?
        .map(|c| c.value());
    let stored = answers.len().map_err(|e| text(&e))?;
    // Every answer is stored with an index row, and pruning removes a row only with its
    // answer or to index it again, but for a row whose key changed on disk (`absent`):
    // fewer rows than answers means an answer lost its row and would be kept for good.
    // (Rows an answer stored again left behind can hide as many; pruning drops those.)
    let indexed = txn
        .open_table(IDEMPOTENCY_EXPIRY)
        .map_err(|e| text(&e))?
        .len()
        .map_err(|e| text(&e))?;
    Ok(counted != Some(stored) || indexed < stored)
}

/// Stores how many answers `txn` leaves (after every change to them).
pub fn store_count(txn: &WriteTransaction) -> Result<(), String> {
    let text = |e: &dyn std::fmt::Display| format!("counting idempotency answers: {e}");
    let answers = txn
        .open_table(IDEMPOTENCY)
        .map_err(|e| text(&e))?
        .len()
        .map_err(|e| text(&e))?;
    txn.open_table(IDEMPOTENCY_COUNT)
        .map_err(|e| text(&e))?
        .insert(COUNT_KEY, answers)
        .map_err(|e| text(&e))?;
    Ok(())
}

/// Replaces the index with every stored answer, as stored at `now_secs` (not before
/// this node applied it); returns how many.
pub fn index_all(txn: &WriteTransaction, now_secs: u64) -> Result<u64, String> {
    let text = |e: &dyn std::fmt::Display| format!("indexing idempotency answers: {e}");
    txn.delete_table(IDEMPOTENCY_EXPIRY).map_err(|e| text(&e))?;
    let mut count = 0;
    {
        let answers = txn.open_table(IDEMPOTENCY).map_err(|e| text(&e))?;
        let mut index = txn.open_table(IDEMPOTENCY_EXPIRY).map_err(|e| text(&e))?;
        for row in answers.iter().map_err(|e| text(&e))? {
            let (key, answer) = row.map_err(|e| text(&e))?;
            put(&mut index, now_secs, key.value(), answer.value()).map_err(|e| text(&e))?;
            count += 1;
        }
    }
    store_count(txn)?;
    Ok(count)
}

/// What one [`prune`] did with the index rows it took.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Pruned {
    /// Answers removed with their index rows.
    pub answers: u64,
    /// Index rows that did not match the answer under their key (the row changed on
    /// disk, or the answer was stored again or damaged since): the answer is kept and
    /// indexed again as of now.
    pub reindexed: u64,
    /// Index rows whose key holds no answer any more: dropped.
    pub absent: u64,
}

impl Pruned {
    pub fn rows(&self) -> u64 {
        self.answers + self.reindexed + self.absent
    }

    pub fn add(&mut self, other: &Pruned) {
        self.answers += other.answers;
        self.reindexed += other.reindexed;
        self.absent += other.absent;
    }
}

/// Removes, in one transaction, up to `limit` index rows stored before `cutoff_secs`,
/// and each one's answer where the row still matches it (else the answer is indexed
/// again at `now_secs`). A crash before the commit removes nothing; the next pass takes
/// the same rows again.
pub fn prune(
    db: &redb::Database,
    cutoff_secs: u64,
    now_secs: u64,
    limit: usize,
) -> Result<Pruned, String> {
    let text = |e: &dyn std::fmt::Display| format!("pruning idempotency answers: {e}");
    let mut txn = db.begin_write().map_err(|e| text(&e))?;
    // No fsync of its own: the state machine's next durable commit carries it, and one
    // lost to a crash is pruned again.
    txn.set_durability(redb::Durability::None);
    let mut pruned = Pruned::default();
    {
        let mut index = txn.open_table(IDEMPOTENCY_EXPIRY).map_err(|e| text(&e))?;
        let mut answers = txn.open_table(IDEMPOTENCY).map_err(|e| text(&e))?;
        let mut due: Vec<(u64, String, Vec<u8>)> = Vec::new();
        for row in index
            .range(..(cutoff_secs, ""))
            .map_err(|e| text(&e))?
            .take(limit)
        {
            let (key, digest) = row.map_err(|e| text(&e))?;
            let (stored_secs, answer_key) = key.value();
            due.push((stored_secs, answer_key.to_string(), digest.value().to_vec()));
        }
        for (stored_secs, answer_key, digest) in due {
            index
                .remove((stored_secs, answer_key.as_str()))
                .map_err(|e| text(&e))?;
            let answer = answers
                .get(answer_key.as_str())
                .map_err(|e| text(&e))?
                .map(|answer| answer.value().to_vec());
            match answer {
                None => pruned.absent += 1,
                Some(answer)
                    if index_digest(stored_secs, &answer_key, &answer).as_slice() == digest =>
                {
                    answers.remove(answer_key.as_str()).map_err(|e| text(&e))?;
                    pruned.answers += 1;
                }
                Some(answer) => {
                    put(&mut index, now_secs, &answer_key, &answer).map_err(|e| text(&e))?;
                    pruned.reindexed += 1;
                }
            }
        }
    }
    store_count(&txn)?;
    txn.commit().map_err(|e| text(&e))?;
    Ok(pruned)
}

#[cfg(test)]
mod tests {
    use super::*;
    use redb::Database;

    /// A "now" after every time below.
    const NOW: u64 = 5_000;

    fn db() -> (tempfile::TempDir, Database) {
        let dir = tempfile::tempdir().unwrap();
        let db = Database::create(dir.path().join("t.redb")).unwrap();
        (dir, db)
    }

    /// Stores an answer and its index row, as the writer does.
    fn store(db: &Database, stored_secs: u64, key: &str, answer: &[u8]) {
        let txn = db.begin_write().unwrap();
        txn.open_table(IDEMPOTENCY)
            .unwrap()
            .insert(key, answer)
            .unwrap();
        put(
            &mut txn.open_table(IDEMPOTENCY_EXPIRY).unwrap(),
            stored_secs,
            key,
            answer,
        )
        .unwrap();
        txn.commit().unwrap();
    }

    fn answers(db: &Database) -> Vec<String> {
        let txn = db.begin_read().unwrap();
        let table = txn.open_table(IDEMPOTENCY).unwrap();
        table
            .iter()
            .unwrap()
            .map(|row| row.unwrap().0.value().to_string())
            .collect()
    }

    fn index_rows(db: &Database) -> u64 {
        let txn = db.begin_read().unwrap();
        txn.open_table(IDEMPOTENCY_EXPIRY).unwrap().len().unwrap()
    }

    #[test]
    fn only_answers_stored_before_the_cutoff_go_and_at_most_the_limit_at_once() {
        let (_dir, db) = db();
        for (secs, key) in [(10, "a\nk1"), (20, "a\nk2"), (30, "b\nk3"), (40, "b\nk4")] {
            store(&db, secs, key, key.as_bytes());
        }
        assert_eq!(prune(&db, 10, NOW, 100).unwrap(), Pruned::default());
        let first = prune(&db, 31, NOW, 2).unwrap();
        assert_eq!(first.answers, 2, "{first:?}");
        assert_eq!(answers(&db), ["b\nk3", "b\nk4"]);
        assert_eq!(prune(&db, 31, NOW, 2).unwrap().answers, 1);
        assert_eq!(answers(&db), ["b\nk4"]);
        assert_eq!(prune(&db, 31, NOW, 2).unwrap(), Pruned::default());
        assert_eq!(index_rows(&db), 1);
    }

    /// An answer stored again under a key after its first one expired (the row under
    /// the key is the new answer) is kept by the old index row, which indexes it again;
    /// its own row removes it, and what index rows are left find no answer.
    #[test]
    fn an_answer_stored_again_under_the_key_is_not_taken_by_the_old_row() {
        let (_dir, db) = db();
        store(&db, 10, "a\nk", b"first");
        store(&db, 500, "a\nk", b"second");
        let pruned = prune(&db, 100, 600, 100).unwrap();
        assert_eq!(
            pruned,
            Pruned {
                reindexed: 1,
                ..Pruned::default()
            }
        );
        assert_eq!(answers(&db), ["a\nk"]);
        assert_eq!(prune(&db, 500, 600, 100).unwrap().rows(), 0);
        let own = prune(&db, 501, 700, 100).unwrap();
        assert_eq!((own.answers, own.rows()), (1, 1), "{own:?}");
        assert!(answers(&db).is_empty());
        let left = prune(&db, 601, 700, 100).unwrap();
        assert_eq!((left.absent, left.rows()), (1, 1), "{left:?}");
        assert_eq!(index_rows(&db), 0);
    }

    /// A changed index row (a bit of its time, its key or its digest flipped, as redb
    /// would read it back after a change on disk) never removes an answer: at worst the
    /// answer stays past its window.
    #[test]
    fn a_changed_index_row_never_removes_an_answer() {
        let key = "agent\nkey";
        let answer = b"the stored answer";
        let digest = index_digest(10, key, answer);
        let mut cases: Vec<(u64, String, Vec<u8>)> = Vec::new();
        for bit in 0..64 {
            let secs = 10u64 ^ (1 << bit);
            if secs < 1000 {
                cases.push((secs, key.to_string(), digest.to_vec()));
            }
        }
        for byte in 0..key.len() {
            for bit in 0..8 {
                let mut changed = key.as_bytes().to_vec();
                changed[byte] ^= 1 << bit;
                if let Ok(changed) = String::from_utf8(changed) {
                    cases.push((10, changed, digest.to_vec()));
                }
            }
        }
        for byte in 0..digest.len() {
            for bit in 0..8 {
                let mut changed = digest.to_vec();
                changed[byte] ^= 1 << bit;
                cases.push((10, key.to_string(), changed));
            }
        }
        cases.push((10, key.to_string(), digest[..31].to_vec()));
        cases.push((10, key.to_string(), Vec::new()));
        for (secs, indexed_key, value) in cases {
            let (_dir, db) = db();
            let txn = db.begin_write().unwrap();
            txn.open_table(IDEMPOTENCY)
                .unwrap()
                .insert(key, answer.as_slice())
                .unwrap();
            txn.open_table(IDEMPOTENCY_EXPIRY)
                .unwrap()
                .insert((secs, indexed_key.as_str()), value.as_slice())
                .unwrap();
            txn.commit().unwrap();
            let case = format!("{secs} {indexed_key:?} {value:?}");
            let pruned = prune(&db, 1000, NOW, 100).unwrap();
            assert_eq!(answers(&db), [key], "{case}");
            if indexed_key == key {
                assert_eq!(pruned.reindexed, 1, "{case}");
                // Indexed again as of now: removed only a window from now.
                assert_eq!(prune(&db, NOW, NOW, 100).unwrap().rows(), 0, "{case}");
                assert_eq!(prune(&db, NOW + 1, NOW, 100).unwrap().answers, 1, "{case}");
            } else {
                assert_eq!(pruned.absent, 1, "{case}");
                assert_eq!(answers(&db), [key], "{case}");
            }
        }
    }

    /// The stored count read back changed (any bit of it), or lost, has every answer
    /// indexed again: never taken as "nothing to index".
    #[test]
    fn a_changed_or_lost_count_has_the_answers_indexed_again() {
        let (_dir, db) = db();
        let txn = db.begin_write().unwrap();
        txn.open_table(IDEMPOTENCY)
            .unwrap()
            .insert("a\nk1", b"one".as_slice())
            .unwrap();
        index_all(&txn, 50).unwrap();
        assert!(!needs_indexing(&txn).unwrap());
        for bit in 0..64 {
            txn.open_table(IDEMPOTENCY_COUNT)
                .unwrap()
                .insert(COUNT_KEY, 1u64 ^ (1 << bit))
                .unwrap();
            assert!(needs_indexing(&txn).unwrap(), "bit {bit}");
        }
        txn.open_table(IDEMPOTENCY_COUNT)
            .unwrap()
            .remove(COUNT_KEY)
            .unwrap();
        assert!(needs_indexing(&txn).unwrap(), "lost");
        txn.abort().unwrap();
    }

    #[test]
    fn an_index_row_lost_has_the_answers_indexed_again() {
        let (_dir, db) = db();
        for (secs, key) in [(10, "a\nk1"), (20, "a\nk2")] {
            store(&db, secs, key, key.as_bytes());
        }
        let txn = db.begin_write().unwrap();
        store_count(&txn).unwrap();
        assert!(!needs_indexing(&txn).unwrap());
        txn.open_table(IDEMPOTENCY_EXPIRY)
            .unwrap()
            .remove((10, "a\nk1"))
            .unwrap()
            .expect("the index row");
        assert!(
            needs_indexing(&txn).unwrap(),
            "an answer left without its row"
        );
        assert_eq!(index_all(&txn, 50).unwrap(), 2);
        assert!(!needs_indexing(&txn).unwrap());
        txn.commit().unwrap();
        assert_eq!(index_rows(&db), 2);
    }

    /// The clock follows a wall clock stepped back, but not one stepped forward, nor one
    /// put right again after it was stepped back: it never runs ahead of real time.
    #[test]
    fn the_expiry_clock_never_runs_faster_than_real_time() {
        let start = std::time::Instant::now();
        let at = |secs: u64| start + std::time::Duration::from_secs(secs);
        const S: i64 = 1_000_000;
        let mut clock = SteadyWall {
            micros: 1_000 * S,
            at: start,
        };
        assert_eq!(clock.read(1_010 * S, at(10)), 1_010 * S);
        // Stepped forward an hour: only the 10 s that passed count.
        assert_eq!(clock.read(4_620 * S, at(20)), 1_020 * S);
        // Stepped back an hour: followed.
        assert_eq!(
            clock.read(1_030 * S - 3_600 * S, at(30)),
            1_030 * S - 3_600 * S
        );
        // Put right again: not followed.
        assert_eq!(clock.read(1_040 * S, at(40)), 1_040 * S - 3_600 * S);
        // Ten seconds on, ten seconds on.
        assert_eq!(clock.read(1_050 * S, at(50)), 1_050 * S - 3_600 * S);
        // Read a million times half a microsecond apart, it loses nothing.
        let mut steady = SteadyWall {
            micros: 0,
            at: start,
        };
        let mut last = 0;
        for n in 1..=1_000_000u64 {
            let then = start + std::time::Duration::from_nanos(500 * n);
            last = steady.read(i64::MAX, then);
        }
        assert_eq!(last, 500_000);
    }

    #[test]
    fn a_file_from_before_the_index_gets_every_answer_indexed() {
        let (_dir, db) = db();
        let txn = db.begin_write().unwrap();
        {
            let mut table = txn.open_table(IDEMPOTENCY).unwrap();
            table.insert("a\nk1", b"one".as_slice()).unwrap();
            table.insert("b\nk2", b"two".as_slice()).unwrap();
        }
        assert!(needs_indexing(&txn).unwrap());
        assert_eq!(index_all(&txn, 50).unwrap(), 2);
        assert!(!needs_indexing(&txn).unwrap());
        // An older build stores an answer without its index row, nor its count; index
        // rows outnumbering answers (as an answer stored again leaves) do not hide it.
        put(
            &mut txn.open_table(IDEMPOTENCY_EXPIRY).unwrap(),
            10,
            "gone\nk",
            b"x",
        )
        .unwrap();
        txn.open_table(IDEMPOTENCY)
            .unwrap()
            .insert("c\nk3", b"three".as_slice())
            .unwrap();
        assert!(needs_indexing(&txn).unwrap());
        assert_eq!(index_all(&txn, 50).unwrap(), 3);
        assert!(!needs_indexing(&txn).unwrap());
        txn.commit().unwrap();
        assert_eq!(prune(&db, 50, NOW, 100).unwrap(), Pruned::default());
        assert_eq!(prune(&db, 51, NOW, 100).unwrap().answers, 3);
        assert!(answers(&db).is_empty());
    }
}
