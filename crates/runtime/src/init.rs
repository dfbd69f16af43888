//! `sandpit __sandbox-init`: the short-lived process that builds a container sandbox.
//!
//! The daemon spawns it with the sandbox's config and the agent's listener on a socket.
//! It joins the sandbox's cgroup and new uts, ipc and net namespaces, enters a new pid
//! namespace and forks its PID 1, which (still real root, in a mount namespace of its own,
//! in namespaces owned by the host's user namespace) mounts the root filesystem, pivots
//! into it, then enters a fresh user namespace whose uid 0 is an unprivileged host uid.
//! Because the mount and network namespaces stay owned by the host's user namespace,
//! root inside the sandbox can never mount, unmount or reconfigure the network. Last
//! come capabilities, no_new_privs, Landlock and seccomp, and the exec of the agent.

use nix::mount::{MntFlags, MsFlags, mount, umount2};
use nix::sched::{CloneFlags, unshare};
use nix::sys::stat::{Mode, SFlag, makedev, mknod};
use nix::unistd::{ForkResult, Gid, Pid, Uid, fork};
use serde::{Deserialize, Serialize};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// Name under which the sandpit binary runs as the in-sandbox agent.
pub use sandpit_abi::AGENT_ARGV0;
/// Where the agent binary appears inside every container sandbox.
pub const AGENT_PATH: &str = "/.sandpit/agent";
/// Size of each sandbox's uid/gid range.
pub const ID_RANGE: u32 = 65_536;

/// What the daemon sends the init process on stdin.
#[derive(Debug, Serialize, Deserialize)]
pub struct InitConfig {
    pub dir: PathBuf,
    pub lower: PathBuf,
    pub host_binds: Vec<PathBuf>,
    /// Host directories bound read-only at another path (host path, absolute sandbox
    /// path), each target made a real directory first (the agent-run harnesses).
    #[serde(default)]
    pub ro_binds: Vec<(PathBuf, PathBuf)>,
    /// True for the `host` template: generate /etc/passwd and friends, apply Landlock.
    pub host_template: bool,
    pub disk_bytes: u64,
    pub uid_base: u32,
    pub agent_exe: PathBuf,
    pub agent_config: String,
    /// Show the lower layer through an idmapped mount, so that files the host's root owns
    /// belong to the sandbox's root (custom root filesystems, where root must be able to
    /// change its own copy of /etc or install packages).
    #[serde(default)]
    pub idmap_lower: bool,
    /// Report when each setup phase ended (the daemon logs it at debug level).
    #[serde(default)]
    pub timing: bool,
    /// The cgroup files to write "0" into, joining the sandbox's cgroup.
    #[serde(default)]
    pub cgroup_tasks: Vec<PathBuf>,
    /// Volumes to mount, idmapped to the sandbox's uid range.
    #[serde(default)]
    pub volumes: Vec<crate::volume::VolumeMount>,
    /// Read-only layers (overlay form, ids from 0) between the writable layer and the
    /// template, top first: what a snapshot, fork or hibernation left.
    #[serde(default)]
    pub layers: Vec<PathBuf>,
    /// A CA certificate (PEM) to install beside the template's roots ([`crate::trust`]).
    #[serde(default)]
    pub extra_ca: Option<String>,
    /// A prepared network namespace comes as the second descriptor with the config: join
    /// it instead of unsharing an empty one.
    #[serde(default)]
    pub netns: bool,
    /// Contents of `/etc/resolv.conf` (empty without networking).
    #[serde(default)]
    pub resolv_conf: Option<String>,
    /// Give the sandbox `sudo` (the agent under that name, which asks the agent) and a
    /// `python` alias where it has only `python3`, in `/usr/local/bin`, and the root-only
    /// directory of the agent's sudo socket.
    #[serde(default)]
    pub sudo: bool,
}

/// Where `sudo` and the `python` alias appear (on every PATH Debian's profile sets).
pub const SHIM_DIR: &str = "usr/local/bin";
/// The directory of the agent's sudo socket, inside the sandbox (the agent checks it
/// again before it listens).
pub const SUDO_DIR: &str = "run/sandpit";
/// Where the `python` alias may point, first found wins.
const PYTHON3: &[&str] = &["/usr/local/bin/python3", "/usr/bin/python3"];
/// Where an existing `python` makes the alias unnecessary.
const PYTHON: &[&str] = &["/usr/local/bin/python", "/usr/bin/python", "/bin/python"];

/// Where the writable layer's tmpfs appears inside a container sandbox, for the daemon
/// only: its root is the host's root's, mode 0700, so nobody in the sandbox can enter.
pub const LAYER_MOUNT: &str = ".sandpit/layer";

