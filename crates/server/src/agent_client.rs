//! Reaching a sandbox's agent: Connect RPC clients and a raw HTTP client, both over the
//! agent's unix socket (the transport a vsock one would later replace).

use connectrpc::client::{ClientBody, ClientConfig, ServiceTransport};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use sandpit_proto::filesystem::FilesystemClient;
use sandpit_proto::process::ProcessClient;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

/// Connects to one agent socket for every request of a pooled client.
#[derive(Clone)]
pub struct UnixConnector(Arc<PathBuf>);

impl tower::Service<http::Uri> for UnixConnector {
    type Response = TokioIo<tokio::net::UnixStream>;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _uri: http::Uri) -> Self::Future {
        let path = self.0.clone();
        Box::pin(async move { Ok(TokioIo::new(tokio::net::UnixStream::connect(&*path).await?)) })
    }
}

type RpcTransport = ServiceTransport<Client<UnixConnector, ClientBody>>;

/// Clients for one sandbox's agent.
pub struct AgentConn {
    pub process: ProcessClient<RpcTransport>,
    pub fs: FilesystemClient<RpcTransport>,
    pub http: Client<UnixConnector, axum::body::Body>,
}

/// The authority used in requests to the agent; the socket decides where they go.
pub const AGENT_BASE: &str = "http://sandbox-agent";

impl AgentConn {
    /// Clients that connect to `socket` on demand.
    pub fn new(socket: PathBuf) -> Self {
        let connector = UnixConnector(Arc::new(socket));
        let rpc = Client::builder(TokioExecutor::new()).build(connector.clone());
        let http = Client::builder(TokioExecutor::new()).build(connector);
        let base: http::Uri = http::Uri::from_static(AGENT_BASE);
        let transport = ServiceTransport::new(rpc);
        Self {
            process: ProcessClient::new(transport.clone(), ClientConfig::new(base.clone())),
            fs: FilesystemClient::new(transport, ClientConfig::new(base)),
            http,
        }
    }

    /// True once the agent answers its health check.
    pub async fn healthy(&self) -> bool {
        let Ok(req) =
            http::Request::get(format!("{AGENT_BASE}/health")).body(axum::body::Body::empty())
        else {
            return false;
        };
        // Bounded: a frozen or wedged agent must not stall whoever asks.
        let answer =
            tokio::time::timeout(std::time::Duration::from_secs(2), self.http.request(req)).await;
        matches!(answer, Ok(Ok(r)) if r.status().is_success())
    }
}
