//! Processes started through `process.Process`: spawning with pipes or a pty, the table
//! the reaper reports exits to, output kept for reattachment, signals and input.
//!
//! Output is delivered to every attached stream; while nobody is attached it is kept
//! (up to [`BACKLOG_LIMIT`] bytes) so that a client that went away can reconnect minutes
//! later and read everything it missed.

use crate::config::{AgentConfig, IsolationMode};
use crate::users::{self, User};
use connectrpc::{
    ConnectError, RequestContext, Response, ServiceRequest, ServiceResult, ServiceStream,
};
use nix::sys::signal::{Signal as NixSignal, kill, killpg};
use nix::unistd::Pid;
use parking_lot::Mutex;
use sandpit_proto::process::__buffa::oneof::process_event::Event;
use sandpit_proto::process::__buffa::oneof::process_event::data_event::Output;
use sandpit_proto::process::__buffa::oneof::process_input::Input;
use sandpit_proto::process::__buffa::oneof::process_selector::Selector;
use sandpit_proto::process::__buffa::oneof::stream_input_request::Event as InputEvent;
use sandpit_proto::process::process_event::{DataEvent, EndEvent, StartEvent};
use sandpit_proto::process::*;
use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::unix::AsyncFd;
use tokio::sync::mpsc;

pub use sandpit_abi::kill_tree;

/// Output bytes kept for a process while no client is attached.
pub const BACKLOG_LIMIT: usize = 64 << 20;
/// How long an ended process whose output nobody collected stays reattachable.
const ENDED_RETENTION: Duration = Duration::from_secs(30 * 60);
/// After the process exits, how long to wait for descendants still holding its pipes.
const DRAIN_GRACE: Duration = Duration::from_millis(250);
const READ_CHUNK: usize = 64 * 1024;
/// How often a command whose exit was not reported yet is looked at directly.
const EXIT_RECHECK: Duration = Duration::from_secs(1);
/// How soon the reaper looks again after a pass that could not finish.
const REAP_RETRY: Duration = Duration::from_millis(50);

/// Non-blocking access to a pipe or pty master.
pub struct FdIo(AsyncFd<OwnedFd>);

impl FdIo {
    fn new(fd: OwnedFd) -> std::io::Result<Self> {
        let flags = nix::fcntl::fcntl(fd.as_fd(), nix::fcntl::FcntlArg::F_GETFL)?;
        let flags = nix::fcntl::OFlag::from_bits_truncate(flags) | nix::fcntl::OFlag::O_NONBLOCK;
        nix::fcntl::fcntl(fd.as_fd(), nix::fcntl::FcntlArg::F_SETFL(flags))?;
        // SAFETY: the OwnedFd is moved in and stays open for as long as the AsyncFd lives.
        Ok(Self(unsafe { AsyncFd::register(fd)? }))
    }

