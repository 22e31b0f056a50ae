//! Operators: named people and services that act on the cluster, each with one role,
//! as the fold of the signed system log; and each agent's current token generation
//! (a reissued token revokes the ones before it).
//!
//! The system log is a `lineage-audit-v1` log of its own (log id [`SYSTEM_LOG_ID`], which
//! no agent can have), so `lineage audit verify` checks it like any agent's log. It is
//! kept out of agent logs: a reference guard replaying an agent log quarantines record
//! kinds it does not know. Operators are found by the SHA-256 of their token; the token
//! itself never reaches the log.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::record::{check_chain, timestamp, Head, Record, ZERO_HASH};
use crate::AuditKey;

/// The system log's id: it has a dot, which agent ids never have.
pub const SYSTEM_LOG_ID: &str = "lineage.operators";
/// The name the shared admin token acts under. No operator may take it.
pub const BUILTIN_ADMIN: &str = "admin";
/// How an operator token starts (the rest is 64 hex digits, 256 random bits).
pub const TOKEN_PREFIX: &str = "lop_";

const GENESIS: &str = "genesis";
const ADDED: &str = "operator_added";
const REVOKED: &str = "operator_revoked";
const REISSUED: &str = "agent_token_reissued";

/// What an operator may do. `admin`: everything. `approver`: read, approve and reject
/// (without scars). `auditor`: read only. `publisher`: store witnessed checkpoints only.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Admin,
    Approver,
    Auditor,
    Publisher,
}

impl Role {
    pub const ALL: [Role; 4] = [Role::Admin, Role::Approver, Role::Auditor, Role::Publisher];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Admin => "admin",
            Role::Approver => "approver",
            Role::Auditor => "auditor",
            Role::Publisher => "publisher",
        }
    }

    pub fn parse(text: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|role| role.as_str() == text)
    }
}

/// One operator as the registry holds it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Operator {
    pub name: String,
    pub role: Role,
    /// Hex SHA-256 of the token.
    pub token_sha256: String,
    pub added_by: String,
    pub added_at: String,
    /// Who revoked it and when; a revoked name is never used again.
    pub revoked_by: Option<String>,
    pub revoked_at: Option<String>,
}

impl Operator {
    pub fn is_active(&self) -> bool {
        self.revoked_by.is_none()
    }
}

/// A change an admin asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    Add {
        name: String,
        role: Role,
        token_sha256: String,
    },
    Revoke {
        name: String,
    },
    /// A new token for an agent: the next generation, and every earlier one refused.
    ReissueAgentToken {
        agent_id: String,
    },
}

/// Why a change was refused (nothing is appended).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ChangeError {
    #[error("operator names are 1-64 characters of [a-z0-9_-]")]
    InvalidName,
    #[error("'{BUILTIN_ADMIN}' is the shared admin token's name and cannot be an operator")]
    Reserved,
    #[error("operator '{0}' exists or existed; names are never reused")]
    NameTaken(String),
    #[error("token_sha256 must be 64 lowercase hex digits")]
    InvalidTokenHash,
    #[error("that token hash belongs to another operator, now or before")]
    TokenInUse,
    #[error("no operator named '{0}'")]
    Unknown(String),
    #[error("operator '{0}' is already revoked")]
    AlreadyRevoked(String),
    #[error("'{0}' is the last named admin; add another admin first")]
    LastAdmin(String),
    #[error("agent_id must be 1-64 characters of [A-Za-z0-9_-]")]
    InvalidAgentId,
}

/// The system log's state: every operator ever added, each agent's current token
/// generation (`token::issue_generation`), and the log's head.
#[derive(Clone, Debug, Default)]
pub struct Operators {
    /// Agents whose token was reissued → the current generation (absent: 0).
    token_generations: BTreeMap<String, u64>,
    by_name: BTreeMap<String, Operator>,
    /// Token hash → name, active operators only.
    active_tokens: HashMap<String, String>,
    /// Every token hash ever registered: a revoked token can never come back.
    all_tokens: BTreeSet<String>,
    head: Option<Head>,
    last_timestamp_micros: i64,
}

/// A new operator token: `lop_` and 256 random bits in hex.
pub fn generate_token() -> Result<String, getrandom::Error> {
    let mut bytes = [0u8; 32];
    getrandom::getrandom(&mut bytes)?;
    Ok(format!("{TOKEN_PREFIX}{}", hex::encode(bytes)))
}

