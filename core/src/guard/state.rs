//! An agent's state is the fold of its records: [`AgentState::apply`] is the only way
//! it changes, at write time and at replay alike.

use std::collections::{BTreeMap, HashMap, VecDeque};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::action_book::{ActionBook, ActionLookup, KeptAction, PendingRequest};
use super::types::{ActionStatus, OutcomeStatus, RecordKind, Scar, Severity, Status};
use crate::policy::Policy;
use crate::record::{timestamp, Head, Record};
use crate::transparency::Frontier;

/// A log that verifies but cannot be a guard log.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ReplayError(pub String);

/// An action waiting for a decision: what deciding it needs (its tool and cost), not its
/// input, which approvers and the API read back from its request record (`KeptAction`,
/// `PendingRequest`), so that actions left waiting hold no input in any replica's memory.
/// Once decided, only its status stays in memory (`action_book`). (Checkpoints from
/// before kept the input here; it is ignored when they are read.)
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ActionState {
    pub tool: String,
    pub cost: u64,
    /// The hash of its request record, which the input read back must have (`None` in a
    /// checkpoint from before it).
    #[serde(default)]
    pub request_hash: Option<[u8; 32]>,
    pub status: ActionStatus,
    pub outcome: Option<OutcomeStatus>,
    pub requested_seq: u64,
    pub requested_at: String,
}

/// A record's hash as bytes (its `hash` field is 64 hex digits once checked).
fn record_hash(record: &Record) -> Option<[u8; 32]> {
    let mut hash = [0; 32];
    hex::decode_to_slice(&record.hash, &mut hash).ok()?;
    Some(hash)
}

/// Everything the guard knows about one agent, derived only from its records.
/// Serialisable so a node can checkpoint it and replay only the records after it.
#[derive(Clone, Debug, PartialEq, Default, Serialize, Deserialize)]
pub struct AgentState {
    pub agent_id: String,
    pub public_key: String,
    pub policy: Option<Policy>,
    /// The last applied record; `None` before genesis.
    pub head: Option<Head>,
    /// The last record's timestamp in microseconds (records never go backwards).
    pub last_timestamp_micros: i64,
    /// Every action: whole while it waits for a decision, about 3 bytes once decided. (Named
    /// apart from the `actions` map that earlier checkpoints held, with every input in
    /// it: those do not parse, and the node replays that agent's records instead.)
    action_book: ActionBook,
    /// Pending approvals by the seq of their request: log order.
    pending: BTreeMap<u64, String>,
    pub actions_requested: u64,
    /// `approval_required` records: decisions that answered `pending_approval`.
    pub approvals_requested: u64,
    pub actions_allowed: u64,
    pub actions_denied: u64,
    pub spent: u64,
    pub scar_score: u32,
    pub scars: Vec<Scar>,
    pub termination_reason: Option<String>,
    /// Who terminated the agent: `guard`, `guard (replay)`, or an operator.
    pub terminated_by: Option<String>,
    /// Denials by reason code (`rejected` for operator rejections).
    pub denied_by_code: BTreeMap<String, u64>,
    tool_calls: HashMap<String, u64>,
    /// Timestamps of the most recent allowed actions, oldest first; at most
    /// `rate_limit.max_actions` are kept, which is all the rate check needs.
    recent_allowed: VecDeque<i64>,
    /// The log as an RFC 6962 tree over its record hashes (size = records applied), so
    /// the agent's Merkle root is known without reading its records.
    #[serde(default)]
    pub tree: Frontier,
}

fn str_field<'a>(payload: &'a Value, field: &str, kind: &str) -> Result<&'a str, ReplayError> {
    payload
        .get(field)
        .and_then(Value::as_str)
        .ok_or_else(|| ReplayError(format!("{kind} record has no string '{field}'")))
}

