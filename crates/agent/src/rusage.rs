//! CPU time and memory peak of each command, from the `wait4` rusage of every process the
//! agent reaps.
//!
//! A command's own rusage already includes the descendants it waited for. Descendants it
//! left behind are re-parented to the agent (PID 1, or a subreaper outside a pid
//! namespace); since every command starts its own session, the agent charges such an
//! orphan to the command whose session it belongs to. The totals are served on the
//! agent's own `GET /rusage?pid=N` route (not part of E2B's protocol, whose messages stay
//! untouched), read by the daemon after the command's end event.

use crate::process::ProcessTable;
use nix::errno::Errno;
use nix::sys::wait::{Id, WaitPidFlag, WaitStatus, waitid};
use parking_lot::Mutex;
use sandpit_abi::proc::Stat;
use serde::Serialize;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Commands whose usage is remembered; the oldest are forgotten beyond this.
const MAX_ENTRIES: usize = 4096;
/// Kernel task flag of a process inside `do_exit` (its descriptors may be closed already).
const PF_EXITING: u64 = 0x4;
/// How long a command's end waits for orphans of its session that are exiting right now.
const SETTLE_ROUNDS: u32 = 10;
const SETTLE_STEP: Duration = Duration::from_millis(5);
/// Children a reaper pass may fail to collect after peeking at them before it gives up.
const MAX_MISSES: u32 = 16;

/// Usage totals of one command (its session), as served to the daemon.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct CommandUsage {
    /// The command's pid (its session id).
    pub pid: u32,
    /// User plus system time, microseconds.
    pub cpu_time_us: u64,
    /// User time, microseconds.
    pub user_time_us: u64,
    /// System time, microseconds.
    pub system_time_us: u64,
    /// Largest resident set of any process counted, KiB.
    pub max_rss_kb: u64,
    /// Processes reaped and counted.
    pub processes: u32,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    usage: CommandUsage,
    created: Instant,
    updated: Instant,
}

/// Usage of recent commands, keyed by command pid.
#[derive(Debug, Default)]
pub struct UsageTable {
    entries: Mutex<HashMap<u32, Entry>>,
}

fn tv_us(tv: &libc::timeval) -> u64 {
    let secs = u64::try_from(tv.tv_sec).unwrap_or(0);
    let micros = u64::try_from(tv.tv_usec).unwrap_or(0);
    secs.saturating_mul(1_000_000).saturating_add(micros)
}

impl UsageTable {
    /// A command with this pid was spawned at `spawned_at`: usage recorded under the pid
    /// before then belongs to an earlier process that had the same pid.
    pub fn begin(&self, pid: u32, spawned_at: Instant) {
        let mut map = self.entries.lock();
        if map.get(&pid).is_some_and(|e| e.created < spawned_at) {
            map.remove(&pid);
        }
    }

    /// Adds one reaped process's rusage to command `key`.
    fn add(&self, key: u32, ru: &libc::rusage) {
        let mut map = self.entries.lock();
        if map.len() >= MAX_ENTRIES && !map.contains_key(&key) {
            // Forget the entry that changed longest ago (an old, long-read command).
            if let Some(old) = map.iter().min_by_key(|(_, e)| e.updated).map(|(k, _)| *k) {
                map.remove(&old);
            }
        }
        let now = Instant::now();
        let e = map.entry(key).or_insert(Entry {
            usage: CommandUsage {
                pid: key,
                cpu_time_us: 0,
                user_time_us: 0,
                system_time_us: 0,
                max_rss_kb: 0,
                processes: 0,
            },
            created: now,
            updated: now,
        });
        let (user, sys) = (tv_us(&ru.ru_utime), tv_us(&ru.ru_stime));
        let u = &mut e.usage;
        u.user_time_us = u.user_time_us.saturating_add(user);
        u.system_time_us = u.system_time_us.saturating_add(sys);
        u.cpu_time_us = u.user_time_us.saturating_add(u.system_time_us);
        u.max_rss_kb = u.max_rss_kb.max(u64::try_from(ru.ru_maxrss).unwrap_or(0));
        u.processes = u.processes.saturating_add(1);
        e.updated = now;
    }

    /// The usage counted so far for command `pid`.
    pub fn get(&self, pid: u32) -> Option<CommandUsage> {
        self.entries.lock().get(&pid).map(|e| e.usage)
    }
}

