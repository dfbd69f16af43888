//! Volume routes: named persistent directories of the caller's owner, mounted into
//! sandboxes at create (`CreateSandboxRequest.volumes`).

use super::{ApiJson, AppState, Owner};
use crate::api::Path;
use crate::error::ApiError;
use axum::Json;
use axum::extract::State;
use http::StatusCode;
use sandpit_api::{CreateVolumeRequest, ErrorBody, Volume, VolumeList};

/// Create a volume; it is ready (its file system made) when this returns.
#[utoipa::path(post, path = "/v1/volumes", request_body = CreateVolumeRequest,
    responses((status = 201, body = Volume), (status = 400, body = ErrorBody), (status = 409, body = ErrorBody), (status = 507, body = ErrorBody)))]
pub async fn create(
    State(state): State<AppState>,
    owner: Owner,
    ApiJson(req): ApiJson<CreateVolumeRequest>,
) -> Result<(StatusCode, Json<Volume>), ApiError> {
    let v = state.manager.create_volume(&owner.0, &req).await?;
    Ok((StatusCode::CREATED, Json(v)))
}

/// List the caller's volumes with their usage.
#[utoipa::path(get, path = "/v1/volumes", responses((status = 200, body = VolumeList)))]
pub async fn list(
    State(state): State<AppState>,
    owner: Owner,
) -> Result<Json<VolumeList>, ApiError> {
    Ok(Json(VolumeList {
        items: state.manager.list_volumes(&owner.0).await?,
    }))
}

/// One volume: size, bytes used, and the sandboxes that have it mounted.
#[utoipa::path(get, path = "/v1/volumes/{name}", responses((status = 200, body = Volume), (status = 404, body = ErrorBody)))]
pub async fn get(
    State(state): State<AppState>,
    owner: Owner,
    Path(name): Path<String>,
) -> Result<Json<Volume>, ApiError> {
    Ok(Json(state.manager.get_volume(&owner.0, &name).await?))
}

/// Delete a volume and its data; refused (409) while a sandbox has it mounted.
#[utoipa::path(delete, path = "/v1/volumes/{name}", responses((status = 204), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn delete(
    State(state): State<AppState>,
    owner: Owner,
    Path(name): Path<String>,
) -> Result<StatusCode, ApiError> {
    state.manager.delete_volume(&owner.0, &name).await?;
    Ok(StatusCode::NO_CONTENT)
}
