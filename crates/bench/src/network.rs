//! The network phase: create -> first exec of a sandbox whose policy opens its link
//! against one whose link stays down (both take a namespace from the daemon's pool), what
//! preparing a namespace costs without the pool (measured here with the daemon's own
//! netlink code), and the egress proxy's added latency per connection and throughput
//! against a direct connection from the host to the same server, measured in the same
//! run with the same client. The server runs in a network namespace this phase makes,
//! on a documentation address routed only into it; nothing leaves the machine.

use super::report::Report;
use super::{Bench, COLD_LIMITS, MIB, Progress, ms};
use anyhow::{Context, bail};
use sandpit_api::RunCommandRequest;
use sandpit_api::network::{NetworkMode, NetworkPolicy, NetworkRule, RuleAction};
use std::io::{Read, Write};
use std::net::Ipv4Addr;
use std::process::Command;
use std::time::Instant;

/// The test server's address (documentation range), and the link to its namespace.
const SERVER_IP: &str = "203.0.113.250";
const LINK_NET: &str = "198.18.200";
const SERVER_PORT: u16 = 18_080;
/// Bytes of the throughput measurement.
const BULK: u64 = 100 << 20;

/// The client, the same in the sandbox (through the proxy) and on the host (direct):
/// `n` connections asking for one byte, then one asking for `size` bytes.
const CLIENT: &str = r#"
import socket, sys, time
host, port, n, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
lat = []
for i in range(n + 1):
    t = time.perf_counter()
    s = socket.create_connection((host, port), timeout=10)
    s.sendall(b"1\n")
    if s.recv(1) != b"x":
        sys.exit("short answer")
    s.close()
    if i > 0:
        lat.append((time.perf_counter() - t) * 1000)
t = time.perf_counter()
s = socket.create_connection((host, port), timeout=30)
s.sendall(b"%d\n" % size)
got = 0
while True:
    b = s.recv(1 << 20)
    if not b:
        break
    got += len(b)
print(" ".join("%.4f" % x for x in lat))
print(got, time.perf_counter() - t)
"#;

fn ip(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .context("run ip (iproute2)")?;
    if !out.status.success() {
        bail!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// A namespace with the test server; removed when dropped.
struct Upstream {
    ns: String,
    link: String,
}

impl Upstream {
    fn start() -> anyhow::Result<Upstream> {
        let id = std::process::id() % 100_000;
        let up = Upstream {
            ns: format!("spbench{id}"),
            link: format!("spbv{id}"),
        };
        ip(&["netns", "add", &up.ns])?;
        ip(&[
            "link", "add", &up.link, "type", "veth", "peer", "name", "eth0", "netns", &up.ns,
        ])?;
        ip(&["addr", "add", &format!("{LINK_NET}.1/30"), "dev", &up.link])?;
        ip(&["link", "set", &up.link, "up"])?;
        let n = |args: &[&str]| {
            let mut a = vec!["-n", up.ns.as_str()];
            a.extend_from_slice(args);
            ip(&a)
        };
        n(&["addr", "add", &format!("{LINK_NET}.2/30"), "dev", "eth0"])?;
        n(&["link", "set", "eth0", "up"])?;
        n(&["link", "set", "lo", "up"])?;
        n(&["addr", "add", &format!("{SERVER_IP}/32"), "dev", "lo"])?;
        // Fails when the address is routed somewhere already: then nothing is measured.
        ip(&[
            "route",
            "add",
            &format!("{SERVER_IP}/32"),
            "via",
            &format!("{LINK_NET}.2"),
            "dev",
            &up.link,
        ])?;
        let ns =
            std::fs::File::open(format!("/run/netns/{}", up.ns)).context("open the namespace")?;
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("bench-upstream".into())
            .spawn(move || {
                let bound = nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET)
                    .map_err(anyhow::Error::from)
                    .and_then(|()| {
                        std::net::TcpListener::bind((Ipv4Addr::UNSPECIFIED, SERVER_PORT))
                            .context("bind the test server")
                    });
                match bound {
                    Ok(l) => {
                        let _ = ready_tx.send(Ok(()));
                        serve(l);
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                    }
                }
            })?;
        ready_rx.recv().context("the test server thread")??;
        Ok(up)
    }
}

/// Answers `N\n` with N bytes, then closes; a thread per connection.
fn serve(l: std::net::TcpListener) {
    for conn in l.incoming().flatten() {
        std::thread::spawn(move || {
            let mut c = conn;
            let _ = c.set_nodelay(true);
            let mut line = Vec::new();
            let mut b = [0u8; 1];
            while line.len() < 32 && c.read_exact(&mut b).is_ok() && b[0] != b'\n' {
                line.push(b[0]);
            }
            let n: u64 = String::from_utf8_lossy(&line).trim().parse().unwrap_or(0);
            let chunk = vec![b'x'; 1 << 20];
            let mut left = n;
            while left > 0 {
                let k = left.min(chunk.len() as u64) as usize;
                if c.write_all(&chunk[..k]).is_err() {
                    return;
                }
                left -= k as u64;
            }
        });
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        // The server thread stays blocked in accept; the namespace goes all the same.
        let _ = ip(&["netns", "del", &self.ns]);
        let _ = ip(&["link", "del", &self.link]);
    }
}

/// Parses the client's output: latencies (ms), bytes and seconds of the bulk transfer.
fn parse_client(out: &str) -> anyhow::Result<(Vec<f64>, u64, f64)> {
    let mut lines = out.lines();
    let lat = lines
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .map(|x| x.parse::<f64>().context("latency"))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut bulk = lines.next().unwrap_or_default().split_whitespace();
    let bytes = bulk.next().unwrap_or_default().parse().context("bytes")?;
    let secs = bulk.next().unwrap_or_default().parse().context("seconds")?;
    Ok((lat, bytes, secs))
}

/// Namespaces with a veth pair made as the daemon makes them, without the pool: the cost
/// a create would pay. Runs on a thread of its own (it enters each namespace).
fn prepare_baseline(n: usize) -> anyhow::Result<(Vec<f64>, Vec<f64>, Vec<f64>)> {
    use sandpit_net::link;
    let host_ns = link::current_netns().context("open the host's namespace")?;
    let mut nl = link::Netlink::open().context("netlink")?;
    let gw: Ipv4Addr = format!("{LINK_NET}.129").parse()?;
    let tag = std::process::id() % 1000;
    let (mut prepare, mut unshare, mut up) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    for i in 0..n {
        let peer = Ipv4Addr::new(198, 18, 201, (2 + i % 250) as u8);
        let t = Instant::now();
        let p = link::prepare(&mut nl, &host_ns, &format!("spbn{tag}x{i}"), gw, peer)
            .context("prepare a namespace")?;
        prepare.push(ms(t.elapsed()));
        let t = Instant::now();
        p.inner
            .lock()
            .set_routed(true, gw)
            .context("bring the link up")?;
        up.push(ms(t.elapsed()));
        drop(p);
        let t = Instant::now();
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).context("unshare")?;
        unshare.push(ms(t.elapsed()));
        nix::sched::setns(&host_ns, nix::sched::CloneFlags::CLONE_NEWNET).context("setns")?;
    }
    Ok((prepare, unshare, up))
}

