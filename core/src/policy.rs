//! An agent's policy: fixed at creation, written as the log's second record.

use std::collections::BTreeMap;
use std::num::{NonZeroU32, NonZeroU64};

use serde::{Deserialize, Serialize};

/// What an agent may do, what it costs, and how many scars it can take.
/// Unknown fields are ignored when reading; every field is written.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Policy {
    /// Lifetime credits; never refills.
    pub budget: u64,
    /// The allowlist: tool name (case-sensitive) to rule.
    pub tools: ToolTable,
    /// Scar score at which the agent is terminated.
    pub scar_limit: u32,
    /// Rule for unlisted tools; `None` denies them.
    #[serde(default)]
    pub default_rule: Option<ToolRule>,
    /// At most `max_actions` allowed actions in any window of `window_secs`.
    #[serde(default)]
    pub rate_limit: Option<RateLimit>,
    /// How fast the agent may grow its log, and how many approvals it may leave waiting;
    /// absent (or any field absent): the defaults.
    /// Written only when given, so every other policy record stays as it was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<GrowthLimits>,
}

/// Largest request input by default, in bytes of canonical JSON.
pub const DEFAULT_MAX_INPUT_BYTES: u64 = 64 * 1024;
/// Action requests per minute by default (denied ones included: they are logged too).
pub const DEFAULT_MAX_REQUESTS_PER_MINUTE: u32 = 6_000;
/// Actions waiting for an approval at once, by default.
pub const DEFAULT_MAX_PENDING_APPROVALS: u32 = 1_000;

/// Bounds on how fast one agent can grow every replica's log, and its memory. A lifetime
/// budget bounds allowed actions, but denied requests are free and each is recorded, so
/// without these one token (even a terminated agent's) could fill every disk; and an
/// action waiting for an approval keeps its input in every replica's memory until an
/// operator decides, so without a cap on them it could fill every replica's memory. A
/// request past them is refused (413, 429, 409) and leaves no record.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrowthLimits {
    /// Largest request input, in bytes of canonical JSON.
    #[serde(default)]
    pub max_input_bytes: Option<NonZeroU64>,
    /// Action requests per minute: a bucket of this many, refilled evenly over a minute.
    #[serde(default)]
    pub max_requests_per_minute: Option<NonZeroU32>,
    /// Actions waiting for an approval at once; a request for a tool that needs one is
    /// refused while this many wait. Written only when given, so policies that do not
    /// name it read and write as before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_pending_approvals: Option<NonZeroU32>,
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

/// Tool names and their rules, sorted by name: a policy's allowlist.
///
/// A `BTreeMap` would do, but its smallest node has room for 11 entries: about 640 bytes
/// for a one-tool policy, kept in every agent's state and in every lane's copy of it
/// (10,000 agents: 6.4 MB). Read and written as the same JSON object (a repeated name
/// keeps its last rule, as the map did), so policy records and checkpoints read the same.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ToolTable(Box<[(String, ToolRule)]>);

impl ToolTable {
    pub fn get(&self, tool: &str) -> Option<&ToolRule> {
        self.0
            .binary_search_by(|(name, _)| name.as_str().cmp(tool))
            .ok()
            .map(|at| &self.0[at].1)
    }

    /// Sets `tool`'s rule, replacing the one it had.
    pub fn insert(&mut self, tool: String, rule: ToolRule) {
        let mut map: BTreeMap<String, ToolRule> =
            std::mem::take(&mut self.0).into_vec().into_iter().collect();
        map.insert(tool, rule);
        *self = ToolTable::from(map);
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &ToolRule)> {
        self.0.iter().map(|(name, rule)| (name.as_str(), rule))
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl From<BTreeMap<String, ToolRule>> for ToolTable {
    fn from(map: BTreeMap<String, ToolRule>) -> Self {
        ToolTable(map.into_iter().collect())
    }
}

impl Serialize for ToolTable {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.iter())
    }
}

