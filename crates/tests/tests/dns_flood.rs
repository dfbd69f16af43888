//! The sandboxes' resolver under a flood: one sandbox sends UDP questions for fresh names
//! of a zone whose name server never answers as fast as it can, and holds hundreds of
//! DNS-over-TCP connections open. The daemon's descriptors stay bounded, another owner's
//! sandbox keeps working (its lookups too), the API keeps answering, the flooder can
//! resolve again afterwards, and the audit gets a few summaries instead of a row per
//! dropped question. The "internet" is a namespace the test makes (see `netfix`).

use sandpit_api::NetworkAuditEntry;
use sandpit_api::network::{NetworkMode, NetworkPolicy, Verdict};
use sandpit_tests::netfix::Upstream;
use sandpit_tests::{Daemon, FdSampler, create_small, dns_lookup, open_fds, sh};
use std::time::{Duration, Instant};

/// How long the flood lasts, in seconds.
const FLOOD_SECS: f64 = 3.5;
/// TCP connections the flooder opens (and holds) before it starts sending.
const TCP_CONNS: usize = 300;
/// The most descriptors the daemon may have open during the flood. With the defaults the
/// resolver holds at most 256 upstream sockets and 256 DNS-over-TCP connections in all
/// (one sandbox: 64 and 16); the daemon idles at ~50. Unbounded, the flood took it to its
/// descriptor limit within a second (one upstream socket per question, each held for the
/// 2 s upstream timeout).
const MAX_FDS: usize = 1000;

/// The flooder: opens `TCP_CONNS` connections to the resolver, then sends questions for
/// random names under blackhole.test for `FLOOD_SECS` from one socket (at most 500,000),
/// then prints how many it sent, how many connections it opened, and how many of those
/// the daemon had closed.
const FLOOD: &str = r#"
import os, random, socket, struct, sys, time
gw, secs, nconn = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
tcp = []
for _ in range(nconn):
    try:
        tcp.append(socket.create_connection((gw, 53), timeout=2))
    except OSError:
        pass
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setblocking(False)
tail = b'\x09blackhole\x04test\x00' + struct.pack('!HH', 1, 1)
end = time.monotonic() + secs
sent = 0
while sent < 500000 and time.monotonic() < end:
    q = struct.pack('!HHHHHH', random.getrandbits(16), 0x0100, 1, 0, 0, 0) + b'\x10' + os.urandom(8).hex().encode() + tail
    try:
        s.sendto(q, (gw, 53))
        sent += 1
    except OSError:
        pass
closed = 0
for c in tcp:
    c.setblocking(False)
    try:
        if c.recv(1) == b'':
            closed += 1
    except BlockingIOError:
        pass
    except OSError:
        closed += 1
print(sent, len(tcp), closed)
"#;

fn open() -> Option<NetworkPolicy> {
    Some(NetworkPolicy {
        mode: NetworkMode::Open,
        rules: vec![],
    })
}

