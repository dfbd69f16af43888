//! The `sudo` command of a sandbox: parses sudo's common options, reduces the
//! environment as sudo's `env_reset` does, hands the request and its standard descriptors
//! to the agent, relays signals, and exits with the command's status.

use super::{Control, MAX_SMALL_FRAME, Reply, Request, SOCKET_PATH, frame, frame_len};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

/// Variables kept without `-E` (sudo's default `env_keep` and `env_check` lists, less
/// what the agent sets itself); `LC_*` are kept too.
const KEEP_ENV: &[&str] = &[
    "TERM",
    "COLORTERM",
    "DISPLAY",
    "XAUTHORITY",
    "LANG",
    "LANGUAGE",
    "TZ",
    "COLUMNS",
    "LINES",
    "LS_COLORS",
];
/// Signals relayed to the command, as sudo relays them.
const RELAY: &[i32] = &[
    libc::SIGHUP,
    libc::SIGINT,
    libc::SIGQUIT,
    libc::SIGTERM,
    libc::SIGUSR1,
    libc::SIGUSR2,
];
const USAGE: &str = "usage: sudo [-EHnks] [-u user] [--] command [arg ...]\n       sudo -i|-s [-u user] [command [arg ...]]";

/// Why the command line was refused.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum ArgError {
    /// An option this sudo does not know.
    #[error("unknown option: {0}")]
    UnknownOption(String),
    /// An option that needs a value came last.
    #[error("option requires an argument -- '{0}'")]
    MissingValue(char),
    /// A target account other than the sandbox's two.
    #[error("unknown user {0}")]
    UnknownUser(String),
    /// Nothing to run.
    #[error("a command is required")]
    NoCommand,
}

/// A parsed `sudo` command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Invocation {
    /// Run a command (or a shell) as `user`.
    Run {
        /// `root` or `user`.
        user: String,
        /// `-E`: keep the whole environment.
        preserve_env: bool,
        /// `-i`: the target's login shell, in its home.
        login: bool,
        /// `-s`: a shell.
        shell: bool,
        /// The command and its arguments (may be empty with `-i`/`-s`).
        argv: Vec<String>,
    },
    /// `-h`.
    Help,
    /// `-V`.
    Version,
    /// `-v`, `-k`, `-K`: nothing to do without passwords.
    Nothing,
}

fn target(name: &str) -> Result<String, ArgError> {
    match name {
        "root" | "#0" => Ok("root".into()),
        "user" | "#1000" => Ok("user".into()),
        other => Err(ArgError::UnknownUser(other.into())),
    }
}

/// Parses the arguments after `sudo`.
pub fn parse_args(args: &[String]) -> Result<Invocation, ArgError> {
    let mut user = "root".to_string();
    let (mut preserve_env, mut login, mut shell) = (false, false, false);
    let mut only = None;
    let mut i = 0;
    while i < args.len() {
        let a = &args[i];
        if a == "--" {
            i += 1;
            break;
        }
        if let Some(long) = a.strip_prefix("--") {
            let (name, value) = match long.split_once('=') {
                Some((n, v)) => (n, Some(v.to_string())),
                None => (long, None),
            };
            match name {
                "user" => {
                    let v = match value {
                        Some(v) => v,
                        None => {
                            i += 1;
                            args.get(i).cloned().ok_or(ArgError::MissingValue('u'))?
                        }
                    };
                    user = target(&v)?;
                }
                "preserve-env" if value.is_none() => preserve_env = true,
                "login" => login = true,
                "shell" => shell = true,
                "non-interactive" | "set-home" => {}
                "help" => only = Some(Invocation::Help),
                "version" => only = Some(Invocation::Version),
                "validate" | "reset-timestamp" | "remove-timestamp" => {
                    only = Some(Invocation::Nothing)
                }
                _ => return Err(ArgError::UnknownOption(a.clone())),
            }
            i += 1;
            continue;
        }
        let Some(flags) = a.strip_prefix('-').filter(|f| !f.is_empty()) else {
            break;
        };
        for (at, c) in flags.char_indices() {
            match c {
                'u' => {
                    let rest = &flags[at + c.len_utf8()..];
                    let v = if rest.is_empty() {
                        i += 1;
                        args.get(i).cloned().ok_or(ArgError::MissingValue('u'))?
                    } else {
                        rest.to_string()
                    };
                    user = target(&v)?;
                    break;
                }
                'E' => preserve_env = true,
                'i' => login = true,
                's' => shell = true,
                'n' | 'H' => {}
                'h' => only = Some(Invocation::Help),
                'V' => only = Some(Invocation::Version),
                'v' | 'k' | 'K' => only = Some(Invocation::Nothing),
                other => return Err(ArgError::UnknownOption(format!("-{other}"))),
            }
        }
        i += 1;
    }
    let argv = args[i..].to_vec();
    if let Some(only) = only
        && argv.is_empty()
    {
        return Ok(only);
    }
    if argv.is_empty() && !login && !shell {
        return Err(ArgError::NoCommand);
    }
    Ok(Invocation::Run {
        user,
        preserve_env,
        login,
        shell,
        argv,
    })
}

