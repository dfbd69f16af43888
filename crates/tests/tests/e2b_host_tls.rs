//! The host form over TLS: a daemon serving the certificate `sandpit tls init` made, and
//! E2B's Python SDK (pinned in `target/test-venv`) using it as it uses E2B's cloud:
//! `E2B_DOMAIN` and an https `E2B_API_URL`, no `E2B_SANDBOX_URL`, so that every call goes
//! to `https://{port}-{id}.{domain}` (`tests/e2b/python/test_host_form.py`).
//!
//! The names resolve through a resolver the test controls: `dnsmasq` (installed by
//! `scripts/setup.sh --test`) answers `127.0.0.1` for the domain on a loopback address of
//! its own and refuses every other name (it has no upstream), and the SDK runs in a mount
//! namespace of its own whose `/etc/resolv.conf` names only that address. No packet
//! leaves loopback.

use sandpit_tests::{Daemon, free_port, sandpit_bin, temp_dir, test_tool};
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The domain of the test's sandboxes (`.test` is reserved: never a real name).
const DOMAIN: &str = "sandboxes.sandpit.test";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `sandpit tls init` into `dir`: its printed instructions, checked for what a team needs.
fn tls_init(dir: &Path) -> String {
    let out = Command::new(sandpit_bin())
        .args(["tls", "init", "--domain", DOMAIN, "--out"])
        .arg(dir)
        .output()
        .expect("run sandpit tls init");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "tls init failed: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for want in [
        format!("*.{DOMAIN}.  A"),
        "update-ca-certificates".to_string(),
        "SSL_CERT_FILE".to_string(),
        "REQUESTS_CA_BUNDLE".to_string(),
        "NODE_EXTRA_CA_CERTS".to_string(),
        format!("E2B_DOMAIN={DOMAIN}"),
    ] {
        assert!(text.contains(&want), "{want:?} missing from:\n{text}");
    }
    let mode = |f: &str| {
        std::fs::metadata(dir.join(f))
            .expect("a file tls init wrote")
            .permissions()
            .mode()
            & 0o777
    };
    assert_eq!(mode("key.pem"), 0o600);
    assert_eq!(mode("cert.pem"), 0o644);
    assert_eq!(mode("ca.pem"), 0o644);
    // A second run keeps the pair a daemon may be serving.
    let again = Command::new(sandpit_bin())
        .args(["tls", "init", "--domain", DOMAIN, "--out"])
        .arg(dir)
        .output()
        .expect("run sandpit tls init");
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("--force"));
    text
}

/// A DNS stub on its own loopback address: the domain and its subdomains are 127.0.0.1,
/// every other name is refused (no upstream servers). Killed when dropped.
struct Dns {
    child: Child,
    addr: String,
}

