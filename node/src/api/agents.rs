//! The guard API for agents and operators, compatible with the reference guard server.
//! Handlers are thin: authorise, validate, call the app, shape the answer.

use std::sync::Arc;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine;
use lineage_core::guard::{Command, Outcome, OutcomeStatus, Severity};
use lineage_core::transparency::{self, Hash};
use lineage_core::verify::VerifyOptions;
use lineage_core::{token, Policy};
use serde::Deserialize;
use serde_json::{json, Value};

use super::auth::{path_agent_id, require, require_agent_or, validate_agent_id, Need, Principal};
use super::error::ApiError;
use super::idempotency::{IdempotencyKey, WriteBody};
use super::path::ApiPath;
use super::query::Query;
use crate::app::{Answer, App, AppError, EntryError, Respond, UnreadableRequest};
use crate::store::state_machine::RecordError;
use crate::store::AgentSlot;

type Result<T> = std::result::Result<T, ApiError>;

/// Log pages: default and largest number of records per page.
const LOG_PAGE_DEFAULT: usize = 500;
const LOG_PAGE_MAX: usize = 5000;
const TOOL_NAME_MAX_BYTES: usize = 128;

#[derive(Deserialize)]
pub struct CreateBody {
    agent_id: String,
    policy: Policy,
}

#[derive(Deserialize)]
pub struct ActionBody {
    tool: String,
    #[serde(default)]
    input: Value,
    cost: Option<u64>,
}

#[derive(Deserialize)]
pub struct OutcomeBody {
    status: OutcomeStatus,
    #[serde(default)]
    detail: String,
}

/// `approver` (and `by` below) is required with the shared admin token, as in the
/// reference; a named operator's own name is recorded, and a different name given here
/// is kept beside it as `claimed_by`.
#[derive(Deserialize)]
pub struct ApproveBody {
    approver: Option<String>,
    note: Option<String>,
}

#[derive(Deserialize)]
pub struct RejectBody {
    approver: Option<String>,
    reason: String,
    scar: Option<Severity>,
}

#[derive(Deserialize)]
pub struct ScarBody {
    severity: Severity,
    reason: String,
    action_id: Option<String>,
}

#[derive(Deserialize)]
pub struct TerminateBody {
    reason: String,
    by: Option<String>,
}

/// `?after=&limit=` (and `local=true`, handled by the routing layer), parsed here so a
/// bad value gets a precise JSON error rather than the framework's plain text.
struct LogQuery {
    after: Option<u64>,
    before: Option<u64>,
    limit: Option<usize>,
}

impl LogQuery {
    fn parse(query: &Query) -> Result<Self> {
        Ok(LogQuery {
            after: query.number("after")?,
            before: query.number("before")?,
            limit: query
                .number("limit")?
                .map(|l| usize::try_from(l).unwrap_or(usize::MAX)),
        })
    }
}

/// The leader's write path for one command, answered as `respond` says. A retry with
/// the request's Idempotency-Key gets the first answer (`idempotency`).
async fn write(
    app: &App,
    principal: &Principal,
    agent_id: &str,
    key: Option<IdempotencyKey>,
    command: Command,
    respond: Respond,
) -> Result<Response> {
    let answer = app
        .execute(agent_id, command, key, respond, principal.authority())
        .await?;
    let status = StatusCode::from_u16(answer.status)
        .map_err(|e| ApiError::Internal(format!("answer status {}: {e}", answer.status)))?;
    Ok((status, Json(answer.body)).into_response())
}

fn status_answer(status: lineage_core::Status) -> Answer {
    Answer {
        status: StatusCode::OK.as_u16(),
        body: serde_json::to_value(status).unwrap_or(Value::Null),
    }
}

pub async fn public_key(State(app): State<Arc<App>>) -> Json<Value> {
    Json(json!({"algorithm": "ed25519", "public_key": app.keys.audit.public_key_hex()}))
}

