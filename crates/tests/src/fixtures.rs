//! What many test files need: requests for small sandboxes, commands inside them, HTTP
//! clients for the daemon's port, and looks at what a sandbox left on the host.

use crate::Daemon;
use sandpit_api::network::{NetworkRule, RuleAction};
use sandpit_api::{
    BuildTemplateRequest, CreateSandboxRequest, LimitsSpec, NetworkAuditEntry, NetworkPolicy,
    RunCommandRequest, RunCommandResponse, Sandbox, Template, TemplateSourceSpec,
};
use sandpit_client::{Client, ClientError};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

/// A fresh directory under /var/tmp (not a tmpfs, unlike /tmp on some hosts), removed when
/// dropped.
pub fn temp_dir(prefix: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in("/var/tmp")
        .expect("tempdir")
}

/// A loopback port nobody listened on a moment ago.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    // Below the kernel's ephemeral range (32768-60999 by default): a port from there can be
    // handed to some client's outgoing connection between this check and the daemon's
    // bind, which made a daemon fail with "Address already in use" under a loaded suite.
    const BASE: u32 = 20_000;
    const SPAN: u32 = 12_000;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    // Test binaries run one after another, each with many tests at once: start each
    // process somewhere else in the span, then walk it, skipping ports in use.
    let _ = NEXT.compare_exchange(
        0,
        std::process::id().wrapping_mul(7919) % SPAN + 1,
        Ordering::Relaxed,
        Ordering::Relaxed,
    );
    for _ in 0..SPAN {
        let port = BASE + NEXT.fetch_add(1, Ordering::Relaxed) % SPAN;
        let port = u16::try_from(port).expect("the span is below 65536");
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

/// Limits of `mib` MiB of memory, the rest the daemon's defaults.
pub fn memory_limit(mib: u64) -> LimitsSpec {
    LimitsSpec {
        memory_bytes: Some(mib << 20),
        ..Default::default()
    }
}

/// The limits of a small sandbox: 256 MiB of memory.
pub fn small() -> LimitsSpec {
    memory_limit(256)
}

/// A request for a small sandbox with ten minutes to live.
pub fn small_request() -> CreateSandboxRequest {
    CreateSandboxRequest {
        limits: small(),
        timeout: Some(600),
        ..Default::default()
    }
}

/// Creates the sandbox `req` asks for, with ten minutes to live unless it says otherwise.
pub async fn create(c: &Client, req: CreateSandboxRequest) -> Sandbox {
    let req = CreateSandboxRequest {
        timeout: req.timeout.or(Some(600)),
        ..req
    };
    c.create_sandbox(&req).await.expect("create sandbox")
}

/// Creates a small sandbox with egress policy `network` (the default one if `None`); its id.
pub async fn create_small(c: &Client, network: Option<NetworkPolicy>) -> String {
    let req = CreateSandboxRequest {
        network,
        ..small_request()
    };
    create(c, req).await.id
}

/// The status of the error `r` must be (`None` for an error without one).
pub fn error_status<T: std::fmt::Debug>(r: Result<T, ClientError>) -> Option<u16> {
    r.expect_err("expected an error").status()
}

/// A build of template `name` from the root filesystem in directory `path`.
pub fn dir_build(name: &str, path: &Path) -> BuildTemplateRequest {
    let path = path.to_str().expect("UTF-8 path").into();
    template_build(name, TemplateSourceSpec::Dir { path })
}

/// A build of template `name` from `source`, with no settings of its own.
pub fn template_build(name: &str, source: TemplateSourceSpec) -> BuildTemplateRequest {
    BuildTemplateRequest {
        name: name.into(),
        source,
        default_user: None,
        workdir: None,
        env: Default::default(),
        start_cmd: None,
        ready_cmd: None,
        ready_timeout_secs: None,
    }
}

/// Follows the build of template `name` (for up to `max`) to its end: the template and
/// the build's log, whose line offsets must count the lines.
pub async fn wait_built(c: &Client, name: &str, max: Duration) -> (Template, Vec<String>) {
    let deadline = tokio::time::Instant::now() + max;
    let mut offset = 0;
    let mut log = Vec::new();
    loop {
        let b = c
            .template_build(name, offset, 5_000)
            .await
            .expect("build log");
        for l in &b.lines {
            assert_eq!(l.offset, log.len() as u64, "offsets count lines");
            log.push(l.text.clone());
        }
        offset = b.next_offset;
        if b.state != "building" {
            return (c.get_template(name).await.expect("template"), log);
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "build of {name} did not end; log so far: {log:#?}"
        );
    }
}

/// Starts the build `req`, which must be accepted as building and end ready (within 5
/// minutes).
pub async fn build_ready(c: &Client, req: &BuildTemplateRequest) -> Template {
    let started = c.build_template(req).await.expect("start a build");
    assert_eq!(started.state, "building");
    let (t, log) = wait_built(c, &req.name, Duration::from_secs(300)).await;
    assert_eq!(t.state, "ready", "{t:?} {log:#?}");
    t
}

/// An egress rule that does `action` to everything; tests narrow it with struct update.
pub fn network_rule(action: RuleAction) -> NetworkRule {
    NetworkRule {
        action,
        domain: None,
        cidr: None,
        ports: vec![],
        overrides: false,
        name: None,
    }
}

/// An egress rule that allows the domain (or wildcard) `d`.
pub fn allow_domain(d: &str) -> NetworkRule {
    NetworkRule {
        domain: Some(d.into()),
        ..network_rule(RuleAction::Allow)
    }
}

/// The first page (the daemon's default size) of the client's sandboxes.
pub async fn sandboxes(c: &Client) -> Vec<Sandbox> {
    c.list_sandboxes(None, &[], None, None)
        .await
        .expect("list sandboxes")
        .items
}

/// A command that runs `argv` as it is.
pub fn command(argv: &[&str]) -> RunCommandRequest {
    RunCommandRequest {
        argv: argv.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

/// A command that runs `bash -c script`; tests add options with struct update.
pub fn bash(script: &str) -> RunCommandRequest {
    RunCommandRequest {
        argv: vec!["bash".into(), "-c".into(), script.into()],
        ..Default::default()
    }
}

/// Runs `bash -c script` and returns the response.
pub async fn sh(c: &Client, id: &str, script: &str) -> RunCommandResponse {
    c.run(id, &bash(script)).await.expect("run command")
}

/// Same as [`sh`] as root.
pub async fn sh_root(c: &Client, id: &str, script: &str) -> RunCommandResponse {
    let req = RunCommandRequest {
        user: Some("root".into()),
        ..bash(script)
    };
    c.run(id, &req).await.expect("run command")
}

/// Waits (up to 20 s) until something in the sandbox listens on its loopback `port`.
pub async fn wait_listening(c: &Client, id: &str, port: u16) {
    let r = sh(
        c,
        id,
        &format!(
            "for i in $(seq 400); do (exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null && exit 0; sleep 0.05; done; exit 1"
        ),
    )
    .await;
    assert_eq!(r.exit_code, 0, "nothing listens on {port}: {}", r.stderr);
}

/// The A record question for `name` sent over UDP to the sandbox's resolver (up to `tries`
/// times, 2 s each): `rcode R answers N`, or `ERR …`.
pub async fn dns_lookup(c: &Client, id: &str, name: &str, tries: u32) -> String {
    let script = format!(
        "import socket,struct\nq=struct.pack('!HHHHHH',0x4242,0x0100,1,0,0,0)+b''.join(bytes([len(l)])+l.encode() for l in '{name}'.split('.'))+b'\\0'+struct.pack('!HH',1,1)\ngw=[l.split()[1] for l in open('/etc/resolv.conf') if l.startswith('nameserver')][0]\nout='ERR none'\nfor _ in range({tries}):\n s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n s.settimeout(2)\n try:\n  s.sendto(q,(gw,53))\n  r=s.recv(4096)\n  out='rcode %d answers %d'%(r[3]&15,struct.unpack('!H',r[6:8])[0])\n  break\n except Exception as e:\n  out='ERR %s'%e\nprint(out)\n"
    );
    sh(c, id, &format!("python3 -c \"{script}\""))
        .await
        .stdout
        .trim()
        .to_string()
}

/// Every network audit entry of sandbox `id`, page after page.
pub async fn audit_entries(c: &Client, id: &str) -> Vec<NetworkAuditEntry> {
    let mut out = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut q = vec![("sandbox", id.to_string()), ("limit", "1000".into())];
        if let Some(cur) = &cursor {
            q.push(("cursor", cur.clone()));
        }
        let page = c.network_audit(&q).await.expect("audit");
        out.extend(page.items);
        match page.next_cursor {
            Some(n) => cursor = Some(n),
            None => return out,
        }
    }
}

/// An HTTP client that never goes through a proxy from the environment.
pub fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("HTTP client")
}

/// Same as [`http`], its connections coming from the loopback address `from`.
pub fn http_from(from: Ipv4Addr) -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .local_address(std::net::IpAddr::V4(from))
        .build()
        .expect("HTTP client")
}

