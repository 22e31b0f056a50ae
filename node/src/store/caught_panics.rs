//! A panic inside redb while it opens the state machine's file (or checks its pages) is
//! taken for damage to the file, not for the end of the process: redb 2.6 asserts on a
//! header field no check can judge (a region tracker page moved within the file by a
//! flipped bit), so without this such a file stopped the node at every start. The
//! process's panic hook (`main.rs`) exits on any other panic; on a thread inside
//! [`catching`] it lets the panic unwind to here. A panic redb turns into an abort (one
//! while it unwinds with a poisoned lock) is not caught.

use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};

thread_local! {
    static CATCHING: Cell<bool> = const { Cell::new(false) };
}

/// Whether the current thread is inside [`catching`] (for the panic hook; false for a
/// thread whose thread-locals are already gone, so the hook never panics itself).
pub fn is_catching() -> bool {
    CATCHING.try_with(Cell::get).unwrap_or(false)
}

/// Runs `work`; a panic in it is returned as its message.
pub fn catching<T>(work: impl FnOnce() -> T) -> Result<T, String> {
    let was = CATCHING.with(|c| c.replace(true));
    let outcome = catch_unwind(AssertUnwindSafe(work));
    CATCHING.with(|c| c.set(was));
    outcome.map_err(|panic| lineage_redb_header::panic_message(panic.as_ref()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_inside_is_its_message_and_the_flag_is_only_set_inside() {
        assert!(!is_catching());
        assert_eq!(catching(is_catching), Ok(true));
        let caught = catching(|| -> u8 { panic!("assertion failed: tracker") });
        assert_eq!(caught, Err("assertion failed: tracker".to_string()));
        assert!(!is_catching());
    }
}
