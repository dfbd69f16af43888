//! The constraints the API enforces, written into its OpenAPI document: patterns of
//! names, ranges of numbers (some from this daemon's configuration), enums, and the
//! statuses every operation can answer. Derived schemas only know Rust types; this file
//! states what the validators behind them accept, so that clients and schema-driven
//! fuzzers can rely on the document. `tests` below checks each pattern against the
//! validator it describes.

use serde_json::{Map, Value, json};

/// Template names (`sandpit_core::templates::check_name`); `host` is built in.
pub(crate) const TEMPLATE_NAME: &str = r"^(?!host$)[A-Za-z0-9_][A-Za-z0-9._-]{0,63}$";
/// Any template a sandbox may start from, `host` included.
pub(crate) const TEMPLATE_REF: &str = r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,63}$";
/// Pool names (`Manager::create_pool`).
pub(crate) const POOL_NAME: &str = r"^[A-Za-z0-9_-]{1,64}$";
/// Volume names (`sandpit_core::volumes::check_name`).
pub(crate) const VOLUME_NAME: &str = r"^[a-z0-9][a-z0-9_-]{0,62}$";
/// Secret names (`sandpit_broker::rules::check_name`).
pub(crate) const SECRET_NAME: &str = r"^[A-Za-z0-9_-]{1,64}$";
/// Lease user names (`sandpit_core::leases::check_user`).
pub(crate) const LEASE_USER: &str = r"^(?!\.\.?$)[A-Za-z0-9._@+-]{1,128}$";
/// Snapshot names (`sandpit_core::snapshots::snapshot_name_ok`).
pub(crate) const SNAPSHOT_NAME: &str = r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$";
/// Page cursors of sandboxes and executions: hex of `{unix ms}:{id}`.
pub(crate) const CURSOR: &str = r"^(3[0-9]){1,18}3[aA](3[0-9]|[46][1-9a-fA-F]|[57][0-9aA]){1,64}$";
/// Page cursors of the network audit: a row number.
pub(crate) const AUDIT_CURSOR: &str = r"^-?[0-9]{1,18}$";
/// A host a secret may be sent to (`sandpit_broker::rules::check_host`): a DNS name, a
/// wildcard over a domain of two labels or more, or an IPv4 address.
pub(crate) const SECRET_HOST: &str = r"^((\*\.)?([a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?\.)+[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?|[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?|((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9]))$";
/// Header values the broker sends: visible characters, spaces and tabs.
pub(crate) const HEADER_TEXT: &str = r"^[^\x00-\x08\x0a-\x1f\x7f]*$";
/// A secret's path prefix (`sandpit_broker::rules::check_prefix`): visible ASCII from `/`,
/// no dot segments, no encoded separators or dots.
pub(crate) const PATH_PREFIX: &str = r"^(?!.*(/\.\.?(/|$)|%2[fFeE]|%5[cC]|%00|\\))/[!-~]*$";
/// A port number, 1 to 65535.
const PORT: &str =
    "([1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])";
/// One IPv4 octet.
const OCTET: &str = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])";
/// Egress rule domains (`sandpit_net::policy::parse_domain`): a host name or `*.` and
/// one, not an address.
fn rule_domain() -> String {
    let ip = format!("({OCTET}\\.){{3}}{OCTET}\\.?$");
    format!("^(\\*\\.)?(?!{ip})[A-Za-z0-9_-]{{1,63}}(\\.[A-Za-z0-9_-]{{1,63}})*\\.?$")
}
/// Egress rule networks (`sandpit_net::policy::Cidr::parse`).
fn rule_cidr() -> String {
    format!("^({OCTET}\\.){{3}}{OCTET}(/([0-9]|[12][0-9]|3[0-2]))?$")
}
/// Sandbox states a list may filter by, comma-separated.
fn state_list() -> String {
    let one = "(creating|running|paused|hibernated|stopping|stopped|error)";
    format!("^({one}(,{one})*)?$")
}
/// Environment variable names (`sandpit_core::manager::check_env`): no `=`, no NUL.
pub(crate) const ENV_NAME: &str = r"^[^=\x00]{1,256}$";

/// What of this daemon's configuration the document states.
#[derive(Debug, Clone)]
pub struct DocConfig {
    /// Longest sandbox timeout, seconds (`serve --max-timeout`).
    pub max_timeout_secs: u64,
    /// Largest pool (`[pool_limits] max_size`).
    pub max_pool_size: u32,
    /// Runtimes a create may name.
    pub runtimes: Vec<String>,
}

