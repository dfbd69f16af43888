//! Template builds against a real daemon: a copied directory keeps its symlinks as
//! symlinks and never reads the host's files, template settings apply (and a create's own
//! values win), start commands and readiness checks gate a sandbox (and a pool's), a
//! template in use cannot be removed, bad input is refused, and debootstrap builds a
//! Debian template.

use sandpit_api::{
    BuildTemplateRequest, CreateSandboxRequest, LimitsSpec, PoolSpec, RunCommandRequest,
    TemplateSourceSpec,
};
use sandpit_tests::{
    Daemon, build_ready, command, dir_build, error_status, rootfs_with_programs, sandboxes,
    sandpit_bin, temp_dir, template_build, wait_built,
};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A root filesystem with one static program in it (the sandpit binary), a file to read,
/// a symlink pointing at the host's /etc/passwd, and a FIFO.
fn tiny_rootfs(dir: &Path) {
    std::fs::create_dir_all(dir.join("usr/bin")).unwrap();
    std::fs::create_dir_all(dir.join("etc")).unwrap();
    std::fs::copy(sandpit_bin(), dir.join("usr/bin/sandpit")).unwrap();
    std::fs::write(dir.join("etc/greeting"), "hello from the template\n").unwrap();
    std::os::unix::fs::symlink("/etc/passwd", dir.join("leak")).unwrap();
    nix::unistd::mkfifo(
        &dir.join("fifo"),
        nix::sys::stat::Mode::from_bits_truncate(0o600),
    )
    .unwrap();
}

/// A root filesystem with a shell (`dash` as /bin/sh), `sleep` and `cat` and the host
/// libraries they need (found with ldd), laid out like a merged-/usr Debian.
fn shell_rootfs(dir: &Path) {
    rootfs_with_programs(
        dir,
        &[
            ("/bin/dash", "usr/bin/sh"),
            ("/bin/sleep", "usr/bin/sleep"),
            ("/bin/cat", "usr/bin/cat"),
        ],
    );
    std::fs::create_dir_all(dir.join("etc")).unwrap();
}

fn shell(script: &str) -> RunCommandRequest {
    RunCommandRequest {
        argv: vec!["/bin/sh".into(), "-c".into(), script.into()],
        ..Default::default()
    }
}

/// The uid a command runs as, read with shell builtins only.
const UID: &str =
    "while read k v rest; do [ \"$k\" = Uid: ] && echo $v; done < /proc/self/status; true";

