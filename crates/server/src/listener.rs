//! The daemon's HTTP listener: one accept loop serving the API and the sandbox port proxy
//! (HTTP/1.1, h2c, upgrades) with the limits that keep clients, authenticated or not, from
//! holding the daemon's descriptors.
//!
//! - A cap on open connections in total and per source address (IPv4 address, IPv6 /64);
//!   loopback clients count like any other. A connection over a cap gets a short 503 and
//!   is closed at once, without the accept loop waiting on it. On HTTP/2 every request
//!   also takes a place of its own while it lasts (an upgraded stream until it ends): one
//!   connection carries up to 200 requests at once, and each may hold a descriptor of the
//!   daemon's (its connection into a sandbox or to an agent). One over a cap gets a 503.
//! - A header-read timeout: a connection must deliver its first request's head within it
//!   from being accepted, and a later request's head within it of that request's first
//!   byte.
//! - An idle timeout: a connection with no request in flight and no new request begun is
//!   closed after it. A request is in flight from its head until its response body is
//!   finished or dropped, so silent streams (command output, SSE, Connect streams) are
//!   never cut. An upgraded connection (WebSocket, h2 CONNECT) leaves these timers; its
//!   descriptor still counts against the caps until it is closed.
//!
//! hyper's own `header_read_timeout` (hyper 1.12) arms when the connection starts waiting
//! for a head, which for a kept-alive HTTP/1.1 connection is as soon as the previous
//! response is written: used at the header timeout it would also close idle keep-alive
//! connections after that time. hyper-util's protocol detection reads the first bytes
//! before hyper's timer exists at all, and HTTP/2 has no such timer. So the timers above
//! are the listener's own, and hyper's runs at header + idle timeout, a bound that a
//! connection only reaches if the listener's bookkeeping were wrong.

use crate::config::ConfigError;
use axum::Router;
use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, Version};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use parking_lot::Mutex;
use serde::Deserialize;
use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// The `[http]` section of the config file: limits of the HTTP listener.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpConfig {
    /// Seconds a client has to send a request's head (default 10).
    pub header_read_timeout_secs: u64,
    /// Seconds a connection may sit with no request in flight (default 60).
    pub idle_timeout_secs: u64,
    /// Open connections (and HTTP/2 requests) at most, all clients together. Unset: 8192,
    /// or a quarter of the daemon's descriptor limit when that is smaller; a value set
    /// here is used as it is.
    pub max_connections: Option<usize>,
    /// Open connections at most from one IPv4 address or IPv6 /64 (default 512).
    pub max_connections_per_ip: usize,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            header_read_timeout_secs: 10,
            idle_timeout_secs: 60,
            max_connections: None,
            max_connections_per_ip: 512,
        }
    }
}

impl HttpConfig {
    /// Rejects zero timeouts and caps, which would refuse every client, and timeouts
    /// beyond a week.
    pub fn check(&self) -> Result<(), ConfigError> {
        const WEEK: u64 = 7 * 24 * 3600;
        for (name, secs) in [
            (
                "http.header_read_timeout_secs",
                self.header_read_timeout_secs,
            ),
            ("http.idle_timeout_secs", self.idle_timeout_secs),
        ] {
            if !(1..=WEEK).contains(&secs) {
                return Err(ConfigError::OutOfRange {
                    name,
                    min: 1,
                    max: WEEK,
                });
            }
        }
        for (name, n) in [
            ("http.max_connections", self.max_connections.unwrap_or(1)),
            ("http.max_connections_per_ip", self.max_connections_per_ip),
        ] {
            if n == 0 {
                return Err(ConfigError::Zero { name });
            }
        }
        Ok(())
    }

    fn settings(&self) -> Settings {
        Settings {
            timeouts: Timeouts {
                header: Duration::from_secs(self.header_read_timeout_secs),
                idle: Duration::from_secs(self.idle_timeout_secs),
            },
            max_connections: total_cap(self.max_connections, fd_limit()),
            max_connections_per_ip: self.max_connections_per_ip,
        }
    }
}

/// The default total cap.
const MAX_CONNECTIONS: usize = 8192;

/// The most an HTTP/1 connection buffers, and so the longest request head (a longer one
/// gets 431). hyper's default, ~400 KB, let every slow head of an unauthenticated client
/// hold that much of the daemon's memory until the header timeout: 500 of them took
/// 196 MiB. Real heads are a few KB; HTTP/2's header lists are capped at 16 KB.
const MAX_HTTP1_BUFFER: usize = 64 * 1024;

fn fd_limit() -> Option<u64> {
    use nix::sys::resource::{Resource, getrlimit};
    getrlimit(Resource::RLIMIT_NOFILE)
        .ok()
        .map(|(soft, _)| soft)
}

/// The total cap: by default at most a quarter of the descriptor limit. A place can cost
/// two descriptors (a proxied request holds its connection into the sandbox as well), so
/// clients take at most half, the rest being for sandboxes, agents, the egress proxy and
/// the store. A configured value is kept, with a warning if it leaves the daemon too few.
fn total_cap(configured: Option<usize>, fd_limit: Option<u64>) -> usize {
    let quarter = fd_limit.map(|n| usize::try_from(n / 4).unwrap_or(usize::MAX).max(1));
    match (configured, quarter) {
        (None, Some(quarter)) => MAX_CONNECTIONS.min(quarter),
        (None, None) => MAX_CONNECTIONS,
        (Some(n), Some(quarter)) if n > quarter => {
            tracing::warn!(
                max_connections = n,
                fd_limit = fd_limit.unwrap_or(0),
                "http.max_connections is above a quarter of the open file limit: clients \
                 can run the daemon out of descriptors"
            );
            n
        }
        (Some(n), _) => n,
    }
}

