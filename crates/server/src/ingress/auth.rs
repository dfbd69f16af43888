//! Who may use a sandbox port through the proxy.
//!
//! - envd (49983): open unless the sandbox is `secure`; then `X-Access-Token` must be its
//!   envd token, or a `GET`/`POST /files` request must carry E2B's signed-URL parameters
//!   (`signature` = `v1_` + unpadded base64 of sha256 of
//!   `path:read|write:username:token[:signature_expiration]`), unexpired.
//! - the code interpreter (49999): runs code, so it takes the envd token, the traffic
//!   token or a signed port URL, and is open only when the sandbox is neither secure nor
//!   private (E2B's SDK sends it only the traffic token on some calls).
//! - any other port: open when the sandbox is `public`; else the traffic token as
//!   `E2B-Traffic-Access-Token`, or a signed port URL: `sandpit_expires` (unix seconds)
//!   and `sandpit_signature` = `v1_` + unpadded base64url of HMAC-SHA256 keyed with the
//!   traffic token over `sandpit-port-v1:{id}:{port}:{expires}`. A host-form request
//!   with a valid signature also gets a cookie with the same pair, scoped to that host,
//!   so a browser keeps access for the page's other requests.
//!
//! A signature that is wrong or expired is 401 with envd's body (`invalid signature`,
//! `signature is already expired`) for every kind of signed URL; a wrong token is 403.

use super::{Route, Target};
use axum::extract::Request;
use axum::response::Response;
use base64::Engine;
use hmac::{Hmac, Mac};
use http::StatusCode;
use sandpit_store::SandboxAccess;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// Header carrying the envd access token (E2B's name).
pub const ENVD_TOKEN_HEADER: &str = "x-access-token";
/// Header carrying the traffic token (E2B's name).
pub const TRAFFIC_TOKEN_HEADER: &str = "e2b-traffic-access-token";
/// Query parameter of a signed port URL: its expiry, unix seconds.
pub const PORT_EXPIRES_PARAM: &str = "sandpit_expires";
/// Query parameter of a signed port URL: its signature.
pub const PORT_SIGNATURE_PARAM: &str = "sandpit_signature";
/// Cookie set after a signed port URL was used in host form.
pub const PORT_COOKIE: &str = "sandpit_port_access";
/// Longest validity of a signed port URL.
pub const MAX_PORT_URL_SECS: u64 = 7 * 24 * 3600;

/// What let a request through.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Grant {
    /// No credential is needed.
    Open,
    /// A token header.
    Token,
    /// E2B's signed `/files` URL: only the signed path and user may be forwarded.
    FileSignature {
        path: String,
        username: Option<String>,
    },
    /// A signed port URL (its parameters are dropped before forwarding).
    PortSignature { expires: i64, signature: String },
    /// The cookie a signed port URL left.
    PortCookie,
}

/// Why a request was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Denied {
    /// No credential at all (401).
    Missing(String),
    /// A credential that is wrong (403).
    Wrong(String),
    /// A signed URL (or the cookie it left) whose signature is wrong or expired: 401
    /// with E2B envd's exact body, `{"code":401,"message":...}`, which its SDKs assert.
    Signature(&'static str),
}

/// Message of a signed URL whose signature does not match (E2B envd's wording).
pub const INVALID_SIGNATURE: &str = "invalid signature";
/// Message of a signed URL past its expiry (E2B envd's wording).
pub const EXPIRED_SIGNATURE: &str = "signature is already expired";

impl Denied {
    /// The JSON answer.
    pub fn into_response(self, id: &str, port: u16) -> Response {
        let (status, msg) = match self {
            Denied::Missing(m) => (StatusCode::UNAUTHORIZED, m),
            Denied::Wrong(m) => (StatusCode::FORBIDDEN, m),
            // envd's body has no sandbox or port fields; the SDKs compare it whole.
            Denied::Signature(m) => {
                return super::error_body(StatusCode::UNAUTHORIZED, m, None, None);
            }
        };
        super::error_body(status, msg, Some(id), Some(port))
    }
}

