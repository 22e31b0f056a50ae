//! The lock over the applied state. Beyond a plain `RwLock` it does two things, both for
//! a holder that waits on a stalled disk (a heads, operator or import entry commits
//! under the write lock, and a checkpoint flushes under it):
//! - a wait for it on one of tokio's worker threads is moved off that worker
//!   (`block_in_place`), so requests stuck behind such a holder cannot take every worker,
//!   and the node's health, readiness and metrics still answer;
//! - it says how long the current write hold has lasted, so the HTTP layer can refuse
//!   at once past a limit (`api::forward`), instead of piling up waiting requests.
//!
//! The uncontended path is one `try_read`/`try_write`, as before.

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard, TryLockError};
use std::time::{Duration, Instant};

pub struct DataLock<T> {
    lock: RwLock<T>,
    /// When the current write hold began: µs since `epoch`, plus one; 0 while none.
    write_held_since: AtomicU64,
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
            epoch: Instant::now(),
        }
    }

    // A panic while holding the lock is a bug we cannot recover from consistently; the
    // data itself is rebuilt from disk on restart. So a poisoned lock is used as it is.

    pub fn read(&self) -> RwLockReadGuard<'_, T> {
        match self.lock.try_read() {
            Ok(guard) => guard,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => {
                off_the_worker(|| self.lock.read().unwrap_or_else(|p| p.into_inner()))
            }
        }
    }

    /// The read guard if nobody writes or waits to write now (metrics skip a pass rather
    /// than wait).
    pub fn try_read(&self) -> Option<RwLockReadGuard<'_, T>> {
        match self.lock.try_read() {
            Ok(guard) => Some(guard),
            Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        }
    }

    pub fn write(&self) -> WriteHold<'_, T> {
        let guard = match self.lock.try_write() {
            Ok(guard) => guard,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => {
                off_the_worker(|| self.lock.write().unwrap_or_else(|p| p.into_inner()))
            }
        };
        let now = self.epoch.elapsed().as_micros() as u64;
        self.write_held_since.store(now + 1, Ordering::Release);
        WriteHold {
            guard,
            since: &self.write_held_since,
        }
    }

    /// How long the current write hold has lasted (`None`: no write holds it).
    pub fn write_held_for(&self) -> Option<Duration> {
        let since = self
            .write_held_since
            .load(Ordering::Acquire)
            .checked_sub(1)?;
        let now = self.epoch.elapsed().as_micros() as u64;
        Some(Duration::from_micros(now.saturating_sub(since)))
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