/// sudo's quoting of a command for `shell -c`: every character but letters, digits and a
/// few harmless ones behind a backslash.
fn shell_quote(argv: &[String]) -> String {
    argv.iter()
        .map(|a| {
            let mut out = String::with_capacity(a.len());
            for ch in a.chars() {
                if !(ch.is_ascii_alphanumeric() || "_-./=:,@%+".contains(ch)) {
                    out.push('\\');
                }
                out.push(ch);
            }
            out
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The request an invocation sends, given the caller's environment and directory.
pub fn request_for(
    user: &str,
    preserve_env: bool,
    login: bool,
    shell: bool,
    argv: &[String],
    env: impl IntoIterator<Item = (String, String)>,
    cwd: String,
) -> Request {
    let home = if user == "root" {
        "/root"
    } else {
        "/home/user"
    };
    let argv = if login || shell {
        let mut v = vec!["/bin/bash".to_string()];
        if login {
            v.push("-l".into());
        }
        if !argv.is_empty() {
            v.push("-c".into());
            v.push(shell_quote(argv));
        }
        v
    } else {
        argv.to_vec()
    };
    let env = env
        .into_iter()
        .filter(|(k, _)| preserve_env || KEEP_ENV.contains(&k.as_str()) || k.starts_with("LC_"))
        .collect();
    Request {
        user: user.into(),
        cwd: if login { home.into() } else { cwd },
        argv,
        env,
    }
}

/// Runs the `sudo` command; returns its exit code.
pub fn client_main() -> i32 {
    let args: Vec<String> = match std::env::args_os()
        .skip(1)
        .map(|a| a.into_string())
        .collect::<Result<_, _>>()
    {
        Ok(a) => a,
        Err(_) => {
            eprintln!("sudo: arguments must be UTF-8");
            return 1;
        }
    };
    let inv = match parse_args(&args) {
        Ok(inv) => inv,
        Err(e) => {
            eprintln!("sudo: {e}\n{USAGE}");
            return 1;
        }
    };
    let (user, preserve_env, login, shell, argv) = match inv {
        Invocation::Help => {
            println!(
                "sudo - run a command as root in a sandpit sandbox (through its agent)\n\n{USAGE}"
            );
            return 0;
        }
        Invocation::Version => {
            println!("sandpit sudo {}", env!("CARGO_PKG_VERSION"));
            return 0;
        }
        Invocation::Nothing => return 0,
        Invocation::Run {
            user,
            preserve_env,
            login,
            shell,
            argv,
        } => (user, preserve_env, login, shell, argv),
    };
    let env = std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)));
    let cwd = std::env::current_dir()
        .ok()
        .and_then(|p| p.into_os_string().into_string().ok())
        .unwrap_or_else(|| "/".into());
    let req = request_for(&user, preserve_env, login, shell, &argv, env, cwd);
    match run(&req) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("sudo: {e}");
            1
        }
    }
}

