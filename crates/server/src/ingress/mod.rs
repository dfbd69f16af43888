//! The ingress: the sandbox data-plane proxy on the daemon's own listener: requests addressed to a
//! sandbox port, by host name `{port}-{sandboxId}.{domain}` or by E2B's headers
//! `E2b-Sandbox-Id` / `E2b-Sandbox-Port`, go to that sandbox; everything else falls
//! through to the REST API.
//!
//! Port 49983 is the agent's envd protocol and 49999 its code interpreter (`/code/...`),
//! both over the daemon's agent connection; any other port is a TCP connection to
//! loopback inside the sandbox's network namespace. The proxy needs no API key: the
//! sandbox's own tokens are the credential (see [`auth`]).

pub mod api;
pub mod auth;
mod forward;
mod netns;

use crate::manager::Manager;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http::StatusCode;
use sandpit_store::SandboxState;
use serde::Deserialize;
use std::sync::Arc;

/// The envd port of E2B's sandboxes, served by the agent.
pub const ENVD_PORT: u16 = 49983;
/// The code interpreter's port, served by the agent under `/code`.
pub const CODE_PORT: u16 = 49999;
/// Path prefix of the code interpreter in the agent.
pub const CODE_PREFIX: &str = "/code";
/// Set on every request the proxy forwards; a request that comes back with it (a
/// sandbox that can reach the daemon, forwarding to itself) is refused, not looped.
pub const LOOP_HEADER: &str = "sandpit-proxied";
/// Domain of host-form addresses when the config names none.
pub const DEFAULT_DOMAIN: &str = "sandpit.localhost";

/// `[proxy]` in the config file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ProxyConfig {
    /// Sandbox ports are addressed as `{port}-{id}.{domain}`; may carry a `:port`, which
    /// then also appears in URLs handed out (default `sandpit.localhost:<listen port>`).
    pub domain: Option<String>,
    /// Also route `{port}-{id}.<any other name>` (for a daemon reached under several
    /// names); only names whose first label has exactly the shape the daemon gives ids.
    pub any_domain: bool,
    /// Scheme of URLs handed out (`https` behind a TLS-terminating front end).
    pub scheme: String,
    /// The daemon's listen port (set at start, not read from the file).
    #[serde(skip)]
    pub listen_port: u16,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        Self {
            domain: None,
            any_domain: true,
            scheme: "http".into(),
            listen_port: 0,
        }
    }
}

impl ProxyConfig {
    /// The domain of host-form addresses, with the port clients must use when it is not
    /// the scheme's default (what E2B's create response calls `domain`).
    pub fn domain(&self) -> String {
        match &self.domain {
            Some(d) => d.clone(),
            None if self.listen_port == 0 => DEFAULT_DOMAIN.to_string(),
            None => format!("{DEFAULT_DOMAIN}:{}", self.listen_port),
        }
    }

    /// Refuses settings that would make unusable or unsafe URLs.
    pub fn check(&self) -> Result<(), crate::config::ConfigError> {
        use crate::config::ConfigError;
        if !matches!(self.scheme.as_str(), "http" | "https") {
            return Err(ConfigError::Scheme(self.scheme.clone()));
        }
        if let Some(d) = &self.domain {
            let host = strip_port(d);
            let port_ok = d == host || d[host.len() + 1..].parse::<u16>().is_ok_and(|p| p > 0);
            let host_ok = !host.is_empty()
                && host.len() <= 253
                && host.split('.').all(|l| {
                    !l.is_empty()
                        && l.len() <= 63
                        && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                });
            if !port_ok || !host_ok {
                return Err(ConfigError::Domain(d.clone()));
            }
        }
        Ok(())
    }

    /// The configured domain without any port, lowercase, for matching host names.
    fn bare_domain(&self) -> String {
        strip_port(&self.domain()).to_ascii_lowercase()
    }
}

/// Where a proxied request goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub sandbox_id: String,
    pub port: u16,
    /// Addressed by host name (cookies set for it are scoped to this one sandbox port).
    pub by_host: bool,
}

