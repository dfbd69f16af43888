//! Sandbox runtimes behind one trait. A runtime places the agent in an isolated (or, for
//! development, unisolated) environment with limits; everything else talks to the agent.

pub mod cgroup;
pub mod container;
mod init;
pub mod process;
pub mod template;
pub mod trust;
pub mod volume;
pub mod volume_files;

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;

pub use init::init_main;
pub use volume::VolumeMount;

/// Why a runtime operation failed.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("invalid sandbox spec: {0}")]
    InvalidSpec(String),
    #[error("the runtime cannot do this: {0}")]
    Unsupported(String),
    #[error("cgroup {path}: {source}")]
    Cgroup {
        path: String,
        source: std::io::Error,
    },
    #[error("sandbox setup failed: {0}")]
    Setup(String),
    /// Something the sandbox may change on purpose is not as sandpit left it.
    #[error("the sandbox changed what sandpit relies on: {0}")]
    Tampered(String),
    #[error("{context}: {source}")]
    Io {
        context: String,
        source: std::io::Error,
    },
    /// A volume's mount path is refused (the request's fault, like `InvalidSpec`).
    #[error("invalid sandbox spec: {0}")]
    MountPath(#[from] volume::MountPathError),
    /// The sandbox's network could not be prepared or routed; `source` is the
    /// networking layer's own error.
    #[error("sandbox setup failed: {context}: {source}")]
    Network {
        context: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
    /// A config for the agent or the init helper could not be encoded.
    #[error("sandbox setup failed: {source}")]
    Encode {
        /// What was being encoded.
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },
}

impl RuntimeError {
    /// True when the host ran out of something shared (descriptors, memory, processes):
    /// the request may succeed later, and nothing about the sandbox is wrong.
    pub fn is_host_exhaustion(&self) -> bool {
        let source = match self {
            RuntimeError::Io { source, .. } | RuntimeError::Cgroup { source, .. } => source,
            // A network setup that failed for want of descriptors or memory is the same
            // shortage, found one layer down.
            RuntimeError::Network { source, .. } => {
                // The networking layer wraps its OS errors in its own type: look down the chain.
                let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(source.as_ref());
                loop {
                    match cur {
                        Some(e) => match e.downcast_ref::<std::io::Error>() {
                            Some(io) => break io,
                            None => cur = e.source(),
                        },
                        None => return false,
                    }
                }
            }
            _ => return false,
        };
        matches!(
            source.raw_os_error(),
            Some(libc::EMFILE | libc::ENFILE | libc::ENOMEM | libc::EAGAIN)
        )
    }

    /// A failed step of network setup, keeping the networking layer's error.
    pub fn network(
        context: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    ) -> Self {
        RuntimeError::Network {
            context: context.into(),
            source: source.into(),
        }
    }

    /// Wraps an i/o error with what was being done.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        RuntimeError::Io {
            context: context.into(),
            source,
        }
    }
}

/// Resource limits of one sandbox.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct Limits {
    /// CPU bandwidth in thousandths of a core.
    pub cpu_millis: u64,
    pub memory_bytes: u64,
    /// Size of the writable layer.
    pub disk_bytes: u64,
    pub max_processes: u64,
}

/// The root filesystem a sandbox starts from.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum TemplateSource {
    /// The host's own /usr and libraries, read-only.
    Host,
    /// A root filesystem directory (e.g. made by debootstrap), used read-only as the lower layer.
    Rootfs { path: PathBuf },
}

/// Everything a runtime needs to start one sandbox.
#[derive(Debug, Clone)]
pub struct SandboxSpec {
    pub id: String,
    pub template: TemplateSource,
    pub limits: Limits,
    pub env: BTreeMap<String, String>,
    /// Default working directory inside the sandbox.
    pub workdir: String,
    /// Volumes to mount (container runtime only).
    pub volumes: Vec<VolumeMount>,
    /// Read-only layers over the template (overlay form, ids from 0), top first.
    pub layers: Vec<PathBuf>,
    /// A CA certificate (PEM) the sandbox trusts besides its template's roots: the
    /// credential broker's CA for this sandbox (container runtime only; see [`trust`]).
    pub extra_ca_pem: Option<String>,
    /// A prepared network namespace to join instead of a new empty one (container
    /// runtime only), with the sandbox's `/etc/resolv.conf`.
    pub net: Option<SandboxNet>,
    /// Give the sandbox `sudo` through its agent and a `python` alias (container runtime
    /// only: the process runtime's root would be the daemon's account on the host).
    pub sudo: bool,
}

