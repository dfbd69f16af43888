//! The `host` template: a small skeleton directory used as the read-only lower layer, into
//! which the host's /usr is bind-mounted read-only at start. Only harmless parts of the
//! host's /etc are copied (never shadow files, sudoers or private keys).

use crate::RuntimeError;
use std::path::{Path, PathBuf};

/// Entries of the host's /etc copied into the skeleton (missing ones are skipped).
const ETC_COPY: &[&str] = &[
    "alternatives",
    "bash.bashrc",
    "ca-certificates",
    "ca-certificates.conf",
    "debian_version",
    "environment",
    "gai.conf",
    "host.conf",
    "inputrc",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "login.defs",
    "lsb-release",
    "matplotlibrc",
    "mime.types",
    "nsswitch.conf",
    "os-release",
    "profile",
    "profile.d",
    "protocols",
    "python3",
    "python3.11",
    "perl",
    "services",
    "shells",
    "skel",
    "ssl",
    "timezone",
    "terminfo",
    "vim",
    "issue",
];
/// Never copied, even below a copied directory.
const ETC_DENY: &[&str] = &["ssl/private"];
/// Top-level directories the sandbox gets; the host's are never visible.
const DIRS: &[&str] = &[
    "usr",
    "etc",
    "home",
    "root",
    "tmp",
    "workspace",
    "proc",
    "sys",
    "dev",
    "run",
    "var",
    "var/tmp",
    "var/lib",
    "var/cache",
    "var/log",
    "opt",
    "mnt",
    ".sandpit",
];
/// Host directories bind-mounted read-only into a `host` sandbox.
pub const HOST_BINDS: &[&str] = &["/usr"];
const MERGED_LINKS: &[&str] = &["bin", "sbin", "lib", "lib32", "lib64", "libx32"];

/// The skeleton for the host as it is now, under `templates_dir`, and the host paths to
/// bind in. The directory is named after a fingerprint of what it copies: running
/// sandboxes keep their lower layer (deleting it would pull their root from under them),
/// and a new one appears only when the host's files changed.
pub fn host_skeleton(templates_dir: &Path) -> Result<(PathBuf, Vec<PathBuf>), RuntimeError> {
    let dir = templates_dir.join(format!("host-{:016x}", host_fingerprint()));
    let binds = if dir.is_dir() {
        host_binds()
    } else {
        build_host_skeleton(&dir)?
    };
    Ok((dir, binds))
}

/// Removes skeletons other than `current` (only call when no sandbox can be using them).
pub fn remove_old_skeletons(templates_dir: &Path, current: &Path) {
    let Ok(rd) = std::fs::read_dir(templates_dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        let name = e.file_name();
        if p != current && is_skeleton_name(&name.to_string_lossy()) {
            let _ = std::fs::remove_dir_all(&p);
        }
    }
}

