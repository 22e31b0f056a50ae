//! The reference docs' Lineage Mastery levels 1–6, replayed against our guard: the same
//! decisions, charges, reasons, scar scores, record kinds and counts.

use std::fs;

use lineage_core::guard::{ActionStatus, Decision, DenyReason, Outcome, Severity};
use lineage_core::verify::{verify_file, VerifyOptions};
use lineage_core::{AuditKey, Guard, Policy, ToolRule};
use serde_json::json;

fn kinds(guard: &Guard) -> Vec<String> {
    guard
        .records()
        .unwrap()
        .into_iter()
        .map(|r| r.kind)
        .collect()
}

#[test]
fn level_1_first_guarded_action() {
    let dir = tempfile::tempdir().unwrap();
    let key = AuditKey::load_or_create(dir.path().join("audit.key")).unwrap();
    let policy = Policy::new(10).allow("search", ToolRule::cost(1));
    let mut guard = Guard::create(dir.path().join("agent.jsonl"), key, "helper", policy).unwrap();

    let first = guard
        .request("search", json!({"query": "status page"}), None)
        .unwrap();
    assert_eq!(
        first,
        Decision::Allowed {
            action_id: "act-1".into(),
            cost: 1,
            remaining: 9
        }
    );
    guard
        .report("act-1", Outcome::success("found 3 results"))
        .unwrap();
    let second = guard
        .request("send_email", json!({"query": "status page"}), None)
        .unwrap();
    assert_eq!(second.action_id(), "act-2");
    match &second {
        Decision::Denied { reason, .. } => {
            assert_eq!(reason.to_string(), "tool 'send_email' is not allowed")
        }
        other => panic!("expected a denial, got {other:?}"),
    }

    let records = guard.records().unwrap();
    assert_eq!(records.len(), 8);
    assert_eq!(
        kinds(&guard),
        [
            "genesis",
            "policy",
            "action_requested",
            "action_allowed",
            "outcome",
            "action_requested",
            "action_denied",
            "scar"
        ]
    );
    assert_eq!(
        records[1]
            .to_line()
            .split("\"payload\":")
            .nth(1)
            .unwrap()
            .split(",\"prev_hash\"")
            .next()
            .unwrap(),
        r#"{"policy":{"budget":10,"default_rule":null,"rate_limit":null,"scar_limit":10,"tools":{"search":{"cost":1,"max_calls":null,"requires_approval":false}}}}"#
    );
    assert_eq!(
        records[2].payload,
        json!({"action_id":"act-1","cost":1,"input":{"query":"status page"},"tool":"search"})
    );
    assert_eq!(
        records[3].payload,
        json!({"action_id":"act-1","approved_by":null})
    );
    assert_eq!(
        records[4].payload,
        json!({"action_id":"act-1","detail":"found 3 results","status":"success"})
    );
    assert_eq!(
        records[5].payload,
        json!({"action_id":"act-2","cost":0,"input":{"query":"status page"},"tool":"send_email"})
    );
    assert_eq!(
        records[6].payload,
        json!({"action_id":"act-2","reason":{"code":"tool_not_allowed","tool":"send_email"}})
    );
    assert_eq!(
        records[7].payload,
        json!({"action_id":"act-2","reason":"tool 'send_email' is not allowed","severity":"moderate"})
    );
    assert!(records.iter().all(|r| r.actor == "helper"));
}

