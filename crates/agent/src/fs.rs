//! Path resolution confined to the sandbox root, and the `filesystem.Filesystem` service.
//!
//! Every lookup goes through `openat2` from a directory fd of the root: in a container
//! (`RESOLVE_IN_ROOT`) symlinks resolve as if the root were `/`, in the process runtime
//! (`RESOLVE_BENEATH`) anything that would leave the root is refused. Either way the
//! kernel does the check at the moment of use, so a symlink swapped in mid-request
//! cannot redirect an operation to the host.

use crate::config::{AgentConfig, IsolationMode};
use crate::users::{self, User};
use connectrpc::{ConnectError, RequestContext, Response, ServiceRequest, ServiceResult};
use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, OpenHow, ResolveFlag, openat2};
use nix::sys::stat::{FileStat, Mode, SFlag, fstatat};
use sandpit_proto::filesystem::*;
use std::ffi::OsString;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Why a file operation failed; each maps onto a Connect code and an HTTP status.
#[derive(Debug, thiserror::Error)]
pub enum FsError {
    #[error("invalid path: {0}")]
    InvalidPath(String),
    #[error("path escapes the sandbox root: {0}")]
    Escape(String),
    #[error("not found: {0}")]
    NotFound(String),
    #[error("already exists: {0}")]
    Exists(String),
    #[error("not a directory: {0}")]
    NotDir(String),
    #[error("is a directory: {0}")]
    IsDir(String),
    #[error("permission denied: {0}")]
    Permission(String),
    #[error("no space left in the sandbox: {0}")]
    NoSpace(String),
    #[error("unknown user: {0}")]
    UnknownUser(String),
    /// Upload metadata that cannot be stored (E2B's limits on `user.e2b.*` attributes).
    #[error("invalid metadata: {0}")]
    Metadata(#[from] crate::metadata::MetadataError),
    /// A request body that cannot be read: a coding not understood, corrupt gzip, or a
    /// body that broke off.
    #[error("{0}")]
    BadBody(String),
    /// What the client accepts cannot be served (`Accept-Encoding`).
    #[error("{0}")]
    NotAcceptable(String),
    #[error("{0}: {1}")]
    Io(String, std::io::Error),
}

impl FsError {
    /// Classifies an errno raised while working on `path`.
    pub fn from_errno(path: &str, e: Errno) -> Self {
        let p = path.to_string();
        match e {
            Errno::ENOENT => FsError::NotFound(p),
            Errno::EEXIST | Errno::ENOTEMPTY => FsError::Exists(p),
            Errno::ENOTDIR => FsError::NotDir(p),
            Errno::EISDIR => FsError::IsDir(p),
            Errno::EACCES | Errno::EPERM | Errno::EROFS => FsError::Permission(p),
            Errno::EXDEV | Errno::ELOOP => FsError::Escape(p),
            Errno::ENOSPC | Errno::EDQUOT | Errno::EFBIG => FsError::NoSpace(p),
            Errno::ENAMETOOLONG | Errno::EINVAL => FsError::InvalidPath(p),
            other => FsError::Io(p, std::io::Error::from(other)),
        }
    }

    /// Classifies an `std::io::Error` raised while working on `path`.
    pub fn from_io(path: &str, e: std::io::Error) -> Self {
        match e.raw_os_error() {
            Some(code) => Self::from_errno(path, Errno::from_raw(code)),
            None => FsError::Io(path.to_string(), e),
        }
    }

    /// HTTP status for the `/files` endpoints.
    pub fn http_status(&self) -> http::StatusCode {
        use http::StatusCode as S;
        match self {
            FsError::InvalidPath(_)
            | FsError::UnknownUser(_)
            | FsError::Metadata(_)
            | FsError::BadBody(_) => S::BAD_REQUEST,
            FsError::NotAcceptable(_) => S::NOT_ACCEPTABLE,
            FsError::Escape(_) | FsError::Permission(_) => S::FORBIDDEN,
            FsError::NotFound(_) => S::NOT_FOUND,
            FsError::Exists(_) => S::CONFLICT,
            FsError::NotDir(_) | FsError::IsDir(_) => S::BAD_REQUEST,
            FsError::NoSpace(_) => S::INSUFFICIENT_STORAGE,
            FsError::Io(..) => S::INTERNAL_SERVER_ERROR,
        }
    }
}

impl From<FsError> for ConnectError {
    fn from(e: FsError) -> Self {
        let msg = e.to_string();
        match e {
            FsError::InvalidPath(_)
            | FsError::UnknownUser(_)
            | FsError::Metadata(_)
            | FsError::BadBody(_)
            | FsError::NotAcceptable(_)
            | FsError::NotDir(_)
            | FsError::IsDir(_) => ConnectError::invalid_argument(msg),
            FsError::Escape(_) | FsError::Permission(_) => ConnectError::permission_denied(msg),
            FsError::NotFound(_) => ConnectError::not_found(msg),
            FsError::Exists(_) => ConnectError::already_exists(msg),
            FsError::NoSpace(_) => ConnectError::resource_exhausted(msg),
            FsError::Io(..) => ConnectError::internal(msg),
        }
    }
}

/// A directory that all file operations are confined to.
pub struct FsRoot {
    dir: OwnedFd,
    /// The root as the kernel names it (`/proc/self/fd/N` read back).
    root_path: PathBuf,
    resolve: ResolveFlag,
    cfg: Arc<AgentConfig>,
}

/// A path checked lexically: absolute inside the sandbox, without `.` or `..`.
#[derive(Debug, Clone)]
pub struct SandboxPath {
    /// Absolute, normalised path as seen inside the sandbox.
    pub abs: String,
}

impl SandboxPath {
    /// The path relative to the root, as openat2 wants it (`.` for the root itself).
    fn rel(&self) -> &str {
        let r = self.abs.trim_start_matches('/');
        if r.is_empty() { "." } else { r }
    }

