//! One lane per agent on the leader: the agent's writes are decided one at a time, and
//! queued for Raft in the order they were decided.
//!
//! With pipelining on, a write is decided on the agent's *pending* state: the applied
//! state plus every write already queued. The next request need not wait for the
//! previous batch to replicate, so one agent's concurrent requests share a batch
//! instead of taking one Raft round each. The state machine's check that every write
//! extends the agent's head (`store::state_machine::check_extends`) stays the safety
//! net: when a write is not applied, every later write of the lane was decided on
//! records the log does not hold, so it no longer extends the head and is rejected at
//! apply too. Its caller gets an error, never a decision made on a history that does not
//! exist. The lane is then *broken*: nobody decides until every write in flight has been
//! answered, and the pending state is dropped.
//!
//! With pipelining off, a turn is held until the write is applied, as the decision path
//! did before lanes: each write is decided on the applied state.
//!
//! A repeated Idempotency-Key waits while a write with that key is in flight, so the
//! repeat finds the stored answer instead of being decided again on a state that
//! already holds the first.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use lineage_core::guard::AgentState;
use tokio::sync::{watch, MutexGuard};

/// The lane map is never swept below this size.
const LANES_SWEEP_MIN: usize = 1024;

/// Every agent's lane. Lanes nobody holds are dropped when the map has doubled since the
/// last sweep, so memory follows the agents being written now, not every agent ever
/// written. A lane drops its pending state when its last write in flight is answered
/// (`InFlight`'s drop; kept if a turn is held just then, until a later write): an idle
/// lane is about 0.5 KB, where one holding a small agent's state was about 2.2 KB
/// (`benches` `lane_bytes`).
pub struct Lanes {
    pipelining: bool,
    map: Mutex<LaneMap>,
}

struct LaneMap {
    lanes: HashMap<String, Arc<Lane>>,
    sweep_at: usize,
}

pub struct Lane {
    /// Held while a write is decided and queued. The pending state lives here: `None`
    /// when there is none (pipelining off, nothing in flight, or dropped after a
    /// failure). Boxed, so that a lane without one does not carry its size.
    turn: tokio::sync::Mutex<Option<Box<AgentState>>>,
    flight: watch::Sender<Flight>,
}

/// The lane's writes that are queued and not yet answered.
#[derive(Default)]
struct Flight {
    writes: usize,
    /// Writes ever queued, and ever answered (`Lane::answered`).
    queued: u64,
    answered: u64,
    /// A write ended without being applied: the pending state may hold records the log
    /// never will.
    broken: bool,
    /// Idempotency keys of the writes in flight.
    keys: HashSet<String>,
}

impl Flight {
    /// Whether a turn for `key` has to wait.
    fn blocks(&self, key: Option<&str>) -> bool {
        (self.broken && self.writes > 0) || key.is_some_and(|key| self.keys.contains(key))
    }
}

impl Lanes {
    pub fn new(pipelining: bool) -> Self {
        Lanes {
            pipelining,
            map: Mutex::new(LaneMap {
                lanes: HashMap::new(),
                sweep_at: LANES_SWEEP_MIN,
            }),
        }
    }

    pub fn pipelining(&self) -> bool {
        self.pipelining
    }

    /// The agent's lane.
    pub fn lane(&self, agent_id: &str) -> Arc<Lane> {
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        if map.lanes.len() >= map.sweep_at {
            // Held by nobody: no turn taken or awaited, no write in flight (each holds
            // its lane until answered).
            map.lanes.retain(|_, lane| Arc::strong_count(lane) > 1);
            map.sweep_at = (map.lanes.len() * 2).max(LANES_SWEEP_MIN);
        }
        map.lanes
            .entry(agent_id.to_string())
            .or_insert_with(|| {
                Arc::new(Lane {
                    turn: tokio::sync::Mutex::new(None),
                    flight: watch::Sender::new(Flight::default()),
                })
            })
            .clone()
    }

