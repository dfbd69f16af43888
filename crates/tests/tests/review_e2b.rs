//! E2B control-plane requests with bad input that once changed a sandbox before they were
//! refused: a connect or resume with a timeout beyond the daemon's maximum woke the paused
//! sandbox and then answered 400.

use reqwest::{Method, StatusCode};
use sandpit_tests::Daemon;
use serde_json::{Value, json};

async fn call(d: &Daemon, method: Method, path: &str, body: Option<Value>) -> (StatusCode, Value) {
    let mut req = reqwest::Client::new()
        .request(method, format!("{}{path}", d.url))
        .header("X-API-Key", d.key.trim());
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
