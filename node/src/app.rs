//! Shared node state and the leader's decision path.
//!
//! Per agent, decisions are serialised by an async mutex: decide on the applied state,
//! seal, propose through Raft, wait until the entry is applied on this node, answer.
//! Different agents proceed in parallel and openraft batches their entries.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use lineage_core::guard::{
    decide, seal, Action, ActionView, AgentState, Command, GuardError, Status,
};
use lineage_core::record::timestamp;
use openraft::error::{CheckIsLeaderError, RaftError};
use serde_json::Value;

use crate::batcher::{Batcher, WriteError};
use crate::disk_reserve::DiskReserve;
use crate::idempotency_key::IdempotencyKey;
use crate::keys::ClusterKeys;
use crate::network::peer_contacts::PeerContacts;
use crate::raft_types::{AppendRecords, ApplyOutcome, IdempotentAnswer, NodeId, Raft, RecordLine};
use crate::store::agent_slot::AgentSlot;
use crate::store::log_store::DurableLog;
use crate::store::StateMachine;

/// How long a read waits for this leader to apply its whole log before answering 503.
const READ_CATCH_UP: std::time::Duration = std::time::Duration::from_secs(3);

pub struct App {
    pub id: NodeId,
    pub raft: Raft,
    pub sm: StateMachine,
    pub keys: ClusterKeys,
    /// One HTTP client for forwarding (and Raft), reused for its connection pool.
    pub http: reqwest::Client,
    pub metrics: Arc<crate::metrics::Metrics>,
    /// The committed Raft index, as this node last learned it.
    pub committed_index: Arc<std::sync::atomic::AtomicU64>,
    /// The heads log's origin (cluster name) this node proposes for the first round.
    pub heads_origin: String,
    /// What a witnessed checkpoint must carry before this node stores it.
    pub witnesses: WitnessPolicy,
    /// Reads that walk a whole agent log (verify, per-agent proofs, some public) run on
    /// blocking threads, this many at once, so a flood of them cannot starve decisions.
    pub whole_log_reads: tokio::sync::Semaphore,
    /// This node's Raft log as the disk has it: its repair floor (`store::repair_floor`).
    pub log: Option<DurableLog>,
    /// When each peer last answered this node's Raft RPCs (`peer_contacts`).
    pub peers: Arc<PeerContacts>,
    /// Free space the leader keeps before it seals anything (`disk_reserve`).
    disk: Option<DiskReserve>,
    batcher: Batcher,
    agent_locks: Mutex<AgentLocks>,
    request_rate: crate::request_rate::RequestRate,
}

/// Per-agent write locks (`App::agent_lock`).
#[derive(Default)]
struct AgentLocks {
    map: HashMap<String, Arc<tokio::sync::Mutex<()>>>,
    /// Sweep unused locks when the map reaches this size.
    sweep_at: usize,
}

/// The agent lock map is never swept below this size.
const AGENT_LOCKS_SWEEP_MIN: usize = 1024;

/// Whole-log reads at once (`App::whole_log_reads`).
const WHOLE_LOG_READS: usize = 2;

/// The witnesses this node trusts: a witnessed checkpoint is stored only when it verifies
/// against the cluster's own key and at least `quorum` of these cosigned it. With none
/// configured, only the cluster's signature is required (auditors check the witnesses).
#[derive(Clone, Debug, Default)]
pub struct WitnessPolicy {
    vkeys: Vec<String>,
    quorum: usize,
}

impl WitnessPolicy {
    /// `vkeys` are C2SP cosignature/v1 verifier keys; `quorum` defaults to 1 with keys.
    pub fn new(vkeys: Vec<String>, quorum: Option<usize>) -> Result<Self, String> {
        for vkey in &vkeys {
            lineage_core::heads::CosignatureVerifier::new(vkey)
                .map_err(|e| format!("witness key {vkey:?}: {e}"))?;
        }
        let quorum = quorum.unwrap_or(usize::from(!vkeys.is_empty()));
        if quorum > vkeys.len() {
            return Err(format!(
                "a witness quorum of {quorum} needs at least that many witness keys (have {})",
                vkeys.len()
            ));
        }
        Ok(WitnessPolicy { vkeys, quorum })
    }