#[derive(Debug, Clone, Copy)]
struct Timeouts {
    header: Duration,
    idle: Duration,
}

#[derive(Debug, Clone, Copy)]
struct Settings {
    timeouts: Timeouts,
    max_connections: usize,
    max_connections_per_ip: usize,
}

/// Serves `app` on `listener` until `shutdown` completes, then stops accepting, lets the
/// open connections finish their requests (gracefully, as hyper does it) and returns
/// once all are closed. With `tls`, every connection is TLS (its handshake within the
/// header-read timeout) and its requests carry a [`crate::tls::ConnInfo`].
pub async fn serve<F>(
    listener: TcpListener,
    app: Router,
    cfg: &HttpConfig,
    tls: Option<Arc<rustls::ServerConfig>>,
    shutdown: F,
) where
    F: Future<Output = ()> + Send + 'static,
{
    serve_with(listener, app, cfg.settings(), tls, shutdown).await
}

async fn serve_with<F>(
    listener: TcpListener,
    app: Router,
    s: Settings,
    tls: Option<Arc<rustls::ServerConfig>>,
    shutdown: F,
) where
    F: Future<Output = ()> + Send + 'static,
{
    let tls = tls.map(tokio_rustls::TlsAcceptor::from);
    let stop = CancellationToken::new();
    tokio::spawn({
        let stop = stop.clone();
        async move {
            shutdown.await;
            stop.cancel();
        }
    });
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .max_buf_size(MAX_HTTP1_BUFFER)
        .header_read_timeout(s.timeouts.header + s.timeouts.idle);
    // WebSockets over HTTP/2 use extended CONNECT.
    builder
        .http2()
        .timer(TokioTimer::new())
        .enable_connect_protocol();
    // Every connection task holds a sender; the channel closes when the last one ends.
    let (open_tx, mut open_rx) = tokio::sync::mpsc::channel::<Infallible>(1);
    let shared = Arc::new(Shared {
        builder,
        timeouts: s.timeouts,
        stop: stop.clone(),
        _open: open_tx,
    });
    let limits = Arc::new(Limits::new(s.max_connections, s.max_connections_per_ip));
    let mut backoff: Option<Duration> = None;
    let mut refused = Refused::default();
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = stop.cancelled() => break,
        };
        let (tcp, peer) = match accepted {
            Ok(a) => {
                backoff = None;
                a
            }
            Err(e) => {
                let Some(wait) = accept_backoff(&e, backoff) else {
                    tracing::debug!(error = %e, "accept failed");
                    continue;
                };
                if backoff.is_none() {
                    tracing::warn!(error = %e, "accept failed; backing off");
                }
                backoff = Some(wait);
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = stop.cancelled() => break,
                }
                continue;
            }
        };
        let permit = match limits.acquire(peer.ip()) {
            Ok(p) => p,
            Err(over) => {
                refuse(&tcp);
                drop(tcp);
                refused.note(over, peer);
                continue;
            }
        };
        // Streamed answers (command output, proxied streams) are many small writes: with
        // Nagle's algorithm each waits for the client's delayed ACK, about 40 ms apiece.
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY");
        }
        let conn = Arc::new(Conn::new());
        let io = Io {
            tcp,
            conn: conn.clone(),
            _permit: permit,
        };
        let svc = Service {
            app: app.clone(),
            conn: conn.clone(),
            limits: limits.clone(),
            peer: peer.ip(),
            tls: None,
        };
        match &tls {
            None => {
                tokio::spawn(serve_conn(shared.clone(), io, svc, conn, peer));
            }
            Some(acceptor) => {
                tokio::spawn(serve_tls(
                    shared.clone(),
                    acceptor.clone(),
                    io,
                    svc,
                    conn,
                    peer,
                ));
            }
        }
    }
    drop(listener);
    drop(shared);
    // Every task has ended when all senders are gone.
    let _ = open_rx.recv().await;
}

/// What every connection task shares.
struct Shared {
    builder: Builder<TokioExecutor>,
    timeouts: Timeouts,
    stop: CancellationToken,
    /// Held while any task lives, so that the accept loop can wait for the last.
    _open: tokio::sync::mpsc::Sender<Infallible>,
}

/// Completes the TLS handshake (within the header-read timeout, which it counts against:
/// the first request's head is due that long after the accept), then serves the
/// connection with its SNI name in every request.
async fn serve_tls(
    shared: Arc<Shared>,
    acceptor: tokio_rustls::TlsAcceptor,
    io: Io,
    mut svc: Service,
    conn: Arc<Conn>,
    peer: SocketAddr,
) {
    let handshake = tokio::time::timeout(shared.timeouts.header, acceptor.accept(io));
    let stream = tokio::select! {
        r = handshake => match r {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                tracing::debug!(%peer, error = %e, "TLS handshake failed");
                return;
            }
            Err(_) => {
                tracing::debug!(%peer, "TLS handshake timed out");
                return;
            }
        },
        _ = shared.stop.cancelled() => return,
    };
    let sni = stream
        .get_ref()
        .1
        .server_name()
        .map(|n| Arc::<str>::from(n.to_ascii_lowercase()));
    svc.tls = Some(crate::tls::ConnInfo { sni });
    serve_conn(shared, stream, svc, conn, peer).await
}

