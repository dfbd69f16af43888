//! E2B template builds against a real daemon, at the HTTP level the SDKs speak: a template
//! requested with `POST /v3/templates`, its COPY files uploaded to the signed URL the
//! daemon hands out, a build of RUN, COPY, ENV, USER and WORKDIR steps with start and
//! ready commands on a local OCI image, status with paged logs, tags, `fromTemplate`, and
//! sandboxes started from the result; unpullable images, bad steps and hostile upload
//! archives refused with clear errors. The SDK scenarios are in `e2b_sdk.rs`.

use reqwest::StatusCode;
use sandpit_api::RunCommandRequest;
use sandpit_tests::{Daemon, rootfs_with_programs, temp_dir};
use serde_json::{Value, json};
use std::path::Path;
use std::time::Duration;

struct E2b {
    http: reqwest::Client,
    url: String,
    key: String,
}

impl E2b {
    fn new(d: &Daemon, key: &str) -> Self {
        Self {
            http: sandpit_tests::http(),
            url: d.url.clone(),
            key: key.to_string(),
        }
    }

    async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> (u16, Value) {
        let mut req = self
            .http
            .request(method, format!("{}{path}", self.url))
            .header("X-API-Key", &self.key);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req.send().await.expect("request");
        let status = resp.status().as_u16();
        let text = resp.text().await.expect("body");
        let value = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON: {text}"))
        };
        (status, value)
    }

    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        self.call(reqwest::Method::POST, path, Some(body)).await
    }

    async fn get(&self, path: &str) -> (u16, Value) {
        self.call(reqwest::Method::GET, path, None).await
    }

    /// `POST /v3/templates`: (template id, build id).
    async fn request(&self, name: &str) -> (String, String) {
        let (s, v) = self
            .post(
                "/v3/templates",
                json!({"name": name, "cpuCount": 1, "memoryMB": 512}),
            )
            .await;
        assert_eq!(s, 202, "{v}");
        (
            v["templateID"].as_str().expect("templateID").to_string(),
            v["buildID"].as_str().expect("buildID").to_string(),
        )
    }

    /// Uploads a COPY step's tar through the URL the daemon gives; returns its hash.
    async fn upload(&self, template: &str, tar: &[u8]) -> String {
        use sha2::Digest;
        let hash = hex::encode(sha2::Sha256::digest(tar));
        let (s, v) = self
            .get(&format!("/templates/{template}/files/{hash}"))
            .await;
        assert_eq!(s, 201, "{v}");
        assert_eq!(v["present"], false, "{v}");
        let url = v["url"].as_str().expect("url").to_string();
        assert!(url.starts_with(&self.url), "{url}");
        // The SDK sends no API key with the upload: the URL's signature is the credential.
        let r = self
            .http
            .put(&url)
            .body(tar.to_vec())
            .send()
            .await
            .expect("upload");
        assert!(r.status().is_success(), "{}", r.status());
        let (_, v) = self
            .get(&format!("/templates/{template}/files/{hash}"))
            .await;
        assert_eq!(v["present"], true, "{v}");
        hash
    }

    /// Polls a build to its end, reading its log in pages; returns the last status and
    /// every log message.
    async fn wait(&self, template: &str, build: &str) -> (Value, Vec<String>) {
        let deadline = std::time::Instant::now() + Duration::from_secs(300);
        let mut offset = 0usize;
        let mut messages = Vec::new();
        loop {
            let (s, v) = self
                .get(&format!(
                    "/templates/{template}/builds/{build}/status?logsOffset={offset}"
                ))
                .await;
            assert_eq!(s, 200, "{v}");
            let entries = v["logEntries"].as_array().expect("logEntries").clone();
            assert!(entries.len() <= 100, "a page holds at most 100 entries");
            assert_eq!(entries.len(), v["logs"].as_array().map_or(0, Vec::len));
            offset += entries.len();
            messages.extend(
                entries
                    .iter()
                    .map(|e| e["message"].as_str().unwrap_or("").to_string()),
            );
            let status = v["status"].as_str().unwrap_or("").to_string();
            if (status == "ready" || status == "error") && entries.is_empty() {
                return (v, messages);
            }
            assert!(
                std::time::Instant::now() < deadline,
                "build {build} did not end: {v}"
            );
            if entries.is_empty() {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }

    async fn start(&self, template: &str, build: &str, spec: Value) -> (u16, Value) {
        self.post(&format!("/v2/templates/{template}/builds/{build}"), spec)
            .await
    }

    async fn sandbox(&self, template: &str) -> String {
        let (s, v) = self
            .post(
                "/v2/sandboxes",
                json!({"templateID": template, "timeout": 300}),
            )
            .await;
        assert_eq!(s, 201, "{v}");
        v["sandboxID"].as_str().expect("sandboxID").to_string()
    }
}

/// A root filesystem of host programs (a shell and what the build's COPY needs), as an OCI
/// image layout at `image`.
fn oci_image(image: &Path) {
    let root = temp_dir("sandpit-e2b-img-");
    rootfs_with_programs(
        root.path(),
        &[
            ("/bin/dash", "usr/bin/sh"),
            ("/bin/tar", "usr/bin/tar"),
            ("/bin/mkdir", "usr/bin/mkdir"),
            ("/bin/chown", "usr/bin/chown"),
            ("/bin/mktemp", "usr/bin/mktemp"),
            ("/usr/bin/dirname", "usr/bin/dirname"),
            ("/bin/rm", "usr/bin/rm"),
            ("/bin/mv", "usr/bin/mv"),
            ("/bin/rmdir", "usr/bin/rmdir"),
            ("/bin/cat", "usr/bin/cat"),
            ("/bin/readlink", "usr/bin/readlink"),
            ("/usr/bin/id", "usr/bin/id"),
            ("/usr/bin/stat", "usr/bin/stat"),
            ("/bin/touch", "usr/bin/touch"),
            ("/bin/pwd", "usr/bin/pwd"),
        ],
    );
    std::fs::create_dir_all(root.path().join("etc")).expect("etc");
    std::fs::write(root.path().join("etc/os-release"), "ID=tiny\n").expect("os-release");
    let mut b = tar::Builder::new(Vec::new());
    b.follow_symlinks(false);
    b.append_dir_all(".", root.path()).expect("layer");
    let layer = b.into_inner().expect("layer");
    let sha = |d: &[u8]| {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(d))
    };
    let blobs = image.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).expect("blobs");
    let blob = |media: &str, data: &[u8]| {
        let h = sha(data);
        std::fs::write(blobs.join(&h), data).expect("blob");
        json!({"mediaType": media, "digest": format!("sha256:{h}"), "size": data.len()})
    };
    let config = serde_json::to_vec(&json!({
        "architecture": "amd64", "os": "linux", "config": {},
        "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{}", sha(&layer))]},
    }))
    .expect("config");
    let cfg = blob("application/vnd.oci.image.config.v1+json", &config);
    let l = blob("application/vnd.oci.image.layer.v1.tar", &layer);
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": cfg, "layers": [l],
    }))
    .expect("manifest");
    let m = blob("application/vnd.oci.image.manifest.v1+json", &manifest);
    std::fs::write(
        image.join("oci-layout"),
        br#"{"imageLayoutVersion":"1.0.0"}"#,
    )
    .expect("oci");
    std::fs::write(
        image.join("index.json"),
        serde_json::to_vec(&json!({"schemaVersion": 2, "manifests": [m]})).expect("index"),
    )
    .expect("index");
}

