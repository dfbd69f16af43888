//! Command routes: run to completion, background start, WebSocket streaming and reattach,
//! signals and stdin. All of them drive the agent's `process.Process` service.

use super::{ApiJson, AppState, Owner};
use crate::agent_client::AgentConn;
use crate::error::ApiError;
use crate::listener::StreamSlot;
use crate::usage::ExecMeter;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Path, State};
use axum::response::Response;
use axum::{Extension, Json};
use base64::Engine;
use connectrpc::client::CallOptions;
use http::StatusCode;
use sandpit_api::*;
use sandpit_proto::process::__buffa::oneof::process_event::Event;
use sandpit_proto::process::__buffa::oneof::process_event::data_event::Output;
use sandpit_proto::process::__buffa::oneof::process_input::Input;
use sandpit_proto::process::__buffa::oneof::process_selector::Selector;
use sandpit_proto::process::*;
use std::sync::Arc;
use std::time::{Duration, Instant};

const DEFAULT_OUTPUT_CAP: u64 = 10 << 20;
const MAX_OUTPUT_CAP: u64 = 64 << 20;
const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

/// Call options naming the user a command or file operation acts as (E2B's convention);
/// without one, the agent uses the sandbox's default user.
pub fn as_user(user: Option<&str>) -> Result<CallOptions, ApiError> {
    let Some(user) = user else {
        return Ok(CallOptions::default());
    };
    if user != "user" && user != "root" {
        return Err(ApiError::bad_request(format!(
            "unknown user {user:?}: use \"user\" or \"root\""
        )));
    }
    let value = format!("Basic {}", B64.encode(format!("{user}:")));
    CallOptions::default()
        .try_with_header("authorization", value)
        .map_err(|e| ApiError::internal(e.to_string()))
}

fn selector(pid: u32) -> ProcessSelector {
    ProcessSelector {
        selector: Some(Selector::Pid(pid)),
        ..Default::default()
    }
}

/// `keep_stdin`: leave a stdin pipe open for later input (WebSocket and background runs).
fn start_request(req: &RunCommandRequest, keep_stdin: bool) -> Result<StartRequest, ApiError> {
    let (cmd, args) = req
        .argv
        .split_first()
        .ok_or_else(|| ApiError::bad_request("argv must not be empty"))?;
    crate::manager::check_env(&req.env)?;
    let config = ProcessConfig {
        cmd: cmd.clone(),
        args: args.to_vec(),
        envs: req
            .env
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        cwd: req.cwd.clone(),
        ..Default::default()
    };
    let pty = req.pty.map(|p| PTY {
        size: pty::Size {
            cols: p.cols as u32,
            rows: p.rows as u32,
            ..Default::default()
        }
        .into(),
        ..Default::default()
    });
    Ok(StartRequest {
        process: config.into(),
        pty: pty.map(Into::into).unwrap_or_default(),
        tag: req.tag.clone(),
        stdin: Some(keep_stdin || req.stdin.is_some() || req.pty.is_some()),
        ..Default::default()
    })
}

async fn send_signal(conn: &AgentConn, pid: u32, sig: Signal) -> Result<(), ApiError> {
    let req = SendSignalRequest {
        process: selector(pid).into(),
        signal: sig.into(),
        ..Default::default()
    };
    conn.process.send_signal(req).await?;
    Ok(())
}

async fn kill(conn: &AgentConn, pid: u32) {
    if let Err(e) = send_signal(conn, pid, Signal::SIGNAL_SIGKILL).await {
        tracing::debug!(pid, error = %e.message, "kill after timeout");
    }
}

async fn write_stdin(
    conn: &AgentConn,
    pid: u32,
    data: Vec<u8>,
    close: bool,
) -> Result<(), ApiError> {
    if !data.is_empty() {
        let input = ProcessInput {
            input: Some(Input::Stdin(data)),
            ..Default::default()
        };
        conn.process
            .send_input(SendInputRequest {
                process: selector(pid).into(),
                input: input.into(),
                ..Default::default()
            })
            .await?;
    }
    if close {
        conn.process
            .close_stdin(CloseStdinRequest {
                process: selector(pid).into(),
                ..Default::default()
            })
            .await?;
    }
    Ok(())
}

