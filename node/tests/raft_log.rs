//! The Raft log's segment files on a real disk: what survives a reopen, a torn write at
//! the end, corruption elsewhere, and truncate/purge across segments.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use lineage_node::raft_types::{Proposal, TypeConfig};
use lineage_node::store::repair_floor::Floor;
use lineage_node::store::LogStore;
use openraft::storage::RaftLogStorage;
use openraft::testing::log_id;
use openraft::{Entry, EntryPayload, RaftLogReader, Vote};

fn blank(term: u64, index: u64) -> Entry<TypeConfig> {
    Entry {
        log_id: log_id(term, 1, index),
        payload: EntryPayload::Blank,
    }
}

fn blanks(term: u64, indexes: std::ops::RangeInclusive<u64>) -> Vec<Entry<TypeConfig>> {
    indexes.map(|i| blank(term, i)).collect()
}

async fn indexes(log: &mut LogStore) -> Vec<u64> {
    let mut reader = log.get_log_reader().await;
    reader
        .try_get_log_entries(0..)
        .await
        .unwrap()
        .iter()
        .map(|e| e.log_id.index)
        .collect()
}

/// A log in `dir` with 200-byte segments holding entries 1..=count (term 1), appended one
/// at a time so they spread over many segments.
async fn blanks_in_small_segments(dir: &Path, count: u64) -> LogStore {
    let mut log = LogStore::open_with_segment_bytes(dir, 200).unwrap();
    for i in 1..=count {
        log.append_and_wait(vec![blank(1, i)]).await.unwrap();
    }
    log
}

fn segments(dir: &Path) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "seg"))
        .collect();
    found.sort();
    found
}

#[tokio::test]
async fn entries_vote_and_purge_survive_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut log = LogStore::open(dir.path()).unwrap();
        log.save_vote(&Vote::new(3, 1)).await.unwrap();
        log.append_and_wait(blanks(1, 1..=5)).await.unwrap();
        log.append_and_wait(blanks(2, 6..=8)).await.unwrap();
        log.purge(log_id(1, 1, 2)).await.unwrap();
    }
    let mut log = LogStore::open(dir.path()).unwrap();
    assert_eq!(log.read_vote().await.unwrap(), Some(Vote::new(3, 1)));
    let state = log.get_log_state().await.unwrap();
    assert_eq!(state.last_purged_log_id, Some(log_id(1, 1, 2)));
    assert_eq!(state.last_log_id, Some(log_id(2, 1, 8)));
    assert_eq!(indexes(&mut log).await, (3..=8).collect::<Vec<_>>());
    // It goes on where it stopped.
    log.append_and_wait(vec![blank(2, 9)]).await.unwrap();
    assert_eq!(indexes(&mut log).await.last(), Some(&9));
}

#[tokio::test]
async fn a_torn_write_at_the_end_is_cut_and_nothing_acknowledged_is_lost() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut log = LogStore::open(dir.path()).unwrap();
        log.save_vote(&Vote::new(1, 1)).await.unwrap();
        log.append_and_wait(blanks(1, 1..=6)).await.unwrap();
    }
    // The frames end where the zeros written ahead of them begin.
    let last = segments(dir.path()).pop().unwrap();
    let bytes = std::fs::read(&last).unwrap();
    let frames_end = bytes.iter().rposition(|&b| b != 0).unwrap() + 1;
    assert!(
        bytes.len() > frames_end,
        "zeros are written ahead of the frames"
    );
    // A crash mid-write: half a frame header and part of a payload after the last frame.
    let file = std::fs::OpenOptions::new().write(true).open(&last).unwrap();
    file.write_all_at(&[200, 0, 0, 0, 1, 2, 3, 4, b'{', b'"'], frames_end as u64)
        .unwrap();
    drop(file);

    let mut log = LogStore::open(dir.path()).unwrap();
    assert_eq!(indexes(&mut log).await, (1..=6).collect::<Vec<_>>());
    assert_eq!(
        log.durability().repair_floor(),
        None,
        "beyond the watermark: no fault"
    );
    let after = std::fs::read(&last).unwrap();
    assert_eq!(
        &after[..frames_end],
        &bytes[..frames_end],
        "intact frames kept"
    );
    assert!(
        after[frames_end..].iter().all(|&b| b == 0),
        "no trace of the torn frame is left"
    );
    log.append_and_wait(vec![blank(1, 7)]).await.unwrap();
    drop(log);
    let mut log = LogStore::open(dir.path()).unwrap();
    assert_eq!(indexes(&mut log).await, (1..=7).collect::<Vec<_>>());
}