/// A network namespace made ready for a sandbox by the daemon.
#[derive(Debug, Clone)]
pub struct SandboxNet {
    /// The namespace (`/proc/.../ns/net`), owned by the host's user namespace.
    pub netns: std::sync::Arc<std::os::fd::OwnedFd>,
    /// Contents of the sandbox's `/etc/resolv.conf`.
    pub resolv_conf: String,
}

/// Where a sandbox's network link is, kept in its handle for re-adoption after a restart.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct NetAttachment {
    /// The sandbox's IPv4 address.
    pub address: std::net::Ipv4Addr,
    /// Name of the host end of its veth pair.
    pub host_if: String,
}

/// A writable layer as the daemon may read it while the sandbox is frozen.
#[derive(Debug)]
pub struct UpperView {
    /// An `O_PATH` descriptor of the upper directory; walk it as `/proc/self/fd/N`, which
    /// nothing inside the sandbox can redirect.
    pub fd: std::os::fd::OwnedFd,
    /// Host id of the sandbox's uid 0 (its files are owned by `id_base + inner id`).
    pub id_base: u32,
}

impl UpperView {
    /// The path through which the upper directory is read.
    pub fn path(&self) -> PathBuf {
        use std::os::fd::AsRawFd;
        PathBuf::from(format!("/proc/self/fd/{}", self.fd.as_raw_fd()))
    }
}

/// What the daemon must remember to find, re-adopt and clean up a sandbox.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct SandboxHandle {
    pub id: String,
    /// Host pid of the agent.
    pub pid: i32,
    /// Start time of that pid (clock ticks since boot), to tell it from a reused pid.
    pub pid_start: u64,
    /// The unix socket the agent serves on.
    pub socket: PathBuf,
    /// The sandbox's private directory on the host.
    pub dir: PathBuf,
    /// First host uid of the sandbox's user namespace (containers only).
    #[serde(default)]
    pub uid_base: Option<u32>,
    /// Its network link, when the daemon gave it one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub net: Option<NetAttachment>,
}

/// Resource usage of a sandbox.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Stats {
    pub cpu_usage_ns: u64,
    pub memory_current_bytes: u64,
    pub memory_peak_bytes: u64,
    pub pids_current: u64,
    /// Page cache held by the sandbox (part of `memory_current_bytes`).
    #[serde(default)]
    pub memory_cache_bytes: u64,
}

/// What a runtime offers, reported through the API.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Capabilities {
    pub name: &'static str,
    /// False for the development-only process runtime.
    pub isolated: bool,
    pub freeze: bool,
    pub stats: bool,
    pub enforces_memory: bool,
    pub enforces_disk: bool,
    pub enforces_processes: bool,
}