/// Why an agent was terminated, read from its log. A `terminated` record's `by` is
/// whatever its writer said, and an operator may write `guard`: the guard's own causes
/// count only where the state bears them out (budget gone, scar limit reached).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TerminationCause {
    /// The guard: an allowed action left no budget.
    Budget,
    /// The guard: the scar score reached the limit.
    Scars,
    /// The guard, at replay, wrote a termination the log was missing.
    Replay,
    /// An operator (`POST /terminate`).
    Operator,
    /// A record that says the guard terminated the agent where its state shows no cause.
    GuardClaimed,
}

impl TerminationCause {
    pub const ALL: [TerminationCause; 5] = [
        TerminationCause::Budget,
        TerminationCause::Scars,
        TerminationCause::Replay,
        TerminationCause::Operator,
        TerminationCause::GuardClaimed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            TerminationCause::Budget => "budget",
            TerminationCause::Scars => "scars",
            TerminationCause::Replay => "replay",
            TerminationCause::Operator => "operator",
            TerminationCause::GuardClaimed => "guard_claimed",
        }
    }
}

impl AgentState {
    /// Why the agent was terminated (`None` while it is alive).
    pub fn termination_cause(&self) -> Option<TerminationCause> {
        let reason = self.termination_reason.as_deref()?;
        let limit = self.policy.as_ref().map_or(0, |p| p.scar_limit);
        let budget_gone = reason.starts_with("budget exhausted") && self.remaining() == 0;
        let scars_reached = reason.starts_with("scar limit reached") && self.scar_score >= limit;
        let borne_out = budget_gone || scars_reached;
        Some(match self.terminated_by.as_deref() {
            Some("guard") if budget_gone => TerminationCause::Budget,
            Some("guard") if scars_reached => TerminationCause::Scars,
            Some("guard (replay)") if borne_out => TerminationCause::Replay,
            Some("guard" | "guard (replay)") => TerminationCause::GuardClaimed,
            _ => TerminationCause::Operator,
        })
    }

    pub fn new() -> Self {
        Self::default()
    }

