//! Bodies of the per-user lease routes under `/v1/leases`.

use crate::Sandbox;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// A user's lease on one warm sandbox (the seed's `sb_container` row).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct Lease {
    /// Caller-chosen user name (unique per owner).
    pub user: String,
    /// The user's sandbox; absent while it is being created or before the first one.
    pub sandbox_id: Option<String>,
    /// `creating` or `ready`.
    pub status: String,
    /// Whether the sandbox is paused now.
    pub paused: bool,
    /// Runtime of the sandbox.
    pub runtime: String,
    /// Optimistic lock counter; every write of the lease bumps it.
    pub lock_version: i64,
    /// Active (running, not paused) seconds of every sandbox this lease has held.
    pub total_usage_seconds: f64,
    /// Last acquire, unix milliseconds.
    pub last_activity_ms: i64,
    /// Unix milliseconds.
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
}

/// `POST /v1/leases/{user}/acquire`: the lease and its running sandbox.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Acquired {
    pub lease: Lease,
    pub sandbox: Sandbox,
    /// True for the one acquirer that created this sandbox.
    pub created: bool,
    /// True if this acquire resumed a paused sandbox.
    pub resumed: bool,
}

/// `GET /v1/leases`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct LeaseList {
    pub items: Vec<Lease>,
}
