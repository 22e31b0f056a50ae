//! Idempotency keys bound to their request. A stored answer is returned only to the same
//! caller kind (agent or operator) sending the same request (method, path, JSON body)
//! under the same key; the same key with another request is refused (422), so a key can
//! never hand an agent's old decision to an operator's terminate, or one tool's answer to
//! another tool's call.

use axum::extract::{FromRequest, Request};
use axum::http::HeaderMap;
use lineage_core::canonical;
use serde::de::DeserializeOwned;
use serde_json::Value;
use sha2::{Digest, Sha256};

use super::body::{json_bytes, parse, MAX_BODY_BYTES};
use super::error::ApiError;
pub use crate::idempotency_key::IdempotencyKey;

/// The longest Idempotency-Key accepted, in bytes.
const MAX_KEY_BYTES: usize = 255;

/// A write's JSON body, and the digest of the whole request when it carries an
/// Idempotency-Key (computed only then).
pub struct WriteBody<T> {
    pub body: T,
    request: Option<String>,
}

impl<S, T> FromRequest<S> for WriteBody<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, ApiError> {
        let keyed = request.headers().contains_key("idempotency-key");
        let target = format!("{} {}", request.method(), request.uri().path());
        let bytes = json_bytes::<S, MAX_BODY_BYTES>(request, state).await?;
        let body = parse(&bytes)?;
        let request = if keyed {
            // Parsed a second time only for keyed writes: the digest is over the body's
            // canonical JSON, so a retry that spells the same JSON differently matches.
            let value: Value = parse(&bytes)?;
            Some(request_digest(&target, &value))
        } else {
            None
        };
        Ok(WriteBody { body, request })
    }
}

/// SHA-256 over `METHOD path`, a newline and the body's canonical JSON, as hex.
fn request_digest(target: &str, body: &Value) -> String {
    let mut hasher = Sha256::new();
    hasher.update(target.as_bytes());
    hasher.update(b"\n");
    hasher.update(canonical::to_string(body).as_bytes());
    hex::encode(hasher.finalize())
}

/// Who sent a write. Agents, the shared admin token and each named operator keep
/// their keys apart.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Caller {
    Agent,
    Operator,
    NamedOperator(String),
}

impl<T> WriteBody<T> {
    /// The body, and the request's Idempotency-Key (if sent) bound to this request and
    /// to `caller`'s namespace.
    pub fn keyed(
        self,
        headers: &HeaderMap,
        caller: Caller,
    ) -> Result<(T, Option<IdempotencyKey>), ApiError> {
        let key = IdempotencyKey::from_request(headers, caller, self.request)?;
        Ok((self.body, key))
    }
}

impl IdempotencyKey {
    /// The request's key, if it sent one (checked: 1-255 visible ASCII characters).
    fn from_request(
        headers: &HeaderMap,
        caller: Caller,
        request: Option<String>,
    ) -> Result<Option<Self>, ApiError> {
        let Some(value) = headers.get("idempotency-key") else {
            return Ok(None);
        };
        let key = value
            .to_str()
            .map_err(|_| ApiError::BadRequest("Idempotency-Key must be visible ASCII".into()))?;
        if key.is_empty() || key.len() > MAX_KEY_BYTES || key.contains(['\n', '\r']) {
            return Err(ApiError::BadRequest(
                "Idempotency-Key must be 1-255 characters".into(),
            ));
        }
        let request = request
            .ok_or_else(|| ApiError::Internal("keyed write without a request digest".into()))?;
        let (scoped, unscoped) = match caller {
            Caller::Agent => (key.to_string(), None),
            Caller::Operator => (format!("operator\n{key}"), Some(key.to_string())),
            // Names are [a-z0-9_-]: never "operator\n…" nor a header value.
            Caller::NamedOperator(name) => (format!("operator:{name}\n{key}"), None),
        };
        Ok(Some(IdempotencyKey {
            scoped,
            request,
            unscoped,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_digest_binds_route_and_body_but_not_spelling() {
        let a = request_digest(
            "POST /v1/agents/bot/actions",
            &json!({"tool":"s","input":{"x":1}}),
        );
        let spelled: Value = serde_json::from_str(r#"{ "input" : {"x":1}, "tool":"s" }"#).unwrap();
        assert_eq!(a, request_digest("POST /v1/agents/bot/actions", &spelled));
        assert_ne!(
            a,
            request_digest(
                "POST /v1/agents/bot/actions",
                &json!({"tool":"t","input":{"x":1}})
            )
        );
        assert_ne!(
            a,
            request_digest(
                "POST /v1/agents/bot/terminate",
                &json!({"tool":"s","input":{"x":1}})
            )
        );
        assert_ne!(
            a,
            request_digest(
                "POST /v1/agents/bot2/actions",
                &json!({"tool":"s","input":{"x":1}})
            )
        );
    }
}
