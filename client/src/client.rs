//! The Rust client for Lineage Cluster: typed calls, a list of node URLs, failover, and
//! retries that never charge twice.
//!
//! Every write carries an `Idempotency-Key` chosen once per logical call and reused on
//! every retry, so a call retried on another node after a leader failure returns the
//! first answer and appends nothing. Retries happen on transport errors and on 503
//! (no leader, leadership changed), moving to the next node, until `retry_for` elapses.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use lineage_core::guard::{Action, Decision, OutcomeStatus, PendingAction, Severity, Status};
use lineage_core::{Policy, Record};
use reqwest::{Method, StatusCode};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};

/// What went wrong, precisely enough to act on.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The cluster answered with an error (`code` as in the API reference).
    #[error("{status} {code}: {message}")]
    Api {
        status: u16,
        code: String,
        message: String,
    },
    /// No node answered usefully before the retry budget ran out.
    #[error("no node answered within {after:?}; last error: {last}")]
    Unavailable { after: Duration, last: String },
    /// Nodes answered, but none had a leader before the retry budget ran out.
    #[error("no leader within {after:?}; last answer: {last}")]
    NoLeader { after: Duration, last: String },
    #[error("unexpected answer: {0}")]
    Decode(String),
    #[error("invalid client configuration: {0}")]
    Config(String),
}

/// An agent's approval queue as a node answered it.
#[derive(Debug, Clone, PartialEq)]
pub struct PendingQueue {
    pub pending: Vec<PendingAction>,
    /// Waiting actions whose request the node could not read back intact: agent,
    /// action, seq and why, never the input.
    pub unreadable: Vec<UnreadableRequest>,
}

/// A waiting action a node could not show (`unreadable` in its answer).
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
pub struct UnreadableRequest {
    pub agent_id: String,
    pub action_id: String,
    pub seq: u64,
    pub error: String,
}

pub struct Client {
    nodes: Vec<String>,
    token: String,
    http: reqwest::Client,
    /// Index of the node that answered last: the likely leader.
    preferred: AtomicUsize,
    retry_for: Duration,
    /// The CA bundle (PEM) an `https://` node's certificate must chain to; `None`: the
    /// client trusts no certificate, so it speaks plain HTTP only.
    ca: Option<Vec<u8>>,
    connect_timeout: Duration,
    answer_timeout: Duration,
}

/// An HTTP client with these waits, trusting only the certificates in `ca` (PEM).
fn http_client(
    connect: Duration,
    answer: Duration,
    ca: Option<&[u8]>,
) -> Result<reqwest::Client, ClientError> {
    let mut builder = reqwest::Client::builder()
        .connect_timeout(connect)
        .timeout(answer)
        .use_rustls_tls()
        .tls_built_in_root_certs(false);
    if let Some(pem) = ca {
        let certificates = reqwest::Certificate::from_pem_bundle(pem)
            .map_err(|e| ClientError::Config(format!("CA bundle: {e}")))?;
        if certificates.is_empty() {
            return Err(ClientError::Config(
                "CA bundle: no certificate in it".into(),
            ));
        }
        for certificate in certificates {
            builder = builder.add_root_certificate(certificate);
        }
    }
    builder
        .build()
        .map_err(|e| ClientError::Config(e.to_string()))
}

/// A fresh idempotency key: 128 random bits in hex.
pub fn new_idempotency_key() -> String {
    lineage_core::keys::random_bytes()
        .map(|b| hex::encode(&b[..16]))
        .unwrap_or_else(|_| format!("{:x}", Instant::now().elapsed().as_nanos()))
}

impl Client {
    /// A client for the nodes at `urls` (e.g. `http://127.0.0.1:9200`) using `token`
    /// (an agent token or the admin token).
    pub fn new(urls: &[String], token: &str) -> Result<Self, ClientError> {
        let nodes: Vec<String> = urls
            .iter()
            .map(|u| u.trim().trim_end_matches('/').to_string())
            .filter(|u| !u.is_empty())
            .collect();
        if nodes.is_empty() {
            return Err(ClientError::Config(
                "at least one node URL is needed".into(),
            ));
        }
        let (connect_timeout, answer_timeout) = (Duration::from_secs(2), Duration::from_secs(10));
        Ok(Client {
            nodes,
            token: token.trim().to_string(),
            http: http_client(connect_timeout, answer_timeout, None)?,
            preferred: AtomicUsize::new(0),
            retry_for: Duration::from_secs(15),
            ca: None,
            connect_timeout,
            answer_timeout,
        })
    }

