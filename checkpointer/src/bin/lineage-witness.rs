//! `lineage-witness`: an external C2SP tlog-witness with its own key and storage.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use lineage_checkpointer::witness::Witness;
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

fn open(dir: &Path, name: &str) -> Result<Witness, String> {
    let seed = read_secret_file(&dir.join(KEY_FILE))
        .map_err(|e| format!("{e} (run `lineage-witness keygen`)"))?;
    Witness::open(dir, name, seed).map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    lineage_checkpointer::init_tracing();
    let result = match cli.command {
        Some(Command::Keygen) => std::fs::create_dir_all(&cli.data_dir)
            .map_err(|e| e.to_string())
            .and_then(|_| {
                create_secret_file(&cli.data_dir.join(KEY_FILE)).map_err(|e| e.to_string())
            })
            .and_then(|_| open(&cli.data_dir, &cli.name))
            .map(|w| println!("{}", w.vkey())),
        Some(Command::Vkey) => read_secret_file(&cli.data_dir.join(KEY_FILE))
            .map_err(|e| format!("{e} (run `lineage-witness keygen`)"))
            .map(|seed| {
                let key = ed25519_dalek::SigningKey::from_bytes(&seed);
                println!(
                    "{}",
                    lineage_checkpointer::witness::vkey_for(&cli.name, &key)
                );
            }),
        Some(Command::AddLog { origin, vkey }) => open(&cli.data_dir, &cli.name)
            .and_then(|w| w.add_log(&origin, &vkey).map_err(|e| e.to_string()))
            .map(|()| println!("trusting {origin}")),
        None => serve(&cli.data_dir, &cli.name, cli.listen),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lineage-witness: {e}");
            ExitCode::FAILURE
        }
    }
}

fn serve(dir: &Path, name: &str, listen: SocketAddr) -> Result<(), String> {
    let witness = Arc::new(open(dir, name)?);
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
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await
        .map_err(|e| e.to_string())
    })
}
