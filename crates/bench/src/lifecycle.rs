//! The lifecycle phase: pause and resume, hibernation, a snapshot of 100 MiB of changes and
//! an incremental one, restore to first exec, and a fork of 10 copies, each beside the
//! host-side operation it should be judged against (a raw cgroup freeze, `tar | zstd` of
//! the same bytes, a full `cp -a` per copy) measured in the same run.

use super::report::Report;
use super::{Bench, MIB, TempDir, ms};
use anyhow::{Context, bail};
use sandpit_api::{CreateSnapshotRequest, ForkRequest, LimitsSpec, RunCommandRequest};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// Bytes of changes the snapshot measurement writes.
const CHANGES: u64 = 100 << 20;
/// Copies of the fork measurement.
const FORK_COPIES: u32 = 10;

impl Bench {
    pub(super) async fn lifecycle(&self, report: &mut Report) -> anyhow::Result<()> {
        let n = self.iterations.max(1);
        let limits = LimitsSpec {
            memory_bytes: Some(1 << 30),
            disk_bytes: Some(512 << 20),
            ..Default::default()
        };
        let api = &self.api;
        let c = &api.client;
        let id = api.create(&api.request(limits)).await?.id;
        let mut made = vec![id.clone()];
        let result = async {
            let sleep = RunCommandRequest {
                argv: vec!["sleep".into(), "3600".into()],
                ..Default::default()
            };
            c.run_background(&id, &sleep).await.context("start a process")?;
            // Pause and resume (freeze, memory kept).
            let (mut pause, mut resume) = (Vec::new(), Vec::new());
            for _ in 0..n {
                api.cancel.check()?;
                let t = Instant::now();
                c.pause(&id).await.context("pause")?;
                pause.push(ms(t.elapsed()));
                let t = Instant::now();
                c.resume(&id).await.context("resume")?;
                resume.push(ms(t.elapsed()));
            }
            report.set_dist("pause", Ok(pause));
            report.set_dist("resume", Ok(resume));
            let raw = tokio::task::spawn_blocking(move || raw_freeze(n))
                .await
                .context("the freezer baseline thread failed")?;
            match raw {
                Ok((f, t)) => {
                    report.set_dist("baseline.cgroup_freeze", Ok(f));
                    report.set_dist("baseline.cgroup_thaw", Ok(t));
                }
                Err(e) => {
                    report.set_dist("baseline.cgroup_freeze", Err(e.to_string()));
                    report.set_dist("baseline.cgroup_thaw", Err(e.to_string()));
                }
            }

            // 100 MiB of incompressible changes, then a full snapshot of them.
            let r = c
                .run(
                    &id,
                    &RunCommandRequest {
                        argv: vec![
                            "bash".into(),
                            "-c".into(),
                            format!(
                                "mkdir -p /home/user/bench && head -c {CHANGES} /dev/urandom > /home/user/bench/big"
                            ),
                        ],
                        ..Default::default()
                    },
                )
                .await
                .context("write the changes")?;
            if r.exit_code != 0 {
                bail!("writing the changes failed: {}", r.stderr.trim());
            }
            api.cancel.check()?;
            let t = Instant::now();
            let full = c
                .snapshot(&id, &CreateSnapshotRequest::default())
                .await
                .context("full snapshot")?;
            report.set("snapshot_full.ms", Some(ms(t.elapsed())));
            report.set("snapshot_full.size_mb", Some(full.size_bytes as f64 / MIB));
            // The same bytes through tar and zstd on the host.
            let base = tokio::task::spawn_blocking(tar_zstd_baseline)
                .await
                .context("the tar baseline thread failed")?;
            match base {
                Ok(v) => report.set("baseline.tar_zstd.ms", Some(v)),
                Err(e) => report.note("baseline.tar_zstd.ms", format!("not measured: {e:#}")),
            }
            // 1 MiB changed, then an incremental snapshot.
            c.run(
                &id,
                &RunCommandRequest {
                    argv: vec![
                        "bash".into(),
                        "-c".into(),
                        "head -c 1048576 /dev/urandom > /home/user/bench/small".into(),
                    ],
                    ..Default::default()
                },
            )
            .await
            .context("write 1 MiB")?;
            let t = Instant::now();
            let inc = c
                .snapshot(
                    &id,
                    &CreateSnapshotRequest {
                        name: None,
                        incremental: true,
                    },
                )
                .await
                .context("incremental snapshot")?;
            report.set("snapshot_incremental.ms", Some(ms(t.elapsed())));
            report.set("snapshot_incremental.size_mb", Some(inc.size_bytes as f64 / MIB));

            // Restore -> first exec: the first unpacks the chain, the next finds it unpacked.
            for key in ["restore_first_exec.first_ms", "restore_first_exec.cached_ms"] {
                api.cancel.check()?;
                let req = sandpit_api::CreateSandboxRequest {
                    snapshot: Some(inc.id.clone()),
                    template: None,
                    runtime: None,
                    ..api.request(limits)
                };
                let (sb, took, ran) = api.create_first_exec(&req).await?;
                made.push(sb.id.clone());
                ran?;
                report.set(key, Some(ms(took)));
            }

            // Hibernate and wake (to a first exec), the files being the 101 MiB above.
            let (mut hib, mut wake) = (Vec::new(), Vec::new());
            for _ in 0..n.min(10) {
                api.cancel.check()?;
                let t = Instant::now();
                c.hibernate(&id).await.context("hibernate")?;
                hib.push(ms(t.elapsed()));
                let t = Instant::now();
                c.resume(&id).await.context("wake")?;
                api.run_true(&id).await?;
                wake.push(ms(t.elapsed()));
            }
            report.set_dist("hibernate", Ok(hib));
            report.set_dist("wake_first_exec", Ok(wake));

            // A fork of 10 copies, all running when the call returns.
            api.cancel.check()?;
            let t = Instant::now();
            let copies = c
                .fork(
                    &id,
                    &ForkRequest {
                        count: Some(FORK_COPIES),
                        metadata: Some(api.request(limits).metadata),
                        ..Default::default()
                    },
                )
                .await
                .context("fork")?;
            report.set("fork_10.ms", Some(ms(t.elapsed())));
            for sb in &copies {
                api.tracker.insert(&sb.id);
                made.push(sb.id.clone());
            }
            let base = tokio::task::spawn_blocking(|| cp_baseline(FORK_COPIES))
                .await
                .context("the copy baseline thread failed")?;
            match base {
                Ok(v) => report.set("baseline.cp_10.ms", Some(v)),
                Err(e) => report.note("baseline.cp_10.ms", format!("not measured: {e:#}")),
            }
            for s in [&inc.id, &full.id] {
                let _ = c.delete_snapshot(s, true).await;
            }
            anyhow::Ok(())
        }
        .await;
        let deleted = api.delete_all(&made, 8, "deleting").await;
        report.set_ratio(
            "pause_vs_cgroup_freeze",
            "pause.p50_ms",
            "baseline.cgroup_freeze.p50_ms",
        );
        report.set_ratio(
            "resume_vs_cgroup_thaw",
            "resume.p50_ms",
            "baseline.cgroup_thaw.p50_ms",
        );
        report.set_ratio(
            "snapshot_vs_tar_zstd",
            "snapshot_full.ms",
            "baseline.tar_zstd.ms",
        );
        report.set_ratio("fork_10_vs_cp_10", "fork_10.ms", "baseline.cp_10.ms");
        result?;
        deleted
    }
}

