//! Pause, hibernation, idle rules, snapshots (local and S3) and forks, against real
//! sandboxes.

use sandpit_api::{
    CreateSandboxRequest, CreateSnapshotRequest, ForkRequest, LimitsSpec, RunCommandRequest,
};
use sandpit_client::Client;
use sandpit_tests::{
    Daemon, bash, command, free_port, http, now_ms, sh, sh_root, template_build, wait_no_leftovers,
};
use std::time::Duration;

/// The harness's small limits, with a 256 MiB disk.
fn small() -> LimitsSpec {
    LimitsSpec {
        disk_bytes: Some(256 << 20),
        ..sandpit_tests::small()
    }
}

/// Creates the sandbox `req` asks for with [`small`] limits (whatever `req` says); its id.
async fn create(c: &Client, req: CreateSandboxRequest) -> String {
    let req = CreateSandboxRequest {
        limits: small(),
        ..req
    };
    sandpit_tests::create(c, req).await.id
}

/// Waits (up to 30 s) until the sandbox is in `state`.
async fn wait_state(c: &Client, id: &str, state: &str) -> String {
    let mut last = String::new();
    for _ in 0..300 {
        match c.get_sandbox(id).await {
            Ok(s) if s.state == state => return s.state,
            Ok(s) => last = s.state,
            Err(e) => last = format!("error: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    last
}

/// sha256 of every file below the listed paths, as `sha256sum` prints them, sorted.
async fn hashes(c: &Client, id: &str) -> String {
    let r = sh_root(
        c,
        id,
        "cd / && find home/user/data etc/sandpit-test var/tmp/sandpit-vt opt/tool -type f -print0 2>/dev/null | sort -z | xargs -0 sha256sum; \
         find home/user/data etc/sandpit-test var/tmp/sandpit-vt opt/tool 2>/dev/null | sort | xargs -r stat -c '%n %A %U' ",
    )
    .await;
    assert_eq!(r.exit_code, 0, "{}", r.stderr);
    r.stdout
}

fn layer_dirs(d: &Daemon) -> Vec<String> {
    std::fs::read_dir(d.data.path().join("layers"))
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().to_string())
                .collect()
        })
        .unwrap_or_default()
}

