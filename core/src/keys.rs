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

/// Writes `text` to a new file with mode 0600, never over an existing one, so that the
/// name only ever holds the whole text: a crash at any step leaves either no file or the
/// complete one, never an empty key that a restart would refuse (or a reader would take).
/// 1. A temporary file beside it (`.NAME.tmp-PID-N`, mode 0600, exclusive create) gets the
///    text and an fsync. A crash here leaves only the temporary file, which the next
///    attempt removes.
/// 2. `hard_link` gives it the final name, and fails if that name exists (another writer
///    won): then the temporary file goes and the answer is `Exists`.
/// 3. The temporary name is unlinked and the directory fsynced, making the name durable.
pub fn write_secret_file(path: &Path, text: &str) -> Result<(), KeyError> {
    let io_err = |source: io::Error| KeyError::Io {
        path: path.display().to_string(),
        source,
    };
    let exists = || KeyError::Exists {
        path: path.display().to_string(),
    };
    if path.symlink_metadata().is_ok() {
        return Err(exists());
    }
    remove_stale_temporaries(path);
    let temp = temporary_name(path)?;
    let mut options = OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let written = options.open(&temp).and_then(|mut file| {
        file.write_all(text.as_bytes())?;
        file.sync_all()
    });
    if let Err(source) = written {
        let _ = std::fs::remove_file(&temp);
        return Err(io_err(source));
    }
    let linked = std::fs::hard_link(&temp, path);
    let _ = std::fs::remove_file(&temp);
    match linked {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Err(exists()),
        Err(e) => return Err(io_err(e)),
    }
    sync_parent_dir(path).map_err(io_err)?;
    Ok(())
}

/// `.NAME.tmp-PID-N` beside `path`: unique within this process and across processes.
fn temporary_name(path: &Path) -> Result<std::path::PathBuf, KeyError> {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| KeyError::Io {
            path: path.display().to_string(),
            source: io::Error::new(io::ErrorKind::InvalidInput, "no file name"),
        })?;
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    Ok(path.with_file_name(format!(".{name}.tmp-{}-{n}", std::process::id())))
}

/// Temporary files an interrupted [`write_secret_file`] left for this name (on Linux,
/// where /proc says whether their writer still runs).
fn remove_stale_temporaries(path: &Path) {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name().and_then(|n| n.to_str())) else {
        return;
    };
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let prefix = format!(".{name}.tmp-");
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let Some(pid) = file_name
            .to_str()
            .and_then(|n| n.strip_prefix(&prefix))
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        // Only a dead writer's: a live one (this process included) may be mid-write.
        let writer_alive = pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists();
        if !writer_alive {
            let _ = std::fs::remove_file(entry.path());
        }
    }
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
    fn an_interrupted_write_leaves_no_key_and_is_cleaned_up() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token.key");
        // What a crash between create and fsync leaves: a partial temporary file.
        let dead = u32::MAX - 1; // above pid_max: never a running process
        std::fs::write(dir.path().join(format!(".token.key.tmp-{dead}-0")), "0123").unwrap();
        assert!(
            read_secret_file(&path).is_err(),
            "no key under the final name"
        );
        let bytes = create_secret_file(&path).unwrap();
        assert_eq!(read_secret_file(&path).unwrap(), bytes);
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, vec!["token.key".to_string()], "temporaries removed");
        // Racing writers: exactly one wins, the other gets Exists, the winner's text stays.
        let raced = dir.path().join("raced.key");
        let results: Vec<_> = std::thread::scope(|scope| {
            let a = scope.spawn(|| write_secret_file(&raced, "aa"));
            let b = scope.spawn(|| write_secret_file(&raced, "bb"));
            vec![a.join().unwrap(), b.join().unwrap()]
        });
        let won = results.iter().filter(|r| r.is_ok()).count();
        assert_eq!(won, 1, "{results:?}");
        assert!(results
            .iter()
            .any(|r| matches!(r, Err(KeyError::Exists { .. }))));
        let text = std::fs::read_to_string(&raced).unwrap();
        assert!(text == "aa" || text == "bb", "{text:?}");
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
