//! Removing a template's directory: whatever a build left mounted inside it is detached
//! first, so that the removal never walks into a filesystem that is not the template's.

use super::BuildError;
use std::path::{Path, PathBuf};

/// Undoes the octal escapes (`\040` for a space...) of /proc/self/mountinfo paths.
fn unescape(field: &str) -> PathBuf {
    use std::os::unix::ffi::OsStringExt;
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = (b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)))
        .then(|| {
            b[i + 1..i + 4]
                .iter()
                .fold(0u32, |v, c| v * 8 + u32::from(c - b'0'))
        })
        .and_then(|v| u8::try_from(v).ok());
        if let Some(byte) = octal {
            out.push(byte);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    PathBuf::from(std::ffi::OsString::from_vec(out))
}

/// Mount points at or below `dir`, deepest first.
fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    let mut found: Vec<PathBuf> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(unescape)
        .filter(|m| m.starts_with(dir))
        .collect();
    found.sort_by_key(|m| std::cmp::Reverse(m.components().count()));
    found.dedup();
    found
}

/// Removes the tree at `dir` (nothing to do when it is missing), detaching mounts below it
/// first; refuses when a mount cannot be detached.
pub fn remove_tree(dir: &Path) -> Result<(), BuildError> {
    match std::fs::symlink_metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(BuildError::io("stat", dir, e)),
        Ok(_) => {}
    }
    for m in mounts_under(dir) {
        tracing::warn!(mount = %m.display(), "detaching a mount left inside a template build");
        if let Err(e) = nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH) {
            tracing::warn!(mount = %m.display(), error = %e, "detaching failed");
        }
    }
    if let Some(m) = mounts_under(dir).first() {
        return Err(BuildError::Failed(format!(
            "{} is still mounted; not removing {}",
            m.display(),
            dir.display()
        )));
    }
    std::fs::remove_dir_all(dir).map_err(|e| BuildError::io("remove", dir, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes_are_undone() {
        assert_eq!(unescape("/a\\040b"), PathBuf::from("/a b"));
        assert_eq!(unescape("/plain"), PathBuf::from("/plain"));
        assert_eq!(unescape("/trail\\04"), PathBuf::from("/trail\\04"));
        assert_eq!(unescape("/big\\777"), PathBuf::from("/big\\777"));
    }

    #[test]
    fn a_mount_inside_is_detached_before_the_removal() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("build");
        let inner = dir.join("rootfs/proc");
        std::fs::create_dir_all(&inner).unwrap();
        // A tmpfs standing in for what a build may leave mounted (debootstrap's /proc).
        nix::mount::mount(
            Some("tmpfs"),
            &inner,
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            Some("size=1m"),
        )
        .unwrap();
        std::fs::write(inner.join("x"), "y").unwrap();
        assert_eq!(mounts_under(&dir), vec![inner.clone()]);
        remove_tree(&dir).unwrap();
        assert!(!dir.exists());
        assert!(mounts_under(&dir).is_empty());
        remove_tree(&dir).unwrap();
    }
}
