//! `lineage_checkpointer`: the checkpointer (heads-log monitor and witness client,
//! `lineage-checkpointer`) and an external tlog-witness (`lineage-witness`).

pub mod checkpointer;
pub mod checkpointer_metrics;
pub mod cluster_client;
pub mod reply_text;
pub mod store_file;
pub mod witness;
pub mod witness_server;

/// Log lines to stderr, filtered by `LINEAGE_LOG` (default `info`), for both binaries,
/// through a queue of 8,192 lines that a thread of its own writes out: when whatever
/// reads stderr stops (a hung supervisor, a log driver on a stalled disk), a line that
/// finds the queue full is dropped rather than holding the task that logs it (every
/// refused add-checkpoint is logged, so a flood of them would otherwise stop the
/// witness once the pipe filled). `lineage_log_sink::flush` writes out what is queued
/// before the process ends.
pub fn init_tracing() {
    use std::io::IsTerminal;
    let writer = lineage_log_sink::stderr();
    tracing_subscriber::fmt()
        // Colour codes only on a terminal, never into files or `docker logs`.
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("LINEAGE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(writer)
        .init();
}

/// Resolves on SIGINT or SIGTERM (what `docker stop` and systemd send), for both
/// binaries' graceful shutdown.
pub async fn shutdown_signal() {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {},
        _ = terminate => {},
    }
}
