//! Async client of the sandpit daemon's REST API (`/v1`) and its command WebSockets.
//!
//! ```no_run
//! # async fn demo() -> Result<(), sandpit_client::ClientError> {
//! use sandpit_client::Client;
//! use sandpit_api::{CreateSandboxRequest, RunCommandRequest};
//!
//! let client = Client::new(sandpit_api::DEFAULT_URL, Some("sp_...".into()))?;
//! let sb = client.create_sandbox(&CreateSandboxRequest::default()).await?;
//! let req = RunCommandRequest { argv: vec!["echo".into(), "hi".into()], ..Default::default() };
//! let out = client.run(&sb.id, &req).await?;
//! assert_eq!(out.stdout, "hi\n");
//! client.delete_sandbox(&sb.id).await?;
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod agents;
mod approvals;
mod error;
mod leases;
mod local;
mod metrics;
mod secrets;
mod stream;
mod templates;
mod usage;

use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use reqwest::header::{AUTHORIZATION, HeaderMap, HeaderValue};
use reqwest::{Method, RequestBuilder, Response, Url};
use sandpit_api::{
    BackgroundCommand, CommandInfo, CreateSandboxRequest, DaemonInfo, EntryInfo, MoveRequest,
    PathRequest, Pool, PoolList, PoolSpec, ResizePoolRequest, RunCommandRequest,
    RunCommandResponse, Sandbox, SandboxList, SandboxStats, SetTimeoutRequest, SignalRequest,
    StdinRequest, Template, Volume, VolumeList,
};
use sandpit_api::{
    CreateSnapshotRequest, ForkRequest, ForkResponse, PauseRequest, Snapshot, SnapshotCheck,
    SnapshotList,
};
use serde::de::DeserializeOwned;
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

pub use agents::{RunFollower, TERMINAL_STATES, is_terminal};
pub use error::ClientError;
pub use leases::{SANDBOX_NOT_FOUND, SANDBOX_STOPPED, SandboxLease};
pub use local::{default_data_dir, local_admin_key};
/// Request bodies for [`Client::write_file`] (e.g. `Body::wrap_stream` of any byte stream).
pub use reqwest::Body;
pub use stream::{CommandStream, decode_data};

/// How long establishing a TCP connection to the daemon may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// A handle to one daemon; cheap to clone (clones share a connection pool).
#[derive(Debug, Clone)]
pub struct Client {
    http: reqwest::Client,
    base: Url,
    /// `Bearer <key>`, kept for WebSocket upgrades (plain requests get it as a default header).
    auth: Option<HeaderValue>,
}

impl Client {
    /// A client of the daemon at `base_url` (e.g. `http://127.0.0.1:7423`), authenticating
    /// every request with `api_key` as a bearer token when one is given.
    pub fn new(base_url: &str, api_key: Option<String>) -> Result<Client, ClientError> {
        let base = Url::parse(base_url)
            .map_err(|e| ClientError::Config(format!("bad URL {base_url:?}: {e}")))?;
        if !matches!(base.scheme(), "http" | "https") || base.cannot_be_a_base() {
            return Err(ClientError::Config(format!(
                "bad URL {base_url:?}: expected http://HOST[:PORT]"
            )));
        }
        let auth = match api_key {
            Some(key) => {
                let mut value =
                    HeaderValue::from_str(&format!("Bearer {}", key.trim())).map_err(|_| {
                        ClientError::Config(
                            "the API key has characters a header cannot carry".into(),
                        )
                    })?;
                value.set_sensitive(true);
                Some(value)
            }
            None => None,
        };
        let mut headers = HeaderMap::new();
        if let Some(value) = &auth {
            headers.insert(AUTHORIZATION, value.clone());
        }
        let mut builder = reqwest::Client::builder()
            .default_headers(headers)
            .user_agent(concat!("sandpit-client/", env!("CARGO_PKG_VERSION")))
            .connect_timeout(CONNECT_TIMEOUT)
            .tcp_nodelay(true);
        // A proxy from the environment must not capture traffic to a local daemon.
        if is_loopback(&base) {
            builder = builder.no_proxy();
        }
        let http = builder.build()?;
        Ok(Client { http, base, auth })
    }

    /// The daemon's base URL.
    pub fn base_url(&self) -> &Url {
        &self.base
    }

    // ---- daemon ----

