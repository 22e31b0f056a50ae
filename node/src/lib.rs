//! `lineage_node`: a Lineage Cluster guard node. [`run`] wires it top to bottom:
//! config → keys → storage → network → raft → app → routes.
//!
//! # Follow a write
//!
//! An agent's `POST /v1/agents/{id}/actions`, function by function:
//!
//! 1. [`api::router`] routes it; [`api::forward::route_to_leader`] relays it to the leader
//!    unless this node leads.
//! 2. [`api::agents::request_action`] checks the token, parses the body and binds its
//!    Idempotency-Key to the request ([`api::idempotency::WriteBody`]).
//! 3. [`app::App::execute`] takes the agent's turn ([`agent_lanes::Lane::turn`]); a
//!    stored answer for the key is replayed, a full disk refuses ([`disk_reserve`]), then
//!    [`lineage_core::guard::decide`] and [`lineage_core::guard::seal`] make the signed
//!    records on the agent's pending state, each turned into the line every node will
//!    store ([`raft_types::RecordLine::new`]).
//! 4. [`batcher::Batcher::propose`] queues the write in the turn's order and joins
//!    concurrent writes into one Raft entry ([`raft_types::Proposal::Writes`]); with
//!    pipelining the turn passes to the agent's next request now.
//! 5. openraft appends it to [`store::log_store::LogStore`]: one write and fdatasync per
//!    group, then the [`store::watermark`]; followers get it through
//!    [`network::raft_client`] and [`network::raft_routes`].
//! 6. Once a quorum holds it, [`store::StateMachine`] applies it:
//!    [`store::state_machine::check_extends`] (seq, prev_hash, hash, actor), then the
//!    guard fold; [`store::sm_writer`] commits the rows behind it.
//! 7. The leader's `execute` answers with the decision (and stored it under the key).

// openraft's error types (StorageError, RaftError) are large by design and appear in
// every storage signature; boxing them would fight the trait definitions.
#![allow(clippy::result_large_err)]

pub mod agent_lanes;
pub mod answer_expiry;
pub mod api;
pub mod app;
pub mod batcher;
pub mod console;
pub mod dev_certs;
pub mod disk_reserve;
pub mod disk_stall;
pub mod disk_watch;
pub mod election_hold;
pub mod heads_rounds;
pub mod idempotency_key;
pub mod import_writes;
pub mod keys;
pub mod log_noise;
pub mod log_pace;
pub mod metrics;
pub mod network;
pub mod operator_changes;
pub mod raft_types;
pub mod read_rounds;
pub mod reference_logs;
pub mod request_rate;
pub mod rotating_secrets;
pub mod scrub;
pub mod snapshot_spool;
pub mod spare_cores;
pub mod store;
pub mod tls;
pub mod tls_reload;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use app::App;
use raft_types::NodeId;

/// How long a node waits for a peer's Raft RPC before it counts as failed.
const RAFT_CONNECT_TIMEOUT_MS: u64 = 500;
const HEARTBEAT_INTERVAL_MS: u64 = 50;
/// Each node draws its election timeout from its own window, staggered by id, so two
/// survivors cannot keep splitting the vote (openraft 0.9 draws the timeout once per
/// process).
const ELECTION_TIMEOUT_BASE_MS: u64 = 200;
const ELECTION_TIMEOUT_STAGGER_MS: u64 = 100;