/// The `Host` that the daemon's proxy routes to port `port` of sandbox `id`.
pub fn port_host(d: &Daemon, port: u16, id: &str) -> String {
    format!("{port}-{id}.sandpit.localhost:{}", d.port)
}

/// A TCP connection to the daemon's loopback `port` from the loopback address `from`
/// (the per-address connection caps see each address as another client).
pub async fn connect_from(port: u16, from: Ipv4Addr) -> std::io::Result<tokio::net::TcpStream> {
    let s = tokio::net::TcpSocket::new_v4()?;
    s.bind(SocketAddr::new(from.into(), 0))?;
    s.connect(SocketAddr::new(Ipv4Addr::LOCALHOST.into(), port))
        .await
}

/// A request body of [`h2_connect`]'s connections.
pub type H2Body = http_body_util::combinators::BoxBody<bytes::Bytes, std::convert::Infallible>;

/// An HTTP/2 connection (prior knowledge, no TLS) to the daemon's loopback `port`, driven
/// in the background.
pub async fn h2_connect(port: u16) -> hyper::client::conn::http2::SendRequest<H2Body> {
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    let (send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .expect("HTTP/2 handshake");
    tokio::spawn(conn);
    send
}

/// One Connect-protocol envelope (flags 0) around the JSON message `v`.
pub fn connect_envelope(v: &serde_json::Value) -> Vec<u8> {
    let msg = v.to_string().into_bytes();
    let mut out = vec![0u8];
    out.extend((msg.len() as u32).to_be_bytes());
    out.extend(msg);
    out
}

/// Now, in unix milliseconds.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock after 1970")
        .as_millis() as i64
}

