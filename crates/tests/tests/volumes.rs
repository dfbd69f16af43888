//! Volumes against a real daemon: data and ownership outlive the sandboxes, read-only
//! mounts hold, the size limit is ENOSPC, hostile mount paths and templates cannot reach
//! the host, deletion is refused while mounted and leaves nothing, and restarts keep data.

use sandpit_api::{CreateSandboxRequest, PoolSpec, VolumeMountSpec};
use sandpit_client::Client;
use sandpit_tests::{Daemon, sandboxes, sandpit_bin, sh, sh_root, wait_no_leftovers};
use std::path::{Path, PathBuf};
use std::time::Duration;

const MIB: u64 = 1 << 20;

fn mount(name: &str, path: &str, read_only: bool) -> VolumeMountSpec {
    VolumeMountSpec {
        name: name.into(),
        path: path.into(),
        read_only,
    }
}

fn with_volumes(volumes: Vec<VolumeMountSpec>) -> CreateSandboxRequest {
    CreateSandboxRequest {
        timeout: Some(600),
        volumes,
        ..Default::default()
    }
}

/// Loop devices whose backing file lies in this daemon's data directory.
fn loop_devices(d: &Daemon) -> Vec<String> {
    let dir = d.data.path().join("volumes");
    let Some(dir) = dir.to_str() else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for e in std::fs::read_dir("/sys/block").unwrap().flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if !name.starts_with("loop") {
            continue;
        }
        if let Ok(file) = std::fs::read_to_string(e.path().join("loop/backing_file"))
            && file.starts_with(dir)
        {
            found.push(format!("{name} {}", file.trim()));
        }
    }
    found
}

/// Host mounts of this daemon's volumes.
fn host_mounts(d: &Daemon) -> Vec<String> {
    let dir = d.data.path().join("volumes");
    std::fs::read_to_string("/proc/mounts")
        .unwrap()
        .lines()
        .filter(|l| {
            l.split(' ')
                .nth(1)
                .is_some_and(|m| Path::new(m).starts_with(&dir))
        })
        .map(String::from)
        .collect()
}