pub async fn create_agent(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: WriteBody<CreateBody>,
) -> Result<Response> {
    let principal = require(&headers, &app, Need::Admin)?;
    let (body, key) = body.keyed(&headers, principal.idempotency_caller())?;
    validate_agent_id(&body.agent_id)?;
    let command = Command::Create {
        agent_id: body.agent_id.clone(),
        policy: body.policy,
    };
    // The answer is stored (under the Idempotency-Key, in the Raft log and on every
    // node) without the token; the token is added to every answer, a replayed one
    // included, as it is computed: never stored anywhere.
    let mut answer = app
        .execute(
            &body.agent_id,
            command,
            key,
            Respond::Status(Box::new(|status| Answer {
                status: StatusCode::OK.as_u16(),
                body: json!({"agent": status}),
            })),
            principal.authority(),
        )
        .await?;
    if answer.status == StatusCode::OK.as_u16() {
        if let Some(map) = answer.body.as_object_mut() {
            // Always the current token: an answer stored by an earlier version holds the
            // first one, which a reissue may have revoked since.
            map.insert(
                "token".into(),
                Value::String(current_token(&app, &body.agent_id)),
            );
        }
    }
    let status = StatusCode::from_u16(answer.status)
        .map_err(|e| ApiError::Internal(format!("answer status {}: {e}", answer.status)))?;
    Ok((status, Json(answer.body)).into_response())
}

pub async fn list_agents(State(app): State<Arc<App>>, headers: HeaderMap) -> Result<Json<Value>> {
    require(&headers, &app, Need::Read)?;
    let data = app.sm.read_data();
    let agents: Vec<Value> = data
        .agents
        .iter()
        .map(|(id, slot)| match slot {
            AgentSlot::Active(state) => {
                json!({"agent_id": id, "state": "active", "status": state.status()})
            }
            AgentSlot::Quarantined(reason) => {
                json!({"agent_id": id, "state": "quarantined", "error": reason})
            }
        })
        .collect();
    Ok(Json(json!({"agents": agents})))
}

pub async fn agent_status(
    State(app): State<Arc<App>>,
    ApiPath(agent_id): ApiPath<String>,
    headers: HeaderMap,
) -> Result<Json<Value>> {
    require_agent_or(&headers, &app, &agent_id, Need::Read)?;
    path_agent_id(&agent_id)?;
    let status = app.with_agent(&agent_id, |s| s.status())?;
    Ok(Json(serde_json::to_value(status).unwrap_or(Value::Null)))
}

pub async fn agent_token(
    State(app): State<Arc<App>>,
    ApiPath(agent_id): ApiPath<String>,
    headers: HeaderMap,
) -> Result<Json<Value>> {
    require(&headers, &app, Need::Admin)?;
    path_agent_id(&agent_id)?;
    app.with_agent(&agent_id, |_| ())?;
    Ok(Json(json!({"token": current_token(&app, &agent_id)})))
}

/// The agent's token at its current generation (computed, never stored).
fn current_token(app: &App, agent_id: &str) -> String {
    let generation = app.sm.read_data().operators.token_generation(agent_id);
    token::issue_generation(&app.keys.token_key, agent_id, generation)
}

/// `POST /v1/agents/:id/token/reissue` (admin): a new token for the agent, recorded in
/// the system log; every earlier token of the agent is refused from then on (on each
/// follower once it has applied the change).
pub async fn reissue_token(
    State(app): State<Arc<App>>,
    ApiPath(agent_id): ApiPath<String>,
    headers: HeaderMap,
) -> Result<Json<Value>> {
    let principal = require(&headers, &app, Need::Admin)?;
    path_agent_id(&agent_id)?;
    app.with_agent(&agent_id, |_| ())?;
    let change = lineage_core::operators::Change::ReissueAgentToken {
        agent_id: agent_id.clone(),
    };
    app.change_operators(change, &super::operators::changed_by(&principal))
        .await?;
    let generation = app.sm.read_data().operators.token_generation(&agent_id);
    Ok(Json(json!({
        "token": token::issue_generation(&app.keys.token_key, &agent_id, generation),
        "generation": generation,
    })))
}

