//! Sandbox lifecycle routes.

use super::{ApiJson, AppState, Owner};
use crate::api::Path;
use crate::error::ApiError;
use axum::Json;
use axum::extract::State;
use http::StatusCode;
use sandpit_api::*;
use sandpit_store::{SandboxFilter, SandboxRecord, SandboxState};
use serde::Deserialize;

/// The API view of a stored sandbox.
pub fn to_api(rec: &SandboxRecord, isolated: bool) -> Sandbox {
    Sandbox {
        id: rec.id.clone(),
        template: rec.template.clone(),
        runtime: rec.runtime.clone(),
        isolated,
        state: rec.state.as_str().to_string(),
        limits: Limits {
            cpu_millis: rec.cpu_millis as u64,
            memory_bytes: rec.memory_bytes as u64,
            disk_bytes: rec.disk_bytes as u64,
            max_processes: rec.max_processes as u64,
        },
        metadata: rec.metadata.clone(),
        created_at_ms: rec.created_at_ms,
        expires_at_ms: rec.expires_at_ms,
        error: rec.error.clone(),
        pool: rec.pool.clone(),
        lifecycle: sandpit_api::Lifecycle {
            idle_timeout: rec.life.idle_timeout_secs,
            on_timeout: match rec.life.on_timeout {
                sandpit_store::OnTimeout::Kill => "kill",
                sandpit_store::OnTimeout::Pause => "pause",
                sandpit_store::OnTimeout::Hibernate => "hibernate",
            }
            .into(),
            auto_resume: rec.life.auto_resume,
            last_activity_ms: rec.life.last_activity_ms,
            paused_at_ms: rec.life.paused_at_ms,
            snapshot: rec.life.snapshot.clone(),
        },
        // Filled in from the proxy's credentials by `crate::access::with_access`.
        secure: true,
        public: false,
        envd_access_token: None,
        traffic_access_token: None,
        network: None,
    }
}

fn bare_view(state: &AppState, rec: &SandboxRecord) -> Sandbox {
    let isolated = state.manager.is_isolated(&rec.runtime);
    let mut s = to_api(rec, isolated);
    s.network = state.manager.net().and_then(|n| n.policy_of(&rec.id));
    s
}

/// The owner's views of sandboxes, with their proxy tokens.
async fn views<'a>(
    state: &AppState,
    recs: impl IntoIterator<Item = &'a SandboxRecord>,
) -> Vec<Sandbox> {
    let mut v: Vec<Sandbox> = recs.into_iter().map(|r| bare_view(state, r)).collect();
    crate::access::with_access(&state.manager, &mut v).await;
    v
}

/// The owner's view of one sandbox, with its proxy tokens.
pub(crate) async fn view(state: &AppState, rec: &SandboxRecord) -> Sandbox {
    let mut v = views(state, [rec]).await;
    v.pop().unwrap_or_else(|| bare_view(state, rec))
}

/// Create a sandbox and wait until it runs.
#[utoipa::path(post, path = "/v1/sandboxes", request_body = CreateSandboxRequest,
    responses((status = 201, body = Sandbox), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody)))]
pub async fn create(
    State(state): State<AppState>,
    owner: Owner,
    ApiJson(req): ApiJson<CreateSandboxRequest>,
) -> Result<(StatusCode, Json<Sandbox>), ApiError> {
    let rec = state.manager.create(&owner.0, req).await?;
    Ok((StatusCode::CREATED, Json(view(&state, &rec).await)))
}

/// Query of the sandbox list.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// Comma-separated states.
    pub state: Option<String>,
    /// `key=value`; repeat for several (all must match).
    #[serde(default)]
    pub metadata: Vec<String>,
    pub limit: Option<u32>,
    pub cursor: Option<String>,
}

/// List the caller's sandboxes, newest last, a page at a time.
#[utoipa::path(get, path = "/v1/sandboxes", params(ListQuery), responses((status = 200, body = SandboxList), (status = 400, body = ErrorBody)))]
pub async fn list(
    State(state): State<AppState>,
    owner: Owner,
    uri: http::Uri,
) -> Result<Json<SandboxList>, ApiError> {
    // Repeated `metadata=` keys need a list-aware parser; serde_urlencoded takes only one.
    let mut q = ListQuery {
        state: None,
        metadata: Vec::new(),
        limit: None,
        cursor: None,
    };
    for (k, v) in form_pairs(uri.query().unwrap_or("")) {
        match k.as_str() {
            "state" => q.state = Some(v),
            "metadata" => q.metadata.push(v),
            "limit" => {
                q.limit = Some(
                    v.parse()
                        .map_err(|_| ApiError::bad_request("limit must be a number"))?,
                )
            }
            "cursor" => q.cursor = Some(v),
            other => {
                return Err(ApiError::bad_request(format!(
                    "unknown query parameter {other:?}"
                )));
            }
        }
    }
    let mut states = Vec::new();
    for s in q
        .state
        .iter()
        .flat_map(|s| s.split(','))
        .filter(|s| !s.is_empty())
    {
        states.push(
            s.parse::<SandboxState>()
                .map_err(|_| ApiError::bad_request(format!("unknown state {s:?}")))?,
        );
    }
    if states.is_empty() {
        // Sandboxes being torn down are already gone for callers, unless asked for.
        states = SandboxState::ALL
            .into_iter()
            .filter(|s| *s != SandboxState::Stopping)
            .collect();
    }
    let mut metadata = Vec::new();
    for m in &q.metadata {
        let (k, v) = m
            .split_once('=')
            .ok_or_else(|| ApiError::bad_request("metadata filters look like key=value"))?;
        metadata.push((k.to_string(), v.to_string()));
    }
    let filter = SandboxFilter {
        owner: Some(owner.0),
        states,
        metadata,
        limit: q.limit.unwrap_or(0),
        cursor: q.cursor,
        ..Default::default()
    };
    let page = state.store.list_sandboxes(&filter).await?;
    Ok(Json(SandboxList {
        items: views(&state, &page.items).await,
        next_cursor: page.next_cursor,
    }))
}