    /// Checks `note` against the cluster's log verifier key and these witnesses.
    pub fn check(&self, note: &str, log_vkey: &str) -> Result<(), String> {
        lineage_core::heads::verify_witnessed(note, log_vkey, &self.vkeys, self.quorum)
            .map(|_| ())
            .map_err(|e| e.to_string())
    }
}

/// Who serves a request: this node (it is the confirmed leader, caught up) or the
/// leader at `addr`.
pub enum Lead {
    Here,
    Forward(String),
}

/// How a write is answered: with the guard's decision, or with the agent's status
/// after the write, shaped by the given function.
pub enum Respond {
    Decision,
    Status(Box<dyn Fn(Status) -> Answer + Send + Sync>),
}

/// What the leader answers after a write: an HTTP status and a JSON body (the wire layer
/// sends them; they are also what an Idempotency-Key replays).
pub struct Answer {
    pub status: u16,
    pub body: Value,
}

/// Why the service could not do what was asked; `api::error` maps each to HTTP.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error("agent not found")]
    AgentNotFound,
    #[error("agent already exists")]
    AgentExists,
    #[error("agent log failed verification: {0}")]
    Quarantined(String),
    #[error("no leader is available right now; retry")]
    NoLeader,
    #[error("{0}")]
    Unavailable(String),
    /// A decision was made on state that was behind the log; it was not applied.
    #[error("the write was decided on stale state ({0}); retry")]
    Stale(String),
    #[error(transparent)]
    Guard(#[from] GuardError),
    /// The disk is below its reserve; nothing was recorded.
    #[error("{0}")]
    InsufficientStorage(String),
    /// An Idempotency-Key first used for another request.
    #[error("this Idempotency-Key was already used for a different request; use a new key")]
    IdempotencyKeyReused,
    /// An operator's key that an earlier version stored an answer under, unbound.
    #[error("this Idempotency-Key was used before keys were bound to requests; check the agent's state, then use a new key")]
    IdempotencyKeyAmbiguous,
    /// The request's input cannot be stored so that every reader gets it back exactly.
    #[error("the input cannot be recorded exactly: {0}")]
    NotRepresentable(String),
    /// The agent's requests per minute are used up (`request_rate`); nothing recorded.
    #[error("this agent sends more requests than its policy's max_requests_per_minute; retry in {retry_after_secs} s")]
    TooManyRequests { retry_after_secs: u64 },
    #[error("{0}")]
    Internal(String),
}

impl App {
    pub fn new(
        id: NodeId,
        raft: Raft,
        sm: StateMachine,
        keys: ClusterKeys,
        http: reqwest::Client,
        metrics: Arc<crate::metrics::Metrics>,
        committed_index: Arc<std::sync::atomic::AtomicU64>,
    ) -> Self {
        App {
            id,
            metrics,
            committed_index,
            batcher: Batcher::spawn(raft.clone()),
            raft,
            sm,
            keys,
            http,
            request_rate: crate::request_rate::RequestRate::default(),
            agent_locks: Mutex::new(AgentLocks {
                map: HashMap::new(),
                sweep_at: AGENT_LOCKS_SWEEP_MIN,
            }),
            heads_origin: String::new(),
            witnesses: WitnessPolicy::default(),
            log: None,
            peers: Arc::default(),
            disk: None,
            whole_log_reads: tokio::sync::Semaphore::new(WHOLE_LOG_READS),
        }
    }

    /// Sets the witnesses a stored witnessed checkpoint must be cosigned by.
    pub fn with_witnesses(mut self, witnesses: WitnessPolicy) -> Self {
        self.witnesses = witnesses;
        self
    }

    /// Gives the node its Raft log's durability handle (repair floor).
    pub fn with_log(mut self, log: DurableLog) -> Self {
        self.log = Some(log);
        self
    }

