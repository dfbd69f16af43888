//! Harness for end-to-end tests: starts `sandpit serve` on a free loopback port with its
//! own data directory, and tears everything down again.

pub mod netfix;

use sandpit_api::{CreateSandboxRequest, LimitsSpec};
use sandpit_client::Client;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

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
}

/// How a test daemon is started, beyond its flags.
#[derive(Default)]
struct Launch {
    stray_fd: bool,
    log: Option<std::fs::File>,
    fd_limit: Option<u64>,
}

/// A fresh data directory under /var/tmp (removed with the daemon).
fn temp_data() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("sandpit-test-")
        .tempdir_in("/var/tmp")
        .expect("tempdir")
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

impl Daemon {
    /// Starts a daemon with a fresh data directory.
    pub async fn start() -> Daemon {
        Self::start_with(&[]).await
    }

    /// Starts a daemon with extra `serve` flags.
    pub async fn start_with(extra: &[&str]) -> Daemon {
        Self::launch(temp_data(), free_port(), extra).await
    }

    /// Starts a daemon on an existing data directory (for restart tests).
    pub async fn start_in(data: tempfile::TempDir, port: u16) -> Daemon {
        Self::launch(data, port, &[]).await
    }

    /// Starts a daemon that inherits an open descriptor without close-on-exec on fd 9
    /// (as from a careless launcher), to check that it never reaches a sandbox.
    pub async fn start_with_stray_fd() -> Daemon {
        let opts = Launch {
            stray_fd: true,
            ..Default::default()
        };
        Self::launch_inner(temp_data(), free_port(), &[], opts).await
    }

    /// Starts a daemon whose open-file limit (soft and hard) is `limit`, so that a test
    /// can run it out of descriptors.
    pub async fn start_with_fd_limit(limit: u64, extra: &[&str]) -> Daemon {
        let opts = Launch {
            fd_limit: Some(limit),
            ..Default::default()
        };
        Self::launch_inner(temp_data(), free_port(), extra, opts).await
    }

    /// Starts a daemon on an existing data directory, its log (at debug level) going to
    /// the file `log` instead of the test's stderr, for tests that look through it.
    pub async fn start_in_logged(data: tempfile::TempDir, port: u16, log: &Path) -> Daemon {
        let file = std::fs::File::create(log).expect("create the daemon's log file");
        let opts = Launch {
            log: Some(file),
            ..Default::default()
        };
        Self::launch_inner(data, port, &[], opts).await
    }

    async fn launch(data: tempfile::TempDir, port: u16, extra: &[&str]) -> Daemon {
        Self::launch_inner(data, port, extra, Launch::default()).await
    }

    async fn launch_inner(
        data: tempfile::TempDir,
        port: u16,
        extra: &[&str],
        opts: Launch,
    ) -> Daemon {
        let mut cmd = Command::new(sandpit_bin());
        if opts.stray_fd || opts.fd_limit.is_some() {
            use std::os::unix::process::CommandExt;
            let (stray_fd, fd_limit) = (opts.stray_fd, opts.fd_limit);
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
        let log = opts.log;
        let child = cmd
            .args([
                "serve",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--data-dir",
            ])
            .arg(data.path())
            .args(extra)
            .env("RUST_LOG", if log.is_some() { "debug" } else { "warn" })
            .stdout(Stdio::null())
            .stderr(log.map_or_else(Stdio::inherit, Stdio::from))
            .spawn()
            .expect("spawn sandpit serve");
        let url = format!("http://127.0.0.1:{port}");
        let probe = Client::new(&url, None).expect("client");
        for _ in 0..500 {
            if probe.health().await.is_ok() {
                break;
            }
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
        }
    }

    /// A client with the admin key.
    pub fn client(&self) -> Client {
        Client::new(&self.url, Some(self.key.clone())).expect("client")
    }

    /// Creates a sandbox with small limits.
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

    /// Deletes every pool and sandbox, then stops the daemon.
    pub async fn shutdown(mut self) {
        remove_everything(&self.client()).await;
        self.stop();
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
        // Delete the test's sandboxes, so that no test leaves sandboxes running.
        if self.child.is_some() {
            let c = self.client();
            block_on_own_thread(async move { remove_everything(&c).await });
        }
        self.stop();
    }
}

/// Deletes another owner's sandbox when dropped (the harness deletes only the admin's).
pub struct DeleteOnDrop(pub Client, pub String);

impl Drop for DeleteOnDrop {
    fn drop(&mut self) {
        let (c, id) = (self.0.clone(), self.1.clone());
        block_on_own_thread(async move {
            // Right after a flood the daemon may still be short of descriptors.
            for _ in 0..20 {
                if c.delete_sandbox(&id).await.is_ok() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        });
    }
}

/// Deletes the daemon's pools (with their idle sandboxes), the admin's sandboxes and volumes.
async fn remove_everything(c: &Client) {
    if let Ok(pools) = c.list_pools().await {
        for p in pools {
            let _ = c.delete_pool(&p.name).await;
        }
    }
    if let Ok(list) = c.list_sandboxes(None, &[], Some(1000), None).await {
        for s in list.items {
            let _ = c.delete_sandbox(&s.id).await;
        }
    }
    // After the sandboxes: a volume is released as soon as its sandbox is being deleted.
    if let Ok(volumes) = c.list_volumes().await {
        for v in volumes {
            let _ = c.delete_volume(&v.name).await;
        }
    }
}

/// Runs `bash -c script` and returns the response.
pub async fn sh(c: &Client, id: &str, script: &str) -> sandpit_api::RunCommandResponse {
    let req = sandpit_api::RunCommandRequest {
        argv: vec!["bash".into(), "-c".into(), script.into()],
        ..Default::default()
    };
    c.run(id, &req).await.expect("run command")
}

/// Same as [`sh`] as root.
pub async fn sh_root(c: &Client, id: &str, script: &str) -> sandpit_api::RunCommandResponse {
    let req = sandpit_api::RunCommandRequest {
        argv: vec!["bash".into(), "-c".into(), script.into()],
        user: Some("root".into()),
        ..Default::default()
    };
    c.run(id, &req).await.expect("run command")
}

/// Whether a tmpfs is mounted on `dir` (the daemon's sandboxes directory, say).
pub fn tmpfs_mounted_on(dir: &std::path::Path) -> bool {
    std::fs::read_to_string("/proc/mounts")
        .unwrap()
        .lines()
        .any(|l| l.split(' ').nth(1) == dir.to_str() && l.split(' ').nth(2) == Some("tmpfs"))
}

/// What remains on the host of sandbox `id`: mounts, its directory, cgroups.
pub fn leftovers(d: &Daemon, id: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap();
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
