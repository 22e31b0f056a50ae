//! When each peer last answered a Raft RPC from this node.
//!
//! openraft 0.9 exposes no heartbeat metric, so the leader's view of a dead follower in an
//! idle cluster was only "follower, lag 0". Every successful RPC (append, heartbeat, vote,
//! snapshot) records the time here; `/v1/cluster`, `lineage cluster status` and the
//! `lineage_raft_peer_last_contact_seconds` gauge read it. It also keeps the log quiet:
//! one WARN when a peer stops answering, one INFO when it is back, never one per retry.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::raft_types::NodeId;
use crate::rotating_secrets::Fingerprints;

/// A peer that has not answered for this long is shown as unreachable. Heartbeats go out
/// every 50 ms, so a live follower is never near it.
pub const UNREACHABLE_AFTER: Duration = Duration::from_secs(3);

#[derive(Default, Clone)]
struct Contact {
    last_answer: Option<Instant>,
    /// The secret fingerprints the peer's last answer carried (`rotating_secrets`).
    secrets: Option<Fingerprints>,
    /// Set on the first failure after an answer (or at start): the outage was reported.
    down_since: Option<Instant>,
}

pub struct PeerContacts {
    started: Instant,
    peers: Mutex<HashMap<NodeId, Contact>>,
}

impl Default for PeerContacts {
    fn default() -> Self {
        PeerContacts {
            started: Instant::now(),
            peers: Mutex::new(HashMap::new()),
        }
    }
}

impl PeerContacts {
    fn with_peer<T>(&self, peer: NodeId, f: impl FnOnce(&mut Contact) -> T) -> T {
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        f(peers.entry(peer).or_default())
    }

    /// The peer answered an RPC.
    pub fn answered(&self, peer: NodeId) {
        let now = Instant::now();
        let was_down = self.with_peer(peer, |c| {
            c.last_answer = Some(now);
            c.down_since.take()
        });
        if let Some(since) = was_down {
            tracing::info!(peer, after = ?now.duration_since(since), "peer answers again");
        }
    }

    /// An RPC to the peer failed (no answer, or an error status). Returns whether this
    /// began an outage (and was logged): later failures of the same outage are not.
    pub fn failed(&self, peer: NodeId, addr: &str, error: &dyn std::fmt::Display) -> bool {
        let first = self.with_peer(peer, |c| {
            let first = c.down_since.is_none();
            c.down_since.get_or_insert_with(Instant::now);
            first
        });
        if first {
            tracing::warn!(peer, addr, %error, "peer does not answer; retrying quietly until it does");
        }
        first
    }

    /// The secrets the peer said it sends and accepts, in its last Raft answer (`None`:
    /// it refused this node's secret).
    pub fn secrets(&self, peer: NodeId, fingerprints: Option<Fingerprints>) {
        self.with_peer(peer, |c| c.secrets = fingerprints);
    }

    /// What `secrets` last recorded for the peer.
    pub fn peer_secrets(&self, peer: NodeId) -> Option<Fingerprints> {
        self.with_peer(peer, |c| c.secrets.clone())
    }

    /// How long ago the peer last answered, or `None` if it never has.
    pub fn since_last_answer(&self, peer: NodeId) -> Option<Duration> {
        self.with_peer(peer, |c| c.last_answer.map(|t| t.elapsed()))
    }

    /// Like `since_last_answer`, counting a peer that never answered from this node's start.
    pub fn silence(&self, peer: NodeId) -> Duration {
        self.since_last_answer(peer)
            .unwrap_or_else(|| self.started.elapsed())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_report_per_outage_and_a_failure_keeps_the_last_answer() {
        let contacts = PeerContacts::default();
        assert_eq!(contacts.since_last_answer(2), None);
        // A peer not up yet: its first failure is reported, the retries are not.
        assert!(contacts.failed(2, "127.0.0.1:1", &"refused"));
        assert!(!contacts.failed(2, "127.0.0.1:1", &"refused"));
        contacts.answered(2);
        assert!(contacts.since_last_answer(2).is_some());
        // A new outage is reported again, once; the last answer's time stays.
        assert!(contacts.failed(2, "127.0.0.1:1", &"refused"));
        assert!(!contacts.failed(2, "127.0.0.1:1", &"refused"));
        assert!(contacts.since_last_answer(2).is_some());
        // Peers are apart.
        assert_eq!(contacts.since_last_answer(3), None);
        assert!(contacts.failed(3, "127.0.0.1:2", &"refused"));
    }
}
