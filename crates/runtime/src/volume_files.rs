//! File operations inside a volume mounted on the host, for the volume-content API.
//!
//! A volume's files are written by sandboxes, so anything in it may be hostile: symlinks
//! to the host's `/etc`, `..` chains, FIFOs, device nodes. Every path is resolved by the
//! kernel from a descriptor of the volume's root with `openat2` and
//! `RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV` (a symlink, absolute or
//! relative, means a path of the volume, never of the host, and no mount is crossed); the
//! last component is then handled with `*at` calls on the parent's descriptor that do not
//! follow it. Reads open with `O_NONBLOCK` and check `fstat` before the first byte, so a
//! FIFO never blocks and only regular files are read. Hard links cannot leave a volume
//! (they never cross file systems), and the host mount is `nodev`.

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::{FileStat, Mode, SFlag};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;

/// Longest path accepted, in bytes.
pub const MAX_PATH: usize = 4096;
/// Deepest listing served.
pub const MAX_DEPTH: u32 = 32;
/// Most entries one listing returns.
pub const MAX_ENTRIES: usize = 50_000;
/// Highest inner uid or gid a file may get (the sandbox's id range).
pub const MAX_ID: u32 = crate::init::ID_RANGE - 1;
/// Highest mode accepted (permission, sticky, setuid and setgid bits; the volume is
/// mounted `nosuid` everywhere).
pub const MAX_MODE: u32 = 0o7777;

/// Why a file operation failed: the request's fault or the host's.
#[derive(Debug, thiserror::Error)]
pub enum VolumeFileError {
    /// The path is not acceptable (empty component, NUL, too long, the root where a file
    /// is needed).
    #[error("invalid path: {0}")]
    InvalidPath(String),
    /// Nothing at the path (or a symlink leading nowhere inside the volume).
    #[error("path {0} not found")]
    NotFound(String),
    /// Something is in the way: the entry exists, or is of the wrong kind.
    #[error("{0}")]
    Conflict(String),
    /// The entry is not what the operation works on (a FIFO, a device, a directory).
    #[error("{0}")]
    WrongType(String),
    /// A uid, gid or mode outside the accepted range.
    #[error("{0}")]
    InvalidArgument(String),
    /// The file system refuses the access (a device node on the `nodev` mount).
    #[error("{0}: permission denied")]
    Denied(String),
    /// The volume's file system is full.
    #[error("the volume is full")]
    NoSpace,
    /// The operation failed on the host.
    #[error("{context}")]
    Sys {
        context: String,
        #[source]
        source: Errno,
    },
}

type Result<T> = std::result::Result<T, VolumeFileError>;

fn sys(context: impl Into<String>) -> impl FnOnce(Errno) -> VolumeFileError {
    let context = context.into();
    move |e| VolumeFileError::Sys { context, source: e }
}

/// Kind of a volume entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryKind {
    File,
    Directory,
    Symlink,
    /// A FIFO, socket or device node.
    Other,
}

/// One entry of a volume, as stat reads it (never following a final symlink).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Last component (empty for the root).
    pub name: String,
    /// Absolute path inside the volume, `/` first.
    pub path: String,
    pub kind: EntryKind,
    pub size: u64,
    /// Permission bits (`st_mode & 0o7777`).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// Times in unix nanoseconds.
    pub atime_ns: i64,
    pub mtime_ns: i64,
    pub ctime_ns: i64,
    /// Where a symlink points (as written, unresolved).
    pub target: Option<String>,
}

/// Owner and mode a new file or directory gets, or an update sets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Meta {
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub mode: Option<u32>,
}

impl Meta {
    /// Checks the ranges: ids in the sandbox's range, mode at most 0o7777.
    pub fn check(&self) -> Result<()> {
        for (what, v) in [("uid", self.uid), ("gid", self.gid)] {
            if let Some(v) = v
                && v > MAX_ID
            {
                return Err(VolumeFileError::InvalidArgument(format!(
                    "{what} {v} is out of range 0..={MAX_ID}"
                )));
            }
        }
        if let Some(m) = self.mode
            && m > MAX_MODE
        {
            return Err(VolumeFileError::InvalidArgument(format!(
                "mode {m:#o} is out of range 0..=0o7777"
            )));
        }
        Ok(())
    }
}

