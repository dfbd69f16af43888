//! What a secret is bound to, how a create request is checked, and the decision for one
//! outbound request: which credentials go in, or why it is refused. Pure functions over
//! plain data, so that every rule is tested without a network.

use sandpit_api::secrets::{CreateSecretRequest, InjectSpec};
use serde::{Deserialize, Serialize};
use std::net::IpAddr;

/// Longest secret value accepted.
pub const MAX_VALUE: usize = 8 << 10;
/// Most hosts, methods or path prefixes of one secret.
pub const MAX_RULES: usize = 32;
/// Prefix of a secret's placeholder; the name follows.
pub const PLACEHOLDER_PREFIX: &str = "SANDPIT_SECRET_";

/// Headers the broker never sets: they frame or route the request, so a credential in
/// them would change what is sent where.
const RESERVED_HEADERS: &[&str] = &[
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "upgrade",
    "te",
    "trailer",
    "expect",
    "proxy-connection",
];

/// A secret's binding rules and injection form, as stored (the `spec` column).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Spec {
    pub hosts: Vec<String>,
    pub methods: Vec<String>,
    #[serde(default)]
    pub path_prefixes: Vec<String>,
    pub inject: InjectSpec,
    #[serde(default)]
    pub allow_http: bool,
}

/// A secret as the broker holds it in memory: its value still sealed.
#[derive(Clone)]
pub struct Secret {
    pub owner: String,
    pub name: String,
    pub sealed: Vec<u8>,
    pub spec: Spec,
    pub expires_at_ms: Option<i64>,
    pub created_at_ms: i64,
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Secret")
            .field("owner", &self.owner)
            .field("name", &self.name)
            .field("spec", &self.spec)
            .finish_non_exhaustive()
    }
}

/// The label a secret's value is sealed under.
pub fn seal_label(owner: &str, name: &str) -> String {
    format!("sandpit-secret\0{owner}\0{name}")
}

/// The string a sandbox writes for the broker to replace with secret `name`.
pub fn placeholder(name: &str) -> String {
    format!("{PLACEHOLDER_PREFIX}{name}")
}

impl Secret {
    /// Whether `host` (lowercase, without a trailing dot) is one this secret may go to.
    pub fn binds_host(&self, host: &str) -> bool {
        self.spec.hosts.iter().any(|p| host_matches(p, host))
    }

    /// The placeholder a sandbox uses, for the placeholder form.
    pub fn placeholder(&self) -> Option<String> {
        matches!(self.spec.inject, InjectSpec::Placeholder).then(|| placeholder(&self.name))
    }

    /// Why this secret may not go with `req`, if it may not.
    fn refusal(&self, req: &RequestView<'_>) -> Option<Refusal> {
        let refuse = |reason: Reason, message: String| {
            Some(Refusal {
                secret: self.name.clone(),
                reason,
                message,
            })
        };
        if !self.binds_host(req.host) {
            return refuse(
                Reason::Host,
                format!("secret {} is not bound to host {}", self.name, req.host),
            );
        }
        if !req.tls && !self.spec.allow_http {
            return refuse(
                Reason::Scheme,
                format!("secret {} may only be sent over HTTPS", self.name),
            );
        }
        if let Some(at) = self.expires_at_ms
            && req.now_ms >= at
        {
            return refuse(
                Reason::Expired,
                format!("secret {} expired at {at} (unix ms)", self.name),
            );
        }
        if !self.spec.methods.iter().any(|m| m == req.method) {
            return refuse(
                Reason::Method,
                format!(
                    "method {} is not allowed for secret {} (allowed: {})",
                    req.method,
                    self.name,
                    self.spec.methods.join(", ")
                ),
            );
        }
        if !self.spec.path_prefixes.is_empty() {
            let Some(path) = req.path.filter(|p| canonical_path(p)) else {
                return refuse(
                    Reason::Path,
                    format!(
                        "the request path is not in canonical form; secret {} needs one below {}",
                        self.name,
                        self.spec.path_prefixes.join(", ")
                    ),
                );
            };
            if !self.spec.path_prefixes.iter().any(|p| path_under(path, p)) {
                return refuse(
                    Reason::Path,
                    format!(
                        "path {path} is not allowed for secret {} (allowed: {})",
                        self.name,
                        self.spec.path_prefixes.join(", ")
                    ),
                );
            }
        }
        None
    }
}

