//! The credential broker's interceptor on loopback, without the egress proxy: a test HTTPS
//! upstream with its own test CA, `Broker::serve` on one end of a TCP pair standing in for
//! the sandbox's connection, and a client on the other end that trusts the sandbox's CA.

use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use rcgen::{CertificateParams, IsCa, Issuer, KeyPair};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use sandpit_api::secrets::{CreateSecretRequest, InjectSpec};
use sandpit_broker::{Broker, BrokerConfig};
use sandpit_net::intercept::{Carried, Destination, Interceptor, Outbound};
use sandpit_store::{SandboxRecord, SandboxState, Store};
use std::net::SocketAddr;
use std::sync::Arc;

const VALUE: &str = "ghp_TopSecretValue_0123456789";
const TOKEN_VALUE: &str = "tok_AnotherSecret_9876543210";
const KEY: [u8; 32] = [42; 32];

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// What the upstream saw of one request.
#[derive(Debug, Clone)]
struct Seen {
    method: Method,
    path: String,
    headers: HeaderMap,
}

/// An HTTPS server for `names` with a test CA, answering every request with its headers
/// (an echo, as some real APIs give) and recording what it saw.
struct Upstream {
    addr: SocketAddr,
    ca_file: tempfile::NamedTempFile,
    seen: Arc<Mutex<Vec<Seen>>>,
}

async fn upstream(names: &[&str]) -> Upstream {
    upstream_with(names, true).await
}

/// Echoes the headers of `req` (and, for an upgrade, every byte sent after the 101).
async fn echo(
    mut req: Request<hyper::body::Incoming>,
    log: Arc<Mutex<Vec<Seen>>>,
) -> Result<http::Response<Full<Bytes>>, std::convert::Infallible> {
    let mut echo = serde_json::Map::new();
    for (k, v) in req.headers() {
        echo.insert(
            k.to_string(),
            String::from_utf8_lossy(v.as_bytes()).into_owned().into(),
        );
    }
    log.lock().push(Seen {
        method: req.method().clone(),
        path: req.uri().path().to_string(),
        headers: req.headers().clone(),
    });
    if req.headers().contains_key("upgrade") {
        let on = hyper::upgrade::on(&mut req);
        tokio::spawn(async move {
            if let Ok(up) = on.await {
                let (mut r, mut w) = tokio::io::split(TokioIo::new(up));
                let _ = tokio::io::copy(&mut r, &mut w).await;
            }
        });
        let mut resp = http::Response::new(Full::new(Bytes::new()));
        *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
        resp.headers_mut()
            .insert("connection", http::HeaderValue::from_static("upgrade"));
        resp.headers_mut()
            .insert("upgrade", http::HeaderValue::from_static("echo"));
        return Ok(resp);
    }
    let body = serde_json::Value::Object(echo).to_string();
    let mut resp = http::Response::new(Full::new(Bytes::from(body)));
    // Echoed in a response header too.
    if let Some(a) = req.headers().get("authorization") {
        resp.headers_mut().insert("x-echo-auth", a.clone());
    }
    Ok(resp)
}

/// An upstream over TLS (`tls`) or plain HTTP.
async fn upstream_with(names: &[&str], tls: bool) -> Upstream {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    let leaf_key = KeyPair::generate().unwrap();
    let leaf_params =
        CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).unwrap();
    let leaf = leaf_params.signed_by(&leaf_key, &issuer).unwrap();
    let ca_file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(ca_file.path(), ca_cert.pem()).unwrap();
    let cfg = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![leaf.der().clone()],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(leaf_key.serialize_der())),
        )
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
    let log = seen.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let (acceptor, log) = (acceptor.clone(), log.clone());
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req| echo(req, log.clone()));
                let builder = hyper::server::conn::http1::Builder::new();
                if tls {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let _ = builder
                        .serve_connection(TokioIo::new(tls), svc)
                        .with_upgrades()
                        .await;
                } else {
                    let _ = builder
                        .serve_connection(TokioIo::new(tcp), svc)
                        .with_upgrades()
                        .await;
                }
            });
        }
    });
    Upstream {
        addr,
        ca_file,
        seen,
    }
}