/// A way of running sandboxes.
pub trait Runtime: Send + Sync {
    /// Name and features of the runtime.
    fn capabilities(&self) -> Capabilities;
    /// Prepares a sandbox (directories, cgroup, uid range, the agent's socket); nothing
    /// runs yet and the handle's pid is 0. A failed create leaves nothing behind.
    fn create(&self, spec: &SandboxSpec) -> Result<SandboxHandle, RuntimeError>;
    /// Launches a created sandbox's agent and fills in its pid; the agent accepts
    /// connections on the socket from then on. After a failure, call `destroy`.
    fn start(&self, spec: &SandboxSpec, h: &mut SandboxHandle) -> Result<(), RuntimeError>;
    /// Kills every process of the sandbox (its resources stay until `destroy`).
    fn kill(&self, h: &SandboxHandle) -> Result<(), RuntimeError>;
    /// Freezes every process of the sandbox.
    fn freeze(&self, h: &SandboxHandle) -> Result<(), RuntimeError>;
    /// Thaws a frozen sandbox.
    fn thaw(&self, h: &SandboxHandle) -> Result<(), RuntimeError>;
    /// Current resource usage.
    fn stats(&self, h: &SandboxHandle) -> Result<Stats, RuntimeError>;
    /// Whether the sandbox's agent is still the process we started; `Unknown` when the
    /// host could not tell (callers must not treat that as dead).
    fn liveness(&self, h: &SandboxHandle) -> Liveness;
    /// True only when the agent is known to be alive.
    fn is_alive(&self, h: &SandboxHandle) -> bool {
        self.liveness(h).is_alive()
    }
    /// Kills and removes everything the sandbox had; idempotent.
    fn destroy(&self, h: &SandboxHandle) -> Result<(), RuntimeError>;
    /// Removes leftovers (cgroups, directories) of sandboxes whose ids are not in `keep`.
    fn remove_orphans(&self, keep: &[String]) -> Result<Vec<String>, RuntimeError>;
    /// Tells the runtime about a sandbox that survived a daemon restart.
    fn adopt(&self, h: &SandboxHandle);
    /// Makes the sandbox unreachable at once without waiting for anything (`destroy`
    /// follows and does the slow part). By default it kills the agent, which as PID 1 of
    /// a pid namespace takes every other process with it; runtimes without one override it.
    fn begin_stop(&self, h: &SandboxHandle) {
        if h.pid > 0 && same_process(h.pid, h.pid_start) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(h.pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
    /// The sandbox's writable layer, for snapshots, forks and hibernation (freeze first:
    /// a running sandbox changes it underneath).
    fn open_upper(&self, _h: &SandboxHandle) -> Result<UpperView, RuntimeError> {
        Err(RuntimeError::Unsupported(format!(
            "the {} runtime has no separate writable layer",
            self.capabilities().name
        )))
    }
    /// On a clean shutdown: removes shared resources (such as the parent cgroup) that no
    /// sandbox uses any more. Sandboxes still running are left alone.
    fn release(&self) {}
}

/// Agent sockets of sandboxes that were created but not started yet: the listener is bound
/// by `create` and handed to the agent by `start`.
#[derive(Default)]
pub struct PendingSockets(
    parking_lot::Mutex<std::collections::HashMap<String, std::os::unix::net::UnixListener>>,
);

impl PendingSockets {
    /// Binds `dir/agent.sock` for sandbox `id` and returns its path.
    pub fn bind(&self, id: &str, dir: &std::path::Path) -> Result<PathBuf, RuntimeError> {
        let socket = dir.join("agent.sock");
        let listener = std::os::unix::net::UnixListener::bind(&socket)
            .map_err(|e| RuntimeError::io("bind agent socket", e))?;
        self.0.lock().insert(id.to_string(), listener);
        Ok(socket)
    }

    /// Takes the listener of a created sandbox.
    pub fn take(&self, id: &str) -> Result<std::os::unix::net::UnixListener, RuntimeError> {
        self.0.lock().remove(id).ok_or_else(|| {
            RuntimeError::Setup(format!("sandbox {id} was not created or already started"))
        })
    }

    /// Drops the listener of a sandbox that will never start.
    pub fn forget(&self, id: &str) {
        self.0.lock().remove(id);
    }
}

/// Creates `dir` (and parents) readable by its owner only: agent sockets live below it.
pub fn private_dir(dir: &std::path::Path) -> Result<(), RuntimeError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir)
        .map_err(|e| RuntimeError::io(format!("create {}", dir.display()), e))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .map_err(|e| RuntimeError::io(format!("chmod {}", dir.display()), e))
}

/// Puts `fd` on `target` for the next exec (between fork and exec: raw syscalls only).
/// dup2 onto itself would keep close-on-exec set, so that case clears the flag instead.
pub fn pass_fd(fd: i32, target: i32) -> std::io::Result<()> {
    // SAFETY: async-signal-safe descriptor syscalls.
    let r = unsafe {
        if fd == target {
            libc::fcntl(fd, libc::F_SETFD, 0)
        } else {
            libc::dup2(fd, target)
        }
    };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Start time of a process in clock ticks since boot, from /proc/PID/stat.
pub fn pid_start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    sandpit_abi::proc::Stat::parse(&stat).map(|s| s.start_time)
}

