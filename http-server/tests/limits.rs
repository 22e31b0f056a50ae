//! The accept loop on its own, over real sockets on 127.0.0.1: the connection cap evicts
//! the quietest idle connection for a new one, silent heads, idle keep-alives and
//! trickled bodies are closed, each close is reported to `Events` with its reason, and
//! shutdown returns. (The node's and the witness's suites test the same rules through
//! their own binaries.)

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::routing::{get, post};
use axum::Router;
use lineage_http_server::{serve, Events, Limits, NoTls};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const MAX_CONNECTIONS: usize = 8;
const HEADER_TIMEOUT: Duration = Duration::from_millis(300);
const IDLE_TIMEOUT: Duration = Duration::from_millis(600);
/// A liveness bound, not a timing claim: what must be closed is closed long before it.
const CLOSE_BOUND: Duration = Duration::from_secs(20);

/// What the server reported.
#[derive(Default)]
struct Recorded {
    most_open: AtomicUsize,
    closed: Mutex<Vec<&'static str>>,
}

impl Recorded {
    fn count(&self, reason: &str) -> usize {
        let closed = self.closed.lock().unwrap_or_else(|p| p.into_inner());
        closed.iter().filter(|r| **r == reason).count()
    }
}

impl Events for Recorded {
    fn open_connections(&self, open: usize) {
        self.most_open.fetch_max(open, Ordering::SeqCst);
    }

    fn connection_closed(&self, reason: &'static str) {
        self.closed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(reason);
    }
}

/// Reads until the server closes the connection: whether it did within the bound.
async fn closed(stream: &mut TcpStream) -> bool {
    let deadline = tokio::time::Instant::now() + CLOSE_BOUND;
    let mut buf = [0u8; 1024];
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0) | Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}

/// `GET /ok` on `stream`, kept alive: the status line.
async fn get_ok(stream: &mut TcpStream) -> String {
    stream
        .write_all(b"GET /ok HTTP/1.1\r\nHost: test\r\n\r\n")
        .await
        .expect("write");
    let mut answer = Vec::new();
    let mut buf = [0u8; 1024];
    while !answer.ends_with(b"ok") {
        let n = tokio::time::timeout(CLOSE_BOUND, stream.read(&mut buf))
            .await
            .expect("an answer")
            .expect("read");
        assert!(n > 0, "closed mid-answer");
        answer.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&answer).into_owned();
    text.lines().next().unwrap_or_default().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_cap_evicts_and_silent_idle_and_trickled_connections_are_closed() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let router = Router::new()
        .route("/ok", get(|| async { "ok" }))
        .route("/echo", post(|body: Bytes| async move { body }));
    let recorded = Arc::new(Recorded::default());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let limits = Limits::new(Some(MAX_CONNECTIONS), HEADER_TIMEOUT, IDLE_TIMEOUT);
    let server = tokio::spawn(serve(
        listener,
        router,
        limits,
        recorded.clone(),
        None::<NoTls>,
        async {
            let _ = stopped.await;
        },
    ));

    // Three times the cap of silent connections, then a request that gets in.
    let mut silent = Vec::new();
    for _ in 0..3 * MAX_CONNECTIONS {
        silent.push(TcpStream::connect(&addr).await.expect("connect"));
    }
    let mut fresh = TcpStream::connect(&addr).await.expect("connect");
    assert_eq!(get_ok(&mut fresh).await, "HTTP/1.1 200 OK");
    assert!(recorded.most_open.load(Ordering::SeqCst) <= MAX_CONNECTIONS);
    assert!(
        recorded.count("evicted") >= 2 * MAX_CONNECTIONS,
        "evicted: {}",
        recorded.count("evicted")
    );

    // A body promised long and sent a byte at a time, each within the header timeout.
    let mut trickled = TcpStream::connect(&addr).await.expect("connect");
    trickled
        .write_all(b"POST /echo HTTP/1.1\r\nHost: test\r\nContent-Length: 100000\r\n\r\n")
        .await
        .expect("write");
    let (mut trickled_read, mut trickled_write) = trickled.into_split();
    let trickle = tokio::spawn(async move {
        for _ in 0..(CLOSE_BOUND.as_millis() / 100) {
            if trickled_write.write_all(b"x").await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });

    for (i, stream) in silent.iter_mut().enumerate() {
        assert!(closed(stream).await, "silent connection {i} stayed open");
    }
    assert!(closed(&mut fresh).await, "the fresh connection stayed open");
    // With the crowd gone, a keep-alive connection answered once and left idle.
    let mut idle = TcpStream::connect(&addr).await.expect("connect");
    assert_eq!(get_ok(&mut idle).await, "HTTP/1.1 200 OK");
    assert!(closed(&mut idle).await, "an idle keep-alive stayed open");
    let mut buf = [0u8; 1024];
    let trickle_closed = tokio::time::timeout(CLOSE_BOUND, async {
        loop {
            match trickled_read.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    trickle.abort();
    assert!(
        trickle_closed.is_ok(),
        "a trickled body held its connection"
    );
    for reason in ["header_timeout", "idle", "body_timeout"] {
        assert!(
            recorded.count(reason) >= 1,
            "no close for {reason}: {:?}",
            recorded.closed.lock().unwrap_or_else(|p| p.into_inner())
        );
    }

    // Shutdown: the server returns once open requests are done (none here).
    let _ = stop.send(());
    tokio::time::timeout(CLOSE_BOUND, server)
        .await
        .expect("serve returned after shutdown")
        .expect("serve task");
}
