//! HTTPS with a generated test CA, in process and as the binary a namespace test runs.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName};
use sandpit_modelsim::{Config, ModelServer, Script, TestCa, TlsIdentity, Turn};
use serde_json::{Value, json};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::sync::Arc;

fn client_config(ca_pem: Option<&str>) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    if let Some(pem) = ca_pem {
        roots
            .add(CertificateDer::from_pem_slice(pem.as_bytes()).unwrap())
            .unwrap();
    }
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    Arc::new(
        rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth(),
    )
}

/// POSTs `body` to `path` over TLS to `addr` as `name`, trusting only `ca_pem`.
async fn post_tls(
    addr: SocketAddr,
    name: &str,
    ca_pem: Option<&str>,
    path: &str,
    body: &Value,
) -> Result<(u16, String), String> {
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    let connector = tokio_rustls::TlsConnector::from(client_config(ca_pem));
    let server_name = ServerName::try_from(name.to_string()).unwrap();
    let tls = connector
        .connect(server_name, tcp)
        .await
        .map_err(|e| e.to_string())?;
    assert_eq!(tls.get_ref().1.alpn_protocol(), None);
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let req = http::Request::post(path)
        .header("host", name)
        .header("x-api-key", "sk-tls")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let res = sender.send_request(req).await.map_err(|e| e.to_string())?;
    let status = res.status().as_u16();
    let bytes = res.into_body().collect().await.unwrap().to_bytes();
    Ok((status, String::from_utf8(bytes.to_vec()).unwrap()))
}

/// Joins the text and tool-input deltas of an Anthropic event stream.
fn joined_deltas(sse: &str) -> (String, String) {
    let (mut text, mut input) = (String::new(), String::new());
    for line in sse.lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        let v: Value = serde_json::from_str(data).unwrap();
        text.push_str(v["delta"]["text"].as_str().unwrap_or(""));
        input.push_str(v["delta"]["partial_json"].as_str().unwrap_or(""));
    }
    (text, input)
}

fn body() -> Value {
    json!({"model": "m", "max_tokens": 10, "stream": true,
           "tools": [{"name": "Bash", "input_schema": {"type": "object", "properties": {"command": {}}}}],
           "messages": [{"role": "user", "content": "hi"}]})
}

#[tokio::test]
async fn https_with_a_test_ca_is_trusted_by_that_ca_only() {
    let ca = TestCa::generate(&["127.0.0.1".into(), "model.test".into()]).unwrap();
    let script = Script::new().turn(Turn::text("over TLS"));
    let server = ModelServer::start(
        Config::new("127.0.0.1:0".parse().unwrap(), script).tls(ca.identity.clone()),
    )
    .await
    .unwrap();
    assert!(server.base_url().starts_with("https://127.0.0.1:"));
    let addr = server.local_addr();
    // Both the IP and the DNS name are in the leaf.
    for name in ["127.0.0.1", "model.test"] {
        let (status, text) = post_tls(addr, name, Some(&ca.ca_pem), "/v1/messages", &body())
            .await
            .unwrap();
        assert_eq!(status, 200);
        assert!(text.contains("event: message_stop"));
        assert_eq!(joined_deltas(&text).0, "over TLS");
    }
    let other = TestCa::generate(&["127.0.0.1".into()]).unwrap();
    let refused = post_tls(
        addr,
        "127.0.0.1",
        Some(&other.ca_pem),
        "/v1/messages",
        &body(),
    )
    .await;
    assert!(refused.is_err(), "another CA must not vouch for this leaf");
    let wrong_name = post_tls(
        addr,
        "elsewhere.test",
        Some(&ca.ca_pem),
        "/v1/messages",
        &body(),
    )
    .await;
    assert!(wrong_name.is_err());
    let reqs = server.requests();
    assert_eq!(reqs.len(), 2);
    assert_eq!(reqs[0].api_key(), Some("sk-tls"));
    assert_eq!(reqs[1].header("host"), Some("model.test"));
}

#[tokio::test]
async fn pem_files_written_by_the_test_ca_load_back_and_bad_ones_name_their_path() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::generate(&["localhost".into()]).unwrap();
    let files = ca.write_to(dir.path()).unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&files.key).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }
    let identity = TlsIdentity::from_files(&files.cert, &files.key).unwrap();
    let server = ModelServer::start(
        Config::new("127.0.0.1:0".parse().unwrap(), Script::new()).tls(identity),
    )
    .await
    .unwrap();
    let (status, _) = post_tls(
        server.local_addr(),
        "localhost",
        Some(&std::fs::read_to_string(&files.ca).unwrap()),
        "/v1/messages/count_tokens",
        &body(),
    )
    .await
    .unwrap();
    assert_eq!(status, 200);
    // A certificate file given as the key is refused, naming the file.
    let err = TlsIdentity::from_files(&files.cert, &files.cert).unwrap_err();
    assert!(err.to_string().contains("cert.pem"), "{err}");
    assert!(err.to_string().contains("private key"), "{err}");
    let missing = TlsIdentity::from_files(&dir.path().join("nope.pem"), &files.key).unwrap_err();
    assert!(missing.to_string().contains("nope.pem"));
}

/// Kills the child if the test fails before stopping it, so no server outlives the test.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// The binary as a namespace test runs it: generated CA, request log, SIGTERM to stop.
#[tokio::test]
async fn the_binary_serves_https_from_a_script_file_and_logs_requests() {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("s.json");
    std::fs::write(
        &script,
        r#"{"turns": [{"tool_calls": [{"name": "Bash", "arguments": {"command": "ls"}}]}]}"#,
    )
    .unwrap();
    let log = dir.path().join("requests.jsonl");
    let mut child = KillOnDrop(
        std::process::Command::new(env!("CARGO_BIN_EXE_sandpit-modelsim"))
            .args(["--listen", "127.0.0.1:0", "--script"])
            .arg(&script)
            .arg("--tls-generate")
            .arg(dir.path())
            .arg("--log")
            .arg(&log)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut line = String::new();
    BufReader::new(child.0.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let url = line
        .trim()
        .strip_prefix("sandpit-modelsim listening on https://")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"));
    let addr: SocketAddr = url.parse().unwrap();
    let ca = std::fs::read_to_string(dir.path().join("ca.pem")).unwrap();
    // With no --tls-name, the leaf is for the listen IP and localhost.
    let (status, text) = post_tls(
        addr,
        "127.0.0.1",
        Some(&ca),
        "/v1/messages?beta=true",
        &body(),
    )
    .await
    .unwrap();
    assert_eq!(status, 200);
    assert!(text.contains(r#""name":"Bash""#));
    assert_eq!(joined_deltas(&text).1, r#"{"command":"ls"}"#);
    let logged: Value = serde_json::from_str(
        std::fs::read_to_string(&log)
            .unwrap()
            .lines()
            .next()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(logged["headers"]["x-api-key"], "sk-tls");
    assert_eq!(logged["query"], "beta=true");
    assert_eq!(logged["turn"], 0);
    let pid = child.0.id().to_string();
    std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    let status = child.0.wait().unwrap();
    assert!(status.success(), "{status}");

    // A script that does not parse stops the binary with the file named.
    std::fs::write(&script, r#"{"turns": 3}"#).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sandpit-modelsim"))
        .args(["--listen", "127.0.0.1:0", "--script"])
        .arg(&script)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("s.json"), "{err}");
}
