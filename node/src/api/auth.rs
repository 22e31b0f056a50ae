//! Bearer tokens: the admin token, or an agent token that acts only as its agent.

use axum::http::HeaderMap;
use lineage_core::token;

use super::error::ApiError;
use crate::keys::ClusterKeys;

pub enum Caller {
    Admin,
    Agent(String),
}

/// Who the `Authorization: Bearer <token>` header speaks for. `Bearer ` is
/// case-sensitive with one space; the token is trimmed.
pub fn caller(headers: &HeaderMap, keys: &ClusterKeys) -> Result<Caller, ApiError> {
    let value = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .ok_or(ApiError::Unauthorized)?;
    let presented = value
        .strip_prefix("Bearer ")
        .ok_or(ApiError::Unauthorized)?
        .trim();
    if token::secrets_equal(presented.as_bytes(), keys.admin_token.as_bytes()) {
        return Ok(Caller::Admin);
    }
    token::verify(&keys.token_key, presented)
        .map(Caller::Agent)
        .ok_or(ApiError::Unauthorized)
}

pub fn require_admin(headers: &HeaderMap, keys: &ClusterKeys) -> Result<(), ApiError> {
    match caller(headers, keys)? {
        Caller::Admin => Ok(()),
        Caller::Agent(_) => Err(ApiError::Forbidden),
    }
}

/// The admin, or the agent itself. Returns whether the caller is the admin.
pub fn require_agent_or_admin(
    headers: &HeaderMap,
    keys: &ClusterKeys,
    agent_id: &str,
) -> Result<bool, ApiError> {
    match caller(headers, keys)? {
        Caller::Admin => Ok(true),
        Caller::Agent(id) if id == agent_id => Ok(false),
        Caller::Agent(_) => Err(ApiError::Forbidden),
    }
}

/// `agent_id` must be 1–64 characters of `[A-Za-z0-9_-]`.
fn is_valid_agent_id(agent_id: &str) -> bool {
    (1..=64).contains(&agent_id.len())
        && agent_id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// An id a new agent is to get (in a request body): a malformed one is a bad request.
pub fn validate_agent_id(agent_id: &str) -> Result<(), ApiError> {
    if is_valid_agent_id(agent_id) {
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
    if is_valid_agent_id(agent_id) {
        Ok(())
    } else {
        Err(ApiError::agent_not_found())
    }
}
