//! `lineage-node`: run a guard node, a local three-node cluster, or create keys.
//! With no subcommand it is a drop-in for the reference guard server: it reads
//! `GUARD_DATA_DIR`, `GUARD_BIND` and `GUARD_ADMIN_TOKEN` and runs a one-node cluster.

mod dev_cluster;
mod dev_supervisor;
mod node_import;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use lineage_log_sink::last_words;
use lineage_node::app::WitnessPolicy;
use lineage_node::raft_types::NodeId;
use lineage_node::{keys, NodeConfig};

// A node allocates and frees many small buffers per decision (JSON, records, HTTP);
// glibc's malloc spent about 15% of a 3-node cluster's CPU on them.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc asks for transparent huge pages, and each time it reuses memory it had given
/// back, the kernel zeroes a whole 2 MiB page: 12% of a follower's CPU under load. Linux
/// turns THP off per process; the flag is read at each fault, so it covers memory
/// mapped before this call too.
fn no_transparent_huge_pages() {
    #[cfg(target_os = "linux")]
    // SAFETY: prctl with PR_SET_THP_DISABLE takes integers and touches no memory of ours;
    // a failure (an old kernel, a seccomp filter) only leaves THP as it was.
    unsafe {
        libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0);
    }
}

/// mimalloc gives freed memory back to the OS only once its purge delay (1 s) has passed
/// and some thread next calls into it. A node that goes quiet after start-up or after a
/// burst would keep all that was freed (10,000 agents: 7 MB at 100k records and 11 MB at
/// 1M, after a restart), so this thread makes that call every second, as jemalloc's
/// background thread does. Under load the allocating threads purge anyway.
fn return_freed_memory_while_idle() {
    let spawned = std::thread::Builder::new()
        .name("free-memory".into())
        .spawn(|| {
            // SAFETY: both calls touch only mimalloc's own state and may be made from any
            // thread. mi_collect on a thread whose heap was never set up does nothing, and
            // this thread need not allocate, hence mi_thread_init.
            unsafe { libmimalloc_sys::mi_thread_init() };
            loop {
                std::thread::sleep(std::time::Duration::from_secs(1));
                // SAFETY: as above. `false`: purge only what is past its delay.
                unsafe { libmimalloc_sys::mi_collect(false) };
            }
        });
    if let Err(e) = spawned {
        tracing::warn!("freed memory stays with the allocator until the next load: {e}");
    }
}

#[derive(Parser)]
#[command(name = "lineage-node", version, about = "A Lineage Cluster guard node")]
struct Cli {
    /// Log format: text or json (level: LINEAGE_LOG, e.g. "info,openraft=warn")
    #[arg(
        long,
        global = true,
        env = "LINEAGE_LOG_FORMAT",
        default_value = "text"
    )]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
#[expect(
    clippy::large_enum_variant,
    reason = "parsed once at start-up; `run`'s flags are the node's whole configuration"
)]
enum Command {
    /// Run one node of a cluster
    Run(RunArgs),
    /// Import a reference guard's data directory through Raft: through this node's own
    /// Raft (--data-dir, --keys-dir: it runs as a single-node cluster on a loopback port
    /// until the import is done), or through a running cluster's API (--url). Exits 1
    /// when a file was refused (the report says why)
    Import(ImportArgs),
    /// Run a local cluster on 127.0.0.1 (ports P, P+1, …) until Ctrl-C
    Dev {
        #[arg(long, default_value_t = 3)]
        nodes: u64,
        #[arg(long, default_value_t = 9200)]
        base_port: u16,
        #[arg(long, default_value = "./lineage-data")]
        data_dir: PathBuf,
    },
    /// Create audit.key, token.key, admin.token and cluster.secret in DIR (0600)
    Keygen {
        dir: PathBuf,
        /// Take audit.key and token.key from this reference guard's data directory (its
        /// keys/), so its logs continue and its agents' tokens keep working; the admin
        /// token and the cluster secret are new
        #[arg(long)]
        from_reference: Option<PathBuf>,
    },
    /// Make a development CA and a certificate per node (for --tls-cert/--tls-key/--tls-ca):
    /// DIR/ca.pem, DIR/ca.key, DIR/node-ID.pem, DIR/node-ID.key (keys 0600). Each node's
    /// certificate names the hosts given (DNS names or IPs, as in --advertise) and
    /// lineage://CLUSTER/node/ID; an existing CA in DIR is reused
    Certs {
        #[arg(long)]
        out: PathBuf,
        /// ID=host[,host…], once per node
        #[arg(long = "node", required = true)]
        nodes: Vec<String>,
        /// The cluster's name, as the nodes are given it (--cluster-name)
        #[arg(long, env = "LINEAGE_CLUSTER_NAME", default_value = lineage_node::DEFAULT_CLUSTER_NAME)]
        cluster_name: String,
        /// Days the node certificates are valid
        #[arg(long, default_value_t = 365)]
        days: u32,
    },
    /// Exit 0 if the node on this machine answers /healthz (or /readyz with --ready):
    /// a container HEALTHCHECK for an image with no curl
    Healthcheck {
        /// The node's port on 127.0.0.1 [default: LINEAGE_LISTEN's port, or 9200]
        #[arg(long)]
        port: Option<u16>,
        /// Check /readyz (a leader is known and this node has caught up) instead
        #[arg(long)]
        ready: bool,
    },
    /// Print the heads log's checkpoint verifier key (what a witness is told to trust)
    Vkey {
        /// Directory with audit.key
        #[arg(long, env = "LINEAGE_KEYS_DIR")]
        keys_dir: PathBuf,
        /// The heads log's origin, as the nodes are given it
        #[arg(long, env = "LINEAGE_CLUSTER_NAME", default_value = lineage_node::DEFAULT_CLUSTER_NAME)]
        cluster_name: String,
    },
}