/// Why the init helper could not build a sandbox. Its text is the helper's `ERR` reply to
/// the daemon (and what PID 1 sends the helper), so it reads as the replies always have:
/// the daemon tells a refused mount path by its [`crate::volume::SPEC_ERROR`] prefix.
#[derive(Debug, thiserror::Error)]
pub(crate) enum InitError {
    /// A system call failed; `step` names what was being done.
    #[error("{step}: {source}")]
    Sys {
        step: String,
        #[source]
        source: nix::errno::Errno,
    },
    /// A file or descriptor operation failed; `step` names what was being done.
    #[error("{step}: {source}")]
    Io {
        step: String,
        #[source]
        source: std::io::Error,
    },
    /// A path or variable for the kernel holds a NUL byte.
    #[error(transparent)]
    Nul(#[from] std::ffi::NulError),
    /// The config the daemon sent is not UTF-8.
    #[error("config: {source}")]
    ConfigText {
        #[source]
        source: std::string::FromUtf8Error,
    },
    /// What the daemon sent, or what the sandbox's tree holds, is not what setup needs.
    #[error("{0}")]
    Refused(&'static str),
    /// The sandbox's PID 1 failed; its own error came over the pipe as text.
    #[error("{0}")]
    Child(String),
    /// The exec of the agent failed. Worded as the reply always was (the `Option` of the
    /// errno in Debug form), so that nothing reading the reply sees a change.
    #[error("exec agent: Some({source:?})")]
    Exec {
        #[source]
        source: nix::errno::Errno,
    },
    /// Capabilities, Landlock or seccomp could not be applied.
    #[error(transparent)]
    Security(#[from] crate::container::security::SecurityError),
    /// The sandbox's CA files could not be written.
    #[error(transparent)]
    Trust(#[from] crate::trust::TrustError),
    /// A volume's mount path is refused: the request's fault.
    #[error("{prefix}{0}", prefix = crate::volume::SPEC_ERROR)]
    MountPath(#[from] crate::volume::MountPathError),
}

impl InitError {
    /// A failed system call during `step`.
    pub(crate) fn sys(step: impl Into<String>, source: nix::errno::Errno) -> Self {
        InitError::Sys {
            step: step.into(),
            source,
        }
    }

    /// A failed i/o operation during `step`.
    pub(crate) fn io(step: impl Into<String>, source: std::io::Error) -> Self {
        InitError::Io {
            step: step.into(),
            source,
        }
    }

    /// The last OS error, for a raw libc call made during `step`.
    fn last_os(step: impl Into<String>) -> Self {
        Self::io(step, std::io::Error::last_os_error())
    }
}

/// The errors setup steps fail with, kept as the source of the step's [`InitError`].
trait StepError {
    fn at(self, step: String) -> InitError;
}

impl StepError for std::io::Error {
    fn at(self, step: String) -> InitError {
        InitError::io(step, self)
    }
}

impl StepError for nix::errno::Errno {
    fn at(self, step: String) -> InitError {
        InitError::sys(step, self)
    }
}

type R<T> = Result<T, InitError>;

static TIMING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
static MARKS: parking_lot::Mutex<String> = parking_lot::Mutex::new(String::new());

/// CLOCK_MONOTONIC in microseconds: one clock for the daemon, the helper and PID 1.
pub fn mono_us() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000 + ts.tv_nsec as u64 / 1_000
}

/// Notes the end of a setup phase when the daemon asked for timings.
pub(crate) fn mark(label: &str) {
    if TIMING.load(std::sync::atomic::Ordering::Relaxed) {
        use std::fmt::Write as _;
        let _ = write!(MARKS.lock(), " {label}={}", mono_us());
    }
}

fn take_marks() -> String {
    std::mem::take(&mut *MARKS.lock())
}

fn ctx<T, E: StepError>(r: Result<T, E>, what: impl FnOnce() -> String) -> R<T> {
    r.map_err(|e| e.at(what()))
}

/// Entry point of `sandpit __sandbox-init`; returns the process exit code.
pub fn init_main() -> i32 {
    let started = mono_us();
    let (raw, listener, netns) = match receive_config() {
        Ok(r) => r,
        Err(e) => {
            println!("ERR reading config: {e}");
            return 1;
        }
    };
    let cfg: InitConfig = match serde_json::from_str(&raw) {
        Ok(c) => c,
        Err(e) => {
            println!("ERR bad config: {e}");
            return 1;
        }
    };
    TIMING.store(cfg.timing, std::sync::atomic::Ordering::Relaxed);
    if cfg.timing {
        use std::fmt::Write as _;
        let _ = write!(MARKS.lock(), " main={started}");
    }
    mark("config");
    if let Err(e) = enter_sandbox(&cfg, listener, netns) {
        println!("ERR {}", e.to_string().replace('\n', " "));
        return 1;
    }
    match run(&cfg) {
        Ok((pid, start)) => {
            println!("OK {pid} {start}{}", take_marks());
            0
        }
        Err(e) => {
            println!("ERR {}", e.to_string().replace('\n', " "));
            1
        }
    }
}

/// Reads the configuration from stdin, a unix socket whose first message also carries the
/// agent's listening socket (and the sandbox's network namespace, when it has one).
fn receive_config() -> R<(String, OwnedFd, Option<OwnedFd>)> {
    use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg};
    let mut buf = vec![0u8; 64 * 1024];
    let mut cmsg = nix::cmsg_space!([std::os::fd::RawFd; 2]);
    let (n, fds) = {
        let mut iov = [std::io::IoSliceMut::new(&mut buf)];
        let msg = ctx(
            recvmsg::<()>(0, &mut iov, Some(&mut cmsg), MsgFlags::MSG_CMSG_CLOEXEC),
            || "receive config".into(),
        )?;
        let mut fds = Vec::new();
        for c in ctx(msg.cmsgs(), || "receive config".into())? {
            if let ControlMessageOwned::ScmRights(got) = c {
                for f in got {
                    // SAFETY: the kernel just installed this descriptor for us.
                    fds.push(unsafe { OwnedFd::from_raw_fd(f) });
                }
            }
        }
        (msg.bytes, fds)
    };
    let mut fds = fds.into_iter();
    let (fd, netns) = (fds.next(), fds.next());
    buf.truncate(n);
    ctx(std::io::stdin().read_to_end(&mut buf), || {
        "read config".into()
    })?;
    let listener = fd.ok_or(InitError::Refused(
        "no listening socket came with the config",
    ))?;
    let raw = String::from_utf8(buf).map_err(|source| InitError::ConfigText { source })?;
    Ok((raw, listener, netns))
}

/// Joins the sandbox's cgroup and its uts, ipc and net namespaces, and puts the agent's
/// socket on its fd. Done here rather than between the daemon's fork and exec, so that
/// the daemon can spawn with vfork semantics instead of copying its page tables.
fn enter_sandbox(cfg: &InitConfig, listener: OwnedFd, netns: Option<OwnedFd>) -> R<()> {
    if cfg.cgroup_tasks.is_empty() {
        return Err(InitError::Refused("no cgroup to join"));
    }
    for p in &cfg.cgroup_tasks {
        // First, so that everything the sandbox ever runs is accounted. "0" moves only
        // this thread (the only one), which keeps the kernel off its global lock.
        ctx(std::fs::write(p, "0"), || format!("join {}", p.display()))?;
    }
    mark("cgroup");
    // The daemon's prepared namespace is joined while this process is still the host's
    // root; it stays owned by the host's user namespace, so the sandbox can never change
    // its addresses, routes or links.
    let flags = match (cfg.netns, netns) {
        (true, Some(ns)) => {
            ctx(nix::sched::setns(&ns, CloneFlags::CLONE_NEWNET), || {
                "join the network namespace".into()
            })?;
            CloneFlags::CLONE_NEWUTS | CloneFlags::CLONE_NEWIPC
        }
        (true, None) => {
            return Err(InitError::Refused(
                "no network namespace came with the config",
            ));
        }
        (false, _) => {
            CloneFlags::CLONE_NEWUTS | CloneFlags::CLONE_NEWIPC | CloneFlags::CLONE_NEWNET
        }
    };
    ctx(unshare(flags), || {
        "unshare uts, ipc and net namespaces".into()
    })?;
    mark("netns");
    let fd = crate::container::LISTEN_FD;
    if listener.as_raw_fd() == fd {
        // Without close-on-exec it reaches the agent; `pass_fd` clears the flag.
        ctx(crate::pass_fd(fd, fd), || "listener".into())?;
        std::mem::forget(listener);
    } else {
        ctx(crate::pass_fd(listener.as_raw_fd(), fd), || {
            "listener".into()
        })?;
    }
    ctx(nix::unistd::setsid(), || "setsid".into())?;
    mark("enter");
    Ok(())
}

fn pipe() -> R<(OwnedFd, OwnedFd)> {
    ctx(nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC), || {
        "pipe".into()
    })
}

fn run(cfg: &InitConfig) -> R<(i32, u64)> {
    // Made here, in the host's pid namespace, where /proc/PID names the helper correctly.
    let userns = if cfg.idmap_lower || !cfg.layers.is_empty() || !cfg.volumes.is_empty() {
        Some(id_mapped_userns(cfg.uid_base)?)
    } else {
        None
    };
    // Only now the pid namespace: the next fork is its PID 1 (the helper above must not
    // be, or the namespace would die with it).
    ctx(unshare(CloneFlags::CLONE_NEWPID), || {
        "unshare pid namespace".into()
    })?;
    let (to_parent_r, to_parent_w) = pipe()?;
    let (to_child_r, to_child_w) = pipe()?;
    // SAFETY: this process is single-threaded (a fresh exec that started no threads).
    match ctx(unsafe { fork() }, || "fork".into())? {
        ForkResult::Child => {
            drop(to_parent_r);
            drop(to_child_w);
            // The helper reports its own marks; these would come twice.
            take_marks();
            let mut report = std::fs::File::from(to_parent_w);
            let mut wait = std::fs::File::from(to_child_r);
            let err = child(cfg, userns.as_ref(), &mut report, &mut wait)
                .err()
                .unwrap_or(InitError::Refused("exec returned"));
            let _ = report.write_all(format!("E{err}").as_bytes());
            // SAFETY: leave without running the parent's atexit handlers twice.
            unsafe { libc::_exit(1) }
        }
        ForkResult::Parent { child } => {
            drop(to_parent_w);
            drop(to_child_r);
            mark("fork");
            let r = parent(
                cfg,
                child,
                std::fs::File::from(to_parent_r),
                std::fs::File::from(to_child_w),
            );
            if r.is_err() {
                let _ = nix::sys::signal::kill(child, nix::sys::signal::Signal::SIGKILL);
                let _ = nix::sys::wait::waitpid(child, None);
            }
            r
        }
    }
}

fn parent(
    cfg: &InitConfig,
    child: Pid,
    mut from_child: std::fs::File,
    mut to_child: std::fs::File,
) -> R<(i32, u64)> {
    let mut buf = [0u8; 1];
    ctx(from_child.read_exact(&mut buf), || {
        "sandbox setup died".into()
    })
    .map_err(|e| {
        let mut rest = String::new();
        let _ = from_child.read_to_string(&mut rest);
        if rest.is_empty() {
            e
        } else {
            InitError::Child(rest)
        }
    })?;
    if buf[0] != b'U' {
        let mut rest = String::new();
        let _ = from_child.read_to_string(&mut rest);
        return Err(InitError::Child(rest));
    }
    let map = format!("0 {} {}\n", cfg.uid_base, ID_RANGE);
    ctx(
        std::fs::write(format!("/proc/{child}/uid_map"), &map),
        || "write uid_map".into(),
    )?;
    ctx(
        std::fs::write(format!("/proc/{child}/gid_map"), &map),
        || "write gid_map".into(),
    )?;
    ctx(to_child.write_all(b"M"), || "signal child".into())?;
    mark("idmap");
    // The pipe closes without a message when the exec of the agent succeeded (after the
    // child's timings, if asked for).
    let mut rest = String::new();
    let _ = from_child.read_to_string(&mut rest);
    mark("exec");
    let mut rest = rest.as_str();
    if let Some((marks, after)) = rest.strip_prefix('T').and_then(|r| r.split_once('\n')) {
        MARKS.lock().push_str(marks);
        rest = after;
    }
    if let Some(msg) = rest.strip_prefix('E') {
        return Err(InitError::Child(msg.to_string()));
    }
    let start = crate::pid_start_time(child.as_raw())
        .ok_or(InitError::Refused("agent exited during start"))?;
    Ok((child.as_raw(), start))
}

fn child(
    cfg: &InitConfig,
    userns: Option<&OwnedFd>,
    report: &mut std::fs::File,
    wait: &mut std::fs::File,
) -> R<()> {
    setup_root(cfg, userns)?;
    ctx(unshare(CloneFlags::CLONE_NEWUSER), || {
        "unshare user namespace".into()
    })?;
    ctx(report.write_all(b"U"), || "report".into())?;
    let mut b = [0u8; 1];
    ctx(wait.read_exact(&mut b), || "wait for id map".into())?;
    mark("c_idmap");
    ctx(nix::unistd::setgroups(&[]), || "setgroups".into())?;
    ctx(
        nix::unistd::setresgid(Gid::from_raw(0), Gid::from_raw(0), Gid::from_raw(0)),
        || "setresgid".into(),
    )?;
    ctx(
        nix::unistd::setresuid(Uid::from_raw(0), Uid::from_raw(0), Uid::from_raw(0)),
        || "setresuid".into(),
    )?;
    crate::container::security::drop_capabilities()?;
    mark("c_caps");
    // SAFETY: prctl with integer arguments.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(InitError::last_os("no_new_privs"));
    }
    if cfg.host_template {
        let writable: Vec<&str> = cfg
            .volumes
            .iter()
            .filter(|v| !v.read_only)
            .map(|v| v.target.as_str())
            .collect();
        crate::container::security::apply_landlock(&writable)?;
    }
    mark("c_landlock");
    redirect_stdio()?;
    mark("c_stdio");
    crate::container::security::apply_seccomp()?;
    mark("c_seccomp");
    if cfg.timing {
        let _ = report.write_all(format!("T{}\n", take_marks()).as_bytes());
    }
    exec_agent(cfg)
}

fn redirect_stdio() -> R<()> {
    let null = ctx(
        nix::fcntl::open("/dev/null", nix::fcntl::OFlag::O_RDWR, Mode::empty()),
        || "open /dev/null".into(),
    )?;
    for fd in 0..3 {
        // SAFETY: dup2 onto the standard descriptors.
        if unsafe { libc::dup2(null.as_raw_fd(), fd) } < 0 {
            return Err(InitError::last_os("dup2"));
        }
    }
    Ok(())
}

fn exec_agent(cfg: &InitConfig) -> R<()> {
    use std::ffi::CString;
    let path = CString::new(AGENT_PATH)?;
    let argv = [CString::new(AGENT_ARGV0)?];
    let env = [
        CString::new(format!("{}={}", sandpit_abi::CONFIG_ENV, cfg.agent_config))?,
        CString::new("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")?,
    ];
    // Whatever the daemon inherited without close-on-exec must not reach the sandbox:
    // only stdio and the listener (fd 3) go on.
    // SAFETY: close_range with integer arguments; nothing else runs in this process.
    if unsafe { libc::syscall(libc::SYS_close_range, 4u32, u32::MAX, 0u32) } != 0 {
        return Err(InitError::last_os("close inherited descriptors"));
    }
    match nix::unistd::execve(&path, &argv, &env) {
        Ok(never) => match never {},
        Err(source) => Err(InitError::Exec { source }),
    }
}

fn mnt(
    src: Option<&str>,
    target: &Path,
    fstype: Option<&str>,
    flags: MsFlags,
    data: Option<&str>,
) -> R<()> {
    ctx(mount(src, target, fstype, flags, data), || {
        format!(
            "mount {} on {}",
            fstype.or(src).unwrap_or("-"),
            target.display()
        )
    })
}

fn bind_ro(src: &Path, target: &Path, extra: MsFlags) -> R<()> {
    ctx(
        mount(
            Some(src),
            target,
            None::<&str>,
            MsFlags::MS_BIND | MsFlags::MS_REC,
            None::<&str>,
        ),
        || format!("bind {} on {}", src.display(), target.display()),
    )?;
    let flags = MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | extra;
    ctx(
        mount(None::<&str>, target, None::<&str>, flags, None::<&str>),
        || format!("remount {} read-only", target.display()),
    )
}

/// A real directory with this owner and mode; a template's symlink or file in its place
/// is replaced rather than followed.
fn mkdir_owned(p: &Path, mode: u32, uid: u32) -> R<()> {
    real_dir(p)?;
    chown_nofollow(p, uid)?;
    ctx(
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)),
        || format!("chmod {}", p.display()),
    )
}

