//! Template routes. Anyone may list templates and follow a build; building and removing
//! templates is for the admin key, since a build reads host paths and runs debootstrap.

use super::{ApiJson, ApiQuery, AppState, Owner};
use crate::api::Path;
use crate::error::ApiError;
use crate::templates::{host_template, to_api};
use axum::Json;
use axum::extract::State;
use http::StatusCode;
use sandpit_api::{BuildTemplateRequest, ErrorBody, Template, TemplateBuild};
use std::time::Duration;

/// Templates sandboxes can start from (`host` first), with their build state.
#[utoipa::path(get, path = "/v1/templates", responses((status = 200, body = Vec<Template>)))]
pub async fn list(
    State(state): State<AppState>,
    owner: Owner,
) -> Result<Json<Vec<Template>>, ApiError> {
    let mut out = vec![host_template()];
    for rec in state.store.list_templates().await? {
        if visible(&state, &owner, &rec.name).await? {
            out.push(to_api(rec));
        }
    }
    Ok(Json(out))
}

/// 404, as for a template that does not exist, unless `owner` may see template `name`.
async fn require_visible(state: &AppState, owner: &Owner, name: &str) -> Result<(), ApiError> {
    if visible(state, owner, name).await? {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("template {name:?} not found"),
        ))
    }
}

/// Whether `owner` may see template `name`: a template an E2B build made belongs to the
/// team that built it (its name can say what they work on); the admin sees every one.
async fn visible(state: &AppState, owner: &Owner, name: &str) -> Result<bool, ApiError> {
    if owner.0 == super::pools::ADMIN_OWNER {
        return Ok(true);
    }
    Ok(state
        .store
        .e2b_build_owner(name)
        .await?
        .is_none_or(|built_by| built_by == owner.0))
}

/// One template: its settings, source, size and build state.
#[utoipa::path(get, path = "/v1/templates/{name}", responses((status = 200, body = Template), (status = 404, body = ErrorBody)))]
pub async fn get(
    State(state): State<AppState>,
    owner: Owner,
    Path(name): Path<String>,
) -> Result<Json<Template>, ApiError> {
    if name == "host" {
        return Ok(Json(host_template()));
    }
    require_visible(&state, &owner, &name).await?;
    let rec = state.manager.templates().get(&state.store, &name).await?;
    Ok(Json(to_api(rec)))
}

/// Build a template (admin) from a directory or an OCI image / `docker save` tarball on the
/// daemon's host, with debootstrap, or from a snapshot of a sandbox that ran setup
/// commands; answers at once, the build goes on in the background.
#[utoipa::path(post, path = "/v1/templates", request_body = BuildTemplateRequest,
    responses((status = 202, body = Template), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody), (status = 409, body = ErrorBody), (status = 422, body = ErrorBody)))]
pub async fn build(
    State(state): State<AppState>,
    owner: Owner,
    ApiJson(req): ApiJson<BuildTemplateRequest>,
) -> Result<(StatusCode, Json<Template>), ApiError> {
    super::pools::require_admin(&owner, "building and removing templates")?;
    let (req, prepared) = match &req.source {
        sandpit_api::TemplateSourceSpec::Snapshot { snapshot, .. } => {
            let snapshot = snapshot.clone();
            state
                .manager
                .snapshot_template_source(&owner.0, &snapshot, req)
                .await?
        }
        _ => (req, None),
    };
    let t = state
        .manager
        .templates()
        .build(&state.store, req, prepared)
        .await?;
    Ok((StatusCode::ACCEPTED, Json(t)))
}

/// Where a build's log is read from.
#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ProgressQuery {
    /// First line wanted (`next_offset` of the previous answer).
    #[serde(default)]
    pub offset: u64,
    /// Wait up to this long (at most 30000) for new lines while the build runs.
    #[serde(default)]
    pub wait_ms: u64,
}

/// A build's state and its log lines from `offset` on.
#[utoipa::path(get, path = "/v1/templates/{name}/build", params(ProgressQuery),
    responses((status = 200, body = TemplateBuild), (status = 404, body = ErrorBody)))]
pub async fn progress(
    State(state): State<AppState>,
    owner: Owner,
    Path(name): Path<String>,
    ApiQuery(q): ApiQuery<ProgressQuery>,
) -> Result<Json<TemplateBuild>, ApiError> {
    require_visible(&state, &owner, &name).await?;
    let b = state
        .manager
        .templates()
        .progress(
            &state.store,
            &name,
            q.offset,
            Duration::from_millis(q.wait_ms),
        )
        .await?;
    Ok(Json(b))
}

/// Remove a template (admin) and the directory its build made; refused while sandboxes
/// or pools use it. A build under way is cancelled.
#[utoipa::path(delete, path = "/v1/templates/{name}",
    responses((status = 204), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn delete(
    State(state): State<AppState>,
    owner: Owner,
    Path(name): Path<String>,
) -> Result<StatusCode, ApiError> {
    super::pools::require_admin(&owner, "building and removing templates")?;
    state
        .manager
        .templates()
        .delete(&state.store, &name)
        .await?;
    Ok(StatusCode::NO_CONTENT)
}
