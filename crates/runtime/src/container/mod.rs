//! The `container` runtime: namespaces, an overlay root on a size-capped tmpfs, cgroup
//! limits, a private uid range per sandbox, dropped capabilities, no_new_privs, Landlock
//! and seccomp. The daemon side lives here; the setup inside the namespaces is `init`.

pub mod security;

use crate::cgroup::Cgroups;
use crate::init::{ID_RANGE, InitConfig};
use crate::{
    Capabilities, Runtime, RuntimeError, SandboxHandle, SandboxSpec, Stats, TemplateSource,
};
use parking_lot::Mutex;
use sandpit_abi::{AgentConfig, IsolationMode};
use std::collections::BTreeSet;
use std::io::{BufRead, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// First host uid handed to sandboxes; far above ranges that distributions give users.
const UID_FLOOR: u32 = 1_000_000_000;
const MAX_SLOTS: u32 = 16_384;
/// The fd number the agent finds its listening socket on.
pub const LISTEN_FD: i32 = 3;

/// Runs sandboxes in Linux namespaces.
pub struct ContainerRuntime {
    sandboxes_dir: PathBuf,
    host_skeleton: PathBuf,
    host_binds: Vec<PathBuf>,
    /// Read-only binds at other paths for `host` sandboxes (host path, sandbox path).
    ro_binds: Vec<(PathBuf, PathBuf)>,
    self_exe: PathBuf,
    cgroups: Cgroups,
    /// Uid-range slots in use, each with the sandbox that holds it.
    slots: Mutex<std::collections::BTreeMap<u32, String>>,
    /// Agent sockets of sandboxes created but not started yet.
    pending: crate::PendingSockets,
}

impl ContainerRuntime {
    /// Prepares the runtime under `data_dir`; `self_exe` is the sandpit binary (it is both
    /// the init helper and the agent).
    pub fn new(
        data_dir: &Path,
        self_exe: PathBuf,
        cgroup_root: &Path,
    ) -> Result<Self, RuntimeError> {
        let sandboxes_dir = data_dir.join("sandboxes");
        crate::private_dir(&sandboxes_dir)?;
        let templates_dir = data_dir.join("templates");
        std::fs::create_dir_all(data_dir.join("templates"))
            .map_err(|e| RuntimeError::io("create templates dir", e))?;
        let (host_skeleton, host_binds) = crate::template::host_skeleton(&templates_dir)?;
        let cgroups = Cgroups::detect(cgroup_root, &cgroup_parent(data_dir))?;
        // The mount comes last, so that a step failing before it leaves nothing mounted.
        if let Err(e) = ensure_tmpfs(&sandboxes_dir) {
            cgroups.remove_parent_if_empty();
            return Err(e);
        }
        Ok(Self {
            sandboxes_dir,
            host_skeleton,
            host_binds,
            ro_binds: Vec::new(),
            self_exe,
            cgroups,
            slots: Mutex::default(),
            pending: Default::default(),
        })
    }

    /// Binds host directory `host` read-only at `at` in every `host`-template sandbox.
    pub fn with_ro_bind(mut self, host: PathBuf, at: PathBuf) -> Self {
        self.ro_binds.push((host, at));
        self
    }

    fn alloc_slot(&self, id: &str) -> Result<u32, RuntimeError> {
        let mut slots = self.slots.lock();
        let free = (0..MAX_SLOTS)
            .find(|s| !slots.contains_key(s))
            .ok_or_else(|| RuntimeError::Setup("no free uid range".into()))?;
        slots.insert(free, id.to_string());
        Ok(free)
    }

    /// Frees the slot of sandbox `id`; a slot that another sandbox holds by now is left
    /// alone, so a repeated teardown can never hand a live sandbox's uids to a new one.
    fn free_slot(&self, uid_base: Option<u32>, id: &str) {
        if let Some(base) = uid_base {
            let mut slots = self.slots.lock();
            let slot = (base - UID_FLOOR) / ID_RANGE;
            if slots.get(&slot).is_some_and(|holder| holder == id) {
                slots.remove(&slot);
            }
        }
    }

    fn dir_of(&self, id: &str) -> PathBuf {
        self.sandboxes_dir.join(id)
    }

    /// Directories, cgroup and the agent's listening socket; nothing runs yet.
    fn prepare(
        &self,
        spec: &SandboxSpec,
        dir: &Path,
        uid_base: u32,
    ) -> Result<SandboxHandle, RuntimeError> {
        for d in [dir.to_path_buf(), dir.join("rootfs"), dir.join("layer")] {
            std::fs::create_dir(&d)
                .map_err(|e| RuntimeError::io(format!("create {}", d.display()), e))?;
        }
        self.cgroups.create(&spec.id, &spec.limits)?;
        let socket = self.pending.bind(&spec.id, dir)?;
        Ok(SandboxHandle {
            id: spec.id.clone(),
            pid: 0,
            pid_start: 0,
            socket,
            dir: dir.to_path_buf(),
            uid_base: Some(uid_base),
            net: None,
        })
    }

    /// Builds the sandbox in its namespaces and execs the agent.
    fn launch(&self, spec: &SandboxSpec, h: &mut SandboxHandle) -> Result<(), RuntimeError> {
        let timing = tracing::enabled!(tracing::Level::DEBUG);
        let t0 = crate::init::mono_us();
        let listener = self.pending.take(&spec.id)?;
        let (dir, uid_base) = (
            h.dir.clone(),
            h.uid_base
                .ok_or_else(|| RuntimeError::Setup("no uid range".into()))?,
        );
        let (lower, host_template) = match &spec.template {
            TemplateSource::Host => (self.host_skeleton.clone(), true),
            TemplateSource::Rootfs { path } => (path.clone(), false),
        };
        let mut env = spec.env.clone();
        if spec.extra_ca_pem.is_some() {
            crate::trust::add_env(&mut env);
        }
        let agent = AgentConfig {
            mode: IsolationMode::Container,
            root: PathBuf::from("/"),
            workdir: spec.workdir.clone(),
            env,
            listen_fd: Some(LISTEN_FD),
            listen_path: None,
            sudo: spec.sudo,
            live: Default::default(),
        };
        let init = InitConfig {
            dir: dir.clone(),
            lower,
            host_binds: if host_template {
                self.host_binds.clone()
            } else {
                Vec::new()
            },
            ro_binds: if host_template {
                self.ro_binds.clone()
            } else {
                Vec::new()
            },
            host_template,
            disk_bytes: spec.limits.disk_bytes,
            uid_base,
            agent_exe: self.self_exe.clone(),
            idmap_lower: !host_template,
            agent_config: serde_json::to_string(&agent).map_err(|source| RuntimeError::Encode {
                what: "agent config",
                source,
            })?,
            timing,
            cgroup_tasks: self.cgroups.procs_files(&spec.id),
            volumes: spec.volumes.clone(),
            layers: spec.layers.clone(),
            extra_ca: spec.extra_ca_pem.clone(),
            netns: spec.net.is_some(),
            resolv_conf: spec.net.as_ref().map(|n| n.resolv_conf.clone()),
            sudo: spec.sudo,
        };
        let (ours, theirs) = std::os::unix::net::UnixStream::pair()
            .map_err(|e| RuntimeError::io("config socket", e))?;
        // No pre_exec: the helper joins the cgroup and namespaces itself, which lets the
        // standard library spawn with posix_spawn (vfork semantics). A fork would copy
        // the daemon's page tables and hold its mmap lock, stalling every other thread.
        let mut cmd = Command::new(&self.self_exe);
        cmd.arg("__sandbox-init")
            .env_clear()
            .stdin(Stdio::from(std::os::fd::OwnedFd::from(theirs)))
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        // Serialized before the spawn: a failure must not leave the helper waiting.
        let payload = serde_json::to_vec(&init).map_err(|source| RuntimeError::Encode {
            what: "init config",
            source,
        })?;
        let mut child = cmd
            .spawn()
            .map_err(|e| RuntimeError::io("spawn sandbox init", e))?;
        drop(cmd);
        let t_spawn = crate::init::mono_us();

        let mut fds = vec![listener.as_raw_fd()];
        if let Some(n) = &spec.net {
            fds.push(n.netns.as_raw_fd());
        }
        let sent = send_with_fds(&ours, &payload, &fds)
            .map_err(|e| RuntimeError::io("send init config", e));
        drop(listener);
        drop(ours);
        if let Err(e) = sent {
            let _ = child.kill();
            let _ = child.wait();
            return Err(e);
        }
        let mut line = String::new();
        if let Some(out) = child.stdout.take() {
            let _ = std::io::BufReader::new(out).read_line(&mut line);
        }
        let t_reply = crate::init::mono_us();
        let _ = child.wait();
        let line = line.trim();
        let mut parts = line.split_whitespace();
        match (parts.next(), parts.next(), parts.next()) {
            (Some("OK"), Some(pid), Some(start)) => {
                if timing {
                    log_timing(&spec.id, t0, t_spawn, t_reply, parts);
                }
                let bad = || RuntimeError::Setup(format!("bad init reply {line:?}"));
                h.pid = pid.parse().map_err(|_| bad())?;
                h.pid_start = start.parse().map_err(|_| bad())?;
                Ok(())
            }
            _ => {
                let msg = line.strip_prefix("ERR ").unwrap_or(line).to_string();
                // The helper's error crossed a process boundary as this line, so only its
                // text is left. A mount path the template turns out to refuse is the
                // request's fault.
                Err(if msg.starts_with(crate::volume::SPEC_ERROR) {
                    RuntimeError::InvalidSpec(msg)
                } else {
                    RuntimeError::Setup(msg)
                })
            }
        }
    }

    /// Removes what is left of a sandbox given only its id.
    fn cleanup(&self, id: &str) -> Result<(), RuntimeError> {
        self.cgroups.kill_all(id)?;
        self.cgroups.remove(id)?;
        let dir = self.dir_of(id);
        // Mounts lived only in the sandbox's own mount namespace, so once its processes
        // are gone the directory is plain files.
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(RuntimeError::io(format!("remove {}", dir.display()), e)),
        }
    }
}

