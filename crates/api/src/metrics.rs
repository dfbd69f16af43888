//! Bodies of the metrics history route: `/v1/sandboxes/{id}/metrics`.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// One sample of a running sandbox's resources.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct MetricSample {
    /// When it was taken, unix milliseconds.
    pub at_ms: i64,
    /// Whole CPUs the sandbox may use (its CPU limit rounded up).
    pub cpu_count: u64,
    /// Share of its CPU limit used since the previous sample, 0 to 100.
    pub cpu_used_pct: f64,
    /// Memory in use other than the page cache, bytes.
    pub memory_used_bytes: u64,
    /// Its memory limit, bytes.
    pub memory_total_bytes: u64,
    /// Its page cache, bytes (with `memory_used_bytes`, what counts against the limit).
    pub memory_cache_bytes: u64,
    /// Bytes used in its writable layer.
    pub disk_used_bytes: u64,
    /// Size of its writable layer, bytes.
    pub disk_total_bytes: u64,
    /// Bytes it has received over its network link since the link was made (0 without
    /// one; a wake or restore makes a new link).
    pub net_rx_bytes: u64,
    /// Bytes it has sent over its network link, counted like `net_rx_bytes`.
    pub net_tx_bytes: u64,
}

/// `GET /v1/sandboxes/{id}/metrics`: the samples of a time range, oldest first. A sandbox
/// is sampled only while it runs: paused and hibernated time has no samples.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct SandboxMetrics {
    pub sandbox_id: String,
    /// Start of the range, unix milliseconds (inclusive).
    pub start_ms: i64,
    /// End of the range, unix milliseconds (exclusive).
    pub end_ms: i64,
    /// Seconds between two samples on this daemon.
    pub sample_interval_secs: u64,
    /// Seconds a sample is kept on this daemon.
    pub retention_secs: u64,
    pub samples: Vec<MetricSample>,
    /// Set when the range holds more samples than one answer carries: ask again with
    /// this as `start`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_start_ms: Option<i64>,
}
