//! File routes. Paths are resolved by the agent inside the sandbox's own root; the daemon
//! never touches a sandbox path on the host.

use super::{ApiJson, ApiQuery, AppState, Owner};
use crate::agent_conn::AGENT_BASE;
use crate::api::Path;
use crate::error::ApiError;
use axum::Json;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::Response;
use http::StatusCode;
use sandpit_api::*;
use sandpit_core::exec::as_user;
use sandpit_proto::filesystem::{self as pfs, FileType};
use serde::Deserialize;

/// `?path=...` (and optional `user`, `depth`).
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct PathQuery {
    pub path: String,
    /// `user` (default) or `root`.
    pub user: Option<String>,
    /// Levels to descend when listing (default 1).
    pub depth: Option<u32>,
}

/// Refuses malformed paths and `..` escapes before anything reaches the agent.
fn check_path(p: &str) -> Result<(), ApiError> {
    use sandpit_api::paths::{PathError, normalize};
    // The agent re-checks against the acting user's home; this is only the early refusal.
    match normalize(p, "/home/user") {
        Ok(_) => Ok(()),
        Err(PathError::Invalid(why)) => Err(ApiError::bad_request(why)),
        Err(PathError::Escape) => Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "permission_denied",
            format!("path escapes the sandbox root: {p}"),
        )),
    }
}

fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~/".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn entry(e: &pfs::EntryInfo) -> EntryInfo {
    let t = match e.r#type.as_known() {
        Some(FileType::FILE_TYPE_DIRECTORY) => "dir",
        Some(FileType::FILE_TYPE_SYMLINK) => "symlink",
        _ => "file",
    };
    EntryInfo {
        name: e.name.clone(),
        path: e.path.clone(),
        r#type: t.to_string(),
        size: e.size,
        mode: e.mode,
        permissions: e.permissions.clone(),
        owner: e.owner.clone(),
        group: e.group.clone(),
        modified_ms: e.modified_time.seconds * 1000 + (e.modified_time.nanos / 1_000_000) as i64,
        symlink_target: e.symlink_target.clone(),
    }
}

/// Turns an agent `/files` error (JSON with a numeric code) into an API error.
async fn agent_error(resp: http::Response<hyper::body::Incoming>) -> ApiError {
    use http_body_util::BodyExt;
    let status = resp.status();
    // The agent is not trusted to keep its error short.
    let limited = http_body_util::Limited::new(resp.into_body(), 64 << 10);
    let body = limited
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let message = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v.get("message").and_then(|m| m.as_str()).map(String::from))
        .unwrap_or_else(|| String::from_utf8_lossy(&body).into_owned());
    let code = match status {
        StatusCode::BAD_REQUEST => "invalid_argument",
        StatusCode::NOT_FOUND => "not_found",
        StatusCode::FORBIDDEN => "permission_denied",
        StatusCode::CONFLICT => "already_exists",
        StatusCode::INSUFFICIENT_STORAGE => "resource_exhausted",
        _ => "agent_error",
    };
    let status = if status.is_server_error() && status != StatusCode::INSUFFICIENT_STORAGE {
        StatusCode::BAD_GATEWAY
    } else {
        status
    };
    ApiError::new(status, code, message)
}

/// The agent's `/files` URI for a query; without a user the sandbox's default applies.
fn files_uri(q: &PathQuery) -> Result<String, ApiError> {
    let mut uri = format!("{AGENT_BASE}/files?path={}", encode(&q.path));
    if let Some(user) = &q.user {
        if user != "user" && user != "root" {
            return Err(ApiError::bad_request(format!(
                "unknown user {user:?}: use \"user\" or \"root\""
            )));
        }
        uri.push_str("&username=");
        uri.push_str(&encode(user));
    }
    Ok(uri)
}

/// Sends a request to the agent's HTTP side; a failure or error status becomes an API error.
async fn send_to_agent(
    conn: &crate::agent_conn::AgentConn,
    req: http::Request<Body>,
) -> Result<http::Response<hyper::body::Incoming>, ApiError> {
    let resp = conn
        .http
        .request(req.map(super::agent_body))
        .await
        .map_err(|e| {
            ApiError::new(
                StatusCode::BAD_GATEWAY,
                "unavailable",
                format!("agent: {e}"),
            )
        })?;
    if !resp.status().is_success() {
        return Err(agent_error(resp).await);
    }
    Ok(resp)
}

