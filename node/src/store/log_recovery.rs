//! Start-up recovery of the Raft log's segments, by the rule of Protocol-Aware Recovery
//! (FAST 2018): a damaged frame may be cut as a write that never finished only when it
//! lies beyond the durable watermark (`watermark.rs`). Damage at or below it, a log that
//! ends before it, or a lost watermark or vote mean this node may have acknowledged
//! entries it no longer holds: the damaged part is cut all the same (the log must stay a
//! run of consecutive, readable entries), but first a repair floor is stored
//! (`repair_floor.rs`), so the node is repaired by its peers instead of trusted.
//!
//! Interrupted at each step: the floor is written (durably) before anything is cut, and
//! cutting only shortens files and deletes later segments, so a crash at any point meets
//! the same damage, or less of it, and the same floor at the next start.

use std::collections::{BTreeMap, VecDeque};
use std::fs::OpenOptions;
use std::path::Path;
use std::sync::Arc;

use super::log_store::{
    decode_frame, frame_header, remove_file, segment_path, sync_dir, Frame, Id, Segment,
    COMMITTED_FILE, FRAME_HEADER, PURGED_FILE,
};
use super::repair_floor::{self, Floor, RepairFloor};
use super::watermark::{Found, Mark, Watermark};
use crate::raft_types::NodeId;
use openraft::Vote;

/// Marks a log directory written by a version that keeps a watermark: a directory with
/// segments and without this file predates watermarks (adopted once, see [`Trust`]).
const FORMAT_FILE: &str = "format";
const FORMAT: &[u8] = b"lineage-raft-log watermark-v1\n";

/// What the log on disk is known to have acknowledged.
enum Trust {
    /// The watermark: the last entry reported durable.
    Mark(Mark),
    /// Segments written before watermarks existed: a bad frame at the end of the last
    /// segment is cut as before; anywhere else it stops start-up.
    Legacy,
    /// The watermark was lost; what was acknowledged is not known.
    Lost(String),
}

/// The first place the scan could not read on from: everything from here is dropped.
struct Damage {
    segment: u64,
    offset: u64,
    reason: String,
}

/// The log as recovered.
pub(super) struct Recovered {
    pub segments: BTreeMap<u64, Segment>,
    /// Durable entries after the last purged one, consecutive.
    pub durable: VecDeque<Frame>,
    pub watermark: Watermark,
    /// Set when this node may have lost acknowledged entries (stored on disk already).
    pub floor: Option<RepairFloor>,
    /// For a lost vote: the highest term in the log, voted for no node that exists.
    pub seeded_vote: Option<Vote<NodeId>>,
}

