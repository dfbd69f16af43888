//! Layer stacks and their manifests: what a stack of overlay-form layers changes over the
//! template, read top-down the way overlayfs merges them, with a content hash per file.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::OsStr;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::ImageError;
use crate::fsx::{self, NodeKind, R, Root, show};

/// Size of a sandbox's id range: a file owned by host id `base + n` is inner id `n`.
pub const ID_RANGE: u32 = 65536;
/// Prefix of OCI whiteout names; a real file with such a name could not be told apart.
pub(crate) const WH_PREFIX: &str = ".wh.";
/// OCI name of the marker that makes its directory opaque.
pub(crate) const WH_OPAQUE: &str = ".wh..wh..opq";

/// One directory of a stack, with the host id that its inner id 0 is stored as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layer {
    pub dir: PathBuf,
    /// 0 for stored layers (inner ids on disk); the sandbox's base for a live upper.
    pub id_base: u32,
}

/// Layers in overlayfs order, top first: `[upper, layer_n, ..., layer_1]`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stack(pub Vec<Layer>);

/// What a path is in a manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum EntryKind {
    /// A directory; `opaque` when it hides the template's directory of the same path.
    Dir {
        opaque: bool,
    },
    File {
        size: u64,
        sha256: String,
    },
    Symlink {
        target: String,
    },
    /// The path is deleted (hides the template's path).
    Whiteout,
}

/// One path of a manifest. Two entries are equal when kind, mode and owner are; mtimes are
/// not recorded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub kind: EntryKind,
    /// Permission bits including setuid, setgid and sticky (0 for whiteouts).
    pub mode: u32,
    /// Inner ids (the sandbox's view), 0 for whiteouts.
    pub uid: u32,
    pub gid: u32,
}

/// Every path a stack changes over the template, keyed by relative path (`a/b`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub entries: BTreeMap<String, Entry>,
}

/// How two manifests differ, each list sorted by path.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ManifestDiff {
    /// Paths only the newer manifest has.
    pub added: Vec<String>,
    /// Paths both have, with a different entry.
    pub changed: Vec<String>,
    /// Paths only the older manifest has.
    pub removed: Vec<String>,
}

impl ManifestDiff {
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.changed.is_empty() && self.removed.is_empty()
    }
}

/// What a walk over a stack left out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WalkStats {
    /// Entries owned by ids outside the layer's range (sandpit's own mount points), with
    /// everything below them.
    pub skipped_foreign: u64,
    /// Sockets, fifos and device nodes other than whiteouts.
    pub skipped_special: u64,
}

impl Manifest {
    /// What changed from `older` to `self`.
    pub fn diff(&self, older: &Manifest) -> ManifestDiff {
        let mut d = ManifestDiff::default();
        for (k, e) in &self.entries {
            match older.entries.get(k) {
                None => d.added.push(k.clone()),
                Some(o) if o != e => d.changed.push(k.clone()),
                Some(_) => {}
            }
        }
        d.removed = older
            .entries
            .keys()
            .filter(|k| !self.entries.contains_key(*k))
            .cloned()
            .collect();
        d
    }

    /// Total size of the regular files listed.
    pub fn file_bytes(&self) -> u64 {
        self.entries
            .values()
            .map(|e| match e.kind {
                EntryKind::File { size, .. } => size,
                _ => 0,
            })
            .sum()
    }
}

/// The inner ids of a node if both its owner and group lie in the layer's range. The
/// host's root counts too, as the overflow id the sandbox sees it as: overlayfs copies a
/// template's file up with its owner when the sandbox renames or moves it, and that file
/// is the sandbox's as much as any other.
pub(crate) fn inner_ids(uid: u32, gid: u32, base: u32) -> Option<(u32, u32)> {
    let inner = |id: u32| match id.checked_sub(base).filter(|i| *i < ID_RANGE) {
        Some(i) => Some(i),
        None if id == 0 => Some(crate::archive::OVERFLOW_ID),
        None => None,
    };
    Some((inner(uid)?, inner(gid)?))
}

