//! `lineage`: the command-line tool for Lineage Cluster.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use lineage_client::ops_cli::{self, Failure, Target, Verdict};
use lineage_client::{audit_cli, import_cli, operator_cli, witnessed_cli};
use serde_json::json;

#[derive(Parser)]
#[command(
    name = "lineage",
    version,
    about = "Lineage Cluster command-line tool",
    after_help = "Exit codes: 0 ok; 1 a negative result (denied, no leader, verification \
                  failed); 2 usage; 3 no node reachable; 4 token refused."
)]
struct Cli {
    #[command(flatten)]
    global: Global,
    #[command(subcommand)]
    command: Command,
}

/// Options every command takes, before or after its name.
#[derive(clap::Args)]
struct Global {
    /// Node URLs, comma-separated; any node will do, requests find the leader [default:
    /// $GUARD_URLS, $GUARD_URL, or http://127.0.0.1:9200]
    #[arg(long, global = true, env = "LINEAGE_URL", value_delimiter = ',')]
    url: Vec<String>,
    /// File holding the admin token [default: $GUARD_ADMIN_TOKEN, ./.env, or
    /// keys/admin.token under $GUARD_DATA_DIR, ./guard-data or ./lineage-data]
    #[arg(long, global = true, env = "LINEAGE_ADMIN_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// CA bundle (PEM) that https:// nodes' certificates must chain to
    #[arg(long, global = true, env = "LINEAGE_CA")]
    ca: Option<PathBuf>,
    /// Seconds to wait for each node before trying the next
    #[arg(long, global = true, default_value_t = 3.0, value_parser = parse_seconds)]
    timeout: f64,
    /// Print JSON: the API's answer, or the verification report
    #[arg(long, global = true)]
    json: bool,
}

fn parse_seconds(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(s) if s > 0.0 && s <= 3600.0 => Ok(s),
        _ => Err(format!(
            "{text:?} is not a number of seconds between 0 and 3600"
        )),
    }
}

impl Global {
    fn target(&self) -> Target {
        Target {
            urls: Target::node_urls(&self.url),
            token_file: self.token_file.clone(),
            ca: self.ca.clone(),
            timeout: Duration::from_secs_f64(self.timeout),
            json: self.json,
        }
    }
}

#[derive(Subcommand)]
enum Command {
    /// Daily work on agents: list, show, create, approval queue, approve, reject,
    /// terminate (admin token)
    #[command(subcommand)]
    Agent(AgentCommand),
    /// Tamper-evident audit logs: keys, appending, fetching, showing, verifying
    #[command(subcommand)]
    Audit(Audit),
    /// Witnessed heads checkpoints: fetch one from a cluster, or verify one
    #[command(subcommand)]
    Checkpoint(CheckpointCommand),
    /// Inspect and change cluster membership (admin token)
    #[command(subcommand)]
    Cluster(ClusterCommand),
    /// Named operators with roles: add (prints a new token), list, revoke (admin)
    #[command(subcommand)]
    Operator(OperatorCommand),
    /// Who the token speaks for
    Whoami,
    /// Move a reference guard's data directory into the cluster, through its Raft log
    /// (admin): every agents/*.jsonl, verified, with its original signatures; resumable
    Import {
        /// The reference guard's data directory (keys/ and agents/); only read
        #[arg(long)]
        from: PathBuf,
    },
}

#[derive(Subcommand)]
enum OperatorCommand {
    /// Add an operator; prints its new token once (only its SHA-256 is sent)
    Add {
        name: String,
        /// admin, approver, auditor or publisher
        #[arg(long)]
        role: String,
        /// Keep the token in this file instead of printing it: made and written there
        /// (mode 0600) first, or, when the file exists, the token it holds is registered
        /// (so running the command again finishes an interrupted run)
        #[arg(long)]
        token_out: Option<PathBuf>,
    },
    /// Every operator ever added, revoked ones too
    List,
    /// Revoke an operator: its token stops working; the name is never reused
    Revoke { name: String },
}

#[derive(Subcommand)]
enum AgentCommand {
    /// Every agent with its state, budget, scars and pending approvals
    List,
    /// One agent's status
    Show { agent: String },
    /// Create an agent and print its token
    Create {
        agent: String,
        /// The policy: JSON, or @FILE
        #[arg(long)]
        policy: String,
    },
    /// Actions waiting for approval: one agent's, or every agent's
    Pending { agent: Option<String> },
    /// Approve a pending action (bound to the exact input it was requested with)
    Approve {
        agent: String,
        action: String,
        #[arg(long)]
        note: Option<String>,
        /// Who approves, as recorded in the log [default: $USER]
        #[arg(long)]
        approver: Option<String>,
    },
    /// Reject a pending action
    Reject {
        agent: String,
        action: String,
        #[arg(long)]
        reason: String,
        /// Also scar the agent: minor, moderate, severe or fatal
        #[arg(long)]
        scar: Option<String>,
        /// Who rejects, as recorded in the log [default: $USER]
        #[arg(long)]
        approver: Option<String>,
    },
    /// Revoke the agent's token and print a new one (every earlier token is refused)
    ReissueToken { agent: String },
    /// Terminate an agent, permanently
    Terminate {
        agent: String,
        #[arg(long)]
        reason: String,
        /// Who terminates, as recorded in the log [default: $USER]
        #[arg(long)]
        by: Option<String>,
    },
}

#[derive(Subcommand)]
enum ClusterCommand {
    /// Leader, term, and every node with its role, lag and last contact
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
    /// Snapshot one node and purge its Raft log through it: the node `--url` names (the
    /// first that answers; its id is in the answer)
    Snapshot,
}

