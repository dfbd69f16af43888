//! Usage metering routes: per owner and period, per sandbox, and execution records.

use super::{ApiQuery, AppState, Owner};
use crate::api::Path;
use crate::error::ApiError;
use crate::manager::now_ms;
use axum::Json;
use axum::extract::State;
use http::StatusCode;
use sandpit_api::ErrorBody;
use sandpit_api::usage::*;
use sandpit_store::{ExecutionRecord, SandboxUsageRecord, active_ms};
use serde::Deserialize;
use std::time::Duration;

/// How long a usage read waits for queued usage to reach the store.
const FLUSH_WAIT: Duration = Duration::from_secs(5);

/// Query of `GET /v1/usage`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct UsageQuery {
    /// Start of the period, unix milliseconds (default: the beginning).
    pub from: Option<i64>,
    /// End of the period (exclusive), unix milliseconds (default: now).
    pub to: Option<i64>,
    /// Whose usage (admin key only; default: the caller's).
    pub owner: Option<String>,
}

/// What an owner used in a period: sandboxes, active seconds, CPU, executions, and the
/// usage log by reason.
#[utoipa::path(get, path = "/v1/usage", params(UsageQuery),
    responses((status = 200, body = UsageSummary), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody)))]
pub async fn summary(
    State(state): State<AppState>,
    owner: Owner,
    ApiQuery(q): ApiQuery<UsageQuery>,
) -> Result<Json<UsageSummary>, ApiError> {
    let who = match q.owner {
        Some(o) if o != owner.0 => {
            if owner.0 != super::pools::ADMIN_OWNER {
                return Err(ApiError::new(
                    StatusCode::FORBIDDEN,
                    "permission_denied",
                    "only the admin key may read another owner's usage",
                ));
            }
            o
        }
        _ => owner.0,
    };
    let from = q.from.unwrap_or(0);
    // A period that ends before it begins is empty (answered as such below).
    if from < 0 || q.to.is_some_and(|to| to < 0) {
        return Err(ApiError::bad_request(
            "from and to are unix milliseconds, not negative",
        ));
    }
    let m = &state.manager;
    // Fresh counters of running sandboxes, then everything queued, before reading; "now"
    // is taken after that, and includes its own millisecond, so that what was recorded
    // before this request is inside the default period.
    crate::usage::sample_live(m, Some(&who)).await;
    m.usage().flush(FLUSH_WAIT).await;
    let now = now_ms();
    let to = q.to.unwrap_or(now + 1).max(from);
    let u = state.store.owner_usage(&who, from, to).await?;
    let until = to.min(now);
    let active: i64 = u
        .sandboxes
        .iter()
        .map(|s| active_ms(&s.states, from, s.ended_at_ms.unwrap_or(until).min(until)))
        .sum();
    Ok(Json(UsageSummary {
        owner: who,
        from_ms: from,
        to_ms: to,
        sandboxes: u.sandboxes.len() as u64,
        active_seconds: active as f64 / 1000.0,
        cpu_time_ms: u64::try_from(u.cpu_ns / 1_000_000).unwrap_or(0),
        executions: u64::try_from(u.executions).unwrap_or(0),
        log: u
            .log
            .into_iter()
            .map(|(reason, count, amount)| {
                (
                    reason,
                    ReasonTotal {
                        count: u64::try_from(count).unwrap_or(0),
                        amount,
                    },
                )
            })
            .collect(),
    }))
}

/// The sandbox's metering row when the caller may see it. Usage outlives the sandbox, so
/// a deleted sandbox's usage is still readable by its owner.
async fn metered(
    state: &AppState,
    owner: &str,
    id: &str,
) -> Result<Option<SandboxUsageRecord>, ApiError> {
    match state.store.sandbox_usage(id).await? {
        Some(u) if u.owner == owner => Ok(Some(u)),
        Some(_) => Err(ApiError::sandbox_not_found(id)),
        // Not metered yet (or never): it must at least be one of the caller's sandboxes.
        None => Ok(state.manager.get(owner, id).await.map(|_| None)?),
    }
}

