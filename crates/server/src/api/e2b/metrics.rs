//! E2B's metrics routes, served from the same history as `/v1/sandboxes/{id}/metrics`:
//! `GET /sandboxes/{id}/metrics?start&end` (the samples in range; E2B's times are unix
//! seconds) and `GET /sandboxes/metrics?sandbox_ids=` (the newest sample of each).

use super::types::Metric;
use super::{E2bError, rfc3339};
use crate::api::{AppState, Owner, Path};
use crate::manager::now_ms;
use axum::Json;
use axum::extract::State;
use serde::Serialize;
use std::collections::BTreeMap;

/// The answer of `GET /sandboxes/metrics`.
#[derive(Debug, Serialize)]
pub struct SandboxesWithMetrics {
    /// The newest sample of each running sandbox asked for that has one, by id.
    pub sandboxes: BTreeMap<String, Metric>,
}

/// The query's pairs, percent-decoded.
fn query_pairs(uri: &http::Uri) -> Vec<(String, String)> {
    form_urlencoded::parse(uri.query().unwrap_or("").as_bytes())
        .into_owned()
        .collect()
}

/// A time of the query in unix seconds, as milliseconds.
fn seconds(name: &str, v: &str) -> Result<i64, E2bError> {
    let bad = || E2bError::bad_request(format!("{name} must be a unix time in seconds, not {v:?}"));
    let s: i64 = v.trim().parse().map_err(|_| bad())?;
    if s < 0 {
        return Err(bad());
    }
    s.checked_mul(1000).ok_or_else(bad)
}

/// `GET /sandboxes/{id}/metrics`: the sandbox's samples with `start <= t <= end` (whole
/// seconds, both ends included as E2B's SDKs round), oldest first; by default all of them.
pub async fn sandbox(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
    uri: http::Uri,
) -> Result<Json<Vec<Metric>>, E2bError> {
    let (mut start, mut end) = (None, None);
    for (k, v) in query_pairs(&uri) {
        match k.as_str() {
            "start" => start = Some(seconds("start", &v)?),
            "end" => end = Some(seconds("end", &v)?),
            // Unknown parameters are ignored, as E2B's API does.
            _ => {}
        }
    }
    let start_ms = start.unwrap_or(0);
    // The whole `end` second is in the range.
    let end_ms = match end {
        Some(e) => e.saturating_add(1000),
        None => now_ms() + 1,
    };
    if let (Some(s), Some(e)) = (start, end)
        && e < s
    {
        return Err(E2bError::bad_request(format!(
            "end ({}) is before start ({})",
            e / 1000,
            s / 1000
        )));
    }
    let h = state
        .manager
        .metrics_history(&owner.0, &id, start_ms, end_ms)
        .await?;
    Ok(Json(h.samples.iter().map(to_e2b).collect()))
}

/// `GET /sandboxes/metrics?sandbox_ids=a,b`: the newest sample of each of the caller's
/// running sandboxes named; others (unknown, not the caller's, not running, no sample
/// yet) are left out.
pub async fn batch(
    State(state): State<AppState>,
    owner: Owner,
    uri: http::Uri,
) -> Result<Json<SandboxesWithMetrics>, E2bError> {
    let mut ids: Option<Vec<String>> = None;
    for (k, v) in query_pairs(&uri) {
        if k == "sandbox_ids" {
            let list = ids.get_or_insert_with(Vec::new);
            list.extend(
                v.split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(str::to_string),
            );
        }
    }
    let Some(mut ids) = ids else {
        return Err(E2bError::bad_request("sandbox_ids is required"));
    };
    ids.sort();
    ids.dedup();
    let latest = state.manager.latest_metrics(&owner.0, &ids).await?;
    Ok(Json(SandboxesWithMetrics {
        sandboxes: latest
            .iter()
            .map(|s| (s.sandbox_id.clone(), to_e2b(s)))
            .collect(),
    }))
}

/// A sample in E2B's shape.
fn to_e2b(s: &sandpit_store::MetricSample) -> Metric {
    let n = |v: i64| u64::try_from(v).unwrap_or(0);
    Metric {
        timestamp: rfc3339(s.at_ms),
        timestamp_unix: s.at_ms.div_euclid(1000),
        cpu_count: n(s.cpu_count),
        cpu_used_pct: s.cpu_used_pct,
        mem_used: n(s.mem_used),
        mem_total: n(s.mem_total),
        mem_cache: n(s.mem_cache),
        disk_used: n(s.disk_used),
        disk_total: n(s.disk_total),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_whole_non_negative_seconds() {
        assert_eq!(seconds("start", "1700000000").unwrap(), 1_700_000_000_000);
        assert_eq!(seconds("start", " 0 ").unwrap(), 0);
        for bad in [
            "",
            "-1",
            "1.5",
            "abc",
            "1e9",
            "99999999999999999999",
            "9223372036854776",
        ] {
            let e = seconds("start", bad).unwrap_err();
            assert_eq!(e.0.status, http::StatusCode::BAD_REQUEST, "{bad:?}");
        }
    }

    #[test]
    fn samples_take_e2b_field_names_and_second_timestamps() {
        let s = sandpit_store::MetricSample {
            sandbox_id: "x".into(),
            at_ms: 1_700_000_000_999,
            cpu_count: 2,
            cpu_used_pct: 12.5,
            mem_used: 1,
            mem_total: 2,
            mem_cache: 3,
            disk_used: 4,
            disk_total: 5,
            net_rx: 6,
            net_tx: 7,
        };
        let v = serde_json::to_value(to_e2b(&s)).unwrap();
        assert_eq!(
            v,
            serde_json::json!({
                "timestamp": "2023-11-14T22:13:20.999Z",
                "timestampUnix": 1_700_000_000,
                "cpuCount": 2, "cpuUsedPct": 12.5,
                "memUsed": 1, "memTotal": 2, "memCache": 3,
                "diskUsed": 4, "diskTotal": 5,
            })
        );
    }
}