/// The number of questions a drop summary counts ("... dropped N queries ...").
fn dropped_in(e: &NetworkAuditEntry) -> Option<u64> {
    let rest = e.rule.strip_prefix("dns limits: dropped ")?;
    rest.split_whitespace().next()?.parse().ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dns_flood_is_bounded_and_summarized() {
    let up = Upstream::start(&[("legit.test", "@2")]);
    let d = Daemon::builder().config(&up.config("")).start().await;
    let pid = d.pid();
    let c = d.client();
    let bob = d.owner("bob").await;

    let flooder = create_small(&c, open()).await;
    let other = create_small(&bob, open()).await;
    assert_eq!(
        dns_lookup(&c, &flooder, "legit.test", 3).await,
        "rcode 0 answers 1"
    );
    assert_eq!(
        dns_lookup(&bob, &other, "legit.test", 3).await,
        "rcode 0 answers 1"
    );
    let idle_fds = open_fds(pid);

    // The daemon's descriptors, sampled every 10 ms while the flood runs.
    let sampler = FdSampler::start(pid);
    let started = Instant::now();
    let flood = {
        let (c, id) = (c.clone(), flooder.clone());
        tokio::spawn(async move {
            sh(
                &c,
                &id,
                &format!(
                    "gw=$(awk '/nameserver/ {{print $2}}' /etc/resolv.conf); python3 - \"$gw\" {FLOOD_SECS} {TCP_CONNS} <<'EOF'\n{FLOOD}\nEOF"
                ),
            )
            .await
        })
    };
    // Meanwhile the other owner's sandbox answers commands and resolves names, and the
    // API serves authenticated requests.
    let mut rounds = 0;
    while !flood.is_finished() {
        let r = sh(&bob, &other, "echo alive").await;
        assert_eq!(r.stdout.trim(), "alive", "{r:?}");
        assert_eq!(bob.get_sandbox(&other).await.unwrap().state, "running");
        assert_eq!(c.get_sandbox(&flooder).await.unwrap().state, "running");
        // Retried like a stub resolver would: the flood can outpace the daemon's reads of
        // the shared socket, and the kernel then drops datagrams of every sender alike.
        if rounds == 2 {
            assert_eq!(
                dns_lookup(&bob, &other, "legit.test", 4).await,
                "rcode 0 answers 1",
                "the other owner's lookup during the flood"
            );
        }
        rounds += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let out = flood.await.unwrap();
    let flood_secs = started.elapsed().as_secs_f64();
    let max_fds = sampler.finish();
    assert_eq!(out.exit_code, 0, "{out:?}");
    let nums: Vec<usize> = out
        .stdout
        .split_whitespace()
        .map(|n| n.parse().unwrap())
        .collect();
    let (sent, opened, closed) = (nums[0], nums[1], nums[2]);
    eprintln!(
        "flood: {sent} questions, {opened} TCP connections ({closed} closed by the daemon), \
         {rounds} rounds of the other sandbox, fds {idle_fds} idle, {max_fds} at most"
    );
    assert!(sent >= 10_000, "the flood hardly ran: {sent} questions");
    assert!(
        max_fds < MAX_FDS,
        "the daemon had {max_fds} descriptors open during the flood"
    );
    // The resolver keeps 16 connections of a sandbox at most and closes the rest at once.
    assert!(opened >= 200, "{opened} TCP connections opened");
    assert!(
        opened - closed <= 16,
        "{opened} TCP connections opened, only {closed} closed by the daemon"
    );

    // Afterwards: both sandboxes run, the flooder resolves again once its questions in
    // flight have timed out.
    let r = sh(&bob, &other, "echo alive").await;
    assert_eq!(r.stdout.trim(), "alive");
    assert_eq!(bob.get_sandbox(&other).await.unwrap().state, "running");
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        dns_lookup(&c, &flooder, "legit.test", 5).await,
        "rcode 0 answers 1"
    );

    // The audit: a summary per second with drops, not a row per dropped question.
    let mut summaries = Vec::new();
    let mut rows = Vec::new();
    for _ in 0..50 {
        rows = c
            .network_audit(&[("sandbox", flooder.clone()), ("limit", "1000".into())])
            .await
            .expect("audit")
            .items;
        summaries = rows
            .iter()
            .filter(|e| dropped_in(e).is_some())
            .cloned()
            .collect();
        if !summaries.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        !summaries.is_empty(),
        "no drop summary: {:#?}",
        &rows[..rows.len().min(20)]
    );
    let dropped: u64 = summaries.iter().filter_map(dropped_in).sum();
    eprintln!(
        "audit: {} rows, {} summaries counting {dropped} dropped questions; first: {}",
        rows.len(),
        summaries.len(),
        summaries[0].rule
    );
    for e in &summaries {
        assert_eq!(
            (e.protocol.as_str(), e.verdict),
            ("dns", Verdict::Deny),
            "{e:?}"
        );
    }
    assert!(dropped >= 1000, "{dropped} questions counted as dropped");
    assert!(
        dropped <= sent as u64 + opened as u64,
        "{dropped} > {sent} sent"
    );
    assert!(
        summaries.len() as f64 <= flood_secs + 3.0,
        "{} summaries for a {flood_secs:.1} s flood",
        summaries.len()
    );
    assert!(rows.len() < 1000, "{} audit rows", rows.len());
    // The other owner sees none of it.
    let theirs = bob
        .network_audit(&[("limit", "1000".into())])
        .await
        .unwrap();
    assert!(theirs.items.iter().all(|e| e.sandbox_id == other));

    d.shutdown().await;
}
