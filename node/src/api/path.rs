//! Path parameters with the API's JSON errors. axum's own `Path` answers a parameter that
//! does not percent-decode to UTF-8 (`/v1/agents/%FF`) with a plain-text 400; every
//! other error of this API is JSON with a `code`.

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use serde::de::DeserializeOwned;

use super::error::ApiError;

/// The route's path parameters, as `axum::extract::Path` reads them.
pub struct ApiPath<T>(pub T);

impl<S, T> FromRequestParts<S> for ApiPath<T>
where
    S: Send + Sync,
    T: DeserializeOwned + Send,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        axum::extract::Path::<T>::from_request_parts(parts, state)
            .await
            .map(|axum::extract::Path(value)| ApiPath(value))
            .map_err(|rejection| {
                // A parameter the route does not have is this node's own mistake.
                if rejection.status().is_server_error() {
                    ApiError::Internal(rejection.body_text())
                } else {
                    ApiError::BadRequest(rejection.body_text())
                }
            })
    }
}