async fn sandbox(store: &Store, id: &str, owner: &str) {
    let rec = SandboxRecord {
        id: id.into(),
        owner: owner.into(),
        template: "host".into(),
        runtime: "container".into(),
        state: SandboxState::Running,
        cpu_millis: 1000,
        memory_bytes: 1 << 28,
        disk_bytes: 1 << 28,
        max_processes: 64,
        env: Default::default(),
        secret_env: Default::default(),
        metadata: Default::default(),
        created_at_ms: 0,
        updated_at_ms: 0,
        expires_at_ms: i64::MAX,
        runtime_state: serde_json::Value::Null,
        error: None,
        version: 0,
        pool: None,
        life: Default::default(),
    };
    store.insert_sandbox(&rec).await.unwrap();
}

fn secret(name: &str, value: &str, inject: InjectSpec) -> CreateSecretRequest {
    CreateSecretRequest {
        name: name.into(),
        value: value.into(),
        hosts: vec!["api.test".into()],
        methods: vec!["GET".into(), "POST".into()],
        path_prefixes: vec!["/repos".into()],
        ttl_secs: Some(3600),
        inject,
        ..Default::default()
    }
}

fn bearer() -> InjectSpec {
    InjectSpec::Header {
        name: "Authorization".into(),
        format: "Bearer {value}".into(),
    }
}

async fn broker_with(store: &Store, extra_ca: Option<&std::path::Path>) -> Broker {
    let cfg = BrokerConfig {
        key_file: None,
        extra_ca_file: extra_ca.map(|p| p.to_path_buf()),
    };
    Broker::with_key(&cfg, store.clone(), Some(&KEY))
        .await
        .unwrap()
}

fn outbound(sandbox: &str, host: &str, tls: bool) -> Outbound {
    Outbound {
        sandbox_id: sandbox.into(),
        host: host.into(),
        port: 443,
        tls,
    }
}

/// The sandbox side of one intercepted connection.
struct Client {
    sender: hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    served: tokio::task::JoinHandle<std::io::Result<Carried>>,
}

/// Opens a connection from a "sandbox" that trusts `ca_pem`, served by the broker, to an
/// upstream the proxy found to be an address of the connection's host.
async fn connect(
    broker: &Broker,
    conn: Outbound,
    upstream: SocketAddr,
    ca_pem: &str,
) -> Result<Client, String> {
    let dest = Destination {
        addr: upstream,
        resolved: true,
    };
    connect_to(broker, conn, dest, ca_pem).await
}

/// [`connect`] to a destination as given.
async fn connect_to(
    broker: &Broker,
    conn: Outbound,
    upstream: Destination,
    ca_pem: &str,
) -> Result<Client, String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (sandbox_side, accepted) =
        tokio::join!(tokio::net::TcpStream::connect(addr), listener.accept());
    let (broker_side, _) = accepted.unwrap();
    let host = conn.host.clone();
    let tls = conn.tls;
    let served = tokio::spawn(broker.serve(conn, Box::new(broker_side), upstream));
    if !tls {
        let (sender, conn) =
            hyper::client::conn::http1::handshake(TokioIo::new(sandbox_side.unwrap()))
                .await
                .map_err(|e| e.to_string())?;
        tokio::spawn(conn.with_upgrades());
        return Ok(Client { sender, served });
    }
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(ca_pem.as_bytes()).unwrap())
        .unwrap();
    let cfg = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tls = tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(ServerName::try_from(host).unwrap(), sandbox_side.unwrap())
        .await
        .map_err(|e| e.to_string())?;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn.with_upgrades());
    Ok(Client { sender, served })
}

impl Client {
    async fn send(
        &mut self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
    ) -> (StatusCode, HeaderMap, String) {
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header("host", "api.test");
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req.body(Full::new(Bytes::new())).unwrap();
        self.sender.ready().await.unwrap();
        let resp = self.sender.send_request(req).await.unwrap();
        let (parts, body) = resp.into_parts();
        let body = body.collect().await.unwrap().to_bytes();
        (
            parts.status,
            parts.headers,
            String::from_utf8_lossy(&body).into_owned(),
        )
    }

    async fn close(self) -> Carried {
        drop(self.sender);
        self.served.await.unwrap().unwrap()
    }
}

fn refusal(body: &str) -> serde_json::Value {
    serde_json::from_str(body).unwrap_or_else(|_| panic!("not JSON: {body}"))
}

