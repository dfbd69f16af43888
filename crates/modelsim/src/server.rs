//! The HTTP(S) server: routes the wire APIs, records each request, answers from the script.

use crate::ModelSimError;
use crate::record::{RecordedRequest, Recorder};
use crate::script::{Resolved, Script};
use crate::tls::TlsIdentity;
use crate::wire::{self, Answer, Api};
use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;

/// Request bodies above this are refused: harness prompts with every tool are ~100 KB.
const MAX_BODY: usize = 32 << 20;

/// How a model server is started.
#[derive(Debug, Clone)]
pub struct Config {
    /// The address to listen on; port 0 picks a free one.
    pub listen: SocketAddr,
    pub script: Script,
    /// Serve HTTPS with this identity instead of plain HTTP.
    pub tls: Option<TlsIdentity>,
    /// Also append every request to this JSON lines file.
    pub log: Option<PathBuf>,
    /// Refuse (401) model requests that do not carry this key as `x-api-key` or bearer token.
    pub api_key: Option<String>,
}

impl Config {
    /// Plain HTTP on `listen`, no log, any key accepted.
    pub fn new(listen: SocketAddr, script: Script) -> Self {
        Config {
            listen,
            script,
            tls: None,
            log: None,
            api_key: None,
        }
    }

    /// Serves HTTPS with `identity`.
    pub fn tls(mut self, identity: TlsIdentity) -> Self {
        self.tls = Some(identity);
        self
    }

    /// Appends requests to `path` as JSON lines.
    pub fn log(mut self, path: PathBuf) -> Self {
        self.log = Some(path);
        self
    }

    /// Accepts only requests carrying `key`.
    pub fn api_key(mut self, key: impl Into<String>) -> Self {
        self.api_key = Some(key.into());
        self
    }
}

struct State {
    script: Script,
    api_key: Option<String>,
    recorder: Recorder,
    seq: AtomicU64,
}