/// What a port is served by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    Envd,
    CodeInterpreter,
    Port(u16),
}

impl Target {
    /// The target of sandbox port `port`.
    pub fn of(port: u16) -> Self {
        match port {
            ENVD_PORT => Target::Envd,
            CODE_PORT => Target::CodeInterpreter,
            p => Target::Port(p),
        }
    }
}

fn strip_port(host: &str) -> &str {
    if host.starts_with('[') {
        // An IPv6 literal never names a sandbox.
        return host;
    }
    host.rsplit_once(':')
        .filter(|(_, p)| p.bytes().all(|b| b.is_ascii_digit()))
        .map_or(host, |(h, _)| h)
}

/// Ids as E2B-style clients may send them: short, and safe in logs and paths.
fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

/// Exactly the shape of ids this daemon makes (see `manager::new_id`).
fn daemon_id_shape(id: &str) -> bool {
    id.len() == 20 && valid_id(id)
}

fn parse_port(s: &str) -> Option<u16> {
    if s.is_empty() || s.len() > 5 || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse::<u16>().ok().filter(|p| *p > 0)
}

/// A request that names a sandbox in a malformed way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouteError {
    /// E2B's headers are incomplete or malformed (400).
    BadHeaders(&'static str),
    /// The id cannot name any sandbox (502, as an unknown one).
    NoSuchSandbox(String),
}

impl IntoResponse for RouteError {
    fn into_response(self) -> Response {
        match self {
            RouteError::BadHeaders(m) => error_body(StatusCode::BAD_REQUEST, m, None, None),
            RouteError::NoSuchSandbox(id) => not_found(&id),
        }
    }
}

/// The sandbox port a request is addressed to: `Ok(None)` for the REST API.
pub fn route_of(
    headers: &http::HeaderMap,
    uri: &http::Uri,
    cfg: &ProxyConfig,
) -> Result<Option<Route>, RouteError> {
    let id = headers.get("e2b-sandbox-id");
    let port = headers.get("e2b-sandbox-port");
    if id.is_some() || port.is_some() {
        let (Some(id), Some(port)) = (id, port) else {
            return Err(RouteError::BadHeaders(
                "E2b-Sandbox-Id and E2b-Sandbox-Port go together",
            ));
        };
        let id = id.to_str().unwrap_or_default().trim();
        let port = port.to_str().unwrap_or_default().trim();
        let Some(port) = parse_port(port) else {
            return Err(RouteError::BadHeaders(
                "E2b-Sandbox-Port must be a port number",
            ));
        };
        if !valid_id(id) {
            return Err(RouteError::NoSuchSandbox(id.to_string()));
        }
        return Ok(Some(Route {
            sandbox_id: id.to_string(),
            port,
            by_host: false,
        }));
    }
    Ok(host_route(headers, uri, cfg))
}

/// The sandbox port the request's host name (`{port}-{id}.{domain}`) addresses, if any;
/// E2B's headers are not looked at.
pub(crate) fn host_route(
    headers: &http::HeaderMap,
    uri: &http::Uri,
    cfg: &ProxyConfig,
) -> Option<Route> {
    // HTTP/2 carries the host in the URI's authority, HTTP/1.1 in the Host header.
    let host = match uri.authority() {
        Some(a) => a.as_str().to_string(),
        None => headers
            .get(http::header::HOST)
            .and_then(|h| h.to_str().ok())?
            .to_string(),
    };
    let host = host.rsplit_once('@').map_or(host.as_str(), |(_, h)| h);
    let host = strip_port(host).trim_end_matches('.').to_ascii_lowercase();
    let (label, rest) = host.split_once('.')?;
    let (port, id) = label.split_once('-')?;
    let port = parse_port(port)?;
    let ours = rest == cfg.bare_domain();
    if (ours && valid_id(id)) || (cfg.any_domain && !rest.is_empty() && daemon_id_shape(id)) {
        return Some(Route {
            sandbox_id: id.to_string(),
            port,
            by_host: true,
        });
    }
    None
}

