//! `lineage-witness`: an external C2SP tlog-witness with its own key and storage.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};
use lineage_checkpointer::witness::{vkey_for, Witness};
use lineage_core::keys::{create_secret_file, read_secret_file};
use lineage_http_server::{Limits, NoTls, DEFAULT_HEADER_TIMEOUT, DEFAULT_IDLE_TIMEOUT};

#[derive(Parser)]
#[command(
    name = "lineage-witness",
    version,
    about = "An external tlog-witness for Lineage Cluster"
)]
struct Cli {
    /// Where the witness keeps its key and state
    #[arg(
        long,
        global = true,
        env = "LINEAGE_WITNESS_DIR",
        default_value = "./witness-data"
    )]
    data_dir: PathBuf,
    /// The witness's name (its cosignature key name). `keygen` stores it beside the key
    /// (KEY.name) and later commands read it from there; a different --name is an error,
    /// since it would change the vkey. Default for a new key: lineage-witness
    #[arg(long, global = true, env = "LINEAGE_WITNESS_NAME")]
    name: Option<String>,
    /// The witness's signing key (default: witness.key in the data dir), e.g. a
    /// container secret
    #[arg(long, global = true, env = "LINEAGE_WITNESS_KEY_FILE")]
    key_file: Option<PathBuf>,
    /// Trust a log at start: its checkpoint verifier key, whose key name is the log's
    /// origin (repeatable; a log already trusted with this key is left as it is, one
    /// trusted with another key stops the start)
    #[arg(
        long = "trust-log",
        env = "LINEAGE_WITNESS_TRUST_LOG",
        value_delimiter = ' '
    )]
    trust_logs: Vec<String>,
    #[command(subcommand)]
    command: Option<Command>,
    /// Address to serve on
    #[arg(long, env = "LINEAGE_WITNESS_LISTEN", default_value = "127.0.0.1:9290")]
    listen: SocketAddr,
    /// Open connections at most; at the cap the quietest idle one is closed to make room
    /// [default: half the open-file limit, which the witness raises to its hard limit]
    #[arg(long, env = "LINEAGE_WITNESS_MAX_CONNECTIONS")]
    max_connections: Option<usize>,
    /// Milliseconds a request's headers may take to arrive (and a request body may stall)
    #[arg(long, env = "LINEAGE_WITNESS_HTTP_HEADER_TIMEOUT_MS", default_value_t = millis(DEFAULT_HEADER_TIMEOUT))]
    http_header_timeout_ms: u64,
    /// Milliseconds a connection may sit with no request and no byte moving
    #[arg(long, env = "LINEAGE_WITNESS_HTTP_IDLE_TIMEOUT_MS", default_value_t = millis(DEFAULT_IDLE_TIMEOUT))]
    http_idle_timeout_ms: u64,
}

fn millis(d: Duration) -> u64 {
    d.as_millis() as u64
}

#[derive(Subcommand)]
enum Command {
    /// Create the witness key (0600; never overwritten) and print the cosignature vkey
    Keygen,
    /// Print the cosignature verifier key
    Vkey,
    /// Trust a log: its origin and its checkpoint verifier key (never removed)
    AddLog {
        #[arg(long)]
        origin: String,
        #[arg(long)]
        vkey: String,
    },
}

const KEY_FILE: &str = "witness.key";
const DEFAULT_NAME: &str = "lineage-witness";

impl Cli {
    fn key_path(&self) -> PathBuf {
        self.key_file
            .clone()
            .unwrap_or_else(|| self.data_dir.join(KEY_FILE))
    }

    fn read_key(&self) -> Result<ed25519_dalek::SigningKey, String> {
        read_secret_file(&self.key_path())
            .map(|seed| ed25519_dalek::SigningKey::from_bytes(&seed))
            .map_err(|e| format!("{e} (run `lineage-witness keygen`)"))
    }

    /// Where `keygen` stores the name the key was made for: the vkey is the name and the
    /// key together, so a name given later must not silently change it.
    fn name_path(&self) -> PathBuf {
        let mut path = self.key_path().into_os_string();
        path.push(".name");
        PathBuf::from(path)
    }