    /// `GET /v1/health`: succeeds if the daemon answers.
    pub async fn health(&self) -> Result<(), ClientError> {
        self.send(self.req(Method::GET, &["health"])?)
            .await
            .map(drop)
    }

    /// `GET /v1/info`: version, runtimes and limits of the daemon.
    pub async fn info(&self) -> Result<DaemonInfo, ClientError> {
        self.json(self.req(Method::GET, &["info"])?).await
    }

    /// `GET /v1/templates`.
    pub async fn list_templates(&self) -> Result<Vec<Template>, ClientError> {
        self.json(self.req(Method::GET, &["templates"])?).await
    }

    // ---- warm pools ----

    /// `GET /v1/pools`: every warm pool with its ready count and hit/miss counters.
    pub async fn list_pools(&self) -> Result<Vec<Pool>, ClientError> {
        let list: PoolList = self.json(self.req(Method::GET, &["pools"])?).await?;
        Ok(list.items)
    }

    /// `GET /v1/pools/{name}`.
    pub async fn get_pool(&self, name: &str) -> Result<Pool, ClientError> {
        self.json(self.req(Method::GET, &["pools", name])?).await
    }

    /// `POST /v1/pools` (admin key): creates a pool; it fills in the background.
    pub async fn create_pool(&self, spec: &PoolSpec) -> Result<Pool, ClientError> {
        self.json(self.req(Method::POST, &["pools"])?.json(spec))
            .await
    }

    /// `PATCH /v1/pools/{name}` (admin key): changes how many idle sandboxes it keeps.
    pub async fn resize_pool(&self, name: &str, size: u32) -> Result<Pool, ClientError> {
        let body = ResizePoolRequest { size };
        self.json(self.req(Method::PATCH, &["pools", name])?.json(&body))
            .await
    }

    /// `DELETE /v1/pools/{name}` (admin key): removes the pool and its idle sandboxes.
    pub async fn delete_pool(&self, name: &str) -> Result<(), ClientError> {
        self.send(self.req(Method::DELETE, &["pools", name])?)
            .await
            .map(drop)
    }

    // ---- volumes ----

    /// `POST /v1/volumes`: creates a volume of `size_bytes`, ready when this returns.
    pub async fn create_volume(&self, name: &str, size_bytes: u64) -> Result<Volume, ClientError> {
        let body = sandpit_api::CreateVolumeRequest {
            name: name.to_string(),
            size_bytes,
        };
        self.json(self.req(Method::POST, &["volumes"])?.json(&body))
            .await
    }

    /// `GET /v1/volumes`: the caller's volumes with their usage.
    pub async fn list_volumes(&self) -> Result<Vec<Volume>, ClientError> {
        let list: VolumeList = self.json(self.req(Method::GET, &["volumes"])?).await?;
        Ok(list.items)
    }

    /// `GET /v1/volumes/{name}`: size, usage and the sandboxes that have it mounted.
    pub async fn get_volume(&self, name: &str) -> Result<Volume, ClientError> {
        self.json(self.req(Method::GET, &["volumes", name])?).await
    }

    /// `DELETE /v1/volumes/{name}`: deletes the volume and its data (refused while mounted).
    pub async fn delete_volume(&self, name: &str) -> Result<(), ClientError> {
        self.send(self.req(Method::DELETE, &["volumes", name])?)
            .await
            .map(drop)
    }

    // ---- sandboxes ----

    /// `POST /v1/sandboxes`: creates a sandbox and returns it once it runs.
    pub async fn create_sandbox(&self, req: &CreateSandboxRequest) -> Result<Sandbox, ClientError> {
        self.json(self.req(Method::POST, &["sandboxes"])?.json(req))
            .await
    }

    /// `GET /v1/sandboxes`: one page of the caller's sandboxes, optionally filtered by state
    /// and by metadata (every `(key, value)` pair must match).
    pub async fn list_sandboxes(
        &self,
        state: Option<&str>,
        metadata: &[(String, String)],
        limit: Option<u32>,
        cursor: Option<&str>,
    ) -> Result<SandboxList, ClientError> {
        let mut query: Vec<(&str, String)> = Vec::new();
        if let Some(state) = state {
            query.push(("state", state.to_string()));
        }
        for (k, v) in metadata {
            query.push(("metadata", format!("{k}={v}")));
        }
        if let Some(limit) = limit {
            query.push(("limit", limit.to_string()));
        }
        if let Some(cursor) = cursor {
            query.push(("cursor", cursor.to_string()));
        }
        self.json(self.req(Method::GET, &["sandboxes"])?.query(&query))
            .await
    }

