//! Owner routes of the proxy: read a sandbox's exposure and tokens, open or close its
//! ports, rotate its traffic token, and mint signed URLs for one port.

use super::auth;
use crate::api::Path;
use crate::api::{ApiJson, AppState, Owner};
use crate::error::ApiError;
use axum::Json;
use axum::extract::State;
use sandpit_api::{PortUrl, PortUrlRequest, SandboxAccess, UpdateAccessRequest};

/// Validity of a signed port URL when the request names none.
pub const DEFAULT_PORT_URL_SECS: u64 = 3600;

fn view(
    state: &AppState,
    rec: &sandpit_store::SandboxRecord,
    mut a: sandpit_store::SandboxAccess,
) -> SandboxAccess {
    if !super::isolated(&state.manager, &rec.runtime) {
        crate::access::enforce_unisolated(&mut a);
    }
    SandboxAccess {
        secure: a.secure,
        public: a.public,
        envd_access_token: a.envd_token,
        traffic_access_token: a.traffic_token,
        domain: state.ingress.domain(),
    }
}

/// How the sandbox is exposed through the proxy, with its tokens.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/access",
    responses((status = 200, body = SandboxAccess), (status = 404, body = sandpit_api::ErrorBody)))]
pub async fn get(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
) -> Result<Json<SandboxAccess>, ApiError> {
    let rec = state.manager.get(&owner.0, &id).await?;
    let a = crate::access::access(&state.manager, &rec.id).await?;
    Ok(Json(view(&state, &rec, a)))
}

/// Open or close the sandbox's non-envd ports to anyone, or issue a new traffic token
/// (signed URLs made with the old one stop working).
#[utoipa::path(patch, path = "/v1/sandboxes/{id}/access", request_body = UpdateAccessRequest,
    responses((status = 200, body = SandboxAccess), (status = 400, body = sandpit_api::ErrorBody), (status = 404, body = sandpit_api::ErrorBody)))]
pub async fn update(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<UpdateAccessRequest>,
) -> Result<Json<SandboxAccess>, ApiError> {
    let rec = state.manager.get(&owner.0, &id).await?;
    let mut a = crate::access::access(&state.manager, &rec.id).await?;
    if let Some(p) = req.public {
        a.public = p;
    }
    if req.rotate_traffic_token {
        a.traffic_token = crate::access::random_token();
    }
    a.updated_at_ms = crate::manager::now_ms();
    crate::access::store_access(&state.manager, &a).await?;
    Ok(Json(view(&state, &rec, a)))
}

/// A URL that reaches one port of the sandbox without its traffic token, until it
/// expires. The envd port takes E2B's own signed `/files` URLs instead.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/ports/{port}/url", request_body = PortUrlRequest,
    responses((status = 200, body = PortUrl), (status = 400, body = sandpit_api::ErrorBody), (status = 404, body = sandpit_api::ErrorBody)))]
pub async fn port_url(
    State(state): State<AppState>,
    owner: Owner,
    Path((id, port)): Path<(String, String)>,
    body: axum::body::Bytes,
) -> Result<Json<PortUrl>, ApiError> {
    // No body and `null` both mean the defaults.
    let req = crate::api::json_or_default::<Option<PortUrlRequest>>(&body)?.unwrap_or_default();
    let port: u16 = port
        .parse()
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| ApiError::bad_request("port must be a number from 1 to 65535"))?;
    if port == super::ENVD_PORT {
        return Err(ApiError::bad_request(
            "the envd port takes the envd access token or E2B's signed /files URLs",
        ));
    }
    let secs = req.expires_in.unwrap_or(DEFAULT_PORT_URL_SECS);
    if secs == 0 || secs > auth::MAX_PORT_URL_SECS {
        return Err(ApiError::bad_request(format!(
            "expires_in must be between 1 and {} seconds",
            auth::MAX_PORT_URL_SECS
        )));
    }
    let path = req.path.unwrap_or_else(|| "/".into());
    if !path.starts_with('/')
        || path.len() > 4096
        || path.contains('#')
        || path.chars().any(|c| c.is_control() || c.is_whitespace())
    {
        return Err(ApiError::bad_request(
            "path must start with '/' and hold no spaces, control characters or '#'",
        ));
    }
    let rec = state.manager.get(&owner.0, &id).await?;
    let a = crate::access::access(&state.manager, &rec.id).await?;
    let expires_at = auth::now_secs() + secs as i64;
    let query = auth::port_url_query(&a, port, expires_at);
    let cfg = &state.ingress;
    let host = format!("{port}-{}.{}", rec.id, cfg.domain());
    let sep = if path.contains('?') { '&' } else { '?' };
    Ok(Json(PortUrl {
        url: format!("{}://{host}{path}{sep}{query}", cfg.scheme),
        host,
        query,
        expires_at,
    }))
}
