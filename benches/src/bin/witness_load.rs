//! Witness benchmark: add-checkpoint requests per second against a real `lineage-witness`
//! process, each a growing checkpoint with its consistency proof, from C concurrent logs
//! (one origin each, as the witness serialises per origin). Printed beside the machine's
//! durable-commit rate measured in the same run, since each cosignature is persisted.
//!
//!   cargo build --release -p lineage-checkpointer -p lineage-benches
//!   target/release/witness_load [--logs 8] [--seconds 10]

use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use lineage_benches::sibling_binary;
use lineage_core::transparency::{consistency_proof, root, Checkpoint, Hash, NoteSigner};
use lineage_core::AuditKey;
use sha2::{Digest, Sha256};

/// Checkpoints a witness takes per second from several logs at once.
#[derive(clap::Parser)]
struct Args {
    /// Logs sending checkpoints at once.
    #[arg(long, default_value_t = 8, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=64))]
    logs: usize,
    /// Seconds of load.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=120))]
    seconds: u64,
}

fn main() {
    let args = <Args as clap::Parser>::parse();
    if let Err(e) = run(&args) {
        eprintln!("witness_load: {e}");
        std::process::exit(1);
    }
}

#[expect(
    clippy::too_many_lines,
    reason = "one measured run, step by step: setup, the load, the report"
)]
fn run(args: &Args) -> Result<(), String> {
    let (logs, seconds) = (args.logs, args.seconds);
    let witness_bin = sibling_binary("lineage-witness", "-p lineage-checkpointer")?;

    let fsync_rate = lineage_benches::durable_appends_per_second()?;

    let data = tempfile::tempdir().map_err(|e| e.to_string())?;
    let witness = |args: &[&str]| {
        Command::new(&witness_bin)
            .arg("--data-dir")
            .arg(data.path())
            .args(["--name", "bench.witness/w"])
            .args(args)
            .stdout(Stdio::null())
            .status()
            .map_err(|e| e.to_string())
    };
    witness(&["keygen"])?;
    let key = AuditKey::from_seed([2; 32]);
    let origins: Vec<String> = (0..logs).map(|i| format!("bench.log/{i}")).collect();
    for origin in &origins {
        let vkey = NoteSigner::new(origin, &key)
            .map_err(|e| e.to_string())?
            .vkey();
        witness(&["add-log", "--origin", origin, "--vkey", &vkey])?;
    }
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| e.to_string())?
        .port();
    let listen = format!("127.0.0.1:{port}");
    let mut child = Command::new(&witness_bin)
        .arg("--data-dir")
        .arg(data.path())
        .args(["--name", "bench.witness/w", "--listen", &listen])
        .env("LINEAGE_LOG", "error")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| e.to_string())?;

    let runtime = tokio::runtime::Runtime::new().map_err(|e| e.to_string())?;
    let result = runtime.block_on(async {
        let http = reqwest::Client::new();
        let ready = Instant::now();
        while tokio::net::TcpStream::connect(&listen).await.is_err() {
            if ready.elapsed() > Duration::from_secs(10) {
                return Err("witness did not start".to_string());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let deadline = Instant::now() + Duration::from_secs(seconds);
        let started = Instant::now();
        let mut tasks = Vec::new();
        for origin in origins {
            let (http, listen, key) = (http.clone(), listen.clone(), key.clone());
            tasks.push(tokio::spawn(async move {
                let mut leaves: Vec<Hash> = Vec::new();
                let (mut ok, mut failed) = (0u64, 0u64);
                while Instant::now() < deadline {
                    let old = leaves.len() as u64;
                    leaves.push(Sha256::digest(format!("{origin}{old}")).into());
                    let checkpoint = Checkpoint {
                        origin: origin.clone(),
                        size: leaves.len() as u64,
                        root: root(&leaves),
                    };
                    let mut body = format!("old {old}\n");
                    for hash in consistency_proof(&leaves, old).unwrap_or_default() {
                        body.push_str(&B64.encode(hash));
                        body.push('\n');
                    }
                    body.push('\n');
                    body.push_str(&checkpoint.sign(&key).unwrap_or_default());
                    let reply = http
                        .post(format!("http://{listen}/add-checkpoint"))
                        .body(body)
                        .send()
                        .await;
                    match reply {
                        Ok(r) if r.status().is_success() => ok += 1,
                        Ok(r) => {
                            if failed == 0 {
                                let status = r.status();
                                eprintln!(
                                    "{origin}: first failure {status}: {}",
                                    r.text().await.unwrap_or_default().trim()
                                );
                            }
                            failed += 1;
                            // The witness did not take this size: retry from where it is.
                            leaves.pop();
                        }
                        Err(e) => {
                            if failed == 0 {
                                eprintln!("{origin}: first failure: {e}");
                            }
                            failed += 1;
                            leaves.pop();
                        }
                    }
                }
                (ok, failed)
            }));
        }
        let (mut ok, mut failed) = (0, 0);
        for task in tasks {
            let (o, f) = task.await.map_err(|e| e.to_string())?;
            ok += o;
            failed += f;
        }
        Ok((ok, failed, started.elapsed()))
    });
    let _ = child.kill();
    let _ = child.wait();
    let (ok, failed, elapsed) = result?;
    let rate = ok as f64 / elapsed.as_secs_f64();
    println!("machine ceiling: {fsync_rate:.0} durable appends/s");
    println!(
        "witness: {rate:.0} add-checkpoint/s cosigned ({ok} ok, {failed} failed, {logs} logs, {seconds} s) = {:.2}x the durable-append ceiling",
        rate / fsync_rate
    );
    Ok(())
}
