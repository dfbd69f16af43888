//! What the benchmark reads from /proc: memory of the host and of processes, and which
//! process is the daemon.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, ToSocketAddrs};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, anyhow};

/// `VmRSS` of a process, in KiB.
pub(super) fn vm_rss_kb(pid: i32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// Host memory in use, sampled a few times: the median, and how far the samples spread
/// (a rough measure of what the rest of the machine was doing meanwhile), both in KiB.
#[derive(Debug, Clone, Copy)]
pub(super) struct UsedSample {
    pub median: f64,
    pub spread: f64,
}

pub(super) async fn sample_used_kb() -> anyhow::Result<UsedSample> {
    let mut samples = Vec::with_capacity(3);
    for i in 0..3 {
        if i > 0 {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        samples.push(host_used_kb()? as f64);
    }
    samples.sort_by(f64::total_cmp);
    Ok(UsedSample {
        median: samples[1],
        spread: samples[2] - samples[0],
    })
}

/// MemTotal - MemAvailable, in KiB.
pub(super) fn host_used_kb() -> anyhow::Result<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").context("read /proc/meminfo")?;
    let field = |name: &str| {
        meminfo
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
            .ok_or_else(|| anyhow!("no {name} in /proc/meminfo"))
    };
    Ok(field("MemTotal:")?.saturating_sub(field("MemAvailable:")?))
}

/// Numeric entries of /proc.
pub(super) fn pids() -> Vec<i32> {
    std::fs::read_dir("/proc")
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// The parent of a process, from /proc/PID/stat.
fn ppid(pid: i32) -> Option<i32> {
    parse_stat_ppid(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// The ppid field of a /proc/PID/stat line; the command name before it is in parentheses
/// and may itself contain spaces and parentheses, so the fields are counted from the last `)`.
fn parse_stat_ppid(stat: &str) -> Option<i32> {
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// Each of `roots` with all its descendants, in the order of `roots`.
pub(super) fn process_trees(roots: &[i32]) -> Vec<Vec<i32>> {
    let parents: Vec<(i32, i32)> = pids()
        .into_iter()
        .filter_map(|p| Some((p, ppid(p)?)))
        .collect();
    roots
        .iter()
        .map(|&root| {
            let mut tree = vec![root];
            let mut i = 0;
            while let Some(&p) = tree.get(i) {
                tree.extend(parents.iter().filter(|(_, pp)| *pp == p).map(|(c, _)| *c));
                i += 1;
            }
            tree
        })
        .collect()
}

/// Proportional set size of a process (shared pages split among their users), in KiB.
pub(super) fn pss_kb(pid: i32) -> Option<u64> {
    let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    rollup
        .lines()
        .find_map(|l| l.strip_prefix("Pss:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// (RSS, PSS) in KiB of every sandpit-agent process whose cgroup is one of the sandboxes
/// `ids` (PSS is 0 where the kernel does not tell).
pub(super) fn agent_memory_kb(ids: &BTreeSet<&str>) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    for pid in pids() {
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        // The agent is exec'd as /.sandpit/agent with argv[0] "sandpit-agent", so its comm
        // may be either name; argv[0] decides.
        let argv0_is_agent = std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
            let argv0 = c.split(|b| *b == 0).next().unwrap_or_default();
            Path::new(std::ffi::OsStr::from_bytes(argv0))
                .file_name()
                .is_some_and(|n| n == "sandpit-agent")
        });
        if comm.trim() != "sandpit-agent" && !argv0_is_agent {
            continue;
        }
        let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
        let ours = cgroup
            .lines()
            .any(|l| l.rsplit('/').next().is_some_and(|last| ids.contains(last)));
        if ours && let Some(rss) = vm_rss_kb(pid) {
            out.push((rss, pss_kb(pid).unwrap_or_default()));
        }
    }
    out
}

/// The pid of the `sandpit serve` behind `url`, found through the socket listening on its
/// port; an explanation when the daemon is elsewhere or is not a sandpit daemon.
pub(super) fn locate_daemon(host: &str, port: u16) -> Result<i32, String> {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let ips: Vec<IpAddr> = match host.parse::<IpAddr>() {
        Ok(ip) => vec![ip],
        Err(_) => (host, port)
            .to_socket_addrs()
            .map(|a| a.map(|s| s.ip()).collect())
            .map_err(|e| format!("cannot resolve {host}: {e}"))?,
    };
    // An address is this machine's if it is loopback or a socket can be bound to it.
    let local: Vec<IpAddr> = ips
        .into_iter()
        .filter(|ip| ip.is_loopback() || std::net::UdpSocket::bind((*ip, 0)).is_ok())
        .collect();
    if local.is_empty() {
        return Err(format!(
            "the daemon at {host} is not on this machine: its RSS cannot be read"
        ));
    }
    let inodes: BTreeSet<u64> = listeners(port)
        .into_iter()
        .filter(|(ip, _)| ip.is_unspecified() || local.contains(ip))
        .map(|(_, inode)| inode)
        .collect();
    if inodes.is_empty() {
        return Err(format!(
            "no socket on this machine listens on port {port} (daemon in another network namespace?)"
        ));
    }
    let targets: BTreeSet<String> = inodes.iter().map(|i| format!("socket:[{i}]")).collect();
    for pid in pids() {
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        let owns = fds.flatten().any(|fd| {
            std::fs::read_link(fd.path())
                .is_ok_and(|l| targets.contains(l.to_string_lossy().as_ref()))
        });
        if !owns {
            continue;
        }
        let exe = std::fs::read_link(format!("/proc/{pid}/exe"))
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default();
        let argv = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let serves = argv.split(|b| *b == 0).any(|a| a == b"serve");
        // A rebuilt binary shows as "/path/sandpit (deleted)".
        let sandpit = Path::new(&exe)
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("sandpit"));
        if serves && sandpit {
            return Ok(pid);
        }
        return Err(format!(
            "port {port} belongs to pid {pid} ({exe}), which is not `sandpit serve`"
        ));
    }
    Err(format!(
        "cannot find the process that listens on port {port}"
    ))
}

/// Listening TCP sockets on `port`: (local address, socket inode), from /proc/net/tcp{,6}.
pub(super) fn listeners(port: u16) -> Vec<(IpAddr, u64)> {
    let mut out = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            let (Some(local), Some(state), Some(inode)) = (f.get(1), f.get(3), f.get(9)) else {
                continue;
            };
            if *state != "0A" {
                continue;
            }
            let Some((addr, p)) = local.split_once(':') else {
                continue;
            };
            if u16::from_str_radix(p, 16).ok() != Some(port) {
                continue;
            }
            if let (Some(ip), Ok(inode)) = (parse_proc_ip(addr), inode.parse()) {
                out.push((ip, inode));
            }
        }
    }
    out
}

/// An address as /proc/net/tcp prints it: 32-bit words in hex, each in host byte order.
pub(super) fn parse_proc_ip(hex: &str) -> Option<IpAddr> {
    let word = |s: &str| u32::from_str_radix(s, 16).ok().map(u32::to_ne_bytes);
    match hex.len() {
        8 => Some(IpAddr::V4(Ipv4Addr::from(word(hex)?))),
        32 => {
            let mut b = [0u8; 16];
            for (i, chunk) in b.chunks_exact_mut(4).enumerate() {
                chunk.copy_from_slice(&word(hex.get(i * 8..i * 8 + 8)?)?);
            }
            let v6 = Ipv6Addr::from(b);
            // A v4 client reaches a dual-stack listener through its mapped address.
            Some(v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_ppid() {
        assert_eq!(parse_stat_ppid("42 (sleep) S 7 42 42 0 -1"), Some(7));
        assert_eq!(parse_stat_ppid("42 (a) b) (c) R 9 1 1"), Some(9));
        assert_eq!(parse_stat_ppid("42 (sleep"), None);
        let me = std::process::id() as i32;
        assert_eq!(process_trees(&[me])[0][0], me);
    }

    #[test]
    fn proc_addresses() {
        assert_eq!(
            parse_proc_ip("0100007F"),
            Some(IpAddr::V4(Ipv4Addr::LOCALHOST))
        );
        assert_eq!(
            parse_proc_ip("00000000000000000000000000000000"),
            Some(IpAddr::V6(Ipv6Addr::UNSPECIFIED))
        );
        assert_eq!(
            parse_proc_ip("00000000000000000000000001000000"),
            Some(IpAddr::V6(Ipv6Addr::LOCALHOST))
        );
    }
}
