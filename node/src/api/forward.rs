//! Any node accepts any request: before a `/v1` handler runs, this layer makes sure
//! this node is the confirmed leader, or relays the request to the leader unchanged.

use std::sync::Arc;

use axum::body::{to_bytes, Body};
use axum::extract::{Request, State};
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::auth::{is_read, refuse_unread};
use super::body::MAX_BODY_BYTES;
use super::error::ApiError;
use crate::app::{App, AppError, Lead};

/// Marks a request one node already forwarded, so it is never forwarded twice.
const FORWARDED_HEADER: &str = "x-lineage-forwarded";
/// Request headers the leader needs to see.
const FORWARDED_REQUEST_HEADERS: [&str; 3] = ["authorization", "content-type", "idempotency-key"];

/// Serves here when this node leads, otherwise forwards to the leader.
pub async fn route_to_leader(
    State(app): State<Arc<App>>,
    request: Request,
    next: Next,
) -> Response {
    if asks_for_local_copy(&request) && !is_read(request.method()) {
        // A write always goes through the leader; a node's own copy is only for reads.
        return ApiError::BadRequest(
            "local=true is for GET reads of this node's copy; writes always go to the leader"
                .into(),
        )
        .into_response();
    }
    if let Some(why) = app
        .state_busy()
        .filter(|_| reads_state_here(&app, &request))
    {
        // Waiting would hold this request (and a thread) until the disk answers, or
        // add to too many already waiting (`data_lock`): say so at once instead.
        return ApiError::App(AppError::SteppingBack(format!("{why}; ask another node")))
            .into_response();
    }
    if let Some(why) = app
        .disk_stalled()
        .filter(|_| serves_here_on_its_disk(&app, &request))
    {
        // Nothing can become durable here, and the cluster elects a leader without this
        // node (`disk_stall`): say so at once, so the client tries another node.
        return ApiError::App(AppError::SteppingBack(format!("{why}; ask another node")))
            .into_response();
    }
    if serves_locally(&request) {
        if let Some(reason) = app.repairing().filter(|_| asks_for_local_copy(&request)) {
            // This node's copy may lack acknowledged decisions: never serve it as is.
            return ApiError::unavailable(format!(
                "this node is being repaired from the cluster and serves no local reads: {reason}"
            ))
            .into_response();
        }
        return next.run(request).await;
    }
    // Reads are linearizable: leadership confirmed with a quorum, state caught up.
    // Writes need only know who leads: apply rejects any record that does not extend
    // the agent's head, so a decision made on stale state can never take effect.
    let lead = if is_read(request.method()) {
        app.lead().await
    } else {
        app.lead_for_write()
    };
    match lead {
        Ok(Lead::Here) => next.run(request).await,
        Ok(Lead::Forward(addr)) => {
            if request.headers().contains_key(FORWARDED_HEADER) {
                return ApiError::from(AppError::NoLeader).into_response();
            }
            if let Err(refused) = admit_body(&app, &addr, request.method(), request.headers()).await
            {
                return refuse_unread(request, refused).await;
            }
            forward(&app, &addr, request)
                .await
                .unwrap_or_else(IntoResponse::into_response)
        }
        Err(e) => ApiError::from(e).into_response(),
    }
}

/// Whether this follower reads a write's body to relay it to the leader at `addr`. A
/// token its state knows: yes. No token: 401 here, as the leader would answer. A token
/// its state does not know may still be valid on the leader (an operator added, or an
/// agent's token reissued, a moment ago, not yet applied here), or made up: the leader
/// is asked whom it speaks for (`GET /v1/whoami`, headers only), and only a token it
/// vouches for has its body read. So no body is ever held here for a token no node
/// knows, and a forged token's write gets the leader's 401 at its head, as on the
/// leader.
async fn admit_body(
    app: &App,
    addr: &str,
    method: &axum::http::Method,
    headers: &axum::http::HeaderMap,
) -> Result<(), ApiError> {
    if is_read(method) {
        return Ok(());
    }
    match super::auth::principal(headers, app) {
        Ok(_) => Ok(()),
        Err(refused) if !super::auth::has_bearer_token(headers) => Err(refused),
        Err(_) => {
            let checked = leader_vouches(app, addr, headers).await;
            let outcome = match &checked {
                Ok(()) => "vouched",
                Err(ApiError::Unauthorized) => "refused",
                Err(_) => "unanswered",
            };
            app.metrics
                .tokens_checked_with_leader
                .with_label_values(&[outcome])
                .inc();
            checked
        }
    }
}

/// How long a follower waits for the leader to say whom a token speaks for: a
/// linearizable read there, a round of heartbeats; short against the clients' own 10 s,
/// which the relay itself needs too.
const VOUCH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3);