/// A path inside a volume, split into its components (`.` dropped, `..` kept for the
/// kernel to resolve inside the root).
#[derive(Debug, Clone)]
struct VPath {
    parts: Vec<String>,
}

impl VPath {
    fn parse(path: &str) -> Result<Self> {
        if path.len() > MAX_PATH || path.contains('\0') {
            return Err(VolumeFileError::InvalidPath(format!(
                "a path is at most {MAX_PATH} bytes without NUL"
            )));
        }
        let parts: Vec<String> = path
            .split('/')
            .filter(|c| !c.is_empty() && *c != ".")
            .map(str::to_string)
            .collect();
        if parts.iter().any(|c| c.len() > 255) {
            return Err(VolumeFileError::InvalidPath(
                "a path component is at most 255 bytes".into(),
            ));
        }
        Ok(Self { parts })
    }

    fn display(&self) -> String {
        format!("/{}", self.parts.join("/"))
    }

    /// The parent's components and the last one; `None` for the root (or a path whose last
    /// component is `..`, which names no entry of its own).
    fn split_last(&self) -> Option<(&[String], &str)> {
        let (last, parent) = self.parts.split_last()?;
        if last == ".." {
            return None;
        }
        Some((parent, last.as_str()))
    }
}

/// The open root of one volume.
pub struct VolumeRoot {
    root: OwnedFd,
}

fn how(flags: OFlag) -> OpenHow {
    OpenHow::new().flags(flags | OFlag::O_CLOEXEC).resolve(
        ResolveFlag::RESOLVE_IN_ROOT
            | ResolveFlag::RESOLVE_NO_MAGICLINKS
            | ResolveFlag::RESOLVE_NO_XDEV,
    )
}

fn kind_of(st: &FileStat) -> EntryKind {
    match SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT {
        SFlag::S_IFREG => EntryKind::File,
        SFlag::S_IFDIR => EntryKind::Directory,
        SFlag::S_IFLNK => EntryKind::Symlink,
        _ => EntryKind::Other,
    }
}

fn not_found_or(path: &str, context: &str) -> impl FnOnce(Errno) -> VolumeFileError {
    let (path, context) = (path.to_string(), context.to_string());
    move |e| match e {
        Errno::ENOENT => VolumeFileError::NotFound(path),
        Errno::ENOTDIR => VolumeFileError::NotFound(path),
        Errno::ELOOP => VolumeFileError::Conflict(format!("{path}: too many symlinks")),
        Errno::EXDEV => VolumeFileError::Conflict(format!("{path}: crosses a mount")),
        Errno::ENOSPC | Errno::EDQUOT => VolumeFileError::NoSpace,
        Errno::EEXIST => VolumeFileError::Conflict(format!("{path} already exists")),
        Errno::EISDIR => VolumeFileError::WrongType(format!("{path} is a directory")),
        Errno::EACCES | Errno::EPERM => VolumeFileError::Denied(path),
        Errno::ENAMETOOLONG => VolumeFileError::InvalidPath(format!("{path}: name too long")),
        e => VolumeFileError::Sys {
            context: format!("{context} {path}"),
            source: e,
        },
    }
}

fn stat_at(dir: BorrowedFd<'_>, name: &str, shown: &str) -> Result<FileStat> {
    if name.is_empty() {
        return nix::sys::stat::fstat(dir).map_err(not_found_or(shown, "stat"));
    }
    nix::sys::stat::fstatat(dir, name, AtFlags::AT_SYMLINK_NOFOLLOW)
        .map_err(not_found_or(shown, "stat"))
}

