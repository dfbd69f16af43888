//! `sudo` inside a container sandbox. Commands run as the sandbox's `user` under
//! no_new_privs, so a setuid sudo cannot work; instead the `sudo` on the sandbox's PATH
//! (this binary under that name, [`client_main`]) asks the agent over a unix socket, and
//! the agent starts the command as the sandbox's root, exactly as the API's `user: root`
//! would. Nothing is gained that the sandbox's owner could not do already, and the
//! command keeps no_new_privs and the sandbox's confinement.
//!
//! The wire: the client sends one frame (a little-endian `u32` length, then the
//! [`Request`] as JSON) with its stdin, stdout and stderr attached to the first byte
//! (`SCM_RIGHTS`); while the command runs it may send [`Control`] frames (signals to
//! relay); the agent answers with one [`Reply`] frame. A client that goes away takes its
//! command with it.

use crate::config::{AgentConfig, IsolationMode};
use crate::process::{ProcessTable, SpawnSpec, kill_tree};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};

/// The name (argv[0]) under which the `sandpit` binary is the sandbox's `sudo` client.
pub const ARGV0: &str = "sudo";
/// The directory of the socket: the sandbox root's, never writable by `user`.
pub const SOCKET_DIR: &str = "/run/sandpit";
/// The socket the agent listens on for `sudo`.
pub const SOCKET_PATH: &str = "/run/sandpit/sudo.sock";
/// Largest request frame accepted (argv and env together).
pub const MAX_REQUEST: usize = 256 * 1024;
/// Largest control or reply frame.
pub const MAX_SMALL_FRAME: usize = 4096;
/// Most argv or env entries in one request.
pub const MAX_ITEMS: usize = 4096;
/// How long a client has to send its whole request.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Most `sudo` commands running at once; more are refused.
pub const MAX_SESSIONS: usize = 256;
/// Most requests being read at once (each may hold up to [`MAX_REQUEST`] bytes); more
/// wait their turn, each within its own [`REQUEST_TIMEOUT`].
pub const MAX_READING: usize = 16;
/// `PATH` of a command run without `-E`, as Debian's sudoers `secure_path`.
pub const SECURE_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// Variables a request may not set: the agent sets them for the target user.
const RESERVED_ENV: &[&str] = &[
    "HOME",
    "USER",
    "LOGNAME",
    "PWD",
    "MAIL",
    "SUDO_USER",
    "SUDO_UID",
    "SUDO_GID",
    "SUDO_COMMAND",
];
/// Signals a client may relay to its command (what a terminal or a supervisor sends).
const RELAYED_SIGNALS: &[i32] = &[
    libc::SIGHUP,
    libc::SIGINT,
    libc::SIGQUIT,
    libc::SIGTERM,
    libc::SIGUSR1,
    libc::SIGUSR2,
    libc::SIGWINCH,
    libc::SIGCONT,
    libc::SIGTSTP,
];

/// What the client asks the agent to run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Request {
    /// The target account: `root` or `user`.
    pub user: String,
    /// Working directory of the command, absolute, inside the sandbox.
    pub cwd: String,
    /// The command and its arguments.
    pub argv: Vec<String>,
    /// Environment passed on (already reduced by the client unless `-E`).
    pub env: Vec<(String, String)>,
}

/// What the client sends while its command runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", deny_unknown_fields)]
pub enum Control {
    /// Relay this signal to the command's process group.
    Signal(i32),
}

/// The agent's one answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", deny_unknown_fields)]
pub enum Reply {
    /// The command ended: its exit code, or 128 + the signal that ended it.
    Exit(i32),
    /// The command could not be run.
    Error(String),
}

