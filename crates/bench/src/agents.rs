//! The agent-run phase: a real harness (pi, from `scripts/setup.sh --harnesses`) driven by
//! the daemon against the scripted model server `sandpit-modelsim`, which listens in a
//! network namespace of the benchmark's own (a veth link and a route to one documentation
//! address that the sandbox's allow-list names; nothing leaves the machine). The address
//! and link come from one of the slices the end-to-end tests use (`crates/tests`
//! `netfix.rs`), taken under the same lock, so that a benchmark beside running tests never
//! shares their addresses.
//!
//! Figures: run start -> first stored event and -> first event a follower sees, beside the
//! same harness command (`pi --version`) started through the exec API and by fork+exec on
//! the host; 100 followers of one run against one follower (wall time and delivery lag);
//! events stored per second by a run of many small tool calls.

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, anyhow, bail};
use sandpit_api::{CreateAgentRequest, LimitsSpec, RunCommandRequest, StartRunRequest};
use sandpit_client::Client;
use serde_json::{Value, json};

use super::report::Report;
use super::{Bench, Progress, TempDir, ms};

/// The port the model server listens on.
const MODEL_PORT: u16 = 8080;
/// Address slices of 203.0.113.0/24 (16 addresses each) the tests and the benchmark share.
const SLICES: u8 = 16;
/// Where those slices are locked.
const SLICE_LOCKS: &str = "/run/sandpit-tests";
/// Where the daemon binds the host's harnesses in a `host` sandbox.
const HARNESS_MOUNT: &str = "/opt/sandpit/harnesses";
/// How long one run may take before the phase gives up on it.
const RUN_LIMIT: Duration = Duration::from_secs(180);
/// Turns and tool calls per turn of the many-events run.
const MANY_TURNS: usize = 20;
const MANY_CALLS: usize = 5;
/// Turns of the fan-out run (each one tool call), after a first turn held long enough
/// for every follower to connect.
const FANOUT_TURNS: usize = 5;
const FANOUT_HOLD_MS: u64 = 2000;

/// The build tree's harness installs, where `scripts/setup.sh --harnesses` puts them.
pub(super) fn default_harness_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.deps/harnesses")
}

/// Why the phase cannot run here, if it cannot: the harnesses, the model server binary
/// or the `ip` tool missing.
fn skip_reason(harness_dir: &Path, modelsim: &Path) -> Option<String> {
    if !harness_dir.join("node_modules/.bin/pi").exists() {
        return Some(format!(
            "skipped: the harnesses are not installed ({} has no node_modules/.bin/pi; run \
             scripts/setup.sh --harnesses, or pass --harness-dir)",
            harness_dir.display()
        ));
    }
    if !modelsim.exists() {
        return Some(format!(
            "skipped: {} is missing (cargo build -p sandpit-modelsim)",
            modelsim.display()
        ));
    }
    if Command::new("ip")
        .arg("-V")
        .output()
        .map(|o| !o.status.success())
        .unwrap_or(true)
    {
        return Some("skipped: the `ip` tool (iproute2) is missing".into());
    }
    None
}

fn now_ms() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64() * 1e3)
        .unwrap_or_default()
}