/// A regular file with this content and owner; a symlink in its place is replaced.
fn write_owned(p: &Path, content: &str, uid: u32) -> R<()> {
    if std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_symlink()) {
        ctx(std::fs::remove_file(p), || {
            format!("replace {}", p.display())
        })?;
    }
    ctx(std::fs::write(p, content), || {
        format!("write {}", p.display())
    })?;
    chown_nofollow(p, uid)
}

/// Gives `p` (never a symlink's target) to `uid`, group the same number.
fn chown_nofollow(p: &Path, uid: u32) -> R<()> {
    let flags = nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW;
    let (u, g) = (Some(Uid::from_raw(uid)), Some(Gid::from_raw(uid)));
    ctx(
        nix::unistd::fchownat(nix::fcntl::AT_FDCWD, p, u, g, flags),
        || format!("chown {}", p.display()),
    )
}

fn setup_root(cfg: &InitConfig, userns: Option<&OwnedFd>) -> R<()> {
    // A mount namespace of PID 1's own: pivot_root must not move the init helper, which
    // still needs the host's /proc to write the id maps.
    ctx(
        unshare(CloneFlags::CLONE_NEWNS | CloneFlags::CLONE_NEWCGROUP),
        || "unshare mount and cgroup namespaces".into(),
    )?;
    mark("c_unshare");
    mnt(
        None,
        Path::new("/"),
        None,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None,
    )?;
    mark("c_private");
    let layer = cfg.dir.join("layer");
    let root = cfg.dir.join("rootfs");
    // The writable layer lives on a size-capped tmpfs: writing past it is ENOSPC and can
    // never reach the host's disk. It is charged to the sandbox's memory cgroup.
    // mode 0700 and the host's root as owner: the daemon reaches it through the sandbox's
    // root (`LAYER_MOUNT`), where no one inside may enter it.
    let opts = format!("size={},mode=0700", cfg.disk_bytes);
    mnt(
        Some("tmpfs"),
        &layer,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some(&opts),
    )?;
    let upper = layer.join("upper");
    let work = layer.join("work");
    mkdir_owned(&upper, 0o755, cfg.uid_base)?;
    mkdir_owned(&work, 0o700, 0)?;
    populate_upper(cfg, &upper)?;
    mark("c_layer");
    // The overlay's options are shown to the sandbox (`mount`, /proc/self/mountinfo) as
    // they were given: named relative to the sandbox's directory, they tell it nothing
    // of the host's paths (data directory, sandbox id, template location).
    let template = match userns {
        Some(ns) if cfg.idmap_lower => {
            idmapped_copy(&cfg.lower, &cfg.dir.join("lower"), ns)?;
            "lower".to_string()
        }
        _ => {
            let link = cfg.dir.join("lower");
            ctx(std::os::unix::fs::symlink(&cfg.lower, &link), || {
                format!("link {}", link.display())
            })?;
            "lower".to_string()
        }
    };
    let mut lowers = Vec::with_capacity(cfg.layers.len() + 1);
    for (i, l) in cfg.layers.iter().enumerate() {
        let ns = userns.ok_or(InitError::Refused(
            "layers need an id-mapped user namespace",
        ))?;
        idmapped_copy(l, &cfg.dir.join(format!("l{i}")), ns)?;
        lowers.push(format!("l{i}"));
    }
    lowers.push(template);
    let ovl = format!(
        "lowerdir={},upperdir=layer/upper,workdir=layer/work",
        lowers.join(":")
    );
    ctx(nix::unistd::chdir(&cfg.dir), || {
        format!("chdir {}", cfg.dir.display())
    })?;
    // nodev: a device node shipped in a template must not open the host's devices.
    mnt(
        Some("overlay"),
        &root,
        Some("overlay"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some(&ovl),
    )?;
    mark("c_overlay");
    for b in &cfg.host_binds {
        let target = root.join(b.strip_prefix("/").unwrap_or(b));
        bind_ro(b, &target, MsFlags::MS_NOSUID | MsFlags::MS_NODEV)?;
    }
    for (src, at) in &cfg.ro_binds {
        // Each component a real directory: a symlink in the tree must not lead the bind
        // onto a host path.
        let mut target = root.clone();
        for part in at
            .components()
            .filter(|c| matches!(c, std::path::Component::Normal(_)))
        {
            target.push(part);
            real_dir(&target)?;
        }
        bind_ro(src, &target, MsFlags::MS_NOSUID | MsFlags::MS_NODEV)?;
    }
    if cfg.sudo && cfg.host_template {
        shim_overlay(&root)?;
    }
    mark("c_binds");

    // Until pivot_root the host is visible and this process is the host's root, so only
    // mount targets are touched here, each made a real directory of the overlay first: a
    // template's `proc -> /somewhere` symlink must not lead a mount onto a host path.
    // `populate_upper` made them in the upper layer, which hides whatever the template
    // has under these names; checked again on the merged tree all the same.
    for d in ["proc", "sys", "dev", ".sandpit"] {
        real_dir(&root.join(d))?;
    }
    let agent = root.join(AGENT_PATH.trim_start_matches('/'));
    match std::fs::symlink_metadata(&agent) {
        Ok(m) if m.is_file() => {}
        _ => {
            return Err(InitError::Refused(
                "the agent mount point is not a plain file",
            ));
        }
    }
    bind_ro(
        &cfg.agent_exe,
        &agent,
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
    )?;

    // The writable layer, for the daemon's snapshots: read-only, and closed to the sandbox
    // by the tmpfs root's owner and mode.
    let layer_view = root.join(LAYER_MOUNT);
    match std::fs::symlink_metadata(&layer_view) {
        Ok(m) if m.is_dir() => {}
        _ => {
            return Err(InitError::Refused(
                "the layer mount point is not a directory",
            ));
        }
    }
    bind_ro(&layer, &layer_view, ro_flags())?;

    mark("c_agent");
    mount_proc(&root)?;
    fresh_boot_id(&root, &layer)?;
    mark("c_proc");
    mnt(
        Some("sysfs"),
        &root.join("sys"),
        Some("sysfs"),
        ro_flags(),
        None,
    )?;
    mask(&root, "sys/firmware")?;
    mark("c_sys");
    mount_dev(&root)?;
    mark("c_dev");
    // Last, so that their mount points cannot lead onto any mount made above.
    if let Some(ns) = userns.filter(|_| !cfg.volumes.is_empty()) {
        crate::volume::mount_in_sandbox(&root, &cfg.volumes, ns, cfg.uid_base)?;
        mark("c_volumes");
    }

    ctx(nix::unistd::sethostname("sandpit"), || "sethostname".into())?;
    loopback_up()?;
    // The agent must outlive an OOM of its commands. The legacy oom_adj interface lowers
    // the score without setting the floor that oom_score_adj would set for every
    // descendant, so commands cannot shield themselves again.
    let _ = std::fs::write("/proc/self/oom_adj", "-17");

    mark("c_net");
    ctx(nix::unistd::chdir(&root), || "chdir rootfs".into())?;
    ctx(nix::unistd::pivot_root(".", "."), || "pivot_root".into())?;
    ctx(umount2(".", MntFlags::MNT_DETACH), || {
        "detach old root".into()
    })?;
    ctx(nix::unistd::chdir("/"), || "chdir /".into())?;
    mark("c_pivot");

    // From here on only the sandbox's own tree is visible: whatever symlinks a template
    // holds resolve inside it.
    let root = Path::new("/");
    if !cfg.host_template {
        ensure_user_account(root, cfg.uid_base)?;
        if cfg.sudo {
            install_shims(root, cfg.uid_base)?;
        }
    }
    if let Some(ca) = &cfg.extra_ca {
        crate::trust::fill_bundle(root, ca)?;
    }
    mark("c_files");
    Ok(())
}

/// Directories of the host template that belong to the sandbox's root.
const HOST_WRITABLE: &[(&str, u32)] = &[
    ("var", 0o755),
    ("var/tmp", 0o1777),
    ("var/cache", 0o755),
    ("var/lib", 0o755),
    ("var/log", 0o755),
    ("opt", 0o755),
    ("mnt", 0o755),
];

/// Writes the sandbox's own directories and files straight into the (still empty) upper
/// layer before the overlay exists: an upper entry hides the template's entry of the same
/// name whatever its type, and nothing has to be copied up. Only files whose content does
/// not depend on the template; `ensure_user_account` edits the template's files later,
/// inside the sandbox, where its symlinks cannot reach the host.
fn populate_upper(cfg: &InitConfig, upper: &Path) -> R<()> {
    let uroot = cfg.uid_base;
    let uuser = cfg.uid_base + sandpit_abi::USER_UID;
    for (d, mode, uid) in [
        ("tmp", 0o1777, uroot),
        ("root", 0o700, uroot),
        ("home", 0o755, uroot),
        ("home/user", 0o755, uuser),
        ("workspace", 0o755, uuser),
        ("etc", 0o755, uroot),
        // Mount points, the host's root's like the mounts on them.
        ("proc", 0o755, 0),
        ("sys", 0o755, 0),
        ("dev", 0o755, 0),
        (".sandpit", 0o755, 0),
        (LAYER_MOUNT, 0o700, 0),
    ]
    .into_iter()
    // The host template's skeleton belongs to the host's root; these the sandbox's root
    // must be able to write, as on any Debian system.
    .chain(
        HOST_WRITABLE
            .iter()
            .copied()
            .filter(|_| cfg.host_template)
            .map(|(d, mode)| (d, mode, uroot)),
    )
    // The sudo socket's directory and its parent: the sandbox root's, closed to `user`,
    // so the socket cannot be replaced by anyone the sudo is meant to lift.
    .chain(
        [("run", 0o755, uroot), (SUDO_DIR, 0o755, uroot)]
            .into_iter()
            .filter(|_| cfg.sudo),
    ) {
        let p = upper.join(d);
        ctx(std::fs::create_dir(&p), || format!("mkdir {}", p.display()))?;
        chown_nofollow(&p, uid)?;
        ctx(
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)),
            || format!("chmod {}", p.display()),
        )?;
    }
    let mut files = vec![
        ("etc/hostname", "sandpit\n", uroot),
        ("etc/hosts", crate::template::HOSTS, uroot),
        (
            "etc/resolv.conf",
            cfg.resolv_conf.as_deref().unwrap_or(""),
            uroot,
        ),
        (AGENT_PATH.trim_start_matches('/'), "", 0),
    ];
    if cfg.host_template {
        files.push(("etc/passwd", crate::template::PASSWD, uroot));
        files.push(("etc/group", crate::template::GROUP, uroot));
    }
    for (f, content, uid) in files {
        let p = upper.join(f);
        ctx(std::fs::write(&p, content), || {
            format!("write {}", p.display())
        })?;
        chown_nofollow(&p, uid)?;
    }
    if let Some(ca) = &cfg.extra_ca {
        crate::trust::prepare(upper, ca)?;
    }
    Ok(())
}