    /// Trusts the CA bundle in `path` (PEM) for `https://` nodes; `None` changes nothing.
    pub fn with_ca_file(mut self, path: Option<&std::path::Path>) -> Result<Self, ClientError> {
        let Some(path) = path else {
            return Ok(self);
        };
        let pem = std::fs::read(path)
            .map_err(|e| ClientError::Config(format!("CA bundle {}: {e}", path.display())))?;
        self.http = http_client(self.connect_timeout, self.answer_timeout, Some(&pem))?;
        self.ca = Some(pem);
        Ok(self)
    }

    /// How long one logical call keeps retrying across nodes (default 15 s).
    pub fn with_retry_for(mut self, retry_for: Duration) -> Self {
        self.retry_for = retry_for;
        self
    }

    /// Waits at most `connect` to reach each node and `answer` for its answer, and keeps
    /// trying for one such wait per node, so every node gets its turn: an unreachable
    /// cluster is reported in seconds, not after 15, and a node that accepts but never
    /// answers (stopped, not dead) costs one wait before the next is asked.
    pub fn with_timeouts(
        mut self,
        connect: Duration,
        answer: Duration,
    ) -> Result<Self, ClientError> {
        let answer = answer.max(connect);
        self.http = http_client(connect, answer, self.ca.as_deref())?;
        (self.connect_timeout, self.answer_timeout) = (connect, answer);
        self.retry_for = answer * u32::try_from(self.nodes.len()).unwrap_or(u32::MAX);
        Ok(self)
    }

    /// `GET path`: the API's JSON answer as it is (admin tools print it).
    pub async fn get_json(&self, path: &str) -> Result<Value, ClientError> {
        self.call(Method::GET, path, None).await
    }

    /// `POST path` with `body` (one idempotency key for every retry): the API's answer.
    pub async fn post_json(&self, path: &str, body: Value) -> Result<Value, ClientError> {
        self.call(Method::POST, path, Some(body)).await
    }

    /// `POST path` with `json`, sent byte for byte (signed lines inside it stay exactly
    /// as they are): the API's answer.
    pub async fn post_raw_json(&self, path: &str, json: String) -> Result<Value, ClientError> {
        let text = self
            .call_text(Method::POST, path, Some(Body::Raw(json)))
            .await?;
        serde_json::from_str(&text).map_err(|e| ClientError::Decode(format!("{e}: {text}")))
    }

    async fn call<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<T, ClientError> {
        let text = self.call_text(method, path, body.map(Body::Json)).await?;
        serde_json::from_str(&text).map_err(|e| ClientError::Decode(format!("{e}: {text}")))
    }

    /// One logical call with failover and retries; the body of the first 2xx answer.
    async fn call_text(
        &self,
        method: Method,
        path: &str,
        body: Option<Body>,
    ) -> Result<String, ClientError> {
        let key = (method == Method::POST).then(new_idempotency_key);
        let start = Instant::now();
        let mut attempt = 0usize;
        let mut last = String::from("no attempt made");
        let mut last_was_no_leader = false;
        while start.elapsed() < self.retry_for {
            let index = (self.preferred.load(Ordering::Relaxed) + attempt) % self.nodes.len();
            let mut request = self
                .http
                .request(method.clone(), format!("{}{path}", self.nodes[index]))
                .bearer_auth(&self.token);
            if let Some(key) = &key {
                request = request.header("Idempotency-Key", key);
            }
            match &body {
                Some(Body::Json(body)) => request = request.json(body),
                Some(Body::Raw(text)) => {
                    request = request
                        .header(reqwest::header::CONTENT_TYPE, "application/json")
                        .body(text.clone());
                }
                None => {}
            }
            match request.send().await {
                Ok(reply) if reply.status() == StatusCode::SERVICE_UNAVAILABLE => {
                    let text = reply.text().await.unwrap_or_default();
                    let error = api_error(StatusCode::SERVICE_UNAVAILABLE, &text);
                    // No leader here, or leadership moved: another node may answer. A
                    // quarantined agent is quarantined on every node; say so at once.
                    if matches!(&error, ClientError::Api { code, .. } if code == "quarantined" || code == "importing")
                    {
                        self.preferred.store(index, Ordering::Relaxed);
                        return Err(error);
                    }
                    last = format!("{}: {text}", self.nodes[index]);
                    last_was_no_leader = true;
                }
                Ok(reply) => {
                    self.preferred.store(index, Ordering::Relaxed);
                    let status = reply.status();
                    let text = reply
                        .text()
                        .await
                        .map_err(|e| ClientError::Decode(e.to_string()))?;
                    if status.is_success() {
                        return Ok(text);
                    }
                    return Err(api_error(status, &text));
                }
                Err(e) => {
                    last = format!("{}: {}", self.nodes[index], error_chain(&e));
                    last_was_no_leader = false;
                }
            }
            attempt += 1;
            let backoff = Duration::from_millis((25 * attempt as u64).min(250));
            tokio::time::sleep(backoff).await;
        }
        let after = self.retry_for;
        Err(if last_was_no_leader {
            ClientError::NoLeader { after, last }
        } else {
            ClientError::Unavailable { after, last }
        })
    }
}

