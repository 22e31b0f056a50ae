//! The operator commands of `lineage`: cluster status, daily agent work, and fetching an
//! agent's signed log. Each command prints a table or short lines, or with `--json` the
//! API's own answer.
//!
//! Exit codes: 0 ok; 1 a negative result (denied, no leader, an API refusal); 2 usage or
//! local I/O; 3 no node reachable; 4 the token was refused.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use lineage_core::Record;
use serde_json::{json, Value};

use crate::client::{Client, ClientError};
use crate::terminal_text::printable;

pub const EXIT_OK: i32 = 0;
pub const EXIT_NEGATIVE: i32 = 1;
pub const EXIT_USAGE: i32 = 2;
pub const EXIT_UNREACHABLE: i32 = 3;
pub const EXIT_AUTH: i32 = 4;

/// How long a node has to answer a page of `audit fetch` (5000 records), where
/// `--timeout` bounds everything else.
const FETCH_PAGE_TIMEOUT: Duration = Duration::from_secs(60);
/// Adding a node answers once the learner has caught up, which takes as long as the log.
const ADD_NODE_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// Where the node URLs come from when `--url` is not given, after `LINEAGE_URL`.
const URL_ENV_FALLBACKS: [&str; 2] = ["GUARD_URLS", "GUARD_URL"];
const DEFAULT_URL: &str = "http://127.0.0.1:9200";

/// Why a command did not succeed, with the exit code that says so.
#[derive(Debug)]
pub enum Failure {
    Usage(String),
    Negative(String),
    Unreachable(String),
    Auth(String),
}

impl Failure {
    pub fn exit_code(&self) -> i32 {
        match self {
            Failure::Usage(_) => EXIT_USAGE,
            Failure::Negative(_) => EXIT_NEGATIVE,
            Failure::Unreachable(_) => EXIT_UNREACHABLE,
            Failure::Auth(_) => EXIT_AUTH,
        }
    }

    pub fn message(&self) -> &str {
        match self {
            Failure::Usage(m)
            | Failure::Negative(m)
            | Failure::Unreachable(m)
            | Failure::Auth(m) => m,
        }
    }
}

impl From<ClientError> for Failure {
    fn from(error: ClientError) -> Self {
        match &error {
            ClientError::Api { status: 401, .. } => Failure::Auth(format!(
                "{error} (check --token-file, GUARD_ADMIN_TOKEN or keys/admin.token)"
            )),
            ClientError::Api { status: 403, .. } => Failure::Auth(error.to_string()),
            ClientError::Api { .. } | ClientError::NoLeader { .. } | ClientError::Decode(_) => {
                Failure::Negative(error.to_string())
            }
            ClientError::Unavailable { .. } => Failure::Unreachable(error.to_string()),
            ClientError::Config(_) => Failure::Usage(error.to_string()),
        }
    }
}

/// The cluster a command talks to, and how it prints.
pub struct Target {
    pub urls: Vec<String>,
    pub token_file: Option<PathBuf>,
    /// CA bundle for `https://` nodes (`--ca`).
    pub ca: Option<PathBuf>,
    pub timeout: Duration,
    pub json: bool,
}

impl Target {
    /// The node URLs: `--url`/`LINEAGE_URL`, else `GUARD_URLS`, `GUARD_URL`, else the
    /// default local node.
    pub fn node_urls(given: &[String]) -> Vec<String> {
        if !given.is_empty() {
            return given.to_vec();
        }
        URL_ENV_FALLBACKS
            .iter()
            .find_map(|name| std::env::var(name).ok().filter(|v| !v.trim().is_empty()))
            .map(|urls| urls.split(',').map(|u| u.trim().to_string()).collect())
            .unwrap_or_else(|| vec![DEFAULT_URL.to_string()])
    }

    /// An admin client that gives each node `--timeout` to answer.
    pub(crate) fn admin_client(&self) -> Result<Client, Failure> {
        self.admin_client_waiting(self.timeout)
    }

    /// An admin client that waits up to `answer` for an answer (a node reached within
    /// `--timeout`).
    fn admin_client_waiting(&self, answer: Duration) -> Result<Client, Failure> {
        let token = find_admin_token(self.token_file.as_deref())?;
        Ok(Client::new(&self.urls, &token)?
            .with_ca_file(self.ca.as_deref())?
            .with_timeouts(self.timeout, answer)?)
    }
}

