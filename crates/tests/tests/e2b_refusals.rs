//! E2B control-plane requests with bad input that once changed a sandbox before they were
//! refused (a connect or resume with a timeout beyond the daemon's maximum woke the paused
//! sandbox and then answered 400), and every E2B route tried with another owner's key.

use reqwest::{Method, StatusCode};
use sandpit_tests::Daemon;
use serde_json::{Value, json};

async fn call(d: &Daemon, method: Method, path: &str, body: Option<Value>) -> (StatusCode, Value) {
    call_as(d, d.key.trim(), method, path, body).await
}

async fn call_as(
    d: &Daemon,
    key: &str,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> (StatusCode, Value) {
    let mut req = sandpit_tests::http()
        .request(method, format!("{}{path}", d.url))
        .header("X-API-Key", key);
    if let Some(b) = body {
        req = req.json(&b);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status();
    let text = resp.text().await.unwrap();
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_refused_connect_or_resume_leaves_the_sandbox_paused() {
    let d = Daemon::start().await;
    let (s, v) = call(
        &d,
        Method::POST,
        "/v2/sandboxes",
        Some(json!({"templateID": "base"})),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let id = v["sandboxID"].as_str().unwrap().to_string();
    let (s, _) = call(&d, Method::POST, &format!("/sandboxes/{id}/pause"), None).await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    for path in [
        format!("/sandboxes/{id}/connect"),
        format!("/v2/sandboxes/{id}/connect"),
        format!("/sandboxes/{id}/resume"),
    ] {
        let (s, v) = call(
            &d,
            Method::POST,
            &path,
            Some(json!({"timeout": 999_999_999})),
        )
        .await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{path}: {v}");
        let (_, detail) = call(&d, Method::GET, &format!("/sandboxes/{id}"), None).await;
        assert_eq!(detail["state"], "paused", "{path} woke it: {detail}");
    }
    // A valid one still resumes it.
    let (s, v) = call(
        &d,
        Method::POST,
        &format!("/sandboxes/{id}/connect"),
        Some(json!({"timeout": 120})),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn another_owner_reaches_nothing_through_e2b_routes() {
    let d = Daemon::start().await;
    let mallory = d.owner_key("mallory").await;
    let (s, v) = call(
        &d,
        Method::POST,
        "/v2/sandboxes",
        Some(json!({"templateID": "base", "metadata": {"team": "a"}})),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let id = v["sandboxID"].as_str().unwrap().to_string();
    let envd = v["envdAccessToken"].as_str().unwrap().to_string();
    let (s, v) = call(
        &d,
        Method::POST,
        &format!("/sandboxes/{id}/snapshots"),
        Some(json!({"name": "owned"})),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let snap = v["snapshotID"].as_str().unwrap().to_string();

    for (method, path, body) in [
        (Method::GET, format!("/sandboxes/{id}"), None),
        (Method::GET, format!("/sandboxes/{id}/metrics"), None),
        (
            Method::POST,
            format!("/sandboxes/{id}/timeout"),
            Some(json!({"timeout": 1})),
        ),
        (Method::POST, format!("/sandboxes/{id}/refreshes"), None),
        (Method::POST, format!("/sandboxes/{id}/pause"), None),
        (Method::POST, format!("/sandboxes/{id}/resume"), None),
        (Method::POST, format!("/sandboxes/{id}/connect"), None),
        (Method::POST, format!("/v2/sandboxes/{id}/connect"), None),
        (Method::POST, format!("/sandboxes/{id}/fork"), None),
        (Method::POST, format!("/sandboxes/{id}/snapshots"), None),
        (Method::DELETE, format!("/sandboxes/{id}"), None),
        (Method::DELETE, format!("/templates/{snap}"), None),
        (Method::DELETE, "/templates/owned".to_string(), None),
    ] {
        let (s, v) = call_as(&d, &mallory, method.clone(), &path, body).await;
        assert!(
            s == StatusCode::NOT_FOUND || s == StatusCode::FORBIDDEN,
            "{method} {path}: {s} {v}"
        );
        assert!(
            !v.to_string().contains(&envd),
            "{method} {path} leaked: {v}"
        );
    }
    // Starting from another owner's snapshot, by id or by name, is no way in either.
    for template in [snap.as_str(), "owned"] {
        let (s, v) = call_as(
            &d,
            &mallory,
            Method::POST,
            "/sandboxes",
            Some(json!({"templateID": template})),
        )
        .await;
        // As unknown as a template that does not exist: nothing says it does.
        assert_eq!(s, StatusCode::NOT_FOUND, "{template}: {v}");
    }
    // Lists show none of it.
    for path in [
        "/sandboxes".to_string(),
        "/v2/sandboxes".to_string(),
        "/v2/sandboxes?metadata=team%3Da".to_string(),
        format!("/snapshots?sandboxID={id}"),
        "/snapshots?name=owned".to_string(),
    ] {
        let (s, v) = call_as(&d, &mallory, Method::GET, &path, None).await;
        assert_eq!(s, StatusCode::OK, "{path}: {v}");
        assert_eq!(v, json!([]), "{path}");
    }
    // And everything is still there, untouched.
    let (_, detail) = call(&d, Method::GET, &format!("/sandboxes/{id}"), None).await;
    assert_eq!(detail["state"], "running", "{detail}");
    let (_, snaps) = call(&d, Method::GET, "/snapshots?name=owned", None).await;
    assert_eq!(snaps[0]["snapshotID"], json!(snap), "{snaps}");
    d.shutdown().await;
}

/// E2B's SDK check, `^e2b_[0-9a-f]+$`, without a regex crate.
fn e2b_sdk_accepts(key: &str) -> bool {
    key.strip_prefix("e2b_").is_some_and(|rest| {
        !rest.is_empty()
            && rest
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn issued_keys_have_an_e2b_form_that_authenticates_the_same_owner() {
    let d = Daemon::start().await;
    let (ok, out, err) = d.cli(&["--json", "keys", "create", "--owner", "erin"]);
    assert!(ok, "{err}");
    let created: Value = serde_json::from_str(&out).unwrap();
    let e2b = created["e2b_key"].as_str().unwrap().to_string();
    assert!(e2b_sdk_accepts(&e2b), "{e2b}");
    assert!(!e2b_sdk_accepts(created["key"].as_str().unwrap()));
    // The admin key written at first start has one too.
    let admin = sandpit_store::e2b_key_form(d.key.trim()).unwrap();
    assert!(e2b_sdk_accepts(&admin), "{admin}");

    // Erin's E2B form is Erin: her sandbox is hers, not the admin's.
    let (s, v) = call_as(
        &d,
        &e2b,
        Method::POST,
        "/v2/sandboxes",
        Some(json!({"templateID": "base"})),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let id = v["sandboxID"].as_str().unwrap().to_string();
    let (s, v) = call_as(&d, &e2b, Method::GET, "/v2/sandboxes", None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert!(
        v.as_array().unwrap().iter().any(|x| x["sandboxID"] == id),
        "{v}"
    );
    let (s, v) = call_as(&d, &admin, Method::GET, "/v2/sandboxes", None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert!(
        !v.as_array().unwrap().iter().any(|x| x["sandboxID"] == id),
        "{v}"
    );
    // A key of the right shape that was never issued is refused.
    let forged = format!("e2b_{}", "0".repeat(40));
    let (s, _) = call_as(&d, &forged, Method::GET, "/v2/sandboxes", None).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    // Revoking the key revokes its E2B form.
    let (ok, _, err) = d.cli(&["keys", "revoke", created["id"].as_str().unwrap()]);
    assert!(ok, "{err}");
    tokio::time::sleep(sandpit_server::api::KEY_CACHE_TTL).await;
    let (s, _) = call_as(&d, &e2b, Method::DELETE, &format!("/sandboxes/{id}"), None).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, _) = call(&d, Method::DELETE, &format!("/sandboxes/{id}"), None).await;
    assert!(s.is_success() || s == StatusCode::NOT_FOUND, "{s}");
    d.shutdown().await;
}
