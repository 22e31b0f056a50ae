//! Paces a log line that can repeat many times a second: a Raft request refused at every
//! heartbeat, from a link that changes the same bytes each time or a peer without a
//! member's certificate. The first is written, then at most one per interval, saying how
//! many were left out since the last; the metric beside the line counts every one.

use std::sync::Mutex;
use std::time::{Duration, Instant};

pub struct Pace {
    interval: Duration,
    state: Mutex<State>,
}

struct State {
    last_written: Option<Instant>,
    left_out: u64,
}

impl Pace {
    pub const fn new(interval: Duration) -> Self {
        Pace {
            interval,
            state: Mutex::new(State {
                last_written: None,
                left_out: 0,
            }),
        }
    }

    /// Whether to write the line now: `Some(how many were left out since the last one)`.
    pub fn admit(&self) -> Option<u64> {
        self.admit_at(Instant::now())
    }

    fn admit_at(&self, now: Instant) -> Option<u64> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let due = state
            .last_written
            .is_none_or(|last| now.saturating_duration_since(last) >= self.interval);
        if due {
            state.last_written = Some(now);
            Some(std::mem::take(&mut state.left_out))
        } else {
            state.left_out += 1;
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_line_is_written_then_one_per_interval_with_the_count_left_out() {
        let pace = Pace::new(Duration::from_secs(10));
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        assert_eq!(pace.admit_at(at(0)), Some(0));
        // Heartbeats every 50 ms for the rest of the interval: left out, counted.
        for i in 1..200 {
            assert_eq!(pace.admit_at(at(i * 50)), None, "at {} ms", i * 50);
        }
        assert_eq!(pace.admit_at(at(10_000)), Some(199));
        assert_eq!(pace.admit_at(at(10_001)), None);
        // A quiet spell: the next one is written at once, saying what was left out.
        assert_eq!(pace.admit_at(at(60_000)), Some(1));
        assert_eq!(pace.admit_at(at(60_000)), None);
    }
}