    /// The final component and the path of its parent, or None for the root.
    fn split(&self) -> Option<(SandboxPath, OsString)> {
        let p = Path::new(&self.abs);
        let name = p.file_name()?.to_os_string();
        let parent = p
            .parent()
            .map(|x| x.to_string_lossy().into_owned())
            .unwrap_or_else(|| "/".into());
        Some((SandboxPath { abs: parent }, name))
    }
}

impl FsRoot {
    /// Opens the configured root directory.
    pub fn open(cfg: Arc<AgentConfig>) -> Result<Self, FsError> {
        let root = cfg.root.to_string_lossy().into_owned();
        let dir = nix::fcntl::open(
            &cfg.root,
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| FsError::from_errno(&root, e))?;
        let resolve = match cfg.mode {
            IsolationMode::Container => {
                ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS
            }
            IsolationMode::Process => {
                ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_MAGICLINKS
            }
        };
        // Where the kernel places the root, so that paths read back from fds below it can
        // be turned into paths inside the sandbox. Without /proc, the configured path (only
        // symlink targets are then reported from the links' text).
        let root_path = std::fs::read_link(Self::fd_path(&dir, None)).unwrap_or_else(|e| {
            tracing::debug!(error = %e, "cannot read the root's path back from /proc");
            cfg.root.clone()
        });
        Ok(Self {
            dir,
            root_path,
            resolve,
            cfg,
        })
    }

    /// The agent configuration this root belongs to.
    pub fn config(&self) -> &AgentConfig {
        &self.cfg
    }

    /// Normalises an API path. Relative paths are taken from the user's home, as E2B does;
    /// a `..` that would climb above `/` is refused rather than clamped, so that a caller
    /// never silently gets a different file than the one it named.
    pub fn check(&self, path: &str, user: &User) -> Result<SandboxPath, FsError> {
        use sandpit_api::paths::{PathError, normalize};
        match normalize(path, user.home) {
            Ok(abs) => Ok(SandboxPath { abs }),
            Err(PathError::Escape) => Err(FsError::Escape(path.to_string())),
            Err(PathError::Invalid(why)) => Err(FsError::InvalidPath(why.to_string())),
        }
    }

    /// Opens a path with the root's confinement.
    pub fn open_at(&self, p: &SandboxPath, flags: OFlag, mode: Mode) -> Result<OwnedFd, FsError> {
        let how = OpenHow::new()
            .flags(flags | OFlag::O_CLOEXEC)
            .mode(mode)
            .resolve(self.resolve);
        openat2(self.dir.as_fd(), p.rel(), how).map_err(|e| FsError::from_errno(&p.abs, e))
    }

    /// Opens the parent directory of `p` and returns it with the final component.
    pub fn open_parent(&self, p: &SandboxPath) -> Result<(OwnedFd, OsString), FsError> {
        let (parent, name) = p
            .split()
            .ok_or_else(|| FsError::InvalidPath("the root itself".into()))?;
        let fd = self.open_at(&parent, OFlag::O_PATH | OFlag::O_DIRECTORY, Mode::empty())?;
        Ok((fd, name))
    }

    /// Creates a directory and its missing parents, owned by `user`.
    pub fn mkdir_all(&self, p: &SandboxPath, user: &User) -> Result<bool, FsError> {
        let mut created = false;
        let mut cur = String::new();
        for comp in p.abs.split('/').filter(|c| !c.is_empty()) {
            cur.push('/');
            cur.push_str(comp);
            let sp = SandboxPath { abs: cur.clone() };
            let (parent, name) = self.open_parent(&sp)?;
            match nix::sys::stat::mkdirat(
                parent.as_fd(),
                name.as_os_str(),
                Mode::from_bits_truncate(0o755),
            ) {
                Ok(()) => {
                    created = true;
                    self.chown_at(&parent, &name, user);
                }
                Err(Errno::EEXIST) => {
                    let st = fstatat(
                        parent.as_fd(),
                        name.as_os_str(),
                        nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
                    )
                    .map_err(|e| FsError::from_errno(&sp.abs, e))?;
                    if !is_dir(&st) && !is_symlink(&st) {
                        return Err(FsError::NotDir(sp.abs));
                    }
                }
                Err(e) => return Err(FsError::from_errno(&sp.abs, e)),
            }
        }
        Ok(created)
    }

    /// Gives a freshly created entry to the acting user, so files written through the API
    /// look the same as files the user's own commands write.
    pub fn chown_at(&self, parent: &OwnedFd, name: &OsString, user: &User) {
        if !user.switch {
            return;
        }
        let r = nix::unistd::fchownat(
            parent.as_fd(),
            name.as_os_str(),
            Some(nix::unistd::Uid::from_raw(user.uid)),
            Some(nix::unistd::Gid::from_raw(user.gid)),
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        );
        if let Err(e) = r {
            tracing::debug!(error = %e, "chown of a new entry failed");
        }
    }

