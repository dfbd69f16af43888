//! Worker processes: one long-lived interpreter per context (python3, node or an
//! interactive bash), an ordinary sandbox process running as the context's user. The agent
//! talks to it over pipes: commands on the worker's fd 3, events from its fd 4, and the
//! cell's output raw on its stdout and stderr.

use super::InterpError;
use super::protocol::{self, BASH_RUN_LINE, Command, Event, Language};
use crate::config::{AgentConfig, IsolationMode};
use crate::users::{self, User};
use bytes::Bytes;
use nix::sys::signal::Signal;
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::unix::pipe;
use tokio::sync::{mpsc, watch};

/// The Python worker program, sent to the interpreter on fd 3.
const PYTHON_WORKER: &str = include_str!("python_worker.py");
/// The JavaScript worker program, sent to node on fd 3.
const NODE_WORKER: &str = include_str!("node_worker.js");
/// Set-up of the interactive bash, written to its stdin.
const BASH_WORKER: &str = include_str!("bash_worker.sh");

/// Reads the worker program (one JSON string line) from fd 3 and runs it; the file object
/// stays open as `_cmd_in` for the commands that follow.
const PYTHON_BOOT: &str = "import json,os;_cmd_in=os.fdopen(3,'rb');exec(compile(json.loads(_cmd_in.readline()),'<sandpit-python-worker>','exec'))";
/// Reads exactly the first line of fd 3 (the program), so the rest stays for the worker.
const NODE_BOOT: &str = "(()=>{const fs=require('fs');const b=Buffer.alloc(1);const a=[];for(;;){if(fs.readSync(3,b,0,1,null)!==1)process.exit(1);if(b[0]===10)break;a.push(b[0]);}require('vm').runInThisContext(JSON.parse(Buffer.from(a).toString('utf8')),{filename:'<sandpit-node-worker>'});})()";

/// How long a worker may take to start and say it is ready.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// Largest event line read from a worker (a big image result, say); longer ones are dropped.
const MAX_EVENT_LINE: usize = 32 << 20;
/// Stderr kept from a worker that fails to start, for the error message.
const START_STDERR_LIMIT: usize = 4096;
const READ_CHUNK: usize = 64 * 1024;

/// Which output stream bytes came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout = 0,
    Stderr = 1,
}

/// What a worker's pipes and pid report to the cell that is running.
#[derive(Debug)]
pub enum Msg {
    /// Raw output bytes.
    Out(Stream, Bytes),
    /// The stream reached its end (every holder of the pipe closed it).
    OutEnd(Stream),
    /// An event line from fd 4.
    Event(Event),
    /// The worker process ended.
    Exited,
}

type Sink = Arc<Mutex<Option<mpsc::Sender<Msg>>>>;

/// Where and as whom a worker runs.
pub struct WorkerSpec {
    pub language: Language,
    pub user: User,
    /// Working directory as seen inside the sandbox.
    pub cwd: String,
    pub cfg: Arc<AgentConfig>,
}

/// Signals a worker's process group, safe to call from outside the context's lock.
#[derive(Clone)]
pub struct Killer {
    pid: u32,
    pidfd: Arc<OwnedFd>,
}

impl Killer {
    /// Whether the worker process is still running.
    pub fn alive(&self) -> bool {
        let mut pfd = libc::pollfd {
            fd: self.pidfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, zero timeout.
        let n = unsafe { libc::poll(&mut pfd, 1, 0) };
        n == 0
    }

    /// Sends `sig` to the worker and everything in its process group. Only while the worker
    /// lives: afterwards its pid (and group id) may belong to someone else.
    fn signal_group(&self, sig: Signal) {
        if !self.alive() {
            return;
        }
        if sig == Signal::SIGKILL {
            crate::process::kill_tree(self.pid, sig);
        } else {
            let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(self.pid as i32), sig);
        }
    }

