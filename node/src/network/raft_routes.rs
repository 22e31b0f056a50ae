//! Incoming Raft RPCs. Every request must carry the cluster secret.

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, State};
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

/// Raft bodies may be larger than the API's: an AppendEntries always carries at least
/// one whole entry, and a batch may end with one large write. Only nodes holding the
/// cluster secret get to send one (checked before the body is read).
const MAX_RAFT_BODY_BYTES: usize = 64 * 1024 * 1024;

pub fn routes(app: Arc<App>) -> Router<Arc<App>> {
    Router::new()
        .route("/raft/append", post(append))
        .route("/raft/vote", post(vote))
        .route("/raft/snapshot", post(snapshot))
        .layer(DefaultBodyLimit::max(MAX_RAFT_BODY_BYTES))
        .route_layer(axum::middleware::from_fn_with_state(
            app,
            require_cluster_secret,
        ))
}

/// Checked before the body is even read: only nodes holding the secret speak Raft.
async fn require_cluster_secret(
    State(app): State<Arc<App>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let presented = request
        .headers()
        .get(CLUSTER_SECRET_HEADER)
        .map(|v| v.as_bytes())
        .unwrap_or_default();
    if secrets_equal(presented, app.keys.cluster_secret.as_bytes()) {
        next.run(request).await
    } else {
        ApiError::Unauthorized.into_response()
    }
}

async fn append(
    State(app): State<Arc<App>>,
    JsonBody(request): JsonBody<AppendEntriesRequest<TypeConfig>, MAX_RAFT_BODY_BYTES>,
) -> Response {
    Json(app.raft.append_entries(request).await).into_response()
}

async fn vote(
    State(app): State<Arc<App>>,
    JsonBody(request): JsonBody<VoteRequest<NodeId>, MAX_RAFT_BODY_BYTES>,
) -> Response {
    Json(app.raft.vote(request).await).into_response()
}

async fn snapshot(
    State(app): State<Arc<App>>,
    JsonBody(request): JsonBody<InstallSnapshotRequest<TypeConfig>, MAX_RAFT_BODY_BYTES>,
) -> Response {
    Json(app.raft.install_snapshot(request).await).into_response()
}
