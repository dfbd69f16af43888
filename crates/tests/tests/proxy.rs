//! The sandbox data-plane proxy against a real daemon: servers started inside sandboxes
//! (python's http.server, and a WebSocket echo server written with the standard library
//! alone) reached by host name and by E2B's headers; traffic tokens, signed URLs and
//! public sandboxes; envd (Connect RPC unary and server streaming, `/files` with E2B's
//! signed URLs) through the proxy; 502 bodies; idle timer and wake on traffic; h2c.

use base64::Engine;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Full};
use sandpit_api::{CreateSandboxRequest, RunCommandRequest};
use sandpit_client::Client;
use sandpit_tests::{
    Daemon, connect_envelope, create, free_port, http, now_ms, port_host, wait_listening,
};
use sha2::{Digest, Sha256};
use std::time::Duration;

/// Answers `GET` with the request's path and headers as JSON, `POST` with its body, and
/// echoes WebSocket frames.
const ECHO_SERVER: &str = r#"
import base64, hashlib, json, struct, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"

class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def reply(self, body, ctype):
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.headers.get("Upgrade", "").lower() == "websocket":
            return self.websocket()
        headers = {}
        for k, v in self.headers.items():
            headers.setdefault(k.lower(), []).append(v)
        self.reply(json.dumps({"path": self.path, "headers": headers}).encode(), "application/json")

    def do_POST(self):
        n = int(self.headers.get("Content-Length", "0"))
        self.reply(self.rfile.read(n), "application/octet-stream")

    def websocket(self):
        key = self.headers["Sec-WebSocket-Key"]
        accept = base64.b64encode(hashlib.sha1((key + GUID).encode()).digest()).decode()
        self.send_response(101)
        self.send_header("Upgrade", "websocket")
        self.send_header("Connection", "Upgrade")
        self.send_header("Sec-WebSocket-Accept", accept)
        self.end_headers()
        self.wfile.flush()
        self.close_connection = True
        r, w = self.rfile, self.wfile
        while True:
            head = r.read(2)
            if len(head) < 2:
                return
            op, n = head[0] & 0x0F, head[1] & 0x7F
            if n == 126:
                n = struct.unpack(">H", r.read(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", r.read(8))[0]
            mask = r.read(4) if head[1] & 0x80 else b"\0\0\0\0"
            data = bytearray(r.read(n))
            for i in range(n):
                data[i] ^= mask[i % 4]
            if op == 8:
                w.write(b"\x88\x00")
                w.flush()
                return
            if op == 9:
                op = 10
            out = bytes([0x80 | op])
            if n < 126:
                out += bytes([n])
            elif n < 65536:
                out += bytes([126]) + struct.pack(">H", n)
            else:
                out += bytes([127]) + struct.pack(">Q", n)
            w.write(out + bytes(data))
            w.flush()

ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), H).serve_forever()
"#;

const ECHO_PORT: u16 = 9000;
const FILE_PORT: u16 = 8000;
const MARKER: &str = "proxied-marker-7f3a";

/// Starts python's http.server on 127.0.0.1 only (serving a file holding [`MARKER`]) and
/// the echo server on every address.
async fn start_servers(c: &Client, id: &str) {
    c.write_file(id, "/tmp/www/index.html", Bytes::from(MARKER))
        .await
        .unwrap();
    c.write_file(id, "/tmp/echo.py", Bytes::from(ECHO_SERVER))
        .await
        .unwrap();
    for argv in [
        vec![
            "python3".to_string(),
            "-m".into(),
            "http.server".into(),
            FILE_PORT.to_string(),
            "--bind".into(),
            "127.0.0.1".into(),
            "--directory".into(),
            "/tmp/www".into(),
        ],
        vec![
            "python3".into(),
            "/tmp/echo.py".into(),
            ECHO_PORT.to_string(),
        ],
    ] {
        let req = RunCommandRequest {
            argv,
            ..Default::default()
        };
        c.run_background(id, &req).await.unwrap();
    }
    wait_listening(c, id, FILE_PORT).await;
    wait_listening(c, id, ECHO_PORT).await;
}

async fn json_of(r: reqwest::Response) -> (u16, serde_json::Value) {
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    let v = serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text));
    (status, v)
}

/// `GET path` on a sandbox port by host name, with extra headers.
async fn get_by_host(
    d: &Daemon,
    id: &str,
    port: u16,
    path: &str,
    headers: &[(&str, &str)],
) -> reqwest::Response {
    let mut r = http()
        .get(format!("{}{path}", d.url))
        .header("host", port_host(d, port, id));
    for (k, v) in headers {
        r = r.header(*k, *v);
    }
    r.send().await.unwrap()
}

