//! `exec` and `run`: a command's output streamed over the command WebSocket, with stdin
//! forwarded and, for `-t`, a pseudo-terminal driven from the local terminal in raw mode.

use std::io::{IsTerminal, Read, Write};
use std::time::Duration;

use anyhow::Context;
use nix::sys::termios::{SetArg, Termios, cfmakeraw, tcgetattr, tcsetattr};
use sandpit_api::{CommandEvent, PtySize, RunCommandRequest};
use sandpit_client::{Client, decode_data};
use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio::sync::{mpsc, watch};

use crate::sandboxes::create_request;
use crate::util::now_ms;
use crate::{Ctx, ExecArgs, ExecOpts, RunArgs};

/// Size of one stdin chunk sent to the command.
const STDIN_CHUNK: usize = 32 * 1024;

/// `sandpit exec`.
pub async fn exec(ctx: &Ctx, args: ExecArgs) -> anyhow::Result<u8> {
    let client = ctx.client()?;
    let mut interrupts = Interrupts::install()?;
    let code = stream(&client, &args.id, &args.opts, args.argv, &mut interrupts).await?;
    Ok(exit_byte(code))
}

/// `sandpit run`: create, exec, and delete the sandbox whatever happened.
pub async fn run(ctx: &Ctx, args: RunArgs) -> anyhow::Result<u8> {
    let client = ctx.client()?;
    // Installed before the sandbox exists, so Ctrl-C can no longer kill us between its
    // creation and its deletion.
    let mut interrupts = Interrupts::install()?;
    // `--env` sets the sandbox's environment too, so helper processes see it as well.
    let req = create_request(&args.sandbox, args.sandbox_timeout, &args.opts.env);
    let sandbox = client.create_sandbox(&req).await?;
    let id = sandbox.id.clone();
    let result = if interrupts.count() > 0 {
        Err(anyhow::anyhow!("interrupted"))
    } else {
        // The sandbox lives as long as this command needs it; if we die, it expires soon.
        let period =
            Duration::from_millis(((sandbox.expires_at_ms - now_ms()).max(3_000) / 3) as u64);
        let keepalive = tokio::spawn(keep_alive(client.clone(), id.clone(), period));
        let result = stream(&client, &id, &args.opts, args.argv, &mut interrupts).await;
        keepalive.abort();
        result
    };
    if let Err(e) = client.delete_sandbox(&id).await
        && !e.is_not_found()
    {
        eprintln!("warning: could not delete sandbox {id}: {e}");
    }
    result.map(exit_byte)
}

async fn keep_alive(client: Client, id: String, period: Duration) {
    let mut tick = tokio::time::interval(period);
    tick.tick().await;
    loop {
        tick.tick().await;
        if let Err(e) = client.keepalive(&id).await {
            tracing::warn!(sandbox = %id, error = %e, "keepalive failed");
        }
    }
}

/// A command's exit code as a process exit status (out-of-range codes are failures).
fn exit_byte(code: i32) -> u8 {
    u8::try_from(code).unwrap_or(if code < 0 { 1 } else { 255 })
}

/// Runs `argv` in sandbox `id` over the WebSocket until it ends; returns its exit code.
async fn stream(
    client: &Client,
    id: &str,
    opts: &ExecOpts,
    argv: Vec<String>,
    interrupts: &mut Interrupts,
) -> anyhow::Result<i32> {
    let stdin_tty = std::io::stdin().is_terminal();
    // Like `docker exec`: a terminal's input is only taken with -i; piped input always.
    let forward_stdin = opts.interactive || !stdin_tty;
    let pty = opts
        .tty
        .then(|| terminal_size().unwrap_or(PtySize { cols: 80, rows: 24 }));
    let timeout_ms = opts
        .timeout
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1));
    let req = RunCommandRequest {
        argv,
        env: opts.env.iter().cloned().collect(),
        cwd: opts.cwd.clone(),
        user: opts.user.clone(),
        timeout_ms,
        pty,
        // The daemon opens the command's stdin only when `stdin` is set; on the WebSocket
        // the text is not written, and the input comes as Stdin messages instead.
        stdin: forward_stdin.then(String::new),
        ..Default::default()
    };
    let mut cmd = client.stream_command(id, &req).await?;
    // Dropped (restoring the terminal) on every way out of this function.
    let raw = if opts.tty && forward_stdin && stdin_tty {
        Some(RawMode::enable()?)
    } else {
        None
    };
    let mut stdin = if forward_stdin {
        Some(spawn_stdin_reader()?)
    } else {
        None
    };
    let mut winch = if pty.is_some() {
        signal(SignalKind::window_change()).ok()
    } else {
        None
    };
    let mut started = false;
    let mut errors = Vec::new();
    let exit_code = loop {
        tokio::select! {
            event = cmd.next_event() => match event? {
                None => break None,
                Some(CommandEvent::Start { .. }) => started = true,
                // Plain blocking writes: tokio's stdio is not built in this workspace, and a
                // terminal or pipe that stalls should hold the stream up anyway.
                Some(CommandEvent::Stdout { data } | CommandEvent::Pty { data }) => {
                    let mut out = std::io::stdout().lock();
                    out.write_all(&decode_data(&data)?)?;
                    out.flush()?;
                }
                Some(CommandEvent::Stderr { data }) => {
                    let mut err = std::io::stderr().lock();
                    err.write_all(&decode_data(&data)?)?;
                    err.flush()?;
                }
                Some(CommandEvent::End { exit_code, .. }) => break Some(exit_code),
                Some(CommandEvent::Error { message }) => errors.push(message),
            },
            // The daemon drops input sent before the command has started.
            chunk = next_chunk(&mut stdin), if started => match chunk {
                Some(Ok(bytes)) => cmd.write_stdin(&bytes).await?,
                Some(Err(e)) => {
                    errors.push(format!("reading stdin failed, closed the command's stdin: {e}"));
                    stdin = None;
                    cmd.close_stdin().await?;
                }
                None => {
                    stdin = None;
                    cmd.close_stdin().await?;
                }
            },
            () = next_signal(&mut winch) => {
                if let Some(size) = terminal_size() {
                    cmd.resize(size.cols, size.rows).await?;
                }
            }
            n = interrupts.next() => match n {
                1 => cmd.signal("SIGTERM").await?,
                2 => cmd.signal("SIGKILL").await?,
                _ => anyhow::bail!("interrupted"),
            },
        }
    };
    drop(raw);
    match exit_code {
        Some(code) => {
            for e in errors {
                eprintln!("warning: {e}");
            }
            Ok(code)
        }
        None if errors.is_empty() => {
            anyhow::bail!("the daemon closed the stream before the command ended")
        }
        None => anyhow::bail!("{}", errors.join("; ")),
    }
}

