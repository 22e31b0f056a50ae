//! Whole-log verification (`/verify`, the scrub) on every core, but only on cores the
//! node's own work leaves idle: its worker threads run at the lowest scheduling priority,
//! so the threads that decide, replicate and write pre-empt them whenever they are
//! runnable. An idle node verifies on all its cores; a busy one barely notices.

use lineage_core::verify::{BatchVerifier, VerifyOptions};

/// The nice value verification workers run at: the lowest priority there is.
pub const WORKER_NICE: i32 = 19;

/// A verifier for a whole stored log, on all cores at [`WORKER_NICE`].
pub fn verifier(options: VerifyOptions) -> BatchVerifier {
    BatchVerifier::new(options, BatchVerifier::all_cores()).with_worker_start(lower_priority)
}

/// Lowers the calling thread's priority to [`WORKER_NICE`] (on Linux the nice value
/// is per thread; the workers are scoped threads that end with their batch, so no
/// pooled thread keeps it). Lowering needs no privilege; if it fails anyway, the
/// worker runs at normal priority, as a verification did before.
fn lower_priority() {
    if let Err(e) = rustix::process::setpriority_process(None, WORKER_NICE) {
        tracing::debug!(error = %e, "cannot lower a verification worker's priority");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This thread's nice value, from /proc (field 19 of its stat line, counted after
    /// the parenthesised name, which may hold spaces).
    fn own_nice() -> i32 {
        let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap();
        let after_name = &stat[stat.rfind(')').unwrap() + 2..];
        after_name.split(' ').nth(16).unwrap().parse().unwrap()
    }

    #[test]
    fn workers_run_at_the_lowest_priority_and_the_caller_keeps_its_own() {
        let before = own_nice();
        let nice_in_worker = std::thread::spawn(|| {
            lower_priority();
            own_nice()
        })
        .join()
        .unwrap();
        assert_eq!(nice_in_worker, WORKER_NICE);
        assert_eq!(own_nice(), before);
    }
}
