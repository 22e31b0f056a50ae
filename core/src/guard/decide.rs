//! `decide(state, command, now)`: the records a command appends, and its answer.
//!
//! Pure: no I/O, no clock, no randomness. The caller seals the drafts (seq, timestamp,
//! hash, signature), makes them durable, and then applies them; because every effect
//! goes through [`AgentState::apply`], the state after deciding equals the state after
//! replaying the log.

use serde_json::{json, Value};

use super::state::AgentState;
use super::types::{
    ActionStatus, Decision, DenyReason, Outcome, OutcomeStatus, RecordKind, Severity,
};
use crate::canonical::MAX_VALUE_DEPTH;
use crate::keys::AuditKey;
use crate::policy::Policy;
use crate::record::{timestamp, Record, ZERO_HASH};

/// Something an agent or an operator asks of the guard.
#[derive(Clone, Debug, PartialEq)]
pub enum Command {
    Create {
        agent_id: String,
        policy: Policy,
    },
    Request {
        tool: String,
        input: Value,
        cost: Option<u64>,
    },
    /// `approver` is who the log names (`approved_by`); `claimed_by`, a name the caller
    /// gave that is not its own, is kept beside it, never instead of it.
    Approve {
        action_id: String,
        approver: String,
        claimed_by: Option<String>,
        note: Option<String>,
    },
    Reject {
        action_id: String,
        approver: String,
        claimed_by: Option<String>,
        reason: String,
        scar: Option<Severity>,
    },
    Report {
        action_id: String,
        outcome: Outcome,
    },
    /// `by`: the named operator who scars (the shared admin token names nobody).
    Scar {
        severity: Severity,
        reason: String,
        action_id: Option<String>,
        by: Option<String>,
    },
    Terminate {
        reason: String,
        by: String,
        claimed_by: Option<String>,
    },
}

/// Why a command was refused without appending anything.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GuardError {
    /// An approve, reject or report named an action that does not exist.
    #[error("unknown action: {0}")]
    UnknownAction(String),
    /// A scar named an action that does not exist.
    #[error("action not found")]
    ActionNotFound(String),
    #[error("action {action_id} is {status:?}; operation not permitted")]
    InvalidState {
        action_id: String,
        status: ActionStatus,
    },
    #[error("agent is already terminated: {0}")]
    AlreadyTerminated(String),
    #[error("agent already exists")]
    AgentExists,
    #[error("agent has no policy")]
    NoPolicy,
    #[error("input is nested deeper than {max} levels")]
    InputTooDeep { max: usize },
    /// Past the policy's `max_input_bytes`: refused, nothing recorded.
    #[error("input is {size} bytes; this agent's policy allows at most {max}")]
    InputTooLarge { size: u64, max: u64 },
    /// A tool that needs an approval while the policy's `max_pending_approvals` wait:
    /// refused, nothing recorded.
    #[error(
        "{pending} actions are waiting for an approval; this agent's policy allows at most \
         {max} at once (approve or reject some first)"
    )]
    TooManyPendingApprovals { pending: usize, max: u32 },
}

/// An outcome's detail as it is logged: whole when its JSON string (quotes aside, as
/// canonical JSON escapes it) fits in `max` bytes, the policy's input limit; else cut
/// at a character boundary and marked with how many bytes of the detail were cut. It is
/// logged twice when it scars (the outcome and the scar's reason), so without a bound
/// one allowed action could add megabytes to every replica's log. Cut rather than
/// refused: a client that reports an exception's text (as the reference's clients do)
/// must not lose the outcome, and its scar, to a long message.
fn bounded_detail(detail: &str, max: u64) -> std::borrow::Cow<'_, str> {
    let escaped_len = |c: char| match c {
        '"' | '\\' | '\u{8}' | '\t' | '\n' | '\u{c}' | '\r' => 2,
        '\0'..='\u{1f}' => 6,
        _ => c.len_utf8(),
    };
    let total: usize = detail.chars().map(escaped_len).sum();
    let max = usize::try_from(max).unwrap_or(usize::MAX);
    if total <= max {
        return std::borrow::Cow::Borrowed(detail);
    }
    // Room for the marker, whose own length depends on the count it carries.
    let marker_room = 40;
    let budget = max.saturating_sub(marker_room);
    let (mut used, mut end) = (0, 0);
    for (at, c) in detail.char_indices() {
        if used + escaped_len(c) > budget {
            break;
        }
        used += escaped_len(c);
        end = at + c.len_utf8();
    }
    std::borrow::Cow::Owned(format!(
        "{}… [{} bytes cut]",
        &detail[..end],
        detail.len() - end
    ))
}

/// A record before sealing: its kind and payload (and, for a scar, its severity as the
/// guard decided it, so later drafts of the same command need not read it back from JSON).
#[derive(Clone, Debug, PartialEq)]
pub struct Draft {
    pub kind: RecordKind,
    pub payload: Value,
    pub scar: Option<Severity>,
}

