//! User metadata on files, as E2B's envd (0.6.2 and later) keeps it: each key is an
//! extended attribute `user.e2b.<key>` of the file. Uploads set it from `X-Metadata-<key>`
//! headers (keys lowercased); `EntryInfo.metadata` reports every `user.e2b.*` attribute of
//! an entry, also those set inside the sandbox (`setfattr`), with the prefix removed.
//!
//! Only names under [`PREFIX`] are ever read or written: the prefix is put in front of a
//! validated key here, so no request can reach `trusted.*`, `security.*`, `system.*` or
//! another program's `user.*` attributes. Attributes are read through a descriptor the
//! caller opened under the sandbox root (by `/proc/self/fd/N`, which names that very
//! inode), never by a path the sandbox could redirect.

use std::collections::HashMap;
use std::ffi::CString;
use std::os::fd::{AsRawFd, OwnedFd};

/// Namespace of the attributes that hold metadata.
pub const PREFIX: &str = "user.e2b.";
/// Longest key: the kernel limits a whole attribute name (prefix included) to 255 bytes.
pub const MAX_KEY_LEN: usize = 255 - PREFIX.len();
/// Budget of one file's metadata, names (with the prefix) and values together: ext4 keeps
/// all of an inode's attributes in one 4 KiB block, so E2B refuses more up front.
pub const MAX_TOTAL_LEN: usize = 4096;
/// Header prefix of upload metadata.
pub const HEADER_PREFIX: &str = "x-metadata-";
/// Largest value read back; the kernel's own limit (`XATTR_SIZE_MAX`).
const MAX_VALUE_READ: usize = 64 * 1024;
/// Largest name list read back (`XATTR_LIST_MAX`).
const MAX_LIST_READ: usize = 64 * 1024;

/// Why a metadata set was refused (a 400 for the caller).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MetadataError {
    /// A key is empty.
    #[error("metadata key must not be empty")]
    EmptyKey,
    /// A key is longer than the kernel allows an attribute name to be.
    #[error("metadata key {key:?} exceeds {MAX_KEY_LEN} bytes")]
    KeyTooLong { key: String },
    /// A key or value holds a byte outside printable US-ASCII.
    #[error("metadata {what} contains non-printable-ASCII byte 0x{byte:02x} at offset {offset}")]
    NotPrintable {
        what: String,
        byte: u8,
        offset: usize,
    },
    /// The whole set is larger than one file may carry.
    #[error("total metadata size {total} exceeds {MAX_TOTAL_LEN} bytes")]
    TooLarge { total: usize },
    /// A header value is not text.
    #[error("metadata value for key {key:?} is not text")]
    NotText { key: String },
}

/// A failure writing or reading attributes, with the errno kept.
#[derive(Debug, thiserror::Error)]
#[error("extended attributes: {op}: {source}")]
pub struct XattrError {
    op: &'static str,
    #[source]
    pub source: std::io::Error,
}

impl XattrError {
    fn last(op: &'static str) -> Self {
        Self {
            op,
            source: std::io::Error::last_os_error(),
        }
    }

    /// The file system keeps no user attributes (`/proc`, `/sys`, old tmpfs): E2B stores
    /// the file anyway and reports no metadata.
    pub fn unsupported(&self) -> bool {
        self.source.raw_os_error() == Some(libc::ENOTSUP)
    }

    /// Out of space for the attributes.
    pub fn no_space(&self) -> bool {
        matches!(
            self.source.raw_os_error(),
            Some(libc::ENOSPC) | Some(libc::EDQUOT) | Some(libc::E2BIG)
        )
    }
}

fn check_printable(what: impl FnOnce() -> String, s: &str) -> Result<(), MetadataError> {
    match s
        .bytes()
        .enumerate()
        .find(|(_, b)| !(0x20..=0x7e).contains(b))
    {
        None => Ok(()),
        Some((offset, byte)) => Err(MetadataError::NotPrintable {
            what: what(),
            byte,
            offset,
        }),
    }
}

/// Checks a metadata set the way E2B's envd does before anything is written: keys
/// non-empty, at most [`MAX_KEY_LEN`] bytes, keys and values printable US-ASCII, and the
/// whole at most [`MAX_TOTAL_LEN`] bytes.
pub fn validate(metadata: &HashMap<String, String>) -> Result<(), MetadataError> {
    let mut total = 0usize;
    let mut keys: Vec<&String> = metadata.keys().collect();
    // A stable order, so the same bad set always names the same key.
    keys.sort();
    for k in keys {
        let v = &metadata[k];
        if k.is_empty() {
            return Err(MetadataError::EmptyKey);
        }
        if k.len() > MAX_KEY_LEN {
            return Err(MetadataError::KeyTooLong { key: k.clone() });
        }
        check_printable(|| "key".into(), k)?;
        check_printable(|| format!("value for key {k:?}"), v)?;
        total += PREFIX.len() + k.len() + v.len();
    }
    if total > MAX_TOTAL_LEN {
        return Err(MetadataError::TooLarge { total });
    }
    Ok(())
}