    /// Interrupts the running cell (SIGINT to the worker's group, as a terminal would).
    pub fn interrupt(&self) {
        self.signal_group(Signal::SIGINT);
    }

    /// Kills the worker and its process group.
    pub fn kill(&self) {
        self.signal_group(Signal::SIGKILL);
    }
}

/// A running worker. Dropping it kills the process.
pub struct Worker {
    language: Language,
    killer: Killer,
    cmd: pipe::Sender,
    stdin: Option<pipe::Sender>,
    sink: Sink,
    exited: watch::Receiver<bool>,
    tasks: Vec<tokio::task::AbortHandle>,
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.killer.kill();
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// A pipe whose two ends are above the standard descriptors, close-on-exec.
fn high_pipe() -> Result<(OwnedFd, OwnedFd), InterpError> {
    let (r, w) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|source| InterpError::Sys {
            context: "pipe",
            source,
        })?;
    Ok((above_ten(r)?, above_ten(w)?))
}

/// Moves a descriptor to a number of at least 10, so that placing the worker's pipes on
/// fds 3 and 4 in the child cannot overwrite one with the other.
fn above_ten(fd: OwnedFd) -> Result<OwnedFd, InterpError> {
    let raw = nix::fcntl::fcntl(fd.as_fd(), nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(10)).map_err(
        |source| InterpError::Sys {
            context: "dup",
            source,
        },
    )?;
    // SAFETY: fcntl just returned this new descriptor, which nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// Finds `name` on `path` (a PATH value); `None` if no executable file has that name.
fn find_program(name: &str, path: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    path.split(':')
        .filter(|d| d.starts_with('/'))
        .map(|d| Path::new(d).join(name))
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// The environment of a worker: the sandbox's, then identity and location of its user.
fn worker_env(spec: &WorkerSpec, cwd_host: &Path) -> BTreeMap<String, String> {
    let cfg = &spec.cfg;
    let mut env = cfg.env();
    for (k, v) in [
        (
            "PATH",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        ),
        ("SHELL", "/bin/bash"),
        ("LANG", "C.UTF-8"),
    ] {
        env.entry(k.into()).or_insert_with(|| v.into());
    }
    let home = users::host_path(cfg, spec.user.home);
    env.insert("HOME".into(), home.to_string_lossy().into_owned());
    env.insert("USER".into(), spec.user.name.into());
    env.insert("LOGNAME".into(), spec.user.name.into());
    env.insert("PWD".into(), cwd_host.to_string_lossy().into_owned());
    if spec.language == Language::Python {
        // Figures are rendered to PNG results; there is no display to draw on.
        env.entry("MPLBACKEND".into())
            .or_insert_with(|| "Agg".into());
    }
    env.retain(|k, v| !k.is_empty() && !k.contains(['=', '\0']) && !v.contains('\0'));
    env
}

async fn deliver(sink: &Sink, msg: Msg) {
    let tx = sink.lock().clone();
    if let Some(tx) = tx {
        // A cell that ended meanwhile dropped its receiver; the message is then dropped too.
        let _ = tx.send(msg).await;
    }
}

/// Reads in a drain before an event at most this many chunks per stream, so that a flood
/// of output from a background process cannot hold events back for ever.
const DRAIN_CHUNKS: usize = 16;

async fn readable(rx: &Option<pipe::Receiver>) {
    match rx {
        Some(rx) => {
            let _ = rx.readable().await;
        }
        None => std::future::pending().await,
    }
}

/// One non-blocking read of an output pipe, passed on; false once nothing is waiting.
async fn read_out(
    outs: &mut [Option<pipe::Receiver>; 2],
    idx: usize,
    buf: &mut [u8],
    sink: &Sink,
) -> bool {
    let stream = if idx == 0 {
        Stream::Stdout
    } else {
        Stream::Stderr
    };
    let Some(rx) = outs[idx].as_ref() else {
        return false;
    };
    match rx.try_read(buf) {
        Ok(0) => {
            outs[idx] = None;
            deliver(sink, Msg::OutEnd(stream)).await;
            false
        }
        Ok(n) => {
            deliver(sink, Msg::Out(stream, Bytes::copy_from_slice(&buf[..n]))).await;
            true
        }
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => false,
        Err(_) => {
            outs[idx] = None;
            deliver(sink, Msg::OutEnd(stream)).await;
            false
        }
    }
}

/// Reads a worker's stdout, stderr and events in one task. Before an event is passed on,
/// the output pipes are drained: the worker wrote that output before the event, so the
/// cell's client sees it first.
async fn pump(mut outs: [Option<pipe::Receiver>; 2], events: pipe::Receiver, sink: Sink) {
    let mut events = Some(events);
    let mut buf = vec![0u8; READ_CHUNK];
    let mut line: Vec<u8> = Vec::new();
    let mut skipping = false;
    while outs.iter().any(Option::is_some) || events.is_some() {
        tokio::select! {
            _ = readable(&outs[0]) => {
                read_out(&mut outs, 0, &mut buf, &sink).await;
            }
            _ = readable(&outs[1]) => {
                read_out(&mut outs, 1, &mut buf, &sink).await;
            }
            _ = readable(&events) => {
                let Some(rx) = events.as_ref() else { continue };
                let n = match rx.try_read(&mut buf) {
                    Ok(0) => {
                        events = None;
                        continue;
                    }
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                    Err(_) => {
                        events = None;
                        continue;
                    }
                };
                let chunk = buf[..n].to_vec();
                let mut chunk = &chunk[..];
                while let Some(nl) = chunk.iter().position(|b| *b == b'\n') {
                    if !skipping {
                        line.extend_from_slice(&chunk[..nl]);
                        match protocol::parse_event(&line) {
                            Some(ev) => {
                                for idx in 0..2 {
                                    for _ in 0..DRAIN_CHUNKS {
                                        if !read_out(&mut outs, idx, &mut buf, &sink).await {
                                            break;
                                        }
                                    }
                                }
                                deliver(&sink, Msg::Event(ev)).await;
                            }
                            None => tracing::debug!(len = line.len(), "ignoring a malformed worker event"),
                        }
                    }
                    skipping = false;
                    line.clear();
                    chunk = &chunk[nl + 1..];
                }
                if !skipping {
                    line.extend_from_slice(chunk);
                    if line.len() > MAX_EVENT_LINE {
                        tracing::warn!("dropping an oversized worker event");
                        line = Vec::new();
                        skipping = true;
                    }
                }
            }
        }
    }
}

async fn watch_exit(pidfd: Arc<OwnedFd>, tx: watch::Sender<bool>, sink: Sink) {
    // pidfd_open descriptors are pollable only; the dup keeps the Killer's copy intact.
    let fd = match pidfd.try_clone() {
        Ok(fd) => fd,
        Err(e) => {
            tracing::warn!(error = %e, "cannot watch a worker; treating it as ended");
            let _ = tx.send(true);
            return;
        }
    };
    // SAFETY: the descriptor is moved in and stays open for as long as the AsyncFd lives.
    let registered = unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE)
    };
    match registered {
        Ok(afd) => {
            let _ = afd.readable().await;
        }
        Err(e) => tracing::warn!(error = %e, "cannot watch a worker; treating it as ended"),
    }
    let _ = tx.send(true);
    deliver(&sink, Msg::Exited).await;
}

