//! Outgoing Raft RPCs over HTTP, authenticated with the cluster secret.

use crate::rotating_secrets::{Fingerprints, RotatingSecrets};
use lineage_client::client::error_chain;
use openraft::error::{
    InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable,
};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::{BasicNode, Entry, EntryPayload, LogId};
use serde::de::DeserializeOwned;
use serde::Serialize;

use std::sync::Arc;

use super::peer_contacts::PeerContacts;
use crate::raft_types::{AppendRecords, Batch, NodeId, Proposal, TypeConfig};
use crate::store::log_store::DurableLog;

/// The header that carries the cluster secret on node-to-node requests.
pub const CLUSTER_SECRET_HEADER: &str = "x-lineage-cluster-secret";
/// On a Raft answer: the answering node's secret fingerprints
/// (`rotating_secrets::Fingerprints::header_value`).
pub const SECRETS_HEADER: &str = "x-lineage-secret-fingerprints";
/// The hex SHA-256 of a Raft request's or answer's body, which the receiver holds the
/// body to (`raft_routes::RaftBody` for requests, `Connection::send` for answers): over
/// plain HTTP only TCP's 16-bit checksum guards the bytes, and a record changed on the
/// way would be rejected at that follower's apply alone, leaving its copy of the agent
/// behind the others' for good; an answer's changed term would depose a candidate.
pub const BODY_SHA256_HEADER: &str = "x-lineage-body-sha256";

/// What a Raft request's or answer's [`BODY_SHA256_HEADER`] says of `body`: its SHA-256, in hex.
pub fn body_digest(body: &[u8]) -> String {
    hex::encode(<sha2::Sha256 as sha2::Digest>::digest(body))
}

#[derive(Clone)]
pub struct RaftHttp {
    pub client: crate::tls::PeerClient,
    /// `http` or `https`: the cluster's scheme (a cluster is all TLS or all plain).
    pub scheme: &'static str,
    /// The cluster secret to send (the first of `cluster.secret`'s lines, re-read on
    /// SIGHUP).
    pub secrets: Arc<RotatingSecrets>,
    /// With the leader's early acknowledgement on, followers hear of commits only up to
    /// what is durable here (`log_store` docs).
    pub durable_log: Option<DurableLog>,
    /// When each peer last answered (`peer_contacts`).
    pub contacts: Arc<PeerContacts>,
    /// Whether this node's disk is held for stalled (only `disk_stall`'s monitor ever
    /// says so; `--disk-stall-ms 0` turns it off).
    pub disk: Arc<crate::disk_watch::DiskWatch>,
    /// Sends withheld because the disk was stalled, each try
    /// (`lineage_raft_replication_withheld_total`).
    pub withheld: prometheus::IntCounter,
    /// Answers refused because they did not match their stated SHA-256
    /// (`lineage_raft_answers_refused_total`: bytes changed on the way).
    pub answers_refused: prometheus::IntCounter,
    /// Answers that carried no SHA-256 (`lineage_raft_messages_without_digest_total`),
    /// refused too when `require_digests`: the peer then shows as not answering, and
    /// the one WARN of that outage says why.
    pub answers_without_digest: prometheus::IntCounter,
    /// An answer without a SHA-256 is refused (`--require-raft-digests`).
    pub require_digests: bool,
}

pub struct Connection {
    http: RaftHttp,
    target: NodeId,
    addr: String,
}

impl RaftNetworkFactory<TypeConfig> for RaftHttp {
    type Network = Connection;

    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> Connection {
        Connection {
            http: self.clone(),
            target,
            addr: node.addr.clone(),
        }
    }
}

/// The most bytes of a Raft answer this node reads: openraft's answers (a vote, a
/// conflict, an error) take a few hundred; a larger body is no node's answer.
const MAX_ANSWER_BYTES: usize = 1024 * 1024;
/// How much of an error answer is kept for the log line.
const ERROR_ANSWER_BYTES: usize = 300;

type CallError<E> = RPCError<NodeId, BasicNode, E>;

