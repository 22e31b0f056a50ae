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
    /// Inspect and change cluster membership (admin token)
    Cluster {
        /// Node URLs, comma-separated (any node will do; requests find the leader)
        #[arg(
            long,
            env = "LINEAGE_URL",
            value_delimiter = ',',
            default_value = "http://127.0.0.1:9200"
        )]
        url: Vec<String>,
        /// File holding the admin token
        #[arg(
            long,
            env = "LINEAGE_ADMIN_TOKEN_FILE",
            default_value = "./lineage-data/keys/admin.token"
        )]
        token_file: PathBuf,
        #[command(subcommand)]
        command: ClusterCommand,
    },
}

#[derive(Subcommand)]
enum ClusterCommand {
    /// Leader, term, indexes, and every node with its role and lag
    Status,
    /// Add a node: as a learner until it has caught up, then as a voter
    Add {
        id: u64,
        /// host:port the other nodes use to reach it
        addr: String,
        #[arg(long)]
        learner_only: bool,
    },
    /// Remove a node from the cluster
    Remove { id: u64 },
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
        Command::Cluster {
            url,
            token_file,
            command,
        } => cluster(&url, &token_file, command, &mut out, &mut err),
    };
    ExitCode::from(code as u8)
}

fn cluster(
    urls: &[String],
    token_file: &std::path::Path,
    command: ClusterCommand,
    out: &mut dyn std::io::Write,
    err: &mut dyn std::io::Write,
) -> i32 {
    let token = match std::fs::read_to_string(token_file) {
        Ok(t) => t,
        Err(e) => {
            let _ = writeln!(
                err,
                "error: cannot read admin token {}: {e}",
                token_file.display()
            );
            return audit_cli::EXIT_USAGE;
        }
    };
    let client = match lineage_client::Client::new(urls, &token) {
        Ok(c) => c,
        Err(e) => {
            let _ = writeln!(err, "error: {e}");
            return audit_cli::EXIT_USAGE;
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            let _ = writeln!(err, "error: {e}");
            return audit_cli::EXIT_USAGE;
        }
    };
    let result = runtime.block_on(async {
        match command {
            ClusterCommand::Status => client.cluster().await,
            ClusterCommand::Add {
                id,
                addr,
                learner_only,
            } => client.add_node(id, &addr, learner_only).await,
            ClusterCommand::Remove { id } => client.remove_node(id).await,
        }
    });
    match result {
        Ok(value) => {
            let _ = writeln!(
                out,
                "{}",
                serde_json::to_string_pretty(&value).unwrap_or_default()
            );
            audit_cli::EXIT_OK
        }
        Err(e) => {
            let _ = writeln!(err, "error: {e}");
            audit_cli::EXIT_FAILED
        }
    }
}
