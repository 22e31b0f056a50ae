//! Known answers for the guard's decisions at their edges, found missing by mutation
//! testing of `guard/decide.rs` (`.ci/mutants`): the input size bound at exactly its
//! limit, the rate limit, the next free action id after a log that used one out of order,
//! an approval used once, the approver's claimed name on the allowed record only, and the
//! termination a log that spent its budget is missing.

mod common;

use common::{allowed_id, Agent};
use lineage_core::guard::{
    decide, missing_termination, ActionStatus, Command, Decision, DenyReason, GuardError,
    RecordKind,
};
use serde_json::{json, Value};

#[test]
fn an_input_of_exactly_the_limit_is_decided_and_one_byte_more_is_refused() {
    let mut agent = Agent::create(json!({
        "budget": 10, "scar_limit": 10, "tools": {"t": {"cost": 0}},
        "limits": {"max_input_bytes": 100}
    }));
    // A JSON string of 98 characters is 100 bytes of canonical JSON, quotes included.
    let at_limit = Value::String("x".repeat(98));
    assert!(matches!(
        agent.request("t", at_limit).unwrap(),
        Some(Decision::Allowed { .. })
    ));
    let over = Value::String("x".repeat(99));
    assert_eq!(
        agent.request("t", over).unwrap_err(),
        GuardError::InputTooLarge {
            size: 101,
            max: 100
        }
    );
}

/// An outcome's detail is bounded by the same limit as a request's input (a failure
/// logs it twice: in the outcome and in its scar), so one token cannot grow the log by
/// megabytes per allowed action. Past the limit it is cut, never refused: the outcome
/// and its scar are still recorded, saying how much was cut. Counted as canonical JSON
/// escapes it, so control characters cannot stretch it sixfold.
#[test]
fn an_outcome_detail_past_the_input_limit_is_cut_not_refused() {
    let mut agent = Agent::create(json!({
        "budget": 10, "scar_limit": 100, "tools": {"t": {"cost": 0}},
        "limits": {"max_input_bytes": 100}
    }));
    let report = |action_id: &str, detail: String| Command::Report {
        action_id: action_id.into(),
        outcome: lineage_core::guard::Outcome {
            status: lineage_core::guard::OutcomeStatus::Failure,
            detail,
        },
    };
    let logged = |agent: &Agent| -> (String, String) {
        let n = agent.records.len();
        let outcome = agent.records[n - 2].payload["detail"]
            .as_str()
            .unwrap()
            .to_string();
        let scar = agent.records[n - 1].payload["reason"]
            .as_str()
            .unwrap()
            .to_string();
        (outcome, scar)
    };
    let escaped = |text: &str| serde_json::to_string(text).unwrap().len() - 2;
    // At the limit: whole, in the outcome and in the scar.
    let whole = allowed_id(agent.request("t", json!(1)).unwrap());
    agent.run(report(&whole, "x".repeat(100))).unwrap();
    assert_eq!(
        logged(&agent),
        (
            "x".repeat(100),
            format!("action failed: {}", "x".repeat(100))
        )
    );
    // Past it, by one byte or by a megabyte: cut, and marked.
    for (n, detail) in [
        "y".repeat(101),
        "z".repeat(1 << 20),
        "€".repeat(40),
        "\u{1}".repeat(30),
    ]
    .into_iter()
    .enumerate()
    {
        let action = allowed_id(agent.request("t", json!(n + 2)).unwrap());
        let records = agent.records.len();
        agent.run(report(&action, detail.clone())).unwrap();
        assert_eq!(agent.records.len(), records + 2, "an outcome and a scar");
        let (outcome, scar) = logged(&agent);
        assert!(
            escaped(&outcome) <= 100,
            "{n}: {} bytes logged",
            escaped(&outcome)
        );
        let cut = detail.len() - outcome.find('…').unwrap();
        assert!(
            outcome.ends_with(&format!("… [{cut} bytes cut]")),
            "{n}: {outcome}"
        );
        assert!(detail.starts_with(&outcome[..outcome.find('…').unwrap()]));
        assert_eq!(scar, format!("action failed: {outcome}"));
    }
}