/// The admin token, found as the Python client finds it: `--token-file` (or
/// `LINEAGE_ADMIN_TOKEN_FILE`); else `GUARD_ADMIN_TOKEN` in the environment or in `./.env`;
/// else `keys/admin.token` under `$GUARD_DATA_DIR`, `./guard-data` or `./lineage-data`.
pub fn find_admin_token(token_file: Option<&Path>) -> Result<String, Failure> {
    let read = |path: &Path| -> Result<Option<String>, String> {
        match std::fs::read_to_string(path) {
            Ok(text) => Ok(Some(text.trim().to_string()).filter(|t| !t.is_empty())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(format!("cannot read {}: {e}", path.display())),
        }
    };
    if let Some(path) = token_file {
        return read(path)
            .map_err(Failure::Usage)?
            .ok_or_else(|| Failure::Usage(format!("no token in {}", path.display())));
    }
    if let Some(token) = std::env::var("GUARD_ADMIN_TOKEN")
        .ok()
        .filter(|t| !t.trim().is_empty())
    {
        return Ok(token.trim().to_string());
    }
    if let Ok(dotenv) = std::fs::read_to_string(".env") {
        let found = dotenv.lines().find_map(|line| {
            let (key, value) = line.trim().split_once('=')?;
            (key.trim() == "GUARD_ADMIN_TOKEN")
                .then(|| value.trim().trim_matches(['"', '\'']).to_string())
                .filter(|v| !v.is_empty())
        });
        if let Some(token) = found {
            return Ok(token);
        }
    }
    let data_dirs = std::env::var("GUARD_DATA_DIR")
        .ok()
        .into_iter()
        .chain(["guard-data".to_string(), "lineage-data".to_string()]);
    let mut looked = Vec::new();
    for dir in data_dirs.filter(|d| !d.is_empty()) {
        let path = Path::new(&dir).join("keys").join("admin.token");
        if let Some(token) = read(&path).map_err(Failure::Usage)? {
            return Ok(token);
        }
        looked.push(path.display().to_string());
    }
    Err(Failure::Usage(format!(
        "no admin token found: give --token-file, or set GUARD_ADMIN_TOKEN or GUARD_DATA_DIR; \
         looked in {}",
        looked.join(", ")
    )))
}

/// An agent or action id as it goes into a URL path: the API's id rule (1-64 of
/// `[A-Za-z0-9_-]`), so `..` or `a/b` can never name another route.
fn path_id<'a>(id: &'a str, what: &str) -> Result<&'a str, Failure> {
    if lineage_core::guard::is_agent_id(id) {
        Ok(id)
    } else {
        Err(Failure::Usage(format!(
            "{what} {id:?} is not an id (1-64 characters of A-Z a-z 0-9 _ -)"
        )))
    }
}

pub(crate) fn runtime() -> Result<tokio::runtime::Runtime, Failure> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Failure::Usage(e.to_string()))
}

pub(crate) fn print_json(out: &mut dyn Write, value: &Value) -> Result<(), Failure> {
    let text = serde_json::to_string_pretty(value).map_err(|e| Failure::Usage(e.to_string()))?;
    writeln!(out, "{text}").map_err(|e| Failure::Usage(e.to_string()))
}

/// A cell of a table: the value as text, `-` when absent. Strings come from agents
/// (tool names, scar reasons), so they pass through [`printable`] (`terminal_text`).
pub(crate) fn cell(value: &Value) -> String {
    match value {
        Value::Null => "-".into(),
        Value::String(s) => printable(s),
        other => other.to_string(),
    }
}

/// Writes rows as columns padded to their widest cell.
pub(crate) fn table(out: &mut dyn Write, rows: &[Vec<String>]) -> Result<(), Failure> {
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..columns)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    for row in rows {
        let mut line = String::new();
        for (c, text) in row.iter().enumerate() {
            if c + 1 == row.len() {
                line.push_str(text);
            } else {
                line.push_str(&format!("{text:<width$}  ", width = widths[c]));
            }
        }
        writeln!(out, "{}", line.trim_end()).map_err(|e| Failure::Usage(e.to_string()))?;
    }
    Ok(())
}

