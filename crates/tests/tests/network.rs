//! Sandbox networking end to end: egress policies (domains, wildcards, CIDRs, ports,
//! deny and override rules), the always-blocked ranges, DNS filtering and rebinding,
//! bypass attempts, live policy changes, the audit, persistence across pause,
//! hibernation, fork, snapshots and restarts, and cleanup. The "internet" is a network
//! namespace each test makes (see `netfix`); no packet goes anywhere else.

use sandpit_api::network::{
    NetworkMode, NetworkPolicy, NetworkRule, PortSpec, RuleAction, Verdict,
};
use sandpit_api::{CreateSandboxRequest, ForkRequest, NetworkAuditEntry};
use sandpit_client::Client;
use sandpit_tests::netfix::{Upstream, links_with_prefix, nft_table_exists};
use sandpit_tests::{
    Daemon, allow_domain, audit_entries, create_small, http, network_rule, sh, small,
};
use std::time::Duration;

fn policy(mode: NetworkMode, rules: Vec<NetworkRule>) -> NetworkPolicy {
    NetworkPolicy { mode, rules }
}

/// A daemon whose data directory holds a config using `up` as its DNS upstream (so that
/// a restart on the same directory keeps it).
async fn daemon(up: &Upstream, extra: &str) -> Daemon {
    Daemon::builder().config(&up.config(extra)).start().await
}

/// `curl` in the sandbox: "CODE rc=N" (000 when no HTTP answer came).
async fn curl(c: &Client, id: &str, args: &str) -> String {
    let r = sh(
        c,
        id,
        &format!(
            "curl -s -k -o /dev/null -w '%{{http_code}}' --max-time 8 {args}; echo \" rc=$?\""
        ),
    )
    .await;
    r.stdout.trim().to_string()
}

/// The body `curl` gets.
async fn fetch(c: &Client, id: &str, url: &str) -> String {
    sh(c, id, &format!("curl -s -k --max-time 8 {url}"))
        .await
        .stdout
}

/// A TCP connection from the sandbox: the first line the server sends, `EOF`, or the error.
async fn tcp_line(c: &Client, id: &str, ip: &str, port: u16) -> String {
    let script = format!(
        "import socket\ntry:\n s=socket.create_connection(('{ip}',{port}),timeout=5)\n s.settimeout(5)\n print(s.recv(200).decode().strip() or 'EOF')\nexcept Exception as e:\n print('ERR', e)\n"
    );
    sh(c, id, &format!("python3 -c \"{script}\""))
        .await
        .stdout
        .trim()
        .to_string()
}

/// A DNS question for `name` sent straight to `server` from the sandbox: the answer's
/// response code and number of answers, or the error.
async fn dns_direct(c: &Client, id: &str, server: &str, name: &str) -> String {
    let script = format!(
        "import socket,struct\nq=struct.pack('!HHHHHH',0x1234,0x0100,1,0,0,0)+b''.join(bytes([len(l)])+l.encode() for l in '{name}'.split('.'))+b'\\0'+struct.pack('!HH',1,1)\ns=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\ns.settimeout(5)\ntry:\n s.sendto(q,('{server}',53))\n r=s.recv(4096)\n print('rcode', r[3]&15, 'answers', struct.unpack('!H',r[6:8])[0])\nexcept Exception as e:\n print('ERR', e)\n"
    );
    sh(c, id, &format!("python3 -c \"{script}\""))
        .await
        .stdout
        .trim()
        .to_string()
}

/// The sandbox's own address.
async fn address_of(c: &Client, id: &str) -> String {
    sh(
        c,
        id,
        "ip -4 -o addr show dev eth0 | awk '{print $4}' | cut -d/ -f1",
    )
    .await
    .stdout
    .trim()
    .to_string()
}

/// The sandbox's nameserver (the gateway, where the daemon listens).
async fn gateway_of(c: &Client, id: &str) -> String {
    sh(c, id, "awk '/nameserver/ {print $2}' /etc/resolv.conf")
        .await
        .stdout
        .trim()
        .to_string()
}