fn pidfd_open(pid: u32) -> std::io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this descriptor for our exclusive use.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

impl Worker {
    /// Starts a worker and waits until it is ready for cells.
    pub async fn spawn(spec: &WorkerSpec) -> Result<Worker, InterpError> {
        let cfg = &spec.cfg;
        let cwd_host = users::host_path(cfg, &spec.cwd);
        if !cwd_host.is_dir() {
            return Err(InterpError::BadRequest(format!(
                "cwd {:?} is not a directory in this sandbox",
                spec.cwd
            )));
        }
        let env = worker_env(spec, &cwd_host);
        let (name, args): (&str, Vec<&str>) = match spec.language {
            Language::Python => ("python3", vec!["-u", "-c", PYTHON_BOOT]),
            Language::JavaScript => ("node", vec!["-e", NODE_BOOT]),
            Language::Bash => ("bash", vec!["--noprofile", "--norc", "--noediting", "-i"]),
        };
        let path_var = env.get("PATH").cloned().unwrap_or_default();
        let program = find_program(name, &path_var).ok_or_else(|| {
            InterpError::BadRequest(format!(
                "{} contexts need `{name}`, which is not installed in this sandbox",
                spec.language.name()
            ))
        })?;

        let (cmd_r, cmd_w) = high_pipe()?;
        let (evt_r, evt_w) = high_pipe()?;
        let mut cmd = std::process::Command::new(&program);
        cmd.args(&args)
            .env_clear()
            .envs(&env)
            .current_dir(&cwd_host)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .stdin(if spec.language == Language::Bash {
                Stdio::piped()
            } else {
                Stdio::null()
            });
        if spec.user.switch {
            cmd.uid(spec.user.uid).gid(spec.user.gid);
        }
        let container = cfg.mode == IsolationMode::Container;
        let (cmd_fd, evt_fd) = (cmd_r.as_raw_fd(), evt_w.as_raw_fd());
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                // Its own session and process group: interrupts and kills reach the
                // worker and what it started, nothing else.
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                crate::process::reset_child(container);
                if libc::dup2(cmd_fd, 3) < 0 || libc::dup2(evt_fd, 4) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().map_err(|e| match e.kind() {
            std::io::ErrorKind::PermissionDenied => InterpError::BadRequest(format!(
                "cannot start {name} as {} in {:?}: permission denied",
                spec.user.name, spec.cwd
            )),
            _ => InterpError::Io {
                context: format!("starting {name}"),
                source: e,
            },
        })?;
        let pid = child.id();
        let pidfd = pidfd_open(pid);
        drop((cmd_r, evt_w));
        let io = |source: std::io::Error| InterpError::Io {
            context: "worker pipes".into(),
            source,
        };
        let stdout = child.stdout.take().map(OwnedFd::from);
        let stderr = child.stderr.take().map(OwnedFd::from);
        let stdin = child.stdin.take().map(OwnedFd::from);
        // The agent's reaper collects the exit status; the pidfd tells us about the exit.
        drop(child);
        let pidfd = match pidfd {
            Ok(fd) => Arc::new(fd),
            Err(e) => {
                crate::process::kill_tree(pid, Signal::SIGKILL);
                return Err(InterpError::Io {
                    context: "pidfd_open".into(),
                    source: e,
                });
            }
        };
        let killer = Killer { pid, pidfd };
        let sink: Sink = Arc::default();
        let (exit_tx, exit_rx) = watch::channel(false);
        let mut worker = Worker {
            language: spec.language,
            killer: killer.clone(),
            cmd: pipe::Sender::from_owned_fd(cmd_w).map_err(io)?,
            stdin: stdin
                .map(pipe::Sender::from_owned_fd)
                .transpose()
                .map_err(io)?,
            sink: sink.clone(),
            exited: exit_rx,
            tasks: Vec::new(),
        };
        let (tx, mut rx) = mpsc::channel(64);
        worker.attach(tx);
        let out_rx = |fd: Option<OwnedFd>| fd.map(pipe::Receiver::from_owned_fd).transpose();
        let outs = [out_rx(stdout).map_err(io)?, out_rx(stderr).map_err(io)?];
        let events = pipe::Receiver::from_owned_fd(evt_r).map_err(io)?;
        let t = tokio::spawn(pump(outs, events, sink.clone()));
        worker.tasks.push(t.abort_handle());
        let t = tokio::spawn(watch_exit(killer.pidfd.clone(), exit_tx, sink.clone()));
        worker.tasks.push(t.abort_handle());

        let ready = async {
            let hello = match spec.language {
                Language::Python => protocol::program_line(PYTHON_WORKER),
                Language::JavaScript => protocol::program_line(NODE_WORKER),
                Language::Bash => Vec::new(),
            };
            let mut stderr = Vec::new();
            let mut write = std::pin::pin!(async {
                if spec.language == Language::Bash {
                    if let Some(stdin) = worker.stdin.as_ref() {
                        write_all(stdin, BASH_WORKER.as_bytes()).await?;
                    }
                } else {
                    write_all(&worker.cmd, &hello).await?;
                }
                Ok::<(), std::io::Error>(())
            });
            let mut written = false;
            loop {
                tokio::select! {
                    r = &mut write, if !written => {
                        written = true;
                        if let Err(e) = r {
                            tracing::debug!(error = %e, "writing to a starting worker");
                        }
                    }
                    msg = rx.recv() => match msg {
                        Some(Msg::Event(Event::Ready)) => return Ok(()),
                        Some(Msg::Out(Stream::Stderr, b)) => {
                            if stderr.len() < START_STDERR_LIMIT {
                                stderr.extend_from_slice(&b);
                            }
                        }
                        Some(Msg::Exited) | None => return Err(stderr),
                        Some(_) => {}
                    }
                }
            }
        };
        let outcome = tokio::time::timeout(START_TIMEOUT, ready).await;
        worker.detach();
        match outcome {
            Ok(Ok(())) => Ok(worker),
            Ok(Err(stderr)) => {
                let text = String::from_utf8_lossy(&stderr);
                let text = text.trim();
                Err(InterpError::Internal(format!(
                    "the {} worker exited while starting{}{}",
                    spec.language.name(),
                    if text.is_empty() { "" } else { ": " },
                    text
                )))
            }
            Err(_) => Err(InterpError::Internal(format!(
                "the {} worker did not start within {} s",
                spec.language.name(),
                START_TIMEOUT.as_secs()
            ))),
        }
    }

