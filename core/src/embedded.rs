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
    /// only its status, waiting or decided: `guard::ActionBook`), from its request's
    /// record alone (`AuditLog::records_at`).
    pub fn action(&self, action_id: &str) -> Result<Option<Action>, GuardFileError> {
        let Some(kept) = self.state.action_view(action_id) else {
            return Ok(None);
        };
        let request = self
            .log
            .records_at(&[kept.requested_seq])?
            .pop()
            .flatten()
            .ok_or_else(|| not_in_file(action_id))?;
        Ok(Some(kept.view(action_id, &request).map_err(ReplayError)?))
    }

    /// The approval queue in log order, each entry's request read back from the file
    /// (those records alone, not the whole file). An entry whose request does not read
    /// back intact fails the whole call: [`Guard::pending_queue`] lists such entries
    /// apart and returns the rest.
    pub fn pending(&self) -> Result<Vec<PendingAction>, GuardFileError> {
        let queue = self.pending_queue()?;
        match queue.unreadable.first() {
            None => Ok(queue.pending),
            Some(entry) => Err(ReplayError(format!(
                "the request of {} (seq {}) does not read back: {}",
                entry.action_id, entry.seq, entry.error
            ))
            .into()),
        }
    }

    /// The approval queue in log order, with the entries whose request record does not
    /// read back intact (changed or cut on disk since the guard opened it) listed apart,
    /// named but never shown, so that the rest can still be decided. A file that cannot
    /// be read at all is an error.
    pub fn pending_queue(&self) -> Result<PendingQueue, GuardFileError> {
        let entries = self.state.pending();
        let seqs: Vec<u64> = entries.iter().map(|entry| entry.seq).collect();
        // All of them in one pass; only if one of them is damaged, each on its own.
        let requests = match self.log.records_at(&seqs) {
            Ok(found) => found.into_iter().map(Ok).collect(),
            Err(AuditError::Corrupt(_)) => seqs
                .iter()
                .map(|&seq| match self.log.records_at(&[seq]) {
                    Ok(mut found) => Ok(Ok(found.pop().flatten())),
                    Err(AuditError::Corrupt(failure)) => Ok(Err(failure.to_string())),
                    Err(other) => Err(other),
                })
                .collect::<Result<Vec<_>, AuditError>>()?,
            Err(other) => return Err(other.into()),
        };
        let mut queue = PendingQueue::default();
        for (entry, request) in entries.iter().zip(requests) {
            let shown = request
                .and_then(|found| found.ok_or_else(|| "not in the file".to_string()))
                .and_then(|request| entry.view(&request));
            match shown {
                Ok(action) => queue.pending.push(action),
                Err(error) => queue.unreadable.push(UnreadableRequest {
                    action_id: entry.action_id.clone(),
                    seq: entry.seq,
                    error,
                }),
            }
        }
        Ok(queue)
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

/// An approval queue read back from the file ([`Guard::pending_queue`]).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct PendingQueue {
    /// The entries shown, in log order.
    pub pending: Vec<PendingAction>,
    /// The waiting actions whose request record does not read back intact.
    pub unreadable: Vec<UnreadableRequest>,
}

/// A waiting action whose request cannot be shown: which one, and why (never its input).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnreadableRequest {
    pub action_id: String,
    pub seq: u64,
    pub error: String,
}