/// The `python` alias's target in the tree under `root`, when the tree has `python3` but
/// no `python`.
fn python_target(root: &Path) -> Option<&'static str> {
    let exists = |p: &str| std::fs::symlink_metadata(root.join(p.trim_start_matches('/'))).is_ok();
    if PYTHON.iter().any(|p| exists(p)) {
        return None;
    }
    PYTHON3.iter().copied().find(|p| exists(p))
}

/// The host template's `/usr` is the host's, read-only: `sudo` and `python` are laid over
/// its `/usr/local/bin` with a read-only overlay whose top layer is a directory of two
/// symlinks in the sandbox's own directory (named relative to it, like the root overlay,
/// so the mount table shows no host path).
fn shim_overlay(root: &Path) -> R<()> {
    let target = root.join(SHIM_DIR);
    if !std::fs::symlink_metadata(&target).is_ok_and(|m| m.is_dir()) {
        // A host without /usr/local/bin: nothing to lay the shims over.
        return Ok(());
    }
    let shims = Path::new("shims");
    ctx(std::fs::create_dir(shims), || "mkdir shims".into())?;
    ctx(
        std::os::unix::fs::symlink(AGENT_PATH, shims.join("sudo")),
        || "link shims/sudo".into(),
    )?;
    if let Some(py) = python_target(root) {
        ctx(std::os::unix::fs::symlink(py, shims.join("python")), || {
            "link shims/python".into()
        })?;
    }
    let rel = Path::new("rootfs").join(SHIM_DIR);
    let opts = format!("lowerdir=shims:{}", rel.display());
    mnt(
        Some("overlay"),
        &target,
        Some("overlay"),
        MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some(&opts),
    )
}

