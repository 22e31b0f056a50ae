//! Importing a reference guard's agent logs through Raft (admin): `lineage import --from
//! DIR` drives these routes, one agent at a time: begin, its original signed lines in
//! batches, commit at the head the source file ends with (`store::imports`).

use std::sync::Arc;

use axum::extract::State;
use axum::http::{HeaderMap, Method};
use axum::routing::{get, post};
use axum::Json;
use lineage_core::{Head, Record};
use serde::Deserialize;
use serde_json::{json, Value};

use super::auth::{path_agent_id, require, Need};
use super::body::JsonBody;
use super::error::ApiError;
use super::path::ApiPath;
use super::route_book::RouteBook;
use crate::app::App;
use crate::raft_types::{
    ImportManifest, ImportStep, RecordLine, Tombstone, MAX_IMPORT_BATCH_BYTES,
};

pub fn routes() -> RouteBook {
    RouteBook::default()
        .route("/v1/agents/{id}/import", &[Method::GET], get(status))
        .route("/v1/agents/{id}/import/begin", &[Method::POST], post(begin))
        .route(
            "/v1/agents/{id}/import/records",
            &[Method::POST],
            post(records),
        )
        .route(
            "/v1/agents/{id}/import/commit",
            &[Method::POST],
            post(commit),
        )
        .route(
            "/v1/agents/{id}/import/tombstone",
            &[Method::POST],
            post(tombstone),
        )
        .route("/v1/agents/{id}/import/abort", &[Method::POST], post(abort))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BeginBody {
    genesis_hash: String,
    source_sha256: String,
    /// The head the source file ends with; the commit must be at it.
    head: Head,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecordsBody {
    /// The source's lines, each as the JSON object it is, byte for byte.
    records: Vec<RecordLine>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CommitBody {
    head: Head,
}

fn hex64(text: &str, what: &str) -> Result<(), ApiError> {
    if text.len() == 64 && text.bytes().all(|b| b.is_ascii_hexdigit()) {
        Ok(())
    } else {
        Err(ApiError::BadRequest(format!(
            "{what} must be 64 hex digits"
        )))
    }
}

/// `GET /v1/agents/:id/import`: `absent`, `importing`, `active` or `quarantined`, with
/// the next seq and head this node holds.
async fn status(
    State(app): State<Arc<App>>,
    ApiPath(agent_id): ApiPath<String>,
    headers: HeaderMap,
) -> Result<Json<Value>, ApiError> {
    require(&headers, &app, Need::Admin)?;
    path_agent_id(&agent_id)?;
    let status = crate::import_writes::status(&app.sm, &agent_id);
    let genesis_hash = match status.state {
        "active" | "importing" if status.next_seq > 0 => app
            .sm
            .records(&agent_id, 0, 1)
            .map_err(|e| ApiError::Internal(e.to_string()))?
            .first()
            .map(|genesis| genesis.hash.clone()),
        _ => None,
    };
    Ok(Json(json!({
        "state": status.state,
        "next_seq": status.next_seq,
        "head": status.head,
        "genesis_hash": genesis_hash,
        "manifest": status.manifest,
    })))
}

async fn begin(
    State(app): State<Arc<App>>,
    ApiPath(agent_id): ApiPath<String>,
    headers: HeaderMap,
    JsonBody(body): JsonBody<BeginBody>,
) -> Result<Json<Value>, ApiError> {
    require(&headers, &app, Need::Admin)?;
    path_agent_id(&agent_id)?;
    hex64(&body.genesis_hash, "genesis_hash")?;
    hex64(&body.source_sha256, "source_sha256")?;
    let manifest = ImportManifest {
        genesis_hash: body.genesis_hash.to_ascii_lowercase(),
        source_sha256: body.source_sha256.to_ascii_lowercase(),
        head: Some(body.head),
    };
    step_and_status(&app, ImportStep::Begin { agent_id, manifest }).await
}

async fn records(
    State(app): State<Arc<App>>,
    ApiPath(agent_id): ApiPath<String>,
    headers: HeaderMap,
    JsonBody(body): JsonBody<RecordsBody>,
) -> Result<Json<Value>, ApiError> {
    require(&headers, &app, Need::Admin)?;
    path_agent_id(&agent_id)?;
    let bytes: usize = body.records.iter().map(|line| line.line().len()).sum();
    if bytes > MAX_IMPORT_BATCH_BYTES && body.records.len() > 1 {
        return Err(ApiError::BodyTooLarge(MAX_IMPORT_BATCH_BYTES));
    }
    if body.records.is_empty() {
        return Err(ApiError::BadRequest("no records".into()));
    }
    // A line is stored as sent and served as it parses: they must be the same line. The
    // line made from the parsed record carries it, so it is parsed once on this node.
    let mut records = Vec::with_capacity(body.records.len());
    for line in &body.records {
        let record = Record::from_line(line.line())
            .map_err(|e| ApiError::BadRequest(format!("not a record: {e}")))?;
        let seq = record.seq;
        let checked = RecordLine::new(record)
            .ok()
            .filter(|checked| checked.line() == line.line())
            .ok_or_else(|| {
                ApiError::BadRequest(format!(
                    "record seq {seq} is not in the format's canonical line form"
                ))
            })?;
        records.push(checked);
    }
    step_and_status(&app, ImportStep::Records { agent_id, records }).await
}

/// Takes `step`, then answers with where the agent's import stands.
async fn step_and_status(app: &App, step: ImportStep) -> Result<Json<Value>, ApiError> {
    let agent_id = step.agent_id().to_string();
    app.import_step(step).await?;
    Ok(Json(json!(crate::import_writes::status(
        &app.sm, &agent_id
    ))))
}

async fn commit(
    State(app): State<Arc<App>>,
    ApiPath(agent_id): ApiPath<String>,
    headers: HeaderMap,
    JsonBody(body): JsonBody<CommitBody>,
) -> Result<Json<Value>, ApiError> {
    require(&headers, &app, Need::Admin)?;
    path_agent_id(&agent_id)?;
    let sealed = app
        .import_step(ImportStep::Commit {
            agent_id: agent_id.clone(),
            head: body.head,
            sealed: Vec::new(),
        })
        .await?;
    let status = app.with_agent(&agent_id, |state| state.status())?;
    Ok(Json(json!({"agent": status, "sealed": sealed})))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TombstoneBody {
    reason: String,
    source_sha256: String,
}

/// `POST /v1/agents/:id/import/tombstone` (admin): the id's reference log failed
/// verification, so nothing of it is imported and the id is reserved for good (409
/// `agent_id_reserved` on create). Again, it is answered as done.
async fn tombstone(
    State(app): State<Arc<App>>,
    ApiPath(agent_id): ApiPath<String>,
    headers: HeaderMap,
    JsonBody(body): JsonBody<TombstoneBody>,
) -> Result<Json<Value>, ApiError> {
    require(&headers, &app, Need::Admin)?;
    path_agent_id(&agent_id)?;
    hex64(&body.source_sha256, "source_sha256")?;
    if body.reason.is_empty() || body.reason.len() > 1024 {
        return Err(ApiError::BadRequest("reason must be 1-1024 bytes".into()));
    }
    let tombstone = Tombstone {
        reason: body.reason,
        source_sha256: body.source_sha256.to_ascii_lowercase(),
    };
    step_and_status(
        &app,
        ImportStep::Tombstone {
            agent_id,
            tombstone,
        },
    )
    .await
}

/// `POST /v1/agents/:id/import/abort` (admin): gives up an import under way (a wrong
/// file begun, a record too large to send); its records so far are deleted on every
/// node and the id is free again, for a new import.
async fn abort(
    State(app): State<Arc<App>>,
    ApiPath(agent_id): ApiPath<String>,
    headers: HeaderMap,
) -> Result<Json<Value>, ApiError> {
    require(&headers, &app, Need::Admin)?;
    path_agent_id(&agent_id)?;
    step_and_status(&app, ImportStep::Abort { agent_id }).await
}