    /// Refuses writes (507) while the data directory's disk is below `disk`'s reserve.
    pub fn with_disk_reserve(mut self, disk: DiskReserve) -> Self {
        self.disk = Some(disk);
        self
    }

    pub fn with_peer_contacts(mut self, peers: Arc<PeerContacts>) -> Self {
        self.peers = peers;
        self
    }

    /// 507 while the data directory's disk is below its reserve (`disk_reserve`): call
    /// before proposing anything.
    pub fn check_disk(&self) -> Result<(), AppError> {
        match self.disk.as_ref().map(DiskReserve::check) {
            Some(Err(full)) => Err(AppError::InsufficientStorage(full.to_string())),
            _ => Ok(()),
        }
    }

    /// Why this node is being repaired (it may have lost acknowledged entries), if it is:
    /// it then serves no reads of its own copy and takes no part in elections.
    pub fn repairing(&self) -> Option<String> {
        self.log
            .as_ref()
            .and_then(DurableLog::repair_floor)
            .map(|floor| floor.reason)
    }

    /// Sets the heads log's origin (the cluster name).
    pub fn with_heads_origin(mut self, origin: String) -> Self {
        self.heads_origin = origin;
        self
    }

    /// Confirms leadership with a quorum and waits until everything committed is applied
    /// here; otherwise says where the leader is.
    pub async fn lead(&self) -> Result<Lead, AppError> {
        match self.raft.ensure_linearizable().await {
            Ok(_) => {
                // openraft 0.9 reads at max(committed, the leader's first entry of its
                // term). A leader restarted within its term (kill -9 of every node) has
                // a committed index rolled back to what was on disk and an old first
                // entry, so entries acknowledged before the restart may not be applied
                // yet. Reading at the leader's last log index covers all of them.
                let last = self.raft.metrics().borrow().last_log_index;
                self.raft
                    .wait(Some(READ_CATCH_UP))
                    .applied_index_at_least(last, "linearizable read")
                    .await
                    .map_err(|e| {
                        AppError::Unavailable(format!("not caught up for a read yet: {e}"))
                    })?;
                Ok(Lead::Here)
            }
            Err(RaftError::APIError(CheckIsLeaderError::ForwardToLeader(f))) => match f.leader_node
            {
                Some(node) if f.leader_id != Some(self.id) => Ok(Lead::Forward(node.addr)),
                _ => Err(AppError::NoLeader),
            },
            Err(RaftError::APIError(CheckIsLeaderError::QuorumNotEnough(_))) => {
                Err(AppError::NoLeader)
            }
            Err(e) => Err(AppError::Unavailable(e.to_string())),
        }
    }

    /// Who leads, as this node currently believes (no quorum round trip). A node that
    /// believes it leads but does not is found out by `client_write`.
    pub fn lead_for_write(&self) -> Result<Lead, AppError> {
        // Borrowed, not cloned: this runs on every write.
        let receiver = self.raft.metrics();
        let metrics = receiver.borrow();
        match metrics.current_leader {
            Some(id) if id == self.id => Ok(Lead::Here),
            Some(id) => metrics
                .membership_config
                .membership()
                .get_node(&id)
                .map(|node| Lead::Forward(node.addr.clone()))
                .ok_or(AppError::NoLeader),
            None => Err(AppError::NoLeader),
        }
    }

    /// The lock that orders one agent's writes on the leader. Locks nobody holds or waits
    /// for are dropped once the map has doubled since the last sweep, so the map stays
    /// about the size of the agents being written at once, not of every agent ever seen.
    fn agent_lock(&self, agent_id: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self.agent_locks.lock().unwrap_or_else(|p| p.into_inner());
        if locks.map.len() >= locks.sweep_at {
            locks.map.retain(|_, lock| Arc::strong_count(lock) > 1);
            locks.sweep_at = (locks.map.len() * 2).max(AGENT_LOCKS_SWEEP_MIN);
        }
        locks.map.entry(agent_id.to_string()).or_default().clone()
    }