/// Why the client could not get an answer.
#[derive(Debug, thiserror::Error)]
enum ClientError {
    #[error("cannot reach the sandbox agent at {SOCKET_PATH}: {0}")]
    Connect(#[source] std::io::Error),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("sending the request: {0}")]
    Send(#[source] nix::errno::Errno),
    #[error("{0}")]
    Protocol(#[from] super::SudoError),
    #[error("{0}")]
    Refused(String),
    #[error("the agent closed the connection without an answer")]
    NoAnswer,
}

/// This process's descriptor `fd`, or `/dev/null` when it is closed.
fn stdio_fd(fd: RawFd, keep: &mut Vec<OwnedFd>) -> Result<RawFd, ClientError> {
    // SAFETY: fcntl F_GETFD only asks whether the descriptor is open.
    if unsafe { libc::fcntl(fd, libc::F_GETFD) } >= 0 {
        return Ok(fd);
    }
    let null: OwnedFd = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")?
        .into();
    let raw = null.as_raw_fd();
    keep.push(null);
    Ok(raw)
}

fn run(req: &Request) -> Result<i32, ClientError> {
    use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};
    use std::io::Write;
    let body = serde_json::to_vec(req).map_err(super::SudoError::from)?;
    if body.len() > super::MAX_REQUEST {
        return Err(ClientError::Refused(
            "the command line and environment are too large".into(),
        ));
    }
    let mut stream =
        std::os::unix::net::UnixStream::connect(SOCKET_PATH).map_err(ClientError::Connect)?;
    let mut keep = Vec::new();
    let fds = [
        stdio_fd(0, &mut keep)?,
        stdio_fd(1, &mut keep)?,
        stdio_fd(2, &mut keep)?,
    ];
    let framed = frame(&body);
    let first = [std::io::IoSlice::new(&framed[..4])];
    let rights = [ControlMessage::ScmRights(&fds)];
    let mut sent = 0;
    while sent == 0 {
        sent = match sendmsg::<()>(stream.as_raw_fd(), &first, &rights, MsgFlags::empty(), None) {
            Ok(n) => n,
            Err(nix::errno::Errno::EINTR) => 0,
            Err(e) => return Err(ClientError::Send(e)),
        };
    }
    match stream.write_all(&framed[sent..]) {
        Ok(()) => {}
        // The agent refused after the first bytes and hung up: its answer says why.
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
            ) => {}
        Err(e) => return Err(e.into()),
    }
    drop(keep);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(wait_reply(stream))
}

async fn wait_reply(stream: std::os::unix::net::UnixStream) -> Result<i32, ClientError> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::signal::unix::{SignalKind, signal};
    stream.set_nonblocking(true)?;
    let stream = tokio::net::UnixStream::from_std(stream)?;
    let (mut rd, mut wr) = stream.into_split();
    let (tx, mut rx) = tokio::sync::mpsc::channel::<i32>(16);
    for &sig in RELAY {
        let mut s = signal(SignalKind::from_raw(sig))?;
        let tx = tx.clone();
        tokio::spawn(async move {
            while s.recv().await.is_some() {
                if tx.send(sig).await.is_err() {
                    return;
                }
            }
        });
    }
    drop(tx);
    let read = async move {
        let mut header = [0u8; 4];
        match rd.read_exact(&mut header).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                return Err(ClientError::NoAnswer);
            }
            Err(e) => return Err(e.into()),
        }
        let len = frame_len(header, MAX_SMALL_FRAME)?;
        let mut body = vec![0u8; len];
        rd.read_exact(&mut body).await?;
        let reply: Reply = serde_json::from_slice(&body).map_err(super::SudoError::from)?;
        Ok(reply)
    };
    tokio::pin!(read);
    loop {
        tokio::select! {
            reply = &mut read => {
                return match reply? {
                    Reply::Exit(code) => Ok(code),
                    Reply::Error(msg) => Err(ClientError::Refused(msg)),
                };
            }
            Some(sig) = rx.recv() => {
                if let Ok(body) = serde_json::to_vec(&Control::Signal(sig)) {
                    // A failed relay shows as the missing answer above.
                    let _ = wr.write_all(&frame(&body)).await;
                }
            }
        }
    }
}
