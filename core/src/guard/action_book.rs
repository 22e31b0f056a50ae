//! Every action an agent ever requested, in memory that does not grow with inputs.
//!
//! A decision needs an action's tool and cost only while the action waits for one:
//! requested, or pending approval. Once decided, later commands need only its status and
//! outcome (an outcome is accepted only for an allowed action). Its input no decision
//! needs: the API and approvers read it back from the `action_requested` record in the
//! log, waiting or decided. So an open action keeps its tool, cost and status here (no
//! input, however large: a waiting action costs every replica the same few bytes); a
//! settled one keeps about 3 bytes: a status byte and the seq of its request
//! (`SeqColumn`, 2 bytes a seq). The ids this guard writes are `act-1`,
//! `act-2`, … in request order, which index those bytes; other ids (a log written
//! elsewhere) go in a map.

use std::collections::HashMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::cow_column::CowColumn;
use super::seq_column::SeqColumn;
use super::state::{ActionState, ReplayError};
use super::types::{Action, ActionStatus, OutcomeStatus, PendingAction};
use crate::record::Record;

/// What memory keeps of an action for the API: its status and outcome, and where its
/// request is (all of a decided action).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeptAction {
    pub status: ActionStatus,
    pub outcome: Option<OutcomeStatus>,
    /// The seq of its `action_requested` record.
    pub requested_seq: u64,
}

impl KeptAction {
    /// The action as the API shows it, from its request record (read back from the log).
    pub fn view(&self, action_id: &str, request: &Record) -> Result<Action, String> {
        let requested = Requested::of(action_id, self.requested_seq, None, request)?;
        Ok(Action {
            action_id: action_id.to_string(),
            tool: requested.tool.to_string(),
            input: requested.input.clone(),
            cost: requested.cost,
            status: self.status,
            outcome: self.outcome,
        })
    }
}

/// An entry of the approval queue as memory keeps it: its request's seq (log order) and
/// time, and the action's id. The rest is in the request record ([`Self::view`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PendingRequest {
    /// The seq of the action's `action_requested` record.
    pub seq: u64,
    pub requested_at: String,
    pub action_id: String,
    /// The hash its request record must have (`ActionState::request_hash`).
    pub request_hash: Option<[u8; 32]>,
}

impl PendingRequest {
    /// The entry as the API shows it, from its request record (read back from the log).
    pub fn view(&self, request: &Record) -> Result<PendingAction, String> {
        let requested = Requested::of(
            &self.action_id,
            self.seq,
            self.request_hash.as_ref(),
            request,
        )?;
        Ok(PendingAction {
            seq: self.seq,
            requested_at: self.requested_at.clone(),
            action: serde_json::json!({
                "action_id": self.action_id,
                "cost": requested.cost,
                "input": requested.input,
                "tool": requested.tool,
            }),
        })
    }
}

/// An action's request, read from its `action_requested` record.
struct Requested<'a> {
    tool: &'a str,
    input: &'a serde_json::Value,
    cost: u64,
}

impl<'a> Requested<'a> {
    /// The request in `record`, which must be `action_id`'s, at `seq`, its content
    /// matching its hash, and its hash `hash` where that is known: what an approver is
    /// shown is what was logged (a record changed on disk is an error, never shown).
    fn of(
        action_id: &str,
        seq: u64,
        hash: Option<&[u8; 32]>,
        record: &'a Record,
    ) -> Result<Self, String> {
        const NO_INPUT: &serde_json::Value = &serde_json::Value::Null;
        let payload = &record.payload;
        let named = payload.get("action_id").and_then(|v| v.as_str());
        if record.seq != seq || record.kind != "action_requested" || named != Some(action_id) {
            return Err(format!(
                "record {} is not the request of {action_id}",
                record.seq
            ));
        }
        let content = record.recompute_hash();
        if hex::encode(content) != record.hash || hash.is_some_and(|hash| *hash != content) {
            return Err(format!(
                "the request of {action_id} (record {}) does not match its hash",
                record.seq
            ));
        }
        Ok(Requested {
            tool: payload
                .get("tool")
                .and_then(|v| v.as_str())
                .unwrap_or_default(),
            input: payload.get("input").unwrap_or(NO_INPUT),
            cost: payload
                .get("cost")
                .and_then(serde_json::Value::as_u64)
                .unwrap_or(0),
        })
    }
}

