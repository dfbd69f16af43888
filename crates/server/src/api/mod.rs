//! The REST API under `/v1`: routing, authentication and request decoding.

pub mod agents;
pub mod approvals;
pub mod commands;
pub mod constraints;
pub mod e2b;
pub mod files;
pub mod leases;
pub mod metrics;
pub mod network;
pub mod passthrough;
pub mod pools;
pub mod sandboxes;
pub mod secrets;
pub mod snapshots;
pub mod templates;
pub mod usage;
pub mod volumes;

use crate::error::ApiError;
use crate::manager::Manager;
use axum::Router;
use axum::extract::{FromRequest, FromRequestParts, Request, State};
use axum::middleware::Next;
use axum::response::Response;
use axum::routing::{any, get, post};
use std::sync::Arc;
use utoipa::OpenApi;

/// Shared state of every handler.
#[derive(Clone)]
pub struct AppState {
    pub manager: Arc<Manager>,
    /// The server's own handle on the store: keys, auth, listings and usage reads.
    pub store: sandpit_store::Store,
    /// The credential broker, for the secrets API.
    pub broker: Arc<crate::broker::Broker>,
    /// When set, every request acts as this owner without a key (loopback only).
    pub no_auth_owner: Option<String>,
    /// Recently verified keys.
    pub keys: Arc<KeyCache>,
    /// How sandbox ports are addressed (`[proxy]`).
    pub ingress: Arc<crate::ingress::ProxyConfig>,
    /// Per-user leases.
    pub leases: Arc<crate::leases::Leases>,
    /// E2B compatibility settings.
    pub e2b: Arc<e2b::E2bConfig>,
    /// How the metrics history is sampled and kept (`[metrics]`).
    pub metrics: sandpit_core::metrics_history::MetricsConfig,
}

/// How long a verified API key is trusted without asking the store again; a revoked key
/// stops working within this time.
pub const KEY_CACHE_TTL: std::time::Duration = std::time::Duration::from_secs(5);
/// Most keys remembered at once (the cache is emptied when it would grow beyond).
const KEY_CACHE_MAX: usize = 4096;

/// API keys verified within the last [`KEY_CACHE_TTL`], so that a request costs no store
/// read for its key.
#[derive(Debug, Default)]
pub struct KeyCache(
    parking_lot::Mutex<std::collections::HashMap<String, (String, String, std::time::Instant)>>,
);

impl KeyCache {
    /// Owner and key id of a recently verified key.
    fn get(&self, key: &str) -> Option<(String, String)> {
        let map = self.0.lock();
        let (owner, id, at) = map.get(key)?;
        (at.elapsed() < KEY_CACHE_TTL).then(|| (owner.clone(), id.clone()))
    }

    fn put(&self, key: String, owner: String, id: String) {
        {
            let mut map = self.0.lock();
            if map.len() >= KEY_CACHE_MAX {
                map.clear();
            }
            map.insert(key, (owner, id, std::time::Instant::now()));
        }
    }
}

/// The authenticated owner of a request.
#[derive(Debug, Clone)]
pub struct Owner(pub String);

/// JSON bodies up to this size are accepted.
pub const JSON_LIMIT: usize = 1 << 20;

/// A JSON body whose rejections are answered in the API's error format.
pub struct ApiJson<T>(pub T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        use axum::extract::rejection::JsonRejection;
        let value = match axum::Json::<serde_json::Value>::from_request(req, state).await {
            Ok(axum::Json(v)) => v,
            Err(JsonRejection::BytesRejection(e))
                if e.status() == http::StatusCode::PAYLOAD_TOO_LARGE =>
            {
                return Err(ApiError::new(
                    http::StatusCode::PAYLOAD_TOO_LARGE,
                    "payload_too_large",
                    format!("request body exceeds {JSON_LIMIT} bytes"),
                ));
            }
            Err(JsonRejection::MissingJsonContentType(_)) => {
                return Err(ApiError::new(
                    http::StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "unsupported_media_type",
                    "expected Content-Type: application/json",
                ));
            }
            Err(e) => {
                return Err(ApiError::bad_request(format!(
                    "invalid JSON body: {}",
                    e.body_text()
                )));
            }
        };
        from_json_value(value).map(ApiJson)
    }
}

