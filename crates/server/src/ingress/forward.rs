//! Forwarding an authorized request: to the agent (envd, code interpreter) over the
//! daemon's agent connection, or to a port inside the sandbox over a fresh TCP
//! connection, with HTTP upgrades (WebSocket) spliced both ways. Bodies stream in both
//! directions; nothing here times out a long stream.

use super::auth::{self, Grant};
use super::{CODE_PREFIX, LOOP_HEADER, Route, Target};
use crate::agent_conn::{AGENT_BASE, AgentConn};
use crate::manager::Manager;
use axum::body::Body;
use axum::extract::Request;
use axum::response::Response;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{StatusCode, Version};
use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use sandpit_store::SandboxRecord;
use std::sync::Arc;
use std::time::Duration;

/// How often a long-lived spliced connection (a WebSocket) counts as activity.
const SPLICE_TOUCH: Duration = Duration::from_secs(30);

/// One authorized request and what it goes to.
pub(super) struct Job {
    pub manager: Arc<Manager>,
    /// Whether the daemon is reached over https (cookies get `Secure`).
    pub https: bool,
    pub rec: SandboxRecord,
    pub conn: Arc<AgentConn>,
    pub route: Route,
    pub target: Target,
    pub grant: Grant,
    pub req: Request,
}

/// Marks the sandbox active when a forwarded exchange ends; while it lives, the agent
/// connection it holds keeps the sandbox from being paused for idleness.
struct Activity {
    manager: Arc<Manager>,
    id: String,
    _conn: Arc<AgentConn>,
}

impl Activity {
    /// Keeps the guard alive inside a body adapter.
    fn hold(&self) {}

    fn touch(&self) {
        self.manager.touch(&self.id);
    }
}

impl Drop for Activity {
    fn drop(&mut self) {
        self.touch();
    }
}

/// Forwards `job.req` and streams the answer back.
pub(super) async fn forward(job: Job) -> Response {
    let Job {
        manager,
        https,
        rec,
        conn,
        route,
        target,
        grant,
        req,
    } = job;
    let id = rec.id.clone();
    let (mut parts, body) = req.into_parts();
    let path = parts.uri.path().to_string();
    if !path.starts_with('/') {
        return super::error_body(
            StatusCode::BAD_REQUEST,
            "the request target must be a path",
            Some(&id),
            Some(route.port),
        );
    }
    let query = forwarded_query(parts.uri.query(), target, &grant);
    let path_and_query = match query {
        Some(q) if !q.is_empty() => format!("{path}?{q}"),
        _ => path,
    };
    clean_credentials(&mut parts.headers, target, &grant);
    manager.touch(&id);
    let activity = Activity {
        manager: manager.clone(),
        id: id.clone(),
        _conn: conn.clone(),
    };
    let mut resp = match target {
        Target::Envd => to_agent(&conn, "", parts, path_and_query, body, activity, &route).await,
        Target::CodeInterpreter => {
            to_agent(
                &conn,
                CODE_PREFIX,
                parts,
                path_and_query,
                body,
                activity,
                &route,
            )
            .await
        }
        Target::Port(port) => {
            let handle = match manager.runtime_of(&rec) {
                Ok((_, h)) => h,
                Err(_) => return super::not_found(&id),
            };
            let dest = Dest {
                pid: handle.pid,
                pid_start: handle.pid_start,
                port,
            };
            // E2B's `maskRequestHost`: the Host the sandbox's server sees.
            if let Some(mask) = manager.broker().mask_request_host(&id)
                && let Ok(v) =
                    HeaderValue::from_str(&crate::broker::transform::masked_host(&mask, port))
            {
                parts.headers.insert(header::HOST, v);
            }
            to_port(dest, parts, path_and_query, body, activity, &route).await
        }
    };
    if let Grant::PortSignature { expires, signature } = &grant
        && route.by_host
    {
        // Host-only cookie: the host names this one sandbox port.
        let max_age = (expires - auth::now_secs()).max(0);
        let secure = if https { "; Secure" } else { "" };
        let c = format!(
            "{}={expires}.{signature}; Max-Age={max_age}; Path=/; HttpOnly; SameSite=Lax{secure}",
            auth::PORT_COOKIE
        );
        if let Ok(v) = HeaderValue::from_str(&c) {
            resp.headers_mut().append(header::SET_COOKIE, v);
        }
    }
    resp
}

