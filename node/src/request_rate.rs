//! Each agent's action requests per minute, on the leader (its policy's
//! `max_requests_per_minute`): the bound on how fast one token can grow every replica's
//! log, since a denied request costs no budget and is still recorded.
//!
//! A bucket per agent holds up to a minute's worth of requests and refills evenly. A
//! request finding it empty is refused with 429 before anything is decided, so it leaves
//! no record. A request decided twice (refused ahead of writes in flight, or decided on a
//! stale state, then decided again) takes one token (`App::execute`). Buckets are memory
//! only: a new leader starts them full, which lets at most one more minute's worth through
//! per election. Full buckets (agents quiet for a minute) are dropped whenever the map
//! doubles, so it holds about the agents active in the last minute.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

/// The map is never swept below this size.
const SWEEP_MIN: usize = 1024;

#[derive(Debug)]
struct Bucket {
    tokens: f64,
    refilled: Instant,
    /// The agent's requests per minute (its policy's, fixed at creation).
    capacity: f64,
}

impl Bucket {
    fn tokens_at(&self, now: Instant) -> f64 {
        let elapsed = now.saturating_duration_since(self.refilled).as_secs_f64();
        (self.tokens + elapsed * self.capacity / 60.0).min(self.capacity)
    }
}

#[derive(Debug)]
pub struct RequestRate {
    buckets: Mutex<(HashMap<String, Bucket>, usize)>,
}

impl Default for RequestRate {
    fn default() -> Self {
        RequestRate {
            buckets: Mutex::new((HashMap::new(), SWEEP_MIN)),
        }
    }
}

impl RequestRate {
    /// Takes one request from the agent's bucket, or says how many seconds until one is
    /// there.
    pub fn admit(&self, agent_id: &str, per_minute: u32, now: Instant) -> Result<(), u64> {
        let capacity = f64::from(per_minute.max(1));
        let per_second = capacity / 60.0;
        let mut guard = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        let (buckets, sweep_at) = &mut *guard;
        if buckets.len() >= *sweep_at {
            buckets.retain(|_, b| b.tokens_at(now) < b.capacity);
            *sweep_at = (buckets.len() * 2).max(SWEEP_MIN);
        }
        let bucket = buckets.entry(agent_id.to_string()).or_insert(Bucket {
            tokens: capacity,
            refilled: now,
            capacity,
        });
        bucket.capacity = capacity;
        bucket.tokens = bucket.tokens_at(now);
        bucket.refilled = now;
        if bucket.tokens >= 1.0 {
            bucket.tokens -= 1.0;
            Ok(())
        } else {
            let wait = (1.0 - bucket.tokens) / per_second;
            Err(wait.ceil().max(1.0) as u64)
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_minutes_worth_at_once_then_an_even_refill() {
        let rate = RequestRate::default();
        let start = Instant::now();
        for n in 0..60 {
            assert_eq!(rate.admit("a", 60, start), Ok(()), "request {n}");
        }
        assert_eq!(rate.admit("a", 60, start), Err(1));
        // Another agent has its own bucket.
        assert_eq!(rate.admit("b", 60, start), Ok(()));
        // One a second comes back.
        let later = start + Duration::from_millis(1_500);
        assert_eq!(rate.admit("a", 60, later), Ok(()));
        assert!(rate.admit("a", 60, later).is_err());
        // A slow bucket says how long to wait.
        let slow = RequestRate::default();
        assert_eq!(slow.admit("s", 1, start), Ok(()));
        assert_eq!(slow.admit("s", 1, start), Err(60));
    }

    #[test]
    fn quiet_agents_are_swept() {
        let rate = RequestRate::default();
        let start = Instant::now();
        for n in 0..SWEEP_MIN {
            rate.admit(&format!("agent-{n}"), 60, start).unwrap();
        }
        let later = start + Duration::from_secs(61);
        rate.admit("new", 60, later).unwrap();
        let held = rate.buckets.lock().unwrap().0.len();
        assert_eq!(held, 1, "only the agent active in the last minute");
    }
}