/// Damage in an acknowledged frame (below the watermark), even far from the end, is never
/// read as "the log ends here" silently: the node keeps a repair floor at its watermark,
/// cuts what it cannot read, and the floor is cleared once replication brings the log
/// past it again.
#[tokio::test]
async fn damage_below_the_watermark_sets_a_repair_floor_that_replication_clears() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut log = blanks_in_small_segments(dir.path(), 12).await;
        log.save_vote(&Vote::new(1, 1)).await.unwrap();
    }
    let files = segments(dir.path());
    assert!(files.len() >= 3, "{files:?}");
    // Flip one payload byte in the first segment.
    let mut bytes = std::fs::read(&files[0]).unwrap();
    bytes[10] ^= 0x20;
    std::fs::write(&files[0], bytes).unwrap();

    let mut log = LogStore::open_with_segment_bytes(dir.path(), 200).unwrap();
    let floor = log.durability().repair_floor().expect("a repair floor");
    assert_eq!(floor.floor, Floor::Entry(log_id(1, 1, 12)));
    assert!(
        floor.reason.contains(&files[0].display().to_string()),
        "names the file: {}",
        floor.reason
    );
    assert!(indexes(&mut log).await.is_empty(), "cut at the damage");
    // It survives a restart before the repair.
    drop(log);
    let mut log = LogStore::open_with_segment_bytes(dir.path(), 200).unwrap();
    assert!(log.durability().repair_floor().is_some());
    // Replication brings the entries back: the floor goes once the log passes it.
    log.append_and_wait(blanks(1, 1..=11)).await.unwrap();
    assert!(log.durability().repair_floor().is_some(), "not yet past it");
    log.append_and_wait(blanks(1, 12..=13)).await.unwrap();
    assert_eq!(log.durability().repair_floor(), None);
    drop(log);
    let mut log = LogStore::open_with_segment_bytes(dir.path(), 200).unwrap();
    assert_eq!(log.durability().repair_floor(), None);
    assert_eq!(indexes(&mut log).await, (1..=13).collect::<Vec<_>>());
}

/// The frames of a segment: (offset, total length with header).
fn frames(path: &Path) -> Vec<(usize, usize)> {
    let bytes = std::fs::read(path).unwrap();
    let mut found = Vec::new();
    let mut offset = 0;
    while offset + 8 <= bytes.len() {
        let len = u32::from_le_bytes(bytes[offset..offset + 4].try_into().unwrap()) as usize;
        if len == 0 {
            break;
        }
        found.push((offset, 8 + len));
        offset += 8 + len;
    }
    found
}

/// A one-segment log with entries 1..=30 acknowledged in three group commits, a vote,
/// and the segment's path.
async fn thirty_acknowledged(dir: &Path) -> PathBuf {
    let mut log = LogStore::open(dir).unwrap();
    log.save_vote(&Vote::new(1, 1)).await.unwrap();
    for batch in [1..=10, 11..=20, 21..=30] {
        log.append_and_wait(blanks(1, batch)).await.unwrap();
    }
    let files = segments(dir);
    assert_eq!(files.len(), 1);
    files[0].clone()
}