    /// Reads some bytes; Ok(0) at end of file (EIO on a pty master means the same).
    async fn read(&self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            let mut guard = self.0.readable().await?;
            match guard.try_io(|inner| {
                nix::unistd::read(inner.get_ref(), buf).map_err(std::io::Error::from)
            }) {
                Ok(Ok(n)) => return Ok(n),
                Ok(Err(e)) if e.raw_os_error() == Some(libc::EIO) => return Ok(0),
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
    }

    async fn write_all(&self, mut data: &[u8]) -> std::io::Result<()> {
        while !data.is_empty() {
            let mut guard = self.0.writable().await?;
            match guard.try_io(|inner| {
                nix::unistd::write(inner.get_ref(), data).map_err(std::io::Error::from)
            }) {
                Ok(Ok(n)) => data = &data[n..],
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
        Ok(())
    }

    fn raw(&self) -> i32 {
        self.0.get_ref().as_raw_fd()
    }
}

#[derive(Default)]
struct Output_ {
    backlog: VecDeque<ProcessEvent>,
    backlog_bytes: usize,
    subscribers: Vec<mpsc::Sender<ProcessEvent>>,
    end: Option<ProcessEvent>,
    ended_at: Option<std::time::Instant>,
}

/// One started process.
pub struct Proc {
    pid: u32,
    tag: Option<String>,
    config: ProcessConfig,
    stdin: tokio::sync::Mutex<Option<Arc<FdIo>>>,
    pty: Option<Arc<FdIo>>,
    out: Mutex<Output_>,
    exit: tokio::sync::watch::Sender<Option<(i32, Option<i32>)>>,
}

fn event_size(ev: &ProcessEvent) -> usize {
    match &ev.event {
        Some(Event::Data(d)) => match &d.output {
            Some(Output::Stdout(b) | Output::Stderr(b) | Output::Pty(b)) => b.len(),
            None => 0,
        },
        _ => 64,
    }
}

impl Proc {
    /// Hands an event to the attached streams, or keeps it until someone attaches.
    async fn publish(&self, ev: ProcessEvent) {
        let subs = {
            let mut out = self.out.lock();
            out.subscribers.retain(|s| !s.is_closed());
            if matches!(ev.event, Some(Event::End(_))) {
                out.end = Some(ev.clone());
                out.ended_at = Some(std::time::Instant::now());
            }
            if out.subscribers.is_empty() {
                Self::keep(&mut out, ev);
                return;
            }
            out.subscribers.clone()
        };
        let mut delivered = false;
        for s in subs {
            // Awaiting a full channel is the back-pressure: a slow reader slows the process.
            delivered |= s.send(ev.clone()).await.is_ok();
        }
        if !delivered {
            Self::keep(&mut self.out.lock(), ev);
        }
    }

    fn keep(out: &mut Output_, ev: ProcessEvent) {
        if matches!(ev.event, Some(Event::End(_))) {
            return; // kept separately in `end`
        }
        out.backlog_bytes += event_size(&ev);
        out.backlog.push_back(ev);
        while out.backlog_bytes > BACKLOG_LIMIT {
            match out.backlog.pop_front() {
                Some(old) => out.backlog_bytes -= event_size(&old),
                None => break,
            }
        }
    }

    /// Attaches a stream: returns what was missed and a channel for what follows.
    fn subscribe(&self) -> (Vec<ProcessEvent>, Option<mpsc::Receiver<ProcessEvent>>) {
        let mut out = self.out.lock();
        let mut missed: Vec<ProcessEvent> = out.backlog.drain(..).collect();
        out.backlog_bytes = 0;
        if let Some(end) = &out.end {
            missed.push(end.clone());
            return (missed, None);
        }
        let (tx, rx) = mpsc::channel(64);
        out.subscribers.push(tx);
        (missed, Some(rx))
    }

    fn is_running(&self) -> bool {
        self.exit.borrow().is_none()
    }

    /// Records the exit status (the first one reported wins). Stored even while nobody
    /// watches yet: `finish` subscribes only when it first runs, which under load can be
    /// after the reaper collected a short command, and a plain `send` would drop the
    /// status for want of a receiver.
    fn exited(&self, status: ExitStatus) {
        self.exit.send_if_modified(|v| {
            if v.is_some() {
                return false;
            }
            *v = Some(status);
            true
        });
    }

    /// The process id of the command.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    fn info(&self) -> ProcessInfo {
        ProcessInfo {
            config: self.config.clone().into(),
            pid: self.pid,
            tag: self.tag.clone(),
            ..Default::default()
        }
    }
}

/// An exit status, as `(code, signal)`.
pub(crate) type ExitStatus = (i32, Option<i32>);

/// The commands and the exits nobody claimed yet, behind one lock so that an exit is
/// either seen by `spawn` when it registers the pid or delivered to the entry afterwards.
#[derive(Default)]
struct Registry {
    procs: HashMap<u32, Arc<Proc>>,
    /// Exits of children that were not (yet) registered commands: orphans, and a command
    /// reaped before its spawner registered it.
    unclaimed: HashMap<u32, ExitStatus>,
}

/// Most unclaimed exits kept; orphans re-parented to the agent land there too.
const UNCLAIMED_LIMIT: usize = 4096;

/// Every process the agent started and has not forgotten yet.
pub struct ProcessTable {
    cfg: Arc<AgentConfig>,
    reg: Mutex<Registry>,
    /// CPU time and memory peak of each command, from the reaper's rusage.
    pub(crate) usage: crate::rusage::UsageTable,
}

/// A started process, the events it already produced, and the channel of the rest.
pub type Spawned = (Arc<Proc>, Vec<ProcessEvent>, mpsc::Receiver<ProcessEvent>);

/// What a caller asks to run.
pub struct SpawnSpec {
    pub config: ProcessConfig,
    pub user: User,
    pub tag: Option<String>,
    pub pty: Option<(u16, u16)>,
    pub stdin: bool,
    /// Descriptors to run the command on (stdin, stdout, stderr) instead of pipes or a
    /// pty: the sandbox's `sudo` hands over its own. Such a command's output never
    /// reaches the table.
    pub stdio: Option<[OwnedFd; 3]>,
    /// Run the command under the supervisor ([`crate::supervise`]) with this grace
    /// period: everything it leaves behind stays in its tree, and a SIGTERM ends all of it.
    pub supervise: Option<Duration>,
}

impl SpawnSpec {
    /// Runs `config` as API user `user` ("root" or "user"; `None`: the sandbox's default),
    /// without a pty, stdin or tag; `None` if the user is unknown.
    pub fn new(cfg: &AgentConfig, user: Option<&str>, config: ProcessConfig) -> Option<Self> {
        Some(Self {
            config,
            user: users::resolve(cfg, user)?,
            tag: None,
            pty: None,
            stdin: false,
            stdio: None,
            supervise: None,
        })
    }
}

impl ProcessTable {
    /// An empty table for the given agent.
    pub fn new(cfg: Arc<AgentConfig>) -> Arc<Self> {
        Arc::new(Self {
            cfg,
            reg: Mutex::default(),
            usage: Default::default(),
        })
    }

    /// Whether `pid` is a command the agent started (and has not forgotten).
    pub fn is_command(&self, pid: u32) -> bool {
        self.reg.lock().procs.contains_key(&pid)
    }

    fn get(&self, sel: &ProcessSelector) -> Result<Arc<Proc>, ConnectError> {
        let reg = self.reg.lock();
        let procs = &reg.procs;
        let found = match &sel.selector {
            Some(Selector::Pid(pid)) => procs.get(pid).cloned(),
            Some(Selector::Tag(tag)) => procs
                .values()
                .find(|p| p.tag.as_deref() == Some(tag.as_str()))
                .cloned(),
            None => return Err(ConnectError::invalid_argument("process selector is empty")),
        };
        found.ok_or_else(|| ConnectError::not_found("process not found"))
    }

    /// Called by the reaper for every child it collected.
    pub fn on_exit(&self, pid: u32, code: i32, signal: Option<i32>) {
        let mut reg = self.reg.lock();
        match reg.procs.get(&pid) {
            Some(p) => p.exited((code, signal)),
            None => {
                if reg.unclaimed.len() >= UNCLAIMED_LIMIT {
                    reg.unclaimed.clear();
                }
                reg.unclaimed.insert(pid, (code, signal));
            }
        }
    }

    /// Registers a freshly forked command, and hands it its exit if the reaper collected
    /// it already. An unclaimed exit under the same pid may also be an orphan's from long
    /// ago (pids are reused): it is the command's only if the command is no longer a child
    /// of the agent, i.e. it was collected.
    fn register(&self, proc: &Arc<Proc>) {
        let mut reg = self.reg.lock();
        reg.procs.insert(proc.pid, proc.clone());
        if let Some(status) = reg.unclaimed.remove(&proc.pid)
            && child_state(proc.pid) == ChildState::Gone
        {
            proc.exited(status);
        }
    }

    /// Whether `proc` is still the table's entry for its pid (not replaced by a command
    /// that was given the same pid after it).
    fn holds(&self, proc: &Arc<Proc>) -> bool {
        self.reg
            .lock()
            .procs
            .get(&proc.pid)
            .is_some_and(|p| Arc::ptr_eq(p, proc))
    }

    /// Drops `proc`'s entry (if it is still the one under its pid): a command whose exit
    /// its starter collected itself, as `sudo` does, needs no keeping for a reattach.
    pub(crate) fn forget(&self, proc: &Arc<Proc>) {
        let mut reg = self.reg.lock();
        if reg
            .procs
            .get(&proc.pid)
            .is_some_and(|p| Arc::ptr_eq(p, proc))
        {
            reg.procs.remove(&proc.pid);
        }
    }

    /// Takes the unclaimed exit recorded under `pid`, if any.
    fn take_unclaimed(&self, pid: u32) -> Option<ExitStatus> {
        self.reg.lock().unclaimed.remove(&pid)
    }

    /// Drops ended processes whose output was collected or that are too old.
    fn gc(&self) {
        self.reg.lock().procs.retain(|_, p| {
            let out = p.out.lock();
            match out.ended_at {
                None => true,
                Some(at) => {
                    let collected = out.backlog.is_empty() && !out.subscribers.is_empty();
                    !collected && at.elapsed() < ENDED_RETENTION
                }
            }
        });
    }

    /// Starts a process and returns it; its output flows into the table entry.
    pub fn spawn(self: &Arc<Self>, spec: SpawnSpec) -> Result<Spawned, ConnectError> {
        self.gc();
        let cfg = &self.cfg;
        let c = &spec.config;
        if c.cmd.is_empty() {
            return Err(ConnectError::invalid_argument("cmd is empty"));
        }
        if c.cmd.contains('\0') || c.args.iter().any(|a| a.contains('\0')) {
            return Err(ConnectError::invalid_argument(
                "cmd and args must not contain NUL bytes",
            ));
        }
        let mut cmd = match spec.supervise {
            None => std::process::Command::new(&c.cmd),
            Some(grace) => {
                // The agent's own binary, whichever path it was started from (the sandbox's
                // `/.sandpit/agent`, or the daemon's binary for the `process` runtime).
                let mut cmd = std::process::Command::new(SELF_EXE);
                cmd.arg0(sandpit_abi::SUPERVISOR_ARGV0)
                    .arg(grace.as_millis().to_string())
                    .arg("--")
                    .arg(&c.cmd);
                cmd
            }
        };
        cmd.args(&c.args);
        cmd.env_clear();
        let home = users::host_path(cfg, spec.user.home);
        let cwd_inside = match c.cwd.as_deref().filter(|s| !s.is_empty()) {
            None => cfg.workdir(),
            Some(raw) => resolve_cwd(raw, spec.user.home)?,
        };
        let cwd = users::host_path(cfg, &cwd_inside);
        // As E2B's envd (which stats it, following links): a missing directory is the
        // caller's mistake, named as such.
        if std::fs::metadata(&cwd).is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound) {
            return Err(ConnectError::invalid_argument(format!(
                "cwd '{cwd_inside}' does not exist"
            )));
        }
        // The sandbox's env first; identity and location always describe this command.
        let mut env: std::collections::BTreeMap<String, String> = cfg.env().into_iter().collect();
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
        env.insert("HOME".into(), home.to_string_lossy().into_owned());
        env.insert("USER".into(), spec.user.name.into());
        env.insert("LOGNAME".into(), spec.user.name.into());
        env.insert("PWD".into(), cwd.to_string_lossy().into_owned());
        if spec.pty.is_some() {
            env.entry("TERM".into())
                .or_insert_with(|| "xterm-256color".into());
        }
        env.extend(c.envs.iter().map(|(k, v)| (k.clone(), v.clone())));
        for (k, v) in &env {
            if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
                return Err(ConnectError::invalid_argument(format!(
                    "invalid environment variable {k:?}"
                )));
            }
        }
        cmd.envs(env);
        cmd.current_dir(&cwd);
        if spec.user.switch {
            cmd.uid(spec.user.uid).gid(spec.user.gid);
        }
        let container = cfg.mode == IsolationMode::Container;

        let mut pty_master = None;
        if let Some((cols, rows)) = spec.pty {
            let ws = nix::pty::Winsize {
                ws_row: rows,
                ws_col: cols,
                ws_xpixel: 0,
                ws_ypixel: 0,
            };
            let pty = nix::pty::openpty(Some(&ws), None)
                .map_err(|e| ConnectError::internal(format!("openpty: {e}")))?;
            let slave = pty.slave;
            let dup = |fd: &OwnedFd| fd.try_clone().map(Stdio::from);
            let (i, o, e) = (dup(&slave), dup(&slave), dup(&slave));
            match (i, o, e) {
                (Ok(i), Ok(o), Ok(e)) => {
                    cmd.stdin(i).stdout(o).stderr(e);
                }
                _ => return Err(ConnectError::internal("dup of pty slave failed")),
            }
            pty_master = Some(pty.master);
            // SAFETY: only async-signal-safe calls between fork and exec.
            unsafe {
                cmd.pre_exec(move || {
                    if libc::setsid() < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    if libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    reset_child(container);
                    Ok(())
                });
            }
        } else if let Some([i, o, e]) = spec.stdio {
            cmd.stdin(Stdio::from(i))
                .stdout(Stdio::from(o))
                .stderr(Stdio::from(e));
            // SAFETY: only async-signal-safe calls between fork and exec.
            unsafe {
                cmd.pre_exec(move || {
                    if libc::setsid() < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    reset_child(container);
                    Ok(())
                });
            }
        } else {
            cmd.stdin(if spec.stdin {
                Stdio::piped()
            } else {
                Stdio::null()
            });
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
            // SAFETY: only async-signal-safe calls between fork and exec.
            unsafe {
                cmd.pre_exec(move || {
                    if libc::setsid() < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    reset_child(container);
                    Ok(())
                });
            }
        }

        let spawned_at = std::time::Instant::now();
        let mut child = cmd.spawn().map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => ConnectError::not_found(format!(
                "{}: command or working directory not found",
                c.cmd
            )),
            std::io::ErrorKind::PermissionDenied => {
                ConnectError::permission_denied(format!("{}: permission denied", c.cmd))
            }
            _ => ConnectError::internal(format!("spawn {}: {e}", c.cmd)),
        })?;
        let pid = child.id();
        self.usage.begin(pid, spawned_at);
        let stdin = child.stdin.take().map(OwnedFd::from);
        let stdout = child.stdout.take().map(OwnedFd::from);
        let stderr = child.stderr.take().map(OwnedFd::from);
        // The reaper, not std, collects the exit status.
        drop(child);
        let ios = (|| -> std::io::Result<_> {
            let wrap =
                |fd: Option<OwnedFd>| fd.map(FdIo::new).transpose().map(|io| io.map(Arc::new));
            Ok((
                wrap(stdin)?,
                wrap(pty_master)?,
                wrap(stdout)?,
                wrap(stderr)?,
            ))
        })();
        let (stdin, pty, stdout, stderr) = match ios {
            Ok(ios) => ios,
            Err(e) => {
                // Nobody could read or end this command: it must not run unseen.
                kill_tree(pid, NixSignal::SIGKILL);
                return Err(ConnectError::internal(format!("pipe setup: {e}")));
            }
        };

        let (exit_tx, _) = tokio::sync::watch::channel(None);
        let proc = Arc::new(Proc {
            pid,
            tag: spec.tag.clone(),
            config: spec.config.clone(),
            stdin: tokio::sync::Mutex::new(if pty.is_some() { pty.clone() } else { stdin }),
            pty: pty.clone(),
            out: Mutex::default(),
            exit: exit_tx,
        });
        self.register(&proc);
        let (missed, rx) = proc.subscribe();
        let readers = [
            pty.map(|io| (io, Output::Pty as fn(Vec<u8>) -> Output)),
            stdout.map(|io| (io, Output::Stdout as fn(Vec<u8>) -> Output)),
            stderr.map(|io| (io, Output::Stderr as fn(Vec<u8>) -> Output)),
        ]
        .into_iter()
        .flatten()
        .map(|(io, kind)| tokio::spawn(pump(proc.clone(), io, kind)))
        .collect();
        tokio::spawn(finish(self.clone(), proc.clone(), readers));
        let rx = rx.ok_or_else(|| ConnectError::internal("process ended before it started"))?;
        Ok((proc, missed, rx))
    }
}

