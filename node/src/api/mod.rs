//! The HTTP API for agents and operators (`agents`), its auth, body parsing, errors,
//! and the layer that routes every `/v1` request to the leader (`forward`).

pub mod agents;
pub mod auth;
pub mod body;
pub mod error;
pub mod forward;
pub mod idempotency;
pub mod import;
pub mod metrics_http;
pub mod openapi;
pub mod operators;
pub mod path;
pub mod query;
pub mod route_book;
pub mod transparency;

use std::sync::Arc;

use axum::extract::DefaultBodyLimit;
use axum::http::{Method, Uri};
use axum::routing::{get, post};
use axum::Router;

use crate::app::App;
use error::ApiError;
use route_book::RouteBook;

/// The routes answered by the leader (`forward` sends them there): the agent and
/// operator API, transparency, cluster membership.
fn leader_routes() -> RouteBook {
    use agents::*;
    const GET: &[Method] = &[Method::GET];
    const POST: &[Method] = &[Method::POST];
    RouteBook::default()
        .route("/v1/public-key", GET, get(public_key))
        .route(
            "/v1/agents",
            &[Method::GET, Method::POST],
            post(create_agent).get(list_agents),
        )
        .route("/v1/agents/{id}", GET, get(agent_status))
        .route("/v1/agents/{id}/token", GET, get(agent_token))
        .route("/v1/agents/{id}/token/reissue", POST, post(reissue_token))
        .route("/v1/agents/{id}/actions", POST, post(request_action))
        .route("/v1/agents/{id}/actions/pending", GET, get(pending_actions))
        .route("/v1/actions/pending", GET, get(all_pending_actions))
        .route("/v1/agents/{id}/actions/{action_id}", GET, get(get_action))
        .route(
            "/v1/agents/{id}/actions/{action_id}/outcome",
            POST,
            post(report_outcome),
        )
        .route(
            "/v1/agents/{id}/actions/{action_id}/approve",
            POST,
            post(approve_action),
        )
        .route(
            "/v1/agents/{id}/actions/{action_id}/reject",
            POST,
            post(reject_action),
        )
        .route("/v1/agents/{id}/scars", POST, post(add_scar))
        .route("/v1/agents/{id}/terminate", POST, post(terminate))
        .route("/v1/agents/{id}/log", GET, get(agent_log))
        .route("/v1/agents/{id}/verify", GET, get(verify_agent))
        .route("/v1/agents/{id}/proof/inclusion", GET, get(inclusion_proof))
        .route(
            "/v1/agents/{id}/proof/consistency",
            GET,
            get(consistency_proof),
        )
        .route(
            "/v1/agents/{id}/head-proof",
            GET,
            get(transparency::head_proof),
        )
        .route("/v1/transparency/vkey", GET, get(transparency::vkey))
        .route(
            "/v1/transparency/checkpoint",
            GET,
            get(transparency::checkpoint),
        )
        .route(
            "/v1/transparency/checkpoint/witnessed",
            &[Method::GET, Method::POST],
            get(transparency::witnessed).post(transparency::store_witnessed),
        )
        .route(
            "/v1/transparency/proof/consistency",
            GET,
            get(transparency::consistency),
        )
        .route("/v1/transparency/leaves", GET, get(transparency::leaves))
        .merge(crate::network::management::cluster_routes())
        .merge(operators::routes())
        .merge(import::routes())
}

/// The routes every node answers itself: health, the API reference, the console,
/// metrics.
fn local_routes() -> RouteBook {
    RouteBook::default()
        .merge(crate::network::management::health_routes())
        // Public and the same on every node: never forwarded.
        .route("/v1/openapi.json", &[Method::GET], get(openapi::serve))
        .merge(crate::console::routes())
        .route("/metrics", &[Method::GET], get(metrics_http::serve))
}

/// Every (method, path) a node serves, node-to-node Raft routes included.
pub fn route_table() -> Vec<(Method, &'static str)> {
    [
        leader_routes(),
        local_routes(),
        crate::network::raft_routes::routes(),
    ]
    .iter()
    .flat_map(|book| book.served().iter().cloned())
    .collect()
}

/// The leader-routed routes merged with the local, health and Raft routes.
pub fn router(app: Arc<App>) -> Router {
    // Layers run outside in: forward (on a follower) first, then the token check on
    // the node that serves the request.
    let leader = leader_routes()
        .into_router()
        .route_layer(axum::middleware::from_fn_with_state(
            app.clone(),
            auth::principal_before_body,
        ))
        .route_layer(axum::middleware::from_fn_with_state(
            app.clone(),
            forward::route_to_leader,
        ));
    Router::new()
        .merge(leader)
        .merge(local_routes().into_router())
        .merge(crate::network::raft_routes::router(app.clone()))
        .fallback(unknown_route)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(body::MAX_BODY_BYTES))
        .layer(axum::middleware::from_fn_with_state(
            app.clone(),
            metrics_http::track,
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
