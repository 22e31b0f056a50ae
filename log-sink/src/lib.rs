//! Where a process's log lines go: to stderr, through a bounded queue that a thread of
//! its own writes out, so that a log reader that stops reading never stops the process.
//!
//! stderr is a pipe to a supervisor (compose's log driver, journald) or a file. When that
//! reader stalls (its disk stalled, it hung), a write to the full pipe blocks; written in
//! place, the first line logged on a tokio worker would hold that worker, and soon every
//! worker, so a node would stop answering its peers and clients (and a witness its
//! submitters) because its log could not be written. Here a line that finds the queue
//! full is dropped and counted ([`dropped_lines`]): a lost log line costs less than a
//! process that stops serving.
//!
//! Every write on the way out is bounded: [`flush`] writes out what is queued,
//! [`say`] writes one line directly, [`last_words`] does both before an exit
//! (`std::process::exit` runs no destructors, and a full pipe must not keep a process
//! that means to exit alive).

use std::sync::OnceLock;
use std::time::Duration;

use parking_lot::Mutex;
use tracing_appender::non_blocking::{ErrorCounter, NonBlocking, NonBlockingBuilder, WorkerGuard};

/// Lines waiting to be written, at most: a few MB at the few hundred bytes a line takes,
/// and some seconds of a busy node's debug logging.
pub const QUEUED_LINES: usize = 8192;
/// How long one bounded write on the way out waits.
const WAIT: Duration = Duration::from_secs(1);

static DROPPED: OnceLock<ErrorCounter> = OnceLock::new();
/// Dropping it writes out what is queued.
static WORKER: Mutex<Option<WorkerGuard>> = Mutex::new(None);

/// The writer for the process's log layer. Call [`flush`] (or [`last_words`]) before
/// the process ends.
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

/// Log lines dropped because the queue was full (0 before [`stderr`] is called).
pub fn dropped_lines() -> u64 {
    DROPPED
        .get()
        .map_or(0, |dropped| dropped.dropped_lines() as u64)
}

/// Writes out the queued lines, waiting at most a few seconds; lines logged after this
/// are dropped. Only for the way out of the process.
pub fn flush() {
    // Held while the queue is written out, so a second caller waits for the first.
    let Some(mut worker) = WORKER.try_lock_for(WAIT) else {
        return;
    };
    if let Some(guard) = worker.take() {
        // Dropping the guard waits for the log thread (about a second at most), and,
        // with the queue full, then prints to stdout, which may be the same stalled
        // pipe: on a thread of its own.
        bounded(move || drop(guard), 2 * WAIT);
    }
}

/// Writes `line` to stderr directly, waiting at most a second for it.
pub fn say(line: String) {
    bounded(move || eprintln!("{line}"), WAIT);
}

/// Before an exit: writes out the queue ([`flush`]), then `line` ([`say`]).
pub fn last_words(line: String) {
    flush();
    say(line);
}

/// Runs `write` on a thread of its own and waits at most `wait` for it. With no thread
/// to spare (often why a process is dying), runs it here, unbounded.
fn bounded(write: impl FnOnce() + Send + 'static, wait: Duration) {
    let (done, finished) = std::sync::mpsc::channel();
    let write = std::sync::Arc::new(Mutex::new(Some(write)));
    let on_thread = write.clone();
    let spawned = std::thread::Builder::new()
        .name("lineage-last-words".into())
        .spawn(move || {
            if let Some(write) = on_thread.lock().take() {
                write();
            }
            let _ = done.send(());
        });
    match spawned {
        Ok(_) => {
            let _ = finished.recv_timeout(wait);
        }
        Err(_) => {
            if let Some(write) = write.lock().take() {
                write();
            }
        }
    }
}
