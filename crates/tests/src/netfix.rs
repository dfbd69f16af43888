//! A network namespace the tests make as the sandboxes' "internet": a veth link to the
//! host, documentation addresses routed into it, and test servers inside (DNS, HTTP,
//! HTTPS, a server-first banner). Nothing ever leaves this machine: the servers bind
//! inside the namespace, and the host routes only the test's own slices of the
//! documentation ranges there.

use std::io::BufRead;
use std::os::fd::AsRawFd;
use std::process::{Child, Command, Stdio};

const SCRIPT: &str = include_str!("upstream.py");
/// Slices of 203.0.113.0/24 and 198.51.100.0/24 (16 addresses each), one per fixture.
const SLICES: u8 = 16;

fn run(args: &[&str]) {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .expect("run a network setup command");
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A test upstream network; removed (namespace, link, routes, servers) when dropped.
pub struct Upstream {
    pub ns: String,
    pub slice: u8,
    server: Option<Child>,
    /// Certificates, keys and the request log.
    dir: tempfile::TempDir,
    _lock: std::fs::File,
}

impl Upstream {
    /// Makes the namespace and starts its servers; `dns` maps names to addresses (`@N`:
    /// address N of the slice, see [`Upstream::ip`]; `@@N`: see [`Upstream::ip2`]).
    pub fn start(dns: &[(&str, &str)]) -> Upstream {
        std::fs::create_dir_all("/run/sandpit-tests").expect("lock dir");
        let (slice, lock) = (0..SLICES)
            .find_map(|s| {
                let f = std::fs::OpenOptions::new()
                    .create(true)
                    .truncate(false)
                    .write(true)
                    .open(format!("/run/sandpit-tests/upstream-{s}.lock"))
                    .ok()?;
                // SAFETY: flock on a descriptor we own.
                let r = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
                (r == 0).then_some((s, f))
            })
            .expect("a free upstream slice");
        let ns = format!("sptestup{slice}");
        let host_if = format!("sptestv{slice}");
        // Leftovers of a test killed before its cleanup.
        let _ = Command::new("ip").args(["netns", "del", &ns]).output();
        let _ = Command::new("ip").args(["link", "del", &host_if]).output();
        run(&["ip", "netns", "add", &ns]);
        run(&[
            "ip", "link", "add", &host_if, "type", "veth", "peer", "name", "eth0", "netns", &ns,
        ]);
        let link = |h: u8| format!("198.18.{slice}.{h}");
        run(&[
            "ip",
            "addr",
            "add",
            &format!("{}/30", link(1)),
            "dev",
            &host_if,
        ]);
        run(&["ip", "link", "set", &host_if, "up"]);
        let inside = |args: &[&str]| {
            let mut a = vec!["ip", "-n", ns.as_str()];
            a.extend_from_slice(args);
            run(&a);
        };
        inside(&["addr", "add", &format!("{}/30", link(2)), "dev", "eth0"]);
        inside(&["link", "set", "eth0", "up"]);
        inside(&["link", "set", "lo", "up"]);
        let base = slice * 16;
        for n in 1..16u8 {
            inside(&[
                "addr",
                "add",
                &format!("203.0.113.{}/32", base + n),
                "dev",
                "lo",
            ]);
            inside(&[
                "addr",
                "add",
                &format!("198.51.100.{}/32", base + n),
                "dev",
                "lo",
            ]);
        }
        for net in ["203.0.113", "198.51.100"] {
            run(&[
                "ip",
                "route",
                "add",
                &format!("{net}.{base}/28"),
                "via",
                &link(2),
                "dev",
                &host_if,
            ]);
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let (cert, key) = make_certs(dir.path(), dns);
        // `@N` stands for address N of this slice of 203.0.113.0/24, `@@N` of 198.51.100.0/24.
        let resolve = |v: &str| match (v.strip_prefix("@@"), v.strip_prefix('@')) {
            (Some(n), _) => format!("198.51.100.{}", base + n.parse::<u8>().expect("@@N")),
            (None, Some(n)) => format!("203.0.113.{}", base + n.parse::<u8>().expect("@N")),
            _ => v.to_string(),
        };
        let cfg = serde_json::json!({
            "dns": dns.iter().map(|(k, v)| (k.to_string(), resolve(v))).collect::<std::collections::BTreeMap<_, _>>(),
            "dns_ip": format!("203.0.113.{}", base + 1),
            "cert": cert,
            "key": key,
            "requests": dir.path().join("requests.jsonl"),
            "dns_file": dir.path().join("dns.json"),
        });
        let mut child = Command::new("ip")
            .args(["netns", "exec", &ns, "python3", "-c", SCRIPT])
            .arg(cfg.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the upstream servers");
        let mut line = String::new();
        let out = child.stdout.take().expect("stdout");
        std::io::BufReader::new(out)
            .read_line(&mut line)
            .expect("upstream ready");
        assert_eq!(line.trim(), "ready", "upstream servers did not start");
        Upstream {
            ns,
            slice,
            server: Some(child),
            dir,
            _lock: lock,
        }
    }

    /// Address `n` (1..16) of this upstream's slice of 203.0.113.0/24.
    pub fn ip(&self, n: u8) -> String {
        format!("203.0.113.{}", self.slice * 16 + n)
    }

    /// Address `n` of this upstream's slice of 198.51.100.0/24.
    pub fn ip2(&self, n: u8) -> String {
        format!("198.51.100.{}", self.slice * 16 + n)
    }

    /// From now on the DNS server answers `name` with `addr` (an address, or `@N`/`@@N`
    /// as in [`Upstream::start`]) and this TTL in seconds: a name that moves, as DNS
    /// rebinding or a changed record.
    pub fn set_dns(&self, name: &str, addr: &str, ttl: u32) {
        let addr = match (addr.strip_prefix("@@"), addr.strip_prefix('@')) {
            (Some(n), _) => self.ip2(n.parse().expect("@@N")),
            (None, Some(n)) => self.ip(n.parse().expect("@N")),
            _ => addr.to_string(),
        };
        let path = self.dir.path().join("dns.json");
        let mut all: serde_json::Map<String, serde_json::Value> = std::fs::read_to_string(&path)
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or_default();
        all.insert(name.to_lowercase(), serde_json::json!([addr, ttl]));
        // Written whole, then renamed: the server never reads half a file.
        let tmp = self.dir.path().join("dns.json.tmp");
        std::fs::write(&tmp, serde_json::Value::Object(all).to_string()).expect("write dns.json");
        std::fs::rename(&tmp, &path).expect("rename dns.json");
    }

    /// The DNS server's address.
    pub fn dns(&self) -> String {
        self.ip(1)
    }

    /// The PEM file of the test CA that issued the HTTPS server's certificate (for a
    /// daemon's `[broker] extra_ca_file`, or a client's `--cacert`).
    pub fn ca_file(&self) -> std::path::PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// Every HTTP(S) request the servers answered so far, in order: `host`, `path`,
    /// `method`, `authorization` (null when the request had none), `local` (the server's
    /// address the request came to), `headers` (every header, as `[name, value]` pairs).
    pub fn requests(&self) -> Vec<serde_json::Value> {
        std::fs::read_to_string(self.dir.path().join("requests.jsonl"))
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).expect("a request record"))
            .collect()
    }

    /// The Authorization header values the servers received, in order (requests
    /// without one are left out).
    pub fn seen_authorization(&self) -> Vec<String> {
        self.requests()
            .iter()
            .filter_map(|r| r["authorization"].as_str().map(String::from))
            .collect()
    }

    /// A daemon config file's `[network]` section using this upstream's DNS.
    pub fn config(&self, extra: &str) -> String {
        format!(
            "[network]\nenabled = true\npool_size = 2\ndns_upstream = [\"{}\"]\n{extra}\n",
            self.dns()
        )
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        if let Some(mut c) = self.server.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        // The namespace takes its end of the link, the link takes its routes.
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).output();
        let _ = Command::new("ip")
            .args(["link", "del", &format!("sptestv{}", self.slice)])
            .output();
    }
}

