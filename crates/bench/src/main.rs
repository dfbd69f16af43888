//! `sandpit-bench` (also run as `sandpit bench`): start latency (cold, from a warm pool, many at once, sustained), exec
//! round trip, file throughput and density of a daemon, with the baselines they should be
//! judged against (fork+exec, unshare, bwrap, crun, runsc) measured in the same run on the
//! same machine. It prints figures and writes them as JSON with a latency chart beside; it
//! never fails on a target.
//!
//! Every sandbox the benchmark creates carries the metadata label `sandpit-bench=<run>` and
//! is deleted before the command returns, also on errors and on Ctrl-C / SIGTERM (the first
//! signal lets the current step finish, a second one abandons it; either way the cleanup
//! runs, and it also finds sandboxes whose creation was cut short by their label). The warm
//! pool it creates is deleted the same way.
//!
//! It is a binary of its own so that the sandpit binary, which every sandbox maps as its
//! agent, carries none of its code (nor the plotting library).
#![forbid(unsafe_code)]

mod agents;
mod baselines;
mod chart;
mod e2b;
mod lifecycle;
mod memory;
mod network;
mod phases;
mod proc;
mod proxy;
mod report;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, anyhow, bail};
use parking_lot::Mutex;
use sandpit_api::{CreateSandboxRequest, LimitsSpec, RunCommandRequest, Sandbox};
use sandpit_client::Client;

use report::{Header, Report};

/// A part of the benchmark, for `--only`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum Phase {
    /// fork+exec, unshare, bwrap, crun, runsc.
    Baselines,
    /// Cold create -> first exec, one after another.
    Cold,
    /// Warm-pool claim -> first exec.
    Pool,
    /// Exec round trip and the daemon's own request overhead.
    Exec,
    /// N cold creates at once.
    Concurrent,
    /// Creates and deletes from several workers for a while.
    Sustained,
    /// Host memory of idle sandboxes, agent and daemon RSS.
    Memory,
    /// 100 MiB upload and download.
    Files,
    /// Pause/resume, hibernate/wake, snapshots of 100 MiB, restore, fork of 10.
    Lifecycle,
    /// E2B's Python SDK: `Sandbox.create()` -> first `commands.run("true")`.
    E2b,
    /// Requests and a download through the sandbox proxy, beside direct ones.
    Proxy,
    /// Create with and without an open network, namespace preparation, the egress proxy
    /// against a direct connection.
    Network,
    /// Agent runs (pi against the scripted model server): run start -> first event,
    /// fan-out to many followers, events stored per second.
    Agents,
}

impl Phase {
    const ALL: [Phase; 13] = [
        Phase::Baselines,
        Phase::Cold,
        Phase::Pool,
        Phase::Exec,
        Phase::Concurrent,
        Phase::Sustained,
        Phase::Memory,
        Phase::Files,
        Phase::Lifecycle,
        Phase::E2b,
        Phase::Proxy,
        Phase::Network,
        Phase::Agents,
    ];

    fn name(self) -> &'static str {
        match self {
            Phase::Baselines => "baselines",
            Phase::Cold => "cold",
            Phase::Pool => "pool",
            Phase::Exec => "exec",
            Phase::Concurrent => "concurrent",
            Phase::Sustained => "sustained",
            Phase::Memory => "memory",
            Phase::Files => "files",
            Phase::Lifecycle => "lifecycle",
            Phase::E2b => "e2b",
            Phase::Proxy => "proxy",
            Phase::Network => "network",
            Phase::Agents => "agents",
        }
    }
}