/// Download a file (streamed).
#[utoipa::path(get, path = "/v1/sandboxes/{id}/files", params(PathQuery), responses((status = 200, description = "file bytes"), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn download(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<PathQuery>,
) -> Result<Response, ApiError> {
    check_path(&q.path)?;
    let (_, conn) = state.manager.agent(&owner.0, &id).await?;
    state
        .manager
        .usage()
        .log(&owner.0, &id, crate::usage::FILE, 1, "download");
    let uri = files_uri(&q)?;
    let req = http::Request::get(uri)
        .body(Body::empty())
        .map_err(|e| ApiError::internal_from("build the agent request", &e))?;
    let resp = send_to_agent(&conn, req).await?;
    let (parts, body) = resp.into_parts();
    let mut out = Response::new(Body::new(body));
    for h in [
        http::header::CONTENT_TYPE,
        http::header::CONTENT_LENGTH,
        http::header::CONTENT_DISPOSITION,
    ] {
        if let Some(v) = parts.headers.get(&h) {
            out.headers_mut().insert(h, v.clone());
        }
    }
    Ok(out)
}

/// Upload a file from the raw request body (streamed); parent directories are created.
#[utoipa::path(put, path = "/v1/sandboxes/{id}/files", params(PathQuery), request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 200, body = EntryInfo), (status = 403, body = ErrorBody), (status = 507, body = ErrorBody)))]
pub async fn upload(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<PathQuery>,
    request: Request,
) -> Result<Json<EntryInfo>, ApiError> {
    check_path(&q.path)?;
    let (_, conn) = state.manager.agent(&owner.0, &id).await?;
    state
        .manager
        .usage()
        .log(&owner.0, &id, crate::usage::FILE, 1, "upload");
    let uri = files_uri(&q)?;
    let req = http::Request::post(uri)
        .header(http::header::CONTENT_TYPE, "application/octet-stream")
        .body(request.into_body())
        .map_err(|e| ApiError::internal_from("build the agent request", &e))?;
    send_to_agent(&conn, req).await?;
    let opts = as_user(q.user.as_deref())?;
    let st = conn
        .fs
        .stat_with_options(
            pfs::StatRequest {
                path: q.path.clone(),
                ..Default::default()
            },
            opts,
        )
        .await?
        .into_owned();
    Ok(Json(entry(&st.entry)))
}

/// List a directory.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/files/list", params(PathQuery), responses((status = 200, body = Vec<EntryInfo>), (status = 404, body = ErrorBody)))]
pub async fn list(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<PathQuery>,
) -> Result<Json<Vec<EntryInfo>>, ApiError> {
    check_path(&q.path)?;
    let (_, conn) = state.manager.agent(&owner.0, &id).await?;
    state
        .manager
        .usage()
        .log(&owner.0, &id, crate::usage::FILE, 1, "list");
    let depth = q.depth.unwrap_or(1).clamp(1, 32);
    let req = pfs::ListDirRequest {
        path: q.path.clone(),
        depth,
        ..Default::default()
    };
    let resp = conn
        .fs
        .list_dir_with_options(req, as_user(q.user.as_deref())?)
        .await?
        .into_owned();
    Ok(Json(resp.entries.iter().map(entry).collect()))
}

/// Describe one path.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/files/stat", params(PathQuery), responses((status = 200, body = EntryInfo), (status = 404, body = ErrorBody)))]
pub async fn stat(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<PathQuery>,
) -> Result<Json<EntryInfo>, ApiError> {
    check_path(&q.path)?;
    let (_, conn) = state.manager.agent(&owner.0, &id).await?;
    state
        .manager
        .usage()
        .log(&owner.0, &id, crate::usage::FILE, 1, "stat");
    let resp = conn
        .fs
        .stat_with_options(
            pfs::StatRequest {
                path: q.path.clone(),
                ..Default::default()
            },
            as_user(q.user.as_deref())?,
        )
        .await?
        .into_owned();
    Ok(Json(entry(&resp.entry)))
}

