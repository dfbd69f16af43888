//! The run supervisor: `sandpit-supervisor GRACE_MS -- COMMAND [ARGS...]`, the process an
//! agent run's harness is started under (the agent starts it when a start carries
//! [`sandpit_abi::SUPERVISE_HEADER`]).
//!
//! It is a child subreaper, so every process the command leaves behind (a tool that
//! double-forks, `setsid`s away or starts a daemon) is re-parented to it instead of to
//! the agent and stays in its tree, where a signal to the tree finds it. It reaps all of
//! them (node reaps only its own children). When the command exits, it exits with the
//! command's status at once: whatever the command left running goes on (re-parented to
//! the agent), as with any command. On SIGTERM (or SIGINT, SIGHUP) it sends SIGTERM to
//! everything below it, waits until all of it is gone or the grace period is over,
//! SIGKILLs what is left, reaps it and exits.
//!
//! It holds no privilege: it runs as the command's user, with the command's environment,
//! and anyone in the sandbox could run it on their own commands to the same effect.

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::wait::{Id, WaitPidFlag, WaitStatus, waitid, waitpid};
use sandpit_abi::proc::{live_descendants, signal_each};
use std::ffi::OsString;
use std::os::fd::AsFd;
use std::os::unix::process::CommandExt;
use std::time::{Duration, Instant};

/// How often the tree is looked at while it is being terminated: a grandchild's end
/// signals its own parent, not the supervisor.
const TERM_POLL: Duration = Duration::from_millis(50);
/// How long the SIGKILLed tree gets to be collected before the supervisor exits anyway
/// (a process stuck in the kernel cannot be waited for forever).
const KILL_REAP: Duration = Duration::from_secs(2);
/// Rounds of SIGKILL: a process may fork between one listing of the tree and the kill.
const KILL_ROUNDS: usize = 20;

/// Why the supervisor could not run its command.
#[derive(Debug, thiserror::Error)]
pub enum SuperviseError {
    /// The arguments are not `GRACE_MS -- COMMAND [ARGS...]`.
    #[error(
        "usage: {} GRACE_MS -- COMMAND [ARGS...]",
        sandpit_abi::SUPERVISOR_ARGV0
    )]
    Usage,
    /// The grace period is not a number of milliseconds within the limit.
    #[error("grace period {0:?} is not a number of milliseconds up to {max}", max = sandpit_abi::MAX_SUPERVISE_GRACE.as_millis())]
    Grace(String),
    /// A system call of the set-up failed.
    #[error("{what}: {source}")]
    Sys {
        what: &'static str,
        #[source]
        source: Errno,
    },
    /// The command could not be started.
    #[error("cannot run {cmd}: {source}")]
    Spawn {
        cmd: String,
        #[source]
        source: std::io::Error,
    },
}

impl SuperviseError {
    /// The exit status the supervisor ends with: a shell's 126/127 for a command that
    /// cannot run or is not there, 2 for a misuse.
    pub fn exit_code(&self) -> i32 {
        match self {
            SuperviseError::Spawn { source, .. }
                if source.kind() == std::io::ErrorKind::NotFound =>
            {
                127
            }
            SuperviseError::Spawn { .. } => 126,
            SuperviseError::Usage | SuperviseError::Grace(_) => 2,
            SuperviseError::Sys { .. } => 125,
        }
    }
}

/// What the supervisor was asked to run.
#[derive(Debug, PartialEq, Eq)]
pub struct Invocation {
    /// Between the SIGTERM and the SIGKILL of a termination.
    pub grace: Duration,
    /// The command and its arguments.
    pub argv: Vec<OsString>,
}

/// Parses the arguments after argv[0].
pub fn parse_args(args: impl IntoIterator<Item = OsString>) -> Result<Invocation, SuperviseError> {
    let mut args = args.into_iter();
    let grace = args.next().ok_or(SuperviseError::Usage)?;
    let grace = parse_grace(&grace.to_string_lossy())?;
    if args.next().is_none_or(|sep| sep != "--") {
        return Err(SuperviseError::Usage);
    }
    let argv: Vec<OsString> = args.collect();
    if argv.is_empty() {
        return Err(SuperviseError::Usage);
    }
    Ok(Invocation { grace, argv })
}

/// Parses a grace period in milliseconds, refusing more than
/// [`sandpit_abi::MAX_SUPERVISE_GRACE`].
pub fn parse_grace(text: &str) -> Result<Duration, SuperviseError> {
    text.parse::<u64>()
        .ok()
        .map(Duration::from_millis)
        .filter(|g| *g <= sandpit_abi::MAX_SUPERVISE_GRACE)
        .ok_or_else(|| SuperviseError::Grace(text.to_string()))
}

/// Entry point of `sandpit-supervisor`: runs, and gives the process's exit status.
pub fn main(args: impl IntoIterator<Item = OsString>) -> i32 {
    match parse_args(args).and_then(|inv| run(&inv)) {
        Ok(code) => code,
        Err(e) => {
            // Its stderr is the command's: the daemon shows the tail as the failure.
            eprintln!("{}: {e}", sandpit_abi::SUPERVISOR_ARGV0);
            e.exit_code()
        }
    }
}