/// Actions waiting for an approval keep their input in memory: at the policy's cap a
/// request that would wait is refused and leaves no record; others go on, one that is
/// denied anyway is denied (and logged) as before, and an approval makes room again.
#[test]
fn requests_that_need_an_approval_are_refused_at_the_cap_of_those_waiting() {
    let mut agent = Agent::create(json!({
        "budget": 100, "scar_limit": 10,
        "tools": {"refund": {"cost": 1, "requires_approval": true}, "t": {"cost": 1}},
        "limits": {"max_pending_approvals": 2}
    }));
    for n in 1..=2 {
        match agent.request("refund", json!(n)).unwrap() {
            Some(Decision::PendingApproval { .. }) => {}
            other => panic!("expected pending_approval: {other:?}"),
        }
    }
    let records = agent.records.len();
    assert_eq!(
        agent.request("refund", json!(3)).unwrap_err(),
        GuardError::TooManyPendingApprovals { pending: 2, max: 2 }
    );
    assert_eq!(agent.records.len(), records, "a refusal left a record");
    allowed_id(agent.request("t", json!(4)).unwrap());
    // Over budget: denied, as it would be without the cap.
    match agent.run(Command::Request {
        tool: "refund".into(),
        input: json!(0),
        cost: Some(1_000),
    }) {
        Ok(Some(Decision::Denied {
            reason: DenyReason::InsufficientBudget { .. },
            ..
        })) => {}
        other => panic!("expected insufficient_budget: {other:?}"),
    }
    agent.approve("act-1", None).unwrap();
    match agent.request("refund", json!(5)).unwrap() {
        Some(Decision::PendingApproval { .. }) => {}
        other => panic!("expected pending_approval after an approval: {other:?}"),
    }
    // Without `limits`, the default cap.
    let agent = Agent::create(json!({
        "budget": 1, "scar_limit": 1, "tools": {"refund": {"cost": 1, "requires_approval": true}}
    }));
    let policy = agent.state.policy.as_ref().unwrap();
    assert_eq!(
        policy.max_pending_approvals(),
        lineage_core::policy::DEFAULT_MAX_PENDING_APPROVALS
    );
}

#[test]
fn the_rate_limit_allows_its_count_in_a_window_and_then_denies() {
    let mut agent = Agent::create(json!({
        "budget": 10, "scar_limit": 100, "tools": {"t": {"cost": 1}},
        "rate_limit": {"max_actions": 2, "window_secs": 60}
    }));
    allowed_id(agent.request("t", json!(1)).unwrap());
    allowed_id(agent.request("t", json!(2)).unwrap());
    match agent.request("t", json!(3)).unwrap() {
        Some(Decision::Denied {
            reason:
                DenyReason::RateLimited {
                    max_actions: 2,
                    window_secs: 60,
                },
            ..
        }) => {}
        other => panic!("expected rate_limited: {other:?}"),
    }
    // A minute later the window holds none of them.
    agent.now += 61_000_000;
    allowed_id(agent.request("t", json!(4)).unwrap());
}

/// A log written elsewhere whose first request took `act-2`, never decided: the next ids
/// skip it, and it cannot be approved (it is not waiting for an approval).
#[test]
fn the_next_action_id_skips_one_a_log_already_used_out_of_order() {
    let mut agent = Agent::create(json!({
        "budget": 10, "scar_limit": 10, "tools": {"t": {"cost": 0}}
    }));
    // A log written elsewhere whose first request took `act-2`.
    agent.append(vec![lineage_core::guard::Draft {
        kind: RecordKind::ActionRequested,
        payload: json!({"action_id": "act-2", "cost": 0, "input": null, "tool": "t"}),
        scar: None,
    }]);
    assert_eq!(allowed_id(agent.request("t", json!(1)).unwrap()), "act-3");
    assert_eq!(allowed_id(agent.request("t", json!(2)).unwrap()), "act-4");
    // Requested and never decided (the log ends there): not waiting for an approval.
    assert_eq!(
        agent.approve("act-2", None).unwrap_err(),
        GuardError::InvalidState {
            action_id: "act-2".into(),
            status: ActionStatus::Requested,
        }
    );
}

