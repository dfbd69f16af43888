//! Volumes: named persistent directories that outlive the sandboxes using them.
//!
//! Each volume is an ext4 file system in a sparse image file under
//! `DATA_DIR/volumes/images/<id>.img`, attached to a loop device and mounted on the host at
//! `DATA_DIR/volumes/mnt/<id>`. The file system is the size limit: a write past it is
//! ENOSPC inside the sandbox, whatever the host's file system is, and the host's disk
//! outside the image is never touched. Files are stored with the sandbox's inner ids
//! (0-based); each sandbox sees the volume through an idmapped bind mount to its own uid
//! range, so what `user` wrote in one sandbox belongs to `user` in the next.
//!
//! Loop devices are set up with LOOP_CONFIGURE and autoclear, so a device goes away by
//! itself when its last mount does; at a start, one that still backs an image (held by a
//! sandbox that outlived the daemon) is reused, never doubled, since two loop devices on
//! one image would be two file systems writing the same blocks.

use crate::RuntimeError;
use crate::init::InitError;
use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::Mode;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Inner uid and gid owning a new volume's root directory: the sandbox's `user`, who
/// runs commands by default and so can write to a fresh volume; root can too.
pub const ROOT_OWNER: u32 = sandpit_abi::USER_UID;
/// Longest mount path accepted, in bytes.
pub const MAX_TARGET_LEN: usize = 1024;
/// Where no volume may be mounted: what the runtime itself mounts or needs.
const RESERVED: &[&str] = &["/proc", "/sys", "/dev", "/.sandpit"];
/// Prefix of an init error caused by the request (a bad mount path) rather than the host.
pub(crate) const SPEC_ERROR: &str = "invalid volume mount: ";
/// How long a delete waits for a dying sandbox to let go of the volume's loop device.
const LOOP_RELEASE_WAIT: Duration = Duration::from_secs(10);

/// One volume mounted into a sandbox.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct VolumeMount {
    /// The volume's mount on the host.
    pub source: PathBuf,
    /// Absolute path inside the sandbox.
    pub target: String,
    pub read_only: bool,
}

/// Why a volume's mount path is refused: the request's fault, never the host's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MountPathError {
    #[error("mount path {path:?} must be absolute")]
    NotAbsolute { path: String },
    #[error("mount path must be at most {MAX_TARGET_LEN} bytes without NUL")]
    TooLong,
    #[error("mount path {path:?} must not contain '.' or '..' components")]
    DotComponent { path: String },
    #[error("mount path {path:?}: component too long")]
    ComponentTooLong { path: String },
    #[error("a volume cannot be mounted on /")]
    Root,
    #[error("mount path {path:?} is under {reserved}, which the sandbox runtime manages")]
    Reserved {
        path: String,
        reserved: &'static str,
    },
    #[error("two volumes are mounted on {path}")]
    Duplicate { path: String },
    #[error("volume mounts {a} and {b} are nested")]
    Nested { a: String, b: String },
    /// The kernel resolved the path (through the template's symlinks) out of the root.
    #[error("mount path {target} resolves outside the sandbox")]
    ResolvesOutside { target: String },
    /// The path resolves, through the template's symlinks, to a refused one.
    #[error("{target} resolves to {inner}: {source}")]
    ResolvesTo {
        target: String,
        inner: String,
        #[source]
        source: Box<MountPathError>,
    },
    #[error("/{prefix} is a dangling symlink")]
    DanglingSymlink { prefix: String },
    #[error("/{prefix} is on a read-only file system")]
    ReadOnly { prefix: String },
    #[error("mount path {target} crosses into another mount at /{prefix}")]
    CrossesMount { target: String, prefix: String },
    #[error("/{prefix} is not a directory")]
    NotADirectory { prefix: String },
    #[error("/{prefix}: too many symlinks")]
    TooManySymlinks { prefix: String },
}