/// Lower layers are joined with ':' in overlay options, which know no escaping here.
fn check_layer_path(p: &Path) -> Result<(), RuntimeError> {
    let s = p.as_os_str().as_encoded_bytes();
    if !p.is_absolute() || s.iter().any(|b| matches!(b, b':' | b',' | b'\\' | 0)) {
        return Err(RuntimeError::InvalidSpec(format!(
            "layer path {} must be absolute, without ':', ',' or '\\'",
            p.display()
        )));
    }
    if !p.is_dir() {
        return Err(RuntimeError::InvalidSpec(format!(
            "layer {} does not exist",
            p.display()
        )));
    }
    Ok(())
}

/// Opens the writable layer of a running sandbox through its root. The sandbox can rename
/// and replace anything on that path (it owns `/`), so the walk follows no symlink and the
/// result must be the layer's tmpfs itself: a separate tmpfs whose root the host's root
/// owns with mode 0700 and holds overlay's `work` directory, none of which a sandbox can
/// make.
fn open_upper(h: &SandboxHandle) -> Result<std::os::fd::OwnedFd, RuntimeError> {
    use nix::fcntl::{OFlag, OpenHow, ResolveFlag, openat2};
    use nix::sys::stat::fstat;
    if h.pid <= 0 || !crate::same_process(h.pid, h.pid_start) {
        return Err(RuntimeError::Setup("the sandbox is not running".into()));
    }
    let io = |what: &str, e: nix::Error| RuntimeError::io(what.to_string(), e.into());
    let dir = OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW;
    let root = nix::fcntl::open(
        format!("/proc/{}/root", h.pid).as_str(),
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .map_err(|e| io("open the sandbox's root", e))?;
    let how = OpenHow::new().flags(dir).resolve(
        ResolveFlag::RESOLVE_NO_SYMLINKS
            | ResolveFlag::RESOLVE_NO_MAGICLINKS
            | ResolveFlag::RESOLVE_BENEATH,
    );
    let layer = openat2(&root, crate::init::LAYER_MOUNT, how).map_err(|e| {
        RuntimeError::Tampered(format!(
            "/{} cannot be opened: {e}",
            crate::init::LAYER_MOUNT
        ))
    })?;
    let (root_st, layer_st) = (
        fstat(&root).map_err(|e| io("stat root", e))?,
        fstat(&layer).map_err(|e| io("stat layer", e))?,
    );
    let is_tmpfs = nix::sys::statfs::fstatfs(&layer)
        .is_ok_and(|s| s.filesystem_type() == nix::sys::statfs::TMPFS_MAGIC);
    let how = OpenHow::new().flags(dir).resolve(
        ResolveFlag::RESOLVE_NO_SYMLINKS
            | ResolveFlag::RESOLVE_NO_MAGICLINKS
            | ResolveFlag::RESOLVE_NO_XDEV
            | ResolveFlag::RESOLVE_BENEATH,
    );
    let work_ok = openat2(&layer, "work", how)
        .ok()
        .and_then(|w| fstat(&w).ok())
        .is_some_and(|w| w.st_uid == 0 && w.st_mode & 0o7777 == 0o700);
    let genuine = is_tmpfs
        && layer_st.st_dev != root_st.st_dev
        && layer_st.st_uid == 0
        && layer_st.st_mode & 0o7777 == 0o700
        && work_ok;
    if !genuine {
        tracing::warn!(id = %h.id, "the sandbox's layer mount was tampered with");
        return Err(RuntimeError::Tampered(format!(
            "/{} is not the sandbox's writable layer",
            crate::init::LAYER_MOUNT
        )));
    }
    openat2(&layer, "upper", how).map_err(|e| io("open the upper layer", e))
}

/// Writes `payload` to `sock`, the first part together with `fds` (SCM_RIGHTS).
fn send_with_fds(
    sock: &std::os::unix::net::UnixStream,
    payload: &[u8],
    fds: &[std::os::fd::RawFd],
) -> std::io::Result<()> {
    use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};
    let n = sendmsg::<()>(
        sock.as_raw_fd(),
        &[std::io::IoSlice::new(payload)],
        &[ControlMessage::ScmRights(fds)],
        MsgFlags::empty(),
        None,
    )?;
    let mut sock = sock;
    sock.write_all(&payload[n..])
}

