//! The HTTP accept loop of the node, the witness and the checkpointer's metrics port:
//! every connection is served in its own task, with bounded waits, and the number of open
//! connections stays below the process's open-file limit.
//!
//! `axum::serve` waits forever for a silent client and accepts until `accept` fails with
//! "Too many open files", after which it stops serving peers and `/healthz` alike. Here:
//! - **A request head has [`Limits::header_timeout`]** from its first byte (for a new
//!   connection, from the accept) to arrive complete. A request body may not stall for
//!   longer than that between bytes either, and must arrive whole within
//!   [`BODY_TIMEOUT_FACTOR`] times it (a minute by default: a 2 MiB body at 35 KB/s), so
//!   a body sent a byte at a time cannot hold its connection, which is never evictable
//!   while its request is in progress, for good.
//! - **An idle keep-alive connection is closed after [`Limits::idle_timeout`]** with no
//!   byte in either direction. A request in progress (a commit wait, a long admin call)
//!   is never idle: its handler bounds it.
//! - **At most [`Limits::max_connections`] are open.** At the cap, the connection that has
//!   been quiet longest, among those with no request in progress, is closed to make room:
//!   a flood of silent connections evicts itself, while a peer's busy Raft connection and
//!   a fresh `/healthz` get in. With nothing to evict, the new connection is closed.
//!
//! - **With TLS, the handshake runs in the connection's own task** (a stalled client
//!   cannot hold up the accept loop) and must finish within the header timeout. A
//!   connection whose first byte does not start a TLS handshake (plain HTTP to the TLS
//!   port) gets `400 this port requires HTTPS` and is closed. The peer's certificate
//!   identity, if it sent one, goes into each request's extensions (what
//!   [`Tls::peer`] makes of its chain).
//!
//! hyper's own header timer also starts while a keep-alive connection waits for its next
//! request, so it would cut idle connections at the header timeout; it is off, and the
//! rules above are kept by one watcher per connection (`watch_connection`) from what the
//! connection's I/O and its service see.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::Router;
use hyper::body::{Frame, Incoming};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tower::ServiceExt;

use rustls::pki_types::CertificateDer;

/// Default [`Limits::header_timeout`].
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// A request body must arrive whole within this many header timeouts.
pub const BODY_TIMEOUT_FACTOR: u32 = 6;
/// Default [`Limits::idle_timeout`]: longer than clients' usual pool idle time would cut
/// their reuse short; reqwest keeps idle connections 90 s, and retries a request whose
/// pooled connection the server closed before the request was written.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// With no `--max-connections`, client connections may use this share of the open-file
/// limit; the rest is for the node's files, its peers and the requests it forwards.
const AUTO_CONNECTION_SHARE: f64 = 0.5;
/// Most a connection's read buffer grows to. hyper's default (about 400 KiB) is what a
/// connection receiving a large body at full speed held until it closed: 200 stalled
/// 2 MB bodies grew a node by 117 MB with it, 28 MB with this.
const READ_BUFFER_BYTES: usize = 64 * 1024;
/// How long after shutdown starts open connections may finish their requests.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// What the server reports about its connections (the node and the checkpointer count
/// them in Prometheus metrics; `()` reports nothing).
pub trait Events: Send + Sync + 'static {
    /// The number of open connections, after one opened or closed.
    fn open_connections(&self, open: usize);
    /// One connection closed by the server, and why (`header_timeout`, `body_timeout`,
    /// `idle`, `evicted`, `refused`, `plaintext_on_tls`, `tls_handshake_timeout`,
    /// `tls_handshake_failed`).
    fn connection_closed(&self, reason: &'static str);
}