/// Every storage fault of an acknowledged part of the last segment: a flipped bit in the
/// middle and at the last frame, a zeroed 4 KiB block, the file cut inside a frame, and
/// the segment deleted. Each one sets the floor at the watermark; none is cut silently.
#[tokio::test]
async fn every_fault_in_acknowledged_frames_sets_the_floor() {
    type Fault = fn(&Path, &[(usize, usize)]);
    let faults: [(&str, Fault, u64); 5] = [
        (
            "bit flip in the middle",
            |path, frames| flip(path, frames[14].0 + 20),
            14,
        ),
        (
            "bit flip in the last frame",
            |path, frames| flip(path, frames[29].0 + 20),
            29,
        ),
        (
            "zeroed 4 KiB block",
            |path, frames| zero(path, frames[14].0 / 4096 * 4096, 4096),
            0,
        ),
        (
            "truncated inside a frame",
            |path, frames| cut(path, frames[20].0 + 5),
            20,
        ),
        (
            "segment deleted",
            |path, _| std::fs::remove_file(path).unwrap(),
            0,
        ),
    ];
    for (name, fault, kept) in faults {
        let dir = tempfile::tempdir().unwrap();
        let segment = thirty_acknowledged(dir.path()).await;
        fault(&segment, &frames(&segment));
        let mut log = LogStore::open(dir.path()).unwrap();
        let floor = log.durability().repair_floor();
        assert_eq!(
            floor.map(|f| f.floor),
            Some(Floor::Entry(log_id(1, 1, 30))),
            "{name}"
        );
        let left = indexes(&mut log).await;
        assert!(left.len() as u64 <= kept.max(1), "{name}: kept {left:?}");
        assert_eq!(left, (1..=left.len() as u64).collect::<Vec<_>>(), "{name}");
    }
}

/// Damage under an open log, read back where no decoded copy is held (a reopened log
/// holds none; a running one holds only its newest 4 MiB): a flipped byte, a zeroed frame,
/// a zeroed header and a cut file are each a read error for the damaged entry and for any
/// range over it, never an entry that reads back otherwise or a shorter log.
#[tokio::test]
async fn damage_read_back_by_an_open_log_is_an_error_never_fewer_entries() {
    type Fault = fn(&Path, &[(usize, usize)]);
    let faults: [(&str, Fault, u64); 5] = [
        ("bit flip", |path, frames| flip(path, frames[14].0 + 20), 15),
        (
            "bit flip that leaves valid JSON: entry 15 reads as 14",
            |path, frames| {
                let bytes = std::fs::read(path).unwrap();
                let (at, len) = frames[14];
                let needle = b"\"index\":15";
                let found = bytes[at..at + len]
                    .windows(needle.len())
                    .position(|w| w == needle)
                    .expect("entry 15's index in its frame");
                flip(path, at + found + needle.len() - 1);
            },
            15,
        ),
        (
            "zeroed frame",
            |path, frames| zero(path, frames[14].0, frames[14].1),
            15,
        ),
        (
            "zeroed header",
            |path, frames| zero(path, frames[14].0, 8),
            15,
        ),
        (
            "cut inside a frame",
            |path, frames| cut(path, frames[20].0 + 5),
            21,
        ),
    ];
    for (name, fault, damaged) in faults {
        let dir = tempfile::tempdir().unwrap();
        let segment = thirty_acknowledged(dir.path()).await;
        let mut log = LogStore::open(dir.path()).unwrap();
        let mut reader = log.get_log_reader().await;
        // Intact, every entry reads back from disk.
        assert_eq!(reader.try_get_log_entries(1..=30).await.unwrap().len(), 30);
        fault(&segment, &frames(&segment));
        for range in [damaged..=damaged, 1..=30] {
            let read = reader.try_get_log_entries(range.clone()).await;
            assert!(read.is_err(), "{name}: {range:?} read back as {read:?}");
        }
        // What lies before the damage still reads.
        let before = reader.try_get_log_entries(1..=damaged - 1).await.unwrap();
        assert_eq!(before.len() as u64, damaged - 1, "{name}");
    }
}