/// Opens the segments in `dir`, judges any damage against the watermark, stores a repair
/// floor when needed, and then cuts what cannot be read.
#[expect(
    clippy::too_many_lines,
    reason = "start-up recovery in Protocol-Aware Recovery's order; each step's crash reasoning sits beside it"
)]
pub(super) fn recover(
    dir: &Path,
    last_purged: Option<Id>,
    has_vote: bool,
    single_voter: bool,
) -> Result<Recovered, String> {
    let had_segments = segment_firsts(dir)?.next().is_some();
    let marked = dir.join(FORMAT_FILE).exists();
    let (mut watermark, found) = Watermark::open(dir)?;
    let created = found == Found::Created;
    // A log from before watermarks stays legacy until the watermark that speaks for it
    // is written (the marker comes after it, at the end), whatever a crash left between.
    let trust = match found {
        _ if had_segments && !marked => Trust::Legacy,
        Found::Mark(mark) => Trust::Mark(mark),
        Found::Created if had_segments => Trust::Lost(format!(
            "{} was missing",
            dir.join(super::watermark::WATERMARK_FILE).display()
        )),
        Found::Created => Trust::Mark(Mark::EMPTY),
        Found::Unreadable(reason) => Trust::Lost(reason),
    };
    let (mut segments, mut durable, damage, later) = scan(dir, last_purged)?;

    let mut fault: Option<RepairFloor> = None;
    let mut fault_at = |floor: Floor, reason: String| {
        let merged = match fault.take() {
            Some(earlier) => RepairFloor {
                floor: earlier.floor.max(floor),
                reason: format!("{}; {reason}", earlier.reason),
            },
            None => RepairFloor { floor, reason },
        };
        fault = Some(merged);
    };
    match (&trust, &damage) {
        (_, None) => {}
        (Trust::Mark(mark), Some(damage)) => {
            let beyond = mark.log_id.is_none()
                || damage.segment > mark.segment
                || (damage.segment == mark.segment && damage.offset >= mark.end);
            if let (false, Some(acknowledged)) = (beyond, mark.log_id) {
                fault_at(
                    Floor::Entry(acknowledged),
                    format!(
                        "{} is damaged at offset {} ({}), at or below the watermark {acknowledged}",
                        segment_path(dir, damage.segment).display(),
                        damage.offset,
                        damage.reason
                    ),
                );
            }
        }
        (Trust::Legacy, Some(damage)) => {
            if damage.segment != segments.keys().next_back().copied().unwrap_or(0) {
                return Err(format!(
                    "raft log corrupt: {} at offset {}: {}",
                    segment_path(dir, damage.segment).display(),
                    damage.offset,
                    damage.reason
                ));
            }
        }
        (Trust::Lost(why), Some(damage)) => fault_at(
            Floor::Unknown,
            format!(
                "{why}, and {} is damaged at offset {} ({})",
                segment_path(dir, damage.segment).display(),
                damage.offset,
                damage.reason
            ),
        ),
    }
    // Where the readable log ends, once the damage is cut.
    let kept: Vec<Frame> = durable
        .iter()
        .copied()
        .filter(|f| damage.as_ref().is_none_or(|d| before(f, d)))
        .collect();
    if let (Trust::Mark(mark), Some(acknowledged)) = (&trust, watermark_entry(&trust)) {
        if last_purged.is_none_or(|p| acknowledged.index > p.index) {
            match kept.iter().find(|f| f.log_id.index == acknowledged.index) {
                None => fault_at(
                    Floor::Entry(acknowledged),
                    format!(
                        "the log ends at {}, before the watermark {acknowledged}",
                        kept.last()
                            .map(|f| f.log_id.to_string())
                            .or(last_purged.map(|p| p.to_string()))
                            .unwrap_or_else(|| "nothing".into())
                    ),
                ),
                Some(frame)
                    if frame.log_id != acknowledged
                        || frame.segment != mark.segment
                        || frame.end() != mark.end
                        || frame.crc != mark.frame_crc =>
                {
                    fault_at(
                        Floor::Entry(acknowledged),
                        format!(
                            "the entry at the watermark ({} in {} ending at {}) is not the \
                             one acknowledged ({acknowledged} ending at {})",
                            frame.log_id,
                            segment_path(dir, frame.segment).display(),
                            frame.end(),
                            mark.end
                        ),
                    )
                }
                Some(_) => {}
            }
        }
    }
    if let Trust::Lost(why) = &trust {
        if damage.is_none() {
            tracing::warn!(%why, "raft log watermark lost; the segments read whole, so it is written anew");
        }
    }
    // A node holds entries of a term above 0 only after it voted or followed a leader of
    // that term, which saves a vote first; the entries a new cluster's first node writes
    // when it initialises (term 0) come before any vote.
    let highest_term = kept
        .iter()
        .map(|f| f.log_id.leader_id.term)
        .max()
        .unwrap_or(0);
    let mut seeded_vote = None;
    if !has_vote && highest_term > 0 && marked {
        // Node id 0 is no node (ids start at 1): this refuses every candidate of that
        // term and follows only leaders of it or later.
        seeded_vote = Some(Vote::new(highest_term, 0));
        if !single_voter {
            fault_at(
                Floor::Unknown,
                "the vote file is missing or unreadable, so this node may already have voted in a term"
                    .into(),
            );
        }
    }

    // The floor first, durably; then the cut.
    let stored = repair_floor::read(dir)?;
    let floor = match (stored, fault) {
        (Some(stored), Some(new)) => Some(RepairFloor {
            floor: stored.floor.max(new.floor),
            reason: new.reason,
        }),
        (stored, new) => new.or(stored),
    };
    if let Some(floor) = &floor {
        repair_floor::write(dir, floor)
            .map_err(|e| format!("cannot store the repair floor in {}: {e}", dir.display()))?;
        tracing::error!(
            floor = ?floor.floor,
            reason = %floor.reason,
            "raft log: this node may have lost acknowledged entries; it will not campaign or \
             vote for a shorter log, and serves no reads, until the cluster repairs it"
        );
    }
    if let Some(damage) = &damage {
        if floor.is_none() {
            tracing::warn!(
                segment = %segment_path(dir, damage.segment).display(),
                offset = damage.offset,
                reason = %damage.reason,
                "cutting an unacknowledged torn write off the raft log (beyond the watermark)"
            );
        }
        if let Some(segment) = segments.get_mut(&damage.segment) {
            segment
                .file
                .set_len(damage.offset)
                .and_then(|()| segment.file.sync_data())
                .map_err(|e| format!("cannot cut segment {}: {e}", damage.segment))?;
            segment.len = damage.offset;
            segment.zeroed = damage.offset;
        }
    }
    for first in &later {
        remove_file(&segment_path(dir, *first))
            .map_err(|e| format!("cannot delete segment {first}: {e}"))?;
    }
    durable = kept.into_iter().collect();
    // A last segment with no frame left holds nothing.
    if let Some((&first, segment)) = segments.last_key_value() {
        if segment.len == 0 {
            segments.remove(&first);
            remove_file(&segment_path(dir, first))
                .map_err(|e| format!("cannot delete an empty segment: {e}"))?;
        }
    }
    drop_purged_segments(dir, last_purged, &mut segments, &durable)?;
    if !later.is_empty() || damage.is_some() {
        sync_dir(dir).map_err(|e| format!("cannot sync {}: {e}", dir.display()))?;
    }
    if created || matches!(trust, Trust::Legacy | Trust::Lost(_)) {
        // From here on the watermark speaks for this log.
        let mark = durable.back().map_or(Mark::EMPTY, |f| f.mark());
        watermark
            .write(&mark)
            .map_err(|e| format!("cannot write the watermark: {e}"))?;
    }
    if !marked {
        std::fs::write(dir.join(FORMAT_FILE), FORMAT)
            .and_then(|()| std::fs::File::open(dir.join(FORMAT_FILE))?.sync_all())
            .and_then(|()| sync_dir(dir))
            .map_err(|e| format!("cannot write {}: {e}", dir.join(FORMAT_FILE).display()))?;
    }
    Ok(Recovered {
        segments,
        durable,
        watermark,
        floor,
        seeded_vote,
    })
}

