//! A history of what concurrent clients asked and were told, and a checker that holds it
//! against the final logs of every node.
//!
//! The checker fails on: spent budget above the policy's; an acknowledged allowed decision
//! missing from the final log or present twice; two different answers for one
//! idempotency key (every 200 is recorded, retries and calls that share a key on purpose
//! included), or a key whose action is not in the final log exactly once; a 200 whose
//! body is not a decision; replicas whose logs differ or fail verification; a per-agent
//! history that is not linearizable against a sequential model of the guard for this
//! workload (calls that share a key are one operation).
//!
//! The linearizability check needs no search: in this model the N-th request to take
//! effect gets `act-N`, so every acknowledged answer names its own place in the order.
//! (stateright's general search did the same job until a simulation run with many calls
//! never answered made it search for over half an hour: it grows exponentially with
//! calls left in flight.)

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use lineage_core::guard::AgentState;
use lineage_core::record::Record;
use lineage_core::verify::{verify_records, VerifyOptions};
use serde::Serialize;
use serde_json::Value;

/// The workload's only operation: request the one tool (cost 1).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct Request;

/// What a request returned, as far as linearizability is concerned.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum Answer {
    Allowed { action_id: String, remaining: u64 },
    Denied { action_id: String, code: String },
}

impl Answer {
    pub fn from_json(body: &Value) -> Option<Answer> {
        let action_id = body["action_id"].as_str()?.to_string();
        match body["decision"].as_str()? {
            "allowed" => Some(Answer::Allowed {
                action_id,
                remaining: body["remaining"].as_u64()?,
            }),
            "denied" => Some(Answer::Denied {
                action_id,
                code: body["reason"]["code"].as_str()?.to_string(),
            }),
            _ => None,
        }
    }
}

/// The guard as the workload sees it: every request takes the next action id; with
/// budget left it is allowed and costs 1; the request that spends the last credit
/// terminates the agent, and every later one is denied `terminated`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct GuardModel {
    pub requests: u64,
    pub remaining: u64,
}

