//! The heads log over HTTP: its verifier key, signed and witnessed checkpoints, proofs,
//! leaves, and each agent's latest head with its inclusion proof. Readable without a
//! token, like the public key; only storing a cosigned checkpoint needs the admin token.

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use axum::Json;
use lineage_core::heads::{HeadProof, HeadStatement};
use lineage_core::transparency::{self, Checkpoint, NoteSigner};
use serde_json::{json, Value};

use super::agents::{b64, query_numbers};
use super::auth::{path_agent_id, require, Need};
use super::body::RawBody;
use super::error::ApiError;
use super::path::ApiPath;
use super::query::Query;
use crate::app::App;
use crate::raft_types::{ApplyOutcome, Proposal};
use crate::store::heads::MAX_WITNESSED_NOTE;

type Result<T> = std::result::Result<T, ApiError>;

/// Most leaves one `leaves` request returns.
pub const MAX_LEAVES_PER_PAGE: u64 = 1000;

fn text(body: String) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], body).into_response()
}

/// The origin every replica signs under: the one the first round fixed, else this
/// node's configured name.
fn origin(app: &App) -> String {
    app.sm
        .read_data()
        .heads
        .origin
        .clone()
        .unwrap_or_else(|| app.heads_origin.clone())
}

fn signer(app: &App) -> Result<NoteSigner> {
    NoteSigner::new(&origin(app), &app.keys.audit).map_err(|e| ApiError::Internal(e.to_string()))
}

/// The heads checkpoint at `size`, signed (deterministically) by the cluster key.
fn signed_checkpoint(app: &App, size: u64) -> Result<String> {
    let root = app
        .sm
        .read_heads_tree(|view| transparency::root_at(&view.tree, size))
        .map_err(ApiError::Internal)?
        .map_err(|e| ApiError::BadRequest(e.to_string()))?;
    Checkpoint {
        origin: origin(app),
        size,
        root,
    }
    .sign(&app.keys.audit)
    .map_err(|e| ApiError::Internal(e.to_string()))
}

/// `GET /v1/transparency/vkey`: the note verifier key for the heads checkpoints.
pub async fn vkey(State(app): State<Arc<App>>) -> Result<Response> {
    Ok(text(format!("{}\n", signer(&app)?.vkey())))
}

/// `GET /v1/transparency/checkpoint`: the latest round's checkpoint (size 0 before any).
pub async fn checkpoint(State(app): State<Arc<App>>) -> Result<Response> {
    let size = app.sm.read_data().heads.last_round.unwrap_or(0);
    Ok(text(signed_checkpoint(&app, size)?))
}

/// `GET /v1/transparency/checkpoint/witnessed`: the latest cosigned checkpoint.
pub async fn witnessed(State(app): State<Arc<App>>) -> Result<Response> {
    let note = app.sm.read_data().heads.witnessed.clone();
    note.map(text)
        .ok_or_else(|| ApiError::NotFound("no checkpoint has been witnessed yet".into()))
}

/// `POST /v1/transparency/checkpoint/witnessed` (admin): stores a cosigned checkpoint of
/// this log, replicated like everything else, so any node serves it to auditors.
pub async fn store_witnessed(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    RawBody(body): RawBody,
) -> Result<Json<Value>> {
    require(&headers, &app, Need::Publish)?;
    if body.len() > MAX_WITNESSED_NOTE {
        return Err(ApiError::BodyTooLarge(MAX_WITNESSED_NOTE));
    }
    let note = String::from_utf8(body.to_vec())
        .map_err(|_| ApiError::BadRequest("the note is not UTF-8".into()))?;
    // Checked here, by the leader before it proposes, not in apply: nodes may be
    // configured with different witnesses, and apply must be the same everywhere.
    let log_vkey = lineage_core::heads::log_vkey(&origin(&app), app.keys.audit.public_key_hex())
        .map_err(|e| ApiError::Internal(e.to_string()))?;
    app.witnesses
        .check(&note, &log_vkey)
        .map_err(|e| ApiError::BadRequest(format!("witnessed checkpoint refused: {e}")))?;
    app.check_disk()?;
    let response = app
        .raft
        .client_write(Proposal::Witnessed { note })
        .await
        .map_err(|e| ApiError::unavailable(format!("not stored: {e}")))?;
    match response.data.0.first() {
        Some(ApplyOutcome::Applied) => Ok(Json(json!({"stored": true}))),
        Some(ApplyOutcome::Rejected(reason)) => Err(ApiError::Rejected(reason.clone())),
        None => Err(ApiError::Internal("no outcome".into())),
    }
}

