//! Background integrity scrub: re-verifies every agent's stored records (chain, hashes,
//! signatures against the cluster key) and checks they end at the head the state was
//! folded to. An agent whose copy fails is quarantined on this node: it serves nothing
//! for that agent and applies nothing more to it, while other nodes carry on.

use std::time::Duration;

use lineage_core::verify::VerifyOptions;

use crate::store::{AgentSlot, StateMachine};

/// What one pass found.
#[derive(Debug, Default)]
pub struct ScrubReport {
    pub agents_checked: usize,
    pub records_checked: u64,
    pub quarantined: Vec<(String, String)>,
}

/// Verifies every active agent once.
pub fn scrub_once(sm: &StateMachine, public_key: &str) -> ScrubReport {
    let mut report = ScrubReport::default();
    let agents: Vec<(String, Option<lineage_core::Head>)> = sm
        .read_data()
        .agents
        .iter()
        .filter_map(|(id, slot)| match slot {
            AgentSlot::Active(state) => Some((id.clone(), state.head.clone())),
            AgentSlot::Quarantined(_) => None,
        })
        .collect();
    for (agent_id, head) in agents {
        report.agents_checked += 1;
        let options = VerifyOptions {
            public_key: Some(public_key.to_string()),
            checkpoint: head.clone(),
        };
        let failure = match sm.verify_stored(&agent_id, crate::spare_cores::verifier(options)) {
            Err(e) => Some(format!("cannot read stored records: {e}")),
            Ok(verified) => {
                report.records_checked += verified.records;
                match verified.failure {
                    Some(f) => Some(f.to_string()),
                    // Records may have been appended since the head was read.
                    None if verified.head.as_ref().map(|h| h.seq)
                        < head.as_ref().map(|h| h.seq) =>
                    {
                        Some("stored log is shorter than the agent's head".into())
                    }
                    None => None,
                }
            }
        };
        if let Some(reason) = failure {
            tracing::error!(
                agent_id,
                reason,
                "scrub: stored copy failed verification; agent quarantined on this node"
            );
            sm.quarantine(&agent_id, reason.clone());
            report.quarantined.push((agent_id, reason));
        }
    }
    report
}

/// Runs [`scrub_once`] every `interval` on the blocking pool.
pub fn spawn(
    sm: StateMachine,
    public_key: String,
    interval: Duration,
    metrics: std::sync::Arc<crate::metrics::Metrics>,
) {
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(interval).await;
            let sm = sm.clone();
            let key = public_key.clone();
            match tokio::task::spawn_blocking(move || scrub_once(&sm, &key)).await {
                Ok(report) => {
                    metrics
                        .scrub_quarantined
                        .inc_by(report.quarantined.len() as u64);
                    metrics
                        .scrub_last_run
                        .set(lineage_core::record::timestamp::now_micros() / 1_000_000);
                    tracing::debug!(
                        agents = report.agents_checked,
                        records = report.records_checked,
                        quarantined = report.quarantined.len(),
                        "scrub pass done"
                    )
                }
                Err(e) => tracing::warn!(error = %e, "scrub pass failed"),
            }
        }
    });
}
