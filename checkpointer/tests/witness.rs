//! The witness as a real process, driven through every case of the tlog-witness protocol,
//! and killed with -9 between requests without losing what it cosigned.

use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use ed25519_dalek::Verifier as _;
use lineage_core::transparency::{consistency_proof, root, Checkpoint, Hash, NoteSigner};
use lineage_core::AuditKey;
use sha2::{Digest, Sha256};

const ORIGIN: &str = "lineage.test/heads";
const FRESH: &str = "lineage.test/fresh";

struct Witness {
    child: Option<Child>,
    dir: tempfile::TempDir,
    listen: String,
    vkey: String,
}

impl Drop for Witness {
    fn drop(&mut self) {
        self.kill();
    }
}

fn witness_cmd(dir: &Path) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_lineage-witness"));
    command
        .arg("--data-dir")
        .arg(dir)
        .arg("--name")
        .arg("witness.test/w1");
    command
}

impl Witness {
    fn setup(log_vkey: &str) -> Witness {
        let dir = tempfile::tempdir().unwrap();
        let out = witness_cmd(dir.path()).arg("keygen").output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let vkey = String::from_utf8(out.stdout).unwrap().trim().to_string();
        for origin in [ORIGIN, FRESH] {
            let status = witness_cmd(dir.path())
                .args(["add-log", "--origin", origin, "--vkey", log_vkey])
                .stdout(Stdio::null())
                .status()
                .unwrap();
            assert!(status.success());
        }
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        Witness {
            child: None,
            dir,
            listen: format!("127.0.0.1:{port}"),
            vkey,
        }
    }

    async fn start(&mut self) {
        self.start_logging_to(Stdio::null()).await;
    }

