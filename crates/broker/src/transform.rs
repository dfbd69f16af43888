//! A sandbox's egress header rules (E2B's network `rules`): per host pattern, headers the
//! broker sets on the sandbox's requests to that host, whose values may name the owner's
//! secrets as `${e2b.secrets.NAME}`. The sandbox only ever sees the placeholder; the
//! broker fills it in on the way out. Pure functions over plain data.

use crate::rules::{Invalid, normal_host};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Most host patterns of one sandbox.
pub const MAX_HOSTS: usize = 64;
/// Most rules for one host pattern.
pub const MAX_RULES_PER_HOST: usize = 16;
/// Most headers one rule sets.
pub const MAX_HEADERS: usize = 32;
/// Longest header value (before secrets are filled in).
pub const MAX_HEADER_VALUE: usize = 8 << 10;
/// How a placeholder starts; the secret's name and `}` follow.
pub const SECRET_PREFIX: &str = "${e2b.secrets.";
/// E2B's workload identity placeholders, which sandpit cannot fill.
const IDENTITY_PREFIX: &str = "${e2b.identity.";

/// Headers a rule may not set: they frame or route the request.
const RESERVED: &[&str] = &[
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

/// One header a rule sets: its name (lower case) and value template.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeaderRule {
    pub name: String,
    pub value: String,
}

/// The headers for one host pattern, in the order they are set (a later one of the same
/// name wins).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostRules {
    pub pattern: String,
    pub headers: Vec<HeaderRule>,
}

/// A sandbox's rules as stored.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EgressRules {
    pub hosts: Vec<HostRules>,
    /// The rules as the client sent them (keys lower-cased), shown back by sandbox info.
    #[serde(default)]
    pub shown: serde_json::Value,
    /// E2B's `maskRequestHost`: the Host the sandbox's ports see on requests that come in
    /// through the ingress, `${PORT}` replaced by the port.
    #[serde(default)]
    pub mask_request_host: Option<String>,
}

/// The placeholder of `maskRequestHost` that stands for the port.
pub const MASK_PORT: &str = "${PORT}";

/// Checks a `maskRequestHost`: a host, optionally `:port`, where `${PORT}` may stand for
/// (part of) a label or the port; at most 253 bytes.
pub fn check_mask(mask: &str) -> Result<String, Invalid> {
    let sample = mask.replace(MASK_PORT, "8080");
    let bad = || {
        Invalid::from(format!(
            "maskRequestHost {mask:?} must be a host name, optionally with :port, where ${{PORT}} stands for the port"
        ))
    };
    if mask.is_empty() || mask.len() > 253 {
        return Err(bad());
    }
    let (host, port) = match sample.rsplit_once(':') {
        Some((h, p)) => (h, Some(p)),
        None => (sample.as_str(), None),
    };
    if port.is_some_and(|p| p.parse::<u16>().is_err()) {
        return Err(bad());
    }
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    };
    if !host.split('.').all(label_ok) {
        return Err(bad());
    }
    Ok(mask.to_string())
}

/// The Host a request to `port` gets under `mask`.
pub fn masked_host(mask: &str, port: u16) -> String {
    mask.replace(MASK_PORT, &port.to_string())
}

/// One rule of E2B's create body: `{"transform": {"headers": {...}}}`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    transform: Option<RawTransform>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTransform {
    headers: Option<BTreeMap<String, String>>,
}

/// A part of a header value template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part<'a> {
    Text(&'a str),
    /// A secret's name (lower case, as stored).
    Secret(String),
}

/// Splits a value into text and `${e2b.secrets.NAME}` placeholders.
pub fn parse_value(v: &str) -> Result<Vec<Part<'_>>, Invalid> {
    let mut parts = Vec::new();
    let mut rest = v;
    while let Some(at) = rest.find(SECRET_PREFIX) {
        if at > 0 {
            parts.push(Part::Text(&rest[..at]));
        }
        let after = &rest[at + SECRET_PREFIX.len()..];
        let end = after
            .find('}')
            .ok_or_else(|| Invalid::from(format!("unclosed secret placeholder in {v:?}")))?;
        let name = &after[..end];
        crate::rules::check_name(name)
            .map_err(|e| Invalid::from(format!("placeholder ${{e2b.secrets.{name}}}: {}", e.0)))?;
        parts.push(Part::Secret(name.to_ascii_lowercase()));
        rest = &after[end + 1..];
    }
    if !rest.is_empty() {
        parts.push(Part::Text(rest));
    }
    Ok(parts)
}