impl Events for () {
    fn open_connections(&self, _open: usize) {}
    fn connection_closed(&self, _reason: &'static str) {}
}

/// TLS for the server: the configuration for each new connection (it may change between
/// connections, for reloads) and what a peer's certificate chain says about it.
pub trait Tls: Clone + Send + Sync + 'static {
    /// Put into each request's extensions when the peer sent a certificate.
    type Peer: Clone + Send + Sync + 'static;
    fn config(&self) -> Arc<rustls::ServerConfig>;
    fn peer(&self, chain: Option<&[CertificateDer<'_>]>) -> Option<Self::Peer>;
}

/// Plain HTTP: [`serve`] with `None::<NoTls>`.
#[derive(Clone)]
pub enum NoTls {}

impl Tls for NoTls {
    type Peer = ();
    fn config(&self) -> Arc<rustls::ServerConfig> {
        match *self {}
    }
    fn peer(&self, _chain: Option<&[CertificateDer<'_>]>) -> Option<()> {
        match *self {}
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub max_connections: usize,
    pub header_timeout: Duration,
    pub idle_timeout: Duration,
}

impl Limits {
    /// `max_connections: None` takes a share of the open-file limit (after raising it).
    pub fn new(
        max_connections: Option<usize>,
        header_timeout: Duration,
        idle_timeout: Duration,
    ) -> Limits {
        let max_connections = max_connections
            .unwrap_or_else(|| (open_file_limit() as f64 * AUTO_CONNECTION_SHARE) as usize)
            .max(1);
        Limits {
            max_connections,
            header_timeout,
            idle_timeout,
        }
    }
}

/// Raises the soft open-file limit to the hard one and returns it. A node serving many
/// clients needs more than the 1,024 many systems give a process by default.
pub fn raise_open_file_limit() -> u64 {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut limit = getrlimit(Resource::Nofile);
    // An unlimited hard limit still meets the kernel's nr_open (2^20 by default).
    let target = limit.maximum.unwrap_or(1 << 20);
    if limit.current.is_some_and(|current| current < target) {
        limit.current = Some(target);
        if let Err(e) = setrlimit(Resource::Nofile, limit) {
            tracing::warn!(error = %e, "could not raise the open-file limit");
        }
    }
    open_file_limit()
}

/// The soft open-file limit (`None`, unlimited, counts as a large number).
fn open_file_limit() -> u64 {
    rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .unwrap_or(1 << 20)
}

/// Why a connection was closed by the server (the reason given to
/// [`Events::connection_closed`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Closed {
    HeaderTimeout,
    BodyTimeout,
    Idle,
    Evicted,
    Refused,
    /// Plain HTTP on the TLS port.
    Plaintext,
    TlsHandshakeTimeout,
    TlsHandshakeFailed,
}

impl Closed {
    fn as_str(self) -> &'static str {
        match self {
            Closed::HeaderTimeout => "header_timeout",
            Closed::BodyTimeout => "body_timeout",
            Closed::Idle => "idle",
            Closed::Evicted => "evicted",
            Closed::Refused => "refused",
            Closed::Plaintext => "plaintext_on_tls",
            Closed::TlsHandshakeTimeout => "tls_handshake_timeout",
            Closed::TlsHandshakeFailed => "tls_handshake_failed",
        }
    }
}

/// What the watcher knows about one connection. Times are milliseconds since the server
/// started (`Clock`), so they fit in atomics.
struct Activity {
    /// The last time a byte was read or written.
    last_io: AtomicU64,
    /// When the pending request head's first byte arrived; 0 when none is pending.
    head_started: AtomicU64,
    /// Requests whose service call has started and not yet answered.
    in_flight: AtomicU32,
    /// A request body is being read (from its head until its last frame).
    reading_body: AtomicBool,
    /// When the body being read began (its head arrived).
    body_started: AtomicU64,
    /// Whether any request has completed (before that, the first head is pending).
    served_one: AtomicBool,
    evict: tokio::sync::Notify,
}

#[derive(Clone, Copy)]
struct Clock(Instant);

impl Clock {
    fn now_ms(self) -> u64 {
        // +1 so that 0 can mean "not set".
        self.0.elapsed().as_millis() as u64 + 1
    }
}

enum Admission {
    Room,
    /// Admitted in place of the quietest idle connection.
    Evicted,
    /// At the cap with a request in progress on every connection: not admitted.
    Full,
}

/// The open connections, for the cap and for eviction.
#[derive(Default)]
struct Registry {
    open: Mutex<HashMap<u64, Arc<Activity>>>,
}

impl Registry {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Activity>>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Admits a connection, evicting the quietest idle one at the cap.
    fn admit(&self, id: u64, activity: Arc<Activity>, max: usize) -> Admission {
        let mut open = self.lock();
        let mut admission = Admission::Room;
        if open.len() >= max {
            let quietest = open
                .iter()
                .filter(|(_, a)| a.in_flight.load(Ordering::Relaxed) == 0)
                .min_by_key(|(_, a)| a.last_io.load(Ordering::Relaxed))
                .map(|(id, _)| *id);
            let Some(victim) = quietest else {
                return Admission::Full;
            };
            if let Some(a) = open.remove(&victim) {
                a.evict.notify_one();
                admission = Admission::Evicted;
            }
        }
        open.insert(id, activity);
        admission
    }

    fn remove(&self, id: u64) {
        self.lock().remove(&id);
    }

    fn len(&self) -> usize {
        self.lock().len()
    }
}

/// Serves `router` on `listener` (over TLS with `tls`) until `shutdown` resolves, then
/// lets open requests finish for up to 10 s.
pub async fn serve<T: Tls>(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    events: Arc<dyn Events>,
    tls: Option<T>,
    shutdown: impl Future<Output = ()>,
) {
    let clock = Clock(Instant::now());
    let registry = Arc::new(Registry::default());
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let tasks = TaskCount::default();
    tokio::pin!(shutdown);
    let mut next_id = 0u64;
    let mut accept_errors_logged = 0u32;
    loop {
        let (stream, _peer) = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(e) => {
                    // EMFILE and friends: the cap should prevent them; if another part of
                    // the process used the descriptors up, wait rather than spin.
                    if accept_errors_logged < 10 {
                        tracing::warn!(error = %e, "accept failed");
                        accept_errors_logged += 1;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        next_id += 1;
        let now = clock.now_ms();
        let activity = Arc::new(Activity {
            last_io: AtomicU64::new(now),
            head_started: AtomicU64::new(now),
            in_flight: AtomicU32::new(0),
            reading_body: AtomicBool::new(false),
            body_started: AtomicU64::new(now),
            served_one: AtomicBool::new(false),
            evict: tokio::sync::Notify::new(),
        });
        match registry.admit(next_id, activity.clone(), limits.max_connections) {
            Admission::Room => {}
            Admission::Evicted => events.connection_closed(Closed::Evicted.as_str()),
            Admission::Full => {
                events.connection_closed(Closed::Refused.as_str());
                drop(stream);
                continue;
            }
        }
        events.open_connections(registry.len());
        if let Err(e) = stream.set_nodelay(true) {
            // Answers would wait for Nagle's algorithm and the peer's delayed ACK.
            tracing::debug!(error = %e, "TCP_NODELAY not set");
        }
        let connection = Connection {
            id: next_id,
            activity,
            clock,
            limits,
            registry: registry.clone(),
            events: events.clone(),
        };
        let router = router.clone();
        let stop = stop_rx.clone();
        tasks.spawn(connection.run(stream, router, tls.clone(), stop));
    }
    let _ = stop_tx.send(true);
    let open = registry.len();
    if open > 0 {
        tracing::info!(open, "waiting for open connections to finish");
    }
    tasks.wait(SHUTDOWN_GRACE).await;
}

/// A count of running connection tasks that shutdown can wait on.
#[derive(Clone, Default)]
struct TaskCount {
    running: Arc<(AtomicU64, tokio::sync::Notify)>,
}

impl TaskCount {
    fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) {
        let running = self.running.clone();
        running.0.fetch_add(1, Ordering::SeqCst);
        tokio::spawn(async move {
            // Counted down on drop: a task that panics is done too.
            let _done = OnDrop(move || {
                running.0.fetch_sub(1, Ordering::SeqCst);
                running.1.notify_waiters();
            });
            task.await;
        });
    }

    async fn wait(&self, grace: Duration) {
        let all_done = async {
            loop {
                let notified = self.running.1.notified();
                if self.running.0.load(Ordering::SeqCst) == 0 {
                    return;
                }
                notified.await;
            }
        };
        let _ = tokio::time::timeout(grace, all_done).await;
    }
}

/// Runs a closure when dropped: bookkeeping that must happen even if a task panics.
struct OnDrop<F: FnMut()>(F);

impl<F: FnMut()> Drop for OnDrop<F> {
    fn drop(&mut self) {
        (self.0)();
    }
}

struct Connection {
    id: u64,
    activity: Arc<Activity>,
    clock: Clock,
    limits: Limits,
    registry: Arc<Registry>,
    events: Arc<dyn Events>,
}

impl Connection {
    async fn run<T: Tls>(
        self,
        stream: TcpStream,
        router: Router,
        tls: Option<T>,
        stop: tokio::sync::watch::Receiver<bool>,
    ) {
        let _registered = {
            let (registry, events, id) = (self.registry.clone(), self.events.clone(), self.id);
            OnDrop(move || {
                registry.remove(id);
                events.open_connections(registry.len());
            })
        };
        let tracked = Tracked {
            inner: stream,
            activity: self.activity.clone(),
            clock: self.clock,
        };
        let Some(tls) = tls else {
            return self.serve_http(tracked, router, None::<()>, stop).await;
        };
        // Evicted at the cap while still handshaking: the socket closes now, so silent
        // connections cannot hold descriptors past the cap for a handshake timeout each.
        let handshake = tokio::select! {
            shaken = self.handshake(tracked, &tls) => shaken,
            () = self.activity.evict.notified() => return,
        };
        match handshake {
            Ok((stream, peer)) => self.serve_http(stream, router, peer, stop).await,
            Err(reason) => self.events.connection_closed(reason.as_str()),
        }
    }

    /// The TLS handshake, within the header timeout; plain HTTP gets its 400 here.
    async fn handshake<T: Tls>(
        &self,
        mut tracked: Tracked,
        tls: &T,
    ) -> Result<(tokio_rustls::server::TlsStream<Tracked>, Option<T::Peer>), Closed> {
        let deadline = tokio::time::Instant::now() + self.limits.header_timeout;
        let mut first = [0u8; 1];
        match tokio::time::timeout_at(deadline, tracked.inner.peek(&mut first)).await {
            Err(_) => return Err(Closed::TlsHandshakeTimeout),
            Ok(Ok(0) | Err(_)) => return Err(Closed::TlsHandshakeFailed),
            Ok(Ok(_)) => {}
        }
        // Every TLS connection opens with a handshake record (content type 22).
        if first[0] != 0x16 {
            refuse_plaintext(&mut tracked.inner).await;
            return Err(Closed::Plaintext);
        }
        let acceptor = tokio_rustls::TlsAcceptor::from(tls.config());
        match tokio::time::timeout_at(deadline, acceptor.accept(tracked)).await {
            Err(_) => Err(Closed::TlsHandshakeTimeout),
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "TLS handshake failed");
                Err(Closed::TlsHandshakeFailed)
            }
            Ok(Ok(stream)) => {
                let peer = tls.peer(stream.get_ref().1.peer_certificates());
                Ok((stream, peer))
            }
        }
    }

    async fn serve_http<S, P>(
        self,
        stream: S,
        router: Router,
        peer: Option<P>,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
        P: Clone + Send + Sync + 'static,
    {
        let io = TokioIo::new(stream);
        let service = {
            let activity = self.activity.clone();
            let clock = self.clock;
            hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
                let activity = activity.clone();
                let router = router.clone();
                let peer = peer.clone();
                async move {
                    activity.head_started.store(0, Ordering::Relaxed);
                    activity.in_flight.fetch_add(1, Ordering::Relaxed);
                    // Counted out even if the handler panics, or the slot would stay
                    // busy (never evictable) for good.
                    let _request_done = {
                        let activity = activity.clone();
                        OnDrop(move || {
                            activity.reading_body.store(false, Ordering::Relaxed);
                            activity.in_flight.fetch_sub(1, Ordering::Relaxed);
                            activity.served_one.store(true, Ordering::Relaxed);
                            activity.last_io.store(clock.now_ms(), Ordering::Relaxed);
                        })
                    };
                    let has_body = !hyper::body::Body::is_end_stream(request.body());
                    activity
                        .body_started
                        .store(clock.now_ms(), Ordering::Relaxed);
                    activity.reading_body.store(has_body, Ordering::Relaxed);
                    let mut request = request.map(|body| {
                        Body::new(TrackedBody {
                            inner: body,
                            activity: activity.clone(),
                        })
                    });
                    if let Some(peer) = peer {
                        request.extensions_mut().insert(peer);
                    }
                    router.oneshot(request).await
                }
            })
        };
        let mut http = hyper::server::conn::http1::Builder::new();
        http.timer(TokioTimer::new())
            .header_read_timeout(None)
            .max_buf_size(READ_BUFFER_BYTES);
        let connection = http.serve_connection(io, service);
        tokio::pin!(connection);
        let mut stopping = false;
        let closed = loop {
            let check_in = self.next_check();
            tokio::select! {
                result = connection.as_mut() => {
                    if let Err(e) = result {
                        tracing::debug!(error = %e, "connection ended with an error");
                    }
                    break None;
                }
                () = tokio::time::sleep(check_in) => {
                    if let Some(reason) = self.overdue() {
                        break Some(reason);
                    }
                }
                () = self.activity.evict.notified() => {
                    // Chosen while idle; a request that started since finishes first.
                    if self.activity.in_flight.load(Ordering::Relaxed) == 0 {
                        break None;
                    }
                    stopping = true;
                    connection.as_mut().graceful_shutdown();
                }
                _ = stop.changed(), if !stopping => {
                    stopping = true;
                    connection.as_mut().graceful_shutdown();
                }
            }
        };
        // Dropping the connection closes the socket (and `_registered` frees its slot).
        if let Some(reason) = closed {
            self.events.connection_closed(reason.as_str());
        }
    }

