//! Incoming Raft RPCs. Every request must carry the cluster secret.

use std::sync::Arc;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use lineage_core::token::secrets_equal;
use openraft::raft::{AppendEntriesRequest, InstallSnapshotRequest, VoteRequest};

use super::raft_client::CLUSTER_SECRET_HEADER;
use crate::api::body::JsonBody;
use crate::api::error::ApiError;
use crate::app::App;
use crate::raft_types::{NodeId, TypeConfig};

pub fn routes() -> Router<Arc<App>> {
    Router::new()
        .route("/raft/append", post(append))
        .route("/raft/vote", post(vote))
        .route("/raft/snapshot", post(snapshot))
}

fn authenticate(app: &App, headers: &HeaderMap) -> Result<(), ApiError> {
    let presented = headers
        .get(CLUSTER_SECRET_HEADER)
        .map(|v| v.as_bytes())
        .unwrap_or_default();
    if secrets_equal(presented, app.keys.cluster_secret.as_bytes()) {
        Ok(())
    } else {
        Err(ApiError::Unauthorized)
    }
}

async fn append(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    JsonBody(request): JsonBody<AppendEntriesRequest<TypeConfig>>,
) -> Response {
    if let Err(e) = authenticate(&app, &headers) {
        return e.into_response();
    }
    Json(app.raft.append_entries(request).await).into_response()
}

async fn vote(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    JsonBody(request): JsonBody<VoteRequest<NodeId>>,
) -> Response {
    if let Err(e) = authenticate(&app, &headers) {
        return e.into_response();
    }
    Json(app.raft.vote(request).await).into_response()
}

async fn snapshot(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    JsonBody(request): JsonBody<InstallSnapshotRequest<TypeConfig>>,
) -> Response {
    if let Err(e) = authenticate(&app, &headers) {
        return e.into_response();
    }
    Json(app.raft.install_snapshot(request).await).into_response()
}