    /// Path through which std can reach an entry below an already opened directory fd.
    pub fn fd_path(fd: &OwnedFd, name: Option<&OsString>) -> PathBuf {
        let mut p = PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()));
        if let Some(n) = name {
            p.push(n);
        }
        p
    }

    /// Describes one entry in E2B's `EntryInfo` shape.
    pub fn entry_info(&self, p: &SandboxPath) -> Result<EntryInfo, FsError> {
        let (parent, name) = match p.split() {
            Some(_) => {
                let (fd, n) = self.open_parent(p)?;
                (Some(fd), n)
            }
            None => (None, OsString::from("/")),
        };
        let lst = match &parent {
            Some(fd) => fstatat(
                fd.as_fd(),
                name.as_os_str(),
                nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
            ),
            None => nix::sys::stat::fstat(self.dir.as_fd()),
        }
        .map_err(|e| FsError::from_errno(&p.abs, e))?;
        let mut info = self.info_from_stat(&p.abs, &lst);
        if is_symlink(&lst) {
            if let Some(fd) = parent.as_ref() {
                info.symlink_target = self.link_target(p, fd, &name);
            }
            info.is_symlink = true;
            // E2B reports what the link points at (its metadata too: the attributes are
            // the target's); a dangling link stays a file.
            if let Ok(target) = self.open_at(p, OFlag::O_PATH, Mode::empty())
                && let Ok(st) = nix::sys::stat::fstat(target.as_fd())
            {
                info.r#type = file_type(&st).into();
                info.size = st.st_size;
                info.metadata = read_metadata(&p.abs, &target);
            }
        } else {
            let own = match &parent {
                Some(fd) => open_entry(fd, &name),
                None => self.dir.try_clone().ok(),
            };
            if let Some(fd) = own {
                info.metadata = read_metadata(&p.abs, &fd);
            }
        }
        Ok(info)
    }

    /// The absolute path inside the sandbox that the symlink `p` leads to, as E2B reports
    /// it: where the kernel resolves it under the root's confinement, or, for a dangling
    /// (or refused) link, the path its text names taken from the link's directory and
    /// normalised with `..` stopping at `/`. A path the kernel resolves outside the root is
    /// never reported.
    fn link_target(&self, p: &SandboxPath, parent: &OwnedFd, name: &OsString) -> Option<String> {
        if let Ok(fd) = self.open_at(p, OFlag::O_PATH, Mode::empty())
            && let Some(abs) = self.inside_path(&fd)
        {
            return Some(abs);
        }
        let text = nix::fcntl::readlinkat(parent.as_fd(), name.as_os_str()).ok()?;
        // The directory the link really sits in, not the lexical one the caller named.
        let base = self
            .inside_path(parent)
            .or_else(|| p.split().map(|(dir, _)| dir.abs))?;
        Some(clamped_join(&base, &text.to_string_lossy()))
    }

    /// The path inside the sandbox of an fd opened below the root, from the kernel's own
    /// record of it; None if the kernel places it outside the root (which openat2's
    /// confinement should never allow) or it has been deleted.
    fn inside_path(&self, fd: &OwnedFd) -> Option<String> {
        let real = std::fs::read_link(Self::fd_path(fd, None)).ok()?;
        // A deleted entry reads as "path (deleted)": not a path anyone can use.
        if real.as_os_str().as_bytes().ends_with(b" (deleted)") {
            return None;
        }
        let rel = real.strip_prefix(&self.root_path).ok()?;
        Some(format!("/{}", rel.to_str()?))
    }

    fn info_from_stat(&self, abs: &str, st: &FileStat) -> EntryInfo {
        let name = Path::new(abs)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "/".into());
        EntryInfo {
            name,
            r#type: file_type(st).into(),
            path: abs.to_string(),
            size: st.st_size,
            mode: st.st_mode & 0o7777,
            permissions: permissions_string(st.st_mode),
            owner: users::name_of(&self.cfg, st.st_uid),
            group: users::name_of(&self.cfg, st.st_gid),
            modified_time: sandpit_proto::buffa_types::google::protobuf::Timestamp {
                seconds: st.st_mtime,
                nanos: st.st_mtime_nsec as i32,
                ..Default::default()
            }
            .into(),
            ..Default::default()
        }
    }

    /// Lists a directory, descending `depth` levels (symlinked directories are not followed).
    pub fn list_dir(&self, p: &SandboxPath, depth: u32) -> Result<Vec<EntryInfo>, FsError> {
        let dir = self.open_at(p, OFlag::O_RDONLY | OFlag::O_DIRECTORY, Mode::empty())?;
        let mut out = Vec::new();
        self.list_into(&dir, &p.abs, depth.max(1), &mut out)?;
        Ok(out)
    }

    fn list_into(
        &self,
        dir: &OwnedFd,
        abs: &str,
        depth: u32,
        out: &mut Vec<EntryInfo>,
    ) -> Result<(), FsError> {
        let rd =
            std::fs::read_dir(Self::fd_path(dir, None)).map_err(|e| FsError::from_io(abs, e))?;
        let mut names: Vec<OsString> = rd.filter_map(|e| e.ok().map(|e| e.file_name())).collect();
        names.sort();
        for name in names {
            let child_abs = if abs == "/" {
                format!("/{}", name.to_string_lossy())
            } else {
                format!("{abs}/{}", name.to_string_lossy())
            };
            let sp = SandboxPath {
                abs: child_abs.clone(),
            };
            let info = match self.entry_info(&sp) {
                Ok(i) => i,
                Err(FsError::NotFound(_)) => continue, // removed while listing
                Err(e) => return Err(e),
            };
            let descend = depth > 1
                && !info.is_symlink
                && info.r#type.as_known() == Some(FileType::FILE_TYPE_DIRECTORY);
            out.push(info);
            if descend {
                let how = OpenHow::new()
                    .flags(
                        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                    )
                    .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_SYMLINKS);
                if let Ok(sub) = openat2(dir.as_fd(), name.as_os_str(), how) {
                    self.list_into(&sub, &child_abs, depth - 1, out)?;
                }
            }
        }
        Ok(())
    }

    /// Removes a file, a symlink (not its target) or a whole directory tree. A path that
    /// is not there (nor its parent) is already removed: done, as E2B's envd answers
    /// (`os.RemoveAll`).
    pub fn remove(&self, p: &SandboxPath) -> Result<(), FsError> {
        match self.remove_existing(p) {
            Err(FsError::NotFound(_)) => Ok(()),
            other => other,
        }
    }

    fn remove_existing(&self, p: &SandboxPath) -> Result<(), FsError> {
        let (parent, name) = self.open_parent(p)?;
        let st = fstatat(
            parent.as_fd(),
            name.as_os_str(),
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .map_err(|e| FsError::from_errno(&p.abs, e))?;
        if is_dir(&st) {
            // std's remove_dir_all never follows symlinks inside the tree.
            std::fs::remove_dir_all(Self::fd_path(&parent, Some(&name)))
                .map_err(|e| FsError::from_io(&p.abs, e))
        } else {
            nix::unistd::unlinkat(
                parent.as_fd(),
                name.as_os_str(),
                nix::unistd::UnlinkatFlags::NoRemoveDir,
            )
            .map_err(|e| FsError::from_errno(&p.abs, e))
        }
    }

    /// Renames an entry, creating the destination's parents.
    pub fn rename(&self, from: &SandboxPath, to: &SandboxPath, user: &User) -> Result<(), FsError> {
        let (src_dir, src_name) = self.open_parent(from)?;
        if let Some((dst_parent, _)) = to.split() {
            self.mkdir_all(&dst_parent, user)?;
        }
        let (dst_dir, dst_name) = self.open_parent(to)?;
        nix::fcntl::renameat(
            src_dir.as_fd(),
            src_name.as_os_str(),
            dst_dir.as_fd(),
            dst_name.as_os_str(),
        )
        .map_err(|e| FsError::from_errno(&from.abs, e))
    }

    /// Creates the directories missing above `p` with the agent's own (root) identity and
    /// gives each to `user`, as E2B's envd does before it writes a file as the user (so
    /// `/0/x.txt` can be written although the user may not write `/`). Existing entries are
    /// left alone, and each existing one is looked up as `user`, so a directory the user
    /// cannot search stays closed. Past the first missing component nothing is resolved by
    /// path: each new directory is opened from its parent's fd without following symlinks,
    /// so a link (dangling, or swapped in meanwhile) is refused, never followed.
    pub fn create_missing_parents(&self, p: &SandboxPath, user: &User) -> Result<(), FsError> {
        let Some((parent, _)) = p.split() else {
            return Ok(());
        };
        let dir_flags = OFlag::O_PATH | OFlag::O_DIRECTORY;
        let mut dir = self.open_at(&SandboxPath { abs: "/".into() }, dir_flags, Mode::empty())?;
        let mut cur = String::new();
        let mut missing = false;
        for comp in parent.abs.split('/').filter(|c| !c.is_empty()) {
            cur.push('/');
            cur.push_str(comp);
            if !missing {
                let sp = SandboxPath { abs: cur.clone() };
                match crate::users::as_fs_user(user, || self.open_at(&sp, dir_flags, Mode::empty()))
                {
                    Ok(fd) => {
                        dir = fd;
                        continue;
                    }
                    Err(FsError::NotFound(_)) => missing = true,
                    Err(e) => return Err(e),
                }
            }
            let created =
                match nix::sys::stat::mkdirat(dir.as_fd(), comp, Mode::from_bits_truncate(0o755)) {
                    Ok(()) => true,
                    // A dangling symlink, or a race: the open below takes only a directory.
                    Err(Errno::EEXIST) => false,
                    Err(e) => return Err(FsError::from_errno(&cur, e)),
                };
            let how = OpenHow::new()
                .flags(dir_flags | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC)
                .resolve(
                    ResolveFlag::RESOLVE_BENEATH
                        | ResolveFlag::RESOLVE_NO_SYMLINKS
                        | ResolveFlag::RESOLVE_NO_MAGICLINKS,
                );
            let next = openat2(dir.as_fd(), comp, how).map_err(|e| FsError::from_errno(&cur, e))?;
            if created {
                give_new_dir(&next, user);
            }
            dir = next;
        }
        Ok(())
    }

    /// Opens (creating or truncating) a file for writing, creating its parents.
    pub fn create_file(&self, p: &SandboxPath, user: &User) -> Result<std::fs::File, FsError> {
        if let Some((parent, _)) = p.split() {
            self.mkdir_all(&parent, user)?;
        }
        let existed = self.open_at(p, OFlag::O_PATH, Mode::empty()).is_ok();
        let fd = self.open_at(
            p,
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_TRUNC,
            Mode::from_bits_truncate(0o644),
        )?;
        if !existed && user.switch {
            let _ = nix::unistd::fchown(
                fd.as_fd(),
                Some(nix::unistd::Uid::from_raw(user.uid)),
                Some(nix::unistd::Gid::from_raw(user.gid)),
            );
        }
        Ok(std::fs::File::from(fd))
    }

    /// Opens a file for reading, with its length when the length can be trusted: a
    /// regular file with a size. `/proc` and `/sys` files (and devices) report 0 and are
    /// read to their end instead, as E2B's envd serves them.
    pub fn open_read(&self, p: &SandboxPath) -> Result<(std::fs::File, Option<u64>), FsError> {
        let fd = self.open_at(p, OFlag::O_RDONLY, Mode::empty())?;
        let st = nix::sys::stat::fstat(fd.as_fd()).map_err(|e| FsError::from_errno(&p.abs, e))?;
        if is_dir(&st) {
            return Err(FsError::IsDir(p.abs.clone()));
        }
        let regular =
            SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits()) == SFlag::S_IFREG;
        let size = (regular && st.st_size > 0).then_some(st.st_size as u64);
        Ok((std::fs::File::from(fd), size))
    }
}

