//! Filesystem operations relative to one trusted root directory, on names that are not
//! trusted: every lookup goes through `openat2` with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
//! RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV`, and the last component is touched only by `*at`
//! calls that do not follow it. Paths are relative and normalized (no `.`/`..`, no empty
//! components); the empty path is the root itself.

use std::ffi::OsStr;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::{
    AtFlags, Dev, FileType, Gid, Mode, OFlags, ResolveFlags, Stat, Timespec, Timestamps, Uid,
    XattrFlags,
};
use rustix::io::Errno;

use crate::error::ImageError;

/// The xattr overlayfs reads to know that a directory hides everything below it.
pub(crate) const OPAQUE_XATTR: &str = "trusted.overlay.opaque";
/// Longest path the kernel accepts, without its NUL.
pub(crate) const PATH_MAX: usize = 4095;
/// Longest single name the kernel accepts.
pub(crate) const NAME_MAX: usize = 255;

const RESOLVE: ResolveFlags = ResolveFlags::BENEATH
    .union(ResolveFlags::NO_SYMLINKS)
    .union(ResolveFlags::NO_MAGICLINKS)
    .union(ResolveFlags::NO_XDEV);

pub(crate) type R<T> = Result<T, ImageError>;

/// A directory every operation stays beneath.
pub(crate) struct Root {
    fd: OwnedFd,
}

