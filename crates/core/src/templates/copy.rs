//! Copying a directory tree into a template without trusting it: every step is relative to
//! an open directory and never follows a symlink, so a symlink (or one swapped in while the
//! copy runs) cannot lead the copy outside the source, and nothing is written outside the
//! destination. Symlinks are copied as symlinks, hard links stay linked, modes, owners
//! and times are kept; device nodes, FIFOs and sockets are skipped and counted, and other
//! filesystems mounted inside the source are not entered (like `cp -x`).

use super::BuildError;
use nix::dir::Dir;
use nix::fcntl::{AtFlags, OFlag, openat, readlinkat};
use nix::sys::stat::{
    FileStat, Mode, SFlag, UtimensatFlags, fchmod, fstat, fstatat, futimens, mkdirat, utimensat,
};
use nix::sys::time::TimeSpec;
use nix::unistd::{Gid, Uid, fchown, fchownat, linkat, symlinkat};
use std::collections::HashMap;
use std::ffi::OsStr;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// Deeper trees are refused: each level holds two open directories.
const MAX_DEPTH: usize = 256;
/// A progress line every this many entries...
const REPORT_EVERY_ENTRIES: u64 = 5000;
/// ...or this many bytes.
const REPORT_EVERY_BYTES: u64 = 256 << 20;
/// Skipped special files named one by one in the log before only the count goes on.
const NAMED_SKIPS: u64 = 20;

/// What a copy did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CopyStats {
    pub files: u64,
    pub dirs: u64,
    pub symlinks: u64,
    /// Files that are further names of a file already copied.
    pub hardlinks: u64,
    /// Device nodes, FIFOs and sockets, which a template does not get.
    pub skipped_special: u64,
    /// Directories on another filesystem, copied as empty directories.
    pub skipped_mounts: u64,
    pub bytes: u64,
}

impl CopyStats {
    fn entries(&self) -> u64 {
        self.files + self.dirs + self.symlinks + self.hardlinks
    }
}

/// Copies the tree at `src` to `dst` (which must not exist; its parent must). `log` gets
/// progress lines; `cancelled` is asked between entries.
pub fn copy_tree(
    src: &Path,
    dst: &Path,
    log: &mut dyn FnMut(String),
    cancelled: &dyn Fn() -> bool,
) -> Result<CopyStats, BuildError> {
    let dir_flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let cwd = nix::fcntl::AT_FDCWD;
    let src_fd = openat(cwd, src, dir_flags, Mode::empty()).map_err(io("open", src))?;
    let root_stat = fstat(&src_fd).map_err(io("stat", src))?;
    mkdirat(cwd, dst, Mode::from_bits_truncate(0o700)).map_err(io("create", dst))?;
    let dst_fd = openat(cwd, dst, dir_flags, Mode::empty()).map_err(io("open", dst))?;
    let mut copy = Copier {
        stats: CopyStats::default(),
        root_dev: root_stat.st_dev,
        dst_root: dst_fd
            .try_clone()
            .map_err(|e| BuildError::io("dup", dst, e))?,
        links: HashMap::new(),
        next_entries: REPORT_EVERY_ENTRIES,
        next_bytes: REPORT_EVERY_BYTES,
        log,
        cancelled,
        src_root: src.to_path_buf(),
    };
    copy.tree(src_fd, dst_fd, root_stat)?;
    let s = copy.stats;
    (copy.log)(format!(
        "copied {} files ({}), {} directories, {} symlinks, {} hard links; skipped {} device nodes/FIFOs/sockets and {} other filesystems",
        s.files,
        human(s.bytes),
        s.dirs + 1,
        s.symlinks,
        s.hardlinks,
        s.skipped_special,
        s.skipped_mounts
    ));
    Ok(s)
}

struct Copier<'a> {
    stats: CopyStats,
    root_dev: u64,
    dst_root: OwnedFd,
    /// (device, inode) of multiply linked files copied so far, and where their copy is.
    links: HashMap<(u64, u64), PathBuf>,
    next_entries: u64,
    next_bytes: u64,
    log: &'a mut dyn FnMut(String),
    cancelled: &'a dyn Fn() -> bool,
    src_root: PathBuf,
}