/// `GET /v1/transparency/proof/consistency?old=M&size=N`.
pub async fn consistency(State(app): State<Arc<App>>, query: Query) -> Result<Json<Value>> {
    let [old, size] = query_numbers(&query, &["old", "size"])?[..] else {
        return Err(ApiError::Internal("query parsing".into()));
    };
    let (proof, old_root, root) = app
        .sm
        .read_heads_tree(|view| {
            let proof = transparency::consistency_proof_at(&view.tree, old, size)?;
            let old_root = transparency::root_at(&view.tree, old)?;
            Ok((proof, old_root, transparency::root_at(&view.tree, size)?))
        })
        .map_err(ApiError::Internal)?
        .map_err(|e: transparency::TransparencyError| ApiError::BadRequest(e.to_string()))?;
    Ok(Json(json!({
        "old": old,
        "size": size,
        "old_root": b64(&old_root),
        "root": b64(&root),
        "proof": proof.iter().map(b64).collect::<Vec<_>>(),
    })))
}

/// `GET /v1/transparency/leaves?start=S&end=E`: head statements `S..E` (at most
/// [`MAX_LEAVES_PER_PAGE`]; fewer means "ask again from where this stopped").
pub async fn leaves(State(app): State<Arc<App>>, query: Query) -> Result<Json<Value>> {
    let [start, end] = query_numbers(&query, &["start", "end"])?[..] else {
        return Err(ApiError::Internal("query parsing".into()));
    };
    let size = app.sm.read_data().heads.tree.size();
    if start > end || end > size {
        return Err(ApiError::BadRequest(format!(
            "need start <= end <= {size} (the heads log's size)"
        )));
    }
    let end = end.min(start.saturating_add(MAX_LEAVES_PER_PAGE));
    let leaves = app
        .sm
        .heads_leaves(start, end)
        .map_err(ApiError::Internal)?;
    let statements = leaves
        .iter()
        .map(|leaf| HeadStatement::from_leaf(leaf))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| ApiError::Internal(format!("stored heads leaf: {e}")))?;
    Ok(Json(json!({"start": start, "leaves": statements})))
}

/// `GET /v1/agents/:id/head-proof[?size=N][&before=I]`: the agent's latest head
/// statement (with index below I, default N) in the heads tree of size N (default: the
/// latest round), its index and inclusion proof, and the signed checkpoint of size N.
pub async fn head_proof(
    State(app): State<Arc<App>>,
    ApiPath(agent_id): ApiPath<String>,
    query: Query,
) -> Result<Json<Value>> {
    path_agent_id(&agent_id)?;
    let size = match query.number("size")? {
        Some(size) => size,
        None => app.sm.read_data().heads.last_round.unwrap_or(0),
    };
    // `before=I` walks back through the agent's earlier statements, still proved in
    // the tree of `size` (an auditor narrows down where a log was rewritten).
    let before = query.number("before")?.map_or(size, |b| b.min(size));
    let (index, proof) = app
        .sm
        .read_heads_tree(|view| {
            if size > view.tree.size {
                return Err(ApiError::BadRequest(format!(
                    "size must be at most {} (the heads log's size)",
                    view.tree.size
                )));
            }
            let index = view
                .statement_below(&agent_id, before)
                .map_err(ApiError::Internal)?
                .ok_or_else(|| {
                    ApiError::NotFound(format!(
                        "the agent has no head statement below index {before}"
                    ))
                })?;
            let proof = transparency::inclusion_proof_at(&view.tree, index, size)
                .map_err(|e| ApiError::Internal(e.to_string()))?;
            Ok((index, proof))
        })
        .map_err(ApiError::Internal)??;
    let leaf = app
        .sm
        .heads_leaves(index, index + 1)
        .map_err(ApiError::Internal)?;
    let statement = leaf
        .first()
        .map(|l| HeadStatement::from_leaf(l))
        .transpose()
        .map_err(|e| ApiError::Internal(format!("stored heads leaf: {e}")))?
        .ok_or_else(|| ApiError::Internal("heads leaf missing".into()))?;
    if statement.agent_id != agent_id {
        // The per-agent index pointed at another agent's leaf: damage, never a proof.
        return Err(ApiError::Internal(format!(
            "heads leaf {index} is {}'s, indexed as {agent_id}'s",
            statement.agent_id
        )));
    }
    let head_proof = HeadProof {
        statement,
        index,
        tree_size: size,
        proof: proof.iter().map(b64).collect(),
    };
    let mut body =
        serde_json::to_value(&head_proof).map_err(|e| ApiError::Internal(e.to_string()))?;
    body["checkpoint"] = Value::String(signed_checkpoint(&app, size)?);
    Ok(Json(body))
}
