//! The Raft log's durable watermark: the last entry this node ever reported durable,
//! kept in its own small file beside the segments (`raft-log/watermark`).
//!
//! Why: after a crash, a bad frame at the end of the log may be a write that was never
//! finished (never acknowledged: safe to cut) or an acknowledged entry the disk damaged
//! later (cutting it would lose a decision a quorum counted on). Only a record of what
//! was acknowledged tells the two apart (Protocol-Aware Recovery, FAST 2018). So after
//! each group commit's data is fdatasynced, the watermark is overwritten and fdatasynced,
//! and only then are the appends reported durable (a leader's early acknowledgement of
//! its own appends comes before, but nothing is applied or sent as committed until this
//! point: `log_store` docs). Recovery may cut a bad frame only
//! beyond the watermark.
//!
//! Layout: two slots of `SLOT_BYTES` at offsets 0 and `SLOT_SPACING` (separate 4 KiB
//! blocks, so a torn or zeroed block loses at most one), written alternately with a
//! rising generation; each carries its own CRC. The newest valid slot wins; the older one
//! is still a valid watermark when a write of the newer one tears.
//!
//! Interrupted at each step: a crash while writing a slot leaves that slot invalid or
//! whole, and the other slot holds the previous watermark, which is never ahead of what
//! is durable (entries are fsynced before it is written).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

use openraft::{CommittedLeaderId, LogId};

use crate::raft_types::NodeId;

pub const WATERMARK_FILE: &str = "watermark";
const MAGIC: &[u8; 8] = b"LNWMARK1";
/// magic, generation, flags, term, node, index, segment, end (8 bytes each), last frame's
/// CRC and the slot's CRC (4 each).
const SLOT_BYTES: usize = 72;
const SLOT_SPACING: u64 = 4096;
const FILE_BYTES: u64 = 2 * SLOT_SPACING;

type Id = LogId<NodeId>;

/// What the log had made durable when the watermark was written: the last entry (none
/// for an empty log), where its frame ends, and that frame's CRC.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mark {
    pub log_id: Option<Id>,
    /// First index of the segment holding the frame, and the offset where it ends.
    pub segment: u64,
    pub end: u64,
    pub frame_crc: u32,
}

impl Mark {
    pub const EMPTY: Mark = Mark {
        log_id: None,
        segment: 0,
        end: 0,
        frame_crc: 0,
    };
}

/// What opening the watermark found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Found {
    /// The file did not exist (it exists now, with an empty mark).
    Created,
    /// Neither slot is valid: the file was damaged.
    Unreadable(String),
    Mark(Mark),
}

pub struct Watermark {
    file: File,
    generation: u64,
}

impl Watermark {
    /// Opens `dir/watermark`, creating and preallocating it (durably, with no mark yet:
    /// the caller writes the first one) when missing.
    pub fn open(dir: &Path) -> Result<(Watermark, Found), String> {
        let path = dir.join(WATERMARK_FILE);
        let existed = path.exists();
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
        if !existed {
            // Sized, but no slot written: until recovery writes the first mark, a crash
            // leaves a file that reads as unreadable, never as "nothing acknowledged".
            file.set_len(FILE_BYTES)
                .and_then(|()| file.sync_all())
                .map_err(|e| format!("cannot size {}: {e}", path.display()))?;
            File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(|e| format!("cannot sync {}: {e}", dir.display()))?;
            let watermark = Watermark {
                file,
                generation: 0,
            };
            return Ok((watermark, Found::Created));
        }
        let mut slots = Vec::new();
        let mut problems = Vec::new();
        for n in 0..2u64 {
            let mut buf = [0u8; SLOT_BYTES];
            match file.read_exact_at(&mut buf, n * SLOT_SPACING) {
                Ok(()) => match decode_slot(&buf) {
                    Ok(slot) => slots.push(slot),
                    Err(e) => problems.push(format!("slot {n}: {e}")),
                },
                Err(e) => problems.push(format!("slot {n}: {e}")),
            }
        }
        let newest = slots.into_iter().max_by_key(|(generation, _)| *generation);
        match newest {
            Some((generation, mark)) => Ok((Watermark { file, generation }, Found::Mark(mark))),
            None => Ok((
                Watermark {
                    file,
                    generation: 0,
                },
                Found::Unreadable(format!("{}: {}", path.display(), problems.join("; "))),
            )),
        }
    }

