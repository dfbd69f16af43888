//! `/v1/sandboxes/{id}/agent/...`: forwards Connect RPC and `/files` requests to the agent
//! unchanged, so E2B-style clients can speak the agent protocol through the daemon.

use super::{AppState, Owner};
use crate::agent_conn::AGENT_BASE;
use crate::api::Path;
use crate::error::ApiError;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::Response;

/// Forward one request to the sandbox's agent and stream the answer back.
pub async fn forward(
    State(state): State<AppState>,
    owner: Owner,
    Path((id, rest)): Path<(String, String)>,
    request: Request,
) -> Result<Response, ApiError> {
    let (_, conn) = state.manager.agent(&owner.0, &id).await?;
    let (mut parts, body) = request.into_parts();
    let query = parts
        .uri
        .query()
        .map(|q| format!("?{q}"))
        .unwrap_or_default();
    parts.uri = format!("{AGENT_BASE}/{rest}{query}")
        .parse()
        .map_err(|_| ApiError::bad_request("invalid agent path"))?;
    // The daemon's own credentials stop here; a Basic header naming the user goes through.
    let bearer = parts
        .headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("Bearer "));
    if bearer {
        parts.headers.remove(http::header::AUTHORIZATION);
    }
    parts.headers.remove("x-api-key");
    parts.headers.remove(http::header::HOST);
    let resp = conn
        .http
        .request(http::Request::from_parts(parts, super::agent_body(body)))
        .await
        .map_err(|e| {
            ApiError::new(
                http::StatusCode::BAD_GATEWAY,
                "unavailable",
                format!("agent: {e}"),
            )
        })?;
    let (parts, body) = resp.into_parts();
    Ok(Response::from_parts(parts, Body::new(body)))
}