/// Why a `sudo` request failed.
#[derive(Debug, thiserror::Error)]
pub enum SudoError {
    /// Reading from or writing to the peer failed.
    #[error("sudo socket i/o: {0}")]
    Io(#[from] std::io::Error),
    /// A frame is larger than allowed.
    #[error("frame of {len} bytes exceeds the limit of {limit}")]
    TooLarge { len: usize, limit: usize },
    /// A frame is not the expected JSON.
    #[error("malformed message: {0}")]
    Json(#[from] serde_json::Error),
    /// A request is well-formed JSON but not acceptable.
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The peer did not send its request in time.
    #[error("the request did not arrive within {0:?}")]
    Timeout(Duration),
    /// The peer is not a process of the sandbox's accounts.
    #[error("peer refused: {0}")]
    Peer(String),
    /// The socket's directory is not safe to listen in.
    #[error("unsafe socket directory {path}: {why}")]
    UnsafeDir { path: String, why: &'static str },
    /// Receiving the descriptors failed.
    #[error("receiving descriptors: {0}")]
    Recv(#[source] nix::errno::Errno),
}

/// Encodes one frame: length, then payload.
pub fn frame(payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + payload.len());
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(payload);
    out
}

/// The payload length a frame header announces, refused above `limit`.
pub fn frame_len(header: [u8; 4], limit: usize) -> Result<usize, SudoError> {
    let len = u32::from_le_bytes(header) as usize;
    if len > limit {
        return Err(SudoError::TooLarge { len, limit });
    }
    Ok(len)
}

/// Parses and checks a request body: known user, absolute cwd, a non-empty argv, bounded
/// counts, no NUL anywhere, env names that `execve` can carry.
pub fn parse_request(body: &[u8]) -> Result<Request, SudoError> {
    let req: Request = serde_json::from_slice(body)?;
    let invalid = |m: &str| Err(SudoError::Invalid(m.to_string()));
    if req.user != "root" && req.user != "user" {
        return invalid("user must be `root` or `user`");
    }
    if !req.cwd.starts_with('/') || req.cwd.contains('\0') {
        return invalid("cwd must be an absolute path");
    }
    if req.argv.is_empty() || req.argv[0].is_empty() {
        return invalid("no command given");
    }
    if req.argv.len() > MAX_ITEMS || req.env.len() > MAX_ITEMS {
        return invalid("too many arguments or variables");
    }
    if req.argv.iter().any(|a| a.contains('\0')) {
        return invalid("arguments must not contain NUL bytes");
    }
    for (k, v) in &req.env {
        if k.is_empty() || k.contains(['=', '\0']) || v.contains('\0') {
            return invalid("invalid environment variable name or value");
        }
    }
    Ok(req)
}

/// Parses a control frame.
pub fn parse_control(body: &[u8]) -> Result<Control, SudoError> {
    Ok(serde_json::from_slice(body)?)
}

/// Makes sure `path` is a real directory of the sandbox's root that no one else may
/// write: then nobody but root can put anything in place of the socket.
fn check_dir(path: &str) -> Result<(), SudoError> {
    use std::os::unix::fs::MetadataExt;
    let unsafe_dir = |why| SudoError::UnsafeDir {
        path: path.to_string(),
        why,
    };
    let m = std::fs::symlink_metadata(path)?;
    if !m.file_type().is_dir() {
        return Err(unsafe_dir("not a directory"));
    }
    if m.uid() != 0 {
        return Err(unsafe_dir("not owned by root"));
    }
    if m.mode() & 0o022 != 0 {
        return Err(unsafe_dir("writable by others than root"));
    }
    Ok(())
}

/// Binds the socket after checking every directory above it; usable by every account.
fn bind() -> Result<UnixListener, SudoError> {
    for dir in ["/", "/run", SOCKET_DIR] {
        check_dir(dir)?;
    }
    match std::fs::remove_file(SOCKET_PATH) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e.into()),
    }
    let listener = UnixListener::bind(SOCKET_PATH)?;
    // The directory is root's alone, so the file cannot have been swapped since bind.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(SOCKET_PATH, std::fs::Permissions::from_mode(0o666))?;
    Ok(listener)
}

/// Serves `sudo` for the life of the agent (container sandboxes that enabled it only).
pub async fn serve(cfg: Arc<AgentConfig>, table: Arc<ProcessTable>) {
    if cfg.mode != IsolationMode::Container {
        // Root of a process sandbox is the daemon's own account on the host.
        tracing::warn!("sudo is never offered outside a container sandbox");
        return;
    }
    let listener = match bind() {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(error = %e, "sudo is not available");
            return;
        }
    };
    let sessions = Arc::new(tokio::sync::Semaphore::new(MAX_SESSIONS));
    let reading = Arc::new(tokio::sync::Semaphore::new(MAX_READING));
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                // Out of descriptors, most likely: wait instead of spinning.
                tracing::warn!(error = %e, "sudo accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let permit = sessions.clone().try_acquire_owned().ok();
        let (cfg, table, reading) = (cfg.clone(), table.clone(), reading.clone());
        tokio::spawn(async move {
            let mut stream = stream;
            let outcome = match permit {
                Some(_permit) => session(&cfg, &table, &reading, &mut stream).await,
                None => Ok(Some(Reply::Error("too many sudo commands running".into()))),
            };
            let reply = match outcome {
                Ok(Some(r)) => r,
                // The client went away: nobody to answer.
                Ok(None) => return,
                Err(e) => {
                    tracing::debug!(error = %e, "sudo request refused");
                    Reply::Error(e.to_string())
                }
            };
            if let Ok(body) = serde_json::to_vec(&reply) {
                let _ =
                    tokio::time::timeout(REQUEST_TIMEOUT, stream.write_all(&frame(&body))).await;
            }
        });
    }
}