/// What the broker looks at in one request.
#[derive(Debug, Clone, Copy)]
pub struct RequestView<'a> {
    /// The connection's host (TLS SNI or HTTP Host), lowercase.
    pub host: &'a str,
    /// Whether the connection is TLS.
    pub tls: bool,
    /// Whether the connection goes to an address `host` resolves to (see
    /// [`sandpit_net::intercept::Destination`]).
    pub resolved: bool,
    pub method: &'a str,
    /// The path of the request target; `None` when it has none (`*`, authority form).
    pub path: Option<&'a str>,
    pub now_ms: i64,
}

/// Which rule a refused request broke.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    Host,
    Scheme,
    Expired,
    Method,
    Path,
    /// The connection goes to an address the host does not resolve to (the sandbox named
    /// the host to another address), so no credential may go with it.
    Destination,
    /// The secret cannot be used at all (its value does not decrypt).
    Unavailable,
    /// A person denied its injection, or nobody decided in time (an approval gate).
    Approval,
}

/// A refused request: the secret and the rule, in words (never the value).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Refusal {
    pub secret: String,
    pub reason: Reason,
    pub message: String,
}

/// How one secret goes into an allowed request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Set header `name` to `format` with the value in it (replacing what the sandbox sent).
    SetHeader {
        secret: usize,
        name: String,
        format: String,
    },
    /// Replace the secret's placeholder in every header value.
    Replace { secret: usize, token: String },
}

impl Action {
    /// The index of the secret this action puts in.
    pub fn secret(&self) -> usize {
        match self {
            Action::SetHeader { secret, .. } | Action::Replace { secret, .. } => *secret,
        }
    }
}

/// Decides one request to `req.host` of a sandbox with `attached` secrets: the actions
/// to take (none: forward it untouched), or why it is refused.
///
/// Header-form secrets bound to the host apply to every request: it gets each one whose
/// rules it meets, and is refused when it meets none of them. A placeholder-form secret
/// applies when its placeholder is in a header value (`headers`): the request is refused
/// unless it meets that secret's rules. Over plain HTTP, header-form secrets that are
/// HTTPS-only are left out rather than refused. A request that would get a credential on
/// a connection to an address the host does not resolve to is refused (`Destination`)
/// rather than sent on without it, so that the sandbox learns why.
pub fn decide(
    attached: &[&Secret],
    req: &RequestView<'_>,
    headers: &[&[u8]],
) -> Result<Vec<Action>, Refusal> {
    let mut actions = Vec::new();
    let mut first_refusal = None;
    let mut header_bound = false;
    for (i, s) in attached.iter().enumerate() {
        let InjectSpec::Header { name, format } = &s.spec.inject else {
            continue;
        };
        if !s.binds_host(req.host) || (!req.tls && !s.spec.allow_http) {
            continue;
        }
        header_bound = true;
        match s.refusal(req) {
            None => actions.push(Action::SetHeader {
                secret: i,
                name: name.clone(),
                format: format.clone(),
            }),
            Some(r) => {
                first_refusal.get_or_insert(r);
            }
        }
    }
    if header_bound
        && actions.is_empty()
        && let Some(r) = first_refusal
    {
        return Err(r);
    }
    for (i, s) in attached.iter().enumerate() {
        let Some(token) = s.placeholder() else {
            continue;
        };
        if !headers
            .iter()
            .any(|v| find_token(v, token.as_bytes()).is_some())
        {
            continue;
        }
        if let Some(r) = s.refusal(req) {
            return Err(r);
        }
        actions.push(Action::Replace { secret: i, token });
    }
    if !req.resolved
        && let Some(a) = actions.first()
    {
        let name = &attached[a.secret()].name;
        return Err(Refusal {
            secret: name.clone(),
            reason: Reason::Destination,
            message: format!(
                "the connection is not to an address {} resolves to; secret {name} goes only there",
                req.host
            ),
        });
    }
    Ok(actions)
}