fn io<'a>(op: &'static str, path: &'a Path) -> impl Fn(nix::Error) -> BuildError + 'a {
    move |e| BuildError::io(op, path, e.into())
}

/// Bytes for people.
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

impl Copier<'_> {
    fn progress(&mut self) {
        let s = self.stats;
        if s.entries() >= self.next_entries || s.bytes >= self.next_bytes {
            (self.log)(format!(
                "copied {} entries ({})",
                s.entries(),
                human(s.bytes)
            ));
            self.next_entries = s.entries() + REPORT_EVERY_ENTRIES;
            self.next_bytes = s.bytes + REPORT_EVERY_BYTES;
        }
    }

    /// Owner, mode and times of `st` onto the open `fd` (owner first: chown clears setuid).
    fn attrs(&self, fd: &OwnedFd, st: &FileStat, path: &Path) -> Result<(), BuildError> {
        fchown(
            fd,
            Some(Uid::from_raw(st.st_uid)),
            Some(Gid::from_raw(st.st_gid)),
        )
        .map_err(io("chown", path))?;
        fchmod(fd, Mode::from_bits_truncate(st.st_mode & 0o7777)).map_err(io("chmod", path))?;
        futimens(fd, &atime(st), &mtime(st)).map_err(io("set times of", path))?;
        Ok(())
    }

    /// The sorted names in an open directory.
    fn list(&self, src: &OwnedFd, rel: &Path) -> Result<Vec<Vec<u8>>, BuildError> {
        let shown = self.src_root.join(rel);
        let listing = src
            .try_clone()
            .map_err(|e| BuildError::io("dup", &shown, e))?;
        let mut entries = Dir::from_fd(listing).map_err(io("list", &shown))?;
        let mut names: Vec<Vec<u8>> = Vec::new();
        for entry in entries.iter() {
            let entry = entry.map_err(io("list", &shown))?;
            let name = entry.file_name().to_bytes();
            if name != b"." && name != b".." {
                names.push(name.to_vec());
            }
        }
        names.sort();
        Ok(names)
    }

    /// Copies the tree below `src` into `dst` with an explicit stack of open directories
    /// (a deep tree must not exhaust a thread's stack), then gives `dst` the attributes
    /// of `root`.
    fn tree(&mut self, src: OwnedFd, dst: OwnedFd, root: FileStat) -> Result<(), BuildError> {
        let names = self.list(&src, Path::new(""))?;
        let mut stack = vec![Frame {
            names: names.into_iter(),
            src,
            dst,
            rel: PathBuf::new(),
            st: root,
        }];
        while let Some(top) = stack.last_mut() {
            let Some(name) = top.names.next() else {
                if let Some(done) = stack.pop() {
                    self.attrs(&done.dst, &done.st, &done.rel)?;
                }
                continue;
            };
            if (self.cancelled)() {
                return Err(BuildError::Cancelled);
            }
            let name = OsStr::from_bytes(&name);
            let rel = top.rel.join(name);
            if let Some(sub) = self.entry(&top.src, &top.dst, name, &rel)? {
                if stack.len() >= MAX_DEPTH {
                    return Err(BuildError::Failed(format!(
                        "{}: the tree is deeper than {MAX_DEPTH} levels",
                        self.src_root.join(&rel).display()
                    )));
                }
                let names = self.list(&sub.0, &rel)?;
                stack.push(Frame {
                    names: names.into_iter(),
                    src: sub.0,
                    dst: sub.1,
                    rel,
                    st: sub.2,
                });
            }
            self.progress();
        }
        Ok(())
    }

    /// Copies one entry; a directory to descend into comes back open (source,
    /// destination, its attributes), to be filled and finished by the caller.
    fn entry(
        &mut self,
        src: &OwnedFd,
        dst: &OwnedFd,
        name: &OsStr,
        rel: &Path,
    ) -> Result<Option<(OwnedFd, OwnedFd, FileStat)>, BuildError> {
        let shown = self.src_root.join(rel);
        let st = fstatat(src, name, AtFlags::AT_SYMLINK_NOFOLLOW).map_err(io("stat", &shown))?;
        let kind = SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits());
        if kind == SFlag::S_IFDIR {
            mkdirat(dst, name, Mode::from_bits_truncate(0o700)).map_err(io("create", rel))?;
            let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
            let d = openat(dst, name, flags, Mode::empty()).map_err(io("open", rel))?;
            self.stats.dirs += 1;
            if st.st_dev != self.root_dev {
                self.stats.skipped_mounts += 1;
                (self.log)(format!(
                    "not entering {}: another filesystem is mounted there",
                    shown.display()
                ));
                self.attrs(&d, &st, rel)?;
                return Ok(None);
            }
            let s = openat(src, name, flags, Mode::empty()).map_err(io("open", &shown))?;
            same_file(&s, &st, &shown)?;
            return Ok(Some((s, d, st)));
        } else if kind == SFlag::S_IFREG {
            if st.st_nlink > 1
                && let Some(first) = self.links.get(&(st.st_dev, st.st_ino))
            {
                linkat(&self.dst_root, first.as_path(), dst, name, AtFlags::empty())
                    .map_err(io("link", rel))?;
                self.stats.hardlinks += 1;
                return Ok(None);
            }
            let flags = OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC;
            let s = openat(src, name, flags, Mode::empty()).map_err(io("open", &shown))?;
            same_file(&s, &st, &shown)?;
            let flags = OFlag::O_WRONLY
                | OFlag::O_CREAT
                | OFlag::O_EXCL
                | OFlag::O_NOFOLLOW
                | OFlag::O_CLOEXEC;
            let d = openat(dst, name, flags, Mode::from_bits_truncate(0o600))
                .map_err(io("create", rel))?;
            let mut from = std::fs::File::from(s);
            let mut to = std::fs::File::from(d);
            let n =
                std::io::copy(&mut from, &mut to).map_err(|e| BuildError::io("copy", &shown, e))?;
            let d = OwnedFd::from(to);
            self.attrs(&d, &st, rel)?;
            self.stats.files += 1;
            self.stats.bytes += n;
            if st.st_nlink > 1 {
                self.links.insert((st.st_dev, st.st_ino), rel.to_path_buf());
            }
        } else if kind == SFlag::S_IFLNK {
            let target = readlinkat(src, name).map_err(io("read link", &shown))?;
            symlinkat(target.as_os_str(), dst, name).map_err(io("create link", rel))?;
            fchownat(
                dst,
                name,
                Some(Uid::from_raw(st.st_uid)),
                Some(Gid::from_raw(st.st_gid)),
                AtFlags::AT_SYMLINK_NOFOLLOW,
            )
            .map_err(io("chown", rel))?;
            utimensat(
                dst,
                name,
                &atime(&st),
                &mtime(&st),
                UtimensatFlags::NoFollowSymlink,
            )
            .map_err(io("set times of", rel))?;
            self.stats.symlinks += 1;
        } else {
            self.stats.skipped_special += 1;
            if self.stats.skipped_special <= NAMED_SKIPS {
                (self.log)(format!(
                    "skipped {} (device nodes, FIFOs and sockets are not copied)",
                    shown.display()
                ));
            }
        }
        Ok(None)
    }
}

