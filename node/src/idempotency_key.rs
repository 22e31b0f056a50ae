//! An Idempotency-Key as the write path and the state machine use it, apart from how it
//! arrives over HTTP (`api::idempotency` makes one from a request).

/// An Idempotency-Key as the state machine stores it: scoped to the caller kind, with
/// the digest of the request it was first sent with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdempotencyKey {
    /// The key in its caller's namespace: agents' keys as sent (as before), operators'
    /// behind an `operator\n` prefix. A header value cannot hold a newline, so the two
    /// namespaces never meet.
    pub scoped: String,
    /// Digest of the request (method, path, canonical body).
    pub request: String,
    /// For operators, the key as sent: where a version before the namespaces stored
    /// their answers (an unbound answer found there is refused, 409).
    pub unscoped: Option<String>,
}