fn ip(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("ip").args(args).output().context("run ip")?;
    if !out.status.success() {
        bail!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// The benchmark's model network: a namespace, its link and route, and the model server
/// in it; all removed when dropped.
struct ModelNet {
    ns: String,
    link: String,
    slice: u8,
    modelsim: PathBuf,
    server: Option<Child>,
    /// Script and server log.
    _dir: TempDir,
    /// The slice's lock, held while the namespace exists.
    _lock: nix::fcntl::Flock<std::fs::File>,
}

/// A free address slice and its lock.
fn lock_slice() -> anyhow::Result<(u8, nix::fcntl::Flock<std::fs::File>)> {
    std::fs::create_dir_all(SLICE_LOCKS).with_context(|| format!("create {SLICE_LOCKS}"))?;
    for s in (0..SLICES).rev() {
        let path = format!("{SLICE_LOCKS}/upstream-{s}.lock");
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .with_context(|| format!("open {path}"))?;
        if let Ok(lock) = nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusiveNonblock) {
            return Ok((s, lock));
        }
    }
    bail!("all {SLICES} test address slices are in use (tests are running?)")
}

impl ModelNet {
    /// Makes the namespace (the model server is started by [`ModelNet::serve`]).
    fn start(modelsim: &Path) -> anyhow::Result<ModelNet> {
        let (slice, lock) = lock_slice()?;
        let tag = std::process::id() % 100_000;
        let net = ModelNet {
            ns: format!("spbench{tag}"),
            link: format!("spbv{tag}"),
            slice,
            modelsim: modelsim.to_path_buf(),
            server: None,
            _dir: TempDir::new("model")?,
            _lock: lock,
        };
        let (link_host, link_ns) = (format!("198.18.{slice}.1"), format!("198.18.{slice}.2"));
        let model_ip = net.ip();
        // Partly made is removed by Drop, like whole.
        ip(&["netns", "add", &net.ns])?;
        ip(&[
            "link", "add", &net.link, "type", "veth", "peer", "name", "eth0", "netns", &net.ns,
        ])?;
        ip(&["addr", "add", &format!("{link_host}/30"), "dev", &net.link])?;
        ip(&["link", "set", &net.link, "up"])?;
        let ns = net.ns.clone();
        let inside = |args: &[&str]| {
            let mut a = vec!["-n", ns.as_str()];
            a.extend_from_slice(args);
            ip(&a)
        };
        inside(&["addr", "add", &format!("{link_ns}/30"), "dev", "eth0"])?;
        inside(&["link", "set", "eth0", "up"])?;
        inside(&["link", "set", "lo", "up"])?;
        inside(&["addr", "add", &format!("{model_ip}/32"), "dev", "lo"])?;
        inside(&["route", "add", "default", "via", &link_host])?;
        ip(&[
            "route",
            "add",
            &format!("{model_ip}/32"),
            "via",
            &link_ns,
            "dev",
            &net.link,
        ])?;
        Ok(net)
    }

    /// (Re)starts the model server, answering from `script`.
    fn serve(&mut self, script: &Value) -> anyhow::Result<()> {
        self.stop_server();
        let script_path = self._dir.path().join("script.json");
        std::fs::write(&script_path, script.to_string())
            .with_context(|| format!("write {}", script_path.display()))?;
        let mut child = Command::new("ip")
            .args(["netns", "exec", &self.ns])
            .arg(&self.modelsim)
            .args(["--listen", &format!("{}:{MODEL_PORT}", self.ip())])
            .arg("--script")
            .arg(&script_path)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("start {}", self.modelsim.display()))?;
        let stdout = child.stdout.take();
        self.server = Some(child);
        let mut line = String::new();
        if let Some(out) = stdout {
            std::io::BufReader::new(out)
                .read_line(&mut line)
                .context("read the model server's first line")?;
        }
        if !line.contains("listening") {
            bail!("the model server did not start: {:?}", line.trim());
        }
        Ok(())
    }

    fn stop_server(&mut self) {
        if let Some(mut c) = self.server.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The model server's address: the last of the slice, which the tests' fixtures
    /// leave alone.
    fn ip(&self) -> String {
        format!("203.0.113.{}", u16::from(self.slice) * 16 + 15)
    }

    fn url(&self) -> String {
        format!("http://{}:{MODEL_PORT}/v1", self.ip())
    }
}

impl Drop for ModelNet {
    fn drop(&mut self) {
        self.stop_server();
        // The namespace takes its end of the link, the link takes its route.
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).output();
        let _ = Command::new("ip")
            .args(["link", "del", &self.link])
            .output();
    }
}

/// One run of a follower: when each event arrived (wall clock, ms) and its stored time.
struct Followed {
    /// When the follower started reading (wall clock, ms).
    connected_ms: f64,
    /// (seq, stored at_ms, received wall ms).
    events: Vec<(i64, f64, f64)>,
    /// When the follower saw the end of the run.
    ended: Instant,
}

/// Reads run `id` to its end with `client`'s follow API.
async fn follow(client: Client, id: String) -> anyhow::Result<Followed> {
    let connected_ms = now_ms();
    let mut f = client.follow_run(&id, 0);
    let mut events = Vec::new();
    while let Some(e) = tokio::time::timeout(RUN_LIMIT, f.next_event())
        .await
        .map_err(|_| anyhow!("run {id}: no event for {} s", RUN_LIMIT.as_secs()))?
        .with_context(|| format!("follow run {id}"))?
    {
        events.push((e.seq, e.at_ms as f64, now_ms()));
    }
    Ok(Followed {
        connected_ms,
        events,
        ended: Instant::now(),
    })
}