/// A directory being copied: what is left to copy in it, and its attributes, which are
/// set once it is full (a read-only mode would stop the copy into it).
struct Frame {
    names: std::vec::IntoIter<Vec<u8>>,
    src: OwnedFd,
    dst: OwnedFd,
    rel: PathBuf,
    st: FileStat,
}

/// The entry opened is the one stat'ed: a swap between the two is refused.
fn same_file(fd: &impl AsFd, st: &FileStat, path: &Path) -> Result<(), BuildError> {
    let now = fstat(fd).map_err(io("stat", path))?;
    if now.st_dev != st.st_dev || now.st_ino != st.st_ino {
        return Err(BuildError::Failed(format!(
            "{} changed while it was copied",
            path.display()
        )));
    }
    Ok(())
}

fn atime(st: &FileStat) -> TimeSpec {
    TimeSpec::new(st.st_atime, st.st_atime_nsec)
}

fn mtime(st: &FileStat) -> TimeSpec {
    TimeSpec::new(st.st_mtime, st.st_mtime_nsec)
}

/// Bytes a tree takes (files counted once however many names they have), never
/// following symlinks or entering other filesystems.
pub fn tree_size(root: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(top) = std::fs::symlink_metadata(root) else {
        return 0;
    };
    let mut seen = std::collections::HashSet::new();
    let mut total = 0u64;
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in rd.flatten() {
            let Ok(m) = e.metadata() else { continue };
            if m.is_dir() {
                if m.dev() == top.dev() {
                    stack.push(e.path());
                }
            } else if m.is_file() && (m.nlink() == 1 || seen.insert((m.dev(), m.ino()))) {
                total += m.len();
            }
        }
    }
    total
}

