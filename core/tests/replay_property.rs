//! Property: for any sequence of commands, the state built while deciding equals the
//! state replayed from the written log, the log verifies, and the guard's invariants hold.

use lineage_core::guard::{
    decide, seal, AgentState, Command, Decision, GuardError, Outcome, Severity,
};
use lineage_core::record::Record;
use lineage_core::verify::{verify_records, VerifyOptions};
use lineage_core::{AuditKey, Policy, ToolRule};
use proptest::prelude::*;
use serde_json::json;

fn command_strategy() -> impl Strategy<Value = Command> {
    let tool = prop::sample::select(vec!["read", "pay", "capped", "unknown"]);
    let action = (1u64..12).prop_map(|n| format!("act-{n}"));
    let severity = prop::sample::select(vec![
        Severity::Minor,
        Severity::Moderate,
        Severity::Severe,
        Severity::Fatal,
    ]);
    prop_oneof![
        6 => (tool, prop::option::of(0u64..30)).prop_map(|(tool, cost)| Command::Request {
            tool: tool.to_string(),
            input: json!({"n": cost}),
            cost,
        }),
        2 => (action.clone(), prop::option::of("[a-z ]{0,8}")).prop_map(|(action_id, note)| Command::Approve {
            action_id,
            approver: "alice".into(),
            claimed_by: None,
            note,
        }),
        1 => (action.clone(), prop::option::of(severity.clone())).prop_map(|(action_id, scar)| Command::Reject {
            action_id,
            approver: "bob".into(),
            claimed_by: None,
            reason: "no".into(),
            scar,
        }),
        2 => (action.clone(), 0u8..3).prop_map(|(action_id, o)| Command::Report {
            action_id,
            outcome: match o {
                0 => Outcome::success("ok"),
                1 => Outcome::failure("broke"),
                _ => Outcome::harmful("bad"),
            },
        }),
        1 => (severity, prop::option::of(action)).prop_map(|(severity, action_id)| Command::Scar {
            severity,
            reason: "seen".into(),
            action_id,
            by: None,
        }),
        1 => Just(Command::Terminate { reason: "stop".into(), by: "ops".into(), claimed_by: None }),
    ]
}

fn policy_strategy() -> impl Strategy<Value = Policy> {
    (
        0u64..120,
        0u32..25,
        prop::option::of((0u32..4, 1u64..5)),
        any::<bool>(),
    )
        .prop_map(|(budget, scar_limit, rate, default)| {
            let mut policy = Policy::new(budget)
                .allow("read", ToolRule::cost(0))
                .allow("pay", ToolRule::cost(5).with_approval())
                .allow("capped", ToolRule::cost(1).with_max_calls(2))
                .scar_limit(scar_limit);
            if let Some((max, window)) = rate {
                policy = policy.rate_limit(max, window);
            }
            if default {
                policy = policy.default_rule(ToolRule::cost(2));
            }
            policy
        })
}

/// Whether `decide` refusing `command` with `e` is what `state` calls for: the action
/// it names is missing or not waiting for this command, the agent is already
/// terminated, or the pending approvals are at their cap.
fn refusal_is_grounded(state: &AgentState, command: &Command, e: &GuardError) -> bool {
    let named = match command {
        Command::Approve { action_id, .. }
        | Command::Reject { action_id, .. }
        | Command::Report { action_id, .. } => Some(action_id),
        Command::Scar { action_id, .. } => action_id.as_ref(),
        _ => None,
    };
    match e {
        GuardError::UnknownAction(id) | GuardError::ActionNotFound(id) => {
            named == Some(id) && state.action(id).is_none()
        }
        GuardError::InvalidState { action_id, status } => {
            named == Some(action_id) && state.action(action_id).map(|a| a.status()) == Some(*status)
        }
        GuardError::AlreadyTerminated(reason) => {
            matches!(command, Command::Terminate { .. })
                && state.termination_reason.as_ref() == Some(reason)
        }
        GuardError::TooManyPendingApprovals { pending, max } => {
            matches!(command, Command::Request { .. })
                && *pending == state.pending_count()
                && state.policy.as_ref().map(|p| p.max_pending_approvals()) == Some(*max)
        }
        // No other refusal fits these commands (small inputs, a policy from the start).
        _ => false,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn deciding_and_replaying_agree(
        policy in policy_strategy(),
        steps in prop::collection::vec((command_strategy(), -2_000_000i64..3_000_000), 1..40),
    ) {
        let key = AuditKey::from_seed([3; 32]);
        let mut state = AgentState::new();
        let mut log: Vec<Record> = Vec::new();
        let mut now = 1_800_000_000_000_000i64;
        let create = Command::Create { agent_id: "p".into(), policy: policy.clone() };
        let mut commands = vec![(create, 0)];
        commands.extend(steps);
        for (command, step) in commands {
            now += step; // time may step backwards: records must still be monotonic
            let before = state.clone();
            let decided = match decide(&state, &command, now, key.public_key_hex()) {
                Ok(d) => d,
                Err(e) => {
                    // A refusal writes nothing, so what it can be checked for is its
                    // reason: one the state it was refused on shows.
                    prop_assert!(refusal_is_grounded(&state, &command, &e), "{command:?} refused: {e:?}");
                    continue;
                }
            };
            let records = seal(&state, decided.drafts, &key, now);
            for record in &records {
                state.apply(record).map_err(|e| TestCaseError::fail(e.to_string()))?;
            }
            log.extend(records);

            // Invariants after every command.
            prop_assert!(state.spent <= policy.budget, "overspent: {} > {}", state.spent, policy.budget);
            if let Some(Decision::Allowed { remaining, .. }) = &decided.decision {
                prop_assert_eq!(*remaining, state.remaining());
            }
            if state.scar_score >= policy.scar_limit && !state.scars.is_empty() {
                prop_assert!(!state.is_alive(), "scar limit reached but alive");
            }
            if !before.is_alive() {
                prop_assert!(!state.is_alive(), "termination was undone");
                prop_assert_eq!(state.spent, before.spent, "a terminated agent spent");
            }
            prop_assert!(state.scar_score >= before.scar_score);
        }

        // Write, read back, verify, replay.
        let text: String = log.iter().map(|r| r.to_line() + "\n").collect();
        let parsed: Vec<Record> = text.lines().map(|l| Record::from_line(l).unwrap()).collect();
        let report = verify_records(&parsed, &VerifyOptions {
            public_key: Some(key.public_key_hex().into()),
            checkpoint: log.last().map(Record::head),
        });
        prop_assert!(report.ok, "{:?}", report.failure);
        let replayed = AgentState::replay(&parsed).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(&replayed, &state);
        for pair in parsed.windows(2) {
            prop_assert!(pair[0].timestamp <= pair[1].timestamp, "timestamps went backwards");
        }
    }
}
