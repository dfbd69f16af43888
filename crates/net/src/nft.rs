//! The daemon's nftables table: sandboxes' packets never leave through the host's
//! routing, every TCP connection of a sandbox goes to the egress proxy and every DNS
//! query to the daemon's resolver. Applied with the `nft` tool, one table per daemon,
//! replaced whole (atomically) at every start.

use super::policy::Cidr;
use std::io::Write;
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};

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

fn run_nft(script: &str) -> Result<(), String> {
    let mut child = Command::new("nft")
        .arg("-f")
        .arg("-")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("run nft: {e}"))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(script.as_bytes())
            .map_err(|e| format!("write to nft: {e}"))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| format!("wait for nft: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "nft failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Installs (or replaces) the table.
pub fn apply(rules: &Rules) -> Result<(), String> {
    run_nft(&rules.script())
}

/// Removes the table if it exists.
pub fn delete(table: &str) -> Result<(), String> {
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
}