/// `lineage cluster status`: the leader, and each node with its role, lag and when the
/// leader last heard from it; a node that stopped answering shows as UNREACHABLE.
pub fn cluster_status(target: &Target, out: &mut dyn Write) -> Result<(), Failure> {
    let client = target.admin_client()?;
    let status = runtime()?.block_on(client.get_json("/v1/cluster"))?;
    if target.json {
        return print_json(out, &status);
    }
    let w = |e: std::io::Error| Failure::Usage(e.to_string());
    writeln!(
        out,
        "leader {}  term {}  commit index {}",
        cell(&status["leader"]),
        cell(&status["term"]),
        cell(&status["commit_index"])
    )
    .map_err(w)?;
    let mut rows = vec![vec![
        "NODE".to_string(),
        "ADDRESS".into(),
        "ROLE".into(),
        "MATCHED".into(),
        "LAG".into(),
        "LAST CONTACT".into(),
        "SECRETS (SENDS; ACCEPTS)".into(),
    ]];
    let empty = Vec::new();
    for node in status["nodes"].as_array().unwrap_or(&empty) {
        let contact = match (&node["reachable"], node["last_contact_ms"].as_u64()) {
            (Value::Null, _) if node["id"] == status["node_id"] => "(answered this)".to_string(),
            (Value::Bool(true), Some(ms)) => format!("{ms} ms ago"),
            (_, Some(ms)) => format!("UNREACHABLE (last answer {:.1} s ago)", ms as f64 / 1000.0),
            (_, None) => "UNREACHABLE (never answered)".to_string(),
        };
        rows.push(vec![
            cell(&node["id"]),
            cell(&node["addr"]),
            cell(&node["role"]),
            cell(&node["matched_index"]),
            cell(&node["lag"]),
            contact,
            secrets_cell(&node["secrets"]),
        ]);
    }
    table(out, &rows)
}

/// A node's cluster-secret fingerprints: the one it sends, then every one it accepts.
fn secrets_cell(secrets: &Value) -> String {
    match (secrets["sends"].as_str(), secrets["accepts"].as_array()) {
        (Some(sends), Some(accepts)) => {
            let accepts: Vec<String> = accepts.iter().map(cell).collect();
            format!("{sends}; {}", accepts.join(","))
        }
        _ => "-".into(),
    }
}

/// `lineage cluster add` / `remove`: prints the API's answer.
pub fn cluster_change(
    target: &Target,
    path: &str,
    body: Value,
    out: &mut dyn Write,
) -> Result<(), Failure> {
    let client = target.admin_client_waiting(ADD_NODE_TIMEOUT)?;
    let answer = runtime()?.block_on(client.post_json(path, body))?;
    print_json(out, &answer)
}

/// `lineage agent list`.
pub fn agent_list(target: &Target, out: &mut dyn Write) -> Result<(), Failure> {
    let client = target.admin_client()?;
    let answer = runtime()?.block_on(client.get_json("/v1/agents"))?;
    if target.json {
        return print_json(out, &answer);
    }
    let mut rows = vec![vec![
        "AGENT".to_string(),
        "STATE".into(),
        "SPENT/BUDGET".into(),
        "SCARS/LIMIT".into(),
        "PENDING".into(),
    ]];
    let empty = Vec::new();
    for agent in answer["agents"].as_array().unwrap_or(&empty) {
        let status = &agent["status"];
        let state = match (agent["state"].as_str(), status["alive"].as_bool()) {
            (Some("active"), Some(false)) => "terminated".to_string(),
            (Some(state), _) => state.to_string(),
            (None, _) => "-".to_string(),
        };
        let (spent, scars, pending) = if status.is_null() {
            (cell(&agent["error"]), String::new(), String::new())
        } else {
            (
                format!("{}/{}", cell(&status["spent"]), cell(&status["budget"])),
                format!(
                    "{}/{}",
                    cell(&status["scar_score"]),
                    cell(&status["scar_limit"])
                ),
                cell(&status["actions_pending"]),
            )
        };
        rows.push(vec![cell(&agent["agent_id"]), state, spent, scars, pending]);
    }
    table(out, &rows)
}