    /// Lanes held now (for the bounds table in ARCHITECTURE.md and its test).
    pub fn len(&self) -> usize {
        self.map
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .lanes
            .len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Lane {
    /// Waits until at least `queued` writes of this lane have been answered: the writes
    /// queued before a decision that was refused on the pending state.
    pub async fn answered(&self, queued: u64) {
        let mut changes = self.flight.subscribe();
        let _ = changes.wait_for(|flight| flight.answered >= queued).await;
    }

    /// Waits for the turn to decide this agent's next write: after the writes decided
    /// before (the lock is fair), after a broken lane has drained, and, with `key`, until
    /// no write with that key is in flight.
    pub async fn turn(self: &Arc<Self>, key: Option<&str>) -> Turn<'_> {
        loop {
            let mut pending = self.turn.lock().await;
            if !self.flight.borrow().blocks(key) {
                let mut reset = false;
                self.flight.send_if_modified(|flight| {
                    reset = flight.broken;
                    flight.broken = false;
                    reset
                });
                if reset {
                    *pending = None;
                }
                return Turn {
                    lane: self,
                    pending,
                };
            }
            let mut changes = self.flight.subscribe();
            drop(pending);
            // `wait_for` looks at the current value first, so no change is missed. The
            // sender lives as long as the lane, which `self` holds.
            let _ = changes.wait_for(|flight| !flight.blocks(key)).await;
        }
    }
}

/// One agent's turn to decide and queue a write.
pub struct Turn<'a> {
    lane: &'a Arc<Lane>,
    pending: MutexGuard<'a, Option<Box<AgentState>>>,
}

impl Turn<'_> {
    /// The pending state to decide on, if it is still what the log will hold: with
    /// writes in flight it is ahead of the applied state; with none it must have the
    /// applied head (`applied_head`), or it is dropped (another leader wrote meanwhile,
    /// or a write of a caller that went away was not applied).
    pub fn pending_state(&mut self, applied_head: Option<&str>) -> Option<&AgentState> {
        let in_flight = self.lane.flight.borrow().writes > 0;
        let current = self.pending.as_ref().is_some_and(|state| {
            in_flight || state.head.as_ref().map(|h| h.hash.as_str()) == applied_head
        });
        if !current {
            *self.pending = None;
        }
        self.pending.as_deref()
    }

    /// Writes of this agent queued and not yet answered.
    pub fn writes_in_flight(&self) -> usize {
        self.lane.flight.borrow().writes
    }

    /// Writes of this agent ever queued (for `Lane::answered`).
    pub fn writes_queued(&self) -> u64 {
        self.lane.flight.borrow().queued
    }

    /// Marks the lane broken: the pending state was taken for a write that will not be
    /// queued, so writes in flight are drained before anyone decides again.
    pub fn break_lane(&mut self) {
        *self.pending = None;
        self.lane.flight.send_modify(|flight| flight.broken = true);
    }

    /// Breaks the lane when dropped, unless the write it stands for was queued first
    /// (`Unqueued::queued`). Held across the await that queues a write, so a caller that
    /// goes away while the queue is full leaves no pending state the log will not hold.
    pub fn unqueued(&self) -> Unqueued {
        Unqueued {
            lane: Some(self.lane.clone()),
        }
    }

    /// Takes the pending state out, to extend it with the next write's records.
    pub fn take_pending(&mut self) -> Option<AgentState> {
        self.pending.take().map(|state| *state)
    }

    /// The state after the write about to be queued (pipelining on).
    pub fn set_pending(&mut self, state: AgentState) {
        *self.pending = Some(Box::new(state));
    }

    /// Counts a queued write as in flight until the returned value is finished or
    /// dropped, which marks the lane broken unless the write was applied.
    pub fn in_flight(&self, key: Option<String>) -> InFlight {
        self.lane.flight.send_modify(|flight| {
            flight.writes += 1;
            flight.queued += 1;
            if let Some(key) = &key {
                flight.keys.insert(key.clone());
            }
        });
        InFlight {
            lane: self.lane.clone(),
            key,
            applied: false,
        }
    }
}

/// A write decided on the pending state, until it is queued (`Turn::unqueued`).
pub struct Unqueued {
    lane: Option<Arc<Lane>>,
}

impl Unqueued {
    pub fn queued(mut self) {
        self.lane = None;
    }
}

impl Drop for Unqueued {
    fn drop(&mut self) {
        if let Some(lane) = self.lane.take() {
            lane.flight.send_modify(|flight| flight.broken = true);
        }
    }
}

/// A queued write, until it is answered.
pub struct InFlight {
    lane: Arc<Lane>,
    key: Option<String>,
    applied: bool,
}

