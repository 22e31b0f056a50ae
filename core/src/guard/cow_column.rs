//! A column of small values kept one per action for an agent's whole life, cloned in
//! constant time.
//!
//! A node decides each write on a clone of the agent's state (its lane's pending state),
//! so with a plain `Vec` every decision copied the agent's whole history: at 31,000
//! actions an agent, 93 KB a decision. Here full chunks of `CHUNK` values are shared
//! (`Arc`) between clones and copied only when one clone changes a value in them; a clone
//! copies the list of chunks' pointers only when it first adds a chunk or changes one, and
//! the unfinished last chunk always. Serialized as the plain list of values, as the `Vec`
//! it replaces was.

use std::sync::Arc;

use serde::ser::SerializeSeq;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Values in a shared chunk, by default: a clone copies fewer than this many.
pub const DEFAULT_CHUNK: usize = 4096;

#[derive(Clone, Debug)]
pub struct CowColumn<T, const CHUNK: usize = DEFAULT_CHUNK> {
    /// Full chunks, `CHUNK` values each.
    chunks: Arc<Vec<Arc<[T]>>>,
    /// The values after them: fewer than `CHUNK`.
    tail: Vec<T>,
}

impl<T, const CHUNK: usize> Default for CowColumn<T, CHUNK> {
    fn default() -> Self {
        CowColumn {
            chunks: Arc::default(),
            tail: Vec::new(),
        }
    }
}

impl<T: Copy, const CHUNK: usize> CowColumn<T, CHUNK> {
    pub fn len(&self) -> usize {
        self.chunks.len() * CHUNK + self.tail.len()
    }

    pub fn push(&mut self, value: T) {
        self.tail.push(value);
        if self.tail.len() == CHUNK {
            let full: Arc<[T]> = std::mem::take(&mut self.tail).into();
            Arc::make_mut(&mut self.chunks).push(full);
        }
    }

    pub fn get(&self, index: usize) -> Option<T> {
        match self.chunks.get(index / CHUNK) {
            Some(chunk) => chunk.get(index % CHUNK).copied(),
            None => self
                .tail
                .get(index.checked_sub(self.chunks.len() * CHUNK)?)
                .copied(),
        }
    }

    /// Changes the value at `index`; false (and nothing changed) past the end.
    pub fn set(&mut self, index: usize, value: T) -> bool {
        let full = self.chunks.len() * CHUNK;
        if index < full {
            let chunks = Arc::make_mut(&mut self.chunks);
            Arc::make_mut(&mut chunks[index / CHUNK])[index % CHUNK] = value;
            return true;
        }
        match self.tail.get_mut(index - full) {
            Some(slot) => {
                *slot = value;
                true
            }
            None => false,
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = T> + '_ {
        self.chunks
            .iter()
            .flat_map(|chunk| chunk.iter())
            .chain(self.tail.iter())
            .copied()
    }
}

impl<T: Copy + PartialEq, const CHUNK: usize> PartialEq for CowColumn<T, CHUNK> {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}

impl<T: Copy + Eq, const CHUNK: usize> Eq for CowColumn<T, CHUNK> {}

impl<T: Copy, const CHUNK: usize> FromIterator<T> for CowColumn<T, CHUNK> {
    fn from_iter<I: IntoIterator<Item = T>>(values: I) -> Self {
        let mut column = CowColumn::default();
        for value in values {
            column.push(value);
        }
        column
    }
}

impl<T: Copy + Serialize, const CHUNK: usize> Serialize for CowColumn<T, CHUNK> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serialize_list(serializer, self.len(), self.iter())
    }
}

/// `values` (`len` of them) as a plain list, its length declared up front: how the
/// columns serialize, as the `Vec`s they replace did.
pub(super) fn serialize_list<S: Serializer, T: Serialize>(
    serializer: S,
    len: usize,
    values: impl Iterator<Item = T>,
) -> Result<S::Ok, S::Error> {
    let mut seq = serializer.serialize_seq(Some(len))?;
    for value in values {
        seq.serialize_element(&value)?;
    }
    seq.end()
}

impl<'de, T: Copy + Deserialize<'de>, const CHUNK: usize> Deserialize<'de> for CowColumn<T, CHUNK> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Ok(Vec::<T>::deserialize(deserializer)?.into_iter().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against a plain `Vec` doing the same: pushes across chunk edges, changes in shared
    /// chunks and in the tail, from clones taken along the way, each clone unchanged by
    /// what the others did.
    #[test]
    fn clones_read_like_vecs_and_never_see_each_others_changes() {
        clones_read_like_vecs::<DEFAULT_CHUNK>(1000);
        clones_read_like_vecs::<64>(17);
    }

    /// The check above for chunks of `N`, a clone taken every `every` pushes.
    fn clones_read_like_vecs<const N: usize>(every: usize) {
        let mut column = CowColumn::<u16, N>::default();
        let mut model = Vec::new();
        let mut snapshots: Vec<(CowColumn<u16, N>, Vec<u16>)> = Vec::new();
        for i in 0..3 * N + 100 {
            let value = (i * 7 % 65_521) as u16;
            column.push(value);
            model.push(value);
            if i % every == every - 1 {
                snapshots.push((column.clone(), model.clone()));
                // A change in a shared chunk and one in the tail, in this copy only.
                let early = i / 3;
                assert!(column.set(early, 1));
                model[early] = 1;
                assert!(column.set(i, 2));
                model[i] = 2;
            }
        }
        assert!(!column.set(model.len(), 3), "past the end");
        assert_eq!(column.len(), model.len());
        for (index, value) in model.iter().enumerate() {
            assert_eq!(column.get(index), Some(*value), "index {index}");
        }
        assert_eq!(column.get(model.len()), None);
        assert!(column.iter().eq(model.iter().copied()));
        for (clone, was) in &snapshots {
            assert_eq!(clone.len(), was.len());
            assert!(clone.iter().eq(was.iter().copied()));
        }
        // A clone shares the full chunks: it copied none of them.
        let clone = column.clone();
        assert!(Arc::ptr_eq(&clone.chunks, &column.chunks));

        let json = serde_json::to_string(&column).unwrap();
        assert_eq!(json, serde_json::to_string(&model).unwrap());
        let back: CowColumn<u16, N> = serde_json::from_str(&json).unwrap();
        assert_eq!(back, column);
    }
}