/// What a `lstat` said about one entry, reduced to what layers care about.
#[derive(Debug, Clone)]
pub(crate) struct Node {
    pub kind: NodeKind,
    /// Permission bits including setuid, setgid and sticky.
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub mtime: i64,
    pub ino: u64,
    pub nlink: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NodeKind {
    Dir,
    File,
    Symlink,
    Whiteout,
    /// Sockets, fifos and real device nodes: never captured, never extracted.
    Special(&'static str),
}

impl Node {
    pub(crate) fn from_stat(st: &Stat) -> Node {
        let ft = FileType::from_raw_mode(st.st_mode);
        let kind = match ft {
            FileType::Directory => NodeKind::Dir,
            FileType::RegularFile => NodeKind::File,
            FileType::Symlink => NodeKind::Symlink,
            FileType::CharacterDevice if st.st_rdev == 0 => NodeKind::Whiteout,
            FileType::CharacterDevice => NodeKind::Special("character device"),
            FileType::BlockDevice => NodeKind::Special("block device"),
            FileType::Fifo => NodeKind::Special("fifo"),
            FileType::Socket => NodeKind::Special("socket"),
            FileType::Unknown => NodeKind::Special("unknown file type"),
        };
        Node {
            kind,
            mode: st.st_mode & 0o7777,
            uid: st.st_uid,
            gid: st.st_gid,
            mtime: st.st_mtime,
            ino: st.st_ino,
            nlink: st.st_nlink,
        }
    }
}

/// Maps the errors that mean "this path goes through a symlink, a non-directory or a mount"
/// to the typed refusal; everything else stays an I/O error.
pub(crate) fn classify(op: &'static str, rel: &Path, e: Errno) -> ImageError {
    if e == Errno::LOOP || e == Errno::XDEV || e == Errno::NOTDIR {
        ImageError::ThroughSymlink { path: show(rel) }
    } else {
        ImageError::io(op, show(rel), e)
    }
}

pub(crate) fn show(rel: &Path) -> String {
    rel.to_string_lossy().into_owned()
}

/// Splits a normalized relative path into its parent and last name.
pub(crate) fn split(rel: &Path) -> (&Path, &OsStr) {
    let parent = rel.parent().unwrap_or(Path::new(""));
    let name = rel.file_name().unwrap_or(OsStr::new(""));
    (parent, name)
}

fn dot(rel: &Path) -> &Path {
    if rel.as_os_str().is_empty() {
        Path::new(".")
    } else {
        rel
    }
}

pub(crate) fn ts(secs: i64) -> Timestamps {
    let t = Timespec {
        tv_sec: secs,
        tv_nsec: 0,
    };
    Timestamps {
        last_access: t,
        last_modification: t,
    }
}

pub(crate) fn uid(id: u32) -> Option<Uid> {
    // u32::MAX means "leave unchanged" to the kernel; ids here are never that.
    (id != u32::MAX).then(|| Uid::from_raw(id))
}

pub(crate) fn gid(id: u32) -> Option<Gid> {
    (id != u32::MAX).then(|| Gid::from_raw(id))
}

impl Root {
    /// Opens a directory the caller trusts (its own data directory) as a root.
    pub(crate) fn open(path: &Path) -> R<Root> {
        let fd = rustix::fs::open(
            path,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| ImageError::io("open directory", path.display().to_string(), e))?;
        Ok(Root { fd })
    }

    fn openat2(&self, rel: &Path, flags: OFlags) -> Result<OwnedFd, Errno> {
        rustix::fs::openat2(
            &self.fd,
            dot(rel),
            flags | OFlags::CLOEXEC | OFlags::NOFOLLOW,
            Mode::empty(),
            RESOLVE,
        )
    }

    /// Opens a directory beneath the root for reading (listing, xattrs, fchmod).
    pub(crate) fn open_dir(&self, rel: &Path) -> R<OwnedFd> {
        self.openat2(rel, OFlags::RDONLY | OFlags::DIRECTORY)
            .map_err(|e| classify("open directory", rel, e))
    }

    /// Opens a directory beneath the root as a handle for `*at` calls; `None` if it is absent.
    pub(crate) fn try_open_path(&self, rel: &Path) -> R<Option<OwnedFd>> {
        match self.openat2(rel, OFlags::PATH | OFlags::DIRECTORY) {
            Ok(fd) => Ok(Some(fd)),
            Err(Errno::NOENT) => Ok(None),
            Err(e) => Err(classify("open directory", rel, e)),
        }
    }

    /// Opens a regular file beneath the root for reading. `O_NONBLOCK` so that a fifo swapped
    /// in since the last `lstat` cannot block; the type is checked on the opened file.
    pub(crate) fn open_file(&self, rel: &Path) -> R<(File, Stat)> {
        let fd = self
            .openat2(rel, OFlags::RDONLY | OFlags::NONBLOCK | OFlags::NOCTTY)
            .map_err(|e| classify("open file", rel, e))?;
        let st = rustix::fs::fstat(&fd).map_err(|e| ImageError::io("stat", show(rel), e))?;
        if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
            return Err(ImageError::Changed { path: show(rel) });
        }
        Ok((File::from(fd), st))
    }

    /// `lstat` of a path beneath the root; `None` when it (or a parent) does not exist.
    pub(crate) fn lstat(&self, rel: &Path) -> R<Option<Node>> {
        let (parent, name) = split(rel);
        let Some(pfd) = self.try_open_path(parent)? else {
            return Ok(None);
        };
        if name.is_empty() {
            let st = rustix::fs::fstat(&pfd).map_err(|e| ImageError::io("stat", show(rel), e))?;
            return Ok(Some(Node::from_stat(&st)));
        }
        statat(&pfd, name, rel)
    }

    /// The parent directory of `rel` as a handle, plus the last name. Fails if the parent is
    /// missing or reached through a symlink.
    pub(crate) fn parent<'a>(&self, rel: &'a Path) -> R<(OwnedFd, &'a OsStr)> {
        let (parent, name) = split(rel);
        match self.try_open_path(parent)? {
            Some(fd) => Ok((fd, name)),
            None => Err(ImageError::io(
                "open directory",
                show(parent),
                io::Error::from(io::ErrorKind::NotFound),
            )),
        }
    }