/// A request body: JSON to encode, or JSON text to send as it is.
enum Body {
    Json(Value),
    Raw(String),
}

/// An error with its causes ("error sending request: … Connection refused"), since
/// reqwest's own message alone does not say why.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// The API's error answer (`{"code", "error"}`); a body of another shape is the message.
fn api_error(status: StatusCode, text: &str) -> ClientError {
    let body: Value = serde_json::from_str(text).unwrap_or(Value::Null);
    ClientError::Api {
        status: status.as_u16(),
        code: body["code"].as_str().unwrap_or("unknown").to_string(),
        message: body["error"].as_str().unwrap_or(text).to_string(),
    }
}

impl Client {
    /// Creates an agent (admin); returns its status and token.
    pub async fn create_agent(
        &self,
        agent_id: &str,
        policy: &Policy,
    ) -> Result<(Status, String), ClientError> {
        let reply: Value = self
            .call(
                Method::POST,
                "/v1/agents",
                Some(json!({"agent_id": agent_id, "policy": policy})),
            )
            .await?;
        let status = serde_json::from_value(reply["agent"].clone())
            .map_err(|e| ClientError::Decode(e.to_string()))?;
        let token = reply["token"].as_str().unwrap_or_default().to_string();
        Ok((status, token))
    }

    /// Asks permission for an action.
    pub async fn request(
        &self,
        agent_id: &str,
        tool: &str,
        input: Value,
        cost: Option<u64>,
    ) -> Result<Decision, ClientError> {
        let mut body = json!({"tool": tool, "input": input});
        if let Some(cost) = cost {
            body["cost"] = json!(cost);
        }
        self.call(
            Method::POST,
            &format!("/v1/agents/{agent_id}/actions"),
            Some(body),
        )
        .await
    }

    pub async fn status(&self, agent_id: &str) -> Result<Status, ClientError> {
        self.call(Method::GET, &format!("/v1/agents/{agent_id}"), None)
            .await
    }

    pub async fn action(&self, agent_id: &str, action_id: &str) -> Result<Action, ClientError> {
        self.call(
            Method::GET,
            &format!("/v1/agents/{agent_id}/actions/{action_id}"),
            None,
        )
        .await
    }

    /// The agent's approval queue. A waiting action whose request the node cannot read
    /// back intact is left out: [`Client::pending_queue`] names those too.
    pub async fn pending(&self, agent_id: &str) -> Result<Vec<PendingAction>, ClientError> {
        Ok(self.pending_queue(agent_id).await?.pending)
    }

    /// The agent's approval queue, with the waiting actions the node could not show.
    pub async fn pending_queue(&self, agent_id: &str) -> Result<PendingQueue, ClientError> {
        let reply: Value = self
            .call(
                Method::GET,
                &format!("/v1/agents/{agent_id}/actions/pending"),
                None,
            )
            .await?;
        let decode = |field: &str| {
            reply
                .get(field)
                .cloned()
                .unwrap_or(Value::Array(Vec::new()))
        };
        Ok(PendingQueue {
            pending: serde_json::from_value(decode("pending"))
                .map_err(|e| ClientError::Decode(e.to_string()))?,
            unreadable: serde_json::from_value(decode("unreadable"))
                .map_err(|e| ClientError::Decode(e.to_string()))?,
        })
    }

