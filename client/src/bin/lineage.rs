//! `lineage`: the command-line tool for Lineage Cluster.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use lineage_client::{audit_cli, witnessed_cli};

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
    /// Witnessed heads checkpoints: fetch one from a cluster, or verify one
    #[command(subcommand)]
    Checkpoint(CheckpointCommand),
    /// Inspect and change cluster membership (admin token)
    Cluster {
        #[command(flatten)]
        nodes: NodeUrls,
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

/// The cluster's node URLs: any node will do, requests find the leader.
#[derive(clap::Args)]
struct NodeUrls {
    /// Node URLs, comma-separated (any node will do; requests find the leader)
    #[arg(
        long,
        env = "LINEAGE_URL",
        value_delimiter = ',',
        default_value = "http://127.0.0.1:9200"
    )]
    url: Vec<String>,
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
enum CheckpointCommand {
    /// Print the cluster's latest witnessed heads checkpoint
    Fetch {
        #[command(flatten)]
        nodes: NodeUrls,
        /// Write it to this file instead of stdout
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Check a witnessed checkpoint: the cluster key's signature and a witness quorum
    Verify {
        note: PathBuf,
        /// The cluster's audit public key (hex)
        #[arg(long)]
        public_key: String,
        /// A witness's cosignature vkey (repeatable)
        #[arg(long = "witness-key", required = true)]
        witness_keys: Vec<String>,
        #[arg(long, default_value_t = 1)]
        quorum: usize,
    },
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
        /// A witnessed heads checkpoint (from `lineage checkpoint fetch`): prove the log
        /// is complete up to the head it fixes (needs --public-key and --witness-key)
        #[arg(long, requires = "public_key")]
        witnessed: Option<PathBuf>,
        /// A witness's cosignature vkey (repeatable)
        #[arg(long = "witness-key")]
        witness_keys: Vec<String>,
        /// Witness cosignatures required
        #[arg(long, default_value_t = 1)]
        quorum: usize,
        /// The agent's head proof (JSON from /v1/agents/ID/head-proof?size=N)
        #[arg(long)]
        head_proof: Option<PathBuf>,
        /// Fetch the head proofs from these node URLs instead (comma-separated)
        #[arg(long, value_delimiter = ',')]
        cluster: Vec<String>,
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
                public_key: Some(public_key),
                witnessed: Some(note),
                witness_keys,
                quorum,
                head_proof,
                cluster,
                ..
            } => witnessed_verify(
                &log,
                &public_key,
                &note,
                &witness_keys,
                quorum,
                head_proof.as_deref(),
                &cluster,
                &mut out,
                &mut err,
            ),
            Audit::Verify {
                log,
                public_key,
                checkpoint,
                json,
                ..
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
        Command::Checkpoint(command) => checkpoint(command, &mut out, &mut err),
        Command::Cluster {
            nodes,
            token_file,
            command,
        } => cluster(&nodes.url, &token_file, command, &mut out, &mut err),
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

fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())
}

#[allow(clippy::too_many_arguments)]
fn witnessed_verify(
    log: &std::path::Path,
    public_key: &str,
    note_path: &std::path::Path,
    witness_keys: &[String],
    quorum: usize,
    head_proof: Option<&std::path::Path>,
    cluster: &[String],
    out: &mut dyn std::io::Write,
    err: &mut dyn std::io::Write,
) -> i32 {
    let usage = |err: &mut dyn std::io::Write, e: String| {
        let _ = writeln!(err, "error: {e}");
        audit_cli::EXIT_USAGE
    };
    let note = match std::fs::read_to_string(note_path) {
        Ok(n) => n,
        Err(e) => return usage(err, format!("cannot read {}: {e}", note_path.display())),
    };
    // The log is verified once, here; what to fetch comes from it and the note, and what
    // comes back is checked against them.
    let agent_id = match witnessed_cli::log_agent_id(log, public_key) {
        Ok(id) => id,
        Err(e) => {
            let _ = writeln!(out, "FAILED  {e}");
            return audit_cli::EXIT_FAILED;
        }
    };
    let proofs = match (head_proof, cluster.is_empty()) {
        (Some(path), _) => std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))
            .and_then(|text| {
                serde_json::from_str::<Vec<lineage_core::heads::HeadProof>>(&text)
                    .or_else(|_| serde_json::from_str(&text).map(|p| vec![p]))
                    .map_err(|e| format!("{} is not a head proof: {e}", path.display()))
            }),
        (None, false) => {
            let size = match witnessed_cli::verify_note(&note, public_key, witness_keys, quorum) {
                Ok(w) => w.checkpoint.size,
                Err(e) => {
                    let _ = writeln!(out, "FAILED  witnessed checkpoint: {e}");
                    return audit_cli::EXIT_FAILED;
                }
            };
            runtime().and_then(|rt| {
                rt.block_on(witnessed_cli::fetch_head_proofs(cluster, &agent_id, size))
            })
        }
        (None, true) => Err("--witnessed needs --head-proof FILE or --cluster URL".into()),
    };
    match proofs {
        Ok(proofs) => witnessed_cli::verify_verified_log(
            log,
            &agent_id,
            public_key,
            &witnessed_cli::WitnessedInput {
                note: &note,
                witness_keys,
                quorum,
            },
            &proofs,
            out,
            err,
        ),
        Err(e) => usage(err, e),
    }
}

fn checkpoint(
    command: CheckpointCommand,
    out: &mut dyn std::io::Write,
    err: &mut dyn std::io::Write,
) -> i32 {
    match command {
        CheckpointCommand::Fetch { nodes, out: path } => {
            let fetched =
                runtime().and_then(|rt| rt.block_on(witnessed_cli::fetch_witnessed(&nodes.url)));
            let written = fetched.and_then(|note| match &path {
                Some(path) => std::fs::write(path, &note)
                    .map_err(|e| format!("cannot write {}: {e}", path.display())),
                None => out.write_all(note.as_bytes()).map_err(|e| e.to_string()),
            });
            match written {
                Ok(()) => audit_cli::EXIT_OK,
                Err(e) => {
                    let _ = writeln!(err, "error: {e}");
                    audit_cli::EXIT_USAGE
                }
            }
        }
        CheckpointCommand::Verify {
            note,
            public_key,
            witness_keys,
            quorum,
        } => {
            let text = match std::fs::read_to_string(&note) {
                Ok(t) => t,
                Err(e) => {
                    let _ = writeln!(err, "error: cannot read {}: {e}", note.display());
                    return audit_cli::EXIT_USAGE;
                }
            };
            match witnessed_cli::verify_note(&text, &public_key, &witness_keys, quorum) {
                Ok(w) => {
                    let _ = writeln!(
                        out,
                        "OK  {} size {} root {}\n    cosigned by {}",
                        w.checkpoint.origin,
                        w.checkpoint.size,
                        hex::encode(w.checkpoint.root),
                        w.witnesses.join(", ")
                    );
                    audit_cli::EXIT_OK
                }
                Err(e) => {
                    let _ = writeln!(out, "FAILED  {e}");
                    audit_cli::EXIT_FAILED
                }
            }
        }
    }
}
