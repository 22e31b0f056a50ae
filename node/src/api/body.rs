//! A JSON body extractor whose every failure is a precise JSON error: wrong content
//! type (415), oversized (413), not JSON (400 `malformed_json`), wrong shape or types
//! (422 `invalid_body`).

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::header::CONTENT_TYPE;
use serde::de::DeserializeOwned;

use super::error::ApiError;

/// Request bodies larger than this are refused (the reference's limit too).
pub const MAX_BODY_BYTES: usize = 2 * 1024 * 1024;

pub struct JsonBody<T>(pub T);

impl<S, T> FromRequest<S> for JsonBody<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, ApiError> {
        let is_json = request
            .headers()
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .is_some_and(|mime| {
                let mime = mime.trim().to_ascii_lowercase();
                mime == "application/json"
                    || (mime.starts_with("application/") && mime.ends_with("+json"))
            });
        if !is_json {
            return Err(ApiError::UnsupportedMediaType);
        }
        let bytes = Bytes::from_request(request, state)
            .await
            .map_err(|rejection| {
                if rejection.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
                    ApiError::BodyTooLarge(MAX_BODY_BYTES)
                } else {
                    ApiError::BadRequest(format!("cannot read request body: {rejection}"))
                }
            })?;
        parse(&bytes).map(JsonBody)
    }
}

/// Parses a JSON body, telling syntax errors from shape errors.
pub fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(bytes).map_err(|e| match e.classify() {
        serde_json::error::Category::Data => ApiError::InvalidBody(e.to_string()),
        _ => ApiError::MalformedJson(e.to_string()),
    })
}
