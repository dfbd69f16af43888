//! The network audit under a flood: a sandbox sending DNS questions for random names as
//! fast as it can neither hides its own refused connection nor another owner's, its
//! repeats and drops are counted in summary rows, and the store grows within the bound
//! the README gives. The "internet" is a network namespace the test makes (see `netfix`);
//! the flood goes only to the daemon's resolver on the sandbox's gateway and lasts 3 s.

use sandpit_api::network::{NetworkMode, NetworkPolicy, Verdict};
use sandpit_client::Client;
use sandpit_tests::netfix::Upstream;
use sandpit_tests::{Daemon, allow_domain, audit_entries, create_small, sh};
use std::path::Path;
use std::time::Duration;

/// The daemon's `[network] audit_rows_per_sandbox_per_minute` in this test.
const ROWS_PER_MINUTE: u64 = 40;
/// Summary rows a sandbox can add in a minute besides (drops per protocol, verdict and
/// reason), as the README counts them.
const SUMMARIES_PER_MINUTE: u64 = 8;
/// The README's bound on a row's size (indexes included), with the longest names.
const BYTES_PER_ROW: u64 = 1024;
/// The README's allowance for SQLite's write-ahead log (checkpointed every 1000 pages).
const WAL_BYTES: u64 = 4 << 20;

/// A small sandbox allowed to reach `allowed.test` only; its id.
async fn create(c: &Client) -> String {
    let policy = NetworkPolicy {
        mode: NetworkMode::Allowlist,
        rules: vec![allow_domain("allowed.test")],
    };
    create_small(c, Some(policy)).await
}

fn db_bytes(dir: &Path) -> u64 {
    ["sandpit.db", "sandpit.db-wal"]
        .iter()
        .map(|f| std::fs::metadata(dir.join(f)).map(|m| m.len()).unwrap_or(0))
        .sum()
}

/// A refused HTTP connection to `ip`:80 from the sandbox, `delay` seconds in: what came
/// back (the proxy's 403) or the error.
fn connect_script(ip: &str, host: &str) -> String {
    format!(
        "def connect():\n time.sleep(DELAY)\n try:\n  c=socket.create_connection(('{ip}',80),timeout=5)\n  c.sendall(b'GET / HTTP/1.1\\r\\nHost: {host}\\r\\n\\r\\n')\n  c.settimeout(5)\n  out.append(c.recv(200).split(b'\\r\\n')[0].decode())\n except Exception as e:\n  out.append('ERR %s' % e)\n"
    )
}

