//! Snapshot routes: take, list, inspect, verify and delete snapshots of sandboxes' files.

use super::{ApiJson, ApiQuery, AppState, Owner};
use crate::api::Path;
use crate::error::ApiError;
use crate::snapshots::to_api;
use axum::Json;
use axum::extract::State;
use http::StatusCode;
use sandpit_api::*;
use serde::Deserialize;

/// Capture the sandbox's files (running, paused or hibernated) as a snapshot: full, or
/// incremental over the snapshot it descends from.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/snapshots", request_body = CreateSnapshotRequest,
    responses((status = 201, body = Snapshot), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn create(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<CreateSnapshotRequest>,
) -> Result<(StatusCode, Json<Snapshot>), ApiError> {
    let rec = state.manager.get(&owner.0, &id).await?;
    let snap = state.manager.snapshot(&rec, &req).await?;
    Ok((StatusCode::CREATED, Json(to_api(&snap))))
}

/// The caller's snapshots, newest first.
#[utoipa::path(get, path = "/v1/snapshots", responses((status = 200, body = SnapshotList)))]
pub async fn list(
    State(state): State<AppState>,
    owner: Owner,
) -> Result<Json<SnapshotList>, ApiError> {
    let items = state.store.list_snapshots(Some(&owner.0)).await?;
    Ok(Json(SnapshotList {
        items: items.iter().map(to_api).collect(),
    }))
}

/// One snapshot, by id or name.
#[utoipa::path(get, path = "/v1/snapshots/{id}", responses((status = 200, body = Snapshot), (status = 404, body = ErrorBody)))]
pub async fn get(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
) -> Result<Json<Snapshot>, ApiError> {
    let snap = state
        .store
        .get_snapshot(&owner.0, &id)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("snapshot {id} not found")))?;
    Ok(Json(to_api(&snap)))
}

/// Query of a snapshot delete.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct DeleteQuery {
    /// Also delete the snapshots that build on this one.
    #[serde(default)]
    pub force: bool,
}

/// Delete a snapshot; refused (409) while incremental snapshots build on it, unless
/// `force=true`, which deletes them too.
#[utoipa::path(delete, path = "/v1/snapshots/{id}", params(DeleteQuery),
    responses((status = 204), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn delete(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<DeleteQuery>,
) -> Result<StatusCode, ApiError> {
    state
        .manager
        .delete_snapshot(&owner.0, &id, q.force)
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Check that every archive of the snapshot's chain is stored intact (sha256).
#[utoipa::path(post, path = "/v1/snapshots/{id}/verify", responses((status = 200, body = SnapshotCheck), (status = 404, body = ErrorBody)))]
pub async fn verify(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
) -> Result<Json<SnapshotCheck>, ApiError> {
    Ok(Json(state.manager.verify_snapshot(&owner.0, &id).await?))
}