/// The query string passed on: a signed file URL forwards exactly what was signed; the
/// proxy's own signature parameters never reach the sandbox.
fn forwarded_query(query: Option<&str>, target: Target, grant: &Grant) -> Option<String> {
    if let Grant::FileSignature { path, username } = grant {
        let mut s = form_urlencoded::Serializer::new(String::new());
        s.append_pair("path", path);
        if let Some(u) = username {
            s.append_pair("username", u);
        }
        return Some(s.finish());
    }
    let query = query?;
    if target == Target::Envd {
        return Some(query.to_string());
    }
    // Filtered segment by segment, so the others keep their exact encoding.
    let kept: Vec<&str> = query
        .split('&')
        .filter(|seg| {
            let key = form_urlencoded::parse(seg.as_bytes())
                .next()
                .map(|(k, _)| k.into_owned())
                .unwrap_or_default();
            key != auth::PORT_EXPIRES_PARAM && key != auth::PORT_SIGNATURE_PARAM
        })
        .collect();
    Some(kept.join("&"))
}

/// Whether a value has the shape of a sandpit API key, in its own form (`sp_` + 40 hex
/// digits) or in the E2B form (`e2b_` + the same digits) that authenticates just as well.
fn daemon_key_shape(v: &str) -> bool {
    sandpit_store::e2b_key_form(v).is_some()
}

/// Whether any value of header `name` holds a word with the shape of a daemon key (every
/// value: a repeated header must not hide one behind a harmless first value).
fn carries_daemon_key(h: &HeaderMap, name: &HeaderName) -> bool {
    h.get_all(name).iter().any(|v| {
        String::from_utf8_lossy(v.as_bytes())
            .split_whitespace()
            .any(daemon_key_shape)
    })
}

/// Removes everything that authenticates to the daemon or to the proxy, so that no API
/// key, envd token or traffic token reaches a process in the sandbox. The agent only
/// needs `Authorization: Basic` (the user); a server on another port keeps its own
/// `Authorization` unless it carries a daemon key.
fn clean_credentials(h: &mut HeaderMap, target: Target, grant: &Grant) {
    for name in [
        "e2b-sandbox-id",
        "e2b-sandbox-port",
        auth::ENVD_TOKEN_HEADER,
        auth::TRAFFIC_TOKEN_HEADER,
        "proxy-authorization",
    ] {
        h.remove(name);
    }
    match target {
        Target::Envd | Target::CodeInterpreter => {
            h.remove("x-api-key");
            // Only the value the agent reads (the first) goes on, and only when it is Basic;
            // a repeated header must not carry anything else along with it.
            let first = h.get(header::AUTHORIZATION).cloned();
            h.remove(header::AUTHORIZATION);
            // A signed URL names its user in what was signed; a header must not change it.
            if !matches!(grant, Grant::FileSignature { .. })
                && let Some(v) = first
                && v.as_bytes()
                    .get(..6)
                    .is_some_and(|p| p.eq_ignore_ascii_case(b"basic "))
            {
                h.insert(header::AUTHORIZATION, v);
            }
        }
        Target::Port(_) => {
            for name in [HeaderName::from_static("x-api-key"), header::AUTHORIZATION] {
                if carries_daemon_key(h, &name) {
                    h.remove(name);
                }
            }
        }
    }
    strip_cookie(h, auth::PORT_COOKIE);
}

/// Drops one cookie from the Cookie headers, keeping the others.
fn strip_cookie(h: &mut HeaderMap, name: &str) {
    let values: Vec<String> = h
        .get_all(header::COOKIE)
        .iter()
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .collect();
    if !values.iter().any(|v| {
        v.split(';')
            .any(|p| p.trim().starts_with(&format!("{name}=")))
    }) {
        return;
    }
    h.remove(header::COOKIE);
    let kept: Vec<&str> = values
        .iter()
        .flat_map(|v| v.split(';'))
        .map(str::trim)
        .filter(|p| !p.is_empty() && !p.starts_with(&format!("{name}=")))
        .collect();
    if !kept.is_empty()
        && let Ok(v) = HeaderValue::from_str(&kept.join("; "))
    {
        h.insert(header::COOKIE, v);
    }
}

