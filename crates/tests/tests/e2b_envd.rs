//! envd's `/files` and filesystem service as E2B's SDKs reach them through the daemon's
//! ingress (the header form), at the HTTP level where a client can send what the SDKs
//! never would: gzip uploads and a gzip bomb against a small disk, `/proc` reads,
//! `Accept-Encoding`, and file metadata with names and sizes past envd's limits, through
//! symlinks and on files the user may not read. The SDK's own view of the same
//! behaviours is in `tests/e2b/python/test_envd_compat.py`.

use base64::Engine;
use reqwest::StatusCode;
use sandpit_api::{CreateSandboxRequest, LimitsSpec};
use sandpit_tests::{Daemon, http, sh, sh_root};
use serde_json::{Value, json};
use std::io::Write;

/// A sandbox reached through the ingress as E2B's SDK reaches envd.
struct Envd<'a> {
    d: &'a Daemon,
    id: String,
    token: String,
}

impl Envd<'_> {
    fn req(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        http()
            .request(method, format!("{}{path}", self.d.url))
            .header("e2b-sandbox-id", &self.id)
            .header("e2b-sandbox-port", "49983")
            .header("x-access-token", &self.token)
            .header(
                "authorization",
                format!(
                    "Basic {}",
                    base64::engine::general_purpose::STANDARD.encode("user:")
                ),
            )
    }

    fn files_url(path: &str) -> String {
        let mut s = form_encode(path);
        s.insert_str(0, "/files?path=");
        s
    }

    async fn upload(
        &self,
        path: &str,
        headers: &[(&str, &[u8])],
        body: Vec<u8>,
    ) -> (StatusCode, Value) {
        let mut r = self
            .req(reqwest::Method::POST, &Self::files_url(path))
            .header("content-type", "application/octet-stream");
        for (k, v) in headers {
            r = r.header(*k, reqwest::header::HeaderValue::from_bytes(v).unwrap());
        }
        let resp = r.body(body).send().await.expect("upload");
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    async fn download(&self, path: &str, accept: Option<&str>) -> reqwest::Response {
        let mut r = self.req(reqwest::Method::GET, &Self::files_url(path));
        if let Some(a) = accept {
            r = r.header("accept-encoding", a);
        }
        r.send().await.expect("download")
    }

    /// A unary Connect call in JSON: the status and the body.
    async fn unary(&self, method: &str, body: Value) -> (StatusCode, Value) {
        let resp = self
            .req(reqwest::Method::POST, &format!("/{method}"))
            .header("content-type", "application/json")
            .header("connect-protocol-version", "1")
            .body(body.to_string())
            .send()
            .await
            .expect("connect call");
        let status = resp.status();
        (status, resp.json().await.unwrap_or(Value::Null))
    }

    async fn stat(&self, path: &str) -> (StatusCode, Value) {
        self.unary("filesystem.Filesystem/Stat", json!({ "path": path }))
            .await
    }
}