pub struct NodeConfig {
    pub id: NodeId,
    pub listen: SocketAddr,
    /// The `host:port` peers use to reach this node.
    pub advertise: String,
    pub data_dir: PathBuf,
    pub keys_dir: PathBuf,
    /// Every voter of a new cluster, `(id, host:port)`; the lowest id bootstraps it.
    pub peers: Vec<(NodeId, String)>,
    /// Overrides `keys/admin.token` (the reference's `GUARD_ADMIN_TOKEN`).
    pub admin_token: Option<String>,
    /// Build a snapshot (and let older log entries be purged) every this many entries.
    pub snapshot_every: u64,
    /// Re-verify every stored record this often; `None` disables the scrub.
    pub scrub_interval: Option<Duration>,
    /// The heads log's origin and checkpoint key name (a schema-less URL).
    pub cluster_name: String,
    /// How often the leader appends a heads round for the agents that changed.
    pub heads_interval: Duration,
    /// How often the state machine commits with an fsync (zero: each apply, before it answers).
    pub state_fsync_interval: Duration,
    /// The leader counts its own appends as flushed at once (`log_store`).
    pub leader_early_ack: bool,
    /// One agent's next write is decided while its previous one replicates (`agent_lanes`).
    pub pipelining: bool,
    /// Raft requests and answers without a body SHA-256 (from a build before digests)
    /// are refused rather than read unchecked (`network::raft_routes`, `raft_client`).
    pub require_raft_digests: bool,
    /// TLS on the node's port and to its peers (`tls`); `None`: plain HTTP.
    pub tls: Option<tls::TlsFiles>,
    /// How often the TLS files' modification times are checked for a reload.
    pub tls_reload_poll: Duration,
    /// The directory whose `agents/*.jsonl` (reference guard logs) must be held by the
    /// cluster before this node serves (`reference_logs`); `None`: `data_dir`.
    pub reference_dir: Option<PathBuf>,
    /// Witnesses whose cosignatures a stored witnessed checkpoint must carry.
    pub witnesses: app::WitnessPolicy,
    /// Free bytes the data directory's disk keeps; below it writes are refused (507).
    pub disk_reserve_bytes: u64,
    /// How long a durable write may wait for the disk before this node steps back
    /// (`disk_stall`); `None`: never.
    pub disk_stall_after: Option<Duration>,
    /// Open client connections at most (`None`: half the open-file limit).
    pub max_connections: Option<usize>,
    /// How long a request head (or a stalled request body) may take to arrive.
    pub http_header_timeout: Duration,
    /// How long a connection may sit with no request and no byte moving.
    pub http_idle_timeout: Duration,
    /// How long a stored Idempotency-Key answer is kept (`store::idempotency_expiry`).
    pub idempotency_window: Duration,
}

pub use store::DEFAULT_STATE_FSYNC_INTERVAL_MS;

/// Default [`NodeConfig::cluster_name`].
pub const DEFAULT_CLUSTER_NAME: &str = "lineage.local/cluster";

/// Longest wait at start-up for this node to re-apply what its own log says is committed.
const REPLAY_WAIT: Duration = Duration::from_secs(600);

/// Default seconds between scrub passes.
pub const DEFAULT_SCRUB_INTERVAL_SECS: u64 = 300;

/// Default for [`NodeConfig::snapshot_every`].
pub const DEFAULT_SNAPSHOT_EVERY: u64 = 10_000;
/// Log entries kept behind a snapshot, so briefly lagging followers need no snapshot.
const LOGS_KEPT_BEHIND_SNAPSHOT: u64 = 1_000;
/// Snapshot chunks travel as JSON arrays of numbers (about 3.6 bytes a byte), so keep
/// each one a small request: openraft's 3 MiB default made an 11 MiB body.
const SNAPSHOT_CHUNK_BYTES: u64 = 256 * 1024;
/// How long one snapshot chunk may take. The last one includes installing the whole
/// snapshot on the follower (replaying every agent's records), which takes seconds for a
/// large state; openraft's 200 ms default failed it on every retry, so a wiped node with a
/// few megabytes of state to receive never came back.
const INSTALL_SNAPSHOT_TIMEOUT_MS: u64 = 60_000;

/// The Raft configuration of node `id` (its election timeout staggered by id); public
/// so the in-process simulation (`tests/sim/`) runs nodes configured as `run` does.
pub fn raft_config(
    id: NodeId,
    snapshot_every: u64,
    elect: bool,
) -> Result<openraft::Config, String> {
    let min = ELECTION_TIMEOUT_BASE_MS + (id % 5) * ELECTION_TIMEOUT_STAGGER_MS;
    openraft::Config {
        cluster_name: "lineage".into(),
        heartbeat_interval: HEARTBEAT_INTERVAL_MS,
        election_timeout_min: min,
        election_timeout_max: min + ELECTION_TIMEOUT_STAGGER_MS,
        snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(snapshot_every.max(1)),
        max_in_snapshot_log_to_keep: LOGS_KEPT_BEHIND_SNAPSHOT.min(snapshot_every),
        snapshot_max_chunk_size: SNAPSHOT_CHUNK_BYTES,
        install_snapshot_timeout: INSTALL_SNAPSHOT_TIMEOUT_MS,
        enable_elect: elect,
        ..Default::default()
    }
    .validate()
    .map_err(|e| format!("raft config: {e}"))
}