    /// Like [`Root::parent`], creating missing parent directories (mode 0755, owner 0:0) the
    /// way tar does for members whose parents were not in the archive.
    pub(crate) fn parent_create<'a>(
        &self,
        rel: &'a Path,
        created: &mut dyn FnMut(&Path),
    ) -> R<(OwnedFd, &'a OsStr)> {
        let (parent, name) = split(rel);
        if let Some(fd) = self.try_open_path(parent)? {
            return Ok((fd, name));
        }
        let mut cur = self
            .openat2(Path::new(""), OFlags::PATH | OFlags::DIRECTORY)
            .map_err(|e| classify("open directory", parent, e))?;
        let mut sofar = PathBuf::new();
        for comp in parent.components() {
            let c = comp.as_os_str();
            sofar.push(c);
            let step = |cur: &OwnedFd| {
                rustix::fs::openat2(
                    cur,
                    c,
                    OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC | OFlags::NOFOLLOW,
                    Mode::empty(),
                    RESOLVE,
                )
            };
            cur = match step(&cur) {
                Ok(fd) => fd,
                Err(Errno::NOENT) => {
                    rustix::fs::mkdirat(&cur, c, Mode::from_raw_mode(0o755))
                        .map_err(|e| classify("mkdir", &sofar, e))?;
                    rustix::fs::chownat(&cur, c, uid(0), gid(0), AtFlags::SYMLINK_NOFOLLOW)
                        .map_err(|e| classify("chown", &sofar, e))?;
                    created(&sofar);
                    step(&cur).map_err(|e| classify("open directory", &sofar, e))?
                }
                Err(e) => return Err(classify("open directory", &sofar, e)),
            };
        }
        Ok((cur, name))
    }

    /// Removes whatever is at `rel` (a whole tree for a directory) without following any
    /// symlink; absent is fine. Iterative, so a deep tree cannot exhaust the stack, and it
    /// holds one directory handle at a time.
    pub(crate) fn remove_all(&self, rel: &Path) -> R<()> {
        let (parent, name) = split(rel);
        if name.is_empty() {
            return self.remove_children(rel);
        }
        let Some(pfd) = self.try_open_path(parent)? else {
            return Ok(());
        };
        match rustix::fs::unlinkat(&pfd, name, AtFlags::empty()) {
            Ok(()) | Err(Errno::NOENT) => return Ok(()),
            Err(Errno::ISDIR) => {}
            Err(e) => return Err(classify("unlink", rel, e)),
        }
        drop(pfd);
        self.remove_children(rel)?;
        let pfd = self.parent(rel)?.0;
        rustix::fs::unlinkat(&pfd, name, AtFlags::REMOVEDIR).map_err(|e| classify("rmdir", rel, e))
    }

    /// Empties the directory at `rel`, keeping the directory itself.
    pub(crate) fn remove_children(&self, rel: &Path) -> R<()> {
        self.remove_children_except(rel, &mut |_| false)
    }

    /// Empties the directory at `rel` except the paths `keep` names; the directories it keeps
    /// are filtered the same way, all the way down.
    pub(crate) fn remove_children_except(
        &self,
        rel: &Path,
        keep: &mut dyn FnMut(&Path) -> bool,
    ) -> R<()> {
        // Post-order without recursion: a directory is listed, its non-directories removed,
        // its subdirectories queued; once it is revisited with all of them gone, it goes too.
        let mut stack: Vec<(PathBuf, bool)> = vec![(rel.to_path_buf(), false)];
        while let Some((dir, listed)) = stack.pop() {
            if listed {
                if dir.as_path() != rel && !keep(&dir) {
                    let (pfd, name) = self.parent(&dir)?;
                    rustix::fs::unlinkat(&pfd, name, AtFlags::REMOVEDIR)
                        .map_err(|e| classify("rmdir", &dir, e))?;
                }
                continue;
            }
            stack.push((dir.clone(), true));
            let fd = self.open_dir(&dir)?;
            for name in list_dir(&fd, &dir)? {
                let child = dir.join(&name);
                if keep(&child) {
                    if let Some(n) = statat(&fd, &name, &child)?
                        && n.kind == NodeKind::Dir
                    {
                        stack.push((child, false));
                    }
                    continue;
                }
                match rustix::fs::unlinkat(&fd, &name, AtFlags::empty()) {
                    Ok(()) | Err(Errno::NOENT) => {}
                    Err(Errno::ISDIR) => stack.push((child, false)),
                    Err(e) => return Err(classify("unlink", &child, e)),
                }
            }
        }
        Ok(())
    }
}

