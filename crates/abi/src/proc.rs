//! Processes as `/proc` shows them: one parser of `/proc/PID/stat`, and killing a whole
//! process tree. The agent kills a command's tree; the daemon kills an unisolated
//! sandbox's agent with everything below it; the run supervisor signals everything below
//! itself.

use nix::errno::Errno;
use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;

/// The fields of a `/proc/PID/stat` line that sandpit reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stat {
    /// The state letter (field 3): `R`, `S`, `T`, `Z`, ...
    pub state: char,
    /// The parent's pid (field 4).
    pub ppid: u32,
    /// The session id (field 6).
    pub session: u32,
    /// The kernel's `PF_*` flags (field 9).
    pub flags: u64,
    /// Start time in clock ticks since boot (field 22).
    pub start_time: u64,
}

impl Stat {
    /// Parses a `/proc/PID/stat` line; `None` when a field is missing or malformed.
    pub fn parse(line: &str) -> Option<Self> {
        // The command name may hold anything, ")" included: the fields restart after the last.
        let mut fields = line.rsplit_once(')')?.1.split_whitespace();
        let mut letters = fields.next()?.chars();
        let state = match (letters.next(), letters.next()) {
            (Some(c), None) => c,
            _ => return None,
        };
        let ppid = fields.next()?.parse().ok()?;
        fields.next()?; // pgrp
        let session = fields.next()?.parse().ok()?;
        fields.next()?; // tty_nr
        fields.next()?; // tpgid
        let flags = fields.next()?.parse().ok()?;
        // Fields 10 to 21 lie between the flags and the start time.
        let start_time = fields.nth(12)?.parse().ok()?;
        Some(Stat {
            state,
            ppid,
            session,
            flags,
            start_time,
        })
    }