fn entry(dir: BorrowedFd<'_>, name: &str, path: String) -> Result<Entry> {
    let st = stat_at(dir, name, &path)?;
    let kind = kind_of(&st);
    let target = if kind == EntryKind::Symlink {
        nix::fcntl::readlinkat(dir, name)
            .ok()
            .map(|t| t.to_string_lossy().into_owned())
    } else {
        None
    };
    let ns = |s: i64, n: i64| s.saturating_mul(1_000_000_000).saturating_add(n);
    Ok(Entry {
        name: name.to_string(),
        path,
        kind,
        size: st.st_size.max(0) as u64,
        mode: st.st_mode & 0o7777,
        uid: st.st_uid,
        gid: st.st_gid,
        atime_ns: ns(st.st_atime, st.st_atime_nsec),
        mtime_ns: ns(st.st_mtime, st.st_mtime_nsec),
        ctime_ns: ns(st.st_ctime, st.st_ctime_nsec),
        target,
    })
}

/// Applies owner and mode to `fd` (an `O_PATH` descriptor of the entry, never a path).
fn apply(fd: &OwnedFd, meta: &Meta, shown: &str) -> Result<()> {
    if meta.uid.is_some() || meta.gid.is_some() {
        nix::unistd::fchownat(
            fd,
            "",
            meta.uid.map(nix::unistd::Uid::from_raw),
            meta.gid.map(nix::unistd::Gid::from_raw),
            AtFlags::AT_EMPTY_PATH,
        )
        .map_err(sys(format!("chown {shown}")))?;
    }
    if let Some(m) = meta.mode {
        // chmod has no descriptor form for O_PATH descriptors before Linux 6.6; through
        // /proc/self/fd it acts on the very inode the descriptor holds.
        let p = format!("/proc/self/fd/{}", fd.as_raw_fd());
        nix::sys::stat::fchmodat(
            nix::fcntl::AT_FDCWD,
            p.as_str(),
            Mode::from_bits_truncate(m),
            nix::sys::stat::FchmodatFlags::FollowSymlink,
        )
        .map_err(sys(format!("chmod {shown}")))?;
    }
    Ok(())
}