/// Receives the first bytes of the request with exactly three descriptors attached.
async fn recv_fds(stream: &UnixStream, buf: &mut [u8]) -> Result<(usize, Vec<OwnedFd>), SudoError> {
    use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg};
    use std::io::IoSliceMut;
    loop {
        stream.readable().await?;
        let res = stream.try_io(tokio::io::Interest::READABLE, || {
            let mut cmsg = nix::cmsg_space!([RawFd; 3]);
            let mut iov = [IoSliceMut::new(buf)];
            // Close-on-exec at once: other commands started meanwhile must not inherit them.
            let flags = MsgFlags::MSG_CMSG_CLOEXEC | MsgFlags::MSG_DONTWAIT;
            let msg = recvmsg::<()>(stream.as_raw_fd(), &mut iov, Some(&mut cmsg), flags)
                .map_err(std::io::Error::from)?;
            let mut fds = Vec::new();
            if let Ok(cmsgs) = msg.cmsgs() {
                for c in cmsgs {
                    if let ControlMessageOwned::ScmRights(raw) = c {
                        // SAFETY: the kernel just installed these descriptors for us.
                        fds.extend(
                            raw.into_iter()
                                .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
                        );
                    }
                }
            }
            Ok((msg.bytes, msg.flags.contains(MsgFlags::MSG_CTRUNC), fds))
        });
        match res {
            Ok((_, true, _)) => {
                return Err(SudoError::Invalid("too many descriptors".into()));
            }
            Ok((n, false, fds)) => return Ok((n, fds)),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => {
                return Err(SudoError::Recv(nix::errno::Errno::from_raw(
                    e.raw_os_error().unwrap_or(libc::EIO),
                )));
            }
        }
    }
}

/// Reads the request: the frame header (descriptors on its first byte), then the body.
async fn read_request(stream: &mut UnixStream) -> Result<(Request, [OwnedFd; 3]), SudoError> {
    let mut header = [0u8; 4];
    let (n, fds) = recv_fds(stream, &mut header).await?;
    if n == 0 {
        return Err(SudoError::Invalid("empty request".into()));
    }
    let fds: [OwnedFd; 3] = fds
        .try_into()
        .map_err(|_| SudoError::Invalid("exactly three descriptors are needed".into()))?;
    stream.read_exact(&mut header[n..]).await?;
    let len = frame_len(header, MAX_REQUEST)?;
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body).await?;
    Ok((parse_request(&body)?, fds))
}

/// Reads one small frame; `None` at a clean end of the stream.
async fn read_small(stream: &mut UnixStream) -> Result<Option<Vec<u8>>, SudoError> {
    let mut header = [0u8; 4];
    match stream.read_exact(&mut header).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let len = frame_len(header, MAX_SMALL_FRAME)?;
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body).await?;
    Ok(Some(body))
}