    async fn start_logging_to(&mut self, log: Stdio) {
        let child = witness_cmd(self.dir.path())
            .args(["--listen", &self.listen])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
        let start = Instant::now();
        while tokio::net::TcpStream::connect(&self.listen).await.is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "witness did not start"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    async fn submit(&self, body: String) -> (u16, String, String) {
        let reply = reqwest::Client::new()
            .post(format!("http://{}/add-checkpoint", self.listen))
            .body(body)
            .send()
            .await
            .unwrap();
        let status = reply.status().as_u16();
        let content_type = reply
            .headers()
            .get("content-type")
            .map(|v| v.to_str().unwrap().to_string())
            .unwrap_or_default();
        (status, content_type, reply.text().await.unwrap())
    }
}

fn leaves(n: u32, salt: &str) -> Vec<Hash> {
    (0..n)
        .map(|i| Sha256::digest(format!("{salt}{i}")).into())
        .collect()
}

/// An add-checkpoint body: `old N`, proof lines, blank line, the signed checkpoint.
fn request(
    key: &AuditKey,
    origin: &str,
    old: u64,
    tree: &[Hash],
    proof: Option<Vec<Hash>>,
) -> String {
    let checkpoint = Checkpoint {
        origin: origin.into(),
        size: tree.len() as u64,
        root: root(tree),
    };
    let proof = proof.unwrap_or_else(|| {
        if old <= tree.len() as u64 {
            consistency_proof(tree, old).unwrap()
        } else {
            Vec::new()
        }
    });
    let mut body = format!("old {old}\n");
    for hash in proof {
        body.push_str(&B64.encode(hash));
        body.push('\n');
    }
    body.push('\n');
    body.push_str(&checkpoint.sign(key).unwrap());
    body
}

/// Checks a cosignature line against the witness vkey and the checkpoint text.
fn check_cosignature(line: &str, vkey: &str, checkpoint_text: &str) {
    // name+hexid+base64: the name has no '+', the base64 key may.
    let mut parts = vkey.splitn(3, '+');
    let (name, id_hex, key_b64) = (
        parts.next().unwrap(),
        parts.next().unwrap(),
        parts.next().unwrap(),
    );
    let key_bytes = B64.decode(key_b64).unwrap();
    assert_eq!(key_bytes[0], 0x04, "timestamped Ed25519 cosignature key");
    let public =
        ed25519_dalek::VerifyingKey::from_bytes(&key_bytes[1..].try_into().unwrap()).unwrap();
    let rest = line.strip_prefix("\u{2014} ").unwrap().trim_end();
    let (line_name, blob_b64) = rest.split_once(' ').unwrap();
    assert_eq!(line_name, name);
    let blob = B64.decode(blob_b64).unwrap();
    assert_eq!(blob.len(), 76);
    assert_eq!(hex::encode(&blob[..4]), id_hex);
    let timestamp = u64::from_be_bytes(blob[4..12].try_into().unwrap());
    assert!(timestamp > 1_700_000_000);
    let message = format!("cosignature/v1\ntime {timestamp}\n{checkpoint_text}");
    let signature = ed25519_dalek::Signature::from_bytes(&blob[12..].try_into().unwrap());
    public
        .verify(message.as_bytes(), &signature)
        .expect("cosignature verifies");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[expect(
    clippy::too_many_lines,
    reason = "a scenario test: every case of the protocol in order, against one witness"
)]
async fn every_case_of_the_protocol_and_a_kill_between_requests() {
    let log_key = AuditKey::from_seed([11; 32]);
    let log_vkey = NoteSigner::new(ORIGIN, &log_key).unwrap().vkey();
    // Both origins are trusted with the same log key (named after ORIGIN).
    let mut witness = Witness::setup(&log_vkey);
    witness.start().await;
    let tree = leaves(12, "honest");
    let sign_as = |origin: &str, old: u64, t: &[Hash], proof: Option<Vec<Hash>>| {
        // A FRESH checkpoint is signed under the ORIGIN key name, as the witness expects.
        let body = request(&log_key, origin, old, t, proof);
        if origin == ORIGIN {
            body
        } else {
            let checkpoint = Checkpoint {
                origin: origin.into(),
                size: t.len() as u64,
                root: root(t),
            };
            let mut note = signed_note::Note::new(checkpoint.text().as_bytes(), &[]).unwrap();
            let signer = NoteSigner::new(ORIGIN, &log_key).unwrap();
            note.add_sigs(&[&signer]).unwrap();
            let head = body.split_once("\n\n").unwrap().0;
            format!("{head}\n\n{}", String::from_utf8(note.to_bytes()).unwrap())
        }
    };

    // First checkpoint, then growth with a consistency proof.
    let (status, _, body) = witness.submit(sign_as(ORIGIN, 0, &tree[..4], None)).await;
    assert_eq!(status, 200, "{body}");
    let text4 = Checkpoint {
        origin: ORIGIN.into(),
        size: 4,
        root: root(&tree[..4]),
    }
    .text();
    check_cosignature(&body, &witness.vkey, &text4);
    let (status, _, body) = witness.submit(sign_as(ORIGIN, 4, &tree[..8], None)).await;
    assert_eq!(status, 200, "{body}");

    // Stale old size: 409 with the size the witness holds.
    let (status, content_type, body) = witness.submit(sign_as(ORIGIN, 4, &tree[..10], None)).await;
    assert_eq!(
        (status, content_type.as_str(), body.as_str()),
        (409, "text/x.tlog.size", "8\n")
    );

    // Rewritten history: a different tree of 10 with its own (valid-for-it) proof.
    let forged = leaves(10, "rewritten");
    let (status, _, body) = witness
        .submit(sign_as(
            ORIGIN,
            8,
            &forged,
            Some(consistency_proof(&forged, 8).unwrap()),
        ))
        .await;
    assert_eq!(status, 422, "{body}");

    // Truncation: a checkpoint smaller than the old size it claims.
    let (status, _, _) = witness
        .submit(sign_as(ORIGIN, 8, &tree[..6], Some(Vec::new())))
        .await;
    assert_eq!(status, 400);

    // Same size, another root.
    let (status, _, _) = witness
        .submit(sign_as(ORIGIN, 8, &forged[..8], Some(Vec::new())))
        .await;
    assert_eq!(status, 422);
    // None of these is kept (anyone may post, and a proof is not signed): the forged
    // note again with another proof, an older checkpoint the log signed, and the
    // cosigned one with a needless proof.
    let junk = Some(vec![[9u8; 32]]);
    let (status, _, _) = witness
        .submit(sign_as(ORIGIN, 8, &forged, junk.clone()))
        .await;
    assert_eq!(status, 422);
    let (status, _, _) = witness.submit(sign_as(ORIGIN, 4, &tree[..6], None)).await;
    assert_eq!(status, 409);
    let (status, _, _) = witness.submit(sign_as(ORIGIN, 8, &tree[..8], junk)).await;
    assert_eq!(status, 422);
    // Nor the forked note again with a line of anyone's added: not the log's to vary.
    for n in 0..3u8 {
        let with_line = format!(
            "{}\u{2014} anyone.test {}\n",
            sign_as(ORIGIN, 8, &forged[..8], Some(Vec::new())),
            B64.encode([n; 40])
        );
        let (status, _, _) = witness.submit(with_line).await;
        assert_eq!(status, 422);
    }

    // Size 0 with a wrong root, and a proof sent with old 0 (fresh origin, still at 0).
    let zero_body = sign_as(FRESH, 0, &[], None);
    let wrong_zero = {
        let checkpoint = Checkpoint {
            origin: FRESH.into(),
            size: 0,
            root: [7; 32],
        };
        let mut note = signed_note::Note::new(checkpoint.text().as_bytes(), &[]).unwrap();
        note.add_sigs(&[&NoteSigner::new(ORIGIN, &log_key).unwrap()])
            .unwrap();
        format!("old 0\n\n{}", String::from_utf8(note.to_bytes()).unwrap())
    };
    let (status, _, _) = witness.submit(wrong_zero).await;
    assert_eq!(status, 422);
    let with_proof = sign_as(FRESH, 0, &tree[..3], Some(vec![tree[0]]));
    let (status, _, _) = witness.submit(with_proof).await;
    assert_eq!(status, 422);
    let (status, _, _) = witness.submit(zero_body).await;
    assert_eq!(status, 200, "the empty tree with the empty root is fine");

    // Unknown origin; a key the witness does not trust; a broken signature.
    let (status, _, _) = witness
        .submit(request(&log_key, "unknown.test/log", 0, &tree[..2], None))
        .await;
    assert_eq!(status, 404);
    let stranger = AuditKey::from_seed([99; 32]);
    let (status, _, _) = witness
        .submit(request(&stranger, ORIGIN, 8, &tree[..9], None))
        .await;
    assert_eq!(status, 403);
    let honest = sign_as(ORIGIN, 8, &tree[..9], None);
    let sig_start = honest.rfind(' ').unwrap() + 1;
    let mut broken = honest.clone();
    let flipped = if &honest[sig_start + 10..sig_start + 11] == "A" {
        "B"
    } else {
        "A"
    };
    broken.replace_range(sig_start + 10..sig_start + 11, flipped);
    let (status, _, _) = witness.submit(broken).await;
    assert_eq!(status, 403);
    for malformed in ["", "old x\n\n", "old 01\n\nfoo", "nonsense"] {
        let (status, _, _) = witness.submit(malformed.to_string()).await;
        assert_eq!(status, 400, "{malformed:?}");
    }

    // kill -9 between requests: what was cosigned survives.
    witness.kill();
    witness.start().await;
    let (status, _, body) = witness.submit(sign_as(ORIGIN, 4, &tree[..9], None)).await;
    assert_eq!(
        (status, body.as_str()),
        (409, "8\n"),
        "the cosigned size survived kill -9"
    );
    // A second line by the trusted key with a bad signature: 403, though the first is
    // good (tlog-witness; signed_note alone would skip the repeat).
    let log_line = honest.rsplit_once("\n\n").unwrap().1.to_string();
    let (line_head, line_b64) = log_line.trim_end().rsplit_once(' ').unwrap();
    let mut bad_sig = B64.decode(line_b64).unwrap();
    bad_sig[10] ^= 1;
    let repeated = format!("{honest}{line_head} {}\n", B64.encode(&bad_sig));
    let (status, _, body) = witness.submit(repeated).await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("does not verify"), "{body}");
    // A line by a key the witness does not know is ignored, and not kept.
    let with_stranger = format!("{honest}\u{2014} stranger.test {}\n", B64.encode([7u8; 40]));
    let (status, _, body) = witness.submit(with_stranger).await;
    assert_eq!(status, 200, "{body}");

    // Monitoring: the latest cosigned checkpoint, with both signatures.
    let origin_hash = hex::encode(Sha256::digest(ORIGIN.as_bytes()));
    let monitored = reqwest::get(format!(
        "http://{}/{origin_hash}/checkpoint",
        witness.listen
    ))
    .await
    .unwrap()
    .text()
    .await
    .unwrap();
    assert!(
        monitored.starts_with(&format!("{ORIGIN}\n9\n")),
        "{monitored}"
    );
    assert!(monitored.contains("\u{2014} witness.test/w1 "));
    assert!(
        !monitored.contains("stranger.test"),
        "the witness served a line it never checked: {monitored}"
    );
    let unknown = reqwest::get(format!(
        "http://{}/{}/checkpoint",
        witness.listen,
        "00".repeat(32)
    ))
    .await
    .unwrap();
    assert_eq!(unknown.status().as_u16(), 404);

    // Evidence: the rewritten-history and same-size-other-root requests were kept.
    witness.kill();
    let seed =
        lineage_core::keys::read_secret_file(&witness.dir.path().join("witness.key")).unwrap();
    let state =
        lineage_checkpointer::witness::Witness::open(witness.dir.path(), "witness.test/w1", seed)
            .unwrap();
    let evidence = state.evidence().unwrap();
    assert_eq!(evidence.len(), 2, "{evidence:#?}");
    assert!(evidence
        .iter()
        .any(|e| e.contains(&format!("{ORIGIN}\n10\n"))));
    assert!(evidence
        .iter()
        .any(|e| e.contains(&format!("{ORIGIN}\n8\n"))));
}

/// A witness whose log nobody reads goes on answering. Its stderr is a pipe that is never
/// read (full after 64 KiB), and each refused add-checkpoint is logged: every one of a
/// flood of them is answered (before, the witness stopped answering once the pipe was
/// full: a log line written in place waits for room).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_witness_whose_log_is_not_read_goes_on_answering() {
    let log_key = AuditKey::from_seed([12; 32]);
    let mut witness = Witness::setup(&NoteSigner::new(ORIGIN, &log_key).unwrap().vkey());
    // Piped and kept in the child, never read.
    witness.start_logging_to(Stdio::piped()).await;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let url = format!("http://{}/add-checkpoint", witness.listen);
    // Some 150 bytes of log each: 3,000 are seven times the pipe.
    for n in 0..3000 {
        let reply = http
            .post(&url)
            .body(format!("old 0\n\nnot a checkpoint {n}\n"))
            .send()
            .await
            .unwrap_or_else(|e| panic!("refused add-checkpoint {n} unanswered: {e}"));
        assert!(reply.status().is_client_error(), "{}", reply.status());
    }
}