/// Entries beyond the decoded cache are read from disk outside the index lock, while
/// truncates cut the very frames being read and appends overwrite them in a new term.
/// Every read must still be the whole log as it stood at one moment (one of the states
/// the writer took it through, compared term by term): never a read error (openraft
/// stops on one), a torn entry, an entry under another's log id, or a mix of states.
#[tokio::test(flavor = "multi_thread", worker_threads = 3)]
async fn reads_racing_truncates_see_the_log_as_it_stood_never_an_error() {
    const LAST: u64 = 80;
    const NOTE: usize = 100_000;
    // 100 KB entries: the 4 MiB cache holds the newest 40 or so, the rest read from disk.
    fn entry(term: u64, index: u64) -> Entry<TypeConfig> {
        let note = format!("{term}/{index}/{}", "x".repeat(NOTE));
        Entry {
            log_id: log_id(term, 1, index),
            payload: EntryPayload::Normal(Proposal::Witnessed { note }),
        }
    }
    fn whole(entries: &[Entry<TypeConfig>]) -> Result<(), String> {
        let mut last_term = 0;
        for (i, e) in entries.iter().enumerate() {
            let (index, term) = (e.log_id.index, e.log_id.leader_id.get_term());
            if index != i as u64 + 1 || term < last_term {
                return Err(format!("entry {index} of term {term} at position {i}"));
            }
            last_term = term;
            match &e.payload {
                EntryPayload::Normal(Proposal::Witnessed { note })
                    if note.starts_with(&format!("{term}/{index}/"))
                        && note.len() == format!("{term}/{index}/").len() + NOTE => {}
                _ => return Err(format!("entry {index} of term {term} holds another's data")),
            }
        }
        Ok(())
    }
    let dir = tempfile::tempdir().unwrap();
    let mut log = LogStore::open(dir.path()).unwrap();
    log.append_and_wait((1..=LAST).map(|i| entry(1, i)).collect())
        .await
        .unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut readers = Vec::new();
    for _ in 0..2 {
        let mut reader = log.get_log_reader().await;
        let stop = stop.clone();
        readers.push(tokio::spawn(async move {
            // The terms of each read's entries, by index.
            let mut seen: Vec<Vec<u64>> = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let read = seen.len();
                let entries = reader
                    .try_get_log_entries(1..=LAST)
                    .await
                    .map_err(|e| format!("read {read}: {e}"))?;
                whole(&entries).map_err(|e| format!("read {read}: {e}"))?;
                seen.push(
                    entries
                        .iter()
                        .map(|e| e.log_id.leader_id.get_term())
                        .collect(),
                );
                tokio::task::yield_now().await;
            }
            Ok::<Vec<Vec<u64>>, String>(seen)
        }));
    }
    // Each round cuts the log inside the part read from disk and writes it again. Each
    // is one step under the log's lock, so these are all the states the log has held.
    let mut terms = vec![1u64; LAST as usize + 1];
    let mut states = std::collections::HashSet::from([terms[1..].to_vec()]);
    for term in 2..=31u64 {
        let at = 5 + (term * 7) % 30;
        log.truncate(log_id(terms[at as usize], 1, at))
            .await
            .unwrap();
        states.insert(terms[1..at as usize].to_vec());
        log.append_and_wait((at..=LAST).map(|i| entry(term, i)).collect())
            .await
            .unwrap();
        terms[at as usize..].fill(term);
        states.insert(terms[1..].to_vec());
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for reader in readers {
        let seen = reader.await.unwrap().unwrap_or_else(|e| panic!("{e}"));
        assert!(!seen.is_empty(), "a reader never finished a read");
        for (n, read) in seen.iter().enumerate() {
            assert!(
                states.contains(read),
                "read {n} is no state the log held: {read:?}"
            );
        }
    }
    let after = log
        .get_log_reader()
        .await
        .try_get_log_entries(1..=LAST)
        .await
        .unwrap();
    whole(&after).unwrap();
    assert_eq!(after.len() as u64, LAST);
}

fn flip(path: &Path, at: usize) {
    let mut bytes = std::fs::read(path).unwrap();
    bytes[at] ^= 0x01;
    std::fs::write(path, bytes).unwrap();
}

fn zero(path: &Path, at: usize, len: usize) {
    let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    file.write_all_at(&vec![0u8; len], at as u64).unwrap();
}

/// Cuts the file to `len` bytes.
fn cut(path: &Path, len: usize) {
    let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    file.set_len(len as u64).unwrap();
}

