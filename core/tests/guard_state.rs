//! Known answers for the fold of an agent's records (`guard/state.rs`), what it keeps of
//! each action (`guard/action_book.rs`) and the guard's vocabulary (`guard/types.rs`):
//! the counters after a scripted history, the approval queue, the rate window, the
//! actions as the API shows them, and each record a guard log cannot hold, refused with
//! its reason. Written for mutation testing (`.ci/mutants`), so each value is exact.

mod common;

use common::{allowed_id, Agent};
use lineage_core::guard::{
    ActionLookup, ActionStatus, Command, Decision, DenyReason, KeptAction, Outcome, OutcomeStatus,
    RecordKind, Severity, TerminationCause,
};
use lineage_core::record::{timestamp, Record};
use lineage_core::transparency;
use serde_json::{json, Value};

const MINUTE: i64 = 60_000_000;

fn pending_id(decision: Option<Decision>) -> String {
    match decision {
        Some(Decision::PendingApproval { action_id }) => action_id,
        other => panic!("not pending: {other:?}"),
    }
}

fn reject(agent: &mut Agent, action_id: &str, scar: Option<Severity>) -> Option<Decision> {
    agent
        .run(Command::Reject {
            action_id: action_id.into(),
            approver: "alice".into(),
            claimed_by: None,
            reason: "no".into(),
            scar,
        })
        .unwrap()
}

fn report(agent: &mut Agent, action_id: &str, outcome: Outcome) {
    agent
        .run(Command::Report {
            action_id: action_id.into(),
            outcome,
        })
        .unwrap();
}

/// The approval policy the scripted histories share.
fn shop() -> Agent {
    Agent::create(json!({
        "budget": 10, "scar_limit": 20,
        "tools": {"pay": {"cost": 3, "requires_approval": true}, "read": {"cost": 1}}
    }))
}

#[test]
fn the_status_counts_exactly_what_the_log_holds() {
    let mut agent = shop();
    assert_eq!(
        allowed_id(agent.request("read", json!(1)).unwrap()),
        "act-1"
    );
    let paid = pending_id(agent.request("pay", json!({"to": "bob"})).unwrap());
    let refused = pending_id(agent.request("pay", json!({"to": "eve"})).unwrap());
    assert!(matches!(
        agent.request("shell", json!("rm")).unwrap(),
        Some(Decision::Denied {
            reason: DenyReason::ToolNotAllowed { .. },
            ..
        })
    ));
    allowed_id(agent.approve(&paid, None).unwrap());
    reject(&mut agent, &refused, Some(Severity::Minor));
    report(&mut agent, "act-1", Outcome::failure("timed out"));

    let state = &agent.state;
    let status = state.status();
    assert_eq!(
        (status.agent_id.as_str(), status.alive, status.budget),
        ("bot", true, 10)
    );
    assert_eq!((status.spent, status.remaining), (4, 6));
    // Scars: the unlisted tool (3), the rejection (1), the failed outcome (1).
    assert_eq!((status.scar_score, status.scar_limit), (5, 20));
    assert_eq!(
        (
            status.actions_allowed,
            status.actions_denied,
            status.actions_pending
        ),
        (2, 2, 0)
    );
    assert_eq!(status.public_key, agent.key.public_key_hex());
    assert_eq!(state.actions_requested, 4);
    assert_eq!(state.approvals_requested, 2);
    assert_eq!(
        state.denied_by_code.clone().into_iter().collect::<Vec<_>>(),
        [
            ("rejected".to_string(), 1),
            ("tool_not_allowed".to_string(), 1)
        ]
    );
    assert_eq!(
        (
            state.tool_calls("read"),
            state.tool_calls("pay"),
            state.tool_calls("shell")
        ),
        (1, 1, 0)
    );
    let scars: Vec<(Severity, Option<&str>)> = status
        .scars
        .iter()
        .map(|s| (s.severity, s.action_id.as_deref()))
        .collect();
    assert_eq!(
        scars,
        [
            (Severity::Moderate, Some("act-4")),
            (Severity::Minor, Some(refused.as_str())),
            (Severity::Minor, Some("act-1"))
        ]
    );
    assert_log_position(&agent);
}

