//! Shared node state and the leader's decision path.
//!
//! Per agent, decisions are taken one at a time in the agent's lane (`agent_lanes`):
//! decide on the pending state (or the applied one), seal, queue for Raft, then wait
//! until the entry is applied on this node and answer; with pipelining on, the agent's
//! next request is decided meanwhile. Different agents proceed in parallel, and the
//! batcher puts concurrent writes into one Raft entry.

use std::sync::Arc;

use lineage_core::guard::{
    decide, seal, Action, AgentState, Command, GuardError, PendingAction, PendingRequest, Status,
};
use lineage_core::record::{timestamp, Record};
use openraft::error::{CheckIsLeaderError, RaftError};
use serde_json::Value;

use crate::agent_lanes::{Lanes, Turn};
use crate::batcher::{Batcher, WriteError};
use crate::disk_reserve::DiskReserve;
use crate::idempotency_key::IdempotencyKey;
use crate::keys::ClusterKeys;
use crate::network::peer_contacts::PeerContacts;
use crate::raft_types::{
    AppendRecords, ApplyOutcome, Authority, IdempotentAnswer, NodeId, Raft, RecordLine,
};
use crate::store::agent_slot::AgentSlot;
use crate::store::log_store::DurableLog;
use crate::store::state_machine::RecordError;
use crate::store::StateMachine;

/// Longest wait for an agent's turn, or for the writes ahead of a refusal (`execute`):
/// writes of a deposed leader may stay unanswered until the new leader's log reaches
/// them.
const TURN_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// How long a read waits for this leader to apply its whole log before answering 503.
const READ_CATCH_UP: std::time::Duration = std::time::Duration::from_secs(3);

pub struct App {
    pub id: NodeId,
    pub raft: Raft,
    pub sm: StateMachine,
    pub keys: ClusterKeys,
    /// One HTTP client for forwarding (and Raft), reused for its connection pool; replaced
    /// when the node's certificate is reloaded.
    pub http: crate::tls::PeerClient,
    /// `http` or `https`: how this node reaches its peers (forwarding).
    pub scheme: &'static str,
    /// With TLS, `/raft/*` requires a peer certificate naming a node of this cluster.
    pub tls: bool,
    /// Raft requests without a body SHA-256 are refused, not read unchecked
    /// (`--require-raft-digests`, `network::raft_routes`).
    pub require_raft_digests: bool,
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
    /// Leadership confirmations for linearizable reads, shared (`read_rounds`).
    read_rounds: crate::read_rounds::ReadRounds<Result<Lead, RoundError>>,
    /// This node's Raft log as the disk has it: its repair floor (`store::repair_floor`).
    pub log: Option<DurableLog>,
    /// When each peer last answered this node's Raft RPCs (`peer_contacts`).
    pub peers: Arc<PeerContacts>,
    /// Free space the leader keeps before it seals anything (`disk_reserve`).
    disk: Option<DiskReserve>,
    /// When this node may stand for election (`election_hold`); none: Raft's own
    /// setting is never changed (nodes built in-process by tests).
    pub elections: Option<Arc<crate::election_hold::ElectionHold>>,
    /// The durable writes in flight, and whether the disk is held for stalled
    /// (`disk_stall`); none: never stalled (nodes built in-process by tests).
    disk_watch: Option<Arc<crate::disk_watch::DiskWatch>>,
    /// How long readers of the state may have been kept out before requests that read
    /// it are refused at once (`state_busy`): --disk-stall-ms.
    state_refuse_after: Option<std::time::Duration>,
    batcher: Batcher,
    lanes: Lanes,
    /// Agent ids that may not be created: reference guard logs for them lie in the data
    /// directory (`reference_logs`).
    reserved_ids: std::collections::BTreeSet<String>,
    request_rate: crate::request_rate::RequestRate,
    /// Operator changes, one at a time (`operator_changes`).
    operator_changes: crate::operator_changes::OperatorChanges,
    /// Import steps, one at a time (`import_writes`).
    import_writes: crate::import_writes::ImportWrites,
}

