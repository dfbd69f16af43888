//! Networking routes: a sandbox's egress policy, and the audit of outbound attempts
//! (listed, and streamed live as server-sent events). Owners see their own sandboxes'
//! entries; the admin sees every entry.

use super::{ApiJson, ApiQuery, AppState, Owner};
use crate::api::Path;
use crate::error::ApiError;
use crate::net::policy::Policy;
use axum::Json;
use axum::Router;
use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::routing::get;
use sandpit_api::ErrorBody;
use sandpit_api::network::{NetworkAuditEntry, NetworkAuditList, NetworkPolicy};
use sandpit_store::SandboxState;
use serde::Deserialize;

/// The routes of this module (behind authentication).
pub fn routes() -> Router<AppState> {
    Router::new()
        .route(
            "/v1/sandboxes/{id}/network",
            get(get_policy).put(set_policy),
        )
        .route("/v1/network/audit", get(audit))
        .route("/v1/network/audit/stream", get(audit_stream))
}

fn net(state: &AppState) -> Result<&std::sync::Arc<crate::net::Net>, ApiError> {
    state.manager.net().ok_or_else(|| {
        ApiError::new(
            http::StatusCode::NOT_IMPLEMENTED,
            "unimplemented",
            "networking is off on this daemon: sandboxes have loopback only",
        )
    })
}

/// A sandbox's egress policy.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/network",
    responses((status = 200, body = NetworkPolicy), (status = 404, body = ErrorBody), (status = 501, body = ErrorBody)))]
pub async fn get_policy(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
) -> Result<Json<NetworkPolicy>, ApiError> {
    let rec = state.manager.get(&owner.0, &id).await?;
    let net = net(&state)?;
    net.policy_of(&rec.id).map(Json).ok_or_else(|| {
        ApiError::bad_request(format!(
            "sandbox {id} has no network of its own (runtime {})",
            rec.runtime
        ))
    })
}

/// Replace a sandbox's egress policy; new connections follow it at once (a running
/// sandbox's route appears or goes with mode `none`). It is kept across pause,
/// hibernation, snapshots and forks.
#[utoipa::path(put, path = "/v1/sandboxes/{id}/network", request_body = NetworkPolicy,
    responses((status = 200, body = NetworkPolicy), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody), (status = 501, body = ErrorBody)))]
pub async fn set_policy(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<NetworkPolicy>,
) -> Result<Json<NetworkPolicy>, ApiError> {
    let rec = state.manager.get(&owner.0, &id).await?;
    let net = net(&state)?;
    if rec.runtime != "container" {
        return Err(ApiError::bad_request(format!(
            "the {} runtime has no network of its own: network policies need the container runtime",
            rec.runtime
        )));
    }
    if rec.state.is_final() {
        return Err(ApiError::conflict(format!(
            "sandbox {id} is {}",
            rec.state.as_str()
        )));
    }
    if rec.state == SandboxState::Creating {
        return Err(ApiError::conflict(format!(
            "sandbox {id} is still being created"
        )));
    }
    let policy =
        Policy::compile(&req).map_err(|e| ApiError::bad_request(format!("network: {e}")))?;
    crate::net::assign(Some(net), &rec, Some(policy)).await?;
    tracing::info!(
        id,
        mode = req.mode.as_str(),
        rules = req.rules.len(),
        "network policy replaced"
    );
    Ok(Json(req))
}

/// Query of the audit list.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct AuditQuery {
    /// Only this sandbox's entries.
    pub sandbox: Option<String>,
    /// Seen at or after this time (unix ms): a row counting repeats matches by its last.
    pub since: Option<i64>,
    /// First seen before this time (unix ms).
    pub until: Option<i64>,
    /// `allow` or `deny`.
    pub verdict: Option<String>,
    /// Page size (default 100, at most 1000).
    pub limit: Option<u32>,
    pub cursor: Option<String>,
}