/// A command's working directory as E2B's envd resolves it: `~` and `~/x` from the user's
/// home, a relative path from the home too, and the result normalised. A `..` above `/`
/// is refused rather than clamped (as every sandbox path is), and `~name` is refused:
/// there are no other homes to expand.
pub fn resolve_cwd(raw: &str, home: &str) -> Result<String, ConnectError> {
    let expanded;
    let path = match raw.strip_prefix('~') {
        None => raw,
        Some("") => home,
        Some(rest) if rest.starts_with('/') => {
            expanded = format!("{home}{rest}");
            &expanded
        }
        Some(_) => {
            return Err(ConnectError::invalid_argument(format!(
                "cwd {raw:?}: cannot expand user-specific home dir"
            )));
        }
    };
    sandpit_api::paths::normalize(path, home).map_err(|e| {
        ConnectError::invalid_argument(match e {
            sandpit_api::paths::PathError::Escape => format!("cwd {raw:?} climbs above /"),
            sandpit_api::paths::PathError::Invalid(why) => format!("cwd {raw:?}: {why}"),
        })
    })
}

/// The timeout a client gives a call in `Connect-Timeout-Ms` (Connect's protocol: at most
/// 10 digits); `None` without one or for 0, which E2B's SDKs never send (0 means none).
pub fn connect_timeout(ctx: &RequestContext) -> Option<Duration> {
    let v = ctx.header("connect-timeout-ms")?.to_str().ok()?.trim();
    if v.is_empty() || v.len() > 10 || !v.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let ms: u64 = v.parse().ok()?;
    (ms > 0).then(|| Duration::from_millis(ms))
}