async fn serve_conn<I>(shared: Arc<Shared>, io: I, svc: Service, conn: Arc<Conn>, peer: SocketAddr)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (t, stop) = (shared.timeouts, &shared.stop);
    let io = TokioIo::new(io);
    let mut served = pin!(shared.builder.serve_connection_with_upgrades(io, svc));
    let mut draining = false;
    loop {
        let deadline = conn.deadline(t);
        let expiry = async move {
            match deadline {
                Some((at, _)) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            r = served.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!(%peer, error = %e, "connection ended with an error");
                }
                return;
            }
            _ = stop.cancelled(), if !draining => {
                draining = true;
                served.as_mut().graceful_shutdown();
            }
            _ = conn.wake.notified() => {}
            _ = expiry => {
                if let Some((at, why)) = conn.deadline(t)
                    && Instant::now() >= at
                {
                    tracing::debug!(%peer, why, "closing the connection");
                    return;
                }
            }
        }
    }
}

/// How long to sleep after a failed accept; `None` for failures of that one connection.
/// Out of descriptors (or memory), the pending connection stays queued and accept fails
/// again at once: without a pause the loop would spin.
fn accept_backoff(e: &std::io::Error, last: Option<Duration>) -> Option<Duration> {
    const FIRST: Duration = Duration::from_millis(20);
    const MAX: Duration = Duration::from_secs(1);
    match e.raw_os_error() {
        Some(
            libc::ECONNABORTED | libc::ECONNRESET | libc::EPROTO | libc::EPERM | libc::ETIMEDOUT,
        ) => None,
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM) => {
            Some(last.map_or(FIRST, |d| (d * 2).min(MAX)))
        }
        // Anything else is unexpected; a pause keeps it from spinning.
        _ => Some(last.map_or(Duration::from_millis(100), |d| (d * 2).min(MAX))),
    }
}

/// What a connection over a cap is told before it is closed.
const BUSY: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\n\
content-type: text/plain\r\n\
content-length: 21\r\n\
retry-after: 1\r\n\
connection: close\r\n\
\r\n\
too many connections\n";

/// Answers 503 without waiting: a fresh socket's send buffer has room. What the client
/// already sent is read first, so that closing sends a FIN after the answer rather than
/// a reset that could discard it.
fn refuse(tcp: &TcpStream) {
    let mut sink = [0u8; 4096];
    let _ = tcp.try_read(&mut sink);
    let _ = tcp.try_write(BUSY);
}

/// Counts refused connections and logs them at most every ten seconds.
#[derive(Default)]
struct Refused {
    since_log: u64,
    last_log: Option<Instant>,
}

impl Refused {
    fn note(&mut self, over: OverCap, peer: SocketAddr) {
        self.since_log += 1;
        tracing::debug!(%peer, ?over, "connection refused: over the connection limit");
        let now = Instant::now();
        if self
            .last_log
            .is_none_or(|t| now.duration_since(t) >= Duration::from_secs(10))
        {
            tracing::warn!(
                refused = self.since_log,
                last_peer = %peer,
                ?over,
                "refusing connections over the limits of [http]"
            );
            self.since_log = 0;
            self.last_log = Some(now);
        }
    }
}

/// Which cap a connection hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OverCap {
    Total,
    PerIp,
}

/// Open connections, in total and per source.
struct Limits {
    max_total: usize,
    max_per_ip: usize,
    counts: Mutex<Counts>,
}

#[derive(Default)]
struct Counts {
    total: usize,
    per_ip: HashMap<IpAddr, usize>,
}

/// One counted connection; dropped with the socket (which an upgrade carries along).
struct Permit {
    limits: Arc<Limits>,
    source: IpAddr,
}

impl Limits {
    fn new(max_total: usize, max_per_ip: usize) -> Self {
        Limits {
            max_total,
            max_per_ip,
            counts: Mutex::default(),
        }
    }

    fn counts(&self) -> parking_lot::MutexGuard<'_, Counts> {
        // The counts stay consistent even if a holder panicked: every update is one step.
        self.counts.lock()
    }

    fn acquire(self: &Arc<Self>, ip: IpAddr) -> Result<Permit, OverCap> {
        let source = source_of(ip);
        let mut c = self.counts();
        if c.total >= self.max_total {
            return Err(OverCap::Total);
        }
        let n = c.per_ip.entry(source).or_insert(0);
        if *n >= self.max_per_ip {
            return Err(OverCap::PerIp);
        }
        *n += 1;
        c.total += 1;
        Ok(Permit {
            limits: self.clone(),
            source,
        })
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut c = self.limits.counts();
        c.total = c.total.saturating_sub(1);
        if let Some(n) = c.per_ip.get_mut(&self.source) {
            *n -= 1;
            if *n == 0 {
                c.per_ip.remove(&self.source);
            }
        }
    }
}

/// The unit a per-source cap counts: an IPv4 address (also when mapped into IPv6), or an
/// IPv6 /64, which one client usually has whole.
fn source_of(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => {
            let bits = u128::from(v6) & !((1u128 << 64) - 1);
            IpAddr::V6(Ipv6Addr::from(bits))
        }
    }
}

/// A connection's request bookkeeping, shared by its socket, its service and its task.
struct Conn {
    base: Instant,
    in_flight: AtomicUsize,
    /// Upgraded (or carrying an h2 CONNECT stream): no timeouts any more.
    exempt: AtomicBool,
    /// HTTP/2: frames arrive between requests (pings, window updates) without starting
    /// one, so only the idle timeout applies.
    h2: AtomicBool,
    /// When the head now awaited began, in ms since `base` plus one; 0 when none is.
    head_since: AtomicU64,
    /// When the last request ended, in ms since `base`.
    idle_since: AtomicU64,
    /// Rings when a deadline may have moved closer.
    wake: Notify,
    /// An HTTP/1 response body broke off: the socket is closed with a reset.
    reset_on_close: AtomicBool,
}

