//! Copying a live upper into a stored layer (fork, hibernate) and folding one overlay-form
//! layer into another (a hibernated sandbox's new changes into its private layer).

use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};

use crate::error::ImageError;
use crate::fsx::{self, NodeKind, R, Root, show};
use crate::manifest::{Layer, Visit, inner_ids, walk};

/// What a copy or merge did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CopyStats {
    /// Entries written (directories, files, symlinks, whiteouts).
    pub entries: u64,
    /// Bytes of regular-file content copied.
    pub bytes: u64,
    /// Whiteouts written.
    pub whiteouts: u64,
    /// Entries owned by ids outside the layer's range, skipped with everything below them.
    pub skipped_foreign: u64,
    /// Sockets, fifos and device nodes other than whiteouts.
    pub skipped_special: u64,
}

/// Copies a live upper (host ids, base `from.id_base`) into a new overlay-form layer dir with
/// inner ids. Whiteouts and opaque dirs are kept, hardlinks within the upper stay hardlinks.
/// `dest` must be empty or absent; on failure it is emptied (removed if this made it).
pub fn copy_layer(from: &Layer, dest: &Path, skip_top: &[&str]) -> Result<CopyStats, ImageError> {
    let created = fsx::prepare_empty_dir(dest)?;
    let res = copy_inner(from, dest, skip_top);
    if res.is_err() {
        fsx::discard(dest, created);
    }
    res
}

fn copy_inner(from: &Layer, dest: &Path, skip_top: &[&str]) -> R<CopyStats> {
    let src = Root::open(&from.dir)?;
    let dst = Root::open(dest)?;
    copy_root_meta(&src, &dst, from.id_base)?;
    let mut stats = CopyStats::default();
    let mut first_link: HashMap<u64, PathBuf> = HashMap::new();
    let mut dir_times = Vec::new();
    walk(&src, skip_top, &mut |v| {
        let Some((u, g)) = admit(&v, from.id_base, &mut stats) else {
            return Ok(false);
        };
        let (pfd, name) = dst.parent(v.rel)?;
        stats.entries += 1;
        match v.node.kind {
            NodeKind::Whiteout => {
                stats.whiteouts += 1;
                fsx::make_whiteout(&pfd, name, v.rel)?;
            }
            NodeKind::Dir => {
                let fd = fsx::make_dir(&pfd, name, v.rel)?;
                fsx::own_and_mode(&fd, v.rel, u, g, v.node.mode)?;
                if v.opaque {
                    fsx::set_opaque(&fd, v.rel)?;
                }
                dir_times.push((v.rel.to_path_buf(), v.node.mtime));
                return Ok(true);
            }
            NodeKind::Symlink => {
                let t = fsx::read_link(v.parent, v.name, v.rel)?;
                fsx::make_symlink(&pfd, name, &t, v.rel, u, g, v.node.mtime)?;
            }
            NodeKind::File => {
                if v.node.nlink > 1 {
                    if let Some(first) = first_link.get(&v.node.ino) {
                        fsx::link(&dst, first, v.rel)?;
                        return Ok(false);
                    }
                    first_link.insert(v.node.ino, v.rel.to_path_buf());
                }
                stats.bytes += copy_file(&src, v.rel, &pfd, name, u, g, v.node.mode, v.node.mtime)?;
            }
            NodeKind::Special(_) => {}
        }
        Ok(false)
    })?;
    set_dir_times(&dst, &dir_times)?;
    Ok(stats)
}