fn watermark_entry(trust: &Trust) -> Option<Id> {
    match trust {
        Trust::Mark(mark) => mark.log_id,
        _ => None,
    }
}

/// Whether `frame` lies before the damaged spot.
fn before(frame: &Frame, damage: &Damage) -> bool {
    frame.segment < damage.segment
        || (frame.segment == damage.segment && frame.offset < damage.offset)
}

fn segment_firsts(dir: &Path) -> Result<impl Iterator<Item = u64>, String> {
    let mut firsts = Vec::new();
    for item in std::fs::read_dir(dir).map_err(|e| format!("cannot list {}: {e}", dir.display()))? {
        let item = item.map_err(|e| format!("cannot list {}: {e}", dir.display()))?;
        let name = item.file_name();
        if let Some(first) = name
            .to_string_lossy()
            .strip_suffix(".seg")
            .and_then(|n| n.parse::<u64>().ok())
        {
            firsts.push(first);
        }
    }
    firsts.sort_unstable();
    Ok(firsts.into_iter())
}

/// Reads every segment's frames up to the first spot it cannot read on from. Returns the
/// segments (the damaged one included, whole), every readable frame after `last_purged`,
/// the damage, and the segments after the damaged one (to be deleted with it).
#[allow(clippy::type_complexity)]
#[expect(
    clippy::too_many_lines,
    reason = "the segment scan: each frame's checks in order, next to the crash reasoning for each"
)]
fn scan(
    dir: &Path,
    last_purged: Option<Id>,
) -> Result<
    (
        BTreeMap<u64, Segment>,
        VecDeque<Frame>,
        Option<Damage>,
        Vec<u64>,
    ),
    String,