    /// `GET /v1/sandboxes/{id}`.
    pub async fn get_sandbox(&self, id: &str) -> Result<Sandbox, ClientError> {
        self.json(self.req(Method::GET, &["sandboxes", id])?).await
    }

    /// `DELETE /v1/sandboxes/{id}`: kills the sandbox and removes everything it had.
    pub async fn delete_sandbox(&self, id: &str) -> Result<(), ClientError> {
        self.send(self.req(Method::DELETE, &["sandboxes", id])?)
            .await
            .map(drop)
    }

    /// `POST /v1/sandboxes/{id}/timeout`: the sandbox now expires `secs` seconds from now.
    pub async fn set_timeout(&self, id: &str, secs: u64) -> Result<(), ClientError> {
        let body = SetTimeoutRequest { timeout: secs };
        self.send(
            self.req(Method::POST, &["sandboxes", id, "timeout"])?
                .json(&body),
        )
        .await
        .map(drop)
    }

    /// `POST /v1/sandboxes/{id}/keepalive`: restarts the sandbox's expiry countdown.
    pub async fn keepalive(&self, id: &str) -> Result<(), ClientError> {
        self.send(self.req(Method::POST, &["sandboxes", id, "keepalive"])?)
            .await
            .map(drop)
    }

    /// `POST /v1/sandboxes/{id}/pause`: freezes every process of the sandbox, memory kept.
    pub async fn pause(&self, id: &str) -> Result<Sandbox, ClientError> {
        self.json(self.req(Method::POST, &["sandboxes", id, "pause"])?)
            .await
    }

    /// `POST /v1/sandboxes/{id}/pause` with `memory: false`: ends the sandbox's processes
    /// and keeps its files; a resume starts it again on them.
    pub async fn hibernate(&self, id: &str) -> Result<Sandbox, ClientError> {
        let body = PauseRequest {
            memory: Some(false),
        };
        self.json(
            self.req(Method::POST, &["sandboxes", id, "pause"])?
                .json(&body),
        )
        .await
    }

    /// `POST /v1/sandboxes/{id}/resume`: thaws a paused sandbox or restarts a hibernated one.
    pub async fn resume(&self, id: &str) -> Result<Sandbox, ClientError> {
        self.json(self.req(Method::POST, &["sandboxes", id, "resume"])?)
            .await
    }

    /// `POST /v1/sandboxes/{id}/snapshots`: captures the sandbox's files.
    pub async fn snapshot(
        &self,
        id: &str,
        req: &CreateSnapshotRequest,
    ) -> Result<Snapshot, ClientError> {
        self.json(
            self.req(Method::POST, &["sandboxes", id, "snapshots"])?
                .json(req),
        )
        .await
    }

    /// `GET /v1/snapshots`: the caller's snapshots, newest first.
    pub async fn list_snapshots(&self) -> Result<SnapshotList, ClientError> {
        self.json(self.req(Method::GET, &["snapshots"])?).await
    }

    /// `GET /v1/snapshots/{id}`: one snapshot by id or name.
    pub async fn get_snapshot(&self, id: &str) -> Result<Snapshot, ClientError> {
        self.json(self.req(Method::GET, &["snapshots", id])?).await
    }

    /// `DELETE /v1/snapshots/{id}`; `force` also deletes the snapshots built on it.
    pub async fn delete_snapshot(&self, id: &str, force: bool) -> Result<(), ClientError> {
        let mut rb = self.req(Method::DELETE, &["snapshots", id])?;
        if force {
            rb = rb.query(&[("force", "true")]);
        }
        self.send(rb).await.map(drop)
    }

    /// `POST /v1/snapshots/{id}/verify`: checks the stored archives of its chain.
    pub async fn verify_snapshot(&self, id: &str) -> Result<SnapshotCheck, ClientError> {
        self.json(self.req(Method::POST, &["snapshots", id, "verify"])?)
            .await
    }

    /// `POST /v1/sandboxes/{id}/fork`: independent copies of the sandbox's files.
    pub async fn fork(&self, id: &str, req: &ForkRequest) -> Result<Vec<Sandbox>, ClientError> {
        let resp: ForkResponse = self
            .json(
                self.req(Method::POST, &["sandboxes", id, "fork"])?
                    .json(req),
            )
            .await?;
        Ok(resp.items)
    }