/// Create a directory and its parents.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/files/mkdir", request_body = PathRequest, responses((status = 200, body = EntryInfo), (status = 409, body = ErrorBody)))]
pub async fn mkdir(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<PathRequest>,
) -> Result<Json<EntryInfo>, ApiError> {
    check_path(&req.path)?;
    let (_, conn) = state.manager.agent(&owner.0, &id).await?;
    state
        .manager
        .usage()
        .log(&owner.0, &id, crate::usage::FILE, 1, "mkdir");
    let resp = conn
        .fs
        .make_dir(pfs::MakeDirRequest {
            path: req.path,
            ..Default::default()
        })
        .await?
        .into_owned();
    Ok(Json(entry(&resp.entry)))
}

/// Move or rename.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/files/move", request_body = MoveRequest, responses((status = 200, body = EntryInfo), (status = 404, body = ErrorBody)))]
pub async fn move_path(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<MoveRequest>,
) -> Result<Json<EntryInfo>, ApiError> {
    check_path(&req.from)?;
    check_path(&req.to)?;
    let (_, conn) = state.manager.agent(&owner.0, &id).await?;
    state
        .manager
        .usage()
        .log(&owner.0, &id, crate::usage::FILE, 1, "move");
    let resp = conn
        .fs
        .r#move(pfs::MoveRequest {
            source: req.from,
            destination: req.to,
            ..Default::default()
        })
        .await?
        .into_owned();
    Ok(Json(entry(&resp.entry)))
}

/// Copy a file or directory tree (as the sandbox user, with `cp -a` inside the sandbox).
#[utoipa::path(post, path = "/v1/sandboxes/{id}/files/copy", request_body = MoveRequest, responses((status = 200, body = EntryInfo), (status = 400, body = ErrorBody)))]
pub async fn copy(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<MoveRequest>,
) -> Result<Json<EntryInfo>, ApiError> {
    check_path(&req.from)?;
    check_path(&req.to)?;
    let (rec, conn) = state.manager.agent(&owner.0, &id).await?;
    state
        .manager
        .usage()
        .log(&owner.0, &id, crate::usage::FILE, 1, "copy");
    // Resolve both through the agent first, so `..` escapes are refused the same way.
    let src = conn
        .fs
        .stat(pfs::StatRequest {
            path: req.from.clone(),
            ..Default::default()
        })
        .await?
        .into_owned();
    let (from, to) = (src.entry.path.clone(), req.to.clone());
    let isolated = state.manager.is_isolated(&rec.runtime);
    // Commands of the unisolated process runtime see host paths; map both under its root.
    let (from, to) = if isolated {
        (from, to)
    } else {
        let (_, h) = state.manager.runtime_of(&rec)?;
        let root = h.dir.join("root");
        let to = sandpit_api::paths::normalize(&to, "/home/user")
            .map_err(|_| ApiError::bad_request("invalid destination"))?;
        let host = |p: &str| {
            root.join(p.trim_start_matches('/'))
                .to_string_lossy()
                .into_owned()
        };
        (host(&from), host(&to))
    };
    let run = sandpit_api::RunCommandRequest {
        argv: vec!["cp".into(), "-a".into(), "--".into(), from, to],
        timeout_ms: Some(600_000),
        ..Default::default()
    };
    let out = sandpit_core::exec::run_to_end(&conn, &run).await?;
    if out.exit_code != 0 {
        return Err(ApiError::bad_request(format!(
            "copy failed: {}",
            out.stderr.trim()
        )));
    }
    let st = conn
        .fs
        .stat(pfs::StatRequest {
            path: req.to,
            ..Default::default()
        })
        .await?
        .into_owned();
    Ok(Json(entry(&st.entry)))
}

/// Remove a file, symlink or directory tree.
#[utoipa::path(delete, path = "/v1/sandboxes/{id}/files", params(PathQuery), responses((status = 204), (status = 404, body = ErrorBody)))]
pub async fn remove(
    State(state): State<AppState>,
    owner: Owner,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<PathQuery>,
) -> Result<StatusCode, ApiError> {
    check_path(&q.path)?;
    let (_, conn) = state.manager.agent(&owner.0, &id).await?;
    state
        .manager
        .usage()
        .log(&owner.0, &id, crate::usage::FILE, 1, "remove");
    conn.fs
        .remove_with_options(
            pfs::RemoveRequest {
                path: q.path,
                ..Default::default()
            },
            as_user(q.user.as_deref())?,
        )
        .await?;
    Ok(StatusCode::NO_CONTENT)
}
