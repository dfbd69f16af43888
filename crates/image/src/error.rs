//! One error type for every operation of the crate.

use std::io;

/// What went wrong while reading a stack, writing or unpacking an archive, or importing an image.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// The host's filesystem refused an operation (not the input's fault).
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: String,
        #[source]
        source: io::Error,
    },
    /// An archive member's name is absolute, has `..`, a NUL, or is longer than PATH_MAX.
    #[error("unsafe member name {path:?}: {reason}")]
    UnsafePath { path: String, reason: &'static str },
    /// A path leads through a symlink or a non-directory; nothing is written through it.
    #[error("path {path:?} leads through a symlink or a non-directory")]
    ThroughSymlink { path: String },
    /// A hardlink member points outside the archive or at something not yet extracted.
    #[error("unsafe hardlink {path:?} -> {target:?}: {reason}")]
    UnsafeHardlink {
        path: String,
        target: String,
        reason: &'static str,
    },
    /// A member is a device node, fifo, socket or another type that is never extracted.
    #[error("member {path:?} is a {kind}, which is refused")]
    SpecialFile { path: String, kind: &'static str },
    /// A setuid or setgid file is owned by an id outside the sandbox's range.
    #[error("member {path:?} is setuid/setgid and owned by {uid}:{gid}, outside the id range")]
    ForeignSetuid { path: String, uid: u64, gid: u64 },
    /// The archive has more members than the limit allows.
    #[error("archive has more than {limit} entries")]
    TooManyEntries { limit: u64 },
    /// The archive holds more bytes than the limit allows.
    #[error("archive holds more than {limit} bytes")]
    TooBig { limit: u64 },
    /// A name or symlink target is not UTF-8, which manifests cannot carry.
    #[error("name is not UTF-8: {path:?}")]
    NotUtf8 { path: String },
    /// A name that layer archives cannot represent (it would read back as a whiteout).
    #[error("name {path:?} cannot be stored in a layer: {reason}")]
    Unrepresentable { path: String, reason: &'static str },
    /// A file changed between the manifest and the archive; freeze the sandbox and retry.
    #[error("{path:?} changed while it was being archived")]
    Changed { path: String },
    /// A manifest does not describe a tree (an entry's parent is not a directory).
    #[error("invalid manifest: {0}")]
    InvalidManifest(String),
    /// The destination directory must be empty (or absent) and is not.
    #[error("destination {path} is not empty")]
    NotEmpty { path: String },
    /// The archive stream is not a valid tar (or its compression is broken).
    #[error("bad archive: {0}")]
    BadArchive(String),
    /// The image (OCI layout or docker save tarball) is malformed.
    #[error("bad image: {0}")]
    BadImage(String),
    /// A blob's content does not match its digest or declared size.
    #[error("digest mismatch for {what}: expected {expected}, got {actual}")]
    DigestMismatch {
        what: String,
        expected: String,
        actual: String,
    },
}

impl ImageError {
    /// True when the input (archive, image, manifest) is at fault rather than the host or a
    /// race with a running sandbox: the API answers those with a 4xx status.
    pub fn is_input_error(&self) -> bool {
        !matches!(self, ImageError::Io { .. } | ImageError::Changed { .. })
    }

    pub(crate) fn io(
        op: &'static str,
        path: impl Into<String>,
        source: impl Into<io::Error>,
    ) -> Self {
        ImageError::Io {
            op,
            path: path.into(),
            source: source.into(),
        }
    }
}
