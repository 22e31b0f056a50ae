//! The request seqs of an agent's numbered actions (`act-1`, `act-2`, …), one per action
//! for its whole life, in about 2 bytes each instead of 8.
//!
//! Requests are logged in order, so consecutive actions' seqs lie a few records apart:
//! each block of 64 keeps its first seq whole, and each later action its distance from
//! the one before in 16 bits; a lookup adds up at most 63 of them. A seq that is not
//! within 16 bits above the one before (a gap of 65,535 records, or a log written
//! elsewhere) is kept whole in a map beside. Serialized as the plain list of seqs, as the
//! `Vec<u64>` it replaces was: checkpoints read the same.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::cow_column::{self, CowColumn};

const BLOCK: usize = 64;
/// An offset that says "look in `whole`".
const WHOLE: u16 = u16::MAX;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SeqColumn {
    /// Each block's first seq (one per 64 actions, so in chunks of 64: a clone copies
    /// the bases of fewer than 4,096 actions, as it copies their offsets).
    bases: CowColumn<u64, 64>,
    /// Each action's seq less the one before it (0 at a block's start), or `WHOLE`.
    offsets: CowColumn<u16>,
    /// The seqs whose offset is `WHOLE`, by index.
    whole: BTreeMap<usize, u64>,
}

impl SeqColumn {
    pub fn push(&mut self, seq: u64) {
        let index = self.offsets.len();
        let offset = if index.is_multiple_of(BLOCK) {
            self.bases.push(seq);
            Some(0)
        } else {
            self.get(index - 1)
                .and_then(|before| seq.checked_sub(before))
                .and_then(|d| u16::try_from(d).ok())
                .filter(|&d| d != WHOLE)
        };
        match offset {
            Some(offset) => self.offsets.push(offset),
            None => {
                self.offsets.push(WHOLE);
                self.whole.insert(index, seq);
            }
        }
    }

    pub fn get(&self, index: usize) -> Option<u64> {
        let start = index - index % BLOCK;
        let mut seq = self.bases.get(index / BLOCK)?;
        for at in start + 1..=index {
            seq = match self.offsets.get(at)? {
                WHOLE => *self.whole.get(&at)?,
                offset => seq.checked_add(u64::from(offset))?,
            };
        }
        Some(seq)
    }

    /// Every seq in order (one pass, not a lookup each).
    fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        let mut seq = 0;
        let mut bases = self.bases.iter();
        self.offsets.iter().enumerate().map(move |(index, offset)| {
            // `push` keeps a base for every block and a whole seq for every `WHOLE`.
            seq = if index.is_multiple_of(BLOCK) {
                let base = bases.next();
                debug_assert!(base.is_some(), "block {} has no base", index / BLOCK);
                base.unwrap_or(seq)
            } else if offset == WHOLE {
                let whole = self.whole.get(&index).copied();
                debug_assert!(whole.is_some(), "seq {index} is not kept whole");
                whole.unwrap_or(seq)
            } else {
                seq + u64::from(offset)
            };
            seq
        })
    }
}

impl Serialize for SeqColumn {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        cow_column::serialize_list(serializer, self.offsets.len(), self.iter())
    }
}

impl<'de> Deserialize<'de> for SeqColumn {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let seqs = Vec::<u64>::deserialize(deserializer)?;
        let mut column = SeqColumn::default();
        for seq in seqs {
            column.push(seq);
        }
        Ok(column)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every seq reads back, whatever the gaps: small ones, ones past 16 bits, a seq
    /// below its block's first, and the offset that would collide with the marker.
    #[test]
    fn every_seq_reads_back_and_serializes_as_a_plain_list() {
        let mut seqs = Vec::new();
        let mut seq = 3u64;
        for i in 0..1_000u64 {
            seq += match i % 97 {
                0 => 70_000,
                1 => u64::from(WHOLE) - 1,
                // A step of exactly the marker's value: kept whole, not read as a marker.
                2 => u64::from(WHOLE),
                _ => 1 + i % 5,
            };
            seqs.push(seq);
        }
        seqs.insert(130, 1); // below its block's base
        seqs.push(u64::MAX);
        let mut column = SeqColumn::default();
        for &seq in &seqs {
            column.push(seq);
        }
        assert_eq!(column.offsets.len(), seqs.len());
        for (index, &seq) in seqs.iter().enumerate() {
            assert_eq!(column.get(index), Some(seq), "index {index}");
        }
        assert_eq!(column.get(seqs.len()), None);
        // One whole seq per step too wide (two kinds), the one below its block's first and
        // the one after it, and the last.
        assert!(
            column.whole.len() <= 2 * (1_000 / 97 + 1) + 3,
            "{:?}",
            column.whole
        );

        let json = serde_json::to_string(&column).unwrap();
        assert_eq!(json, serde_json::to_string(&seqs).unwrap());
        let back: SeqColumn = serde_json::from_str(&json).unwrap();
        assert_eq!(back, column);
    }
}
