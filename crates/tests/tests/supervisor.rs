//! The run supervisor (`sandpit-supervisor`, the `sandpit` binary under that name) on its
//! own, without a daemon or root: what it does when its command ends, and when it is told
//! to terminate a tree with processes that escaped by `setsid`, trap SIGTERM or ignore it.

use sandpit_tests::daemon::sandpit_bin;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// Starts `script` (sh) under the supervisor with `grace_ms`, in `dir`.
fn supervised(dir: &Path, grace_ms: u64, script: &str) -> Child {
    Command::new(sandpit_bin())
        .arg0("sandpit-supervisor")
        .args([&grace_ms.to_string(), "--", "sh", "-c", script])
        .current_dir(dir)
        .spawn()
        .unwrap()
}

/// Waits until `file` in `dir` holds a pid; the pid.
fn pid_in(dir: &Path, file: &str) -> u32 {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(t) = std::fs::read_to_string(dir.join(file))
            && let Ok(p) = t.trim().parse()
        {
            return p;
        }
        assert!(Instant::now() < deadline, "{file} never written");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether `pid` runs (a zombie does not).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next().map(|st| st != "Z"))
        })
        .unwrap_or(false)
}

/// The parent pid of `pid`.
fn ppid(pid: u32) -> Option<u32> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    s.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

fn wait_with_deadline(child: &mut Child, within: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + within;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        assert!(Instant::now() < deadline, "the supervisor did not exit");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn term(child: &Child) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
}

fn kill(pid: u32) {
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    );
}

#[test]
fn a_command_that_ends_gives_its_status_and_leaves_what_it_started() {
    let dir = tempfile::tempdir().unwrap();
    // A "dev server" started in a session of its own, then the command exits 3.
    let mut sup = supervised(
        dir.path(),
        60_000,
        "setsid sleep 60 </dev/null >/dev/null 2>&1 & echo $! > server; exit 3",
    );
    let status = wait_with_deadline(&mut sup, Duration::from_secs(20));
    assert_eq!(status.code(), Some(3));
    let server = pid_in(dir.path(), "server");
    // Not killed by the supervisor's end: a run that ends normally keeps its servers.
    assert!(alive(server), "the server was killed");
    kill(server);
}

#[test]
fn a_command_that_cannot_run_is_a_shells_127_with_the_reason_on_stderr() {
    let out = Command::new(sandpit_bin())
        .arg0("sandpit-supervisor")
        .args(["100", "--", "/nonexistent/harness"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(127));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot run /nonexistent/harness"), "{err}");
    let out = Command::new(sandpit_bin())
        .arg0("sandpit-supervisor")
        .args(["soon", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn sigterm_reaches_escaped_processes_first_and_sigkill_ends_the_rest_after_the_grace() {
    let dir = tempfile::tempdir().unwrap();
    // Three escapes from the command's process group and session: a double-forked
    // (orphaned) sleep, one that traps SIGTERM (writes a marker, exits) and one that
    // ignores it. The command itself waits.
    let script = r#"
        setsid sh -c 'sleep 1000 & echo $! > escaped' </dev/null >/dev/null 2>&1 &
        setsid sh -c 'trap "echo term > trapped.marker; exit 0" TERM; echo $$ > trapper; while :; do sleep 1; done' </dev/null >/dev/null 2>&1 &
        setsid sh -c 'trap "" TERM; echo $$ > ignorer; exec sleep 1000' </dev/null >/dev/null 2>&1 &
        sleep 1000
    "#;
    let grace = Duration::from_millis(1500);
    let mut sup = supervised(dir.path(), grace.as_millis() as u64, script);
    let pids: Vec<u32> = ["escaped", "trapper", "ignorer"]
        .iter()
        .map(|f| pid_in(dir.path(), f))
        .collect();
    // The double-forked one is re-parented to the supervisor once its parent is gone
    // (the other two are the command's children, in sessions of their own).
    let deadline = Instant::now() + Duration::from_secs(20);
    while ppid(pids[0]) != Some(sup.id()) {
        assert!(Instant::now() < deadline, "never re-parented");
        std::thread::sleep(Duration::from_millis(20));
    }
    let start = Instant::now();
    term(&sup);
    let status = wait_with_deadline(&mut sup, Duration::from_secs(20));
    let took = start.elapsed();
    // The command ended by the SIGTERM; the ignorer held the supervisor to the grace.
    assert_eq!(status.code(), Some(143), "{status:?}");
    assert!(took >= grace, "exited after {took:?}, before the grace");
    assert!(
        took < grace + Duration::from_secs(5),
        "exited after {took:?}"
    );
    assert_eq!(
        std::fs::read_to_string(dir.path().join("trapped.marker"))
            .unwrap()
            .trim(),
        "term"
    );
    for p in &pids {
        assert!(!alive(*p), "pid {p} survived");
    }
}

#[test]
fn a_tree_that_honours_sigterm_ends_without_waiting_for_the_grace() {
    let dir = tempfile::tempdir().unwrap();
    let mut sup = supervised(
        dir.path(),
        60_000,
        "setsid sh -c 'sleep 1000 & echo $! > escaped' </dev/null >/dev/null 2>&1 & sleep 1000",
    );
    let escaped = pid_in(dir.path(), "escaped");
    let deadline = Instant::now() + Duration::from_secs(20);
    while ppid(escaped) != Some(sup.id()) {
        assert!(Instant::now() < deadline, "never re-parented");
        std::thread::sleep(Duration::from_millis(20));
    }
    let start = Instant::now();
    term(&sup);
    let status = wait_with_deadline(&mut sup, Duration::from_secs(20));
    assert_eq!(status.code(), Some(143));
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
    assert!(!alive(escaped));
}
