//! A command's end must reach its stream however its exit is noticed: reported before the
//! task waiting for it first ran (what a busy single-threaded agent does under load), or
//! collected without a report at all.
//!
//! The reaper's `waitid(P_ALL)` collects every child of this process, so the tests take
//! turns (each integration test file is a process of its own).

use nix::sys::wait::{Id, WaitPidFlag, WaitStatus, waitid};
use nix::unistd::Pid;
use sandpit_agent::process::{ProcessTable, SpawnSpec};
use sandpit_agent::{AgentConfig, IsolationMode};
use sandpit_proto::process::__buffa::oneof::process_event::Event;
use sandpit_proto::process::process_event::EndEvent;
use sandpit_proto::process::{ProcessConfig, ProcessEvent};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn config(root: &std::path::Path) -> Arc<AgentConfig> {
    Arc::new(AgentConfig {
        mode: IsolationMode::Process,
        root: root.to_path_buf(),
        workdir: "/".into(),
        env: Default::default(),
        listen_fd: None,
        listen_path: None,
        sudo: false,
        live: Default::default(),
    })
}

fn spec(cfg: &AgentConfig, cmd: &str, args: &[&str]) -> SpawnSpec {
    let config = ProcessConfig {
        cmd: cmd.into(),
        args: args.iter().map(|a| a.to_string()).collect(),
        ..Default::default()
    };
    SpawnSpec::new(cfg, Some("root"), config).expect("root is a known user")
}

/// Blocks until child `pid` has exited, leaving it for whoever collects it.
fn wait_exited(pid: u32) {
    let flags = WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT;
    match waitid(Id::Pid(Pid::from_raw(pid as i32)), flags) {
        Ok(WaitStatus::Exited(..) | WaitStatus::Signaled(..)) => {}
        other => panic!("waitid({pid}): {other:?}"),
    }
}

/// The end event of a stream, or None if none comes within the bound.
async fn end_of(mut rx: mpsc::Receiver<ProcessEvent>) -> Option<EndEvent> {
    let wait = async {
        while let Some(ev) = rx.recv().await {
            if let Some(Event::End(end)) = ev.event {
                return Some(*end);
            }
        }
        None
    };
    tokio::time::timeout(Duration::from_secs(10), wait)
        .await
        .ok()
        .flatten()
}

#[tokio::test(flavor = "current_thread")]
async fn exits_reaped_before_their_waiters_first_run_still_end_the_streams() {
    let _turn = TURN.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path());
    let table = ProcessTable::new(cfg.clone());
    // A busy agent thread: many commands are started before any task spawned for them
    // runs, they exit meanwhile, and a reaper pass (the reaper's, or another command's
    // settle) reports their exits before the tasks waiting for them first run.
    let mut started = Vec::new();
    for i in 0..50 {
        let code = (i % 7).to_string();
        let (proc, _, rx) = table
            .spawn(spec(&cfg, "sh", &["-c", &format!("exit {code}")]))
            .unwrap();
        started.push((proc.pid(), i % 7, rx));
    }
    for (pid, _, _) in &started {
        wait_exited(*pid);
    }
    assert!(sandpit_agent::rusage::reap_pass(&table));
    for (pid, code, rx) in started {
        let end = end_of(rx)
            .await
            .unwrap_or_else(|| panic!("command {pid} exited but its stream never ended"));
        assert_eq!(end.exit_code, code, "exit code of {pid}");
        assert!(end.exited);
        assert_eq!(end.error, None);
    }
}

#[tokio::test(flavor = "current_thread")]
async fn a_command_collected_without_a_report_still_ends_with_an_error() {
    let _turn = TURN.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path());
    let table = ProcessTable::new(cfg.clone());
    let (proc, _, rx) = table.spawn(spec(&cfg, "true", &[])).unwrap();
    let pid = proc.pid();
    // Collected behind the table's back: no exit is ever reported to it.
    let mut status = 0;
    // SAFETY: wait4 writes only into the local status; a null rusage is allowed.
    let got = unsafe { libc::wait4(pid as i32, &mut status, 0, std::ptr::null_mut()) };
    assert_eq!(got, pid as i32);
    let end = end_of(rx)
        .await
        .expect("a lost exit must not keep the stream open forever");
    assert!(!end.exited);
    assert!(end.error.is_some(), "the end says the status was lost");
}

#[tokio::test(flavor = "current_thread")]
async fn a_running_command_is_not_ended_by_the_recheck() {
    let _turn = TURN.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path());
    let table = ProcessTable::new(cfg.clone());
    let (proc, _, mut rx) = table.spawn(spec(&cfg, "sleep", &["3"])).unwrap();
    // Longer than two rechecks: a live child is never taken for a lost one.
    let early = tokio::time::timeout(Duration::from_millis(2500), async {
        while let Some(ev) = rx.recv().await {
            if matches!(ev.event, Some(Event::End(_))) {
                return true;
            }
        }
        false
    })
    .await;
    assert!(early.is_err(), "the stream ended while the command ran");
    // No reaper task here: the recheck finds the zombie and collects it.
    let end = end_of(rx)
        .await
        .expect("the exit is noticed by the recheck");
    assert_eq!(end.exit_code, 0);
    assert!(end.exited);
    assert_eq!(end.error, None);
    assert_eq!(end.status, "exit status 0", "command {}", proc.pid());
}