/// The names of the secrets a value template needs.
pub fn secret_names(v: &str) -> Vec<String> {
    parse_value(v)
        .map(|parts| {
            parts
                .into_iter()
                .filter_map(|p| match p {
                    Part::Secret(n) => Some(n),
                    Part::Text(_) => None,
                })
                .collect()
        })
        .unwrap_or_default()
}

fn check_pattern(key: &str) -> Result<String, Invalid> {
    let host = normal_host(key);
    if host == "*" || host.is_empty() {
        return Err(format!("rules: host {key:?} is not usable; name a host or `*.domain`").into());
    }
    if host.contains('/') {
        return Err(format!(
            "rules: {key:?}: address ranges are not supported, name a host or an address"
        )
        .into());
    }
    let name = host.strip_prefix("*.").unwrap_or(&host);
    if name.parse::<std::net::IpAddr>().is_ok() {
        if host.starts_with("*.") {
            return Err(format!("rules: {key:?} is not a host pattern").into());
        }
        return Ok(host);
    }
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && !l.starts_with('-')
            && !l.ends_with('-')
            && l.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
    };
    if name.len() > 253 || !name.split('.').all(label_ok) {
        return Err(format!(
            "rules: host {key:?} must be a DNS name, `*.` and a domain, or an address"
        )
        .into());
    }
    Ok(host)
}

fn check_header(host: &str, name: &str, value: &str) -> Result<HeaderRule, Invalid> {
    let lower = name.to_ascii_lowercase();
    if http::HeaderName::from_bytes(lower.as_bytes()).is_err() {
        return Err(format!("rules[{host}]: {name:?} is not a header name").into());
    }
    if RESERVED.contains(&lower.as_str()) || lower.starts_with("proxy-") {
        return Err(format!("rules[{host}]: header {name:?} cannot be set by a rule").into());
    }
    if value.len() > MAX_HEADER_VALUE {
        return Err(
            format!("rules[{host}]: the value of {name} is over {MAX_HEADER_VALUE} bytes").into(),
        );
    }
    if value.bytes().any(|b| (b < 0x20 && b != b'\t') || b == 0x7f) {
        return Err(format!(
            "rules[{host}]: the value of {name} must not contain control characters"
        )
        .into());
    }
    if value.contains(IDENTITY_PREFIX) {
        return Err(format!(
            "rules[{host}]: {name}: workload identity tokens (${{e2b.identity...}}) are not supported by sandpit"
        )
        .into());
    }
    parse_value(value).map_err(|e| Invalid::from(format!("rules[{host}]: {name}: {}", e.0)))?;
    Ok(HeaderRule {
        name: lower,
        value: value.to_string(),
    })
}

/// Reads E2B's `rules` object (`{host: [{transform: {headers: {name: value}}}]}`).
pub fn from_e2b(raw: &serde_json::Value) -> Result<EgressRules, Invalid> {
    let map: BTreeMap<String, Vec<RawRule>> =
        serde_json::from_value(raw.clone()).map_err(|e| Invalid::from(format!("rules: {e}")))?;
    if map.len() > MAX_HOSTS {
        return Err(format!("rules: at most {MAX_HOSTS} hosts").into());
    }
    let mut hosts: Vec<HostRules> = Vec::new();
    let mut shown = serde_json::Map::new();
    for (key, rules) in &map {
        let pattern = check_pattern(key)?;
        if hosts.iter().any(|h| h.pattern == pattern) {
            return Err(format!("rules: host {pattern} is named twice").into());
        }
        if rules.len() > MAX_RULES_PER_HOST {
            return Err(format!("rules[{key}]: at most {MAX_RULES_PER_HOST} rules").into());
        }
        let mut headers = Vec::new();
        let mut shown_rules = Vec::new();
        for rule in rules {
            let set = rule
                .transform
                .as_ref()
                .and_then(|t| t.headers.clone())
                .unwrap_or_default();
            if set.len() > MAX_HEADERS {
                return Err(format!("rules[{key}]: at most {MAX_HEADERS} headers a rule").into());
            }
            for (name, value) in &set {
                headers.push(check_header(&pattern, name, value)?);
            }
            shown_rules.push(match &rule.transform {
                None => serde_json::json!({}),
                Some(_) => serde_json::json!({"transform": {"headers": set}}),
            });
        }
        shown.insert(pattern.clone(), serde_json::Value::Array(shown_rules));
        hosts.push(HostRules { pattern, headers });
    }
    Ok(EgressRules {
        hosts,
        shown: serde_json::Value::Object(shown),
        mask_request_host: None,
    })
}