/// Whether a request asks to switch protocols (`Connection: upgrade` + `Upgrade`).
fn wants_upgrade(h: &HeaderMap) -> bool {
    h.contains_key(header::UPGRADE)
        && h.get_all(header::CONNECTION).iter().any(|v| {
            v.to_str()
                .unwrap_or("")
                .split(',')
                .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
        })
}

/// Removes hop-by-hop headers (those of RFC 9110 7.6.1 and any the Connection header
/// names); with `upgrade`, `Connection: upgrade` and `Upgrade` stay.
fn strip_hop(h: &mut HeaderMap, upgrade: bool) {
    let named: Vec<HeaderName> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
        .collect();
    for n in named {
        if !(upgrade && n == header::UPGRADE) {
            h.remove(n);
        }
    }
    for n in [
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
    ] {
        h.remove(n);
    }
    h.remove(header::CONNECTION);
    if upgrade {
        h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    } else {
        h.remove(header::UPGRADE);
    }
}

/// Sets the loop marker. Done after [`strip_hop`], which removes whatever the client's
/// `Connection` header names: the marker must not be one of them.
fn mark_proxied(h: &mut HeaderMap) {
    h.insert(LOOP_HEADER, HeaderValue::from_static("1"));
}

/// A streamed body that holds `activity` until it is done.
fn held_body(body: hyper::body::Incoming, activity: Activity) -> Body {
    Body::new(body.map_frame(move |f| {
        activity.hold();
        f
    }))
}

async fn to_agent(
    conn: &AgentConn,
    prefix: &str,
    mut parts: http::request::Parts,
    path_and_query: String,
    body: Body,
    activity: Activity,
    route: &Route,
) -> Response {
    strip_hop(&mut parts.headers, false);
    mark_proxied(&mut parts.headers);
    parts.headers.remove(header::HOST);
    // The agent speaks HTTP/1.1; a client's HTTP/2 stream is carried over it.
    parts.version = Version::HTTP_11;
    parts.uri = match format!("{AGENT_BASE}{prefix}{path_and_query}").parse() {
        Ok(u) => u,
        Err(_) => {
            return super::error_body(
                StatusCode::BAD_REQUEST,
                "invalid request path",
                Some(&route.sandbox_id),
                Some(route.port),
            );
        }
    };
    match conn
        .http
        .request(http::Request::from_parts(
            parts,
            crate::api::agent_body(body),
        ))
        .await
    {
        Ok(resp) => {
            let (mut p, b) = resp.into_parts();
            strip_hop(&mut p.headers, false);
            Response::from_parts(p, held_body(b, activity))
        }
        Err(e) => {
            tracing::debug!(id = %route.sandbox_id, error = %e, "proxy: the agent did not answer");
            super::port_not_open(&route.sandbox_id, route.port)
        }
    }
}

/// Where a port's connections go.
struct Dest {
    pid: i32,
    pid_start: u64,
    port: u16,
}

