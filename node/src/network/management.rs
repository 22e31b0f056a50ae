//! Cluster management for operators (admin token), and health for load balancers.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Json;
use openraft::{BasicNode, ChangeMembers, ServerState};
use serde::Deserialize;
use serde_json::json;

use crate::api::auth::{require, Need};
use crate::api::body::JsonBody;
use crate::api::error::ApiError;
use crate::api::route_book::RouteBook;
use crate::app::App;
use crate::raft_types::NodeId;

pub fn health_routes() -> RouteBook {
    RouteBook::default()
        .route("/healthz", &[Method::GET], get(healthz))
        .route("/readyz", &[Method::GET], get(readyz))
}

/// Under `/v1`, so they are routed to the leader like every other operator call (except
/// `/v1/node/…`, which acts on the node asked: `api::forward`).
pub fn cluster_routes() -> RouteBook {
    RouteBook::default()
        .route("/v1/node/snapshot", &[Method::POST], post(snapshot_now))
        .route("/v1/cluster", &[Method::GET], get(cluster))
        .route("/v1/cluster/nodes", &[Method::POST], post(add_node))
        .route(
            "/v1/cluster/nodes/remove",
            &[Method::POST],
            post(remove_node),
        )
}

async fn healthz() -> Json<serde_json::Value> {
    Json(json!({"ok": true}))
}

/// Ready when a leader is known, this node has applied what it knows is committed, and
/// it is neither under repair nor stepping back from a stalled disk.
async fn readyz(State(app): State<Arc<App>>) -> Response {
    let metrics = app.raft.metrics().borrow().clone();
    let applied = metrics.last_applied.map_or(0, |l| l.index);
    let logged = metrics.last_log_index.unwrap_or(0);
    let repairing = app.repairing();
    let disk_stalled = app.disk_stalled();
    let ready = metrics.current_leader.is_some()
        && applied >= logged
        && repairing.is_none()
        && disk_stalled.is_none();
    let body = json!({"ready": ready, "leader": metrics.current_leader, "applied_index": applied, "repairing": repairing, "disk_stalled": disk_stalled});
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(body)).into_response()
}

/// `GET /v1/cluster`: leader, term, indexes, and every node with its role, lag and
/// secret fingerprints.
async fn cluster(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
) -> Result<Json<serde_json::Value>, ApiError> {
    require(&headers, &app, Need::Read)?;
    let metrics = app.raft.metrics().borrow().clone();
    let membership = metrics.membership_config.membership();
    let voters: BTreeSet<NodeId> = membership.voter_ids().collect();
    let last_index = metrics.last_log_index.unwrap_or(0);
    let replication = metrics.replication.clone().unwrap_or_default();
    let nodes: Vec<_> = membership
        .nodes()
        .map(|(id, node)| {
            let role = if Some(*id) == metrics.current_leader {
                "leader"
            } else if voters.contains(id) {
                "follower"
            } else {
                "learner"
            };
            let matched = if *id == app.id && metrics.state == ServerState::Leader {
                Some(last_index)
            } else {
                replication.get(id).and_then(|m| m.map(|l| l.index))
            };
            // Heard from by this node (the leader answers this route): a follower that
            // stopped answering shows as unreachable, even in an idle cluster.
            let contact = (*id != app.id)
                .then(|| app.peers.since_last_answer(*id))
                .flatten();
            let reachable = (*id != app.id)
                .then(|| contact.is_some_and(|age| age < super::peer_contacts::UNREACHABLE_AFTER));
            // Which cluster secrets the node sends and accepts (fingerprints): this
            // node's own, a peer's from its last Raft answer to this node.
            let secrets = if *id == app.id {
                Some(app.keys.secrets.fingerprints())
            } else {
                app.peers.peer_secrets(*id)
            };
            json!({
                "id": id,
                "addr": node.addr,
                "role": role,
                "matched_index": matched,
                "lag": matched.map(|m| last_index.saturating_sub(m)),
                "last_contact_ms": contact.map(|age| age.as_millis() as u64),
                "reachable": reachable,
                "secrets": secrets,
            })
        })
        .collect();
    Ok(Json(json!({
        "node_id": app.id,
        "leader": metrics.current_leader,
        "term": metrics.current_term,
        "commit_index": app.committed_index.load(std::sync::atomic::Ordering::Relaxed),
        "last_log_index": metrics.last_log_index,
        "applied_index": metrics.last_applied.map(|l| l.index),
        "nodes": nodes,
    })))
}

