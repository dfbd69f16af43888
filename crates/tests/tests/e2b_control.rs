//! E2B's control plane where E2B's defaults differ from sandpit's own: the lifecycle of a
//! create that names none (kill at the timeout, no auto-resume), public ports unless
//! `allowPublicTraffic: false` (and then the traffic token is required), `timeout: 0`,
//! the order, start-time bound and pages of `GET /v2/sandboxes`, `mcp`, and a boot id of
//! the sandbox's own. The `/v1` API keeps its own defaults. SDK scenarios of the same
//! behaviours are in `tests/e2b/python/test_control_compat.py`.

use reqwest::{Method, StatusCode};
use sandpit_tests::{Daemon, http, port_host, sh, wait_listening};
use serde_json::{Value, json};
use std::time::Duration;

const PORT: u16 = 8000;
const MARKER: &str = "control-plane-marker-51c2";

struct E2b {
    url: String,
    key: String,
}

impl E2b {
    fn new(d: &Daemon) -> Self {
        Self {
            url: d.url.clone(),
            key: d.key.clone(),
        }
    }

    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> (StatusCode, Value, reqwest::header::HeaderMap) {
        let mut req = http()
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
        let (s, v, _) = self.call(Method::POST, "/v2/sandboxes", Some(body)).await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        v
    }

    async fn create_id(&self, body: Value) -> String {
        self.create(body).await["sandboxID"]
            .as_str()
            .expect("sandboxID")
            .to_string()
    }

    async fn detail(&self, id: &str) -> (StatusCode, Value) {
        let (s, v, _) = self
            .call(Method::GET, &format!("/sandboxes/{id}"), None)
            .await;
        (s, v)
    }

    async fn state(&self, id: &str) -> String {
        let (s, v) = self.detail(id).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        v["state"].as_str().expect("state").to_string()
    }

    async fn post(&self, id: &str, what: &str, body: Value) -> (StatusCode, Value) {
        let (s, v, _) = self
            .call(Method::POST, &format!("/sandboxes/{id}/{what}"), Some(body))
            .await;
        (s, v)
    }

    /// The ids of a `GET /v2/sandboxes` page and its next token.
    async fn list(&self, query: &str) -> (Vec<String>, Option<String>) {
        let (s, v, h) = self
            .call(Method::GET, &format!("/v2/sandboxes?{query}"), None)
            .await;
        assert_eq!(s, StatusCode::OK, "{query}: {v}");
        let ids = v
            .as_array()
            .expect("a list")
            .iter()
            .map(|x| x["sandboxID"].as_str().expect("id").to_string())
            .collect();
        let next = h
            .get("x-next-token")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        (ids, next)
    }
}

/// `GET /health` of the sandbox's envd through the proxy, in E2B's header form.
async fn envd_health(d: &Daemon, id: &str, envd_token: &str) -> StatusCode {
    http()
        .get(format!("{}/health", d.url))
        .header("E2b-Sandbox-Id", id)
        .header("E2b-Sandbox-Port", "49983")
        .header("X-Access-Token", envd_token)
        .timeout(Duration::from_secs(60))
        .send()
        .await
        .expect("health request")
        .status()
}

/// `GET /index.html` on the sandbox's [`PORT`], by host name or by E2B's headers, with
/// the traffic token header when given.
async fn get_port(d: &Daemon, id: &str, by_host: bool, token: Option<&str>) -> StatusCode {
    let mut r = http()
        .get(format!("{}/index.html", d.url))
        .timeout(Duration::from_secs(60));
    r = if by_host {
        r.header("host", port_host(d, PORT, id))
    } else {
        r.header("E2b-Sandbox-Id", id)
            .header("E2b-Sandbox-Port", PORT.to_string())
    };
    if let Some(t) = token {
        r = r.header("E2B-Traffic-Access-Token", t);
    }
    r.send().await.expect("port request").status()
}

