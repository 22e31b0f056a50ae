//! The segment log under any single fault: cut one segment file at any byte offset, or
//! flip any byte of it, and reopen. Recovery either refuses to open, or gives back a
//! prefix of the acknowledged entries, never a changed one; and when that prefix is
//! shorter than what was acknowledged, the node knows it (a repair floor), so it takes no
//! part in elections until its peers have repaired it.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use lineage_node::raft_types::{Proposal, TypeConfig};
use lineage_node::store::LogStore;
use openraft::storage::RaftLogStorage;
use openraft::testing::log_id;
use openraft::{Entry, EntryPayload, RaftLogReader, Vote};
use proptest::prelude::*;

/// Small segments, so a handful of entries spans several files.
const SEGMENT_BYTES: u64 = 300;

fn entry(index: u64) -> Entry<TypeConfig> {
    Entry {
        log_id: log_id(1, 1, index),
        payload: EntryPayload::Normal(Proposal::HeadsRound {
            origin: format!("origin-{index}"),
        }),
    }
}

fn segments(dir: &Path) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("read dir")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "seg"))
        .collect();
    found.sort();
    found
}

#[derive(Debug, Clone)]
enum Fault {
    /// Cut the file at this offset.
    Cut(u64),
    /// XOR the byte at this offset with this mask (non-zero).
    Flip(u64, u8),
}

fn check(count: u64, segment_pick: usize, fault: Fault) -> Result<(), TestCaseError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let dir = tempfile::tempdir().expect("tempdir");
        let written: Vec<Entry<TypeConfig>> = (1..=count).map(entry).collect();
        {
            let mut log =
                LogStore::open_with_segment_bytes(dir.path(), SEGMENT_BYTES).expect("open");
            // The vote a node saves before it holds entries of term 1: without it every
            // reopen has a repair floor, lost entries or not.
            log.save_vote(&Vote::new(1, 1)).await.expect("vote");
            for e in &written {
                // One at a time: each append acknowledged (durable) before the next.
                log.append_and_wait(vec![e.clone()]).await.expect("append");
            }
        }
        let files = segments(dir.path());
        let file = &files[segment_pick % files.len()];
        // Faults land where the frames are, or just past them (frames end well inside
        // the first few hundred bytes; zeros follow).
        let len = std::fs::metadata(file).expect("metadata").len();
        // A cut at or past the end leaves the file as it was: that log must open whole.
        let untouched = matches!(fault, Fault::Cut(at) if at >= len);
        match fault {
            Fault::Cut(at) => {
                let f = std::fs::OpenOptions::new()
                    .write(true)
                    .open(file)
                    .expect("open");
                f.set_len(at.min(len)).expect("cut");
            }
            Fault::Flip(at, mask) => {
                let f = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(file)
                    .expect("open");
                let at = at.min(len.saturating_sub(1));
                let mut byte = [0u8; 1];
                f.read_exact_at(&mut byte, at).expect("read");
                byte[0] ^= mask;
                f.write_all_at(&byte, at).expect("flip");
            }
        }
        let mut log = match LogStore::open_with_segment_bytes(dir.path(), SEGMENT_BYTES) {
            Ok(log) => log,
            Err(e) => {
                prop_assert!(!untouched, "a log nothing was done to did not open: {e:?}");
                return Ok(()); // refusing to open a damaged log is a safe answer
            }
        };
        let mut reader = log.get_log_reader().await;
        let read = reader.try_get_log_entries(0..).await.expect("read entries");
        prop_assert!(
            read.len() <= written.len() && read[..] == written[..read.len()],
            "not a prefix of what was acknowledged: {:?}",
            read.iter().map(|e| e.log_id.index).collect::<Vec<_>>()
        );
        if untouched {
            prop_assert_eq!(
                read.len(),
                written.len(),
                "entries lost from an untouched log"
            );
            prop_assert!(log.durability().repair_floor().is_none());
        }
        if read.len() < written.len() {
            prop_assert!(
                log.durability().repair_floor().is_some(),
                "{} acknowledged entries lost without a repair floor",
                written.len() - read.len()
            );
        }
        Ok(())
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn any_single_cut_or_flipped_byte_gives_a_prefix_or_a_refusal(
        count in 1u64..=12,
        segment_pick in 0usize..8,
        fault in prop_oneof![
            (0u64..700).prop_map(Fault::Cut),
            ((0u64..700), (1u8..=255)).prop_map(|(at, mask)| Fault::Flip(at, mask)),
        ],
    ) {
        check(count, segment_pick, fault)?;
    }
}

/// Every case above passes on a refusal to open, so a store refusing every log would
/// pass them all: a log nothing was done to opens with every entry, whatever the
/// generator happened to pick.
#[test]
fn a_cut_at_or_past_the_end_changes_nothing() {
    for count in [1, 5, 12] {
        for segment_pick in 0..3 {
            check(count, segment_pick, Fault::Cut(u64::MAX)).unwrap();
        }
    }
}