/// Reads a body a handler took as bytes, as [`ApiJson`] would; blank means `T::default()`
/// (ask for an `Option<T>` to take `null` as well).
pub(crate) fn json_or_default<T: serde::de::DeserializeOwned + Default>(
    body: &[u8],
) -> Result<T, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    let value: serde_json::Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))?;
    from_json_value(value)
}

fn from_json_value<T: serde::de::DeserializeOwned>(
    mut value: serde_json::Value,
) -> Result<T, ApiError> {
    integral_floats_as_integers(&mut value);
    serde_path_to_error::deserialize(value)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))
}

/// JSON has one number type: `5.0` is the integer 5 (and a schema's `integer` admits it),
/// but serde refuses a float for an integer field. Integral values that fit exactly are
/// rewritten as integers before the body is read.
fn integral_floats_as_integers(v: &mut serde_json::Value) {
    use serde_json::Value;
    // 2^53: beyond it an f64 no longer names one integer.
    const EXACT: f64 = 9_007_199_254_740_992.0;
    match v {
        Value::Number(n) => {
            if let Some(f) = n.as_f64().filter(|_| n.is_f64())
                && f.fract() == 0.0
                && f.abs() <= EXACT
            {
                *n = if f >= 0.0 {
                    serde_json::Number::from(f as u64)
                } else {
                    serde_json::Number::from(f as i64)
                };
            }
        }
        Value::Array(items) => items.iter_mut().for_each(integral_floats_as_integers),
        Value::Object(members) => members.values_mut().for_each(integral_floats_as_integers),
        _ => {}
    }
}

/// Path parameters whose rejections are answered in the API's error format (axum's own
/// extractor answers in plain text).
pub struct Path<T>(pub T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned + Send> FromRequestParts<S> for Path<T> {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut http::request::Parts,
        state: &S,
    ) -> Result<Self, Self::Rejection> {
        match axum::extract::Path::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(v)) => Ok(Path(v)),
            Err(e) if e.status().is_server_error() => Err(ApiError::internal(e.body_text())),
            Err(e) => Err(ApiError::bad_request(format!(
                "invalid path parameter: {}",
                e.body_text()
            ))),
        }
    }
}

/// Query strings whose rejections are answered in the API's error format.
pub struct ApiQuery<T>(pub T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut http::request::Parts,
        state: &S,
    ) -> Result<Self, Self::Rejection> {
        axum::extract::Query::<T>::from_request_parts(parts, state)
            .await
            .map(|q| ApiQuery(q.0))
            .map_err(|e| ApiError::bad_request(format!("invalid query: {}", e.body_text())))
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Owner {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut http::request::Parts,
        _state: &S,
    ) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<Owner>()
            .cloned()
            .ok_or_else(|| ApiError::unauthenticated("missing API key"))
    }
}

/// Reads the API key from `Authorization: Bearer` or E2B's `X-API-Key`.
fn presented_key(headers: &http::HeaderMap) -> Option<String> {
    if let Some(v) = headers.get("x-api-key").and_then(|v| v.to_str().ok()) {
        return Some(v.trim().to_string());
    }
    let auth = headers.get(http::header::AUTHORIZATION)?.to_str().ok()?;
    auth.strip_prefix("Bearer ").map(|k| k.trim().to_string())
}

/// The owner (and key id) a request's API key stands for; loopback `--insecure-no-auth`
/// daemons act as the admin owner without a key.
pub(crate) async fn resolve_owner(
    state: &AppState,
    headers: &http::HeaderMap,
) -> Result<(String, Option<String>), ApiError> {
    if let Some(o) = &state.no_auth_owner {
        return Ok((o.clone(), None));
    }
    let key = presented_key(headers).ok_or_else(|| {
        ApiError::unauthenticated("missing API key (Authorization: Bearer <key>)")
    })?;
    if let Some((owner, id)) = state.keys.get(&key) {
        return Ok((owner, Some(id)));
    }
    let found = state.store.authenticate(&key).await?;
    let (owner, id) = found
        .map(|k| (k.owner, k.id))
        // The empty owner marks idle pool sandboxes; no key may act as it.
        .filter(|(o, _)| !o.is_empty())
        .ok_or_else(|| ApiError::unauthenticated("invalid API key"))?;
    state.keys.put(key, owner.clone(), id.clone());
    Ok((owner, Some(id)))
}

async fn authenticate(
    State(state): State<AppState>,
    mut req: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let (owner, key_id) = resolve_owner(&state, req.headers()).await?;
    req.extensions_mut().insert(Owner(owner));
    if let Some(id) = key_id {
        req.extensions_mut().insert(ApiKeyId(id));
    }
    Ok(next.run(req).await)
}

