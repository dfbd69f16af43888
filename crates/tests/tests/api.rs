//! End-to-end tests of the API surface around the core: the agent pass-through (Connect
//! RPC in E2B's shape), watchers, streams with stdin and a pty, listing, TTL changes,
//! custom root filesystem templates and the CLI.

use sandpit_api::{CommandEvent, CreateSandboxRequest, LimitsSpec, PtySize, RunCommandRequest};
use sandpit_tests::{Daemon, bash, command, sandboxes, sandpit_bin, sh};
use std::time::Duration;

async fn connect_call(
    d: &Daemon,
    id: &str,
    method: &str,
    body: serde_json::Value,
) -> (u16, serde_json::Value) {
    let r = sandpit_tests::http()
        .post(format!("{}/v1/sandboxes/{id}/agent/{method}", d.url))
        .header("authorization", format!("Bearer {}", d.key))
        .header("content-type", "application/json")
        .header("connect-protocol-version", "1")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(serde_json::Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_passthrough_speaks_connect_and_watchers_see_changes() {
    let d = Daemon::start().await;
    let c = d.client();
    let id = d.sandbox(LimitsSpec::default()).await;
    let (status, v) = connect_call(
        &d,
        &id,
        "filesystem.Filesystem/Stat",
        serde_json::json!({"path": "/etc/hostname"}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["entry"]["name"], "hostname");
    let (status, v) = connect_call(
        &d,
        &id,
        "filesystem.Filesystem/Stat",
        serde_json::json!({"path": "/nope"}),
    )
    .await;
    assert_eq!((status, v["code"].as_str()), (404, Some("not_found")));
    let (status, v) = connect_call(
        &d,
        &id,
        "filesystem.Filesystem/CreateWatcher",
        serde_json::json!({"path": "/home/user"}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let watcher = v["watcherId"].as_str().unwrap().to_string();
    sh(
        &c,
        &id,
        "touch /home/user/new-file && echo x >> /home/user/new-file && rm /home/user/new-file",
    )
    .await;
    // Events arrive asynchronously: poll (and accumulate) for up to 10 s.
    let mut kinds: Vec<String> = Vec::new();
    let wanted = ["EVENT_TYPE_CREATE", "EVENT_TYPE_WRITE", "EVENT_TYPE_REMOVE"];
    for _ in 0..100 {
        let (_, v) = connect_call(
            &d,
            &id,
            "filesystem.Filesystem/GetWatcherEvents",
            serde_json::json!({"watcherId": watcher}),
        )
        .await;
        kinds.extend(
            v["events"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|e| e["name"] == "new-file")
                .map(|e| e["type"].as_str().unwrap_or("").to_string()),
        );
        if wanted.iter().all(|k| kinds.iter().any(|x| x == k)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for k in wanted {
        assert!(kinds.iter().any(|x| x == k), "{k} missing in {kinds:?}");
    }
    let (status, _) = connect_call(
        &d,
        &id,
        "filesystem.Filesystem/RemoveWatcher",
        serde_json::json!({"watcherId": watcher}),
    )
    .await;
    assert_eq!(status, 200);
    // the process service lists what the REST API started, through the same agent
    let bg = c
        .run_background(
            &id,
            &RunCommandRequest {
                argv: vec!["sleep".into(), "30".into()],
                tag: Some("napper".into()),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let (_, v) = connect_call(&d, &id, "process.Process/List", serde_json::json!({})).await;
    assert!(
        v["processes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["pid"] == bg.pid && p["tag"] == "napper"),
        "{v}"
    );
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_streams_take_stdin_signals_and_a_pty() {
    let d = Daemon::start().await;
    let c = d.client();
    let id = d.sandbox(LimitsSpec::default()).await;
    let mut s = c.stream_command(&id, &command(&["cat"])).await.unwrap();
    s.write_stdin(b"piped through\n").await.unwrap();
    s.close_stdin().await.unwrap();
    let (out, _, code) = s.collect().await.unwrap();
    assert_eq!((out.as_slice(), code), (&b"piped through\n"[..], 0));
    let req = RunCommandRequest {
        pty: Some(PtySize {
            cols: 100,
            rows: 30,
        }),
        ..bash("stty size; tty")
    };
    let mut s = c.stream_command(&id, &req).await.unwrap();
    let mut text = Vec::new();
    while let Some(ev) = tokio::time::timeout(Duration::from_secs(10), s.next_event())
        .await
        .unwrap()
        .unwrap()
    {
        match ev {
            CommandEvent::Pty { data } => text.extend(sandpit_client::decode_data(&data).unwrap()),
            CommandEvent::End { .. } => break,
            _ => {}
        }
    }
    let text = String::from_utf8_lossy(&text);
    assert!(
        text.contains("30 100") && text.contains("/dev/pts/"),
        "{text}"
    );
    let mut s = c
        .stream_command(&id, &command(&["sleep", "60"]))
        .await
        .unwrap();
    s.signal("SIGKILL").await.unwrap();
    let (_, _, code) = tokio::time::timeout(Duration::from_secs(10), s.collect())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(code, 137);
    // a command that cannot start is reported on the stream, not as a silent close
    let mut s = c
        .stream_command(&id, &command(&["/does/not/exist"]))
        .await
        .unwrap();
    let ev = tokio::time::timeout(Duration::from_secs(10), s.next_event())
        .await
        .unwrap()
        .unwrap();
    assert!(matches!(ev, Some(CommandEvent::Error { .. })), "{ev:?}");
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listing_filters_paginates_and_ttl_can_change() {
    let d = Daemon::start().await;
    let c = d.client();
    let mut ids = Vec::new();
    for i in 0..5 {
        let req = CreateSandboxRequest {
            metadata: [("parity".to_string(), (i % 2).to_string())].into(),
            ..Default::default()
        };
        ids.push(c.create_sandbox(&req).await.unwrap().id);
    }
    let even = [("parity".to_string(), "0".to_string())];
    let p1 = c
        .list_sandboxes(Some("running"), &even, Some(2), None)
        .await
        .unwrap();
    assert_eq!(p1.items.len(), 2);
    let p2 = c
        .list_sandboxes(Some("running"), &even, Some(2), p1.next_cursor.as_deref())
        .await
        .unwrap();
    assert_eq!(p2.items.len(), 1);
    assert!(p2.next_cursor.is_none());
    let mut seen: Vec<String> = p1
        .items
        .iter()
        .chain(&p2.items)
        .map(|s| s.id.clone())
        .collect();
    seen.sort();
    let mut want = vec![ids[0].clone(), ids[2].clone(), ids[4].clone()];
    want.sort();
    assert_eq!(seen, want);
    assert_eq!(
        c.list_sandboxes(Some("paused"), &[], None, None)
            .await
            .unwrap()
            .items
            .len(),
        0
    );
    assert_eq!(
        c.list_sandboxes(Some("bogus"), &[], None, None)
            .await
            .unwrap_err()
            .status(),
        Some(400)
    );
    assert_eq!(
        c.list_sandboxes(None, &[], None, Some("not-a-cursor"))
            .await
            .unwrap_err()
            .status(),
        Some(400)
    );
    // TTL: shorten one to a second; keep-alive pushes another out again
    let before = c.get_sandbox(&ids[1]).await.unwrap().expires_at_ms;
    tokio::time::sleep(Duration::from_millis(20)).await;
    c.keepalive(&ids[1]).await.unwrap();
    assert!(c.get_sandbox(&ids[1]).await.unwrap().expires_at_ms > before);
    assert_eq!(
        c.set_timeout(&ids[1], 0).await.unwrap_err().status(),
        Some(400)
    );
    c.set_timeout(&ids[3], 1).await.unwrap();
    let mut gone = false;
    for _ in 0..40 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if c.get_sandbox(&ids[3]).await.map(|_| false).unwrap_or(true) {
            gone = true;
            break;
        }
    }
    assert!(gone);
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn custom_rootfs_templates_run_their_own_binaries() {
    let d = Daemon::start().await;
    let c = d.client();
    // A root filesystem with one static program in it: the sandpit binary itself.
    let rootfs = sandpit_tests::temp_dir("sandpit-rootfs-");
    std::fs::create_dir_all(rootfs.path().join("usr/bin")).unwrap();
    std::fs::copy(sandpit_bin(), rootfs.path().join("usr/bin/sandpit")).unwrap();
    // A hostile template: symlinks where sandpit sets things up, pointing at host paths,
    // and a device node.
    let victim = sandpit_tests::temp_dir("sandpit-victim-");
    for (name, target) in [
        ("tmp", "t"),
        ("etc", "e"),
        ("proc", "p"),
        (".sandpit", "s"),
        ("workspace", "w"),
    ] {
        std::fs::create_dir(victim.path().join(target)).unwrap();
        std::os::unix::fs::symlink(victim.path().join(target), rootfs.path().join(name)).unwrap();
    }
    let zero = std::ffi::CString::new(
        rootfs
            .path()
            .join("usr/bin/zero")
            .to_string_lossy()
            .as_bytes(),
    )
    .unwrap();
    // SAFETY: mknod with a valid NUL-terminated path; the test runs as root.
    let made = unsafe { libc::mknod(zero.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 5)) };
    assert_eq!(made, 0);
    let out = std::process::Command::new(sandpit_bin())
        .args(["template", "add", "tiny", "--rootfs"])
        .arg(rootfs.path())
        .arg("--data-dir")
        .arg(d.data.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        c.list_templates()
            .await
            .unwrap()
            .iter()
            .any(|t| t.name == "tiny")
    );
    let sb = c
        .create_sandbox(&CreateSandboxRequest {
            template: Some("tiny".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    let r = c
        .run(&sb.id, &command(&["/usr/bin/sandpit", "--version"]))
        .await
        .unwrap();
    assert_eq!(r.exit_code, 0, "{r:?}");
    assert!(r.stdout.starts_with("sandpit"), "{r:?}");
    // the host's /usr is not there: only the template's
    assert_eq!(
        c.stat(&sb.id, "/usr/bin/python3")
            .await
            .unwrap_err()
            .status(),
        Some(404)
    );
    // the template's files (owned by the host's root) belong to the sandbox's root, who
    // can change its own copy of them; the template directory itself never changes
    let st = c.stat(&sb.id, "/usr/bin/sandpit").await.unwrap();
    assert_eq!(
        (st.owner.as_str(), st.group.as_str()),
        ("root", "root"),
        "{st:?}"
    );
    let req = RunCommandRequest {
        argv: vec!["/usr/bin/sandpit".into(), "cp".into(), "--help".into()],
        user: Some("root".into()),
        ..Default::default()
    };
    assert_eq!(c.run(&sb.id, &req).await.unwrap().exit_code, 0);
    // As root, replace the binary in place (the API writes through the agent, which is root).
    let up = sandpit_tests::http()
        .put(format!(
            "{}/v1/sandboxes/{}/files?path=/usr/bin/sandpit&user=root",
            d.url, sb.id
        ))
        .header("authorization", format!("Bearer {}", d.key))
        .body("replaced")
        .send()
        .await
        .unwrap();
    assert_eq!(
        up.status(),
        200,
        "root must be able to modify its own copy of the template"
    );
    assert_eq!(
        c.read_file(&sb.id, "/usr/bin/sandpit")
            .await
            .unwrap()
            .as_ref(),
        b"replaced"
    );
    assert!(
        std::fs::metadata(rootfs.path().join("usr/bin/sandpit"))
            .unwrap()
            .len()
            > 1000
    );
    // nothing of the hostile template's symlinks reached the host, and its device is dead
    for t in ["t", "e", "p", "s", "w"] {
        let dir = victim.path().join(t);
        assert_eq!(
            std::fs::read_dir(&dir).unwrap().count(),
            0,
            "{t} was written through a symlink"
        );
        use std::os::unix::fs::MetadataExt;
        assert_eq!(std::fs::metadata(&dir).unwrap().uid(), 0);
    }
    // the device node is there but cannot be opened (the root filesystem is nodev)
    assert_eq!(c.stat(&sb.id, "/usr/bin/zero").await.unwrap().name, "zero");
    let e = c.read_file(&sb.id, "/usr/bin/zero").await.unwrap_err();
    assert_eq!(e.status(), Some(403), "{e}");
    // writes land in the sandbox's own layer, never in the template directory
    c.write_file(&sb.id, "/home/user/new", "x").await.unwrap();
    assert_eq!(
        c.read_file(&sb.id, "/home/user/new")
            .await
            .unwrap()
            .as_ref(),
        b"x"
    );
    assert!(!rootfs.path().join("home/user/new").exists() && !rootfs.path().join("home").exists());
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_run_prints_42_and_serve_refuses_unsafe_flags() {
    let d = Daemon::start().await;
    let out = std::process::Command::new(sandpit_bin())
        .args(["run", "--", "python3", "-c", "print(6*7)"])
        .env("SANDPIT_URL", &d.url)
        .env("SANDPIT_DATA_DIR", d.data.path())
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "42\n",
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success());
    let out = std::process::Command::new(sandpit_bin())
        .args(["run", "--", "bash", "-c", "exit 9"])
        .env("SANDPIT_URL", &d.url)
        .env("SANDPIT_DATA_DIR", d.data.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(9));
    assert!(
        sandboxes(&d.client()).await.is_empty(),
        "run must delete its sandbox"
    );
    let tmp = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(sandpit_bin())
        .args([
            "serve",
            "--listen",
            "0.0.0.0:0",
            "--insecure-no-auth",
            "--data-dir",
        ])
        .arg(tmp.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("loopback"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_freezes_processes_and_resume_keeps_them() {
    let d = Daemon::start().await;
    let c = d.client();
    let id = c
        .create_sandbox(&CreateSandboxRequest {
            timeout: Some(600),
            auto_resume: Some(false),
            ..Default::default()
        })
        .await
        .unwrap()
        .id;
    let bg = c
        .run_background(
            &id,
            &bash("i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.05; done"),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    for round in 0..2 {
        c.pause(&id).await.unwrap();
        assert_eq!(c.get_sandbox(&id).await.unwrap().state, "paused");
        assert_eq!(
            c.pause(&id).await.unwrap().state,
            "paused",
            "round {round}: pausing again changes nothing"
        );
        assert_eq!(
            sh_status(&c, &id).await,
            Some(409),
            "a paused sandbox runs nothing"
        );
        let frozen_at = d.client().stats(&id).await.unwrap().cpu_usage_ns;
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            d.client().stats(&id).await.unwrap().cpu_usage_ns,
            frozen_at,
            "no CPU while frozen"
        );
        c.resume(&id).await.unwrap();
        assert_eq!(c.resume(&id).await.unwrap().state, "running");
        let a = sh(&c, &id, "cat /tmp/count").await.stdout;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let b = sh(&c, &id, "cat /tmp/count").await.stdout;
        assert!(
            b.trim().parse::<u32>().unwrap() > a.trim().parse::<u32>().unwrap(),
            "the loop runs again after resume"
        );
    }
    assert!(
        c.list_commands(&id)
            .await
            .unwrap()
            .iter()
            .any(|p| p.pid == bg.pid)
    );
    // a paused sandbox can still be deleted outright
    c.pause(&id).await.unwrap();
    c.delete_sandbox(&id).await.unwrap();
    d.shutdown().await;
}

async fn sh_status(c: &sandpit_client::Client, id: &str) -> Option<u16> {
    let req = command(&["true"]);
    c.run(id, &req).await.err().and_then(|e| e.status())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_key_stops_working_within_the_cache_time() {
    let d = Daemon::start().await;
    let db = d.store().await;
    let (key, secret) = db.create_api_key("carol", "test").await.unwrap();
    let carol = sandpit_client::Client::new(&d.url, Some(secret)).unwrap();
    carol.list_sandboxes(None, &[], None, None).await.unwrap();
    assert!(db.revoke_api_key(&key.id).await.unwrap());
    db.close().await;
    let mut refused = false;
    for _ in 0..80 {
        match carol.list_sandboxes(None, &[], None, None).await {
            Err(e) if e.status() == Some(401) => {
                refused = true;
                break;
            }
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    assert!(refused, "a revoked key still works after 8 s");
    d.shutdown().await;
}