    /// `GET /v1/sandboxes/{id}/network`: the sandbox's egress policy.
    pub async fn get_network(
        &self,
        id: &str,
    ) -> Result<sandpit_api::network::NetworkPolicy, ClientError> {
        self.json(self.req(Method::GET, &["sandboxes", id, "network"])?)
            .await
    }

    /// `PUT /v1/sandboxes/{id}/network`: replaces the sandbox's egress policy.
    pub async fn set_network(
        &self,
        id: &str,
        policy: &sandpit_api::network::NetworkPolicy,
    ) -> Result<sandpit_api::network::NetworkPolicy, ClientError> {
        self.json(
            self.req(Method::PUT, &["sandboxes", id, "network"])?
                .json(policy),
        )
        .await
    }

    /// `GET /v1/network/audit`: outbound attempts, newest first; `query` holds filters
    /// (`sandbox`, `since`, `until`, `verdict`, `limit`, `cursor`).
    pub async fn network_audit(
        &self,
        query: &[(&str, String)],
    ) -> Result<sandpit_api::network::NetworkAuditList, ClientError> {
        self.json(self.req(Method::GET, &["network", "audit"])?.query(query))
            .await
    }

    /// `GET /v1/sandboxes/{id}/stats`: current resource usage.
    pub async fn stats(&self, id: &str) -> Result<SandboxStats, ClientError> {
        self.json(self.req(Method::GET, &["sandboxes", id, "stats"])?)
            .await
    }

    // ---- commands ----

    /// `POST /v1/sandboxes/{id}/commands`: runs a command to completion (`background` is
    /// forced off) and returns its captured output.
    pub async fn run(
        &self,
        id: &str,
        req: &RunCommandRequest,
    ) -> Result<RunCommandResponse, ClientError> {
        let body = RunCommandRequest {
            background: false,
            ..req.clone()
        };
        self.json(
            self.req(Method::POST, &["sandboxes", id, "commands"])?
                .json(&body),
        )
        .await
    }

    /// `POST /v1/sandboxes/{id}/commands` with `background` forced on: starts the command
    /// and returns its pid at once.
    pub async fn run_background(
        &self,
        id: &str,
        req: &RunCommandRequest,
    ) -> Result<BackgroundCommand, ClientError> {
        let body = RunCommandRequest {
            background: true,
            ..req.clone()
        };
        self.json(
            self.req(Method::POST, &["sandboxes", id, "commands"])?
                .json(&body),
        )
        .await
    }

    /// `GET /v1/sandboxes/{id}/commands`: the commands still running.
    pub async fn list_commands(&self, id: &str) -> Result<Vec<CommandInfo>, ClientError> {
        self.json(self.req(Method::GET, &["sandboxes", id, "commands"])?)
            .await
    }

    /// `POST /v1/sandboxes/{id}/commands/{pid}/signal` with `SIGTERM` or `SIGKILL`.
    pub async fn signal(&self, id: &str, pid: u32, signal: &str) -> Result<(), ClientError> {
        let pid = pid.to_string();
        let body = SignalRequest {
            signal: signal.to_string(),
        };
        let rb = self.req(Method::POST, &["sandboxes", id, "commands", &pid, "signal"])?;
        self.send(rb.json(&body)).await.map(drop)
    }

    /// `POST /v1/sandboxes/{id}/commands/{pid}/stdin`: writes `data`, then closes stdin if `close`.
    pub async fn send_stdin(
        &self,
        id: &str,
        pid: u32,
        data: &str,
        close: bool,
    ) -> Result<(), ClientError> {
        let pid = pid.to_string();
        let body = StdinRequest {
            data: data.to_string(),
            close,
        };
        let rb = self.req(Method::POST, &["sandboxes", id, "commands", &pid, "stdin"])?;
        self.send(rb.json(&body)).await.map(drop)
    }

    /// `GET /v1/sandboxes/{id}/commands/stream` (WebSocket): starts `req` and streams its events.
    pub async fn stream_command(
        &self,
        id: &str,
        req: &RunCommandRequest,
    ) -> Result<CommandStream, ClientError> {
        let text = serde_json::to_string(req).map_err(|e| ClientError::Decode(e.to_string()))?;
        let ws = self
            .connect_ws(&["sandboxes", id, "commands", "stream"])
            .await?;
        let mut stream = CommandStream::new(ws);
        stream.send_text(text).await?;
        Ok(stream)
    }