> {
    let firsts: Vec<u64> = segment_firsts(dir)?.collect();
    let purged_to = last_purged.map(|p| p.index);
    let mut segments = BTreeMap::new();
    let mut durable: VecDeque<Frame> = VecDeque::new();
    let mut damage: Option<Damage> = None;
    let mut later = Vec::new();
    let mut expected: Option<(u64, u64)> = None; // (previous segment, next index)
    for &first in &firsts {
        if damage.is_some() {
            later.push(first);
            continue;
        }
        if let Some((previous, next)) = expected {
            if first != next {
                // A segment is missing or the previous one ends early: the log cannot
                // read on past the previous segment's end.
                let end = segments.get(&previous).map_or(0, |s: &Segment| s.len);
                damage = Some(Damage {
                    segment: previous,
                    offset: end,
                    reason: format!("the next segment starts at index {first}, not {next}"),
                });
                later.push(first);
                continue;
            }
        }
        let path = segment_path(dir, first);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
        let bytes =
            std::fs::read(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let mut offset = 0usize;
        let mut zeroed = None;
        let mut next = first;
        while offset < bytes.len() {
            if frame_header(&bytes[offset..]).is_some_and(|(len, _)| len == 0)
                && bytes[offset..].iter().all(|&b| b == 0)
            {
                // The zeros written ahead: the frames end here.
                zeroed = Some(bytes.len() as u64);
                break;
            }
            let frame = frame_header(&bytes[offset..])
                .filter(|(len, _)| offset + FRAME_HEADER + *len as usize <= bytes.len())
                .ok_or_else(|| "a frame runs past the end of the file".to_string())
                .and_then(|(len, crc)| {
                    decode_frame(&bytes[offset..offset + FRAME_HEADER + len as usize])
                        .map(|entry| (entry, len, crc))
                })
                .and_then(|(entry, len, crc)| {
                    if entry.log_id.index == next {
                        Ok((entry, len, crc))
                    } else {
                        Err(format!(
                            "holds index {} where {next} belongs",
                            entry.log_id.index
                        ))
                    }
                });
            let (entry, len, crc) = match frame {
                Ok(found) => found,
                Err(reason) => {
                    damage = Some(Damage {
                        segment: first,
                        offset: offset as u64,
                        reason,
                    });
                    break;
                }
            };
            if purged_to.is_none_or(|p| entry.log_id.index > p) {
                durable.push_back(Frame {
                    log_id: entry.log_id,
                    segment: first,
                    offset: offset as u64,
                    len,
                    crc,
                });
            }
            offset += FRAME_HEADER + len as usize;
            next += 1;
        }
        expected = Some((first, next));
        segments.insert(
            first,
            Segment {
                file: Arc::new(file),
                len: offset as u64,
                zeroed: zeroed.unwrap_or(offset as u64),
            },
        );
    }
    if let (Some(front), Some(p)) = (durable.front(), purged_to) {
        if front.log_id.index != p + 1 {
            return Err(format!(
                "raft log has a hole: purged to {p}, next entry is {}",
                front.log_id.index
            ));
        }
    }
    Ok((segments, durable, damage, later))
}

/// Deletes segments holding only purged entries (a purge interrupted before deleting them).
fn drop_purged_segments(
    dir: &Path,
    last_purged: Option<Id>,
    segments: &mut BTreeMap<u64, Segment>,
    durable: &VecDeque<Frame>,
) -> Result<(), String> {
    if last_purged.is_none() {
        return Ok(());
    }
    let keep_from = durable.front().map(|f| f.segment);
    let stale: Vec<u64> = segments
        .keys()
        .copied()
        .filter(|&first| keep_from.is_none_or(|keep| first < keep))
        .collect();
    for first in &stale {
        segments.remove(first);
        remove_file(&segment_path(dir, *first))
            .map_err(|e| format!("cannot delete a purged segment: {e}"))?;
    }
    if !stale.is_empty() {
        sync_dir(dir).map_err(|e| format!("cannot sync {}: {e}", dir.display()))?;
    }
    Ok(())
}

/// Empties the log in `dir` so that the node catches up from a snapshot: its state
/// machine is behind the log's start and the log cannot replay it. The entries it had
/// acknowledged go with it, so a repair floor at its watermark is stored first; the vote
/// stays. Interrupted at any step, the next start finds the floor and does the rest again.
pub(super) fn discard_for_snapshot(dir: &Path, reason: &str) -> Result<(), String> {
    let (mut watermark, found) = Watermark::open(dir)?;
    let purged: Option<Id> = super::log_store::read_purged(dir).unwrap_or(None);
    let floor = match found {
        Found::Mark(mark) => match mark.log_id.max(purged) {
            Some(last) => Floor::Entry(last),
            None => Floor::Unknown,
        },
        Found::Created | Found::Unreadable(_) => Floor::Unknown,
    };
    let stored = repair_floor::read(dir)?;
    let floor = RepairFloor {
        floor: stored.map_or(floor, |s| s.floor.max(floor)),
        reason: format!("{reason}; the log was emptied to take a snapshot"),
    };
    repair_floor::write(dir, &floor)
        .map_err(|e| format!("cannot store the repair floor in {}: {e}", dir.display()))?;
    tracing::error!(floor = ?floor.floor, %reason, "raft log emptied: this node is rebuilt from a snapshot");
    for first in segment_firsts(dir)? {
        remove_file(&segment_path(dir, first))
            .map_err(|e| format!("cannot delete segment {first}: {e}"))?;
    }
    for name in [PURGED_FILE, COMMITTED_FILE] {
        remove_file(&dir.join(name)).map_err(|e| format!("cannot delete {name}: {e}"))?;
    }
    sync_dir(dir).map_err(|e| format!("cannot sync {}: {e}", dir.display()))?;
    watermark
        .write(&Mark::EMPTY)
        .map_err(|e| format!("cannot write the watermark: {e}"))
}
