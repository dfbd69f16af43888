//! Warm pool routes. Anyone may read pool status; creating, resizing and deleting pools
//! is for the admin key, since pools spend the whole daemon's memory.

use super::{ApiJson, AppState, Owner};
use crate::api::Path;
use crate::error::ApiError;
use crate::pools::PoolView;
use axum::Json;
use axum::extract::State;
use http::StatusCode;
use sandpit_api::{ErrorBody, Limits, Pool, PoolList, PoolSpec, ResizePoolRequest};

/// Owner of the admin key (and of requests on a daemon started without auth).
pub const ADMIN_OWNER: &str = "admin";

/// 403 unless the request acts as the admin; `what` says what needs the admin key.
pub(crate) fn require_admin(owner: &Owner, what: &str) -> Result<(), ApiError> {
    if owner.0 == ADMIN_OWNER {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "permission_denied",
            format!("{what} needs the admin key"),
        ))
    }
}

fn to_api(v: PoolView) -> Pool {
    let d = v.def;
    Pool {
        name: d.name,
        template: d.template,
        runtime: d.runtime,
        limits: Limits {
            cpu_millis: d.cpu_millis as u64,
            memory_bytes: d.memory_bytes as u64,
            disk_bytes: d.disk_bytes as u64,
            max_processes: d.max_processes as u64,
        },
        size: d.size as u32,
        ready: v.ready,
        starting: v.starting,
        hits: d.hits as u64,
        misses: d.misses as u64,
        source: d.source,
    }
}

/// List warm pools with their ready counts and hit/miss counters.
#[utoipa::path(get, path = "/v1/pools", responses((status = 200, body = PoolList)))]
pub async fn list(State(state): State<AppState>, _owner: Owner) -> Json<PoolList> {
    Json(PoolList {
        items: state
            .manager
            .pools()
            .views()
            .into_iter()
            .map(to_api)
            .collect(),
    })
}

/// One warm pool.
#[utoipa::path(get, path = "/v1/pools/{name}", responses((status = 200, body = Pool), (status = 404, body = ErrorBody)))]
pub async fn get(
    State(state): State<AppState>,
    _owner: Owner,
    Path(name): Path<String>,
) -> Result<Json<Pool>, ApiError> {
    state
        .manager
        .pools()
        .view(&name)
        .map(|v| Json(to_api(v)))
        .ok_or_else(|| ApiError::not_found(format!("pool {name} not found")))
}

/// Create a warm pool (admin); it fills in the background. 400 over `[pool_limits]
/// max_size`, 409 when its sandboxes' memory does not fit beside the other pools'.
#[utoipa::path(post, path = "/v1/pools", request_body = PoolSpec,
    responses((status = 201, body = Pool), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn create(
    State(state): State<AppState>,
    owner: Owner,
    ApiJson(spec): ApiJson<PoolSpec>,
) -> Result<(StatusCode, Json<Pool>), ApiError> {
    require_admin(&owner, "managing warm pools")?;
    let v = state.manager.create_pool(&spec).await?;
    Ok((StatusCode::CREATED, Json(to_api(v))))
}

/// Resize a warm pool (admin); idle sandboxes beyond the new size are destroyed. Growing
/// is held to the same limits as a create (400, 409).
#[utoipa::path(patch, path = "/v1/pools/{name}", request_body = ResizePoolRequest,
    responses((status = 200, body = Pool), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn resize(
    State(state): State<AppState>,
    owner: Owner,
    Path(name): Path<String>,
    ApiJson(req): ApiJson<ResizePoolRequest>,
) -> Result<Json<Pool>, ApiError> {
    require_admin(&owner, "managing warm pools")?;
    Ok(Json(to_api(
        state.manager.resize_pool(&name, req.size).await?,
    )))
}

/// Delete a warm pool (admin) and its idle sandboxes; claimed ones are not touched.
#[utoipa::path(delete, path = "/v1/pools/{name}", responses((status = 204), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn delete(
    State(state): State<AppState>,
    owner: Owner,
    Path(name): Path<String>,
) -> Result<StatusCode, ApiError> {
    require_admin(&owner, "managing warm pools")?;
    state.manager.delete_pool(&name).await?;
    Ok(StatusCode::NO_CONTENT)
}