async fn to_port(
    dest: Dest,
    mut parts: http::request::Parts,
    path_and_query: String,
    body: Body,
    activity: Activity,
    route: &Route,
) -> Response {
    let id = route.sandbox_id.as_str();
    let stream = match super::netns::connect(dest.pid, dest.pid_start, dest.port).await {
        Ok(s) => s,
        Err(super::netns::ConnectError::Refused(p)) => return super::port_not_open(id, p),
        Err(super::netns::ConnectError::Gone) => return super::not_found(id),
        Err(e) => {
            tracing::warn!(id, port = dest.port, error = %e, "proxy: connecting to a sandbox port failed");
            return super::error_body(
                StatusCode::BAD_GATEWAY,
                format!("cannot connect to port {}: {e}", dest.port),
                Some(id),
                Some(dest.port),
            );
        }
    };
    let (mut sender, connection) =
        match hyper::client::conn::http1::handshake::<_, Body>(TokioIo::new(stream)).await {
            Ok(x) => x,
            Err(e) => {
                return super::error_body(
                    StatusCode::BAD_GATEWAY,
                    format!("port {}: {e}", dest.port),
                    Some(id),
                    Some(dest.port),
                );
            }
        };
    tokio::spawn(async move {
        if let Err(e) = connection.with_upgrades().await {
            tracing::debug!(error = %e, "proxy: a sandbox port connection ended with an error");
        }
    });
    // Only an HTTP/1.1 client connection can be taken over; over HTTP/2 the request goes
    // as a plain one.
    let downstream = if wants_upgrade(&parts.headers) {
        parts.extensions.remove::<hyper::upgrade::OnUpgrade>()
    } else {
        None
    };
    strip_hop(&mut parts.headers, downstream.is_some());
    mark_proxied(&mut parts.headers);
    if !parts.headers.contains_key(header::HOST)
        && let Some(a) = parts.uri.authority()
        && let Ok(v) = HeaderValue::from_str(a.as_str())
    {
        parts.headers.insert(header::HOST, v);
    }
    parts.version = Version::HTTP_11;
    parts.uri = match path_and_query.parse() {
        Ok(u) => u,
        Err(_) => {
            return super::error_body(
                StatusCode::BAD_REQUEST,
                "invalid request path",
                Some(id),
                Some(dest.port),
            );
        }
    };
    let mut resp = match sender
        .send_request(http::Request::from_parts(parts, body))
        .await
    {
        Ok(r) => r,
        Err(e) => {
            return super::error_body(
                StatusCode::BAD_GATEWAY,
                format!(
                    "the server on port {} closed the connection: {e}",
                    dest.port
                ),
                Some(id),
                Some(dest.port),
            );
        }
    };
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        let Some(downstream) = downstream else {
            return super::error_body(
                StatusCode::BAD_GATEWAY,
                "the sandbox's server switched protocols unasked",
                Some(id),
                Some(dest.port),
            );
        };
        let upstream = hyper::upgrade::on(&mut resp);
        tokio::spawn(splice(upstream, downstream, activity));
        let (p, _) = resp.into_parts();
        return Response::from_parts(p, Body::empty());
    }
    let (mut p, b) = resp.into_parts();
    strip_hop(&mut p.headers, false);
    Response::from_parts(p, held_body(b, activity))
}

