//! E2B's REST control plane (`/sandboxes`, `/v2/sandboxes`, `/snapshots`, `/templates`,
//! `/secrets`, `/volumes`), so
//! that E2B's SDKs pointed at sandpit with `E2B_API_URL` work unchanged. Each route maps onto
//! the same manager calls as sandpit's own `/v1` API; only names, shapes and statuses differ.

pub mod builds;
mod lifecycle;
mod listing;
mod metrics;
pub mod rules;
mod sandboxes;
pub mod secrets;
mod templates;
pub mod types;
pub mod volume_content;
pub mod volumes;

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
    /// Whether an E2B create that says nothing of the network gets internet access (mode
    /// `open`: the always-blocked host, private and metadata ranges stay blocked), as on
    /// E2B. `false` leaves such sandboxes on the daemon's `[network] default_mode`.
    #[serde(default = "yes")]
    pub internet_by_default: bool,
    /// Whether E2B-created sandboxes get a `sudo` that runs commands as their root through
    /// the agent, and a `python` alias of `python3`, as E2B's base image has both
    /// (container runtime only). `false` leaves both out: `sudo` is then not found.
    #[serde(default = "yes")]
    pub sudo: bool,
    /// Whether the ports of an E2B create that does not set `allowPublicTraffic` are open
    /// without the traffic token, as E2B's default is. `false` makes them private.
    #[serde(default = "yes")]
    pub public_ports: bool,
    /// Images E2B template builds may start from (`fromImage`), mapped to the absolute
    /// path of a local OCI layout or `docker save` tarball, or to a template name: this
    /// daemon pulls nothing from a registry.
    #[serde(default)]
    pub images: BTreeMap<String, String>,
}

fn yes() -> bool {
    true
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
            internet_by_default: true,
            sudo: true,
            public_ports: true,
            images: BTreeMap::new(),
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

impl From<sandpit_core::CoreError> for E2bError {
    fn from(e: sandpit_core::CoreError) -> Self {
        Self(e.into())
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
        let bytes = body_bytes(req, state).await?;
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(Body(T::default()));
        }
        parse(&bytes).map(Body)
    }
}

/// A JSON body that must be present.
pub struct Required<T>(pub T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> FromRequest<S> for Required<T> {
    type Rejection = E2bError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        parse(&body_bytes(req, state).await?).map(Required)
    }
}

/// The request's body, its rejections (too large, unreadable) in E2B's shape.
async fn body_bytes<S: Send + Sync>(
    req: Request,
    state: &S,
) -> Result<axum::body::Bytes, E2bError> {
    axum::body::Bytes::from_request(req, state)
        .await
        .map_err(|e| E2bError::new(e.status(), e.body_text()))
}

fn parse<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, E2bError> {
    serde_json::from_slice(bytes)
        .map_err(|e| E2bError::bad_request(format!("invalid JSON body: {e}")))
}