/// A cgroup v1 freezer (or v2 `cgroup.freeze`) with one `sleep` in it, frozen and thawed
/// directly: the kernel's part of a pause.
fn raw_freeze(n: usize) -> anyhow::Result<(Vec<f64>, Vec<f64>)> {
    let name = format!("sandpit-bench-freeze-{}", std::process::id());
    let v1 = Path::new("/sys/fs/cgroup/freezer");
    // The root of a v1 freezer hierarchy has no freezer.state of its own.
    let (dir, state, frozen, thawed, wait) = if v1.join("cgroup.procs").exists() {
        (
            v1.join(&name),
            "freezer.state",
            "FROZEN",
            "THAWED",
            "freezer.state",
        )
    } else {
        (
            Path::new("/sys/fs/cgroup").join(&name),
            "cgroup.freeze",
            "1",
            "0",
            "cgroup.events",
        )
    };
    std::fs::create_dir(&dir).with_context(|| format!("create {}", dir.display()))?;
    if !dir.join("cgroup.procs").exists() {
        // Not a cgroup filesystem after all: leave nothing behind.
        let _ = std::fs::remove_dir(&dir);
        bail!("{} is not a cgroup", dir.display());
    }
    let mut child = Command::new("sleep")
        .arg("3600")
        .spawn()
        .context("spawn sleep")?;
    let run = (|| {
        std::fs::write(dir.join("cgroup.procs"), child.id().to_string()).context("join")?;
        let settle = |want: &str| -> anyhow::Result<()> {
            for _ in 0..100_000 {
                let s = std::fs::read_to_string(dir.join(wait))?;
                let done = if wait == "freezer.state" {
                    s.trim() == want
                } else {
                    s.lines()
                        .any(|l| l == format!("frozen {}", if want == "1" { 1 } else { 0 }))
                };
                if done {
                    return Ok(());
                }
                std::thread::sleep(Duration::from_micros(50));
            }
            bail!("the freezer did not settle")
        };
        let (mut f, mut t) = (Vec::new(), Vec::new());
        for _ in 0..n {
            let s = Instant::now();
            std::fs::write(dir.join(state), frozen)?;
            settle(frozen)?;
            f.push(ms(s.elapsed()));
            let s = Instant::now();
            std::fs::write(dir.join(state), thawed)?;
            settle(thawed)?;
            t.push(ms(s.elapsed()));
        }
        anyhow::Ok((f, t))
    })();
    let _ = std::fs::write(dir.join(state), thawed);
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir(&dir);
    run
}

/// `tar --zstd` of 100 MiB of random bytes on the host, in ms.
fn tar_zstd_baseline() -> anyhow::Result<f64> {
    let dir = TempDir::new("tar")?;
    let src = dir.path().join("src");
    std::fs::create_dir(&src)?;
    super::phases::write_payload(&src.join("big"), CHANGES)?;
    let t = Instant::now();
    let ok = Command::new("tar")
        .args(["--zstd", "-cf"])
        .arg(dir.path().join("out.tar.zst"))
        .arg("-C")
        .arg(&src)
        .arg(".")
        .status()
        .context("run tar")?
        .success();
    if !ok {
        bail!("tar --zstd failed");
    }
    Ok(ms(t.elapsed()))
}

/// `cp -a` of 101 MiB, `copies` times: what copying the files per copy would cost.
fn cp_baseline(copies: u32) -> anyhow::Result<f64> {
    let dir = TempDir::new("cp")?;
    let src = dir.path().join("src");
    std::fs::create_dir(&src)?;
    super::phases::write_payload(&src.join("big"), CHANGES + (1 << 20))?;
    let t = Instant::now();
    for i in 0..copies {
        let ok = Command::new("cp")
            .arg("-a")
            .arg(&src)
            .arg(dir.path().join(format!("copy{i}")))
            .status()
            .context("run cp")?
            .success();
        if !ok {
            bail!("cp failed");
        }
    }
    Ok(ms(t.elapsed()))
}
