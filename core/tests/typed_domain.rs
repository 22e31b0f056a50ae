//! The guard's domain facts are typed, each with one list: why an agent was terminated
//! comes from what its log bears out, not from the `by` a termination record claims (an
//! operator who terminates with `by: "guard"` is not counted as budget exhaustion or a
//! scar limit); every denial's code is in the one list metrics label by; every record
//! kind a guard writes reads back as itself, and one it does not write is refused.

use lineage_core::guard::{Decision, DenyReason, RecordKind, TerminationCause};
use lineage_core::{AuditKey, Guard, Policy, ToolRule};
use serde_json::json;

fn guard(dir: &std::path::Path, policy: Policy) -> Guard {
    let key = AuditKey::load_or_create(dir.join("audit.key")).expect("key");
    Guard::create(dir.join("agent.jsonl"), key, "bot", policy).expect("guard")
}

#[test]
fn the_cause_is_what_the_log_bears_out() {
    // The guard, when an allowed action spends the last credit.
    let dir = tempfile::tempdir().expect("dir");
    let mut spent = guard(dir.path(), Policy::new(2).allow("pay", ToolRule::cost(2)));
    assert!(matches!(
        spent.request("pay", json!({}), None).expect("decide"),
        Decision::Allowed { remaining: 0, .. }
    ));
    assert_eq!(
        spent.state().termination_cause(),
        Some(TerminationCause::Budget)
    );

    // The guard, when scars reach the limit (two unlisted tools: 3 + 3 >= 5).
    let dir = tempfile::tempdir().expect("dir");
    let mut policy = Policy::new(100).allow("read", ToolRule::cost(1));
    policy.scar_limit = 5;
    let mut scarred = guard(dir.path(), policy.clone());
    for _ in 0..2 {
        scarred.request("shell", json!({}), None).expect("decide");
    }
    assert_eq!(
        scarred.state().termination_cause(),
        Some(TerminationCause::Scars)
    );

    // An operator, under any name, and one who writes "guard" with the guard's words.
    for (by, reason, cause) in [
        ("alice", "done", TerminationCause::Operator),
        ("guard", "budget exhausted", TerminationCause::GuardClaimed),
        (
            "guard",
            "scar limit reached (9 >= 5)",
            TerminationCause::GuardClaimed,
        ),
        (
            "guard (replay)",
            "budget exhausted",
            TerminationCause::GuardClaimed,
        ),
    ] {
        let dir = tempfile::tempdir().expect("dir");
        let mut agent = guard(dir.path(), policy.clone());
        agent.request("read", json!({}), None).expect("decide");
        assert_eq!(agent.state().termination_cause(), None, "alive");
        agent.terminate(reason, by).expect("terminate");
        assert_eq!(
            agent.state().termination_cause(),
            Some(cause),
            "{by}: {reason}"
        );
    }
}

#[test]
fn every_denial_code_is_in_the_one_list() {
    let reasons = [
        DenyReason::Terminated { reason: "x".into() },
        DenyReason::ToolNotAllowed { tool: "x".into() },
        DenyReason::InsufficientBudget {
            cost: 1,
            remaining: 0,
        },
        DenyReason::ToolCallLimit {
            tool: "x".into(),
            max_calls: 1,
        },
        DenyReason::RateLimited {
            max_actions: 1,
            window_secs: 1,
        },
        DenyReason::Rejected {
            by: "x".into(),
            reason: "x".into(),
        },
    ];
    let codes: Vec<&str> = reasons.iter().map(DenyReason::code).collect();
    assert_eq!(codes, DenyReason::CODES);
}

#[test]
fn every_record_kind_a_guard_writes_reads_back() {
    let dir = tempfile::tempdir().expect("dir");
    let policy = Policy::new(10)
        .allow("read", ToolRule::cost(1))
        .allow("pay", ToolRule::cost(1).with_approval());
    let mut agent = guard(dir.path(), policy);
    agent.request("read", json!({}), None).expect("allowed");
    agent
        .report("act-1", lineage_core::guard::Outcome::success("ok"))
        .expect("outcome");
    agent.request("pay", json!({}), None).expect("pending");
    agent.request("pay", json!({}), None).expect("pending");
    agent.approve("act-2", "alice").expect("approve");
    agent
        .reject(
            "act-3",
            "alice",
            "no",
            Some(lineage_core::guard::Severity::Minor),
        )
        .expect("reject");
    agent.request("shell", json!({}), None).expect("denied");
    agent.terminate("done", "alice").expect("terminate");
    let written: std::collections::BTreeSet<String> = agent
        .records()
        .expect("records")
        .into_iter()
        .map(|r| r.kind)
        .collect();
    let all: std::collections::BTreeSet<String> = RecordKind::ALL
        .iter()
        .map(|k| k.as_str().to_string())
        .collect();
    assert_eq!(written, all, "the guard writes every kind, and only those");
    for kind in RecordKind::ALL {
        assert_eq!(RecordKind::parse(kind.as_str()), Some(kind));
    }
    assert_eq!(RecordKind::parse("Genesis"), None);
}