/// Logs how long each step of a launch took, in microseconds since the step before; the
/// helper's marks are absolute CLOCK_MONOTONIC times.
fn log_timing<'a>(
    id: &str,
    t0: u64,
    t_spawn: u64,
    t_reply: u64,
    marks: impl Iterator<Item = &'a str>,
) {
    use std::fmt::Write as _;
    let mut marks: Vec<(u64, &str)> = marks
        .filter_map(|m| {
            let (label, at) = m.split_once('=')?;
            Some((at.parse().ok()?, label))
        })
        .collect();
    marks.sort_unstable();
    let mut steps = String::new();
    let mut prev = t_spawn;
    let _ = write!(steps, "spawn={}", t_spawn.saturating_sub(t0));
    for (at, label) in marks {
        let _ = write!(steps, " {label}={}", at.saturating_sub(prev));
        prev = at;
    }
    let _ = write!(steps, " reply={}", t_reply.saturating_sub(prev));
    let done = crate::init::mono_us();
    let _ = write!(steps, " wait={}", done.saturating_sub(t_reply));
    tracing::debug!(id, total_us = done - t0, steps = %steps, "sandbox launched");
}

/// Puts the sandboxes' directories (sockets, mount points and the process runtime's
/// roots: nothing that outlives the sandboxes, which end at a reboot anyway) on a tmpfs:
/// on ext4, allocating and freeing their inodes under churn costs more CPU than anything
/// else in a create (`recently_deleted` scans in the inode allocator). A restart finds
/// the tmpfs of the previous run, with its live sandboxes' sockets, and keeps it.
fn ensure_tmpfs(dir: &Path) -> Result<(), RuntimeError> {
    if is_tmpfs(dir) {
        return Ok(());
    }
    let busy = std::fs::read_dir(dir)
        .map_err(|e| RuntimeError::io(format!("read {}", dir.display()), e))?
        .next()
        .is_some();
    if busy {
        // Sandboxes started by an older version live here on disk; leave them be.
        tracing::warn!(dir = %dir.display(), "sandbox directory is not empty; not moving it to a tmpfs");
        return Ok(());
    }
    nix::mount::mount(
        Some("tmpfs"),
        dir,
        Some("tmpfs"),
        nix::mount::MsFlags::MS_NOSUID | nix::mount::MsFlags::MS_NODEV,
        Some("mode=0700"),
    )
    .map_err(|e| RuntimeError::io(format!("mount tmpfs on {}", dir.display()), e.into()))
}

