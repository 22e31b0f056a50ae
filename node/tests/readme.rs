//! The README's walkthrough works as written: its marked shell blocks
//! (`<!-- readme-test: NAME -->` before a ```sh block) run with bash, in order, against a
//! fresh `lineage-node dev` cluster, and reach a log that verifies against the witnessed
//! checkpoint. Only the ports change (the README's 9200.. become free ones, and
//! `LINEAGE_URL` names the first node for `lineage`'s default), and the binaries come from
//! this build's target directory rather than `target/release`.

#[path = "cluster/util.rs"]
mod util;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The README's shell block marked `name`.
fn block(readme: &str, name: &str) -> String {
    let marker = format!("<!-- readme-test: {name} -->");
    let after = readme
        .split_once(&marker)
        .unwrap_or_else(|| panic!("README.md has no {marker}"))
        .1;
    let body = after
        .trim_start()
        .strip_prefix("```sh\n")
        .unwrap_or_else(|| panic!("{marker} is not followed by a ```sh block"));
    body.split_once("\n```")
        .unwrap_or_else(|| panic!("{marker}'s block does not end"))
        .0
        .to_string()
}

fn bin_dir() -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_lineage-node"))
        .parent()
        .expect("target dir")
        .to_path_buf()
}

struct Dev(Child);

impl Drop for Dev {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let _ = self.0.wait();
    }
}

/// Runs a block with bash (stopping at the first failing command) in `dir`.
/// `lineage` without `--url` talks to 127.0.0.1:9200, the README's first node: here the
/// first node is at `base`, so `LINEAGE_URL` says so.
fn run_block(script: &str, dir: &Path, base: u16) -> (bool, String) {
    let path = std::env::var("PATH").unwrap_or_default();
    let output = Command::new("bash")
        .args(["-e", "-o", "pipefail", "-c", script])
        .current_dir(dir)
        .env("PATH", format!("{}:{path}", bin_dir().display()))
        .env("LINEAGE_URL", format!("http://127.0.0.1:{base}"))
        .env_remove("LINEAGE_ADMIN_TOKEN_FILE")
        .env_remove("GUARD_ADMIN_TOKEN")
        .output()
        .expect("run bash");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_walkthrough_reaches_a_verified_witnessed_log() {
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md"))
            .expect("README.md");
    let base = util::free_consecutive_ports(5);
    let ports = |text: String| {
        (0..5u16).fold(text, |text, i| {
            text.replace(
                &format!("127.0.0.1:{}", 9200 + i),
                &format!("127.0.0.1:{}", base + i),
            )
        })
    };
    let walkthrough = ports(block(&readme, "walkthrough"));
    let verify = ports(block(&readme, "verify"));

    let dir = tempfile::tempdir().expect("tempdir");
    let log = std::fs::File::create(dir.path().join("dev.out")).expect("log file");
    let dev = Dev(Command::new(env!("CARGO_BIN_EXE_lineage-node"))
        .args(["dev", "--base-port", &base.to_string()])
        .current_dir(dir.path())
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("log"))
        .stderr(log)
        .spawn()
        .expect("start dev"));
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .expect("client");
    let start = Instant::now();
    loop {
        let mut ready = true;
        for i in 0..3 {
            let reply = http
                .get(format!("http://127.0.0.1:{}/readyz", base + i))
                .send()
                .await;
            ready &= reply.is_ok_and(|r| r.status().is_success());
        }
        if ready {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "dev did not get ready:\n{}",
            std::fs::read_to_string(dir.path().join("dev.out")).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let (ok, output) = run_block(&walkthrough, dir.path(), base);
    assert!(ok, "the walkthrough failed:\n{output}");
    for expected in [
        r#""decision":"allowed","remaining":9"#,
        r#""decision":"pending_approval""#,
        r#""agent_id":"bot""#,
        r#""cost":4,"decision":"allowed","remaining":5"#,
        r#""code":"tool_not_allowed""#,
        "5 spent of 10",
        "scars      3 of 5",
    ] {
        assert!(
            output.contains(expected),
            "{expected} missing from:\n{output}"
        );
    }
    // The block waits for the checkpointer; on a slow machine, a few more rounds.
    let mut attempts = Vec::new();
    for _ in 0..5 {
        let (ok, output) = run_block(&verify, dir.path(), base);
        if ok {
            assert!(
                output.contains("complete up to its witnessed head"),
                "{output}"
            );
            drop(dev);
            return;
        }
        attempts.push(output);
    }
    panic!(
        "the verify block never passed:\n{}\ndev:\n{}",
        attempts.join("\n---\n"),
        std::fs::read_to_string(dir.path().join("dev.out")).unwrap_or_default()
    );
}

/// `deploy/provision-keys.sh deploy/keys`, as the README says, writes secrets into the
/// work tree: git must ignore them, so `git add -A` cannot commit them.
#[test]
fn the_keys_the_readme_provisions_are_ignored_by_git() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    if !repo.join(".git").exists() {
        eprintln!("SKIPPED: not a git work tree");
        return;
    }
    for file in ["admin.token", "audit.key", "witness.key", "compose.env"] {
        let status = Command::new("git")
            .args(["check-ignore", "-q", &format!("deploy/keys/{file}")])
            .current_dir(&repo)
            .status()
            .expect("run git");
        assert!(status.success(), "deploy/keys/{file} is not ignored by git");
    }
}

/// The README's TLS blocks: its setup makes keys and certificates, a node runs with the
/// flags it names, and `curl --cacert` and `lineage --ca` reach it over HTTPS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_tls_blocks_work_as_written() {
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md"))
            .expect("README.md");
    let port = util::free_port();
    let ports = |text: String| text.replace("127.0.0.1:9200", &format!("127.0.0.1:{port}"));
    let setup = ports(block(&readme, "tls-setup"));
    let clients = ports(block(&readme, "tls-clients"));
    let dir = tempfile::tempdir().expect("tempdir");
    let (ok, output) = run_block(&setup, dir.path(), port);
    assert!(ok, "the TLS setup failed:\n{output}");
    // The node, with the flags the setup block names.
    let listen = format!("127.0.0.1:{port}");
    let log = std::fs::File::create(dir.path().join("node.out")).expect("log file");
    let node = Dev(Command::new(env!("CARGO_BIN_EXE_lineage-node"))
        .args(["run", "--id", "1", "--listen", &listen])
        .args(["--peers", &format!("1={listen}")])
        .args(["--data-dir", "data", "--keys-dir", "keys"])
        .args([
            "--tls-cert",
            "tls/node-1.pem",
            "--tls-key",
            "tls/node-1.key",
        ])
        .args(["--tls-ca", "tls/ca.pem"])
        .current_dir(dir.path())
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("log"))
        .stderr(log)
        .spawn()
        .expect("start the node"));
    let http = util::https_client(&dir.path().join("tls/ca.pem"));
    let start = Instant::now();
    while !http
        .get(format!("https://{listen}/readyz"))
        .send()
        .await
        .is_ok_and(|r| r.status().is_success())
    {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the TLS node did not get ready:\n{}",
            std::fs::read_to_string(dir.path().join("node.out")).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (ok, output) = run_block(&clients, dir.path(), port);
    assert!(ok, "the TLS client block failed:\n{output}");
    for expected in [r#""agents":[]"#, "leader 1"] {
        assert!(
            output.contains(expected),
            "{expected} missing from:\n{output}"
        );
    }
    drop(node);
}