#[derive(OpenApi)]
#[openapi(
    info(title = "sandpit", description = "Self-hosted sandboxes for AI agents."),
    paths(
        sandboxes::create, sandboxes::list, sandboxes::get, sandboxes::delete, sandboxes::set_timeout,
        sandboxes::keepalive,
        sandboxes::pause,
        sandboxes::resume, sandboxes::stats, sandboxes::info,
        commands::run, commands::list, commands::signal, commands::stdin, commands::stream, commands::attach,
        files::download, files::upload, files::list, files::stat, files::mkdir, files::move_path, files::copy, files::remove,
        pools::list, pools::get, pools::create, pools::resize, pools::delete,
        volumes::list, volumes::get, volumes::create, volumes::delete,
        sandboxes::fork, snapshots::create, snapshots::list, snapshots::get, snapshots::delete,
        snapshots::verify,
        templates::list, templates::get, templates::build, templates::progress, templates::delete,
        leases::acquire, leases::list, leases::get, leases::release,
        usage::summary, usage::sandbox, usage::executions, metrics::history,
        crate::ingress::api::get, crate::ingress::api::update, crate::ingress::api::port_url,
        secrets::create, secrets::list, secrets::get_one, secrets::delete, secrets::sandbox_get, secrets::sandbox_put,
        network::get_policy, network::set_policy, network::audit, network::audit_stream,
        agents::create, agents::list, agents::list_all, agents::get_one, agents::delete, agents::start_run,
        agents::get_run, agents::cancel, agents::events, agents::stream, agents::create_workspace,
        approvals::list, approvals::get_one, approvals::approve, approvals::deny,
    ),
    components(schemas(sandpit_api::ErrorBody, sandpit_api::CommandEvent, sandpit_api::ClientMessage)),
    modifiers(&BearerAuth)
)]
struct ApiDoc;

struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
        openapi.security = Some(vec![utoipa::openapi::security::SecurityRequirement::new(
            "bearer",
            Vec::<String>::new(),
        )]);
    }
}

/// The OpenAPI document of the API.
pub fn openapi() -> utoipa::openapi::OpenApi {
    ApiDoc::openapi()
}

/// The whole HTTP application: sandbox-port requests go to the proxy, the rest to the API.
pub fn router(state: AppState) -> Router {
    let ingress = Arc::new(crate::ingress::Ingress {
        manager: state.manager.clone(),
        config: state.ingress.clone(),
    });
    Router::new()
        .fallback_service(api_router(state))
        .layer(axum::middleware::from_fn_with_state(
            ingress,
            crate::ingress::dispatch,
        ))
}

