//! Anyone may connect to a witness. Against the real `lineage-witness` process: silent
//! connections past its cap do not keep a fresh request out, and silent, trickled and idle
//! connections are all closed (before this server, none of them ever was).

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const MAX_CONNECTIONS: usize = 20;
const HEADER_TIMEOUT_MS: u64 = 500;
const IDLE_TIMEOUT_MS: u64 = 1_000;
/// A liveness bound, not a timing claim: a connection the witness must close is closed
/// long before this (it checks each one at a quarter of its shortest bound).
const CLOSE_BOUND: Duration = Duration::from_secs(20);
/// Any origin hash: no witness has cosigned anything for it.
const MONITOR_PATH: &str =
    "/0000000000000000000000000000000000000000000000000000000000000000/checkpoint";

struct Witness {
    child: Child,
    listen: String,
    _dir: tempfile::TempDir,
}

impl Drop for Witness {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn start_witness() -> Witness {
    let dir = tempfile::tempdir().unwrap();
    let witness = || {
        let mut command = Command::new(env!("CARGO_BIN_EXE_lineage-witness"));
        command.arg("--data-dir").arg(dir.path());
        command
    };
    let keygen = witness().arg("keygen").output().unwrap();
    assert!(
        keygen.status.success(),
        "{}",
        String::from_utf8_lossy(&keygen.stderr)
    );
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let listen = format!("127.0.0.1:{port}");
    let child = witness()
        .args(["--listen", &listen])
        .args(["--max-connections", &MAX_CONNECTIONS.to_string()])
        .args(["--http-header-timeout-ms", &HEADER_TIMEOUT_MS.to_string()])
        .args(["--http-idle-timeout-ms", &IDLE_TIMEOUT_MS.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while TcpStream::connect(&listen).await.is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "witness did not start"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Witness {
        child,
        listen,
        _dir: dir,
    }
}

/// Reads until the witness closes the connection (EOF or reset): whether it did within
/// [`CLOSE_BOUND`].
async fn closed_within_bound(stream: &mut TcpStream) -> bool {
    let deadline = tokio::time::Instant::now() + CLOSE_BOUND;
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0) | Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}

/// `GET` of the monitoring path on `stream`, kept alive: the status line of the answer.
async fn monitor_on(stream: &mut TcpStream) -> String {
    let request = format!("GET {MONITOR_PATH} HTTP/1.1\r\nHost: witness\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    let mut buf = [0u8; 1024];
    let deadline = tokio::time::Instant::now() + CLOSE_BOUND;
    loop {
        let n = tokio::time::timeout_at(deadline, stream.read(&mut buf))
            .await
            .expect("an answer")
            .unwrap();
        assert!(n > 0, "closed mid-answer");
        answer.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&answer).into_owned();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length: usize = head
                .lines()
                .find_map(|l| {
                    let (name, value) = l.split_once(':')?;
                    name.eq_ignore_ascii_case("content-length")
                        .then(|| value.trim().parse().ok())?
                })
                .expect("a content-length");
            if body.len() >= length {
                return head.lines().next().unwrap_or_default().to_string();
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn silent_trickled_and_idle_connections_are_closed_and_the_cap_lets_a_fresh_one_in() {
    let witness = start_witness().await;
    let addr = witness.listen.as_str();

    // Five times the cap of silent connections: each new one evicts the quietest.
    let mut silent = Vec::new();
    for _ in 0..5 * MAX_CONNECTIONS {
        silent.push(TcpStream::connect(addr).await.unwrap());
    }
    let mut fresh = TcpStream::connect(addr).await.unwrap();
    assert_eq!(monitor_on(&mut fresh).await, "HTTP/1.1 404 Not Found");

    // A body sent a byte at a time, each within the header timeout: only the whole-body
    // deadline (six header timeouts) ends it. The trickle runs past the close bound.
    let mut trickled = TcpStream::connect(addr).await.unwrap();
    trickled
        .write_all(
            b"POST /add-checkpoint HTTP/1.1\r\nHost: witness\r\nContent-Length: 1000\r\n\r\n",
        )
        .await
        .unwrap();
    let trickle = tokio::spawn(async move {
        let gap = Duration::from_millis(HEADER_TIMEOUT_MS / 3);
        let bytes = (CLOSE_BOUND.as_millis() / gap.as_millis()) as usize + 10;
        for _ in 0..bytes {
            if trickled.write_all(b"x").await.is_err() {
                return true;
            }
            tokio::time::sleep(gap).await;
        }
        // Still accepted after the whole trickle: the body deadline never fired.
        false
    });

    // Every silent connection still open is closed: no head arrived in time, or it
    // was evicted.
    for (i, stream) in silent.iter_mut().enumerate() {
        assert!(
            closed_within_bound(stream).await,
            "silent connection {i} stayed open"
        );
    }
    // The fresh connection answered once and then sat idle: closed too.
    assert!(
        closed_within_bound(&mut fresh).await,
        "an idle keep-alive connection stayed open"
    );
    assert!(
        trickle.await.unwrap(),
        "a trickled body held its connection past the whole-body deadline"
    );

    // After all that the witness still answers.
    let mut after = TcpStream::connect(addr).await.unwrap();
    assert_eq!(monitor_on(&mut after).await, "HTTP/1.1 404 Not Found");
}