fn assert_no_secret(what: &str, text: &str) {
    assert!(!text.contains(VALUE), "{what} holds the secret: {text}");
    assert!(
        !text.contains(TOKEN_VALUE),
        "{what} holds the secret: {text}"
    );
}

#[tokio::test]
async fn credentials_go_in_for_matching_requests_and_never_back_out() {
    let up = upstream(&["api.test", "other.test"]).await;
    let store = Store::open_in_memory().await.unwrap();
    sandbox(&store, "sbx1", "alice").await;
    sandbox(&store, "sbx2", "alice").await;
    let broker = broker_with(&store, Some(up.ca_file.path())).await;
    broker
        .create_secret("alice", &secret("gh", VALUE, bearer()))
        .await
        .unwrap();
    let mut tok = secret("tok", TOKEN_VALUE, InjectSpec::Placeholder);
    tok.path_prefixes = vec![];
    broker.create_secret("alice", &tok).await.unwrap();
    broker
        .attach("sbx1", "alice", &["gh".into(), "tok".into()])
        .await
        .unwrap();

    // Only bound hosts of sandboxes with secrets are wanted; plain HTTP only if allowed.
    assert!(broker.wants(&outbound("sbx1", "api.test", true)));
    assert!(broker.wants(&outbound("sbx1", "API.test.", true)));
    assert!(!broker.wants(&outbound("sbx1", "other.test", true)));
    assert!(!broker.wants(&outbound("sbx1", "api.test", false)));
    assert!(!broker.wants(&outbound("sbx2", "api.test", true)));
    assert!(!broker.wants(&outbound("nope", "api.test", true)));

    let ca = broker.ca_pem("sbx1").unwrap();
    let mut c = connect(&broker, outbound("sbx1", "api.test", true), up.addr, &ca)
        .await
        .unwrap();

    // Matching host, method and path: the header goes in, and the echo comes back masked.
    let (status, headers, body) = c
        .send(Method::GET, "/repos/x", &[("authorization", "Bearer fake")])
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let seen = up.seen.lock().last().cloned().unwrap();
    assert_eq!(seen.method, Method::GET);
    assert_eq!(seen.path, "/repos/x");
    assert_eq!(
        seen.headers.get("authorization").unwrap(),
        &format!("Bearer {VALUE}")
    );
    assert_eq!(seen.headers.get_all("authorization").iter().count(), 1);
    assert_no_secret("response body", &body);
    assert!(body.contains("Bearer ****"), "{body}");
    let echoed = headers.get("x-echo-auth").unwrap().to_str().unwrap();
    assert_no_secret("response header", echoed);
    let seen_before = up.seen.lock().len();

    // Wrong method, wrong path, path tricks: 403 saying what did not match, nothing sent.
    for (method, path, reason) in [
        (Method::DELETE, "/repos/x", "method"),
        (Method::GET, "/admin", "path"),
        (Method::GET, "/repos/../admin", "path"),
        (Method::GET, "/repos/%2e%2e/admin", "path"),
    ] {
        let (status, headers, body) = c.send(method.clone(), path, &[]).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{method} {path}: {body}");
        assert_eq!(headers.get("x-sandpit-broker").unwrap(), "refused");
        let r = refusal(&body);
        assert_eq!(r["code"], "credential_refused");
        assert_eq!(r["reason"], reason, "{body}");
        assert_eq!(r["secret"], "gh");
        assert!(r["message"].as_str().unwrap().contains(method.as_str()) || reason == "path");
        assert_no_secret("refusal", &body);
    }
    assert_eq!(up.seen.lock().len(), seen_before);

    // A placeholder in a header is replaced with the secret.
    let (status, _, body) = c
        .send(
            Method::POST,
            "/repos/y",
            &[("x-api-key", "key=SANDPIT_SECRET_tok;v=1")],
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let seen = up.seen.lock().last().cloned().unwrap();
    assert_eq!(
        seen.headers.get("x-api-key").unwrap(),
        &format!("key={TOKEN_VALUE};v=1")
    );
    assert_no_secret("response body", &body);

    // The Host header must name the host the connection is to.
    let req = Request::builder()
        .method(Method::GET)
        .uri("/repos/x")
        .header("host", "evil.test")
        .body(Full::new(Bytes::new()))
        .unwrap();
    c.sender.ready().await.unwrap();
    let resp = c.sender.send_request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::FORBIDDEN);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(refusal(&String::from_utf8_lossy(&body))["reason"], "host");

    let (up_bytes, down_bytes) = c.close().await;
    assert!(up_bytes > 0 && down_bytes > 0, "{up_bytes} {down_bytes}");

    // Another sandbox's CA is not this sandbox's: the handshake fails.
    let other_ca = broker.ca_pem("sbx2").unwrap();
    assert_ne!(other_ca, ca);
    assert!(
        connect(
            &broker,
            outbound("sbx1", "api.test", true),
            up.addr,
            &other_ca
        )
        .await
        .is_err()
    );

    // Detached: no longer wanted.
    broker.attach("sbx1", "alice", &[]).await.unwrap();
    assert!(!broker.wants(&outbound("sbx1", "api.test", true)));
}