impl EgressRules {
    /// The rules for `host` (normalised): an exact pattern first, else the longest
    /// wildcard that covers it (rule sets are not merged).
    pub fn lookup(&self, host: &str) -> Option<&HostRules> {
        if let Some(exact) = self.hosts.iter().find(|h| h.pattern == host) {
            return Some(exact);
        }
        self.hosts
            .iter()
            .filter(|h| h.pattern.starts_with("*.") && crate::rules::host_matches(&h.pattern, host))
            .max_by_key(|h| h.pattern.len())
    }

    /// Every secret name the rules need.
    pub fn secret_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .hosts
            .iter()
            .flat_map(|h| h.headers.iter().flat_map(|r| secret_names(&r.value)))
            .collect();
        names.sort();
        names.dedup();
        names
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn rules_read_e2b_shape_and_pick_exact_then_longest_wildcard() {
        let r = from_e2b(&json!({
            "API.example.com": [{"transform": {"headers": {"X-Key": "Bearer ${e2b.secrets.GH}"}}}],
            "*.example.com": [{"transform": {"headers": {"X-A": "1"}}}, {"transform": {"headers": {"X-A": "2"}}}],
            "*.deep.example.com": [{}],
            "203.0.113.5": [{"transform": {"headers": {"X-Ip": "yes"}}}],
        }))
        .unwrap();
        assert_eq!(
            r.lookup("api.example.com").unwrap().pattern,
            "api.example.com"
        );
        assert_eq!(r.lookup("b.example.com").unwrap().pattern, "*.example.com");
        assert_eq!(
            r.lookup("x.deep.example.com").unwrap().pattern,
            "*.deep.example.com"
        );
        assert!(r.lookup("example.com").is_none());
        assert!(r.lookup("example.org").is_none());
        assert_eq!(r.lookup("203.0.113.5").unwrap().headers[0].name, "x-ip");
        let api = r.lookup("api.example.com").unwrap();
        assert_eq!(api.headers[0].name, "x-key");
        assert_eq!(r.secret_names(), ["gh"]);
        let wild = r.lookup("b.example.com").unwrap();
        assert_eq!(
            wild.headers
                .iter()
                .map(|h| h.value.as_str())
                .collect::<Vec<_>>(),
            ["1", "2"]
        );
        assert_eq!(
            r.shown["api.example.com"][0]["transform"]["headers"]["X-Key"],
            "Bearer ${e2b.secrets.GH}"
        );
    }

    #[test]
    fn bad_rules_are_refused_with_a_reason() {
        for bad in [
            json!({"*": [{}]}),
            json!({"10.0.0.0/8": [{}]}),
            json!({"a b.com": [{}]}),
            json!({"h.com": [{"transform": {"headers": {"Host": "x"}}}]}),
            json!({"h.com": [{"transform": {"headers": {"Content-Length": "1"}}}]}),
            json!({"h.com": [{"transform": {"headers": {"bad header": "x"}}}]}),
            json!({"h.com": [{"transform": {"headers": {"X": "a\r\nX-Evil: 1"}}}]}),
            json!({"h.com": [{"transform": {"headers": {"X": "${e2b.secrets.gh"}}}]}),
            json!({"h.com": [{"transform": {"headers": {"X": "${e2b.secrets.a b}"}}}]}),
            json!({"h.com": [{"transform": {"headers": {"X": "${e2b.identity.tokens.aws}"}}}]}),
            json!({"h.com": [{"transform": {"body": "x"}}]}),
            json!({"h.com": [{"other": 1}]}),
            json!({"h.com": {"transform": {}}}),
            json!(["h.com"]),
        ] {
            assert!(from_e2b(&bad).is_err(), "accepted {bad}");
        }
    }

    #[test]
    fn masks_are_hosts_with_a_port_placeholder() {
        for ok in [
            "custom-host.example.com:${PORT}",
            "${PORT}-app.example.com",
            "h.test",
        ] {
            assert!(check_mask(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "a b.com",
            "h.com:${PORT}x",
            "h.com:99999",
            "h.com/x",
            "h\r\nX: 1",
            "h.com:",
        ] {
            assert!(check_mask(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            masked_host("custom.example.com:${PORT}", 8080),
            "custom.example.com:8080"
        );
    }

    #[test]
    fn values_split_into_text_and_secrets() {
        assert_eq!(
            parse_value("a ${e2b.secrets.X} b${e2b.secrets.y}").unwrap(),
            vec![
                Part::Text("a "),
                Part::Secret("x".into()),
                Part::Text(" b"),
                Part::Secret("y".into())
            ]
        );
        assert_eq!(
            parse_value("${other}").unwrap(),
            vec![Part::Text("${other}")]
        );
    }
}
