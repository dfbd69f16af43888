//! The E2B phase: E2B's own Python SDK, unmodified, timing `Sandbox.create()` to the end
//! of the first `commands.run("true")`, beside sandpit's native API doing the same in the
//! same run (the SDK's and the compatibility layer's cost is the difference).

use super::report::Report;
use super::{Bench, ms};
use anyhow::{Context, bail};
use std::path::Path;
use std::time::Instant;

/// The timing script, run with a Python that has `e2b` installed.
const SCRIPT: &str = include_str!("e2b_sdk.py");

/// Whether the optional E2B phase can run with `python`: `None` when `import e2b` works,
/// else why not, for the report's note (the phase is then skipped, as runsc's baseline is
/// when runsc is missing, rather than failing the run).
pub(super) async fn skip_reason(python: &Path) -> Option<String> {
    let out = tokio::process::Command::new(python)
        .args(["-c", "import e2b"])
        .env_remove("E2B_DEBUG")
        .kill_on_drop(true)
        .output()
        .await;
    let why = match out {
        Ok(o) if o.status.success() => return None,
        Ok(o) => {
            let err = String::from_utf8_lossy(&o.stderr);
            err.lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .map(|l| l.trim().to_string())
                .unwrap_or_else(|| format!("`import e2b` exited with {}", o.status))
        }
        Err(e) => format!("cannot run it: {e}"),
    };
    Some(format!(
        "skipped: E2B's Python SDK is not available to {} ({why}); \
         `scripts/setup.sh --test` installs it into target/test-venv, or pass --e2b-python",
        python.display()
    ))
}

impl Bench {
    pub(super) async fn e2b(&self, report: &mut Report) -> anyhow::Result<()> {
        let Some(e2b) = &self.e2b else {
            bail!("no API key to give the E2B SDK");
        };
        if let Some(why) = skip_reason(&e2b.python).await {
            eprintln!("note: e2b: {why}");
            report.set_dist("e2b_sdk_create_first_exec", Err(why));
            return Ok(());
        }
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

#[cfg(test)]
mod tests {
    use super::skip_reason;
    use std::os::unix::fs::PermissionsExt;

    /// A stand-in for python: a shell script that ignores its arguments.
    fn fake_python(dir: &std::path::Path, body: &str) -> std::path::PathBuf {
        let p = dir.join("python");
        std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p
    }

    #[tokio::test]
    async fn the_e2b_phase_is_skipped_with_a_note_when_the_sdk_cannot_be_imported() {
        let dir = tempfile::tempdir().unwrap();
        let missing = fake_python(
            dir.path(),
            "echo 'Traceback (most recent call last):' >&2\n\
             echo \"ModuleNotFoundError: No module named 'e2b'\" >&2\nexit 1",
        );
        let why = skip_reason(&missing).await.expect("skipped");
        assert!(why.starts_with("skipped:"), "{why}");
        assert!(why.contains("No module named 'e2b'"), "{why}");
        assert!(why.contains("--e2b-python"), "{why}");

        let absent = dir.path().join("no-such-python");
        let why = skip_reason(&absent).await.expect("skipped");
        assert!(why.contains("cannot run it"), "{why}");

        let works = fake_python(dir.path(), "exit 0");
        assert_eq!(skip_reason(&works).await, None);
    }
}