/// The head, next seq, clock and Merkle tree all stand at the last record.
fn assert_log_position(agent: &Agent) {
    let state = &agent.state;
    let last = agent.records.last().unwrap();
    assert_eq!(state.status().head, last.head());
    assert_eq!(state.next_seq(), agent.records.len() as u64);
    assert_eq!(
        Some(state.last_timestamp_micros),
        timestamp::parse(&last.timestamp)
    );
    let leaves: Vec<Vec<u8>> = agent
        .records
        .iter()
        .map(|r| hex::decode(&r.hash).unwrap())
        .collect();
    assert_eq!(state.tree.size(), agent.records.len() as u64);
    assert_eq!(state.tree.root(), transparency::root(&leaves));
}

#[test]
fn a_fresh_state_has_nothing_and_replay_folds_a_whole_log() {
    let fresh = lineage_core::AgentState::new();
    assert_eq!(
        (fresh.next_seq(), fresh.budget(), fresh.remaining()),
        (0, 0, 0)
    );
    assert!(fresh.is_alive());
    assert_eq!(fresh.status().head.seq, 0);

    let mut agent = shop();
    agent.request("read", json!(1)).unwrap();
    let replayed = lineage_core::AgentState::replay(&agent.records).unwrap();
    assert_eq!(replayed, agent.state);
    assert_eq!((replayed.spent, replayed.remaining()), (1, 9));
}

#[test]
fn the_queue_lists_waiting_actions_in_log_order_with_their_exact_request() {
    let mut agent = shop();
    assert_eq!(agent.state.oldest_pending_micros(), None);
    let first = pending_id(agent.request("pay", json!({"to": "bob"})).unwrap());
    let first_record = agent.records.last().unwrap().clone();
    agent.now += MINUTE;
    let second = pending_id(agent.request("pay", json!({"to": "eve"})).unwrap());
    let second_record = agent.records.last().unwrap().clone();

    let queue = agent.state.pending();
    assert_eq!(agent.state.pending_count(), 2);
    assert_eq!(agent.state.status().actions_pending, 2);
    let expected = |id: &str, to: &str, request: &Record| {
        (
            request.seq - 1,
            request.timestamp.clone(),
            json!({"action_id": id, "cost": 3, "input": {"to": to}, "tool": "pay"}),
        )
    };
    // Memory keeps no input: each entry is completed from its request record.
    let got: Vec<_> = queue
        .iter()
        .map(|p| {
            let request = agent.records.iter().find(|r| r.seq == p.seq).unwrap();
            let entry = p.view(request).unwrap();
            (entry.seq, entry.requested_at, entry.action)
        })
        .collect();
    // The queue names the seq of the request, one before its approval_required record.
    assert_eq!(
        got,
        [
            expected(&first, "bob", &first_record),
            expected(&second, "eve", &second_record)
        ]
    );
    assert_eq!(
        agent.state.oldest_pending_micros(),
        timestamp::parse(&first_record.timestamp)
    );

    allowed_id(agent.approve(&first, None).unwrap());
    assert_eq!(agent.state.pending_count(), 1);
    assert_eq!(
        agent.state.oldest_pending_micros(),
        timestamp::parse(&second_record.timestamp)
    );
    reject(&mut agent, &second, None);
    assert_eq!(agent.state.pending_count(), 0);
    assert!(agent.state.pending().is_empty());
    assert_eq!(agent.state.oldest_pending_micros(), None);
}

