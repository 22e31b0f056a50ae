//! One error type for the HTTP API and the single place that maps it to a status and a
//! `{"code", "error"}` body.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use lineage_core::guard::GuardError;
use serde_json::json;

use crate::app::AppError;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    BadRequest(String),
    #[error("request body is not valid JSON: {0}")]
    MalformedJson(String),
    #[error("request body does not match the expected shape: {0}")]
    InvalidBody(String),
    #[error("expected a request with Content-Type: application/json")]
    UnsupportedMediaType,
    #[error("request body is larger than {0} bytes")]
    BodyTooLarge(usize),
    #[error("missing or invalid bearer token")]
    Unauthorized,
    #[error("this token may not access this resource")]
    Forbidden,
    #[error("{0}")]
    NotFound(String),
    /// The cluster refused what was sent, as stated (409).
    #[error("{0}")]
    Rejected(String),
    #[error("agent not found")]
    AgentNotFound,
    #[error("action not found")]
    ActionNotFound,
    #[error("no such route: {0}")]
    UnknownRoute(String),
    #[error("agent already exists")]
    AgentExists,
    #[error("agent log failed verification: {0}")]
    Quarantined(String),
    #[error("no leader is available right now; retry")]
    NoLeader,
    #[error("{0}")]
    Unavailable(String),
    /// A decision was made on state that was behind the log; it was not applied.
    #[error("the write was decided on stale state ({0}); retry")]
    Stale(String),
    #[error(transparent)]
    Guard(#[from] GuardError),
    /// The disk is below its reserve; nothing was recorded (507).
    #[error("{0}")]
    InsufficientStorage(String),
    /// An Idempotency-Key first used for another request (route, agent or body).
    #[error("this Idempotency-Key was already used for a different request; use a new key")]
    IdempotencyKeyReused,
    /// An operator's key that an earlier version stored an answer under, unbound.
    #[error("this Idempotency-Key was used before keys were bound to requests; check the agent's state, then use a new key")]
    IdempotencyKeyAmbiguous,
    /// The request's input cannot be stored so that every reader gets it back exactly.
    #[error("the input cannot be recorded exactly: {0}")]
    NotRepresentable(String),
    #[error("{0}")]
    Internal(String),
}

impl ApiError {
    pub fn status_and_code(&self) -> (StatusCode, &'static str) {
        match self {
            ApiError::BadRequest(_) => (StatusCode::BAD_REQUEST, "bad_request"),
            ApiError::MalformedJson(_) => (StatusCode::BAD_REQUEST, "malformed_json"),
            ApiError::InvalidBody(_) => (StatusCode::UNPROCESSABLE_ENTITY, "invalid_body"),
            ApiError::UnsupportedMediaType => {
                (StatusCode::UNSUPPORTED_MEDIA_TYPE, "unsupported_media_type")
            }
            ApiError::BodyTooLarge(_) => (StatusCode::PAYLOAD_TOO_LARGE, "body_too_large"),
            ApiError::Unauthorized => (StatusCode::UNAUTHORIZED, "unauthorized"),
            ApiError::Forbidden => (StatusCode::FORBIDDEN, "forbidden"),
            ApiError::AgentNotFound | ApiError::ActionNotFound => {
                (StatusCode::NOT_FOUND, "not_found")
            }
            ApiError::NotFound(_) => (StatusCode::NOT_FOUND, "not_found"),
            ApiError::Rejected(_) => (StatusCode::CONFLICT, "rejected"),
            ApiError::UnknownRoute(_) => (StatusCode::NOT_FOUND, "unknown_route"),
            ApiError::AgentExists => (StatusCode::CONFLICT, "agent_exists"),
            ApiError::Quarantined(_) => (StatusCode::SERVICE_UNAVAILABLE, "quarantined"),
            ApiError::NoLeader => (StatusCode::SERVICE_UNAVAILABLE, "no_leader"),
            ApiError::Unavailable(_) | ApiError::Stale(_) => {
                (StatusCode::SERVICE_UNAVAILABLE, "unavailable")
            }
            ApiError::Guard(e) => match e {
                GuardError::UnknownAction(_) => (StatusCode::NOT_FOUND, "unknown_action"),
                GuardError::ActionNotFound(_) => (StatusCode::NOT_FOUND, "not_found"),
                GuardError::InvalidState { .. } => (StatusCode::CONFLICT, "invalid_state"),
                GuardError::AlreadyTerminated(_) => (StatusCode::CONFLICT, "already_terminated"),
                GuardError::AgentExists => (StatusCode::CONFLICT, "agent_exists"),
                GuardError::InputTooDeep { .. } => (StatusCode::BAD_REQUEST, "bad_request"),
                GuardError::NoPolicy => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
            },
            ApiError::InsufficientStorage(_) => {
                (StatusCode::INSUFFICIENT_STORAGE, "insufficient_storage")
            }
            ApiError::IdempotencyKeyReused => {
                (StatusCode::UNPROCESSABLE_ENTITY, "idempotency_key_reused")
            }
            ApiError::IdempotencyKeyAmbiguous => {
                (StatusCode::CONFLICT, "idempotency_key_ambiguous")
            }
            ApiError::NotRepresentable(_) => {
                (StatusCode::UNPROCESSABLE_ENTITY, "input_not_representable")
            }
            ApiError::Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        }
    }
}

impl From<AppError> for ApiError {
    fn from(error: AppError) -> Self {
        match error {
            AppError::AgentNotFound => ApiError::AgentNotFound,
            AppError::AgentExists => ApiError::AgentExists,
            AppError::Quarantined(reason) => ApiError::Quarantined(reason),
            AppError::NoLeader => ApiError::NoLeader,
            AppError::Unavailable(reason) => ApiError::Unavailable(reason),
            AppError::Stale(reason) => ApiError::Stale(reason),
            AppError::Guard(e) => ApiError::Guard(e),
            AppError::InsufficientStorage(reason) => ApiError::InsufficientStorage(reason),
            AppError::IdempotencyKeyReused => ApiError::IdempotencyKeyReused,
            AppError::IdempotencyKeyAmbiguous => ApiError::IdempotencyKeyAmbiguous,
            AppError::NotRepresentable(reason) => ApiError::NotRepresentable(reason),
            AppError::Internal(reason) => ApiError::Internal(reason),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, code) = self.status_and_code();
        if matches!(self, ApiError::NoLeader) {
            // Routine while an election runs (and at every start): clients retry.
            tracing::debug!(code, "request failed: no leader yet");
        } else if status.is_server_error() {
            tracing::warn!(code, error = %self, "request failed");
        }
        (
            status,
            axum::Json(json!({"code": code, "error": self.to_string()})),
        )
            .into_response()
    }
}