async fn authenticate(
    State(state): State<AppState>,
    mut req: Request,
    next: Next,
) -> Result<Response, E2bError> {
    let (owner, key_id) = resolve_owner(&state, req.headers()).await?;
    req.extensions_mut().insert(super::Owner(owner));
    if let Some(id) = key_id {
        req.extensions_mut().insert(crate::api::ApiKeyId(id));
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
        .route("/v2/sandboxes", post(sandboxes::create).get(listing::list))
        .route(
            "/sandboxes/{id}",
            get(sandboxes::detail).delete(sandboxes::kill),
        )
        .route("/sandboxes/{id}/timeout", post(lifecycle::set_timeout))
        .route("/sandboxes/{id}/refreshes", post(sandboxes::refresh))
        .route("/sandboxes/{id}/pause", post(sandboxes::pause))
        .route("/sandboxes/{id}/resume", post(sandboxes::resume))
        .route("/sandboxes/{id}/connect", post(sandboxes::connect))
        .route("/v2/sandboxes/{id}/connect", post(sandboxes::connect))
        .route("/sandboxes/{id}/fork", post(sandboxes::fork))
        .route("/sandboxes/{id}/metrics", get(metrics::sandbox))
        .route("/sandboxes/metrics", get(metrics::batch))
        .route(
            "/sandboxes/{id}/network",
            axum::routing::put(sandboxes::update_network),
        )
        .route("/sandboxes/{id}/snapshots", post(templates::snapshot))
        .route("/snapshots", get(templates::list_snapshots))
        .route("/templates", get(templates::list))
        .route(
            "/templates/{id}",
            get(templates::get).delete(templates::delete),
        )
        .route("/templates/aliases/{alias}", get(templates::alias))
        .route("/secrets", get(secrets::list).post(secrets::create))
        .route(
            "/secrets/{id}",
            get(secrets::get_one)
                .post(secrets::update)
                .delete(secrets::delete),
        )
        .route("/volumes", get(volumes::list).post(volumes::create))
        .route(
            "/volumes/{id}",
            get(volumes::get_one).delete(volumes::delete),
        )
        .merge(builds::routes())
        .layer(axum::extract::DefaultBodyLimit::max(super::JSON_LIMIT))
        .layer(axum::middleware::from_fn_with_state(state, authenticate))
        .merge(volumes::content_routes())
        .merge(builds::public_routes())
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
    let a = crate::access::access(&state.manager, &rec.id).await?;
    let internet = state
        .manager
        .net()
        .and_then(|n| n.policy_of(&rec.id))
        .map(|p| p.mode != sandpit_api::NetworkMode::None);
    Ok(Access {
        envd_token: Some(a.envd_token),
        traffic_token: Some(a.traffic_token),
        domain: state.ingress.domain(),
        internet: Some(internet.unwrap_or(false)),
    })
}

/// What the `network` object and `allow_internet_access` of an E2B create ask for.
#[derive(Debug, Default)]
pub struct NetworkSpec {
    /// `allowPublicTraffic`: ports open without the traffic token.
    pub public: Option<bool>,
    /// The egress policy (`None`: the daemon's default).
    pub policy: Option<sandpit_api::NetworkPolicy>,
}

/// E2B's `network` object (create), and the body of `PUT /sandboxes/{id}/network`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct E2bNetwork {
    allow_public_traffic: Option<bool>,
    #[serde(default)]
    allow_out: Vec<String>,
    #[serde(default)]
    deny_out: Vec<String>,
    #[serde(default)]
    dns_servers: Vec<String>,
    egress_proxy: Option<serde_json::Value>,
    /// Kept with the rules (`rules.rs`); the ingress sets it as the Host.
    pub(crate) mask_request_host: Option<String>,
    #[serde(default)]
    https_ports: Vec<u16>,
    /// Header rules, served by the broker (`rules.rs`).
    pub(crate) rules: Option<serde_json::Value>,
    /// Only in the update body.
    #[serde(rename = "allow_internet_access")]
    allow_internet_access: Option<bool>,
}

impl E2bNetwork {
    /// Refuses what sandpit cannot honour rather than ignoring it.
    fn check(&self) -> Result<(), E2bError> {
        let refuse = |what: &str, why: &str| {
            Err(E2bError::bad_request(format!(
                "{what} is not supported: {why}"
            )))
        };
        if !self.dns_servers.is_empty() {
            return refuse(
                "dnsServers",
                "sandboxes use the daemon's resolver, which enforces the policy",
            );
        }
        if self.egress_proxy.as_ref().is_some_and(|v| !v.is_null()) {
            return refuse("egressProxy", "egress goes through the daemon's own proxy");
        }
        if !self.https_ports.is_empty() {
            return refuse(
                "httpsPorts",
                "the proxy forwards plain HTTP to sandbox ports",
            );
        }
        Ok(())
    }
}

/// One `allowOut`/`denyOut` entry: an IP address or CIDR block, else a domain name.
fn egress_rule(
    entry: &str,
    action: sandpit_api::network::RuleAction,
    overrides: bool,
) -> sandpit_api::NetworkRule {
    let e = entry.trim();
    let cidr = match e.parse::<std::net::IpAddr>() {
        Ok(std::net::IpAddr::V4(_)) => Some(format!("{e}/32")),
        Ok(std::net::IpAddr::V6(_)) => Some(format!("{e}/128")),
        Err(_) if e.contains('/') => Some(e.to_string()),
        Err(_) => None,
    };
    sandpit_api::NetworkRule {
        action,
        domain: cidr.is_none().then(|| e.to_string()),
        cidr,
        ports: Vec::new(),
        overrides,
        name: None,
    }
}

/// E2B's egress settings as a sandpit policy. Internet access with `denyOut` entries is
/// mode `open` with deny rules, and `allowOut` entries win over them (as in E2B); denying
/// everything (`0.0.0.0/0`) or no internet access with `allowOut` entries is an
/// allowlist; no internet access and no entries is mode `none`.
pub fn egress_policy(
    internet: Option<bool>,
    allow_out: &[String],
    deny_out: &[String],
    default_internet: bool,
) -> Option<sandpit_api::NetworkPolicy> {
    use sandpit_api::NetworkMode;
    use sandpit_api::network::RuleAction;
    if internet.is_none() && allow_out.is_empty() && deny_out.is_empty() && !default_internet {
        return None;
    }
    let deny_all = deny_out
        .iter()
        .any(|d| matches!(d.trim(), "0.0.0.0/0" | "::/0"));
    let internet = internet.unwrap_or(true) && !deny_all;
    let allows = allow_out
        .iter()
        .map(|a| egress_rule(a, RuleAction::Allow, internet));
    let policy = if internet {
        sandpit_api::NetworkPolicy {
            mode: NetworkMode::Open,
            rules: deny_out
                .iter()
                .map(|d| egress_rule(d, RuleAction::Deny, false))
                .chain(allows)
                .collect(),
        }
    } else if allow_out.is_empty() {
        sandpit_api::NetworkPolicy {
            mode: NetworkMode::None,
            rules: Vec::new(),
        }
    } else {
        sandpit_api::NetworkPolicy {
            mode: NetworkMode::Allowlist,
            rules: allows.collect(),
        }
    };
    Some(policy)
}

