//! `sandpit bench`: start latency, exec round trip, file throughput and density of a daemon,
//! with the baselines they should be judged against (fork+exec, bwrap, crun) measured in the
//! same run on the same machine. It prints figures; it never fails on a target.
//!
//! Every sandbox the benchmark creates carries the metadata label `sandpit-bench=<run>` and
//! is deleted before the command returns, also on errors and on Ctrl-C / SIGTERM (the first
//! signal lets the current step finish, a second one abandons it; either way the cleanup
//! runs, and it also finds sandboxes whose creation was cut short by their label).

use std::collections::{BTreeMap, BTreeSet};
use std::io::{IsTerminal, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, ToSocketAddrs};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, anyhow, bail};
use futures::StreamExt;
use sandpit_api::{CreateSandboxRequest, LimitsSpec, RunCommandRequest};
use sandpit_client::Client;
use serde_json::{Value, json};

/// Options of `sandpit bench`.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Sandboxes to create and delete one after another, for start latency.
    #[arg(long, default_value_t = 50)]
    pub iterations: u32,
    /// Idle sandboxes to hold at once, for density.
    #[arg(long, default_value_t = 100)]
    pub idle: u32,
    /// Print the results as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Metadata key that marks the benchmark's sandboxes (the value names the run).
const LABEL: &str = "sandpit-bench";
/// Size of the file written into and read back from a sandbox.
const FILE_BYTES: u64 = 100 << 20;
/// Where that file goes inside the sandbox (the writable layer).
const FILE_PATH: &str = "/tmp/sandpit-bench.bin";
/// Runs of `true` before the exec round trip is timed (connection set-up, agent caches).
const EXEC_WARMUP: usize = 3;
/// Lifetime given to the benchmark's sandboxes: if this process is SIGKILLed, the daemon's
/// reaper still removes them.
const SANDBOX_TIMEOUT_SECS: u64 = 1800;
/// The targets of the start-latency work, printed beside the figures (informational).
const TARGETS: [(&str, f64); 3] = [
    ("create_first_exec.p50_ms", 15.0),
    ("exec_rtt.p50_ms", 3.0),
    ("idle.per_sandbox_mb", 8.0),
];
/// Mount point of the cgroup2 hierarchy of a "hybrid" cgroup layout.
const HYBRID_UNIFIED: &str = "/sys/fs/cgroup/unified";
const MIB: f64 = (1u64 << 20) as f64;
/// Host memory counts as settled when it moves less than this (KiB) ...
const QUIET_KB: u64 = 2048;
/// ... across this many samples taken 0.5 s apart (2 s) ...
const QUIET_WINDOW: usize = 5;
/// ... and the wait for that gives up after this long.
const QUIET_TIMEOUT: Duration = Duration::from_secs(30);

/// Runs the benchmark against the daemon at the global `--url`.
pub async fn run(ctx: &crate::Ctx, args: BenchArgs) -> anyhow::Result<()> {
    let json_out = args.json || ctx.json;
    let client = ctx.client()?;
    let info = client
        .info()
        .await
        .with_context(|| format!("cannot query the daemon at {}", ctx.url))?;
    if !info.runtimes.iter().any(|r| r.name == "container") {
        bail!(
            "the daemon at {} offers no `container` runtime (it has: {})",
            ctx.url,
            info.runtimes
                .iter()
                .map(|r| r.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }

    let bench = Bench {
        client: client.clone(),
        iterations: args.iterations as usize,
        idle: args.idle as usize,
        timeout: SANDBOX_TIMEOUT_SECS.min(info.max_timeout),
        tracker: Tracker::new(format!("{}-{}", std::process::id(), unix_ms())),
        cancel: Cancel::default(),
    };
    let outcome = {
        let work = bench.run_all();
        tokio::pin!(work);
        let mut signalled = false;
        loop {
            tokio::select! {
                r = &mut work => break r,
                () = interrupted() => {
                    if signalled {
                        break Err(anyhow!("interrupted"));
                    }
                    signalled = true;
                    bench.cancel.set();
                    eprintln!(
                        "\ninterrupted: finishing the current step, then deleting the benchmark's sandboxes (again to stop at once)"
                    );
                }
            }
        }
    };
    let left = bench.cleanup().await;
    let (report, failed_phases) = outcome?;
    if !left.is_empty() {
        bail!(
            "could not delete the benchmark's sandboxes {} (label {LABEL}={})",
            left.join(", "),
            bench.tracker.run
        );
    }

    let header = Header {
        url: ctx.url.clone(),
        daemon_version: info.version,
        iterations: args.iterations,
        idle: args.idle,
    };
    if json_out {
        println!(
            "{}",
            serde_json::to_string_pretty(&report.to_json(&header))?
        );
    } else {
        print!("{}", report.to_table(&header));
    }
    if failed_phases > 0 {
        bail!("{failed_phases} measurement(s) failed (see above)");
    }
    Ok(())
}

/// Resolves on SIGINT or SIGTERM.
async fn interrupted() {
    use tokio::signal::unix::{SignalKind, signal};
    let ctrl_c = async {
        // Without a handler there is no Ctrl-C to wait for; that must not read as one.
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                () = ctrl_c => {}
                _ = term.recv() => {}
            }
        }
        Err(_) => ctrl_c.await,
    }
}

// ---- bookkeeping ----

/// Set by the first interrupt; every loop checks it between steps.
#[derive(Debug, Clone, Default)]
struct Cancel(Arc<AtomicBool>);

impl Cancel {
    fn set(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    fn is_set(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }

    fn check(&self) -> anyhow::Result<()> {
        if self.is_set() {
            bail!("interrupted");
        }
        Ok(())
    }
}

/// The sandboxes the benchmark created and has not deleted yet.
#[derive(Debug)]
struct Tracker {
    /// Value of the [`LABEL`] metadata of this run's sandboxes.
    run: String,
    live: Mutex<BTreeSet<String>>,
}

impl Tracker {
    fn new(run: String) -> Self {
        Tracker {
            run,
            live: Mutex::default(),
        }
    }

    fn insert(&self, id: &str) {
        if let Ok(mut live) = self.live.lock() {
            live.insert(id.to_string());
        }
    }

    fn remove(&self, id: &str) {
        if let Ok(mut live) = self.live.lock() {
            live.remove(id);
        }
    }