/// Makes `inside` (an absolute path in the tree at `root`) a directory owned by
/// `uid`/`gid` where it is missing, without following any symlink of the tree; a
/// component that is a symlink or a file stops it (`false`).
pub fn ensure_dir(root: &Path, inside: &str, uid: u32, gid: u32) -> Result<bool, BuildError> {
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let mut fd =
        openat(nix::fcntl::AT_FDCWD, root, flags, Mode::empty()).map_err(io("open", root))?;
    for part in inside.split('/').filter(|p| !p.is_empty() && *p != ".") {
        let name = OsStr::new(part);
        match mkdirat(&fd, name, Mode::from_bits_truncate(0o755)) {
            Ok(()) => {
                let next = openat(&fd, name, flags, Mode::empty()).map_err(io("open", root))?;
                fchown(&next, Some(Uid::from_raw(uid)), Some(Gid::from_raw(gid)))
                    .map_err(io("chown", root))?;
                fd = next;
            }
            Err(nix::errno::Errno::EEXIST) => match openat(&fd, name, flags, Mode::empty()) {
                Ok(next) => fd = next,
                // ELOOP / ENOTDIR: a symlink or a file is in the way.
                Err(_) => return Ok(false),
            },
            Err(e) => return Err(BuildError::io("create", &root.join(part), e.into())),
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    fn copy(src: &Path, dst: &Path) -> (CopyStats, Vec<String>) {
        let mut lines = Vec::new();
        let stats = copy_tree(src, dst, &mut |l| lines.push(l), &|| false).unwrap();
        (stats, lines)
    }

    #[test]
    fn symlinks_stay_links_specials_are_skipped_and_attributes_kept() {
        let t = tempfile::tempdir().unwrap();
        let src = t.path().join("src");
        std::fs::create_dir_all(src.join("usr/bin")).unwrap();
        std::fs::write(src.join("usr/bin/tool"), b"#!/bin/sh\necho hi\n").unwrap();
        // chown clears the setuid bit, so the mode comes after it (as in the copy).
        std::os::unix::fs::chown(src.join("usr/bin/tool"), Some(1000), Some(1001)).unwrap();
        std::fs::set_permissions(
            src.join("usr/bin/tool"),
            std::fs::Permissions::from_mode(0o4755),
        )
        .unwrap();
        std::fs::hard_link(src.join("usr/bin/tool"), src.join("usr/bin/tool2")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", src.join("leak")).unwrap();
        std::os::unix::fs::symlink("../../etc/shadow", src.join("usr/bin/up")).unwrap();
        nix::unistd::mkfifo(&src.join("fifo"), Mode::from_bits_truncate(0o600)).unwrap();
        let dst = t.path().join("dst");
        let (stats, lines) = copy(&src, &dst);
        assert_eq!(stats.files, 1, "{stats:?}");
        assert_eq!(stats.hardlinks, 1);
        assert_eq!(stats.symlinks, 2);
        assert_eq!(stats.skipped_special, 1);
        assert!(lines.iter().any(|l| l.contains("fifo")), "{lines:?}");
        let leak = std::fs::symlink_metadata(dst.join("leak")).unwrap();
        assert!(leak.file_type().is_symlink());
        assert_eq!(
            std::fs::read_link(dst.join("leak")).unwrap(),
            Path::new("/etc/passwd")
        );
        let tool = std::fs::metadata(dst.join("usr/bin/tool")).unwrap();
        assert_eq!(tool.mode() & 0o7777, 0o4755);
        assert_eq!((tool.uid(), tool.gid()), (1000, 1001));
        assert_eq!(
            tool.ino(),
            std::fs::metadata(dst.join("usr/bin/tool2")).unwrap().ino()
        );
        assert_eq!(
            std::fs::read(dst.join("usr/bin/tool")).unwrap(),
            b"#!/bin/sh\necho hi\n"
        );
        assert!(!dst.join("fifo").exists());
        assert_eq!(tree_size(&dst), 18);
    }

    #[test]
    fn a_symlinked_source_and_an_existing_destination_are_refused() {
        let t = tempfile::tempdir().unwrap();
        let real = t.path().join("real");
        std::fs::create_dir(&real).unwrap();
        std::os::unix::fs::symlink(&real, t.path().join("link")).unwrap();
        let err = copy_tree(
            &t.path().join("link"),
            &t.path().join("d"),
            &mut |_| {},
            &|| false,
        )
        .unwrap_err();
        assert!(err.to_string().contains("open"), "{err}");
        let err = copy_tree(&real, &real, &mut |_| {}, &|| false).unwrap_err();
        assert!(err.to_string().contains("create"), "{err}");
        let err = copy_tree(&real, &t.path().join("c"), &mut |_| {}, &|| true);
        // An empty tree has nothing to cancel between; a tree with entries stops.
        assert!(err.is_ok());
        std::fs::write(real.join("f"), "x").unwrap();
        let err = copy_tree(&real, &t.path().join("e"), &mut |_| {}, &|| true).unwrap_err();
        assert!(matches!(err, BuildError::Cancelled), "{err}");
    }

    #[test]
    fn a_tree_too_deep_is_refused_without_exhausting_the_stack() {
        let t = tempfile::tempdir().unwrap();
        let mut p = t.path().join("src");
        for _ in 0..(MAX_DEPTH + 20) {
            p = p.join("d");
        }
        std::fs::create_dir_all(&p).unwrap();
        let err = copy_tree(
            &t.path().join("src"),
            &t.path().join("dst"),
            &mut |_| {},
            &|| false,
        )
        .unwrap_err();
        assert!(err.to_string().contains("deeper than"), "{err}");
        // One level less than the limit copies.
        let mut p = t.path().join("ok");
        for _ in 0..(MAX_DEPTH - 1) {
            p = p.join("d");
        }
        std::fs::create_dir_all(&p).unwrap();
        std::fs::write(p.join("f"), "deep").unwrap();
        let s = copy_tree(
            &t.path().join("ok"),
            &t.path().join("ok2"),
            &mut |_| {},
            &|| false,
        )
        .unwrap();
        assert_eq!((s.dirs, s.files), (MAX_DEPTH as u64 - 1, 1));
        let mut q = t.path().join("ok2");
        for _ in 0..(MAX_DEPTH - 1) {
            q = q.join("d");
        }
        assert_eq!(std::fs::read(q.join("f")).unwrap(), b"deep");
    }

    #[test]
    fn read_only_directories_are_filled_before_their_mode_is_set() {
        use std::os::unix::fs::PermissionsExt;
        let t = tempfile::tempdir().unwrap();
        let src = t.path().join("src");
        std::fs::create_dir_all(src.join("ro/sub")).unwrap();
        std::fs::write(src.join("ro/sub/f"), "x").unwrap();
        std::fs::set_permissions(src.join("ro/sub"), std::fs::Permissions::from_mode(0o555))
            .unwrap();
        std::fs::set_permissions(src.join("ro"), std::fs::Permissions::from_mode(0o500)).unwrap();
        let dst = t.path().join("dst");
        copy_tree(&src, &dst, &mut |_| {}, &|| false).unwrap();
        assert_eq!(std::fs::read(dst.join("ro/sub/f")).unwrap(), b"x");
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode(&dst.join("ro")), 0o500);
        assert_eq!(mode(&dst.join("ro/sub")), 0o555);
    }

    #[test]
    fn ensure_dir_creates_missing_parts_but_never_through_a_symlink() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("root");
        let outside = t.path().join("outside");
        std::fs::create_dir_all(&root).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        assert!(ensure_dir(&root, "/srv/app", 1000, 1000).unwrap());
        let m = std::fs::metadata(root.join("srv/app")).unwrap();
        assert!(m.is_dir());
        assert_eq!(m.uid(), 1000);
        std::os::unix::fs::symlink(&outside, root.join("escape")).unwrap();
        assert!(!ensure_dir(&root, "/escape/x", 0, 0).unwrap());
        assert!(!outside.join("x").exists());
    }
}
