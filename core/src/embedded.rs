//! An in-process guard over one log file, for agents that embed the guard.
//!
//! Each operation decides on the current state, seals the records, makes them durable
//! with one write and one `fdatasync`, and only then applies them. If the write fails,
//! the in-memory state is unchanged and the guard refuses further work (its file may
//! hold records it did not apply); reopening replays whatever reached the disk.

use std::path::Path;

use serde_json::Value;

use crate::guard::{
    decide, missing_termination, seal, Action, AgentState, Command, Decision, GuardError, Outcome,
    PendingAction, ReplayError, Severity, Status,
};
use crate::keys::AuditKey;
use crate::log_file::{AuditError, AuditLog};
use crate::policy::Policy;
use crate::record::{timestamp, Head, Record};

#[derive(Debug, thiserror::Error)]
pub enum GuardFileError {
    #[error(transparent)]
    Audit(#[from] AuditError),
    #[error(transparent)]
    Guard(#[from] GuardError),
    #[error("log is not a guard log: {0}")]
    Replay(#[from] ReplayError),
    #[error("an earlier write failed; reopen the guard to continue")]
    Poisoned,
}

/// A guarded agent whose log is a local file.
#[derive(Debug)]
pub struct Guard {
    log: AuditLog,
    state: AgentState,
    poisoned: bool,
}

impl Guard {
    /// Creates a new agent: writes genesis and policy to a new file.
    pub fn create(
        path: impl AsRef<Path>,
        key: AuditKey,
        agent_id: &str,
        policy: Policy,
    ) -> Result<Self, GuardFileError> {
        let log = AuditLog::create_empty(path.as_ref(), key, agent_id)?;
        let mut guard = Guard {
            log,
            state: AgentState::new(),
            poisoned: false,
        };
        guard.run(&Command::Create {
            agent_id: agent_id.to_string(),
            policy,
        })?;
        Ok(guard)
    }

    /// Opens an agent: verifies and replays its log, then appends a missing termination
    /// record if the replayed state calls for one.
    pub fn open(path: impl AsRef<Path>, key: AuditKey) -> Result<Self, GuardFileError> {
        let mut state = AgentState::new();
        let log = AuditLog::open_with(path, key, |record| {
            state.apply(record).map_err(|e| e.to_string())
        })?;
        let mut guard = Guard {
            log,
            state,
            poisoned: false,
        };
        if let Some(repair) = missing_termination(&guard.state) {
            guard.commit(vec![repair], timestamp::now_micros())?;
        }
        Ok(guard)
    }

    /// Runs a command: decide, write durably, apply.
    pub fn run(&mut self, command: &Command) -> Result<Option<Decision>, GuardFileError> {
        if self.poisoned {
            return Err(GuardFileError::Poisoned);
        }
        let now = timestamp::now_micros();
        let decided = decide(&self.state, command, now, self.log.public_key_hex())?;
        self.commit(decided.drafts, now)?;
        Ok(decided.decision)
    }

    fn commit(
        &mut self,
        drafts: Vec<crate::guard::Draft>,
        now: i64,
    ) -> Result<Vec<Record>, GuardFileError> {
        let records = seal(&self.state, drafts, self.log.key(), now);
        if let Err(e) = self.log.write_records(&records) {
            self.poisoned = true;
            return Err(e.into());
        }
        for record in &records {
            // The records were decided from this state; a failure would be a bug.
            self.state.apply(record)?;
        }
        Ok(records)
    }

    fn decision(&mut self, command: Command) -> Result<Decision, GuardFileError> {
        self.run(&command)?
            .ok_or_else(|| GuardFileError::Replay(ReplayError("command gave no decision".into())))
    }

    pub fn request(
        &mut self,
        tool: &str,
        input: Value,
        cost: Option<u64>,
    ) -> Result<Decision, GuardFileError> {
        self.decision(Command::Request {
            tool: tool.to_string(),
            input,
            cost,
        })
    }

    pub fn approve(&mut self, action_id: &str, approver: &str) -> Result<Decision, GuardFileError> {
        self.approve_with_note(action_id, approver, None)
    }

    pub fn approve_with_note(
        &mut self,
        action_id: &str,
        approver: &str,
        note: Option<&str>,
    ) -> Result<Decision, GuardFileError> {
        self.decision(Command::Approve {
            action_id: action_id.to_string(),
            approver: approver.to_string(),
            claimed_by: None,
            note: note.map(str::to_string),
        })
    }

    pub fn reject(
        &mut self,
        action_id: &str,
        approver: &str,
        reason: &str,
        scar: Option<Severity>,
    ) -> Result<Decision, GuardFileError> {
        self.decision(Command::Reject {
            action_id: action_id.to_string(),
            approver: approver.to_string(),
            claimed_by: None,
            reason: reason.to_string(),
            scar,
        })
    }

    pub fn report(&mut self, action_id: &str, outcome: Outcome) -> Result<(), GuardFileError> {
        self.run(&Command::Report {
            action_id: action_id.to_string(),
            outcome,
        })
        .map(drop)
    }

    pub fn scar(
        &mut self,
        severity: Severity,
        reason: &str,
        action_id: Option<&str>,
    ) -> Result<(), GuardFileError> {
        self.run(&Command::Scar {
            severity,
            reason: reason.to_string(),
            action_id: action_id.map(str::to_string),
            by: None,
        })
        .map(drop)
    }

    pub fn terminate(&mut self, reason: &str, by: &str) -> Result<(), GuardFileError> {
        self.run(&Command::Terminate {
            reason: reason.to_string(),
            by: by.to_string(),
            claimed_by: None,
        })
        .map(drop)
    }

    pub fn status(&self) -> Status {
        self.state.status()
    }

    pub fn is_alive(&self) -> bool {
        self.state.is_alive()
    }

    /// One action. Its tool, input and cost are read back from the file (memory keeps
    /// only its status, waiting or decided: `guard::ActionBook`).
    pub fn action(&self, action_id: &str) -> Result<Option<Action>, GuardFileError> {
        let Some(kept) = self.state.action_view(action_id) else {
            return Ok(None);
        };
        let records = self.log.records()?;
        let request = request_at(&records, kept.requested_seq, action_id)?;
        Ok(Some(kept.view(action_id, request).map_err(ReplayError)?))
    }

    /// The approval queue in log order, each entry's request read back from the file.
    pub fn pending(&self) -> Result<Vec<PendingAction>, GuardFileError> {
        let queue = self.state.pending();
        if queue.is_empty() {
            return Ok(Vec::new());
        }
        let records = self.log.records()?;
        queue
            .iter()
            .map(|entry| {
                let request = request_at(&records, entry.seq, &entry.action_id)?;
                Ok(entry.view(request).map_err(ReplayError)?)
            })
            .collect()
    }

    pub fn head(&self) -> Head {
        self.log.head()
    }

    pub fn state(&self) -> &AgentState {
        &self.state
    }

    /// Every record, read back from the file.
    pub fn records(&self) -> Result<Vec<Record>, GuardFileError> {
        Ok(self.log.records()?)
    }
}

/// The record at `seq` (the file's records are in seq order): `action_id`'s request.
fn request_at<'a>(
    records: &'a [Record],
    seq: u64,
    action_id: &str,
) -> Result<&'a Record, ReplayError> {
    records
        .binary_search_by_key(&seq, |r| r.seq)
        .map(|i| &records[i])
        .map_err(|_| ReplayError(format!("the request of {action_id} is not in the file")))
}