    fn take(&self) -> Vec<String> {
        match self.live.lock() {
            Ok(mut live) => std::mem::take(&mut *live).into_iter().collect(),
            Err(_) => Vec::new(),
        }
    }
}

/// A directory removed (with its contents) when dropped, so that no exit path leaves it.
struct TempDir(PathBuf);

impl TempDir {
    fn new(what: &str) -> anyhow::Result<Self> {
        let path = std::env::temp_dir().join(format!(
            "sandpit-bench-{what}-{}-{}",
            std::process::id(),
            unix_ms()
        ));
        std::fs::create_dir(&path).with_context(|| format!("create {}", path.display()))?;
        Ok(TempDir(path))
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.0) {
            eprintln!("warning: cannot remove {}: {e}", self.0.display());
        }
    }
}

/// A live `n/total` counter on stderr when it is a terminal (nothing otherwise).
struct Progress {
    label: &'static str,
    total: usize,
    tty: bool,
}

impl Progress {
    fn new(label: &'static str, total: usize) -> Self {
        let p = Progress {
            label,
            total,
            tty: std::io::stderr().is_terminal(),
        };
        p.set(0);
        p
    }

    fn set(&self, done: usize) {
        if self.tty {
            eprint!("\r\x1b[2K{} {done}/{}", self.label, self.total);
            let _ = std::io::stderr().flush();
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if self.tty {
            eprint!("\r\x1b[2K");
            let _ = std::io::stderr().flush();
        }
    }
}

fn unix_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or_default()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

// ---- the report ----

/// p50 and p95 of a set of samples.
#[derive(Debug, Clone, Copy)]
struct Dist {
    p50: f64,
    p95: f64,
}

impl Dist {
    /// Percentiles by linear interpolation between the closest ranks of the sorted samples.
    fn of(mut samples: Vec<f64>) -> Option<Dist> {
        if samples.is_empty() {
            return None;
        }
        samples.sort_by(f64::total_cmp);
        let at = |q: f64| {
            let rank = q * (samples.len() - 1) as f64;
            let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
            samples[lo] + (samples[hi] - samples[lo]) * (rank - lo as f64)
        };
        Some(Dist {
            p50: at(0.50),
            p95: at(0.95),
        })
    }
}

/// Figures under stable dotted names (null when not measured) and why some are missing.
#[derive(Debug, Default)]
struct Report {
    figures: BTreeMap<String, Option<f64>>,
    notes: BTreeMap<String, String>,
    /// Pid of the daemon, when it runs on this machine.
    daemon_pid: Option<i32>,
}

struct Header {
    url: String,
    daemon_version: String,
    iterations: u32,
    idle: u32,
}

impl Report {
    fn set(&mut self, key: &str, value: Option<f64>) {
        self.figures.insert(key.to_string(), value);
    }

    fn get(&self, key: &str) -> Option<f64> {
        self.figures.get(key).copied().flatten()
    }

    fn note(&mut self, key: &str, text: impl Into<String>) {
        self.notes.insert(key.to_string(), text.into());
    }

    /// `<prefix>.p50_ms` and `<prefix>.p95_ms`, or nulls and a note saying why.
    fn set_dist(&mut self, prefix: &str, samples: Result<Vec<f64>, String>) {
        let dist = match samples {
            Ok(s) => Dist::of(s).ok_or_else(|| "no samples (0 iterations)".to_string()),
            Err(e) => Err(e),
        };
        match dist {
            Ok(d) => {
                self.set(&format!("{prefix}.p50_ms"), Some(d.p50));
                self.set(&format!("{prefix}.p95_ms"), Some(d.p95));
            }
            Err(reason) => {
                self.set(&format!("{prefix}.p50_ms"), None);
                self.set(&format!("{prefix}.p95_ms"), None);
                self.note(prefix, reason);
            }
        }
    }

    /// `ratio.<name>` = a / b when both are known.
    fn set_ratio(&mut self, name: &str, a: &str, b: &str) {
        let ratio = match (self.get(a), self.get(b)) {
            (Some(a), Some(b)) if b > 0.0 => Some(a / b),
            _ => None,
        };
        self.set(&format!("ratio.{name}"), ratio);
    }

    fn to_json(&self, h: &Header) -> Value {
        // Three decimals are far below the noise of any of these figures.
        let round = |v: f64| (v * 1000.0).round() / 1000.0;
        let figures: serde_json::Map<String, Value> = self
            .figures
            .iter()
            .map(|(k, v)| (k.clone(), v.map(round).map_or(Value::Null, Value::from)))
            .collect();
        let targets: serde_json::Map<String, Value> = TARGETS
            .iter()
            .map(|(k, v)| (k.to_string(), Value::from(*v)))
            .collect();
        json!({
            "sandpit_version": env!("CARGO_PKG_VERSION"),
            "daemon_version": h.daemon_version,
            "url": h.url,
            "daemon_pid": self.daemon_pid,
            "iterations": h.iterations,
            "idle": h.idle,
            "units": "ms = milliseconds, MB = MiB (2^20 bytes), mb_per_s = MiB per second, s = seconds",
            "figures": figures,
            "targets": targets,
            "notes": self.notes,
        })
    }

