//! `lineage-node dev`: a local cluster on consecutive ports (the nodes, then a witness and
//! a checkpointer when their binaries sit beside this one), run under `dev_supervisor`.
//! It prints what a newcomer needs: each node's URL, where the admin token is, the audit
//! public key, the witness's vkey, and a verify line to copy.

use std::path::{Path, PathBuf};
use std::process::Command;

use lineage_node::keys;

use crate::dev_supervisor::{self, StopOrder, Supervised};

const DEV_WITNESS_NAME: &str = "dev.witness/w1";

/// The dev witness: its binary beside this one, its data dir, and its verifier key
/// (created on first use).
struct DevWitness {
    bin: PathBuf,
    dir: PathBuf,
    vkey: String,
}

/// Starts the cluster and supervises it until a signal (or a child that keeps failing).
pub fn dev(nodes: u64, base_port: u16, data_dir: &Path) -> Result<(), String> {
    if nodes == 0 || nodes > 9 {
        return Err("--nodes must be between 1 and 9".into());
    }
    let exe = std::env::current_exe().map_err(|e| format!("cannot find own executable: {e}"))?;
    let witness_port = u64::from(base_port) + nodes;
    let checkpointer_port = witness_port + 1;
    let ports: Vec<u64> = (0..nodes + 2).map(|i| u64::from(base_port) + i).collect();
    check_ports_free(&ports)?;

    let keys_dir = data_dir.join("keys");
    keys::create_missing(&keys_dir, false)?;
    let addr = |i: u64| format!("127.0.0.1:{}", u64::from(base_port) + i - 1);
    let peers: Vec<String> = (1..=nodes).map(|i| format!("{i}={}", addr(i))).collect();
    // The witness's key comes first: the nodes store only checkpoints it cosigned.
    let witness = dev_witness(&exe, data_dir);
    let mut children = Vec::new();
    for i in 1..=nodes {
        let (exe, listen, peers) = (exe.clone(), addr(i), peers.join(","));
        let (node_dir, keys_dir) = (data_dir.join(format!("node-{i}")), keys_dir.clone());
        let witness_key = witness.as_ref().ok().map(|w| w.vkey.clone());
        let make = move || {
            let mut command = Command::new(&exe);
            command
                .args(["run", "--id", &i.to_string(), "--listen", &listen])
                .arg("--data-dir")
                .arg(&node_dir)
                .arg("--keys-dir")
                .arg(&keys_dir)
                .arg("--peers")
                .arg(&peers);
            if let Some(vkey) = &witness_key {
                command.args(["--witness-key", vkey]);
            }
            command
        };
        children.push(Supervised::spawn(
            format!("node {i}"),
            StopOrder::Node,
            Box::new(make),
        )?);
    }
    let urls: Vec<String> = (1..=nodes).map(|i| format!("http://{}", addr(i))).collect();
    let transparency = witness.as_ref().map_err(Clone::clone).and_then(|witness| {
        supervise_transparency(
            &exe,
            witness,
            data_dir,
            &keys_dir,
            &urls,
            witness_port,
            checkpointer_port,
        )
    });
    let witness_running = match transparency {
        Ok(mut started) => {
            children.append(&mut started);
            true
        }
        Err(e) => {
            println!("(no witness or checkpointer: {e})");
            false
        }
    };

    let audit = lineage_core::AuditKey::load(keys_dir.join(keys::AUDIT_KEY))
        .map_err(|e| format!("audit key: {e}"))?;
    let token_path = keys_dir.join(keys::ADMIN_TOKEN);
    println!("Lineage Cluster: {nodes} nodes");
    for i in 1..=nodes {
        println!("  node {i}           http://{}", addr(i));
    }
    println!("  admin token      {}", token_path.display());
    println!("  audit public key {}", audit.public_key_hex());
    if let (true, Ok(witness)) = (witness_running, &witness) {
        println!("  witness          http://127.0.0.1:{witness_port}");
        println!("  witness vkey     {}", witness.vkey);
        println!("  checkpointer     http://127.0.0.1:{checkpointer_port}/metrics");
    }
    println!("\nTry:");
    println!(
        "  curl -s -H \"Authorization: Bearer $(cat {})\" http://{}/v1/cluster",
        token_path.display(),
        addr(1)
    );
    let cluster = urls.join(",");
    println!(
        "  lineage --url {cluster} --token-file {} cluster status",
        token_path.display()
    );
    if let (true, Ok(witness)) = (witness_running, &witness) {
        println!("Verify an agent's log against the witnessed checkpoint (AGENT: its id):");
        println!(
            "  lineage --url {cluster} --token-file {} audit fetch AGENT > AGENT.jsonl && \
             lineage --url {cluster} checkpoint fetch --out checkpoint.txt && lineage audit \
             verify AGENT.jsonl --public-key {} --witnessed checkpoint.txt --witness-key {} \
             --cluster {cluster}",
            token_path.display(),
            audit.public_key_hex(),
            witness.vkey,
        );
    }
    println!("\nA child that fails is restarted; Ctrl-C, SIGTERM or SIGHUP stops everything.\n");
    dev_supervisor::run(children)
}

