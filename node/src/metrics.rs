//! Prometheus metrics, served at `GET /metrics` by `api::metrics_http`.
//!
//! Guard metrics (decisions, scars, terminations, agents, approvals) are derived at scrape
//! time from the applied state machine, which every node holds in full: each node's
//! figures equal what its copy of the audit logs says, and survive restarts. Labels are
//! bounded: reason codes, severities and causes are fixed sets; nothing is per agent.

use std::collections::BTreeMap;
use std::sync::Mutex;

use lineage_core::record::timestamp;
use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

use lineage_core::guard::{DenyReason, TerminationCause};

use crate::network::peer_contacts::PeerContacts;
use crate::raft_types::{NodeId, Raft};
use crate::store::state_machine::SmData;
use crate::store::{AgentSlot, StateMachine};

/// What the metrics read from a node: its applied state, its Raft, when each peer last
/// answered. Narrow on purpose, so metrics need nothing of the service or HTTP.
pub struct NodeView<'a> {
    pub id: NodeId,
    pub sm: &'a StateMachine,
    pub raft: &'a Raft,
    pub committed_index: u64,
    pub peers: &'a PeerContacts,
}

pub struct Metrics {
    registry: Registry,
    pub http_request_duration: HistogramVec,
    pub log_append_duration: Histogram,
    decisions: IntCounterVec,
    scars: IntCounterVec,
    terminations: IntCounterVec,
    agents: IntGaugeVec,
    pending_approvals: IntGauge,
    oldest_pending_age: prometheus::Gauge,
    raft_term: IntGauge,
    raft_leader: IntGauge,
    raft_is_leader: IntGauge,
    raft_last_log_index: IntGauge,
    raft_applied_index: IntGauge,
    raft_snapshot_index: IntGauge,
    raft_commit_index: IntGauge,
    raft_replication_lag: IntGaugeVec,
    raft_peer_last_contact: prometheus::GaugeVec,
    /// `process_*` (CPU, memory, file descriptors), unprefixed as Prometheus expects.
    process_registry: Registry,
    pub scrub_quarantined: prometheus::IntCounter,
    pub scrub_last_run: IntGauge,
    /// When the node's TLS certificate (`node`) and its CA (`ca`) expire.
    tls_not_after: IntGaugeVec,
    /// Certificate reloads that failed (the old certificate stayed in use).
    pub tls_reload_failures: prometheus::IntCounter,
    /// Secret reloads (SIGHUP) that failed (the secrets in use stayed).
    pub secret_reload_failures: prometheus::IntCounter,
    /// Writes decided on an agent's pending state while earlier ones were in flight.
    pub writes_pipelined: prometheus::IntCounter,
    /// Writes the state machine rejected because they did not extend the agent's head.
    pub writes_rejected_at_apply: prometheus::IntCounter,
    /// Leadership rounds run for linearizable reads (`read_rounds`), against the reads.
    pub read_rounds: prometheus::IntCounter,
    pub linearizable_reads: prometheus::IntCounter,
    /// Writes whose token this follower's state did not know, asked of the leader before
    /// their body was read, by outcome (`api::forward`).
    pub tokens_checked_with_leader: IntCounterVec,
    /// Raft sends withheld while the disk was stalled, each try (`raft_client`).
    pub raft_replication_withheld: prometheus::IntCounter,
    /// Log lines dropped because the log's reader fell behind (`lineage_log_sink`).
    log_lines_dropped: prometheus::IntCounter,
    log_drops_synced: parking_lot::Mutex<()>,
    /// Vote requests received, by candidate (`raft_routes`).
    pub raft_vote_requests: IntCounterVec,
    /// Raft requests refused, by reason (`raft_routes`).
    pub raft_requests_refused: IntCounterVec,
    /// Raft answers refused for not matching their stated SHA-256 (`raft_client`).
    pub raft_answers_refused: prometheus::IntCounter,
    /// Raft requests received and answers got without a body SHA-256, by way.
    pub raft_messages_without_digest: IntCounterVec,
    /// Stored idempotency answers past their window, by outcome (`idempotency_expiry`).
    pub idempotency_expired: IntCounterVec,
    /// The age of the oldest durable write in flight, and whether the node holds its
    /// disk for stalled (`disk_stall`).
    pub disk_write_in_flight: prometheus::Gauge,
    pub disk_stalled: IntGauge,
    pub state_blocked: prometheus::Gauge,
    pub state_waiters: IntGauge,
    /// Open client connections (`lineage_http_server`).
    http_connections: IntGauge,
    http_connections_closed: IntCounterVec,
    /// Last exported value of each state-derived counter, to add only the difference.
    exported: Mutex<BTreeMap<String, u64>>,
}