impl<'de> Deserialize<'de> for ToolTable {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        BTreeMap::<String, ToolRule>::deserialize(deserializer).map(ToolTable::from)
    }
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
            tools: ToolTable::default(),
            scar_limit: 10,
            default_rule: None,
            rate_limit: None,
            limits: None,
        }
    }

    /// Largest request input, in bytes of canonical JSON.
    pub fn max_input_bytes(&self) -> u64 {
        self.limits
            .and_then(|l| l.max_input_bytes)
            .map_or(DEFAULT_MAX_INPUT_BYTES, NonZeroU64::get)
    }

    /// Action requests per minute.
    pub fn max_requests_per_minute(&self) -> u32 {
        self.limits
            .and_then(|l| l.max_requests_per_minute)
            .map_or(DEFAULT_MAX_REQUESTS_PER_MINUTE, NonZeroU32::get)
    }

    /// Actions waiting for an approval at once.
    pub fn max_pending_approvals(&self) -> u32 {
        self.limits
            .and_then(|l| l.max_pending_approvals)
            .map_or(DEFAULT_MAX_PENDING_APPROVALS, NonZeroU32::get)
    }

    pub fn limits(mut self, limits: GrowthLimits) -> Self {
        self.limits = Some(limits);
        self
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
        let mut value = serde_json::json!({
            "budget": self.budget,
            "default_rule": self.default_rule.as_ref().map(ToolRule::to_value),
            "rate_limit": self.rate_limit.map(|r| serde_json::json!({
                "max_actions": r.max_actions,
                "window_secs": r.window_secs,
            })),
            "scar_limit": self.scar_limit,
            "tools": self.tools.iter()
                .map(|(name, rule)| (name.to_string(), rule.to_value()))
                .collect::<serde_json::Map<_, _>>(),
        });
        if let (Some(limits), Some(map)) = (self.limits, value.as_object_mut()) {
            let mut written = serde_json::json!({
                "max_input_bytes": limits.max_input_bytes,
                "max_requests_per_minute": limits.max_requests_per_minute,
            });
            // Only when given: policy records that do not name it stay byte for byte.
            if let (Some(max), Some(written)) =
                (limits.max_pending_approvals, written.as_object_mut())
            {
                written.insert("max_pending_approvals".into(), max.get().into());
            }
            map.insert("limits".into(), written);
        }
        value
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
    fn the_tool_table_reads_and_writes_as_the_map_it_replaces() {
        // Out of order, with a repeated name (the map kept its last rule) and names
        // that sort differently by bytes and by letters.
        let json = r#"{"search":{"cost":1},"Zeta":{"cost":2},"email":{"cost":3,"requires_approval":true},"search":{"cost":4,"max_calls":2}}"#;
        let table: ToolTable = serde_json::from_str(json).unwrap();
        let map: BTreeMap<String, ToolRule> = serde_json::from_str(json).unwrap();
        assert_eq!(
            serde_json::to_string(&table).unwrap(),
            serde_json::to_string(&map).unwrap()
        );
        assert_eq!(table.len(), 3);
        for (name, rule) in &map {
            assert_eq!(table.get(name), Some(rule), "{name}");
        }
        assert_eq!(table.get("SEARCH"), None);
        assert_eq!(table.get(""), None);
        let names: Vec<&str> = table.iter().map(|(name, _)| name).collect();
        assert_eq!(names, ["Zeta", "email", "search"]);

        let mut grown = table.clone();
        let rule = ToolRule {
            cost: 9,
            requires_approval: false,
            max_calls: None,
        };
        grown.insert("alpha".into(), rule.clone());
        grown.insert("email".into(), rule.clone());
        assert_eq!(grown.get("alpha"), Some(&rule));
        assert_eq!(grown.get("email"), Some(&rule));
        assert_eq!(grown.get("search"), table.get("search"));
        assert_eq!(grown.len(), 4);
        assert!(ToolTable::default().is_empty());
    }

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
    fn growth_limits_are_written_only_when_given() {
        let policy: Policy = serde_json::from_str(
            r#"{"budget":1,"scar_limit":1,"tools":{},"limits":{"max_input_bytes":100}}"#,
        )
        .unwrap();
        assert_eq!(
            crate::canonical::to_string(&policy.to_value()),
            r#"{"budget":1,"default_rule":null,"limits":{"max_input_bytes":100,"max_requests_per_minute":null},"rate_limit":null,"scar_limit":1,"tools":{}}"#
        );
        assert_eq!(policy.max_input_bytes(), 100);
        assert_eq!(
            policy.max_requests_per_minute(),
            DEFAULT_MAX_REQUESTS_PER_MINUTE
        );
        let plain = Policy::new(1);
        assert!(!crate::canonical::to_string(&plain.to_value()).contains("limits"));
        assert_eq!(plain.max_input_bytes(), DEFAULT_MAX_INPUT_BYTES);
        // The written form reads back as the same policy.
        let back: Policy = serde_json::from_value(policy.to_value()).unwrap();
        assert_eq!(back, policy);
        assert_eq!(
            policy.max_pending_approvals(),
            DEFAULT_MAX_PENDING_APPROVALS
        );
        // The cap on approvals waiting is written when given, and reads back.
        let capped: Policy = serde_json::from_str(
            r#"{"budget":1,"scar_limit":1,"tools":{},"limits":{"max_pending_approvals":5}}"#,
        )
        .unwrap();
        assert_eq!(
            crate::canonical::to_string(&capped.to_value()),
            r#"{"budget":1,"default_rule":null,"limits":{"max_input_bytes":null,"max_pending_approvals":5,"max_requests_per_minute":null},"rate_limit":null,"scar_limit":1,"tools":{}}"#
        );
        assert_eq!(capped.max_pending_approvals(), 5);
        let back: Policy = serde_json::from_value(capped.to_value()).unwrap();
        assert_eq!(back, capped);
    }

    #[test]
    fn type_errors_are_rejected() {
        for bad in [
            r#"{"budget":-1,"scar_limit":3,"tools":{}}"#,
            r#"{"budget":1,"scar_limit":3,"tools":{"a":{"cost":1.0}}}"#,
            r#"{"budget":1,"tools":{}}"#,
            r#"{"budget":1,"scar_limit":3,"tools":{},"rate_limit":{"max_actions":1}}"#,
            r#"{"budget":1,"scar_limit":3,"tools":{},"limits":{"max_input_bytes":0}}"#,
            r#"{"budget":1,"scar_limit":3,"tools":{},"limits":{"max_requests_per_minute":-1}}"#,
        ] {
            assert!(serde_json::from_str::<Policy>(bad).is_err(), "{bad}");
        }
    }
}