pub async fn request_action(
    State(app): State<Arc<App>>,
    ApiPath(agent_id): ApiPath<String>,
    headers: HeaderMap,
    body: WriteBody<ActionBody>,
) -> Result<Response> {
    let principal = require_agent_or(&headers, &app, &agent_id, Need::Admin)?;
    path_agent_id(&agent_id)?;
    let (body, key) = body.keyed(&headers, principal.idempotency_caller())?;
    if body.tool.is_empty() || body.tool.len() > TOOL_NAME_MAX_BYTES {
        return Err(ApiError::BadRequest("tool must be 1-128 characters".into()));
    }
    let command = Command::Request {
        tool: body.tool,
        input: body.input,
        cost: body.cost,
    };
    write(&app, &principal, &agent_id, key, command, Respond::Decision).await
}

pub async fn pending_actions(
    State(app): State<Arc<App>>,
    ApiPath(agent_id): ApiPath<String>,
    headers: HeaderMap,
) -> Result<Json<Value>> {
    require(&headers, &app, Need::Read)?;
    path_agent_id(&agent_id)?;
    // Each entry's request is read back from the store: off the async workers.
    let reader = app.clone();
    let queue = tokio::task::spawn_blocking(move || reader.pending(&agent_id))
        .await
        .map_err(|e| ApiError::Internal(format!("reading the approval queue: {e}")))??;
    let mut body = json!({"pending": queue.pending});
    // Present only when some request could not be read back here (the reference's
    // answer has `pending` alone).
    if !queue.unreadable.is_empty() {
        body["unreadable"] = json!(queue.unreadable);
    }
    Ok(Json(body))
}

/// Actions waiting for approval in one page of `GET /v1/actions/pending`, by default and
/// at most.
const PENDING_PAGE_DEFAULT: u64 = 100;
const PENDING_PAGE_MAX: u64 = 1000;

/// `GET /v1/actions/pending[?limit=N][&after=CURSOR]`: every agent's actions waiting for
/// approval (admin), ordered by agent id then seq, with the total across all agents. The
/// cursor `next` is `AGENT:SEQ` of the page's last entry.
pub async fn all_pending_actions(
    State(app): State<Arc<App>>,
    query: Query,
    headers: HeaderMap,
) -> Result<Json<Value>> {
    require(&headers, &app, Need::Read)?;
    let limit = query.number("limit")?.unwrap_or(PENDING_PAGE_DEFAULT);
    if !(1..=PENDING_PAGE_MAX).contains(&limit) {
        return Err(ApiError::BadRequest(format!(
            "limit must be between 1 and {PENDING_PAGE_MAX}, got {limit}"
        )));
    }
    let after = query.text("after").map(parse_pending_cursor).transpose()?;
    let mut total = 0u64;
    let mut chosen = Vec::new();
    let mut more = false;
    {
        let data = app.sm.read_data();
        for (agent_id, slot) in &data.agents {
            let AgentSlot::Active(state) = slot else {
                continue;
            };
            total += state.pending_count() as u64;
            if state.pending_count() == 0 || more {
                continue;
            }
            for entry in state.pending() {
                let past_cursor = after.as_ref().is_none_or(|(cursor_agent, cursor_seq)| {
                    (agent_id.as_str(), entry.seq) > (cursor_agent.as_str(), *cursor_seq)
                });
                if !past_cursor {
                    continue;
                }
                if chosen.len() as u64 == limit {
                    more = true;
                    break;
                }
                chosen.push((agent_id.clone(), entry));
            }
        }
    }
    // The requests are read back with the state's lock let go (the read takes it again),
    // off the async workers.
    let reader = app.clone();
    let (chosen, page, unreadable) = tokio::task::spawn_blocking(move || {
        let mut page = Vec::with_capacity(chosen.len());
        let mut unreadable = Vec::new();
        for (agent_id, entry) in &chosen {
            match reader.pending_view(agent_id, entry) {
                Ok(shown) => {
                    let mut value = serde_json::to_value(shown)
                        .map_err(|e| ApiError::Internal(e.to_string()))?;
                    value["agent_id"] = json!(agent_id);
                    page.push(value);
                }
                Err(EntryError::Unreadable(why)) => {
                    unreadable.push(UnreadableRequest::of(agent_id, entry, why))
                }
                Err(EntryError::Failed(error)) => return Err(ApiError::from(error)),
            }
        }
        Ok::<_, ApiError>((chosen, page, unreadable))
    })
    .await
    .map_err(|e| ApiError::Internal(format!("reading the approval queue: {e}")))??;
    let next = more
        .then(|| chosen.last())
        .flatten()
        .map(|(agent_id, entry)| format!("{agent_id}:{}", entry.seq));
    let mut body = json!({"pending": page, "total": total, "next": next});
    if !unreadable.is_empty() {
        body["unreadable"] = json!(unreadable);
    }
    Ok(Json(body))
}