enum Member<'a> {
    File(&'a str, &'a [u8], u32),
    Dir(&'a str),
    Symlink(&'a str, &'a str),
    /// A name written raw, past the `tar` crate's own checks, with a type and a declared size.
    Raw(&'a str, tar::EntryType, u64),
}

fn context(members: &[Member<'_>]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for m in members {
        let mut h = tar::Header::new_gnu();
        let (name, data, kind, mode, link, size): (&str, &[u8], _, u32, Option<&str>, u64) = match m
        {
            Member::File(n, d, mode) => {
                (n, d, tar::EntryType::Regular, *mode, None, d.len() as u64)
            }
            Member::Dir(n) => (n, b"", tar::EntryType::Directory, 0o755, None, 0),
            Member::Symlink(n, t) => (n, b"", tar::EntryType::Symlink, 0o777, Some(t), 0),
            Member::Raw(n, k, size) => (n, b"", *k, 0o644, None, *size),
        };
        h.as_gnu_mut().expect("gnu").name[..name.len()].copy_from_slice(name.as_bytes());
        if let Some(t) = link {
            h.as_gnu_mut().expect("gnu").linkname[..t.len()].copy_from_slice(t.as_bytes());
        }
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_size(size);
        h.set_mtime(1_700_000_000);
        h.set_cksum();
        b.append(&h, data).expect("member");
    }
    b.into_inner().expect("tar")
}

fn sh(script: &str) -> RunCommandRequest {
    RunCommandRequest {
        argv: vec!["/bin/sh".into(), "-c".into(), script.into()],
        ..Default::default()
    }
}

/// Sandboxes of the admin that are not stopped (a build's own must be gone).
async fn live_sandboxes(d: &Daemon) -> Vec<String> {
    sandpit_tests::sandboxes(&d.client())
        .await
        .into_iter()
        .filter(|s| s.state != "stopped" && s.state != "stopping")
        .map(|s| s.id)
        .collect()
}

async fn run(d: &Daemon, id: &str, script: &str) -> String {
    let r = d.client().run(id, &sh(script)).await.expect("run");
    assert_eq!(r.exit_code, 0, "{script}: {}", r.stderr);
    r.stdout
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_build_of_steps_on_a_local_image_makes_a_template_sandboxes_start_from() {
    let image = temp_dir("sandpit-e2b-oci-");
    oci_image(image.path());
    let d = Daemon::builder()
        .config(&format!(
            "[e2b.images]\n\"tiny:1\" = \"{}\"\n",
            image.path().display()
        ))
        .start()
        .await;
    let e = E2b::new(&d, &d.key);
    let (tid, bid) = e.request("app:v1").await;
    let ctx = context(&[
        Member::Dir("ctx"),
        Member::File("ctx/hello.txt", b"hello from the context\n", 0o644),
        Member::File("ctx/run.sh", b"#!/bin/sh\necho ran\n", 0o755),
        Member::Symlink("ctx/link", "hello.txt"),
        Member::Symlink("ctx/elsewhere", "/etc/os-release"),
        Member::Dir("ctx/sub"),
        Member::File("ctx/sub/deep.txt", b"deep\n", 0o644),
        Member::File("other.txt", b"not copied\n", 0o644),
    ]);
    let hash = e.upload(&tid, &ctx).await;
    let (s, v) = e
        .start(
            &tid,
            &bid,
            json!({
                "fromImage": "tiny:1",
                "force": true,
                "steps": [
                    {"type": "ENV", "args": ["GREETING", "hi there"]},
                    {"type": "RUN", "args": ["echo \"$GREETING\" > /home/user/env.txt; id -u > /home/user/run-uid"]},
                    {"type": "COPY", "args": ["ctx/*", "/opt/app", "", ""], "filesHash": hash},
                    {"type": "COPY", "args": ["ctx/hello.txt", "/opt/single.txt", "root", "0600"], "filesHash": hash},
                    {"type": "USER", "args": ["root"]},
                    {"type": "WORKDIR", "args": ["/srv/work"]},
                    {"type": "RUN", "args": ["id -u > uid; pwd > where"]},
                    {"type": "RUN", "args": ["id -u > /srv/work/as-user"], "force": false},
                    {"type": "USER", "args": ["user"]},
                ],
                "startCmd": "touch /tmp/started",
                "readyCmd": "test -f /tmp/started",
            }),
        )
        .await;
    assert_eq!(s, 202, "{v}");
    let (v, logs) = e.wait(&tid, &bid).await;
    assert_eq!(v["status"], "ready", "{v}\n{logs:#?}");
    assert!(
        logs.iter().any(|l| l.contains("RUN id -u > uid")),
        "{logs:#?}"
    );
    assert!(
        logs.iter().any(|l| l.contains("COPY ctx/* /opt/app")),
        "{logs:#?}"
    );
    // The log pages from any offset.
    let (_, page) = e
        .get(&format!(
            "/templates/{tid}/builds/{bid}/status?logsOffset=2&limit=3"
        ))
        .await;
    assert_eq!(page["logEntries"].as_array().map(Vec::len), Some(3));
    assert_eq!(page["logEntries"][0]["message"], json!(logs[2]));

    let id = e.sandbox("app:v1").await;
    assert_eq!(run(&d, &id, "cat /home/user/env.txt").await, "hi there\n");
    assert_eq!(run(&d, &id, "cat /home/user/run-uid").await, "1000\n");
    assert_eq!(
        run(&d, &id, "cat /opt/app/hello.txt").await,
        "hello from the context\n"
    );
    assert_eq!(run(&d, &id, "/opt/app/run.sh").await, "ran\n");
    assert_eq!(run(&d, &id, "readlink /opt/app/link").await, "hello.txt\n");
    assert_eq!(
        run(&d, &id, "readlink /opt/app/elsewhere").await,
        "/etc/os-release\n"
    );
    // A matched directory's contents land in the destination, as in Docker.
    assert_eq!(run(&d, &id, "cat /opt/app/deep.txt").await, "deep\n");
    assert!(
        d.client()
            .run(
                &id,
                &sh("test -e /opt/app/other.txt || test -e /opt/other.txt")
            )
            .await
            .expect("run")
            .exit_code
            != 0
    );
    assert_eq!(
        run(
            &d,
            &id,
            "stat -c '%u %a' /opt/app/hello.txt /opt/single.txt"
        )
        .await,
        "1000 644\n0 600\n"
    );
    assert_eq!(
        run(&d, &id, "cat /srv/work/uid /srv/work/where").await,
        "0\n/srv/work\n"
    );
    // The last USER and WORKDIR are the sandbox's defaults; the start command ran.
    assert_eq!(run(&d, &id, "id -u; pwd").await, "1000\n/srv/work\n");
    run(&d, &id, "test -f /tmp/started").await;

    // Tags: assign, list, start by tag, remove.
    let (s, v) = e
        .post(
            "/templates/tags",
            json!({"target": "app:v1", "tags": ["prod"]}),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    assert_eq!(v["buildID"], json!(bid));
    let (s, v) = e.get(&format!("/templates/{tid}/tags")).await;
    assert_eq!(s, 200);
    let tags: Vec<&str> = v
        .as_array()
        .expect("tags")
        .iter()
        .filter_map(|t| t["tag"].as_str())
        .collect();
    assert_eq!(tags, ["prod", "v1"]);
    for bad in [":x", "app:", "a b"] {
        let (s, v) = e
            .post(
                "/templates/tags",
                json!({"target": "app:v1", "tags": [bad]}),
            )
            .await;
        assert_eq!(s, 400, "{bad}: {v}");
        assert_eq!(v["code"], 400);
    }
    let (s, _) = e
        .post("/templates/tags", json!({"target": ":v1", "tags": ["x"]}))
        .await;
    assert_eq!(s, 400);
    e.sandbox("app:prod").await;
    let (s, _) = e
        .call(
            reqwest::Method::DELETE,
            "/templates/tags",
            Some(json!({"name": "app", "tags": ["prod"]})),
        )
        .await;
    assert_eq!(s, 204);
    let (s, _) = e
        .post("/v2/sandboxes", json!({"templateID": "app:prod"}))
        .await;
    assert_eq!(s, 404);
    // Exists checks and the template's own view.
    let (s, v) = e.get("/templates/aliases/app").await;
    assert_eq!((s, v["templateID"].as_str()), (200, Some(tid.as_str())));
    let (s, _) = e.get("/templates/aliases/no-such-template").await;
    assert_eq!(s, 404);
    let (s, v) = e.get("/templates/app").await;
    assert_eq!(s, 200);
    assert_eq!(v["builds"][0]["status"], "ready");
    // The list shows it as E2B's template, not the sandpit template the build made.
    let (_, v) = e.get("/templates").await;
    let listed: Vec<&str> = v
        .as_array()
        .expect("templates")
        .iter()
        .filter_map(|t| t["templateID"].as_str())
        .collect();
    assert!(listed.contains(&tid.as_str()), "{listed:?}");
    assert!(
        !listed.iter().any(|t| t.starts_with(&format!("e2b-{tid}"))),
        "{listed:?}"
    );
    let (_, v) = E2b::new(&d, &d.owner_key("team-c").await)
        .get("/templates")
        .await;
    assert!(!v.to_string().contains(&tid), "{v}");

    // fromTemplate: a second template on the first one's files.
    let (t2, b2) = e.request("app-child").await;
    let (s, v) = e
        .start(
            &t2,
            &b2,
            json!({"fromTemplate": "app:v1", "steps": [
                {"type": "RUN", "args": ["cat /opt/app/hello.txt > /home/user/copied"]},
            ]}),
        )
        .await;
    assert_eq!(s, 202, "{v}");
    let (v, logs) = e.wait(&t2, &b2).await;
    assert_eq!(v["status"], "ready", "{v}\n{logs:#?}");
    let child = e.sandbox("app-child").await;
    assert_eq!(
        run(&d, &child, "cat /home/user/copied").await,
        "hello from the context\n"
    );

    // Another owner sees none of it.
    let other = d.owner_key("team-b").await;
    let o = E2b::new(&d, &other);
    assert_eq!(o.get(&format!("/templates/{tid}/tags")).await.0, 404);
    assert_eq!(
        o.get(&format!("/templates/{tid}/builds/{bid}/status"))
            .await
            .0,
        404
    );
    assert_eq!(
        o.post("/v2/sandboxes", json!({"templateID": "app:v1"}))
            .await
            .0,
        404
    );
    let (s, _) = o
        .get(&format!("/templates/{tid}/files/{}", "a".repeat(64)))
        .await;
    assert_eq!(s, 404);
    // Not by the sandpit template the build made either, through either API, nor as the
    // base of a build of theirs.
    let made = format!("e2b-{tid}-{}", bid.replace('-', ""));
    assert!(d.client().get_template(&made).await.is_ok(), "{made}");
    assert_eq!(
        o.post("/v2/sandboxes", json!({"templateID": made})).await.0,
        404
    );
    let theirs = d.owner("team-b").await;
    let native = sandpit_api::CreateSandboxRequest {
        template: Some(made.clone()),
        ..Default::default()
    };
    assert_eq!(
        sandpit_tests::error_status(theirs.create_sandbox(&native).await),
        Some(404)
    );
    // Nor listed or shown by `/v1/templates`: a built template's name is its team's
    // business (the admin, who built this one, sees it above).
    assert_eq!(
        sandpit_tests::error_status(theirs.get_template(&made).await),
        Some(404)
    );
    let listed: Vec<String> = theirs
        .list_templates()
        .await
        .expect("templates")
        .into_iter()
        .map(|t| t.name)
        .collect();
    assert!(listed.contains(&"host".to_string()), "{listed:?}");
    assert!(!listed.contains(&made), "{listed:?}");
    let progress = reqwest::Client::new()
        .get(format!("{}/v1/templates/{made}/build", d.url))
        .bearer_auth(&other)
        .send()
        .await
        .expect("follow the build");
    assert_eq!(progress.status(), 404);
    let (t3, b3) = o.request("borrowed").await;
    let (s, v) = o.start(&t3, &b3, json!({"fromTemplate": made})).await;
    assert_eq!(s, 400, "{v}");

    // A template in use cannot go; once its sandboxes are gone it can, with its builds.
    let (s, _) = e
        .call(reqwest::Method::DELETE, "/templates/app", None)
        .await;
    assert_eq!(s, 409);
    d.remove_everything().await;
    let (s, v) = e
        .call(reqwest::Method::DELETE, "/templates/app-child", None)
        .await;
    assert_eq!(s, 204, "{v}");
    let (s, v) = e
        .call(reqwest::Method::DELETE, "/templates/app", None)
        .await;
    assert_eq!(s, 204, "{v}");
    assert_eq!(e.get("/templates/aliases/app").await.0, 404);
    // Only the imported image is left of the templates.
    let names: Vec<String> = d
        .client()
        .list_templates()
        .await
        .expect("templates")
        .into_iter()
        .map(|t| t.name)
        .filter(|n| n != "host")
        .collect();
    assert_eq!(names.len(), 1, "{names:?}");
    assert!(names[0].starts_with("e2b-img-"), "{names:?}");
    assert!(
        d.client()
            .list_snapshots()
            .await
            .expect("snapshots")
            .items
            .is_empty()
    );
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unpullable_images_and_bad_steps_get_clear_errors() {
    let d = Daemon::start().await;
    let e = E2b::new(&d, &d.key);
    let (tid, bid) = e.request("refused").await;
    let (s, v) = e
        .start(
            &tid,
            &bid,
            json!({"fromImage": "ubuntu:22.04", "steps": []}),
        )
        .await;
    assert_eq!(s, 400, "{v}");
    let m = v["message"].as_str().unwrap_or("");
    assert!(m.contains("cannot be pulled"), "{m}");
    assert!(
        m.contains("e2bdev/base") && m.contains("fromTemplate"),
        "{m}"
    );
    // The build is over, with the same reason.
    let (_, v) = e
        .get(&format!("/templates/{tid}/builds/{bid}/status"))
        .await;
    assert_eq!(v["status"], "error");
    assert_eq!(v["reason"]["step"], "base");
    // Started once only.
    let (s, _) = e
        .start(&tid, &bid, json!({"fromTemplate": "base", "steps": []}))
        .await;
    assert_eq!(s, 409);

    for (spec, says) in [
        (
            json!({"fromImage": "e2bdev/base", "fromImageRegistry": {"type": "registry", "username": "u", "password": "p"}}),
            "fromImageRegistry",
        ),
        (
            json!({"fromTemplate": "base", "steps": [{"type": "EXPOSE", "args": ["80"]}]}),
            "unsupported step type",
        ),
        (
            json!({"fromTemplate": "base", "steps": [{"type": "USER", "args": ["nobody"]}]}),
            "USER \"nobody\"",
        ),
        (
            json!({"fromTemplate": "base", "steps": [{"type": "COPY", "args": ["a", "b"], "filesHash": "b".repeat(64)}]}),
            "were not uploaded",
        ),
        (
            json!({"fromTemplate": "base", "steps": [{"type": "ENV", "args": ["ONLY_A_NAME"]}]}),
            "pairs",
        ),
        (json!({"fromTemplate": "no-such-template"}), "not found"),
    ] {
        let (tid, bid) = e.request("refused").await;
        let (s, v) = e.start(&tid, &bid, spec.clone()).await;
        assert_eq!(s, 400, "{spec}: {v}");
        let m = v["message"].as_str().unwrap_or("");
        assert!(m.contains(says), "{spec}: {m}");
    }

    // Steps that fail while running end the build with the step and a reason.
    for (steps, step, says) in [
        (
            json!([{"type": "RUN", "args": ["whoami", "root123"]}]),
            "1",
            "failed to run command 'whoami': command failed: unauthenticated: invalid username: 'root123'",
        ),
        (
            json!([{"type": "RUN", "args": ["true"]}, {"type": "RUN", "args": ["echo broken >&2; exit 3"]}]),
            "2",
            "exit status 3: broken",
        ),
    ] {
        let (tid, bid) = e.request("failing").await;
        let (s, v) = e
            .start(&tid, &bid, json!({"fromTemplate": "base", "steps": steps}))
            .await;
        assert_eq!(s, 202, "{v}");
        let (v, _) = e.wait(&tid, &bid).await;
        assert_eq!(v["status"], "error", "{v}");
        assert_eq!(v["reason"]["step"], step, "{v}");
        let m = v["reason"]["message"].as_str().unwrap_or("");
        assert!(m.contains(says), "{m}");
    }
    // A failed build leaves no sandbox, snapshot or template behind, and starts nothing.
    assert!(live_sandboxes(&d).await.is_empty());
    assert!(
        d.client()
            .list_snapshots()
            .await
            .expect("snapshots")
            .items
            .is_empty()
    );
    let (s, _) = e
        .post("/v2/sandboxes", json!({"templateID": "failing"}))
        .await;
    assert_eq!(s, 404);

    // Names and hashes are checked.
    for name in ["", "../x", "a/b", ":tag", "name:", "base"] {
        let (s, v) = e.post("/v3/templates", json!({"name": name})).await;
        assert!(s == 400 || s == 409, "{name:?}: {s} {v}");
    }
    for hash in ["..%2F..%2Fetc", "abc", &"z".repeat(64)] {
        let (s, _) = e.get(&format!("/templates/{tid}/files/{hash}")).await;
        assert_eq!(s, 400, "{hash}");
    }
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_uploads_are_refused_and_never_touch_the_host() {
    let d = Daemon::start().await;
    let e = E2b::new(&d, &d.key);
    let (tid, _) = e.request("hostile").await;
    let hash = "c".repeat(64);
    let (_, v) = e.get(&format!("/templates/{tid}/files/{hash}")).await;
    let url = v["url"].as_str().expect("url").to_string();
    // A signature is bound to its template, hash and expiry.
    let forged = [
        url.replace(&hash, &"d".repeat(64)),
        url.replace(&tid, "aaaaaaaaaaaaaaaaaaaa"),
        url.replace("expires=", "expires=9"),
        url.split('?').next().unwrap_or("").to_string(),
    ];
    for u in forged {
        let r = e.http.put(&u).body("x").send().await.expect("put");
        assert_eq!(r.status(), StatusCode::FORBIDDEN, "{u}");
    }

    let sentinel = format!("/tmp/sandpit-e2b-escape-{}", std::process::id());
    let _ = std::fs::remove_file(&sentinel);
    let escape = format!("../../../../../../..{sentinel}");
    let abs = sentinel.trim_start_matches('/').to_string();
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (
            context(&[Member::File(&escape, b"x", 0o644)]),
            "has a .. component",
        ),
        (
            context(&[Member::Raw(&format!("/{abs}"), tar::EntryType::Regular, 0)]),
            "absolute path",
        ),
        (
            context(&[
                Member::Symlink("ctx", "/tmp"),
                Member::File(&format!("ctx/{}", &sentinel[5..]), b"x", 0o644),
            ]),
            "leads through a symlink",
        ),
        (
            context(&[Member::Symlink("up", "../../../../etc/shadow")]),
            "climbs out of the copied tree",
        ),
        (
            context(&[Member::Raw("dev", tar::EntryType::Block, 0)]),
            "block device",
        ),
        (
            context(&[Member::Raw("fifo", tar::EntryType::Fifo, 0)]),
            "fifo",
        ),
        // A member that claims 2 GiB: refused from its header, before anything is read.
        (
            context(&[Member::Raw("huge", tar::EntryType::Regular, 2 << 30)]),
            "more than",
        ),
        (b"this is not an archive at all".to_vec(), "COPY *"),
    ];
    for (tar, says) in cases {
        let (tid, bid) = e.request("hostile").await;
        let hash = e.upload(&tid, &tar).await;
        let (s, v) = e
            .start(
                &tid,
                &bid,
                json!({"fromTemplate": "base", "steps": [
                    {"type": "COPY", "args": ["*", "/home/user/in", "", ""], "filesHash": hash},
                ]}),
            )
            .await;
        assert_eq!(s, 202, "{v}");
        let (v, _) = e.wait(&tid, &bid).await;
        assert_eq!(v["status"], "error", "{says}: {v}");
        assert_eq!(v["reason"]["step"], "1", "{v}");
        let m = v["reason"]["message"].as_str().unwrap_or("");
        assert!(m.contains(says), "{says}: {m}");
        assert!(!Path::new(&sentinel).exists(), "{says}: wrote on the host");
    }
    assert!(live_sandboxes(&d).await.is_empty());
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_build_streams_its_log_and_one_cut_short_by_a_daemon_stop_leaves_nothing() {
    let mut d = Daemon::start().await;
    let key = d.key.clone();
    let e = E2b::new(&d, &key);
    let (tid, bid) = e.request("cut-short").await;
    let (s, v) = e
        .start(
            &tid,
            &bid,
            json!({"fromTemplate": "base", "steps": [
                {"type": "RUN", "args": ["echo begun; sleep 300"]},
            ]}),
        )
        .await;
    assert_eq!(s, 202, "{v}");
    // The step's output is in the log while the step still runs.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let (_, v) = e
            .get(&format!("/templates/{tid}/builds/{bid}/status"))
            .await;
        assert_eq!(v["status"], "building", "{v}");
        let seen = v["logEntries"]
            .as_array()
            .is_some_and(|l| l.iter().any(|e| e["message"] == "begun"));
        if seen {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{v}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(live_sandboxes(&d).await.len(), 1);
    d.stop();
    let d = d.restart().start().await;
    let e = E2b::new(&d, &key);
    let (s, v) = e
        .get(&format!("/templates/{tid}/builds/{bid}/status"))
        .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["status"], "error", "{v}");
    let m = v["reason"]["message"].as_str().unwrap_or("");
    assert!(m.contains("interrupted"), "{m}");
    // Its build sandbox went with it, and nothing starts from the template.
    assert!(live_sandboxes(&d).await.is_empty());
    assert!(
        d.client()
            .list_snapshots()
            .await
            .expect("snapshots")
            .items
            .is_empty()
    );
    let (s, _) = e
        .post("/v2/sandboxes", json!({"templateID": "cut-short"}))
        .await;
    assert_eq!(s, 404);
    d.shutdown().await;
}
