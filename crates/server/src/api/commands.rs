//! Command routes: run to completion, background start, WebSocket streaming and reattach,
//! signals and stdin. All of them drive the agent's `process.Process` service.

use super::{ApiJson, AppState, Owner};
use crate::agent_conn::AgentConn;
use crate::api::Path;
use crate::error::ApiError;
use crate::listener::StreamSlot;
use crate::usage::ExecMeter;
use axum::extract::State;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::response::Response;
use axum::{Extension, Json};
use base64::Engine;
use http::StatusCode;
use sandpit_api::*;
use sandpit_core::exec::{
    B64, EventStream, as_user, connect_events, kill, parse_signal, run_metered, selector,
    send_signal, start, start_events, start_request, write_stdin,
};
use sandpit_proto::process::*;
use std::sync::Arc;
use std::time::Duration;

/// Run a command: to completion (output captured up to a cap) or in the background.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/commands", request_body = RunCommandRequest,
    responses((status = 200, body = RunCommandResponse), (status = 202, body = BackgroundCommand), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn run(
    State(state): State<AppState>,
    owner: Owner,
    caller: super::Caller,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<RunCommandRequest>,
) -> Result<Response, ApiError> {
    use axum::response::IntoResponse;
    let (_, conn) = state.manager.agent(&owner.0, &id).await?;
    let mut meter = ExecMeter::begin(&state.manager, &caller.0, &id, &conn, &req);
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
    caller: super::Caller,
    Path(id): Path<String>,
    slot: Option<Extension<StreamSlot>>,
    ws: WebSocketUpgrade,
) -> Result<Response, ApiError> {
    let (_, conn) = state.manager.agent(&owner.0, &id).await?;
    let (manager, c) = (state.manager.clone(), conn.clone());
    let meter = move |req: &RunCommandRequest| ExecMeter::begin(&manager, &caller.0, &id, &c, req);
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
    let text =
        serde_json::to_string(ev).map_err(|e| ApiError::internal_from("encode an event", &e))?;
    tx.send(Message::Text(text.into()))
        .await
        .map_err(|e| ApiError::internal_from("websocket", &e))
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
        Ok::<_, sandpit_core::CoreError>(stream)
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
        Err(e) => {
            let message = ApiError::from(e).message;
            send_event(&mut tx, &CommandEvent::Error { message }).await
        }
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
                        let e = ApiError::from(e);
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