fn network_error<E: std::error::Error>(error: &(impl std::error::Error + 'static)) -> CallError<E> {
    RPCError::Network(NetworkError::new(error))
}

fn failed_call<E: std::error::Error>(why: String) -> CallError<E> {
    network_error(&std::io::Error::other(why))
}

impl Connection {
    async fn call<Req, Resp, Err>(
        &self,
        path: &str,
        request: &Req,
        option: &RPCOption,
    ) -> Result<Resp, CallError<RaftError<NodeId, Err>>>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
        Err: std::error::Error + DeserializeOwned,
    {
        // openraft times an RPC out by dropping this future, often before reqwest's own
        // timeout fires: a call that never finishes counts as a failure too.
        let mut unfinished = Unfinished {
            contacts: &self.http.contacts,
            target: self.target,
            addr: &self.addr,
            done: false,
        };
        let result = self.send(path, request, option).await;
        unfinished.done = true;
        match result {
            Ok(Ok(answer)) => {
                self.http.contacts.answered(self.target);
                Ok(answer)
            }
            Ok(Err(e)) => {
                // The peer answered, with an error of its own (openraft's line for it is
                // among those `log_noise` drops): say it here.
                self.http.contacts.answered(self.target);
                tracing::warn!(peer = self.target, error = %e, "peer answered with an error");
                Err(RPCError::RemoteError(RemoteError::new(self.target, e)))
            }
            // No answer, an error status (a refused secret or certificate, a changed
            // request), or an answer that failed its check: the peer is not usable, and
            // is shown so until a call succeeds (`peer_contacts`, which logs the first
            // failure of each outage with what the peer said).
            Err(e) => {
                self.http.contacts.failed(self.target, &self.addr, &e);
                Err(e)
            }
        }
    }

    async fn send<Req, Resp, Err>(
        &self,
        path: &str,
        request: &Req,
        option: &RPCOption,
    ) -> Result<Result<Resp, RaftError<NodeId, Err>>, CallError<RaftError<NodeId, Err>>>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
        Err: std::error::Error + DeserializeOwned,
    {
        let url = format!("{}://{}/raft/{path}", self.http.scheme, self.addr);
        let body = serde_json::to_vec(request).map_err(|e| network_error(&e))?;
        let digest = body_digest(&body);
        let response = self
            .http
            .client
            .current()
            .post(url)
            .header(
                CLUSTER_SECRET_HEADER,
                self.http.secrets.cluster_secret_to_send(),
            )
            .header(BODY_SHA256_HEADER, digest)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .timeout(option.hard_ttl())
            .body(body)
            .send()
            .await
            .map_err(|e| {
                if e.is_connect() {
                    RPCError::Unreachable(Unreachable::new(&e))
                } else {
                    network_error(&e)
                }
            })?;
        let status = response.status();
        // What the peer says it sends and accepts; a peer that refuses our secret (401)
        // says nothing, and what it said before no longer holds. A successful answer's
        // is recorded only once its body has passed its check, below.
        let fingerprints = response
            .headers()
            .get(SECRETS_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(Fingerprints::from_header);
        if !status.is_success() {
            if fingerprints.is_some() || status == reqwest::StatusCode::UNAUTHORIZED {
                self.http.contacts.secrets(self.target, fingerprints);
            }
            let (said, _) = body_prefix(response, ERROR_ANSWER_BYTES)
                .await
                .unwrap_or_default();
            let said = String::from_utf8_lossy(&said);
            return Err(failed_call(format!("peer answered {status}: {said}")));
        }
        let stated = response.headers().get(BODY_SHA256_HEADER).cloned();
        let answer = answer_within(response, MAX_ANSWER_BYTES)
            .await
            .map_err(failed_call)?;
        // An answer without the header (a build before it, during an upgrade) is read
        // as before, unless every node is known to send it.
        match stated {
            Some(stated) if stated.as_bytes() != body_digest(&answer).as_bytes() => {
                self.http.answers_refused.inc();
                return Err(failed_call(format!(
                    "the answer ({} bytes) does not match its {BODY_SHA256_HEADER}: changed on the way",
                    answer.len()
                )));
            }
            Some(_) => {}
            None => {
                self.http.answers_without_digest.inc();
                if self.http.require_digests {
                    return Err(failed_call(format!(
                        "the answer has no {BODY_SHA256_HEADER}, which --require-raft-digests \
                         requires (a node of a build before digests?)"
                    )));
                }
            }
        }
        if fingerprints.is_some() {
            self.http.contacts.secrets(self.target, fingerprints);
        }
        serde_json::from_slice(&answer).map_err(|e| network_error(&e))
    }
}

/// A successful answer's whole body, or why not: over `max` bytes, whether its stated
/// length says so (refused unread: a peer that states 4 GiB and sends nothing holds no
/// call open) or its bytes do, or cut off on the way.
async fn answer_within(response: reqwest::Response, max: usize) -> Result<Vec<u8>, String> {
    if let Some(stated) = response.content_length().filter(|&n| n > max as u64) {
        return Err(format!(
            "the peer's answer states {stated} bytes, over {max}"
        ));
    }
    match body_prefix(response, max).await {
        Ok((body, false)) => Ok(body),
        Ok((_, true)) => Err(format!("the peer's answer is over {max} bytes")),
        // With its causes ("connection reset" under reqwest's own words).
        Err(e) => Err(format!("reading the peer's answer: {}", error_chain(&e))),
    }
}

/// Up to `limit` bytes of a response's body, and whether it held more.
async fn body_prefix(
    mut response: reqwest::Response,
    limit: usize,
) -> Result<(Vec<u8>, bool), reqwest::Error> {
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await? {
        let room = limit - body.len();
        if chunk.len() > room {
            body.extend_from_slice(&chunk[..room]);
            return Ok((body, true));
        }
        body.extend_from_slice(&chunk);
    }
    Ok((body, false))
}

/// Reports an RPC whose future was dropped before it finished (openraft's timeout).
struct Unfinished<'a> {
    contacts: &'a PeerContacts,
    target: NodeId,
    addr: &'a str,
    done: bool,
}

impl Drop for Unfinished<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.contacts.failed(
                self.target,
                self.addr,
                &"no answer within openraft's timeout",
            );
        }
    }
}

