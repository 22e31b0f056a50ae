//! The lock over the applied state. Beyond a plain `RwLock` it does two things, for a
//! holder that waits on a stalled disk (an entry's own commit under the write lock; a
//! checkpoint's flush under it; a snapshot's view, which flushes under a read hold that
//! a writer then queues behind, and readers behind that writer):
//! - a wait for it on one of tokio's worker threads is moved off that worker
//!   (`block_in_place`), so requests stuck behind such a holder do not take every
//!   worker, and the node's health, readiness and metrics still answer;
//! - it says how long readers have been kept out (a write holding it, or a writer
//!   waiting for it), and how many threads wait, so the HTTP layer can refuse at once
//!   past a limit (`api::forward`) instead of piling up waiting requests (each waits
//!   on a thread of tokio's blocking pool, which is finite).
//!
//! A wait stays where it is for up to a millisecond first (`WAIT_IN_PLACE`); a write
//! reads the clock twice. The lock is parking_lot's: no poisoning (the state is rebuilt
//! from disk on restart anyway), and timed waits.

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};

/// How long a wait for the lock stays on the thread that asks before it moves off a
/// worker: an apply holds the lock for a few hundred µs, and a move costs a hand-off to
/// a thread of the blocking pool (measured: 0.93× decisions/s on one node when every
/// contended wait moved).
const WAIT_IN_PLACE: Duration = Duration::from_millis(1);

pub struct DataLock<T> {
    lock: RwLock<T>,
    /// When the current write hold began: µs since `epoch`, plus one; 0 while none.
    write_held_since: AtomicU64,
    /// When a writer that found the lock taken began to wait, the same way (the first
    /// such writer marks it, and clears it once it holds the lock; readers wait behind
    /// a waiting writer).
    writer_waiting_since: AtomicU64,
    /// Threads waiting for the lock off a worker.
    waiters: AtomicUsize,
    epoch: Instant,
}

/// A write hold: the guard, and the mark [`DataLock::write_held_for`] reads, cleared
/// when it ends.
pub struct WriteHold<'a, T> {
    guard: RwLockWriteGuard<'a, T>,
    since: &'a AtomicU64,
}

impl<T> Deref for WriteHold<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<T> DerefMut for WriteHold<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.guard
    }
}

impl<T> Drop for WriteHold<'_, T> {
    fn drop(&mut self) {
        // Cleared before the guard (a field) is released.
        self.since.store(0, Ordering::Release);
    }
}

impl<T> DataLock<T> {
    pub fn new(value: T) -> Self {
        DataLock {
            lock: RwLock::new(value),
            write_held_since: AtomicU64::new(0),
            writer_waiting_since: AtomicU64::new(0),
            waiters: AtomicUsize::new(0),
            epoch: Instant::now(),
        }
    }

    pub fn read(&self) -> RwLockReadGuard<'_, T> {
        match self.lock.try_read_for(WAIT_IN_PLACE) {
            Some(guard) => guard,
            None => self.wait(|| self.lock.read()),
        }
    }

    /// The read guard if nobody writes or waits to write now (a scrape polls rather
    /// than wait).
    pub fn try_read(&self) -> Option<RwLockReadGuard<'_, T>> {
        self.lock.try_read()
    }

    pub fn write(&self) -> WriteHold<'_, T> {
        let guard = match self.lock.try_write() {
            Some(guard) => guard,
            None => {
                let marked = self
                    .writer_waiting_since
                    .compare_exchange(0, self.now(), Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok();
                let guard = match self.lock.try_write_for(WAIT_IN_PLACE) {
                    Some(guard) => guard,
                    None => self.wait(|| self.lock.write()),
                };
                if marked {
                    self.writer_waiting_since.store(0, Ordering::Release);
                }
                guard
            }
        };
        self.write_held_since.store(self.now(), Ordering::Release);
        WriteHold {
            guard,
            since: &self.write_held_since,
        }
    }

    /// How long the current write hold has lasted (`None`: no write holds it).
    pub fn write_held_for(&self) -> Option<Duration> {
        self.age(&self.write_held_since)
    }

    /// How long a reader arriving now would have been kept out: the longer of the
    /// current write hold and the wait of a writer queued for the lock (`None`: neither).
    pub fn readers_kept_out_for(&self) -> Option<Duration> {
        match (self.write_held_for(), self.age(&self.writer_waiting_since)) {
            (Some(held), Some(waited)) => Some(held.max(waited)),
            (held, waited) => held.or(waited),
        }
    }

    /// Threads waiting for the lock now (each on a thread of its own).
    pub fn waiters(&self) -> usize {
        self.waiters.load(Ordering::Relaxed)
    }

    fn wait<R>(&self, wait: impl FnOnce() -> R) -> R {
        self.waiters.fetch_add(1, Ordering::Relaxed);
        let result = off_the_worker(wait);
        self.waiters.fetch_sub(1, Ordering::Relaxed);
        result
    }

    /// Now as a mark: µs since `epoch`, plus one (0 means "no mark").
    fn now(&self) -> u64 {
        (self.epoch.elapsed().as_micros() as u64).saturating_add(1)
    }

    fn age(&self, mark: &AtomicU64) -> Option<Duration> {
        let since = mark.load(Ordering::Acquire);
        (since != 0).then(|| Duration::from_micros(self.now().saturating_sub(since)))
    }
}