/// The host mount of the daemon's only volume (ids are not part of the API).
fn only_host_mount(d: &Daemon) -> PathBuf {
    let dirs: Vec<PathBuf> = std::fs::read_dir(d.data.path().join("volumes/mnt"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert_eq!(dirs.len(), 1, "{dirs:?}");
    dirs[0].clone()
}

/// Deletes a volume whose sandboxes were just deleted, and checks that no loop device or
/// mount of this daemon's volumes is left.
async fn delete_volume_and_check(d: &Daemon, c: &Client, name: &str) {
    c.delete_volume(name).await.expect("delete volume");
    assert!(c.get_volume(name).await.unwrap_err().is_not_found());
    assert_eq!(c.delete_volume(name).await.unwrap_err().status(), Some(404));
    assert_eq!(loop_devices(d), Vec::<String>::new());
    assert_eq!(host_mounts(d), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_and_ownership_outlive_the_sandbox() {
    let d = Daemon::start().await;
    let c = d.client();
    let v = c.create_volume("shared", 64 * MIB).await.unwrap();
    assert_eq!((v.size_bytes, v.state.as_str()), (64 * MIB, "ready"));
    assert!(v.in_use_by.is_empty());
    assert!(v.available_bytes.unwrap() > 40 * MIB, "{v:?}");

    let a = c
        .create_sandbox(&with_volumes(vec![mount(
            "shared",
            "/workspace/data",
            false,
        )]))
        .await
        .unwrap();
    // A fresh volume is an empty directory that `user` owns.
    let r = sh(
        &c,
        &a.id,
        "stat -c '%U %G %a' /workspace/data; ls -A /workspace/data",
    )
    .await;
    assert_eq!(
        (r.exit_code, r.stdout.as_str()),
        (0, "user user 755\n"),
        "{r:?}"
    );
    let r = sh(
        &c,
        &a.id,
        "set -e; cd /workspace/data; echo from-a > notes; mkdir sub; echo deep > sub/f; \
         head -c 3000000 /dev/urandom > blob; sha256sum blob | cut -d' ' -f1; cat /proc/self/uid_map",
    )
    .await;
    assert_eq!(r.exit_code, 0, "{r:?}");
    let mut lines = r.stdout.lines();
    let blob_hash = lines.next().unwrap().to_string();
    let a_map = lines.next().unwrap().to_string();
    let r = sh_root(
        &c,
        &a.id,
        "echo secret > /workspace/data/rootfile; chmod 600 /workspace/data/rootfile",
    )
    .await;
    assert_eq!(r.exit_code, 0, "{r:?}");
    let info = c.get_volume("shared").await.unwrap();
    assert_eq!(info.in_use_by, vec![a.id.clone()]);
    assert!(info.used_bytes.unwrap() >= 3_000_000, "{info:?}");

    // On the host, files carry the inner ids, not sandbox A's host ids.
    {
        use std::os::unix::fs::MetadataExt;
        let host = only_host_mount(&d);
        let m = std::fs::metadata(host.join("notes")).unwrap();
        assert_eq!((m.uid(), m.gid()), (1000, 1000));
        let m = std::fs::metadata(host.join("rootfile")).unwrap();
        assert_eq!((m.uid(), m.gid()), (0, 0));
    }

    c.delete_sandbox(&a.id).await.unwrap();
    assert_eq!(wait_no_leftovers(&d, &a.id).await, Vec::<String>::new());

    // Sandbox B has another uid range (A's freed one goes to a sandbox started first),
    // and sees the files as their inner owners.
    let filler = d.sandbox(Default::default()).await;
    let b = c
        .create_sandbox(&with_volumes(vec![mount("shared", "/mnt/v", false)]))
        .await
        .unwrap();
    let r = sh(
        &c,
        &b.id,
        "cd /mnt/v; stat -c '%U %G %n' notes sub sub/f rootfile; cat notes sub/f; \
         sha256sum blob | cut -d' ' -f1; cat /proc/self/uid_map; echo more >> notes; \
         cat rootfile 2>&1 || true",
    )
    .await;
    assert_eq!(r.exit_code, 0, "{r:?}");
    let lines: Vec<&str> = r.stdout.lines().collect();
    assert_eq!(
        &lines[..6],
        &[
            "user user notes",
            "user user sub",
            "user user sub/f",
            "root root rootfile",
            "from-a",
            "deep"
        ],
        "{r:?}"
    );
    assert_eq!(lines[6], blob_hash);
    assert_ne!(lines[7], a_map, "sandboxes A and B share a uid range");
    assert!(lines[8].contains("Permission denied"), "{r:?}");
    let r = sh_root(&c, &b.id, "cat /mnt/v/rootfile; cat /mnt/v/notes").await;
    assert_eq!(r.stdout, "secret\nfrom-a\nmore\n", "{r:?}");

    // Deleting it while B has it mounted is refused and changes nothing.
    let e = c.delete_volume("shared").await.unwrap_err();
    assert_eq!(e.status(), Some(409), "{e}");
    assert!(e.to_string().contains(&b.id), "{e}");
    assert_eq!(sh(&c, &b.id, "cat /mnt/v/sub/f").await.stdout, "deep\n");

    c.delete_sandbox(&b.id).await.unwrap();
    c.delete_sandbox(&filler).await.unwrap();
    delete_volume_and_check(&d, &c, "shared").await;
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_mounts_refuse_writes_and_remounts() {
    let d = Daemon::start().await;
    let c = d.client();
    c.create_volume("ro", 32 * MIB).await.unwrap();
    // The same volume twice: writable at /rw, read-only at /ro.
    let sb = c
        .create_sandbox(&with_volumes(vec![
            mount("ro", "/rw", false),
            mount("ro", "/ro", true),
        ]))
        .await
        .unwrap();
    let r = sh(&c, &sb.id, "echo hi > /rw/f && cat /ro/f").await;
    assert_eq!((r.exit_code, r.stdout.as_str()), (0, "hi\n"), "{r:?}");
    for (who, out) in [
        ("user", sh(&c, &sb.id, "echo x > /ro/g").await),
        ("root", sh_root(&c, &sb.id, "echo x > /ro/g").await),
        ("root", sh_root(&c, &sb.id, "rm /ro/f").await),
        ("root", sh_root(&c, &sb.id, "mkdir /ro/d").await),
    ] {
        assert_ne!(out.exit_code, 0, "{who}: {out:?}");
        assert!(
            out.stderr.contains("Read-only file system"),
            "{who}: {out:?}"
        );
    }
    // Root inside cannot make it writable again.
    let r = sh_root(&c, &sb.id, "mount -o remount,rw /ro").await;
    assert_ne!(r.exit_code, 0, "{r:?}");
    let r = sh_root(&c, &sb.id, "mount -o remount,bind,rw /ro").await;
    assert_ne!(r.exit_code, 0, "{r:?}");
    let r = sh_root(&c, &sb.id, "umount /ro").await;
    assert_ne!(r.exit_code, 0, "{r:?}");
    let r = sh_root(&c, &sb.id, "echo x > /ro/g").await;
    assert!(r.stderr.contains("Read-only file system"), "{r:?}");
    let r = sh(
        &c,
        &sb.id,
        "grep -E ' /(ro|rw) ' /proc/self/mounts | cut -d' ' -f2,4",
    )
    .await;
    let opts: Vec<&str> = r.stdout.lines().collect();
    assert_eq!(opts.len(), 2, "{r:?}");
    for l in &opts {
        let (path, o) = l.split_once(' ').unwrap();
        let o: Vec<&str> = o.split(',').collect();
        assert!(o.contains(&"nosuid") && o.contains(&"nodev"), "{l}");
        assert_eq!(o.contains(&"ro"), path == "/ro", "{l}");
    }
    assert_eq!(
        std::fs::read_to_string(only_host_mount(&d).join("f")).unwrap(),
        "hi\n"
    );
    c.delete_sandbox(&sb.id).await.unwrap();
    delete_volume_and_check(&d, &c, "ro").await;
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_size_limit_is_enospc_inside() {
    let d = Daemon::start().await;
    let c = d.client();
    c.create_volume("small", 16 * MIB).await.unwrap();
    let sb = c
        .create_sandbox(&with_volumes(vec![mount("small", "/data", false)]))
        .await
        .unwrap();
    let r = sh(&c, &sb.id, "head -c 40M /dev/zero > /data/big").await;
    assert_ne!(r.exit_code, 0, "{r:?}");
    assert!(r.stderr.contains("No space left on device"), "{r:?}");
    let r = sh(&c, &sb.id, "stat -c %s /data/big").await;
    let written: u64 = r.stdout.trim().parse().unwrap();
    assert!(written > 8 * MIB && written < 16 * MIB, "{written}");
    let v = c.get_volume("small").await.unwrap();
    assert!(v.used_bytes.unwrap() >= written, "{v:?}");
    assert!(v.available_bytes.unwrap() < MIB, "{v:?}");
    // The image on the host never grows past the volume's size.
    {
        use std::os::unix::fs::MetadataExt;
        let images: Vec<_> = std::fs::read_dir(d.data.path().join("volumes/images"))
            .unwrap()
            .flatten()
            .collect();
        assert_eq!(images.len(), 1);
        let m = images[0].metadata().unwrap();
        assert_eq!(m.len(), 16 * MIB);
        assert!(
            m.blocks() * 512 <= 16 * MIB,
            "{} allocated",
            m.blocks() * 512
        );
    }
    // Space comes back when the file goes.
    let r = sh(
        &c,
        &sb.id,
        "rm /data/big && head -c 4M /dev/zero > /data/again && echo ok",
    )
    .await;
    assert_eq!(r.stdout, "ok\n", "{r:?}");
    c.delete_sandbox(&sb.id).await.unwrap();
    delete_volume_and_check(&d, &c, "small").await;
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volume_requests_are_checked_and_owner_scoped() {
    let d = Daemon::start().await;
    let c = d.client();
    for (name, size) in [
        ("toosmall", MIB),
        ("toobig", 2 << 40),
        ("", 64 * MIB),
        ("Upper", 64 * MIB),
        ("-dash", 64 * MIB),
        ("a/b", 64 * MIB),
        ("dots..", 64 * MIB),
    ] {
        let e = c.create_volume(name, size).await.unwrap_err();
        assert_eq!(e.status(), Some(400), "{name:?} {size}: {e}");
    }
    c.create_volume("mine", 16 * MIB).await.unwrap();
    let e = c.create_volume("mine", 16 * MIB).await.unwrap_err();
    assert_eq!(e.status(), Some(409), "{e}");
    let names: Vec<String> = c
        .list_volumes()
        .await
        .unwrap()
        .into_iter()
        .map(|v| v.name)
        .collect();
    assert_eq!(names, ["mine"]);

    // Another owner neither sees nor mounts nor deletes it, and may use the same name.
    let m = d.owner("mallory").await;
    assert!(m.list_volumes().await.unwrap().is_empty());
    assert!(m.get_volume("mine").await.unwrap_err().is_not_found());
    assert!(m.delete_volume("mine").await.unwrap_err().is_not_found());
    let e = m
        .create_sandbox(&with_volumes(vec![mount("mine", "/data", false)]))
        .await
        .unwrap_err();
    assert_eq!(e.status(), Some(404), "{e}");
    assert!(e.to_string().contains("volume mine not found"), "{e}");
    assert!(sandboxes(&m).await.is_empty());
    m.create_volume("mine", 16 * MIB).await.unwrap();
    m.delete_volume("mine").await.unwrap();
    assert_eq!(c.get_volume("mine").await.unwrap().state, "ready");

    c.delete_volume("mine").await.unwrap();
    assert_eq!(loop_devices(&d), Vec::<String>::new());
    let doc: serde_json::Value = reqwest::get(format!("{}/v1/openapi.json", d.url))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    for path in ["/v1/volumes", "/v1/volumes/{name}"] {
        assert!(doc["paths"][path].is_object(), "{path} not documented");
    }
    assert!(doc["components"]["schemas"]["VolumeMountSpec"].is_object());
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_mount_paths_are_refused_and_leave_nothing() {
    let d = Daemon::start().await;
    let c = d.client();
    c.create_volume("v", 16 * MIB).await.unwrap();
    let refused = [
        vec![mount("v", "/proc/x", false)],
        vec![mount("v", "/proc", false)],
        vec![mount("v", "/sys/kernel", false)],
        vec![mount("v", "/dev/shm", false)],
        vec![mount("v", "/.sandpit", false)],
        vec![mount("v", "/", false)],
        vec![mount("v", "data", false)],
        vec![mount("v", "../etc", false)],
        vec![mount("v", "/workspace/../etc", false)],
        vec![mount("v", "/a", false), mount("v", "/a/", false)],
        vec![mount("v", "/a", false), mount("v", "/a/b", false)],
        vec![mount("Bad", "/a", false)],
        // Through the host template's read-only /usr (a mount of its own), directly or
        // through the /bin -> usr/bin symlink.
        vec![mount("v", "/usr/local/x", false)],
        vec![mount("v", "/bin/x", false)],
        // A file, not a directory.
        vec![mount("v", "/etc/hostname", false)],
    ];
    for volumes in refused {
        let e = c
            .create_sandbox(&with_volumes(volumes.clone()))
            .await
            .unwrap_err();
        assert_eq!(e.status(), Some(400), "{volumes:?}: {e}");
    }
    let e = c
        .create_sandbox(&with_volumes(vec![mount("nope", "/data", false)]))
        .await
        .unwrap_err();
    assert_eq!(e.status(), Some(404), "{e}");
    assert!(e.to_string().contains("volume nope not found"), "{e}");
    // No half-made sandbox, and the volume is free.
    assert!(sandboxes(&c).await.is_empty());
    for _ in 0..200 {
        if std::fs::read_dir(d.data.path().join("sandboxes"))
            .unwrap()
            .next()
            .is_none()
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let left: Vec<_> = std::fs::read_dir(d.data.path().join("sandboxes"))
        .unwrap()
        .collect();
    assert!(left.is_empty(), "{left:?}");
    assert!(c.get_volume("v").await.unwrap().in_use_by.is_empty());
    delete_volume_and_check(&d, &c, "v").await;
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn template_symlinks_cannot_lead_a_mount_onto_the_host() {
    let d = Daemon::start().await;
    let c = d.client();
    // A root filesystem with one static program (the sandpit binary) and symlinks that
    // would point at host paths if followed outside the sandbox.
    let rootfs = sandpit_tests::temp_dir("sandpit-rootfs-");
    let victim = sandpit_tests::temp_dir("sandpit-victim-");
    let r = rootfs.path();
    std::fs::create_dir_all(r.join("usr/bin")).unwrap();
    // The template has its own directory at the victim's path: a mount through `victim`
    // must land there, never in the host's.
    let victim_inner = r.join(victim.path().strip_prefix("/").unwrap());
    std::fs::create_dir_all(&victim_inner).unwrap();
    std::fs::create_dir_all(r.join("etc")).unwrap();
    std::fs::copy(sandpit_bin(), r.join("usr/bin/sandpit")).unwrap();
    for (name, target) in [
        ("workspace", PathBuf::from("/etc")),
        ("link", PathBuf::from("/etc")),
        ("rel", PathBuf::from("../../../../../../../../etc")),
        ("victim", victim.path().to_path_buf()),
        ("proclink", PathBuf::from("/proc")),
        ("dangling", PathBuf::from("/nonexistent/dir")),
        // Exists on the host, not in the template.
        ("hostonly", PathBuf::from("/var/lib")),
    ] {
        std::os::unix::fs::symlink(&target, r.join(name)).unwrap();
    }
    let out = std::process::Command::new(sandpit_bin())
        .args(["template", "add", "links", "--rootfs"])
        .arg(r)
        .arg("--data-dir")
        .arg(d.data.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let host_etc_before: Vec<_> = std::fs::read_dir("/etc")
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    c.create_volume("v", 16 * MIB).await.unwrap();
    let req = |path: &str| CreateSandboxRequest {
        template: Some("links".into()),
        ..with_volumes(vec![mount("v", path, false)])
    };
    // Each resolves inside the sandbox: the volume lands in the sandbox's own /etc or
    // under its own copy of the victim's path.
    let mut seen = Vec::new();
    for (path, inner) in [
        ("/workspace/data", "/workspace/data"),
        ("/link/vol", "/etc/vol"),
        ("/rel/vol2", "/etc/vol2"),
        ("/victim/sub", &*format!("{}/sub", victim.path().display())),
    ] {
        let sb = c
            .create_sandbox(&req(path))
            .await
            .unwrap_or_else(|e| panic!("{path}: {e}"));
        let file = format!("{inner}/from-{}", path.replace('/', "_"));
        c.write_file(&sb.id, &file, reqwest::Body::from("x"))
            .await
            .unwrap_or_else(|e| panic!("{file}: {e}"));
        seen.push(format!("from-{}", path.replace('/', "_")));
        c.delete_sandbox(&sb.id).await.unwrap();
    }
    for bad in ["/proclink/x", "/dangling", "/dangling/x", "/hostonly/x"] {
        let e = c.create_sandbox(&req(bad)).await.unwrap_err();
        assert_eq!(e.status(), Some(400), "{bad}: {e}");
    }
    // The host saw none of it.
    let host_etc_after: Vec<_> = std::fs::read_dir("/etc")
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(host_etc_before, host_etc_after);
    for p in [
        "/etc/data",
        "/etc/vol",
        "/etc/vol2",
        "/nonexistent",
        "/var/lib/x",
    ] {
        assert!(!Path::new(p).exists(), "{p} appeared on the host");
    }
    assert!(std::fs::read_dir(victim.path()).unwrap().next().is_none());
    // The volume got every file.
    let sb = c
        .create_sandbox(&with_volumes(vec![mount("v", "/check", false)]))
        .await
        .unwrap();
    let r = sh(&c, &sb.id, "ls /check | sort").await;
    seen.sort();
    assert_eq!(r.stdout, format!("{}\n", seen.join("\n")), "{r:?}");
    c.delete_sandbox(&sb.id).await.unwrap();
    delete_volume_and_check(&d, &c, "v").await;
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_with_volumes_never_takes_a_pool_sandbox() {
    let d = Daemon::start().await;
    let c = d.client();
    c.create_pool(&PoolSpec {
        name: "p".into(),
        size: 1,
        ..Default::default()
    })
    .await
    .unwrap();
    for _ in 0..300 {
        if c.get_pool("p").await.unwrap().ready == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(c.get_pool("p").await.unwrap().ready, 1);
    c.create_volume("v", 16 * MIB).await.unwrap();
    // Same template, runtime and (default) limits as the pool: only the volume differs.
    let sb = c
        .create_sandbox(&with_volumes(vec![mount("v", "/data", false)]))
        .await
        .unwrap();
    assert_eq!(sb.pool, None);
    let r = sh(&c, &sb.id, "echo ok > /data/f && cat /data/f").await;
    assert_eq!(r.stdout, "ok\n", "{r:?}");
    let p = c.get_pool("p").await.unwrap();
    assert_eq!((p.ready, p.hits), (1, 0));
    let plain = c.create_sandbox(&with_volumes(vec![])).await.unwrap();
    assert_eq!(plain.pool.as_deref(), Some("p"));
    c.delete_sandbox(&sb.id).await.unwrap();
    c.delete_sandbox(&plain.id).await.unwrap();
    delete_volume_and_check(&d, &c, "v").await;
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volumes_keep_their_data_across_daemon_restarts() {
    let mut d = Daemon::start().await;
    let c = d.client();
    c.create_volume("keep", 32 * MIB).await.unwrap();
    let a = c
        .create_sandbox(&with_volumes(vec![mount("keep", "/data", false)]))
        .await
        .unwrap();
    assert_eq!(sh(&c, &a.id, "echo one > /data/f").await.exit_code, 0);

    // A clean stop unmounts the volume from the host; the running sandbox keeps it (and
    // with it the loop device), and the next start mounts that same device again.
    d.stop();
    assert_eq!(host_mounts(&d), Vec::<String>::new());
    assert_eq!(loop_devices(&d).len(), 1, "{:?}", loop_devices(&d));
    let mut d = d.restart().start().await;
    let c = d.client();
    let r = sh(&c, &a.id, "cat /data/f; echo two >> /data/f").await;
    assert_eq!(r.stdout, "one\n", "{r:?}");
    let b = c
        .create_sandbox(&with_volumes(vec![mount("keep", "/data", true)]))
        .await
        .unwrap();
    let r = sh(&c, &b.id, "cat /data/f").await;
    assert_eq!(r.stdout, "one\ntwo\n", "{r:?}");
    assert_eq!(loop_devices(&d).len(), 1, "{:?}", loop_devices(&d));
    assert_eq!(
        c.get_volume("keep").await.unwrap().in_use_by.len(),
        2,
        "both sandboxes hold it"
    );

    // A crash of the daemon loses nothing either, and leaks nothing.
    c.delete_sandbox(&a.id).await.unwrap();
    c.delete_sandbox(&b.id).await.unwrap();
    assert_eq!(wait_no_leftovers(&d, &a.id).await, Vec::<String>::new());
    assert_eq!(wait_no_leftovers(&d, &b.id).await, Vec::<String>::new());
    d.kill9();
    assert_eq!(host_mounts(&d).len(), 1, "a crash leaves the host mount");
    let d = d.restart().start().await;
    let c = d.client();
    assert_eq!(loop_devices(&d).len(), 1, "{:?}", loop_devices(&d));
    let sb = c
        .create_sandbox(&with_volumes(vec![mount("keep", "/data", false)]))
        .await
        .unwrap();
    let r = sh(&c, &sb.id, "cat /data/f").await;
    assert_eq!(r.stdout, "one\ntwo\n", "{r:?}");
    assert_eq!(loop_devices(&d).len(), 1, "{:?}", loop_devices(&d));
    c.delete_sandbox(&sb.id).await.unwrap();
    delete_volume_and_check(&d, &c, "keep").await;
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_removes_volumes_a_crash_left_half_made() {
    let mut d = Daemon::start().await;
    let c = d.client();
    c.create_volume("good", 16 * MIB).await.unwrap();
    c.create_volume("half", 16 * MIB).await.unwrap();
    d.kill9();
    // As if the daemon had died in the middle of deleting "half", and had left an image
    // no record knows (a create cut short before its record).
    let db = d.store().await;
    let half = db.get_volume("admin", "half").await.unwrap().unwrap();
    assert!(
        db.set_volume_state(
            &half.id,
            sandpit_store::VolumeState::Ready,
            sandpit_store::VolumeState::Deleting
        )
        .await
        .unwrap()
    );
    db.close().await;
    let stray = d.data.path().join("volumes/images/stray.img");
    std::fs::write(&stray, b"").unwrap();
    assert_eq!(loop_devices(&d).len(), 2);
    let d = d.restart().start().await;
    let c = d.client();
    let names: Vec<String> = c
        .list_volumes()
        .await
        .unwrap()
        .into_iter()
        .map(|v| v.name)
        .collect();
    assert_eq!(names, ["good"]);
    assert!(!stray.exists());
    let devices = loop_devices(&d);
    assert_eq!(devices.len(), 1, "{devices:?}");
    assert!(!devices[0].contains(&half.id), "{devices:?}");
    delete_volume_and_check(&d, &c, "good").await;
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hibernation_forks_and_snapshots_keep_volumes_outside_the_files() {
    let d = Daemon::start().await;
    let c = d.client();
    c.create_volume("life", 32 * MIB).await.unwrap();
    let s = c
        .create_sandbox(&with_volumes(vec![mount("life", "/data", false)]))
        .await
        .unwrap();
    let r = sh(&c, &s.id, "echo vol > /data/v && echo layer > /home/user/l").await;
    assert_eq!(r.exit_code, 0, "{r:?}");

    // Hibernated, the sandbox still holds its volume, and gets it back when it wakes.
    assert_eq!(c.hibernate(&s.id).await.unwrap().state, "hibernated");
    assert_eq!(
        c.get_volume("life").await.unwrap().in_use_by,
        vec![s.id.clone()]
    );
    assert_eq!(
        c.delete_volume("life").await.unwrap_err().status(),
        Some(409)
    );
    c.resume(&s.id).await.unwrap();
    let r = sh(&c, &s.id, "cat /data/v /home/user/l; echo again >> /data/v").await;
    assert_eq!(r.stdout, "vol\nlayer\n", "{r:?}");

    // A fork copies the files and shares the volume.
    let forks = c
        .fork(&s.id, &sandpit_api::ForkRequest::default())
        .await
        .unwrap();
    assert_eq!(forks.len(), 1);
    let f = &forks[0].id;
    let r = sh(
        &c,
        f,
        "cat /data/v /home/user/l; echo fork > /data/from-fork",
    )
    .await;
    assert_eq!(r.stdout, "vol\nagain\nlayer\n", "{r:?}");
    assert_eq!(sh(&c, &s.id, "cat /data/from-fork").await.stdout, "fork\n");
    let mut users = c.get_volume("life").await.unwrap().in_use_by;
    users.sort();
    let mut want = vec![s.id.clone(), f.clone()];
    want.sort();
    assert_eq!(users, want);

    // A snapshot holds the sandbox's own files, not the volume's: a sandbox started from
    // it finds an empty mount point, or the volume when its create names it.
    let snap = c
        .snapshot(&s.id, &sandpit_api::CreateSnapshotRequest::default())
        .await
        .unwrap();
    let plain = c
        .create_sandbox(&CreateSandboxRequest {
            snapshot: Some(snap.id.clone()),
            ..with_volumes(vec![])
        })
        .await
        .unwrap();
    let r = sh(&c, &plain.id, "cat /home/user/l; ls -A /data | wc -l").await;
    assert_eq!(r.stdout, "layer\n0\n", "{r:?}");
    let mounted = c
        .create_sandbox(&CreateSandboxRequest {
            snapshot: Some(snap.id.clone()),
            ..with_volumes(vec![mount("life", "/data", true)])
        })
        .await
        .unwrap();
    let r = sh(&c, &mounted.id, "cat /data/from-fork").await;
    assert_eq!(r.stdout, "fork\n", "{r:?}");

    for id in [&s.id, f, &plain.id, &mounted.id] {
        c.delete_sandbox(id).await.unwrap();
    }
    c.delete_snapshot(&snap.id, true).await.unwrap();
    delete_volume_and_check(&d, &c, "life").await;
    d.shutdown().await;
}
