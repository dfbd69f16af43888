//! Density: what N idle sandboxes cost the host, their agents and the daemon, and whether
//! they all still answer.

use std::collections::{BTreeSet, VecDeque};
use std::io::Read;
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use futures::StreamExt;

use super::proc::{self, UsedSample};
use super::report::{Report, quantile};
use super::{Bench, COLD_LIMITS, MIB, Progress, baselines, ms};

/// Host memory counts as settled when it moves less than this (KiB) ...
const QUIET_KB: u64 = 2048;
/// ... across this many samples taken 0.5 s apart (2 s) ...
const QUIET_WINDOW: usize = 5;
/// ... and the wait for that gives up after this long.
const QUIET_TIMEOUT: Duration = Duration::from_secs(30);

/// Whether a per-unit host memory figure can be trusted. Growth and release are two
/// independent readings of the same thing: when they agree and dwarf the sampling noise,
/// memory that was still moving elsewhere did not decide them.
fn credible(grown: f64, released: f64, noise: f64) -> bool {
    let disagree = (grown - released).abs() > grown.abs().max(released.abs()) / 4.0 + 0.5;
    grown > 0.0 && !disagree && noise <= grown.abs() / 2.0
}

/// Idle bwrap sandboxes, killed and reaped when dropped (and by the kernel if this process
/// dies first: `--die-with-parent`).
struct IdleBwraps(Vec<Child>);

impl Drop for IdleBwraps {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
        }
        for c in &mut self.0 {
            let _ = c.wait();
        }
    }
}