impl Dns {
    fn start() -> Dns {
        let dnsmasq = ["/usr/sbin/dnsmasq", "/usr/bin/dnsmasq"]
            .into_iter()
            .find(|p| Path::new(p).exists())
            .expect("dnsmasq is missing: run scripts/setup.sh --test (Debian's dnsmasq-base)");
        // 127.0.0.0/8 is all loopback: a random address keeps parallel runs apart.
        let pid = std::process::id();
        let addr = format!("127.53.{}.{}", (pid >> 8) % 250 + 1, pid % 250 + 2);
        let mut child = Command::new(dnsmasq)
            .args([
                "--keep-in-foreground",
                "--conf-file=/dev/null",
                "--no-resolv",
                "--no-hosts",
                "--no-poll",
                "--bind-interfaces",
                "--port=53",
                "--user=root",
                "--log-facility=-",
            ])
            .arg(format!("--listen-address={addr}"))
            .arg(format!("--address=/{DOMAIN}/127.0.0.1"))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start dnsmasq");
        // Ready once it answers; it exits at once if the address cannot be bound.
        for _ in 0..100 {
            if let Ok(Some(status)) = child.try_wait() {
                let mut err = String::new();
                if let Some(mut e) = child.stderr.take() {
                    let _ = e.read_to_string(&mut err);
                }
                panic!("dnsmasq exited ({status}): {err}");
            }
            let sock = std::net::UdpSocket::bind("127.0.0.1:0").expect("udp socket");
            sock.set_read_timeout(Some(Duration::from_millis(100)))
                .expect("timeout");
            if sock
                .send_to(&dns_query(&format!("api.{DOMAIN}")), format!("{addr}:53"))
                .is_ok()
            {
                let mut buf = [0u8; 512];
                if let Ok((n, _)) = sock.recv_from(&mut buf)
                    && n >= 4
                    && buf[3] & 0x0f == 0
                {
                    return Dns { child, addr };
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        panic!("dnsmasq did not answer on {addr}:53");
    }
}

impl Drop for Dns {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A DNS query for the A record of `name`.
fn dns_query(name: &str) -> Vec<u8> {
    let mut q = vec![0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
    for label in name.split('.') {
        q.push(label.len() as u8);
        q.extend_from_slice(label.as_bytes());
    }
    q.extend_from_slice(&[0, 0, 1, 0, 1]);
    q
}

/// Runs `cmd` (program and arguments) in a mount namespace whose `/etc/resolv.conf` is
/// `resolv`; returns whether it succeeded and its output.
fn run_with_resolver(resolv: &Path, envs: &[(&str, String)], cmd: &[String]) -> (bool, String) {
    let mut c = Command::new("unshare");
    c.args(["--mount", "--propagation", "private", "sh", "-c"])
        .arg(r#"mount --bind "$0" /etc/resolv.conf && exec "$@""#)
        .arg(resolv)
        .args(cmd)
        .current_dir(repo())
        .env_remove("E2B_SANDBOX_URL")
        .env_remove("E2B_DEBUG")
        .env_remove("E2B_ACCESS_TOKEN")
        .env_remove("SSL_CERT_DIR")
        .env_remove("REQUESTS_CA_BUNDLE");
    for (k, v) in envs {
        c.env(k, v);
    }
    let out = c.output().expect("run under unshare");
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[tokio::test(flavor = "multi_thread")]
async fn the_python_sdk_works_in_host_form_over_tls() {
    let certs = temp_dir("sandpit-tls-");
    tls_init(certs.path());
    let (ca, cert, key) = (
        certs.path().join("ca.pem"),
        certs.path().join("cert.pem"),
        certs.path().join("key.pem"),
    );
    let port = free_port();
    let d = Daemon::builder()
        .port(port)
        .config(&format!("[proxy]\ndomain = \"{DOMAIN}:{port}\"\n"))
        .args(&[
            "--tls-cert",
            cert.to_str().expect("utf-8 path"),
            "--tls-key",
            key.to_str().expect("utf-8 path"),
        ])
        .tls_probe(&ca, &format!("api.{DOMAIN}"))
        .start()
        .await;
    assert_eq!(d.url, format!("https://api.{DOMAIN}:{port}"));

    // Plain HTTP on the TLS port gets no HTTP answer.
    let mut plain = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    plain
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    plain
        .write_all(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\n")
        .expect("write");
    let mut answer = Vec::new();
    let _ = plain.read_to_end(&mut answer);
    assert!(
        !answer.starts_with(b"HTTP/"),
        "plain HTTP was answered: {answer:?}"
    );

    let dns = Dns::start();
    let resolv = certs.path().join("resolv.conf");
    std::fs::write(&resolv, format!("nameserver {}\n", dns.addr)).expect("write resolv.conf");

    // The resolver answers the domain, and nothing else.
    let getent = |name: &str| {
        run_with_resolver(
            &resolv,
            &[],
            &["getent".into(), "ahostsv4".into(), name.into()],
        )
    };
    let (ok, text) = getent(&format!("49983-abc.{DOMAIN}"));
    assert!(ok && text.contains("127.0.0.1"), "{text}");
    let (ok, _) = getent("example.com");
    assert!(!ok, "a name outside the domain resolved");

    let envs = [
        ("E2B_API_KEY", d.key.clone()),
        ("E2B_API_URL", d.url.clone()),
        ("E2B_DOMAIN", format!("{DOMAIN}:{port}")),
        ("SSL_CERT_FILE", ca.display().to_string()),
    ];
    let pytest = test_tool("pytest").display().to_string();
    let (ok, text) = run_with_resolver(
        &resolv,
        &envs,
        &[
            pytest,
            "-q".into(),
            "-p".into(),
            "no:cacheprovider".into(),
            "tests/e2b/python/test_host_form.py".into(),
        ],
    );
    println!("{text}");
    drop(dns);
    // The test harness cleans up over plain HTTP: the same data directory and port served
    // without TLS removes whatever a failed scenario left.
    d.restart().start().await.shutdown().await;
    assert!(ok, "the host-form scenarios failed:\n{text}");
    assert!(text.contains("5 passed"), "{text}");
    assert!(!text.contains("skipped"), "{text}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_key_others_can_read_stops_the_start() {
    let certs = temp_dir("sandpit-tls-");
    tls_init(certs.path());
    let key = certs.path().join("key.pem");
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let (status, stderr, _data) = Daemon::builder()
        .config_file(&format!(
            "[tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\n",
            certs.path().join("cert.pem").display(),
            key.display()
        ))
        .start_failing();
    assert!(!status.success());
    assert!(
        stderr.contains("chmod 600") && stderr.contains("key.pem"),
        "{stderr}"
    );
    // Half a pair is refused too, by the flags' parser.
    let (status, stderr, _data) = Daemon::builder()
        .args(&["--tls-cert", "/nonexistent/cert.pem"])
        .start_failing();
    assert!(!status.success());
    assert!(stderr.contains("--tls-key"), "{stderr}");
}