/// Every port dev will listen on must be free now: a clash found by a child later would
/// read as a crash loop.
fn check_ports_free(ports: &[u64]) -> Result<(), String> {
    for port in ports {
        let port = u16::try_from(*port).map_err(|_| format!("port {port} is out of range"))?;
        std::net::TcpListener::bind(("127.0.0.1", port)).map_err(|e| {
            format!(
                "port {port} on 127.0.0.1 is not free ({e}); is another `lineage-node dev` \
                 running? Choose others with --base-port"
            )
        })?;
    }
    Ok(())
}

fn dev_witness(exe: &Path, data_dir: &Path) -> Result<DevWitness, String> {
    let bin = exe.with_file_name("lineage-witness");
    if !bin.exists() || !exe.with_file_name("lineage-checkpointer").exists() {
        return Err("build them with `cargo build --release --bins`".into());
    }
    let dir = data_dir.join("witness");
    let witness = |args: &[&str]| {
        Command::new(&bin)
            .arg("--data-dir")
            .arg(&dir)
            .args(["--name", DEV_WITNESS_NAME])
            .args(args)
            .output()
            .map_err(|e| format!("lineage-witness: {e}"))
    };
    if !dir.join("witness.key").exists() {
        witness(&["keygen"])?;
    }
    let vkey_out = witness(&["vkey"])?;
    let vkey = String::from_utf8_lossy(&vkey_out.stdout).trim().to_string();
    if !vkey_out.status.success() || vkey.is_empty() {
        return Err(format!(
            "lineage-witness vkey: {}",
            String::from_utf8_lossy(&vkey_out.stderr).trim()
        ));
    }
    Ok(DevWitness { bin, dir, vkey })
}

/// The witness (trusting this cluster's heads log) and a checkpointer, supervised like
/// the nodes.
fn supervise_transparency(
    exe: &Path,
    witness: &DevWitness,
    data_dir: &Path,
    keys_dir: &Path,
    urls: &[String],
    witness_port: u64,
    checkpointer_port: u64,
) -> Result<Vec<Supervised>, String> {
    let checkpointer_bin = exe.with_file_name("lineage-checkpointer");
    let log_vkey = crate::heads_vkey(keys_dir, lineage_node::DEFAULT_CLUSTER_NAME)?;
    let witness_addr = format!("127.0.0.1:{witness_port}");
    let (bin, dir, trust) = (witness.bin.clone(), witness.dir.clone(), log_vkey.clone());
    let listen = witness_addr.clone();
    let witness_child = Supervised::spawn(
        "witness".into(),
        StopOrder::Witness,
        Box::new(move || {
            let mut command = Command::new(&bin);
            command
                .arg("--data-dir")
                .arg(&dir)
                .args(["--name", DEV_WITNESS_NAME, "--listen", &listen])
                .arg("--trust-log")
                .arg(&trust);
            command
        }),
    )?;
    let cluster = urls.join(",");
    let witness_arg = format!("http://{witness_addr}={}", witness.vkey);
    let (checkpointer_dir, token) = (
        data_dir.join("checkpointer"),
        keys_dir.join(keys::ADMIN_TOKEN),
    );
    let metrics = format!("127.0.0.1:{checkpointer_port}");
    let checkpointer_child = match Supervised::spawn(
        "checkpointer".into(),
        StopOrder::Checkpointer,
        Box::new(move || {
            let mut command = Command::new(&checkpointer_bin);
            command
                .arg("--cluster")
                .arg(&cluster)
                .arg("--witness")
                .arg(&witness_arg)
                .arg("--log-vkey")
                .arg(&log_vkey)
                .arg("--data-dir")
                .arg(&checkpointer_dir)
                .arg("--admin-token-file")
                .arg(&token)
                .arg("--metrics-listen")
                .arg(&metrics);
            command
        }),
    ) {
        Ok(child) => child,
        Err(e) => {
            // Not half a transparency stack: the witness stops too.
            dev_supervisor::stop_all(&mut [witness_child]);
            return Err(e);
        }
    };
    Ok(vec![witness_child, checkpointer_child])
}