/// Applies an overlay-form layer on top of another overlay-form layer dir in place (upper
/// over lower): a whiteout in `top` removes the path from `dest` and stays as a whiteout
/// (deeper layers may still have it), an opaque dir replaces dest's dir. `top.id_base` is
/// the base of `top`'s ids; `dest` holds inner ids. Not atomic: on failure `dest` is part-way
/// merged, so merge into a copy when the old state must survive.
pub fn merge_layer(top: &Layer, dest: &Path, skip_top: &[&str]) -> Result<CopyStats, ImageError> {
    let src = Root::open(&top.dir)?;
    let dst = Root::open(dest)?;
    copy_root_meta(&src, &dst, top.id_base)?;
    let mut stats = CopyStats::default();
    let mut dir_times = Vec::new();
    walk(&src, skip_top, &mut |v| {
        let Some((u, g)) = admit(&v, top.id_base, &mut stats) else {
            return Ok(false);
        };
        stats.entries += 1;
        let (pfd, name) = dst.parent(v.rel)?;
        let existing = fsx::statat(&pfd, name, v.rel)?;
        match v.node.kind {
            NodeKind::Dir => {
                let fd = match existing {
                    Some(n) if n.kind == NodeKind::Dir && !v.opaque => {
                        fsx::open_child_dir(&pfd, name, v.rel)?
                    }
                    Some(n) => {
                        dst.remove_all(v.rel)?;
                        let fd = fsx::make_dir(&pfd, name, v.rel)?;
                        // Below a non-directory the template's directory was hidden; the
                        // new one must keep hiding it.
                        if v.opaque || n.kind != NodeKind::Dir {
                            fsx::set_opaque(&fd, v.rel)?;
                        }
                        fd
                    }
                    None => {
                        let fd = fsx::make_dir(&pfd, name, v.rel)?;
                        if v.opaque {
                            fsx::set_opaque(&fd, v.rel)?;
                        }
                        fd
                    }
                };
                fsx::own_and_mode(&fd, v.rel, u, g, v.node.mode)?;
                dir_times.push((v.rel.to_path_buf(), v.node.mtime));
                return Ok(true);
            }
            _ if existing.is_some() => dst.remove_all(v.rel)?,
            _ => {}
        }
        match v.node.kind {
            NodeKind::Whiteout => {
                stats.whiteouts += 1;
                fsx::make_whiteout(&pfd, name, v.rel)?;
            }
            NodeKind::Symlink => {
                let t = fsx::read_link(v.parent, v.name, v.rel)?;
                fsx::make_symlink(&pfd, name, &t, v.rel, u, g, v.node.mtime)?;
            }
            NodeKind::File => {
                stats.bytes += copy_file(&src, v.rel, &pfd, name, u, g, v.node.mode, v.node.mtime)?;
            }
            NodeKind::Dir | NodeKind::Special(_) => {}
        }
        Ok(false)
    })?;
    set_dir_times(&dst, &dir_times)?;
    Ok(stats)
}

/// The inner ids to write a visited entry with, or `None` (counted) when it is skipped.
fn admit(v: &Visit<'_>, base: u32, stats: &mut CopyStats) -> Option<(u32, u32)> {
    match v.node.kind {
        NodeKind::Whiteout => Some((0, 0)),
        NodeKind::Special(_) => {
            stats.skipped_special += 1;
            None
        }
        _ => {
            let ids = inner_ids(v.node.uid, v.node.gid, base);
            if ids.is_none() {
                stats.skipped_foreign += 1;
            }
            ids
        }
    }
}

/// The upper's root directory gives the merged root its owner and mode.
fn copy_root_meta(src: &Root, dst: &Root, base: u32) -> R<()> {
    let here = Path::new("");
    if let Some(n) = src.lstat(here)?
        && let Some((u, g)) = inner_ids(n.uid, n.gid, base)
    {
        let fd = dst.open_dir(here)?;
        fsx::own_and_mode(&fd, here, u, g, n.mode)?;
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn copy_file(
    src: &Root,
    rel: &Path,
    pfd: &std::os::fd::OwnedFd,
    name: &std::ffi::OsStr,
    u: u32,
    g: u32,
    mode: u32,
    mtime: i64,
) -> R<u64> {
    let (mut sf, _) = src.open_file(rel)?;
    let mut df = fsx::create_file(pfd, name, rel)?;
    // File to file: std uses copy_file_range, so no bytes pass through userspace.
    let n = io::copy(&mut sf, &mut df).map_err(|e| ImageError::io("copy", show(rel), e))?;
    fsx::own_and_mode(&df, rel, u, g, mode)?;
    fsx::set_mtime_fd(&df, rel, mtime)?;
    Ok(n)
}

fn set_dir_times(dst: &Root, dirs: &[(PathBuf, i64)]) -> R<()> {
    for (rel, mtime) in dirs.iter().rev() {
        let (pfd, name) = dst.parent(rel)?;
        fsx::set_mtime_at(&pfd, name, rel, *mtime)?;
    }
    Ok(())
}