/// Options of `sandpit bench`.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Runs of each one-after-another latency measurement (cold, pool, exec, baselines).
    #[arg(long, default_value_t = 50)]
    pub iterations: u32,
    /// Idle sandboxes to hold at once for density, one measurement per number, e.g.
    /// `--idle 100,1000`; 0 skips.
    #[arg(long, value_delimiter = ',', default_value = "100")]
    pub idle: Vec<u32>,
    /// Creates in flight at once while filling the idle set.
    #[arg(long, default_value_t = 16)]
    pub idle_concurrency: u32,
    /// Cold creates started at the same moment (and `crun run`s, for the baseline).
    #[arg(long, default_value_t = 50)]
    pub concurrency: u32,
    /// Length of the sustained create/delete phase.
    #[arg(long, default_value_t = 30)]
    pub sustained_secs: u64,
    /// Workers of the sustained phase, each creating and deleting in a loop.
    #[arg(long, default_value_t = 8)]
    pub workers: u32,
    /// Size of the warm pool the pool phase creates.
    #[arg(long, default_value_t = 8)]
    pub pool_size: u32,
    /// Run only these phases (comma-separated): baselines, cold, pool, exec, concurrent,
    /// sustained, memory, files, lifecycle, network, proxy, e2b, agents. Default: all.
    #[arg(long, value_delimiter = ',', value_enum)]
    pub only: Vec<Phase>,
    /// Python with the `e2b` package, for the e2b phase (default: the test virtualenv
    /// `target/test-venv/bin/python` when it exists, else `python3`).
    #[arg(long)]
    pub e2b_python: Option<PathBuf>,
    /// Timed agent runs of the agents phase (run start -> first event).
    #[arg(long, default_value_t = 10)]
    pub agent_runs: u32,
    /// Concurrent followers of one run in the agents phase.
    #[arg(long, default_value_t = 100)]
    pub followers: u32,
    /// The harness installs (`scripts/setup.sh --harnesses`) for the agents phase's
    /// host baseline and its check that pi is there (default: the build tree's
    /// `.deps/harnesses`); the daemon binds its own `[agents] harness_dir`.
    #[arg(long)]
    pub harness_dir: Option<PathBuf>,
    /// Directory for results.json, results.txt and latency.png
    /// (default ./bench-results/<UTC time>).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Print the results as JSON instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// Metadata key that marks the benchmark's sandboxes (the value names the run).
const LABEL: &str = "sandpit-bench";
/// Lifetime given to the benchmark's sandboxes: if this process is SIGKILLed, the daemon's
/// reaper still removes them.
const SANDBOX_TIMEOUT_SECS: u64 = 1800;
/// Limits of cold creates: one off the default process cap, so that no warm pool (which
/// would hold sandboxes of the default limits) can serve them.
const COLD_LIMITS: LimitsSpec = LimitsSpec {
    cpu_millis: None,
    memory_bytes: None,
    disk_bytes: None,
    max_processes: Some(511),
};
const MIB: f64 = (1u64 << 20) as f64;

/// `sandpit-bench [--url URL] [--api-key KEY] [--data-dir DIR] [options]`.
#[derive(Debug, clap::Parser)]
#[command(
    name = "sandpit-bench",
    version,
    about = "Measure a sandpit daemon against its baselines."
)]
struct Cli {
    /// URL of the daemon.
    #[arg(long, env = "SANDPIT_URL", default_value = sandpit_api::DEFAULT_URL)]
    url: String,
    /// API key (default: the local daemon's <data-dir>/admin.key, when readable).
    #[arg(long, env = "SANDPIT_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// The daemon's state directory, where its admin key is [default: /var/lib/sandpit as
    /// root, else ~/.local/share/sandpit].
    #[arg(long, env = "SANDPIT_DATA_DIR")]
    data_dir: Option<PathBuf>,
    #[command(flatten)]
    args: BenchArgs,
}

/// The daemon under test and how to reach it.
struct Target {
    url: String,
    key: Option<String>,
}