async fn wait_no_layers(d: &Daemon) -> Vec<String> {
    for _ in 0..100 {
        if layer_dirs(d).is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    layer_dirs(d)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_counter_continues_where_it_stopped_across_two_pauses_with_its_files_env_and_cwd() {
    let d = Daemon::start().await;
    let c = d.client();
    let id = create(
        &c,
        CreateSandboxRequest {
            auto_resume: Some(false),
            ..Default::default()
        },
    )
    .await;
    // The log stays open on fd 3 the whole time.
    sh(&c, &id, "mkdir -p /tmp/work").await;
    let bg = c
        .run_background(
            &id,
            &RunCommandRequest {
                env: [("COUNTER_ENV".to_string(), "kept".to_string())].into(),
                cwd: Some("/tmp/work".into()),
                ..bash("exec 3>>/tmp/work/log; i=0; while true; do i=$((i+1)); echo $i > count.new; mv count.new count; echo $i >&3; sleep 0.05; done")
            },
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    for round in 0..2 {
        let before: u64 = sh(&c, &id, "cat /tmp/work/count")
            .await
            .stdout
            .trim()
            .parse()
            .unwrap();
        let paused = c.pause(&id).await.unwrap();
        assert_eq!(paused.state, "paused", "round {round}");
        assert!(paused.lifecycle.paused_at_ms.is_some());
        // Pausing a paused sandbox changes nothing.
        assert_eq!(c.pause(&id).await.unwrap().state, "paused");
        // Without auto_resume, work on a paused sandbox is refused.
        let refused = c.run(&id, &command(&["true"])).await.unwrap_err();
        assert_eq!(refused.status(), Some(409), "round {round}");
        let frozen_at = c.stats(&id).await.unwrap().cpu_usage_ns;
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(
            c.stats(&id).await.unwrap().cpu_usage_ns,
            frozen_at,
            "no CPU while frozen"
        );
        assert_eq!(c.resume(&id).await.unwrap().state, "running");
        assert_eq!(
            c.resume(&id).await.unwrap().state,
            "running",
            "resume is idempotent"
        );
        let after: u64 = sh(&c, &id, "cat /tmp/work/count")
            .await
            .stdout
            .trim()
            .parse()
            .unwrap();
        // Running on for the 1.5 s pause would have added about 30; starting over, 1.
        assert!(
            after >= before && after - before < 15,
            "round {round}: {before} before the pause, {after} after"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
        let later: u64 = sh(&c, &id, "cat /tmp/work/count")
            .await
            .stdout
            .trim()
            .parse()
            .unwrap();
        assert!(later > after, "the loop goes on after resume");
    }
    // The same process, with its env, cwd and open file.
    // Read as the process's own user: root inside lacks CAP_SYS_PTRACE.
    let check = sh(
        &c,
        &id,
        &format!(
            "tr '\\0' '\\n' < /proc/{0}/environ | grep COUNTER_ENV; readlink /proc/{0}/cwd; readlink /proc/{0}/fd/3; \
             tail -n1 /tmp/work/log; cat /tmp/work/count",
            bg.pid
        ),
    )
    .await;
    let lines: Vec<&str> = check.stdout.lines().collect();
    assert_eq!(lines.len(), 5, "{check:?}");
    assert_eq!(
        &lines[..3],
        ["COUNTER_ENV=kept", "/tmp/work", "/tmp/work/log"],
        "{check:?}"
    );
    let (logged, count): (u64, u64) = (lines[3].parse().unwrap(), lines[4].parse().unwrap());
    assert!(
        count.abs_diff(logged) <= 1,
        "the open log got every count: {logged} vs {count}"
    );
    c.delete_sandbox(&id).await.unwrap();
    assert!(wait_no_leftovers(&d, &id).await.is_empty());
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hibernation_keeps_files_ends_processes_and_survives_a_restart() {
    let mut d = Daemon::start().await;
    let c = d.client();
    let id = create(
        &c,
        CreateSandboxRequest {
            env: [("HIB".to_string(), "env-kept".to_string())].into(),
            workdir: Some("/tmp".into()),
            user: Some("root".into()),
            ..Default::default()
        },
    )
    .await;
    let setup = sh_root(
        &c,
        &id,
        "mkdir -p /home/user/data/sub /etc/sandpit-test /var/tmp/sandpit-vt /opt/tool && echo vt > /var/tmp/sandpit-vt/f && echo tool > /opt/tool/t && head -c 300000 /dev/urandom > /home/user/data/blob \
         && echo hello > /home/user/data/sub/a && ln -s sub/a /home/user/data/link && echo x > /etc/sandpit-test/conf \
         && chown 1000:1000 /home/user/data/sub/a && chmod 4750 /etc/sandpit-test/conf && rm /etc/debian_version && echo one > /home/user/gone",
    )
    .await;
    assert_eq!(setup.exit_code, 0, "{setup:?}");
    let before = hashes(&c, &id).await;
    let bg = c
        .run_background(&id, &command(&["sleep", "1000"]))
        .await
        .unwrap();
    for round in 0..3 {
        let h = c.hibernate(&id).await.unwrap();
        assert_eq!(h.state, "hibernated", "round {round}");
        // Nothing of it runs on the host.
        assert!(wait_no_leftovers(&d, &id).await.is_empty(), "round {round}");
        if round == 1 {
            // A hibernated sandbox survives a daemon restart.
            d.stop();
            d = d.restart().start().await;
        }
        let c = d.client();
        assert_eq!(c.get_sandbox(&id).await.unwrap().state, "hibernated");
        // A command wakes it (auto_resume is on by default).
        let r = sh(
            &c,
            &id,
            "pwd; whoami; echo $HIB; test -e /etc/debian_version || echo no-debian-version",
        )
        .await;
        assert_eq!(
            r.stdout, "/tmp\nroot\nenv-kept\nno-debian-version\n",
            "round {round}: {r:?}"
        );
        assert_eq!(c.get_sandbox(&id).await.unwrap().state, "running");
        assert_eq!(hashes(&c, &id).await, before, "round {round}");
        let procs = c.list_commands(&id).await.unwrap();
        assert!(
            procs.iter().all(|p| p.pid != bg.pid),
            "processes end with hibernation"
        );
        // Changes after a resume are kept by the next hibernation, deletions too.
        let r = sh(&c, &id, "cat /home/user/gone 2>/dev/null || echo absent").await;
        let want = if round == 0 { "one\n" } else { "absent\n" };
        assert_eq!(r.stdout, want, "round {round}");
        sh_root(&c, &id, "rm -f /home/user/gone").await;
    }
    // Hibernating again and again does not pile up layers: they fold into one.
    let c = d.client();
    c.hibernate(&id).await.unwrap();
    let layers = layer_dirs(&d);
    assert_eq!(layers.len(), 1, "{layers:?}");
    c.delete_sandbox(&id).await.unwrap();
    assert!(wait_no_leftovers(&d, &id).await.is_empty());
    assert_eq!(
        wait_no_layers(&d).await,
        Vec::<String>::new(),
        "a deleted sandbox's layers go"
    );
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_sandboxes_pause_and_wake_on_the_next_call_and_keepalive_holds_them() {
    let d = Daemon::start().await;
    let c = d.client();
    let idle = create(
        &c,
        CreateSandboxRequest {
            idle_timeout: Some(2),
            ..Default::default()
        },
    )
    .await;
    let kept = create(
        &c,
        CreateSandboxRequest {
            idle_timeout: Some(3),
            ..Default::default()
        },
    )
    .await;
    let never = create(
        &c,
        CreateSandboxRequest {
            idle_timeout: Some(0),
            ..Default::default()
        },
    )
    .await;
    sh(&c, &idle, "echo state > /tmp/s").await;
    // `kept` gets a keep-alive every second for 6 s.
    for _ in 0..6 {
        c.keepalive(&kept).await.unwrap();
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    assert_eq!(wait_state(&c, &idle, "paused").await, "paused");
    assert_eq!(
        c.get_sandbox(&kept).await.unwrap().state,
        "running",
        "keep-alives hold it"
    );
    assert_eq!(c.get_sandbox(&never).await.unwrap().state, "running");
    // The next call wakes the idle one, with its files.
    assert_eq!(sh(&c, &idle, "cat /tmp/s").await.stdout, "state\n");
    assert_eq!(c.get_sandbox(&idle).await.unwrap().state, "running");
    // A long command counts as activity while it runs.
    let r = sh(&c, &idle, "sleep 4; echo done").await;
    assert_eq!(r.stdout, "done\n");
    assert_eq!(c.get_sandbox(&idle).await.unwrap().state, "running");
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeouts_pause_or_kill_and_paused_sandboxes_hibernate_later() {
    let d = Daemon::builder()
        .config_file("[lifecycle]\nhibernate_after_secs = 2\nmax_lifetime_secs = 40\n")
        .start()
        .await;
    let c = d.client();
    let pausing = create(
        &c,
        CreateSandboxRequest {
            timeout: Some(2),
            on_timeout: Some("pause".into()),
            ..Default::default()
        },
    )
    .await;
    let killed = create(
        &c,
        CreateSandboxRequest {
            timeout: Some(2),
            ..Default::default()
        },
    )
    .await;
    sh(&c, &pausing, "echo kept > /tmp/f").await;
    // Timeout → pause; paused for 2 s → hibernated.
    assert_eq!(wait_state(&c, &pausing, "hibernated").await, "hibernated");
    let gone = c.get_sandbox(&killed).await;
    assert_eq!(
        gone.unwrap_err().status(),
        Some(404),
        "the default timeout kills"
    );
    let woke = c.resume(&pausing).await.unwrap();
    assert_eq!(woke.state, "running");
    assert!(
        woke.expires_at_ms > now_ms() && woke.expires_at_ms < now_ms() + 10_000,
        "a resume gives the timeout again: {}",
        woke.expires_at_ms
    );
    assert_eq!(sh(&c, &pausing, "cat /tmp/f").await.stdout, "kept\n");
    c.delete_sandbox(&pausing).await.unwrap();
    let bad = c
        .create_sandbox(&CreateSandboxRequest {
            on_timeout: Some("explode".into()),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(bad.status(), Some(400));
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_maximum_lifetime_ends_any_sandbox() {
    let d = Daemon::builder()
        .config_file("[lifecycle]\nmax_lifetime_secs = 3\n")
        .start()
        .await;
    let c = d.client();
    let id = create(&c, CreateSandboxRequest::default()).await;
    let mut gone = false;
    for _ in 0..200 {
        if c.get_sandbox(&id).await.is_err() {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        gone,
        "a 600 s timeout does not outlive a 3 s maximum lifetime"
    );
    assert!(wait_no_leftovers(&d, &id).await.is_empty());
    d.shutdown().await;
}

/// Takes a full snapshot, then two incremental ones, and restores each: every restore has
/// exactly the files of its point. Then checks integrity, deletion rules and cleanup.
async fn snapshot_chain_restores_exact_files(d: &Daemon) {
    let c = d.client();
    let id = create(&c, CreateSandboxRequest::default()).await;
    sh_root(
        &c,
        &id,
        "mkdir -p /home/user/data/dir /etc/sandpit-test && head -c 2000000 /dev/urandom > /home/user/data/big \
         && echo v1 > /home/user/data/dir/f && echo keep > /home/user/data/keep && ln -s dir/f /home/user/data/link \
         && echo cfg > /etc/sandpit-test/c && chown -R 1000:1000 /home/user/data",
    )
    .await;
    let h1 = hashes(&c, &id).await;
    let s1 = c
        .snapshot(
            &id,
            &CreateSnapshotRequest {
                name: Some(format!("one-{id}")),
                incremental: true,
            },
        )
        .await
        .unwrap();
    assert_eq!(s1.kind, "full", "no snapshot before: a full one");
    assert!(s1.parent.is_none());
    sh_root(
        &c,
        &id,
        "echo v2 > /home/user/data/dir/f && rm /home/user/data/keep && echo new > /home/user/data/new && rm -r /etc/sandpit-test",
    )
    .await;
    let h2 = hashes(&c, &id).await;
    let s2 = c
        .snapshot(
            &id,
            &CreateSnapshotRequest {
                name: Some(format!("two-{id}")),
                incremental: true,
            },
        )
        .await
        .unwrap();
    assert_eq!(s2.kind, "incremental");
    assert_eq!(s2.parent.as_deref(), Some(s1.id.as_str()));
    assert!(
        s2.size_bytes < s1.size_bytes / 4,
        "the increment holds only the changes: {} vs {}",
        s2.size_bytes,
        s1.size_bytes
    );
    // Restore the middle point, change it, snapshot incrementally on top of it.
    let r2 = create(
        &c,
        CreateSandboxRequest {
            snapshot: Some(s2.name.clone()),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(hashes(&c, &r2).await, h2);
    sh_root(&c, &r2, "echo v3 > /home/user/data/dir/f && mkdir -p /etc/sandpit-test && echo back > /etc/sandpit-test/c").await;
    let h3 = hashes(&c, &r2).await;
    let s3 = c
        .snapshot(
            &r2,
            &CreateSnapshotRequest {
                name: Some(format!("three-{id}")),
                incremental: true,
            },
        )
        .await
        .unwrap();
    assert_eq!(s3.parent.as_deref(), Some(s2.id.as_str()));
    for (snap, want) in [(&s1, &h1), (&s2, &h2), (&s3, &h3)] {
        let r = create(
            &c,
            CreateSandboxRequest {
                snapshot: Some(snap.id.clone()),
                ..Default::default()
            },
        )
        .await;
        assert_eq!(&hashes(&c, &r).await, want, "restore of {}", snap.name);
        c.delete_sandbox(&r).await.unwrap();
    }
    // A full snapshot of a restored sandbox stands alone.
    let full = c
        .snapshot(
            &r2,
            &CreateSnapshotRequest {
                name: None,
                incremental: false,
            },
        )
        .await
        .unwrap();
    assert_eq!((full.kind.as_str(), full.parent.as_deref()), ("full", None));
    let check = c.verify_snapshot(&s3.id).await.unwrap();
    assert!(check.ok && check.chain.len() == 3, "{check:?}");
    // Deleting a snapshot others build on is refused unless forced.
    assert_eq!(
        c.delete_snapshot(&s1.id, false).await.unwrap_err().status(),
        Some(409)
    );
    c.delete_snapshot(&full.id, false).await.unwrap();
    c.delete_snapshot(&s1.id, true).await.unwrap();
    for s in [&s1, &s2, &s3] {
        assert_eq!(c.get_snapshot(&s.id).await.unwrap_err().status(), Some(404));
    }
    // The restored sandbox keeps running on its layers.
    assert_eq!(
        sh(&c, &r2, "cat /home/user/data/dir/f").await.stdout,
        "v3\n"
    );
    let missing = c
        .create_sandbox(&CreateSandboxRequest {
            snapshot: Some("no-such".into()),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(missing.status(), Some(404));
    c.delete_sandbox(&r2).await.unwrap();
    c.delete_sandbox(&id).await.unwrap();
    assert_eq!(wait_no_layers(d).await, Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_chains_restore_identical_files_from_a_local_store() {
    let d = Daemon::start().await;
    snapshot_chain_restores_exact_files(&d).await;
    // A damaged archive is caught by the check and refused at restore.
    let c = d.client();
    let id = create(&c, CreateSandboxRequest::default()).await;
    sh(
        &c,
        &id,
        "mkdir -p /home/user/data && echo x > /home/user/data/x",
    )
    .await;
    let s = c
        .snapshot(&id, &CreateSnapshotRequest::default())
        .await
        .unwrap();
    let archive = d
        .data
        .path()
        .join("snapshots")
        .join(&s.id)
        .join("layer.tar.zst");
    let mut bytes = std::fs::read(&archive).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    std::fs::write(&archive, bytes).unwrap();
    let check = c.verify_snapshot(&s.id).await.unwrap();
    assert!(!check.ok, "{check:?}");
    let refused = c
        .create_sandbox(&CreateSandboxRequest {
            snapshot: Some(s.id.clone()),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(refused.status(), Some(409), "{refused}");
    d.shutdown().await;
}

/// An S3-compatible server (moto) on a free loopback port, with one bucket.
struct S3Server {
    child: std::process::Child,
    port: u16,
}

impl S3Server {
    async fn start() -> S3Server {
        let port = free_port();
        let bin = sandpit_tests::test_tool("moto_server");
        let child = std::process::Command::new(bin)
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start moto_server (scripts/setup.sh --test installs it)");
        // Killed and waited for on drop, also when it never comes up.
        let server = S3Server { child, port };
        let http = http();
        let url = format!("http://127.0.0.1:{port}/snapshots-bucket");
        for _ in 0..300 {
            if http
                .put(&url)
                .send()
                .await
                .is_ok_and(|r| r.status().is_success())
            {
                return server;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        drop(server);
        panic!("moto_server did not come up on port {port}");
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_chains_restore_identical_files_from_an_s3_store() {
    let s3 = S3Server::start().await;
    let d = Daemon::builder()
        .config_file(&format!(
            "[snapshots]\nkind = \"s3\"\nbucket = \"snapshots-bucket\"\nprefix = \"test/run\"\n\
         endpoint = \"http://127.0.0.1:{}\"\nregion = \"us-east-1\"\naccess_key_id = \"test\"\n\
         secret_access_key = \"test\"\nallow_http = true\n",
            s3.port
        ))
        .start()
        .await;
    snapshot_chain_restores_exact_files(&d).await;
    // Nothing went to the local directory.
    let local = d.data.path().join("snapshots");
    assert!(!local.exists() || std::fs::read_dir(&local).unwrap().next().is_none());
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forks_are_independent_copies_with_their_own_processes_and_limits() {
    let d = Daemon::start().await;
    let c = d.client();
    let src = create(&c, CreateSandboxRequest::default()).await;
    sh(&c, &src, "mkdir -p /home/user/data && echo parent > /home/user/data/f && head -c 1000000 /dev/urandom > /home/user/data/big").await;
    let want = hashes(&c, &src).await;
    let bg = c
        .run_background(&src, &command(&["sleep", "1000"]))
        .await
        .unwrap();
    let copies = c
        .fork(
            &src,
            &ForkRequest {
                count: Some(3),
                limits: Some(LimitsSpec {
                    memory_bytes: Some(128 << 20),
                    ..small()
                }),
                metadata: Some([("copy".to_string(), "yes".to_string())].into()),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(copies.len(), 3);
    let mut ids: Vec<&str> = copies.iter().map(|s| s.id.as_str()).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 3, "each copy has its own id");
    for (i, copy) in copies.iter().enumerate() {
        assert_eq!(copy.state, "running");
        assert_eq!(copy.limits.memory_bytes, 128 << 20);
        assert_eq!(copy.metadata.get("copy").map(String::as_str), Some("yes"));
        assert_eq!(hashes(&c, &copy.id).await, want);
        let procs = c.list_commands(&copy.id).await.unwrap();
        assert!(
            procs
                .iter()
                .all(|p| p.pid != bg.pid || p.argv[0] != "sleep"),
            "processes are not copied"
        );
        sh(&c, &copy.id, &format!("echo copy{i} > /home/user/data/f")).await;
    }
    // Writes in one copy reach neither the others nor the source.
    for (i, copy) in copies.iter().enumerate() {
        assert_eq!(
            sh(&c, &copy.id, "cat /home/user/data/f").await.stdout,
            format!("copy{i}\n")
        );
    }
    assert_eq!(
        sh(&c, &src, "cat /home/user/data/f").await.stdout,
        "parent\n"
    );
    sh(&c, &src, "echo changed > /home/user/data/f").await;
    assert_eq!(
        sh(&c, &copies[0].id, "cat /home/user/data/f").await.stdout,
        "copy0\n"
    );
    // Bad counts are refused.
    for count in [0, 65] {
        let e = c
            .fork(
                &src,
                &ForkRequest {
                    count: Some(count),
                    ..Default::default()
                },
            )
            .await
            .unwrap_err();
        assert_eq!(e.status(), Some(400));
    }
    for copy in &copies {
        c.delete_sandbox(&copy.id).await.unwrap();
    }
    c.delete_sandbox(&src).await.unwrap();
    assert_eq!(wait_no_layers(&d).await, Vec::<String>::new());
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_mount_cannot_be_entered_or_redirected_from_inside() {
    let d = Daemon::start().await;
    let c = d.client();
    let id = create(&c, CreateSandboxRequest::default()).await;
    // Root inside cannot enter the writable layer's mount.
    let r = sh_root(&c, &id, "ls /.sandpit/layer 2>&1; echo rc=$?").await;
    assert!(
        r.stdout.contains("Permission denied") && r.stdout.contains("rc=2"),
        "{r:?}"
    );
    // Moving it away and planting a symlink to the host's /etc in its place: a snapshot
    // must refuse, never read the host.
    let r = sh_root(
        &c,
        &id,
        "mkdir -p /home/user/data && echo mine > /home/user/data/x && mv /.sandpit /.moved 2>&1; \
         mkdir -p /.sandpit && ln -s /etc /.sandpit/layer && ls -la /.sandpit; echo rc=$?",
    )
    .await;
    let moved = r.stdout.contains("layer -> /etc");
    let snap = c.snapshot(&id, &CreateSnapshotRequest::default()).await;
    if moved {
        let e = snap.unwrap_err();
        assert!(e.status().unwrap_or(0) >= 400, "{e}");
    } else {
        // The rename was refused (a mount point below it): the snapshot has only the
        // sandbox's files.
        let s = snap.unwrap();
        assert!(s.entries < 100, "{s:?}");
    }
    c.delete_sandbox(&id).await.unwrap();
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wake_cut_short_by_a_crash_leaves_the_sandbox_hibernated_with_its_files() {
    let mut d = Daemon::start().await;
    let c = d.client();
    let id = create(&c, CreateSandboxRequest::default()).await;
    sh(&c, &id, "echo survived > /home/user/f").await;
    assert_eq!(c.hibernate(&id).await.unwrap().state, "hibernated");
    // As if the daemon died in the middle of a wake: the record says `creating`.
    d.kill9();
    {
        let store = d.store().await;
        let moved = store
            .transition(
                &id,
                &[sandpit_store::SandboxState::Hibernated],
                sandpit_store::SandboxState::Creating,
                None,
            )
            .await
            .unwrap();
        assert!(moved.is_some());
    }
    let d = d.restart().start().await;
    let c = d.client();
    assert_eq!(c.get_sandbox(&id).await.unwrap().state, "hibernated");
    assert_eq!(sh(&c, &id, "cat /home/user/f").await.stdout, "survived\n");
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_no_layer_can_hold_fails_the_snapshot_clearly_and_the_sandbox_runs_on() {
    let d = Daemon::start().await;
    let c = d.client();
    let id = create(&c, CreateSandboxRequest::default()).await;
    let r = sh(
        &c,
        &id,
        "touch \"/home/user/bad-$(printf '\\377')\" && echo made",
    )
    .await;
    assert_eq!(r.stdout, "made\n", "{r:?}");
    let e = c
        .snapshot(&id, &CreateSnapshotRequest::default())
        .await
        .unwrap_err();
    assert_eq!(e.status(), Some(422), "{e}");
    // Thawed again, and nothing of the failed snapshot is listed.
    assert_eq!(c.get_sandbox(&id).await.unwrap().state, "running");
    assert_eq!(sh(&c, &id, "echo alive").await.stdout, "alive\n");
    assert!(c.list_snapshots().await.unwrap().items.is_empty());
    // Hibernation copies names as they are: the file comes back.
    assert_eq!(c.hibernate(&id).await.unwrap().state, "hibernated");
    let r = sh(&c, &id, "ls /home/user | grep -c bad-").await;
    assert_eq!(r.stdout, "1\n");
    d.shutdown().await;
}

/// Waits (up to 60 s) for a template build to end; its final state.
async fn built(c: &Client, name: &str) -> String {
    for _ in 0..600 {
        let t = c.get_template(name).await.unwrap();
        if t.state != "building" {
            return t.state;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    "still building".into()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_built_from_a_snapshot_of_setup_commands_gives_every_sandbox_those_files() {
    let d = Daemon::start().await;
    let c = d.client();
    let src = create(
        &c,
        CreateSandboxRequest {
            env: [("TOOL_HOME".to_string(), "/opt/tool".to_string())].into(),
            ..Default::default()
        },
    )
    .await;
    // The build steps.
    let r = sh_root(
        &c,
        &src,
        "mkdir -p /opt/tool && printf '#!/bin/sh\\necho tool-ok\\n' > /opt/tool/run && chmod 755 /opt/tool/run \
         && rm /etc/debian_version && echo rc > /home/user/.toolrc && chown 1000:1000 /home/user/.toolrc",
    )
    .await;
    assert_eq!(r.exit_code, 0, "{r:?}");
    let snap = c
        .snapshot(&src, &CreateSnapshotRequest::default())
        .await
        .unwrap();
    let name = format!("steps-{src}");
    let source = sandpit_api::TemplateSourceSpec::Snapshot {
        snapshot: snap.id.clone(),
        base: None,
    };
    let req = sandpit_api::BuildTemplateRequest {
        ready_cmd: Some("test -x /opt/tool/run".into()),
        ..template_build(&name, source)
    };
    c.build_template(&req).await.unwrap();
    assert_eq!(built(&c, &name).await, "ready");
    let t = c.get_template(&name).await.unwrap();
    assert_eq!(
        t.source,
        Some(sandpit_api::TemplateSourceSpec::Snapshot {
            snapshot: snap.id.clone(),
            base: Some("host".into()),
        })
    );
    assert_eq!(
        t.settings.env.get("TOOL_HOME").map(String::as_str),
        Some("/opt/tool")
    );
    // The template keeps its own copy: the sandbox and snapshot it came from can go.
    c.delete_sandbox(&src).await.unwrap();
    c.delete_snapshot(&snap.id, false).await.unwrap();
    let sb = create(
        &c,
        CreateSandboxRequest {
            template: Some(name.clone()),
            ..Default::default()
        },
    )
    .await;
    let r = sh(
        &c,
        &sb,
        "/opt/tool/run; cat ~/.toolrc; echo $TOOL_HOME; test -e /etc/debian_version || echo no-version; whoami",
    )
    .await;
    assert_eq!(
        r.stdout, "tool-ok\nrc\n/opt/tool\nno-version\nuser\n",
        "{r:?}"
    );
    // A snapshot of a template's sandbox holds only what changed over the template.
    sh(&c, &sb, "echo mine > /home/user/mine").await;
    let small = c
        .snapshot(&sb, &CreateSnapshotRequest::default())
        .await
        .unwrap();
    assert_eq!(small.template, name);
    assert!(small.size_bytes < 16 * 1024, "{small:?}");
    let again = create(
        &c,
        CreateSandboxRequest {
            snapshot: Some(small.id.clone()),
            ..Default::default()
        },
    )
    .await;
    let r = sh(&c, &again, "cat /home/user/mine; /opt/tool/run").await;
    assert_eq!(r.stdout, "mine\ntool-ok\n");
    // The template cannot go while a snapshot builds on it or sandboxes use it.
    let e = c.delete_template(&name).await.unwrap_err();
    assert_eq!(e.status(), Some(409), "{e}");
    c.delete_snapshot(&small.id, false).await.unwrap();
    assert_eq!(
        c.delete_template(&name).await.unwrap_err().status(),
        Some(409)
    );
    c.delete_sandbox(&sb).await.unwrap();
    c.delete_sandbox(&again).await.unwrap();
    assert!(wait_no_leftovers(&d, &sb).await.is_empty());
    c.delete_template(&name).await.unwrap();
    assert_eq!(wait_no_layers(&d).await, Vec::<String>::new());
    // A snapshot that does not exist fails the build request at once.
    let bad = sandpit_api::BuildTemplateRequest {
        name: format!("none-{src}"),
        source: sandpit_api::TemplateSourceSpec::Snapshot {
            snapshot: "no-such".into(),
            base: None,
        },
        ..req
    };
    assert_eq!(
        c.build_template(&bad).await.unwrap_err().status(),
        Some(404)
    );
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sparse_files_beyond_the_disk_limit_are_refused_and_moved_template_files_survive() {
    let d = Daemon::start().await;
    let c = d.client();
    let id = create(&c, CreateSandboxRequest::default()).await;
    // A template file moved by root: overlayfs copies it up as the host's root's.
    let r = sh_root(
        &c,
        &id,
        "mv /etc/bash.bashrc /etc/bash.bashrc.orig && truncate -s 4G /home/user/sparse && du -k /home/user/sparse",
    )
    .await;
    assert_eq!(r.exit_code, 0, "{r:?}");
    // 4 GiB of nothing would be 4 GiB on the host's disk once copied: refused, clearly.
    let layers_before = layer_dirs(&d);
    for what in ["hibernate", "snapshot", "fork"] {
        let e = match what {
            "hibernate" => c.hibernate(&id).await.map(drop),
            "snapshot" => c
                .snapshot(&id, &CreateSnapshotRequest::default())
                .await
                .map(drop),
            _ => c.fork(&id, &ForkRequest::default()).await.map(drop),
        }
        .unwrap_err();
        assert_eq!(e.status(), Some(422), "{what}: {e}");
        assert!(e.to_string().contains("disk limit"), "{what}: {e}");
        assert_eq!(c.get_sandbox(&id).await.unwrap().state, "running", "{what}");
    }
    assert_eq!(layer_dirs(&d), layers_before, "nothing was written");
    sh(&c, &id, "rm /home/user/sparse").await;
    assert_eq!(c.hibernate(&id).await.unwrap().state, "hibernated");
    let r = sh(
        &c,
        &id,
        "ls /etc/bash.bashrc* 2>&1; head -c 20 /etc/bash.bashrc.orig | wc -c",
    )
    .await;
    assert_eq!(r.stdout, "/etc/bash.bashrc.orig\n20\n", "{r:?}");
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_archives_no_record_names_are_swept_at_start_and_deletes_leave_no_directory() {
    let mut d = Daemon::start().await;
    let c = d.client();
    let id = create(&c, CreateSandboxRequest::default()).await;
    let snap = c
        .snapshot(&id, &CreateSnapshotRequest::default())
        .await
        .unwrap();
    let store = d.data.path().join("snapshots");
    assert!(store.join(&snap.id).join("layer.tar.zst").is_file());
    c.delete_snapshot(&snap.id, false).await.unwrap();
    assert!(
        !store.join(&snap.id).exists(),
        "a deleted snapshot leaves no directory"
    );
    // As if a crash came between an upload and its record: one old, one just written.
    let plant = |name: &str, age: std::time::Duration| {
        let dir = store.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        for f in ["layer.tar.zst", "manifest.json"] {
            let file = std::fs::File::create(dir.join(f)).unwrap();
            file.set_modified(std::time::SystemTime::now() - age)
                .unwrap();
        }
    };
    plant("snapdeadbeef", Duration::from_secs(3600));
    plant("snapfresh", Duration::ZERO);
    std::fs::write(store.join("not-ours.txt"), "x").unwrap();
    d.stop();
    let d = d.restart().start().await;
    assert!(
        !store.join("snapdeadbeef").exists(),
        "an old orphan is swept"
    );
    assert!(
        store.join("snapfresh/layer.tar.zst").exists(),
        "a fresh upload is left"
    );
    assert!(
        store.join("not-ours.txt").exists(),
        "what is not sandpit's is left"
    );
    std::fs::remove_dir_all(store.join("snapfresh")).unwrap();
    d.shutdown().await;
}

/// The raw bodies of every API response about sandbox `id` and its listings (sandpit's and
/// E2B's), and of the snapshot listing.
async fn bodies_about(d: &Daemon, id: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (path, e2b) in [
        (format!("/v1/sandboxes/{id}"), false),
        ("/v1/sandboxes".to_string(), false),
        ("/v1/snapshots".to_string(), false),
        (format!("/sandboxes/{id}"), true),
        ("/v2/sandboxes".to_string(), true),
    ] {
        let rb = http().get(format!("{}{path}", d.url));
        let rb = if e2b {
            rb.header("X-API-Key", d.key.trim())
        } else {
            rb.bearer_auth(d.key.trim())
        };
        let resp = rb.send().await.unwrap();
        assert_eq!(resp.status(), 200, "{path}");
        out.push((path, resp.text().await.unwrap()));
    }
    out
}

/// Sandbox `sb` sees `MY_SECRET` (marked secret) and `PLAIN`, no API response shows the
/// secret value, and its record keeps the mark.
async fn assert_secret_env(d: &Daemon, sb: &str, secret: &str, step: &str) {
    let c = d.client();
    let r = sh(&c, sb, "echo $MY_SECRET $PLAIN").await;
    assert_eq!(r.stdout, format!("{secret} plain\n"), "{step}: {r:?}");
    for (path, body) in bodies_about(d, sb).await {
        assert!(!body.contains(secret), "{step}: {path} shows it: {body}");
    }
    let db = d.store().await;
    let rec = db.get_sandbox(sb).await.unwrap().unwrap();
    db.close().await;
    assert_eq!(
        rec.secret_env,
        ["MY_SECRET".to_string()].into(),
        "{step}: the mark"
    );
}

/// Env values marked secret reach the sandbox's commands like any env; the mark (and the
/// value) survive pause, hibernation, a fork and a snapshot's restore; no API response
/// shows them; a template built from the snapshot leaves them out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secret_env_values_reach_commands_survive_every_copy_and_are_never_shown() {
    const SECRET: &str = "s3cr3t-value-of-the-env-42";
    let d = Daemon::start().await;
    let c = d.client();
    // A name that is not a variable of env is refused.
    let e = c
        .create_sandbox(&CreateSandboxRequest {
            env: [("A".to_string(), "1".to_string())].into(),
            secret_env: vec!["B".into()],
            limits: small(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.status(), Some(400), "{e}");

    let id = create(
        &c,
        CreateSandboxRequest {
            env: [
                ("MY_SECRET".to_string(), SECRET.to_string()),
                ("PLAIN".to_string(), "plain".to_string()),
            ]
            .into(),
            secret_env: vec!["MY_SECRET".into()],
            ..Default::default()
        },
    )
    .await;
    assert_secret_env(&d, &id, SECRET, "created").await;

    assert_eq!(c.pause(&id).await.unwrap().state, "paused");
    assert_eq!(c.resume(&id).await.unwrap().state, "running");
    assert_secret_env(&d, &id, SECRET, "paused and resumed").await;
    assert_eq!(c.hibernate(&id).await.unwrap().state, "hibernated");
    assert_eq!(c.resume(&id).await.unwrap().state, "running");
    assert_secret_env(&d, &id, SECRET, "hibernated and resumed").await;

    let forks = c.fork(&id, &ForkRequest::default()).await.unwrap();
    assert_eq!(forks.len(), 1);
    assert!(!serde_json::to_string(&forks).unwrap().contains(SECRET));
    assert_secret_env(&d, &forks[0].id, SECRET, "forked").await;

    let snap = c
        .snapshot(&id, &CreateSnapshotRequest::default())
        .await
        .unwrap();
    let restored = create(
        &c,
        CreateSandboxRequest {
            snapshot: Some(snap.id.clone()),
            ..Default::default()
        },
    )
    .await;
    assert_secret_env(&d, &restored, SECRET, "restored from a snapshot").await;

    // A template shows its env to whoever reads it: the secret stays out, the rest is kept.
    let name = format!("secret-env-{id}");
    let source = sandpit_api::TemplateSourceSpec::Snapshot {
        snapshot: snap.id.clone(),
        base: None,
    };
    c.build_template(&template_build(&name, source))
        .await
        .unwrap();
    assert_eq!(built(&c, &name).await, "ready");
    let t = c.get_template(&name).await.unwrap();
    assert_eq!(
        t.settings.env,
        [("PLAIN".to_string(), "plain".to_string())].into()
    );
    for path in [format!("/v1/templates/{name}"), "/v1/templates".to_string()] {
        let body = http()
            .get(format!("{}{path}", d.url))
            .bearer_auth(d.key.trim())
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(!body.contains(SECRET), "{path}: {body}");
    }

    for sb in [&id, &forks[0].id, &restored] {
        c.delete_sandbox(sb).await.unwrap();
    }
    c.delete_template(&name).await.unwrap();
    c.delete_snapshot(&snap.id, false).await.unwrap();
    d.shutdown().await;
}