#[test]
fn level_2_budgets_and_costs() {
    let dir = tempfile::tempdir().unwrap();
    let policy = Policy::new(100)
        .allow("llm_call", ToolRule::cost(1))
        .allow("web_search", ToolRule::cost(5));
    let mut guard = Guard::create(
        dir.path().join("agent.jsonl"),
        AuditKey::generate().unwrap(),
        "researcher",
        policy,
    )
    .unwrap();
    /// (tool, declared cost, expected (charge, remaining) or None for a denial)
    type Step = (&'static str, Option<u64>, Option<(u64, u64)>);
    let plan: [Step; 6] = [
        ("llm_call", Some(12), Some((12, 88))),
        ("web_search", None, Some((5, 83))),
        ("llm_call", Some(0), Some((1, 82))),
        ("llm_call", Some(90), None),
        ("llm_call", Some(40), Some((40, 42))),
        ("llm_call", Some(42), Some((42, 0))),
    ];
    for (tool, declared, expected) in plan {
        let decision = guard.request(tool, json!({}), declared).unwrap();
        match (decision, expected) {
            (
                Decision::Allowed {
                    action_id,
                    cost,
                    remaining,
                },
                Some((want_cost, want_remaining)),
            ) => {
                assert_eq!((cost, remaining), (want_cost, want_remaining));
                assert_eq!(guard.status().remaining, want_remaining);
                guard.report(&action_id, Outcome::success("")).unwrap();
            }
            (Decision::Denied { reason, .. }, None) => {
                assert_eq!(
                    reason,
                    DenyReason::InsufficientBudget {
                        cost: 90,
                        remaining: 82
                    }
                );
                assert_eq!(reason.to_string(), "cost 90 exceeds remaining budget 82");
            }
            (other, want) => panic!("{tool}: got {other:?}, wanted {want:?}"),
        }
    }
    let status = guard.status();
    assert_eq!(
        (status.spent, status.budget, status.alive),
        (100, 100, false)
    );
    assert_eq!(
        status.termination_reason.as_deref(),
        Some("budget exhausted")
    );
    assert_eq!(status.scar_score, 0, "running low is not misbehaviour");
    assert_eq!(
        guard.request("llm_call", json!({}), None).unwrap(),
        Decision::Denied {
            action_id: "act-7".into(),
            reason: DenyReason::Terminated {
                reason: "budget exhausted".into()
            }
        }
    );
}

#[test]
fn level_3_scars_and_termination() {
    let dir = tempfile::tempdir().unwrap();
    let key_path = dir.path().join("audit.key");
    let policy = Policy::new(1000)
        .allow("read_file", ToolRule::cost(1))
        .allow("http_get", ToolRule::cost(1).with_max_calls(2))
        .scar_limit(10);
    let mut guard = Guard::create(
        dir.path().join("agent.jsonl"),
        AuditKey::load_or_create(&key_path).unwrap(),
        "worker",
        policy,
    )
    .unwrap();
    let score = |g: &Guard| (g.status().scar_score, g.status().alive);

    let id = guard
        .request("read_file", json!({"path": "report.md"}), None)
        .unwrap()
        .action_id()
        .to_string();
    guard
        .report(&id, Outcome::failure("file not found"))
        .unwrap();
    assert_eq!(score(&guard), (1, true));

    guard
        .request("delete_file", json!({"path": "report.md"}), None)
        .unwrap();
    assert_eq!(score(&guard), (4, true));

    for _ in 0..3 {
        let id = guard
            .request("http_get", json!({"url": "https://example.com"}), None)
            .unwrap()
            .action_id()
            .to_string();
        if guard
            .action(&id)
            .unwrap()
            .is_some_and(|a| a.status == ActionStatus::Allowed)
        {
            guard.report(&id, Outcome::success("")).unwrap();
        }
    }
    assert_eq!(score(&guard), (5, true));

    guard
        .scar(
            Severity::Severe,
            "uploaded a customer file to a paste site",
            None,
        )
        .unwrap();
    assert_eq!(score(&guard), (15, false));
    let status = guard.status();
    assert_eq!(
        status.termination_reason.as_deref(),
        Some("scar limit reached (15 >= 10)")
    );
    let scars: Vec<(Severity, &str)> = status
        .scars
        .iter()
        .map(|s| (s.severity, s.reason.as_str()))
        .collect();
    assert_eq!(
        scars,
        [
            (Severity::Minor, "action failed: file not found"),
            (Severity::Moderate, "tool 'delete_file' is not allowed"),
            (
                Severity::Minor,
                "tool 'http_get' reached its limit of 2 calls"
            ),
            (Severity::Severe, "uploaded a customer file to a paste site"),
        ]
    );

    let mut other = Guard::create(
        dir.path().join("other.jsonl"),
        AuditKey::load(&key_path).unwrap(),
        "other",
        Policy::new(10),
    )
    .unwrap();
    other
        .terminate("incident INC-42: suspended while we investigate", "oncall")
        .unwrap();
    assert!(!other.is_alive());
    let again = other.terminate("again", "oncall").unwrap_err();
    assert_eq!(
        again.to_string(),
        "agent is already terminated: incident INC-42: suspended while we investigate"
    );
}

#[test]
fn level_4_humans_in_the_loop() {
    let dir = tempfile::tempdir().unwrap();
    let policy = Policy::new(100)
        .allow("draft_reply", ToolRule::cost(1))
        .allow("send_refund", ToolRule::cost(10).with_approval());
    let mut guard = Guard::create(
        dir.path().join("agent.jsonl"),
        AuditKey::generate().unwrap(),
        "support",
        policy,
    )
    .unwrap();

    let first = guard
        .request("send_refund", json!({"order": "A-100", "amount": 40}), None)
        .unwrap();
    assert_eq!(
        first,
        Decision::PendingApproval {
            action_id: "act-1".into()
        }
    );
    assert_eq!(guard.status().spent, 0);
    let action = guard.action("act-1").unwrap().unwrap();
    assert_eq!(action.tool, "send_refund");
    assert_eq!(
        lineage_core::canonical::to_string(&action.input),
        r#"{"amount":40,"order":"A-100"}"#
    );
    let approved = guard
        .approve_with_note("act-1", "alice", Some("order shipped late; policy REF-3"))
        .unwrap();
    assert_eq!(
        approved,
        Decision::Allowed {
            action_id: "act-1".into(),
            cost: 10,
            remaining: 90
        }
    );
    guard
        .report("act-1", Outcome::success("refund issued"))
        .unwrap();

    guard
        .request(
            "send_refund",
            json!({"order": "A-101", "amount": 4000}),
            None,
        )
        .unwrap();
    let rejected = guard
        .reject(
            "act-2",
            "bob",
            "amount exceeds order value",
            Some(Severity::Moderate),
        )
        .unwrap();
    assert_eq!(
        rejected,
        Decision::Denied {
            action_id: "act-2".into(),
            reason: DenyReason::Rejected {
                by: "bob".into(),
                reason: "amount exceeds order value".into()
            }
        }
    );

    guard
        .request("send_refund", json!({"order": "A-102", "amount": 25}), None)
        .unwrap();
    guard.terminate("support queue paused", "oncall").unwrap();
    let late = guard.approve("act-3", "alice").unwrap();
    assert!(!late.is_allowed());

    let status = guard.status();
    assert_eq!(
        (status.spent, status.scar_score, status.alive),
        (10, 3, false)
    );
    let decided: Vec<_> = guard
        .records()
        .unwrap()
        .into_iter()
        .filter(|r| r.kind == "action_allowed" || r.kind == "action_rejected")
        .map(|r| (r.kind, lineage_core::canonical::to_string(&r.payload)))
        .collect();
    assert_eq!(
        decided,
        [
            (
                "action_allowed".to_string(),
                r#"{"action_id":"act-1","approved_by":"alice","note":"order shipped late; policy REF-3"}"#.to_string()
            ),
            (
                "action_rejected".to_string(),
                r#"{"action_id":"act-2","by":"bob","reason":"amount exceeds order value"}"#.to_string()
            ),
        ]
    );
}

/// One run of level 5: some work and one mistake.
fn level_5_run(dir: &std::path::Path) -> (Vec<String>, lineage_core::Status, usize) {
    let log = dir.join("agent.jsonl");
    let key = AuditKey::load_or_create(dir.join("audit.key")).unwrap();
    let mut guard = if log.exists() {
        Guard::open(&log, key).unwrap()
    } else {
        Guard::create(
            &log,
            key,
            "night-shift",
            Policy::new(20)
                .allow("work", ToolRule::cost(3))
                .scar_limit(6),
        )
        .unwrap()
    };
    let mut lines = Vec::new();
    for (tool, input) in [
        ("work", json!({"task": "reconcile"})),
        ("wipe_disk", json!({"disk": "/dev/sda"})),
    ] {
        match guard.request(tool, input, None).unwrap() {
            Decision::Allowed { action_id, .. } => {
                guard.report(&action_id, Outcome::success("")).unwrap();
                lines.push(format!("{tool} allowed"));
            }
            Decision::Denied { reason, .. } => lines.push(format!("{tool} denied: {reason}")),
            Decision::PendingApproval { .. } => unreachable!(),
        }
    }
    let count = guard.records().unwrap().len();
    (lines, guard.status(), count)
}

#[test]
fn level_5_consequences_survive_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let (lines, status, count) = level_5_run(dir.path());
    assert_eq!(
        lines,
        [
            "work allowed",
            "wipe_disk denied: tool 'wipe_disk' is not allowed"
        ]
    );
    assert_eq!(
        (status.spent, status.scar_score, status.alive, count),
        (3, 3, true, 8)
    );

    let (_, status, count) = level_5_run(dir.path());
    assert_eq!(
        (status.spent, status.scar_score, status.alive, count),
        (6, 6, false, 15)
    );
    assert_eq!(
        status.termination_reason.as_deref(),
        Some("scar limit reached (6 >= 6)")
    );

    let (lines, status, count) = level_5_run(dir.path());
    assert_eq!(
        lines,
        [
            "work denied: agent is terminated: scar limit reached (6 >= 6)",
            "wipe_disk denied: agent is terminated: scar limit reached (6 >= 6)"
        ]
    );
    assert_eq!(
        (status.spent, status.scar_score, status.alive, count),
        (6, 6, false, 19)
    );

    // Editing a record is refused.
    let log = dir.path().join("agent.jsonl");
    let original = fs::read_to_string(&log).unwrap();
    fs::write(&log, original.replacen("\"cost\":3", "\"cost\":0", 1)).unwrap();
    let key = AuditKey::load(dir.path().join("audit.key")).unwrap();
    let err = Guard::open(&log, key.clone()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "log is corrupt: line 2 (seq 1): hash does not match record content"
    );

    // Cutting the termination off: the guard terminates the agent again on open.
    let lines: Vec<&str> = original.lines().collect();
    let cut_at = lines
        .iter()
        .position(|l| l.contains("\"kind\":\"terminated\""))
        .unwrap();
    fs::write(&log, lines[..cut_at].join("\n") + "\n").unwrap();
    let mut guard = Guard::open(&log, key).unwrap();
    match guard.request("work", json!({}), None).unwrap() {
        Decision::Denied { reason, .. } => assert_eq!(
            reason.to_string(),
            "agent is terminated: scar limit reached (6 >= 6); termination record missing from the log"
        ),
        other => panic!("expected a denial, got {other:?}"),
    }
    let repaired = guard.records().unwrap();
    assert_eq!(repaired[cut_at].kind, "terminated");
    assert_eq!(repaired[cut_at].payload["by"], "guard (replay)");
}

