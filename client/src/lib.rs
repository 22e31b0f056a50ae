//! `lineage_client`: the Rust client for Lineage Cluster ([`Client`]) and the
//! implementation of the `lineage` CLI's commands.

pub mod audit_cli;
pub mod client;
pub mod import_cli;
pub mod operator_cli;
pub mod ops_cli;
pub mod terminal_text;
pub mod witnessed_cli;

pub use client::{Client, ClientError, PendingQueue, UnreadableRequest};
