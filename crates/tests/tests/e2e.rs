//! End-to-end tests against a real daemon and real container sandboxes. Each test starts
//! its own daemon (own data dir, own cgroup parent) and removes what it made.

use sandpit_api::{CommandEvent, CreateSandboxRequest, LimitsSpec, RunCommandRequest};
use sandpit_tests::{
    Daemon, bash, command, http, leftovers, sandboxes, sh, sh_root, tmpfs_mounted_on,
    wait_no_leftovers,
};
use sha2::{Digest, Sha256};
use std::time::Duration;

/// The harness's small limits, with at most 64 processes.
fn small() -> LimitsSpec {
    LimitsSpec {
        max_processes: Some(64),
        ..sandpit_tests::small()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_prints_42_and_commands_report_exit_codes_and_streams() {
    let d = Daemon::start().await;
    let c = d.client();
    let id = d.sandbox(small()).await;
    let r = c
        .run(&id, &command(&["python3", "-c", "print(6*7)"]))
        .await
        .unwrap();
    assert_eq!((r.exit_code, r.stdout.as_str()), (0, "42\n"));
    let r = sh(&c, &id, "echo out; echo err >&2; exit 7").await;
    assert_eq!(
        (r.exit_code, r.stdout.as_str(), r.stderr.as_str()),
        (7, "out\n", "err\n")
    );
    // stdin is delivered and closed
    let req = RunCommandRequest {
        argv: vec!["wc".into(), "-c".into()],
        stdin: Some("hello".into()),
        ..Default::default()
    };
    assert_eq!(c.run(&id, &req).await.unwrap().stdout.trim(), "5");
    // output cap
    let req = RunCommandRequest {
        max_output_bytes: Some(1000),
        ..bash("head -c 100000 /dev/zero")
    };
    let r = c.run(&id, &req).await.unwrap();
    assert!(r.truncated && r.stdout.len() == 1000);
    // 50 MB of output over the stream, all of it
    let req = bash("head -c 52428800 /dev/zero; echo done >&2");
    let (out, err, code) = c
        .stream_command(&id, &req)
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    assert_eq!(
        (out.len(), err.as_slice(), code),
        (52_428_800, &b"done\n"[..], 0)
    );
    // unknown command: a clear 404, not a 500
    let bad = c.run(&id, &command(&["/nope"])).await.unwrap_err();
    assert_eq!(bad.status(), Some(404));
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn isolation_holds() {
    let d = Daemon::start().await;
    let c = d.client();
    let id = d.sandbox(small()).await;
    let daemon_pid = d.pid();
    // only the sandbox's own processes are visible
    let r = sh(
        &c,
        &id,
        "ls /proc | grep -E '^[0-9]+$' | sort -n | head -1; ls /proc | grep -cE '^[0-9]+$'",
    )
    .await;
    let mut lines = r.stdout.lines();
    assert_eq!(lines.next(), Some("1"));
    assert!(
        lines.next().unwrap().parse::<u32>().unwrap() < 10,
        "{}",
        r.stdout
    );
    assert_ne!(
        sh(&c, &id, &format!("kill -0 {daemon_pid}"))
            .await
            .exit_code,
        0
    );
    // root inside is an unprivileged uid outside
    let r = sh_root(&c, &id, "id -u; cat /proc/self/uid_map").await;
    let map: Vec<&str> = r
        .stdout
        .lines()
        .nth(1)
        .unwrap()
        .split_whitespace()
        .collect();
    assert_eq!(r.stdout.lines().next(), Some("0"));
    assert_eq!(map[0], "0");
    assert!(map[1].parse::<u64>().unwrap() >= 1_000_000_000);
    // host files are not writable, mounts and namespaces refused, even for root
    let r = sh_root(&c, &id, "touch /usr/x 2>&1; mount -t tmpfs t /mnt 2>&1; unshare -U true 2>&1; echo > /proc/sysrq-trigger 2>&1; grep -E '^(Seccomp|NoNewPrivs):' /proc/self/status").await;
    assert!(r.stdout.contains("Read-only file system"), "{}", r.stdout);
    assert!(
        r.stdout.contains("permission denied") || r.stdout.contains("Operation not permitted"),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout.contains("Seccomp:\t2") && r.stdout.contains("NoNewPrivs:\t1"),
        "{}",
        r.stdout
    );
    // module loading and kexec are refused by seccomp; ptrace of the host is impossible
    let py = format!(
        "import ctypes,os; l=ctypes.CDLL(None,use_errno=True); r=l.syscall(175,0,0,0); print(r, ctypes.get_errno()); r=l.syscall(101,16,1,0,0); print(r, ctypes.get_errno()); r=l.syscall(101,16,{daemon_pid},0,0); print(r, ctypes.get_errno())"
    );
    let r = c
        .run(
            &id,
            &RunCommandRequest {
                argv: vec!["python3".into(), "-c".into(), py],
                user: Some("root".into()),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let lines: Vec<&str> = r.stdout.lines().collect();
    assert_eq!(
        lines[0], "-1 1",
        "init_module must fail with EPERM: {}",
        r.stdout
    );
    assert_eq!(
        lines[1], "-1 1",
        "ptrace(ATTACH) of the agent (PID 1) must fail with EPERM: {}",
        r.stdout
    );
    assert_eq!(
        lines[2], "-1 3",
        "ptrace(ATTACH) of a host pid must fail with ESRCH: {}",
        r.stdout
    );
    // the network is loopback only (network mode `none` by default): the sandbox's link,
    // when the daemon gives it one, is down with no route at all, and the daemon's port
    // on the host's loopback is not reachable from the sandbox's own loopback
    let r = sh(&c, &id, "ls /sys/class/net").await;
    let links: Vec<&str> = r.stdout.split_whitespace().collect();
    assert!(links == ["lo"] || links == ["eth0", "lo"], "{links:?}");
    let r = sh(
        &c,
        &id,
        "tail -n +2 /proc/net/route | wc -l; cat /sys/class/net/eth0/operstate 2>/dev/null || echo down",
    )
    .await;
    assert_eq!(
        r.stdout.split_whitespace().collect::<Vec<_>>(),
        vec!["0", "down"]
    );
    let probe = format!(
        "import socket; s=socket.socket(); s.settimeout(2); print(s.connect_ex(('127.0.0.1', {})))",
        d.port
    );
    let r = c
        .run(
            &id,
            &RunCommandRequest {
                argv: vec!["python3".into(), "-c".into(), probe],
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(
        r.stdout.trim(),
        "111",
        "connecting to the daemon's port must be refused: {r:?}"
    );
    // the agent's listening socket (fd 3) is not inherited by commands, and no command
    // can shield itself from the OOM killer
    // (a plain command, no pipeline, so the shell itself holds no extra descriptors)
    let r = sh(&c, &id, "for f in /proc/$$/fd/*; do readlink $f; done").await;
    assert!(
        !r.stdout.contains("socket:"),
        "a socket leaked into a command: {}",
        r.stdout
    );
    let r = sh_root(
        &c,
        &id,
        "cat /proc/self/oom_score_adj; echo -1000 > /proc/self/oom_score_adj && echo lowered",
    )
    .await;
    assert_eq!(r.stdout.trim(), "0", "{r:?}");
    // the host's /etc secrets are not there
    assert_ne!(sh_root(&c, &id, "test -e /etc/shadow").await.exit_code, 0);
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_contain_memory_fork_and_disk_bombs() {
    let d = Daemon::start().await;
    let c = d.client();
    let limits = LimitsSpec {
        memory_bytes: Some(64 << 20),
        max_processes: Some(32),
        disk_bytes: Some(16 << 20),
        ..Default::default()
    };
    let id = d.sandbox(limits).await;
    let r = c
        .run(
            &id,
            &command(&[
                "python3",
                "-c",
                "x = bytearray(512 << 20); print('survived')",
            ]),
        )
        .await
        .unwrap();
    assert_eq!(r.exit_code, 137, "memory bomb must be OOM-killed: {r:?}");
    let r = sh(&c, &id, "for i in $(seq 100); do sleep 5 & done 2>&1 | grep -c 'Resource temporarily unavailable'; true").await;
    assert!(
        r.stdout.trim().parse::<u32>().unwrap_or(0) > 0,
        "fork bomb must hit max_processes: {r:?}"
    );
    let r = sh(
        &c,
        &id,
        "pkill sleep; dd if=/dev/zero of=/tmp/fill bs=1M count=64 2>&1; echo rc=$?",
    )
    .await;
    assert!(r.stdout.contains("No space left on device"), "{}", r.stdout);
    c.health().await.unwrap();
    let st = c.stats(&id).await.unwrap();
    assert!(st.memory_peak_bytes > 0);
    // still usable after all that
    assert_eq!(sh(&c, &id, "rm /tmp/fill; echo ok").await.stdout, "ok\n");
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeouts_signals_and_background_reattach() {
    let d = Daemon::start().await;
    let c = d.client();
    let id = d.sandbox(small()).await;
    // timeout kills the whole tree, including a grandchild in its own process group
    let req = RunCommandRequest {
        timeout_ms: Some(500),
        ..bash("setsid sleep 300 & sleep 300")
    };
    let r = c.run(&id, &req).await.unwrap();
    assert!(r.timed_out && r.exit_code == 137, "{r:?}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(sh(&c, &id, "pgrep -c sleep; true").await.stdout.trim(), "0");
    // background command survives the client going away; its output is kept
    let bg = c
        .run_background(&id, &bash("echo first; sleep 1; echo second; sleep 30"))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        c.list_commands(&id)
            .await
            .unwrap()
            .iter()
            .any(|p| p.pid == bg.pid)
    );
    let mut s = c.attach(&id, bg.pid).await.unwrap();
    let mut seen = String::new();
    while !seen.contains("second") {
        match tokio::time::timeout(Duration::from_secs(10), s.next_event())
            .await
            .unwrap()
            .unwrap()
        {
            Some(CommandEvent::Stdout { data }) => seen
                .push_str(&String::from_utf8(sandpit_client::decode_data(&data).unwrap()).unwrap()),
            Some(_) => {}
            None => break,
        }
    }
    assert_eq!(seen, "first\nsecond\n");
    c.signal(&id, bg.pid, "SIGTERM").await.unwrap();
    let mut code = None;
    while let Ok(Ok(Some(ev))) = tokio::time::timeout(Duration::from_secs(10), s.next_event()).await
    {
        if let CommandEvent::End { exit_code, .. } = ev {
            code = Some(exit_code);
            break;
        }
    }
    assert_eq!(code, Some(143));
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_round_trip_and_escapes_are_refused() {
    let d = Daemon::start().await;
    let c = d.client();
    let id = d
        .sandbox(LimitsSpec {
            memory_bytes: Some(1 << 30),
            disk_bytes: Some(512 << 20),
            ..Default::default()
        })
        .await;
    let local = tempfile::NamedTempFile::new().unwrap();
    let mut data = vec![0u8; 100 << 20];
    for (i, b) in data.iter_mut().enumerate() {
        *b = (i.wrapping_mul(2654435761) >> 13) as u8;
    }
    std::fs::write(local.path(), &data).unwrap();
    c.upload_from_file(&id, "/workspace/big/blob.bin", local.path())
        .await
        .unwrap();
    let back = c.read_file(&id, "/workspace/big/blob.bin").await.unwrap();
    assert_eq!(
        hex::encode(Sha256::digest(&back)),
        hex::encode(Sha256::digest(&data))
    );
    let inside = sh(&c, &id, "sha256sum /workspace/big/blob.bin | cut -d' ' -f1").await;
    assert_eq!(inside.stdout.trim(), hex::encode(Sha256::digest(&data)));
    drop(back);
    let st = c.stat(&id, "/workspace/big/blob.bin").await.unwrap();
    assert_eq!((st.size, st.owner.as_str()), (100 << 20, "user"));
    c.copy_path(&id, "/workspace/big", "/workspace/copy")
        .await
        .unwrap();
    c.move_path(&id, "/workspace/copy/blob.bin", "/home/user/moved.bin")
        .await
        .unwrap();
    assert_eq!(
        c.stat(&id, "/home/user/moved.bin").await.unwrap().size,
        100 << 20
    );
    c.remove(&id, "/workspace/big").await.unwrap();
    assert_eq!(
        c.stat(&id, "/workspace/big").await.unwrap_err().status(),
        Some(404)
    );
    c.mkdir(&id, "/workspace/a/b").await.unwrap();
    assert!(
        c.list_dir(&id, "/workspace", 2)
            .await
            .unwrap()
            .iter()
            .any(|e| e.path == "/workspace/a/b" && e.r#type == "dir")
    );
    // file operations are checked as the acting user: `user` cannot read root's files or
    // write where it may not; `root` can
    sh_root(&c, &id, "echo s > /root/secret && chmod 600 /root/secret").await;
    assert_eq!(
        c.read_file(&id, "/root/secret").await.unwrap_err().status(),
        Some(403)
    );
    assert_eq!(
        c.write_file(&id, "/etc/x", "x").await.unwrap_err().status(),
        Some(403)
    );
    assert_eq!(
        c.mkdir(&id, "/usr/local/newdir")
            .await
            .unwrap_err()
            .status(),
        Some(403)
    );
    let http = http();
    let as_root = http
        .get(format!(
            "{}/v1/sandboxes/{id}/files?path=/root/secret&user=root",
            d.url
        ))
        .header("authorization", format!("Bearer {}", d.key))
        .send()
        .await
        .unwrap();
    assert_eq!(as_root.status(), 200);
    assert_eq!(as_root.text().await.unwrap(), "s\n");
    // escapes: `..` above the root is refused; symlinks resolve inside the sandbox only
    assert_eq!(
        c.read_file(&id, "/../../etc/passwd")
            .await
            .unwrap_err()
            .status(),
        Some(403)
    );
    sh(
        &c,
        &id,
        &format!("ln -s {} /tmp/host-data", d.data.path().display()),
    )
    .await;
    assert_eq!(
        c.read_file(&id, "/tmp/host-data/admin.key")
            .await
            .unwrap_err()
            .status(),
        Some(404)
    );
    assert_eq!(
        c.read_file(&id, "relative/../../../..")
            .await
            .unwrap_err()
            .status(),
        Some(403)
    );
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_runtime_strips_secrets_and_refuses_symlink_escapes() {
    // Off unless the daemon opts in: its commands run on the host.
    let d = Daemon::start().await;
    let req = CreateSandboxRequest {
        runtime: Some("process".into()),
        ..Default::default()
    };
    assert_eq!(
        d.client().create_sandbox(&req).await.unwrap_err().status(),
        Some(403)
    );
    assert!(
        d.client()
            .info()
            .await
            .unwrap()
            .runtimes
            .iter()
            .all(|r| r.isolated)
    );
    d.shutdown().await;
    let d = Daemon::builder()
        .args(&["--allow-process-runtime"])
        .start()
        .await;
    let c = d.client();
    let req = CreateSandboxRequest {
        runtime: Some("process".into()),
        env: [("MY_TOKEN".to_string(), "given".to_string())].into(),
        ..Default::default()
    };
    let sb = c.create_sandbox(&req).await.unwrap();
    assert!(!sb.isolated);
    let r = sh(
        &c,
        &sb.id,
        "env | grep -E 'TOKEN|KEY|SECRET' | sort; ln -s /etc/passwd $HOME/link",
    )
    .await;
    assert_eq!(r.stdout, "MY_TOKEN=given\n");
    assert_eq!(
        c.read_file(&sb.id, "/home/user/link")
            .await
            .unwrap_err()
            .status(),
        Some(403)
    );
    // files written by the API and by commands meet in the same place; copy works there too
    c.write_file(&sb.id, "/workspace/in.txt", "hello")
        .await
        .unwrap();
    assert_eq!(
        sh(&c, &sb.id, "cat $HOME/../../workspace/in.txt")
            .await
            .stdout,
        "hello"
    );
    c.copy_path(&sb.id, "/workspace/in.txt", "/workspace/out.txt")
        .await
        .unwrap();
    assert_eq!(
        c.read_file(&sb.id, "/workspace/out.txt")
            .await
            .unwrap()
            .as_ref(),
        b"hello"
    );
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_and_expiry_leave_nothing_behind() {
    let d = Daemon::start().await;
    let c = d.client();
    let id = d.sandbox(small()).await;
    sh(&c, &id, "sleep 100 & echo started").await;
    c.delete_sandbox(&id).await.unwrap();
    // Gone for callers at once; its resources go in the background, within moments.
    assert_eq!(c.get_sandbox(&id).await.unwrap_err().status(), Some(404));
    assert_eq!(c.delete_sandbox(&id).await.unwrap_err().status(), Some(404));
    assert_eq!(wait_no_leftovers(&d, &id).await, Vec::<String>::new());
    let short = c
        .create_sandbox(&CreateSandboxRequest {
            timeout: Some(1),
            ..Default::default()
        })
        .await
        .unwrap();
    let mut gone = false;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if c.get_sandbox(&short.id).await.is_err() {
            gone = true;
            break;
        }
    }
    assert!(gone, "sandbox with a 1 s timeout did not expire");
    assert_eq!(wait_no_leftovers(&d, &short.id).await, Vec::<String>::new());
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_of_the_daemon_then_restart_reconciles() {
    let mut d = Daemon::start().await;
    let c = d.client();
    let alive = d.sandbox(small()).await;
    let doomed = d.sandbox(small()).await;
    let paused = d.sandbox(small()).await;
    let half_deleted = d.sandbox(small()).await;
    sh(&c, &alive, "echo kept > /tmp/mark").await;
    c.pause(&paused).await.unwrap();
    d.kill9();
    // kill one sandbox while the daemon is down
    let db = d.store().await;
    let rec = db.get_sandbox(&doomed).await.unwrap().unwrap();
    let pid = rec.runtime_state["pid"].as_i64().unwrap() as i32;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    // A delete cut short by the crash: recorded as stopping, resources still there.
    db.transition(
        &half_deleted,
        &[sandpit_store::SandboxState::Running],
        sandpit_store::SandboxState::Stopping,
        None,
    )
    .await
    .unwrap()
    .unwrap();
    db.close().await;
    // Leftovers of a sandbox the store never heard of (a create cut short by the crash).
    let orphan = "orphan0000000000000";
    std::fs::create_dir_all(d.data.path().join("sandboxes").join(orphan).join("rootfs")).unwrap();
    let parent = std::fs::read_dir("/sys/fs/cgroup/memory")
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.join(&alive).exists())
        .expect("the live sandbox's memory cgroup");
    std::fs::create_dir(parent.join(orphan)).unwrap();
    let d = d.restart().start().await;
    let c = d.client();
    assert_eq!(sh(&c, &alive, "cat /tmp/mark").await.stdout, "kept\n");
    let dead = c.get_sandbox(&doomed).await.unwrap();
    assert_eq!(dead.state, "stopped");
    assert_eq!(leftovers(&d, &doomed), Vec::<String>::new());
    assert_eq!(
        c.get_sandbox(&half_deleted).await.unwrap_err().status(),
        Some(404),
        "an interrupted delete is finished on start"
    );
    assert_eq!(leftovers(&d, &half_deleted), Vec::<String>::new());
    assert_eq!(
        leftovers(&d, orphan),
        Vec::<String>::new(),
        "orphans are swept on start"
    );
    assert_eq!(
        c.get_sandbox(&paused).await.unwrap().state,
        "paused",
        "a paused sandbox survives a restart"
    );
    c.resume(&paused).await.unwrap();
    assert_eq!(sh(&c, &paused, "echo back").await.stdout, "back\n");
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owners_only_see_their_own_sandboxes() {
    let d = Daemon::start().await;
    let admin = d.client();
    let id = d.sandbox(small()).await;
    let other = d.owner("mallory").await;
    assert_eq!(
        other.get_sandbox(&id).await.unwrap_err().status(),
        Some(404)
    );
    assert_eq!(
        other.delete_sandbox(&id).await.unwrap_err().status(),
        Some(404)
    );
    assert_eq!(
        other
            .read_file(&id, "/etc/hostname")
            .await
            .unwrap_err()
            .status(),
        Some(404)
    );
    assert!(sandboxes(&other).await.is_empty());
    let anon = sandpit_client::Client::new(&d.url, None).unwrap();
    assert_eq!(anon.get_sandbox(&id).await.unwrap_err().status(), Some(401));
    let wrong = sandpit_client::Client::new(
        &d.url,
        Some("sp_0000000000000000000000000000000000000000".into()),
    )
    .unwrap();
    assert_eq!(
        wrong
            .list_sandboxes(None, &[], None, None)
            .await
            .unwrap_err()
            .status(),
        Some(401)
    );
    assert_eq!(admin.get_sandbox(&id).await.unwrap().id, id);
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_a_clear_4xx_and_leaves_nothing() {
    let d = Daemon::start().await;
    let c = d.client();
    // A template that does not exist is not found; the rest is malformed.
    let unknown = CreateSandboxRequest {
        template: Some("nope".into()),
        ..Default::default()
    };
    let e = c.create_sandbox(&unknown).await.unwrap_err();
    assert_eq!(e.status(), Some(404), "{e}");
    let cases = [
        CreateSandboxRequest {
            runtime: Some("vm".into()),
            ..Default::default()
        },
        CreateSandboxRequest {
            timeout: Some(0),
            ..Default::default()
        },
        CreateSandboxRequest {
            limits: LimitsSpec {
                memory_bytes: Some(1),
                ..Default::default()
            },
            ..Default::default()
        },
        CreateSandboxRequest {
            limits: LimitsSpec {
                max_processes: Some(u64::MAX),
                ..Default::default()
            },
            ..Default::default()
        },
        CreateSandboxRequest {
            env: [("A=B".to_string(), "x".to_string())].into(),
            ..Default::default()
        },
        CreateSandboxRequest {
            workdir: Some("relative".into()),
            ..Default::default()
        },
    ];
    for req in cases {
        let e = c.create_sandbox(&req).await.unwrap_err();
        assert_eq!(e.status(), Some(400), "{req:?}: {e}");
    }
    let http = http();
    let url = format!("{}/v1/sandboxes", d.url);
    let auth = format!("Bearer {}", d.key);
    let r = http
        .post(&url)
        .header("authorization", &auth)
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let body: serde_json::Value = r.json().await.unwrap();
    assert!(body["code"].is_string() && body["message"].is_string());
    let big = format!("{{\"metadata\":{{\"k\":\"{}\"}}}}", "x".repeat(2 << 20));
    // A fresh client: the server closes a connection whose oversized body it did not read.
    let r = sandpit_tests::http()
        .post(&url)
        .header("authorization", &auth)
        .header("content-type", "application/json")
        .body(big)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    let r = http
        .post(&url)
        .header("authorization", &auth)
        .header("content-type", "application/json")
        .body("{\"unknown\":1}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert!(sandboxes(&c).await.is_empty());
    // paths and users that must never reach the agent as given
    let id = d.sandbox(LimitsSpec::default()).await;
    let long = format!("/{}", "x".repeat(5000));
    for path in ["/tmp/a\0b", long.as_str(), ""] {
        let e = c.read_file(&id, path).await.unwrap_err();
        assert_eq!(e.status(), Some(400), "{path:?}: {e}");
    }
    let r = http
        .get(format!(
            "{}/v1/sandboxes/{id}/files?path=/etc/hostname&user=mallory",
            d.url
        ))
        .header("authorization", &auth)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let bad_runs = [
        RunCommandRequest {
            argv: vec![],
            ..Default::default()
        },
        RunCommandRequest {
            argv: vec!["true".into()],
            user: Some("nobody".into()),
            ..Default::default()
        },
        RunCommandRequest {
            argv: vec!["true".into()],
            env: [("BAD=NAME".to_string(), "x".to_string())].into(),
            ..Default::default()
        },
    ];
    for req in bad_runs {
        let e = c.run(&id, &req).await.unwrap_err();
        assert_eq!(e.status(), Some(400), "{req:?}");
    }
    assert_eq!(
        c.get_sandbox("../../etc").await.unwrap_err().status(),
        Some(404)
    );
    let doc: serde_json::Value = http
        .get(format!("{}/v1/openapi.json", d.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(doc["paths"]["/v1/sandboxes"].is_object());
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_create_leaves_no_half_made_sandbox() {
    let d = Daemon::start().await;
    let c = d.client();
    // A template whose directory vanished after it was registered: the runtime refuses it.
    let db = d.store().await;
    let t = sandpit_store::TemplateRecord {
        name: "gone".into(),
        rootfs: "/var/tmp/sandpit-no-such-rootfs".into(),
        created_at_ms: 0,
        ..Default::default()
    };
    db.upsert_template(&t).await.unwrap();
    db.close().await;
    let e = c
        .create_sandbox(&CreateSandboxRequest {
            template: Some("gone".into()),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.status(), Some(400), "{e}");
    assert!(sandboxes(&c).await.is_empty());
    let dirs: Vec<_> = std::fs::read_dir(d.data.path().join("sandboxes"))
        .unwrap()
        .collect();
    assert!(dirs.is_empty(), "{dirs:?}");
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_sandbox_while_it_is_created_leaves_nothing() {
    let d = Daemon::start().await;
    let c = d.client();
    let mut caught = 0;
    for round in 0..5 {
        let creator = {
            let c = c.clone();
            tokio::spawn(async move {
                c.create_sandbox(&CreateSandboxRequest {
                    limits: small(),
                    ..Default::default()
                })
                .await
            })
        };
        // Delete it the moment it shows up, whatever state it is in.
        let mut id = None;
        for _ in 0..2000 {
            let listed = c.list_sandboxes(None, &[], None, None).await.unwrap();
            if let Some(s) = listed.items.first() {
                if s.state == "creating" {
                    caught += 1;
                }
                id = Some(s.id.clone());
                let _ = c.delete_sandbox(&s.id).await;
                break;
            }
        }
        let created = creator.await.unwrap();
        let id = id.unwrap_or_else(|| panic!("round {round}: never listed ({created:?})"));
        if let Ok(sb) = &created {
            assert_eq!(sb.id, id);
        }
        assert_eq!(c.get_sandbox(&id).await.unwrap_err().status(), Some(404));
        assert_eq!(wait_no_leftovers(&d, &id).await, Vec::<String>::new());
    }
    eprintln!("deleted {caught} of 5 sandboxes while they were being created");
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_directories_live_on_a_tmpfs_that_a_clean_stop_unmounts() {
    let d = Daemon::start().await;
    let dir = d.data.path().join("sandboxes");
    assert!(tmpfs_mounted_on(&dir), "no tmpfs on {}", dir.display());
    let id = d.sandbox(small()).await;
    assert!(dir.join(&id).join("agent.sock").exists());
    let path = dir.clone();
    d.shutdown().await;
    assert!(
        !tmpfs_mounted_on(&path),
        "the tmpfs outlived a clean stop with no sandboxes"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn descriptors_the_daemon_inherited_never_reach_a_sandbox() {
    let d = Daemon::builder().stray_fd().start().await;
    let c = d.client();
    let id = d.sandbox(small()).await;
    // The stray descriptor is /dev/null: beyond stdio, neither the agent (PID 1) nor a
    // command may hold one.
    let agent = sh_root(
        &c,
        &id,
        "for f in /proc/1/fd/*; do n=${f##*/}; [ $n -gt 2 ] && readlink $f; done; true",
    )
    .await;
    assert!(!agent.stdout.contains("/dev/null"), "{agent:?}");
    let own = sh(&c, &id, "for f in /proc/$$/fd/*; do echo ${f##*/}; done").await;
    let fds: Vec<&str> = own.stdout.lines().collect();
    assert!(!fds.contains(&"9"), "fd 9 leaked into a command: {fds:?}");
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_process_sandbox_kills_its_commands() {
    let d = Daemon::builder()
        .args(&["--allow-process-runtime"])
        .start()
        .await;
    let c = d.client();
    let sb = c
        .create_sandbox(&CreateSandboxRequest {
            runtime: Some("process".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    let marker = format!("sleep 4{}", std::process::id() % 100_000);
    let bg = RunCommandRequest {
        background: true,
        ..bash(&format!("{marker} & {marker}"))
    };
    c.run_background(&sb.id, &bg).await.unwrap();
    let running = || {
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
            .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
            .filter(|c| c.trim() == marker)
            .count()
    };
    for _ in 0..100 {
        if running() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(running(), 2);
    c.delete_sandbox(&sb.id).await.unwrap();
    let mut left = running();
    for _ in 0..100 {
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        left = running();
    }
    assert_eq!(left, 0, "commands of a deleted process sandbox still run");
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mounts_seen_inside_name_no_host_path() {
    let d = Daemon::start().await;
    let c = d.client();
    let id = d.sandbox(small()).await;
    sh(&c, &id, "echo kept > /tmp/f").await;
    let fork = c
        .fork(
            &id,
            &sandpit_api::ForkRequest {
                count: Some(1),
                ..Default::default()
            },
        )
        .await
        .expect("fork")
        .remove(0)
        .id;
    let data = d.data.path().to_str().expect("utf-8 data dir").to_string();
    for sb in [&id, &fork] {
        let out = sh_root(&c, sb, "cat /proc/self/mountinfo; mount").await;
        assert_eq!(out.exit_code, 0, "{}", out.stderr);
        let overlay = out
            .stdout
            .lines()
            .find(|l| l.contains(" - overlay "))
            .expect("the root overlay is listed");
        assert!(overlay.contains("upperdir=layer/upper"), "{overlay}");
        for secret in [data.as_str(), id.as_str(), fork.as_str()] {
            assert!(
                !out.stdout.contains(secret),
                "{secret} is visible in the sandbox's mounts:\n{}",
                out.stdout
            );
        }
    }
    assert_eq!(sh(&c, &fork, "cat /tmp/f").await.stdout, "kept\n");
    d.shutdown().await;
}
