//! E2B's sandbox routes.

use super::types::{self, ListedSandbox, SandboxDetail};
use super::{Body, CLIENT_ID, E2bError, ENVD_VERSION, Required, rfc3339};
use crate::api::{AppState, Owner};
use crate::error::ApiError;
use crate::manager::now_ms;
use axum::Json;
use axum::extract::{Path, State};
use http::StatusCode;
use sandpit_api::{CreateSandboxRequest, VolumeMountSpec};
use sandpit_store::{OnTimeout, SandboxFilter, SandboxRecord, SandboxState};

/// E2B shows two states: frozen and hibernated sandboxes are both `paused`.
fn e2b_state(s: SandboxState) -> Option<&'static str> {
    match s {
        SandboxState::Creating | SandboxState::Running => Some("running"),
        SandboxState::Paused | SandboxState::Hibernated => Some("paused"),
        _ => None,
    }
}

/// The sandbox of `owner` as E2B sees it: stopped and failed ones no longer exist.
pub(super) async fn live(
    state: &AppState,
    owner: &Owner,
    id: &str,
) -> Result<SandboxRecord, E2bError> {
    let rec = state.manager.get(&owner.0, id).await?;
    if e2b_state(rec.state).is_none() {
        return Err(ApiError::sandbox_not_found(id).into());
    }
    Ok(rec)
}

async fn created(state: &AppState, rec: &SandboxRecord) -> Result<types::Sandbox, E2bError> {
    let access = crate::api::e2b::access(state, rec).await?;
    Ok(types::Sandbox {
        template_id: rec.template.clone(),
        sandbox_id: rec.id.clone(),
        client_id: CLIENT_ID.into(),
        alias: rec.template.clone(),
        envd_version: ENVD_VERSION.into(),
        envd_access_token: access.envd_token,
        traffic_access_token: access.traffic_token,
        domain: access.domain,
    })
}

pub(super) fn listed(rec: &SandboxRecord) -> ListedSandbox {
    ListedSandbox {
        template_id: rec.template.clone(),
        sandbox_id: rec.id.clone(),
        client_id: CLIENT_ID.into(),
        alias: rec.template.clone(),
        started_at: rfc3339(rec.created_at_ms),
        end_at: rfc3339(rec.expires_at_ms),
        cpu_count: (rec.cpu_millis.max(1) as u64).div_ceil(1000),
        memory_mb: rec.memory_bytes.max(0) as u64 >> 20,
        disk_size_mb: rec.disk_bytes.max(0) as u64 >> 20,
        state: e2b_state(rec.state).unwrap_or("running"),
        envd_version: ENVD_VERSION.into(),
        metadata: rec.metadata.clone(),
        // Filled in by the detail view, which reads the mounts from the store.
        volume_mounts: Vec::new(),
    }
}

/// `POST /sandboxes`, `POST /v2/sandboxes`: create and wait until it runs.
pub async fn create(
    State(state): State<AppState>,
    owner: Owner,
    Required(req): Required<types::NewSandbox>,
) -> Result<(StatusCode, Json<types::Sandbox>), E2bError> {
    super::lifecycle::check_mcp(req.mcp.as_ref())?;
    if req.iam.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(E2bError::bad_request("iam is not supported by sandpit"));
    }
    // Without networking on this daemon, only an explicit request for it is an error.
    let default_internet = state.e2b.internet_by_default && state.manager.net().is_some();
    let network = crate::api::e2b::network_spec(&req, default_internet)?;
    let rules = super::rules::of_create(req.network.as_ref())?;
    super::rules::check(&state, &owner.0, rules.as_ref()).await?;
    if let Some(mounts) = &req.volume_mounts {
        super::volumes::check_mounts(mounts)?;
    }
    let (template, snapshot) = resolve_template(&state, &owner, &req.template_id).await?;
    let life = super::lifecycle::lifecycle_of(&req);
    let create = CreateSandboxRequest {
        template,
        snapshot,
        timeout: req.timeout,
        env: req.env_vars.unwrap_or_default(),
        metadata: req.metadata.unwrap_or_default(),
        volumes: req
            .volume_mounts
            .unwrap_or_default()
            .into_iter()
            .map(|v| VolumeMountSpec {
                name: v.name,
                path: v.path,
                read_only: false,
            })
            .collect(),
        idle_timeout: Some(state.e2b.idle_timeout_secs),
        on_timeout: Some(life.on_timeout.to_string()),
        auto_resume: Some(life.auto_resume),
        sudo: Some(state.e2b.sudo),
        ..Default::default()
    };
    let mut create = crate::api::e2b::apply_access(create, req.secure, network);
    create.public = Some(super::lifecycle::public_ports(
        create.public,
        state.e2b.public_ports,
    ));
    let rec = state.manager.create(&owner.0, create).await?;
    if rules.is_some()
        && let Err(e) = super::rules::install(&state, &rec.id, &owner.0, rules).await
    {
        // No sandbox without the rules it was asked with.
        if let Err(d) = state.manager.destroy(&rec).await {
            tracing::warn!(id = %rec.id, error = %d.chain(), "removing a sandbox whose rules failed");
        }
        return Err(e);
    }
    Ok((StatusCode::CREATED, Json(created(&state, &rec).await?)))
}