/// Run a command: to completion (output captured up to a cap) or in the background.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/commands", request_body = RunCommandRequest,
    responses((status = 200, body = RunCommandResponse), (status = 202, body = BackgroundCommand), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn run(
    State(state): State<AppState>,
    owner: Owner,
    caller: crate::usage::Caller,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<RunCommandRequest>,
) -> Result<Response, ApiError> {
    use axum::response::IntoResponse;
    let (_, conn) = state.manager.agent(&owner.0, &id).await?;
    let mut meter = ExecMeter::begin(&state.manager, &caller, &id, &conn, &req);
    if req.pty.is_some() {
        return Err(ApiError::bad_request(
            "a pty needs the WebSocket route /commands/stream",
        ));
    }
    if req.background {
        let (pid, stream) = start(&conn, &req, true).await?;
        meter.started(pid);
        // Dropping the stream detaches: the agent keeps the output until someone reattaches.
        drop(stream);
        return Ok((StatusCode::ACCEPTED, Json(BackgroundCommand { pid })).into_response());
    }
    Ok(Json(run_metered(&conn, &req, &mut meter).await?).into_response())
}

type StartStream = connectrpc::client::ServerStream<
    hyper::body::Incoming,
    __buffa::view::StartResponseView<'static>,
>;

/// Starts a command, feeds its stdin text, and returns its pid with the event stream.
pub(crate) async fn start(
    conn: &AgentConn,
    req: &RunCommandRequest,
    keep_stdin: bool,
) -> Result<(u32, StartStream), ApiError> {
    let mut opts = as_user(req.user.as_deref())?;
    if req.background {
        opts = opts
            .try_with_header("sandpit-detach", "1")
            .map_err(|e| ApiError::internal(e.to_string()))?;
    }
    let mut stream = conn
        .process
        .start_with_options(start_request(req, keep_stdin)?, opts)
        .await?;
    let pid = match stream.message::<StartResponse>().await? {
        Some(m) => match (*m.to_owned_message().event).clone().event {
            Some(Event::Start(s)) => s.pid,
            _ => return Err(ApiError::internal("agent did not report the start")),
        },
        None => {
            return Err(ApiError::internal(
                "agent closed the stream before the start",
            ));
        }
    };
    if let Some(input) = &req.stdin {
        write_stdin(conn, pid, input.as_bytes().to_vec(), !keep_stdin).await?;
    }
    Ok((pid, stream))
}

/// Runs a command to its end, capturing output up to the cap and enforcing the timeout.
pub async fn run_to_end(
    conn: &AgentConn,
    req: &RunCommandRequest,
) -> Result<RunCommandResponse, ApiError> {
    run_metered(conn, req, &mut ExecMeter::off()).await
}

/// [`run_to_end`], reporting the command's progress to its execution record.
async fn run_metered(
    conn: &AgentConn,
    req: &RunCommandRequest,
    meter: &mut ExecMeter,
) -> Result<RunCommandResponse, ApiError> {
    let cap = req
        .max_output_bytes
        .unwrap_or(DEFAULT_OUTPUT_CAP)
        .min(MAX_OUTPUT_CAP) as usize;
    let started = Instant::now();
    let (pid, mut stream) = start(conn, req, false).await?;
    meter.started(pid);
    let deadline = req
        .timeout_ms
        .map(|ms| tokio::time::Instant::now() + Duration::from_millis(ms));
    let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
    let mut truncated = false;
    let mut timed_out = false;
    let mut exit_code = -1;
    loop {
        let next = match deadline {
            Some(d) if !timed_out => {
                match tokio::time::timeout_at(d, stream.message::<StartResponse>()).await {
                    Ok(m) => m,
                    Err(_) => {
                        timed_out = true;
                        meter.timed_out();
                        kill(conn, pid).await;
                        continue;
                    }
                }
            }
            _ => stream.message::<StartResponse>().await,
        };
        let Some(msg) = next? else { break };
        match (*msg.to_owned_message().event).clone().event {
            Some(Event::Data(d)) => {
                let (buf, chunk, out) = match d.output {
                    Some(Output::Stdout(b)) => (&mut stdout, b, true),
                    Some(Output::Stderr(b)) => (&mut stderr, b, false),
                    Some(Output::Pty(b)) => (&mut stderr, b, true),
                    None => continue,
                };
                meter.output(out, chunk.len());
                let room = cap.saturating_sub(buf.len());
                if chunk.len() > room {
                    truncated = true;
                }
                buf.extend_from_slice(&chunk[..chunk.len().min(room)]);
            }
            Some(Event::End(e)) => {
                exit_code = e.exit_code;
                meter.ended(exit_code);
                break;
            }
            _ => {}
        }
    }
    Ok(RunCommandResponse {
        pid,
        exit_code,
        stdout: String::from_utf8_lossy(&stdout).into_owned(),
        stderr: String::from_utf8_lossy(&stderr).into_owned(),
        duration_ms: started.elapsed().as_millis() as u64,
        truncated,
        timed_out,
    })
}

/// Running commands.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/commands", responses((status = 200, body = Vec<CommandInfo>), (status = 404, body = ErrorBody)))]
pub async fn list(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
) -> Result<Json<Vec<CommandInfo>>, ApiError> {
    let (_, conn) = state.manager.agent(&owner.0, &id).await?;
    let resp = conn
        .process
        .list(ListRequest::default())
        .await?
        .into_owned();
    Ok(Json(
        resp.processes
            .into_iter()
            .map(|p| {
                let mut argv = vec![p.config.cmd.clone()];
                argv.extend(p.config.args.iter().cloned());
                CommandInfo {
                    pid: p.pid,
                    tag: p.tag.clone(),
                    argv,
                    cwd: p.config.cwd.clone(),
                }
            })
            .collect(),
    ))
}

fn parse_signal(s: &str) -> Result<Signal, ApiError> {
    match s.trim_start_matches("SIG").to_ascii_uppercase().as_str() {
        "TERM" | "SIGTERM" => Ok(Signal::SIGNAL_SIGTERM),
        "KILL" | "SIGKILL" => Ok(Signal::SIGNAL_SIGKILL),
        other => Err(ApiError::bad_request(format!(
            "unsupported signal {other:?}: use SIGTERM or SIGKILL"
        ))),
    }
}

/// Send SIGTERM or SIGKILL (which kills the whole process tree).
#[utoipa::path(post, path = "/v1/sandboxes/{id}/commands/{pid}/signal", request_body = SignalRequest, responses((status = 204), (status = 404, body = ErrorBody)))]
pub async fn signal(
    State(state): State<AppState>,
    owner: Owner,
    Path((id, pid)): Path<(String, u32)>,
    ApiJson(req): ApiJson<SignalRequest>,
) -> Result<StatusCode, ApiError> {
    let sig = parse_signal(&req.signal)?;
    let (_, conn) = state.manager.agent(&owner.0, &id).await?;
    send_signal(&conn, pid, sig).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Write to a command's stdin, optionally closing it.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/commands/{pid}/stdin", request_body = StdinRequest, responses((status = 204), (status = 404, body = ErrorBody)))]
pub async fn stdin(
    State(state): State<AppState>,
    owner: Owner,
    Path((id, pid)): Path<(String, u32)>,
    ApiJson(req): ApiJson<StdinRequest>,
) -> Result<StatusCode, ApiError> {
    let (_, conn) = state.manager.agent(&owner.0, &id).await?;
    write_stdin(&conn, pid, req.data.into_bytes(), req.close).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Start a command over a WebSocket: send a RunCommandRequest, receive CommandEvents.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/commands/stream", responses((status = 101, description = "WebSocket of CommandEvent"), (status = 404, body = ErrorBody)))]
pub async fn stream(
    State(state): State<AppState>,
    owner: Owner,
    caller: crate::usage::Caller,
    Path(id): Path<String>,
    slot: Option<Extension<StreamSlot>>,
    ws: WebSocketUpgrade,
) -> Result<Response, ApiError> {
    let (_, conn) = state.manager.agent(&owner.0, &id).await?;
    let (manager, c) = (state.manager.clone(), conn.clone());
    let meter = move |req: &RunCommandRequest| ExecMeter::begin(&manager, &caller, &id, &c, req);
    Ok(ws.on_upgrade(move |socket| async move {
        // An HTTP/2 stream's place under the listener's caps lasts as long as the socket.
        let _slot = slot;
        if let Err(e) = stream_new(socket, conn, meter).await {
            tracing::debug!(error = %e.message, "command stream ended with an error");
        }
    }))
}

/// Reattach to a running (or finished but unread) command: missed output, then live output.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/commands/{pid}/stream", responses((status = 101, description = "WebSocket of CommandEvent"), (status = 404, body = ErrorBody)))]
pub async fn attach(
    State(state): State<AppState>,
    owner: Owner,
    Path((id, pid)): Path<(String, u32)>,
    slot: Option<Extension<StreamSlot>>,
    ws: WebSocketUpgrade,
) -> Result<Response, ApiError> {
    let (_, conn) = state.manager.agent(&owner.0, &id).await?;
    let stream = conn
        .process
        .connect(ConnectRequest {
            process: selector(pid).into(),
            ..Default::default()
        })
        .await?;
    Ok(ws.on_upgrade(move |socket| async move {
        let _slot = slot;
        let (tx, rx) = split(socket);
        let off = ExecMeter::off();
        let _ = pump(connect_events(stream), tx, rx, conn, None, None, off).await;
    }))
}

type WsTx = futures::stream::SplitSink<WebSocket, Message>;
type WsRx = futures::stream::SplitStream<WebSocket>;

fn split(socket: WebSocket) -> (WsTx, WsRx) {
    use futures::StreamExt;
    socket.split()
}

async fn send_event(tx: &mut WsTx, ev: &CommandEvent) -> Result<(), ApiError> {
    use futures::SinkExt;
    let text = serde_json::to_string(ev).map_err(|e| ApiError::internal(e.to_string()))?;
    tx.send(Message::Text(text.into()))
        .await
        .map_err(|e| ApiError::internal(format!("websocket: {e}")))
}

async fn stream_new(
    socket: WebSocket,
    conn: Arc<AgentConn>,
    meter: impl FnOnce(&RunCommandRequest) -> ExecMeter,
) -> Result<(), ApiError> {
    use futures::StreamExt;
    let (mut tx, mut rx) = split(socket);
    let first = loop {
        match rx.next().await {
            Some(Ok(Message::Text(t))) => break t,
            Some(Ok(Message::Ping(_) | Message::Pong(_))) => continue,
            _ => return Ok(()),
        }
    };
    let req: RunCommandRequest = match serde_json::from_str(&first) {
        Ok(r) => r,
        Err(e) => {
            send_event(
                &mut tx,
                &CommandEvent::Error {
                    message: format!("invalid start message: {e}"),
                },
            )
            .await?;
            return Ok(());
        }
    };
    let meter = meter(&req);
    let started = async {
        let opts = as_user(req.user.as_deref())?;
        let stream = conn
            .process
            .start_with_options(start_request(&req, true)?, opts)
            .await?;
        Ok::<_, ApiError>(stream)
    }
    .await;
    match started {
        Ok(stream) => {
            pump(
                start_events(stream),
                tx,
                rx,
                conn,
                req.timeout_ms.map(Duration::from_millis),
                req.stdin.clone(),
                meter,
            )
            .await
        }
        Err(e) => send_event(&mut tx, &CommandEvent::Error { message: e.message }).await,
    }
}

/// Relays agent events to the socket and socket messages to the agent until the end event.
async fn pump(
    mut stream: EventStream,
    mut tx: WsTx,
    mut rx: WsRx,
    conn: Arc<AgentConn>,
    timeout: Option<Duration>,
    mut initial_stdin: Option<String>,
    mut meter: ExecMeter,
) -> Result<(), ApiError> {
    use futures::StreamExt;
    let mut pid: Option<u32> = None;
    // Messages that arrive before the start event wait for the pid.
    let mut early: Vec<ClientMessage> = Vec::new();
    let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
    let mut killed = false;
    loop {
        let sleep = async {
            match deadline {
                Some(d) if !killed => tokio::time::sleep_until(d).await,
                _ => std::future::pending().await,
            }
        };
        tokio::select! {
            ev = stream.next() => {
                let ev = match ev.transpose() {
                    Ok(Some(ev)) => ev,
                    Ok(None) => return Ok(()),
                    Err(e) => {
                        send_event(&mut tx, &CommandEvent::Error { message: e.message.clone() }).await?;
                        return Err(e);
                    }
                };
                meter.observe(&ev);
                if let CommandEvent::Start { pid: p } = ev {
                    pid = Some(p);
                    if let Some(text) = initial_stdin.take() {
                        write_stdin(&conn, p, text.into_bytes(), false).await?;
                    }
                    for m in std::mem::take(&mut early) {
                        if let Err(e) = client_message(&conn, p, m).await {
                            send_event(&mut tx, &CommandEvent::Error { message: e.message }).await?;
                        }
                    }
                }
                let end = matches!(ev, CommandEvent::End { .. });
                send_event(&mut tx, &ev).await?;
                if end {
                    close_gracefully(&mut tx, &mut rx).await;
                    return Ok(());
                }
            }
            msg = rx.next() => {
                let Some(Ok(msg)) = msg else {
                    // The client went away: the command keeps running and can be reattached.
                    return Ok(());
                };
                let Message::Text(t) = msg else { continue };
                match serde_json::from_str::<ClientMessage>(&t) {
                    Ok(m) => match pid {
                        None => early.push(m),
                        Some(p) => if let Err(e) = client_message(&conn, p, m).await {
                            send_event(&mut tx, &CommandEvent::Error { message: e.message }).await?;
                        }
                    }
                    Err(e) => send_event(&mut tx, &CommandEvent::Error { message: format!("invalid message: {e}") }).await?,
                }
            }
            _ = sleep => {
                killed = true;
                meter.timed_out();
                if let Some(p) = pid { kill(&conn, p).await; }
            }
        }
    }
}

/// Completes the WebSocket closing handshake. Dropping the socket while the client still
/// sends (late stdin, a close) would make the kernel answer with a reset, and a reset can
/// discard output the client has not read yet.
async fn close_gracefully(tx: &mut WsTx, rx: &mut WsRx) {
    use futures::{SinkExt, StreamExt};
    let _ = tx.send(Message::Close(None)).await;
    let drain = async {
        while let Some(Ok(msg)) = rx.next().await {
            if matches!(msg, Message::Close(_)) {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(5), drain).await;
}

async fn client_message(conn: &AgentConn, pid: u32, m: ClientMessage) -> Result<(), ApiError> {
    match m {
        ClientMessage::Stdin { data } => {
            let bytes = B64
                .decode(data)
                .map_err(|e| ApiError::bad_request(format!("stdin is not base64: {e}")))?;
            // A pty process takes its input through the terminal; the agent routes stdin there.
            write_stdin(conn, pid, bytes, false).await?;
        }
        ClientMessage::CloseStdin => write_stdin(conn, pid, Vec::new(), true).await?,
        ClientMessage::Signal { signal } => send_signal(conn, pid, parse_signal(&signal)?).await?,
        ClientMessage::Resize { cols, rows } => {
            let pty = PTY {
                size: pty::Size {
                    cols: cols as u32,
                    rows: rows as u32,
                    ..Default::default()
                }
                .into(),
                ..Default::default()
            };
            conn.process
                .update(UpdateRequest {
                    process: selector(pid).into(),
                    pty: pty.into(),
                    ..Default::default()
                })
                .await?;
        }
    }
    Ok(())
}

fn to_event(ev: ProcessEvent) -> Option<CommandEvent> {
    Some(match ev.event? {
        Event::Start(s) => CommandEvent::Start { pid: s.pid },
        Event::Data(d) => match d.output? {
            Output::Stdout(b) => CommandEvent::Stdout {
                data: B64.encode(b),
            },
            Output::Stderr(b) => CommandEvent::Stderr {
                data: B64.encode(b),
            },
            Output::Pty(b) => CommandEvent::Pty {
                data: B64.encode(b),
            },
        },
        Event::End(e) => CommandEvent::End {
            exit_code: e.exit_code,
            status: e.status.clone(),
        },
        Event::Keepalive(_) => return None,
    })
}

type ConnectStream = connectrpc::client::ServerStream<
    hyper::body::Incoming,
    __buffa::view::ConnectResponseView<'static>,
>;
/// Command events of a Start or Connect call.
type EventStream =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<CommandEvent, ApiError>> + Send>>;

macro_rules! events_fn {
    ($name:ident, $stream:ty, $resp:ty) => {
        fn $name(s: $stream) -> EventStream {
            Box::pin(futures::stream::unfold(Some(s), |s| async move {
                let mut s = s?;
                loop {
                    match s.message::<$resp>().await {
                        Ok(Some(m)) => {
                            if let Some(e) = to_event((*m.to_owned_message().event).clone()) {
                                return Some((Ok(e), Some(s)));
                            }
                        }
                        Ok(None) => return None,
                        Err(e) => return Some((Err(ApiError::from(e)), None)),
                    }
                }
            }))
        }
    };
}
events_fn!(start_events, StartStream, StartResponse);
events_fn!(connect_events, ConnectStream, ConnectResponse);
