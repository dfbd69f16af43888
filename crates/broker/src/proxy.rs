//! One intercepted connection: TLS toward the sandbox with a leaf of its own CA, HTTP/1.1
//! requests checked one at a time against the sandbox's secrets, credentials put in, and
//! the request carried over a verified TLS connection to the upstream the egress proxy
//! allowed. A refused request never reaches the upstream. The upstream's certificate is
//! not what decides whether a credential may go there (a CA the daemon trusts may have
//! issued one for the name to anyone): the destination must be an address of the host.

use super::Inner;
use super::rules::{self, Action, Reason, Refusal, RequestView, Secret};
use super::transform;
use bytes::{Bytes, BytesMut};
use http::header::{CONTENT_ENCODING, HOST, UPGRADE};
use http::{HeaderValue, Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use http_body_util::combinators::BoxBody;
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::{TokioIo, TokioTimer};
use sandpit_net::approval::{GateCapability, GateDecision, GateRequest, printable_path};
use sandpit_net::intercept::{BoxedIo, Carried, Destination, Outbound};
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use zeroize::Zeroizing;

/// Time allowed for the sandbox's TLS handshake, and for reaching the upstream.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// A request's headers must arrive within this (also bounds an idle keep-alive connection).
const HEADER_TIMEOUT: Duration = Duration::from_secs(60);
/// Secret values shorter than this are not masked in responses: masking every short
/// string that happens to match would mangle ordinary content.
const MIN_MASKED: usize = 8;

type ResBody = BoxBody<Bytes, hyper::Error>;

/// Bytes through the connection's upstream side (all upstream connections it used).
#[derive(Default)]
struct Counters {
    up: AtomicU64,
    down: AtomicU64,
}

/// One sandbox connection being served.
struct ConnCtx {
    inner: Arc<Inner>,
    sandbox_id: String,
    host: String,
    tls: bool,
    upstream: SocketAddr,
    /// Whether `upstream` is an address `host` resolves to; no credential goes otherwise.
    resolved: bool,
    counters: Arc<Counters>,
    /// The upstream connection, kept between requests of a keep-alive connection.
    sender: tokio::sync::Mutex<Option<SendRequest<Incoming>>>,
    /// Spliced upgraded connections (WebSocket), awaited before the byte counts are final.
    upgrades: parking_lot::Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

fn io_other(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

/// Serves one connection the broker wanted; see [`sandpit_net::intercept::Interceptor::serve`].
pub(super) async fn serve(
    inner: Arc<Inner>,
    conn: Outbound,
    client: BoxedIo,
    upstream: Destination,
) -> io::Result<Carried> {
    let host = rules::normal_host(&conn.host);
    let counters = Arc::new(Counters::default());
    let io: BoxedIo = if conn.tls {
        let authority = inner
            .authority
            .as_ref()
            .ok_or_else(|| io_other("the credential broker has no key"))?;
        let cfg = authority
            .server_config(&conn.sandbox_id, &host)
            .map_err(io_other)?;
        let accept = tokio_rustls::TlsAcceptor::from(cfg).accept(client);
        let tls = tokio::time::timeout(HANDSHAKE_TIMEOUT, accept)
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "TLS handshake timed out"))??;
        Box::new(tls)
    } else {
        client
    };
    let ctx = Arc::new(ConnCtx {
        inner,
        sandbox_id: conn.sandbox_id,
        host,
        tls: conn.tls,
        upstream: upstream.addr,
        resolved: upstream.resolved,
        counters: counters.clone(),
        sender: tokio::sync::Mutex::new(None),
        upgrades: parking_lot::Mutex::default(),
    });
    let svc_ctx = ctx.clone();
    let service = hyper::service::service_fn(move |req| {
        let ctx = svc_ctx.clone();
        async move { Ok::<_, std::convert::Infallible>(ctx.handle(req).await) }
    });
    let served = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .serve_connection(TokioIo::new(io), service)
        .with_upgrades()
        .await;
    if let Err(e) = served {
        tracing::debug!(sandbox = %ctx.sandbox_id, host = %ctx.host, error = %e, "intercepted connection ended");
    }
    let upgrades = std::mem::take(&mut *ctx.upgrades.lock());
    for u in upgrades {
        let _ = u.await;
    }
    Ok((
        counters.up.load(Ordering::Relaxed),
        counters.down.load(Ordering::Relaxed),
    ))
}

/// The JSON answer to a request the broker will not carry.
fn refused(r: &Refusal) -> Response<ResBody> {
    let body = serde_json::json!({
        "code": "credential_refused",
        "reason": r.reason,
        "secret": r.secret,
        "message": format!("sandpit credential broker refused the request: {}", r.message),
    });
    json_response(StatusCode::FORBIDDEN, &body)
}

/// Why no connection to the upstream could be made: which upstream, and what failed. Its
/// text is what the sandbox's client is answered (after `sandpit credential broker: `).
#[derive(Debug, thiserror::Error)]
#[error("upstream {host} ({addr}): {why}")]
struct UpstreamError {
    host: String,
    addr: SocketAddr,
    #[source]
    why: UpstreamFailure,
}

/// The step of reaching an upstream that failed.
#[derive(Debug, thiserror::Error)]
enum UpstreamFailure {
    #[error("connect timed out")]
    ConnectTimeout,
    #[error("{0}")]
    Connect(#[source] io::Error),
    #[error("{0}")]
    Name(#[source] rustls_pki_types::InvalidDnsNameError),
    #[error("TLS handshake timed out")]
    TlsTimeout,
    #[error("TLS: {0}")]
    Tls(#[source] io::Error),
    #[error("{0}")]
    Handshake(#[source] hyper::Error),
}

fn bad_gateway(message: String) -> Response<ResBody> {
    let body = serde_json::json!({
        "code": "upstream_unreachable",
        "message": format!("sandpit credential broker: {message}"),
    });
    json_response(StatusCode::BAD_GATEWAY, &body)
}

fn json_response(status: StatusCode, body: &serde_json::Value) -> Response<ResBody> {
    let full = http_body_util::Full::new(Bytes::from(body.to_string()))
        .map_err(|never| match never {})
        .boxed();
    let mut resp = Response::new(full);
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp.headers_mut()
        .insert("x-sandpit-broker", HeaderValue::from_static("refused"));
    resp
}

/// The host of a Host header or authority, without its port; None when what follows the
/// host is not a port (`allowed.test:80@evil.test`): a server may read another host there.
fn host_part(authority: &str) -> Option<&str> {
    let (host, port) = match authority.strip_prefix('[') {
        Some(rest) => match rest.split_once(']')? {
            (host, "") => return Some(host),
            (host, after) => (host, after.strip_prefix(':')?),
        },
        None => match authority.rsplit_once(':') {
            Some(split) => split,
            None => return Some(authority),
        },
    };
    port.bytes().all(|b| b.is_ascii_digit()).then_some(host)
}

impl ConnCtx {
    async fn handle(self: &Arc<Self>, mut req: Request<Incoming>) -> Response<ResBody> {
        let refuse_host = |named: &str| Refusal {
            secret: String::new(),
            reason: Reason::Host,
            message: format!(
                "the request names host {named} but the connection is to {}",
                self.host
            ),
        };
        // One Host, and a host in it: a server may route by a second Host header or by what
        // it reads in a malformed one, which the broker would not have checked.
        let hosts = req.headers().get_all(HOST);
        if hosts.iter().nth(1).is_some() {
            return refused(&Refusal {
                secret: String::new(),
                reason: Reason::Host,
                message: "the request has more than one Host header".into(),
            });
        }
        let header_host = match hosts.iter().next() {
            None => None,
            Some(h) => match h.to_str().ok().and_then(host_part) {
                Some(named) => Some(rules::normal_host(named)),
                None => {
                    return refused(&Refusal {
                        secret: String::new(),
                        reason: Reason::Host,
                        message: format!(
                            "the request's Host {:?} is not a host and port",
                            String::from_utf8_lossy(h.as_bytes())
                        ),
                    });
                }
            },
        };
        let uri_host = req.uri().host().map(rules::normal_host);
        for named in [header_host, uri_host].into_iter().flatten() {
            if named != self.host {
                return refused(&refuse_host(&named));
            }
        }
        let attached = self.inner.attached_secrets(&self.sandbox_id);
        let secrets: Vec<&Secret> = attached.iter().map(|s| s.as_ref()).collect();
        let path = req.uri().path();
        let view = RequestView {
            host: &self.host,
            tls: self.tls,
            resolved: self.resolved,
            method: req.method().as_str(),
            path: path.starts_with('/').then_some(path),
            now_ms: sandpit_store::now_ms(),
        };
        let values: Vec<&[u8]> = req.headers().values().map(|v| v.as_bytes()).collect();
        let decision = rules::decide(&secrets, &view, &values);
        let actions = match decision {
            Ok(a) => a,
            Err(r) => {
                tracing::info!(sandbox = %self.sandbox_id, host = %self.host, method = %req.method(),
                    secret = %r.secret, reason = ?r.reason, "credential broker refused a request");
                return refused(&r);
            }
        };
        if let Some(r) = self.ask_gate(&req, &secrets, &actions).await {
            tracing::info!(sandbox = %self.sandbox_id, host = %self.host, method = %req.method(),
                secret = %r.secret, "credential broker refused a request: {}", r.message);
            return refused(&r);
        }
        let mut masks: Vec<Zeroizing<Vec<u8>>> = Vec::new();
        let mut used: Vec<String> = Vec::new();
        for action in &actions {
            let (index, applied) = match action {
                Action::SetHeader {
                    secret,
                    name,
                    format,
                } => (
                    *secret,
                    self.set_header(&mut req, secrets[*secret], name, format),
                ),
                Action::Replace { secret, token } => {
                    (*secret, self.replace(&mut req, secrets[*secret], token))
                }
            };
            match applied {
                Ok(value) => {
                    used.push(secrets[index].name.clone());
                    if value.len() >= MIN_MASKED {
                        masks.push(value);
                    }
                }
                Err(r) => return refused(&r),
            }
        }
        match self.apply_egress_rules(&mut req) {
            Ok((names, values)) => {
                used.extend(names);
                masks.extend(values.into_iter().filter(|v| v.len() >= MIN_MASKED));
            }
            Err(r) => {
                tracing::info!(sandbox = %self.sandbox_id, host = %self.host, method = %req.method(),
                    secret = %r.secret, reason = ?r.reason, "credential broker refused a request");
                return refused(&r);
            }
        }
        if !used.is_empty() {
            tracing::info!(sandbox = %self.sandbox_id, host = %self.host, method = %req.method(),
                secrets = ?used, "credential broker injected credentials");
        }
        self.forward(req, masks).await
    }

    /// Asks the approval gate about each credential the request would carry; the first
    /// refused one refuses the request (the request is held until the gate answers).
    async fn ask_gate(
        &self,
        req: &Request<Incoming>,
        secrets: &[&Secret],
        actions: &[Action],
    ) -> Option<Refusal> {
        let gate = self.inner.gate.read().clone()?;
        let mut asked: Vec<usize> = Vec::new();
        for action in actions {
            let (Action::SetHeader { secret, .. } | Action::Replace { secret, .. }) = action;
            if asked.contains(secret) {
                continue;
            }
            asked.push(*secret);
            let name = secrets[*secret].name.clone();
            let ask = GateRequest {
                sandbox_id: self.sandbox_id.clone(),
                capability: GateCapability::Credential { name: name.clone() },
                host: self.host.clone(),
                port: self.upstream.port(),
                method: Some(req.method().as_str().to_string()),
                path: Some(printable_path(req.uri().path())),
            };
            match gate.decide(ask).await {
                GateDecision::NotGated | GateDecision::Approved { .. } => {}
                GateDecision::Refused {
                    approval_id,
                    reason,
                } => {
                    return Some(Refusal {
                        secret: name,
                        reason: Reason::Approval,
                        message: format!(
                            "approval {}: {reason}",
                            approval_id.as_deref().unwrap_or("(not recorded)")
                        ),
                    });
                }
            }
        }
        None
    }

    /// Sets the headers the sandbox's egress rules give this host, each
    /// `${e2b.secrets.NAME}` filled in with the owner's secret: the names and values used.
    /// A secret that is gone, plain HTTP, or a destination the host does not resolve to,
    /// refuses the request rather than sending the placeholder on.
    #[allow(clippy::type_complexity)]
    fn apply_egress_rules(
        &self,
        req: &mut Request<Incoming>,
    ) -> Result<(Vec<String>, Vec<Zeroizing<Vec<u8>>>), Refusal> {
        let mut names = Vec::new();
        let mut values = Vec::new();
        let Some((owner, all)) = self.inner.egress_of(&self.sandbox_id) else {
            return Ok((names, values));
        };
        let Some(rules) = all.lookup(&self.host) else {
            return Ok((names, values));
        };
        for h in &rules.headers {
            let parts = transform::parse_value(&h.value).map_err(|e| Refusal {
                secret: String::new(),
                reason: Reason::Unavailable,
                message: format!("the rule for header {}: {}", h.name, e.0),
            })?;
            let mut full = Zeroizing::new(Vec::with_capacity(h.value.len()));
            let mut has_secret = false;
            for part in parts {
                match part {
                    transform::Part::Text(t) => full.extend_from_slice(t.as_bytes()),
                    transform::Part::Secret(name) => {
                        let s = self
                            .inner
                            .e2b_secret(&owner, &name)
                            .ok_or_else(|| Refusal {
                                secret: name.clone(),
                                reason: Reason::Unavailable,
                                message: format!(
                                    "secret {name} named by the rule for header {} does not exist",
                                    h.name
                                ),
                            })?;
                        // As the broker's own secrets by default: never in clear text.
                        if !self.tls {
                            return Err(Refusal {
                                secret: name.clone(),
                                reason: Reason::Scheme,
                                message: format!("secret {name} may only be sent over HTTPS"),
                            });
                        }
                        if !self.resolved {
                            return Err(Refusal {
                                secret: name.clone(),
                                reason: Reason::Destination,
                                message: format!(
                                    "the connection is not to an address {} resolves to; secret {name} goes only there",
                                    self.host
                                ),
                            });
                        }
                        let value = self.open(&s)?;
                        full.extend_from_slice(&value);
                        values.push(value);
                        names.push(name);
                        has_secret = true;
                    }
                }
            }
            let unusable = || Refusal {
                secret: String::new(),
                reason: Reason::Unavailable,
                message: format!(
                    "the rule for header {} does not make a valid header",
                    h.name
                ),
            };
            let name = http::HeaderName::from_bytes(h.name.as_bytes()).map_err(|_| unusable())?;
            let mut hv = HeaderValue::from_bytes(&full).map_err(|_| unusable())?;
            hv.set_sensitive(has_secret);
            req.headers_mut().remove(&name);
            req.headers_mut().insert(name, hv);
        }
        Ok((names, values))
    }

    fn open(&self, s: &Secret) -> Result<Zeroizing<Vec<u8>>, Refusal> {
        self.inner.open(s).map_err(|e| {
            tracing::warn!(owner = %s.owner, secret = %s.name, error = %e, "a secret cannot be used");
            Refusal {
                secret: s.name.clone(),
                reason: Reason::Unavailable,
                message: format!("secret {} cannot be used: {e}", s.name),
            }
        })
    }

    fn set_header(
        &self,
        req: &mut Request<Incoming>,
        s: &Secret,
        name: &str,
        format: &str,
    ) -> Result<Zeroizing<Vec<u8>>, Refusal> {
        let value = self.open(s)?;
        let (before, after) = format.split_once("{value}").unwrap_or((format, ""));
        let mut full = Zeroizing::new(Vec::with_capacity(format.len() + value.len()));
        full.extend_from_slice(before.as_bytes());
        full.extend_from_slice(&value);
        full.extend_from_slice(after.as_bytes());
        let unusable = || Refusal {
            secret: s.name.clone(),
            reason: Reason::Unavailable,
            message: format!("secret {} does not make a valid header", s.name),
        };
        let name = http::HeaderName::from_bytes(name.as_bytes()).map_err(|_| unusable())?;
        let mut hv = HeaderValue::from_bytes(&full).map_err(|_| unusable())?;
        hv.set_sensitive(true);
        req.headers_mut().remove(&name);
        req.headers_mut().insert(name, hv);
        Ok(value)
    }

    fn replace(
        &self,
        req: &mut Request<Incoming>,
        s: &Secret,
        token: &str,
    ) -> Result<Zeroizing<Vec<u8>>, Refusal> {
        let value = self.open(s)?;
        for hv in req.headers_mut().values_mut() {
            if rules::find_token(hv.as_bytes(), token.as_bytes()).is_none() {
                continue;
            }
            let replaced = Zeroizing::new(rules::replace_token(
                hv.as_bytes(),
                token.as_bytes(),
                &value,
            ));
            let mut new = HeaderValue::from_bytes(&replaced).map_err(|_| Refusal {
                secret: s.name.clone(),
                reason: Reason::Unavailable,
                message: format!("secret {} does not make a valid header", s.name),
            })?;
            new.set_sensitive(true);
            *hv = new;
        }
        Ok(value)
    }

    async fn forward(
        self: &Arc<Self>,
        mut req: Request<Incoming>,
        masks: Vec<Zeroizing<Vec<u8>>>,
    ) -> Response<ResBody> {
        let client_upgrade = req
            .headers()
            .contains_key(UPGRADE)
            .then(|| hyper::upgrade::on(&mut req));
        let mut slot = self.sender.lock().await;
        let mut sender = match slot.take() {
            Some(s) if !s.is_closed() => s,
            _ => match self.connect().await {
                Ok(s) => s,
                Err(e) => return bad_gateway(e.to_string()),
            },
        };
        if sender.ready().await.is_err() {
            sender = match self.connect().await {
                Ok(s) => s,
                Err(e) => return bad_gateway(e.to_string()),
            };
        }
        let mut resp = match sender.send_request(req).await {
            Ok(r) => r,
            Err(e) => {
                return bad_gateway(format!("upstream {}: {e}", self.host));
            }
        };
        if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
            // The upstream connection becomes the upgraded stream; the next request (there
            // is none on this connection) would need a new one.
            drop(slot);
            if let Some(client_upgrade) = client_upgrade {
                let upstream_upgrade = hyper::upgrade::on(&mut resp);
                let task = tokio::spawn(async move {
                    if let (Ok(c), Ok(u)) = (client_upgrade.await, upstream_upgrade.await) {
                        let (mut c, mut u) = (TokioIo::new(c), TokioIo::new(u));
                        let _ = tokio::io::copy_bidirectional(&mut c, &mut u).await;
                    }
                });
                self.upgrades.lock().push(task);
            }
        } else {
            *slot = Some(sender);
        }
        let (mut parts, body) = resp.into_parts();
        for hv in parts.headers.values_mut() {
            let mut bytes = hv.as_bytes().to_vec();
            if mask(&mut bytes, &masks)
                && let Ok(v) = HeaderValue::from_bytes(&bytes)
            {
                *hv = v;
            }
        }
        let encoded = parts
            .headers
            .get(CONTENT_ENCODING)
            .is_some_and(|e| !e.as_bytes().eq_ignore_ascii_case(b"identity"));
        let body = if masks.is_empty() || encoded {
            body.boxed()
        } else {
            Masked::new(body, masks).boxed()
        };
        Response::from_parts(parts, body)
    }

    /// A new HTTP/1.1 connection to the upstream, over TLS verified for the host when the
    /// sandbox's connection was TLS.
    async fn connect(&self) -> Result<SendRequest<Incoming>, UpstreamError> {
        let fail = |why| UpstreamError {
            host: self.host.clone(),
            addr: self.upstream,
            why,
        };
        let tcp = tokio::time::timeout(
            CONNECT_TIMEOUT,
            tokio::net::TcpStream::connect(self.upstream),
        )
        .await
        .map_err(|_| fail(UpstreamFailure::ConnectTimeout))?
        .map_err(|e| fail(UpstreamFailure::Connect(e)))?;
        let _ = tcp.set_nodelay(true);
        let counted = Counted {
            inner: tcp,
            counters: self.counters.clone(),
        };
        let io: BoxedIo = if self.tls {
            let name = rustls_pki_types::ServerName::try_from(self.host.clone())
                .map_err(|e| fail(UpstreamFailure::Name(e)))?;
            let connector = tokio_rustls::TlsConnector::from(self.inner.upstream_tls.clone());
            let tls = tokio::time::timeout(CONNECT_TIMEOUT, connector.connect(name, counted))
                .await
                .map_err(|_| fail(UpstreamFailure::TlsTimeout))?
                .map_err(|e| fail(UpstreamFailure::Tls(e)))?;
            Box::new(tls)
        } else {
            Box::new(counted)
        };
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io))
            .await
            .map_err(|e| fail(UpstreamFailure::Handshake(e)))?;
        let host = self.host.clone();
        tokio::spawn(async move {
            if let Err(e) = conn.with_upgrades().await {
                tracing::debug!(host, error = %e, "upstream connection ended");
            }
        });
        Ok(sender)
    }
}

/// Overwrites every occurrence of each of `masks` in `buf` with `*`; true if any was.
fn mask(buf: &mut [u8], masks: &[Zeroizing<Vec<u8>>]) -> bool {
    let mut hit = false;
    for m in masks {
        let at: Vec<usize> = memchr::memmem::find_iter(buf, m.as_slice()).collect();
        for start in at {
            buf[start..start + m.len()].fill(b'*');
            hit = true;
        }
    }
    hit
}

/// Length of the longest end of `buf` that is the start of one of `masks` (and not a
/// whole one): bytes that must wait for the next chunk before they can be shown.
fn partial_tail(buf: &[u8], masks: &[Zeroizing<Vec<u8>>]) -> usize {
    let mut keep = 0;
    for m in masks {
        let window = buf.len().min(m.len() - 1);
        let tail_start = buf.len() - window;
        for pos in memchr::memchr_iter(m[0], &buf[tail_start..]) {
            let start = tail_start + pos;
            let tail = &buf[start..];
            if m.starts_with(tail) {
                keep = keep.max(tail.len());
                break;
            }
        }
    }
    keep
}

/// A response body with the secrets that went into its request masked out, so that an
/// upstream echoing a request's headers cannot hand the credential to the sandbox. The
/// length is unchanged; only bytes that might begin a secret are held back.
struct Masked<B> {
    inner: B,
    masks: Vec<Zeroizing<Vec<u8>>>,
    held: BytesMut,
    trailers: Option<http::HeaderMap>,
    done: bool,
}

impl<B> Masked<B> {
    fn new(inner: B, masks: Vec<Zeroizing<Vec<u8>>>) -> Self {
        Self {
            inner,
            masks,
            held: BytesMut::new(),
            trailers: None,
            done: false,
        }
    }
}

impl<B> Drop for Masked<B> {
    fn drop(&mut self) {
        zeroize::Zeroize::zeroize(&mut self.held[..]);
    }
}

impl<B> Body for Masked<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = &mut *self;
        loop {
            if this.done {
                if !this.held.is_empty() {
                    let rest = this.held.split().freeze();
                    return Poll::Ready(Some(Ok(Frame::data(rest))));
                }
                return Poll::Ready(this.trailers.take().map(|t| Ok(Frame::trailers(t))));
            }
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => this.done = true,
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e))),
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => {
                        this.held.extend_from_slice(&data);
                        mask(&mut this.held[..], &this.masks);
                        let keep = partial_tail(&this.held, &this.masks);
                        let ready = this.held.len() - keep;
                        if ready > 0 {
                            let out = this.held.split_to(ready).freeze();
                            return Poll::Ready(Some(Ok(Frame::data(out))));
                        }
                    }
                    Err(frame) => {
                        this.trailers = frame.into_trailers().ok();
                        this.done = true;
                    }
                },
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.held.is_empty() && self.trailers.is_none()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        let mut hint = self.inner.size_hint();
        let held = self.held.len() as u64;
        hint.set_lower(hint.lower() + held);
        if let Some(upper) = hint.upper() {
            hint.set_upper(upper + held);
        }
        hint
    }
}