async fn next_chunk(
    rx: &mut Option<mpsc::Receiver<std::io::Result<Vec<u8>>>>,
) -> Option<std::io::Result<Vec<u8>>> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

async fn next_signal(sig: &mut Option<Signal>) {
    if let Some(s) = sig
        && s.recv().await.is_some()
    {
        return;
    }
    std::future::pending().await
}

/// Reads our stdin on a plain thread (a blocked read must never hold up exiting) and hands
/// the chunks over; the channel closes at end of file, after a read error if there was one.
pub fn spawn_stdin_reader() -> anyhow::Result<mpsc::Receiver<std::io::Result<Vec<u8>>>> {
    let (tx, rx) = mpsc::channel(8);
    std::thread::Builder::new()
        .name("stdin".into())
        .spawn(move || {
            let mut stdin = std::io::stdin().lock();
            let mut buf = vec![0u8; STDIN_CHUNK];
            loop {
                let chunk = match stdin.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => Ok(buf[..n].to_vec()),
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => Err(e),
                };
                let failed = chunk.is_err();
                if tx.blocking_send(chunk).is_err() || failed {
                    break;
                }
            }
        })
        .context("cannot start the stdin thread")?;
    Ok(rx)
}

nix::ioctl_read_bad!(tiocgwinsz, libc::TIOCGWINSZ, libc::winsize);

/// Size of the terminal on stdin, stdout or stderr, whichever is one.
fn terminal_size() -> Option<PtySize> {
    for fd in [libc::STDIN_FILENO, libc::STDOUT_FILENO, libc::STDERR_FILENO] {
        let mut ws = libc::winsize {
            ws_row: 0,
            ws_col: 0,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        // SAFETY: TIOCGWINSZ writes one `winsize` through a pointer to a live local.
        let ok = unsafe { tiocgwinsz(fd, &mut ws) }.is_ok();
        if ok && ws.ws_col > 0 && ws.ws_row > 0 {
            return Some(PtySize {
                cols: ws.ws_col,
                rows: ws.ws_row,
            });
        }
    }
    None
}

/// The local terminal in raw mode for as long as this lives.
struct RawMode {
    saved: Termios,
}

impl RawMode {
    fn enable() -> anyhow::Result<RawMode> {
        let stdin = std::io::stdin();
        let saved = tcgetattr(&stdin).context("cannot read the terminal's settings")?;
        let mut raw = saved.clone();
        cfmakeraw(&mut raw);
        tcsetattr(&stdin, SetArg::TCSANOW, &raw).context("cannot put the terminal in raw mode")?;
        Ok(RawMode { saved })
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        let _ = tcsetattr(std::io::stdin(), SetArg::TCSANOW, &self.saved);
    }
}

/// Counts SIGINT, SIGTERM and SIGHUP: the first asks the command to stop, the second kills
/// it, the third gives up waiting.
struct Interrupts {
    count: watch::Receiver<u32>,
}

impl Interrupts {
    fn install() -> anyhow::Result<Interrupts> {
        let mut sigs = Vec::new();
        for kind in [
            SignalKind::interrupt(),
            SignalKind::terminate(),
            SignalKind::hangup(),
        ] {
            sigs.push(signal(kind).context("cannot install signal handlers")?);
        }
        let (tx, count) = watch::channel(0u32);
        for mut sig in sigs {
            let tx = tx.clone();
            tokio::spawn(async move {
                while sig.recv().await.is_some() {
                    tx.send_modify(|n| *n += 1);
                }
            });
        }
        Ok(Interrupts { count })
    }

    /// Signals received so far.
    fn count(&self) -> u32 {
        *self.count.borrow()
    }

    /// Waits for the next signal and returns the count including it (cancel-safe).
    async fn next(&mut self) -> u32 {
        if self.count.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
        *self.count.borrow_and_update()
    }
}