impl InFlight {
    /// The write was applied.
    pub fn applied(mut self) {
        self.applied = true;
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let (applied, key) = (self.applied, self.key.take());
        let mut idle = false;
        self.lane.flight.send_modify(|flight| {
            flight.writes = flight.writes.saturating_sub(1);
            flight.answered += 1;
            if let Some(key) = &key {
                flight.keys.remove(key);
            }
            if !applied {
                flight.broken = true;
            }
            idle = flight.writes == 0;
        });
        // With nothing in flight the applied state is the agent's whole state, so the
        // pending copy only saves the next write a clone; it is dropped, so that the
        // lanes of agents no longer written hold no state. A turn held now (the write
        // was answered before its turn let go) keeps it: always safe, as before.
        if idle {
            if let Ok(mut pending) = self.lane.turn.try_lock() {
                *pending = None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Whether `future` is still waiting after the runtime has had a chance to run it.
    async fn still_waiting<F: std::future::Future>(future: F) -> bool {
        tokio::time::timeout(Duration::from_millis(50), future)
            .await
            .is_err()
    }

    #[tokio::test]
    async fn a_write_not_applied_holds_every_turn_until_the_lane_drains() {
        let lanes = Lanes::new(true);
        let lane = lanes.lane("a");
        let (first, second) = {
            let mut turn = lane.turn(None).await;
            turn.set_pending(AgentState::new());
            (turn.in_flight(None), turn.in_flight(None))
        };
        drop(first); // answered without being applied: the lane breaks
        assert!(
            still_waiting(lane.turn(None)).await,
            "a turn on a broken lane"
        );
        second.applied();
        let mut turn = lane.turn(None).await;
        assert!(
            turn.pending_state(None).is_none(),
            "a drained broken lane keeps its pending state"
        );
    }

    #[tokio::test]
    async fn a_key_in_flight_holds_its_repeat_but_not_other_keys() {
        let lanes = Lanes::new(true);
        let lane = lanes.lane("a");
        let write = lane.turn(Some("k")).await.in_flight(Some("k".into()));
        assert!(still_waiting(lane.turn(Some("k"))).await, "the same key");
        drop(lane.turn(Some("other")).await);
        drop(lane.turn(None).await);
        write.applied();
        drop(lane.turn(Some("k")).await);
    }

    #[tokio::test]
    async fn a_pending_state_is_kept_while_ahead_and_dropped_when_the_head_moved() {
        let lanes = Lanes::new(true);
        let lane = lanes.lane("a");
        let mut turn = lane.turn(None).await;
        turn.set_pending(AgentState::new()); // no head
        let write = turn.in_flight(None);
        assert!(
            turn.pending_state(Some("applied-elsewhere")).is_some(),
            "ahead of the applied state while a write is in flight"
        );
        // Answered while the turn is still held: the pending state stays for now.
        write.applied();
        assert!(
            turn.pending_state(None).is_some(),
            "the same head as applied"
        );
        assert!(
            turn.pending_state(Some("another-leader-wrote")).is_none(),
            "nothing in flight and another head: dropped"
        );
    }

    #[tokio::test]
    async fn an_idle_lane_drops_its_pending_state_and_a_busy_one_keeps_it() {
        let lanes = Lanes::new(true);
        let lane = lanes.lane("a");
        let mut turn = lane.turn(None).await;
        let first = turn.in_flight(None);
        turn.set_pending(AgentState::new());
        drop(turn);
        let mut turn = lane.turn(None).await;
        let second = turn.in_flight(None);
        turn.set_pending(AgentState::new());
        drop(turn);
        first.applied();
        assert!(
            lane.turn(None).await.pending_state(None).is_some(),
            "one write still in flight: the next is decided on the pending state"
        );
        second.applied();
        assert!(
            lane.turn(None).await.pending_state(None).is_none(),
            "nothing in flight and nobody deciding: the lane holds no state"
        );
    }

    #[tokio::test]
    async fn a_write_that_never_reached_the_queue_breaks_the_lane() {
        let lanes = Lanes::new(true);
        let lane = lanes.lane("a");
        let earlier = {
            let mut turn = lane.turn(None).await;
            turn.set_pending(AgentState::new());
            turn.in_flight(None)
        };
        {
            let mut turn = lane.turn(None).await;
            assert!(turn.take_pending().is_some());
            let unqueued = turn.unqueued();
            drop(unqueued); // the caller went away before the write was queued
        }
        assert!(
            still_waiting(lane.turn(None)).await,
            "a turn on a broken lane"
        );
        earlier.applied();
        drop(lane.turn(None).await);
    }

    #[tokio::test]
    async fn answered_waits_for_the_writes_queued_before() {
        let lanes = Lanes::new(true);
        let lane = lanes.lane("a");
        let turn = lane.turn(None).await;
        let write = turn.in_flight(None);
        let queued = turn.writes_queued();
        drop(turn);
        assert!(still_waiting(lane.answered(queued)).await);
        write.applied();
        lane.answered(queued).await;
    }

    #[test]
    fn lanes_nobody_holds_are_swept() {
        let lanes = Lanes::new(true);
        let held = lanes.lane("held");
        for i in 0..LANES_SWEEP_MIN {
            drop(lanes.lane(&format!("idle-{i}")));
        }
        drop(lanes.lane("one-more"));
        assert!(lanes.len() < 10, "{} lanes after the sweep", lanes.len());
        assert!(
            Arc::ptr_eq(&held, &lanes.lane("held")),
            "a held lane was swept"
        );
    }
}