    fn to_table(&self, h: &Header) -> String {
        use std::fmt::Write as _;
        let f = |key: &str, unit: &str| match self.get(key) {
            Some(v) if unit == "MB/s" || unit == "MB" => format!("{v:.1} {unit}"),
            Some(v) => format!("{v:.2} {unit}"),
            None => "n/a".to_string(),
        };
        let ratio = |key: &str| {
            self.get(key)
                .map_or_else(|| "n/a".to_string(), |r| format!("{r:.2}x"))
        };
        let target = |key: &str| {
            let Some((_, t)) = TARGETS.iter().find(|(k, _)| *k == key) else {
                return String::new();
            };
            let unit = if key.ends_with("_mb") { "MB" } else { "ms" };
            let verdict = match self.get(key) {
                // Only the host-wide memory growth can come out negative: noise.
                Some(v) if v <= 0.0 => "unreliable",
                Some(v) if v <= *t => "met",
                Some(_) => "missed",
                None => "n/a",
            };
            format!("<= {t} {unit} ({verdict})")
        };
        let line = |out: &mut String, cols: [&str; 6]| {
            let [label, p50, p95, base, ratio, target] = cols;
            let l = format!("{label:<32} {p50:>11} {p95:>11}   {base:<26} {ratio:>6}   {target}");
            let _ = writeln!(out, "{}", l.trim_end());
        };

        let mut out = String::new();
        let pid = self
            .daemon_pid
            .map_or_else(|| "not on this machine".to_string(), |p| format!("pid {p}"));
        let _ = writeln!(
            out,
            "sandpit bench: daemon {} (version {}, {pid}); {} iterations, {} idle sandboxes",
            h.url, h.daemon_version, h.iterations, h.idle
        );
        let _ = writeln!(
            out,
            "(MB = MiB; latencies are wall-clock as the client sees them)"
        );
        let _ = writeln!(out);
        line(
            &mut out,
            ["sandpit", "p50", "p95", "baseline p50", "ratio", "target"],
        );
        let base = |label: &str, key: &str| format!("{label} {}", f(key, "ms"));
        line(
            &mut out,
            [
                "create -> first exec",
                &f("create_first_exec.p50_ms", "ms"),
                &f("create_first_exec.p95_ms", "ms"),
                &base("crun run", "baseline.crun_run.p50_ms"),
                &ratio("ratio.create_vs_crun_run"),
                &target("create_first_exec.p50_ms"),
            ],
        );
        if self.get("baseline.crun_run_net.p50_ms").is_some() {
            line(
                &mut out,
                [
                    "",
                    "",
                    "",
                    &base("crun run net", "baseline.crun_run_net.p50_ms"),
                    &ratio("ratio.create_vs_crun_run_net"),
                    "",
                ],
            );
        }
        line(
            &mut out,
            [
                "",
                "",
                "",
                &base("bwrap", "baseline.bwrap.p50_ms"),
                &ratio("ratio.create_vs_bwrap"),
                "",
            ],
        );
        line(
            &mut out,
            [
                "delete",
                &f("delete.p50_ms", "ms"),
                &f("delete.p95_ms", "ms"),
                "",
                "",
                "",
            ],
        );
        line(
            &mut out,
            [
                "exec round trip",
                &f("exec_rtt.p50_ms", "ms"),
                &f("exec_rtt.p95_ms", "ms"),
                &base("fork+exec", "baseline.fork_exec.p50_ms"),
                &ratio("ratio.exec_vs_fork_exec"),
                &target("exec_rtt.p50_ms"),
            ],
        );
        let single = |out: &mut String, label: &str, key: &str, unit: &str, extra: &str| {
            line(out, [label, &f(key, unit), "", extra, "", ""]);
        };
        single(
            &mut out,
            "file write (100 MiB upload)",
            "file_write.mb_per_s",
            "MB/s",
            "",
        );
        single(
            &mut out,
            "file read (100 MiB download)",
            "file_read.mb_per_s",
            "MB/s",
            "",
        );
        line(
            &mut out,
            [
                "idle host memory per sandbox",
                &f("idle.per_sandbox_mb", "MB"),
                "",
                "",
                "",
                &target("idle.per_sandbox_mb"),
            ],
        );
        single(
            &mut out,
            "  released on delete / sandbox",
            "idle.per_sandbox_released_mb",
            "MB",
            "",
        );

        single(
            &mut out,
            "  noise (sample spread / N)",
            "idle.per_sandbox_noise_mb",
            "MB",
            "",
        );
        single(
            &mut out,
            "  agent RSS (mean)",
            "idle.agent_rss_mb",
            "MB",
            "",
        );
        single(
            &mut out,
            "  agent PSS (mean)",
            "idle.agent_pss_mb",
            "MB",
            "",
        );
        single(
            &mut out,
            "  cgroup memory (mean)",
            "idle.cgroup_memory_mb",
            "MB",
            "",
        );
        single(
            &mut out,
            "  daemon RSS growth / sandbox",
            "idle.daemon_rss_per_sandbox_mb",
            "MB",
            "",
        );
        single(
            &mut out,
            &format!("  create {} (total)", h.idle),
            "idle.create_total_s",
            "s",
            "",
        );
        single(
            &mut out,
            &format!("  delete {} (total)", h.idle),
            "idle.delete_total_s",
            "s",
            "",
        );
        let with_idle = match self.get("idle.daemon_rss_mb") {
            Some(v) => format!("{v:.1} MB with {} idle", h.idle),
            None => String::new(),
        };
        single(&mut out, "daemon RSS", "daemon.rss_mb", "MB", &with_idle);

        let _ = writeln!(out);
        line(&mut out, ["baseline", "p50", "p95", "", "", ""]);
        for (label, prefix) in [
            ("fork+exec /bin/true", "baseline.fork_exec"),
            ("bwrap --unshare-all true", "baseline.bwrap"),
            ("crun run true", "baseline.crun_run"),
            ("  unshare wrapper alone", "baseline.unshare_wrapper"),
            ("  crun run net of wrapper", "baseline.crun_run_net"),
        ] {
            let (p50, p95) = (format!("{prefix}.p50_ms"), format!("{prefix}.p95_ms"));
            // The wrapper rows exist only where the cgroup layout needs the wrapper.
            if label.starts_with(' ') && self.get(&p50).is_none() {
                continue;
            }
            let p95 = if self.figures.contains_key(&p95) {
                f(&p95, "ms")
            } else {
                String::new()
            };
            line(&mut out, [label, &f(&p50, "ms"), &p95, "", "", ""]);
        }
        if !self.notes.is_empty() {
            let _ = writeln!(out);
            let _ = writeln!(out, "notes:");
            for (k, v) in &self.notes {
                let _ = writeln!(out, "  {k}: {v}");
            }
        }
        out
    }
}

// ---- the measurements ----

/// One benchmark run.
struct Bench {
    client: Client,
    iterations: usize,
    idle: usize,
    /// Lifetime of each sandbox, in seconds.
    timeout: u64,
    tracker: Tracker,
    cancel: Cancel,
}

impl Bench {
    /// Runs every measurement; a failed sandpit measurement leaves nulls and a note and is
    /// counted, an interrupt ends the run.
    async fn run_all(&self) -> anyhow::Result<(Report, usize)> {
        let mut report = Report::default();
        let mut failed = 0usize;
        // Every name is in the JSON document, null until (unless) it is measured.
        for prefix in [
            "create_first_exec",
            "delete",
            "exec_rtt",
            "baseline.fork_exec",
            "baseline.bwrap",
            "baseline.crun_run",
            "baseline.unshare_wrapper",
        ] {
            report.set(&format!("{prefix}.p50_ms"), None);
            report.set(&format!("{prefix}.p95_ms"), None);
        }
        for key in [
            "baseline.crun_run_net.p50_ms",
            "file_write.mb_per_s",
            "file_read.mb_per_s",
        ] {
            report.set(key, None);
        }

        let url = self.client.base_url();
        let daemon = match (url.host_str(), url.port_or_known_default()) {
            (Some(host), Some(port)) => locate_daemon(host, port),
            _ => Err(format!("no host and port in {url}")),
        };
        match &daemon {
            Ok(pid) => {
                report.daemon_pid = Some(*pid);
                report.set(
                    "daemon.rss_mb",
                    vm_rss_kb(*pid).map(|kb| kb as f64 / 1024.0),
                );
            }
            Err(reason) => {
                report.set("daemon.rss_mb", None);
                report.note("daemon.rss_mb", reason.clone());
            }
        }

        // Baselines first, while no sandbox exists to compete with them.
        let cancel = self.cancel.clone();
        let n = self.iterations;
        let baselines = tokio::task::spawn_blocking(move || measure_baselines(n, &cancel))
            .await
            .context("the baseline thread failed")?;
        self.cancel.check()?;
        for (prefix, samples) in baselines.dists {
            if let Err(reason) = &samples {
                // Visible also with --json, where the notes go to stdout only.
                eprintln!("warning: {prefix} not measured: {reason}");
            }
            report.set_dist(prefix, samples);
        }
        for (key, text) in baselines.notes {
            report.note(key, text);
        }
        if let (Some(run), Some(wrapper)) = (
            report.get("baseline.crun_run.p50_ms"),
            report.get("baseline.unshare_wrapper.p50_ms"),
        ) {
            report.set("baseline.crun_run_net.p50_ms", Some(run - wrapper));
        }

        let mut phase = |report: &mut Report, name: &str, r: anyhow::Result<()>| {
            if let Err(e) = r {
                if self.cancel.is_set() {
                    return Err(e);
                }
                eprintln!("error: {name}: {e:#}");
                report.note(name, format!("failed: {e:#}"));
                failed += 1;
            }
            Ok(())
        };
        let r = self.create_first_exec(&mut report).await;
        phase(&mut report, "create_first_exec", r)?;
        let r = self.exec_rtt(&mut report).await;
        phase(&mut report, "exec_rtt", r)?;
        // Density before the file test, whose 100 MiB through a tmpfs and the page cache
        // would disturb the host-wide memory figures.
        let r = self.idle(&mut report, daemon.ok()).await;
        phase(&mut report, "idle", r)?;
        let r = self.file_io(&mut report).await;
        phase(&mut report, "file_io", r)?;

        report.set_ratio(
            "create_vs_crun_run",
            "create_first_exec.p50_ms",
            "baseline.crun_run.p50_ms",
        );
        report.set_ratio(
            "create_vs_crun_run_net",
            "create_first_exec.p50_ms",
            "baseline.crun_run_net.p50_ms",
        );
        report.set_ratio(
            "create_vs_bwrap",
            "create_first_exec.p50_ms",
            "baseline.bwrap.p50_ms",
        );
        report.set_ratio(
            "exec_vs_fork_exec",
            "exec_rtt.p50_ms",
            "baseline.fork_exec.p50_ms",
        );
        Ok((report, failed))
    }