/// The heads log's note verifier key for `cluster_name`, from the audit key in `keys_dir`.
/// How long `healthcheck` waits for the node's answer.
const HEALTHCHECK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3);

fn healthcheck(port: Option<u16>, ready: bool) -> Result<(), String> {
    let port = port
        .or_else(|| {
            std::env::var("LINEAGE_LISTEN")
                .ok()?
                .parse::<SocketAddr>()
                .ok()
                .map(|a| a.port())
        })
        .unwrap_or(9200);
    let path = if ready { "/readyz" } else { "/healthz" };
    // A node with TLS (LINEAGE_TLS_CA set, as for `run`) is asked over HTTPS by the name
    // its certificate gives this machine.
    let ca = std::env::var_os("LINEAGE_TLS_CA").map(PathBuf::from);
    let url = match ca {
        Some(_) => format!("https://localhost:{port}{path}"),
        None => format!("http://127.0.0.1:{port}{path}"),
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("runtime: {e}"))?;
    runtime.block_on(async {
        let mut builder = reqwest::Client::builder()
            .timeout(HEALTHCHECK_TIMEOUT)
            .use_rustls_tls()
            .tls_built_in_root_certs(false);
        if let Some(ca) = &ca {
            builder = lineage_node::tls::trusting_only(builder, ca)?;
        }
        let client = builder.build().map_err(|e| format!("http client: {e}"))?;
        let reply = client
            .get(&url)
            .send()
            .await
            .map_err(|e| format!("{url}: no answer: {e}"))?;
        let status = reply.status();
        let body = reply.text().await.unwrap_or_default();
        if status.is_success() {
            println!("{url}: {status} {}", body.trim());
            Ok(())
        } else {
            Err(format!("{url}: {status} {}", body.trim()))
        }
    })
}

pub(crate) fn heads_vkey(keys_dir: &Path, cluster_name: &str) -> Result<String, String> {
    let audit = lineage_core::AuditKey::load(keys_dir.join(keys::AUDIT_KEY))
        .map_err(|e| format!("audit key: {e}"))?;
    lineage_core::transparency::NoteSigner::new(cluster_name, &audit)
        .map(|signer| signer.vkey())
        .map_err(|e| format!("--cluster-name {cluster_name:?}: {e}"))
}

fn parse_peers(peers: &[String]) -> Result<Vec<(NodeId, String)>, String> {
    peers
        .iter()
        .filter(|p| !p.trim().is_empty())
        .map(|p| {
            let (id, addr) = p
                .split_once('=')
                .ok_or_else(|| format!("peer {p:?} must be id=host:port"))?;
            let id = id
                .trim()
                .parse()
                .map_err(|_| format!("peer id {id:?} is not a number"))?;
            Ok((id, addr.trim().to_string()))
        })
        .collect()
}