#[test]
fn it_refuses_to_sign_when_its_clock_went_backwards() {
    let dir = tempfile::tempdir().unwrap();
    let witness =
        lineage_checkpointer::witness::Witness::open(dir.path(), "witness.test/w2", [5; 32])
            .unwrap();
    let log_key = AuditKey::from_seed([12; 32]);
    witness
        .add_log(ORIGIN, &NoteSigner::new(ORIGIN, &log_key).unwrap().vkey())
        .unwrap();
    let tree = leaves(6, "clock");
    let first = witness
        .add_checkpoint(
            request(&log_key, ORIGIN, 0, &tree[..2], None).as_bytes(),
            || 2_000_000_000,
        )
        .unwrap();
    assert_eq!(first.status, 200, "{}", first.body);
    let back = witness
        .add_checkpoint(
            request(&log_key, ORIGIN, 2, &tree[..4], None).as_bytes(),
            || 1_999_999_999,
        )
        .unwrap();
    assert_eq!(back.status, 500);
    assert!(back.body.contains("clock went backwards"));
    assert_eq!(
        witness.log_state(ORIGIN).unwrap().unwrap().size,
        2,
        "nothing was cosigned"
    );
    let later = witness
        .add_checkpoint(
            request(&log_key, ORIGIN, 2, &tree[..4], None).as_bytes(),
            || 2_000_000_001,
        )
        .unwrap();
    assert_eq!(later.status, 200);
    // A log is never re-added under another key.
    assert!(witness
        .add_log(
            ORIGIN,
            &NoteSigner::new(ORIGIN, &AuditKey::from_seed([13; 32]))
                .unwrap()
                .vkey()
        )
        .is_err());
}