/// Ends `proc` (its whole tree, SIGKILL) when `timeout` passes before it exits: E2B's envd
/// runs a started command under the start's `Connect-Timeout-Ms` and kills it there,
/// whether or not a client still reads its stream.
fn kill_at_timeout(table: Arc<ProcessTable>, proc: Arc<Proc>, timeout: Duration) {
    tokio::spawn(async move {
        let mut exit = proc.exit.subscribe();
        tokio::select! {
            _ = tokio::time::sleep(timeout) => {}
            _ = exit.wait_for(|v| v.is_some()) => return,
        }
        // Not a later command that was given the same pid.
        if proc.is_running() && table.holds(&proc) {
            tracing::debug!(pid = proc.pid, ?timeout, "command timed out; killing it");
            kill_tree(proc.pid, NixSignal::SIGKILL);
        }
    });
}

/// Undoes what the agent set for itself but commands must not inherit.
pub(crate) fn reset_child(container: bool) {
    // SAFETY: plain syscalls on the child's own state, async-signal-safe.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigprocmask(libc::SIG_SETMASK, &set, std::ptr::null_mut());
        if container {
            // The agent shields itself from the OOM killer; its commands must not be shielded.
            let fd = libc::open(c"/proc/self/oom_score_adj".as_ptr(), libc::O_WRONLY);
            if fd >= 0 {
                libc::write(fd, b"0".as_ptr().cast(), 1);
                libc::close(fd);
            }
        }
    }
}

