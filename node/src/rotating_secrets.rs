//! The secrets that rotate without a restart, re-read on every reload (SIGHUP):
//!
//! - the cluster secret: `cluster.secret` may hold several lines; the first is sent to
//!   peers, every line is accepted from them. A rotation is three phases, each done on
//!   every node before the next: add the new secret as a second line (accept both), move
//!   it first (send it), drop the old line. `GET /v1/cluster` shows each node's secret
//!   fingerprints, so a phase is confirmed by what the nodes say, not by a clock;
//! - the admin token: `admin.token` (one line: clients read it whole), and, while a new one
//!   rolls out, `admin.token.previous`: the old token, then a line `not_after=<RFC 3339>`
//!   after which it is refused.
//!
//! A reload that fails (a file unreadable, empty or malformed) changes nothing: the secrets
//! in use stay, and the error is logged.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arc_swap::ArcSwap;
use lineage_core::record::timestamp;
use lineage_core::token::secrets_equal;
use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::keys::{ADMIN_TOKEN, CLUSTER_SECRET, MIN_ADMIN_TOKEN_CHARS};

pub const ADMIN_TOKEN_PREVIOUS: &str = "admin.token.previous";
/// The most lines `cluster.secret` may hold (a rotation needs two).
const MAX_CLUSTER_SECRETS: usize = 4;

/// The secrets read at one (re)load.
struct SecretSet {
    /// Non-empty; the first is sent.
    cluster: Vec<String>,
    admin: String,
    previous_admin: Option<PreviousAdmin>,
}

struct PreviousAdmin {
    token: String,
    not_after_micros: i64,
    not_after: String,
}

/// What a node says about its secrets: fingerprints (the first 16 hex digits of a
/// SHA-256 over a label and the secret), never the secrets.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Fingerprints {
    /// The cluster secret this node sends.
    pub sends: String,
    /// Every cluster secret this node accepts.
    pub accepts: Vec<String>,
    /// Until when the previous admin token is accepted, if one is.
    #[serde(default)]
    pub admin_previous_until: Option<String>,
}

impl Fingerprints {
    /// The form carried in a Raft answer's header: `SENDS;ACCEPTS,ACCEPTS`.
    pub fn header_value(&self) -> String {
        format!("{};{}", self.sends, self.accepts.join(","))
    }

    pub fn from_header(value: &str) -> Option<Fingerprints> {
        let (sends, accepts) = value.split_once(';')?;
        let well_formed = |fp: &str| fp.len() == 16 && fp.bytes().all(|b| b.is_ascii_hexdigit());
        let accepts: Vec<String> = accepts.split(',').map(str::to_string).collect();
        (well_formed(sends) && accepts.iter().all(|fp| well_formed(fp))).then(|| Fingerprints {
            sends: sends.to_string(),
            accepts,
            admin_previous_until: None,
        })
    }
}

/// The fingerprint shown for a cluster secret.
pub fn fingerprint(secret: &str) -> String {
    let digest = Sha256::new()
        .chain_update(b"lineage cluster secret fingerprint\n")
        .chain_update(secret.as_bytes())
        .finalize();
    hex::encode(&digest[..8])
}

pub struct RotatingSecrets {
    dir: PathBuf,
    /// The admin token from the environment (drop-in mode), which overrides the file.
    admin_from_env: Option<String>,
    current: ArcSwap<SecretSet>,
}

impl RotatingSecrets {
    /// Reads the secrets in `dir`; `admin_from_env` overrides `admin.token`.
    pub fn load(dir: &Path, admin_from_env: Option<String>) -> Result<Self, String> {
        let set = read_set(dir, admin_from_env.as_deref())?;
        Ok(RotatingSecrets {
            dir: dir.to_path_buf(),
            admin_from_env,
            current: ArcSwap::from_pointee(set),
        })
    }

    /// Reads the files again; on any error the secrets in use stay.
    pub fn reload(&self) -> Result<(), String> {
        let set = read_set(&self.dir, self.admin_from_env.as_deref())?;
        self.current.store(Arc::new(set));
        Ok(())
    }