/// What is known of a sandbox's process. Only [`Liveness::Dead`] is evidence: a failed
/// read of `/proc` (EMFILE under descriptor pressure, say) says nothing about the process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Liveness {
    /// The process runs (or is frozen) and is the one that was started.
    Alive,
    /// It is gone: no such pid, a zombie, or another process under the same pid.
    Dead,
    /// It could not be checked; what stopped the check.
    Unknown(String),
}

impl Liveness {
    /// True only for [`Liveness::Alive`].
    pub fn is_alive(&self) -> bool {
        matches!(self, Liveness::Alive)
    }

    /// True only for [`Liveness::Dead`].
    pub fn is_dead(&self) -> bool {
        matches!(self, Liveness::Dead)
    }
}

/// Whether `pid` is alive, not a zombie, and started at `start`, from `/proc/PID/stat`.
pub fn process_liveness(pid: i32, start: u64) -> Liveness {
    if pid <= 0 {
        return Liveness::Dead;
    }
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => liveness_of_stat(&stat, start),
        Err(e) => match e.raw_os_error() {
            Some(libc::ENOENT) | Some(libc::ESRCH) => Liveness::Dead,
            _ => Liveness::Unknown(format!("read /proc/{pid}/stat: {e}")),
        },
    }
}

/// Reads a `/proc/PID/stat` line: dead when a zombie or started at another time.
fn liveness_of_stat(stat: &str, start: u64) -> Liveness {
    match sandpit_abi::proc::Stat::parse(stat).map(|s| (s.state, s.start_time)) {
        Some(('Z' | 'X' | 'x', _)) => Liveness::Dead,
        Some((_, s)) if s == start => Liveness::Alive,
        // The pid was reused by another process.
        Some(_) => Liveness::Dead,
        None => Liveness::Unknown("unreadable /proc stat line".into()),
    }
}

/// True if `pid` is alive, not a zombie, and started at `start`; false also when that
/// cannot be checked, so it suits "may I signal this pid", never "is it dead".
pub fn same_process(pid: i32, start: u64) -> bool {
    process_liveness(pid, start).is_alive()
}

/// Validates a sandbox id before it is used in host paths and cgroup names.
pub fn check_id(id: &str) -> Result<(), RuntimeError> {
    let ok = !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(RuntimeError::InvalidSpec(format!("bad sandbox id {id:?}")))
    }
}

#[cfg(test)]
mod liveness_tests {
    use super::*;

