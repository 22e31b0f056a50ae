//! The checkpointer's Prometheus metrics (names the alert rules in
//! `deploy/prometheus/alerts.yml` use).

use prometheus::{
    Encoder, Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec,
    Opts, Registry, TextEncoder,
};

#[derive(Clone)]
pub struct Metrics {
    pub registry: Registry,
    /// Seconds the newest accepted checkpoint has waited for a quorum of cosigners (0
    /// when cosigned).
    pub checkpoint_age: Gauge,
    pub interval: Gauge,
    /// Alarms, by source: a witness's name, or `monitor`.
    pub inconsistencies: IntCounterVec,
    pub rounds: IntCounter,
    pub round_duration: Histogram,
    pub fetch_errors: IntCounter,
    pub witness_errors: IntCounterVec,
    pub checkpoint_size: IntGauge,
    pub cosigned_size: IntGaugeVec,
    pub witnesses: IntGauge,
    /// Evidence files in the evidence directory: each is an alarm nobody has dealt with
    /// yet (moving it out resolves it). Unlike a counter, it survives restarts.
    pub unresolved_evidence: IntGauge,
    /// Open connections to the metrics port.
    http_connections: IntGauge,
    /// Connections the metrics port closed, by reason (`lineage_http_server::Events`).
    http_connections_closed: IntCounterVec,
}

impl Metrics {
    pub fn new(interval_secs: f64) -> Result<Metrics, prometheus::Error> {
        let registry = Registry::new();
        let p = "lineage_checkpointer_";
        let checkpoint_age = Gauge::new(
            format!("{p}checkpoint_age_seconds"),
            "Seconds the newest heads checkpoint has waited for a quorum of cosignatures",
        )?;
        let interval = Gauge::new(format!("{p}interval_seconds"), "Seconds between rounds")?;
        let inconsistencies = IntCounterVec::new(
            Opts::new(
                format!("{p}inconsistencies_total"),
                "Alarms: inconsistent or refused checkpoints, by source (a witness, or \
                 monitor) and by whose fault they show (kind: log, witness, checkpointer)",
            ),
            &["witness", "kind"],
        )?;
        let rounds = IntCounter::new(format!("{p}rounds_total"), "Rounds run")?;
        let round_duration = Histogram::with_opts(
            HistogramOpts::new(format!("{p}round_duration_seconds"), "Time per round").buckets(
                vec![
                    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                ],
            ),
        )?;
        let fetch_errors = IntCounter::new(
            format!("{p}fetch_errors_total"),
            "Rounds ended early because the cluster could not be read",
        )?;
        let witness_errors = IntCounterVec::new(
            Opts::new(
                format!("{p}witness_errors_total"),
                "Witness requests that failed without an answer to act on",
            ),
            &["witness"],
        )?;
        let checkpoint_size = IntGauge::new(
            format!("{p}checkpoint_size"),
            "Size of the last accepted heads checkpoint",
        )?;
        let cosigned_size = IntGaugeVec::new(
            Opts::new(
                format!("{p}cosigned_size"),
                "Largest size each witness cosigned",
            ),
            &["witness"],
        )?;
        let witnesses = IntGauge::new(format!("{p}witnesses"), "Witnesses configured")?;
        let unresolved_evidence = IntGauge::new(
            format!("{p}unresolved_evidence"),
            "Evidence files in the evidence directory (alarms not yet moved out)",
        )?;
        registry.register(Box::new(checkpoint_age.clone()))?;
        registry.register(Box::new(interval.clone()))?;
        registry.register(Box::new(inconsistencies.clone()))?;
        registry.register(Box::new(rounds.clone()))?;
        registry.register(Box::new(round_duration.clone()))?;
        registry.register(Box::new(fetch_errors.clone()))?;
        registry.register(Box::new(witness_errors.clone()))?;
        registry.register(Box::new(checkpoint_size.clone()))?;
        registry.register(Box::new(cosigned_size.clone()))?;
        registry.register(Box::new(witnesses.clone()))?;
        let http_connections = IntGauge::new(
            format!("{p}http_connections"),
            "Open connections to the metrics port",
        )?;
        let http_connections_closed = IntCounterVec::new(
            Opts::new(
                format!("{p}http_connections_closed_total"),
                "Connections the metrics port closed, by reason",
            ),
            &["reason"],
        )?;
        registry.register(Box::new(unresolved_evidence.clone()))?;
        registry.register(Box::new(http_connections.clone()))?;
        registry.register(Box::new(http_connections_closed.clone()))?;
        interval.set(interval_secs);
        Ok(Metrics {
            registry,
            checkpoint_age,
            interval,
            inconsistencies,
            rounds,
            round_duration,
            fetch_errors,
            witness_errors,
            checkpoint_size,
            cosigned_size,
            witnesses,
            unresolved_evidence,
            http_connections,
            http_connections_closed,
        })
    }

    /// The text exposition format.
    pub fn render(&self) -> String {
        let mut buffer = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buffer);
        String::from_utf8(buffer).unwrap_or_default()
    }
}

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
