//! E2B's template and snapshot routes. E2B treats a snapshot as a template: sandboxes start
//! from it by id, and deleting it goes through `DELETE /templates/{id}`.

use super::types::{self, SnapshotInfo};
use super::{Body, E2bError, ENVD_VERSION, rfc3339};
use crate::api::{AppState, Owner};
use axum::Json;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use http::{HeaderMap, HeaderValue, StatusCode};
use sandpit_api::Template;

/// `POST /sandboxes/{id}/snapshots`: a full snapshot of the sandbox's files. Memory is not
/// captured (`memory: true` is refused rather than quietly dropped).
pub async fn snapshot(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
    Body(req): Body<types::SnapshotRequest>,
) -> Result<(StatusCode, Json<SnapshotInfo>), E2bError> {
    if req.memory == Some(true) {
        return Err(E2bError::bad_request(
            "sandpit snapshots hold files, not memory: leave memory unset or false",
        ));
    }
    let rec = super::sandboxes::live(&state, &owner, &id).await?;
    let snap = state
        .manager
        .snapshot(
            &rec,
            &sandpit_api::CreateSnapshotRequest {
                name: req.name,
                incremental: false,
            },
        )
        .await?;
    Ok((
        StatusCode::CREATED,
        Json(SnapshotInfo {
            snapshot_id: snap.id,
            names: vec![snap.name],
        }),
    ))
}

/// `GET /snapshots?sandboxID&name&limit&nextToken`: the caller's snapshots, newest first.
pub async fn list_snapshots(
    State(state): State<AppState>,
    owner: Owner,
    uri: http::Uri,
) -> Result<Response, E2bError> {
    let (mut sandbox, mut name, mut limit, mut offset) = (None, None, 100usize, 0usize);
    for (k, v) in form_urlencoded::parse(uri.query().unwrap_or("").as_bytes()).into_owned() {
        match k.as_str() {
            "sandboxID" => sandbox = Some(v),
            "name" => name = Some(v),
            "limit" => {
                limit = v
                    .parse()
                    .ok()
                    .filter(|n| (1..=1000).contains(n))
                    .ok_or_else(|| E2bError::bad_request("limit must be between 1 and 1000"))?
            }
            "nextToken" => {
                offset = v
                    .parse()
                    .map_err(|_| E2bError::bad_request("invalid nextToken"))?
            }
            other => {
                return Err(E2bError::bad_request(format!(
                    "unknown query parameter {other:?}"
                )));
            }
        }
    }
    let all: Vec<_> = state
        .store
        .list_snapshots(Some(&owner.0))
        .await?
        .into_iter()
        .filter(|s| sandbox.as_deref().is_none_or(|id| s.sandbox_id == id))
        .filter(|s| name.as_deref().is_none_or(|n| s.name == n))
        .collect();
    let page: Vec<SnapshotInfo> = all
        .iter()
        .skip(offset)
        .take(limit)
        .map(|s| SnapshotInfo {
            snapshot_id: s.id.clone(),
            names: vec![s.name.clone()],
        })
        .collect();
    let mut headers = HeaderMap::new();
    if offset + page.len() < all.len()
        && let Ok(v) = HeaderValue::from_str(&(offset + page.len()).to_string())
    {
        headers.insert("x-next-token", v);
    }
    Ok((headers, Json(page)).into_response())
}

