//! The simulation's network: Raft RPCs handed straight to the target node's `Raft`, in
//! the process, through seeded faults (a cut link, a dropped request, a lost reply, a
//! delay). Built like the in-memory router of openraft's examples; the leader's commit
//! index is clamped to what its disk holds, as `network::raft_client` does.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lineage_node::raft_types::{NodeId, Raft, TypeConfig};
use lineage_node::store::log_store::DurableLog;
use openraft::error::{InstallSnapshotError, RPCError, RaftError, RemoteError, Unreachable};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::BasicNode;

/// SplitMix64: small, seeded, and the same sequence everywhere.
pub struct SeededRng(u64);

impl SeededRng {
    pub fn new(seed: u64) -> Self {
        SeededRng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// True with probability `percent` / 100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// The faults in force; the nemesis changes them as the run goes.
#[derive(Default, Clone, Debug)]
pub struct Faults {
    /// Links that carry nothing, both ways.
    pub cut: BTreeSet<(NodeId, NodeId)>,
    /// Per cent of requests dropped before delivery, and of replies lost after it.
    pub drop_percent: u64,
    /// Each delivery waits up to this long.
    pub max_delay_ms: u64,
}

impl Faults {
    /// Cuts `node` off from every node in `others`.
    pub fn isolate(&mut self, node: NodeId, others: impl IntoIterator<Item = NodeId>) {
        for other in others {
            self.cut.insert((node.min(other), node.max(other)));
        }
    }

    fn is_cut(&self, a: NodeId, b: NodeId) -> bool {
        self.cut.contains(&(a.min(b), a.max(b)))
    }
}

pub struct Router {
    nodes: Mutex<BTreeMap<NodeId, Raft>>,
    faults: Mutex<Faults>,
    rng: Mutex<SeededRng>,
}

impl Router {
    pub fn new(seed: u64) -> Arc<Router> {
        Arc::new(Router {
            nodes: Mutex::default(),
            faults: Mutex::default(),
            rng: Mutex::new(SeededRng::new(seed)),
        })
    }

    pub fn register(&self, id: NodeId, raft: Raft) {
        lock(&self.nodes).insert(id, raft);
    }

    /// The node no longer answers (stopped).
    pub fn unregister(&self, id: NodeId) {
        lock(&self.nodes).remove(&id);
    }

    pub fn set_faults(&self, faults: Faults) {
        *lock(&self.faults) = faults;
    }

    pub fn faults(&self) -> Faults {
        lock(&self.faults).clone()
    }

    /// The target's `Raft` if the request gets through: waits the delay, then fails as
    /// unreachable on a cut link, a drop, or a stopped target.
    async fn deliver(&self, from: NodeId, to: NodeId) -> Result<Raft, Unreachable> {
        let (cut, dropped, delay) = {
            let faults = lock(&self.faults);
            let mut rng = lock(&self.rng);
            let delay = rng.below(faults.max_delay_ms + 1);
            (
                faults.is_cut(from, to),
                rng.chance(faults.drop_percent),
                delay,
            )
        };
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        if cut || dropped {
            return Err(unreachable("the network dropped the request"));
        }
        lock(&self.nodes)
            .get(&to)
            .cloned()
            .ok_or_else(|| unreachable("the node is stopped"))
    }

    /// Whether the reply gets back (it is lost on a drop, or if the link was cut meanwhile).
    fn reply_arrives(&self, from: NodeId, to: NodeId) -> Result<(), Unreachable> {
        let faults = lock(&self.faults);
        if faults.is_cut(from, to) || lock(&self.rng).chance(faults.drop_percent) {
            return Err(unreachable("the network lost the reply"));
        }
        Ok(())
    }
}

/// A mutex's guard, even after a panic elsewhere held it (the simulation's one helper).
pub fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

fn unreachable(why: &str) -> Unreachable {
    Unreachable::new(&std::io::Error::other(why.to_string()))
}

/// One node's side of the network.
#[derive(Clone)]
pub struct SimNetwork {
    pub from: NodeId,
    pub router: Arc<Router>,
    /// With the leader's early acknowledgement: followers hear of commits only up to
    /// what is durable here.
    pub durable_log: DurableLog,
}

impl RaftNetworkFactory<TypeConfig> for SimNetwork {
    type Network = SimConnection;

    async fn new_client(&mut self, target: NodeId, _node: &BasicNode) -> SimConnection {
        SimConnection {
            network: self.clone(),
            to: target,
        }
    }
}

pub struct SimConnection {
    network: SimNetwork,
    to: NodeId,
}

type Rpc<T, E = RaftError<NodeId>> = Result<T, RPCError<NodeId, BasicNode, E>>;

impl SimConnection {
    async fn target(&self) -> Result<Raft, Unreachable> {
        self.network
            .router
            .deliver(self.network.from, self.to)
            .await
    }

    /// The target's answer, unless the reply is lost on the way back.
    #[expect(
        clippy::result_large_err,
        reason = "openraft's RaftNetwork methods return this error type"
    )]
    fn back<T, E: std::error::Error>(
        &self,
        result: Result<T, RaftError<NodeId, E>>,
    ) -> Rpc<T, RaftError<NodeId, E>> {
        let reply = result.map_err(|e| RPCError::RemoteError(RemoteError::new(self.to, e)))?;
        self.network
            .router
            .reply_arrives(self.network.from, self.to)
            .map_err(RPCError::Unreachable)?;
        Ok(reply)
    }
}

impl RaftNetwork<TypeConfig> for SimConnection {
    async fn append_entries(
        &mut self,
        mut request: AppendEntriesRequest<TypeConfig>,
        _option: RPCOption,
    ) -> Rpc<AppendEntriesResponse<NodeId>> {
        request.leader_commit = self.network.durable_log.clamp_commit(request.leader_commit);
        let raft = self.target().await.map_err(RPCError::Unreachable)?;
        let result = raft.append_entries(request).await;
        self.back(result)
    }

    async fn install_snapshot(
        &mut self,
        request: InstallSnapshotRequest<TypeConfig>,
        _option: RPCOption,
    ) -> Rpc<InstallSnapshotResponse<NodeId>, RaftError<NodeId, InstallSnapshotError>> {
        let raft = self.target().await.map_err(RPCError::Unreachable)?;
        let result = raft.install_snapshot(request).await;
        self.back(result)
    }

    async fn vote(
        &mut self,
        request: VoteRequest<NodeId>,
        _option: RPCOption,
    ) -> Rpc<VoteResponse<NodeId>> {
        let raft = self.target().await.map_err(RPCError::Unreachable)?;
        let result = raft.vote(request).await;
        self.back(result)
    }
}