/// What a command produced: the records to append and, for requests, approvals and
/// rejections, the decision to answer with.
#[derive(Clone, Debug, PartialEq)]
pub struct Decided {
    pub drafts: Vec<Draft>,
    pub decision: Option<Decision>,
}

fn draft(kind: RecordKind, payload: Value) -> Draft {
    Draft {
        kind,
        payload,
        scar: None,
    }
}

/// The records and answer for `command` on `state` at time `now_micros`.
/// `public_key` is only used by `Create`, for the genesis record.
#[expect(
    clippy::too_many_lines,
    reason = "the guard's whole decision, one arm per command; kept together so the policy reads in one place"
)]
pub fn decide(
    state: &AgentState,
    command: &Command,
    now_micros: i64,
    public_key: &str,
) -> Result<Decided, GuardError> {
    let now = now_micros.max(state.last_timestamp_micros);
    match command {
        Command::Create { agent_id, policy } => {
            if state.head.is_some() {
                return Err(GuardError::AgentExists);
            }
            Ok(Decided {
                drafts: vec![
                    draft(
                        RecordKind::Genesis,
                        json!({"log_id": agent_id, "public_key": public_key}),
                    ),
                    draft(RecordKind::Policy, json!({"policy": policy.to_value()})),
                ],
                decision: None,
            })
        }
        Command::Request { tool, input, cost } => {
            let policy = state.policy.as_ref().ok_or(GuardError::NoPolicy)?;
            if crate::canonical::depth(input) > MAX_VALUE_DEPTH {
                return Err(GuardError::InputTooDeep {
                    max: MAX_VALUE_DEPTH,
                });
            }
            let size = crate::canonical::to_string(input).len() as u64;
            if size > policy.max_input_bytes() {
                return Err(GuardError::InputTooLarge {
                    size,
                    max: policy.max_input_bytes(),
                });
            }
            let rule = policy.rule_for(tool);
            let cost = cost.unwrap_or(0).max(rule.map_or(0, |r| r.cost));
            // `act-N` after the requests so far; a log written elsewhere may have used
            // that id out of order, so take the next one free (every node picks the same).
            let mut n = state.actions_requested + 1;
            while state.action(&format!("act-{n}")).is_some() {
                n += 1;
            }
            let action_id = format!("act-{n}");
            let mut drafts = vec![draft(
                RecordKind::ActionRequested,
                json!({"action_id": action_id, "cost": cost, "input": input, "tool": tool}),
            )];
            let decision = match check(state, policy, tool, cost, now) {
                Err(reason) => deny(state, &action_id, reason, &mut drafts),
                Ok(rule_requires_approval) if rule_requires_approval => {
                    // It would wait, keeping its input in every replica's memory until an
                    // operator decides: refused (nothing recorded) while the cap waits.
                    let max = policy.max_pending_approvals();
                    let pending = state.pending_count();
                    if pending >= max as usize {
                        return Err(GuardError::TooManyPendingApprovals { pending, max });
                    }
                    drafts.push(draft(
                        RecordKind::ApprovalRequired,
                        json!({"action_id": action_id}),
                    ));
                    Decision::PendingApproval { action_id }
                }
                Ok(_) => allow(state, &action_id, cost, None, None, &mut drafts),
            };
            Ok(Decided {
                drafts,
                decision: Some(decision),
            })
        }
        Command::Approve {
            action_id,
            approver,
            claimed_by,
            note,
        } => {
            let policy = state.policy.as_ref().ok_or(GuardError::NoPolicy)?;
            let action = pending_action(state, action_id)?;
            let mut drafts = Vec::new();
            let decision = match check(state, policy, &action.tool, action.cost, now) {
                Err(reason) => deny(state, action_id, reason, &mut drafts),
                Ok(_) => allow(
                    state,
                    action_id,
                    action.cost,
                    Some(approver),
                    note.as_deref(),
                    &mut drafts,
                ),
            };
            // Only an approval carries the approver's names; a denial here is the guard's.
            if let Some(claimed) = claimed_by {
                for allowed in drafts
                    .iter_mut()
                    .filter(|d| d.kind == RecordKind::ActionAllowed)
                {
                    with_claim(&mut allowed.payload, claimed);
                }
            }
            Ok(Decided {
                drafts,
                decision: Some(decision),
            })
        }
        Command::Reject {
            action_id,
            approver,
            claimed_by,
            reason,
            scar,
        } => {
            pending_action(state, action_id)?;
            let mut rejected = json!({"action_id": action_id, "by": approver, "reason": reason});
            if let Some(claimed) = claimed_by {
                with_claim(&mut rejected, claimed);
            }
            let mut drafts = vec![draft(RecordKind::ActionRejected, rejected)];
            if let Some(severity) = scar {
                let text = format!("rejected by {approver}: {reason}");
                scar_drafts(state, *severity, &text, Some(action_id), None, &mut drafts);
            }
            Ok(Decided {
                drafts,
                decision: Some(Decision::Denied {
                    action_id: action_id.clone(),
                    reason: DenyReason::Rejected {
                        by: approver.clone(),
                        reason: reason.clone(),
                    },
                }),
            })
        }
        Command::Report { action_id, outcome } => {
            let status = state
                .action(action_id)
                .ok_or_else(|| GuardError::UnknownAction(action_id.clone()))?
                .status();
            if status != ActionStatus::Allowed {
                return Err(GuardError::InvalidState {
                    action_id: action_id.clone(),
                    status,
                });
            }
            let policy = state.policy.as_ref().ok_or(GuardError::NoPolicy)?;
            let detail = bounded_detail(&outcome.detail, policy.max_input_bytes());
            let mut drafts = vec![draft(
                RecordKind::Outcome,
                json!({"action_id": action_id, "detail": detail, "status": outcome.status.as_str()}),
            )];
            let scar = match outcome.status {
                OutcomeStatus::Success => None,
                OutcomeStatus::Failure => {
                    Some((Severity::Minor, format!("action failed: {detail}")))
                }
                OutcomeStatus::Harmful => {
                    Some((Severity::Severe, format!("action caused harm: {detail}")))
                }
            };
            if let Some((severity, text)) = scar {
                scar_drafts(state, severity, &text, Some(action_id), None, &mut drafts);
            }
            Ok(Decided {
                drafts,
                decision: None,
            })
        }
        Command::Scar {
            severity,
            reason,
            action_id,
            by,
        } => {
            if let Some(id) = action_id {
                if state.action(id).is_none() {
                    return Err(GuardError::ActionNotFound(id.clone()));
                }
            }
            let mut drafts = Vec::new();
            scar_drafts(
                state,
                *severity,
                reason,
                action_id.as_deref(),
                by.as_deref(),
                &mut drafts,
            );
            Ok(Decided {
                drafts,
                decision: None,
            })
        }
        Command::Terminate {
            reason,
            by,
            claimed_by,
        } => {
            if let Some(existing) = &state.termination_reason {
                return Err(GuardError::AlreadyTerminated(existing.clone()));
            }
            let mut payload = json!({"by": by, "reason": reason});
            if let Some(claimed) = claimed_by {
                with_claim(&mut payload, claimed);
            }
            Ok(Decided {
                drafts: vec![draft(RecordKind::Terminated, payload)],
                decision: None,
            })
        }
    }
}