fn form_pairs(query: &str) -> Vec<(String, String)> {
    form_urlencoded::parse(query.as_bytes())
        .into_owned()
        .collect()
}

/// Get one sandbox.
#[utoipa::path(get, path = "/v1/sandboxes/{id}", responses((status = 200, body = Sandbox), (status = 404, body = ErrorBody)))]
pub async fn get(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
) -> Result<Json<Sandbox>, ApiError> {
    let rec = state.manager.get(&owner.0, &id).await?;
    Ok(Json(view(&state, &rec).await))
}

/// Destroy a sandbox: every process, mount, cgroup and directory goes.
#[utoipa::path(delete, path = "/v1/sandboxes/{id}", responses((status = 204), (status = 404, body = ErrorBody)))]
pub async fn delete(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    let rec = state.manager.get(&owner.0, &id).await?;
    state.manager.destroy(&rec).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Expire the sandbox `timeout` seconds from now.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/timeout", request_body = SetTimeoutRequest, responses((status = 204), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn set_timeout(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<SetTimeoutRequest>,
) -> Result<StatusCode, ApiError> {
    let rec = state.manager.get(&owner.0, &id).await?;
    state.manager.set_timeout(&rec, req.timeout).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Pause the sandbox: by default its processes are frozen with their memory
/// (`paused`); with `{"memory": false}` they end and only its files are kept
/// (`hibernated`). A call to a paused sandbox resumes it when its `auto_resume` is set.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/pause", request_body(content = Option<PauseRequest>),
    responses((status = 200, body = Sandbox), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody), (status = 501, body = ErrorBody)))]
pub async fn pause(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<Json<Sandbox>, ApiError> {
    // No body and `null` both mean the defaults.
    let req = super::json_or_default::<Option<PauseRequest>>(&body)?.unwrap_or_default();
    let rec = state.manager.get(&owner.0, &id).await?;
    let rec = state
        .manager
        .pause(&rec, req.memory.unwrap_or(true))
        .await?;
    Ok(Json(view(&state, &rec).await))
}

/// Resume a paused sandbox (thaw) or a hibernated one (started again on its files); a
/// running one is returned as it is.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/resume", responses((status = 200, body = Sandbox), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn resume(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
) -> Result<Json<Sandbox>, ApiError> {
    let rec = state.manager.get(&owner.0, &id).await?;
    let rec = state.manager.resume(&rec).await?;
    Ok(Json(view(&state, &rec).await))
}

/// Make independent copies of the sandbox's files, each a new sandbox with its own
/// processes, limits and identity.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/fork", request_body = ForkRequest,
    responses((status = 201, body = ForkResponse), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn fork(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<ForkRequest>,
) -> Result<(StatusCode, Json<ForkResponse>), ApiError> {
    let rec = state.manager.get(&owner.0, &id).await?;
    let made = state.manager.fork(&rec, &req).await?;
    Ok((
        StatusCode::CREATED,
        Json(ForkResponse {
            items: views(&state, &made).await,
        }),
    ))
}

/// Restart the sandbox's default lifetime from now.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/keepalive", responses((status = 204), (status = 404, body = ErrorBody)))]
pub async fn keepalive(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    let rec = state.manager.get(&owner.0, &id).await?;
    state
        .manager
        .usage()
        .log(&owner.0, &id, crate::usage::KEEPALIVE, 1, "");
    state
        .manager
        .set_timeout(
            &rec,
            crate::manager::DEFAULT_TIMEOUT.min(state.manager.config().max_timeout_secs),
        )
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Resource usage.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/stats", responses((status = 200, body = SandboxStats), (status = 404, body = ErrorBody), (status = 501, body = ErrorBody)))]
pub async fn stats(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
) -> Result<Json<SandboxStats>, ApiError> {
    let rec = state.manager.get(&owner.0, &id).await?;
    let (rt, h) = state.manager.runtime_of(&rec)?;
    let s = tokio::task::spawn_blocking(move || rt.stats(&h))
        .await
        .map_err(|e| ApiError::internal_from("the stats task failed", &e))??;
    Ok(Json(SandboxStats {
        cpu_usage_ns: s.cpu_usage_ns,
        memory_current_bytes: s.memory_current_bytes,
        memory_peak_bytes: s.memory_peak_bytes,
        pids_current: s.pids_current,
    }))
}

/// Daemon version and runtimes.
#[utoipa::path(get, path = "/v1/info", responses((status = 200, body = DaemonInfo)))]
pub async fn info(State(state): State<AppState>, _owner: Owner) -> Json<DaemonInfo> {
    let allow_process = state.manager.config().allow_process_runtime;
    let runtimes = state
        .manager
        .runtimes()
        .map(|(_, r)| r)
        .filter(|r| allow_process || r.capabilities().isolated)
        .map(|r| {
            let c = r.capabilities();
            RuntimeInfo {
                name: c.name.to_string(),
                isolated: c.isolated,
                freeze: c.freeze,
                stats: c.stats,
                enforces_memory: c.enforces_memory,
                enforces_disk: c.enforces_disk,
                enforces_processes: c.enforces_processes,
            }
        })
        .collect();
    Json(DaemonInfo {
        version: env!("CARGO_PKG_VERSION").to_string(),
        runtimes,
        default_runtime: state.manager.config().default_runtime.clone(),
        max_timeout: state.manager.config().max_timeout_secs,
    })
}