/// A JSON error in the shape of E2B's proxy: `{code, message, sandboxId[, port]}`.
pub(crate) fn error_body(
    status: StatusCode,
    message: impl Into<String>,
    sandbox: Option<&str>,
    port: Option<u16>,
) -> Response {
    let mut body = serde_json::json!({
        "code": status.as_u16(),
        "message": message.into(),
    });
    if let Some(id) = sandbox {
        body["sandboxId"] = id.into();
    }
    if let Some(p) = port {
        body["port"] = p.into();
    }
    (status, axum::Json(body)).into_response()
}

/// 502: no such sandbox (or not one a request may reach: ended, being deleted, idle in
/// a pool). E2B's SDKs recognise "was not found".
pub(crate) fn not_found(id: &str) -> Response {
    error_body(
        StatusCode::BAD_GATEWAY,
        "The sandbox was not found",
        Some(id),
        None,
    )
}

/// 502: nothing listens on the port. E2B's SDKs recognise "port is not open".
pub(crate) fn port_not_open(id: &str, port: u16) -> Response {
    error_body(
        StatusCode::BAD_GATEWAY,
        format!("The sandbox is running but port is not open: nothing listens on port {port}"),
        Some(id),
        Some(port),
    )
}

/// What the ingress needs: the sandboxes, and how their ports are addressed.
pub struct Ingress {
    pub manager: Arc<Manager>,
    pub config: Arc<ProxyConfig>,
}

/// Routes sandbox-port requests to the proxy and all others to the REST API.
pub async fn dispatch(State(ing): State<Arc<Ingress>>, req: Request, next: Next) -> Response {
    match route_of(req.headers(), req.uri(), &ing.config) {
        Ok(None) => match crate::tls::unrouted_files(req.uri()) {
            Some(refused) => refused,
            None => next.run(req).await,
        },
        Ok(Some(route)) => {
            let info = req.extensions().get::<crate::tls::ConnInfo>();
            if let Err(refused) =
                crate::tls::check_names(info, req.headers(), req.uri(), &route, &ing.config)
            {
                return refused;
            }
            let https = ing.config.scheme == "https";
            handle(ing.manager.clone(), https, route, req).await
        }
        Err(e) => e.into_response(),
    }
}

async fn handle(m: Arc<Manager>, https: bool, route: Route, req: Request) -> Response {
    let id = route.sandbox_id.as_str();
    if req.headers().contains_key(LOOP_HEADER) {
        return error_body(
            StatusCode::LOOP_DETECTED,
            "the request came back to the proxy it was forwarded by",
            Some(id),
            Some(route.port),
        );
    }
    let rec = match m.find(id).await {
        Ok(Some(r)) => r,
        Ok(None) => return not_found(id),
        Err(e) => {
            tracing::warn!(id, error = %e, "proxy: reading the sandbox failed");
            return error_body(
                StatusCode::BAD_GATEWAY,
                "the sandbox could not be looked up",
                Some(id),
                None,
            );
        }
    };
    if !reachable(&rec) {
        return not_found(id);
    }
    let mut access = match crate::access::access(&m, id).await {
        Ok(a) => a,
        Err(sandpit_core::CoreError::SandboxNotFound(_)) => return not_found(id),
        Err(e) => {
            return error_body(StatusCode::BAD_GATEWAY, e.chain(), Some(id), None);
        }
    };
    if !isolated(&m, &rec.runtime) {
        crate::access::enforce_unisolated(&mut access);
    }
    let target = Target::of(route.port);
    let grant = match auth::authorize(&route, target, &access, &req) {
        Ok(g) => g,
        Err(denied) => return denied.into_response(id, route.port),
    };
    // Only now, with a valid credential, may the request wake a paused sandbox. A
    // running one needs no second read of its record.
    let (rec, conn) = if rec.state == SandboxState::Running {
        match m.runtime_of(&rec) {
            Ok((_, h)) => {
                m.touch(id);
                let conn = m.conn_for(id, &h);
                (rec, conn)
            }
            Err(e) => return agent_error(id, e),
        }
    } else {
        match m.agent(&rec.owner, id).await {
            Ok(x) => x,
            Err(e) => return agent_error(id, e),
        }
    };
    forward::forward(forward::Job {
        manager: m,
        https,
        rec,
        conn,
        route,
        target,
        grant,
        req,
    })
    .await
}