    #[test]
    fn exhaustion_of_the_host_is_told_apart() {
        let emfile = RuntimeError::io("bind", std::io::Error::from_raw_os_error(libc::EMFILE));
        assert!(emfile.is_host_exhaustion());
        let denied = RuntimeError::io("bind", std::io::Error::from_raw_os_error(libc::EACCES));
        assert!(!denied.is_host_exhaustion());
        assert!(!RuntimeError::Setup("x".into()).is_host_exhaustion());
        assert!(!RuntimeError::from(volume::MountPathError::Root).is_host_exhaustion());
        let net = |errno| {
            RuntimeError::network(
                "prepare the sandbox's network",
                std::io::Error::from_raw_os_error(errno),
            )
        };
        assert!(net(libc::ENFILE).is_host_exhaustion());
        assert!(!net(libc::EPERM).is_host_exhaustion());
        // A cause that is no i/o error says nothing about the host's resources.
        assert!(!RuntimeError::network("route", "no such link").is_host_exhaustion());
        // An io error wrapped by the networking layer's own type still counts.
        #[derive(Debug, thiserror::Error)]
        #[error("netns: {0}")]
        struct Wrapped(#[source] std::io::Error);
        let wrapped =
            |errno| RuntimeError::network("net", Wrapped(std::io::Error::from_raw_os_error(errno)));
        assert!(wrapped(libc::EMFILE).is_host_exhaustion());
        assert!(!wrapped(libc::EACCES).is_host_exhaustion());
    }

    #[test]
    fn new_variants_read_as_before_and_keep_their_cause() {
        use std::error::Error as _;
        let e = RuntimeError::network(
            "prepare the sandbox's network",
            std::io::Error::from_raw_os_error(libc::EEXIST),
        );
        assert_eq!(
            e.to_string(),
            format!(
                "sandbox setup failed: prepare the sandbox's network: {}",
                std::io::Error::from_raw_os_error(libc::EEXIST)
            )
        );
        assert!(e.source().is_some());
        let json = serde_json::from_str::<u8>("x").unwrap_err();
        let shown = json.to_string();
        let e = RuntimeError::Encode {
            what: "agent config",
            source: json,
        };
        assert_eq!(e.to_string(), format!("sandbox setup failed: {shown}"));
        assert!(e.source().is_some());
    }

    fn stat_line(state: &str, start: u64) -> String {
        // pid (comm with ") (" in it) state, then fields 4..=21, then starttime (22).
        let middle: Vec<String> = (4..=21).map(|n| n.to_string()).collect();
        format!("42 (a) (b) {state} {} {start} 99 100", middle.join(" "))
    }

    #[test]
    fn a_stat_line_tells_alive_dead_or_reused() {
        assert_eq!(liveness_of_stat(&stat_line("S", 777), 777), Liveness::Alive);
        assert_eq!(liveness_of_stat(&stat_line("T", 777), 777), Liveness::Alive);
        assert_eq!(liveness_of_stat(&stat_line("Z", 777), 777), Liveness::Dead);
        assert_eq!(liveness_of_stat(&stat_line("S", 778), 777), Liveness::Dead);
        assert!(matches!(
            liveness_of_stat("42 (a", 777),
            Liveness::Unknown(_)
        ));
        assert!(matches!(
            liveness_of_stat("42 (a) S 1", 777),
            Liveness::Unknown(_)
        ));
    }

    #[test]
    fn this_process_is_alive_and_a_free_pid_is_dead() {
        let me = std::process::id() as i32;
        let start = pid_start_time(me).expect("own start time");
        assert_eq!(process_liveness(me, start), Liveness::Alive);
        assert_eq!(process_liveness(me, start + 1), Liveness::Dead);
        assert_eq!(process_liveness(0, 0), Liveness::Dead);
        // Above the kernel's pid_max (at most 2^22): never a process.
        assert_eq!(process_liveness(1 << 23, 1), Liveness::Dead);
    }

    #[test]
    fn running_out_of_descriptors_is_no_evidence_of_death() {
        use nix::sys::resource::{Resource, getrlimit, setrlimit};
        // In a child process, so the test runner's own limit stays as it was.
        let me = std::process::id() as i32;
        let start = pid_start_time(me).expect("own start time");
        // SAFETY: glibc's fork resets the allocator's locks in the child, which touches
        // nothing else another thread could hold, and leaves with _exit.
        match unsafe { nix::unistd::fork() }.expect("fork") {
            nix::unistd::ForkResult::Child => {
                let code = (|| {
                    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).ok()?;
                    // Descriptors 0..=2 and whatever is open fill the table.
                    setrlimit(Resource::RLIMIT_NOFILE, 3, hard).ok()?;
                    let mut held = Vec::new();
                    while let Ok(f) = std::fs::File::open("/dev/null") {
                        held.push(f);
                    }
                    Some(match process_liveness(me, start) {
                        Liveness::Unknown(_) => 0,
                        Liveness::Dead => 1,
                        Liveness::Alive => 2,
                    })
                })()
                .unwrap_or(3);
                // SAFETY: ends the forked child without running the parent's destructors.
                unsafe { libc::_exit(code) }
            }
            nix::unistd::ForkResult::Parent { child } => {
                let status = nix::sys::wait::waitpid(child, None).expect("wait");
                assert_eq!(
                    status,
                    nix::sys::wait::WaitStatus::Exited(child, 0),
                    "with no descriptor left, the check must say Unknown (1 = Dead, 2 = Alive)"
                );
            }
        }
    }
}
