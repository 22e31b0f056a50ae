//! An agent's policy: fixed at creation, written as the log's second record.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// What an agent may do, what it costs, and how many scars it can take.
/// Unknown fields are ignored when reading; every field is written.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Policy {
    /// Lifetime credits; never refills.
    pub budget: u64,
    /// The allowlist: tool name (case-sensitive) to rule.
    pub tools: BTreeMap<String, ToolRule>,
    /// Scar score at which the agent is terminated.
    pub scar_limit: u32,
    /// Rule for unlisted tools; `None` denies them.
    #[serde(default)]
    pub default_rule: Option<ToolRule>,
    /// At most `max_actions` allowed actions in any window of `window_secs`.
    #[serde(default)]
    pub rate_limit: Option<RateLimit>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolRule {
    /// Minimum charge; a request may declare more, never less.
    pub cost: u64,
    #[serde(default)]
    pub requires_approval: bool,
    /// Lifetime cap on allowed calls of this tool.
    #[serde(default)]
    pub max_calls: Option<u64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RateLimit {
    pub max_actions: u32,
    pub window_secs: u64,
}

impl Policy {
    /// A policy with `budget` credits, no tools, and a scar limit of 10.
    pub fn new(budget: u64) -> Self {
        Policy {
            budget,
            tools: BTreeMap::new(),
            scar_limit: 10,
            default_rule: None,
            rate_limit: None,
        }
    }

    pub fn allow(mut self, tool: impl Into<String>, rule: ToolRule) -> Self {
        self.tools.insert(tool.into(), rule);
        self
    }

    pub fn scar_limit(mut self, limit: u32) -> Self {
        self.scar_limit = limit;
        self
    }

    pub fn rate_limit(mut self, max_actions: u32, window_secs: u64) -> Self {
        self.rate_limit = Some(RateLimit {
            max_actions,
            window_secs,
        });
        self
    }

    pub fn default_rule(mut self, rule: ToolRule) -> Self {
        self.default_rule = Some(rule);
        self
    }

    /// The rule for `tool`: its own, else the default, else none (not allowed).
    pub fn rule_for(&self, tool: &str) -> Option<&ToolRule> {
        self.tools.get(tool).or(self.default_rule.as_ref())
    }

    /// The normalised JSON form written into the policy record.
    pub fn to_value(&self) -> serde_json::Value {
        serde_json::json!({
            "budget": self.budget,
            "default_rule": self.default_rule.as_ref().map(ToolRule::to_value),
            "rate_limit": self.rate_limit.map(|r| serde_json::json!({
                "max_actions": r.max_actions,
                "window_secs": r.window_secs,
            })),
            "scar_limit": self.scar_limit,
            "tools": self.tools.iter()
                .map(|(name, rule)| (name.clone(), rule.to_value()))
                .collect::<serde_json::Map<_, _>>(),
        })
    }
}

impl ToolRule {
    pub fn cost(cost: u64) -> Self {
        ToolRule {
            cost,
            requires_approval: false,
            max_calls: None,
        }
    }

    pub fn with_approval(mut self) -> Self {
        self.requires_approval = true;
        self
    }

    pub fn with_max_calls(mut self, max_calls: u64) -> Self {
        self.max_calls = Some(max_calls);
        self
    }

    fn to_value(&self) -> serde_json::Value {
        serde_json::json!({
            "cost": self.cost,
            "max_calls": self.max_calls,
            "requires_approval": self.requires_approval,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_is_written_normalised() {
        let policy: Policy = serde_json::from_str(
            r#"{"budget":10,"scar_limit":3,"tools":{"search":{"cost":1}},"extra":"ignored"}"#,
        )
        .unwrap();
        assert_eq!(
            crate::canonical::to_string(&policy.to_value()),
            r#"{"budget":10,"default_rule":null,"rate_limit":null,"scar_limit":3,"tools":{"search":{"cost":1,"max_calls":null,"requires_approval":false}}}"#
        );
    }

    #[test]
    fn type_errors_are_rejected() {
        for bad in [
            r#"{"budget":-1,"scar_limit":3,"tools":{}}"#,
            r#"{"budget":1,"scar_limit":3,"tools":{"a":{"cost":1.0}}}"#,
            r#"{"budget":1,"tools":{}}"#,
            r#"{"budget":1,"scar_limit":3,"tools":{},"rate_limit":{"max_actions":1}}"#,
        ] {
            assert!(serde_json::from_str::<Policy>(bad).is_err(), "{bad}");
        }
    }
}