fn open_to_server() -> NetworkPolicy {
    NetworkPolicy {
        mode: NetworkMode::Allowlist,
        rules: vec![NetworkRule {
            action: RuleAction::Allow,
            domain: None,
            cidr: Some(format!("{SERVER_IP}/32")),
            ports: vec![],
            overrides: false,
            name: None,
        }],
    }
}

impl Bench {
    pub(super) async fn network(&self, report: &mut Report) -> anyhow::Result<()> {
        for d in [
            "net.create_none_first_exec",
            "net.create_open_first_exec",
            "net.proxy_connect",
            "baseline.direct_connect",
            "baseline.netns_prepare",
            "baseline.unshare_netns",
        ] {
            report.declare_dist(d);
        }
        let api = &self.api;
        let n = self.iterations.max(1);

        // Create -> first exec, link down (none) and up with a route (open), interleaved.
        let none = NetworkPolicy::default();
        let open = open_to_server();
        let mut req_none = api.request(COLD_LIMITS);
        req_none.network = Some(none);
        let mut req_open = api.request(COLD_LIMITS);
        req_open.network = Some(open.clone());
        let (mut t_none, mut t_open) = (Vec::new(), Vec::new());
        let progress = Progress::new("network create -> first exec", n);
        for i in 0..=n {
            api.cancel.check()?;
            for (req, out) in [(&req_none, &mut t_none), (&req_open, &mut t_open)] {
                let (sb, took, ran) = match api.create_first_exec(req).await {
                    Ok(r) => r,
                    Err(e) if i == 0 => {
                        report.note("net", format!("not measured: {e:#} (is networking on?)"));
                        return Err(e);
                    }
                    Err(e) => return Err(e),
                };
                let deleted = api.delete(&sb.id).await;
                ran?;
                deleted?;
                if i > 0 {
                    out.push(ms(took));
                }
            }
            progress.set(i);
        }
        drop(progress);
        report.set_dist("net.create_none_first_exec", Ok(t_none));
        report.set_dist("net.create_open_first_exec", Ok(t_open));
        for q in ["p50", "p95"] {
            let d = match (
                report.get(&format!("net.create_open_first_exec.{q}_ms")),
                report.get(&format!("net.create_none_first_exec.{q}_ms")),
            ) {
                (Some(a), Some(b)) => Some(a - b),
                _ => None,
            };
            report.set(&format!("net.create_open_minus_none.{q}_ms"), d);
        }
        report.note(
            "net.create_open_first_exec",
            "create -> first `true`, one at a time, alternating with net.create_none_first_exec: \
             both take a prepared namespace from the daemon's pool; `open` also brings the \
             sandbox's link up with its route",
        );

        // What the pool saves: preparing a namespace here, as the daemon does.
        // A thread of its own: it enters namespaces.
        let worker = std::thread::spawn(move || prepare_baseline(n));
        let base = tokio::task::spawn_blocking(move || worker.join())
            .await
            .context("the namespace baseline thread")?
            .map_err(|_| anyhow::anyhow!("the namespace baseline thread panicked"))?;
        match base {
            Ok((prepare, unshare, up)) => {
                report.set_dist("baseline.netns_prepare", Ok(prepare));
                report.set_dist("baseline.unshare_netns", Ok(unshare));
                report.set_dist("net.link_up", Ok(up));
                report.note(
                    "baseline.netns_prepare",
                    "unshare a network namespace, veth pair, addresses, links up through netlink: \
                     what a create would pay without the pool (its removal happens in the kernel, \
                     in the background)",
                );
            }
            Err(e) => {
                report.set_dist("net.link_up", Err(format!("{e:#}")));
                report.set_dist("baseline.netns_prepare", Err(format!("{e:#}")));
                report.set_dist("baseline.unshare_netns", Err(format!("{e:#}")));
            }
        }

        // The proxy against a direct connection, same server, same client.
        let up = match tokio::task::spawn_blocking(Upstream::start).await? {
            Ok(u) => u,
            Err(e) => {
                report.note("net.proxy_connect", format!("not measured: {e:#}"));
                return Err(e);
            }
        };
        let result = async {
            let sb = api.create(&req_open).await?;
            let run = async {
                let req = RunCommandRequest {
                    argv: vec![
                        "python3".into(),
                        "-c".into(),
                        CLIENT.into(),
                        SERVER_IP.into(),
                        SERVER_PORT.to_string(),
                        n.to_string(),
                        BULK.to_string(),
                    ],
                    timeout_ms: Some(300_000),
                    ..Default::default()
                };
                let out = api
                    .client
                    .run(&sb.id, &req)
                    .await
                    .context("run the client")?;
                if out.exit_code != 0 {
                    bail!("the client failed in the sandbox: {}", out.stderr.trim());
                }
                parse_client(&out.stdout)
            }
            .await;
            let deleted = api.delete(&sb.id).await;
            let proxied = run?;
            deleted?;
            let direct = tokio::task::spawn_blocking(move || {
                let out = Command::new("python3")
                    .args(["-c", CLIENT, SERVER_IP, &SERVER_PORT.to_string()])
                    .args([n.to_string(), BULK.to_string()])
                    .output()
                    .context("run the client on the host")?;
                if !out.status.success() {
                    bail!(
                        "the client failed on the host: {}",
                        String::from_utf8_lossy(&out.stderr).trim()
                    );
                }
                parse_client(&String::from_utf8_lossy(&out.stdout))
            })
            .await??;
            Ok::<_, anyhow::Error>((proxied, direct))
        }
        .await;
        drop(up);
        let ((p_lat, p_bytes, p_secs), (d_lat, d_bytes, d_secs)) = result?;
        if p_bytes != BULK || d_bytes != BULK {
            bail!("short transfer: {p_bytes} through the proxy, {d_bytes} direct, of {BULK}");
        }
        report.set_dist("net.proxy_connect", Ok(p_lat));
        report.set_dist("baseline.direct_connect", Ok(d_lat));
        for q in ["p50", "p95"] {
            let d = match (
                report.get(&format!("net.proxy_connect.{q}_ms")),
                report.get(&format!("baseline.direct_connect.{q}_ms")),
            ) {
                (Some(a), Some(b)) => Some(a - b),
                _ => None,
            };
            report.set(&format!("net.proxy_added.{q}_ms"), d);
        }
        report.set(
            "net.proxy_throughput.mb_per_s",
            Some(p_bytes as f64 / MIB / p_secs),
        );
        report.set(
            "baseline.direct_throughput.mb_per_s",
            Some(d_bytes as f64 / MIB / d_secs),
        );
        report.set_ratio(
            "proxy_vs_direct_throughput",
            "net.proxy_throughput.mb_per_s",
            "baseline.direct_throughput.mb_per_s",
        );
        report.note(
            "net.proxy_connect",
            "connect, send 2 bytes, receive 1, close, from a sandbox through the egress proxy \
             (policy check, audit, upstream connect); baseline.direct_connect is the same \
             client on the host, straight to the same server",
        );
        Ok(())
    }
}
