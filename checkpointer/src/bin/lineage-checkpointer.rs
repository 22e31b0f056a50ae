//! `lineage-checkpointer`: monitors a cluster's heads log, gets its checkpoints cosigned
//! by witnesses, and stores the cosigned notes back in the cluster.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use lineage_checkpointer::checkpointer::{Checkpointer, WitnessTarget};
use lineage_checkpointer::checkpointer_metrics::Metrics;
use lineage_checkpointer::cluster_client::ClusterClient;

/// Connections the metrics port keeps open at most (Prometheus needs one or two).
const METRICS_MAX_CONNECTIONS: usize = 64;

#[derive(Parser)]
#[command(
    name = "lineage-checkpointer",
    version,
    about = "Monitor a Lineage Cluster's heads log and get its checkpoints witnessed"
)]
struct Cli {
    /// Cluster node URLs, tried in turn (http://host:port,...)
    #[arg(long, env = "LINEAGE_CLUSTER", value_delimiter = ',', required = true)]
    cluster: Vec<String>,
    /// CA bundle (PEM) the cluster's https:// nodes' certificates must chain to
    #[arg(long, env = "LINEAGE_CLUSTER_CA")]
    cluster_ca: Option<PathBuf>,
    /// A witness: its submission URL and cosignature vkey, URL=VKEY (repeatable)
    #[arg(long = "witness", env = "LINEAGE_WITNESSES", value_delimiter = ' ')]
    witnesses: Vec<String>,
    /// Where the checkpointer keeps its state and evidence files
    #[arg(
        long,
        env = "LINEAGE_CHECKPOINTER_DIR",
        default_value = "./checkpointer-data"
    )]
    data_dir: PathBuf,
    /// The heads log's verifier key; by default fetched from the cluster at the first
    /// start and pinned in the data dir
    #[arg(long, env = "LINEAGE_LOG_VKEY")]
    log_vkey: Option<String>,
    /// File with the token that stores cosigned checkpoints in the cluster: a
    /// `publisher` operator's (`lineage operator add checkpointer --role publisher`)
    #[arg(
        long,
        env = "LINEAGE_CHECKPOINTER_TOKEN_FILE",
        conflicts_with = "admin_token_file"
    )]
    token_file: Option<PathBuf>,
    /// File with the cluster's shared admin token, where no publisher operator exists
    /// (it can do far more than store checkpoints: prefer --token-file)
    #[arg(long, env = "LINEAGE_ADMIN_TOKEN_FILE")]
    admin_token_file: Option<PathBuf>,
    /// Milliseconds between rounds
    #[arg(long, env = "LINEAGE_CHECKPOINTER_INTERVAL_MS", default_value_t = 1000)]
    interval_ms: u64,
    /// Cosignatures needed before a checkpoint counts as witnessed (for the age metric)
    #[arg(long, env = "LINEAGE_CHECKPOINTER_QUORUM", default_value_t = 1)]
    quorum: usize,
    /// Where /metrics and /healthz are served
    #[arg(
        long,
        env = "LINEAGE_CHECKPOINTER_METRICS",
        default_value = "127.0.0.1:9296"
    )]
    metrics_listen: SocketAddr,
    /// Stop after this many rounds (default: run until SIGINT/SIGTERM)
    #[arg(long)]
    rounds: Option<u64>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    lineage_checkpointer::init_tracing();
    let result = tokio::runtime::Runtime::new()
        .map_err(|e| e.to_string())
        .and_then(|runtime| runtime.block_on(run(cli)));
    match result {
        Ok(()) => {
            lineage_log_sink::flush();
            ExitCode::SUCCESS
        }
        Err(e) => {
            // What is queued first, then the error line.
            lineage_log_sink::last_words(format!("lineage-checkpointer: {e}"));
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> Result<(), String> {
    let witnesses = cli
        .witnesses
        .iter()
        .filter(|w| !w.is_empty())
        .map(|w| WitnessTarget::parse(w))
        .collect::<Result<Vec<_>, _>>()?;
    if cli.quorum > witnesses.len() {
        return Err(format!(
            "--quorum {} is more than the {} witnesses given",
            cli.quorum,
            witnesses.len()
        ));
    }
    let publish_token = match cli.token_file.as_ref().or(cli.admin_token_file.as_ref()) {
        Some(path) => Some(
            std::fs::read_to_string(path)
                .map_err(|e| format!("cannot read {}: {e}", path.display()))?
                .trim()
                .to_string(),
        ),
        None => None,
    };
    let interval = Duration::from_millis(cli.interval_ms.max(10));
    let metrics = Metrics::new(interval.as_secs_f64()).map_err(|e| e.to_string())?;
    let cluster = ClusterClient::with_ca(
        cli.cluster.clone(),
        publish_token,
        cli.cluster_ca.as_deref(),
    )?;
    let checkpointer = Checkpointer::open(
        &cli.data_dir,
        cluster,
        witnesses,
        cli.quorum,
        cli.log_vkey.clone(),
        metrics.clone(),
    )
    .await
    .map_err(|e| e.to_string())?;
    let listener = tokio::net::TcpListener::bind(cli.metrics_listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", cli.metrics_listen))?;
    let metrics = Arc::new(metrics);
    let metrics_for_http = metrics.clone();
    let routes = axum::Router::new()
        .route(
            "/metrics",
            axum::routing::get(move || {
                let m = metrics_for_http.clone();
                async move { m.render() }
            }),
        )
        .route("/healthz", axum::routing::get(|| async { "ok\n" }));
    // Prometheus is the only expected client: a small cap, and the usual timeouts.
    let limits = lineage_http_server::Limits::new(
        Some(METRICS_MAX_CONNECTIONS),
        lineage_http_server::DEFAULT_HEADER_TIMEOUT,
        lineage_http_server::DEFAULT_IDLE_TIMEOUT,
    );
    tokio::spawn(lineage_http_server::serve(
        listener,
        routes,
        limits,
        metrics,
        None::<lineage_http_server::NoTls>,
        std::future::pending(),
    ));
    tracing::info!(log_vkey = checkpointer.log_vkey(), metrics = %cli.metrics_listen, "lineage-checkpointer running");
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut done = 0u64;
    let stop = lineage_checkpointer::shutdown_signal();
    tokio::pin!(stop);
    loop {
        tokio::select! {
            _ = &mut stop => return Ok(()),
            _ = ticker.tick() => {}
        }
        let report = checkpointer.round().await.map_err(|e| e.to_string())?;
        if report.new_statements > 0 || !report.cosigned_by.is_empty() {
            tracing::info!(
                size = report.size,
                statements = report.new_statements,
                cosigned_by = ?report.cosigned_by,
                stored = report.stored,
                "round"
            );
        }
        done += 1;
        if cli.rounds.is_some_and(|n| done >= n) {
            return Ok(());
        }
    }
}