fn eq(a: &str, b: &str) -> bool {
    a.as_bytes().ct_eq(b.as_bytes()).into()
}

/// Now, unix seconds.
pub fn now_secs() -> i64 {
    crate::manager::now_ms() / 1000
}

/// E2B's `/files` URL signature.
pub fn file_signature(
    path: &str,
    operation: &str,
    username: &str,
    token: &str,
    expires: Option<i64>,
) -> String {
    let raw = match expires {
        Some(e) => format!("{path}:{operation}:{username}:{token}:{e}"),
        None => format!("{path}:{operation}:{username}:{token}"),
    };
    let digest = Sha256::digest(raw.as_bytes());
    format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest)
    )
}

/// The signature of a port URL valid until `expires` (unix seconds).
pub fn port_signature(traffic_token: &str, id: &str, port: u16, expires: i64) -> String {
    // HMAC accepts keys of any length; `new_from_slice` cannot fail for it.
    let mut mac = match Hmac::<Sha256>::new_from_slice(traffic_token.as_bytes()) {
        Ok(m) => m,
        Err(_) => return String::new(),
    };
    mac.update(format!("sandpit-port-v1:{id}:{port}:{expires}").as_bytes());
    format!(
        "v1_{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(mac.finalize().into_bytes())
    )
}

/// The query string of a signed URL for a port.
pub fn port_url_query(access: &SandboxAccess, port: u16, expires: i64) -> String {
    let sig = port_signature(&access.traffic_token, &access.sandbox_id, port, expires);
    form_urlencoded::Serializer::new(String::new())
        .append_pair(PORT_EXPIRES_PARAM, &expires.to_string())
        .append_pair(PORT_SIGNATURE_PARAM, &sig)
        .finish()
}

/// Query parameters, refusing a repeated one among `watched` (a signature must cover
/// exactly what is forwarded).
fn query_params(
    query: &str,
    watched: &[&str],
) -> Result<std::collections::HashMap<String, String>, Denied> {
    let mut out = std::collections::HashMap::new();
    for (k, v) in form_urlencoded::parse(query.as_bytes()) {
        if !watched.contains(&k.as_ref()) {
            continue;
        }
        if out.insert(k.to_string(), v.to_string()).is_some() {
            return Err(Denied::Wrong(format!("query parameter {k} is repeated")));
        }
    }
    Ok(out)
}

fn header<'a>(req: &'a Request, name: &str) -> Option<&'a str> {
    req.headers().get(name).map(|v| v.to_str().unwrap_or(""))
}

/// A valid signed port URL or its cookie, `Ok(None)` when the request carries neither.
fn port_credential(
    route: &Route,
    access: &SandboxAccess,
    req: &Request,
) -> Result<Option<Grant>, Denied> {
    let q = query_params(
        req.uri().query().unwrap_or(""),
        &[PORT_EXPIRES_PARAM, PORT_SIGNATURE_PARAM],
    )?;
    match (q.get(PORT_EXPIRES_PARAM), q.get(PORT_SIGNATURE_PARAM)) {
        (Some(exp), Some(sig)) => {
            let expires = check_port_pair(route, access, exp, sig)?;
            return Ok(Some(Grant::PortSignature {
                expires,
                signature: sig.clone(),
            }));
        }
        (None, None) => {}
        _ => {
            return Err(Denied::Wrong(format!(
                "a signed URL needs both {PORT_EXPIRES_PARAM} and {PORT_SIGNATURE_PARAM}"
            )));
        }
    }
    if !route.by_host {
        return Ok(None);
    }
    let values = cookies(req.headers(), PORT_COOKIE);
    if values.is_empty() {
        return Ok(None);
    }
    if !own_page(req) {
        return Err(Denied::Wrong(
            "the access cookie only counts for requests from this sandbox port's own pages".into(),
        ));
    }
    // Any valid one will do: a page of another sandbox (the same site) can set a cookie
    // of this name for the whole domain, which the browser then sends as well.
    let mut refusal = None;
    for value in values {
        let checked = value
            .split_once('.')
            .ok_or_else(|| Denied::Wrong("malformed access cookie".into()))
            .and_then(|(exp, sig)| check_port_pair(route, access, exp, sig));
        match checked {
            Ok(_) => return Ok(Some(Grant::PortCookie)),
            Err(e) => {
                refusal.get_or_insert(e);
            }
        }
    }
    Err(refusal.unwrap_or_else(|| Denied::Wrong("invalid access cookie".into())))
}