/// Open descriptors of process `pid` (0 once it is gone).
pub fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Samples a process's open descriptors every 10 ms until dropped; `max()` is the most seen.
pub struct FdSampler {
    stop: Arc<AtomicBool>,
    max: Arc<AtomicUsize>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FdSampler {
    /// Starts sampling process `pid`.
    pub fn start(pid: u32) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let max = Arc::new(AtomicUsize::new(open_fds(pid)));
        let thread = {
            let (stop, max) = (stop.clone(), max.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    max.fetch_max(open_fds(pid), Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(10));
                }
            })
        };
        FdSampler {
            stop,
            max,
            thread: Some(thread),
        }
    }

    /// The most descriptors seen so far.
    pub fn max(&self) -> usize {
        self.max.load(Ordering::Relaxed)
    }

    /// Stops sampling; the most descriptors seen.
    pub fn finish(mut self) -> usize {
        self.halt();
        self.max()
    }

    fn halt(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for FdSampler {
    fn drop(&mut self) {
        self.halt();
    }
}

/// Makes `dir` a root filesystem of usr/bin, usr/lib and usr/lib64 (with bin, lib, lib64
/// linked to them) holding the host programs `programs` (host path, path inside) with
/// the libraries they load.
pub fn rootfs_with_programs(dir: &Path, programs: &[(&str, &str)]) {
    for d in ["usr/bin", "usr/lib", "usr/lib64"] {
        std::fs::create_dir_all(dir.join(d)).expect("rootfs directory");
    }
    for (link, target) in [
        ("bin", "usr/bin"),
        ("lib", "usr/lib"),
        ("lib64", "usr/lib64"),
    ] {
        std::os::unix::fs::symlink(target, dir.join(link)).expect("rootfs link");
    }
    for (host, inside) in programs {
        std::fs::copy(host, dir.join(inside)).expect("copy a program");
        let out = std::process::Command::new("ldd")
            .arg(host)
            .output()
            .expect("ldd");
        for word in String::from_utf8_lossy(&out.stdout).split_whitespace() {
            if word.starts_with('/') {
                let to = dir.join(word.trim_start_matches('/'));
                std::fs::create_dir_all(to.parent().expect("a library's directory"))
                    .expect("library directory");
                std::fs::copy(word, &to).expect("copy a library");
            }
        }
    }
}

/// Whether a tmpfs is mounted on `dir` (the daemon's sandboxes directory, say).
pub fn tmpfs_mounted_on(dir: &Path) -> bool {
    std::fs::read_to_string("/proc/mounts")
        .expect("/proc/mounts")
        .lines()
        .any(|l| l.split(' ').nth(1) == dir.to_str() && l.split(' ').nth(2) == Some("tmpfs"))
}

/// What remains on the host of sandbox `id`: mounts, its directory, cgroups.
pub fn leftovers(d: &Daemon, id: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mounts = std::fs::read_to_string("/proc/mounts").expect("/proc/mounts");
    if mounts.contains(id) {
        found.push("mount".into());
    }
    if d.data.path().join("sandboxes").join(id).exists() {
        found.push("dir".into());
    }
    for ctl in ["memory", "pids", "cpu", "freezer", "unified"] {
        if let Ok(rd) = std::fs::read_dir(format!("/sys/fs/cgroup/{ctl}")) {
            for e in rd.flatten() {
                if e.file_name().to_string_lossy().starts_with("sandpit-")
                    && e.path().join(id).exists()
                {
                    found.push(format!("cgroup {ctl}"));
                }
            }
        }
    }
    found
}

/// Leftovers of a deleted sandbox once its background teardown had 10 s to finish.
pub async fn wait_no_leftovers(d: &Daemon, id: &str) -> Vec<String> {
    for _ in 0..200 {
        if leftovers(d, id).is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    leftovers(d, id)
}

/// A test-only tool that `scripts/setup.sh --test` installs into the repository's own
/// virtualenv (`target/test-venv`), else the one on PATH.
pub fn test_tool(name: &str) -> PathBuf {
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let venv = repo.join("target/test-venv/bin").join(name);
    if venv.exists() {
        venv
    } else {
        PathBuf::from(name)
    }
}