    /// The cluster secret to send to peers.
    pub fn cluster_secret_to_send(&self) -> String {
        self.current.load().cluster[0].clone()
    }

    /// Whether `presented` is one of the cluster secrets (each compared in constant time).
    pub fn accepts_cluster_secret(&self, presented: &[u8]) -> bool {
        let set = self.current.load();
        set.cluster.iter().fold(false, |ok, secret| {
            secrets_equal(presented, secret.as_bytes()) | ok
        })
    }

    /// Whether `presented` is the admin token, or the previous one before its not_after.
    pub fn is_admin_token(&self, presented: &[u8]) -> bool {
        let set = self.current.load();
        let current = secrets_equal(presented, set.admin.as_bytes());
        let previous = set.previous_admin.as_ref().is_some_and(|previous| {
            secrets_equal(presented, previous.token.as_bytes())
                && timestamp::now_micros() <= previous.not_after_micros
        });
        current | previous
    }

    pub fn fingerprints(&self) -> Fingerprints {
        let set = self.current.load();
        Fingerprints {
            sends: fingerprint(&set.cluster[0]),
            accepts: set.cluster.iter().map(|s| fingerprint(s)).collect(),
            admin_previous_until: set
                .previous_admin
                .as_ref()
                .map(|previous| previous.not_after.clone()),
        }
    }
}

fn read_set(dir: &Path, admin_from_env: Option<&str>) -> Result<SecretSet, String> {
    let read = |name: &str| -> Result<String, String> {
        std::fs::read_to_string(dir.join(name)).map_err(|e| {
            format!(
                "{}: {e} (create the keys with `lineage-node keygen {}`)",
                dir.join(name).display(),
                dir.display()
            )
        })
    };
    let cluster: Vec<String> = read(CLUSTER_SECRET)?
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty())
        .map(str::to_string)
        .collect();
    // Each is sent as an HTTP header value: visible ASCII only.
    if let Some(n) = cluster
        .iter()
        .position(|secret| !secret.bytes().all(|b| b.is_ascii_graphic()))
    {
        return Err(format!(
            "{}: line {} is not visible ASCII (it travels in an HTTP header)",
            dir.join(CLUSTER_SECRET).display(),
            n + 1
        ));
    }
    if cluster.is_empty() || cluster.len() > MAX_CLUSTER_SECRETS {
        return Err(format!(
            "{}: needs 1 to {MAX_CLUSTER_SECRETS} secrets, one per line (the first is sent), has {}",
            dir.join(CLUSTER_SECRET).display(),
            cluster.len()
        ));
    }
    let admin = match admin_from_env {
        Some(token) => token.trim().to_string(),
        None => read(ADMIN_TOKEN)?.trim().to_string(),
    };
    if admin.len() < MIN_ADMIN_TOKEN_CHARS || admin.contains(['\n', '\r']) {
        return Err(format!(
            "the admin token must be at least {MIN_ADMIN_TOKEN_CHARS} characters, on one line"
        ));
    }
    let previous_path = dir.join(ADMIN_TOKEN_PREVIOUS);
    let previous_admin = match std::fs::read_to_string(&previous_path) {
        Ok(text) => {
            Some(parse_previous(&text).map_err(|e| format!("{}: {e}", previous_path.display()))?)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(format!("{}: {e}", previous_path.display())),
    };
    Ok(SecretSet {
        cluster,
        admin,
        previous_admin,
    })
}

