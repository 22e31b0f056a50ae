//! Node-to-node Raft traffic: outgoing RPCs (`raft_client`) and their routes
//! (`raft_routes`), and cluster management for operators (`management`).

pub mod management;
pub mod raft_client;
pub mod raft_routes;