/// The record that repairs a log cut just after the scar or the spend that should have
/// terminated the agent, if one is missing.
pub fn missing_termination(state: &AgentState) -> Option<Draft> {
    if !state.is_alive() || state.policy.is_none() {
        return None;
    }
    let limit = state.policy.as_ref().map_or(0, |p| p.scar_limit);
    let reason = if !state.scars.is_empty() && state.scar_score >= limit {
        format!(
            "scar limit reached ({} >= {limit}); termination record missing from the log",
            state.scar_score
        )
    } else if state.actions_allowed > 0 && state.remaining() == 0 {
        "budget exhausted; termination record missing from the log".to_string()
    } else {
        return None;
    };
    Some(draft(
        RecordKind::Terminated,
        json!({"by": "guard (replay)", "reason": reason}),
    ))
}

/// The checks, in order. `Ok(requires_approval)` when all pass.
fn check(
    state: &AgentState,
    policy: &Policy,
    tool: &str,
    cost: u64,
    now: i64,
) -> Result<bool, DenyReason> {
    if let Some(reason) = &state.termination_reason {
        return Err(DenyReason::Terminated {
            reason: reason.clone(),
        });
    }
    let rule = policy
        .rule_for(tool)
        .ok_or_else(|| DenyReason::ToolNotAllowed {
            tool: tool.to_string(),
        })?;
    if let Some(max_calls) = rule.max_calls {
        if state.tool_calls(tool) >= max_calls {
            return Err(DenyReason::ToolCallLimit {
                tool: tool.to_string(),
                max_calls,
            });
        }
    }
    if let Some(limit) = policy.rate_limit {
        let window = i64::try_from(limit.window_secs.saturating_mul(1_000_000)).unwrap_or(i64::MAX);
        let cutoff = now.saturating_sub(window);
        if state.allowed_after(cutoff) >= limit.max_actions as usize {
            return Err(DenyReason::RateLimited {
                max_actions: limit.max_actions,
                window_secs: limit.window_secs,
            });
        }
    }
    let remaining = state.remaining();
    if cost > remaining {
        return Err(DenyReason::InsufficientBudget { cost, remaining });
    }
    Ok(rule.requires_approval)
}

