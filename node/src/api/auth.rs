//! Bearer tokens: the shared admin token, a named operator's token (acting within its
//! role), or an agent token that acts only as its agent.

use std::pin::Pin;
use std::sync::Arc;

use axum::body::HttpBody;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use lineage_core::guard::is_agent_id;
use lineage_core::operators::{Role, BUILTIN_ADMIN};
use lineage_core::token;

use super::body::MAX_BODY_BYTES;
use super::error::ApiError;
use super::idempotency::Caller;
use crate::app::App;
use crate::raft_types::Authority;

/// Who a request's bearer token speaks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Principal {
    /// The shared admin token: every right, attributed to nobody (the reference's
    /// behaviour: records name whoever the request body names).
    SharedAdmin,
    /// A named operator (`lineage operator add`).
    Operator { name: String, role: Role },
    /// An agent, with its token's generation.
    Agent(String, u64),
}

/// What a route needs from an operator; the endpoint × role table is
/// `docs/SECURITY.md`, and `tests/roles.rs` checks every cell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// Read agents, actions, logs, verification, operators: admin, approver, auditor.
    Read,
    /// Approve or reject (without a scar): admin, approver.
    Decide,
    /// Everything else that changes the cluster, acting as an agent, agent tokens: admin.
    Admin,
    /// Store a witnessed checkpoint: admin, publisher.
    Publish,
}

impl Need {
    fn allows(self, role: Role) -> bool {
        match self {
            Need::Read => matches!(role, Role::Admin | Role::Approver | Role::Auditor),
            Need::Decide => matches!(role, Role::Admin | Role::Approver),
            Need::Admin => role == Role::Admin,
            Need::Publish => matches!(role, Role::Admin | Role::Publisher),
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Need::Read => "read",
            Need::Decide => "approve or reject",
            Need::Admin => "do this (admin only)",
            Need::Publish => "publish witnessed checkpoints",
        }
    }
}

impl Principal {
    /// The operator role, if an operator.
    pub fn role(&self) -> Option<Role> {
        match self {
            Principal::SharedAdmin => Some(Role::Admin),
            Principal::Operator { role, .. } => Some(*role),
            Principal::Agent(..) => None,
        }
    }

    /// The name records are attributed to, and the name the body claimed, kept beside
    /// it when it differs. The shared admin token names nobody, so the body's name is
    /// used as the reference does, except a named operator's: records under that name
    /// are made with that operator's token only.
    pub fn attribute(
        &self,
        app: &App,
        claimed: Option<String>,
        field: &str,
    ) -> Result<(String, Option<String>), ApiError> {
        match self {
            Principal::Operator { name, .. } => {
                let claimed = claimed.filter(|c| c != name);
                Ok((name.clone(), claimed))
            }
            Principal::SharedAdmin | Principal::Agent(..) => {
                let claimed = claimed
                    .ok_or_else(|| ApiError::InvalidBody(format!("missing field `{field}`")))?;
                if app.sm.read_data().operators.get(&claimed).is_some() {
                    return Err(ApiError::NotPermitted(format!(
                        "{claimed} is a named operator: records name {claimed} only when made \
                         with {claimed}'s own token, not the shared admin token"
                    )));
                }
                Ok((claimed, None))
            }
        }
    }

    /// What apply checks again for a write made as this caller (`Authority`): the
    /// shared admin token is never revoked through the system log, so nothing.
    pub fn authority(&self) -> Option<Authority> {
        match self {
            Principal::SharedAdmin => None,
            Principal::Operator { name, .. } => Some(Authority::Operator(name.clone())),
            Principal::Agent(_, generation) => Some(Authority::AgentGeneration(*generation)),
        }
    }

    /// The namespace of this caller's Idempotency-Keys.
    pub fn idempotency_caller(&self) -> Caller {
        match self {
            Principal::SharedAdmin => Caller::Operator,
            Principal::Operator { name, .. } => Caller::NamedOperator(name.clone()),
            Principal::Agent(..) => Caller::Agent,
        }
    }

    /// How `GET /v1/whoami` describes it.
    pub fn describe(&self) -> serde_json::Value {
        match self {
            Principal::SharedAdmin => serde_json::json!({
                "kind": "shared_admin", "name": BUILTIN_ADMIN, "role": "admin", "attributed": false,
            }),
            Principal::Operator { name, role } => serde_json::json!({
                "kind": "operator", "name": name, "role": role.as_str(), "attributed": true,
            }),
            Principal::Agent(id, _) => serde_json::json!({"kind": "agent", "agent_id": id}),
        }
    }
}