/// The shell's encoding of a wait status as one exit code.
fn exit_code(status: WaitStatus) -> Option<i32> {
    match status {
        WaitStatus::Exited(_, code) => Some(code),
        WaitStatus::Signaled(_, sig, _) => Some(128 + sig as i32),
        _ => None,
    }
}

/// Where a supervision stands.
#[derive(Debug, Default)]
struct State {
    /// The command's exit code, once it was collected.
    exit: Option<i32>,
    /// Set by the first termination signal: when the SIGKILL is due.
    kill_at: Option<Instant>,
}

/// What to do next, decided from the state and whether anything lives below.
#[derive(Debug, PartialEq, Eq)]
enum Step {
    /// Exit with this code.
    Exit(i32),
    /// SIGKILL everything below, then exit with this code.
    KillAndExit(i32),
    /// Wait for a signal, at most this long (`None`: no limit).
    Wait(Option<Duration>),
}

impl State {
    fn next(&self, now: Instant, anything_left: impl FnOnce() -> bool) -> Step {
        // Terminated before the command ended: the status a SIGTERM gives.
        let code = self.exit.unwrap_or(128 + Signal::SIGTERM as i32);
        match self.kill_at {
            None if self.exit.is_some() => Step::Exit(code),
            None => Step::Wait(None),
            Some(_) if !anything_left() => Step::Exit(code),
            Some(at) if now >= at => Step::KillAndExit(code),
            Some(at) => Step::Wait(Some((at - now).min(TERM_POLL))),
        }
    }
}

/// Supervises the command to its end; its exit code.
fn run(inv: &Invocation) -> Result<i32, SuperviseError> {
    let sys = |what| move |source| SuperviseError::Sys { what, source };
    nix::sys::prctl::set_child_subreaper(true).map_err(sys("become a child subreaper"))?;
    let mut mask = SigSet::empty();
    for s in [
        Signal::SIGCHLD,
        Signal::SIGTERM,
        Signal::SIGINT,
        Signal::SIGHUP,
    ] {
        mask.add(s);
    }
    // Blocked before the fork, so that no exit and no termination is missed.
    mask.thread_block().map_err(sys("block signals"))?;
    let sfd = SignalFd::with_flags(&mask, SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC)
        .map_err(sys("signalfd"))?;
    let (cmd, args) = inv.argv.split_first().ok_or(SuperviseError::Usage)?;
    let mut command = std::process::Command::new(cmd);
    command.args(args);
    // SAFETY: only sigprocmask (async-signal-safe) between fork and exec. The mask is
    // inherited across exec, and a command with SIGTERM blocked could not be terminated.
    unsafe {
        command.pre_exec(|| {
            crate::process::reset_child(false);
            Ok(())
        });
    }
    let child = command.spawn().map_err(|source| SuperviseError::Spawn {
        cmd: cmd.to_string_lossy().into_owned(),
        source,
    })?;
    let harness = child.id();
    // This loop, not std, collects it.
    drop(child);
    let me = std::process::id();
    let mut state = State::default();
    loop {
        reap(harness, &mut state.exit);
        match state.next(Instant::now(), || !live_descendants(me).is_empty()) {
            Step::Exit(code) => return Ok(code),
            Step::KillAndExit(code) => {
                kill_all(me, harness, &mut state.exit);
                return Ok(state.exit.unwrap_or(code));
            }
            Step::Wait(limit) => {
                if wait_signal(&sfd, limit) && state.kill_at.is_none() {
                    state.kill_at = Some(Instant::now() + inv.grace);
                    // The whole tree, whatever group or session each process is in.
                    let below = live_descendants(me);
                    signal_each(&below, Signal::SIGTERM);
                }
            }
        }
    }
}

/// Waits for a signal (at most `limit`) and drains the signalfd; true when one of them
/// asks for termination.
fn wait_signal(sfd: &SignalFd, limit: Option<Duration>) -> bool {
    let timeout = match limit {
        None => PollTimeout::NONE,
        Some(d) => PollTimeout::try_from(d).unwrap_or(PollTimeout::MAX),
    };
    let mut fds = [PollFd::new(sfd.as_fd(), PollFlags::POLLIN)];
    match poll(&mut fds, timeout) {
        Ok(_) | Err(Errno::EINTR) => {}
        Err(e) => {
            // Nothing to wait on: look again after a pause rather than spin.
            eprintln!("{}: poll: {e}", sandpit_abi::SUPERVISOR_ARGV0);
            std::thread::sleep(TERM_POLL);
        }
    }
    let mut terminate = false;
    while let Ok(Some(info)) = sfd.read_signal() {
        terminate |= info.ssi_signo != Signal::SIGCHLD as u32;
    }
    terminate
}

