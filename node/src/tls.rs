//! TLS for the node's one port: the server's configuration (rustls, ring), the identity a
//! peer's certificate carries, and the client the node uses to reach its peers.
//!
//! One port serves the API and Raft. A client certificate is asked for but not required
//! (the API's clients authenticate with bearer tokens); `/raft/*` requires one that names
//! a node of this cluster (`network::raft_routes`), on top of the cluster secret. A node's
//! certificate carries a URI SAN `lineage://<cluster>/node/<id>` and the serverAuth and
//! clientAuth usages: it serves and it calls its peers. Peers are often addressed by IP,
//! for which clients send no SNI, so nothing here depends on SNI.
//!
//! The server's configuration is read anew for each connection from an `ArcSwap`, so a
//! renewed certificate takes effect without a restart (`reload`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// The URI SAN prefix of a node certificate.
pub const NODE_URI_SCHEME: &str = "lineage://";

/// Where the node's certificate, key and CA bundle are (`--tls-cert`, `--tls-key`,
/// `--tls-ca`).
#[derive(Clone, Debug)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
}

/// What a peer's certificate says about it, put in each request's extensions. Absent
/// when the peer sent no certificate (or TLS is off).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerCertificate {
    /// The node it names (`lineage://<cluster>/node/<id>`), if it names one.
    pub node: Option<(String, u64)>,
}

