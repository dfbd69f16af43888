//! An extra certificate authority a sandbox trusts (the credential broker's CA for that
//! sandbox): the CA alone and a bundle of the template's own roots plus the CA, in the
//! sandbox's `/.sandpit` (which only the host's root can write), and the environment
//! variables that point common TLS clients at the bundle.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// The CA certificate alone, relative to the sandbox's root.
pub const CA_FILE: &str = ".sandpit/ca.pem";
/// The template's roots and the CA, relative to the sandbox's root.
pub const BUNDLE_FILE: &str = ".sandpit/ca-bundle.pem";
/// Where distributions keep their root bundle; the first regular file found is used.
const SYSTEM_BUNDLES: &[&str] = &[
    "etc/ssl/certs/ca-certificates.crt",
    "etc/pki/tls/certs/ca-bundle.crt",
    "etc/ssl/cert.pem",
];
/// Largest system bundle read.
const MAX_BUNDLE: u64 = 8 << 20;
/// Variables that OpenSSL, Python requests, curl, Node.js and git read a CA file from.
pub const ENV_VARS: &[&str] = &[
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "NODE_EXTRA_CA_CERTS",
    "GIT_SSL_CAINFO",
];

/// Points the TLS variables at the bundle, unless the sandbox's own env sets them.
pub fn add_env(env: &mut BTreeMap<String, String>) {
    for v in ENV_VARS {
        env.entry(v.to_string())
            .or_insert_with(|| format!("/{BUNDLE_FILE}"));
    }
}

/// Why a CA file of a sandbox could not be written.
#[derive(Debug, thiserror::Error)]
#[error("{op} {}: {source}", path.display())]
pub struct TrustError {
    /// What was being done: `create`, `open` or `write`.
    pub op: &'static str,
    /// The file.
    pub path: std::path::PathBuf,
    #[source]
    pub source: std::io::Error,
}

/// Wraps an i/o error on `path` with the operation.
fn err(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> TrustError {
    let path = path.to_path_buf();
    move |source| TrustError { op, path, source }
}

fn write_new(p: &Path, content: &[u8]) -> Result<(), TrustError> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .open(p)
        .map_err(err("create", p))?;
    f.write_all(content).map_err(err("write", p))
}

/// Writes the CA and an empty bundle into the new writable layer (before the overlay
/// exists, so no name in it can lead elsewhere); the host's root owns both.
pub(crate) fn prepare(upper: &Path, ca_pem: &str) -> Result<(), TrustError> {
    write_new(&upper.join(CA_FILE), ca_pem.as_bytes())?;
    write_new(&upper.join(BUNDLE_FILE), b"")
}

/// Opens the template's root bundle in the sandbox's own tree (`root` is the sandbox's
/// `/` after pivot_root). Still privileged here, so only a regular file that is not in
/// /proc or /sys is taken; anything else counts as none.
fn system_roots(root: &Path) -> Option<(std::fs::File, u64)> {
    use nix::sys::statfs::{PROC_SUPER_MAGIC, SYSFS_MAGIC, fstatfs};
    for rel in SYSTEM_BUNDLES {
        let Ok(f) = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(root.join(rel))
        else {
            continue;
        };
        let Ok(meta) = f.metadata() else {
            continue;
        };
        let pseudo = fstatfs(&f).map_or(true, |s| {
            s.filesystem_type() == PROC_SUPER_MAGIC || s.filesystem_type() == SYSFS_MAGIC
        });
        if meta.is_file() && !pseudo {
            return Some((f, meta.len().min(MAX_BUNDLE)));
        }
    }
    None
}

/// Fills the bundle made by [`prepare`]: the template's roots (at most [`MAX_BUNDLE`],
/// copied in the kernel), then the CA.
pub(crate) fn fill_bundle(root: &Path, ca_pem: &str) -> Result<(), TrustError> {
    use std::os::unix::fs::FileExt;
    let p = root.join(BUNDLE_FILE);
    let mut out = std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&p)
        .map_err(err("open", &p))?;
    if let Some((src, len)) = system_roots(root) {
        let copied = std::io::copy(&mut (&src).take(len), &mut out).map_err(err("write", &p))?;
        let mut last = [0u8; 1];
        let ends_line = copied == 0
            || src
                .read_at(&mut last, copied - 1)
                .map_or(true, |n| n == 1 && last[0] == b'\n');
        if !ends_line {
            out.write_all(b"\n").map_err(err("write", &p))?;
        }
    }
    out.write_all(ca_pem.as_bytes()).map_err(err("write", &p))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bundle_is_the_roots_then_the_ca() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::create_dir_all(root.join(".sandpit")).unwrap();
        std::fs::create_dir_all(root.join("etc/ssl/certs")).unwrap();
        std::fs::write(root.join(SYSTEM_BUNDLES[0]), "ROOTS").unwrap();
        prepare(root, "CA\n").unwrap();
        assert_eq!(std::fs::read(root.join(BUNDLE_FILE)).unwrap(), b"");
        fill_bundle(root, "CA\n").unwrap();
        assert_eq!(
            std::fs::read(root.join(BUNDLE_FILE)).unwrap(),
            b"ROOTS\nCA\n"
        );
        assert_eq!(std::fs::read(root.join(CA_FILE)).unwrap(), b"CA\n");
        // Made once: a second prepare on the same layer is refused rather than followed.
        let again = prepare(root, "CA\n").unwrap_err();
        let ca = root.join(CA_FILE);
        assert_eq!(
            again.to_string(),
            format!(
                "create {}: {}",
                ca.display(),
                std::io::Error::from_raw_os_error(libc::EEXIST)
            )
        );
        let cause = std::error::Error::source(&again)
            .and_then(|s| s.downcast_ref::<std::io::Error>())
            .map(|e| e.kind());
        assert_eq!(cause, Some(std::io::ErrorKind::AlreadyExists));
    }

    #[test]
    fn a_template_without_roots_gets_the_ca_alone_and_links_are_not_written_through() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::create_dir_all(root.join(".sandpit")).unwrap();
        std::fs::write(root.join("elsewhere"), "keep").unwrap();
        std::os::unix::fs::symlink(root.join("elsewhere"), root.join(BUNDLE_FILE)).unwrap();
        assert!(fill_bundle(root, "CA\n").is_err());
        assert_eq!(std::fs::read(root.join("elsewhere")).unwrap(), b"keep");
        std::fs::remove_file(root.join(BUNDLE_FILE)).unwrap();
        std::fs::write(root.join(BUNDLE_FILE), "").unwrap();
        fill_bundle(root, "CA\n").unwrap();
        assert_eq!(std::fs::read(root.join(BUNDLE_FILE)).unwrap(), b"CA\n");
        let mut env = BTreeMap::from([("SSL_CERT_FILE".to_string(), "/mine".to_string())]);
        add_env(&mut env);
        assert_eq!(env["SSL_CERT_FILE"], "/mine");
        assert_eq!(env["NODE_EXTRA_CA_CERTS"], "/.sandpit/ca-bundle.pem");
    }
}