impl GuardModel {
    /// The model's answer to the next request, which it takes.
    pub fn invoke(&mut self, _op: &Request) -> Answer {
        self.requests += 1;
        let action_id = format!("act-{}", self.requests);
        if self.remaining == 0 {
            return Answer::Denied {
                action_id,
                code: "terminated".into(),
            };
        }
        self.remaining -= 1;
        Answer::Allowed {
            action_id,
            remaining: self.remaining,
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub enum Event {
    Invoke {
        client: usize,
        agent: String,
        key: String,
    },
    /// The first 200 answer a logical call got (it may have been retried).
    Return {
        client: usize,
        agent: String,
        answer: Answer,
    },
    /// Every 200 answer for a key, retries included.
    Reply { key: String, body: Value },
    /// A 200 whose body is not a decision.
    Malformed { key: String, body: Value },
}

#[derive(Default)]
pub struct History {
    events: Mutex<Vec<Event>>,
    /// Answers other than 200 (503 during failover, transport errors), retried or not.
    pub errors: std::sync::atomic::AtomicUsize,
}

impl History {
    pub fn record(&self, event: Event) {
        self.events.lock().unwrap().push(event);
    }

    pub fn events(&self) -> Vec<Event> {
        self.events.lock().unwrap().clone()
    }
}

/// Counts for the report.
#[derive(Debug, Default, Serialize)]
pub struct Summary {
    pub operations: usize,
    pub acknowledged: usize,
    pub acknowledged_allowed: usize,
    pub unanswered: usize,
}

pub fn summarise(events: &[Event]) -> Summary {
    let mut s = Summary::default();
    for e in events {
        match e {
            Event::Invoke { .. } => s.operations += 1,
            Event::Return { answer, .. } => {
                s.acknowledged += 1;
                if matches!(answer, Answer::Allowed { .. }) {
                    s.acknowledged_allowed += 1;
                }
            }
            Event::Reply { .. } | Event::Malformed { .. } => {}
        }
    }
    s.unanswered = s.operations - s.acknowledged;
    s
}

/// One logical call of an agent's history: the index of its invocation among the events,
/// and of its first answer with that answer, if it got one.
struct Call {
    invoked: usize,
    returned: Option<(usize, Answer)>,
}

/// One agent's calls, in the order of the events; a client that starts a call while
/// another of its calls is in flight, or an answer without a call, is a malformed history.
fn calls_of(events: &[Event], agent: &str) -> Result<Vec<Call>, String> {
    let mut calls: Vec<Call> = Vec::new();
    let mut in_flight: BTreeMap<usize, usize> = BTreeMap::new();
    for (at, event) in events.iter().enumerate() {
        match event {
            Event::Invoke {
                client, agent: a, ..
            } if a == agent => {
                if in_flight.insert(*client, calls.len()).is_some() {
                    return Err(format!(
                        "client {client} called again while a call was in flight"
                    ));
                }
                calls.push(Call {
                    invoked: at,
                    returned: None,
                });
            }
            Event::Return {
                client,
                agent: a,
                answer,
            } if a == agent => {
                let call = in_flight
                    .remove(client)
                    .ok_or_else(|| format!("client {client} got an answer without a call"))?;
                calls[call].returned = Some((at, answer.clone()));
            }
            _ => {}
        }
    }
    Ok(calls)
}

/// Whether one agent's calls are linearizable against [`GuardModel`] from `budget`.
///
/// An answer naming `act-N` is the N-th request to take effect, so it must be the model's
/// N-th answer, no two answers may name one place, and a call that began after another
/// was answered must come later. The places no answer names were taken by calls never
/// answered (their answers lost): each such call can take one, above every place
/// answered before it began. A greedy match over the places in order decides that.
fn linearizable(calls: &[Call], budget: u64) -> Result<(), String> {
    // (place, invoked, returned) of each answered call.
    let mut answered: Vec<(u64, usize, usize)> = Vec::new();
    let mut taken = BTreeSet::new();
    for call in calls {
        let Some((returned, answer)) = &call.returned else {
            continue;
        };
        let (Answer::Allowed { action_id, .. } | Answer::Denied { action_id, .. }) = answer;
        let place: u64 = action_id
            .strip_prefix("act-")
            .and_then(|n| n.parse().ok())
            .filter(|n| *n >= 1)
            .ok_or_else(|| format!("{action_id} names no place in the order"))?;
        let expected = GuardModel {
            requests: place - 1,
            remaining: budget.saturating_sub(place - 1),
        }
        .invoke(&Request);
        if &expected != answer {
            return Err(format!(
                "request {place} was answered {answer:?}, where the model answers {expected:?}"
            ));
        }
        if !taken.insert(place) {
            return Err(format!("two calls were answered {action_id}"));
        }
        answered.push((place, call.invoked, *returned));
    }
    for earlier in &answered {
        for later in &answered {
            if earlier.2 < later.1 && earlier.0 > later.0 {
                return Err(format!(
                    "act-{} began after act-{} was answered, yet comes before it",
                    later.0, earlier.0
                ));
            }
        }
    }
    let mut floors: Vec<u64> = calls
        .iter()
        .filter(|call| call.returned.is_none())
        .map(|call| {
            answered
                .iter()
                .filter(|a| a.2 < call.invoked)
                .map(|a| a.0)
                .max()
                .unwrap_or(0)
        })
        .collect();
    floors.sort_unstable();
    let last = taken.last().copied().unwrap_or(0);
    for (filled, place) in (1..=last)
        .filter(|place| !taken.contains(place))
        .enumerate()
    {
        // Calls that could take this place; the places before it used `filled` of them,
        // and every call that could take an earlier place can take this one too.
        let able = floors.partition_point(|floor| *floor < place);
        if able <= filled {
            return Err(format!(
                "place {place} was taken by no call that could have taken it"
            ));
        }
    }
    Ok(())
}

/// Checks a history against the final logs (`logs[node][agent]` = records as JSON).
/// Returns every violation found; empty means the run kept every promise.
#[expect(
    clippy::too_many_lines,
    reason = "the history checker: one pass over the history, each invariant checked where its data is"
)]
pub fn check(
    events: &[Event],
    logs: &[BTreeMap<String, Vec<Value>>],
    public_key: &str,
    budget: u64,
) -> Vec<String> {
    let mut violations = Vec::new();

    // One answer per idempotency key.
    let mut by_key: BTreeMap<&str, &Value> = BTreeMap::new();
    for e in events {
        if let Event::Reply { key, body } = e {
            match by_key.get(key.as_str()) {
                Some(first) if *first != body => violations.push(format!(
                    "idempotency key {key} got two different answers: {first} and {body}"
                )),
                Some(_) => {}
                None => {
                    by_key.insert(key, body);
                }
            }
        }
    }

    for e in events {
        if let Event::Malformed { key, body } = e {
            violations.push(format!(
                "idempotency key {key}: a 200 that is not a decision: {body}"
            ));
        }
    }

    // Replicas agree and verify.
    let Some(reference) = logs.first() else {
        return vec!["no final logs".into()];
    };

    // Each answered key's action was requested exactly once, however often it was sent.
    let agent_of: BTreeMap<&str, &str> = events
        .iter()
        .filter_map(|e| match e {
            Event::Invoke { agent, key, .. } => Some((key.as_str(), agent.as_str())),
            _ => None,
        })
        .collect();
    for (key, body) in &by_key {
        let (Some(agent), Some(action_id)) = (agent_of.get(key), body["action_id"].as_str()) else {
            continue;
        };
        let count = reference.get(*agent).map_or(0, |log| {
            log.iter()
                .filter(|r| {
                    r["kind"] == "action_requested" && r["payload"]["action_id"] == action_id
                })
                .count()
        });
        if count != 1 {
            violations.push(format!(
                "idempotency key {key}: its action {action_id} was requested {count} times in the final log"
            ));
        }
    }
    for (n, node_logs) in logs.iter().enumerate() {
        if node_logs != reference {
            violations.push(format!("node {} holds different logs than node 1", n + 1));
        }
    }
    for (agent, log) in reference {
        let records: Vec<Record> = match log
            .iter()
            .map(|r| serde_json::from_value(r.clone()))
            .collect()
        {
            Ok(r) => r,
            Err(e) => {
                violations.push(format!("{agent}: unreadable record: {e}"));
                continue;
            }
        };
        let report = verify_records(
            &records,
            &VerifyOptions {
                public_key: Some(public_key.to_string()),
                checkpoint: None,
            },
        );
        if let Some(f) = report.failure {
            violations.push(format!("{agent}: final log fails verification: {f}"));
        }
        match AgentState::replay(&records) {
            Ok(state) if state.spent > budget => violations.push(format!(
                "{agent}: spent {} of a budget of {budget}",
                state.spent
            )),
            Ok(_) => {}
            Err(e) => violations.push(format!("{agent}: final log does not replay: {e}")),
        }
    }

    // Every acknowledged allowed decision is in the final log exactly once.
    for e in events {
        if let Event::Return {
            agent,
            answer: Answer::Allowed { action_id, .. },
            ..
        } = e
        {
            let count = reference.get(agent).map_or(0, |log| {
                log.iter()
                    .filter(|r| {
                        r["kind"] == "action_allowed"
                            && r["payload"]["action_id"] == action_id.as_str()
                    })
                    .count()
            });
            if count != 1 {
                violations.push(format!(
                    "{agent}: acknowledged allowed {action_id} appears {count} times in the final log"
                ));
            }
        }
    }

    // Linearizable per agent.
    let agents: std::collections::BTreeSet<&str> = events
        .iter()
        .filter_map(|e| match e {
            Event::Invoke { agent, .. } => Some(agent.as_str()),
            _ => None,
        })
        .collect();
    for agent in agents {
        let verdict = calls_of(events, agent)
            .map_err(|e| format!("malformed history: {e}"))
            .and_then(|calls| linearizable(&calls, budget));
        if let Err(reason) = verdict {
            violations.push(format!("{agent}: history is not linearizable: {reason}"));
        }
    }
    violations
}
