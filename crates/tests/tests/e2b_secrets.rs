//! E2B's `/secrets` API and network `rules` on the credential broker, against a real
//! daemon: shapes and statuses as E2B's SDK parses them, bad input refused, owners kept
//! apart, and a value that appears in no answer, log, sandbox environment or process
//! list. `rules_inject_secrets_on_egress_and_the_sandbox_sees_only_placeholders` drives a
//! sandbox's curl through the egress proxy and the broker to a test HTTPS upstream in a
//! network namespace the test makes (see `netfix`): the upstream gets the header with the
//! value, the sandbox only ever had `${e2b.secrets.NAME}`.

use reqwest::{Method, StatusCode};
use sandpit_client::Client;
use sandpit_tests::netfix::Upstream;
use sandpit_tests::{Daemon, http, sh};
use serde_json::{Value, json};
use std::path::Path;

const VALUE: &str = "ghp_E2bRuleSecret_9d41c7aa";
const VALUE2: &str = "ghp_E2bRotated_Value_77f01b";
const KEY_HEX: &str = "5a1c2a9e8b7d6c5f4e3a2b1c0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e";

struct E2b {
    url: String,
    key: String,
}

impl E2b {
    fn new(d: &Daemon, key: &str) -> Self {
        Self {
            url: d.url.clone(),
            key: key.to_string(),
        }
    }

    /// A request with the key in `X-API-Key`: (status, body text, `x-next-token`).
    async fn raw(
        &self,
        method: Method,
        path: &str,
        body: Option<&str>,
    ) -> (StatusCode, String, Option<String>) {
        let mut req = http()
            .request(method, format!("{}{path}", self.url))
            .header("X-API-Key", &self.key);
        if let Some(b) = body {
            req = req
                .header("content-type", "application/json")
                .body(b.to_string());
        }
        let resp = req.send().await.expect("request");
        let status = resp.status();
        let next = resp
            .headers()
            .get("x-next-token")
            .and_then(|v| v.to_str().ok())
            .map(String::from);
        (status, resp.text().await.expect("body"), next)
    }

    async fn call(&self, method: Method, path: &str, body: Option<Value>) -> (StatusCode, Value) {
        let text = body.map(|b| b.to_string());
        let (s, t, _) = self.raw(method, path, text.as_deref()).await;
        let v = if t.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&t).unwrap_or_else(|_| panic!("not JSON: {t}"))
        };
        (s, v)
    }
}

fn write_key(dir: &Path) -> String {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join("broker.key");
    std::fs::write(&path, KEY_HEX).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path.display().to_string()
}

