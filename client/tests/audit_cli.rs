//! The `lineage audit` binary, run as a user would: output, `--json`, exit codes.

use std::path::Path;
use std::process::{Command, Output};

use lineage_core::{AuditKey, Guard, Policy, ToolRule};
use serde_json::json;

fn lineage(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lineage"))
        .args(args)
        .output()
        .expect("run lineage")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn keygen_pubkey_append_show_verify() {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("audit.key");
    let log = dir.path().join("deploys.jsonl");

    let out = lineage(&["audit", "keygen", s(&key)]);
    assert_eq!(out.status.code(), Some(0));
    let printed = text(&out.stdout);
    let public = printed
        .lines()
        .nth(1)
        .unwrap()
        .strip_prefix("public key: ")
        .unwrap()
        .to_string();
    assert_eq!(public.len(), 64);
    let again = lineage(&["audit", "keygen", s(&key)]);
    assert_eq!(
        again.status.code(),
        Some(2),
        "keygen must refuse to overwrite"
    );
    assert!(text(&again.stderr).contains("refusing to overwrite"));

    let out = lineage(&["audit", "pubkey", s(&key)]);
    assert_eq!(text(&out.stdout).trim(), public);

    for version in ["1.4.1", "1.4.2"] {
        let payload = format!(r#"{{"service": "api", "version": "{version}"}}"#);
        let out = lineage(&[
            "audit",
            "append",
            s(&log),
            "--key",
            s(&key),
            "--actor",
            "ci",
            "--kind",
            "deploy",
            "--payload",
            &payload,
        ]);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    }
    let head = text(
        &lineage(&[
            "audit",
            "append",
            s(&log),
            "--key",
            s(&key),
            "--actor",
            "ci",
            "--kind",
            "note",
        ])
        .stdout,
    );
    assert!(head.starts_with("3:"), "{head}");

    let out = lineage(&[
        "audit",
        "verify",
        s(&log),
        "--public-key",
        &public,
        "--checkpoint",
        head.trim(),
    ]);
    assert_eq!(out.status.code(), Some(0));
    let report = text(&out.stdout);
    assert!(
        report.starts_with("OK  4 records, log deploys\n"),
        "{report}"
    );
    assert!(report.contains(&format!("    head       {}", head.trim())));
    assert!(
        text(&out.stderr).is_empty(),
        "no warning with a trusted key"
    );

    let out = lineage(&["audit", "verify", s(&log)]);
    assert_eq!(out.status.code(), Some(0));
    assert!(text(&out.stderr).contains("warning: no --public-key given"));

    let out = lineage(&[
        "audit",
        "verify",
        s(&log),
        "--public-key",
        &public,
        "--json",
    ]);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["ok"], true);
    assert_eq!(json["records"], 4);
    assert_eq!(json["key_trusted"], true);
    assert_eq!(json["log_id"], "deploys");
    assert!(json["failure"].is_null());

    let out = lineage(&["audit", "show", s(&log)]);
    let table = text(&out.stdout);
    assert_eq!(table.lines().count(), 5);
    assert!(table.contains(r#"{"service":"api","version":"1.4.2"}"#));
    let out = lineage(&["audit", "show", s(&log), "--json"]);
    assert_eq!(text(&out.stdout), std::fs::read_to_string(&log).unwrap());
}

#[test]
fn verify_fails_precisely_with_exit_1() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bot.jsonl");
    let key = AuditKey::generate().unwrap();
    let mut guard = Guard::create(
        &path,
        key.clone(),
        "bot",
        Policy::new(1000).allow("pay", ToolRule::cost(1)),
    )
    .unwrap();
    guard.request("pay", json!({"amount": 310}), None).unwrap();
    let head = guard.head();
    drop(guard);
    let original = std::fs::read_to_string(&path).unwrap();
    std::fs::write(
        &path,
        original.replacen("\"amount\":310", "\"amount\":31", 1),
    )
    .unwrap();
    let out = lineage(&[
        "audit",
        "verify",
        s(&path),
        "--public-key",
        key.public_key_hex(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        text(&out.stdout),
        "FAILED  line 3 (seq 2): hash does not match record content\n"
    );

    let lines: Vec<&str> = original.lines().collect();
    std::fs::write(&path, lines[..3].join("\n") + "\n").unwrap();
    let out = lineage(&[
        "audit",
        "verify",
        s(&path),
        "--public-key",
        key.public_key_hex(),
        "--checkpoint",
        &head.to_string(),
        "--json",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        json["failure"]["reason"],
        "log ends at seq 2 before checkpoint (truncated)"
    );
}

#[test]
fn usage_and_io_errors_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.jsonl");
    for args in [
        vec!["audit", "verify", s(&missing)],
        vec!["audit", "verify", s(&missing), "--checkpoint", "nope"],
        vec!["audit", "verify", s(&missing), "--public-key", "xyz"],
        vec!["audit", "pubkey", s(&missing)],
        vec!["audit", "frobnicate"],
        vec![
            "audit",
            "append",
            s(&missing),
            "--key",
            s(&missing),
            "--actor",
            "a",
            "--kind",
            "k",
            "--payload",
            "{bad",
        ],
    ] {
        let out = lineage(&args);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            text(&out.stderr)
        );
        assert!(!text(&out.stderr).is_empty());
    }
}