fn parse_pending_cursor(cursor: &str) -> Result<(String, u64)> {
    let bad = || ApiError::BadRequest(format!("after must be a cursor AGENT:SEQ, got {cursor:?}"));
    let (agent, seq) = cursor.rsplit_once(':').ok_or_else(bad)?;
    Ok((agent.to_string(), seq.parse().map_err(|_| bad())?))
}

pub async fn get_action(
    State(app): State<Arc<App>>,
    ApiPath((agent_id, action_id)): ApiPath<(String, String)>,
    headers: HeaderMap,
) -> Result<Json<Value>> {
    require_agent_or(&headers, &app, &agent_id, Need::Read)?;
    path_agent_id(&agent_id)?;
    let action = app
        .action(&agent_id, &action_id)?
        .ok_or(ApiError::ActionNotFound)?;
    Ok(Json(serde_json::to_value(action).unwrap_or(Value::Null)))
}

pub async fn report_outcome(
    State(app): State<Arc<App>>,
    ApiPath((agent_id, action_id)): ApiPath<(String, String)>,
    headers: HeaderMap,
    body: WriteBody<OutcomeBody>,
) -> Result<Response> {
    let principal = require_agent_or(&headers, &app, &agent_id, Need::Admin)?;
    let (body, key) = body.keyed(&headers, principal.idempotency_caller())?;
    if body.status == OutcomeStatus::Harmful && matches!(principal, Principal::Agent(..)) {
        return Err(ApiError::Forbidden);
    }
    path_agent_id(&agent_id)?;
    let command = Command::Report {
        action_id,
        outcome: Outcome {
            status: body.status,
            detail: body.detail,
        },
    };
    write(
        &app,
        &principal,
        &agent_id,
        key,
        command,
        Respond::Status(Box::new(status_answer)),
    )
    .await
}

pub async fn approve_action(
    State(app): State<Arc<App>>,
    ApiPath((agent_id, action_id)): ApiPath<(String, String)>,
    headers: HeaderMap,
    body: WriteBody<ApproveBody>,
) -> Result<Response> {
    let principal = require(&headers, &app, Need::Decide)?;
    path_agent_id(&agent_id)?;
    let (body, key) = body.keyed(&headers, principal.idempotency_caller())?;
    let (approver, claimed_by) = principal.attribute(&app, body.approver, "approver")?;
    let command = Command::Approve {
        action_id,
        approver,
        claimed_by,
        note: body.note,
    };
    write(&app, &principal, &agent_id, key, command, Respond::Decision).await
}

pub async fn reject_action(
    State(app): State<Arc<App>>,
    ApiPath((agent_id, action_id)): ApiPath<(String, String)>,
    headers: HeaderMap,
    body: WriteBody<RejectBody>,
) -> Result<Response> {
    let principal = require(&headers, &app, Need::Decide)?;
    path_agent_id(&agent_id)?;
    let (body, key) = body.keyed(&headers, principal.idempotency_caller())?;
    // A scar can terminate the agent: only an admin may attach one.
    if body.scar.is_some() {
        super::auth::permit(&principal, Need::Admin)
            .map_err(|_| ApiError::NotPermitted("only an admin may reject with a scar".into()))?;
    }
    let (approver, claimed_by) = principal.attribute(&app, body.approver, "approver")?;
    let command = Command::Reject {
        action_id,
        approver,
        claimed_by,
        reason: body.reason,
        scar: body.scar,
    };
    write(&app, &principal, &agent_id, key, command, Respond::Decision).await
}

