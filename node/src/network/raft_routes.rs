//! Incoming Raft RPCs. Every request must carry the cluster secret and, with TLS, come
//! with a certificate that names a node of this cluster (`tls`).

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, Method};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use openraft::error::RaftError;
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, VoteRequest, VoteResponse,
};

use super::raft_client::{body_digest, BODY_SHA256_HEADER, CLUSTER_SECRET_HEADER, SECRETS_HEADER};
use crate::api::body::{json_bytes, parse};
use crate::api::error::ApiError;
use crate::api::route_book::RouteBook;
use crate::app::App;
use crate::log_pace::Pace;
use crate::raft_types::{NodeId, TypeConfig};
use crate::store::repair_floor::Floor;
use crate::tls::PeerCertificate;

/// Raft bodies may be larger than the API's: an AppendEntries always carries at least
/// one whole entry, and a batch may end with one large write. Only nodes holding the
/// cluster secret get to send one (checked before the body is read).
const MAX_RAFT_BODY_BYTES: usize = 64 * 1024 * 1024;

/// Refusals repeat at every heartbeat while their cause lasts: one WARN per 10 s for each
/// cause, with how many were left out (`log_pace`); `lineage_raft_requests_refused_total`
/// counts every one.
static CERTIFICATE_REFUSALS: Pace = Pace::new(Duration::from_secs(10));
static DIGEST_REFUSALS: Pace = Pace::new(Duration::from_secs(10));
static MISSING_DIGEST_REFUSALS: Pace = Pace::new(Duration::from_secs(10));

pub fn routes() -> RouteBook {
    RouteBook::default()
        .route("/raft/append", &[Method::POST], post(append))
        .route("/raft/vote", &[Method::POST], post(vote))
        .route("/raft/snapshot", &[Method::POST], post(snapshot))
}

/// The Raft routes with their body limit, behind the cluster-secret check.
pub fn router(app: Arc<App>) -> Router<Arc<App>> {
    routes()
        .into_router()
        .layer(DefaultBodyLimit::max(MAX_RAFT_BODY_BYTES))
        .route_layer(axum::middleware::from_fn_with_state(
            app,
            require_cluster_secret,
        ))
}

/// Checked before the body is even read: only nodes holding the secret (and, with TLS,
/// a node's certificate) speak Raft.
async fn require_cluster_secret(
    State(app): State<Arc<App>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if app.tls {
        let peer = request.extensions().get::<PeerCertificate>();
        if let Err(why) = node_certificate(&app, peer) {
            if let Some(left_out) = CERTIFICATE_REFUSALS.admit() {
                tracing::warn!(
                    why,
                    left_out,
                    "a Raft request without a member node's certificate"
                );
            }
            app.metrics
                .raft_requests_refused
                .with_label_values(&["certificate"])
                .inc();
            return ApiError::NotANode(why).into_response();
        }
    }
    let presented = request
        .headers()
        .get(CLUSTER_SECRET_HEADER)
        .map(|v| v.as_bytes())
        .unwrap_or_default();
    if app.keys.secrets.accepts_cluster_secret(presented) {
        // The answer says which secrets this node sends and accepts (fingerprints), so
        // the leader can show every node's phase of a rotation (`GET /v1/cluster`).
        let mut response = next.run(request).await;
        let fingerprints = app.keys.secrets.fingerprints().header_value();
        if let Ok(value) = axum::http::HeaderValue::from_str(&fingerprints) {
            response.headers_mut().insert(SECRETS_HEADER, value);
        }
        response
    } else {
        app.metrics
            .raft_requests_refused
            .with_label_values(&["secret"])
            .inc();
        ApiError::Unauthorized.into_response()
    }
}

/// A Raft request's JSON body, held to the SHA-256 its sender stated
/// (`BODY_SHA256_HEADER`): a body that differs (changed on the way) is refused with 400
/// and counted; openraft sends an AppendEntries or snapshot chunk again, as after any
/// failed call, and a vote at the next election. A request without the header (a node
/// of a build before it, during a rolling upgrade) is counted and read as before, or,
/// with `--require-raft-digests`, refused with 400 before its body is read
/// (`reason="missing_digest"`).
struct RaftBody<T>(T);

