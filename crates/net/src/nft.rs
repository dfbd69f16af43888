//! The daemon's nftables table: sandboxes' packets never leave through the host's
//! routing, every TCP connection of a sandbox goes to the egress proxy and every DNS
//! query to the daemon's resolver. Applied with the `nft` tool, one table per daemon,
//! replaced whole (atomically) at every start.

use super::policy::Cidr;
use std::io::{self, Write};
use std::net::Ipv4Addr;
use std::process::{Command, ExitStatus, Stdio};

/// What the table redirects where.
#[derive(Debug, Clone)]
pub struct Rules {
    pub table: String,
    /// Prefix of the host ends of the sandboxes' veth pairs.
    pub if_prefix: String,
    pub subnet: Cidr,
    pub gateway: Ipv4Addr,
    pub proxy_port: u16,
    pub dns_udp_port: u16,
    pub dns_tcp_port: u16,
    /// DNS packets a second (and burst) each sandbox may send before the kernel drops
    /// them: a flood then never reaches the resolver's one socket, where it would crowd
    /// out every other sandbox's questions.
    pub dns_packets_per_second: u32,
    pub dns_packet_burst: u32,
}

impl Rules {
    /// The nft script that replaces the table.
    pub fn script(&self) -> String {
        let Rules {
            table,
            if_prefix,
            subnet,
            gateway,
            proxy_port,
            dns_udp_port,
            dns_tcp_port,
            dns_packets_per_second,
            dns_packet_burst,
        } = self;
        let iif = format!("iifname \"{if_prefix}*\"");
        format!(
            "table inet {table} {{}}
delete table inet {table}
table inet {table} {{
    set dns_rate {{
        type ipv4_addr; size 65535; flags dynamic; timeout 10s;
    }}
    chain sb_early {{
        type filter hook prerouting priority raw; policy accept;
        {iif} meta nfproto ipv6 drop
        {iif} ip saddr != {subnet} drop
        {iif} ip daddr {{ 224.0.0.0/4, 255.255.255.255 }} drop
        {iif} udp dport 53 update @dns_rate {{ ip saddr limit rate over {dns_packets_per_second}/second burst {dns_packet_burst} packets }} drop
    }}
    chain sb_nat {{
        type nat hook prerouting priority dstnat; policy accept;
        {iif} udp dport 53 redirect to :{dns_udp_port}
        {iif} tcp dport 53 redirect to :{dns_tcp_port}
        {iif} meta l4proto tcp redirect to :{proxy_port}
    }}
    chain sb_in {{
        type filter hook input priority filter; policy accept;
        {iif} ct state established,related accept
        {iif} ct status dnat ip daddr {gateway} tcp dport {{ {proxy_port}, {dns_tcp_port} }} accept
        {iif} ct status dnat ip daddr {gateway} udp dport {dns_udp_port} accept
        {iif} drop
    }}
    chain sb_fwd {{
        type filter hook forward priority filter; policy accept;
        {iif} drop
        oifname \"{if_prefix}*\" drop
    }}
}}
"
        )
    }
}

/// Why the `nft` tool did not apply a script.
#[derive(Debug, thiserror::Error)]
pub enum NftError {
    /// The tool could not be started.
    #[error("run nft: {0}")]
    Spawn(#[source] io::Error),
    /// The script could not be handed to it.
    #[error("write to nft: {0}")]
    Write(#[source] io::Error),
    /// Its end could not be waited for.
    #[error("wait for nft: {0}")]
    Wait(#[source] io::Error),
    /// It ran and refused the script: its exit status and what it said.
    #[error("nft failed: {stderr}")]
    Failed { status: ExitStatus, stderr: String },
}

fn run_nft(script: &str) -> Result<(), NftError> {
    let mut child = Command::new("nft")
        .arg("-f")
        .arg("-")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(NftError::Spawn)?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(script.as_bytes())
            .map_err(NftError::Write)?;
    }
    let out = child.wait_with_output().map_err(NftError::Wait)?;
    if out.status.success() {
        Ok(())
    } else {
        Err(NftError::Failed {
            status: out.status,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

/// Installs (or replaces) the table.
pub fn apply(rules: &Rules) -> Result<(), NftError> {
    run_nft(&rules.script())
}

/// Removes the table if it exists.
pub fn delete(table: &str) -> Result<(), NftError> {
    run_nft(&format!(
        "table inet {table} {{}}\ndelete table inet {table}\n"
    ))
}

/// Names of the inet tables whose names start with `prefix`.
pub fn tables_with_prefix(prefix: &str) -> Vec<String> {
    let Ok(out) = Command::new("nft")
        .args(["list", "tables", "inet"])
        .stderr(Stdio::null())
        .output()
    else {
        return Vec::new();
    };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.trim().strip_prefix("table inet "))
        .filter(|t| t.starts_with(prefix))
        .map(str::to_string)
        .collect()
}

/// Whether the table exists.
pub fn exists(table: &str) -> bool {
    Command::new("nft")
        .args(["list", "table", "inet", table])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Whether the `nft` tool runs here.
pub fn available() -> bool {
    Command::new("nft")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_script_redirects_and_drops() {
        let r = Rules {
            table: "sandpit_abc".into(),
            if_prefix: "spabc".into(),
            subnet: Cidr::parse("10.200.0.0/16").unwrap(),
            gateway: "10.200.0.1".parse().unwrap(),
            proxy_port: 4000,
            dns_udp_port: 4001,
            dns_tcp_port: 4002,
            dns_packets_per_second: 400,
            dns_packet_burst: 800,
        };
        let s = r.script();
        assert!(s.starts_with("table inet sandpit_abc {}\ndelete table inet sandpit_abc\n"));
        assert!(s.contains("iifname \"spabc*\" meta l4proto tcp redirect to :4000"));
        assert!(s.contains("iifname \"spabc*\" udp dport 53 redirect to :4001"));
        assert!(s.contains("iifname \"spabc*\" ip saddr != 10.200.0.0/16 drop"));
        assert!(s.contains("oifname \"spabc*\" drop"));
        assert!(s.contains(
            "iifname \"spabc*\" udp dport 53 update @dns_rate { ip saddr limit rate over 400/second burst 800 packets } drop"
        ));
    }

    #[test]
    fn nft_errors_keep_the_status_the_output_and_the_os_error() {
        use std::error::Error as _;
        use std::os::unix::process::ExitStatusExt;
        let failed = NftError::Failed {
            status: ExitStatus::from_raw(1 << 8),
            stderr: "Error: syntax error".into(),
        };
        assert_eq!(failed.to_string(), "nft failed: Error: syntax error");
        assert!(matches!(&failed, NftError::Failed { status, .. } if status.code() == Some(1)));
        assert!(failed.source().is_none());
        let spawn = NftError::Spawn(io::Error::from(io::ErrorKind::NotFound));
        assert!(spawn.to_string().starts_with("run nft: "));
        let cause = spawn
            .source()
            .expect("the spawn failure keeps the OS error");
        assert_eq!(
            cause.downcast_ref::<io::Error>().map(io::Error::kind),
            Some(io::ErrorKind::NotFound)
        );
    }
}
