//! Reloads without a restart. On SIGHUP: the rotating secrets (`rotating_secrets`: the
//! cluster secret's lines, the admin token and its previous one), and the node's
//! certificate. The certificate also when the modification time of `--tls-cert`,
//! `--tls-key` or `--tls-ca` changes (polled). A new pair is
//! checked before anything is swapped (`tls::TlsServer::reload` builds the whole server
//! configuration first); if it is bad, the old one keeps serving, the error is logged and
//! `lineage_tls_reload_failures_total` goes up. The peer client is rebuilt with the new
//! identity only once the server's configuration took it.

use std::sync::Arc;
use std::time::Duration;

use crate::metrics::Metrics;
use crate::rotating_secrets::RotatingSecrets;
use crate::tls::{self, PeerClient, TlsServer};

/// Re-reads the rotating secrets; a bad file leaves the ones in use.
fn reload_secrets(secrets: &RotatingSecrets, metrics: &Metrics) {
    match secrets.reload() {
        Ok(()) => {
            let fingerprints = secrets.fingerprints();
            tracing::info!(
                sends = %fingerprints.sends,
                accepts = ?fingerprints.accepts,
                admin_previous_until = ?fingerprints.admin_previous_until,
                "secrets reloaded"
            );
        }
        Err(e) => {
            metrics.secret_reload_failures.inc();
            tracing::error!(error = %e, "secrets reload failed; the secrets in use stay");
        }
    }
}

/// How often the files' modification times are looked at by default.
pub const DEFAULT_POLL: Duration = Duration::from_secs(10);

/// Publishes the expiry of the node's certificate and of its CA bundle's first one.
pub fn publish_expiry(server: &TlsServer, metrics: &Metrics) {
    let files = server.files();
    for (name, path) in [("node", &files.cert), ("ca", &files.ca)] {
        match tls::not_after_seconds(path) {
            Ok(seconds) => metrics.set_tls_not_after(name, seconds),
            Err(e) => tracing::warn!(error = %e, "cannot read a certificate's expiry"),
        }
    }
}

/// One reload: the server's configuration, then the peer client, then the metrics.
pub fn reload(
    server: &TlsServer,
    client: &PeerClient,
    connect_timeout: Duration,
    metrics: &Metrics,
) -> Result<(), String> {
    let result = server.reload().and_then(|()| {
        client.replace(tls::peer_client(Some(server.files()), connect_timeout)?);
        Ok(())
    });
    match &result {
        Ok(()) => {
            tracing::info!("TLS certificate reloaded");
            publish_expiry(server, metrics);
        }
        Err(e) => {
            metrics.tls_reload_failures.inc();
            tracing::error!(error = %e, "TLS reload failed; the previous certificate stays in use");
        }
    }
    result
}

/// Watches for SIGHUP and for changed files, for as long as the node runs. Without TLS
/// (`server` is `None`) SIGHUP reloads the secrets only (the systemd unit's `ExecReload`
/// sends it, and its default action would kill the process).
pub fn spawn(
    server: Option<TlsServer>,
    client: PeerClient,
    secrets: Arc<RotatingSecrets>,
    connect_timeout: Duration,
    metrics: Arc<Metrics>,
    poll: Duration,
) {
    let mut hangups = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(signal) => Some(signal),
        Err(e) => {
            tracing::warn!(error = %e, "no SIGHUP handler; TLS files are still polled");
            None
        }
    };
    let Some(server) = server else {
        tokio::spawn(async move {
            while let Some(signal) = hangups.as_mut() {
                if signal.recv().await.is_none() {
                    return;
                }
                reload_secrets(&secrets, &metrics);
            }
        });
        return;
    };
    publish_expiry(&server, &metrics);
    tokio::spawn(async move {
        let mut seen = tls::modified(server.files());
        loop {
            let hangup = async {
                match hangups.as_mut() {
                    Some(signal) => signal.recv().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = hangup => reload_secrets(&secrets, &metrics),
                () = tokio::time::sleep(poll) => {
                    let now = tls::modified(server.files());
                    if now == seen {
                        continue;
                    }
                }
            }
            // Whether or not it worked: a bad file is reported once, not every poll.
            seen = tls::modified(server.files());
            let _ = reload(&server, &client, connect_timeout, &metrics);
        }
    });
}