/// `lineage agent show ID`.
pub fn agent_show(target: &Target, agent_id: &str, out: &mut dyn Write) -> Result<(), Failure> {
    let agent_id = path_id(agent_id, "agent")?;
    let client = target.admin_client()?;
    let status = runtime()?.block_on(client.get_json(&format!("/v1/agents/{agent_id}")))?;
    if target.json {
        return print_json(out, &status);
    }
    let w = |e: std::io::Error| Failure::Usage(e.to_string());
    let alive = status["alive"].as_bool().unwrap_or(false);
    writeln!(out, "agent      {}", cell(&status["agent_id"])).map_err(w)?;
    if alive {
        writeln!(out, "state      active").map_err(w)?;
    } else {
        writeln!(
            out,
            "state      terminated: {}",
            cell(&status["termination_reason"])
        )
        .map_err(w)?;
    }
    writeln!(
        out,
        "budget     {} spent of {} ({} left)",
        cell(&status["spent"]),
        cell(&status["budget"]),
        cell(&status["remaining"])
    )
    .map_err(w)?;
    writeln!(
        out,
        "scars      {} of {}",
        cell(&status["scar_score"]),
        cell(&status["scar_limit"])
    )
    .map_err(w)?;
    let empty = Vec::new();
    for scar in status["scars"].as_array().unwrap_or(&empty) {
        writeln!(
            out,
            "           - {} {}: {}",
            cell(&scar["severity"]),
            cell(&scar["weight"]),
            cell(&scar["reason"])
        )
        .map_err(w)?;
    }
    writeln!(
        out,
        "actions    {} allowed, {} denied, {} waiting for approval",
        cell(&status["actions_allowed"]),
        cell(&status["actions_denied"]),
        cell(&status["actions_pending"])
    )
    .map_err(w)?;
    writeln!(
        out,
        "head       {}:{}",
        cell(&status["head"]["seq"]),
        cell(&status["head"]["hash"])
    )
    .map_err(w)?;
    writeln!(out, "public key {}", cell(&status["public_key"])).map_err(w)
}

/// `lineage agent create ID --policy JSON|@FILE`: prints the agent's token.
pub fn agent_create(
    target: &Target,
    agent_id: &str,
    policy: &str,
    out: &mut dyn Write,
) -> Result<(), Failure> {
    let text = match policy.strip_prefix('@') {
        Some(path) => std::fs::read_to_string(path)
            .map_err(|e| Failure::Usage(format!("cannot read policy {path}: {e}")))?,
        None => policy.to_string(),
    };
    let policy: Value = serde_json::from_str(&text)
        .map_err(|e| Failure::Usage(format!("--policy is not JSON: {e}")))?;
    let client = target.admin_client()?;
    let body = json!({"agent_id": agent_id, "policy": policy});
    let answer = runtime()?.block_on(client.post_json("/v1/agents", body))?;
    if target.json {
        return print_json(out, &answer);
    }
    let w = |e: std::io::Error| Failure::Usage(e.to_string());
    writeln!(
        out,
        "created agent {agent_id} (budget {})",
        cell(&answer["agent"]["budget"])
    )
    .map_err(w)?;
    writeln!(out, "token {}", cell(&answer["token"])).map_err(w)
}