/// Lost metadata: a lost watermark with an intact log is written anew (no fault); a lost
/// watermark with damage in the log cannot tell a torn write from a lost acknowledged
/// entry (floor of unknown height); a lost vote while the log has followed a leader could
/// let this node vote twice in a term (floor of unknown height).
#[tokio::test]
async fn lost_watermark_or_vote() {
    let dir = tempfile::tempdir().unwrap();
    let segment = thirty_acknowledged(dir.path()).await;
    std::fs::remove_file(dir.path().join("watermark")).unwrap();
    let mut log = LogStore::open(dir.path()).unwrap();
    assert_eq!(log.durability().repair_floor(), None);
    assert_eq!(indexes(&mut log).await.len(), 30);
    drop(log);
    // The watermark written anew protects the log again.
    flip(&segment, frames(&segment)[29].0 + 20);
    let log = LogStore::open(dir.path()).unwrap();
    assert_eq!(
        log.durability().repair_floor().map(|f| f.floor),
        Some(Floor::Entry(log_id(1, 1, 30)))
    );

    let dir = tempfile::tempdir().unwrap();
    let segment = thirty_acknowledged(dir.path()).await;
    std::fs::remove_file(dir.path().join("watermark")).unwrap();
    flip(&segment, frames(&segment)[29].0 + 20);
    let log = LogStore::open(dir.path()).unwrap();
    assert_eq!(
        log.durability().repair_floor().map(|f| f.floor),
        Some(Floor::Unknown)
    );

    let dir = tempfile::tempdir().unwrap();
    thirty_acknowledged(dir.path()).await;
    std::fs::remove_file(dir.path().join("vote.json")).unwrap();
    let log = LogStore::open(dir.path()).unwrap();
    let floor = log.durability().repair_floor().expect("floor");
    assert_eq!(floor.floor, Floor::Unknown);
    assert!(floor.reason.contains("vote"), "{}", floor.reason);
}

/// Truncating committed entries is refused (a fatal assertion), and the log then refuses
/// everything (the node exits and recovers from disk).
#[tokio::test]
async fn truncating_committed_entries_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut log = LogStore::open(dir.path()).unwrap();
    log.append_and_wait(blanks(1, 1..=10)).await.unwrap();
    log.save_committed(Some(log_id(1, 1, 8))).await.unwrap();
    log.truncate(log_id(1, 1, 9)).await.unwrap();
    let error = log.truncate(log_id(1, 1, 8)).await.unwrap_err();
    assert!(error.to_string().contains("committed"), "{error}");
    assert!(log.append_and_wait(blanks(1, 9..=9)).await.is_err());
}

#[tokio::test]
async fn truncate_and_purge_across_segments_then_reopen() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut log = blanks_in_small_segments(dir.path(), 30).await;
        let before = segments(dir.path()).len();
        log.purge(log_id(1, 1, 10)).await.unwrap();
        assert!(
            segments(dir.path()).len() < before,
            "whole purged segments are deleted"
        );
        log.truncate(log_id(1, 1, 20)).await.unwrap();
        assert_eq!(indexes(&mut log).await, (11..=19).collect::<Vec<_>>());
        // A new leader's entries replace the truncated ones.
        log.append_and_wait(blanks(2, 20..=22)).await.unwrap();
    }
    let mut log = LogStore::open_with_segment_bytes(dir.path(), 200).unwrap();
    assert_eq!(indexes(&mut log).await, (11..=22).collect::<Vec<_>>());
    let mut reader = log.get_log_reader().await;
    let tail = reader.try_get_log_entries(19..=20).await.unwrap();
    assert_eq!(tail[0].log_id, log_id(1, 1, 19));
    assert_eq!(tail[1].log_id, log_id(2, 1, 20));
    // Purging past the end (a snapshot replaced everything): the log restarts after it.
    log.purge(log_id(2, 1, 40)).await.unwrap();
    assert!(indexes(&mut log).await.is_empty());
    assert!(segments(dir.path()).is_empty());
    log.append_and_wait(vec![blank(3, 41)]).await.unwrap();
    drop(log);
    let mut log = LogStore::open(dir.path()).unwrap();
    assert_eq!(indexes(&mut log).await, vec![41]);
    assert_eq!(
        log.get_log_state().await.unwrap().last_purged_log_id,
        Some(log_id(2, 1, 40))
    );
}

#[tokio::test]
async fn truncated_entries_never_come_back() {
    // Same-size frames: the replacing entry ends exactly where the next truncated one
    // began, so only cutting the file keeps those from being read back after a reopen.
    let dir = tempfile::tempdir().unwrap();
    {
        let mut log = LogStore::open(dir.path()).unwrap();
        log.append_and_wait(blanks(1, 1..=6)).await.unwrap();
        log.truncate(log_id(1, 1, 4)).await.unwrap();
        log.append_and_wait(vec![blank(2, 4)]).await.unwrap();
    }
    let mut log = LogStore::open(dir.path()).unwrap();
    assert_eq!(indexes(&mut log).await, vec![1, 2, 3, 4]);
    let mut reader = log.get_log_reader().await;
    let last = reader.try_get_log_entries(4..=4).await.unwrap();
    assert_eq!(last[0].log_id, log_id(2, 1, 4));
}

