//! TLS on the node's one port, with certificates made in the test (`lineage-node certs`
//! and, for strangers, rcgen signed by the same CA): HTTPS with the CA works through any
//! node (a follower forwards over HTTPS), a client without the CA fails its handshake,
//! plain HTTP to the port gets `400 this port requires HTTPS` at once, and `/raft/*`
//! answers only a peer whose certificate names a member node of this cluster (the
//! cluster secret is still asked for on top).

#[path = "cluster/util.rs"]
mod util;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use rcgen::{CertificateParams, KeyPair, SanType};
use serde_json::json;
use util::Cluster;

const CLUSTER_SECRET_HEADER: &str = "x-lineage-cluster-secret";

fn policy() -> serde_json::Value {
    json!({"budget": 100, "scar_limit": 10, "tools": {"work": {"cost": 1}}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_with_the_ca_works_through_any_node_and_without_it_fails() {
    let cluster = Cluster::start_tls(3, &[]).await;
    let leader = cluster.wait_for_leader(Duration::from_secs(20)).await;
    let follower = (leader + 1) % 3;
    let token = cluster.create_agent(follower, "tls-agent", policy()).await;
    let (status, answer) = cluster
        .post(
            follower,
            "/v1/agents/tls-agent/actions",
            &token,
            json!({"tool": "work"}),
            Some("k1"),
        )
        .await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["decision"], "allowed", "{answer}");
    // Every node has the record: Raft carried it over TLS.
    let log = cluster
        .converged_log("tls-agent", Duration::from_secs(20))
        .await;
    assert!(log.len() >= 3, "{log:?}");

    let without_ca = reqwest::Client::builder()
        .use_rustls_tls()
        .timeout(Duration::from_secs(5))
        .build()
        .expect("client");
    let error = without_ca
        .get(cluster.url(leader, "/healthz"))
        .send()
        .await
        .expect_err("a certificate from an unknown CA was accepted");
    assert!(
        format!("{error:?}").contains("UnknownIssuer"),
        "not a certificate error: {error:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_http_to_the_tls_port_gets_a_400_and_the_connection_closes() {
    let cluster = Cluster::start_tls(1, &[]).await;
    let mut stream = std::net::TcpStream::connect(&cluster.addrs[0]).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: node\r\n\r\n")
        .expect("write");
    let mut answer = String::new();
    // read_to_string returns at EOF: the node closed the connection.
    stream.read_to_string(&mut answer).expect("read to the end");
    assert!(answer.starts_with("HTTP/1.1 400 "), "{answer}");
    assert!(answer.contains("this port requires HTTPS"), "{answer}");
    drop(stream);
    // Counted once the node has closed its side too (it waits for this client's close).
    let series = "lineage_http_connections_closed_total{reason=\"plaintext_on_tls\"}";
    let mut counted = None;
    for _ in 0..50 {
        counted = cluster.metrics(0).await.get(series).copied();
        if counted.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(counted, Some(1.0), "{series}");
}

/// A certificate signed by the cluster's CA with the given SANs (clientAuth), as PEM
/// (certificate, then key).
fn stranger_certificate(tls: &Path, sans: &[SanType]) -> Vec<u8> {
    let ca_key = KeyPair::from_pem(&std::fs::read_to_string(tls.join("ca.key")).unwrap()).unwrap();
    let ca_params =
        CertificateParams::from_ca_cert_pem(&std::fs::read_to_string(tls.join("ca.pem")).unwrap())
            .unwrap();
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let mut params = CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
    params.subject_alt_names.extend(sans.iter().cloned());
    params.extended_key_usages = vec![
        rcgen::ExtendedKeyUsagePurpose::ServerAuth,
        rcgen::ExtendedKeyUsagePurpose::ClientAuth,
    ];
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, &ca, &ca_key).unwrap();
    format!("{}\n{}", cert.pem(), key.serialize_pem()).into_bytes()
}

fn client_with_identity(tls: &Path, identity_pem: Option<Vec<u8>>) -> reqwest::Client {
    let ca = std::fs::read(tls.join("ca.pem")).unwrap();
    let mut builder = reqwest::Client::builder()
        .use_rustls_tls()
        .tls_built_in_root_certs(false)
        .timeout(Duration::from_secs(5));
    for certificate in reqwest::Certificate::from_pem_bundle(&ca).unwrap() {
        builder = builder.add_root_certificate(certificate);
    }
    if let Some(pem) = identity_pem {
        builder = builder.identity(reqwest::Identity::from_pem(&pem).unwrap());
    }
    builder.build().unwrap()
}

fn uri(text: &str) -> SanType {
    SanType::URI(text.to_string().try_into().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raft_answers_only_a_member_nodes_certificate() {
    let cluster = Cluster::start_tls(3, &[]).await;
    let leader = cluster.wait_for_leader(Duration::from_secs(20)).await;
    let target = (leader + 1) % 3;
    let tls = cluster.tls_dir.clone().expect("TLS directory");
    let secret = std::fs::read_to_string(cluster.dir.path().join("keys/cluster.secret"))
        .expect("cluster secret");
    let own = |id: usize| {
        let mut pem = std::fs::read(tls.join(format!("node-{id}.pem"))).unwrap();
        pem.push(b'\n');
        pem.extend(std::fs::read(tls.join(format!("node-{id}.key"))).unwrap());
        pem
    };
    let cases: Vec<(&str, Option<Vec<u8>>, u16)> = vec![
        ("no certificate", None, 403),
        (
            "a certificate naming no node",
            Some(stranger_certificate(&tls, &[])),
            403,
        ),
        (
            "a node of another cluster",
            Some(stranger_certificate(
                &tls,
                &[uri("lineage://elsewhere/node/1")],
            )),
            403,
        ),
        (
            "a node that is not a member",
            Some(stranger_certificate(
                &tls,
                &[uri(&format!(
                    "lineage://{}/node/9",
                    lineage_node::DEFAULT_CLUSTER_NAME
                ))],
            )),
            403,
        ),
    ];
    for path in ["/raft/vote", "/raft/append"] {
        for (what, identity, expected) in &cases {
            let client = client_with_identity(&tls, identity.clone());
            let reply = client
                .post(cluster.url(target, path))
                .header(CLUSTER_SECRET_HEADER, secret.trim())
                .json(&json!({}))
                .send()
                .await
                .unwrap_or_else(|e| panic!("{path}, {what}: {e:?}"));
            let status = reply.status().as_u16();
            let body = reply.text().await.unwrap_or_default();
            assert_eq!(status, *expected, "{path}, {what}: {body}");
            assert!(body.contains("not_a_node"), "{path}, {what}: {body}");
        }
        // A member's own certificate passes the check; the body is then refused as not
        // the expected shape (422), which shows the request got past it. Without the
        // secret: 401.
        let member = client_with_identity(&tls, Some(own(leader + 1)));
        let reply = member
            .post(cluster.url(target, path))
            .header(CLUSTER_SECRET_HEADER, secret.trim())
            .json(&json!({}))
            .send()
            .await
            .expect("member request");
        assert_eq!(
            reply.status().as_u16(),
            422,
            "{path}: a member's certificate"
        );
        let reply = member
            .post(cluster.url(target, path))
            .json(&json!({}))
            .send()
            .await
            .expect("member request");
        assert_eq!(reply.status().as_u16(), 401, "{path}: no cluster secret");
    }

    // A member's certificate speaks only for that member: a vote it sends for another
    // node's candidacy is refused; for its own, it reaches Raft (and is not granted: its
    // term is old).
    let member_id = (leader + 1) as u64;
    let member = client_with_identity(&tls, Some(own(leader + 1)));
    for (candidate, expected) in [(member_id % 3 + 1, 403), (member_id, 200)] {
        let request = json!({
            "vote": {"leader_id": {"term": 1, "node_id": candidate}, "committed": false},
            "last_log_id": null
        });
        let reply = member
            .post(cluster.url(target, "/raft/vote"))
            .header(CLUSTER_SECRET_HEADER, secret.trim())
            .json(&request)
            .send()
            .await
            .expect("vote");
        let status = reply.status().as_u16();
        let body = reply.text().await.unwrap_or_default();
        assert_eq!(
            status, expected,
            "node {member_id}'s certificate voting for {candidate}: {body}"
        );
    }
}

/// The certificate node `i` serves now, on a fresh connection.
async fn served_certificate(cluster: &Cluster, i: usize) -> Vec<u8> {
    let tls = cluster.tls_dir.as_ref().expect("TLS directory");
    let ca = std::fs::read(tls.join("ca.pem")).unwrap();
    let mut builder = reqwest::Client::builder()
        .use_rustls_tls()
        .tls_built_in_root_certs(false)
        .tls_info(true)
        .timeout(Duration::from_secs(5));
    for certificate in reqwest::Certificate::from_pem_bundle(&ca).unwrap() {
        builder = builder.add_root_certificate(certificate);
    }
    let reply = builder
        .build()
        .unwrap()
        .get(cluster.url(i, "/healthz"))
        .send()
        .await
        .expect("HTTPS with the CA");
    assert!(reply.status().is_success());
    reply
        .extensions()
        .get::<reqwest::tls::TlsInfo>()
        .and_then(|info| info.peer_certificate())
        .expect("the served certificate")
        .to_vec()
}

fn certificate_der(path: &Path) -> Vec<u8> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::CertificateDer::from_pem_file(path)
        .expect("a PEM certificate")
        .to_vec()
}

/// Replaces `to` with a copy of `from`, atomically (a rename), as a renewal tool would.
fn replace_file(from: &Path, to: &Path) {
    let temporary = to.with_extension("new");
    std::fs::copy(from, &temporary).unwrap();
    std::fs::rename(&temporary, to).unwrap();
}

/// A new certificate and key for node 1 from the cluster's CA, put in place of the old
/// ones; returns the new certificate (DER).
fn renew_node_certificate(cluster: &Cluster) -> Vec<u8> {
    let tls = cluster.tls_dir.clone().expect("TLS directory");
    let renewal = tempfile::tempdir().unwrap();
    for name in ["ca.pem", "ca.key"] {
        std::fs::copy(tls.join(name), renewal.path().join(name)).unwrap();
    }
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_lineage-node"))
        .args(["certs", "--node", "1=127.0.0.1,localhost", "--out"])
        .arg(renewal.path())
        .output()
        .expect("certs");
    assert!(output.status.success(), "{output:?}");
    replace_file(&renewal.path().join("node-1.key"), &tls.join("node-1.key"));
    replace_file(&renewal.path().join("node-1.pem"), &tls.join("node-1.pem"));
    certificate_der(&tls.join("node-1.pem"))
}

async fn wait_until_served(cluster: &Cluster, expected: &[u8]) {
    let mut served = Vec::new();
    for _ in 0..100 {
        served = served_certificate(cluster, 0).await;
        if served == expected {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(served, expected, "the renewed certificate is not served");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_a_renewed_certificate_at_once() {
    // Polled every 10 minutes: only the signal can make the node notice within the test.
    let cluster = Cluster::start_tls(1, &["--tls-reload-poll-ms", "600000"]).await;
    let renewed = renew_node_certificate(&cluster);
    cluster.hangup(0);
    wait_until_served(&cluster, &renewed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewed_certificate_is_served_without_a_restart_and_a_bad_one_is_refused() {
    let cluster = Cluster::start_tls(1, &["--tls-reload-poll-ms", "100"]).await;
    let tls = cluster.tls_dir.clone().expect("TLS directory");
    let first = certificate_der(&tls.join("node-1.pem"));
    assert_eq!(served_certificate(&cluster, 0).await, first);
    let expiry = cluster.metrics(0).await["lineage_tls_cert_not_after_seconds{cert=\"node\"}"];
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!(
        expiry > now + 300.0 * 86_400.0,
        "expiry {expiry}, now {now}"
    );

    // Renewed by the same CA, files replaced in place: the poll notices.
    let renewed = renew_node_certificate(&cluster);
    assert_ne!(renewed, first);
    wait_until_served(&cluster, &renewed).await;

    // A broken certificate file, then SIGHUP: refused, counted, the renewed one serves on.
    let failures = |m: &std::collections::BTreeMap<String, f64>| {
        m.get("lineage_tls_reload_failures_total")
            .copied()
            .unwrap_or(0.0)
    };
    let before = failures(&cluster.metrics(0).await);
    std::fs::write(tls.join("node-1.pem"), "not a certificate\n").unwrap();
    cluster.hangup(0);
    let mut after = before;
    for _ in 0..100 {
        after = failures(&cluster.metrics(0).await);
        if after > before {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(after > before, "the bad certificate was not refused");
    assert_eq!(served_certificate(&cluster, 0).await, renewed);
    assert!(!cluster.has_exited(0), "the node died of a bad certificate");
}

/// The one-file Python client over HTTPS: with `ca_file` it creates an agent and is
/// allowed an action through a follower; without the CA it gets no answer (the handshake
/// fails), reported as a GuardError with no status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_client_speaks_https_with_the_ca() {
    let cluster = Cluster::start_tls(3, &[]).await;
    let leader = cluster.wait_for_leader(Duration::from_secs(20)).await;
    let follower = (leader + 1) % 3;
    let tls = cluster.tls_dir.clone().expect("TLS directory");
    let script = r#"
import sys
from lineage_guard import AdminClient, AgentClient, GuardError
url, token, ca = sys.argv[1], sys.argv[2], sys.argv[3]
admin = AdminClient(url, token, ca_file=ca)
created = admin.create_agent("py-tls", {"budget": 5, "scar_limit": 3, "tools": {"work": {"cost": 1}}})
agent = AgentClient(url, "py-tls", created["token"], ca_file=ca)
print("decision", agent.request("work")["decision"])
try:
    AdminClient(url, token, retry_for=1).agents()
    print("without the CA: answered")
except GuardError as e:
    print("without the CA: status", e.status, "CERTIFICATE_VERIFY_FAILED" in e.message)
"#;
    let python = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../client/python");
    let output = std::process::Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(cluster.url(follower, ""))
        .arg(cluster.admin.trim())
        .arg(tls.join("ca.pem"))
        .env("PYTHONPATH", &python)
        .env_remove("LINEAGE_CA")
        .output()
        .expect("run python3");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("decision allowed"), "{stdout}");
    assert!(
        stdout.contains("without the CA: status None True"),
        "{stdout}"
    );
}

/// `systemctl reload` sends SIGHUP to every node (the unit's `ExecReload`): a node without
/// TLS takes it and serves on, rather than dying of the signal's default action.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_does_not_stop_a_node_without_tls() {
    let cluster = Cluster::start(1).await;
    cluster.hangup(0);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!cluster.has_exited(0), "SIGHUP stopped the node");
    let (status, _) = cluster.get(0, "/healthz", "").await;
    assert_eq!(status, 200);
}

/// `lineage-node certs` for node `node` in a new directory: with the cluster's CA
/// (`tls`) when given, else with a CA of its own. Returns (certificate, key) paths.
fn other_certificate(tls: Option<&Path>, node: u64, dir: &Path) -> (PathBuf, PathBuf) {
    if let Some(tls) = tls {
        for name in ["ca.pem", "ca.key"] {
            std::fs::copy(tls.join(name), dir.join(name)).unwrap();
        }
    }
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_lineage-node"))
        .args([
            "certs",
            "--node",
            &format!("{node}=127.0.0.1,localhost"),
            "--out",
        ])
        .arg(dir)
        .output()
        .expect("certs");
    assert!(output.status.success(), "{output:?}");
    (
        dir.join(format!("node-{node}.pem")),
        dir.join(format!("node-{node}.key")),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_refuses_a_certificate_that_names_another_node_or_another_ca() {
    let cluster = Cluster::start_tls(1, &[]).await;
    let tls = cluster.tls_dir.clone().expect("TLS directory");
    let first = certificate_der(&tls.join("node-1.pem"));
    let failures = async || {
        cluster
            .metrics(0)
            .await
            .get("lineage_tls_reload_failures_total")
            .copied()
            .unwrap_or(0.0)
    };
    let (node_two, another_ca) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    for (cert, key) in [
        other_certificate(Some(&tls), 2, node_two.path()),
        other_certificate(None, 1, another_ca.path()),
    ] {
        let before = failures().await;
        replace_file(&key, &tls.join("node-1.key"));
        replace_file(&cert, &tls.join("node-1.pem"));
        cluster.hangup(0);
        let mut after = before;
        for _ in 0..100 {
            after = failures().await;
            if after > before {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(after > before, "{} was taken", cert.display());
        assert_eq!(
            served_certificate(&cluster, 0).await,
            first,
            "the old one serves on"
        );
    }
    // At start, the same checks are the node's exit message.
    cluster.stop_gracefully(0);
    let (two_cert, two_key) = (
        node_two.path().join("node-2.pem"),
        node_two.path().join("node-2.key"),
    );
    let (other_cert, other_key) = (
        another_ca.path().join("node-1.pem"),
        another_ca.path().join("node-1.key"),
    );
    for (cert, key, why) in [
        (two_cert, two_key, "names lineage://"),
        (other_cert, other_key, "peers would refuse it"),
    ] {
        let data = tempfile::tempdir().unwrap();
        let addr = format!("127.0.0.1:{}", util::free_port());
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_lineage-node"))
            .args([
                "run",
                "--id",
                "1",
                "--listen",
                &addr,
                "--peers",
                &format!("1={addr}"),
            ])
            .arg("--data-dir")
            .arg(data.path())
            .arg("--keys-dir")
            .arg(cluster.dir.path().join("keys"))
            .arg("--tls-cert")
            .arg(&cert)
            .arg("--tls-key")
            .arg(&key)
            .arg("--tls-ca")
            .arg(tls.join("ca.pem"))
            .output()
            .expect("run");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{stderr}");
        assert!(stderr.contains(why), "{}: {stderr}", cert.display());
    }
}