/// What the book holds for one id.
#[derive(Clone, Debug, PartialEq)]
pub enum ActionLookup<'a> {
    /// Waiting for a decision: the whole request.
    Open(&'a ActionState),
    /// Decided: its request is in the log at `requested_seq`.
    Settled(KeptAction),
}

impl ActionLookup<'_> {
    pub fn status(&self) -> ActionStatus {
        match self {
            ActionLookup::Open(open) => open.status,
            ActionLookup::Settled(settled) => settled.status,
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ActionBook {
    /// `act-N`'s status and outcome at N-1 (`encode`).
    numbered_status: CowColumn<u8>,
    /// `act-N`'s request seq at N-1.
    numbered_seq: SeqColumn,
    /// Settled actions whose ids are not `act-N` in request order.
    named: HashMap<String, KeptAction>,
    /// Actions waiting for a decision, with their request. Shared (`Arc`) so that a clone
    /// of the state (one per decision, in a lane) copies no inputs; a change copies that
    /// one action.
    open: HashMap<String, Arc<ActionState>>,
}

/// The index of `act-N` among the numbered actions, if `id` is one.
fn numbered_index(id: &str) -> Option<usize> {
    let n: usize = id.strip_prefix("act-")?.parse().ok()?;
    // `act-01` parses as 1 but is another id.
    (n >= 1 && id.len() == 4 + n.to_string().len()).then(|| n - 1)
}

fn encode(status: ActionStatus, outcome: Option<OutcomeStatus>) -> u8 {
    let status = match status {
        ActionStatus::Requested => 0,
        ActionStatus::PendingApproval => 1,
        ActionStatus::Allowed => 2,
        ActionStatus::Denied => 3,
        ActionStatus::Completed => 4,
    };
    let outcome = match outcome {
        None => 0,
        Some(OutcomeStatus::Success) => 1,
        Some(OutcomeStatus::Failure) => 2,
        Some(OutcomeStatus::Harmful) => 3,
    };
    status | (outcome << 4)
}

fn decode(byte: u8) -> Option<(ActionStatus, Option<OutcomeStatus>)> {
    let status = match byte & 0x0f {
        0 => ActionStatus::Requested,
        1 => ActionStatus::PendingApproval,
        2 => ActionStatus::Allowed,
        3 => ActionStatus::Denied,
        4 => ActionStatus::Completed,
        _ => return None,
    };
    let outcome = match byte >> 4 {
        0 => None,
        1 => Some(OutcomeStatus::Success),
        2 => Some(OutcomeStatus::Failure),
        3 => Some(OutcomeStatus::Harmful),
        _ => return None,
    };
    Some((status, outcome))
}

impl ActionBook {
    /// A new request. An id already used is refused: no decision could say which one
    /// it meant.
    pub fn request(&mut self, action_id: String, action: ActionState) -> Result<(), ReplayError> {
        if self.lookup(&action_id).is_some() {
            return Err(ReplayError(format!(
                "seq {}: action id {action_id} requested twice",
                action.requested_seq
            )));
        }
        if numbered_index(&action_id) == Some(self.numbered_status.len()) {
            self.numbered_status
                .push(encode(ActionStatus::Requested, None));
            self.numbered_seq.push(action.requested_seq);
        }
        self.open.insert(action_id, Arc::new(action));
        Ok(())
    }

    pub fn lookup(&self, action_id: &str) -> Option<ActionLookup<'_>> {
        if let Some(open) = self.open.get(action_id) {
            return Some(ActionLookup::Open(open));
        }
        if let Some(settled) = self.named.get(action_id) {
            return Some(ActionLookup::Settled(*settled));
        }
        let index = numbered_index(action_id)?;
        let (status, outcome) = decode(self.numbered_status.get(index)?)?;
        Some(ActionLookup::Settled(KeptAction {
            status,
            outcome,
            requested_seq: self.numbered_seq.get(index)?,
        }))
    }

    /// An open action, to change its status while it stays open (pending approval).
    pub fn open_mut(&mut self, action_id: &str) -> Option<&mut ActionState> {
        self.open.get_mut(action_id).map(Arc::make_mut)
    }

    pub fn open(&self, action_id: &str) -> Option<&ActionState> {
        self.open.get(action_id).map(|action| &**action)
    }

    /// Decides an open action: its request leaves memory. Returns it.
    pub fn settle(
        &mut self,
        action_id: &str,
        status: ActionStatus,
    ) -> Result<ActionState, ReplayError> {
        let Some(action) = self.open.remove(action_id) else {
            return Err(self.not_open(action_id));
        };
        let settled = KeptAction {
            status,
            outcome: None,
            requested_seq: action.requested_seq,
        };
        self.store(action_id, settled);
        Ok(Arc::unwrap_or_clone(action))
    }

    /// Records an outcome for a decided action.
    pub fn complete(&mut self, action_id: &str, outcome: OutcomeStatus) -> Result<(), ReplayError> {
        match self.lookup(action_id) {
            Some(ActionLookup::Settled(mut settled)) => {
                settled.status = ActionStatus::Completed;
                settled.outcome = Some(outcome);
                self.store(action_id, settled);
                Ok(())
            }
            _ => Err(self.not_open(action_id)),
        }
    }

    fn store(&mut self, action_id: &str, settled: KeptAction) {
        match numbered_index(action_id) {
            Some(index)
                if index < self.numbered_status.len() && !self.named.contains_key(action_id) =>
            {
                self.numbered_status
                    .set(index, encode(settled.status, settled.outcome));
            }
            _ => {
                self.named.insert(action_id.to_string(), settled);
            }
        }
    }

    fn not_open(&self, action_id: &str) -> ReplayError {
        match self.lookup(action_id) {
            None => ReplayError(format!("unknown action: {action_id}")),
            Some(found) => ReplayError(format!(
                "action {action_id} is {:?}, not waiting for this record",
                found.status()
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn requested(seq: u64) -> ActionState {
        ActionState {
            tool: "t".into(),
            cost: 1,
            request_hash: None,
            status: ActionStatus::Requested,
            outcome: None,
            requested_seq: seq,
            requested_at: String::new(),
        }
    }

    /// A clone (a lane's pending state) shares what the book holds: open actions' inputs
    /// and the settled columns. A change in either copy is that copy's alone.
    #[test]
    fn a_clone_shares_open_actions_and_changes_stay_its_own() {
        let mut book = ActionBook::default();
        for n in 1..=5000u64 {
            book.request(format!("act-{n}"), requested(n * 2)).unwrap();
            if n % 10 != 0 {
                book.settle(&format!("act-{n}"), ActionStatus::Allowed)
                    .unwrap();
            }
        }
        let mut clone = book.clone();
        assert!(Arc::ptr_eq(&book.open["act-10"], &clone.open["act-10"]));
        clone.open_mut("act-10").unwrap().status = ActionStatus::PendingApproval;
        clone.settle("act-20", ActionStatus::Denied).unwrap();
        clone.complete("act-1", OutcomeStatus::Success).unwrap();
        assert_eq!(book.open("act-10").unwrap().status, ActionStatus::Requested);
        assert_eq!(
            book.lookup("act-20").unwrap().status(),
            ActionStatus::Requested
        );
        assert_eq!(
            book.lookup("act-1").unwrap().status(),
            ActionStatus::Allowed
        );
        assert_eq!(
            clone.lookup("act-10").unwrap().status(),
            ActionStatus::PendingApproval
        );
        assert_eq!(
            clone.lookup("act-20").unwrap().status(),
            ActionStatus::Denied
        );
        assert_eq!(
            clone.lookup("act-1").unwrap().status(),
            ActionStatus::Completed
        );
        assert!(Arc::ptr_eq(&book.open["act-30"], &clone.open["act-30"]));
        // A checkpoint reads back as the book it was taken of.
        let json = serde_json::to_string(&book).unwrap();
        let back: ActionBook = serde_json::from_str(&json).unwrap();
        assert_eq!(back, book);
    }

    #[test]
    fn numbered_ids_need_their_exact_spelling() {
        assert_eq!(numbered_index("act-1"), Some(0));
        assert_eq!(numbered_index("act-12"), Some(11));
        for other in [
            "act-0", "act-01", "act-", "act-x", "act-+1", "ACT-1", "act-1 ",
        ] {
            assert_eq!(numbered_index(other), None, "{other}");
        }
    }

    #[test]
    fn every_status_and_outcome_survives_its_byte() {
        let statuses = [
            ActionStatus::Requested,
            ActionStatus::PendingApproval,
            ActionStatus::Allowed,
            ActionStatus::Denied,
            ActionStatus::Completed,
        ];
        let outcomes = [
            None,
            Some(OutcomeStatus::Success),
            Some(OutcomeStatus::Failure),
            Some(OutcomeStatus::Harmful),
        ];
        for status in statuses {
            for outcome in outcomes {
                assert_eq!(decode(encode(status, outcome)), Some((status, outcome)));
            }
        }
        assert_eq!(decode(0x05), None);
        assert_eq!(decode(0x42), None);
    }

    #[test]
    fn a_settled_action_keeps_its_status_not_its_input() {
        // What a request brings besides its seq (tool, time, record hash), marked so
        // that a copy of it left in the checkpoint can be seen.
        let marked = |seq| ActionState {
            tool: "tool-xxxx".into(),
            requested_at: "at-xxxx".into(),
            request_hash: Some([0xee; 32]),
            ..requested(seq)
        };
        let mut book = ActionBook::default();
        book.request("act-1".into(), marked(2)).unwrap();
        book.request("custom".into(), marked(5)).unwrap();
        book.request("act-7".into(), marked(8)).unwrap(); // out of order: named
        assert!(matches!(book.lookup("act-1"), Some(ActionLookup::Open(_))));
        let json = serde_json::to_string(&book).unwrap();
        assert!(json.contains("xxxx") && json.contains("238,238"), "{json}");
        book.settle("act-1", ActionStatus::Allowed).unwrap();
        book.settle("custom", ActionStatus::Denied).unwrap();
        book.settle("act-7", ActionStatus::Allowed).unwrap();
        book.complete("act-1", OutcomeStatus::Harmful).unwrap();
        // The checkpoint of settled actions holds none of their requests.
        let json = serde_json::to_string(&book).unwrap();
        assert!(
            !json.contains("xxxx") && !json.contains("238,238"),
            "a settled action's request stays out: {json}"
        );
        assert!(book.open.is_empty());
        assert_eq!(
            book.lookup("act-1"),
            Some(ActionLookup::Settled(KeptAction {
                status: ActionStatus::Completed,
                outcome: Some(OutcomeStatus::Harmful),
                requested_seq: 2
            }))
        );
        assert_eq!(
            book.lookup("custom").map(|l| l.status()),
            Some(ActionStatus::Denied)
        );
        assert_eq!(
            book.lookup("act-7").map(|l| l.status()),
            Some(ActionStatus::Allowed)
        );
        assert_eq!(book.lookup("act-2"), None);
        assert!(book.settle("act-1", ActionStatus::Denied).is_err());
        assert!(book.request("act-1".into(), requested(9)).is_err());
        assert!(book.request("act-7".into(), requested(9)).is_err());
        assert!(book.complete("nope", OutcomeStatus::Success).is_err());
        let mut named: Vec<&String> = book.named.keys().collect();
        named.sort();
        assert_eq!(named, ["act-7", "custom"]);
        assert_eq!(book.numbered_status.len(), 1);
    }

    /// Through the guard, as a node runs it: an input is in its `action_requested` record
    /// only, never in the state a checkpoint saves, while its action waits or once decided.
    #[test]
    fn an_input_stays_in_the_log_not_in_the_checkpoint() {
        use crate::guard::{decide, seal, AgentState, Command};
        use crate::{AuditKey, Policy, ToolRule};
        let key = AuditKey::from_seed([5; 32]);
        let mut state = AgentState::new();
        let mut log = String::new();
        let mut run = |state: &mut AgentState, command: Command| {
            let decided = decide(state, &command, 1_800_000_000_000_000, key.public_key_hex());
            for record in seal(state, decided.unwrap().drafts, &key, 1_800_000_000_000_000) {
                state.apply(&record).unwrap();
                log.push_str(&record.to_line());
            }
        };
        let policy = Policy::new(10).allow("pay", ToolRule::cost(1).with_approval());
        let agent_id = "a".into();
        run(&mut state, Command::Create { agent_id, policy });
        run(
            &mut state,
            Command::Request {
                tool: "pay".into(),
                input: serde_json::json!({"iban": "input-xxxx"}),
                cost: None,
            },
        );
        let waiting = serde_json::to_string(&state).unwrap();
        assert!(
            !waiting.contains("input-xxxx"),
            "a waiting input kept: {waiting}"
        );
        run(
            &mut state,
            Command::Approve {
                action_id: "act-1".into(),
                approver: "alice".into(),
                claimed_by: None,
                note: None,
            },
        );
        assert_eq!(
            state.action("act-1").map(|a| a.status()),
            Some(ActionStatus::Allowed)
        );
        let settled = serde_json::to_string(&state).unwrap();
        assert!(
            !settled.contains("input-xxxx"),
            "a settled input kept: {settled}"
        );
        assert!(
            log.contains("input-xxxx"),
            "the input was never requested: {log}"
        );
    }

    /// `act-2` requested before `act-1` is named; once `act-1` makes the numbered list
    /// one long, `act-2` is the index just past its end and must stay named.
    #[test]
    fn an_id_requested_out_of_order_stays_named_at_the_numbered_end() {
        let mut book = ActionBook::default();
        book.request("act-2".into(), requested(2)).unwrap();
        book.request("act-1".into(), requested(3)).unwrap();
        book.settle("act-2", ActionStatus::Denied).unwrap();
        book.settle("act-1", ActionStatus::Allowed).unwrap();
        book.complete("act-2", OutcomeStatus::Failure).unwrap();
        book.complete("act-1", OutcomeStatus::Success).unwrap();
        assert_eq!(book.numbered_status.len(), 1);
        assert_eq!(book.named.keys().collect::<Vec<_>>(), ["act-2"]);
        assert_eq!(
            book.lookup("act-2"),
            Some(ActionLookup::Settled(KeptAction {
                status: ActionStatus::Completed,
                outcome: Some(OutcomeStatus::Failure),
                requested_seq: 2
            }))
        );
        assert_eq!(
            book.lookup("act-1"),
            Some(ActionLookup::Settled(KeptAction {
                status: ActionStatus::Completed,
                outcome: Some(OutcomeStatus::Success),
                requested_seq: 3
            }))
        );
    }

    #[test]
    fn an_outcome_needs_a_decided_action() {
        let mut book = ActionBook::default();
        book.request("act-1".into(), requested(2)).unwrap();
        assert_eq!(
            book.complete("act-1", OutcomeStatus::Success),
            Err(ReplayError(
                "action act-1 is Requested, not waiting for this record".into()
            ))
        );
        assert_eq!(
            book.settle("act-5", ActionStatus::Allowed),
            Err(ReplayError("unknown action: act-5".into()))
        );
        assert_eq!(
            book.lookup("act-1").map(|l| l.status()),
            Some(ActionStatus::Requested)
        );
    }
}