    /// `GET /v1/sandboxes/{id}/commands/{pid}/stream` (WebSocket): reattaches to a running
    /// command; the daemon replays `Start` and the output missed so far, then live events.
    pub async fn attach(&self, id: &str, pid: u32) -> Result<CommandStream, ClientError> {
        let pid = pid.to_string();
        let ws = self
            .connect_ws(&["sandboxes", id, "commands", &pid, "stream"])
            .await?;
        Ok(CommandStream::new(ws))
    }

    // ---- files ----

    /// `GET /v1/sandboxes/{id}/files?path=`: a whole file in memory.
    pub async fn read_file(&self, id: &str, path: &str) -> Result<Bytes, ClientError> {
        let rb = self
            .req(Method::GET, &["sandboxes", id, "files"])?
            .query(&[("path", path)]);
        Ok(self.send(rb).await?.bytes().await?)
    }

    /// `GET /v1/sandboxes/{id}/files?path=` as a stream of chunks (the status is checked
    /// before the first one).
    pub async fn download_stream(
        &self,
        id: &str,
        path: &str,
    ) -> Result<impl futures::Stream<Item = Result<Bytes, ClientError>> + Send + 'static, ClientError>
    {
        let rb = self
            .req(Method::GET, &["sandboxes", id, "files"])?
            .query(&[("path", path)]);
        let body = self.send(rb).await?.bytes_stream();
        Ok(body.map(|chunk| chunk.map_err(ClientError::from)))
    }

    /// `GET /v1/sandboxes/{id}/files?path=`, streamed into `out` (flushed at the end);
    /// returns the number of bytes written.
    pub async fn download_to<W>(
        &self,
        id: &str,
        path: &str,
        out: &mut W,
    ) -> Result<u64, ClientError>
    where
        W: AsyncWrite + Unpin + ?Sized,
    {
        let mut body = std::pin::pin!(self.download_stream(id, path).await?);
        let mut written = 0u64;
        while let Some(chunk) = body.next().await {
            let chunk = chunk?;
            out.write_all(&chunk).await?;
            written += chunk.len() as u64;
        }
        out.flush().await?;
        Ok(written)
    }

    /// `PUT /v1/sandboxes/{id}/files?path=` with the raw bytes of `body`, creating or
    /// replacing the file (and its missing parent directories, as the daemon does).
    pub async fn write_file(
        &self,
        id: &str,
        path: &str,
        body: impl Into<reqwest::Body>,
    ) -> Result<(), ClientError> {
        let rb = self
            .req(Method::PUT, &["sandboxes", id, "files"])?
            .query(&[("path", path)]);
        self.send(rb.body(body)).await.map(drop)
    }

    /// Uploads the local file `local` to `path` in the sandbox, streaming it.
    pub async fn upload_from_file(
        &self,
        id: &str,
        path: &str,
        local: &Path,
    ) -> Result<(), ClientError> {
        let file = tokio::fs::File::open(local).await?;
        self.write_file(id, path, body_from_reader(file)).await
    }

    /// `GET /v1/sandboxes/{id}/files/list?path=&depth=`: the entries below `path`, down to
    /// `depth` levels (1 = direct children).
    pub async fn list_dir(
        &self,
        id: &str,
        path: &str,
        depth: u32,
    ) -> Result<Vec<EntryInfo>, ClientError> {
        let depth = depth.to_string();
        let rb = self
            .req(Method::GET, &["sandboxes", id, "files", "list"])?
            .query(&[("path", path), ("depth", &depth)]);
        self.json(rb).await
    }

    /// `GET /v1/sandboxes/{id}/files/stat?path=`.
    pub async fn stat(&self, id: &str, path: &str) -> Result<EntryInfo, ClientError> {
        let rb = self
            .req(Method::GET, &["sandboxes", id, "files", "stat"])?
            .query(&[("path", path)]);
        self.json(rb).await
    }

    /// `POST /v1/sandboxes/{id}/files/mkdir`: creates a directory and its missing parents.
    pub async fn mkdir(&self, id: &str, path: &str) -> Result<(), ClientError> {
        let body = PathRequest {
            path: path.to_string(),
        };
        self.send(
            self.req(Method::POST, &["sandboxes", id, "files", "mkdir"])?
                .json(&body),
        )
        .await
        .map(drop)
    }