async fn pump(proc: Arc<Proc>, io: Arc<FdIo>, kind: fn(Vec<u8>) -> Output) {
    let mut buf = vec![0u8; READ_CHUNK];
    loop {
        match io.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                let ev = ProcessEvent {
                    event: Some(Event::Data(Box::new(DataEvent {
                        output: Some(kind(buf[..n].to_vec())),
                        ..Default::default()
                    }))),
                    ..Default::default()
                };
                proc.publish(ev).await;
            }
        }
    }
}

/// How a child of the agent stands, asked without collecting it.
#[derive(Debug, PartialEq, Eq)]
enum ChildState {
    /// Running (or stopped).
    Running,
    /// Exited, and waiting to be collected.
    Zombie,
    /// No child of the agent has this pid: it was collected.
    Gone,
}

/// Peeks at child `pid` with `waitid(P_PID, WNOHANG|WNOWAIT)`, which leaves a zombie for
/// the reaper.
fn child_state(pid: u32) -> ChildState {
    use nix::sys::wait::{Id, WaitPidFlag, WaitStatus, waitid};
    let flags = WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT;
    loop {
        return match waitid(Id::Pid(Pid::from_raw(pid as i32)), flags) {
            Ok(WaitStatus::Exited(..) | WaitStatus::Signaled(..)) => ChildState::Zombie,
            Ok(_) => ChildState::Running,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(nix::errno::Errno::ECHILD) => ChildState::Gone,
            Err(e) => {
                tracing::warn!(pid, error = %e, "waitid on a command failed");
                ChildState::Running
            }
        };
    }
}