/// Opens entry `name` of `dir` itself (never through a symlink) as an `O_PATH`
/// descriptor, for reading its attributes; `None` if it is gone or turned into a symlink.
fn open_entry(dir: &OwnedFd, name: &OsString) -> Option<OwnedFd> {
    let how = OpenHow::new()
        .flags(OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC)
        .resolve(
            ResolveFlag::RESOLVE_BENEATH
                | ResolveFlag::RESOLVE_NO_SYMLINKS
                | ResolveFlag::RESOLVE_NO_MAGICLINKS,
        );
    let fd = openat2(dir.as_fd(), name.as_os_str(), how).ok()?;
    // O_PATH|O_NOFOLLOW opens a symlink itself; its attributes are not the entry's.
    let st = nix::sys::stat::fstat(fd.as_fd()).ok()?;
    (!is_symlink(&st)).then_some(fd)
}

/// The user metadata of the inode behind `fd`; a failure to read it (a file the user may
/// not read, an unusual file system) leaves the entry without metadata rather than
/// failing the whole answer.
fn read_metadata<M: FromIterator<(String, String)> + Default>(abs: &str, fd: &OwnedFd) -> M {
    match crate::metadata::read(fd) {
        Ok(m) => m.unwrap_or_default().into_iter().collect(),
        Err(e) => {
            tracing::debug!(path = abs, error = %e, "metadata not readable");
            Default::default()
        }
    }
}

/// Joins a symlink's text to the directory it sits in and normalises the result, a `..`
/// at `/` staying at `/` as it does when the kernel resolves in the root.
fn clamped_join(dir: &str, text: &str) -> String {
    let mut parts: Vec<&str> = Vec::new();
    let start = if text.starts_with('/') { "" } else { dir };
    for comp in start.split('/').chain(text.split('/')) {
        match comp {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            c => parts.push(c),
        }
    }
    format!("/{}", parts.join("/"))
}