impl<T: serde::de::DeserializeOwned> axum::extract::FromRequest<Arc<App>> for RaftBody<T> {
    type Rejection = ApiError;

    async fn from_request(
        request: axum::extract::Request,
        app: &Arc<App>,
    ) -> Result<Self, ApiError> {
        let stated = request.headers().get(BODY_SHA256_HEADER).cloned();
        if stated.is_none() {
            app.metrics
                .raft_messages_without_digest
                .with_label_values(&["request"])
                .inc();
            // Refused before its body is read: nothing in it can be checked.
            if app.require_raft_digests {
                app.metrics
                    .raft_requests_refused
                    .with_label_values(&["missing_digest"])
                    .inc();
                if let Some(left_out) = MISSING_DIGEST_REFUSALS.admit() {
                    tracing::warn!(
                        left_out,
                        "a Raft request without a body SHA-256 refused (--require-raft-digests): \
                         a node of a build before digests?"
                    );
                }
                return Err(ApiError::BadRequest(format!(
                    "the request has no {BODY_SHA256_HEADER}, which this node requires \
                     (--require-raft-digests)"
                )));
            }
        }
        let bytes = json_bytes::<_, MAX_RAFT_BODY_BYTES>(request, app).await?;
        if stated.is_some_and(|stated| stated.as_bytes() != body_digest(&bytes).as_bytes()) {
            app.metrics
                .raft_requests_refused
                .with_label_values(&["digest"])
                .inc();
            if let Some(left_out) = DIGEST_REFUSALS.admit() {
                tracing::warn!(
                    bytes = bytes.len(),
                    left_out,
                    "a Raft request body does not match the SHA-256 its sender stated; refused"
                );
            }
            return Err(ApiError::BadRequest(format!(
                "the body ({} bytes) does not match its {BODY_SHA256_HEADER}: changed on the way",
                bytes.len()
            )));
        }
        parse(&bytes).map(RaftBody)
    }
}

/// A Raft answer as JSON, with its body's SHA-256 (`BODY_SHA256_HEADER`), which the
/// caller holds it to (`raft_client`): an answer changed on its way back (a vote's term,
/// a conflict's log id) is refused there and the call counts as failed, as a request
/// changed on its way here is refused by `RaftBody`.
fn sealed_answer<T: serde::Serialize>(answer: &T) -> Response {
    match serde_json::to_vec(answer) {
        Ok(body) => (
            [
                (header::CONTENT_TYPE, "application/json".to_string()),
                (
                    header::HeaderName::from_static(BODY_SHA256_HEADER),
                    body_digest(&body),
                ),
            ],
            body,
        )
            .into_response(),
        Err(e) => ApiError::Internal(format!("cannot write the Raft answer: {e}")).into_response(),
    }
}

/// The peer's certificate must name a node of this cluster that is a member (voter or
/// learner) of the membership this node knows. A node that knows none yet (it was just
/// started empty, to be added) accepts any node of this cluster.
fn node_certificate(app: &App, peer: Option<&PeerCertificate>) -> Result<(), String> {
    let Some(peer) = peer else {
        return Err("Raft requires a node certificate; none was presented".into());
    };
    let Some((cluster, id)) = &peer.node else {
        return Err("the certificate names no node (lineage://<cluster>/node/<id>)".into());
    };
    if *cluster != app.heads_origin {
        return Err(format!(
            "the certificate names a node of another cluster ({cluster})"
        ));
    }
    let metrics = app.raft.metrics();
    let membership = metrics.borrow();
    let members = membership.membership_config.membership();
    let known = members.nodes().next().is_some();
    if known && members.get_node(id).is_none() {
        return Err(format!("node {id} is not a member of this cluster"));
    }
    Ok(())
}