/// Whole-log reads at once (`App::whole_log_reads`).
const WHOLE_LOG_READS: usize = 2;
/// Requests that may wait for the state's lock at once, each on a thread of tokio's
/// blocking pool (512 by default, shared with applies and file work): past this one
/// more is refused at once (`App::state_busy`). Requests wait only while a write holds
/// or waits for the lock: an apply's few hundred µs, a heads commit's fsync.
const MAX_STATE_WAITERS: usize = 256;

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

/// Why a leadership round failed, shared by the reads that waited for it.
#[derive(Clone, Debug)]
enum RoundError {
    NoLeader,
    Unavailable(String),
}

/// Who serves a request: this node (it is the confirmed leader, caught up) or the
/// leader at `addr`.
#[derive(Clone, Debug)]
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
    /// A reference guard log for this id lies in the data directory, not imported.
    #[error("agent id {0} is reserved: a reference guard log for it is in this node's data directory and was not imported")]
    IdReserved(String),
    #[error("agent log failed verification: {0}")]
    Quarantined(String),
    #[error("no leader is available right now; retry")]
    NoLeader,
    #[error("{0}")]
    Unavailable(String),
    /// This node steps back from a disk that has not answered, or from a state a write
    /// on it holds (`App::disk_stalled`, `App::state_busy`): ask another node.
    #[error("{0}")]
    SteppingBack(String),
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
    /// The agent's log is being imported: nothing is served for it until the import
    /// commits.
    #[error("agent {0} is being imported; it is served once the import completes")]
    Importing(String),
    /// An import step that does not hold (`store::imports`); nothing changed.
    #[error("{0}")]
    ImportRefused(String),
    /// An operator change the registry refuses (`lineage_core::operators`).
    #[error(transparent)]
    Operator(lineage_core::operators::ChangeError),
    #[error("{0}")]
    Internal(String),
}

impl App {
    pub fn new(
        id: NodeId,
        raft: Raft,
        sm: StateMachine,
        keys: ClusterKeys,
        http: crate::tls::PeerClient,
        metrics: Arc<crate::metrics::Metrics>,
        committed_index: Arc<std::sync::atomic::AtomicU64>,
    ) -> Self {
        App {
            id,
            elections: None,
            disk_watch: None,
            state_refuse_after: None,
            metrics,
            committed_index,
            batcher: Batcher::spawn(raft.clone()),
            raft,
            sm,
            keys,
            http,
            scheme: "http",
            tls: false,
            require_raft_digests: false,
            request_rate: crate::request_rate::RequestRate::default(),
            lanes: Lanes::new(true),
            reserved_ids: std::collections::BTreeSet::new(),
            heads_origin: String::new(),
            witnesses: WitnessPolicy::default(),
            log: None,
            peers: Arc::default(),
            disk: None,
            whole_log_reads: tokio::sync::Semaphore::new(WHOLE_LOG_READS),
            read_rounds: Default::default(),
            operator_changes: Default::default(),
            import_writes: Default::default(),
        }
    }

    /// The node's election hold, made where its Raft is (`election_hold`).
    pub fn with_elections(mut self, elections: Arc<crate::election_hold::ElectionHold>) -> Self {
        self.elections = Some(elections);
        self
    }

    /// The durable writes this node's stores report (`disk_watch`).
    pub fn with_disk_watch(mut self, watch: Arc<crate::disk_watch::DiskWatch>) -> Self {
        self.disk_watch = Some(watch);
        self
    }

    /// Refuses requests that read the state at once once its readers have been kept
    /// out for `after` (`None`: never for how long, only for how many wait).
    pub fn with_state_refuse_after(mut self, after: Option<std::time::Duration>) -> Self {
        self.state_refuse_after = after;
        self
    }

