//! `lineage_core`: the `lineage-audit-v1` log format, keys, verification, policy, and
//! the guard as a pure state machine.
//!
//! Architecture invariant: nothing here does network I/O or reads a clock inside the
//! state machine. [`guard::decide`] and [`guard::AgentState::apply`] are deterministic
//! functions of their arguments, so every node, the CLI and the checkpointer share them
//! and agree. File I/O lives only in [`log_file`], [`keys`] and [`embedded`].

pub mod canonical;
pub mod embedded;
pub mod guard;
pub mod heads;
pub mod keys;
pub mod log_file;
pub mod note;
pub mod operators;
pub mod policy;
pub mod record;
pub mod token;
pub mod transparency;
pub mod verify;

pub use embedded::{Guard, GuardFileError};
pub use guard::{AgentState, Command, Decision, DenyReason, Outcome, Severity, Status};
pub use keys::AuditKey;
pub use log_file::{AuditError, AuditLog};
pub use policy::{GrowthLimits, Policy, RateLimit, ToolRule, ToolTable};
pub use record::{Head, Record};
pub use verify::{
    verify_file, verify_reader, verify_records, VerifyFailure, VerifyOptions, VerifyReport,
};