impl Target {
    fn client(&self) -> anyhow::Result<Client> {
        Client::new(&self.url, self.key.clone())
            .with_context(|| format!("cannot use daemon URL {}", self.url))
    }
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    use clap::Parser;
    let cli = Cli::parse();
    let key = match cli.api_key.as_deref().map(str::trim) {
        Some(k) if !k.is_empty() => Some(k.to_string()),
        _ => {
            let dir = cli
                .data_dir
                .clone()
                .unwrap_or_else(sandpit_client::default_data_dir);
            sandpit_client::local_admin_key(&dir)
        }
    };
    let target = Target { url: cli.url, key };
    match run(&target, cli.args).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sandpit-bench: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Runs the benchmark against the daemon at `ctx`.
async fn run(ctx: &Target, args: BenchArgs) -> anyhow::Result<()> {
    let json_out = args.json;
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
    let phases: BTreeSet<Phase> = if args.only.is_empty() {
        Phase::ALL.into_iter().collect()
    } else {
        args.only.iter().copied().collect()
    };
    let started = utc_stamp(SystemTime::now());
    let out_dir = args
        .out
        .clone()
        .unwrap_or_else(|| Path::new("bench-results").join(&started));
    // Before the run, so that a long run cannot end in "cannot write the results".
    std::fs::create_dir_all(&out_dir)
        .with_context(|| format!("create the results directory {}", out_dir.display()))?;

    let mut idle: Vec<usize> = args
        .idle
        .iter()
        .filter(|n| **n > 0)
        .map(|n| *n as usize)
        .collect();
    idle.sort_unstable();
    idle.dedup();
    let run_id = format!("{}-{}", std::process::id(), unix_ms());
    let bench = Bench {
        api: Api {
            client: client.clone(),
            tracker: Arc::new(Tracker::new(run_id.clone())),
            timeout: SANDBOX_TIMEOUT_SECS.min(info.max_timeout),
            cancel: Cancel::default(),
        },
        phases: phases.clone(),
        iterations: args.iterations as usize,
        idle,
        idle_concurrency: args.idle_concurrency.max(1) as usize,
        concurrency: args.concurrency as usize,
        sustained: Duration::from_secs(args.sustained_secs),
        workers: args.workers.max(1) as usize,
        pool_size: args.pool_size.max(1),
        pool_name: format!("sandpit-bench-{run_id}"),
        pool_created: AtomicBool::new(false),
        agent_runs: args.agent_runs as usize,
        followers: args.followers as usize,
        harness_dir: args
            .harness_dir
            .clone()
            .unwrap_or_else(agents::default_harness_dir),
        e2b: ctx.key.clone().map(|key| E2bSdk {
            url: ctx.url.clone(),
            key,
            python: args.e2b_python.clone().unwrap_or_else(|| {
                let venv = PathBuf::from("target/test-venv/bin/python");
                if venv.exists() {
                    venv
                } else {
                    PathBuf::from("python3")
                }
            }),
        }),
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
                    bench.api.cancel.set();
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
            "could not delete {} (label {LABEL}={})",
            left.join(", "),
            bench.api.tracker.run
        );
    }

    let header = Header {
        url: ctx.url.clone(),
        daemon_version: info.version,
        started,
        iterations: args.iterations,
        concurrency: args.concurrency,
        workers: args.workers,
        sustained_secs: args.sustained_secs,
        idle: bench.idle.iter().map(|n| *n as u32).collect(),
        phases: phases.iter().map(|p| p.name().to_string()).collect(),
    };
    let table = report.to_table(&header);
    let json = serde_json::to_string_pretty(&report.to_json(&header))?;
    let json_path = out_dir.join("results.json");
    std::fs::write(&json_path, format!("{json}\n"))
        .with_context(|| format!("write {}", json_path.display()))?;
    let table_path = out_dir.join("results.txt");
    std::fs::write(&table_path, &table)
        .with_context(|| format!("write {}", table_path.display()))?;
    let chart_path = out_dir.join("latency.png");
    let chart = chart::draw(&chart_path, &report, &header);
    if json_out {
        println!("{json}");
    } else {
        print!("{table}");
    }
    match chart {
        Ok(note) => {
            eprintln!(
                "results: {}, {}, {}{}",
                json_path.display(),
                table_path.display(),
                chart_path.display(),
                note.map(|n| format!(" ({n})")).unwrap_or_default()
            );
        }
        Err(e) => eprintln!(
            "results: {}, {} (no chart: {e:#})",
            json_path.display(),
            table_path.display()
        ),
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
        self.live.lock().insert(id.to_string());
    }

    fn remove(&self, id: &str) {
        self.live.lock().remove(id);
    }

    fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.live.lock()).into_iter().collect()
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

/// The daemon's peak RSS while it is sampled (every 50 ms, in a task of its own).
struct RssSampler {
    peak_kb: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl RssSampler {
    fn start(pid: i32) -> Self {
        let peak_kb = Arc::new(AtomicU64::new(0));
        let peak = peak_kb.clone();
        let task = tokio::spawn(async move {
            loop {
                if let Some(kb) = proc::vm_rss_kb(pid) {
                    peak.fetch_max(kb, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
        RssSampler { peak_kb, task }
    }

    fn peak_mb(&self) -> Option<f64> {
        let kb = self.peak_kb.load(Ordering::Relaxed);
        (kb > 0).then(|| kb as f64 / 1024.0)
    }
}

impl Drop for RssSampler {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn unix_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or_default()
}

/// `YYYYMMDD-HHMMSS` in UTC, for directory names that sort by time.
fn utc_stamp(t: SystemTime) -> String {
    let secs = t
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Howard Hinnant's days-to-civil algorithm (proleptic Gregorian calendar).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}{month:02}{day:02}-{:02}{:02}{:02}",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

// ---- the daemon's API, as the benchmark uses it ----

/// What every measurement needs to create, use and delete sandboxes; cheap to clone into
/// tasks.
#[derive(Debug, Clone)]
struct Api {
    client: Client,
    tracker: Arc<Tracker>,
    /// Lifetime of each sandbox, in seconds.
    timeout: u64,
    cancel: Cancel,
}

impl Api {
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

    async fn create(&self, req: &CreateSandboxRequest) -> anyhow::Result<Sandbox> {
        let sb = self
            .client
            .create_sandbox(req)
            .await
            .context("create sandbox")?;
        self.tracker.insert(&sb.id);
        Ok(sb)
    }

    async fn delete(&self, id: &str) -> anyhow::Result<()> {
        self.client
            .delete_sandbox(id)
            .await
            .with_context(|| format!("delete sandbox {id}"))?;
        self.tracker.remove(id);
        Ok(())
    }

    /// Deletes all of `ids`, `parallel` at a time; the first error, after trying them all.
    async fn delete_all(
        &self,
        ids: &[String],
        parallel: usize,
        label: &'static str,
    ) -> anyhow::Result<()> {
        use futures::StreamExt;
        let progress = Progress::new(label, ids.len());
        let mut done = 0;
        let mut first_err = None;
        // No cancel check here: deleting is the cleanup.
        let mut deletes = futures::stream::iter(ids.iter().map(|id| self.delete(id)))
            .buffer_unordered(parallel.max(1));
        while let Some(r) = deletes.next().await {
            done += 1;
            progress.set(done);
            if let Err(e) = r {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
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

    /// Create, then the first `true`: the sandbox and the time to the end of `true`; the
    /// sandbox is left for the caller to delete (also when `true` failed).
    async fn create_first_exec(
        &self,
        req: &CreateSandboxRequest,
    ) -> anyhow::Result<(Sandbox, Duration, anyhow::Result<()>)> {
        let t = Instant::now();
        let sb = self.create(req).await?;
        let ran = self.run_true(&sb.id).await;
        Ok((sb, t.elapsed(), ran))
    }
}

// ---- the run ----

/// One benchmark run.
struct Bench {
    api: Api,
    phases: BTreeSet<Phase>,
    iterations: usize,
    /// Idle set sizes, ascending, none 0.
    idle: Vec<usize>,
    idle_concurrency: usize,
    concurrency: usize,
    sustained: Duration,
    workers: usize,
    pool_size: u32,
    pool_name: String,
    /// Whether the pool may exist on the daemon (and so must be deleted).
    pool_created: AtomicBool,
    /// Timed runs of the agents phase.
    agent_runs: usize,
    /// Followers of one run in the agents phase.
    followers: usize,
    /// The host's harness installs (for the agents phase).
    harness_dir: PathBuf,
    /// How the e2b phase reaches the daemon through E2B's SDK.
    e2b: Option<E2bSdk>,
}

/// The daemon's URL and key, and the Python that has E2B's SDK.
struct E2bSdk {
    url: String,
    key: String,
    python: PathBuf,
}

impl Bench {
    /// Runs the chosen measurements; a failed sandpit measurement leaves nulls and a note and
    /// is counted, an interrupt ends the run.
    async fn run_all(&self) -> anyhow::Result<(Report, usize)> {
        let mut report = Report::default();
        let mut failed = 0usize;
        let on = |p: Phase| self.phases.contains(&p);

        let url = self.api.client.base_url();
        let daemon = match (url.host_str(), url.port_or_known_default()) {
            (Some(host), Some(port)) => proc::locate_daemon(host, port),
            _ => Err(format!("no host and port in {url}")),
        };
        report.set("daemon.rss_idle_mb", None);
        match &daemon {
            Ok(pid) => {
                report.daemon_pid = Some(*pid);
                report.set(
                    "daemon.rss_idle_mb",
                    proc::vm_rss_kb(*pid).map(|kb| kb as f64 / 1024.0),
                );
                // Allocators rarely hand memory back: a daemon that has served a load
                // before keeps some of that RSS.
                report.note(
                    "daemon.rss_idle_mb",
                    "VmRSS of the daemon when this run started: its idle size only if it had \
                     served no load before (start a fresh daemon for that figure)",
                );
            }
            Err(reason) => report.note("daemon.rss_idle_mb", reason.clone()),
        }
        let daemon = daemon.ok();

        // Baselines first, while no sandbox exists to compete with them.
        if on(Phase::Baselines) {
            self.baselines(&mut report).await?;
        }

        let mut phase = |report: &mut Report, name: &str, r: anyhow::Result<()>| {
            if let Err(e) = r {
                if self.api.cancel.is_set() {
                    return Err(e);
                }
                eprintln!("error: {name}: {e:#}");
                report.note(name, format!("failed: {e:#}"));
                failed += 1;
            }
            Ok(())
        };
        if on(Phase::Cold) {
            let r = self.cold(&mut report).await;
            phase(&mut report, "cold_first_exec", r)?;
        }
        if on(Phase::Pool) {
            let r = self.pool(&mut report).await;
            // The pool keeps refilling while it exists; nothing after may compete with that.
            let deleted = self.delete_pool().await;
            phase(&mut report, "pool_first_exec", r.and(deleted))?;
        }
        if on(Phase::Exec) {
            let r = self.exec_rtt(&mut report).await;
            phase(&mut report, "exec_rtt", r)?;
        }
        // The daemon's peak RSS "under load" is that of the two phases meant as load.
        let sampler = daemon
            .filter(|_| on(Phase::Concurrent) || on(Phase::Sustained))
            .map(RssSampler::start);
        if on(Phase::Concurrent) {
            let r = self.concurrent(&mut report).await;
            phase(&mut report, "concurrent_first_exec", r)?;
        }
        if on(Phase::Sustained) {
            let r = self.sustained(&mut report).await;
            phase(&mut report, "sustained", r)?;
        }
        if let Some(s) = sampler {
            report.set("daemon.rss_load_peak_mb", s.peak_mb());
        }
        // Density before the file test, whose 100 MiB through a tmpfs and the page cache
        // would disturb the host-wide memory figures.
        if on(Phase::Memory) {
            if on(Phase::Baselines)
                && let Some(&n) = self.idle.first()
            {
                // Per-sandbox figures: 100 are plenty, whatever sizes the sandboxes get.
                let r = self.idle_bwrap(&mut report, n.min(100)).await;
                phase(&mut report, "baseline.idle_bwrap", r)?;
            }
            for &n in &self.idle {
                let r = self.idle(&mut report, n, daemon).await;
                phase(&mut report, &format!("idle.{n}"), r)?;
            }
            if self.idle.is_empty() {
                report.note("idle", "skipped (--idle 0)");
            }
        }
        if on(Phase::Files) {
            let r = self.file_io(&mut report).await;
            phase(&mut report, "file_io", r)?;
        }
        if on(Phase::Lifecycle) {
            let r = self.lifecycle(&mut report).await;
            phase(&mut report, "lifecycle", r)?;
        }
        if on(Phase::Network) {
            let r = self.network(&mut report).await;
            phase(&mut report, "net", r)?;
        }
        if on(Phase::Proxy) {
            let r = self.proxy(&mut report).await;
            phase(&mut report, "proxy_request", r)?;
        }
        if on(Phase::E2b) {
            let r = self.e2b(&mut report).await;
            phase(&mut report, "e2b_sdk_create_first_exec", r)?;
        }
        if on(Phase::Agents) {
            let r = self.agents(&mut report).await;
            phase(&mut report, "agent_first_event", r)?;
        }

        for &n in &self.idle {
            if report
                .figures
                .contains_key("baseline.idle_bwrap.per_sandbox_mb")
            {
                report.set_ratio(
                    &format!("idle_{n}_vs_bwrap"),
                    &format!("idle.{n}.per_sandbox_mb"),
                    "baseline.idle_bwrap.per_sandbox_mb",
                );
                report.set_ratio(
                    &format!("idle_{n}_agent_rss_vs_bwrap"),
                    &format!("idle.{n}.agent_rss_median_mb"),
                    "baseline.idle_bwrap.rss_mb",
                );
                report.set_ratio(
                    &format!("idle_{n}_agent_pss_vs_bwrap"),
                    &format!("idle.{n}.agent_pss_median_mb"),
                    "baseline.idle_bwrap.pss_mb",
                );
            }
        }
        for (name, a, b) in [
            (
                "pool_vs_crun_run",
                "pool_first_exec.p50_ms",
                "baseline.crun_run.p50_ms",
            ),
            (
                "pool_vs_fork_exec",
                "pool_first_exec.p50_ms",
                "baseline.fork_exec.p50_ms",
            ),
            (
                "cold_vs_crun_run",
                "cold_first_exec.p50_ms",
                "baseline.crun_run.p50_ms",
            ),
            (
                "cold_vs_crun_run_net",
                "cold_first_exec.p50_ms",
                "baseline.crun_run_net.p50_ms",
            ),
            (
                "cold_vs_unshare",
                "cold_first_exec.p50_ms",
                "baseline.unshare.p50_ms",
            ),
            (
                "cold_vs_bwrap",
                "cold_first_exec.p50_ms",
                "baseline.bwrap.p50_ms",
            ),
            (
                "cold_vs_runsc_ptrace",
                "cold_first_exec.p50_ms",
                "baseline.runsc_ptrace.p50_ms",
            ),
            (
                "concurrent_vs_crun_run_concurrent",
                "concurrent_first_exec.p95_ms",
                "baseline.crun_run_concurrent.p95_ms",
            ),
            (
                "concurrent_wall_vs_crun",
                "concurrent.wall_ms",
                "baseline.crun_run_concurrent.wall_ms",
            ),
            (
                "sustained_vs_crun",
                "sustained.cycles_per_s",
                "baseline.crun_run_concurrent.per_s",
            ),
            (
                "exec_vs_fork_exec",
                "exec_rtt.p50_ms",
                "baseline.fork_exec.p50_ms",
            ),
            (
                "agent_first_event_vs_pi_exec",
                "agent_first_event.p50_ms",
                "baseline.pi_version_exec.p50_ms",
            ),
            (
                "agent_first_event_vs_pi_fork_exec",
                "agent_first_event.p50_ms",
                "baseline.pi_version_fork_exec.p50_ms",
            ),
            (
                "agent_fanout_vs_single",
                "agent_fanout.wall_ms",
                "agent_single.wall_ms",
            ),
            (
                "agent_fanout_lag_vs_single",
                "agent_fanout_lag.p95_ms",
                "agent_single_lag.p95_ms",
            ),
        ] {
            if report.figures.contains_key(a) {
                report.set_ratio(name, a, b);
            }
        }
        Ok((report, failed))
    }

    async fn baselines(&self, report: &mut Report) -> anyhow::Result<()> {
        let cancel = self.api.cancel.clone();
        let (n, c) = (self.iterations, self.concurrency);
        let b = tokio::task::spawn_blocking(move || baselines::measure(n, c, &cancel))
            .await
            .context("the baseline thread failed")?;
        self.api.cancel.check()?;
        for (prefix, samples) in b.dists {
            if let Err(reason) = &samples {
                // Visible also with --json, where the notes go to stdout only.
                eprintln!("note: {prefix} not measured: {reason}");
            }
            report.set_dist(prefix, samples);
        }
        for (key, value) in b.values {
            report.set(key, Some(value));
        }
        for (key, text) in b.notes {
            report.note(key, text);
        }
        if let (Some(run), Some(wrapper)) = (
            report.get("baseline.crun_run.p50_ms"),
            report.get("baseline.unshare_wrapper.p50_ms"),
        ) {
            report.set("baseline.crun_run_net.p50_ms", Some(run - wrapper));
        }
        Ok(())
    }

    /// Deletes the warm pool if this run may have created it; the pool's sandboxes go with
    /// it on the daemon's side.
    async fn delete_pool(&self) -> anyhow::Result<()> {
        if !self.pool_created.load(Ordering::SeqCst) {
            return Ok(());
        }
        match self.api.client.delete_pool(&self.pool_name).await {
            Ok(()) => {}
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(anyhow!("delete pool {}: {e}", self.pool_name)),
        }
        self.pool_created.store(false, Ordering::SeqCst);
        Ok(())
    }

    /// Deletes whatever the run left: the pool, the sandboxes it knows of, then any carrying
    /// its label (a create cut short by a second interrupt may have succeeded on the daemon's
    /// side). Returns what it could not delete.
    async fn cleanup(&self) -> Vec<String> {
        let mut left = BTreeSet::new();
        if let Err(e) = self.delete_pool().await {
            eprintln!("warning: {e:#}");
            left.insert(format!("pool {}", self.pool_name));
        }
        let client = &self.api.client;
        for id in self.api.tracker.take() {
            if let Err(e) = client.delete_sandbox(&id).await
                && !e.is_not_found()
            {
                eprintln!("warning: cannot delete sandbox {id}: {e}");
                left.insert(id);
            }
        }
        let label = [(LABEL.to_string(), self.api.tracker.run.clone())];
        for pass in 0..3 {
            if pass > 0 {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            let mut found = Vec::new();
            let mut cursor: Option<String> = None;
            loop {
                match client
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
                match client.delete_sandbox(&id).await {
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: BenchArgs,
    }

    #[test]
    fn arguments() {
        let a = Cli::try_parse_from(["x"]).unwrap().args;
        assert_eq!(a.idle, vec![100]);
        assert!(a.only.is_empty());
        assert_eq!((a.concurrency, a.sustained_secs, a.workers), (50, 30, 8));

        let a = Cli::try_parse_from([
            "x",
            "--idle",
            "100,1000",
            "--only",
            "cold,pool,memory",
            "--sustained-secs",
            "5",
        ])
        .unwrap()
        .args;
        assert_eq!(a.idle, vec![100, 1000]);
        assert_eq!(a.only, vec![Phase::Cold, Phase::Pool, Phase::Memory]);
        assert_eq!(a.sustained_secs, 5);

        assert!(Cli::try_parse_from(["x", "--only", "cold,warp"]).is_err());
        assert!(Cli::try_parse_from(["x", "--idle", "many"]).is_err());
    }

    #[test]
    fn phase_names_round_trip() {
        use clap::ValueEnum;
        for p in Phase::ALL {
            assert_eq!(Phase::from_str(p.name(), false), Ok(p));
        }
    }

    #[test]
    fn utc_stamps() {
        assert_eq!(utc_stamp(UNIX_EPOCH), "19700101-000000");
        let t = UNIX_EPOCH + Duration::from_secs(1_709_251_199); // 2024-02-29 23:59:59
        assert_eq!(utc_stamp(t), "20240229-235959");
        let t = UNIX_EPOCH + Duration::from_secs(951_782_400); // 2000-02-29 00:00:00
        assert_eq!(utc_stamp(t), "20000229-000000");
    }
}