/// Serves [`MARKER`] on the sandbox's loopback [`PORT`].
async fn serve_marker(d: &Daemon, id: &str) {
    let c = d.client();
    c.write_file(id, "/tmp/www/index.html", bytes::Bytes::from(MARKER))
        .await
        .expect("write the page");
    let argv = [
        "python3",
        "-m",
        "http.server",
        "8000",
        "--bind",
        "127.0.0.1",
        "--directory",
        "/tmp/www",
    ];
    c.run_background(id, &sandpit_tests::command(&argv))
        .await
        .expect("start the server");
    wait_listening(&c, id, PORT).await;
}

async fn boot_id(c: &sandpit_client::Client, id: &str) -> String {
    let r = sh(c, id, "cat /proc/sys/kernel/random/boot_id").await;
    assert_eq!(r.exit_code, 0, "{r:?}");
    r.stdout.trim().to_string()
}

async fn wait_state(e: &E2b, id: &str, want: &str) {
    for _ in 0..300 {
        if e.state(id).await == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{id} never became {want}: {}", e.state(id).await);
}

#[tokio::test(flavor = "multi_thread")]
async fn e2b_lifecycle_defaults_keep_a_paused_sandbox_paused_and_v1_keeps_its_own() {
    let d = Daemon::start().await;
    let e = E2b::new(&d);
    let plain = e.create(json!({"templateID": "base"})).await;
    let id = plain["sandboxID"].as_str().expect("id").to_string();
    let token = plain["envdAccessToken"].as_str().expect("envd token");
    let (_, v) = e.detail(&id).await;
    assert_eq!(
        v["lifecycle"],
        json!({"autoResume": false, "onTimeout": "kill"})
    );
    // Paused by hand, it stays paused when a health probe comes: 502, as for a sandbox
    // that is not running.
    let (s, v) = e.post(&id, "pause", json!({})).await;
    assert_eq!(s, StatusCode::NO_CONTENT, "{v}");
    assert_eq!(envd_health(&d, &id, token).await, StatusCode::BAD_GATEWAY);
    assert_eq!(e.state(&id).await, "paused");
    // Only connect wakes it.
    let (s, v) = e.post(&id, "connect", json!({"timeout": 60})).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(envd_health(&d, &id, token).await, StatusCode::NO_CONTENT);

    // Asked for, auto-resume wakes it on the first request.
    let woken = e
        .create(json!({"templateID": "base", "autoPause": true, "autoResume": {"enabled": true}}))
        .await;
    let wid = woken["sandboxID"].as_str().expect("id").to_string();
    let (_, v) = e.detail(&wid).await;
    assert_eq!(
        v["lifecycle"],
        json!({"autoResume": true, "onTimeout": "pause"})
    );
    e.post(&wid, "pause", json!({})).await;
    assert_eq!(e.state(&wid).await, "paused");
    let wtoken = woken["envdAccessToken"].as_str().expect("envd token");
    assert_eq!(envd_health(&d, &wid, wtoken).await, StatusCode::NO_CONTENT);
    assert_eq!(e.state(&wid).await, "running");
    // `autoResume: {enabled: false}` and `autoPause: false` are the defaults said aloud.
    let said = e
        .create_id(
            json!({"templateID": "base", "autoPause": false, "autoResume": {"enabled": false}}),
        )
        .await;
    let (_, v) = e.detail(&said).await;
    assert_eq!(
        v["lifecycle"],
        json!({"autoResume": false, "onTimeout": "kill"})
    );

    // sandpit's own API keeps its defaults: auto-resume on, ports private.
    let c = d.client();
    let native = c
        .create_sandbox(&Default::default())
        .await
        .expect("a /v1 create");
    assert!(native.lifecycle.auto_resume);
    assert!(!native.public);
    assert_eq!(native.lifecycle.on_timeout, "kill");
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn ports_are_public_by_default_and_private_ones_need_the_traffic_token() {
    let d = Daemon::start().await;
    let e = E2b::new(&d);
    let c = d.client();
    let open = e.create_id(json!({"templateID": "base"})).await;
    assert!(c.get_sandbox(&open).await.expect("view").public);
    let private = e
        .create(json!({"templateID": "base", "network": {"allowPublicTraffic": false}}))
        .await;
    let pid = private["sandboxID"].as_str().expect("id").to_string();
    let ptoken = private["trafficAccessToken"]
        .as_str()
        .expect("traffic token")
        .to_string();
    assert!(!c.get_sandbox(&pid).await.expect("view").public);
    let said_open = e
        .create_id(json!({"templateID": "base", "network": {"allowPublicTraffic": true}}))
        .await;
    for id in [&open, &pid, &said_open] {
        serve_marker(&d, id).await;
    }
    for by_host in [true, false] {
        assert_eq!(get_port(&d, &open, by_host, None).await, StatusCode::OK);
        assert_eq!(
            get_port(&d, &said_open, by_host, None).await,
            StatusCode::OK
        );
        // Private: no token, a wrong one, another sandbox's, the envd token: all refused.
        let other_traffic = c
            .get_sandbox(&open)
            .await
            .expect("view of the open sandbox")
            .traffic_access_token
            .expect("its traffic token");
        let envd = private["envdAccessToken"].as_str().expect("envd token");
        for bad in [
            None,
            Some("not-the-token"),
            Some(other_traffic.as_str()),
            Some(envd),
            Some(""),
        ] {
            let s = get_port(&d, &pid, by_host, bad).await;
            assert!(
                s == StatusCode::UNAUTHORIZED || s == StatusCode::FORBIDDEN,
                "{bad:?} by host {by_host}: {s}"
            );
        }
        assert_eq!(
            get_port(&d, &pid, by_host, Some(&ptoken)).await,
            StatusCode::OK
        );
    }
    // The body really came from the sandbox.
    let r = http()
        .get(format!("{}/index.html", d.url))
        .header("host", port_host(&d, PORT, &pid))
        .header("E2B-Traffic-Access-Token", &ptoken)
        .send()
        .await
        .expect("request");
    assert_eq!(r.text().await.expect("body"), MARKER);
    d.shutdown().await;

    // An operator can make E2B's ports private by default; asking still opens them.
    let d = Daemon::builder()
        .config("[e2b]\npublic_ports = false\n")
        .start()
        .await;
    let e = E2b::new(&d);
    let c = d.client();
    let closed = e.create_id(json!({"templateID": "base"})).await;
    assert!(!c.get_sandbox(&closed).await.expect("view").public);
    serve_marker(&d, &closed).await;
    let s = get_port(&d, &closed, true, None).await;
    assert!(
        s == StatusCode::UNAUTHORIZED || s == StatusCode::FORBIDDEN,
        "{s}"
    );
    let asked = e
        .create_id(json!({"templateID": "base", "network": {"allowPublicTraffic": true}}))
        .await;
    assert!(c.get_sandbox(&asked).await.expect("view").public);
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn timeout_zero_runs_the_timeout_action_at_once() {
    let d = Daemon::start().await;
    let e = E2b::new(&d);
    // No lifecycle: killed.
    let id = e.create_id(json!({"templateID": "base"})).await;
    let (s, v) = e.post(&id, "timeout", json!({"timeout": 0})).await;
    assert_eq!(s, StatusCode::NO_CONTENT, "{v}");
    assert_eq!(e.detail(&id).await.0, StatusCode::NOT_FOUND);
    let (s, _) = e.post(&id, "timeout", json!({"timeout": 0})).await;
    assert_eq!(s, StatusCode::NOT_FOUND);

    // Pausing on timeout: paused with its memory, and a connect brings back the same
    // processes.
    let id = e
        .create_id(json!({"templateID": "base", "autoPause": true}))
        .await;
    let c = d.client();
    sh(&c, &id, "sleep 600 >/dev/null 2>&1 & echo $! > /tmp/pid").await;
    let pid = sh(&c, &id, "cat /tmp/pid").await.stdout;
    let (s, v) = e.post(&id, "timeout", json!({"timeout": 0})).await;
    assert_eq!(s, StatusCode::NO_CONTENT, "{v}");
    assert_eq!(e.state(&id).await, "paused");
    assert_eq!(
        c.get_sandbox(&id).await.expect("view").state,
        "paused",
        "a memory pause"
    );
    // The timeout does not strike again while it is paused.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(e.state(&id).await, "paused");
    let (s, v) = e.post(&id, "connect", json!({"timeout": 60})).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let alive = sh(&c, &id, &format!("kill -0 {} && echo alive", pid.trim())).await;
    assert_eq!(alive.stdout, "alive\n", "{alive:?}");
    // Paused again by `timeout: 0` when already paused: nothing to do, still paused.
    e.post(&id, "pause", json!({})).await;
    let (s, _) = e.post(&id, "timeout", json!({"timeout": 0})).await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    assert_eq!(e.state(&id).await, "paused");

    // A files-only pause on timeout: hibernated.
    let id = e
        .create_id(json!({"templateID": "base", "autoPause": true, "autoPauseMemory": false}))
        .await;
    let (s, _) = e.post(&id, "timeout", json!({"timeout": 0})).await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    assert_eq!(e.state(&id).await, "paused");
    assert_eq!(c.get_sandbox(&id).await.expect("view").state, "hibernated");

    // Refused shapes stay refused.
    let id = e.create_id(json!({"templateID": "base"})).await;
    for body in [
        json!({}),
        json!({"timeout": -1}),
        json!({"timeout": "now"}),
        json!({"timeout": 99_999_999}),
    ] {
        let (s, v) = e.post(&id, "timeout", body.clone()).await;
        assert!(s.is_client_error(), "{body}: {s} {v}");
        assert_eq!(e.state(&id).await, "running", "{body}");
    }
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn list_is_newest_first_bounded_inclusively_and_paged() {
    let d = Daemon::start().await;
    let e = E2b::new(&d);
    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push(
            e.create_id(json!({"templateID": "base", "metadata": {"group": "g1"}}))
                .await,
        );
        // Distinct start times (they are kept to the millisecond).
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    e.create_id(json!({"templateID": "base", "metadata": {"group": "other"}}))
        .await;
    let newest: Vec<String> = ids.iter().rev().cloned().collect();
    let q = "metadata=group%3Dg1";
    assert_eq!(e.list(q).await, (newest.clone(), None));
    assert_eq!(e.list(&format!("{q}&order=desc")).await.0, newest);
    assert_eq!(e.list(&format!("{q}&order=asc")).await.0, ids);

    // One a page, newest first, each page's token leading to the next; none after the last.
    for (order, want) in [("desc", &newest), ("asc", &ids)] {
        let mut got = Vec::new();
        let mut token: Option<String> = None;
        let mut pages = 0;
        loop {
            let mut query = format!("{q}&limit=1&order={order}");
            if let Some(t) = &token {
                query.push_str(&format!("&nextToken={t}"));
            }
            let (page, next) = e.list(&query).await;
            assert_eq!(page.len(), 1, "{order}: {page:?}");
            got.extend(page);
            pages += 1;
            match next {
                Some(t) => token = Some(t),
                None => break,
            }
            assert!(pages < 10, "paging does not end");
        }
        assert_eq!(&got, want, "{order}");
    }

    // Paused ones page the same way, and a mixed filter shows the newest first.
    let (s, _) = e.post(&ids[0], "pause", json!({})).await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let (s, _) = e.post(&ids[2], "pause", json!({})).await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let (page, next) = e.list(&format!("{q}&state=paused&limit=1")).await;
    assert_eq!(page, [ids[2].clone()]);
    let (page, next) = e
        .list(&format!(
            "{q}&state=paused&limit=1&nextToken={}",
            next.expect("a second page")
        ))
        .await;
    assert_eq!((page, next), (vec![ids[0].clone()], None));
    assert_eq!(
        e.list(&format!("{q}&state=running")).await.0,
        [ids[1].clone()]
    );
    assert_eq!(
        e.list(&format!("{q}&state=running,paused&limit=2")).await.0,
        [ids[2].clone(), ids[1].clone()]
    );

    // `startedAfter` is inclusive: the start time of the middle one lists it and the newer.
    let (_, mid) = e.detail(&ids[1]).await;
    let started = mid["startedAt"].as_str().expect("startedAt");
    let enc = |t: &str| t.replace('+', "%2B").replace(':', "%3A");
    assert_eq!(
        e.list(&format!("{q}&startedAfter={}", enc(started)))
            .await
            .0,
        [ids[2].clone(), ids[1].clone()]
    );
    // The same instant written another way (microseconds, an offset) is the same bound.
    let other = if started.contains('.') {
        started.replace('Z', "000+00:00")
    } else {
        started.replace('Z', ".000000+00:00")
    };
    assert_ne!(other, started);
    assert_eq!(
        e.list(&format!("{q}&startedAfter={}", enc(&other))).await.0,
        [ids[2].clone(), ids[1].clone()]
    );
    let (_, last) = e.detail(&ids[2]).await;
    let last = last["startedAt"].as_str().expect("startedAt");
    assert_eq!(
        e.list(&format!("{q}&startedAfter={}", enc(last))).await.0,
        [ids[2].clone()]
    );

    // Bad queries are refused in E2B's error shape, not ignored.
    for bad in [
        "order=newest",
        "order=",
        "limit=0",
        "limit=1001",
        "nextToken=zz-not-a-token",
        "startedAfter=yesterday",
        "state=stopped",
        "sortBy=startedAt",
    ] {
        let (s, v, _) = e
            .call(Method::GET, &format!("/v2/sandboxes?{bad}"), None)
            .await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{bad}: {v}");
        assert_eq!(v["code"], json!(400), "{bad}: {v}");
    }
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn mcp_is_taken_as_e2b_takes_it_and_a_boot_id_is_the_sandbox_own() {
    let d = Daemon::start().await;
    let e = E2b::new(&d);
    let c = d.client();
    // E2B accepts the MCP configuration and leaves the gateway to the SDK; without a
    // gateway in the sandbox, starting it fails as it does on E2B's base template.
    let id = e
        .create_id(json!({"templateID": "base", "mcp": {"some-server": {}}}))
        .await;
    let r = sh(&c, &id, "mcp-gateway --config '{}'").await;
    assert_eq!(r.exit_code, 127, "{r:?}");
    let (s, _, _) = e
        .call(Method::DELETE, &format!("/sandboxes/{id}"), None)
        .await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    for bad in [json!("server"), json!([1]), json!(7)] {
        let (s, v, _) = e
            .call(
                Method::POST,
                "/v2/sandboxes",
                Some(json!({"templateID": "base", "mcp": bad})),
            )
            .await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    }
    assert_eq!(
        e.list("").await.0,
        Vec::<String>::new(),
        "nothing half-made"
    );

    // A boot id of its own: not the host's, kept by a freeze, new after a files-only
    // pause (a restart), and read-only.
    let id = e.create_id(json!({"templateID": "base"})).await;
    let host = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").expect("host boot id");
    let first = boot_id(&c, &id).await;
    assert_eq!(first.len(), 36, "{first}");
    assert_ne!(first, host.trim());
    let r = sandpit_tests::sh_root(
        &c,
        &id,
        "echo 00000000-0000-0000-0000-000000000000 > /proc/sys/kernel/random/boot_id",
    )
    .await;
    assert_ne!(r.exit_code, 0, "the boot id was writable");
    // Its mount names no host path.
    let mounts = sh(&c, &id, "grep boot_id /proc/self/mountinfo")
        .await
        .stdout;
    assert!(mounts.contains(" /boot_id "), "{mounts}");
    let data = d.data.path().to_str().expect("utf-8 data dir");
    assert!(!mounts.contains(data) && !mounts.contains(&id), "{mounts}");
    e.post(&id, "pause", json!({})).await;
    e.post(&id, "connect", json!({})).await;
    assert_eq!(boot_id(&c, &id).await, first, "a freeze kept the boot id");
    e.post(&id, "pause", json!({"memory": false})).await;
    wait_state(&e, &id, "paused").await;
    let (s, v) = e.post(&id, "connect", json!({})).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let second = boot_id(&c, &id).await;
    assert_eq!(second.len(), 36, "{second}");
    assert_ne!(second, first, "a restart gets a new boot id");
    d.shutdown().await;
}

/// A Connect request of `process.Process/Start` for `script` to the sandbox's envd through
/// the proxy, written by hand on a connection of its own (HTTP/1.1, kept alive).
fn start_request(id: &str, token: &str, script: &str) -> Vec<u8> {
    let msg = serde_json::to_vec(&json!({"process": {"cmd": "/bin/bash", "args": ["-c", script]}}))
        .expect("JSON");
    let mut body = vec![0u8];
    body.extend(u32::try_from(msg.len()).expect("small").to_be_bytes());
    body.extend(msg);
    let mut req = format!(
        "POST /process.Process/Start HTTP/1.1\r\nhost: 127.0.0.1\r\ne2b-sandbox-id: {id}\r\n\
         e2b-sandbox-port: 49983\r\nx-access-token: {token}\r\nauthorization: Basic dXNlcjo=\r\n\
         content-type: application/connect+json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    req.extend(body);
    req
}

/// Reads from `s` into `got` until `needle` appears (30 s at most).
async fn read_until(s: &mut tokio::net::TcpStream, got: &mut Vec<u8>, needle: &str) {
    use tokio::io::AsyncReadExt;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !String::from_utf8_lossy(got).contains(needle) {
        let mut buf = [0u8; 4096];
        let n = tokio::time::timeout_at(deadline, s.read(&mut buf))
            .await
            .expect("in time")
            .expect("read");
        assert!(
            n > 0,
            "closed before {needle:?}: {}",
            String::from_utf8_lossy(got)
        );
        got.extend_from_slice(&buf[..n]);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stream_cut_off_by_a_kill_ends_with_a_reset_and_a_finished_one_does_not() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let d = Daemon::start().await;
    let e = E2b::new(&d);
    let v = e.create(json!({"templateID": "base"})).await;
    let id = v["sandboxID"].as_str().expect("id").to_string();
    let token = v["envdAccessToken"].as_str().expect("token").to_string();

    // A stream that ends by itself leaves the connection open for the next request.
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", d.port))
        .await
        .expect("connect");
    s.write_all(&start_request(&id, &token, "echo done-first"))
        .await
        .expect("write");
    let mut got = Vec::new();
    // The last chunk of a chunked answer: the stream ended cleanly.
    read_until(&mut s, &mut got, "\r\n0\r\n\r\n").await;
    s.write_all(&start_request(&id, &token, "echo done-second"))
        .await
        .expect("write again");
    let mut got = Vec::new();
    read_until(&mut s, &mut got, "\r\n0\r\n\r\n").await;
    assert!(String::from_utf8_lossy(&got).starts_with("HTTP/1.1 200"));

    // A stream still running when the sandbox is killed: the connection is reset, which
    // clients tell apart from a malformed answer.
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", d.port))
        .await
        .expect("connect");
    s.write_all(&start_request(&id, &token, "sleep 60"))
        .await
        .expect("write");
    let mut got = Vec::new();
    read_until(&mut s, &mut got, "pid").await;
    let (st, _, _) = e
        .call(Method::DELETE, &format!("/sandboxes/{id}"), None)
        .await;
    assert_eq!(st, StatusCode::NO_CONTENT);
    let end = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let mut buf = [0u8; 4096];
            match s.read(&mut buf).await {
                Ok(0) => return Ok(()),
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) => return Err(e),
            }
        }
    })
    .await
    .expect("the stream ended in time");
    let err = end.expect_err("a clean close instead of a reset");
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset, "{err}");
    d.shutdown().await;
}
