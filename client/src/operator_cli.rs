//! `lineage operator add|list|revoke` and `lineage whoami`: named operators with roles.
//!
//! `add` makes the token here (256 random bits) and sends only its SHA-256, so the token
//! never reaches the cluster's log, its idempotency answers, or the network after this.

use std::io::Write;
use std::path::Path;

use lineage_core::operators::{generate_token, is_operator_name, token_sha256, Role, TOKEN_PREFIX};
use serde_json::{json, Value};

use crate::ops_cli::{cell, print_json, runtime, table, Failure, Target};

/// `lineage operator add NAME --role R [--token-out FILE]`: prints the new token once,
/// or keeps it in FILE. With FILE, the token is written there (mode 0600, a new file)
/// before it is registered, and a FILE that exists already holds the token to register:
/// a run cut short anywhere is finished by running it again (adding the same operator
/// with the same token is answered as done), and a token is never overwritten.
pub fn add(
    target: &Target,
    name: &str,
    role: &str,
    token_out: Option<&Path>,
    out: &mut dyn Write,
) -> Result<(), Failure> {
    let role = Role::parse(role).ok_or_else(|| {
        Failure::Usage(format!(
            "role must be admin, approver, auditor or publisher, not {role:?}"
        ))
    })?;
    let client = target.admin_client()?;
    let token = match token_out {
        Some(path) => kept_token(path).map_err(Failure::Usage)?,
        None => generate_token().map_err(|e| Failure::Usage(format!("no randomness: {e}")))?,
    };
    let answer = runtime()?.block_on(client.post_json(
        "/v1/operators",
        json!({"name": name, "role": role.as_str(), "token_sha256": token_sha256(&token)}),
    ))?;
    let w = |e: std::io::Error| Failure::Usage(e.to_string());
    if let Some(path) = token_out {
        if target.json {
            return print_json(out, &answer);
        }
        return writeln!(
            out,
            "added operator {name} ({}); its token is in {}",
            role.as_str(),
            path.display()
        )
        .map_err(w);
    }
    if target.json {
        let mut answer = answer;
        answer["token"] = Value::String(token);
        return print_json(out, &answer);
    }
    writeln!(out, "added operator {name} ({})", role.as_str()).map_err(w)?;
    writeln!(
        out,
        "token (shown once; give it to {name} and keep it secret):"
    )
    .map_err(w)?;
    writeln!(out, "{token}").map_err(w)
}

/// The token kept in `path`: read when the file exists, else made and written there.
fn kept_token(path: &Path) -> Result<String, String> {
    match std::fs::read_to_string(path) {
        Ok(text) => {
            let token = text.trim().to_string();
            let well_formed = token
                .strip_prefix(TOKEN_PREFIX)
                .is_some_and(|hex| hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()));
            if well_formed {
                Ok(token)
            } else {
                Err(format!(
                    "{} exists and holds no operator token; it is never overwritten",
                    path.display()
                ))
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let token = generate_token().map_err(|e| format!("no randomness: {e}"))?;
            write_secret(path, &token)?;
            Ok(token)
        }
        Err(e) => Err(format!("cannot read {}: {e}", path.display())),
    }
}

/// Writes a secret to a new file, mode 0600, synced, never over an existing file.
fn write_secret(path: &Path, secret: &str) -> Result<(), String> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    // A named temporary file is created 0600.
    let mut tmp = tempfile::NamedTempFile::new_in(dir)
        .map_err(|e| format!("cannot write in {}: {e}", dir.display()))?;
    writeln!(tmp, "{secret}")
        .and_then(|()| tmp.as_file().sync_all())
        .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    tmp.persist_noclobber(path)
        .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    Ok(())
}

/// `lineage operator list`: every operator ever added, revoked ones too.
pub fn list(target: &Target, out: &mut dyn Write) -> Result<(), Failure> {
    let client = target.admin_client()?;
    let answer = runtime()?.block_on(client.get_json("/v1/operators"))?;
    if target.json {
        return print_json(out, &answer);
    }
    let mut rows = vec![vec![
        "NAME".to_string(),
        "ROLE".into(),
        "STATE".into(),
        "ADDED BY".into(),
        "ADDED AT".into(),
        "REVOKED BY".into(),
    ]];
    let empty = Vec::new();
    for operator in answer["operators"].as_array().unwrap_or(&empty) {
        let state = if operator["active"] == Value::Bool(true) {
            "active"
        } else {
            "revoked"
        };
        rows.push(vec![
            cell(&operator["name"]),
            cell(&operator["role"]),
            state.to_string(),
            cell(&operator["added_by"]),
            cell(&operator["added_at"]),
            cell(&operator["revoked_by"]),
        ]);
    }
    table(out, &rows)
}

/// `lineage operator revoke NAME`.
pub fn revoke(target: &Target, name: &str, out: &mut dyn Write) -> Result<(), Failure> {
    if !is_operator_name(name) {
        return Err(Failure::Usage(format!(
            "{name:?} is not an operator name (1-64 characters of a-z 0-9 _ -)"
        )));
    }
    let client = target.admin_client()?;
    let answer = runtime()?
        .block_on(client.post_json(&format!("/v1/operators/{name}/revoke"), json!({})))?;
    if target.json {
        return print_json(out, &answer);
    }
    writeln!(out, "revoked operator {name}").map_err(|e| Failure::Usage(e.to_string()))
}

/// `lineage whoami`: who the token speaks for.
pub fn whoami(target: &Target, out: &mut dyn Write) -> Result<(), Failure> {
    let client = target.admin_client()?;
    let answer = runtime()?.block_on(client.get_json("/v1/whoami"))?;
    if target.json {
        return print_json(out, &answer);
    }
    let text = match answer["kind"].as_str() {
        Some("operator") => format!(
            "operator {} (role {})",
            cell(&answer["name"]),
            cell(&answer["role"])
        ),
        Some("shared_admin") => {
            "the shared admin token (role admin; records name whoever the request names)".into()
        }
        Some("agent") => format!("agent {}", cell(&answer["agent_id"])),
        _ => answer.to_string(),
    };
    writeln!(out, "{text}").map_err(|e| Failure::Usage(e.to_string()))
}