/// Collects every child that has exited, charging its rusage to the command of its
/// session, and reports exit statuses to the process table. Never blocks. Returns false
/// if it had to stop while an exited child may be left uncollected (the caller looks
/// again soon: no further SIGCHLD may come for it, as signals coalesce).
pub fn reap_pass(table: &ProcessTable) -> bool {
    let mut misses = 0;
    loop {
        // Peek without collecting: once collected, the zombie's session is gone from /proc.
        let flags = WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT;
        let pid = match waitid(Id::All, flags) {
            Ok(WaitStatus::Exited(pid, _) | WaitStatus::Signaled(pid, _, _)) => pid.as_raw(),
            Err(Errno::EINTR) => continue,
            // Nothing has exited (only exits are asked for, so nothing else comes back).
            Ok(_) | Err(Errno::ECHILD) => return true,
            Err(e) => {
                tracing::warn!(error = %e, "waitid failed");
                return false;
            }
        };
        let session = Stat::of(pid as u32).map(|s| s.session);
        let mut status = 0;
        // SAFETY: all-zero is a valid rusage, filled in by wait4.
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: wait4 writes into the two locals, which outlive the call.
        let got = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut ru) };
        if got != pid {
            // Collected elsewhere meanwhile (0: and its pid already given to a live
            // child), or interrupted: look again, since other exited children may wait.
            // Bounded, in case the kernel keeps offering a child wait4 will not take.
            misses += 1;
            if misses > MAX_MISSES {
                return false;
            }
            continue;
        }
        let pid = pid as u32;
        let key = match session {
            Some(s) if s == pid || table.is_command(s) => Some(s),
            _ => None,
        };
        if let Some(key) = key {
            table.usage.add(key, &ru);
        }
        if libc::WIFEXITED(status) {
            table.on_exit(pid, libc::WEXITSTATUS(status), None);
        } else if libc::WIFSIGNALED(status) {
            let sig = libc::WTERMSIG(status);
            table.on_exit(pid, 128 + sig, Some(sig));
        }
    }
}

/// Whether a child of the agent in `session` is dying right now: its usage will be ours
/// to collect within microseconds.
fn member_exiting(session: u32) -> bool {
    let me = std::process::id();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return false;
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        // Pids grow: a process older than the command cannot descend from it, and skipping
        // those keeps this cheap in a sandbox full of long-lived processes.
        .filter(|pid| *pid > session)
        .filter_map(Stat::of)
        .any(|s| {
            s.session == session && s.ppid == me && (s.state == 'Z' || s.flags & PF_EXITING != 0)
        })
}

/// Called when command `pid` has exited and its output is drained: collects what has
/// exited, and gives orphans of its session that are exiting at this moment a few
/// milliseconds to be collected too, so the usage read after the end event is complete.
/// Descendants that are still running are not waited for.
pub async fn settle(table: &Arc<ProcessTable>, pid: u32) {
    // Whatever this pass leaves, the reaper task retries on its own.
    reap_pass(table);
    // Only inside a sandbox's own pid namespace is /proc small; outside (the process
    // runtime, for development), scanning the host's processes is not worth it.
    if std::process::id() != 1 {
        return;
    }
    for _ in 0..SETTLE_ROUNDS {
        if !member_exiting(pid) {
            return;
        }
        tokio::time::sleep(SETTLE_STEP).await;
        reap_pass(table);
    }
}

/// Query of `GET /rusage`.
#[derive(Debug, serde::Deserialize)]
pub struct UsageQuery {
    pid: u32,
}

/// `GET /rusage?pid=N`: the usage counted for command N, or 404 if none is known.
pub async fn route(
    axum::extract::State(table): axum::extract::State<Arc<ProcessTable>>,
    axum::extract::Query(q): axum::extract::Query<UsageQuery>,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    match table.usage.get(q.pid) {
        Some(u) => axum::Json(u).into_response(),
        None => (axum::http::StatusCode::NOT_FOUND, "no usage for this pid").into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ru(user_us: i64, sys_us: i64, rss: i64) -> libc::rusage {
        // SAFETY: all-zero is a valid rusage.
        let mut r: libc::rusage = unsafe { std::mem::zeroed() };
        r.ru_utime.tv_sec = user_us / 1_000_000;
        r.ru_utime.tv_usec = user_us % 1_000_000;
        r.ru_stime.tv_sec = sys_us / 1_000_000;
        r.ru_stime.tv_usec = sys_us % 1_000_000;
        r.ru_maxrss = rss;
        r
    }

    #[test]
    fn usage_adds_up_per_command_and_peaks_are_maxima() {
        let t = UsageTable::default();
        t.add(10, &ru(1_500_000, 250, 900));
        t.add(10, &ru(20, 30, 4000));
        t.add(11, &ru(5, 5, 1));
        let u = t.get(10).unwrap();
        assert_eq!(u.user_time_us, 1_500_020);
        assert_eq!(u.system_time_us, 280);
        assert_eq!(u.cpu_time_us, 1_500_300);
        assert_eq!(u.max_rss_kb, 4000);
        assert_eq!(u.processes, 2);
        assert_eq!(t.get(11).unwrap().cpu_time_us, 10);
        assert!(t.get(12).is_none());
    }

    #[test]
    fn a_reused_pid_starts_from_zero_but_an_early_reap_is_kept() {
        let t = UsageTable::default();
        t.add(10, &ru(100, 0, 1));
        let spawned = Instant::now();
        // Counted before this spawn: an earlier process with the same pid.
        t.begin(10, spawned);
        assert!(t.get(10).is_none());
        // The new command exited and was reaped before the spawner registered it.
        let spawned = Instant::now();
        t.add(10, &ru(7, 0, 1));
        t.begin(10, spawned);
        assert_eq!(t.get(10).unwrap().cpu_time_us, 7);
    }

    #[test]
    fn the_table_is_bounded() {
        let t = UsageTable::default();
        for pid in 0..(MAX_ENTRIES as u32 + 10) {
            t.add(pid, &ru(1, 0, 1));
        }
        let n = t.entries.lock().len();
        assert_eq!(n, MAX_ENTRIES);
        // The newest are kept.
        assert!(t.get(MAX_ENTRIES as u32 + 9).is_some());
    }
}
