//! Processes as `/proc` shows them: one parser of `/proc/PID/stat`, and killing a whole
//! process tree. The agent kills a command's tree; the daemon kills an unisolated
//! sandbox's agent with everything below it.

use nix::errno::Errno;
use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;

/// The fields of a `/proc/PID/stat` line that sandpit reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stat<'a> {
    /// The state letter (field 3): `R`, `S`, `T`, `Z`, ...
    pub state: &'a str,
    /// The parent's pid (field 4).
    pub ppid: u32,
    /// Start time in clock ticks since boot (field 22).
    pub start_time: u64,
}

impl<'a> Stat<'a> {
    /// Parses a `/proc/PID/stat` line; `None` when a field is missing or malformed.
    pub fn parse(line: &'a str) -> Option<Self> {
        // The command name may hold anything, ")" included: the fields restart after the last.
        let mut fields = line.rsplit_once(')')?.1.split_whitespace();
        let state = fields.next()?;
        let ppid = fields.next()?.parse().ok()?;
        // Fields 5 to 21 lie between the parent and the start time.
        let start_time = fields.nth(17)?.parse().ok()?;
        Some(Stat {
            state,
            ppid,
            start_time,
        })
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

/// Pids below `root` in the parent tree, read from /proc.
pub fn descendants(root: u32) -> Vec<u32> {
    let mut parent_of: Vec<(u32, u32)> = Vec::new();
    if let Ok(rd) = std::fs::read_dir("/proc") {
        for e in rd.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            // A process may end between the listing and the read; it has no children then.
            let Ok(line) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            if let Some(stat) = Stat::parse(&line) {
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
        // pid (comm with ") (" in it) state ppid, then fields 5..=21, then starttime (22).
        let middle: Vec<String> = (5..=21).map(|n| n.to_string()).collect();
        format!(
            "42 (a) (b) {state} {ppid} {} {start} 99 100",
            middle.join(" ")
        )
    }

    #[test]
    fn a_stat_line_gives_state_parent_and_start() {
        assert_eq!(
            Stat::parse(&stat_line("S", "7", 777)),
            Some(Stat {
                state: "S",
                ppid: 7,
                start_time: 777
            })
        );
        assert_eq!(Stat::parse(&stat_line("S", "x", 777)), None);
        assert_eq!(Stat::parse("42 (a"), None);
        assert_eq!(Stat::parse("42 (a) S 1"), None);
        let own = std::fs::read_to_string("/proc/self/stat").unwrap();
        let own = Stat::parse(&own).expect("own stat line");
        assert_eq!(own.ppid, std::os::unix::process::parent_id());
    }

    /// Whether `pid` is gone or a zombie (its parent may not have reaped it yet).
    fn ended(pid: u32) -> bool {
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Ok(line) => Stat::parse(&line).is_some_and(|s| s.state == "Z"),
            Err(_) => true,
        }
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