/// Waits for the exit the reaper reports to `proc`. SIGCHLD is the fast path; every
/// [`EXIT_RECHECK`] the child itself is looked at too, so that a missed signal or a lost
/// notice cannot keep a command's stream open forever: a zombie gets a reaper pass, and a
/// child that is gone without a reported status ends as lost (`None`).
async fn wait_exit(table: &Arc<ProcessTable>, proc: &Arc<Proc>) -> Option<ExitStatus> {
    let mut rx = proc.exit.subscribe();
    // Two looks in a row, a period apart, before calling a status lost: the reaper
    // reports right after it collects, so a second look cannot race with it.
    let mut gone_seen = false;
    loop {
        if let Some(v) = *rx.borrow_and_update() {
            return Some(v);
        }
        match tokio::time::timeout(EXIT_RECHECK, rx.changed()).await {
            Ok(Ok(())) => continue,
            // The sender lives in `proc`, which this task holds.
            Ok(Err(_)) => return *proc.exit.borrow(),
            Err(_elapsed) => {}
        }
        if proc.exit.borrow().is_some() {
            continue;
        }
        // A command given the same pid after ours was collected is not ours to look at.
        let state = if table.holds(proc) {
            child_state(proc.pid)
        } else {
            ChildState::Gone
        };
        match state {
            ChildState::Running => gone_seen = false,
            ChildState::Zombie => {
                tracing::warn!(pid = proc.pid, "command exited unnoticed; reaping it now");
                crate::rusage::reap_pass(table);
                gone_seen = false;
            }
            ChildState::Gone => {
                let unclaimed = table
                    .holds(proc)
                    .then(|| table.take_unclaimed(proc.pid))
                    .flatten();
                if let Some(status) = unclaimed {
                    proc.exited(status);
                } else if gone_seen {
                    tracing::error!(pid = proc.pid, "a command's exit status was lost");
                    return None;
                } else {
                    gone_seen = true;
                }
            }
        }
    }
}

/// Waits for `proc`'s exit status as the reaper reports it (`None`: it was lost).
pub(crate) async fn exit_status(table: &Arc<ProcessTable>, proc: &Arc<Proc>) -> Option<ExitStatus> {
    wait_exit(table, proc).await
}

/// Waits for the exit, lets the readers drain, then publishes the end event.
async fn finish(
    table: Arc<ProcessTable>,
    proc: Arc<Proc>,
    readers: Vec<tokio::task::JoinHandle<()>>,
) {
    let status = wait_exit(&table, &proc).await;
    let drain = futures::future::join_all(readers);
    if tokio::time::timeout(DRAIN_GRACE, drain).await.is_err() {
        tracing::debug!(
            pid = proc.pid,
            "descendants still hold the output pipes; ending anyway"
        );
    }
    *proc.stdin.lock().await = None;
    // Before the end event: whoever reads the command's usage after it sees a total.
    crate::rusage::settle(&table, proc.pid).await;
    let end = match status {
        Some((code, signal)) => EndEvent {
            exit_code: code,
            exited: signal.is_none(),
            status: match signal {
                Some(s) => format!(
                    "signal: {}",
                    NixSignal::try_from(s)
                        .map(|s| s.as_str().trim_start_matches("SIG").to_lowercase())
                        .unwrap_or_else(|_| s.to_string())
                ),
                None => format!("exit status {code}"),
            },
            error: None,
            ..Default::default()
        },
        None => EndEvent {
            exit_code: -1,
            exited: false,
            status: "unknown".into(),
            error: Some("the command ended but its exit status was lost".into()),
            ..Default::default()
        },
    };
    let ev = ProcessEvent {
        event: Some(Event::End(Box::new(end))),
        ..Default::default()
    };
    proc.publish(ev).await;
}

/// Request header (sandpit's own) asking Start to return after the start event and keep
/// all output for a later Connect.
pub const DETACH_HEADER: &str = "sandpit-detach";

/// The agent's executable as the kernel knows it: exec'd as the supervisor, it is the
/// very file the agent runs from, even when the path it was started by changed since.
const SELF_EXE: &str = "/proc/self/exe";

/// The supervision a start asks for with [`sandpit_abi::SUPERVISE_HEADER`] (its grace
/// period in milliseconds); `None` without the header.
pub fn supervise_grace(ctx: &RequestContext) -> Result<Option<Duration>, ConnectError> {
    let Some(v) = ctx.header(sandpit_abi::SUPERVISE_HEADER) else {
        return Ok(None);
    };
    let text = v.to_str().map_err(|_| {
        ConnectError::invalid_argument(format!("{} is not text", sandpit_abi::SUPERVISE_HEADER))
    })?;
    crate::supervise::parse_grace(text.trim())
        .map(Some)
        .map_err(|e| ConnectError::invalid_argument(e.to_string()))
}

/// The interval for keepalive events, from E2B's `Keepalive-Ping-Interval` header (seconds).
pub fn keepalive_interval(ctx: &RequestContext) -> Duration {
    let secs = ctx
        .header("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|s| *s > 0)
        .unwrap_or(30);
    Duration::from_secs(secs.min(3600))
}

/// Turns the attach result into a Connect stream with a start event, missed output,
/// live output and keepalives; it ends after the end event.
fn event_stream<T: Send + 'static>(
    pid: u32,
    missed: Vec<ProcessEvent>,
    rx: Option<mpsc::Receiver<ProcessEvent>>,
    keepalive: Duration,
    wrap: fn(ProcessEvent) -> T,
) -> ServiceStream<T> {
    let start = ProcessEvent {
        event: Some(Event::Start(Box::new(StartEvent {
            pid,
            ..Default::default()
        }))),
        ..Default::default()
    };
    let mut queue: VecDeque<ProcessEvent> = VecDeque::from(missed);
    queue.push_front(start);
    let state = (queue, rx, false);
    let s = futures::stream::unfold(state, move |(mut queue, mut rx, done)| async move {
        if done {
            return None;
        }
        let ev = match queue.pop_front() {
            Some(ev) => ev,
            None => {
                let r = rx.as_mut()?;
                tokio::select! {
                    ev = r.recv() => ev?,
                    _ = tokio::time::sleep(keepalive) => ProcessEvent {
                        event: Some(Event::Keepalive(Box::default())), ..Default::default()
                    },
                }
            }
        };
        let is_end = matches!(ev.event, Some(Event::End(_)));
        Some((Ok(wrap(ev)), (queue, rx, is_end)))
    });
    Box::pin(s)
}