/// Sets up the log (`lineage_log_sink`: `flush` writes out what is queued).
fn init_tracing(format: LogFormat) {
    use std::io::IsTerminal;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;
    let filter = tracing_subscriber::EnvFilter::try_from_env("LINEAGE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,openraft=warn"));
    // Colour codes only on a terminal, never into files or `docker logs`.
    let ansi = std::io::stderr().is_terminal();
    let writer = lineage_log_sink::stderr();
    let layer = match format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_ansi(ansi)
            .with_writer(writer)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_current_span(true)
            .with_writer(writer)
            .boxed(),
    };
    tracing_subscriber::registry()
        .with(
            layer
                .with_filter(filter)
                .with_filter(tracing_subscriber::filter::filter_fn(
                    lineage_node::log_noise::keep,
                )),
        )
        .init();
}

/// Exit status of a node stopped by a panic or a fatal Raft or storage error.
const EXIT_FATAL: i32 = 70;

/// A panic anywhere (openraft's core, a storage thread, a request task) ends the process
/// with a clear last line and a non-zero status instead of leaving it half alive: tokio
/// would catch the panic and the node would go on answering 503 ("panicked") forever.
/// Supervisors (`dev`, systemd, compose) restart it, and start-up recovers from disk.
/// The one exception is redb opening the state file, where a panic is taken for damage
/// (`lineage_redb_header::open_checked`).
fn exit_on_panic() {
    std::panic::set_hook(Box::new(|info| {
        if lineage_redb_header::is_catching() {
            // redb opening the state file: taken for damage where it is caught.
            // The node goes on (the file is moved aside): its log must too.
            lineage_log_sink::say(format!("lineage-node: caught: {info}"));
            return;
        }
        let thread = std::thread::current();
        let name = thread.name().unwrap_or("unnamed");
        tracing::error!(thread = name, %info, "fatal: panic; exiting");
        last_words(format!(
            "lineage-node: fatal: panic in thread {name}: {info}"
        ));
        std::process::exit(EXIT_FATAL);
    }));
}

#[derive(clap::Args)]
struct RunArgs {
    /// This node's id (unique in the cluster)
    #[arg(long, env = "LINEAGE_NODE_ID")]
    id: NodeId,
    /// Address to listen on
    #[arg(long, env = "LINEAGE_LISTEN", default_value = "127.0.0.1:9200")]
    listen: SocketAddr,
    /// host:port other nodes use to reach this one (default: --listen)
    #[arg(long, env = "LINEAGE_ADVERTISE")]
    advertise: Option<String>,
    /// Where this node keeps its Raft log and records
    #[arg(long, env = "LINEAGE_DATA_DIR")]
    data_dir: PathBuf,
    /// Directory with audit.key, token.key, admin.token, cluster.secret
    #[arg(long, env = "LINEAGE_KEYS_DIR")]
    keys_dir: PathBuf,
    /// Voters of a new cluster, as id=host:port,id=host:port (the lowest id bootstraps)
    #[arg(long, env = "LINEAGE_PEERS", value_delimiter = ',')]
    peers: Vec<String>,
    #[command(flatten)]
    tuning: Tuning,
}

