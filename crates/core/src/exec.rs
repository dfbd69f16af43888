//! Commands in a sandbox, over its agent's process service: start one (as a user, with
//! stdin, detached or not), run one to its end with output capped and a timeout, signal
//! it, write its stdin, and turn the agent's events into [`CommandEvent`]s.

use crate::agent_conn::AgentConn;
use crate::error::CoreError;
use crate::usage::ExecMeter;
use base64::Engine;
use connectrpc::client::CallOptions;
use sandpit_api::{CommandEvent, RunCommandRequest, RunCommandResponse};
use sandpit_proto::process::__buffa::oneof::process_event::Event;
use sandpit_proto::process::__buffa::oneof::process_event::data_event::Output;
use sandpit_proto::process::__buffa::oneof::process_input::Input;
use sandpit_proto::process::__buffa::oneof::process_selector::Selector;
use sandpit_proto::process::*;
use std::time::{Duration, Instant};

const DEFAULT_OUTPUT_CAP: u64 = 10 << 20;
const MAX_OUTPUT_CAP: u64 = 64 << 20;
pub const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

/// Call options naming the user a command or file operation acts as (E2B's convention);
/// without one, the agent uses the sandbox's default user.
pub fn as_user(user: Option<&str>) -> Result<CallOptions, CoreError> {
    let Some(user) = user else {
        return Ok(CallOptions::default());
    };
    if user != "user" && user != "root" {
        return Err(CoreError::invalid(format!(
            "unknown user {user:?}: use \"user\" or \"root\""
        )));
    }
    let value = format!("Basic {}", B64.encode(format!("{user}:")));
    CallOptions::default()
        .try_with_header("authorization", value)
        .map_err(|e| CoreError::internal_from("a call header", e))
}

pub fn selector(pid: u32) -> ProcessSelector {
    ProcessSelector {
        selector: Some(Selector::Pid(pid)),
        ..Default::default()
    }
}

/// `keep_stdin`: leave a stdin pipe open for later input (WebSocket and background runs).
pub fn start_request(req: &RunCommandRequest, keep_stdin: bool) -> Result<StartRequest, CoreError> {
    let (cmd, args) = req
        .argv
        .split_first()
        .ok_or_else(|| CoreError::invalid("argv must not be empty"))?;
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

pub async fn send_signal(conn: &AgentConn, pid: u32, sig: Signal) -> Result<(), CoreError> {
    let req = SendSignalRequest {
        process: selector(pid).into(),
        signal: sig.into(),
        ..Default::default()
    };
    conn.process.send_signal(req).await?;
    Ok(())
}

pub async fn kill(conn: &AgentConn, pid: u32) {
    if let Err(e) = send_signal(conn, pid, Signal::SIGNAL_SIGKILL).await {
        tracing::debug!(pid, error = %e.chain(), "kill after timeout");
    }
}

pub async fn write_stdin(
    conn: &AgentConn,
    pid: u32,
    data: Vec<u8>,
    close: bool,
) -> Result<(), CoreError> {
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

pub type StartStream = connectrpc::client::ServerStream<
    crate::agent_conn::ResponseBody,
    __buffa::view::StartResponseView<'static>,
>;

/// Starts a command, feeds its stdin text, and returns its pid with the event stream.
pub async fn start(
    conn: &AgentConn,
    req: &RunCommandRequest,
    keep_stdin: bool,
) -> Result<(u32, StartStream), CoreError> {
    start_with(conn, req, keep_stdin, None).await
}

/// [`start`], with the command run under the agent's supervisor when `supervise` gives
/// its grace period: the pid is the supervisor's, everything the command leaves behind
/// stays below it, and a SIGTERM to it ends the whole tree (SIGKILL after the grace).
pub async fn start_with(
    conn: &AgentConn,
    req: &RunCommandRequest,
    keep_stdin: bool,
    supervise: Option<Duration>,
) -> Result<(u32, StartStream), CoreError> {
    let mut opts = as_user(req.user.as_deref())?;
    if req.background {
        opts = opts
            .try_with_header("sandpit-detach", "1")
            .map_err(|e| CoreError::internal_from("a call header", e))?;
    }
    if let Some(grace) = supervise {
        let grace = grace.min(sandpit_abi::MAX_SUPERVISE_GRACE);
        opts = opts
            .try_with_header(sandpit_abi::SUPERVISE_HEADER, grace.as_millis().to_string())
            .map_err(|e| CoreError::internal_from("a call header", e))?;
    }
    let mut stream = conn
        .process
        .start_with_options(start_request(req, keep_stdin)?, opts)
        .await?;
    let pid = match stream.message::<StartResponse>().await? {
        Some(m) => match (*m.to_owned_message().event).clone().event {
            Some(Event::Start(s)) => s.pid,
            _ => return Err(CoreError::internal("agent did not report the start")),
        },
        None => {
            return Err(CoreError::internal(
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
) -> Result<RunCommandResponse, CoreError> {
    run_metered(conn, req, &mut ExecMeter::off()).await
}

/// [`run_to_end`], reporting the command's progress to its execution record.
pub async fn run_metered(
    conn: &AgentConn,
    req: &RunCommandRequest,
    meter: &mut ExecMeter,
) -> Result<RunCommandResponse, CoreError> {
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

pub fn parse_signal(s: &str) -> Result<Signal, CoreError> {
    match s.trim_start_matches("SIG").to_ascii_uppercase().as_str() {
        "TERM" | "SIGTERM" => Ok(Signal::SIGNAL_SIGTERM),
        "KILL" | "SIGKILL" => Ok(Signal::SIGNAL_SIGKILL),
        other => Err(CoreError::invalid(format!(
            "unsupported signal {other:?}: use SIGTERM or SIGKILL"
        ))),
    }
}

pub fn to_event(ev: ProcessEvent) -> Option<CommandEvent> {
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

pub type ConnectStream = connectrpc::client::ServerStream<
    crate::agent_conn::ResponseBody,
    __buffa::view::ConnectResponseView<'static>,
>;
/// Command events of a Start or Connect call.
pub type EventStream =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<CommandEvent, CoreError>> + Send>>;

macro_rules! events_fn {
    ($name:ident, $stream:ty, $resp:ty) => {
        pub fn $name(s: $stream) -> EventStream {
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
                        Err(e) => return Some((Err(CoreError::from(e)), None)),
                    }
                }
            }))
        }
    };
}
events_fn!(start_events, StartStream, StartResponse);
events_fn!(connect_events, ConnectStream, ConnectResponse);