/// One `sudo` command: checks the peer, reads the request, runs it, relays signals, and
/// returns the reply (`None` when the client went away and its command was ended).
async fn session(
    cfg: &Arc<AgentConfig>,
    table: &Arc<ProcessTable>,
    reading: &tokio::sync::Semaphore,
    stream: &mut UnixStream,
) -> Result<Option<Reply>, SudoError> {
    let cred = stream.peer_cred()?;
    // A peer outside the sandbox's pid namespace shows no pid; outside its user
    // namespace, an unmapped uid.
    if cred.pid().is_none_or(|p| p <= 0) {
        return Err(SudoError::Peer("not a process of this sandbox".into()));
    }
    let caller = cred.uid();
    if caller != crate::users::ROOT_UID && caller != crate::users::USER_UID {
        return Err(SudoError::Peer(format!("uid {caller} may not use sudo")));
    }
    // The whole request, the wait for a reading slot included, within the timeout.
    let (req, stdio) = tokio::time::timeout(REQUEST_TIMEOUT, async {
        let _slot = reading
            .acquire()
            .await
            .map_err(|_| SudoError::Invalid("the agent is stopping".into()))?;
        read_request(stream).await
    })
    .await
    .map_err(|_| SudoError::Timeout(REQUEST_TIMEOUT))??;
    let Some(user) = crate::users::resolve(cfg, Some(&req.user)) else {
        return Err(SudoError::Invalid(format!("unknown user {}", req.user)));
    };
    let mut config = sandpit_proto::process::ProcessConfig {
        cmd: req.argv[0].clone(),
        args: req.argv[1..].to_vec(),
        cwd: Some(req.cwd.clone()),
        ..Default::default()
    };
    let env: BTreeMap<String, String> = req
        .env
        .into_iter()
        .filter(|(k, _)| !RESERVED_ENV.contains(&k.as_str()))
        .chain([
            ("SUDO_UID".to_string(), caller.to_string()),
            ("SUDO_GID".to_string(), cred.gid().to_string()),
            ("SUDO_USER".to_string(), crate::users::name_of(cfg, caller)),
            ("SUDO_COMMAND".to_string(), sudo_command(&req.argv)),
        ])
        .collect();
    for (k, v) in env {
        config.envs.insert(k, v);
    }
    let spec = SpawnSpec {
        config,
        user,
        tag: None,
        pty: None,
        stdin: false,
        stdio: Some(stdio),
        supervise: None,
    };
    let proc = match table.spawn(spec) {
        Ok((proc, _, _)) => proc,
        Err(e) => return Ok(Some(Reply::Error(e.message.unwrap_or_default()))),
    };
    let pid = proc.pid();
    tracing::info!(pid, caller, user = %req.user, "sudo command started");
    let reply = relay(table, &proc, stream).await;
    table.forget(&proc);
    Ok(reply)
}

/// Waits for the command's exit while relaying the client's signals; ends the command
/// when the client goes away (`None`).
async fn relay(
    table: &Arc<ProcessTable>,
    proc: &Arc<crate::process::Proc>,
    stream: &mut UnixStream,
) -> Option<Reply> {
    let pid = proc.pid();
    let exit = crate::process::exit_status(table, proc);
    tokio::pin!(exit);
    loop {
        tokio::select! {
            status = &mut exit => {
                return Some(match status {
                    Some((code, None)) => Reply::Exit(code),
                    Some((_, Some(sig))) => Reply::Exit(128 + sig),
                    None => Reply::Error("the command's exit status was lost".into()),
                });
            }
            frame = read_small(stream) => {
                let control = match frame {
                    Ok(Some(body)) => parse_control(&body),
                    Ok(None) => Err(SudoError::Invalid("client went away".into())),
                    Err(e) => Err(e),
                };
                match control {
                    Ok(Control::Signal(sig)) if RELAYED_SIGNALS.contains(&sig) => {
                        if let Ok(sig) = nix::sys::signal::Signal::try_from(sig) {
                            let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pid as i32), sig);
                        }
                    }
                    Ok(Control::Signal(sig)) => {
                        tracing::debug!(pid, sig, "sudo: signal not relayed");
                    }
                    Err(e) => {
                        // The client is gone (or talks nonsense): its command goes with
                        // it, as it would were it the client's own child.
                        tracing::debug!(pid, error = %e, "sudo client gone; ending its command");
                        kill_tree(pid, nix::sys::signal::Signal::SIGKILL);
                        // Its exit reaches the table entry before the entry is forgotten.
                        let _ = tokio::time::timeout(REQUEST_TIMEOUT, &mut exit).await;
                        return None;
                    }
                }
            }
        }
    }
}

/// `SUDO_COMMAND` as sudo sets it: the command line, bounded.
fn sudo_command(argv: &[String]) -> String {
    let mut s = argv.join(" ");
    if s.len() > 4096 {
        let mut end = 4096;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
    s
}

mod client;
pub use client::{ArgError, Invocation, client_main, parse_args, request_for};

#[cfg(test)]
mod tests;
