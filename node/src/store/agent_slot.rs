//! What a node holds for each agent: its state, or why its copy is quarantined. A leaf:
//! every layer may name it.

use lineage_core::guard::AgentState;

/// What the node knows about each agent.
#[derive(Clone, Debug)]
pub enum AgentSlot {
    Active(Box<AgentState>),
    /// This node's copy failed to load; it serves nothing for the agent.
    Quarantined(String),
}