/// Every write on the node that serves it (the leader; a node for its own `/v1/node/…`
/// routes) must name a principal before its body is held. The handler checks what that
/// principal may do, as before; this only keeps a caller with no valid token from making
/// the node hold a body of up to 2 MiB on each of its connections. Reads carry
/// no body; their handlers check their own tokens (some are public).
pub async fn principal_before_body(
    State(app): State<Arc<App>>,
    request: Request,
    next: Next,
) -> Response {
    if !is_read(request.method()) {
        if let Err(refused) = principal(request.headers(), &app) {
            return refuse_unread(request, refused).await;
        }
    }
    next.run(request).await
}

/// GET and HEAD (axum answers HEAD with a route's GET handler): requests that take no
/// body and change nothing.
pub fn is_read(method: &Method) -> bool {
    method == Method::GET || method == Method::HEAD
}

/// Answers `refused` at once to a request whose body is not wanted, and reads that body
/// on to its end in the background, throwing it away a frame at a time (up to 2 MiB:
/// memory holds one frame). Closing the socket on a client still sending its body would
/// reset it before it read the answer (half of 1 MB writes got a reset, not the 401).
/// The drain is bounded in time too: once the answer is out, the accept loop takes what
/// arrives for the next request's head, and closes the connection after the header
/// timeout.
pub async fn refuse_unread(request: Request, refused: ApiError) -> Response {
    let mut body = request.into_body();
    tokio::spawn(async move {
        let mut seen = 0usize;
        while seen <= MAX_BODY_BYTES {
            match std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
                Some(Ok(frame)) => seen += frame.data_ref().map_or(0, |data| data.len()),
                Some(Err(_)) | None => break,
            }
        }
    });
    refused.into_response()
}

/// Whether the request carries a bearer token at all (valid or not).
pub fn has_bearer_token(headers: &HeaderMap) -> bool {
    headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("Bearer "))
}

/// Who the `Authorization: Bearer <token>` header speaks for. `Bearer ` is
/// case-sensitive with one space; the token is trimmed. Operators are looked up in this
/// node's applied registry: a follower that lags may accept a just-revoked token on
/// `?local=true` reads until it catches up.
pub fn principal(headers: &HeaderMap, app: &App) -> Result<Principal, ApiError> {
    let value = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .ok_or(ApiError::Unauthorized)?;
    let presented = value
        .strip_prefix("Bearer ")
        .ok_or(ApiError::Unauthorized)?
        .trim();
    if app.keys.secrets.is_admin_token(presented.as_bytes()) {
        return Ok(Principal::SharedAdmin);
    }
    let data = app.sm.read_data();
    if let Some((agent_id, generation)) = token::verify_generation(&app.keys.token_key, presented) {
        // Only the agent's current generation: an earlier one was revoked by a reissue.
        return if generation == data.operators.token_generation(&agent_id) {
            Ok(Principal::Agent(agent_id, generation))
        } else {
            Err(ApiError::Unauthorized)
        };
    }
    data.operators
        .by_token(presented)
        .map(|operator| Principal::Operator {
            name: operator.name.clone(),
            role: operator.role,
        })
        .ok_or(ApiError::Unauthorized)
}

/// An operator whose role meets `need`.
pub fn require(headers: &HeaderMap, app: &App, need: Need) -> Result<Principal, ApiError> {
    let principal = principal(headers, app)?;
    permit(&principal, need)?;
    Ok(principal)
}

/// Whether `principal` (an operator) may do what `need` says.
pub fn permit(principal: &Principal, need: Need) -> Result<(), ApiError> {
    match principal.role() {
        None => Err(ApiError::Forbidden),
        Some(role) if need.allows(role) => Ok(()),
        Some(role) => Err(ApiError::NotPermitted(format!(
            "the {} role may not {}",
            role.as_str(),
            need.describe()
        ))),
    }
}

/// The agent `agent_id` itself, or an operator whose role meets `need`.
pub fn require_agent_or(
    headers: &HeaderMap,
    app: &App,
    agent_id: &str,
    need: Need,
) -> Result<Principal, ApiError> {
    let principal = principal(headers, app)?;
    match &principal {
        Principal::Agent(id, _) if id == agent_id => Ok(principal),
        Principal::Agent(..) => Err(ApiError::Forbidden),
        _ => permit(&principal, need).map(|()| principal),
    }
}

/// An id a new agent is to get (in a request body): a malformed one is a bad request.
pub fn validate_agent_id(agent_id: &str) -> Result<(), ApiError> {
    if is_agent_id(agent_id) {
        Ok(())
    } else {
        Err(ApiError::BadRequest(
            "agent_id must be 1-64 characters of [A-Za-z0-9_-]".into(),
        ))
    }
}

/// An agent id in a path: no agent can have a malformed id, so it is not found (404),
/// as the reference answers.
pub fn path_agent_id(agent_id: &str) -> Result<(), ApiError> {
    if is_agent_id(agent_id) {
        Ok(())
    } else {
        Err(ApiError::agent_not_found())
    }
}