/// A custom template's `/usr` is its own: `sudo` and `python` become symlinks in its
/// `/usr/local/bin` (the writable layer), unless the template has these names already.
/// Runs after pivot_root, so the template's symlinks resolve inside the sandbox.
fn install_shims(root: &Path, uroot: u32) -> R<()> {
    let dir = root.join(SHIM_DIR);
    if !std::fs::symlink_metadata(&dir).is_ok_and(|m| m.is_dir()) {
        return Ok(());
    }
    let mut links = vec![("sudo", AGENT_PATH)];
    if let Some(py) = python_target(root) {
        links.push(("python", py));
    }
    for (name, to) in links {
        let link = dir.join(name);
        if std::fs::symlink_metadata(&link).is_ok() {
            continue;
        }
        ctx(std::os::unix::fs::symlink(to, &link), || {
            format!("link {}", link.display())
        })?;
        chown_nofollow(&link, uroot)?;
    }
    Ok(())
}

/// Makes `p` a real directory: a symlink or file of the template is whited out first.
fn real_dir(p: &Path) -> R<()> {
    match std::fs::symlink_metadata(p) {
        Ok(m) if m.is_dir() => return Ok(()),
        Ok(_) => ctx(std::fs::remove_file(p), || {
            format!("replace {}", p.display())
        })?,
        Err(_) => {}
    }
    ctx(std::fs::create_dir(p), || format!("mkdir {}", p.display()))
}