fn to_e2b(state: &AppState, t: &Template, with_builds: bool) -> types::Template {
    let aliases: Vec<String> = state
        .e2b
        .templates
        .iter()
        .filter(|(_, to)| **to == t.name)
        .map(|(alias, _)| alias.clone())
        .collect();
    let status = match t.state.as_str() {
        "ready" => "ready",
        "building" => "building",
        _ => "error",
    };
    let build_id = t.build_id.clone().unwrap_or_else(|| t.name.clone());
    types::Template {
        template_id: t.name.clone(),
        build_id: build_id.clone(),
        cpu_count: 1,
        memory_mb: 512,
        disk_size_mb: t.size_bytes >> 20,
        public: true,
        names: std::iter::once(t.name.clone())
            .chain(aliases.iter().cloned())
            .collect(),
        aliases,
        created_at: rfc3339(t.created_at_ms),
        updated_at: rfc3339(t.updated_at_ms),
        created_by: None,
        last_spawned_at: None,
        spawn_count: 0,
        build_count: 1,
        envd_version: ENVD_VERSION.into(),
        build_status: status.into(),
        builds: with_builds.then(|| {
            vec![types::TemplateBuild {
                build_id,
                status: status.into(),
                created_at: rfc3339(t.created_at_ms),
                updated_at: rfc3339(t.updated_at_ms),
                cpu_count: 1,
                memory_mb: 512,
            }]
        }),
    }
}

async fn all_templates(state: &AppState, owner: Owner) -> Result<Vec<Template>, E2bError> {
    Ok(crate::api::templates::list(State(state.clone()), owner)
        .await?
        .0)
}

/// `GET /templates`: sandpit's templates, each with the E2B aliases that stand for it.
pub async fn list(
    State(state): State<AppState>,
    owner: Owner,
) -> Result<Json<Vec<types::Template>>, E2bError> {
    let all = all_templates(&state, owner.clone()).await?;
    let mut out = Vec::new();
    for t in &all {
        // A build's own template shows as the E2B template it belongs to (below).
        if state.store.e2b_build_owner(&t.name).await?.is_none() {
            out.push(to_e2b(&state, t, false));
        }
    }
    out.extend(super::builds::list(&state, &owner).await?);
    Ok(Json(out))
}

/// The sandpit template an E2B template id or alias stands for.
fn target<'a>(state: &'a AppState, id: &'a str) -> &'a str {
    state.e2b.templates.get(id).map_or(id, String::as_str)
}

/// `GET /templates/{id}` (an id or an alias).
pub async fn get(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
) -> Result<Json<types::Template>, E2bError> {
    if let Some(t) = super::builds::describe(&state, &owner, &id).await? {
        return Ok(Json(t));
    }
    let name = target(&state, &id).to_string();
    let t = crate::api::templates::get(State(state.clone()), owner, crate::api::Path(name)).await?;
    Ok(Json(to_e2b(&state, &t.0, true)))
}

/// `GET /templates/aliases/{alias}`.
pub async fn alias(
    State(state): State<AppState>,
    owner: Owner,
    Path(alias): Path<String>,
) -> Result<Json<types::TemplateAlias>, E2bError> {
    if let Some(t) = state.store.e2b_template(&owner.0, &alias).await? {
        return Ok(Json(types::TemplateAlias {
            template_id: t.id,
            public: false,
        }));
    }
    let name = target(&state, &alias).to_string();
    let t = crate::api::templates::get(State(state.clone()), owner, crate::api::Path(name)).await?;
    Ok(Json(types::TemplateAlias {
        template_id: t.0.name,
        public: true,
    }))
}

/// `DELETE /templates/{id}`: deletes one of the caller's snapshots (how E2B's SDKs delete
/// snapshots), or a template (admin only).
pub async fn delete(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
) -> Result<StatusCode, E2bError> {
    if super::builds::delete(&state, &owner, &id).await? {
        return Ok(StatusCode::NO_CONTENT);
    }
    if let Some(s) = state.store.get_snapshot(&owner.0, &id).await? {
        state
            .manager
            .delete_snapshot(&owner.0, &s.id, false)
            .await?;
        return Ok(StatusCode::NO_CONTENT);
    }
    if state.e2b.templates.contains_key(&id) {
        return Err(E2bError::bad_request(format!(
            "{id} is an alias in the daemon's [e2b] config, not a template to delete"
        )));
    }
    Ok(crate::api::templates::delete(State(state.clone()), owner, crate::api::Path(id)).await?)
}