#[tokio::test]
async fn the_durable_gate_answers_for_what_is_on_disk() {
    let dir = tempfile::tempdir().unwrap();
    let mut log = LogStore::open(dir.path()).unwrap();
    let durable = log.durability();
    log.append_and_wait(blanks(1, 1..=3)).await.unwrap();
    durable.wait_durable(log_id(1, 1, 3)).unwrap();
    // An entry the log does not hold, or holds from another leader, is an error at once.
    let missing = durable.wait_durable(log_id(1, 1, 4)).unwrap_err();
    assert!(missing.contains("does not hold"), "{missing}");
    let other = durable.wait_durable(log_id(2, 1, 3)).unwrap_err();
    assert!(other.contains("instead of"), "{other}");
    // Followers hear of commits only as far as this log is on disk.
    assert_eq!(
        durable.clamp_commit(Some(log_id(1, 1, 9))),
        Some(log_id(1, 1, 3))
    );
    assert_eq!(
        durable.clamp_commit(Some(log_id(1, 1, 2))),
        Some(log_id(1, 1, 2))
    );
    assert_eq!(durable.clamp_commit(None), None);
    // Purged entries were durable before the snapshot that replaced them.
    log.purge(log_id(1, 1, 2)).await.unwrap();
    durable.wait_durable(log_id(1, 1, 1)).unwrap();
    // What is on disk stays answerable after the log is closed.
    drop(log);
    durable.wait_durable(log_id(1, 1, 3)).unwrap();
}

#[tokio::test]
async fn a_former_leader_with_early_acks_comes_back_as_a_candidate_not_the_leader() {
    let dir = tempfile::tempdir().unwrap();
    let mut log = LogStore::open(dir.path()).unwrap();
    let mut led = Vote::new(3, 1);
    led.commit();
    log.save_vote(&led).await.unwrap();
    drop(log);
    // The log alone keeps the vote as it was (the node demotes itself at every start
    // anyway, `lib.rs`, since it may have run with early acks before).
    let mut plain = LogStore::open(dir.path()).unwrap();
    assert_eq!(plain.read_vote().await.unwrap(), Some(led));
    drop(plain);
    // With it, node 1 must not lead term 3 again: the same vote, not committed.
    let mut early = LogStore::open(dir.path()).unwrap().leading_as(1);
    assert_eq!(early.read_vote().await.unwrap(), Some(Vote::new(3, 1)));
    drop(early);
    // Another node's committed vote is kept as it is.
    let mut other = LogStore::open(dir.path()).unwrap().leading_as(2);
    assert_eq!(other.read_vote().await.unwrap(), Some(led));
}

#[tokio::test]
async fn entries_within_one_append_must_be_consecutive() {
    let dir = tempfile::tempdir().unwrap();
    let mut log = LogStore::open(dir.path()).unwrap();
    log.append_and_wait(blanks(1, 1..=3)).await.unwrap();
    // Entries within one append must be consecutive.
    let error = log
        .append_and_wait(vec![blank(1, 4), blank(1, 6)])
        .await
        .unwrap_err();
    assert!(error.to_string().contains("continues at 5"), "{error}");
    // Nothing of the refused append was taken.
    assert_eq!(indexes(&mut log).await, vec![1, 2, 3]);
    log.append_and_wait(vec![blank(1, 4)]).await.unwrap();
    drop(log);
    let mut log = LogStore::open(dir.path()).unwrap();
    assert_eq!(indexes(&mut log).await, vec![1, 2, 3, 4]);
}