#[derive(Deserialize)]
struct AddNode {
    id: NodeId,
    addr: String,
    /// Join as a learner only (default: promote to voter once caught up).
    #[serde(default)]
    learner_only: bool,
}

#[derive(Deserialize)]
struct RemoveNode {
    id: NodeId,
}

/// Adds a node as a learner (waiting until it has caught up), then makes it a voter.
async fn add_node(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    JsonBody(body): JsonBody<AddNode>,
) -> Result<Json<serde_json::Value>, ApiError> {
    require(&headers, &app, Need::Admin)?;
    // As `remove_node`: only a leader confirmed by a quorum changes membership (a
    // removed leader that still believes it leads must not be asked).
    app.confirm_leading().await?;
    app.raft
        .add_learner(body.id, BasicNode { addr: body.addr }, true)
        .await
        .map_err(|e| ApiError::unavailable(e.to_string()))?;
    if !body.learner_only {
        app.raft
            .change_membership(ChangeMembers::AddVoterIds(BTreeSet::from([body.id])), false)
            .await
            .map_err(|e| ApiError::unavailable(e.to_string()))?;
    }
    Ok(Json(json!({"ok": true})))
}

/// Removes a node from the cluster: a voter in one membership change (openraft's joint
/// then uniform config, not retained as a learner), a learner by removing it from the
/// nodes. 404 for a node that is not a member (a retry of a removal whose answer was
/// lost gets it too: the node is gone either way).
///
/// One change, never two, and never the leader's own removal (409): a removed leader
/// steps down once the change commits, and openraft 0.9 then fails on it ("Only leader
/// is allowed to call update_effective_membership()", found by the CLI membership test:
/// first through a second change this handler made, then with one change alone). The
/// procedure for the leader is to stop it and remove it once another node leads.
///
/// Leadership is confirmed with a quorum first: the request was routed here on this
/// node's belief that it leads, and a node cut off (or a leader already removed) would
/// otherwise answer 404 from a membership the cluster has moved past.
async fn remove_node(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    JsonBody(body): JsonBody<RemoveNode>,
) -> Result<Json<serde_json::Value>, ApiError> {
    require(&headers, &app, Need::Admin)?;
    app.confirm_leading().await?;
    let membership = app.raft.metrics().borrow().membership_config.clone();
    let membership = membership.membership();
    let is_voter = membership.voter_ids().any(|id| id == body.id);
    // openraft takes the removal of a node it does not know as done: an operator who
    // typed the wrong id would be told the node is gone.
    if !membership.nodes().any(|(id, _)| *id == body.id) {
        let members: Vec<String> = membership.nodes().map(|(id, _)| id.to_string()).collect();
        return Err(ApiError::NotFound(format!(
            "node {} is not a member of the cluster (members: {})",
            body.id,
            members.join(", ")
        )));
    }
    if body.id == app.id {
        // openraft 0.9 fails a leader that removes itself (a debug assertion in
        // `append_membership` once it has stepped down, found by the CLI membership
        // test) and has no leadership transfer.
        return Err(ApiError::Rejected(format!(
            "node {} is the leader and cannot remove itself: stop it (another node leads \
             within seconds), then remove it",
            body.id
        )));
    }
    let change = if is_voter {
        ChangeMembers::RemoveVoters(BTreeSet::from([body.id]))
    } else {
        ChangeMembers::RemoveNodes(BTreeSet::from([body.id]))
    };
    app.raft
        .change_membership(change, false)
        .await
        .map_err(|e| ApiError::unavailable(e.to_string()))?;
    Ok(Json(json!({"ok": true})))
}