/// Whether a request may be one of the sandbox port's own pages, or a person opening it,
/// rather than another site's page riding on the cookie. Every sandbox is a subdomain of
/// one domain, so for browsers they are all the same site and `SameSite` lets another
/// sandbox's page send the cookie: its `Origin` (sent with every cross-origin fetch,
/// form post and WebSocket) or `Sec-Fetch-Site` gives it away.
fn own_page(req: &Request) -> bool {
    let own_host = req
        .uri()
        .authority()
        .map(|a| a.as_str().to_string())
        .or_else(|| header(req, "host").map(str::to_string))
        .map(|h| host_name(&h));
    if let Some(origin) = header(req, "origin") {
        let from = origin.split_once("://").map(|(_, rest)| host_name(rest));
        if from.is_none() || from != own_host {
            return false;
        }
    }
    match header(req, "sec-fetch-site") {
        None | Some("same-origin") | Some("none") => true,
        // A page of elsewhere: only a top-level navigation (a link followed) is let in.
        Some(_) => {
            matches!(*req.method(), http::Method::GET | http::Method::HEAD)
                && header(req, "sec-fetch-mode") == Some("navigate")
                && matches!(header(req, "sec-fetch-dest"), None | Some("document"))
        }
    }
}

/// The lowercase host name of a `host[:port]` (no port, no trailing dot).
fn host_name(authority: &str) -> String {
    let h = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    super::strip_port(h)
        .trim_end_matches('.')
        .to_ascii_lowercase()
}

fn check_port_pair(
    route: &Route,
    access: &SandboxAccess,
    exp: &str,
    sig: &str,
) -> Result<i64, Denied> {
    let expires: i64 = exp
        .parse()
        .map_err(|_| Denied::Wrong("malformed signature expiry".into()))?;
    let want = port_signature(
        &access.traffic_token,
        &route.sandbox_id,
        route.port,
        expires,
    );
    if !eq(sig, &want) {
        return Err(Denied::Signature(INVALID_SIGNATURE));
    }
    // Checked after the signature, so that the answer says "expired" only for URLs that
    // were once valid.
    if now_secs() > expires {
        return Err(Denied::Signature(EXPIRED_SIGNATURE));
    }
    Ok(expires)
}

/// The value of cookie `name` in the request's Cookie headers.
pub fn cookie(headers: &http::HeaderMap, name: &str) -> Option<String> {
    cookies(headers, name).into_iter().next()
}