/// Checks a mount path inside a sandbox and returns it without empty components
/// (`//a/b/` is `/a/b`). Refused: relative paths, `.` and `..`, `/` itself, and anything
/// at or below `/proc`, `/sys`, `/dev` or `/.sandpit`.
pub fn check_target(path: &str) -> Result<String, MountPathError> {
    if !path.starts_with('/') {
        return Err(MountPathError::NotAbsolute { path: path.into() });
    }
    if path.len() > MAX_TARGET_LEN || path.contains('\0') {
        return Err(MountPathError::TooLong);
    }
    let mut parts = Vec::new();
    for c in path.split('/') {
        match c {
            "" => {}
            "." | ".." => return Err(MountPathError::DotComponent { path: path.into() }),
            c if c.len() > 255 => {
                return Err(MountPathError::ComponentTooLong { path: path.into() });
            }
            c => parts.push(c),
        }
    }
    if parts.is_empty() {
        return Err(MountPathError::Root);
    }
    let norm = format!("/{}", parts.join("/"));
    if let Some(r) = RESERVED.iter().find(|r| norm == **r || within(&norm, r)) {
        return Err(MountPathError::Reserved {
            path: path.into(),
            reserved: r,
        });
    }
    Ok(norm)
}

/// Checks every mount path of one sandbox: each valid, no two equal or one inside another.
pub fn check_targets<'a>(
    paths: impl IntoIterator<Item = &'a str>,
) -> Result<Vec<String>, MountPathError> {
    let norms = paths
        .into_iter()
        .map(check_target)
        .collect::<Result<Vec<_>, _>>()?;
    for (i, a) in norms.iter().enumerate() {
        for b in &norms[i + 1..] {
            if a == b {
                return Err(MountPathError::Duplicate { path: a.clone() });
            }
            if within(a, b) || within(b, a) {
                return Err(MountPathError::Nested {
                    a: a.clone(),
                    b: b.clone(),
                });
            }
        }
    }
    Ok(norms)
}

/// Whether `inner` lies strictly below `outer` (both normalised, absolute).
fn within(inner: &str, outer: &str) -> bool {
    inner.len() > outer.len() && inner.starts_with(outer) && inner.as_bytes()[outer.len()] == b'/'
}

/// The host side of volumes under one data directory: images, loop devices, mounts.
pub struct VolumeHost {
    images: PathBuf,
    mounts: PathBuf,
    /// Serialises attaching, mounting and unmounting, so that one image never gets two
    /// loop devices and a delete never races a mount of the same volume.
    lock: Mutex<()>,
}

fn io(context: impl Into<String>, e: impl Into<std::io::Error>) -> RuntimeError {
    RuntimeError::io(context, e.into())
}

impl VolumeHost {
    /// Prepares `DATA_DIR/volumes` (nothing is mounted until a volume is used).
    pub fn new(data_dir: &Path) -> Result<Self, RuntimeError> {
        let root = data_dir.join("volumes");
        let (images, mounts) = (root.join("images"), root.join("mnt"));
        for d in [&root, &images, &mounts] {
            crate::private_dir(d)?;
        }
        // The kernel names a loop device's backing file by its real path.
        let canon = |p: &Path| {
            p.canonicalize()
                .map_err(|e| io(format!("resolve {}", p.display()), e))
        };
        Ok(Self {
            images: canon(&images)?,
            mounts: canon(&mounts)?,
            lock: Mutex::new(()),
        })
    }

    /// The directory holding the images (for free-space checks).
    pub fn images_dir(&self) -> &Path {
        &self.images
    }

    fn image(&self, id: &str) -> PathBuf {
        self.images.join(format!("{id}.img"))
    }

    fn mount_dir(&self, id: &str) -> PathBuf {
        self.mounts.join(id)
    }

