//! Stateless agent tokens: `agt_<agent_id>.<hex HMAC-SHA256(token key, domain || id)>`.
//! Any node holding the token key can issue and check them; nothing is stored.

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

/// The token for `agent_id`.
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
    fn secret_compare() {
        assert!(secrets_equal(b"abc", b"abc"));
        assert!(!secrets_equal(b"abc", b"abd"));
        assert!(!secrets_equal(b"abc", b"abcd"));
    }
}