#[tokio::test]
async fn an_expired_secret_is_refused() {
    let up = upstream(&["api.test"]).await;
    let store = Store::open_in_memory().await.unwrap();
    sandbox(&store, "sbx1", "bob").await;
    let broker = broker_with(&store, Some(up.ca_file.path())).await;
    let mut s = secret("short", VALUE, bearer());
    s.ttl_secs = None;
    s.expires_at_ms = Some(sandpit_store::now_ms() + 1500);
    broker.create_secret("bob", &s).await.unwrap();
    broker
        .attach("sbx1", "bob", &["short".into()])
        .await
        .unwrap();
    let ca = broker.ca_pem("sbx1").unwrap();
    let mut c = connect(&broker, outbound("sbx1", "api.test", true), up.addr, &ca)
        .await
        .unwrap();
    let (status, _, body) = c.send(Method::GET, "/repos/a", &[]).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let before = up.seen.lock().len();
    // Past the expiry (on the same keep-alive connection): refused, not sent.
    let wait = s.expires_at_ms.unwrap() - sandpit_store::now_ms() + 50;
    tokio::time::sleep(std::time::Duration::from_millis(wait.max(0) as u64)).await;
    let (status, _, body) = c.send(Method::GET, "/repos/a", &[]).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
    let r = refusal(&body);
    assert_eq!(r["reason"], "expired");
    assert_eq!(r["secret"], "short");
    assert_no_secret("refusal", &body);
    assert_eq!(up.seen.lock().len(), before);
    c.close().await;
}

#[tokio::test]
async fn an_upstream_the_broker_cannot_verify_gets_no_credential() {
    // The broker trusts only the public roots, not the upstream's test CA.
    let up = upstream(&["api.test"]).await;
    let store = Store::open_in_memory().await.unwrap();
    sandbox(&store, "sbx1", "carol").await;
    let broker = broker_with(&store, None).await;
    broker
        .create_secret("carol", &secret("gh", VALUE, bearer()))
        .await
        .unwrap();
    broker
        .attach("sbx1", "carol", &["gh".into()])
        .await
        .unwrap();
    let ca = broker.ca_pem("sbx1").unwrap();
    let mut c = connect(&broker, outbound("sbx1", "api.test", true), up.addr, &ca)
        .await
        .unwrap();
    let (status, _, body) = c.send(Method::GET, "/repos/a", &[]).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY, "{body}");
    assert_eq!(refusal(&body)["code"], "upstream_unreachable");
    assert_no_secret("error", &body);
    assert!(up.seen.lock().is_empty());
    c.close().await;
}

#[tokio::test]
async fn without_a_key_nothing_is_stored_or_wanted() {
    let store = Store::open_in_memory().await.unwrap();
    sandbox(&store, "sbx1", "dave").await;
    let broker = Broker::with_key(&BrokerConfig::default(), store.clone(), None)
        .await
        .unwrap();
    assert!(!broker.enabled());
    let err = broker
        .create_secret("dave", &secret("gh", VALUE, bearer()))
        .await
        .unwrap_err();
    assert!(
        matches!(err, sandpit_broker::BrokerError::Disabled),
        "{err}"
    );
    assert!(err.to_string().contains("key"), "{err}");
    assert!(store.list_secrets(None).await.unwrap().is_empty());
    assert!(broker.ca_pem("sbx1").is_none());
    assert!(!broker.wants(&outbound("sbx1", "api.test", true)));
}