/// The delivery lags (received minus stored) of events stored after the follower
/// connected; earlier ones came as a replay and say nothing about fan-out.
fn live_lags(f: &Followed) -> impl Iterator<Item = f64> + '_ {
    f.events
        .iter()
        .filter(move |(_, at, _)| *at >= f.connected_ms)
        .map(|(_, at, got)| (got - at).max(0.0))
}

/// A script of `turns` turns with `calls` harmless tool calls each, then `done`; the
/// first turn held `hold_ms`.
fn tool_script(turns: usize, calls: usize, hold_ms: u64) -> Value {
    let mut all: Vec<Value> = (0..turns)
        .map(|i| {
            let calls: Vec<Value> = (0..calls)
                .map(|j| json!({"name": "bash", "arguments": {"command": format!("echo {i}.{j}")}}))
                .collect();
            json!({"text": format!("step {i}"), "tool_calls": calls})
        })
        .collect();
    all.push(json!({"text": "done"}));
    if hold_ms > 0
        && let Some(first) = all.first_mut()
    {
        first["delay_ms"] = json!(hold_ms);
    }
    json!({"turns": all})
}

impl Bench {
    /// The agent-run phase (see the module's doc).
    pub(super) async fn agents(&self, report: &mut Report) -> anyhow::Result<()> {
        report.declare_dist("agent_first_event");
        report.declare_dist("agent_first_event_follower");
        let modelsim = std::env::current_exe()
            .context("the benchmark's own path")?
            .with_file_name("sandpit-modelsim");
        if let Some(why) = skip_reason(&self.harness_dir, &modelsim) {
            eprintln!("note: agents: {why}");
            report.note("agent_first_event", why);
            return Ok(());
        }
        let n = self.agent_runs.max(1);
        let mut net = ModelNet::start(&modelsim)?;
        // A fresh run starts at turn 0 of the script, so one script serves every run of a
        // kind; each kind gets the server restarted with its own.
        net.serve(&json!({"turns": [{"text": "done"}]}))?;
        let sb = self.agent_sandbox(&net).await?;
        let result = async {
            let Some(rt) = self.agent_runtime(&sb, &net, report).await? else {
                return Ok(());
            };
            self.first_event(report, &sb, &rt, n).await?;
            net.serve(&tool_script(FANOUT_TURNS, 1, FANOUT_HOLD_MS))?;
            self.fan_out(report, &rt).await?;
            net.serve(&tool_script(MANY_TURNS, MANY_CALLS, 0))?;
            self.many_events(report, &rt).await?;
            anyhow::Ok(())
        }
        .await;
        let deleted = self.api.delete(&sb).await;
        result?;
        deleted
    }

    /// A `host` sandbox allowed to reach the model server only.
    async fn agent_sandbox(&self, net: &ModelNet) -> anyhow::Result<String> {
        let mut req = self.api.request(LimitsSpec {
            memory_bytes: Some(1 << 30),
            ..Default::default()
        });
        req.network = Some(
            serde_json::from_value(json!({"mode": "allowlist", "rules": [
                {"action": "allow", "cidr": format!("{}/32", net.ip()), "ports": [MODEL_PORT]}]}))
            .context("the sandbox's network policy")?,
        );
        Ok(self.api.create(&req).await?.id)
    }

    /// A pi runtime in `sb`; `None` (and a note) when the daemon has no harnesses.
    async fn agent_runtime(
        &self,
        sb: &str,
        net: &ModelNet,
        report: &mut Report,
    ) -> anyhow::Result<Option<String>> {
        let req: CreateAgentRequest = serde_json::from_value(json!({
            "harness": "pi", "model": {"base_url": net.url(), "model": "modelsim"}}))
        .context("the runtime request")?;
        match self.api.client.create_agent(sb, &req).await {
            Ok(rt) => Ok(Some(rt.id)),
            Err(e) if matches!(e.status(), Some(404 | 405 | 503)) => {
                let why = format!(
                    "skipped: the daemon runs no harness ({e}); give it `[agents] harness_dir`"
                );
                eprintln!("note: agents: {why}");
                report.note("agent_first_event", why);
                Ok(None)
            }
            Err(e) => Err(anyhow!("create a pi runtime in {sb}: {e}")),
        }
    }