/// Asks the leader at `addr` whether the bearer token in `headers` names a principal:
/// yes, 401 (it does not), or 503 (no answer: the client retries, on this node or
/// another).
async fn leader_vouches(
    app: &App,
    addr: &str,
    headers: &axum::http::HeaderMap,
) -> Result<(), ApiError> {
    let url = format!("{}://{addr}/v1/whoami", app.scheme);
    let mut ask = app
        .http
        .current()
        .get(url)
        .header(FORWARDED_HEADER, "1")
        .timeout(VOUCH_TIMEOUT);
    if let Some(token) = headers.get(axum::http::header::AUTHORIZATION) {
        ask = ask.header(axum::http::header::AUTHORIZATION, token.clone());
    }
    match ask.send().await {
        Ok(reply) if reply.status().is_success() => Ok(()),
        Ok(reply) if reply.status() == StatusCode::UNAUTHORIZED => Err(ApiError::Unauthorized),
        Ok(reply) => Err(ApiError::unavailable(format!(
            "this node does not know the token yet, and the leader did not vouch for it \
             (status {}); retry",
            reply.status().as_u16()
        ))),
        Err(e) => Err(ApiError::unavailable(format!(
            "this node does not know the token yet, and the leader could not be asked: {e}; retry"
        ))),
    }
}

/// What a node whose disk is stalled refuses: what it would serve itself as the leader
/// it believes it is (its reads wait for applies, its writes for fsyncs, and leadership
/// checks renew the leases that keep the others from electing), and operator actions on
/// the node itself that write (a snapshot). Local reads are served from memory; a
/// follower relays the rest, which needs no disk of its own.
fn serves_here_on_its_disk(app: &App, request: &Request) -> bool {
    if serves_locally(request) {
        return !is_read(request.method()) && !asks_for_local_copy(request);
    }
    app.raft.metrics().borrow().current_leader == Some(app.id)
}

/// Whether this node reads its own state for `request`: what it serves itself, and a
/// write it relays (its token is checked here first, `auth::principal_before_body`); a
/// read it relays is not looked at here.
fn reads_state_here(app: &App, request: &Request) -> bool {
    !is_read(request.method())
        || serves_locally(request)
        || app.raft.metrics().borrow().current_leader == Some(app.id)
}

/// Node-local answers: the public key, `?local=true` reads of a node's own copy, and
/// operator actions on the node itself (`/v1/node/…`).
fn serves_locally(request: &Request) -> bool {
    let path = request.uri().path();
    path == "/v1/public-key" || path.starts_with("/v1/node/") || asks_for_local_copy(request)
}

/// `local=true`, read by the API's one query parser (a query it refuses is not a local
/// read: it goes on to the handler, which says what is wrong with it).
fn asks_for_local_copy(request: &Request) -> bool {
    super::query::Query::parse(request.uri().query())
        .is_ok_and(|query| query.text("local") == Some("true"))
}

/// How long a forwarded request waits for the leader's answer. A write waits for its
/// commit there; a leader that cannot commit (no quorum) would otherwise hold this
/// node's connection, and the client's, indefinitely. (A write answered 503 after this
/// may still commit: its client's retry with the same Idempotency-Key gets the answer.)
const FORWARD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);
/// Operator calls that legitimately run long on the leader: adding a node waits for it
/// to catch up (the CLI allows 30 minutes), and verifying a long log takes a while.
const LONG_FORWARD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30 * 60);

fn forward_timeout(path: &str) -> std::time::Duration {
    if path.starts_with("/v1/cluster/nodes") || path.ends_with("/verify") {
        LONG_FORWARD_TIMEOUT
    } else {
        FORWARD_TIMEOUT
    }
}

async fn forward(app: &App, addr: &str, request: Request) -> Result<Response, ApiError> {
    let (parts, body) = request.into_parts();
    let path_and_query = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let url = format!("{}://{addr}{path_and_query}", app.scheme);
    // A read's handler takes no body: none is read or relayed (and it is dropped now,
    // or the connection would count as reading a body while the leader answers).
    let bytes = if is_read(&parts.method) {
        drop(body);
        axum::body::Bytes::new()
    } else {
        to_bytes(body, MAX_BODY_BYTES)
            .await
            .map_err(|_| ApiError::BodyTooLarge(MAX_BODY_BYTES))?
    };
    let mut outgoing = app
        .http
        .current()
        .request(parts.method.clone(), url)
        .header(FORWARDED_HEADER, "1")
        .timeout(forward_timeout(parts.uri.path()))
        .body(bytes);
    for name in FORWARDED_REQUEST_HEADERS {
        if let Some(value) = parts.headers.get(name) {
            outgoing = outgoing.header(name, value.clone());
        }
    }
    let reply = outgoing
        .send()
        .await
        .map_err(|e| ApiError::unavailable(format!("cannot reach the leader at {addr}: {e}")))?;
    let status = StatusCode::from_u16(reply.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let content_type = reply.headers().get("content-type").cloned();
    let body = reply
        .bytes()
        .await
        .map_err(|e| ApiError::unavailable(format!("the leader's answer was cut off: {e}")))?;
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = status;
    if let Some(value) = content_type {
        response
            .headers_mut()
            .insert(HeaderName::from_static("content-type"), value);
    }
    response.headers_mut().insert(
        HeaderName::from_static("x-lineage-served-by"),
        HeaderValue::from_str(addr).unwrap_or(HeaderValue::from_static("leader")),
    );
    Ok(response)
}