/// `lstat` of one name in a directory handle; `None` when absent.
pub(crate) fn statat(dir: &OwnedFd, name: &OsStr, rel: &Path) -> R<Option<Node>> {
    match rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(st) => Ok(Some(Node::from_stat(&st))),
        Err(Errno::NOENT) => Ok(None),
        Err(e) => Err(classify("stat", rel, e)),
    }
}

/// The names in a directory, sorted, without `.` and `..`.
pub(crate) fn list_dir(fd: &OwnedFd, rel: &Path) -> R<Vec<std::ffi::OsString>> {
    let mut dir = rustix::fs::Dir::read_from(fd)
        .map_err(|e| ImageError::io("read directory", show(rel), e))?;
    let mut names = Vec::new();
    while let Some(ent) = dir.read() {
        let ent = ent.map_err(|e| ImageError::io("read directory", show(rel), e))?;
        let n = ent.file_name().to_bytes();
        if n == b"." || n == b".." {
            continue;
        }
        names.push(OsStr::from_bytes(n).to_os_string());
    }
    names.sort();
    Ok(names)
}

/// Whether an open directory carries the overlayfs opaque mark.
pub(crate) fn is_opaque(fd: &OwnedFd, rel: &Path) -> R<bool> {
    let mut buf = [0u8; 8];
    match rustix::fs::fgetxattr(fd, OPAQUE_XATTR, &mut buf[..]) {
        Ok(n) => Ok(&buf[..n] == b"y"),
        Err(Errno::NODATA) | Err(Errno::NOTSUP) | Err(Errno::RANGE) => Ok(false),
        Err(e) => Err(ImageError::io("read xattr", show(rel), e)),
    }
}

pub(crate) fn set_opaque(fd: &OwnedFd, rel: &Path) -> R<()> {
    rustix::fs::fsetxattr(fd, OPAQUE_XATTR, b"y", XattrFlags::empty())
        .map_err(|e| ImageError::io("set opaque xattr", show(rel), e))
}

/// Sets owner, then mode (chown clears setuid), on an open file or directory.
pub(crate) fn own_and_mode(fd: impl AsFd, rel: &Path, u: u32, g: u32, mode: u32) -> R<()> {
    rustix::fs::fchown(&fd, uid(u), gid(g)).map_err(|e| ImageError::io("chown", show(rel), e))?;
    rustix::fs::fchmod(&fd, Mode::from_raw_mode(mode & 0o7777))
        .map_err(|e| ImageError::io("chmod", show(rel), e))
}

/// Creates an empty regular file (exclusive, never through a symlink), mode 0600 until the
/// caller has written it.
pub(crate) fn create_file(pfd: &OwnedFd, name: &OsStr, rel: &Path) -> R<File> {
    let fd = rustix::fs::openat(
        pfd,
        name,
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )
    .map_err(|e| classify("create", rel, e))?;
    Ok(File::from(fd))
}

/// Makes a directory and returns it open for fchown/fchmod/xattrs.
pub(crate) fn make_dir(pfd: &OwnedFd, name: &OsStr, rel: &Path) -> R<OwnedFd> {
    rustix::fs::mkdirat(pfd, name, Mode::from_raw_mode(0o700))
        .map_err(|e| classify("mkdir", rel, e))?;
    open_child_dir(pfd, name, rel)
}

pub(crate) fn open_child_dir(pfd: &OwnedFd, name: &OsStr, rel: &Path) -> R<OwnedFd> {
    rustix::fs::openat2(
        pfd,
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
        RESOLVE,
    )
    .map_err(|e| classify("open directory", rel, e))
}