fn is_dir(st: &FileStat) -> bool {
    SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits()) == SFlag::S_IFDIR
}

fn is_symlink(st: &FileStat) -> bool {
    SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits()) == SFlag::S_IFLNK
}

fn file_type(st: &FileStat) -> FileType {
    if is_dir(st) {
        FileType::FILE_TYPE_DIRECTORY
    } else if is_symlink(st) {
        FileType::FILE_TYPE_SYMLINK
    } else {
        FileType::FILE_TYPE_FILE
    }
}

/// `ls -l` style permissions, the form E2B's SDKs show.
fn permissions_string(mode: u32) -> String {
    let kind = match mode & SFlag::S_IFMT.bits() {
        m if m == SFlag::S_IFDIR.bits() => 'd',
        m if m == SFlag::S_IFLNK.bits() => 'L',
        _ => '-',
    };
    let mut s = String::with_capacity(10);
    s.push(kind);
    for shift in [6u32, 3, 0] {
        let bits = (mode >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        s.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    s
}

/// The `filesystem.Filesystem` Connect service.
pub struct FilesystemService {
    root: Arc<FsRoot>,
    watchers: crate::watch::Watchers,
}

impl FilesystemService {
    /// Serves the given root.
    pub fn new(root: Arc<FsRoot>) -> Self {
        Self {
            watchers: crate::watch::Watchers::new(root.clone()),
            root,
        }
    }

    fn user(&self, ctx: &RequestContext) -> Result<User, ConnectError> {
        let name = users::from_headers(ctx.headers());
        users::resolve(self.root.config(), name.as_deref()).ok_or_else(|| {
            ConnectError::invalid_argument(format!("unknown user {:?}", name.unwrap_or_default()))
        })
    }
}

/// Runs blocking filesystem work off the async thread.
async fn blocking<T: Send + 'static>(
    user: &User,
    f: impl FnOnce() -> Result<T, FsError> + Send + 'static,
) -> Result<T, ConnectError> {
    let user = user.clone();
    match tokio::task::spawn_blocking(move || users::as_fs_user(&user, f)).await {
        Ok(r) => r.map_err(ConnectError::from),
        Err(e) => Err(ConnectError::internal(format!("worker failed: {e}"))),
    }
}

impl Filesystem for FilesystemService {
    async fn stat(
        &self,
        ctx: RequestContext,
        request: ServiceRequest<'_, StatRequest>,
    ) -> ServiceResult<StatResponse> {
        let user = self.user(&ctx)?;
        let p = self.root.check(request.path, &user)?;
        let root = self.root.clone();
        let entry = blocking(&user, move || root.entry_info(&p)).await?;
        Response::ok(StatResponse {
            entry: entry.into(),
            ..Default::default()
        })
    }

    async fn make_dir(
        &self,
        ctx: RequestContext,
        request: ServiceRequest<'_, MakeDirRequest>,
    ) -> ServiceResult<MakeDirResponse> {
        let user = self.user(&ctx)?;
        let p = self.root.check(request.path, &user)?;
        let root = self.root.clone();
        let acting = user.clone();
        let entry = blocking(&acting, move || {
            if !root.mkdir_all(&p, &user)? {
                return Err(FsError::Exists(p.abs.clone()));
            }
            root.entry_info(&p)
        })
        .await?;
        Response::ok(MakeDirResponse {
            entry: entry.into(),
            ..Default::default()
        })
    }

    async fn r#move(
        &self,
        ctx: RequestContext,
        request: ServiceRequest<'_, MoveRequest>,
    ) -> ServiceResult<MoveResponse> {
        let user = self.user(&ctx)?;
        let from = self.root.check(request.source, &user)?;
        let to = self.root.check(request.destination, &user)?;
        let root = self.root.clone();
        let acting = user.clone();
        let entry = blocking(&acting, move || {
            root.rename(&from, &to, &user)?;
            root.entry_info(&to)
        })
        .await?;
        Response::ok(MoveResponse {
            entry: entry.into(),
            ..Default::default()
        })
    }

    async fn list_dir(
        &self,
        ctx: RequestContext,
        request: ServiceRequest<'_, ListDirRequest>,
    ) -> ServiceResult<ListDirResponse> {
        let user = self.user(&ctx)?;
        let p = self.root.check(request.path, &user)?;
        let depth = request.depth;
        let root = self.root.clone();
        let entries = blocking(&user, move || root.list_dir(&p, depth)).await?;
        Response::ok(ListDirResponse {
            entries,
            ..Default::default()
        })
    }

    async fn remove(
        &self,
        ctx: RequestContext,
        request: ServiceRequest<'_, RemoveRequest>,
    ) -> ServiceResult<RemoveResponse> {
        let user = self.user(&ctx)?;
        let p = self.root.check(request.path, &user)?;
        let root = self.root.clone();
        blocking(&user, move || root.remove(&p)).await?;
        Response::ok(RemoveResponse::default())
    }

    async fn watch_dir(
        &self,
        ctx: RequestContext,
        request: ServiceRequest<'_, WatchDirRequest>,
    ) -> ServiceResult<connectrpc::ServiceStream<WatchDirResponse>> {
        let user = self.user(&ctx)?;
        let p = self.root.check(request.path, &user)?;
        let keepalive = crate::process::keepalive_interval(&ctx);
        let stream =
            self.watchers
                .stream(p, request.recursive, request.include_entry, keepalive)?;
        Ok(Response::new(stream))
    }

    async fn create_watcher(
        &self,
        ctx: RequestContext,
        request: ServiceRequest<'_, CreateWatcherRequest>,
    ) -> ServiceResult<CreateWatcherResponse> {
        let user = self.user(&ctx)?;
        let p = self.root.check(request.path, &user)?;
        let id = self
            .watchers
            .create(p, request.recursive, request.include_entry)?;
        Response::ok(CreateWatcherResponse {
            watcher_id: id,
            ..Default::default()
        })
    }

    async fn get_watcher_events(
        &self,
        _ctx: RequestContext,
        request: ServiceRequest<'_, GetWatcherEventsRequest>,
    ) -> ServiceResult<GetWatcherEventsResponse> {
        let events = self.watchers.drain(request.watcher_id)?;
        Response::ok(GetWatcherEventsResponse {
            events,
            ..Default::default()
        })
    }

    async fn remove_watcher(
        &self,
        _ctx: RequestContext,
        request: ServiceRequest<'_, RemoveWatcherRequest>,
    ) -> ServiceResult<RemoveWatcherResponse> {
        self.watchers.remove(request.watcher_id)?;
        Response::ok(RemoveWatcherResponse::default())
    }
}

