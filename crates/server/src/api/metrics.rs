//! The metrics history of a sandbox: `GET /v1/sandboxes/{id}/metrics`, served from the
//! samples the core's sampler (`sandpit_core::metrics_history`) keeps in the store.

use super::{ApiQuery, AppState, Owner};
use crate::api::Path;
use crate::error::ApiError;
use crate::manager::now_ms;
use axum::extract::State;
use axum::routing::get;
use axum::{Json, Router};
use sandpit_api::ErrorBody;
use sandpit_api::metrics::{MetricSample, SandboxMetrics};
use serde::Deserialize;

/// The routes of this file.
pub fn routes() -> Router<AppState> {
    Router::new().route("/v1/sandboxes/{id}/metrics", get(history))
}

/// Query of `GET /v1/sandboxes/{id}/metrics`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct MetricsQuery {
    /// Start of the range, unix milliseconds, inclusive (default: the oldest sample kept).
    pub start: Option<i64>,
    /// End of the range, unix milliseconds, exclusive (default: now); not before `start`.
    pub end: Option<i64>,
}

/// The sandbox's resource samples in a time range, oldest first: CPU, memory, disk and
/// network, taken every `sample_interval_secs` while it runs (none while paused or
/// hibernated) and kept `retention_secs`. Reading them is not activity: it does not keep
/// the sandbox from idling out.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/metrics", params(MetricsQuery),
    responses((status = 200, body = SandboxMetrics), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn history(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<MetricsQuery>,
) -> Result<Json<SandboxMetrics>, ApiError> {
    let start = q.start.unwrap_or(0);
    // Includes the current millisecond, so a sample taken just now is in the default range.
    let end = q.end.unwrap_or_else(|| now_ms() + 1);
    let h = state
        .manager
        .metrics_history(&owner.0, &id, start, end)
        .await?;
    let next_start_ms = if h.truncated {
        h.samples.last().map(|s| s.at_ms + 1)
    } else {
        None
    };
    Ok(Json(SandboxMetrics {
        sandbox_id: id,
        start_ms: start,
        end_ms: end,
        sample_interval_secs: state.metrics.sample_interval_secs,
        retention_secs: state.metrics.retention_secs,
        samples: h.samples.iter().map(to_api).collect(),
        next_start_ms,
    }))
}

fn to_api(s: &sandpit_store::MetricSample) -> MetricSample {
    let n = |v: i64| u64::try_from(v).unwrap_or(0);
    MetricSample {
        at_ms: s.at_ms,
        cpu_count: n(s.cpu_count),
        cpu_used_pct: s.cpu_used_pct,
        memory_used_bytes: n(s.mem_used),
        memory_total_bytes: n(s.mem_total),
        memory_cache_bytes: n(s.mem_cache),
        disk_used_bytes: n(s.disk_used),
        disk_total_bytes: n(s.disk_total),
        net_rx_bytes: n(s.net_rx),
        net_tx_bytes: n(s.net_tx),
    }
}