/// The most record bytes one AppendEntries carries. openraft 0.9 gives an AppendEntries
/// one heartbeat interval (50 ms) before it counts as failed, and sends up to 300
/// entries at once to a follower that is behind; each entry is a whole batch of writes.
/// A follower catching up after a restart must get its entries in pieces it can parse
/// and make durable within that time (and under its body limit), or it never catches up.
const APPEND_BYTES_BUDGET: usize = 256 * 1024;

/// Keeps the leading entries that fit in `APPEND_BYTES_BUDGET` (always at least one) and
/// returns the log id of the last one kept if any were left out.
fn keep_within_budget(entries: &mut Vec<Entry<TypeConfig>>) -> Option<LogId<NodeId>> {
    let mut bytes = 0;
    let keep = entries
        .iter()
        .position(|entry| {
            bytes += entry_bytes(entry);
            bytes > APPEND_BYTES_BUDGET
        })
        .map_or(entries.len(), |over| over.max(1));
    if keep == entries.len() {
        return None;
    }
    entries.truncate(keep);
    entries.last().map(|entry| entry.log_id)
}

/// About how many bytes an entry takes in an AppendEntries body.
fn entry_bytes(entry: &Entry<TypeConfig>) -> usize {
    const FRAMING: usize = 128;
    match &entry.payload {
        EntryPayload::Normal(Proposal::Writes(Batch(appends))) => {
            FRAMING + appends.iter().map(AppendRecords::size).sum::<usize>()
        }
        EntryPayload::Normal(Proposal::Witnessed { note }) => FRAMING + note.len(),
        _ => FRAMING,
    }
}

impl Connection {
    /// A node that steps back from a stalled disk sends no entries and no snapshot chunk
    /// (the peer is treated as unreachable, and openraft backs off and retries). Its
    /// heartbeats are off already (`disk_stall`), but a catch-up or snapshot stream to a
    /// lagging follower would go on renewing that follower's lease, and with it hold off
    /// the election that lets the others serve, for as long as the stream lasts. Nothing
    /// withheld was acknowledged on its account: an entry not yet on a majority was never
    /// committed, and one that was is on every majority a new leader is elected from.
    fn withhold_if_stalled<E>(&self) -> Result<(), RPCError<NodeId, BasicNode, E>>
    where
        E: std::error::Error,
    {
        if !self.http.disk.stalled() {
            return Ok(());
        }
        self.http.withheld.inc();
        Err(RPCError::Unreachable(Unreachable::new(
            &std::io::Error::other(
                "this node's disk is stalled: it sends no entries until the disk answers",
            ),
        )))
    }
}

impl RaftNetwork<TypeConfig> for Connection {
    async fn append_entries(
        &mut self,
        mut request: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        self.withhold_if_stalled()?;
        if let Some(durable) = &self.http.durable_log {
            request.leader_commit = durable.clamp_commit(request.leader_commit);
        }
        let sent_only_up_to = keep_within_budget(&mut request.entries);
        let response = self.call("append", &request, &option).await?;
        Ok(match (response, sent_only_up_to) {
            // The follower has what was sent: openraft sends the rest next.
            (AppendEntriesResponse::Success, Some(last)) => {
                AppendEntriesResponse::PartialSuccess(Some(last))
            }
            (response, _) => response,
        })
    }