#[test]
fn an_approval_is_used_once_and_only_a_pending_action_can_be_approved() {
    let mut agent = Agent::create(json!({
        "budget": 10, "scar_limit": 10,
        "tools": {"pay": {"cost": 1, "requires_approval": true}, "read": {"cost": 0}}
    }));
    assert!(matches!(
        agent.request("pay", json!("a")).unwrap(),
        Some(Decision::PendingApproval { .. })
    ));
    allowed_id(agent.approve("act-1", None).unwrap());
    assert_eq!(
        agent.approve("act-1", None).unwrap_err(),
        GuardError::InvalidState {
            action_id: "act-1".into(),
            status: ActionStatus::Allowed,
        }
    );
    allowed_id(agent.request("read", json!("b")).unwrap());
    assert_eq!(
        agent.approve("act-2", None).unwrap_err(),
        GuardError::InvalidState {
            action_id: "act-2".into(),
            status: ActionStatus::Allowed,
        }
    );
    assert_eq!(agent.state.spent, 1, "charged once");
}

#[test]
fn a_claimed_name_goes_on_the_allowed_record_only() {
    let mut agent = Agent::create(json!({
        "budget": 1, "scar_limit": 10,
        "tools": {"pay": {"cost": 1, "requires_approval": true}}
    }));
    agent.request("pay", json!("a")).unwrap();
    let before = agent.records.len();
    allowed_id(agent.approve("act-1", Some("mallory")).unwrap());
    // The last credit: the approval also terminates the agent.
    let written: Vec<(&str, &Value)> = agent.records[before..]
        .iter()
        .map(|r| (r.kind.as_str(), &r.payload))
        .collect();
    assert_eq!(
        written.iter().map(|(kind, _)| *kind).collect::<Vec<_>>(),
        ["action_allowed", "terminated"]
    );
    assert_eq!(written[0].1["claimed_by"], "mallory");
    assert_eq!(written[0].1["approved_by"], "alice");
    assert!(written[1].1.get("claimed_by").is_none(), "{}", written[1].1);
}

#[test]
fn a_log_that_spent_its_budget_without_terminating_is_missing_its_termination() {
    // A fresh agent with nothing to spend has not exhausted anything.
    let fresh = Agent::create(json!({"budget": 0, "scar_limit": 10, "tools": {"t": {"cost": 0}}}));
    assert_eq!(missing_termination(&fresh.state), None);

    // The last credit spent, and the log cut before its termination record.
    let mut spent =
        Agent::create(json!({"budget": 1, "scar_limit": 10, "tools": {"t": {"cost": 1}}}));
    let decided = decide(
        &spent.state,
        &Command::Request {
            tool: "t".into(),
            input: json!(1),
            cost: None,
        },
        spent.now,
        spent.key.public_key_hex(),
    )
    .unwrap();
    let kinds: Vec<RecordKind> = decided.drafts.iter().map(|d| d.kind).collect();
    assert_eq!(
        kinds,
        [
            RecordKind::ActionRequested,
            RecordKind::ActionAllowed,
            RecordKind::Terminated
        ]
    );
    spent.append(decided.drafts[..2].to_vec());
    let sealed = missing_termination(&spent.state).expect("a termination is missing");
    assert_eq!(sealed.kind, RecordKind::Terminated);
    assert_eq!(
        sealed.payload["reason"],
        "budget exhausted; termination record missing from the log"
    );
    spent.append(vec![sealed]);
    assert_eq!(missing_termination(&spent.state), None);
}