impl VolumeRoot {
    /// Opens the volume mounted at `dir`.
    pub fn open(dir: &Path) -> Result<Self> {
        let root = nix::fcntl::open(
            dir,
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(sys(format!("open {}", dir.display())))?;
        Ok(Self { root })
    }

    fn resolve(&self, parts: &[String], flags: OFlag, shown: &str) -> Result<OwnedFd> {
        let rel = if parts.is_empty() {
            ".".to_string()
        } else {
            parts.join("/")
        };
        nix::fcntl::openat2(&self.root, rel.as_str(), how(flags))
            .map_err(not_found_or(shown, "open"))
    }

    /// The directory `parts` names, made (with `meta`, defaulting to `default_owner` and
    /// 0755) where missing when `create` is set.
    fn dir(&self, parts: &[String], create: Option<(&Meta, u32)>, shown: &str) -> Result<OwnedFd> {
        let flags = OFlag::O_PATH | OFlag::O_DIRECTORY;
        let Some((meta, owner)) = create else {
            return self.resolve(parts, flags, shown);
        };
        let mut dir = self.resolve(&[], flags, shown)?;
        for i in 0..parts.len() {
            dir = match self.resolve(&parts[..=i], flags, shown) {
                Ok(fd) => fd,
                Err(VolumeFileError::NotFound(_)) => {
                    self.mkdir_in(&dir, &parts[i], meta, owner, shown)?;
                    self.resolve(&parts[..=i], flags, shown)?
                }
                Err(e) => return Err(e),
            };
        }
        Ok(dir)
    }

    fn mkdir_in(
        &self,
        parent: &OwnedFd,
        name: &str,
        meta: &Meta,
        owner: u32,
        shown: &str,
    ) -> Result<()> {
        if name == ".." {
            return Err(VolumeFileError::InvalidPath(format!(
                "{shown}: cannot create '..'"
            )));
        }
        nix::sys::stat::mkdirat(parent, name, Mode::from_bits_truncate(0o700))
            .map_err(not_found_or(shown, "mkdir"))?;
        // Made 0700 and root's, then given away: nobody else sees it half made.
        let fd = nix::fcntl::openat(
            parent,
            name,
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(not_found_or(shown, "open"))?;
        let full = Meta {
            uid: Some(meta.uid.unwrap_or(owner)),
            gid: Some(meta.gid.unwrap_or(owner)),
            mode: Some(meta.mode.unwrap_or(0o755)),
        };
        apply(&fd, &full, shown)
    }

    /// Stats `path` (a final symlink is reported, not followed).
    pub fn stat(&self, path: &str) -> Result<Entry> {
        let p = VPath::parse(path)?;
        let shown = p.display();
        match p.split_last() {
            None => {
                let d = self.resolve(&p.parts, OFlag::O_PATH | OFlag::O_DIRECTORY, &shown)?;
                entry(d.as_fd(), "", shown)
            }
            Some((parent, name)) => {
                let d = self.dir(parent, None, &shown)?;
                entry(d.as_fd(), name, shown)
            }
        }
    }

    /// Opens the regular file at `path` for reading (symlinks followed inside the volume);
    /// returns it with its size. A FIFO, device or directory is refused without blocking.
    pub fn open_read(&self, path: &str) -> Result<(std::fs::File, u64)> {
        let p = VPath::parse(path)?;
        let shown = p.display();
        // What it is, without opening it, for a clear refusal (the check after the open
        // below is the one that guards).
        let probe = self.resolve(&p.parts, OFlag::O_PATH, &shown)?;
        let st = nix::sys::stat::fstat(&probe).map_err(sys(format!("stat {shown}")))?;
        if kind_of(&st) == EntryKind::Other {
            return Err(VolumeFileError::WrongType(format!(
                "{shown} is not a regular file"
            )));
        }
        let fd = self.resolve(
            &p.parts,
            OFlag::O_RDONLY | OFlag::O_NONBLOCK | OFlag::O_NOCTTY,
            &shown,
        )?;
        let st = nix::sys::stat::fstat(&fd).map_err(sys(format!("stat {shown}")))?;
        match kind_of(&st) {
            EntryKind::File => {}
            EntryKind::Directory => {
                return Err(VolumeFileError::WrongType(format!(
                    "{shown} is a directory"
                )));
            }
            _ => {
                return Err(VolumeFileError::WrongType(format!(
                    "{shown} is not a regular file"
                )));
            }
        }
        // Back to blocking reads for a regular file.
        nix::fcntl::fcntl(&fd, nix::fcntl::FcntlArg::F_SETFL(OFlag::empty()))
            .map_err(sys(format!("fcntl {shown}")))?;
        Ok((std::fs::File::from(fd), st.st_size.max(0) as u64))
    }

    /// Opens `path` for writing from the start, made when missing (its parents too when
    /// `force`), truncated when it is a regular file; a final symlink, FIFO, device or
    /// directory is refused. New files get `meta`, defaulting to `default_owner` and 0644;
    /// the caller applies `meta` to an existing file with [`VolumeRoot::finish_write`].
    pub fn open_write(
        &self,
        path: &str,
        meta: &Meta,
        force: bool,
        default_owner: u32,
    ) -> Result<(std::fs::File, bool)> {
        meta.check()?;
        let p = VPath::parse(path)?;
        let shown = p.display();
        let (parent, name) = p.split_last().ok_or_else(|| {
            VolumeFileError::InvalidPath(format!("{shown} names a directory, not a file"))
        })?;
        let dir = self.dir(parent, force.then_some((meta, default_owner)), &shown)?;
        if let Ok(st) = stat_at(dir.as_fd(), name, &shown)
            && kind_of(&st) != EntryKind::File
        {
            return Err(VolumeFileError::WrongType(format!(
                "{shown} is not a regular file"
            )));
        }
        // The last component is created in the resolved parent and never followed.
        let flags = OFlag::O_WRONLY
            | OFlag::O_NONBLOCK
            | OFlag::O_NOFOLLOW
            | OFlag::O_NOCTTY
            | OFlag::O_CLOEXEC;
        let (fd, created) = match nix::fcntl::openat(
            &dir,
            name,
            flags | OFlag::O_CREAT | OFlag::O_EXCL,
            Mode::from_bits_truncate(0o600),
        ) {
            Ok(fd) => (fd, true),
            Err(Errno::EEXIST) => (
                nix::fcntl::openat(&dir, name, flags, Mode::empty()).map_err(|e| match e {
                    Errno::ELOOP => VolumeFileError::WrongType(format!("{shown} is a symlink")),
                    Errno::ENXIO => {
                        VolumeFileError::WrongType(format!("{shown} is not a regular file"))
                    }
                    e => not_found_or(&shown, "open")(e),
                })?,
                false,
            ),
            Err(e) => return Err(not_found_or(&shown, "create")(e)),
        };
        let st = nix::sys::stat::fstat(&fd).map_err(sys(format!("stat {shown}")))?;
        if kind_of(&st) != EntryKind::File {
            return Err(VolumeFileError::WrongType(format!(
                "{shown} is not a regular file"
            )));
        }
        nix::fcntl::fcntl(&fd, nix::fcntl::FcntlArg::F_SETFL(OFlag::empty()))
            .map_err(sys(format!("fcntl {shown}")))?;
        nix::unistd::ftruncate(&fd, 0).map_err(not_found_or(&shown, "truncate"))?;
        if created {
            let full = Meta {
                uid: Some(meta.uid.unwrap_or(default_owner)),
                gid: Some(meta.gid.unwrap_or(default_owner)),
                mode: Some(meta.mode.unwrap_or(0o644)),
            };
            nix::unistd::fchown(
                &fd,
                full.uid.map(nix::unistd::Uid::from_raw),
                full.gid.map(nix::unistd::Gid::from_raw),
            )
            .map_err(sys(format!("chown {shown}")))?;
            nix::sys::stat::fchmod(&fd, Mode::from_bits_truncate(full.mode.unwrap_or(0o644)))
                .map_err(sys(format!("chmod {shown}")))?;
        }
        Ok((std::fs::File::from(fd), created))
    }

    /// After a write to `file` (opened by [`VolumeRoot::open_write`]): applies `meta` to an
    /// existing file and stats it.
    pub fn finish_write(&self, file: &std::fs::File, path: &str, meta: &Meta) -> Result<Entry> {
        let p = VPath::parse(path)?;
        let shown = p.display();
        if meta.uid.is_some() || meta.gid.is_some() {
            nix::unistd::fchown(
                file,
                meta.uid.map(nix::unistd::Uid::from_raw),
                meta.gid.map(nix::unistd::Gid::from_raw),
            )
            .map_err(sys(format!("chown {shown}")))?;
        }
        if let Some(m) = meta.mode {
            nix::sys::stat::fchmod(file, Mode::from_bits_truncate(m))
                .map_err(sys(format!("chmod {shown}")))?;
        }
        let name = p.parts.last().cloned().unwrap_or_default();
        entry(file.as_fd(), "", shown).map(|mut e| {
            e.name = name;
            e
        })
    }

    /// Makes the directory `path` (its parents too when `force`); with `force` an existing
    /// directory is fine.
    pub fn make_dir(&self, path: &str, meta: &Meta, force: bool, owner: u32) -> Result<Entry> {
        meta.check()?;
        let p = VPath::parse(path)?;
        let shown = p.display();
        let (parent, name) = p
            .split_last()
            .ok_or_else(|| VolumeFileError::Conflict(format!("{shown} already exists")))?;
        let dir = self.dir(parent, force.then_some((meta, owner)), &shown)?;
        match self.mkdir_in(&dir, name, meta, owner, &shown) {
            Ok(()) => {}
            Err(VolumeFileError::Conflict(_))
                if force
                    && stat_at(dir.as_fd(), name, &shown)
                        .is_ok_and(|st| kind_of(&st) == EntryKind::Directory) => {}
            Err(e) => return Err(e),
        }
        entry(dir.as_fd(), name, shown)
    }

    /// Lists directory `path` down to `depth` levels (1: its entries only); symlinks are
    /// listed, never followed.
    pub fn list(&self, path: &str, depth: u32) -> Result<Vec<Entry>> {
        let p = VPath::parse(path)?;
        let shown = p.display();
        let depth = depth.clamp(1, MAX_DEPTH);
        let dir = self.resolve(&p.parts, OFlag::O_RDONLY | OFlag::O_DIRECTORY, &shown)?;
        let base = if p.parts.is_empty() {
            String::new()
        } else {
            shown.clone()
        };
        let mut out = Vec::new();
        list_into(dir, &base, depth, &mut out)?;
        Ok(out)
    }

    /// Sets owner and mode of `path` (a final symlink gets its owner changed, never its
    /// target's; a mode for a symlink is refused).
    pub fn set_meta(&self, path: &str, meta: &Meta) -> Result<Entry> {
        meta.check()?;
        let p = VPath::parse(path)?;
        let shown = p.display();
        let (dir, name) = match p.split_last() {
            Some((parent, name)) => (self.dir(parent, None, &shown)?, name.to_string()),
            None => (
                self.resolve(&p.parts, OFlag::O_PATH | OFlag::O_DIRECTORY, &shown)?,
                String::new(),
            ),
        };
        let fd = if name.is_empty() {
            dir.try_clone().map_err(|e| VolumeFileError::Sys {
                context: format!("dup {shown}"),
                source: Errno::from_raw(e.raw_os_error().unwrap_or(0)),
            })?
        } else {
            nix::fcntl::openat(
                &dir,
                name.as_str(),
                OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                Mode::empty(),
            )
            .map_err(not_found_or(&shown, "open"))?
        };
        let st = nix::sys::stat::fstat(&fd).map_err(sys(format!("stat {shown}")))?;
        if kind_of(&st) == EntryKind::Symlink && meta.mode.is_some() {
            return Err(VolumeFileError::WrongType(format!(
                "{shown} is a symlink: its mode cannot be set"
            )));
        }
        apply(&fd, meta, &shown)?;
        entry(dir.as_fd(), &name, shown)
    }

    /// Removes `path`: a file, symlink or other entry is unlinked (never followed), a
    /// directory with everything in it.
    pub fn remove(&self, path: &str) -> Result<()> {
        let p = VPath::parse(path)?;
        let shown = p.display();
        let (parent, name) = p.split_last().ok_or_else(|| {
            VolumeFileError::InvalidPath("the volume's root cannot be removed".into())
        })?;
        let dir = self.dir(parent, None, &shown)?;
        let st = stat_at(dir.as_fd(), name, &shown)?;
        remove_in(&dir, name, kind_of(&st) == EntryKind::Directory, &shown, 0)
    }
}

fn list_into(dir: OwnedFd, base: &str, depth: u32, out: &mut Vec<Entry>) -> Result<()> {
    let dup = dir.try_clone().map_err(|e| VolumeFileError::Sys {
        context: format!("dup {base}"),
        source: Errno::from_raw(e.raw_os_error().unwrap_or(0)),
    })?;
    let mut d = nix::dir::Dir::from_fd(dup).map_err(sys(format!("read {base}/")))?;
    let mut names = Vec::new();
    for e in d.iter() {
        let e = e.map_err(sys(format!("read {base}/")))?;
        let n = e.file_name().to_string_lossy().into_owned();
        if n != "." && n != ".." {
            names.push(n);
        }
    }
    names.sort();
    for n in names {
        if out.len() >= MAX_ENTRIES {
            return Err(VolumeFileError::InvalidArgument(format!(
                "more than {MAX_ENTRIES} entries: list a smaller depth"
            )));
        }
        let path = format!("{base}/{n}");
        let e = match entry(dir.as_fd(), &n, path.clone()) {
            Ok(e) => e,
            // Gone since it was read: a sandbox is changing the directory.
            Err(VolumeFileError::NotFound(_)) => continue,
            Err(e) => return Err(e),
        };
        let sub = e.kind == EntryKind::Directory && depth > 1;
        out.push(e);
        if sub {
            match nix::fcntl::openat(
                &dir,
                n.as_str(),
                OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                Mode::empty(),
            ) {
                Ok(fd) => list_into(fd, &path, depth - 1, out)?,
                Err(Errno::ENOENT | Errno::ENOTDIR | Errno::ELOOP) => {}
                Err(e) => return Err(sys(format!("open {path}"))(e)),
            }
        }
    }
    Ok(())
}

fn remove_in(parent: &OwnedFd, name: &str, is_dir: bool, shown: &str, level: u32) -> Result<()> {
    if !is_dir {
        return nix::unistd::unlinkat(parent, name, nix::unistd::UnlinkatFlags::NoRemoveDir)
            .map_err(not_found_or(shown, "unlink"));
    }
    if level > 256 {
        return Err(VolumeFileError::Conflict(format!(
            "{shown}: nested too deep"
        )));
    }
    // Opened without following: a directory swapped for a symlink is ELOOP, not a walk
    // through the symlink's target.
    let fd = nix::fcntl::openat(
        parent,
        name,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(not_found_or(shown, "open"))?;
    let dup = fd.try_clone().map_err(|e| VolumeFileError::Sys {
        context: format!("dup {shown}"),
        source: Errno::from_raw(e.raw_os_error().unwrap_or(0)),
    })?;
    let mut d = nix::dir::Dir::from_fd(dup).map_err(sys(format!("read {shown}")))?;
    let mut children = Vec::new();
    for e in d.iter() {
        let e = e.map_err(sys(format!("read {shown}")))?;
        let n = e.file_name().to_string_lossy().into_owned();
        if n != "." && n != ".." {
            children.push(n);
        }
    }
    for n in children {
        let child = format!("{shown}/{n}");
        let st = match stat_at(fd.as_fd(), &n, &child) {
            Ok(st) => st,
            Err(VolumeFileError::NotFound(_)) => continue,
            Err(e) => return Err(e),
        };
        match remove_in(
            &fd,
            &n,
            kind_of(&st) == EntryKind::Directory,
            &child,
            level + 1,
        ) {
            Ok(()) | Err(VolumeFileError::NotFound(_)) => {}
            Err(e) => return Err(e),
        }
    }
    nix::unistd::unlinkat(parent, name, nix::unistd::UnlinkatFlags::RemoveDir)
        .map_err(not_found_or(shown, "rmdir"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    fn tmp() -> (tempfile::TempDir, VolumeRoot) {
        let t = tempfile::tempdir().expect("tempdir");
        let r = VolumeRoot::open(t.path()).expect("open");
        (t, r)
    }

    #[test]
    fn symlinks_stay_inside() {
        let (t, r) = tmp();
        std::os::unix::fs::symlink("/etc/passwd", t.path().join("abs")).expect("symlink");
        std::os::unix::fs::symlink("../../../../../../etc/passwd", t.path().join("rel"))
            .expect("symlink");
        std::os::unix::fs::symlink("/etc", t.path().join("etc")).expect("symlink");
        for p in [
            "abs",
            "rel",
            "/../../etc/passwd",
            "etc/passwd",
            "../etc/hostname",
        ] {
            assert!(
                // `etc -> /etc` makes `/etc/passwd` a loop inside the volume: ELOOP.
                matches!(
                    r.open_read(p),
                    Err(VolumeFileError::NotFound(_) | VolumeFileError::Conflict(_))
                ),
                "{p}: {:?}",
                r.open_read(p).map(|f| f.1)
            );
        }
        // A write through a symlinked directory lands inside the volume, or nowhere.
        assert!(
            r.open_write("etc/x", &Meta::default(), false, 1000)
                .is_err()
        );
        assert!(!Path::new("/etc/x").exists());
        assert!(matches!(
            r.open_write("abs", &Meta::default(), false, 1000),
            Err(VolumeFileError::WrongType(_))
        ));
        let st = r.stat("abs").expect("stat");
        assert_eq!(st.kind, EntryKind::Symlink);
        assert_eq!(st.target.as_deref(), Some("/etc/passwd"));
        // Removing the symlinked directory removes the link only.
        r.remove("etc").expect("remove");
        assert!(Path::new("/etc/passwd").exists());
    }

    #[test]
    fn fifos_do_not_block() {
        let (t, r) = tmp();
        nix::unistd::mkfifo(&t.path().join("f"), Mode::from_bits_truncate(0o644)).expect("fifo");
        assert!(matches!(
            r.open_read("f"),
            Err(VolumeFileError::WrongType(_))
        ));
        assert!(matches!(
            r.open_write("f", &Meta::default(), false, 1000),
            Err(VolumeFileError::WrongType(_))
        ));
        assert!(matches!(
            r.open_read("/"),
            Err(VolumeFileError::WrongType(_))
        ));
        // A device node (here /dev/zero's numbers) is never read, whatever the mount.
        nix::sys::stat::mknod(
            &t.path().join("zero"),
            SFlag::S_IFCHR,
            Mode::from_bits_truncate(0o666),
            nix::sys::stat::makedev(1, 5),
        )
        .expect("mknod");
        assert!(matches!(
            r.open_read("zero"),
            Err(VolumeFileError::WrongType(_))
        ));
        assert!(matches!(
            r.open_write("zero", &Meta::default(), false, 1000),
            Err(VolumeFileError::WrongType(_))
        ));
        assert_eq!(r.stat("zero").expect("stat").kind, EntryKind::Other);
    }

    #[test]
    fn write_read_list_remove() {
        let (_t, r) = tmp();
        let m = Meta {
            uid: Some(1000),
            gid: Some(1000),
            mode: None,
        };
        let (mut f, created) = r.open_write("/a/b/c.txt", &m, true, 1000).expect("write");
        assert!(created);
        f.write_all(b"hello").expect("write");
        let e = r
            .finish_write(&f, "/a/b/c.txt", &Meta::default())
            .expect("finish");
        assert_eq!(
            (e.size, e.mode, e.uid, e.name.as_str()),
            (5, 0o644, 1000, "c.txt")
        );
        let (mut f, n) = r.open_read("a/b/c.txt").expect("read");
        let mut s = String::new();
        f.read_to_string(&mut s).expect("read");
        assert_eq!((s.as_str(), n), ("hello", 5));
        assert!(matches!(
            r.open_write("/x/y", &m, false, 1000),
            Err(VolumeFileError::NotFound(_))
        ));
        let l = r.list("/", 3).expect("list");
        let paths: Vec<_> = l.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(paths, ["/a", "/a/b", "/a/b/c.txt"]);
        assert_eq!(r.list("/a", 1).expect("list").len(), 1);
        let d = r
            .make_dir("/a/d", &Meta::default(), false, 1000)
            .expect("mkdir");
        assert_eq!((d.kind, d.mode), (EntryKind::Directory, 0o755));
        assert!(matches!(
            r.make_dir("/a/d", &Meta::default(), false, 1000),
            Err(VolumeFileError::Conflict(_))
        ));
        r.make_dir("/a/d", &Meta::default(), true, 1000)
            .expect("mkdir force");
        let e = r
            .set_meta(
                "/a/b/c.txt",
                &Meta {
                    uid: Some(0),
                    gid: Some(5),
                    mode: Some(0o600),
                },
            )
            .expect("meta");
        assert_eq!((e.uid, e.gid, e.mode), (0, 5, 0o600));
        assert!(
            r.set_meta(
                "/a",
                &Meta {
                    uid: Some(1 << 20),
                    ..Meta::default()
                }
            )
            .is_err()
        );
        assert!(
            r.set_meta(
                "/a",
                &Meta {
                    mode: Some(0o10000),
                    ..Meta::default()
                }
            )
            .is_err()
        );
        r.remove("/a").expect("remove");
        assert!(matches!(r.stat("/a"), Err(VolumeFileError::NotFound(_))));
        assert!(r.remove("/").is_err());
    }
}