fn check_verdict(v: &Option<String>) -> Result<(), ApiError> {
    match v.as_deref() {
        None | Some("allow") | Some("deny") => Ok(()),
        Some(other) => Err(ApiError::bad_request(format!(
            "verdict is `allow` or `deny`, not {other:?}"
        ))),
    }
}

fn scope(owner: &Owner) -> Option<String> {
    (owner.0 != super::pools::ADMIN_OWNER).then(|| owner.0.clone())
}

/// Outbound connection attempts and DNS queries of sandboxes, newest first.
#[utoipa::path(get, path = "/v1/network/audit", params(AuditQuery),
    responses((status = 200, body = NetworkAuditList), (status = 400, body = ErrorBody)))]
pub async fn audit(
    State(state): State<AppState>,
    owner: Owner,
    ApiQuery(q): ApiQuery<AuditQuery>,
) -> Result<Json<NetworkAuditList>, ApiError> {
    check_verdict(&q.verdict)?;
    let before_id = q
        .cursor
        .as_deref()
        .map(|c| {
            c.parse::<i64>()
                .map_err(|_| ApiError::bad_request("invalid cursor"))
        })
        .transpose()?;
    if let Some(net) = state.manager.net() {
        // What was streamed is listed too.
        net.audit.flush().await;
    }
    let (items, next) = state
        .store
        .list_audit(&sandpit_store::AuditFilter {
            owner: scope(&owner),
            sandbox_id: q.sandbox,
            since_ms: q.since,
            until_ms: q.until,
            verdict: q.verdict,
            before_id,
            limit: q.limit.unwrap_or(100),
        })
        .await?;
    Ok(Json(NetworkAuditList {
        items: items.iter().map(crate::net::audit::to_api).collect(),
        next_cursor: next.map(|n| n.to_string()),
    }))
}

/// Query of the live audit stream.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct StreamQuery {
    /// Only this sandbox's entries.
    pub sandbox: Option<String>,
    /// `allow` or `deny`.
    pub verdict: Option<String>,
}

/// Follow audit entries as they happen (server-sent events, one `audit` event per
/// entry; an allowed connection's entry comes again with its byte counts when it closes).
#[utoipa::path(get, path = "/v1/network/audit/stream", params(StreamQuery),
    responses((status = 200, description = "text/event-stream of NetworkAuditEntry"), (status = 400, body = ErrorBody), (status = 501, body = ErrorBody)))]
pub async fn audit_stream(
    State(state): State<AppState>,
    owner: Owner,
    ApiQuery(q): ApiQuery<StreamQuery>,
) -> Result<Sse<impl futures::Stream<Item = Result<Event, std::convert::Infallible>>>, ApiError> {
    check_verdict(&q.verdict)?;
    let net = net(&state)?;
    let (rx, closing) = net.audit.subscribe();
    let only_owner = scope(&owner);
    let keep = move |e: &crate::net::audit::Live| {
        only_owner.as_ref().is_none_or(|o| *o == e.owner)
            && q.sandbox.as_ref().is_none_or(|s| *s == e.entry.sandbox_id)
            && q.verdict
                .as_deref()
                .is_none_or(|v| v == e.entry.verdict.as_str())
    };
    let stream = futures::stream::unfold(
        (rx, closing, keep),
        |(mut rx, mut closing, keep)| async move {
            loop {
                if *closing.borrow() {
                    return None;
                }
                let got = tokio::select! {
                    r = rx.recv() => r,
                    _ = closing.changed() => return None,
                };
                match got {
                    Ok(e) if keep(&e) => {
                        let ev = event(&e.entry);
                        return Some((Ok(ev), (rx, closing, keep)));
                    }
                    Ok(_) => {}
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                        let ev = Event::default().event("lagged").data(n.to_string());
                        return Some((Ok(ev), (rx, closing, keep)));
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => return None,
                }
            }
        },
    );
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()))
}

fn event(e: &NetworkAuditEntry) -> Event {
    let data = serde_json::to_string(e).unwrap_or_else(|_| "{}".into());
    Event::default()
        .event("audit")
        .id(e.id.to_string())
        .data(data)
}
