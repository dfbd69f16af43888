//! HTTP routes of the code interpreter, shaped as the E2B code-interpreter SDK calls them
//! (its port-49999 server), under `/code`.

use super::InterpError;
use super::contexts::{ContextInfo, Contexts};
use super::exec::{self, Cell};
use super::protocol::{Language, valid_env_name};
use crate::config::AgentConfig;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// Largest request body (code is sent inline).
const MAX_BODY: usize = 32 << 20;
/// Largest cell.
const MAX_CODE: usize = 16 << 20;
/// Most extra environment variables of one cell.
const MAX_ENV_VARS: usize = 1024;
/// Longest per-cell timeout accepted, in seconds (a week).
const MAX_TIMEOUT_SECS: f64 = 7.0 * 86400.0;

struct Interp {
    cfg: Arc<AgentConfig>,
    contexts: Contexts,
}

type Shared = State<Arc<Interp>>;

/// The code-interpreter routes, for the agent's router.
pub fn router(cfg: Arc<AgentConfig>) -> Router {
    let state = Arc::new(Interp {
        contexts: Contexts::new(cfg.clone()),
        cfg,
    });
    Router::new()
        .route("/code/health", get(health))
        .route("/code/execute", post(execute))
        .route("/code/contexts", get(list).post(create))
        .route("/code/contexts/{id}", delete(remove))
        .route("/code/contexts/{id}/restart", post(restart))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(state)
}

fn parse<T: DeserializeOwned + Default>(body: &Bytes) -> Result<T, InterpError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(body).map_err(InterpError::Body)
}

fn user_of(cfg: &AgentConfig, headers: &HeaderMap) -> Result<crate::users::User, InterpError> {
    let name = crate::users::from_headers(headers);
    crate::users::resolve(cfg, name.as_deref()).ok_or_else(|| {
        InterpError::BadRequest(format!("unknown user {:?}", name.unwrap_or_default()))
    })
}

fn language(name: Option<&str>) -> Result<Language, InterpError> {
    Ok(Language::parse(name)?)
}

async fn health() -> impl IntoResponse {
    axum::Json(serde_json::json!({"status": "ok"}))
}

/// Body of `POST /code/execute`.
#[derive(Debug, Default, Deserialize)]
struct ExecuteRequest {
    code: Option<String>,
    context_id: Option<String>,
    language: Option<String>,
    env_vars: Option<BTreeMap<String, String>>,
    /// Seconds; sandpit's own addition (the SDK bounds a cell by closing the request).
    timeout: Option<f64>,
}

fn validate_env(env: &BTreeMap<String, String>) -> Result<(), InterpError> {
    if env.len() > MAX_ENV_VARS {
        return Err(InterpError::BadRequest(format!(
            "at most {MAX_ENV_VARS} env_vars per execution"
        )));
    }
    for (k, v) in env {
        if !valid_env_name(k) {
            return Err(InterpError::BadRequest(format!(
                "invalid environment variable name {k:?} (letters, digits and '_')"
            )));
        }
        if v.contains('\0') {
            return Err(InterpError::BadRequest(format!(
                "environment variable {k:?} contains a NUL byte"
            )));
        }
    }
    Ok(())
}

async fn execute(
    State(s): Shared,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, InterpError> {
    let req: ExecuteRequest = parse(&body)?;
    let code = req
        .code
        .ok_or_else(|| InterpError::BadRequest("code is required".into()))?;
    if code.len() > MAX_CODE {
        return Err(InterpError::BadRequest(format!(
            "code is larger than {MAX_CODE} bytes"
        )));
    }
    if code.contains('\0') {
        return Err(InterpError::BadRequest(
            "code must not contain NUL bytes".into(),
        ));
    }
    let env = req.env_vars.unwrap_or_default();
    validate_env(&env)?;
    let timeout = match req.timeout {
        None => None,
        Some(0.0) => None,
        Some(t) if t.is_finite() && t > 0.0 && t <= MAX_TIMEOUT_SECS => {
            Some(Duration::from_secs_f64(t))
        }
        Some(t) => {
            return Err(InterpError::BadRequest(format!(
                "timeout must be between 0 and {MAX_TIMEOUT_SECS} seconds, not {t}"
            )));
        }
    };
    let wanted = req.language.as_deref().filter(|l| !l.trim().is_empty());
    let ctx = match req.context_id.as_deref().filter(|id| !id.is_empty()) {
        Some(id) => {
            let ctx = s.contexts.get(id)?;
            if let Some(name) = wanted {
                let lang = language(Some(name))?;
                if lang != ctx.language {
                    return Err(InterpError::BadRequest(format!(
                        "context {id} runs {}, not {}",
                        ctx.language.name(),
                        lang.name()
                    )));
                }
            }
            ctx
        }
        None => {
            let lang = language(wanted)?;
            let user = user_of(&s.cfg, &headers)?;
            s.contexts.default_for(lang, user).await?
        }
    };
    // Cells of one context queue here, in order.
    let mut guard = ctx.state.clone().lock_owned().await;
    ctx.ensure_worker(&mut guard).await?;
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    let cell = Cell { code, env, timeout };
    tokio::spawn(exec::run(ctx, guard, cell, tx));
    let lines = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|line| (line, rx))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/x-ndjson")
        .body(Body::from_stream(lines))
        .map_err(InterpError::from)
}

/// Body of `POST /code/contexts`.
#[derive(Debug, Default, Deserialize)]
struct CreateRequest {
    cwd: Option<String>,
    language: Option<String>,
}

async fn create(
    State(s): Shared,
    headers: HeaderMap,
    body: Bytes,
) -> Result<axum::Json<ContextInfo>, InterpError> {
    let req: CreateRequest = parse(&body)?;
    let lang = language(req.language.as_deref())?;
    let user = user_of(&s.cfg, &headers)?;
    let cwd = req
        .cwd
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| s.contexts.default_cwd());
    let ctx = s.contexts.create(lang, cwd, user).await?;
    Ok(axum::Json(ctx.info()))
}

async fn list(State(s): Shared) -> axum::Json<Vec<ContextInfo>> {
    axum::Json(s.contexts.list())
}

async fn remove(State(s): Shared, Path(id): Path<String>) -> Result<StatusCode, InterpError> {
    s.contexts.remove(&id)?;
    Ok(StatusCode::NO_CONTENT)
}

async fn restart(State(s): Shared, Path(id): Path<String>) -> Result<StatusCode, InterpError> {
    s.contexts.restart(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}
