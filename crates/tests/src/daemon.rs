//! The daemon under test: one builder starts `sandpit serve` on a loopback port with a data
//! directory of its own, and dropping it deletes what the test left and stops it.

use crate::fixtures::{free_port, temp_dir};
use sandpit_api::{CreateSandboxRequest, LimitsSpec};
use sandpit_client::{Client, ClientError};
use sandpit_store::Store;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The `sandpit` binary built beside the test executable.
pub fn sandpit_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<triple>/debug/deps/<test> -> target/<triple>/debug/sandpit
    let dir = exe.parent().and_then(|d| d.parent()).expect("target dir");
    let bin = dir.join("sandpit");
    assert!(
        bin.exists(),
        "{} missing: build with `cargo build --workspace` first",
        bin.display()
    );
    bin
}

/// A daemon under test.
pub struct Daemon {
    pub child: Option<Child>,
    pub url: String,
    pub data: tempfile::TempDir,
    pub key: String,
    pub port: u16,
    /// Holds the file given with `--config`, if any, as long as the daemon runs.
    _config_dir: Option<tempfile::TempDir>,
}

/// How a test daemon is started: [`Daemon::builder`], then [`DaemonBuilder::start`].
pub struct DaemonBuilder {
    data: tempfile::TempDir,
    port: Option<u16>,
    args: Vec<String>,
    config: Option<String>,
    config_file: Option<String>,
    log: Option<PathBuf>,
    log_level: Option<String>,
    fd_limit: Option<u64>,
    stray_fd: bool,
    /// A TLS daemon: the CA file to trust and the host name to probe it under.
    tls_probe: Option<(PathBuf, String)>,
}

impl DaemonBuilder {
    /// The daemon serves TLS (its flags or config say so): its health is probed with
    /// `curl` under `host` (resolved to 127.0.0.1) trusting `ca`, and [`Daemon::url`] is
    /// `https://host:port`.
    pub fn tls_probe(mut self, ca: &Path, host: &str) -> Self {
        self.tls_probe = Some((ca.to_path_buf(), host.to_string()));
        self
    }

    /// Adds `serve` flags.
    pub fn args(mut self, args: &[&str]) -> Self {
        self.args.extend(args.iter().map(|a| a.to_string()));
        self
    }

    /// Serves from an existing data directory (a restart) instead of a fresh one.
    pub fn data_dir(mut self, data: tempfile::TempDir) -> Self {
        self.data = data;
        self
    }

    /// The data directory the daemon will serve from, to put files in before it starts.
    pub fn data_path(&self) -> &Path {
        self.data.path()
    }

    /// Listens on `port` instead of a free one.
    pub fn port(mut self, port: u16) -> Self {
        self.port = Some(port);
        self
    }

    /// Writes `toml` to the data directory's `config.toml` (read at this and every later
    /// start on the same directory).
    pub fn config(mut self, toml: &str) -> Self {
        self.config = Some(toml.to_string());
        self
    }

    /// Writes `toml` to a file outside the data directory and passes it with `--config`
    /// (read at this start only).
    pub fn config_file(mut self, toml: &str) -> Self {
        self.config_file = Some(toml.to_string());
        self
    }

    /// Sends the daemon's log (uncoloured, at debug level unless [`Self::log_level`] says
    /// otherwise) to the file `path` instead of the test's stderr.
    pub fn log(mut self, path: &Path) -> Self {
        self.log = Some(path.to_path_buf());
        self
    }

    /// The daemon's `RUST_LOG` (default: `warn`, or `debug` with [`Self::log`]).
    pub fn log_level(mut self, level: &str) -> Self {
        self.log_level = Some(level.to_string());
        self
    }

    /// Sets the daemon's open-file limit (soft and hard) to `limit`, so that a test can run
    /// it out of descriptors.
    pub fn fd_limit(mut self, limit: u64) -> Self {
        self.fd_limit = Some(limit);
        self
    }

    /// Lets the daemon inherit an open descriptor without close-on-exec on fd 9 (as from a
    /// careless launcher), to check that it never reaches a sandbox.
    pub fn stray_fd(mut self) -> Self {
        self.stray_fd = true;
        self
    }

