//! Attacks on the sandbox data-plane proxy that once worked: a client stripping the
//! proxy's own loop marker with `Connection`, daemon keys slipping into a sandbox as the
//! second value of a repeated header, one sandbox's stuck listener stalling every other
//! sandbox's port traffic, and cookies of signed port URLs honoured for requests from
//! other sandboxes' pages (all sandboxes share one site, so `SameSite` does not stop them).

use bytes::Bytes;
use sandpit_api::{CreateSandboxRequest, RunCommandRequest, Sandbox};
use sandpit_client::Client;
use sandpit_tests::{Daemon, http, port_host, sh, wait_listening};

/// Answers every `GET` with the request's path and headers (each name with all its
/// values, in order) as JSON.
const ECHO_SERVER: &str = r#"
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def do_GET(self):
        headers = {}
        for k, v in self.headers.items():
            headers.setdefault(k.lower(), []).append(v)
        body = json.dumps({"path": self.path, "headers": headers}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"#;

const ECHO_PORT: u16 = 9000;

/// A sandbox with the default limits.
async fn create(c: &Client) -> Sandbox {
    sandpit_tests::create(c, CreateSandboxRequest::default()).await
}

async fn start_echo(c: &Client, id: &str) {
    c.write_file(id, "/tmp/echo.py", Bytes::from(ECHO_SERVER))
        .await
        .unwrap();
    let req = RunCommandRequest {
        argv: vec![
            "python3".into(),
            "/tmp/echo.py".into(),
            ECHO_PORT.to_string(),
        ],
        ..Default::default()
    };
    c.run_background(id, &req).await.unwrap();
    wait_listening(c, id, ECHO_PORT).await;
}

/// `GET path` on a sandbox port by host name; the headers may repeat names.
async fn get(
    d: &Daemon,
    id: &str,
    port: u16,
    path: &str,
    headers: &[(&str, &str)],
) -> (u16, serde_json::Value) {
    let mut r = http()
        .get(format!("{}{path}", d.url))
        .header("host", port_host(d, port, id));
    for (k, v) in headers {
        r = r.header(*k, *v);
    }
    let r = r.send().await.unwrap();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    let v = serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text));
    (status, v)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_header_cannot_remove_the_loop_marker() {
    let d = Daemon::start().await;
    let c = d.client();
    let sb = create(&c).await;
    let traffic = sb.traffic_access_token.clone().unwrap();
    start_echo(&c, &sb.id).await;
    for connection in ["sandpit-proxied", "keep-alive, Sandpit-Proxied"] {
        let (status, v) = get(
            &d,
            &sb.id,
            ECHO_PORT,
            "/",
            &[
                ("e2b-traffic-access-token", &traffic),
                ("connection", connection),
            ],
        )
        .await;
        assert_eq!(status, 200, "{v}");
        // The marker that stops a request coming back to the proxy must reach the sandbox
        // whatever the client names as hop-by-hop.
        assert_eq!(v["headers"]["sandpit-proxied"][0], "1", "{connection}: {v}");
    }
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_headers_cannot_carry_a_daemon_key_into_a_sandbox() {
    let d = Daemon::start().await;
    let c = d.client();
    let sb = create(&c).await;
    let traffic = sb.traffic_access_token.clone().unwrap();
    start_echo(&c, &sb.id).await;
    let key = d.key.trim().to_string();
    let bearer = format!("Bearer {key}");
    let (status, v) = get(
        &d,
        &sb.id,
        ECHO_PORT,
        "/",
        &[
            ("e2b-traffic-access-token", &traffic),
            ("x-api-key", "not-a-key"),
            ("x-api-key", &key),
            ("authorization", "Basic dXNlcjo="),
            ("authorization", &bearer),
        ],
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert!(
        !v.to_string().contains(&key),
        "the daemon key reached the sandbox: {v}"
    );
    d.shutdown().await;
}

/// Listens with a backlog of one and never accepts: once its queue is full, the kernel
/// drops further SYNs, so connections to it stay half-open until the connector gives up.
const STUCK_SERVER: &str = r#"
import socket, sys, time
s = socket.socket()
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen(0)
time.sleep(100000)
"#;

const STUCK_PORT: u16 = 7000;

/// Connections of sandbox `id` to `port` still waiting for an answer to their SYN (in
/// its own network namespace, where the proxy's connections are made).
async fn syn_sent(c: &Client, id: &str, port: u16) -> usize {
    let r = sh(
        c,
        id,
        &format!("awk '$4 == \"02\" && $3 ~ /:{port:04X}$/' /proc/net/tcp | wc -l"),
    )
    .await;
    r.stdout.trim().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_sandbox_listener_does_not_hold_up_other_sandboxes() {
    let d = Daemon::start().await;
    let c = d.client();
    let stuck = create(&c).await;
    let other = create(&c).await;
    c.write_file(&stuck.id, "/tmp/stuck.py", Bytes::from(STUCK_SERVER))
        .await
        .unwrap();
    c.run_background(
        &stuck.id,
        &RunCommandRequest {
            argv: vec![
                "python3".into(),
                "/tmp/stuck.py".into(),
                STUCK_PORT.to_string(),
            ],
            ..Default::default()
        },
    )
    .await
    .unwrap();
    wait_listening(&c, &stuck.id, STUCK_PORT).await;
    start_echo(&c, &other.id).await;

    // More requests to the stuck port than the proxy ever had connecting threads.
    let finished = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut hung = Vec::new();
    for _ in 0..140 {
        let (url, host, token, finished) = (
            d.url.clone(),
            port_host(&d, STUCK_PORT, &stuck.id),
            stuck.traffic_access_token.clone().unwrap(),
            finished.clone(),
        );
        hung.push(tokio::spawn(async move {
            let _ = http()
                .get(url)
                .header("host", host)
                .header("e2b-traffic-access-token", token)
                .send()
                .await;
            finished.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }));
    }
    loop {
        if syn_sent(&c, &stuck.id, STUCK_PORT).await >= 128 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    // Another sandbox's port answers while all of those still wait for their connections
    // (they give up only after the proxy's connect timeout, seconds away).
    let (status, v) = get(
        &d,
        &other.id,
        ECHO_PORT,
        "/",
        &[(
            "e2b-traffic-access-token",
            other.traffic_access_token.as_deref().unwrap(),
        )],
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        finished.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "the other sandbox was answered only after stuck connections gave up"
    );
    for h in hung {
        h.abort();
    }
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn access_cookies_count_only_for_their_own_pages() {
    let d = Daemon::start().await;
    let c = d.client();
    let sb = create(&c).await;
    let attacker = create(&c).await;
    start_echo(&c, &sb.id).await;
    let r = http()
        .post(format!(
            "{}/v1/sandboxes/{}/ports/{ECHO_PORT}/url",
            d.url, sb.id
        ))
        .header("authorization", format!("Bearer {}", d.key.trim()))
        .json(&serde_json::json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let signed: serde_json::Value = r.json().await.unwrap();
    let (status, _) = get(
        &d,
        &sb.id,
        ECHO_PORT,
        &format!("/?{}", signed["query"].as_str().unwrap()),
        &[],
    )
    .await;
    assert_eq!(status, 200);
    let exp = signed["expires_at"].as_i64().unwrap();
    let sig = form_urlencoded_value(signed["query"].as_str().unwrap(), "sandpit_signature");
    let cookie = format!("sandpit_port_access={exp}.{sig}");
    let own = format!("http://{}", port_host(&d, ECHO_PORT, &sb.id));
    let other = format!("http://{}", port_host(&d, 8080, &attacker.id));

    // The sandbox port's own pages, and a person opening it (a navigation), keep access.
    for headers in [
        vec![("cookie", cookie.as_str())],
        vec![("cookie", &cookie), ("origin", &own)],
        vec![
            ("cookie", &cookie),
            ("sec-fetch-site", "same-origin"),
            ("sec-fetch-mode", "cors"),
        ],
        vec![
            ("cookie", &cookie),
            ("sec-fetch-site", "cross-site"),
            ("sec-fetch-mode", "navigate"),
            ("sec-fetch-dest", "document"),
        ],
    ] {
        let (status, v) = get(&d, &sb.id, ECHO_PORT, "/", &headers).await;
        assert_eq!(status, 200, "{headers:?}: {v}");
    }
    // Another sandbox's page is the same site (one domain for all), so SameSite does not
    // keep the browser from sending the cookie along: the proxy must not honour it.
    for headers in [
        vec![("cookie", cookie.as_str()), ("origin", &other)],
        vec![("cookie", &cookie), ("origin", "null")],
        vec![
            ("cookie", &cookie),
            ("sec-fetch-site", "same-site"),
            ("sec-fetch-mode", "no-cors"),
            ("sec-fetch-dest", "image"),
        ],
        vec![
            ("cookie", &cookie),
            ("sec-fetch-site", "same-site"),
            ("sec-fetch-mode", "navigate"),
            ("sec-fetch-dest", "iframe"),
        ],
    ] {
        let (status, v) = get(&d, &sb.id, ECHO_PORT, "/", &headers).await;
        assert_eq!(status, 403, "{headers:?}: {v}");
    }
    // A page of another sandbox may set a cookie of the same name for the whole domain;
    // it must not take the real one's place.
    let tossed = format!("sandpit_port_access=1.v1_bogus; {cookie}");
    let (status, v) = get(&d, &sb.id, ECHO_PORT, "/", &[("cookie", &tossed)]).await;
    assert_eq!(status, 200, "{v}");
    let (status, _) = get(
        &d,
        &sb.id,
        ECHO_PORT,
        "/",
        &[("cookie", "sandpit_port_access=1.v1_bogus")],
    )
    .await;
    assert_eq!(status, 401);
    d.shutdown().await;
}

fn form_urlencoded_value(query: &str, name: &str) -> String {
    query
        .split('&')
        .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
        .unwrap()
        .to_string()
}

/// Sends `head` (a whole request, `\r\n` line ends) on a fresh connection and
/// returns the status code of the answer.
async fn raw_status(d: &Daemon, head: &str) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", d.port))
        .await
        .unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    let mut chunk = [0u8; 1024];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = s.read(&mut chunk).await.unwrap();
        assert!(n > 0, "closed: {}", String::from_utf8_lossy(&buf));
        buf.extend_from_slice(&chunk[..n]);
    }
    let line = String::from_utf8_lossy(&buf)
        .lines()
        .next()
        .unwrap()
        .to_string();
    line.split(' ').nth(1).unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_request_form_reaches_a_secure_envd_without_its_token() {
    use http_body_util::{BodyExt, Full};
    let d = Daemon::start().await;
    let c = d.client();
    let sb = create(&c).await;
    let id = sb.id.clone();
    let traffic = sb.traffic_access_token.clone().unwrap();
    let envd = sb.envd_access_token.clone().unwrap();
    let envd_host = port_host(&d, 49983, &id);
    let list = |extra: &str, target: &str, host: &str| {
        format!(
            "POST {target} HTTP/1.1\r\nHost: {host}\r\n{extra}Content-Type: application/json\r\n\
             Content-Length: 2\r\nConnection: close\r\n\r\n{{}}"
        )
    };
    // The token itself works (so the refusals below are about the forms, not the call).
    let ok = list(
        &format!("X-Access-Token: {envd}\r\n"),
        "/process.Process/List",
        &envd_host,
    );
    assert_eq!(raw_status(&d, &ok).await, 200);
    let api = format!("127.0.0.1:{}", d.port);
    for (what, req) in [
        (
            "absolute-form URI naming envd, Host naming the API",
            list(
                "",
                &format!("http://{envd_host}/process.Process/List"),
                &api,
            ),
        ),
        (
            "a wrong X-Access-Token before the right one",
            list(
                &format!("X-Access-Token: {traffic}\r\nX-Access-Token: {envd}\r\n"),
                "/process.Process/List",
                &envd_host,
            ),
        ),
        (
            "the traffic token as the envd token",
            list(
                &format!("X-Access-Token: {traffic}\r\n"),
                "/process.Process/List",
                &envd_host,
            ),
        ),
        (
            "E2B headers naming envd first, the code interpreter second",
            list(
                &format!(
                    "E2b-Sandbox-Id: {id}\r\nE2b-Sandbox-Port: 49983\r\nE2b-Sandbox-Port: 49999\r\n\
                     E2B-Traffic-Access-Token: {traffic}\r\n"
                ),
                "/process.Process/List",
                &api,
            ),
        ),
        (
            "E2B headers with padding",
            list(
                &format!("E2b-Sandbox-Id:  {id} \r\nE2b-Sandbox-Port:  49983 \r\n"),
                "/process.Process/List",
                &api,
            ),
        ),
        (
            "a /files signature on another path",
            list(
                "",
                "/process.Process/List?path=%2Fetc%2Fpasswd&signature=v1_x",
                &envd_host,
            ),
        ),
    ] {
        let status = raw_status(&d, &req).await;
        assert!(
            status == 401 || status == 403,
            "{what}: {status} for\n{req}"
        );
    }
    // The code interpreter takes the traffic token, but its paths stay under /code.
    for target in [
        "/../process.Process/List",
        "/%2e%2e/process.Process/List",
        "//process.Process/List",
        "/process.Process/List",
    ] {
        let req = list(
            &format!("E2B-Traffic-Access-Token: {traffic}\r\n"),
            target,
            &port_host(&d, 49999, &id),
        );
        assert_eq!(raw_status(&d, &req).await, 404, "{target}");
    }
    // HTTP/2: the authority decides, not a Host header beside it.
    let mut send = sandpit_tests::h2_connect(d.port).await;
    // (envd refuses without the token; the API has no such route)
    for (authority, host_header, want) in [
        (envd_host.clone(), api.clone(), 401),
        (api.clone(), envd_host.clone(), 404),
    ] {
        let req = http::Request::post(format!("http://{authority}/process.Process/List"))
            .header("host", host_header)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from("{}")).map_err(|e| match e {}).boxed())
            .unwrap();
        let resp = send.send_request(req).await.unwrap();
        assert_eq!(resp.status(), want, "{authority}");
    }
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_that_wakes_a_hibernated_sandbox_gets_through() {
    let d = Daemon::start().await;
    let c = d.client();
    let sb = create(&c).await;
    let envd = sb.envd_access_token.clone().unwrap();
    c.write_file(&sb.id, "/tmp/kept.txt", Bytes::from("kept"))
        .await
        .unwrap();
    c.hibernate(&sb.id).await.unwrap();
    // A page's many requests arrive one after another; the first wakes the sandbox, the
    // others (some while it is starting again) must wait for it rather than find it
    // half-started.
    let mut all = Vec::new();
    for _ in 0..100 {
        let (url, host, envd) = (
            format!("{}/files?path=/tmp/kept.txt", d.url),
            port_host(&d, 49983, &sb.id),
            envd.clone(),
        );
        all.push(tokio::spawn(async move {
            let r = http()
                .get(url)
                .header("host", host)
                .header("x-access-token", envd)
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        }));
        tokio::time::sleep(std::time::Duration::from_millis(3)).await;
    }
    for h in all {
        let (status, body) = h.await.unwrap();
        assert_eq!((status, body.as_str()), (200, "kept"), "{body}");
    }
    d.shutdown().await;
}