/// How a node is tuned, besides who it is and where it keeps its data: `run`'s flags,
/// and in drop-in mode the same `LINEAGE_*` variables (`DropInTuning`), so a setting
/// means the same in both modes and neither ignores one.
#[derive(clap::Args)]
struct Tuning {
    /// Snapshot the state machine every this many Raft entries
    #[arg(long, env = "LINEAGE_SNAPSHOT_EVERY", default_value_t = lineage_node::DEFAULT_SNAPSHOT_EVERY)]
    snapshot_every: u64,
    /// Seconds between integrity scrubs of the stored records (0 disables)
    #[arg(long, env = "LINEAGE_SCRUB_INTERVAL_SECS", default_value_t = lineage_node::DEFAULT_SCRUB_INTERVAL_SECS)]
    scrub_interval_secs: u64,
    /// The heads log's origin, also the checkpoint key name (a schema-less URL)
    #[arg(long, env = "LINEAGE_CLUSTER_NAME", default_value = lineage_node::DEFAULT_CLUSTER_NAME)]
    cluster_name: String,
    /// Milliseconds between heads-log rounds
    #[arg(long, env = "LINEAGE_HEADS_INTERVAL_MS", default_value_t = lineage_node::heads_rounds::DEFAULT_HEADS_INTERVAL_MS)]
    heads_interval_ms: u64,
    /// Milliseconds between the state machine's fsynced commits (0: each apply commits
    /// durably before it answers); the Raft log is always fsynced before anything is
    /// acknowledged
    #[arg(long, env = "LINEAGE_STATE_FSYNC_INTERVAL_MS", default_value_t = lineage_node::DEFAULT_STATE_FSYNC_INTERVAL_MS)]
    state_fsync_interval_ms: u64,
    /// While leading, count this node's own log appends as flushed at once so it
    /// replicates while its disk syncs; applies and the commits followers hear still
    /// wait for the fsync (see docs/ARCHITECTURE.md). `false`: every append waits
    /// [default: true; false in drop-in mode, a node with no one to replicate to]
    #[arg(long, env = "LINEAGE_LEADER_EARLY_ACK", action = clap::ArgAction::Set)]
    leader_early_ack: Option<bool>,
    /// Decide an agent's next request on its pending state while the previous one
    /// replicates; the apply-time head check rejects any that a failed write leaves
    /// behind. `false`: each of an agent's writes waits for the one before
    #[arg(long, env = "LINEAGE_PIPELINING", default_value_t = true, action = clap::ArgAction::Set)]
    pipelining: bool,
    /// Refuse Raft requests and answers that carry no body SHA-256 (nodes of a build
    /// before digests send none). Turn on once every node runs a build that sends
    /// them: a digest header damaged on the way can then no longer skip the check
    #[arg(long, env = "LINEAGE_REQUIRE_RAFT_DIGESTS", default_value_t = false, action = clap::ArgAction::Set)]
    require_raft_digests: bool,
    /// A witness's cosignature verifier key (name+id+key); repeat for several. A
    /// witnessed checkpoint is stored only when enough of them cosigned it
    #[arg(
        long = "witness-key",
        env = "LINEAGE_WITNESS_KEYS",
        value_delimiter = ','
    )]
    witness_keys: Vec<String>,
    /// How many of the --witness-key witnesses must cosign (default: 1 when any are given)
    #[arg(long, env = "LINEAGE_WITNESS_QUORUM")]
    witness_quorum: Option<usize>,
    /// Free space (MiB) the data directory's disk keeps: below it the leader answers
    /// new writes 507 insufficient_storage, recording nothing, until space returns
    #[arg(long, env = "LINEAGE_DISK_RESERVE_MB", default_value_t = lineage_node::disk_reserve::DEFAULT_DISK_RESERVE_MB)]
    disk_reserve_mb: u64,
    /// Milliseconds a durable write (Raft log or state file) may wait for the disk
    /// before this node steps back: no heartbeats, no elections, 503 to what it
    /// would serve itself as leader, until the disk answers (0: never; else >= 1000)
    #[arg(long, env = "LINEAGE_DISK_STALL_MS", default_value_t = millis(lineage_node::disk_stall::DEFAULT_STALL_AFTER))]
    disk_stall_ms: u64,
    /// Seconds a stored Idempotency-Key answer is kept for retries; after that the
    /// same key makes a new request. Give every node the same
    #[arg(long, env = "LINEAGE_IDEMPOTENCY_WINDOW_SECS", default_value_t = IDEMPOTENCY_WINDOW_SECS, value_parser = clap::value_parser!(u64).range(1..))]
    idempotency_window_secs: u64,
    #[command(flatten)]
    connections: ConnectionFlags,
    #[command(flatten)]
    tls: TlsFlags,
}

/// The drop-in mode takes its tuning from the environment alone (it has no flags).
#[derive(clap::Parser)]
#[command(name = "lineage-node")]
struct DropInTuning {
    #[command(flatten)]
    tuning: Tuning,
}

/// Who a node is and where it keeps its data.
struct NodeIdentity {
    id: NodeId,
    listen: SocketAddr,
    advertise: String,
    data_dir: PathBuf,
    keys_dir: PathBuf,
    peers: Vec<(NodeId, String)>,
    admin_token: Option<String>,
    reference_dir: Option<PathBuf>,
}