    /// Starts a daemon that is expected to fail its start: waits for it to exit (60 s at
    /// most) and returns its exit status, its standard error and its data directory.
    pub fn start_failing(self) -> (std::process::ExitStatus, String, tempfile::TempDir) {
        let port = self.port.unwrap_or_else(free_port);
        let (mut cmd, _config_dir) = self.command(port);
        cmd.env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("spawn sandpit serve");
        let deadline = Instant::now() + Duration::from_secs(60);
        let status = loop {
            if let Some(s) = child.try_wait().expect("wait for sandpit serve") {
                break s;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("sandpit serve did not exit within 60 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let mut stderr = String::new();
        if let Some(mut e) = child.stderr.take() {
            use std::io::Read;
            let _ = e.read_to_string(&mut stderr);
        }
        (status, stderr, self.data)
    }

    /// The `sandpit serve` command of this builder, with the directory holding its
    /// `--config` file (kept as long as the daemon runs).
    fn command(&self, port: u16) -> (Command, Option<tempfile::TempDir>) {
        let data = &self.data;
        if let Some(toml) = &self.config {
            std::fs::write(data.path().join("config.toml"), toml).expect("write config.toml");
        }
        let mut cmd = Command::new(sandpit_bin());
        cmd.args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--data-dir",
        ])
        .arg(data.path());
        let config_dir = self.config_file.as_ref().map(|toml| {
            let dir = temp_dir("sandpit-test-cfg-");
            let path = dir.path().join("config.toml");
            std::fs::write(&path, toml).expect("write the config file");
            cmd.arg("--config").arg(&path);
            dir
        });
        cmd.args(&self.args);
        if self.stray_fd || self.fd_limit.is_some() {
            pre_exec(&mut cmd, self.stray_fd, self.fd_limit);
        }
        (cmd, config_dir)
    }

    /// Starts the daemon and waits until it answers its health check.
    pub async fn start(self) -> Daemon {
        let port = self.port.unwrap_or_else(free_port);
        let (mut cmd, config_dir) = self.command(port);
        let data = self.data;
        let level = self
            .log_level
            .unwrap_or_else(|| if self.log.is_some() { "debug" } else { "warn" }.into());
        cmd.env("RUST_LOG", level).stdout(Stdio::null());
        match &self.log {
            Some(path) => {
                let file = std::fs::File::create(path).expect("create the daemon's log file");
                // Tests search the file for fields: no colour codes between them.
                cmd.env("NO_COLOR", "1").stderr(file)
            }
            None => cmd.stderr(Stdio::inherit()),
        };
        let mut child = cmd.spawn().expect("spawn sandpit serve");
        let url = match &self.tls_probe {
            Some((_, host)) => format!("https://{host}:{port}"),
            None => format!("http://127.0.0.1:{port}"),
        };
        let probe = Client::new(&format!("http://127.0.0.1:{port}"), None).expect("client");
        let healthy = || async {
            match &self.tls_probe {
                None => probe.health().await.is_ok(),
                Some((ca, host)) => {
                    let mut curl = tokio::process::Command::new("curl");
                    curl.args(["-sf", "-o", "/dev/null", "--cacert"])
                        .arg(ca)
                        .arg("--resolve")
                        .arg(format!("{host}:{port}:127.0.0.1"))
                        .arg(format!("https://{host}:{port}/v1/health"));
                    curl.status().await.is_ok_and(|s| s.success())
                }
            }
        };
        // Generous: on a loaded 2-core CI machine the store's first fsync alone has taken
        // over 5 s. A daemon that exits early fails at once instead of waiting it out.
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while !healthy().await {
            if let Ok(Some(status)) = child.try_wait() {
                panic!("sandpit serve exited before it was healthy: {status}");
            }
            assert!(
                std::time::Instant::now() < deadline,
                "sandpit serve was not healthy within 60 s"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let key =
            std::fs::read_to_string(data.path().join("admin.key")).expect("admin key written");
        Daemon {
            child: Some(child),
            url,
            data,
            key,
            port,
            _config_dir: config_dir,
        }
    }
}

/// Opens a stray descriptor on fd 9 and/or sets the open-file limit in the child.
fn pre_exec(cmd: &mut Command, stray_fd: bool, fd_limit: Option<u64>) {
    use std::os::unix::process::CommandExt;
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            if stray_fd {
                let fd = libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY);
                if fd < 0 || libc::dup2(fd, 9) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            if let Some(n) = fd_limit {
                let lim = libc::rlimit {
                    rlim_cur: n,
                    rlim_max: n,
                };
                if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
}

impl Daemon {
    /// A builder for a daemon with a fresh data directory on a free port.
    pub fn builder() -> DaemonBuilder {
        DaemonBuilder {
            data: temp_dir("sandpit-test-"),
            port: None,
            args: Vec::new(),
            config: None,
            config_file: None,
            log: None,
            log_level: None,
            fd_limit: None,
            stray_fd: false,
            tls_probe: None,
        }
    }

    /// Starts a daemon with a fresh data directory: `Daemon::builder().start()`.
    pub async fn start() -> Daemon {
        Self::builder().start().await
    }

    /// Stops the daemon if it still runs (SIGTERM: its sandboxes keep running) and
    /// returns a builder for the next daemon on the same data directory and port.
    pub fn restart(mut self) -> DaemonBuilder {
        self.stop();
        let data = std::mem::replace(&mut self.data, tempfile::tempdir().expect("tempdir"));
        Self::builder().data_dir(data).port(self.port)
    }

    /// The daemon's process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("the daemon runs").id()
    }

    /// A client with the admin key.
    pub fn client(&self) -> Client {
        Client::new(&self.url, Some(self.key.clone())).expect("client")
    }

    /// The daemon's store, opened beside it.
    pub async fn store(&self) -> Store {
        Store::open(&self.data.path().join("sandpit.db"))
            .await
            .expect("open the daemon's store")
    }

    /// A new key of `owner` (made in the store, as `sandpit keys create` would).
    pub async fn owner_key(&self, owner: &str) -> String {
        let db = self.store().await;
        let (_, key) = db.create_api_key(owner, "test").await.expect("create key");
        db.close().await;
        key
    }

    /// A client of a new key of `owner`; the harness deletes their sandboxes too.
    pub async fn owner(&self, owner: &str) -> Client {
        Client::new(&self.url, Some(self.owner_key(owner).await)).expect("client")
    }

    /// The host pid of sandbox `id`'s agent, from the store.
    pub async fn agent_pid(&self, id: &str) -> i32 {
        let db = self.store().await;
        let rec = db.get_sandbox(id).await.expect("read the store");
        db.close().await;
        let rec = rec.expect("the sandbox's record");
        rec.runtime_state["pid"].as_i64().expect("an agent pid") as i32
    }

    /// Runs the `sandpit` CLI against this daemon: (success, stdout, stderr).
    pub fn cli(&self, args: &[&str]) -> (bool, String, String) {
        let (code, stdout, stderr) = self.cli_code(args);
        (code == Some(0), stdout, stderr)
    }

    /// Runs the `sandpit` CLI against this daemon: (exit code, stdout, stderr).
    pub fn cli_code(&self, args: &[&str]) -> (Option<i32>, String, String) {
        let out = self
            .cli_command(args)
            .output()
            .expect("run the sandpit CLI");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// The `sandpit` CLI with `args`, set up to reach this daemon, not yet started.
    pub fn cli_command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(sandpit_bin());
        cmd.args(args)
            .env("SANDPIT_URL", &self.url)
            .env("SANDPIT_DATA_DIR", self.data.path());
        cmd
    }

    /// Creates a sandbox with `limits` and ten minutes to live; its id.
    pub async fn sandbox(&self, limits: LimitsSpec) -> String {
        let req = CreateSandboxRequest {
            limits,
            timeout: Some(600),
            ..Default::default()
        };
        self.client()
            .create_sandbox(&req)
            .await
            .expect("create sandbox")
            .id
    }

    /// Deletes every pool, and every owner's sandboxes and volumes (what dropping the
    /// daemon does before it stops it).
    pub async fn remove_everything(&self) {
        self.remover().run().await;
    }

    /// Deletes every pool, and every owner's sandboxes and volumes, then stops the daemon.
    pub async fn shutdown(mut self) {
        if self.running() {
            self.remove_everything().await;
        }
        self.stop();
    }

    /// Whether the daemon was started, not stopped, and has not exited.
    fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// Stops the daemon with SIGTERM (sandboxes keep running).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            let _ = child.wait();
        }
    }

    /// Kills the daemon with SIGKILL.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn remover(&self) -> Remover {
        Remover {
            url: self.url.clone(),
            key: self.key.clone(),
            db: self.data.path().join("sandpit.db"),
        }
    }
}