/// Creates a symlink (its target is data, never resolved) owned by `u:g`.
pub(crate) fn make_symlink(
    pfd: &OwnedFd,
    name: &OsStr,
    target: &OsStr,
    rel: &Path,
    u: u32,
    g: u32,
    mtime: i64,
) -> R<()> {
    rustix::fs::symlinkat(target, pfd, name).map_err(|e| classify("symlink", rel, e))?;
    rustix::fs::chownat(pfd, name, uid(u), gid(g), AtFlags::SYMLINK_NOFOLLOW)
        .map_err(|e| classify("chown", rel, e))?;
    set_mtime_at(pfd, name, rel, mtime)
}

/// Creates an overlayfs whiteout: a 0:0 character device owned by root.
pub(crate) fn make_whiteout(pfd: &OwnedFd, name: &OsStr, rel: &Path) -> R<()> {
    rustix::fs::mknodat(
        pfd,
        name,
        FileType::CharacterDevice,
        Mode::empty(),
        Dev::default(),
    )
    .map_err(|e| classify("mknod whiteout", rel, e))?;
    rustix::fs::chownat(pfd, name, uid(0), gid(0), AtFlags::SYMLINK_NOFOLLOW)
        .map_err(|e| classify("chown", rel, e))
}

pub(crate) fn set_mtime_at(pfd: &OwnedFd, name: &OsStr, rel: &Path, mtime: i64) -> R<()> {
    rustix::fs::utimensat(pfd, name, &ts(mtime), AtFlags::SYMLINK_NOFOLLOW)
        .map_err(|e| classify("set times", rel, e))
}

pub(crate) fn set_mtime_fd(fd: impl AsFd, rel: &Path, mtime: i64) -> R<()> {
    rustix::fs::futimens(&fd, &ts(mtime)).map_err(|e| ImageError::io("set times", show(rel), e))
}

/// Reads a symlink's target without following it.
pub(crate) fn read_link(pfd: &OwnedFd, name: &OsStr, rel: &Path) -> R<std::ffi::OsString> {
    let t =
        rustix::fs::readlinkat(pfd, name, Vec::new()).map_err(|e| classify("readlink", rel, e))?;
    Ok(OsStr::from_bytes(t.as_bytes()).to_os_string())
}

/// Hardlinks `from` to `to`, both beneath the root; never follows a symlink at `from`.
pub(crate) fn link(root: &Root, from: &Path, to: &Path) -> R<()> {
    let (fpfd, fname) = root.parent(from)?;
    let (tpfd, tname) = root.parent(to)?;
    rustix::fs::linkat(&fpfd, fname, &tpfd, tname, AtFlags::empty())
        .map_err(|e| classify("link", to, e))
}

/// An empty directory we may fill, created when absent. Returns whether it was created.
pub(crate) fn prepare_empty_dir(dir: &Path) -> R<bool> {
    match std::fs::create_dir(dir) {
        Ok(()) => {
            // Whatever the daemon's umask: a layer or rootfs root is 0755, as `/` is.
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))
                .map_err(|e| ImageError::io("chmod", dir.display().to_string(), e))?;
            return Ok(true);
        }
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => {
            return Err(ImageError::io(
                "create directory",
                dir.display().to_string(),
                e,
            ));
        }
    }
    let root = Root::open(dir)?;
    let fd = root.open_dir(Path::new(""))?;
    if !list_dir(&fd, Path::new(""))?.is_empty() {
        return Err(ImageError::NotEmpty {
            path: dir.display().to_string(),
        });
    }
    Ok(false)
}

/// Undoes a failed fill of `dir`: its contents go, and the directory too if we made it.
pub(crate) fn discard(dir: &Path, created: bool) {
    let res = Root::open(dir).and_then(|r| r.remove_children(Path::new("")));
    if let Err(e) = res {
        tracing::warn!(dir = %dir.display(), error = %e, "could not clean up after a failed unpack");
    } else if created && let Err(e) = std::fs::remove_dir(dir) {
        tracing::warn!(dir = %dir.display(), error = %e, "could not remove a directory after a failed unpack");
    }
}