/// An action left waiting keeps no input in memory (every replica holds it until an
/// operator decides): the state, as a checkpoint writes it, has none of it; a checkpoint
/// from before, which kept inputs, still reads back, without them.
#[test]
fn a_waiting_action_holds_no_input_and_older_checkpoints_still_read() {
    let mut agent = shop();
    let marker = "q".repeat(40_000);
    let id = pending_id(agent.request("pay", json!({"memo": marker})).unwrap());
    let json = serde_json::to_string(&agent.state).unwrap();
    assert!(
        !json.contains("qqqq"),
        "the input is held: {} bytes",
        json.len()
    );
    assert!(json.len() < 4_000, "{} bytes", json.len());

    // As checkpoints before this kept a waiting action: with its input.
    let mut older: Value = serde_json::from_str(&json).unwrap();
    let open = older["action_book"]["open"][&id]
        .as_object_mut()
        .expect("the waiting action, by id");
    open.insert("input".into(), json!({"memo": marker}));
    let read: lineage_core::guard::AgentState = serde_json::from_value(older).unwrap();
    assert_eq!(read, agent.state);
    assert_eq!(read.pending()[0].action_id, id);
}

/// What an approver is shown is what was logged: a request record read back with its
/// input changed is an error, and so is one whose hash was recomputed to match (it is
/// not the record the action was replayed from).
#[test]
fn a_changed_request_is_never_shown_to_an_approver() {
    let mut agent = shop();
    pending_id(agent.request("pay", json!({"to": "bob"})).unwrap());
    let entry = agent.state.pending().remove(0);
    let request = agent.records.iter().find(|r| r.seq == entry.seq).unwrap();
    assert!(entry.view(request).is_ok(), "control");

    let mut changed = request.clone();
    changed.payload["input"]["to"] = json!("eve");
    let error = entry.view(&changed).unwrap_err();
    assert!(error.contains("does not match its hash"), "{error}");
    let kept = agent.state.action_view(&entry.action_id).unwrap();
    assert!(kept.view(&entry.action_id, &changed).is_err());

    changed.hash = hex::encode(changed.recompute_hash());
    let error = entry.view(&changed).unwrap_err();
    assert!(error.contains("does not match its hash"), "{error}");
}

#[test]
fn the_rate_window_counts_strictly_later_actions_and_keeps_only_max_actions() {
    let mut agent = Agent::create(json!({
        "budget": 100, "scar_limit": 100, "tools": {"t": {"cost": 1}},
        "rate_limit": {"max_actions": 3, "window_secs": 60}
    }));
    let mut times = Vec::new();
    for i in 0..5 {
        times.push(agent.now);
        allowed_id(agent.request("t", json!(i)).unwrap());
        agent.now += MINUTE;
    }
    // Only the last three are kept: all the rate check needs.
    assert_eq!(agent.state.allowed_after(i64::MIN), 3);
    assert_eq!(agent.state.allowed_after(times[2] - 1), 3);
    assert_eq!(agent.state.allowed_after(times[2]), 2, "strictly after");
    assert_eq!(agent.state.allowed_after(times[4]), 0);

    // Without a rate limit nothing is kept.
    let mut unlimited = shop();
    allowed_id(unlimited.request("read", json!(1)).unwrap());
    assert_eq!(unlimited.state.allowed_after(i64::MIN), 0);
}

#[test]
fn an_action_reads_back_from_its_request_whether_open_or_decided() {
    let mut agent = shop();
    let id = pending_id(agent.request("pay", json!({"to": "bob"})).unwrap());
    let request = agent.records[agent.records.len() - 2].clone();
    assert_eq!(request.kind, "action_requested");
    let whole = lineage_core::guard::Action {
        action_id: id.clone(),
        tool: "pay".into(),
        input: json!({"to": "bob"}),
        cost: 3,
        status: ActionStatus::PendingApproval,
        outcome: None,
    };
    let open = KeptAction {
        status: ActionStatus::PendingApproval,
        outcome: None,
        requested_seq: request.seq,
    };
    assert_eq!(agent.state.action_view(&id), Some(open));
    assert_eq!(open.view(&id, &request), Ok(whole.clone()));
    assert!(matches!(
        agent.state.action(&id),
        Some(ActionLookup::Open(open)) if open.status == ActionStatus::PendingApproval
    ));
    assert_eq!(
        agent.state.action(&id).map(|a| a.status()),
        Some(ActionStatus::PendingApproval)
    );

    allowed_id(agent.approve(&id, None).unwrap());
    report(&mut agent, &id, Outcome::harmful("leaked"));
    let settled = KeptAction {
        status: ActionStatus::Completed,
        outcome: Some(OutcomeStatus::Harmful),
        requested_seq: request.seq,
    };
    assert_eq!(agent.state.action_view(&id), Some(settled));
    assert_eq!(
        agent.state.action(&id).map(|a| a.status()),
        Some(ActionStatus::Completed)
    );
    assert_eq!(
        settled.view(&id, &request),
        Ok(lineage_core::guard::Action {
            status: ActionStatus::Completed,
            outcome: Some(OutcomeStatus::Harmful),
            ..whole
        })
    );
    assert_eq!(agent.state.action_view("act-9"), None);
    assert!(agent.state.action("act-9").is_none());
}