#[tokio::test]
async fn secrets_are_sealed_at_rest_and_survive_a_restart() {
    let up = upstream(&["api.test"]).await;
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("s.db");
    let store = Store::open(&db).await.unwrap();
    sandbox(&store, "sbx1", "erin").await;
    let broker = broker_with(&store, Some(up.ca_file.path())).await;
    let view = broker
        .create_secret("erin", &secret("gh", VALUE, bearer()))
        .await
        .unwrap();
    assert_no_secret("create answer", &serde_json::to_string(&view).unwrap());
    broker.attach("sbx1", "erin", &["gh".into()]).await.unwrap();
    let ca = broker.ca_pem("sbx1").unwrap();
    store.close().await;
    for f in std::fs::read_dir(dir.path()).unwrap() {
        let bytes = std::fs::read(f.unwrap().path()).unwrap();
        assert!(
            !bytes.windows(VALUE.len()).any(|w| w == VALUE.as_bytes()),
            "the value is in the database files in the clear"
        );
    }
    // A new daemon with the same key finds the secret and its attachment, and the
    // sandbox's CA (derived, never stored) is still the one it trusts.
    let store = Store::open(&db).await.unwrap();
    let again = broker_with(&store, Some(up.ca_file.path())).await;
    assert!(again.wants(&outbound("sbx1", "api.test", true)));
    assert_eq!(again.attached("sbx1").await.unwrap(), ["gh"]);
    let mut c = connect(&again, outbound("sbx1", "api.test", true), up.addr, &ca)
        .await
        .unwrap();
    let (status, _, body) = c.send(Method::GET, "/repos/a", &[]).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    c.close().await;
    // With another key the secret does not decrypt: refused, never sent without it.
    let other = Broker::with_key(
        &BrokerConfig {
            key_file: None,
            extra_ca_file: Some(up.ca_file.path().to_path_buf()),
        },
        store.clone(),
        Some(&[1; 32]),
    )
    .await
    .unwrap();
    let other_ca = other.ca_pem("sbx1").unwrap();
    assert_ne!(other_ca, ca);
    let before = up.seen.lock().len();
    let mut c = connect(
        &other,
        outbound("sbx1", "api.test", true),
        up.addr,
        &other_ca,
    )
    .await
    .unwrap();
    let (status, _, body) = c.send(Method::GET, "/repos/a", &[]).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
    assert_eq!(refusal(&body)["reason"], "unavailable");
    assert_eq!(up.seen.lock().len(), before);
    c.close().await;
}

