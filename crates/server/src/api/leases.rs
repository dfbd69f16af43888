//! Per-user lease routes: acquire (create or resume the user's one sandbox), list, show
//! and release.

use super::{ApiQuery, AppState, Owner};
use crate::api::Path;
use crate::error::ApiError;
use crate::leases::{check_user, lease_not_found};
use axum::Json;
use axum::extract::State;
use http::StatusCode;
use sandpit_api::leases::{Acquired, Lease, LeaseList};
use sandpit_api::{CreateSandboxRequest, ErrorBody};
use sandpit_store::{LeaseRecord, SandboxState};
use serde::Deserialize;

/// The API view of a lease, with its live pause state and accumulated active time.
pub async fn view(state: &AppState, rec: &LeaseRecord) -> Result<Lease, ApiError> {
    let m = &state.manager;
    let mut paused = rec.paused;
    let mut current_ms = 0;
    if let Some(id) = &rec.sandbox_id {
        if let Some(sb) = state.store.get_sandbox(id).await? {
            paused = !sb.state.is_final()
                && !matches!(
                    sb.state,
                    SandboxState::Running | SandboxState::Creating | SandboxState::Stopping
                );
        }
        current_ms = crate::leases::active_ms_of(m, id).await;
    }
    Ok(Lease {
        user: rec.user.clone(),
        sandbox_id: rec.sandbox_id.clone(),
        status: rec.status.as_str().to_string(),
        paused,
        runtime: rec.runtime.clone(),
        lock_version: rec.lock_version,
        total_usage_seconds: rec.usage_ms.saturating_add(current_ms) as f64 / 1000.0,
        last_activity_ms: rec.last_activity_ms,
        created_at_ms: rec.created_at_ms,
        updated_at_ms: rec.updated_at_ms,
    })
}

/// Return the user's one warm sandbox, running: created on first use (with the body's
/// create fields), resumed when paused, replaced when it died. Concurrent acquires for
/// one user all get the same sandbox; exactly one of them creates it.
#[utoipa::path(post, path = "/v1/leases/{user}/acquire", request_body = CreateSandboxRequest,
    responses((status = 200, body = Acquired), (status = 400, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn acquire(
    State(state): State<AppState>,
    owner: Owner,
    Path(user): Path<String>,
    body: axum::body::Bytes,
) -> Result<Json<Acquired>, ApiError> {
    check_user(&user)?;
    let req: CreateSandboxRequest = super::json_or_default(&body)?;
    let got = state
        .leases
        .acquire(&state.manager, &owner.0, &user, req)
        .await?;
    let isolated = state.manager.is_isolated(&got.sandbox.runtime);
    Ok(Json(Acquired {
        lease: view(&state, &got.lease).await?,
        sandbox: super::sandboxes::to_api(&got.sandbox, isolated),
        created: got.created,
        resumed: got.resumed,
    }))
}

/// The caller's leases.
#[utoipa::path(get, path = "/v1/leases", responses((status = 200, body = LeaseList)))]
pub async fn list(
    State(state): State<AppState>,
    owner: Owner,
) -> Result<Json<LeaseList>, ApiError> {
    let mut items = Vec::new();
    for rec in state.store.list_leases(&owner.0).await? {
        items.push(view(&state, &rec).await?);
    }
    Ok(Json(LeaseList { items }))
}

/// One lease.
#[utoipa::path(get, path = "/v1/leases/{user}", responses((status = 200, body = Lease), (status = 404, body = ErrorBody)))]
pub async fn get(
    State(state): State<AppState>,
    owner: Owner,
    Path(user): Path<String>,
) -> Result<Json<Lease>, ApiError> {
    check_user(&user)?;
    let rec = state
        .store
        .get_lease(&owner.0, &user)
        .await?
        .ok_or_else(|| lease_not_found(&user))?;
    Ok(Json(view(&state, &rec).await?))
}

/// Query of a release.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ReleaseQuery {
    /// Keep the sandbox running (it becomes an ordinary sandbox of the owner).
    #[serde(default)]
    pub keep: bool,
}

/// Release a lease: its sandbox is destroyed unless `keep=true`.
#[utoipa::path(delete, path = "/v1/leases/{user}", params(ReleaseQuery), responses((status = 204), (status = 404, body = ErrorBody)))]
pub async fn release(
    State(state): State<AppState>,
    owner: Owner,
    Path(user): Path<String>,
    ApiQuery(q): ApiQuery<ReleaseQuery>,
) -> Result<StatusCode, ApiError> {
    state
        .leases
        .release(&state.manager, &owner.0, &user, q.keep)
        .await?;
    Ok(StatusCode::NO_CONTENT)
}