    fn request(&self, limits: LimitsSpec) -> CreateSandboxRequest {
        CreateSandboxRequest {
            template: Some("host".into()),
            runtime: Some("container".into()),
            timeout: Some(self.timeout),
            limits,
            metadata: BTreeMap::from([(LABEL.to_string(), self.tracker.run.clone())]),
            ..Default::default()
        }
    }

    async fn create(&self, req: &CreateSandboxRequest) -> anyhow::Result<String> {
        let sb = self
            .client
            .create_sandbox(req)
            .await
            .context("create sandbox")?;
        self.tracker.insert(&sb.id);
        Ok(sb.id)
    }

    async fn delete(&self, id: &str) -> anyhow::Result<()> {
        self.client
            .delete_sandbox(id)
            .await
            .with_context(|| format!("delete sandbox {id}"))?;
        self.tracker.remove(id);
        Ok(())
    }

    /// Runs `true` in the sandbox and insists that it succeeded.
    async fn run_true(&self, id: &str) -> anyhow::Result<()> {
        let req = RunCommandRequest {
            argv: vec!["true".into()],
            ..Default::default()
        };
        let out = self
            .client
            .run(id, &req)
            .await
            .with_context(|| format!("run `true` in {id}"))?;
        if out.exit_code != 0 {
            bail!(
                "`true` exited with {} in {id}: {}",
                out.exit_code,
                out.stderr.trim()
            );
        }
        Ok(())
    }

    /// `create_first_exec` and `delete`: one sandbox after another.
    async fn create_first_exec(&self, report: &mut Report) -> anyhow::Result<()> {
        let req = self.request(LimitsSpec::default());
        let progress = Progress::new("create -> first exec", self.iterations);
        let mut create = Vec::with_capacity(self.iterations);
        let mut delete = Vec::with_capacity(self.iterations);
        // One round first, untimed: the first sandbox after a daemon start pays for cold
        // caches (template skeleton, page cache of the binary) that no later one sees.
        for i in 0..=self.iterations {
            self.cancel.check()?;
            let t0 = Instant::now();
            let id = self.create(&req).await?;
            let ran = self.run_true(&id).await;
            let started = t0.elapsed();
            let t1 = Instant::now();
            let deleted = self.delete(&id).await;
            let stopped = t1.elapsed();
            ran?;
            deleted?;
            if i > 0 {
                create.push(ms(started));
                delete.push(ms(stopped));
            }
            progress.set(i);
        }
        report.set_dist("create_first_exec", Ok(create));
        report.set_dist("delete", Ok(delete));
        Ok(())
    }