/// `lineage agent pending [ID]`: one agent's approval queue, or every agent's.
pub fn agent_pending(
    target: &Target,
    agent_id: Option<&str>,
    out: &mut dyn Write,
) -> Result<(), Failure> {
    let client = target.admin_client()?;
    let rt = runtime()?;
    let mut entries: Vec<Value> = Vec::new();
    // Waiting actions the node could not show: their request does not read back intact.
    let mut unreadable: Vec<Value> = Vec::new();
    match agent_id {
        Some(id) => {
            let id = path_id(id, "agent")?;
            let answer =
                rt.block_on(client.get_json(&format!("/v1/agents/{id}/actions/pending")))?;
            for mut entry in answer["pending"].as_array().cloned().unwrap_or_default() {
                entry["agent_id"] = json!(id);
                entries.push(entry);
            }
            unreadable.extend(answer["unreadable"].as_array().cloned().unwrap_or_default());
        }
        None => {
            // Every page: the queue is bounded by what operators can work through.
            let mut cursor: Option<String> = None;
            loop {
                let path = match &cursor {
                    Some(after) => format!("/v1/actions/pending?limit=1000&after={after}"),
                    None => "/v1/actions/pending?limit=1000".to_string(),
                };
                let answer = rt.block_on(client.get_json(&path))?;
                entries.extend(answer["pending"].as_array().cloned().unwrap_or_default());
                unreadable.extend(answer["unreadable"].as_array().cloned().unwrap_or_default());
                let next = answer["next"].as_str().map(str::to_string);
                match next {
                    Some(next) if Some(&next) != cursor.as_ref() => cursor = Some(next),
                    _ => break,
                }
            }
        }
    }
    if target.json {
        let mut body = json!({"pending": entries});
        if !unreadable.is_empty() {
            body["unreadable"] = json!(unreadable);
        }
        return print_json(out, &body);
    }
    let mut rows = vec![vec![
        "AGENT".to_string(),
        "ACTION".into(),
        "TOOL".into(),
        "COST".into(),
        "REQUESTED".into(),
        "INPUT".into(),
    ]];
    for entry in &entries {
        let action = &entry["action"];
        // Canonical JSON escapes only C0 controls: DEL, C1 (CSI among them) and the
        // invisible characters still need escaping for the terminal.
        let mut input = printable(&lineage_core::canonical::to_string(&action["input"]));
        if input.chars().count() > 60 {
            input = input.chars().take(57).collect::<String>() + "...";
        }
        rows.push(vec![
            cell(&entry["agent_id"]),
            cell(&action["action_id"]),
            cell(&action["tool"]),
            cell(&action["cost"]),
            cell(&entry["requested_at"]),
            input,
        ]);
    }
    table(out, &rows)?;
    let write = |out: &mut dyn Write, line: String| {
        writeln!(out, "{line}").map_err(|e| Failure::Usage(e.to_string()))
    };
    for entry in &unreadable {
        write(
            out,
            format!(
                "(cannot be shown: {} {} at seq {}: {})",
                cell(&entry["agent_id"]),
                cell(&entry["action_id"]),
                cell(&entry["seq"]),
                cell(&entry["error"])
            ),
        )?;
    }
    if entries.is_empty() && unreadable.is_empty() {
        write(out, "(no action is waiting for approval)".to_string())?;
    }
    Ok(())
}

/// What an operator decides on a pending action.
pub enum Verdict<'a> {
    Approve {
        note: Option<&'a str>,
    },
    Reject {
        reason: &'a str,
        scar: Option<&'a str>,
    },
}

/// `lineage agent approve|reject ID ACTION`: prints the decision. An approval that the
/// guard still denies (the budget ran out meanwhile) is a negative result.
pub fn agent_decide(
    target: &Target,
    agent_id: &str,
    action_id: &str,
    approver: &str,
    verdict: Verdict<'_>,
    out: &mut dyn Write,
) -> Result<(), Failure> {
    let (agent_id, action_id) = (path_id(agent_id, "agent")?, path_id(action_id, "action")?);
    let (path, body) = match verdict {
        Verdict::Approve { note } => (
            format!("/v1/agents/{agent_id}/actions/{action_id}/approve"),
            json!({"approver": approver, "note": note}),
        ),
        Verdict::Reject { reason, scar } => (
            format!("/v1/agents/{agent_id}/actions/{action_id}/reject"),
            json!({"approver": approver, "reason": reason, "scar": scar}),
        ),
    };
    let client = target.admin_client()?;
    let decision = runtime()?.block_on(client.post_json(&path, body))?;
    if target.json {
        print_json(out, &decision)?;
    } else {
        let text = match decision["decision"].as_str() {
            Some("allowed") => format!(
                "allowed {action_id} (cost {}, {} left)",
                cell(&decision["cost"]),
                cell(&decision["remaining"])
            ),
            Some("denied") => format!("denied {action_id}: {}", cell(&decision["reason"]["code"])),
            Some(other) => format!("{} {action_id}", printable(other)),
            None => decision.to_string(),
        };
        writeln!(out, "{text}").map_err(|e| Failure::Usage(e.to_string()))?;
    }
    match (decision["decision"].as_str(), &decision["reason"]["code"]) {
        // A rejection is answered as `denied` with the code `rejected`: what was asked.
        (Some("denied"), code) if code != "rejected" => Err(Failure::Negative(format!(
            "{action_id} was denied: {}",
            cell(code)
        ))),
        _ => Ok(()),
    }
}