pub async fn add_scar(
    State(app): State<Arc<App>>,
    ApiPath(agent_id): ApiPath<String>,
    headers: HeaderMap,
    body: WriteBody<ScarBody>,
) -> Result<Response> {
    let principal = require(&headers, &app, Need::Admin)?;
    path_agent_id(&agent_id)?;
    let (body, key) = body.keyed(&headers, principal.idempotency_caller())?;
    let by = match &principal {
        Principal::Operator { name, .. } => Some(name.clone()),
        _ => None,
    };
    let command = Command::Scar {
        severity: body.severity,
        reason: body.reason,
        action_id: body.action_id,
        by,
    };
    write(
        &app,
        &principal,
        &agent_id,
        key,
        command,
        Respond::Status(Box::new(status_answer)),
    )
    .await
}

pub async fn terminate(
    State(app): State<Arc<App>>,
    ApiPath(agent_id): ApiPath<String>,
    headers: HeaderMap,
    body: WriteBody<TerminateBody>,
) -> Result<Response> {
    let principal = require(&headers, &app, Need::Admin)?;
    path_agent_id(&agent_id)?;
    let (body, key) = body.keyed(&headers, principal.idempotency_caller())?;
    let (by, claimed_by) = principal.attribute(&app, body.by, "by")?;
    let command = Command::Terminate {
        reason: body.reason,
        by,
        claimed_by,
    };
    write(
        &app,
        &principal,
        &agent_id,
        key,
        command,
        Respond::Status(Box::new(status_answer)),
    )
    .await
}

pub async fn agent_log(
    State(app): State<Arc<App>>,
    ApiPath(agent_id): ApiPath<String>,
    query: Query,
    headers: HeaderMap,
) -> Result<Json<Value>> {
    let query = LogQuery::parse(&query)?;
    require(&headers, &app, Need::Read)?;
    path_agent_id(&agent_id)?;
    let (head, next_seq) = app.with_agent(&agent_id, |s| (s.head.clone(), s.next_seq()))?;
    let limit = query.limit.unwrap_or(LOG_PAGE_DEFAULT).min(LOG_PAGE_MAX);
    let mut from = query.after.map_or(0, |a| a.saturating_add(1));
    let mut count = limit;
    if let Some(before) = query.before {
        // The `limit` records just below `before` (seqs are dense from 0): a reader
        // pages from the newest back, and each page is still in ascending order.
        let end = before.min(next_seq);
        from = from.max(end.saturating_sub(limit as u64));
        count = usize::try_from(end.saturating_sub(from)).unwrap_or(limit);
    }
    let records = if count == 0 {
        Vec::new()
    } else {
        match app.sm.records(&agent_id, from, count) {
            Ok(records) => records,
            Err(RecordError::Damaged(why)) => return Err(quarantine_copy(&app, &agent_id, why)),
            Err(RecordError::Store(why)) => {
                return Err(ApiError::unavailable(format!(
                    "reading the log: the store cannot be read here: {why}"
                )))
            }
        }
    };
    if let Some(why) = page_shortfall(next_seq, from, count, records.len()) {
        return Err(quarantine_copy(&app, &agent_id, why));
    }
    Ok(Json(json!({"head": head, "records": records})))
}

/// Why a log page of `got` records from `from` (at most `count`) is short, if it is:
/// every record below `next_seq` was applied before the read began, so a page holding
/// fewer of them is a copy that lost records, never to be served as a shorter log.
fn page_shortfall(next_seq: u64, from: u64, count: usize, got: usize) -> Option<String> {
    let expected = next_seq.saturating_sub(from).min(count as u64);
    ((got as u64) < expected).then(|| {
        format!(
            "records {from}..{} read back as {got} of {expected}",
            from + expected
        )
    })
}

/// This node's copy of an agent's log does not read back: the agent is quarantined on
/// this node, as the scrub would do on its next pass, and the read is answered as any
/// request for a quarantined agent is (503 `quarantined`, which clients do not retry).
fn quarantine_copy(app: &App, agent_id: &str, why: String) -> ApiError {
    let reason = format!("node {}'s stored records do not read back: {why}", app.id);
    tracing::error!(agent_id, %reason, "agent quarantined on this node");
    app.sm.quarantine(agent_id, reason.clone());
    ApiError::App(AppError::Quarantined(reason))
}