impl Conn {
    fn new() -> Self {
        Conn {
            base: Instant::now(),
            in_flight: AtomicUsize::new(0),
            exempt: AtomicBool::new(false),
            h2: AtomicBool::new(false),
            // The first head is awaited from the start.
            head_since: AtomicU64::new(1),
            idle_since: AtomicU64::new(0),
            wake: Notify::new(),
            reset_on_close: AtomicBool::new(false),
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.base.elapsed().as_millis()).unwrap_or(u64::MAX - 1)
    }

    fn at(&self, ms: u64) -> Instant {
        self.base + Duration::from_millis(ms)
    }

    /// Bytes arrived: between requests on HTTP/1, they begin the next head.
    fn on_read(&self) {
        if self.in_flight.load(Ordering::SeqCst) == 0
            && !self.h2.load(Ordering::SeqCst)
            && self
                .head_since
                .compare_exchange(0, self.now_ms() + 1, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        {
            self.wake.notify_one();
        }
    }

    /// A request's head has arrived; it is in flight until the guard is dropped.
    fn begin<B>(self: &Arc<Self>, req: &Request<B>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        self.head_since.store(0, Ordering::SeqCst);
        if req.version() == Version::HTTP_2 {
            self.h2.store(true, Ordering::SeqCst);
        }
        InFlight(self.clone())
    }

    /// When the connection is to be closed and why; `None` while a request is in flight.
    fn deadline(&self, t: Timeouts) -> Option<(Instant, &'static str)> {
        if self.exempt.load(Ordering::SeqCst) || self.in_flight.load(Ordering::SeqCst) > 0 {
            return None;
        }
        match self.head_since.load(Ordering::SeqCst) {
            0 => Some((
                self.at(self.idle_since.load(Ordering::SeqCst)) + t.idle,
                "idle timeout",
            )),
            since => Some((self.at(since - 1) + t.header, "header read timeout")),
        }
    }
}

/// A request in flight on its connection.
struct InFlight(Arc<Conn>);

impl InFlight {
    fn exempt(&self) {
        self.0.exempt.store(true, Ordering::SeqCst);
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        // Before the count drops, so that a zero count never pairs with a stale time.
        self.0.idle_since.store(self.0.now_ms(), Ordering::SeqCst);
        if self.0.in_flight.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.wake.notify_one();
        }
    }
}

/// The accepted socket, reporting reads to its connection and holding its permit.
struct Io {
    tcp: TcpStream,
    conn: Arc<Conn>,
    _permit: Permit,
}

/// A response body that fails half-way (a sandbox killed under a command's stream) ends an
/// HTTP/1 connection with a TCP reset rather than a plain close: the client then sees a
/// connection error, as over HTTP/2 it sees the stream's reset, not a truncated message.
/// E2B's SDKs treat only the former as "the connection dropped", probe the sandbox and
/// report it killed.
impl Drop for Io {
    fn drop(&mut self) {
        if self.conn.reset_on_close.load(Ordering::SeqCst) {
            let zero = libc::linger {
                l_onoff: 1,
                l_linger: 0,
            };
            if let Err(e) =
                nix::sys::socket::setsockopt(&self.tcp, nix::sys::socket::sockopt::Linger, &zero)
            {
                tracing::debug!(error = %e, "cannot set SO_LINGER for a reset");
            }
        }
    }
}

impl AsyncRead for Io {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.tcp).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.conn.on_read();
        }
        r
    }
}

impl AsyncWrite for Io {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }
}

/// The application, counting each request as in flight until its response body is done.
#[derive(Clone)]
struct Service {
    app: Router,
    conn: Arc<Conn>,
    limits: Arc<Limits>,
    peer: IpAddr,
    /// Set on TLS connections, and given to each of their requests.
    tls: Option<crate::tls::ConnInfo>,
}

/// The place an HTTP/2 request holds under the connection caps. It is in the request's
/// extensions, so that a handler that upgrades the stream (a WebSocket over extended
/// CONNECT) keeps it for as long as the upgraded stream lives.
#[derive(Clone)]
pub struct StreamSlot {
    _permit: Arc<Permit>,
}

/// What a request over a cap is told (the connection stays).
fn busy() -> Response<axum::body::Body> {
    Response::builder()
        .status(StatusCode::SERVICE_UNAVAILABLE)
        .header(http::header::CONTENT_TYPE, "text/plain")
        .header(http::header::RETRY_AFTER, "1")
        .body(axum::body::Body::from("too many connections\n"))
        .unwrap_or_default()
}

type ServiceFuture = Pin<Box<dyn Future<Output = Result<Response<Tracked>, Infallible>> + Send>>;

impl hyper::service::Service<Request<Incoming>> for Service {
    type Response = Response<Tracked>;
    type Error = Infallible;
    type Future = ServiceFuture;

    fn call(&self, mut req: Request<Incoming>) -> Self::Future {
        use tower::ServiceExt;
        let guard = self.conn.begin(&req);
        let slot = if req.version() == Version::HTTP_2 {
            match self.limits.acquire(self.peer) {
                Ok(p) => Some(StreamSlot {
                    _permit: Arc::new(p),
                }),
                Err(over) => {
                    tracing::debug!(peer = %self.peer, ?over, "HTTP/2 request refused: over the connection limit");
                    return Box::pin(async move {
                        Ok(busy().map(|body| Tracked {
                            body,
                            _guard: guard,
                            _slot: None,
                            http1: None,
                        }))
                    });
                }
            }
        } else {
            None
        };
        if let Some(s) = &slot {
            req.extensions_mut().insert(s.clone());
        }
        if let Some(info) = &self.tls {
            req.extensions_mut().insert(info.clone());
        }
        let connect = req.method() == Method::CONNECT;
        let http1 = (req.version() < Version::HTTP_2).then(|| self.conn.clone());
        let app = self.app.clone();
        Box::pin(async move {
            let resp = match app.oneshot(req).await {
                Ok(r) => r,
                Err(e) => match e {},
            };
            // The connection (HTTP/1) or stream (HTTP/2 extended CONNECT) now carries
            // something else, for as long as that lasts. A refused CONNECT stays plain
            // HTTP, timeouts and all.
            if resp.status() == StatusCode::SWITCHING_PROTOCOLS
                || (connect && resp.status().is_success())
            {
                guard.exempt();
            }
            Ok(resp.map(|body| Tracked {
                body,
                _guard: guard,
                _slot: slot,
                http1,
            }))
        })
    }
}