/// The REST API alone.
fn api_router(state: AppState) -> Router {
    let doc = Arc::new(constraints::document(
        &openapi(),
        &constraints::DocConfig {
            max_timeout_secs: state.manager.config().max_timeout_secs,
            max_pool_size: state.manager.config().pool_limits.max_size,
            runtimes: state
                .manager
                .runtimes()
                .map(|(n, _)| n.to_string())
                // Offered only when the operator allows it (`--allow-process-runtime`).
                .filter(|n| n != "process" || state.manager.config().allow_process_runtime)
                .collect(),
        },
    ));
    let authed = Router::new()
        .merge(network::routes())
        .merge(metrics::routes())
        .merge(agents::routes())
        .merge(approvals::routes())
        .route("/v1/info", get(sandboxes::info))
        .route("/v1/templates", get(templates::list).post(templates::build))
        .route(
            "/v1/templates/{name}",
            get(templates::get).delete(templates::delete),
        )
        .route("/v1/templates/{name}/build", get(templates::progress))
        .route("/v1/pools", get(pools::list).post(pools::create))
        .route(
            "/v1/pools/{name}",
            get(pools::get).patch(pools::resize).delete(pools::delete),
        )
        .route("/v1/volumes", get(volumes::list).post(volumes::create))
        .route(
            "/v1/volumes/{name}",
            get(volumes::get).delete(volumes::delete),
        )
        .route(
            "/v1/sandboxes",
            post(sandboxes::create).get(sandboxes::list),
        )
        .route(
            "/v1/sandboxes/{id}",
            get(sandboxes::get).delete(sandboxes::delete),
        )
        .route("/v1/sandboxes/{id}/timeout", post(sandboxes::set_timeout))
        .route("/v1/sandboxes/{id}/keepalive", post(sandboxes::keepalive))
        .route("/v1/sandboxes/{id}/pause", post(sandboxes::pause))
        .route("/v1/sandboxes/{id}/resume", post(sandboxes::resume))
        .route("/v1/sandboxes/{id}/fork", post(sandboxes::fork))
        .route("/v1/sandboxes/{id}/snapshots", post(snapshots::create))
        .route("/v1/snapshots", get(snapshots::list))
        .route(
            "/v1/snapshots/{id}",
            get(snapshots::get).delete(snapshots::delete),
        )
        .route("/v1/snapshots/{id}/verify", post(snapshots::verify))
        .route("/v1/sandboxes/{id}/stats", get(sandboxes::stats))
        .route(
            "/v1/sandboxes/{id}/access",
            get(crate::ingress::api::get).patch(crate::ingress::api::update),
        )
        .route(
            "/v1/sandboxes/{id}/ports/{port}/url",
            post(crate::ingress::api::port_url),
        )
        .route("/v1/leases", get(leases::list))
        .route(
            "/v1/leases/{user}",
            get(leases::get).delete(leases::release),
        )
        .route("/v1/leases/{user}/acquire", post(leases::acquire))
        .route("/v1/usage", get(usage::summary))
        .route("/v1/sandboxes/{id}/usage", get(usage::sandbox))
        .route("/v1/sandboxes/{id}/executions", get(usage::executions))
        .route(
            "/v1/sandboxes/{id}/commands",
            post(commands::run).get(commands::list),
        )
        .route("/v1/sandboxes/{id}/commands/stream", get(commands::stream))
        .route(
            "/v1/sandboxes/{id}/commands/{pid}/stream",
            get(commands::attach),
        )
        .route(
            "/v1/sandboxes/{id}/commands/{pid}/signal",
            post(commands::signal),
        )
        .route(
            "/v1/sandboxes/{id}/commands/{pid}/stdin",
            post(commands::stdin),
        )
        .route("/v1/sandboxes/{id}/files/list", get(files::list))
        .route("/v1/sandboxes/{id}/files/stat", get(files::stat))
        .route("/v1/sandboxes/{id}/files/mkdir", post(files::mkdir))
        .route("/v1/sandboxes/{id}/files/move", post(files::move_path))
        .route("/v1/sandboxes/{id}/files/copy", post(files::copy))
        .merge(secrets::routes())
        .layer(axum::extract::DefaultBodyLimit::max(JSON_LIMIT))
        .route(
            "/v1/sandboxes/{id}/files",
            get(files::download)
                .put(files::upload)
                .post(files::upload)
                .delete(files::remove)
                .layer(axum::extract::DefaultBodyLimit::disable()),
        )
        .route(
            "/v1/sandboxes/{id}/agent/{*rest}",
            any(passthrough::forward).layer(axum::extract::DefaultBodyLimit::disable()),
        )
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            authenticate,
        ));
    Router::new()
        .route(
            "/v1/health",
            get(|| async { axum::Json(serde_json::json!({ "status": "ok" })) }),
        )
        .route(
            "/v1/openapi.json",
            get(move || async move { axum::Json(serde_json::Value::clone(&doc)) }),
        )
        .merge(authed)
        .merge(e2b::router(state.clone()))
        .fallback(|| async { ApiError::not_found("no such route") })
        .with_state(state)
}

/// The API key a request authenticated with (set by the authentication middleware).
#[derive(Debug, Clone)]
pub struct ApiKeyId(pub String);

/// Who made a request, for execution records: the owner and the API key's id.
#[derive(Debug, Clone)]
pub struct Caller(pub crate::usage::Caller);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut http::request::Parts,
        state: &S,
    ) -> Result<Self, Self::Rejection> {
        let owner = Owner::from_request_parts(parts, state).await?;
        Ok(Caller(crate::usage::Caller {
            owner: owner.0,
            api_key_id: parts.extensions.get::<ApiKeyId>().map(|k| k.0.clone()),
        }))
    }
}

/// A request body as the agent connection takes it: any body, boxed (uploads stream).
pub(crate) fn agent_body<B>(body: B) -> crate::agent_conn::AgentBody
where
    B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<sandpit_core::error::BoxError>,
{
    use http_body_util::BodyExt;
    body.map_err(Into::into).boxed_unsync()
}