#[test]
fn level_6_proving_what_happened() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("agent.jsonl");
    let mut guard = Guard::create(
        &log,
        AuditKey::load_or_create(dir.path().join("audit.key")).unwrap(),
        "payer",
        Policy::new(1000).allow("pay", ToolRule::cost(1)),
    )
    .unwrap();
    for amount in [120, 75, 310] {
        let id = guard
            .request("pay", json!({"to": "ACME", "amount": amount}), Some(amount))
            .unwrap()
            .action_id()
            .to_string();
        guard.report(&id, Outcome::success("sent")).unwrap();
    }
    let public_key = guard.status().public_key;
    let checkpoint = guard.head();
    assert_eq!(checkpoint.seq, 10);
    drop(guard);

    let trusted = VerifyOptions {
        public_key: Some(public_key.clone()),
        checkpoint: Some(checkpoint.clone()),
    };
    let original = fs::read_to_string(&log).unwrap();
    let check = |text: &str, options: &VerifyOptions| {
        fs::write(&log, text).unwrap();
        let report = verify_file(&log, options);
        match report.failure {
            None => format!("OK ({} records)", report.records),
            Some(failure) => format!("FAILED {failure}"),
        }
    };
    assert_eq!(check(&original, &trusted), "OK (11 records)");
    assert_eq!(
        check(
            &original.replacen("\"amount\":310", "\"amount\":31", 1),
            &trusted
        ),
        "FAILED line 9 (seq 8): hash does not match record content"
    );
    let lines: Vec<&str> = original.lines().collect();
    let without: Vec<&str> = lines
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 5)
        .map(|(_, l)| *l)
        .collect();
    assert_eq!(
        check(&(without.join("\n") + "\n"), &trusted),
        "FAILED line 6 (seq 6): expected seq 5, found 6"
    );
    let cut = lines[..lines.len() - 3].join("\n") + "\n";
    assert_eq!(
        check(
            &cut,
            &VerifyOptions {
                public_key: Some(public_key),
                checkpoint: None
            }
        ),
        "OK (8 records)"
    );
    assert_eq!(
        check(&cut, &trusted),
        "FAILED log ends at seq 7 before checkpoint (truncated)"
    );
}
