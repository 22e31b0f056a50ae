//! The guard as a pure state machine: [`AgentState::apply`] folds a record in,
//! [`decide`] says which records a command appends. No I/O, no clock.

mod action_book;
mod decide;
mod state;
mod types;

pub use action_book::{ActionLookup, ActionView, SettledAction};
pub use decide::{decide, missing_termination, seal, Command, Decided, Draft, GuardError};
pub use state::{ActionState, AgentState, ReplayError, TerminationCause};
pub use types::{
    Action, ActionStatus, Decision, DenyReason, Outcome, OutcomeStatus, PendingAction, RecordKind,
    Scar, Severity, Status,
};