#[test]
fn a_settled_action_reads_back_only_its_own_request() {
    let mut agent = shop();
    let id = allowed_id(agent.request("read", json!("x")).unwrap());
    let settled = agent.state.action_view(&id).unwrap();
    let request = agent
        .records
        .iter()
        .find(|r| r.seq == settled.requested_seq)
        .unwrap()
        .clone();
    assert_eq!(settled.view(&id, &request).unwrap().input, json!("x"));
    let mut other_seq = request.clone();
    other_seq.seq += 1;
    let mut other_kind = request.clone();
    other_kind.kind = "action_allowed".into();
    let mut other_id = request.clone();
    other_id.payload["action_id"] = json!("act-2");
    for wrong in [other_seq, other_kind, other_id] {
        assert_eq!(
            settled.view(&id, &wrong),
            Err(format!("record {} is not the request of {id}", wrong.seq))
        );
    }
}

#[test]
fn termination_causes_are_borne_out_at_their_exact_limits() {
    // Scars exactly at the limit, written by the guard at replay: borne out.
    let mut scarred = Agent::create(json!({
        "budget": 10, "scar_limit": 3, "tools": {"t": {"cost": 1}}
    }));
    let terminate = |agent: &mut Agent, reason: &str, by: &str| {
        agent.append(vec![lineage_core::guard::Draft {
            kind: RecordKind::Terminated,
            payload: json!({"reason": reason, "by": by}),
            scar: None,
        }]);
    };
    scarred.append(vec![lineage_core::guard::Draft {
        kind: RecordKind::Scar,
        payload: json!({"severity": "moderate", "reason": "r"}),
        scar: None,
    }]);
    assert_eq!(scarred.state.scar_score, 3);
    terminate(
        &mut scarred,
        "scar limit reached (3 >= 3)",
        "guard (replay)",
    );
    assert_eq!(
        scarred.state.termination_cause(),
        Some(TerminationCause::Replay)
    );
    assert!(!scarred.state.is_alive());
    assert_eq!(
        scarred.state.terminated_by.as_deref(),
        Some("guard (replay)")
    );

    // The budget gone, as the guard said at replay.
    let mut spent =
        Agent::create(json!({"budget": 1, "scar_limit": 3, "tools": {"t": {"cost": 1}}}));
    spent.append(vec![
        lineage_core::guard::Draft {
            kind: RecordKind::ActionRequested,
            payload: json!({"action_id": "act-1", "cost": 1, "input": null, "tool": "t"}),
            scar: None,
        },
        lineage_core::guard::Draft {
            kind: RecordKind::ActionAllowed,
            payload: json!({"action_id": "act-1"}),
            scar: None,
        },
    ]);
    assert_eq!(spent.state.remaining(), 0);
    terminate(&mut spent, "budget exhausted", "guard (replay)");
    assert_eq!(
        spent.state.termination_cause(),
        Some(TerminationCause::Replay)
    );

    // One short of either: claimed, not borne out.
    let mut short =
        Agent::create(json!({"budget": 2, "scar_limit": 4, "tools": {"t": {"cost": 1}}}));
    allowed_id(short.request("t", json!(1)).unwrap());
    short.append(vec![lineage_core::guard::Draft {
        kind: RecordKind::Scar,
        payload: json!({"severity": "moderate", "reason": "r"}),
        scar: None,
    }]);
    terminate(&mut short, "scar limit reached (3 >= 4)", "guard");
    assert_eq!(
        short.state.termination_cause(),
        Some(TerminationCause::GuardClaimed)
    );

    let names: Vec<&str> = TerminationCause::ALL.iter().map(|c| c.as_str()).collect();
    assert_eq!(
        names,
        ["budget", "scars", "replay", "operator", "guard_claimed"]
    );
}

