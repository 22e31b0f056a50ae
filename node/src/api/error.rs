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
    /// An operator whose role does not allow the request, as stated.
    #[error("{0}")]
    NotPermitted(String),
    /// A Raft request over TLS without a member node's certificate.
    #[error("{0}")]
    NotANode(String),
    #[error("{0}")]
    NotFound(String),
    /// The cluster refused what was sent, as stated (409).
    #[error("{0}")]
    Rejected(String),
    #[error("action not found")]
    ActionNotFound,
    #[error("no such route: {0}")]
    UnknownRoute(String),
    #[error("{0}")]
    Internal(String),
    /// What the service refused or could not do (`app::AppError`).
    #[error(transparent)]
    App(#[from] AppError),
}

impl ApiError {
    /// A malformed id names no agent: the same answer as an unknown one.
    pub fn agent_not_found() -> Self {
        ApiError::App(AppError::AgentNotFound)
    }

    /// Unavailable for now (503): the client may retry.
    pub fn unavailable(reason: impl Into<String>) -> Self {
        ApiError::App(AppError::Unavailable(reason.into()))
    }

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
            ApiError::Forbidden | ApiError::NotPermitted(_) => (StatusCode::FORBIDDEN, "forbidden"),
            ApiError::NotANode(_) => (StatusCode::FORBIDDEN, "not_a_node"),
            ApiError::ActionNotFound | ApiError::NotFound(_) => {
                (StatusCode::NOT_FOUND, "not_found")
            }
            ApiError::Rejected(_) => (StatusCode::CONFLICT, "rejected"),
            ApiError::UnknownRoute(_) => (StatusCode::NOT_FOUND, "unknown_route"),
            ApiError::Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
            ApiError::App(e) => app_status_and_code(e),
        }
    }
}

/// The HTTP answer to each way the service can refuse.
fn app_status_and_code(error: &AppError) -> (StatusCode, &'static str) {
    match error {
        AppError::AgentNotFound => (StatusCode::NOT_FOUND, "not_found"),
        AppError::AgentExists => (StatusCode::CONFLICT, "agent_exists"),
        AppError::IdReserved(_) => (StatusCode::CONFLICT, "agent_id_reserved"),
        AppError::Quarantined(_) => (StatusCode::SERVICE_UNAVAILABLE, "quarantined"),
        AppError::NoLeader => (StatusCode::SERVICE_UNAVAILABLE, "no_leader"),
        AppError::Unavailable(_) | AppError::Stale(_) | AppError::SteppingBack(_) => {
            (StatusCode::SERVICE_UNAVAILABLE, "unavailable")
        }
        AppError::Guard(e) => match e {
            GuardError::UnknownAction(_) => (StatusCode::NOT_FOUND, "unknown_action"),
            GuardError::ActionNotFound(_) => (StatusCode::NOT_FOUND, "not_found"),
            GuardError::InvalidState { .. } => (StatusCode::CONFLICT, "invalid_state"),
            GuardError::AlreadyTerminated(_) => (StatusCode::CONFLICT, "already_terminated"),
            GuardError::AgentExists => (StatusCode::CONFLICT, "agent_exists"),
            GuardError::InputTooDeep { .. } => (StatusCode::BAD_REQUEST, "bad_request"),
            GuardError::InputTooLarge { .. } => (StatusCode::PAYLOAD_TOO_LARGE, "input_too_large"),
            GuardError::TooManyPendingApprovals { .. } => {
                (StatusCode::CONFLICT, "too_many_pending_approvals")
            }
            // A log imported with a genesis and no policy yet: nothing can be decided.
            GuardError::NoPolicy => (StatusCode::CONFLICT, "invalid_state"),
        },
        AppError::InsufficientStorage(_) => {
            (StatusCode::INSUFFICIENT_STORAGE, "insufficient_storage")
        }
        AppError::IdempotencyKeyReused => {
            (StatusCode::UNPROCESSABLE_ENTITY, "idempotency_key_reused")
        }
        AppError::IdempotencyKeyAmbiguous => (StatusCode::CONFLICT, "idempotency_key_ambiguous"),
        AppError::NotRepresentable(_) => {
            (StatusCode::UNPROCESSABLE_ENTITY, "input_not_representable")
        }
        AppError::TooManyRequests { .. } => (StatusCode::TOO_MANY_REQUESTS, "too_many_requests"),
        AppError::Importing(_) => (StatusCode::SERVICE_UNAVAILABLE, "importing"),
        AppError::ImportRefused(_) => (StatusCode::CONFLICT, "import_refused"),
        AppError::Operator(e) => {
            use lineage_core::operators::ChangeError;
            match e {
                ChangeError::InvalidName
                | ChangeError::InvalidTokenHash
                | ChangeError::InvalidAgentId => (StatusCode::BAD_REQUEST, "bad_request"),
                ChangeError::Reserved => (StatusCode::CONFLICT, "name_reserved"),
                ChangeError::NameTaken(_) => (StatusCode::CONFLICT, "operator_exists"),
                ChangeError::TokenInUse => (StatusCode::CONFLICT, "token_in_use"),
                ChangeError::Unknown(_) => (StatusCode::NOT_FOUND, "operator_not_found"),
                ChangeError::AlreadyRevoked(_) => (StatusCode::CONFLICT, "already_revoked"),
                ChangeError::LastAdmin(_) => (StatusCode::CONFLICT, "last_admin"),
            }
        }
        AppError::Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, code) = self.status_and_code();
        if matches!(self, ApiError::App(AppError::NoLeader)) {
            // Routine while an election runs (and at every start): clients retry.
            tracing::debug!(code, "request failed: no leader yet");
        } else if matches!(self, ApiError::App(AppError::SteppingBack(_))) {
            // One a request while a disk stalls: `disk_stall` says it once, and the log
            // may be on that disk.
            tracing::debug!(code, error = %self, "request refused: this node steps back");
        } else if status.is_server_error() {
            tracing::warn!(code, error = %self, "request failed");
        }
        let mut response = (
            status,
            axum::Json(json!({"code": code, "error": self.to_string()})),
        )
            .into_response();
        if let ApiError::App(AppError::TooManyRequests { retry_after_secs }) = self {
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from(retry_after_secs),
            );
        }
        response
    }
}
