//! Layers of sandbox filesystems: manifests of overlayfs stacks, layer archives for
//! snapshots (zstd tar with OCI whiteouts), layer copies for fork and hibernate, and OCI
//! image import for templates.
//!
//! Every archive member and every name in a live upper is untrusted: nothing here follows a
//! symlink, and every path is resolved beneath its root with `openat2`.
#![forbid(unsafe_code)]

mod archive;
mod context;
mod copy;
mod error;
mod fsx;
mod manifest;
mod oci;

pub use archive::{
    LayerStats, UnpackLimits, UnpackStats, apply_oci_layer, unpack_layer, write_layer,
};
pub use context::{ContextLimits, CopySpec, Selection, select_context};
pub use copy::{CopyStats, copy_layer, merge_layer};
pub use error::ImageError;
pub use manifest::{Entry, EntryKind, ID_RANGE, Layer, Manifest, ManifestDiff, Stack, WalkStats};
pub use oci::{ImageConfig, ImportProgress, import_image, import_image_with};

#[cfg(test)]
mod tests;
