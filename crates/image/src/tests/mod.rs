//! Tests on real directories (run as root: whiteouts, trusted xattrs and chown need it).

mod hostile;
mod layers;
mod oci;

use std::collections::BTreeMap;
use std::fs;
use std::io::Read;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use rustix::fs::{FileType, Mode, XattrFlags};

use crate::fsx::OPAQUE_XATTR;

/// Writes a file with mode and owner.
pub(crate) fn file(root: &Path, rel: &str, data: &[u8], mode: u32, uid: u32, gid: u32) {
    let p = root.join(rel);
    fs::write(&p, data).unwrap();
    std::os::unix::fs::lchown(&p, Some(uid), Some(gid)).unwrap();
    fs::set_permissions(&p, fs::Permissions::from_mode(mode)).unwrap();
}

pub(crate) fn dir(root: &Path, rel: &str, mode: u32, uid: u32, gid: u32) {
    let p = root.join(rel);
    fs::create_dir_all(&p).unwrap();
    std::os::unix::fs::lchown(&p, Some(uid), Some(gid)).unwrap();
    fs::set_permissions(&p, fs::Permissions::from_mode(mode)).unwrap();
}

pub(crate) fn symlink(root: &Path, rel: &str, target: &str, uid: u32) {
    let p = root.join(rel);
    std::os::unix::fs::symlink(target, &p).unwrap();
    std::os::unix::fs::lchown(&p, Some(uid), Some(uid)).unwrap();
}

/// An overlayfs whiteout, as the kernel makes it.
pub(crate) fn whiteout(root: &Path, rel: &str) {
    rustix::fs::mknodat(
        rustix::fs::CWD,
        root.join(rel),
        FileType::CharacterDevice,
        Mode::empty(),
        0,
    )
    .unwrap();
}

pub(crate) fn make_opaque(root: &Path, rel: &str) {
    rustix::fs::lsetxattr(root.join(rel), OPAQUE_XATTR, b"y", XattrFlags::empty()).unwrap();
}

pub(crate) fn is_opaque(p: &Path) -> bool {
    let mut buf = [0u8; 4];
    matches!(rustix::fs::lgetxattr(p, OPAQUE_XATTR, &mut buf[..]), Ok(1) if buf[0] == b'y')
}

pub(crate) fn is_whiteout(p: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    fs::symlink_metadata(p)
        .map(|m| m.file_type().is_char_device() && m.rdev() == 0)
        .unwrap_or(false)
}

pub(crate) fn owner(p: &Path) -> (u32, u32) {
    let m = fs::symlink_metadata(p).unwrap();
    (m.uid(), m.gid())
}

pub(crate) fn mode(p: &Path) -> u32 {
    fs::symlink_metadata(p).unwrap().mode() & 0o7777
}

/// Deterministic bytes that are not all alike (so compression cannot hide a mix-up).
pub(crate) fn pattern(n: usize, seed: u8) -> Vec<u8> {
    let mut x = u32::from(seed).wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x >> 11) as u8
        })
        .collect()
}

/// Member names of a (compressed or plain) tar, in order.
pub(crate) fn members(archive: &[u8]) -> Vec<String> {
    let data: Vec<u8> = if archive.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        zstd::decode_all(archive).unwrap()
    } else {
        archive.to_vec()
    };
    let mut ar = tar::Archive::new(&data[..]);
    ar.entries()
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            String::from_utf8(e.path_bytes().into_owned()).unwrap()
        })
        .collect()
}

/// Every file's bytes under a directory, as the merged view of `layers` (top first) shows
/// them to overlayfs, for byte-for-byte comparisons.
pub(crate) fn contents(m: &crate::Manifest, stack: &crate::Stack) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let roots = stack.open().unwrap();
    for (k, e) in &m.entries {
        if let crate::EntryKind::File { .. } = e.kind {
            let (root, _) = crate::manifest::find(&roots, Path::new(k))
                .unwrap()
                .unwrap();
            let (mut f, _) = root.open_file(Path::new(k)).unwrap();
            let mut v = Vec::new();
            f.read_to_end(&mut v).unwrap();
            out.insert(k.clone(), v);
        }
    }
    out
}

/// A directory next to a canary file: whatever an archive does, the canary's directory must
/// end up holding the canary and the target only.
pub(crate) struct Arena {
    pub tmp: tempfile::TempDir,
}

pub(crate) const CANARY: &[u8] = b"canary: must never change\n";

impl Arena {
    pub(crate) fn new() -> Arena {
        let tmp = tempfile::tempdir().unwrap();
        fs::write(tmp.path().join("canary"), CANARY).unwrap();
        fs::create_dir(tmp.path().join("target")).unwrap();
        Arena { tmp }
    }
    pub(crate) fn base(&self) -> &Path {
        self.tmp.path()
    }
    pub(crate) fn target(&self) -> std::path::PathBuf {
        self.tmp.path().join("target")
    }
    /// The canary is intact and nothing new appeared beside it.
    pub(crate) fn assert_untouched(&self) {
        assert_eq!(fs::read(self.base().join("canary")).unwrap(), CANARY);
        let mut names: Vec<String> = fs::read_dir(self.base())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["canary", "target"]);
    }
}
