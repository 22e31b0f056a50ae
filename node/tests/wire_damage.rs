//! A Raft request changed on its way between nodes. Over plain HTTP only TCP's 16-bit
//! checksum guards the bytes; a record changed there would pass the follower's parse and
//! be rejected at its apply alone, leaving its copy of the agent behind the others' for
//! good. Each request carries the SHA-256 of its body (`x-lineage-body-sha256`), so the
//! follower refuses such a body and the leader sends it again.

#[path = "cluster/util.rs"]
mod util;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use util::Cluster;

/// What the proxies change: the first hex digit of a record's hash in a request.
const HASH_FIELD: &[u8] = br#""hash":""#;

/// Forwards each connection made to `listener` to `target`. While `armed`, it changes
/// the first digit of a record's `"hash"` found in one read of the bytes going to the
/// target into another hex digit (the JSON still parses), once in all (`changed`).
async fn damaging_proxy(
    listener: TcpListener,
    target: String,
    armed: Arc<AtomicBool>,
    changed: Arc<AtomicUsize>,
) {
    while let Ok((inbound, _)) = listener.accept().await {
        let Ok(outbound) = TcpStream::connect(&target).await else {
            continue; // the node is down; the caller's connection just closes
        };
        let (armed, changed) = (armed.clone(), changed.clone());
        tokio::spawn(async move {
            let (mut from_caller, mut to_caller) = inbound.into_split();
            let (mut from_node, mut to_node) = outbound.into_split();
            tokio::spawn(async move { tokio::io::copy(&mut from_node, &mut to_caller).await });
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = match from_caller.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                let chunk = &mut buf[..n];
                if armed.load(Ordering::Acquire) {
                    if let Some(at) = find(chunk, HASH_FIELD).map(|at| at + HASH_FIELD.len()) {
                        if at < chunk.len()
                            && armed.swap(false, Ordering::AcqRel)
                            && chunk[at].is_ascii_hexdigit()
                        {
                            chunk[at] = if chunk[at] == b'a' { b'b' } else { b'a' };
                            changed.fetch_add(1, Ordering::AcqRel);
                        }
                    }
                }
                if to_node.write_all(chunk).await.is_err() {
                    break;
                }
            }
        });
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Every node is reached by its peers through a proxy that changes one record's hash in
/// one Raft request after the agent exists. The node that receives it refuses it
/// (counted `digest`), the leader sends it again, and every replica's copy of the agent
/// ends the same, every write there. Without the digest the changed entry was appended,
/// rejected at that node's apply alone, and that copy never caught up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raft_request_changed_on_its_way_is_refused_and_sent_again() {
    let mut cluster = Cluster::prepare(3, &[]);
    let armed = Arc::new(AtomicBool::new(false));
    let changed = Arc::new(AtomicUsize::new(0));
    for i in 0..3 {
        let listen = cluster.listen_apart(i);
        let proxy = TcpListener::bind(&cluster.addrs[i])
            .await
            .expect("bind proxy");
        tokio::spawn(damaging_proxy(
            proxy,
            listen,
            armed.clone(),
            changed.clone(),
        ));
    }
    for i in 0..3 {
        cluster.start_node(i);
    }
    cluster.wait_for_leader(Duration::from_secs(15)).await;
    let policy = json!({"budget": 1_000, "scar_limit": 10, "tools": {"search": {"cost": 1}}});
    let token = cluster.create_agent(0, "victim", policy).await;
    let mut writes = 0;
    let mut refused = 0.0;
    // A round arms the proxies and writes until one changed a request, then a few more,
    // decided on the copies that took it. A changed request the leader gave up on before
    // the receiver read it (openraft's 50 ms bound) is refused by nobody: another round.
    for round in 1..=5 {
        armed.store(true, Ordering::Release);
        let round_end = writes + 10;
        while writes < round_end || (changed.load(Ordering::Acquire) < round && writes < 200) {
            let (status, body) = cluster
                .post_until_served(
                    writes % 3,
                    "/v1/agents/victim/actions",
                    &token,
                    json!({"tool": "search", "input": {"n": writes}}),
                    &format!("w{writes}"),
                )
                .await;
            assert_eq!(status, 200, "write {writes}: {body}");
            assert_eq!(body["decision"], "allowed", "write {writes}: {body}");
            writes += 1;
        }
        assert_eq!(
            changed.load(Ordering::Acquire),
            round,
            "no Raft request with a record passed a proxy by write {writes}"
        );
        let log = cluster
            .converged_log("victim", Duration::from_secs(30))
            .await;
        // Genesis and policy, then a request and its decision for each write.
        assert_eq!(log.len(), 2 + 2 * writes, "{log:?}");
        refused = 0.0;
        for i in 0..3 {
            refused += cluster
                .metrics(i)
                .await
                .get(r#"lineage_raft_requests_refused_total{reason="digest"}"#)
                .copied()
                .unwrap_or_default();
        }
        if refused > 0.0 {
            break;
        }
    }
    assert_eq!(refused, 1.0, "one changed request refused, in five rounds");
}
