//! A history of what concurrent clients asked and were told, and a checker that holds it
//! against the final logs of every node.
//!
//! The checker fails on: spent budget above the policy's; an acknowledged allowed decision
//! missing from the final log or present twice; two different answers for one
//! idempotency key (every 200 is recorded, retries and calls that share a key on purpose
//! included), or a key whose action is not in the final log exactly once; a 200 whose
//! body is not a decision; replicas whose logs differ or fail verification; a per-agent
//! history that is not linearizable (stateright's `LinearizabilityTester` against a
//! sequential model of the guard for this workload; calls that share a key are one
//! operation).

use std::collections::BTreeMap;
use std::sync::Mutex;

use lineage_core::guard::AgentState;
use lineage_core::record::Record;
use lineage_core::verify::{verify_records, VerifyOptions};
use serde::Serialize;
use serde_json::Value;
use stateright::semantics::{ConsistencyTester, LinearizabilityTester, SequentialSpec};

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

impl SequentialSpec for GuardModel {
    type Op = Request;
    type Ret = Answer;

    fn invoke(&mut self, _op: &Request) -> Answer {
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

/// Whether the tester's history is linearizable. stateright's search recurses about once
/// per operation, so a long history (the Docker scenarios run longest) overflowed the
/// test thread's 2 MiB stack in CI once; the search gets a thread with room for it.
fn is_linearizable(tester: LinearizabilityTester<usize, GuardModel>) -> bool {
    std::thread::Builder::new()
        .name("linearizability".into())
        .stack_size(512 * 1024 * 1024)
        .spawn(move || tester.is_consistent())
        .expect("start the linearizability checker")
        .join()
        .expect("the linearizability checker panicked")
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
        let mut tester = LinearizabilityTester::new(GuardModel {
            requests: 0,
            remaining: budget,
        });
        let mut valid = true;
        for e in events {
            let step = match e {
                Event::Invoke {
                    client, agent: a, ..
                } if a == agent => tester.on_invoke(*client, Request).map(drop),
                Event::Return {
                    client,
                    agent: a,
                    answer,
                } if a == agent => tester.on_return(*client, answer.clone()).map(drop),
                _ => Ok(()),
            };
            if let Err(e) = step {
                violations.push(format!("{agent}: malformed history: {e}"));
                valid = false;
                break;
            }
        }
        if valid && !is_linearizable(tester) {
            violations.push(format!("{agent}: history is not linearizable"));
        }
    }
    violations
}