    /// Makes `mark` the watermark, durably: the next slot in turn, then fdatasync.
    pub fn write(&mut self, mark: &Mark) -> io::Result<()> {
        self.generation += 1;
        let slot = encode_slot(self.generation, mark);
        self.file
            .write_all_at(&slot, (self.generation % 2) * SLOT_SPACING)?;
        self.file.sync_data()
    }
}

fn encode_slot(generation: u64, mark: &Mark) -> [u8; SLOT_BYTES] {
    let mut buf = [0u8; SLOT_BYTES];
    let (flags, term, node, index) = match mark.log_id {
        Some(id) => (1u64, id.leader_id.term, id.leader_id.node_id, id.index),
        None => (0, 0, 0, 0),
    };
    buf[0..8].copy_from_slice(MAGIC);
    for (n, value) in [generation, flags, term, node, index, mark.segment, mark.end]
        .into_iter()
        .enumerate()
    {
        buf[8 + n * 8..16 + n * 8].copy_from_slice(&value.to_le_bytes());
    }
    buf[64..68].copy_from_slice(&mark.frame_crc.to_le_bytes());
    let crc = crc32fast::hash(&buf[..68]);
    buf[68..72].copy_from_slice(&crc.to_le_bytes());
    buf
}

fn decode_slot(buf: &[u8; SLOT_BYTES]) -> Result<(u64, Mark), String> {
    if &buf[0..8] != MAGIC {
        return Err("no watermark magic".into());
    }
    let crc = u32::from_le_bytes([buf[68], buf[69], buf[70], buf[71]]);
    if crc32fast::hash(&buf[..68]) != crc {
        return Err("checksum mismatch".into());
    }
    let word = |n: usize| {
        let mut bytes = [0u8; 8];
        bytes.copy_from_slice(&buf[8 + n * 8..16 + n * 8]);
        u64::from_le_bytes(bytes)
    };
    let log_id = match word(1) {
        0 => None,
        1 => Some(LogId::new(
            CommittedLeaderId::new(word(2), word(3)),
            word(4),
        )),
        other => return Err(format!("unknown flags {other}")),
    };
    let frame_crc = u32::from_le_bytes([buf[64], buf[65], buf[66], buf[67]]);
    Ok((
        word(0),
        Mark {
            log_id,
            segment: word(5),
            end: word(6),
            frame_crc,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mark(index: u64) -> Mark {
        Mark {
            log_id: Some(LogId::new(CommittedLeaderId::new(3, 2), index)),
            segment: 0,
            end: 100 * index,
            frame_crc: 7,
        }
    }

    #[test]
    fn the_newest_whole_slot_wins_and_a_torn_one_falls_back() {
        let dir = tempfile::tempdir().unwrap();
        let (watermark, found) = Watermark::open(dir.path()).unwrap();
        assert_eq!(found, Found::Created);
        drop(watermark);
        // Created but never written: unreadable, not an empty mark.
        let (mut watermark, found) = Watermark::open(dir.path()).unwrap();
        assert!(matches!(found, Found::Unreadable(_)), "{found:?}");
        watermark.write(&Mark::EMPTY).unwrap();
        watermark.write(&mark(1)).unwrap();
        watermark.write(&mark(2)).unwrap();
        drop(watermark);
        let (_, found) = Watermark::open(dir.path()).unwrap();
        assert_eq!(found, Found::Mark(mark(2)));

        // Damage the newest slot (generation 3, slot 1): the previous one is the mark.
        let path = dir.path().join(WATERMARK_FILE);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[SLOT_SPACING as usize + 40] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        let (mut watermark, found) = Watermark::open(dir.path()).unwrap();
        assert_eq!(found, Found::Mark(mark(1)));
        // Writing goes on from the surviving generation.
        watermark.write(&mark(5)).unwrap();
        let (_, found) = Watermark::open(dir.path()).unwrap();
        assert_eq!(found, Found::Mark(mark(5)));

        // Both slots zeroed: unreadable, never "empty".
        std::fs::write(&path, vec![0u8; FILE_BYTES as usize]).unwrap();
        let (_, found) = Watermark::open(dir.path()).unwrap();
        assert!(matches!(found, Found::Unreadable(_)), "{found:?}");
    }
}