/// Runs `work` to its end on a thread with a runtime of its own: Drop cannot await, and a
/// failed test never reaches its own cleanup.
fn block_on_own_thread<F>(work: F)
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    let cleanup = std::thread::spawn(move || {
        if let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            rt.block_on(work);
        }
    });
    let _ = cleanup.join();
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // A stopped daemon's sandboxes stay: a restart test hands them to the next daemon.
        if self.running() {
            let remover = self.remover();
            block_on_own_thread(remover.run());
        }
        self.stop();
    }
}

/// Deletes what a test left in a running daemon: pools, and the sandboxes and volumes of
/// every owner. The API shows each owner only their own, so the store says who the owners
/// are and gives each a key for this.
struct Remover {
    url: String,
    key: String,
    db: PathBuf,
}

impl Remover {
    async fn run(self) {
        // Right after a flood the daemon may still be short of descriptors.
        let deadline = Instant::now() + Duration::from_secs(10);
        let Ok(admin) = Client::new(&self.url, Some(self.key.clone())) else {
            return;
        };
        if let Some(pools) = retrying(deadline, || admin.list_pools()).await {
            for p in pools {
                retrying(deadline, || admin.delete_pool(&p.name)).await;
            }
        }
        for c in self.owners(admin).await {
            remove_sandboxes_and_volumes(&c, deadline).await;
        }
    }