/// A user namespace whose uid/gid 0..65536 map to the sandbox's host range, held open by
/// fd after the short-lived process that created it has gone.
fn id_mapped_userns(uid_base: u32) -> R<OwnedFd> {
    let (ready_r, ready_w) = pipe()?;
    let (hold_r, hold_w) = pipe()?;
    // SAFETY: single-threaded process; the child only makes raw syscalls and exits.
    match ctx(unsafe { fork() }, || "fork".into())? {
        ForkResult::Child => {
            drop(ready_r);
            drop(hold_w);
            // SAFETY: raw syscalls, then _exit.
            unsafe {
                let ok = libc::unshare(libc::CLONE_NEWUSER) == 0;
                libc::write(
                    ready_w.as_raw_fd(),
                    if ok { b"U".as_ptr() } else { b"E".as_ptr() }.cast(),
                    1,
                );
                let mut b = [0u8; 1];
                libc::read(hold_r.as_raw_fd(), b.as_mut_ptr().cast(), 1);
                libc::_exit(0)
            }
        }
        ForkResult::Parent { child } => {
            drop(ready_w);
            drop(hold_r);
            let result = (|| {
                let mut b = [0u8; 1];
                ctx(std::fs::File::from(ready_r).read_exact(&mut b), || {
                    "userns helper".into()
                })?;
                if b[0] != b'U' {
                    return Err(InitError::Refused("userns helper could not unshare"));
                }
                let map = format!("0 {uid_base} {ID_RANGE}\n");
                ctx(
                    std::fs::write(format!("/proc/{child}/uid_map"), &map),
                    || "helper uid_map".into(),
                )?;
                ctx(
                    std::fs::write(format!("/proc/{child}/gid_map"), &map),
                    || "helper gid_map".into(),
                )?;
                ctx(
                    nix::fcntl::open(
                        format!("/proc/{child}/ns/user").as_str(),
                        nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_CLOEXEC,
                        Mode::empty(),
                    ),
                    || "open helper userns".into(),
                )
            })();
            drop(hold_w);
            let _ = nix::sys::wait::waitpid(child, None);
            result
        }
    }
}