/// The OpenAPI document of the API with the constraints of this daemon.
pub fn document(doc: &utoipa::openapi::OpenApi, cfg: &DocConfig) -> Value {
    let (v, missing) = constrained(doc, cfg);
    for at in missing {
        // A renamed field or route; the unit tests fail on it, so it never ships.
        tracing::error!(at, "an OpenAPI constraint names no part of the document");
    }
    v
}

/// The document and the places constraints were meant for but found missing.
fn constrained(doc: &utoipa::openapi::OpenApi, cfg: &DocConfig) -> (Value, Vec<String>) {
    let v = match serde_json::to_value(doc) {
        Ok(v) => v,
        Err(e) => return (Value::Null, vec![format!("the document itself: {e}")]),
    };
    let mut d = Doc {
        v,
        missing: Vec::new(),
    };
    schemas(&mut d, cfg);
    parameters(&mut d);
    statuses(&mut d.v);
    (d.v, d.missing)
}

/// The document being constrained.
struct Doc {
    v: Value,
    missing: Vec<String>,
}

fn pattern(p: &str) -> Value {
    json!({"pattern": p})
}

fn range(lo: u64, hi: u64) -> Value {
    json!({"minimum": lo, "maximum": hi})
}

fn one_of(values: &[&str]) -> Value {
    json!({"enum": values})
}

/// A path, as `sandpit_api::paths::normalize` takes it: not empty, no NUL, at most 4096 bytes.
fn path() -> Value {
    json!({"minLength": 1, "maxLength": 4096, "pattern": r"^[^\x00]+$"})
}

/// Environment variables (`check_env`).
fn env() -> Value {
    json!({
        "maxProperties": 1024,
        "propertyNames": {"type": "string", "pattern": ENV_NAME},
        "additionalProperties": {"type": "string", "maxLength": 131072, "pattern": r"^[^\x00]*$"},
    })
}

/// Caller labels (`check_metadata`).
fn metadata() -> Value {
    json!({
        "maxProperties": 64,
        "propertyNames": {"type": "string", "minLength": 1, "maxLength": 256},
        "additionalProperties": {"type": "string", "maxLength": 1024},
    })
}

/// Merges `add` into the object at `at` (creating nothing: a missing target is a bug in
/// this table, recorded, so that a renamed field fails the tests rather than silently).
fn merge(d: &mut Doc, at: &str, add: Value) {
    let Some(target) = d.v.pointer_mut(at) else {
        d.missing.push(at.to_string());
        return;
    };
    // An optional field is `{"type": [T, "null"]}` or `{"oneOf": [{"type": "null"}, S]}`:
    // the constraint belongs on S.
    let target = match target.get_mut("oneOf") {
        Some(Value::Array(alts)) => match alts
            .iter_mut()
            .find(|a| a.get("type") != Some(&json!("null")))
        {
            Some(t) => t,
            None => return,
        },
        _ => target,
    };
    let nullable = target
        .get("type")
        .and_then(Value::as_array)
        .is_some_and(|t| t.contains(&json!("null")));
    if let (Some(obj), Value::Object(add)) = (target.as_object_mut(), add) {
        for (k, mut val) in add {
            // `null` stays a valid value of an optional field.
            if let ("enum", true, Value::Array(values)) = (k.as_str(), nullable, &mut val) {
                values.push(Value::Null);
            }
            obj.insert(k, val);
        }
    }
}

fn prop(d: &mut Doc, schema: &str, field: &str, add: Value) {
    merge(
        d,
        &format!("/components/schemas/{schema}/properties/{field}"),
        add,
    );
}