    /// A handle that can interrupt or kill this worker from anywhere.
    pub fn killer(&self) -> Killer {
        self.killer.clone()
    }

    /// Whether the process still runs.
    pub fn alive(&self) -> bool {
        !*self.exited.borrow() && self.killer.alive()
    }

    /// Routes the worker's output and events to `tx` (the running cell).
    pub fn attach(&self, tx: mpsc::Sender<Msg>) {
        *self.sink.lock() = Some(tx);
    }

    /// Stops routing: output between cells is dropped.
    pub fn detach(&self) {
        *self.sink.lock() = None;
    }

    /// Hands one cell to the worker.
    pub async fn send_cell(
        &self,
        token: &str,
        env: &BTreeMap<String, String>,
        code: &str,
    ) -> Result<(), InterpError> {
        let io = |source: std::io::Error| InterpError::Io {
            context: "writing to the worker".into(),
            source,
        };
        match self.language {
            Language::Bash => {
                let frame =
                    protocol::bash_frame(token, env, code).map_err(InterpError::BadRequest)?;
                write_all(&self.cmd, &frame).await.map_err(io)?;
                let stdin = self
                    .stdin
                    .as_ref()
                    .ok_or_else(|| InterpError::Internal("bash worker without stdin".into()))?;
                write_all(stdin, BASH_RUN_LINE).await.map_err(io)
            }
            Language::Python | Language::JavaScript => {
                let line = Command::Exec { code, env, token }.to_line();
                write_all(&self.cmd, &line).await.map_err(io)
            }
        }
    }
}

async fn write_all(tx: &pipe::Sender, data: &[u8]) -> std::io::Result<()> {
    let mut data = data;
    while !data.is_empty() {
        tx.writable().await?;
        match tx.try_write(data) {
            Ok(n) => data = &data[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