/// Starts a node and serves until SIGINT or SIGTERM.
#[expect(
    clippy::too_many_lines,
    reason = "start-up wiring in order (keys, storage, network, raft, app, routes); each step depends on the one before"
)]
pub async fn run(config: NodeConfig) -> Result<(), String> {
    let keys = keys::load(&config.keys_dir, config.admin_token.clone())?;
    let open_files = lineage_http_server::raise_open_file_limit();
    let http_limits = lineage_http_server::Limits::new(
        config.max_connections,
        config.http_header_timeout,
        config.http_idle_timeout,
    );
    tracing::debug!(
        open_files,
        max_connections = http_limits.max_connections,
        "connection limits"
    );
    // Refuse a name no note can be signed under before anything starts.
    lineage_core::transparency::NoteSigner::new(&config.cluster_name, &keys.audit)
        .map_err(|e| format!("--cluster-name: {e}"))?;
    let metrics = Arc::new(metrics::Metrics::new(config.id));
    let configured_alone = config.peers.iter().all(|(id, _)| *id == config.id);
    let (log_store, state_machine) = store::open_with(
        &config.data_dir,
        config.state_fsync_interval,
        configured_alone,
    )?;
    let disk_watch = Arc::new(disk_watch::DiskWatch::default());
    let mut log_store = log_store
        .with_append_timer(metrics.log_append_duration.clone())
        .with_disk_watch(disk_watch.clone());
    let mut state_machine = state_machine
        .with_disk_reserve(config.disk_reserve_bytes)
        .with_disk_watch(disk_watch.clone());
    // Never the leader of its old term after a restart, whatever `--leader-early-ack` is
    // now: entries it acknowledged early and lost before a crash may be on followers
    // under the same log ids (`LogStore::leading_as`), and a log under repair is cut.
    // The cost: an election after a leader restarts.
    log_store.demote_own_leadership(config.id);
    let mut durable_log = None;
    if config.leader_early_ack {
        log_store = log_store.leading_as(config.id);
        let gate = log_store.durability();
        state_machine = state_machine.behind(gate.clone());
        durable_log = Some(gate);
    }
    let committed_index = log_store.committed_index.clone();
    // What this node must have applied before its reference-log check (only when its data
    // directory has reference logs at all): the cluster's only voter commits its whole
    // log once it leads again (its committed hint may lag the log by a flush); a member
    // of a larger cluster re-applies, with no peer, what it knew committed.
    let reference_dir = config.reference_dir.as_ref().unwrap_or(&config.data_dir);
    let has_reference_logs = reference_logs::present(reference_dir)?;
    let only_voter = store::single_voter(&state_machine, configured_alone);
    let replay_to = if !has_reference_logs {
        0
    } else if only_voter {
        use openraft::storage::RaftLogStorage;
        log_store
            .get_log_state()
            .await
            .map_err(|e| format!("reading the Raft log: {e}"))?
            .last_log_id
            .map_or(0, |id| id.index)
    } else {
        committed_index.load(std::sync::atomic::Ordering::Relaxed)
    };
    let log_handle = log_store.durability();
    let repairing = log_handle.repair_floor().is_some();
    if let Some(floor) = log_handle.repair_floor() {
        if store::single_voter(&state_machine, configured_alone) {
            // No peer can repair the only voter: say what was lost and what to do.
            return Err(format!(
                "this node may have lost acknowledged decisions ({}), and as its cluster's \
                 only voter no peer can repair it. Restore {} from a backup, or accept the \
                 loss of the entries up to {:?} by deleting {}",
                floor.reason,
                config.data_dir.display(),
                floor.floor,
                config
                    .data_dir
                    .join(store::RAFT_LOG_DIR)
                    .join(store::repair_floor::FLOOR_FILE)
                    .display()
            ));
        }
    }
    let tls_server = config
        .tls
        .clone()
        .map(|files| tls::TlsServer::load(files, &config.cluster_name, config.id))
        .transpose()?;
    let connect_timeout = Duration::from_millis(RAFT_CONNECT_TIMEOUT_MS);
    let http = tls::PeerClient::new(tls::peer_client(config.tls.as_ref(), connect_timeout)?);
    // From here on SIGHUP reloads TLS (or is ignored), never kills the node.
    tls_reload::spawn(
        tls_server.clone(),
        http.clone(),
        keys.secrets.clone(),
        connect_timeout,
        metrics.clone(),
        config.tls_reload_poll,
    );
    let scheme = if config.tls.is_some() {
        "https"
    } else {
        "http"
    };
    let peer_contacts = Arc::new(network::peer_contacts::PeerContacts::default());
    let network = network::raft_client::RaftHttp {
        client: http.clone(),
        scheme,
        secrets: keys.secrets.clone(),
        durable_log,
        contacts: peer_contacts.clone(),
        disk: disk_watch.clone(),
        withheld: metrics.raft_replication_withheld.clone(),
        answers_refused: metrics.raft_answers_refused.clone(),
        answers_without_digest: metrics
            .raft_messages_without_digest
            .with_label_values(&["answer"]),
        require_digests: config.require_raft_digests,
    };
    let raft = openraft::Raft::new(
        config.id,
        Arc::new(raft_config(config.id, config.snapshot_every, !repairing)?),
        network,
        log_store,
        state_machine.clone(),
    )
    .await
    .map_err(|e| format!("raft: {e}"))?;
    // Reference guard logs are checked against the state as of `replay_to`, so it is
    // re-applied first (the state machine's last durable commit may be older). 0: no
    // entry that holds an agent (a fresh node has applied nothing yet).
    if replay_to > 0 {
        raft.wait(Some(REPLAY_WAIT))
            .applied_index_at_least(Some(replay_to), "replay before the reference-log check")
            .await
            .map_err(|e| format!("replaying this node's log: {e}"))?;
    }
    let reserved_ids = if has_reference_logs {
        // Reads and verifies whole files: off the workers, which Raft's timers now need.
        let (dir, sm) = (reference_dir.to_path_buf(), state_machine.clone());
        let ignore = std::env::var(reference_logs::IGNORE_VAR).is_ok_and(|v| v == "1");
        tokio::task::spawn_blocking(move || reference_logs::check(&dir, &sm, ignore, only_voter))
            .await
            .map_err(|e| format!("checking reference logs: {e}"))??
    } else {
        Default::default()
    };

    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|e| {
            format!(
                "cannot listen on {}: {e} (is another lineage-node running?)",
                config.listen
            )
        })?;

    let lowest_peer = config.peers.iter().map(|(id, _)| *id).min();
    if lowest_peer == Some(config.id) {
        let members = network::management::initial_members(&config.peers);
        // Refused (harmlessly) when this node's log already holds a membership.
        if let Err(e) = raft.initialize(members).await {
            tracing::debug!(error = %e, "cluster already initialised");
        }
    }

    if let Some(interval) = config.scrub_interval {
        scrub::spawn(
            state_machine.clone(),
            keys.audit.public_key_hex().to_string(),
            interval,
            metrics.clone(),
        );
    }
    let elections = {
        let raft = raft.clone();
        election_hold::ElectionHold::new(move |on| raft.runtime_config().elect(on), repairing)
    };
    if repairing {
        spawn_campaign_after_repair(elections.clone(), log_handle.clone());
    }
    let _disk_stall = match config.disk_stall_after {
        Some(after) => {
            let (raft, elections) = (raft.clone(), elections.clone());
            let step_back = disk_stall::StepBack {
                heartbeats: Box::new(move |on| raft.runtime_config().heartbeat(on)),
                elections: Box::new(move |stalled| elections.disk_stalled(stalled)),
            };
            Some(disk_stall::spawn(
                disk_watch.clone(),
                after,
                step_back,
                metrics.clone(),
            )?)
        }
        None => None,
    };
    let disk = state_machine.disk_reserve();
    spawn_record_merges(state_machine.clone());
    answer_expiry::spawn(
        state_machine.clone(),
        config.idempotency_window,
        metrics.clone(),
    );
    spawn_exit_on_fatal(raft.clone());
    heads_rounds::spawn(
        raft.clone(),
        state_machine.clone(),
        disk.clone(),
        disk_watch.clone(),
        config.id,
        config.cluster_name.clone(),
        config.heads_interval,
    );
    let app = Arc::new(
        App::new(
            config.id,
            raft.clone(),
            state_machine.clone(),
            keys,
            http,
            metrics,
            committed_index,
        )
        .with_heads_origin(config.cluster_name.clone())
        .with_witnesses(config.witnesses.clone())
        .with_pipelining(config.pipelining)
        .with_tls(config.tls.is_some())
        .with_raft_digests_required(config.require_raft_digests)
        .with_reserved_ids(reserved_ids)
        .with_log(log_handle)
        .with_disk_reserve(disk)
        .with_peer_contacts(peer_contacts)
        .with_elections(elections)
        .with_disk_watch(disk_watch)
        .with_state_refuse_after(config.disk_stall_after),
    );
    let connection_metrics = app.metrics.clone();

    let router = api::router(app);
    tracing::info!(id = config.id, listen = %config.listen, advertise = %config.advertise, "lineage-node serving");
    lineage_http_server::serve(
        listener,
        router,
        http_limits,
        connection_metrics,
        tls_server,
        shutdown_signal(),
    )
    .await;
    let _ = raft.shutdown().await;
    // So the next start replays only what follows these checkpoints (below the disk
    // reserve there are none: it replays more). A stop is clean only once every applied
    // row is committed.
    match state_machine
        .flush()
        .and_then(|()| state_machine.checkpoint_agents())
    {
        Ok(_) => store::mark_clean_stop(&config.data_dir),
        Err(e) => {
            tracing::warn!(error = %e, "could not commit and checkpoint the state at shutdown")
        }
    }
    Ok(())
}

