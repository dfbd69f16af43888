//! Credential broker routes: the caller's secrets (`/v1/secrets`; the admin may name
//! another owner with `?owner=`), and which of them a sandbox may use
//! (`/v1/sandboxes/{id}/secrets`). No route ever answers with a secret's value.

use super::{ApiJson, ApiQuery, AppState, Owner};
use crate::api::Path;
use crate::error::ApiError;
use axum::Json;
use axum::Router;
use axum::extract::State;
use axum::routing::get;
use http::StatusCode;
use sandpit_api::ErrorBody;
use sandpit_api::secrets::{CreateSecretRequest, SandboxSecrets, Secret, SecretList};
use serde::Deserialize;

/// `?owner=`: whose secrets (the admin only, for another owner).
#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct OwnerQuery {
    pub owner: Option<String>,
}

/// The owner a request acts for: the caller's own, or with the admin key any named one.
fn acting_owner(owner: &Owner, q: &OwnerQuery) -> Result<String, ApiError> {
    match q.owner.as_deref() {
        None => Ok(owner.0.clone()),
        Some(o) if o == owner.0 => Ok(o.to_string()),
        Some(o) => {
            super::pools::require_admin(owner, "acting on another owner's secrets")?;
            // The empty owner marks idle pool sandboxes; nobody's secrets are theirs.
            if o.is_empty() || o.len() > 256 {
                return Err(ApiError::bad_request("owner must be 1 to 256 bytes"));
            }
            Ok(o.to_string())
        }
    }
}

/// Store a secret. Its value is encrypted with the daemon's broker key and never shown again.
#[utoipa::path(post, path = "/v1/secrets", params(OwnerQuery), request_body = CreateSecretRequest,
    responses((status = 201, body = Secret), (status = 400, body = ErrorBody), (status = 409, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn create(
    State(state): State<AppState>,
    owner: Owner,
    ApiQuery(q): ApiQuery<OwnerQuery>,
    ApiJson(req): ApiJson<CreateSecretRequest>,
) -> Result<(StatusCode, Json<Secret>), ApiError> {
    let owner = acting_owner(&owner, &q)?;
    let s = state.broker.create_secret(&owner, &req).await?;
    Ok((StatusCode::CREATED, Json(s)))
}

/// List the secrets (without values).
#[utoipa::path(get, path = "/v1/secrets", params(OwnerQuery), responses((status = 200, body = SecretList)))]
pub async fn list(
    State(state): State<AppState>,
    owner: Owner,
    ApiQuery(q): ApiQuery<OwnerQuery>,
) -> Result<Json<SecretList>, ApiError> {
    let owner = acting_owner(&owner, &q)?;
    Ok(Json(SecretList {
        items: state.broker.list_secrets(&owner).await?,
    }))
}

/// One secret (without its value).
#[utoipa::path(get, path = "/v1/secrets/{name}", params(OwnerQuery), responses((status = 200, body = Secret), (status = 404, body = ErrorBody)))]
pub async fn get_one(
    State(state): State<AppState>,
    owner: Owner,
    ApiQuery(q): ApiQuery<OwnerQuery>,
    Path(name): Path<String>,
) -> Result<Json<Secret>, ApiError> {
    let owner = acting_owner(&owner, &q)?;
    Ok(Json(state.broker.get_secret(&owner, &name).await?))
}

/// Delete a secret; sandboxes that had it stop getting it at once.
#[utoipa::path(delete, path = "/v1/secrets/{name}", params(OwnerQuery), responses((status = 204), (status = 404, body = ErrorBody)))]
pub async fn delete(
    State(state): State<AppState>,
    owner: Owner,
    ApiQuery(q): ApiQuery<OwnerQuery>,
    Path(name): Path<String>,
) -> Result<StatusCode, ApiError> {
    let owner = acting_owner(&owner, &q)?;
    state.broker.delete_secret(&owner, &name).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// The secrets a sandbox may use.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/secrets", responses((status = 200, body = SandboxSecrets), (status = 404, body = ErrorBody)))]
pub async fn sandbox_get(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
) -> Result<Json<SandboxSecrets>, ApiError> {
    let rec = state.manager.get(&owner.0, &id).await?;
    Ok(Json(SandboxSecrets {
        secrets: state.broker.attached(&rec.id).await?,
    }))
}

/// Replace the secrets a sandbox may use (names of its owner's secrets); takes effect on
/// its next request.
#[utoipa::path(put, path = "/v1/sandboxes/{id}/secrets", request_body = SandboxSecrets,
    responses((status = 200, body = SandboxSecrets), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn sandbox_put(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<SandboxSecrets>,
) -> Result<Json<SandboxSecrets>, ApiError> {
    let rec = state.manager.get(&owner.0, &id).await?;
    if rec.state.is_final() {
        return Err(ApiError::sandbox_stopped(&id, rec.state.as_str()));
    }
    state
        .broker
        .attach(&rec.id, &rec.owner, &req.secrets)
        .await?;
    Ok(Json(SandboxSecrets {
        secrets: state.broker.attached(&rec.id).await?,
    }))
}

/// The routes above, to be placed behind authentication.
pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/secrets", get(list).post(create))
        .route("/v1/secrets/{name}", get(get_one).delete(delete))
        .route(
            "/v1/sandboxes/{id}/secrets",
            get(sandbox_get).put(sandbox_put),
        )
}