    pub async fn report(
        &self,
        agent_id: &str,
        action_id: &str,
        status: OutcomeStatus,
        detail: &str,
    ) -> Result<Status, ClientError> {
        let path = format!("/v1/agents/{agent_id}/actions/{action_id}/outcome");
        self.call(
            Method::POST,
            &path,
            Some(json!({"status": status, "detail": detail})),
        )
        .await
    }

    pub async fn approve(
        &self,
        agent_id: &str,
        action_id: &str,
        approver: &str,
        note: Option<&str>,
    ) -> Result<Decision, ClientError> {
        let path = format!("/v1/agents/{agent_id}/actions/{action_id}/approve");
        self.call(
            Method::POST,
            &path,
            Some(json!({"approver": approver, "note": note})),
        )
        .await
    }

    pub async fn reject(
        &self,
        agent_id: &str,
        action_id: &str,
        approver: &str,
        reason: &str,
        scar: Option<Severity>,
    ) -> Result<Decision, ClientError> {
        let path = format!("/v1/agents/{agent_id}/actions/{action_id}/reject");
        self.call(
            Method::POST,
            &path,
            Some(json!({"approver": approver, "reason": reason, "scar": scar})),
        )
        .await
    }

    pub async fn scar(
        &self,
        agent_id: &str,
        severity: Severity,
        reason: &str,
        action_id: Option<&str>,
    ) -> Result<Status, ClientError> {
        let body = json!({"severity": severity, "reason": reason, "action_id": action_id});
        self.call(
            Method::POST,
            &format!("/v1/agents/{agent_id}/scars"),
            Some(body),
        )
        .await
    }

    pub async fn terminate(
        &self,
        agent_id: &str,
        reason: &str,
        by: &str,
    ) -> Result<Status, ClientError> {
        self.call(
            Method::POST,
            &format!("/v1/agents/{agent_id}/terminate"),
            Some(json!({"reason": reason, "by": by})),
        )
        .await
    }

    /// One page of an agent's signed records (seq > `after`).
    pub async fn log(
        &self,
        agent_id: &str,
        after: Option<u64>,
        limit: usize,
    ) -> Result<Vec<Record>, ClientError> {
        let mut path = format!("/v1/agents/{agent_id}/log?limit={limit}");
        if let Some(after) = after {
            path.push_str(&format!("&after={after}"));
        }
        let reply: Value = self.call(Method::GET, &path, None).await?;
        serde_json::from_value(reply["records"].clone())
            .map_err(|e| ClientError::Decode(e.to_string()))
    }

    /// `GET /v1/cluster` (admin).
    /// The latest witnessed heads checkpoint (a signed note; public).
    pub async fn witnessed_checkpoint(&self) -> Result<String, ClientError> {
        self.call_text(Method::GET, "/v1/transparency/checkpoint/witnessed", None)
            .await
    }

    /// The agent's latest head statement with index below `before`, proved in the heads
    /// tree of `size` (public).
    pub async fn head_proof(
        &self,
        agent_id: &str,
        size: u64,
        before: u64,
    ) -> Result<lineage_core::heads::HeadProof, ClientError> {
        let path = format!("/v1/agents/{agent_id}/head-proof?size={size}&before={before}");
        self.call(Method::GET, &path, None).await
    }

    pub async fn cluster(&self) -> Result<Value, ClientError> {
        self.call(Method::GET, "/v1/cluster", None).await
    }

    /// Adds a node as a learner, then (unless `learner_only`) as a voter (admin).
    pub async fn add_node(
        &self,
        id: u64,
        addr: &str,
        learner_only: bool,
    ) -> Result<Value, ClientError> {
        self.call(
            Method::POST,
            "/v1/cluster/nodes",
            Some(json!({"id": id, "addr": addr, "learner_only": learner_only})),
        )
        .await
    }

    /// Removes a node from the cluster (admin).
    pub async fn remove_node(&self, id: u64) -> Result<Value, ClientError> {
        self.call(
            Method::POST,
            "/v1/cluster/nodes/remove",
            Some(json!({"id": id})),
        )
        .await
    }
}