impl Tuning {
    /// The node's whole configuration. `early_ack_default` is this mode's
    /// `--leader-early-ack` when none is given.
    fn node_config(self, who: NodeIdentity, early_ack_default: bool) -> Result<NodeConfig, String> {
        let Tuning {
            snapshot_every,
            scrub_interval_secs,
            cluster_name,
            heads_interval_ms,
            state_fsync_interval_ms,
            leader_early_ack,
            pipelining,
            require_raft_digests,
            witness_keys,
            witness_quorum,
            disk_reserve_mb,
            disk_stall_ms,
            idempotency_window_secs,
            connections,
            tls,
        } = self;
        let witnesses = WitnessPolicy::new(witness_keys, witness_quorum)?;
        let tls_reload_poll = tls.reload_poll();
        let tls = tls.files()?;
        Ok(NodeConfig {
            id: who.id,
            listen: who.listen,
            advertise: who.advertise,
            data_dir: who.data_dir,
            keys_dir: who.keys_dir,
            peers: who.peers,
            admin_token: who.admin_token,
            snapshot_every,
            scrub_interval: scrub_interval(scrub_interval_secs),
            cluster_name,
            heads_interval: std::time::Duration::from_millis(heads_interval_ms.max(10)),
            state_fsync_interval: std::time::Duration::from_millis(state_fsync_interval_ms),
            leader_early_ack: leader_early_ack.unwrap_or(early_ack_default),
            pipelining,
            require_raft_digests,
            tls,
            tls_reload_poll,
            reference_dir: who.reference_dir,
            witnesses,
            disk_reserve_bytes: disk_reserve_mb.saturating_mul(1024 * 1024),
            disk_stall_after: disk_stall(disk_stall_ms)?,
            max_connections: connections.max_connections,
            http_header_timeout: connections.header_timeout(),
            http_idle_timeout: connections.idle_timeout(),
            idempotency_window: std::time::Duration::from_secs(idempotency_window_secs),
        })
    }
}

impl RunArgs {
    fn run(self) -> Result<(), String> {
        let RunArgs {
            id,
            listen,
            advertise,
            data_dir,
            keys_dir,
            peers,
            tuning,
        } = self;
        let who = NodeIdentity {
            id,
            listen,
            advertise: advertise.unwrap_or_else(|| listen.to_string()),
            data_dir,
            keys_dir,
            peers: parse_peers(&peers)?,
            admin_token: None,
            reference_dir: None,
        };
        serve(tuning.node_config(who, true)?)
    }
}

#[derive(clap::Args)]
struct ImportArgs {
    /// The reference guard's data directory (keys/, agents/*.jsonl)
    #[arg(long)]
    from: PathBuf,
    /// This node's data directory (import through its own Raft)
    #[arg(long, env = "LINEAGE_DATA_DIR")]
    data_dir: Option<PathBuf>,
    /// This node's keys (made by `keygen --from-reference`)
    #[arg(long, env = "LINEAGE_KEYS_DIR")]
    keys_dir: Option<PathBuf>,
    /// A running cluster's node URLs, comma-separated (import through its API)
    #[arg(long, value_delimiter = ',')]
    url: Vec<String>,
    /// With --url: the admin token's file
    #[arg(long)]
    token_file: Option<PathBuf>,
}

impl ImportArgs {
    fn run(self) -> Result<(), String> {
        node_import::import(&node_import::ImportTarget {
            from: self.from,
            urls: self.url,
            token_file: self.token_file,
            data_dir: self.data_dir,
            keys_dir: self.keys_dir,
        })
    }
}

fn main() -> ExitCode {
    no_transparent_huge_pages();
    let cli = Cli::parse();
    init_tracing(cli.log_format);
    exit_on_panic();
    let result = match cli.command {
        Some(Command::Healthcheck { port, ready }) => healthcheck(port, ready),
        Some(Command::Keygen {
            dir,
            from_reference,
        }) => match from_reference {
            None => keys::keygen(&dir),
            Some(reference) => keys::keygen_from_reference(&dir, &reference),
        }
        .map(|()| {
            println!("keys written to {} (mode 0600)", dir.display());
        }),
        Some(Command::Vkey {
            keys_dir,
            cluster_name,
        }) => heads_vkey(&keys_dir, &cluster_name).map(|vkey| println!("{vkey}")),
        Some(Command::Certs {
            out,
            nodes,
            cluster_name,
            days,
        }) => lineage_node::dev_certs::make(&out, &nodes, &cluster_name, days).map(|written| {
            for path in written {
                println!("{}", path.display());
            }
        }),
        Some(Command::Run(args)) => args.run(),
        Some(Command::Dev {
            nodes,
            base_port,
            data_dir,
        }) => dev_cluster::dev(nodes, base_port, &data_dir),
        Some(Command::Import(args)) => args.run(),
        None => reference_mode(),
    };
    match result {
        Ok(()) => {
            lineage_log_sink::flush();
            ExitCode::SUCCESS
        }
        Err(e) => {
            last_words(format!("lineage-node: {e}"));
            ExitCode::FAILURE
        }
    }
}