pub async fn verify_agent(
    State(app): State<Arc<App>>,
    ApiPath(agent_id): ApiPath<String>,
    headers: HeaderMap,
) -> Result<Json<Value>> {
    require(&headers, &app, Need::Read)?;
    path_agent_id(&agent_id)?;
    // The head this node folded the agent's state to: a stored log that ends before it
    // lost records, and fails here as "truncated" instead of verifying a shorter log.
    let head = app.with_agent(&agent_id, |s| s.head.clone())?;
    whole_log_read(&app, SlotWait::Queue, move |app| {
        let options = VerifyOptions {
            public_key: Some(app.keys.audit.public_key_hex().to_string()),
            checkpoint: head,
        };
        let report = app
            .sm
            .verify_stored(&agent_id, crate::spare_cores::verifier(options))
            .map_err(ApiError::Internal)?;
        Ok(if report.ok {
            json!({"ok": true, "records": report.records, "public_key": report.public_key, "head": report.head})
        } else {
            // The copy verified is this node's (the leader's, for a linearizable read).
            json!({"ok": false, "records": report.records, "failure": report.failure, "node": app.id})
        })
    })
    .await
    .map(Json)
}

/// How long a whole-log read waits for a slot.
enum SlotWait {
    /// As long as it takes (its caller was authorised for this read).
    Queue,
    /// Up to this long, then 503.
    AtMost(std::time::Duration),
    /// Not at all: 503 at once if every slot is busy.
    NotAtAll,
}

/// Runs `read`, which walks a whole agent log, on a blocking thread once one of the
/// node's few whole-log slots is free (`App::whole_log_reads`).
async fn whole_log_read<T: Send + 'static>(
    app: &Arc<App>,
    wait: SlotWait,
    read: impl FnOnce(&App) -> Result<T> + Send + 'static,
) -> Result<T> {
    let busy = || ApiError::unavailable("every whole-log read slot is busy; retry shortly");
    let closed = |_| ApiError::unavailable("the node is shutting down");
    let slots = &app.whole_log_reads;
    let _slot = match wait {
        SlotWait::Queue => slots.acquire().await.map_err(closed)?,
        SlotWait::AtMost(limit) => tokio::time::timeout(limit, slots.acquire())
            .await
            .map_err(|_| busy())?
            .map_err(closed)?,
        SlotWait::NotAtAll => slots.try_acquire().map_err(|_| busy())?,
    };
    let app = app.clone();
    tokio::task::spawn_blocking(move || read(&app))
        .await
        .map_err(|e| ApiError::Internal(format!("whole-log read: {e}")))?
}

/// Numeric query parameters for the proof endpoints, parsed with precise errors.
pub(super) fn query_numbers(query: &Query, names: &[&str]) -> Result<Vec<u64>> {
    names
        .iter()
        .map(|name| query.required_number(name))
        .collect()
}

/// How long a proof asked for with a valid token (the checkpointer's, an operator's,
/// an agent's) may wait for a whole-log slot before it is refused.
const PROOF_SLOT_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// A proof over the agent's first `size` record hashes. The cheap checks come first, in
/// this order: the agent, the tree size, then the request's own `argument` check; only
/// then is the log read, on a whole-log slot, and `build` given the leaves. Anyone may
/// ask: a request with no valid token finding both slots taken is refused at once (503,
/// retry) rather than holding its connection while it waits; one with a token (the
/// checkpointer's rounds depend on these proofs) waits up to [`PROOF_SLOT_WAIT`].
async fn proof_over_records(
    app: &Arc<App>,
    headers: &HeaderMap,
    agent_id: String,
    size: u64,
    argument: Result<()>,
    build: impl FnOnce(&[Hash]) -> Result<Value> + Send + 'static,
) -> Result<Json<Value>> {
    let head = app.with_agent(&agent_id, |s| s.next_seq())?;
    if size == 0 || size > head {
        return Err(ApiError::BadRequest(format!(
            "size must be between 1 and {head}"
        )));
    }
    argument?;
    let wait = if crate::api::auth::principal(headers, app).is_ok() {
        SlotWait::AtMost(PROOF_SLOT_WAIT)
    } else {
        SlotWait::NotAtAll
    };
    whole_log_read(app, wait, move |app| {
        build(&record_hashes(app, &agent_id, size)?)
    })
    .await
    .map(Json)
}

