//! Bodies of the volume routes under `/v1/volumes`.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// `POST /v1/volumes`: a named persistent directory with a size limit.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateVolumeRequest {
    /// 1 to 63 characters of `[a-z0-9_-]`, starting with a letter or digit; unique per owner.
    pub name: String,
    /// Size of the volume's file system (16 MiB to 1 TiB); writes past it fail with ENOSPC.
    pub size_bytes: u64,
}

/// A volume as the API shows it.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Volume {
    pub name: String,
    pub size_bytes: u64,
    /// `ready`, or `creating` / `deleting` while that is under way.
    pub state: String,
    /// Bytes in use (file data and file system metadata); absent unless ready (or when
    /// the host cannot mount it just now).
    pub used_bytes: Option<u64>,
    /// Bytes that can still be written; absent when `used_bytes` is.
    pub available_bytes: Option<u64>,
    /// Unix milliseconds.
    pub created_at_ms: i64,
    /// Sandboxes that have it mounted now; it cannot be deleted while there are any.
    pub in_use_by: Vec<String>,
}

/// `GET /v1/volumes`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct VolumeList {
    pub items: Vec<Volume>,
}

/// A volume to mount into a new sandbox (`CreateSandboxRequest.volumes`).
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct VolumeMountSpec {
    /// Name of one of the caller's volumes.
    pub name: String,
    /// Absolute mount path inside the sandbox (not `/`, nor under `/proc`, `/sys`, `/dev`
    /// or `/.sandpit`); missing directories are created.
    pub path: String,
    #[serde(default)]
    pub read_only: bool,
}