fn isolated(m: &Manager, runtime: &str) -> bool {
    m.is_isolated(runtime)
}

/// Whether the proxy may reach a sandbox in this state at all.
fn reachable(rec: &sandpit_store::SandboxRecord) -> bool {
    rec.owner != crate::pools::POOL_OWNER
        && !rec.state.is_final()
        && !matches!(rec.state, SandboxState::Stopping)
}

fn agent_error(id: &str, e: sandpit_core::CoreError) -> Response {
    use sandpit_core::CoreError as E;
    if matches!(
        e,
        E::SandboxNotFound(_) | E::NotFound(_) | E::SandboxStopped { .. }
    ) {
        return not_found(id);
    }
    error_body(StatusCode::BAD_GATEWAY, e.chain(), Some(id), None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> ProxyConfig {
        ProxyConfig {
            listen_port: 3000,
            ..Default::default()
        }
    }

    fn route(host: &str) -> Option<Route> {
        let mut h = http::HeaderMap::new();
        h.insert(http::header::HOST, host.parse().unwrap());
        route_of(&h, &"/x".parse().unwrap(), &cfg()).unwrap()
    }

    const ID: &str = "abcdefghij0123456789";

    #[test]
    fn host_form() {
        let r = route(&format!("8080-{ID}.sandpit.localhost:3000")).unwrap();
        assert_eq!((r.sandbox_id.as_str(), r.port, r.by_host), (ID, 8080, true));
        // Short ids only under the configured domain; case does not matter.
        assert_eq!(
            route("49983-abc.SANDPIT.localhost").unwrap().sandbox_id,
            "abc"
        );
        assert!(route("49983-abc.example.com").is_none());
        assert_eq!(route(&format!("1-{ID}.example.com")).unwrap().port, 1);
        // REST names and malformed labels fall through.
        for h in [
            "127.0.0.1:3000",
            "localhost",
            "api.sandpit.localhost",
            "0-abc.sandpit.localhost",
            "65536-abc.sandpit.localhost",
            "x80-abc.sandpit.localhost",
            "80-ABC_d.sandpit.localhost",
            "[::1]:3000",
        ] {
            assert!(route(h).is_none(), "{h}");
        }
    }

    #[test]
    fn header_form_wins_and_must_be_whole() {
        let mut h = http::HeaderMap::new();
        h.insert(http::header::HOST, "127.0.0.1:3000".parse().unwrap());
        h.insert("E2b-Sandbox-Id", ID.parse().unwrap());
        h.insert("e2b-sandbox-port", "49983".parse().unwrap());
        let r = route_of(&h, &"/".parse().unwrap(), &cfg())
            .unwrap()
            .unwrap();
        assert_eq!((r.port, r.by_host), (49983, false));
        h.remove("e2b-sandbox-port");
        assert!(matches!(
            route_of(&h, &"/".parse().unwrap(), &cfg()),
            Err(RouteError::BadHeaders(_))
        ));
        h.insert("e2b-sandbox-port", "http".parse().unwrap());
        assert!(route_of(&h, &"/".parse().unwrap(), &cfg()).is_err());
    }

    #[test]
    fn domains() {
        assert_eq!(cfg().domain(), "sandpit.localhost:3000");
        let c = ProxyConfig {
            domain: Some("Sandboxes.Example.com".into()),
            ..cfg()
        };
        assert_eq!(c.bare_domain(), "sandboxes.example.com");
        assert_eq!(strip_port("a.b:80"), "a.b");
        assert_eq!(Target::of(49999), Target::CodeInterpreter);
        assert_eq!(Target::of(8080), Target::Port(8080));
    }
}