    /// Makes volume `id` of `size_bytes` (a sparse image with an ext4 file system whose
    /// root belongs to inner uid 1000, mode 0755) and mounts it; returns the host mount.
    /// A failure leaves nothing behind.
    pub fn create(&self, id: &str, size_bytes: u64) -> Result<PathBuf, RuntimeError> {
        crate::check_id(id)?;
        let img = self.image(id);
        let made = (|| {
            use std::os::unix::fs::OpenOptionsExt;
            let f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&img)
                .map_err(|e| io(format!("create {}", img.display()), e))?;
            f.set_len(size_bytes)
                .map_err(|e| io(format!("size {}", img.display()), e))?;
            drop(f);
            mkfs(&img)?;
            let dir = self.mount(id)?;
            // A fresh volume is an empty directory (e2fsck makes lost+found again if it
            // ever needs one).
            let lf = dir.join("lost+found");
            if let Err(e) = std::fs::remove_dir(&lf) {
                tracing::debug!(path = %lf.display(), error = %e, "keeping lost+found");
            }
            Ok(dir)
        })();
        if made.is_err()
            && let Err(e) = self.remove(id)
        {
            tracing::warn!(id, error = %e, "cleanup after a failed volume create");
        }
        made
    }

    /// Mounts volume `id` on the host unless it is already, and returns the mount. A loop
    /// device that still backs its image is reused: mounting it again gives the same file
    /// system a sandbox that outlived a daemon restart is still writing to.
    pub fn mount(&self, id: &str) -> Result<PathBuf, RuntimeError> {
        crate::check_id(id)?;
        let _g = self.lock.lock();
        let dir = self.mount_dir(id);
        if is_mountpoint(&dir) {
            return Ok(dir);
        }
        let img = self.image(id);
        if !img.is_file() {
            return Err(RuntimeError::Setup(format!(
                "volume image {} is missing",
                img.display()
            )));
        }
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io(format!("create {}", dir.display()), e)),
        }
        let bound = loopdev::backing(&img);
        if bound.len() > 1 {
            tracing::warn!(id, devices = ?bound, "several loop devices back one volume image");
        }
        // The open device keeps an autoclear loop device alive until the mount holds it.
        let (dev, path) = match bound.first() {
            Some(name) => {
                let path = PathBuf::from(format!("/dev/{name}"));
                let dev = nix::fcntl::open(&path, OFlag::O_RDWR | OFlag::O_CLOEXEC, Mode::empty())
                    .map_err(|e| io(format!("open {}", path.display()), e))?;
                tracing::info!(id, device = %path.display(), "reusing the volume's loop device");
                (dev, path)
            }
            None => {
                loopdev::attach(&img).map_err(|e| io(format!("attach {}", img.display()), e))?
            }
        };
        nix::mount::mount(
            Some(&path),
            &dir,
            Some("ext4"),
            nix::mount::MsFlags::MS_NOSUID | nix::mount::MsFlags::MS_NODEV,
            None::<&str>,
        )
        .map_err(|e| io(format!("mount {} on {}", path.display(), dir.display()), e))?;
        drop(dev);
        tracing::debug!(id, device = %path.display(), "volume mounted");
        Ok(dir)
    }

    /// Bytes in use and bytes still free in volume `id` (mounting it if needed).
    pub fn usage(&self, id: &str) -> Result<(u64, u64), RuntimeError> {
        let dir = self.mount(id)?;
        let st = nix::sys::statvfs::statvfs(&dir)
            .map_err(|e| io(format!("statvfs {}", dir.display()), e))?;
        let frsize = st.fragment_size();
        let used = (st.blocks() - st.blocks_free()) * frsize;
        Ok((used, st.blocks_available() * frsize))
    }

    /// Removes volume `id` from the host: unmounts it and deletes its image; its loop
    /// device goes with its last user (waited for, briefly, in case a sandbox is still
    /// dying). Idempotent.
    pub fn remove(&self, id: &str) -> Result<(), RuntimeError> {
        crate::check_id(id)?;
        let img = self.image(id);
        {
            let _g = self.lock.lock();
            self.unmount_locked(id)?;
            // Gone under the lock: a concurrent `mount` finds no image and attaches nothing.
            match std::fs::remove_file(&img) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io(format!("remove {}", img.display()), e)),
            }
        }
        let deadline = Instant::now() + LOOP_RELEASE_WAIT;
        let mut asked = false;
        loop {
            let left = loopdev::backing(&img);
            if left.is_empty() {
                break;
            }
            if !asked {
                // Detaches it now, or when its last user closes it.
                for name in &left {
                    loopdev::detach(name);
                }
                asked = true;
            }
            if Instant::now() > deadline {
                tracing::warn!(id, devices = ?left, "a loop device still backs a deleted volume; it goes when its last user does");
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    fn unmount_locked(&self, id: &str) -> Result<(), RuntimeError> {
        use nix::mount::{MntFlags, umount2};
        let dir = self.mount_dir(id);
        // Bounded: each round takes one mount off the stack.
        for _ in 0..8 {
            if !is_mountpoint(&dir) {
                break;
            }
            if let Err(e) = umount2(&dir, MntFlags::empty()) {
                tracing::warn!(id, error = %e, "volume busy on the host; detaching it lazily");
                umount2(&dir, MntFlags::MNT_DETACH)
                    .map_err(|e| io(format!("unmount {}", dir.display()), e))?;
            }
        }
        match std::fs::remove_dir(&dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io(format!("remove {}", dir.display()), e)),
        }
    }

    /// At a clean stop: unmounts every volume from the host. A sandbox still running keeps
    /// its own mount, and the loop device stays until it ends; the next start reuses it.
    pub fn release(&self) {
        let _g = self.lock.lock();
        for id in dir_names(&self.mounts) {
            if let Err(e) = self.unmount_locked(&id) {
                tracing::warn!(id, error = %e, "unmounting a volume at shutdown failed");
            }
        }
    }

    /// At a start: removes the images, mounts and loop devices of volumes not in `keep`
    /// (left by a create or delete that a crash cut short); returns their ids.
    pub fn remove_orphans(&self, keep: &[String]) -> Vec<String> {
        let mut ids: std::collections::BTreeSet<String> =
            dir_names(&self.mounts).into_iter().collect();
        for name in dir_names(&self.images) {
            if let Some(id) = name.strip_suffix(".img") {
                ids.insert(id.to_string());
            }
        }
        for (_, file) in loopdev::bound() {
            let file = file.strip_suffix(" (deleted)").unwrap_or(&file);
            let path = Path::new(file);
            if path.parent() == Some(self.images.as_path())
                && let Some(id) = path
                    .file_name()
                    .and_then(|n| n.to_str())
                    .and_then(|n| n.strip_suffix(".img"))
            {
                ids.insert(id.to_string());
            }
        }
        let mut removed = Vec::new();
        for id in ids {
            if keep.contains(&id) || crate::check_id(&id).is_err() {
                continue;
            }
            match self.remove(&id) {
                Ok(()) => removed.push(id),
                Err(e) => tracing::warn!(id, error = %e, "removing an orphaned volume failed"),
            }
        }
        removed
    }
}