    /// Reads and parses `/proc/PID/stat`; `None` when the process is gone or its line
    /// cannot be read.
    pub fn of(pid: u32) -> Option<Self> {
        Self::parse(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
    }
}

/// Sends `sig` to a process, its process group and every descendant.
pub fn kill_tree(pid: u32, sig: Signal) {
    let mut victims = descendants(pid);
    victims.push(pid);
    let _ = killpg(Pid::from_raw(pid as i32), sig);
    for v in victims {
        match kill(Pid::from_raw(v as i32), sig) {
            Ok(()) | Err(Errno::ESRCH) => {}
            Err(e) => tracing::debug!(pid = v, error = %e, "kill failed"),
        }
    }
}

/// Pids below `root` in the parent tree that have not exited (zombies left out: no
/// signal reaches them, and their parent collects them).
pub fn live_descendants(root: u32) -> Vec<u32> {
    descendants(root)
        .into_iter()
        .filter(|p| Stat::of(*p).is_some_and(|s| s.state != 'Z' && s.state != 'X'))
        .collect()
}

/// Sends `sig` to each of `pids`; a process that is gone already is not an error. The
/// number of processes the signal reached.
pub fn signal_each(pids: &[u32], sig: Signal) -> usize {
    let mut reached = 0;
    for p in pids {
        match kill(Pid::from_raw(*p as i32), sig) {
            Ok(()) => reached += 1,
            Err(Errno::ESRCH) => {}
            Err(e) => tracing::debug!(pid = p, error = %e, "kill failed"),
        }
    }
    reached
}

/// Pids below `root` in the parent tree, read from /proc.
pub fn descendants(root: u32) -> Vec<u32> {
    let mut parent_of: Vec<(u32, u32)> = Vec::new();
    if let Ok(rd) = std::fs::read_dir("/proc") {
        for e in rd.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            // A process may end between the listing and the read; it has no children then.
            if let Some(stat) = Stat::of(pid) {
                parent_of.push((pid, stat.ppid));
            }
        }
    }
    let mut out = Vec::new();
    let mut frontier = vec![root];
    while let Some(p) = frontier.pop() {
        for (child, _) in parent_of.iter().filter(|(_, pp)| *pp == p) {
            if !out.contains(child) {
                out.push(*child);
                frontier.push(*child);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    fn stat_line(state: &str, ppid: &str, start: u64) -> String {
        // pid (comm with ") (" in it) state ppid pgrp session tty tpgid flags, then fields
        // 10..=21, then starttime (22).
        let middle: Vec<String> = (10..=21).map(|n| n.to_string()).collect();
        format!(
            "42 (a) (b) {state} {ppid} 5 6 -1 -1 4194560 {} {start} 99 100",
            middle.join(" ")
        )
    }

    #[test]
    fn a_stat_line_gives_its_fields() {
        assert_eq!(
            Stat::parse(&stat_line("S", "7", 777)),
            Some(Stat {
                state: 'S',
                ppid: 7,
                session: 6,
                flags: 4194560,
                start_time: 777
            })
        );
        assert_eq!(Stat::parse(&stat_line("S", "x", 777)), None);
        assert_eq!(Stat::parse(&stat_line("SS", "7", 777)), None);
        assert_eq!(Stat::parse("42 (a"), None);
        assert_eq!(Stat::parse("42 (a) S 1"), None);
        let own = Stat::of(std::process::id()).expect("own stat line");
        assert_eq!(own.ppid, std::os::unix::process::parent_id());
        let session = nix::unistd::getsid(None).unwrap().as_raw() as u32;
        assert_eq!(own.session, session);
    }

    /// Whether `pid` is gone or a zombie (its parent may not have reaped it yet).
    fn ended(pid: u32) -> bool {
        Stat::of(pid).is_none_or(|s| s.state == 'Z')
    }

    #[test]
    fn live_descendants_leave_out_zombies_and_signal_each_skips_the_gone() {
        // The shell becomes a sleep that never collects its children: `true` stays a
        // zombie below it, the background sleep lives.
        let mut sh = std::process::Command::new("sh")
            .args(["-c", "sleep 30 & true & exec sleep 30"])
            .spawn()
            .unwrap();
        let pid = sh.id();
        let deadline = Instant::now() + Duration::from_secs(10);
        let (zombie, live) = loop {
            let below = descendants(pid);
            let zombies: Vec<u32> = below
                .iter()
                .copied()
                .filter(|p| Stat::of(*p).is_some_and(|s| s.state == 'Z'))
                .collect();
            if below.len() == 2 && zombies.len() == 1 {
                let live: Vec<u32> = below.into_iter().filter(|p| *p != zombies[0]).collect();
                break (zombies[0], live);
            }
            assert!(
                Instant::now() < deadline,
                "children never settled: {below:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        assert_eq!(live_descendants(pid), live);
        assert!(!live_descendants(pid).contains(&zombie));
        assert_eq!(signal_each(&live, Signal::SIGKILL), 1);
        assert_eq!(signal_each(&[pid], Signal::SIGKILL), 1);
        sh.wait().unwrap();
        // Gone and collected: no signal reaches it, and that is no error.
        assert_eq!(signal_each(&[pid], Signal::SIGKILL), 0);
    }

    #[test]
    fn kill_tree_reaches_grandchildren_outside_the_group() {
        // Not a group leader: killpg finds no group, so only the /proc walk reaches them.
        // The shell outlives its children, so only the signal can end it. Short sleeps, so
        // that a failed run leaves nothing behind for long.
        let mut sh = std::process::Command::new("sh")
            .args(["-c", "sleep 30 & sleep 30 & wait; sleep 30"])
            .spawn()
            .unwrap();
        let pid = sh.id();
        let deadline = Instant::now() + Duration::from_secs(10);
        let below = loop {
            let below = descendants(pid);
            if below.len() == 2 {
                break below;
            }
            assert!(Instant::now() < deadline, "sleeps never started: {below:?}");
            std::thread::sleep(Duration::from_millis(20));
        };
        kill_tree(pid, Signal::SIGKILL);
        let status = sh.wait().unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(Signal::SIGKILL as i32)
        );
        for p in below {
            while !ended(p) {
                assert!(Instant::now() < deadline, "pid {p} survived kill_tree");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}