/// How many client connections a node keeps open, and for how long.
#[derive(clap::Args)]
struct ConnectionFlags {
    /// Open client connections at most; at the cap the quietest idle one is closed to
    /// make room [default: half the open-file limit, which the node raises to its hard limit]
    #[arg(long, env = "LINEAGE_MAX_CONNECTIONS")]
    max_connections: Option<usize>,
    /// Milliseconds a request's headers may take to arrive (and a request body may stall)
    #[arg(long, env = "LINEAGE_HTTP_HEADER_TIMEOUT_MS", default_value_t = millis(lineage_http_server::DEFAULT_HEADER_TIMEOUT))]
    http_header_timeout_ms: u64,
    /// Milliseconds a connection may sit with no request and no byte moving
    #[arg(long, env = "LINEAGE_HTTP_IDLE_TIMEOUT_MS", default_value_t = millis(lineage_http_server::DEFAULT_IDLE_TIMEOUT))]
    http_idle_timeout_ms: u64,
}

#[derive(clap::Args, Debug)]
struct TlsFlags {
    /// This node's certificate chain (PEM): serve HTTPS, and present it to peers. Needs
    /// --tls-key and --tls-ca; every node of a cluster runs with TLS or none does
    #[arg(long, env = "LINEAGE_TLS_CERT")]
    tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM)
    #[arg(long, env = "LINEAGE_TLS_KEY")]
    tls_key: Option<PathBuf>,
    /// CA bundle (PEM) that peers' and clients' certificates are checked against
    #[arg(long, env = "LINEAGE_TLS_CA")]
    tls_ca: Option<PathBuf>,
    /// Milliseconds between checks of the TLS files for a renewal (SIGHUP reloads at once)
    #[arg(long, env = "LINEAGE_TLS_RELOAD_POLL_MS", default_value_t = millis(lineage_node::tls_reload::DEFAULT_POLL))]
    tls_reload_poll_ms: u64,
}

impl TlsFlags {
    fn reload_poll(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.tls_reload_poll_ms.max(10))
    }

    fn files(self) -> Result<Option<lineage_node::tls::TlsFiles>, String> {
        match (self.tls_cert, self.tls_key, self.tls_ca) {
            (None, None, None) => Ok(None),
            (Some(cert), Some(key), Some(ca)) => {
                Ok(Some(lineage_node::tls::TlsFiles { cert, key, ca }))
            }
            _ => Err("TLS needs all three of --tls-cert, --tls-key and --tls-ca".into()),
        }
    }
}

impl ConnectionFlags {
    fn header_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.http_header_timeout_ms.max(1))
    }

    fn idle_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.http_idle_timeout_ms.max(1))
    }
}

fn millis(d: std::time::Duration) -> u64 {
    d.as_millis() as u64
}

fn scrub_interval(secs: u64) -> Option<std::time::Duration> {
    (secs > 0).then(|| std::time::Duration::from_secs(secs))
}

fn serve(config: NodeConfig) -> Result<(), String> {
    return_freed_memory_while_idle();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("runtime: {e}"))?
        // The node runs as a task on a worker, not on this thread: start-up allocates
        // every agent's state, and what the workers later free of it stays in this
        // thread's allocator pages, which only this thread collects, and it would only
        // wait here. 10,000 agents at 1M records, two runs: 8-19 MB less after a load,
        // 4-6 MB more while idle after a restart (the worker keeps start-up's pages).
        .block_on(async {
            tokio::spawn(lineage_node::run(config))
                .await
                .map_err(|e| format!("the node's main task: {e}"))?
        })
}

