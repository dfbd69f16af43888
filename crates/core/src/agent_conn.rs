//! Reaching a sandbox's agent: Connect RPC clients and a raw HTTP client over a byte
//! stream that an [`AgentTransport`] opens. Unix sockets are the transport today; a vsock
//! or virtio-console transport for microVMs implements the same trait.

use crate::error::CoreError;
use connectrpc::client::{ClientBody, ClientConfig, ServiceTransport};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::{Connected, Connection};
use hyper_util::rt::{TokioExecutor, TokioIo};
use sandpit_proto::filesystem::FilesystemClient;
use sandpit_proto::process::ProcessClient;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};

/// A bidirectional byte stream to an agent.
pub trait AgentStream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> AgentStream for T {}

/// Future of a new connection to an agent.
pub type Connecting = Pin<Box<dyn Future<Output = std::io::Result<Box<dyn AgentStream>>> + Send>>;

/// Opens connections to one sandbox's agent.
pub trait AgentTransport: Send + Sync + 'static {
    /// A fresh connection (HTTP/1.1 is spoken over it).
    fn connect(&self) -> Connecting;
}

/// The agent's unix socket on the host, as the container and process runtimes provide it.
pub struct UnixTransport(pub PathBuf);

impl AgentTransport for UnixTransport {
    fn connect(&self) -> Connecting {
        let path = self.0.clone();
        Box::pin(async move {
            let s = tokio::net::UnixStream::connect(path).await?;
            Ok(Box::new(s) as Box<dyn AgentStream>)
        })
    }
}

/// A connection as hyper wants it.
pub struct AgentIo(TokioIo<Box<dyn AgentStream>>);

impl Connection for AgentIo {
    fn connected(&self) -> Connected {
        Connected::new()
    }
}

impl hyper::rt::Read for AgentIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
    }
}

impl hyper::rt::Write for AgentIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }
}

/// Adapts a transport to the connector interface of hyper's pooled client.
#[derive(Clone)]
pub struct Connector(Arc<dyn AgentTransport>);

impl tower::Service<http::Uri> for Connector {
    type Response = AgentIo;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _uri: http::Uri) -> Self::Future {
        let connecting = self.0.connect();
        Box::pin(async move { Ok(AgentIo(TokioIo::new(connecting.await?))) })
    }
}

type RpcTransport = ServiceTransport<Client<Connector, ClientBody>>;

/// Clients for one sandbox's agent.
pub struct AgentConn {
    pub process: ProcessClient<RpcTransport>,
    pub fs: FilesystemClient<RpcTransport>,
    pub http: Client<Connector, AgentBody>,
}

/// Body of a raw HTTP request to an agent: any byte stream, boxed (uploads stream through).
pub type AgentBody =
    http_body_util::combinators::UnsyncBoxBody<bytes::Bytes, crate::error::BoxError>;

/// An empty request body.
pub fn empty_body() -> AgentBody {
    use http_body_util::BodyExt;
    http_body_util::Empty::new()
        .map_err(|e| match e {})
        .boxed_unsync()
}

/// A request body of the given bytes.
pub fn full_body(bytes: impl Into<bytes::Bytes>) -> AgentBody {
    use http_body_util::BodyExt;
    http_body_util::Full::new(bytes.into())
        .map_err(|e| match e {})
        .boxed_unsync()
}

/// Body of a response from an agent.
pub type ResponseBody = hyper::body::Incoming;

/// Largest single Connect message accepted from an agent (a directory listing, say).
pub const MAX_AGENT_MESSAGE: usize = 16 << 20;

/// Longest a filesystem call to an agent may take.
pub const FS_CALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(120);

/// The authority used in requests to the agent; the socket decides where they go.
pub const AGENT_BASE: &str = "http://sandbox-agent";

/// Idle connections each client keeps to its agent. Every request in flight has a
/// connection of its own, and a burst of them would otherwise leave them all open (for
/// hyper's default 90 s, without bound): bursts to several sandboxes in turn would add up
/// to the daemon's descriptor limit. A new connection to a local socket is cheap.
const POOL_MAX_IDLE: usize = 4;
/// How long an idle connection to an agent is kept.
const POOL_IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