    /// Why a request that reads this node's state should not wait for it: a write has
    /// kept readers out for longer than the node judges its disk stalled after (a commit
    /// waiting on that disk), or too many already wait (each on a thread of its own,
    /// `data_lock`).
    pub fn state_busy(&self) -> Option<String> {
        let waiters = self.sm.state_waiters();
        if waiters >= MAX_STATE_WAITERS {
            return Some(format!(
                "{waiters} requests are already waiting for this node's state"
            ));
        }
        let after = self.state_refuse_after?;
        let blocked = self.sm.state_blocked_for().filter(|b| *b >= after)?;
        Some(format!(
            "this node's state has been held by a write waiting on its disk for {:.1} s",
            blocked.as_secs_f64()
        ))
    }

    /// Why this node steps back while its disk is stalled (`disk_stall`): the write that
    /// has waited longest, and for how long.
    pub fn disk_stalled(&self) -> Option<String> {
        let watch = self.disk_watch.as_ref().filter(|w| w.stalled())?;
        Some(match watch.oldest() {
            Some((write, age)) => format!(
                "this node's disk has not finished a write ({}) for {:.1} s",
                write.name(),
                age.as_secs_f64()
            ),
            None => "this node's disk has just answered again".to_string(),
        })
    }

    /// Peers are reached over TLS, and only nodes' certificates may speak Raft.
    pub fn with_tls(mut self, on: bool) -> Self {
        self.scheme = if on { "https" } else { "http" };
        self.tls = on;
        self
    }

    /// Raft requests without a body SHA-256 are refused (every node runs a build that
    /// sends them).
    pub fn with_raft_digests_required(mut self, required: bool) -> Self {
        self.require_raft_digests = required;
        self
    }

    /// Agent ids that creating is refused for (`reference_logs`).
    pub fn with_reserved_ids(mut self, ids: std::collections::BTreeSet<String>) -> Self {
        self.reserved_ids = ids;
        self
    }

    /// Turns pipelining of one agent's writes on or off (`agent_lanes`; on by default).
    pub fn with_pipelining(mut self, on: bool) -> Self {
        self.lanes = Lanes::new(on);
        self
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
        self.metrics.linearizable_reads.inc();
        let confirmed = self
            .read_rounds
            .confirm(|| async {
                self.metrics.read_rounds.inc();
                self.confirm_leadership().await
            })
            .await
            .map_err(|e| match e {
                RoundError::NoLeader => AppError::NoLeader,
                RoundError::Unavailable(why) => AppError::Unavailable(why),
            })?;
        if let Lead::Here = confirmed {
            // openraft 0.9 reads at max(committed, the leader's first entry of its
            // term). A leader restarted within its term (kill -9 of every node) has a
            // committed index rolled back to what was on disk and an old first entry,
            // so entries acknowledged before the restart may not be applied yet.
            // Reading at the leader's last log index, read after the round, covers all
            // of them.
            let last = self.raft.metrics().borrow().last_log_index;
            self.raft
                .wait(Some(READ_CATCH_UP))
                .applied_index_at_least(last, "linearizable read")
                .await
                .map_err(|e| AppError::Unavailable(format!("not caught up for a read yet: {e}")))?;
        }
        Ok(confirmed)
    }

    /// One round of openraft's leadership check (a heartbeat to every follower), which
    /// `read_rounds` shares among the reads that may use it.
    async fn confirm_leadership(&self) -> Result<Lead, RoundError> {
        match self.raft.ensure_linearizable().await {
            Ok(_) => Ok(Lead::Here),
            Err(RaftError::APIError(CheckIsLeaderError::ForwardToLeader(f))) => match f.leader_node
            {
                Some(node) if f.leader_id != Some(self.id) => Ok(Lead::Forward(node.addr)),
                _ => Err(RoundError::NoLeader),
            },
            Err(RaftError::APIError(CheckIsLeaderError::QuorumNotEnough(_))) => {
                Err(RoundError::NoLeader)
            }
            Err(e) => Err(RoundError::Unavailable(e.to_string())),
        }
    }

