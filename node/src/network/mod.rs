//! Node-to-node Raft traffic: outgoing RPCs (`raft_client`), when each peer last answered
//! them (`peer_contacts`) and their routes (`raft_routes`), and cluster management for
//! operators (`management`).

pub mod management;
pub mod peer_contacts;
pub mod raft_client;
pub mod raft_routes;