/// A response body that ends its request's time in flight (and gives back its HTTP/2
/// place) when it is finished or dropped.
struct Tracked {
    body: axum::body::Body,
    _guard: InFlight,
    _slot: Option<StreamSlot>,
    /// The connection of an HTTP/1 request, marked for a reset if the body fails.
    http1: Option<Arc<Conn>>,
}

impl http_body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        let r = Pin::new(&mut self.body).poll_frame(cx);
        if let (Poll::Ready(Some(Err(_))), Some(conn)) = (&r, &self.http1) {
            conn.reset_on_close.store(true, Ordering::SeqCst);
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::get;
    use std::net::Ipv4Addr;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const T: Timeouts = Timeouts {
        header: Duration::from_millis(400),
        idle: Duration::from_millis(1200),
    };

    fn app() -> Router {
        Router::new()
            .route("/", get(|| async { "ok" }))
            .route(
                "/slow",
                get(|| async {
                    tokio::time::sleep(Duration::from_millis(2000)).await;
                    "slow"
                }),
            )
            .route(
                "/stream",
                get(|| async {
                    let chunks = futures::stream::unfold(0, |i| async move {
                        match i {
                            0 => Some((Ok::<_, Infallible>(Bytes::from("first\n")), 1)),
                            1 => {
                                tokio::time::sleep(Duration::from_millis(2000)).await;
                                Some((Ok(Bytes::from("last\n")), 2))
                            }
                            _ => None,
                        }
                    });
                    axum::body::Body::from_stream(chunks)
                }),
            )
            .route(
                "/broken",
                get(|| async {
                    // The break comes a while after the first chunk, as when a sandbox
                    // dies under a command's stream (a reset drops what is unsent).
                    let chunks = futures::stream::unfold(0, |i| async move {
                        match i {
                            0 => Some((Ok(Bytes::from("first\n")), 1)),
                            1 => {
                                tokio::time::sleep(Duration::from_millis(300)).await;
                                Some((Err(std::io::Error::other("upstream went away")), 2))
                            }
                            _ => None,
                        }
                    });
                    axum::body::Body::from_stream(chunks)
                }),
            )
    }

    struct Server {
        addr: SocketAddr,
        stop: Option<tokio::sync::oneshot::Sender<()>>,
        done: tokio::task::JoinHandle<()>,
    }

    async fn server(per_ip: usize, total: usize) -> Server {
        server_with(per_ip, total, T).await
    }

    async fn server_with(per_ip: usize, total: usize, timeouts: Timeouts) -> Server {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let s = Settings {
            timeouts,
            max_connections: total,
            max_connections_per_ip: per_ip,
        };
        let done = tokio::spawn(serve_with(l, app(), s, None, async move {
            let _ = rx.await;
        }));
        Server {
            addr,
            stop: Some(tx),
            done,
        }
    }

    async fn connect_from(addr: SocketAddr, from: Ipv4Addr) -> TcpStream {
        let s = tokio::net::TcpSocket::new_v4().unwrap();
        s.bind(SocketAddr::new(from.into(), 0)).unwrap();
        s.connect(addr).await.unwrap()
    }

    /// Reads until the head is complete and `until` has been seen.
    async fn read_response(s: &mut TcpStream, until: &str) -> String {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            let text = String::from_utf8_lossy(&buf).to_string();
            if text.contains("\r\n\r\n") && text.contains(until) {
                return text;
            }
            let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut chunk))
                .await
                .expect("a response in time")
                .unwrap();
            assert!(n > 0, "closed before the response was complete: {text}");
            buf.extend_from_slice(&chunk[..n]);
        }
    }

    /// Waits for the server to close `s`; returns how long that took.
    async fn closed_after(s: &mut TcpStream, limit: Duration) -> Duration {
        let start = Instant::now();
        let mut chunk = [0u8; 1024];
        loop {
            match tokio::time::timeout_at(start + limit, s.read(&mut chunk)).await {
                Err(_) => panic!("still open after {limit:?}"),
                Ok(Ok(0)) | Ok(Err(_)) => return start.elapsed(),
                Ok(Ok(_)) => {}
            }
        }
    }

    #[tokio::test]
    async fn a_body_that_breaks_off_resets_an_http1_connection_and_a_complete_one_does_not() {
        let srv = server(8, 8).await;
        let mut s = TcpStream::connect(srv.addr).await.unwrap();
        s.write_all(b"GET /broken HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut got = Vec::new();
        let mut chunk = [0u8; 4096];
        let end = loop {
            match tokio::time::timeout(Duration::from_secs(10), s.read(&mut chunk))
                .await
                .expect("an end in time")
            {
                Ok(0) => break None,
                Ok(n) => got.extend_from_slice(&chunk[..n]),
                Err(e) => break Some(e.kind()),
            }
        };
        assert!(String::from_utf8_lossy(&got).contains("first"));
        assert_eq!(
            end,
            Some(std::io::ErrorKind::ConnectionReset),
            "a truncated body must end in a reset, not a plain close"
        );
        // A complete answer on a connection the client then closes: no reset anywhere,
        // and the connection serves the next request.
        let mut s = TcpStream::connect(srv.addr).await.unwrap();
        for _ in 0..2 {
            s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                .await
                .unwrap();
            assert!(read_response(&mut s, "ok").await.contains("200 OK"));
        }
    }

    #[tokio::test]
    async fn a_partial_head_is_cut_at_the_header_timeout() {
        let srv = server(100, 100).await;
        let mut s = connect_from(srv.addr, Ipv4Addr::LOCALHOST).await;
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            .await
            .unwrap();
        let took = closed_after(&mut s, Duration::from_secs(5)).await;
        assert!(took >= T.header - Duration::from_millis(50), "{took:?}");
        // Nor may a connection that sends nothing at all wait longer.
        let mut s = connect_from(srv.addr, Ipv4Addr::LOCALHOST).await;
        let took = closed_after(&mut s, Duration::from_secs(5)).await;
        assert!(took < T.idle, "{took:?}");
        // Nor one that sends a prefix of the HTTP/2 preface (hyper-util's detection).
        let mut s = connect_from(srv.addr, Ipv4Addr::LOCALHOST).await;
        s.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap();
        let took = closed_after(&mut s, Duration::from_secs(5)).await;
        assert!(took < T.idle, "{took:?}");
    }

    #[tokio::test]
    async fn keep_alive_waits_the_idle_timeout_and_a_later_head_the_header_timeout() {
        let srv = server(100, 100).await;
        let mut s = connect_from(srv.addr, Ipv4Addr::LOCALHOST).await;
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        read_response(&mut s, "ok").await;
        // Idle, past the header timeout: still there for the next request.
        tokio::time::sleep(T.header + Duration::from_millis(300)).await;
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        read_response(&mut s, "ok").await;
        let took = closed_after(&mut s, Duration::from_secs(5)).await;
        assert!(took >= T.idle - Duration::from_millis(100), "{took:?}");

        // A second head begun and never finished: the header timeout, not the idle one.
        let mut s = connect_from(srv.addr, Ipv4Addr::LOCALHOST).await;
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        read_response(&mut s, "ok").await;
        s.write_all(b"GET / HTTP/1.1\r\nHo").await.unwrap();
        let took = closed_after(&mut s, Duration::from_secs(5)).await;
        assert!(took < T.idle - Duration::from_millis(200), "{took:?}");
    }

    #[tokio::test]
    async fn a_refused_connect_does_not_escape_the_timeouts() {
        // HTTP/2 extended CONNECT (how WebSockets ride HTTP/2) to a route that has none.
        let srv = server(100, 100).await;
        let tcp = connect_from(srv.addr, Ipv4Addr::LOCALHOST).await;
        let (mut send, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
                .await
                .unwrap();
        let conn = tokio::spawn(conn);
        let mut req = Request::builder()
            .method(Method::CONNECT)
            .uri("http://x/")
            .body(http_body_util::Empty::<Bytes>::new())
            .unwrap();
        req.extensions_mut()
            .insert(hyper::ext::Protocol::from_static("websocket"));
        let resp = send.send_request(req).await.unwrap();
        assert!(!resp.status().is_success(), "{}", resp.status());
        drop(resp);
        tokio::time::timeout(T.idle + Duration::from_secs(3), conn)
            .await
            .expect("the connection was closed when idle")
            .unwrap()
            .ok();
    }

    #[tokio::test]
    async fn silent_requests_and_streams_outlive_the_idle_timeout() {
        let srv = server(100, 100).await;
        let mut a = connect_from(srv.addr, Ipv4Addr::LOCALHOST).await;
        a.write_all(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut b = connect_from(srv.addr, Ipv4Addr::LOCALHOST).await;
        b.write_all(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let (ra, rb) = tokio::join!(read_response(&mut a, "slow"), read_response(&mut b, "last"));
        assert!(ra.starts_with("HTTP/1.1 200"), "{ra}");
        assert!(rb.contains("first\n") && rb.contains("last\n"), "{rb}");
        // And the connection is reusable afterwards.
        a.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        assert!(read_response(&mut a, "ok").await.ends_with("ok"));
    }

    #[tokio::test]
    async fn h2c_works_and_idles_out() {
        let srv = server(100, 100).await;
        let tcp = connect_from(srv.addr, Ipv4Addr::LOCALHOST).await;
        let (mut send, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
                .await
                .unwrap();
        let conn = tokio::spawn(conn);
        for path in ["/", "/slow"] {
            let req = Request::get(format!("http://x{path}"))
                .body(http_body_util::Empty::<Bytes>::new())
                .unwrap();
            let resp = send.send_request(req).await.unwrap();
            assert_eq!(resp.status(), StatusCode::OK);
            assert_eq!(resp.version(), Version::HTTP_2);
            use http_body_util::BodyExt;
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            assert!(body == "ok" || body == "slow");
        }
        // Idle now: the server ends the connection.
        tokio::time::timeout(T.idle + Duration::from_secs(3), conn)
            .await
            .expect("the idle HTTP/2 connection was closed")
            .unwrap()
            .ok();
    }

    #[tokio::test]
    async fn a_head_beyond_the_buffer_is_refused() {
        let srv = server(100, 100).await;
        let mut s = connect_from(srv.addr, Ipv4Addr::LOCALHOST).await;
        let pad = "a".repeat(1000);
        let mut head = String::from("GET / HTTP/1.1\r\nHost: x\r\n");
        while head.len() <= MAX_HTTP1_BUFFER {
            head.push_str(&format!("X-Pad: {pad}\r\n"));
        }
        // The daemon may stop reading (and reset) before all of it is written.
        let _ = s.write_all(head.as_bytes()).await;
        let text = read_response(&mut s, "\r\n").await;
        assert!(text.starts_with("HTTP/1.1 431 "), "{text}");
        // A head of a few KB is fine.
        let mut s = connect_from(srv.addr, Ipv4Addr::LOCALHOST).await;
        s.write_all(format!("GET / HTTP/1.1\r\nHost: x\r\nX-Pad: {pad}\r\n\r\n").as_bytes())
            .await
            .unwrap();
        assert!(
            read_response(&mut s, "ok")
                .await
                .starts_with("HTTP/1.1 200")
        );
    }

    #[tokio::test]
    async fn http2_requests_take_places_of_their_own() {
        let srv = server(3, 100).await;
        let tcp = connect_from(srv.addr, Ipv4Addr::LOCALHOST).await;
        let (send, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
                .await
                .unwrap();
        tokio::spawn(conn);
        // The connection holds one place, two slow requests the others: a third at once
        // is over the per-address cap.
        let slow = |send: &hyper::client::conn::http2::SendRequest<_>| {
            let mut send = send.clone();
            tokio::spawn(async move {
                let req = Request::get("http://x/slow")
                    .body(http_body_util::Empty::<Bytes>::new())
                    .unwrap();
                send.send_request(req).await.unwrap().status()
            })
        };
        let (a, b) = (slow(&send), slow(&send));
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(slow(&send).await.unwrap(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(a.await.unwrap(), StatusCode::OK);
        assert_eq!(b.await.unwrap(), StatusCode::OK);
        // Their places are given back when they end.
        assert_eq!(slow(&send).await.unwrap(), StatusCode::OK);
    }

    #[tokio::test]
    async fn connections_over_a_cap_get_503_and_are_closed() {
        // Timeouts long enough that only the caps close anything here.
        let long = Timeouts {
            header: Duration::from_secs(30),
            idle: Duration::from_secs(30),
        };
        let srv = server_with(2, 3, long).await;
        let ip1 = Ipv4Addr::new(127, 0, 0, 1);
        let held = [
            connect_from(srv.addr, ip1).await,
            connect_from(srv.addr, ip1).await,
        ];
        // Over the per-address cap.
        let mut over = connect_from(srv.addr, ip1).await;
        let text = read_response(&mut over, "too many connections\n").await;
        assert!(text.starts_with("HTTP/1.1 503 "), "{text}");
        closed_after(&mut over, Duration::from_secs(2)).await;
        // Another address still gets in, up to the total.
        let mut other = connect_from(srv.addr, Ipv4Addr::new(127, 0, 0, 2)).await;
        other
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        assert!(
            read_response(&mut other, "ok")
                .await
                .starts_with("HTTP/1.1 200")
        );
        let mut third = connect_from(srv.addr, Ipv4Addr::new(127, 0, 0, 3)).await;
        let text = read_response(&mut third, "too many connections\n").await;
        assert!(text.starts_with("HTTP/1.1 503 "), "{text}");
        // Closed connections give their places back.
        drop(held);
        drop(other);
        let mut s = None;
        for _ in 0..100 {
            let mut c = connect_from(srv.addr, ip1).await;
            c.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                .await
                .unwrap();
            let text = read_response(&mut c, "\n").await;
            if text.starts_with("HTTP/1.1 200") {
                s = Some(text);
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(s.is_some(), "no place again after closing");
    }

    #[tokio::test]
    async fn graceful_shutdown_lets_a_request_finish() {
        let mut srv = server(100, 100).await;
        let mut a = connect_from(srv.addr, Ipv4Addr::LOCALHOST).await;
        a.write_all(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        let _ = srv.stop.take().unwrap().send(());
        let r = read_response(&mut a, "slow").await;
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
        tokio::time::timeout(Duration::from_secs(5), srv.done)
            .await
            .expect("serve returned after the last connection")
            .unwrap();
        assert!(
            TcpStream::connect(srv.addr).await.is_err(),
            "still accepting"
        );
    }

    #[test]
    fn limits_count_per_source_and_in_total() {
        let l = Arc::new(Limits::new(3, 2));
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let a_mapped: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        let b: IpAddr = "2001:db8::1".parse().unwrap();
        let b_same64: IpAddr = "2001:db8::ffff:2".parse().unwrap();
        let p1 = l.acquire(a).unwrap();
        let p2 = l.acquire(a_mapped).unwrap();
        assert_eq!(l.acquire(a).err(), Some(OverCap::PerIp));
        let p3 = l.acquire(b).unwrap();
        assert_eq!(l.acquire(b_same64).err(), Some(OverCap::Total));
        drop(p1);
        assert_eq!(l.acquire(a).map(drop), Ok(()));
        let p4 = l.acquire(b_same64).unwrap();
        assert_eq!(
            l.acquire("2001:db8:0:1::1".parse().unwrap()).err(),
            Some(OverCap::Total)
        );
        drop((p2, p3, p4));
        let c = l.counts();
        assert_eq!((c.total, c.per_ip.len()), (0, 0));
    }

    #[test]
    fn deadlines_follow_the_requests() {
        let c = Arc::new(Conn::new());
        let t0 = c.base;
        assert_eq!(c.deadline(T), Some((t0 + T.header, "header read timeout")));
        let req = Request::get("/").body(()).unwrap();
        let g = c.begin(&req);
        assert_eq!(c.deadline(T), None);
        c.on_read();
        assert_eq!(c.deadline(T), None, "request bodies do not start a head");
        drop(g);
        let (at, why) = c.deadline(T).unwrap();
        assert_eq!(why, "idle timeout");
        assert!(at >= t0 + T.idle);
        c.on_read();
        assert_eq!(c.deadline(T).unwrap().1, "header read timeout");
        // HTTP/2: only the idle timeout between requests.
        let h2 = Request::get("/").version(Version::HTTP_2).body(()).unwrap();
        drop(c.begin(&h2));
        c.on_read();
        assert_eq!(c.deadline(T).unwrap().1, "idle timeout");
        // Upgraded: none at all.
        c.begin(&req).exempt();
        assert_eq!(c.deadline(T), None);
    }

    #[test]
    fn accept_errors_back_off_only_when_resources_run_out() {
        let e = |n| std::io::Error::from_raw_os_error(n);
        assert_eq!(accept_backoff(&e(libc::ECONNABORTED), None), None);
        let first = accept_backoff(&e(libc::EMFILE), None).unwrap();
        assert!(first > Duration::ZERO);
        let second = accept_backoff(&e(libc::ENFILE), Some(first)).unwrap();
        assert!(second > first);
        let mut d = second;
        for _ in 0..20 {
            d = accept_backoff(&e(libc::EMFILE), Some(d)).unwrap();
        }
        assert_eq!(d, Duration::from_secs(1));
    }

    #[test]
    fn the_busy_answer_is_well_formed() {
        let text = std::str::from_utf8(BUSY).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.contains(&format!("content-length: {}", body.len())));
    }

    #[test]
    fn the_default_total_cap_leaves_descriptors_for_the_rest() {
        assert_eq!(total_cap(None, Some(1_048_576)), MAX_CONNECTIONS);
        assert_eq!(total_cap(None, Some(1024)), 256);
        assert_eq!(total_cap(None, None), MAX_CONNECTIONS);
        // What the operator set stays.
        assert_eq!(total_cap(Some(4000), Some(256)), 4000);
        assert_eq!(total_cap(Some(100), Some(20_000)), 100);
    }

    #[test]
    fn config_defaults_and_checks() {
        let d = HttpConfig::default();
        assert_eq!((d.header_read_timeout_secs, d.idle_timeout_secs), (10, 60));
        assert!(d.check().is_ok());
        let zero = HttpConfig {
            max_connections_per_ip: 0,
            ..d.clone()
        };
        assert_eq!(
            zero.check().unwrap_err().to_string(),
            "http.max_connections_per_ip must be at least 1"
        );
        let zero = HttpConfig {
            max_connections: Some(0),
            ..d.clone()
        };
        assert!(matches!(
            zero.check(),
            Err(ConfigError::Zero {
                name: "http.max_connections"
            })
        ));
        let huge = HttpConfig {
            idle_timeout_secs: u64::MAX,
            ..d
        };
        assert_eq!(
            huge.check().unwrap_err().to_string(),
            "http.idle_timeout_secs must be between 1 and 604800"
        );
    }

    /// A TLS listener with a certificate of `tls::init` for `sb.example.test`; its app
    /// answers `/sni` with the SNI name the request carries.
    async fn tls_server(dir: &std::path::Path) -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
        let files = crate::tls::init("sb.example.test", dir, false).unwrap();
        let cfg = crate::tls::server_config(&crate::tls::TlsFiles {
            cert: files.cert,
            key: files.key,
        })
        .unwrap();
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let app = app().route(
            "/sni",
            get(|req: axum::extract::Request| async move {
                req.extensions()
                    .get::<crate::tls::ConnInfo>()
                    .and_then(|i| i.sni.as_deref().map(str::to_string))
                    .unwrap_or_else(|| "none".into())
            }),
        );
        let s = Settings {
            timeouts: T,
            max_connections: 100,
            max_connections_per_ip: 100,
        };
        tokio::spawn(serve_with(l, app, s, Some(cfg), async move {
            let _ = rx.await;
        }));
        (addr, tx)
    }

    #[tokio::test]
    async fn tls_serves_with_the_sni_name_and_cuts_a_silent_handshake() {
        let dir = tempfile::tempdir().unwrap();
        let (addr, _stop) = tls_server(dir.path()).await;
        let mut roots = rustls::RootCertStore::empty();
        let ca = std::fs::read(dir.path().join(crate::tls::CA_FILE)).unwrap();
        use rustls_pki_types::pem::PemObject;
        for c in rustls_pki_types::CertificateDer::pem_slice_iter(&ca) {
            roots.add(c.unwrap()).unwrap();
        }
        let client = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::aws_lc_rs::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
        let connector = tokio_rustls::TlsConnector::from(Arc::new(client));
        let name = "8000-abc.SB.example.test";
        let tcp = TcpStream::connect(addr).await.unwrap();
        let server_name = rustls_pki_types::ServerName::try_from(name).unwrap();
        let mut tls = connector.connect(server_name, tcp).await.unwrap();
        tls.write_all(
            b"GET /sni HTTP/1.1\r\nHost: 8000-abc.sb.example.test\r\nConnection: close\r\n\r\n",
        )
        .await
        .unwrap();
        let mut answer = String::new();
        tls.read_to_string(&mut answer).await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.ends_with("8000-abc.sb.example.test"), "{answer}");
        // A name the certificate does not cover fails the client's check.
        let tcp = TcpStream::connect(addr).await.unwrap();
        let other = rustls_pki_types::ServerName::try_from("sb.other.test").unwrap();
        assert!(connector.connect(other, tcp).await.is_err());
        // A connection that never finishes its handshake is closed at the header timeout.
        let mut silent = connect_from(addr, Ipv4Addr::LOCALHOST).await;
        let took = closed_after(&mut silent, Duration::from_secs(5)).await;
        assert!(took < T.idle, "{took:?}");
        // Plain HTTP gets no HTTP answer.
        let mut plain = connect_from(addr, Ipv4Addr::LOCALHOST).await;
        plain
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut got = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), plain.read_to_end(&mut got)).await;
        assert!(!got.starts_with(b"HTTP/"), "{got:?}");
    }
}