fn is_tmpfs(dir: &Path) -> bool {
    nix::sys::statfs::statfs(dir)
        .is_ok_and(|s| s.filesystem_type() == nix::sys::statfs::TMPFS_MAGIC)
}

/// On a clean stop with no sandbox left, unmounts the sandboxes' tmpfs (a data directory
/// that is itself on a tmpfs has no mount of its own here and is left alone).
fn release_tmpfs(dir: &Path) {
    use std::os::unix::fs::MetadataExt;
    let dev = |p: &Path| std::fs::metadata(p).map(|m| m.dev()).ok();
    let mounted = match (dev(dir), dir.parent().and_then(dev)) {
        (Some(a), Some(b)) => a != b,
        _ => false,
    };
    let empty = std::fs::read_dir(dir).is_ok_and(|mut rd| rd.next().is_none());
    // Only a tmpfs, as `ensure_tmpfs` mounts: a volume an operator put here stays.
    if mounted
        && empty
        && is_tmpfs(dir)
        && let Err(e) = nix::mount::umount2(dir, nix::mount::MntFlags::MNT_DETACH)
    {
        tracing::warn!(dir = %dir.display(), error = %e, "unmounting the sandboxes tmpfs failed");
    }
}

/// Names the parent cgroup after the data directory (FNV-1a of its path).
fn cgroup_parent(data_dir: &Path) -> String {
    let canon = data_dir
        .canonicalize()
        .unwrap_or_else(|_| data_dir.to_path_buf());
    let mut h: u32 = 0x811c_9dc5;
    for b in canon.as_os_str().as_encoded_bytes() {
        h = (h ^ *b as u32).wrapping_mul(0x0100_0193);
    }
    format!("sandpit-{h:08x}")
}