/// With TLS, the node a Raft request speaks for (the leader or candidate in its vote)
/// must be the node its certificate names: a member's certificate cannot speak for
/// another member.
fn sender_is_the_certificate(
    app: &App,
    peer: Option<&axum::Extension<PeerCertificate>>,
    vote: &openraft::Vote<NodeId>,
) -> Result<(), ApiError> {
    if !app.tls {
        return Ok(());
    }
    let named = peer.and_then(|p| p.node.as_ref()).map(|(_, id)| *id);
    let speaks_for = vote.leader_id().voted_for();
    if named.is_some() && named == speaks_for {
        Ok(())
    } else {
        Err(ApiError::NotANode(format!(
            "the request speaks for node {speaks_for:?}, the certificate names node {named:?}"
        )))
    }
}

async fn append(
    State(app): State<Arc<App>>,
    peer: Option<axum::Extension<PeerCertificate>>,
    RaftBody(request): RaftBody<AppendEntriesRequest<TypeConfig>>,
) -> Response {
    if let Err(e) = sender_is_the_certificate(&app, peer.as_ref(), &request.vote) {
        return e.into_response();
    }
    // A leader's commit index covers every entry committed before it only once it has
    // committed an entry of its own term; before that it may lag an earlier term's.
    let leader_commit = request
        .leader_commit
        .filter(|c| request.vote.is_committed() && c.leader_id == *request.vote.leader_id());
    let response = app.raft.append_entries(request).await;
    if let (Ok(AppendEntriesResponse::Success), Some(log)) = (&response, &app.log) {
        if let Err(e) = log.caught_up_with(leader_commit) {
            tracing::error!(error = %e, "cannot record the repair");
        }
    }
    sealed_answer(&response)
}

/// A node under repair (`store::repair_floor`) gives its vote only to a candidate whose
/// log has passed its floor: it may have acknowledged entries it lost, and a candidate
/// behind them could win without them. It answers as a voter with a longer log would, so
/// the candidate backs off.
async fn vote(
    State(app): State<Arc<App>>,
    peer: Option<axum::Extension<PeerCertificate>>,
    RaftBody(request): RaftBody<VoteRequest<NodeId>>,
) -> Response {
    if let Err(e) = sender_is_the_certificate(&app, peer.as_ref(), &request.vote) {
        return e.into_response();
    }
    count_vote_request(&app, request.vote.leader_id().voted_for());
    let floor = app.log.as_ref().and_then(|log| log.repair_floor());
    if let Some(floor) = floor.filter(|f| !f.floor.allows_candidate(request.last_log_id)) {
        let metrics = app.raft.metrics().borrow().clone();
        tracing::info!(candidate = %request.vote, floor = ?floor.floor, "vote refused: the candidate's log is behind this node's repair floor");
        let last_log_id = match floor.floor {
            Floor::Entry(id) => Some(id),
            Floor::Unknown => request.last_log_id,
        };
        let refused: Result<VoteResponse<NodeId>, RaftError<NodeId>> = Ok(VoteResponse {
            vote: metrics.vote,
            vote_granted: false,
            last_log_id,
        });
        return sealed_answer(&refused);
    }
    sealed_answer(&app.raft.vote(request).await)
}

/// Counts a vote request by its candidate; ids outside the membership share one label,
/// so a peer cannot grow the metric without bound.
fn count_vote_request(app: &App, candidate: Option<NodeId>) {
    let member = candidate.filter(|id| {
        app.raft
            .metrics()
            .borrow()
            .membership_config
            .membership()
            .get_node(id)
            .is_some()
    });
    let label = member.map_or_else(|| "other".to_string(), |id| id.to_string());
    app.metrics
        .raft_vote_requests
        .with_label_values(&[&label])
        .inc();
}

async fn snapshot(
    State(app): State<Arc<App>>,
    peer: Option<axum::Extension<PeerCertificate>>,
    RaftBody(request): RaftBody<InstallSnapshotRequest<TypeConfig>>,
) -> Response {
    if let Err(e) = sender_is_the_certificate(&app, peer.as_ref(), &request.vote) {
        return e.into_response();
    }
    // Only a current leader's stream holds this node's elections: a deposed one's chunk
    // is refused below, and must not keep this node from campaigning.
    let current = request.vote >= app.raft.metrics().borrow().vote;
    let _turn = app
        .elections
        .as_ref()
        .filter(|_| current)
        .map(|hold| hold.snapshot_chunk());
    sealed_answer(&app.raft.install_snapshot(request).await)
}
