//! A column of small values kept one per action for an agent's whole life, cloned in
//! constant time.
//!
//! A node decides each write on a clone of the agent's state (its lane's pending state),
//! so with a plain `Vec` every decision copied the agent's whole history: at 31,000
//! actions an agent, 93 KB a decision. Here full chunks of [`CHUNK`] values are shared
//! (`Arc`) between clones and copied only when one clone changes a value in them; a clone
//! copies the list of chunks' pointers only when it first adds a chunk or changes one, and
//! the unfinished last chunk always. Serialized as the plain list of values, as the `Vec`
//! it replaces was.

use std::sync::Arc;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Values in a shared chunk.
pub const CHUNK: usize = 4096;

#[derive(Clone, Debug)]
pub struct CowColumn<T> {
    /// Full chunks, [`CHUNK`] values each.
    chunks: Arc<Vec<Arc<[T]>>>,
    /// The values after them: fewer than [`CHUNK`].
    tail: Vec<T>,
}

impl<T> Default for CowColumn<T> {
    fn default() -> Self {
        CowColumn {
            chunks: Arc::default(),
            tail: Vec::new(),
        }
    }
}

impl<T: Copy> CowColumn<T> {
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

impl<T: Copy + PartialEq> PartialEq for CowColumn<T> {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}

impl<T: Copy + Eq> Eq for CowColumn<T> {}

impl<T: Copy> FromIterator<T> for CowColumn<T> {
    fn from_iter<I: IntoIterator<Item = T>>(values: I) -> Self {
        let mut column = CowColumn::default();
        for value in values {
            column.push(value);
        }
        column
    }
}

impl<T: Copy + Serialize> Serialize for CowColumn<T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.iter())
    }
}

impl<'de, T: Copy + Deserialize<'de>> Deserialize<'de> for CowColumn<T> {
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
        let mut column = CowColumn::default();
        let mut model = Vec::new();
        let mut snapshots: Vec<(CowColumn<u16>, Vec<u16>)> = Vec::new();
        for i in 0..3 * CHUNK + 100 {
            let value = (i * 7 % 65_521) as u16;
            column.push(value);
            model.push(value);
            if i % 1000 == 999 {
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
        let back: CowColumn<u16> = serde_json::from_str(&json).unwrap();
        assert_eq!(back, column);
    }
}