/// Names of the entries of `dir` (none if it cannot be read).
fn dir_names(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.file_name().to_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

/// Whether something is mounted on `dir` (its device differs from its parent's).
fn is_mountpoint(dir: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let dev = |p: &Path| std::fs::symlink_metadata(p).map(|m| m.dev()).ok();
    match (dev(dir), dir.parent().and_then(dev)) {
        (Some(a), Some(b)) => a != b,
        _ => false,
    }
}

/// `mkfs.ext4` on an image file. No reserved blocks (nobody in a sandbox is the host's
/// root, who alone could use them); the journal is not zeroed since a new sparse file
/// reads as zeros; the inode tables are not either, since mkfs punches the whole (sparse)
/// file first and knows it reads as zeros, so no lazy-init thread fills the host's disk.
fn mkfs(img: &Path) -> Result<(), RuntimeError> {
    let opts = format!("root_owner={ROOT_OWNER}:{ROOT_OWNER},lazy_journal_init=1");
    let mut last = None;
    // The daemon's PATH may lack the sbin directories.
    for exe in ["mkfs.ext4", "/usr/sbin/mkfs.ext4", "/sbin/mkfs.ext4"] {
        let out = std::process::Command::new(exe)
            .args(["-q", "-F", "-m", "0", "-E", &opts])
            .arg(img)
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .stdin(std::process::Stdio::null())
            .output();
        match out {
            Ok(o) if o.status.success() => return Ok(()),
            Ok(o) => {
                return Err(RuntimeError::Setup(format!(
                    "mkfs.ext4 failed ({}): {}",
                    o.status,
                    String::from_utf8_lossy(&o.stderr).trim()
                )));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => last = Some(e),
            Err(e) => return Err(io("run mkfs.ext4", e)),
        }
    }
    Err(RuntimeError::Setup(format!(
        "mkfs.ext4 not found (install e2fsprogs): {}",
        last.map(|e| e.to_string()).unwrap_or_default()
    )))
}

/// Loop devices through the LOOP_CTL and LOOP_CONFIGURE ioctls (Linux 5.8+). Hand-written
/// rather than the `loopdev` crate, which generates its bindings with bindgen (libclang
/// at build time) and attaches in two steps (LOOP_SET_FD, then LOOP_SET_STATUS64) instead
/// of one atomic LOOP_CONFIGURE.
mod loopdev {
    use nix::fcntl::OFlag;
    use nix::sys::stat::Mode;
    use std::os::fd::{AsRawFd, OwnedFd};
    use std::path::{Path, PathBuf};

    const LO_FLAGS_AUTOCLEAR: u32 = 4;
    const LO_NAME_SIZE: usize = 64;

    /// `struct loop_info64` of <linux/loop.h>.
    #[repr(C)]
    struct LoopInfo64 {
        lo_device: u64,
        lo_inode: u64,
        lo_rdevice: u64,
        lo_offset: u64,
        lo_sizelimit: u64,
        lo_number: u32,
        lo_encrypt_type: u32,
        lo_encrypt_key_size: u32,
        lo_flags: u32,
        lo_file_name: [u8; LO_NAME_SIZE],
        lo_crypt_name: [u8; LO_NAME_SIZE],
        lo_encrypt_key: [u8; 32],
        lo_init: [u64; 2],
    }

    /// `struct loop_config` of <linux/loop.h>.
    #[repr(C)]
    struct LoopConfig {
        fd: u32,
        block_size: u32,
        info: LoopInfo64,
        reserved: [u64; 8],
    }

    nix::ioctl_none_bad!(ctl_get_free, 0x4C82);
    nix::ioctl_write_ptr_bad!(configure, 0x4C0A, LoopConfig);
    nix::ioctl_none_bad!(clr_fd, 0x4C01);

    /// Every bound loop device (`loopN`) with its backing file as the kernel names it
    /// (with a ` (deleted)` suffix once the file is gone).
    pub fn bound() -> Vec<(String, String)> {
        let Ok(rd) = std::fs::read_dir("/sys/block") else {
            return Vec::new();
        };
        rd.flatten()
            .filter_map(|e| {
                let name = e.file_name().to_str()?.to_string();
                if !name.starts_with("loop") {
                    return None;
                }
                // Absent while the device is unbound.
                let file = std::fs::read_to_string(e.path().join("loop/backing_file")).ok()?;
                Some((name, file.trim_end_matches('\n').to_string()))
            })
            .collect()
    }

    /// Loop devices backed by `file`, also after it was deleted.
    pub fn backing(file: &Path) -> Vec<String> {
        let Some(want) = file.to_str() else {
            return Vec::new();
        };
        bound()
            .into_iter()
            .filter(|(_, f)| f == want || f.strip_suffix(" (deleted)") == Some(want))
            .map(|(n, _)| n)
            .collect()
    }

    /// Attaches `file` to a free loop device in one step, with autoclear (the device
    /// detaches when its last user closes it); returns the open device and its path.
    pub fn attach(file: &Path) -> std::io::Result<(OwnedFd, PathBuf)> {
        let ctl = nix::fcntl::open(
            "/dev/loop-control",
            OFlag::O_RDWR | OFlag::O_CLOEXEC,
            Mode::empty(),
        )?;
        let backing = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(file)?;
        let mut info = LoopInfo64 {
            lo_device: 0,
            lo_inode: 0,
            lo_rdevice: 0,
            lo_offset: 0,
            lo_sizelimit: 0,
            lo_number: 0,
            lo_encrypt_type: 0,
            lo_encrypt_key_size: 0,
            lo_flags: LO_FLAGS_AUTOCLEAR,
            lo_file_name: [0; LO_NAME_SIZE],
            lo_crypt_name: [0; LO_NAME_SIZE],
            lo_encrypt_key: [0; 32],
            lo_init: [0; 2],
        };
        let name = file.as_os_str().as_encoded_bytes();
        let n = name.len().min(LO_NAME_SIZE - 1);
        info.lo_file_name[..n].copy_from_slice(&name[..n]);
        let config = LoopConfig {
            fd: backing.as_raw_fd() as u32,
            block_size: 0,
            info,
            reserved: [0; 8],
        };
        // Another process may take the free device between asking and configuring it.
        let mut last = nix::errno::Errno::EBUSY;
        for _ in 0..16 {
            // SAFETY: an argument-less ioctl on the loop control device.
            let n = unsafe { ctl_get_free(ctl.as_raw_fd()) }?;
            let path = PathBuf::from(format!("/dev/loop{n}"));
            let dev = nix::fcntl::open(&path, OFlag::O_RDWR | OFlag::O_CLOEXEC, Mode::empty())?;
            // SAFETY: `config` is a correctly laid out loop_config that outlives the call.
            match unsafe { configure(dev.as_raw_fd(), &config) } {
                Ok(_) => return Ok((dev, path)),
                Err(nix::errno::Errno::EBUSY) => last = nix::errno::Errno::EBUSY,
                Err(e) => return Err(e.into()),
            }
        }
        Err(last.into())
    }

    /// Asks loop device `name` to detach (at once, or when its last user closes it).
    pub fn detach(name: &str) {
        let path = format!("/dev/{name}");
        if let Ok(dev) = nix::fcntl::open(
            path.as_str(),
            OFlag::O_RDWR | OFlag::O_CLOEXEC,
            Mode::empty(),
        ) {
            // SAFETY: an argument-less ioctl on a loop device we opened.
            if let Err(e) = unsafe { clr_fd(dev.as_raw_fd()) } {
                tracing::debug!(device = path, error = %e, "LOOP_CLR_FD");
            }
        }
    }
}

/// Mounts `mounts` into a sandbox's new root `root` (called by its PID 1 before
/// pivot_root, as the host's root: the host is still visible). Each mount point is
/// resolved inside `root` by the kernel (`openat2` with RESOLVE_IN_ROOT, so a template's
/// symlink such as `workspace -> /etc` means the sandbox's /etc, never the host's), may not
/// cross into another mount (the host template's /usr, /proc, /dev...), and is created as
/// a directory of the sandbox's root when missing. The volume is attached by file
/// descriptor, idmapped to the sandbox's uid range, nosuid and nodev, read-only if asked
/// (the mount namespace belongs to the host's user namespace, so the sandbox cannot
/// remount it).
pub(crate) fn mount_in_sandbox(
    root: &Path,
    mounts: &[VolumeMount],
    userns: &OwnedFd,
    uid_base: u32,
) -> Result<(), InitError> {
    check_targets(mounts.iter().map(|m| m.target.as_str()))?;
    let rootfd = nix::fcntl::open(
        root,
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| InitError::sys(format!("open {}", root.display()), e))?;
    let real_root = fd_path(&rootfd)?;
    for m in mounts {
        let target = check_target(&m.target)?;
        let dir = mount_point(&rootfd, &target, uid_base)?;
        // What the kernel resolved, checked like the request: a symlink may not lead a
        // volume onto /proc or the agent's directory.
        let real = fd_path(&dir)?;
        let inner = real
            .strip_prefix(&real_root)
            .ok()
            .and_then(|p| p.to_str())
            .map(|p| format!("/{p}"))
            .ok_or_else(|| MountPathError::ResolvesOutside {
                target: target.clone(),
            })?;
        check_target(&inner).map_err(|e| MountPathError::ResolvesTo {
            target: target.clone(),
            inner: inner.clone(),
            source: Box::new(e),
        })?;
        let mut attrs = crate::init::MOUNT_ATTR_NOSUID | crate::init::MOUNT_ATTR_NODEV;
        if m.read_only {
            attrs |= crate::init::MOUNT_ATTR_RDONLY;
        }
        let tree = crate::init::idmapped_tree(&m.source, userns, attrs)?;
        crate::init::attach_tree(&tree, dir.as_fd(), c"")
            .map_err(|e| InitError::io(format!("mount volume on {target}"), e))?;
    }
    Ok(())
}

/// The directory `target` names inside the root `rootfd`, made (owned by the sandbox's
/// root, mode 0755) where missing, one component at a time.
fn mount_point(rootfd: &OwnedFd, target: &str, uid_base: u32) -> Result<OwnedFd, InitError> {
    use nix::errno::Errno;
    let how = OpenHow::new()
        .flags(OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC)
        .resolve(
            ResolveFlag::RESOLVE_IN_ROOT
                | ResolveFlag::RESOLVE_NO_MAGICLINKS
                | ResolveFlag::RESOLVE_NO_XDEV,
        );
    let open = |prefix: &str| nix::fcntl::openat2(rootfd, prefix, how);
    let parts: Vec<&str> = target.split('/').filter(|c| !c.is_empty()).collect();
    let mut dir = open(".").map_err(|e| InitError::sys("open sandbox root", e))?;
    for i in 0..parts.len() {
        let prefix = parts[..=i].join("/");
        dir = match open(&prefix) {
            Ok(fd) => fd,
            Err(Errno::ENOENT) => {
                // Made in the directory resolved so far; mkdirat never follows a symlink
                // in the last component (a dangling one is EEXIST).
                nix::sys::stat::mkdirat(&dir, parts[i], Mode::from_bits_truncate(0o755)).map_err(
                    |e| match e {
                        Errno::EEXIST => MountPathError::DanglingSymlink {
                            prefix: prefix.clone(),
                        }
                        .into(),
                        Errno::EROFS => MountPathError::ReadOnly {
                            prefix: prefix.clone(),
                        }
                        .into(),
                        e => InitError::sys(format!("create /{prefix}"), e),
                    },
                )?;
                nix::unistd::fchownat(
                    &dir,
                    parts[i],
                    Some(nix::unistd::Uid::from_raw(uid_base)),
                    Some(nix::unistd::Gid::from_raw(uid_base)),
                    nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
                )
                .map_err(|e| InitError::sys(format!("chown /{prefix}"), e))?;
                open(&prefix).map_err(|e| InitError::sys(format!("open /{prefix}"), e))?
            }
            Err(Errno::EXDEV) => {
                return Err(MountPathError::CrossesMount {
                    target: target.into(),
                    prefix,
                }
                .into());
            }
            Err(Errno::ENOTDIR) => return Err(MountPathError::NotADirectory { prefix }.into()),
            Err(Errno::ELOOP) => return Err(MountPathError::TooManySymlinks { prefix }.into()),
            Err(e) => return Err(InitError::sys(format!("resolve /{prefix}"), e)),
        };
    }
    Ok(dir)
}

/// The path the kernel gives an open descriptor.
fn fd_path(fd: &OwnedFd) -> Result<PathBuf, InitError> {
    nix::fcntl::readlink(format!("/proc/self/fd/{}", fd.as_raw_fd()).as_str())
        .map(PathBuf::from)
        .map_err(|e| InitError::sys("readlink of a descriptor", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_paths_are_checked() {
        assert_eq!(check_target("/data").unwrap(), "/data");
        assert_eq!(
            check_target("//home/user//cache/").unwrap(),
            "/home/user/cache"
        );
        for bad in [
            "",
            "data",
            "./data",
            "/",
            "//",
            "/a/../etc",
            "/a/./b",
            "/..",
            "/proc",
            "/proc/x",
            "/sys/fs",
            "/dev",
            "/dev/shm",
            "/.sandpit",
            "/.sandpit/agent",
            "/a\0b",
        ] {
            assert!(check_target(bad).is_err(), "{bad:?} accepted");
        }
        // Only whole components are reserved.
        assert_eq!(check_target("/process").unwrap(), "/process");
        assert_eq!(check_target("/devices/x").unwrap(), "/devices/x");
        assert!(check_target(&format!("/{}", "a".repeat(300))).is_err());
        assert!(check_target(&format!("/{}", "ab/".repeat(400))).is_err());
    }

    #[test]
    fn a_sandbox_mounts_each_path_once_and_never_nested() {
        assert_eq!(
            check_targets(["/a", "/b/c", "/ab"]).unwrap(),
            ["/a", "/b/c", "/ab"]
        );
        assert!(check_targets(["/a", "/a/"]).is_err());
        assert!(check_targets(["/a", "/a/b"]).is_err());
        assert!(check_targets(["/a/b/c", "/a/b"]).is_err());
        assert!(check_targets(["/a", "relative"]).is_err());
    }

    #[test]
    fn mount_path_errors_read_as_before() {
        assert_eq!(
            check_target("data").unwrap_err().to_string(),
            "mount path \"data\" must be absolute"
        );
        assert_eq!(
            check_target("/proc/x").unwrap_err(),
            MountPathError::Reserved {
                path: "/proc/x".into(),
                reserved: "/proc"
            }
        );
        assert_eq!(
            check_target("/proc/x").unwrap_err().to_string(),
            "mount path \"/proc/x\" is under /proc, which the sandbox runtime manages"
        );
        assert_eq!(
            check_targets(["/a", "/a/b"]).unwrap_err().to_string(),
            "volume mounts /a and /a/b are nested"
        );
        assert_eq!(
            check_targets(["/a", "/a"]).unwrap_err().to_string(),
            "two volumes are mounted on /a"
        );
        // A path that resolves somewhere refused keeps why it was refused.
        let e = MountPathError::ResolvesTo {
            target: "/w".into(),
            inner: "/proc".into(),
            source: Box::new(check_target("/proc").unwrap_err()),
        };
        assert_eq!(
            e.to_string(),
            "/w resolves to /proc: mount path \"/proc\" is under /proc, which the sandbox runtime manages"
        );
        assert!(std::error::Error::source(&e).is_some());
        // In the init helper's reply it carries the prefix the daemon recognises.
        let reply = InitError::from(MountPathError::NotADirectory {
            prefix: "etc/x".into(),
        })
        .to_string();
        assert_eq!(reply, format!("{SPEC_ERROR}/etc/x is not a directory"));
        // As a runtime error it is the request's fault, not the host's.
        let r = RuntimeError::from(MountPathError::Root);
        assert_eq!(
            r.to_string(),
            "invalid sandbox spec: a volume cannot be mounted on /"
        );
        assert!(!r.is_host_exhaustion());
    }
}