/// Sends DNS questions (A, for random names under flood.test, every tenth for the same
/// name) to the sandbox's resolver as fast as it can for 3 s, making the refused
/// connection 1.5 s in; prints how many it sent and what the connection got.
fn flood_script(ip: &str) -> String {
    format!(
        "import socket,struct,random,string,threading,time\n\
         out=[]\nDELAY=1.5\n\
         {connect}\
         ns=[l.split()[1] for l in open('/etc/resolv.conf') if l.startswith('nameserver')][0]\n\
         s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n\
         s.setblocking(False)\n\
         def q(i,name):\n return struct.pack('!HHHHHH',i&0xffff,0x0100,1,0,0,0)+b''.join(bytes([len(l)])+l.encode() for l in name.split('.'))+b'\\0'+struct.pack('!HH',1,1)\n\
         t=threading.Thread(target=connect)\nt.start()\n\
         n=0\nend=time.time()+3\n\
         while time.time()<end:\n\
         \x20name='same.flood.test' if n%10==0 else ''.join(random.choice(string.ascii_lowercase) for _ in range(12))+'.flood.test'\n\
         \x20try:\n  s.sendto(q(n,name),(ns,53))\n  n+=1\n except (BlockingIOError,OSError):\n  pass\n\
         \x20try:\n  while True:\n   s.recv(4096)\n except (BlockingIOError,OSError):\n  pass\n\
         t.join()\nprint(n,out[0])\n",
        connect = connect_script(ip, "mid-flood.test"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dns_flood_hides_no_connection_and_the_store_stays_bounded() {
    let up = Upstream::start(&[("allowed.test", "@2")]);
    let d = Daemon::builder()
        .config(&up.config(&format!(
            "audit_rows_per_sandbox_per_minute = {ROWS_PER_MINUTE}"
        )))
        .start()
        .await;
    let c = d.client();
    let other = d.owner("mallory").await;
    let a = create(&c).await;
    let b = create(&other).await;
    // Both can reach the resolver and are refused elsewhere before the flood starts.
    let warm = sh(&c, &a, "getent hosts allowed.test >/dev/null; echo $?").await;
    assert_eq!(warm.stdout.trim(), "0", "{warm:?}");

    let before = db_bytes(d.data.path());
    let flood = {
        let c = c.clone();
        let a = a.clone();
        let script = flood_script(&up.ip(3));
        tokio::spawn(async move { sh(&c, &a, &format!("python3 -c \"{script}\"")).await })
    };
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let b_script = format!(
        "import socket,time\nout=[]\nDELAY=0\n{}connect()\nprint(out[0])\n",
        connect_script(&up.ip(4), "other-owner.test")
    );
    let b_run = sh(&other, &b, &format!("python3 -c \"{b_script}\"")).await;
    let a_run = flood.await.unwrap();
    assert_eq!(a_run.exit_code, 0, "{a_run:?}");
    let (sent, got) = a_run
        .stdout
        .trim()
        .split_once(' ')
        .expect("count and reply");
    let sent: u64 = sent.parse().unwrap();
    assert!(
        got.contains("403"),
        "the refused connection mid-flood: {a_run:?}"
    );
    assert!(b_run.stdout.contains("403"), "{b_run:?}");
    // The flood is far more than the sandbox's rows a minute: most of it must be dropped.
    assert!(sent > 10 * ROWS_PER_MINUTE, "only {sent} questions sent");

    // Both refused connections are in the audit.
    let a_rows = audit_entries(&c, &a).await;
    let mid = a_rows
        .iter()
        .find(|e| e.protocol == "tcp" && e.dest_ip.as_deref() == Some(up.ip(3).as_str()))
        .unwrap_or_else(|| panic!("A's connection mid-flood is not in the audit: {a_rows:#?}"));
    assert_eq!(mid.verdict, Verdict::Deny);
    assert_eq!(mid.http_host.as_deref(), Some("mid-flood.test"));
    let b_rows = audit_entries(&other, &b).await;
    let e = b_rows
        .iter()
        .find(|e| e.protocol == "tcp" && e.dest_ip.as_deref() == Some(up.ip(4).as_str()))
        .unwrap_or_else(|| panic!("B's connection is not in the audit: {b_rows:#?}"));
    assert_eq!(e.verdict, Verdict::Deny);
    assert_eq!(e.http_host.as_deref(), Some("other-owner.test"));
    assert!(
        b_rows.iter().all(|e| !e.rule.contains("dropped")),
        "{b_rows:#?}"
    );

    // The flood is summarised: the drops in a counted row, the repeats in one row each.
    let dropped: u64 = a_rows
        .iter()
        .filter(|e| e.protocol == "dns" && e.rule.ends_with("dropped (rate limit)"))
        .map(|e| {
            assert_eq!(e.rule, format!("{} entries dropped (rate limit)", e.count));
            e.count
        })
        .sum();
    assert!(dropped > 0, "no drop summary: {a_rows:#?}");
    let same: Vec<_> = a_rows
        .iter()
        .filter(|e| e.dest_name.as_deref() == Some("same.flood.test"))
        .collect();
    assert!(
        !same.is_empty() && same.len() <= 2 && same.iter().any(|e| e.count > 1),
        "the repeated name is not aggregated: {same:#?}"
    );
    assert!(same.iter().all(|e| e.verdict == Verdict::Deny));
    // At most two minutes' worth of rows (the flood may straddle a minute's end).
    let bound_rows = 2 * (ROWS_PER_MINUTE + SUMMARIES_PER_MINUTE);
    assert!(
        a_rows.len() as u64 <= bound_rows,
        "{} rows for A, more than {bound_rows}",
        a_rows.len()
    );
    let counted: u64 = a_rows.iter().map(|e| e.count).sum();
    assert!(counted > a_rows.len() as u64, "{counted}");

    // The store grew within the documented bound: rows of both sandboxes, plus the log.
    let grown = db_bytes(d.data.path()).saturating_sub(before);
    let bound = 2 * bound_rows * BYTES_PER_ROW + WAL_BYTES;
    eprintln!(
        "flood: {sent} questions, {} rows for A ({counted} attempts, {dropped} dropped), store grew {grown} bytes (bound {bound})",
        a_rows.len()
    );
    assert!(
        grown < bound,
        "the store grew by {grown} bytes for a {sent}-question flood, more than {bound}"
    );

    d.shutdown().await;
}