impl Bench {
    /// `baseline.idle_bwrap.*`: what `n` idle `bwrap --unshare-all ... sleep infinity` cost
    /// the host, measured as the sandboxes are.
    pub(super) async fn idle_bwrap(&self, report: &mut Report, n: usize) -> anyhow::Result<()> {
        let key = |name: &str| format!("baseline.idle_bwrap.{name}");
        for name in [
            "per_sandbox_mb",
            "per_sandbox_released_mb",
            "rss_mb",
            "pss_mb",
        ] {
            report.set(&key(name), None);
        }
        if !baselines::in_path("bwrap") {
            report.note(&key("per_sandbox_mb"), "bwrap is not installed");
            return Ok(());
        }
        let mut unsettled = Vec::new();
        if !self.wait_for_quiet_memory().await? {
            unsettled.push("before");
        }
        let before = proc::sample_used_kb().await?;
        let mut idle = IdleBwraps(Vec::with_capacity(n));
        let progress = Progress::new("baseline: idle bwrap sandboxes", n);
        for i in 0..n {
            self.api.cancel.check()?;
            let child = baselines::bwrap(&["--die-with-parent", "sleep", "infinity"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .context("start bwrap")?;
            idle.0.push(child);
            progress.set(i + 1);
        }
        drop(progress);
        if !self.wait_for_quiet_memory().await? {
            unsettled.push("with them");
        }
        let with = proc::sample_used_kb().await?;
        for c in &mut idle.0 {
            if let Ok(Some(status)) = c.try_wait() {
                let mut err = String::new();
                if let Some(mut e) = c.stderr.take() {
                    let _ = e.read_to_string(&mut err);
                }
                bail!("an idle bwrap exited ({status}): {}", err.trim());
            }
        }
        let roots: Vec<i32> = idle
            .0
            .iter()
            .filter_map(|c| i32::try_from(c.id()).ok())
            .collect();
        let (mut rss, mut pss) = (Vec::new(), Vec::new());
        for tree in proc::process_trees(&roots) {
            rss.push(tree.iter().filter_map(|p| proc::vm_rss_kb(*p)).sum::<u64>() as f64);
            pss.push(tree.iter().filter_map(|p| proc::pss_kb(*p)).sum::<u64>() as f64);
        }
        drop(idle);
        if !self.wait_for_quiet_memory().await? {
            unsettled.push("after");
        }
        let after = proc::sample_used_kb().await?;
        let median_mb = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            quantile(&v, 0.5).map(|kb| kb / 1024.0)
        };
        let count = n as f64;
        let grown = (with.median - before.median) / 1024.0 / count;
        let released = (with.median - after.median) / 1024.0 / count;
        let noise = before.spread.max(with.spread).max(after.spread) / 1024.0 / count;
        report.set(&key("per_sandbox_mb"), Some(grown));
        report.set(&key("per_sandbox_released_mb"), Some(released));
        report.set(&key("rss_mb"), median_mb(rss));
        report.set(&key("pss_mb"), median_mb(pss));
        let mut note = format!(
            "{n} idle `bwrap --unshare-all --die-with-parent ... sleep infinity`: host memory \
             growth / N as for the sandboxes; rss_mb and pss_mb: median over the sandboxes of \
             the sum over their processes (bwrap, its pid-1 bwrap, sleep)"
        );
        note.push_str(&caveats(&unsettled, grown, released, noise, "each", ""));
        report.note(&key("per_sandbox_mb"), note);
        Ok(())
    }

    /// `idle.<n>.*`: what `n` idle sandboxes cost the host.
    pub(super) async fn idle(
        &self,
        report: &mut Report,
        n: usize,
        daemon: Option<i32>,
    ) -> anyhow::Result<()> {
        let key = |name: &str| format!("idle.{n}.{name}");
        for name in [
            "per_sandbox_mb",
            "per_sandbox_released_mb",
            "per_sandbox_noise_mb",
            "agent_rss_median_mb",
            "agent_rss_max_mb",
            "agent_pss_median_mb",
            "agent_pss_max_mb",
            "cgroup_memory_mb",
            "create_total_s",
            "delete_total_s",
            "daemon_rss_mb",
            "daemon_rss_per_sandbox_mb",
            "exec_failed",
        ] {
            report.set(&key(name), None);
        }
        report.declare_dist(&key("exec"));
        let req = self.api.request(COLD_LIMITS);
        // The sandboxes of the earlier measurements were just deleted, and the kernel hands
        // back what they held over several seconds (tens of MB here): a baseline taken during
        // that would make the sandboxes look free or even negative.
        let mut unsettled = Vec::new();
        if !self.wait_for_quiet_memory().await? {
            unsettled.push("before creating them");
        }
        let daemon_before = daemon.and_then(proc::vm_rss_kb);
        let used_before = proc::sample_used_kb().await?;

        let progress = Progress::new("idle sandboxes", n);
        let t = Instant::now();
        let mut ids = Vec::with_capacity(n);
        let mut failed = None;
        // After a failed create, the ones not yet started are skipped.
        let stop = AtomicBool::new(false);
        {
            let mut creates = futures::stream::iter((0..n).map(|_| async {
                if stop.load(Ordering::SeqCst) {
                    bail!("skipped");
                }
                self.api.cancel.check()?;
                self.api.create(&req).await
            }))
            .buffer_unordered(self.idle_concurrency);
            while let Some(r) = creates.next().await {
                match r {
                    Ok(sb) => ids.push(sb.id),
                    // Those in flight finish and are deleted below.
                    Err(e) => {
                        stop.store(true, Ordering::SeqCst);
                        failed.get_or_insert(e);
                    }
                }
                progress.set(ids.len());
            }
        }
        let create_s = t.elapsed().as_secs_f64();
        drop(progress);

        let measured = match failed {
            None => {
                let r = self
                    .measure_idle(report, n, &ids, daemon, daemon_before)
                    .await;
                match r {
                    Ok(used) => self.exec_each(report, n, &ids).await.map(|()| used),
                    Err(e) => Err(e),
                }
            }
            Some(e) => Err(e),
        };

        let t = Instant::now();
        let deleted = self
            .api
            .delete_all(&ids, self.idle_concurrency, "deleting idle sandboxes")
            .await;
        let delete_s = t.elapsed().as_secs_f64();
        let (used_with, settled_with) = measured?;
        deleted?;
        report.set(&key("create_total_s"), Some(create_s));
        report.set(&key("delete_total_s"), Some(delete_s));
        if !settled_with {
            unsettled.push("with them");
        }

        // The host-wide figure sees everything else the machine does, so it is taken twice:
        // as the growth when the sandboxes came and as the release once they were gone (after
        // the kernel's deferred freeing). Agreement makes it credible.
        if !self.wait_for_quiet_memory().await? {
            unsettled.push("after deleting them");
        }
        let used_after = proc::sample_used_kb().await?;
        let count = ids.len() as f64;
        let grown = (used_with.median - used_before.median) / 1024.0 / count;
        let released = (used_with.median - used_after.median) / 1024.0 / count;
        let noise = used_before
            .spread
            .max(used_with.spread)
            .max(used_after.spread)
            / 1024.0
            / count;
        report.set(&key("per_sandbox_mb"), Some(grown));
        report.set(&key("per_sandbox_released_mb"), Some(released));
        report.set(&key("per_sandbox_noise_mb"), Some(noise));
        let mut note = "growth of (MemTotal - MemAvailable) / N, each level the median of 3 \
                        samples 0.5 s apart taken once host memory had stopped moving; \
                        includes the daemon's growth; per_sandbox_released_mb is the same \
                        measured on deletion"
            .to_string();
        note.push_str(&caveats(
            &unsettled,
            grown,
            released,
            noise,
            "per sandbox",
            "; trust cgroup_memory_mb + agent_pss_median_mb instead, or rerun on a quiet machine",
        ));
        report.note(&key("per_sandbox_mb"), note);
        Ok(())
    }

    /// Waits until host memory in use stops moving (less than [`QUIET_KB`] over
    /// [`QUIET_WINDOW`] samples 0.5 s apart); false if it kept moving for [`QUIET_TIMEOUT`].
    async fn wait_for_quiet_memory(&self) -> anyhow::Result<bool> {
        let start = Instant::now();
        let mut window = VecDeque::with_capacity(QUIET_WINDOW);
        loop {
            self.api.cancel.check()?;
            if window.len() == QUIET_WINDOW {
                window.pop_front();
            }
            window.push_back(proc::host_used_kb()?);
            if window.len() == QUIET_WINDOW {
                let (lo, hi) = window
                    .iter()
                    .fold((u64::MAX, 0), |(lo, hi), &v| (lo.min(v), hi.max(v)));
                if hi - lo < QUIET_KB {
                    return Ok(true);
                }
            }
            if start.elapsed() >= QUIET_TIMEOUT {
                return Ok(false);
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    async fn measure_idle(
        &self,
        report: &mut Report,
        n: usize,
        ids: &[String],
        daemon: Option<i32>,
        daemon_before: Option<u64>,
    ) -> anyhow::Result<(UsedSample, bool)> {
        let key = |name: &str| format!("idle.{n}.{name}");
        let count = ids.len() as f64;
        let settled = self.wait_for_quiet_memory().await?;
        let used_with = proc::sample_used_kb().await?;

        let wanted: BTreeSet<&str> = ids.iter().map(String::as_str).collect();
        let agents = proc::agent_memory_kb(&wanted);
        if agents.is_empty() {
            report.note(
                &key("agent_rss_median_mb"),
                "found no sandpit-agent process in the sandboxes' cgroups",
            );
        } else {
            let mb = |mut v: Vec<f64>| {
                v.sort_by(f64::total_cmp);
                (
                    quantile(&v, 0.5).map(|x| x / 1024.0),
                    v.last().map(|x| x / 1024.0),
                )
            };
            let (rss_median, rss_max) = mb(agents.iter().map(|a| a.0 as f64).collect());
            // RSS counts the shared pages of the sandpit binary in full in every agent;
            // PSS splits them, which is what N agents really add up to.
            let (pss_median, pss_max) = mb(agents.iter().map(|a| a.1 as f64).collect());
            report.set(&key("agent_rss_median_mb"), rss_median);
            report.set(&key("agent_rss_max_mb"), rss_max);
            report.set(&key("agent_pss_median_mb"), pss_median);
            report.set(&key("agent_pss_max_mb"), pss_max);
            if agents.len() != ids.len() {
                report.note(
                    &key("agent_rss_median_mb"),
                    format!("found {} agents for {} sandboxes", agents.len(), ids.len()),
                );
            }
        }

        let progress = Progress::new("cgroup memory of each", ids.len());
        let mut cgroup = Vec::with_capacity(ids.len());
        for id in ids {
            self.api.cancel.check()?;
            match self.api.client.stats(id).await {
                Ok(s) => cgroup.push(s.memory_current_bytes as f64),
                Err(e) => {
                    report.note(&key("cgroup_memory_mb"), format!("stats of {id}: {e}"));
                    break;
                }
            }
            progress.set(cgroup.len());
        }
        drop(progress);
        if cgroup.len() == ids.len() {
            report.set(
                &key("cgroup_memory_mb"),
                Some(cgroup.iter().sum::<f64>() / count / MIB),
            );
        }

        if let Some(pid) = daemon {
            let after = proc::vm_rss_kb(pid);
            report.set(&key("daemon_rss_mb"), after.map(|kb| kb as f64 / 1024.0));
            if let (Some(a), Some(b)) = (after, daemon_before) {
                report.set(
                    &key("daemon_rss_per_sandbox_mb"),
                    Some((a as f64 - b as f64) / 1024.0 / count),
                );
            }
        }
        Ok((used_with, settled))
    }

    /// `idle.<n>.exec`: `true` in each idle sandbox, one after another (after the memory
    /// figures, which the execs would disturb); how many failed.
    async fn exec_each(&self, report: &mut Report, n: usize, ids: &[String]) -> anyhow::Result<()> {
        let progress = Progress::new("exec in each idle sandbox", ids.len());
        let (mut samples, mut failed, mut first_err) = (Vec::new(), 0usize, None);
        for (i, id) in ids.iter().enumerate() {
            self.api.cancel.check()?;
            let t = Instant::now();
            match self.api.run_true(id).await {
                Ok(()) => samples.push(ms(t.elapsed())),
                Err(e) => {
                    failed += 1;
                    first_err.get_or_insert_with(|| format!("{e:#}"));
                }
            }
            progress.set(i + 1);
        }
        report.set(&format!("idle.{n}.exec_failed"), Some(failed as f64));
        if let Some(e) = first_err {
            report.note(&format!("idle.{n}.exec_failed"), format!("first: {e}"));
        }
        report.set_dist(&format!("idle.{n}.exec"), Ok(samples));
        Ok(())
    }
}

/// What to add to a host-memory note when the readings cannot be trusted: memory that did
/// not settle, or growth and release that disagree (`per` names the unit, `advice` ends it).
fn caveats(
    unsettled: &[&str],
    grown: f64,
    released: f64,
    noise: f64,
    per: &str,
    advice: &str,
) -> String {
    let mut out = String::new();
    if !unsettled.is_empty() {
        out.push_str(&format!(
            "; host memory did not settle within {}s {}",
            QUIET_TIMEOUT.as_secs(),
            unsettled.join(", ")
        ));
    }
    if !credible(grown, released, noise) {
        out.push_str(&format!(
            "; UNRELIABLE in this run (growth {grown:.1} MB vs release {released:.1} MB {per}, \
             sample spread {noise:.1} MB): other activity on the machine{advice}"
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::credible;

    #[test]
    fn memory_credibility() {
        assert!(credible(1.5, 1.6, 0.0));
        assert!(!credible(-1.1, 1.5, 0.3));
        assert!(!credible(19.2, 1.0, 0.1));
        assert!(!credible(3.0, 2.9, 2.4));
    }
}