/// An E2B template id names a configured alias, one of the caller's snapshots (E2B starts
/// sandboxes from snapshots by passing the snapshot as the template), or a template.
async fn resolve_template(
    state: &AppState,
    owner: &Owner,
    id: &str,
) -> Result<(Option<String>, Option<String>), E2bError> {
    if id.is_empty() {
        return Err(E2bError::bad_request("templateID is required"));
    }
    if let Some(t) = state.e2b.templates.get(id) {
        return Ok((Some(t.clone()), None));
    }
    if let Some(s) = state.store.get_snapshot(&owner.0, id).await? {
        return Ok((None, Some(s.id)));
    }
    if let Some(t) = super::builds::resolve(state, &owner.0, id).await? {
        return Ok((Some(t), None));
    }
    Ok((Some(id.to_string()), None))
}

/// Metadata filters come as one url-encoded query value `k=v&k2=v2` whose keys and values
/// are url-encoded once more.
pub(super) fn metadata_filter(raw: &str) -> Vec<(String, String)> {
    form_urlencoded::parse(raw.as_bytes())
        .into_owned()
        .map(|(k, v)| {
            let dec = |s: &str| {
                form_urlencoded::parse(format!("x={s}").as_bytes())
                    .next()
                    .map(|(_, v)| v.into_owned())
                    .unwrap_or_default()
            };
            (dec(&k), dec(&v))
        })
        .collect()
}

pub(super) fn query_pairs(uri: &http::Uri) -> Vec<(String, String)> {
    form_urlencoded::parse(uri.query().unwrap_or("").as_bytes())
        .into_owned()
        .collect()
}

/// `GET /sandboxes` (the older list): running sandboxes, filtered by metadata.
pub async fn list_running(
    State(state): State<AppState>,
    owner: Owner,
    uri: http::Uri,
) -> Result<Json<Vec<ListedSandbox>>, E2bError> {
    let mut filter = SandboxFilter {
        owner: Some(owner.0.clone()),
        states: vec![SandboxState::Running],
        limit: 1000,
        ..Default::default()
    };
    for (k, v) in query_pairs(&uri) {
        match k.as_str() {
            "metadata" => filter.metadata.extend(metadata_filter(&v)),
            other => {
                return Err(E2bError::bad_request(format!(
                    "unknown query parameter {other:?}"
                )));
            }
        }
    }
    let mut out = Vec::new();
    loop {
        let page = state.store.list_sandboxes(&filter).await?;
        out.extend(page.items.iter().map(listed));
        match page.next_cursor {
            Some(c) => filter.cursor = Some(c),
            None => break,
        }
    }
    Ok(Json(out))
}

/// `GET /sandboxes/{id}`.
pub async fn detail(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
) -> Result<Json<SandboxDetail>, E2bError> {
    let rec = live(&state, &owner, &id).await?;
    let access = crate::api::e2b::access(&state, &rec).await?;
    let mut listed = listed(&rec);
    listed.volume_mounts = state
        .store
        .sandbox_volumes(&rec.id)
        .await?
        .into_iter()
        .map(|(v, a)| types::VolumeMount {
            name: v.name,
            path: a.path,
        })
        .collect();
    Ok(Json(SandboxDetail {
        listed,
        envd_access_token: access.envd_token,
        domain: access.domain,
        lifecycle: types::Lifecycle {
            auto_resume: rec.life.auto_resume,
            on_timeout: match rec.life.on_timeout {
                OnTimeout::Kill => "kill",
                OnTimeout::Pause | OnTimeout::Hibernate => "pause",
            }
            .into(),
        },
        allow_internet_access: access.internet,
        network: super::rules::shown(&state, &rec.id),
    }))
}

