//! `lineage-node certs`: a development CA and one certificate per node, for
//! `--tls-cert`, `--tls-key` and `--tls-ca` (`tls`). A production deployment brings its
//! own CA; what a node certificate must carry is the same: the hosts peers dial (DNS
//! names or IPs, as in `--advertise`), the URI SAN `lineage://<cluster>/node/<id>`, and
//! the serverAuth and clientAuth usages.
//!
//! Written into DIR: `ca.pem`, `ca.key`, `node-ID.pem`, `node-ID.key`. Keys are created
//! 0600 and atomically (`lineage_core::keys::write_secret_file`); nothing that exists is
//! overwritten. A CA already in DIR signs the new node certificates, so a node can be
//! added to a cluster later.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose, SanType,
};

/// How long the development CA is valid.
const CA_DAYS: i64 = 3650;

/// One `--node ID=host[,host…]`.
fn parse_node(spec: &str) -> Result<(u64, Vec<String>), String> {
    let (id, hosts) = spec
        .split_once('=')
        .ok_or_else(|| format!("--node {spec:?}: expected ID=host[,host…]"))?;
    let id = id
        .parse()
        .map_err(|_| format!("--node {spec:?}: {id:?} is not a node id"))?;
    let hosts: Vec<String> = hosts
        .split(',')
        .map(str::trim)
        .filter(|h| !h.is_empty())
        .map(String::from)
        .collect();
    if hosts.is_empty() {
        return Err(format!("--node {spec:?}: no host"));
    }
    Ok((id, hosts))
}

fn rcgen_err(what: &str) -> impl Fn(rcgen::Error) -> String + '_ {
    move |e| format!("{what}: {e}")
}

/// Writes a public file that must not exist yet.
fn write_new(path: &Path, text: &str) -> Result<(), String> {
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .and_then(|mut file| {
            std::io::Write::write_all(&mut file, text.as_bytes())?;
            file.sync_all()
        })
        .map_err(|e| format!("{}: {e}", path.display()))
}

fn write_key(path: &Path, key: &KeyPair) -> Result<(), String> {
    lineage_core::keys::write_secret_file(path, &key.serialize_pem()).map_err(|e| e.to_string())
}

fn validity(params: &mut CertificateParams, days: i64) {
    let now = time::OffsetDateTime::now_utc();
    // A little slack for clocks that differ between hosts.
    params.not_before = now - time::Duration::hours(1);
    params.not_after = now + time::Duration::days(days);
}

/// The CA in `dir`, made there if there is none.
fn certificate_authority(dir: &Path) -> Result<(rcgen::Certificate, KeyPair, bool), String> {
    let (cert_path, key_path) = (dir.join("ca.pem"), dir.join("ca.key"));
    if cert_path.exists() {
        let key_pem = std::fs::read_to_string(&key_path)
            .map_err(|e| format!("{}: {e}", key_path.display()))?;
        let key = KeyPair::from_pem(&key_pem).map_err(rcgen_err("ca.key"))?;
        let cert_pem = std::fs::read_to_string(&cert_path)
            .map_err(|e| format!("{}: {e}", cert_path.display()))?;
        let params = CertificateParams::from_ca_cert_pem(&cert_pem).map_err(rcgen_err("ca.pem"))?;
        // Only its name and key are used, to sign: this copy is never written.
        let cert = params.self_signed(&key).map_err(rcgen_err("ca.pem"))?;
        return Ok((cert, key, false));
    }
    let key = KeyPair::generate().map_err(rcgen_err("CA key"))?;
    let mut params = CertificateParams::default();
    params
        .distinguished_name
        .push(DnType::CommonName, "lineage development CA");
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    validity(&mut params, CA_DAYS);
    let cert = params.self_signed(&key).map_err(rcgen_err("CA"))?;
    write_key(&key_path, &key)?;
    write_new(&cert_path, &cert.pem())?;
    Ok((cert, key, true))
}

/// Makes the CA (unless `dir` has one) and each node's certificate; returns the files
/// written.
pub fn make(
    dir: &Path,
    nodes: &[String],
    cluster: &str,
    days: u32,
) -> Result<Vec<PathBuf>, String> {
    let nodes = nodes
        .iter()
        .map(|spec| parse_node(spec))
        .collect::<Result<Vec<_>, _>>()?;
    // Every refusal comes before anything is written.
    let mut ids = std::collections::BTreeSet::new();
    for (id, _) in &nodes {
        if !ids.insert(*id) {
            return Err(format!("--node {id} is given twice; nothing was written"));
        }
        for file in [format!("node-{id}.pem"), format!("node-{id}.key")] {
            let path = dir.join(file);
            if path.symlink_metadata().is_ok() {
                return Err(format!("{} exists; nothing was written", path.display()));
            }
        }
    }
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let (ca, ca_key, made) = certificate_authority(dir)?;
    let mut written = Vec::new();
    if made {
        written.extend([dir.join("ca.pem"), dir.join("ca.key")]);
    }
    for (id, hosts) in nodes {
        let mut params = CertificateParams::new(hosts).map_err(rcgen_err("--node"))?;
        let uri = crate::tls::node_uri(cluster, id);
        params.subject_alt_names.push(SanType::URI(
            uri.clone()
                .try_into()
                .map_err(rcgen_err("--cluster-name"))?,
        ));
        params
            .distinguished_name
            .push(DnType::CommonName, format!("lineage node {id}"));
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        validity(&mut params, i64::from(days));
        let key = KeyPair::generate().map_err(rcgen_err("node key"))?;
        let cert = params
            .signed_by(&key, &ca, &ca_key)
            .map_err(rcgen_err("node certificate"))?;
        let (cert_path, key_path) = (
            dir.join(format!("node-{id}.pem")),
            dir.join(format!("node-{id}.key")),
        );
        write_key(&key_path, &key)?;
        write_new(&cert_path, &cert.pem())?;
        written.extend([cert_path, key_path]);
    }
    Ok(written)
}
