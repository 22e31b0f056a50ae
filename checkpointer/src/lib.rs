//! `lineage_checkpointer`: the checkpointer (heads-log monitor and witness client,
//! `lineage-checkpointer`) and an external tlog-witness (`lineage-witness`).

pub mod checkpointer;
pub mod checkpointer_metrics;
pub mod cluster_client;
pub mod witness;
pub mod witness_server;
