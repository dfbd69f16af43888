//! Approvals of agent runs' risky actions (issue 13, parts 6 and 7): list them, read one,
//! approve or deny a pending one. Only the run's owner sees or decides them (another owner
//! gets 404); with `[approvals] require_approver_role` only keys with the `approver` role
//! decide. These routes are on the daemon's API listener, never on a sandbox's egress path.

use super::{ApiQuery, AppState, Owner};
use crate::api::Path;
use crate::error::ApiError;
use axum::Json;
use axum::Router;
use axum::extract::State;
use axum::routing::{get, post};
use sandpit_api::{Approval, ApproveRequest, DenyRequest, ErrorBody};
use sandpit_core::approvals;
use sandpit_store::Decision;
use serde::Deserialize;

/// Longest deny reason kept (it is shown inside the sandbox).
const MAX_REASON: usize = 500;

/// The approval routes.
pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/approvals", get(list))
        .route("/v1/approvals/{id}", get(get_one))
        .route("/v1/approvals/{id}/approve", post(approve))
        .route("/v1/approvals/{id}/deny", post(deny))
}

/// Filters of `GET /v1/approvals`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    /// `pending`, `approved`, `denied`, `expired` or `abandoned`.
    pub state: Option<String>,
    /// Only this run's.
    pub run: Option<String>,
}

/// The caller's approvals, oldest first.
#[utoipa::path(get, path = "/v1/approvals",
    params(("state" = Option<String>, Query, description = "pending, approved, denied, expired or abandoned"),
           ("run" = Option<String>, Query, description = "only this run's")),
    responses((status = 200, body = Vec<Approval>), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn list(
    State(state): State<AppState>,
    owner: Owner,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> Result<Json<Vec<Approval>>, ApiError> {
    let recs = state
        .manager
        .list_approvals(&owner.0, q.state.as_deref(), q.run.as_deref())
        .await?;
    Ok(Json(recs.iter().map(approvals::to_api).collect()))
}

/// One approval.
#[utoipa::path(get, path = "/v1/approvals/{id}",
    responses((status = 200, body = Approval), (status = 404, body = ErrorBody)))]
pub async fn get_one(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
) -> Result<Json<Approval>, ApiError> {
    let rec = state.manager.approval(&owner.0, &id).await?;
    Ok(Json(approvals::to_api(&rec)))
}

/// Approve a pending approval: the held action goes on (scope `run`: the same capability
/// and target for the rest of the run too).
#[utoipa::path(post, path = "/v1/approvals/{id}/approve", request_body = ApproveRequest,
    responses((status = 200, body = Approval), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody),
              (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn approve(
    State(state): State<AppState>,
    owner: Owner,
    key: Option<axum::Extension<super::ApiKeyId>>,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<Json<Approval>, ApiError> {
    let req: ApproveRequest = super::json_or_default(&body)?;
    let scope = approvals::parse_scope(req.scope.as_deref())?;
    check_approver(&state, &owner, key.as_deref(), &id).await?;
    let rec = state
        .manager
        .decide_approval(
            &owner.0,
            &id,
            Decision::Approve(scope),
            None,
            decider(key.as_deref()),
        )
        .await?;
    Ok(Json(approvals::to_api(&rec)))
}

/// Deny a pending approval: the held action is refused inside the sandbox with the reason.
#[utoipa::path(post, path = "/v1/approvals/{id}/deny", request_body = DenyRequest,
    responses((status = 200, body = Approval), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody),
              (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn deny(
    State(state): State<AppState>,
    owner: Owner,
    key: Option<axum::Extension<super::ApiKeyId>>,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<Json<Approval>, ApiError> {
    let req: DenyRequest = super::json_or_default(&body)?;
    let reason = req
        .reason
        .map(|r| {
            // Printable and short: it is written into the sandbox's HTTP response.
            r.chars()
                .filter(|c| !c.is_control())
                .take(MAX_REASON)
                .collect::<String>()
        })
        .filter(|r| !r.trim().is_empty());
    check_approver(&state, &owner, key.as_deref(), &id).await?;
    let rec = state
        .manager
        .decide_approval(
            &owner.0,
            &id,
            Decision::Deny,
            reason,
            decider(key.as_deref()),
        )
        .await?;
    Ok(Json(approvals::to_api(&rec)))
}

/// Who a decision is recorded as made by: the deciding API key's id (the record keeps the
/// owner besides). Only a loopback `--insecure-no-auth` daemon has no key.
fn decider(key: Option<&super::ApiKeyId>) -> &str {
    key.map_or(NO_AUTH_DECIDER, |k| k.0.as_str())
}

/// `decided_by` of a decision made on a daemon without API keys.
pub const NO_AUTH_DECIDER: &str = "insecure-no-auth";

/// With the approver role required, refuses keys without it (403), after the approval
/// is known to be the caller's (so another owner still gets 404).
async fn check_approver(
    state: &AppState,
    owner: &Owner,
    key: Option<&super::ApiKeyId>,
    id: &str,
) -> Result<(), ApiError> {
    state.manager.approval(&owner.0, id).await?;
    if !state.manager.approver_role_required() {
        return Ok(());
    }
    let allowed = match key {
        Some(k) => state.store.key_has_role(&k.0, APPROVER).await?,
        // Only a loopback --insecure-no-auth daemon has no key: its operator is the admin.
        None => state.no_auth_owner.is_some(),
    };
    if allowed {
        Ok(())
    } else {
        Err(ApiError::new(
            http::StatusCode::FORBIDDEN,
            "forbidden",
            "deciding approvals needs an API key with the approver role",
        ))
    }
}

/// The role that may decide approvals when `[approvals] require_approver_role` is set.
pub const APPROVER: &str = "approver";