    /// The witness's name: the stored one (a different --name is an error), else --name,
    /// else the default (keys made before names were stored).
    fn name(&self) -> Result<String, String> {
        let path = self.name_path();
        let stored = match std::fs::read_to_string(&path) {
            Ok(text) => Some(text.trim_end_matches('\n').to_string()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
        };
        match (stored, &self.name) {
            (Some(stored), Some(given)) if &stored != given => Err(format!(
                "this key was made for the name {stored:?} (in {}); --name {given:?} would \
                 give a different vkey: drop --name, or make a new key for the new name",
                path.display()
            )),
            (Some(stored), _) => Ok(stored),
            (None, Some(given)) => Ok(given.clone()),
            (None, None) => Ok(DEFAULT_NAME.to_string()),
        }
    }

    fn open(&self) -> Result<Witness, String> {
        let key = self.read_key()?;
        Witness::open(&self.data_dir, &self.name()?, key.to_bytes()).map_err(|e| e.to_string())
    }

    /// Creates the key file only (no witness state), so keys can be made apart from
    /// where the witness will keep its data.
    fn keygen(&self) -> Result<(), String> {
        let path = self.key_path();
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)
                .map_err(|e| format!("cannot create {}: {e}", parent.display()))?;
        }
        let name = self
            .name
            .clone()
            .unwrap_or_else(|| DEFAULT_NAME.to_string());
        // Check the name before the key exists, so a bad name leaves nothing behind.
        if !signed_note::is_key_name_valid(&name) {
            return Err(format!("{name:?} is not a valid key name"));
        }
        create_secret_file(&path).map_err(|e| e.to_string())?;
        // The key is created first: a crash between the two leaves a key without a
        // stored name, which reads as the default name; rerunning keygen then refuses
        // (the key exists) rather than overwriting it.
        let name_path = self.name_path();
        std::fs::write(&name_path, format!("{name}\n"))
            .map_err(|e| format!("cannot write {}: {e}", name_path.display()))?;
        self.print_vkey()
    }

    fn print_vkey(&self) -> Result<(), String> {
        let key = self.read_key()?;
        println!("{}", vkey_for(&self.name()?, key.to_bytes())?);
        Ok(())
    }
}

/// The origin a log verifier key names: its key name, the text before the first '+'.
fn origin_of(vkey: &str) -> Result<&str, String> {
    signed_note::StandardVerifier::new(vkey)
        .map_err(|e| format!("--trust-log {vkey:?}: not a verifier key: {e}"))?;
    vkey.split_once('+')
        .map(|(name, _)| name)
        .ok_or_else(|| format!("--trust-log {vkey:?}: not a verifier key"))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    lineage_checkpointer::init_tracing();
    let result = match &cli.command {
        Some(Command::Keygen) => cli.keygen(),
        Some(Command::Vkey) => cli.print_vkey(),
        Some(Command::AddLog { origin, vkey }) => cli
            .open()
            .and_then(|w| w.add_log(origin, vkey).map_err(|e| e.to_string()))
            .map(|()| println!("trusting {origin}")),
        None => serve(&cli),
    };
    match result {
        Ok(()) => {
            lineage_log_sink::flush();
            ExitCode::SUCCESS
        }
        Err(e) => {
            // What is queued first, then the error line.
            lineage_log_sink::last_words(format!("lineage-witness: {e}"));
            ExitCode::FAILURE
        }
    }
}

fn serve(cli: &Cli) -> Result<(), String> {
    let witness = Arc::new(cli.open()?);
    for vkey in cli.trust_logs.iter().filter(|v| !v.is_empty()) {
        let origin = origin_of(vkey)?;
        witness
            .add_log(origin, vkey)
            .map_err(|e| format!("--trust-log: {e}"))?;
        println!("trusting {origin}");
    }
    let (name, listen) = (cli.name()?, cli.listen);
    // Anyone may post to a witness: silent, slow and idle connections are closed, and
    // their number is capped (the same accept loop as the node's).
    lineage_http_server::raise_open_file_limit();
    let limits = Limits::new(
        cli.max_connections,
        Duration::from_millis(cli.http_header_timeout_ms.max(1)),
        Duration::from_millis(cli.http_idle_timeout_ms.max(1)),
    );
    println!("lineage-witness {name} on http://{listen}");
    println!("  cosignature vkey {}", witness.vkey());
    let runtime = tokio::runtime::Runtime::new().map_err(|e| e.to_string())?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .map_err(|e| format!("cannot listen on {listen}: {e}"))?;
        lineage_http_server::serve(
            listener,
            lineage_checkpointer::witness_server::router(witness),
            limits,
            Arc::new(()),
            None::<NoTls>,
            lineage_checkpointer::shutdown_signal(),
        )
        .await;
        Ok(())
    })
}