/// Where `token` first occurs in `hay` as a whole placeholder (not followed by another
/// name character, so `SANDPIT_SECRET_a` is not found inside `SANDPIT_SECRET_ab`).
pub fn find_token(hay: &[u8], token: &[u8]) -> Option<usize> {
    let mut from = 0;
    while let Some(at) = memchr::memmem::find(&hay[from..], token) {
        let start = from + at;
        let end = start + token.len();
        if hay.get(end).is_none_or(|b| !is_name_byte(*b)) {
            return Some(start);
        }
        from = start + 1;
    }
    None
}

/// Replaces every whole occurrence of `token` in `hay` with `value`.
pub fn replace_token(hay: &[u8], token: &[u8], value: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(hay.len() + value.len());
    let mut rest = hay;
    while let Some(at) = find_token(rest, token) {
        out.extend_from_slice(&rest[..at]);
        out.extend_from_slice(value);
        rest = &rest[at + token.len()..];
    }
    out.extend_from_slice(rest);
    out
}

fn is_name_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b'-'
}

/// Whether host pattern `pattern` (exact, or `*.suffix`) covers `host`.
pub fn host_matches(pattern: &str, host: &str) -> bool {
    match pattern.strip_prefix("*.") {
        Some(suffix) => host
            .strip_suffix(suffix)
            .and_then(|head| head.strip_suffix('.'))
            .is_some_and(|head| !head.is_empty()),
        None => pattern == host,
    }
}

/// The form hosts are compared in: lowercase, without a trailing dot.
pub fn normal_host(host: &str) -> String {
    host.trim_end_matches('.').to_ascii_lowercase()
}

/// A path with no dot segments and no encoded slash, backslash or dot, which no server
/// can read as lying outside the prefix it textually starts with.
pub fn canonical_path(path: &str) -> bool {
    if !path.starts_with('/') || path.contains('\\') {
        return false;
    }
    let lower = path.to_ascii_lowercase();
    if ["%2f", "%5c", "%2e", "%00"]
        .iter()
        .any(|enc| lower.contains(enc))
    {
        return false;
    }
    !path.split('/').any(|seg| seg == "." || seg == "..")
}

/// Whether `path` is `prefix` or below it (by whole segments, unless the prefix ends in `/`).
pub fn path_under(path: &str, prefix: &str) -> bool {
    match path.strip_prefix(prefix) {
        Some(rest) => prefix.ends_with('/') || rest.is_empty() || rest.starts_with('/'),
        None => false,
    }
}

/// Why a create request (or a secret's name) is not valid: its text is the whole cause,
/// and what the client is answered with a 400.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Invalid(pub String);

impl From<String> for Invalid {
    fn from(message: String) -> Self {
        Invalid(message)
    }
}

impl From<&str> for Invalid {
    fn from(message: &str) -> Self {
        Invalid(message.to_string())
    }
}

impl From<Invalid> for String {
    fn from(e: Invalid) -> Self {
        e.0
    }
}

/// Checks a secret's name: 1 to 64 characters of `[A-Za-z0-9_-]`.
pub fn check_name(name: &str) -> Result<(), Invalid> {
    if name.is_empty() || name.len() > 64 || !name.bytes().all(is_name_byte) {
        return Err(
            format!("secret name {name:?} must be 1 to 64 characters of [A-Za-z0-9_-]").into(),
        );
    }
    Ok(())
}

