//! `lineage_checkpointer`: the external tlog-witness (`lineage-witness`). The
//! checkpointer itself (monitor and witness client) is still to come (issue #5).

pub mod witness;
pub mod witness_server;