/// The agent's first `size` record hashes (the leaves of its tree of that size).
fn record_hashes(app: &App, agent_id: &str, size: u64) -> Result<Vec<Hash>> {
    app.sm
        .record_hashes(agent_id, size)
        .map_err(ApiError::Internal)
}

pub(super) fn b64(hash: &Hash) -> String {
    base64::engine::general_purpose::STANDARD.encode(hash)
}

/// `GET /v1/agents/:id/proof/inclusion?index=I&size=N`: record I is in the agent's tree
/// of size N (leaves are record hashes).
pub async fn inclusion_proof(
    State(app): State<Arc<App>>,
    ApiPath(agent_id): ApiPath<String>,
    headers: HeaderMap,
    query: Query,
) -> Result<Json<Value>> {
    path_agent_id(&agent_id)?;
    let [index, size] = query_numbers(&query, &["index", "size"])?[..] else {
        return Err(ApiError::Internal("query parsing".into()));
    };
    let argument = if index < size {
        Ok(())
    } else {
        Err(ApiError::BadRequest(format!(
            "index must be below size {size}"
        )))
    };
    proof_over_records(&app, &headers, agent_id, size, argument, move |leaves| {
        let proof = transparency::inclusion_proof(leaves, index)
            .map_err(|e| ApiError::BadRequest(e.to_string()))?;
        Ok(json!({
            "index": index,
            "size": size,
            "leaf": b64(&leaves[index as usize]),
            "root": b64(&transparency::root(leaves)),
            "proof": proof.iter().map(b64).collect::<Vec<_>>(),
        }))
    })
    .await
}

/// `GET /v1/agents/:id/proof/consistency?old=M&size=N`: the agent's tree of size M is a
/// prefix of its tree of size N.
pub async fn consistency_proof(
    State(app): State<Arc<App>>,
    ApiPath(agent_id): ApiPath<String>,
    headers: HeaderMap,
    query: Query,
) -> Result<Json<Value>> {
    path_agent_id(&agent_id)?;
    let [old, size] = query_numbers(&query, &["old", "size"])?[..] else {
        return Err(ApiError::Internal("query parsing".into()));
    };
    let argument = if (1..=size).contains(&old) {
        Ok(())
    } else {
        Err(ApiError::BadRequest(format!(
            "old must be between 1 and {size}"
        )))
    };
    proof_over_records(&app, &headers, agent_id, size, argument, move |leaves| {
        let proof = transparency::consistency_proof(leaves, old)
            .map_err(|e| ApiError::BadRequest(e.to_string()))?;
        Ok(json!({
            "old": old,
            "size": size,
            "old_root": b64(&transparency::root(&leaves[..old as usize])),
            "root": b64(&transparency::root(leaves)),
            "proof": proof.iter().map(b64).collect::<Vec<_>>(),
        }))
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::page_shortfall;

    #[test]
    fn a_page_short_of_the_records_below_the_head_is_named() {
        // Whole pages, and pages that end at the head, are not short.
        assert_eq!(page_shortfall(10, 0, 5, 5), None);
        assert_eq!(page_shortfall(10, 8, 5, 2), None);
        // Past the head (or at it), nothing is expected.
        assert_eq!(page_shortfall(10, 10, 5, 0), None);
        assert_eq!(page_shortfall(10, u64::MAX, 5, 0), None);
        assert_eq!(page_shortfall(0, 0, 5, 0), None);
        // One record short, inside the page and at the head.
        assert_eq!(
            page_shortfall(10, 0, 5, 4).as_deref(),
            Some("records 0..5 read back as 4 of 5")
        );
        assert_eq!(
            page_shortfall(10, 8, 5, 1).as_deref(),
            Some("records 8..10 read back as 1 of 2")
        );
        assert!(page_shortfall(u64::MAX, u64::MAX - 1, usize::MAX, 0).is_some());
    }
}