/// The `process.Process` Connect service.
pub struct ProcessService {
    pub table: Arc<ProcessTable>,
}

impl ProcessService {
    fn user(&self, ctx: &RequestContext) -> Result<User, ConnectError> {
        let name = users::from_headers(ctx.headers());
        users::resolve(&self.table.cfg, name.as_deref()).ok_or_else(|| {
            ConnectError::invalid_argument(format!("unknown user {:?}", name.unwrap_or_default()))
        })
    }

    async fn write_input(
        &self,
        sel: &ProcessSelector,
        input: &ProcessInput,
    ) -> Result<(), ConnectError> {
        let proc = self.table.get(sel)?;
        let (data, to_pty) = match &input.input {
            Some(Input::Stdin(d)) => (d, false),
            Some(Input::Pty(d)) => (d, true),
            None => return Ok(()),
        };
        let sink = if to_pty {
            proc.pty
                .clone()
                .ok_or_else(|| ConnectError::failed_precondition("process has no pty"))?
        } else {
            proc.stdin
                .lock()
                .await
                .clone()
                .ok_or_else(|| ConnectError::failed_precondition("stdin is closed"))?
        };
        sink.write_all(data)
            .await
            .map_err(|e| ConnectError::failed_precondition(format!("write to process: {e}")))
    }
}

impl Process for ProcessService {
    async fn list(
        &self,
        _ctx: RequestContext,
        _request: ServiceRequest<'_, ListRequest>,
    ) -> ServiceResult<ListResponse> {
        let reg = self.table.reg.lock();
        let mut processes: Vec<ProcessInfo> = reg
            .procs
            .values()
            .filter(|p| p.is_running())
            .map(|p| p.info())
            .collect();
        processes.sort_by_key(|p| p.pid);
        Response::ok(ListResponse {
            processes,
            ..Default::default()
        })
    }

    async fn connect(
        &self,
        ctx: RequestContext,
        request: ServiceRequest<'_, ConnectRequest>,
    ) -> ServiceResult<ServiceStream<ConnectResponse>> {
        let req = request.to_owned_message();
        let proc = self.table.get(&req.process)?;
        let (missed, rx) = proc.subscribe();
        let wrap = |ev: ProcessEvent| ConnectResponse {
            event: ev.into(),
            ..Default::default()
        };
        Ok(Response::new(event_stream(
            proc.pid,
            missed,
            rx,
            keepalive_interval(&ctx),
            wrap,
        )))
    }

    async fn start(
        &self,
        ctx: RequestContext,
        request: ServiceRequest<'_, StartRequest>,
    ) -> ServiceResult<ServiceStream<StartResponse>> {
        let req = request.to_owned_message();
        let user = self.user(&ctx)?;
        let supervise = supervise_grace(&ctx)?;
        let pty = req.pty.as_option().map(|p| {
            let cols = p.size.cols.clamp(1, u16::MAX as u32) as u16;
            let rows = p.size.rows.clamp(1, u16::MAX as u32) as u16;
            (cols, rows)
        });
        let spec = SpawnSpec {
            config: (*req.process).clone(),
            user,
            tag: req.tag.clone(),
            pty,
            stdin: req.stdin.unwrap_or(true),
            stdio: None,
            supervise,
        };
        let (proc, missed, rx) = self.table.spawn(spec)?;
        if let Some(t) = connect_timeout(&ctx) {
            kill_at_timeout(self.table.clone(), proc.clone(), t);
        }
        let wrap = |ev: ProcessEvent| StartResponse {
            event: ev.into(),
            ..Default::default()
        };
        if ctx.header(DETACH_HEADER).is_some() {
            // Detached start: nothing is handed to this stream after the start event, so all
            // output waits in the backlog for a later Connect instead of dying in transit.
            drop(rx);
            return Ok(Response::new(event_stream(
                proc.pid,
                missed,
                None,
                keepalive_interval(&ctx),
                wrap,
            )));
        }
        Ok(Response::new(event_stream(
            proc.pid,
            missed,
            Some(rx),
            keepalive_interval(&ctx),
            wrap,
        )))
    }

    async fn update(
        &self,
        _ctx: RequestContext,
        request: ServiceRequest<'_, UpdateRequest>,
    ) -> ServiceResult<UpdateResponse> {
        let req = request.to_owned_message();
        let proc = self.table.get(&req.process)?;
        if let Some(p) = req.pty.as_option() {
            let fd = proc
                .pty
                .as_ref()
                .ok_or_else(|| ConnectError::failed_precondition("process has no pty"))?;
            let ws = libc::winsize {
                ws_row: p.size.rows.clamp(1, u16::MAX as u32) as u16,
                ws_col: p.size.cols.clamp(1, u16::MAX as u32) as u16,
                ws_xpixel: 0,
                ws_ypixel: 0,
            };
            // SAFETY: TIOCSWINSZ reads a winsize struct that lives for the call.
            if unsafe { libc::ioctl(fd.raw(), libc::TIOCSWINSZ, &ws) } < 0 {
                return Err(ConnectError::internal(format!(
                    "resize: {}",
                    std::io::Error::last_os_error()
                )));
            }
        }
        Response::ok(UpdateResponse::default())
    }