/// An action whose request is not in the file.
fn not_in_file(action_id: &str) -> GuardFileError {
    ReplayError(format!("the request of {action_id} is not in the file")).into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::ToolRule;

    /// The approval queue and an action read back only their own requests: a record
    /// damaged on disk long before them stops neither (a read of the whole file, as
    /// before, would), while the action whose request it was cannot be shown.
    #[test]
    fn the_queue_and_an_action_read_their_requests_not_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.jsonl");
        let key = AuditKey::from_seed([5; 32]);
        let policy = Policy::new(10_000)
            .allow("search", ToolRule::cost(1))
            .allow("refund", ToolRule::cost(1).with_approval());
        let mut guard = Guard::create(&path, key.clone(), "agent", policy).unwrap();
        for n in 0..300 {
            guard
                .request("search", serde_json::json!({"n": n}), None)
                .unwrap();
        }
        let Decision::PendingApproval { action_id } = guard
            .request("refund", serde_json::json!({"order": 42}), None)
            .unwrap()
        else {
            panic!("a refund waits for an approval");
        };
        // act-1's request, the third record, changed on disk (same length).
        let text = std::fs::read_to_string(&path).unwrap();
        let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
        lines[2] = lines[2].replacen('{', "x", 1);
        std::fs::write(&path, lines.join("\n") + "\n").unwrap();
        assert!(guard.records().is_err(), "the whole file no longer reads");

        let queue = guard.pending().unwrap();
        assert_eq!(queue.len(), 1);
        assert_eq!(queue[0].action["action_id"], action_id.as_str());
        assert_eq!(queue[0].action["input"], serde_json::json!({"order": 42}));
        let late = guard.action("act-300").unwrap().unwrap();
        assert_eq!(late.input, serde_json::json!({"n": 299}));
        assert!(
            guard.action("act-1").is_err(),
            "an action whose request was damaged was shown"
        );
        assert!(guard.action("act-999").unwrap().is_none());
    }

    /// Queued requests damaged on disk (one no longer parses, one parses but holds
    /// another input) are listed apart by `pending_queue`, never shown, while the rest of
    /// the queue is; `pending` refuses, naming one.
    #[test]
    fn damaged_queued_requests_are_listed_apart() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.jsonl");
        let key = AuditKey::from_seed([6; 32]);
        let policy = Policy::new(10_000).allow("refund", ToolRule::cost(1).with_approval());
        let mut guard = Guard::create(&path, key, "agent", policy).unwrap();
        for order in 0..200 {
            guard
                .request("refund", serde_json::json!({"order": order}), None)
                .unwrap();
        }
        let queue = guard.pending_queue().unwrap();
        assert_eq!((queue.pending.len(), queue.unreadable.len()), (200, 0));
        let seq_of = |action: &str| {
            queue
                .pending
                .iter()
                .find(|entry| entry.action["action_id"] == action)
                .unwrap()
                .seq
        };
        let (broken, changed) = (seq_of("act-5"), seq_of("act-150"));
        let text = std::fs::read_to_string(&path).unwrap();
        let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
        lines[broken as usize] = lines[broken as usize].replacen('{', "x", 1);
        let line = &lines[changed as usize];
        assert!(line.contains(r#""order":149"#), "{line}");
        lines[changed as usize] = line.replacen(r#""order":149"#, r#""order":999"#, 1);
        std::fs::write(&path, lines.join("\n") + "\n").unwrap();

        let queue = guard.pending_queue().unwrap();
        let named: Vec<(&str, u64)> = queue
            .unreadable
            .iter()
            .map(|entry| (entry.action_id.as_str(), entry.seq))
            .collect();
        assert_eq!(named, [("act-5", broken), ("act-150", changed)]);
        assert_eq!(queue.pending.len(), 198);
        let shown = serde_json::to_string(&queue.pending).unwrap();
        assert!(
            !shown.contains(r#""order":999"#),
            "the changed input was shown"
        );
        assert!(!shown.contains(r#""order":4}"#) && !shown.contains(r#""order":149}"#));
        assert!(shown.contains(r#""order":3}"#) && shown.contains(r#""order":199}"#));
        let refused = guard.pending().unwrap_err().to_string();
        assert!(refused.contains("act-5"), "{refused}");
    }

    /// A read the disk fails fails the call: an I/O error is not a damaged record, and
    /// must not be reported as one. The log's path is made to lead to this process's
    /// `/proc/self/mem`, where a read at the record's offset (an unmapped address) fails
    /// with EIO.
    #[test]
    fn a_read_error_fails_the_queue_rather_than_naming_an_entry_damaged() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.jsonl");
        let key = AuditKey::from_seed([7; 32]);
        let policy = Policy::new(100)
            .allow("refund", ToolRule::cost(1).with_approval())
            .allow("search", ToolRule::cost(0));
        let mut guard = Guard::create(&path, key, "agent", policy).unwrap();
        // The queued request sits where the file keeps a mark (every 128 records), so
        // the read that fails is that of its own line, not of the lines before it.
        while guard.head().seq < 127 {
            guard
                .request("search", serde_json::json!({}), None)
                .unwrap();
        }
        assert_eq!(guard.head().seq, 127, "records per request changed");
        guard
            .request("refund", serde_json::json!({"order": 1}), None)
            .unwrap();
        assert_eq!(guard.state().pending()[0].seq, 128);
        std::fs::rename(&path, dir.path().join("moved.jsonl")).unwrap();
        std::os::unix::fs::symlink("/proc/self/mem", &path).unwrap();
        match guard.pending_queue() {
            Err(GuardFileError::Audit(AuditError::Io { .. })) => {}
            other => panic!("expected an I/O error, got {other:?}"),
        }
    }
}
