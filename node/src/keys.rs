//! The cluster's shared secrets, as files in one directory (mode 0600):
//! `audit.key` (Ed25519 seed), `token.key` (agent-token HMAC key), `admin.token`,
//! `cluster.secret` (node-to-node Raft traffic). Same names and format as the reference.

use std::path::Path;

use lineage_core::keys::{create_secret_file, read_secret_file, KeyError};
use lineage_core::AuditKey;

pub const AUDIT_KEY: &str = "audit.key";
pub const TOKEN_KEY: &str = "token.key";
pub const ADMIN_TOKEN: &str = "admin.token";
pub const CLUSTER_SECRET: &str = "cluster.secret";
/// Secrets every node of a cluster shares.
pub struct ClusterKeys {
    pub audit: AuditKey,
    pub token_key: [u8; 32],
    /// The cluster secret and the admin token: they rotate without a restart.
    pub secrets: std::sync::Arc<crate::rotating_secrets::RotatingSecrets>,
}

/// The admin token must be at least this long.
pub const MIN_ADMIN_TOKEN_CHARS: usize = 32;

/// Creates every key file that does not exist yet (never overwrites). With
/// `admin_from_env`, no admin.token file is made. Returns the names it created.
pub fn create_missing(dir: &Path, admin_from_env: bool) -> Result<Vec<&'static str>, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let mut created = Vec::new();
    for name in [ADMIN_TOKEN, AUDIT_KEY, TOKEN_KEY, CLUSTER_SECRET] {
        if name == ADMIN_TOKEN && admin_from_env {
            continue;
        }
        match create_secret_file(&dir.join(name)) {
            Ok(_) => created.push(name),
            Err(KeyError::Exists { .. }) => {}
            Err(e) => return Err(e.to_string()),
        }
    }
    Ok(created)
}

/// `lineage-node keygen DIR`: creates all four files, refusing if any exists.
pub fn keygen(dir: &Path) -> Result<(), String> {
    for name in [ADMIN_TOKEN, AUDIT_KEY, TOKEN_KEY, CLUSTER_SECRET] {
        if dir.join(name).exists() {
            return Err(format!(
                "{}: refusing to overwrite an existing key file",
                dir.join(name).display()
            ));
        }
    }
    create_missing(dir, false).map(drop)
}

/// `lineage-node keygen --from-reference REF DIR`: the cluster's keys for moving a
/// reference guard's data directory over. `audit.key` and `token.key` are copied from
/// `REF/keys` (checked to be keys first), so the imported logs continue under the same
/// signing key and every agent token keeps working; `admin.token` and `cluster.secret`
/// are new. Refuses if any file exists in DIR; the reference directory is only read.
pub fn keygen_from_reference(dir: &Path, reference: &Path) -> Result<(), String> {
    for name in [ADMIN_TOKEN, AUDIT_KEY, TOKEN_KEY, CLUSTER_SECRET] {
        if dir.join(name).exists() {
            return Err(format!(
                "{}: refusing to overwrite an existing key file",
                dir.join(name).display()
            ));
        }
    }
    let source = reference.join("keys");
    let audit = AuditKey::load(source.join(AUDIT_KEY))
        .map_err(|e| format!("{}: {e}", source.join(AUDIT_KEY).display()))?;
    let token_key = read_secret_file(&source.join(TOKEN_KEY))
        .map_err(|e| format!("{}: {e}", source.join(TOKEN_KEY).display()))?;
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    for (name, bytes) in [(AUDIT_KEY, audit.seed()), (TOKEN_KEY, token_key)] {
        lineage_core::keys::write_secret_file(&dir.join(name), &hex::encode(bytes))
            .map_err(|e| e.to_string())?;
    }
    create_missing(dir, false).map(drop)
}

/// Loads the keys; `admin_token` (from the environment) overrides admin.token.
pub fn load(dir: &Path, admin_token: Option<String>) -> Result<ClusterKeys, String> {
    let secrets = crate::rotating_secrets::RotatingSecrets::load(dir, admin_token)?;
    let audit = AuditKey::load(dir.join(AUDIT_KEY)).map_err(|e| e.to_string())?;
    let token_key = read_secret_file(&dir.join(TOKEN_KEY)).map_err(|e| e.to_string())?;
    Ok(ClusterKeys {
        audit,
        token_key,
        secrets: std::sync::Arc::new(secrets),
    })
}