    /// Runs `f` on the agent's applied state, or says why it cannot be served here.
    pub fn with_agent<T>(
        &self,
        agent_id: &str,
        f: impl FnOnce(&AgentState) -> T,
    ) -> Result<T, AppError> {
        let data = self.sm.read_data();
        match data.agents.get(agent_id) {
            None => Err(AppError::AgentNotFound),
            Some(AgentSlot::Quarantined(reason)) => Err(AppError::Quarantined(reason.clone())),
            Some(AgentSlot::Active(state)) => Ok(f(state)),
        }
    }

    /// One action as the API shows it. Memory holds a decided action's status only; its
    /// tool, input and cost are read back from this node's copy of its request record
    /// (after the state lock is let go: the read takes it again).
    pub fn action(&self, agent_id: &str, action_id: &str) -> Result<Option<Action>, AppError> {
        let settled = match self.with_agent(agent_id, |s| s.action_view(action_id))? {
            None => return Ok(None),
            Some(ActionView::Whole(action)) => return Ok(Some(action)),
            Some(ActionView::Settled(settled)) => settled,
        };
        let records = self
            .sm
            .records(agent_id, settled.requested_seq, 1)
            .map_err(|e| AppError::Internal(format!("reading the request of {action_id}: {e}")))?;
        let request = records.first().ok_or_else(|| {
            AppError::Internal(format!("the request of {action_id} is not stored here"))
        })?;
        settled
            .view(action_id, request)
            .map(Some)
            .map_err(AppError::Internal)
    }

    /// The leader's write path for one command. `respond` turns the decision and the
    /// agent's status after the write into the HTTP answer.
    pub async fn execute(
        &self,
        agent_id: &str,
        command: Command,
        idempotency: Option<IdempotencyKey>,
        respond: Respond,
    ) -> Result<Answer, AppError> {
        let lock = self.agent_lock(agent_id);
        let _serialised = lock.lock().await;
        match self
            .decide_and_write(agent_id, &command, &idempotency, &respond)
            .await
        {
            // The state this node decided on was behind (it has just become leader):
            // catch up with everything committed and decide once more.
            Err(AppError::Stale(_)) => {
                self.raft
                    .ensure_linearizable()
                    .await
                    .map_err(|_| AppError::NoLeader)?;
                match self
                    .decide_and_write(agent_id, &command, &idempotency, &respond)
                    .await
                {
                    Err(AppError::Stale(reason)) => Err(AppError::Unavailable(format!(
                        "the write was not applied ({reason}); retry"
                    ))),
                    other => other,
                }
            }
            other => other,
        }
    }

    /// The answer first given under `key`, if the key was used: only for the same request
    /// (422 otherwise), and a stored answer that cannot be read back intact is a 503,
    /// never a reason to decide (and charge) again.
    fn stored_answer(
        &self,
        agent_id: &str,
        key: &IdempotencyKey,
    ) -> Result<Option<Answer>, AppError> {
        let lookup = |scoped: &str| {
            self.sm.idempotent_answer(agent_id, scoped).map_err(|e| {
                tracing::error!(agent_id, error = %e, "stored idempotent answer unreadable");
                AppError::Unavailable(format!(
                    "the answer stored under this Idempotency-Key cannot be read back: {e}"
                ))
            })
        };
        let stored = lookup(&key.scoped)?;
        if let (None, Some(unscoped)) = (&stored, &key.unscoped) {
            // Before keys had namespaces an operator's answer sat under the bare key, as
            // agents' still do: an old answer there may be the operator's first answer or
            // an agent's. Neither decide again nor hand over an agent's answer: refuse.
            if lookup(unscoped)?.is_some_and(|answer| answer.request.is_empty()) {
                return Err(AppError::IdempotencyKeyAmbiguous);
            }
        }
        let Some(answer) = stored else {
            return Ok(None);
        };
        // Answers stored before keys were bound to requests carry no digest.
        if !answer.request.is_empty() && answer.request != key.request {
            return Err(AppError::IdempotencyKeyReused);
        }
        let body = serde_json::from_str(&answer.body)
            .map_err(|e| AppError::Unavailable(format!("the stored answer is not JSON: {e}")))?;
        if !(100..=599).contains(&answer.status) {
            return Err(AppError::Unavailable(format!(
                "the stored answer has no valid status: {}",
                answer.status
            )));
        }
        Ok(Some(Answer {
            status: answer.status,
            body,
        }))
    }

