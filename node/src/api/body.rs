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

/// A JSON body. `LIMIT` is the body limit of the routes it serves, for the 413 message:
/// routes with a larger `DefaultBodyLimit` (the Raft routes) name theirs here too.
pub struct JsonBody<T, const LIMIT: usize = MAX_BODY_BYTES>(pub T);

impl<S, T, const LIMIT: usize> FromRequest<S> for JsonBody<T, LIMIT>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, ApiError> {
        let bytes = json_bytes::<S, LIMIT>(request, state).await?;
        parse(&bytes).map(JsonBody)
    }
}

/// The bytes of a JSON request body: the content type checked, the size limited.
pub async fn json_bytes<S: Send + Sync, const LIMIT: usize>(
    request: Request,
    state: &S,
) -> Result<Bytes, ApiError> {
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
    bytes_within::<S, LIMIT>(request, state).await
}

/// A body of any content type, as bytes, with the API's JSON errors (axum's own `Bytes`
/// answers an oversized body with a plain-text 413).
pub struct RawBody(pub Bytes);

impl<S: Send + Sync> FromRequest<S> for RawBody {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, ApiError> {
        bytes_within::<S, MAX_BODY_BYTES>(request, state)
            .await
            .map(RawBody)
    }
}

/// The body's bytes, within the route's body limit (`LIMIT` names it in the 413).
async fn bytes_within<S: Send + Sync, const LIMIT: usize>(
    request: Request,
    state: &S,
) -> Result<Bytes, ApiError> {
    Bytes::from_request(request, state)
        .await
        .map_err(|rejection| {
            if rejection.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::BodyTooLarge(LIMIT)
            } else {
                ApiError::BadRequest(format!("cannot read request body: {rejection}"))
            }
        })
}

/// Parses a JSON body, telling syntax errors from shape errors.
pub fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(bytes).map_err(|e| match e.classify() {
        serde_json::error::Category::Data => ApiError::InvalidBody(e.to_string()),
        _ => ApiError::MalformedJson(e.to_string()),
    })
}

#[cfg(test)]
mod tests {
    use axum::extract::DefaultBodyLimit;
    use axum::http::StatusCode;
    use axum::routing::post;
    use axum::Router;
    use serde_json::Value;
    use tower::ServiceExt;

    use super::*;

    async fn accept(JsonBody(_): JsonBody<Value, 64>) -> &'static str {
        "ok"
    }

    #[tokio::test]
    async fn an_oversized_body_is_refused_with_the_limit_of_its_route() {
        let app = Router::new()
            .route("/", post(accept))
            .layer(DefaultBodyLimit::max(64));
        let send = |body: String| {
            let request = axum::http::Request::post("/")
                .header(CONTENT_TYPE, "application/json")
                .body(axum::body::Body::from(body))
                .expect("request");
            app.clone().oneshot(request)
        };
        let fits = send(format!("\"{}\"", "x".repeat(62)))
            .await
            .expect("answer");
        assert_eq!(fits.status(), StatusCode::OK);
        let over = send(format!("\"{}\"", "x".repeat(63)))
            .await
            .expect("answer");
        assert_eq!(over.status(), StatusCode::PAYLOAD_TOO_LARGE);
        let body = axum::body::to_bytes(over.into_body(), 1024)
            .await
            .expect("body");
        let body: Value = serde_json::from_slice(&body).expect("JSON error");
        assert_eq!(body["code"], "body_too_large");
        assert_eq!(body["error"], "request body is larger than 64 bytes");
    }
}