    /// The admin's client, then one for every other owner that has a key, a live
    /// sandbox or a volume in the store.
    async fn owners(&self, admin: Client) -> Vec<Client> {
        let mut clients = vec![admin];
        let Ok(db) = Store::open(&self.db).await else {
            return clients;
        };
        let mut owners = BTreeSet::new();
        if let Ok(keys) = db.list_api_keys().await {
            owners.extend(keys.into_iter().map(|k| k.owner));
        }
        if let Ok(live) = db.live_sandboxes().await {
            owners.extend(live.into_iter().map(|s| s.owner));
        }
        if let Ok(volumes) = db.list_volumes(None).await {
            owners.extend(volumes.into_iter().map(|v| v.owner));
        }
        if let Ok(Some(admin)) = db.authenticate(self.key.trim()).await {
            owners.remove(&admin.owner);
        }
        for owner in owners {
            let Ok((_, key)) = db.create_api_key(&owner, "test harness cleanup").await else {
                continue;
            };
            if let Ok(c) = Client::new(&self.url, Some(key)) {
                clients.push(c);
            }
        }
        db.close().await;
        clients
    }
}

/// Deletes the owner's sandboxes, then their volumes (a volume is released as soon as its
/// sandbox is being deleted).
async fn remove_sandboxes_and_volumes(c: &Client, deadline: Instant) {
    // Page by page from the start: deleted sandboxes leave the listing.
    loop {
        let Some(page) = retrying(deadline, || c.list_sandboxes(None, &[], Some(1000), None)).await
        else {
            break;
        };
        let mut deleted = 0;
        for s in &page.items {
            if retrying(deadline, || c.delete_sandbox(&s.id))
                .await
                .is_some()
            {
                deleted += 1;
            }
        }
        if page.next_cursor.is_none() || deleted == 0 {
            break;
        }
    }
    if let Some(volumes) = retrying(deadline, || c.list_volumes()).await {
        for v in volumes {
            retrying(deadline, || c.delete_volume(&v.name)).await;
        }
    }
}

/// Calls `call` until it succeeds, it fails for good (a 4xx answer) or `deadline` passes.
async fn retrying<T, F, Fut>(deadline: Instant, mut call: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, ClientError>>,
{
    loop {
        match call().await {
            Ok(v) => return Some(v),
            Err(e) if e.status().is_none_or(|s| s >= 500) && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(_) => return None,
        }
    }
}
