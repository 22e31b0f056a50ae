//! Outgoing Raft RPCs over HTTP, authenticated with the cluster secret.

use openraft::error::{
    InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable,
};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::BasicNode;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::raft_types::{NodeId, TypeConfig};
use crate::store::log_store::DurableLog;

/// The header that carries the cluster secret on node-to-node requests.
pub const CLUSTER_SECRET_HEADER: &str = "x-lineage-cluster-secret";

#[derive(Clone)]
pub struct RaftHttp {
    pub client: reqwest::Client,
    pub secret: String,
    /// With the leader's early acknowledgement on, followers hear of commits only up to
    /// what is durable here (`log_store` docs).
    pub durable_log: Option<DurableLog>,
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

impl Connection {
    async fn call<Req, Resp, Err>(
        &self,
        path: &str,
        request: &Req,
        option: &RPCOption,
    ) -> Result<Resp, RPCError<NodeId, BasicNode, RaftError<NodeId, Err>>>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
        Err: std::error::Error + DeserializeOwned,
    {
        let url = format!("http://{}/raft/{path}", self.addr);
        let response = self
            .http
            .client
            .post(url)
            .header(CLUSTER_SECRET_HEADER, &self.http.secret)
            .timeout(option.hard_ttl())
            .json(request)
            .send()
            .await
            .map_err(|e| {
                if e.is_connect() {
                    RPCError::Unreachable(Unreachable::new(&e))
                } else {
                    RPCError::Network(NetworkError::new(&e))
                }
            })?;
        if !response.status().is_success() {
            let status = response.status();
            let err = std::io::Error::other(format!("peer answered {status}"));
            return Err(RPCError::Network(NetworkError::new(&err)));
        }
        let result: Result<Resp, RaftError<NodeId, Err>> = response
            .json()
            .await
            .map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        result.map_err(|e| RPCError::RemoteError(RemoteError::new(self.target, e)))
    }
}

impl RaftNetwork<TypeConfig> for Connection {
    async fn append_entries(
        &mut self,
        mut request: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        if let Some(durable) = &self.http.durable_log {
            request.leader_commit = durable.clamp_commit(request.leader_commit);
        }
        self.call("append", &request, &option).await
    }

    async fn install_snapshot(
        &mut self,
        request: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<
        InstallSnapshotResponse<NodeId>,
        RPCError<NodeId, BasicNode, RaftError<NodeId, InstallSnapshotError>>,
    > {
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