fn form_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'/' | b'~' => {
                char::from(b).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn gz(data: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

fn gunzip(data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    std::io::Read::read_to_end(&mut flate2::read::MultiGzDecoder::new(data), &mut out).unwrap();
    out
}

/// Peak resident memory of a process, in bytes.
fn peak_rss(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap()
        * 1024
}

async fn sandbox(d: &Daemon, disk_bytes: Option<u64>) -> Envd<'_> {
    sandbox_in(d, disk_bytes, None).await
}

async fn sandbox_in<'a>(d: &'a Daemon, disk_bytes: Option<u64>, runtime: Option<&str>) -> Envd<'a> {
    let c = d.client();
    let sb = c
        .create_sandbox(&CreateSandboxRequest {
            limits: LimitsSpec {
                disk_bytes,
                ..Default::default()
            },
            runtime: runtime.map(str::to_string),
            timeout: Some(600),
            ..Default::default()
        })
        .await
        .expect("create");
    Envd {
        d,
        token: sb.envd_access_token.clone().expect("envd token"),
        id: sb.id,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gzip_uploads_are_decoded_a_bomb_stops_at_the_disk_limit_and_proc_files_stream() {
    let d = Daemon::start().await;
    let e = sandbox(&d, Some(32 << 20)).await;
    let c = d.client();
    let text = b"plain on disk\n".repeat(1000);

    // A raw body, gzip-encoded: stored decoded.
    let (s, v) = e
        .upload("gz.txt", &[("content-encoding", b"gzip")], gz(&text))
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v[0]["path"], "/home/user/gz.txt", "{v}");
    let out = sh(
        &c,
        &e.id,
        "md5sum < /home/user/gz.txt; stat -c %s /home/user/gz.txt",
    )
    .await;
    let want = md5_of(&text);
    assert!(out.stdout.starts_with(&want), "{} vs {want}", out.stdout);
    assert!(
        out.stdout.ends_with(&format!("{}\n", text.len())),
        "{}",
        out.stdout
    );

    // A multipart body, gzip-encoded as a whole (as envd decodes it).
    let boundary = "XyZ";
    let mut mp = Vec::new();
    mp.extend_from_slice(format!("--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"m.txt\"\r\nContent-Type: application/octet-stream\r\n\r\n").as_bytes());
    mp.extend_from_slice(b"multipart content");
    mp.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    let resp = e
        .req(reqwest::Method::POST, &Envd::files_url("/home/user/m.txt"))
        .header(
            "content-type",
            format!("multipart/form-data; boundary={boundary}"),
        )
        .header("content-encoding", "gzip")
        .body(gz(&mp))
        .send()
        .await
        .unwrap();
    assert_eq!(
        resp.status(),
        StatusCode::OK,
        "{}",
        resp.text().await.unwrap()
    );
    assert_eq!(
        sh(&c, &e.id, "cat /home/user/m.txt").await.stdout,
        "multipart content"
    );

    // Not gzip, a coding envd does not speak: 400, and no file is left behind.
    let (s, v) = e
        .upload(
            "bad.txt",
            &[("content-encoding", b"gzip")],
            b"not gzip".to_vec(),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert!(
        v["message"].as_str().unwrap_or("").contains("decompress"),
        "{v}"
    );
    let (s, v) = e
        .upload("br.txt", &[("content-encoding", b"br")], b"x".to_vec())
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    let out = sh(
        &c,
        &e.id,
        "ls /home/user/bad.txt /home/user/br.txt 2>&1; true",
    )
    .await;
    assert!(
        out.stdout.matches("No such file").count() == 2,
        "{}",
        out.stdout
    );

    // A bomb: 1 GiB of zeros in about 1 MiB, against a 32 MiB disk. It ends in a full
    // disk (507), in bounded time, without the daemon or the agent holding it in memory.
    let daemon_before = peak_rss(d.pid());
    let member = gz(&vec![0u8; 1 << 20]);
    let bomb: Vec<u8> = member
        .iter()
        .copied()
        .cycle()
        .take(member.len() * 1024)
        .collect();
    assert!(bomb.len() < 2 << 20);
    let started = std::time::Instant::now();
    let (s, v) = e
        .upload("bomb.bin", &[("content-encoding", b"gzip")], bomb)
        .await;
    assert_eq!(s, StatusCode::INSUFFICIENT_STORAGE, "{v}");
    assert!(started.elapsed() < std::time::Duration::from_secs(60));
    let agent = d.agent_pid(&e.id).await as u32;
    assert!(peak_rss(agent) < 96 << 20, "agent peak {}", peak_rss(agent));
    let grew = peak_rss(d.pid()).saturating_sub(daemon_before);
    assert!(grew < 64 << 20, "daemon grew by {grew}");
    // The sandbox's disk ended it: the file stopped at the limit, not at 1 GiB.
    let out = sh(&c, &e.id, "stat -c %s /home/user/bomb.bin").await;
    let size: u64 = out.stdout.trim().parse().unwrap();
    assert!(size <= 32 << 20, "{size}");
    // The sandbox goes on: the space comes back and a new upload works.
    let (s, _) = e
        .unary(
            "filesystem.Filesystem/Remove",
            json!({"path": "/home/user/bomb.bin"}),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    let (s, v) = e
        .upload("after.txt", &[("content-encoding", b"gzip")], gz(b"fine"))
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");

    // Downloads: gzip when asked, plain otherwise, 406 when nothing acceptable is left.
    let r = e.download("/home/user/gz.txt", Some("gzip")).await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.headers()["content-encoding"], "gzip");
    assert_eq!(gunzip(&r.bytes().await.unwrap()), text);
    let r = e
        .download("/home/user/gz.txt", Some("br;q=1, gzip;q=0"))
        .await;
    assert!(r.headers().get("content-encoding").is_none());
    assert_eq!(r.headers()["content-length"], text.len().to_string());
    assert_eq!(r.bytes().await.unwrap().as_ref(), text.as_slice());
    let r = e
        .download("/home/user/gz.txt", Some("br, identity;q=0"))
        .await;
    assert_eq!(r.status(), StatusCode::NOT_ACCEPTABLE);

    // /proc files report a size of 0 and are read to their end.
    let r = e.download("/proc/self/status", None).await;
    assert_eq!(r.status(), StatusCode::OK);
    let body = r.text().await.unwrap();
    assert!(body.contains("Name:") && body.contains("Pid:"), "{body}");
    let r = e.download("/proc/version", Some("gzip")).await;
    let body = gunzip(&r.bytes().await.unwrap());
    assert!(body.starts_with(b"Linux version"));
    d.shutdown().await;
}

/// The process runtime has no disk of its own: its limit is RLIMIT_FSIZE on the agent,
/// and a write past it must fail (507), not kill the agent with SIGXFSZ.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_the_process_runtime_a_bomb_ends_at_the_file_size_limit_and_the_agent_lives() {
    let d = Daemon::builder()
        .args(&["--allow-process-runtime"])
        .start()
        .await;
    let e = sandbox_in(&d, Some(16 << 20), Some("process")).await;
    let member = gz(&vec![0u8; 1 << 20]);
    let bomb: Vec<u8> = member
        .iter()
        .copied()
        .cycle()
        .take(member.len() * 256)
        .collect();
    let (s, v) = e
        .upload("/tmp/bomb.bin", &[("content-encoding", b"gzip")], bomb)
        .await;
    assert_eq!(s, StatusCode::INSUFFICIENT_STORAGE, "{v}");
    let (s, v) = e.stat("/tmp/bomb.bin").await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let size: u64 = v["entry"]["size"].as_str().unwrap_or("0").parse().unwrap();
    assert!(size <= 16 << 20, "{v}");
    // The agent is still there: it answers, and a normal upload works.
    let (s, v) = e
        .unary(
            "filesystem.Filesystem/Remove",
            json!({"path": "/tmp/bomb.bin"}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (s, v) = e
        .upload(
            "/tmp/small.txt",
            &[("content-encoding", b"gzip")],
            gz(b"ok"),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let r = e.download("/tmp/small.txt", None).await;
    assert_eq!(r.text().await.unwrap(), "ok");
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_stays_in_its_namespace_within_envd_limits_and_inside_the_sandbox() {
    let d = Daemon::start().await;
    let e = sandbox(&d, None).await;
    let c = d.client();
    let attrs = |p: &str| format!("python3 -c \"import os; print(sorted(os.listxattr('{p}')))\"");

    // Keys are lowercased and always land under user.e2b.: a key naming another
    // namespace is just a key.
    let (s, v) = e
        .upload(
            "m.txt",
            &[
                ("x-metadata-Author", b"mish"),
                ("x-metadata-trusted.evil", b"1"),
                ("x-metadata-security.selinux", b"2"),
            ],
            b"x".to_vec(),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let want = json!({"author": "mish", "trusted.evil": "1", "security.selinux": "2"});
    assert_eq!(v[0]["metadata"], want, "{v}");
    let out = sh(&c, &e.id, &attrs("/home/user/m.txt")).await;
    assert_eq!(
        out.stdout, "['user.e2b.author', 'user.e2b.security.selinux', 'user.e2b.trusted.evil']\n",
        "{}",
        out.stderr
    );
    let (s, v) = e.stat("/home/user/m.txt").await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["entry"]["metadata"], want, "{v}");
    // Kept across a move.
    let (s, v) = e
        .unary(
            "filesystem.Filesystem/Move",
            json!({"source": "/home/user/m.txt", "destination": "/home/user/sub/moved.txt"}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["entry"]["metadata"], want, "{v}");

    // Past envd's limits, or not printable ASCII: 400, and the file is not created.
    let long_key = format!("x-metadata-{}", "k".repeat(247));
    let big = "v".repeat(1000);
    let cases: Vec<Vec<(&str, &[u8])>> = vec![
        vec![(long_key.as_str(), b"v")],
        vec![
            ("x-metadata-a", big.as_bytes()),
            ("x-metadata-b", big.as_bytes()),
            ("x-metadata-c", big.as_bytes()),
            ("x-metadata-d", big.as_bytes()),
            ("x-metadata-e", big.as_bytes()),
        ],
        vec![("x-metadata-k", b"caf\xc3\xa9")],
        vec![("x-metadata-k", b"tab\tbed")],
    ];
    for headers in cases {
        let (s, v) = e.upload("refused.txt", &headers, b"x".to_vec()).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
        assert!(
            v["message"]
                .as_str()
                .unwrap_or("")
                .contains("invalid metadata"),
            "{v}"
        );
    }
    let (s, _) = e.stat("/home/user/refused.txt").await;
    assert_eq!(s, StatusCode::NOT_FOUND);

    // Through a symlink: the metadata lands on the target, and the link reports it.
    let out = sh(
        &c,
        &e.id,
        "echo t > /home/user/target.txt && ln -s target.txt /home/user/link",
    )
    .await;
    assert_eq!(out.exit_code, 0, "{}", out.stderr);
    let (s, v) = e
        .upload("link", &[("x-metadata-via", b"link")], b"y".to_vec())
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let out = sh(&c, &e.id, &attrs("/home/user/target.txt")).await;
    assert_eq!(out.stdout, "['user.e2b.via']\n", "{}", out.stderr);
    let (_, v) = e.stat("/home/user/link").await;
    assert_eq!(v["entry"]["metadata"], json!({"via": "link"}), "{v}");

    // Set inside the sandbox: reported, except what is not UTF-8 and other user.*
    // attributes; a large value does not break the answer.
    let out = sh(
        &c,
        &e.id,
        "python3 -c \"import os; p='/home/user/target.txt'; os.setxattr(p,'user.e2b.big',b'v'*60000); \
         os.setxattr(p,'user.e2b.bin',b'\\xff\\xfe'); os.setxattr(p,'user.other',b'no')\"",
    )
    .await;
    assert_eq!(out.exit_code, 0, "{}", out.stderr);
    let (s, v) = e.stat("/home/user/target.txt").await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let md = v["entry"]["metadata"].as_object().unwrap();
    let mut keys: Vec<&String> = md.keys().collect();
    keys.sort();
    assert_eq!(keys, ["big", "via"], "{v}");
    assert_eq!(md["big"].as_str().unwrap().len(), 60000);
    // An overwrite without metadata clears what an upload or the sandbox had set.
    let (s, v) = e.upload("target.txt", &[], b"z".to_vec()).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert!(v[0].get("metadata").is_none(), "{v}");
    let out = sh(&c, &e.id, &attrs("/home/user/target.txt")).await;
    assert_eq!(out.stdout, "['user.other']\n", "{}", out.stderr);

    // A file the user may not read: its metadata is not revealed to the user, and the
    // stat still answers.
    let out = sh_root(
        &c,
        &e.id,
        "echo s > /tmp/secret && chmod 600 /tmp/secret && \
         python3 -c \"import os; os.setxattr('/tmp/secret','user.e2b.secret',b'root only')\"",
    )
    .await;
    assert_eq!(out.exit_code, 0, "{}", out.stderr);
    let (s, v) = e.stat("/tmp/secret").await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert!(v["entry"].get("metadata").is_none(), "{v}");
    d.shutdown().await;
}

/// What the host's `md5sum` prints for `data` (compared with the sandbox's own).
fn md5_of(data: &[u8]) -> String {
    let out = std::process::Command::new("md5sum")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut ch| {
            ch.stdin.take().unwrap().write_all(data)?;
            ch.wait_with_output()
        })
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}
