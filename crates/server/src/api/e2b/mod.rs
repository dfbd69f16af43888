//! E2B's REST control plane (`/sandboxes`, `/v2/sandboxes`, `/snapshots`, `/templates`), so
//! that E2B's SDKs pointed at sandpit with `E2B_API_URL` work unchanged. Each route maps onto
//! the same manager calls as sandpit's own `/v1` API; only names, shapes and statuses differ.

mod sandboxes;
mod templates;
pub mod types;

use super::{AppState, resolve_owner};
use crate::error::ApiError;
use axum::Router;
use axum::extract::{FromRequest, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use http::StatusCode;
use serde::Deserialize;
use std::collections::BTreeMap;

/// The envd protocol level the agent answers to: the SDKs switch features on by it, and
/// the agent serves everything they gate up to this version.
pub const ENVD_VERSION: &str = "0.6.4";

/// What E2B SDK callers see as the client that runs their sandboxes.
pub const CLIENT_ID: &str = "sandpit";

/// `[e2b]` of the config file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct E2bConfig {
    /// E2B template names (and aliases) that stand for sandpit templates. The SDKs create
    /// `base` by default and the code interpreter SDK `code-interpreter-v1`.
    #[serde(default = "default_aliases")]
    pub templates: BTreeMap<String, String>,
    /// Seconds without API calls before an E2B-created sandbox pauses (E2B sandboxes only
    /// end at their timeout, so 0, never, by default).
    #[serde(default)]
    pub idle_timeout_secs: u64,
}

fn default_aliases() -> BTreeMap<String, String> {
    [("base", "host"), ("code-interpreter-v1", "host")]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

impl Default for E2bConfig {
    fn default() -> Self {
        Self {
            templates: default_aliases(),
            idle_timeout_secs: 0,
        }
    }
}

/// An error in E2B's shape: `{code: <status>, message}`.
#[derive(Debug)]
pub struct E2bError(pub ApiError);

impl From<ApiError> for E2bError {
    fn from(e: ApiError) -> Self {
        Self(e)
    }
}

impl From<sandpit_store::StoreError> for E2bError {
    fn from(e: sandpit_store::StoreError) -> Self {
        Self(e.into())
    }
}

impl From<sandpit_runtime::RuntimeError> for E2bError {
    fn from(e: sandpit_runtime::RuntimeError) -> Self {
        Self(e.into())
    }
}

impl E2bError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self(ApiError::new(status, "e2b", message))
    }
    fn bad_request(message: impl Into<String>) -> Self {
        Self(ApiError::bad_request(message))
    }
}

impl IntoResponse for E2bError {
    fn into_response(self) -> Response {
        let e = self.0;
        if e.status.is_server_error() {
            tracing::warn!(status = %e.status, message = %e.message, "E2B request failed");
        }
        (
            e.status,
            axum::Json(types::Error {
                code: e.status.as_u16(),
                message: e.message,
            }),
        )
            .into_response()
    }
}

/// A JSON body; an empty body reads as the type's default, since the SDKs send none for
/// optional bodies.
pub struct Body<T>(pub T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned + Default> FromRequest<S> for Body<T> {
    type Rejection = E2bError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = axum::body::Bytes::from_request(req, state)
            .await
            .map_err(|e| E2bError::new(e.status(), e.body_text()))?;
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(Body(T::default()));
        }
        serde_json::from_slice(&bytes)
            .map(Body)
            .map_err(|e| E2bError::bad_request(format!("invalid JSON body: {e}")))
    }
}

/// A JSON body that must be present.
pub struct Required<T>(pub T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> FromRequest<S> for Required<T> {
    type Rejection = E2bError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = axum::body::Bytes::from_request(req, state)
            .await
            .map_err(|e| E2bError::new(e.status(), e.body_text()))?;
        serde_json::from_slice(&bytes)
            .map(Required)
            .map_err(|e| E2bError::bad_request(format!("invalid JSON body: {e}")))
    }
}

async fn authenticate(
    State(state): State<AppState>,
    mut req: Request,
    next: Next,
) -> Result<Response, E2bError> {
    let (owner, key_id) = resolve_owner(&state, req.headers()).await?;
    req.extensions_mut().insert(super::Owner(owner));
    if let Some(id) = key_id {
        req.extensions_mut().insert(crate::usage::ApiKeyId(id));
    }
    Ok(next.run(req).await)
}

/// RFC 3339 text of a unix-milliseconds time, as E2B's timestamps are written.
pub fn rfc3339(ms: i64) -> String {
    use time::format_description::well_known::Rfc3339;
    time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .ok()
        .and_then(|t| t.format(&Rfc3339).ok())
        .unwrap_or_else(|| "1970-01-01T00:00:00Z".into())
}

