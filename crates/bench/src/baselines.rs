//! The baselines: what starting `true` costs without sandpit, measured in the same run on
//! the same machine: fork+exec, `unshare` with the namespaces a sandbox gets, bwrap,
//! `crun run` (one at a time and N at once) and, where installed, gVisor's `runsc`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Barrier;
use std::time::Instant;

use anyhow::Context;
use serde_json::json;

use super::{Cancel, Progress, TempDir, ms, unix_ms};

/// Mount point of the cgroup2 hierarchy of a "hybrid" cgroup layout.
const HYBRID_UNIFIED: &str = "/sys/fs/cgroup/unified";

/// What the baseline thread measured: samples (or why not) per dotted prefix, single
/// figures, and notes.
#[derive(Default)]
pub(super) struct Baselines {
    pub dists: Vec<(&'static str, Result<Vec<f64>, String>)>,
    pub values: Vec<(&'static str, f64)>,
    pub notes: Vec<(&'static str, String)>,
}

/// Measures every baseline, `n` runs each and `concurrency` runs of crun at once (blocking).
pub(super) fn measure(n: usize, concurrency: usize, cancel: &Cancel) -> Baselines {
    let mut out = Baselines::default();
    let progress = Progress::new("baseline fork+exec", n);
    let fork = time_command(n, cancel, &progress, |_| Command::new("/bin/true"));
    drop(progress);
    out.dists.push(("baseline.fork_exec", fork));

    // The namespaces a container sandbox gets (crates/runtime: uts, ipc and net before the
    // init helper runs, then pid, user, mount and cgroup), without anything sandpit then
    // sets up inside them.
    let progress = Progress::new("baseline unshare", n);
    let unshare = time_command(n, cancel, &progress, |_| {
        let mut c = Command::new("unshare");
        c.args([
            "--user",
            "--map-root-user",
            "--mount",
            "--uts",
            "--ipc",
            "--net",
            "--pid",
            "--cgroup",
            "--fork",
            "true",
        ]);
        c
    });
    drop(progress);
    out.dists.push(("baseline.unshare", unshare));
    out.notes.push((
        "baseline.unshare",
        "unshare --user --map-root-user --mount --uts --ipc --net --pid --cgroup --fork true"
            .into(),
    ));

    let progress = Progress::new("baseline bwrap", n);
    let timed = time_command(n, cancel, &progress, |_| bwrap(&["true"]));
    drop(progress);
    out.dists.push(("baseline.bwrap", timed));

    if cancel.is_set() {
        return out;
    }
    match oci_baselines(n, concurrency, cancel, &mut out) {
        Ok(()) => {}
        Err(e) => out.dists.push(("baseline.crun_run", Err(e))),
    }
    out
}

/// `crun run` and `runsc run` of a bundle shaped like sandpit's host template.
fn oci_baselines(
    n: usize,
    concurrency: usize,
    cancel: &Cancel,
    out: &mut Baselines,
) -> Result<(), String> {
    let hybrid = is_mountpoint(HYBRID_UNIFIED);
    let bundle = TempDir::new("oci").map_err(|e| format!("{e:#}"))?;
    let parent = format!("sandpit-bench-oci-{}", std::process::id());
    let prefix = format!("sandpit-bench-{}-{}", std::process::id(), unix_ms());
    let rootfs = bundle.path().join("rootfs");
    write_rootfs(&rootfs).map_err(|e| format!("cannot write the bundle: {e:#}"))?;
    let one = bundle.path().join("one");
    write_config(&one, &rootfs, &format!("/{parent}/bench"))
        .map_err(|e| format!("cannot write the bundle: {e:#}"))?;

    if !in_path("crun") {
        out.dists
            .push(("baseline.crun_run", Err("crun is not installed".into())));
    } else if hybrid && !in_path("unshare") {
        out.dists.push((
            "baseline.crun_run",
            Err(
                "unshare (util-linux) is not installed, and crun needs it on this hybrid cgroup host"
                    .into(),
            ),
        ));
    } else {
        crun_baselines(
            n,
            concurrency,
            cancel,
            out,
            (bundle.path(), &one, &rootfs),
            (&parent, &prefix),
            hybrid,
        );
    }

    if cancel.is_set() {
        remove_cgroups(&parent);
        return Ok(());
    }
    if in_path("runsc") {
        let runsc = |args: &[&str]| {
            let mut c = Command::new("runsc");
            c.args(["--platform=ptrace", "--network=none"]).args(args);
            c
        };
        let id = |i: usize| format!("{prefix}-runsc-{i}");
        let progress = Progress::new("baseline runsc", n);
        let bundle = one.to_string_lossy().into_owned();
        let run = time_command(n, cancel, &progress, |i| {
            runsc(&["run", "--bundle", &bundle, &id(i)])
        });
        drop(progress);
        if run.is_err() {
            // A run that failed half-way may leave its container behind.
            for i in 0..=n {
                let _ = runsc(&["delete", "-force", &id(i)])
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status();
            }
        }
        out.dists.push(("baseline.runsc_ptrace", run));
    } else {
        out.dists.push((
            "baseline.runsc_ptrace",
            Err("runsc (gVisor) is not installed: skipped".into()),
        ));
    }
    remove_cgroups(&parent);
    Ok(())
}

fn crun_baselines(
    n: usize,
    concurrency: usize,
    cancel: &Cancel,
    out: &mut Baselines,
    (dir, one, rootfs): (&Path, &Path, &Path),
    (parent, prefix): (&str, &str),
    hybrid: bool,
) {
    let crun = |args: &[&str]| {
        if hybrid {
            // Debian's crun 1.8 refuses a hybrid layout; hiding cgroup2 in a private mount
            // namespace makes it a plain v1 host for crun.
            let mut c = Command::new("unshare");
            c.args([
                "-m",
                "sh",
                "-c",
                &format!("umount {HYBRID_UNIFIED} 2>/dev/null; exec crun \"$@\""),
                "sh",
            ]);
            c.args(args);
            c
        } else {
            let mut c = Command::new("crun");
            c.args(args);
            c
        }
    };
    let id = |i: usize| format!("{prefix}-{i}");
    let many_id = |i: usize| format!("{prefix}-many-{i}");
    // `crun run` removes a container that exited; one that failed half-way may remain.
    let delete_left = |ids: &mut dyn Iterator<Item = String>| {
        for id in ids {
            if Path::new("/run/crun").join(&id).exists() {
                let _ = crun(&["delete", "-f", &id])
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status();
            }
        }
    };

    let progress = Progress::new("baseline crun run", n);
    let bundle = one.to_string_lossy().into_owned();
    let run = time_command(n, cancel, &progress, |i| {
        crun(&["run", "--bundle", &bundle, &id(i)])
    });
    drop(progress);
    delete_left(&mut (0..=n).map(id));
    out.dists.push((
        "baseline.crun_run",
        run.map_err(|e| format!("crun run: {e}")),
    ));

    if hybrid {
        let progress = Progress::new("baseline unshare wrapper", n);
        let wrapper = time_command(n, cancel, &progress, |_| {
            let mut c = Command::new("unshare");
            c.args([
                "-m",
                "sh",
                "-c",
                &format!("umount {HYBRID_UNIFIED} 2>/dev/null; exec true"),
            ]);
            c
        });
        drop(progress);
        out.dists.push(("baseline.unshare_wrapper", wrapper));
        out.notes.push((
            "baseline.unshare_wrapper",
            format!(
                "cgroups are hybrid here and crun refuses them, so each crun is \
                 `unshare -m sh -c 'umount {HYBRID_UNIFIED}; exec crun run ...'`: the crun \
                 figures include that wrapper (measured alone as baseline.unshare_wrapper; \
                 crun_run_net = crun_run - wrapper)"
            ),
        ));
    }

    if cancel.is_set() || concurrency == 0 {
        return;
    }
    // N containers at once need N cgroups, so N configs (sharing the one rootfs).
    let mut bundles = Vec::with_capacity(concurrency);
    for i in 0..concurrency {
        let b = dir.join(format!("many-{i}"));
        if let Err(e) = write_config(&b, rootfs, &format!("/{parent}/many-{i}")) {
            out.dists.push((
                "baseline.crun_run_concurrent",
                Err(format!("cannot write the bundle: {e:#}")),
            ));
            return;
        }
        bundles.push(b.to_string_lossy().into_owned());
    }
    let many = time_concurrent(concurrency, |i| {
        crun(&["run", "--bundle", &bundles[i], &many_id(i)])
    });
    delete_left(&mut (0..concurrency).map(many_id));
    match many {
        Ok((samples, wall_ms)) => {
            out.values
                .push(("baseline.crun_run_concurrent.wall_ms", wall_ms));
            if wall_ms > 0.0 {
                out.values.push((
                    "baseline.crun_run_concurrent.per_s",
                    samples.len() as f64 * 1e3 / wall_ms,
                ));
            }
            out.dists
                .push(("baseline.crun_run_concurrent", Ok(samples)));
        }
        Err(e) => out.dists.push((
            "baseline.crun_run_concurrent",
            Err(format!("crun run: {e}")),
        )),
    }
}

/// `bwrap --unshare-all` with the host's /usr read-only (as the host template has it)
/// running `args`.
pub(super) fn bwrap(args: &[&str]) -> Command {
    let mut c = Command::new("bwrap");
    c.args([
        "--unshare-all",
        "--ro-bind",
        "/usr",
        "/usr",
        "--symlink",
        "usr/bin",
        "/bin",
        "--symlink",
        "usr/lib",
        "/lib",
        "--symlink",
        "usr/lib64",
        "/lib64",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
    ]);
    c.args(args);
    c
}

/// Starts `count` commands at once (threads released together by a barrier) and times each
/// to its exit; also the wall time from the first start to the last exit, in ms.
fn time_concurrent(
    count: usize,
    make: impl Fn(usize) -> Command + Sync,
) -> Result<(Vec<f64>, f64), String> {
    let barrier = Barrier::new(count);
    let runs: Vec<Result<(Instant, Instant), String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..count)
            .map(|i| {
                let (barrier, make) = (&barrier, &make);
                s.spawn(move || {
                    let mut cmd = make(i);
                    cmd.stdin(Stdio::null())
                        .stdout(Stdio::null())
                        .stderr(Stdio::null());
                    barrier.wait();
                    let t0 = Instant::now();
                    let status = cmd.status().map_err(|e| format!("cannot run: {e}"))?;
                    let t1 = Instant::now();
                    if !status.success() {
                        return Err(format!("failed ({status})"));
                    }
                    Ok((t0, t1))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a timing thread panicked".into()))
            })
            .collect()
    });
    let runs: Vec<(Instant, Instant)> = runs.into_iter().collect::<Result<_, _>>()?;
    let (Some(first), Some(last)) = (
        runs.iter().map(|r| r.0).min(),
        runs.iter().map(|r| r.1).max(),
    ) else {
        return Ok((Vec::new(), 0.0));
    };
    let samples = runs.iter().map(|(a, b)| ms(*b - *a)).collect();
    Ok((samples, ms(last - first)))
}

/// A read-only rootfs of empty mount points and the host template's symlinks.
fn write_rootfs(rootfs: &Path) -> anyhow::Result<()> {
    for d in ["usr", "proc", "dev", "tmp"] {
        let p = rootfs.join(d);
        std::fs::create_dir_all(&p).with_context(|| format!("create {}", p.display()))?;
    }
    for (link, target) in [
        ("bin", "usr/bin"),
        ("lib", "usr/lib"),
        ("lib64", "usr/lib64"),
        ("sbin", "usr/sbin"),
    ] {
        let p = rootfs.join(link);
        std::os::unix::fs::symlink(target, &p)
            .with_context(|| format!("create {}", p.display()))?;
    }
    Ok(())
}

/// An OCI bundle in `dir` running `/usr/bin/true` on `rootfs` with the host's /usr bound in
/// read-only, in the cgroup `cgroups_path`.
fn write_config(dir: &Path, rootfs: &Path, cgroups_path: &str) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let config = json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": 0, "gid": 0},
            "args": ["/usr/bin/true"],
            "env": ["PATH=/usr/bin:/bin"],
            "cwd": "/",
            "noNewPrivileges": true
        },
        "root": {"path": PathBuf::from(rootfs), "readonly": true},
        "hostname": "sandpit-bench",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/usr", "type": "bind", "source": "/usr", "options": ["rbind", "ro"]}
        ],
        "linux": {
            "namespaces": [
                {"type": "pid"}, {"type": "mount"}, {"type": "ipc"}, {"type": "uts"},
                {"type": "network"}
            ],
            // Explicit, or crun would put the containers at the root of the tree.
            "cgroupsPath": cgroups_path
        }
    });
    let path = dir.join("config.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&config)?)
        .with_context(|| format!("write {}", path.display()))?;
    Ok(())
}

