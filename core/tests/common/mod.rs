//! An agent driven the way a node drives one, with a clock the test sets: each command is
//! decided, sealed with a real key and folded into the state record by record.

#![allow(dead_code, reason = "each test crate uses its own part of the harness")]

use lineage_core::guard::{decide, seal, AgentState, Command, Decision, Draft, GuardError};
use lineage_core::record::Record;
use lineage_core::{AuditKey, Policy};
use serde_json::Value;

pub const START: i64 = 1_800_000_000_000_000;

/// One agent's log and state, each command decided, sealed and replayed record by record.
pub struct Agent {
    pub key: AuditKey,
    pub state: AgentState,
    pub records: Vec<Record>,
    pub now: i64,
}

impl Agent {
    pub fn create(policy: Value) -> Agent {
        let mut agent = Agent {
            key: AuditKey::from_seed([3; 32]),
            state: AgentState::new(),
            records: Vec::new(),
            now: START,
        };
        let policy: Policy = serde_json::from_value(policy).unwrap();
        agent
            .run(Command::Create {
                agent_id: "bot".into(),
                policy,
            })
            .unwrap();
        agent
    }

    pub fn run(&mut self, command: Command) -> Result<Option<Decision>, GuardError> {
        let decided = decide(&self.state, &command, self.now, self.key.public_key_hex())?;
        self.append(decided.drafts);
        Ok(decided.decision)
    }

    pub fn append(&mut self, drafts: Vec<Draft>) {
        for record in seal(&self.state, drafts, &self.key, self.now) {
            self.state.apply(&record).unwrap();
            self.records.push(record);
        }
        self.now += 1_000;
    }

    pub fn request(&mut self, tool: &str, input: Value) -> Result<Option<Decision>, GuardError> {
        self.run(Command::Request {
            tool: tool.into(),
            input,
            cost: None,
        })
    }

    pub fn approve(
        &mut self,
        action_id: &str,
        claimed_by: Option<&str>,
    ) -> Result<Option<Decision>, GuardError> {
        self.run(Command::Approve {
            action_id: action_id.into(),
            approver: "alice".into(),
            claimed_by: claimed_by.map(str::to_string),
            note: None,
        })
    }
}

pub fn allowed_id(decision: Option<Decision>) -> String {
    match decision {
        Some(Decision::Allowed { action_id, .. }) => action_id,
        other => panic!("not allowed: {other:?}"),
    }
}