/// Collects the exit status of a sandbox's PID 1 if this daemon is its (sub)reaper.
fn reap(pid: i32) {
    // pid 0 (created, never started) would mean "any child of our group".
    if pid <= 0 {
        return;
    }
    let _ = nix::sys::wait::waitpid(
        nix::unistd::Pid::from_raw(pid),
        Some(nix::sys::wait::WaitPidFlag::WNOHANG),
    );
}

impl Runtime for ContainerRuntime {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            name: "container",
            isolated: true,
            freeze: true,
            stats: true,
            enforces_memory: true,
            enforces_disk: true,
            enforces_processes: true,
        }
    }

    fn create(&self, spec: &SandboxSpec) -> Result<SandboxHandle, RuntimeError> {
        crate::check_id(&spec.id)?;
        if let TemplateSource::Rootfs { path } = &spec.template {
            crate::template::check_rootfs(path)?;
        }
        crate::volume::check_targets(spec.volumes.iter().map(|v| v.target.as_str()))?;
        for l in &spec.layers {
            check_layer_path(l)?;
        }
        let slot = self.alloc_slot(&spec.id)?;
        let uid_base = UID_FLOOR + slot * ID_RANGE;
        let dir = self.dir_of(&spec.id);
        if dir.exists() {
            self.free_slot(Some(uid_base), &spec.id);
            return Err(RuntimeError::InvalidSpec(format!(
                "sandbox {} already exists",
                spec.id
            )));
        }
        match self.prepare(spec, &dir, uid_base) {
            Ok(h) => Ok(h),
            Err(e) => {
                if let Err(c) = self.cleanup(&spec.id) {
                    tracing::error!(id = %spec.id, error = %c, "cleanup after failed create");
                }
                self.free_slot(Some(uid_base), &spec.id);
                Err(e)
            }
        }
    }

    fn start(&self, spec: &SandboxSpec, h: &mut SandboxHandle) -> Result<(), RuntimeError> {
        self.launch(spec, h)
    }

    fn kill(&self, h: &SandboxHandle) -> Result<(), RuntimeError> {
        self.cgroups.kill_all(&h.id)?;
        reap(h.pid);
        Ok(())
    }

    fn freeze(&self, h: &SandboxHandle) -> Result<(), RuntimeError> {
        self.cgroups.set_frozen(&h.id, true)
    }

    fn thaw(&self, h: &SandboxHandle) -> Result<(), RuntimeError> {
        self.cgroups.set_frozen(&h.id, false)
    }

    fn stats(&self, h: &SandboxHandle) -> Result<Stats, RuntimeError> {
        Ok(self.cgroups.stats(&h.id))
    }

    fn liveness(&self, h: &SandboxHandle) -> crate::Liveness {
        let l = crate::process_liveness(h.pid, h.pid_start);
        if l.is_dead() {
            reap(h.pid);
        }
        l
    }

    fn destroy(&self, h: &SandboxHandle) -> Result<(), RuntimeError> {
        crate::check_id(&h.id)?;
        self.pending.forget(&h.id);
        self.cgroups.kill_all(&h.id)?;
        reap(h.pid);
        self.cleanup(&h.id)?;
        self.free_slot(h.uid_base, &h.id);
        Ok(())
    }

    fn remove_orphans(&self, keep: &[String]) -> Result<Vec<String>, RuntimeError> {
        let mut ids: BTreeSet<String> = self.cgroups.list().into_iter().collect();
        if let Ok(rd) = std::fs::read_dir(&self.sandboxes_dir) {
            ids.extend(
                rd.flatten()
                    .filter_map(|e| e.file_name().to_str().map(String::from)),
            );
        }
        let mut removed = Vec::new();
        for id in ids {
            if keep.contains(&id) || crate::check_id(&id).is_err() {
                continue;
            }
            self.cleanup(&id)?;
            removed.push(id);
        }
        if keep.is_empty() {
            // No sandbox can be using an older host skeleton any more.
            if let Some(templates) = self.host_skeleton.parent() {
                crate::template::remove_old_skeletons(templates, &self.host_skeleton);
            }
        }
        Ok(removed)
    }

    fn adopt(&self, h: &SandboxHandle) {
        if let Some(base) = h.uid_base {
            self.slots
                .lock()
                .insert((base - UID_FLOOR) / ID_RANGE, h.id.clone());
        }
    }

    fn open_upper(&self, h: &SandboxHandle) -> Result<crate::UpperView, RuntimeError> {
        let id_base = h
            .uid_base
            .ok_or_else(|| RuntimeError::Setup("no uid range".into()))?;
        let fd = open_upper(h)?;
        // The pid could have been reused between the check and the open.
        if !crate::same_process(h.pid, h.pid_start) {
            return Err(RuntimeError::Setup("the sandbox is not running".into()));
        }
        Ok(crate::UpperView { fd, id_base })
    }

    fn release(&self) {
        self.cgroups.remove_parent_if_empty();
        release_tmpfs(&self.sandboxes_dir);
    }
}