/// Makes a test CA (`ca.pem`) and the HTTPS server's certificate, issued by it for
/// `upstream.test`, `*.upstream.test` and every name in `dns`, in `dir`: (cert, key).
fn make_certs(
    dir: &std::path::Path,
    dns: &[(&str, &str)],
) -> (std::path::PathBuf, std::path::PathBuf) {
    let p = |f: &str| dir.join(f).to_str().expect("utf-8 temp path").to_string();
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    let mut ca = vec!["openssl", "req", "-x509"];
    ca.extend_from_slice(&ec);
    let (ca_key, ca_pem) = (p("ca.key"), p("ca.pem"));
    ca.extend_from_slice(&[
        "-subj",
        "/CN=sandpit test upstream CA",
        "-days",
        "1",
        "-keyout",
        &ca_key,
        "-out",
        &ca_pem,
    ]);
    run(&ca);
    let (key, csr, cert) = (p("key.pem"), p("leaf.csr"), p("cert.pem"));
    let mut req = vec!["openssl", "req", "-new"];
    req.extend_from_slice(&ec);
    req.extend_from_slice(&["-subj", "/CN=upstream.test", "-keyout", &key, "-out", &csr]);
    run(&req);
    let mut names = vec!["upstream.test".to_string(), "*.upstream.test".to_string()];
    names.extend(dns.iter().map(|(n, _)| n.to_string()));
    names.sort();
    names.dedup();
    let san: Vec<String> = names.iter().map(|n| format!("DNS:{n}")).collect();
    let ext = p("leaf.ext");
    std::fs::write(
        &ext,
        format!(
            "subjectAltName={}\nbasicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n",
            san.join(",")
        ),
    )
    .expect("write the leaf's extensions");
    run(&[
        "openssl",
        "x509",
        "-req",
        "-in",
        &csr,
        "-CA",
        &ca_pem,
        "-CAkey",
        &ca_key,
        "-CAcreateserial",
        "-days",
        "1",
        "-extfile",
        &ext,
        "-out",
        &cert,
    ]);
    (cert.into(), key.into())
}

/// Host links whose names start with `prefix`.
pub fn links_with_prefix(prefix: &str) -> Vec<String> {
    let out = Command::new("ip")
        .args(["-o", "link", "show"])
        .output()
        .expect("ip link");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split(": ").nth(1))
        .map(|n| n.split('@').next().unwrap_or(n).to_string())
        .filter(|n| n.starts_with(prefix))
        .collect()
}

/// Whether the nftables table `name` (family inet) exists.
pub fn nft_table_exists(name: &str) -> bool {
    let out = Command::new("nft")
        .args(["list", "tables"])
        .output()
        .expect("nft list tables");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .any(|l| l.trim() == format!("table inet {name}"))
}