fn must<T>(result: prometheus::Result<T>) -> T {
    // Metric definitions are static; a failure here is a programming error caught by
    // the first test that starts a node.
    result.unwrap_or_else(|e| panic!("metric definition: {e}"))
}

impl Metrics {
    #[expect(
        clippy::too_many_lines,
        reason = "the metric definitions, one after another"
    )]
    pub fn new(node_id: u64) -> Self {
        let registry = Registry::new_custom(
            Some("lineage".into()),
            Some([("node".to_string(), node_id.to_string())].into()),
        )
        .unwrap_or_default();
        let counter = |name: &str, help: &str, labels: &[&str]| {
            let c = must(IntCounterVec::new(Opts::new(name, help), labels));
            must(registry.register(Box::new(c.clone())));
            c
        };
        let gauge = |name: &str, help: &str| {
            let g = must(IntGauge::new(name, help));
            must(registry.register(Box::new(g.clone())));
            g
        };
        let decisions = counter(
            "decisions_total",
            "Guard decisions in the replicated logs, by outcome and deny code.",
            &["outcome", "code"],
        );
        let scars = counter(
            "scars_total",
            "Scars in the replicated logs, by severity.",
            &["severity"],
        );
        let terminations = counter(
            "terminations_total",
            "Agent terminations, by cause (budget, scars, replay, operator, guard_claimed).",
            &["cause"],
        );
        let agents = must(IntGaugeVec::new(
            Opts::new(
                "agents",
                "Agents on this node, by state (active, terminated, quarantined).",
            ),
            &["state"],
        ));
        must(registry.register(Box::new(agents.clone())));
        let raft_replication_lag = must(IntGaugeVec::new(
            Opts::new(
                "raft_replication_lag_entries",
                "Log entries a follower is behind the leader (leader only).",
            ),
            &["follower"],
        ));
        must(registry.register(Box::new(raft_replication_lag.clone())));
        let raft_peer_last_contact = must(prometheus::GaugeVec::new(
            Opts::new(
                "raft_peer_last_contact_seconds",
                "Seconds since a peer last answered the leader's Raft RPCs (leader only; \
                 a peer that never answered counts from the leader's start).",
            ),
            &["peer"],
        ));
        must(registry.register(Box::new(raft_peer_last_contact.clone())));
        let build_info = must(IntGaugeVec::new(
            Opts::new("build_info", "Always 1; the running build's version."),
            &["version"],
        ));
        must(registry.register(Box::new(build_info.clone())));
        build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);
        let process_registry = Registry::new();
        #[cfg(target_os = "linux")]
        must(process_registry.register(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        )));
        let http_request_duration = must(HistogramVec::new(
            HistogramOpts::new(
                "http_request_duration_seconds",
                "HTTP request latency by route.",
            )
            .buckets(vec![
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
            ]),
            &["method", "route", "status"],
        ));
        must(registry.register(Box::new(http_request_duration.clone())));
        let log_append_duration = must(Histogram::with_opts(
            HistogramOpts::new(
                "raft_log_append_duration_seconds",
                "Durable Raft log writes (one group commit each: write + fdatasync).",
            )
            .buckets(vec![
                0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5,
            ]),
        ));
        must(registry.register(Box::new(log_append_duration.clone())));
        let oldest_pending_age = must(prometheus::Gauge::new(
            "oldest_pending_approval_age_seconds",
            "Age of the oldest action waiting for approval (0 when none).",
        ));
        must(registry.register(Box::new(oldest_pending_age.clone())));
        let scrub_quarantined = must(prometheus::IntCounter::new(
            "scrub_quarantined_total",
            "Agents the integrity scrub quarantined on this node.",
        ));
        must(registry.register(Box::new(scrub_quarantined.clone())));
        let tls_not_after = IntGaugeVec::new(
            Opts::new(
                "tls_cert_not_after_seconds",
                "When a certificate this node uses expires (Unix seconds): node is its own, \
                 ca the first of its CA bundle.",
            ),
            &["cert"],
        );
        let tls_not_after = must(tls_not_after);
        must(registry.register(Box::new(tls_not_after.clone())));
        let tls_reload_failures = must(prometheus::IntCounter::new(
            "tls_reload_failures_total",
            "TLS certificate reloads that failed; the previous certificate stayed in use.",
        ));
        must(registry.register(Box::new(tls_reload_failures.clone())));
        let secret_reload_failures = must(prometheus::IntCounter::new(
            "secret_reload_failures_total",
            "Reloads of cluster.secret, admin.token or admin.token.previous that failed; \
             the secrets in use stayed.",
        ));
        must(registry.register(Box::new(secret_reload_failures.clone())));
        let writes_pipelined = must(prometheus::IntCounter::new(
            "writes_pipelined_total",
            "Writes this leader decided on an agent's pending state while the agent's \
             earlier writes were still replicating.",
        ));
        must(registry.register(Box::new(writes_pipelined.clone())));
        let writes_rejected_at_apply = must(prometheus::IntCounter::new(
            "writes_rejected_at_apply_total",
            "Writes this leader proposed that were rejected at apply because they did not \
             extend the agent's head (decided on a stale or pending state that the log \
             does not hold); each is decided once more or answered with an error.",
        ));
        must(registry.register(Box::new(writes_rejected_at_apply.clone())));
        let read_rounds = must(prometheus::IntCounter::new(
            "read_rounds_total",
            "Leadership rounds (a heartbeat to every follower) this node ran for \
             linearizable reads; reads arriving during one share the next.",
        ));
        must(registry.register(Box::new(read_rounds.clone())));
        let linearizable_reads = must(prometheus::IntCounter::new(
            "linearizable_reads_total",
            "Reads this node confirmed its leadership for (or learned the leader for).",
        ));
        must(registry.register(Box::new(linearizable_reads.clone())));
        let tokens_checked_with_leader = counter(
            "tokens_checked_with_leader_total",
            "Writes whose token this follower's state did not know (yet), whose token it \
             asked the leader about before reading the body, by outcome: vouched (the \
             body was read and relayed), refused (401), unanswered (503).",
            &["outcome"],
        );
        for outcome in ["vouched", "refused", "unanswered"] {
            tokens_checked_with_leader.with_label_values(&[outcome]);
        }
        let raft_replication_withheld = must(prometheus::IntCounter::new(
            "raft_replication_withheld_total",
            "Raft sends (append, heartbeat or snapshot chunk, each retry counted) this node \
             withheld while it stepped back from a stalled disk, so that a catch-up stream \
             cannot hold off the election.",
        ));
        must(registry.register(Box::new(raft_replication_withheld.clone())));
        let log_lines_dropped = must(prometheus::IntCounter::new(
            "log_lines_dropped_total",
            "Log lines dropped because whatever reads the node's stderr fell behind \
             (8,192 lines were queued): the node does not wait for its log.",
        ));
        must(registry.register(Box::new(log_lines_dropped.clone())));
        let raft_vote_requests = counter(
            "raft_vote_requests_received_total",
            "Raft vote requests this node received, by candidate node id (`other`: an id \
             not in the membership): who keeps starting elections.",
            &["candidate"],
        );
        let raft_requests_refused = counter(
            "raft_requests_refused_total",
            "Raft requests this node refused, by reason: secret (no cluster secret it \
             accepts, as in a rotation gone wrong) and certificate (with TLS, not a member \
             node's), before reading them; digest (the body does not match the SHA-256 its \
             sender stated: changed on the way); missing_digest (no SHA-256, refused with \
             --require-raft-digests).",
            &["reason"],
        );
        for reason in ["secret", "certificate", "digest", "missing_digest"] {
            raft_requests_refused.with_label_values(&[reason]);
        }
        let raft_answers_refused = must(prometheus::IntCounter::new(
            "raft_answers_refused_total",
            "Raft answers this node refused because the body did not match the SHA-256 \
             the answering peer stated (changed on the way back); the call counts as \
             failed (an append or snapshot chunk is sent again, a vote's grant is lost).",
        ));
        must(registry.register(Box::new(raft_answers_refused.clone())));
        let raft_messages_without_digest = counter(
            "raft_messages_without_digest_total",
            "Raft requests this node received (way=request) and answers it got \
             (way=answer) without a body SHA-256, as nodes of a build before digests send \
             them: read unchecked, or refused with --require-raft-digests. It stops \
             increasing once every node runs a build that sends digests.",
            &["way"],
        );
        for way in ["request", "answer"] {
            raft_messages_without_digest.with_label_values(&[way]);
        }
        let idempotency_expired = counter(
            "idempotency_answers_expired_total",
            "Index rows of stored Idempotency-Key answers this node took once past their \
             window, by outcome: removed (the answer with it), reindexed (the answer under \
             the key did not match the row: kept, indexed again as of now), absent (no \
             answer under the key any more).",
            &["outcome"],
        );
        for outcome in ["removed", "reindexed", "absent"] {
            idempotency_expired.with_label_values(&[outcome]);
        }
        let disk_write_in_flight = must(prometheus::Gauge::new(
            "disk_write_in_flight_seconds",
            "How long the oldest durable write in flight (a Raft log group commit, a state \
             file commit) has been waiting for the disk; 0 when none is.",
        ));
        must(registry.register(Box::new(disk_write_in_flight.clone())));
        let state_blocked = must(prometheus::Gauge::new(
            "state_blocked_seconds",
            "How long readers of this node's applied state have been kept out by a write \
             holding it or queued for it (a heads, operator or import entry's commit, a \
             checkpoint's flush, a snapshot's); 0 when they are not. Past --disk-stall-ms \
             requests that read it are answered 503 at once.",
        ));
        must(registry.register(Box::new(state_blocked.clone())));
        let state_waiters = gauge(
            "state_waiters",
            "Requests and tasks waiting for this node's applied state, each on a thread of \
             its own; past 256 requests that read it are answered 503 at once.",
        );
        let disk_stalled = gauge(
            "disk_stalled",
            "1 while this node's disk has not finished a write for longer than \
             --disk-stall-ms: it steps back from leading and answers 503.",
        );
        let http_connections_closed = counter(
            "http_connections_closed_total",
            "Client connections the server closed, by reason (header_timeout, body_timeout, \
             idle, evicted at the connection cap, refused with every connection busy, \
             plaintext_on_tls, tls_handshake_timeout, tls_handshake_failed).",
            &["reason"],
        );
        Metrics {
            http_connections: gauge("http_connections", "Open client connections."),
            http_connections_closed,
            pending_approvals: gauge("pending_approvals", "Actions waiting for approval."),
            raft_term: gauge("raft_term", "Current Raft term."),
            raft_leader: gauge(
                "raft_leader_id",
                "Id of the leader this node knows (0 if none).",
            ),
            raft_is_leader: gauge("raft_is_leader", "1 if this node is the leader."),
            raft_last_log_index: gauge(
                "raft_last_log_index",
                "Index of the last entry in this node's log.",
            ),
            raft_applied_index: gauge(
                "raft_applied_index",
                "Index of the last entry applied on this node.",
            ),
            raft_commit_index: gauge(
                "raft_commit_index",
                "Highest log index known to be committed.",
            ),
            raft_snapshot_index: gauge(
                "raft_snapshot_index",
                "Last log index covered by this node's snapshot (0 if none).",
            ),
            scrub_last_run: gauge(
                "scrub_last_run_timestamp_seconds",
                "When the last scrub pass finished.",
            ),
            registry,
            http_request_duration,
            log_append_duration,
            decisions,
            scars,
            terminations,
            agents,
            oldest_pending_age,
            raft_replication_lag,
            raft_peer_last_contact,
            process_registry,
            scrub_quarantined,
            tls_not_after,
            tls_reload_failures,
            secret_reload_failures,
            writes_pipelined,
            writes_rejected_at_apply,
            read_rounds,
            linearizable_reads,
            tokens_checked_with_leader,
            log_lines_dropped,
            log_drops_synced: parking_lot::Mutex::new(()),
            raft_replication_withheld,
            idempotency_expired,
            raft_vote_requests,
            raft_requests_refused,
            raft_answers_refused,
            raft_messages_without_digest,
            disk_write_in_flight,
            state_blocked,
            state_waiters,
            disk_stalled,
            exported: Mutex::new(BTreeMap::new()),
        }
    }

    /// When the certificate `cert` (`node` or `ca`) expires.
    pub fn set_tls_not_after(&self, cert: &str, unix_seconds: i64) {
        self.tls_not_after
            .with_label_values(&[cert])
            .set(unix_seconds);
    }

    /// Raises a state-derived counter to `total`.
    fn set_counter(&self, counter: &IntCounterVec, labels: &[&str], total: u64) {
        let key = format!("{:p}{}", counter, labels.join("\u{1f}"));
        let mut exported = self.exported.lock().unwrap_or_else(|p| p.into_inner());
        let before = exported.get(&key).copied().unwrap_or(0);
        let metric = counter.with_label_values(labels);
        if total < before {
            // The state shrank (a snapshot replaced it): restart the counter.
            metric.reset();
            metric.inc_by(total);
        } else {
            metric.inc_by(total - before);
        }
        exported.insert(key, total);
    }

    /// Sets the figures Raft's metrics and the state's lock give.
    pub fn refresh(&self, node: &NodeView<'_>) {
        let blocked = node.sm.state_blocked_for();
        self.state_blocked
            .set(blocked.map_or(0.0, |blocked| blocked.as_secs_f64()));
        self.state_waiters
            .set(i64::try_from(node.sm.state_waiters()).unwrap_or(i64::MAX));
        {
            // One scrape at a time brings the counter up to the count (two at once
            // would both add the same difference).
            let _one = self.log_drops_synced.lock();
            let dropped = lineage_log_sink::dropped_lines();
            self.log_lines_dropped
                .inc_by(dropped.saturating_sub(self.log_lines_dropped.get()));
        }
        self.refresh_raft(node);
    }

    /// Sets the figures that walk every agent from `state` (`None`: a write keeps it,
    /// and they keep their last values).
    pub fn refresh_agents(&self, state: Option<&SmData>) {
        if let Some(state) = state {
            self.refresh_state(state);
        }
    }

    /// The figures that walk every agent, in one pass over the state as applied.
    fn refresh_state(&self, data: &SmData) {
        let mut allowed = 0u64;
        let mut pending_decisions = 0u64;
        let mut denied: BTreeMap<&'static str, u64> = BTreeMap::new();
        let mut scars: BTreeMap<&'static str, u64> = BTreeMap::new();
        let mut terminations: BTreeMap<&'static str, u64> = BTreeMap::new();
        let (mut active, mut terminated, mut quarantined) = (0i64, 0i64, 0i64);
        let mut pending_now = 0usize;
        let mut oldest_pending: Option<i64> = None;
        {
            let none = crate::store::imports::ImportPoint::default();
            for (agent_id, slot) in &data.agents {
                let state = match slot {
                    AgentSlot::Quarantined(_) => {
                        quarantined += 1;
                        continue;
                    }
                    AgentSlot::Active(state) => state,
                };
                // An imported agent counts from its import on (no alert for its history).
                let point = data.import_points.get(agent_id).unwrap_or(&none);
                allowed += state.actions_allowed.saturating_sub(point.allowed);
                pending_decisions += state
                    .approvals_requested
                    .saturating_sub(point.approvals_requested);
                for (code, n) in &state.denied_by_code {
                    let before = point.denied_by_code.get(code).copied().unwrap_or(0);
                    let code = DenyReason::CODES
                        .iter()
                        .find(|c| **c == code)
                        .copied()
                        .unwrap_or("other");
                    *denied.entry(code).or_insert(0) += n.saturating_sub(before);
                }
                let mut scars_before = point.scars.clone();
                for scar in &state.scars {
                    let severity = scar.severity.as_str();
                    match scars_before.get_mut(severity) {
                        Some(left) if *left > 0 => *left -= 1,
                        _ => *scars.entry(severity).or_insert(0) += 1,
                    }
                }
                if state.is_alive() {
                    active += 1;
                } else {
                    terminated += 1;
                    if !point.terminated {
                        let cause = state
                            .termination_cause()
                            .unwrap_or(TerminationCause::Operator);
                        *terminations.entry(cause.as_str()).or_insert(0) += 1;
                    }
                }
                pending_now += state.pending_count();
                if let Some(t) = state.oldest_pending_micros() {
                    oldest_pending = Some(oldest_pending.map_or(t, |o| o.min(t)));
                }
            }
        }
        self.set_counter(&self.decisions, &["allowed", ""], allowed);
        self.set_counter(
            &self.decisions,
            &["pending_approval", ""],
            pending_decisions,
        );
        for code in DenyReason::CODES.iter().chain(["other"].iter()) {
            self.set_counter(
                &self.decisions,
                &["denied", code],
                denied.get(code).copied().unwrap_or(0),
            );
        }
        for severity in ["minor", "moderate", "severe", "fatal"] {
            self.set_counter(
                &self.scars,
                &[severity],
                scars.get(severity).copied().unwrap_or(0),
            );
        }
        for cause in TerminationCause::ALL.map(TerminationCause::as_str) {
            self.set_counter(
                &self.terminations,
                &[cause],
                terminations.get(cause).copied().unwrap_or(0),
            );
        }
        self.agents.with_label_values(&["active"]).set(active);
        self.agents
            .with_label_values(&["terminated"])
            .set(terminated);
        self.agents
            .with_label_values(&["quarantined"])
            .set(quarantined);
        self.pending_approvals.set(pending_now as i64);
        let age = oldest_pending.map_or(0.0, |t| (timestamp::now_micros() - t).max(0) as f64 / 1e6);
        self.oldest_pending_age.set(age);
    }

    /// The figures Raft's own metrics give.
    fn refresh_raft(&self, node: &NodeView<'_>) {
        let metrics = node.raft.metrics().borrow().clone();
        self.raft_term.set(metrics.current_term as i64);
        self.raft_leader
            .set(metrics.current_leader.unwrap_or(0) as i64);
        self.raft_is_leader
            .set(i64::from(metrics.current_leader == Some(node.id)));
        let last = metrics.last_log_index.unwrap_or(0);
        self.raft_last_log_index.set(last as i64);
        self.raft_applied_index
            .set(metrics.last_applied.map_or(0, |l| l.index) as i64);
        self.raft_commit_index.set(node.committed_index as i64);
        self.raft_snapshot_index
            .set(metrics.snapshot.map_or(0, |l| l.index) as i64);
        self.raft_peer_last_contact.reset();
        if metrics.current_leader == Some(node.id) {
            for peer in metrics
                .membership_config
                .membership()
                .nodes()
                .map(|(id, _)| *id)
            {
                if peer != node.id {
                    self.raft_peer_last_contact
                        .with_label_values(&[&peer.to_string()])
                        .set(node.peers.silence(peer).as_secs_f64());
                }
            }
        }
        self.raft_replication_lag.reset();
        if let Some(replication) = &metrics.replication {
            for (follower, matched) in replication {
                if *follower == node.id {
                    continue;
                }
                let matched = matched.map_or(0, |l| l.index);
                self.raft_replication_lag
                    .with_label_values(&[&follower.to_string()])
                    .set(last.saturating_sub(matched) as i64);
            }
        }
    }

    /// The text exposition format of every metric.
    pub fn render(&self) -> Result<String, String> {
        let mut buffer = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buffer)
            .map_err(|e| e.to_string())?;
        TextEncoder::new()
            .encode(&self.process_registry.gather(), &mut buffer)
            .map_err(|e| e.to_string())?;
        String::from_utf8(buffer).map_err(|e| e.to_string())
    }
}

/// The accept loop's counts: `lineage_http_connections` and
/// `lineage_http_connections_closed_total{reason}`.
impl lineage_http_server::Events for Metrics {
    fn open_connections(&self, open: usize) {
        self.http_connections.set(open as i64);
    }

    fn connection_closed(&self, reason: &'static str) {
        self.http_connections_closed
            .with_label_values(&[reason])
            .inc();
    }
}