/// Reads the network part of a create.
pub fn network_spec(
    req: &types::NewSandbox,
    default_internet: bool,
) -> Result<NetworkSpec, E2bError> {
    let net: E2bNetwork = match &req.network {
        None | Some(serde_json::Value::Null) => E2bNetwork::default(),
        Some(v) => serde_json::from_value(v.clone())
            .map_err(|e| E2bError::bad_request(format!("invalid network: {e}")))?,
    };
    net.check()?;
    Ok(NetworkSpec {
        // Unset stays unset: the create applies E2B's default (`lifecycle::public_ports`).
        public: net.allow_public_traffic,
        policy: egress_policy(
            req.allow_internet_access,
            &net.allow_out,
            &net.deny_out,
            default_internet,
        ),
    })
}

/// Reads the body of `PUT /sandboxes/{id}/network`: `None` when it changes no egress.
pub fn network_update(body: &E2bNetwork) -> Result<Option<sandpit_api::NetworkPolicy>, E2bError> {
    body.check()?;
    if body.allow_public_traffic.is_some() {
        return Err(E2bError::bad_request(
            "allowPublicTraffic cannot change here: PATCH /v1/sandboxes/{id}/access does",
        ));
    }
    Ok(egress_policy(
        body.allow_internet_access,
        &body.allow_out,
        &body.deny_out,
        true,
    ))
}

/// Carries E2B's `secure` and network settings into a sandpit create.
pub fn apply_access(
    mut create: sandpit_api::CreateSandboxRequest,
    secure: Option<bool>,
    network: NetworkSpec,
) -> sandpit_api::CreateSandboxRequest {
    create.secure = secure;
    create.public = network.public;
    create.network = network.policy;
    create
}

#[cfg(test)]
mod tests {
    use super::egress_policy;
    use sandpit_api::NetworkMode;
    use sandpit_api::network::RuleAction;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn nothing_said_follows_the_default() {
        let open = egress_policy(None, &[], &[], true).expect("a policy");
        assert_eq!(open.mode, NetworkMode::Open);
        assert!(open.rules.is_empty());
        assert_eq!(egress_policy(None, &[], &[], false), None);
    }

    #[test]
    fn no_internet_is_none_or_an_allowlist() {
        let none = egress_policy(Some(false), &[], &[], true).expect("a policy");
        assert_eq!(none.mode, NetworkMode::None);
        let list = egress_policy(
            Some(false),
            &s(&["api.example.com", "1.2.3.4", "10.0.0.0/8"]),
            &[],
            true,
        )
        .expect("a policy");
        assert_eq!(list.mode, NetworkMode::Allowlist);
        assert_eq!(list.rules[0].domain.as_deref(), Some("api.example.com"));
        assert_eq!(list.rules[1].cidr.as_deref(), Some("1.2.3.4/32"));
        assert_eq!(list.rules[2].cidr.as_deref(), Some("10.0.0.0/8"));
        assert!(
            list.rules
                .iter()
                .all(|r| r.action == RuleAction::Allow && !r.overrides)
        );
        // Denying everything is the same allowlist.
        let same = egress_policy(None, &s(&["api.example.com"]), &s(&["0.0.0.0/0"]), true)
            .expect("a policy");
        assert_eq!(same.mode, NetworkMode::Allowlist);
        assert_eq!(same.rules.len(), 1);
    }

    #[test]
    fn deny_entries_with_internet_are_deny_rules_that_allow_entries_override() {
        let p = egress_policy(
            None,
            &s(&["good.example.com"]),
            &s(&["evil.example.com", "::1"]),
            true,
        )
        .expect("a policy");
        assert_eq!(p.mode, NetworkMode::Open);
        assert_eq!(p.rules.len(), 3);
        assert_eq!(p.rules[0].action, RuleAction::Deny);
        assert_eq!(p.rules[0].domain.as_deref(), Some("evil.example.com"));
        assert_eq!(p.rules[1].cidr.as_deref(), Some("::1/128"));
        assert_eq!(p.rules[2].action, RuleAction::Allow);
        assert!(p.rules[2].overrides);
    }
}