fn pending_action<'a>(
    state: &'a AgentState,
    action_id: &str,
) -> Result<&'a super::state::ActionState, GuardError> {
    match state.action(action_id) {
        None => Err(GuardError::UnknownAction(action_id.to_string())),
        Some(super::ActionLookup::Open(action))
            if action.status == ActionStatus::PendingApproval =>
        {
            Ok(action)
        }
        Some(found) => Err(GuardError::InvalidState {
            action_id: action_id.to_string(),
            status: found.status(),
        }),
    }
}

fn deny(
    state: &AgentState,
    action_id: &str,
    reason: DenyReason,
    drafts: &mut Vec<Draft>,
) -> Decision {
    drafts.push(draft(
        RecordKind::ActionDenied,
        json!({"action_id": action_id, "reason": reason.to_value()}),
    ));
    if let Some(severity) = reason.scar() {
        scar_drafts(
            state,
            severity,
            &reason.to_string(),
            Some(action_id),
            None,
            drafts,
        );
    }
    Decision::Denied {
        action_id: action_id.to_string(),
        reason,
    }
}

fn allow(
    state: &AgentState,
    action_id: &str,
    cost: u64,
    approver: Option<&String>,
    note: Option<&str>,
    drafts: &mut Vec<Draft>,
) -> Decision {
    let mut payload = json!({"action_id": action_id, "approved_by": approver});
    if let (Some(note), Some(map)) = (note, payload.as_object_mut()) {
        map.insert("note".into(), Value::String(note.to_string()));
    }
    drafts.push(draft(RecordKind::ActionAllowed, payload));
    let remaining = state.remaining().saturating_sub(cost);
    if remaining == 0 {
        drafts.push(draft(
            RecordKind::Terminated,
            json!({"by": "guard", "reason": "budget exhausted"}),
        ));
    }
    Decision::Allowed {
        action_id: action_id.to_string(),
        cost,
        remaining,
    }
}

/// A scar, and the termination it causes if the agent is alive and reaches its limit.
fn scar_drafts(
    state: &AgentState,
    severity: Severity,
    reason: &str,
    action_id: Option<&str>,
    by: Option<&str>,
    drafts: &mut Vec<Draft>,
) {
    let mut payload =
        json!({"action_id": action_id, "reason": reason, "severity": severity.as_str()});
    if let (Some(by), Some(map)) = (by, payload.as_object_mut()) {
        map.insert("by".into(), Value::String(by.to_string()));
    }
    drafts.push(Draft {
        kind: RecordKind::Scar,
        payload,
        scar: Some(severity),
    });
    // Earlier drafts of this same command may already have scarred or terminated.
    let earlier_scars: u32 = drafts
        .iter()
        .filter_map(|d| d.scar)
        .fold(0u32, |acc, s| acc.saturating_add(s.weight()));
    let terminated_now = drafts.iter().any(|d| d.kind == RecordKind::Terminated);
    let score = state.scar_score.saturating_add(earlier_scars);
    let limit = state.policy.as_ref().map_or(0, |p| p.scar_limit);
    if state.is_alive() && !terminated_now && score >= limit {
        drafts.push(draft(
            RecordKind::Terminated,
            json!({"by": "guard", "reason": format!("scar limit reached ({score} >= {limit})")}),
        ));
    }
}

/// Adds `claimed_by` to a record's payload: the name a caller gave beside the one the
/// log attributes the record to.
fn with_claim(payload: &mut Value, claimed: &str) {
    if let Some(map) = payload.as_object_mut() {
        map.insert("claimed_by".into(), Value::String(claimed.to_string()));
    }
}

/// Seals drafts onto the end of `state`'s log: consecutive seqs, chained hashes, one
/// timestamp clamped so that it never goes backwards, signed by `key`.
pub fn seal(
    state: &AgentState,
    drafts: Vec<Draft>,
    key: &AuditKey,
    now_micros: i64,
) -> Vec<Record> {
    let at = timestamp::format(now_micros.max(state.last_timestamp_micros));
    let mut actor = state.agent_id.clone();
    let mut prev = state
        .head
        .as_ref()
        .map_or_else(|| ZERO_HASH.to_string(), |h| h.hash.clone());
    let mut records = Vec::with_capacity(drafts.len());
    for (seq, d) in (state.next_seq()..).zip(drafts) {
        // Genesis names the actor before the state knows it.
        if d.kind == RecordKind::Genesis {
            if let Some(log_id) = d.payload.get("log_id").and_then(Value::as_str) {
                actor = log_id.to_string();
            }
        }
        let record = Record::seal(
            key,
            seq,
            at.clone(),
            &actor,
            d.kind.as_str(),
            d.payload,
            &prev,
        );
        prev.clone_from(&record.hash);
        records.push(record);
    }
    records
}
