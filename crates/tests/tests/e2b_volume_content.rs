//! E2B's volume-content API (`/volumecontent/{id}/...`) against a real daemon, attacked
//! from inside a sandbox: symlinks to host files (absolute and `../` forms), a symlinked
//! directory, a FIFO and hard links planted in the volume must not let the API read or
//! write outside it, nor hang; tokens open their own volume only and other owners see
//! nothing; files cross between the API and sandboxes with the right owners.

use reqwest::{Method, StatusCode};
use sandpit_tests::{Daemon, http, sh, sh_root};
use serde_json::{Value, json};
use std::time::Duration;

struct Vol {
    url: String,
    id: String,
    token: String,
}

impl Vol {
    async fn call(
        &self,
        method: Method,
        what: &str,
        query: &str,
        auth: Option<&str>,
        body: Option<Vec<u8>>,
    ) -> (StatusCode, Vec<u8>) {
        let mut req = http()
            .request(
                method,
                format!("{}/volumecontent/{}/{what}?{query}", self.url, self.id),
            )
            .timeout(Duration::from_secs(20));
        if let Some(a) = auth {
            req = req.bearer_auth(a);
        }
        if let Some(b) = body {
            req = req
                .header("content-type", "application/octet-stream")
                .body(b);
        }
        let resp = req.send().await.expect("request (a hang fails here)");
        let status = resp.status();
        (status, resp.bytes().await.expect("body").to_vec())
    }

    async fn with_token(
        &self,
        m: Method,
        what: &str,
        q: &str,
        body: Option<Vec<u8>>,
    ) -> (StatusCode, Vec<u8>) {
        self.call(m, what, q, Some(&self.token.clone()), body).await
    }

    async fn json(&self, m: Method, what: &str, q: &str) -> (StatusCode, Value) {
        let (s, b) = self.with_token(m, what, q, None).await;
        (s, serde_json::from_slice(&b).unwrap_or(Value::Null))
    }
}

async fn new_volume(d: &Daemon, key: &str, name: &str) -> Vol {
    let resp = http()
        .post(format!("{}/volumes", d.url))
        .header("X-API-Key", key)
        .json(&json!({ "name": name }))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::CREATED);
    let v: Value = resp.json().await.unwrap();
    Vol {
        url: d.url.clone(),
        id: v["volumeID"].as_str().unwrap().into(),
        token: v["token"].as_str().unwrap().into(),
    }
}