fn check_host(h: &str) -> Result<String, Invalid> {
    let host = normal_host(h);
    let bad = || format!("host {h:?} must be a DNS name, `*.` and a domain, or an IP address");
    let (wild, name) = match host.strip_prefix("*.") {
        Some(rest) => (true, rest),
        None => (false, host.as_str()),
    };
    if !wild && name.parse::<IpAddr>().is_ok() {
        return Ok(host);
    }
    let labels: Vec<&str> = name.split('.').collect();
    let label_ok = |l: &&str| {
        !l.is_empty()
            && l.len() <= 63
            && !l.starts_with('-')
            && !l.ends_with('-')
            && l.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
    };
    if name.len() > 253 || !labels.iter().all(label_ok) {
        return Err(bad().into());
    }
    if wild && labels.len() < 2 {
        return Err(
            format!("host {h:?}: a wildcard must cover a domain of at least two labels").into(),
        );
    }
    Ok(host)
}

fn check_method(m: &str) -> Result<String, Invalid> {
    let up = m.to_ascii_uppercase();
    if up.is_empty() || up.len() > 32 || http::Method::from_bytes(up.as_bytes()).is_err() {
        return Err(format!("method {m:?} is not an HTTP method").into());
    }
    if up == "CONNECT" {
        return Err("method CONNECT cannot carry a credential".into());
    }
    Ok(up)
}

fn check_prefix(p: &str) -> Result<String, Invalid> {
    if p.len() > 1024 || !canonical_path(p) || p.bytes().any(|b| !(0x21..0x7f).contains(&b)) {
        return Err(format!(
            "path prefix {p:?} must start with / and have no dot segments, encoded separators or spaces"
        ).into());
    }
    Ok(p.to_string())
}

/// A value the broker can put into a header: visible characters, spaces and tabs.
pub fn check_value(v: &str) -> Result<(), Invalid> {
    if v.is_empty() || v.len() > MAX_VALUE {
        return Err(format!("value must be 1 to {MAX_VALUE} bytes").into());
    }
    if v.bytes().any(|b| (b < 0x20 && b != b'\t') || b == 0x7f) {
        return Err("value must not contain control characters".into());
    }
    Ok(())
}

fn check_inject(inject: &InjectSpec) -> Result<InjectSpec, Invalid> {
    match inject {
        InjectSpec::Header { name, format } => {
            let lower = name.to_ascii_lowercase();
            if http::HeaderName::from_bytes(lower.as_bytes()).is_err() {
                return Err(format!("inject.name {name:?} is not a header name").into());
            }
            if RESERVED_HEADERS.contains(&lower.as_str()) || lower.starts_with("proxy-") {
                return Err(format!("inject.name {name:?} cannot carry a credential").into());
            }
            if format.matches("{value}").count() != 1 || format.len() > 256 {
                return Err(
                    "inject.format must hold `{value}` exactly once (at most 256 bytes)".into(),
                );
            }
            if format
                .bytes()
                .any(|b| (b < 0x20 && b != b'\t') || b == 0x7f)
            {
                return Err("inject.format must not contain control characters".into());
            }
            Ok(InjectSpec::Header {
                name: lower,
                format: format.clone(),
            })
        }
        InjectSpec::Placeholder => Ok(InjectSpec::Placeholder),
    }
}

fn checked<T>(
    what: &str,
    items: &[String],
    required: bool,
    check: impl Fn(&str) -> Result<T, Invalid>,
) -> Result<Vec<T>, Invalid> {
    if required && items.is_empty() {
        return Err(format!("{what} must name at least one").into());
    }
    if items.len() > MAX_RULES {
        return Err(format!("{what}: at most {MAX_RULES}").into());
    }
    items.iter().map(|i| check(i)).collect()
}

