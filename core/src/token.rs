//! Stateless agent tokens: `agt_<agent_id>.<hex HMAC-SHA256(token key, domain || id)>`.
//! Any node holding the token key can issue and check them; nothing is stored.
//!
//! A token can be revoked by reissuing it: generation 0 is the token above (the
//! reference's), generation `g` ≥ 1 is `agt_<agent_id>.<g>.<hex HMAC(key, domain' || id
//! || "\n" || g)>`, under its own domain. Which generation is current is the cluster's
//! replicated state (`operators::Operators::token_generation`); a token of another
//! generation verifies here but is refused there.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;

const DOMAIN: &[u8] = b"lineage-guard-agent-token:";

fn mac(key: &[u8; 32], agent_id: &str) -> Hmac<Sha256> {
    // HMAC accepts keys of any length, so this cannot fail.
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(key)
        .unwrap_or_else(|_| unreachable!("HMAC takes any key length"));
    mac.update(DOMAIN);
    mac.update(agent_id.as_bytes());
    mac
}

const GENERATION_DOMAIN: &[u8] = b"lineage-agent-token-generation:";

fn generation_mac(key: &[u8; 32], agent_id: &str, generation: u64) -> Hmac<Sha256> {
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(key)
        .unwrap_or_else(|_| unreachable!("HMAC takes any key length"));
    mac.update(GENERATION_DOMAIN);
    mac.update(agent_id.as_bytes());
    mac.update(b"\n");
    mac.update(generation.to_string().as_bytes());
    mac
}

/// The token of `agent_id` at `generation` (0: the original token, [`issue`]).
pub fn issue_generation(key: &[u8; 32], agent_id: &str, generation: u64) -> String {
    if generation == 0 {
        return issue(key, agent_id);
    }
    let tag = generation_mac(key, agent_id, generation)
        .finalize()
        .into_bytes();
    format!("agt_{agent_id}.{generation}.{}", hex::encode(tag))
}

/// The agent and generation a token speaks for, if its MAC is valid. A token of
/// generation 0 for an id that ends in `.<digits>` reads like a later generation of a
/// shorter id; the MAC, under its own domain, tells them apart.
pub fn verify_generation(key: &[u8; 32], token: &str) -> Option<(String, u64)> {
    if let Some(agent_id) = verify(key, token) {
        return Some((agent_id, 0));
    }
    let rest = token.strip_prefix("agt_")?;
    let (head, tag_hex) = rest.rsplit_once('.')?;
    let (agent_id, generation) = head.rsplit_once('.')?;
    if generation.starts_with('0') || !generation.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let generation: u64 = generation.parse().ok()?;
    let tag = hex::decode(tag_hex).ok()?;
    generation_mac(key, agent_id, generation)
        .verify_slice(&tag)
        .ok()?;
    Some((agent_id.to_string(), generation))
}

/// The token for `agent_id` (generation 0).
pub fn issue(key: &[u8; 32], agent_id: &str) -> String {
    let tag = mac(key, agent_id).finalize().into_bytes();
    format!("agt_{agent_id}.{}", hex::encode(tag))
}

/// The agent a token speaks for, if its MAC is valid (hex is case-insensitive).
pub fn verify(key: &[u8; 32], token: &str) -> Option<String> {
    let rest = token.strip_prefix("agt_")?;
    let (agent_id, tag_hex) = rest.rsplit_once('.')?;
    let tag = hex::decode(tag_hex).ok()?;
    mac(key, agent_id).verify_slice(&tag).ok()?;
    Some(agent_id.to_string())
}

/// Constant-time equality for secrets such as the admin token (lengths must match).
pub fn secrets_equal(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && bool::from(a.ct_eq(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_verify_and_bind_to_their_agent() {
        let key = [9u8; 32];
        let token = issue(&key, "bot.v2");
        assert_eq!(verify(&key, &token).as_deref(), Some("bot.v2"));
        assert_eq!(
            verify(
                &key,
                &token.to_uppercase().replacen("AGT_BOT.V2", "agt_bot.v2", 1)
            )
            .as_deref(),
            Some("bot.v2")
        );
        assert_eq!(verify(&[8u8; 32], &token), None);
        let forged = token.replacen("bot.v2", "other", 1);
        assert_eq!(verify(&key, &forged), None);
        assert_eq!(verify(&key, "agt_x.zz"), None);
        assert_eq!(verify(&key, "bearer"), None);
    }

    #[test]
    fn later_generations_verify_as_themselves_only() {
        let key = [9u8; 32];
        let first = issue_generation(&key, "bot", 0);
        assert_eq!(first, issue(&key, "bot"));
        assert_eq!(verify_generation(&key, &first), Some(("bot".into(), 0)));
        let third = issue_generation(&key, "bot", 3);
        assert!(third.starts_with("agt_bot.3."), "{third}");
        assert_eq!(verify_generation(&key, &third), Some(("bot".into(), 3)));
        // Not a generation-0 token of an agent called "bot.3".
        assert_eq!(verify(&key, &third), None);
        let tag = third.rsplit('.').next().unwrap();
        assert_eq!(verify_generation(&key, &format!("agt_bot.4.{tag}")), None);
        assert_eq!(verify_generation(&key, &format!("agt_bot.03.{tag}")), None);
        assert_eq!(verify_generation(&key, &format!("agt_other.3.{tag}")), None);
        // A generation-0 token of an id ending in digits is still that.
        let dotted = issue(&key, "bot.3");
        assert_eq!(verify_generation(&key, &dotted), Some(("bot.3".into(), 0)));
        assert_eq!(verify_generation(&[8u8; 32], &third), None);
    }

    #[test]
    fn secret_compare() {
        assert!(secrets_equal(b"abc", b"abc"));
        assert!(!secrets_equal(b"abc", b"abd"));
        assert!(!secrets_equal(b"abc", b"abcd"));
    }
}