/// Every value of cookie `name` in the request's Cookie headers, in order.
pub fn cookies(headers: &http::HeaderMap, name: &str) -> Vec<String> {
    headers
        .get_all(http::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .filter(|(k, _)| *k == name)
        .map(|(_, v)| v.to_string())
        .collect()
}

/// E2B's signed `/files` URL, `Ok(None)` when the request has no `signature`.
fn file_credential(access: &SandboxAccess, req: &Request) -> Result<Option<Grant>, Denied> {
    if req.uri().path() != "/files" {
        return Ok(None);
    }
    let q = query_params(
        req.uri().query().unwrap_or(""),
        &["path", "username", "signature", "signature_expiration"],
    )?;
    let Some(sig) = q.get("signature") else {
        return Ok(None);
    };
    let operation = match *req.method() {
        http::Method::GET | http::Method::HEAD => "read",
        http::Method::POST | http::Method::PUT => "write",
        _ => {
            return Err(Denied::Wrong(
                "a signed URL only reads or writes files".into(),
            ));
        }
    };
    let path = q.get("path").cloned().unwrap_or_default();
    if path.is_empty() {
        return Err(Denied::Wrong("a signed URL must name a path".into()));
    }
    let username = q.get("username").cloned();
    let expires = match q.get("signature_expiration") {
        Some(e) => Some(
            e.parse::<i64>()
                .map_err(|_| Denied::Wrong("malformed signature_expiration".into()))?,
        ),
        None => None,
    };
    let want = file_signature(
        &path,
        operation,
        username.as_deref().unwrap_or(""),
        &access.envd_token,
        expires,
    );
    if !eq(sig, &want) {
        return Err(Denied::Signature(INVALID_SIGNATURE));
    }
    if expires.is_some_and(|e| now_secs() > e) {
        return Err(Denied::Signature(EXPIRED_SIGNATURE));
    }
    Ok(Some(Grant::FileSignature { path, username }))
}

/// Decides whether `req` may reach `target` of the sandbox whose credentials are `access`.
pub fn authorize(
    route: &Route,
    target: Target,
    access: &SandboxAccess,
    req: &Request,
) -> Result<Grant, Denied> {
    let envd_header = header(req, ENVD_TOKEN_HEADER);
    let traffic_header = header(req, TRAFFIC_TOKEN_HEADER);
    match target {
        Target::Envd => {
            if !access.secure {
                return Ok(Grant::Open);
            }
            if let Some(t) = envd_header {
                return if eq(t, &access.envd_token) {
                    Ok(Grant::Token)
                } else {
                    Err(Denied::Wrong("invalid X-Access-Token".into()))
                };
            }
            file_credential(access, req)?.ok_or_else(|| {
                Denied::Missing("this sandbox is secure: X-Access-Token required".into())
            })
        }
        Target::CodeInterpreter => {
            if !access.secure && access.public {
                return Ok(Grant::Open);
            }
            let mut wrong = false;
            if let Some(t) = envd_header {
                if eq(t, &access.envd_token) {
                    return Ok(Grant::Token);
                }
                wrong = true;
            }
            if let Some(t) = traffic_header {
                if eq(t, &access.traffic_token) {
                    return Ok(Grant::Token);
                }
                wrong = true;
            }
            if let Some(g) = port_credential(route, access, req)? {
                return Ok(g);
            }
            Err(if wrong {
                Denied::Wrong("invalid access token".into())
            } else {
                Denied::Missing(
                    "X-Access-Token or E2B-Traffic-Access-Token required for the code interpreter"
                        .into(),
                )
            })
        }
        Target::Port(_) => {
            if access.public {
                return Ok(Grant::Open);
            }
            if let Some(t) = traffic_header {
                return if eq(t, &access.traffic_token) {
                    Ok(Grant::Token)
                } else {
                    Err(Denied::Wrong("invalid E2B-Traffic-Access-Token".into()))
                };
            }
            port_credential(route, access, req)?.ok_or_else(|| {
                Denied::Missing(
                    "this sandbox's ports are private: E2B-Traffic-Access-Token or a signed URL required"
                        .into(),
                )
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "abcdefghij0123456789";

    fn access(secure: bool, public: bool) -> SandboxAccess {
        SandboxAccess {
            sandbox_id: ID.into(),
            envd_token: "envd-secret".into(),
            traffic_token: "traffic-secret".into(),
            secure,
            public,
            updated_at_ms: 0,
        }
    }

    fn route(port: u16, by_host: bool) -> Route {
        Route {
            sandbox_id: ID.into(),
            port,
            by_host,
        }
    }

    fn req(method: &str, uri: &str, headers: &[(&str, &str)]) -> Request {
        let mut b = http::Request::builder().method(method).uri(uri);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(axum::body::Body::empty()).unwrap()
    }

    fn check(port: u16, a: &SandboxAccess, r: &Request) -> Result<Grant, Denied> {
        authorize(&route(port, true), Target::of(port), a, r)
    }

    #[test]
    fn e2b_file_signature_recipe() {
        // The recipe of E2B's SDK, computed independently: sha256 over
        // "/home/user/a.txt:read:user:tok", standard base64 without padding.
        let raw = "/home/user/a.txt:read:user:tok";
        let want = format!(
            "v1_{}",
            base64::engine::general_purpose::STANDARD
                .encode(Sha256::digest(raw.as_bytes()))
                .trim_end_matches('=')
        );
        assert_eq!(
            file_signature("/home/user/a.txt", "read", "user", "tok", None),
            want
        );
        assert_ne!(
            file_signature("/home/user/a.txt", "read", "user", "tok", Some(1)),
            want
        );
    }

    #[test]
    fn envd_needs_the_envd_token_when_secure() {
        let a = access(true, false);
        assert!(matches!(
            check(49983, &a, &req("POST", "/process.Process/List", &[])),
            Err(Denied::Missing(_))
        ));
        assert!(matches!(
            check(
                49983,
                &a,
                &req("POST", "/x", &[("x-access-token", "traffic-secret")])
            ),
            Err(Denied::Wrong(_))
        ));
        // The traffic token is not an envd credential.
        assert!(matches!(
            check(
                49983,
                &a,
                &req(
                    "POST",
                    "/x",
                    &[("e2b-traffic-access-token", "traffic-secret")]
                )
            ),
            Err(Denied::Missing(_))
        ));
        assert_eq!(
            check(
                49983,
                &a,
                &req("POST", "/x", &[("X-Access-Token", "envd-secret")])
            ),
            Ok(Grant::Token)
        );
        assert_eq!(
            check(49983, &access(false, false), &req("POST", "/x", &[])),
            Ok(Grant::Open)
        );
    }

    fn enc(s: &str) -> String {
        form_urlencoded::byte_serialize(s.as_bytes()).collect()
    }

    #[test]
    fn signed_files() {
        let a = access(true, false);
        let sig = enc(&file_signature("/tmp/f", "read", "", "envd-secret", None));
        let uri = format!("/files?path=%2Ftmp%2Ff&signature={sig}");
        assert_eq!(
            check(49983, &a, &req("GET", &uri, &[])),
            Ok(Grant::FileSignature {
                path: "/tmp/f".into(),
                username: None
            })
        );
        // Read signatures do not write, and the path is covered.
        assert_eq!(
            check(49983, &a, &req("POST", &uri, &[])),
            Err(Denied::Signature(INVALID_SIGNATURE))
        );
        let other = format!("/files?path=%2Fetc%2Fshadow&signature={sig}");
        assert_eq!(
            check(49983, &a, &req("GET", &other, &[])),
            Err(Denied::Signature(INVALID_SIGNATURE))
        );
        // E2B envd's answer, exactly: 401 and no other fields.
        let r = Denied::Signature(EXPIRED_SIGNATURE).into_response(ID, 49983);
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
        let twice = format!("/files?path=%2Ftmp%2Ff&path=%2Fetc%2Fshadow&signature={sig}");
        assert!(check(49983, &a, &req("GET", &twice, &[])).is_err());
        // The user is covered too.
        let as_root = format!("/files?path=%2Ftmp%2Ff&username=root&signature={sig}");
        assert!(check(49983, &a, &req("GET", &as_root, &[])).is_err());
        let past = now_secs() - 10;
        let sig = enc(&file_signature(
            "/tmp/f",
            "write",
            "user",
            "envd-secret",
            Some(past),
        ));
        let uri = format!(
            "/files?path=%2Ftmp%2Ff&username=user&signature={sig}&signature_expiration={past}"
        );
        assert_eq!(
            check(49983, &a, &req("POST", &uri, &[])),
            Err(Denied::Signature(EXPIRED_SIGNATURE))
        );
        // Elsewhere than /files a signature is no credential.
        let uri = format!("/process.Process/List?path=%2Ftmp%2Ff&signature={sig}");
        assert!(matches!(
            check(49983, &a, &req("POST", &uri, &[])),
            Err(Denied::Missing(_))
        ));
    }

    #[test]
    fn ports_private_by_default() {
        let a = access(true, false);
        assert!(matches!(
            check(8080, &a, &req("GET", "/", &[])),
            Err(Denied::Missing(_))
        ));
        // The envd token does not open other ports.
        assert!(matches!(
            check(
                8080,
                &a,
                &req("GET", "/", &[("x-access-token", "envd-secret")])
            ),
            Err(Denied::Missing(_))
        ));
        assert_eq!(
            check(
                8080,
                &a,
                &req(
                    "GET",
                    "/",
                    &[("E2B-Traffic-Access-Token", "traffic-secret")]
                )
            ),
            Ok(Grant::Token)
        );
        assert_eq!(
            check(8080, &access(true, true), &req("GET", "/", &[])),
            Ok(Grant::Open)
        );
    }

    #[test]
    fn signed_port_urls_and_cookies() {
        let a = access(true, false);
        let exp = now_secs() + 60;
        let q = port_url_query(&a, 8080, exp);
        let g = check(8080, &a, &req("GET", &format!("/p?{q}"), &[])).unwrap();
        assert!(matches!(g, Grant::PortSignature { expires, .. } if expires == exp));
        // Bound to the port and to the sandbox's token.
        assert!(check(8081, &a, &req("GET", &format!("/p?{q}"), &[])).is_err());
        let mut rotated = a.clone();
        rotated.traffic_token = "new".into();
        assert!(check(8080, &rotated, &req("GET", &format!("/p?{q}"), &[])).is_err());
        let old = port_url_query(&a, 8080, now_secs() - 1);
        assert_eq!(
            check(8080, &a, &req("GET", &format!("/?{old}"), &[])),
            Err(Denied::Signature(EXPIRED_SIGNATURE))
        );
        // A longer validity cannot be claimed by editing the expiry.
        let forged = old.replace(
            &(now_secs() - 1).to_string(),
            &(now_secs() + 999).to_string(),
        );
        assert_eq!(
            check(8080, &a, &req("GET", &format!("/?{forged}"), &[])),
            Err(Denied::Signature(INVALID_SIGNATURE))
        );
        let sig = port_signature(&a.traffic_token, ID, 8080, exp);
        let c = format!("other=1; {PORT_COOKIE}={exp}.{sig}");
        assert_eq!(
            check(8080, &a, &req("GET", "/", &[("cookie", &c)])),
            Ok(Grant::PortCookie)
        );
        // Cookies count in host form only (a shared host would share them).
        assert!(
            authorize(
                &route(8080, false),
                Target::Port(8080),
                &a,
                &req("GET", "/", &[("cookie", &c)])
            )
            .is_err()
        );
        // The code interpreter takes any of the three credentials.
        for h in [
            ("x-access-token", "envd-secret"),
            ("e2b-traffic-access-token", "traffic-secret"),
        ] {
            assert_eq!(
                check(49999, &a, &req("POST", "/execute", &[h])),
                Ok(Grant::Token)
            );
        }
        assert!(check(49999, &a, &req("POST", "/execute", &[])).is_err());
        assert!(check(49999, &access(true, true), &req("POST", "/execute", &[])).is_err());
        assert_eq!(
            check(49999, &access(false, true), &req("POST", "/execute", &[])),
            Ok(Grant::Open)
        );
    }
}
