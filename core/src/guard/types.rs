//! The guard's vocabulary: decisions, deny reasons, severities, outcomes, statuses.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::record::Head;

/// Scar severities and their weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Minor,
    Moderate,
    Severe,
    Fatal,
}

impl Severity {
    pub fn weight(self) -> u32 {
        match self {
            Severity::Minor => 1,
            Severity::Moderate => 3,
            Severity::Severe => 10,
            Severity::Fatal => u32::MAX,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Severity::Minor => "minor",
            Severity::Moderate => "moderate",
            Severity::Severe => "severe",
            Severity::Fatal => "fatal",
        }
    }
}

/// How an allowed action went.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OutcomeStatus {
    Success,
    Failure,
    Harmful,
}

impl OutcomeStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            OutcomeStatus::Success => "success",
            OutcomeStatus::Failure => "failure",
            OutcomeStatus::Harmful => "harmful",
        }
    }
}

/// A reported outcome with its free-text detail.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    pub status: OutcomeStatus,
    pub detail: String,
}

impl Outcome {
    pub fn success(detail: impl Into<String>) -> Self {
        Outcome {
            status: OutcomeStatus::Success,
            detail: detail.into(),
        }
    }
    pub fn failure(detail: impl Into<String>) -> Self {
        Outcome {
            status: OutcomeStatus::Failure,
            detail: detail.into(),
        }
    }
    pub fn harmful(detail: impl Into<String>) -> Self {
        Outcome {
            status: OutcomeStatus::Harmful,
            detail: detail.into(),
        }
    }
}

/// The life of an action. `Debug` names appear in `invalid_state` messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ActionStatus {
    Requested,
    PendingApproval,
    Allowed,
    Denied,
    Completed,
}

/// Why a request was denied. Serialised tagged by `code`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "code", rename_all = "snake_case")]
pub enum DenyReason {
    Terminated { reason: String },
    ToolNotAllowed { tool: String },
    InsufficientBudget { cost: u64, remaining: u64 },
    ToolCallLimit { tool: String, max_calls: u64 },
    RateLimited { max_actions: u32, window_secs: u64 },
    Rejected { by: String, reason: String },
}

impl DenyReason {
    /// Every `code` a denial can carry: the one list (metrics label by it).
    pub const CODES: [&'static str; 6] = [
        "terminated",
        "tool_not_allowed",
        "insufficient_budget",
        "tool_call_limit",
        "rate_limited",
        "rejected",
    ];

    /// The scar this denial leaves, if any (rejections carry theirs separately).
    pub fn scar(&self) -> Option<Severity> {
        match self {
            DenyReason::ToolNotAllowed { .. } => Some(Severity::Moderate),
            DenyReason::ToolCallLimit { .. } | DenyReason::RateLimited { .. } => {
                Some(Severity::Minor)
            }
            _ => None,
        }
    }

    /// The `code` tag.
    pub fn code(&self) -> &'static str {
        match self {
            DenyReason::Terminated { .. } => "terminated",
            DenyReason::ToolNotAllowed { .. } => "tool_not_allowed",
            DenyReason::InsufficientBudget { .. } => "insufficient_budget",
            DenyReason::ToolCallLimit { .. } => "tool_call_limit",
            DenyReason::RateLimited { .. } => "rate_limited",
            DenyReason::Rejected { .. } => "rejected",
        }
    }

    pub fn to_value(&self) -> Value {
        serde_json::to_value(self).unwrap_or(Value::Null)
    }
}

impl std::fmt::Display for DenyReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DenyReason::Terminated { reason } => write!(f, "agent is terminated: {reason}"),
            DenyReason::ToolNotAllowed { tool } => write!(f, "tool '{tool}' is not allowed"),
            DenyReason::InsufficientBudget { cost, remaining } => {
                write!(f, "cost {cost} exceeds remaining budget {remaining}")
            }
            DenyReason::ToolCallLimit { tool, max_calls } => {
                write!(f, "tool '{tool}' reached its limit of {max_calls} calls")
            }
            DenyReason::RateLimited {
                max_actions,
                window_secs,
            } => write!(
                f,
                "rate limit of {max_actions} actions per {window_secs}s exceeded"
            ),
            DenyReason::Rejected { by, reason } => write!(f, "rejected by {by}: {reason}"),
        }
    }
}

/// The guard's answer to a request or an approval.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "decision", rename_all = "snake_case")]
pub enum Decision {
    Allowed {
        action_id: String,
        cost: u64,
        remaining: u64,
    },
    Denied {
        action_id: String,
        reason: DenyReason,
    },
    PendingApproval {
        action_id: String,
    },
}

impl Decision {
    pub fn action_id(&self) -> &str {
        match self {
            Decision::Allowed { action_id, .. }
            | Decision::Denied { action_id, .. }
            | Decision::PendingApproval { action_id } => action_id,
        }
    }

    pub fn is_allowed(&self) -> bool {
        matches!(self, Decision::Allowed { .. })
    }
}

/// One action as the API shows it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Action {
    pub action_id: String,
    pub tool: String,
    pub input: Value,
    pub cost: u64,
    pub status: ActionStatus,
    pub outcome: Option<OutcomeStatus>,
}

/// A scar on the record.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Scar {
    pub seq: u64,
    pub severity: Severity,
    pub reason: String,
    pub action_id: Option<String>,
}

/// An agent's status, as `GET /v1/agents/:id` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    pub agent_id: String,
    pub alive: bool,
    pub termination_reason: Option<String>,
    pub budget: u64,
    pub spent: u64,
    pub remaining: u64,
    pub scar_score: u32,
    pub scar_limit: u32,
    pub scars: Vec<Scar>,
    pub actions_allowed: u64,
    pub actions_denied: u64,
    pub actions_pending: u64,
    pub head: Head,
    pub public_key: String,
}

/// An entry of the approval queue.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PendingAction {
    pub seq: u64,
    pub requested_at: String,
    pub action: Value,
}

/// The kinds of record a guard writes, and reads back at replay. On the hash and wire path
/// a record's `kind` stays the string it was signed with; it is parsed where a guard
/// acts on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordKind {
    Genesis,
    Policy,
    ActionRequested,
    ApprovalRequired,
    ActionAllowed,
    ActionDenied,
    ActionRejected,
    Outcome,
    Scar,
    Terminated,
}

impl RecordKind {
    pub const ALL: [RecordKind; 10] = [
        RecordKind::Genesis,
        RecordKind::Policy,
        RecordKind::ActionRequested,
        RecordKind::ApprovalRequired,
        RecordKind::ActionAllowed,
        RecordKind::ActionDenied,
        RecordKind::ActionRejected,
        RecordKind::Outcome,
        RecordKind::Scar,
        RecordKind::Terminated,
    ];

    /// The name in the log (`lineage-audit-v1`).
    pub fn as_str(self) -> &'static str {
        match self {
            RecordKind::Genesis => "genesis",
            RecordKind::Policy => "policy",
            RecordKind::ActionRequested => "action_requested",
            RecordKind::ApprovalRequired => "approval_required",
            RecordKind::ActionAllowed => "action_allowed",
            RecordKind::ActionDenied => "action_denied",
            RecordKind::ActionRejected => "action_rejected",
            RecordKind::Outcome => "outcome",
            RecordKind::Scar => "scar",
            RecordKind::Terminated => "terminated",
        }
    }

    /// The kind a log's name stands for, if a guard writes it.
    pub fn parse(name: &str) -> Option<RecordKind> {
        RecordKind::ALL
            .into_iter()
            .find(|kind| kind.as_str() == name)
    }
}