fn from(template: &str) -> CreateSandboxRequest {
    CreateSandboxRequest {
        template: Some(template.into()),
        timeout: Some(600),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directory_build_copies_without_following_symlinks() {
    let d = Daemon::start().await;
    let c = d.client();
    let src = temp_dir("sandpit-tsrc-");
    tiny_rootfs(src.path());
    // Built through the CLI, which follows the build's progress.
    let out = std::process::Command::new(sandpit_bin())
        .args(["template", "build", "tiny", "--dir"])
        .arg(src.path())
        .args(["--env", "GREETING=hi"])
        .env("SANDPIT_URL", &d.url)
        .env("SANDPIT_DATA_DIR", d.data.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "tiny\n");
    assert!(stderr.contains("copying"), "{stderr}");
    assert!(
        stderr.contains("skipped 1 device nodes/FIFOs/sockets"),
        "{stderr}"
    );
    assert!(stderr.contains("template tiny is ready"), "{stderr}");
    let t = c.get_template("tiny").await.unwrap();
    assert_eq!(t.state, "ready");
    assert_eq!(
        t.settings.env.get("GREETING").map(String::as_str),
        Some("hi")
    );
    assert_eq!(
        t.source,
        Some(TemplateSourceSpec::Dir {
            path: src.path().to_str().unwrap().into()
        })
    );
    assert!(t.size_bytes > 1_000_000, "{t:?}");
    // The copy is the daemon's own, under its data directory: the symlink stayed a
    // symlink (the host file was not read into it), the FIFO was skipped.
    let rootfs = PathBuf::from(&t.rootfs);
    assert!(rootfs.starts_with(d.data.path().join("templates")), "{t:?}");
    let leak = std::fs::symlink_metadata(rootfs.join("leak")).unwrap();
    assert!(leak.file_type().is_symlink());
    assert_eq!(
        std::fs::read_link(rootfs.join("leak")).unwrap(),
        Path::new("/etc/passwd")
    );
    assert!(std::fs::symlink_metadata(rootfs.join("fifo")).is_err());
    // The source can go away: the template does not depend on it.
    drop(src);
    let sb = c.create_sandbox(&from("tiny")).await.unwrap();
    assert_eq!(
        c.read_file(&sb.id, "/etc/greeting").await.unwrap().as_ref(),
        b"hello from the template\n"
    );
    let st = c.stat(&sb.id, "/leak").await.unwrap();
    assert_eq!(st.symlink_target.as_deref(), Some("/etc/passwd"));
    // Inside, the link resolves to the sandbox's own passwd, never the host's.
    let inside = c.read_file(&sb.id, "/leak").await.unwrap();
    let host = std::fs::read("/etc/passwd").unwrap();
    assert_ne!(inside.as_ref(), host.as_slice());
    assert!(
        String::from_utf8_lossy(&inside).contains("user:x:1000"),
        "{inside:?}"
    );
    let r = c
        .run(&sb.id, &command(&["/usr/bin/sandpit", "--version"]))
        .await
        .unwrap();
    assert_eq!(r.exit_code, 0, "{r:?}");
    // ls and inspect through the CLI.
    let ls = std::process::Command::new(sandpit_bin())
        .args(["template", "ls"])
        .env("SANDPIT_URL", &d.url)
        .env("SANDPIT_DATA_DIR", d.data.path())
        .output()
        .unwrap();
    let ls = String::from_utf8_lossy(&ls.stdout);
    assert!(
        ls.lines()
            .any(|l| l.starts_with("tiny") && l.contains("ready") && l.contains("copy of")),
        "{ls}"
    );
    assert!(ls.lines().any(|l| l.starts_with("host")), "{ls}");
    let inspect = std::process::Command::new(sandpit_bin())
        .args(["template", "inspect", "tiny"])
        .env("SANDPIT_URL", &d.url)
        .env("SANDPIT_DATA_DIR", d.data.path())
        .output()
        .unwrap();
    let json: serde_json::Value = serde_json::from_slice(&inspect.stdout).unwrap();
    assert_eq!(json["name"], "tiny");
    assert_eq!(json["env"]["GREETING"], "hi");
    assert_eq!(json["source"]["kind"], "dir");
    c.delete_sandbox(&sb.id).await.unwrap();
    let rm = std::process::Command::new(sandpit_bin())
        .args(["template", "rm", "tiny"])
        .env("SANDPIT_URL", &d.url)
        .env("SANDPIT_DATA_DIR", d.data.path())
        .output()
        .unwrap();
    assert!(
        rm.status.success(),
        "{}",
        String::from_utf8_lossy(&rm.stderr)
    );
    assert!(!rootfs.exists(), "the build's directory is removed with it");
    assert!(!rootfs.parent().unwrap().exists());
    assert_eq!(error_status(c.get_template("tiny").await), Some(404));
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn template_settings_apply_and_a_create_overrides_them() {
    let d = Daemon::start().await;
    let c = d.client();
    let src = temp_dir("sandpit-tsrc-");
    shell_rootfs(src.path());
    let req = BuildTemplateRequest {
        default_user: Some("root".into()),
        workdir: Some("/srv/app".into()),
        env: [("A", "tmpl"), ("B", "tmpl")]
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .into(),
        ..dir_build("sh", src.path())
    };
    build_ready(&c, &req).await;
    let probe = format!("echo $A $B; pwd; {UID}");
    // The template's settings.
    let sb = c.create_sandbox(&from("sh")).await.unwrap();
    let r = c.run(&sb.id, &shell(&probe)).await.unwrap();
    assert_eq!(
        (r.exit_code, r.stdout.as_str()),
        (0, "tmpl tmpl\n/srv/app\n0\n"),
        "{r:?}"
    );
    // The workdir was made in the template, for its default user.
    let st = c.stat(&sb.id, "/srv/app").await.unwrap();
    assert_eq!((st.r#type.as_str(), st.owner.as_str()), ("dir", "root"));
    // A create's own values win; the template's other env values stay.
    let mine = CreateSandboxRequest {
        env: [("B".to_string(), "mine".to_string())].into(),
        workdir: Some("/tmp".into()),
        user: Some("user".into()),
        ..from("sh")
    };
    let sb2 = c.create_sandbox(&mine).await.unwrap();
    let r = c.run(&sb2.id, &shell(&probe)).await.unwrap();
    assert_eq!(
        (r.exit_code, r.stdout.as_str()),
        (0, "tmpl mine\n/tmp\n1000\n"),
        "{r:?}"
    );
    // A command's own env still wins over both.
    let r = c
        .run(
            &sb2.id,
            &RunCommandRequest {
                env: [("A".to_string(), "cmd".to_string())].into(),
                ..shell("echo $A $B")
            },
        )
        .await
        .unwrap();
    assert_eq!(r.stdout, "cmd mine\n");
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_command_and_readiness_check_gate_sandboxes_and_pool_members() {
    let d = Daemon::start().await;
    let c = d.client();
    let src = temp_dir("sandpit-tsrc-");
    shell_rootfs(src.path());
    // A small service: it takes a moment to come up, then writes a file and keeps
    // counting; the readiness check waits for the file.
    let req = BuildTemplateRequest {
        start_cmd: Some(
            "sleep 1; echo up > /tmp/ready; i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 0.2; done"
                .into(),
        ),
        ready_cmd: Some("test -f /tmp/ready".into()),
        ..dir_build("svc", src.path())
    };
    let t = build_ready(&c, &req).await;
    assert_eq!(t.settings.ready_cmd.as_deref(), Some("test -f /tmp/ready"));
    let sb = c.create_sandbox(&from("svc")).await.unwrap();
    assert_eq!(sb.state, "running");
    // Handed out only once ready: the file is there at once.
    assert_eq!(
        c.read_file(&sb.id, "/tmp/ready").await.unwrap().as_ref(),
        b"up\n"
    );
    // The service keeps running in the background, as the default user.
    let cmds = c.list_commands(&sb.id).await.unwrap();
    assert!(
        cmds.iter()
            .any(|p| p.tag.as_deref() == Some("template-start")),
        "{cmds:?}"
    );
    assert_eq!(c.stat(&sb.id, "/tmp/ready").await.unwrap().owner, "user");
    let r = c
        .run(
            &sb.id,
            &shell("a=$(cat /tmp/count); sleep 1; b=$(cat /tmp/count); [ $b -gt $a ]"),
        )
        .await
        .unwrap();
    assert_eq!(r.exit_code, 0, "the service goes on counting: {r:?}");
    // A pool of the template: its members run the service and pass the check before they
    // count as ready, so a claim gets a sandbox that is ready at once.
    let small = LimitsSpec {
        memory_bytes: Some(128 << 20),
        ..Default::default()
    };
    c.create_pool(&PoolSpec {
        name: "svc-pool".into(),
        template: Some("svc".into()),
        limits: small,
        size: 1,
        ..Default::default()
    })
    .await
    .unwrap();
    let mut ready = false;
    for _ in 0..600 {
        if c.get_pool("svc-pool").await.unwrap().ready == 1 {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(ready, "{:?}", c.get_pool("svc-pool").await);
    let claimed = c
        .create_sandbox(&CreateSandboxRequest {
            limits: small,
            ..from("svc")
        })
        .await
        .unwrap();
    assert_eq!(claimed.pool.as_deref(), Some("svc-pool"));
    assert_eq!(
        c.read_file(&claimed.id, "/tmp/ready")
            .await
            .unwrap()
            .as_ref(),
        b"up\n"
    );
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_readiness_check_fails_the_create_and_leaves_nothing() {
    let d = Daemon::start().await;
    let c = d.client();
    let src = temp_dir("sandpit-tsrc-");
    shell_rootfs(src.path());
    let req = BuildTemplateRequest {
        start_cmd: Some("while :; do sleep 1; done".into()),
        ready_cmd: Some("echo not yet; echo still starting >&2; exit 3".into()),
        ready_timeout_secs: Some(2),
        ..dir_build("never", src.path())
    };
    build_ready(&c, &req).await;
    let e = c.create_sandbox(&from("never")).await.unwrap_err();
    assert_eq!(e.status(), Some(422), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("readiness check"), "{msg}");
    assert!(msg.contains("exit code 3"), "{msg}");
    assert!(msg.contains("still starting"), "{msg}");
    // Nothing is left: no record, no directory, no mount.
    assert!(sandboxes(&c).await.is_empty());
    let dirs: Vec<_> = std::fs::read_dir(d.data.path().join("sandboxes"))
        .map(|rd| rd.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(dirs.is_empty(), "{dirs:?}");
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap();
    let rootfs = c.get_template("never").await.unwrap().rootfs;
    assert!(!mounts.contains(&rootfs), "{mounts}");
    // A start command that cannot start (no such shell in the template) fails likewise.
    let src2 = temp_dir("sandpit-tsrc-");
    tiny_rootfs(src2.path());
    let req = BuildTemplateRequest {
        start_cmd: Some("true".into()),
        ..dir_build("noshell", src2.path())
    };
    build_ready(&c, &req).await;
    let e = c.create_sandbox(&from("noshell")).await.unwrap_err();
    assert_eq!(e.status(), Some(422), "{e}");
    assert!(e.to_string().contains("start command"), "{e}");
    assert!(sandboxes(&c).await.is_empty());
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_in_use_cannot_be_removed() {
    let d = Daemon::start().await;
    let c = d.client();
    let src = temp_dir("sandpit-tsrc-");
    tiny_rootfs(src.path());
    let t = build_ready(&c, &dir_build("busy", src.path())).await;
    let sb = c.create_sandbox(&from("busy")).await.unwrap();
    let e = c.delete_template("busy").await.unwrap_err();
    assert_eq!(e.status(), Some(409), "{e}");
    assert!(e.to_string().contains(&sb.id), "{e}");
    // The refusal changed nothing: the template still starts sandboxes.
    assert_eq!(c.get_template("busy").await.unwrap().state, "ready");
    let sb2 = c.create_sandbox(&from("busy")).await.unwrap();
    c.delete_sandbox(&sb.id).await.unwrap();
    c.delete_sandbox(&sb2.id).await.unwrap();
    // A pool keeps it in use too.
    c.create_pool(&PoolSpec {
        name: "busy-pool".into(),
        template: Some("busy".into()),
        size: 0,
        ..Default::default()
    })
    .await
    .unwrap();
    let e = c.delete_template("busy").await.unwrap_err();
    assert_eq!(e.status(), Some(409), "{e}");
    assert!(e.to_string().contains("busy-pool"), "{e}");
    c.delete_pool("busy-pool").await.unwrap();
    // Sandboxes just deleted may still be being torn down: the delete waits for them.
    c.delete_template("busy").await.unwrap();
    assert!(!Path::new(&t.rootfs).exists());
    assert_eq!(
        error_status(c.create_sandbox(&from("busy")).await),
        Some(404)
    );
    assert_eq!(error_status(c.delete_template("busy").await), Some(404));
    // The name is free again.
    build_ready(&c, &dir_build("busy", src.path())).await;
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_names_paths_and_sources_are_refused() {
    let d = Daemon::start().await;
    let c = d.client();
    let src = temp_dir("sandpit-tsrc-");
    tiny_rootfs(src.path());
    let ok = dir_build("good", src.path());
    for name in [
        "",
        "host",
        "../x",
        "a/b",
        ".x",
        "-x",
        "a b",
        &"n".repeat(65),
    ] {
        let e = c
            .build_template(&BuildTemplateRequest {
                name: name.to_string(),
                ..ok.clone()
            })
            .await;
        assert_eq!(error_status(e), Some(400), "{name:?}");
    }
    let file = src.path().join("etc/greeting");
    let not_rootfs = temp_dir("sandpit-tsrc-");
    for path in [
        "relative/dir".to_string(),
        "/var/tmp/sandpit-no-such-dir".to_string(),
        "/".to_string(),
        file.to_str().unwrap().to_string(),
        not_rootfs.path().to_str().unwrap().to_string(),
        d.data.path().to_str().unwrap().to_string(),
        d.data
            .path()
            .join("templates")
            .to_str()
            .unwrap()
            .to_string(),
        format!("{}/../x", src.path().display()),
    ] {
        let e = c
            .build_template(&BuildTemplateRequest {
                source: TemplateSourceSpec::Dir { path: path.clone() },
                ..ok.clone()
            })
            .await;
        assert_eq!(error_status(e), Some(400), "{path:?}");
    }
    for source in [
        TemplateSourceSpec::Debootstrap {
            suite: "--foreign".into(),
            packages: vec![],
            mirror: None,
        },
        TemplateSourceSpec::Debootstrap {
            suite: "bookworm".into(),
            packages: vec!["curl;rm -rf /".into()],
            mirror: None,
        },
        TemplateSourceSpec::Debootstrap {
            suite: "bookworm".into(),
            packages: vec![],
            mirror: Some("file:///etc".into()),
        },
        TemplateSourceSpec::Path {
            path: src.path().to_str().unwrap().into(),
        },
    ] {
        let e = c
            .build_template(&BuildTemplateRequest {
                source: source.clone(),
                ..ok.clone()
            })
            .await;
        assert_eq!(error_status(e), Some(400), "{source:?}");
    }
    for bad in [
        BuildTemplateRequest {
            default_user: Some("mallory".into()),
            ..ok.clone()
        },
        BuildTemplateRequest {
            workdir: Some("../etc".into()),
            ..ok.clone()
        },
        BuildTemplateRequest {
            start_cmd: Some(" ".into()),
            ..ok.clone()
        },
        BuildTemplateRequest {
            ready_timeout_secs: Some(0),
            ..ok.clone()
        },
        BuildTemplateRequest {
            env: [("A=B".to_string(), "x".to_string())].into(),
            ..ok.clone()
        },
    ] {
        assert_eq!(
            error_status(c.build_template(&bad).await),
            Some(400),
            "{bad:?}"
        );
    }
    // Unknown fields are refused rather than ignored.
    let raw = sandpit_tests::http()
        .post(format!("{}/v1/templates", d.url))
        .header("authorization", format!("Bearer {}", d.key))
        .json(&serde_json::json!({
            "name": "x", "source": {"kind": "dir", "path": src.path()}, "startCmd": "x"
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(raw.status(), 400);
    // Builds and removals need the admin key; reading does not.
    let a = d.owner("alice").await;
    assert_eq!(error_status(a.build_template(&ok).await), Some(403));
    // Nothing of the refused requests was recorded.
    let names: Vec<String> = c
        .list_templates()
        .await
        .unwrap()
        .into_iter()
        .map(|t| t.name)
        .collect();
    assert_eq!(names, ["host"]);
    build_ready(&c, &ok).await;
    assert_eq!(error_status(a.delete_template("good").await), Some(403));
    assert_eq!(a.get_template("good").await.unwrap().state, "ready");
    // A second build of an existing name conflicts; unknown names are 404s.
    assert_eq!(error_status(c.build_template(&ok).await), Some(409));
    assert_eq!(error_status(c.get_template("nope").await), Some(404));
    assert_eq!(
        error_status(c.template_build("nope", 0, 0).await),
        Some(404)
    );
    assert_eq!(error_status(c.delete_template("nope").await), Some(404));
    assert_eq!(error_status(c.delete_template("host").await), Some(400));
    assert_eq!(c.get_template("host").await.unwrap().rootfs, "host");
    // A build that fails leaves a failed record and no directory; its name can be reused.
    let deep = temp_dir("sandpit-tsrc-");
    std::fs::create_dir_all(deep.path().join("usr/bin")).unwrap();
    let mut p = deep.path().join("d");
    for _ in 0..300 {
        p = p.join("d");
    }
    std::fs::create_dir_all(&p).unwrap();
    let started = c
        .build_template(&dir_build("deep", deep.path()))
        .await
        .unwrap();
    let (t, log) = wait_built(&c, "deep", Duration::from_secs(120)).await;
    assert_eq!(t.state, "failed", "{t:?}");
    let why = t.error.clone().unwrap_or_default();
    assert!(why.contains("deeper than"), "{why}");
    assert!(log.iter().any(|l| l.starts_with("error:")), "{log:#?}");
    assert!(!Path::new(&started.rootfs).parent().unwrap().exists());
    let e = c.create_sandbox(&from("deep")).await.unwrap_err();
    assert_eq!(e.status(), Some(409), "{e}");
    assert!(e.to_string().contains("failed to build"), "{e}");
    std::fs::remove_dir_all(deep.path().join("d")).unwrap();
    build_ready(&c, &dir_build("deep", deep.path())).await;
    d.shutdown().await;
}

/// The Debian mirror this machine's apt uses (deb822 `URIs:` or a one-line `deb` entry).
fn apt_mirror() -> Option<String> {
    let mut files = vec![PathBuf::from("/etc/apt/sources.list")];
    if let Ok(rd) = std::fs::read_dir("/etc/apt/sources.list.d") {
        let mut more: Vec<PathBuf> = rd.flatten().map(|e| e.path()).collect();
        more.sort();
        files.extend(more);
    }
    for f in files {
        let name = f.to_string_lossy().to_string();
        if !(name.ends_with(".list") || name.ends_with(".sources")) {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(&f) else {
            continue;
        };
        for line in text.lines().map(str::trim) {
            let uri = if let Some(rest) = line.strip_prefix("URIs:") {
                rest.split_whitespace().next()
            } else if let Some(rest) = line.strip_prefix("deb ") {
                rest.split_whitespace().find(|w| w.starts_with("http"))
            } else {
                None
            };
            if let Some(u) = uri
                && u.starts_with("http")
                && u.trim_end_matches('/').ends_with("/debian")
            {
                return Some(u.trim_end_matches('/').to_string());
            }
        }
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debootstrap_builds_a_debian_template_and_a_cancelled_build_leaves_nothing() {
    let mirror = apt_mirror().expect("a Debian mirror in /etc/apt/sources.list(.d)");
    let d = Daemon::start().await;
    let c = d.client();
    let deb = |name: &str| {
        let source = TemplateSourceSpec::Debootstrap {
            suite: "bookworm".into(),
            packages: vec![],
            mirror: Some(mirror.clone()),
        };
        template_build(name, source)
    };
    // A build removed while it runs is cancelled: debootstrap stops, its directory goes.
    let first = c.build_template(&deb("cancelled")).await.unwrap();
    let work = PathBuf::from(&first.rootfs).parent().unwrap().to_path_buf();
    let mut offset = 0;
    'wait: for _ in 0..120 {
        let b = c.template_build("cancelled", offset, 1_000).await.unwrap();
        offset = b.next_offset;
        for l in &b.lines {
            if l.text.starts_with("I: ") {
                break 'wait;
            }
        }
        assert_eq!(b.state, "building", "{b:?}");
    }
    c.delete_template("cancelled").await.unwrap();
    assert!(!work.exists(), "{} is left", work.display());
    assert_eq!(error_status(c.get_template("cancelled").await), Some(404));
    let ps = std::process::Command::new("pgrep")
        .args(["-f", &work.to_string_lossy()])
        .output()
        .unwrap();
    assert!(ps.stdout.is_empty(), "debootstrap still runs: {ps:?}");
    // The real build, about 40 s.
    c.build_template(&deb("bookworm")).await.unwrap();
    let (t, log) = wait_built(&c, "bookworm", Duration::from_secs(900)).await;
    assert_eq!(t.state, "ready", "{t:?}\n{}", log.join("\n"));
    assert!(log.iter().any(|l| l.starts_with("I: Retriev")), "{log:#?}");
    assert!(
        log.iter()
            .any(|l| l.contains("Base system installed successfully")),
        "{log:#?}"
    );
    assert!(t.size_bytes > 100 << 20, "{t:?}");
    let sb = c.create_sandbox(&from("bookworm")).await.unwrap();
    let r = c
        .run(&sb.id, &command(&["cat", "/etc/debian_version"]))
        .await
        .unwrap();
    assert_eq!(r.exit_code, 0, "{r:?}");
    assert!(r.stdout.starts_with("12."), "{r:?}");
    c.delete_sandbox(&sb.id).await.unwrap();
    c.delete_template("bookworm").await.unwrap();
    assert!(!Path::new(&t.rootfs).exists());
    d.shutdown().await;
}

fn sha256_hex(b: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(b))
}

/// A tar of the directory `dir` (symlinks kept as symlinks).
fn tar_of_dir(dir: &Path) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    b.follow_symlinks(false);
    b.append_dir_all(".", dir).unwrap();
    b.into_inner().unwrap()
}

/// A layer tar of (name, contents) files; names are written raw, so `..` gets through.
fn raw_layer(files: &[(&str, &[u8])]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (name, data) in files {
        let mut h = tar::Header::new_gnu();
        h.as_gnu_mut().unwrap().name[..name.len()].copy_from_slice(name.as_bytes());
        h.set_entry_type(tar::EntryType::Regular);
        h.set_mode(0o644);
        h.set_uid(0);
        h.set_gid(0);
        h.set_size(data.len() as u64);
        h.set_mtime(1_700_000_000);
        h.set_cksum();
        b.append(&h, *data).unwrap();
    }
    b.into_inner().unwrap()
}

fn image_config(layers: &[&[u8]], config: serde_json::Value) -> Vec<u8> {
    let ids: Vec<String> = layers
        .iter()
        .map(|l| format!("sha256:{}", sha256_hex(l)))
        .collect();
    serde_json::to_vec(&serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": ids},
    }))
    .unwrap()
}

/// Writes an OCI image layout of uncompressed layers at `dir`.
fn oci_layout(dir: &Path, layers: &[Vec<u8>], config: serde_json::Value) {
    let blobs = dir.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).unwrap();
    let blob = |media: &str, data: &[u8]| {
        let h = sha256_hex(data);
        std::fs::write(blobs.join(&h), data).unwrap();
        serde_json::json!({"mediaType": media, "digest": format!("sha256:{h}"), "size": data.len()})
    };
    let refs: Vec<&[u8]> = layers.iter().map(Vec::as_slice).collect();
    let cfg = blob(
        "application/vnd.oci.image.config.v1+json",
        &image_config(&refs, config),
    );
    let descs: Vec<serde_json::Value> = layers
        .iter()
        .map(|l| blob("application/vnd.oci.image.layer.v1.tar", l))
        .collect();
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": cfg,
        "layers": descs,
    }))
    .unwrap();
    let m = blob("application/vnd.oci.image.manifest.v1+json", &manifest);
    std::fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
    std::fs::write(
        dir.join("index.json"),
        serde_json::to_vec(&serde_json::json!({"schemaVersion": 2, "manifests": [m]})).unwrap(),
    )
    .unwrap();
}

fn oci_build(name: &str, path: &Path) -> BuildTemplateRequest {
    let path = path.to_str().unwrap().into();
    template_build(name, TemplateSourceSpec::Oci { path })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oci_image_becomes_a_template_with_its_config() {
    let d = Daemon::start().await;
    let c = d.client();
    let base = temp_dir("sandpit-tsrc-");
    shell_rootfs(base.path());
    std::fs::write(base.path().join("etc/motd"), "base\n").unwrap();
    // Layer 2 replaces a file, adds one, and deletes `cat` with a whiteout.
    let top = raw_layer(&[
        ("etc/motd", b"from the second layer\n"),
        ("app/hello", b"hello\n"),
        ("usr/bin/.wh.cat", b""),
    ]);
    let image = temp_dir("sandpit-image-");
    oci_layout(
        image.path(),
        &[tar_of_dir(base.path()), top],
        serde_json::json!({
            "Env": ["PATH=/usr/bin:/bin", "FROM_IMAGE=yes", "SHARED=image"],
            "WorkingDir": "/app",
            "Entrypoint": ["/bin/sh", "-c"],
            "Cmd": ["echo started > /tmp/started; while :; do sleep 1; done"],
        }),
    );
    let req = BuildTemplateRequest {
        env: [("SHARED".to_string(), "mine".to_string())].into(),
        ready_cmd: Some("test -f /tmp/started".into()),
        ..oci_build("img", image.path())
    };
    c.build_template(&req).await.unwrap();
    let (t, log) = wait_built(&c, "img", Duration::from_secs(300)).await;
    assert_eq!(t.state, "ready", "{t:?} {log:#?}");
    assert!(
        log.iter().any(|l| l.starts_with("applied layer 2/2")),
        "{log:#?}"
    );
    let s = &t.settings;
    assert_eq!(s.env.get("FROM_IMAGE").map(String::as_str), Some("yes"));
    assert_eq!(s.env.get("SHARED").map(String::as_str), Some("mine"));
    assert_eq!(s.workdir.as_deref(), Some("/app"));
    assert_eq!(s.default_user.as_deref(), Some("root"));
    assert_eq!(
        s.start_cmd.as_deref(),
        Some("exec /bin/sh -c 'echo started > /tmp/started; while :; do sleep 1; done'")
    );
    let sb = c.create_sandbox(&from("img")).await.unwrap();
    let r = c
        .run(
            &sb.id,
            &shell(&format!("echo $FROM_IMAGE $SHARED; pwd; {UID}")),
        )
        .await
        .unwrap();
    assert_eq!(
        (r.exit_code, r.stdout.as_str()),
        (0, "yes mine\n/app\n0\n"),
        "{r:?}"
    );
    // The image's command ran before the sandbox was handed out.
    assert_eq!(
        c.read_file(&sb.id, "/tmp/started").await.unwrap().as_ref(),
        b"started\n"
    );
    assert_eq!(
        c.read_file(&sb.id, "/etc/motd").await.unwrap().as_ref(),
        b"from the second layer\n"
    );
    assert_eq!(
        c.read_file(&sb.id, "/app/hello").await.unwrap().as_ref(),
        b"hello\n"
    );
    assert_eq!(
        error_status(c.stat(&sb.id, "/usr/bin/cat").await),
        Some(404)
    );
    assert!(c.stat(&sb.id, "/usr/bin/sleep").await.is_ok());
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_docker_save_tarball_with_a_path_traversal_is_refused() {
    let d = Daemon::start().await;
    let c = d.client();
    let good = raw_layer(&[("usr/bin/tool", b"x"), ("etc/os-release", b"ok")]);
    let evil = raw_layer(&[("../../escaped", b"owned")]);
    let config = image_config(&[&good, &evil], serde_json::json!({}));
    // `docker save`: manifest.json, the config and one directory per layer, in a tarball.
    let mut outer = tar::Builder::new(Vec::new());
    let mut add = |name: &str, data: &[u8]| {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1_700_000_000);
        h.set_cksum();
        outer.append_data(&mut h, name, data).unwrap();
    };
    add(
        "manifest.json",
        &serde_json::to_vec(&serde_json::json!([{
            "Config": "config.json",
            "RepoTags": ["evil:latest"],
            "Layers": ["aaa/layer.tar", "bbb/layer.tar"],
        }]))
        .unwrap(),
    );
    add("config.json", &config);
    add("aaa/layer.tar", &good);
    add("bbb/layer.tar", &evil);
    let tarball = temp_dir("sandpit-image-");
    let path = tarball.path().join("evil.tar");
    std::fs::write(&path, outer.into_inner().unwrap()).unwrap();
    let started = c.build_template(&oci_build("evil", &path)).await.unwrap();
    let (t, log) = wait_built(&c, "evil", Duration::from_secs(120)).await;
    assert_eq!(t.state, "failed", "{t:?} {log:#?}");
    let why = t.error.unwrap_or_default();
    assert!(why.contains("unsafe member name"), "{why}");
    // Nothing of the build is left, and nothing escaped it.
    let work = Path::new(&started.rootfs).parent().unwrap().to_path_buf();
    assert!(!work.exists());
    let templates = d.data.path().join("templates");
    for p in [templates.join("escaped"), d.data.path().join("escaped")] {
        assert!(!p.exists(), "{} was written", p.display());
    }
    let left: Vec<String> = std::fs::read_dir(&templates)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("evil"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    assert_eq!(
        error_status(c.create_sandbox(&from("evil")).await),
        Some(409)
    );
    // A path that is neither a directory nor a tarball of an image fails the same way.
    let junk = tarball.path().join("junk.tar");
    std::fs::write(&junk, b"not a tarball").unwrap();
    c.build_template(&oci_build("junk", &junk)).await.unwrap();
    let (t, _) = wait_built(&c, "junk", Duration::from_secs(60)).await;
    assert_eq!(t.state, "failed", "{t:?}");
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_build_cut_short_by_a_daemon_stop_is_failed_and_cleaned_at_the_next_start() {
    let mut d = Daemon::start().await;
    let c = d.client();
    let src = temp_dir("sandpit-tsrc-");
    tiny_rootfs(src.path());
    let kept = build_ready(&c, &dir_build("kept", src.path())).await;
    d.stop();
    // What a daemon killed mid-build leaves: a `building` record and its half-made
    // directory; and a build directory whose record is gone altogether.
    let templates = d.data.path().join("templates");
    let half = templates.join("half-abc123");
    let stray = templates.join("stray-def456");
    for dir in [&half, &stray] {
        std::fs::create_dir_all(dir.join("rootfs/usr/bin")).unwrap();
        std::fs::write(dir.join("sandpit-build.json"), "{}").unwrap();
    }
    let db = d.store().await;
    db.insert_template_build(&sandpit_store::TemplateRecord {
        name: "half".into(),
        rootfs: half.join("rootfs").to_str().unwrap().into(),
        source: serde_json::json!({"kind": "dir", "path": "/x"}),
        state: sandpit_store::TemplateState::Building,
        build_id: Some("abc123".into()),
        ..Default::default()
    })
    .await
    .unwrap();
    db.close().await;
    let d = d.restart().start().await;
    let c = d.client();
    let t = c.get_template("half").await.unwrap();
    assert_eq!(t.state, "failed", "{t:?}");
    assert!(t.error.unwrap_or_default().contains("interrupted"));
    assert!(!half.exists() && !stray.exists());
    // The finished template and the host skeleton are untouched.
    assert!(Path::new(&kept.rootfs).join("usr/bin/sandpit").is_file());
    let sb = c.create_sandbox(&from("kept")).await.unwrap();
    assert_eq!(sb.state, "running");
    // The failed name can be built again.
    build_ready(&c, &dir_build("half", src.path())).await;
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_woken_or_forked_sandbox_runs_its_start_command_again() {
    let d = Daemon::start().await;
    let c = d.client();
    let src = temp_dir("sandpit-tsrc-");
    shell_rootfs(src.path());
    // Counts its starts in a file that the sandbox's files keep. The ready flag lives in
    // /dev/shm, which is not part of the captured files: a flag in /tmp would be copied into
    // a fork and pass its readiness check before the fork's own start command has run.
    let req = BuildTemplateRequest {
        start_cmd: Some(
            "n=$(cat /home/user/starts 2>/dev/null || echo 0); echo $((n+1)) > /home/user/starts; : > /dev/shm/up; while :; do sleep 1; done"
                .into(),
        ),
        ready_cmd: Some("test -f /dev/shm/up".into()),
        ..dir_build("counted", src.path())
    };
    build_ready(&c, &req).await;
    let sb = c.create_sandbox(&from("counted")).await.unwrap();
    let starts = |id: String| {
        let c = c.clone();
        async move { c.read_file(&id, "/home/user/starts").await.unwrap() }
    };
    assert_eq!(starts(sb.id.clone()).await.as_ref(), b"1\n");
    // Hibernation ends the processes; the wake starts the service again on the same files.
    assert_eq!(c.hibernate(&sb.id).await.unwrap().state, "hibernated");
    assert_eq!(c.resume(&sb.id).await.unwrap().state, "running");
    assert_eq!(starts(sb.id.clone()).await.as_ref(), b"2\n");
    let cmds = c.list_commands(&sb.id).await.unwrap();
    assert!(
        cmds.iter()
            .any(|p| p.tag.as_deref() == Some("template-start")),
        "{cmds:?}"
    );
    // A fork gets the files and a service of its own.
    let forks = c
        .fork(
            &sb.id,
            &sandpit_api::ForkRequest {
                count: Some(1),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(forks.len(), 1);
    assert_eq!(starts(forks[0].id.clone()).await.as_ref(), b"3\n");
    assert_eq!(starts(sb.id.clone()).await.as_ref(), b"2\n");
    d.shutdown().await;
}