/// `host`, `host-<16 hex digits>`, either with `.new`: names [`host_skeleton`] and
/// [`build_host_skeleton`] use. Built templates share the directory and may be called
/// `hostile-...`; those are not skeletons.
fn is_skeleton_name(name: &str) -> bool {
    let name = name.strip_suffix(".new").unwrap_or(name);
    name == "host"
        || name
            .strip_prefix("host-")
            .is_some_and(|fp| fp.len() == 16 && fp.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// FNV-1a over names, sizes, mtimes and link targets of everything the skeleton copies.
fn host_fingerprint() -> u64 {
    fn feed(h: &mut u64, bytes: &[u8]) {
        for b in bytes {
            *h = (*h ^ *b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }
    fn walk(h: &mut u64, p: &Path, depth: u32) {
        use std::os::unix::fs::MetadataExt;
        let Ok(m) = std::fs::symlink_metadata(p) else {
            return;
        };
        feed(h, p.as_os_str().as_encoded_bytes());
        feed(h, &m.size().to_le_bytes());
        feed(h, &m.mtime().to_le_bytes());
        feed(h, &m.mode().to_le_bytes());
        if m.file_type().is_symlink() {
            if let Ok(t) = std::fs::read_link(p) {
                feed(h, t.as_os_str().as_encoded_bytes());
            }
        } else if m.is_dir()
            && depth < 16
            && let Ok(rd) = std::fs::read_dir(p)
        {
            let mut names: Vec<PathBuf> = rd.flatten().map(|e| e.path()).collect();
            names.sort();
            for n in names {
                walk(h, &n, depth + 1);
            }
        }
    }
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    feed(&mut h, env!("CARGO_PKG_VERSION").as_bytes());
    for name in MERGED_LINKS {
        walk(&mut h, &Path::new("/").join(name), 15);
    }
    for name in ETC_COPY {
        walk(&mut h, &Path::new("/etc").join(name), 0);
    }
    h
}

/// Host directories to bind into a `host` sandbox (more than /usr without merged /usr).
fn host_binds() -> Vec<PathBuf> {
    let mut binds: Vec<PathBuf> = HOST_BINDS.iter().map(PathBuf::from).collect();
    for name in MERGED_LINKS {
        let host = Path::new("/").join(name);
        if std::fs::symlink_metadata(&host).is_ok_and(|m| m.is_dir()) {
            binds.push(host);
        }
    }
    binds
}

/// Builds the skeleton under `dir` (replacing any) and returns the host paths to bind in.
pub fn build_host_skeleton(dir: &Path) -> Result<Vec<PathBuf>, RuntimeError> {
    let tmp = dir.with_extension("new");
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp)
        .map_err(|e| RuntimeError::io(format!("create {}", tmp.display()), e))?;
    for d in DIRS {
        let p = tmp.join(d);
        std::fs::create_dir_all(&p)
            .map_err(|e| RuntimeError::io(format!("create {}", p.display()), e))?;
    }
    let mut binds: Vec<PathBuf> = HOST_BINDS.iter().map(PathBuf::from).collect();
    for name in MERGED_LINKS {
        let host = Path::new("/").join(name);
        match std::fs::symlink_metadata(&host) {
            Ok(m) if m.file_type().is_symlink() => {
                let target = std::fs::read_link(&host)
                    .map_err(|e| RuntimeError::io(format!("readlink {}", host.display()), e))?;
                std::os::unix::fs::symlink(&target, tmp.join(name))
                    .map_err(|e| RuntimeError::io(format!("symlink {name}"), e))?;
            }
            Ok(m) if m.is_dir() => {
                // A host without merged /usr: bind the directory itself.
                std::fs::create_dir_all(tmp.join(name))
                    .map_err(|e| RuntimeError::io(format!("create {name}"), e))?;
                binds.push(host);
            }
            _ => {}
        }
    }
    for name in ETC_COPY {
        let src = Path::new("/etc").join(name);
        if std::fs::symlink_metadata(&src).is_ok() {
            copy_tree(&src, &tmp.join("etc").join(name), Path::new(name))?;
        }
    }
    let _ = std::fs::remove_dir_all(dir);
    std::fs::rename(&tmp, dir)
        .map_err(|e| RuntimeError::io(format!("install {}", dir.display()), e))?;
    Ok(binds)
}

fn copy_tree(src: &Path, dst: &Path, rel: &Path) -> Result<(), RuntimeError> {
    if ETC_DENY.iter().any(|d| rel == Path::new(d)) {
        return Ok(());
    }
    let meta = std::fs::symlink_metadata(src)
        .map_err(|e| RuntimeError::io(format!("stat {}", src.display()), e))?;
    let ft = meta.file_type();
    if ft.is_symlink() {
        let target = std::fs::read_link(src)
            .map_err(|e| RuntimeError::io(format!("readlink {}", src.display()), e))?;
        std::os::unix::fs::symlink(target, dst)
            .map_err(|e| RuntimeError::io(format!("symlink {}", dst.display()), e))?;
    } else if ft.is_dir() {
        std::fs::create_dir_all(dst)
            .map_err(|e| RuntimeError::io(format!("create {}", dst.display()), e))?;
        let rd = std::fs::read_dir(src)
            .map_err(|e| RuntimeError::io(format!("list {}", src.display()), e))?;
        for e in rd.flatten() {
            copy_tree(
                &e.path(),
                &dst.join(e.file_name()),
                &rel.join(e.file_name()),
            )?;
        }
    } else if ft.is_file() {
        use std::os::unix::fs::PermissionsExt;
        // Only world-readable files: anything narrower is private to the host.
        if meta.permissions().mode() & 0o004 == 0 {
            return Ok(());
        }
        std::fs::copy(src, dst)
            .map_err(|e| RuntimeError::io(format!("copy {}", src.display()), e))?;
    }
    Ok(())
}

/// `/etc/passwd` of a host-template sandbox.
pub const PASSWD: &str = "root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000:user:/home/user:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n";
/// `/etc/group` of a host-template sandbox.
pub const GROUP: &str = "root:x:0:\ntty:x:5:\nuser:x:1000:\nnogroup:x:65534:\n";
/// `/etc/hosts` of every sandbox.
pub const HOSTS: &str = "127.0.0.1\tlocalhost sandpit\n::1\tlocalhost ip6-localhost ip6-loopback\n";

/// Checks that a directory can serve as a root filesystem template.
pub fn check_rootfs(path: &Path) -> Result<(), RuntimeError> {
    let s = path.to_string_lossy();
    if !path.is_absolute() || s.contains([',', ':', '\n']) {
        // overlayfs options cannot carry these characters.
        return Err(RuntimeError::InvalidSpec(format!(
            "rootfs path {s:?} must be absolute and free of ',' and ':'"
        )));
    }
    if !path.join("bin").exists() && !path.join("usr/bin").exists() {
        return Err(RuntimeError::InvalidSpec(format!(
            "{s} does not look like a root filesystem (no bin or usr/bin)"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skeleton_has_no_host_secrets_and_mirrors_merged_usr() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("host");
        let binds = build_host_skeleton(&dir).unwrap();
        assert!(binds.contains(&PathBuf::from("/usr")));
        assert!(!dir.join("etc/shadow").exists());
        assert!(!dir.join("etc/ssl/private").exists());
        assert!(
            !dir.join("etc/passwd").exists(),
            "passwd is generated per sandbox"
        );
        assert!(dir.join("home").is_dir() && dir.join("workspace").is_dir());
        if std::fs::symlink_metadata("/bin")
            .unwrap()
            .file_type()
            .is_symlink()
        {
            assert!(
                std::fs::symlink_metadata(dir.join("bin"))
                    .unwrap()
                    .file_type()
                    .is_symlink()
            );
        }
        // Rebuilding replaces the old skeleton in place.
        build_host_skeleton(&dir).unwrap();
        assert!(!dir.with_extension("new").exists());
        // The fingerprinted skeleton is reused while the host is unchanged.
        let (a, _) = host_skeleton(t.path()).unwrap();
        let (b, _) = host_skeleton(t.path()).unwrap();
        assert_eq!(a, b);
        let built = t.path().join("hostile-abc123");
        std::fs::create_dir(&built).unwrap();
        remove_old_skeletons(t.path(), &a);
        assert!(a.is_dir() && !dir.exists());
        assert!(built.is_dir(), "a built template is not a skeleton");
    }
}