    /// The rule this connection breaks now, if any.
    fn overdue(&self) -> Option<Closed> {
        let a = &self.activity;
        let now = self.clock.now_ms();
        let header_ms = self.limits.header_timeout.as_millis() as u64;
        let idle_ms = self.limits.idle_timeout.as_millis() as u64;
        let last_io = a.last_io.load(Ordering::Relaxed);
        if a.in_flight.load(Ordering::Relaxed) > 0 {
            let body_ms = header_ms.saturating_mul(u64::from(BODY_TIMEOUT_FACTOR));
            let body_late = a.reading_body.load(Ordering::Relaxed)
                && (now.saturating_sub(last_io) >= header_ms
                    || now.saturating_sub(a.body_started.load(Ordering::Relaxed)) >= body_ms);
            return body_late.then_some(Closed::BodyTimeout);
        }
        let head_started = a.head_started.load(Ordering::Relaxed);
        if head_started != 0 && now.saturating_sub(head_started) >= header_ms {
            return Some(Closed::HeaderTimeout);
        }
        (head_started == 0 && now.saturating_sub(last_io) >= idle_ms).then_some(Closed::Idle)
    }

    /// How long until a rule could next be broken.
    fn next_check(&self) -> Duration {
        let shortest = self.limits.header_timeout.min(self.limits.idle_timeout);
        // Checking at a quarter of the shortest bound closes within 1.25x of it.
        (shortest / 4).max(Duration::from_millis(10))
    }
}