    /// Replays records in order into a fresh state.
    pub fn replay<'a>(records: impl IntoIterator<Item = &'a Record>) -> Result<Self, ReplayError> {
        let mut state = AgentState::new();
        for record in records {
            state.apply(record)?;
        }
        Ok(state)
    }

    pub fn is_alive(&self) -> bool {
        self.termination_reason.is_none()
    }

    pub fn budget(&self) -> u64 {
        self.policy.as_ref().map_or(0, |p| p.budget)
    }

    pub fn remaining(&self) -> u64 {
        self.budget().saturating_sub(self.spent)
    }

    pub fn next_seq(&self) -> u64 {
        self.head.as_ref().map_or(0, |h| h.seq + 1)
    }

    /// What memory holds of an action: the whole request while it waits for a decision,
    /// its status once decided.
    pub fn action(&self, action_id: &str) -> Option<ActionLookup<'_>> {
        self.action_book.lookup(action_id)
    }

    /// Allowed calls of exactly this tool name.
    pub fn tool_calls(&self, tool: &str) -> u64 {
        self.tool_calls.get(tool).copied().unwrap_or(0)
    }

    /// Allowed actions with a timestamp after `cutoff_micros`.
    pub fn allowed_after(&self, cutoff_micros: i64) -> usize {
        self.recent_allowed
            .iter()
            .rev()
            .take_while(|t| **t > cutoff_micros)
            .count()
    }

    /// Folds one record in. The record's chain position is the caller's to check
    /// (see [`crate::verify`]); this checks that it makes sense as a guard record.
    #[expect(
        clippy::too_many_lines,
        reason = "the fold: one arm per record kind, so replay reads in one place"
    )]
    pub fn apply(&mut self, record: &Record) -> Result<(), ReplayError> {
        // The hash is checked before anything changes. A later check can refuse a record
        // after a counter has moved, so a caller that sees an error must drop this
        // state (the node quarantines the agent; replay stops).
        let mut leaf = [0u8; 32];
        hex::decode_to_slice(&record.hash, &mut leaf)
            .map_err(|_| ReplayError(format!("seq {}: hash is not 64 hex digits", record.seq)))?;
        let payload = &record.payload;
        let parsed = RecordKind::parse(&record.kind);
        if self.policy.is_none()
            && !matches!(parsed, Some(RecordKind::Genesis | RecordKind::Policy))
        {
            return Err(ReplayError(format!(
                "seq {}: record before policy",
                record.seq
            )));
        }
        let Some(parsed) = parsed else {
            return Err(ReplayError(format!(
                "unknown record kind '{}'",
                record.kind
            )));
        };
        let kind = record.kind.as_str();
        match parsed {
            RecordKind::Genesis => {
                self.agent_id = str_field(payload, "log_id", kind)?.to_string();
                self.public_key = str_field(payload, "public_key", kind)?.to_string();
            }
            RecordKind::Policy => {
                if self.policy.is_some() {
                    return Err(ReplayError("policy may only be set once".into()));
                }
                let policy = payload
                    .get("policy")
                    .cloned()
                    .ok_or_else(|| ReplayError("policy record has no 'policy'".into()))?;
                let policy: Policy = serde_json::from_value(policy)
                    .map_err(|e| ReplayError(format!("policy record is invalid: {e}")))?;
                if let Some(limit) = &policy.rate_limit {
                    self.recent_allowed
                        .reserve(limit.max_actions.min(1024) as usize);
                }
                self.policy = Some(policy);
            }
            RecordKind::ActionRequested => {
                let action_id = str_field(payload, "action_id", kind)?.to_string();
                let tool = str_field(payload, "tool", kind)?.to_string();
                let cost = payload
                    .get("cost")
                    .and_then(Value::as_u64)
                    .ok_or_else(|| ReplayError("action_requested record has no 'cost'".into()))?;
                self.action_book.request(
                    action_id,
                    ActionState {
                        tool,
                        cost,
                        request_hash: record_hash(record),
                        status: ActionStatus::Requested,
                        outcome: None,
                        requested_seq: record.seq,
                        requested_at: record.timestamp.clone(),
                    },
                )?;
                self.actions_requested += 1;
            }
            RecordKind::ApprovalRequired => {
                let action_id = str_field(payload, "action_id", kind)?;
                let action = self.action_book.open_mut(action_id).ok_or_else(|| {
                    ReplayError(format!(
                        "seq {}: approval_required for {action_id}, which is not waiting for a decision",
                        record.seq
                    ))
                })?;
                action.status = ActionStatus::PendingApproval;
                let seq = action.requested_seq;
                self.approvals_requested += 1;
                self.pending.insert(seq, action_id.to_string());
            }
            RecordKind::ActionAllowed => {
                let action_id = str_field(payload, "action_id", kind)?;
                let at = timestamp::parse(&record.timestamp)
                    .ok_or_else(|| ReplayError(format!("seq {}: invalid timestamp", record.seq)))?;
                let action = self.action_book.settle(action_id, ActionStatus::Allowed)?;
                let (cost, tool, seq) = (action.cost, action.tool, action.requested_seq);
                self.pending.remove(&seq);
                self.spent = self.spent.saturating_add(cost);
                self.actions_allowed += 1;
                *self.tool_calls.entry(tool).or_insert(0) += 1;
                let keep = self
                    .policy
                    .as_ref()
                    .and_then(|p| p.rate_limit)
                    .map_or(0, |r| r.max_actions as usize);
                if keep > 0 {
                    self.recent_allowed.push_back(at);
                    while self.recent_allowed.len() > keep {
                        self.recent_allowed.pop_front();
                    }
                }
            }
            RecordKind::ActionDenied | RecordKind::ActionRejected => {
                let action_id = str_field(payload, "action_id", kind)?;
                let code = if parsed == RecordKind::ActionRejected {
                    "rejected"
                } else {
                    payload
                        .get("reason")
                        .and_then(|r| r.get("code"))
                        .and_then(Value::as_str)
                        .unwrap_or("unknown")
                };
                let action = self.action_book.settle(action_id, ActionStatus::Denied)?;
                *self.denied_by_code.entry(code.to_string()).or_insert(0) += 1;
                self.pending.remove(&action.requested_seq);
                self.actions_denied += 1;
            }
            RecordKind::Outcome => {
                let action_id = str_field(payload, "action_id", kind)?;
                let status: OutcomeStatus = payload
                    .get("status")
                    .cloned()
                    .and_then(|s| serde_json::from_value(s).ok())
                    .ok_or_else(|| ReplayError("outcome record has no valid 'status'".into()))?;
                self.action_book.complete(action_id, status)?;
            }
            RecordKind::Scar => {
                let severity: Severity = payload
                    .get("severity")
                    .cloned()
                    .and_then(|s| serde_json::from_value(s).ok())
                    .ok_or_else(|| ReplayError("scar record has no valid 'severity'".into()))?;
                let reason = str_field(payload, "reason", kind)?.to_string();
                let action_id = payload
                    .get("action_id")
                    .and_then(Value::as_str)
                    .map(str::to_string);
                self.scar_score = self.scar_score.saturating_add(severity.weight());
                self.scars.push(Scar {
                    seq: record.seq,
                    severity,
                    reason,
                    action_id,
                });
            }
            RecordKind::Terminated => {
                let reason = str_field(payload, "reason", kind)?.to_string();
                self.termination_reason = Some(reason);
                self.terminated_by = payload
                    .get("by")
                    .and_then(Value::as_str)
                    .map(str::to_string);
            }
        }
        if let Some(at) = timestamp::parse(&record.timestamp) {
            self.last_timestamp_micros = self.last_timestamp_micros.max(at);
        }
        self.tree.push(&leaf);
        self.head = Some(record.head());
        Ok(())
    }

    /// The status shown by the API.
    pub fn status(&self) -> Status {
        let policy = self.policy.clone().unwrap_or_else(|| Policy::new(0));
        Status {
            agent_id: self.agent_id.clone(),
            alive: self.is_alive(),
            termination_reason: self.termination_reason.clone(),
            budget: policy.budget,
            spent: self.spent,
            remaining: self.remaining(),
            scar_score: self.scar_score,
            scar_limit: policy.scar_limit,
            scars: self.scars.clone(),
            actions_allowed: self.actions_allowed,
            actions_denied: self.actions_denied,
            actions_pending: self.pending.len() as u64,
            head: self.head.clone().unwrap_or(Head {
                seq: 0,
                hash: String::new(),
            }),
            public_key: self.public_key.clone(),
        }
    }

    /// What memory keeps of one action for the API: its status and where its request
    /// is, for the caller to read back ([`KeptAction::view`]).
    pub fn action_view(&self, action_id: &str) -> Option<KeptAction> {
        Some(match self.action_book.lookup(action_id)? {
            ActionLookup::Open(a) => KeptAction {
                status: a.status,
                outcome: a.outcome,
                requested_seq: a.requested_seq,
            },
            ActionLookup::Settled(kept) => kept,
        })
    }

    /// The approval queue in log order, each entry to be completed from its request
    /// record ([`PendingRequest::view`]).
    pub fn pending(&self) -> Vec<PendingRequest> {
        self.pending
            .iter()
            .filter_map(|(seq, id)| {
                let a = self.action_book.open(id)?;
                Some(PendingRequest {
                    seq: *seq,
                    requested_at: a.requested_at.clone(),
                    action_id: id.clone(),
                    request_hash: a.request_hash,
                })
            })
            .collect()
    }

    /// Number of actions waiting for approval.
    pub fn pending_count(&self) -> usize {
        self.pending.len()
    }

    /// Microseconds of the oldest pending request's timestamp, if any.
    pub fn oldest_pending_micros(&self) -> Option<i64> {
        let id = self.pending.values().next()?;
        timestamp::parse(&self.action_book.open(id)?.requested_at)
    }
}