/// E2B's signed-URL recipe, written out here to check the daemon against it.
fn e2b_file_signature(path: &str, op: &str, user: &str, token: &str, exp: Option<i64>) -> String {
    let raw = match exp {
        Some(e) => format!("{path}:{op}:{user}:{token}:{e}"),
        None => format!("{path}:{op}:{user}:{token}"),
    };
    let b64 = base64::engine::general_purpose::STANDARD.encode(Sha256::digest(raw.as_bytes()));
    format!("v1_{}", b64.trim_end_matches('='))
}

fn now_secs() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn private_ports_by_host_and_header_with_tokens_and_signed_urls() {
    let d = Daemon::start().await;
    let c = d.client();
    let sb = create(&c, CreateSandboxRequest::default()).await;
    let id = sb.id.clone();
    // Private and secure by default; the owner sees both tokens.
    assert!(sb.secure && !sb.public, "{sb:?}");
    let traffic = sb.traffic_access_token.clone().unwrap();
    let envd = sb.envd_access_token.clone().unwrap();
    assert!(traffic.len() >= 32 && envd.len() >= 32 && traffic != envd);
    assert_eq!(
        c.get_sandbox(&id).await.unwrap().traffic_access_token,
        Some(traffic.clone())
    );
    start_servers(&c, &id).await;

    // No token: 401 with E2B's JSON shape; a wrong one: 403.
    let (status, v) = json_of(get_by_host(&d, &id, FILE_PORT, "/", &[]).await).await;
    assert_eq!(status, 401, "{v}");
    assert_eq!(v["sandboxId"], id.as_str());
    assert_eq!(v["code"], 401);
    let (status, _) = json_of(
        get_by_host(
            &d,
            &id,
            FILE_PORT,
            "/",
            &[("e2b-traffic-access-token", "wrong")],
        )
        .await,
    )
    .await;
    assert_eq!(status, 403);
    // The envd token is not a traffic token.
    let (status, _) =
        json_of(get_by_host(&d, &id, FILE_PORT, "/", &[("x-access-token", &envd)]).await).await;
    assert_eq!(status, 401);

    // The traffic token opens the port, by host name and by E2B's headers; the server
    // listens on 127.0.0.1 only, inside the sandbox.
    let r = get_by_host(
        &d,
        &id,
        FILE_PORT,
        "/index.html",
        &[("E2B-Traffic-Access-Token", &traffic)],
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.unwrap(), MARKER);
    let r = http()
        .get(format!("{}/index.html", d.url))
        .header("E2b-Sandbox-Id", &id)
        .header("E2b-Sandbox-Port", FILE_PORT.to_string())
        .header("e2b-traffic-access-token", &traffic)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.unwrap(), MARKER);

    // A request body goes through.
    let payload = vec![7u8; 300_000];
    let r = http()
        .post(format!("{}/upload", d.url))
        .header("host", port_host(&d, ECHO_PORT, &id))
        .header("e2b-traffic-access-token", &traffic)
        .body(payload.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.bytes().await.unwrap().to_vec(), payload);

    // Nothing that authenticates to the daemon or the proxy reaches the sandbox; the
    // application's own headers and cookies do.
    let key = d.key.trim().to_string();
    let r = get_by_host(
        &d,
        &id,
        ECHO_PORT,
        "/h?x=1",
        &[
            ("e2b-traffic-access-token", &traffic),
            ("x-api-key", &key),
            ("authorization", &format!("Bearer {key}")),
            ("x-access-token", &envd),
            ("x-app", "kept"),
            ("cookie", "app=1"),
        ],
    )
    .await;
    let (status, v) = json_of(r).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["path"], "/h?x=1");
    let seen = v["headers"].as_object().unwrap();
    for gone in [
        "e2b-traffic-access-token",
        "x-api-key",
        "authorization",
        "x-access-token",
        "e2b-sandbox-id",
    ] {
        assert!(!seen.contains_key(gone), "{gone} reached the sandbox: {v}");
    }
    assert_eq!(v["headers"]["x-app"][0], "kept");
    assert_eq!(v["headers"]["cookie"][0], "app=1");
    assert!(!v.to_string().contains(&key) && !v.to_string().contains(&traffic));

    // Signed URLs minted by the owner.
    let url_req = |port: u16, body: serde_json::Value| {
        http()
            .post(format!("{}/v1/sandboxes/{id}/ports/{port}/url", d.url))
            .header("authorization", format!("Bearer {}", d.key))
            .json(&body)
            .send()
    };
    let (status, signed) = json_of(
        url_req(ECHO_PORT, serde_json::json!({"path": "/s?a=b"}))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, 200, "{signed}");
    assert_eq!(signed["host"], port_host(&d, ECHO_PORT, &id));
    let url = signed["url"].as_str().unwrap();
    let path_and_query = url
        .split_once(&signed["host"].as_str().unwrap().to_string())
        .unwrap()
        .1;
    let r = get_by_host(&d, &id, ECHO_PORT, path_and_query, &[]).await;
    assert_eq!(r.status(), 200);
    let cookie = r
        .headers()
        .get("set-cookie")
        .expect("a signed URL leaves a cookie")
        .to_str()
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .to_string();
    let (_, v) = json_of(r).await;
    // The signature parameters stay with the proxy.
    assert_eq!(v["path"], "/s?a=b");
    // The cookie alone opens the same host (a browser's next requests), not another port.
    let r = get_by_host(&d, &id, ECHO_PORT, "/next", &[("cookie", &cookie)]).await;
    assert_eq!(r.status(), 200);
    let (_, v) = json_of(r).await;
    assert!(v["headers"].get("cookie").is_none(), "{v}");
    let r = get_by_host(&d, &id, FILE_PORT, "/", &[("cookie", &cookie)]).await;
    assert_eq!(r.status(), 401);
    // The header form takes the signed query too.
    let r = http()
        .get(format!("{}/q?{}", d.url, signed["query"].as_str().unwrap()))
        .header("e2b-sandbox-id", &id)
        .header("e2b-sandbox-port", ECHO_PORT.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // Bound to its port.
    let other = path_and_query.to_string();
    let r = get_by_host(&d, &id, FILE_PORT, &other, &[]).await;
    assert_eq!(r.status(), 401);
    // Expired: signed with the real traffic token, an expiry in the past.
    let past = now_secs() - 5;
    let sig = sandpit_server::ingress::auth::port_signature(&traffic, &id, ECHO_PORT, past);
    let r = get_by_host(
        &d,
        &id,
        ECHO_PORT,
        &format!("/?sandpit_expires={past}&sandpit_signature={sig}"),
        &[],
    )
    .await;
    let (status, v) = json_of(r).await;
    assert_eq!(status, 401);
    assert!(
        v["message"]
            .as_str()
            .unwrap()
            .contains("signature is already expired"),
        "{v}"
    );
    // A forged expiry.
    let later = now_secs() + 3600;
    let r = get_by_host(
        &d,
        &id,
        ECHO_PORT,
        &format!("/?sandpit_expires={later}&sandpit_signature={sig}"),
        &[],
    )
    .await;
    assert_eq!(r.status(), 401);
    // Bad mint requests.
    for (port, body) in [
        (49983u16, serde_json::json!({})),
        (8080, serde_json::json!({"expires_in": 0})),
        (8080, serde_json::json!({"path": "no-slash"})),
        (8080, serde_json::json!({"bogus": 1})),
    ] {
        let (status, v) = json_of(url_req(port, body).await.unwrap()).await;
        assert_eq!(status, 400, "{port}: {v}");
    }
    // Minting needs the owner's API key.
    let r = http()
        .post(format!("{}/v1/sandboxes/{id}/ports/8000/url", d.url))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);

    // A loop back into the proxy is refused.
    let r = get_by_host(
        &d,
        &id,
        ECHO_PORT,
        "/",
        &[
            ("e2b-traffic-access-token", &traffic),
            ("sandpit-proxied", "1"),
        ],
    )
    .await;
    assert_eq!(r.status(), 508);

    // Rotating the traffic token retires the old one and the URLs signed with it.
    let r = http()
        .patch(format!("{}/v1/sandboxes/{id}/access", d.url))
        .header("authorization", format!("Bearer {}", d.key))
        .json(&serde_json::json!({"rotate_traffic_token": true}))
        .send()
        .await
        .unwrap();
    let (status, a) = json_of(r).await;
    assert_eq!(status, 200, "{a}");
    let rotated = a["traffic_access_token"].as_str().unwrap().to_string();
    assert_ne!(rotated, traffic);
    assert_eq!(a["envd_access_token"], envd.as_str());
    let r = get_by_host(
        &d,
        &id,
        FILE_PORT,
        "/",
        &[("e2b-traffic-access-token", &traffic)],
    )
    .await;
    assert_eq!(r.status(), 403);
    let r = get_by_host(&d, &id, ECHO_PORT, path_and_query, &[]).await;
    assert_eq!(r.status(), 401);
    let r = get_by_host(
        &d,
        &id,
        FILE_PORT,
        "/",
        &[("e2b-traffic-access-token", &rotated)],
    )
    .await;
    assert_eq!(r.status(), 200);
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn public_sandboxes_websockets_and_502s() {
    let d = Daemon::start().await;
    let c = d.client();
    let sb = create(
        &c,
        CreateSandboxRequest {
            public: Some(true),
            ..Default::default()
        },
    )
    .await;
    let id = sb.id.clone();
    assert!(sb.public);
    start_servers(&c, &id).await;
    // Public: no token needed.
    let r = get_by_host(&d, &id, FILE_PORT, "/index.html", &[]).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.unwrap(), MARKER);

    // WebSocket echo through the proxy, by host name and by headers.
    use futures::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    for by_host in [true, false] {
        let mut req = format!("ws://127.0.0.1:{}/ws", d.port)
            .into_client_request()
            .unwrap();
        if by_host {
            req.headers_mut()
                .insert("host", port_host(&d, ECHO_PORT, &id).parse().unwrap());
        } else {
            req.headers_mut()
                .insert("e2b-sandbox-id", id.parse().unwrap());
            req.headers_mut()
                .insert("e2b-sandbox-port", ECHO_PORT.to_string().parse().unwrap());
        }
        let (mut ws, resp) = tokio_tungstenite::connect_async(req).await.unwrap();
        assert_eq!(resp.status(), 101);
        ws.send(Message::text("hello through the proxy"))
            .await
            .unwrap();
        let got = ws.next().await.unwrap().unwrap();
        assert_eq!(got.into_text().unwrap().as_str(), "hello through the proxy");
        let big: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        ws.send(Message::binary(big.clone())).await.unwrap();
        let got = ws.next().await.unwrap().unwrap();
        assert_eq!(got.into_data().to_vec(), big);
        ws.close(None).await.unwrap();
    }

    // Making it private again closes it.
    let r = http()
        .patch(format!("{}/v1/sandboxes/{id}/access", d.url))
        .header("authorization", format!("Bearer {}", d.key))
        .json(&serde_json::json!({"public": false}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(!c.get_sandbox(&id).await.unwrap().public);
    let r = get_by_host(&d, &id, FILE_PORT, "/", &[]).await;
    assert_eq!(r.status(), 401);
    // A private sandbox's WebSocket needs the token too.
    let mut req = format!("ws://127.0.0.1:{}/ws", d.port)
        .into_client_request()
        .unwrap();
    req.headers_mut()
        .insert("host", port_host(&d, ECHO_PORT, &id).parse().unwrap());
    assert!(tokio_tungstenite::connect_async(req).await.is_err());

    // Nothing listens: 502 naming the port, in both forms.
    let r = http()
        .patch(format!("{}/v1/sandboxes/{id}/access", d.url))
        .header("authorization", format!("Bearer {}", d.key))
        .json(&serde_json::json!({"public": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let (status, v) = json_of(get_by_host(&d, &id, 3999, "/", &[]).await).await;
    assert_eq!(status, 502, "{v}");
    assert_eq!(v["port"], 3999);
    assert_eq!(v["sandboxId"], id.as_str());
    assert!(
        v["message"].as_str().unwrap().contains("port is not open")
            && v["message"].as_str().unwrap().contains("3999"),
        "{v}"
    );
    let r = http()
        .get(&d.url)
        .header("e2b-sandbox-id", &id)
        .header("e2b-sandbox-port", "4001")
        .send()
        .await
        .unwrap();
    let (status, v) = json_of(r).await;
    assert_eq!((status, v["port"].as_u64()), (502, Some(4001)), "{v}");

    // Unknown sandboxes: 502 "was not found", in both forms.
    let ghost = "zzzzzzzzzzzzzzzzzzzz";
    let (status, v) = json_of(get_by_host(&d, ghost, 8000, "/", &[]).await).await;
    assert_eq!(status, 502);
    assert_eq!(v["message"], "The sandbox was not found");
    assert_eq!(v["sandboxId"], ghost);
    let r = http()
        .get(&d.url)
        .header("e2b-sandbox-id", "nosuchsandbox")
        .header("e2b-sandbox-port", "49983")
        .send()
        .await
        .unwrap();
    let (status, v) = json_of(r).await;
    assert_eq!(status, 502);
    assert_eq!(v["sandboxId"], "nosuchsandbox");
    // Malformed header forms are refused, not passed to the API.
    let r = http()
        .get(format!("{}/v1/health", d.url))
        .header("e2b-sandbox-id", &id)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    // The REST API still answers on the same listener.
    let r = http()
        .get(format!("{}/v1/health", d.url))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    // A deleted sandbox is not found any more.
    c.delete_sandbox(&id).await.unwrap();
    let (status, v) = json_of(get_by_host(&d, &id, FILE_PORT, "/", &[]).await).await;
    assert_eq!(
        (status, v["message"].as_str()),
        (502, Some("The sandbox was not found"))
    );
    d.shutdown().await;
}

/// Splits a Connect streaming body into its messages (flags, JSON).
fn envelopes(mut body: &[u8]) -> Vec<(u8, serde_json::Value)> {
    let mut out = Vec::new();
    while body.len() >= 5 {
        let flags = body[0];
        let n = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
        let msg = &body[5..5 + n];
        out.push((flags, serde_json::from_slice(msg).unwrap()));
        body = &body[5 + n..];
    }
    assert!(body.is_empty(), "trailing bytes in a Connect stream");
    out
}

fn user_basic() -> String {
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode("user:")
    )
}

/// A Connect unary JSON call to envd through the header form.
async fn envd_unary(
    d: &Daemon,
    id: &str,
    method: &str,
    body: serde_json::Value,
    token: Option<&str>,
) -> (u16, serde_json::Value) {
    let mut r = http()
        .post(format!("{}/{method}", d.url))
        .header("e2b-sandbox-id", id)
        .header("e2b-sandbox-port", "49983")
        .header("content-type", "application/json")
        .header("connect-protocol-version", "1")
        .header("authorization", user_basic())
        .body(body.to_string());
    if let Some(t) = token {
        r = r.header("x-access-token", t);
    }
    json_of(r.send().await.unwrap()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envd_through_the_proxy() {
    let d = Daemon::start().await;
    let c = d.client();
    let sb = create(&c, CreateSandboxRequest::default()).await;
    let id = sb.id.clone();
    let token = sb.envd_access_token.clone().unwrap();

    // Unary Connect in JSON: refused without the token on a secure sandbox.
    let stat = serde_json::json!({"path": "/home/user"});
    let (status, v) = envd_unary(&d, &id, "filesystem.Filesystem/Stat", stat.clone(), None).await;
    assert_eq!(status, 401, "{v}");
    let (status, _) = envd_unary(
        &d,
        &id,
        "filesystem.Filesystem/Stat",
        stat.clone(),
        Some("nope"),
    )
    .await;
    assert_eq!(status, 403);
    let (status, v) = envd_unary(
        &d,
        &id,
        "filesystem.Filesystem/Stat",
        stat.clone(),
        Some(&token),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["entry"]["name"], "user");
    assert_eq!(v["entry"]["path"], "/home/user");
    // By host name too, and /health.
    let r = http()
        .get(format!("{}/health", d.url))
        .header("host", port_host(&d, 49983, &id))
        .header("x-access-token", &token)
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.status());

    // Server streaming: process.Process/Start, output streamed back as Connect messages.
    let start = serde_json::json!({
        "process": {"cmd": "/bin/bash", "args": ["-c", "echo streamed-$((6*7)); echo err >&2; exit 3"]}
    });
    let r = http()
        .post(format!("{}/process.Process/Start", d.url))
        .header("host", port_host(&d, 49983, &id))
        .header("x-access-token", &token)
        .header("authorization", user_basic())
        .header("content-type", "application/connect+json")
        .body(connect_envelope(&start))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let body = r.bytes().await.unwrap();
    let msgs = envelopes(&body);
    let mut stdout = Vec::new();
    let mut exit = None;
    let mut pid = None;
    for (flags, m) in &msgs {
        if flags & 2 != 0 {
            assert!(m.get("error").is_none(), "stream ended with {m}");
            continue;
        }
        let e = &m["event"];
        if let Some(p) = e["start"]["pid"].as_u64() {
            pid = Some(p);
        }
        if let Some(s) = e["data"]["stdout"].as_str() {
            stdout.extend(base64::engine::general_purpose::STANDARD.decode(s).unwrap());
        }
        if e.get("end").is_some() {
            exit = Some(e["end"]["exitCode"].as_i64().unwrap_or(0));
        }
    }
    assert!(pid.is_some(), "{msgs:?}");
    assert_eq!(String::from_utf8(stdout).unwrap(), "streamed-42\n");
    assert_eq!(exit, Some(3));

    // /files with E2B's signed URLs: write, then read back.
    let path = "/home/user/signed/upload.bin";
    let data: Vec<u8> = (0..150_000u32).map(|i| (i * 7 % 256) as u8).collect();
    let exp = now_secs() + 120;
    let wsig = e2b_file_signature(path, "write", "user", &token, Some(exp));
    let files_url = |sig: &str, exp: i64| {
        reqwest::Url::parse_with_params(
            &format!("{}/files", d.url),
            &[
                ("path", path.to_string()),
                ("username", "user".into()),
                ("signature", sig.to_string()),
                ("signature_expiration", exp.to_string()),
            ],
        )
        .unwrap()
    };
    let form = reqwest::multipart::Form::new().part(
        "file",
        reqwest::multipart::Part::bytes(data.clone()).file_name("upload.bin"),
    );
    let r = http()
        .post(files_url(&wsig, exp))
        .header("host", port_host(&d, 49983, &id))
        .multipart(form)
        .send()
        .await
        .unwrap();
    let (status, v) = json_of(r).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v[0]["path"], path);
    let rsig = e2b_file_signature(path, "read", "user", &token, Some(exp));
    let r = http()
        .get(files_url(&rsig, exp))
        .header("e2b-sandbox-id", &id)
        .header("e2b-sandbox-port", "49983")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.bytes().await.unwrap().to_vec(), data);
    // A write signature does not read, an expired one does nothing, a signature without
    // expiry (E2B allows those) reads.
    let r = http()
        .get(files_url(&wsig, exp))
        .header("host", port_host(&d, 49983, &id))
        .send()
        .await
        .unwrap();
    let (status, v) = json_of(r).await;
    assert_eq!(status, 401, "{v}");
    assert_eq!(
        v,
        serde_json::json!({"code": 401, "message": "invalid signature"}),
        "E2B envd's exact body"
    );
    let old = now_secs() - 1;
    let osig = e2b_file_signature(path, "read", "user", &token, Some(old));
    let r = http()
        .get(files_url(&osig, old))
        .header("host", port_host(&d, 49983, &id))
        .send()
        .await
        .unwrap();
    let (status, v) = json_of(r).await;
    assert_eq!(status, 401, "{v}");
    assert_eq!(
        v,
        serde_json::json!({"code": 401, "message": "signature is already expired"}),
        "E2B envd's exact body"
    );
    let nsig = e2b_file_signature(path, "read", "", &token, None);
    let r = http()
        .get(
            reqwest::Url::parse_with_params(
                &format!("{}/files", d.url),
                &[("path", path), ("signature", nsig.as_str())],
            )
            .unwrap(),
        )
        .header("host", port_host(&d, 49983, &id))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.bytes().await.unwrap().len(), data.len());

    // The code interpreter's port takes the traffic token (E2B's SDK sends only that on
    // some calls) and goes to the agent; without a credential it is refused.
    let traffic = sb.traffic_access_token.clone().unwrap();
    let r = http()
        .get(format!("{}/contexts", d.url))
        .header("e2b-sandbox-id", &id)
        .header("e2b-sandbox-port", "49999")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = http()
        .get(format!("{}/contexts", d.url))
        .header("e2b-sandbox-id", &id)
        .header("e2b-sandbox-port", "49999")
        .header("e2b-traffic-access-token", &traffic)
        .send()
        .await
        .unwrap();
    assert!(
        ![401, 403, 502].contains(&r.status().as_u16()),
        "{}",
        r.status()
    );

    // `secure: false` opens envd without a token, as in E2B.
    let open = create(
        &c,
        CreateSandboxRequest {
            secure: Some(false),
            ..Default::default()
        },
    )
    .await;
    assert!(!open.secure);
    let (status, v) = envd_unary(&d, &open.id, "filesystem.Filesystem/Stat", stat, None).await;
    assert_eq!(status, 200, "{v}");
    // ... but its other ports stay private.
    let r = get_by_host(&d, &open.id, 8000, "/", &[]).await;
    assert_eq!(r.status(), 401);
    d.shutdown().await;
}

/// Reads Connect messages off a streamed response as they arrive.
struct ConnectReader {
    stream: std::pin::Pin<Box<dyn futures::Stream<Item = reqwest::Result<Bytes>> + Send>>,
    buf: Vec<u8>,
}

impl ConnectReader {
    fn new(r: reqwest::Response) -> Self {
        Self {
            stream: Box::pin(r.bytes_stream()),
            buf: Vec::new(),
        }
    }

    /// The next message, bounded in time so that a proxy that buffers fails the test
    /// instead of hanging it.
    async fn next(&mut self) -> Option<(u8, serde_json::Value)> {
        use futures::StreamExt;
        loop {
            if self.buf.len() >= 5 {
                let n = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]])
                    as usize;
                if self.buf.len() >= 5 + n {
                    let flags = self.buf[0];
                    let v = serde_json::from_slice(&self.buf[5..5 + n]).unwrap();
                    self.buf.drain(..5 + n);
                    return Some((flags, v));
                }
            }
            let chunk = tokio::time::timeout(Duration::from_secs(30), self.stream.next())
                .await
                .expect("the stream stalled: is the proxy buffering?")?;
            self.buf.extend_from_slice(&chunk.unwrap());
        }
    }

    /// Stdout gathered until it contains `want` (or the process ends).
    async fn stdout_until(&mut self, want: &str) -> String {
        let mut out = String::new();
        while !out.contains(want) {
            let Some((_, m)) = self.next().await else {
                break;
            };
            if let Some(s) = m["event"]["data"]["stdout"].as_str() {
                let b = base64::engine::general_purpose::STANDARD.decode(s).unwrap();
                out.push_str(&String::from_utf8_lossy(&b));
            }
            if m["event"].get("end").is_some() {
                break;
            }
        }
        out
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envd_client_streaming_is_not_buffered() {
    let d = Daemon::start().await;
    let c = d.client();
    let sb = create(&c, CreateSandboxRequest::default()).await;
    let id = sb.id.clone();
    let token = sb.envd_access_token.clone().unwrap();
    let post = |method: &str| {
        http()
            .post(format!("{}/process.Process/{method}", d.url))
            .header("e2b-sandbox-id", &id)
            .header("e2b-sandbox-port", "49983")
            .header("x-access-token", &token)
            .header("authorization", user_basic())
            .header("content-type", "application/connect+json")
    };
    // The command waits for stdin: its start event can only arrive if the response
    // streams while the process runs.
    let start = serde_json::json!({
        "process": {"cmd": "/bin/bash", "args": ["-c", "read a; echo first-$a; read b; echo second-$b"]},
        "stdin": true
    });
    let r = post("Start")
        .body(connect_envelope(&start))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut events = ConnectReader::new(r);
    let (_, first) = events.next().await.unwrap();
    let pid = first["event"]["start"]["pid"]
        .as_u64()
        .expect("start event");

    // StreamInput: a client stream whose messages are sent one at a time, each only
    // after the output of the one before came back.
    let (tx, rx) = futures::channel::mpsc::unbounded::<Vec<u8>>();
    let input = reqwest::Body::wrap_stream(futures::StreamExt::map(rx, Ok::<_, std::io::Error>));
    let sending = tokio::spawn(post("StreamInput").body(input).send());
    let data = |s: &str| {
        connect_envelope(&serde_json::json!({
            "data": {"input": {"stdin": base64::engine::general_purpose::STANDARD.encode(s)}}
        }))
    };
    tx.unbounded_send(connect_envelope(
        &serde_json::json!({"start": {"process": {"pid": pid}}}),
    ))
    .unwrap();
    tx.unbounded_send(data("one\n")).unwrap();
    assert!(events.stdout_until("first-one").await.contains("first-one"));
    tx.unbounded_send(data("two\n")).unwrap();
    assert!(
        events
            .stdout_until("second-two")
            .await
            .contains("second-two")
    );
    drop(tx);
    let r = sending.await.unwrap().unwrap();
    assert_eq!(r.status(), 200);
    let body = r.bytes().await.unwrap();
    for (flags, m) in envelopes(&body) {
        assert!(
            m.get("error").is_none(),
            "StreamInput ended with {m} ({flags})"
        );
    }
    let mut end = None;
    while let Some((_, m)) = events.next().await {
        if let Some(e) = m["event"].get("end") {
            end = Some(e.clone());
        }
    }
    assert_eq!(end.map(|e| e["exitCode"].as_i64().unwrap_or(0)), Some(0));
    d.shutdown().await;
}

async fn state_of(c: &Client, id: &str) -> String {
    // The list does not count as activity and wakes nothing.
    c.list_sandboxes(None, &[], Some(1000), None)
        .await
        .unwrap()
        .items
        .into_iter()
        .find(|s| s.id == id)
        .unwrap()
        .state
}

async fn last_activity(c: &Client, id: &str) -> i64 {
    c.list_sandboxes(None, &[], Some(1000), None)
        .await
        .unwrap()
        .items
        .into_iter()
        .find(|s| s.id == id)
        .unwrap()
        .lifecycle
        .last_activity_ms
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traffic_is_activity_and_wakes_paused_sandboxes() {
    let d = Daemon::start().await;
    let c = d.client();
    let sb = create(&c, CreateSandboxRequest::default()).await;
    let id = sb.id.clone();
    let traffic = sb.traffic_access_token.clone().unwrap();
    let envd = sb.envd_access_token.clone().unwrap();
    start_servers(&c, &id).await;

    // Proxy traffic restarts the idle timer (activity is written by the daemon's 1 s tick).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before = now_ms();
    assert!(last_activity(&c, &id).await < before);
    let r = get_by_host(
        &d,
        &id,
        FILE_PORT,
        "/",
        &[("e2b-traffic-access-token", &traffic)],
    )
    .await;
    assert_eq!(r.status(), 200);
    let mut seen = 0;
    for _ in 0..100 {
        seen = last_activity(&c, &id).await;
        if seen >= before {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(seen >= before, "last activity {seen} < {before}");

    // A paused sandbox: a request without a credential does not wake it; one with the
    // token does, and reaches the (thawed) server.
    assert_eq!(c.pause(&id).await.unwrap().state, "paused");
    let r = get_by_host(&d, &id, FILE_PORT, "/", &[]).await;
    assert_eq!(r.status(), 401);
    assert_eq!(state_of(&c, &id).await, "paused");
    let r = get_by_host(
        &d,
        &id,
        FILE_PORT,
        "/index.html",
        &[("e2b-traffic-access-token", &traffic)],
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.unwrap(), MARKER);
    assert_eq!(state_of(&c, &id).await, "running");

    // A hibernated one wakes on envd traffic, with the same tokens as before.
    assert_eq!(c.hibernate(&id).await.unwrap().state, "hibernated");
    let (status, v) = envd_unary(
        &d,
        &id,
        "filesystem.Filesystem/Stat",
        serde_json::json!({"path": "/tmp/www/index.html"}),
        Some(&envd),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["entry"]["name"], "index.html");
    assert_eq!(state_of(&c, &id).await, "running");
    let again = c.get_sandbox(&id).await.unwrap();
    assert_eq!(again.envd_access_token, Some(envd.clone()));
    assert_eq!(again.traffic_access_token, Some(traffic.clone()));

    // Without auto_resume a paused sandbox stays paused and says so.
    let still = create(
        &c,
        CreateSandboxRequest {
            auto_resume: Some(false),
            ..Default::default()
        },
    )
    .await;
    c.pause(&still.id).await.unwrap();
    let (status, v) = envd_unary(
        &d,
        &still.id,
        "filesystem.Filesystem/Stat",
        serde_json::json!({"path": "/"}),
        still.envd_access_token.as_deref(),
    )
    .await;
    assert_eq!(status, 502, "{v}");
    assert!(v["message"].as_str().unwrap().contains("paused"), "{v}");
    assert_eq!(state_of(&c, &still.id).await, "paused");

    // A fork gets tokens of its own and its source's exposure.
    let forks = c
        .fork(&id, &sandpit_api::ForkRequest::default())
        .await
        .unwrap();
    let f = &forks[0];
    assert!(f.secure && !f.public);
    assert!(f.envd_access_token.is_some() && f.envd_access_token != Some(envd.clone()));
    assert!(f.traffic_access_token.is_some() && f.traffic_access_token != Some(traffic.clone()));
    let (status, _) = envd_unary(
        &d,
        &f.id,
        "filesystem.Filesystem/Stat",
        serde_json::json!({"path": "/"}),
        Some(&envd),
    )
    .await;
    assert_eq!(status, 403);
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2c_reaches_ports_envd_and_the_api() {
    let d = Daemon::start().await;
    let c = d.client();
    let sb = create(&c, CreateSandboxRequest::default()).await;
    let id = sb.id.clone();
    let traffic = sb.traffic_access_token.clone().unwrap();
    let envd = sb.envd_access_token.clone().unwrap();
    start_servers(&c, &id).await;

    // HTTP/2 with prior knowledge on the daemon's one port.
    let mut send = sandpit_tests::h2_connect(d.port).await;
    // A port by host name (HTTP/2 carries it as the authority).
    let req = http::Request::get(format!(
        "http://{}/index.html",
        port_host(&d, FILE_PORT, &id)
    ))
    .header("e2b-traffic-access-token", &traffic)
    .body(Empty::<Bytes>::new().map_err(|e| match e {}).boxed())
    .unwrap();
    let resp = send.send_request(req).await.unwrap();
    assert_eq!(resp.version(), http::Version::HTTP_2);
    assert_eq!(resp.status(), 200);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, MARKER.as_bytes());
    // envd, by E2B's headers, Connect unary over the same HTTP/2 connection.
    let req = http::Request::post(format!(
        "http://127.0.0.1:{}/filesystem.Filesystem/Stat",
        d.port
    ))
    .header("e2b-sandbox-id", &id)
    .header("e2b-sandbox-port", "49983")
    .header("x-access-token", &envd)
    .header("content-type", "application/json")
    .header("connect-protocol-version", "1")
    .body(
        Full::new(Bytes::from(r#"{"path":"/tmp/www"}"#))
            .map_err(|e| match e {})
            .boxed(),
    )
    .unwrap();
    let resp = send.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["entry"]["name"], "www");
    // The REST API over HTTP/2 too.
    let req = http::Request::get(format!("http://127.0.0.1:{}/v1/health", d.port))
        .body(Empty::<Bytes>::new().map_err(|e| match e {}).boxed())
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_runtime_ports_are_on_the_host_loopback() {
    let d = Daemon::builder()
        .args(&["--allow-process-runtime"])
        .start()
        .await;
    let c = d.client();
    let sb = create(
        &c,
        CreateSandboxRequest {
            runtime: Some("process".into()),
            // Asked for, but never granted to a sandbox on the host's own network.
            public: Some(true),
            secure: Some(false),
            ..Default::default()
        },
    )
    .await;
    assert!(sb.secure && !sb.public, "{sb:?}");
    let port = free_port();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("index.html"), MARKER).unwrap();
    let req = RunCommandRequest {
        argv: vec![
            "python3".into(),
            "-m".into(),
            "http.server".into(),
            port.to_string(),
            "--bind".into(),
            "127.0.0.1".into(),
            "--directory".into(),
            dir.path().to_string_lossy().into_owned(),
        ],
        ..Default::default()
    };
    c.run_background(&sb.id, &req).await.unwrap();
    wait_listening(&c, &sb.id, port).await;
    let r = get_by_host(&d, &sb.id, port, "/index.html", &[]).await;
    assert_eq!(r.status(), 401);
    let (status, _) = envd_unary(
        &d,
        &sb.id,
        "filesystem.Filesystem/Stat",
        serde_json::json!({"path": "/"}),
        None,
    )
    .await;
    assert_eq!(status, 401);
    let r = get_by_host(
        &d,
        &sb.id,
        port,
        "/index.html",
        &[(
            "e2b-traffic-access-token",
            sb.traffic_access_token.as_deref().unwrap(),
        )],
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.unwrap(), MARKER);
    d.shutdown().await;
}