/// Waits (bounded) until the committed hint on disk names `index`.
async fn hint_on_disk_reaches(dir: &Path, index: u64) {
    let path = dir.join("committed.json");
    for _ in 0..100 {
        let hint: Option<openraft::LogId<u64>> = std::fs::read(&path)
            .ok()
            .and_then(|b| {
                let json = lineage_node::store::checked_row::unseal(&b).ok()?;
                serde_json::from_slice(json).ok()
            })
            .flatten();
        if hint.is_some_and(|h| h.index == index) {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("the committed hint never reached {index}");
}

#[tokio::test]
async fn the_committed_hint_is_kept_but_never_ahead_of_the_durable_log() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut log = LogStore::open(dir.path()).unwrap();
        log.append_and_wait(blanks(1, 1..=5)).await.unwrap();
        log.save_committed(Some(log_id(1, 1, 3))).await.unwrap();
        hint_on_disk_reaches(dir.path(), 3).await;
        // Committed beyond what this node has durably: the hint stops at its last entry.
        log.save_committed(Some(log_id(1, 1, 9))).await.unwrap();
        hint_on_disk_reaches(dir.path(), 5).await;
    }
    let mut log = LogStore::open(dir.path()).unwrap();
    assert_eq!(
        log.read_committed().await.unwrap().map(|c| c.index),
        Some(5)
    );
}

/// A log written before watermarks existed (no `watermark`, no `format` marker) is read by
/// the old rule once — a bad frame at the end of the last segment is cut as torn — and a
/// watermark is then written for it, so the next fault is judged by the watermark.
#[tokio::test]
async fn a_log_from_before_watermarks_is_adopted() {
    let dir = tempfile::tempdir().unwrap();
    let segment = thirty_acknowledged(dir.path()).await;
    std::fs::remove_file(dir.path().join("watermark")).unwrap();
    std::fs::remove_file(dir.path().join("format")).unwrap();
    flip(&segment, frames(&segment)[29].0 + 20);
    let mut log = LogStore::open(dir.path()).unwrap();
    assert_eq!(log.durability().repair_floor(), None);
    assert_eq!(indexes(&mut log).await, (1..=29).collect::<Vec<_>>());
    drop(log);
    assert!(dir.path().join("format").exists());
    flip(&segment, frames(&segment)[28].0 + 20);
    let log = LogStore::open(dir.path()).unwrap();
    assert_eq!(
        log.durability().repair_floor().map(|f| f.floor),
        Some(Floor::Entry(log_id(1, 1, 29)))
    );
}

/// A floor the log already passes when it opens (a crash between passing it and clearing
/// it) is cleared at once, not left until the next write.
#[tokio::test]
async fn a_floor_already_passed_is_cleared_at_open() {
    let dir = tempfile::tempdir().unwrap();
    thirty_acknowledged(dir.path()).await;
    let floor = lineage_node::store::repair_floor::RepairFloor {
        floor: Floor::Entry(log_id(1, 1, 20)),
        reason: "test".into(),
    };
    lineage_node::store::repair_floor::write(dir.path(), &floor).unwrap();
    let log = LogStore::open(dir.path()).unwrap();
    assert_eq!(log.durability().repair_floor(), None);
    assert!(!dir.path().join("repair-floor.json").exists());
}

/// The committed hint reads back only intact: a changed byte that still parsed could name
/// an index that was never committed (start-up would apply it), so a damaged hint, or one
/// in the older unsealed form, is ignored (which only means "apply what the state machine
/// has until a leader says more").
#[tokio::test]
async fn the_committed_hint_is_used_only_intact() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut log = LogStore::open(dir.path()).unwrap();
        log.save_vote(&Vote::new(1, 1)).await.unwrap();
        log.append_and_wait(blanks(1, 1..=10)).await.unwrap();
        log.save_committed(Some(log_id(1, 1, 8))).await.unwrap();
        // The writer stores the hint when idle, at most every 50 ms.
        let hint = dir.path().join("committed.json");
        for _ in 0..100 {
            if hint.exists() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        assert!(hint.exists(), "the hint was written");
    }
    let mut log = LogStore::open(dir.path()).unwrap();
    assert_eq!(log.read_committed().await.unwrap(), Some(log_id(1, 1, 8)));
    drop(log);
    let hint = dir.path().join("committed.json");
    let mut bytes = std::fs::read(&hint).unwrap();
    let at = bytes.len() - 3;
    bytes[at] ^= 0x01;
    std::fs::write(&hint, &bytes).unwrap();
    let mut log = LogStore::open(dir.path()).unwrap();
    assert_eq!(log.read_committed().await.unwrap(), None);
    drop(log);
    let plain = serde_json::to_vec(&Some(log_id(1, 1, 10))).unwrap();
    std::fs::write(&hint, plain).unwrap();
    let mut log = LogStore::open(dir.path()).unwrap();
    assert_eq!(log.read_committed().await.unwrap(), None);
}
