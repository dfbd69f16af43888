//! E2B's `/volumes` API and `volumeMounts` at create on sandpit's volumes, against a real
//! daemon: shapes and statuses as E2B's SDK parses them, owners kept apart, mount paths
//! checked before anything is made, and data kept across sandboxes (the volume-content
//! API is tried by `e2b_volume_content.rs`).

use reqwest::{Method, StatusCode};
use sandpit_tests::{Daemon, http, sh};
use serde_json::{Value, json};

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

    async fn call(&self, method: Method, path: &str, body: Option<Value>) -> (StatusCode, Value) {
        let mut req = http()
            .request(method, format!("{}{path}", self.url))
            .header("X-API-Key", &self.key);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req.send().await.expect("request");
        let status = resp.status();
        let text = resp.text().await.expect("body");
        let v = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON: {text}"))
        };
        (status, v)
    }
}

fn assert_error(v: &Value, status: StatusCode) {
    assert_eq!(v["code"], json!(status.as_u16()), "{v}");
    assert!(v["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_volumes_api_answers_in_e2b_shape_and_keeps_owners_apart() {
    let d = Daemon::start().await;
    let e = E2b::new(&d, &d.key);
    let (s, v) = e
        .call(Method::POST, "/volumes", Some(json!({"name": "data"})))
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let id = v["volumeID"].as_str().unwrap().to_string();
    assert_eq!(v["name"], "data");
    assert!(v["token"].is_string(), "{v}");
    let (s, v) = e.call(Method::GET, "/volumes", None).await;
    assert_eq!(
        (s, v),
        (StatusCode::OK, json!([{"volumeID": id, "name": "data"}]))
    );
    for sel in [id.as_str(), "data"] {
        let (s, v) = e.call(Method::GET, &format!("/volumes/{sel}"), None).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        assert_eq!(
            (v["volumeID"].as_str(), v["name"].as_str()),
            (Some(id.as_str()), Some("data"))
        );
    }
    // The native API sees the same volume.
    let native = d.client().get_volume("data").await.unwrap();
    assert_eq!(native.size_bytes, 1 << 30);

    for bad in [
        json!({"name": "Bad Name"}),
        json!({"name": ""}),
        json!({"name": "x".repeat(64)}),
        json!({"name": "../x"}),
        json!({}),
    ] {
        let (s, v) = e.call(Method::POST, "/volumes", Some(bad.clone())).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{bad}: {v}");
        assert_error(&v, StatusCode::BAD_REQUEST);
    }
    let (s, v) = e
        .call(Method::POST, "/volumes", Some(json!({"name": "data"})))
        .await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");

    // Another owner: not found by id or name, not listed, not mountable.
    let bob_key = d.owner_key("bob").await;
    let bob = E2b::new(&d, &bob_key);
    for sel in [id.as_str(), "data"] {
        for m in [Method::GET, Method::DELETE] {
            let (s, v) = bob.call(m.clone(), &format!("/volumes/{sel}"), None).await;
            assert_eq!(s, StatusCode::NOT_FOUND, "{m} {sel}: {v}");
            assert_error(&v, StatusCode::NOT_FOUND);
        }
    }
    let (_, v) = bob.call(Method::GET, "/volumes", None).await;
    assert_eq!(v, json!([]));
    let (s, v) = bob
        .call(
            Method::POST,
            "/v2/sandboxes",
            Some(json!({"templateID": "base", "volumeMounts": [{"name": "data", "path": "/mnt/data"}]})),
        )
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    assert!(
        sandpit_tests::sandboxes(&d.owner("bob").await)
            .await
            .is_empty()
    );

    let (s, _) = e
        .call(Method::DELETE, &format!("/volumes/{id}"), None)
        .await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let (s, _) = e
        .call(Method::DELETE, &format!("/volumes/{id}"), None)
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volume_mounts_are_checked_and_keep_data_across_sandboxes() {
    let d = Daemon::start().await;
    let e = E2b::new(&d, &d.key);
    let c = d.client();
    let (s, v) = e
        .call(Method::POST, "/volumes", Some(json!({"name": "work"})))
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let id = v["volumeID"].as_str().unwrap().to_string();

    // Paths into the host or over what the sandbox needs: 400, and no sandbox is made.
    for path in [
        "relative/dir",
        "/mnt/../etc",
        "/mnt/./x",
        "/",
        "/proc/self",
        "/sys",
        "/dev/shm",
        "/.sandpit",
        "/usr/local/bin",
        "/etc",
        "/bin",
        "/lib",
        "/run/sandpit",
        "/home/user",
        "/tmp",
        "/mnt/a\0b",
    ] {
        let (s, v) = e
            .call(
                Method::POST,
                "/v2/sandboxes",
                Some(
                    json!({"templateID": "base", "volumeMounts": [{"name": "work", "path": path}]}),
                ),
            )
            .await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{path:?}: {v}");
        assert_error(&v, StatusCode::BAD_REQUEST);
    }
    let (s, v) = e
        .call(
            Method::POST,
            "/v2/sandboxes",
            Some(json!({"templateID": "base", "volumeMounts": [
                {"name": "work", "path": "/mnt/a"}, {"name": "work", "path": "/mnt/a/b"}]})),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    let (s, v) = e
        .call(
            Method::POST,
            "/v2/sandboxes",
            Some(json!({"templateID": "base", "volumeMounts": [{"name": "missing", "path": "/mnt/x"}]})),
        )
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    assert!(sandpit_tests::sandboxes(&c).await.is_empty());

    // Written in one sandbox, read in the next.
    let (s, v) = e
        .call(
            Method::POST,
            "/v2/sandboxes",
            Some(json!({"templateID": "base", "volumeMounts": [{"name": "work", "path": "/home/user/work"}]})),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let first = v["sandboxID"].as_str().unwrap().to_string();
    let w = sh(
        &c,
        &first,
        "echo kept > /home/user/work/note && cat /home/user/work/note",
    )
    .await;
    assert_eq!(w.stdout, "kept\n", "{}", w.stderr);
    let (_, info) = e
        .call(Method::GET, &format!("/sandboxes/{first}"), None)
        .await;
    assert_eq!(
        info["volumeMounts"],
        json!([{"name": "work", "path": "/home/user/work"}])
    );
    // In use: not deleted.
    let (s, v) = e
        .call(Method::DELETE, &format!("/volumes/{id}"), None)
        .await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    let (s, _) = e
        .call(Method::DELETE, &format!("/sandboxes/{first}"), None)
        .await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let (s, v) = e
        .call(
            Method::POST,
            "/v2/sandboxes",
            Some(
                json!({"templateID": "base", "volumeMounts": [{"name": "work", "path": "/mnt/w"}]}),
            ),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let second = v["sandboxID"].as_str().unwrap().to_string();
    let r = sh(&c, &second, "cat /mnt/w/note").await;
    assert_eq!(r.stdout, "kept\n", "{}", r.stderr);
    c.delete_sandbox(&second).await.unwrap();
    d.shutdown().await;
}
