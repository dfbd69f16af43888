//! E2B's REST control plane on the daemon: shapes, statuses and error bodies that E2B's
//! SDKs rely on, checked at the HTTP level (the SDK scenarios are in `e2b_sdk.rs`).

use reqwest::StatusCode;
use sandpit_tests::{Daemon, command};
use serde_json::{Value, json};

struct E2b {
    http: reqwest::Client,
    url: String,
    key: String,
}

impl E2b {
    fn new(d: &Daemon) -> Self {
        Self {
            http: sandpit_tests::http(),
            url: d.url.clone(),
            key: d.key.clone(),
        }
    }

    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> (StatusCode, Value, reqwest::header::HeaderMap) {
        let mut req = self
            .http
            .request(method, format!("{}{path}", self.url))
            .header("X-API-Key", &self.key);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req.send().await.expect("request");
        let status = resp.status();
        let headers = resp.headers().clone();
        let text = resp.text().await.expect("body");
        let value = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON: {text}"))
        };
        (status, value, headers)
    }

    async fn create(&self, body: Value) -> Value {
        let (s, v, _) = self
            .call(reqwest::Method::POST, "/v2/sandboxes", Some(body))
            .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        v
    }

    /// Creates a sandbox and returns its id.
    async fn create_id(&self, body: Value) -> String {
        self.create(body).await["sandboxID"]
            .as_str()
            .expect("sandboxID")
            .to_string()
    }
}