async fn sandbox_with(d: &Daemon, name: &str) -> String {
    let resp = http()
        .post(format!("{}/v2/sandboxes", d.url))
        .header("X-API-Key", &d.key)
        .json(&json!({"templateID": "base", "volumeMounts": [{"name": name, "path": "/mnt/v"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::CREATED);
    let v: Value = resp.json().await.unwrap();
    v["sandboxID"].as_str().unwrap().into()
}

fn error_code(b: &[u8]) -> Value {
    serde_json::from_slice::<Value>(b).unwrap_or(Value::Null)["code"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn planted_links_fifos_and_dots_never_leave_the_volume() {
    let d = Daemon::start().await;
    let c = d.client();
    let v = new_volume(&d, &d.key, "attack").await;
    // A host file and directory outside the volume that the sandbox points at.
    let outside = tempfile::tempdir().unwrap();
    let host_file = outside.path().join("host-secret");
    std::fs::write(&host_file, "host secret\n").unwrap();
    let (hf, hd) = (
        host_file.display().to_string(),
        outside.path().display().to_string(),
    );
    let sbx = sandbox_with(&d, "attack").await;
    let plant = format!(
        "cd /mnt/v && echo inside > real && ln -s {hf} abs && \
         ln -s ../../../../../../../../..{hf} rel && ln -s {hd} hostdir && \
         ln -s /etc/passwd passwd && mkfifo fifo && ln real hard && \
         mkdir sub && ln -s ../../../../.. sub/up && echo ok"
    );
    let r = sh(&c, &sbx, &plant).await;
    assert_eq!(r.stdout, "ok\n", "{}", r.stderr);
    // A hard link to a file outside the volume cannot be made at all.
    let r = sh_root(&c, &sbx, "ln /etc/hostname /mnt/v/h 2>&1; echo $?").await;
    assert_ne!(
        r.stdout.trim_end().lines().last(),
        Some("0"),
        "{}",
        r.stdout
    );

    // Reads through the symlinks resolve inside the volume: nothing there.
    for path in [
        "/abs",
        "/rel",
        "/passwd",
        "/hostdir/host-secret",
        "/sub/up/etc/passwd",
        "/../../../../etc/passwd",
        &format!("/../../../../..{hf}"),
    ] {
        let (s, b) = v
            .with_token(Method::GET, "file", &format!("path={path}"), None)
            .await;
        assert!(
            s == StatusCode::NOT_FOUND || s == StatusCode::CONFLICT,
            "{path}: {s} {}",
            String::from_utf8_lossy(&b)
        );
        assert!(!String::from_utf8_lossy(&b).contains("host secret"));
        assert!(!String::from_utf8_lossy(&b).contains("root:"));
    }
    // Writes through them do not reach the host.
    for path in [
        "/abs",
        "/rel",
        "/passwd",
        "/hostdir/host-secret",
        "/hostdir/new",
    ] {
        let (s, b) = v
            .with_token(
                Method::PUT,
                "file",
                &format!("path={path}"),
                Some(b"pwned".to_vec()),
            )
            .await;
        assert!(
            s.is_client_error(),
            "{path}: {s} {}",
            String::from_utf8_lossy(&b)
        );
    }
    // With force, a write under the symlinked directory makes a path inside the volume
    // or fails; the host directory is untouched either way.
    let _ = v
        .with_token(
            Method::PUT,
            "file",
            "path=/hostdir/forced&force=true",
            Some(b"pwned".to_vec()),
        )
        .await;
    assert_eq!(
        std::fs::read_to_string(&host_file).unwrap(),
        "host secret\n"
    );
    assert_eq!(
        std::fs::read_dir(outside.path()).unwrap().count(),
        1,
        "something was written to the host directory"
    );
    // Metadata and removal act on the link, never on its target.
    let before = std::fs::metadata(&host_file).unwrap();
    let (s, _) = v
        .call(
            Method::PATCH,
            "path",
            "path=/abs",
            Some(&v.token),
            Some(br#"{"mode": 511}"#.to_vec()),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let (s, _) = v
        .call(
            Method::PATCH,
            "path",
            "path=/abs",
            Some(&v.token),
            Some(br#"{"uid": 1234}"#.to_vec()),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    let after = std::fs::metadata(&host_file).unwrap();
    {
        use std::os::unix::fs::MetadataExt;
        assert_eq!((before.uid(), before.mode()), (after.uid(), after.mode()));
    }
    let (s, _) = v
        .with_token(Method::DELETE, "path", "path=/hostdir", None)
        .await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    assert!(host_file.exists());

    // Stat reports symlinks as they are.
    let (s, st) = v.json(Method::GET, "path", "path=/abs").await;
    assert_eq!(s, StatusCode::OK, "{st}");
    assert_eq!(
        (st["type"].as_str(), st["target"].as_str()),
        (Some("symlink"), Some(hf.as_str()))
    );

    // A FIFO is refused at once, for reading and writing; nothing blocks.
    let started = std::time::Instant::now();
    let (s, b) = v.with_token(Method::GET, "file", "path=/fifo", None).await;
    assert_eq!(
        s,
        StatusCode::BAD_REQUEST,
        "{}",
        String::from_utf8_lossy(&b)
    );
    assert_eq!(error_code(&b), json!(400));
    let (s, _) = v
        .with_token(Method::PUT, "file", "path=/fifo", Some(b"x".to_vec()))
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(started.elapsed() < Duration::from_secs(5));
    let (s, st) = v.json(Method::GET, "path", "path=/fifo").await;
    assert_eq!((s, st["type"].as_str()), (StatusCode::OK, Some("unknown")));
    // A device node (a sandbox cannot make one; the host can, on the volume's mount):
    // never opened.
    let dev = d.data.path().join(format!("volumes/mnt/{}/zero", v.id));
    nix::sys::stat::mknod(
        &dev,
        nix::sys::stat::SFlag::S_IFCHR,
        nix::sys::stat::Mode::from_bits_truncate(0o666),
        nix::sys::stat::makedev(1, 5),
    )
    .unwrap();
    let (s, _) = v.with_token(Method::GET, "file", "path=/zero", None).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let (s, _) = v
        .with_token(Method::PUT, "file", "path=/zero", Some(b"x".to_vec()))
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    std::fs::remove_file(&dev).unwrap();

    // A hard link inside the volume is just the same file.
    let (s, b) = v.with_token(Method::GET, "file", "path=/hard", None).await;
    assert_eq!((s, b.as_slice()), (StatusCode::OK, b"inside\n".as_slice()));
    // A listing does not follow the symlinked directory.
    let (s, l) = v.json(Method::GET, "dir", "path=/&depth=5").await;
    assert_eq!(s, StatusCode::OK, "{l}");
    let paths: Vec<&str> = l
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["path"].as_str().unwrap())
        .collect();
    assert_eq!(
        paths,
        [
            "/abs", "/fifo", "/hard", "/passwd", "/real", "/rel", "/sub", "/sub/up"
        ]
    );
    // Bad paths and arguments: 400, never 500.
    for (m, what, q) in [
        (Method::GET, "file", "path=/a%00b"),
        (Method::GET, "file", "path=/"),
        (Method::DELETE, "path", "path=/"),
        (Method::DELETE, "path", "path=/.."),
        (Method::POST, "dir", "path=/x&uid=65536"),
        (Method::POST, "dir", "path=/x&mode=4096"),
        (Method::POST, "dir", "path=/x&uid=-1"),
        (Method::GET, "file", "nopath=1"),
    ] {
        let (s, b) = v.with_token(m.clone(), what, q, None).await;
        assert_eq!(
            s,
            StatusCode::BAD_REQUEST,
            "{m} {what}?{q}: {}",
            String::from_utf8_lossy(&b)
        );
    }
    c.delete_sandbox(&sbx).await.unwrap();
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_open_their_own_volume_and_owners_stay_apart() {
    let d = Daemon::start().await;
    let mine = new_volume(&d, &d.key, "mine").await;
    let other = new_volume(&d, &d.key, "other").await;
    let bob_key = d.owner_key("bob").await;
    let bobs = new_volume(&d, &bob_key, "bobs").await;
    assert!(mine.token.starts_with("sp_vol_") && mine.token != other.token);
    let (s, _) = bobs
        .with_token(Method::PUT, "file", "path=/b", Some(b"bob".to_vec()))
        .await;
    assert_eq!(s, StatusCode::CREATED);

    // The token again from GET /volumes/{id}.
    let v: Value = http()
        .get(format!("{}/volumes/{}", d.url, mine.id))
        .header("X-API-Key", &d.key)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["token"].as_str(), Some(mine.token.as_str()));

    let at_bobs = |auth: Option<String>| {
        let url = bobs.url.clone();
        let id = bobs.id.clone();
        async move {
            Vol {
                url,
                id,
                token: String::new(),
            }
            .call(Method::GET, "file", "path=/b", auth.as_deref(), None)
            .await
            .0
        }
    };
    assert_eq!(at_bobs(None).await, StatusCode::UNAUTHORIZED);
    assert_eq!(
        at_bobs(Some("nonsense".into())).await,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        at_bobs(Some(format!("sp_vol_{}", "0".repeat(64)))).await,
        StatusCode::FORBIDDEN
    );
    assert_eq!(
        at_bobs(Some(mine.token.clone())).await,
        StatusCode::FORBIDDEN
    );
    // Another owner's API key: the volume does not exist for it.
    assert_eq!(at_bobs(Some(d.key.clone())).await, StatusCode::NOT_FOUND);
    // Its owner's key and its own token open it.
    assert_eq!(at_bobs(Some(bob_key.clone())).await, StatusCode::OK);
    assert_eq!(at_bobs(Some(bobs.token.clone())).await, StatusCode::OK);
    // A token of one of mine does not open the other.
    let (s, _) = other
        .call(Method::GET, "dir", "path=/", Some(&mine.token), None)
        .await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    // A deleted volume's token opens nothing.
    let del = http()
        .delete(format!("{}/volumes/{}", d.url, other.id))
        .header("X-API-Key", &d.key)
        .send()
        .await
        .unwrap();
    assert_eq!(del.status(), StatusCode::NO_CONTENT);
    let (s, _) = other.with_token(Method::GET, "dir", "path=/", None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    // Tokens outlive a restart of the daemon.
    let d = d.restart().start().await;
    let mine = Vol {
        url: d.url.clone(),
        ..mine
    };
    let (s, _) = mine.with_token(Method::GET, "dir", "path=/", None).await;
    assert_eq!(s, StatusCode::OK);
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_cross_between_the_api_and_sandboxes_with_their_owners() {
    let d = Daemon::start().await;
    let c = d.client();
    let v = new_volume(&d, &d.key, "shared").await;
    let (s, b) = v
        .with_token(
            Method::PUT,
            "file",
            "path=/a/b/api.txt&force=true",
            Some(b"from the API\n".to_vec()),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{}", String::from_utf8_lossy(&b));
    let st: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(
        (
            st["uid"].clone(),
            st["gid"].clone(),
            st["mode"].clone(),
            st["size"].clone()
        ),
        (json!(1000), json!(1000), json!(0o644), json!(13))
    );
    let (s, _) = v
        .with_token(
            Method::PUT,
            "file",
            "path=/rootfile&uid=0&gid=0&mode=384",
            Some(b"root's\n".to_vec()),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED);
    let sbx = sandbox_with(&d, "shared").await;
    let r = sh(
        &c,
        &sbx,
        "cat /mnt/v/a/b/api.txt && stat -c '%U %G %a' /mnt/v/a/b/api.txt /mnt/v/a /mnt/v/rootfile \
         && (cat /mnt/v/rootfile 2>/dev/null || echo denied) \
         && echo from the sandbox > /mnt/v/sbx.txt",
    )
    .await;
    assert_eq!(
        r.stdout, "from the API\nuser user 644\nuser user 755\nroot root 600\ndenied\n",
        "{}",
        r.stderr
    );
    let (s, b) = v
        .with_token(Method::GET, "file", "path=/sbx.txt", None)
        .await;
    assert_eq!(
        (s, b.as_slice()),
        (StatusCode::OK, b"from the sandbox\n".as_slice())
    );
    let (_, st) = v.json(Method::GET, "path", "path=/sbx.txt").await;
    assert_eq!(
        (st["uid"].clone(), st["gid"].clone()),
        (json!(1000), json!(1000))
    );
    c.delete_sandbox(&sbx).await.unwrap();
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_volume_is_507_and_leaves_no_half_written_file() {
    let d = Daemon::start().await;
    d.client().create_volume("tiny", 16 << 20).await.unwrap();
    let resp = http()
        .get(format!("{}/volumes/tiny", d.url))
        .header("X-API-Key", &d.key)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let v: Value = resp.json().await.unwrap();
    let vol = Vol {
        url: d.url.clone(),
        id: v["volumeID"].as_str().unwrap().into(),
        token: v["token"].as_str().unwrap().into(),
    };
    let (s, b) = vol
        .with_token(Method::PUT, "file", "path=/big", Some(vec![7u8; 32 << 20]))
        .await;
    assert_eq!(
        s,
        StatusCode::INSUFFICIENT_STORAGE,
        "{}",
        String::from_utf8_lossy(&b)
    );
    assert_eq!(error_code(&b), json!(507));
    let (s, _) = vol.with_token(Method::GET, "path", "path=/big", None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    // The space is back: a small file fits.
    let (s, _) = vol
        .with_token(Method::PUT, "file", "path=/small", Some(vec![1u8; 1 << 20]))
        .await;
    assert_eq!(s, StatusCode::CREATED);
    d.shutdown().await;
}