#[tokio::test]
async fn plain_http_only_where_the_secret_allows_it() {
    let up = upstream_with(&["api.test"], false).await;
    let store = Store::open_in_memory().await.unwrap();
    sandbox(&store, "sbx1", "fay").await;
    let broker = broker_with(&store, None).await;
    let mut tok = secret("tok", TOKEN_VALUE, InjectSpec::Placeholder);
    tok.allow_http = true;
    broker.create_secret("fay", &tok).await.unwrap();
    broker
        .create_secret("fay", &secret("https-only", VALUE, bearer()))
        .await
        .unwrap();
    broker
        .attach("sbx1", "fay", &["tok".into(), "https-only".into()])
        .await
        .unwrap();
    assert!(broker.wants(&outbound("sbx1", "api.test", false)));
    let mut c = connect(&broker, outbound("sbx1", "api.test", false), up.addr, "")
        .await
        .unwrap();
    let (status, _, body) = c
        .send(
            Method::GET,
            "/repos/a",
            &[("x-api-key", "SANDPIT_SECRET_tok")],
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let seen = up.seen.lock().last().cloned().unwrap();
    assert_eq!(seen.headers.get("x-api-key").unwrap(), TOKEN_VALUE);
    // The HTTPS-only header secret is not sent over plain HTTP.
    assert!(seen.headers.get("authorization").is_none());
    assert_no_secret("response", &body);
    c.close().await;
}

#[tokio::test]
async fn an_upgraded_connection_carries_its_bytes_both_ways() {
    let up = upstream(&["api.test"]).await;
    let store = Store::open_in_memory().await.unwrap();
    sandbox(&store, "sbx1", "gus").await;
    let broker = broker_with(&store, Some(up.ca_file.path())).await;
    broker
        .create_secret("gus", &secret("gh", VALUE, bearer()))
        .await
        .unwrap();
    broker.attach("sbx1", "gus", &["gh".into()]).await.unwrap();
    let ca = broker.ca_pem("sbx1").unwrap();
    let mut c = connect(&broker, outbound("sbx1", "api.test", true), up.addr, &ca)
        .await
        .unwrap();
    let req = Request::builder()
        .method(Method::GET)
        .uri("/repos/socket")
        .header("host", "api.test")
        .header("connection", "upgrade")
        .header("upgrade", "echo")
        .body(Full::new(Bytes::new()))
        .unwrap();
    c.sender.ready().await.unwrap();
    let resp = c.sender.send_request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::SWITCHING_PROTOCOLS);
    let seen = up.seen.lock().last().cloned().unwrap();
    assert_eq!(
        seen.headers.get("authorization").unwrap(),
        &format!("Bearer {VALUE}")
    );
    let upgraded = hyper::upgrade::on(resp).await.unwrap();
    let mut io = TokioIo::new(upgraded);
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let payload = vec![7u8; 100_000];
    io.write_all(&payload).await.unwrap();
    let mut back = vec![0u8; payload.len()];
    io.read_exact(&mut back).await.unwrap();
    assert_eq!(back, payload);
    io.shutdown().await.unwrap();
    drop(io);
    let (up_bytes, down_bytes) = c.close().await;
    assert!(
        up_bytes > 100_000 && down_bytes > 100_000,
        "{up_bytes} {down_bytes}"
    );
}

#[tokio::test]
async fn no_credential_goes_to_an_address_the_host_does_not_resolve_to() {
    // The upstream's certificate is valid for the host and issued by a CA the broker
    // trusts: only the destination check stands between the credential and it.
    let up = upstream(&["api.test"]).await;
    let store = Store::open_in_memory().await.unwrap();
    sandbox(&store, "sbx1", "hal").await;
    let broker = broker_with(&store, Some(up.ca_file.path())).await;
    broker
        .create_secret("hal", &secret("gh", VALUE, bearer()))
        .await
        .unwrap();
    let mut tok = secret("tok", TOKEN_VALUE, InjectSpec::Placeholder);
    tok.allow_http = true;
    tok.path_prefixes = vec![];
    broker.create_secret("hal", &tok).await.unwrap();
    broker
        .attach("sbx1", "hal", &["gh".into(), "tok".into()])
        .await
        .unwrap();
    let ca = broker.ca_pem("sbx1").unwrap();
    let elsewhere = Destination {
        addr: up.addr,
        resolved: false,
    };
    let mut c = connect_to(&broker, outbound("sbx1", "api.test", true), elsewhere, &ca)
        .await
        .unwrap();
    for headers in [vec![], vec![("x-api-key", "SANDPIT_SECRET_tok")]] {
        let (status, _, body) = c.send(Method::GET, "/repos/a", &headers).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
        let r = refusal(&body);
        assert_eq!(r["code"], "credential_refused", "{r}");
        assert_eq!(r["reason"], "destination", "{r}");
        assert_no_secret("refusal", &body);
    }
    assert!(up.seen.lock().is_empty());
    assert_eq!(c.close().await, (0, 0));

    // Plain HTTP, and a request with nothing to put in: carried untouched.
    let plain = upstream_with(&["api.test"], false).await;
    broker.attach("sbx1", "hal", &["tok".into()]).await.unwrap();
    let elsewhere = Destination {
        addr: plain.addr,
        resolved: false,
    };
    let mut c = connect_to(&broker, outbound("sbx1", "api.test", false), elsewhere, "")
        .await
        .unwrap();
    let (status, _, body) = c
        .send(Method::GET, "/x", &[("x-api-key", "SANDPIT_SECRET_tok")])
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
    assert_eq!(refusal(&body)["reason"], "destination");
    let (status, _, body) = c.send(Method::GET, "/x", &[("x-api-key", "mine")]).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let seen = plain.seen.lock().clone();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0].headers.get("x-api-key").unwrap(), "mine");
    c.close().await;
}