/// `lineage agent reissue-token ID`: prints the agent's new token; every earlier one
/// is refused from now on.
pub fn agent_reissue_token(
    target: &Target,
    agent_id: &str,
    out: &mut dyn Write,
) -> Result<(), Failure> {
    let agent_id = path_id(agent_id, "agent")?;
    let client = target.admin_client()?;
    let path = format!("/v1/agents/{agent_id}/token/reissue");
    let answer = runtime()?.block_on(client.post_json(&path, json!({})))?;
    if target.json {
        return print_json(out, &answer);
    }
    writeln!(out, "{}", cell(&answer["token"])).map_err(|e| Failure::Usage(e.to_string()))
}

/// `lineage agent terminate ID --reason R`.
pub fn agent_terminate(
    target: &Target,
    agent_id: &str,
    reason: &str,
    by: &str,
    out: &mut dyn Write,
) -> Result<(), Failure> {
    let agent_id = path_id(agent_id, "agent")?;
    let client = target.admin_client()?;
    let path = format!("/v1/agents/{agent_id}/terminate");
    let status =
        runtime()?.block_on(client.post_json(&path, json!({"reason": reason, "by": by})))?;
    if target.json {
        return print_json(out, &status);
    }
    writeln!(out, "terminated {agent_id}: {reason}").map_err(|e| Failure::Usage(e.to_string()))
}

/// `lineage checkpoint fetch`: the latest witnessed heads checkpoint (public: no token).
pub fn checkpoint_fetch(
    target: &Target,
    dest: Option<&Path>,
    out: &mut dyn Write,
) -> Result<(), Failure> {
    let client = Client::new(&target.urls, "")?
        .with_ca_file(target.ca.as_deref())?
        .with_timeouts(target.timeout, target.timeout)?;
    let note = runtime()?.block_on(client.witnessed_checkpoint())?;
    match dest {
        None => out
            .write_all(note.as_bytes())
            .map_err(|e| Failure::Usage(e.to_string())),
        Some(path) => write_new_file(path, note.as_bytes()).map_err(Failure::Usage),
    }
}

/// Records asked for per page by `audit fetch` (the API's maximum).
const FETCH_PAGE: usize = 5000;

/// `lineage audit fetch AGENT`: the agent's signed records, one line each, exactly as
/// the log file holds them, so `lineage audit verify` checks what was fetched. Every
/// page is checked to continue the last (seq by seq) before anything is written out.
pub fn audit_fetch(
    target: &Target,
    agent_id: &str,
    dest: Option<&Path>,
    out: &mut dyn Write,
) -> Result<(), Failure> {
    let agent_id = path_id(agent_id, "agent")?;
    let client = target.admin_client_waiting(FETCH_PAGE_TIMEOUT)?;
    let rt = runtime()?;
    let mut lines = String::new();
    let mut next_seq = 0u64;
    loop {
        let after = next_seq.checked_sub(1);
        let records: Vec<Record> = rt.block_on(client.log(agent_id, after, FETCH_PAGE))?;
        for record in &records {
            if record.seq != next_seq {
                return Err(Failure::Negative(format!(
                    "the cluster answered seq {} where seq {next_seq} was due",
                    record.seq
                )));
            }
            next_seq += 1;
            lines.push_str(&record.to_line());
            lines.push('\n');
        }
        if records.len() < FETCH_PAGE {
            break;
        }
    }
    match dest {
        None => out
            .write_all(lines.as_bytes())
            .map_err(|e| Failure::Usage(e.to_string())),
        Some(path) => {
            write_new_file(path, lines.as_bytes()).map_err(Failure::Usage)?;
            eprintln!(
                "{next_seq} records of {agent_id} written to {}",
                path.display()
            );
            Ok(())
        }
    }
}

/// Writes `bytes` to `path` through a temporary file and a rename, so an interrupted
/// fetch never leaves a short log that would read as a truncated one.
fn write_new_file(path: &Path, bytes: &[u8]) -> Result<(), String> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let mut tmp = tempfile::NamedTempFile::new_in(dir)
        .map_err(|e| format!("cannot write in {}: {e}", dir.display()))?;
    tmp.write_all(bytes)
        .and_then(|()| tmp.as_file().sync_all())
        .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    tmp.persist(path)
        .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cells_show_agent_text_without_escape_sequences() {
        assert_eq!(
            cell(&Value::String("pay\u{202e}exe.txt\u{7}".into())),
            "pay\\u{202e}exe.txt\\u{7}"
        );
        assert_eq!(cell(&Value::Null), "-");
        assert_eq!(cell(&serde_json::json!(12)), "12");
    }
}