/// A running model server; dropping it stops it.
pub struct ModelServer {
    addr: SocketAddr,
    https: bool,
    state: Arc<State>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl ModelServer {
    /// Binds `config.listen` and starts serving.
    pub async fn start(config: Config) -> Result<Self, ModelSimError> {
        let tls = match &config.tls {
            Some(identity) => Some(tokio_rustls::TlsAcceptor::from(identity.server_config()?)),
            None => None,
        };
        let log = match &config.log {
            Some(path) => Some(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .map_err(|source| ModelSimError::OpenLog {
                        path: path.clone(),
                        source,
                    })?,
            ),
            None => None,
        };
        let bind = |source| ModelSimError::Bind {
            addr: config.listen,
            source,
        };
        let listener = TcpListener::bind(config.listen).await.map_err(bind)?;
        let addr = listener.local_addr().map_err(bind)?;
        let state = Arc::new(State {
            script: config.script,
            api_key: config.api_key,
            recorder: Recorder::new(log),
            seq: AtomicU64::new(0),
        });
        let (stop, stopped) = oneshot::channel();
        let https = tls.is_some();
        let task = tokio::spawn(accept_loop(listener, tls, state.clone(), stopped));
        tracing::info!(%addr, https, "model server listening");
        Ok(ModelServer {
            addr,
            https,
            state,
            stop: Some(stop),
            task: Some(task),
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR` or `https://ADDR`, without a path.
    pub fn base_url(&self) -> String {
        let scheme = if self.https { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }

    /// Every request received so far, in arrival order.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.state.recorder.all()
    }

    /// Waits until `pred` holds for the requests received so far; `None` after `timeout`.
    pub async fn wait_for(
        &self,
        timeout: Duration,
        pred: impl FnMut(&[RecordedRequest]) -> bool,
    ) -> Option<Vec<RecordedRequest>> {
        self.state.recorder.wait_for(timeout, pred).await
    }

    /// Stops accepting and closes open connections.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for ModelServer {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

async fn accept_loop(
    listener: TcpListener,
    tls: Option<tokio_rustls::TlsAcceptor>,
    state: Arc<State>,
    mut stopped: oneshot::Receiver<()>,
) {
    // Owning the connections here means stopping the loop (or aborting it) ends them too.
    let mut conns = JoinSet::new();
    loop {
        let (stream, peer) = tokio::select! {
            _ = &mut stopped => return,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of descriptors and the like pass; a pause keeps it from spinning.
                    tracing::warn!(error = %e, "accept");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        while conns.try_join_next().is_some() {}
        let state = state.clone();
        let tls = tls.clone();
        conns.spawn(async move {
            let service = hyper::service::service_fn(move |req| handle(state.clone(), req));
            let http = hyper::server::conn::http1::Builder::new();
            let served = match tls {
                Some(acceptor) => match acceptor.accept(stream).await {
                    Ok(stream) => http.serve_connection(TokioIo::new(stream), service).await,
                    Err(e) => {
                        tracing::debug!(%peer, error = %e, "TLS handshake");
                        return;
                    }
                },
                None => http.serve_connection(TokioIo::new(stream), service).await,
            };
            if let Err(e) = served {
                tracing::debug!(%peer, error = %e, "connection");
            }
        });
    }
}

type ResBody = BoxBody<Bytes, Infallible>;

fn route(method: &Method, path: &str) -> Api {
    let path = path.strip_prefix("/v1").unwrap_or(path);
    match (method, path) {
        (&Method::POST, "/chat/completions") => Api::ChatCompletions,
        (&Method::POST, "/messages") => Api::Messages,
        (&Method::POST, "/messages/count_tokens") => Api::CountTokens,
        (&Method::POST, "/responses") => Api::Responses,
        (&Method::GET, "/models") => Api::Models,
        _ => Api::Unknown,
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn json_response(status: StatusCode, body: &Value) -> Response<ResBody> {
    let mut res = Response::new(Full::new(Bytes::from(body.to_string())).boxed());
    *res.status_mut() = status;
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    res
}

/// The error body each API's clients parse.
fn error_body(api: Api, kind: &str, message: &str) -> Value {
    match api {
        Api::Messages | Api::CountTokens => {
            json!({"type": "error", "error": {"type": kind, "message": message}})
        }
        _ => json!({"error": {"message": message, "type": kind, "code": kind}}),
    }
}

async fn handle(
    state: Arc<State>,
    req: Request<Incoming>,
) -> Result<Response<ResBody>, Infallible> {
    let (parts, body) = req.into_parts();
    let seq = state.seq.fetch_add(1, Ordering::Relaxed) + 1;
    let api = route(&parts.method, parts.uri.path());
    let mut headers: BTreeMap<String, String> = BTreeMap::new();
    for (name, value) in &parts.headers {
        let value = String::from_utf8_lossy(value.as_bytes()).into_owned();
        headers
            .entry(name.as_str().to_string())
            .and_modify(|v| {
                v.push_str(", ");
                v.push_str(&value);
            })
            .or_insert(value);
    }
    let mut record = RecordedRequest {
        seq,
        time_ms: 0,
        method: parts.method.to_string(),
        path: parts.uri.path().to_string(),
        query: parts.uri.query().map(str::to_string),
        headers,
        api,
        turn: None,
        side: false,
        stream: false,
        status: 200,
        note: None,
        body: Value::Null,
    };
    let raw = match http_body_util::Limited::new(body, MAX_BODY).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            record.time_ms = now_ms();
            record.status = 400;
            record.note = Some(format!("reading the body: {e}"));
            state.recorder.push(record);
            let body = error_body(api, "invalid_request_error", "unreadable body");
            return Ok(json_response(StatusCode::BAD_REQUEST, &body));
        }
    };
    record.time_ms = now_ms();
    let parsed: Option<Value> = serde_json::from_slice(&raw).ok();
    record.body = match &parsed {
        Some(v) => v.clone(),
        None if raw.is_empty() => Value::Null,
        None => Value::String(String::from_utf8_lossy(&raw).into_owned()),
    };
    let is_model_call = matches!(
        api,
        Api::ChatCompletions | Api::Messages | Api::Responses | Api::CountTokens
    );
    if is_model_call
        && let Some(key) = &state.api_key
        && record.api_key() != Some(key.as_str())
    {
        record.status = 401;
        record.note = Some("the request's API key is not the expected one".into());
        state.recorder.push(record);
        let body = error_body(api, "authentication_error", "invalid API key");
        return Ok(json_response(StatusCode::UNAUTHORIZED, &body));
    }
    let model_id = state.script.model.as_deref().unwrap_or("modelsim");
    let body = match (api, parsed) {
        (Api::Unknown, _) => {
            record.status = 404;
            state.recorder.push(record);
            let body = error_body(api, "not_found_error", "modelsim does not serve this path");
            return Ok(json_response(StatusCode::NOT_FOUND, &body));
        }
        (Api::Models, _) => {
            state.recorder.push(record);
            // Fields of both the OpenAI and the Anthropic model list.
            let body = json!({
                "object": "list",
                "data": [{"id": model_id, "object": "model", "type": "model", "created": 0,
                          "owned_by": "modelsim", "display_name": model_id,
                          "created_at": "2025-01-01T00:00:00Z"}],
                "has_more": false, "first_id": model_id, "last_id": model_id,
            });
            return Ok(json_response(StatusCode::OK, &body));
        }
        (_, None) => {
            record.status = 400;
            record.note = Some("the body is not JSON".into());
            state.recorder.push(record);
            let body = error_body(api, "invalid_request_error", "the body is not JSON");
            return Ok(json_response(StatusCode::BAD_REQUEST, &body));
        }
        (_, Some(body)) => body,
    };
    if api == Api::CountTokens {
        state.recorder.push(record);
        let body = wire::messages::count_tokens(raw.len());
        return Ok(json_response(StatusCode::OK, &body));
    }
    let request = match api {
        Api::ChatCompletions => wire::chat::parse(&body, raw.len()),
        Api::Messages => wire::messages::parse(&body, raw.len()),
        _ => wire::responses::parse(&body, raw.len()),
    };
    let resolved: Resolved = state
        .script
        .resolve(request.assistant_turns, &request.tools, seq);
    record.turn = resolved.turn;
    record.side = resolved.side;
    record.stream = request.stream;
    record.note = resolved.note.clone();
    tracing::info!(
        seq,
        ?api,
        turn = ?resolved.turn,
        side = resolved.side,
        stream = request.stream,
        calls = resolved.calls.len(),
        "model request"
    );
    if let Some(note) = &resolved.note {
        tracing::warn!(seq, "{note}");
    }
    state.recorder.push(record);
    if !resolved.delay.is_zero() {
        tokio::time::sleep(resolved.delay).await;
    }
    let created = i64::try_from(now_ms() / 1000).unwrap_or(0);
    let answer = match api {
        Api::ChatCompletions => wire::chat::render(&request, &resolved, seq, created),
        Api::Messages => wire::messages::render(&request, &resolved, seq),
        _ => wire::responses::render(&request, &resolved, seq, created),
    };
    Ok(match answer {
        Answer::Json(v) => json_response(StatusCode::OK, &v),
        Answer::Sse(events) => sse_response(events),
    })
}

/// Sends each event as its own body frame, so the client reads them as they come.
fn sse_response(events: Vec<(Option<&'static str>, String)>) -> Response<ResBody> {
    let (tx, rx) = mpsc::channel(8);
    tokio::spawn(async move {
        for (name, data) in events {
            let frame = match name {
                Some(name) => format!("event: {name}\ndata: {data}\n\n"),
                None => format!("data: {data}\n\n"),
            };
            if tx.send(Bytes::from(frame)).await.is_err() {
                return;
            }
        }
    });
    let mut res = Response::new(ChannelBody { rx }.boxed());
    let h = res.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/event-stream"),
    );
    h.insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-cache"),
    );
    res
}

/// A response body fed by a channel; it ends when the sender is dropped.
struct ChannelBody {
    rx: mpsc::Receiver<Bytes>,
}

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.rx
            .poll_recv(cx)
            .map(|chunk| chunk.map(|c| Ok(Frame::data(c))))
    }
}