    /// `exec_rtt`: `true` again and again in one running sandbox.
    async fn exec_rtt(&self, report: &mut Report) -> anyhow::Result<()> {
        let id = self.create(&self.request(LimitsSpec::default())).await?;
        let result = async {
            for _ in 0..EXEC_WARMUP {
                self.run_true(&id).await?;
            }
            let progress = Progress::new("exec round trip", self.iterations);
            let mut samples = Vec::with_capacity(self.iterations);
            for i in 0..self.iterations {
                self.cancel.check()?;
                let t = Instant::now();
                self.run_true(&id).await?;
                samples.push(ms(t.elapsed()));
                progress.set(i + 1);
            }
            anyhow::Ok(samples)
        }
        .await;
        let deleted = self.delete(&id).await;
        report.set_dist("exec_rtt", Ok(result?));
        deleted
    }

    /// `file_write.mb_per_s` and `file_read.mb_per_s`: 100 MiB up, then down again.
    async fn file_io(&self, report: &mut Report) -> anyhow::Result<()> {
        report.set("file_write.mb_per_s", None);
        report.set("file_read.mb_per_s", None);
        let dir = TempDir::new("file")?;
        let local = dir.path().join("payload.bin");
        {
            let local = local.clone();
            tokio::task::spawn_blocking(move || write_payload(&local, FILE_BYTES))
                .await
                .context("the payload thread failed")??;
        }
        self.cancel.check()?;
        // The writable layer is a tmpfs charged to memory: room for the file twice over.
        let limits = LimitsSpec {
            memory_bytes: Some(1 << 30),
            disk_bytes: Some(512 << 20),
            ..Default::default()
        };
        let id = self.create(&self.request(limits)).await?;
        let result = async {
            let t = Instant::now();
            self.client
                .upload_from_file(&id, FILE_PATH, &local)
                .await
                .context("upload")?;
            let write_s = t.elapsed().as_secs_f64();
            let size = self.client.stat(&id, FILE_PATH).await.context("stat")?.size;
            if u64::try_from(size).ok() != Some(FILE_BYTES) {
                bail!("the uploaded file has {size} bytes, not {FILE_BYTES}");
            }
            self.cancel.check()?;

            let t = Instant::now();
            let stream = self
                .client
                .download_stream(&id, FILE_PATH)
                .await
                .context("download")?;
            let mut stream = std::pin::pin!(stream);
            let mut got = 0u64;
            while let Some(chunk) = stream.next().await {
                got += chunk.context("download")?.len() as u64;
            }
            let read_s = t.elapsed().as_secs_f64();
            if got != FILE_BYTES {
                bail!("downloaded {got} bytes, not {FILE_BYTES}");
            }
            anyhow::Ok((write_s, read_s))
        }
        .await;
        let deleted = self.delete(&id).await;
        let (write_s, read_s) = result?;
        let mib = FILE_BYTES as f64 / MIB;
        report.set("file_write.mb_per_s", Some(mib / write_s));
        report.set("file_read.mb_per_s", Some(mib / read_s));
        deleted
    }

    /// `idle.*`: what N idle sandboxes cost the host.
    async fn idle(&self, report: &mut Report, daemon: Option<i32>) -> anyhow::Result<()> {
        for key in [
            "idle.per_sandbox_mb",
            "idle.per_sandbox_released_mb",
            "idle.per_sandbox_noise_mb",
            "idle.agent_rss_mb",
            "idle.agent_pss_mb",
            "idle.cgroup_memory_mb",
            "idle.create_total_s",
            "idle.delete_total_s",
            "idle.daemon_rss_mb",
            "idle.daemon_rss_per_sandbox_mb",
        ] {
            report.set(key, None);
        }
        if self.idle == 0 {
            report.note("idle", "skipped (--idle 0)");
            return Ok(());
        }
        let req = self.request(LimitsSpec::default());
        // The sandboxes of the earlier measurements were just deleted, and the kernel hands
        // back what they held over several seconds (tens of MB here): a baseline taken during
        // that would make the sandboxes look free or even negative.
        let mut unsettled = Vec::new();
        if !self.wait_for_quiet_memory().await? {
            unsettled.push("before creating them");
        }
        let daemon_before = daemon.and_then(vm_rss_kb);
        let used_before = sample_used_kb().await?;
        let progress = Progress::new("idle sandboxes", self.idle);
        let mut ids = Vec::with_capacity(self.idle);
        let t = Instant::now();
        let created = async {
            for i in 0..self.idle {
                self.cancel.check()?;
                ids.push(self.create(&req).await?);
                progress.set(i + 1);
            }
            anyhow::Ok(())
        }
        .await;
        let create_s = t.elapsed().as_secs_f64();
        drop(progress);

        let measured = match created {
            Ok(()) => self.measure_idle(report, &ids, daemon, daemon_before).await,
            Err(e) => Err(e),
        };

        let t = Instant::now();
        let progress = Progress::new("deleting idle sandboxes", ids.len());
        let mut deleted = Ok(());
        for (i, id) in ids.iter().enumerate() {
            // No cancel check here: deleting is the cleanup.
            if let Err(e) = self.delete(id).await {
                deleted = Err(e);
            }
            progress.set(i + 1);
        }
        drop(progress);
        let delete_s = t.elapsed().as_secs_f64();
        let (used_with, settled_with) = measured?;
        deleted?;
        report.set("idle.create_total_s", Some(create_s));
        report.set("idle.delete_total_s", Some(delete_s));
        if !settled_with {
            unsettled.push("with them");
        }

        // The host-wide figure sees everything else the machine does, so it is taken twice:
        // as the growth when the sandboxes came and as the release once they were gone (after
        // the kernel's deferred freeing). Agreement makes it credible.
        if !self.wait_for_quiet_memory().await? {
            unsettled.push("after deleting them");
        }
        let used_after = sample_used_kb().await?;
        let n = ids.len() as f64;
        let grown = (used_with.median - used_before.median) / 1024.0 / n;
        let released = (used_with.median - used_after.median) / 1024.0 / n;
        let noise = used_before
            .spread
            .max(used_with.spread)
            .max(used_after.spread)
            / 1024.0
            / n;
        report.set("idle.per_sandbox_mb", Some(grown));
        report.set("idle.per_sandbox_released_mb", Some(released));
        report.set("idle.per_sandbox_noise_mb", Some(noise));
        let mut note = "growth of (MemTotal - MemAvailable) / N, each level the median of 3 \
                        samples 0.5 s apart taken once host memory had stopped moving; \
                        includes the daemon's growth; per_sandbox_released_mb is the same \
                        measured on deletion"
            .to_string();
        if !unsettled.is_empty() {
            note.push_str(&format!(
                "; host memory did not settle within {}s {}",
                QUIET_TIMEOUT.as_secs(),
                unsettled.join(", ")
            ));
        }
        let disagree = (grown - released).abs() > grown.abs().max(released.abs()) / 4.0 + 0.5;
        if grown <= 0.0 || disagree || noise > grown.abs() / 2.0 || !unsettled.is_empty() {
            note.push_str(&format!(
                "; UNRELIABLE in this run (growth {grown:.1} MB vs release {released:.1} MB per \
                 sandbox, sample spread {noise:.1} MB): other activity on the machine; trust \
                 idle.cgroup_memory_mb + idle.agent_pss_mb instead, or rerun on a quiet machine"
            ));
        }
        report.note("idle.per_sandbox_mb", note);
        Ok(())
    }