/// Metering of one sandbox: active seconds (paused time excluded), CPU, memory peak, disk
/// used; readable after the sandbox is gone.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/usage",
    responses((status = 200, body = SandboxUsage), (status = 404, body = ErrorBody)))]
pub async fn sandbox(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
) -> Result<Json<SandboxUsage>, ApiError> {
    let m = &state.manager;
    metered(&state, &owner.0, &id).await?;
    if let Ok(rec) = m.get(&owner.0, &id).await {
        crate::usage::sample_one(m, &rec).await;
    }
    m.usage().flush(FLUSH_WAIT).await;
    let Some(u) = metered(&state, &owner.0, &id).await? else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("sandbox {id} has no usage recorded yet"),
        ));
    };
    let end = u.ended_at_ms.unwrap_or_else(now_ms);
    let executions = state.store.count_executions(&id).await?;
    Ok(Json(SandboxUsage {
        sandbox_id: u.sandbox_id,
        owner: u.owner,
        state: u.state,
        created_at_ms: u.created_at_ms,
        ended_at_ms: u.ended_at_ms,
        active_seconds: active_ms(&u.states, 0, end) as f64 / 1000.0,
        wall_seconds: end.saturating_sub(u.created_at_ms).max(0) as f64 / 1000.0,
        cpu_time_ms: u64::try_from(u.cpu_ns / 1_000_000).unwrap_or(0),
        memory_peak_bytes: u64::try_from(u.memory_peak_bytes).unwrap_or(0),
        disk_used_bytes: u.disk_used_bytes.and_then(|d| u64::try_from(d).ok()),
        egress_bytes: u64::try_from(u.egress_bytes).unwrap_or(0),
        egress_note: EGRESS_NOTE.to_string(),
        executions: u64::try_from(executions).unwrap_or(0),
    }))
}

/// Query of the executions list.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ExecutionsQuery {
    /// Page size (default 100, at most 1000).
    pub limit: Option<u32>,
    pub cursor: Option<String>,
}

/// The API view of an execution record.
pub fn to_api(e: ExecutionRecord) -> Execution {
    let kb = e.memory_peak_kb.and_then(|k| u64::try_from(k).ok());
    Execution {
        execution_id: e.id,
        sandbox_id: e.sandbox_id,
        caller: ExecutionCaller {
            owner: e.owner,
            api_key_id: e.api_key_id,
        },
        command: e.command,
        pid: e.pid.and_then(|p| u32::try_from(p).ok()),
        background: e.background,
        timestamp: ExecutionTimes {
            created_ms: e.created_at_ms,
            started_ms: e.started_at_ms,
            ended_ms: e.ended_at_ms,
        },
        resources: ExecutionResources {
            cpu_time_ms: e.cpu_time_ms.and_then(|c| u64::try_from(c).ok()),
            memory_peak_mb: kb.map(|k| k.div_ceil(1024)),
            memory_peak_kb: kb,
            network_egress_kb: 0,
        },
        output: ExecutionOutput {
            stdout_bytes: u64::try_from(e.stdout_bytes).unwrap_or(0),
            stderr_bytes: u64::try_from(e.stderr_bytes).unwrap_or(0),
            exit_code: e.exit_code.and_then(|c| i32::try_from(c).ok()),
            timed_out: e.timed_out,
        },
    }
}

/// Execution records of a sandbox's commands, newest first, a page at a time.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/executions", params(ExecutionsQuery),
    responses((status = 200, body = ExecutionList), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn executions(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<ExecutionsQuery>,
) -> Result<Json<ExecutionList>, ApiError> {
    metered(&state, &owner.0, &id).await?;
    state.manager.usage().flush(FLUSH_WAIT).await;
    let page = state
        .store
        .list_executions(&id, q.limit.unwrap_or(0), q.cursor.as_deref())
        .await?;
    Ok(Json(ExecutionList {
        items: page.items.into_iter().map(to_api).collect(),
        next_cursor: page.next_cursor,
    }))
}