fn assert_e2b_error(v: &Value, status: StatusCode) {
    assert_eq!(v["code"], json!(status.as_u16()), "{v}");
    assert!(v["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
}

#[tokio::test(flavor = "multi_thread")]
async fn create_answers_in_e2b_shape_and_maps_base_to_the_host_template() {
    let d = Daemon::start().await;
    let e = E2b::new(&d);
    let v = e
        .create(json!({"templateID": "base", "timeout": 120, "metadata": {"k": "v"}, "envVars": {"A": "1"}}))
        .await;
    let id = v["sandboxID"].as_str().expect("sandboxID").to_string();
    assert_eq!(v["templateID"], "host");
    assert_eq!(v["envdVersion"], sandpit_server::api::e2b::ENVD_VERSION);
    assert_eq!(v["clientID"], "sandpit");
    assert!(v["domain"].as_str().is_some_and(|d| !d.is_empty()));

    let (s, detail, _) = e
        .call(reqwest::Method::GET, &format!("/sandboxes/{id}"), None)
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(detail["state"], "running");
    assert_eq!(detail["metadata"], json!({"k": "v"}));
    assert_eq!(detail["lifecycle"]["onTimeout"], "kill");
    let started = detail["startedAt"].as_str().expect("startedAt");
    let ends = detail["endAt"].as_str().expect("endAt");
    assert!(started < ends, "{started} {ends}");
    assert_eq!(detail["memoryMB"], json!(512));

    // The older create path answers the same way.
    let (s, v1, _) = e
        .call(
            reqwest::Method::POST,
            "/sandboxes",
            Some(json!({"templateID": "base"})),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v1}");
    for sid in [id, v1["sandboxID"].as_str().expect("id").to_string()] {
        let (s, _, _) = e
            .call(reqwest::Method::DELETE, &format!("/sandboxes/{sid}"), None)
            .await;
        assert_eq!(s, StatusCode::NO_CONTENT);
    }
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn errors_use_e2b_bodies_and_statuses() {
    let d = Daemon::start().await;
    let e = E2b::new(&d);
    // No key, and a wrong key.
    let resp = e
        .http
        .get(format!("{}/v2/sandboxes", d.url))
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
    assert_e2b_error(&resp.json().await.expect("json"), StatusCode::UNAUTHORIZED);
    let resp = e
        .http
        .get(format!("{}/v2/sandboxes", d.url))
        .header("X-API-Key", "sp_wrong")
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);

    let (s, v, _) = e
        .call(reqwest::Method::GET, "/sandboxes/nosuchsandbox", None)
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_e2b_error(&v, StatusCode::NOT_FOUND);
    let (s, v, _) = e
        .call(reqwest::Method::DELETE, "/sandboxes/nosuchsandbox", None)
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_e2b_error(&v, StatusCode::NOT_FOUND);

    for (body, why) in [
        (
            json!({"templateID": "no-such-template"}),
            "unknown template",
        ),
        (json!({"templateID": "base", "timeout": 0}), "zero timeout"),
        (
            json!({"templateID": "base", "timeout": 99999999}),
            "timeout over the maximum",
        ),
        (
            json!({"templateID": "base", "envVars": {"BAD=NAME": "x"}}),
            "bad env name",
        ),
        (
            json!({"templateID": "base", "mcp": "x"}),
            "mcp not an object",
        ),
        (json!({"templateID": ""}), "empty template"),
        (json!({"timeout": 10}), "no template"),
        (
            json!({"templateID": "base", "timeout": "soon"}),
            "wrong type",
        ),
    ] {
        let (s, v, _) = e
            .call(reqwest::Method::POST, "/v2/sandboxes", Some(body))
            .await;
        assert!(s.is_client_error(), "{why}: {s} {v}");
        assert_e2b_error(&v, s);
    }
    let resp = e
        .http
        .post(format!("{}/v2/sandboxes", d.url))
        .header("X-API-Key", &d.key)
        .body("{not json")
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    // Nothing half-made was left behind by the refused creates.
    let (_, list, _) = e.call(reqwest::Method::GET, "/v2/sandboxes", None).await;
    assert_eq!(list, json!([]));
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn pause_connect_resume_statuses() {
    let d = Daemon::start().await;
    let e = E2b::new(&d);
    let id = e.create_id(json!({"templateID": "base"})).await;
    let post = |p: &str| format!("/sandboxes/{id}/{p}");
    // Connecting to a running sandbox: 200.
    let (s, v, _) = e
        .call(
            reqwest::Method::POST,
            &post("connect"),
            Some(json!({"timeout": 60})),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["sandboxID"], json!(id));
    // Resuming a running one is a conflict.
    let (s, v, _) = e.call(reqwest::Method::POST, &post("resume"), None).await;
    assert_eq!(s, StatusCode::CONFLICT);
    assert_e2b_error(&v, StatusCode::CONFLICT);
    // Pause: 204, then 409 for the second.
    let (s, _, _) = e.call(reqwest::Method::POST, &post("pause"), None).await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let (s, v, _) = e.call(reqwest::Method::POST, &post("pause"), None).await;
    assert_eq!(s, StatusCode::CONFLICT);
    assert_e2b_error(&v, StatusCode::CONFLICT);
    let (_, detail, _) = e
        .call(reqwest::Method::GET, &format!("/sandboxes/{id}"), None)
        .await;
    assert_eq!(detail["state"], "paused");
    // The v2 connect resumes it: 201.
    let (s, v, _) = e
        .call(
            reqwest::Method::POST,
            &format!("/v2/sandboxes/{id}/connect"),
            Some(json!({"timeout": 60})),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let (_, detail, _) = e
        .call(reqwest::Method::GET, &format!("/sandboxes/{id}"), None)
        .await;
    assert_eq!(detail["state"], "running");
    // `memory: false` on connect (the SDK's `on_resume="reboot"`) starts the processes
    // again on the kept files: a process from before is gone, the files are not.
    let c = d.client();
    let sleeper = c
        .run_background(&id, &command(&["sleep", "600"]))
        .await
        .expect("background sleep");
    sandpit_tests::sh(&c, &id, "echo kept > /home/user/kept.txt").await;
    let (s, _, _) = e.call(reqwest::Method::POST, &post("pause"), None).await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let (s, v, _) = e
        .call(
            reqwest::Method::POST,
            &post("connect"),
            Some(json!({"memory": false})),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let pids: Vec<u32> = c
        .list_commands(&id)
        .await
        .expect("list")
        .iter()
        .map(|p| p.pid)
        .collect();
    assert!(
        !pids.contains(&sleeper.pid),
        "{pids:?} still has {}",
        sleeper.pid
    );
    let cat = sandpit_tests::sh(&c, &id, "cat /home/user/kept.txt").await;
    assert_eq!(cat.stdout, "kept\n");
    // Pause without memory (sandpit's hibernation) and resume through the older call.
    let (s, _, _) = e
        .call(
            reqwest::Method::POST,
            &post("pause"),
            Some(json!({"memory": false})),
        )
        .await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let (s, v, _) = e
        .call(
            reqwest::Method::POST,
            &post("resume"),
            Some(json!({"timeout": 90})),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    // Timeout and refreshes.
    let (s, _, _) = e
        .call(
            reqwest::Method::POST,
            &post("timeout"),
            Some(json!({"timeout": 30})),
        )
        .await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let (_, before, _) = e
        .call(reqwest::Method::GET, &format!("/sandboxes/{id}"), None)
        .await;
    let (s, _, _) = e
        .call(
            reqwest::Method::POST,
            &post("refreshes"),
            Some(json!({"duration": 600})),
        )
        .await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let (_, after, _) = e
        .call(reqwest::Method::GET, &format!("/sandboxes/{id}"), None)
        .await;
    assert!(
        after["endAt"].as_str() > before["endAt"].as_str(),
        "{before} {after}"
    );
    let (s, v, _) = e
        .call(reqwest::Method::POST, &post("timeout"), Some(json!({})))
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_e2b_error(&v, StatusCode::BAD_REQUEST);
    // Metrics: the history fills in as the sampler runs (every 5 s by default); its
    // samples carry the sandbox's limits.
    let mut m = json!([]);
    for _ in 0..60 {
        let (s, v, _) = e.call(reqwest::Method::GET, &post("metrics"), None).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        m = v;
        if m.as_array().is_some_and(|a| !a.is_empty()) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
    assert_eq!(m[0]["memTotal"], json!(512u64 << 20));
    assert!(m[0]["memUsed"].as_u64().is_some_and(|u| u > 0), "{m}");
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn list_filters_and_pages_with_next_token() {
    let d = Daemon::start().await;
    let e = E2b::new(&d);
    let mut ids = Vec::new();
    for i in 0..3 {
        let v = e
            .create(json!({"templateID": "base", "metadata": {"team": "blue", "n": i.to_string()}}))
            .await;
        ids.push(v["sandboxID"].as_str().expect("id").to_string());
    }
    let other = e
        .create(json!({"templateID": "base", "metadata": {"team": "red"}}))
        .await;
    // E2B encodes the metadata filter as one query value: `team=blue` url-encoded.
    let (s, page1, h) = e
        .call(
            reqwest::Method::GET,
            "/v2/sandboxes?metadata=team%3Dblue&limit=2",
            None,
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(page1.as_array().map(Vec::len), Some(2));
    let token = h
        .get("x-next-token")
        .and_then(|v| v.to_str().ok())
        .expect("X-Next-Token")
        .to_string();
    let (_, page2, h2) = e
        .call(
            reqwest::Method::GET,
            &format!("/v2/sandboxes?metadata=team%3Dblue&limit=2&nextToken={token}"),
            None,
        )
        .await;
    assert!(h2.get("x-next-token").is_none(), "{page1} {page2} {h2:?}");
    let mut seen: Vec<String> = page1
        .as_array()
        .into_iter()
        .chain(page2.as_array())
        .flatten()
        .map(|s| s["sandboxID"].as_str().expect("id").to_string())
        .collect();
    seen.sort();
    let mut want = ids.clone();
    want.sort();
    assert_eq!(seen, want);

    // State filter: pause one; `paused` lists only it, `running` the rest.
    let (s, _, _) = e
        .call(
            reqwest::Method::POST,
            &format!("/sandboxes/{}/pause", ids[0]),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let (_, paused, _) = e
        .call(reqwest::Method::GET, "/v2/sandboxes?state=paused", None)
        .await;
    assert_eq!(paused.as_array().map(Vec::len), Some(1));
    assert_eq!(paused[0]["sandboxID"], json!(ids[0]));
    assert_eq!(paused[0]["state"], "paused");
    // The older list shows running sandboxes only.
    let (_, old, _) = e.call(reqwest::Method::GET, "/sandboxes", None).await;
    let old_ids: Vec<&str> = old
        .as_array()
        .expect("array")
        .iter()
        .filter_map(|s| s["sandboxID"].as_str())
        .collect();
    assert_eq!(old_ids.len(), 3);
    assert!(!old_ids.contains(&ids[0].as_str()));
    assert!(old_ids.contains(&other["sandboxID"].as_str().expect("id")));
    let (s, v, _) = e
        .call(reqwest::Method::GET, "/v2/sandboxes?state=sleeping", None)
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_e2b_error(&v, StatusCode::BAD_REQUEST);
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn snapshots_templates_and_fork() {
    let d = Daemon::start().await;
    let e = E2b::new(&d);
    let id = e.create_id(json!({"templateID": "base"})).await;
    let (s, snap, _) = e
        .call(
            reqwest::Method::POST,
            &format!("/sandboxes/{id}/snapshots"),
            Some(json!({"name": "e2b-snap"})),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{snap}");
    assert_eq!(snap["names"], json!(["e2b-snap"]));
    let snap_id = snap["snapshotID"].as_str().expect("snapshotID").to_string();
    let (_, list, _) = e
        .call(
            reqwest::Method::GET,
            &format!("/snapshots?sandboxID={id}"),
            None,
        )
        .await;
    assert_eq!(
        list,
        json!([{"snapshotID": snap_id, "names": ["e2b-snap"]}])
    );
    // A memory snapshot is refused, not faked.
    let (s, v, _) = e
        .call(
            reqwest::Method::POST,
            &format!("/sandboxes/{id}/snapshots"),
            Some(json!({"memory": true})),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_e2b_error(&v, StatusCode::BAD_REQUEST);
    // A sandbox starts from the snapshot by its id, and by its name.
    for t in [snap_id.as_str(), "e2b-snap"] {
        let v = e.create(json!({"templateID": t})).await;
        assert_eq!(v["templateID"], "host");
    }
    // Fork: two copies, each a sandbox in E2B's shape.
    let (s, forks, _) = e
        .call(
            reqwest::Method::POST,
            &format!("/sandboxes/{id}/fork"),
            Some(json!({"count": 2})),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{forks}");
    let forks = forks.as_array().expect("array");
    assert_eq!(forks.len(), 2);
    assert!(
        forks
            .iter()
            .all(|f| f["sandbox"]["sandboxID"].as_str().is_some_and(|s| s != id))
    );
    // Templates: the host template with its E2B aliases.
    let (_, templates, _) = e.call(reqwest::Method::GET, "/templates", None).await;
    let host = templates
        .as_array()
        .expect("array")
        .iter()
        .find(|t| t["templateID"] == "host")
        .expect("host template")
        .clone();
    let aliases = host["aliases"].as_array().expect("aliases");
    assert!(aliases.contains(&json!("base")), "{host}");
    let (s, base, _) = e.call(reqwest::Method::GET, "/templates/base", None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(base["templateID"], "host");
    assert_eq!(base["builds"][0]["status"], "ready");
    // E2B deletes snapshots through the template route.
    let (s, _, _) = e
        .call(
            reqwest::Method::DELETE,
            &format!("/templates/{snap_id}"),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let (_, list, _) = e
        .call(
            reqwest::Method::GET,
            &format!("/snapshots?sandboxID={id}"),
            None,
        )
        .await;
    assert_eq!(list, json!([]));
    let (s, v, _) = e
        .call(reqwest::Method::DELETE, "/templates/base", None)
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_e2b_error(&v, StatusCode::BAD_REQUEST);
    d.shutdown().await;
}

/// Reads one HTTP/1.1 response (head and a Content-Length body) from `s`; `None` at EOF.
async fn read_response(s: &mut tokio::net::UnixStream) -> Option<String> {
    use tokio::io::AsyncReadExt;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_string();
            let len: usize = head
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse().ok())?
                })
                .unwrap_or(0);
            while buf.len() < end + 4 + len {
                let n = s.read(&mut chunk).await.ok()?;
                if n == 0 {
                    return None;
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            return Some(head);
        }
        let n = s.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_multipart_upload_is_answered_after_its_last_bytes() {
    // The agent's multipart reader stops at the closing boundary. It once answered there
    // and closed the connection while the client still had the body's final CRLF to write
    // (E2B's JS SDK sends it apart): the daemon then saw a broken pipe and answered 502.
    // Now the agent reads the body to its end first, and the connection stays usable.
    use tokio::io::AsyncWriteExt;
    let d = Daemon::start().await;
    let e = E2b::new(&d);
    let id = e.create_id(json!({"templateID": "base"})).await;
    let socket = d.data.path().join("sandboxes").join(&id).join("agent.sock");
    let mut s = tokio::net::UnixStream::connect(&socket)
        .await
        .expect("agent socket");
    let body = "--b0undary\r\nContent-Disposition: form-data; name=\"file\"; filename=\"f\"\r\n\
                Content-Type: application/octet-stream\r\n\r\nuploaded\r\n--b0undary--\r\n";
    let head = format!(
        "POST /files?path=/home/user/up.txt HTTP/1.1\r\nHost: agent\r\n\
         Content-Type: multipart/form-data; boundary=b0undary\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.expect("head");
    s.write_all(&body.as_bytes()[..body.len() - 2])
        .await
        .expect("body");
    // Give the agent time to reach the closing boundary before the last two bytes.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    s.write_all(b"\r\n")
        .await
        .expect("the connection is still open for the last bytes");
    let first = read_response(&mut s)
        .await
        .expect("an answer to the upload");
    assert!(first.starts_with("HTTP/1.1 200"), "{first}");
    // The same connection serves the next request: nothing of the body was left unread.
    s.write_all(b"GET /health HTTP/1.1\r\nHost: agent\r\n\r\n")
        .await
        .expect("second request");
    let second = read_response(&mut s)
        .await
        .expect("the connection was closed after the upload");
    assert!(second.starts_with("HTTP/1.1 2"), "{second}");
    let out = sandpit_tests::sh(&d.client(), &id, "cat /home/user/up.txt").await;
    assert_eq!(out.stdout, "uploaded");
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn e2b_network_settings_become_egress_policies() {
    /// The sandbox's egress policy as sandpit's own API shows it.
    async fn policy(d: &Daemon, id: String) -> Value {
        sandpit_tests::http()
            .get(format!("{}/v1/sandboxes/{id}/network", d.url))
            .bearer_auth(&d.key)
            .send()
            .await
            .expect("send")
            .json()
            .await
            .expect("json")
    }
    let d = Daemon::start().await;
    let e = E2b::new(&d);
    // E2B's default: internet access (sandpit's `open`, private ranges still blocked).
    let open = e.create_id(json!({"templateID": "base"})).await;
    assert_eq!(policy(&d, open.clone()).await["mode"], "open");
    let (_, detail, _) = e
        .call(reqwest::Method::GET, &format!("/sandboxes/{open}"), None)
        .await;
    assert_eq!(detail["allowInternetAccess"], json!(true));
    // No internet at all.
    let none = e
        .create_id(json!({"templateID": "base", "allow_internet_access": false}))
        .await;
    assert_eq!(
        policy(&d, none.clone()).await,
        json!({"mode": "none", "rules": []})
    );
    let (_, detail, _) = e
        .call(reqwest::Method::GET, &format!("/sandboxes/{none}"), None)
        .await;
    assert_eq!(detail["allowInternetAccess"], json!(false));
    // An allowlist.
    let list = e
        .create_id(json!({"templateID": "base", "network": {
            "allowOut": ["api.example.com", "203.0.113.7"], "denyOut": ["0.0.0.0/0"]}}))
        .await;
    let p = policy(&d, list.clone()).await;
    assert_eq!(p["mode"], "allowlist", "{p}");
    assert_eq!(p["rules"][0]["domain"], "api.example.com");
    assert_eq!(p["rules"][1]["cidr"], "203.0.113.7/32");
    // A live change through E2B's route.
    let (s, v, _) = e
        .call(
            reqwest::Method::PUT,
            &format!("/sandboxes/{open}/network"),
            Some(json!({"denyOut": ["evil.example.com"]})),
        )
        .await;
    assert_eq!(s, StatusCode::NO_CONTENT, "{v}");
    let p = policy(&d, open.clone()).await;
    assert_eq!(p["mode"], "open");
    assert_eq!(p["rules"][0]["action"], "deny");
    assert_eq!(p["rules"][0]["domain"], "evil.example.com");
    // What sandpit cannot honour, or cannot read, is refused, not ignored.
    for body in [
        json!({"templateID": "base", "network": {"dnsServers": ["1.1.1.1"]}}),
        json!({"templateID": "base", "network": {"maskRequestHost": "not a host"}}),
        json!({"templateID": "base", "network": {"rules": {"api.x": {}}}}),
        json!({"templateID": "base", "network": {"allowOut": ["not a cidr/99"]}}),
    ] {
        let (s, v, _) = e
            .call(reqwest::Method::POST, "/v2/sandboxes", Some(body))
            .await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
        assert_e2b_error(&v, StatusCode::BAD_REQUEST);
    }
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn auto_pause_memory_false_makes_the_timeout_a_files_only_pause() {
    let d = Daemon::start().await;
    let e = E2b::new(&d);
    let c = d.client();
    let body = json!({
        "templateID": "base", "timeout": 5, "autoPause": true, "autoPauseMemory": false
    });
    let files_only = e.create_id(body).await;
    let with_memory = e
        .create_id(json!({"templateID": "base", "timeout": 5, "autoPause": true}))
        .await;
    for id in [&files_only, &with_memory] {
        sandpit_tests::sh(&c, id, "echo kept > /home/user/kept.txt").await;
    }
    let settled = |s: &str| matches!(s, "paused" | "hibernated");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let a = c.get_sandbox(&files_only).await.expect("get").state;
        let b = c.get_sandbox(&with_memory).await.expect("get").state;
        if settled(&a) && settled(&b) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "not paused by the timeout: {a} {b}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    }
    let v1 = c.get_sandbox(&files_only).await.expect("get");
    assert_eq!(
        v1.state, "hibernated",
        "autoPauseMemory: false keeps only files"
    );
    assert_eq!(v1.lifecycle.on_timeout, "hibernate");
    let v1 = c.get_sandbox(&with_memory).await.expect("get");
    assert_eq!(v1.state, "paused", "the default keeps the memory");
    assert_eq!(v1.lifecycle.on_timeout, "pause");
    // E2B has one word for both: paused, with a lifecycle that pauses on timeout.
    for id in [&files_only, &with_memory] {
        let (s, v, _) = e
            .call(reqwest::Method::GET, &format!("/sandboxes/{id}"), None)
            .await;
        assert_eq!(s, StatusCode::OK, "{v}");
        assert_eq!(v["state"], "paused", "{v}");
        assert_eq!(v["lifecycle"]["onTimeout"], "pause", "{v}");
    }
    // The files survive the files-only pause.
    let (s, v, _) = e
        .call(
            reqwest::Method::POST,
            &format!("/sandboxes/{files_only}/connect"),
            Some(json!({"timeout": 60})),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(
        c.read_file(&files_only, "/home/user/kept.txt")
            .await
            .expect("read")
            .as_ref(),
        b"kept\n"
    );
    d.shutdown().await;
}

/// E2B's `files.write` below a directory only root may write, as the default user: envd
/// creates the missing directories (as root, then gives them to the user) and writes the
/// file as the user. (`/` itself stays closed in a `host` sandbox: Landlock keeps the
/// host's top level read-only, so `/opt` stands in for E2B's `/0`.)
/// An existing directory the user may not write stays refused, and a symlink in the way
/// is never followed to create anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_creates_missing_parents_for_the_user_and_nothing_else() {
    let d = Daemon::start().await;
    let e = E2b::new(&d);
    let created = e.create(json!({"templateID": "base"})).await;
    let id = created["sandboxID"].as_str().unwrap().to_string();
    let token = created["envdAccessToken"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let c = d.client();
    let upload = |path: &str, body: &'static str| {
        let url = reqwest::Url::parse_with_params(
            &format!("{}/files", d.url),
            &[("path", path), ("username", "user")],
        )
        .unwrap();
        e.http
            .post(url)
            .header("e2b-sandbox-id", &id)
            .header("e2b-sandbox-port", "49983")
            .header("x-access-token", &token)
            .body(body)
            .send()
    };
    let r = upload("/opt/made/a/x.txt", "hello").await.unwrap();
    let status = r.status();
    let v: Value = r.json().await.unwrap();
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v[0]["path"], "/opt/made/a/x.txt", "{v}");
    // Owned by the user the commands run as (the default user), not by root.
    let out = sandpit_tests::sh(
        &c,
        &id,
        "id -u; stat -c '%u %n' /opt /opt/made /opt/made/a /opt/made/a/x.txt; cat /opt/made/a/x.txt",
    )
    .await;
    let uid = out.stdout.lines().next().unwrap_or_default().to_string();
    assert_ne!(uid, "0", "{}", out.stdout);
    assert_eq!(
        out.stdout,
        format!(
            "{uid}\n0 /opt\n{uid} /opt/made\n{uid} /opt/made/a\n{uid} /opt/made/a/x.txt\nhello"
        ),
        "{}",
        out.stderr
    );
    // An existing directory the user cannot write: refused, nothing written.
    let r = upload("/etc/x.txt", "no").await.unwrap();
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
    // A dangling symlink in the way: refused, and nothing created where it points.
    let out = sandpit_tests::sh(&c, &id, "ln -s /made-by-link /home/user/dangling").await;
    assert_eq!(out.exit_code, 0, "{}", out.stderr);
    let r = upload("/home/user/dangling/new/x.txt", "no").await.unwrap();
    assert!(r.status().is_client_error(), "{}", r.status());
    let out = sandpit_tests::sh_root(
        &c,
        &id,
        "test -e /etc/x.txt && echo etc; test -e /made-by-link && echo link; true",
    )
    .await;
    assert_eq!(out.stdout, "", "{}", out.stderr);
    d.shutdown().await;
}