/// Opens `p` as a directory and returns a path through which a watcher can follow it.
pub fn watch_target(root: &FsRoot, p: &SandboxPath) -> Result<(OwnedFd, PathBuf), FsError> {
    let fd = root.open_at(p, OFlag::O_RDONLY | OFlag::O_DIRECTORY, Mode::empty())?;
    let path = FsRoot::fd_path(&fd, None);
    Ok((fd, path))
}

/// Converts bytes of an OS string for messages.
pub fn lossy(name: &OsString) -> String {
    String::from_utf8_lossy(name.as_bytes()).into_owned()
}

/// Gives a directory the agent just made (as root) to `user` through its descriptor, not
/// by name: the user owns the parent, so between the mkdir and a chown by name it could
/// swap the name for another inode (a hard link to a root-owned file) and have that chowned.
/// Only a directory still owned by the agent is handed over.
fn give_new_dir(fd: &OwnedFd, user: &User) {
    if !user.switch {
        return;
    }
    let empty = AtFlags::AT_EMPTY_PATH;
    match fstatat(fd.as_fd(), "", empty) {
        Ok(st) if st.st_uid == nix::unistd::geteuid().as_raw() => {}
        Ok(_) => {
            tracing::debug!("a new directory changed hands before its chown; left alone");
            return;
        }
        Err(e) => {
            tracing::debug!(error = %e, "stat of a new directory failed");
            return;
        }
    }
    let r = nix::unistd::fchownat(
        fd.as_fd(),
        "",
        Some(nix::unistd::Uid::from_raw(user.uid)),
        Some(nix::unistd::Gid::from_raw(user.gid)),
        empty,
    );
    if let Err(e) = r {
        tracing::debug!(error = %e, "chown of a new directory failed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::AgentConfig;
    use std::collections::HashMap;

    fn root_at(dir: &Path) -> FsRoot {
        root_in(dir, IsolationMode::Process)
    }

    fn root_in(dir: &Path, mode: IsolationMode) -> FsRoot {
        let cfg = AgentConfig {
            mode,
            root: dir.to_path_buf(),
            workdir: "/home/user".into(),
            env: Default::default(),
            listen_fd: None,
            listen_path: None,
            sudo: false,
            live: Default::default(),
        };
        FsRoot::open(Arc::new(cfg)).unwrap()
    }

    fn user() -> User {
        crate::users::resolve(
            &AgentConfig {
                mode: IsolationMode::Process,
                root: "/".into(),
                workdir: "/".into(),
                env: Default::default(),
                listen_fd: None,
                listen_path: None,
                sudo: false,
                live: Default::default(),
            },
            None,
        )
        .unwrap()
    }

    #[test]
    fn lexical_checks_refuse_escapes_and_garbage() {
        let t = tempfile::tempdir().unwrap();
        let r = root_at(t.path());
        let u = user();
        assert_eq!(r.check("/a/./b/../c", &u).unwrap().abs, "/a/c");
        assert_eq!(
            r.check("notes.txt", &u).unwrap().abs,
            "/home/user/notes.txt"
        );
        assert!(matches!(
            r.check("/../etc/passwd", &u),
            Err(FsError::Escape(_))
        ));
        assert!(matches!(
            r.check("../../../../x", &u),
            Err(FsError::Escape(_))
        ));
        assert!(matches!(r.check("", &u), Err(FsError::InvalidPath(_))));
        assert!(matches!(r.check("/a\0b", &u), Err(FsError::InvalidPath(_))));
    }

    /// A non-root user the agent switches to (needs the tests to run as root).
    fn switched_user() -> User {
        User {
            name: "user",
            uid: 4242,
            gid: 4242,
            home: "/home/user",
            switch: true,
        }
    }

    fn running_as_root() -> bool {
        nix::unistd::geteuid().is_root()
    }

    #[test]
    fn missing_parents_are_created_for_the_user_and_the_file_written_as_the_user() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        if !running_as_root() {
            eprintln!("skipped: needs root to switch users");
            return;
        }
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("root");
        std::fs::create_dir_all(&root).unwrap();
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755)).unwrap();
        // A directory the user may not write: its missing children are still created (as
        // E2B does for `/0`), but a file directly in it stays refused.
        std::fs::create_dir(root.join("locked")).unwrap();
        std::fs::set_permissions(root.join("locked"), std::fs::Permissions::from_mode(0o755))
            .unwrap();
        let r = root_in(&root, IsolationMode::Container);
        let u = switched_user();
        let sp = r.check("/0/a/x.txt", &u).unwrap();
        r.create_missing_parents(&sp, &u).unwrap();
        let f = crate::users::as_fs_user(&u, || r.create_file(&sp, &u)).unwrap();
        drop(f);
        for d in ["0", "0/a", "0/a/x.txt"] {
            let m = std::fs::symlink_metadata(root.join(d)).unwrap();
            assert_eq!((m.uid(), m.gid()), (4242, 4242), "{d}");
        }
        let sp = r.check("/locked/x.txt", &u).unwrap();
        r.create_missing_parents(&sp, &u).unwrap();
        assert!(matches!(
            crate::users::as_fs_user(&u, || r.create_file(&sp, &u)),
            Err(FsError::Permission(_))
        ));
        assert!(!root.join("locked/x.txt").exists());
        // Existing directories keep their owner.
        assert_eq!(std::fs::metadata(root.join("locked")).unwrap().uid(), 0);
        // A directory the user cannot search hides what is below it.
        std::fs::create_dir(root.join("private")).unwrap();
        std::fs::set_permissions(root.join("private"), std::fs::Permissions::from_mode(0o700))
            .unwrap();
        let sp = r.check("/private/new/x.txt", &u).unwrap();
        assert!(matches!(
            r.create_missing_parents(&sp, &u),
            Err(FsError::Permission(_))
        ));
        assert!(!root.join("private/new").exists());
    }

    #[test]
    fn missing_parents_never_follow_a_symlink_out_of_the_root() {
        for mode in [IsolationMode::Container, IsolationMode::Process] {
            let t = tempfile::tempdir().unwrap();
            let root = t.path().join("root");
            let outside = t.path().join("outside");
            std::fs::create_dir_all(&root).unwrap();
            std::fs::create_dir_all(&outside).unwrap();
            // Absolute and relative links to a host directory, and one to a host path that
            // does not exist yet (a creation there would land outside).
            std::os::unix::fs::symlink(&outside, root.join("abs")).unwrap();
            std::os::unix::fs::symlink("../outside", root.join("rel")).unwrap();
            std::os::unix::fs::symlink(t.path().join("made"), root.join("dangling")).unwrap();
            let r = root_in(&root, mode);
            let u = if running_as_root() {
                switched_user()
            } else {
                user()
            };
            for p in [
                "/abs/new/x.txt",
                "/rel/new/x.txt",
                "/dangling/new/x.txt",
                "/dangling/x.txt",
            ] {
                let sp = r.check(p, &u).unwrap();
                let made = r
                    .create_missing_parents(&sp, &u)
                    .and_then(|()| crate::users::as_fs_user(&u, || r.create_file(&sp, &u)));
                assert!(made.is_err(), "{mode:?} {p} must be refused");
            }
            assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0, "{mode:?}");
            assert!(!t.path().join("made").exists(), "{mode:?}");
            assert!(!t.path().join("new").exists(), "{mode:?}");
        }
    }

    #[test]
    fn symlinks_out_of_the_root_are_refused() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("root");
        std::fs::create_dir_all(&root).unwrap();
        std::fs::write(t.path().join("secret"), "host").unwrap();
        std::os::unix::fs::symlink(t.path().join("secret"), root.join("abs")).unwrap();
        std::os::unix::fs::symlink("../secret", root.join("rel")).unwrap();
        std::os::unix::fs::symlink("/", root.join("slash")).unwrap();
        let r = root_at(&root);
        let u = user();
        for p in ["/abs", "/rel", "/slash/etc/passwd"] {
            let sp = r.check(p, &u).unwrap();
            assert!(
                matches!(r.open_read(&sp), Err(FsError::Escape(_))),
                "{p} must be refused"
            );
            assert!(
                matches!(r.create_file(&sp, &u), Err(FsError::Escape(_))),
                "{p} must not be writable"
            );
        }
        // Listing shows the link itself without following it out.
        let list = r.list_dir(&r.check("/", &u).unwrap(), 1).unwrap();
        assert!(list.iter().any(|e| e.name == "abs" && e.is_symlink));
        assert_eq!(
            std::fs::read_to_string(t.path().join("secret")).unwrap(),
            "host"
        );
    }

    #[test]
    fn a_symlink_reports_the_absolute_path_it_leads_to_inside_the_root() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("root");
        let home = root.join("home/user");
        std::fs::create_dir_all(&home).unwrap();
        std::fs::write(t.path().join("secret"), "host").unwrap();
        std::fs::write(home.join("test_file.txt"), "x").unwrap();
        let link = |text: &str, name: &str| std::os::unix::fs::symlink(text, home.join(name));
        link("test_file.txt", "plain").unwrap();
        link("../user/./test_file.txt", "dotted").unwrap();
        link("plain", "chained").unwrap();
        link("missing/x", "dangling").unwrap();
        link("../../../../../secret", "climbing").unwrap();
        link(t.path().join("secret").to_str().unwrap(), "host_abs").unwrap();
        std::os::unix::fs::symlink("/home/user/test_file.txt", root.join("abs")).unwrap();
        let host = t.path().to_string_lossy().into_owned();
        let u = user();
        let target = |r: &FsRoot, p: &str| {
            let info = r.entry_info(&r.check(p, &u).unwrap()).unwrap();
            assert!(info.is_symlink, "{p}");
            info.symlink_target.unwrap()
        };
        for mode in [IsolationMode::Process, IsolationMode::Container] {
            let r = root_in(&root, mode);
            for p in ["plain", "dotted", "chained"] {
                assert_eq!(target(&r, p), "/home/user/test_file.txt", "{p} {mode:?}");
            }
            assert_eq!(target(&r, "dangling"), "/home/user/missing/x");
            // A `..` stops at the root, as the kernel's resolution in the root does.
            assert_eq!(target(&r, "climbing"), "/secret");
            // A link naming a host path is not followed there: it reports the path it
            // names, which inside the sandbox is a missing file.
            assert_eq!(target(&r, "host_abs"), format!("{host}/secret"));
            let listed = r.list_dir(&r.check("/home/user", &u).unwrap(), 1).unwrap();
            let plain = listed.iter().find(|e| e.name == "plain").unwrap();
            assert_eq!(
                plain.symlink_target.as_deref(),
                Some("/home/user/test_file.txt")
            );
            assert_eq!(
                plain.r#type.as_known(),
                Some(FileType::FILE_TYPE_FILE),
                "a link reports its target's type"
            );
        }
        // An absolute link means the sandbox's own path in a container.
        let c = root_in(&root, IsolationMode::Container);
        assert_eq!(target(&c, "/abs"), "/home/user/test_file.txt");
    }

    /// Sets `user.<name>` on a host path; false where the file system keeps none.
    fn set_xattr(p: &Path, name: &str, value: &[u8]) -> bool {
        let path = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
        let name = std::ffi::CString::new(name).unwrap();
        // SAFETY: valid C strings and a buffer of the length given.
        unsafe {
            libc::setxattr(
                path.as_ptr(),
                name.as_ptr(),
                value.as_ptr().cast(),
                value.len(),
                0,
            ) == 0
        }
    }

    #[test]
    fn removing_what_is_not_there_is_done_but_a_refusal_stays_one() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("root");
        std::fs::create_dir_all(root.join("d")).unwrap();
        std::fs::write(t.path().join("outside"), "host").unwrap();
        std::os::unix::fs::symlink(t.path(), root.join("up")).unwrap();
        let r = root_at(&root);
        let u = user();
        for p in ["/missing", "/missing/deeper/x", "/d/missing"] {
            r.remove(&r.check(p, &u).unwrap()).unwrap();
        }
        // A parent that is a symlink out of the root is an escape, not "already gone".
        assert!(matches!(
            r.remove(&r.check("/up/outside", &u).unwrap()),
            Err(FsError::Escape(_))
        ));
        assert!(t.path().join("outside").exists());
    }

    #[test]
    fn entries_report_user_e2b_metadata_and_never_a_host_files() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("root");
        std::fs::create_dir_all(root.join("home/user")).unwrap();
        let f = root.join("home/user/f.txt");
        std::fs::write(&f, "x").unwrap();
        if !set_xattr(&f, "user.e2b.author", b"mish") {
            eprintln!("skipped: no user xattrs on this file system");
            return;
        }
        assert!(set_xattr(&f, "user.other", b"not ours"));
        assert!(set_xattr(&f, "user.e2b.bin", b"\xff"));
        // A host file with metadata, and links to it from inside the root.
        let host = t.path().join("host.txt");
        std::fs::write(&host, "host").unwrap();
        assert!(set_xattr(&host, "user.e2b.secret", b"host"));
        std::os::unix::fs::symlink(&host, root.join("home/user/abs")).unwrap();
        std::os::unix::fs::symlink("../../../host.txt", root.join("home/user/rel")).unwrap();
        std::os::unix::fs::symlink("f.txt", root.join("home/user/inside")).unwrap();
        let want: HashMap<String, String> = [("author".to_string(), "mish".to_string())]
            .into_iter()
            .collect();
        let u = user();
        for mode in [IsolationMode::Process, IsolationMode::Container] {
            let r = root_in(&root, mode);
            let info = r
                .entry_info(&r.check("/home/user/f.txt", &u).unwrap())
                .unwrap();
            assert_eq!(
                info.metadata.clone().into_iter().collect::<HashMap<_, _>>(),
                want
            );
            let link = r
                .entry_info(&r.check("/home/user/inside", &u).unwrap())
                .unwrap();
            assert_eq!(
                link.metadata.clone().into_iter().collect::<HashMap<_, _>>(),
                want
            );
            for p in ["/home/user/abs", "/home/user/rel"] {
                let info = r.entry_info(&r.check(p, &u).unwrap()).unwrap();
                assert!(
                    info.metadata.is_empty(),
                    "{mode:?} {p}: {:?}",
                    info.metadata
                );
            }
            let listed = r.list_dir(&r.check("/home/user", &u).unwrap(), 1).unwrap();
            for e in &listed {
                let got: HashMap<_, _> = e.metadata.clone().into_iter().collect();
                match e.name.as_str() {
                    "f.txt" | "inside" => assert_eq!(got, want, "{}", e.name),
                    _ => assert!(got.is_empty(), "{mode:?} {}: {got:?}", e.name),
                }
            }
            // A rename keeps them: they belong to the inode.
            let from = r.check("/home/user/f.txt", &u).unwrap();
            let to = r.check("/home/user/g.txt", &u).unwrap();
            r.rename(&from, &to, &u).unwrap();
            let moved = r.entry_info(&to).unwrap();
            assert_eq!(moved.metadata.into_iter().collect::<HashMap<_, _>>(), want);
            r.rename(&to, &from, &u).unwrap();
        }
    }

    #[test]
    fn only_regular_files_with_a_size_give_a_length() {
        let t = tempfile::tempdir().unwrap();
        std::fs::write(t.path().join("full"), "12345").unwrap();
        std::fs::write(t.path().join("empty"), "").unwrap();
        let r = root_at(t.path());
        let u = user();
        let size = |p: &str| r.open_read(&r.check(p, &u).unwrap()).unwrap().1;
        assert_eq!(size("/full"), Some(5));
        // Read to the end: an empty file gives nothing either way; a /proc file gives its
        // text although it reports 0.
        assert_eq!(size("/empty"), None);
    }

    #[test]
    fn a_symlink_swapped_in_mid_flight_never_leads_outside() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("root");
        let outside = t.path().join("outside");
        std::fs::create_dir_all(root.join("d")).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(root.join("d/f"), "inside").unwrap();
        std::fs::write(outside.join("f"), "outside").unwrap();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (stop2, root2, outside2) = (stop.clone(), root.clone(), outside.clone());
        // Flip /d between the real directory and a symlink to the outside as fast as possible.
        let flipper = std::thread::spawn(move || {
            while !stop2.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = std::fs::rename(root2.join("d"), root2.join("real"));
                let _ = std::os::unix::fs::symlink(&outside2, root2.join("d"));
                let _ = std::fs::remove_file(root2.join("d"));
                let _ = std::fs::rename(root2.join("real"), root2.join("d"));
            }
        });
        let r = root_at(&root);
        let u = user();
        let p = r.check("/d/f", &u).unwrap();
        let (mut inside_reads, mut attempts) = (0u32, 0u32);
        // At least 3000 tries; on a loaded machine the flipper may hold /d as a symlink
        // for whole time slices, so go on (bounded) until one read went through, or the
        // test would prove nothing.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while attempts < 3000 || (inside_reads == 0 && std::time::Instant::now() < deadline) {
            attempts += 1;
            if let Ok((mut f, _)) = r.open_read(&p) {
                let mut s = String::new();
                std::io::Read::read_to_string(&mut f, &mut s).unwrap();
                assert_eq!(s, "inside", "a read escaped the root");
                inside_reads += 1;
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        flipper.join().unwrap();
        assert!(inside_reads > 0, "no read went through in {attempts} tries");
    }
}