/// Mount attributes of `mount_setattr` (<linux/mount.h>).
pub(crate) const MOUNT_ATTR_RDONLY: u64 = 0x0000_0001;
pub(crate) const MOUNT_ATTR_NOSUID: u64 = 0x0000_0002;
pub(crate) const MOUNT_ATTR_NODEV: u64 = 0x0000_0004;
const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;

/// Attaches an idmapped clone of `src` at `target` (a plain directory it creates).
fn idmapped_copy(src: &Path, target: &Path, userns: &OwnedFd) -> R<PathBuf> {
    use std::ffi::CString;
    ctx(std::fs::create_dir_all(target), || {
        format!("mkdir {}", target.display())
    })?;
    let ctarget = CString::new(target.as_os_str().as_encoded_bytes())?;
    let tree = idmapped_tree(src, userns, 0)?;
    attach_tree(&tree, nix::fcntl::AT_FDCWD, &ctarget)
        .map_err(|e| InitError::io(format!("attach idmapped {}", src.display()), e))?;
    Ok(target.to_path_buf())
}

/// A detached clone of the mount at `src` whose files appear through `userns`'s id map
/// (on-disk id N is host id uid_base+N), with the extra `MOUNT_ATTR_*` flags `attrs`.
pub(crate) fn idmapped_tree(src: &Path, userns: &OwnedFd, attrs: u64) -> R<OwnedFd> {
    use std::ffi::CString;
    #[repr(C)]
    struct MountAttr {
        attr_set: u64,
        attr_clr: u64,
        propagation: u64,
        userns_fd: u64,
    }
    const OPEN_TREE_CLONE: libc::c_uint = 1;
    let csrc = CString::new(src.as_os_str().as_encoded_bytes())?;
    let empty = c"";
    // SAFETY: the new mount API with valid C strings and a correctly sized attr struct.
    unsafe {
        let tree = libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            csrc.as_ptr(),
            OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint,
        ) as libc::c_int;
        if tree < 0 {
            return Err(InitError::last_os(format!("open_tree {}", src.display())));
        }
        let tree = OwnedFd::from_raw_fd(tree);
        let attr = MountAttr {
            attr_set: MOUNT_ATTR_IDMAP | attrs,
            attr_clr: 0,
            propagation: 0,
            userns_fd: userns.as_raw_fd() as u64,
        };
        let r = libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_EMPTY_PATH as libc::c_uint,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        );
        if r < 0 {
            return Err(InitError::last_os(format!("idmap {}", src.display())));
        }
        Ok(tree)
    }
}

/// Attaches a detached mount tree at `path` relative to `dir` (an empty `path` means
/// `dir` itself, which then needs no path lookup at all).
pub(crate) fn attach_tree(
    tree: &OwnedFd,
    dir: std::os::fd::BorrowedFd<'_>,
    path: &std::ffi::CStr,
) -> std::io::Result<()> {
    const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 4;
    const MOVE_MOUNT_T_EMPTY_PATH: libc::c_uint = 0x40;
    let mut flags = MOVE_MOUNT_F_EMPTY_PATH;
    if path.is_empty() {
        flags |= MOVE_MOUNT_T_EMPTY_PATH;
    }
    // SAFETY: move_mount with open descriptors and NUL-terminated strings.
    let r = unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            tree.as_raw_fd(),
            c"".as_ptr(),
            dir.as_raw_fd(),
            path.as_ptr(),
            flags,
        )
    };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn ro_flags() -> MsFlags {
    MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC
}

/// Adds the `user` account to a custom root filesystem that lacks it.
/// Reads a template's account file as this (still fully privileged) process may: never
/// through a symlink (it could point at /proc or /sys), never a FIFO or device (which could
/// block or leak), and at most 1 MiB. Anything else counts as an empty file.
fn read_account_file(p: &Path) -> String {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let Ok(f) = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(p)
    else {
        return String::new();
    };
    if !f.metadata().is_ok_and(|m| m.is_file()) {
        return String::new();
    }
    let mut text = String::new();
    match f.take(1 << 20).read_to_string(&mut text) {
        Ok(_) => text,
        Err(_) => String::new(),
    }
}

fn ensure_user_account(root: &Path, uroot: u32) -> R<()> {
    let passwd = root.join("etc/passwd");
    let cur = read_account_file(&passwd);
    if !cur.lines().any(|l| l.starts_with("user:")) {
        let base = if cur.is_empty() {
            "root:x:0:0:root:/root:/bin/sh\n".to_string()
        } else {
            cur
        };
        write_owned(
            &passwd,
            &format!(
                "{base}user:x:{u}:{u}:user:/home/user:/bin/sh\n",
                u = sandpit_abi::USER_UID
            ),
            uroot,
        )?;
    }
    let group = root.join("etc/group");
    let cur = read_account_file(&group);
    if !cur.lines().any(|l| l.starts_with("user:")) {
        let base = if cur.is_empty() {
            "root:x:0:\n".to_string()
        } else {
            cur
        };
        write_owned(
            &group,
            &format!("{base}user:x:{}:\n", sandpit_abi::USER_UID),
            uroot,
        )?;
    }
    Ok(())
}

/// Paths the OCI default profile hides or makes read-only.
const PROC_MASKED: &[&str] = &[
    "proc/acpi",
    "proc/kcore",
    "proc/keys",
    "proc/latency_stats",
    "proc/timer_list",
    "proc/timer_stats",
    "proc/sched_debug",
    "proc/scsi",
    "proc/asound",
];
const PROC_READONLY: &[&str] = &[
    "proc/bus",
    "proc/fs",
    "proc/irq",
    "proc/sys",
    "proc/sysrq-trigger",
];

