//! The guard as a pure state machine: [`AgentState::apply`] folds a record in,
//! [`decide`] says which records a command appends. No I/O, no clock.

mod action_book;
mod cow_column;
mod decide;
mod seq_column;
mod state;
mod types;

pub use action_book::{ActionLookup, KeptAction, PendingRequest};
pub use decide::{decide, missing_termination, seal, Command, Decided, Draft, GuardError};
pub use state::{ActionState, AgentState, ReplayError, TerminationCause};
pub use types::{
    Action, ActionStatus, Decision, DenyReason, Outcome, OutcomeStatus, PendingAction, RecordKind,
    Scar, Severity, Status,
};

/// Whether `id` is an agent id this project accepts: 1-64 characters of
/// `[A-Za-z0-9_-]` (so it is safe in a URL path and a file name, and never the system
/// log's dotted id).
pub fn is_agent_id(id: &str) -> bool {
    (1..=64).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}