/// Runs `wait` so that, on a worker of tokio's multi-threaded runtime, the worker's
/// other tasks move to another thread meanwhile. Elsewhere (a blocking-pool thread, a
/// plain thread, a current-thread runtime, where `block_in_place` would panic) it
/// simply runs.
fn off_the_worker<R>(wait: impl FnOnce() -> R) -> R {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(wait)
        }
        _ => wait(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_write_hold_is_timed_while_it_lasts() {
        let lock = DataLock::new(0u32);
        assert_eq!(lock.write_held_for(), None);
        {
            let mut hold = lock.write();
            *hold += 1;
            std::thread::sleep(Duration::from_millis(20));
            let held = lock.write_held_for().expect("held");
            assert!(held >= Duration::from_millis(20), "{held:?}");
            assert!(lock.try_read().is_none());
        }
        assert_eq!(lock.write_held_for(), None);
        assert_eq!(*lock.read(), 1);
        assert_eq!(lock.try_read().map(|g| *g), Some(1));
    }

    /// A long read hold (a snapshot's view flushing on a slow disk) with a writer queued
    /// behind it keeps readers out too: that is counted from when the writer began to
    /// wait, and the waiting writer is counted.
    #[test]
    fn a_writer_waiting_behind_a_long_read_counts_as_keeping_readers_out() {
        let lock = Arc::new(DataLock::new(0u32));
        let read = lock.read();
        let writer = {
            let lock = lock.clone();
            std::thread::spawn(move || *lock.write() += 1)
        };
        let start = std::time::Instant::now();
        while lock.waiters() == 0 {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "no writer waited"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(20));
        let kept_out = lock.readers_kept_out_for().expect("a writer waits");
        assert!(kept_out >= Duration::from_millis(20), "{kept_out:?}");
        assert_eq!(lock.write_held_for(), None);
        drop(read);
        writer.join().unwrap();
        assert_eq!(lock.readers_kept_out_for(), None);
        assert_eq!(lock.waiters(), 0);
        assert_eq!(*lock.read(), 1);
    }

    /// A holder stuck for as long as the test says (a stalled disk) while the runtime's
    /// only two workers each run a task waiting for the lock: a third task still runs.
    /// With a plain `read()` both workers would wait and the third would not run until
    /// the hold ended.
    #[test]
    fn waiters_on_the_workers_leave_the_runtime_running() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let lock = Arc::new(DataLock::new(7u32));
        let (release, released) = std::sync::mpsc::channel::<()>();
        let holder = {
            let lock = lock.clone();
            let (held, is_held) = std::sync::mpsc::channel();
            let thread = std::thread::spawn(move || {
                let _hold = lock.write();
                held.send(()).unwrap();
                let _ = released.recv_timeout(Duration::from_secs(60));
            });
            is_held.recv().unwrap();
            thread
        };
        let waiters: Vec<_> = (0..2)
            .map(|_| {
                let lock = lock.clone();
                runtime.spawn(async move { *lock.read() })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(50));
        // Timed on this thread, not the runtime's: with its workers taken, the
        // runtime's own timers would not fire either.
        let (ran, did_run) = std::sync::mpsc::channel();
        runtime.spawn(async move {
            let _ = ran.send(());
        });
        let third_ran = did_run.recv_timeout(Duration::from_secs(10)).is_ok();
        release.send(()).unwrap();
        holder.join().unwrap();
        for waiter in waiters {
            assert_eq!(runtime.block_on(waiter).unwrap(), 7);
        }
        assert!(third_ran, "a task could not run while two waited");
        assert_eq!(lock.write_held_for(), None);
    }
}