/// Exit status when openraft stops on a fatal error (`main.rs` uses the same for panics).
const EXIT_FATAL: i32 = 70;

/// When openraft stops on a fatal error (a failed log write or fsync, a storage assertion,
/// a panic in its core), the node exits with a clear last line instead of staying up and
/// answering 503: its supervisor restarts it and start-up recovers from disk.
fn spawn_exit_on_fatal(raft: raft_types::Raft) {
    let mut metrics = raft.metrics();
    tokio::spawn(async move {
        loop {
            let state = metrics.borrow().running_state.clone();
            if let Some(fatal) = state
                .err()
                .filter(|f| !matches!(f, openraft::error::Fatal::Stopped))
            {
                tracing::error!(error = %fatal, "fatal: raft stopped; exiting");
                lineage_log_sink::last_words(format!("lineage-node: fatal: raft stopped: {fatal}"));
                std::process::exit(EXIT_FATAL);
            }
            if metrics.changed().await.is_err() {
                // Raft shut down (graceful stop): nothing more to watch.
                return;
            }
        }
    });
}

/// How often the records written since the last pass are packed.
const RECORD_MERGE_INTERVAL: Duration = Duration::from_secs(1);

/// Packs the raw record rows the writer's commits leave into compressed runs
/// (`StateMachine::merge_record_runs`), so records cost well under their lines on disk
/// (0.4 of them with 200-byte inputs of random letters, `benches` `memory_growth`).
/// A pass waits while the disk is below its reserve (`StateMachine::own_commits_wait`).
fn spawn_record_merges(state_machine: store::state_machine::StateMachine) {
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(RECORD_MERGE_INTERVAL).await;
            let sm = state_machine.clone();
            match tokio::task::spawn_blocking(move || sm.merge_record_runs(false)).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => tracing::warn!(error = %e, "could not merge record rows"),
                Err(e) => tracing::warn!(error = %e, "record merge task failed"),
            }
        }
    });
}

/// A node under repair starts with elections off (`store::repair_floor`); they go back on
/// once its log has passed the floor (and no snapshot stream holds them, `election_hold`).
fn spawn_campaign_after_repair(
    elections: Arc<election_hold::ElectionHold>,
    log: store::log_store::DurableLog,
) {
    tokio::spawn(async move {
        while log.repair_floor().is_some() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        tracing::info!("repaired: this node's log has passed its repair floor");
        elections.repaired();
    });
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = terminate => {},
    }
    tracing::info!("shutting down");
}