#[test]
fn the_vocabulary_has_its_exact_names_weights_and_messages() {
    let severities = [
        (Severity::Minor, "minor", 1),
        (Severity::Moderate, "moderate", 3),
        (Severity::Severe, "severe", 10),
        (Severity::Fatal, "fatal", u32::MAX),
    ];
    for (severity, name, weight) in severities {
        assert_eq!((severity.as_str(), severity.weight()), (name, weight));
        assert_eq!(serde_json::to_value(severity).unwrap(), json!(name));
    }
    for (outcome, status, name) in [
        (Outcome::success("d"), OutcomeStatus::Success, "success"),
        (Outcome::failure("d"), OutcomeStatus::Failure, "failure"),
        (Outcome::harmful("d"), OutcomeStatus::Harmful, "harmful"),
    ] {
        assert_eq!((outcome.status, outcome.detail.as_str()), (status, "d"));
        assert_eq!(status.as_str(), name);
        assert_eq!(serde_json::to_value(status).unwrap(), json!(name));
    }

    let denials = [
        (
            DenyReason::Terminated { reason: "r".into() },
            None,
            "agent is terminated: r",
        ),
        (
            DenyReason::ToolNotAllowed { tool: "sh".into() },
            Some(Severity::Moderate),
            "tool 'sh' is not allowed",
        ),
        (
            DenyReason::InsufficientBudget {
                cost: 5,
                remaining: 2,
            },
            None,
            "cost 5 exceeds remaining budget 2",
        ),
        (
            DenyReason::ToolCallLimit {
                tool: "t".into(),
                max_calls: 4,
            },
            Some(Severity::Minor),
            "tool 't' reached its limit of 4 calls",
        ),
        (
            DenyReason::RateLimited {
                max_actions: 2,
                window_secs: 60,
            },
            Some(Severity::Minor),
            "rate limit of 2 actions per 60s exceeded",
        ),
        (
            DenyReason::Rejected {
                by: "alice".into(),
                reason: "no".into(),
            },
            None,
            "rejected by alice: no",
        ),
    ];
    for (reason, scar, message) in denials {
        assert_eq!(reason.scar(), scar, "{message}");
        assert_eq!(reason.to_string(), message);
        let value = reason.to_value();
        assert_eq!(value["code"], json!(reason.code()), "{value}");
        assert_eq!(serde_json::from_value::<DenyReason>(value).unwrap(), reason);
    }
}

#[test]
fn a_decision_names_its_action() {
    let decisions = [
        (
            Decision::Allowed {
                action_id: "a".into(),
                cost: 1,
                remaining: 0,
            },
            true,
        ),
        (
            Decision::Denied {
                action_id: "b".into(),
                reason: DenyReason::Terminated { reason: "r".into() },
            },
            false,
        ),
        (
            Decision::PendingApproval {
                action_id: "c".into(),
            },
            false,
        ),
    ];
    let named: Vec<(&str, bool)> = decisions
        .iter()
        .map(|(d, _)| (d.action_id(), d.is_allowed()))
        .collect();
    assert_eq!(named, [("a", true), ("b", false), ("c", false)]);
    for (d, allowed) in &decisions {
        assert_eq!(d.is_allowed(), *allowed);
    }
}

