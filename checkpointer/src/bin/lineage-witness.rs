//! `lineage-witness`: an external C2SP tlog-witness with its own key and storage.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use lineage_checkpointer::witness::{vkey_for, Witness};
use lineage_core::keys::{create_secret_file, read_secret_file};

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
    /// The witness's name (its cosignature key name)
    #[arg(
        long,
        global = true,
        env = "LINEAGE_WITNESS_NAME",
        default_value = "lineage-witness"
    )]
    name: String,
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

    fn open(&self) -> Result<Witness, String> {
        let key = self.read_key()?;
        Witness::open(&self.data_dir, &self.name, key.to_bytes()).map_err(|e| e.to_string())
    }

    /// Creates the key file only (no witness state), so keys can be made apart from
    /// where the witness will keep its data.
    fn keygen(&self) -> Result<(), String> {
        let path = self.key_path();
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)
                .map_err(|e| format!("cannot create {}: {e}", parent.display()))?;
        }
        create_secret_file(&path).map_err(|e| e.to_string())?;
        self.print_vkey()
    }

    fn print_vkey(&self) -> Result<(), String> {
        let key = self.read_key()?;
        println!("{}", vkey_for(&self.name, key.to_bytes())?);
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
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lineage-witness: {e}");
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
    let (name, listen) = (&cli.name, cli.listen);
    println!("lineage-witness {name} on http://{listen}");
    println!("  cosignature vkey {}", witness.vkey());
    let runtime = tokio::runtime::Runtime::new().map_err(|e| e.to_string())?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .map_err(|e| format!("cannot listen on {listen}: {e}"))?;
        axum::serve(
            listener,
            lineage_checkpointer::witness_server::router(witness),
        )
        .with_graceful_shutdown(lineage_checkpointer::shutdown_signal())
        .await
        .map_err(|e| e.to_string())
    })
}