#[derive(Subcommand)]
enum CheckpointCommand {
    /// Print the cluster's latest witnessed heads checkpoint
    Fetch {
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
    /// Write an agent's signed log from the cluster, one record per line, as a file
    /// `verify` checks (admin token)
    Fetch {
        agent: String,
        /// Write to this file (through a rename) instead of stdout
        #[arg(long)]
        out: Option<PathBuf>,
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
    Show { log: PathBuf },
}

/// Who acts, as the log records it: the given name, else the login name.
fn actor(given: Option<String>) -> String {
    given
        .or_else(|| std::env::var("USER").ok().filter(|u| !u.is_empty()))
        .unwrap_or_else(|| "operator".to_string())
}

#[expect(
    clippy::too_many_lines,
    reason = "the command dispatch: one arm per command"
)]
fn main() -> ExitCode {
    let cli = Cli::parse();
    let (mut out, mut err) = (std::io::stdout().lock(), std::io::stderr().lock());
    let json = cli.global.json;
    let target = cli.global.target();
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
            Audit::Fetch { agent, out: dest } => report(
                ops_cli::audit_fetch(&target, &agent, dest.as_deref(), &mut out),
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
                target.ca.as_deref(),
                &mut out,
                &mut err,
            ),
            Audit::Verify {
                log,
                public_key,
                checkpoint,
                ..
            } => audit_cli::verify(
                &log,
                public_key.as_deref(),
                checkpoint.as_deref(),
                json,
                &mut out,
                &mut err,
            ),
            Audit::Show { log } => audit_cli::show(&log, json, &mut out, &mut err),
        },
        Command::Checkpoint(command) => checkpoint(command, &target, &mut out, &mut err),
        Command::Cluster(command) => {
            let result = match command {
                ClusterCommand::Status => ops_cli::cluster_status(&target, &mut out),
                ClusterCommand::Add {
                    id,
                    addr,
                    learner_only,
                } => ops_cli::cluster_change(
                    &target,
                    "/v1/cluster/nodes",
                    json!({"id": id, "addr": addr, "learner_only": learner_only}),
                    &mut out,
                ),
                ClusterCommand::Remove { id } => ops_cli::cluster_change(
                    &target,
                    "/v1/cluster/nodes/remove",
                    json!({"id": id}),
                    &mut out,
                ),
                ClusterCommand::Snapshot => {
                    ops_cli::cluster_change(&target, "/v1/node/snapshot", json!({}), &mut out)
                }
            };
            report(result, &mut err)
        }
        Command::Operator(command) => {
            let result = match command {
                OperatorCommand::Add {
                    name,
                    role,
                    token_out,
                } => operator_cli::add(&target, &name, &role, token_out.as_deref(), &mut out),
                OperatorCommand::List => operator_cli::list(&target, &mut out),
                OperatorCommand::Revoke { name } => operator_cli::revoke(&target, &name, &mut out),
            };
            report(result, &mut err)
        }
        Command::Whoami => report(operator_cli::whoami(&target, &mut out), &mut err),
        Command::Import { from } => report(import_cli::import(&target, &from, &mut out), &mut err),
        Command::Agent(command) => {
            let result = match command {
                AgentCommand::List => ops_cli::agent_list(&target, &mut out),
                AgentCommand::Show { agent } => ops_cli::agent_show(&target, &agent, &mut out),
                AgentCommand::Create { agent, policy } => {
                    ops_cli::agent_create(&target, &agent, &policy, &mut out)
                }
                AgentCommand::Pending { agent } => {
                    ops_cli::agent_pending(&target, agent.as_deref(), &mut out)
                }
                AgentCommand::Approve {
                    agent,
                    action,
                    note,
                    approver,
                } => ops_cli::agent_decide(
                    &target,
                    &agent,
                    &action,
                    &actor(approver),
                    Verdict::Approve {
                        note: note.as_deref(),
                    },
                    &mut out,
                ),
                AgentCommand::Reject {
                    agent,
                    action,
                    reason,
                    scar,
                    approver,
                } => ops_cli::agent_decide(
                    &target,
                    &agent,
                    &action,
                    &actor(approver),
                    Verdict::Reject {
                        reason: &reason,
                        scar: scar.as_deref(),
                    },
                    &mut out,
                ),
                AgentCommand::ReissueToken { agent } => {
                    ops_cli::agent_reissue_token(&target, &agent, &mut out)
                }
                AgentCommand::Terminate { agent, reason, by } => {
                    ops_cli::agent_terminate(&target, &agent, &reason, &actor(by), &mut out)
                }
            };
            report(result, &mut err)
        }
    };
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}

/// The exit code of an operator command, after saying what went wrong.
fn report(result: Result<(), Failure>, err: &mut dyn std::io::Write) -> i32 {
    match result {
        Ok(()) => ops_cli::EXIT_OK,
        Err(failure) => {
            let _ = writeln!(
                err,
                "error: {}",
                lineage_client::terminal_text::printable(failure.message())
            );
            failure.exit_code()
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
    ca: Option<&std::path::Path>,
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
                rt.block_on(witnessed_cli::fetch_head_proofs(
                    cluster, ca, &agent_id, size,
                ))
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
    target: &Target,
    out: &mut dyn std::io::Write,
    err: &mut dyn std::io::Write,
) -> i32 {
    match command {
        CheckpointCommand::Fetch { out: path } => {
            match ops_cli::checkpoint_fetch(target, path.as_deref(), out) {
                Ok(()) => audit_cli::EXIT_OK,
                Err(failure) => {
                    let _ = writeln!(
                        err,
                        "error: {}",
                        lineage_client::terminal_text::printable(failure.message())
                    );
                    failure.exit_code()
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