/// Answers plain HTTP on the TLS port with a 400 and closes: the request is drained
/// (briefly) after the answer is sent and the write side shut, so the client reads the
/// answer rather than a reset.
async fn refuse_plaintext(stream: &mut TcpStream) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const BODY: &str = r#"{"code":"https_required","error":"this port requires HTTPS"}"#;
    let answer = format!(
        "HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{BODY}",
        BODY.len()
    );
    let sent = async {
        stream.write_all(answer.as_bytes()).await?;
        stream.shutdown().await?;
        let mut sink = [0u8; 4096];
        while stream.read(&mut sink).await? > 0 {}
        io::Result::Ok(())
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), sent).await;
}

/// The socket, recording when bytes move and when a new request head begins.
struct Tracked {
    inner: TcpStream,
    activity: Arc<Activity>,
    clock: Clock,
}

impl AsyncRead for Tracked {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            let now = self.clock.now_ms();
            let a = &self.activity;
            a.last_io.store(now, Ordering::Relaxed);
            let between_requests =
                a.in_flight.load(Ordering::Relaxed) == 0 && a.served_one.load(Ordering::Relaxed);
            if between_requests {
                // The first byte of the next head: its header timeout starts now. (A
                // new connection's started at the accept.)
                let _ =
                    a.head_started
                        .compare_exchange(0, now, Ordering::Relaxed, Ordering::Relaxed);
            }
        }
        polled
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.activity
                .last_io
                .store(self.clock.now_ms(), Ordering::Relaxed);
        }
        polled
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// A request body that says when it has been read to its end.
struct TrackedBody {
    inner: Incoming,
    activity: Arc<Activity>,
}

impl hyper::body::Body for TrackedBody {
    type Data = hyper::body::Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None | Some(Err(_)))) || self.inner.is_end_stream() {
            self.activity.reading_body.store(false, Ordering::Relaxed);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for TrackedBody {
    fn drop(&mut self) {
        // A handler that never reads its body (or stops early) is not reading it.
        self.activity.reading_body.store(false, Ordering::Relaxed);
    }
}