fn schemas(v: &mut Doc, cfg: &DocConfig) {
    prop(
        v,
        "NetworkRule",
        "domain",
        json!({"maxLength": 255, "pattern": rule_domain()}),
    );
    prop(v, "NetworkRule", "cidr", pattern(&rule_cidr()));
    prop(v, "NetworkRule", "name", json!({"maxLength": 128}));
    prop(
        v,
        "NetworkRule",
        "ports",
        json!({"maxItems": sandpit_net::policy::MAX_PORT_RANGES}),
    );
    prop(
        v,
        "NetworkPolicy",
        "rules",
        json!({"maxItems": sandpit_net::policy::MAX_RULES}),
    );
    // A rule needs a selector; `override` only on allow rules.
    merge(
        v,
        "/components/schemas/NetworkRule",
        json!({"anyOf": [
            {"required": ["domain"], "properties": {"domain": {"type": "string"}}},
            {"required": ["cidr"], "properties": {"cidr": {"type": "string"}}},
            {"required": ["ports"], "properties": {"ports": {"minItems": 1}}},
        ],
        "not": {"required": ["action", "override"],
                "properties": {"action": {"const": "deny"}, "override": {"const": true}}}}),
    );
    // Exactly one of the two expiries.
    merge(
        v,
        "/components/schemas/CreateSecretRequest",
        json!({"oneOf": [
            {"required": ["expires_at_ms"], "properties": {"expires_at_ms": {"type": "integer"}},
             "not": {"required": ["ttl_secs"], "properties": {"ttl_secs": {"type": "integer"}}}},
            {"required": ["ttl_secs"], "properties": {"ttl_secs": {"type": "integer"}},
             "not": {"required": ["expires_at_ms"], "properties": {"expires_at_ms": {"type": "integer"}}}},
        ]}),
    );
    // Replaced whole: `merge` would descend into the first alternative.
    if let Some(port) = v.v.pointer_mut("/components/schemas/PortSpec") {
        port["oneOf"] = json!([
            {"type": "integer", "minimum": 1, "maximum": 65535},
            {"type": "string", "pattern": format!("^0*{PORT}(-0*{PORT})?$")},
        ]);
    }
    let users = one_of(&["user", "root"]);
    let runtimes: Vec<&str> = cfg.runtimes.iter().map(String::as_str).collect();
    let harnesses = one_of(&["pi", "opencode", "claude", "codex"]);
    let timeout = range(1, cfg.max_timeout_secs);
    let limits = [
        ("cpu_millis", sandpit_core::manager::CPU_RANGE),
        ("memory_bytes", sandpit_core::manager::MEMORY_RANGE),
        ("disk_bytes", sandpit_core::manager::DISK_RANGE),
        ("max_processes", sandpit_core::manager::PROCESSES_RANGE),
    ];
    for (field, (lo, hi)) in limits {
        prop(v, "LimitsSpec", field, range(lo, hi));
    }
    for s in ["CreateSandboxRequest", "CreateWorkspaceRequest"] {
        prop(v, s, "env", env());
        prop(v, s, "template", pattern(TEMPLATE_REF));
        prop(v, s, "timeout", timeout.clone());
    }
    let c = "CreateSandboxRequest";
    prop(v, c, "metadata", metadata());
    prop(v, c, "runtime", one_of(&runtimes));
    prop(v, c, "user", users.clone());
    prop(v, c, "on_timeout", one_of(&["kill", "pause", "hibernate"]));
    prop(
        v,
        c,
        "workdir",
        json!({"pattern": r"^/[^\x00]*$", "maxLength": 4096}),
    );
    merge(
        v,
        &format!("/components/schemas/{c}/properties/secrets/items"),
        pattern(SECRET_NAME),
    );
    prop(v, "VolumeMountSpec", "name", pattern(VOLUME_NAME));
    prop(
        v,
        "VolumeMountSpec",
        "path",
        json!({"pattern": r"^/[^\x00]*[^/\x00][^\x00]*$", "maxLength": 4096}),
    );
    prop(
        v,
        "ForkRequest",
        "count",
        range(1, u64::from(sandpit_core::snapshots::MAX_FORK)),
    );
    prop(v, "ForkRequest", "timeout", timeout.clone());
    prop(v, "ForkRequest", "metadata", metadata());
    prop(v, "SetTimeoutRequest", "timeout", timeout);
    prop(v, "CreateSnapshotRequest", "name", pattern(SNAPSHOT_NAME));
    prop(v, "PoolSpec", "name", pattern(POOL_NAME));
    prop(v, "PoolSpec", "template", pattern(TEMPLATE_REF));
    prop(v, "PoolSpec", "runtime", one_of(&runtimes));
    prop(
        v,
        "PoolSpec",
        "size",
        range(0, u64::from(cfg.max_pool_size)),
    );
    prop(
        v,
        "ResizePoolRequest",
        "size",
        range(0, u64::from(cfg.max_pool_size)),
    );
    let (lo, hi) = sandpit_core::volumes::SIZE_RANGE;
    prop(v, "CreateVolumeRequest", "name", pattern(VOLUME_NAME));
    prop(v, "CreateVolumeRequest", "size_bytes", range(lo, hi));
    prop(v, "BuildTemplateRequest", "name", pattern(TEMPLATE_NAME));
    prop(v, "BuildTemplateRequest", "default_user", users.clone());
    prop(v, "BuildTemplateRequest", "env", env());
    let r = "RunCommandRequest";
    merge(
        v,
        &format!("/components/schemas/{r}/properties/argv"),
        json!({"minItems": 1, "prefixItems": [{"type": "string", "minLength": 1}]}),
    );
    prop(v, r, "env", env());
    prop(v, r, "user", users);
    prop(
        v,
        r,
        "cwd",
        json!({"pattern": r"^[^\x00]*$", "maxLength": 4096}),
    );
    // Commands on a pseudo-terminal run only through the WebSocket route.
    merge(
        v,
        &format!("/components/schemas/{r}/properties/pty"),
        json!({"type": "null", "description": "Only on the WebSocket route `/commands/stream`; refused here."}),
    );
    prop(
        v,
        "SignalRequest",
        "signal",
        one_of(&["SIGTERM", "SIGKILL"]),
    );
    prop(v, "PathRequest", "path", path());
    prop(v, "MoveRequest", "from", path());
    prop(v, "MoveRequest", "to", path());
    prop(
        v,
        "PortUrlRequest",
        "expires_in",
        range(1, crate::ingress::auth::MAX_PORT_URL_SECS),
    );
    prop(
        v,
        "PortUrlRequest",
        "path",
        json!({"pattern": r"^/[^#\s\x00-\x1f\x7f-\x9f]*$", "maxLength": 4096}),
    );
    prop(v, "CreateAgentRequest", "harness", harnesses.clone());
    prop(v, "CreateWorkspaceRequest", "harness", harnesses);
    prop(v, "StartRunRequest", "mode", one_of(&["fresh", "continue"]));
    prop(v, "ApproveRequest", "scope", one_of(&["once", "run"]));
    prop(
        v,
        "SandboxSecrets",
        "secrets",
        json!({"items": {"type": "string", "pattern": SECRET_NAME}}),
    );
    let rules = sandpit_broker::rules::MAX_RULES;
    let s = "CreateSecretRequest";
    prop(v, s, "name", pattern(SECRET_NAME));
    prop(
        v,
        s,
        "value",
        json!({"minLength": 1, "maxLength": sandpit_broker::rules::MAX_VALUE, "pattern": HEADER_TEXT}),
    );
    prop(
        v,
        s,
        "hosts",
        json!({"minItems": 1, "maxItems": rules, "items": {"type": "string", "maxLength": 253, "pattern": SECRET_HOST}}),
    );
    prop(
        v,
        s,
        "methods",
        json!({"minItems": 1, "maxItems": rules, "items": {"type": "string", "enum":
            ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE"]}}),
    );
    prop(
        v,
        s,
        "path_prefixes",
        json!({"maxItems": rules, "items": {"type": "string", "maxLength": 1024, "pattern": PATH_PREFIX}}),
    );
    prop(v, s, "ttl_secs", range(1, 10 * 365 * 24 * 3600));
    prop(
        v,
        "AgentModelSpec",
        "base_url",
        json!({"minLength": 1, "pattern": "^https?://[^\\s]+$"}),
    );
    prop(v, "AgentModelSpec", "model", json!({"minLength": 1}));
}

/// The schema of parameter `name` of operation `method path`.
fn param(v: &mut Doc, path: &str, method: &str, name: &str, add: Value) {
    let at = format!(
        "/paths/{}/{method}/parameters",
        path.replace('~', "~0").replace('/', "~1")
    );
    let found = match v.v.pointer(&at) {
        Some(Value::Array(params)) => params
            .iter()
            .position(|p| p.get("name") == Some(&json!(name))),
        _ => None,
    };
    match found {
        Some(i) => merge(v, &format!("{at}/{i}/schema"), add),
        None => v.missing.push(format!("{method} {path} parameter {name}")),
    }
}

fn parameters(v: &mut Doc) {
    param(v, "/v1/sandboxes", "get", "state", pattern(&state_list()));
    param(v, "/v1/sandboxes", "get", "cursor", pattern(CURSOR));
    merge(
        v,
        "/paths/~1v1~1sandboxes/get/parameters/1/schema/items",
        pattern("^[^=]*=.*$"),
    );
    param(
        v,
        "/v1/sandboxes/{id}/executions",
        "get",
        "cursor",
        pattern(CURSOR),
    );
    param(
        v,
        "/v1/network/audit",
        "get",
        "cursor",
        pattern(AUDIT_CURSOR),
    );
    for p in ["from", "to"] {
        param(v, "/v1/usage", "get", p, json!({"minimum": 0}));
    }
    for p in ["start", "end"] {
        param(
            v,
            "/v1/sandboxes/{id}/metrics",
            "get",
            p,
            json!({"minimum": 0}),
        );
    }
    for m in ["get", "post"] {
        param(
            v,
            "/v1/secrets",
            m,
            "owner",
            json!({"minLength": 1, "maxLength": 256}),
        );
    }
    for m in ["get", "delete"] {
        param(
            v,
            "/v1/secrets/{name}",
            m,
            "owner",
            json!({"minLength": 1, "maxLength": 256}),
        );
    }
    for m in ["get", "delete"] {
        param(v, "/v1/leases/{user}", m, "user", pattern(LEASE_USER));
        param(v, "/v1/secrets/{name}", m, "name", pattern(SECRET_NAME));
        param(v, "/v1/volumes/{name}", m, "name", pattern(VOLUME_NAME));
        param(v, "/v1/pools/{name}", m, "name", pattern(POOL_NAME));
    }
    // `host` can be read but never removed.
    param(
        v,
        "/v1/templates/{name}",
        "get",
        "name",
        pattern(TEMPLATE_REF),
    );
    param(
        v,
        "/v1/templates/{name}",
        "delete",
        "name",
        pattern(TEMPLATE_NAME),
    );
    param(v, "/v1/pools/{name}", "patch", "name", pattern(POOL_NAME));
    param(
        v,
        "/v1/leases/{user}/acquire",
        "post",
        "user",
        pattern(LEASE_USER),
    );
    param(
        v,
        "/v1/sandboxes/{id}/ports/{port}/url",
        "post",
        "port",
        json!({"type": "integer", "minimum": 1, "maximum": 65535}),
    );
    param(
        v,
        "/v1/approvals",
        "get",
        "state",
        one_of(&["pending", "approved", "denied", "expired"]),
    );
    for p in [
        "/v1/sandboxes/{id}/files",
        "/v1/sandboxes/{id}/files/list",
        "/v1/sandboxes/{id}/files/stat",
    ] {
        param(v, p, "get", "path", path());
        param(v, p, "get", "user", one_of(&["user", "root"]));
    }
    for m in ["put", "delete"] {
        param(v, "/v1/sandboxes/{id}/files", m, "path", path());
        param(
            v,
            "/v1/sandboxes/{id}/files",
            m,
            "user",
            one_of(&["user", "root"]),
        );
    }
    param(
        v,
        "/v1/network/audit",
        "get",
        "verdict",
        one_of(&["allow", "deny"]),
    );
    param(
        v,
        "/v1/network/audit/stream",
        "get",
        "verdict",
        one_of(&["allow", "deny"]),
    );
}

/// Every operation that reads input can answer 400 with an [`sandpit_api::ErrorBody`],
/// and every one behind a key 401; derived documents list only what each handler names.
fn statuses(v: &mut Value) {
    let error = json!({
        "description": "",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}},
    });
    let Some(Value::Object(paths)) = v.get_mut("paths") else {
        return;
    };
    for (path, ops) in paths.iter_mut() {
        let Some(ops) = ops.as_object_mut() else {
            continue;
        };
        for (_, op) in ops.iter_mut() {
            let Some(op) = op.as_object_mut() else {
                continue;
            };
            let has_body = op.contains_key("requestBody");
            let reads_input = has_body
                || op
                    .get("parameters")
                    .and_then(Value::as_array)
                    .is_some_and(|p| !p.is_empty());
            let open = matches!(path.as_str(), "/v1/health" | "/v1/openapi.json");
            let responses = op
                .entry("responses")
                .or_insert_with(|| Value::Object(Map::new()));
            let Some(responses) = responses.as_object_mut() else {
                continue;
            };
            if reads_input {
                responses.entry("400").or_insert_with(|| {
                    with_description(
                        &error,
                        "The request is malformed or breaks a stated constraint.",
                    )
                });
            }
            // A path names a resource, and a body may name others (a template, a secret).
            if path.contains('{') || has_body {
                responses
                    .entry("404")
                    .or_insert_with(|| with_description(&error, "No such resource of the caller."));
            }
            if !open {
                // An admin-only operation, an approver-only decision, a disabled runtime,
                // a file the sandbox user may not touch.
                responses.entry("403").or_insert_with(|| {
                    with_description(&error, "The key, or the sandbox user, may not do this.")
                });
            }
            if !open {
                responses
                    .entry("401")
                    .or_insert_with(|| with_description(&error, "No valid API key."));
            }
        }
    }
}

fn with_description(v: &Value, d: &str) -> Value {
    let mut v = v.clone();
    v["description"] = json!(d);
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use regex::Regex;

    /// Strings near the edges of every name rule: empty, one character, the longest,
    /// one longer, leading and inner punctuation, `host`, `.` and `..`, non-ASCII.
    fn corpus() -> Vec<String> {
        let mut out: Vec<String> = [
            "", "a", "A", "0", "_", "-", ".", "..", "...", "host", "hosts", "a.b", ".a", "-a",
            "a-", "a_b", "a b", "a/b", "a@b", "a+b", "é", "a\u{0}", "ab=c", "x.y.z", "a..b",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        for n in [62, 63, 64, 65, 127, 128, 129] {
            out.push("a".repeat(n));
            out.push("A".repeat(n));
            out.push(format!("1{}", "b".repeat(n - 1)));
        }
        out
    }

    /// A pattern here agrees with the validator it states, on every string of the corpus.
    fn agrees(pattern: &str, valid: impl Fn(&str) -> bool) {
        // The `regex` crate has no look-ahead; the patterns use one only to exclude exact
        // names, which are checked apart here.
        let (plain, excluded): (String, Vec<&str>) = match pattern {
            TEMPLATE_NAME => (TEMPLATE_REF.to_string(), vec!["host"]),
            LEASE_USER => (r"^[A-Za-z0-9._@+-]{1,128}$".to_string(), vec![".", ".."]),
            p => (p.to_string(), vec![]),
        };
        let re = Regex::new(&plain).expect("a valid pattern");
        for s in corpus() {
            let documented = re.is_match(&s) && !excluded.contains(&s.as_str());
            assert_eq!(
                documented,
                valid(&s),
                "{pattern} says {documented} for {s:?}, the validator the opposite"
            );
        }
    }

    #[test]
    fn name_patterns_state_what_the_validators_accept() {
        agrees(TEMPLATE_NAME, |s| {
            sandpit_core::templates::check_name(s).is_ok()
        });
        agrees(TEMPLATE_REF, |s| {
            s == "host" || sandpit_core::templates::check_name(s).is_ok()
        });
        agrees(VOLUME_NAME, |s| {
            sandpit_core::volumes::check_name(s).is_ok()
        });
        agrees(SECRET_NAME, |s| {
            sandpit_broker::rules::check_name(s).is_ok()
        });
        agrees(LEASE_USER, |s| sandpit_core::leases::check_user(s).is_ok());
        agrees(SNAPSHOT_NAME, sandpit_core::snapshots::snapshot_name_ok);
        agrees(POOL_NAME, sandpit_core::pool_manage::pool_name_ok);
        agrees(ENV_NAME, |s| {
            let env = std::collections::BTreeMap::from([(s.to_string(), String::new())]);
            sandpit_core::manager::check_env(&env).is_ok()
        });
    }

    #[test]
    fn every_constraint_lands_on_a_part_of_the_document() {
        let cfg = DocConfig {
            max_timeout_secs: 3600,
            max_pool_size: 8,
            runtimes: vec!["container".into()],
        };
        let (doc, missing) = constrained(&crate::api::openapi(), &cfg);
        assert!(
            missing.is_empty(),
            "constraints that found no target: {missing:?}"
        );
        let s = &doc["components"]["schemas"];
        assert_eq!(
            s["CreateSandboxRequest"]["properties"]["timeout"]["maximum"],
            3600
        );
        assert_eq!(s["PoolSpec"]["properties"]["size"]["maximum"], 8);
        assert_eq!(
            s["CreateSandboxRequest"]["properties"]["user"]["enum"],
            json!(["user", "root", null])
        );
        assert_eq!(s["PoolSpec"]["properties"]["name"]["pattern"], POOL_NAME);
        // Query parameters are in the query, path parameters in the path template.
        for (path, ops) in doc["paths"].as_object().expect("paths") {
            for (method, op) in ops.as_object().expect("operations") {
                for p in op["parameters"].as_array().into_iter().flatten() {
                    let name = p["name"].as_str().expect("a name");
                    let in_template = path.contains(&format!("{{{name}}}"));
                    assert_eq!(
                        p["in"] == "path",
                        in_template,
                        "{method} {path}: parameter {name} is in {}",
                        p["in"]
                    );
                }
                assert!(
                    op["responses"].get("401").is_some()
                        || path == "/v1/health"
                        || path == "/v1/openapi.json"
                );
            }
        }
    }
}