    /// `POST /v1/sandboxes/{id}/files/move`: renames `from` to `to`.
    pub async fn move_path(&self, id: &str, from: &str, to: &str) -> Result<(), ClientError> {
        self.post_move(id, "move", from, to).await
    }

    /// `POST /v1/sandboxes/{id}/files/copy`: copies `from` (a file or directory tree) to `to`.
    pub async fn copy_path(&self, id: &str, from: &str, to: &str) -> Result<(), ClientError> {
        self.post_move(id, "copy", from, to).await
    }

    /// `DELETE /v1/sandboxes/{id}/files?path=`: removes a file or a whole directory tree.
    pub async fn remove(&self, id: &str, path: &str) -> Result<(), ClientError> {
        let rb = self
            .req(Method::DELETE, &["sandboxes", id, "files"])?
            .query(&[("path", path)]);
        self.send(rb).await.map(drop)
    }

    // ---- plumbing ----

    async fn post_move(&self, id: &str, op: &str, from: &str, to: &str) -> Result<(), ClientError> {
        let body = MoveRequest {
            from: from.to_string(),
            to: to.to_string(),
        };
        self.send(
            self.req(Method::POST, &["sandboxes", id, "files", op])?
                .json(&body),
        )
        .await
        .map(drop)
    }

    /// `base/v1/<segments...>`, each segment percent-encoded as one path component.
    fn endpoint(&self, segments: &[&str]) -> Result<Url, ClientError> {
        let mut url = self.base.clone();
        url.set_query(None);
        url.set_fragment(None);
        {
            let mut path = url
                .path_segments_mut()
                .map_err(|()| ClientError::Config(format!("{} cannot be a base URL", self.base)))?;
            path.pop_if_empty().push("v1").extend(segments);
        }
        Ok(url)
    }

    fn req(&self, method: Method, segments: &[&str]) -> Result<RequestBuilder, ClientError> {
        Ok(self.http.request(method, self.endpoint(segments)?))
    }

    /// Sends the request and turns an error status into [`ClientError::Api`].
    async fn send(&self, rb: RequestBuilder) -> Result<Response, ClientError> {
        let resp = rb.send().await?;
        let status = resp.status();
        if status.is_success() {
            return Ok(resp);
        }
        // The body is only the error's explanation; if even that fails, the status remains.
        let body = resp.bytes().await.unwrap_or_default();
        Err(error::from_body(status.as_u16(), &body))
    }

    async fn json<T: DeserializeOwned>(&self, rb: RequestBuilder) -> Result<T, ClientError> {
        let body = self.send(rb).await?.bytes().await?;
        decode_json(&body)
    }

    async fn connect_ws(&self, segments: &[&str]) -> Result<stream::Ws, ClientError> {
        let mut url = self.endpoint(segments)?;
        let scheme = if url.scheme() == "https" { "wss" } else { "ws" };
        url.set_scheme(scheme).map_err(|()| {
            ClientError::Config(format!("cannot make a WebSocket URL of {}", self.base))
        })?;
        let mut request = url.as_str().into_client_request()?;
        if let Some(auth) = &self.auth {
            request.headers_mut().insert(AUTHORIZATION, auth.clone());
        }
        // Interactive streams carry single keystrokes: no Nagle delay.
        let (ws, _response) =
            tokio_tungstenite::connect_async_with_config(request, None, true).await?;
        Ok(ws)
    }
}

/// A streamed request body reading `reader` to its end.
pub fn body_from_reader<R>(reader: R) -> reqwest::Body
where
    R: tokio::io::AsyncRead + Send + Sync + 'static,
{
    // The default 4 KiB chunks cost a syscall and a body frame each; 256 KiB chunks let an
    // upload run at the speed of the daemon rather than of the chunking.
    reqwest::Body::wrap_stream(tokio_util::io::ReaderStream::with_capacity(
        reader,
        256 << 10,
    ))
}

fn decode_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, ClientError> {
    serde_json::from_slice(body).map_err(|e| {
        let snippet: String = String::from_utf8_lossy(body).chars().take(200).collect();
        ClientError::Decode(format!("{e} in {snippet:?}"))
    })
}

fn is_loopback(url: &Url) -> bool {
    let Some(host) = url.host_str() else {
        return false;
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}