fn client_builder() -> hyper_util::client::legacy::Builder {
    let mut b = Client::builder(TokioExecutor::new());
    b.pool_max_idle_per_host(POOL_MAX_IDLE)
        .pool_idle_timeout(POOL_IDLE_TIMEOUT)
        .pool_timer(hyper_util::rt::TokioTimer::new());
    b
}

impl AgentConn {
    /// Clients that connect to the agent's unix socket on demand.
    pub fn new(socket: PathBuf) -> Self {
        Self::over(Arc::new(UnixTransport(socket)))
    }

    /// Clients over any transport.
    pub fn over(transport: Arc<dyn AgentTransport>) -> Self {
        let connector = Connector(transport);
        let rpc = client_builder().build(connector.clone());
        let http = client_builder().build(connector);
        let base: http::Uri = http::Uri::from_static(AGENT_BASE);
        // What a compromised agent may send back in one message is bounded.
        let config = ClientConfig::new(base).with_default_max_message_size(MAX_AGENT_MESSAGE);
        let transport = ServiceTransport::new(rpc);
        Self {
            process: ProcessClient::new(transport.clone(), config.clone()),
            // Every filesystem call the daemon makes is unary; a wedged agent must not hold
            // a request forever (commands stream and are bounded by their own timeouts).
            fs: FilesystemClient::new(transport, config.with_default_timeout(FS_CALL_TIMEOUT)),
            http,
        }
    }

    /// Applies a sandbox's new settings (env, default workdir and user) through the
    /// agent's `/init`, as a claimed pool member or a restored sandbox needs.
    pub async fn init(&self, settings: &serde_json::Value) -> Result<(), CoreError> {
        let request = http::Request::post(format!("{AGENT_BASE}/init"))
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(full_body(settings.to_string()))
            .map_err(|e| CoreError::internal_from("build the /init request", e))?;
        let answer = tokio::time::timeout(Duration::from_secs(5), self.http.request(request))
            .await
            .map_err(|_| CoreError::unavailable("the sandbox agent did not answer /init"))?
            .map_err(|e| CoreError::unavailable(format!("agent /init: {e}")))?;
        if answer.status().is_success() {
            Ok(())
        } else {
            Err(CoreError::unavailable(format!(
                "agent /init answered {}",
                answer.status()
            )))
        }
    }

    /// The agent's count of a command's CPU time (µs) and memory peak (KiB).
    pub async fn rusage(&self, pid: i64) -> Option<(u64, u64)> {
        use http_body_util::BodyExt;
        #[derive(serde::Deserialize)]
        struct Answer {
            cpu_time_us: u64,
            max_rss_kb: u64,
        }
        let req = http::Request::get(format!("{AGENT_BASE}/rusage?pid={pid}"))
            .body(empty_body())
            .ok()?;
        let resp = tokio::time::timeout(Duration::from_secs(5), self.http.request(req))
            .await
            .ok()?
            .ok()?;
        if !resp.status().is_success() {
            return None;
        }
        // The agent runs inside the sandbox: what it answers is bounded and parsed, not trusted.
        let body = http_body_util::Limited::new(resp.into_body(), crate::usage::RUSAGE_LIMIT);
        let bytes = tokio::time::timeout(Duration::from_secs(5), body.collect())
            .await
            .ok()?
            .ok()?
            .to_bytes();
        let a: Answer = serde_json::from_slice(&bytes).ok()?;
        Some((a.cpu_time_us, a.max_rss_kb))
    }

    /// True once the agent answers its health check.
    pub async fn healthy(&self) -> bool {
        let Ok(req) = http::Request::get(format!("{AGENT_BASE}/health")).body(empty_body()) else {
            return false;
        };
        // Bounded: a frozen or wedged agent must not stall whoever asks.
        let answer =
            tokio::time::timeout(std::time::Duration::from_secs(2), self.http.request(req)).await;
        matches!(answer, Ok(Ok(r)) if r.status().is_success())
    }
}