    async fn install_snapshot(
        &mut self,
        request: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<
        InstallSnapshotResponse<NodeId>,
        RPCError<NodeId, BasicNode, RaftError<NodeId, InstallSnapshotError>>,
    > {
        self.withhold_if_stalled()?;
        self.call("snapshot", &request, &option).await
    }

    async fn vote(
        &mut self,
        request: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> Result<VoteResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        self.call("vote", &request, &option).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use openraft::testing::log_id;
    use std::time::Duration;

    fn entry(index: u64, note_bytes: usize) -> Entry<TypeConfig> {
        Entry {
            log_id: log_id(1, 1, index),
            payload: EntryPayload::Normal(Proposal::Witnessed {
                note: "x".repeat(note_bytes),
            }),
        }
    }

    #[test]
    fn an_append_keeps_the_entries_that_fit_and_always_one() {
        let mut small: Vec<_> = (1..=10).map(|i| entry(i, 1000)).collect();
        assert_eq!(keep_within_budget(&mut small), None);
        assert_eq!(small.len(), 10);

        let mut large: Vec<_> = (1..=10)
            .map(|i| entry(i, APPEND_BYTES_BUDGET / 4))
            .collect();
        assert_eq!(keep_within_budget(&mut large), Some(log_id(1, 1, 3)));
        assert_eq!(large.len(), 3);

        let mut huge: Vec<_> = (1..=3).map(|i| entry(i, APPEND_BYTES_BUDGET * 2)).collect();
        assert_eq!(keep_within_budget(&mut huge), Some(log_id(1, 1, 1)));
        assert_eq!(huge.len(), 1);

        let mut empty = Vec::new();
        assert_eq!(keep_within_budget(&mut empty), None);

        let writes = Entry {
            log_id: log_id(1, 1, 1),
            payload: EntryPayload::Normal(Proposal::Writes(Batch(Arc::new(vec![AppendRecords {
                agent_id: "bot".into(),
                records: Vec::new(),
                idempotency: None,
                authority: None,
            }])))),
        };
        assert!(entry_bytes(&writes) > 0);
    }

    /// A peer on loopback that answers one request with `head` and then `body`, and
    /// keeps the connection open until the caller drops it.
    async fn peer_answering(head: &'static str, body: Vec<u8>) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut request = Vec::new();
            let mut buf = [0u8; 1024];
            while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = stream.read(&mut buf).await.unwrap();
                assert!(n > 0, "the caller hung up before its request ended");
                request.extend_from_slice(&buf[..n]);
            }
            stream.write_all(head.as_bytes()).await.unwrap();
            stream.write_all(&body).await.unwrap();
            // Held until the caller hangs up.
            let _ = stream.read(&mut buf).await;
        });
        format!("http://{addr}/raft/append")
    }

    async fn answer_from(head: &'static str, body: Vec<u8>, max: usize) -> Result<Vec<u8>, String> {
        let url = peer_answering(head, body).await;
        let client = reqwest::Client::builder().no_proxy().build().unwrap();
        let response = client.post(url).send().await.unwrap();
        // Bounds the test, not the code: reading a body that never comes would wait
        // for ever.
        tokio::time::timeout(Duration::from_secs(30), answer_within(response, max))
            .await
            .unwrap_or_else(|_| Err("still reading after 30 s".into()))
    }

    #[tokio::test]
    async fn an_answer_stating_more_than_the_bound_is_refused_unread() {
        // 4 GiB stated, nothing sent: refused at once, not waited for.
        let refused = answer_from(
            "HTTP/1.1 200 OK\r\ncontent-length: 4294967296\r\n\r\n",
            Vec::new(),
            MAX_ANSWER_BYTES,
        )
        .await;
        assert_eq!(
            refused,
            Err(format!(
                "the peer's answer states 4294967296 bytes, over {MAX_ANSWER_BYTES}"
            ))
        );
    }

    #[tokio::test]
    async fn an_answer_is_read_whole_within_the_bound_and_refused_past_it() {
        let body = br#"{"Ok":{"vote":1}}"#.to_vec();
        let head = "HTTP/1.1 200 OK\r\ncontent-length: 17\r\n\r\n";
        assert_eq!(answer_from(head, body.clone(), 17).await, Ok(body));

        // No stated length (chunked): refused once its bytes pass the bound.
        let chunked = "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n";
        let chunk = |n: usize| format!("{n:x}\r\n{}\r\n", "x".repeat(n));
        let over = format!("{}{}0\r\n\r\n", chunk(10), chunk(10)).into_bytes();
        assert_eq!(
            answer_from(chunked, over, 15).await,
            Err("the peer's answer is over 15 bytes".into())
        );
        let within = format!("{}{}0\r\n\r\n", chunk(10), chunk(5)).into_bytes();
        assert_eq!(answer_from(chunked, within, 15).await, Ok(vec![b'x'; 15]));
    }
}