/// The hex SHA-256 of a token, as registered and looked up.
pub fn token_sha256(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

/// Whether `name` is an operator name: 1-64 characters of `[a-z0-9_-]`.
pub fn is_operator_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
}

fn valid_hash(hash: &str) -> bool {
    hash.len() == 64 && hash.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

impl Operators {
    /// The operator a token belongs to, if it is active.
    pub fn by_token(&self, token: &str) -> Option<&Operator> {
        let name = self.active_tokens.get(&token_sha256(token))?;
        self.by_name.get(name)
    }

    pub fn get(&self, name: &str) -> Option<&Operator> {
        self.by_name.get(name)
    }

    /// Every operator ever added, by name.
    pub fn all(&self) -> impl Iterator<Item = &Operator> {
        self.by_name.values()
    }

    pub fn head(&self) -> Option<&Head> {
        self.head.as_ref()
    }

    /// The agent's current token generation (0 until its token is first reissued).
    pub fn token_generation(&self, agent_id: &str) -> u64 {
        self.token_generations.get(agent_id).copied().unwrap_or(0)
    }

    pub fn next_seq(&self) -> u64 {
        self.head.as_ref().map_or(0, |h| h.seq + 1)
    }

    /// The records (kind, payload) that make `change`, asked for by `by`; `Ok(None)` when
    /// it is already so (the same operator with the same role and token: a retried add).
    pub fn decide(
        &self,
        change: &Change,
        by: &str,
        public_key_hex: &str,
    ) -> Result<Option<Vec<(&'static str, Value)>>, ChangeError> {
        let record = match change {
            Change::Add {
                name,
                role,
                token_sha256,
            } => {
                if name.eq_ignore_ascii_case(BUILTIN_ADMIN) {
                    return Err(ChangeError::Reserved);
                }
                if !is_operator_name(name) {
                    return Err(ChangeError::InvalidName);
                }
                if !valid_hash(token_sha256) {
                    return Err(ChangeError::InvalidTokenHash);
                }
                if let Some(existing) = self.by_name.get(name) {
                    let same = existing.is_active()
                        && existing.role == *role
                        && existing.token_sha256 == *token_sha256;
                    return if same {
                        Ok(None)
                    } else {
                        Err(ChangeError::NameTaken(name.clone()))
                    };
                }
                if self.all_tokens.contains(token_sha256) {
                    return Err(ChangeError::TokenInUse);
                }
                (
                    ADDED,
                    json!({"name": name, "role": role.as_str(), "token_sha256": token_sha256, "by": by}),
                )
            }
            Change::Revoke { name } => {
                if name == BUILTIN_ADMIN {
                    return Err(ChangeError::Reserved);
                }
                let operator = self
                    .by_name
                    .get(name)
                    .ok_or_else(|| ChangeError::Unknown(name.clone()))?;
                if !operator.is_active() {
                    return Err(ChangeError::AlreadyRevoked(name.clone()));
                }
                let other_admins = self
                    .by_name
                    .values()
                    .filter(|o| o.is_active() && o.role == Role::Admin && o.name != *name)
                    .count();
                if operator.role == Role::Admin && other_admins == 0 {
                    return Err(ChangeError::LastAdmin(name.clone()));
                }
                (REVOKED, json!({"name": name, "by": by}))
            }
            Change::ReissueAgentToken { agent_id } => {
                if !crate::guard::is_agent_id(agent_id) {
                    return Err(ChangeError::InvalidAgentId);
                }
                let generation = self.token_generation(agent_id) + 1;
                (
                    REISSUED,
                    json!({"agent_id": agent_id, "generation": generation, "by": by}),
                )
            }
        };
        let mut records = Vec::with_capacity(2);
        if self.head.is_none() {
            records.push((
                GENESIS,
                json!({"log_id": SYSTEM_LOG_ID, "public_key": public_key_hex}),
            ));
        }
        records.push(record);
        Ok(Some(records))
    }

    /// Signs `drafts` as the next records of the system log, stamped no earlier than the
    /// last record.
    pub fn seal(
        &self,
        drafts: Vec<(&'static str, Value)>,
        key: &AuditKey,
        now_micros: i64,
    ) -> Vec<Record> {
        let at = timestamp::format(now_micros.max(self.last_timestamp_micros));
        let mut prev = self
            .head
            .as_ref()
            .map_or_else(|| ZERO_HASH.to_string(), |h| h.hash.clone());
        let mut records = Vec::with_capacity(drafts.len());
        for (seq, (kind, payload)) in (self.next_seq()..).zip(drafts) {
            let record = Record::seal(key, seq, at.clone(), SYSTEM_LOG_ID, kind, payload, &prev);
            prev.clone_from(&record.hash);
            records.push(record);
        }
        records
    }

    /// Folds records in, all or none: each must extend the head and make sense as an
    /// operator change that `decide` would have allowed.
    pub fn apply(&mut self, records: &[Record]) -> Result<(), String> {
        let head_hash = self.head.as_ref().map_or(ZERO_HASH, |h| h.hash.as_str());
        check_chain(self.next_seq(), head_hash, SYSTEM_LOG_ID, records)?;
        let mut next = self.clone();
        for record in records {
            next.fold(record)
                .map_err(|e| format!("system log seq {}: {e}", record.seq))?;
        }
        *self = next;
        Ok(())
    }

    fn fold(&mut self, record: &Record) -> Result<(), String> {
        let text = |field: &str| {
            record
                .payload
                .get(field)
                .and_then(Value::as_str)
                .map(str::to_string)
                .ok_or_else(|| format!("{} has no '{field}'", record.kind))
        };
        match (record.seq, record.kind.as_str()) {
            (0, GENESIS) => {
                if text("log_id")? != SYSTEM_LOG_ID {
                    return Err("genesis names another log".into());
                }
            }
            (0, _) => return Err("the first record is not a genesis".into()),
            (_, ADDED) => {
                let role = text("role")?;
                let change = Change::Add {
                    name: text("name")?,
                    role: Role::parse(&role).ok_or_else(|| format!("unknown role '{role}'"))?,
                    token_sha256: text("token_sha256")?,
                };
                let Change::Add {
                    name,
                    role,
                    token_sha256,
                } = self.check(&change)?
                else {
                    return Err("not an add".into());
                };
                self.all_tokens.insert(token_sha256.clone());
                self.active_tokens
                    .insert(token_sha256.clone(), name.clone());
                self.by_name.insert(
                    name.clone(),
                    Operator {
                        name,
                        role,
                        token_sha256,
                        added_by: text("by")?,
                        added_at: record.timestamp.clone(),
                        revoked_by: None,
                        revoked_at: None,
                    },
                );
            }
            (_, REVOKED) => {
                let change = self.check(&Change::Revoke {
                    name: text("name")?,
                })?;
                let Change::Revoke { name } = change else {
                    return Err("not a revoke".into());
                };
                let by = text("by")?;
                if let Some(operator) = self.by_name.get_mut(&name) {
                    self.active_tokens.remove(&operator.token_sha256);
                    operator.revoked_by = Some(by);
                    operator.revoked_at = Some(record.timestamp.clone());
                }
            }
            (_, REISSUED) => {
                let agent_id = text("agent_id")?;
                let generation = record.payload.get("generation").and_then(Value::as_u64);
                self.check(&Change::ReissueAgentToken {
                    agent_id: agent_id.clone(),
                })?;
                let next = self.token_generation(&agent_id) + 1;
                if generation != Some(next) {
                    return Err(format!("{REISSUED} must name generation {next}"));
                }
                self.token_generations.insert(agent_id, next);
            }
            (_, kind) => return Err(format!("unknown record kind '{kind}'")),
        }
        if let Some(at) = timestamp::parse(&record.timestamp) {
            self.last_timestamp_micros = self.last_timestamp_micros.max(at);
        }
        self.head = Some(record.head());
        Ok(())
    }

    /// The same rules as `decide`, for a change read from the log (a retried add, which
    /// `decide` answers with nothing, is not a record and is refused here).
    fn check(&self, change: &Change) -> Result<Change, String> {
        match self.decide(change, "", "") {
            Ok(Some(_)) => Ok(change.clone()),
            Ok(None) => Err("the operator is already there".into()),
            Err(e) => Err(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> AuditKey {
        AuditKey::from_seed([3; 32])
    }

    fn add(name: &str, role: Role, token: &str) -> Change {
        Change::Add {
            name: name.into(),
            role,
            token_sha256: token_sha256(token),
        }
    }

    fn change(ops: &mut Operators, change: &Change, now: i64) -> Result<Vec<Record>, ChangeError> {
        let key = key();
        let drafts = ops
            .decide(change, "admin", key.public_key_hex())?
            .unwrap_or_default();
        let records = ops.seal(drafts, &key, now);
        if !records.is_empty() {
            ops.apply(&records).unwrap();
        }
        Ok(records)
    }

    #[test]
    fn operators_are_found_by_token_until_revoked_and_names_are_never_reused() {
        let mut ops = Operators::default();
        let first = change(&mut ops, &add("alice", Role::Admin, "t-alice"), 10).unwrap();
        assert_eq!(
            first.len(),
            2,
            "the first change opens the log with a genesis"
        );
        assert_eq!(first[0].kind, GENESIS);
        change(&mut ops, &add("bob", Role::Approver, "t-bob"), 20).unwrap();
        assert_eq!(ops.by_token("t-bob").map(|o| o.role), Some(Role::Approver));
        assert!(ops.by_token("t-nobody").is_none());
        // A retried add of the same operator appends nothing.
        assert!(change(&mut ops, &add("bob", Role::Approver, "t-bob"), 25)
            .unwrap()
            .is_empty());
        change(&mut ops, &Change::Revoke { name: "bob".into() }, 30).unwrap();
        assert!(ops.by_token("t-bob").is_none());
        assert_eq!(
            ops.get("bob").and_then(|o| o.revoked_by.clone()).as_deref(),
            Some("admin")
        );
        assert_eq!(
            change(&mut ops, &add("bob", Role::Approver, "t-bob2"), 40),
            Err(ChangeError::NameTaken("bob".into()))
        );
        assert_eq!(
            change(&mut ops, &add("carol", Role::Auditor, "t-bob"), 40),
            Err(ChangeError::TokenInUse),
            "a revoked token never comes back under another name"
        );
        assert_eq!(ops.next_seq(), 4);
    }

    #[test]
    fn the_reserved_name_bad_names_and_the_last_admin_are_refused() {
        let mut ops = Operators::default();
        for name in ["admin", "Admin"] {
            assert_eq!(
                change(&mut ops, &add(name, Role::Auditor, "t"), 1),
                Err(ChangeError::Reserved)
            );
        }
        for name in ["", "Bob", "a.b", &"x".repeat(65)] {
            assert_eq!(
                change(&mut ops, &add(name, Role::Auditor, "t"), 1),
                Err(ChangeError::InvalidName),
                "{name:?}"
            );
        }
        let bad_hash = Change::Add {
            name: "x".into(),
            role: Role::Auditor,
            token_sha256: "ABC".into(),
        };
        assert_eq!(
            change(&mut ops, &bad_hash, 1),
            Err(ChangeError::InvalidTokenHash)
        );
        change(&mut ops, &add("root1", Role::Admin, "r1"), 1).unwrap();
        let revoke = |name: &str| Change::Revoke { name: name.into() };
        assert_eq!(
            change(&mut ops, &revoke("root1"), 2),
            Err(ChangeError::LastAdmin("root1".into()))
        );
        change(&mut ops, &add("root2", Role::Admin, "r2"), 3).unwrap();
        change(&mut ops, &revoke("root1"), 4).unwrap();
        assert_eq!(
            change(&mut ops, &revoke("root1"), 5),
            Err(ChangeError::AlreadyRevoked("root1".into()))
        );
        assert_eq!(
            change(&mut ops, &revoke("admin"), 5),
            Err(ChangeError::Reserved)
        );
        assert_eq!(
            change(&mut ops, &revoke("ghost"), 5),
            Err(ChangeError::Unknown("ghost".into()))
        );
    }

    #[test]
    fn apply_refuses_records_that_do_not_extend_or_break_the_rules() {
        let key = key();
        let mut ops = Operators::default();
        let records = change(&mut ops, &add("alice", Role::Admin, "a"), 1).unwrap();
        // The same records again do not extend the head.
        assert!(ops
            .clone()
            .apply(&records)
            .unwrap_err()
            .contains("does not extend"));
        // A signed record that decide would refuse (a second add of the name) is refused
        // at apply too, and changes nothing.
        let forged = ops.seal(
            vec![(ADDED, json!({"name": "alice", "role": "auditor", "token_sha256": token_sha256("z"), "by": "x"}))],
            &key,
            2,
        );
        let before = ops.next_seq();
        assert!(ops.apply(&forged).unwrap_err().contains("never reused"));
        assert_eq!(ops.next_seq(), before);
        let unknown = ops.seal(vec![("party", json!({}))], &key, 2);
        assert!(ops
            .apply(&unknown)
            .unwrap_err()
            .contains("unknown record kind"));
        // Timestamps never go back.
        let later = change(&mut ops, &add("bob", Role::Auditor, "b"), 0).unwrap();
        assert!(later[0].timestamp >= records[1].timestamp);
    }

    #[test]
    fn agent_tokens_are_reissued_one_generation_at_a_time() {
        let key = key();
        let mut ops = Operators::default();
        let reissue = Change::ReissueAgentToken {
            agent_id: "bot".into(),
        };
        assert_eq!(ops.token_generation("bot"), 0);
        change(&mut ops, &reissue, 1).unwrap();
        change(&mut ops, &reissue, 2).unwrap();
        assert_eq!(ops.token_generation("bot"), 2);
        assert_eq!(ops.token_generation("other"), 0);
        assert_eq!(
            change(
                &mut ops,
                &Change::ReissueAgentToken {
                    agent_id: "a.b".into()
                },
                3
            ),
            Err(ChangeError::InvalidAgentId)
        );
        // A record that skips a generation is refused at apply.
        let skipped = ops.seal(
            vec![(
                REISSUED,
                json!({"agent_id": "bot", "generation": 5, "by": "x"}),
            )],
            &key,
            4,
        );
        assert!(ops.apply(&skipped).unwrap_err().contains("generation 3"));
        assert_eq!(ops.token_generation("bot"), 2);
    }

    #[test]
    fn the_edges_of_names_hashes_retries_and_listing() {
        let mut ops = Operators::default();
        // Digits, `_` and `-` are name characters; hashes are 64 lowercase hex digits.
        let records = change(&mut ops, &add("ops-1_a", Role::Admin, "t1"), 1).unwrap();
        assert_eq!(ops.head(), Some(&records[records.len() - 1].head()));
        for bad in ["AB".repeat(32), "ab".to_string()] {
            let change_bad = Change::Add {
                name: "x".into(),
                role: Role::Auditor,
                token_sha256: bad.clone(),
            };
            assert_eq!(
                change(&mut ops, &change_bad, 2),
                Err(ChangeError::InvalidTokenHash),
                "{bad}"
            );
        }
        // A retry is the same operator only if role and token match too.
        for retry in [
            add("ops-1_a", Role::Auditor, "t1"),
            add("ops-1_a", Role::Admin, "t2"),
        ] {
            assert_eq!(
                change(&mut ops, &retry, 3),
                Err(ChangeError::NameTaken("ops-1_a".into()))
            );
        }
        change(&mut ops, &add("second", Role::Approver, "t3"), 4).unwrap();
        let names: Vec<&str> = ops.all().map(|o| o.name.as_str()).collect();
        assert_eq!(names, ["ops-1_a", "second"]);
        // Agent ids take `_` and `-` too.
        let reissue = Change::ReissueAgentToken {
            agent_id: "my-bot_1".into(),
        };
        change(&mut ops, &reissue, 5).unwrap();
        assert_eq!(ops.token_generation("my-bot_1"), 1);
    }

    #[test]
    fn the_system_log_verifies_as_a_lineage_audit_v1_log() {
        let mut ops = Operators::default();
        let mut lines = Vec::new();
        for (i, name) in ["alice", "bob"].into_iter().enumerate() {
            for record in change(&mut ops, &add(name, Role::Admin, name), i as i64).unwrap() {
                lines.push(record);
            }
        }
        let report = crate::verify_records(&lines, &crate::VerifyOptions::default());
        assert!(report.ok, "{report:?}");
    }

    #[test]
    fn tokens_are_256_random_bits_and_only_their_hash_is_kept() {
        let token = generate_token().unwrap();
        assert!(token.starts_with(TOKEN_PREFIX));
        assert_eq!(token.len(), TOKEN_PREFIX.len() + 64);
        assert_ne!(token, generate_token().unwrap());
        let mut ops = Operators::default();
        let records = change(&mut ops, &add("svc", Role::Publisher, &token), 1).unwrap();
        assert!(records.iter().all(|r| !r.to_line().contains(&token)));
        assert_eq!(ops.by_token(&token).map(|o| o.name.as_str()), Some("svc"));
    }
}