/// `DELETE /sandboxes/{id}`.
pub async fn kill(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
) -> Result<StatusCode, E2bError> {
    let rec = live(&state, &owner, &id).await?;
    state.manager.destroy(&rec).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Keeps the sandbox at least `secs` more seconds; never shortens its life.
async fn extend(state: &AppState, rec: &SandboxRecord, secs: u64) -> Result<(), E2bError> {
    let left = u64::try_from((rec.expires_at_ms - now_ms()) / 1000).unwrap_or(0);
    if secs > left {
        state.manager.set_timeout(rec, secs).await?;
    }
    Ok(())
}

/// `POST /sandboxes/{id}/refreshes`: keep it alive `duration` seconds (default 60) more.
pub async fn refresh(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
    Body(req): Body<types::RefreshRequest>,
) -> Result<StatusCode, E2bError> {
    let rec = live(&state, &owner, &id).await?;
    extend(&state, &rec, req.duration.unwrap_or(60)).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /sandboxes/{id}/pause`: 204, or 409 when it is not running. `memory: false`
/// keeps only the files (sandpit's hibernation).
pub async fn pause(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
    Body(req): Body<types::PauseRequest>,
) -> Result<StatusCode, E2bError> {
    let rec = live(&state, &owner, &id).await?;
    if rec.state != SandboxState::Running {
        return Err(E2bError::new(
            StatusCode::CONFLICT,
            format!("sandbox {id} is already paused"),
        ));
    }
    state
        .manager
        .pause(&rec, req.memory.unwrap_or(true))
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Brings a paused sandbox back; `memory: false` restarts its processes on its files.
async fn wake(
    state: &AppState,
    rec: &SandboxRecord,
    memory: Option<bool>,
) -> Result<SandboxRecord, E2bError> {
    let rec = if memory == Some(false) && rec.state == SandboxState::Paused {
        state.manager.hibernate(rec).await?
    } else {
        rec.clone()
    };
    Ok(state.manager.resume(&rec).await?)
}

/// Refuses a timeout the daemon would refuse, before a paused sandbox is woken for it.
fn check_timeout(state: &AppState, timeout: Option<u64>) -> Result<(), E2bError> {
    if let Some(t) = timeout {
        state.manager.timeout(Some(t))?;
    }
    Ok(())
}

/// `POST /sandboxes/{id}/connect` (and `/v2/...`): 200 with the sandbox when it runs, 201
/// when this call resumed it. Its timeout is raised to `timeout` if that is later.
pub async fn connect(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
    Body(req): Body<types::ConnectRequest>,
) -> Result<(StatusCode, Json<types::Sandbox>), E2bError> {
    let rec = live(&state, &owner, &id).await?;
    check_timeout(&state, req.timeout)?;
    let (status, rec) = match rec.state {
        SandboxState::Paused | SandboxState::Hibernated => {
            (StatusCode::CREATED, wake(&state, &rec, req.memory).await?)
        }
        _ => (StatusCode::OK, rec),
    };
    if let Some(t) = req.timeout {
        extend(&state, &rec, t).await?;
    }
    Ok((status, Json(created(&state, &rec).await?)))
}

/// `POST /sandboxes/{id}/resume` (the older call): 201, or 409 when it already runs.
pub async fn resume(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
    Body(req): Body<types::ConnectRequest>,
) -> Result<(StatusCode, Json<types::Sandbox>), E2bError> {
    let rec = live(&state, &owner, &id).await?;
    if !matches!(rec.state, SandboxState::Paused | SandboxState::Hibernated) {
        return Err(E2bError::new(
            StatusCode::CONFLICT,
            format!("sandbox {id} is already running"),
        ));
    }
    check_timeout(&state, req.timeout)?;
    let rec = wake(&state, &rec, req.memory).await?;
    if let Some(t) = req.timeout {
        state.manager.set_timeout(&rec, t).await?;
    }
    Ok((StatusCode::CREATED, Json(created(&state, &rec).await?)))
}

/// `POST /sandboxes/{id}/fork`: copies of its files, each a new running sandbox.
pub async fn fork(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
    Body(req): Body<types::ForkRequest>,
) -> Result<(StatusCode, Json<Vec<types::ForkResult>>), E2bError> {
    let rec = live(&state, &owner, &id).await?;
    let made = state
        .manager
        .fork(
            &rec,
            &sandpit_api::ForkRequest {
                count: req.count,
                timeout: req.timeout,
                ..Default::default()
            },
        )
        .await?;
    let mut out = Vec::with_capacity(made.len());
    for r in &made {
        out.push(types::ForkResult {
            sandbox: Some(created(&state, r).await?),
            error: None,
        });
    }
    Ok((StatusCode::CREATED, Json(out)))
}

/// `PUT /sandboxes/{id}/network`: replaces the sandbox's egress policy; new connections
/// follow it at once.
pub async fn update_network(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
    Required(req): Required<crate::api::e2b::E2bNetwork>,
) -> Result<StatusCode, E2bError> {
    let rec = live(&state, &owner, &id).await?;
    // The update replaces the whole configuration: no rules in it clears them. Its body
    // has no maskRequestHost (E2B's SDKs send none), so the create's stays unless given.
    let rules = super::rules::parse(req.rules.as_ref())?;
    let given = super::rules::mask(
        req.mask_request_host
            .as_ref()
            .map(|m| serde_json::Value::String(m.clone()))
            .as_ref(),
    )?;
    let mask = given.or_else(|| state.broker.mask_request_host(&rec.id));
    let rules = super::rules::with_mask(rules, mask);
    super::rules::check(&state, &owner.0, rules.as_ref()).await?;
    if let Some(policy) = crate::api::e2b::network_update(&req)? {
        let _applied = crate::api::network::set_policy(
            State(state.clone()),
            owner,
            crate::api::Path(id),
            crate::api::ApiJson(policy),
        )
        .await?;
    }
    super::rules::install(&state, &rec.id, &rec.owner, rules).await?;
    Ok(StatusCode::NO_CONTENT)
}