    async fn decide_and_write(
        &self,
        agent_id: &str,
        command: &Command,
        idempotency: &Option<IdempotencyKey>,
        respond: &Respond,
    ) -> Result<Answer, AppError> {
        if let Some(key) = idempotency {
            if let Some(answer) = self.stored_answer(agent_id, key)? {
                return Ok(answer);
            }
        }
        // A full disk refuses before anything is decided or sealed: the request leaves no
        // trace, and its retry is decided afresh once space returns.
        self.check_disk()?;
        let now = timestamp::now_micros();
        let (records, answer) = {
            let data = self.sm.read_data();
            let empty = AgentState::new();
            let state: &AgentState = match (data.agents.get(agent_id), command) {
                (Some(AgentSlot::Quarantined(reason)), _) => {
                    return Err(AppError::Quarantined(reason.clone()))
                }
                (Some(AgentSlot::Active(_)), Command::Create { .. }) => {
                    return Err(AppError::AgentExists)
                }
                (Some(AgentSlot::Active(state)), _) => state,
                (None, Command::Create { .. }) => &empty,
                (None, _) => return Err(AppError::AgentNotFound),
            };
            if let (Command::Request { .. }, Some(policy)) = (command, &state.policy) {
                self.request_rate
                    .admit(
                        agent_id,
                        policy.max_requests_per_minute(),
                        std::time::Instant::now(),
                    )
                    .map_err(|retry_after_secs| AppError::TooManyRequests { retry_after_secs })?;
            }
            let decided = decide(state, command, now, self.keys.audit.public_key_hex())?;
            let records = seal(state, decided.drafts, &self.keys.audit, now);
            let answer = match respond {
                Respond::Decision => Answer {
                    status: 200,
                    body: serde_json::to_value(&decided.decision)
                        .map_err(|e| AppError::Internal(e.to_string()))?,
                },
                Respond::Status(shape) => {
                    // The status after these records, for the answer (and its idempotent
                    // copy). Only operator writes and outcomes need it, so the clone stays
                    // off the agents' request path.
                    let mut after = state.clone();
                    for record in &records {
                        after.apply(record).map_err(|e| {
                            AppError::Internal(format!("guard refused its own record: {e}"))
                        })?;
                    }
                    shape(after.status())
                }
            };
            (records, answer)
        };
        let idempotency = match idempotency {
            Some(key) => Some(IdempotentAnswer {
                key: key.scoped.clone(),
                status: answer.status,
                body: serde_json::to_string(&answer.body)
                    .map_err(|e| AppError::Internal(e.to_string()))?,
                request: key.request.clone(),
            }),
            None => None,
        };
        // The lines are made here, on the request's own task, so that nothing on the
        // way to the store encodes a record again; one that would not read back as the
        // same record is refused before it is proposed.
        let records = records
            .into_iter()
            .map(RecordLine::new)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| AppError::NotRepresentable(e.to_string()))?;
        let entry = AppendRecords {
            agent_id: agent_id.to_string(),
            records,
            idempotency,
        };
        match self.batcher.write(entry).await {
            Ok(ApplyOutcome::Applied) => Ok(answer),
            Ok(ApplyOutcome::Rejected(reason)) => Err(AppError::Stale(reason)),
            Err(WriteError::NotLeader) => Err(AppError::Unavailable(
                "leadership changed before the write committed; retry with the same Idempotency-Key".into(),
            )),
            Err(WriteError::Failed(e)) => Err(AppError::Unavailable(e)),
        }
    }
}