/// The server side: the current configuration, replaced whole on reload.
#[derive(Clone)]
pub struct TlsServer {
    config: Arc<ArcSwap<rustls::ServerConfig>>,
    files: TlsFiles,
    /// The node this is: (cluster, id), which its own certificate must name.
    node: (String, u64),
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read_certificates(path: &Path, what: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let certificates = CertificateDer::pem_file_iter(path)
        .map_err(|e| format!("{what} {}: {e}", path.display()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{what} {}: {e}", path.display()))?;
    if certificates.is_empty() {
        return Err(format!(
            "{what} {}: no PEM certificate in it",
            path.display()
        ));
    }
    Ok(certificates)
}

fn read_roots(path: &Path) -> Result<rustls::RootCertStore, String> {
    let mut roots = rustls::RootCertStore::empty();
    for certificate in read_certificates(path, "--tls-ca")? {
        roots
            .add(certificate)
            .map_err(|e| format!("--tls-ca {}: {e}", path.display()))?;
    }
    Ok(roots)
}

/// Checks the node's own certificate as its peers will: it chains to the CA bundle, it
/// may be used as a client certificate (clientAuth: the node calls its peers with it),
/// and it names this node. A mistake here would otherwise show only as peers refusing
/// every Raft request.
fn check_own_certificate(
    files: &TlsFiles,
    chain: &[CertificateDer<'static>],
    node: &(String, u64),
) -> Result<(), String> {
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(read_roots(&files.ca)?),
        provider(),
    )
    .build()
    .map_err(|e| format!("--tls-ca {}: {e}", files.ca.display()))?;
    let (end_entity, intermediates) = chain
        .split_first()
        .ok_or_else(|| format!("--tls-cert {}: no certificate", files.cert.display()))?;
    verifier
        .verify_client_cert(
            end_entity,
            intermediates,
            rustls::pki_types::UnixTime::now(),
        )
        .map_err(|e| {
            format!(
                "--tls-cert {}: peers would refuse it (it must chain to --tls-ca {} and allow \
                 clientAuth): {e}",
                files.cert.display(),
                files.ca.display()
            )
        })?;
    let named = peer_certificate(Some(chain)).and_then(|peer| peer.node);
    if named.as_ref() != Some(node) {
        return Err(format!(
            "--tls-cert {}: names {}, but this node is {}",
            files.cert.display(),
            named.map_or("no node".to_string(), |(cluster, id)| node_uri(
                &cluster, id
            )),
            node_uri(&node.0, node.1)
        ));
    }
    Ok(())
}

/// Builds the server's configuration from the files, checking that the key matches the
/// certificate, that the certificate is valid now, and that peers will take it
/// (`check_own_certificate`).
fn server_config(files: &TlsFiles, node: &(String, u64)) -> Result<rustls::ServerConfig, String> {
    let chain = read_certificates(&files.cert, "--tls-cert")?;
    let key = PrivateKeyDer::from_pem_file(&files.key)
        .map_err(|e| format!("--tls-key {}: {e}", files.key.display()))?;
    let (not_before, not_after) = validity(&chain[0])?;
    let now = SystemTime::now();
    if now < not_before || now > not_after {
        return Err(format!(
            "--tls-cert {}: not valid now (valid from {} to {})",
            files.cert.display(),
            httpdate(not_before),
            httpdate(not_after)
        ));
    }
    check_own_certificate(files, &chain, node)?;
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(read_roots(&files.ca)?),
        provider(),
    )
    .allow_unauthenticated()
    .build()
    .map_err(|e| format!("--tls-ca {}: {e}", files.ca.display()))?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .map_err(|e| format!("--tls-cert/--tls-key: {e}"))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

impl TlsServer {
    /// The configuration of node `id` of cluster `cluster`, from `files`.
    pub fn load(files: TlsFiles, cluster: &str, id: u64) -> Result<Self, String> {
        let node = (cluster.to_string(), id);
        let config = server_config(&files, &node)?;
        Ok(TlsServer {
            config: Arc::new(ArcSwap::from_pointee(config)),
            files,
            node,
        })
    }

    /// The configuration for a new connection.
    pub fn current(&self) -> Arc<rustls::ServerConfig> {
        self.config.load_full()
    }

    /// Reads the files again and, if they make a valid configuration, serves new
    /// connections with it; otherwise the old one stays and the error is returned.
    pub fn reload(&self) -> Result<(), String> {
        let config = server_config(&self.files, &self.node)?;
        self.config.store(Arc::new(config));
        Ok(())
    }

    pub fn files(&self) -> &TlsFiles {
        &self.files
    }
}

/// The accept loop takes each connection's configuration from here, and puts what the
/// peer's certificate says into each request.
impl lineage_http_server::Tls for TlsServer {
    type Peer = PeerCertificate;

    fn config(&self) -> Arc<rustls::ServerConfig> {
        self.current()
    }

    fn peer(&self, chain: Option<&[CertificateDer<'_>]>) -> Option<PeerCertificate> {
        peer_certificate(chain)
    }
}

/// The identity in a peer's certificate chain (its first, end-entity certificate).
pub fn peer_certificate(chain: Option<&[CertificateDer<'_>]>) -> Option<PeerCertificate> {
    let end_entity = chain?.first()?;
    let node = x509_parser::parse_x509_certificate(end_entity.as_ref())
        .ok()
        .and_then(|(_, certificate)| {
            let names = certificate.subject_alternative_name().ok()??;
            names
                .value
                .general_names
                .iter()
                .find_map(|name| match name {
                    x509_parser::extensions::GeneralName::URI(uri) => parse_node_uri(uri),
                    _ => None,
                })
        });
    Some(PeerCertificate { node })
}

/// `lineage://<cluster>/node/<id>` → (cluster, id).
pub fn parse_node_uri(uri: &str) -> Option<(String, u64)> {
    let rest = uri.strip_prefix(NODE_URI_SCHEME)?;
    let (cluster, id) = rest.rsplit_once("/node/")?;
    // Canonical digits only: `+3` or `03` would name node 3 under another spelling.
    let canonical = !id.is_empty()
        && id.bytes().all(|b| b.is_ascii_digit())
        && (id == "0" || !id.starts_with('0'));
    if !canonical {
        return None;
    }
    let id = id.parse().ok()?;
    (!cluster.is_empty()).then(|| (cluster.to_string(), id))
}

/// The URI SAN of node `id` of `cluster`.
pub fn node_uri(cluster: &str, id: u64) -> String {
    format!("{NODE_URI_SCHEME}{cluster}/node/{id}")
}

/// A certificate's validity period.
pub fn validity(certificate: &CertificateDer<'_>) -> Result<(SystemTime, SystemTime), String> {
    let (_, parsed) = x509_parser::parse_x509_certificate(certificate.as_ref())
        .map_err(|e| format!("not an X.509 certificate: {e}"))?;
    let at = |t: x509_parser::time::ASN1Time| {
        let seconds = t.timestamp();
        if seconds >= 0 {
            SystemTime::UNIX_EPOCH + Duration::from_secs(seconds as u64)
        } else {
            SystemTime::UNIX_EPOCH
        }
    };
    let v = parsed.validity();
    Ok((at(v.not_before), at(v.not_after)))
}

/// When the files last changed (their modification times), to notice a renewal.
pub fn modified(files: &TlsFiles) -> Vec<Option<SystemTime>> {
    [&files.cert, &files.key, &files.ca]
        .iter()
        .map(|path| std::fs::metadata(path).and_then(|m| m.modified()).ok())
        .collect()
}

/// When the certificate in `path` (its first) expires, in seconds since the epoch.
pub fn not_after_seconds(path: &Path) -> Result<i64, String> {
    let chain = read_certificates(path, "certificate")?;
    let (_, not_after) = validity(&chain[0])?;
    Ok(not_after
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64))
}

fn httpdate(t: SystemTime) -> String {
    let seconds = t
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format!("{seconds} s after the epoch")
}

/// The node's client for its peers, replaced whole when the certificate is reloaded:
/// requests in flight finish on the old one, and its pooled connections close with it.
#[derive(Clone)]
pub struct PeerClient(Arc<ArcSwap<reqwest::Client>>);

impl PeerClient {
    pub fn new(client: reqwest::Client) -> Self {
        PeerClient(Arc::new(ArcSwap::from_pointee(client)))
    }

    /// The client for the next request.
    pub fn current(&self) -> reqwest::Client {
        reqwest::Client::clone(&self.0.load())
    }

    pub fn replace(&self, client: reqwest::Client) {
        self.0.store(Arc::new(client));
    }
}

/// Idle pooled connections to peers are closed after this long, so none outlives a
/// reload by much even while its client is still referenced.
const PEER_POOL_IDLE: Duration = Duration::from_secs(60);

/// The node's HTTP client for its peers (Raft and forwarded requests): it trusts only the
/// CA bundle, presents the node's certificate, and speaks TLS 1.3. Without TLS, plain.
pub fn peer_client(
    files: Option<&TlsFiles>,
    connect_timeout: Duration,
) -> Result<reqwest::Client, String> {
    let builder = reqwest::Client::builder()
        .connect_timeout(connect_timeout)
        .pool_idle_timeout(PEER_POOL_IDLE);
    let Some(files) = files else {
        return builder.build().map_err(|e| format!("http client: {e}"));
    };
    let mut identity = std::fs::read(&files.cert).map_err(|e| format!("--tls-cert: {e}"))?;
    identity.push(b'\n');
    identity.extend(std::fs::read(&files.key).map_err(|e| format!("--tls-key: {e}"))?);
    let builder = builder
        .min_tls_version(reqwest::tls::Version::TLS_1_3)
        .identity(reqwest::Identity::from_pem(&identity).map_err(|e| format!("--tls-key: {e}"))?);
    trusting_only(builder, &files.ca)
        .map_err(|e| format!("--tls-ca {e}"))?
        .build()
        .map_err(|e| format!("http client: {e}"))
}

/// `builder` trusting the CA bundle in `ca` (PEM) and nothing else: not the roots a
/// reqwest feature compiles in (the checkpointer's webpki roots unify into every binary).
pub fn trusting_only(
    builder: reqwest::ClientBuilder,
    ca: &Path,
) -> Result<reqwest::ClientBuilder, String> {
    let pem = std::fs::read(ca).map_err(|e| format!("{}: {e}", ca.display()))?;
    let mut builder = builder.use_rustls_tls().tls_built_in_root_certs(false);
    for certificate in
        reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| format!("{}: {e}", ca.display()))?
    {
        builder = builder.add_root_certificate(certificate);
    }
    Ok(builder)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_uris_round_trip_and_strangers_do_not_parse() {
        let uri = node_uri("example.com/guard", 3);
        assert_eq!(uri, "lineage://example.com/guard/node/3");
        assert_eq!(parse_node_uri(&uri), Some(("example.com/guard".into(), 3)));
        for stranger in [
            "https://example.com/node/3",
            "lineage:///node/3",
            "lineage://c/node/x",
            "lineage://c/nodes/3",
            "lineage://c/node/-1",
            "lineage://c/node/+3",
            "lineage://c/node/03",
        ] {
            assert_eq!(parse_node_uri(stranger), None, "{stranger}");
        }
    }
}
