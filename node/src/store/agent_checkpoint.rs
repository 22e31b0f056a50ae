//! How an agent's checkpoint (its state as of its last record, so start-up replays only
//! what follows) is stored: its JSON packed (`packed_run`, one zstd frame of one line),
//! sealed with SHA-256 (`checked_row`).
//!
//! Why packed: a checkpoint is mostly hex (the Merkle frontier, the head's hashes, the
//! key) and timestamps that share their leading digits; with 10,000 agents of 10
//! records each, checkpoints were a quarter of the pages in use (`redb_tables`).
//!
//! Reading checks the seal, then the frame. A row from before packing (sealed JSON, which
//! begins with `{`; a packed row begins with its format byte) is still read. Any failure
//! is an error: the caller replays the agent's records from the start instead, since
//! the records, not the checkpoint, are the truth.

use lineage_core::guard::AgentState;

use super::{checked_row, packed_run};

/// The most text a checkpoint may declare. A state's JSON grows with what it keeps per
/// action, far beyond a run of records; the seal is checked before this is read, so the
/// bound is against a runaway size, not damage.
const MAX_JSON_BYTES: usize = u32::MAX as usize;

/// The JSON of `state`, as a checkpoint stores it: the part that reads the state (done
/// under the data lock), apart from [`row`], the slow part (done after it).
pub fn json(state: &AgentState) -> Result<String, String> {
    serde_json::to_string(state).map_err(|e| format!("agent checkpoint: {e}"))
}

/// The row stored for a state's [`json`].
pub fn row(json: &str) -> Result<Vec<u8>, String> {
    // Compact JSON escapes every line break, so the text is one line.
    let packed = packed_run::pack(json, 1)?;
    Ok(checked_row::seal(&packed))
}

/// The state a stored row holds, checked.
pub fn decode(row: &[u8]) -> Result<AgentState, String> {
    let content = checked_row::unseal(row)?;
    let parsed = if content.first() == Some(&b'{') {
        serde_json::from_slice(content)
    } else {
        serde_json::from_str(&packed_run::unpack_within(content, MAX_JSON_BYTES)?)
    };
    parsed.map_err(|e| format!("agent checkpoint: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> AgentState {
        let mut state = AgentState::new();
        state.agent_id = "bot-7".into();
        state.public_key = "ab".repeat(32);
        state.spent = 1234;
        state
    }

    #[test]
    fn a_checkpoint_reads_back_as_written_and_an_older_unpacked_one_too() {
        let state = state();
        let row = row(&json(&state).unwrap()).unwrap();
        assert_eq!(decode(&row).unwrap(), state);
        let json = serde_json::to_vec(&state).unwrap();
        assert!(
            row.len() < json.len() + 32,
            "{} of {}",
            row.len(),
            json.len()
        );
        let older = checked_row::seal(&json);
        assert_eq!(decode(&older).unwrap(), state);
    }

    /// Every flipped bit, a zeroed row and every cut is an error: the caller replays.
    #[test]
    fn a_damaged_checkpoint_is_an_error_never_another_state() {
        let row = row(&json(&state()).unwrap()).unwrap();
        for byte in 0..row.len() {
            for bit in 0..8 {
                let mut damaged = row.clone();
                damaged[byte] ^= 1 << bit;
                assert!(decode(&damaged).is_err(), "bit {bit} of byte {byte}");
            }
        }
        assert!(decode(&vec![0; row.len()]).is_err());
        for len in 0..row.len() {
            assert!(decode(&row[..len]).is_err(), "cut to {len}");
        }
    }
}