/// `TOKEN\nnot_after=RFC3339`.
fn parse_previous(text: &str) -> Result<PreviousAdmin, String> {
    let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty());
    let token = lines.next().ok_or("empty")?.to_string();
    let not_after = lines
        .next()
        .and_then(|line| line.strip_prefix("not_after="))
        .ok_or("the second line must be not_after=<RFC 3339 time>: until when the old token is accepted")?
        .to_string();
    let not_after_micros = timestamp::parse(&not_after)
        .ok_or_else(|| format!("not_after={not_after:?} is not an RFC 3339 time"))?;
    if lines.next().is_some() {
        return Err("holds more than a token and its not_after line".into());
    }
    if token.len() < MIN_ADMIN_TOKEN_CHARS {
        return Err(format!(
            "the token must be at least {MIN_ADMIN_TOKEN_CHARS} characters"
        ));
    }
    Ok(PreviousAdmin {
        token,
        not_after_micros,
        not_after,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir_with(files: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (name, text) in files {
            std::fs::write(dir.path().join(name), text).unwrap();
        }
        dir
    }

    const ADMIN: &str = "a-admin-token-of-at-least-32-characters";
    const OLD_ADMIN: &str = "o-old-admin-token-of-at-least-32-chars";

    #[test]
    fn every_cluster_secret_line_is_accepted_and_the_first_is_sent() {
        let dir = dir_with(&[(CLUSTER_SECRET, "new\nold\n"), (ADMIN_TOKEN, ADMIN)]);
        let secrets = RotatingSecrets::load(dir.path(), None).unwrap();
        assert_eq!(secrets.cluster_secret_to_send(), "new");
        assert!(secrets.accepts_cluster_secret(b"new") && secrets.accepts_cluster_secret(b"old"));
        assert!(!secrets.accepts_cluster_secret(b"ne") && !secrets.accepts_cluster_secret(b""));
        let fps = secrets.fingerprints();
        assert_eq!(fps.accepts.len(), 2);
        assert_eq!(fps.sends, fps.accepts[0]);
        assert_eq!(
            Fingerprints::from_header(&fps.header_value())
                .unwrap()
                .accepts,
            fps.accepts
        );
        // Dropping the old line, then a bad file: the reload keeps the last good set.
        std::fs::write(dir.path().join(CLUSTER_SECRET), "new\n").unwrap();
        secrets.reload().unwrap();
        assert!(!secrets.accepts_cluster_secret(b"old"));
        for bad in ["\n\n", "new\nnicht-ascii-ä\n", "with space\n"] {
            std::fs::write(dir.path().join(CLUSTER_SECRET), bad).unwrap();
            assert!(secrets.reload().is_err(), "{bad:?}");
        }
        assert!(secrets.accepts_cluster_secret(b"new"));
    }

    #[test]
    fn the_previous_admin_token_works_until_its_not_after() {
        let later = timestamp::format(timestamp::now_micros() + 60_000_000);
        let dir = dir_with(&[
            (CLUSTER_SECRET, "s"),
            (ADMIN_TOKEN, ADMIN),
            (
                ADMIN_TOKEN_PREVIOUS,
                &format!("{OLD_ADMIN}\nnot_after={later}\n"),
            ),
        ]);
        let secrets = RotatingSecrets::load(dir.path(), None).unwrap();
        assert!(secrets.is_admin_token(ADMIN.as_bytes()));
        assert!(secrets.is_admin_token(OLD_ADMIN.as_bytes()));
        assert_eq!(secrets.fingerprints().admin_previous_until, Some(later));
        let earlier = timestamp::format(timestamp::now_micros() - 1);
        std::fs::write(
            dir.path().join(ADMIN_TOKEN_PREVIOUS),
            format!("{OLD_ADMIN}\nnot_after={earlier}\n"),
        )
        .unwrap();
        secrets.reload().unwrap();
        assert!(!secrets.is_admin_token(OLD_ADMIN.as_bytes()));
        assert!(secrets.is_admin_token(ADMIN.as_bytes()));
        // Without a not_after, the file is refused (and the set in use stays).
        for bad in [
            OLD_ADMIN.to_string(),
            format!("{OLD_ADMIN}\nnot_after=soon"),
            format!("short\nnot_after={earlier}"),
        ] {
            std::fs::write(dir.path().join(ADMIN_TOKEN_PREVIOUS), bad).unwrap();
            assert!(secrets.reload().is_err());
        }
    }
}