/// The audit entry `f` picks, waiting a little for connections still closing.
async fn entry(
    c: &Client,
    id: &str,
    what: &str,
    f: impl Fn(&NetworkAuditEntry) -> bool,
) -> NetworkAuditEntry {
    for _ in 0..50 {
        if let Some(e) = audit_entries(c, id).await.into_iter().find(|e| f(e)) {
            return e;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!(
        "no audit entry for {what}: {:#?}",
        audit_entries(c, id).await
    );
}

/// The host's first global IPv4 address that is not a test link's.
fn host_address() -> String {
    let out = std::process::Command::new("ip")
        .args(["-4", "-o", "addr", "show", "scope", "global"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(3))
        .map(|a| a.split('/').next().unwrap_or(a).to_string())
        .find(|a| !a.starts_with("198.18.") && !a.starts_with("10."))
        .expect("a host address")
}

fn tag_of(d: &Daemon) -> String {
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(d.data.path().join("network.json")).unwrap())
            .unwrap();
    v["tag"].as_str().unwrap().to_string()
}

/// Waits until the daemon's links are exactly `n` (the kernel removes a sandbox's link
/// in the background after its namespace goes).
async fn wait_links(prefix: &str, n: usize) -> Vec<String> {
    for _ in 0..300 {
        if links_with_prefix(prefix).len() == n {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    links_with_prefix(prefix)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allowlist_rules_bypasses_blocked_ranges_rebinding_and_audit() {
    let up = Upstream::start(&[
        ("allowed.test", "@2"),
        ("other.test", "@3"),
        ("a.svc.test", "@4"),
        ("svc.test", "@4"),
        ("denied.svc.test", "@5"),
        ("special.svc.test", "@6"),
        ("rebind.test", "127.0.0.1"),
        ("private.test", "10.1.2.3"),
        ("meta.test", "169.254.169.254"),
    ]);
    let d = daemon(&up, "").await;
    let c = d.client();
    let p = policy(
        NetworkMode::Allowlist,
        vec![
            allow_domain("allowed.test"),
            NetworkRule {
                domain: Some("*.svc.test".into()),
                ports: vec![PortSpec::One(443)],
                ..network_rule(RuleAction::Allow)
            },
            NetworkRule {
                cidr: Some(format!("{}/28", up.ip2(0))),
                ports: vec![PortSpec::Range("7000-7001".into())],
                ..network_rule(RuleAction::Allow)
            },
            allow_domain("rebind.test"),
            allow_domain("private.test"),
            allow_domain("meta.test"),
            NetworkRule {
                domain: Some("denied.svc.test".into()),
                ..network_rule(RuleAction::Deny)
            },
            NetworkRule {
                domain: Some("special.svc.test".into()),
                ..network_rule(RuleAction::Deny)
            },
            NetworkRule {
                domain: Some("special.svc.test".into()),
                ports: vec![PortSpec::One(443)],
                overrides: true,
                name: Some("special exception".into()),
                ..network_rule(RuleAction::Allow)
            },
        ],
    );
    let id = create_small(&c, Some(p.clone())).await;
    assert_eq!(c.get_sandbox(&id).await.unwrap().network, Some(p.clone()));
    assert_eq!(c.get_network(&id).await.unwrap(), p);

    // Domains, wildcards, ports.
    assert_eq!(curl(&c, &id, "http://allowed.test/").await, "200 rc=0");
    let body = fetch(&c, &id, "http://allowed.test/path").await;
    assert!(body.contains("\"host\": \"allowed.test\""), "{body}");
    assert!(
        body.contains(&format!("\"local\": \"{}\"", up.ip(2))),
        "{body}"
    );
    assert_eq!(curl(&c, &id, "https://allowed.test/").await, "200 rc=0");
    assert_eq!(curl(&c, &id, "http://other.test/").await, "000 rc=6");
    let body = fetch(&c, &id, "https://a.svc.test/").await;
    assert!(body.contains("\"sni\": \"a.svc.test\""), "{body}");
    assert_eq!(curl(&c, &id, "http://a.svc.test/").await, "403 rc=0");
    assert_eq!(curl(&c, &id, "https://svc.test/").await, "000 rc=6");
    // Deny wins over allow; an allow with `override` wins over deny.
    assert_eq!(curl(&c, &id, "https://denied.svc.test/").await, "000 rc=6");
    assert_eq!(curl(&c, &id, "https://special.svc.test/").await, "200 rc=0");
    assert_eq!(curl(&c, &id, "http://special.svc.test/").await, "403 rc=0");
    // CIDR and port rules, with a protocol where the server speaks first.
    assert_eq!(
        tcp_line(&c, &id, &up.ip2(2), 7000).await,
        format!("BANNER {}", up.ip2(2))
    );
    assert_eq!(tcp_line(&c, &id, &up.ip2(2), 80).await, "EOF");
    // An address no rule allows.
    assert_eq!(
        curl(&c, &id, &format!("http://{}/", up.ip(3))).await,
        "403 rc=0"
    );

    // Bypass attempts: an allowed name sent to another address.
    let spoof = curl(
        &c,
        &id,
        &format!(
            "--resolve allowed.test:443:{} https://allowed.test/",
            up.ip(3)
        ),
    )
    .await;
    assert!(spoof.starts_with("000 "), "{spoof}");
    let spoof = curl(
        &c,
        &id,
        &format!(
            "--resolve allowed.test:80:{} http://allowed.test/",
            up.ip(3)
        ),
    )
    .await;
    assert_eq!(spoof, "403 rc=0");
    let spoof = curl(
        &c,
        &id,
        &format!("-H 'Host: allowed.test' http://{}/", up.ip(3)),
    )
    .await;
    assert_eq!(spoof, "403 rc=0");
    // DNS asked of another server still meets the sandbox's resolver.
    assert_eq!(
        dns_direct(&c, &id, &up.dns(), "other.test").await,
        "rcode 3 answers 0"
    );
    assert_eq!(
        dns_direct(&c, &id, &up.dns(), "allowed.test").await,
        "rcode 0 answers 1"
    );

    // Always blocked: metadata, the daemon, the host, private ranges, a neighbour.
    assert_eq!(
        curl(&c, &id, "http://169.254.169.254/latest/").await,
        "403 rc=0"
    );
    let gw = gateway_of(&c, &id).await;
    assert_eq!(
        curl(&c, &id, &format!("http://{gw}:{}/v1/health", d.port)).await,
        "403 rc=0"
    );
    let host = host_address();
    assert_eq!(
        curl(&c, &id, &format!("http://{host}:{}/v1/health", d.port)).await,
        "403 rc=0"
    );
    // The host's loopback is not the sandbox's: nothing listens on the daemon's port there.
    assert_eq!(
        curl(&c, &id, &format!("http://127.0.0.1:{}/v1/health", d.port)).await,
        "000 rc=7"
    );
    assert_eq!(curl(&c, &id, "http://10.1.2.3/").await, "403 rc=0");
    assert_eq!(curl(&c, &id, "http://172.16.0.1/").await, "403 rc=0");
    assert_eq!(curl(&c, &id, "http://192.168.1.1/").await, "403 rc=0");
    assert_eq!(curl(&c, &id, "http://100.64.0.1/").await, "403 rc=0");
    let neighbour = create_small(&c, Some(policy(NetworkMode::Open, vec![]))).await;
    sh(
        &c,
        &neighbour,
        "nohup python3 -m http.server 8000 >/dev/null 2>&1 & sleep 0.5",
    )
    .await;
    let n_ip = address_of(&c, &neighbour).await;
    assert!(n_ip.parse::<std::net::Ipv4Addr>().is_ok(), "{n_ip:?}");
    assert_ne!(n_ip, address_of(&c, &id).await);
    assert_eq!(
        curl(&c, &neighbour, "http://127.0.0.1:8000/").await,
        "200 rc=0"
    );
    assert_eq!(
        curl(&c, &id, &format!("http://{n_ip}:8000/")).await,
        "403 rc=0"
    );
    // Even an open sandbox with an allow-everything override cannot reach them.
    c.set_network(
        &neighbour,
        &policy(
            NetworkMode::Open,
            vec![NetworkRule {
                cidr: Some("0.0.0.0/0".into()),
                overrides: true,
                ..network_rule(RuleAction::Allow)
            }],
        ),
    )
    .await
    .unwrap();
    assert_eq!(
        curl(&c, &neighbour, "http://169.254.169.254/").await,
        "403 rc=0"
    );
    assert_eq!(
        curl(&c, &neighbour, &format!("http://{gw}:{}/v1/health", d.port)).await,
        "403 rc=0"
    );
    assert_eq!(
        curl(&c, &neighbour, "http://allowed.test/").await,
        "200 rc=0"
    );

    // DNS rebinding: answers pointing at blocked addresses are dropped.
    assert_eq!(curl(&c, &id, "http://rebind.test/").await, "000 rc=6");
    assert_eq!(curl(&c, &id, "http://private.test/").await, "000 rc=6");
    assert_eq!(curl(&c, &id, "http://meta.test/").await, "000 rc=6");

    // The audit: every attempt, its verdict and the rule that decided.
    let e = entry(&c, &id, "allowed.test over http", |e| {
        e.http_host.as_deref() == Some("allowed.test") && e.ended_at_ms.is_some()
    })
    .await;
    assert_eq!(e.verdict, Verdict::Allow);
    assert_eq!(e.protocol, "tcp");
    assert_eq!(e.dest_name.as_deref(), Some("allowed.test"));
    assert_eq!(e.dest_ip, Some(up.ip(2)));
    assert_eq!(e.dest_port, 80);
    assert_eq!(e.rule, "rules[0] allow allowed.test");
    assert!(e.bytes_sent > 20 && e.bytes_received > 100, "{e:?}");
    let e = entry(&c, &id, "a.svc.test over TLS", |e| {
        e.sni.as_deref() == Some("a.svc.test")
    })
    .await;
    assert_eq!(e.verdict, Verdict::Allow);
    assert_eq!(e.rule, "rules[1] allow *.svc.test port 443");
    let e = entry(&c, &id, "the override", |e| {
        e.sni.as_deref() == Some("special.svc.test")
    })
    .await;
    assert_eq!(e.rule, "rules[8] \"special exception\"");
    let e = entry(&c, &id, "denied.svc.test", |e| {
        e.dest_name.as_deref() == Some("denied.svc.test")
    })
    .await;
    assert_eq!((e.protocol.as_str(), e.verdict), ("dns", Verdict::Deny));
    assert_eq!(e.rule, "rules[6] deny denied.svc.test");
    let e = entry(&c, &id, "the spoofed SNI", |e| {
        e.sni.as_deref() == Some("allowed.test") && e.verdict == Verdict::Deny
    })
    .await;
    assert_eq!(
        e.rule,
        format!("allowed.test does not resolve to {}", up.ip(3))
    );
    let e = entry(&c, &id, "the metadata address", |e| {
        e.dest_ip.as_deref() == Some("169.254.169.254")
    })
    .await;
    assert_eq!(
        (e.verdict, e.rule.as_str()),
        (Verdict::Deny, "blocked: link-local")
    );
    let e = entry(&c, &id, "the neighbour", |e| {
        e.dest_ip.as_deref() == Some(n_ip.as_str())
    })
    .await;
    assert!(e.rule.starts_with("blocked: sandbox network"), "{e:?}");
    let e = entry(&c, &id, "the host", |e| {
        e.dest_ip.as_deref() == Some(host.as_str())
    })
    .await;
    assert_eq!(e.rule, "blocked: host address");
    let e = entry(&c, &id, "the rebinding answer", |e| {
        e.dest_name.as_deref() == Some("rebind.test")
    })
    .await;
    assert_eq!(e.protocol, "dns");
    assert!(
        e.rule.contains("removed 127.0.0.1 (blocked: loopback)"),
        "{e:?}"
    );
    let e = entry(&c, &id, "other.test", |e| {
        e.dest_name.as_deref() == Some("other.test")
    })
    .await;
    assert_eq!(
        (e.verdict, e.rule.as_str()),
        (Verdict::Deny, "default deny (allowlist)")
    );
    let e = entry(&c, &id, "the banner", |e| e.dest_port == 7000).await;
    assert_eq!(
        e.rule,
        format!("rules[2] allow {}/28 port 7000-7001", up.ip2(0))
    );
    // Filters: verdict and time.
    let denied = c
        .network_audit(&[
            ("sandbox", id.clone()),
            ("verdict", "deny".into()),
            ("limit", "1000".into()),
        ])
        .await
        .unwrap()
        .items;
    assert!(denied.len() >= 10 && denied.iter().all(|e| e.verdict == Verdict::Deny));
    let future = c
        .network_audit(&[("since", (e.at_ms + 3_600_000).to_string())])
        .await
        .unwrap();
    assert!(future.items.is_empty());
    assert!(
        c.network_audit(&[("verdict", "maybe".into())])
            .await
            .is_err()
    );
    // Another owner sees none of it.
    let other = d.owner("mallory").await;
    assert!(other.network_audit(&[]).await.unwrap().items.is_empty());
    assert_eq!(
        other.get_network(&id).await.unwrap_err().status(),
        Some(404)
    );
    assert_eq!(
        other.set_network(&id, &p).await.unwrap_err().status(),
        Some(404)
    );
    // Egress counts in the usage.
    let usage: serde_json::Value = http()
        .get(format!("{}/v1/sandboxes/{id}/usage", d.url))
        .bearer_auth(&d.key)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(usage["egress_bytes"].as_u64().unwrap() > 100, "{usage}");
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_policy_changes_none_mode_and_bad_policies() {
    let up = Upstream::start(&[("allowed.test", "@2"), ("other.test", "@3")]);
    let d = daemon(&up, "").await;
    let c = d.client();
    // The default mode is `none`: no route at all.
    let id = create_small(&c, None).await;
    assert_eq!(
        c.get_network(&id).await.unwrap(),
        policy(NetworkMode::None, vec![])
    );
    let routes = sh(&c, &id, "tail -n +2 /proc/net/route | wc -l").await;
    assert_eq!(routes.stdout.trim(), "0");
    let t = tcp_line(&c, &id, &up.ip(2), 80).await;
    assert!(t.contains("Network is unreachable"), "{t}");
    assert_eq!(curl(&c, &id, "http://allowed.test/").await, "000 rc=6");
    // Root in the sandbox cannot give itself a route.
    let r = sandpit_tests::sh_root(
        &c,
        &id,
        &format!(
            "ip link set eth0 up 2>&1; ip route add default via {} 2>&1; tail -n +2 /proc/net/route | wc -l",
            up.ip(1)
        ),
    )
    .await;
    assert!(r.stdout.trim().ends_with('0'), "{}", r.stdout);

    // Open, with a deny by address and one by name.
    c.set_network(
        &id,
        &policy(
            NetworkMode::Open,
            vec![
                NetworkRule {
                    cidr: Some(format!("{}/32", up.ip(3))),
                    ..network_rule(RuleAction::Deny)
                },
                NetworkRule {
                    domain: Some("other.test".into()),
                    ..network_rule(RuleAction::Deny)
                },
            ],
        ),
    )
    .await
    .unwrap();
    assert_eq!(curl(&c, &id, "http://allowed.test/").await, "200 rc=0");
    assert_eq!(
        curl(&c, &id, &format!("http://{}/", up.ip(4))).await,
        "200 rc=0"
    );
    assert_eq!(
        curl(&c, &id, &format!("http://{}/", up.ip(3))).await,
        "403 rc=0"
    );
    assert_eq!(curl(&c, &id, "http://other.test/").await, "000 rc=6");
    assert_eq!(curl(&c, &id, "http://169.254.169.254/").await, "403 rc=0");

    // A live change: a connection open from before stays, new ones follow the policy.
    sh(
        &c,
        &id,
        &format!(
            "python3 -c \"import socket,time\ns=socket.create_connection(('{}',80))\nopen('/tmp/ready','w').close()\ntime.sleep(3)\ns.sendall(b'GET / HTTP/1.1\\r\\nHost: allowed.test\\r\\nConnection: close\\r\\n\\r\\n')\nprint(s.recv(100).decode().split(chr(13))[0])\" > /tmp/long.out 2>&1 &",
            up.ip(2)
        ),
    )
    .await;
    for _ in 0..50 {
        if sh(&c, &id, "test -e /tmp/ready && echo yes")
            .await
            .stdout
            .trim()
            == "yes"
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    c.set_network(
        &id,
        &policy(NetworkMode::Allowlist, vec![allow_domain("other.test")]),
    )
    .await
    .unwrap();
    assert_eq!(curl(&c, &id, "http://allowed.test/").await, "000 rc=6");
    assert_eq!(
        curl(&c, &id, &format!("http://{}/", up.ip(4))).await,
        "403 rc=0"
    );
    assert_eq!(curl(&c, &id, "http://other.test/").await, "200 rc=0");
    tokio::time::sleep(Duration::from_secs(4)).await;
    let long = sh(&c, &id, "cat /tmp/long.out").await.stdout;
    assert_eq!(long.trim(), "HTTP/1.1 200 OK", "{long}");

    // Back to none: the route goes.
    c.set_network(&id, &policy(NetworkMode::None, vec![]))
        .await
        .unwrap();
    let t = tcp_line(&c, &id, &up.ip(3), 80).await;
    assert!(t.contains("Network is unreachable"), "{t}");

    // Bad policies are refused with 400 and change nothing.
    for bad in [
        serde_json::json!({"mode": "sometimes"}),
        serde_json::json!({"mode": "allowlist", "rules": [{"action": "allow"}]}),
        serde_json::json!({"mode": "allowlist", "rules": [{"action": "allow", "domain": "a b"}]}),
        serde_json::json!({"mode": "allowlist", "rules": [{"action": "allow", "cidr": "10.0.0.0/40"}]}),
        serde_json::json!({"mode": "allowlist", "rules": [{"action": "allow", "ports": [0]}]}),
        serde_json::json!({"mode": "allowlist", "rules": [{"action": "deny", "domain": "x.test", "override": true}]}),
        serde_json::json!({"mode": "open", "extra": 1}),
    ] {
        let r = http()
            .put(format!("{}/v1/sandboxes/{id}/network", d.url))
            .bearer_auth(&d.key)
            .json(&bad)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{bad}");
    }
    assert_eq!(
        c.get_network(&id).await.unwrap(),
        policy(NetworkMode::None, vec![])
    );
    let r = c
        .create_sandbox(&CreateSandboxRequest {
            network: Some(policy(
                NetworkMode::Allowlist,
                vec![network_rule(RuleAction::Allow)],
            )),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(r.status(), Some(400));
    assert_eq!(
        c.get_network("nosuchsandbox").await.unwrap_err().status(),
        Some(404)
    );
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_policy_survives_pause_hibernation_fork_snapshot_and_restart() {
    let up = Upstream::start(&[("allowed.test", "@2"), ("other.test", "@3")]);
    let mut d = daemon(&up, "").await;
    let c = d.client();
    let p = policy(NetworkMode::Allowlist, vec![allow_domain("allowed.test")]);
    let id = create_small(&c, Some(p.clone())).await;
    let works = |c: Client, id: String| async move {
        assert_eq!(
            curl(&c, &id, "http://allowed.test/").await,
            "200 rc=0",
            "{id}"
        );
        assert_eq!(
            curl(&c, &id, "http://other.test/").await,
            "000 rc=6",
            "{id}"
        );
        assert_eq!(c.get_network(&id).await.unwrap().rules.len(), 1);
    };
    works(c.clone(), id.clone()).await;

    c.pause(&id).await.unwrap();
    assert_eq!(c.get_network(&id).await.unwrap(), p);
    c.resume(&id).await.unwrap();
    works(c.clone(), id.clone()).await;

    assert_eq!(c.hibernate(&id).await.unwrap().state, "hibernated");
    assert_eq!(c.get_network(&id).await.unwrap(), p);
    c.resume(&id).await.unwrap();
    works(c.clone(), id.clone()).await;

    let forks = c
        .fork(
            &id,
            &ForkRequest {
                count: Some(1),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(forks[0].network, Some(p.clone()));
    works(c.clone(), forks[0].id.clone()).await;

    let snap = c.snapshot(&id, &Default::default()).await.unwrap();
    let restored = c
        .create_sandbox(&CreateSandboxRequest {
            snapshot: Some(snap.id.clone()),
            timeout: Some(600),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(restored.network, Some(p.clone()));
    works(c.clone(), restored.id.clone()).await;

    // A restart re-adopts the sandbox with its link and policy.
    d.stop();
    let d = d.restart().start().await;
    let c = d.client();
    assert_eq!(c.get_network(&id).await.unwrap(), p);
    works(c.clone(), id.clone()).await;
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_left_after_delete_kill9_and_restart() {
    let up = Upstream::start(&[("allowed.test", "@2")]);
    let mut d = daemon(&up, "").await;
    let c = d.client();
    let tag = tag_of(&d);
    let (prefix, table) = (format!("sp{tag}"), format!("sandpit_{tag}"));
    assert!(nft_table_exists(&table));
    // The pool's two, ready ahead.
    assert_eq!(wait_links(&prefix, 2).await.len(), 2);
    let a = create_small(&c, None).await;
    assert_eq!(wait_links(&prefix, 3).await.len(), 3);
    c.delete_sandbox(&a).await.unwrap();
    assert_eq!(wait_links(&prefix, 2).await.len(), 2);

    let b = create_small(
        &c,
        Some(policy(
            NetworkMode::Allowlist,
            vec![allow_domain("allowed.test")],
        )),
    )
    .await;
    assert_eq!(wait_links(&prefix, 3).await.len(), 3);
    d.kill9();
    // The pool's namespaces die with the daemon; the running sandbox keeps its link.
    assert_eq!(wait_links(&prefix, 1).await.len(), 1);
    // A link of this daemon's that nobody holds (as if left by an older run).
    let stray = format!("{prefix}fffe");
    let out = std::process::Command::new("ip")
        .args([
            "link",
            "add",
            &stray,
            "type",
            "veth",
            "peer",
            "name",
            &format!("{prefix}fffd"),
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    // The table of a daemon that is gone for good (no daemon holds its tag, no link).
    let stale = "sandpit_0dead";
    let out = std::process::Command::new("nft")
        .args(["add", "table", "inet", stale])
        .output()
        .unwrap();
    assert!(out.status.success());
    let d = d.restart().start().await;
    let c = d.client();
    assert!(!nft_table_exists(stale));
    let links = wait_links(&prefix, 3).await;
    assert!(!links.contains(&stray), "{links:?}");
    assert_eq!(links.len(), 3, "{links:?}");
    assert_eq!(curl(&c, &b, "http://allowed.test/").await, "200 rc=0");
    assert!(nft_table_exists(&table));
    // A firewall reload that flushes the table: the daemon puts it back.
    let out = std::process::Command::new("nft")
        .args(["delete", "table", "inet", &table])
        .output()
        .unwrap();
    assert!(out.status.success());
    for _ in 0..300 {
        if nft_table_exists(&table) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(nft_table_exists(&table), "the table was not applied again");
    assert_eq!(curl(&c, &b, "http://allowed.test/").await, "200 rc=0");
    assert_eq!(curl(&c, &b, "http://169.254.169.254/").await, "403 rc=0");
    d.shutdown().await;
    assert_eq!(wait_links(&prefix, 0).await, Vec::<String>::new());
    assert!(!nft_table_exists(&table));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_exceptions_and_networking_off() {
    let up = Upstream::start(&[("private.test", "10.1.2.3"), ("allowed.test", "@2")]);
    let d = daemon(
        &up,
        "default_mode = \"open\"\n[[network.operator_allow]]\ncidr = \"10.1.2.0/24\"\nports = [443]\n",
    )
    .await;
    let c = d.client();
    let id = create_small(&c, None).await;
    assert_eq!(c.get_network(&id).await.unwrap().mode, NetworkMode::Open);
    // Only resolution: nothing is sent to the private address.
    let r = sh(&c, &id, "getent hosts private.test").await;
    assert!(r.stdout.contains("10.1.2.3"), "{}", r.stdout);
    assert_eq!(curl(&c, &id, "http://allowed.test/").await, "200 rc=0");
    d.shutdown().await;

    let d = Daemon::builder()
        .config("[network]\nenabled = false\n")
        .start()
        .await;
    let c = d.client();
    let id = create_small(&c, None).await;
    let devs = sh(&c, &id, "cat /proc/net/dev").await.stdout;
    assert!(devs.contains("lo:") && !devs.contains("eth0"), "{devs}");
    assert_eq!(c.get_sandbox(&id).await.unwrap().network, None);
    assert_eq!(c.get_network(&id).await.unwrap_err().status(), Some(501));
    let r = c
        .create_sandbox(&CreateSandboxRequest {
            network: Some(policy(NetworkMode::Open, vec![])),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(r.status(), Some(400));
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_audit_streams_live() {
    use futures::StreamExt;
    let up = Upstream::start(&[("allowed.test", "@2")]);
    let d = daemon(&up, "").await;
    let c = d.client();
    let id = create_small(
        &c,
        Some(policy(
            NetworkMode::Allowlist,
            vec![allow_domain("allowed.test")],
        )),
    )
    .await;
    let resp = http()
        .get(format!("{}/v1/network/audit/stream?sandbox={id}", d.url))
        .bearer_auth(&d.key)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.bytes_stream();
    assert_eq!(curl(&c, &id, "http://allowed.test/").await, "200 rc=0");
    assert_eq!(curl(&c, &id, "http://169.254.169.254/").await, "403 rc=0");
    let mut text = String::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let ended = |t: &str| {
        t.match_indices("\"ended_at_ms\":")
            .any(|(i, m)| t[i + m.len()..].starts_with(|c: char| c.is_ascii_digit()))
    };
    while !(text.contains("\"dest_ip\":\"169.254.169.254\"") && ended(&text)) {
        let chunk = tokio::time::timeout_at(deadline, body.next())
            .await
            .expect("audit events in time")
            .expect("stream open")
            .unwrap();
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(text.contains("event: audit"), "{text}");
    assert!(text.contains("\"http_host\":\"allowed.test\""), "{text}");
    assert!(text.contains("\"verdict\":\"deny\""), "{text}");
    // An open stream does not keep the daemon from stopping; it ends.
    d.shutdown().await;
    let ended = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(Ok(_)) = body.next().await {}
    })
    .await;
    assert!(ended.is_ok(), "the stream outlived the daemon");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_pool_sandbox_takes_the_policy_of_its_claim() {
    let up = Upstream::start(&[("allowed.test", "@2"), ("other.test", "@3")]);
    let d = daemon(&up, "").await;
    let c = d.client();
    c.create_pool(&sandpit_api::PoolSpec {
        name: "warm".into(),
        limits: small(),
        size: 1,
        ..Default::default()
    })
    .await
    .unwrap();
    for _ in 0..300 {
        if c.get_pool("warm").await.unwrap().ready == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let p = policy(NetworkMode::Allowlist, vec![allow_domain("allowed.test")]);
    let sb = c
        .create_sandbox(&CreateSandboxRequest {
            limits: small(),
            timeout: Some(600),
            network: Some(p.clone()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(
        sb.pool.as_deref(),
        Some("warm"),
        "not claimed from the pool"
    );
    assert_eq!(sb.network, Some(p));
    assert_eq!(curl(&c, &sb.id, "http://allowed.test/").await, "200 rc=0");
    assert_eq!(curl(&c, &sb.id, "http://other.test/").await, "000 rc=6");
    // A claim without a policy gets the daemon's default (none): no route.
    for _ in 0..300 {
        if c.get_pool("warm").await.unwrap().ready == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let plain = c
        .create_sandbox(&CreateSandboxRequest {
            limits: small(),
            timeout: Some(600),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(plain.pool.as_deref(), Some("warm"));
    assert_eq!(plain.network.map(|n| n.mode), Some(NetworkMode::None));
    let t = tcp_line(&c, &plain.id, &up.ip(2), 80).await;
    assert!(t.contains("Network is unreachable"), "{t}");
    d.shutdown().await;
}
