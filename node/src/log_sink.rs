//! Where the node's log lines go: to stderr, through a bounded queue that a thread of its
//! own writes out, so that a log reader that stops reading never stops the node.
//!
//! stderr is a pipe to a supervisor (compose's log driver, journald) or a file. When that
//! reader stalls (its disk stalled, it hung), a write to the full pipe blocks; written in
//! place, the first line logged on a tokio worker would hold that worker, and soon every
//! worker, so the node would stop answering its peers and clients because its log could
//! not be written. Here a line that finds the queue full is dropped and counted
//! (`lineage_log_lines_dropped_total`): a lost log line costs less than a node that
//! stops serving.
//!
//! On the way out of the process, [`flush`] writes out what is queued, and
//! [`last_words`] then writes a final line directly, each waiting a bounded time
//! (`std::process::exit` runs no destructors, and a full pipe must not keep a process
//! that means to exit alive).

use std::sync::OnceLock;
use std::time::Duration;

use parking_lot::Mutex;
use tracing_appender::non_blocking::{ErrorCounter, NonBlocking, NonBlockingBuilder, WorkerGuard};

/// Lines waiting to be written, at most: a few MB at the few hundred bytes a line takes,
/// and some seconds of a busy node's debug logging.
pub const QUEUED_LINES: usize = 8192;
/// How long [`last_words`] waits for its line to be written.
const LAST_WORDS_WAIT: Duration = Duration::from_secs(1);

static DROPPED: OnceLock<ErrorCounter> = OnceLock::new();
/// Dropping it writes out what is queued, waiting at most about a second.
static WORKER: Mutex<Option<WorkerGuard>> = Mutex::new(None);

/// The writer for the node's log layer. Call [`flush`] before the process ends.
pub fn stderr() -> NonBlocking {
    let (writer, guard) = NonBlockingBuilder::default()
        .lossy(true)
        .buffered_lines_limit(QUEUED_LINES)
        .thread_name("lineage-log")
        .finish(std::io::stderr());
    // Only the first sink counts (a process sets up its logging once).
    let _ = DROPPED.set(writer.error_counter());
    *WORKER.lock() = Some(guard);
    writer
}

/// Writes out the queued lines (waiting at most about a second); lines logged after this
/// are dropped. Does nothing if another thread is flushing now.
pub fn flush() {
    let guard = WORKER
        .try_lock_for(LAST_WORDS_WAIT)
        .and_then(|mut worker| worker.take());
    drop(guard);
}

/// Log lines dropped because the queue was full (0 before [`stderr`] is called).
pub fn dropped_lines() -> u64 {
    DROPPED
        .get()
        .map_or(0, |dropped| dropped.dropped_lines() as u64)
}

/// Writes out the queue ([`flush`]), then `line` to stderr directly, waiting at most a
/// second for it.
pub fn last_words(line: String) {
    flush();
    let (written, wait) = std::sync::mpsc::channel();
    let line_for_writer = line.clone();
    let writer = std::thread::Builder::new()
        .name("lineage-last-words".into())
        .spawn(move || {
            eprintln!("{line_for_writer}");
            let _ = written.send(());
        });
    match writer {
        Ok(_) => {
            let _ = wait.recv_timeout(LAST_WORDS_WAIT);
        }
        // No thread to spare (often why a process is dying): write it here, unbounded.
        Err(_) => eprintln!("{line}"),
    }
}
