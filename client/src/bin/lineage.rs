//! `lineage`: the command-line tool for Lineage Cluster.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use lineage_client::audit_cli;

#[derive(Parser)]
#[command(name = "lineage", version, about = "Lineage Cluster command-line tool")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Tamper-evident audit logs: keys, appending, showing, verifying
    #[command(subcommand)]
    Audit(Audit),
}

#[derive(Subcommand)]
enum Audit {
    /// Generate an Ed25519 signing key into a new file (mode 0600; never overwrites)
    Keygen { path: PathBuf },
    /// Print the public key of a signing key file
    Pubkey { path: PathBuf },
    /// Append a signed record (creating the log if needed) and print the new head
    Append {
        log: PathBuf,
        #[arg(long)]
        key: PathBuf,
        #[arg(long)]
        actor: String,
        #[arg(long)]
        kind: String,
        /// The record's payload, as JSON (default: {})
        #[arg(long)]
        payload: Option<String>,
    },
    /// Verify the hash chain and every signature (exit 0 valid, 1 failed, 2 error)
    Verify {
        log: PathBuf,
        /// The public key you trust (hex); without it only self-consistency is shown
        #[arg(long)]
        public_key: Option<String>,
        /// A head published earlier, SEQ:HASH: catches truncation and rewrites
        #[arg(long)]
        checkpoint: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Print the records as a table, or as JSON Lines with --json (does not verify)
    Show {
        log: PathBuf,
        #[arg(long)]
        json: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let (mut out, mut err) = (std::io::stdout().lock(), std::io::stderr().lock());
    let code = match cli.command {
        Command::Audit(audit) => match audit {
            Audit::Keygen { path } => audit_cli::keygen(&path, &mut out, &mut err),
            Audit::Pubkey { path } => audit_cli::pubkey(&path, &mut out, &mut err),
            Audit::Append {
                log,
                key,
                actor,
                kind,
                payload,
            } => audit_cli::append(
                &log,
                &key,
                &actor,
                &kind,
                payload.as_deref(),
                &mut out,
                &mut err,
            ),
            Audit::Verify {
                log,
                public_key,
                checkpoint,
                json,
            } => audit_cli::verify(
                &log,
                public_key.as_deref(),
                checkpoint.as_deref(),
                json,
                &mut out,
                &mut err,
            ),
            Audit::Show { log, json } => audit_cli::show(&log, json, &mut out, &mut err),
        },
    };
    ExitCode::from(code as u8)
}