/// A stream that counts the bytes through it into the connection's counters.
struct Counted<S> {
    inner: S,
    counters: Arc<Counters>,
}

impl<S: AsyncRead + Unpin> AsyncRead for Counted<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        let n = (buf.filled().len() - before) as u64;
        self.counters.down.fetch_add(n, Ordering::Relaxed);
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Counted<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = &r {
            self.counters.up.fetch_add(*n as u64, Ordering::Relaxed);
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn masks(list: &[&str]) -> Vec<Zeroizing<Vec<u8>>> {
        list.iter()
            .map(|m| Zeroizing::new(m.as_bytes().to_vec()))
            .collect()
    }

    #[test]
    fn a_host_part_is_followed_by_a_port_or_nothing() {
        assert_eq!(host_part("api.test"), Some("api.test"));
        assert_eq!(host_part("api.test:443"), Some("api.test"));
        assert_eq!(host_part("api.test:"), Some("api.test"));
        assert_eq!(host_part("[2001:db8::1]:80"), Some("2001:db8::1"));
        assert_eq!(host_part("[2001:db8::1]"), Some("2001:db8::1"));
        for bad in [
            "api.test:80@evil.test",
            "api.test:evil.test",
            "[2001:db8::1]evil",
            "[2001:db8::1",
        ] {
            assert_eq!(host_part(bad), None, "{bad}");
        }
    }

    #[test]
    fn masking_hides_every_occurrence_and_keeps_the_length() {
        let m = masks(&["supersecret", "tok-12345678"]);
        let mut buf = b"a supersecret b tok-12345678 supersecret".to_vec();
        let len = buf.len();
        assert!(mask(&mut buf, &m));
        assert_eq!(buf, b"a *********** b ************ ***********".to_vec());
        assert_eq!(buf.len(), len);
        let mut clean = b"nothing here".to_vec();
        assert!(!mask(&mut clean, &m));
    }

    #[test]
    fn only_a_possible_start_of_a_secret_is_held_back() {
        let m = masks(&["supersecret"]);
        assert_eq!(partial_tail(b"hello world", &m), 0);
        assert_eq!(partial_tail(b"hello supers", &m), 6);
        assert_eq!(partial_tail(b"hello s", &m), 1);
        assert_eq!(partial_tail(b"", &m), 0);
        // A whole occurrence is masked before this is asked, never held.
        assert_eq!(partial_tail(b"xsupersecret", &m), 0);
    }

    #[tokio::test]
    async fn a_secret_split_across_chunks_is_masked() {
        let chunks: Vec<Result<Frame<Bytes>, std::convert::Infallible>> = vec![
            Ok(Frame::data(Bytes::from_static(b"echo: Bearer super"))),
            Ok(Frame::data(Bytes::from_static(b"secret and sup"))),
            Ok(Frame::data(Bytes::from_static(b"er"))),
        ];
        let inner = http_body_util::StreamBody::new(futures::stream::iter(chunks));
        let body = Masked::new(inner, masks(&["supersecret"]));
        let out = body.collect().await.unwrap().to_bytes();
        assert_eq!(&out[..], b"echo: Bearer *********** and super");
    }

    #[test]
    fn an_upstream_failure_reads_as_before_and_keeps_the_os_error() {
        use std::error::Error as _;
        let addr: SocketAddr = "192.0.2.5:443".parse().unwrap();
        let e = UpstreamError {
            host: "api.test".into(),
            addr,
            why: UpstreamFailure::Connect(io::Error::from(io::ErrorKind::ConnectionRefused)),
        };
        assert!(
            e.to_string()
                .starts_with("upstream api.test (192.0.2.5:443): "),
            "{e}"
        );
        let step = e.source().expect("the failed step is kept");
        let os = step.source().expect("the OS error is kept");
        assert_eq!(
            os.downcast_ref::<io::Error>().map(io::Error::kind),
            Some(io::ErrorKind::ConnectionRefused)
        );
        let timeout = UpstreamError {
            host: "api.test".into(),
            addr,
            why: UpstreamFailure::TlsTimeout,
        };
        assert_eq!(
            timeout.to_string(),
            "upstream api.test (192.0.2.5:443): TLS handshake timed out"
        );
    }
}