    async fn stream_input(
        &self,
        _ctx: RequestContext,
        mut requests: connectrpc::InboundStream<StreamInputRequest>,
    ) -> ServiceResult<StreamInputResponse> {
        use futures::StreamExt;
        let mut selector: Option<ProcessSelector> = None;
        while let Some(item) = requests.next().await {
            let msg = item?.to_owned_message();
            match msg.event {
                Some(InputEvent::Start(s)) => selector = Some((*s.process).clone()),
                Some(InputEvent::Data(d)) => {
                    let sel = selector
                        .as_ref()
                        .ok_or_else(|| ConnectError::invalid_argument("data before start"))?;
                    self.write_input(sel, &d.input).await?;
                }
                Some(InputEvent::Keepalive(_)) | None => {}
            }
        }
        Response::ok(StreamInputResponse::default())
    }

    async fn send_input(
        &self,
        _ctx: RequestContext,
        request: ServiceRequest<'_, SendInputRequest>,
    ) -> ServiceResult<SendInputResponse> {
        let req = request.to_owned_message();
        self.write_input(&req.process, &req.input).await?;
        Response::ok(SendInputResponse::default())
    }

    async fn send_signal(
        &self,
        _ctx: RequestContext,
        request: ServiceRequest<'_, SendSignalRequest>,
    ) -> ServiceResult<SendSignalResponse> {
        let req = request.to_owned_message();
        let proc = self.table.get(&req.process)?;
        // An ended command is no longer there to signal: E2B's envd answers NOT_FOUND, and
        // its SDKs' `kill` turns that into `false`.
        if !proc.is_running() {
            return Err(ConnectError::not_found("process not found (it has ended)"));
        }
        match req.signal.as_known() {
            Some(Signal::SIGNAL_SIGKILL) => kill_tree(proc.pid, NixSignal::SIGKILL),
            Some(Signal::SIGNAL_SIGTERM) => {
                let _ = killpg(Pid::from_raw(proc.pid as i32), NixSignal::SIGTERM);
                let _ = kill(Pid::from_raw(proc.pid as i32), NixSignal::SIGTERM);
            }
            _ => return Err(ConnectError::invalid_argument("unsupported signal")),
        }
        Response::ok(SendSignalResponse::default())
    }

    async fn close_stdin(
        &self,
        _ctx: RequestContext,
        request: ServiceRequest<'_, CloseStdinRequest>,
    ) -> ServiceResult<CloseStdinResponse> {
        let req = request.to_owned_message();
        let proc = self.table.get(&req.process)?;
        if proc.pty.is_some() {
            // A pty has no separate stdin; EOF is ^D on the terminal.
            if let Some(p) = &proc.pty {
                let _ = p.write_all(&[4]).await;
            }
        } else {
            *proc.stdin.lock().await = None;
        }
        Response::ok(CloseStdinResponse::default())
    }
}

/// Collects exit statuses of every child (and, as PID 1, of every orphan), with the
/// rusage of each charged to the command it belongs to.
pub async fn reap(table: Arc<ProcessTable>, mut sigchld: tokio::signal::unix::Signal) {
    loop {
        if crate::rusage::reap_pass(&table) {
            if sigchld.recv().await.is_none() {
                return;
            }
        } else {
            // The pass stopped with a child possibly left: look again soon rather than
            // wait for a SIGCHLD that may already have been consumed.
            tokio::select! {
                r = sigchld.recv() => if r.is_none() { return },
                _ = tokio::time::sleep(REAP_RETRY) => {}
            }
        }
    }
}

/// Raw fd helper for tests and the server: wraps an inherited descriptor number.
///
/// # Safety
/// `fd` must be an open descriptor that nothing else owns.
pub unsafe fn owned_fd(fd: i32) -> OwnedFd {
    // SAFETY: guaranteed by the caller.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_relative_cwd_is_taken_from_the_home_and_cannot_climb_out() {
        let ok = |raw: &str, home: &str| resolve_cwd(raw, home).unwrap();
        assert_eq!(ok("work/sub", "/home/user"), "/home/user/work/sub");
        assert_eq!(ok("~", "/home/user"), "/home/user");
        assert_eq!(ok("~/w/../x", "/home/user"), "/home/user/x");
        assert_eq!(ok("rw", "/root"), "/root/rw");
        assert_eq!(ok("/tmp/./a", "/home/user"), "/tmp/a");
        assert_eq!(ok("..", "/home/user"), "/home");
        for bad in ["../../..", "~/../../..", "~root", "~user/x", "a\0b", "/.."] {
            let e = resolve_cwd(bad, "/home/user").unwrap_err();
            assert_eq!(e.code, connectrpc::ErrorCode::InvalidArgument, "{bad:?}");
        }
    }
}