/// Runs the command once with its output captured, to fail early with a useful reason, then
/// `n` times with the output discarded, timing each run to its exit.
fn time_command(
    n: usize,
    cancel: &Cancel,
    progress: &Progress,
    make: impl Fn(usize) -> Command,
) -> Result<Vec<f64>, String> {
    let mut probe = make(0);
    let program = probe.get_program().to_string_lossy().into_owned();
    let out = probe.stdin(Stdio::null()).output().map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            format!("{program} is not installed")
        } else {
            format!("cannot run {program}: {e}")
        }
    })?;
    if !out.status.success() {
        return Err(format!(
            "{program} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let mut samples = Vec::with_capacity(n);
    for i in 1..=n {
        if cancel.is_set() {
            return Err("interrupted".into());
        }
        let mut cmd = make(i);
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let t = Instant::now();
        let status = cmd
            .status()
            .map_err(|e| format!("cannot run {program}: {e}"))?;
        let elapsed = t.elapsed();
        if !status.success() {
            return Err(format!("{program} failed ({status}) on run {i}"));
        }
        samples.push(ms(elapsed));
        progress.set(i);
    }
    Ok(samples)
}

/// Removes `<hierarchy>/<parent>` (and the container cgroups below it) from every cgroup
/// hierarchy: v2 at /sys/fs/cgroup, v1 and hybrid one level down.
fn remove_cgroups(parent: &str) {
    let base = Path::new("/sys/fs/cgroup");
    let mut dirs = vec![base.join(parent)];
    if let Ok(entries) = std::fs::read_dir(base) {
        dirs.extend(entries.flatten().map(|e| e.path().join(parent)));
    }
    for dir in dirs {
        if !dir.is_dir() {
            continue;
        }
        // Children first: a cgroup with children cannot be removed.
        if let Ok(children) = std::fs::read_dir(&dir) {
            for child in children.flatten() {
                if child.file_type().is_ok_and(|t| t.is_dir()) {
                    let _ = std::fs::remove_dir(child.path());
                }
            }
        }
        match std::fs::remove_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => eprintln!("warning: cannot remove cgroup {}: {e}", dir.display()),
        }
    }
}

/// True if an executable file named `program` is in one of the `PATH` directories.
pub(super) fn in_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()))
}

/// True if `path` is a mount point of this mount namespace.
fn is_mountpoint(path: &str) -> bool {
    std::fs::read_to_string("/proc/self/mountinfo")
        .is_ok_and(|m| m.lines().any(|l| l.split_whitespace().nth(4) == Some(path)))
}