/// A copy of `template` as the record after the log's end, with another kind and payload:
/// the fold checks what a record says, its chain position is the verifier's.
fn next(agent: &Agent, template: &Record, kind: &str, payload: Value) -> Record {
    let mut record = template.clone();
    record.seq = agent.state.next_seq();
    record.kind = kind.into();
    record.payload = payload;
    record
}

#[test]
fn a_record_a_guard_log_cannot_hold_is_refused_with_its_reason() {
    let mut agent = shop();
    let open = pending_id(agent.request("pay", json!(1)).unwrap());
    let template = agent.records[0].clone();
    let seq = agent.state.next_seq();
    let refused = [
        (
            "genesis",
            json!({"public_key": "k"}),
            "genesis record has no string 'log_id'".to_string(),
        ),
        (
            "policy",
            json!({"policy": {"budget": 1}}),
            "policy may only be set once".into(),
        ),
        (
            "nonsense",
            json!({}),
            "unknown record kind 'nonsense'".into(),
        ),
        (
            "action_requested",
            json!({"action_id": "x", "tool": "t"}),
            "action_requested record has no 'cost'".into(),
        ),
        (
            "action_requested",
            json!({"action_id": open, "tool": "t", "cost": 1}),
            format!("seq {seq}: action id {open} requested twice"),
        ),
        (
            "approval_required",
            json!({"action_id": "act-9"}),
            format!("seq {seq}: approval_required for act-9, which is not waiting for a decision"),
        ),
        (
            "action_allowed",
            json!({"action_id": "act-9"}),
            "unknown action: act-9".into(),
        ),
        (
            "outcome",
            json!({"action_id": open, "status": "success"}),
            format!("action {open} is PendingApproval, not waiting for this record"),
        ),
        (
            "outcome",
            json!({"action_id": open, "status": "fine"}),
            "outcome record has no valid 'status'".into(),
        ),
        (
            "scar",
            json!({"severity": "huge", "reason": "r"}),
            "scar record has no valid 'severity'".into(),
        ),
        (
            "terminated",
            json!({"by": "x"}),
            "terminated record has no string 'reason'".into(),
        ),
    ];
    for (kind, payload, reason) in refused {
        let record = next(&agent, &template, kind, payload);
        let mut state = agent.state.clone();
        assert_eq!(state.apply(&record).unwrap_err().0, reason, "{kind}");
    }

    let mut bad_time = next(
        &agent,
        &template,
        "action_allowed",
        json!({"action_id": open}),
    );
    bad_time.timestamp = "yesterday".into();
    assert_eq!(
        agent.state.clone().apply(&bad_time).unwrap_err().0,
        format!("seq {seq}: invalid timestamp")
    );
    let mut bad_hash = next(
        &agent,
        &template,
        "scar",
        json!({"severity": "minor", "reason": "r"}),
    );
    bad_hash.hash.pop();
    let mut state = agent.state.clone();
    assert_eq!(
        state.apply(&bad_hash).unwrap_err().0,
        format!("seq {seq}: hash is not 64 hex digits")
    );
    assert_eq!(state, agent.state, "refused before anything changed");
}

#[test]
fn before_its_policy_a_log_holds_only_genesis_and_a_valid_policy() {
    let agent = shop();
    let template = agent.records[0].clone();
    let seq = agent.state.next_seq();
    let mut unborn = lineage_core::AgentState::new();
    unborn.apply(&agent.records[0]).unwrap();
    let early = next(
        &agent,
        &template,
        "scar",
        json!({"severity": "minor", "reason": "r"}),
    );
    assert_eq!(
        unborn.apply(&early).unwrap_err().0,
        format!("seq {seq}: record before policy")
    );
    let mut no_policy = unborn.clone();
    let empty = next(&agent, &template, "policy", json!({}));
    assert_eq!(
        no_policy.apply(&empty).unwrap_err().0,
        "policy record has no 'policy'"
    );
    let invalid = next(
        &agent,
        &template,
        "policy",
        json!({"policy": {"budget": "all"}}),
    );
    assert!(unborn
        .apply(&invalid)
        .unwrap_err()
        .0
        .starts_with("policy record is invalid: "));
}