    /// `lead`, for changes only the confirmed leader makes: `NoLeader` (503) when this node
    /// does not lead (it may only believe it does: cut off, or removed).
    pub async fn confirm_leading(&self) -> Result<(), AppError> {
        match self.lead().await? {
            Lead::Here => Ok(()),
            Lead::Forward(_) => Err(AppError::NoLeader),
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

    /// Makes a change in the system log (`operator_changes`: an operator added or
    /// revoked, an agent's token reissued) as this node, the confirmed leader, with
    /// everything committed applied; `by` names who asked. Applied here on return.
    pub async fn change_operators(
        &self,
        change: lineage_core::operators::Change,
        by: &str,
    ) -> Result<(), AppError> {
        self.confirm_leading().await?;
        use crate::operator_changes::ChangeFailed;
        self.operator_changes
            .apply(&self.raft, &self.sm, &self.keys.audit, change, by)
            .await
            .map_err(|failed| match failed {
                ChangeFailed::Refused(e) => AppError::Operator(e),
                ChangeFailed::NotCommitted(_) => AppError::Unavailable(failed.to_string()),
                ChangeFailed::Stale(reason) => AppError::Stale(reason),
                ChangeFailed::Internal(e) => AppError::Internal(e),
            })
    }

    /// Takes one step of importing an agent's log (`import_writes`) as this node, the
    /// confirmed leader, caught up. Returns the records a commit sealed.
    pub async fn import_step(
        &self,
        step: crate::raft_types::ImportStep,
    ) -> Result<Vec<lineage_core::Record>, AppError> {
        self.confirm_leading().await?;
        use crate::import_writes::ImportFailed;
        self.import_writes
            .take(&self.raft, &self.sm, &self.keys.audit, step)
            .await
            .map_err(|failed| match failed {
                ImportFailed::Refused(reason) => AppError::ImportRefused(reason),
                ImportFailed::NotCommitted(_) => AppError::Unavailable(failed.to_string()),
                ImportFailed::Internal(e) => AppError::Internal(e),
            })
    }

    /// Runs `f` on the agent's applied state, or says why it cannot be served here.
    pub fn with_agent<T>(
        &self,
        agent_id: &str,
        f: impl FnOnce(&AgentState) -> T,
    ) -> Result<T, AppError> {
        let data = self.sm.read_data();
        if data.imports.contains_key(agent_id) {
            return Err(AppError::Importing(agent_id.to_string()));
        }
        match data.agents.get(agent_id) {
            None => Err(AppError::AgentNotFound),
            Some(AgentSlot::Quarantined(reason)) => Err(AppError::Quarantined(reason.clone())),
            Some(AgentSlot::Active(state)) => Ok(f(state)),
        }
    }

    /// One action as the API shows it. Memory holds an action's status only, waiting or
    /// decided; its tool, input and cost are read back from this node's copy of its
    /// request record (after the state lock is let go: the read takes it again).
    pub fn action(&self, agent_id: &str, action_id: &str) -> Result<Option<Action>, AppError> {
        let Some(kept) = self.with_agent(agent_id, |s| s.action_view(action_id))? else {
            return Ok(None);
        };
        let request = self.request_record(agent_id, kept.requested_seq, action_id)?;
        kept.view(action_id, &request)
            .map(Some)
            .map_err(AppError::Internal)
    }

    /// An agent's approval queue in log order, each entry's request read back from the
    /// log (memory keeps no inputs). An entry whose request does not read back intact
    /// here is listed apart, so the rest of the queue can still be decided.
    pub fn pending(&self, agent_id: &str) -> Result<QueueView, AppError> {
        let queue = self.with_agent(agent_id, |s| s.pending())?;
        let mut view = QueueView::default();
        for entry in &queue {
            match self.pending_view(agent_id, entry) {
                Ok(shown) => view.pending.push(shown),
                Err(EntryError::Unreadable(why)) => view
                    .unreadable
                    .push(UnreadableRequest::of(agent_id, entry, why)),
                Err(EntryError::Failed(error)) => return Err(error),
            }
        }
        Ok(view)
    }

    /// One approval queue entry, its request read back from the log (taken with no lock on
    /// the state held: the read takes it again).
    pub fn pending_view(
        &self,
        agent_id: &str,
        entry: &PendingRequest,
    ) -> Result<PendingAction, EntryError> {
        let request = self.request_record(agent_id, entry.seq, &entry.action_id)?;
        entry.view(&request).map_err(EntryError::Unreadable)
    }

    /// The `action_requested` record at `seq`, `action_id`'s.
    fn request_record(
        &self,
        agent_id: &str,
        seq: u64,
        action_id: &str,
    ) -> Result<Record, EntryError> {
        match self.sm.record_at(agent_id, seq) {
            Ok(Some(record)) => Ok(record),
            Ok(None) => Err(EntryError::Unreadable(format!(
                "the request of {action_id} is not stored here"
            ))),
            Err(RecordError::Damaged(why)) => Err(EntryError::Unreadable(format!(
                "the request of {action_id} does not read back: {why}"
            ))),
            // Nothing about this entry: the node cannot serve the page (503, so clients
            // ask another node).
            Err(RecordError::Store(why)) => Err(EntryError::Failed(AppError::Unavailable(
                format!("reading the request of {action_id}: the store cannot be read: {why}"),
            ))),
        }
    }

    /// The leader's write path for one command. `respond` turns the decision and the
    /// agent's status after the write into the HTTP answer.
    pub async fn execute(
        &self,
        agent_id: &str,
        command: Command,
        idempotency: Option<IdempotencyKey>,
        respond: Respond,
        authority: Option<Authority>,
    ) -> Result<Answer, AppError> {
        let lane = self.lanes.lane(agent_id);
        let key = idempotency.as_ref().map(|key| key.scoped.as_str());
        let (mut caught_up, mut waited_for_writes_ahead) = (false, false);
        let mut attempt = Attempt {
            command: &command,
            idempotency: &idempotency,
            respond: &respond,
            authority: &authority,
            rate_admitted: false,
        };
        // At most three rounds: each way round ends the loop the second time.
        loop {
            let turn = tokio::time::timeout(TURN_WAIT, lane.turn(key))
                .await
                .map_err(|_| {
                    AppError::Unavailable(
                        "this agent's earlier writes are not answered yet; retry".into(),
                    )
                })?;
            match self.decide_and_write(turn, agent_id, &mut attempt).await {
                Ok(answer) => return Ok(answer),
                // Refused on a pending state: the writes ahead of it may yet fail, and the
                // refusal with them. Once they are answered, decide once more.
                Err(NotDone::RefusedAhead { error, queued }) => {
                    if waited_for_writes_ahead
                        || tokio::time::timeout(TURN_WAIT, lane.answered(queued))
                            .await
                            .is_err()
                    {
                        return Err(error);
                    }
                    waited_for_writes_ahead = true;
                }
                // Decided on a state the log does not hold: this node has just become
                // leader and is behind, or (pipelining) a write queued before it was not
                // applied. Catch up with everything committed and decide once more (a
                // broken lane drains before the next turn).
                Err(NotDone::Failed(AppError::Stale(reason))) => {
                    if caught_up {
                        return Err(AppError::Unavailable(format!(
                            "the write was not applied ({reason}); retry"
                        )));
                    }
                    caught_up = true;
                    tracing::debug!(
                        agent_id,
                        reason,
                        "write decided on stale state; deciding again"
                    );
                    self.raft
                        .ensure_linearizable()
                        .await
                        .map_err(|_| AppError::NoLeader)?;
                }
                Err(NotDone::Failed(error)) => return Err(error),
            }
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

    /// Decides one write on the agent's pending state (or its applied state), queues it
    /// while `turn` is held, and waits for its outcome: with pipelining on, after giving
    /// the turn to the agent's next write.
    async fn decide_and_write(
        &self,
        mut turn: Turn<'_>,
        agent_id: &str,
        attempt: &mut Attempt<'_>,
    ) -> Result<Answer, NotDone> {
        let idempotency = attempt.idempotency;
        if let Some(key) = idempotency {
            if let Some(answer) = self.stored_answer(agent_id, key)? {
                return Ok(answer);
            }
        }
        // A full disk refuses before anything is decided or sealed: the request leaves no
        // trace, and its retry is decided afresh once space returns.
        self.check_disk()?;
        let mut sealed = self.decide_locked(&mut turn, agent_id, attempt)?;
        // Checked again at apply, where the system log is current (`Authority`).
        sealed.entry.authority.clone_from(attempt.authority);
        // Until the write is queued, the lane has no pending state (it was taken to make
        // `after`): going away here breaks the lane.
        let unqueued = turn.unqueued();
        let proposed = self
            .batcher
            .propose(sealed.entry)
            .await
            .map_err(write_error)?;
        let in_flight = turn.in_flight(idempotency.as_ref().map(|key| key.scoped.clone()));
        unqueued.queued();
        if let Some(after) = sealed.after.filter(|_| self.lanes.pipelining()) {
            turn.set_pending(after);
        }
        if sealed.pipelined {
            self.metrics.writes_pipelined.inc();
        }
        // The outcome is awaited on a task of its own, so that the write counts as in
        // flight (and its key as taken) until it is answered, even when this request's
        // caller goes away.
        let (outcome_tx, outcome_rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let outcome = proposed.outcome().await;
            if matches!(outcome, Ok(ApplyOutcome::Applied)) {
                in_flight.applied();
            } else {
                drop(in_flight);
            }
            let _ = outcome_tx.send(outcome);
        });
        if self.lanes.pipelining() {
            // The next write of this agent may be decided now, on the pending state.
            drop(turn);
        }
        let outcome = outcome_rx
            .await
            .map_err(|_| AppError::Unavailable("the write was dropped".into()))?;
        match outcome {
            Ok(ApplyOutcome::Applied) => Ok(sealed.answer),
            Ok(ApplyOutcome::Rejected(reason)) => {
                self.metrics.writes_rejected_at_apply.inc();
                Err(AppError::Stale(reason).into())
            }
            Err(error) => Err(write_error(error).into()),
        }
    }

    /// Spends one of the agent's requests per minute on a request (`request_rate`), once
    /// per request: one refused ahead of writes in flight, or decided on a stale state, is
    /// decided again (`execute`) and spends none the second time.
    fn admit_request(
        &self,
        agent_id: &str,
        state: &AgentState,
        attempt: &mut Attempt<'_>,
    ) -> Result<(), AppError> {
        if let (Command::Request { .. }, Some(policy), false) =
            (attempt.command, &state.policy, attempt.rate_admitted)
        {
            self.request_rate
                .admit(
                    agent_id,
                    policy.max_requests_per_minute(),
                    std::time::Instant::now(),
                )
                .map_err(|retry_after_secs| AppError::TooManyRequests { retry_after_secs })?;
            attempt.rate_admitted = true;
        }
        Ok(())
    }

    /// Decides `command`, seals its records and makes the entry to queue, with the
    /// answer it will get once applied and the agent's state after it. A pending state
    /// it decided on is taken out of the turn (`decide_and_write` puts `after` back once
    /// the entry is queued).
    fn decide_locked(
        &self,
        turn: &mut Turn<'_>,
        agent_id: &str,
        attempt: &mut Attempt<'_>,
    ) -> Result<Sealed, NotDone> {
        let (command, idempotency, respond) =
            (attempt.command, attempt.idempotency, attempt.respond);
        let now = timestamp::now_micros();
        let data = self.sm.read_data();
        if let Some(error) = while_importing(&data, agent_id, command) {
            return Err(error.into());
        }
        let applied = match data.agents.get(agent_id) {
            Some(AgentSlot::Quarantined(reason)) => {
                return Err(AppError::Quarantined(reason.clone()).into())
            }
            Some(AgentSlot::Active(state)) => Some(&**state),
            None => None,
        };
        let applied_head = applied
            .and_then(|s| s.head.as_ref())
            .map(|h| h.hash.as_str());
        let empty = AgentState::new();
        let in_flight = turn.writes_in_flight();
        let queued = turn.writes_queued();
        let pending = turn.pending_state(applied_head);
        let from_pending = pending.is_some();
        let pipelined = from_pending && in_flight > 0;
        // A refusal decided on writes that are not applied yet may not hold once they are.
        let refused = |error: AppError| match pipelined {
            true => NotDone::RefusedAhead { error, queued },
            false => NotDone::Failed(error),
        };
        let state: &AgentState = match (pending.or(applied), command) {
            (Some(_), Command::Create { .. }) => return Err(refused(AppError::AgentExists)),
            (Some(state), _) => state,
            (None, Command::Create { .. }) if self.reserved_ids.contains(agent_id) => {
                return Err(AppError::IdReserved(agent_id.to_string()).into())
            }
            (None, Command::Create { .. }) => &empty,
            (None, _) => return Err(AppError::AgentNotFound.into()),
        };
        self.admit_request(agent_id, state, attempt)?;
        let decided = decide(state, command, now, self.keys.audit.public_key_hex())
            .map_err(|e| refused(AppError::Guard(e)))?;
        let records = seal(state, decided.drafts, &self.keys.audit, now);
        // The lines are made here, on the request's own task, so that nothing on the way
        // to the store encodes a record again; one that would not read back as the same
        // record is refused before it is proposed.
        let lines = records
            .into_iter()
            .map(RecordLine::new)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| AppError::NotRepresentable(e.to_string()))?;
        // The state after these records: the next pending state, and the status some
        // answers show. The applied state is copied under the data lock, folded after it.
        let base = if !(self.lanes.pipelining() || matches!(respond, Respond::Status(_))) {
            None
        } else if from_pending {
            turn.take_pending()
        } else {
            Some(applied.cloned().unwrap_or_else(AgentState::new))
        };
        drop(data);
        let after = match base {
            Some(mut after) => {
                // Folded from what each line reads back as, as every node will.
                for line in &lines {
                    let folded = line.record().and_then(|record| {
                        after
                            .apply(&record)
                            .map_err(|e| format!("guard refused its own record: {e}"))
                    });
                    if let Err(e) = folded {
                        turn.break_lane();
                        return Err(AppError::Internal(e).into());
                    }
                }
                Some(after)
            }
            None => None,
        };
        let answered = answer_and_copy(respond, &after, &decided.decision, idempotency);
        let (answer, idempotency) = match answered {
            Ok(answered) => answered,
            Err(error) => {
                if from_pending {
                    turn.break_lane();
                }
                return Err(error.into());
            }
        };
        let entry = AppendRecords {
            agent_id: agent_id.to_string(),
            records: lines,
            idempotency,
            authority: None,
        };
        Ok(Sealed {
            entry,
            answer,
            after,
            pipelined,
        })
    }
}

/// Why one queue entry (or action) could not be shown.
#[derive(Debug)]
pub enum EntryError {
    /// Its request record does not read back intact here: the entry alone.
    Unreadable(String),
    /// The node cannot read its store at all: the whole answer fails.
    Failed(AppError),
}

impl From<EntryError> for AppError {
    fn from(error: EntryError) -> AppError {
        match error {
            EntryError::Unreadable(why) => AppError::Internal(why),
            EntryError::Failed(error) => error,
        }
    }
}

/// An agent's approval queue as this node can show it.
#[derive(Debug, Default)]
pub struct QueueView {
    pub pending: Vec<PendingAction>,
    pub unreadable: Vec<UnreadableRequest>,
}

/// A waiting action whose request record does not read back intact on this node
/// (damaged or missing here; the scrub quarantines such a copy): listed with why, never
/// with an input, so the rest of a queue stays readable.
#[derive(Debug, Clone, serde::Serialize)]
pub struct UnreadableRequest {
    pub agent_id: String,
    pub action_id: String,
    /// The `seq` of the request's record.
    pub seq: u64,
    pub error: String,
}

impl UnreadableRequest {
    pub fn of(agent_id: &str, entry: &PendingRequest, error: String) -> Self {
        tracing::error!(
            agent_id,
            action_id = %entry.action_id,
            seq = entry.seq,
            %error,
            "a waiting action's request does not read back intact on this node"
        );
        UnreadableRequest {
            agent_id: agent_id.to_string(),
            action_id: entry.action_id.clone(),
            seq: entry.seq,
            error,
        }
    }
}

/// The answer a write gets once applied, and its copy stored under the request's
/// Idempotency-Key.
fn answer_and_copy(
    respond: &Respond,
    after: &Option<AgentState>,
    decision: &Option<lineage_core::guard::Decision>,
    idempotency: &Option<IdempotencyKey>,
) -> Result<(Answer, Option<IdempotentAnswer>), AppError> {
    let answer = match (respond, after) {
        (Respond::Status(shape), Some(after)) => shape(after.status()),
        _ => Answer {
            status: 200,
            body: serde_json::to_value(decision).map_err(|e| AppError::Internal(e.to_string()))?,
        },
    };
    let copy = match idempotency {
        Some(key) => Some(IdempotentAnswer {
            key: key.scoped.clone(),
            status: answer.status,
            body: serde_json::to_string(&answer.body)
                .map_err(|e| AppError::Internal(e.to_string()))?,
            request: key.request.clone(),
        }),
        None => None,
    };
    Ok((answer, copy))
}

/// A write decided and sealed, not yet queued.
struct Sealed {
    entry: AppendRecords,
    answer: Answer,
    /// The agent's state after the write (pipelining on, or an answer that shows it).
    after: Option<AgentState>,
    /// Decided on a pending state while earlier writes were in flight.
    pipelined: bool,
}

/// One write as `execute` hands it to each try at deciding it.
struct Attempt<'a> {
    command: &'a Command,
    idempotency: &'a Option<IdempotencyKey>,
    respond: &'a Respond,
    authority: &'a Option<Authority>,
    /// Whether the request has spent one of the agent's requests per minute already.
    rate_admitted: bool,
}

/// Why `decide_and_write` gave no answer.
enum NotDone {
    /// Refused on a pending state, with `queued` writes of the lane queued before it:
    /// the refusal may not hold once they are answered (one of them may fail).
    RefusedAhead {
        error: AppError,
        queued: u64,
    },
    Failed(AppError),
}

impl From<AppError> for NotDone {
    fn from(error: AppError) -> Self {
        NotDone::Failed(error)
    }
}

/// What the caller of a write that failed in the batcher is told.
/// Why `command` cannot be decided while the agent's log is being imported (a create
/// finds the id taken, anything else waits for the commit), or once its id is reserved
/// for good by a tombstone.
fn while_importing(
    data: &crate::store::state_machine::SmData,
    agent_id: &str,
    command: &Command,
) -> Option<AppError> {
    if data.tombstones.contains_key(agent_id) {
        return Some(AppError::IdReserved(agent_id.to_string()));
    }
    data.imports.contains_key(agent_id).then(|| match command {
        Command::Create { .. } => AppError::AgentExists,
        _ => AppError::Importing(agent_id.to_string()),
    })
}

fn write_error(error: WriteError) -> AppError {
    match error {
        WriteError::NotLeader => AppError::Unavailable(
            "leadership changed before the write committed; retry with the same Idempotency-Key"
                .into(),
        ),
        WriteError::Failed(e) => AppError::Unavailable(e),
    }
}