/// The container way to run it: the key from a secret file, the log trusted by a start
/// flag (no `add-log` step, no shell), again at every restart without losing state, and
/// a start refused when the flag names a trusted origin with another key.
#[tokio::test]
async fn trusting_a_log_at_start_with_a_key_file() {
    let keys = tempfile::tempdir().unwrap();
    let key_file = keys.path().join("witness.key");
    let data = tempfile::tempdir().unwrap();
    let out = witness_cmd(data.path())
        .arg("--key-file")
        .arg(&key_file)
        .arg("keygen")
        .output()
        .unwrap();
    assert!(out.status.success());
    let vkey = String::from_utf8(out.stdout).unwrap().trim().to_string();
    assert_eq!(
        std::fs::read_dir(data.path()).unwrap().count(),
        0,
        "keygen with --key-file writes only the key"
    );
    let log_key = AuditKey::from_seed([21; 32]);
    let log_vkey = NoteSigner::new(ORIGIN, &log_key).unwrap().vkey();
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut witness = Witness {
        child: None,
        dir: data,
        listen: format!("127.0.0.1:{port}"),
        vkey,
    };
    let start_with = |witness: &Witness, trusted: &str| {
        witness_cmd(witness.dir.path())
            .arg("--key-file")
            .arg(&key_file)
            .args(["--trust-log", trusted, "--listen", &witness.listen])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let wait_listening = async |witness: &Witness| {
        let start = Instant::now();
        while tokio::net::TcpStream::connect(&witness.listen)
            .await
            .is_err()
        {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "witness did not start"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let tree = leaves(4, "trust-flag");

    witness.child = Some(start_with(&witness, &log_vkey));
    wait_listening(&witness).await;
    let (status, _, body) = witness
        .submit(request(&log_key, ORIGIN, 0, &tree[..2], None))
        .await;
    assert_eq!(status, 200, "{body}");
    let text2 = Checkpoint {
        origin: ORIGIN.into(),
        size: 2,
        root: root(&tree[..2]),
    }
    .text();
    check_cosignature(&body, &witness.vkey, &text2);
    witness.kill();

    // The same flag at the next start is a no-op: what was cosigned stays.
    witness.child = Some(start_with(&witness, &log_vkey));
    wait_listening(&witness).await;
    let (status, _, body) = witness
        .submit(request(&log_key, ORIGIN, 0, &tree[..4], None))
        .await;
    assert_eq!(status, 409, "the witness remembers size 2: {body}");
    assert_eq!(body.trim(), "2");
    witness.kill();

    // Another key for the same origin: the start is refused, clearly.
    let other = NoteSigner::new(ORIGIN, &AuditKey::from_seed([22; 32]))
        .unwrap()
        .vkey();
    let refused = start_with(&witness, &other).wait_with_output().unwrap();
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("already configured with another key"),
        "{stderr}"
    );
    // And a value that is not a verifier key at all.
    let garbage = start_with(&witness, "not-a-key")
        .wait_with_output()
        .unwrap();
    assert!(!garbage.status.success());
    assert!(String::from_utf8_lossy(&garbage.stderr).contains("--trust-log"));
}

/// `keygen` stores the name beside the key: `vkey` without `--name` prints the same
/// vkey (it used to print one for the default name, and verification then found no
/// cosignature), and a different `--name` is refused rather than changing the vkey.
#[test]
fn the_witness_name_is_stored_with_its_key() {
    let dir = tempfile::tempdir().unwrap();
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_lineage-witness"))
            .arg("--data-dir")
            .arg(dir.path())
            .args(args)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).trim().to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let (ok, made, err) = run(&["--name", "witness.test/named", "keygen"]);
    assert!(ok, "{err}");
    assert!(made.starts_with("witness.test/named+"), "{made}");
    for args in [&["vkey"][..], &["--name", "witness.test/named", "vkey"]] {
        let (ok, vkey, err) = run(args);
        assert!(ok, "{args:?}: {err}");
        assert_eq!(vkey, made, "{args:?}");
    }
    let (ok, _, err) = run(&["--name", "witness.test/other", "vkey"]);
    assert!(!ok, "a different name must be refused");
    assert!(err.contains("witness.test/named"), "{err}");
    // A second keygen never overwrites the key (or its name).
    let (ok, _, _) = run(&["--name", "witness.test/other", "keygen"]);
    assert!(!ok);
    assert_eq!(run(&["vkey"]).1, made);
    // An invalid name is refused before any key is made.
    let fresh = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_lineage-witness"))
        .arg("--data-dir")
        .arg(fresh.path())
        .args(["--name", "bad name+", "keygen"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(!fresh.path().join("witness.key").exists());
}

/// Unproven evidence is bounded: once `MAX_UNPROVEN_EVIDENCE` requests are kept, more
/// larger checkpoints with failing proofs are still refused (422) but add no row; a fork
/// is kept all the same, and the witness goes on cosigning the honest log.
#[test]
fn evidence_is_kept_up_to_its_bound() {
    use lineage_checkpointer::witness::{Witness, MAX_UNPROVEN_EVIDENCE};
    let dir = tempfile::tempdir().unwrap();
    let witness = Witness::open(dir.path(), "witness.test/w3", [6; 32]).unwrap();
    let log_key = AuditKey::from_seed([13; 32]);
    witness
        .add_log(ORIGIN, &NoteSigner::new(ORIGIN, &log_key).unwrap().vkey())
        .unwrap();
    let tree = leaves(4, "bounded");
    let clock = || 2_000_000_000;
    let first = witness
        .add_checkpoint(
            request(&log_key, ORIGIN, 0, &tree[..2], None).as_bytes(),
            clock,
        )
        .unwrap();
    assert_eq!(first.status, 200, "{}", first.body);
    // Each a checkpoint the log signed, larger than the cosigned one, that no proof
    // joins to it: a distinct note each time.
    for n in 0..MAX_UNPROVEN_EVIDENCE + 5 {
        let forged = leaves(3, &format!("fork-{n}"));
        let reply = witness
            .add_checkpoint(
                request(&log_key, ORIGIN, 2, &forged, Some(vec![[1u8; 32]])).as_bytes(),
                clock,
            )
            .unwrap();
        assert_eq!(reply.status, 422, "{}", reply.body);
    }
    assert_eq!(
        witness.evidence().unwrap().len() as u64,
        MAX_UNPROVEN_EVIDENCE
    );
    // A fork (the cosigned size, another root) is kept all the same.
    let fork = witness
        .add_checkpoint(
            request(&log_key, ORIGIN, 2, &leaves(2, "fork"), Some(Vec::new())).as_bytes(),
            clock,
        )
        .unwrap();
    assert_eq!(fork.status, 422, "{}", fork.body);
    let evidence = witness.evidence().unwrap();
    assert_eq!(evidence.len() as u64, MAX_UNPROVEN_EVIDENCE + 1);
    assert!(
        evidence[0].contains(&format!("{ORIGIN}\n2\n")),
        "{}",
        evidence[0]
    );
    let honest = witness
        .add_checkpoint(request(&log_key, ORIGIN, 2, &tree, None).as_bytes(), clock)
        .unwrap();
    assert_eq!(honest.status, 200, "{}", honest.body);
}
