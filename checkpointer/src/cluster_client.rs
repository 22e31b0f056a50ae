//! Reads the cluster's transparency endpoints, trying each node in turn: a node that
//! cannot be reached or answers 5xx is skipped; any other answer is the cluster's.

use std::time::Duration;

use lineage_core::heads::HeadStatement;
use serde::Deserialize;

use crate::reply_text::{text_within, MAX_CLUSTER_ANSWER_BYTES};

/// Each request's limit; a round retries next time rather than waiting longer.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// No node answered (all down, or all 5xx): try again next round.
    #[error("no cluster node answered: {0}")]
    Unreachable(String),
    /// A node answered, and refused (4xx), or the answer is malformed.
    #[error("{0}")]
    Refused(String),
}

#[derive(Clone)]
pub struct ClusterClient {
    urls: Vec<String>,
    http: reqwest::Client,
    publish_token: Option<String>,
}

/// A consistency proof as the node serves it.
#[derive(Debug, Deserialize)]
pub struct ConsistencyAnswer {
    pub proof: Vec<String>,
}

#[derive(Debug, Deserialize)]
struct LeavesAnswer {
    leaves: Vec<HeadStatement>,
}

impl ClusterClient {
    pub fn new(urls: Vec<String>, publish_token: Option<String>) -> Result<Self, String> {
        Self::with_ca(urls, publish_token, None)
    }

    /// A client for the cluster at `urls`; `https://` nodes' certificates must chain to
    /// the CA bundle (PEM) in `ca`, and to nothing else.
    pub fn with_ca(
        urls: Vec<String>,
        publish_token: Option<String>,
        ca: Option<&std::path::Path>,
    ) -> Result<Self, String> {
        if urls.is_empty() {
            return Err("at least one cluster URL is needed".into());
        }
        let mut builder = reqwest::Client::builder()
            .timeout(REQUEST_TIMEOUT)
            .use_rustls_tls()
            .tls_built_in_root_certs(false);
        if let Some(ca) = ca {
            let pem = std::fs::read(ca).map_err(|e| format!("{}: {e}", ca.display()))?;
            for certificate in reqwest::Certificate::from_pem_bundle(&pem)
                .map_err(|e| format!("{}: {e}", ca.display()))?
            {
                builder = builder.add_root_certificate(certificate);
            }
        }
        let http = builder.build().map_err(|e| format!("http client: {e}"))?;
        Ok(ClusterClient {
            urls: urls
                .into_iter()
                .map(|u| u.trim_end_matches('/').to_string())
                .collect(),
            http,
            publish_token,
        })
    }

    async fn send(
        &self,
        build: impl Fn(&str) -> reqwest::RequestBuilder,
    ) -> Result<String, FetchError> {
        let mut last = String::new();
        for base in &self.urls {
            match build(base).send().await {
                Ok(reply) if reply.status().is_server_error() => {
                    last = format!("{base}: {}", reply.status());
                }
                Ok(reply) => {
                    let status = reply.status();
                    let body = text_within(reply, MAX_CLUSTER_ANSWER_BYTES)
                        .await
                        .map_err(|e| FetchError::Unreachable(format!("{base}: {e}")))?;
                    return if status.is_success() {
                        Ok(body)
                    } else {
                        Err(FetchError::Refused(format!(
                            "{base}: {status}: {}",
                            body.trim()
                        )))
                    };
                }
                Err(e) => last = format!("{base}: {e}"),
            }
        }
        Err(FetchError::Unreachable(last))
    }

    /// A GET, with the publish token when there is one: the nodes let a caller with a
    /// valid token wait for a busy whole-log read (agents' proofs), where anonymous
    /// callers are refused at once.
    pub async fn get_text(&self, path: &str) -> Result<String, FetchError> {
        self.send(|base| {
            let request = self.http.get(format!("{base}{path}"));
            match &self.publish_token {
                Some(token) => request.bearer_auth(token),
                None => request,
            }
        })
        .await
    }

    async fn get_json<T: serde::de::DeserializeOwned>(&self, path: &str) -> Result<T, FetchError> {
        let body = self.get_text(path).await?;
        serde_json::from_str(&body)
            .map_err(|e| FetchError::Refused(format!("GET {path}: malformed answer: {e}")))
    }

    pub async fn checkpoint(&self) -> Result<String, FetchError> {
        self.get_text("/v1/transparency/checkpoint").await
    }

    pub async fn vkey(&self) -> Result<String, FetchError> {
        Ok(self
            .get_text("/v1/transparency/vkey")
            .await?
            .trim()
            .to_string())
    }

    /// Heads-log leaves `start..end`, however many pages that takes.
    pub async fn leaves(&self, start: u64, end: u64) -> Result<Vec<HeadStatement>, FetchError> {
        let mut out = Vec::new();
        let mut next = start;
        while next < end {
            let page: LeavesAnswer = self
                .get_json(&format!("/v1/transparency/leaves?start={next}&end={end}"))
                .await?;
            if page.leaves.is_empty() {
                return Err(FetchError::Refused(format!(
                    "the cluster returned no leaves from {next} below {end}"
                )));
            }
            next += page.leaves.len() as u64;
            out.extend(page.leaves);
        }
        Ok(out)
    }

    pub async fn heads_consistency(&self, old: u64, size: u64) -> Result<Vec<String>, FetchError> {
        let answer: ConsistencyAnswer = self
            .get_json(&format!(
                "/v1/transparency/proof/consistency?old={old}&size={size}"
            ))
            .await?;
        Ok(answer.proof)
    }

    pub async fn agent_consistency(
        &self,
        agent_id: &str,
        old: u64,
        size: u64,
    ) -> Result<Vec<String>, FetchError> {
        let answer: ConsistencyAnswer = self
            .get_json(&format!(
                "/v1/agents/{agent_id}/proof/consistency?old={old}&size={size}"
            ))
            .await?;
        Ok(answer.proof)
    }

    /// Stores a cosigned checkpoint in the cluster (needs a publisher or admin token).
    pub async fn store_witnessed(&self, note: &str) -> Result<(), FetchError> {
        let token = self
            .publish_token
            .as_deref()
            .ok_or_else(|| FetchError::Refused("no token to store with (--token-file)".into()))?;
        self.send(|base| {
            self.http
                .post(format!("{base}/v1/transparency/checkpoint/witnessed"))
                .bearer_auth(token)
                .header("content-type", "text/plain")
                .body(note.to_string())
        })
        .await
        .map(|_| ())
    }
}