/// How long `POST /v1/node/snapshot` waits for the snapshot, and then for the purge.
const SNAPSHOT_WAIT: std::time::Duration = std::time::Duration::from_secs(120);
/// How often a wait for a snapshot looks at the disk reserve.
const SNAPSHOT_WAIT_SLICE: std::time::Duration = std::time::Duration::from_secs(1);
const PURGE_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// `POST /v1/node/snapshot`: this node builds a snapshot of what it has applied and purges
/// its Raft log through it, so its disk holds each record once (before a backup, or to
/// measure). Openraft does the same by itself every `--snapshot-every` entries, keeping
/// some entries behind for lagging followers; after this, a follower behind the purge
/// gets a snapshot instead. A leader purges only once no replication is reading the
/// entries: the answer's `purged_index` says how far it got within the wait.
async fn snapshot_now(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
) -> Result<Json<serde_json::Value>, ApiError> {
    require(&headers, &app, Need::Admin)?;
    if let Some(reason) = app.repairing() {
        // Its state may lack acknowledged entries: it gets the leader's snapshot instead.
        return Err(ApiError::unavailable(format!(
            "this node is being repaired from the cluster: {reason}"
        )));
    }
    // A build commits to the state file: below the reserve it commits nothing
    // (`build_snapshot`).
    app.check_disk()?;
    let Some(applied) = app.raft.metrics().borrow().last_applied else {
        return Err(ApiError::Rejected(
            "this node has applied nothing to snapshot yet".into(),
        ));
    };
    let fatal = |e: openraft::error::Fatal<NodeId>| ApiError::unavailable(e.to_string());
    app.raft.trigger().snapshot().await.map_err(fatal)?;
    // Waited for in slices, the disk looked at between them: below its reserve a build
    // commits nothing and ends at once (`build_snapshot`), and openraft does not retry a
    // trigger, so waiting longer would only delay the 507.
    let deadline = std::time::Instant::now() + SNAPSHOT_WAIT;
    let built = loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let waited = app
            .raft
            .wait(Some(left.min(SNAPSHOT_WAIT_SLICE)))
            .metrics(
                |m| m.snapshot.is_some_and(|s| s.index >= applied.index),
                "snapshot built",
            )
            .await;
        match waited {
            Ok(metrics) => break metrics,
            Err(e) => {
                app.check_disk()?;
                if left <= SNAPSHOT_WAIT_SLICE
                    || matches!(e, openraft::metrics::WaitError::ShuttingDown)
                {
                    return Err(ApiError::unavailable(format!(
                        "the snapshot was not built: {e}"
                    )));
                }
            }
        }
    };
    let snapshot = built.snapshot.map_or(applied.index, |s| s.index);
    app.raft
        .trigger()
        .purge_log(snapshot)
        .await
        .map_err(fatal)?;
    let purged = match app
        .raft
        .wait(Some(PURGE_WAIT))
        .metrics(
            |m| m.purged.is_some_and(|p| p.index >= snapshot),
            "log purged",
        )
        .await
    {
        Ok(m) => m.purged,
        Err(_) => app.raft.metrics().borrow().purged,
    };
    Ok(Json(json!({
        "node_id": app.id,
        "snapshot_index": snapshot,
        "purged_index": purged.map(|p| p.index),
    })))
}

/// The initial membership, from `id=addr` peers.
pub fn initial_members(peers: &[(NodeId, String)]) -> BTreeMap<NodeId, BasicNode> {
    peers
        .iter()
        .map(|(id, addr)| (*id, BasicNode { addr: addr.clone() }))
        .collect()
}