    /// Starts a run of `rt` and returns its id and the instant before the request.
    async fn start(&self, rt: &str, task: &str) -> anyhow::Result<(String, Instant)> {
        let req = StartRunRequest {
            task: task.into(),
            mode: None,
            idempotency_key: None,
            timeout_secs: Some(RUN_LIMIT.as_secs()),
        };
        let t = Instant::now();
        let run = self
            .api
            .client
            .start_run(rt, &req)
            .await
            .with_context(|| format!("start a run of {rt}"))?;
        Ok((run.id, t))
    }

    /// `agent_first_event` (POST run -> first stored event, polled) and
    /// `agent_first_event_follower` (-> first event a follower reads), beside `pi
    /// --version` through the exec API and by fork+exec on the host.
    async fn first_event(
        &self,
        report: &mut Report,
        sb: &str,
        rt: &str,
        n: usize,
    ) -> anyhow::Result<()> {
        let client = &self.api.client;
        let pi = format!("{HARNESS_MOUNT}/node_modules/.bin/pi");
        let version = RunCommandRequest {
            argv: vec![pi, "--version".into()],
            ..Default::default()
        };
        let host_pi = self.harness_dir.join("node_modules/.bin/pi");
        let (mut stored, mut followed, mut exec, mut fork) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let progress = Progress::new("agent run -> first event", n);
        // One round first, untimed: the first start pays for cold caches (node's code,
        // the harness's files) that no later one sees.
        for i in 0..=n {
            self.api.cancel.check()?;
            let t = Instant::now();
            let out = client
                .run(sb, &version)
                .await
                .context("run `pi --version` in the sandbox")?;
            let exec_ms = ms(t.elapsed());
            if out.exit_code != 0 {
                bail!(
                    "`pi --version` exited with {}: {}",
                    out.exit_code,
                    out.stderr.trim()
                );
            }
            let t = Instant::now();
            let st = tokio::process::Command::new(&host_pi)
                .arg("--version")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .await
                .with_context(|| format!("run {} --version", host_pi.display()))?;
            let fork_ms = ms(t.elapsed());
            if !st.success() {
                bail!("{} --version exited with {st}", host_pi.display());
            }

            let (id, t0) = self.start(rt, "answer").await?;
            let follower = tokio::spawn({
                let (c, id) = (client.clone(), id.clone());
                async move {
                    let mut f = c.follow_run(&id, 0);
                    let first = f.next_event().await;
                    let at = Instant::now();
                    // Read to the end, so that the next run starts on an idle runtime.
                    while let Ok(Some(_)) = f.next_event().await {}
                    first.map(|e| e.map(|_| at))
                }
            });
            let first_stored = loop {
                let page = client
                    .run_events(&id, 0, Some(1))
                    .await
                    .with_context(|| format!("events of run {id}"))?;
                if !page.events.is_empty() {
                    break Instant::now();
                }
                if t0.elapsed() > RUN_LIMIT {
                    bail!("run {id} stored no event in {} s", RUN_LIMIT.as_secs());
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            };
            let first_seen = tokio::time::timeout(RUN_LIMIT, follower)
                .await
                .map_err(|_| anyhow!("run {id} did not end in {} s", RUN_LIMIT.as_secs()))?
                .context("the follower task")?
                .with_context(|| format!("follow run {id}"))?
                .ok_or_else(|| anyhow!("run {id} ended without an event"))?;
            let run = client.get_run(&id).await.context("get run")?;
            if run.state != "succeeded" {
                bail!("run {id} ended {}: {:?}", run.state, run.reason);
            }
            if i > 0 {
                stored.push(ms(first_stored - t0));
                followed.push(ms(first_seen - t0));
                exec.push(exec_ms);
                fork.push(fork_ms);
            }
            progress.set(i);
        }
        drop(progress);
        report.set_dist("agent_first_event", Ok(stored));
        report.set_dist("agent_first_event_follower", Ok(followed));
        report.set_dist("baseline.pi_version_exec", Ok(exec));
        report.set_dist("baseline.pi_version_fork_exec", Ok(fork));
        report.note(
            "agent_first_event",
            "POST /v1/agents/{id}/runs -> the first event in GET /v1/runs/{id}/events (polled \
             every ms); _follower: -> the first event a follow_run reader got; baselines: \
             `pi --version` to its end through the exec API in the same sandbox, and by \
             fork+exec on the host",
        );
        Ok(())
    }

    /// `agent_fanout.*` and `agent_single.*`: one run read by `followers` followers at
    /// once, and one read by a single follower: from the start to the last follower
    /// having read the end, and each live event's delivery lag.
    async fn fan_out(&self, report: &mut Report, rt: &str) -> anyhow::Result<()> {
        report.set("agent_fanout.wall_ms", None);
        report.set("agent_single.wall_ms", None);
        report.declare_dist("agent_fanout_lag");
        report.declare_dist("agent_single_lag");
        for (prefix, k) in [
            ("agent_single", 1usize),
            ("agent_fanout", self.followers.max(1)),
        ] {
            self.api.cancel.check()?;
            eprintln!("agent run read by {k} follower(s) ...");
            let (id, t0) = self.start(rt, "steps").await?;
            let tasks: Vec<_> = (0..k)
                .map(|_| tokio::spawn(follow(self.api.client.clone(), id.clone())))
                .collect();
            let mut all = Vec::with_capacity(k);
            for t in tasks {
                all.push(t.await.context("a follower task")??);
            }
            let stored = self
                .api
                .client
                .run_events(&id, 0, Some(1000))
                .await
                .with_context(|| format!("events of run {id}"))?;
            let want: Vec<i64> = stored.events.iter().map(|e| e.seq).collect();
            for f in &all {
                let got: Vec<i64> = f.events.iter().map(|e| e.0).collect();
                if got != want {
                    bail!(
                        "a follower of run {id} read {} events, {} are stored",
                        got.len(),
                        want.len()
                    );
                }
            }
            let last = all.iter().map(|f| f.ended).max().unwrap_or(t0);
            let lags: Vec<f64> = all.iter().flat_map(live_lags).collect();
            report.set(&format!("{prefix}.wall_ms"), Some(ms(last - t0)));
            report.set(&format!("{prefix}.events"), Some(want.len() as f64));
            report.set_dist(&format!("{prefix}_lag"), Ok(lags));
        }
        report.note(
            "agent_fanout.wall_ms",
            format!(
                "POST run -> every one of {} concurrent followers (sandpit_client follow_run) \
                 has read the run's end; the run: {FANOUT_TURNS} turns of one tool call, the \
                 first answer held {FANOUT_HOLD_MS} ms so that all connect first; \
                 agent_single: the same run with one follower; _lag: received minus stored \
                 time of each event stored after its follower connected",
                self.followers
            ),
        );
        Ok(())
    }

    /// `agent_events.per_s`: events stored per second by a run of many small tool calls
    /// (first to last event's stored time).
    async fn many_events(&self, report: &mut Report, rt: &str) -> anyhow::Result<()> {
        report.set("agent_events.per_s", None);
        report.set("agent_events.count", None);
        self.api.cancel.check()?;
        eprintln!("agent run of {MANY_TURNS} turns x {MANY_CALLS} tool calls ...");
        let (id, t0) = self.start(rt, "many").await?;
        let f = follow(self.api.client.clone(), id.clone()).await?;
        let run = self.api.client.get_run(&id).await.context("get run")?;
        if run.state != "succeeded" {
            bail!("run {id} ended {}: {:?}", run.state, run.reason);
        }
        let (first, last) = match (f.events.first(), f.events.last()) {
            (Some(a), Some(b)) => (a.1, b.1),
            _ => bail!("run {id} stored no events"),
        };
        let count = f.events.len() as f64;
        let secs = (last - first) / 1e3;
        if secs > 0.0 {
            report.set("agent_events.per_s", Some(count / secs));
        }
        report.set("agent_events.count", Some(count));
        report.set("agent_events.run_ms", Some(ms(f.ended - t0)));
        report.note(
            "agent_events.per_s",
            format!(
                "events of one pi run ({MANY_TURNS} turns of {MANY_CALLS} `echo` tool calls) \
                 divided by the time from its first to its last stored event; bounded by the \
                 harness and the model round trips as much as by the store"
            ),
        );
        Ok(())
    }
}