/// Collects every child that ended (orphans re-parented here included), noting the
/// command's status.
fn reap(harness: u32, exit: &mut Option<i32>) {
    loop {
        match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) | Err(Errno::ECHILD) => return,
            Ok(status) => {
                if status.pid().is_some_and(|p| p.as_raw() as u32 == harness) {
                    *exit = exit.or(exit_code(status));
                }
            }
            Err(Errno::EINTR) => continue,
            Err(e) => {
                eprintln!("{}: waitpid: {e}", sandpit_abi::SUPERVISOR_ARGV0);
                return;
            }
        }
    }
}

/// SIGKILLs everything below the supervisor until nothing is left, and collects it.
fn kill_all(me: u32, harness: u32, exit: &mut Option<i32>) {
    for _ in 0..KILL_ROUNDS {
        let below = live_descendants(me);
        if below.is_empty() {
            break;
        }
        signal_each(&below, Signal::SIGKILL);
        reap(harness, exit);
        std::thread::sleep(Duration::from_millis(10));
    }
    let until = Instant::now() + KILL_REAP;
    loop {
        reap(harness, exit);
        // Everything that had ended was just collected: a child still there is alive.
        let children_left = waitid(
            Id::All,
            WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT,
        )
        .is_ok();
        if !children_left || Instant::now() >= until {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<OsString> {
        a.iter().map(OsString::from).collect()
    }

    #[test]
    fn the_arguments_are_a_grace_then_the_command() {
        assert_eq!(
            parse_args(args(&["1500", "--", "sh", "-c", "x"])).unwrap(),
            Invocation {
                grace: Duration::from_millis(1500),
                argv: args(&["sh", "-c", "x"]),
            }
        );
        // The command's own `--` is its own.
        assert_eq!(
            parse_args(args(&["0", "--", "a", "--"])).unwrap().argv,
            args(&["a", "--"])
        );
        for bad in [
            &[][..],
            &["100"],
            &["100", "--"],
            &["100", "sh"],
            &["100", "-", "sh"],
        ] {
            let e = parse_args(args(bad)).unwrap_err();
            assert!(matches!(e, SuperviseError::Usage), "{bad:?}: {e}");
            assert_eq!(e.exit_code(), 2);
        }
        let max = sandpit_abi::MAX_SUPERVISE_GRACE.as_millis().to_string();
        assert!(parse_args(args(&[&max, "--", "x"])).is_ok());
        for bad in ["-1", "1.5", "", "5s", "300001", "99999999999999999999"] {
            let e = parse_args(args(&[bad, "--", "x"])).unwrap_err();
            assert!(matches!(e, SuperviseError::Grace(_)), "{bad:?}: {e}");
        }
    }

    #[test]
    fn a_command_that_cannot_run_gives_the_shells_codes() {
        let missing = SuperviseError::Spawn {
            cmd: "x".into(),
            source: std::io::ErrorKind::NotFound.into(),
        };
        assert_eq!(missing.exit_code(), 127);
        let denied = SuperviseError::Spawn {
            cmd: "x".into(),
            source: std::io::ErrorKind::PermissionDenied.into(),
        };
        assert_eq!(denied.exit_code(), 126);
    }

    #[test]
    fn the_command_ending_ends_supervision_unless_a_termination_is_under_way() {
        let now = Instant::now();
        let never = || panic!("the tree is not looked at before a termination");
        // Running, nothing asked: wait without a limit.
        let s = State::default();
        assert_eq!(s.next(now, never), Step::Wait(None));
        // The command ended on its own: its status, whatever it left running.
        let s = State {
            exit: Some(3),
            kill_at: None,
        };
        assert_eq!(s.next(now, never), Step::Exit(3));
        // Terminating: wait (polling the tree) while something lives and the grace lasts.
        let s = State {
            exit: Some(0),
            kill_at: Some(now + Duration::from_secs(5)),
        };
        assert_eq!(s.next(now, || true), Step::Wait(Some(TERM_POLL)));
        // ... leave as soon as the tree is empty ...
        assert_eq!(s.next(now, || false), Step::Exit(0));
        // ... and kill what is left once it is over; a command that never ended gives
        // the status of a SIGTERM.
        let s = State {
            exit: None,
            kill_at: Some(now),
        };
        assert_eq!(s.next(now, || true), Step::KillAndExit(143));
        let s = State {
            exit: None,
            kill_at: Some(now + Duration::from_millis(10)),
        };
        assert_eq!(
            s.next(now, || true),
            Step::Wait(Some(Duration::from_millis(10)))
        );
    }

    #[test]
    fn wait_statuses_read_as_a_shell_reads_them() {
        let pid = nix::unistd::Pid::from_raw(7);
        assert_eq!(exit_code(WaitStatus::Exited(pid, 4)), Some(4));
        assert_eq!(
            exit_code(WaitStatus::Signaled(pid, Signal::SIGKILL, false)),
            Some(137)
        );
        assert_eq!(exit_code(WaitStatus::StillAlive), None);
    }
}
