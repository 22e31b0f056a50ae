//! The HTTP API for agents and operators (`agents`), its auth, body parsing, errors,
//! and the layer that routes every `/v1` request to the leader (`forward`).

pub mod agents;
pub mod auth;
pub mod body;
pub mod error;
pub mod forward;
pub mod idempotency;
pub mod openapi;
pub mod query;
pub mod transparency;

use std::sync::Arc;

use axum::extract::DefaultBodyLimit;
use axum::http::{Method, Uri};
use axum::routing::{get, post};
use axum::Router;

use crate::app::App;
use error::ApiError;

/// The `/v1` routes (leader-routed) merged with management, health and Raft routes.
pub fn router(app: Arc<App>) -> Router {
    use agents::*;
    let v1 = Router::new()
        .route("/v1/public-key", get(public_key))
        .route("/v1/agents", post(create_agent).get(list_agents))
        .route("/v1/agents/{id}", get(agent_status))
        .route("/v1/agents/{id}/token", get(agent_token))
        .route("/v1/agents/{id}/actions", post(request_action))
        .route("/v1/agents/{id}/actions/pending", get(pending_actions))
        .route("/v1/actions/pending", get(all_pending_actions))
        .route("/v1/agents/{id}/actions/{action_id}", get(get_action))
        .route(
            "/v1/agents/{id}/actions/{action_id}/outcome",
            post(report_outcome),
        )
        .route(
            "/v1/agents/{id}/actions/{action_id}/approve",
            post(approve_action),
        )
        .route(
            "/v1/agents/{id}/actions/{action_id}/reject",
            post(reject_action),
        )
        .route("/v1/agents/{id}/scars", post(add_scar))
        .route("/v1/agents/{id}/terminate", post(terminate))
        .route("/v1/agents/{id}/log", get(agent_log))
        .route("/v1/agents/{id}/verify", get(verify_agent))
        .route("/v1/agents/{id}/proof/inclusion", get(inclusion_proof))
        .route("/v1/agents/{id}/proof/consistency", get(consistency_proof))
        .route("/v1/agents/{id}/head-proof", get(transparency::head_proof))
        .route("/v1/transparency/vkey", get(transparency::vkey))
        .route("/v1/transparency/checkpoint", get(transparency::checkpoint))
        .route(
            "/v1/transparency/checkpoint/witnessed",
            get(transparency::witnessed).post(transparency::store_witnessed),
        )
        .route(
            "/v1/transparency/proof/consistency",
            get(transparency::consistency),
        )
        .route("/v1/transparency/leaves", get(transparency::leaves))
        .merge(crate::network::management::cluster_routes())
        .route_layer(axum::middleware::from_fn_with_state(
            app.clone(),
            forward::route_to_leader,
        ));
    Router::new()
        .merge(v1)
        .merge(crate::network::management::health_routes())
        // Public and the same on every node: never forwarded.
        .route("/v1/openapi.json", get(openapi::serve))
        .merge(crate::console::routes())
        .route("/metrics", get(crate::metrics::serve))
        .merge(crate::network::raft_routes::routes(app.clone()))
        .fallback(unknown_route)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(body::MAX_BODY_BYTES))
        .layer(axum::middleware::from_fn_with_state(
            app.clone(),
            crate::metrics::track,
        ))
        .with_state(app)
}

async fn unknown_route(method: Method, uri: Uri) -> ApiError {
    ApiError::UnknownRoute(format!("{method} {}", uri.path()))
}

async fn method_not_allowed(method: Method, uri: Uri) -> axum::response::Response {
    use axum::response::IntoResponse;
    let (status, body) = (
        axum::http::StatusCode::METHOD_NOT_ALLOWED,
        axum::Json(serde_json::json!({
            "code": "method_not_allowed",
            "error": format!("{method} is not allowed on {}", uri.path()),
        })),
    );
    (status, body).into_response()
}