/// The reference guard server's environment and key layout, as a one-node cluster.
fn reference_mode() -> Result<(), String> {
    let data_dir =
        PathBuf::from(std::env::var("GUARD_DATA_DIR").unwrap_or_else(|_| "guard-data".into()));
    let bind = std::env::var("GUARD_BIND").unwrap_or_else(|_| "127.0.0.1:9200".into());
    let listen: SocketAddr = bind
        .parse()
        .map_err(|e| format!("GUARD_BIND {bind:?} is not an address: {e}"))?;
    let admin_token = match std::env::var("GUARD_ADMIN_TOKEN") {
        Ok(token) => Some(token),
        Err(std::env::VarError::NotPresent) => None,
        Err(e) => return Err(format!("GUARD_ADMIN_TOKEN: {e}")),
    };
    // The same LINEAGE_* settings as `run`'s flags; an invalid one stops start-up,
    // before any key is written.
    let tuning = <DropInTuning as clap::Parser>::try_parse_from(["lineage-node"])
        .map_err(|e| format!("drop-in mode's settings: {}", drop_in_setting_error(&e)))?
        .tuning;
    let keys_dir = data_dir.join("keys");
    let generate_admin_token = admin_token.is_none();
    let who = NodeIdentity {
        id: 1,
        listen,
        advertise: listen.to_string(),
        data_dir: data_dir.join("node"),
        keys_dir: keys_dir.clone(),
        peers: vec![(1, listen.to_string())],
        admin_token,
        reference_dir: Some(data_dir.clone()),
    };
    let config = tuning.node_config(who, false)?;
    keys::create_missing(&keys_dir, !generate_admin_token)?;
    let scheme = if config.tls.is_some() {
        "https"
    } else {
        "http"
    };
    println!("lineage-node listening on {scheme}://{listen}");
    println!("  data dir    {}", data_dir.display());
    if generate_admin_token {
        println!(
            "  admin token from {}",
            keys_dir.join(keys::ADMIN_TOKEN).display()
        );
    }
    serve(config)
}

/// A bad value among the drop-in mode's settings, named by its variable: clap names the
/// flag, which the drop-in mode does not take ("LINEAGE_PIPELINING: invalid value
/// 'sometimes' [possible values: true, false]").
fn drop_in_setting_error(error: &clap::Error) -> String {
    use clap::error::{ContextKind, ContextValue};
    let rendered = error.to_string();
    let mut lines = rendered
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("For more information"));
    let mut text = lines
        .next()
        .unwrap_or_default()
        .trim_start_matches("error: ")
        .to_string();
    for more in lines {
        text.push(' ');
        text.push_str(more);
    }
    let Some(ContextValue::String(flag)) = error.get(ContextKind::InvalidArg) else {
        return text;
    };
    let command = <DropInTuning as clap::CommandFactory>::command();
    let variable = command
        .get_arguments()
        .find(|arg| {
            arg.get_long()
                .is_some_and(|long| flag.split(' ').next() == Some(&format!("--{long}")))
        })
        .and_then(|arg| arg.get_env())
        .map(|name| name.to_string_lossy().into_owned());
    match variable {
        Some(variable) => format!(
            "{variable}: {}",
            text.replace(&format!(" for '{flag}'"), "")
        ),
        None => text,
    }
}

/// `--disk-stall-ms`: 0 turns the check off; otherwise at least a second.
fn disk_stall(ms: u64) -> Result<Option<std::time::Duration>, String> {
    let after = std::time::Duration::from_millis(ms);
    match ms {
        0 => Ok(None),
        _ if after < lineage_node::disk_stall::MIN_STALL_AFTER => Err(format!(
            "--disk-stall-ms (LINEAGE_DISK_STALL_MS) must be 0 (off) or at least {}",
            millis(lineage_node::disk_stall::MIN_STALL_AFTER)
        )),
        _ => Ok(Some(after)),
    }
}

const IDEMPOTENCY_WINDOW_SECS: u64 = lineage_node::store::idempotency_expiry::DEFAULT_WINDOW_SECS;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disk_stall_is_off_at_zero_and_at_least_a_second_otherwise() {
        assert_eq!(disk_stall(0), Ok(None));
        let refused = disk_stall(999).expect_err("under a second");
        assert!(refused.contains("at least 1000"), "{refused}");
        assert_eq!(
            disk_stall(1000),
            Ok(Some(std::time::Duration::from_secs(1)))
        );
    }
}