/// Checks a create request; returns its rules as stored and its expiry.
pub fn validate(req: &CreateSecretRequest, now_ms: i64) -> Result<(Spec, i64), Invalid> {
    check_name(&req.name)?;
    check_value(&req.value)?;
    let mut hosts = checked("hosts", &req.hosts, true, check_host)?;
    let mut methods = checked("methods", &req.methods, true, check_method)?;
    let mut path_prefixes = checked("path_prefixes", &req.path_prefixes, false, check_prefix)?;
    for v in [&mut hosts, &mut methods, &mut path_prefixes] {
        v.sort();
        v.dedup();
    }
    let expires_at_ms = match (req.expires_at_ms, req.ttl_secs) {
        (Some(at), None) => at,
        (None, Some(ttl)) => i64::try_from(ttl)
            .ok()
            .and_then(|t| t.checked_mul(1000))
            .and_then(|t| t.checked_add(now_ms))
            .ok_or("ttl_secs is too large")?,
        _ => return Err("give exactly one of expires_at_ms and ttl_secs".into()),
    };
    if expires_at_ms <= now_ms {
        return Err("the expiry must be in the future".into());
    }
    let inject = check_inject(&req.inject)?;
    Ok((
        Spec {
            hosts,
            methods,
            path_prefixes,
            inject,
            allow_http: req.allow_http,
        },
        expires_at_ms,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(name: &str, inject: InjectSpec, prefixes: &[&str]) -> Secret {
        Secret {
            owner: "o".into(),
            name: name.into(),
            sealed: Vec::new(),
            spec: Spec {
                hosts: vec!["api.example.com".into(), "*.svc.example.org".into()],
                methods: vec!["GET".into(), "POST".into()],
                path_prefixes: prefixes.iter().map(|p| p.to_string()).collect(),
                inject,
                allow_http: false,
            },
            expires_at_ms: Some(1_000),
            created_at_ms: 0,
        }
    }

    fn header() -> InjectSpec {
        InjectSpec::Header {
            name: "authorization".into(),
            format: "Bearer {value}".into(),
        }
    }

    fn req<'a>(host: &'a str, method: &'a str, path: &'a str) -> RequestView<'a> {
        RequestView {
            host,
            tls: true,
            resolved: true,
            method,
            path: Some(path),
            now_ms: 500,
        }
    }

    const NO_HEADERS: [&[u8]; 0] = [];

    #[test]
    fn hosts_match_exactly_or_below_a_wildcard() {
        assert!(host_matches("api.example.com", "api.example.com"));
        assert!(!host_matches("api.example.com", "xapi.example.com"));
        assert!(host_matches("*.example.com", "a.example.com"));
        assert!(host_matches("*.example.com", "a.b.example.com"));
        assert!(!host_matches("*.example.com", "example.com"));
        assert!(!host_matches("*.example.com", "badexample.com"));
        assert!(!host_matches("*.example.com", ".example.com"));
    }

    #[test]
    fn paths_are_compared_by_segment_and_must_be_canonical() {
        assert!(path_under("/v1/chat", "/v1/chat"));
        assert!(path_under("/v1/chat/x", "/v1/chat"));
        assert!(!path_under("/v1/chatty", "/v1/chat"));
        assert!(path_under("/repos/x", "/repos/"));
        assert!(!path_under("/repo", "/repos/"));
        for bad in [
            "/a/../b",
            "/a/./b",
            "/a/%2e%2e/b",
            "/a/%2F/b",
            "/a\\b",
            "relative",
        ] {
            assert!(!canonical_path(bad), "{bad}");
        }
        assert!(canonical_path("/a/b.c/..d"));
    }

    #[test]
    fn a_header_secret_is_injected_only_for_its_host_method_path_and_time() {
        let s = secret("gh", header(), &["/repos"]);
        let all = [&s];
        let ok = decide(
            &all,
            &req("api.example.com", "GET", "/repos/x"),
            &NO_HEADERS,
        );
        assert_eq!(
            ok.unwrap(),
            vec![Action::SetHeader {
                secret: 0,
                name: "authorization".into(),
                format: "Bearer {value}".into()
            }]
        );
        let wild = decide(
            &all,
            &req("a.svc.example.org", "POST", "/repos"),
            &NO_HEADERS,
        );
        assert_eq!(wild.unwrap().len(), 1);
        let method = decide(
            &all,
            &req("api.example.com", "DELETE", "/repos/x"),
            &NO_HEADERS,
        );
        assert_eq!(method.unwrap_err().reason, Reason::Method);
        let path = decide(&all, &req("api.example.com", "GET", "/admin"), &NO_HEADERS);
        assert_eq!(path.unwrap_err().reason, Reason::Path);
        let sneaky = decide(
            &all,
            &req("api.example.com", "GET", "/repos/../admin"),
            &NO_HEADERS,
        );
        assert_eq!(sneaky.unwrap_err().reason, Reason::Path);
        let mut late = req("api.example.com", "GET", "/repos/x");
        late.now_ms = 1_000;
        let expired = decide(&all, &late, &NO_HEADERS).unwrap_err();
        assert_eq!(expired.reason, Reason::Expired);
        assert_eq!(expired.secret, "gh");
        // Another host: nothing to do with this secret.
        let other = decide(&all, &req("example.net", "DELETE", "/"), &NO_HEADERS);
        assert_eq!(other.unwrap(), vec![]);
    }

    #[test]
    fn of_several_header_secrets_the_matching_ones_go_in() {
        let reader = secret("reader", header(), &["/read"]);
        let mut writer = secret("writer", header(), &["/write"]);
        writer.spec.inject = InjectSpec::Header {
            name: "x-api-key".into(),
            format: "{value}".into(),
        };
        let all = [&reader, &writer];
        let got = decide(
            &all,
            &req("api.example.com", "GET", "/write/1"),
            &NO_HEADERS,
        );
        assert!(matches!(
            got.unwrap().as_slice(),
            [Action::SetHeader { secret: 1, .. }]
        ));
        let none = decide(&all, &req("api.example.com", "GET", "/other"), &NO_HEADERS);
        assert_eq!(none.unwrap_err().secret, "reader");
    }

    #[test]
    fn placeholders_are_replaced_only_where_the_rules_allow() {
        let s = secret("tok", InjectSpec::Placeholder, &[]);
        let all = [&s];
        let with: [&[u8]; 1] = [b"token SANDPIT_SECRET_tok"];
        let got = decide(&all, &req("api.example.com", "GET", "/"), &with).unwrap();
        assert_eq!(
            got,
            vec![Action::Replace {
                secret: 0,
                token: "SANDPIT_SECRET_tok".into()
            }]
        );
        // No placeholder: the request goes untouched.
        let plain = decide(&all, &req("api.example.com", "DELETE", "/"), &NO_HEADERS);
        assert_eq!(plain.unwrap(), vec![]);
        let wrong_method = decide(&all, &req("api.example.com", "DELETE", "/"), &with);
        assert_eq!(wrong_method.unwrap_err().reason, Reason::Method);
        let wrong_host = decide(&all, &req("evil.example.net", "GET", "/"), &with);
        assert_eq!(wrong_host.unwrap_err().reason, Reason::Host);
        // A longer name is another placeholder.
        let longer: [&[u8]; 1] = [b"SANDPIT_SECRET_tokx"];
        let got = decide(&all, &req("evil.example.net", "GET", "/"), &longer);
        assert_eq!(got.unwrap(), vec![]);
        let mut http = req("api.example.com", "GET", "/");
        http.tls = false;
        let scheme = decide(&all, &http, &with).unwrap_err();
        assert_eq!(scheme.reason, Reason::Scheme);
    }

    #[test]
    fn no_credential_goes_to_an_address_the_host_does_not_resolve_to() {
        let gh = secret("gh", header(), &[]);
        let tok = secret("tok", InjectSpec::Placeholder, &[]);
        let mut elsewhere = req("api.example.com", "GET", "/repos/x");
        elsewhere.resolved = false;
        let r = decide(&[&gh, &tok], &elsewhere, &NO_HEADERS).unwrap_err();
        assert_eq!((r.reason, r.secret.as_str()), (Reason::Destination, "gh"));
        let with: [&[u8]; 1] = [b"token SANDPIT_SECRET_tok"];
        let r = decide(&[&tok], &elsewhere, &with).unwrap_err();
        assert_eq!((r.reason, r.secret.as_str()), (Reason::Destination, "tok"));
        // Nothing to put in: the request goes on untouched.
        assert_eq!(decide(&[&tok], &elsewhere, &NO_HEADERS).unwrap(), vec![]);
        // A rule broken anyway keeps its own reason.
        elsewhere.method = "DELETE";
        let r = decide(&[&gh], &elsewhere, &NO_HEADERS).unwrap_err();
        assert_eq!(r.reason, Reason::Method);
        // The same requests to an address of the host get their credentials.
        let home = req("api.example.com", "GET", "/repos/x");
        assert_eq!(decide(&[&gh, &tok], &home, &with).unwrap().len(), 2);
    }

    #[test]
    fn tokens_are_replaced_whole() {
        let out = replace_token(
            b"a SANDPIT_SECRET_x b SANDPIT_SECRET_xy SANDPIT_SECRET_x",
            b"SANDPIT_SECRET_x",
            b"V",
        );
        assert_eq!(out, b"a V b SANDPIT_SECRET_xy V");
    }

    fn create(name: &str) -> CreateSecretRequest {
        CreateSecretRequest {
            name: name.into(),
            value: "s3cr3t".into(),
            hosts: vec!["API.Example.com.".into()],
            methods: vec!["get".into()],
            ttl_secs: Some(60),
            ..Default::default()
        }
    }

    #[test]
    fn create_requests_are_checked() {
        let (spec, exp) = validate(&create("gh"), 1_000).unwrap();
        assert_eq!(spec.hosts, ["api.example.com"]);
        assert_eq!(spec.methods, ["GET"]);
        assert_eq!(exp, 61_000);
        type Change = Box<dyn Fn(&mut CreateSecretRequest)>;
        let bad: Vec<Change> = vec![
            Box::new(|r| r.name = "a b".into()),
            Box::new(|r| r.name = String::new()),
            Box::new(|r| r.value = String::new()),
            Box::new(|r| r.value = "a\r\nX-Evil: 1".into()),
            Box::new(|r| r.value = "x".repeat(MAX_VALUE + 1)),
            Box::new(|r| r.hosts = vec![]),
            Box::new(|r| r.hosts = vec!["*.com".into()]),
            Box::new(|r| r.hosts = vec!["a..b".into()]),
            Box::new(|r| r.hosts = vec!["exa mple.com".into()]),
            Box::new(|r| r.hosts = vec!["*.1.2.3.4x/".into()]),
            Box::new(|r| r.methods = vec![]),
            Box::new(|r| r.methods = vec!["G ET".into()]),
            Box::new(|r| r.methods = vec!["CONNECT".into()]),
            Box::new(|r| r.path_prefixes = vec!["no-slash".into()]),
            Box::new(|r| r.path_prefixes = vec!["/a/../b".into()]),
            Box::new(|r| r.ttl_secs = None),
            Box::new(|r| r.expires_at_ms = Some(5)),
            Box::new(|r| {
                r.ttl_secs = None;
                r.expires_at_ms = Some(5)
            }),
            Box::new(|r| r.ttl_secs = Some(u64::MAX)),
            Box::new(|r| {
                r.inject = InjectSpec::Header {
                    name: "Host".into(),
                    format: "{value}".into(),
                }
            }),
            Box::new(|r| {
                r.inject = InjectSpec::Header {
                    name: "X-Key".into(),
                    format: "no value".into(),
                }
            }),
            Box::new(|r| {
                r.inject = InjectSpec::Header {
                    name: "bad header".into(),
                    format: "{value}".into(),
                }
            }),
        ];
        for (i, change) in bad.iter().enumerate() {
            let mut r = create("gh");
            change(&mut r);
            assert!(validate(&r, 1_000).is_err(), "case {i} was accepted");
        }
        let mut ip = create("ip");
        ip.hosts = vec!["203.0.113.7".into()];
        assert!(validate(&ip, 0).is_ok());
    }

    #[test]
    fn an_invalid_request_reads_as_its_message() {
        let e = check_name("no spaces").unwrap_err();
        assert_eq!(
            e.to_string(),
            "secret name \"no spaces\" must be 1 to 64 characters of [A-Za-z0-9_-]"
        );
        assert_eq!(String::from(e.clone()), e.to_string());
        assert_eq!(
            check_method("CONNECT").unwrap_err(),
            Invalid("method CONNECT cannot carry a credential".into())
        );
    }
}
