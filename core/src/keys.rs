//! Key files: 32 random bytes written as 64 lowercase hex characters, no newline,
//! created with mode 0600 and never overwritten.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::Path;

use ed25519_dalek::{Signer, SigningKey, VerifyingKey};

/// Errors loading or creating a key file.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("{path}: {source}")]
    Io { path: String, source: io::Error },
    #[error("{path}: refusing to overwrite an existing key file")]
    Exists { path: String },
    #[error("{path}: a key file must hold 64 hex characters (32 bytes)")]
    Malformed { path: String },
    #[error("cannot gather randomness: {0}")]
    Random(String),
}

/// 32 bytes from the operating system's CSPRNG.
pub fn random_bytes() -> Result<[u8; 32], KeyError> {
    let mut bytes = [0u8; 32];
    getrandom::getrandom(&mut bytes).map_err(|e| KeyError::Random(e.to_string()))?;
    Ok(bytes)
}

/// Creates `path` with 32 fresh random bytes in hex (mode 0600, `create_new`, fsynced)
/// and returns the bytes. Refuses to overwrite an existing file.
pub fn create_secret_file(path: &Path) -> Result<[u8; 32], KeyError> {
    let bytes = random_bytes()?;
    write_secret_file(path, &hex::encode(bytes))?;
    Ok(bytes)
}

/// Writes `text` to a new file with mode 0600 and fsyncs it (and its directory).
pub fn write_secret_file(path: &Path, text: &str) -> Result<(), KeyError> {
    let io_err = |source: io::Error| KeyError::Io {
        path: path.display().to_string(),
        source,
    };
    let mut options = OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut file = options.open(path).map_err(|source| {
        if source.kind() == io::ErrorKind::AlreadyExists {
            KeyError::Exists {
                path: path.display().to_string(),
            }
        } else {
            io_err(source)
        }
    })?;
    file.write_all(text.as_bytes()).map_err(io_err)?;
    file.sync_all().map_err(io_err)?;
    sync_parent_dir(path).map_err(io_err)?;
    Ok(())
}

/// Reads a hex key file (trimmed) into 32 bytes.
pub fn read_secret_file(path: &Path) -> Result<[u8; 32], KeyError> {
    let text = std::fs::read_to_string(path).map_err(|source| KeyError::Io {
        path: path.display().to_string(),
        source,
    })?;
    parse_secret_hex(text.trim()).ok_or_else(|| KeyError::Malformed {
        path: path.display().to_string(),
    })
}

fn parse_secret_hex(text: &str) -> Option<[u8; 32]> {
    let mut bytes = [0u8; 32];
    hex::decode_to_slice(text, &mut bytes).ok()?;
    Some(bytes)
}

/// Makes a directory entry durable: fsync the directory that holds `path`.
pub fn sync_parent_dir(path: &Path) -> io::Result<()> {
    #[cfg(unix)]
    {
        let parent = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        File::open(parent)?.sync_all()?;
    }
    Ok(())
}

/// The Ed25519 key that signs audit records (an RFC 8032 seed).
#[derive(Clone)]
pub struct AuditKey {
    signing: SigningKey,
    public_hex: String,
}

impl std::fmt::Debug for AuditKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuditKey")
            .field("public_key", &self.public_hex)
            .finish_non_exhaustive()
    }
}

impl AuditKey {
    /// The key for a 32-byte seed.
    pub fn from_seed(seed: [u8; 32]) -> Self {
        let signing = SigningKey::from_bytes(&seed);
        let public_hex = hex::encode(signing.verifying_key().as_bytes());
        AuditKey {
            signing,
            public_hex,
        }
    }

    /// A fresh random key, not written anywhere.
    pub fn generate() -> Result<Self, KeyError> {
        Ok(Self::from_seed(random_bytes()?))
    }

    /// Loads the seed from a hex key file.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, KeyError> {
        Ok(Self::from_seed(read_secret_file(path.as_ref())?))
    }

    /// Creates a new key file (0600); refuses to overwrite.
    pub fn create(path: impl AsRef<Path>) -> Result<Self, KeyError> {
        Ok(Self::from_seed(create_secret_file(path.as_ref())?))
    }

    /// Loads the key file, creating it (and its directory) first if it does not exist.
    pub fn load_or_create(path: impl AsRef<Path>) -> Result<Self, KeyError> {
        let path = path.as_ref();
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|source| KeyError::Io {
                path: dir.display().to_string(),
                source,
            })?;
        }
        match Self::create(path) {
            Err(KeyError::Exists { .. }) => Self::load(path),
            other => other,
        }
    }

    /// The public key as 64 lowercase hex characters.
    pub fn public_key_hex(&self) -> &str {
        &self.public_hex
    }

    pub fn verifying_key(&self) -> VerifyingKey {
        self.signing.verifying_key()
    }

    /// The 32-byte seed (for deriving other encodings of the same key).
    pub fn seed(&self) -> [u8; 32] {
        self.signing.to_bytes()
    }

    /// Signs a raw 32-byte record hash.
    pub fn sign_hash(&self, hash: &[u8; 32]) -> [u8; 64] {
        self.signing.sign(hash).to_bytes()
    }

    /// Signs arbitrary bytes (used for signed notes).
    pub fn sign_bytes(&self, message: &[u8]) -> [u8; 64] {
        self.signing.sign(message).to_bytes()
    }
}

/// Parses a hex public key (case-insensitive, trimmed).
pub fn parse_public_key(text: &str) -> Option<VerifyingKey> {
    let mut bytes = [0u8; 32];
    hex::decode_to_slice(text.trim(), &mut bytes).ok()?;
    VerifyingKey::from_bytes(&bytes).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_file_is_created_0600_and_never_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.key");
        let key = AuditKey::create(&path).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.len(), 64);
        assert!(text
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        assert!(matches!(
            AuditKey::create(&path),
            Err(KeyError::Exists { .. })
        ));
        assert_eq!(std::fs::read_to_string(&path).unwrap(), text);
        let loaded = AuditKey::load_or_create(&path).unwrap();
        assert_eq!(loaded.public_key_hex(), key.public_key_hex());
    }

    #[test]
    fn malformed_key_file_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.key");
        std::fs::write(&path, "not hex").unwrap();
        let err = AuditKey::load(&path).unwrap_err();
        assert!(err.to_string().contains("64 hex characters"), "{err}");
    }

    #[test]
    fn trimmed_key_file_loads() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("k.key");
        std::fs::write(&path, format!("  {}\n", "11".repeat(32))).unwrap();
        assert!(AuditKey::load(&path).is_ok());
    }
}