/// A path and what is there, as the walker hands them out.
pub(crate) struct Visit<'a> {
    pub rel: &'a Path,
    pub node: &'a fsx::Node,
    /// For directories: whether they carry the opaque xattr.
    pub opaque: bool,
    /// The open parent directory (for readlink and friends).
    pub parent: &'a std::os::fd::OwnedFd,
    pub name: &'a OsStr,
}

/// Walks a layer directory pre-order without following symlinks; `visit` says whether to
/// descend into a directory. Top-level names in `skip_top` are never visited. Iterative, one
/// directory handle open at a time.
pub(crate) fn walk(
    root: &Root,
    skip_top: &[&str],
    visit: &mut dyn FnMut(Visit<'_>) -> R<bool>,
) -> R<()> {
    let mut stack = vec![PathBuf::new()];
    while let Some(dir) = stack.pop() {
        let fd = root.open_dir(&dir)?;
        let mut subdirs = Vec::new();
        for name in fsx::list_dir(&fd, &dir)? {
            if dir.as_os_str().is_empty() && skip_top.iter().any(|s| OsStr::new(s) == name) {
                continue;
            }
            let rel = dir.join(&name);
            if rel.as_os_str().len() > fsx::PATH_MAX {
                return Err(ImageError::Unrepresentable {
                    path: show(&rel),
                    reason: "path longer than PATH_MAX",
                });
            }
            // Gone since the listing: nothing to record.
            let Some(node) = fsx::statat(&fd, &name, &rel)? else {
                continue;
            };
            let opaque = if node.kind == NodeKind::Dir {
                let cfd = fsx::open_child_dir(&fd, &name, &rel)?;
                fsx::is_opaque(&cfd, &rel)?
            } else {
                false
            };
            let v = Visit {
                rel: &rel,
                node: &node,
                opaque,
                parent: &fd,
                name: &name,
            };
            if visit(v)? && node.kind == NodeKind::Dir {
                subdirs.push(rel);
            }
        }
        stack.extend(subdirs.into_iter().rev());
    }
    Ok(())
}

pub(crate) fn utf8(rel: &Path) -> R<&str> {
    rel.to_str()
        .ok_or_else(|| ImageError::NotUtf8 { path: show(rel) })
}

/// Refuses names that a layer archive would read back as something else.
pub(crate) fn check_name(rel: &Path, name: &OsStr) -> R<()> {
    if name.as_bytes().starts_with(WH_PREFIX.as_bytes()) {
        return Err(ImageError::Unrepresentable {
            path: show(rel),
            reason: "names starting with .wh. are whiteouts in layer archives",
        });
    }
    Ok(())
}

/// Streams a reader through sha256: (hex digest, bytes read).
pub(crate) fn hash_reader(mut r: impl Read, rel: &Path, buf: &mut [u8]) -> R<(String, u64)> {
    let mut h = Sha256::new();
    let mut n = 0u64;
    loop {
        let k = match r.read(buf) {
            Ok(0) => break,
            Ok(k) => k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(ImageError::io("read", show(rel), e)),
        };
        h.update(&buf[..k]);
        n += k as u64;
    }
    Ok((hex::encode(h.finalize()), n))
}

impl Stack {
    /// What the whole stack changes over the template (merged top-down as overlayfs would,
    /// whiteouts and opaque dirs honoured), with sha256 of every regular file.
    pub fn manifest(&self, skip_top: &[&str]) -> Result<Manifest, ImageError> {
        self.manifest_with_stats(skip_top).map(|(m, _)| m)
    }

    /// [`Stack::manifest`], also saying how many entries were left out and why.
    pub fn manifest_with_stats(
        &self,
        skip_top: &[&str],
    ) -> Result<(Manifest, WalkStats), ImageError> {
        // Each path remembers the layer that defined it: an entry from a higher layer wins,
        // and decides whether deeper layers may still add children below it.
        let mut out: BTreeMap<String, (Entry, usize)> = BTreeMap::new();
        // Paths a higher layer holds with a foreign owner: not captured, but they hide what
        // deeper layers have there, as in the merged view.
        let mut blocked: HashSet<String> = HashSet::new();
        let mut stats = WalkStats::default();
        let mut buf = vec![0u8; 128 * 1024];
        for (i, layer) in self.0.iter().enumerate() {
            let root = Root::open(&layer.dir)?;
            let mut hashed: HashMap<u64, (String, u64)> = HashMap::new();
            walk(&root, skip_top, &mut |v| {
                let key = utf8(v.rel)?;
                if blocked.contains(key) {
                    return Ok(false);
                }
                let is_dir = v.node.kind == NodeKind::Dir;
                if let Some((higher, j)) = out.get_mut(key)
                    && *j < i
                {
                    // A directory above merges with what is here unless it is opaque. What
                    // ends the lookup here (a non-directory, an opaque directory) keeps the
                    // template's path hidden below the merged directory: it becomes opaque.
                    return Ok(match &mut higher.kind {
                        EntryKind::Dir { opaque } if !*opaque => {
                            if !is_dir || v.opaque {
                                *opaque = true;
                            }
                            is_dir
                        }
                        _ => false,
                    });
                }
                let (kind, mode, uid, gid) = match v.node.kind {
                    // Whiteouts carry no ownership: overlayfs makes them as its mounter.
                    NodeKind::Whiteout => (EntryKind::Whiteout, 0, 0, 0),
                    NodeKind::Special(_) => {
                        stats.skipped_special += 1;
                        return Ok(false);
                    }
                    k => {
                        let Some((uid, gid)) = inner_ids(v.node.uid, v.node.gid, layer.id_base)
                        else {
                            stats.skipped_foreign += 1;
                            blocked.insert(key.to_string());
                            return Ok(false);
                        };
                        let (kind, mode) = match k {
                            NodeKind::Dir => (EntryKind::Dir { opaque: v.opaque }, v.node.mode),
                            NodeKind::Symlink => {
                                let t = fsx::read_link(v.parent, v.name, v.rel)?;
                                let target = t
                                    .into_string()
                                    .map_err(|_| ImageError::NotUtf8 { path: show(v.rel) })?;
                                (EntryKind::Symlink { target }, 0o777)
                            }
                            _ => {
                                let (sha256, size) = match hashed.get(&v.node.ino) {
                                    Some(h) => h.clone(),
                                    None => {
                                        let (f, _) = root.open_file(v.rel)?;
                                        let h = hash_reader(f, v.rel, &mut buf)?;
                                        if v.node.nlink > 1 {
                                            hashed.insert(v.node.ino, h.clone());
                                        }
                                        h
                                    }
                                };
                                (EntryKind::File { size, sha256 }, v.node.mode)
                            }
                        };
                        (kind, mode, uid, gid)
                    }
                };
                check_name(v.rel, v.name)?;
                out.insert(
                    key.to_string(),
                    (
                        Entry {
                            kind,
                            mode,
                            uid,
                            gid,
                        },
                        i,
                    ),
                );
                Ok(is_dir)
            })?;
        }
        let entries = out.into_iter().map(|(k, (e, _))| (k, e)).collect();
        Ok((Manifest { entries }, stats))
    }

    /// Opens every layer's directory once, top first, with its id base.
    pub(crate) fn open(&self) -> R<Vec<(Root, u32)>> {
        self.0
            .iter()
            .map(|l| Ok((Root::open(&l.dir)?, l.id_base)))
            .collect()
    }
}

/// The topmost of `roots` that holds `rel` with an owner in its range, and what is there.
pub(crate) fn find<'a>(roots: &'a [(Root, u32)], rel: &Path) -> R<Option<(&'a Root, fsx::Node)>> {
    for (root, base) in roots {
        match root.lstat(rel) {
            Ok(Some(n)) => {
                let ours = n.kind == NodeKind::Whiteout || inner_ids(n.uid, n.gid, *base).is_some();
                return Ok(ours.then_some((root, n)));
            }
            Ok(None) => continue,
            // A non-directory on the way hides the path in this and deeper layers.
            Err(ImageError::ThroughSymlink { .. }) => return Ok(None),
            Err(e) => return Err(e),
        }
    }
    Ok(None)
}