/// The metadata an upload carries in `X-Metadata-<key>` headers: keys lowercased, the
/// first value of a repeated header, an empty key ignored (as E2B's envd does). Validated.
pub fn from_headers(headers: &http::HeaderMap) -> Result<HashMap<String, String>, MetadataError> {
    let mut out = HashMap::new();
    for name in headers.keys() {
        // Header names are lowercase already.
        let Some(key) = name.as_str().strip_prefix(HEADER_PREFIX) else {
            continue;
        };
        if key.is_empty() || out.contains_key(key) {
            continue;
        }
        let Some(value) = headers.get(name) else {
            continue;
        };
        let value = value.to_str().map_err(|_| MetadataError::NotText {
            key: key.to_string(),
        })?;
        out.insert(key.to_string(), value.to_string());
    }
    validate(&out)?;
    Ok(out)
}

/// The path by which the kernel reaches exactly the inode behind `fd` (which may be an
/// `O_PATH` descriptor, for which the `f*xattr` calls are refused).
fn fd_cpath(fd: &OwnedFd) -> CString {
    // A decimal number: never holds a NUL.
    CString::new(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap_or_default()
}

/// Splits a `listxattr` answer into the names under [`PREFIX`], without the prefix.
fn our_keys(list: &[u8]) -> Vec<String> {
    list.split(|b| *b == 0)
        .filter_map(|n| std::str::from_utf8(n).ok())
        .filter_map(|n| n.strip_prefix(PREFIX))
        .map(str::to_string)
        .collect()
}

/// Reads the metadata of the inode behind `fd` (any descriptor, `O_PATH` included).
/// `None` when it has none or its file system keeps none; keys and values that are not
/// UTF-8 (set inside the sandbox) are skipped, as E2B does, since the answer cannot carry
/// them.
pub fn read(fd: &OwnedFd) -> Result<Option<HashMap<String, String>>, XattrError> {
    let path = fd_cpath(fd);
    let mut list = vec![0u8; MAX_LIST_READ];
    // SAFETY: `path` is a valid C string and `list` a writable buffer of the length given.
    let n = unsafe { libc::listxattr(path.as_ptr(), list.as_mut_ptr().cast(), list.len()) };
    if n < 0 {
        let e = XattrError::last("list");
        if e.unsupported() {
            return Ok(None);
        }
        return Err(e);
    }
    list.truncate(n as usize);
    let mut out = HashMap::new();
    let mut value = vec![0u8; MAX_VALUE_READ];
    for key in our_keys(&list) {
        let Ok(name) = CString::new(format!("{PREFIX}{key}")) else {
            continue;
        };
        // SAFETY: valid C strings and a writable buffer of the length given.
        let n = unsafe {
            libc::getxattr(
                path.as_ptr(),
                name.as_ptr(),
                value.as_mut_ptr().cast(),
                value.len(),
            )
        };
        if n < 0 {
            let e = XattrError::last("get");
            // Removed meanwhile.
            if e.source.raw_os_error() == Some(libc::ENODATA) {
                continue;
            }
            return Err(e);
        }
        if let Ok(v) = std::str::from_utf8(&value[..n as usize]) {
            out.insert(key, v.to_string());
        }
    }
    Ok((!out.is_empty()).then_some(out))
}

/// Replaces the metadata of the file open as `fd` (a real descriptor, not `O_PATH`) with
/// `metadata`: keys it lacks are removed, so an overwrite does not keep stale metadata
/// (`O_TRUNC` keeps attributes). Nothing is touched when there is nothing to change, so a
/// plain upload raises no attribute event for watchers. `metadata` must be validated.
pub fn replace(fd: &OwnedFd, metadata: &HashMap<String, String>) -> Result<(), XattrError> {
    let raw = fd.as_raw_fd();
    let mut list = vec![0u8; MAX_LIST_READ];
    // SAFETY: `list` is a writable buffer of the length given.
    let n = unsafe { libc::flistxattr(raw, list.as_mut_ptr().cast(), list.len()) };
    if n < 0 {
        let e = XattrError::last("list");
        if e.unsupported() && metadata.is_empty() {
            return Ok(());
        }
        return Err(e);
    }
    list.truncate(n as usize);
    for key in our_keys(&list) {
        if metadata.contains_key(&key) {
            continue;
        }
        let Ok(name) = CString::new(format!("{PREFIX}{key}")) else {
            continue;
        };
        // SAFETY: a valid C string.
        if unsafe { libc::fremovexattr(raw, name.as_ptr()) } < 0 {
            let e = XattrError::last("remove");
            if e.source.raw_os_error() != Some(libc::ENODATA) {
                return Err(e);
            }
        }
    }
    for (k, v) in metadata {
        let name = CString::new(format!("{PREFIX}{k}")).map_err(|e| XattrError {
            op: "name",
            source: std::io::Error::new(std::io::ErrorKind::InvalidInput, e),
        })?;
        // SAFETY: a valid C string and a readable buffer of the length given.
        let r = unsafe { libc::fsetxattr(raw, name.as_ptr(), v.as_ptr().cast(), v.len(), 0) };
        if r < 0 {
            return Err(XattrError::last("set"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn validation_follows_envd_limits() {
        assert!(validate(&map(&[("author", "mish"), ("a.b-c_d", "")])).is_ok());
        assert_eq!(validate(&map(&[("", "x")])), Err(MetadataError::EmptyKey));
        let long = "k".repeat(MAX_KEY_LEN + 1);
        assert!(matches!(
            validate(&map(&[(&long, "x")])),
            Err(MetadataError::KeyTooLong { .. })
        ));
        assert!(validate(&map(&[(&"k".repeat(MAX_KEY_LEN), "x")])).is_ok());
        for bad in ["a\nb", "é", "tab\t", "\u{7f}"] {
            assert!(
                matches!(
                    validate(&map(&[("k", bad)])),
                    Err(MetadataError::NotPrintable { .. })
                ),
                "{bad:?}"
            );
            assert!(matches!(
                validate(&map(&[(bad, "v")])),
                Err(MetadataError::NotPrintable { .. })
            ));
        }
        // The budget counts the prefix of every name.
        let v = "v".repeat(MAX_TOTAL_LEN - PREFIX.len() - 1);
        assert!(validate(&map(&[("k", &v)])).is_ok());
        let v = "v".repeat(MAX_TOTAL_LEN - PREFIX.len());
        assert!(matches!(
            validate(&map(&[("k", &v)])),
            Err(MetadataError::TooLarge { .. })
        ));
    }

    #[test]
    fn headers_give_lowercased_keys_and_ignore_the_rest() {
        let mut h = http::HeaderMap::new();
        h.insert("X-Metadata-Author", "mish".parse().unwrap());
        h.append("x-metadata-author", "second".parse().unwrap());
        h.insert("X-Metadata-", "ignored".parse().unwrap());
        h.insert("X-Access-Token", "abc".parse().unwrap());
        h.insert("Content-Type", "application/octet-stream".parse().unwrap());
        assert_eq!(from_headers(&h).unwrap(), map(&[("author", "mish")]));
        let mut h = http::HeaderMap::new();
        h.insert(
            "X-Metadata-Bad",
            http::HeaderValue::from_bytes(b"caf\xc3\xa9").unwrap(),
        );
        assert!(from_headers(&h).is_err());
    }

    #[test]
    fn only_names_under_the_prefix_are_keys() {
        let list =
            b"user.e2b.a\0user.other\0trusted.x\0security.selinux\0user.e2b.\xff\0user.e2b.b.c\0";
        assert_eq!(our_keys(list), vec!["a".to_string(), "b.c".to_string()]);
    }

    #[test]
    fn replace_then_read_round_trips_and_clears_stale_keys() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("f");
        let f = std::fs::File::create(&p).unwrap();
        let fd = OwnedFd::from(f);
        // Another program's attribute in the plain user namespace is left alone.
        let other = CString::new("user.other").unwrap();
        // SAFETY: valid C strings and buffer.
        let r =
            unsafe { libc::fsetxattr(fd.as_raw_fd(), other.as_ptr(), b"x".as_ptr().cast(), 1, 0) };
        if r < 0 {
            eprintln!("skipped: no user xattrs on this file system");
            return;
        }
        replace(&fd, &map(&[("a", "1"), ("b", "2")])).unwrap();
        assert_eq!(read(&fd).unwrap(), Some(map(&[("a", "1"), ("b", "2")])));
        replace(&fd, &map(&[("b", "3")])).unwrap();
        assert_eq!(read(&fd).unwrap(), Some(map(&[("b", "3")])));
        replace(&fd, &HashMap::new()).unwrap();
        assert_eq!(read(&fd).unwrap(), None);
        let mut buf = [0u8; 8];
        // SAFETY: valid C string and buffer.
        let n = unsafe {
            libc::fgetxattr(
                fd.as_raw_fd(),
                other.as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        };
        assert_eq!(n, 1, "user.other must survive");
        // Read through an O_PATH descriptor, as entry listings do.
        let opath = nix::fcntl::open(
            &p,
            nix::fcntl::OFlag::O_PATH | nix::fcntl::OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        )
        .unwrap();
        replace(&fd, &map(&[("k", "v")])).unwrap();
        assert_eq!(read(&opath).unwrap(), Some(map(&[("k", "v")])));
    }
}