/// E2B's routes, authenticated with `X-API-Key` and answering errors in E2B's shape.
pub fn router(state: AppState) -> Router<AppState> {
    Router::new()
        .route(
            "/sandboxes",
            post(sandboxes::create).get(sandboxes::list_running),
        )
        .route(
            "/v2/sandboxes",
            post(sandboxes::create).get(sandboxes::list),
        )
        .route(
            "/sandboxes/{id}",
            get(sandboxes::detail).delete(sandboxes::kill),
        )
        .route("/sandboxes/{id}/timeout", post(sandboxes::set_timeout))
        .route("/sandboxes/{id}/refreshes", post(sandboxes::refresh))
        .route("/sandboxes/{id}/pause", post(sandboxes::pause))
        .route("/sandboxes/{id}/resume", post(sandboxes::resume))
        .route("/sandboxes/{id}/connect", post(sandboxes::connect))
        .route("/v2/sandboxes/{id}/connect", post(sandboxes::connect))
        .route("/sandboxes/{id}/fork", post(sandboxes::fork))
        .route("/sandboxes/{id}/metrics", get(sandboxes::metrics))
        .route("/sandboxes/{id}/snapshots", post(templates::snapshot))
        .route("/snapshots", get(templates::list_snapshots))
        .route("/templates", get(templates::list))
        .route(
            "/templates/{id}",
            get(templates::get).delete(templates::delete),
        )
        .route("/templates/aliases/{alias}", get(templates::alias))
        .layer(axum::extract::DefaultBodyLimit::max(super::JSON_LIMIT))
        .layer(axum::middleware::from_fn_with_state(state, authenticate))
}

/// What an E2B client needs to reach a sandbox's data plane.
pub struct Access {
    pub envd_token: Option<String>,
    pub traffic_token: Option<String>,
    pub domain: String,
    /// Whether it may reach the internet (`None`: not said).
    pub internet: Option<bool>,
}

/// Tokens and domain of a sandbox, as its create, connect and detail answers carry them.
/// The traffic token is always given: the code interpreter SDK sends only it on some calls.
pub async fn access(
    state: &AppState,
    rec: &sandpit_store::SandboxRecord,
) -> Result<Access, E2bError> {
    let a = crate::proxy::access(&state.manager, &rec.id).await?;
    Ok(Access {
        envd_token: Some(a.envd_token),
        traffic_token: Some(a.traffic_token),
        domain: state.manager.cfg.proxy.domain(),
        internet: Some(false),
    })
}

/// What the `network` object and `allow_internet_access` of an E2B create ask for.
#[derive(Debug, Default)]
pub struct NetworkSpec {
    /// `allowPublicTraffic`: ports open without the traffic token.
    pub public: Option<bool>,
}

/// E2B's `network` object.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct E2bNetwork {
    allow_public_traffic: Option<bool>,
    #[serde(default)]
    allow_out: Vec<String>,
    #[serde(default)]
    deny_out: Vec<String>,
    #[serde(default)]
    dns_servers: Vec<String>,
    egress_proxy: Option<serde_json::Value>,
    mask_request_host: Option<String>,
    #[serde(default)]
    https_ports: Vec<u16>,
    rules: Option<serde_json::Value>,
}

/// Reads the network part of a create. Egress settings sandpit cannot honour are refused
/// rather than silently ignored.
pub fn network_spec(req: &types::NewSandbox) -> Result<NetworkSpec, E2bError> {
    let net: E2bNetwork = match &req.network {
        None | Some(serde_json::Value::Null) => E2bNetwork::default(),
        Some(v) => serde_json::from_value(v.clone())
            .map_err(|e| E2bError::bad_request(format!("invalid network: {e}")))?,
    };
    if req.allow_internet_access == Some(true)
        || !net.allow_out.is_empty()
        || !net.deny_out.is_empty()
        || !net.dns_servers.is_empty()
        || net.egress_proxy.as_ref().is_some_and(|v| !v.is_null())
        || net.mask_request_host.is_some()
        || net.rules.as_ref().is_some_and(|v| !v.is_null())
    {
        return Err(E2bError::bad_request(
            "egress network access is not available on this sandpit daemon",
        ));
    }
    if !net.https_ports.is_empty() {
        return Err(E2bError::bad_request(
            "httpsPorts is not supported: the proxy forwards plain HTTP to sandbox ports",
        ));
    }
    Ok(NetworkSpec {
        public: net.allow_public_traffic,
    })
}

/// Carries E2B's `secure` and network settings into a sandpit create.
pub fn apply_access(
    mut create: sandpit_api::CreateSandboxRequest,
    secure: Option<bool>,
    network: NetworkSpec,
) -> sandpit_api::CreateSandboxRequest {
    create.secure = secure;
    create.public = network.public;
    create
}