fn mount_proc(root: &Path) -> R<()> {
    let p = root.join("proc");
    mnt(
        Some("proc"),
        &p,
        Some("proc"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        None,
    )?;
    for m in PROC_MASKED {
        mask(root, m)?;
    }
    for r in PROC_READONLY {
        let t = root.join(r);
        if t.exists() {
            bind_ro(
                &t,
                &t,
                MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
            )?;
        }
    }
    Ok(())
}

/// Gives the sandbox a boot id of its own for this start, as a guest kernel has: the
/// host's would stay the same across a files-only pause and its restart, which E2B's
/// SDK users read as proof of a cold boot. A freeze keeps it (the mount stays). The file
/// lives at the top of the layer's tmpfs, beside (never in) the upper layer, so that the
/// sandbox's mount table names no host path.
fn fresh_boot_id(root: &Path, layer: &Path) -> R<()> {
    let target = root.join("proc/sys/kernel/random/boot_id");
    if !target.exists() {
        return Ok(());
    }
    // Read in the host's procfs, still mounted at /proc until pivot_root.
    let id = ctx(
        std::fs::read_to_string("/proc/sys/kernel/random/uuid"),
        || "read a fresh uuid".into(),
    )?;
    let src = layer.join("boot_id");
    ctx(std::fs::write(&src, id.as_bytes()), || {
        format!("write {}", src.display())
    })?;
    bind_ro(
        &src,
        &target,
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
    )
}

fn mask(root: &Path, rel: &str) -> R<()> {
    let t = root.join(rel);
    match std::fs::symlink_metadata(&t) {
        Ok(m) if m.is_dir() => mnt(Some("tmpfs"), &t, Some("tmpfs"), ro_flags(), Some("size=0")),
        Ok(_) => ctx(
            mount(
                Some("/dev/null"),
                &t,
                None::<&str>,
                MsFlags::MS_BIND,
                None::<&str>,
            ),
            || format!("mask {rel}"),
        ),
        Err(_) => Ok(()),
    }
}

fn mount_dev(root: &Path) -> R<()> {
    let dev = root.join("dev");
    mnt(
        Some("tmpfs"),
        &dev,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("mode=0755,size=64k"),
    )?;
    for (name, major, minor) in [
        ("null", 1, 3),
        ("zero", 1, 5),
        ("full", 1, 7),
        ("random", 1, 8),
        ("urandom", 1, 9),
        ("tty", 5, 0),
    ] {
        let p = dev.join(name);
        ctx(
            mknod(
                &p,
                SFlag::S_IFCHR,
                Mode::from_bits_truncate(0o666),
                makedev(major, minor),
            ),
            || format!("mknod {name}"),
        )?;
        ctx(
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o666)),
            || format!("chmod {name}"),
        )?;
    }
    for (name, target) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
        ("ptmx", "pts/ptmx"),
    ] {
        ctx(std::os::unix::fs::symlink(target, dev.join(name)), || {
            format!("symlink /dev/{name}")
        })?;
    }
    for d in ["pts", "shm"] {
        ctx(std::fs::create_dir(dev.join(d)), || {
            format!("mkdir /dev/{d}")
        })?;
    }
    mnt(
        Some("devpts"),
        &dev.join("pts"),
        Some("devpts"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("newinstance,ptmxmode=0666,mode=0620"),
    )?;
    mnt(
        Some("shm"),
        &dev.join("shm"),
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("mode=1777,size=64m"),
    )
}

fn loopback_up() -> R<()> {
    // SAFETY: an AF_INET socket only used for the two interface ioctls below.
    unsafe {
        let s = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if s < 0 {
            return Err(InitError::last_os("socket"));
        }
        let mut req: libc::ifreq = std::mem::zeroed();
        for (i, b) in b"lo\0".iter().enumerate() {
            req.ifr_name[i] = *b as libc::c_char;
        }
        let mut r = libc::ioctl(s, libc::SIOCGIFFLAGS, &mut req);
        if r == 0 {
            req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
            r = libc::ioctl(s, libc::SIOCSIFFLAGS, &req);
        }
        let err = std::io::Error::last_os_error();
        libc::close(s);
        if r != 0 {
            return Err(InitError::io("bring up lo", err));
        }
    }
    Ok(())
}

#[cfg(test)]
mod init_error_tests {
    use super::InitError;
    use std::error::Error as _;

    #[test]
    fn each_step_reads_as_the_reply_did_and_keeps_its_errno() {
        let e = super::ctx(Err::<(), _>(nix::errno::Errno::EPERM), || {
            "unshare pid namespace".into()
        })
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("unshare pid namespace: {}", nix::errno::Errno::EPERM)
        );
        let errno = e
            .source()
            .and_then(|s| s.downcast_ref::<nix::errno::Errno>());
        assert_eq!(errno, Some(&nix::errno::Errno::EPERM));

        let io = std::io::Error::from_raw_os_error(libc::ENOSPC);
        let shown = io.to_string();
        let e = super::ctx(Err::<(), _>(io), || "write /x".into()).unwrap_err();
        assert_eq!(e.to_string(), format!("write /x: {shown}"));
        let cause = e.source().and_then(|s| s.downcast_ref::<std::io::Error>());
        assert_eq!(cause.and_then(|e| e.raw_os_error()), Some(libc::ENOSPC));

        let e = InitError::Exec {
            source: nix::errno::Errno::ENOENT,
        };
        assert_eq!(e.to_string(), "exec agent: Some(ENOENT)");
        assert!(e.source().is_some());

        let e = InitError::from(std::ffi::CString::new("a\0b").unwrap_err());
        assert!(e.to_string().contains("nul byte"), "{e}");
        assert_eq!(
            InitError::Refused("no cgroup to join").to_string(),
            "no cgroup to join"
        );
        // What PID 1 sent over the pipe comes back word for word.
        assert_eq!(
            InitError::Child("mount proc on /x: EPERM".into()).to_string(),
            "mount proc on /x: EPERM"
        );
    }
}

#[cfg(test)]
mod account_file_tests {
    use super::read_account_file;

    #[test]
    fn only_regular_files_are_read_and_only_a_bounded_amount() {
        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("passwd");
        std::fs::write(&plain, "root:x:0:0::/root:/bin/sh\n").unwrap();
        assert_eq!(read_account_file(&plain), "root:x:0:0::/root:/bin/sh\n");
        // A symlink (a template's passwd pointing at /proc/kallsyms, say) is not followed.
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&plain, &link).unwrap();
        assert_eq!(read_account_file(&link), "");
        // A FIFO neither blocks nor counts.
        let fifo = dir.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        assert_eq!(read_account_file(&fifo), "");
        assert_eq!(read_account_file(&dir.path().join("missing")), "");
        let big = dir.path().join("big");
        std::fs::write(&big, "a".repeat(3 << 20)).unwrap();
        assert_eq!(read_account_file(&big).len(), 1 << 20);
    }
}
