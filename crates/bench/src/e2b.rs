//! The E2B phase: E2B's own Python SDK, unmodified, timing `Sandbox.create()` to the end
//! of the first `commands.run("true")`, beside sandpit's native API doing the same in the
//! same run (the SDK's and the compatibility layer's cost is the difference).

use super::report::Report;
use super::{Bench, ms};
use anyhow::{Context, bail};
use std::time::Instant;

/// The timing script, run with a Python that has `e2b` installed.
const SCRIPT: &str = include_str!("e2b_sdk.py");

impl Bench {
    pub(super) async fn e2b(&self, report: &mut Report) -> anyhow::Result<()> {
        let Some(e2b) = &self.e2b else {
            bail!("no API key to give the E2B SDK");
        };
        let n = self.iterations.max(1);
        let api = &self.api;
        // The native baseline first: create, then `true`, through sandpit's own API.
        let mut native = Vec::with_capacity(n);
        let req = api.request(Default::default());
        for _ in 0..n {
            api.cancel.check()?;
            let t = Instant::now();
            let (sb, _, ran) = api.create_first_exec(&req).await?;
            native.push(ms(t.elapsed()));
            api.delete(&sb.id).await?;
            ran?;
        }
        report.set_dist("baseline.native_create_first_exec", Ok(native));

        let mut cmd = tokio::process::Command::new(&e2b.python);
        cmd.arg("-c")
            .arg(SCRIPT)
            .arg(n.to_string())
            .arg("base")
            .arg(&api.tracker.run)
            .env("E2B_API_KEY", &e2b.key)
            .env("E2B_API_URL", &e2b.url)
            .env("E2B_SANDBOX_URL", &e2b.url)
            .env_remove("E2B_DEBUG")
            .kill_on_drop(true);
        let out = cmd
            .output()
            .await
            .with_context(|| format!("run {}", e2b.python.display()))?;
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            let last: Vec<&str> = err.lines().rev().take(5).collect();
            bail!(
                "the E2B SDK run failed (is `e2b` installed for {}? `scripts/setup.sh --test` puts it in target/test-venv): {}",
                e2b.python.display(),
                last.into_iter().rev().collect::<Vec<_>>().join(" | ")
            );
        }
        let samples: Vec<f64> =
            serde_json::from_slice(&out.stdout).context("the E2B SDK run printed no timings")?;
        report.set_dist("e2b_sdk_create_first_exec", Ok(samples));
        report.set_ratio(
            "e2b_sdk_vs_native",
            "e2b_sdk_create_first_exec.p50_ms",
            "baseline.native_create_first_exec.p50_ms",
        );
        Ok(())
    }
}