fn assert_error(v: &Value, status: StatusCode) {
    assert_eq!(v["code"], json!(status.as_u16()), "{v}");
    assert!(v["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_secrets_api_keeps_values_and_owners_apart_and_refuses_bad_input() {
    let b = Daemon::builder();
    let key = write_key(b.data_path());
    let log_dir = tempfile::tempdir().unwrap();
    let log = log_dir.path().join("daemon.log");
    let d = b
        .config(&format!("[broker]\nkey_file = {key:?}\n"))
        .log(&log)
        .log_level("debug")
        .start()
        .await;
    let e = E2b::new(&d, &d.key);
    let body = json!({"name": "GH-Token", "value": VALUE, "metadata": {"env": "test"}});
    let (s, text, _) = e
        .raw(Method::POST, "/secrets", Some(&body.to_string()))
        .await;
    assert_eq!(s, StatusCode::CREATED, "{text}");
    assert!(!text.contains(VALUE), "{text}");
    let created: Value = serde_json::from_str(&text).unwrap();
    let id = created["secretID"].as_str().unwrap().to_string();
    assert!(id.starts_with("sec_"), "{created}");
    assert_eq!(created["name"], "gh-token");
    assert_eq!(created["currentVersion"], 1);
    assert_eq!(created["metadata"], json!({"env": "test"}));
    assert!(created["createdAt"].as_str().unwrap().ends_with('Z'));
    assert_eq!(created["createdAt"], created["updatedAt"]);

    // By id and by name (any case); no answer holds the value.
    for path in [
        "/secrets".to_string(),
        format!("/secrets/{id}"),
        "/secrets/gh-token".into(),
        "/secrets/GH-TOKEN".into(),
        "/v1/secrets".into(),
    ] {
        let (s, text, _) = e.raw(Method::GET, &path, None).await;
        assert_eq!(s, StatusCode::OK, "{path}: {text}");
        assert!(
            text.contains(&id) || path == "/v1/secrets",
            "{path}: {text}"
        );
        assert!(!text.contains(VALUE), "{path}: {text}");
    }
    let (s, v) = e
        .call(
            Method::POST,
            &format!("/secrets/{id}"),
            Some(json!({"value": VALUE2})),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["currentVersion"], 2);
    assert_eq!(
        v["metadata"],
        json!({"env": "test"}),
        "metadata kept when not given"
    );
    assert!(!v.to_string().contains(VALUE2));
    let (s, v) = e
        .call(
            Method::POST,
            "/secrets/gh-token",
            Some(json!({"value": VALUE, "metadata": {}})),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        (v["currentVersion"].clone(), v["metadata"].clone()),
        (json!(3), json!({}))
    );

    // Bad input: 400 with a reason, 409 for a taken name, and nothing stored.
    let long_meta: serde_json::Map<String, Value> =
        (0..33).map(|i| (format!("k{i}"), json!("v"))).collect();
    let bad = [
        json!({"name": "sec_mine", "value": "v"}),
        json!({"name": "a b", "value": "v"}),
        json!({"name": "{x}", "value": "v"}),
        json!({"name": "", "value": "v"}),
        json!({"name": "x".repeat(65), "value": "v"}),
        json!({"name": "ok", "value": ""}),
        json!({"name": "ok", "value": "a\r\nX-Evil: 1"}),
        json!({"name": "ok", "value": "v".repeat(8193)}),
        json!({"name": "ok", "value": "v", "metadata": long_meta}),
        json!({"name": "ok", "value": "v", "metadata": {"k": "v".repeat(1025)}}),
        json!({"name": "ok", "value": "v", "extra": 1}),
        json!({"name": "ok"}),
    ];
    for b in &bad {
        let (s, v) = e.call(Method::POST, "/secrets", Some(b.clone())).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{b}: {v}");
        assert_error(&v, StatusCode::BAD_REQUEST);
    }
    // A parse error does not echo the body (it could hold the value).
    let (s, text, _) = e
        .raw(
            Method::POST,
            "/secrets",
            Some(&format!("{{\"name\": 5, \"value\": \"{VALUE}\"}}")),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(!text.contains(VALUE), "{text}");
    let (s, text, _) = e
        .raw(
            Method::POST,
            "/secrets",
            Some(&format!("{{\"value\": \"{VALUE}\" broken")),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(!text.contains(VALUE), "{text}");
    let (s, v) = e
        .call(
            Method::POST,
            "/secrets",
            Some(json!({"name": "gh-TOKEN", "value": "x"})),
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert_error(&v, StatusCode::CONFLICT);

    // Another owner: nothing of it, by id or name, and its own names are its own.
    let bob_key = d.owner_key("bob").await;
    let bob = E2b::new(&d, &bob_key);
    for sel in [id.as_str(), "gh-token"] {
        for (m, body) in [
            (Method::GET, None),
            (Method::POST, Some(json!({"value": "stolen"}))),
            (Method::DELETE, None),
        ] {
            let (s, v) = bob.call(m.clone(), &format!("/secrets/{sel}"), body).await;
            assert_eq!(s, StatusCode::NOT_FOUND, "{m} {sel}: {v}");
            assert_error(&v, StatusCode::NOT_FOUND);
        }
    }
    let (s, v) = bob.call(Method::GET, "/secrets", None).await;
    assert_eq!((s, v), (StatusCode::OK, json!([])));
    let (s, v) = bob
        .call(
            Method::POST,
            "/secrets",
            Some(json!({"name": "gh-token", "value": "bobs"})),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let (_, v) = e.call(Method::GET, "/secrets/gh-token", None).await;
    assert_eq!(
        v["currentVersion"], 3,
        "bob's create touched alice's secret: {v}"
    );

    // Pages by name, the next one's token in X-Next-Token.
    for n in ["a-one", "b-two"] {
        let (s, v) = e
            .call(
                Method::POST,
                "/secrets",
                Some(json!({"name": n, "value": "v"})),
            )
            .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
    }
    let (s, text, next) = e.raw(Method::GET, "/secrets?limit=2", None).await;
    assert_eq!(s, StatusCode::OK);
    let page: Vec<Value> = serde_json::from_str(&text).unwrap();
    assert_eq!(
        page.iter().map(|p| p["name"].clone()).collect::<Vec<_>>(),
        [json!("a-one"), json!("b-two")]
    );
    let next = next.expect("a next token");
    let (_, text, more) = e
        .raw(
            Method::GET,
            &format!("/secrets?limit=2&nextToken={next}"),
            None,
        )
        .await;
    let page: Vec<Value> = serde_json::from_str(&text).unwrap();
    assert_eq!(page.len(), 1, "{text}");
    assert_eq!(page[0]["name"], "gh-token");
    assert!(more.is_none());
    for q in ["limit=0", "limit=101", "limit=x"] {
        let (s, v) = e.call(Method::GET, &format!("/secrets?{q}"), None).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{q}: {v}");
    }

    // Delete: 204, then 404 (the SDK's destroy answers false).
    let (s, _) = e
        .call(Method::DELETE, &format!("/secrets/{id}"), None)
        .await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    for m in [Method::GET, Method::DELETE] {
        let (s, v) = e.call(m, &format!("/secrets/{id}"), None).await;
        assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    }
    let (_, v) = bob.call(Method::GET, "/secrets/gh-token", None).await;
    assert_eq!(
        v["currentVersion"], 1,
        "alice's delete took bob's secret: {v}"
    );

    d.shutdown().await;
    let logged = std::fs::read_to_string(&log).unwrap();
    assert!(
        logged.contains("E2B secret stored"),
        "the log is not the daemon's"
    );
    for v in [VALUE, VALUE2] {
        assert!(!logged.contains(v), "the daemon logged a secret value");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_broker_key_secrets_and_rules_are_refused_with_the_fix() {
    let d = Daemon::start().await;
    let e = E2b::new(&d, &d.key);
    let (s, v) = e
        .call(
            Method::POST,
            "/secrets",
            Some(json!({"name": "gh", "value": VALUE})),
        )
        .await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    assert!(v["message"].as_str().unwrap().contains("key_file"), "{v}");
    let (s, v) = e
        .call(
            Method::POST,
            "/v2/sandboxes",
            Some(json!({"templateID": "base", "network": {"rules": {"api.example.com": [{"transform": {"headers": {"X-A": "1"}}}]}}})),
        )
        .await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    assert!(sandpit_tests::sandboxes(&d.client()).await.is_empty());
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_rules_make_no_sandbox() {
    let b = Daemon::builder();
    let key = write_key(b.data_path());
    let d = b
        .config(&format!("[broker]\nkey_file = {key:?}\n"))
        .start()
        .await;
    let e = E2b::new(&d, &d.key);
    let (s, v) = e
        .call(
            Method::POST,
            "/secrets",
            Some(json!({"name": "gh", "value": VALUE})),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let bob_key = d.owner_key("bob").await;
    let bob = E2b::new(&d, &bob_key);
    let (s, _) = bob
        .call(
            Method::POST,
            "/secrets",
            Some(json!({"name": "bobs", "value": "bob-value"})),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED);
    // A secret of the native API, bound to its own host: rules cannot send it elsewhere.
    let native = json!({"name": "native", "value": "native-value", "hosts": ["api.example.com"], "methods": ["GET"], "ttl_secs": 600, "inject": {"type": "header", "name": "Authorization"}});
    let (s, v) = e.call(Method::POST, "/v1/secrets", Some(native)).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");

    let header =
        |v: &str| json!({"api.example.com": [{"transform": {"headers": {"Authorization": v}}}]});
    let bad = [
        header("Bearer ${e2b.secrets.missing}"),
        header("Bearer ${e2b.secrets.bobs}"),
        header("Bearer ${e2b.secrets.native}"),
        header("Bearer ${e2b.secrets.gh"),
        header("${e2b.identity.tokens.aws}"),
        header("a\r\nX-Evil: 1"),
        json!({"*": [{"transform": {"headers": {"X-A": "1"}}}]}),
        json!({"10.0.0.0/8": [{}]}),
        json!({"api.example.com": [{"transform": {"headers": {"Host": "evil.example.com"}}}]}),
        json!({"api.example.com": [{"transform": {"headers": {"Content-Length": "0"}}}]}),
        json!({"api.example.com": [{"transform": {"body": "x"}}]}),
        json!({"api.example.com": "not a list"}),
    ];
    for rules in &bad {
        let (s, v) = e
            .call(
                Method::POST,
                "/v2/sandboxes",
                Some(json!({"templateID": "base", "network": {"rules": rules}})),
            )
            .await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{rules}: {v}");
        assert_error(&v, StatusCode::BAD_REQUEST);
    }
    assert!(sandpit_tests::sandboxes(&d.client()).await.is_empty());
    // The same through the update of a running sandbox.
    let (s, v) = e
        .call(
            Method::POST,
            "/v2/sandboxes",
            Some(json!({"templateID": "base"})),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let id = v["sandboxID"].as_str().unwrap().to_string();
    let (s, v) = e
        .call(
            Method::PUT,
            &format!("/sandboxes/{id}/network"),
            Some(json!({"rules": header("Bearer ${e2b.secrets.bobs}")})),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    d.shutdown().await;
}

async fn curl(c: &Client, id: &str, args: &str) -> (String, String) {
    let out = sh(
        c,
        id,
        &format!("curl -sS --max-time 10 -w '\\n%{{http_code}}' {args}; echo \" $?\""),
    )
    .await;
    let (body, tail) = out.stdout.trim_end().rsplit_once('\n').unwrap_or_default();
    for v in [VALUE, VALUE2] {
        assert!(!out.stdout.contains(v), "{}", out.stdout);
        assert!(!out.stderr.contains(v), "{}", out.stderr);
    }
    (body.to_string(), tail.to_string())
}

/// Looks for `needle` in every process's environment and command line, the process
/// list, the shell's environment (a count), and files under /etc, /tmp, /home, /root and
/// /run (their names). The needle goes in reversed, so no command line of the search
/// itself holds it.
async fn search(c: &Client, id: &str, needle: &str) -> String {
    let reversed: String = needle.chars().rev().collect();
    let out = sh(
        c,
        id,
        &format!(
            "X='{reversed}'; n() {{ printf '%s\\n' \"$X\" | rev; }}; \
             {{ cat /proc/[0-9]*/environ /proc/[0-9]*/cmdline 2>/dev/null; ps -eo args; env; }} | grep -c -F -f <(n); \
             grep -rlsF -f <(n) /etc /tmp /home /root /run 2>/dev/null | head -3; true"
        ),
    )
    .await;
    out.stdout
}

/// The header `name` (lower case) of the last request the upstream got for `host`.
fn last_header(up: &Upstream, host: &str, name: &str) -> Option<String> {
    let reqs: Vec<Value> = up
        .requests()
        .into_iter()
        .filter(|r| r["host"] == host)
        .collect();
    let last = reqs.last()?;
    last["headers"]
        .as_array()?
        .iter()
        .find(|h| h[0].as_str().is_some_and(|n| n.eq_ignore_ascii_case(name)))
        .and_then(|h| h[1].as_str().map(String::from))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_inject_secrets_on_egress_and_the_sandbox_sees_only_placeholders() {
    let up = Upstream::start(&[
        ("api.upstream.test", "@2"),
        ("other.upstream.test", "@3"),
        ("wild.upstream.test", "@4"),
    ]);
    let b = Daemon::builder();
    let key = write_key(b.data_path());
    let log_dir = tempfile::tempdir().unwrap();
    let log = log_dir.path().join("daemon.log");
    let d = b
        .config(&format!(
            "{}[broker]\nkey_file = {key:?}\nextra_ca_file = {:?}\n",
            up.config(""),
            up.ca_file().display().to_string()
        ))
        .log(&log)
        .log_level("debug")
        .start()
        .await;
    let e = E2b::new(&d, &d.key);
    let c = d.client();
    let (s, v) = e
        .call(
            Method::POST,
            "/secrets",
            Some(json!({"name": "GH", "value": VALUE})),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let placeholder = "${e2b.secrets.gh}";
    let create = json!({
        "templateID": "base",
        "timeout": 300,
        "allow_internet_access": false,
        "envVars": {"GH_TOKEN": placeholder},
        "network": {
            "allowOut": ["*.upstream.test"],
            "rules": {
                "API.upstream.test": [
                    {"transform": {"headers": {"Authorization": format!("Bearer {placeholder}")}}},
                    {"transform": {"headers": {"X-Plain": "plain-value"}}},
                ],
                "*.upstream.test": [{"transform": {"headers": {"X-Wild": "wild-value"}}}],
            },
        },
    });
    let (s, v) = e.call(Method::POST, "/v2/sandboxes", Some(create)).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let id = v["sandboxID"].as_str().unwrap().to_string();

    // The sandbox sends a header of its own; the rule replaces it with the value.
    let (body, tail) = curl(
        &c,
        &id,
        "-H 'Authorization: Bearer from-the-sandbox' https://api.upstream.test/repos/x",
    )
    .await;
    assert_eq!(tail, "200 0", "{body}");
    assert_eq!(
        last_header(&up, "api.upstream.test", "authorization").as_deref(),
        Some(format!("Bearer {VALUE}").as_str())
    );
    assert_eq!(
        last_header(&up, "api.upstream.test", "x-plain").as_deref(),
        Some("plain-value")
    );
    // The exact host's rules win; the wildcard's are not merged in.
    assert_eq!(last_header(&up, "api.upstream.test", "x-wild"), None);
    let (body, tail) = curl(&c, &id, "https://wild.upstream.test/").await;
    assert_eq!(tail, "200 0", "{body}");
    assert_eq!(
        last_header(&up, "wild.upstream.test", "x-wild").as_deref(),
        Some("wild-value")
    );
    assert_eq!(
        last_header(&up, "wild.upstream.test", "authorization"),
        None
    );
    // Plain HTTP: headers without a secret go in, a secret never goes in clear text.
    let before = up.requests().len();
    let (body, tail) = curl(&c, &id, "http://wild.upstream.test/plain").await;
    assert_eq!(tail, "200 0", "{body}");
    assert_eq!(
        last_header(&up, "wild.upstream.test", "x-wild").as_deref(),
        Some("wild-value")
    );
    let (body, tail) = curl(&c, &id, "http://api.upstream.test/plain").await;
    assert_eq!(tail, "403 0", "{body}");
    let refusal: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(refusal["reason"], "scheme", "{refusal}");
    assert_eq!(up.requests().len(), before + 1);

    // The sandbox holds only the placeholder: its environment, its processes, its files.
    let env = sh(&c, &id, "echo \"$GH_TOKEN\"").await;
    assert_eq!(env.stdout, format!("{placeholder}\n"));
    // The search finds the placeholder (so it can fail) and not the value.
    let found = search(&c, &id, placeholder).await;
    assert_ne!(
        found.lines().next(),
        Some("0"),
        "the search does not find what is there"
    );
    assert_eq!(
        search(&c, &id, VALUE).await,
        "0\n",
        "the value is inside the sandbox"
    );

    // A new version goes out on the next request.
    let (s, v) = e
        .call(Method::POST, "/secrets/gh", Some(json!({"value": VALUE2})))
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (_, tail) = curl(&c, &id, "https://api.upstream.test/again").await;
    assert_eq!(tail, "200 0");
    assert_eq!(
        last_header(&up, "api.upstream.test", "authorization").as_deref(),
        Some(format!("Bearer {VALUE2}").as_str())
    );
    // A fork keeps the rules.
    let (s, forks) = e
        .call(
            Method::POST,
            &format!("/sandboxes/{id}/fork"),
            Some(json!({"count": 1})),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{forks}");
    let fork = forks[0]["sandbox"]["sandboxID"]
        .as_str()
        .expect("a fork")
        .to_string();
    let (body, tail) = curl(&c, &fork, "https://api.upstream.test/from-fork").await;
    assert_eq!(tail, "200 0", "{body}");
    assert_eq!(
        last_header(&up, "api.upstream.test", "authorization").as_deref(),
        Some(format!("Bearer {VALUE2}").as_str())
    );
    c.delete_sandbox(&fork).await.unwrap();
    // Sandbox info shows the rules with their placeholders, never a value.
    let (_, text, _) = e.raw(Method::GET, &format!("/sandboxes/{id}"), None).await;
    assert!(!text.contains(VALUE) && !text.contains(VALUE2), "{text}");
    let info: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        info["network"]["rules"]["api.upstream.test"][0]["transform"]["headers"]["Authorization"],
        format!("Bearer {placeholder}"),
        "{info}"
    );

    // A deleted secret: the request is refused, and never reaches the upstream.
    let before = up.requests().len();
    let (s, _) = e.call(Method::DELETE, "/secrets/gh", None).await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let (body, tail) = curl(&c, &id, "https://api.upstream.test/gone").await;
    assert_eq!(tail, "403 0", "{body}");
    let refusal: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(refusal["code"], "credential_refused", "{refusal}");
    assert_eq!(refusal["secret"], "gh", "{refusal}");
    assert_eq!(up.requests().len(), before);

    // An update without rules clears them: the host is no longer intercepted.
    let (s, v) = e
        .call(
            Method::PUT,
            &format!("/sandboxes/{id}/network"),
            Some(json!({"allowOut": ["*.upstream.test"], "allow_internet_access": false})),
        )
        .await;
    assert_eq!(s, StatusCode::NO_CONTENT, "{v}");
    let ca_pem = std::fs::read_to_string(up.ca_file()).unwrap();
    sh(
        &c,
        &id,
        &format!("cat > /tmp/up-ca.pem <<'EOF'\n{ca_pem}EOF"),
    )
    .await;
    let (body, tail) = curl(
        &c,
        &id,
        "--cacert /tmp/up-ca.pem https://api.upstream.test/plain",
    )
    .await;
    assert_eq!(tail, "200 0", "{body}");
    assert_eq!(last_header(&up, "api.upstream.test", "x-plain"), None);
    assert_eq!(last_header(&up, "api.upstream.test", "authorization"), None);

    c.delete_sandbox(&id).await.unwrap();
    d.shutdown().await;
    let logged = std::fs::read_to_string(&log).unwrap();
    assert!(
        logged.contains("credential broker injected credentials"),
        "the log is not the broker's"
    );
    for v in [VALUE, VALUE2] {
        assert!(!logged.contains(v), "the daemon logged a secret value");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mask_request_host_is_the_host_a_sandbox_port_sees() {
    let d = Daemon::start().await;
    let e = E2b::new(&d, &d.key);
    let c = d.client();
    for bad in [
        "a b.example.com",
        "h.example.com:${PORT}x",
        "h.example.com:99999",
        "h\r\nX-Evil: 1",
    ] {
        let (s, v) = e
            .call(
                Method::POST,
                "/v2/sandboxes",
                Some(json!({"templateID": "base", "network": {"maskRequestHost": bad}})),
            )
            .await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{bad:?}: {v}");
    }
    assert!(sandpit_tests::sandboxes(&c).await.is_empty());
    let (s, v) = e
        .call(
            Method::POST,
            "/v2/sandboxes",
            Some(json!({"templateID": "base", "network": {
                "allowPublicTraffic": true,
                "maskRequestHost": "custom-host.example.com:${PORT}",
            }})),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let id = v["sandboxID"].as_str().unwrap().to_string();
    let server = r#"cat > /tmp/echo_host.py <<'EOF'
import http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = self.headers.get("Host", "").encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.HTTPServer(("", 8080), H).serve_forever()
EOF
nohup python3 /tmp/echo_host.py >/dev/null 2>&1 &"#;
    sh(&c, &id, server).await;
    sandpit_tests::wait_listening(&c, &id, 8080).await;
    let seen = || async {
        let resp = http()
            .get(format!("{}/", d.url))
            .header("E2b-Sandbox-Id", &id)
            .header("E2b-Sandbox-Port", "8080")
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        resp.text().await.unwrap()
    };
    assert_eq!(seen().await, "custom-host.example.com:8080");
    // A network update that does not name it keeps it.
    let (s, v) = e
        .call(
            Method::PUT,
            &format!("/sandboxes/{id}/network"),
            Some(json!({"denyOut": ["203.0.113.9"]})),
        )
        .await;
    assert_eq!(s, StatusCode::NO_CONTENT, "{v}");
    assert_eq!(seen().await, "custom-host.example.com:8080");
    let (_, info) = e.call(Method::GET, &format!("/sandboxes/{id}"), None).await;
    assert_eq!(
        info["network"]["maskRequestHost"], "custom-host.example.com:${PORT}",
        "{info}"
    );
    c.delete_sandbox(&id).await.unwrap();
    d.shutdown().await;
}