/// Copies bytes both ways between the client and the sandbox until either side closes.
async fn splice(
    upstream: hyper::upgrade::OnUpgrade,
    downstream: hyper::upgrade::OnUpgrade,
    activity: Activity,
) {
    let (up, down) = match tokio::join!(upstream, downstream) {
        (Ok(u), Ok(d)) => (u, d),
        (u, d) => {
            tracing::debug!(
                upstream = u.is_ok(),
                downstream = d.is_ok(),
                "proxy: an upgrade did not complete"
            );
            return;
        }
    };
    let mut up = TokioIo::new(up);
    let mut down = TokioIo::new(down);
    let copy = tokio::io::copy_bidirectional(&mut down, &mut up);
    tokio::pin!(copy);
    let mut tick = tokio::time::interval(SPLICE_TOUCH);
    loop {
        tokio::select! {
            r = &mut copy => {
                if let Err(e) = r {
                    tracing::debug!(id = %activity.id, error = %e, "proxy: a spliced connection ended with an error");
                }
                break;
            }
            _ = tick.tick() => activity.touch(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_go() {
        let mut h = HeaderMap::new();
        h.insert("connection", "keep-alive, x-secret".parse().unwrap());
        h.insert("x-secret", "1".parse().unwrap());
        h.insert("keep-alive", "timeout=5".parse().unwrap());
        h.insert("upgrade", "websocket".parse().unwrap());
        h.insert("x-kept", "1".parse().unwrap());
        let mut up = h.clone();
        strip_hop(&mut h, false);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("x-kept"));
        up.insert("connection", "Upgrade".parse().unwrap());
        assert!(wants_upgrade(&up));
        strip_hop(&mut up, true);
        assert_eq!(up["connection"], "upgrade");
        assert_eq!(up["upgrade"], "websocket");
    }

    #[test]
    fn credentials_never_reach_the_sandbox() {
        let key = format!("sp_{}", "ab".repeat(20));
        let mut h = HeaderMap::new();
        h.insert("x-api-key", key.parse().unwrap());
        h.insert("authorization", format!("Bearer {key}").parse().unwrap());
        h.insert("x-access-token", "t".parse().unwrap());
        h.insert("e2b-traffic-access-token", "t".parse().unwrap());
        h.insert("e2b-sandbox-id", "x".parse().unwrap());
        h.insert(
            "cookie",
            format!("a=1; {}=9.sig; b=2", auth::PORT_COOKIE)
                .parse()
                .unwrap(),
        );
        let mut port = h.clone();
        clean_credentials(&mut port, Target::Port(8080), &Grant::Token);
        assert_eq!(port.len(), 1);
        assert_eq!(port["cookie"], "a=1; b=2");
        // The E2B form of the same key is the same secret: it is stripped too.
        let e2b_key = format!("e2b_{}", "ab".repeat(20));
        let mut e2b = HeaderMap::new();
        e2b.insert("x-api-key", e2b_key.parse().unwrap());
        e2b.insert(
            "authorization",
            format!("Bearer {e2b_key}").parse().unwrap(),
        );
        clean_credentials(&mut e2b, Target::Port(8080), &Grant::Token);
        assert!(e2b.is_empty(), "{e2b:?}");
        // An application's own bearer token passes to its port, not to the agent.
        let mut app = HeaderMap::new();
        app.insert("authorization", "Bearer app-token".parse().unwrap());
        let mut agent = app.clone();
        clean_credentials(&mut app, Target::Port(8080), &Grant::Token);
        assert_eq!(app["authorization"], "Bearer app-token");
        clean_credentials(&mut agent, Target::Envd, &Grant::Token);
        assert!(agent.is_empty());
        // Basic names the user for the agent, unless a signed URL fixed the user.
        let mut basic = HeaderMap::new();
        basic.insert("authorization", "Basic cm9vdDo=".parse().unwrap());
        let mut signed = basic.clone();
        clean_credentials(&mut basic, Target::Envd, &Grant::Token);
        assert_eq!(basic["authorization"], "Basic cm9vdDo=");
        let g = Grant::FileSignature {
            path: "/a".into(),
            username: None,
        };
        clean_credentials(&mut signed, Target::Envd, &g);
        assert!(signed.is_empty());
        // Repeated headers: every value counts, and only the agent's one Basic value stays.
        let mut twice = HeaderMap::new();
        twice.append("x-api-key", "app-key".parse().unwrap());
        twice.append("x-api-key", key.parse().unwrap());
        twice.append("authorization", "Basic cm9vdDo=".parse().unwrap());
        twice.append("authorization", format!("Bearer\t{key}").parse().unwrap());
        let mut agent = twice.clone();
        clean_credentials(&mut twice, Target::Port(8080), &Grant::Token);
        assert!(twice.is_empty(), "{twice:?}");
        clean_credentials(&mut agent, Target::CodeInterpreter, &Grant::Token);
        assert_eq!(agent.len(), 1, "{agent:?}");
        assert_eq!(agent["authorization"], "Basic cm9vdDo=");
    }

    #[test]
    fn queries() {
        let g = Grant::FileSignature {
            path: "/a b".into(),
            username: Some("user".into()),
        };
        assert_eq!(
            forwarded_query(Some("path=x&signature=s&extra=1"), Target::Envd, &g).unwrap(),
            "path=%2Fa+b&username=user"
        );
        let q = "a=%20x&sandpit_expires=1&sandpit_signature=v1_x&b=+";
        assert_eq!(
            forwarded_query(Some(q), Target::Port(80), &Grant::Open).unwrap(),
            "a=%20x&b=+"
        );
        assert_eq!(
            forwarded_query(Some("path=x"), Target::Envd, &Grant::Token).unwrap(),
            "path=x"
        );
    }
}