    /// Waits until host memory in use stops moving (less than [`QUIET_KB`] over
    /// [`QUIET_WINDOW`] samples 0.5 s apart); false if it kept moving for [`QUIET_TIMEOUT`].
    async fn wait_for_quiet_memory(&self) -> anyhow::Result<bool> {
        let start = Instant::now();
        let mut window = std::collections::VecDeque::with_capacity(QUIET_WINDOW);
        loop {
            self.cancel.check()?;
            if window.len() == QUIET_WINDOW {
                window.pop_front();
            }
            window.push_back(host_used_kb()?);
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
        ids: &[String],
        daemon: Option<i32>,
        daemon_before: Option<u64>,
    ) -> anyhow::Result<(UsedSample, bool)> {
        let n = ids.len() as f64;
        let settled = self.wait_for_quiet_memory().await?;
        let used_with = sample_used_kb().await?;

        let wanted: BTreeSet<&str> = ids.iter().map(String::as_str).collect();
        let agents = agent_memory_kb(&wanted);
        if agents.is_empty() {
            report.note(
                "idle.agent_rss_mb",
                "found no sandpit-agent process in the sandboxes' cgroups",
            );
        } else {
            let count = agents.len() as f64;
            let rss = agents.iter().map(|a| a.0).sum::<u64>() as f64 / count;
            let pss = agents.iter().map(|a| a.1).sum::<u64>() as f64 / count;
            report.set("idle.agent_rss_mb", Some(rss / 1024.0));
            // RSS counts the shared pages of the sandpit binary in full in every agent;
            // PSS splits them, which is what N agents really add up to.
            report.set("idle.agent_pss_mb", Some(pss / 1024.0));
            if agents.len() != ids.len() {
                report.note(
                    "idle.agent_rss_mb",
                    format!("found {} agents for {} sandboxes", agents.len(), ids.len()),
                );
            }
        }

        let mut cgroup = Vec::with_capacity(ids.len());
        for id in ids {
            self.cancel.check()?;
            match self.client.stats(id).await {
                Ok(s) => cgroup.push(s.memory_current_bytes as f64),
                Err(e) => {
                    report.note("idle.cgroup_memory_mb", format!("stats of {id}: {e}"));
                    break;
                }
            }
        }
        if cgroup.len() == ids.len() {
            report.set(
                "idle.cgroup_memory_mb",
                Some(cgroup.iter().sum::<f64>() / n / MIB),
            );
        }

        if let Some(pid) = daemon {
            let after = vm_rss_kb(pid);
            report.set("idle.daemon_rss_mb", after.map(|kb| kb as f64 / 1024.0));
            if let (Some(a), Some(b)) = (after, daemon_before) {
                report.set(
                    "idle.daemon_rss_per_sandbox_mb",
                    Some((a as f64 - b as f64) / 1024.0 / n),
                );
            }
        }
        Ok((used_with, settled))
    }

    /// Deletes whatever the run left: the sandboxes it knows of, then any carrying its label
    /// (a create cut short by a second interrupt may have succeeded on the daemon's side).
    /// Returns the ids it could not delete.
    async fn cleanup(&self) -> Vec<String> {
        let mut left = BTreeSet::new();
        for id in self.tracker.take() {
            if let Err(e) = self.client.delete_sandbox(&id).await
                && !e.is_not_found()
            {
                eprintln!("warning: cannot delete sandbox {id}: {e}");
                left.insert(id);
            }
        }
        let label = [(LABEL.to_string(), self.tracker.run.clone())];
        for pass in 0..3 {
            if pass > 0 {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            let mut found = Vec::new();
            let mut cursor: Option<String> = None;
            loop {
                match self
                    .client
                    .list_sandboxes(None, &label, None, cursor.as_deref())
                    .await
                {
                    Ok(page) => {
                        found.extend(page.items.into_iter().map(|s| (s.id, s.state)));
                        cursor = page.next_cursor;
                        if cursor.is_none() {
                            break;
                        }
                    }
                    Err(e) => {
                        eprintln!("warning: cannot list the benchmark's sandboxes: {e}");
                        return left.into_iter().collect();
                    }
                }
            }
            let live: Vec<_> = found
                .into_iter()
                .filter(|(_, state)| !matches!(state.as_str(), "stopped" | "error"))
                .collect();
            if live.is_empty() {
                break;
            }
            for (id, _) in live {
                match self.client.delete_sandbox(&id).await {
                    Ok(()) => {
                        left.remove(&id);
                    }
                    Err(e) if e.is_not_found() => {
                        left.remove(&id);
                    }
                    Err(e) => {
                        eprintln!("warning: cannot delete sandbox {id}: {e}");
                        left.insert(id);
                    }
                }
            }
        }
        left.into_iter().collect()
    }
}

/// Writes `len` bytes of pseudo-random data (incompressible, so no layer can cheat).
fn write_payload(path: &Path, len: u64) -> anyhow::Result<()> {
    let mut file = std::io::BufWriter::new(
        std::fs::File::create(path).with_context(|| format!("create {}", path.display()))?,
    );
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut chunk = vec![0u8; 1 << 20];
    let mut left = len;
    while left > 0 {
        for word in chunk.chunks_exact_mut(8) {
            // xorshift64: fast, and good enough to defeat compression.
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            word.copy_from_slice(&state.to_le_bytes());
        }
        let n = left.min(chunk.len() as u64) as usize;
        file.write_all(&chunk[..n])
            .with_context(|| format!("write {}", path.display()))?;
        left -= n as u64;
    }
    file.flush()
        .with_context(|| format!("write {}", path.display()))?;
    Ok(())
}

// ---- baselines ----

/// What the baseline thread measured: samples (or why not) per dotted prefix, and notes.
struct Baselines {
    dists: Vec<(&'static str, Result<Vec<f64>, String>)>,
    notes: Vec<(&'static str, String)>,
}

/// Measures fork+exec, bwrap and crun, `n` times each (blocking).
fn measure_baselines(n: usize, cancel: &Cancel) -> Baselines {
    let mut out = Baselines {
        dists: Vec::new(),
        notes: Vec::new(),
    };
    let progress = Progress::new("baseline fork+exec", n);
    let fork = time_command(n, cancel, &progress, |_| Command::new("/bin/true"));
    drop(progress);
    out.dists.push(("baseline.fork_exec", fork));

    let progress = Progress::new("baseline bwrap", n);
    let bwrap = time_command(n, cancel, &progress, |_| {
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
            "true",
        ]);
        c
    });
    drop(progress);
    out.dists.push(("baseline.bwrap", bwrap));

    match crun_baseline(n, cancel) {
        Ok((run, wrapper)) => {
            out.dists.push(("baseline.crun_run", run));
            if let Some(wrapper) = wrapper {
                out.dists.push(("baseline.unshare_wrapper", wrapper));
                out.notes.push((
                    "baseline.unshare_wrapper",
                    format!(
                        "cgroups are hybrid here and crun refuses them, so each run is \
                         `unshare -m sh -c 'umount {HYBRID_UNIFIED}; exec crun run ...'`: the \
                         figure includes that wrapper (measured alone as \
                         baseline.unshare_wrapper; crun_run_net = crun_run - wrapper)"
                    ),
                ));
            }
        }
        Err(e) => out.dists.push(("baseline.crun_run", Err(e))),
    }
    out
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

/// `crun run` of a bundle shaped like sandpit's host template; with the wrapper's own cost
/// when the cgroup layout forces one.
type CrunResult = (Result<Vec<f64>, String>, Option<Result<Vec<f64>, String>>);

fn crun_baseline(n: usize, cancel: &Cancel) -> Result<CrunResult, String> {
    let hybrid = is_mountpoint(HYBRID_UNIFIED);
    if !in_path("crun") {
        return Err("crun is not installed".into());
    }
    if hybrid && !in_path("unshare") {
        return Err(
            "unshare (util-linux) is not installed, and crun needs it on this hybrid cgroup host"
                .into(),
        );
    }
    let bundle = TempDir::new("crun").map_err(|e| format!("{e:#}"))?;
    let parent = format!("sandpit-bench-crun-{}", std::process::id());
    let prefix = format!("sandpit-bench-{}-{}", std::process::id(), unix_ms());
    write_bundle(bundle.path(), &parent).map_err(|e| format!("cannot write the bundle: {e:#}"))?;
    let dir = bundle.path().to_path_buf();
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

    let progress = Progress::new("baseline crun run", n);
    let run = time_command(n, cancel, &progress, |i| {
        let bundle = dir.to_string_lossy().into_owned();
        crun(&["run", "--bundle", &bundle, &id(i)])
    });
    drop(progress);
    // `crun run` removes a container that exited; one that failed half-way may remain.
    let runs = match &run {
        Ok(s) => s.len() + 1,
        Err(_) => n + 1,
    };
    for i in 0..runs {
        let state = Path::new("/run/crun").join(id(i));
        if state.exists() {
            let _ = crun(&["delete", "-f", &id(i)])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
    remove_cgroups(&parent);

    let run = run.map_err(|e| format!("crun run: {e}"));
    let wrapper = hybrid.then(|| {
        let progress = Progress::new("baseline unshare wrapper", n);
        time_command(n, cancel, &progress, |_| {
            let mut c = Command::new("unshare");
            c.args([
                "-m",
                "sh",
                "-c",
                &format!("umount {HYBRID_UNIFIED} 2>/dev/null; exec true"),
            ]);
            c
        })
    });
    Ok((run, wrapper))
}

/// An OCI bundle: a read-only rootfs of empty mount points and the host template's symlinks,
/// with the host's /usr bound in read-only, running `/usr/bin/true`.
fn write_bundle(dir: &Path, cgroup_parent: &str) -> anyhow::Result<()> {
    let rootfs = dir.join("rootfs");
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
        "root": {"path": "rootfs", "readonly": true},
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
            "cgroupsPath": format!("/{cgroup_parent}/bench")
        }
    });
    let path = dir.join("config.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&config)?)
        .with_context(|| format!("write {}", path.display()))?;
    Ok(())
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
fn in_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()))
}

/// True if `path` is a mount point of this mount namespace.
fn is_mountpoint(path: &str) -> bool {
    std::fs::read_to_string("/proc/self/mountinfo")
        .is_ok_and(|m| m.lines().any(|l| l.split_whitespace().nth(4) == Some(path)))
}

// ---- /proc ----

/// `VmRSS` of a process, in KiB.
fn vm_rss_kb(pid: i32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// Host memory in use, sampled a few times: the median, and how far the samples spread
/// (a rough measure of what the rest of the machine was doing meanwhile), both in KiB.
#[derive(Debug, Clone, Copy)]
struct UsedSample {
    median: f64,
    spread: f64,
}

async fn sample_used_kb() -> anyhow::Result<UsedSample> {
    let mut samples = Vec::with_capacity(3);
    for i in 0..3 {
        if i > 0 {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        samples.push(host_used_kb()? as f64);
    }
    samples.sort_by(f64::total_cmp);
    Ok(UsedSample {
        median: samples[1],
        spread: samples[2] - samples[0],
    })
}

/// MemTotal - MemAvailable, in KiB.
fn host_used_kb() -> anyhow::Result<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").context("read /proc/meminfo")?;
    let field = |name: &str| {
        meminfo
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
            .ok_or_else(|| anyhow!("no {name} in /proc/meminfo"))
    };
    Ok(field("MemTotal:")?.saturating_sub(field("MemAvailable:")?))
}

/// Numeric entries of /proc.
fn pids() -> Vec<i32> {
    std::fs::read_dir("/proc")
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Proportional set size of a process (shared pages split among their users), in KiB.
fn pss_kb(pid: i32) -> Option<u64> {
    let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    rollup
        .lines()
        .find_map(|l| l.strip_prefix("Pss:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// (RSS, PSS) in KiB of every sandpit-agent process whose cgroup is one of the sandboxes
/// `ids` (PSS is 0 where the kernel does not tell).
fn agent_memory_kb(ids: &BTreeSet<&str>) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    for pid in pids() {
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        // The agent is exec'd as /.sandpit/agent with argv[0] "sandpit-agent", so its comm
        // may be either name; argv[0] decides.
        let argv0_is_agent = std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
            let argv0 = c.split(|b| *b == 0).next().unwrap_or_default();
            Path::new(std::ffi::OsStr::from_bytes(argv0))
                .file_name()
                .is_some_and(|n| n == "sandpit-agent")
        });
        if comm.trim() != "sandpit-agent" && !argv0_is_agent {
            continue;
        }
        let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
        let ours = cgroup
            .lines()
            .any(|l| l.rsplit('/').next().is_some_and(|last| ids.contains(last)));
        if ours && let Some(rss) = vm_rss_kb(pid) {
            out.push((rss, pss_kb(pid).unwrap_or_default()));
        }
    }
    out
}

/// The pid of the `sandpit serve` behind `url`, found through the socket listening on its
/// port; an explanation when the daemon is elsewhere or is not a sandpit daemon.
fn locate_daemon(host: &str, port: u16) -> Result<i32, String> {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let ips: Vec<IpAddr> = match host.parse::<IpAddr>() {
        Ok(ip) => vec![ip],
        Err(_) => (host, port)
            .to_socket_addrs()
            .map(|a| a.map(|s| s.ip()).collect())
            .map_err(|e| format!("cannot resolve {host}: {e}"))?,
    };
    // An address is this machine's if it is loopback or a socket can be bound to it.
    let local: Vec<IpAddr> = ips
        .into_iter()
        .filter(|ip| ip.is_loopback() || std::net::UdpSocket::bind((*ip, 0)).is_ok())
        .collect();
    if local.is_empty() {
        return Err(format!(
            "the daemon at {host} is not on this machine: its RSS cannot be read"
        ));
    }
    let inodes: BTreeSet<u64> = listeners(port)
        .into_iter()
        .filter(|(ip, _)| ip.is_unspecified() || local.contains(ip))
        .map(|(_, inode)| inode)
        .collect();
    if inodes.is_empty() {
        return Err(format!(
            "no socket on this machine listens on port {port} (daemon in another network namespace?)"
        ));
    }
    let targets: BTreeSet<String> = inodes.iter().map(|i| format!("socket:[{i}]")).collect();
    for pid in pids() {
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        let owns = fds.flatten().any(|fd| {
            std::fs::read_link(fd.path())
                .is_ok_and(|l| targets.contains(l.to_string_lossy().as_ref()))
        });
        if !owns {
            continue;
        }
        let exe = std::fs::read_link(format!("/proc/{pid}/exe"))
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default();
        let argv = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let serves = argv.split(|b| *b == 0).any(|a| a == b"serve");
        // A rebuilt binary shows as "/path/sandpit (deleted)".
        let sandpit = Path::new(&exe)
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("sandpit"));
        if serves && sandpit {
            return Ok(pid);
        }
        return Err(format!(
            "port {port} belongs to pid {pid} ({exe}), which is not `sandpit serve`"
        ));
    }
    Err(format!(
        "cannot find the process that listens on port {port}"
    ))
}

/// Listening TCP sockets on `port`: (local address, socket inode), from /proc/net/tcp{,6}.
fn listeners(port: u16) -> Vec<(IpAddr, u64)> {
    let mut out = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            let (Some(local), Some(state), Some(inode)) = (f.get(1), f.get(3), f.get(9)) else {
                continue;
            };
            if *state != "0A" {
                continue;
            }
            let Some((addr, p)) = local.split_once(':') else {
                continue;
            };
            if u16::from_str_radix(p, 16).ok() != Some(port) {
                continue;
            }
            if let (Some(ip), Ok(inode)) = (parse_proc_ip(addr), inode.parse()) {
                out.push((ip, inode));
            }
        }
    }
    out
}

/// An address as /proc/net/tcp prints it: 32-bit words in hex, each in host byte order.
fn parse_proc_ip(hex: &str) -> Option<IpAddr> {
    let word = |s: &str| u32::from_str_radix(s, 16).ok().map(u32::to_ne_bytes);
    match hex.len() {
        8 => Some(IpAddr::V4(Ipv4Addr::from(word(hex)?))),
        32 => {
            let mut b = [0u8; 16];
            for (i, chunk) in b.chunks_exact_mut(4).enumerate() {
                chunk.copy_from_slice(&word(hex.get(i * 8..i * 8 + 8)?)?);
            }
            let v6 = Ipv6Addr::from(b);
            // A v4 client reaches a dual-stack listener through its mapped address.
            Some(v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate() {
        let d = Dist::of((1..=100).map(f64::from).collect()).unwrap();
        assert!((d.p50 - 50.5).abs() < 1e-9);
        assert!((d.p95 - 95.05).abs() < 1e-9);
        assert!(Dist::of(Vec::new()).is_none());
        let one = Dist::of(vec![3.0]).unwrap();
        assert_eq!((one.p50, one.p95), (3.0, 3.0));
    }

    #[test]
    fn proc_addresses() {
        assert_eq!(
            parse_proc_ip("0100007F"),
            Some(IpAddr::V4(Ipv4Addr::LOCALHOST))
        );
        assert_eq!(
            parse_proc_ip("00000000000000000000000000000000"),
            Some(IpAddr::V6(Ipv6Addr::UNSPECIFIED))
        );
        assert_eq!(
            parse_proc_ip("00000000000000000000000001000000"),
            Some(IpAddr::V6(Ipv6Addr::LOCALHOST))
        );
    }
}
